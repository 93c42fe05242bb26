"""The Llama model: parameter counts, causality, packing, scan vs unrolled, remat, RoPE scaling."""

import contextlib
import dataclasses
import io

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kernels
from configs import llama
from models import ComputeConfig, ModelConfig, abstract_model, param_names
from models.builder import init_params, per_layer, stacked
from models.compute import REMAT_POLICIES, ROTATED
from models.rope import inverse_frequencies

TINY = ModelConfig(vocab_size=64, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, mlp_dim=64)


def _apply(cfg, params, tokens, positions=None, segment_ids=None, compute=None):
  graphdef, _ = abstract_model(cfg, compute)
  return nnx.merge(graphdef, params)(tokens, positions, segment_ids)


@pytest.fixture(scope="module")
def tiny_params():
  return init_params(TINY, jax.random.PRNGKey(0))


# Published parameter counts (Hugging Face model cards / config-derived totals) and the
# Ultra-Scale Playbook's benchmark-model sizes (1.34B, 3.57B, 8.86B, 80B).
PUBLISHED = {
    "llama3_1b": 1_235_814_400,
    "llama3_8b": 8_030_261_248,
    "llama3_70b": 70_553_706_496,
    "llama3_405b": 405_853_388_800,
}
PLAYBOOK_BILLIONS = {"playbook_1b": 1.34, "playbook_3b": 3.57, "playbook_8b": 8.86,
                     "playbook_80b": 80.0}


@pytest.mark.parametrize("name", sorted(llama.MODELS))
def test_parameter_count_matches_formula_abstractly(name):
  cfg = llama.model(name)
  _, abstract = abstract_model(cfg)  # nothing allocated: the 405B model is fine on a laptop
  built = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract))
  assert built == cfg.num_params()
  if name in PUBLISHED:
    assert built == PUBLISHED[name]
  if name in PLAYBOOK_BILLIONS:
    assert round(built / 1e9, 2 if built < 1e10 else 0) == PLAYBOOK_BILLIONS[name]


def test_every_parameter_has_logical_names_and_layers_axis():
  names = param_names(TINY)
  _, abstract = abstract_model(TINY)
  flat_names = jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, tuple))
  for leaf_names, leaf in zip(flat_names, jax.tree.leaves(abstract)):
    assert len(leaf_names) == leaf.ndim
  assert names["layers"]["attn"]["q"]["w"] == ("layers", "embed", "heads", "head_dim")
  assert names["layers"]["mlp"]["down"]["w"] == ("layers", "mlp", "embed")
  assert names["embed"]["table"] == ("vocab", "embed")


def test_output_shape(tiny_params):
  logits = _apply(TINY, tiny_params, jnp.zeros((3, 16), jnp.int32))
  assert logits.shape == (3, 16, TINY.vocab_size)


def test_causality_by_gradient(tiny_params):
  """The loss at position t has exactly zero gradient w.r.t. the tokens after t.

  Tokens at positions <= t come from ids 0..31, after t from ids 32..63; with an untied head the
  embedding rows 32..63 are used only as inputs after t, so their gradient must be exactly 0.
  """
  t, length = 7, 16
  rng = np.random.default_rng(0)
  tokens = np.concatenate([rng.integers(0, 32, t + 1), rng.integers(32, 64, length - t - 1)])
  tokens = jnp.asarray(tokens[None], jnp.int32)

  def loss_at_t(params):
    logits = _apply(TINY, params, tokens)
    return -jax.nn.log_softmax(logits[0, t])[5]

  grad_table = jax.grad(loss_at_t)(tiny_params)["embed"]["table"]
  assert float(jnp.abs(grad_table[32:]).max()) == 0.0
  assert float(jnp.abs(grad_table[np.asarray(tokens[0, :t + 1])]).min()) > 0.0


