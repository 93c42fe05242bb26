"""The analytic step time of pipelined layouts (sharding/plan/hardware.py): meshtron's executor
against nanotron's stages, on the small model of tests/test_estimate.py."""

import dataclasses

import pytest

from configs.llama import MODELS
from sharding.layout import Layout
from sharding.layout_text import parse
from sharding.pipeline import schedules
from sharding.pipeline.schedules import bubble_ratio
from sharding.plan import hardware, planner
from sharding.plan.estimate import PLAYBOOK_MIXED, trainer_precision
from tests.test_estimate import SEQ, SMALL


def test_pipelined_steps_price_the_executors_lockstep_ticks():
  """The forward share (2 x params a layer and token, the scores once, the head 2 x 1,600)
  weighs the ticks: meshtron's executor (a stage recomputes its chunk in the backward) pays
  schedules.lockstep_ratio; nanotron's stages (lockstep=False) the bubble's 1 + bubble_ratio;
  unpipelined layouts the same either way."""
  forward = hardware.flops_split(SMALL, Layout(), SEQ, forward_only=True)
  assert forward == pytest.approx((SEQ * 2 * 2 * 2304, SEQ * (2 * 768 / 3 + 2 * 1600)))
  hw, pipe = hardware.PROFILES["h100"], Layout(pipeline=2, microbatches=4)
  times = {(lay.pipeline, lockstep): hardware.step_time(SMALL, lay, SEQ, PLAYBOOK_MIXED, hw,
                                                        lockstep=lockstep)
           for lay in (Layout(microbatches=4), pipe) for lockstep in (True, False)}
  assert times[1, True] == times[1, False]
  backward = 1 - sum(hardware.flops_split(SMALL, pipe, SEQ, forward_only=True)) / sum(
      hardware.flops_split(SMALL, pipe, SEQ))
  assert 0.7 < backward < 0.8  # the layers' 6 of 8: forward, backward and the recomputation
  assert times[2, True].bubble_s / times[2, False].bubble_s == pytest.approx(
      (schedules.lockstep_ratio("1f1b", 2, 4, 1, round(backward, 3)) - 1) /
      bubble_ratio("1f1b", 2, 4))
  assert times[2, True].step_s > times[2, False].step_s


def test_cross_node_pipeline_hops_block_only_in_nanotrons_runs():
  """A hop between stages on different nodes: nanotron's blocking send costs pipeline_hop_s per
  microbatch (blocking_sends=True, the playbook's sweep); meshtron's asynchronous collective
  permute its bytes at the NICs' bandwidth plus the network latency. Hops inside a node, and
  every other collective, are priced the same either way."""
  hw = hardware.PROFILES["h100"]
  across = Layout(pipeline=2, tensor=8, microbatches=4)  # tensor fills a node: stages apart
  inside = Layout(pipeline=2, microbatches=4)
  assert hardware.placement(across, hw.gpus_per_node)["pipeline"] == 1
  for lay in (across, inside):
    meshtron, nanotron = (hardware.step_time(SMALL, lay, SEQ, PLAYBOOK_MIXED, hw,
                                             blocking_sends=b) for b in (False, True))
    hop = next(c for c in hardware.collectives(SMALL, lay, SEQ, PLAYBOOK_MIXED)
               if c.phase == "pipeline")
    assert hop.count == 2 * 4 and hop.ring_steps == hop.count  # each microbatch there and back
    extra = hop.ring_steps * (hw.pipeline_hop_s - hw.inter_latency_s) if lay is across else 0.0
    assert nanotron.comm_s["pipeline"] - meshtron.comm_s["pipeline"] == pytest.approx(extra)
    assert {k: v for k, v in nanotron.comm_s.items() if k != "pipeline"} == \
        {k: v for k, v in meshtron.comm_s.items() if k != "pipeline"}
    assert (extra > 0) == (lay is across)


