"""Pallas flash attention for GPUs (Triton lowering): forward and backward kernels, custom_vjp."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels.pallas_triton import out_type, triton_call, varying_like

# Letters: B batch, L query length, S key length (= L here), H query heads, K kv heads,
# G = H / K query heads per kv head, d head dim of q and k, dv of v (MLA: dv != d). Inside
# kernels: bq / bk query / key block rows.

# Masked scores get a large finite negative, not -inf: a block where a row is fully masked then
# gives exp2(MASK - MASK) = 1 instead of NaN, and the row's first unmasked block rescales that
# garbage by exp2(MASK - real) = 0. Every row sees at least itself, so no row stays masked (with
# a window a row's first visited blocks may be all masked for it, never the one holding itself).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
LOG2_E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile rows per program; each a power of two (the Triton lowering's rule).

  The forward and dQ kernels hold one query block and loop over key blocks; the dK/dV kernel
  holds one key block and loops over query blocks of every head in its group. Defaults suit
  H100 with head dim 128 in bf16 (shared memory of a dK/dV program: K, V and their fp32
  accumulators plus a Q and dO block per stage). Blocks larger than the padded sequence shrink.
  """

  block_q: int = 128
  block_k: int = 64
  block_q_bwd: int = 64
  block_k_bwd: int = 64


@dataclasses.dataclass(frozen=True)
class KernelStatic:
  """Everything static about one call (hashable: the custom_vjp's non-differentiable arg)."""

  causal: bool
  window: int  # > 0: query i sees keys j with i - window < j <= i (0: no window)
  sm_scale: float
  length: int  # true sequence length; rows and keys at or past it are padding
  blocks: BlockSizes
  has_segments: bool
  interpret: bool | None  # None: interpret on CPU, Triton elsewhere (picked at lowering)
  num_warps: int
  num_stages: int
  count_visits: bool = False  # visit_counts(): each program also writes its loop's trip count


def _pow2_ceil(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def _mask_scores(s, q_idx, k_idx, seg_q, seg_k, st: KernelStatic, padded: bool):
  """Masks a [bq, bk] score tile: causal, in the window, same segment, keys in the true length."""
  masks = []
  if st.causal:
    masks.append(q_idx[:, None] >= k_idx[None, :])
  if st.window:
    masks.append(q_idx[:, None] - k_idx[None, :] < st.window)
  if seg_q is not None:
    masks.append(seg_q[:, None] == seg_k[None, :])
  if padded:
    masks.append(jnp.broadcast_to(k_idx[None, :] < st.length, s.shape))
  return s if not masks else jnp.where(functools.reduce(jnp.logical_and, masks), s, MASK_VALUE)


def _key_blocks(q_block, bq: int, bk: int, st: KernelStatic):
  """Key blocks [lo, hi) a query block needs: from its first row's oldest key in the window to
  its diagonal when causal (the others are fully masked), never the blocks all padding."""
  hi = -(-st.length // bk)  # key blocks holding a real key
  if st.causal:
    hi = jnp.minimum(lax.div((q_block + 1) * bq + bk - 1, bk), hi)
  lo = lax.div(jnp.maximum(q_block * bq - st.window + 1, 0), bk) if st.window else 0
  return lo, hi


def _loop(lo, hi, body, init, count=None):
  """(fori_loop(lo, hi, body, init), count + its trip count); a count None (the default) stays."""
  if count is None:
    return lax.fori_loop(lo, hi, body, init), None
  return lax.fori_loop(lo, hi, lambda j, c: (body(j, c[0]), c[1] + 1), (init, count))


def _store_count(count_ref, count):
  if count_ref is not None:
    count_ref[...] = jnp.full(count_ref.shape, count, jnp.int32)


def _fwd_kernel(q_ref, k_ref, v_ref, seg_ref, seg_k_ref, o_ref, lse_ref, count_ref=None, *,
                st: KernelStatic, bq: int, bk: int, padded: bool):
  """One query block of one head: online softmax over the key blocks (base-2 exponentials)."""
  i = pl.program_id(0)
  q = q_ref[...]
  q_idx = i * bq + jnp.arange(bq)
  seg_q = None if seg_ref is None else seg_ref[pl.ds(i * bq, bq)]
  scale = st.sm_scale * LOG2_E

  def body(j, carry):
    acc, m_prev, l_prev = carry
    keys = pl.ds(j * bk, bk)
    s = jnp.dot(q, k_ref[keys, :].T, preferred_element_type=jnp.float32) * scale
    seg_k = None if seg_ref is None else seg_k_ref[keys]
    s = _mask_scores(s, q_idx, j * bk + jnp.arange(bk), seg_q, seg_k, st, padded)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=-1))
    correction = jnp.exp2(m_prev - m_next)
    p = jnp.exp2(s - m_next[:, None])
    l_next = correction * l_prev + jnp.sum(p, axis=-1)
    v = v_ref[keys, :]
    acc = correction[:, None] * acc + jnp.dot(p.astype(v.dtype), v,
                                              preferred_element_type=jnp.float32)
    return acc, m_next, l_next

  init = (jnp.zeros(o_ref.shape, jnp.float32), jnp.full((bq,), -jnp.inf, jnp.float32),
          jnp.zeros((bq,), jnp.float32))
  (acc, m, l), count = _loop(*_key_blocks(i, bq, bk, st), body, init,
                             None if count_ref is None else jnp.int32(0))
  if st.window and padded:  # a block of padding rows past every key's window visits no block:
    m, l = jnp.where(l > 0, m, 0.0), jnp.where(l > 0, l, 1.0)  # 0 out, finite lse, not NaN
  o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
  lse_ref[...] = m + jnp.log2(l)  # base-2 logsumexp of the scaled scores, for the backward
  _store_count(count_ref, count)


