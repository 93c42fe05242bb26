"""Context parallelism's four attentions on compiled train steps: per-device temporaries, and the
collectives per step (bytes and executions by kind), one JSON line per (target, impl).

Ring (zig-zag), all-gather, Ulysses over all 8 devices and the USP hybrid (ring 2 x Ulysses 4)
on context=8, for the Llama-3.2-1B preset (32 heads, 8 kv heads, head dim 64; bf16 compute,
float32 state) at one sequence of --seq tokens a step, remat full: on 8 CPU devices (attention
"auto" is the XLA reference there) and for 8 H100s compiled without a GPU (`auto` is the Pallas
flash kernel; the ring and the hybrid attend each block with kernels/ring_attention's own jnp
block attention on every platform). Each line also has the analytic model's context bytes and,
for a GPU target, the step time sharding/xla/step_time.py predicts from the scheduled program.

  .venv/bin/python -m benchmarks.context_parallel [--targets cpu,h100x8] [--seq 32768]
"""

import argparse
import dataclasses
import json
import os
import sys

IMPLS = (("ring", 0), ("allgather", 0), ("ulysses", 0), ("ulysses_ring", 4))
GIB = 2 ** 30


def config(impl: str, degree: int, seq: int):
  from configs import llama
  from sharding import MeshConfig
  cfg = llama.large("llama3_1b")
  cfg.mesh, cfg.batch_size, cfg.seq_len = MeshConfig(data=1, context=8), 1, seq
  cfg.model = dataclasses.replace(cfg.model, param_dtype="float32")
  cfg.compute = dataclasses.replace(cfg.compute, context_impl=impl, ulysses_degree=degree,
                                    remat="full")
  return cfg


def analytic(cfg) -> dict:
  """{kind: bytes per step} of the analytic model's context-parallel collectives."""
  from sharding.plan import estimate, hardware
  layout = cfg.layout(8)
  precision = estimate.trainer_precision(cfg.model.dtype, cfg.model.param_dtype)
  return {c.kind: c.payload * c.count for c in
          hardware.collectives(estimate.model_spec(cfg.model, cfg.compute), layout, cfg.seq_len,
                               precision) if c.phase == "context"}


def line(target: str, impl: str, degree: int, cfg, rep) -> dict:
  return {"target": target, "impl": impl, "ulysses_degree": degree, "seq": cfg.seq_len,
          "model": "llama3_1b", "remat": cfg.compute.remat,
          "temp_gib": rep.memory["temp"] / GIB, "peak_gib": rep.memory["peak"] / GIB,
          "collectives": {kind: {"executions": s["executions"],
                                 "payload_mib": s["payload_bytes"] / 2 ** 20,
                                 "wire_mib": s["wire_bytes"] / 2 ** 20}
                          for kind, s in rep.summary.items()},
          "analytic_context_mib": {k: v / 2 ** 20 for k, v in analytic(cfg).items()},
          # GPU programs: sharding/xla/step_time.py's prediction from the scheduled HLO (a model,
          # not a measurement); None on CPU.
          "predicted_step_s": rep.step_time.get("step_s"),
          "predicted_exposed_communication_s": rep.step_time.get("exposed_communication_s"),
          "compile_s": rep.compile_seconds}


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--targets", default="cpu,h100x8")
  parser.add_argument("--seq", type=int, default=32768)
  args = parser.parse_args()
  targets = args.targets.split(",")
  if "cpu" in targets:  # 8 fake CPU devices, set before JAX starts
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
  from sharding.xla import compiled
  from trainer.aot import compile_for_gpus, compile_locally
  for target in targets:
    for impl, degree in IMPLS:
      cfg = config(impl, degree, args.seq)
      if target == "cpu":
        import jax
        rep = compile_locally(cfg, "cpu", jax.devices()[:8])
      else:
        rep = compile_for_gpus(cfg, compiled.parse_gpu_target(target))
      print(json.dumps(line(target, impl, degree, cfg, rep)), flush=True)


if __name__ == "__main__":
  sys.exit(main())