def test_an_unrolled_chunk_is_priced_without_its_layers_recomputation():
  """Layout.stage_remat: in a pipeline stage whose chunk holds at most UNROLLED_STAGE_GROUPS
  layers the executor's recomputation is the only one (models/transformer.py), so remat
  selective or full prices and stores as none there; with longer chunks, and for nanotron's
  stages (stages_recompute=False), remat stays what it says."""
  from sharding.layout import UNROLLED_STAGE_GROUPS
  from sharding.plan.estimate import memory
  assert UNROLLED_STAGE_GROUPS == 4
  short = Layout(pipeline=2, microbatches=4)  # SMALL's 2 layers: 1 a stage
  long_chunks = dataclasses.replace(SMALL, num_layers=16)  # 8 a stage
  for remat in ("selective", "full"):
    lay = dataclasses.replace(short, remat=remat)
    none = dataclasses.replace(short, remat="none")
    assert lay.stage_remat(SMALL.num_layers) == "none"
    assert lay.stage_remat(long_chunks.num_layers) == remat
    assert Layout(remat=remat).stage_remat(SMALL.num_layers) == remat  # no stages
    assert hardware.flops_split(SMALL, lay, SEQ) == hardware.flops_split(SMALL, none, SEQ)
    assert memory(SMALL, lay, SEQ) == memory(SMALL, none, SEQ)
    assert hardware.flops_split(SMALL, lay, SEQ, stages_recompute=False) != \
        hardware.flops_split(SMALL, none, SEQ, stages_recompute=False)
    assert hardware.flops_split(long_chunks, lay, SEQ) != \
        hardware.flops_split(long_chunks, none, SEQ)


def test_plan_lists_an_unrolled_chunks_program_once():
  """Where remat selective or full would run as none (an unrolled chunk), `plan` lists the
  layout once, as remat=none, and still lists each remat where a stage's layers are scanned;
  kept residuals (pipeline_recompute=false: no forward rerun to stand in) under selective and
  full remat, their remat=none programs rejected (planner.KEPT_UNPRICED)."""
  from sharding.plan import planner
  hw = hardware.PROFILES["h100"]
  for layers, remats in ((8, {"none"}), (64, {"none", "selective", "full"})):
    model = dataclasses.replace(SMALL, num_layers=layers)
    result = planner.plan(model, 8, SEQ, 64 * SEQ, PLAYBOOK_MIXED, hw)
    staged = [c.layout for c in result.ranked if c.layout.pipeline == 2
              and c.layout.virtual_stages == 1]
    rerun = {lay.remat for lay in staged if lay.pipeline_recompute}
    kept = {lay.remat for lay in staged if not lay.pipeline_recompute}
    assert rerun == remats, layers
    assert kept == {"selective", "full"}, layers
    assert any(why == planner.KEPT_UNPRICED and "remat=none" in what
               for what, why in result.rejected), layers


def test_the_executors_recomputed_forward_sends_its_tensor_collectives_again():
  """Sequence parallelism on 2 stages (1 layer each, 4 microbatches): 6 all-gathers a layer pass,
  2 more for the forward the executor recomputes in each backward; nanotron's stages store
  their activations (stages_recompute=False) and send 6; 2 more a microbatch for the head."""
  lay = Layout(pipeline=2, tensor=2, sequence_parallel=True, microbatches=4)
  gathers = {flag: sum(c.count for c in hardware.collectives(SMALL, lay, SEQ, PLAYBOOK_MIXED, flag)
                       if c.phase == "tensor" and c.kind == "all-gather")
             for flag in (True, False)}
  assert gathers == {True: 4 * 1 * (6 + 2) + 2 * 4, False: 4 * 1 * 6 + 2 * 4}


def test_tensorwise_fp8_gathers_a_layer_s_inputs_and_output_gradients_in_fp8():
  """Tensorwise fp8 (Precision.fp8_gathers) gathers each layer input once, quantized (q/k/v's,
  gate/up's), and o's and down's output gradients in e5m2: 4 gathers a layer pass of 1 byte an
  element, 2 more for the executor's recomputed forward; the head's 2 a microbatch stay bf16.
  Rowwise fp8 gathers as bf16 does."""
  lay = Layout(pipeline=2, tensor=2, sequence_parallel=True, microbatches=4)
  tokens_d = SEQ * SMALL.embed_dim  # one sequence a microbatch
  for fp8_gathers, per_layer, width in ((True, 4, 1), (False, 6, 2)):
    precision = trainer_precision("bfloat16", "bfloat16", fp8_layers=True,
                                  fp8_gathers=fp8_gathers)
    gathers = sorted((c.count, c.payload) for c in hardware.collectives(
        SMALL, lay, SEQ, precision) if c.phase == "tensor" and c.kind == "all-gather")
    assert gathers == [(2 * 4, 2 * tokens_d), (4 * (per_layer + 2), width * tokens_d)]
  assert trainer_precision("bfloat16", "bfloat16", fp8_gathers=True).fp8_gathers is False


