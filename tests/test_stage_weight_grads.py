"""A pipeline stage whose layer weights are split over fsdp reduces each layer's weight gradient
to the weight's own shard in the backward tick's layer scan. Without the cotangent constraint
(models/transformer.py, `_weight_grads_as_stored`) XLA all-reduced each layer's gradient whole
and stacked the chunk's gradients whole in float32 before slicing them to the shard (Llama-3
70B, pipeline=8 x fsdp=4 x tensor=2 on 64 H100s: 49.2 GiB, 761 tok/s/GPU; with it 38.2 GiB,
849). Deviceless h100x4: XLA:CPU lowers a reduce-scatter as an all-reduce."""

import dataclasses
import math

from configs import llama
from sharding import MeshConfig
from sharding.layout import UNROLLED_STAGE_GROUPS
from sharding.xla import compiled, hlo
from trainer.aot import compile_for_gpus

LAYERS, EMBED, MLP = 10, 1024, 2048  # 5 a stage on 2 stages: scanned


def test_stage_weight_gradients_are_reduced_to_their_fsdp_shards(tmp_path):
  """Llama-style, pipeline=2 x fsdp=2 (no tensor axis: the only large reductions in the ticks
  are the weights'). Each MLP weight is [1024, 2048], its embed dim split by fsdp: no all-reduce
  in the tick loop carries a layer's whole weights (before: bf16[10485760], 40 a step), no
  float32 stack of a chunk's 5 whole gradients exists, and the weights' gradients leave the
  scan reduce-scattered."""
  assert LAYERS // 2 > UNROLLED_STAGE_GROUPS
  cfg = llama.large("llama3_8b")
  cfg.model = dataclasses.replace(cfg.model, num_layers=LAYERS, embed_dim=EMBED, mlp_dim=MLP,
                                  num_heads=8, num_kv_heads=8, vocab_size=8192)
  cfg.seq_len, cfg.batch_size, cfg.microbatches = 1024, 8, 4
  cfg.mesh = MeshConfig(data=1, fsdp=2, pipeline=2, tensor=1)
  path = str(tmp_path / "step.hlo")
  compile_for_gpus(cfg, compiled.parse_gpu_target("h100x4"), hlo_path=path)
  text = open(path).read()
  ops = hlo.collectives(text)
  whole = EMBED * MLP
  # In the tick loop (count > 1: per layer and tick); the step's last sums (the tables', the
  # norm's) are once.
  reduced = [c for c in ops if c.kind == "all-reduce" and math.prod(c.shape) >= whole
             and c.count > 1]
  assert not reduced, [(c.dtype, c.shape) for c in reduced]
  assert f"f32[5,{EMBED},{MLP}]" not in text and f"f32[5,{MLP},{EMBED}]" not in text
  # The layers' weight gradients reduce-scattered in the tick loop, each at least a whole q
  # projection's (bf16 [1024, 8, 128] in, its fsdp half out).
  scattered = [c for c in ops if c.kind == "reduce-scatter" and c.count > 1
               and c.bytes >= EMBED * 8 * 128 * 2]
  assert scattered, [(c.kind, c.shape, c.count) for c in ops]
