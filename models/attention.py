"""Grouped-query self-attention: projections, RoPE, logical constraints, the kernel call."""

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import kernels
from models.compute import ROTATED
from models.config import ModelConfig
from models.layers import Einsum, RMSNorm, project_shared, projection_kw
from models.rope import apply_rope, inverse_frequencies
from sharding import constrain, context_attention, shard_map_logical

Q_NAMES = ("batch", "seq", "act_heads", "head_dim")
KV_NAMES = ("batch", "seq", "act_kv_heads", "head_dim")

# A Pallas kernel is opaque to XLA's partitioner: it runs per device under shard_map (batch over
# the data axes, heads over `tensor`). It needs whole sequences: context parallelism (seq split)
# is refused with a clear error rather than silently attending within each shard. On CPU the
# kernel runs in the Pallas interpreter, which shard_map's varying-axes check cannot follow
# (see shard_map_logical); the check stays on wherever the kernel really compiles. One per layout
# and window: the kernel's block bounds are static.
@functools.cache
def flash_per_device(layout, window: int):
  """The Pallas flash kernel per device on the layout's mesh (sequences whole)."""
  return shard_map_logical(
      layout, lambda q, k, v, segment_ids: kernels.attention(q, k, v, segment_ids, causal=True,
                                                     impl="pallas_flash", window=window),
      (Q_NAMES, KV_NAMES, KV_NAMES, ("batch", "seq")), Q_NAMES, whole=("seq",),
      what="pallas_flash attention", check_vma_on_cpu=False)


def _whole_sequence(q, k, v, positions, segment_ids, *, impl: str, window: int):
  """What Ulysses runs between its all-to-alls: the model's kernel over whole sequences (their
  index order, which the Ulysses order keeps; positions are not needed)."""
  del positions
  return kernels.attention(q, k, v, segment_ids, causal=True, impl=impl, window=window)


def context_kernel(context_impl: str, impl: str):
  """The per-device context-parallel kernel of `context_impl` (sharding.context_attention gives
  it the axes); Ulysses wraps the attention `impl` this trace runs."""
  if context_impl == "ulysses":
    return functools.partial(kernels.ulysses_attention,
                             attend=functools.partial(_whole_sequence, impl=impl))
  if context_impl == "ring" and impl in ("pallas_flash", "cudnn"):  # a flash kernel per hop
    return kernels.ring_flash_attention
  return {"ring": kernels.ring_attention, "allgather": kernels.allgather_attention,
          "ulysses_ring": kernels.ulysses_ring_attention}[context_impl]


class Attention(nnx.Module):
  """Llama attention: q/k/v column-split over heads, o row-split; K/V shared by head groups."""

  def __init__(self, cfg: ModelConfig, compute, layout, *, rngs: nnx.Rngs):
    d, h, k, dh = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    kw = projection_kw(cfg, compute, layout, rngs, "attention")
    self.q = Einsum((d, h, dh), ("embed", "heads", "head_dim"), (0,), **kw)
    self.k = Einsum((d, k, dh), ("embed", "kv_heads", "head_dim"), (0,), **kw)
    self.v = Einsum((d, k, dh), ("embed", "kv_heads", "head_dim"), (0,), **kw)
    self.o = Einsum((h, dh, d), ("heads", "head_dim", "embed"), (0, 1), **kw)
    norm = dict(param_dtype=cfg.param_dtype, dtype=cfg.dtype)
    self.q_norm = RMSNorm(dh, cfg.norm_eps, **norm) if cfg.qk_norm else None
    self.k_norm = RMSNorm(dh, cfg.norm_eps, **norm) if cfg.qk_norm else None
    # Plain numbers (static), not arrays: the frequencies are a trace-time constant.
    self.rope = (dh, cfg.rope_theta, cfg.rope_scaling_factor, cfg.rope_low_freq_factor,
                 cfg.rope_high_freq_factor, cfg.rope_original_max_len)
    self.layout = layout  # the kernel (layout.attention) and the context split
    self.window = cfg.sliding_window
    self.remat, self.dtype = compute.remat, cfg.dtype  # the input's gather (models/layers.py)

  def project(self, x_BLD, positions_BL, input_amax=None):
    """q [B, L, H, d], k and v [B, L, K, d], QK-norm and RoPE applied. `input_amax`: as
    models/layers.py Einsum's."""
    # One gather for q, k and v (models/layers.py): in fp8 when tensorwise, else in bf16 for
    # layers that recompute.
    q, k, v = project_shared(self.layout, (self.q, self.k, self.v),
                             ("BLD,DHd->BLHd", "BLD,DKd->BLKd", "BLD,DKd->BLKd"),
                             (Q_NAMES, KV_NAMES, KV_NAMES), x_BLD, self.remat != "none",
                             input_amax)
    if self.q_norm is not None:  # QK-norm (Qwen3), per head over the head dim
      q, k = self.q_norm(q), self.k_norm(k)
    inv_freq = inverse_frequencies(*self.rope)
    q, k = apply_rope(q, positions_BL, inv_freq), apply_rope(k, positions_BL, inv_freq)
    if self.q_norm is None:
      # The kernel's q and k, kept under remat="none" and "selective" (models/compute.py) in
      # place of the projections' outputs, which only RoPE read: the same bytes, and the
      # backward runs no RoPE again to rebuild the kernel's inputs. With QK-norm the norms'
      # backward reads the projections' outputs, so keeping these too would add their size.
      q, k = checkpoint_name(q, ROTATED), checkpoint_name(k, ROTATED)
    return q, k, v

  def attend(self, q, k, v, positions_BL, segment_ids_BL, window=None):
    """The kernel over projected q, k, v, then the output projection: [B, L, D]. `window`: this
    layer's sliding window (0: full attention); None: the model's."""
    window = self.window if window is None else window
    layout, impl = self.layout, self.layout.attention
    if layout.sequence_axes:  # context parallelism: each device holds a part of the sequence
      segments = jnp.ones_like(positions_BL) if segment_ids_BL is None else segment_ids_BL
      out = context_attention(layout, context_kernel(layout.context_impl, impl), q, k, v,
                              positions_BL, segments, window=window,
                              check_vma_on_cpu=impl != "pallas_flash" or
                              layout.context_impl not in ("ulysses", "ring"))
    elif impl == "pallas_flash":
      out = flash_per_device(layout, window)(q, k, v, segment_ids_BL)
    else:
      out = kernels.attention(q, k, v, segment_ids_BL, causal=True, impl=impl, window=window)
    out = constrain(out, Q_NAMES)
    # Its gradient gathered once for both of o's backward dots (Einsum's gather_gradient).
    return self.o("BLHd,HdD->BLD", out, gather_gradient=True)

  def __call__(self, x_BLD: jax.Array, positions_BL: jax.Array, segment_ids_BL,
               window=None, input_amax=None) -> jax.Array:
    q, k, v = self.project(x_BLD, positions_BL, input_amax)
    return self.attend(q, k, v, positions_BL, segment_ids_BL, window)
