"""Plain-jnp oracles the kernels are checked against: attention (causal, packed, GQA), the
output head's cross-entropy, residual add + RMSNorm."""

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

# Einsum letters: B batch, L query length, S key length, K kv heads, G query heads per kv head,
# d head dim (Dh).


def attention_mask(length: int, segment_ids, causal: bool, window: int = 0):
  """[B or 1, 1, L, S] boolean mask: causal by index, and same document when segment ids given;
  with `window` > 0 (sliding-window attention, Mistral's), only the last `window` keys up to the
  query (query index - key index < window)."""
  mask = jnp.ones((1, 1, length, length), dtype=bool)
  if causal:
    mask = jnp.tril(mask)
  if window:
    index = jnp.arange(length)
    mask = mask & (index[:, None] - index[None, :] < window)[None, None]
  if segment_ids is not None:
    same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    mask = mask & same
  return mask


def attention(q, k, v, segment_ids=None, *, causal: bool = True, window: int = 0):
  """Softmax attention in float32 without repeating K/V for grouped-query attention.

  Args:
    q: [B, L, H, d] queries; k, v: [B, L, K, d] keys and values, H a multiple of K (v may
      have another head dim, dv: MLA's).
    segment_ids: optional [B, L] int document ids; tokens attend only within their document.
    causal: mask future positions.
    window: > 0: each query sees only the last `window` keys (itself included).
  Returns:
    [B, L, H, dv] in q's dtype.
  """
  b, length, h, d = q.shape
  kv_heads = k.shape[2]
  q = q.reshape(b, length, kv_heads, h // kv_heads, d)
  scores = jnp.einsum("BLKGd,BSKd->BKGLS", q, k, preferred_element_type=jnp.float32)
  scores = scores * (d ** -0.5)
  mask = attention_mask(length, segment_ids, causal, window)[:, :, None]  # [B, 1, 1, L, S]
  scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  # Named: remat="none" keeps them, as autodiff alone would (models/compute.py).
  probs = checkpoint_name(jax.nn.softmax(scores, axis=-1), "attention_probs")
  out = jnp.einsum("BKGLS,BSKd->BLKGd", probs.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
  out = out.reshape(b, length, h, v.shape[-1]).astype(q.dtype)  # MLA: v's head dim
  return checkpoint_name(out, "attention_out")


def cross_entropy(h_BLD, w_DV, targets_BL, mask_BL, z_loss: float = 0.0):
  """Summed masked cross-entropy of the dense logits h @ w [B, L, V] (float32), as the trainer's
  dense loss computes it: (loss_sum, {"nll_sum", "z_loss_sum", "tokens"})."""
  logits = jnp.einsum("BLD,DV->BLV", h_BLD, w_DV).astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets_BL[..., None], axis=-1)[..., 0]
  mask = mask_BL.astype(jnp.float32)
  nll_sum = jnp.sum((lse - target_logit) * mask)
  z_sum = jnp.sum(jnp.square(lse) * mask)
  return nll_sum + z_loss * z_sum, {"nll_sum": nll_sum, "z_loss_sum": z_sum,
                                    "tokens": jnp.sum(mask)}


def rmsnorm_residual(x_ND, residual_ND, scale_D, eps: float):
  """(RMSNorm(h) * scale, h) with h = x + residual rounded to x's dtype; norm in float32."""
  h = (x_ND.astype(jnp.float32) + residual_ND.astype(jnp.float32)).astype(x_ND.dtype)
  h32 = h.astype(jnp.float32)
  y = h32 * jax.lax.rsqrt(jnp.mean(h32 * h32, axis=-1, keepdims=True) + eps)
  # The scale broadcast is spelled out: the tests (and careful users) run with rank promotion
  # set to "raise", where an implicit [N, D] x [D] product is an error.
  scale = scale_D.astype(jnp.float32).reshape((1,) * (y.ndim - 1) + scale_D.shape)
  return (y * scale).astype(x_ND.dtype), h