def test_packed_documents_do_not_attend_across(tiny_params):
  """A document packed after another gives the same logits as the document alone."""
  rng = np.random.default_rng(1)
  doc_a, doc_b = rng.integers(0, 64, 10), rng.integers(0, 64, 6)
  packed = jnp.asarray(np.concatenate([doc_a, doc_b])[None], jnp.int32)
  segments = jnp.asarray([[1] * 10 + [2] * 6], jnp.int32)
  positions = jnp.asarray([list(range(10)) + list(range(6))], jnp.int32)
  together = _apply(TINY, tiny_params, packed, positions, segments)
  alone = _apply(TINY, tiny_params, jnp.asarray(doc_b[None], jnp.int32))
  np.testing.assert_allclose(together[0, 10:], alone[0], atol=1e-5)
  # Without segment ids the second document does see the first: the mask is what isolates it.
  leaky = _apply(TINY, tiny_params, packed, positions, None)
  assert float(jnp.abs(leaky[0, 10:] - alone[0]).max()) > 1e-3


def test_scanned_equals_layers_stored_apart(tiny_params):
  """compute.scan_layers=False: each layer's weights arrays of their own (no `layers` dim), the
  same initial values as the stack's rows, the layers unrolled, the same logits."""
  unrolled = ComputeConfig(scan_layers=False)
  apart = init_params(TINY, jax.random.PRNGKey(0), unrolled)
  assert sorted(apart["layers"]) == [0, 1]
  assert param_names(TINY, unrolled)["layers"][1]["attn"]["q"]["w"] == ("embed", "heads",
                                                                        "head_dim")
  for got, want in zip(jax.tree.leaves(apart), jax.tree.leaves(per_layer(tiny_params))):
    np.testing.assert_array_equal(got, want)
  for got, want in zip(jax.tree.leaves(stacked(apart)), jax.tree.leaves(tiny_params)):
    np.testing.assert_array_equal(got, want)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 64, (2, 16)), jnp.int32)
  jaxpr_scan = str(jax.make_jaxpr(lambda p: _apply(TINY, p, tokens))(tiny_params))
  jaxpr_loop = str(jax.make_jaxpr(lambda p: _apply(TINY, p, tokens, compute=unrolled))(apart))
  assert "scan" in jaxpr_scan and "scan" not in jaxpr_loop
  np.testing.assert_allclose(_apply(TINY, tiny_params, tokens),
                             _apply(TINY, apart, tokens, compute=unrolled), rtol=0, atol=1e-5)


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_remat_gives_same_loss_and_grads(tiny_params, policy):
  tokens = jnp.asarray(np.random.default_rng(3).integers(0, 64, (2, 16)), jnp.int32)

  def loss_fn(compute):
    def loss(params):
      logits = _apply(TINY, params, tokens, compute=compute).astype(jnp.float32)
      return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])
    return jax.jit(jax.value_and_grad(loss))

  plain, remat = loss_fn(ComputeConfig()), loss_fn(ComputeConfig(remat=policy))
  hlo_plain = plain.lower(tiny_params).compile().as_text()
  hlo_remat = remat.lower(tiny_params).compile().as_text()
  assert hlo_plain != hlo_remat  # the two programs really differ
  (loss_a, grads_a), (loss_b, grads_b) = plain(tiny_params), remat(tiny_params)
  np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def saved_residuals(fn, *args) -> list[str]:
  """What the backward of `fn` reads, one "dtype[shape] output of <op>" line each."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    jax.ad_checkpoint.print_saved_residuals(fn, *args)
  return [line.split(" from ")[0] for line in out.getvalue().splitlines()]


def test_no_recompute_keeps_matmul_outputs_not_elementwise_intermediates(tiny_params,
                                                                         monkeypatch):
  """remat="none" recomputes no matmul, but the backward reads only matmul (and kernel) outputs:
  SwiGLU's and softmax's intermediates and the norms' statistics inside the layers are
  recomputed, as a hand-written backward would (models/compute.py). Same loss and gradients as
  autodiff keeping every intermediate (everything_saveable: what remat="none" was)."""
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, 64, (2, 16)), jnp.int32)
  unrolled = ComputeConfig(scan_layers=False)  # each residual visible with the op making it
  params = per_layer(tiny_params)

  def loss(params):
    return jnp.mean(_apply(TINY, params, tokens, compute=unrolled).astype(jnp.float32) ** 2)

  kept = saved_residuals(loss, params)
  value, grads = jax.jit(jax.value_and_grad(loss))(params)
  monkeypatch.setitem(REMAT_POLICIES, "none", jax.checkpoint_policies.everything_saveable)
  everything = saved_residuals(loss, params)
  value_all, grads_all = jax.jit(jax.value_and_grad(loss))(params)

  elementwise = ("'silu'", " exp", " div", "'_where'", " integer_pow")
  assert any(op in line for line in everything for op in elementwise)  # the variants differ
  assert not [line for line in kept if any(op in line for op in elementwise)]
  assert len(kept) < len(everything)
  np.testing.assert_allclose(value, value_all, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_all)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("remat", ["none", "selective"])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_remat_keeps_q_and_k_after_rope(qk_norm, remat):
  """remat="none" and "selective": the backward reads q and k as the attention took them, after
  RoPE (named ROTATED), not the q and k projections' outputs, which only RoPE read: the same
  bytes, and no RoPE again in the backward (models/attention.py). v is its projection's output. With QK-norm,
  whose backward reads the projections' outputs, those are kept instead."""
  cfg = dataclasses.replace(TINY, qk_norm=qk_norm)
  params = per_layer(init_params(cfg, jax.random.PRNGKey(0)))
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, 64, (2, 16)), jnp.int32)
  unrolled = ComputeConfig(scan_layers=False, remat=remat)
  kept = saved_residuals(lambda p: jnp.mean(_apply(cfg, p, tokens, compute=unrolled) ** 2), params)
  h, kv, d, layers = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
  rotated = [f"f32[2,16,{n},{d}] named '{ROTATED}'" for n in (h, kv)]
  projected = [f"f32[32,{n},{d}] output of dot_general" for n in (h, kv)]  # [B·L, heads, d]
  assert kept.count(projected[1]) == (2 if qk_norm else 1) * layers  # v (and k)
  assert kept.count(projected[0]) == (layers if qk_norm else 0)
  assert [kept.count(r) for r in rotated] == [0 if qk_norm else layers] * 2


