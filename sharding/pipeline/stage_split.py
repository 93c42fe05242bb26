"""Uneven pipeline stages: how many layers each pipeline position (stage x virtual chunk) runs,
and the padded layer stack that keeps the SPMD program one scan.

With a split like 3+2 (5 layers over 2 positions) every position gets `slots = max(split)` rows
of the stacked layer weights; the rows a position does not use are padding (zeros, never run:
the stage skips them with a conditional, so they cost memory but no matmuls). The stack is
stored padded in model order (position 0's rows first), so the pipeline axis divides it.

A MoE model has two stacks, its first dense layers (`layers`) and its MoE layers (`moe_layers`);
a position's layers are some of each, so each stack gets its own counts per position (its
"stack split", e.g. 1 dense + 3 MoE layers on 2 positions: layers 1+0, moe_layers 1+2), and is
padded by its own max when those are uneven.
"""

import functools
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


# Cached: the planner asks for the same few splits for each of its ~30,000 layouts.
@functools.lru_cache(maxsize=4096)
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


@functools.lru_cache(maxsize=4096)  # the planner asks it ~10^6 times a search
def slots_per_device(num_layers: int, pipeline: int, virtual: int, stage_layers: str) -> int:
  """Layer slots one pipeline stage holds and runs at most (Layout.layers_per_device)."""
  if pipeline == 1:
    return num_layers
  return max(split(num_layers, pipeline * virtual, stage_layers)) * virtual


# The model's layer stacks in model order (models/transformer.py): dense layers, then MoE layers.
STACKS = ("layers", "moe_layers")
# ((stack name, its layers per position), ...) for the stacks stored padded; () for none.
StackSplit = tuple[tuple[str, tuple[int, ...]], ...]


def stack_split(counts: tuple[int, ...], dense_layers: int) -> StackSplit:
  """How the stacks are stored for the split `counts` (layers per position) of a model whose
  first `dense_layers` layers are dense: every stack's layers per position when any stack's are
  uneven (all stacks then stored padded), else () (each stack divides evenly, stored as is)."""
  dense, start = [], 0
  for n in counts:
    dense.append(min(max(dense_layers - start, 0), n))
    start += n
  per_stack = (tuple(dense), tuple(n - d for n, d in zip(counts, dense)))
  split = tuple((name, c) for name, c in zip(STACKS, per_stack) if sum(c))
  return split if any(is_uneven(c) for _, c in split) else ()


def from_meta(value) -> StackSplit:
  """A checkpoint's recorded split: [[name, counts], ...], or the layer counts alone (dense
  models, written before MoE pipelines)."""
  if value and all(isinstance(v, int) for v in value):
    return (("layers", tuple(value)),)
  return tuple((name, tuple(c)) for name, c in value or ())


def present_rows(split: StackSplit, flat: bool = False) -> dict[str, np.ndarray]:
  """{stack: [positions, slots] bool (flat: [positions x slots])} of the padded stacks."""
  return {name: present(c).reshape(-1) if flat else present(c) for name, c in split}


def live_chunks(positions: np.ndarray, present: dict, stacks) -> dict:
  """{stack: [virtual] bool}: the chunks (a device's virtual stages; `positions` [virtual,
  stages], Schedule.positions) in which the stack holds a layer on some stage. In the others
  every row on every stage is padding, which a conditional skips, so its gradient is zero and
  the pipeline executor keeps no sum for it. DeepSeek-V3's 3 dense layers on 8 stages x 4 chunks
  are stored as 2 rows a position; each device kept float32 sums of 8 rows, where 2 can live."""
  return {k: np.asarray([k not in present or bool(np.asarray(present[k])[p].any())
                         for p in positions]) for k in stacks}


def row_patterns(present: dict) -> tuple[list[dict], np.ndarray]:
  """([pattern {stack: [rows] bool}], [positions] the pattern of each): the distinct rows the
  positions of `present` ({stack: [positions, rows] bool}) hold; one empty pattern without
  padded stacks."""
  if not present:
    return [{}], np.zeros(1, np.int32)
  keys = sorted(present)
  table = np.concatenate([np.asarray(present[k]) for k in keys], axis=1)
  unique, pattern_of = np.unique(table, axis=0, return_inverse=True)
  widths = np.cumsum([0] + [np.asarray(present[k]).shape[1] for k in keys])
  patterns = [{k: row[widths[i]:widths[i + 1]] for i, k in enumerate(keys)} for row in unique]
  return patterns, pattern_of.reshape(-1).astype(np.int32)


