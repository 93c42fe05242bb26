"""The planner's memory-bound kernels (sharding/plan/memory_bound.py), counted by hand: each
elementwise operation of a layer reads its inputs and writes its outputs once, at the
compiled-program model's copy bandwidth."""

import dataclasses

import pytest

from sharding.layout import Layout
from sharding.plan import hardware, memory_bound
from sharding.plan.estimate import PLAYBOOK_MIXED, MoESpec, ModelSpec, trainer_precision

# D 16, q 4 x 4 = 16, k and v 2 x 4 = 8, F 32, V 100; bf16 activations (a = 2).
SMALL = ModelSpec(vocab_size=100, embed_dim=16, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=4, mlp_dim=32)
SEQ = 8
H100 = hardware.PROFILES["h100"]


def test_a_dense_layer_s_bytes_by_hand():
  """Forward 10aD (2 norms, 2 adds) + 2a(q + k) (RoPE) + 3aF (SwiGLU) = 320 + 96 + 192;
  backward 12aD + 2a(q + k) + 5aF = 384 + 96 + 320. fp8 adds 2a + 1 = 5 bytes per element of
  the GEMMs' inputs forward (x twice, o's 16, down's 32: 80) and of their outputs' gradients
  backward (q, k, v 32, o and down 2 x 16, gate and up 64: 128)."""
  assert memory_bound.layer_bytes(SMALL, Layout(), PLAYBOOK_MIXED) == (608, 800)
  fp8 = trainer_precision("bfloat16", "bfloat16", fp8_layers=True)
  assert memory_bound.layer_bytes(SMALL, Layout(), fp8) == (608 + 400, 800 + 640)
  # Tensor parallelism without sequence parallelism repeats the D-wide work on every rank (its
  # token share divides by tensor, so D-wide bytes count tensor times); with it, they split.
  split = memory_bound.layer_bytes(SMALL, Layout(tensor=2, sequence_parallel=True),
                                   PLAYBOOK_MIXED)
  repeated = memory_bound.layer_bytes(SMALL, Layout(tensor=2), PLAYBOOK_MIXED)
  assert split == (608, 800)
  assert repeated == (608 + 320, 800 + 384)


def test_a_moe_layer_s_bytes_by_hand():
  """2 of 4 experts of width 8, no dense MLP: forward 10aD + 8aD x 2 copies (four gathers of
  each routed row) + 3aD (combining 2 rows into 1) + 2a(q + k) + 3a x 8 x 2 buffer rows =
  320 + 512 + 96 + 96 + 96; backward 12aD + 512 + 5aD (read 1, write 2, read 2) + 96 + 5a x 8 x
  2 = 384 + 512 + 160 + 96 + 160. Buffers of 2x the rows double the experts' SwiGLU."""
  moe = dataclasses.replace(SMALL, moe=MoESpec(4, 2, 8, dispatch="dropless"))
  assert memory_bound.layer_bytes(moe, Layout(), PLAYBOOK_MIXED) == (1120, 1312)
  assert memory_bound.layer_bytes(moe, Layout(), PLAYBOOK_MIXED, rows_ratio=2.0) == (
      1120 + 96, 1312 + 160)


def test_experts_as_batched_gemms_add_their_gathers_by_hand():
  """moe.grouped_matmul=capacity moves each routed row into its expert's slots and back, per
  GEMM (D 16, F 8, bf16: b = a = 2): forward x in 2Db, gate and up out 4Fa, h in 2Fb, down out
  2Da = 64 + 64 + 32 + 64 = 224 a row; backward dy in 2Db, dh out 2Fa, h in again 2Fb, dg and du
  in 4Fb, dx out twice 4Da, x in again 2Db = 64 + 32 + 32 + 64 + 128 + 64 = 384 a row; 2 rows a
  token. fp8 experts (b = 1): 176 and 272 a row, beside fp8's casts."""
  plain = dataclasses.replace(SMALL, moe=MoESpec(4, 2, 8, dispatch="dropless"))
  batched = dataclasses.replace(plain, moe=dataclasses.replace(plain.moe,
                                                               grouped_matmul="capacity"))
  assert memory_bound.layer_bytes(batched, Layout(), PLAYBOOK_MIXED) == (1120 + 2 * 224,
                                                                       1312 + 2 * 384)
  fp8 = trainer_precision("bfloat16", "bfloat16", fp8_layers=True)
  base = memory_bound.layer_bytes(plain, Layout(), fp8)
  assert memory_bound.layer_bytes(batched, Layout(), fp8) == (base[0] + 2 * 176,
                                                            base[1] + 2 * 272)


