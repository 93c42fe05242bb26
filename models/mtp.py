"""DeepSeek-V3's multi-token prediction (arXiv:2412.19437, sec. 2.2): `mtp_depth` modules run one
after another on the main model's last hidden states; module k predicts, at position i, the token
t_{i+k+1}, sharing the model's embedding and output head. Training only: the logits never use it.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from models.compute import REMAT_POLICIES
from models.config import ModelConfig
from models.layers import RESIDUAL, Einsum, RMSNorm
from sharding import constrain


class MTPModule(nnx.Module):
  """Depth k: h'_i = M [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)], h^k = block(h'), and
  RMSNorm_k(h^k) for the shared head.

  `block` is the class of the model's last layers (models/transformer.py: MoEBlock for a MoE,
  else DecoderBlock), causal with the main model's positions and documents. The concatenation
  puts the embedding first, as DeepSeek-V3's checkpoints (`eh_proj` after `enorm`, `hnorm`) do;
  the paper writes the hidden state first, which is the same model with M's halves swapped.
  """

  def __init__(self, cfg: ModelConfig, compute, layout, *, block, rngs: nnx.Rngs):
    kw = dict(param_dtype=cfg.param_dtype, dtype=cfg.dtype)
    d = cfg.embed_dim
    self.embed_norm = RMSNorm(d, cfg.norm_eps, **kw)
    self.hidden_norm = RMSNorm(d, cfg.norm_eps, **kw)
    # M [2D, D]: both dims are model-width, so both are `embed` (FSDP splits the first; a mesh
    # axis splits one dim of an array at most).
    self.proj = Einsum((2 * d, d), ("embed", "embed"), (0,), rngs=rngs,
                       tokens_split=layout.tokens_split, **kw)
    self.block = block(cfg, compute, layout, rngs=rngs)
    self.out_norm = RMSNorm(d, cfg.norm_eps, **kw)

  def __call__(self, h_BLD, e_BLD, positions_BL, segment_ids_BL):
    """(h^k [B, L, D] for the next depth, RMSNorm_k(h^k) for the head, the block's routing stats
    or None)."""
    x = jnp.concatenate([self.embed_norm(e_BLD), self.hidden_norm(h_BLD)], axis=-1)
    x = constrain(self.proj("BLC,CD->BLD", x), RESIDUAL)
    out = self.block(x, positions_BL, segment_ids_BL)
    h, stats = out if isinstance(out, tuple) else (out, None)
    return h, self.out_norm(h), stats


def run(modules, embeddings, h_BLD, positions_BL, segment_ids_BL, remat: str):
  """The stacked modules (leading dim: depth) one after another.

  Args:
    modules: MTPModule weights stacked on a leading `mtp_layers` dim of the depth D.
    embeddings: D embedded inputs [B, L, D]: for depth k, those of the tokens k positions ahead.
    h_BLD: the main model's last hidden states, before its final norm.
    positions_BL, segment_ids_BL: as for the main model.
    remat: the run's remat policy (compute.remat), applied to each module as to a layer.
  Returns:
    (D head inputs [B, L, D], D routing stats or Nones).
  """
  graphdef, stacked = nnx.split(modules)

  def depth(h, e, state):
    return nnx.merge(graphdef, state)(h, e, positions_BL, segment_ids_BL)

  # remat="none" runs the module as plain autodiff (it keeps a little more than a layer would):
  # under a pipeline's last stage with dropless experts, its checkpoint policy made Shardy
  # refuse the expert region (tests/test_mtp.py, slow; broken since 5f4eb53, found 2026-11-26).
  if remat != "none":
    depth = jax.checkpoint(depth, policy=REMAT_POLICIES[remat])
  heads, stats = [], []
  for k, e in enumerate(embeddings):  # D is small (DeepSeek-V3: 1): unrolled
    h_BLD, normed, s = depth(h_BLD, e, jax.tree.map(lambda a, k=k: a[k], stacked))
    heads.append(normed)
    stats.append(s)
  return heads, stats
