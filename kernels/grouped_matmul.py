"""A grouped matmul for the MoE's sorted rows (Pallas; Triton on GPUs, the interpreter on CPU).

`grouped_matmul(x, w, group_sizes)` is `jax.lax.ragged_dot`: rows [M, K] sorted by group, the
first group_sizes[0] rows times w[0] [K, N], the next group_sizes[1] rows times w[1], ...; rows
past the groups give zeros. This jax's XLA:GPU runs ragged_dot as one dense GEMM over a masked
copy of the rows per group (E times the FLOPs; tests/test_kernels_gpu.py), which is why this
kernel exists: each [bm, bn] output tile multiplies its rows by the weights of only the groups
those rows belong to (one, or a few where a tile straddles group boundaries).

Backward: dx is the same kernel over dy and the transposed weights; dw[g] = x_g^T dy_g, one
program per (group, K tile, N tile) looping over the row tiles of its group (`_dw_kernel`).

fp8 (`grouped_matmul_fp8`, `grouped_weight_grad_fp8`; models/fp8/grouped.py quantizes and
differentiates): the same kernels on f8 operands, each with float32 scales (q ~ value x scale).
The dot takes the f8 tiles as they are (Triton's f8 dot on H100, float32 accumulation); the
forward divides each group's partial tile by that group's column scales before adding it, then
the tile by its rows' scales; dW divides its tile by the outer product of its group's scales.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels.pallas_triton import out_type, triton_call


@dataclasses.dataclass(frozen=True)
class GroupedBlocks:
  """Tile sizes (powers of two, the Triton lowering's rule): rows, the contracted dim, columns."""

  block_m: int = 64
  block_k: int = 64
  block_n: int = 128


@dataclasses.dataclass(frozen=True)
class _Static:
  blocks: GroupedBlocks
  interpret: bool | None  # None: the interpreter on CPU, Triton elsewhere (picked at lowering)
  num_warps: int = 4
  num_stages: int = 2


def _pallas(kernel, st: _Static, name: str, **call_kw):
  return triton_call(kernel, name=name, interpret=st.interpret, num_warps=st.num_warps,
                     num_stages=st.num_stages, **call_kw)


def _scalar(ref, i):
  return ref[pl.ds(i, 1)][0]


def _rows_kernel(first_ref, last_ref, start_ref, end_ref, x_ref, w_ref, *refs, bm, bk, steps,
                 transposed):
  """Output tile (i, j): its rows through each group g in [first, last] that holds some of them,
  each row masked to its own group. `refs`: the output, or (fp8) the rows' reciprocal scales
  [bm], the groups' reciprocal column scales [G, bn] and the output. `transposed`: w_ref holds
  the weights as [G, bn, K], each tile transposed here."""
  i = pl.program_id(0)
  rows = i * bm + jnp.arange(bm)
  scaled, o_ref = len(refs) == 3, refs[-1]

  def group(g, acc):
    inside = (rows >= _scalar(start_ref, g)) & (rows < _scalar(end_ref, g))

    def contract(kk, acc):
      x = x_ref[:, pl.ds(kk * bk, bk)]
      x = jnp.where(inside[:, None], x, jnp.zeros_like(x))
      w = w_ref[g, :, pl.ds(kk * bk, bk)].T if transposed else w_ref[g, pl.ds(kk * bk, bk), :]
      return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)
    if not scaled:  # one accumulator: rows outside g add exact zeros
      return lax.fori_loop(0, steps, contract, acc)
    # fp8: the column scales differ per group, so each group's partial tile is rescaled alone.
    part = lax.fori_loop(0, steps, contract, jnp.zeros(o_ref.shape, jnp.float32))
    return acc + part * refs[1][pl.ds(g, 1), :]

  acc = jnp.zeros(o_ref.shape, jnp.float32)
  acc = lax.fori_loop(_scalar(first_ref, i), _scalar(last_ref, i) + 1, group, acc)
  if scaled:
    acc = acc * refs[0][...][:, None]
  o_ref[...] = acc.astype(o_ref.dtype)


