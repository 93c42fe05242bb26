"""The gradients of the weights every pipeline stage holds (embedding, final norm, head,
multi-token prediction). The tick sums them in float32 in lock step: a piece that returned the
gradient of every shared weight added a vocabulary-sized table per tick for each table it does
not even read (the 70B TP4 PP8 VP5 program: two at 0.9 ms each, in 45.9 ms ticks). So each piece
is differentiated only in the shared weights it reads, and the embedding's gradient is taken once
after the ticks from the input gradients that position 0's backward keeps per microbatch."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Leaves:
  """Some leaves of the shared weights' tree (`indices` in jax.tree.leaves order)."""

  indices: tuple[int, ...]

  @classmethod
  def read_by(cls, fn, shared, *args) -> "Leaves":
    """The leaves fn(shared, *args) reads (from its jaxpr; a leaf passed on counts as read)."""
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (shared, args))
    jaxpr = jax.make_jaxpr(lambda s, a: fn(s, *a))(*shapes).jaxpr
    used = {id(v) for e in jaxpr.eqns for v in e.invars} | {id(v) for v in jaxpr.outvars}
    leaves = len(jax.tree.leaves(shared))  # the invars: shared's leaves, then the args'
    return cls(tuple(i for i, v in enumerate(jaxpr.invars[:leaves]) if id(v) in used))

  def take(self, tree) -> list:
    leaves = jax.tree.leaves(tree)
    return [leaves[i] for i in self.indices]

  def put(self, tree, values, combine=lambda old, new: new):
    """`tree` with its leaves at `indices` replaced by combine(leaf, value)."""
    leaves, treedef = jax.tree.flatten(tree)
    for i, value in zip(self.indices, values):
      leaves[i] = combine(leaves[i], value)
    return jax.tree.unflatten(treedef, leaves)


def embeddings(first, shared, data):
  """first(shared, microbatch) for every microbatch of `data` ({name: [M, b, ...]}), [M, ...],
  one microbatch at a time (a batched lookup would reduce the whole [M, b, L, D] over the
  vocabulary's devices at once): position 0's inputs, looked up once before the ticks. Looked
  up inside them, under a conditional that a lock-step tick prices (and waits for) at every tick
  and again in the backward's recomputation, the 405B TP8 PP8 CP2 VP8 program all-reduced a
  [4096, 16384] embedding over `tensor` 3,150 times a step for its 192 microbatches."""
  return jax.lax.map(lambda mb: first(shared, mb), data)


def embedding_grads(first, shared, data, embedded, kept, acc, add):
  """add(acc, the gradients of `first` (the embedding) in the shared weights, summed over the
  microbatches), given its output gradients `embedded` [M, ...] where `kept` (position 0's
  stage), zeros elsewhere. In groups of microbatches (up to 1 GiB of float32 output gradient), each
  differentiated in the sums' dtypes: one table-sized addition a group, where there was one a
  tick."""
  count, each = embedded.shape[0], int(np.prod(embedded.shape[1:])) * 4
  group = max(d for d in range(1, count + 1) if count % d == 0 and d * each <= max(each, 2**30))
  reads = Leaves.read_by(first, shared, jax.tree.map(lambda a: a[0], data))
  wide = [w.astype(a.dtype) for w, a in zip(reads.take(shared), reads.take(acc))]

  def group_grads(i):  # [group, b, ...] -> [b * group, ...]: b major, so rows split over an axis
    # (`expert`) stay split; [group * b] was not a tiling of b's split, so XLA gathered every
    # tick's kept rows over `expert` to make the buffer whole.
    rows = lambda a: jnp.swapaxes(jax.lax.dynamic_slice_in_dim(a, i * group, group), 0, 1
                                  ).reshape(-1, *a.shape[2:])
    y, pullback = jax.vjp(lambda w: first(reads.put(shared, w), jax.tree.map(rows, data)), wide)
    return pullback(jnp.where(kept, rows(embedded), 0).astype(y.dtype))[0]

  # Summed from the first group's, not from a table of zeros: XLA may schedule a zero table
  # early, live through the ticks (1 GiB at the 405B's 16384 x 16032 vocabulary slice).
  total = group_grads(0)
  if count > group:
    total = jax.lax.scan(lambda s, i: (jax.tree.map(jnp.add, s, group_grads(i)), None), total,
                         jnp.arange(1, count // group))[0]
  return add(acc, reads, total)
