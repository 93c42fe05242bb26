"""`meshtron memory` and `meshtron plan`: the estimator and planner behind flags, tables, JSON,
a stacked-bar plot and the chosen layout written as a config file for `meshtron train`."""

import dataclasses
import json
import sys
import time

from absl import flags

import sharding.layout
from sharding.plan import estimate, hardware, planner

_MODEL = flags.DEFINE_string("model", "", "memory/plan: model preset (e.g. llama3_70b,"
                             " playbook_8b, mixtral_8x7b); memory without it reads --config")
_GPU = flags.DEFINE_string("gpu", "h100", "memory/plan: h100, h200, a100, b200 or a profile .json")
_SEQ = flags.DEFINE_integer("seq", 4096, "memory/plan: sequence length")
_LAYOUT = flags.DEFINE_string("layout", "", "memory: e.g. data=4,tensor=2,pipeline=2,zero=1,mbs=4,"
                              "ga=16,remat=selective,sp=1,schedule=1f1b (also fsdp=, context=,"
                              " expert=, vpp=; aliases dp=, tp=, pp=, cp=, ep=)")
_PRECISION = flags.DEFINE_string("precision", "playbook", "memory/plan: playbook (bf16 + fp32"
                                 " master, Adam fp32), playbook_fp32_accum, fp32, or trainer"
                                 " (what trainer/ stores today: fp32 params, grads and moments)")
_PLOT = flags.DEFINE_string("plot", "", "memory: write a stacked bar chart of the breakdown here")
_GPUS = flags.DEFINE_integer("gpus", 0, "plan: number of GPUs (default nodes x gpus_per_node);"
                             " memory --config: devices the mesh fills")
_NODES = flags.DEFINE_integer("nodes", 1, "plan: number of nodes")
_GPUS_PER_NODE = flags.DEFINE_integer("gpus_per_node", 0, "plan: GPUs per node (default: the"
                                      " profile's, 8)")
_BATCH = flags.DEFINE_string("global_batch_tokens", "1M", "plan: tokens per step (1M = 2**20)")
_TOP = flags.DEFINE_integer("top_k", 10, "plan: layouts to print")
_OUT = flags.DEFINE_string("out", "", "plan: config file to write for the best layout (default"
                           " plan_<model>_<gpus>.py)")


def parse_tokens(text: str) -> int:
  """"1M" -> 1048576, "512K" -> 524288, "4096" -> 4096."""
  text = text.strip().upper()
  scale = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}.get(text[-1:], 1)
  number = text[:-1] if scale > 1 else text
  if not number.isdigit():
    raise ValueError(f"--global_batch_tokens={text!r} must be a number with an optional K/M/G")
  return int(number) * scale


def model_by_name(name: str):
  """A configs preset (read by duck typing) or one of the estimator's own models."""
  from configs import llama
  if name in llama.MODELS:
    return estimate.model_spec(llama.MODELS[name])
  if name in estimate.ESTIMATOR_MODELS:
    return estimate.ESTIMATOR_MODELS[name]
  names = sorted(set(llama.MODELS) | set(estimate.ESTIMATOR_MODELS))
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
               f" {hw.memory_bytes / estimate.GB:.0f} GB: {'fits' if cand.fits else 'DOES NOT FIT'}")
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


def run_memory(config, config_given: bool) -> None:
  hw = hardware.load_profile(_GPU.value)
  if _MODEL.value:
    model = model_by_name(_MODEL.value)
    layout = sharding.layout.parse(_LAYOUT.value)
    precision, seq, title = precision_by_name(_PRECISION.value), _SEQ.value, _MODEL.value
  else:
    if _LAYOUT.value or not config_given:
      raise ValueError("memory needs --model=NAME --layout=... or --config=PRESET|file.py")
    model = estimate.model_spec(config.model)
    layout = config.layout(_GPUS.value or hw.gpus_per_node)
    precision = estimate.trainer_precision(config.model.dtype, config.model.param_dtype)
    seq, title = config.seq_len, f"{config.model.num_params() / 1e9:.2f}B-parameter model"
  errors = planner.divisibility_errors(model, layout, seq)
  if errors:
    raise ValueError(f"layout {layout.string()}: {'; '.join(errors)}")
  cand = planner.evaluate(model, layout, seq, precision, hw)
  title = f"{title}, seq {seq}, {precision.name}, {hw.name}"
  if _json():
    print(json.dumps(dict(cand.summary(), model=title)))
  else:
    print(format_memory(cand, title, hw))
  if _PLOT.value:
    plot_memory(cand, _PLOT.value, title, hw)
    if not _json():
      print(f"wrote {_PLOT.value}")


