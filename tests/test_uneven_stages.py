"""Uneven pipeline stages: layer counts that the stages do not divide (Llama-3 405B's 126 layers
on 16 stages) train exactly like one device; the padding rows of the stored stack cost memory
but run no matmuls; the split is one syntax everywhere (config, layout strings, estimator)."""

import dataclasses
import json
import os
import subprocess
import sys
from unittest import mock

import jax
import numpy as np
import pytest

from benchmarks import playbook_sweep as sweep
from cli.memory import run_memory
from configs import llama as llama_presets
from sharding import LayoutError, MeshConfig, layout_of, layout_text
from sharding.pipeline import stage_split
from sharding.plan import estimate
from sharding.xla import hlo
from tests import parallel_harness as harness
from tests.test_parallel import assert_same_training
from tests.test_pipeline import references  # noqa: F401  (the one-device runs, a fixture)
from trainer.config import CheckpointConfig
from trainer.trainer import Trainer

MESHTRON = os.path.join(os.path.dirname(sys.executable), "meshtron")


def model(layers):
  return dataclasses.replace(harness.MODEL, num_layers=layers)


@pytest.mark.parametrize("layers,positions,given,split", [
    (5, 2, "", (3, 2)),          # one fewer on the last stage (it also runs the head)
    (7, 4, "", (2, 2, 2, 1)),
    (126, 16, "", (7,) + (8,) * 14 + (7,)),  # Llama-3 405B on 16 stages: first and last 7
    (28, 8, "", (3, 3, 4, 4, 4, 4, 3, 3)),   # the playbook's 3B on 8 stages
    (8, 4, "", (2, 2, 2, 2)),    # even: nothing padded
    (5, 2, "1+4", (1, 4)),       # given
])
def test_the_split_is_automatic_or_given(layers, positions, given, split):
  assert stage_split.split(layers, positions, given) == split
  assert sum(split) == layers
  rows = stage_split.real_rows(split)
  assert len(rows) == layers and stage_split.present(split).sum() == layers


@pytest.mark.parametrize("layers,positions,given,message", [
    (6, 8, "", "8 pipeline stages .x virtual stages. for 6 layers"),
    (5, 2, "2+2", "gives 2 stages with 4 layers"),
    (5, 2, "2+x", "positive layer counts joined by"),
])
def test_bad_splits_are_one_line_errors(layers, positions, given, message):
  with pytest.raises(LayoutError, match=message):
    stage_split.split(layers, positions, given)


def test_the_split_reads_back_from_a_layout_string():
  lay = layout_text.parse("data=2,pipeline=2,stage_layers=1+4,ga=4")
  assert lay.stage_layers == "1+4" and layout_text.parse(lay.string()) == lay
  assert lay.stage_split(5) == (1, 4) and lay.layers_per_device(5) == 4
  with pytest.raises(LayoutError, match="pipeline=1"):
    layout_of(MeshConfig(data=8, stage_layers="1+4"), 8, model(5), batch_size=8, seq_len=16)


@pytest.mark.parametrize("layers,mesh", [
    pytest.param(5, dict(data=4, pipeline=2), id="5-layers-pp2"),
    pytest.param(7, dict(data=2, pipeline=4), id="7-layers-pp4"),
    pytest.param(5, dict(data=4, pipeline=2, stage_layers="1+4", pipeline_schedule="zero_bubble"),
                 id="5-layers-pp2-given-1+4-zero-bubble", marks=pytest.mark.slow),
    pytest.param(7, dict(data=4, pipeline=2, pipeline_schedule="zbv", virtual_stages=2),
                 id="7-layers-pp2-zbv", marks=pytest.mark.slow),
])
def test_uneven_stages_equal_one_device(layers, mesh, references):  # noqa: F811
  """Loss, gradients and parameters after 3 AdamW steps, 8 microbatches: the tolerances of
  tests/test_parallel.py."""
  cfg = MeshConfig(**mesh)
  positions = cfg.pipeline * cfg.virtual_stages
  split = stage_split.split(layers, positions, cfg.stage_layers)
  assert stage_split.is_uneven(split)  # really padded: positions x slots > layers
  assert positions * max(split) > layers
  assert_same_training(harness.run(cfg, microbatches=8, model=model(layers)), references(layers))


def _branch_dots(hlo_text: str) -> list[list[int]]:
  """The matmuls in each branch of each conditional."""
  comps = hlo.computations(hlo_text)
  return [[hlo.count_within(comps, b, lambda x: x.op in ("dot", "convolution"))
           for b in hlo.callees(ins)]
          for instrs in comps.values() for ins in instrs if ins.op == "conditional"]


def dot_free_branches(hlo_text: str) -> int:
  """Conditionals with a branch that runs no matmul while another branch does."""
  return sum(min(counts) == 0 < max(counts) for counts in _branch_dots(hlo_text))


def _row_pattern_switches(hlo_text: str) -> int:
  """Conditionals whose branches all run matmuls, not all as many: a switch over the positions'
  row patterns (sharding/pipeline/executor.py), each branch with its own layers."""
  return sum(min(counts) > 0 and len(set(counts)) > 1 for counts in _branch_dots(hlo_text))


