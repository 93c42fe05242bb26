"""The only Flax-touching building blocks: parameters with logical names, projections, norms."""

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models.compute import PROJECTION
from models.fp8 import delayed as fp8_ops
from models.fp8.current import Gemm, quantized_einsum, sequence_scale, shared_input_einsums
from sharding import (constrain, constrain_cotangent, embedding_lookup,
                      logical_sum_reduce_scatter)

# The residual stream [B, L, D]: sequence-sharded between tensor-parallel regions under sequence
# parallelism (`res_seq`), whole-sequence inside them.
RESIDUAL = ("batch", "res_seq", "act_embed")
# A projection input whose sequence is whole over `tensor`: under sequence parallelism the
# residual's tokens are split there, and XLA gathers them for each dot that reads them (3 in
# attention, 2 in the MLP, each again in the backward): one constraint makes it one gather, and
# its transpose one reduce-scatter of the summed input gradients (Megatron-SP's collectives).
GATHERED = ("batch", "seq", "act_embed")
# The same with the sequences in groups (sequence_groups): a sequence's place in its group after B.
GROUPS_RESIDUAL, GROUPS_GATHERED = (("batch", None, *n[1:]) for n in (RESIDUAL, GATHERED))


def gather_sequence(x_BLD: jax.Array, dtype) -> jax.Array:
  """A projection input gathered once (GATHERED), in the compute `dtype` the projections cast it
  to anyway. For layers that recompute ("selective", "full"): without recomputation the gathered
  input would be kept whole for the backward (as [B·L, D] token rows, which a remat policy cannot
  name), where Megatron-SP keeps the 1/tensor shard; there XLA gathers per dot instead."""
  # Cast where it lies (RESIDUAL), or XLA may gather the float32 norm output in the recomputation.
  return constrain(constrain(x_BLD.astype(dtype), RESIDUAL), GATHERED)


def project_shared(layout, einsums: Sequence["Einsum"], eqns: Sequence[str], out_names: Sequence,
                   x_BLD: jax.Array, gather_once: bool, input_amax=None) -> tuple:
  """`einsums[i](eqns[i], x_BLD)`, constrained to `out_names[i]`, for projections that read one
  input (q, k and v; gate and up).
  With tensorwise fp8 in all of them and the tokens split (sequence or context parallelism), x
  is quantized and, under sequence parallelism, gathered once, in fp8, for all of them (models/fp8/current.py,
  shared_input_einsums): quantized per GEMM, XLA gathered each GEMM's fp8 copy of the input for
  it, forward and backward (the 70B TP4 PP8 recipe: 10 gathers per two layers where 4 do). x's
  gradient is reduce-scattered once too (reduce_input_gradient).
  Where nothing is gathered, grouping only saves amax and cast passes, and on the
  Megatron-Bridge 8B FP8 FSDP recipe it cost memory: 59.4 -> 65.5 GiB, XLA then recomputing
  GEMMs to fit (12,193 -> 10,864 predicted tok/s/GPU, with one scale per tensor); not traced
  further, so each GEMM quantizes x there (with tensorwise's per-sequence scales, which no
  collective computes, XLA finds the quantizations equal and casts once). Otherwise each
  projects x, gathered once first when `gather_once` (gather_sequence's layers that
  recompute). `input_amax`: as Einsum's."""
  if einsums[0].tokens_split and all(e.fp8_recipe == "tensorwise" for e in einsums):
    weights = tuple(tuple(e.w_fp8.get_value()[:2]) if hasattr(e, "w_fp8") else None
                    for e in einsums)
    dtype, group = einsums[0].dtype, einsums[0].fp8_group
    x, eqns_x = x_BLD.astype(dtype), tuple(eqns)
    x_amax = None if input_amax is None else input_amax()
    gather, names_x, input_names = gather_fp8_input, tuple(out_names), (GATHERED, RESIDUAL)
    if group > 1:  # each array gets the group's place after B: unnamed, not split
      eqns_x, x, x_amax = sequence_groups(group, eqns_x, x, x_amax)
      gather, names_x = gather_fp8_groups, tuple((n[0], None, *n[1:]) for n in out_names)
      input_names = (GROUPS_GATHERED, GROUPS_RESIDUAL)
    sum_dx = functools.partial(reduce_input_gradient, layout, eqns_x, names_x, input_names)
    ys = shared_input_einsums(eqns_x, gather, sum_dx, x,
                              tuple(e.w[...].astype(e.dtype) for e in einsums), weights, x_amax)
    return tuple(constrain(y.reshape(x_BLD.shape[0], *y.shape[2 if group > 1 else 1:]), names)
                 for y, names in zip(ys, out_names))
  if gather_once:
    x_BLD = gather_sequence(x_BLD, einsums[0].dtype)
  return tuple(constrain(e(eqn, x_BLD, input_amax), names)
               for e, eqn, names in zip(einsums, eqns, out_names))


