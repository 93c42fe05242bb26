"""Measures the train step for one config and layout; prints one JSON line per run.

Compile time (AOT, no persistent cache), steady step time (median over --steps steps after
--warmup, each ended by `block_until_ready`), tokens/s, model FLOP/s (`flops_per_token`: 6N +
causal attention, the trainer's own MFU numerator), MFU against the measured matmul peak of the
same dtype, per-device memory of the compiled program, and the CPU used by other processes
during the timed window (so a contended measurement says so), and the process's page faults per
timed step (fresh host memory; trainer/process/host_memory.py). Optional `jax.profiler` trace. From the
command line it runs under the trainer's malloc settings, like `meshtron`.

Usage:
  python -m benchmarks.train_step --model=100m --devices=8 --layout=fsdp=4,tensor=2 \
      [--batch=8 --seq=256 --remat=none --dtype=float32 --microbatches=1 --steps=10 --warmup=3]
      [--layers=N] [--steps=0: compile only] [--peak_file=benchmarks/results/peak.jsonl]
      [--trace=DIR] [--label=NAME]
"""

import argparse
import dataclasses
import json
import os
import resource
import statistics
import time

# Model presets of the benchmarks (exact dims are part of every JSON line). "tiny" and "100m" use
# the 32000-token vocabulary of MaxText's synthetic-data defaults, so both trainers run the same
# model; "debug" is meshtron's byte-vocabulary preset. All multi-head (kv heads = heads), untied.
MODELS = {
    "debug": dict(vocab_size=264, embed_dim=128, num_layers=4, num_heads=4, num_kv_heads=2,
                  head_dim=32, mlp_dim=384),
    # The sweep's model: every dim divides 8, so any layout of 8 devices is valid.
    "small": dict(vocab_size=512, embed_dim=256, num_layers=4, num_heads=8, num_kv_heads=8,
                  head_dim=32, mlp_dim=1024),
    "tiny": dict(vocab_size=32_000, embed_dim=256, num_layers=4, num_heads=4, num_kv_heads=4,
                 head_dim=64, mlp_dim=1024),
    "100m": dict(vocab_size=32_000, embed_dim=768, num_layers=8, num_heads=12, num_kv_heads=12,
                 head_dim=64, mlp_dim=2048),
}


def parse_layout(text: str) -> dict:
  """"fsdp=4,tp=2,sp=1" -> {"fsdp": 4, "tensor": 2, "sequence_parallel": True}: the mesh config
  fields that differ from one device (sharding.layout_text.parse: mesh names or the dp/tp/...
  aliases, one-line errors); "" -> {}."""
  import sharding.layout
  import sharding.layout_text
  from sharding.mesh import MeshConfig
  layout, default = sharding.layout_text.parse(text), sharding.layout.Layout()
  fields = {f.name for f in dataclasses.fields(MeshConfig)}
  return {k: v for k, v in dataclasses.asdict(layout).items()
          if k in fields and v != getattr(default, k)}


def layout_name(layout: dict) -> str:
  """{"fsdp": 4, "tensor": 2} -> "fsdp=4,tensor=2"; {} -> "single"."""
  parts = [f"{k}={v}" for k, v in layout.items()
           if k not in ("zero_stage", "sequence_parallel") and v != 1]
  if layout.get("zero_stage"):
    parts.append(f"zero={layout['zero_stage']}")
  if layout.get("sequence_parallel"):
    parts.append("sp")
  return ",".join(parts) or "single"


def make_config(model: str, layout: dict, *, batch: int, seq: int, remat: str, dtype: str,
                microbatches: int = 1, layers: int = 0, steps: int = 100):
  """The TrainConfig of a benchmark run: synthetic data, no persistent compile cache."""
  from models import ComputeConfig, ModelConfig
  from sharding.mesh import MeshConfig
  from trainer.config import DataConfig, TrainConfig
  dims = dict(MODELS[model], **({"num_layers": layers} if layers else {}))
  return TrainConfig(
      model=ModelConfig(**dims, dtype=dtype), compute=ComputeConfig(remat=remat),
      mesh=MeshConfig(**{"data": 1, **layout}), batch_size=batch, seq_len=seq,
      microbatches=microbatches, steps=max(steps, 1), data=DataConfig(source="synthetic"),
      compilation_cache_dir="", sample_tokens=0, eval_every=10**9)


def peak_from_file(path: str, dtype: str) -> float:
  """The best measured matmul FLOP/s of `dtype` in a peak.py JSON-lines file (0 if none)."""
  if not path or not os.path.exists(path):
    return 0.0
  rows = [json.loads(line) for line in open(path) if line.strip()]
  best = [r["gflops"] for r in rows if r.get("benchmark") == "matmul_peak" and r["dtype"] == dtype]
  return max(best, default=0.0) * 1e9


