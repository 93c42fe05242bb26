"""Context-parallel attention per device: ring (K/V blocks passed around) and all-gather variants.

Both run inside a shard_map whose `axis_name` splits the sequence; masks come from token
positions and segment ids (not indices), so any order of the sequence (e.g. load-balanced
"zigzag") is handled. A sliding window (`window` > 0, Mistral's) keeps the keys whose position
is less than `window` before the query's: within a document positions advance by one per token
(trainer/data.py), so that is kernels/reference.py's index difference. Einsum letters: B batch,
L local queries, S keys, K kv heads, G query heads per kv head, d q/k head dim, e v head dim
(different from d under MLA).
"""

import functools

import jax
import jax.numpy as jnp


def block_attention(q, k, v, q_pos, k_pos, q_seg, k_seg, causal: bool = True, window: int = 0):
  """Attention of local queries to one block of keys: (output [B, L, H, e] f32, lse [B, L, H]).

  Rows with no visible key in the block get output 0 and lse -inf, so blocks combine exactly.
  `window` > 0 also hides keys `window` or more positions before the query.
  """
  b, length, h, d = q.shape
  kv_heads = k.shape[2]
  qg = q.reshape(b, length, kv_heads, h // kv_heads, d)
  scores = jnp.einsum("BLKGd,BSKd->BKGLS", qg, k, preferred_element_type=jnp.float32)
  scores = scores * (d ** -0.5)
  mask = (q_seg[:, :, None] == k_seg[:, None, :])  # [B, L, S]
  if causal:
    mask &= k_pos[:, None, :] <= q_pos[:, :, None]
  if window:
    mask &= q_pos[:, :, None] - k_pos[:, None, :] < window
  scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
  # The max only stabilizes the exponent (the result does not depend on it): no gradient.
  top = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  probs = jnp.exp(scores - top)
  total = jnp.sum(probs, axis=-1, keepdims=True)
  safe_total = jnp.where(total > 0, total, 1.0)
  out = jnp.einsum("BKGLS,BSKe->BLKGe", probs / safe_total, v.astype(jnp.float32))
  lse = jnp.where(total > 0, top + jnp.log(safe_total), -jnp.inf)[..., 0]  # [B, K, G, L]
  return out.reshape(b, length, h, v.shape[-1]), lse.transpose(0, 3, 1, 2).reshape(b, length, h)


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
_block = jax.checkpoint(block_attention, static_argnums=(7, 8))


def _chunked_block(q, k, v, q_pos, k_pos, q_seg, k_seg, causal: bool, window: int, chunks: int):
  """`_block` over the block's keys in `chunks` equal pieces, one after another (a scan; the
  pieces combine exactly), so the scores alive are [L, S / chunks] a head: the USP hybrid's
  blocks hold U times the ring's keys for 1/U of its heads, and this keeps its scores the
  ring's size."""
  if chunks == 1:
    return _block(q, k, v, q_pos, k_pos, q_seg, k_seg, causal, window)
  size = k.shape[1] // chunks
  piece = lambda x, i: jax.lax.dynamic_slice_in_dim(x, i * size, size, axis=1)  # noqa: E731

  def step(carry, i):
    part = _block(q, piece(k, i), piece(v, i), q_pos, piece(k_pos, i), q_seg, piece(k_seg, i),
                  causal, window)
    return combine(*carry, *part), None

  first = _block(q, piece(k, 0), piece(v, 0), q_pos, piece(k_pos, 0), q_seg, piece(k_seg, 0),
                 causal, window)
  return jax.lax.scan(step, first, jnp.arange(1, chunks))[0]


def ring_hops(devices: int, local_length: int, window: int = 0, contiguous: bool = False) -> int:
  """Hops of the ring: N - 1, or with a causal window over the contiguous order (device i holds
  tokens [i·L, (i+1)·L)) the ceil((window - 1) / L) previous blocks a query can reach."""
  if not (window and contiguous):
    return devices - 1
  return min(devices - 1, -(-(window - 1) // local_length))


def ring_attention(q, k, v, positions, segment_ids, *, axis_name, causal: bool = True,
                   window: int = 0, contiguous: bool = False, key_chunks: int = 1):
  """Per-device ring attention: this device's queries against the K/V blocks it needs.

  K/V travel around the ring with `ppermute` (N - 1 steps, or fewer with a window; the transfer
  for the next step is issued before this step's compute so XLA can overlap them); positions
  and segment ids (tiny) are all-gathered once. Autodiff through the ring gives the backward
  ring.

  With a causal `window` and the sequence in `contiguous` order, the ring stops after
  `ring_hops` steps (static): no query reaches further back. The first devices then receive
  blocks from the end of the sequence (the ring wraps around); the mask hides them (later
  positions, or other documents), and computing them costs those devices no more than every
  other device spends, so the step is not slower for it. The zigzag order spreads every block
  over the sequence: there a window masks but skips no hop.

  Args:
    q: [B, L, H, d] local queries; k: [B, L, K, d] and v: [B, L, K, e] local keys/values.
    positions, segment_ids: [B, L] of the local tokens.
    axis_name: the mesh axis (or axes) splitting the sequence.
    window: > 0: each query sees only the keys less than `window` positions before it.
    contiguous: the sequence is in contiguous order over `axis_name` (else any order).
    key_chunks: attend each received block in this many key pieces, one after another
      (`_chunked_block`; it must divide L).
  Returns:
    [B, L, H, e] in q's dtype.
  """
  n = jax.lax.axis_size(axis_name)
  me = jax.lax.axis_index(axis_name)
  length = k.shape[1]
  hops = ring_hops(n, length, window, contiguous and causal)
  all_pos = jax.lax.all_gather(positions, axis_name, axis=1, tiled=True)
  all_seg = jax.lax.all_gather(segment_ids, axis_name, axis=1, tiled=True)

  def block_meta(step):  # positions / segments of the block received after `step` hops
    start = ((me - step) % n) * length
    return (jax.lax.dynamic_slice_in_dim(all_pos, start, length, axis=1),
            jax.lax.dynamic_slice_in_dim(all_seg, start, length, axis=1))

  ring = [(i, (i + 1) % n) for i in range(n)]
  k_pos, k_seg = block_meta(0)
  attend = functools.partial(_chunked_block, causal=causal, window=window, chunks=key_chunks)
  out, lse = attend(q, k, v, positions, k_pos, segment_ids, k_seg)

  def step(carry, hop):
    # A scan, not a Python loop: its backward runs the blocks one after another, so only one
    # block's scores are alive at a time. Each hop first sends the block on, then computes.
    k, v, out, lse = carry
    k, v = jax.lax.ppermute((k, v), axis_name, ring)
    k_pos, k_seg = block_meta(hop)
    block_out, block_lse = attend(q, k, v, positions, k_pos, segment_ids, k_seg)
    out, lse = combine(out, lse, block_out, block_lse)
    return (k, v, out, lse), None

  if hops:
    (_, _, out, lse), _ = jax.lax.scan(step, (k, v, out, lse), jnp.arange(1, hops + 1))
  return out.astype(q.dtype)


def allgather_attention(q, k, v, positions, segment_ids, *, axis_name, causal: bool = True,
                        window: int = 0, contiguous: bool = False):
  """Per-device attention after all-gathering K/V over the sequence axis (Llama-3's approach
  for long context): simpler than the ring; K/V memory grows with the whole sequence. A
  `window` only masks: every block is still gathered (`contiguous`, the order, is not needed)."""
  del contiguous
  gather = lambda x: jax.lax.all_gather(x, axis_name, axis=1, tiled=True)
  out, _ = block_attention(q, gather(k), gather(v), positions, gather(positions), segment_ids,
                           gather(segment_ids), causal, window)
  return out.astype(q.dtype)
