"""Ulysses (DeepSpeed-Ulysses) context-parallel attention per device, and USP's hybrid of it with
the ring.

Ulysses: the sequence is split over `axis_name` and the heads are whole. An all-to-all trades
that for a head split (each device gets the whole sequence of 1/N of the heads), any
whole-sequence attention runs locally, and a second all-to-all trades back: 4 all-to-alls per
layer forward (q, k, v, output), their transposes backward. The received blocks are concatenated
in device order, so a sequence split in the contiguous order (device i holds the i-th block)
arrives whole and in its natural order: kernels that mask by index (kernels.attention's xla,
pallas_flash, cudnn) are right as they are.

Grouped-query attention with fewer local kv heads than the degree (or a count it does not
divide): each kv head is replicated (`kv_repeats`) before the all-to-all, so every device
receives the kv heads its query heads read, and the gradients of the copies add up in the
backward.
"""

import functools
import math

import jax
import jax.numpy as jnp

from kernels.ring_attention import ring_attention


def kv_repeats(kv_heads: int, degree: int) -> int:
  """Copies of each kv head the all-to-all sends: 1 when the degree divides the kv heads, else
  the fewest that make their count (lcm(kv_heads, degree)) a multiple of the degree. Copies
  stay next to their head, so kv head k·r + j is head k's: query head h still reads kv head
  h // (H / K), provided the degree divides the query heads."""
  return degree // math.gcd(kv_heads, degree)


def ulysses_attention(q, k, v, positions, segment_ids, *, axis_name, attend, window: int = 0,
                      contiguous: bool = True):
  """Per-device Ulysses attention.

  Args:
    q: [B, L, H, d] local queries; k: [B, L, K, d], v: [B, L, K, e] (e: MLA's v head dim).
    positions, segment_ids: [B, L] of the local tokens.
    axis_name: the mesh axis (or axes) splitting the sequence; its size N must divide H.
    attend: `attend(q, k, v, positions, segment_ids, window=...)`, attention over whole
      sequences of [B, N·L] tokens (N·L positions and segment ids, gathered here).
    window: this layer's sliding window (0: full attention), passed to `attend`.
    contiguous: unused: the order is the caller's to choose for `attend` (part of the signature
      the context-parallel kernels share).
  Returns:
    [B, L, H, e] in q's dtype.
  """
  del contiguous
  degree = jax.lax.axis_size(axis_name)
  if q.shape[2] % degree:
    raise ValueError(f"Ulysses over {degree} devices needs local query heads divisible by"
                     f" {degree}, got {q.shape[2]}")
  repeats = kv_repeats(k.shape[2], degree)
  if repeats > 1:
    k, v = jnp.repeat(k, repeats, axis=2), jnp.repeat(v, repeats, axis=2)
  to_heads = lambda x: jax.lax.all_to_all(x, axis_name, 2, 1, tiled=True)  # noqa: E731
  gather = lambda x: jax.lax.all_gather(x, axis_name, axis=1, tiled=True)  # noqa: E731
  out = attend(to_heads(q), to_heads(k), to_heads(v), gather(positions), gather(segment_ids),
               window=window)
  return jax.lax.all_to_all(out, axis_name, 1, 2, tiled=True).astype(q.dtype)


def ulysses_ring_attention(q, k, v, positions, segment_ids, *, axis_name, window: int = 0,
                           contiguous: bool = False):
  """USP: Ulysses over the inner axis, the ring over the outer one.

  `axis_name` = (ring axis, Ulysses axis), the outer and inner factors of the sequence split.
  After the inner all-to-all each device holds its ring position's block (the U inner devices'
  chunks, U = the Ulysses degree) for H / U heads, and the ring passes those blocks around the
  outer axis. The ring masks by positions and segment ids, so the order inside a block does not
  matter: in the zigzag order over all R·U devices a ring position holds chunks o and 2R-1-o at
  U times the grain (a zigzag over the ring, balanced); in the `contiguous` order it holds the
  o-th block, and a window skips the ring hops it does not reach.
  """
  ring_axis, ulysses_axis = axis_name
  # Each received block holds U devices' tokens for 1/U of the heads: attended in U key pieces,
  # its scores are the ring's size (a head's [U·L, L] where the ring's has [L, L] for U times
  # the heads).
  ring = functools.partial(ring_attention, axis_name=ring_axis, contiguous=contiguous,
                           key_chunks=jax.lax.axis_size(ulysses_axis))
  return ulysses_attention(q, k, v, positions, segment_ids, axis_name=ulysses_axis,
                           attend=ring, window=window)
