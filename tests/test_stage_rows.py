"""A pipeline stage's unrolled rows, and compiled programs XLA got wrong.

XLA 0.10.2 (GPU) miscompiles a sum of bf16-converted f32 all-reduces: all-reduce reassociation
makes it one bf16 all-reduce that keeps the f32 reduction, the combiner packs that with f32
all-reduces and the contiguous pass flattens the pack into bf16, bitcasting f32 arrays to bf16
ones of the same length (sharding/xla/soundness.py). Indexing a stacked weight per row made that
sum (the transpose pads each row's gradient and adds them up); models.transformer.unstacked
cuts rows by lax.split, whose transpose concatenates. The DeepSeek-V3-like PP32 CP4 TP4 plan
candidate aborted XLA with it; the DeepSeek-V3 anchor's program carried 18 such bitcasts."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.transformer import unstacked
from sharding import MeshConfig
from sharding.xla import compiled, soundness
from tests import parallel_harness as harness
from tests.test_moe_parallel import MOE
from trainer.aot import compile_for_gpus

P = jax.sharding.PartitionSpec


def test_unstacked_rows_are_the_rows_and_their_gradient_a_concatenation():
  w = jnp.arange(12.0).reshape(3, 4)
  present = np.array([True, False, True])
  rows = unstacked({"w": w, "here": present}, 3)
  assert all(np.array_equal(r["w"], w[i]) for i, r in enumerate(rows))
  assert [type(r["here"]) for r in rows] == [np.bool_] * 3  # static: XLA drops padding conds

  def loss(w, cut):
    return sum((i + 1.0) * (r ** 2).sum() for i, r in enumerate(cut(w)))
  by_split = lambda w: unstacked(w, 3)
  by_index = lambda w: [w[i] for i in range(3)]
  split_jaxpr = str(jax.make_jaxpr(jax.grad(lambda w: loss(w, by_split)))(w))
  index_jaxpr = str(jax.make_jaxpr(jax.grad(lambda w: loss(w, by_index)))(w))
  assert "concatenate" in split_jaxpr and " pad" not in split_jaxpr
  assert " pad" in index_jaxpr  # the variant that made XLA's sum of all-reduces
  np.testing.assert_array_equal(jax.grad(lambda w: loss(w, by_split))(w),
                                jax.grad(lambda w: loss(w, by_index))(w))


def _rows_program(cut, **compiler_options):
  """Two bf16 rows scaling tokens split over 8 H100s, and an f32 weight read after them: their
  gradients are reduced over the 8 devices, bf16 (after an f32 reduce) and f32."""
  devices = compiled.gpu_devices(compiled.parse_gpu_target("h100x8"))
  mesh = jax.sharding.Mesh(np.array(devices), ("i",))
  on = lambda *spec: jax.sharding.NamedSharding(mesh, P(*spec))

  def grads(w, x, r):
    def loss(w, r):
      h = x
      for row in cut(w):
        h = (h.astype(jnp.float32) * row.astype(jnp.float32)[None]).astype(jnp.bfloat16)
      return (h.astype(jnp.float32) @ r.T).sum() + (h.astype(jnp.float32) ** 2).sum()
    return jax.grad(loss, argnums=(0, 1))(w, r)
  step = jax.jit(grads, in_shardings=(on(), on("i"), on()), out_shardings=(on(), on()),
                 compiler_options=compiler_options or None)
  args = (jax.ShapeDtypeStruct((2, 256), jnp.bfloat16),
          jax.ShapeDtypeStruct((1024, 256), jnp.bfloat16),
          jax.ShapeDtypeStruct((8, 256), jnp.float32))
  # A deviceless executable cannot be read back from the tests' persistent cache: not cached.
  cached = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  try:
    return step.lower(*args).compile(), devices
  finally:
    jax.config.update("jax_enable_compilation_cache", cached)


def test_xla_miscompiles_indexed_rows_and_the_report_refuses_the_program():
  """The XLA bug itself, on the smallest program that shows it, and what meshtron does: the
  report of a compiled program (meshtron compile, plan, train) raises instead of pricing it;
  the error's option avoids the bug; rows cut by lax.split never make it."""
  indexed, devices = _rows_program(lambda w: [w[0], w[1]])
  found = soundness.resized_bitcasts(indexed.as_text())
  if jax.__version__.startswith("0.10."):  # the bug as jaxlib 0.10.2 (the pinned one) has it
    assert found and any("f32[8,256] -> bf16[2048]" in f for f in found)
  if found:  # a later XLA (the lent GPU machine's 0.11) may have fixed it: then no refusal
    with pytest.raises(ValueError, match="XLA miscompiled the train step: .* set xla_options="
                                         "xla_gpu_all_reduce_combine_threshold_bytes=0"):
      compiled.report(indexed, "h100x8", devices)
  else:
    compiled.report(indexed, "h100x8", devices)
  unpacked, _ = _rows_program(lambda w: [w[0], w[1]],
                              xla_gpu_all_reduce_combine_threshold_bytes=0)
  split, _ = _rows_program(lambda w: unstacked(w, 2))
  for program in (unpacked, split):
    assert soundness.resized_bitcasts(program.as_text()) == []
    compiled.report(program, "h100x8", devices)


def test_a_bf16_moe_stage_under_context_and_tensor_compiles_soundly_for_h100s():
  """The layout family of the DeepSeek-V3-like candidate XLA aborted on (PP32 CP4 TP4 SP,
  dropless experts, bf16 weights with float32 masters), small: two MoE layers a stage, whose
  norm weights' gradients are reduced over context x tensor in bf16 next to the router's f32
  ones. Its program carried 14 resized bitcasts before the rows were cut by lax.split."""
  model = dataclasses.replace(harness.MODEL, num_layers=5, param_dtype="bfloat16",
                              dtype="bfloat16")
  cfg = harness.config(MeshConfig(data=1, pipeline=2, context=2, tensor=2,
                                  sequence_parallel=True),
                       moe=MOE, model=model, microbatches=2,
                       compute=dataclasses.replace(harness.COMPUTE, context_impl="allgather"))
  cfg.optim = dataclasses.replace(cfg.optim, master_weights=True)
  # Stage 0: the dense layer and two MoE layers; stage 1: two MoE layers.
  assert cfg.layout(8).stage_split(model.num_layers) == (3, 2)
  rep = compile_for_gpus(cfg, compiled.parse_gpu_target("h100x8"))  # raises if unsound
  assert rep.platform != "cpu" and rep.num_devices == 8
