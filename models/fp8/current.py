"""fp8 projections with current scaling: the tensorwise, rowwise and blockwise recipes.

Delayed scaling (models/fp8/delayed.py) scales a tensor by the amaxes of earlier steps; these recipes scale
it by its own amax, taken as it is quantized, so they keep no state and never saturate:

  tensorwise  one scale per weight, and per sequence of an activation or gradient: a token array
              [B, L, ...] takes the amax over all but its batch dim B (any other operand, such
              as the experts' dispatched rows, one scale). torchao's Float8Linear "tensorwise"
              and Transformer Engine's current scaling take one amax per data-parallel rank,
              over the whole sequences it holds, with no reduction across ranks; per sequence
              is that amax, independent of how the batch is split.
  rowwise     one scale per index of an operand's non-contracted dims, the amax over its contracted
              dims: per row of activations, per column of weights (torchao's "rowwise").
  blockwise   DeepSeek-V3: activations and gradients in 1 x 128 tiles (one scale per index of the
              non-contracted dims and per 128 elements of the flattened contracted dims), weights
              in 128 x 128 blocks (per 128 contracted x 128 flattened free elements). The
              contraction is split into its blocks as a batch dim of the einsum; each block's
              float32 partial product is rescaled by its two scales and the blocks are summed in
              float32. Block = min(128, size): a size over 128 must be a multiple of 128. Cost
              of this formulation (no fused kernel): the [blocks, *out] float32 partial products
              are materialized, blocks x the output (32x at a 4096 contraction).

Every GEMM of the step quantizes its operands along its own contraction: for y = x.w, dx = dy.w^T
contracts over the output's dims (w's free dims) and dw = x^T.dy over the token dims. Forward
operands are e4m3, output gradients e5m2; scales are float32 fmax / amax (not rounded to powers
of two), 1 for an all-zero tile.

Sharding: amaxes are jnp.max over the logical arrays, and the blocks are cut from the logical
arrays too, so under GSPMD every layout computes what one device computes (a sharded amax is an
all-reduce max; a block or row split over devices gets its max the same way). A sequence's amax
is reduced only over the devices that split its tokens (sequence and context parallelism, as
Transformer Engine reduces over the tensor-parallel group); data parallelism reduces none. A
block that straddles two shards is still one block, whichever layout: no layout is refused, but
blockwise's transposes and reshapes into blocks cost collectives GSPMD adds
(tests/test_fp8_recipes.py's fsdp=4 x tensor=2 projections: 5 to 8 all-gathers for forward and
backward, tensorwise's 1).
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels.residuals import keep
from models.fp8.delayed import E4M3, E5M2, quantize, scale_from_amax, scaled_dot, transposed

RECIPES = ("tensorwise", "rowwise", "blockwise")
# The batch and length letters of the models' token arrays (x_BLD): tensorwise scales each
# sequence of such an operand apart (its batch index), as a data-parallel rank scales its own.
SEQUENCE, LENGTH = "B", "L"
BLOCK = 128  # DeepSeek-V3's tile: 1 x 128 activations and gradients, 128 x 128 weights


class Gemm(NamedTuple):
  """One einsum `a,b->out` of two operands, with the roles of its letters."""
  a: str
  b: str
  out: str
  eqn: str
  blocks: str  # two letters unused by the einsum: block index, position within the block

  @classmethod
  def parse(cls, eqn: str) -> "Gemm":
    inputs, out = eqn.split("->")
    a, b = inputs.split(",")
    unused = [c for c in "zyxwvutsrqponmlkjihgfecba" if c not in eqn]
    return cls(a, b, out, eqn, "".join(unused[:2]))

  @property
  def contracted(self) -> str:
    """In b's order: b is the weight in the forward and dx GEMMs, whose 128 x 128 blocks are then
    the same blocks of w in both."""
    return "".join(c for c in self.b if c in self.a and c not in self.out)

  @property
  def batch(self) -> str:
    return "".join(c for c in self.out if c in self.a and c in self.b)


class Quantized(NamedTuple):
  """An fp8 operand `q` (letters `spec`) and its scales (letters `scale_spec`): q ~ value x scale.
  Blockwise operands carry the contraction as the two block letters, last."""
  q: jax.Array
  spec: str
  scale: jax.Array
  scale_spec: str


def _expand(array: jax.Array, spec: str, target: str) -> jax.Array:
  """`array` (letters `spec`, all in `target`) transposed and reshaped to broadcast against
  an array with letters `target`."""
  order = sorted(spec, key=target.index)
  array = jnp.transpose(array, [spec.index(c) for c in order])
  return array.reshape([array.shape[order.index(c)] if c in spec else 1 for c in target])


def _block(gemm: Gemm, letters: str, size: int) -> int:
  block = min(BLOCK, size)
  if size % block:
    raise ValueError(f"compute.fp8.recipe='blockwise' blocks dims {letters!r} of {gemm.eqn!r}"
                     f" ({size} elements) by {BLOCK}: make their size at most {BLOCK} or a"
                     f" multiple of {BLOCK}")
  return block


def quantize_operand(recipe: str, t: jax.Array, gemm: Gemm, operand: int, dtype,
                     weight: bool = False, amax=None) -> Quantized:
  """Operand `operand` (0: a, 1: b) of `gemm` in fp8 with `recipe`'s scales for that GEMM's
  contraction; `weight` picks blockwise's 128 x 128 blocks over the 1 x 128 tiles, and
  tensorwise's one scale over one per sequence. `amax`: tensorwise's amaxes of t, when its
  producer computed them (a norm: RMSNorm.sequence_amax), else None."""
  spec, contracted = (gemm.a, gemm.b)[operand], gemm.contracted
  if recipe == "tensorwise":
    per = "" if weight else sequence_scale(spec)
    axes = tuple(i for i, c in enumerate(spec) if c not in per)
    scale = scale_from_amax(jnp.max(jnp.abs(t), axis=axes) if amax is None else amax, dtype)
    return Quantized(quantize(t, _expand(scale, per, spec), dtype), spec, scale, per)
  others = "".join(c for c in spec if c not in contracted)
  if recipe == "rowwise":
    axes = tuple(spec.index(c) for c in contracted)
    scale = scale_from_amax(jnp.max(jnp.abs(t), axis=axes), dtype)
    return Quantized(quantize(t, _expand(scale, others, spec), dtype), spec, scale, others)
  if recipe != "blockwise":
    raise ValueError(f"compute.fp8.recipe={recipe!r} is not one of {RECIPES}")
  # Blockwise: [batch..., free..., contracted...] with the contraction flattened into blocks.
  batch = "".join(c for c in others if c in gemm.batch)
  free = "".join(c for c in others if c not in batch)
  order = batch + free + contracted
  t = jnp.transpose(t, [spec.index(c) for c in order])
  lead, size = t.shape[:len(others)], math.prod(t.shape[len(others):])
  block = _block(gemm, contracted, size)
  t = t.reshape(*lead, size // block, block)
  amax = jnp.max(jnp.abs(t), axis=-1)  # [batch..., free..., blocks]: the 1 x 128 tiles
  if weight:  # and the max over 128 consecutive elements of the flattened free dims
    outer, width = lead[:len(batch)], math.prod(lead[len(batch):])
    tile = _block(gemm, free, width)
    tiles = amax.reshape(*outer, width // tile, tile, -1).max(axis=-2, keepdims=True)
    amax = jnp.broadcast_to(tiles, (*outer, width // tile, tile, tiles.shape[-1]))
    amax = amax.reshape(*lead, -1)
  scale = scale_from_amax(amax, dtype)
  return Quantized(quantize(t, scale[..., None], dtype), others + gemm.blocks, scale,
                   others + gemm.blocks[0])


def sequence_scale(spec: str) -> str:
  """The letters of a tensorwise activation's or gradient's scales: the batch letter of a token
  array (letters B and L), else none (one scale)."""
  return SEQUENCE if SEQUENCE in spec and LENGTH in spec else ""


def scaled_matmul(gemm: Gemm, a: Quantized, b: Quantized, dtype) -> jax.Array:
  """einsum of two fp8 operands with float32 accumulation, divided by both operands' scales (per
  block, then the blocks summed in float32, when the contraction is blocked)."""
  if not a.scale_spec and not b.scale_spec:  # tensorwise weights: as delayed scaling's GEMMs
    return scaled_dot(f"{a.spec},{b.spec}->{gemm.out}", a.q, b.q, a.scale, b.scale, dtype)
  # The letter a scale varies along that the GEMM contracts, kept as a batch dim of the GEMM and
  # summed after the division: blockwise's block index, or tensorwise's sequence in dw (one
  # product per sequence; with one sequence per device, as at the anchors' micro-batch of 1, the
  # sum is the data-parallel reduction dw takes anyway).
  k = "".join(dict.fromkeys(c for c in a.scale_spec + b.scale_spec if c not in gemm.out))
  # Tensorwise divides in `dtype`, as scaled_dot (models/fp8/delayed.py says why), and sums in
  # it (jnp.sum would add bf16 in float32, and XLA then reduce-scatters dw in float32). Rowwise
  # and blockwise divide in float32 (no GEMM takes their scales); blocks sum in float32.
  tensorwise = {a.scale_spec, b.scale_spec} <= {"", SEQUENCE}
  divide = dtype if tensorwise else jnp.float32
  partial = jnp.einsum(f"{a.spec},{b.spec}->{k}{gemm.out}", a.q, b.q,
                       preferred_element_type=jnp.float32 if k and not tensorwise else dtype)
  scale = _expand(a.scale, a.scale_spec, k + gemm.out) * _expand(b.scale, b.scale_spec,
                                                                 k + gemm.out)
  y = partial.astype(divide) / scale.astype(divide)
  if k:
    y = jax.lax.reduce(y, jnp.zeros((), divide), jax.lax.add, (0,))
  return y.astype(dtype)


def quantize_weight(w: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Tensorwise: (fp8 w, its scale), the same for every GEMM of w (models/fp8/weights.py
  computes it once per step, before the microbatches)."""
  scale = scale_from_amax(jnp.max(jnp.abs(w)), E4M3)
  return quantize(w, scale, E4M3), scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 6))
