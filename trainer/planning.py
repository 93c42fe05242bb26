"""`meshtron memory` and `meshtron plan` (flags in trainer/cli.py): the estimator and planner
behind tables, JSON, a stacked-bar plot and the chosen layout written as a config file for
`meshtron train`."""

import dataclasses
import json
import sys
import time

import sharding.layout
from sharding.plan import estimate, hardware, planner

def parse_tokens(text: str) -> int:
  """"1M" -> 1048576, "512K" -> 524288, "4096" -> 4096."""
  text = text.strip().upper()
  scale = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}.get(text[-1:], 1)
  number = text[:-1] if scale > 1 else text
  if not number.isdigit():
    raise ValueError(f"--global_batch_tokens={text!r} must be a number with an optional K/M/G")
  return int(number) * scale


def _preset_module(name: str):
  """The configs module whose `large(name)` builds trainer preset `name`, or None."""
  from configs import llama, moe
  return next((m for m in (llama, moe) if name in m.MODELS), None)


def model_by_name(name: str):
  """A configs preset (dense or MoE, read by duck typing) or one of the estimator's own models."""
  if module := _preset_module(name):
    return estimate.model_spec(module.MODELS[name])
  if name in estimate.ESTIMATOR_MODELS:
    return estimate.ESTIMATOR_MODELS[name]
  from configs import llama, moe
  names = sorted(set(llama.MODELS) | set(moe.MODELS) | set(estimate.ESTIMATOR_MODELS))
  raise ValueError(f"unknown model {name!r}; models: {', '.join(names)}")


def precision_by_name(name: str, model_dtype: str = "bfloat16") -> estimate.Precision:
  if name == "trainer":
    return estimate.trainer_precision(model_dtype)
  if name not in estimate.PRECISIONS:
    raise ValueError(f"unknown precision {name!r}; one of {', '.join(estimate.PRECISIONS)}")
  return estimate.PRECISIONS[name]


def format_memory(cand: planner.Candidate, title: str, hw: hardware.HardwareProfile) -> str:
  m, t = cand.memory, cand.time
  rows = [("parameters", m.params), ("gradients", m.grads), ("optimizer states", m.optimizer),
          ("activations", m.activations), ("logits / loss buffers", m.logits),
          ("temporaries + workspace", m.temporaries)]
  lines = [title, f"layout {cand.layout.string()} on {cand.layout.num_devices} GPUs",
           "memory per GPU (GB = 1e9 bytes):"]
  lines += [f"  {name:<26}{value / estimate.GB:10.2f} GB" for name, value in rows]
  lines.append(f"  {'total':<26}{m.total / estimate.GB:10.2f} GB of"
               f" {hw.memory_bytes / estimate.GB:.0f} GB:"
               f" {'fits' if cand.fits else 'DOES NOT FIT'}")
  lines.append(f"predicted step {t.step_s:.3f} s (compute {t.compute_s:.3f}, bubble"
               f" {t.bubble_s:.3f}, exposed communication {t.exposed_comm_s:.3f});"
               f" {t.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, MFU {t.mfu:.1%}")
  return "\n".join(lines)


def plot_memory(cand: planner.Candidate, path: str, title: str,
                hw: hardware.HardwareProfile) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  m = cand.memory
  parts = [("parameters", m.params), ("gradients", m.grads), ("optimizer", m.optimizer),
           ("activations", m.activations), ("logits", m.logits),
           ("temporaries", m.temporaries)]
  fig, ax = plt.subplots(figsize=(6.5, 5))
  bottom = 0.0
  for name, value in parts:
    ax.bar([0], [value / estimate.GB], bottom=[bottom], label=name, width=0.5)
    bottom += value / estimate.GB
  ax.axhline(hw.memory_bytes / estimate.GB, color="k", linestyle="--", label=f"{hw.name} memory")
  parts_of_layout = cand.layout.string().split(",")
  label = "\n".join(",".join(parts_of_layout[i:i + 4]) for i in range(0, len(parts_of_layout), 4))
  ax.set_xticks([0], [label], fontsize=7)
  ax.set_ylabel("GB per GPU")
  ax.set_title(title, fontsize=9)
  ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def run_memory(config, config_given: bool, *, model: str, layout: str, gpu: str, seq: int,
               precision: str, plot: str, gpus: int, as_json: bool) -> None:
  """The memory breakdown and predicted step of one layout: of a preset `model` under `layout`,
  or of the TrainConfig `config` on `gpus` devices (default a node)."""
  hw = hardware.load_profile(gpu)
  if model:
    spec, lay = model_by_name(model), sharding.layout.parse(layout)
    chosen, title = precision_by_name(precision), model
  else:
    if layout or not config_given:
      raise ValueError("memory needs --model=NAME --layout=... or --config=PRESET|file.py")
    spec, lay = estimate.model_spec(config.model), config.layout(gpus or hw.gpus_per_node)
    chosen = estimate.trainer_precision(config.model.dtype, config.model.param_dtype)
    seq, title = config.seq_len, f"{config.model.num_params() / 1e9:.2f}B-parameter model"
  errors = planner.divisibility_errors(spec, lay, seq)
  if errors:
    raise ValueError(f"layout {lay.string()}: {'; '.join(errors)}")
  cand = planner.evaluate(spec, lay, seq, chosen, hw)
  title = f"{title}, seq {seq}, {chosen.name}, {hw.name}"
  if as_json:
    print(json.dumps(dict(cand.summary(), model=title)))
  else:
    print(format_memory(cand, title, hw))
  if plot:
    plot_memory(cand, plot, title, hw)
    if not as_json:
      print(f"wrote {plot}")


