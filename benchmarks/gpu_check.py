"""`make gpu-check`: proves the GPU path on a machine with NVIDIA GPUs and JAX's CUDA plugin
already installed. Writes one JSON line per result to <out_dir>/<phase>.jsonl (default
benchmarks/results/gpu/), each with the GPU, driver, jax/jaxlib versions, the commit
(MESHTRON_COMMIT: a copy on a GPU machine may have no .git) and the date, as it is measured.

Phases, each one command of at most ~8 minutes on one H100 (`all` runs them in order):
  smoke    imports and versions, one flash-attention call, one tiny train step (~2 min): catches
           drift of the machine's jax before anything heavy
  tests    `pytest -m gpu` (tests/test_gpu_*.py): a line per test; fails if any failed or skipped
  kernels  matmul peak and copy bandwidth, attention kernels (pallas_flash, cuDNN, xla; seq 2k-16k),
           the jax-triton RMSNorm against XLA's fusion (benchmarks/gpu_kernels.py)
  train    the train step of Llama-3-8B's dimensions, 8 layers, seq 4096: attention cudnn and
           pallas_flash x remat none/selective/full, one process each (benchmarks/gpu_train.py)
  fp8      the same step (cudnn, remat full) in bf16 and with the tensorwise and delayed fp8
           recipes, each under XLA's autotuned GEMMs and with Triton GEMMs off (cuBLASLt fp8)
  moe      Qwen3-30B-A3B and DeepSeek-V3-like cuts (MOE_CUTS), dropless and dropping dispatch

It first checks that there is a GPU (one line and exit 2 if not), then installs meshtron without
touching the installed jax (`pip install --no-deps -e .`) and the wheels carried in .whl/ (`make
gpu-wheels`): only those whose package is missing there, or all with `--wheels=pinned`.

Usage: make gpu-check [PHASE=smoke] [GPU_OUT=DIR] [GPU_CHECK_ARGS='--attention cudnn'], or
  python -m benchmarks.gpu_check --phase PHASE|all [--out_dir DIR] [--budget_s 400] [--attention
  cudnn,pallas_flash] [--remat none,selective,full] [--wheels missing|pinned|none] [--rehearse]
`--rehearse`: the phases on the CPU at tiny sizes (tests/test_gpu_check.py), never a GPU result.
"""

import argparse
import datetime
import glob
import importlib.metadata
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree

from benchmarks.gpu_install import SITE, install

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("smoke", "tests", "kernels", "train", "fp8", "moe")
# The moe phase's cuts (issue [24]): (model, layers, routed experts), each dropless and dropping;
# the first also dropless with XLA's ragged_dot and with the batched GEMMs over equal slots
# (moe.grouped_matmul=capacity, what the anchors' MoE rows run) in place of the Pallas grouped
# matmul (MOE_RUNS).
MOE_CUTS = (("qwen3_30b_a3b", 4, 0), ("deepseek_v3_like", 4, 32))
MOE_RUNS = (("dropless", "auto"), ("dropless", "ragged_dot"), ("dropless", "capacity"),
            ("dropping", "auto"))
TRITON_OFF = "xla_gpu_enable_triton_gemm=false"
# The fp8 phase's runs: (fp8 recipe, xla_options); a rehearsal runs the first two.
FP8_RUNS = (("tensorwise", TRITON_OFF), ("none", ""), ("tensorwise", ""), ("delayed", ""),
            ("delayed", TRITON_OFF), ("none", TRITON_OFF))
# The train step may use nearly the whole GPU (JAX's default leaves it 75%).
MEMORY_FRACTION = "0.94"
# Micro-batches the train phase tries per remat policy, largest first, the first that fits
# measured (deviceless H100 compiles at seq 4096: 61.5 GiB at batch 2 without remat, 54.7 GiB at
# batch 4 selective, 45.0 GiB at batch 4 full; 0.94 of an 80 GB H100 is about 74.8 GiB).
BATCHES = {"none": "2,1", "selective": "8,4,2,1", "full": "8,4,2,1"}


def fail(message: str) -> None:
  print(f"gpu-check: {message}", file=sys.stderr)
  sys.exit(2)


def gpu_names() -> list[str]:
  """The NVIDIA GPUs nvidia-smi lists ("name, driver, memory" each); [] when there are none."""
  if not shutil.which("nvidia-smi"):
    return []
  proc = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                         "--format=csv,noheader"], capture_output=True, text=True, timeout=60)
  return [line.strip() for line in proc.stdout.splitlines() if line.strip()] \
      if proc.returncode == 0 else []


