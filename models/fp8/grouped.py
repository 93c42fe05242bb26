"""fp8 for the dropless MoE's grouped GEMMs: the tensorwise and rowwise recipes, per expert.

Rows x [M, K] sorted by expert (group), weights w [G, K, N]; y[r] = x[r] @ w[g(r)]. The scales
are those of the einsum ("dropping") dispatch's "EBCD,EDF->EBCF" under models/fp8/current.py:

  tensorwise  one scale per operand (all rows; all experts' weights).
  rowwise     x per row (amax over K), w per (expert, column) (amax over K). Backward: dx = dy w^T
              contracts over N, so dy per row and w per (expert, k); dW[g] = x_g^T dy_g contracts
              over the rows of group g, so x per (expert, k) and dy per (expert, n), each amax
              over that group's rows only.

The GEMMs (`impl`): "pallas", kernels/grouped_matmul.py's fp8 kernels (f8 tiles into Triton's dot,
float32 accumulation, scales applied to the output tiles); "ragged_dot", jax.lax.ragged_dot on the
f8 operands (float32 result), the scales applied to its output. What XLA makes of the latter
(jax 0.10.2, tests/test_fp8_experts.py): for H100 the dot keeps its f8 operands (a Triton GEMM
fusion), over the same masked copy of the rows per expert as in bf16 (E times the FLOPs); XLA:CPU
converts the f8 operands to float32 before its dot, which is exact (a product of two f8 values
fits float32's mantissa), so CPU gives what an f8 GEMM with float32 accumulation gives, up to
summation order. Neither path widens to bf16. "capacity": batched GEMMs of the f8 operands over
equal slots per expert (kernels/capacity_matmul.py), a Triton GEMM fusion with f8 operands for
H100; tensorwise scales divided in the output dtype, as the dense fp8 GEMMs divide them
(models/fp8/delayed.py's scaled_dot), rowwise as ragged_dot's.

The output gradient is e4m3 here, not e5m2 as in the dense projections: Pallas's Triton lowering
takes no dot of two different f8 types ("a and b must have the same element type"), and both
paths quantize alike so that they compute the same numbers. Current scaling puts each gradient
amax at e4m3's 448 (torchao's rowwise recipe and DeepSeek-V3 keep gradients in e4m3 likewise).

Weights are quantized from the copy the dropless region receives (the compute dtype, what FSDP
gathers into it), as the einsum dispatch's projections quantize theirs (models/layers.py).

Sharding: inside the dropless shard_map each device holds some rows, experts and hidden columns
(sharding/expert.py's ExpertAxes); every amax is pmax'ed over the mesh axes that spread its
elements (`GemmAxes`), so a layout quantizes exactly as one device does. Delayed scaling (amax
histories as parameters) and blockwise (1 x 128 tiles along ragged groups) are refused with the
dropless dispatch (models/fp8/config.py).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kernels.capacity_matmul import capacity_matmul, capacity_weight_grad
from kernels.grouped_matmul import grouped_matmul_fp8, grouped_weight_grad_fp8, summed_like
from kernels.residuals import keep
from models.fp8.delayed import E4M3, quantize, scale_from_amax
from models.fp8.config import GROUPED_RECIPES

RECIPES = GROUPED_RECIPES  # what models/fp8/config.py lets the dropless experts take
IMPLS = ("pallas", "ragged_dot", "capacity")
GRAD = E4M3  # the output gradient's format (see the module docstring)


class GemmAxes(NamedTuple):
  """Mesh axes (inside the dropless region) over which one grouped GEMM's amaxes are reduced;
  and, for impl "capacity", its slots an expert (kernels/capacity_matmul.py; 0: M / G)."""
  k: tuple[str, ...] = ()  # split the forward's contraction K (the down projection's hidden dim)
  n: tuple[str, ...] = ()  # split the output columns N (gate's and up's hidden dim)
  rows: tuple[str, ...] = ()  # hold other rows of the same experts (dW's contraction)
  every: tuple[str, ...] = ()  # all of the above and the experts': a tensor's amax
  slots: int = 0


def _amax(t: jax.Array, axes: tuple[str, ...], axis=None) -> jax.Array:
  amax = jnp.max(jnp.abs(t), axis=axis).astype(jnp.float32)
  return lax.pmax(amax, axes) if axes else amax


def group_ids(group_sizes: jax.Array, rows: int) -> jax.Array:
  """The group of each row [M] (G for rows past the groups): how many group ends it has passed
  (a compare-and-count, as sharding/expert.py does, for vmap under shard_map)."""
  ends = jnp.cumsum(group_sizes)
  return jnp.sum(ends[None, :] <= jnp.arange(rows)[:, None], axis=1)


def quantize_rows(recipe: str, t: jax.Array, contracted: tuple, every: tuple, dtype):
  """t [M, C] contracted over C: (fp8 t, scales [M], or a scalar for tensorwise)."""
  if recipe == "tensorwise":
    scale = scale_from_amax(_amax(t, every), dtype)
    return quantize(t, scale, dtype), scale
  scale = scale_from_amax(_amax(t, contracted, axis=1), dtype)
  return quantize(t, scale[:, None], dtype), scale


def quantize_weight(recipe: str, w: jax.Array, axis: int, contracted: tuple, every: tuple, dtype):
  """w [G, K, N] contracted over `axis` (1: K, 2: N): (fp8 w, scales [G, the other dim])."""
  if recipe == "tensorwise":
    scale = scale_from_amax(_amax(w, every), dtype)
    return quantize(w, scale, dtype), scale
  scale = scale_from_amax(_amax(w, contracted, axis=axis), dtype)
  return quantize(w, jnp.expand_dims(scale, axis), dtype), scale


def quantize_group_columns(t: jax.Array, groups: jax.Array, num_groups: int, rows: tuple, dtype):
  """t [M, C] contracted over the rows of each group (rowwise dW): (fp8 t, scales [G, C]); rows
  past the groups keep scale 1 (the GEMMs ignore them)."""
  amax = jax.ops.segment_max(jnp.abs(t).astype(jnp.float32), groups, num_segments=num_groups)
  scale = scale_from_amax(lax.pmax(amax, rows) if rows else amax, dtype)  # empty group: -inf -> 1
  per_row = jnp.where((groups < num_groups)[:, None],
                      scale[jnp.minimum(groups, num_groups - 1)], 1.0)
  return quantize(t, per_row, dtype), scale


def _per_row(scale, groups, num_groups):
  """A [G, N] (or scalar) scale at each row's group: [M, N] (or the scalar)."""
  if scale.ndim == 0:
    return scale
  return scale[jnp.minimum(groups, num_groups - 1)]