def _dq_kernel(q_ref, k_ref, v_ref, seg_ref, seg_k_ref, do_ref, lse_ref, delta_ref, dq_ref,
               count_ref=None, *, st: KernelStatic, bq: int, bk: int, padded: bool):
  """dQ of one query block of one head: dS = P * (dO V^T - delta), dQ = scale * dS K."""
  i = pl.program_id(0)
  q, do = q_ref[...], do_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]
  q_idx = i * bq + jnp.arange(bq)
  seg_q = None if seg_ref is None else seg_ref[pl.ds(i * bq, bq)]
  scale = st.sm_scale * LOG2_E

  def body(j, dq):
    keys = pl.ds(j * bk, bk)
    k, v = k_ref[keys, :], v_ref[keys, :]
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale
    seg_k = None if seg_ref is None else seg_k_ref[keys]
    s = _mask_scores(s, q_idx, j * bk + jnp.arange(bk), seg_q, seg_k, st, padded)
    p = jnp.exp2(s - lse[:, None])
    dp = jnp.dot(do, v.T, preferred_element_type=jnp.float32)
    ds = p * (dp - delta[:, None])
    return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

  dq, count = _loop(*_key_blocks(i, bq, bk, st), body, jnp.zeros(q.shape, jnp.float32),
                    None if count_ref is None else jnp.int32(0))
  dq_ref[...] = (dq * st.sm_scale).astype(dq_ref.dtype)
  _store_count(count_ref, count)


def _dkv_kernel(q_ref, k_ref, v_ref, seg_ref, seg_k_ref, do_ref, lse_ref, delta_ref, dk_ref,
                dv_ref, count_ref=None, *, st: KernelStatic, bq: int, bk: int, groups: int,
                padded: bool):
  """dK, dV of one key block of one kv head, summed over the `groups` query heads that share it
  (GQA: K/V are never repeated, and neither are their gradients)."""
  j = pl.program_id(0)
  k, v = k_ref[...], v_ref[...]
  k_idx = j * bk + jnp.arange(bk)
  seg_k = None if seg_ref is None else seg_k_ref[pl.ds(j * bk, bk)]
  scale = st.sm_scale * LOG2_E
  # Causal: query blocks before this key block's diagonal see none of its keys; with a window,
  # neither do those after the block of the last query whose window holds its last key.
  first = lax.div(j * bk, bq) if st.causal else 0
  last = -(-st.length // bq)  # query blocks holding a real row
  if st.window:
    last = jnp.minimum(lax.div(j * bk + bk - 1 + st.window - 1, bq) + 1, last)

  def body(g, i, carry):
    dk, dv = carry
    rows = pl.ds(i * bq, bq)
    q, do = q_ref[rows, g, :], do_ref[rows, g, :]
    lse, delta = lse_ref[g, rows], delta_ref[g, rows]
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale
    seg_q = None if seg_ref is None else seg_ref[rows]
    s = _mask_scores(s, i * bq + jnp.arange(bq), k_idx, seg_q, seg_k, st, padded)
    p = jnp.exp2(s - lse[:, None])  # [bq, bk]
    dv = dv + jnp.dot(p.astype(do.dtype).T, do, preferred_element_type=jnp.float32)
    dp = jnp.dot(do, v.T, preferred_element_type=jnp.float32)
    ds = p * (dp - delta[:, None])
    dk = dk + jnp.dot(ds.astype(q.dtype).T, q, preferred_element_type=jnp.float32)
    return dk, dv

  init = ((jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)),
          None if count_ref is None else jnp.int32(0))
  (dk, dv), count = lax.fori_loop(
      0, groups, lambda g, c: _loop(first, last, functools.partial(body, g), *c), init)
  dk_ref[...] = (dk * st.sm_scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)
  _store_count(count_ref, count)


