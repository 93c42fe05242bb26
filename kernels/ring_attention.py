"""Context-parallel attention per device: ring (K/V blocks passed around) and all-gather variants.

Both run inside a shard_map whose `axis_name` splits the sequence; masks come from token
positions and segment ids (not indices), so any order of the sequence (e.g. load-balanced
"zigzag") is handled. Einsum letters: B batch, L local queries, S keys, K kv heads, G query heads
per kv head, d head dim.
"""

import jax
import jax.numpy as jnp


def block_attention(q, k, v, q_pos, k_pos, q_seg, k_seg, causal: bool = True):
  """Attention of local queries to one block of keys: (output [B, L, H, d] f32, lse [B, L, H]).

  Rows with no visible key in the block get output 0 and lse -inf, so blocks combine exactly.
  """
  b, length, h, d = q.shape
  kv_heads = k.shape[2]
  qg = q.reshape(b, length, kv_heads, h // kv_heads, d)
  scores = jnp.einsum("BLKGd,BSKd->BKGLS", qg, k, preferred_element_type=jnp.float32)
  scores = scores * (d ** -0.5)
  mask = (q_seg[:, :, None] == k_seg[:, None, :])  # [B, L, S]
  if causal:
    mask &= k_pos[:, None, :] <= q_pos[:, :, None]
  scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
  # The max only stabilizes the exponent (the result does not depend on it): no gradient.
  top = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  probs = jnp.exp(scores - top)
  total = jnp.sum(probs, axis=-1, keepdims=True)
  safe_total = jnp.where(total > 0, total, 1.0)
  out = jnp.einsum("BKGLS,BSKd->BLKGd", probs / safe_total, v.astype(jnp.float32))
  lse = jnp.where(total > 0, top + jnp.log(safe_total), -jnp.inf)[..., 0]  # [B, K, G, L]
  return out.reshape(b, length, h, d), lse.transpose(0, 3, 1, 2).reshape(b, length, h)


def combine(out_a, lse_a, out_b, lse_b):
  """Merges two partial attentions over disjoint key sets (the online-softmax rule)."""
  top = jax.lax.stop_gradient(jnp.maximum(lse_a, lse_b))
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  weight_a = jnp.exp(jnp.where(jnp.isfinite(lse_a), lse_a - top, -jnp.inf))
  weight_b = jnp.exp(jnp.where(jnp.isfinite(lse_b), lse_b - top, -jnp.inf))
  total = weight_a + weight_b
  safe_total = jnp.where(total > 0, total, 1.0)
  out = (out_a * weight_a[..., None] + out_b * weight_b[..., None]) / safe_total[..., None]
  lse = jnp.where(total > 0, top + jnp.log(safe_total), -jnp.inf)
  return out, lse


# Recompute each block's scores in the backward instead of keeping N of them alive.
_block = jax.checkpoint(block_attention, static_argnums=(7,))


def ring_attention(q, k, v, positions, segment_ids, *, axis_name, causal: bool = True):
  """Per-device ring attention: this device's queries against every device's K/V block.

  K/V travel around the ring with `ppermute` (N - 1 steps; the transfer for the next step is
  issued before this step's compute so XLA can overlap them); positions and segment ids (tiny)
  are all-gathered once. Autodiff through the ring gives the backward ring.

  Args:
    q: [B, L, H, d] local queries; k, v: [B, L, K, d] local keys/values.
    positions, segment_ids: [B, L] of the local tokens.
    axis_name: the mesh axis (or axes) splitting the sequence.
  Returns:
    [B, L, H, d] in q's dtype.
  """
  n = jax.lax.axis_size(axis_name)
  me = jax.lax.axis_index(axis_name)
  length = k.shape[1]
  all_pos = jax.lax.all_gather(positions, axis_name, axis=1, tiled=True)
  all_seg = jax.lax.all_gather(segment_ids, axis_name, axis=1, tiled=True)

  def block_meta(step):  # positions / segments of the block received after `step` hops
    start = ((me - step) % n) * length
    return (jax.lax.dynamic_slice_in_dim(all_pos, start, length, axis=1),
            jax.lax.dynamic_slice_in_dim(all_seg, start, length, axis=1))

  ring = [(i, (i + 1) % n) for i in range(n)]
  k_pos, k_seg = block_meta(0)
  out, lse = _block(q, k, v, positions, k_pos, segment_ids, k_seg, causal)

  def step(carry, hop):
    # A scan, not a Python loop: its backward runs the blocks one after another, so only one
    # block's scores are alive at a time. Each hop first sends the block on, then computes.
    k, v, out, lse = carry
    k, v = jax.lax.ppermute((k, v), axis_name, ring)
    k_pos, k_seg = block_meta(hop)
    block_out, block_lse = _block(q, k, v, positions, k_pos, segment_ids, k_seg, causal)
    out, lse = combine(out, lse, block_out, block_lse)
    return (k, v, out, lse), None

  (_, _, out, lse), _ = jax.lax.scan(step, (k, v, out, lse), jnp.arange(1, n))
  return out.astype(q.dtype)


def allgather_attention(q, k, v, positions, segment_ids, *, axis_name, causal: bool = True):
  """Per-device attention after all-gathering K/V over the sequence axis (Llama-3's approach
  for long context): simpler than the ring; K/V memory grows with the whole sequence."""
  gather = lambda x: jax.lax.all_gather(x, axis_name, axis=1, tiled=True)
  out, _ = block_attention(q, gather(k), gather(v), positions, gather(positions), segment_ids,
                           gather(segment_ids), causal)
  return out.astype(q.dtype)
