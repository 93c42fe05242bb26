"""Issue [26]'s top-3 check by compiling: `meshtron plan` must list the anchor's layout "or one
faster by the compiled-program prediction" in its top 3. For each anchor, the planner's first
three layouts (but the anchor's own, which is its row) are compiled deviceless for the anchor's
cluster with everything else the anchor's row compiles with (model, global batch, sequence, fp8
recipe, bf16 weights with float32 master copies, MoE exchange capacity), and each program's
predicted tokens/s/GPU (sharding/xla/step_time.py) is set beside the anchor's own program's
(`benchmarks/results/step_time_anchors.jsonl`). A layout passes when its program peaks at most
76 GiB (the anchors table's line) and is predicted at least as fast as the anchor's.

Run it after `make anchors` (it reads those rows). One JSON line per anchor in
benchmarks/results/anchor_plan_compiled.jsonl; `make anchor-plans`
(about 15 minutes of compiles on 2 cores; not part of `make test`) runs it, then renders the
anchors section of docs/planning.md again (benchmarks/step_time_anchors.py shows the table).

  .venv/bin/python -m benchmarks.anchor_plan_compiled [--only NAME] [--out FILE]
"""

import argparse
import concurrent.futures
import dataclasses
import json
import os

from benchmarks import anchor_planner
from benchmarks.anchor_recipes import (ANCHORS, PEAK_LIMIT_GIB, Anchor, anchor_layout, config,
                                       scales_per_rank)
from sharding.layout import Layout
from sharding.plan import hardware, planner
from sharding.xla import compiled
from trainer.aot import compile_for_gpus

RESULTS = os.path.join(os.path.dirname(__file__), "results", "anchor_plan_compiled.jsonl")
# The anchors' own programs (benchmarks/step_time_anchors.py, `make anchors`).
ANCHOR_RESULTS = os.path.join(os.path.dirname(__file__), "results", "step_time_anchors.jsonl")
WORKERS = 2  # compiles at once, as `plan --compile_top`
# One layout's compile, here and for the anchors table and breakdown: Qwen3-30B-A3B's 48 MoE
# layers apart take ~20 min, the DeepSeek-V3 rows ~27 (a breakdown of one passed the 30-minute
# default).
TIMEOUT_S = 3600


def candidate_config(a: Anchor, layout: Layout):
  """The anchor's config with the planned layout's mesh, accumulation and recomputation (and
  the layers stacked under pipeline stages, which split a stack, where the anchor's are apart)."""
  cfg = config(a)
  cfg.mesh = layout.mesh_config()
  cfg.batch_size, cfg.microbatches = layout.global_batch, layout.microbatches
  cfg.compute = dataclasses.replace(cfg.compute, remat=layout.remat)
  if layout.pipeline > 1:
    cfg.compute = dataclasses.replace(cfg.compute, scan_layers=True)
  if layout.context > 1:
    cfg.compute = dataclasses.replace(cfg.compute, context_impl=layout.context_impl)
  cfg.compute = dataclasses.replace(cfg.compute, fp8=dataclasses.replace(
      cfg.compute.fp8, sequences_per_scale=1))  # then the candidate's own micro-batch
  return scales_per_rank(cfg, a.gpus)


def top_layouts(a: Anchor) -> tuple[str, int | None, list]:
  """(the anchor's layout string, its rank in the plan or None, the plan's first TOP
  candidates), with the planner asked as `anchor_planner.planner_fields` asks it."""
  cfg = config(a)
  layout = anchor_layout(a)
  result = planner.plan(cfg.model, a.gpus, a.seq_len, a.batch_size * a.seq_len,
                        cfg.precision(), hardware.PROFILES["h100"])
  names = [c.layout.string() for c in result.ranked]
  rank = names.index(layout.string()) + 1 if layout.string() in names else None
  return layout.string(), rank, result.ranked[:anchor_planner.TOP]


def compile_candidate(a: Anchor, layout: Layout) -> dict:
  """One planned layout's program for the anchor's cluster: its prediction and peak, or why
  it was refused or failed. Where the anchor's row stores its layers apart and this layout's
  program does not fit so, the layers are stacked, as a user whose program does not fit would
  (`plan` sizes stacked programs: its `compiled` activation terms were fitted on them); the
  entry keeps the apart program's peak."""
  target = compiled.parse_gpu_target(a.target)
  cfg = candidate_config(a, layout)
  entry = _compiled(cfg, target)
  if entry["status"] == "compiled" and not entry["fits_76gib"] and not cfg.compute.scan_layers:
    stacked = _compiled(dataclasses.replace(
        cfg, compute=dataclasses.replace(cfg.compute, scan_layers=True)), target)
    if stacked["status"] == "compiled" and stacked["fits_76gib"]:
      return {**stacked, "layers": "stacked: apart, its program peaked at"
              f" {entry['compiled_peak_gib']:.1f} GiB"}
  return entry


