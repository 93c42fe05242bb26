"""Overlap in scheduled XLA programs: the kernels between each async collective's start and done."""

import dataclasses
import math
import re

from sharding.xla import hlo

# Instructions that launch no kernel: data plumbing, and the async halves of other operations.
_NO_KERNEL = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                        "after-all", "add-dependency", "opt-barrier", "partition-id",
                        "replica-id", "domain", "send", "recv"})
# Custom calls that are matrix engines' work (GEMM libraries, Triton/Pallas, cuDNN attention).
_MATMUL_TARGET = re.compile(r"custom_call_target=\"[^\"]*(gemm|matmul|cublas|triton|cudnn|mosaic)",
                            re.IGNORECASE)
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_WHILE_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_ROOT = re.compile(r"^\s*ROOT\s+%?([\w.\-]+)\s*=", re.MULTILINE)
# What forwards a value without computing on it (the path from a done to a loop's ROOT tuple).
_PLUMBING = frozenset({"tuple", "get-tuple-element", "bitcast", "copy"})


@dataclasses.dataclass(frozen=True)
class Window:
  """The scheduled instructions between one async collective's start and its done.

  Attributes:
    name: The collective's instruction name (the `-start`, or the op inside an `async-start`).
    computation: The computation holding the start and done.
    compute_ops: Kernels between them (fusions, custom calls, dots, loops...; no bitcasts,
      tuples or other async halves).
    matmul_ops: Of those, the ones doing matrix work (dots, GEMM fusions and custom calls,
      Triton/Pallas/cuDNN kernels; loops and calls that contain such work).
    matmul_flops: FLOPs of the dots between them (loop bodies times their trip counts); 0 for
      custom calls whose FLOPs the text does not show.
    between: Names of the compute ops between them, in schedule order.
    found_done: False when no matching done was found in the same computation (counted as
      nothing to hide behind).
  """

  name: str
  computation: str
  compute_ops: int
  matmul_ops: int
  matmul_flops: float
  between: tuple[str, ...]
  found_done: bool = True


def _first_operand(ins: hlo.Instr) -> str:
  return (hlo.operands(ins) or [""])[0]


class _Costs:
  """Memoized per-computation facts: does it do matrix work, and its dot FLOPs per run."""

  def __init__(self, comps: dict[str, list[hlo.Instr]]):
    self.comps = comps
    self._flops: dict[str, float] = {}
    self._matmul: dict[str, bool] = {}

  def instr_flops(self, ins: hlo.Instr, types: dict[str, str]) -> float:
    if ins.op == "dot":
      operand = _first_operand(ins)
      lhs = hlo.arrays(types.get(operand, ""))
      out = hlo.arrays(ins.type)
      dims = _CONTRACTING.search(ins.attrs)
      if not lhs or not out or not dims:
        return 0.0
      k = math.prod(lhs[0][1][int(d)] for d in dims.group(1).split(",") if d)
      return 2.0 * math.prod(out[0][1]) * k
    trip = 0 if hlo.unrun(ins) else 1
    if ins.op == "while" and (m := _TRIP.search(ins.attrs)):
      trip = int(m.group(1))
    body = _WHILE_BODY.search(ins.attrs)
    total = 0.0
    for callee in hlo.callees(ins):
      if ins.op.endswith(("-done", "-update")) or callee not in self.comps:
        continue
      total += self.flops(callee) * (trip if body and callee == body.group(1) else 1)
    return total

  def flops(self, comp: str) -> float:
    if comp not in self._flops:
      self._flops[comp] = 0.0  # guards against cycles
      types = {ins.name: ins.type for ins in self.comps[comp]}
      self._flops[comp] = sum(self.instr_flops(ins, types) for ins in self.comps[comp])
    return self._flops[comp]

  def is_matmul(self, ins: hlo.Instr) -> bool:
    if ins.op in ("dot", "convolution", "ragged-dot") or _MATMUL_TARGET.search(ins.attrs):
      return True
    if ins.op.startswith(("all-", "reduce-scatter", "collective-", "async-")):
      return False
    return any(self._comp_has_matmul(c) for c in hlo.callees(ins) if c in self.comps)

  def _comp_has_matmul(self, comp: str) -> bool:
    if comp not in self._matmul:
      self._matmul[comp] = False  # guards against cycles
      self._matmul[comp] = any(self.is_matmul(ins) for ins in self.comps[comp])
    return self._matmul[comp]


def _is_kernel(ins: hlo.Instr) -> bool:
  return ins.op not in _NO_KERNEL and not ins.op.endswith(("-start", "-done", "-update"))


def windows(hlo_text: str) -> dict[str, Window]:
  """Every async collective's window, keyed by the collective's instruction name (as in
  `hlo.collectives`). Meaningful for scheduled modules (`is_scheduled=true`), where the text
  order of a computation is its schedule.
  """
  comps = hlo.computations(hlo_text)
  costs = _Costs(comps)
  out = {}
  for comp, instrs in comps.items():
    origin, done_at = {}, {}
    for i, ins in enumerate(instrs):
      if ins.op.endswith(("-done", "-update")):
        operand = _first_operand(ins)
        origin[ins.name] = origin.get(operand, operand)
        if ins.op.endswith("-done"):
          done_at[origin[ins.name]] = i
    types = {x.name: x.type for x in instrs}
    for i, ins in enumerate(instrs):
      kind = ins.op[:-len("-start")] if ins.op.endswith("-start") else ""
      if ins.op == "async-start":
        inner = [c for c in hlo.callees(ins) if c in comps]
        names = [x.name for c in inner for x in comps[c] if x.op in hlo.KINDS]
      elif kind in hlo.KINDS:
        names = [ins.name]
      else:
        continue
      j = done_at.get(ins.name)
      between = [x for x in instrs[i + 1:j] if _is_kernel(x)] if j is not None else []
      matmuls = [x for x in between if costs.is_matmul(x)]
      flops = sum(costs.instr_flops(x, types) for x in matmuls)
      for name in names:
        out[name] = Window(name, comp, len(between), len(matmuls), flops,
                           tuple(x.name for x in between), j is not None)
  return out


