"""Multi-head latent attention (DeepSeek-V3): logits equal transformers' DeepseekV3ForCausalLM with
and without the query latent, the export reloads there with identical logits, and MLA trains like
one device under fsdp x tensor (dense) and expert x fsdp (the DeepSeek MoE)."""

import dataclasses
import json

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from configs import moe as moe_presets
from models import ComputeConfig, hf, param_names
from models.builder import init_params
from models.config import MLAConfig, MoEConfig
from models.hf.deepseek import RopeDeinterleaved
from models.transformer import Transformer
from sharding import LayoutError, MeshConfig
from sharding.layout import Layout
from sharding.mesh import AXES
from sharding.plan import planner
from sharding.plan.estimate import model_spec
from sharding.rules import DEFAULT_RULES, logical_to_spec, role_rules
from tests import parallel_harness as harness
from tests.test_hf import TINY, TOKENS, assert_same_tensors, hf_logits, random_hf_model
from tests.test_parallel import assert_same_training

PARITY = 1e-5  # max |logit difference| against transformers in float32 (issue [20])
# Distinct dims, so that a mixed-up split shows: q/k heads 6 + 4 (rope), v heads 5.
MLA_DIMS = dict(kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5)
CASES = {
    # One dense layer and one MoE layer: 4 experts in 2 groups, 1 group per token, top-2, 1
    # shared expert, the correction bias random (it picks experts).
    "q_latent_moe": dict(q_lora_rank=12, first_k_dense_replace=1),
    # No query latent (q_proj), every layer dense.
    "no_q_latent_dense": dict(q_lora_rank=None, first_k_dense_replace=2),
}


def hf_deepseek(path, case: str, seed=0):
  """A random DeepseekV3ForCausalLM (test_hf.random_hf_model), the correction bias included."""
  config = transformers.DeepseekV3Config(
      **TINY, num_key_value_heads=4, head_dim=MLA_DIMS["qk_rope_head_dim"], **MLA_DIMS,
      **CASES[case], moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
      n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
      attn_implementation="eager")
  model = random_hf_model(transformers.DeepseekV3ForCausalLM, config, path, seed=seed)
  with torch.no_grad():
    for name, buffer in model.named_buffers():
      if name.endswith("e_score_correction_bias"):
        buffer.copy_(0.3 * torch.randn_like(buffer))
  model.save_pretrained(path)
  return model


@pytest.mark.parametrize("case", CASES)
def test_deepseek_v3_import_export_parity(tmp_path, case):
  reference = hf_deepseek(tmp_path / "hf", case)
  expected = hf_logits(reference)
  model = hf.from_pretrained(str(tmp_path / "hf"))
  cfg = model.config
  assert cfg.mla == MLAConfig(q_lora_rank=CASES[case]["q_lora_rank"] or 0, **MLA_DIMS)
  assert (cfg.moe is None) == (case == "no_q_latent_dense")
  diff = np.abs(np.asarray(model(TOKENS)) - expected).max()
  print(f"deepseek_v3 {case}: max |logits - transformers| = {diff:.3g}")
  assert diff < PARITY

  hf.save_pretrained(model, str(tmp_path / "out"))
  written = json.loads((tmp_path / "out" / "config.json").read_text())
  assert written["architectures"] == ["DeepseekV3ForCausalLM"]
  assert_same_tensors(tmp_path / "hf", tmp_path / "out")
  reloaded = transformers.DeepseekV3ForCausalLM.from_pretrained(
      tmp_path / "out", attn_implementation="eager").eval()
  np.testing.assert_array_equal(hf_logits(reloaded), expected)


def test_the_rope_dims_order_matters(tmp_path, monkeypatch):
  """The import's permutation of the rope dims is needed: loading the same weights as if they
  were stored in halves gives other logits (so the parity above is not vacuous)."""
  expected = hf_logits(hf_deepseek(tmp_path / "hf", "no_q_latent_dense"))
  # The rope layouts read their tensors unpermuted (as their base layout stores them).
  monkeypatch.setattr(RopeDeinterleaved, "read",
                      lambda self, hf, index, shape: self.base.read(hf, index, shape))
  unpermuted = hf.from_pretrained(str(tmp_path / "hf"))
  monkeypatch.undo()
  assert np.abs(np.asarray(unpermuted(TOKENS)) - expected).max() > 100 * PARITY