def _with_optional_segments(kernel, has_segments: bool):
  """Adapts a kernel taking the queries' and the keys' segment refs (4th, 5th) to a call that
  passes no segment ids."""
  if has_segments:
    return kernel
  return lambda q_ref, k_ref, v_ref, *refs: kernel(q_ref, k_ref, v_ref, None, None, *refs)


def _pallas(kernel, st: KernelStatic, name: str, grid, out_specs, out_shape, **call_kw):
  """The kernel's Triton call (kernels/pallas_triton.py). With `count_visits` one more output:
  an int32 per program (its grid point), its loops' trip count."""
  if st.count_visits:
    out_specs = [*out_specs, pl.BlockSpec((1,) * len(grid), lambda *idx: idx)]
    out_shape = [*out_shape, jax.ShapeDtypeStruct(grid, jnp.int32)]
  return triton_call(kernel, name=name, interpret=st.interpret, num_warps=st.num_warps,
                     num_stages=st.num_stages, grid=grid, out_specs=out_specs,
                     out_shape=out_shape, **call_kw)


def _row_specs(bq: int, *dims):
  """[bq, dim] row blocks of one head, one per head dim (q and k: d; v, out and dO: dv)."""
  return [pl.BlockSpec((None, bq, None, n), lambda i, bb, hh: (bb, i, hh, 0)) for n in dims]


def _kv_specs(length: int, groups: int, *dims):
  """A kv head's whole rows: every query head of a group (GQA) reads them in place."""
  return [pl.BlockSpec((None, length, None, n), lambda i, bb, hh: (bb, 0, lax.div(hh, groups), 0))
          for n in dims]