def _busy_cpu_s() -> float:
  """CPU seconds the whole machine has spent busy (all processes), from /proc/stat."""
  try:
    values = list(map(int, open("/proc/stat").readline().split()[1:]))
  except OSError:
    return float("nan")
  return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


def summarize_trace(trace_dir: str, steps: int, wall_s: float, top: int = 12) -> dict:
  """Per-step time of the compiled program's ops by kind (HLO op name without its number) from
  the XLA:CPU threads of a `jax.profiler` trace, and how busy those threads were."""
  import glob
  import jax
  paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
  if not paths:
    return {}
  by_kind, busy, threads = {}, 0.0, 0
  for plane in jax.profiler.ProfileData.from_file(paths[-1]).planes:
    for line in plane.lines:
      if not line.name.startswith("tf_XLAEigen"):
        continue
      threads += 1
      for event in line.events:
        name = event.name
        # Container ops (their bodies are traced too) and executor bookkeeping are not work.
        if name.startswith(("Thunk", "Threadpool", "end: ", "while", "call", "conditional")):
          continue
        kind = name.rsplit(".", 1)[0] if name.rsplit(".", 1)[-1].isdigit() else name
        by_kind[kind] = by_kind.get(kind, 0.0) + event.duration_ns / 1e6 / steps
        busy += event.duration_ns / 1e9
  ranked = sorted(by_kind.items(), key=lambda kv: -kv[1])[:top]
  return {"op_ms_per_step": {k: round(v, 2) for k, v in ranked},
          "xla_threads": threads, "xla_threads_busy": round(busy / max(wall_s, 1e-9), 2)}


def wait_idle(seconds: float, cores: float = 0.25) -> float:
  """Waits (up to `seconds`) until other processes use fewer than `cores` cores over 3 s;
  returns the last measured load in cores."""
  deadline, busy = time.monotonic() + seconds, float("nan")
  while True:
    start = _busy_cpu_s()
    time.sleep(3)
    busy = (_busy_cpu_s() - start) / 3
    if busy < cores or time.monotonic() > deadline:
      return busy


def measure(cfg, devices=None, *, steps: int, warmup: int, peak_flops: float,
            trace_dir: str = "", hlo_path: str = "", after_trace_dir: str = "") -> dict:
  """Compiles and runs `cfg`; returns the measurement (see the module docstring). On a GPU with
  a built-in profile it also predicts the step from the compiled program (`predicted`, as
  `meshtron compile` does). `hlo_path` keeps the compiled program's text (gzip);
  `after_trace_dir` traces two more steps after the timed ones (the timing stays untraced)."""
  import jax
  from trainer.trainer import Trainer
  trainer = Trainer(cfg, devices)
  rep = trainer.compile()
  n = trainer.mesh.devices.size
  out = {"num_devices": n, "params_m": round(cfg.model.num_params() / 1e6, 3),
         "compile_s": round(rep.compile_seconds, 3),
         "memory_gib_per_device": {k: round(v / 2**30, 4) for k, v in rep.memory.items()},
         "collective_mib_per_device": round(rep.wire_bytes / 2**20, 3),
         "xla_flops_per_device": rep.flops}
  out.update(_predicted(cfg, trainer, rep, hlo_path))
  if steps <= 0:
    return out
  trainer.init_state()
  batches = trainer.iterator("train")
  times = []
  with trainer.scope():
    batch = trainer.to_device(next(batches))
    cpu0 = wall0 = busy0 = 0.0
    for i in range(warmup + steps):
      if i == warmup:
        cpu0, wall0, busy0 = time.process_time(), time.perf_counter(), _busy_cpu_s()
        faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        if trace_dir:
          jax.profiler.start_trace(trace_dir)
      start = time.perf_counter()
      trainer.state, metrics = trainer.compiled_step(trainer.state, batch)
      batch = trainer.to_device(next(batches))  # the next batch is prepared while the step runs
      jax.block_until_ready((trainer.state, metrics))
      times.append(time.perf_counter() - start)
    cpu, wall, busy = (time.process_time() - cpu0, time.perf_counter() - wall0,
                       _busy_cpu_s() - busy0)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    if trace_dir:
      jax.profiler.stop_trace()
      out["trace"] = summarize_trace(trace_dir, steps, wall)
    if after_trace_dir:
      jax.profiler.start_trace(after_trace_dir)
      for _ in range(2):
        trainer.state, metrics = trainer.compiled_step(trainer.state, batch)
      jax.block_until_ready((trainer.state, metrics))
      jax.profiler.stop_trace()
  timed = times[warmup:]
  step_s, step_s_mean = statistics.median(timed), statistics.fmean(timed)
  tokens = cfg.batch_size * cfg.seq_len
  model_flops = cfg.model.flops_per_token(cfg.seq_len) * tokens / step_s
  out.update(
      step_s=round(step_s, 5), step_s_mean=round(step_s_mean, 5),
      step_s_min=round(min(timed), 5), step_s_max=round(max(timed), 5),
      first_step_s=round(times[0], 4), tokens_per_s=round(tokens / step_s, 1),
      tokens_per_s_mean=round(tokens / step_s_mean, 1),
      model_gflops_per_s=round(model_flops / 1e9, 2),
      mfu=round(model_flops / peak_flops, 4) if peak_flops else None,
      loss=float(metrics["loss"]), own_cores=round(cpu / wall, 2),
      other_cores=round(max(0.0, (busy - cpu) / wall), 2),
      page_faults_per_step=round(faults / steps))
  return out


