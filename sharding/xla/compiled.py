"""What a compiled program really costs per device: memory, FLOPs, collectives; GPU targets."""

import dataclasses
import os
import re

from sharding.xla import branches, hlo, overlap, soundness, step_time

GIB = 1024 ** 3
_TARGETS_DIR = os.path.join(os.path.dirname(__file__), "targets")
# name -> (target-config file, GPUs per host). Aliases share a file.
GPU_TARGETS = {"h100": ("h100_sxm.txtpb", 8), "h100-sxm": ("h100_sxm.txtpb", 8),
               "h200": ("h200.txtpb", 8)}


@dataclasses.dataclass(frozen=True)
class GpuTarget:
  """A GPU cluster to compile for without a GPU: `h100x64` is 64 H100s, 8 per host."""

  name: str
  gpu: str
  num_devices: int
  devices_per_host: int
  config_path: str

  @property
  def num_hosts(self) -> int:
    return max(1, self.num_devices // self.devices_per_host)

  @property
  def topology(self) -> str:
    """<slices>x<hosts per slice>x<devices per host>, as jax.experimental.topologies wants."""
    return f"1x{self.num_hosts}x{min(self.num_devices, self.devices_per_host)}"

  @property
  def device_memory_bytes(self) -> int:
    """One device's memory, from the target config (0 where it gives none)."""
    found = re.search(r"device_memory_size:\s*(\d+)", open(self.config_path).read())
    return int(found.group(1)) if found else 0


def parse_gpu_target(name: str) -> GpuTarget:
  """Parses "<gpu>x<count>" (e.g. h100x8, h100-sxm x64, h200x16); one-line ValueError if bad."""
  match = re.fullmatch(r"([a-z0-9-]+?)x(\d+)", name.strip().lower())
  if not match or match.group(1) not in GPU_TARGETS:
    raise ValueError(f"unknown target {name!r}; use local or <gpu>x<count> with gpu one of"
                     f" {', '.join(sorted(GPU_TARGETS))} (e.g. h100x64)")
  gpu, count = match.group(1), int(match.group(2))
  filename, per_host = GPU_TARGETS[gpu]
  if count < 1 or (count > per_host and count % per_host):
    raise ValueError(f"target {name!r}: {count} GPUs must be at most {per_host} or a multiple of"
                     f" {per_host} ({per_host} per host)")
  return GpuTarget(name, gpu, count, per_host, os.path.join(_TARGETS_DIR, filename))


def gpu_devices(target: GpuTarget) -> list:
  """Abstract devices of the target cluster. Needs the gpu-aot extra and JAX_PLATFORMS=cpu set
  before JAX starts; call it in a subprocess (a bad target config can crash XLA)."""
  from jax.experimental import topologies  # imported here: only deviceless GPU compiles need it
  with open(target.config_path) as f:
    config = f.read()
  topology = topologies.get_topology_desc(platform="cuda", topology_name="",
                                          target_config=config, topology=target.topology)
  return list(topology.devices)


@dataclasses.dataclass
class CompiledReport:
  """Per-device facts of one compiled program (all bytes per device, per execution)."""

  target: str
  num_devices: int
  platform: str
  memory: dict  # argument/output/temp/alias/generated_code/peak bytes
  flops: float | None  # XLA's cost analysis (None where the backend gives none, e.g. GPU)
  collectives: list  # list of dicts (hlo.Collective fields + wire bytes)
  summary: dict  # per collective kind: ops, executions, payload_bytes, wire_bytes
  is_scheduled: bool  # the HLO went through XLA's scheduler (GPU latency-hiding scheduler)
  compile_seconds: float = 0.0
  extra: dict = dataclasses.field(default_factory=dict)  # model/analytic facts from the caller
  # overlap.summarize of the collectives: wire bytes with compute scheduled between start and
  # done ("hidden") and without ("exposed"); {} in reports made before it existed.
  overlap: dict = dataclasses.field(default_factory=dict)
  # step_time.StepPrediction.summary of a GPU program: the predicted step, tokens/s/GPU, MFU and
  # the costliest ops; {} for CPU programs and reports made before it existed.
  step_time: dict = dataclasses.field(default_factory=dict)
  # branches.costliest_branch_wire_bytes: per kind, each conditional counted by its costliest
  # branch (`summary` counts every branch as taken); {} in reports made before it existed.
  costliest_branch: dict = dataclasses.field(default_factory=dict)
  # What one device may use, for programs compiled for this machine's own devices (the GPU's
  # limit, or the host's available memory shared by CPU devices); 0: unknown or a GPU target.
  memory_limit_bytes: int = 0

  @property
  def wire_bytes(self) -> float:
    return sum(v["wire_bytes"] for v in self.summary.values())

  @property
  def async_fraction(self) -> float:
    """Fraction of collective wire bytes issued as async start/done pairs."""
    total = self.wire_bytes
    async_bytes = sum(c["total_wire_bytes"] for c in self.collectives if c["is_async"])
    return async_bytes / total if total else 1.0


def memory_of(compiled) -> dict:
  """Bytes per device of a `jax.stages.Compiled`: arguments, outputs, temporaries, aliased,
  generated code, and the peak."""
  stats = compiled.memory_analysis()
  memory = {key: int(getattr(stats, f"{key}_size_in_bytes", 0) or 0)
            for key in ("argument", "output", "temp", "alias", "generated_code")}
  # Arguments, outputs and temporaries can be live at once; donated (aliased) buffers count once.
  # Some backends report a peak of their own (XLA:CPU's omits temporaries): take the larger.
  memory["peak"] = max(int(getattr(stats, "peak_memory_in_bytes", 0) or 0),
                       memory["argument"] + memory["output"] + memory["temp"] - memory["alias"])
  return memory


# XLA's rematerialization pass names each instruction it recomputes after the original, with
# ".remat" (".remat2" for a second copy; XLA may uniquify either: "bitcast.remat.3").
_REMATERIALIZED = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]*\.remat\d*(?:\.\d+)*\s*=", re.M)