def grouped_gemm(impl: str, x, w, group_sizes, x_scale, w_scale, out_dtype, transposed=False,
                 slots=0):
  """x [M, K] fp8 (scales [M] or scalar) @ w [G, K, N] fp8 (scales [G, N] or scalar) per group;
  `transposed`: w given as [G, N, K], multiplied transposed (the Pallas kernel reads it as it is
  stored, kernels/grouped_matmul.py says why)."""
  if impl == "pallas":
    return grouped_matmul_fp8(x, w, group_sizes, x_scale, w_scale, out_dtype=out_dtype,
                              transposed=transposed)
  if impl == "capacity" and x_scale.ndim == 0 and w_scale.ndim == 0:
    # Tensorwise: divided in out_dtype, as scaled_dot (models/fp8/delayed.py) says why.
    return capacity_matmul(x, w, group_sizes, slots=slots, transposed=transposed,
                           preferred_element_type=out_dtype, scale=x_scale * w_scale)
  if impl == "capacity":
    y = capacity_matmul(x, w, group_sizes, slots=slots, transposed=transposed,
                        preferred_element_type=jnp.float32)
  else:
    y = lax.ragged_dot(x, jnp.swapaxes(w, 1, 2) if transposed else w, group_sizes,
                       preferred_element_type=jnp.float32)
  groups = group_ids(group_sizes, x.shape[0])
  row = x_scale[:, None] if x_scale.ndim else x_scale
  return (y / (row * _per_row(w_scale, groups, w.shape[0]))).astype(out_dtype)


# dW = x^T dy per group: the rows are ragged and contracted, no free dim is grouped.
_WEIGHT_GRAD_DIMS = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[])


