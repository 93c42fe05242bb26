"""The pure train step: gradient accumulation, loss masking, optimizer pieces, single compile."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax

import sharding
from models import ComputeConfig, ModelConfig, abstract_model, param_names
from trainer import loss
from trainer.config import OptimConfig, StepConfig
from trainer.optim import decay_mask, make_optimizer, schedule
from tests.parallel_harness import sharded_state
from trainer.step import make_train_step

TINY = ModelConfig(vocab_size=64, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, mlp_dim=64)


def random_batch(seed, batch=8, length=16, vocab=64):
  """A packed-looking batch with uneven loss masks, so microbatches hold different token counts."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, (batch, length + 1)).astype(np.int32)
  mask = (rng.random((batch, length)) < np.linspace(0.2, 1.0, batch)[:, None]).astype(np.float32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
          "positions": np.tile(np.arange(length, dtype=np.int32), (batch, 1)),
          "segment_ids": np.ones((batch, length), np.int32), "loss_mask": mask}


def one_device_state(tx, cfg=TINY):
  mesh = sharding.make_mesh(sharding.MeshConfig(), jax.devices()[:1])
  with sharding.use_rules(mesh):
    graphdef, _ = abstract_model(cfg)
    state, _ = sharded_state(cfg, tx, param_names(cfg), seed=0)
  return graphdef, state


def test_gradient_accumulation_equals_one_big_batch():
  """With SGD(lr=1) the parameter change is exactly the gradient, so comparing parameters after
  one step compares gradients; 4 microbatches must match 1 batch of 4x the size."""
  tx = optax.sgd(1.0)
  graphdef, state = one_device_state(tx)
  batch = random_batch(0)
  steps = {n: jax.jit(make_train_step(graphdef, param_names(TINY), tx, lambda s: 1.0,
                                       sharding.Layout(microbatches=n), StepConfig()))
           for n in (1, 4)}
  loops = {n: step.lower(state, batch).as_text().count("stablehlo.while") for n, step in steps.items()}
  assert loops[4] == loops[1] + 1  # really a scan over microbatches around the layer scan
  (big, m_big), (acc, m_acc) = steps[1](state, batch), steps[4](state, batch)
  np.testing.assert_allclose(m_big["loss"], m_acc["loss"], rtol=1e-6)
  assert float(m_big["tokens"]) == float(np.sum(batch["loss_mask"]))
  for a, b, p in zip(jax.tree.leaves(big.params), jax.tree.leaves(acc.params),
                     jax.tree.leaves(state.params)):
    grad_big, grad_acc = np.asarray(a) - np.asarray(p), np.asarray(b) - np.asarray(p)
    assert np.linalg.norm(grad_big) > 0
    # Same math, different float32 summation order: relative L2 error per tensor below 1e-5.
    assert np.linalg.norm(grad_big - grad_acc) <= 1e-5 * np.linalg.norm(grad_big)


def test_loss_mask_excludes_tokens():
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, 4, 8)), jnp.float32)
  targets = jnp.asarray([[1, 2, 3, 4], [5, 6, 7, 0]], jnp.int32)
  mask = jnp.asarray([[1, 1, 0, 0], [1, 0, 0, 0]], jnp.float32)
  total, stats = loss.cross_entropy_sums(logits, targets, mask)
  expected = -sum(jax.nn.log_softmax(logits[b, t])[targets[b, t]]
                  for b, t in [(0, 0), (0, 1), (1, 0)])
  np.testing.assert_allclose(total, expected, rtol=1e-6)
  assert float(stats["tokens"]) == 3.0
  with_z, _ = loss.cross_entropy_sums(logits, targets, mask, z_loss=1e-2)
  lse = jax.nn.logsumexp(logits, axis=-1)
  np.testing.assert_allclose(with_z - total, 1e-2 * float(jnp.sum(lse ** 2 * mask)), rtol=1e-5)


