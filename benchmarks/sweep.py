"""The playbook's layout sweep in miniature: every layout of 8 fake CPU devices x micro-batches x
remat for a small model, measured (throughput, MFU, compiled memory, collectives) next to the
analytic prediction of sharding/plan/estimate.py + sharding/plan/hardware.py, written to CSV; plus the
scaling lines (each strategy on 1, 2, 4, 8 devices). Plot with `python -m benchmarks.plot_sweep`.

The layouts are a list of dicts (LAYOUTS below): adding a strategy is adding rows. Expert
parallelism needs a MoE, and the sweep's model is dense: its rows are written as `skipped` with
the reason (benchmarks/moe_vs_dense.py trains the MoE), so the CSV shows the whole playbook grid.
Pipeline rows with fewer microbatches than stages are `error` rows saying so (1F1B needs m >= p).

Fake devices share the machine's cores: the sweep measures what partitioning costs (collectives,
replicated work, smaller matmuls), not what more hardware gains. On a shared machine compare
tokens_per_cpu_s (tokens per CPU-second of this process), which other load moves far less than
tokens_per_s.

Usage: python -m benchmarks.sweep [--out benchmarks/results/sweep.csv] [--quick]
           [--model small --batch 32 --seq 128 --steps 4 --warmup 2] [--peak_file ...]
           [--layouts "fsdp=4,context=2;fsdp=4,pipeline=2"]  (only these; their rows replace
           the same rows of an existing --out, the others are kept)
"""

import argparse
import csv
import dataclasses
import math
import os

if __name__ == "__main__":  # before JAX starts: 8 fake CPU devices (a test keeps its own)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

from benchmarks import train_step  # noqa: E402

AXES = ("data", "pipeline", "fsdp", "expert", "context", "tensor")
SKIPPED = {"expert": "expert parallelism needs a MoE; the sweep's model is dense"
                      " (benchmarks/moe_vs_dense.py trains the MoE)"}
LAYOUTS = [
    dict(data=8), dict(data=8, zero_stage=1), dict(data=8, zero_stage=2),
    dict(data=8, zero_stage=3), dict(fsdp=8), dict(data=2, fsdp=4),
    dict(tensor=8), dict(tensor=8, sequence_parallel=True),
    dict(fsdp=4, tensor=2), dict(fsdp=4, tensor=2, sequence_parallel=True),
    dict(fsdp=2, tensor=4), dict(data=2, fsdp=2, tensor=2),
    # More of the same grid (add them for a longer sweep):
    # dict(data=4, fsdp=2), dict(data=4, tensor=2), dict(data=2, tensor=4),
    # dict(fsdp=2, tensor=4, sequence_parallel=True),
    # Context and pipeline parallelism (pipeline needs microbatches >= stages), expert (skipped):
    dict(fsdp=4, context=2), dict(fsdp=4, pipeline=2), dict(fsdp=4, expert=2),
    dict(data=2, tensor=2, pipeline=2),
]
# (micro-batches, remat) columns of the heatmap: the full product by default.
PAIRS = [(1, "none"), (1, "full"), (4, "none"), (4, "full")]
# The scaling lines: each strategy alone on 1, 2, 4 and 8 devices (1 device: the baseline).
SCALING_SIZES = (2, 4, 8)
FIELDS = ["kind", "layout", "devices", *AXES, "zero_stage", "sequence_parallel", "microbatches",
          "remat", "status", "reason", "tokens_per_s", "tokens_per_cpu_s", "step_s", "mfu",
          "compile_s",
          "mem_peak_gib", "mem_temp_gib", "mem_argument_gib", "collective_mib",
          "predicted_tokens_per_s", "predicted_step_s", "predicted_mem_gib", "other_cores",
          "load_average_1m"]


def devices_of(layout: dict) -> int:
  return math.prod(layout.get(a, 1) for a in AXES)


def cpu_profile(peak_flops: float, bandwidth: float, devices: int):
  """The analytic model's hardware profile for `devices` fake CPU devices sharing one machine:
  each gets 1/devices of the measured matmul peak and memory bandwidth; collectives are memory
  copies. No factor is fitted to the sweep."""
  from sharding.plan import hardware
  share = max(devices, 1)
  return dataclasses.replace(
      hardware.PROFILES["h100"], name=f"cpu/{share}", memory_bytes=24e9 / share,
      peak_bf16_flops=peak_flops / share, peak_fp8_flops=peak_flops / share,
      hbm_bandwidth=bandwidth / share, intra_node_bandwidth=bandwidth / share,
      inter_node_bandwidth=bandwidth / share, gpus_per_node=8, matmul_efficiency=0.5,
      intra_latency_s=20e-6, layer_overhead_s=200e-6)


def predict(cfg, devices: int, peak_flops: float, bandwidth: float) -> dict:
  """Analytic tokens/s, step time and per-device memory of `cfg` (issue [4]'s model)."""
  from sharding.plan import estimate, hardware
  layout = cfg.layout(devices)
  precision = estimate.trainer_precision(cfg.model.dtype, cfg.model.param_dtype)
  spec = estimate.model_spec(cfg.model, cfg.compute)
  mem = estimate.memory(spec, layout, cfg.seq_len, precision, workspace_bytes=0)
  # lockstep=False: the fake devices share the machine's cores, so a stage that waits for
  # another's longer operation in a tick leaves its cores to that stage.
  t = hardware.step_time(spec, layout, cfg.seq_len, precision,
                         cpu_profile(peak_flops, bandwidth, devices), lockstep=False,
                         uniform_matmuls=True)
  return dict(predicted_tokens_per_s=round(t.tokens_per_s_per_gpu * devices, 1),
              predicted_step_s=round(t.step_s, 5), predicted_mem_gib=round(mem.total / 2**30, 4))


