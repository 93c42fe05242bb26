"""The analytic step time of pipelined layouts (sharding/plan/hardware.py): meshtron's executor
against nanotron's stages, on the small model of tests/test_estimate.py."""

import pytest

from sharding.layout import Layout
from sharding.pipeline import schedules
from sharding.pipeline.schedules import bubble_ratio
from sharding.plan import hardware
from sharding.plan.estimate import PLAYBOOK_MIXED
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
