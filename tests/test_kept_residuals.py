"""mesh.pipeline_recompute=false: the pipeline stages keep their forward's residuals for the
backward tick (as Megatron's do) instead of running the chunk's forward again; the step trains
exactly like one device, its backward ticks run no forward, and the analytic model prices it as
the stages that store activations."""

import dataclasses

import pytest

from configs import llama
from sharding import Layout, MeshConfig
from sharding.layout_text import parse
from sharding.mesh import LayoutError
from sharding.pipeline import stage_split
from sharding.plan import estimate, hardware, planner
from tests import parallel_harness as harness
from tests.test_moe_parallel import MOE
from tests.test_parallel import assert_same_training
from tests.test_pipeline import MODELS, loop_counts, references  # noqa: F401 (a fixture)
from trainer.trainer import Trainer


def kept(stages, schedule, virtual=1, **mesh):
  return MeshConfig(**{"data": 8 // stages, **mesh, "pipeline": stages},
                    pipeline_schedule=schedule, virtual_stages=virtual,
                    pipeline_recompute=False)


FAST = [pytest.param(kept(2, "paired_1f1b", 2), "none", id="pipeline=2,paired_1f1b,vpp=2"),
        # The Megatron-Bridge 70B anchor's stages: kept residuals under selective remat.
        pytest.param(kept(2, "paired_1f1b", 2), "selective",
                     id="pipeline=2,paired_1f1b,vpp=2,selective"),
        pytest.param(kept(2, "1f1b", data=1, fsdp=2, tensor=2), "none",
                     id="pipeline=2,1f1b,fsdp=2,tensor=2")]
SLOW = [pytest.param(kept(4, "interleaved_1f1b", 2, data=2), id="pipeline=4,interleaved"),
        pytest.param(kept(2, "zero_bubble"), id="pipeline=2,zero_bubble"),
        pytest.param(kept(4, "zbv", 2, data=2), id="pipeline=4,zbv"),
        pytest.param(kept(4, "dualpipev", 2, data=2), id="pipeline=4,dualpipev")]


@pytest.mark.parametrize("mesh,remat", FAST)
def test_kept_residuals_train_like_one_device(mesh, remat, references):
  """8 microbatches, 3 AdamW steps: loss, gradients and parameters equal the one-device run."""
  assert_same_training(harness.run(mesh, microbatches=8, model=MODELS[8], remat=remat),
                       references(8))


@pytest.mark.slow
@pytest.mark.parametrize("mesh", SLOW)
def test_kept_residuals_train_like_one_device_every_schedule(mesh, references):
  assert_same_training(harness.run(mesh, microbatches=8, model=MODELS[8]), references(8))


def compiled(recompute: bool, remat: str = "none"):
  cfg = harness.config(dataclasses.replace(kept(4, "1f1b", data=2), pipeline_recompute=recompute),
                       microbatches=8, model=MODELS[4], remat=remat)
  trainer = Trainer(cfg)
  with trainer.scope():
    return trainer.train_step.lower(trainer.abstract_state, trainer.abstract_batch()).compile()


def test_backward_ticks_run_no_forward_and_keep_more():
  """1F1B, 4 stages, 8 microbatches. A layer's dot runs once in the forward and twice in the
  backward (the input's and the weight's gradients); recomputing, a backward tick runs the
  forward's again: 4 a microbatch against 3 kept. The dots the step executes (each loop's trips
  x its body's) measured 732 recomputing, 606 kept: the layers' 504 drop by their quarter, the
  head's and the rest (228) stay. The kept residuals take more memory than the recomputing
  program's stage inputs. Kept under remat=selective (the 70B anchor's stages), the backward
  runs the attention's score dots again, not the projections': 624 dots, 18 more than kept
  under none and 108 fewer than recomputing, at 74% of its temporary memory."""
  counts, temps = {}, {}
  for recompute, remat in ((True, "none"), (False, "none"), (False, "selective")):
    program = compiled(recompute, remat)
    loops = loop_counts(program.as_text(), lambda i: i.op == "dot")
    counts[recompute, remat] = sum(trips * dots for trips, dots in loops if trips)
    temps[recompute, remat] = program.memory_analysis().temp_size_in_bytes
  assert counts[False, "none"] < 0.85 * counts[True, "none"], counts
  assert temps[False, "none"] > temps[True, "none"], temps
  assert counts[False, "none"] < counts[False, "selective"] < counts[True, "none"], counts
  assert temps[False, "selective"] < temps[False, "none"], temps


def test_layout_and_estimate_of_kept_residuals():
  """The switch reads and prints as pipeline_recompute=0; the analytic model prices it as the
  stages that store activations (stages_recompute=False: Megatron's): no forward rerun."""
  lay = parse("pipeline=4,data=2,pipeline_recompute=0")
  assert not lay.pipeline_recompute and parse(lay.string()) == lay
  recomputing = dataclasses.replace(lay, pipeline_recompute=True)
  model = llama.model("llama3_8b")
  assert hardware.flops_split(model, lay, 8192) == hardware.flops_split(
      model, recomputing, 8192, stages_recompute=False)
  assert sum(hardware.flops_split(model, lay, 8192)) < sum(
      hardware.flops_split(model, recomputing, 8192))
  assert not Layout(pipeline_recompute=False).stages_recompute()  # no stages: nothing rerun


def test_uneven_stages_keep_their_residuals_and_train_like_one_device(references):
  """8 layers as 1+3+2+2 on 4 stages (rows padded to 3 a stage): the positions' row patterns
  nest (the second stage's holds every row the others hold), so one traced chunk program keeps
  every tick's residuals, the padding rows masked as the recomputing executor masks them
  (stage_split.nested). Llama-3.1-405B's 126 layers on 16 stages nest alike."""
  mesh = dataclasses.replace(kept(4, "1f1b", data=2), stage_layers="1+3+2+2")
  assert Trainer(harness.config(mesh, microbatches=8, model=MODELS[8])).stage_layers == (
      ("layers", (1, 3, 2, 2)),)
  assert_same_training(harness.run(mesh, microbatches=8, model=MODELS[8]), references(8))


@pytest.mark.parametrize("model,moe", [
    (dataclasses.replace(MODELS[8], num_layers=4), dataclasses.replace(MOE, dispatch="dropping")),
    (dataclasses.replace(MODELS[8], mtp_depth=1), None),
], ids=["a dense and a MoE stack split unevenly", "multi-token prediction"])
def test_kept_residuals_refuse_what_they_cannot_keep(model, moe):
  """One line before anything is built: row patterns that do not nest (1 dense + 3 MoE layers
  on 2 stages: the first runs the dense and a MoE layer, the second two MoE layers; no position
  runs them all) or a last stage's extra modules are not kept; nor does `plan` rank them."""
  mesh = kept(2, "1f1b", data=2, expert=2) if moe else kept(2, "1f1b")
  cfg = harness.config(mesh, microbatches=8, model=model, moe=moe)
  with pytest.raises(LayoutError, match="pipeline_recompute=false keeps one program"):
    Trainer(cfg)
  # `plan` refuses them with the trainer's sentence and ranks their recomputing siblings.
  result = planner.plan(cfg.model, 8, 64, 8 * 64 * 8, estimate.PLAYBOOK_MIXED,
                        hardware.PROFILES["h100"])
  refused = [what for what, why in result.rejected if why == stage_split.KEPT_REFUSAL]
  assert refused and all("pipeline_recompute=0" in what for what in refused)
  staged = [c.layout for c in result.ranked if c.layout.pipeline > 1]
  assert staged and all(lay.pipeline_recompute for lay in staged)


def test_memory_estimate_of_kept_residuals():
  """The analytic memory: the executor's stash and split head either way; kept, the in-flight
  chunks' activations (as Megatron's stages hold them) instead of one chunk's."""
  lay = parse("pipeline=4,data=2,ga=8,pipeline_recompute=0")
  recomputing = dataclasses.replace(lay, pipeline_recompute=True)
  model = llama.model("llama3_8b")
  kept, again = estimate.memory(model, lay, 8192), estimate.memory(model, recomputing, 8192)
  assert kept.logits == again.logits  # the head's tokens split over the stages in both
  megatron = estimate.memory(model, recomputing, 8192, stages_recompute=False)
  assert kept.activations > again.activations and megatron.activations < kept.activations