def test_mla_checks_say_what_to_set():
  model = dataclasses.replace(harness.MODEL, mla=MLAConfig(**MLA_DIMS))
  with pytest.raises(ValueError, match="model.head_dim=10 .* model.num_kv_heads=16"):
    model.validate()
  with pytest.raises(ValueError, match="qk_rope_head_dim even"):
    dataclasses.replace(mla_model(), mla=MLAConfig(**dict(MLA_DIMS, qk_rope_head_dim=3),
                                                   )).validate()


def mla_model(q_lora_rank: int = 8):
  """The harness model with MLA: 16 heads of q/k 6 + 4 and v 4 (every dim divides the mesh)."""
  return dataclasses.replace(
      harness.MODEL, num_kv_heads=16, head_dim=10,
      mla=MLAConfig(q_lora_rank=q_lora_rank, kv_lora_rank=8, qk_nope_head_dim=6,
                    qk_rope_head_dim=4, v_head_dim=4))


def test_mla_trains_like_one_device_under_fsdp_and_tensor():
  """fsdp=4 x tensor=2: heads split over tensor, the latents replicated, at the tolerances of
  tests/test_parallel.py."""
  model = mla_model()
  model.validate()
  ref = harness.run(MeshConfig(data=1), devices=jax.devices()[:1], model=model)
  assert_same_training(harness.run(MeshConfig(data=1, fsdp=4, tensor=2), model=model), ref)


@pytest.mark.slow
def test_deepseek_moe_with_mla_trains_like_one_device_under_expert_and_fsdp():
  """expert=4 x fsdp=2, dropless: MLA without the query latent, 1 dense + 1 MoE layer, the
  sigmoid router with its bias, group-limited, a shared expert."""
  model = mla_model(q_lora_rank=0)
  moe = MoEConfig(num_experts=8, experts_per_token=2, expert_mlp_dim=32, num_shared_experts=1,
                  first_dense_layers=1, router="sigmoid", bias_update_rate=0.001,
                  routed_scaling=2.5, expert_groups=4, groups_per_token=2, dispatch="dropless")
  ref = harness.run(MeshConfig(data=1), devices=jax.devices()[:1], model=model, moe=moe)
  assert_same_training(harness.run(MeshConfig(data=1, expert=4, fsdp=2), model=model, moe=moe),
                       ref)


def test_deepseek_v3_preset_has_the_published_counts():
  """DeepSeek-V3: 671B parameters, 37B active (arXiv:2412.19437), without the multi-token
  prediction module; its module adds one MoE layer and the [2D, D] projection (11.6B; the
  report's 14B includes the checkpoint's copies of the shared embedding and head)."""
  model = moe_presets.MODELS["deepseek_v3"]
  model.validate()
  main = dataclasses.replace(model, mtp_depth=0)
  assert main.num_params() / 1e9 == pytest.approx(671, rel=0.002)
  assert main.active_params() / 1e9 == pytest.approx(37, rel=0.02)
  shared = 2 * model.vocab_size * model.embed_dim
  assert (model.num_params() - main.num_params() + shared) / 1e9 == pytest.approx(14, rel=0.05)


def test_mla_runs_in_every_attention_kernel():
  """q/k heads of 10 and v heads of 4 through XLA's dot_product (v zero-padded to q's dim, the
  cuDNN path) and the Pallas flash kernel (interpret mode): the reference's logits."""
  tokens = TOKENS[:2, :16] % harness.MODEL.vocab_size
  graphdef, params = nnx.split(Transformer(mla_model(), rngs=nnx.Rngs(0)))
  want = np.asarray(nnx.merge(graphdef, params)(tokens))
  for impl in ("dot_product", "pallas_flash"):
    other, _ = nnx.split(Transformer(mla_model(), ComputeConfig(attention_impl=impl),
                                     rngs=nnx.Rngs(0)))
    run = lambda p, other=other: nnx.merge(other, p)(tokens)
    assert ("pallas_call" in str(jax.make_jaxpr(run)(params))) == (impl == "pallas_flash")
    assert np.abs(np.asarray(run(params)) - want).max() < 1e-5, impl


