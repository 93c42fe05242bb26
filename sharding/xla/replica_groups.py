"""How many devices an HLO collective spans: its replica groups in any of XLA's syntaxes, a
collective-permute's cycle, or every device of the module (sharding/xla/hlo.collectives)."""

import re

_EXPLICIT = re.compile(r"replica_groups=\{(\{[\d,\s]*\})?")
_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}")
_MESH_AXIS = re.compile(r"'?([\w.]+)'?\s*=\s*(\d+)")
_GROUP_AXIS = re.compile(r"'?([\w.]+)'?(?::\((\d+)\)(\d+))?")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?\s*)*)\}")
_PAIR = re.compile(r"\{(\d+),(\d+)\}")


def module_devices(header: str) -> int | None:
  found = {k: int(v) for k, v in re.findall(r"\b(num_partitions|replica_count)=(\d+)", header)}
  return found.get("num_partitions", 1) * found.get("replica_count", 1) if found else None


def group_size(ins, all_devices: int | None) -> int:
  """N from whichever replica_groups syntax the instruction uses."""
  if m := _IOTA.search(ins.attrs):  # [groups,size]<=[...]T(...)
    return int(m.group(2))
  if m := _MESH.search(ins.attrs):  # mesh['a'=2,'b'=4] {'b'} or {'a':(1)2}
    sizes = {name: int(size) for name, size in _MESH_AXIS.findall(m.group(1))}
    n = 1
    for item in filter(None, (s.strip() for s in m.group(2).split(","))):
      axis = _GROUP_AXIS.fullmatch(item)
      n *= int(axis.group(3)) if axis.group(3) else sizes[axis.group(1)]
    return n
  m = _EXPLICIT.search(ins.attrs)
  if m and m.group(1) and m.group(1) != "{}":
    return len(re.findall(r"\d+", m.group(1)))
  if all_devices is None:  # {} (or none) means every device, and the header does not say how many
    raise ValueError(f"{ins.name}: replica_groups={{}} needs num_devices (no num_partitions or"
                     " replica_count in the HloModule header)")
  return all_devices


def permute_group_size(ins) -> int:
  """Devices in the connected component of source_target_pairs that holds the first pair."""
  m = _PAIRS.search(ins.attrs)
  pairs = [{int(a), int(b)} for a, b in _PAIR.findall(m.group(1))] if m else []
  group, size = set(pairs[0]) if pairs else set(), -1
  while len(group) != size:
    size = len(group)
    group = group.union(*(p for p in pairs if p & group))
  return max(size, 1)
