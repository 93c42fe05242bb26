"""The precision policy: bf16 compute tracks fp32, gradient accumulation in bf16 or fp32, one-line
errors for bad settings, and per-precision memory of the compiled step against the analytic model.

Tolerances, stated once:
  * bf16 compute (fp32 master weights, fp32 loss) vs fp32, same data and init, 50 steps: every
    step's loss within 0.02 nats (measured: at most 0.006).
  * bf16 vs fp32 gradient accumulation over 4 microbatches: relative L2 error of each gradient
    <= 1e-2 (bf16 keeps 8 bits: 4e-3 per rounding) and > 0 (it is a different computation).
  * memory: as tests/test_estimate_vs_compiled.py: parameters + optimizer state within 2% of the
    compiled arguments (less the batch); gradients + activations within a factor 2 of the
    compiled temporaries.
"""

import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest

from models import ComputeConfig
from models.config import ModelConfig
from models.fp8.config import Fp8Config
from sharding import Layout, MeshConfig
from sharding.plan import estimate, optimizer_cost
from tests import parallel_harness as harness
from tests import training_runs
from tests.test_step import TINY, one_device_state, random_batch
from trainer.config import OptimConfig, StepConfig, TrainConfig
from trainer.trainer import Trainer
from models import param_names
from trainer.step import make_train_step


def test_bf16_compute_tracks_fp32_training():
  """The first 50 steps of 100 (fp32 master weights and loss; only the compute dtype differs)."""
  assert training_runs.config(100, dtype="bfloat16").model.dtype != \
      training_runs.config(100).model.dtype
  fp32 = training_runs.losses(100)[:50]
  bf16 = training_runs.losses(100, dtype="bfloat16")[:50]
  assert fp32 != bf16
  assert training_runs.mean(fp32, 40, 50) < training_runs.mean(fp32, 0, 10) - 1.5  # it learns
  assert max(abs(a - b) for a, b in zip(fp32, bf16)) <= 0.02


def test_bf16_gradient_accumulation_is_close_to_fp32():
  """SGD(lr=1): the parameter change is the gradient. 4 microbatches accumulated in bf16 vs fp32."""
  tx = optax.sgd(1.0)
  graphdef, state = one_device_state(tx)
  names, batch = param_names(TINY), random_batch(0)
  steps = {d: jax.jit(make_train_step(graphdef, names, tx, lambda s: 1.0,
                                      Layout(microbatches=4), StepConfig(grad_accum_dtype=d)))
           for d in ("float32", "bfloat16")}
  texts = {d: s.lower(state, batch).as_text() for d, s in steps.items()}
  assert texts["float32"] != texts["bfloat16"]
  grads = {d: [np.asarray(a) - np.asarray(p) for a, p in zip(
      jax.tree.leaves(s(state, batch)[0].params), jax.tree.leaves(state.params))]
      for d, s in steps.items()}
  errors = [np.linalg.norm(b - f) / np.linalg.norm(f)
            for f, b in zip(grads["float32"], grads["bfloat16"])]
  assert max(errors) <= 1e-2 and max(errors) > 0, errors
  assert all(g.dtype == np.float32 for g in grads["bfloat16"])  # cast back to the param dtype


@pytest.mark.parametrize("change,message", [
    (lambda c: setattr(c, "grad_accum_dtype", "float16"), "grad_accum_dtype='float16' is not one of"),
    (lambda c: setattr(c.compute.fp8, "recipe", "current"), "compute.fp8.recipe='current' is not one"),
    (lambda c: setattr(c.compute.fp8, "targets", "mlp,router"), "names ['router']"),
    (lambda c: setattr(c.compute.fp8, "amax_history", 0), "compute.fp8.amax_history must be positive"),
    (lambda c: (setattr(c.compute.fp8, "targets", "head"), setattr(c.model, "tie_embeddings", True)),
     "needs an untied head"),
    (lambda c: setattr(c.optim, "name", "lion"), "optim.name='lion' is not one of"),
    (lambda c: setattr(c.optim, "muon_beta", 1.0), "optim.muon_beta must be in [0, 1)"),
    (lambda c: setattr(c.optim, "muon_ns_steps", 0), "optim.muon_ns_steps and"),
])
def test_bad_precision_and_optimizer_settings_are_one_line_errors(change, message):
  cfg = TrainConfig(model=ModelConfig(), compute=ComputeConfig(fp8=Fp8Config(enabled=True)))
  cfg.validate()
  change(cfg)
  with pytest.raises(ValueError) as error:
    cfg.validate()
  assert message in str(error.value) and "\n" not in str(error.value)