def _predicted(cfg, trainer, rep, hlo_path: str) -> dict:
  """The step predicted from the compiled program (sharding/xla/step_time.py), where the device
  has a built-in hardware profile and the program was scheduled (GPUs); {} elsewhere."""
  import gzip
  from sharding.plan import hardware
  from sharding.xla import step_time
  devices = list(trainer.mesh.devices.flat)
  text = trainer.compiled_step.as_text() if hlo_path or rep.is_scheduled else ""
  if hlo_path:
    with gzip.open(hlo_path, "wt") as f:
      f.write(text)
  profile = hardware.profile_of_device(getattr(devices[0], "device_kind", ""))
  if profile is None or not rep.is_scheduled:
    return {}
  tokens = cfg.batch_size * cfg.seq_len
  try:
    summary = step_time.predict(text, profile).summary(
        tokens, cfg.model.flops_per_token(cfg.seq_len) * tokens, len(devices),
        profile.peak_bf16_flops)
  except Exception as e:  # noqa: BLE001  (a failed prediction must not lose the measurement)
    return {"predicted": {"error": f"{type(e).__name__}: {str(e)[:300]}"}}
  summary["top_ops"] = [{k: op[k] for k in ("name", "kind", "total_s", "flops", "bytes")}
                        for op in summary["top_ops"][:6]]
  return {"predicted": dict(summary, profile=profile.name)}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="tiny", choices=sorted(MODELS))
  parser.add_argument("--layers", type=int, default=0, help="override the number of layers")
  parser.add_argument("--layout", default="", help="e.g. fsdp=4,tensor=2,sp=1 (default 1 device)")
  parser.add_argument("--devices", type=int, default=0,
                      help="fake CPU devices (default: the layout's product)")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=256)
  parser.add_argument("--microbatches", type=int, default=1)
  parser.add_argument("--remat", default="none")
  parser.add_argument("--dtype", default="float32")
  parser.add_argument("--steps", type=int, default=10, help="timed steps (0: compile only)")
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--peak_file", default="", help="peak.py output (else measured here)")
  parser.add_argument("--trace", default="", help="write a jax.profiler trace of the timed steps")
  parser.add_argument("--label", default="")
  parser.add_argument("--wait_idle", type=float, default=0,
                      help="first wait up to this many seconds for other load to leave the CPUs")
  args = parser.parse_args(argv)
  from trainer.process import host_memory
  if argv is None:  # a command line, not a test calling main(): measure with the trainer's malloc
    host_memory.reexec_with_tunables()
  layout = parse_layout(args.layout)
  devices = args.devices or max(1, _product(layout))
  # Before JAX starts: fake devices share the machine's cores.
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={devices}").strip()
  import jax
  from trainer.metrics import measure_matmul_flops
  peak_source = "peak_file"
  peak = peak_from_file(args.peak_file, args.dtype)
  if not peak:
    peak, peak_source = measure_matmul_flops(args.dtype, 2048, 10), "measured in-process"
  cfg = make_config(args.model, layout, batch=args.batch, seq=args.seq, remat=args.remat,
                    dtype=args.dtype, microbatches=args.microbatches, layers=args.layers,
                    steps=args.warmup + args.steps)
  idle = round(wait_idle(args.wait_idle), 2) if args.wait_idle else None
  load = os.getloadavg()[0]
  result = measure(cfg, jax.devices()[:devices], steps=args.steps, warmup=args.warmup,
                   peak_flops=peak, trace_dir=args.trace)
  print(json.dumps({
      "benchmark": "train_step", "label": args.label, "trainer": "meshtron", "model": args.model,
      "dims": {k: getattr(cfg.model, k) for k in MODELS["tiny"]}, "layout": layout_name(layout),
      "batch": args.batch, "seq": args.seq, "microbatches": args.microbatches,
      "remat": args.remat, "dtype": args.dtype, **result,
      "peak_gflops": round(peak / 1e9, 1), "peak_source": peak_source,
      "busy_cores_before": idle, "load_average_1m_before": round(load, 2), "load_average_1m": round(os.getloadavg()[0], 2),
      "steps_timed": args.steps}), flush=True)


def _product(layout: dict) -> int:
  n = 1
  for key in ("data", "pipeline", "fsdp", "expert", "context", "tensor"):
    n *= layout.get(key, 1)
  return n


if __name__ == "__main__":
  main()
