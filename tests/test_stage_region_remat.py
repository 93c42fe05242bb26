"""A layer checkpoint over the flash kernel's region nested in a pipeline stage (sharding.
shard_map.stage_shard_map) keeps the kernel's output and row statistics under remat "none",
rather than running its forward again in the backward tick. A stage's chunk of more than
UNROLLED_STAGE_GROUPS layers is scanned and checkpointed (DeepSeek-V3-like PP8 EP64: 8 layers a
chunk), and JAX's partial evaluation of a while loop (the region's one trip) keeps none of its
outputs unless they are named (STAGE_REGION)."""

import dataclasses

import pytest

from configs import llama
from sharding import MeshConfig
from sharding.layout import UNROLLED_STAGE_GROUPS
from sharding.xla import compiled, hlo
from tests.test_anchor_programs import flash_forwards_per_backward
from trainer.aot import compile_for_gpus

LAYERS = 10  # 5 a stage on 2 stages: scanned


@pytest.mark.parametrize("remat,forwards", [("selective", 2), ("none", 1)])
def test_a_scanned_chunk_keeps_the_flash_kernels_outputs_under_remat_none(tmp_path, remat,
                                                                          forwards):
  """Llama-style, pipeline=2 x tensor=2 on h100x4, the flash kernel in the stages. The backward
  branch of the executor's tick holds the forward kernel (the call that also returns the f32
  log-sum-exp) in its recomputed chunk's layer scan and, where the checkpoint keeps less than
  the kernel's outputs (selective: projections only), again in the transposed scan. Under
  remat none it did too before the region's outputs were named."""
  assert LAYERS // 2 > UNROLLED_STAGE_GROUPS
  cfg = llama.large("llama3_8b")
  cfg.model = dataclasses.replace(cfg.model, num_layers=LAYERS, embed_dim=1024, mlp_dim=2048,
                                  num_heads=8, num_kv_heads=8, vocab_size=8192)
  cfg.seq_len, cfg.batch_size, cfg.microbatches = 1024, 8, 8
  cfg.mesh = MeshConfig(data=1, fsdp=1, pipeline=2, tensor=2)
  cfg.compute = dataclasses.replace(cfg.compute, attention_impl="auto", remat=remat)
  path = str(tmp_path / "step.hlo")
  compile_for_gpus(cfg, compiled.parse_gpu_target("h100x4"), hlo_path=path)
  assert flash_forwards_per_backward(open(path).read()) == [0, 1, forwards]


def test_kept_residuals_store_the_flash_kernels_output_once(tmp_path):
  """Kept residuals (pipeline_recompute=false) under remat none, h100x4, 5 layers a stage
  (scanned): the flash kernel's output is both the region's output and a residual of its own
  pullback. The chunk's forward writes it into its kept residuals once, where it wrote it twice
  (the region's kept leaves and the output projection's input: 3.75 GiB of the 70B PP8 x FSDP4
  x TP2 kept program's 78.0 GiB peak)."""
  cfg = llama.large("llama3_8b")
  cfg.model = dataclasses.replace(cfg.model, num_layers=LAYERS, embed_dim=1024, mlp_dim=2048,
                                  num_heads=8, num_kv_heads=8, vocab_size=8192)
  cfg.seq_len, cfg.batch_size, cfg.microbatches = 1024, 8, 8
  cfg.mesh = MeshConfig(data=1, fsdp=1, pipeline=2, tensor=2, pipeline_recompute=False)
  cfg.compute = dataclasses.replace(cfg.compute, attention_impl="auto", remat="none")
  path = str(tmp_path / "step.hlo")
  compile_for_gpus(cfg, compiled.parse_gpu_target("h100x4"), hlo_path=path)
  comps = hlo.computations(open(path).read())
  kernels = {i.name for instrs in comps.values() for i in instrs
             if i.op == "custom-call" and i.type.startswith("(") and " f32[" in i.type}
  outputs = {i.name for instrs in comps.values() for i in instrs
             if i.op == "get-tuple-element" and hlo.operands(i)[0] in kernels
             and i.attrs.endswith("index=0")}
  writes = [[i.name for instrs in comps.values() for i in instrs
             if "dynamic_update_slice" in i.attrs and o in hlo.operands(i)] for o in outputs]
  assert kernels and outputs and all(len(w) == 1 for w in writes), writes
