"""The one reduction of a pipeline step: the executor's sums (gradients, loss, statistics) over
the manual mesh axes that each device summed its own part on, once after the schedule.

Under ZeRO-1 a device's optimizer state holds one part of each weight (its `embed` dim split
over the replicas, sharding/rules.py): such a layer weight's gradient sums leave the stages per
replica and are summed into those parts outside, where XLA reduce-scatters them, as Megatron's
distributed optimizer reduces its gradients, instead of all-reducing them whole inside (the
Llama-3.1-405B TP8 PP8 CP2 VP8 program all-reduced its float32 layer gradients over data x
context: 47.8 GB a device per step, where the reduce-scatter sends half). Not inside: a
reduce-scatter over a stage's manual axes gathered the weight over the automatic `tensor` first
(XLA's SPMD partitioner, jaxlib 0.10)."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from sharding.rules import entry_axes, spec_entry
from sharding.scope import constrain_spec


def reduce_sums(tree, axes, by_max=None, owns=None, per_replica=None):
  """Each leaf of `tree` summed (by_max: its max taken) over `axes`, except the axes its device
  owns its own values over (`owns`: a frozenset per leaf, e.g. the experts' weights over
  `expert`), and the leaves `per_replica` marks, left as they are (summed by sum_replicas)."""
  by_max = by_max or jax.tree.map(lambda _: False, tree)
  owns = owns or jax.tree.map(lambda _: frozenset(), tree)
  per_replica = per_replica or jax.tree.map(lambda _: False, tree)

  def one(m, a, mine, later):  # in float32 at least: XLA:CPU aborts on a bf16 psum in a
    # shard_map that leaves some mesh axes automatic (its all-reduce promotion meets a constraint)
    over = tuple(x for x in axes if x not in mine)
    if not over or later:
      return a
    wide = a.astype(jnp.promote_types(a.dtype, jnp.float32))
    return (jax.lax.pmax(wide, over) if m else jax.lax.psum(wide, over)).astype(a.dtype)
  return jax.tree.map(one, by_max, tree, owns, per_replica)


def per_replica_specs(specs, reduced, by_max, replica_axes):
  """(out specs, per_replica, parts) for a stage's layer gradients: the leaves whose optimizer
  state `reduced` (sharding.scope.specs_over over the replica axes; None: no ZeRO) splits over
  some replica axes leave the stages per replica, a leading dim over `replica_axes` before
  their own `specs`; `parts`: their PartitionSpec after sum_replicas (the pipeline axis and
  those parts; the other dims left to XLA), None for the rest."""
  is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
  if reduced is None:
    return specs, jax.tree.map(lambda _: False, specs, is_leaf=is_spec), None

  def one(s, r, m):  # not the fp8 histories (by max), nor a weight split over a replica axis
    # (the experts' over `expert`: each device's own, not summed over it)
    if m or not any(entry_axes(e) for e in tuple(r)[1:]) or any(
        a in replica_axes for e in s for a in entry_axes(e)):
      return s, False, None
    keep = [*tuple(s)[:1], *(PartitionSpec.UNCONSTRAINED for _ in tuple(r)[1:])]
    parts = [spec_entry(entry_axes(e)) if d and entry_axes(e) else keep[d]
             for d, e in enumerate(tuple(r))]
    return PartitionSpec(spec_entry(replica_axes), *s), True, PartitionSpec(*parts)
  triples = jax.tree.map(one, specs, reduced, by_max, is_leaf=is_spec)
  is_triple = lambda x: isinstance(x, tuple) and len(x) == 3 and is_spec(x[0])  # noqa: E731
  return tuple(jax.tree.map(lambda t, i=i: t[i], triples, is_leaf=is_triple) for i in range(3))


def sum_replicas(tree, per_replica, parts, like, mesh):
  """The per-replica leaves [R, ...] summed over their replicas into their `parts` (XLA
  reduce-scatters them), in float32, then cast like the parameters `like`."""
  if parts is None:
    return tree

  def one(later, a, spec, p):
    if not later:
      return a
    total = jax.lax.with_sharding_constraint(jnp.sum(a, axis=0), NamedSharding(mesh, spec))
    return total.astype(p.dtype)
  return jax.tree.map(one, per_replica, tree, parts, like)


def split_into(tree, parts, by_max):
  """ZeRO-2 in the stages: a tick's layer gradients `tree` constrained to the gradients' parts
  over the stage's automatic axes (`parts`, a tree of PartitionSpecs like it; None: as it is),
  so XLA reduce-scatters each into its sum's part, where it all-reduced them whole and kept the
  part (DeepSeek-V3-like PP8 EP64: 238 GiB a step of bf16 all-reduces over `expert`). Not the
  leaves combined by max (`by_max`: fp8 histories), which are no sums."""
  if parts is None:
    return tree
  return jax.tree.map(lambda p, m, d: d if m else constrain_spec(d, p), parts, by_max, tree,
                      is_leaf=lambda x: isinstance(x, PartitionSpec))