def forward_kernel(q, k, v, seg, st: KernelStatic, out_dtype=None):
  """(out [B, L, H, dv] in `out_dtype` (default q's), base-2 logsumexp [B, H, L]); `seg` None or
  the queries' and the keys' segment ids, [B, L] each."""
  b, length, h, d = q.shape
  kv_heads, dv = k.shape[2], v.shape[3]
  groups = h // kv_heads
  bq, bk = st.blocks.block_q, st.blocks.block_k
  kernel = functools.partial(_fwd_kernel, st=st, bq=bq, bk=bk, padded=length != st.length)
  q_spec, o_spec = _row_specs(bq, d, dv)
  k_spec, v_spec = _kv_specs(length, groups, d, dv)
  seg_specs = [pl.BlockSpec((None, length), lambda i, bb, hh: (bb, 0))] * (2 * st.has_segments)
  args = [q, k, v] + (list(seg) if st.has_segments else [])
  return _pallas(
      _with_optional_segments(kernel, st.has_segments), st, "flash_attention_fwd",
      grid=(length // bq, b, h), in_specs=[q_spec, k_spec, v_spec, *seg_specs],
      out_specs=[o_spec, pl.BlockSpec((None, None, bq), lambda i, bb, hh: (bb, hh, i))],
      out_shape=[out_type((b, length, h, dv), out_dtype or q.dtype, *args),
                 out_type((b, h, length), jnp.float32, *args)])(*args)


def backward_kernels(q, k, v, seg, out, lse, do, st: KernelStatic):
  """dq, dk, dv and {"dq": counts, "dkv": counts} (empty without count_visits)."""
  b, length, h, d = q.shape
  kv_heads, dv = k.shape[2], v.shape[3]
  groups = h // kv_heads
  bq, bk = st.blocks.block_q_bwd, st.blocks.block_k_bwd
  padded = length != st.length
  # delta_i = sum_d dO_i O_i (= sum_j P_ij dP_ij): one cheap fused XLA reduction, [B, H, L].
  delta = jnp.einsum("BLHd,BLHd->BHL", out.astype(jnp.float32), do.astype(jnp.float32))
  inputs = [q, k, v] + (list(seg) if st.has_segments else []) + [do, lse, delta]
  seg_specs = [pl.BlockSpec((None, length), lambda *idx: (idx[1], 0))] * (2 * st.has_segments)

  dq_kernel = functools.partial(_dq_kernel, st=st, bq=bq, bk=bk, padded=padded)
  q_spec, do_spec = _row_specs(bq, d, dv)
  k_spec, v_spec = _kv_specs(length, groups, d, dv)
  stat_spec = pl.BlockSpec((None, None, bq), lambda i, bb, hh: (bb, hh, i))
  dq = _pallas(
      _with_optional_segments(dq_kernel, st.has_segments), st, "flash_attention_dq",
      grid=(length // bq, b, h),
      in_specs=[q_spec, k_spec, v_spec, *seg_specs, do_spec, stat_spec, stat_spec],
      out_specs=[q_spec], out_shape=[out_type(q.shape, q.dtype, *inputs)],
  )(*inputs)

  dkv_kernel = functools.partial(_dkv_kernel, st=st, bq=bq, bk=bk, groups=groups, padded=padded)
  q_group_spec, do_group_spec = (
      pl.BlockSpec((None, length, groups, n), lambda j, bb, kk: (bb, 0, kk, 0)) for n in (d, dv))
  k_block_spec, v_block_spec = (
      pl.BlockSpec((None, bk, None, n), lambda j, bb, kk: (bb, j, kk, 0)) for n in (d, dv))
  group_stat_spec = pl.BlockSpec((None, groups, length), lambda j, bb, kk: (bb, kk, 0))
  dkv = _pallas(
      _with_optional_segments(dkv_kernel, st.has_segments), st, "flash_attention_dkv",
      grid=(length // bk, b, kv_heads),
      in_specs=[q_group_spec, k_block_spec, v_block_spec, *seg_specs, do_group_spec,
                group_stat_spec, group_stat_spec],
      out_specs=[k_block_spec, v_block_spec],
      out_shape=[out_type(k.shape, k.dtype, *inputs), out_type(v.shape, v.dtype, *inputs)],
  )(*inputs)
  return dq[0], dkv[0], dkv[1], {"dq": dq[1], "dkv": dkv[2]} if st.count_visits else {}


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, seg, st: KernelStatic):
  return forward_kernel(q, k, v, seg, st)[0]


def _flash_fwd(q, k, v, seg, st: KernelStatic):
  out, lse = forward_kernel(q, k, v, seg, st)
  return out, (q, k, v, seg, out, lse)


def _flash_bwd(st: KernelStatic, residuals, do):
  q, k, v, seg, out, lse = residuals
  dq, dk, dv, _ = backward_kernels(q, k, v, seg, out, lse, do, st)
  # integer segment ids have no cotangent
  return varying_like(dq, q), varying_like(dk, k), varying_like(dv, v), None


_flash.defvjp(_flash_fwd, _flash_bwd)


def prepare(q, k, v, segment_ids, *, causal=True, window=0, sm_scale=None,
            block_sizes=BlockSizes(), interpret=None, num_warps=None, num_stages=2,
            count_visits=False):
  """Checks flash_attention's arguments; pads the sequence to a multiple of every block (blocks
  shrink for short sequences first) and each head dim to a power of two (zero columns change no
  dot product). Returns q, k, v, the queries' and keys' int32 segment ids (or None), and the
  KernelStatic."""
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"flash_attention wants q [B, L, H, d], k [B, L, K, d] and v [B, L, K, dv];"
                     f" got q {q.shape}, k {k.shape}, v {v.shape}")
  b, length, h, d = q.shape
  if k.shape != (b, length, k.shape[2], d) or v.shape[:3] != k.shape[:3] or h % k.shape[2]:
    raise ValueError(f"flash_attention: k {k.shape}, v {v.shape} do not fit q {q.shape} (same"
                     " batch and length, k q's head dim, query heads a multiple of kv heads)")
  if not q.dtype == k.dtype == v.dtype:
    raise ValueError(f"flash_attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
  if window < 0 or (window and not causal):
    raise ValueError(f"flash_attention: window={window} must be 0 (none), or > 0 with causal")
  for name, size in dataclasses.asdict(block_sizes).items():
    if size <= 0 or size & (size - 1):
      raise ValueError(f"flash_attention: {name}={size} must be a power of two (Triton tiles)")
  cap = _pow2_ceil(length)
  blocks = BlockSizes(*(min(s, cap) for s in dataclasses.astuple(block_sizes)))
  padded_length = -(-length // max(dataclasses.astuple(blocks))) * max(dataclasses.astuple(blocks))
  st = KernelStatic(causal=causal, window=window if window < length else 0,  # else all causal
                    sm_scale=float(d ** -0.5 if sm_scale is None else sm_scale), length=length,
                    blocks=blocks, has_segments=segment_ids is not None, interpret=interpret,
                    num_warps=num_warps or (4 if max(d, v.shape[3]) <= 64 else 8),
                    num_stages=num_stages, count_visits=count_visits)
  pad_l = padded_length - length
  q, k, v = (jnp.pad(x, ((0, 0), (0, pad_l), (0, 0), (0, _pow2_ceil(x.shape[3]) - x.shape[3])))
             if pad_l or _pow2_ceil(x.shape[3]) != x.shape[3] else x for x in (q, k, v))
  if segment_ids is not None and pad_l:
    segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad_l)))
  seg = None if segment_ids is None else (segment_ids.astype(jnp.int32),) * 2
  return q, k, v, seg, st