def test_the_last_stage_runs_the_multi_token_prediction_module_on_all_its_tokens():
  """One MTP module (SMALL's layer, a [2D, D] projection, the head): on 2 stages the last runs
  it on every token of its 4 microbatches, forward and backward once (6 x its matmul params, the
  head's among the rest with the scores); the forward ticks run none of it. Without stages it
  runs with the layers' passes on the device's tokens, as before."""
  mtp = dataclasses.replace(SMALL, mtp_depth=1)
  block = mtp.mtp_block()[0] + 2 * SMALL.embed_dim ** 2
  head = SMALL.vocab_size * SMALL.embed_dim
  for lay, tokens in ((Layout(pipeline=2, microbatches=4), 4 * SEQ), (Layout(), SEQ)):
    (base_l, base_r), (l, r) = (hardware.flops_split(m, lay, SEQ) for m in (SMALL, mtp))
    assert l - base_l == pytest.approx(6 * block * tokens)
    assert r - base_r == pytest.approx(tokens * (6 * head + mtp.attention_flops(SEQ)))
  staged = Layout(pipeline=2, microbatches=4)
  assert hardware.flops_split(mtp, staged, SEQ, forward_only=True) == \
      hardware.flops_split(SMALL, staged, SEQ, forward_only=True)


def test_plan_ranks_no_pipeline_schedule_the_executor_refuses():
  """1F1B needs at least as many microbatches as stages (sharding/pipeline/schedules.py): a
  layout with fewer is rejected with the executor's own sentence, not ranked (the 405B's plan
  on 128 GPUs had ranked pipeline=2 with one microbatch 3rd, a layout its config refuses)."""
  result = planner.plan(MODELS["playbook_8b"], 16, 4096, 2**16, PLAYBOOK_MIXED,
                        hardware.PROFILES["h100"])
  piped = [c.layout for c in result.ranked if c.layout.pipeline > 1]
  assert piped and all(
      schedules.table_if_valid(lay.pipeline_schedule, lay.pipeline, lay.microbatches,
                               lay.virtual_stages) is not None for lay in piped)
  refused = [(what, why) for what, why in result.rejected
             if "needs at least as many microbatches as stages" in why]
  assert refused and all(parse(what).microbatches < parse(what).pipeline for what, _ in refused)


@pytest.mark.parametrize("recompute", [True, False])
def test_a_layouts_schedules_share_its_costs_but_the_bubbles(recompute):
  """`plan` prices a layout's schedules from one hardware.stage_costs and one
  estimate.memory_parts: given those of another schedule, step_time and memory are what they
  are computed alone (exactly), and the schedules' steps differ (and kept, their memory)."""
  hw, model = hardware.PROFILES["h100"], dataclasses.replace(SMALL, num_layers=16)
  lays = [Layout(pipeline=2, microbatches=8, virtual_stages=2, remat="selective",
                 pipeline_schedule=s, pipeline_recompute=recompute)
          for s in ("interleaved_1f1b", "paired_1f1b")]
  alone = [hardware.step_time(model, lay, SEQ, PLAYBOOK_MIXED, hw) for lay in lays]
  sizes = [planner.memory(model, lay, SEQ, PLAYBOOK_MIXED) for lay in lays]
  assert alone[0].step_s != alone[1].step_s
  assert (sizes[0] != sizes[1]) == (not recompute)  # kept: the schedules' microbatches in flight
  for lay, other, time, size in zip(lays, lays[::-1], alone, sizes):
    costs = hardware.stage_costs(model, other, SEQ, PLAYBOOK_MIXED, hw)
    assert hardware.step_time(model, lay, SEQ, PLAYBOOK_MIXED, hw, costs=costs) == time
    parts = planner.memory_parts(model, other, SEQ, PLAYBOOK_MIXED)
    assert planner.memory(model, lay, SEQ, PLAYBOOK_MIXED, parts=parts) == size
