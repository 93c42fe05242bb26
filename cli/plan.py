"""`meshtron plan`: every valid layout of a model on a cluster, ranked by predicted throughput
(analytic); with --compile_top the best compiled for the cluster and ranked again
(cli/plan_compile.py); with --out the chosen one written as a config file."""

import dataclasses
import json
import time

from cli import flags, plan_compile
from cli.presets import (model_by_name, parse_tokens, precision_by_name, preset_module,
                         write_config)
from sharding.plan import estimate, hardware, planner


def run() -> None:
  """The flags' plan."""
  run_plan(model=flags.MODEL.value, gpu=flags.GPU.value, gpus=flags.GPUS.value,
           nodes=flags.NODES.value, gpus_per_node=flags.GPUS_PER_NODE.value, seq=flags.SEQ.value,
           global_batch_tokens=flags.BATCH.value, precision=flags.PRECISION.value,
           top_k=flags.TOP.value, out=flags.OUT.value, as_json=flags.JSON.value,
           compile_top=flags.COMPILE_TOP.value, activations=flags.ACTIVATIONS.value)


def run_plan(*, model: str, gpu: str, gpus: int, nodes: int, gpus_per_node: int, seq: int,
             global_batch_tokens: str, precision: str, top_k: int, out: str,
             as_json: bool, compile_top: int = 0,
             activations: str = planner.PLANNER_FORMULA) -> None:
  """The ranked layouts of a preset `model` on a cluster, and a config file for the best; with
  `compile_top` the best that many compiled and ranked again (cli/plan_compile.py)."""
  start = time.perf_counter()
  hw = hardware.load_profile(gpu)
  if gpus_per_node:
    hw = dataclasses.replace(hw, gpus_per_node=gpus_per_node)
  if not model:
    raise ValueError("plan needs --model=NAME (e.g. --model=llama3_70b)")
  spec = model_by_name(model)
  gpus = gpus or nodes * hw.gpus_per_node
  chosen = precision_by_name(precision)
  tokens = parse_tokens(global_batch_tokens)
  if compile_top < 0:
    raise ValueError(f"--compile_top={compile_top} must be 0 (analytic only) or a count of layouts")
  if compile_top:
    plan_compile.gpu_target(hw.name, gpus)  # a target exists: refused before planning
    if preset_module(model) is None:
      raise ValueError(f"--compile_top compiles trainer presets; {model} is the estimator's"
                       " own model (use a preset: `meshtron compile --help` lists them)")
  result = planner.plan(spec, gpus, seq, tokens, chosen, hw, formula=activations)
  best = result.ranked[:top_k]
  if not as_json:
    print(f"{model} ({spec.num_params() / 1e9:.2f}B) on {gpus} x {hw.summary()};"
          f" seq {seq}, {tokens:,} tokens per step, {chosen.name}")
    print(f"{result.considered:,} layouts considered, {len(result.ranked):,} fit,"
          f" {len(result.rejected):,} rejected ({time.perf_counter() - start:.2f} s)")
    print(f"{'#':>3}  {'tok/s/GPU':>10} {'MFU':>6} {'step s':>8} {'GB/GPU':>7}  layout")
    for i, c in enumerate(best, 1):
      print(f"{i:>3}  {c.time.tokens_per_s_per_gpu:>10,.0f} {c.time.mfu:>6.1%}"
            f" {c.time.step_s:>8.3f} {c.memory.total / estimate.GB:>7.1f}  {c.layout.string()}")
    print("rejected, by reason:")
    print("\n".join(planner.rejection_summary(result.rejected)))
  if not best:
    raise ValueError(f"no layout of {model} fits on {gpus} {hw.name} GPUs")
  compiled_best = []
  if compile_top:
    if not as_json:
      print(f"compiling the best {min(compile_top, len(result.ranked))} layouts for"
            f" {hw.name}x{gpus} without a GPU, {plan_compile.WORKERS} at a time ...", flush=True)
    results, tables = plan_compile.run(model, result.ranked[:compile_top], seq, hw.name, gpus,
                                       quiet=as_json, precision=chosen)
    compiled_best = plan_compile.reranked(results)
    print(json.dumps({"analytic": [c.summary() for c in best],
                      "compiled": [r.summary() for r in results]}) if as_json else tables)
    if not compiled_best:
      raise ValueError(f"none of the best {compile_top} layouts of {model} compiled and fit on"
                       f" {gpus} {hw.name} GPUs")
  elif as_json:
    print(json.dumps([c.summary() for c in best]))
  chosen_layout = compiled_best[0].candidate.layout if compile_top else best[0].layout
  if out and write_config(out, model, chosen_layout, seq, chosen) and not as_json:
    print(f"wrote {out}: meshtron train --config={out}")
  elif not out and not as_json:
    print("--out=best.py writes the best layout as a config file for meshtron train")