def flash_attention(q, k, v, segment_ids=None, *, causal: bool = True, window: int = 0,
                    sm_scale: float | None = None, block_sizes: BlockSizes = BlockSizes(),
                    interpret: bool | None = None, num_warps: int | None = None,
                    num_stages: int = 2):
  """Flash attention with the semantics of `kernels.reference.attention`; differentiable.

  Memory is O(L) per head: scores exist only as [block, block] tiles, and the forward saves the
  output and a logsumexp per row for the backward. Sequences are padded up to a multiple of the
  largest block (padded keys are masked, padded rows dropped) and head dims to powers of two.

  Args:
    q: [B, L, H, d] queries; k: [B, L, K, d], v: [B, L, K, dv] with H a multiple of K (GQA, K/V
      not repeated); dv may differ from d (MLA: d = 192, dv = 128).
    segment_ids: optional [B, L] int document ids; packed documents never attend to each other.
    causal: mask future positions; key blocks past a query block's diagonal are skipped.
    window: > 0 (needs causal): query i sees keys j with i - window < j <= i (Mistral's sliding
      window); key blocks wholly outside it are skipped, forward and backward.
    sm_scale: score scale, default d ** -0.5.
    block_sizes: tile sizes (powers of two).
    interpret: True runs the Pallas interpreter (CPU), False the Triton kernel; None picks per
      lowering platform (interpreter on CPU, Triton on GPU).
    num_warps, num_stages: Triton launch parameters (num_warps: 4 for head dims <= 64, else 8).
  Returns:
    [B, L, H, dv] in q's dtype (float32 accumulation for bf16 inputs).
  """
  length, dv = q.shape[1], v.shape[-1]
  out = _flash(*prepare(q, k, v, segment_ids, causal=causal, window=window, sm_scale=sm_scale,
                        block_sizes=block_sizes, interpret=interpret, num_warps=num_warps,
                        num_stages=num_stages))
  return out if out.shape[1] == length and out.shape[3] == dv else out[:, :length, :, :dv]


def visit_counts(q, k, v, segment_ids=None, **options):
  """Trip counts of the kernels' block loops, an int32 per program (the tests check them, and
  benchmarks/attention_paths.py reports the work a window skips): "fwd" [L / block_q,
  B, H] and "dq" [L / block_q_bwd, B, H] key blocks; "dkv" [L / block_k_bwd, B, K] query blocks
  summed over the group's heads. `options`: flash_attention's; L and blocks as padded/shrunk."""
  q, k, v, seg, st = prepare(q, k, v, segment_ids, count_visits=True, **options)
  out, lse, fwd = forward_kernel(q, k, v, seg, st)
  return {"fwd": fwd, **backward_kernels(q, k, v, seg, out, lse, jnp.zeros_like(out), st)[3]}
