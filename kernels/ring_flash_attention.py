"""Ring attention on the Pallas flash kernel: context parallelism without [L, S] score tensors.

kernels.ring_attention attends each received K/V block with XLA ops that hold the block's
scores, [L, S] float32 a head, and recompute them in the backward: memory-bound work on GPUs.
Here each hop is one flash-kernel call instead.

The sequence is in the zigzag order (sharding.context_parallel.zigzag_permutation): device i
holds chunks i and 2n-1-i of 2n, its local halves A (earlier) and B (later), so local index
order is position order. Against the block of device j the causal mask is whole halves:
- j = i: the local causal attention;
- j < i: A and B see all of j's A half and none of its B half;
- j > i: only B sees j's block, all of it.
Every hop after the first is therefore one unmasked flash call over half-length pieces stacked
along the batch: (A, B) against (A_j, A_j), or (B, B) against (A_j, B_j); the same work on every
device. Segment ids still mask (packed documents), the queries' and the keys' their own. A
fully masked row of a hop comes back with a logsumexp near the kernel's MASK_VALUE, so merging
gives it no weight (every row sees itself in the first hop).

A custom_vjp runs the backward ring over the blocks the forward received and kept: each block's
dK/dV accumulator travels the ring as its block did and reaches the owner after n hops; flash
attention's backward of one hop needs only the final output and logsumexp. Partial outputs merge
in float32; the accumulators travel in the inputs' dtype.
"""

import functools

import jax
import jax.numpy as jnp

from kernels.flash_attention import BlockSizes, backward_kernels, forward_kernel, prepare
from kernels.pallas_triton import varying_like
from kernels.ring_attention import ring_attention


def fits(local_length: int, block_sizes: BlockSizes = BlockSizes()) -> bool:
  """Whether the zigzag halves tile into the kernel's blocks without padding (a padded half
  would need its own key mask): the half a multiple of the largest block, as shrunk to it."""
  half = local_length // 2
  if local_length % 2 or not half:
    return False
  largest = min(max(block_sizes.block_q, block_sizes.block_k, block_sizes.block_q_bwd,
                    block_sizes.block_k_bwd), 1 << (half - 1).bit_length())
  return half % largest == 0


def ring_flash_attention(q, k, v, positions, segment_ids, *, axis_name, causal: bool = True,
                         window: int = 0, contiguous: bool = False, interpret=None):
  """kernels.ring_attention's contract, on the flash kernel where it applies: full causal
  attention in the zigzag order (not `contiguous`) with halves that tile into its blocks
  (`fits`). Elsewhere (a window, the contiguous order, odd lengths) it runs ring_attention."""
  if not causal or window or contiguous or not fits(q.shape[1]):
    return ring_attention(q, k, v, positions, segment_ids, axis_name=axis_name, causal=causal,
                          window=window, contiguous=contiguous)
  if segment_ids is None:
    segment_ids = jnp.ones(q.shape[:2], jnp.int32)
  return _ring(q, k, v, segment_ids, axis_name, interpret)


def _halves(x, axis=1):
  half = x.shape[axis] // 2
  return (jax.lax.slice_in_dim(x, 0, half, axis=axis),
          jax.lax.slice_in_dim(x, half, 2 * half, axis=axis))


def _stack(earlier, when_earlier, when_later):
  """The hop's half-length pieces stacked along the batch: (first, second) of either case."""
  return jnp.where(earlier, jnp.concatenate(when_earlier, axis=0),
                   jnp.concatenate(when_later, axis=0))


def _merge(out_a, lse_a, out_b, lse_b):
  """Two partial attentions over disjoint keys: out [B, L, H, e], base-2 lse [B, H, L]."""
  top = jnp.maximum(lse_a, lse_b)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  wa, wb = jnp.exp2(lse_a - top), jnp.exp2(lse_b - top)
  total = wa + wb
  row = lambda w: jnp.swapaxes(w / total, 1, 2)[..., None]  # noqa: E731 [B, H, L] -> [B, L, H, 1]
  return out_a * row(wa) + out_b * row(wb), top + jnp.log2(total)


def _setup(q, k, v, segment_ids, interpret):
  """Head dims padded as the kernel wants them; the diagonal's and the halves' statics."""
  qp, kp, vp, seg, diagonal = prepare(q, k, v, segment_ids, causal=True, interpret=interpret)
  half = q.shape[1] // 2
  cross = prepare(qp[:, :half], kp[:, :half], vp[:, :half], seg[0][:, :half], causal=False,
                  interpret=interpret)[4]
  return qp, kp, vp, seg[0], diagonal, cross


def _hop_inputs(earlier, q, seg, k, v, k_seg):
  """A hop's kernel inputs: the local queries' halves and the received block's, stacked."""
  (qa, qb), (sa, sb) = _halves(q), _halves(seg)
  (ka, kb), (va, vb), (ska, skb) = _halves(k), _halves(v), _halves(k_seg)
  return (_stack(earlier, (qa, qb), (qb, qb)), _stack(earlier, (ka, ka), (ka, kb)),
          _stack(earlier, (va, va), (va, vb)),
          (_stack(earlier, (sa, sb), (sb, sb)), _stack(earlier, (ska, ska), (ska, skb))))


