"""DeepSeek-V3's multi-token prediction (models/mtp.py, trainer/loss.py): the loss against a
reference written here in numpy, exactness at weight 0, training under a layout (pipeline
stages included: the last runs the modules), the counts, the planner."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import ComputeConfig, ModelConfig, abstract_model, hf, param_names
from models.builder import init_params
from models.config import MoEConfig
from models.fp8.config import Fp8Config
from configs import moe as moe_configs
from sharding import MeshConfig
from sharding import Layout, layout_of
from sharding.plan import hardware, planner
from sharding.plan.estimate import PLAYBOOK_MIXED, ModelSpec, memory, model_spec
from tests import parallel_harness as harness
from tests.test_moe_parallel import MOE as HARNESS_MOE
from tests.test_parallel import assert_same_training
from trainer import loss
from trainer.config import StepConfig, TrainConfig
from trainer.non_gradient import NonGradient
from trainer.trainer import Trainer
from trainer.step import make_loss_sums

TINY = ModelConfig(vocab_size=64, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, mlp_dim=64, mtp_depth=1, mtp_loss_weight=0.3)
B, L = 4, 16
# DeepSeek-V3-like: a leading dense layer, sigmoid routing with shared experts and the balancing
# bias; its MTP block is a MoE block too.
MOE = dataclasses.replace(TINY, num_layers=3, moe=MoEConfig(
    num_experts=4, experts_per_token=2, num_shared_experts=1, first_dense_layers=1,
    router="sigmoid", bias_update_rate=1e-3, load_balance_loss=0.01, router_z_loss=0.001))


def packed_batch(seed: int = 0) -> dict:
  """Two documents per row (cut at different places), positions restarting, and loss masks with
  holes: position 5 of row 0 masked, and the last token of each first document (whose target is
  the next document's first token), as trainer/data.py masks it."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, TINY.vocab_size, (B, L + 1)).astype(np.int32)
  cut = np.array([7, 3, 12, 9])[:, None]
  i = np.arange(L)[None]
  mask = np.ones((B, L), np.float32)
  mask[0, 5] = 0.0
  mask[np.arange(B), cut[:, 0] - 1] = 0.0
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
          "positions": np.where(i < cut, i, i - cut).astype(np.int32),
          "segment_ids": np.where(i < cut, 1, 2).astype(np.int32), "loss_mask": mask}


def rms(x, scale, eps):
  x = np.asarray(x, np.float64)
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(scale)


def ce(logits, target):
  logits = np.asarray(logits, np.float64)
  top = logits.max()
  return top + np.log(np.sum(np.exp(logits - top))) - logits[target]


def reference_loss_sum(cfg: ModelConfig, params: dict, batch: dict) -> tuple[float, float, int]:
  """(summed loss, summed MTP cross-entropy, MTP tokens) of a depth-1 model, by hand: the main
  trunk and the MTP block run as the model's own modules, the rest here."""
  model = nnx.merge(abstract_model(cfg)[0], params)
  pos, seg = batch["positions"], batch["segment_ids"]
  x, _ = model.run_layers(model.embed_tokens(batch["inputs"]), pos, seg)
  table, head = np.asarray(params["embed"]["table"]), np.asarray(params["head"]["w"])
  eps, mtp = cfg.norm_eps, jax.tree.map(lambda a: np.asarray(a)[0], params["mtp"])
  main_logits = rms(x, params["final_norm"]["scale"], eps) @ head
  # Depth 1: at position i, the embedding of token i + 1 (any token past the row's end: the
  # block is causal and that position's target is masked) and the main hidden state.
  ahead = np.concatenate([batch["inputs"][:, 1:], batch["inputs"][:, :1]], axis=1)
  joined = np.concatenate([rms(table[ahead], mtp["embed_norm"]["scale"], eps),
                           rms(x, mtp["hidden_norm"]["scale"], eps)], axis=-1)
  graphdef, stacked = nnx.split(model.mtp)
  block = nnx.merge(graphdef, jax.tree.map(lambda a: a[0], stacked)).block
  h1 = block(np.asarray(joined @ mtp["proj"]["w"], np.float32), pos, seg)
  mtp_logits = rms(h1, mtp["out_norm"]["scale"], eps) @ head
  main = mtp_sum = 0.0
  mtp_tokens = 0
  for b in range(B):
    for i in range(L):
      main += batch["loss_mask"][b, i] * ce(main_logits[b, i], batch["targets"][b, i])
      # The target two tokens ahead, t_{i+2} = targets[i + 1]: inside the row, the same
      # document, and counted by the loss mask there.
      if i + 1 < L and seg[b, i + 1] == seg[b, i] and batch["loss_mask"][b, i + 1]:
        mtp_sum += ce(mtp_logits[b, i], batch["targets"][b, i + 1])
        mtp_tokens += 1
  return main + cfg.mtp_loss_weight / 1 * mtp_sum, mtp_sum, mtp_tokens


