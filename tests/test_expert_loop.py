"""The expert loop (sharding/expert_loop.py): a step without pipeline stages whose batch is split
over the experts' axis runs its microbatches manual over that axis (and the replicas'), and
reduces the shared weights' gradients once a step, not once a microbatch. Trains like one
device (test_moe_parallel.py's tolerances and reference)."""

import collections
import dataclasses
from unittest import mock

import jax
import numpy as np
import pytest

from configs import moe as moe_configs
from models.fp8.config import Fp8Config
from sharding.layout import Layout
from sharding.xla import compiled, hlo
from tests import parallel_harness as harness, test_mtp
from tests.test_moe_parallel import MOE, M, reference
from tests.test_parallel import assert_same_training
from trainer.aot import compile_for_gpus

FLOAT_REDUCTIONS = ("all-reduce", "reduce-scatter", "all-gather")


def test_the_loop_takes_the_expert_and_replica_axes_only_where_nothing_else_splits():
  moe = dict(num_experts=8, microbatches=4)
  assert Layout(expert=8, **moe).loop_axes == ("expert",)
  assert Layout(data=2, expert=4, zero_stage=1, **moe).loop_axes == ("data", "expert")
  assert Layout(data=2, expert=4, **moe).vmapped_replicas == ((), 1)
  assert Layout(data=2, expert=4, num_experts=8).loop_axes == ()  # one microbatch
  assert Layout(data=8, microbatches=4).loop_axes == ()  # a dense model
  assert Layout(data=2, expert=4, **moe).in_train_step().in_expert_loop
  for other in (dict(fsdp=2), dict(tensor=2), dict(context=2), dict(pipeline=2),
                dict(zero_stage=2), dict(moe_dispatch="dropping")):
    lay = Layout(expert=4, **moe, **other)
    assert lay.loop_axes == () and not lay.in_train_step().in_expert_loop, other
  assert Layout(data=2, expert=4, microbatches=4).vmapped_replicas == (("data",), 2)


# tests/test_moe_parallel.py's expert=4,data=2,ga=2 with rounds of a quarter of a pair's share
# runs in the loop too.
LAYOUTS = {
    "expert=8,ga=4": (M(expert=8), MOE, 4),
    "expert=4,data=2,zero=1,ga=2": (M(expert=4, data=2, zero_stage=1), MOE, 2),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_expert_loop_trains_like_one_device(name):
  mesh, moe, microbatches = LAYOUTS[name]
  assert harness.config(mesh, moe=moe, microbatches=microbatches).layout(8).loop_axes
  assert_same_training(harness.run(mesh, moe=moe, microbatches=microbatches), reference(moe))


@pytest.mark.parametrize("recipe,targets", [("delayed", "attention,mlp"),
                                            ("tensorwise", "experts")])
def test_fp8_trains_in_the_expert_loop_like_one_device(recipe, targets):
  """fp8 in the loop: the projections' weights quantized once a step before it (entering it
  whole on every device) and delayed scaling's amax histories combined by max over the devices
  (measured 1.3e-3 from one device at the third loss, equal to the automatic program's), the
  experts' grouped GEMMs scaled by each device's rows (6e-4). Within 2e-3, test_fp8_experts.py's
  bar for gradient accumulation over replicas, each of which scales by its own rows. Tensorwise
  on the dense projections too scales each device's activations by its own rows (Transformer
  Engine's current scaling is per rank too) where the automatic program took the amax over
  `expert`: 3.8e-3 from one device at the third loss (automatic 1.9e-3, one device with 2
  microbatches 7e-4), fp8's chaos over 3 steps at lr 1e-2 (test_fp8_recipes.py), not tested."""
  compute = dataclasses.replace(harness.COMPUTE, fp8=Fp8Config(enabled=True, recipe=recipe,
                                                               targets=targets))
  assert compute != harness.COMPUTE
  mesh, options = M(expert=4, data=2), dict(compute=compute, moe=MOE, microbatches=2)
  assert harness.config(mesh, **options).layout(8).loop_axes == ("data", "expert")
  ref = harness.run(M(), devices=jax.devices()[:1], compute=compute, moe=MOE)
  got = harness.run(mesh, **options)
  assert ref.losses[-1] < ref.losses[0]
  np.testing.assert_allclose(got.losses, ref.losses, rtol=2e-3)


def reductions_by_executions(text: str) -> collections.Counter:
  """{(kind, executions per step): instructions} of the float reductions and gathers."""
  return collections.Counter((c.kind, c.count) for c in hlo.collectives(text)
                             if c.kind in FLOAT_REDUCTIONS and c.dtype.startswith(("f", "bf")))


def test_the_shared_gradients_leave_the_loop_unreduced_on_8_cpu_devices():
  """expert=4 x data=2, ZeRO-1, 4 microbatches: with the loop every float reduction runs once a
  step; without it (the axes automatic, as before) the shared weights' gradients were reduced
  in each of the 4 microbatches."""
  mesh, options = M(expert=4, data=2, zero_stage=1), dict(moe=MOE, microbatches=4)
  loop = reductions_by_executions(harness.compile_step(mesh, **options).as_text())
  with mock.patch.object(Layout, "loop_expert_axes", property(lambda self: ())):
    automatic = reductions_by_executions(harness.compile_step(mesh, **options).as_text())
  assert [k for k in automatic if k[1] == 4], automatic
  assert loop and all(count == 1 for _, count in loop), loop


def test_the_shared_gradients_are_reduced_once_a_step_in_the_h100_program(tmp_path):
  """The same layout compiled for 8 H100s (the ragged exchange, the Pallas grouped matmul):
  the exchanges run in every microbatch, every float reduction and gather once a step (one
  reduce-scatter into ZeRO-1's parts per group of weights)."""
  cfg = moe_configs.debug_moe()
  cfg.mesh = M(data=2, expert=4, zero_stage=1)
  cfg.batch_size, cfg.seq_len, cfg.microbatches = 32, 64, 4
  cfg.model.num_layers = 2
  path = tmp_path / "step.hlo"
  compile_for_gpus(cfg, compiled.parse_gpu_target("h100x8"), hlo_path=str(path))
  text = path.read_text()
  exchanges = [c.count for c in hlo.collectives(text) if c.kind == "ragged-all-to-all"]
  assert exchanges and all(n == cfg.microbatches * cfg.model.num_layers for n in exchanges)
  once = reductions_by_executions(text)
  assert once[("reduce-scatter", 1)] and all(count == 1 for _, count in once), once


def test_a_moe_prediction_module_trains_in_the_expert_loop_like_one_device():
  """DeepSeek-V3's shape in small: the MoE model with a depth-1 multi-token prediction module
  whose block is a MoE too, on expert=4 x data=2 with 2 microbatches, in the loop: its router
  losses, loads and shifted targets are sums over each device's rows, and its bias moves by the
  step's loads summed over the devices, as on one device."""
  mesh = M(expert=4, data=2)
  assert harness.config(mesh, model=test_mtp.with_mtp(), moe=test_mtp.HARNESS_MOE,
                        microbatches=2).layout(8).loop_axes == ("data", "expert")
  result = harness.run(mesh, model=test_mtp.with_mtp(), moe=test_mtp.HARNESS_MOE,
                       microbatches=2)
  ref = test_mtp.reference(moe=test_mtp.HARNESS_MOE)
  assert_same_training(result, ref)
  test_mtp.assert_same_mtp_metrics(result, ref)
