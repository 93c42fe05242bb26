"""The anchors table (issue [26]): each published H100 run of benchmarks/anchor_recipes.py compiled
deviceless for its own cluster (`meshtron compile --target=h100xN`), with its compiled peak
memory, its collective bytes beside the analytic minimum for its layout
(sharding/plan/minimum.py), its predicted step (sharding/xla/step_time.py) beside the published
tokens/s/GPU, and what differs from the published run.

The prediction's constants are the H100 profile's (sharding/plan/profiles.py), fixed with their
sources before this comparison was first run. Collective bytes are what one device sends per
step under ring algorithms (the compiled program's, counted by sharding.xla.hlo; the minimum's,
by the same convention, at the run's own precision). A recipe meshtron refuses is a row that
says why. One JSON line per anchor, then (with --doc) the section of docs/planning.md between its
markers. `make anchors` runs every row but the "before" ones (about 12 minutes on 2 cores; not
part of `make test`); those are an earlier commit's programs, kept as committed.

  .venv/bin/python -m benchmarks.step_time_anchors [--only NAME] [--out FILE]
      [--doc docs/planning.md] [--render_only | --refresh]
"""

import argparse
import json
import os
import time

from benchmarks import anchor_plan_compiled, anchor_planner
from benchmarks.anchor_recipes import ANCHORS, PEAK_LIMIT_GIB, Anchor, anchor_layout, config
from benchmarks.report import replace_section
from sharding.plan.estimate import model_spec
from sharding.plan.minimum import minimum_bytes
from sharding.xla import compiled
from trainer.aot import compile_for_gpus

RESULTS = os.path.join(os.path.dirname(__file__), "results", "step_time_anchors.jsonl")
BEGIN, END = "<!-- step-time-anchors:begin -->", "<!-- step-time-anchors:end -->"


def _row(a: Anchor) -> dict:
  return {"anchor": a.name, "source": a.source, "release": a.release, "precision": a.precision,
          "model": a.preset, "target": a.target,
          "layout": ", ".join(f"{k}={v}" for k, v in a.mesh.items()),
          "batch": a.batch_size, "seq": a.seq_len, "microbatches": a.microbatches,
          "remat": a.remat, "layers_apart": not dict(a.compute).get("scan_layers", True),
          "master_weights": a.master_weights, "routing": a.routing,
          "before": a.before,
          "published_tokens_per_s_per_gpu": round(a.published, 1),
          "differences": a.differences}


def run(a: Anchor) -> dict:
  target = compiled.parse_gpu_target(a.target)
  cfg, row = config(a), _row(a)
  start = time.perf_counter()
  try:
    cfg.validate()
    layout = cfg.layout(target.num_devices)
  except ValueError as e:  # a layout meshtron refuses today: the row says why
    return {**row, "status": "refused", "reason": str(e).splitlines()[0]}
  try:
    rep = compile_for_gpus(cfg, target, timeout=anchor_plan_compiled.TIMEOUT_S)
  except ValueError as e:  # accepted, but the compile fails: a bug the row names
    return {**row, "status": "failed", "reason": str(e).splitlines()[0]}
  st = rep.step_time
  return {**row, "status": "compiled",
          "predicted_tokens_per_s_per_gpu": round(st["tokens_per_s_per_gpu"], 1),
          "predicted_over_published": round(st["tokens_per_s_per_gpu"] / a.published, 3),
          "predicted_step_s": st["step_s"], "predicted_mfu": st["mfu"],
          "kernels_s": st["compute_s"], "communication_s": st["communication_s"],
          "exposed_communication_s": st["exposed_communication_s"],
          "compiled_peak_gib": rep.memory["peak"] / 2**30,
          "fits_76gib": rep.memory["peak"] <= PEAK_LIMIT_GIB * 2**30,
          # Each conditional by its costliest branch (a pipeline tick runs one stage role's
          # forward or backward; the step-time model prices it the same way): an upper bound
          # for pipelined programs, exact for the others.
          "collective_bytes": sum(rep.costliest_branch.values()),
          "collective_bytes_all_branches": rep.wire_bytes,
          "collectives": {kind: {k: v[k] for k in ("executions", "wire_bytes")}
                          for kind, v in rep.summary.items()},
          **minimum_fields(a, layout, sum(rep.costliest_branch.values())),
          **anchor_planner.planner_fields(a, layout, st["tokens_per_s_per_gpu"]),
          "top_ops": [{k: op[k] for k in ("name", "kind", "count", "total_s", "flops")}
                      for op in st["top_ops"][:5]],
          "xla_rematerialization": rep.extra.get("xla rematerialization", ""),
          "compile_s": round(time.perf_counter() - start, 1)}


def minimum_fields(a: Anchor, layout, collective_bytes: float) -> dict:
  """The analytic minimum for the anchor's layout at its config's precision, and the ratio. The
  compute settings go with the model: they name the row's context-parallel algorithm (Ulysses'
  all-to-alls or the ring's K/V passes), whose minimum the row is held to."""
  cfg = config(a)
  precision = cfg.precision()
  minimum = minimum_bytes(model_spec(cfg.model, cfg.compute), layout, a.seq_len, precision)
  total = sum(minimum.values())
  return {"minimum_bytes": minimum, "minimum_total_bytes": total,
          "bytes_over_minimum": collective_bytes / total if total else None,
          "minimum_precision": precision.name}


