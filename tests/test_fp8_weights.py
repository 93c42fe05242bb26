"""fp8 weights quantized once per step (models/fp8/weights.py): the same numbers as quantizing in
each GEMM, and a step whose microbatch loop quantizes no weight.

Equalities here are exact (np.testing.assert_array_equal): the weight quantized beforehand is the
very array the GEMM would have computed, and everything after it is the same program.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend.core import jaxprs_in_params

from configs import llama
from models import ComputeConfig, builder
from models.fp8.config import Fp8Config
from models.fp8.delayed import fp8_einsum, quantize_weight as delayed_weight
from models.fp8.current import (quantize_weight as tensorwise_weight, quantized_einsum,
                                shared_input_einsums)
from models.fp8.weights import RECIPES, QuantizedWeight, quantize_weights
from models.layers import GATHERED, RESIDUAL, gather_fp8_input, reduce_input_gradient
from sharding import Layout, MeshConfig, constrain, named_sharding, sum_terms
from sharding.xla import hlo
from tests import parallel_harness as harness
from tests.test_collective_matmul import layout_of, reductions
from trainer.config import StepConfig
from trainer.step import make_grads_fn, make_loss_sums
from trainer.trainer import Trainer

EQN = "BLD,DHd->BLHd"


@pytest.fixture(scope="module")
def operands():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(2, 5, 32)) * 3, jnp.bfloat16)
  w = jnp.asarray(rng.normal(size=(32, 4, 8)) * 0.1, jnp.bfloat16)
  c = jnp.asarray(rng.normal(size=(2, 5, 4, 8)) * 1e-3, jnp.float32)  # the output gradient
  histories = [jnp.asarray(h, jnp.float32) for h in
               ([0.0, 2.5, 7.0, 1.0], [0.3, 0.0, 0.0, 0.0], [4e-3, 5e-3, 0.0, 0.0])]
  return x, w, c, histories


def _value_and_grads(fn, x, w, c, histories):
  """y, and the cotangents of x, w and the histories, for the loss sum(y * c)."""
  loss = lambda x, w, *h: jnp.sum(fn(x, w, *h).astype(jnp.float32) * c)
  return fn(x, w, *histories), jax.grad(loss, argnums=tuple(range(2 + len(histories))))(
      x, w, *histories)


def test_a_weight_quantized_beforehand_gives_the_same_numbers(operands):
  """Tensorwise and delayed: the forward, dx, dw and (delayed) the three histories' new values
  are bit-identical whether the GEMM quantizes w or is handed quantize_weight(w)."""
  x, w, c, histories = operands
  per_gemm = _value_and_grads(lambda x, w: quantized_einsum("tensorwise", EQN, x, w), x, w, c, [])
  weight = QuantizedWeight(*tensorwise_weight(w), None)
  once = _value_and_grads(lambda x, w: quantized_einsum("tensorwise", EQN, x, w, weight),
                          x, w, c, [])
  jax.tree.map(np.testing.assert_array_equal, per_gemm, once)
  assert weight.q.dtype == jnp.float8_e4m3fn and weight.scale.shape == ()

  per_gemm = _value_and_grads(lambda x, w, *h: fp8_einsum(EQN, 1, x, w, *h), x, w, c, histories)
  weight = QuantizedWeight(*delayed_weight(w, histories[1], 1))
  once = _value_and_grads(lambda x, w, *h: fp8_einsum(EQN, 1, x, w, *h, weight), x, w, c,
                          histories)
  jax.tree.map(np.testing.assert_array_equal, per_gemm, once)
  assert float(once[1][3][0]) == float(jnp.max(jnp.abs(w.astype(jnp.float32))))  # rolled in


def small_model(recipe: str):
  """(the model config, its compute config with every projection in fp8 by `recipe`)."""
  cfg = llama.debug().model
  return (dataclasses.replace(cfg, num_layers=2, dtype="bfloat16"),
          ComputeConfig(fp8=Fp8Config(enabled=True, recipe=recipe, amax_history=4)))


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_model_with_its_weights_quantized_once_equals_quantizing_in_each_gemm(recipe):
  """A whole model (layer stack scanned, every projection in fp8): one QuantizedWeight per fp8
  projection, with a scale per layer of its stack; the loss and every gradient (histories
  included) are bit-identical with and without them."""
  model_cfg, compute = small_model(recipe)
  graphdef, _ = builder.abstract_model(model_cfg, compute)
  params = builder.init_params(model_cfg, jax.random.key(0), compute)
  weights = quantize_weights(nnx.merge(graphdef, params))
  layers = model_cfg.num_layers
  assert len(weights) == 7 and all(w.scale.shape == (layers,) for w in weights.values())
  assert all((w.history is None) == (recipe == "tensorwise") for w in weights.values())
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, model_cfg.vocab_size, (2, 33)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
           "positions": np.tile(np.arange(32, dtype=np.int32), (2, 1)),
           "segment_ids": np.ones((2, 32), np.int32), "loss_mask": np.ones((2, 32), np.float32)}
  grad = jax.jit(jax.grad(make_loss_sums(graphdef, Layout(), StepConfig()), has_aux=True))
  per_gemm, stats = grad(params, batch)
  once, stats_once = grad(params, batch, weights)
  np.testing.assert_array_equal(stats["loss_sum"], stats_once["loss_sum"])
  jax.tree.map(np.testing.assert_array_equal, per_gemm, once)


def _weight_converts(jaxpr, is_weight, is_loop, inside_scan=False, found=None):
  """{"inside": n, "outside": n}: conversions to e4m3 of arrays whose shape `is_weight`, by
  whether they sit inside a scan that `is_loop` (the microbatches', the pipeline's ticks)."""
  found = found if found is not None else {"inside": 0, "outside": 0}
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "convert_element_type" and \
        eqn.params["new_dtype"] == jnp.float8_e4m3fn and \
        is_weight(tuple(eqn.invars[0].aval.shape)):
      found["inside" if inside_scan else "outside"] += 1
    inner = inside_scan or (eqn.primitive.name == "scan" and is_loop(eqn))
    for sub in jaxprs_in_params(eqn.params):
      _weight_converts(sub, is_weight, is_loop, inner, found)
  return found


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_microbatch_loop_quantizes_no_weight(recipe):
  """With 2 microbatches, tensorwise quantizes every weight before the loop and none inside it;
  rowwise (two quantizations per weight, one per GEMM contraction) quantizes inside it."""
  model_cfg, compute = small_model(recipe)
  graphdef, abstract = builder.abstract_model(model_cfg, compute)
  names = builder.param_names(model_cfg, compute)
  params = abstract
  grads_fn = make_grads_fn(graphdef, names, Layout(microbatches=2), StepConfig())
  batch = {k: jax.ShapeDtypeStruct((4, 32), jnp.float32 if k == "loss_mask" else jnp.int32)
           for k in ("inputs", "targets", "positions", "segment_ids", "loss_mask")}
  jaxpr = jax.make_jaxpr(grads_fn)(params, batch).jaxpr
  tensorwise, _ = builder.abstract_model(*small_model("tensorwise"))
  stacks = [w.q.shape for w in jax.eval_shape(
      lambda p: quantize_weights(nnx.merge(tensorwise, p)), abstract).values()]
  found = _weight_converts(jaxpr, {*stacks, *(s[1:] for s in stacks)}.__contains__,
                           lambda scan: scan.params["length"] == 2)
  if recipe == "tensorwise":  # each of the 7 projections' stack, once
    assert found == {"inside": 0, "outside": len(stacks)} and len(stacks) == 7, found
  else:
    assert found["inside"] > 0 and found["outside"] == 0, found


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_pipeline_ticks_quantize_no_weight(recipe):
  """pipeline=2 x fsdp=2 x tensor=2 with 2 microbatches: each stage quantizes its chunks'
  weights once, before the ticks (trainer/pipeline_step.py, `quantize`), and no tick quantizes
  one: the forward, the backward's recomputation and its dx GEMM read that copy.
  Before, every projection was quantized inside the ticks (tests/test_fp8.py checks that the
  numbers equal one device's)."""
  # No activation's shape ends in a weight's ([b, L, D] = [16, 16, 32] would end in o's).
  model = dataclasses.replace(harness.MODEL, head_dim=24, mlp_dim=256)
  compute = dataclasses.replace(harness.COMPUTE, fp8=Fp8Config(enabled=True, recipe=recipe))
  cfg = harness.config(MeshConfig(data=1, pipeline=2, fsdp=2, tensor=2), microbatches=2,
                       model=model, compute=compute)
  trainer = Trainer(cfg)
  with trainer.scope():
    jaxpr = trainer.train_step.trace(trainer.abstract_state, trainer.abstract_batch()).jaxpr.jaxpr
  graphdef, abstract = builder.abstract_model(model, compute)
  # A layer's weights: the tails of the stacks' shapes (a stage holds [virtual, rows, ...]).
  layer_weights = [w.q.shape[1:] for w in jax.eval_shape(
      lambda p: quantize_weights(nnx.merge(graphdef, p)), abstract).values()]
  is_weight = lambda shape: any(shape[-len(w):] == w for w in layer_weights)
  found = _weight_converts(jaxpr, is_weight, lambda scan: True)
  assert len(layer_weights) == 7 and found == {"inside": 0, "outside": 7}, found


@pytest.mark.parametrize("beforehand", [False, True])
def test_projections_of_one_input_give_the_separate_gemms_numbers(operands, beforehand):
  """shared_input_einsums (q, k and v of one x, quantized once): each output and each dw are
  bit-identical to a separate quantized_einsum's, and dx is the separate dx's summed in order;
  with the weights quantized beforehand (models/fp8/weights.py) or in the GEMMs."""
  x, w, _, _ = operands
  rng = np.random.default_rng(2)
  ws = (w, *(jnp.asarray(rng.normal(size=(32, 2, 8)) * 0.05, jnp.bfloat16) for _ in range(2)))
  eqns = ("BLD,DHd->BLHd", "BLD,DKd->BLKd", "BLD,DKd->BLKd")
  weights = tuple(tensorwise_weight(w) if beforehand else None for w in ws)
  cs = tuple(jnp.asarray(rng.normal(size=(2, 5, w.shape[1], 8)) * 1e-3, jnp.bfloat16) for w in ws)
  ys, pullback = jax.vjp(
      lambda x, *ws: shared_input_einsums(eqns, lambda q: q, sum_terms, x, ws, weights), x, *ws)
  dx, *dws = pullback(cs)
  dx_sum = None
  for eqn, w, weight, c, y, dw in zip(eqns, ws, weights, cs, ys, dws):
    weight = None if weight is None else QuantizedWeight(*weight, None)
    y_one, one_pullback = jax.vjp(lambda x, w: quantized_einsum("tensorwise", eqn, x, w, weight),
                                  x, w)
    dx_one, dw_one = one_pullback(c)
    np.testing.assert_array_equal(y, y_one)
    np.testing.assert_array_equal(dw, dw_one)
    dx_sum = dx_one if dx_sum is None else dx_sum + dx_one
  np.testing.assert_array_equal(dx, dx_sum)


def test_tensor_parallel_projections_gather_their_fp8_input_once():
  """tensor=4 with sequence parallelism, tensorwise, 2 layers, on 8 CPU devices: one all-gather
  of the fp8 input for q, k and v and one for gate and up per layer, in the forward; the
  backward's dw GEMMs read the gathered copy, and the output gradients of o and down are
  gathered in e5m2 (in bf16 before the thirty-first session: 2 of the 4 gathers a layer). Quantized in each GEMM, XLA gathered each GEMM's
  fp8 copy for it, forward and backward: 20 gathers (the 70B TP4 PP8 VP5 recipe's fp8 gathers
  went from 2.4 TB to 0.55 TB a step, docs/planning.md).
  The input's gradient is reduced once for q, k and v and once for gate and up (a
  reduce-scatter each); reduced per GEMM, it took 5 reductions per layer where 2 do."""
  model = dataclasses.replace(harness.MODEL, head_dim=16, mlp_dim=256, dtype="bfloat16")
  compute = dataclasses.replace(harness.COMPUTE, fp8=Fp8Config(enabled=True, recipe="tensorwise"))
  cfg = harness.config(MeshConfig(data=2, tensor=4, sequence_parallel=True), model=model,
                       compute=compute)
  trainer = Trainer(cfg)
  with trainer.scope():
    text = trainer.train_step.lower(trainer.abstract_state,
                                    trainer.abstract_batch()).compile().as_text()
  rows = harness.BATCH // 2  # per data-parallel replica
  activation = (rows, harness.SEQ, model.embed_dim)
  # XLA:CPU moves fp8 collectives as f16; the bf16 step's own gathers are float32 here.
  gathers = [c for c in hlo.collectives(text) if c.kind == "all-gather" and c.shape == activation]
  fp8 = [c for c in gathers if c.dtype in ("f8e4m3fn", "f8e5m2", "f16")]
  # Per layer: forward, the e4m3 inputs of q, k and v and of gate and up; backward, the e5m2
  # output gradients of o and down, quantized before their gather (none gathered in bf16).
  assert sum(c.count * c.arrays for c in fp8) == 4 * model.num_layers, fp8
  # In bf16 (float32 here) only the 2 outside the layers' loops, once a step each.
  wide = [c for c in gathers if c not in fp8]
  assert [(c.count, c.arrays) for c in wide] == [(1, 1), (1, 1)], wide
  # XLA:CPU keeps its own reduce-scatters as an all-reduce of the whole activation.
  shard = (rows, harness.SEQ // 4, model.embed_dim)
  reductions = {kind: sum(c.count * c.arrays for c in hlo.collectives(text) if c.kind == kind
                          and c.shape == shape) for kind, shape in
                (("all-reduce", activation), ("reduce-scatter", shard))}
  # Per layer: the forward's o and down, the backward's 2 input gradients; the embedding lookup
  # and the head's dx.
  assert reductions == {"all-reduce": 2 * model.num_layers + 2,
                        "reduce-scatter": 2 * model.num_layers}, reductions


def test_sequence_parallel_projections_reduce_their_input_gradient_once():
  """q, k and v under tensor=4 with sequence parallelism, float32 operands: the outputs, dx and
  the dws equal one device's (dx adds the same products in another order), and the program
  reduce-scatters dx once, which XLA does not do with the plain sum (sum_terms). The model's
  count of reductions is test_tensor_parallel_projections_gather_their_fp8_input_once's."""
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(4, 32, 16)), jnp.float32)
  ws = tuple(jnp.asarray(rng.normal(size=(16, 4, 8)) * 0.1, jnp.float32) for _ in range(3))
  eqns = ("BLD,DHd->BLHd",) * 3
  heads = ("batch", "seq", "act_heads", "head_dim")
  cs = tuple(jnp.asarray(rng.normal(size=(4, 32, 4, 8)) * 1e-3, jnp.float32) for _ in ws)
  layout = layout_of(data=2, tensor=4)
  assert GATHERED != RESIDUAL  # the gather and the scatter are over `tensor`

  def step(sum_dx):
    def loss(x, ws, cs):
      ys = shared_input_einsums(eqns, gather_fp8_input, sum_dx, x, ws, (None,) * 3)
      ys = tuple(constrain(y, heads) for y in ys)  # as the attention's q, k and v
      return sum(jnp.sum(y * c) for y, c in zip(ys, cs)), ys
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))

  want = step(sum_terms)(x, ws, cs)
  once = step(functools.partial(reduce_input_gradient, layout, eqns, (heads,) * 3,
                                (GATHERED, RESIDUAL)))
  with layout.scope():
    # As in the model: x sequence-split, the output gradients split by heads.
    args = (jax.device_put(x, named_sharding(RESIDUAL, x.shape)), ws,
            tuple(jax.device_put(c, named_sharding(heads, c.shape)) for c in cs))
    got = once(*args)
    per_gemm = step(sum_terms).lower(*args).compile().as_text()
    assert reductions(once.lower(*args).compile().as_text()) == {"reduce-scatter": 1}
  assert "reduce-scatter" not in reductions(per_gemm)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
