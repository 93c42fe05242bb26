"""sharding/layout.py: one layout, resolved once, for the trainer and the analytic model alike; the
step bound to it; presets that overrides cannot reach."""

import dataclasses

import pytest

import configs
from sharding import LayoutError, MeshConfig
from sharding.layout import Layout
from sharding.layout_text import parse
from tests import parallel_harness as harness
from trainer.trainer import Trainer


def M(**sizes) -> MeshConfig:
  return MeshConfig(**{"data": 1, **sizes})


# A resolved run's decisions on its devices (sharding.resolve); the other Layout fields are the
# plan that `TrainConfig.layout` resolves without devices.
DECISIONS = {"mesh", "rules", "platform", "attention", "stage_attention", "context_impl",
             "ulysses_degree", "load_balanced", "grouped_matmul", "exchange", "stacks",
             "in_pipeline_stage", "in_replica_vmap"}


def plan(layout: Layout) -> dict:
  assert DECISIONS < {f.name for f in dataclasses.fields(layout)}
  return {f.name: getattr(layout, f.name) for f in dataclasses.fields(layout)
          if f.name not in DECISIONS}


def test_the_trainer_and_the_analytic_model_resolve_the_same_layout():
  """`TrainConfig.layout` (memory/plan) is what the trainer resolves: sizes, switches, batch
  split, and the vocabulary and lookup decisions made from the same group tokens."""
  cfg = harness.config(M(fsdp=4, tensor=2, sequence_parallel=True), microbatches=2)
  run = Trainer(cfg).layout
  layout = cfg.layout(8)
  assert plan(run) == plan(layout)
  assert dict(run.mesh.shape) == layout.sizes()
  assert layout == Layout(fsdp=4, tensor=2, sequence_parallel=True, micro_batch=4,
                          microbatches=2)
  assert layout.global_batch == cfg.batch_size and layout.num_devices == 8
  vocab, seq = cfg.model.vocab_size, cfg.seq_len
  assert run.vocab_split == layout.splits_vocab(vocab, seq)
  assert run.lookup_rows == layout.moves_lookup_rows(vocab, seq)
  assert run.rules == layout.rules_for(vocab, seq)
  # The fsdp group's tokens per microbatch: the batch over the non-fsdp batch axes (1 here).
  assert layout.group_tokens(seq) == cfg.batch_size * seq / cfg.microbatches


def test_layout_strings_use_the_mesh_names_and_round_trip():
  layout = Layout(data=2, fsdp=4, pipeline=2, zero_stage=1, micro_batch=2, microbatches=8,
                  remat="full", pipeline_schedule="interleaved_1f1b", virtual_stages=2)
  text = layout.string()
  keys = {item.split("=")[0] for item in text.split(",")}
  assert text.startswith("data=2,pipeline=2,fsdp=4,") and not keys & {"dp", "tp", "pp", "cp"}
  assert parse(text) == layout
  assert parse("dp=2,pp=2,fsdp=4,zero=1,mbs=2,ga=8,remat=full,schedule=interleaved_1f1b,"
               "vpp=2") == layout


def test_layout_errors_are_one_line_and_before_compiling():
  for impl in ("ring", "ulysses_ring"):  # collective-permutes cannot run inside a stage
    cfg = harness.config(M(pipeline=2, context=2, data=2), compute=dataclasses.replace(
        harness.COMPUTE, context_impl=impl, ulysses_degree=2 if impl == "ulysses_ring" else 0))
    with pytest.raises(LayoutError, match=f"context_impl={impl} sends its ring's blocks by"
                       " collective-permutes, .* set compute.context_impl=allgather or ulysses"):
      cfg.layout(8)
  cfg = harness.config(M(pipeline=2, data=4), microbatches=2)
  cfg.compute = dataclasses.replace(cfg.compute, attention_impl="pallas_flash")
  cfg.layout(8)  # a GPU runs it; on CPU the run's resolution refuses it, before compiling
  with pytest.raises(LayoutError, match="pallas_flash runs inside a pipeline stage only where"):
    Trainer(cfg)
  cfg = harness.config(M(data=8))
  cfg.batch_size = 12
  with pytest.raises(LayoutError) as error:
    cfg.layout(8)
  assert "\n" not in str(error.value) and "batch_size=12" in str(error.value)


def lowered(cfg, scope_of=None) -> str:
  """The train step of a fresh Trainer (nothing cached) lowered outside any sharding scope, or
  inside the scope of the Trainer `scope_of`."""
  trainer = Trainer(cfg)
  args = (trainer.abstract_state, trainer.abstract_batch())
  if scope_of is None:
    return trainer.train_step.lower(*args).as_text()
  with scope_of.scope():
    return trainer.train_step.lower(*args).as_text()


def test_the_step_traces_in_its_own_layout_wherever_it_is_called():
  """The jitted step is bound to its layout, so tracing it outside that layout is impossible:
  lowered outside any sharding scope, inside its own and inside another layout's, it is the
  same program (the unbound step outside a scope would be the one-device program)."""
  fsdp_cfg, data_cfg = harness.config(M(fsdp=8)), harness.config(M(data=8))
  outside = lowered(fsdp_cfg)
  assert outside != lowered(data_cfg)  # the two layouts really give different programs
  assert lowered(fsdp_cfg, Trainer(fsdp_cfg)) == outside
  assert lowered(fsdp_cfg, Trainer(data_cfg)) == outside


@pytest.mark.parametrize("preset", ["debug", "debug_moe", "llama3_8b", "mixtral_8x7b"])
def test_overrides_never_reach_a_preset(preset):
  """ml-collections applies `--config.a.b=v` by setattr on nested configs: a second config built
  from the same preset must not see the first one's overrides."""
  first = configs.get(preset)
  pristine = configs.get(preset)
  first.compute.fp8.enabled = not first.compute.fp8.enabled
  first.model.num_layers += 1
  first.mesh.tensor = 8
  if first.model.moe is not None:
    first.model.moe.num_experts += 2
  again = configs.get(preset)
  assert again == pristine and again != first


def test_stages_are_manual_over_expert_where_zero_keeps_whole_gradient_sums():
  """`Layout.stage_expert_axes`: a pipeline stage is manual over `expert` with the dropless MoE at
  ZeRO-0/1 (each expert device keeps whole sums of the shared weights' gradients, reduced once a
  step); not without stages, not for the dropping MoE, not at ZeRO-2, which splits the sums."""
  stages = Layout(pipeline=2, expert=4)
  assert stages.stage_expert_axes == ("expert",)
  assert dataclasses.replace(stages, zero_stage=1).stage_expert_axes == ("expert",)
  assert dataclasses.replace(stages, zero_stage=2).stage_expert_axes == ()
  assert dataclasses.replace(stages, moe_dispatch="dropping").stage_expert_axes == ()
  assert Layout(data=2, expert=4).stage_expert_axes == ()
  assert Layout(pipeline=2, data=4).stage_expert_axes == ()
