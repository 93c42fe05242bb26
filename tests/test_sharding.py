"""Mesh sizes, the rules table, ZeRO views, layout errors, and the golden spec table."""

import os

import pytest
from jax.sharding import PartitionSpec as P

import sharding
from configs import llama
from sharding import LayoutError, MeshConfig
from sharding.rules import (DEFAULT_RULES, layout_rules, logical_to_spec, lookup_moves_rows,
                            role_rules, split_vocab_over_fsdp)
from trainer.trainer import Trainer

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "sharding_debug.txt")
SIZES = {"data": 2, "pipeline": 1, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}


def test_minus_one_fills_and_product_must_match():
  assert sharding.resolve_sizes(MeshConfig(data=-1, tensor=2), 8)["data"] == 4
  assert sharding.resolve_sizes(MeshConfig(data=2, fsdp=-1, tensor=2), 8)["fsdp"] == 2
  with pytest.raises(LayoutError, match="has 4 devices but 8 are available"):
    sharding.resolve_sizes(MeshConfig(data=2, tensor=2), 8)
  with pytest.raises(LayoutError, match="only one mesh axis may be -1"):
    sharding.resolve_sizes(MeshConfig(data=-1, fsdp=-1), 8)
  with pytest.raises(LayoutError, match="cannot fill 8 devices"):
    sharding.resolve_sizes(MeshConfig(data=-1, tensor=3), 8)


def test_mesh_axes_in_fixed_order():
  mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  assert mesh.axis_names == sharding.AXES
  assert dict(mesh.shape) == {"data": 2, "pipeline": 1, "fsdp": 2, "expert": 1, "context": 1,
                              "tensor": 2}
  # tensor is innermost: its pairs are neighbouring devices (the fastest links on a node)
  assert [d.id for d in mesh.devices[0, 0, 0, 0, 0, :]] == [0, 1]


def test_hosts_go_to_outer_axes_and_tensor_stays_inside():
  sizes = {"data": 4, "pipeline": 2, "fsdp": 8, "expert": 1, "context": 1, "tensor": 8}
  assert sharding.split_across_hosts(sizes, 8) == {
      "data": 4, "pipeline": 2, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}
  assert sharding.split_across_hosts(sizes, 8, "data=2,fsdp=4")["fsdp"] == 4
  with pytest.raises(LayoutError, match="multiply to 2"):
    sharding.split_across_hosts(sizes, 8, "data=2")
  with pytest.raises(LayoutError, match="tensor=8 would span 2 hosts"):
    sharding.split_across_hosts(sizes, 8, "data=4,tensor=2")
  assert sharding.split_across_hosts(sizes, 8, "data=4,tensor=2", True)["tensor"] == 2


def test_rules_resolve_in_priority_order_each_axis_once():
  # Attention heads claim `tensor` before the sequence does, even with sequence parallelism.
  sp_rules = layout_rules(DEFAULT_RULES, sequence_parallel=True)
  q = logical_to_spec(("batch", "seq", "act_heads", "head_dim"), (8, 16, 4, 8), SIZES, sp_rules)
  assert q == P(("data", "fsdp"), None, "tensor", None)
  residual = logical_to_spec(("batch", "res_seq", "act_embed"), (8, 16, 32), SIZES, sp_rules)
  assert residual == P(("data", "fsdp"), "tensor", None)
  plain = logical_to_spec(("batch", "res_seq", "act_embed"), (8, 16, 32), SIZES, DEFAULT_RULES)
  assert plain == P(("data", "fsdp"), None, None)
  # size-1 axes are dropped: expert=1 never shows up in a spec
  assert logical_to_spec(("experts", "embed"), (4, 32), SIZES, DEFAULT_RULES) == P(None, "fsdp")


def test_vocab_over_fsdp_splits_the_vocab_dims_and_keeps_the_group_tokens_whole():
  split = layout_rules(DEFAULT_RULES, vocab_over_fsdp=True)
  assert split != DEFAULT_RULES
  # Logits: the vocab takes fsdp before the batch can; the head and the table split their vocab
  # dim over tensor and fsdp, so their `embed` dim stays whole.
  assert logical_to_spec(("batch", "seq", "act_vocab"), (8, 16, 64), SIZES, split) == \
      P("data", None, ("tensor", "fsdp"))
  assert logical_to_spec(("embed", "vocab"), (32, 64), SIZES, split) == P(None, ("tensor", "fsdp"))
  assert logical_to_spec(("vocab", "embed"), (64, 32), SIZES, split) == P(("tensor", "fsdp"), None)
  # Without it, the same names resolve as before: batch over data x fsdp, embed over fsdp.
  assert logical_to_spec(("batch", "seq", "act_vocab"), (8, 16, 64), SIZES, DEFAULT_RULES) == \
      P(("data", "fsdp"), None, "tensor")
  assert logical_to_spec(("embed", "vocab"), (32, 64), SIZES, DEFAULT_RULES) == P("fsdp", "tensor")