def sequence_groups(group: int, eqns: Sequence[str], x_BLD: jax.Array, x_amax=None) -> tuple:
  """Tensorwise fp8's sequences in consecutive groups of `group` (compute.fp8.sequences_per_scale):
  the einsums with a letter after B for a sequence's place in its group, x as [B / group, group,
  L, ...] and its per-sequence amax as the groups' (or None). Tensorwise scales per B
  (models/fp8/current.py), so each group shares one scale; B splits over devices holding whole
  groups (sharding/resolution.py checks it), the sequence as it was."""
  place = next(c for c in "zyxwvutsrqponmlkjihgfedcba" if all(c not in e for e in eqns))
  def grouped(eqn):  # x's and the output's B; the weight has none
    (x, w), out = eqn.split("->")[0].split(","), eqn.split("->")[1]
    return f"{x.replace('B', 'B' + place)},{w}->{out.replace('B', 'B' + place)}"
  eqns = tuple(map(grouped, eqns))
  b = x_BLD.shape[0]
  x_amax = None if x_amax is None else jnp.max(x_amax.reshape(b // group, group), axis=1)
  return eqns, x_BLD.reshape(b // group, group, *x_BLD.shape[1:]), x_amax


def reduce_input_gradient(layout, eqns: tuple, out_names: tuple, input_names: tuple,
                          terms) -> jax.Array:
  """x's gradient in shared_input_einsums: its GEMMs' dx terms summed on each device and
  reduce-scattered once to the residual's layout. Reduced per GEMM, as XLA placed it, q, k and v
  took 3 reduce-scatters and gate and up 2 (the 70B TP4 PP8 recipe's largest collective).
  `input_names`: x's names gathered and as the residual (GATHERED, RESIDUAL, or their
  sequence_groups forms)."""
  gathered, residual = input_names
  names = []
  for eqn, out in zip(eqns, out_names):
    gemm = Gemm.parse(eqn)
    by_letter = dict(zip(gemm.a, gathered)) | dict(zip(gemm.out, out))
    scale = tuple(by_letter[c] for c in sequence_scale(gemm.out))  # the output gradient's
    names.append((out, scale, tuple(by_letter[c] for c in gemm.b), ()))
  return logical_sum_reduce_scatter(layout, terms, names, gathered, residual, "projection dx")


def gather_fp8_input(x_BLD: jax.Array) -> jax.Array:
  """The all-gather shared_input_einsums applies to the fp8 input (a module-level function: a
  stable static argument)."""
  # Quantized where it lies (RESIDUAL), or XLA gathers the float32 x * scale before the cast.
  return constrain(constrain(x_BLD, RESIDUAL), GATHERED)


def gather_fp8_groups(x: jax.Array) -> jax.Array:
  """gather_fp8_input for x in sequence_groups ([B / group, group, L, D])."""
  return constrain(constrain(x, GROUPS_RESIDUAL), GROUPS_GATHERED)


def projection_kw(cfg, compute, layout, rngs: nnx.Rngs, target: str | None = None) -> dict:
  """The keyword arguments of a model's Einsum: its dtypes and init RNG, the run's fp8 config
  when it applies to `target` ("attention", "mlp", "experts", "head"; None: never), and whether
  the layout splits tokens (`Einsum`)."""
  fp8 = compute.fp8 if target is not None and compute.fp8.applies_to(target) else None
  return dict(param_dtype=cfg.param_dtype, dtype=cfg.dtype, rngs=rngs, fp8=fp8,
              tokens_split=layout.tokens_split)


def logical_param(value: jax.Array, names: Sequence[str]) -> nnx.Param:
  """A parameter that carries its logical dim names as `out_sharding` metadata.

  Eager sharding is off: the names are logical, and only sharding/ maps them to mesh axes.
  """
  return nnx.Param(value, out_sharding=tuple(names), eager_sharding=False)


class Einsum(nnx.Module):
  """A projection `einsum(eqn, x, w)`; w has logical dim names and fan-in scaled init.

  The precision policy's casts happen here and only here (besides the loss): x and w to the
  compute dtype, or, with `fp8` (a models.config.Fp8Config that applies), both to fp8 with its
  recipe: delayed scaling (models/fp8/delayed.py; the amax histories are parameters of this
  module, and only this recipe has them) or a current-scaling one (models/fp8/current.py: no
  state). `tokens_split`: the layout splits the sequence of some activation (sharding.Layout).
  """

  def __init__(self, shape: Sequence[int], names: Sequence[str], fan_in_dims: Sequence[int], *,
               param_dtype, dtype, rngs: nnx.Rngs, fp8=None, tokens_split: bool = False):
    out_dims = tuple(i for i in range(len(shape)) if i not in fan_in_dims)
    init = jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                                in_axis=tuple(fan_in_dims), out_axis=out_dims)
    self.w = logical_param(init(rngs.params(), tuple(shape), param_dtype), names)
    self.weight_rank = len(shape)  # w's own dims: stacking (nnx.vmap) adds dims before them
    self.dtype = dtype
    self.tokens_split = tokens_split
    self.fp8_recipe = fp8.recipe if fp8 is not None else None  # plain str and int: static
    self.fp8_margin = fp8.margin if fp8 is not None else None
    self.fp8_group = fp8.sequences_per_scale if fp8 is not None else 1
    if self.fp8_recipe == "delayed":
      for name in fp8_ops.HISTORIES:  # float32 whatever the param dtype: amaxes span decades
        setattr(self, name, logical_param(jnp.zeros((fp8.amax_history,), jnp.float32),
                                          (fp8_ops.FP8_HISTORY,)))

  def __call__(self, eqn: str, x: jax.Array, input_amax=None,
               gather_gradient: bool = False) -> jax.Array:
    """`input_amax`: None, or a function of no arguments returning x's amax per sequence
    (RMSNorm.sequence_amax), which tensorwise fp8 then scales x by; other precisions never call
    it, so it adds nothing to their programs. `gather_gradient`: the output's gradient [B, L, D]
    is gathered over the sequence (GATHERED) once for both backward dots (a row-parallel
    projection under sequence parallelism: attention's o, the MLP's down), by tensorwise fp8
    in e5m2, after its quantization (models/fp8/current.py quantized_einsum), else as it
    comes."""
    if gather_gradient and self.fp8_recipe != "tensorwise":
      return constrain_cotangent(self(eqn, x, input_amax), GATHERED)
    # The step's fp8 copy of w, when the train step quantized it once (models/fp8/weights.py).
    weight = self.w_fp8.get_value() if hasattr(self, "w_fp8") else None
    # fp8 quantizes the compute-dtype copy of w, as the anchors quantize their bf16 weights; dw
    # then leaves in the compute dtype, so its reduction moves what the bf16 step's does.
    x, w = x.astype(self.dtype), self.w[...].astype(self.dtype)
    if self.fp8_recipe == "delayed":
      return fp8_ops.fp8_einsum(eqn, self.fp8_margin, x, w,
                                *(getattr(self, n)[...] for n in fp8_ops.HISTORIES), weight)
    if self.fp8_recipe is not None:
      x_amax = input_amax() if input_amax is not None and self.fp8_recipe == "tensorwise" \
          else None
      if self.fp8_group > 1 and eqn.startswith("BL") and "->BL" in eqn:
        return self._grouped_einsum(eqn, x, w, weight, x_amax,
                                    gather_fp8_groups if gather_gradient else None)
      return quantized_einsum(self.fp8_recipe, eqn, x, w, weight, x_amax,
                              gather_fp8_input if gather_gradient else None)
    if eqn.startswith("BL") and "->BL" in eqn and not self.tokens_split:
      # Whole sequences on each device: contract over one token dim [B·L] instead of two. The
      # weight gradient then contracts one dim of row-major operands; with two, XLA:CPU copies
      # the [B, L, F] activation gradient transposed first, at the cost of a third of the MLP
      # backward (benchmarks/train_step.py --trace, op `copy_bitcast_fusion`).
      lhs, rest = eqn.split(",", 1)
      y = self._einsum(f"T{lhs[2:]},{rest.replace('->BL', '->T')}",
                       x.reshape(-1, *x.shape[2:]), w)
      return y.reshape(*x.shape[:2], *y.shape[1:])
    return self._einsum(eqn, x, w)

  def _grouped_einsum(self, eqn: str, x: jax.Array, w: jax.Array, weight, x_amax,
                      gather_gradient=None) -> jax.Array:
    """Tensorwise fp8 with one scale per `fp8_group` consecutive sequences (sequence_groups)."""
    eqn, x, x_amax = sequence_groups(self.fp8_group, (eqn,), x, x_amax)
    y = quantized_einsum(self.fp8_recipe, eqn[0], x, w, weight, x_amax, gather_gradient)
    return y.reshape(-1, *y.shape[2:])

  def _einsum(self, eqn: str, x: jax.Array, w: jax.Array) -> jax.Array:
    if hasattr(self, "w_sum"):  # the step's float32 sum of w's gradients (attach_gradient_sums)
      return checkpoint_name(summed_einsum(eqn, x, w, self.w_sum.get_value()), PROJECTION)
    return jnp.einsum(eqn, x, w)


class GradientSum(nnx.Variable):
  """A weight's float32 gradient sum for one microbatch (an Einsum's or an Embed's): set by
  `attach_gradient_sums`, never a parameter."""


def attach_gradient_sums(model, with_sums) -> None:
  """Hands each bf16/f32 projection (no fp8) and embedding lookup of `model` (merged inside the
  differentiated function) its weight's running gradient sum from `with_sums`, the model's
  graph merged with the parameters' tree of sums; the gradient with respect to those sums is
  then those weights' gradients, in float32."""
  sums = dict(nnx.iter_graph(with_sums))  # by path: `model` may hold more (its fp8 copies)
  for path, module in nnx.iter_graph(model):
    if isinstance(module, Einsum) and module.fp8_recipe is None:
      module.w_sum = GradientSum(sums[path].w[...])
    elif isinstance(module, Embed):
      module.table_sum = GradientSum(sums[path].table[...])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def summed_einsum(eqn: str, x: jax.Array, w: jax.Array, w_sum: jax.Array) -> jax.Array:
  """einsum(eqn, x, w), whose weight gradient is computed in float32 and leaves as the cotangent
  of `w_sum` (w's float32 gradient sum, its value unused), w's own being zero. The train step
  adds it to that sum (trainer/step.py), and XLA fuses the add into the GEMM's epilogue: the
  GEMM reads and writes the float32 sum, where a bf16 gradient was written, read again,
  converted and added by a kernel of its own in every microbatch (Megatron's
  gradient-accumulation fusion). `w_sum` is no residual: a residual would pass the layer
  checkpoint's optimization barrier, and XLA then keeps the add apart."""
  del w_sum
  return jnp.einsum(eqn, x, w)


def _summed_forward(eqn, x, w, w_sum):
  return summed_einsum(eqn, x, w, w_sum), (x, w)


def _summed_backward(eqn, residuals, g):
  x, w = residuals
  lhs, rest = eqn.split(",")
  w_dims, out = rest.split("->")
  dx = jnp.einsum(f"{out},{w_dims}->{lhs}", g, w)
  dw = jnp.einsum(f"{lhs},{out}->{w_dims}", x, g, preferred_element_type=jnp.float32)
  return dx, None, dw


summed_einsum.defvjp(_summed_forward, _summed_backward)


def summed_lookup(table: jax.Array, tokens: jax.Array, table_sum: jax.Array) -> jax.Array:
  """table[tokens], whose table gradient (the tokens' rows scatter-added, in float32) leaves as
  the cotangent of `table_sum` (its value unused), the table's own being zero. Added to the sum,
  a scatter into zeros becomes XLA's scatter into the sum, in place: only the tokens' rows are
  touched, where a bf16 [V, D] gradient was converted and added to the whole float32 [V, D] sum
  in every microbatch."""
  return _summed_lookup(table.shape, table, tokens, table_sum)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _summed_lookup(shape, table, tokens, table_sum):
  del shape, table_sum
  return jnp.take(table, tokens, axis=0)


def _lookup_forward(shape, table, tokens, table_sum):
  return _summed_lookup(shape, table, tokens, table_sum), tokens


def _lookup_backward(shape, tokens, g):
  return None, None, jnp.zeros(shape, jnp.float32).at[tokens].add(g.astype(jnp.float32))


_summed_lookup.defvjp(_lookup_forward, _lookup_backward)


class Embed(nnx.Module):
  """Token embedding table [V, D]; `attend` reuses it as the output head when tied."""

  def __init__(self, vocab: int, dim: int, std: float, *, param_dtype, dtype, rngs: nnx.Rngs,
               layout=None):
    init = jax.nn.initializers.normal(stddev=std)
    self.table = logical_param(init(rngs.params(), (vocab, dim), param_dtype), ("vocab", "embed"))
    self.dtype = dtype
    self.layout = layout

  def __call__(self, tokens_BL: jax.Array) -> jax.Array:
    # With `lookup_embed` over fsdp (sharding.rules, when the fsdp group has fewer tokens than
    # the vocab) the table is not gathered: each device looks up the rows of its fsdp group's
    # tokens in its own `embed` columns, then an all-to-all hands each device its tokens' full
    # rows, and the gradient comes back the same way (no [V, D] reduction). Otherwise the
    # `embed` dim is gathered first and `vocab` stays split: each tensor-parallel device looks
    # up its vocab slice (Megatron's vocab-parallel embedding). Cast first, so any gather moves
    # compute-dtype bytes.
    table = constrain(self.table[...].astype(self.dtype), ("vocab", "lookup_embed"))
    if hasattr(self, "table_sum"):  # the step's float32 sum of its gradients (no pipeline)
      rows = summed_lookup(table, tokens_BL, self.table_sum.get_value())
    else:
      rows = embedding_lookup(self.layout, table, tokens_BL)  # pipeline stages: sharding/lookup.py
    return constrain(rows, ("lookup_batch", "seq", "lookup_embed"))

  def attend(self, x_BLD: jax.Array) -> jax.Array:
    return jnp.einsum("BLD,VD->BLV", x_BLD, self.table[...].astype(self.dtype))


class RMSNorm(nnx.Module):
  """Root-mean-square norm computed in float32, with a learned per-channel scale."""

  def __init__(self, dim: int, eps: float, *, param_dtype, dtype):
    self.scale = logical_param(jnp.ones((dim,), param_dtype), ("norm",))
    self.eps = eps
    self.dtype = dtype

  def _factors(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x in float32, each token's rsqrt(mean(x²) + eps) [..., 1] and the scale [1, ..., D]:
    the norm is their product."""
    x32 = x.astype(jnp.float32)
    rsqrt = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return x32, rsqrt, self.scale[...].astype(jnp.float32).reshape((1,) * (x.ndim - 1) + (-1,))

  def __call__(self, x: jax.Array) -> jax.Array:
    x32, rsqrt, scale = self._factors(x)
    return (x32 * rsqrt * scale).astype(self.dtype)

  def sequence_amax(self, x: jax.Array) -> jax.Array:
    """max|self(x)| over all but the batch dim of x [B, ..., D]: [B], in the compute dtype, for
    tensorwise fp8's per-sequence scale of the projections that read self(x).

    A token's norm multiplies its row by r = rsqrt(mean(x²) + eps) > 0, so its largest
    |element| is r · max_d |x_d · scale_d|: per-token statistics, read from x as the norm reads
    it. Taken from self(x) instead, XLA:GPU wrote |self(x)| [B, L, D] from the norm's kernel
    and reduced it in another. Equal to that max up to float32 rounding (the products'
    order), rounded to the compute dtype as self(x)'s elements are."""
    x32, rsqrt, scale = self._factors(x)
    peak = jnp.max(jnp.abs(x32 * scale), axis=-1, keepdims=True)
    return jnp.max(rsqrt * peak, axis=tuple(range(1, x.ndim))).astype(self.dtype)