def quantized_einsum(recipe: str, eqn: str, x: jax.Array, w: jax.Array, weight=None,
                     x_amax=None, gather_gradient=None) -> jax.Array:
  """einsum(eqn, x, w) in fp8 with current scaling (`recipe` in RECIPES), any two-operand eqn.

  x: the activation, in the compute dtype (the result's); w: the weight, in dw's dtype (the
  projections pass its compute-dtype copy: models/layers.py).
  Differentiating gives dx and dw from fp8 GEMMs with the e5m2 output gradient. `weight`, for
  tensorwise: quantize_weight(w) computed beforehand (then w only types dw), or None. `x_amax`,
  for tensorwise: x's amax per sequence, computed by x's producer, or None (quantize_operand).
  `gather_gradient`, for tensorwise: a function applied to the e5m2 output gradient before both
  GEMMs read it (a sequence-parallel all-gather, models/layers.py), or None. Quantized where it
  lies, the gradient moves in fp8, and its amax and cast passes read a 1/tensor part; its
  values are those of the bf16 gradient gathered first (a max and a cast per element).
  """
  return _forward(recipe, eqn, x, w, weight, x_amax, gather_gradient)[0]


def _forward(recipe, eqn, x, w, weight=None, x_amax=None, gather_gradient=None):
  gemm = Gemm.parse(eqn)
  if (weight is not None or x_amax is not None or gather_gradient is not None) \
      and recipe != "tensorwise":
    raise ValueError(f"a weight quantized, an input amax taken or a gradient gathered in fp8 is"
                     f" tensorwise's, not {recipe!r}'s")
  qx = quantize_operand(recipe, x, gemm, 0, E4M3, amax=x_amax)
  qw = (quantize_operand(recipe, w, gemm, 1, E4M3, weight=True) if weight is None
        else Quantized(weight[0], gemm.b, weight[1], ""))
  # Residuals. tensorwise: the fp8 operands and their scales (1 byte per element), whose scales do
  # not depend on the contraction. rowwise and blockwise: x in the compute dtype (2 bytes per
  # element in bf16, twice tensorwise's) and w as given (the parameter, which FSDP gathers again
  # or keeps gathered), because the backward GEMMs need other scales (rowwise: dw's per column
  # of x; blockwise: dw's tiles along the tokens) and requantizing an fp8 value would round twice.
  saved = (qx.q, qx.scale, qw.q, qw.scale) if recipe == "tensorwise" else (x, w)
  # Kept under remat="none", with the (scaled) output (kernels/residuals.py).
  return keep(scaled_matmul(gemm, qx, qw, x.dtype)), (keep(saved), jnp.zeros((), w.dtype))