@pytest.mark.parametrize("setting,fsdp,tensor,vocab,tokens,expected", [
    ("auto", 8, 1, 32000, 2048, True),     # gathering 2048 token rows beats 32000 head columns
    ("auto", 8, 1, 32000, 8000, True),     # at the 4x margin
    ("auto", 8, 1, 32000, 8001, False),
    ("auto", 8, 1, 32000, 65536, False),   # a large batch keeps the weight gathers
    ("auto", 4, 2, 32000, 4096, False),    # tensor already splits the head: 16000 columns each
    ("auto", 4, 2, 32000, 2048, True),
    ("auto", 8, 1, 32004, 2048, False),    # the vocab does not divide over fsdp
    ("auto", 1, 8, 32000, 2048, False),    # no fsdp, nothing to decide
    ("on", 8, 1, 32000, 65536, True),
    ("off", 8, 1, 32000, 2048, False),
])
def test_vocab_over_fsdp_auto_picks_the_smaller_gather(setting, fsdp, tensor, vocab, tokens,
                                                       expected):
  assert split_vocab_over_fsdp(setting, fsdp=fsdp, tensor=tensor, vocab=vocab,
                               group_tokens=tokens) is expected


@pytest.mark.parametrize("fsdp,tensor,pipeline,tokens,expected", [
    (8, 1, 1, 2048, True),    # 2048 token rows against 32000 table rows
    (8, 1, 1, 32000, False),
    (4, 2, 1, 16000, False),  # tensor already splits the table: 16000 rows each
    (8, 1, 2, 2048, False),   # not inside the pipeline's shard_map (XLA aborts there)
    (1, 8, 1, 2048, False),   # no fsdp, nothing to gather
])
def test_lookup_moves_rows_when_the_group_has_fewer_tokens_than_the_table(
    fsdp, tensor, pipeline, tokens, expected):
  assert lookup_moves_rows(fsdp=fsdp, tensor=tensor, pipeline=pipeline, vocab=32000,
                           group_tokens=tokens) is expected
  # Never with the sequence split (wrong rows from the partitioned lookup, see the rule).
  assert not lookup_moves_rows(fsdp=fsdp, tensor=tensor, pipeline=pipeline, vocab=32000,
                               group_tokens=tokens, context=2)


def test_indivisible_dim_names_tensor_shape_and_axes():
  sizes = dict(SIZES, tensor=16)
  with pytest.raises(LayoutError) as error:
    logical_to_spec(("layers", "embed", "kv_heads", "head_dim"), (2, 32, 8, 64), sizes,
                    DEFAULT_RULES, "layers/attn/k/w")
  message = str(error.value)
  assert "layers/attn/k/w (2, 32, 8, 64)" in message
  assert "kv_heads=8 cannot be split over tensor=16" in message


def test_overrides_replace_rows_and_reject_unknown_axes_and_names():
  overrides = sharding.parse_overrides("embed=fsdp+data; mlp=")
  rules = sharding.with_overrides(DEFAULT_RULES, overrides)
  assert logical_to_spec(("embed", "mlp"), (32, 64), SIZES, rules) == P(("fsdp", "data"), None)
  with pytest.raises(LayoutError, match="unknown mesh axes"):
    sharding.parse_overrides("embed=model")
  with pytest.raises(LayoutError, match="'embedz=fsdp' names no logical dim"):
    sharding.parse_overrides("embedz=fsdp")


@pytest.mark.parametrize("stage,sharded_roles", [
    (0, set()), (1, {"opt_state"}), (2, {"opt_state", "grads"}),
    (3, {"opt_state", "grads", "params"})])
