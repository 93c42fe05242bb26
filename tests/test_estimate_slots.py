"""The memory estimate's slot buffers of the batched experts (moe.grouped_matmul=capacity,
sharding/plan/expert_rows.slot_bytes): by hand, and against the compiled H100 programs.

Where every expert is on the device, the batched experts gather exchange_capacity x a device's
routed rows into [experts, slots, width] buffers; the Pallas kernel reads the rows in place.
`plan` had counted neither, and ranked first DeepSeek-V3 FSDP layouts that compiled to 99-158
GiB (docs/planning.md, thirty-fourth session)."""

import concurrent.futures
import dataclasses

import pytest

from sharding.layout import Layout
from sharding.plan import estimate, expert_rows
from sharding.plan.estimate import ModelSpec, MoESpec, trainer_precision

MOE = ModelSpec(vocab_size=100, embed_dim=16, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=4, mlp_dim=32, moe=MoESpec(num_experts=8, experts_per_token=2,
                                                    expert_mlp_dim=8, dispatch="dropless",
                                                    grouped_matmul="capacity"))


def with_moe(**changes):
  return dataclasses.replace(MOE, moe=dataclasses.replace(MOE.moe, **changes))


def test_slot_buffers_by_hand():
  """100 tokens, top-2, headroom 2: 400 slot rows; each 5 D-wide rows (D 16) and 3 F-wide (F 8)
  at 2 bytes, 2 of the D-wide at 1 byte under fp8; the experts' width halved by tensor=2 (its
  tokens gathered, each device all of them); with the experts over expert x tensor (sequence
  parallel, Megatron's ETP 1) a device routes its half of the sequence at the whole width."""
  rows = 100 * 2 * 2
  assert expert_rows.slot_bytes(MOE, Layout(), 100, 2, False) == rows * (5 * 16 * 2 + 3 * 8 * 2)
  assert expert_rows.slot_bytes(MOE, Layout(), 100, 2, True) == \
      rows * (2 * 16 + 3 * 16 * 2 + 3 * 8 * 2)
  assert expert_rows.slot_bytes(MOE, Layout(tensor=2, sequence_parallel=True), 100, 2, False) \
      == rows * (5 * 16 * 2 + 3 * 4 * 2)
  folded = Layout(expert=2, tensor=2, sequence_parallel=True)
  assert expert_rows.slot_bytes(MOE, folded, 100, 2, False) == \
      100 / 2 * 2 * 2 * (5 * 16 * 2 + 3 * 8 * 2)
  for kernel in (with_moe(grouped_matmul="pallas"), with_moe(dispatch="dropping")):
    assert expert_rows.slot_bytes(kernel, Layout(), 100, 2, False) == 0.0


def test_the_estimate_adds_them_to_the_temporaries_of_batched_experts_only():
  layout, precision = Layout(micro_batch=4, microbatches=1), trainer_precision("bfloat16")
  pallas = estimate.memory(with_moe(grouped_matmul="pallas"), layout, 32, precision)
  batched = estimate.memory(MOE, layout, 32, precision)
  assert batched.temporaries - pallas.temporaries == pytest.approx(
      expert_rows.slot_bytes(MOE, layout, 4 * 32, 2, False))
  assert batched.activations == pallas.activations and batched.params == pallas.params


# (name, expert width, tensor, fp8): the programs the counts were read from; the first runs in
# the default suite, the rest in `make test-all` (tests/slow_cases.txt).
COMPILED = [("bf16", 256, 1, False), ("bf16, F 512", 512, 1, False),
            ("bf16, tensor=2", 256, 2, False), ("fp8 tensorwise", 256, 1, True)]
# The same for the SwiGLU whole on the slots (moe.grouped_matmul=slots), all in `make test-all`.
WHOLE = [("slots, bf16", 256, False), ("slots, bf16, F 512", 512, False),
         ("slots, fp8 tensorwise", 256, True)]


