"""Prints one JSON line per train-step program: a hash of its optimized HLO without source
locations (`sharding.xla.hlo.without_source_info`) or the module's name, for checking that a
refactor leaves every compiled program unchanged. Run it before and after, then compare:

  python benchmarks/program_hashes.py > before.jsonl   # (on the old commit)
  python benchmarks/program_hashes.py --compare before.jsonl

The programs: the 15 named layouts of tests/test_parallel.py, plus a pipeline (1F1B), context
parallelism (ring), MoE expert parallelism (dropless and dropping), fp8 and the Pallas flash +
chunked-loss step, on 8 fake CPU devices (built with the test suite's LLVM -O0, whose HLO is
the default build's: tests/test_layout_programs.py); and three bf16 programs compiled deviceless
for 8 H100s (the gpu-aot extra), where "auto" choices resolve for the GPU: attention "auto" (the
Pallas flash kernel) at fsdp=8, the dropless MoE's "auto" exchange (ragged all-to-all) at
expert=8, and a pipeline stage's "auto" attention (the XLA reference) at pipeline=2 x fsdp=4.
Tracebacks are kept out of MLIR locations (JAX_TRACEBACK_IN_LOCATIONS_LIMIT=0): the serialized
Pallas kernels would otherwise carry the source files' paths and line numbers.
"""

import argparse
import dataclasses
import hashlib
import json
import os
import re
import sys
import tempfile

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["JAX_TRACEBACK_IN_LOCATIONS_LIMIT"] = "0"  # also for the GPU compiles' subprocesses
os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

from models import ComputeConfig  # noqa: E402
from models.config import MoEConfig  # noqa: E402
from models.fp8.config import Fp8Config  # noqa: E402
from sharding import MeshConfig  # noqa: E402
from sharding.xla import compiled, hlo  # noqa: E402
from tests import parallel_harness as harness  # noqa: E402
from tests.test_parallel import LAYOUTS  # noqa: E402
from trainer.aot import compile_for_gpus  # noqa: E402

MOE = MoEConfig(num_experts=8, experts_per_token=2, expert_mlp_dim=32, num_shared_experts=1,
                first_dense_layers=1, router="sigmoid", bias_update_rate=0.01,
                dispatch="dropless")


def programs() -> dict:
  """name -> (MeshConfig, harness.compile_step keyword arguments)."""
  out = dict(LAYOUTS)
  out["pipeline=2,1f1b,data=4"] = (MeshConfig(data=4, pipeline=2, pipeline_schedule="1f1b"),
                                   dict(microbatches=8))
  out["context=4,data=2"] = (MeshConfig(data=2, context=4), {})
  out["expert=4,fsdp=2,dropless"] = (MeshConfig(data=1, expert=4, fsdp=2), dict(moe=MOE))
  out["expert=8,dropping"] = (MeshConfig(data=1, expert=8),
                              dict(moe=dataclasses.replace(MOE, dispatch="dropping")))
  out["fsdp=8,fp8"] = (MeshConfig(data=1, fsdp=8),
                       dict(compute=dataclasses.replace(harness.COMPUTE, fp8=Fp8Config(True))))
  out["data=2,fsdp=2,tensor=2,flash,chunked"] = (
      MeshConfig(data=2, fsdp=2, tensor=2),
      dict(compute=ComputeConfig(attention_impl="pallas_flash", loss_impl="chunked",
                                 loss_chunk_size=4), microbatches=2))
  return out


def gpu_programs() -> dict:
  """name -> (MeshConfig, harness.config keyword arguments) of the bf16 programs for h100x8."""
  bf16, auto = dataclasses.replace(harness.MODEL, dtype="bfloat16"), ComputeConfig()
  return {
      "h100x8:fsdp=8,auto_attention": (MeshConfig(data=1, fsdp=8),
                                       dict(model=bf16, compute=auto)),
      "h100x8:expert=8,dropless,auto_exchange": (
          MeshConfig(data=1, expert=8),
          dict(model=bf16, compute=auto, moe=dataclasses.replace(MOE, exchange="auto"))),
      "h100x8:pipeline=2,fsdp=4,auto_attention": (MeshConfig(data=1, pipeline=2, fsdp=4),
                                                  dict(model=bf16, compute=auto,
                                                       microbatches=4)),
  }


def gpu_program_text(mesh_cfg, options) -> str:
  """The optimized HLO of a program compiled deviceless for 8 H100s."""
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "program.hlo")
    compile_for_gpus(harness.config(mesh_cfg, **options), compiled.parse_gpu_target("h100x8"),
                     hlo_path=path)
    with open(path) as f:
      return f.read()


def program_hash(text: str) -> str:
  text = re.sub(r"^HloModule \S+", "HloModule", hlo.without_source_info(text), flags=re.M)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--compare", default="", help="a previous run's output: report changes")
  args = parser.parse_args()
  before = {}
  if args.compare:
    before = {r["program"]: r["hash"] for r in map(json.loads, open(args.compare)) if r}
  changed = []
  texts = [(name, lambda m=mesh_cfg, o=options: harness.compile_step(m, **o).as_text())
           for name, (mesh_cfg, options) in programs().items()]
  texts += [(name, lambda m=mesh_cfg, o=options: gpu_program_text(m, o))
            for name, (mesh_cfg, options) in gpu_programs().items()]
  for name, text in texts:
    digest = program_hash(text())
    row = {"program": name, "hash": digest}
    if before:
      row["same"] = before.get(name) == digest
      if not row["same"]:
        changed.append(name)
    print(json.dumps(row), flush=True)
  if args.compare:
    print(json.dumps({"compared": len(before), "changed": changed}), flush=True)
    sys.exit(1 if changed else 0)


if __name__ == "__main__":
  main()
