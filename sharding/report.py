"""Human-readable sharding tables (parameters, activations) and the too-much-replicated check."""

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from sharding.mesh import mesh_sizes
from sharding.rules import logical_to_spec, role_rules
from sharding.scope import is_names, spec

@dataclasses.dataclass(frozen=True)
class Row:
  name: str
  shape: tuple[int, ...]
  names: tuple[str | None, ...]
  spec: jax.sharding.PartitionSpec
  bytes_per_device: int
  total_bytes: int


def _split(partition_spec, sizes: dict[str, int]) -> int:
  """How many pieces a spec cuts an array into."""
  pieces = 1
  for entry in partition_spec:
    for axis in (entry if isinstance(entry, tuple) else (entry,) if entry else ()):
      pieces *= sizes[axis]
  return pieces


def param_rows(layout, names_tree: Any, abstract_tree: Any, role: str = "params") -> list[Row]:
  """One row per parameter in the sharding scope of `layout` (`role` picks the ZeRO view)."""
  sizes = mesh_sizes(layout.mesh)
  rows = []
  flat_names = jax.tree_util.tree_leaves_with_path(names_tree, is_leaf=is_names)
  for (path, names), leaf in zip(flat_names, jax.tree.leaves(abstract_tree)):
    name = jax.tree_util.keystr(path, simple=True, separator="/")
    partition = spec(names, leaf.shape, name, role)
    total = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
    rows.append(Row(name, tuple(leaf.shape), tuple(names), partition,
                    total // _split(partition, sizes), total))
  return rows


def activation_rows(recorded: list) -> list[Row]:
  """Distinct (shape, names, spec) activation constraints recorded while tracing."""
  rows, seen = [], set()
  for shape, names, partition in recorded:
    if (shape, names) not in seen:
      seen.add((shape, names))
      rows.append(Row("activation", shape, names, partition, 0, 0))
  return rows


def format_rows(rows: list[Row], with_bytes: bool = True) -> str:
  """A fixed-width table: name, shape, logical names, PartitionSpec (and bytes per device)."""
  lines = []
  for row in rows:
    cells = [row.name, "x".join(map(str, row.shape)), "(" + ", ".join(map(str, row.names)) + ")",
             str(row.spec).replace("PartitionSpec", "P")]
    if with_bytes:
      cells.append(f"{row.bytes_per_device:,} B/device")
    lines.append("  ".join(f"{c:<{w}}" for c, w in zip(cells, (34, 14, 40, 40, 0))).rstrip())
  return "\n".join(lines)


def replicated_fraction(rows: list[Row]) -> float:
  """Fraction of parameter bytes stored whole on every device."""
  total = sum(r.total_bytes for r in rows)
  whole = sum(r.total_bytes for r in rows if r.bytes_per_device == r.total_bytes)
  return whole / max(total, 1)


def check_replication(layout, rows: list[Row], max_fraction: float, reference_rules) -> None:
  """Raises if more than `max_fraction` of the parameter bytes are whole on every device while
  `reference_rules` (the default table for this layout) would split them: a rule override that
  silently replicates (e.g. the MLP). Parameters replicated by design (norm scales; embedding
  and head across pipeline stages; everything under plain data parallelism) do not count."""
  sizes = mesh_sizes(layout.mesh)
  reference = role_rules(reference_rules, "params", layout.zero_stage)
  lost = [r for r in rows if r.bytes_per_device == r.total_bytes
          and _split(logical_to_spec(r.names, r.shape, sizes, reference, r.name), sizes) > 1]
  fraction = sum(r.total_bytes for r in lost) / max(sum(r.total_bytes for r in rows), 1)
  if fraction > max_fraction:
    worst = sorted(lost, key=lambda r: -r.total_bytes)[:3]
    raise ValueError(
        f"{fraction:.0%} of parameter bytes are replicated on every device although the default"
        f" rules of this layout shard them (limit {max_fraction:.0%}); largest: "
        + ", ".join(f"{r.name} {r.names}" for r in worst))
