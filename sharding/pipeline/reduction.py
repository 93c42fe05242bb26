"""The one reduction of a pipeline step: the executor's sums (gradients, loss, statistics) over
the manual mesh axes that each device summed its own part on, once after the schedule."""

import jax
import jax.numpy as jnp


def reduce_sums(tree, axes, by_max=None, owns=None):
  """Each leaf of `tree` summed (by_max: its max taken) over `axes`, except the axes its device
  owns its own values over (`owns`: a frozenset per leaf, e.g. the experts' weights over
  `expert`)."""
  by_max = by_max or jax.tree.map(lambda _: False, tree)
  owns = owns or jax.tree.map(lambda _: frozenset(), tree)

  def one(m, a, mine):  # in float32 at least: XLA:CPU aborts on a bf16 psum in a shard_map
    # that leaves some mesh axes automatic (its all-reduce promotion meets a constraint)
    over = tuple(x for x in axes if x not in mine)
    if not over:
      return a
    wide = a.astype(jnp.promote_types(a.dtype, jnp.float32))
    return (jax.lax.pmax(wide, over) if m else jax.lax.psum(wide, over)).astype(a.dtype)
  return jax.tree.map(one, by_max, tree, owns)