def test_attention_impls_agree_with_gqa_and_segments():
  rng = np.random.default_rng(4)
  q = jnp.asarray(rng.normal(size=(2, 12, 8, 16)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(2, 12, 2, 16)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(2, 12, 2, 16)), jnp.float32)
  segments = jnp.asarray([[1] * 5 + [2] * 7, [1] * 12], jnp.int32)
  ref = kernels.attention(q, k, v, segments, impl="xla")
  other = kernels.attention(q, k, v, segments, impl="dot_product")
  np.testing.assert_allclose(ref, other, atol=1e-5)
  # GQA without repeating K/V equals repeating each kv head over its group of query heads.
  repeated = kernels.attention(q, jnp.repeat(k, 4, axis=2), jnp.repeat(v, 4, axis=2), segments)
  np.testing.assert_allclose(ref, repeated, atol=1e-6)


def test_llama3_rope_scaling():
  """Llama-3 rule: short wavelengths kept, long ones divided by the factor, smooth between."""
  plain = inverse_frequencies(128, 500_000.0)
  scaled = inverse_frequencies(128, 500_000.0, 8.0, 1.0, 4.0, 8192)
  wavelen = 2 * np.pi / plain
  short, long_ = wavelen < 8192 / 4, wavelen > 8192 / 1
  np.testing.assert_array_equal(scaled[short], plain[short])
  np.testing.assert_allclose(scaled[long_], plain[long_] / 8.0)
  middle = ~short & ~long_
  assert middle.any()
  assert np.all((scaled[middle] < plain[middle]) & (scaled[middle] > plain[middle] / 8.0))
  assert np.all(np.diff(scaled) < 0)  # still strictly decreasing: no discontinuity


def test_flops_per_token_formula():
  cfg = TINY
  # q and o are D*H*Dh each, k and v D*K*Dh each, the MLP 3*D*F, the head V*D.
  matmul_params = cfg.num_layers * (2 * 32 * 4 * 8 + 2 * 32 * 2 * 8 + 3 * 32 * 64) + 64 * 32
  assert cfg.flops_per_token(16) == 6 * matmul_params + 6 * 2 * 4 * 8 * 16
