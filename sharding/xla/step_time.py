"""Step time from a compiled GPU program, without a GPU: a roofline over the scheduled HLO.

The entry computation is walked in schedule order (a scheduled module's text order); a while
loop runs its body trip-count times, a call its callee, a conditional its costliest branch.
Kernels run one after another on the compute stream. An async collective runs on the
communication stream from its start (once that stream is free) and the compute stream waits for
it at its done, so what the schedule puts between the two hides it; a synchronous collective
blocks the compute stream.

- A kernel costs max(FLOPs / (peak x fraction), bytes / copy bandwidth) + launch overhead:
  FLOPs of the dots it holds (fusions, nested fusions) or of a cuBLAS GEMM call (from its
  contracting dims), at the fp8 peak for a GEMM on f8 operands; the flash-attention Triton
  kernels by name (forward 2 matmuls, dQ 3, dK/dV 4, each 2·B·H·L²·d halved for the causal
  mask) at the flash fraction; the Pallas grouped matmul (dropless MoE) by name, 2·M·K·N over
  its buffer's rows, at the grouped-matmul fraction. Bytes: operands read and
  results written, where an operand only sliced (dynamic-slice, gather) counts its slices and an
  in-place dynamic-update-slice its update, also through bitcasts (views, which move nothing).
- A collective costs its ring wire bytes (hlo.Collective.wire_bytes) over the bus bandwidth of
  NVLink when its group stays in a node, else of the network, plus a latency. A ragged
  all-to-all across nodes (the dropless MoE exchange) has no ring: the bytes for peers in other
  nodes leave through the GPU's own NIC, the rest over NVLink meanwhile.

The constants are the GPU profile's (sharding/plan/profiles.py), each with its source.
"""

import dataclasses
import math
import re

import numpy as np

from sharding.xla import hlo, overlap

_NO_KERNEL = overlap._NO_KERNEL | {"while", "call", "conditional", "copy-start", "copy-done"}
_CONTRACT_ATTR = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_CONTRACT_JSON = re.compile(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]')
_GEMM_CALL = re.compile(r'custom_call_target="__cublas\$(?:lt\$)?(?:gemm|matmul)')
_FLASH = re.compile(r"flash_attention_(fwd|dq|dkv)")
_FLASH_MATMULS = {"fwd": 2, "dq": 3, "dkv": 4}
# The Pallas grouped matmul of dropless MoE (kernels/grouped_matmul.py): rows x weights, and dW.
GROUPED_MATMUL = re.compile(r"/grouped_matmul(?:_fp8)?(_dw)?/pallas_call")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_LIST_GROUPS = re.compile(r"replica_groups=\{\{([\d,]+)\}")


@dataclasses.dataclass
class OpCost:
  """One instruction's cost: per execution, and how many times a step runs it."""

  name: str
  kind: str  # "gemm", "attention", "memory" or a collective kind
  seconds: float
  count: int
  flops: float = 0.0
  bytes: float = 0.0

  @property
  def total_s(self) -> float:
    return self.seconds * self.count


@dataclasses.dataclass
class StepPrediction:
  """The predicted step of one device, and where its time goes."""

  step_s: float
  compute_s: float  # kernels alone, back to back
  communication_s: float  # every collective's time, hidden or not
  exposed_communication_s: float  # the step's time beyond its kernels
  top_ops: list  # the costliest instructions: dicts of OpCost fields and total_s

  def summary(self, tokens_per_step: float, model_flops_per_step: float, devices: int,
              peak_flops: float) -> dict:
    """The JSON of `meshtron compile --json` ("step_time"): seconds, tokens/s/GPU, MFU."""
    return {"step_s": self.step_s, "compute_s": self.compute_s,
            "communication_s": self.communication_s,
            "exposed_communication_s": self.exposed_communication_s,
            "tokens_per_s_per_gpu": tokens_per_step / self.step_s / devices,
            "mfu": model_flops_per_step / devices / self.step_s / peak_flops,
            "top_ops": self.top_ops}


