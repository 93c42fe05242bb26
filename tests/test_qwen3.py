"""Qwen3 (dense) is the Llama model with QK-norm: logits equal transformers' Qwen3ForCausalLM, the
export reloads there with identical logits, and it trains like one device under fsdp x tensor."""

import dataclasses
import json

import jax
import numpy as np
import pytest
import transformers
from flax import nnx

from configs import llama as llama_presets
from configs import moe as moe_presets
from models import abstract_model, hf
from models.config import MoEConfig
from sharding import MeshConfig
from tests import parallel_harness as harness
from tests.test_hf import TINY, TOKENS, assert_same_tensors, hf_logits, random_hf_model
from tests.test_parallel import assert_same_training

PARITY = 1e-5  # max |logit difference| against transformers in float32 (issue [20])


def hf_qwen3(path, seed=0):
  """A random Qwen3ForCausalLM (GQA, head_dim 16) saved with save_pretrained; weights scaled as
  tests/test_hf.hf_llama's, the QK-norm scales spread wider, so that they matter."""
  config = transformers.Qwen3Config(**TINY, num_key_value_heads=2, head_dim=16,
                                    tie_word_embeddings=False, attn_implementation="eager")
  return random_hf_model(transformers.Qwen3ForCausalLM, config, path, seed=seed,
                         norm_spread=0.3)


def test_qwen3_import_export_parity(tmp_path):
  reference = hf_qwen3(tmp_path / "hf")
  expected = hf_logits(reference)
  model = hf.from_pretrained(str(tmp_path / "hf"))
  assert model.config.qk_norm and model.config.rope_theta == TINY["rope_theta"]
  diff = np.abs(np.asarray(model(TOKENS)) - expected).max()
  print(f"qwen3: max |logits - transformers| = {diff:.3g}")
  assert diff < PARITY

  hf.save_pretrained(model, str(tmp_path / "out"))
  assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == [
      "Qwen3ForCausalLM"]
  assert_same_tensors(tmp_path / "hf", tmp_path / "out")
  reloaded = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "out",
                                                           attn_implementation="eager").eval()
  np.testing.assert_array_equal(hf_logits(reloaded), expected)


def test_the_qk_norm_matters(tmp_path):
  """The parity above would be vacuous if the norms changed nothing: the same weights in the model
  without QK-norm (a Llama) give other logits."""
  expected = hf_logits(hf_qwen3(tmp_path / "hf"))
  model = hf.from_pretrained(str(tmp_path / "hf"))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  for name in ("q_norm", "k_norm"):
    del params["layers"]["attn"][name]
  graphdef, _ = abstract_model(dataclasses.replace(model.config, qk_norm=False))
  as_llama = nnx.merge(graphdef, params)
  assert np.abs(np.asarray(as_llama(TOKENS)) - expected).max() > 100 * PARITY


def test_qwen3_trains_like_one_device_under_fsdp_and_tensor():
  """fsdp=4 x tensor=2 (the norm scales replicated, q and k split over heads), at the tolerances
  of tests/test_parallel.py; the model really has the QK-norm parameters."""
  model = dataclasses.replace(harness.MODEL, qk_norm=True)
  ref = harness.run(MeshConfig(data=1), devices=jax.devices()[:1], model=model)
  got = harness.run(MeshConfig(data=1, fsdp=4, tensor=2), model=model)
  _, params = abstract_model(model)
  assert params["layers"]["attn"]["q_norm"]["scale"].shape == (model.num_layers, model.head_dim)
  assert_same_training(got, ref)


def test_qwen3_presets_have_the_published_parameter_counts():
  """Qwen3-8B: 8.19B parameters, 6.95B without the (untied) embeddings; Qwen3-32B: 32.8B, 31.2B
  (the model cards)."""
  for name, total, body in (("qwen3_8b", 8.19e9, 6.95e9), ("qwen3_32b", 32.8e9, 31.2e9)):
    m = llama_presets.MODELS[name]
    assert m.qk_norm and not m.tie_embeddings
    assert round(m.num_params() / 1e9, 2 if total < 1e10 else 1) == total / 1e9
    embeddings = 2 * m.vocab_size * m.embed_dim
    assert round((m.num_params() - embeddings) / 1e9, 2 if body < 1e10 else 1) == body / 1e9