def refresh(path: str) -> None:
  """Rewrites the rows of `path` with their recipe's current text (anchor_recipes.py) and the
  analytic minimum of their layout (sharding/plan/minimum.py), compiling nothing."""
  anchors = {a.name: a for a in ANCHORS}
  rows = [json.loads(line) for line in open(path) if line.strip()]
  for r in rows:
    if r["anchor"] not in anchors:
      continue
    a = anchors[r["anchor"]]
    r.update(_row(a))
    if r["status"] == "compiled":
      layout = anchor_layout(a)
      r.update(minimum_fields(a, layout, r["collective_bytes"]))
      r.update(anchor_planner.planner_fields(a, layout, r["predicted_tokens_per_s_per_gpu"]))
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)


def _gib(n: float) -> str:
  return f"{n / 2**30:,.0f}" if n >= 2**30 else f"{n / 2**30:.2f}"


def render(path: str) -> str:
  rows = [json.loads(line) for line in open(path) if line.strip()]
  lines = ["| published run (release) | model, GPUs, layout, batch x seq, remat, precision |"
           " compiled peak GiB (<= 76) | collective GiB/step : analytic minimum |"
           " predicted tok/s/GPU (MFU) | published tok/s/GPU | predicted / published |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
  for r in rows:
    accumulation = f" ({r['microbatches']} microbatches)" if r["microbatches"] > 1 else ""
    setup = (f"{r['model']}, {r['target']}, {r['layout']}, {r['batch']} x {r['seq']}"
             f"{accumulation}, {r['remat']}"
             f"{', layers apart' if r.get('layers_apart') else ''}, {r['precision']}"
             f"{', bf16 weights + fp32 master' if r.get('master_weights') else ''}")
    head = f"| {r['anchor']} ({r['release']}) | {setup} |"
    if r["status"] != "compiled":
      lines.append(f"{head} {r['status']}: {r['reason']} | | |"
                   f" {r['published_tokens_per_s_per_gpu']:,.0f} | |")
      continue
    over = r["bytes_over_minimum"]
    ratio = f" ({over:.1f}x)" if over is not None else ""
    lines.append(
        f"{head} {r['compiled_peak_gib']:,.1f} ({'yes' if r['fits_76gib'] else 'no'}) |"
        f" {_gib(r['collective_bytes'])} : {_gib(r['minimum_total_bytes'])}{ratio} |"
        f" {r['predicted_tokens_per_s_per_gpu']:,.0f} ({r['predicted_mfu']:.1%}) |"
        f" {r['published_tokens_per_s_per_gpu']:,.0f} | {r['predicted_over_published']:.2f} |")
  lines += ["", "The planner on each compiled row (`benchmarks/anchor_planner.py`; issue [26] asks"
            " for the anchor's layout, or a faster one, in `plan`'s top 3, and its analytic speed"
            " within 20% of the compiled prediction):", "", *anchor_planner.render(rows), ""]
  plans = anchor_plan_compiled.render(anchor_plan_compiled.RESULTS)
  if plans:
    lines += ["`plan`'s top 3 compiled for each anchor's cluster with the anchor's batch, sequence"
              " and precision (`make anchor-plans`, `benchmarks/anchor_plan_compiled.py`): the"
              " check holds where the anchor's layout is among them, or one whose program fits in"
              " 76 GiB and is predicted at least as fast as the anchor's:", "", *plans, ""]
  for r in rows:
    routing = f" Routing: {r['routing']}." if r.get("routing") else ""
    before = f" Before row: {r['before']}." if r.get("before") else ""
    remat = (f" Compiled (trainer/xla_remat.py): {r['xla_rematerialization']}."
             if r.get("xla_rematerialization") else "")
    lines.append(f"- {r['anchor']}: {r['source']}. Not the same: {r['differences']}."
                 f"{routing}{before}{remat}")
  return "\n".join(lines) + "\n"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--only", default="", help="run the anchors whose name contains this;"
                      " the other rows of --out are kept (without --only, all but the"
                      " 'before' rows)")
  parser.add_argument("--out", default=RESULTS)
  parser.add_argument("--doc", default="", help="write the section into this Markdown file")
  parser.add_argument("--render_only", action="store_true", help="render --out, compile nothing")
  parser.add_argument("--refresh", action="store_true", help="rewrite --out's rows with their"
                      " recipes' text and analytic minimums, compile nothing")
  args = parser.parse_args()
  if args.refresh:
    refresh(args.out)
  elif not args.render_only:
    kept = {}
    if os.path.exists(args.out):
      kept = {r["anchor"]: r for r in map(json.loads, open(args.out)) if r}
    for a in ANCHORS:  # the table's order is ANCHORS'; rows not re-run keep their last result
      # A "before" row is the program of an earlier commit: re-run only when named (on a
      # worktree of that commit, with this commit's benchmarks/ and sharding/xla/ analysis).
      if args.only in a.name and (args.only or not a.before):
        kept[a.name] = run(a)
        print(json.dumps(kept[a.name]), flush=True)
    with open(args.out, "w") as f:
      for a in ANCHORS:
        if a.name in kept:
          f.write(json.dumps(kept[a.name]) + "\n")
  if args.doc:
    replace_section(args.doc, BEGIN, END, render(args.out))
    print(f"wrote the step-time anchors section of {args.doc}")


if __name__ == "__main__":
  main()
