"""The MoE layer: router math, dispatch paths == a dense reference, drops, balancing, counts."""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import sharding
from configs import moe as moe_configs
from models import ComputeConfig, ModelConfig, abstract_model, param_names
from models.config import MoEConfig
from models.moe import MoE, Router, capacity, dispatch_masks, limit_to_groups, update_bias
from sharding.plan.estimate import model_spec
from trainer.config import OptimConfig, StepConfig
from trainer.optim import frozen_mask, make_optimizer
from tests.parallel_harness import sharded_state
from trainer.state import make_init_fn
from trainer.step import make_train_step

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ModelConfig(vocab_size=64, embed_dim=32, num_layers=3, num_heads=4, num_kv_heads=2,
                   head_dim=8, mlp_dim=64)
# Capacity factor E / k: every expert can take every token of a group, so nothing drops.
NO_DROPS = MoEConfig(num_experts=8, experts_per_token=2, expert_mlp_dim=16,
                     num_shared_experts=1, capacity_factor=4.0)


def with_moe(**changes) -> ModelConfig:
  return dataclasses.replace(BASE, moe=dataclasses.replace(NO_DROPS, **changes))


def moe_layer(cfg: ModelConfig, seed: int) -> MoE:
  """One MoE layer of `cfg` on one device (the default compute, kernels for JAX's backend)."""
  return MoE(cfg, ComputeConfig(), sharding.local_layout(cfg), rngs=nnx.Rngs(seed))


