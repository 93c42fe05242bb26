"""Multi-head latent attention (DeepSeek-V2/V3): queries and keys/values from low-rank latents."""

import jax.numpy as jnp
from flax import nnx

from models.attention import KV_NAMES, Q_NAMES, Attention
from models.config import ModelConfig
from models.layers import Einsum, RMSNorm, projection_kw
from models.rope import apply_rope, inverse_frequencies
from sharding import constrain

LATENT = ("batch", "seq", "latent")
# DeepSeek's latent norms keep RMSNorm's default epsilon whatever the model's (its reference code
# and transformers' DeepseekV3Attention both build them without the config's rms_norm_eps).
LATENT_NORM_EPS = 1e-6


class MLAttention(Attention):
  """MLA with the attention kernels of `Attention` (reference, flash, context parallel).

  q = q_b(norm(q_a(x))) (or q(x) without a query latent); [c_kv, k_rope] = kv_a(x), one matmul;
  [k_nope, v] = kv_b(norm(c_kv)) per head. Each head's query and key are [nope, rope] with RoPE
  on the rope part; the rope key is one head broadcast to all. Stored like the HF checkpoint but
  for the rope dims' order: ours rotate halves (models/rope.py), DeepSeek's interleaved pairs; the
  import permutes those weight columns (models/hf/deepseek.py), which leaves every q.k unchanged.
  """

  def __init__(self, cfg: ModelConfig, compute, layout, *,  # pylint: disable=super-init-not-called
               rngs: nnx.Rngs):
    m, d, h = cfg.mla, cfg.embed_dim, cfg.num_heads
    self.nope, self.rope_dim, self.latent_dim = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    kw = projection_kw(cfg, compute, layout, rngs, "attention")
    norm = dict(param_dtype=cfg.param_dtype, dtype=cfg.dtype)
    if m.q_lora_rank:
      self.q_a = Einsum((d, m.q_lora_rank), ("embed", "latent"), (0,), **kw)
      self.q_a_norm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS, **norm)
      self.q_b = Einsum((m.q_lora_rank, h, qk), ("latent_rank", "heads", "head_dim"), (0,), **kw)
      self.q = None
    else:
      self.q_a = self.q_a_norm = self.q_b = None
      self.q = Einsum((d, h, qk), ("embed", "heads", "head_dim"), (0,), **kw)
    self.kv_a = Einsum((d, m.kv_lora_rank + m.qk_rope_head_dim), ("embed", "latent"), (0,), **kw)
    self.kv_a_norm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS, **norm)
    self.kv_b = Einsum((m.kv_lora_rank, h, m.qk_nope_head_dim + m.v_head_dim),
                       ("latent_rank", "heads", "head_dim"), (0,), **kw)
    self.o = Einsum((h, m.v_head_dim, d), ("heads", "head_dim", "embed"), (0, 1), **kw)
    self.rope = (m.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling_factor,
                 cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_len)
    self.layout, self.window = layout, cfg.sliding_window

  def project(self, x_BLD, positions_BL, input_amax=None):
    """q, k [B, L, H, nope + rope] and v [B, L, H, v_head_dim], RoPE applied. `input_amax`: as
    models/layers.py Einsum's."""
    if self.q is None:
      latent = constrain(self.q_a("BLD,DR->BLR", x_BLD, input_amax), LATENT)
      q = self.q_b("BLR,RHd->BLHd", self.q_a_norm(latent))
    else:
      q = self.q("BLD,DHd->BLHd", x_BLD, input_amax)
    q = constrain(q, Q_NAMES)
    compressed = constrain(self.kv_a("BLD,DR->BLR", x_BLD, input_amax), LATENT)
    latent, k_rope = compressed[..., :self.latent_dim], compressed[..., self.latent_dim:]
    kv = constrain(self.kv_b("BLR,RHd->BLHd", self.kv_a_norm(latent)), KV_NAMES)
    k_nope, v = kv[..., :self.nope], kv[..., self.nope:]
    inv_freq = inverse_frequencies(*self.rope)
    q_rope = apply_rope(q[..., self.nope:], positions_BL, inv_freq)
    k_rope = apply_rope(k_rope[:, :, None, :], positions_BL, inv_freq)
    q = jnp.concatenate([q[..., :self.nope], q_rope], axis=-1)
    k_rope = jnp.broadcast_to(k_rope, (*k_nope.shape[:3], self.rope_dim)).astype(k_nope.dtype)
    k = jnp.concatenate([k_nope, k_rope], axis=-1)
    return constrain(q, Q_NAMES), constrain(k, KV_NAMES), constrain(v, KV_NAMES)