def jax_platform() -> str:
  """The platform of JAX's first device, asked in a child process: this process must not hold
  GPU memory while the tests and train phases run theirs (JAX preallocates 75% of it)."""
  proc = subprocess.run([sys.executable, "-c", "import jax; print(jax.devices()[0].platform)"],
                        capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false"))
  return proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 and proc.stdout.strip() \
      else f"none ({proc.stderr.strip().splitlines()[-1][:300] if proc.stderr.strip() else '?'})"


def machine_facts(rehearse: bool) -> dict:
  """What every result line carries: the GPU, driver, versions, commit and date (importing jax
  starts no backend)."""
  import jax
  import jaxlib
  gpus = gpu_names()
  name, driver, memory = (gpus[0].split(", ") + ["", "", ""])[:3] if gpus else ("cpu", "", "")
  plugins = {d.metadata["Name"]: d.version for d in importlib.metadata.distributions()
             if d.metadata["Name"] and d.metadata["Name"].startswith("jax-cuda")}
  commit = os.environ.get("MESHTRON_COMMIT", "")
  if not commit and os.path.isdir(os.path.join(REPO, ".git")):
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
  return {"gpu": name, "gpu_count": len(gpus), "gpu_memory": memory, "driver": driver,
          "jax": jax.__version__, "jaxlib": jaxlib.__version__, "cuda_plugin": plugins,
          "python": platform.python_version(), "commit": commit or "unknown",
          "rehearsal": rehearse,
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


class Results:
  """One phase's JSON-lines file, written line by line (and echoed to stdout)."""

  def __init__(self, out_dir: str, phase: str, facts: dict):
    os.makedirs(out_dir, exist_ok=True)
    self.path = os.path.join(out_dir, f"{phase}.jsonl")
    self.phase, self.facts = phase, facts
    self._file = open(self.path, "w", encoding="utf-8")

  def emit(self, **fields) -> None:
    line = json.dumps({"phase": self.phase, **fields, **self.facts})
    self._file.write(line + "\n")
    self._file.flush()
    print(line, flush=True)

  def close(self) -> None:
    self._file.close()


def outcomes_so_far(log_path: str) -> list[dict]:
  """The tests that ended before pytest was cut short, each with its outcome, seconds and
  failure message (tests/conftest.py writes them to MESHTRON_GPU_TEST_LOG as they end)."""
  if not os.path.exists(log_path):
    return []
  rows = [json.loads(line) for line in open(log_path, encoding="utf-8") if line.strip()]
  # A failure outside the test body (setup, teardown) is an error, as in the JUnit report.
  return [dict(r, outcome="error") if r["when"] != "call" and r["outcome"] == "failed" else r
          for r in rows]


def run_as_group(command: list[str], timeout: float, env: dict) -> tuple[str, bool]:
  """(output, cut) of `command` in a process group that a cut kills whole: xdist workers would
  otherwise live on with their GPU memory and fail the next phases (as on 2026-11-26)."""
  proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
  try:
    return proc.communicate(timeout=timeout)[0], False
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    return proc.communicate()[0], True


def run_tests(results: Results, out_dir: str, rehearse: bool, deadline: float,
              select: str = "", workers: int = 1) -> bool:
  """`pytest -m gpu` in a child process (`select`: its -k expression); one line per test from
  its JUnit report, or, when the phase's budget cut pytest short (no report), from the log of
  the tests that ended (outcomes_so_far). `workers` > 1 runs that many pytest-xdist processes
  sharing the GPU: a test spends most of its ~25 s compiling on the CPU."""
  junit, progress = (os.path.join(out_dir, n) for n in ("junit.xml", ".tests-progress.jsonl"))
  if os.path.exists(progress):
    os.remove(progress)
  # Memory on demand: the tests start processes (the CLI) beside this one. xdist workers hand
  # freed memory back (JAX's pool keeps its high-water mark: two tests ran out on 2026-11-26).
  env = dict(os.environ, MESHTRON_GPU_TESTS="rehearse" if rehearse else "gpu",
             XLA_PYTHON_CLIENT_PREALLOCATE="false", MESHTRON_GPU_TEST_LOG=progress,
             **({"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"} if workers > 1 else {}))
  # The gpu tests live in tests/test_gpu_*.py (tests/test_gpu_check.py checks that): collecting
  # only those keeps the CPU suite's imports (notebooks, MaxText peers) off the GPU machine.
  files = sorted(os.path.relpath(p, REPO)
                 for p in glob.glob(os.path.join(REPO, "tests", "test_gpu_*.py")))
  command = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider",
             f"--junitxml={junit}", *(["-k", select] if select else []),
             *(["-n", str(workers)] if workers > 1 else []), *files]
  cut_short = []
  output, timed_out = run_as_group(command, max(60.0, deadline - time.monotonic()), env=env)
  tail = output[-4000:]
  if timed_out:
    tail = f"pytest ran past the phase's time budget\n{output[-3000:]}"
    cut_short = outcomes_so_far(progress)
  print(tail, flush=True)
  counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
  for row in cut_short:
    counts[row["outcome"]] += 1
    results.emit(test=row["test"], outcome=row["outcome"], seconds=row["seconds"],
                 message=row["message"][:500], properties={},
                 note="pytest was cut short by the phase's budget: the tests that ended")
  for case in (ElementTree.parse(junit).getroot().iter("testcase")
               if os.path.exists(junit) else []):
    outcome, message = "passed", ""
    for kind in ("failure", "error", "skipped"):
      node = case.find(kind)
      if node is not None:
        outcome = {"failure": "failed"}.get(kind, kind)
        message = (node.get("message") or node.text or "").strip().splitlines()[:1]
        message = message[0][:500] if message else ""
    counts[outcome] += 1
    properties = {p.get("name"): p.get("value") for p in case.iter("property")}
    results.emit(test=f"{case.get('classname')}::{case.get('name')}", outcome=outcome,
                 seconds=float(case.get("time") or 0), message=message, properties=properties)
  # A rehearsal skips what exists only on a GPU; on a GPU nothing may skip.
  allowed_skips = counts["skipped"] if rehearse else 0
  ok = (counts["passed"] > 0 and counts["failed"] == counts["error"] == 0
        and counts["skipped"] <= allowed_skips and not cut_short)
  if os.path.exists(progress):
    os.remove(progress)
  results.emit(summary="pytest -m gpu", ok=ok, **counts, output_tail=tail[-1500:])
  return ok


def run_train(results: Results, args, deadline: float, runs: list[dict]) -> bool:
  """benchmarks.gpu_train once per run (its attention, remat, fp8 and xla_options), each in
  its own process."""
  peak = 0.0
  # The bf16 peak the kernels phase measured on this GPU: in this run's output, or in the
  # committed results (a phase run by itself on a fresh machine).
  for kernels in (os.path.join(args.out_dir, "kernels.jsonl"),
                  os.path.join(REPO, "benchmarks", "results", "gpu", "kernels.jsonl")):
    rows = [json.loads(line) for line in open(kernels, encoding="utf-8") if line.strip()] \
        if os.path.exists(kernels) else []
    peak = max((r["tflops"] for r in rows if r.get("benchmark") == "matmul_peak"
                and r.get("dtype") == "bfloat16" and r.get("rehearsal") == args.rehearse),
               default=0.0)
    if peak:
      break
  env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=MEMORY_FRACTION)
  ok = True
  for index, run in enumerate(runs):
    fields = dict(benchmark="train_step", **run)
    if time.monotonic() > deadline:
      results.emit(**fields, status="skipped", reason="the phase's time budget is spent")
      continue
    command = [sys.executable, "-m", "benchmarks.gpu_train",
               *(f"--{k}={v}" for k, v in run.items()), f"--peak_tflops={peak}",
               f"--batches={BATCHES.get(run['remat'], '2,1')}"]
    if args.artifacts_dir:  # the compiled program of every run, a trace of the phase's first
      name = artifact_name(run)
      os.makedirs(args.artifacts_dir, exist_ok=True)
      command.append(f"--hlo_out={os.path.join(args.artifacts_dir, name + '.hlo.txt.gz')}")
      if index == 0:
        command.append(f"--trace_dir={os.path.join(args.artifacts_dir, 'trace-' + name)}")
    if args.rehearse:
      command += ["--rehearse", "--seq=64", "--layers=2", "--batches=2", "--steps=2",
                  "--warmup=1"]
    try:
      proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300)
    except subprocess.TimeoutExpired:
      results.emit(**fields, status="timeout")
      ok = False
      continue
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode or not lines:
      results.emit(**fields, status="error", error=proc.stderr[-2000:])
      ok = False
      continue
    row = json.loads(lines[-1])
    results.emit(**row)
    ok = ok and row.get("status") == "ok" and (args.rehearse or row.get("platform") == "gpu")
  return ok


