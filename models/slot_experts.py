"""The dropless experts' SwiGLU run whole on slots (`model.moe.grouped_matmul=slots`).

grouped_matmul=capacity (kernels/capacity_matmul.py) gives each of a device's G experts C slots
and runs every GEMM of the SwiGLU as one batched GEMM over them, but each GEMM gathers its rows
into the slots and its products back out (gate, up and down apart, forward and backward), and in
fp8 quantizes x once for gate and once for up, keeping both copies for the backward. Here a
round gathers C rows of every expert into [G, C, D] once (x quantized once, before the gather),
runs gate, up, the SwiGLU and down on the slots, and gathers the products back once; the
backward likewise (one gather of the output gradient in, one of dx out, dx of gate and up
summed in the slots). Padding slots hold zeros: every product, gradient and amax they add is 0.

Rows past an expert's C slots run in later rounds, in loops as many times as the largest expert
needs (named OVERFLOW_ROUNDS: counted 0 times by the compiled-program analysis, the predicted
case); the backward runs a later round's forward again. In fp8 (tensorwise) x and the output
gradient are scaled by all their rows' amaxes; the SwiGLU product and its gradients by a round's
(in one round, all rows': then the numbers are grouped_matmul=capacity's).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels.capacity_matmul import as_stored, overflow_rounds, rows_to_slots, slots_to_rows
from kernels.grouped_matmul import summed_like
from kernels.residuals import keep
from models.fp8.delayed import E4M3, quantize
from models.fp8.grouped import quantize_rows


class SlotPrecision(NamedTuple):
  """fp8 tensorwise (each amax reduced over the mesh axes `every` of the dropless region,
  models/fp8/grouped.py's GemmAxes.every) or, `fp8` False, the GEMMs in the compute dtype."""
  fp8: bool = False
  every: tuple[str, ...] = ()


def _quantized(t, precision: SlotPrecision):
  """(fp8 t, its tensorwise scale), or (t, None) without fp8. The output gradients are e4m3 too,
  as the grouped fp8 GEMMs' (models/fp8/grouped.py says why)."""
  if not precision.fp8:
    return t, None
  return quantize_rows("tensorwise", t, (), precision.every, E4M3)


def _gemm(eqn, a, a_scale, b, b_scale, dtype):
  """einsum of (fp8) operands, divided by their scales in `dtype` (XLA:GPU folds that into the
  GEMM, as for the dense fp8 projections)."""
  y = jnp.einsum(eqn, a, b, preferred_element_type=dtype)
  return y if a_scale is None else y / (a_scale * b_scale).astype(dtype)


def _swiglu(gate_out, up_out):
  return jax.nn.silu(gate_out) * up_out


class _Weights(NamedTuple):
  gate: jax.Array
  gate_scale: jax.Array | None
  up: jax.Array
  up_scale: jax.Array | None
  down: jax.Array
  down_scale: jax.Array | None


def _round(r, qx, x_scale, w: _Weights, group_sizes, order, slots, precision, dtype):
  """Round r's slots through the SwiGLU: (products [G, C, D], gate and up outputs, h's scale)."""
  xs = rows_to_slots(qx, group_sizes, slots, r, order)
  gate_out = _gemm("gcd,gdf->gcf", xs, x_scale, w.gate, w.gate_scale, dtype)
  up_out = _gemm("gcd,gdf->gcf", xs, x_scale, w.up, w.up_scale, dtype)
  qh, h_scale = _quantized(_swiglu(gate_out, up_out), precision)
  return _gemm("gcf,gfd->gcd", qh, h_scale, w.down, w.down_scale, dtype), gate_out, up_out, h_scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def slot_swiglu(x_AD, group_sizes, gate, up, down, order, back, slots: int,
                precision: SlotPrecision = SlotPrecision()):
  """Rows x [A, D] grouped by expert (group_sizes [G]; rows past them are padding) through their
  expert's SwiGLU (gate, up [G, D, F], down [G, F, D]): [A, D], zeros for the padding rows, in
  x's dtype (the weights' gradients in theirs). `order` and `back` (int [A], or both None: x is
  sorted): x's rows are not sorted by expert, sorted row i is x[order[i]], `back` the inverse;
  the slots gather through both, so the sorted rows are never written (the exchange's received
  rows, sharding/exchange_rounds.py). `slots`: C, an expert's slots a round."""
  return _forward(x_AD, group_sizes, gate, up, down, order, back, slots, precision)[0]


def _forward(x, group_sizes, gate, up, down, order, back, slots, precision):
  qx, x_scale = _quantized(x, precision)
  # The (fp8) weights read as stored (kernels/capacity_matmul.as_stored says why).
  quantized = [_quantized(p, precision) for p in (gate, up, down)]
  w = _Weights(*(t for q, scale in quantized for t in (as_stored(q), scale)))

  # The loop's operands flat: its replicas' custom_vmap (kernels/per_replica.py) takes arrays.
  def later(r, y, qx, x_scale, group_sizes, order, back, *w):
    return slots_to_rows(_round(r, qx, x_scale, _Weights(*w), group_sizes, order, slots,
                                precision, x.dtype)[0], group_sizes, slots, r, y, back)
  products, gate_out, up_out, h_scale = _round(0, qx, x_scale, w, group_sizes, order, slots,
                                               precision, x.dtype)
  y = slots_to_rows(products, group_sizes, slots, 0, jnp.zeros_like(x, shape=(x.shape[0],
                                                                             down.shape[2])), back)
  y = overflow_rounds(group_sizes, slots, later, y, qx, x_scale, group_sizes, order, back, *w)
  # Kept under remat="none" (kernels/residuals.py): x's fp8 copy (rows: the later rounds gather
  # theirs from it), the fp8 weights, the first round's gate and up outputs.
  kept = keep((qx, x_scale, w, gate_out, up_out, h_scale))
  return keep(y), (kept, group_sizes, order, back, (x[:, :0], gate[:0], up[:0], down[:0]))


def _round_backward(r, g_rows, g_scale, qx, x_scale, w, group_sizes, order, gate_out, up_out,
                    h_scale, slots, precision, dtypes):
  """Round r's gradients: (dx in slots [G, C, D], dW of gate, up, down)."""
  x_dtype, w_dtype = dtypes
  gs = rows_to_slots(g_rows, group_sizes, slots, r, order)
  xs = rows_to_slots(qx, group_sizes, slots, r, order)
  h = _swiglu(gate_out, up_out)  # the down GEMM's input again, quantized as the forward did
  qh = h if h_scale is None else quantize(h, h_scale, E4M3)
  d_down = _gemm("gcf,gcd->gfd", qh, h_scale, gs, g_scale, w_dtype)
  dh = _gemm("gcd,gfd->gcf", gs, g_scale, w.down, w.down_scale, x_dtype)
  d_gate_out, d_up_out = jax.vjp(_swiglu, gate_out, up_out)[1](dh)
  (qg_gate, s_gate), (qg_up, s_up) = (_quantized(t, precision) for t in (d_gate_out, d_up_out))
  dxs = _gemm("gcf,gdf->gcd", qg_gate, s_gate, w.gate, w.gate_scale, x_dtype) + \
      _gemm("gcf,gdf->gcd", qg_up, s_up, w.up, w.up_scale, x_dtype)
  return (dxs, _gemm("gcd,gcf->gdf", xs, x_scale, qg_gate, s_gate, w_dtype),
          _gemm("gcd,gcf->gdf", xs, x_scale, qg_up, s_up, w_dtype), d_down)


def _backward(slots, precision, residuals, g):
  (qx, x_scale, w, gate_out, up_out, h_scale), group_sizes, order, back, like = residuals
  x, gate, up, down = like
  dtypes = (x.dtype, gate.dtype)
  g_rows, g_scale = _quantized(g, precision)
  dxs, *dws = _round_backward(0, g_rows, g_scale, qx, x_scale, w, group_sizes, order, gate_out,
                              up_out, h_scale, slots, precision, dtypes)
  dx = slots_to_rows(dxs, group_sizes, slots, 0, jnp.zeros_like(g), back)  # [A, D], as y

  def later(r, carry, g_rows, g_scale, qx, x_scale, group_sizes, order, back, *w):
    dx, dws = carry
    w = _Weights(*w)
    _, gate_out, up_out, h_scale = _round(r, qx, x_scale, w, group_sizes, order, slots,
                                          precision, x.dtype)
    dxs, *more = _round_backward(r, g_rows, g_scale, qx, x_scale, w, group_sizes, order,
                                 gate_out, up_out, h_scale, slots, precision, dtypes)
    return (slots_to_rows(dxs, group_sizes, slots, r, dx, back),
            [a + b for a, b in zip(dws, more)])
  dx, dws = overflow_rounds(group_sizes, slots, later, (dx, dws), g_rows, g_scale, qx, x_scale,
                            group_sizes, order, back, *w)
  return (summed_like(dx, x), None,
          *(summed_like(dw, p) for dw, p in zip(dws, (gate, up, down))), None, None)


slot_swiglu.defvjp(_forward, _backward)