@pytest.mark.parametrize("loss_impl", ["dense", "chunked"])
def test_depth_one_loss_equals_the_hand_computed_reference(loss_impl):
  cfg, compute = TINY, ComputeConfig(loss_impl=loss_impl, loss_chunk_size=4)
  params = init_params(cfg, jax.random.key(0), compute)
  batch = packed_batch()
  loss_sum, stats = jax.jit(make_loss_sums(abstract_model(cfg, compute)[0], Layout(),
                                           StepConfig()))(params, batch)
  want, want_mtp, mtp_tokens = reference_loss_sum(cfg, params, batch)
  # 15 in-row pairs (i, i + 1) a row = 60: 4 cross a document boundary, 5 end on a masked token
  # (row 0's position 5, and each first document's last token).
  assert mtp_tokens == 60 - 4 - 5
  assert float(stats["mtp_tokens"][0]) == mtp_tokens
  np.testing.assert_allclose(float(stats["mtp_loss_sum"]), want_mtp, rtol=2e-6)
  np.testing.assert_allclose(float(loss_sum), want, rtol=2e-6)
  # The train step's metrics from these sums: what MTP adds to the loss, and depth 1's mean CE.
  metrics = loss.mtp_metrics(stats, stats["tokens"], cfg.mtp_loss_weight)
  np.testing.assert_allclose(float(metrics["mtp_loss"]),
                             0.3 * want_mtp / float(stats["tokens"]), rtol=2e-6)
  np.testing.assert_allclose(float(metrics["mtp_nll_1"]), want_mtp / mtp_tokens, rtol=2e-6)


def test_depth_two_weight_zero_is_the_plain_model_and_the_weight_counts():
  deep = dataclasses.replace(TINY, mtp_depth=2)
  plain = dataclasses.replace(TINY, mtp_depth=0)
  params = init_params(deep, jax.random.key(1))
  main = {k: v for k, v in params.items() if k != "mtp"}
  # The modules are created last: the other weights are the plain model's draws.
  for got, want in zip(jax.tree.leaves(main), jax.tree.leaves(init_params(plain, jax.random.key(1)))):
    np.testing.assert_array_equal(got, want)
  batch = packed_batch(1)
  # The MTP weight is the model config's: one graph definition per weight.
  sums = {w: jax.jit(make_loss_sums(abstract_model(dataclasses.replace(
      deep, mtp_loss_weight=w))[0], Layout(), StepConfig()))(params, batch) for w in (0.0, 0.5)}
  plain_sum, plain_stats = jax.jit(make_loss_sums(abstract_model(plain)[0], Layout(),
                                                  StepConfig()))(main, batch)
  assert "mtp_loss_sum" not in plain_stats
  assert float(sums[0.0][0]) == float(plain_sum)
  weighted, stats = sums[0.5]
  assert stats["mtp_nll_sum"].shape == (2,) and float(weighted) != float(plain_sum)
  np.testing.assert_allclose(float(weighted) - float(plain_sum),
                             0.5 / 2 * float(stats["mtp_loss_sum"]), rtol=1e-5)
  # Depth 2 predicts from 3 tokens ahead: fewer valid positions than depth 1.
  assert float(stats["mtp_tokens"][1]) < float(stats["mtp_tokens"][0])


_REFERENCES = {}


def with_mtp(layers: int = 2) -> ModelConfig:
  return dataclasses.replace(harness.MODEL, mtp_depth=1, num_layers=layers)


def reference(moe: MoEConfig | None = None, layers: int = 2) -> harness.Result:
  """One-device training of the harness model with `layers` layers and an MTP module (once per
  session)."""
  key = (moe, layers)
  if key not in _REFERENCES:
    _REFERENCES[key] = harness.run(MeshConfig(), devices=jax.devices()[:1], moe=moe,
                                   model=with_mtp(layers))
  return _REFERENCES[key]


