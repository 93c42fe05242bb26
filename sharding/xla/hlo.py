"""The collectives of an optimized XLA program: what each one moves and how often it runs."""

import collections
import dataclasses
import math
import re

from kernels.capacity_matmul import OVERFLOW_ROUNDS
from sharding.xla import replica_groups

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
         "ragged-all-to-all")

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*(?:\(.*\)\s*->\s*.*)?\{\s*$")
_OPCODE = re.compile(r"\s*(?P<op>[\w\-]+)\(")
_LEAF = re.compile(r"(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[\d,<=\s]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")
_METADATA = re.compile(r",?\s*metadata=\{[^}]*\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_ONE_CALLEE = re.compile(r"\b(?:calls|to_apply|\w+_computation|select|scatter)=%?([\w.\-]+)")
_MANY_CALLEES = re.compile(r"\b(?:calls|branch_computations|called_computations)=\{([^}]*)\}")
_WHILE_PART = re.compile(r"\b(body|condition)=%?([\w.\-]+)")
_OP_NAME = re.compile(r'%([\w.\-]+) = .*?op_name="([^"]*)"')
_LOOP_NAME = re.compile(r'op_name="([^"]*)"')

_SOURCE_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def without_source_info(text: str) -> str:
  """An optimized HLO module without its source locations (instruction metadata and the file and
  stack-frame tables): equal for the same program traced from different call sites."""
  blocks = [b for b in text.split("\n\n") if b.split("\n", 1)[0] not in _SOURCE_TABLES]
  return _METADATA.sub("", "\n\n".join(blocks))


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of an optimized HLO module.

  `bytes` (S) is the payload per device, by kind: all-reduce, all-to-all and collective-permute:
  the result bytes; all-gather: the gathered result bytes (S_out); reduce-scatter: the operand
  bytes S_in = N × result bytes; ragged-all-to-all (the dropless MoE exchange on GPUs, whose
  rows per peer depend on the routing): the smaller of its send and receive buffers, what every
  device sends and receives under balanced routing (the other buffer is sized for imbalance).
  Tuple payloads (combined ops, CPU all-to-all as N slices) add up every element;
  `shape`/`dtype` then describe the first element only.

  Attributes:
    kind: One of KINDS.
    dtype: Element type of the (first) payload array, e.g. "f32".
    shape: Shape of the (first) payload array.
    bytes: S as defined above.
    group_size: N, devices per replica group. For collective-permute (whose formula ignores N):
      the devices in the cycle of `source_target_pairs` holding the first pair (2 for a swap).
    is_async: Came from a `-start`/`-done` pair (or an `async-start` wrapper).
    count: Executions per program run: product of the trip counts of the enclosing while loops.
    computation: Name of the HLO computation holding the instruction.
    name: Instruction name, without "%".
    unknown_trip_count: An enclosing while loop has no known_trip_count; it was taken as 1, so
      `count` is a lower bound.
    arrays: Number of arrays in the payload (> 1 for combined ops and CPU all-to-all slices).
  """

  kind: str
  dtype: str
  shape: tuple[int, ...]
  bytes: int
  group_size: int
  is_async: bool
  count: int
  computation: str
  name: str
  unknown_trip_count: bool = False
  arrays: int = 1

  @property
  def wire_bytes(self) -> float:
    """Bytes each device sends per execution under ring algorithms."""
    n, s = self.group_size, self.bytes
    if self.kind == "collective-permute":
      return float(s)
    if self.kind == "all-reduce":
      return 2 * (n - 1) / n * s
    # all-gather (S_out), reduce-scatter (S_in) and the all-to-alls share one formula.
    return (n - 1) / n * s

  @property
  def total_wire_bytes(self) -> float:
    """wire_bytes times the executions per program run."""
    return self.wire_bytes * self.count


# One instruction: result type (comments stripped), attributes (metadata stripped) and, for a
# while loop, the JAX op_name its metadata records (`unrun`).
Instr = _Instr = collections.namedtuple("Instr", "name type op attrs op_name", defaults=("",))


def _close(text: str) -> int:
  """Index just past the bracket group that `text` starts with."""
  depth = 0
  for i, ch in enumerate(text):
    depth += (ch in "({[") - (ch in ")}]")
    if depth == 0:
      return i + 1
  return len(text)


def _split_top(tuple_type: str) -> list[str]:
  """Splits "(a, (b, c), d)" into its top-level elements; a non-tuple is its own only element."""
  t = tuple_type.strip()
  if not t.startswith("("):
    return [t]
  parts, depth, start = [], 0, 1
  for i, ch in enumerate(t[:_close(t)]):
    depth += (ch in "({[") - (ch in ")}]")
    if (ch == "," and depth == 1) or depth == 0:
      parts.append(t[start:i].strip())
      start = i + 1
  return [p for p in parts if p]


def _leaves(type_str: str) -> list[tuple[str, tuple[int, ...]]]:
  """All (dtype, shape) arrays in a possibly nested tuple type, layouts ignored."""
  out = []
  for m in _LEAF.finditer(re.sub(r"\{[^{}]*\}", "", type_str)):
    dims = m.group("dims").replace("<=", "").replace(" ", "")
    out.append((m.group("dtype"), tuple(int(d) for d in dims.split(",") if d)))
  return out


def bytes_of(leaves) -> int:  # of arrays(type): [(dtype, shape)]
  total = 0
  for dtype, shape in leaves:
    # Bits are the first number in XLA's type names (bf16, f8e4m3fn, s4); token[] carries none.
    bits = 8 if dtype == "pred" else int((re.findall(r"\d+", dtype) or [0])[0])
    total += math.ceil(math.prod(shape) * bits / 8)
  return total


def _parse(hlo_text: str) -> tuple[dict[str, list[_Instr]], str]:
  """Returns ({computation: instructions}, module header line)."""
  header, current, pending, stmts = "", "", None, []
  for raw in hlo_text.splitlines():
    line = _COMMENT.sub("", raw).strip()
    if line.startswith("HloModule"):
      header = line
    elif (head := _HEADER.match(line)) and "=" not in line.split("(")[0]:
      current, pending = head.group("name"), None
    elif _INSTR.match(line):
      pending = [current, line]
      stmts.append(pending)
    elif line and not line.startswith("}") and pending:
      pending[1] += " " + line  # a wrapped instruction (hand-written HLO) continues
    else:
      pending = None
  comps: dict[str, list[_Instr]] = collections.defaultdict(list)
  for comp, text in stmts:
    m = _INSTR.match(text)
    rest = m.group("rest")
    end = _close(rest) if rest.startswith("(") else rest.find(" ")
    type_str, tail = rest[:end], rest[end:]
    if op := _OPCODE.match(tail):
      attrs = _METADATA.sub("", tail[op.end():])
      loop = _LOOP_NAME.search(tail) if op.group("op") == "while" else None
      comps[comp].append(_Instr(m.group("name"), type_str, op.group("op"), attrs,
                                loop.group(1) if loop else ""))
  return comps, header


def op_names(hlo_text: str) -> dict[str, str]:
  """Instruction name -> the JAX op_name path its metadata records (instructions that have one)."""
  return dict(_OP_NAME.findall(hlo_text))


def computations(hlo_text: str) -> dict[str, list[Instr]]:
  """{computation name: its instructions in text order}; for a scheduled module (is_scheduled=
  true) that order is the schedule. `attrs` starts with the operand list."""
  return _parse(hlo_text)[0]


def callees(ins: Instr) -> list[str]:
  """Names of the computations an instruction calls (fusions, calls, while body/condition...)."""
  names = _ONE_CALLEE.findall(ins.attrs)
  for group in _MANY_CALLEES.findall(ins.attrs):
    names += [c.strip().lstrip("%") for c in group.split(",") if c.strip()]
  return names + [c for _, c in _WHILE_PART.findall(ins.attrs)]


def count_within(comps: dict[str, list[Instr]], comp: str, matches, path=()) -> int:
  """Instructions where matches(instruction) in `comp` and what it calls, at every call."""
  return sum(bool(matches(i)) + sum(count_within(comps, c, matches, (*path, comp))
             for c in callees(i) if c in comps and c not in path) for i in comps.get(comp, []))


def operands(ins: Instr) -> list[str]:
  """Operand names, printed as "%name" (or "type %name" in older text)."""
  text = "(" + ins.attrs
  inside = text[1:_close(text) - 1]
  return re.findall(r"%([\w.\-]+)", inside) or re.findall(r"([\w.\-]+)", inside)


def arrays(type_str: str) -> list[tuple[str, tuple[int, ...]]]:
  """(dtype, shape) of every array in a (possibly tuple) HLO type."""
  return _leaves(type_str)


_INDUCTION = re.compile(r'"known_induction_variable"\s*:\s*\{\s*"tuple_index"\s*:\s*"(\d+)"')
_CONSTANT = re.compile(r"\s*(-?\d+)\)")


def trip_count(ins: Instr, comps: dict[str, list[Instr]], comp: str) -> int | None:
  """Iterations of while loop `ins` (in computation `comp`): its known_trip_count, else read from
  its condition, `induction < constant` with the induction variable's initial value a constant
  (XLA leaves the count out of loops it rewrote, e.g. the gradient-accumulation loop once its
  first iteration is peeled); None if neither says; 0 for a loop the prediction never enters."""
  if unrun(ins):
    return 0
  if trip := _TRIP.search(ins.attrs):
    return int(trip.group(1))
  parts = dict(_WHILE_PART.findall(ins.attrs))
  body = comps.get(parts.get("condition", ""), [])
  root = body[-1] if body else None
  if root is not None and root.op == "fusion":  # the compare fused with its constant
    fused = [c for c in callees(root) if c in comps]
    body, root = (comps[fused[0]], comps[fused[0]][-1]) if fused else (body, None)
  if root is None or root.op != "compare" or "direction=LT" not in root.attrs:
    return None
  values = {x.name: int(m.group(1)) for x in body
            if x.op == "constant" and (m := _CONSTANT.match(x.attrs))}
  bound = values.get((operands(root)[1:2] or [""])[0])
  index = int(m.group(1)) if (m := _INDUCTION.search(ins.attrs)) else 0
  init = _constant_of(comps.get(comp, []), operands(ins)[:1], index)
  return None if bound is None or init is None else max(0, bound - init)


def unrun(ins: Instr) -> bool:
  """A loop of rounds after the first, the MoE exchange's (sharding/exchange_rounds.py) or the
  experts' batched GEMMs' (kernels/capacity_matmul.py), which the predicted case, every device
  pair within its capacity and every expert within its slots, never enters."""
  return OVERFLOW_ROUNDS in ins.op_name


def _constant_of(instrs: list[Instr], names: list[str], index: int) -> int | None:
  """The value of element `index` of the while operand `names[0]` when it is a constant (through
  tuple, copy and bitcast instructions)."""
  by_name = {x.name: x for x in instrs}
  x = by_name.get(names[0]) if names else None
  if x is not None and x.op == "tuple":
    x = by_name.get((operands(x)[index:index + 1] or [""])[0])
  while x is not None and x.op in ("copy", "bitcast"):
    x = by_name.get((operands(x) or [""])[0])
  m = _CONSTANT.match(x.attrs) if x is not None and x.op == "constant" else None
  return int(m.group(1)) if m else None


def executions(comps: dict[str, list[_Instr]]
               ) -> tuple[dict[str, int], dict[str, bool], set[str]]:
  """Executions per program run of each computation of `computations(...)`, its unknown-trip
  flag, and the async wrappers: what `collectives` counts by (and what counts ops it does not
  list, e.g. ragged-all-to-all).

  A computation runs once per run of each call site, a while body known_trip_count times (its
  condition once more). Every conditional branch counts as taken, an upper bound. Computations
  nobody calls (the entry, or snippets without one) run once.
  """
  callers: dict[str, list[tuple[str, int, bool]]] = collections.defaultdict(list)
  async_comps = set()
  for comp, instrs in comps.items():
    for ins in instrs:
      if ins.op.endswith(("-done", "-update")):
        continue  # the matching -start already names the same callee
      if ins.op == "while":
        trip = trip_count(ins, comps, comp)
        n = 1 if trip is None else trip
        for part, callee in _WHILE_PART.findall(ins.attrs):
          callers[callee].append((comp, n + (part == "condition" and trip is not None),
                                  trip is None))
        continue
      callees = _ONE_CALLEE.findall(ins.attrs)
      for group in _MANY_CALLEES.findall(ins.attrs):
        callees += [c.strip().lstrip("%") for c in group.split(",") if c.strip()]
      for callee in callees:
        callers[callee].append((comp, 1, False))
        if ins.op == "async-start":
          async_comps.add(callee)

  count, unknown = {}, {}

  def visit(comp: str, seen: frozenset) -> None:
    if comp in count:
      return
    sites = [s for s in callers.get(comp, []) if s[0] not in seen]  # guards against cycles
    if not sites:
      count[comp], unknown[comp] = 1, False
      return
    total, unk = 0, False
    for caller, mult, site_unknown in sites:
      visit(caller, seen | {comp})
      total += count[caller] * mult
      unk = unk or unknown[caller] or site_unknown
    count[comp], unknown[comp] = total, unk

  for comp in comps:
    visit(comp, frozenset())
  return count, unknown, async_comps


def _payload(kind: str, is_start: bool, type_str: str) -> str:
  """The part of the result type that the byte formula of `kind` is about."""
  if not is_start or kind == "all-reduce":
    return type_str  # all-reduce-start's result is the reduced value itself
  parts = _split_top(type_str)
  if kind == "ragged-all-to-all":  # ((input, output, offsets and sizes...), output)
    sent, received = _split_top(parts[0])[0], parts[-1]
    return min(sent, received, key=lambda t: bytes_of(_leaves(t)))
  if kind == "collective-permute":
    return parts[1]  # (operand, result, context...)
  return parts[-1]  # (operand(s), result)


def collectives(hlo_text: str, num_devices: int | None = None) -> list[Collective]:
  """Lists the collectives of an optimized HLO module (`compiled.as_text()`), in text order.

  Args:
    hlo_text: Optimized HLO text, CPU or GPU (sync or async `-start`/`-done` forms).
    num_devices: Devices in the program; only used for `replica_groups={}` when the HloModule
      header has neither num_partitions nor replica_count (header values take precedence).

  Returns:
    One Collective per instruction; async ops appear once (at -start), -done is ignored.

  Raises:
    ValueError: A collective's group size cannot be determined.
  """
  comps, header = _parse(hlo_text)
  count, unknown, async_comps = executions(comps)
  all_devices = replica_groups.module_devices(header) or num_devices
  out = []
  for comp, instrs in comps.items():
    for ins in instrs:
      is_start = ins.op.endswith("-start")
      kind = ins.op[:-len("-start")] if is_start else ins.op
      if kind not in KINDS:
        continue
      leaves = _leaves(_payload(kind, is_start, ins.type))
      permute = kind == "collective-permute"
      n = replica_groups.permute_group_size(ins) if permute else replica_groups.group_size(
          ins, all_devices)
      nbytes = bytes_of(leaves) * (n if kind == "reduce-scatter" else 1)
      dtype, shape = leaves[0] if leaves else ("", ())
      out.append(Collective(kind=kind, dtype=dtype, shape=shape, bytes=nbytes, group_size=n,
                            is_async=is_start or comp in async_comps, count=count[comp],
                            computation=comp, name=ins.name, unknown_trip_count=unknown[comp],
                            arrays=len(leaves)))
  return out


def summarize(cols: list[Collective]) -> dict:
  """Totals per kind present, in KINDS order ({} without collectives).

  Returns:
    {kind: {"ops": instructions, "executions": sum of count, "wire_bytes": sum of
    total_wire_bytes, "payload_bytes": sum of bytes × count}}.
  """
  out = {}
  for kind in KINDS:
    of_kind = [c for c in cols if c.kind == kind]
    if of_kind:
      out[kind] = {"ops": len(of_kind), "executions": sum(c.count for c in of_kind),
                   "wire_bytes": sum(c.total_wire_bytes for c in of_kind),
                   "payload_bytes": sum(c.bytes * c.count for c in of_kind)}
  return out

