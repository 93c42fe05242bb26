"""The chunked cross-entropy: the dense loss's sums and gradients, O(chunk x vocab) memory, and
vocab-parallel logits that are never gathered."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sharding
from kernels import reference
from kernels.cross_entropy import chunked_cross_entropy
from models import ComputeConfig, ModelConfig, abstract_model, param_names
from models.builder import init_params
from sharding.xla import hlo
from trainer import loss
from trainer.config import StepConfig
from trainer.step import make_grads_fn

TINY = ModelConfig(vocab_size=64, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, mlp_dim=64)


def problem(batch=2, length=50, dim=32, vocab=96, seed=0):
  rng = np.random.default_rng(seed)
  h = jnp.asarray(rng.normal(size=(batch, length, dim)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(dim, vocab)) / np.sqrt(dim), jnp.float32)
  targets = jnp.asarray(rng.integers(0, vocab, (batch, length)), jnp.int32)
  mask = jnp.asarray(rng.random((batch, length)) < 0.8, jnp.float32)
  return h, w, targets, mask


def trainer_dense(h, w, targets, mask, z_loss):
  """What the dense path computes: the model's logits, then trainer.loss.cross_entropy_sums."""
  return loss.cross_entropy_sums(jnp.einsum("BLD,DV->BLV", h, w), targets, mask, z_loss)


def value_and_grads(fn, h, w, targets, mask):
  return jax.value_and_grad(lambda h, w: fn(h, w, targets, mask), argnums=(0, 1),
                            has_aux=True)(h, w)


@pytest.mark.parametrize("chunk", [16, 50, 64])  # padded tail, one chunk, chunk > length
def test_chunked_equals_dense_sums_stats_and_gradients(chunk):
  h, w, targets, mask = problem()
  z_loss = 1e-3
  chunked = lambda *a: chunked_cross_entropy(*a, z_loss=z_loss, chunk=chunk)
  (got, got_stats), got_grads = value_and_grads(chunked, h, w, targets, mask)
  for dense in (lambda *a: reference.cross_entropy(*a, z_loss),
                lambda *a: trainer_dense(*a, z_loss)):
    (want, want_stats), want_grads = value_and_grads(dense, h, w, targets, mask)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for key in ("nll_sum", "z_loss_sum", "tokens"):
      np.testing.assert_allclose(got_stats[key], want_stats[key], rtol=1e-6)
    for a, b in zip(got_grads, want_grads):
      assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b)


@pytest.mark.parametrize("tied", [False, True])
def test_model_with_chunked_loss_gives_the_dense_gradients(tied):
  """The train step's loss path: hidden states + head weights (tied: the embedding transposed)
  through the chunked loss equal logits through the dense loss."""
  cfg = dataclasses.replace(TINY, tie_embeddings=tied)
  dense, chunked = ComputeConfig(), ComputeConfig(loss_impl="chunked", loss_chunk_size=8)
  params = init_params(cfg, jax.random.PRNGKey(0))
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 64, (4, 21)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
           "positions": np.tile(np.arange(20, dtype=np.int32), (4, 1)),
           "segment_ids": np.ones((4, 20), np.int32),
           "loss_mask": (rng.random((4, 20)) < 0.7).astype(np.float32)}
  results = []
  for compute in (dense, chunked):
    graphdef, _ = abstract_model(cfg, compute)
    step_cfg = StepConfig(z_loss=1e-4)
    results.append(jax.jit(make_grads_fn(graphdef, param_names(cfg, compute), sharding.Layout(),
                                         step_cfg))(params, batch))
  (dense_grads, dense_stats), (chunked_grads, chunked_stats) = results
  for key in dense_stats:
    np.testing.assert_allclose(chunked_stats[key], dense_stats[key], rtol=1e-6)
  for a, b in zip(jax.tree.leaves(chunked_grads), jax.tree.leaves(dense_grads)):
    assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b)


def compiled_temp_bytes(fn, batch, length, dim, vocab):
  args = (jax.ShapeDtypeStruct((batch, length, dim), jnp.float32),
          jax.ShapeDtypeStruct((dim, vocab), jnp.float32),
          jax.ShapeDtypeStruct((batch, length), jnp.int32),
          jax.ShapeDtypeStruct((batch, length), jnp.float32))
  grads = jax.jit(jax.grad(lambda h, w, t, m: fn(h, w, t, m)[0], argnums=(0, 1)))
  return grads.lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_chunked_loss_needs_a_tenth_of_the_dense_memory():
  """Vocab 128k x seq 4096, loss and gradients: the dense path's temporaries hold [L, V] float32
  logits and their gradient (several GiB); the chunked one [chunk, V] tiles. D = 256 on XLA:CPU,
  whose head-gradient accumulation adds a [D, V] buffer (the H100 compile in test_kernels_gpu
  shows the same ratio at D = 4096)."""
  shape = dict(batch=1, length=4096, dim=256, vocab=128 * 1024)
  dense = compiled_temp_bytes(lambda *a: trainer_dense(*a, 1e-4), **shape)
  chunked = compiled_temp_bytes(lambda *a: chunked_cross_entropy(*a, z_loss=1e-4, chunk=256),
                                **shape)
  assert dense >= 4 * 4096 * 128 * 1024  # at least the float32 logits
  assert chunked * 10 <= dense, (chunked / 2**20, dense / 2**20)


def test_vocab_parallel_logits_are_never_gathered():
  """Under tensor parallelism the head's vocab dim stays split: each device reduces its own
  [B, chunk, V/4] tile (all-reduces of per-token scalars), and the sums equal one device's."""
  h, w, targets, mask = problem(batch=4, length=32, dim=32, vocab=256)
  mesh = sharding.make_mesh(sharding.MeshConfig(data=2, tensor=4))
  fn = lambda h, w: loss.chunked_cross_entropy_sums(h, w, targets, mask, 1e-3, chunk=8)
  want = jax.value_and_grad(fn, argnums=(0, 1), has_aux=True)(h, w)
  with sharding.use_rules(mesh):
    h_sharded = jax.device_put(h, sharding.named_sharding(("batch", "seq", "act_embed"), h.shape))
    w_sharded = jax.device_put(w, sharding.named_sharding(("embed", "vocab"), w.shape))
    step = jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=True))
    text = step.lower(h_sharded, w_sharded).compile().as_text()
    got = step(h_sharded, w_sharded)
  vocab_sized = [c for c in hlo.collectives(text, 8) if 256 in c.shape or 64 in c.shape]
  assert not [c for c in vocab_sized if c.kind == "all-gather"], vocab_sized
  np.testing.assert_allclose(got[0][0], want[0][0], rtol=1e-6)
  for a, b in zip(got[1], want[1]):
    assert np.linalg.norm(np.asarray(a) - b) <= 1e-5 * np.linalg.norm(b)