def _trainer(layers, **mesh):
  cfg = harness.config(MeshConfig(data=4, pipeline=2, **mesh), microbatches=8,
                       model=model(layers))
  return Trainer(cfg)


def test_padding_rows_are_masked_and_stay_zero():
  """5 layers on 2 stages are stored as 2 x 3 rows. The two positions' row patterns are one
  stack's (3 rows, and 2 of them), so every position runs the 3 rows and masks its padding row
  (stage_split.nested): the program has the even 6-layer program's matmuls and no switch over
  row patterns (whose branches made XLA copy the rows' weights and gradients; the form before,
  patched in, has one). After training steps the padding weights are still exactly zero (no
  gradient, no decay of zero). In lock step a tick waits for the 3-row position either way."""
  uneven, even = _trainer(5), _trainer(6)
  assert uneven.stage_layers == (("layers", (3, 2)),) and even.stage_layers == ()
  assert uneven.abstract_state.params["layers"]["mlp"]["down"]["w"].shape[0] == 6

  def text(trainer):
    with trainer.scope():
      return trainer.train_step.lower(trainer.abstract_state,
                                      trainer.abstract_batch()).compile().as_text()
  with mock.patch.object(stage_split, "nested", lambda patterns: False):
    switched = text(_trainer(5))
  masked, whole = text(uneven), text(even)
  assert _row_pattern_switches(switched) > 0 == _row_pattern_switches(masked)
  assert masked.count(" dot(") == whole.count(" dot(")

  uneven.init_state()
  with uneven.scope():
    for batch in harness.batches():
      uneven.state, _ = uneven.train_step(uneven.state, uneven.to_device(batch))
  padding = ~stage_split.present((3, 2)).reshape(-1)
  for leaf in jax.tree.leaves(uneven.state.params["layers"]):
    leaf = np.asarray(leaf)
    assert not leaf[padding].any() and leaf[~padding].any()


def test_the_estimator_counts_the_padded_rows():
  """The most loaded stage holds max(split) x virtual layer rows: 126 layers on 16 stages hold
  8 rows each, as 128 layers would (memory and time of that stage); 5 on 2 hold 3."""
  llama = estimate.model_spec(llama_presets.MODELS["llama3_405b"])
  padded = dataclasses.replace(llama, num_layers=128)
  lay = layout_text.parse("data=1,pipeline=16,tensor=8,ga=32")
  ours, as_128 = (estimate.memory(m, lay, 4096, estimate.PLAYBOOK_MIXED) for m in (llama, padded))
  assert lay.layers_per_device(126) == 8 and estimate.stage_layers(llama, lay) == 8
  assert ours.params == pytest.approx(as_128.params)
  assert ours.activations == pytest.approx(as_128.activations)
  assert layout_text.parse("data=4,pipeline=2").layers_per_device(5) == 3


def test_memory_evaluates_every_sweep_layout_with_no_more_stages_than_layers(capsys):
  """`meshtron memory` on every successful layout of the playbook's H100 sweep (the data of
  [18]): a fit verdict for each with no more stages than layers, uneven ones included (refused
  before: 144 of the 1,746 runs), and a one-line reason for the one with more stages than
  layers (the 3B's 28 layers on 32 stages)."""
  verdicts, uneven, reasons = 0, 0, []
  for run in sweep.runs():
    name, lay = run["model"], sweep.layout_of(run)
    layers = llama_presets.MODELS[name].num_layers
    args = dict(model=name, layout=lay.string(), gpu="h100", seq=sweep.SEQ,
                precision="playbook_fp32_accum", plot="", gpus=0, as_json=True)
    if lay.pipeline > layers:
      with pytest.raises(ValueError) as error:
        run_memory(None, False, **args)
      reasons.append(str(error.value))
      continue
    run_memory(None, False, **args)
    out = json.loads(capsys.readouterr().out)
    assert isinstance(out["fits"], bool) and out["total_gb"] > 0
    verdicts += 1
    uneven += layers % lay.pipeline != 0
  assert (verdicts, uneven, len(reasons)) == (1745, 144, 1)
  assert "\n" not in reasons[0] and "32 layers for pipeline" not in reasons[0]
  assert "28 layers for pipeline=32" in reasons[0] and "every stage needs a layer" in reasons[0]


