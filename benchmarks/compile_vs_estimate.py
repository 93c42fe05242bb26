"""Compiled per-device peak memory of the playbook's 8.86B model on 8 H100s (deviceless compile)
against the analytic estimate, one JSON line per layout.

The estimate uses the dtypes the trainer uses today: parameters, gradients and AdamW moments in
float32 (model.param_dtype), activations in bfloat16 (--config.model.dtype=bfloat16), no master
copy; it leaves out the CUDA/NCCL workspace allowance (the compiled peak has none).

  .venv/bin/python -m benchmarks.compile_vs_estimate [--only N]
"""

import argparse
import dataclasses
import json
import time

from configs import llama
from sharding.xla import compiled
from sharding.plan import estimate
from sharding.mesh import MeshConfig
from trainer.aot import compile_for_gpus

BATCH, SEQ = 8, 4096  # 8 sequences of 4096 tokens: one sequence per GPU per microbatch
LAYOUTS = [  # (name, mesh, microbatches, remat)
    ("fsdp=8", MeshConfig(data=1, fsdp=8), 1, "none"),
    ("fsdp=4 x tensor=2, sp", MeshConfig(data=1, fsdp=4, tensor=2, sequence_parallel=True), 2,
     "none"),
    ("tensor=8, sp", MeshConfig(data=1, tensor=8, sequence_parallel=True), 8, "none"),
    ("data=2 x fsdp=4, remat full", MeshConfig(data=2, fsdp=4), 1, "full"),
]


def config(mesh: MeshConfig, microbatches: int, remat: str):
  cfg = llama.large("playbook_8b")
  cfg.mesh, cfg.batch_size, cfg.seq_len, cfg.microbatches = mesh, BATCH, SEQ, microbatches
  cfg.model = dataclasses.replace(cfg.model, dtype="bfloat16", param_dtype="float32")
  cfg.compute = dataclasses.replace(cfg.compute, remat=remat)
  return cfg


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--only", type=int, default=-1, help="run one layout by index")
  args = parser.parse_args()
  target = compiled.parse_gpu_target("h100x8")
  for i, (name, mesh, microbatches, remat) in enumerate(LAYOUTS):
    if args.only >= 0 and i != args.only:
      continue
    cfg = config(mesh, microbatches, remat)
    layout = cfg.layout(target.num_devices)
    precision = estimate.trainer_precision(cfg.model.dtype, cfg.model.param_dtype)
    spec = estimate.model_spec(cfg.model, cfg.compute)
    est = estimate.memory(spec, layout, SEQ, precision, workspace_bytes=0)
    # The `compiled` activation formula (what meshtron's GPU programs keep) beside the default.
    by_program = estimate.memory(spec, layout, SEQ, precision, workspace_bytes=0,
                                 formula="compiled")
    start = time.perf_counter()
    rep = compile_for_gpus(cfg, target)
    seconds = time.perf_counter() - start
    peak = rep.memory["peak"]
    print(json.dumps({
        "model": "playbook_8b", "target": target.name, "layout": name,
        "estimator_layout": layout.string(), "compiled_peak_gb": peak / 1e9,
        "estimate_gb": est.total / 1e9, "ratio_estimate_over_compiled": est.total / peak,
        "compiled_argument_gb": rep.memory["argument"] / 1e9,
        "compiled_temp_gb": rep.memory["temp"] / 1e9,
        "estimate_state_gb": (est.params + est.optimizer) / 1e9,
        "estimate_breakdown_gb": {k: v / 1e9 for k, v in dataclasses.asdict(est).items()},
        "compiled_formula_gb": by_program.total / 1e9,
        "ratio_compiled_formula_over_compiled": by_program.total / peak,
        "compile_s": seconds}), flush=True)


if __name__ == "__main__":
  main()