def mtp_leaves(result: harness.Result, moe: MoEConfig | None = None) -> dict:
  """{path under mtp ("block/moe/router/bias"): its index among the result's leaves}."""
  model = harness.config(MeshConfig(), moe=moe, model=with_mtp()).model
  paths = jax.tree_util.tree_leaves_with_path(abstract_model(model)[1])
  assert len(paths) == len(result.grads)
  return {"/".join(str(k.key) for k in path[1:]): i for i, (path, _) in enumerate(paths)
          if path[0].key == "mtp"}


def assert_same_mtp_metrics(result, ref):
  """The pipelined step's MTP metrics (its own loss, depth 1's cross-entropy) are the
  one-device step's, step by step."""
  for got, want in zip(result.metrics, ref.metrics, strict=True):
    for key in ("mtp_loss", "mtp_nll_1"):
      np.testing.assert_allclose(got[key], want[key], rtol=2e-5)


def test_trains_like_one_device_under_fsdp_and_tensor():
  ref = reference()
  assert_same_training(harness.run(MeshConfig(fsdp=4, tensor=2), model=with_mtp()), ref)
  # The modules learn: every MTP weight has a gradient.
  assert all(np.abs(ref.grads[i]).max() > 0 for i in mtp_leaves(ref).values())
  assert ref.losses[-1] < ref.losses[0]


@pytest.mark.parametrize("mesh_cfg,microbatches,layers", [
    (MeshConfig(data=2, pipeline=2, fsdp=2), 2, 2),
    # 3 layers on 2 stages (2 + 1): the last position's backward, which runs the module, skips
    # its padding row statically.
    (MeshConfig(data=4, pipeline=2), 2, 3),
    # The V (4 positions): the last is stage 0's second chunk, where the embedding is too.
    pytest.param(MeshConfig(data=4, pipeline=2, pipeline_schedule="dualpipev",
                            virtual_stages=2), 4, 4, marks=pytest.mark.slow),
], ids=["data=2,pipeline=2,fsdp=2,1f1b,ga=2", "data=4,pipeline=2,ga=2,3_layers",
        "data=4,pipeline=2,dualpipev,ga=4,4_layers"])
def test_trains_like_one_device_on_the_last_pipeline_stage(mesh_cfg, microbatches, layers):
  """The last pipeline position runs the module on its last layer's output, with the shifted
  tokens of its microbatch and the shared embedding and head (their gradients summed with the
  first position's); the module's weights are whole on every stage (`mtp_layers` is not split
  over `pipeline`)."""
  result = harness.run(mesh_cfg, model=with_mtp(layers), microbatches=microbatches)
  ref = reference(layers=layers)
  assert_same_training(result, ref)
  assert_same_mtp_metrics(result, ref)
  assert all(np.abs(result.grads[i]).max() > 0 for i in mtp_leaves(result).values())


def test_the_positions_padding_rows_run_nothing():
  """3 layers on 2 stages (2 + 1) with the module: a stage's forward and backward run under a
  switch over the positions' row patterns, and the last position's backward (which alone runs
  the module) has its own, all with their rows as numpy (known when tracing), so XLA drops the
  padding row's conditionals and matmuls; a lock-step tick waits for its costliest branch. As
  traced rows (before), the program held 24 conditionals with a matmul-free branch and 271
  dots; now 4 and 199 (DeepSeek-V3's recipe: its last position's backward went from 410 to
  245 ms, and no branch runs its dense and its MoE rows together)."""
  from unittest import mock
  from models import transformer
  from tests.test_uneven_stages import dot_free_branches

  def program():  # a fresh Trainer: its own jit, traced again
    trainer = Trainer(harness.config(MeshConfig(data=4, pipeline=2), model=with_mtp(3),
                                     microbatches=2))
    assert trainer.stage_layers == (("layers", (2, 1)),)
    with trainer.scope():
      return trainer.train_step.lower(trainer.abstract_state,
                                      trainer.abstract_batch()).compile().as_text()
  with mock.patch.object(transformer, "layer_rows", jnp.asarray):
    traced = program()
  static = program()
  assert dot_free_branches(static) < dot_free_branches(traced)
  assert static.count(" dot(") < traced.count(" dot(")


@pytest.mark.slow
def test_a_moe_module_trains_like_one_device_under_pipeline_and_experts():
  """The harness MoE (1 dense + 1 MoE layer, sigmoid router with the balancing bias, dropless)
  with a MoE module on pipeline=2 x expert=2 x data=2, 2 microbatches: the module's router
  losses join the last stage's loss, and its loads (summed over microbatches, stages and
  replicas) move its own bias as on one device."""
  result = harness.run(MeshConfig(data=2, pipeline=2, expert=2), model=with_mtp(),
                       moe=HARNESS_MOE, microbatches=2)
  ref = reference(moe=HARNESS_MOE)
  assert_same_training(result, ref)
  assert_same_mtp_metrics(result, ref)
  bias = mtp_leaves(ref, HARNESS_MOE)["block/moe/router/bias"]
  assert np.abs(ref.params[bias] - ref.initial_params[bias]).max() > 0  # the bias moved
  assert not np.any(result.grads[bias])