def rematerialized(text: str) -> int:
  """How many instructions of a compiled program (its HLO text) XLA recomputes to meet its
  memory limit."""
  return len(_REMATERIALIZED.findall(text))


def report(compiled, target: str, devices: list, compile_seconds: float = 0.0) -> CompiledReport:
  """Builds the report of a `jax.stages.Compiled` (from `jit(f).lower(...).compile()`) for the
  `devices` it was compiled for."""
  memory = memory_of(compiled)
  costs = compiled.cost_analysis()
  costs = costs[0] if isinstance(costs, list) else costs
  flops = float(costs["flops"]) if costs and "flops" in costs else None
  text = compiled.as_text()
  soundness.check(text)  # before anything is reported of a program XLA got wrong
  cols = hlo.collectives(text, len(devices))
  rows = [dict(dataclasses.asdict(c), wire_bytes=c.wire_bytes, total_wire_bytes=c.total_wire_bytes)
          for c in cols]
  scheduled = "is_scheduled=true" in text
  if scheduled:  # without a schedule, text order says nothing about what overlaps
    overlap.annotate(rows, text)
  return CompiledReport(target, len(devices), devices[0].platform, memory, flops, rows,
                        hlo.summarize(cols), scheduled, compile_seconds,
                        overlap=overlap.summarize(rows) if scheduled else {},
                        costliest_branch=branches.costliest_branch_wire_bytes(text, len(devices)))


def from_json(data: dict) -> CompiledReport:
  known = {f.name for f in dataclasses.fields(CompiledReport)}
  return CompiledReport(**{k: v for k, v in data.items() if k in known})


def fits(rep: CompiledReport, device_memory_bytes: int) -> tuple[bool, float]:
  """(peak <= device memory, headroom in bytes)."""
  headroom = device_memory_bytes - rep.memory["peak"]
  return headroom >= 0, headroom


def format_report(rep: CompiledReport, device_memory_bytes: int | None = None) -> str:
  """A readable report: memory table, grouped collectives, totals and the fit verdict."""
  lines = [f"target {rep.target}: {rep.num_devices} devices ({rep.platform}), compiled in"
           f" {rep.compile_seconds:.1f} s, scheduled HLO: {'yes' if rep.is_scheduled else 'no'}"]
  lines += [f"  {k}: {v}" for k, v in rep.extra.items()]
  lines.append("memory per device:")
  labels = {"argument": "arguments (state + batch)", "output": "outputs",
            "temp": "temporaries (activations, gradients, workspace)",
            "alias": "aliased (donated state reused)", "generated_code": "generated code",
            "peak": "peak"}
  for key, label in labels.items():
    lines.append(f"  {label:<50} {rep.memory[key] / GIB:10.3f} GiB")
  if device_memory_bytes:
    ok, headroom = fits(rep, device_memory_bytes)
    lines.append(f"  fits in {device_memory_bytes / GIB:.1f} GiB: {'yes' if ok else 'NO'}"
                 f" ({'headroom' if ok else 'short by'} {abs(headroom) / GIB:.2f} GiB)")
  if rep.flops is not None:
    lines.append(f"FLOPs per device per step (XLA cost analysis): {rep.flops:.4g}")
  lines.append("collectives per device per step (grouped; wire bytes by ring formulas):")
  groups: dict = {}
  for c in rep.collectives:
    shape = (f"{c['arrays']} arrays" if c["arrays"] > 1
             else "x".join(map(str, c["shape"])) or "scalar")
    key = (c["kind"], c["dtype"], shape, c["group_size"], c["is_async"], c["count"])
    groups.setdefault(key, [0, 0.0, 0.0])
    groups[key][0] += 1
    groups[key][1] += c["total_wire_bytes"]
    groups[key][2] += c["total_wire_bytes"] if c.get("compute_between", 0) > 0 else 0.0
  hide = rep.overlap != {}
  lines.append(f"  {'kind':<19}{'dtype':<6}{'shape':<22}{'group':>6}{'async':>6}{'runs':>6}"
               f"{'ops':>5}{'wire MiB':>12}" + (f"{'hidden':>8}" if hide else ""))
  for (kind, dtype, shape, group, is_async, count), (ops, wire, hidden) in sorted(
      groups.items(), key=lambda kv: -kv[1][1]):
    lines.append(f"  {kind:<19}{dtype:<6}{shape:<22}{group:>6}{'yes' if is_async else 'no':>6}"
                 f"{count:>6}{ops:>5}{wire / 2**20:12.3f}"
                 + (f"{hidden / wire if wire else 1.0:>8.0%}" if hide else ""))
  lines.append("totals by kind:")
  for kind, v in rep.summary.items():
    lines.append(f"  {kind:<19} {v['executions']:>5} executions {v['wire_bytes'] / 2**20:12.3f}"
                 " MiB on the wire")
  lines.append(f"  all                 {rep.wire_bytes / 2**20:.3f} MiB per device per step,"
               f" {rep.async_fraction:.0%} of it async")
  if hide:
    o = rep.overlap
    lines.append(f"overlap: {o['hidden_bytes'] / 2**20:.3f} MiB ({o['hidden_fraction']:.0%}) have"
                 f" kernels scheduled between start and done ({o['matmul_hidden_fraction']:.0%}"
                 f" a matmul); {o['exposed_bytes'] / 2**20:.3f} MiB exposed")
  if rep.step_time:
    lines.append(step_time.format_prediction(rep.step_time))
  return "\n".join(lines)
