"""meshtron vs MaxText on this machine: the same model, layout, batch, sequence, remat, dtype,
AdamW and synthetic data, run alternately (meshtron, MaxText, meshtron, MaxText, ...) so that both
see the same background load. Prints (and appends to --out) one JSON line per run and one summary
line per configuration with the ratio of the medians of meshtron and MaxText tokens/s.

The machine may be shared: each run records the CPU other processes used, and the summary also
compares tokens per CPU-second of each trainer (ratio_per_cpu_second), which contention moves
less. Both sides' tokens/s are from the *mean* step time of their timed steps (MaxText's runner reports
the mean: its host-side step times jitter under asynchronous dispatch; the mean is total time over
steps). MFU of both uses meshtron's model FLOPs per token and the measured matmul peak.

"Each at its best" (--meshtron_remat none --remat selective): meshtron without recomputation
against MaxText's least recomputing policy (MaxText checkpoints every layer whatever its policy);
the summary's "remat" then names both ("none/selective").

Usage (or --summarize FILE to recompute the summaries of every run in FILE):
  python -m benchmarks.compare [--config tiny:single --config "100m:fsdp=4,tensor=2" ...]
      [--rounds 3] [--remat full] [--meshtron_remat none] [--dtype bfloat16,float32]
      [--steps 15 --warmup 5]
      [--peak_file benchmarks/results/peak.jsonl] [--out benchmarks/results/compare.jsonl]
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

from trainer.process import host_memory

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

DEFAULT_CONFIGS = ["tiny:single", "tiny:fsdp=8", "tiny:fsdp=4,tensor=2",
                   "100m:single", "100m:fsdp=8", "100m:fsdp=4,tensor=2"]
# Timed steps per model; both trainers exclude their first `warmup` steps (meshtron's heap grows
# to its steady size in its first steps; trainer/process/host_memory.py).
STEPS = {"tiny": (15, 5), "100m": (6, 3)}


def last_json(text: str) -> dict | None:
  for line in reversed(text.strip().splitlines()):
    if line.startswith("{"):
      return json.loads(line)
  return None


def run_meshtron(model: str, layout: str, args, steps: int, warmup: int) -> dict:
  cmd = [sys.executable, "-m", "benchmarks.train_step", f"--model={model}",
         f"--layout={'' if layout == 'single' else layout}", f"--batch={args.batch}",
         f"--seq={args.seq}", f"--remat={args.meshtron_remat or args.remat}",
         f"--dtype={args.dtype}",
         f"--steps={steps}", f"--warmup={warmup}", f"--peak_file={args.peak_file}",
         "--label=compare"]
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=REPO)
  row = last_json(proc.stdout)
  if proc.returncode or row is None:
    return {"trainer": "meshtron", "error": proc.stderr.strip().splitlines()[-3:]}
  return row


def run_maxtext(model: str, layout: str, args, steps: int, warmup: int) -> dict:
  # The same host allocator settings as meshtron's runs (trainer/process/host_memory.py), so the ratio
  # compares the two trainers' programs, not glibc's defaults against tuned ones.
  env = dict(host_memory.tunables_env(), BATCH=str(args.batch), SEQ=str(args.seq), REMAT=args.remat,
             DTYPE=args.dtype, STEPS=str(steps + warmup), WARMUP=str(warmup))
  proc = subprocess.run(["bash", os.path.join(HERE, "peers", "maxtext.sh"), model, layout],
                        capture_output=True, text=True, env=env, check=False)
  row = last_json(proc.stdout) or {"trainer": "maxtext"}
  contention = [l for l in proc.stderr.splitlines() if "window steps" in l]
  if contention:
    row["runner_summary"] = contention[-1].split("] ", 1)[-1]
  if proc.returncode or row.get("tokens_per_s") is None:
    row["error"] = proc.stderr.strip().splitlines()[-5:]
  return row


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", action="append", help="model:layout (repeatable)")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=256)
  parser.add_argument("--remat", default="full", help="full | selective (MaxText cannot turn"
                      " remat off)")
  parser.add_argument("--meshtron_remat", default="",
                      help="meshtron's remat when it differs from MaxText's (--remat)")
  parser.add_argument("--dtype", default="bfloat16,float32",
                      help="compute dtypes, comma-separated (bf16 is what GPUs train in)")
  parser.add_argument("--steps", type=int, default=0, help="timed steps (default per model)")
  parser.add_argument("--warmup", type=int, default=0)
  parser.add_argument("--peak_file", default=os.path.join(HERE, "results", "peak.jsonl"))
  parser.add_argument("--out", default="")
  parser.add_argument("--summarize", default="", help="only print the summaries of a"
                      " compare.jsonl (all its runs, grouped by configuration)")
  args = parser.parse_args()
  if args.summarize:
    for summary in summarize_file(args.summarize, args.peak_file):
      print(json.dumps(summary))
    return
  out = open(args.out, "a", encoding="utf-8") if args.out else None

  def emit(row: dict) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    if out:
      out.write(line + "\n")
      out.flush()

  dtypes = args.dtype.split(",")
  for spec, dtype in [(s, d) for d in dtypes for s in args.config or DEFAULT_CONFIGS]:
    args.dtype = dtype
    model, _, layout = spec.partition(":")
    steps, warmup = args.steps or STEPS[model][0], args.warmup or STEPS[model][1]
    runs = {"meshtron": [], "maxtext": []}
    flops_per_token = peak = None
    for round_ in range(args.rounds):
      for name, fn in (("meshtron", run_meshtron), ("maxtext", run_maxtext)):
        row = fn(model, layout or "single", args, steps, warmup)
        row["round"] = round_
        if args.meshtron_remat and args.meshtron_remat != args.remat:
          row["pairing"] = pairing(args.meshtron_remat, args.remat)
        if name == "meshtron" and "tokens_per_s" in row:
          flops_per_token = row["model_gflops_per_s"] * 1e9 / row["tokens_per_s"]
          peak = row["peak_gflops"] * 1e9
        emit(row)
        key = "tokens_per_s_mean" if name == "meshtron" else "tokens_per_s"
        if row.get(key):
          runs[name].append(row[key])
    emit(summarize(model, layout or "single", pairing(args.meshtron_remat or args.remat,
                                                      args.remat), args.dtype, runs,
                   flops_per_token, peak))


def pairing(meshtron_remat: str, maxtext_remat: str) -> str:
  """The summary's "remat": one name at equal settings, else "meshtron's/MaxText's"."""
  return meshtron_remat if meshtron_remat == maxtext_remat else f"{meshtron_remat}/{maxtext_remat}"