def run_plan() -> None:
  start = time.perf_counter()
  hw = hardware.load_profile(_GPU.value)
  if _GPUS_PER_NODE.value:
    hw = dataclasses.replace(hw, gpus_per_node=_GPUS_PER_NODE.value)
  if not _MODEL.value:
    raise ValueError("plan needs --model=NAME (e.g. --model=llama3_70b)")
  model = model_by_name(_MODEL.value)
  gpus = _GPUS.value or _NODES.value * hw.gpus_per_node
  precision = precision_by_name(_PRECISION.value)
  result = planner.plan(model, gpus, _SEQ.value, parse_tokens(_BATCH.value), precision, hw)
  best = result.ranked[: _TOP.value]
  if _json():
    print(json.dumps([c.summary() for c in best]))
  else:
    print(f"{_MODEL.value} ({model.num_params() / 1e9:.2f}B) on {gpus} x"
          f" {hardware.gpu_summary(hw)}; seq {_SEQ.value}, {parse_tokens(_BATCH.value):,} tokens"
          f" per step, {precision.name}")
    print(f"{result.considered:,} layouts considered, {len(result.ranked):,} fit,"
          f" {len(result.rejected):,} rejected ({time.perf_counter() - start:.2f} s)")
    print(f"{'#':>3}  {'tok/s/GPU':>10} {'MFU':>6} {'step s':>8} {'GB/GPU':>7}  layout")
    for i, c in enumerate(best, 1):
      print(f"{i:>3}  {c.time.tokens_per_s_per_gpu:>10,.0f} {c.time.mfu:>6.1%}"
            f" {c.time.step_s:>8.3f} {c.memory.total / estimate.GB:>7.1f}  {c.layout.string()}")
    print("rejected, by reason:")
    print("\n".join(planner.rejection_summary(result.rejected)))
  if not best:
    raise ValueError(f"no layout of {_MODEL.value} fits on {gpus} {hw.name} GPUs")
  path = _OUT.value or f"plan_{_MODEL.value}_{gpus}.py"
  if write_config(path, _MODEL.value, best[0].layout, _SEQ.value) and not _json():
    print(f"wrote {path}: meshtron train --config={path}")


def write_config(path: str, model: str, layout: sharding.layout.Layout, seq: int) -> bool:
  """A config file for `meshtron train` with the layout's mesh, batch and remat."""
  from configs import llama
  if model not in llama.MODELS:
    print(f"note: {model} is not a trainer preset yet; no config written", file=sys.stderr)
    return False
  mesh = ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(layout.mesh_config()).items()
                   if k not in ("dcn", "allow_tensor_across_hosts"))
  text = f'''"""{model} with the layout chosen by `meshtron plan`: {layout.string()}."""

from configs import llama
from sharding.mesh import MeshConfig


def get_config():
  cfg = llama.large({model!r})
  cfg.mesh = MeshConfig({mesh})
  cfg.seq_len = {seq}
  cfg.batch_size = {layout.global_batch}  # sequences per step: mbs x ga x data x fsdp x expert
  cfg.microbatches = {layout.microbatches}
  cfg.model.remat = {layout.remat!r}
  return cfg
'''
  with open(path, "w") as f:
    f.write(text)
  return True


def _json() -> bool:
  return bool(flags.FLAGS["json"].value)  # defined by trainer/main.py


def run(verb: str, config, config_given: bool) -> None:
  """Entry from trainer/main.py; ValueErrors become one-line errors there."""
  if verb == "memory":
    run_memory(config, config_given)
  else:
    run_plan()