def tokens_x(seed=0, shape=(4, 16, 32)):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_dispatch_paths_equal_the_dense_reference(router):
  """Dropping (capacity never reached) and dropless equal every-expert-on-every-token mixed by
  the router weights, forward and gradient (float32; measured errors ~1e-6 and ~1e-6)."""
  layer = moe_layer(with_moe(router=router, bias_update_rate=0.01), 0)
  graphdef, state = nnx.split(layer)
  x = tokens_x()

  def loss(state, x, dispatch):
    y, stats = nnx.merge(graphdef, state)(x, dispatch)
    return jnp.sum(jnp.sin(y)), stats

  (ref, _), ref_grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(state, x, "dense")
  for dispatch in ("dropping", "dropless"):
    (out, stats), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(state, x,
                                                                               dispatch)
    assert float(stats["dropped"]) == 0
    np.testing.assert_allclose(out, ref, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
      assert np.linalg.norm(got - want) <= 1e-5 * max(np.linalg.norm(want), 1e-30)


def test_router_weights_and_losses_by_hand():
  x = tokens_x(1, (2, 8, 32))
  for kind, scaling in (("softmax", 1.0), ("sigmoid", 2.5)):
    router = Router(with_moe(router=kind, routed_scaling=scaling), rngs=nnx.Rngs(1))
    ids, weights, stats = router(x)
    logits = np.einsum("bld,de->ble", x, router.w[...])
    scores = jax.nn.softmax(logits) if kind == "softmax" else jax.nn.sigmoid(logits)
    np.testing.assert_array_equal(ids, jax.lax.top_k(scores, 2)[1])
    picked = np.take_along_axis(np.asarray(scores), np.asarray(ids), -1)
    np.testing.assert_allclose(weights, scaling * picked / picked.sum(-1, keepdims=True),
                               rtol=1e-6)
    probs = scores / np.sum(scores, -1, keepdims=True)
    for row in range(2):  # the balance loss of each sequence
      fraction = np.bincount(np.asarray(ids[row]).ravel(), minlength=8) / ids[row].size
      np.testing.assert_allclose(stats["aux_loss"][row],
                                 8 * np.sum(fraction * probs[row].mean(0)), rtol=1e-5)
    np.testing.assert_allclose(stats["z_loss"], jax.nn.logsumexp(logits, -1) ** 2, rtol=1e-5)
    np.testing.assert_array_equal(stats["load"], np.bincount(np.asarray(ids).ravel(), minlength=8))
  # Perfectly uniform routing gives the balance loss its minimum, 1.
  uniform = Router(with_moe(), rngs=nnx.Rngs(0))
  uniform.w[...] = jnp.zeros_like(uniform.w[...])
  np.testing.assert_allclose(uniform(x)[2]["aux_loss"], 1.0, rtol=1e-6)


def test_small_capacity_drops_exactly_the_late_assignments():
  """GShard order: first choices in sequence order, then second choices; an expert keeps its
  first C assignments. The output then lacks exactly the dropped assignments' terms."""
  rng = np.random.default_rng(2)
  b, l, k, e = 3, 16, 2, 8
  ids = np.argsort(rng.random((b, l, e)), -1)[..., :k].astype(np.int32)  # distinct per token
  ids[0, :, 0] = 0  # row 0: every first choice is expert 0, far over capacity
  slots = capacity(l, k, e, 1.0)
  assert slots == 4
  kept = np.zeros((b, l, k), bool)
  for row in range(b):
    used = np.zeros(e, int)
    for choice in range(k):
      for t in range(l):
        expert = ids[row, t, choice]
        kept[row, t, choice] = used[expert] < slots
        used[expert] += 1
  weights = rng.random((b, l, k)).astype(np.float32)
  dispatch, combine, dropped = dispatch_masks(jnp.asarray(ids), jnp.asarray(weights), e, slots)
  assert int(dropped) == int((~kept).sum()) and (~kept[0, :, 0]).sum() == l - slots
  np.testing.assert_array_equal(np.asarray(dispatch).sum((2, 3)), kept.sum(-1))
  assert np.asarray(dispatch).sum(1).max() == 1  # one assignment per (expert, slot)
  np.testing.assert_allclose(np.asarray(combine).sum((2, 3)), (weights * kept).sum(-1),
                             rtol=1e-6)
  # Through the layer: the dropping output equals the reference with dropped weights zeroed.
  layer = moe_layer(with_moe(capacity_factor=1.0, num_shared_experts=0), 3)
  # Every token's logits are 0..7 (feature 0 is 1, the router reads only it): experts 7, 6.
  layer.router.w[...] = jnp.zeros((32, 8)).at[0].set(jnp.arange(8.0))
  x = tokens_x(3, (2, 16, 32)).at[..., 0].set(1.0)
  y, stats = layer(x, "dropping")
  ids, weights, _ = layer.router(x)
  assert float(stats["dropped"]) == 2 * 16 * 2 - 2 * 2 * slots  # 2 experts take 4 slots a row
  every = layer.experts.every_token(x)
  mix = np.zeros((2, 16, 8))
  for row in range(2):
    for t in range(16):
      for choice in range(2):
        if t < slots:
          mix[row, t, ids[row, t, choice]] += weights[row, t, choice]
  np.testing.assert_allclose(y, np.einsum("ble,bled->bld", mix, every), rtol=1e-5, atol=1e-6)


def test_aux_loss_free_bias_moves_load_toward_balance():
  """A skewed router (expert e's logit + 0.5 e) and the sign update: the largest load, as a
  multiple of the fair share, falls from over 3x to near 1 (curve in the report)."""
  router = Router(with_moe(router="sigmoid", bias_update_rate=0.01), rngs=nnx.Rngs(4))
  router.w[...] = router.w[...].at[0].set(jnp.arange(8.0) * 0.5)  # feature 0 is 1: the skew
  x = tokens_x(4, (8, 32, 32)).at[..., 0].set(1.0)
  curve = []
  for _ in range(80):
    ids, weights, stats = router(x)
    curve.append(float(stats["load"].max() / stats["load"].mean()))
    router.bias[...] = update_bias(router.bias[...], stats["load"], 0.01)
  print("max load / fair share every 10 steps:", [round(c, 2) for c in curve[::10]])
  assert curve[0] > 3.0 and max(curve[-10:]) < 1.5
  # The bias picks the experts, but the mixing weights are the unbiased scores.
  ids_b, weights_b, _ = router(x)
  logits = jnp.einsum("bld,de->ble", x, router.w[...])
  picked = jnp.take_along_axis(jax.nn.sigmoid(logits), ids_b, -1)
  np.testing.assert_allclose(weights_b, picked / picked.sum(-1, keepdims=True), rtol=1e-6)
  assert not np.array_equal(ids, ids_b)


def test_train_step_updates_bias_and_reports_moe_metrics():
  """The optimizer leaves `expert_bias` alone; the step moves it by exactly +-rate (or 0); MoE
  metrics appear only for MoE models."""
  cfg = with_moe(router="sigmoid", bias_update_rate=0.05, first_dense_layers=1)
  names = param_names(cfg)
  frozen = frozen_mask(names)
  assert jax.tree.leaves(frozen).count(True) == 1 and frozen["moe_layers"]["moe"]["router"]["bias"]
  tx, lr = make_optimizer(OptimConfig(learning_rate=0.1, warmup_steps=0), names, 10)
  layout = sharding.resolve(sharding.MeshConfig(), jax.devices()[:1], cfg, batch_size=4,
                            seq_len=16)
  rng = np.random.default_rng(5)
  tokens = rng.integers(0, 64, (4, 17)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
           "positions": np.tile(np.arange(16, dtype=np.int32), (4, 1)),
           "segment_ids": np.ones((4, 16), np.int32), "loss_mask": np.ones((4, 16), np.float32)}
  with layout.scope():
    graphdef, _ = abstract_model(cfg, None, layout.in_train_step())
    state, _ = sharded_state(cfg, tx, names, seed=0)
    new_state, metrics = jax.jit(make_train_step(graphdef, names, tx, lr, layout,
                                                 StepConfig()))(state, batch)
  delta = np.asarray(new_state.params["moe_layers"]["moe"]["router"]["bias"]
                     - state.params["moe_layers"]["moe"]["router"]["bias"])
  assert set(np.round(np.unique(delta) / 0.05).astype(int)) <= {-1, 0, 1} and delta.any()
  assert {"moe_aux_loss", "moe_z_loss", "moe_dropped_fraction", "moe_load_min", "moe_load_max",
          "moe_load_cv"} <= set(metrics)
  assert float(metrics["moe_load_min"]) <= 1.0 <= float(metrics["moe_load_max"])
  assert float(metrics["moe_aux_loss"]) >= 1.0 - 1e-6  # its minimum is 1 (uniform)
  tx = optax.sgd(0.1)
  dense_step = make_train_step(abstract_model(BASE)[0], param_names(BASE), tx, lambda s: 0.1,
                               sharding.Layout(), StepConfig())
  _, dense_metrics = jax.eval_shape(dense_step, jax.eval_shape(make_init_fn(BASE, tx, 0)), batch)
  assert not any(k.startswith("moe") for k in dense_metrics)


def test_config_validation_errors():
  with pytest.raises(ValueError, match="experts_per_token=9 exceeds model.moe.num_experts=8"):
    with_moe(experts_per_token=9).validate()
  with pytest.raises(ValueError, match="first_dense_layers=3 leaves no MoE layer"):
    with_moe(first_dense_layers=3).validate()
  with pytest.raises(ValueError, match="router='top1'"):
    with_moe(router="top1").validate()
  # A config sent through dataclasses.asdict (the GPU compile subprocess) comes back typed.
  assert ModelConfig(**dataclasses.asdict(with_moe())).moe == with_moe().moe


def test_experts_must_divide_the_expert_axis():
  from tests import parallel_harness as harness
  from trainer.trainer import Trainer
  cfg = harness.config(sharding.MeshConfig(data=2, expert=4), moe=dataclasses.replace(
      NO_DROPS, num_experts=6, experts_per_token=2))
  with pytest.raises(ValueError, match=r"experts=6 cannot be split over expert=4"):
    Trainer(cfg)


@pytest.mark.parametrize("name", sorted(moe_configs.MODELS))
def test_parameter_counts_built_total_active_and_estimator(name):
  cfg = moe_configs.model(name)
  _, abstract = abstract_model(cfg)  # abstract: the 675B model is fine on a laptop
  built = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract))
  assert built == cfg.num_params()
  per_token = cfg.active_params()
  if name == "mixtral_8x7b":  # published: 46.7B total, 12.9B active (arXiv:2401.04088)
    assert (round(built / 1e9, 1), round(per_token / 1e9, 1)) == (46.7, 12.9)
  spec = model_spec(cfg)  # leading dense layers included; the routing biases are not
  # (one per MoE layer, and per multi-token-prediction module's MoE block)
  biases = (cfg.moe_layers() + cfg.mtp_depth) * cfg.moe.num_experts \
      if cfg.moe.bias_update_rate else 0
  assert spec.num_params() == pytest.approx(built - biases, rel=1e-12)
  assert spec.flops_per_token(4096) == pytest.approx(cfg.flops_per_token(4096), rel=1e-12)
  # Active parameters drive the FLOPs: 6 x (active matmul weights) + attention.
  matmul = (cfg.flops_per_token(1) - 6 * cfg.num_layers * cfg.num_heads * cfg.head_dim) / 6
  assert matmul < per_token < built


