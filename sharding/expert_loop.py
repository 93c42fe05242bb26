"""The microbatch loop of a step without pipeline stages, run under a shard_map manual over the
expert axes that split the batch (`Layout.loop_expert_axes`).

The devices of those axes are data-parallel for every weight but the experts'. Left automatic,
each microbatch's gradients of those shared weights were partial sums over them, and XLA
reduced them at once, into ZeRO-1's parts, in every microbatch: a reduce-scatter of every
shared weight's gradient per microbatch (Qwen3-30B-A3B's EP16 recipe, 64 microbatches: 174 GiB
a device per step, where one reduction moves 5.4). Manual, each device keeps whole float32 sums
of its own rows' gradients over the microbatches, as Megatron's distributed optimizer and the
pipeline executor (`Layout.stage_expert_axes`) keep them, and they are summed once, after the
loop, into the optimizer's parts. The experts' weights stay split, each device summing its own
experts' gradients (the exchange brings it every token routed to them, sharding/expert.py)."""

import jax
from jax.sharding import PartitionSpec

from sharding.rules import entry_axes, spec_entry
from sharding.scope import excluding, specs_over
from sharding.shard_map import varying_over


def _is_spec(x) -> bool:
  return isinstance(x, PartitionSpec)


def run_loop(layout, names, loop, params, micro: dict, fp8_weights):
  """loop(params, micro, fp8_weights) -> (sums, stats), run by each device of `layout.loop_axes`
  (the gradient replicas' and the expert axes) on its own rows of the microbatches `micro`
  ({name: [M, B, ...]}); without those axes, run as it is.

  Args:
    layout: the run's sharding.Layout.
    names: the parameters' logical names.
    loop: sums over the microbatches: `sums` like `params`, each with a leading dim of the
      step's vmapped replicas (trainer/step.py; one here), and `stats` (summed).
    params: the parameters; fp8_weights: their fp8 copies (models/fp8/weights.py), or None.
  Returns:
    (sums, stats): each weight's sums with the devices it is not split over (the shared
    weights': all; the experts': the replicas') folded into the leading replicas' dim, for the
    step's one reduction over it; stats summed over every device.
  """
  axes = layout.loop_axes
  if not axes:
    return loop(params, micro, fp8_weights)
  specs = specs_over(names, params, axes)
  # The axes a weight's sums are per device over: those it is not split over.
  apart = jax.tree.map(lambda s: tuple(a for a in axes if a not in {
      x for e in s for x in entry_axes(e)}), specs, is_leaf=_is_spec)
  is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, str) for a in x)  # noqa: E731
  rows = lambda a: PartitionSpec(None, spec_entry(axes), *(None,) * (a.ndim - 2))  # noqa: E731
  fp8_weights = fp8_weights or {}

  def per_device(params, micro, fp8_weights):
    with excluding(axes):
      # Varying, the shared weights' gradients stay each device's own (no implicit psum).
      params = jax.tree.map(lambda p: varying_over(p, axes), params)
      sums, stats = loop(params, micro, fp8_weights)
    sums = jax.tree.map(lambda o, x: x[None] if o else x, apart, sums, is_leaf=is_axes)
    return sums, jax.tree.map(lambda x: jax.lax.psum(varying_over(x, axes), axes), stats)

  out_specs = jax.tree.map(lambda s, o: PartitionSpec(spec_entry(o), None, *s) if o else
                           PartitionSpec(None, *s), specs, apart, is_leaf=_is_spec)
  mapped = jax.shard_map(per_device, mesh=layout.mesh, axis_names=set(axes),
                         in_specs=(specs, jax.tree.map(rows, micro),
                                   jax.tree.map(lambda _: PartitionSpec(), fp8_weights)),
                         out_specs=(out_specs, PartitionSpec()))
  sums, stats = mapped(params, micro, fp8_weights)
  # [devices, replicas, ...] -> [devices x replicas, ...]
  folded = jax.tree.map(lambda o, x: x.reshape(-1, *x.shape[2:]) if o else x, apart, sums,
                        is_leaf=is_axes)
  return folded, stats


def loop_typed(layout, tree):
  """`tree` (zeros: a loop's initial sums) typed as varying over the expert loop's axes, like
  the sums the loop adds to them inside its region; as it is without the loop."""
  return jax.tree.map(lambda x: varying_over(x, layout.loop_axes), tree)