def hf_qwen3_moe(path, norm_topk_prob, seed=0):
  """A random Qwen3MoeForCausalLM (4 experts of width 32, top-2), weights scaled as hf_qwen3's."""
  config = transformers.Qwen3MoeConfig(**TINY, num_key_value_heads=2, head_dim=16,
                                       num_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=32, norm_topk_prob=norm_topk_prob,
                                       attn_implementation="eager")
  return random_hf_model(transformers.Qwen3MoeForCausalLM, config, path, seed=seed,
                         norm_spread=0.3)


@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["normalized", "raw_top_k"])
def test_qwen3_moe_import_export_parity(tmp_path, norm_topk_prob):
  """Qwen3-MoE: QK-norm and a MoE in every layer (router `mlp.gate`, per-expert gate/up/down
  projections, no shared expert); norm_topk_prob decides whether the top-k weights are
  renormalized. Logits equal transformers', the export reloads there with identical logits."""
  reference = hf_qwen3_moe(tmp_path / "hf", norm_topk_prob)
  expected = hf_logits(reference)
  model = hf.from_pretrained(str(tmp_path / "hf"))
  moe = model.config.moe
  assert model.config.qk_norm and (moe.num_experts, moe.experts_per_token) == (4, 2)
  assert moe.expert_mlp_dim == 32 and moe.normalize_top_k == norm_topk_prob
  diff = np.abs(np.asarray(model(TOKENS)) - expected).max()
  print(f"qwen3-moe norm_topk_prob={norm_topk_prob}: max |logits - transformers| = {diff:.3g}")
  assert diff < PARITY
  # The flag matters: the same weights with the other choice give other logits.
  flipped = dataclasses.replace(moe, normalize_top_k=not norm_topk_prob)
  graphdef, _ = abstract_model(dataclasses.replace(model.config, moe=flipped))
  other = nnx.merge(graphdef, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  assert np.abs(np.asarray(other(TOKENS)) - expected).max() > 100 * PARITY
  hf.save_pretrained(model, str(tmp_path / "out"))
  assert_same_tensors(tmp_path / "hf", tmp_path / "out")
  reloaded = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "out",
                                                              attn_implementation="eager").eval()
  np.testing.assert_array_equal(hf_logits(reloaded), expected)


@pytest.mark.slow
def test_qwen3_moe_trains_like_one_device_under_expert_and_fsdp():
  """expert=4 x fsdp=2, dropless, the raw top-k weights (norm_topk_prob false): the QK-norm and
  the router train like one device at the tolerances of tests/test_parallel.py."""
  model = dataclasses.replace(harness.MODEL, qk_norm=True)
  moe = MoEConfig(num_experts=8, experts_per_token=2, expert_mlp_dim=32, normalize_top_k=False,
                  dispatch="dropless")
  ref = harness.run(MeshConfig(data=1), devices=jax.devices()[:1], model=model, moe=moe)
  assert_same_training(harness.run(MeshConfig(data=1, expert=4, fsdp=2), model=model, moe=moe),
                       ref)


def test_qwen3_moe_presets_have_the_published_parameter_counts():
  """Qwen3-30B-A3B: 30.5B parameters, 3.3B active; Qwen3-235B-A22B: 235B, 22B (model cards, which
  round and do not say how they count the embeddings: within 2%; we count both tables, as active
  too: 30.53B / 3.35B and 235.09B / 22.19B)."""
  for name, total, active in (("qwen3_30b_a3b", 30.5, 3.3), ("qwen3_235b_a22b", 235, 22)):
    m = moe_presets.MODELS[name]
    assert m.num_params() / 1e9 == pytest.approx(total, rel=0.02)
    assert m.active_params() / 1e9 == pytest.approx(active, rel=0.02)
