"""How long the planner takes, as JSON lines: issue [18]'s two bounds, measured here rather than
asserted in a timed test.

- `analytic`: `planner.plan` for Llama-3 70B on 512 H100s (64 nodes), seq 4096, 1M-token batch,
  in-process; best and first of `--repeats` (the bound: under 5 s).
- `compile_top`: the CLI `meshtron plan --model=llama3_70b --gpu=h100 --nodes=8 --compile_top=16`
  in a fresh process, wall clock from start to exit, interpreter start and 16 deviceless
  compiles included (the bound: under 5 minutes on 2 cores), and what the compiles decided:
  layouts refused before compiling, compiled past the GPU's memory, fitting, and the best.

Usage: python -m benchmarks.planner_speed [--repeats 3] [--skip_compile_top]
         >> benchmarks/results/planner_speed.jsonl
"""

import argparse
import json
import os
import subprocess
import sys
import time

from configs.llama import MODELS
from sharding.plan import hardware, planner
from sharding.plan.estimate import PLAYBOOK_MIXED

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

COMPILE_TOP_ARGS = ("plan", "--model=llama3_70b", "--gpu=h100", "--nodes=8", "--compile_top=16")


def emit(**fields) -> None:
  commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
  print(json.dumps({**fields, "commit": commit, "cpus": os.cpu_count(),
                    "load_average_1m": round(os.getloadavg()[0], 2)}), flush=True)


def analytic(repeats: int) -> None:
  seconds = []
  for _ in range(repeats):
    start = time.perf_counter()
    result = planner.plan(MODELS["llama3_70b"], 512, 4096, 2**20, PLAYBOOK_MIXED,
                          hardware.PROFILES["h100"])
    seconds.append(time.perf_counter() - start)
  emit(benchmark="analytic", model="llama3_70b", gpus=512, considered=result.considered,
       ranked=len(result.ranked), first_s=round(seconds[0], 2), best_s=round(min(seconds), 2),
       bound_s=5.0)


def compile_top() -> None:
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop("XLA_FLAGS", None)  # the CLI's own fake-device setting, as a user runs it
  start = time.perf_counter()
  proc = subprocess.run([sys.executable, "-m", "cli.main", *COMPILE_TOP_ARGS, "--json"],
                        cwd=REPO, env=env, capture_output=True, text=True)
  seconds = time.perf_counter() - start
  if proc.returncode != 0:
    sys.exit(f"meshtron {' '.join(COMPILE_TOP_ARGS)} failed: {proc.stderr.strip()[-500:]}")
  layouts = json.loads(proc.stdout)["compiled"]
  built = [c for c in layouts if c["compiled"]]
  fitting = [c for c in built if c["fits"]]
  best = max(fitting, key=lambda c: c["tokens_per_s_per_gpu"], default=None)
  emit(benchmark="compile_top", command="meshtron " + " ".join(COMPILE_TOP_ARGS),
       wall_s=round(seconds, 1), bound_s=300.0, layouts=len(layouts),
       refused=len(layouts) - len(built), too_big=len(built) - len(fitting), fit=len(fitting),
       best_layout=best and best["layout"],
       best_tokens_per_s_per_gpu=best and round(best["tokens_per_s_per_gpu"]),
       best_mfu=best and round(best["mfu"], 3),
       best_analytic_tokens_per_s_per_gpu=best and round(best["analytic_tokens_per_s_per_gpu"]))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--skip_compile_top", action="store_true",
                      help="only the analytic search (about a second)")
  args = parser.parse_args()
  analytic(args.repeats)
  if not args.skip_compile_top:
    compile_top()


if __name__ == "__main__":
  main()