def artifact_name(run: dict) -> str:
  """A run's artifacts (`<name>.hlo.txt.gz`, `trace-<name>`): its settings' values, in order."""
  return "-".join(str(v) for v in run.values() if v)


def train_runs(phase: str, args) -> list[dict]:
  """The gpu_train.py runs of the train phase (attention x remat, bf16), the fp8 phase or the moe
  phase (each cut dropless and dropping, remat selective)."""
  if phase == "train":
    return [dict(attention=a, remat=r) for a in args.attention.split(",")
            for r in args.remat.split(",")]
  if phase == "moe":
    return [dict(attention=args.attention.split(",")[0], remat="selective", model=name,
                 layers=layers, experts=experts, dispatch=dispatch,
                 **({"grouped_matmul": kernel} if kernel != "auto" else {}))
            for name, layers, experts in moe_cuts(args.moe_models)
            for dispatch, kernel in MOE_RUNS if name == MOE_CUTS[0][0] or kernel == "auto"]
  runs = FP8_RUNS[:2] if args.rehearse else FP8_RUNS
  return [dict(attention=args.attention.split(",")[0], remat="full", fp8=fp8, xla_options=x)
          for fp8, x in runs]


def moe_cuts(models: str) -> list[tuple]:
  """MOE_CUTS in the order --moe_models names them (a visit that measured one cut runs the other
  first); all of them, in MOE_CUTS's order, when it names none."""
  cuts = {cut[0]: cut for cut in MOE_CUTS}
  names = [name for name in models.split(",") if name] or list(cuts)
  unknown = [name for name in names if name not in cuts]
  if unknown:
    fail(f"--moe_models names {', '.join(unknown)}; choose among {', '.join(cuts)}")
  return [cuts[name] for name in names]