def _compiled(cfg, target) -> dict:
  try:
    cfg.validate()
    cfg.layout(target.num_devices)
    rep = compile_for_gpus(cfg, target, timeout=TIMEOUT_S)
  except Exception as e:  # noqa: BLE001  (a refusal or failed compile is this layout's verdict)
    return {"status": "failed", "reason": (str(e).strip().splitlines() or [type(e).__name__])[0]}
  st = rep.step_time
  return {"status": "compiled", "predicted_tokens_per_s_per_gpu": round(
      st["tokens_per_s_per_gpu"], 1), "predicted_mfu": st["mfu"],
      "compiled_peak_gib": rep.memory["peak"] / 2**30,
      "fits_76gib": rep.memory["peak"] <= PEAK_LIMIT_GIB * 2**30,
      "xla_rematerialization": rep.extra.get("xla rematerialization", "")}


def run(anchors: list, stored: dict) -> list[dict]:
  """Each anchor's check; compiles are shared between rows with the same config."""
  jobs, rows = {}, []
  pool = concurrent.futures.ThreadPoolExecutor(WORKERS)
  for a in anchors:
    mine, rank, top = top_layouts(a)
    row = {"anchor": a.name, "target": a.target, "layout": mine, "rank": rank,
           "anchor_predicted_tokens_per_s_per_gpu":
               stored.get(a.name, {}).get("predicted_tokens_per_s_per_gpu"),
           "candidates": []}
    for i, c in enumerate(top, 1):
      entry = {"rank": i, "layout": c.layout.string(),
               "analytic_tokens_per_s_per_gpu": round(c.time.tokens_per_s_per_gpu, 1)}
      if c.layout.string() != mine:  # the anchor's own program is the anchors table's row
        key = json.dumps(dataclasses.asdict(candidate_config(a, c.layout)), sort_keys=True,
                         default=str) + a.target
        if key not in jobs:
          jobs[key] = pool.submit(compile_candidate, a, c.layout)
        entry["job"] = key
      row["candidates"].append(entry)
    rows.append(row)
  for row in rows:
    for entry in row["candidates"]:
      if "job" in entry:
        entry.update(jobs[entry.pop("job")].result())
    row.update(verdict(row))
    print(json.dumps(row), flush=True)
  pool.shutdown()
  return rows


def verdict(row: dict) -> dict:
  """Whether the plan's top 3 holds the anchor's layout, or a layout whose program fits and is
  predicted at least as fast as the anchor's program."""
  own = row["anchor_predicted_tokens_per_s_per_gpu"]
  faster = [e for e in row["candidates"] if e.get("status") == "compiled" and e["fits_76gib"]
            and own is not None and e["predicted_tokens_per_s_per_gpu"] >= own]
  best = max(faster, key=lambda e: e["predicted_tokens_per_s_per_gpu"], default=None)
  holds = (row["rank"] is not None and row["rank"] <= anchor_planner.TOP) or best is not None
  return {"top_3_holds": holds, "fastest_faster": best["layout"] if best else None}


def render(path: str) -> list[str]:
  """The compiled top-3 table's lines ([] without results)."""
  if not os.path.exists(path):
    return []
  lines = ["| published run | anchor's program, tok/s/GPU | `plan`'s top 3 compiled: predicted"
           " tok/s/GPU, peak GiB | anchor's layout or a faster one in the top 3? |",
           "| --- | ---: | --- | --- |"]
  # The anchors' programs as `make anchors` last compiled them: a recompiled anchor is judged
  # against its candidates by its current prediction, not the one stored beside them.
  current = {r["anchor"]: r.get("predicted_tokens_per_s_per_gpu")
             for r in map(json.loads, filter(str.strip, open(ANCHOR_RESULTS)))}
  for r in map(json.loads, filter(str.strip, open(path))):
    r["anchor_predicted_tokens_per_s_per_gpu"] = current.get(
        r["anchor"], r["anchor_predicted_tokens_per_s_per_gpu"])
    r.update(verdict(r))
    cells = []
    for e in r["candidates"]:
      if e["layout"] == r["layout"]:
        cells.append(f"{e['rank']}. the anchor's layout")
      elif e.get("status") == "compiled":
        cells.append(f"{e['rank']}. {e['layout']}: {e['predicted_tokens_per_s_per_gpu']:,.0f},"
                     f" {e['compiled_peak_gib']:.1f}{'' if e['fits_76gib'] else ' (over 76)'}"
                     f"{' (' + e['layers'] + ')' if 'layers' in e else ''}")
      else:
        cells.append(f"{e['rank']}. {e['layout']}: {e['status']} ({e['reason']})")
    own = r["anchor_predicted_tokens_per_s_per_gpu"]
    lines.append(f"| {r['anchor']} | {own:,.0f} | {'<br>'.join(cells) or 'no layout fits'} |"
                 f" {'yes' if r['top_3_holds'] else 'no'} |")
  return lines


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--only", default="", help="check the anchors whose name contains this;"
                      " the other rows of --out are kept")
  parser.add_argument("--out", default=RESULTS)
  args = parser.parse_args()
  stored = {r["anchor"]: r for r in map(json.loads, open(ANCHOR_RESULTS))}
  anchors = [a for a in ANCHORS if args.only in a.name and not a.before
             and stored.get(a.name, {}).get("status") == "compiled"]
  kept = {}
  if os.path.exists(args.out):
    kept = {r["anchor"]: r for r in map(json.loads, filter(str.strip, open(args.out)))}
  kept.update({r["anchor"]: r for r in run(anchors, stored)})
  with open(args.out, "w") as f:
    f.writelines(json.dumps(kept[a.name]) + "\n" for a in ANCHORS if a.name in kept)


if __name__ == "__main__":
  main()