def test_weight_decay_mask_follows_logical_names():
  names = param_names(TINY)
  mask = decay_mask(OptimConfig(), names)
  assert mask["layers"]["attn"]["q"]["w"] and mask["layers"]["mlp"]["down"]["w"]
  assert mask["head"]["w"]
  assert not mask["embed"]["table"] and not mask["final_norm"]["scale"]
  assert not mask["layers"]["attn_norm"]["scale"]
  both = decay_mask(OptimConfig(decay_embeddings=True, decay_norms=True), names)
  assert both["embed"]["table"] and both["layers"]["mlp_norm"]["scale"]


def test_schedule_warmup_and_cosine():
  lr = schedule(OptimConfig(learning_rate=1.0, warmup_steps=4, min_learning_rate_ratio=0.1), 20)
  values = [float(lr(s)) for s in range(20)]
  np.testing.assert_allclose(values[:4], [0.25, 0.5, 0.75, 1.0])  # step 0 already trains
  assert all(a >= b for a, b in zip(values[3:], values[4:]))
  np.testing.assert_allclose(values[-1], 0.1, atol=1e-6)


def test_train_step_compiles_once_and_learns():
  """Sharded in/out shardings make the state round-trip exactly: no recompile after step 1."""
  cfg, compute = TINY, ComputeConfig(remat="full")
  layout = sharding.resolve(sharding.MeshConfig(fsdp=2, tensor=2), jax.devices()[:4], cfg,
                            compute, batch_size=8, seq_len=16)
  with layout.scope():
    names = param_names(cfg, compute)
    tx, lr = make_optimizer(OptimConfig(learning_rate=1e-2, warmup_steps=0), names, 10)
    graphdef, _ = abstract_model(cfg, compute, layout.in_train_step())
    state, shardings = sharded_state(cfg, tx, names, seed=0)
    batch_sharding = sharding.named_sharding(("batch", "seq"), (8, 16))
    train_step, traces = make_train_step(graphdef, names, tx, lr, layout), []

    def traced(state, batch):  # runs once per trace: a retrace would be a second compile
      traces.append(1)
      return train_step(state, batch)

    step = jax.jit(traced, donate_argnums=0, in_shardings=(shardings, batch_sharding),
                   out_shardings=(shardings, sharding.replicated()))
    batch = jax.device_put(random_batch(1), batch_sharding)
    losses = []
    for _ in range(6):
      state, metrics = step(state, batch)
      losses.append(float(metrics["loss"]))
  assert len(traces) == 1
  assert losses[-1] < losses[0] - 0.5, losses  # memorizes the one batch
  assert int(state.step) == 6


def test_without_the_document_mask_attention_sees_one_causal_row():
  """data.document_mask=False (StepConfig.document_mask): rows of one document each give the
  same loss as with the mask, from a program without the document mask (cuDNN then needs no
  mask bias); rows of several documents attend across them, so their loss differs."""
  from trainer.step import make_loss_sums
  graphdef, state = one_device_state(optax.sgd(1.0))
  cfg = TINY
  sums = {flag: jax.jit(make_loss_sums(graphdef, sharding.Layout(),
                                       StepConfig(document_mask=flag)))
          for flag in (True, False)}
  one_document = random_batch(1)
  texts = {flag: f.lower(state.params, one_document).as_text() for flag, f in sums.items()}
  # The document mask compares ids query by key: an equality on [B, 1, L, L] (the layers share
  # one scan body), which only the masked program has.
  masks = {flag: len(re.findall(r"compare\s+EQ.*tensor<8x1x16x16xi32>", text))
           for flag, text in texts.items()}
  assert masks == {True: 1, False: 0}, (cfg.num_layers, masks)
  same = {flag: float(f(state.params, one_document)[0]) for flag, f in sums.items()}
  np.testing.assert_allclose(same[True], same[False], rtol=1e-6)
  packed = dict(one_document, segment_ids=np.repeat(np.arange(2, dtype=np.int32), 8)[None]
                .repeat(8, 0))
  across = {flag: float(f(state.params, packed)[0]) for flag, f in sums.items()}
  assert abs(across[True] - across[False]) > 1e-3 * abs(across[True])
  assert document_mask_of(False) is False and document_mask_of(True) is True


def document_mask_of(flag: bool) -> bool:
  """What TrainConfig.step() makes of data.document_mask."""
  from trainer.config import DataConfig, TrainConfig
  return TrainConfig(data=DataConfig(document_mask=flag)).step().document_mask