def test_moe_module_trains_like_one_device_with_the_sequence_split_over_microbatches():
  """The MoE model with a depth-1 module on context=2 x expert=2 x data=2, 2 microbatches: each
  device differentiates its own part of the sequence and the gradients are reduced once per
  step (trainer/step.py); router losses, loads and the module's shifted targets are sums over
  tokens, so the parts add up to one device's step."""
  result = harness.run(MeshConfig(data=2, context=2, expert=2), model=with_mtp(),
                       moe=HARNESS_MOE, microbatches=2)
  ref = reference(moe=HARNESS_MOE)
  assert_same_training(result, ref)
  assert_same_mtp_metrics(result, ref)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_cfg,options", [
    # The shifted targets are made before the load-balanced reordering of the sequence.
    (MeshConfig(context=2, fsdp=2, tensor=2), {}),
    (MeshConfig(data=2, fsdp=2, tensor=2, sequence_parallel=True),
     dict(microbatches=4, remat="full")),
], ids=["context=2,fsdp=2,tensor=2", "data=2,fsdp=2,tensor=2,sp,ga=4,remat=full"])
def test_depth_two_trains_like_one_device_under_more_layouts(mesh_cfg, options):
  model = dataclasses.replace(harness.MODEL, mtp_depth=2)
  reference = harness.run(MeshConfig(), devices=jax.devices()[:1], model=model)
  assert_same_training(harness.run(mesh_cfg, model=model, **options), reference)


def test_parameter_and_flop_counts_include_the_modules():
  for cfg in (dataclasses.replace(TINY, mtp_depth=2), MOE):
    _, abstract = abstract_model(cfg)
    built = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract))
    mtp = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract["mtp"]))
    assert built == cfg.num_params() and mtp == cfg.mtp_params() > 0
    names = jax.tree.leaves(param_names(cfg)["mtp"], is_leaf=lambda x: isinstance(x, tuple))
    assert all(n[0] == "mtp_layers" and len(n) == x.ndim
               for n, x in zip(names, jax.tree.leaves(abstract["mtp"])))
    # The estimator: the same parameters (less the routing biases, which it leaves out) and
    # FLOPs, the modules' included.
    biases = (cfg.moe_layers() + cfg.mtp_depth) * 4 if cfg.moe else 0
    spec = model_spec(cfg)
    assert spec.num_params() == built - biases
    assert spec.flops_per_token(16) == pytest.approx(cfg.flops_per_token(16), rel=1e-12)
    plain = dataclasses.replace(cfg, mtp_depth=0)
    assert cfg.flops_per_token(16) > plain.flops_per_token(16)
    assert memory(cfg, Layout(), 16).total > memory(plain, Layout(), 16).total
  # By hand for tests/test_estimate.py's small model (V=100, D=16, 2 layers of 2336 parameters,
  # 2304 of them matrices) with one module: + 3*16 norms + 2*16*16 projection + 2336 = 2896
  # parameters; FLOPs + 6 x (2304 + 512 + the head's 1600) + 6 H Dh s = 26496 + 6*4*4*8.
  small = ModelSpec(vocab_size=100, embed_dim=16, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=4, mlp_dim=32)
  with_mtp = dataclasses.replace(small, mtp_depth=1)
  assert with_mtp.num_params() == small.num_params() + 2896 == 7888 + 2896
  assert with_mtp.flops_per_token(8) == small.flops_per_token(8) + 26496 + 768


def test_the_estimate_holds_the_modules_on_the_last_stage_for_one_microbatch():
  """Under pipeline stages the module adds its weights once and one microbatch's activations:
  the last stage runs it in each backward right after its forward (1F1B with 4 microbatches on
  2 stages keeps 2 in flight on the first)."""
  compute = ComputeConfig(attention_impl="xla")
  cfg = model_spec(TINY, compute)
  plain = model_spec(dataclasses.replace(TINY, mtp_depth=0), compute)
  added = lambda layout, part: (getattr(memory(cfg, layout, 16), part)
                                - getattr(memory(plain, layout, 16), part))
  piped, flat = Layout(pipeline=2, microbatches=4), Layout(microbatches=4)
  for part in ("params", "activations", "logits"):
    assert added(piped, part) == pytest.approx(added(flat, part)) and added(flat, part) > 0