def run_plan(*, model: str, gpu: str, gpus: int, nodes: int, gpus_per_node: int, seq: int,
             global_batch_tokens: str, precision: str, top_k: int, out: str,
             as_json: bool, compile_top: int = 0) -> None:
  """The ranked layouts of a preset `model` on a cluster, and a config file for the best; with
  `compile_top` the best that many compiled and ranked again (trainer/compile_top.py)."""
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
    from trainer import compile_top as compiling
    compiling.gpu_target(hw.name, gpus)  # a target exists: refused before planning
    if _preset_module(model) is None:
      raise ValueError(f"--compile_top compiles trainer presets; {model} is the estimator's"
                       " own model (use a preset: `meshtron compile --help` lists them)")
  result = planner.plan(spec, gpus, seq, tokens, chosen, hw)
  best = result.ranked[:top_k]
  if not as_json:
    print(f"{model} ({spec.num_params() / 1e9:.2f}B) on {gpus} x {hardware.gpu_summary(hw)};"
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
            f" {hw.name}x{gpus} without a GPU, {compiling.WORKERS} at a time ...", flush=True)
    results, tables = compiling.run(model, result.ranked[:compile_top], seq, hw.name, gpus,
                                    quiet=as_json)
    compiled_best = compiling.reranked(results)
    print(json.dumps({"analytic": [c.summary() for c in best],
                      "compiled": [r.summary() for r in results]}) if as_json else tables)
    if not compiled_best:
      raise ValueError(f"none of the best {compile_top} layouts of {model} compiled and fit on"
                       f" {gpus} {hw.name} GPUs")
  elif as_json:
    print(json.dumps([c.summary() for c in best]))
  chosen_layout = compiled_best[0].candidate.layout if compile_top else best[0].layout
  if out and write_config(out, model, chosen_layout, seq) and not as_json:
    print(f"wrote {out}: meshtron train --config={out}")
  elif not out and not as_json:
    print("--out=best.py writes the best layout as a config file for meshtron train")


def train_config(model: str, layout: sharding.layout.Layout, seq: int):
  """The TrainConfig of a preset under a planned layout: what write_config's file builds."""
  cfg = _preset_module(model).large(model)
  cfg.mesh = layout.mesh_config()
  cfg.seq_len, cfg.batch_size, cfg.microbatches = seq, layout.global_batch, layout.microbatches
  cfg.compute = dataclasses.replace(cfg.compute, remat=layout.remat)
  return cfg


def write_config(path: str, model: str, layout: sharding.layout.Layout, seq: int) -> bool:
  """A config file for `meshtron train` with the layout's mesh, batch and remat."""
  module = _preset_module(model)
  if module is None:
    print(f"note: {model} is not a trainer preset yet; no config written", file=sys.stderr)
    return False
  mesh = ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(layout.mesh_config()).items()
                   if k not in ("dcn", "allow_tensor_across_hosts"))
  text = f'''"""{model} with the layout chosen by `meshtron plan`: {layout.string()}."""

from configs import {module.__name__.split(".")[-1]}
from sharding.mesh import MeshConfig


def get_config():
  cfg = {module.__name__.split(".")[-1]}.large({model!r})
  cfg.mesh = MeshConfig({mesh})
  cfg.seq_len = {seq}
  cfg.batch_size = {layout.global_batch}  # sequences per step: mbs x ga x data x fsdp x expert
  cfg.microbatches = {layout.microbatches}
  cfg.compute.remat = {layout.remat!r}
  return cfg
'''
  with open(path, "w") as f:
    f.write(text)
  return True
