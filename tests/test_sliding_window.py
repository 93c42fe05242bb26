"""Sliding-window attention (Mistral's, every layer): the mask, the XLA lowering, logits equal to
transformers' MistralForCausalLM, export round trip, and training like one device (also under
context parallelism, where the sequence stays in contiguous order and the ring cuts its hops)."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx

import kernels
from kernels import reference
from models import abstract_model, hf
from sharding import MeshConfig
from tests import parallel_harness as harness
from tests.test_hf import TINY, TOKENS, assert_same_tensors, hf_logits, random_hf_model
from tests.test_parallel import assert_same_training

PARITY = 1e-5  # max |logit difference| against transformers in float32 (issue [20])
WINDOW = 8  # shorter than TOKENS' 24 positions


def test_the_window_keeps_the_last_keys_of_each_document():
  """Query i sees key j iff j <= i, i - j < window and both are in one document."""
  segments = jnp.asarray([[1] * 7 + [2] * 5])
  mask = np.asarray(reference.attention_mask(12, segments, causal=True, window=3))[0, 0]
  for i in range(12):
    for j in range(12):
      same = (i < 7) == (j < 7)
      assert mask[i, j] == (j <= i and i - j < 3 and same), (i, j)


def test_the_xla_lowering_equals_the_reference_with_a_window():
  """jax.nn.dot_product_attention's local window (what cuDNN runs) is the reference's."""
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (2, 16, 4, 8))
  k, v = (jax.random.normal(key, (2, 16, 2, 8)) for key in keys[1:])
  want = kernels.attention(q, k, v, causal=True, impl="xla", window=5)
  got = kernels.attention(q, k, v, causal=True, impl="dot_product", window=5)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  full = kernels.attention(q, k, v, causal=True, impl="xla")
  assert np.abs(np.asarray(full - want)).max() > 0.1  # the window really masks


def hf_mistral(path, seed=0):
  """A random MistralForCausalLM with a window of WINDOW (test_hf.random_hf_model)."""
  config = transformers.MistralConfig(**TINY, num_key_value_heads=2, head_dim=16,
                                      sliding_window=WINDOW, attn_implementation="eager")
  return random_hf_model(transformers.MistralForCausalLM, config, path, seed=seed)


def test_mistral_import_export_parity(tmp_path):
  reference_model = hf_mistral(tmp_path / "hf")
  expected = hf_logits(reference_model)
  model = hf.from_pretrained(str(tmp_path / "hf"))
  assert model.config.sliding_window == WINDOW
  diff = np.abs(np.asarray(model(TOKENS)) - expected).max()
  print(f"mistral: max |logits - transformers| = {diff:.3g}")
  assert diff < PARITY
  # The window matters: the same weights with full attention give other logits.
  graphdef, _ = abstract_model(dataclasses.replace(model.config, sliding_window=0))
  full = nnx.merge(graphdef, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  assert np.abs(np.asarray(full(TOKENS)) - expected).max() > 100 * PARITY

  hf.save_pretrained(model, str(tmp_path / "out"))
  written = json.loads((tmp_path / "out" / "config.json").read_text())
  assert written["architectures"] == ["MistralForCausalLM"]
  assert written["sliding_window"] == WINDOW
  assert_same_tensors(tmp_path / "hf", tmp_path / "out")
  reloaded = transformers.MistralForCausalLM.from_pretrained(tmp_path / "out",
                                                             attn_implementation="eager").eval()
  np.testing.assert_array_equal(hf_logits(reloaded), expected)


WINDOWED = dataclasses.replace(harness.MODEL, sliding_window=5)


@pytest.fixture(scope="module")
def windowed_reference():
  """The windowed tiny model (a window of 5 on 16-token packed rows) trained on one device."""
  return harness.run(MeshConfig(data=1), devices=jax.devices()[:1], model=WINDOWED)


def test_a_windowed_model_trains_like_one_device_under_fsdp_and_tensor(windowed_reference):
  """fsdp=4 x tensor=2, at test_parallel.py's tolerances."""
  full = harness.run(MeshConfig(data=1), devices=jax.devices()[:1], model=harness.MODEL)
  assert abs(full.losses[-1] - windowed_reference.losses[-1]) > 1e-4  # the window matters
  assert_same_training(harness.run(MeshConfig(data=1, fsdp=4, tensor=2), model=WINDOWED),
                       windowed_reference)


@pytest.mark.parametrize("context", [2, 4], ids=["context=2,data=4", "context=4,data=2"])
def test_a_windowed_model_trains_like_one_device_under_context(context, windowed_reference):
  """The rows stay in the contiguous order and the ring runs the 1 hop a window of 5 reaches
  (tests/test_context_parallel.py counts them): of 1 with 8 tokens per device, of 3 with 4 (so
  a batch left in the zigzag order would miss keys there)."""
  assert_same_training(harness.run(MeshConfig(data=8 // context, context=context),
                                   model=WINDOWED), windowed_reference)


def test_the_mistral_7b_preset_has_the_published_parameter_count():
  from configs import llama
  m = llama.MODELS["mistral_7b"]
  assert m.sliding_window == 4096 and m.num_params() == 7_241_732_096


def test_mixtral_with_a_window_import_export_parity(tmp_path):
  """Mixtral's config.json may set a window too (every layer): read, matched and written back."""
  config = transformers.MixtralConfig(**TINY, num_key_value_heads=2, head_dim=16,
                                      num_local_experts=4, num_experts_per_tok=2,
                                      sliding_window=WINDOW, attn_implementation="eager")
  reference_model = random_hf_model(transformers.MixtralForCausalLM, config, tmp_path / "hf")
  expected = hf_logits(reference_model)
  model = hf.from_pretrained(str(tmp_path / "hf"))
  assert model.config.sliding_window == WINDOW and model.config.moe is not None
  assert np.abs(np.asarray(model(TOKENS)) - expected).max() < PARITY
  hf.save_pretrained(model, str(tmp_path / "out"))
  assert json.loads((tmp_path / "out" / "config.json").read_text())["sliding_window"] == WINDOW
  reloaded = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "out",
                                                             attn_implementation="eager").eval()
  np.testing.assert_array_equal(hf_logits(reloaded), expected)
