"""The analytic planner against the Ultra-Scale Playbook's whole H100 sweep: fit on at most 10%
of the runs, score on the rest.

The data (benchmarks/data/playbook_sweep_h100.csv) is derived from nanotron's `bench_final2`
results (the sweep behind the playbook: 1 to 64 nodes of 8 H100s, seq 4096, bf16 with fp32
gradient accumulation, flash attention, no recomputation), read from the copy at
github.com/eyao600/Rapid-LLM, validation_scripts/huggingface_data/bench_final2_mod_add.csv (commit
24ef24c6, 2025-12-25). `--derive RAW.csv` rewrites it: the runs with status Success and the
sweep's global batch (256 x 4096 = 1M tokens), of the four playbook models (the seven 469G runs,
one node count, are left out). Every run is kept.

Scored per (model, nodes) cell, on the runs not used to fit:
- the rank correlation (Spearman) of predicted and measured tokens/s/GPU;
- the measured speed of the layout the model ranks first, over the cell's measured best;
- the median error of the predicted peak memory against the measured reserved memory.

The fit: the profile's efficiency factors (matmul efficiency, collective efficiency, latencies,
per-layer overhead, cross-node pipeline hop, overlap fractions) by least squares of log
throughput on a sample of 10% of the runs drawn per cell with a fixed seed; the model's form is
unchanged (no per-layout terms).

  .venv/bin/python -m benchmarks.playbook_sweep [--fit] [--out FILE] [--doc docs/planning.md]
"""

import argparse
import collections
import csv
import dataclasses
import json
import math
import os
import random

from configs import llama
from sharding.layout import Layout
from sharding.plan import estimate, hardware

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data", "playbook_sweep_h100.csv")
RESULTS = os.path.join(HERE, "results", "playbook_sweep.jsonl")
BEGIN, END = "<!-- playbook-sweep:begin -->", "<!-- playbook-sweep:end -->"
MODELS = {"1.34G": "playbook_1b", "3.57G": "playbook_3b", "8.86G": "playbook_8b",
          "80G": "playbook_80b"}
COLUMNS = ("job_id", "model", "nodes", "dp", "tp", "pp", "mbs", "ga", "zero", "tokens_per_s_gpu",
           "mem_reserved_gb", "after_pp_fix")
SEQ, FIT_FRACTION, SEED = 4096, 0.10, 0
PRECISION = estimate.PLAYBOOK_MIXED_FP32_ACCUM


def derive(raw_path: str, out_path: str = DATA) -> int:
  """Writes the derived CSV from the raw sweep file; returns the number of runs kept."""
  kept = []
  with open(raw_path, newline="") as f:
    for r in csv.DictReader(f):
      size = r["name"].split("_")[0]
      if r["status"] != "Success" or size not in MODELS:
        continue
      if float(r["gbs"]) * int(r["seq_len"]) != 2 ** 20 or int(r["seq_len"]) != SEQ:
        continue
      kept.append([r["job_id"], MODELS[size], int(float(r["nodes"])), r["dp"], r["tp"], r["pp"],
                   r["mbs"], int(float(r["batch_accum"])), r["zero_stage"], r["tok/s/gpu"],
                   r["Mem Res (GB)"], r["after_pp_fix"]])
  os.makedirs(os.path.dirname(out_path), exist_ok=True)
  with open(out_path, "w", newline="") as f:
    f.write("# Derived by benchmarks/playbook_sweep.py --derive from nanotron's bench_final2"
            " (copy: github.com/eyao600/Rapid-LLM@24ef24c6,\n# validation_scripts/huggingface_data/"
            "bench_final2_mod_add.csv): status Success, 256 x 4096 tokens per step, models"
            " 1.34G/3.57G/8.86G/80G.\n")
    writer = csv.writer(f)
    writer.writerow(COLUMNS)
    writer.writerows(kept)
  return len(kept)


def runs(path: str = DATA) -> list[dict]:
  with open(path, newline="") as f:
    return list(csv.DictReader(line for line in f if not line.startswith("#")))


