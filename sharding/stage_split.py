"""Uneven pipeline stages: how many layers each pipeline position (stage x virtual chunk) runs,
and the padded layer stack that keeps the SPMD program one scan.

With a split like 3+2 (5 layers over 2 positions) every position gets `slots = max(split)` rows
of the stacked layer weights; the rows a position does not use are padding (zeros, never run:
the stage skips them with a conditional, so they cost memory but no matmuls). The stack is
stored padded in model order (position 0's rows first), so the pipeline axis divides it.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from sharding.mesh import LayoutError


def parse(text: str) -> tuple[int, ...]:
  """"3+2" -> (3, 2); "" -> () (automatic). One-line LayoutError for anything else."""
  if not text:
    return ()
  parts = text.split("+")
  if not all(p.strip().isdigit() and int(p) > 0 for p in parts):
    raise LayoutError(f"stage_layers={text!r} must be positive layer counts joined by '+', one"
                      " per pipeline stage (x virtual stage), e.g. 7+8+8+8+8+8+8+7")
  return tuple(int(p) for p in parts)


def split(num_layers: int, positions: int, stage_layers: str = "") -> tuple[int, ...]:
  """Layers per pipeline position (stages x virtual stages, in model order).

  Given: `stage_layers` ("7+8+...+7"), checked against the model. Automatic: even when the
  positions divide the layers; otherwise ceil(L/P) layers each, one fewer on the last position,
  then the first, the second-last, ... (the last stage also runs the head and loss, the first the
  embedding: Megatron's --decoder-first/last-pipeline-num-layers, chosen for you).
  """
  if positions > num_layers:
    raise LayoutError(f"{positions} pipeline stages (x virtual stages) for {num_layers} layers:"
                      " every stage needs at least one layer; use fewer stages")
  given = parse(stage_layers)
  if given:
    if len(given) != positions or sum(given) != num_layers:
      raise LayoutError(f"stage_layers={stage_layers} gives {len(given)} stages with"
                        f" {sum(given)} layers, but the layout has {positions} pipeline"
                        f" positions (stages x virtual stages) and the model {num_layers} layers")
    return given
  slots = math.ceil(num_layers / positions)
  counts = [slots] * positions
  order = [p for pair in zip(range(positions - 1, -1, -1), range(positions)) for p in pair]
  short = slots * positions - num_layers
  for p in list(dict.fromkeys(order))[:short]:  # last, first, second-last, second, ...
    counts[p] -= 1
  return tuple(counts)


def is_uneven(counts: tuple[int, ...]) -> bool:
  return bool(counts) and len(set(counts)) > 1


def present(counts: tuple[int, ...]) -> np.ndarray:
  """[positions, slots] bool: which slots of each position hold a layer."""
  slots = max(counts)
  return np.arange(slots)[None, :] < np.asarray(counts)[:, None]


def real_rows(counts: tuple[int, ...]) -> np.ndarray:
  """Indices of the real layers in the padded stack, in model order."""
  return np.flatnonzero(present(counts).reshape(-1))


def pad(layers, counts: tuple[int, ...]):
  """Stacked layer weights [L, ...] -> [positions x slots, ...], zeros in the padding rows."""
  rows = jnp.asarray(real_rows(counts))
  size = len(counts) * max(counts)
  return jax.tree.map(lambda w: jnp.zeros((size, *w.shape[1:]), w.dtype).at[rows].set(w), layers)


def unpad(layers, counts: tuple[int, ...]):
  """The padded stack -> [L, ...] in model order (for export and comparisons)."""
  rows = jnp.asarray(real_rows(counts))
  return jax.tree.map(lambda w: jnp.take(w, rows, axis=0), layers)


def padded_shape(shape: tuple[int, ...], counts: tuple[int, ...]) -> tuple[int, ...]:
  return (len(counts) * max(counts), *shape[1:])


def layer_of_row(counts: tuple[int, ...]) -> np.ndarray:
  """For each row of the padded stack, the model layer it holds, -1 for padding."""
  out = np.full(len(counts) * max(counts), -1)
  out[real_rows(counts)] = np.arange(sum(counts))
  return out


def _in_stack(path) -> bool:
  return any(getattr(key, "key", None) == "layers" for key in path)


def restack(tree, old: tuple[int, ...], new: tuple[int, ...]):
  """A state stored with split `old` (() = unpadded) as split `new` would store it: every leaf
  under a `layers` key (parameters and their optimizer moments) unpadded, then padded again."""
  def one(path, w):
    if not _in_stack(path) or getattr(w, "ndim", 0) == 0:
      return w
    w = unpad(w, old) if old else w
    return pad(w, new) if new else w
  return jax.tree_util.tree_map_with_path(one, tree)


def rows_whole(sharding: NamedSharding) -> NamedSharding:
  """A layer-stack leaf's sharding with its rows unsplit (another split's row count need not
  divide the pipeline axis)."""
  return NamedSharding(sharding.mesh, PartitionSpec(None, *tuple(sharding.spec)[1:]))


def stored_like(abstract, old: tuple[int, ...], new: tuple[int, ...]):
  """The abstract state (ShapeDtypeStructs with NamedShardings) a checkpoint written with split
  `old` holds, given the abstract state of split `new`: its stack leaves with old's row count,
  their rows whole (`rows_whole`)."""
  count = len(old) * max(old) if old else sum(new)  # unpadded: the model's layers

  def one(path, a):
    if not _in_stack(path) or len(a.shape) == 0:
      return a
    return jax.ShapeDtypeStruct((count, *a.shape[1:]), a.dtype, sharding=rows_whole(a.sharding))
  return jax.tree_util.tree_map_with_path(one, abstract)