def annotate(rows: list[dict], hlo_text: str) -> None:
  """Adds `compute_between`, `matmul_between`, `matmul_flops_between` and `carried` (see
  `carried`) to report rows (dicts of hlo.Collective fields) in place; synchronous collectives
  get zeros."""
  found, ahead = windows(hlo_text), carried(hlo_text)
  for row in rows:
    w = found.get(row["name"]) if row["is_async"] else None
    row["compute_between"] = w.compute_ops if w else 0
    row["matmul_between"] = w.matmul_ops if w else 0
    row["matmul_flops_between"] = w.matmul_flops if w else 0.0
    row["carried"] = ahead.get(row["name"], False)


def summarize(rows: list[dict], large_bytes: float = 0) -> dict:
  """Wire bytes per step with and without compute to hide behind, from annotated rows.

  A collective's bytes count as hidden when it is async and at least one kernel runs between its
  start and done ("behind compute"), and as hidden behind a matmul when one of those kernels is
  matrix work; everything else is exposed. Only collectives moving at least `large_bytes` per
  execution are counted.

  Returns:
    {"wire_bytes", "hidden_bytes", "exposed_bytes", "hidden_fraction", "matmul_hidden_bytes",
    "matmul_hidden_fraction", "async_ops", "ops_with_compute", "ops_with_matmul"}.
  """
  rows = [r for r in rows if r["wire_bytes"] >= large_bytes]
  total = sum(r["total_wire_bytes"] for r in rows)
  hidden = sum(r["total_wire_bytes"] for r in rows if r.get("compute_between", 0) > 0)
  behind_matmul = sum(r["total_wire_bytes"] for r in rows if r.get("matmul_between", 0) > 0)
  return {"wire_bytes": total, "hidden_bytes": hidden, "exposed_bytes": total - hidden,
          "hidden_fraction": hidden / total if total else 1.0,
          "matmul_hidden_bytes": behind_matmul,
          "matmul_hidden_fraction": behind_matmul / total if total else 1.0,
          "async_ops": sum(1 for r in rows if r["is_async"]),
          "ops_with_compute": sum(1 for r in rows if r.get("compute_between", 0) > 0),
          "ops_with_matmul": sum(1 for r in rows if r.get("matmul_between", 0) > 0)}


def busiest_computation(hlo_text: str) -> str:
  """The computation holding the most collective instructions (on GPUs the layer loop's body),
  or the last one (the entry's) when none has any."""
  comps = hlo.computations(hlo_text)
  count = lambda instrs: sum(ins.op.removesuffix("-start") in hlo.KINDS for ins in instrs)
  names = list(comps)
  return max(reversed(names), key=lambda name: count(comps[name]))


def timeline(hlo_text: str, computation: str, width: int = 0) -> list[str]:
  """The schedule of one computation reduced to what overlap is about: collective starts and
  dones, and matrix-work kernels (other kernels folded into "+n ops"): what `meshtron compile
  --timeline` prints."""
  comps = hlo.computations(hlo_text)
  costs = _Costs(comps)
  lines, folded = [], 0
  for ins in comps[computation]:
    collective = ins.op.endswith(("-start", "-done")) and (
        ins.op.rsplit("-", 1)[0] in hlo.KINDS or ins.op.startswith("async-"))
    if collective or (_is_kernel(ins) and costs.is_matmul(ins)):
      if folded:
        lines.append(f"  +{folded} ops")
        folded = 0
      shape = "x".join(map(str, (hlo.arrays(ins.type) or [("", ())])[-1][1]))
      lines.append(f"{ins.op:<22} {ins.name} {shape}")
    elif _is_kernel(ins):
      folded += 1
  if folded:
    lines.append(f"  +{folded} ops")
  return [line[:width] for line in lines] if width else lines


def _pairs(comps: dict[str, list[hlo.Instr]], comp: str) -> list[tuple[str, str]]:
  """(collective name, its done's name) for the async collectives started in `comp`."""
  done_of = {_first_operand(ins): ins.name for ins in comps[comp] if ins.op.endswith("-done")}
  return [(ins.name, done_of.get(ins.name, "")) for ins in comps[comp]
          if ins.op.endswith("-start") and ins.op[:-len("-start")] in hlo.KINDS]


def carried(hlo_text: str) -> dict[str, bool]:
  """For each async collective in a while-loop body: is its result carried to the next iteration
  (its done reaches the body's ROOT tuple through tuples, bitcasts and copies only)? That is a
  collective issued one iteration ahead of its use, e.g. the all-gather of layer i+1's weights
  during layer i (FSDP prefetch by XLA's collective pipeliner)."""
  comps = hlo.computations(hlo_text)
  roots = set(_ROOT.findall(hlo_text))
  bodies = {m.group(1) for instrs in comps.values() for ins in instrs if ins.op == "while"
            if (m := _WHILE_BODY.search(ins.attrs))}
  out = {}
  for comp in bodies & comps.keys():
    by_name = {ins.name: ins for ins in comps[comp]}
    reach, stack = set(), [n for n in by_name if n in roots]
    while stack:  # everything the ROOT tuple forwards without computing
      name = stack.pop()
      if name in reach or name not in by_name:
        continue
      reach.add(name)
      if by_name[name].op in _PLUMBING:
        stack += hlo.operands(by_name[name])
    for w in _pairs(comps, comp):
      out[w[0]] = w[1] in reach
  return out