def grouped_weight_gemm(impl: str, x, dy, group_sizes, x_scale, dy_scale, out_dtype, slots=0):
  """dW [G, K, N] = per group x_g^T dy_g from fp8 x [M, K] and dy [M, N], scales [G, K] and
  [G, N] (or scalars)."""
  if impl == "pallas":
    return grouped_weight_grad_fp8(x, dy, group_sizes, x_scale, dy_scale, out_dtype=out_dtype)
  if impl == "capacity" and x_scale.ndim == 0:
    return capacity_weight_grad(x, dy, group_sizes, slots=slots,
                                preferred_element_type=out_dtype, scale=x_scale * dy_scale)
  if impl == "capacity":
    dw = capacity_weight_grad(x, dy, group_sizes, slots=slots, preferred_element_type=jnp.float32)
  else:
    dw = lax.ragged_dot_general(x, dy, group_sizes, _WEIGHT_GRAD_DIMS,
                                preferred_element_type=jnp.float32)
  scale = x_scale[:, :, None] * dy_scale[:, None, :] if x_scale.ndim else x_scale * dy_scale
  return (dw / scale).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def quantized_grouped(recipe: str, impl: str, axes: GemmAxes, input_kept: bool, x, w,
                      group_sizes):
  """ragged_dot(x, w, group_sizes) in fp8 with current scaling (`recipe` in RECIPES).

  x: [M, K] rows sorted by group, the compute dtype (the result's); w: [G, K, N] (dW's dtype).
  Differentiating gives dx and dW from fp8 GEMMs with the output gradient in e4m3 (GRAD).
  `input_kept`: x's fp8 copy (rowwise: x) is named for remat="none" to keep; False where x is
  cheap to make again from what the layer keeps anyway (the down projection's input, the SwiGLU
  product of the kept gate and up outputs): the backward then makes it again instead of the
  layer holding it (tests/test_fp8_expert_residuals.py).
  """
  return _forward(recipe, impl, axes, input_kept, x, w, group_sizes)[0]


def _forward(recipe, impl, axes, input_kept, x, w, group_sizes):
  qx, sx = quantize_rows(recipe, x, axes.k, axes.every, E4M3)
  qw, sw = quantize_weight(recipe, w, 1, axes.k, axes.every, E4M3)
  y = grouped_gemm(impl, qx, qw, group_sizes, sx, sw, x.dtype, slots=axes.slots)
  # tensorwise: the fp8 operands (1 byte per element), whose one scale serves every GEMM;
  # rowwise: x and w as given, because dx and dW scale them along other dims (fp8_current.py).
  saved = (qx, sx, qw, sw) if recipe == "tensorwise" else (x, w)
  # Kept under remat="none", with the (scaled) output (kernels/residuals.py); x's copy only
  # where `input_kept` (else the remat policy decides, and recomputes it).
  saved = (keep(saved[0]) if input_kept else saved[0], *keep(saved[1:]))
  return keep(y), (saved, group_sizes, jnp.zeros((), w.dtype))


def _backward(recipe, impl, axes, input_kept, residuals, g):
  saved, group_sizes, w_zero = residuals
  if recipe == "tensorwise":
    qx, sx, qw, sw = saved
    qg, sg = quantize_rows(recipe, g, (), axes.every, GRAD)
    dx = grouped_gemm(impl, qg, qw, group_sizes, sg, sw, g.dtype, True, axes.slots)
    dw = grouped_weight_gemm(impl, qx, qg, group_sizes, sx, sg, w_zero.dtype, axes.slots)
    x, w = qx, qw
  else:
    x, w = saved
    qg, sg = quantize_rows(recipe, g, axes.n, axes.every, GRAD)
    qw, sw = quantize_weight(recipe, w, 2, axes.n, axes.every, E4M3)
    dx = grouped_gemm(impl, qg, qw, group_sizes, sg, sw, g.dtype, True, axes.slots)
    groups, num_groups = group_ids(group_sizes, x.shape[0]), w.shape[0]
    qx, sx = quantize_group_columns(x, groups, num_groups, axes.rows, E4M3)
    qg, sg = quantize_group_columns(g, groups, num_groups, axes.rows, GRAD)
    dw = grouped_weight_gemm(impl, qx, qg, group_sizes, sx, sg, w_zero.dtype, axes.slots)
  return summed_like(dx, x), summed_like(dw, w), None


quantized_grouped.defvjp(_forward, _backward)
