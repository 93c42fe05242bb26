"""fp8 under FSDP in the compiled program: the playbook's 8.86B Llama on 8 H100s (fsdp=8, bf16
compute, float32 master weights, full remat, 4096 tokens per sequence), bf16 against each fp8
recipe, one and two microbatches. Deviceless compiles: compiled-program facts (collective bytes
and counts, peak memory) and meshtron's step-time prediction (sharding/xla/step_time.py), not
wall time.

  .venv/bin/python -m benchmarks.fp8_fsdp [--recipes bf16,tensorwise] [--microbatches 1,2]
      [--xla_options xla_gpu_enable_triton_gemm=false]

One JSON line per (recipe, microbatches); "vs_bf16" divides by the bf16 line of the same
microbatches. benchmarks/results/fp8_fsdp.jsonl holds the last full run.
"""

import argparse
import dataclasses
import json
import time

from configs import llama
from models.fp8.config import Fp8Config
from sharding.mesh import MeshConfig
from sharding.xla import compiled
from trainer.aot import compile_for_gpus

SEQ = 4096
RECIPES = ("bf16", "delayed", "tensorwise", "rowwise", "blockwise")


def config(recipe: str, microbatches: int, xla_options: str = ""):
  cfg = llama.large("playbook_8b")
  cfg.xla_options = xla_options
  cfg.mesh, cfg.batch_size, cfg.seq_len = MeshConfig(data=1, fsdp=8), 8 * microbatches, SEQ
  cfg.microbatches = microbatches
  fp8 = Fp8Config() if recipe == "bf16" else Fp8Config(enabled=True, recipe=recipe)
  cfg.model = dataclasses.replace(cfg.model, dtype="bfloat16", param_dtype="float32")
  cfg.compute = dataclasses.replace(cfg.compute, remat="full", fp8=fp8)
  return cfg


def facts(rep: compiled.CompiledReport) -> dict:
  """Per device per step: GiB by collective kind and dtype, executions, peak, prediction."""
  gib, wire = 2 ** 30, {}
  for c in rep.collectives:
    key = f"{c['kind']} {c['dtype']}"
    wire[key] = wire.get(key, 0.0) + c["total_wire_bytes"] / gib
  return {"peak_gib": rep.memory["peak"] / gib, "wire_gib": wire,
          "executions": {k: v["executions"] for k, v in rep.summary.items()},
          "predicted_step_s": rep.step_time.get("step_s"),
          "predicted_tokens_per_s_per_gpu": rep.step_time.get("tokens_per_s_per_gpu")}


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--recipes", default=",".join(RECIPES))
  parser.add_argument("--microbatches", default="1,2")
  parser.add_argument("--xla_options", default="",
                      help="e.g. xla_gpu_enable_triton_gemm=false: cuBLASLt fp8 GEMMs")
  args = parser.parse_args()
  target = compiled.parse_gpu_target("h100x8")
  for microbatches in map(int, args.microbatches.split(",")):
    bf16 = None
    for recipe in args.recipes.split(","):
      start = time.perf_counter()
      row = facts(compile_for_gpus(config(recipe, microbatches, args.xla_options), target))
      if recipe == "bf16":
        bf16 = row
      elif bf16 is not None:
        row["vs_bf16"] = {
            "all_gather_bytes": sum(v for k, v in row["wire_gib"].items()
                                    if k.startswith("all-gather"))
                                / sum(v for k, v in bf16["wire_gib"].items()
                                      if k.startswith("all-gather")),
            "peak": row["peak_gib"] / bf16["peak_gib"],
            "predicted_step": row["predicted_step_s"] / bf16["predicted_step_s"]}
      print(json.dumps({"model": "playbook_8b", "target": target.name, "layout": "fsdp=8",
                        "recipe": recipe, "microbatches": microbatches, "seq": SEQ,
                        "xla_options": args.xla_options, **row,
                        "compile_s": time.perf_counter() - start}), flush=True)


if __name__ == "__main__":
  main()