def _dw_kernel(first_ref, last_ref, start_ref, end_ref, x_ref, dy_ref, *refs, bm):
  """dW tile (g, a, b): sum over the row tiles of group g of x_tile^T dy_tile (rows masked to g).
  `refs`: dW, or (fp8) group g's reciprocal scales of x's columns [bk] and dy's [bn], and dW."""
  g = pl.program_id(0)
  dw_ref = refs[-1]
  start, end = _scalar(start_ref, g), _scalar(end_ref, g)

  def tile(t, acc):
    rows = t * bm + jnp.arange(bm)
    inside = (rows >= start) & (rows < end)
    x = x_ref[pl.ds(t * bm, bm), :]
    x = jnp.where(inside[:, None], x, jnp.zeros_like(x))
    return acc + jnp.dot(x.T, dy_ref[pl.ds(t * bm, bm), :], preferred_element_type=jnp.float32)

  acc = jnp.zeros(dw_ref.shape, jnp.float32)
  acc = lax.fori_loop(_scalar(first_ref, g), _scalar(last_ref, g) + 1, tile, acc)
  if len(refs) == 3:
    acc = acc * refs[0][...][:, None] * refs[1][...][None, :]
  dw_ref[...] = acc.astype(dw_ref.dtype)


def _bounds(group_sizes, rows: int, bm: int):
  """Group row ranges and, per row tile, the first and last group holding its rows; per group,
  its first and last row tile (last < first for an empty group)."""
  sizes = group_sizes.astype(jnp.int32)
  end = jnp.cumsum(sizes)
  start = end - sizes
  tiles = rows // bm
  tile_start = jnp.arange(tiles, dtype=jnp.int32) * bm
  # The group holding a row: how many groups end at or before it. Rows past every group map to
  # an index past the last group: their tiles loop over no group (last < first).
  first = jnp.sum(end[None, :] <= tile_start[:, None], axis=1).astype(jnp.int32)
  last = jnp.sum(end[None, :] <= (tile_start + bm - 1)[:, None], axis=1).astype(jnp.int32)
  last = jnp.minimum(last, sizes.shape[0] - 1)
  group_first = start // bm
  group_last = jnp.where(sizes > 0, (end - 1) // bm, group_first - 1)
  return start, end, first, last, group_first.astype(jnp.int32), group_last.astype(jnp.int32)


def _pad_to(x, axis: int, multiple: int):
  pad = -x.shape[axis] % multiple
  if not pad:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths)