def _forward(q, k, v, segment_ids, axis_name, interpret):
  """(out in q's dtype with padded head dims, base-2 lse, the backward's residuals)."""
  qp, kp, vp, seg, diagonal, cross = _setup(q, k, v, segment_ids, interpret)
  n, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
  out, lse = forward_kernel(qp, kp, vp, (seg, seg), diagonal, out_dtype=jnp.float32)
  ring = [(i, (i + 1) % n) for i in range(n)]

  def hop(carry, h):
    k, v, k_seg, out, lse = carry
    k, v, k_seg = jax.lax.ppermute((k, v, k_seg), axis_name, ring)
    earlier = h <= me  # the block came from device me - h
    o, l = forward_kernel(*_hop_inputs(earlier, qp, seg, k, v, k_seg), cross,
                          out_dtype=jnp.float32)
    (o1, o2), (l1, l2) = _halves(o, 0), _halves(l, 0)
    ob, lb = _merge(o1, l1, o2, l2)
    hop_out = jnp.where(earlier, jnp.concatenate([o1, o2], 1),
                        jnp.concatenate([jnp.zeros_like(o1), ob], 1))
    hop_lse = jnp.where(earlier, jnp.concatenate([l1, l2], 2),
                        jnp.concatenate([jnp.full_like(l1, -jnp.inf), lb], 2))
    out, lse = _merge(out, lse, hop_out, hop_lse)
    return (k, v, k_seg, out, lse), (k, v, k_seg)

  # The received blocks are kept for the backward (K/V, a few MiB a hop under GQA): it then
  # sends only their gradients, as JAX's own transpose of the jnp ring does.
  blocks = None
  if n > 1:
    (_, _, _, out, lse), blocks = jax.lax.scan(hop, (kp, vp, seg, out, lse), jnp.arange(1, n))
  out = out.astype(q.dtype)
  return out, lse, (qp, kp, vp, seg, out, lse, blocks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _ring(q, k, v, segment_ids, axis_name, interpret):
  return _forward(q, k, v, segment_ids, axis_name, interpret)[0][..., :v.shape[-1]]


def _ring_fwd(q, k, v, segment_ids, axis_name, interpret):
  out, _, residuals = _forward(q, k, v, segment_ids, axis_name, interpret)
  return out[..., :v.shape[-1]], (q, k, v, segment_ids, residuals)


def _ring_bwd(axis_name, interpret, residuals, d_out):
  q, k, v, segment_ids, (qp, kp, vp, seg, out, lse, blocks) = residuals
  _, _, _, _, diagonal, cross = _setup(q, k, v, segment_ids, interpret)
  d_out = jnp.pad(d_out, ((0, 0),) * 3 + ((0, out.shape[-1] - d_out.shape[-1]),))
  n, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
  f32 = lambda *xs: tuple(x.astype(jnp.float32) for x in xs)  # noqa: E731
  dq, dk, dv = f32(*backward_kernels(qp, kp, vp, (seg, seg), out, lse, d_out, diagonal)[:3])
  (oa, ob), (da, db), (la, lb) = _halves(out), _halves(d_out), _halves(lse, 2)
  ring = [(i, (i + 1) % n) for i in range(n)]

  def hop(carry, inputs):
    dk, dv, dq = carry
    h, (k, v, k_seg) = inputs
    # The accumulated gradients of the block this device now attends to arrive from the device
    # before it, in the inputs' dtype (as the jnp ring's transposed permutes send them).
    dk, dv = f32(*jax.lax.ppermute((dk.astype(kp.dtype), dv.astype(vp.dtype)), axis_name, ring))
    earlier = h <= me
    g = backward_kernels(
        *_hop_inputs(earlier, qp, seg, k, v, k_seg), _stack(earlier, (oa, ob), (ob, ob)),
        _stack(earlier, (la, lb), (lb, lb)), _stack(earlier, (da, db), (db, db)), cross)
    (q1, q2), (k1, k2), (v1, v2) = (_halves(x, 0) for x in f32(*g[:3]))
    dq = dq + jnp.where(earlier, jnp.concatenate([q1, q2], 1),
                        jnp.concatenate([jnp.zeros_like(q1), q1 + q2], 1))
    def block(g1, g2):  # both pieces were the block's A half (earlier), or its A and B halves
      return jnp.where(earlier, jnp.concatenate([g1 + g2, jnp.zeros_like(g1)], 1),
                       jnp.concatenate([g1, g2], 1))
    return (dk + block(k1, k2), dv + block(v1, v2), dq), None

  if n > 1:
    (dk, dv, dq), _ = jax.lax.scan(hop, (dk, dv, dq), (jnp.arange(1, n), blocks))
    dk, dv = jax.lax.ppermute((dk.astype(kp.dtype), dv.astype(vp.dtype)), axis_name,
                              ring)  # the last hop's block goes home
  trim = lambda g, x: varying_like(g[..., :x.shape[-1]].astype(x.dtype), x)  # noqa: E731
  return trim(dq, q), trim(dk, k), trim(dv, v), None


_ring.defvjp(_ring_fwd, _ring_bwd)