def test_the_planner_pipelines_deepseek_v3():
  """DeepSeek-V3 (one MTP module) on 512 H100s: pipeline layouts are no longer rejected; some
  fit and rank, and the trainer's layout checks take the best of them."""
  model = moe_configs.MODELS["deepseek_v3"]
  assert planner.divisibility_errors(model_spec(model), Layout(data=4, pipeline=16, expert=8),
                                     4096) == []
  result = planner.plan(model, 512, 4096, 2**22, PLAYBOOK_MIXED, hardware.PROFILES["h100"])
  piped = [c for c in result.ranked if c.layout.pipeline > 1]
  assert piped and all(c.fits for c in piped)
  assert not any("multi-token" in why for _, why in result.rejected)
  best = piped[0].layout  # with its context-parallel attention, where it has a context axis
  compute = ComputeConfig(context_impl=best.context_impl)
  assert layout_of(best.mesh_config(), 512, model, compute, batch_size=best.global_batch,
                   seq_len=4096, microbatches=best.microbatches).pipeline == best.pipeline
  assert layout_of(MeshConfig(pipeline=2), 2, TINY, batch_size=4, seq_len=16,
                   microbatches=2).pipeline == 2


def test_moe_block_router_losses_and_its_own_balancing_bias():
  params = init_params(MOE, jax.random.key(3))
  loss_sum, stats = jax.jit(make_loss_sums(abstract_model(MOE)[0], Layout(), StepConfig()))(
      params, packed_batch())
  load = np.asarray(stats["mtp_moe_load"])
  assert load.shape == (1, 4) and load.sum() == B * L * 2  # every token to its top-2
  main = float(stats["nll_sum"]) + 0.01 * float(stats["moe_aux_sum"]) + \
      0.001 * float(stats["moe_z_sum"])
  mtp = 0.3 * float(stats["mtp_loss_sum"]) + 0.01 * float(stats["mtp_moe_aux_sum"]) + \
      0.001 * float(stats["mtp_moe_z_sum"])
  assert float(stats["mtp_moe_aux_sum"]) > 0 and float(stats["mtp_moe_z_sum"]) > 0
  np.testing.assert_allclose(float(loss_sum), main + mtp, rtol=1e-6)
  # The update moves each bias by its own blocks' loads: the layers' by moe_load, the module's
  # by mtp_moe_load (trainer/non_gradient.py).
  moved = NonGradient(param_names(MOE), 1e-3).apply(params, params, stats)
  for path, key in ((("moe_layers",), "moe_load"), (("mtp", "block"), "mtp_moe_load")):
    before, after = params, moved
    for name in (*path, "moe", "router", "bias"):
      before, after = before[name], after[name]
    want = np.asarray(stats[key], np.float32)
    want = 1e-3 * np.sign(want.mean(axis=-1, keepdims=True) - want)
    np.testing.assert_allclose(np.asarray(after) - np.asarray(before), want, atol=1e-9)


def test_logits_and_export_leave_the_modules_out(tmp_path):
  params = init_params(TINY, jax.random.key(2))
  model = nnx.merge(abstract_model(TINY)[0], params)
  plain = dataclasses.replace(TINY, mtp_depth=0)
  main = nnx.merge(abstract_model(plain)[0], {k: v for k, v in params.items() if k != "mtp"})
  tokens = packed_batch()["inputs"]
  np.testing.assert_array_equal(model(tokens), main(tokens))
  hf.save_pretrained(model, str(tmp_path))  # the main model's weights only
  np.testing.assert_array_equal(hf.from_pretrained(str(tmp_path))(tokens), main(tokens))


def test_refused_settings():
  with pytest.raises(ValueError, match="mtp_depth and model.mtp_loss_weight must be >= 0"):
    dataclasses.replace(TINY, mtp_depth=-1).validate()
  with pytest.raises(ValueError, match="multi-token prediction modules share it"):
    ComputeConfig(fp8=Fp8Config(enabled=True, targets="head")).validate(TINY)
  # A current-scaling recipe keeps no history, so the shared head may run in fp8.
  ComputeConfig(fp8=Fp8Config(enabled=True, recipe="tensorwise", targets="head")).validate(TINY)
  with pytest.raises(ValueError, match="init_from=hf.*mtp_depth=0"):
    TrainConfig(model=TINY, init_from="hf:/nowhere").validate()