def run_phase(phase: str, args, facts: dict) -> bool:
  results = Results(args.out_dir, phase, facts)
  deadline = time.monotonic() + args.budget_s
  try:
    if phase == "smoke":
      from benchmarks import gpu_kernels
      return gpu_kernels.smoke(results.emit, args.rehearse)
    if phase == "tests":
      return run_tests(results, args.out_dir, args.rehearse, deadline, args.tests_k,
                       args.tests_workers)
    if phase == "kernels":
      from benchmarks import gpu_kernels
      gpu_kernels.peak(results.emit, args.rehearse)
      gpu_kernels.attention(results.emit, args.rehearse, deadline)
      gpu_kernels.rmsnorm(results.emit, args.rehearse)
      return True
    return run_train(results, args, deadline, train_runs(phase, args))
  finally:
    results.close()


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--phase", default="all", choices=(*PHASES, "all"))
  parser.add_argument("--out_dir", default=os.path.join(REPO, "benchmarks", "results", "gpu"))
  parser.add_argument("--budget_s", type=float, default=400.0,
                      help="per phase: no new measurement starts after this many seconds")
  parser.add_argument("--attention", default="cudnn,pallas_flash")
  parser.add_argument("--remat", default="none,selective,full")
  parser.add_argument("--moe_models", default="",
                      help="moe: the cuts to run, in this order (default: all of MOE_CUTS)")
  parser.add_argument("--wheels", default="missing", choices=("missing", "pinned", "none"))
  parser.add_argument("--tests_k", default="", help="tests: only those pytest -k selects")
  parser.add_argument("--tests_workers", type=int, default=1,
                      help="tests: pytest-xdist processes sharing the GPU (the machine has it)")
  parser.add_argument("--artifacts_dir", default="",
                      help="train/fp8: keep each run's compiled program and a trace of the first")
  parser.add_argument("--rehearse", action="store_true")
  args = parser.parse_args(argv)
  if args.rehearse:
    os.environ["JAX_PLATFORMS"] = "cpu"
    # cuDNN runs only on GPUs: rehearse the same jax.nn call with its XLA implementation.
    args.attention = args.attention.replace("cudnn", "dot_product")
  else:
    if not gpu_names():
      fail("no NVIDIA GPU on this machine (nvidia-smi finds none); run it on a GPU machine, see"
           " docs/gpu-check.md 'GPU results'")
    installed = install(args.wheels)
    if installed:
      print(f"gpu-check: installed {', '.join(installed)}", flush=True)
    if os.path.isdir(SITE) and SITE not in sys.path:
      # This process started before the carried wheels' directory was on PYTHONPATH (install);
      # the phases import them here (flax & co. in smoke and kernels): the same command runs
      # again as a process that starts with it. Our own modules come from the repo root.
      return subprocess.run([sys.executable, "-m", "benchmarks.gpu_check",
                             *(sys.argv[1:] if argv is None else argv), "--wheels=none"],
                            cwd=REPO).returncode
  if not args.rehearse and (platform_name := jax_platform()) != "gpu":
    fail(f"nvidia-smi sees {gpu_names()[0]} but JAX's first device is {platform_name}: JAX's"
         " CUDA plugin is missing or cannot load; install jax[cuda] there")
  if args.phase == "all":  # each phase in a fresh process: its own GPU memory, nothing held over
    common = [f"--out_dir={args.out_dir}", f"--budget_s={args.budget_s}",
              f"--attention={args.attention}", f"--remat={args.remat}", "--wheels=none",
              *(["--rehearse"] if args.rehearse else []),
              *([f"--artifacts_dir={args.artifacts_dir}"] if args.artifacts_dir else [])]
    failed = [phase for phase in PHASES if subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", f"--phase={phase}", *common],
        cwd=REPO).returncode]
  else:
    facts = machine_facts(args.rehearse)
    failed = [] if run_phase(args.phase, args, facts) else [args.phase]
  if failed:
    print(f"gpu-check: {', '.join(failed)} failed; see {args.out_dir}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
