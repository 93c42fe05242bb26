"""Exposed vs hidden collective bytes of the playbook's 8.86B model on 8 and 64 H100s
(deviceless compiles), per layout and XLA preset: compiled-program facts, not wall time.

A collective's bytes are "hidden" when XLA's schedule puts at least one kernel between its start
and done, "behind a matmul" when one of those kernels is matrix work; the rest is exposed. Each
line also counts the collectives per kind (combine thresholds change them) and the layer-loop
all-gathers issued one iteration ahead (FSDP prefetch). The last lines compare one
sequence-parallel MLP block at the model's sizes on tensor=8, with XLA's all-gather/reduce-
scatter and with the collective matmuls of sharding/collective_matmul.py.

  .venv/bin/python -m benchmarks.overlap [--only N] [--presets none,overlap_v1] [--no_block]
"""

import argparse
import dataclasses
import collections
import json
import os
import subprocess
import sys
import time

from configs import llama
from sharding.xla import compiled, hlo, overlap
from sharding.mesh import MeshConfig
from trainer.aot import compile_for_gpus

SEQ = 4096
BEFORE_AFTER = ("none", "overlap_v1")
BUCKETS = BEFORE_AFTER + ("overlap_unbucketed_v1", "overlap_bucketed_v1")
LAYOUTS = [  # (target, name, mesh, batch, remat, presets)
    ("h100x8", "fsdp=8", MeshConfig(data=1, fsdp=8), 8, "full", BUCKETS),
    ("h100x8", "fsdp=8, no remat", MeshConfig(data=1, fsdp=8), 8, "none",
     BEFORE_AFTER),
    ("h100x8", "fsdp=4 x tensor=2, sp",
     MeshConfig(data=1, fsdp=4, tensor=2, sequence_parallel=True), 8, "full", BEFORE_AFTER),
    ("h100x8", "tensor=8, sp", MeshConfig(data=1, tensor=8, sequence_parallel=True), 8, "full",
     BEFORE_AFTER),
    ("h100x8", "data=2 x fsdp=4", MeshConfig(data=2, fsdp=4), 8, "full", BEFORE_AFTER),
    ("h100x64", "fsdp=8 x tensor=8, sp", MeshConfig(data=1, fsdp=8, tensor=8,
                                                    sequence_parallel=True), 8, "full",
     BEFORE_AFTER),
    ("h100x64", "data=8 x fsdp=8", MeshConfig(data=8, fsdp=8), 64, "full", BEFORE_AFTER),
]


def config(mesh: MeshConfig, batch: int, remat: str, preset: str):
  cfg = llama.large("playbook_8b")
  cfg.mesh, cfg.batch_size, cfg.seq_len, cfg.xla_preset = mesh, batch, SEQ, preset
  cfg.model = dataclasses.replace(cfg.model, dtype="bfloat16", param_dtype="float32")
  cfg.compute = dataclasses.replace(cfg.compute, remat=remat)
  return cfg


def facts(rep: compiled.CompiledReport) -> dict:
  """The benchmark's numbers from one report (GiB = 2**30 bytes, per device per step)."""
  o, gib = rep.overlap, 2 ** 30
  loop_gathers = [c for c in rep.collectives if c["kind"] == "all-gather" and c["count"] > 1]
  exposed = sorted((c for c in rep.collectives if c["compute_between"] == 0),
                   key=lambda c: -c["total_wire_bytes"])
  return {
      "peak_gib": rep.memory["peak"] / gib, "temp_gib": rep.memory["temp"] / gib,
      "wire_gib": o["wire_bytes"] / gib, "hidden_gib": o["hidden_bytes"] / gib,
      "exposed_gib": o["exposed_bytes"] / gib, "hidden_fraction": o["hidden_fraction"],
      "behind_matmul_gib": o["matmul_hidden_bytes"] / gib,
      "behind_matmul_fraction": o["matmul_hidden_fraction"],
      "executions": {k: v["executions"] for k, v in rep.summary.items()},
      "ops": {k: v["ops"] for k, v in rep.summary.items()},
      "loop_all_gathers_prefetched": f"{sum(c['carried'] for c in loop_gathers)}"
                                     f"/{len(loop_gathers)}",
      "largest_exposed": [f"{c['kind']} {'x'.join(map(str, c['shape']))} x{c['count']}"
                          f" {c['total_wire_bytes'] / 2**20:.0f} MiB in"
                          f" {'a loop' if c['count'] > 1 else 'the step'}"
                          for c in exposed[:3]],
  }


def block(grad: bool, collective: bool) -> dict:
  """The SP MLP block x [1, 4096, 4096] -> [4096, 14336] -> [14336, 4096], bf16, on h100x8."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  args = ["h100x8", "8", "dims=1,4096,4096,14336"] + ["grad"] * grad + ["plain"] * (not collective)
  start = time.perf_counter()
  out = subprocess.run([sys.executable, "-m", "benchmarks.sp_mlp_block", *args], cwd=repo,
                       capture_output=True, text=True, check=True,
                       env={**env, "JAX_PLATFORMS": "cpu"}).stdout
  cols = hlo.collectives(out)
  rows = [dict(dataclasses.asdict(c), wire_bytes=c.wire_bytes, total_wire_bytes=c.total_wire_bytes)
          for c in cols]
  overlap.annotate(rows, out)
  o, mib = overlap.summarize(rows), 2 ** 20
  return {"block": "sp_mlp D=4096 F=14336 L=4096", "target": "h100x8", "tensor": 8,
          "pass": "fwd+bwd" if grad else "fwd",
          "matmuls": "collective matmul" if collective else "XLA all-gather/reduce-scatter",
          "collectives": dict(collections.Counter(c.kind for c in cols)),
          "wire_mib": o["wire_bytes"] / mib, "hidden_fraction": o["hidden_fraction"],
          "behind_matmul_fraction": o["matmul_hidden_fraction"],
          "exposed_mib": o["exposed_bytes"] / mib, "compile_s": time.perf_counter() - start}


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--only", type=int, default=-1, help="run one layout by index")
  parser.add_argument("--presets", default="", help="comma-separated; default: per layout")
  parser.add_argument("--no_block", action="store_true", help="skip the SP MLP block lines")
  args = parser.parse_args()
  for i, (target_name, name, mesh, batch, remat, presets) in enumerate(LAYOUTS):
    if args.only >= 0 and i != args.only:
      continue
    target = compiled.parse_gpu_target(target_name)
    for preset in (args.presets.split(",") if args.presets else presets):
      start = time.perf_counter()
      rep = compile_for_gpus(config(mesh, batch, remat, preset), target)
      print(json.dumps({
          "model": "playbook_8b", "target": target.name, "layout": name, "remat": remat,
          "batch": batch, "seq": SEQ, "preset": preset,
          "fits": bool(compiled.fits(rep, target.device_memory_bytes)[0]), **facts(rep),
          "compile_s": time.perf_counter() - start}), flush=True)
  if not args.no_block and args.only < 0:
    for grad in (False, True):
      for collective in (False, True):
        print(json.dumps(block(grad, collective)), flush=True)


if __name__ == "__main__":
  main()