def test_zero_stage_views(stage, sharded_roles):
  sizes = dict(SIZES, fsdp=1, tensor=1, data=8)
  for role in ("params", "grads", "opt_state"):
    spec = logical_to_spec(("layers", "embed", "mlp"), (2, 32, 64), sizes,
                           role_rules(DEFAULT_RULES, role, stage))
    assert (spec == P(None, "data", None)) == (role in sharded_roles), (role, spec)
    # Context parallelism's devices hold the same parameters: ZeRO shards over them too.
    with_context = logical_to_spec(("layers", "embed", "mlp"), (2, 32, 64),
                                   dict(sizes, data=2, context=4),
                                   role_rules(DEFAULT_RULES, role, stage))
    assert (with_context == P(None, ("data", "context"), None)) == (role in sharded_roles)
    # So do expert parallelism's (each holds other tokens), for the weights they share; the
    # experts' own weights keep `expert` on their experts dim, their state split over data only.
    with_expert = dict(sizes, data=2, expert=4)
    shared = logical_to_spec(("layers", "embed", "mlp"), (2, 32, 64), with_expert,
                             role_rules(DEFAULT_RULES, role, stage))
    assert (shared == P(None, ("data", "expert"), None)) == (role in sharded_roles)
    routed = logical_to_spec(("layers", "experts", "embed", "mlp"), (2, 8, 32, 64), with_expert,
                             role_rules(DEFAULT_RULES, role, stage))
    assert routed == P(None, "expert", "data" if role in sharded_roles else None, None)


def debug_config(**mesh):
  cfg = llama.debug()
  cfg.mesh = MeshConfig(**{"data": 1, **mesh})
  return cfg


@pytest.mark.parametrize("mesh,options,message", [
    (dict(tensor=8), {}, "kv_heads=2 cannot be split over tensor=8"),
    (dict(data=8), dict(batch_size=12), "batch_size=12 is not divisible by the data-parallel"
                                        " size 8 (data=8) x microbatches=1"),
    (dict(data=8), dict(batch_size=16, microbatches=4),
     "batch_size=16 is not divisible by the data-parallel size 8 (data=8) x microbatches=4"),
    (dict(fsdp=4, tensor=2, sequence_parallel=True), dict(seq_len=33),
     "seq_len=33 is not divisible by context x tensor"),
    (dict(data=8, sequence_parallel=True), {}, "sequence_parallel=True needs tensor"),
    (dict(data=4), {}, "has 4 devices but 8 are available"),
    (dict(fsdp=8, vocab_over_fsdp="yes"), {}, "mesh.vocab_over_fsdp='yes' is not a choice"),
])
def test_invalid_layouts_fail_before_compiling(mesh, options, message):
  cfg = debug_config(**mesh)
  for key, value in options.items():
    setattr(cfg, key, value)
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
    Trainer(cfg)


def test_replicated_parameters_are_refused_when_layout_shards():
  cfg = debug_config(tensor=2, fsdp=4)
  cfg.sharding_rules = "mlp=;embed="  # silently replicates the MLP and everything on fsdp
  with pytest.raises(ValueError, match="replicated on every device"):
    Trainer(cfg)
  cfg = debug_config(data=8)  # plain data parallelism replicates by design: no complaint
  assert Trainer(cfg).param_rows


GOLDEN_LAYOUTS = {
    "fsdp=8": dict(fsdp=8),
    "fsdp=4,tensor=2,sequence_parallel": dict(fsdp=4, tensor=2, sequence_parallel=True),
    "data=2,fsdp=2,tensor=2,zero_stage=3": dict(data=2, fsdp=2, tensor=2, zero_stage=3),
}


def golden_text() -> str:
  parts = []
  for name, mesh in GOLDEN_LAYOUTS.items():
    parts.append(f"=== debug model, {name} ===\n{Trainer(debug_config(**mesh)).sharding_report()}")
  return "\n\n".join(parts) + "\n"


def test_golden_spec_table():
  """The PartitionSpec of every parameter and activation of the debug model under 3 layouts.

  A deliberate change (new rule, renamed parameter) updates the file with
  `UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_sharding.py -k golden`; review the diff.
  """
  text = golden_text()
  if os.environ.get("UPDATE_GOLDEN"):
    os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
    with open(GOLDEN, "w") as f:
      f.write(text)
  with open(GOLDEN) as f:
    expected = f.read()
  assert text == expected, (
      "the sharding of the debug model changed; if intended, regenerate with UPDATE_GOLDEN=1"
      " (see this test's docstring) and commit the reviewed diff of " + GOLDEN)


@pytest.mark.parametrize("batch,microbatches,split", [(8, 1, True), (32, 1, False),
                                                      (32, 4, True)])
def test_trainer_and_estimate_split_the_vocab_alike(batch, microbatches, split):
  """The debug model (264 vocab) at 8 tokens a sequence on fsdp=8: the group shares batch x 8 /
  microbatches tokens per microbatch; "auto" splits the vocab at 64 and keeps it at 256. The
  analytic model (meshtron plan / memory) decides the same from the same layout."""
  cfg = debug_config(fsdp=8)
  cfg.batch_size, cfg.seq_len, cfg.microbatches = batch, 8, microbatches
  assert Trainer(cfg).layout.vocab_split is split
  assert cfg.layout(8).splits_vocab(cfg.model.vocab_size, cfg.seq_len) is split
