"""Issue [26]'s named wastes, gone from the compiled H100 programs of small models: each test
compiles deviceless (`meshtron compile --target=h100xN`'s path) and reads the HLO."""

import collections
import dataclasses
import math
import re

import pytest

from configs import llama, moe
from sharding.mesh import MeshConfig
from sharding.xla import compiled, hlo
from trainer.aot import compile_for_gpus

# Llama-3-405B's shape of layer (GQA, 128-wide heads) at 1/8 the width, 2 layers.
SMALL = dict(num_layers=2, vocab_size=16_384, embed_dim=2048, mlp_dim=4096, num_heads=16,
             head_dim=128)


def gpu_program(tmp_path, mesh: dict, remat: str, microbatches: int) -> str:
  cfg = llama.large("llama3_405b")
  cfg.model = dataclasses.replace(cfg.model, **SMALL)
  cfg.mesh = MeshConfig(**{"data": 1, "fsdp": 1, **mesh})
  cfg.batch_size, cfg.microbatches = microbatches, microbatches
  cfg.compute = dataclasses.replace(cfg.compute, remat=remat)
  devices = math.prod(size for axis, size in mesh.items() if axis != "sequence_parallel")
  path = str(tmp_path / "step.hlo")
  compile_for_gpus(cfg, compiled.parse_gpu_target(f"h100x{devices}"), hlo_path=path)
  return open(path).read()


def gathered_twice(text: str) -> list[str]:
  """All-gathers of a value that the same computation already gathers the same way: what XLA
  does not merge (each collective has its own channel)."""
  out = []
  for comp, instrs in hlo.computations(text).items():
    seen = collections.Counter(
        (tuple(hlo.operands(i)), i.type, re.sub(r"channel_id=\d+", "", i.attrs.split(")", 1)[1]))
        for i in instrs if i.op in ("all-gather", "all-gather-start"))
    out += [f"{comp}: {key[0]} x{n}" for key, n in seen.items() if n > 1]
  return out


@pytest.mark.parametrize("mesh,remat", [
    (dict(pipeline=2, tensor=8, sequence_parallel=True), "full"),
    pytest.param(dict(pipeline=2, tensor=8, sequence_parallel=True), "selective",
                 marks=pytest.mark.slow),
    pytest.param(dict(tensor=8, sequence_parallel=True), "full", marks=pytest.mark.slow),
], ids=["pipeline-full", "pipeline-selective", "tensor-full"])
def test_sequence_parallel_gathers_each_activation_once(tmp_path, mesh, remat):
  """Under sequence parallelism XLA gathered a projection input once per dot that read it (3 for
  q/k/v, 2 for gate/up) and a projection's output gradient once per backward dot: the 405B on
  16 stages x tensor 8 moved 3.6 TB of all-gathers a step, 30,938 executions. One constraint on
  each (models/layers.py GATHERED) leaves one gather per value."""
  text = gpu_program(tmp_path, mesh, remat, microbatches=4 if "pipeline" in mesh else 1)
  gathers = [c for c in hlo.collectives(text) if c.kind == "all-gather"]
  assert gathers  # sequence parallelism gathers
  assert gathered_twice(text) == []


def test_a_pipeline_looks_each_microbatch_up_once(tmp_path):
  """Position 0's inputs are looked up before the ticks, once per microbatch (the lookup of a
  vocabulary split over `tensor`: a masked gather, all-reduced). Inside the ticks it ran under a
  conditional, which a lock-step tick prices (and waits for) at every tick, in the forward and
  again in the backward's recomputation: the 405B TP8 PP8 CP2 VP8 program all-reduced 3,150
  embeddings a step for its 192 microbatches, 740 of its 4,683 GB of collectives."""
  text = gpu_program(tmp_path, dict(pipeline=2, tensor=8, sequence_parallel=True), "full",
                     microbatches=4)
  lookups = [c for c in hlo.collectives(text)
             if c.kind == "all-reduce" and len(c.shape) == 3 and c.shape[-1] == SMALL["embed_dim"]]
  assert lookups and not any(c.unknown_trip_count for c in lookups)
  assert sum(c.count for c in lookups) == 4  # one per microbatch


