"""Prints one JSON line per train-step program: a hash of its optimized HLO without source
locations (`sharding.xla.hlo.without_source_info`) or the module's name, for checking that a
refactor leaves every compiled program unchanged. Run it before and after, then compare:

  python -m benchmarks.program_hashes > before.jsonl   # (on the old commit)
  python -m benchmarks.program_hashes --compare before.jsonl

The programs: the 15 named layouts of the layout matrix (tests/test_parallel.py, whose model and
run are tests/parallel_harness.py; tests/test_benchmarks.py checks that the copies here equal
them), plus a pipeline (1F1B), context parallelism (ring), MoE expert parallelism (dropless and
dropping), fp8 and the Pallas flash + chunked-loss step, on 8 fake CPU devices (built with the
test suite's LLVM -O0, whose HLO is the default build's: tests/test_layout_programs.py); and
three bf16 programs compiled deviceless for 8 H100s (the gpu-aot extra), where "auto" choices
resolve for the GPU: attention "auto" (the Pallas flash kernel) at fsdp=8, the dropless MoE's
"auto" exchange (ragged all-to-all) at expert=8, and a pipeline stage's "auto" attention (the XLA
reference) at pipeline=2 x fsdp=4. Tracebacks are kept out of MLIR locations
(JAX_TRACEBACK_IN_LOCATIONS_LIMIT=0): the serialized Pallas kernels would otherwise carry the
source files' paths and line numbers.
"""

import argparse
import dataclasses
import hashlib
import json
import os
import re
import sys
import tempfile

if __name__ == "__main__":  # before JAX starts; an importing test keeps its own settings
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["JAX_TRACEBACK_IN_LOCATIONS_LIMIT"] = "0"  # also for the GPU compiles' subprocesses
  os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8"
                             " --xla_backend_optimization_level=0")

from models import ComputeConfig, ModelConfig  # noqa: E402
from models.config import MoEConfig  # noqa: E402
from models.fp8.config import Fp8Config  # noqa: E402
from sharding import MeshConfig  # noqa: E402
from sharding.xla import compiled, hlo  # noqa: E402
from trainer.aot import compile_for_gpus  # noqa: E402
from trainer.config import DataConfig, OptimConfig, TrainConfig  # noqa: E402

# The layout matrix's run (tests/parallel_harness.py): every dim divides every mesh size up to 8.
MODEL = ModelConfig(vocab_size=264, embed_dim=32, num_layers=2, num_heads=16, num_kv_heads=8,
                    head_dim=8, mlp_dim=64)
COMPUTE = ComputeConfig(attention_impl="xla")
BATCH, SEQ, STEPS = 32, 16, 3
OPTIM = OptimConfig(learning_rate=1e-2, warmup_steps=0, weight_decay=0.1)
MOE = MoEConfig(num_experts=8, experts_per_token=2, expert_mlp_dim=32, num_shared_experts=1,
                first_dense_layers=1, router="sigmoid", bias_update_rate=0.01,
                dispatch="dropless")


def config(mesh_cfg: MeshConfig, *, microbatches: int = 1, remat: str = "none",
           model: ModelConfig = MODEL, moe: MoEConfig | None = None,
           compute: ComputeConfig = COMPUTE) -> TrainConfig:
  """The TrainConfig of a program (tests/parallel_harness.config's); `moe` makes it a MoE."""
  cfg = TrainConfig(model=model, compute=dataclasses.replace(compute, remat=remat),
                    mesh=mesh_cfg, optim=OPTIM, data=DataConfig(source="synthetic"),
                    batch_size=BATCH, seq_len=SEQ, microbatches=microbatches, steps=STEPS)
  if moe is not None:
    cfg.model = dataclasses.replace(cfg.model, moe=moe)
    # Pure expert parallelism keeps the dense weights whole on every device by design.
    cfg.max_replicated_fraction = 1.0
  return cfg


def _mesh(**sizes) -> MeshConfig:
  return MeshConfig(**{"data": 1, **sizes})