def _backward(recipe, eqn, gather_gradient, residuals, g):
  saved, w_zero = residuals
  dx_gemm, dw_gemm = map(Gemm.parse, transposed(eqn))
  if recipe == "tensorwise":
    qx, sx, qw, sw = saved
    qg = quantize_operand(recipe, g, dx_gemm, 0, E5M2)  # one scale: the same in both GEMMs
    if gather_gradient is not None:
      qg = qg._replace(q=gather_gradient(qg.q))
    dx_ops = qg, Quantized(qw, dx_gemm.b, sw, "")
    dw_ops = Quantized(qx, dw_gemm.a, sx, sequence_scale(dw_gemm.a)), qg
  else:
    x, w = saved
    dx_ops = (quantize_operand(recipe, g, dx_gemm, 0, E5M2),
              quantize_operand(recipe, w, dx_gemm, 1, E4M3, weight=True))
    dw_ops = (quantize_operand(recipe, x, dw_gemm, 0, E4M3),
              quantize_operand(recipe, g, dw_gemm, 1, E5M2))
  # None: no cotangent for a precomputed weight or amax (not differentiated: w gets dw, and a
  # scale is a constant of the quantization).
  return (scaled_matmul(dx_gemm, *dx_ops, g.dtype), scaled_matmul(dw_gemm, *dw_ops, w_zero.dtype),
          None, None)