def test_the_swiglu_whole_on_the_slots_adds_one_gather_each_way_by_hand():
  """moe.grouped_matmul=slots (models/slot_experts.py) moves each routed row into its slot once
  and its product out once (D 16, F 8, bf16): forward x in 2Db, y out 2Da = 64 + 64 = 128 a
  row; backward dy and x in 4Db, dx out 2Da = 128 + 64 = 192 a row, 2 rows a token; fp8 (b =
  1): 96 and 128. Fewer than capacity's 224 and 384 (the F-wide moves and dx twice are gone)."""
  plain = dataclasses.replace(SMALL, moe=MoESpec(4, 2, 8, dispatch="dropless"))
  slots = dataclasses.replace(plain, moe=dataclasses.replace(plain.moe, grouped_matmul="slots"))
  assert memory_bound.layer_bytes(slots, Layout(), PLAYBOOK_MIXED) == (1120 + 2 * 128,
                                                                     1312 + 2 * 192)
  fp8 = trainer_precision("bfloat16", "bfloat16", fp8_layers=True)
  base = memory_bound.layer_bytes(plain, Layout(), fp8)
  assert memory_bound.layer_bytes(slots, Layout(), fp8) == (base[0] + 2 * 96, base[1] + 2 * 128)


def test_a_step_s_memory_bound_seconds_by_hand():
  """Per token: 2 layers x (608 forward + 800 backward) + 3aV = 600 for the cross-entropy;
  selective remat runs each layer's forward again (+2 x 608); at 3.0 TB/s."""
  for remat, per_token in (("none", 2 * 1408 + 600), ("selective", 2 * (1408 + 608) + 600),
                           ("full", 2 * (1408 + 608) + 600)):
    seconds = memory_bound.memory_bound_seconds(SMALL, Layout(remat=remat), SEQ, PLAYBOOK_MIXED,
                                                H100)
    assert seconds == pytest.approx(SEQ * per_token / H100.copy_bandwidth)
  # Two microbatches of two sequences: 4x the tokens; pipeline=2: each stage runs 1 of the 2
  # layers on all of them and the head on half, and its executor recomputes the forward and
  # adds each microbatch's gradient of its layer's 2,304 weights into their float32 sums.
  staged = memory_bound.memory_bound_seconds(
      SMALL, Layout(pipeline=2, micro_batch=2, microbatches=2), SEQ, PLAYBOOK_MIXED, H100)
  assert staged == pytest.approx((4 * SEQ * (1408 + 608 + 300) + 2 * 2304 * (2 + 8)) /
                                 H100.copy_bandwidth)


def test_the_pipeline_executor_s_sums_and_weight_copies_by_hand():
  """A stage's 2,304 weights a layer (q 256, k and v 128 each, o 256, the MLP 1,536). Per
  microbatch the backward tick adds each weight's bf16 gradient into its float32 sum (2 + 4 + 4
  bytes); a stage of 2 layers is cut into them by its forward and its backward tick, each
  copying its weights (read and write, 2 bytes each in bf16, 1 in fp8). ZeRO-2 adds the
  reduce-scattered part only. Nothing without stages, nor for stages that store activations."""
  four = dataclasses.replace(SMALL, num_layers=4)
  bf16 = trainer_precision("bfloat16", "bfloat16", "float32")
  fp8 = trainer_precision("bfloat16", "bfloat16", "float32", fp8_layers=True)
  one_layer = Layout(pipeline=4, microbatches=2)
  two_layers = Layout(pipeline=2, microbatches=2)
  assert memory_bound.executor_bytes(four, one_layer, bf16) == 2 * 2304 * 10
  assert memory_bound.executor_bytes(four, two_layers, bf16) == 2 * 4608 * (10 + 2 * 2 * 2)
  assert memory_bound.executor_bytes(four, two_layers, fp8) == 2 * 4608 * (10 + 2 * 2 * 1)
  zero2 = Layout(data=2, pipeline=2, microbatches=2, zero_stage=2)
  assert memory_bound.executor_bytes(four, zero2, bf16) == 2 * 4608 * (10 / 2 + 2 * 2 * 2)
  assert memory_bound.executor_bytes(four, Layout(microbatches=2), bf16) == 0
  stored = (memory_bound.memory_bound_seconds(four, two_layers, SEQ, bf16, H100, flag)
            for flag in (True, False))
  # Stages that store activations neither add these nor recompute the forward (608 a token).
  assert next(stored) - next(stored) == pytest.approx(
      (2 * 4608 * 18 + 2 * SEQ * 2 * 608) / H100.copy_bandwidth)