def test_a_pallas_expert_region_compiles_in_a_pipeline_stage_for_gpus(tmp_path):
  """DeepSeek-V3-like (sigmoid router, expert groups, a leading dense layer) cut to 4 layers of
  1024 and 16 experts, on pipeline=2 x expert=2 H100s: the dropless experts run the Pallas
  grouped matmul inside the stage, whose region once failed to differentiate ("Expected
  cotangent type float32[1,1024,8]{V:pipeline} but got float32[1,1024,8]") and kept issue
  [26]'s DeepSeek-V3 anchors from compiling."""
  cfg = moe.large("deepseek_v3_like")
  cfg.model = dataclasses.replace(
      cfg.model, num_layers=4, embed_dim=1024, mlp_dim=2048, num_heads=8, vocab_size=8192,
      moe=dataclasses.replace(cfg.model.moe, first_dense_layers=1, num_experts=16,
                              expert_groups=4, groups_per_token=2, expert_mlp_dim=256))
  cfg.seq_len, cfg.batch_size, cfg.microbatches = 1024, 4, 2
  cfg.mesh = MeshConfig(data=1, fsdp=1, pipeline=2, expert=2)
  path = str(tmp_path / "step.hlo")
  rep = compile_for_gpus(cfg, compiled.parse_gpu_target("h100x4"), hlo_path=path)
  text = open(path).read()
  assert "ragged-all-to-all" in text and "__triton" in text  # the GPU exchange and kernels
  assert rep.memory["peak"] > 0


@pytest.mark.parametrize("attention,flash", [("xla", False), ("auto", True)])
def test_pipeline_stages_attend_with_the_flash_kernel_on_gpus(tmp_path, attention, flash):
  """Inside pipeline stages "auto" attention is the Pallas flash kernel on GPUs (its shard_map
  nests in the stage's, sharding/shard_map.py stage_shard_map): no [heads, L, L] score blocks,
  which the reference ("xla") stores for every layer and microbatch."""
  cfg = llama.large("llama3_8b")
  cfg.model = dataclasses.replace(cfg.model, num_layers=4, embed_dim=1024, mlp_dim=2048,
                                  num_heads=8, num_kv_heads=8, vocab_size=8192)
  cfg.seq_len, cfg.batch_size, cfg.microbatches = 1024, 8, 8
  cfg.mesh = MeshConfig(data=1, fsdp=1, pipeline=2, tensor=2)
  cfg.compute = dataclasses.replace(cfg.compute, attention_impl=attention)
  path = str(tmp_path / "step.hlo")
  compile_for_gpus(cfg, compiled.parse_gpu_target("h100x4"), hlo_path=path)
  text = open(path).read()
  scores = re.findall(r"f32\[[\d,]*\b4,[\d,]*1024,1024\]", text)  # 8 heads / tensor 2
  assert bool(scores) != flash
  assert ("xla.gpu.triton" in text) == flash
  if flash:  # the backward reads the forward kernel's outputs (flash_forwards_per_backward)
    assert flash_forwards_per_backward(text) == [0, 2, 2]


def flash_forwards_per_backward(text: str) -> list[int]:
  """The flash forward kernel calls (those that also return the f32 log-sum-exp) in each branch
  of the executor's tick (idle, forward, backward), as the program lists them (a scanned
  chunk's once, in its loop's body). Of a 2-layer stage (unrolled): the backward's are 2 when
  the pullback reads the saved residuals; 4 when, under a layer checkpoint whose policy keeps
  less than the kernel's outputs or the stage region's recomputing backward, it ran the kernel
  again (tests/test_stage_region_remat.py: a scanned chunk's)."""
  comps = hlo.computations(text)

  def forward(ins):
    return ins.op == "custom-call" and ins.type.startswith("(") and " f32[" in ins.type
  per_branch = [[hlo.count_within(comps, b, forward) for b in hlo.callees(i) if b in comps]
                for instrs in comps.values() for i in instrs if i.op == "conditional"]
  return next(b for b in per_branch if len(b) == 3 and max(b) > 0)
