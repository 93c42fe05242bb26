"""What every Pallas kernel here shares: the Triton call (interpreted on CPU) and output types
that carry shard_map's varying axes."""

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt


def out_type(shape, dtype, *inputs):
  """An output type that varies over every manual mesh axis an input varies over: inside
  `jax.shard_map(check_vma=True)` Pallas asks how outputs vary; outside it this is empty."""
  varying = frozenset().union(*(jax.typeof(x).manual_axis_type.varying for x in inputs))
  return jax.ShapeDtypeStruct(shape, dtype,
                              manual_axis_type=jax.sharding.ManualAxisType(varying=varying))


def varying_like(x, primal):
  """`x` cast to vary over every manual mesh axis `primal` varies over (no values change): a
  kernel's cotangent where an unchecked shard_map (check_vma off: the CPU interpreter) lost the
  varying axes its primal, from an enclosing shard_map, still carries."""
  varying = lambda a: jax.typeof(a).manual_axis_type.varying  # noqa: E731
  extra = tuple(sorted(varying(primal) - varying(x)))
  return jax.lax.pcast(x, extra, to="varying") if extra else x


def triton_call(kernel, *, name: str, interpret: bool | None, num_warps: int, num_stages: int,
                **call_kw):
  """pallas_call with the Triton CompilerParams (Mosaic GPU is the default lowering in this jax).
  `interpret=None` picks per lowering platform: the interpreter on CPU, Triton elsewhere, so one
  traced program runs on CPU and compiles for GPUs (including deviceless compiles)."""
  def run(interpret, *args):
    return pl.pallas_call(
        kernel, compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name=name, **call_kw)(*args)
  if interpret is None:
    return lambda *args: lax.platform_dependent(
        *args, cpu=functools.partial(run, True), default=functools.partial(run, False))
  return functools.partial(run, interpret)
