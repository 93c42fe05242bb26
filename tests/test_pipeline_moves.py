"""The pipeline step's moves of whole weights and gradients, once per step: the layer chunks
between storage order and the stages that run them (sharding/pipeline/device_order.py), and
the ZeRO-1 reduction of the layer gradients (sharding/pipeline/reduction.py)."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding import MeshConfig
from sharding.pipeline import schedules
from sharding.pipeline.device_order import device_order
from sharding.xla import hlo
from sharding.xla.compiled import parse_gpu_target
from tests import parallel_harness as harness
from tests.test_pipeline import MODELS
from trainer.aot import compile_for_gpus


@pytest.mark.parametrize("kind,stages,virtual", [
    ("interleaved_1f1b", 4, 2), ("interleaved_1f1b", 8, 5), ("interleaved_1f1b", 8, 8),
    ("paired_1f1b", 8, 5), ("zbv", 4, 2), ("dualpipev", 4, 2), ("interleaved_1f1b", 2, 3)])
def test_the_chunks_move_to_the_stages_that_run_them_and_back(kind, stages, virtual):
  """The rounds of sends put each stage's chunks where the schedule runs them, as a gather by
  the schedule's positions does, and the inverse puts them back; with v = 5 and 8 on 8 stages
  (the 70B and 405B recipes) each stage runs one chunk it stores, which is not sent."""
  schedule = schedules.make(kind, stages, stages * virtual, virtual)
  rows, layers = 3, stages * virtual * 3
  w = np.arange(layers * 2, dtype=np.float32).reshape(layers, 2)
  order = [schedule.position(c, s) for s in range(stages) for c in range(virtual)]
  want = w.reshape(stages * virtual, rows, 2)[order].reshape(layers, 2)
  mesh = Mesh(np.array(jax.devices()[:stages]), ("pipeline",))
  x = jax.device_put(w, NamedSharding(mesh, PartitionSpec("pipeline")))
  move = jax.jit(lambda t, inverse: device_order(schedule, mesh, "pipeline", t, inverse),
                 static_argnums=1)
  moved = move(x, False)
  np.testing.assert_array_equal(moved, want)
  np.testing.assert_array_equal(move(moved, True), w)
  sends = [c for c in hlo.collectives(move.lower(x, False).compile().as_text())
           if c.kind == "collective-permute"]
  stays = all(any(schedule.position(c, s) // virtual == s for c in range(virtual))
              for s in range(stages))
  assert len(sends) == virtual - stays


def test_zero_1_reduce_scatters_the_layer_gradients_into_the_optimizer_parts(tmp_path):
  """pipeline=2 x data=4, ZeRO-1, 8 microbatches, compiled for 8 H100s: each layer weight's
  gradient sums leave the stages per replica and are reduce-scattered over the 4 replicas into
  the parts their optimizer states hold, once per step, as Megatron's distributed optimizer
  reduces them, where without ZeRO they are all-reduced whole (half the bytes; the 405B TP8 PP8
  CP2 VP8 program: 47.8 GB a device per step, 23.9 now). XLA:CPU turns neither into a
  reduce-scatter, hence the GPU program."""
  def reductions(zero_stage):
    cfg = harness.config(MeshConfig(data=4, pipeline=2, zero_stage=zero_stage), microbatches=8,
                         model=MODELS[4])
    path = str(tmp_path / f"zero{zero_stage}.hlo")
    compile_for_gpus(cfg, parse_gpu_target("h100x8"), hlo_path=path)
    text = open(path).read()
    return [c for c in hlo.collectives(text) if c.group_size == 4 and c.kind in (
        "all-reduce", "reduce-scatter") and c.dtype == "f32" and c.count == 1]
  wire = lambda cs, kind: sum(c.wire_bytes for c in cs if c.kind == kind)
  whole, parts = reductions(0), reductions(1)
  assert wire(whole, "all-reduce") > 0 and not wire(whole, "reduce-scatter")  # they differ
  # The stage's 7 layer weights (q, k, v, o, gate, up, down) reduce-scattered; left
  # all-reduced: the norms' scales, whose optimizer state is not split.
  assert wire(parts, "all-reduce") < 0.01 * wire(parts, "reduce-scatter")
  assert wire(parts, "reduce-scatter") < 0.51 * wire(whole, "all-reduce")
