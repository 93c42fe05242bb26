"""fp8 projections with per-tensor delayed scaling: e4m3 operands forward, e5m2 output gradients.

Delayed scaling (Micikevicius et al. 2022, arXiv:2209.05433; Transformer Engine's default
recipe): each tensor is cast with a scale derived from the amaxes of the previous steps, kept as
an amax history per tensor (newest first):

    scale = fmax / max(history) / 2^margin       (1 while the history is all zeros)
    q     = cast_fp8(clip(x * scale, -fmax, fmax)),   x ~ q / scale

The matmul runs on the fp8 operands with a float32 result, which is then divided by both scales.

The histories are parameters (logical name FP8_HISTORY), so they live in the train state and its
checkpoints with no extra plumbing. Their new values come out of the backward pass as their
"gradients" (flax's fp8_ops trick): `fp8_einsum` is a custom_vjp whose cotangent for each history
is that history with this step's amax rolled in. The train step then *overwrites* those leaves
with it; the optimizer never moves them (trainer/optim.py freezes them, weight decay skips them).
The amaxes are jnp.max over the whole logical array: under jit with GSPMD XLA reduces a sharded
operand's max over all its shards (an all-reduce max), so every replica holds the same state.
The current-scaling recipes (tensorwise, rowwise, blockwise) are in models/fp8/current.py.
"""

import functools

import jax
import jax.numpy as jnp

from kernels.pallas_triton import varying_like
from kernels.residuals import keep

E4M3 = jnp.float8_e4m3fn  # forward operands: more mantissa (max 448)
E5M2 = jnp.float8_e5m2  # gradients: more range (max 57344)
FP8_HISTORY = "fp8_history"  # logical dim name of the amax histories (replicated: unknown name)
HISTORIES = ("fp8_x", "fp8_w", "fp8_g")  # per projection: input, weight, output gradient


def scale_from_amax(amax: jax.Array, dtype, margin: int = 0) -> jax.Array:
  """fmax / amax / 2^margin, elementwise; 1 where the amax is 0 (nothing to scale) or not finite."""
  amax = amax.astype(jnp.float32)
  scale = jnp.float32(jnp.finfo(dtype).max) / amax / (2.0 ** margin)
  # Two comparisons (both false for NaN), not isfinite: XLA:GPU fuses a comparison into the
  # GEMM that divides by the scale, where an is-finite stayed a kernel of its own per scale.
  return jnp.where((amax > 0) & (amax < jnp.inf), scale, 1.0).astype(jnp.float32)


def scale_from_history(history: jax.Array, dtype, margin: int) -> jax.Array:
  """The scale from the largest amax of the window; 1 before any amax is known."""
  return scale_from_amax(jnp.max(history), dtype, margin)


def quantize(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
  """x * scale, saturated to the format's range, cast to fp8 (round to nearest even)."""
  fmax = jnp.float32(jnp.finfo(dtype).max)
  return jnp.clip(x.astype(jnp.float32) * scale, -fmax, fmax).astype(dtype)


def roll_in(history: jax.Array, x: jax.Array) -> jax.Array:
  """The history with max|x| (over the whole logical array) as the newest entry."""
  amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  return jnp.concatenate([amax[None], history[:-1]])


def transposed(eqn: str) -> tuple[str, str]:
  """For `x,w->y`: the einsums giving dx from (dy, w) and dw from (x, dy)."""
  inputs, out = eqn.split("->")
  x, w = inputs.split(",")
  return f"{out},{w}->{x}", f"{x},{out}->{w}"


def scaled_dot(eqn, a, b, scale_a, scale_b, dtype):
  """einsum of two fp8 operands with per-tensor scales, divided by both scales, in `dtype`.

  The GEMM accumulates in float32 and returns `dtype`, as the bf16 step's GEMMs do: where XLA
  splits the contraction over devices (dw under data parallelism, the o and down projections
  under tensor parallelism), it reduces the partial results in that dtype, not in float32. The
  scales divide in `dtype` too, as flax's fp8_ops dequantizes: that is the pattern XLA:GPU folds
  into a cuBLASLt fp8 GEMM's scale operand (tests/test_fp8_recipes.py). In bf16 the product of
  the two scales rounds to bf16 (relative 2^-9, one factor per GEMM); in float32 nothing rounds.
  """
  y = jnp.einsum(eqn, a, b, preferred_element_type=dtype)
  return y / (scale_a * scale_b).astype(dtype)


def quantize_weight(w: jax.Array, w_history: jax.Array, margin: int):
  """(fp8 w, its scale, w_history with max|w| rolled in): what one step uses for w, whichever
  microbatch (models/fp8/weights.py computes it once per step)."""
  scale = scale_from_history(w_history, E4M3, margin)
  return quantize(w, scale, E4M3), scale, roll_in(w_history, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def fp8_einsum(eqn: str, margin: int, x, w, x_history, w_history, g_history, weight=None):
  """einsum(eqn, x, w) in fp8; x in the compute dtype (the result's), w in dw's dtype.

  Differentiating gives dx and dw (computed from the same fp8 operands and the e5m2 gradient)
  and, for the three histories, their updated values (see the module docstring). `weight`:
  quantize_weight(w, w_history, margin) computed beforehand (then w only types dw), or None.
  """
  return _forward(eqn, margin, x, w, x_history, w_history, g_history, weight)[0]


def _forward(eqn, margin, x, w, x_history, w_history, g_history, weight=None):
  sx = scale_from_history(x_history, E4M3, margin)
  qx = quantize(x, sx, E4M3)
  qw, sw, new_w_history = weight if weight is not None else quantize_weight(w, w_history, margin)
  # A weight quantized before a region manual over some axes (the expert loop's) enters it
  # invariant; its history's new value is typed as the history it replaces.
  new_w_history = varying_like(new_w_history, w_history)
  y = scaled_dot(eqn, qx, qw, sx, sw, x.dtype)
  # Residuals are the fp8 operands (1 byte per element, not the compute dtype's 2 or 4). Kept,
  # with the output (its scaled value: then XLA can fold the scales into the GEMM), under
  # remat="none" (kernels/residuals.py).
  residuals = (qx, qw, sx, sw, roll_in(x_history, x), new_w_history, g_history,
               jnp.zeros((), w.dtype))
  return keep(y), keep(residuals)


def _backward(eqn, margin, residuals, g):
  qx, qw, sx, sw, x_history, w_history, g_history, w_zero = residuals
  sg = scale_from_history(g_history, E5M2, margin)
  qg = quantize(g, sg, E5M2)
  dx_eqn, dw_eqn = transposed(eqn)
  dx = scaled_dot(dx_eqn, qg, qw, sg, sw, g.dtype)
  dw = scaled_dot(dw_eqn, qx, qg, sx, sg, w_zero.dtype)
  # None: no cotangent for a precomputed weight (it is not differentiated; w gets dw).
  return dx, dw, x_history, w_history, roll_in(g_history, g), None


fp8_einsum.defvjp(_forward, _backward)