def test_a_padded_checkpoint_resumes_in_other_layouts_and_exports_the_model(tmp_path):
  """3 layers on 2 stages (stored 2 x 2 rows) saved at step 2: restored under data=8 (the model's
  own 3 rows) and under the split 1+2 the parameters are the same; training resumed under
  data=8 continues the original run; the HF export and an HF import into uneven stages hold
  exactly the model's rows."""
  from tests.test_checkpoint import rows, tiny_run
  from cli import convert
  from trainer import checkpoint, hf_init, loop
  from models import hf
  from trainer.state import unstored

  def run_cfg(mesh, **kw):
    cfg = tiny_run(mesh=mesh, microbatches=2, steps=4, checkpoint=CheckpointConfig(every_steps=2),
                   batch_size=16, **kw)
    cfg.model.num_layers = 3
    return cfg

  source = tmp_path / "source"
  loop.run(run_cfg(MeshConfig(data=4, pipeline=2)), str(source))
  params = {}
  for name, mesh in (("data=8", MeshConfig(data=8)),
                     ("1+2", MeshConfig(data=4, pipeline=2, stage_layers="1+2"))):
    cfg = run_cfg(mesh)
    trainer = Trainer(cfg)
    state, _, _ = checkpoint.Checkpointer(str(source / "checkpoints"), cfg.checkpoint).restore(
        2, restore_target(trainer), trainer.iterator("train"), vars(cfg.model), True,
        trainer.stage_layers)
    params[name] = jax.tree.map(np.asarray, unstored(state.params, trainer.stage_layers))
  jax.tree.map(np.testing.assert_array_equal, params["data=8"], params["1+2"])

  resumed = tmp_path / "resumed"
  cfg = run_cfg(MeshConfig(data=8))
  cfg.checkpoint.restore_from = str(source / "checkpoints" / "2")
  loop.run(cfg, str(resumed))
  for step in (3, 4):
    np.testing.assert_allclose(rows(resumed)[step]["loss"], rows(source)[step]["loss"],
                               rtol=1e-5)

  convert.to_hf(str(source), str(tmp_path / "hf"))
  exported = hf.load_params(str(tmp_path / "hf"), run_cfg(MeshConfig(data=8)).model)
  final = Trainer(run_cfg(MeshConfig(data=8)))
  state, _, _ = checkpoint.Checkpointer(str(source / "checkpoints"), final.cfg.checkpoint).restore(
      4, restore_target(final), final.iterator("train"), vars(final.cfg.model))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6),
               exported, state.params)
  cfg = run_cfg(MeshConfig(data=4, pipeline=2), init_from=f"hf:{tmp_path / 'hf'}")
  trainer = Trainer(cfg)
  imported = hf_init.init_state_from_hf(trainer).params
  assert imported["layers"]["mlp"]["down"]["w"].shape[0] == 4
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               unstored(imported, trainer.stage_layers), exported)


def restore_target(trainer):
  """The trainer's abstract state in its shardings: what a checkpoint restores into."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      trainer.abstract_state, trainer.shardings)


@pytest.mark.slow
def test_llama3_405b_on_16_stages_compiles_for_128_h100s():
  """Deviceless: Llama-3 405B, pipeline=16 x tensor=8 (h100x128). The report names the split
  (7+8x14+7) and every stage stores 8 layer rows: the program's argument bytes equal those of a
  128-layer model on the same layout, exactly."""
  def compile_405b(layers):
    result = subprocess.run(
        [MESHTRON, "compile", "--config=llama3_405b", "--target=h100x128", "--json",
         "--config.mesh.data=1", "--config.mesh.fsdp=1", "--config.mesh.pipeline=16",
         "--config.mesh.tensor=8", "--config.mesh.sequence_parallel=true",
         "--config.compute.remat=full", "--config.batch_size=16", "--config.microbatches=16",
         f"--config.model.num_layers={layers}"],
        capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)
  ours, even = compile_405b(126), compile_405b(128)
  assert "layers 7+" + "8+" * 14 + "7;" in ours["extra"]["pipeline stages"]
  assert "at most 8 layers (2 padding rows in all" in ours["extra"]["pipeline stages"]
  assert "at most 8 layers (0 padding rows in all" in even["extra"]["pipeline stages"]
  assert ours["memory"]["argument"] == even["memory"]["argument"]
  assert 0 < ours["memory"]["peak"]


def test_plan_proposes_uneven_stages_where_they_beat_the_even_ones():
  """Llama-3 405B (126 layers) on 128 H100s: of the pipelined layouts whose stages run their
  chunks' forwards again, the fastest splits its 126 layers unevenly (pipeline=16: 7+8x14+7);
  the stage counts that divide 126 (2) rank below. (Of those that keep residuals, pipeline=2 x
  fsdp=32 under full remat ranks above them all: its stages hold 63 layers.)"""
  from sharding.plan import hardware, planner
  model = llama_presets.MODELS["llama3_405b"]
  result = planner.plan(model, 128, 4096, 2**20, estimate.PLAYBOOK_MIXED,
                        hardware.PROFILES["h100"])
  piped = [c for c in result.ranked if c.layout.pipeline > 1 and c.layout.pipeline_recompute]
  uneven = [c for c in piped if 126 % c.layout.pipeline]
  even = [c for c in piped if not 126 % c.layout.pipeline]
  assert uneven and even
  assert piped[0] is uneven[0]
  assert uneven[0].time.tokens_per_s_per_gpu > even[0].time.tokens_per_s_per_gpu
  assert any(126 % c.layout.pipeline for c in result.ranked[:10])
