"""Per-layer sliding-window patterns (GPT-OSS alternating local/global, Gemma 3's five to one):
`model.full_attention_every`. Each layer gets its static window, in the scan, unrolled, in every
kernel and under context parallelism; the estimator counts the windows' work and ring hops."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kernels.ring_attention import ring_hops
from models import ComputeConfig
from models.config import ModelConfig
from models.transformer import Transformer
from sharding import MeshConfig
from sharding.plan import context_parallel
from sharding.plan.estimate import attention_span, model_spec
from tests import parallel_harness as harness
from tests.test_parallel import assert_same_training

# 4 layers, window 3 over 16 tokens; every 2nd layer (1 and 3) attends fully (GPT-OSS's pattern).
PATTERN = ModelConfig(vocab_size=64, embed_dim=32, num_layers=4, num_heads=4, num_kv_heads=2,
                      head_dim=8, mlp_dim=48, sliding_window=3, full_attention_every=2)
XLA = ComputeConfig(attention_impl="xla")
TOKENS = np.random.default_rng(0).integers(0, 64, (2, 16)).astype(np.int32)


def logits(cfg, params=None, compute=XLA):
  graphdef, state = nnx.split(Transformer(cfg, compute, rngs=nnx.Rngs(0)))
  return np.asarray(nnx.merge(graphdef, state if params is None else params)(TOKENS)), state


def test_each_layer_attends_through_its_own_window():
  """The model's logits equal its blocks run one by one with windows 3, full, 3, full; in the
  unrolled model with remat too; and differ from a window in every layer and from none."""
  got, _ = logits(PATTERN)
  model = Transformer(PATTERN, XLA, rngs=nnx.Rngs(0))
  graphdef, stacked = nnx.split(model.layers)
  x = model.embed_tokens(TOKENS)
  positions = jnp.broadcast_to(jnp.arange(16), TOKENS.shape)
  for layer in range(4):
    block = nnx.merge(graphdef, jax.tree.map(lambda a, i=layer: a[i], stacked))
    x = block(x, positions, None, window=0 if layer % 2 else 3)
  np.testing.assert_allclose(got, model.logits(model.final_norm(x)), atol=1e-5)
  unrolled, _ = logits(PATTERN, compute=dataclasses.replace(XLA, scan_layers=False,
                                                            remat="full"))
  np.testing.assert_allclose(unrolled, got, atol=1e-5)
  for other in (dict(full_attention_every=0), dict(sliding_window=0, full_attention_every=0)):
    assert np.abs(logits(dataclasses.replace(PATTERN, **other))[0] - got).max() > 0.1


def test_the_pattern_runs_in_the_flash_kernel_and_xla_lowering():
  """pallas_flash (interpret mode) and dot_product run each layer's window: the reference's
  logits with the same weights."""
  want, params = logits(PATTERN)
  for impl in ("pallas_flash", "dot_product"):
    got, _ = logits(PATTERN, params, ComputeConfig(attention_impl=impl))
    assert np.abs(got - want).max() < 1e-5, impl


def test_patterns_that_do_not_fit_the_layers_are_refused():
  for bad in (dict(sliding_window=0), dict(full_attention_every=3), dict(full_attention_every=1)):
    with pytest.raises(ValueError, match="full_attention_every=.* needs"):
      dataclasses.replace(PATTERN, **bad).validate()


def test_a_pattern_trains_like_one_device_under_context_4():
  """context=4 x data=2: windowed layers run 1 of the ring's 3 hops (window 5 over local blocks
  of 4 tokens: ceil(4 / 4)), full layers all 3, in the contiguous order the window asks for."""
  model = dataclasses.replace(harness.MODEL, sliding_window=5, full_attention_every=2)
  assert ring_hops(4, harness.SEQ // 4, 5, contiguous=True) == 1
  ref = harness.run(MeshConfig(data=1), devices=jax.devices()[:1], model=model)
  assert_same_training(harness.run(MeshConfig(data=2, context=4), model=model), ref)


def test_the_estimator_counts_the_windows_work_and_hops():
  """attention_span is twice the mean keys a query sees (brute force over the causal window
  mask, within 0.1%), per layer of the pattern; the planner's ring hops are the kernel's."""
  seq, window = 4096, 1024
  keys = np.minimum(np.arange(seq) + 1, window).mean()
  assert attention_span(seq, window) == pytest.approx(2 * keys, rel=1e-3)
  assert attention_span(seq, window, 4) == pytest.approx((3 * 2 * keys + seq) / 4, rel=1e-3)
  assert attention_span(seq, 0) == attention_span(seq, 2 * seq) == seq
  mistral = model_spec(dataclasses.replace(PATTERN, full_attention_every=0, sliding_window=window),
                       XLA)
  pattern = model_spec(dataclasses.replace(PATTERN, sliding_window=window), XLA)
  for context in (2, 4, 8, 16):
    windowed = ring_hops(context, seq // context, window, contiguous=True)
    assert context_parallel.ring_hops(mistral, context, seq) == windowed
    assert context_parallel.ring_hops(pattern, context, seq) == (windowed + context - 1) / 2
  assert context_parallel.ring_hops(mistral, 16, seq) == 4 < 15  # the window really saves hops
  full = dataclasses.replace(PATTERN, sliding_window=0, full_attention_every=0)
  assert PATTERN.flops_per_token(seq) < full.flops_per_token(seq)
  assert model_spec(PATTERN, XLA).flops_per_token(seq) == pytest.approx(
      PATTERN.flops_per_token(seq))
