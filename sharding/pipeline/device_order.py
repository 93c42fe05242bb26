"""The layer stacks between storage order and a pipeline step's device order.

Storage keeps model order: stage s holds positions [s·v, (s+1)·v) of the stacks (v = virtual
stages, a position = one chunk of layers). A stage runs the chunks at its schedule positions
(interleaved: s, s + S, s + 2S, ...; the V-shaped: s and 2S - 1 - s), so every step moves the
chunks to the stages that run them, and their gradients back. The moves are v rounds of
point-to-point sends over the pipeline axis, each stage sending one chunk and receiving one per
round; the chunk a stage both stores and runs stays put (those rounds send nothing). Left to
XLA, the same permutation as a gather (`jnp.take` over the pipeline-sharded stack) sent every
chunk and then all-reduced the stage's weights over `data` (the Llama-3.1-405B TP8 PP8 CP2 VP8
program: 12.75 GB of permutes and a 22.3 GB all-reduce a device per step)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec


@functools.lru_cache(maxsize=64)
def _rounds(kind: str, stages: int, virtual: int, positions: tuple) -> tuple:
  """((each stage's destination, the slot each stage sends, the slot each stage receives
  into), ...) per round, storage to device order; first, where every stage runs a chunk it
  stores, a round of local copies (destination None). `positions[c][s]`: the position stage s
  runs as its chunk c."""
  del kind  # in the key only: the positions already say where each chunk runs
  # The moves: position p, stored at (p // virtual, p % virtual), runs at (s, c).
  moves = [(p // virtual, p % virtual, s, c) for c, row in enumerate(positions)
           for s, p in enumerate(row)]
  left = {src: [m for m in moves if m[0] == src] for src in range(stages)}
  rounds = []
  kept = [next((m for m in left[s] if m[2] == s), None) for s in range(stages)]
  if all(kept):  # each stage runs one chunk it stores: a round of local copies
    rounds.append((None, tuple(m[1] for m in kept), tuple(m[3] for m in kept)))
    for m in kept:
      left[m[0]].remove(m)
  while any(left.values()):  # a perfect matching of stages to stages (each sends v, gets v)
    match: dict[int, tuple] = {}

    def assign(src, seen):
      for m in left[src]:
        if m[2] not in seen:
          seen.add(m[2])
          if m[2] not in match or assign(match[m[2]][0], seen):
            match[m[2]] = m
            return True
      return False
    for src in range(stages):
      if not assign(src, set()):
        raise AssertionError(f"no round of moves for {positions}")  # a regular bipartite graph
    by_src, by_dest = sorted(match.values()), [match[d] for d in range(stages)]
    for m in by_src:
      left[m[0]].remove(m)
    rounds.append((tuple(m[2] for m in by_src), tuple(m[1] for m in by_src),
                   tuple(m[3] for m in by_dest)))
  return tuple(rounds)


def device_order(schedule, mesh, axis: str, tree, inverse: bool = False):
  """Each stack [L, ...] of `tree` (split over `axis` on its first dim, in storage order) with
  its chunks at the stages and slots that run them (inverse: back to storage order)."""
  stages, virtual = schedule.stages, schedule.virtual
  if virtual == 1:
    return tree
  positions = tuple(tuple(int(p) for p in row) for row in schedule.positions())
  rounds = _rounds(schedule.kind, stages, virtual, positions)

  def local(w):  # this stage's [virtual x rows, ...]
    chunks = w.reshape(virtual, w.shape[0] // virtual, *w.shape[1:])
    me = jax.lax.axis_index(axis)
    out = jnp.zeros_like(chunks)
    for dest, send, receive in rounds:
      send, receive = (receive, send) if inverse else (send, receive)
      piece = chunks[jnp.asarray(send)[me]]
      if dest is not None:
        pairs = [(d, s) for s, d in enumerate(dest)] if inverse else list(enumerate(dest))
        piece = jax.lax.ppermute(piece, axis, pairs)
      out = out.at[jnp.asarray(receive)[me]].set(piece)
    return out.reshape(w.shape)
  return jax.shard_map(lambda t: jax.tree.map(local, t), mesh=mesh, axis_names={axis},
                       in_specs=PartitionSpec(axis), out_specs=PartitionSpec(axis))(tree)
