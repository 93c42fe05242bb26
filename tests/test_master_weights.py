"""bf16 parameters with float32 master weights in the optimizer (optim.master_weights)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sharding
from tests import parallel_harness as harness
from trainer.optim import MasterWeightsState, make_optimizer, with_master_weights
from trainer.trainer import Trainer


def _grads(step: int) -> dict:
  rng = np.random.default_rng(step)
  return {"w": jnp.asarray(rng.normal(size=64) * 1e-3, jnp.bfloat16),
          "b": jnp.ones((8,), jnp.bfloat16)}  # AdamW then moves b by -lr (1 + wd b) a step


def test_master_weights_follow_float32_adamw_exactly_and_params_are_their_rounding():
  """The masters are what AdamW gives float32 parameters fed the same (bf16) gradients, bit for
  bit; the bf16 parameters are the masters rounded. Plain AdamW on bf16 parameters loses each
  update smaller than half a bf16 step, so it ends elsewhere (the variants differ)."""
  adamw = optax.adamw(3e-4, weight_decay=0.1)
  start = {"w": jnp.linspace(-2, 2, 64).astype(jnp.bfloat16),
           "b": jnp.full((8,), 1.0, jnp.bfloat16)}
  tx = with_master_weights(adamw)
  params, state = start, tx.init(start)
  reference = jax.tree.map(lambda p: p.astype(jnp.float32), start)
  ref_state = adamw.init(reference)
  plain, plain_state = start, adamw.init(start)
  for step in range(20):
    g = _grads(step)
    updates, state = tx.update(g, state, params)
    params = optax.apply_updates(params, updates)
    ref_updates, ref_state = adamw.update(jax.tree.map(lambda x: x.astype(jnp.float32), g),
                                          ref_state, reference)
    reference = optax.apply_updates(reference, ref_updates)
    plain_updates, plain_state = adamw.update(g, plain_state, plain)
    plain = optax.apply_updates(plain, plain_updates)
  assert isinstance(state, MasterWeightsState)
  for k in start:
    assert params[k].dtype == jnp.bfloat16 and state.master[k].dtype == jnp.float32
    np.testing.assert_array_equal(state.master[k], reference[k])
    np.testing.assert_array_equal(params[k], reference[k].astype(jnp.bfloat16))
  # b starts at 1.0, where bf16 steps are 2^-8 below: plain AdamW's -3.3e-4 rounds back to 1.0
  # every step; the master moves by 20 of them and its rounding is 1 - 2^-7.
  np.testing.assert_array_equal(np.asarray(plain["b"], np.float32), np.ones(8))
  np.testing.assert_array_equal(np.asarray(params["b"], np.float32), np.full(8, 1 - 2**-7))


def test_a_parameter_set_outside_the_optimizer_is_taken_by_its_master():
  """Routing biases and fp8 histories are written by the train step itself after the update
  (trainer/non_gradient.py): the next update keeps the written value, not the stale master."""
  tx = with_master_weights(optax.chain(optax.sgd(0.1), optax.masked(
      optax.set_to_zero(), {"w": False, "bias": True})))
  params = {"w": jnp.ones((4,), jnp.bfloat16), "bias": jnp.zeros((4,), jnp.bfloat16)}
  state = tx.init(params)
  grads = {"w": jnp.ones((4,), jnp.bfloat16), "bias": jnp.ones((4,), jnp.bfloat16)}
  updates, state = tx.update(grads, state, params)
  params = optax.apply_updates(params, updates)
  params["bias"] = jnp.full((4,), 0.5, jnp.bfloat16)  # what NonGradient.apply does
  updates, state = tx.update(grads, state, params)
  params = optax.apply_updates(params, updates)
  np.testing.assert_array_equal(params["bias"], np.full(4, 0.5, np.float32))
  np.testing.assert_array_equal(state.master["bias"], np.full(4, 0.5, np.float32))
  np.testing.assert_allclose(np.asarray(params["w"], np.float32), 0.8, rtol=1e-2)


def test_master_weights_need_lower_precision_parameters():
  cfg = harness.config(sharding.MeshConfig())
  cfg.optim = dataclasses.replace(cfg.optim, master_weights=True)
  with pytest.raises(ValueError, match="set --config.model.param_dtype=bfloat16"):
    cfg.validate()


def test_masters_are_sharded_like_the_moments_and_the_step_trains():
  """ZeRO-1 over data=4 x tensor=2: each master copy is split like its AdamW moments (over
  `data` too), not like the parameter; after two steps every bf16 parameter is its master
  rounded."""
  cfg = harness.config(sharding.MeshConfig(data=4, tensor=2, zero_stage=1))
  cfg.model = dataclasses.replace(cfg.model, param_dtype="bfloat16", dtype="bfloat16")
  cfg.optim = dataclasses.replace(cfg.optim, master_weights=True)
  cfg.validate()
  trainer = Trainer(cfg)
  trainer.init_state()
  state = trainer.state
  assert isinstance(state.opt_state, MasterWeightsState)
  has_mu = lambda x: hasattr(x, "mu")  # optax.ScaleByAdamState, inside clipping's chain
  adam = next(x for x in jax.tree.leaves(state.opt_state.inner, is_leaf=has_mu) if has_mu(x))
  master_specs = [x.sharding.spec for x in jax.tree.leaves(state.opt_state.master)]
  assert master_specs == [x.sharding.spec for x in jax.tree.leaves(adam.mu)]
  param_specs = [x.sharding.spec for x in jax.tree.leaves(state.params)]
  assert master_specs != param_specs  # ZeRO-1: the optimizer's view splits over data too
  assert any("data" in str(spec) for spec in master_specs)
  losses = []
  with trainer.scope():
    for batch in harness.batches()[:2]:
      state, metrics = trainer.step_fn(state, trainer.to_device(batch))
      losses.append(float(metrics["loss"]))
  for p, m in zip(jax.tree.leaves(state.params), jax.tree.leaves(state.opt_state.master)):
    assert p.dtype == jnp.bfloat16 and m.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(p), np.asarray(m.astype(jnp.bfloat16)))
  assert np.isfinite(losses).all()
  tx, _ = make_optimizer(cfg.optim, trainer.names, cfg.steps)
  assert isinstance(jax.eval_shape(tx.init, state.params), MasterWeightsState)
