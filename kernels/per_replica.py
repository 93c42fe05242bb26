"""A function run once per replica under jax.vmap (the data-parallel replicas of gradient
accumulation), in a Python loop instead of batched: for while loops whose trip count is the
data's. Batched, such a loop takes a batched predicate, and JAX 0.10 types the batched loop's
carry as varying over the vmapped mesh axis and its closed-over values as not: ops mixing the
two fail shard_map's check ("Primitive lt requires varying manual axes to match"). Used by the
dropless exchange's rounds (sharding/exchange_rounds.py) and the batched experts' later rounds
(kernels/capacity_matmul.py)."""

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap


def per_replica(fn):
  """fn, run once per replica (a Python loop) under jax.vmap, unbatched otherwise."""
  wrapped = custom_vmap(fn)

  @wrapped.def_vmap
  def rule(axis_size, in_batched, *args):
    # Leaf by leaf: an argument may be a pytree (a loop's carry of several arrays).
    outs = [fn(*jax.tree.map(lambda a, batched, i=i: a[i] if batched else a, args,
                             tuple(in_batched)))
            for i in range(axis_size)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *outs)
    return stacked, jax.tree.map(lambda _: True, stacked)

  return wrapped