def test_meshtron_s_step_adds_them_and_the_playbook_s_nanotron_runs_do_not():
  """meshtron's kernels (the default) add the memory-bound seconds to the matmuls'; the
  playbook's nanotron runs (uniform_matmuls) keep their one fitted efficiency, which covers
  everything their steps ran."""
  layout = Layout()
  mine, uniform = (hardware.step_time(SMALL, layout, SEQ, PLAYBOOK_MIXED, H100,
                                      uniform_matmuls=u) for u in (False, True))
  linear, rest = hardware.flops_split(SMALL, layout, SEQ)
  matmuls = hardware.matmul_seconds(SMALL, layout, SEQ, H100, linear, H100.peak_bf16_flops)
  launches = 3 * SMALL.num_layers * H100.layer_overhead_s
  assert mine.compute_s == pytest.approx(matmuls + launches + memory_bound.memory_bound_seconds(
      SMALL, layout, SEQ, PLAYBOOK_MIXED, H100))
  assert uniform.compute_s == pytest.approx(
      (linear + rest) / H100.peak_bf16_flops / H100.matmul_efficiency + launches)


def test_the_count_is_a_floor_of_the_compiled_program_s_memory_bound_bytes(tmp_path):
  """The debug Llama's 8xH100 programs (fsdp=8): the bytes the step-time model reads off their
  memory-bound kernels (sharding/xla/step_time.py) exceed the count, which leaves out what the
  programs add (the optimizer's update, which `plan` prices apart, the layer scan's stacked
  residuals, layout copies): about 4x it without remat in bf16 when written."""
  from configs import llama
  from models import ComputeConfig
  from models.fp8.config import Fp8Config
  from sharding.mesh import MeshConfig
  from sharding.plan.estimate import model_spec
  from sharding.xla import compiled, step_time
  from trainer.aot import compile_for_gpus

  target = compiled.parse_gpu_target("h100x8")
  counted, found = {}, {}
  for remat, fp8 in (("none", False), ("selective", False), ("none", True)):
    cfg = llama.debug()
    cfg.mesh = MeshConfig(data=1, fsdp=8)
    cfg.batch_size, cfg.seq_len = 16, 512
    cfg.compute = ComputeConfig(remat=remat, fp8=Fp8Config(enabled=fp8))
    path = tmp_path / f"{remat}_{fp8}.hlo"
    compile_for_gpus(cfg, target, hlo_path=str(path))
    ops = step_time.predict(path.read_text(), H100, target.devices_per_host, top=10**9).top_ops
    found[remat, fp8] = sum(o["bytes"] * o["count"] for o in ops if o["kind"] == "memory")
    counted[remat, fp8] = H100.copy_bandwidth * memory_bound.memory_bound_seconds(
        model_spec(cfg.model, cfg.compute), cfg.layout(8), cfg.seq_len, cfg.precision(), H100)
  # The settings differ: selective remat runs the forward's operations again, fp8 casts.
  assert counted["none", False] < counted["selective", False]
  assert counted["none", False] < counted["none", True]
  assert all(0 < counted[k] < found[k] for k in found), (counted, found)