class _Walk:
  def __init__(self, hlo_text: str, profile, gpus_per_node: int):
    self.comps = hlo.computations(hlo_text)
    self.flops_of = overlap._Costs(self.comps)
    self.op_names = hlo.op_names(hlo_text)
    self.collectives = {c.name: c for c in hlo.collectives(hlo_text)}
    self.profile, self.gpus_per_node = profile, gpus_per_node
    self.costs: dict[str, OpCost] = {}
    self.communication = 0.0

  # ---- one instruction ----

  def kernel(self, ins: hlo.Instr, types: dict, count: int) -> float:
    p = self.profile
    flops, fraction, kind = self.kernel_flops(ins, types)
    moved = self.kernel_bytes(ins, types)
    peak = p.peak_fp8_flops if kind == "gemm" and self.is_f8_gemm(ins, types) else \
        p.peak_bf16_flops
    seconds = max(flops / (peak * fraction) if flops else 0.0,
                  moved / p.copy_bandwidth) + p.kernel_overhead_s
    self.record(OpCost(ins.name, kind if flops else "memory", seconds, count, flops, moved))
    return seconds

  def kernel_flops(self, ins: hlo.Instr, types: dict) -> tuple[float, float, str]:
    p = self.profile
    flash = _FLASH.search(self.op_names.get(ins.name, ""))
    if ins.op == "custom-call" and flash:
      shapes = [s for _, s in hlo.arrays(types.get((hlo.operands(ins) or [""])[0], ""))]
      if shapes and len(shapes[0]) == 4:
        b, length, heads, head_dim = shapes[0]
        per_matmul = 2.0 * b * heads * length * length * head_dim / 2  # causal: half the scores
        return (_FLASH_MATMULS[flash.group(1)] * per_matmul, p.flash_triton_fraction,
                "attention")
    grouped = GROUPED_MATMUL.search(self.op_names.get(ins.name, ""))
    if ins.op == "custom-call" and grouped:
      return grouped_matmul_flops(ins, types, bool(grouped.group(1))), \
          p.grouped_matmul_fraction, "gemm"
    if ins.op == "custom-call" and "cudnn" in ins.attrs and "fmha" in ins.attrs.lower():
      shapes = [s for _, s in hlo.arrays(types.get((hlo.operands(ins) or [""])[0], ""))]
      if shapes and len(shapes[0]) == 4:
        b, length, heads, head_dim = shapes[0]
        # The backward's target is "__cudnn$fmha...Backward" (seen in jax 0.11.2's GPU
        # program; "bwd" appears only in the op name): dQ, dK, dV, dP and the recomputed scores.
        matmuls = 5 if "backward" in ins.attrs.lower() or "bwd" in ins.attrs.lower() else 2
        return (matmuls * b * heads * length * length * head_dim, p.flash_cudnn_fraction,
                "attention")
    if ins.op == "custom-call" and _GEMM_CALL.search(ins.attrs):
      lhs = hlo.arrays(types.get((hlo.operands(ins) or [""])[0], ""))
      out = hlo.arrays(ins.type)
      dims = _CONTRACT_JSON.search(ins.attrs)
      if lhs and out and dims:
        k = math.prod(lhs[0][1][int(d.strip().strip('"'))] for d in dims.group(1).split(",")
                      if d.strip())
        return 2.0 * math.prod(out[0][1]) * k, p.gemm_peak_fraction, "gemm"
    if ins.op == "dot":
      return self.flops_of.instr_flops(ins, types), p.gemm_peak_fraction, "gemm"
    if ins.op == "fusion":
      return (sum(self.flops_of.flops(c) for c in hlo.callees(ins) if c in self.comps),
              p.gemm_peak_fraction, "gemm")
    return 0.0, 1.0, "memory"

  def is_f8_gemm(self, ins: hlo.Instr, types: dict) -> bool:
    """A cuBLASLt fp8 call, or a dot (or a fusion holding one) on two f8 operands: it runs on
    the fp8 tensor cores (peak_fp8_flops)."""
    if ins.op == "custom-call":
      return 'custom_call_target="__cublas$lt$matmul$f8"' in ins.attrs
    if ins.op == "dot":
      kinds = [hlo.arrays(types.get(o, "")) for o in hlo.operands(ins)[:2]]
      return len(kinds) == 2 and all(k and k[0][0].startswith("f8") for k in kinds)
    if ins.op != "fusion":
      return False
    for comp in hlo.callees(ins):
      body = self.comps.get(comp, [])
      body_types = {x.name: x.type for x in body}
      if any(self.is_f8_gemm(x, body_types) for x in body if x.op in ("dot", "fusion")):
        return True
    return False

  def kernel_bytes(self, ins: hlo.Instr, types: dict) -> float:
    nbytes = lambda type_str: hlo.bytes_of(hlo.arrays(type_str))  # noqa: E731
    operands = hlo.operands(ins)
    out = nbytes(ins.type)
    fused = [c for c in hlo.callees(ins) if c in self.comps] if ins.op == "fusion" else []
    if not fused:
      return out + sum(nbytes(types.get(o, "")) for o in operands)
    body = self.comps[fused[0]]
    params = {int(m.group(1)): x.name for x in body if x.op == "parameter"
              if (m := re.match(r"\s*(\d+)", x.attrs))}
    # A bitcast is a view of its operand (no kernel, no bytes): a value is read where the
    # views of it are, so the rules below look through them.
    by_name = {x.name: x for x in body}
    viewed = lambda name: viewed(hlo.operands(by_name[name])[0]) if name in by_name and \
        by_name[name].op == "bitcast" else name  # noqa: E731
    users: dict[str, list] = {}
    for x in body:
      if x.op != "bitcast":
        for name in hlo.operands(x):
          users.setdefault(viewed(name), []).append(x)
    root = body[-1] if body else None
    while root is not None and root.op == "bitcast":
      root = by_name.get(hlo.operands(root)[0])
    in_place = root is not None and root.op == "dynamic-update-slice"
    total = 0.0
    for i, operand in enumerate(operands):
      param = params.get(i)
      uses = users.get(param, [])
      if in_place and [viewed(o) for o in hlo.operands(root)[:1]] == [param]:
        continue  # the buffer updated in place: only the update moves
      if uses and all(u.op in ("dynamic-slice", "gather") and
                      [viewed(o) for o in hlo.operands(u)[:1]] == [param] for u in uses):
        total += sum(nbytes(u.type) for u in uses)
      else:
        total += nbytes(types.get(operand, ""))
    if in_place:
      update = hlo.operands(root)[1:2]
      body_types = {x.name: x.type for x in body}
      out = 2 * nbytes(body_types.get(update[0], "")) if update else out
    return total + out

  def collective(self, name: str, count: int) -> float:
    """Seconds of one execution of a collective (0 for an async op that is none); recorded."""
    c = self.collectives.get(name)
    if c is None:
      return 0.0
    seconds = self.collective_seconds(c)
    self.communication += seconds * count
    self.record(OpCost(name, c.kind, seconds, count, bytes=c.wire_bytes))
    return seconds

  def collective_seconds(self, c: hlo.Collective) -> float:
    p = self.profile
    inside = self.group_in_node(c)
    if c.kind == "ragged-all-to-all" and not inside:
      # An all-to-all has no ring to spread over a node's NICs: the rows for peers in other
      # nodes leave through this GPU's own NIC (network_busbw_per_gpu, its line rate), the
      # rows for its node's peers over NVLink at the same time.
      ins = self.instruction(c.computation, c.name)
      ids = first_group(ins.attrs) if ins else None
      local = sum(i // self.gpus_per_node == ids[0] // self.gpus_per_node for i in ids) \
          if ids else 1
      n = c.group_size
      return max(c.bytes * (n - local) / n / p.network_busbw_per_gpu,
                 c.bytes * (local - 1) / n / p.nvlink_busbw) + p.network_latency_s
    bandwidth = p.nvlink_busbw if inside else min(
        p.nvlink_busbw, p.network_busbw_per_gpu * min(c.group_size, self.gpus_per_node))
    latency = p.collective_latency_s if inside else p.network_latency_s
    return c.wire_bytes / bandwidth + latency

  def group_in_node(self, c: hlo.Collective) -> bool:
    """Whether the first replica group (device ids) lies in one node of gpus_per_node GPUs."""
    ins = self.instruction(c.computation, c.name)
    ids = first_group(ins.attrs) if ins else None
    if c.kind == "collective-permute" or not ids:
      return c.group_size <= self.gpus_per_node
    return len({i // self.gpus_per_node for i in ids}) == 1

  def instruction(self, comp: str, name: str):
    return next((x for x in self.comps.get(comp, []) if x.name == name), None)

  def record(self, cost: OpCost) -> None:
    seen = self.costs.get(cost.name)
    if seen is None:
      self.costs[cost.name] = cost
    else:
      seen.count += cost.count

  # ---- one computation: (time, kernel time) per run ----

  def run(self, comp: str, count: int) -> tuple[float, float]:
    instrs = self.comps.get(comp, [])
    types = {x.name: x.type for x in instrs}
    compute_free = comm_free = kernels = 0.0
    finish: dict[str, float] = {}
    for ins in instrs:
      op = ins.op
      if op.endswith("-start") and op[:-len("-start")] in hlo.KINDS or op == "async-start":
        names = [ins.name] if op != "async-start" else [
            x.name for c in hlo.callees(ins) if c in self.comps for x in self.comps[c]
            if x.op in hlo.KINDS]
        seconds = sum(self.collective(n, count) for n in names)
        start = max(compute_free, comm_free)
        comm_free = start + seconds
        finish[ins.name] = comm_free
      elif op.endswith("-done"):
        source = (hlo.operands(ins) or [""])[0]
        compute_free = max(compute_free, finish.get(source, 0.0))
      elif op in hlo.KINDS:  # synchronous: blocks the compute stream
        seconds = self.collective(ins.name, count)
        compute_free = max(compute_free, comm_free) + seconds
        comm_free = compute_free
      elif op == "while":
        trip = hlo.trip_count(ins, self.comps, comp)
        trip = 1 if trip is None else trip
        body = overlap._WHILE_BODY.search(ins.attrs)
        seconds, inner = self.run(body.group(1), count * trip) if body else (0.0, 0.0)
        compute_free += trip * seconds
        kernels += trip * inner
      elif op in ("call", "conditional"):
        branches = [self.run(c, count) for c in hlo.callees(ins) if c in self.comps]
        seconds, inner = max(branches, default=(0.0, 0.0))
        compute_free += seconds
        kernels += inner
      elif op not in _NO_KERNEL and not op.endswith(("-update",)):
        seconds = self.kernel(ins, types, count)
        compute_free += seconds
        kernels += seconds
    return max(compute_free, comm_free), kernels


def grouped_matmul_flops(ins: hlo.Instr, types: dict, weight_grad: bool) -> float:
  """2·M·K·N of a grouped matmul call over its buffer's M rows (the rows it may hold; the kernel
  skips the tiles past its groups, so under a padded exchange buffer this is an upper bound).
  Rows x weights: out [M, N], rows [M, K], weights [E, K, N] (or [E, N, K], the backward's dx
  reading them transposed); dW: out [E, K, N], rows [M, K]."""
  out = hlo.arrays(ins.type)
  shapes = [s for o in hlo.operands(ins) for _, s in hlo.arrays(types.get(o, ""))[:1]]
  if not out:
    return 0.0
  if weight_grad and len(out[0][1]) == 3:
    _, k, n = out[0][1]
    rows = [s[0] for s in shapes if len(s) == 2 and s[1] == k]
    return 2.0 * rows[0] * k * n if rows else 0.0
  if len(out[0][1]) == 2:
    m, n = out[0][1]
    contracted = {s[1] for s in shapes if len(s) == 2 and s[0] == m}  # the rows' K
    ks = [k for s in shapes if len(s) == 3 for k in contracted if sorted(s[1:]) == sorted((k, n))]
    return 2.0 * m * ks[0] * n if ks else 0.0
  return 0.0


def first_group(attrs: str) -> list[int] | None:
  """Device ids of the first replica group: {{0,1,..},..} or the iota form [G,N]<=[dims]T(perm)
  (iota(prod dims) reshaped to dims, transposed by perm, read as G groups of N)."""
  if m := _LIST_GROUPS.search(attrs):
    return [int(x) for x in m.group(1).split(",")]
  if m := _IOTA_GROUPS.search(attrs):
    groups, size = int(m.group(1)), int(m.group(2))
    dims = [int(d) for d in m.group(3).split(",")]
    perm = [int(d) for d in m.group(4).split(",")] if m.group(4) else list(range(len(dims)))
    ids = np.arange(math.prod(dims)).reshape(dims).transpose(perm).reshape(-1)
    return [int(i) for i in ids[:size]] if groups * size == ids.size else None
  return None


def predict(hlo_text: str, profile, gpus_per_node: int = 8, top: int = 10) -> StepPrediction:
  """The step of one device of a scheduled GPU program (`compiled.as_text()`)."""
  walk = _Walk(hlo_text, profile, gpus_per_node)
  entry = _entry(hlo_text, walk.comps)
  step, kernels = walk.run(entry, 1)
  ranked = sorted(walk.costs.values(), key=lambda c: -c.total_s)[:top]
  return StepPrediction(step, kernels, walk.communication, max(0.0, step - kernels),
                        [dict(dataclasses.asdict(c), total_s=c.total_s) for c in ranked])


def _entry(hlo_text: str, comps: dict) -> str:
  m = re.search(r"^ENTRY\s+%?([\w.\-]+)", hlo_text, re.M)
  return m.group(1) if m else next(iter(comps))


def format_prediction(summary: dict) -> str:
  """The lines `meshtron compile` prints for a predicted step."""
  lines = [f"predicted step (sharding/xla/step_time.py): {summary['step_s'] * 1e3:.1f} ms,"
           f" {summary['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, MFU {summary['mfu']:.1%};"
           f" kernels {summary['compute_s'] * 1e3:.1f} ms, communication"
           f" {summary['communication_s'] * 1e3:.1f} ms of which exposed"
           f" {summary['exposed_communication_s'] * 1e3:.1f} ms",
           "  costliest ops (per step):"]
  for op in summary["top_ops"]:
    extra = f", {op['flops'] / 1e12:.2f} TFLOP" if op["flops"] else ""
    lines.append(f"    {op['total_s'] * 1e3:8.2f} ms  {op['kind']:<18} {op['name']}"
                 f" x{op['count']}{extra}")
  return "\n".join(lines)