def test_cli_overrides_reach_a_preset_moe():
  """ml-collections applies --config.model.moe.<field> to a preset whose moe is set, despite
  the `MoEConfig | None` annotation."""
  code = ("import sys; from absl import flags; from ml_collections import config_flags;"
          "import configs;"
          "c = config_flags.DEFINE_config_dataclass('config', configs.get('debug'), '',"
          " parse_fn=configs.get);"
          "flags.FLAGS(sys.argv); m = c.value.model.moe;"
          "print(m.num_experts, m.router, m.capacity_factor)")
  out = subprocess.run([sys.executable, "-c", code, "--config=debug_moe",
                        "--config.model.moe.num_experts=4", "--config.model.moe.router=sigmoid",
                        "--config.model.moe.capacity_factor=2.0"], capture_output=True,
                       text=True, cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                       timeout=120)
  assert out.stdout.split() == ["4", "sigmoid", "2.0"], out.stderr[-1000:]


def test_group_limited_routing_picks_only_from_the_best_groups():
  """DeepSeek-V3's routing (8 groups of 4 experts here, 2 kept per token, top-4): per token, the
  groups ranked by the sum of their two best scores; the chosen experts are the top-4 of the kept
  groups' experts, checked token by token in numpy; without the limit other experts win."""
  cfg = dataclasses.replace(
      moe_configs.model("debug_moe"),
      moe=MoEConfig(num_experts=32, experts_per_token=4, router="sigmoid", expert_groups=8,
                    groups_per_token=2))
  cfg.validate()
  router = Router(cfg, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 16, cfg.embed_dim))
  ids, _, _ = router(x)
  scores = np.asarray(jax.nn.sigmoid(jnp.einsum("BLD,DE->BLE", x, router.w[...])))
  ungrouped = np.argsort(-scores, axis=-1, kind="stable")[..., :4]
  differs = 0
  for b in range(2):
    for t in range(16):
      s = scores[b, t].reshape(8, 4)
      group_score = np.sort(s, axis=-1)[:, -2:].sum(-1)
      kept = np.argsort(-group_score, kind="stable")[:2]
      allowed = np.full(32, -np.inf)
      for g in kept:
        allowed[g * 4:(g + 1) * 4] = scores[b, t, g * 4:(g + 1) * 4]
      want = np.argsort(-allowed, kind="stable")[:4]
      np.testing.assert_array_equal(np.asarray(ids[b, t]), want)
      assert len({int(i) // 4 for i in want}) <= 2
      differs += set(want) != set(ungrouped[b, t])
  assert differs > 0
  np.testing.assert_array_equal(limit_to_groups(jnp.asarray(scores), 1, 1), scores)


def test_group_limits_that_cannot_hold_the_top_k_are_refused():
  with pytest.raises(ValueError, match="must divide"):
    MoEConfig(num_experts=10, expert_groups=4).validate(4)
  with pytest.raises(ValueError, match="keep at least experts_per_token"):
    MoEConfig(num_experts=16, experts_per_token=8, expert_groups=8, groups_per_token=2).validate(4)