def compiled_peak(width: int, tensor: int, fp8: bool, headroom: float, kernel="capacity"):
  """(peak bytes, estimate's slot bytes) of a 2-layer MoE whose experts dominate (D 1024, 32
  experts top-8, seq 4096, 4 sequences a device, remat full), fsdp x tensor = 8, compiled for
  h100x8 without a GPU."""
  from configs import moe
  from models import ComputeConfig
  from models.fp8.config import Fp8Config
  from sharding import MeshConfig
  from sharding.xla import compiled
  from trainer.aot import compile_for_gpus
  cfg = moe.debug_moe()
  cfg.model = dataclasses.replace(
      cfg.model, embed_dim=1024, num_layers=2, num_heads=8, num_kv_heads=8, head_dim=128,
      mlp_dim=2048, vocab_size=4096, dtype="bfloat16", moe=dataclasses.replace(
          cfg.model.moe, num_experts=32, experts_per_token=8, expert_mlp_dim=width,
          dispatch="dropless", grouped_matmul=kernel, exchange_capacity=headroom))
  cfg.mesh = MeshConfig(data=1, fsdp=8 // tensor, tensor=tensor, sequence_parallel=tensor > 1)
  cfg.compute = ComputeConfig(remat="full", fp8=Fp8Config(enabled=True, recipe="tensorwise")
                              if fp8 else Fp8Config())
  cfg.seq_len, cfg.batch_size, cfg.microbatches = 4096, 4 * 8 // tensor, 1
  peak = compile_for_gpus(cfg, compiled.parse_gpu_target("h100x8")).memory["peak"]
  m = estimate.model_spec(cfg.model, cfg.compute)
  slots = expert_rows.slot_bytes(m, cfg.layout(8), 4 * cfg.seq_len, 2, fp8)
  return peak, slots


@pytest.mark.parametrize("name, width, tensor, fp8", COMPILED, ids=[c[0] for c in COMPILED])
def test_the_slot_buffers_match_the_compiled_peaks_growth_with_the_headroom(
    name, width, tensor, fp8):
  """From exchange_capacity 1 to 2 only the slots grow (the rows are the device's own): the
  estimate's growth is 1.00x the compiled peak's (bf16, 1,472 MiB), 1.02x at F 512, 1.23x with
  tensor=2 (XLA held 4 D-wide buffers there, not 5) and 1.10x under fp8, never below."""
  with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two compile subprocesses at once
    one, two = pool.map(lambda headroom: compiled_peak(width, tensor, fp8, headroom), (1.0, 2.0))
  assert two[1] == pytest.approx(2 * one[1]) and one[1] > 0
  assert 1.0 <= (two[1] - one[1]) / (two[0] - one[0]) <= 1.25


@pytest.mark.parametrize("name, width, fp8", WHOLE, ids=[c[0] for c in WHOLE])
def test_the_whole_swiglu_s_slot_buffers_match_the_compiled_peaks_growth(name, width, fp8):
  """moe.grouped_matmul=slots holds fewer D-wide and more F-wide slot buffers than capacity
  (expert_rows.WHOLE_*): the estimate's growth 1.03x the compiled peak's in bf16 (743.6 MiB),
  1.08x at F 512, 1.20x under fp8, never below."""
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    one, two = pool.map(lambda headroom: compiled_peak(width, 1, fp8, headroom, "slots"),
                        (1.0, 2.0))
  assert two[1] == pytest.approx(2 * one[1]) and one[1] > 0
  assert 1.0 <= (two[1] - one[1]) / (two[0] - one[0]) <= 1.25


def test_the_whole_swiglu_s_slot_buffers_by_hand():
  """100 tokens, top-2, headroom 2: 400 slot rows of 1 D-wide (D 16) and 8 F-wide (F 8) rows at
  2 bytes; under fp8 2 D-wide and 3 F-wide more at 1 byte."""
  whole = with_moe(grouped_matmul="slots")
  assert expert_rows.slot_bytes(whole, Layout(), 100, 2, False) == 400 * (16 * 2 + 8 * 8 * 2)
  assert expert_rows.slot_bytes(whole, Layout(), 100, 2, True) == \
      400 * (16 * 2 + 2 * 16 + 8 * 8 * 2 + 3 * 8)