def nested(patterns: list[dict]) -> bool:
  """Whether one of the row patterns holds every row the others hold (one stack's padding
  rows, as Llama-3.1-405B's 126 layers on 64 positions). The executor then runs that pattern's
  rows at every position, the padding rows masked (`masked_rows`), where a switch over the
  patterns made XLA copy each row's weights and gradients at its branches' boundaries (405B TP8
  PP8 CP2 VP8: 5.5 s a step). In lock step that costs no time: a tick waits for the position
  holding them all, and a conditional is priced at its costliest branch. Not for patterns of two
  stacks (a MoE model's dense and MoE rows), whose union no position runs."""
  union = {k: np.any([p[k] for p in patterns], axis=0) for k in patterns[0]}
  return any(all(np.array_equal(p[k], union[k]) for k in union) for p in patterns)


# Why pipeline_recompute=false refuses a layout (sharding.resolution and `plan` both say it).
KEPT_REFUSAL = ("mesh.pipeline_recompute=false keeps one program's residuals per chunk: it needs"
                " stages that split one layer stack (a MoE model's dense layers evenly) and no"
                " multi-token prediction; set pipeline_recompute=true")


@functools.lru_cache(maxsize=4096)  # the planner asks it for each kept layout
def keeps_residuals(counts: tuple[int, ...], dense_layers: int, mtp_depth: int) -> bool:
  """Whether the kept-residuals executor (pipeline_recompute=false) runs the split `counts` of
  a model with `dense_layers` leading dense layers: its positions' row patterns nest (one
  program keeps every chunk's residuals) and no multi-token prediction module follows."""
  patterns = row_patterns(present_rows(stack_split(counts, dense_layers)))[0]
  return nested(patterns) and not mtp_depth


def masked_rows(patterns: list[dict], pattern) -> dict:
  """The rows of pattern number `pattern` (traced: the position's), traced: models/transformer
  runs every row and masks the padding ones."""
  return {k: jnp.asarray(np.stack([p[k] for p in patterns]))[pattern] for k in patterns[0]}


def pad_stacks(params: dict, split: StackSplit) -> dict:
  """The model's parameters with each stack of `split` padded."""
  return {**params, **{name: pad(params[name], c) for name, c in split}}


def unpad_stacks(params: dict, split: StackSplit) -> dict:
  return {**params, **{name: unpad(params[name], c) for name, c in split}}


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


def layer_of_row(counts: tuple[int, ...]) -> np.ndarray:
  """For each row of the padded stack, the model layer it holds, -1 for padding."""
  out = np.full(len(counts) * max(counts), -1)
  out[real_rows(counts)] = np.arange(sum(counts))
  return out


def _stack_of(path) -> str | None:
  """The layer stack a state leaf belongs to (its parameter or optimizer moment), or None."""
  return next((key.key for key in path if getattr(key, "key", None) in STACKS), None)


def restack(tree, old: StackSplit, new: StackSplit):
  """A state stored with split `old` (() = unpadded) as split `new` would store it: every leaf
  of a layer stack (parameters and their optimizer moments) unpadded, then padded again."""
  old, new = dict(old), dict(new)

  def one(path, w):
    stack = _stack_of(path)
    if stack is None or getattr(w, "ndim", 0) == 0:
      return w
    w = unpad(w, old[stack]) if stack in old else w
    return pad(w, new[stack]) if stack in new else w
  return jax.tree_util.tree_map_with_path(one, tree)


def rows_whole(sharding: NamedSharding) -> NamedSharding:
  """A layer-stack leaf's sharding with its rows unsplit (another split's row count need not
  divide the pipeline axis)."""
  return NamedSharding(sharding.mesh, PartitionSpec(None, *tuple(sharding.spec)[1:]))


def stored_like(abstract, old: StackSplit, new: StackSplit):
  """The abstract state (ShapeDtypeStructs with NamedShardings) a checkpoint written with split
  `old` holds, given the abstract state of split `new`: its stack leaves with old's row count,
  their rows whole (`rows_whole`)."""
  old, new = dict(old), dict(new)

  def one(path, a):
    stack = _stack_of(path)
    if stack is None or len(a.shape) == 0:
      return a
    if stack in old:
      count = len(old[stack]) * max(old[stack])
    else:  # unpadded: the stack's own layers
      count = sum(new[stack]) if stack in new else a.shape[0]
    return jax.ShapeDtypeStruct((count, *a.shape[1:]), a.dtype, sharding=rows_whole(a.sharding))
  return jax.tree_util.tree_map_with_path(one, abstract)