def _matmul(x, w, group_sizes, st: _Static, out_dtype, scales=(), transposed=False):
  """The forward kernel over padded operands: x [M, K], w [G, K, N] -> [M, N]; `scales`: none,
  or (fp8) the reciprocal scales of the rows [M] and of each group's columns [G, N].
  `transposed`: w given as [G, N, K] (x @ w[g]^T), each tile transposed in the kernel: the
  backward's dx reads the weights as they are stored. (A transpose outside made XLA store the
  layer scan's whole stack of expert weights transposed, for the later rounds' backward:
  3.4 GiB of the Qwen3-30B-A3B EP16 program, and its copy each microbatch.)"""
  b = st.blocks
  m, k = x.shape
  n = w.shape[1 if transposed else 2]
  start, end, first, last, _, _ = _bounds(group_sizes, m, b.block_m)
  vec = lambda size: pl.BlockSpec((size,), lambda i, j: (0,))
  kernel = functools.partial(_rows_kernel, bm=b.block_m, bk=b.block_k, steps=k // b.block_k,
                             transposed=transposed)
  groups = w.shape[0]
  w_spec = (pl.BlockSpec((groups, b.block_n, k), lambda i, j: (0, j, 0)) if transposed else
            pl.BlockSpec((groups, k, b.block_n), lambda i, j: (0, 0, j)))
  scale_specs = [pl.BlockSpec((b.block_m,), lambda i, j: (i,)),
                 pl.BlockSpec((groups, b.block_n), lambda i, j: (0, j))][:len(scales)]
  return _pallas(
      kernel, st, "grouped_matmul_fp8" if scales else "grouped_matmul",
      grid=(m // b.block_m, n // b.block_n),
      in_specs=[vec(first.shape[0]), vec(last.shape[0]), vec(groups), vec(groups),
                pl.BlockSpec((b.block_m, k), lambda i, j: (i, 0)), w_spec, *scale_specs],
      out_specs=pl.BlockSpec((b.block_m, b.block_n), lambda i, j: (i, j)),
      out_shape=out_type((m, n), out_dtype, x, w, group_sizes))(
          first, last, start, end, x, w, *scales)


def _weight_grad(x, dy, group_sizes, st: _Static, out_dtype, scales=()):
  """dW [G, K, N] = per group x_g^T dy_g, over padded operands; `scales`: none, or (fp8) the
  reciprocal scales of each group's columns of x [G, K] and of dy [G, N]."""
  b = st.blocks
  m, k = x.shape
  n = dy.shape[1]
  groups = group_sizes.shape[0]
  start, end, _, _, first, last = _bounds(group_sizes, m, b.block_m)
  vec = lambda size: pl.BlockSpec((size,), lambda g, a, c: (0,))
  scale_specs = [pl.BlockSpec((None, b.block_k), lambda g, a, c: (g, a)),
                 pl.BlockSpec((None, b.block_n), lambda g, a, c: (g, c))][:len(scales)]
  return _pallas(
      functools.partial(_dw_kernel, bm=b.block_m), st,
      "grouped_matmul_fp8_dw" if scales else "grouped_matmul_dw",
      grid=(groups, k // b.block_k, n // b.block_n),
      in_specs=[vec(groups)] * 4 + [
          pl.BlockSpec((m, b.block_k), lambda g, a, c: (0, a)),
          pl.BlockSpec((m, b.block_n), lambda g, a, c: (0, c)), *scale_specs],
      out_specs=pl.BlockSpec((None, b.block_k, b.block_n), lambda g, a, c: (g, a, c)),
      out_shape=out_type((groups, k, n), out_dtype, x, dy, group_sizes))(
          first, last, start, end, x, dy, *scales)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped(x, w, group_sizes, st: _Static):
  return _matmul(x, w, group_sizes, st, x.dtype)


def _grouped_fwd(x, w, group_sizes, st):
  return _matmul(x, w, group_sizes, st, x.dtype), (x, w, group_sizes)


def _grouped_bwd(st, residuals, dy):
  x, w, group_sizes = residuals
  dx = _matmul(dy, w, group_sizes, dataclasses.replace(
      st, blocks=GroupedBlocks(st.blocks.block_m, st.blocks.block_n, st.blocks.block_k)), x.dtype,
      transposed=True)
  dw = _weight_grad(x, dy, group_sizes, st, w.dtype)
  return summed_like(dx, x), summed_like(dw, w), None


def summed_like(cotangent, primal):
  """Inside shard_map, a cotangent varying over more mesh axes than its primal (w, replicated
  over the token axes that x and dy vary over) is the per-device part of a sum over them: the
  psum that JAX's own transpose of the implicit broadcast would insert."""
  varying = lambda a: jax.typeof(a).manual_axis_type.varying
  extra = tuple(sorted(varying(cotangent) - varying(primal)))
  return jax.lax.psum(cotangent, extra) if extra else cotangent


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def _checked(x, w, group_sizes, blocks: GroupedBlocks) -> int:
  """The padding multiple of K and N, after checking the shapes and blocks."""
  if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1] or group_sizes.shape != w.shape[:1]:
    raise ValueError(f"grouped_matmul wants x [M, K], w [G, K, N], group_sizes [G]; got"
                     f" {x.shape}, {w.shape}, {group_sizes.shape}")
  return _padding(blocks)


def _padding(blocks: GroupedBlocks) -> int:
  for name, size in dataclasses.asdict(blocks).items():
    if size <= 0 or size & (size - 1):
      raise ValueError(f"grouped_matmul: {name}={size} must be a power of two (Triton tiles)")
  # Largest block of the two a dim meets (K is contracted forward, N backward), for both passes.
  return max(blocks.block_k, blocks.block_n)


def grouped_matmul(x, w, group_sizes, *, blocks: GroupedBlocks = GroupedBlocks(),
                   interpret: bool | None = None):
  """`jax.lax.ragged_dot(x, w, group_sizes)` as a Pallas kernel; differentiable in x and w.

  Args:
    x: [M, K] rows sorted by group; w: [G, K, N]; group_sizes: [G] int, summing to at most M.
    blocks: tile sizes (powers of two); each dim is padded up to its block.
    interpret: True: the Pallas interpreter; False: Triton; None: per lowering platform.
  Returns:
    [M, N] in x's dtype (float32 accumulation).
  """
  kn = _checked(x, w, group_sizes, blocks)
  m, n = x.shape[0], w.shape[2]
  xp = _pad_to(_pad_to(x, 0, blocks.block_m), 1, kn)
  wp = _pad_to(_pad_to(w, 1, kn), 2, kn)
  st = _Static(blocks, interpret)
  return _grouped(xp, wp, group_sizes, st)[:m, :n]


def _reciprocal(scale, shape, axis: int, multiple: int):
  """1 / scale broadcast to `shape` (a scalar scale: tensorwise), `axis` padded with ones."""
  inverse = jnp.broadcast_to(1.0 / jnp.asarray(scale, jnp.float32), shape)
  pad = -shape[axis] % multiple
  widths = [(0, pad if a == axis else 0) for a in range(len(shape))]
  return jnp.pad(inverse, widths, constant_values=1.0) if pad else inverse


def grouped_matmul_fp8(x, w, group_sizes, x_scale, w_scale, *, out_dtype,
                       blocks: GroupedBlocks = GroupedBlocks(), interpret: bool | None = None,
                       transposed: bool = False):
  """y[r] = x[r] @ w[g(r)] / (x_scale[r] w_scale[g(r)]) on fp8 operands (forward only).

  Args:
    x: [M, K] f8 rows sorted by group; w: [G, K, N] f8; group_sizes: [G] int.
    x_scale: [M] or a scalar, float32 (x ~ value x scale); w_scale: [G, N] or a scalar.
    transposed: w given as [G, N, K]: y[r] = x[r] @ w[g(r)]^T (the backward's dx).
  Returns:
    [M, N] in out_dtype (float32 accumulation); rows past the groups give zeros.
  """
  stored = jax.ShapeDtypeStruct((w.shape[0], *w.shape[1:][::-1]), w.dtype) if transposed else w
  kn = _checked(x, stored, group_sizes, blocks)
  m, groups, n = x.shape[0], w.shape[0], w.shape[1 if transposed else 2]
  xp = _pad_to(_pad_to(x, 0, blocks.block_m), 1, kn)
  wp = _pad_to(_pad_to(w, 1, kn), 2, kn)
  scales = (_reciprocal(x_scale, (m,), 0, blocks.block_m),
            _reciprocal(w_scale, (groups, n), 1, kn))
  return _matmul(xp, wp, group_sizes, _Static(blocks, interpret), out_dtype, scales,
                 transposed)[:m, :n]


def grouped_weight_grad_fp8(x, dy, group_sizes, x_scale, dy_scale, *, out_dtype,
                            blocks: GroupedBlocks = GroupedBlocks(),
                            interpret: bool | None = None):
  """dW[g] = x_g^T dy_g / outer(x_scale[g], dy_scale[g]) on fp8 operands: x [M, K], dy [M, N]
  sorted by group, the scales [G, K] and [G, N] (or scalars), float32. Returns [G, K, N]."""
  if x.ndim != 2 or dy.ndim != 2 or x.shape[0] != dy.shape[0]:
    raise ValueError(f"grouped_weight_grad_fp8 wants x [M, K], dy [M, N]; got {x.shape},"
                     f" {dy.shape}")
  kn = _padding(blocks)
  k, n, groups = x.shape[1], dy.shape[1], group_sizes.shape[0]
  xp = _pad_to(_pad_to(x, 0, blocks.block_m), 1, kn)
  dyp = _pad_to(_pad_to(dy, 0, blocks.block_m), 1, kn)
  scales = (_reciprocal(x_scale, (groups, k), 1, kn), _reciprocal(dy_scale, (groups, n), 1, kn))
  return _weight_grad(xp, dyp, group_sizes, _Static(blocks, interpret), out_dtype,
                      scales)[:, :k, :n]