# name: (mesh sizes, model changes, train-config changes); the first two run with the slow set.
CASES = {
    "bf16 compute, dp": (dict(data=8), dict(dtype="bfloat16"), {}),
    "bf16 params and compute, zero1": (dict(data=8, zero_stage=1),
                                       dict(dtype="bfloat16", param_dtype="bfloat16"), {}),
    "bf16 compute, bf16 accumulation, fsdp, ga=4": (
        dict(fsdp=8), dict(dtype="bfloat16"), dict(microbatches=4, grad_accum_dtype="bfloat16")),
    "fp8, fsdp+tp": (dict(fsdp=4, tensor=2), dict(dtype="bfloat16"),
                     dict(compute=dataclasses.replace(harness.COMPUTE,
                                                      fp8=Fp8Config(enabled=True)))),
    "muon, fsdp": (dict(fsdp=8), {}, dict(optim=OptimConfig(name="muon"))),
}


@functools.lru_cache(maxsize=None)
def measured(name):
  """(compiled memory analysis, analytic Memory, analytic fp8 state bytes, layout)."""
  mesh_kw, model_kw, train_kw = CASES[name]
  mesh = MeshConfig(**{"data": 1, **mesh_kw})
  cfg = dataclasses.replace(harness.config(mesh, model=dataclasses.replace(harness.MODEL,
                                                                             **model_kw)),
                            **train_kw)
  trainer = Trainer(cfg)
  with trainer.scope():
    stats = trainer.train_step.lower(trainer.abstract_state,
                                     trainer.abstract_batch()).compile().memory_analysis()
  m, layout, fp8_cfg = cfg.model, cfg.layout(8), cfg.compute.fp8
  precision = estimate.trainer_precision(m.dtype, m.param_dtype, cfg.grad_accum_dtype)
  estimator = optimizer_cost.muon_memory if cfg.optim.name == "muon" else estimate.memory
  est = estimator(estimate.model_spec(m, cfg.compute), layout, cfg.seq_len, precision,
                  workspace_bytes=0)
  # fp8 histories: float32 parameters with two (unused) AdamW moments, replicated.
  fp8 = 3 * 4 * optimizer_cost.fp8_state_elements(
      m, fp8_cfg.amax_history, recipe=fp8_cfg.recipe) if fp8_cfg.enabled else 0
  return stats, est, fp8, layout


SLOW = ("bf16 compute, dp", "bf16 params and compute, zero1")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                                  for n in CASES])
def test_memory_per_precision_compiled_vs_analytic(name):
  stats, est, fp8, layout = measured(name)
  batch = 5 * harness.BATCH * harness.SEQ * 4 // layout.batch_shards
  assert est.params + est.optimizer + fp8 == pytest.approx(
      stats.argument_size_in_bytes - batch, rel=0.02)
  analytic = est.grads + est.activations + est.logits + est.temporaries
  assert 0.5 <= analytic / stats.temp_size_in_bytes <= 2.0


def test_muon_needs_less_optimizer_state_than_adamw():
  """Muon keeps one momentum where AdamW keeps two moments (hidden matrices): the compiled
  arguments are smaller than AdamW's analytic state by the estimated difference."""
  stats, est, _, layout = measured("muon, fsdp")
  adamw = estimate.memory(estimate.model_spec(harness.MODEL, harness.COMPUTE), layout, harness.SEQ,
                          estimate.trainer_precision("float32"), workspace_bytes=0)
  assert est.optimizer < adamw.optimizer
  batch = 5 * harness.BATCH * harness.SEQ * 4 // layout.batch_shards
  assert stats.argument_size_in_bytes - batch < 0.99 * (adamw.params + adamw.optimizer)