def run_one(kind: str, layout: dict, microbatches: int, remat: str, args, peak, bandwidth):
  import jax
  row = dict(kind=kind, layout=train_step.layout_name(layout), devices=devices_of(layout),
             **{a: layout.get(a, 1) for a in AXES}, zero_stage=layout.get("zero_stage", 0),
             sequence_parallel=int(layout.get("sequence_parallel", False)),
             microbatches=microbatches, remat=remat, load_average_1m=round(os.getloadavg()[0], 2))
  missing = [SKIPPED[a] for a in SKIPPED if layout.get(a, 1) > 1]
  if missing:
    return dict(row, status="skipped", reason=", ".join(missing))
  cfg = train_step.make_config(args.model, layout, batch=args.batch, seq=args.seq, remat=remat,
                               dtype="float32", microbatches=microbatches,
                               steps=args.steps + args.warmup)
  try:
    row.update(predict(cfg, row["devices"], peak, bandwidth))
    result = train_step.measure(cfg, jax.devices()[:row["devices"]], steps=args.steps,
                                warmup=args.warmup, peak_flops=peak)
  except Exception as e:  # an invalid layout is a result too: keep going, record why
    return dict(row, status="error", reason=f"{type(e).__name__}: {str(e).splitlines()[0]}"[:300])
  mem = result["memory_gib_per_device"]
  return dict(row, status="ok", reason="", tokens_per_s=result["tokens_per_s"],
              tokens_per_cpu_s=round(result["tokens_per_s_mean"] / result["own_cores"], 1),
              step_s=result["step_s"], mfu=result["mfu"], compile_s=result["compile_s"],
              mem_peak_gib=mem["peak"], mem_temp_gib=mem["temp"],
              mem_argument_gib=mem["argument"], collective_mib=result["collective_mib_per_device"],
              other_cores=result["other_cores"])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                    "sweep.csv"))
  parser.add_argument("--model", default="small", choices=sorted(train_step.MODELS))
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--seq", type=int, default=128)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--warmup", type=int, default=1)
  parser.add_argument("--pairs", default=",".join(f"{m}:{r}" for m, r in PAIRS),
                      help="heatmap columns microbatches:remat, e.g. 1:none,4:full")
  parser.add_argument("--scaling_sizes", default=",".join(map(str, SCALING_SIZES)))
  parser.add_argument("--layouts", default="",
                      help="';'-separated layouts to (re)measure, merged into an existing --out")
  parser.add_argument("--quick", action="store_true",
                      help="3 layouts, microbatches 1, remat none, no scaling lines (tests)")
  parser.add_argument("--peak_file", default=os.path.join(os.path.dirname(__file__), "results",
                                                          "peak.jsonl"))
  args = parser.parse_args()
  from trainer.process import host_memory
  host_memory.reexec_with_tunables()  # the trainer's malloc settings (trainer/process/)
  from trainer.metrics import measure_matmul_flops
  peak = train_step.peak_from_file(args.peak_file, "float32") or \
      measure_matmul_flops("float32", 2048, 10)
  bandwidth = _bandwidth_from_file(args.peak_file) or 20e9
  pairs = [(int(p.split(":")[0]), p.split(":")[1]) for p in args.pairs.split(",")]
  sizes = [int(n) for n in args.scaling_sizes.split(",") if n]
  scaling = [dict(), *(dict([(axis, n)]) for axis in ("data", "fsdp", "tensor") for n in sizes)]
  layouts = LAYOUTS
  if args.quick:
    layouts, pairs, scaling = [LAYOUTS[4], LAYOUTS[8], LAYOUTS[12]], [(1, "none")], []
  kept = []
  if args.layouts:
    layouts = [train_step.parse_layout(text) for text in args.layouts.split(";")]
    scaling, names = [], {train_step.layout_name(lay) for lay in layouts}
    if os.path.exists(args.out):
      with open(args.out, newline="", encoding="utf-8") as old:
        kept = [r for r in csv.DictReader(old) if r["layout"] not in names]
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, FIELDS)
    writer.writeheader()
    writer.writerows(kept)
    jobs = [("sweep", lay, mb, r) for lay in layouts for mb, r in pairs]
    jobs += [("scaling", lay, 1, "none") for lay in scaling]
    for i, (kind, layout, mb, remat) in enumerate(jobs):
      row = run_one(kind, layout, mb, remat, args, peak, bandwidth)
      writer.writerow(row)
      f.flush()
      print(f"[{i + 1}/{len(jobs)}] {kind} {row['layout']} mb={mb} remat={remat}:"
            f" {row['status']} {row.get('tokens_per_s', '')} tok/s"
            f" (predicted {row.get('predicted_tokens_per_s', '')}) {row['reason']}", flush=True)
  print(f"wrote {args.out}")


def _bandwidth_from_file(path: str) -> float:
  import json
  if not os.path.exists(path):
    return 0.0
  rows = [json.loads(line) for line in open(path) if line.strip()]
  return max((r["gbytes_per_s"] for r in rows if r.get("benchmark") == "copy_bandwidth"),
             default=0.0) * 1e9


if __name__ == "__main__":
  main()