def layout_of(run: dict) -> Layout:
  tp = int(run["tp"])
  return Layout(data=int(run["dp"]), tensor=tp, pipeline=int(run["pp"]),
                micro_batch=int(run["mbs"]), microbatches=int(run["ga"]),
                zero_stage=int(run["zero"]), sequence_parallel=tp > 1)  # nanotron REDUCE_SCATTER


_SPECS = {name: dataclasses.replace(estimate.model_spec(llama.MODELS[name]), flash_attention=True)
          for name in MODELS.values()}


def refusal(run: dict) -> str:
  """Why meshtron cannot run a sweep layout, '' when it can: nanotron ran the 3B's 28 layers
  on 32 stages (empty stages); meshtron gives every stage a layer (uneven stages otherwise,
  sharding/pipeline/stage_split.py)."""
  layers = _SPECS[run["model"]].num_layers
  if int(run["pp"]) > layers:
    return f"{run['pp']} pipeline stages for {layers} layers: every stage needs a layer"
  return ""


def predict(run: dict, hw: hardware.HardwareProfile) -> float:
  return hardware.step_time(_SPECS[run["model"]], layout_of(run), SEQ, PRECISION, hw,
                            hardware.NANOTRON_ORDER, stages_recompute=False,
                            lockstep=False, blocking_sends=True,
                            uniform_matmuls=True).tokens_per_s_per_gpu


def spearman(a: list, b: list) -> float:
  def ranks(x):
    order = sorted(range(len(x)), key=lambda i: x[i])
    out = [0.0] * len(x)
    for rank, i in enumerate(order):
      out[i] = rank
    return out
  ra, rb, n = ranks(a), ranks(b), len(a)
  return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def fit_sample(all_runs: list[dict]) -> set:
  """Indices of 10% of the runs (rounded down), drawn with a fixed seed from each (model, nodes)
  cell in proportion to its size (largest remainders first)."""
  cells = collections.defaultdict(list)
  for i, r in enumerate(all_runs):
    cells[(r["model"], r["nodes"])].append(i)
  budget = int(FIT_FRACTION * len(all_runs))
  share = {key: FIT_FRACTION * len(ids) for key, ids in cells.items()}
  quota = {key: int(s) for key, s in share.items()}
  for key in sorted(cells, key=lambda k: quota[k] - share[k])[:budget - sum(quota.values())]:
    quota[key] += 1
  rng, chosen = random.Random(SEED), set()
  for key in sorted(cells):
    chosen.update(rng.sample(sorted(cells[key]), quota[key]))
  return chosen