# The 15 named layouts of the layout matrix (tests/test_parallel.LAYOUTS): (mesh, options).
LAYOUTS = {
    "data=8": (_mesh(data=8), {}),
    "fsdp=8": (_mesh(fsdp=8), {}),
    "data=2,fsdp=4": (_mesh(data=2, fsdp=4), {}),
    "tensor=8": (_mesh(tensor=8), {}),
    "fsdp=2,tensor=4": (_mesh(fsdp=2, tensor=4), {}),
    "fsdp=2,tensor=4,sp": (_mesh(fsdp=2, tensor=4, sequence_parallel=True), {}),
    "data=2,fsdp=2,tensor=2": (_mesh(data=2, fsdp=2, tensor=2), {}),
    "fsdp=8,vocab_over_fsdp": (_mesh(fsdp=8, vocab_over_fsdp="on"), {}),
    "fsdp=4,tensor=2,sp,vocab_over_fsdp": (
        _mesh(fsdp=4, tensor=2, sequence_parallel=True, vocab_over_fsdp="on"), {}),
    "data=8,zero=1": (_mesh(data=8, zero_stage=1), {}),
    "data=8,zero=2": (_mesh(data=8, zero_stage=2), {}),
    "data=8,zero=3": (_mesh(data=8, zero_stage=3), {}),
    "data=2,fsdp=2,tensor=2,ga=4,remat=full": (_mesh(data=2, fsdp=2, tensor=2),
                                               dict(microbatches=4, remat="full")),
    "data=8,zero=2,ga=4": (_mesh(data=8, zero_stage=2), dict(microbatches=4)),
    "fsdp=2,tensor=4,sp,ga=4,remat=full": (_mesh(fsdp=2, tensor=4, sequence_parallel=True),
                                           dict(microbatches=4, remat="full")),
}


def cpu_table() -> dict:
  """name -> (MeshConfig, `config` keyword arguments) of the programs on 8 CPU devices."""
  out = dict(LAYOUTS)
  out["pipeline=2,1f1b,data=4"] = (MeshConfig(data=4, pipeline=2, pipeline_schedule="1f1b"),
                                   dict(microbatches=8))
  out["context=4,data=2"] = (MeshConfig(data=2, context=4), {})
  out["expert=4,fsdp=2,dropless"] = (MeshConfig(data=1, expert=4, fsdp=2), dict(moe=MOE))
  out["expert=8,dropping"] = (MeshConfig(data=1, expert=8),
                              dict(moe=dataclasses.replace(MOE, dispatch="dropping")))
  out["fsdp=8,fp8"] = (MeshConfig(data=1, fsdp=8),
                       dict(compute=dataclasses.replace(COMPUTE, fp8=Fp8Config(True))))
  out["data=2,fsdp=2,tensor=2,flash,chunked"] = (
      MeshConfig(data=2, fsdp=2, tensor=2),
      dict(compute=ComputeConfig(attention_impl="pallas_flash", loss_impl="chunked",
                                 loss_chunk_size=4), microbatches=2))
  return out


def gpu_table() -> dict:
  """name -> (MeshConfig, `config` keyword arguments) of the bf16 programs for h100x8."""
  bf16, auto = dataclasses.replace(MODEL, dtype="bfloat16"), ComputeConfig()
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


def programs() -> dict:
  """name -> TrainConfig of the programs compiled on 8 CPU devices."""
  return {name: config(mesh_cfg, **options) for name, (mesh_cfg, options) in cpu_table().items()}


def gpu_programs() -> dict:
  """name -> TrainConfig of the programs compiled deviceless for h100x8."""
  return {name: config(mesh_cfg, **options) for name, (mesh_cfg, options) in gpu_table().items()}


def cpu_program_text(cfg: TrainConfig) -> str:
  """The optimized HLO of a config's train step on this process's CPU devices, compiled from
  abstract inputs (nothing allocated or run)."""
  from trainer.trainer import Trainer
  trainer = Trainer(cfg)
  with trainer.scope():
    executable = trainer.train_step.lower(trainer.abstract_state,
                                          trainer.abstract_batch()).compile()
  return executable.as_text()


def gpu_program_text(cfg: TrainConfig) -> str:
  """The optimized HLO of a config's train step compiled deviceless for 8 H100s."""
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "program.hlo")
    compile_for_gpus(cfg, compiled.parse_gpu_target("h100x8"), hlo_path=path)
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
  texts = [(name, cpu_program_text, cfg) for name, cfg in programs().items()]
  texts += [(name, gpu_program_text, cfg) for name, cfg in gpu_programs().items()]
  for name, text, cfg in texts:
    digest = program_hash(text(cfg))
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