quantized_einsum.defvjp(_forward, _backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def shared_input_einsums(eqns: tuple, gather, sum_dx, x: jax.Array, ws: tuple,
                         weights: tuple, x_amax=None) -> tuple:
  """Tensorwise einsums of one activation x with several weights (q, k and v; gate and up): the
  numbers of separate quantized_einsum calls, with x quantized (one amax, one cast) and passed
  to `gather` (a sequence-parallel all-gather) once for all of them instead of once per GEMM.
  Transformer Engine fuses q, k and v into one GEMM for the same reason. The backward reads the
  gathered fp8 x for every dw. `weights`: each w's (fp8 w, scale) from quantize_weight, or None.
  `sum_dx(terms)`: x's gradient from its GEMMs' dx terms, (function, arguments) pairs to call
  and add in order (sharding.sum_terms on one device); sequence parallelism adds them before
  reducing them once (sharding.logical_sum_reduce_scatter). The arguments of GEMM i's term: its
  output gradient in e5m2 and that one's scale (its letters: eqn i's output), its fp8 weight
  and that one's scale. `x_amax`: as quantized_einsum's.
  """
  return _shared_forward(eqns, gather, sum_dx, x, ws, weights, x_amax)[0]


def _shared_forward(eqns, gather, sum_dx, x, ws, weights, x_amax=None):
  gemms = [Gemm.parse(e) for e in eqns]
  # Its scale: any contraction's.
  qx = quantize_operand("tensorwise", x, gemms[0], 0, E4M3, amax=x_amax)
  q = gather(qx.q)
  qws = tuple(quantize_weight(w) if weight is None else tuple(weight)
              for w, weight in zip(ws, weights))
  ys = tuple(keep(scaled_matmul(g, qx._replace(q=q, spec=g.a), Quantized(qw, g.b, sw, ""),
                                x.dtype)) for g, (qw, sw) in zip(gemms, qws))
  return ys, (keep((q, qx.scale, qws)), tuple(jnp.zeros((), w.dtype) for w in ws))


def _shared_backward(eqns, gather, sum_dx, residuals, gs):
  (q, sx, qws), w_zeros = residuals
  terms, dws = [], []
  for eqn, (qw, sw), g, w_zero in zip(eqns, qws, gs, w_zeros):
    dx_gemm, dw_gemm = map(Gemm.parse, transposed(eqn))
    qg = quantize_operand("tensorwise", g, dx_gemm, 0, E5M2)
    terms.append((functools.partial(_dx_term, dx_gemm, g.dtype), (qg.q, qg.scale, qw, sw)))
    qx = Quantized(q, dw_gemm.a, sx, sequence_scale(dw_gemm.a))
    dws.append(scaled_matmul(dw_gemm, qx, qg, w_zero.dtype))
  return sum_dx(terms), tuple(dws), None, None


def _dx_term(gemm: Gemm, dtype, g, g_scale, w, w_scale) -> jax.Array:
  return scaled_matmul(gemm, Quantized(g, gemm.a, g_scale, sequence_scale(gemm.a)),
                       Quantized(w, gemm.b, w_scale, ""), dtype)


shared_input_einsums.defvjp(_shared_forward, _shared_backward)
