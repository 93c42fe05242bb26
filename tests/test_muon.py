"""Muon (trainer/optim.py): one update against numpy, the partition by logical names, fsdp=8 equal
to one device, its analytic cost, and loss curves against AdamW at the same learning rate.

Tolerances: one update vs the float64 numpy algorithm, relative L2 <= 1e-5 (five float32
Newton-Schulz iterations); layouts as tests/test_parallel.py (loss and gradients 1e-5, updates
1e-2).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import param_names
from models.builder import init_params
from sharding import MeshConfig
from sharding.layout import Layout
from sharding.plan import optimizer_cost
from tests import parallel_harness as harness
from tests.test_mla import mla_model
from tests import training_runs
from tests.test_parallel import assert_same_training
from trainer.config import OptimConfig
from trainer.optim import make_optimizer, muon_dims

NS = (3.4445, -4.775, 2.0315)  # the quintic Newton-Schulz coefficients (Keller Jordan's Muon)


def np_orthogonalize(g):
  x = np.asarray(g, np.float64)
  transposed = x.shape[0] > x.shape[1]
  x = x.T if transposed else x
  x = x / (np.linalg.norm(x) + 1e-8)
  a, b, c = NS
  for _ in range(5):
    gram = x @ x.T
    x = a * x + (b * gram + c * gram @ gram) @ x
  return x.T if transposed else x


def np_muon_first_update(g, w, lr, wd, beta=0.95):
  """Step 1 of Nesterov Muon with bias correction (as optax), Moonlight's RMS matching and
  decoupled weight decay, for one fan_in x fan_out matrix."""
  momentum = (1 - beta) * g
  nesterov = beta * momentum / (1 - beta**2) + (1 - beta) * g / (1 - beta)
  scale = 0.2 * math.sqrt(max(g.shape))
  return -lr * (scale * np_orthogonalize(nesterov) + wd * w)


def rel(a, b):
  return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def test_one_muon_update_equals_numpy():
  rng = np.random.default_rng(0)
  names = {"w": ("embed", "mlp"), "q": ("layers", "embed", "heads", "head_dim"),
           "o": ("layers", "heads", "head_dim", "embed"), "table": ("vocab", "embed"),
           "hist": ("layers", "fp8_history")}
  shapes = {"w": (6, 10), "q": (2, 8, 2, 3), "o": (2, 2, 3, 8), "table": (5, 8), "hist": (2, 4)}
  params = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
  grads = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
  cfg = OptimConfig(name="muon", learning_rate=0.1, warmup_steps=0, min_learning_rate_ratio=1.0,
                    weight_decay=0.1, clip_norm=0.0)
  tx, _ = make_optimizer(cfg, names, total_steps=10)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  g, p = ({k: np.asarray(v, np.float64) for k, v in t.items()} for t in (grads, params))
  assert rel(updates["w"], np_muon_first_update(g["w"], p["w"], 0.1, 0.1)) <= 1e-5
  for layer in range(2):  # stacked layers: one matrix each, fan-in x fan-out by logical names
    want = np_muon_first_update(g["q"][layer].reshape(8, 6), p["q"][layer].reshape(8, 6), 0.1, 0.1)
    assert rel(np.asarray(updates["q"][layer]).reshape(8, 6), want) <= 1e-5
    want = np_muon_first_update(g["o"][layer].reshape(6, 8), p["o"][layer].reshape(6, 8), 0.1, 0.1)
    assert rel(np.asarray(updates["o"][layer]).reshape(6, 8), want) <= 1e-5
  # The embedding table takes AdamW (step 1: -lr * g / (|g| + eps), no decay on embeddings).
  np.testing.assert_allclose(updates["table"], -0.1 * g["table"] / (np.abs(g["table"]) + 1e-8),
                             rtol=1e-5)
  assert not np.any(np.asarray(updates["hist"]))  # fp8 state: frozen, overwritten by the step


def test_muon_partition_by_logical_names():
  names = param_names(harness.MODEL)
  assert muon_dims(names["layers"]["attn"]["q"]["w"]) == ((1,), (2, 3))
  assert muon_dims(names["layers"]["attn"]["o"]["w"]) == ((1, 2), (3,))
  assert muon_dims(names["layers"]["mlp"]["down"]["w"]) == ((1,), (2,))
  assert muon_dims(("layers", "experts", "embed", "mlp")) == ((2,), (3,))
  for adamw in (names["embed"]["table"], names["head"]["w"], names["final_norm"]["scale"],
                ("layers", "embed", None)):  # the last: an MoE router
    assert muon_dims(adamw) is None
  # MLA: its latent projections are matrices from the latent.
  assert muon_dims(("layers", "latent_rank", "heads", "head_dim")) == ((1,), (2, 3))
  # The analytic model counts exactly the parameters the optimizer gives Muon (MLA's too).
  for model in (harness.MODEL, mla_model(q_lora_rank=8), mla_model(q_lora_rank=0)):
    abstract = jax.eval_shape(lambda model=model: init_params(model, jax.random.PRNGKey(0)))
    sizes = jax.tree.map(lambda n, a: math.prod(a.shape) if muon_dims(n) else 0,
                         param_names(model), abstract, is_leaf=lambda x: isinstance(x, tuple))
    assert sum(jax.tree.leaves(sizes)) == optimizer_cost.muon_params(model)


def test_muon_under_fsdp8_equals_one_device(monkeypatch):
  monkeypatch.setattr(harness, "OPTIM", dataclasses.replace(harness.OPTIM, name="muon"))
  assert harness.config(MeshConfig(data=1)).optim.name == "muon"
  reference = harness.run(MeshConfig(data=1), devices=jax.devices()[:1])
  assert reference.losses[-1] < reference.losses[0]
  assert_same_training(harness.run(MeshConfig(data=1, fsdp=8)), reference)


def test_newton_schulz_cost_model():
  """FLOPs per device divide by the matrix shards; each iteration all-reduces the m x m Gram."""
  model = harness.MODEL
  one = optimizer_cost.muon_newton_schulz(model, Layout())
  fsdp = optimizer_cost.muon_newton_schulz(model, Layout(fsdp=8))
  assert one.wire_bytes == 0 and fsdp.flops == pytest.approx(one.flops / 8)
  d, f = model.embed_dim, model.mlp_dim  # gate: 32 x 64 -> m = 32
  per_gate = 5 * (4 * d * d * f + 2 * d**3)
  assert one.flops > model.num_layers * 2 * per_gate
  gram_bytes = sum(c * min(a, b) ** 2 * 4 for c, a, b in optimizer_cost.muon_matrices(model))
  assert fsdp.wire_bytes == pytest.approx(model.num_layers * 5 * 2 * 7 / 8 * gram_bytes)


def curves():
  adamw = training_runs.losses(100)
  muon = training_runs.losses(100, optimizer="muon")
  return adamw, muon


def test_muon_trains_the_tiny_model():
  """Same data, init, learning rate and schedule (peak 3e-3, 20 warmup steps, cosine)."""
  adamw, muon = curves()
  assert muon != adamw
  assert training_runs.mean(muon, 90, 100) < training_runs.mean(muon, 0, 10) - 0.9


@pytest.mark.xfail(strict=True, reason="measured: Muon is behind AdamW at 100 steps on this"
                   " 0.16M-parameter model (last-10 mean 3.90 vs 3.61); AdamW's first steps are"
                   " sign-like (update RMS ~ lr) while Moonlight's matched Muon update has RMS"
                   " 0.2 lr, so Muon starts slower and only catches up by ~300 steps")
def test_muon_reaches_lower_loss_than_adamw_at_equal_steps():
  adamw, muon = curves()
  assert training_runs.mean(muon, 90, 100) < training_runs.mean(adamw, 90, 100)


@pytest.mark.slow
def test_muon_matches_adamw_after_300_steps():
  """Measured 25-step window means (AdamW / Muon): 3.955/4.346 at the start, 2.249/2.251 at the
  end; Muon is ahead in some middle windows and behind in others."""
  adamw, muon = training_runs.losses(300), training_runs.losses(300, optimizer="muon")
  assert abs(training_runs.mean(muon, 250, 300) - training_runs.mean(adamw, 250, 300)) <= 0.03