def test_fsdp_splits_every_mla_matrix():
  """q_b and kv_b [R, H, d] have no `embed` dim: FSDP splits their latent rank (`latent_rank`,
  sharding/rules.py). Before, every device held them whole: DeepSeek-V3 under fsdp=16 x
  expert=64 compiled to 124.5 GB a device, 57 GB of it those two stacks' state."""
  model = mla_model()
  names = param_names(model)
  shapes = jax.eval_shape(lambda: init_params(model, jax.random.PRNGKey(0)))
  sizes = dict(fsdp=4, tensor=2)
  pairs = list(zip(jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, tuple)),
                   jax.tree.leaves(shapes)))
  matrices = [(n, logical_to_spec(n, a.shape, sizes, DEFAULT_RULES)) for n, a in pairs
              if len([d for d in n if d not in ("layers", "norm")]) >= 2]
  latent = [spec for n, spec in matrices if "latent_rank" in n]
  assert len(latent) == 2 and all(spec[1] == "fsdp" for spec in latent)
  assert all("fsdp" in jax.tree.leaves(tuple(spec)) for _, spec in matrices), matrices
  # ZeRO splits the same dim (sharding.rules.ZERO_DIMS): DeepSeek-V3's recipe keeps its MLA
  # optimizer state over 64 `expert` ZeRO ranks, not whole on each.
  for stage in (0, 1):
    opt = [logical_to_spec(n, a.shape, dict(expert=4, tensor=2),
                           role_rules(DEFAULT_RULES, "opt_state", stage))
           for n, a in pairs if "latent_rank" in n]
    assert [spec[1] for spec in opt] == ["expert" if stage else None] * 2, opt


def test_the_planner_refuses_the_layouts_the_rules_refuse():
  """`plan`'s divisibility check splits `embed` and MLA's latent ranks over the rules' ZeRO group
  (fsdp, and from ZeRO-1 data x context x expert). It checked the ranks against fsdp alone and
  `embed` without `expert`, so it ranked DeepSeek-V3 layouts the rules refuse before compiling
  (data x expert = 1,024 at ZeRO-1 against the kv rank 512)."""
  moe = MoEConfig(num_experts=8, experts_per_token=2, expert_mlp_dim=32)
  model = dataclasses.replace(mla_model(), moe=moe)
  names = param_names(model)
  shapes = jax.eval_shape(lambda: init_params(model, jax.random.PRNGKey(0)))
  pairs = list(zip(jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, tuple)),
                   jax.tree.leaves(shapes)))

  def rules_accept(layout: Layout) -> bool:
    sizes = {axis: getattr(layout, axis) for axis in AXES}
    rules = role_rules(DEFAULT_RULES, "opt_state", layout.zero_stage)
    try:
      for n, a in pairs:
        logical_to_spec(n, a.shape, sizes, rules)
    except LayoutError:
      return False
    return True

  layouts = [Layout(data=16, zero_stage=1), Layout(data=4, expert=4, zero_stage=1),
             Layout(data=2, expert=4, zero_stage=1), Layout(data=2, context=2, expert=2,
                                                           zero_stage=1),
             Layout(data=16), Layout(fsdp=8), Layout(fsdp=16), Layout(fsdp=2, expert=8,
                                                                      zero_stage=1)]
  verdicts = [rules_accept(lay) for lay in layouts]
  assert True in verdicts and False in verdicts
  spec = model_spec(model)
  assert [not planner.divisibility_errors(spec, lay, 64) for lay in layouts] == verdicts
