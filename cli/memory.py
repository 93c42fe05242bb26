"""`meshtron memory`: one layout's per-device memory breakdown and predicted step time
(analytic, no devices), as a table, JSON or a stacked-bar plot."""

import dataclasses
import json

from cli import flags
from cli.presets import model_by_name, precision_by_name
from sharding import layout_text as layouts
from sharding.plan import estimate, hardware, optimizer_cost, planner


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
  lines.append(f"predicted step {t.step_s:.3f} s (compute {t.compute_s:.3f}, of it memory-bound"
               f" {t.memory_bound_s:.3f}, bubble"
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


def run(config, config_given: bool) -> None:
  """The flags' layout (--model, --layout) or, without --model, the config's (--config)."""
  run_memory(config, config_given, model=flags.MODEL.value, layout=flags.LAYOUT.value,
             gpu=flags.GPU.value, seq=flags.SEQ.value, precision=flags.PRECISION.value,
             plot=flags.PLOT.value, gpus=flags.GPUS.value, as_json=flags.JSON.value,
             activations=flags.ACTIVATIONS.value)


def run_memory(config, config_given: bool, *, model: str, layout: str, gpu: str, seq: int,
               precision: str, plot: str, gpus: int, as_json: bool,
               activations: str = planner.PLANNER_FORMULA) -> None:
  """The memory breakdown and predicted step of one layout: of a preset `model` under `layout`,
  or of the TrainConfig `config` on `gpus` devices (default a node)."""
  hw = hardware.load_profile(gpu)
  if model:
    if config_given:  # its fields would be ignored
      raise ValueError("memory takes --model=NAME --layout=... or --config=PRESET|file.py with"
                       " --config.a.b=value overrides, not both")
    spec, lay = model_by_name(model), layouts.parse(layout)
    if lay.context > 1:  # the layout's cp_impl (plan writes allgather for pipeline x context)
      spec = dataclasses.replace(spec, context_impl=lay.context_impl)
    chosen, title = precision_by_name(precision), model
  else:
    if layout or not config_given:
      raise ValueError("memory needs --model=NAME --layout=... or --config=PRESET|file.py")
    spec = estimate.model_spec(config.model, config.compute)
    lay = config.layout(gpus or hw.gpus_per_node)
    chosen = config.precision()
    seq, title = config.seq_len, f"{config.model.num_params() / 1e9:.2f}B-parameter model"
  errors = planner.divisibility_errors(spec, lay, seq)
  if errors:
    raise ValueError(f"layout {lay.string()}: {'; '.join(errors)}")
  cand = planner.evaluate(spec, lay, seq, chosen, hw, formula=activations)
  extra = {}
  if not model:  # the config's optimizer and fp8 state (sharding/plan/optimizer_cost.py)
    mem = optimizer_cost.run_memory(spec, lay, seq, chosen, optimizer=config.optim.name,
                                    fp8=config.compute.fp8, formula=activations)
    cand = dataclasses.replace(cand, memory=mem, fits=mem.total <= hw.memory_bytes)
    if config.optim.name == "muon":
      cost = optimizer_cost.muon_newton_schulz(spec, lay, config.optim.muon_ns_steps)
      extra = {"muon_newton_schulz_tflop": cost.flops / 1e12,
               "muon_newton_schulz_wire_mb": cost.wire_bytes / 1e6}
  title = f"{title}, seq {seq}, {chosen.name}, {hw.name}"
  if as_json:
    print(json.dumps(dict(cand.summary(), model=title, **extra)))
  else:
    print(format_memory(cand, title, hw))
    if extra:
      print(f"Muon's Newton-Schulz per step and device: {extra['muon_newton_schulz_tflop']:.3f}"
            f" TFLOP, {extra['muon_newton_schulz_wire_mb']:.1f} MB sent (not in the step time)")
  if plot:
    plot_memory(cand, plot, title, hw)
    if not as_json:
      print(f"wrote {plot}")
