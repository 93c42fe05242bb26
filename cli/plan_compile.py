"""`meshtron plan --compile_top=K`: the analytic ranking's best K layouts compiled for the cluster
without a GPU, two at a time, then ranked again by the step predicted from each compiled program
(sharding/xla/step_time.py) among those whose compiled peak memory fits a GPU.

The analytic plan ranks every layout in milliseconds with the playbook's formulas; a compile
takes seconds to a minute but is the program meshtron would run: in the dtypes the plan priced
(cli/presets.precision_settings: the playbook's bf16 parameters with float32 master copies),
attention "auto" (a flash kernel).
"""

import concurrent.futures
import dataclasses
import time

from cli.presets import train_config
from sharding.plan import planner
from sharding.xla import compiled
from trainer.aot import compile_for_gpus

WORKERS = 2  # compiles at once: each is one XLA process, about one core busy
TIMEOUT_S = 900  # one layout's compile


@dataclasses.dataclass
class CompiledLayout:
  """One analytically ranked layout, compiled (or why not)."""

  analytic_rank: int
  candidate: planner.Candidate
  report: compiled.CompiledReport | None = None
  error: str = ""
  fits: bool = False

  @property
  def tokens_per_s_per_gpu(self) -> float:
    return self.report.step_time["tokens_per_s_per_gpu"] if self.report else 0.0

  def summary(self) -> dict:
    out = {"analytic_rank": self.analytic_rank, "layout": self.candidate.layout.string(),
           "analytic_tokens_per_s_per_gpu": self.candidate.time.tokens_per_s_per_gpu,
           "compiled": self.report is not None, "error": self.error, "fits": self.fits}
    if self.report:
      st = self.report.step_time
      out.update(tokens_per_s_per_gpu=st["tokens_per_s_per_gpu"], mfu=st["mfu"],
                 step_time_s=st["step_s"],
                 exposed_communication_s=st["exposed_communication_s"],
                 compiled_peak_gib=self.report.memory["peak"] / 2**30,
                 compile_s=self.report.compile_seconds)
    return out


def gpu_target(gpu: str, gpus: int) -> compiled.GpuTarget:
  """The deviceless target of `--gpu` x `gpus`; a one-line error for a GPU with none."""
  if gpu not in compiled.GPU_TARGETS:
    raise ValueError(f"--compile_top compiles for {' or '.join(sorted(compiled.GPU_TARGETS))}"
                     f" targets; --gpu={gpu} has no deviceless target (use --compile_top=0)")
  return compiled.parse_gpu_target(f"{gpu}x{gpus}")


def compile_best(model: str, candidates: list, seq: int, target: compiled.GpuTarget,
                 precision=None, progress=None) -> list[CompiledLayout]:
  """Compiles each candidate's train step for `target` storing what `precision` prices, WORKERS
  at a time; a layout the trainer refuses or XLA fails on keeps its one-line reason."""
  results = [CompiledLayout(i, c) for i, c in enumerate(candidates, 1)]

  def one(result: CompiledLayout) -> CompiledLayout:
    try:
      cfg = train_config(model, result.candidate.layout, seq, precision)
      cfg.layout(target.num_devices)  # the trainer's own checks, before spending a compile
      result.report = compile_for_gpus(cfg, target, timeout=TIMEOUT_S)
      result.fits = compiled.fits(result.report, target.device_memory_bytes)[0]
    except Exception as e:  # noqa: BLE001  (any refusal is this layout's verdict, not the plan's)
      result.error = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return result

  with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
    for done, result in enumerate(pool.map(one, results), 1):
      if progress:
        progress(done, len(results), result)
  return results


def reranked(results: list[CompiledLayout]) -> list[CompiledLayout]:
  """The compiled layouts that fit, fastest predicted step first."""
  return sorted((r for r in results if r.report and r.fits),
                key=lambda r: -r.tokens_per_s_per_gpu)


def format_tables(results: list[CompiledLayout], target: compiled.GpuTarget,
                  seconds: float, precision=None) -> str:
  """The compiled ranking, then the layouts dropped and why."""
  gib = target.device_memory_bytes / 2**30
  ranked = reranked(results)
  stores = precision.name if precision else "the preset's dtypes"
  lines = [f"compiled for {target.name} without a GPU: {len(results)} layouts in {seconds:.0f} s,"
           f" {len(ranked)} fit in {gib:.0f} GiB; ranked by the step predicted from each program",
           f"  (each program stores what the plan priced: {stores})",
           f"{'#':>3} {'was':>4}  {'tok/s/GPU':>10} {'MFU':>6} {'step s':>8} {'exposed':>8}"
           f" {'GiB':>6}  layout"]
  for i, r in enumerate(ranked, 1):
    s = r.summary()
    lines.append(f"{i:>3} {r.analytic_rank:>4}  {s['tokens_per_s_per_gpu']:>10,.0f}"
                 f" {s['mfu']:>6.1%} {s['step_time_s']:>8.3f}"
                 f" {s['exposed_communication_s']:>7.3f}s {s['compiled_peak_gib']:>6.1f}"
                 f"  {s['layout']}")
  dropped = [r for r in results if not (r.report and r.fits)]
  if dropped:
    lines.append("dropped:")
    for r in dropped:
      why = r.error or (f"compiled peak {r.report.memory['peak'] / 2**30:.1f} GiB >"
                        f" {gib:.0f} GiB")
      lines.append(f"  analytic #{r.analytic_rank} {r.candidate.layout.string()}: {why}")
  return "\n".join(lines)


def run(model: str, candidates: list, seq: int, gpu: str, gpus: int, quiet: bool,
        precision=None):
  """(results, printed tables) of compiling the best candidates, storing what `precision`
  prices."""
  target = gpu_target(gpu, gpus)
  start = time.perf_counter()

  def progress(done, total, result):
    if not quiet:
      verdict = "compiled" if result.report else f"failed: {result.error}"
      print(f"  [{done}/{total}] {result.candidate.layout.string()}: {verdict}", flush=True)

  results = compile_best(model, candidates, seq, target, precision, progress)
  return results, format_tables(results, target, time.perf_counter() - start, precision)