def tokens_per_cpu_s(row: dict) -> float | None:
  """Tokens per CPU-second of the trainer process over the timed steps: less sensitive than
  tokens/s to other processes sharing the cores (both trainers' threads count)."""
  if row["trainer"] == "meshtron":
    return round(row["tokens_per_s_mean"] / row["own_cores"], 1) if row.get("own_cores") else None
  match = re.search(r"trainer cpu/step=([0-9.]+)s", row.get("runner_summary", ""))
  return round(row["batch"] * row["seq"] / float(match.group(1)), 1) if match else None


def summarize(model, layout, remat, dtype, runs, flops_per_token, peak) -> dict:
  """The ratio of the medians of meshtron's and MaxText's tokens/s over the alternating runs."""
  summary = {"benchmark": "compare", "model": model, "layout": layout, "remat": remat,
             "dtype": dtype, "meshtron_tokens_per_s": runs["meshtron"],
             "maxtext_tokens_per_s": runs["maxtext"], "load_average_1m": os.getloadavg()[0]}
  if runs["meshtron"] and runs["maxtext"]:
    mesh_med, max_med = statistics.median(runs["meshtron"]), statistics.median(runs["maxtext"])
    summary.update(meshtron_median=mesh_med, maxtext_median=max_med,
                   ratio_meshtron_over_maxtext=round(mesh_med / max_med, 3))
    if runs.get("meshtron_per_cpu") and runs.get("maxtext_per_cpu"):
      a, b = (statistics.median(runs[k]) for k in ("meshtron_per_cpu", "maxtext_per_cpu"))
      summary.update(meshtron_tokens_per_cpu_s=runs["meshtron_per_cpu"],
                     maxtext_tokens_per_cpu_s=runs["maxtext_per_cpu"],
                     ratio_per_cpu_second=round(a / b, 3))
    if flops_per_token and peak:
      summary.update(meshtron_mfu=round(mesh_med * flops_per_token / peak, 4),
                     maxtext_mfu=round(max_med * flops_per_token / peak, 4))
  return summary


def summarize_file(path: str, peak_file: str = "") -> list[dict]:
  """Summaries recomputed from every run row of a compare.jsonl (runs of several invocations of
  this script add up), one per (model, layout, remat, dtype). MFU uses the best peak of
  `peak_file` when given (else the peak each meshtron run read)."""
  groups = {}
  for line in open(path, encoding="utf-8"):
    row = json.loads(line)
    if row.get("benchmark") != "train_step" or row.get("error"):
      continue
    key = (row["model"], row["layout"], row.get("pairing", row["remat"]), row["dtype"])
    runs, info = groups.setdefault(key, ({"meshtron": [], "maxtext": []}, {}))
    value = row.get("tokens_per_s_mean" if row["trainer"] == "meshtron" else "tokens_per_s")
    if value:
      runs[row["trainer"]].append(value)
      per_cpu = tokens_per_cpu_s(row)
      if per_cpu:
        runs.setdefault(row["trainer"] + "_per_cpu", []).append(per_cpu)
    if row["trainer"] == "meshtron":
      info.update(flops=row["model_gflops_per_s"] * 1e9 / row["tokens_per_s"],
                  peak=row["peak_gflops"] * 1e9)
  best = {}  # dtype -> best measured matmul FLOP/s
  if peak_file and os.path.exists(peak_file):
    for row in map(json.loads, filter(str.strip, open(peak_file, encoding="utf-8"))):
      if row.get("benchmark") == "matmul_peak":
        best[row["dtype"]] = max(best.get(row["dtype"], 0.0), row["gflops"] * 1e9)
  return [summarize(*key, runs, info.get("flops"), best.get(key[3]) or info.get("peak"))
          for key, (runs, info) in groups.items()]


if __name__ == "__main__":
  main()