def score(scored: list[dict], hw: hardware.HardwareProfile) -> dict:
  """Per-cell rank correlation, first-ranked regret and the memory error on `scored` (less the
  layouts meshtron refuses, counted)."""
  refused = [r for r in scored if refusal(r)]
  scored = [r for r in scored if not refusal(r)]
  cells = collections.defaultdict(list)
  memory_errors = []
  for r in scored:
    p = predict(r, hw)
    cells[(r["model"], int(r["nodes"]))].append((p, float(r["tokens_per_s_gpu"])))
    mem = estimate.memory(_SPECS[r["model"]], layout_of(r), SEQ, PRECISION,
                          stages_recompute=False).total / 1e9  # nanotron stores activations
    memory_errors.append(abs(mem / float(r["mem_reserved_gb"]) - 1))
  rows = []
  for (model, nodes), pairs in sorted(cells.items()):
    if len(pairs) < 3:
      continue
    rho = spearman([p for p, _ in pairs], [t for _, t in pairs])
    first = max(pairs)[1] / max(t for _, t in pairs)
    rows.append({"model": model, "nodes": nodes, "runs": len(pairs), "spearman": rho,
                 "first_ranked_over_best": first})
  rhos = sorted(r["spearman"] for r in rows)
  memory_errors.sort()
  return {"cells": rows, "median_spearman": rhos[len(rhos) // 2] if len(rhos) % 2 else
          (rhos[len(rhos) // 2 - 1] + rhos[len(rhos) // 2]) / 2,
          "min_spearman": rhos[0],
          "cells_first_ranked_at_least_0.9": sum(r["first_ranked_over_best"] >= 0.9 for r in rows),
          "cells_first_ranked_below_half": sum(r["first_ranked_over_best"] < 0.5 for r in rows),
          "n_cells": len(rows), "runs_scored": len(scored), "refused": len(refused),
          "median_memory_error": memory_errors[len(memory_errors) // 2]}


# The fitted factors and the physical range each must stay in.
FITTED = {"matmul_efficiency": (0.2, 0.85), "collective_efficiency": (0.3, 1.0),
          "intra_latency_s": (1e-6, 1e-4), "inter_latency_s": (1e-6, 1e-4),
          "layer_overhead_s": (1e-6, 1e-3), "pipeline_hop_s": (1e-5, 1e-2),
          "overlap_grad_sync": (0.0, 1.0), "overlap_tensor": (0.0, 1.0),
          "overlap_pipeline": (0.0, 1.0), "overlap_zero3": (0.0, 1.0)}


# PyTorch's caching allocator reserves memory in blocks; past this much of the 80 GB it frees
# its cache and retries allocations every step. XLA plans a program's buffers once, so meshtron
# has no such regime: a layout that fits runs at its full speed.
ALLOCATOR_PRESSURE_GB = 70.0


def named_departure(run: dict) -> str:
  """Nanotron's own behaviour, not physics, read from the run's own record ('' for none). Scored
  separately, never fitted:
  - pre-fix pipeline: pipeline runs made before the benchmark's pipeline fix (`after_pp_fix`
    False) run at a median 0.04-0.2x of any prediction, far below the same layouts after it;
  - allocator pressure: the 17 runs that reserved over 70 GB of the 80 run at 0.08-0.38x of
    the prediction (median 0.16), the 368 that reserved 40-70 GB at a median 0.96x (7.6% of
    them at 0.38x or below). Named after inspecting the whole sweep, as the first was."""
  if int(run["pp"]) > 1 and run["after_pp_fix"] != "True":
    return "pre-fix pipeline"
  if float(run["mem_reserved_gb"]) > ALLOCATOR_PRESSURE_GB:
    return "allocator pressure"
  return ""


def with_params(hw: hardware.HardwareProfile, values: dict) -> hardware.HardwareProfile:
  overlap = dict(hw.overlap)
  plain = {}
  for key, value in values.items():
    if key.startswith("overlap_"):
      overlap[key[len("overlap_"):]] = min(1.0, max(0.0, value))
    else:
      plain[key] = value
  return dataclasses.replace(hw, overlap=tuple(overlap.items()), **plain)


def fit(sample: list[dict], hw: hardware.HardwareProfile) -> hardware.HardwareProfile:
  """Least squares of log(predicted / measured) over `sample`, each factor within its range
  (bounded Nelder-Mead on the factors scaled by their ranges)."""
  from scipy.optimize import minimize
  sample = [r for r in sample if not refusal(r)]
  names = list(FITTED)
  low = [FITTED[n][0] for n in names]
  span = [FITTED[n][1] - FITTED[n][0] for n in names]
  start = [(dict(hw.overlap)[n[8:]] if n.startswith("overlap_") else getattr(hw, n))
           for n in names]
  measured = [math.log(float(r["tokens_per_s_gpu"])) for r in sample]
  values = lambda x: {n: lo + s * v for n, lo, s, v in zip(names, low, span, x)}  # noqa: E731

  def loss(x):
    trial = with_params(hw, values(x))
    return sum((math.log(predict(r, trial)) - m) ** 2 for r, m in zip(sample, measured))

  x0 = [min(1.0, max(0.0, (v - lo) / s)) for v, lo, s in zip(start, low, span)]
  best = minimize(loss, x0, method="Nelder-Mead", bounds=[(0.0, 1.0)] * len(names),
                  options={"maxiter": 4000, "xatol": 1e-4, "fatol": 1e-5, "adaptive": True})
  return with_params(hw, values(best.x))


def twins(all_runs: list[dict]) -> dict:
  """How rankable each cell is: layouts that differ only in ZeRO-0 vs ZeRO-1 should run at
  nearly one speed (the same bytes, reduce-scatter + all-gather instead of all-reduce), so the
  rank correlation of the ZeRO-0 runs' speeds with their ZeRO-1 twins' bounds what any model
  that ranks them alike can reach. Cells with at least 5 twin pairs."""
  speeds = collections.defaultdict(dict)
  for r in all_runs:
    key = tuple(r[k] for k in ("model", "nodes", "dp", "tp", "pp", "mbs", "ga", "after_pp_fix"))
    speeds[key].setdefault(r["zero"], float(r["tokens_per_s_gpu"]))
  cells = collections.defaultdict(list)
  for key, by_zero in speeds.items():
    if {"0", "1"} <= set(by_zero):
      cells[key[:2]].append((by_zero["0"], by_zero["1"]))
  rows = [{"model": m, "nodes": int(n), "pairs": len(p),
           "spearman": spearman([a for a, _ in p], [b for _, b in p])}
          for (m, n), p in sorted(cells.items()) if len(p) >= 5]
  ratios = sorted(max(a, b) / min(a, b) for p in cells.values() for a, b in p)
  return {"cells": rows, "pairs": len(ratios), "median_ratio": ratios[len(ratios) // 2],
          "median_spearman": sorted(r["spearman"] for r in rows)[len(rows) // 2]}


def render(path: str) -> str:
  rows = [r for r in map(json.loads, filter(str.strip, open(path))) if "runs" in r]  # not twins
  lines = ["| profile | held-out runs scored | median cell rank corr. (min) | cells whose"
           " first-ranked layout runs >= 0.9x the best | cells < 0.5x | median memory error |",
           "| --- | --- | ---: | ---: | ---: | ---: |"]
  for s in rows:
    lines.append(f"| {s['kind']} | {s['runs_scored']} ({s['runs']}) | {s['median_spearman']:.2f}"
                 f" ({s['min_spearman']:.2f}) | {s['cells_first_ranked_at_least_0.9']} of"
                 f" {s['n_cells']} | {s['cells_first_ranked_below_half']} |"
                 f" {s['median_memory_error']:.0%} |")
  return "\n".join(lines) + "\n"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--derive", default="", help="the raw bench_final2 CSV to derive from")
  parser.add_argument("--fit", action="store_true", help="also fit on 10%% and score the rest")
  parser.add_argument("--out", default=RESULTS)
  parser.add_argument("--doc", default="", help="write the section into this Markdown file")
  args = parser.parse_args()
  if args.derive:
    print(json.dumps({"derived_runs": derive(args.derive)}))
  all_runs = runs()
  physical = [r for r in all_runs if not named_departure(r)]
  chosen = {id(physical[i]) for i in fit_sample(physical)}  # 10% of the physical runs
  held_out = {"all runs": [r for r in all_runs if id(r) not in chosen],
              "without pre-fix pipeline runs": [
                  r for r in all_runs if id(r) not in chosen
                  and named_departure(r) != "pre-fix pipeline"],
              "without named departures": [r for r in physical if id(r) not in chosen]}
  profiles = {"built-in": hardware.PROFILES["h100"]}
  if args.fit:
    profiles["fitted"] = fit([r for r in physical if id(r) in chosen], profiles["built-in"])
  results = []
  for kind, hw in profiles.items():
    for name, scored in held_out.items():
      extra = {} if kind == "built-in" else dict(
          fit_runs=len(chosen), factors={k: getattr(hw, k) for k in FITTED if hasattr(hw, k)},
          overlap=dict(hw.overlap))
      results.append(dict(kind=kind, runs=name, **extra, **score(scored, hw)))
  results.append(dict(kind="zero-0/1 twins", **twins(all_runs)))
  with open(args.out, "w") as f:
    for r in results:
      print(json.dumps({k: v for k, v in r.items() if k != "cells"}), flush=True)
      f.write(json.dumps(r) + "\n")
  if args.doc:
    from benchmarks.report import replace_section
    replace_section(args.doc, BEGIN, END, render(args.out))


if __name__ == "__main__":
  main()
