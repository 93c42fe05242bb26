"""Pipeline schedules as tick tables: dependencies hold, and the bubble and memory facts of the
playbook follow from the tables (every operation takes one tick)."""

import itertools

import numpy as np
import pytest

from sharding.pipeline import schedules as S
from tests.schedule_timing import idle_times

CASES = [(p, m) for p in (2, 4, 8) for m in (8, 16) if m >= p]


def ops_of(schedule, stage):
  return [(int(o), int(m), int(c)) for o, m, c in zip(schedule.op[:, stage],
                                                      schedule.microbatch[:, stage],
                                                      schedule.chunk[:, stage]) if o != S.IDLE]


@pytest.mark.parametrize("kind", S.SCHEDULES)
@pytest.mark.parametrize("stages,microbatches", CASES)
def test_every_microbatch_passes_every_stage_in_order(kind, stages, microbatches):
  virtual = 2 if kind in ("interleaved_1f1b", *S.V_SHAPED) else 1
  if kind == "dualpipev" and microbatches < 2 * stages:
    microbatches = 2 * stages  # its minimum
  schedule = S.make(kind, stages, microbatches, virtual)
  when = {}
  for t, s in itertools.product(range(schedule.ticks), range(stages)):
    for op, m, c in schedule.ops_at(t, s):
      # DualPipeV runs some backwards whole and splits others: one name for the input gradient.
      op = S.BACKWARD_INPUT if kind == "dualpipev" and op == S.BACKWARD else op
      key = (op, m, schedule.position(c, s))
      assert key not in when, f"{key} runs twice"
      when[key] = t
  positions = stages * virtual
  split_backward = kind in ("zero_bubble", *S.V_SHAPED)
  backward = S.BACKWARD_INPUT if split_backward else S.BACKWARD
  for m in range(microbatches):
    for p in range(positions):
      assert (S.FORWARD, m, p) in when and (backward, m, p) in when
      if p:  # forward after the previous stage's forward (one tick of transfer)
        assert when[(S.FORWARD, m, p)] > when[(S.FORWARD, m, p - 1)]
      if p < positions - 1:  # backward after the next stage's backward
        assert when[(backward, m, p)] > when[(backward, m, p + 1)]
      assert when[(backward, m, p)] > when[(S.FORWARD, m, p)]
      if split_backward and (S.BACKWARD_WEIGHT, m, p) in when:
        assert when[(S.BACKWARD_WEIGHT, m, p)] > when[(S.BACKWARD_INPUT, m, p)]
      elif split_backward:  # DualPipeV's whole backwards; every other split one has its w
        assert kind == "dualpipev"
  # The executor's head runs once per microbatch, in the tick of its last position's forward.
  heads = schedule.head_ops()
  assert sorted(heads[heads[:, 0] >= 0, 0]) == list(range(microbatches))
  for t, (m, s, c) in enumerate(heads):
    if m >= 0:
      assert when[(S.FORWARD, m, positions - 1)] == t and schedule.position(c, s) == positions - 1


@pytest.mark.parametrize("stages,microbatches", CASES)
def test_bubbles_and_in_flight_microbatches(stages, microbatches):
  p, m = stages, microbatches
  afab, one_f_one_b = S.make("afab", p, m), S.make("1f1b", p, m)
  interleaved = S.make("interleaved_1f1b", p, m, 2)
  zero = S.make("zero_bubble", p, m)
  # AFAB and 1F1B idle (p - 1) / (m + p - 1) of the time (forward and backward each one tick).
  assert afab.bubble_fraction() == pytest.approx((p - 1) / (m + p - 1))
  assert one_f_one_b.bubble_fraction() == pytest.approx((p - 1) / (m + p - 1))
  # Interleaving v chunks per device: (p - 1) / (v m + p - 1).
  assert interleaved.bubble_fraction() == pytest.approx((p - 1) / (2 * m + p - 1))
  # Zero bubble (ZB-H1): weight gradients fill the bubbles, at 1F1B's memory.
  assert zero.bubble_fraction() < one_f_one_b.bubble_fraction()
  assert list(zero.in_flight()) == list(one_f_one_b.in_flight())
  # AFAB keeps all m microbatches in flight on every stage; 1F1B at most p (p - s on stage s).
  assert list(afab.in_flight()) == [m] * p
  assert list(one_f_one_b.in_flight()) == [min(m, p - s) for s in range(p)]


@pytest.mark.parametrize("stages,microbatches", CASES)
def test_zbv_folds_the_model_into_a_v_and_nearly_closes_the_bubble(stages, microbatches):
  """ZB-V: stage s holds positions s and 2p-1-s (the first stage the first and the last); the
  turn at the last stage is a local hand-off, every other message goes to a neighbour. Its bubble
  is below ZB-H1's and 1F1B's, its saved inputs within 1F1B's peak (2p half-stage chunks = p
  whole-stage microbatches), and it needs no more microbatches than stages."""
  p, m = stages, microbatches
  zbv = S.make("zbv", p, m, 2)
  assert zbv.positions().tolist() == [list(range(p)), list(range(2 * p - 1, p - 1, -1))]
  send = zbv.messages()[0][..., 0]  # one message a tick (no pairs)
  local = {(int(zbv.op[t, s]), int(zbv.chunk[t, s]), s)
           for t, s in zip(*np.nonzero(send == S.HERE))}
  assert local == {(S.FORWARD, 0, p - 1), (S.BACKWARD_INPUT, 1, p - 1)}
  assert np.sum(send == S.HERE) == 2 * m
  zero, one_f_one_b = S.make("zero_bubble", p, m), S.make("1f1b", p, m)
  assert zbv.bubble_fraction() < zero.bubble_fraction() < one_f_one_b.bubble_fraction()
  assert zbv.in_flight().max() <= 2 * p
  assert S.in_flight_microbatches("zbv", p, m, 2) <= S.in_flight_microbatches("1f1b", p, m)
  assert S.bubble_ratio("zbv", p, m, 2) < S.bubble_ratio("zero_bubble", p, m)
  S.make("zbv", p, p // 2 or 1, 2)  # fewer microbatches than stages: still a valid table


@pytest.mark.parametrize("stages,microbatches", [(2, 4), (4, 8), (4, 16), (8, 16), (8, 20)])
def test_dualpipev_pairs_forward_and_backward_and_has_the_papers_bubble_and_memory(
    stages, microbatches):
  """DualPipeV (DeepSeek-V3 report; deepseek-ai/DualPipe, PP = 2p chunks on p devices): its main
  phase pairs one microbatch's forward with another's backward in one tick (the overlapped F&B
  that ZB-V lacks); with F = 1, B = 2, W = 1 (input and weight passes 1 each) the most idle
  device idles (PP/2 - 1)(F&B + B - 3W) and every device holds PP + 1 chunk activations at its
  peak, as the README of DualPipe tabulates. The same replay gives 1F1B's (PP - 1)(F + B)."""
  p, m = stages, microbatches
  dual = S.make("dualpipev", p, m, 2)
  assert dual.positions().tolist() == S.make("zbv", p, m, 2).positions().tolist()
  pairs = dual.paired[..., 0] != S.IDLE
  for s in range(p):  # steps 4 and 5 of dualpipev.py; the last rank's first F0/B1 not paired
    assert pairs[:, s].sum() == 2 * (m - 2 * p + s + 1) - (s == p - 1) + (p - s - 1)
  for t, s in zip(*np.nonzero(pairs)):
    (f, fm, fc), (b, bm, bc) = dual.ops_at(t, s)
    assert (f, b) == (S.FORWARD, S.BACKWARD) and fc != bc and fm > bm
  assert not np.any(S.make("zbv", p, m, 2).op == S.BACKWARD)  # ZB-V never pairs nor fuses
  for overlapped in (2.5, 3.0):
    durations = {S.FORWARD: 1, S.BACKWARD: 2, S.BACKWARD_INPUT: 1, S.BACKWARD_WEIGHT: 1,
                 "pair": overlapped}
    assert idle_times(dual, durations).max() == pytest.approx((p - 1) * (overlapped + 2 - 3))
  assert list(dual.in_flight()) == [2 * p + 1] * p
  assert S.in_flight_microbatches("dualpipev", p, m, 2) == (2 * p + 1) / 2
  one_f_one_b = S.make("1f1b", 2 * p, m)  # the same PP stages, one per device
  assert idle_times(one_f_one_b, {S.FORWARD: 1, S.BACKWARD: 2}).max() == (2 * p - 1) * 3


def test_rendering_reads_like_the_playbook():
  text = S.make("1f1b", 4, 8).render().splitlines()
  assert text[0].split()[:5] == ["F0", "F1", "F2", "F3", "."]
  assert text[3].split()[:4] == [".", ".", ".", "F0"]
  assert "B0" in text[3].split()[4]


@pytest.mark.parametrize("args,message", [
    (("1f1b", 4, 2), "at least as many microbatches as stages"),
    (("interleaved_1f1b", 4, 6, 2), "microbatches a multiple of the stages"),
    (("interleaved_1f1b", 4, 8, 1), "virtual >= 2"),
    (("afab", 4, 8, 2), "need schedule=interleaved_1f1b"),
    (("zbv", 4, 8, 1), "two chunks per stage"),
    (("dualpipev", 4, 6, 2), "at least twice as many microbatches as stages"),
    (("gpipe", 4, 8), "is not one of"),
])
def test_invalid_schedules_are_clear_errors(args, message):
  with pytest.raises(ValueError, match=message):
    S.make(*args)


def test_tables_are_small_ints():
  schedule = S.make("interleaved_1f1b", 8, 16, 2)
  assert schedule.op.dtype == np.int32 and schedule.op.shape == (schedule.ticks, 8)


def test_lockstep_ticks_wait_for_the_slowest_stage():
  """The executor's ticks run on every stage at once, so each lasts as long as its costliest
  operation. Hand-computed: 1F1B, 2 stages, 3 microbatches, f = 1/4, b = 3/4 (the chunk's
  forward recomputed): ticks (F .)(F F)(. B)(B F)(F B)(B F)(. B)(B .) cost 2 f + 6 b = 5 over
  3 (f + b) busy; ZB-H1, 2 stages, 2 microbatches, f = b = 1/2: (F .)(F F)(. b)(b w)(w F)(. b)
  (b w)(w .) cost 3 f + 5 b / 2 = 2.75 over 2. With equal operation costs the ratio is the
  bubble's, 1 + bubble_ratio."""
  assert S.lockstep_ratio("1f1b", 2, 3, 1, 0.75) == pytest.approx(5 / 3)
  assert S.lockstep_ratio("zero_bubble", 2, 2, 1, 0.5) == pytest.approx(2.75 / 2)
  for kind, virtual in (("afab", 1), ("1f1b", 1), ("interleaved_1f1b", 2)):
    for p, m in CASES:
      assert S.lockstep_ratio(kind, p, m, virtual, 0.5) == pytest.approx(
          1 + S.bubble_ratio(kind, p, m, virtual))
  # AFAB's ticks hold one kind of operation each: no stage waits on another's longer one.
  assert S.lockstep_ratio("afab", 4, 8, 1, 0.75) == pytest.approx(1 + S.bubble_ratio("afab", 4, 8))
  assert S.lockstep_ratio("1f1b", 4, 8, 1, 0.75) > 1 + S.bubble_ratio("1f1b", 4, 8)


@pytest.mark.parametrize("stages,microbatches", CASES)
@pytest.mark.parametrize("virtual", [1, 2])
def test_paired_1f1b_runs_a_forward_and_a_backward_each_steady_tick(stages, microbatches,
                                                                    virtual):
  """paired_1f1b keeps 1F1B's order (interleaved's with virtual stages) and runs each
  steady-state forward with a backward in one tick: dependencies hold as for every schedule,
  no tick waits (priced in lock step with a backward 3x a forward, its step is the bubble's
  1 + (p-1)/(v m), where 1F1B's lock-step ticks cost about 1.5x that). Its warm-up keeps
  2(p - s) + (v - 1) p chunk inputs in flight on stage s: twice 1F1B's p - s, one more than
  interleaved 1F1B's."""
  p, m, v = stages, microbatches, virtual
  paired = S.make("paired_1f1b", p, m, v)
  unpaired = S.make("1f1b" if v == 1 else "interleaved_1f1b", p, m, v)
  assert paired.paired is not None and unpaired.paired is None
  forwards = [(int(o), int(mb), int(c)) for o, mb, c in zip(paired.op.ravel(),
              paired.microbatch.ravel(), paired.chunk.ravel()) if o == S.FORWARD]
  assert len(forwards) == p * m * v
  assert S.lockstep_ratio("paired_1f1b", p, m, v, 0.75) == pytest.approx(1 + (p - 1) / (v * m))
  assert S.lockstep_ratio("paired_1f1b", p, m, v, 0.75) < S.lockstep_ratio(
      unpaired.kind, p, m, v, 0.75)
  # Megatron-Bridge's Llama-3-70B shape (8 stages, 5 virtual, 128 microbatches): 1.49 -> 1.01.
  assert S.lockstep_ratio("interleaved_1f1b", 8, 128, 5, 0.75) > 1.48
  assert S.lockstep_ratio("paired_1f1b", 8, 128, 5, 0.75) == pytest.approx(1 + 7 / 640)
  want = [min(m * v, 2 * (p - s) + (v - 1) * p) for s in range(p)]
  assert list(paired.in_flight()) == want
  if v > 1:
    assert (paired.in_flight() <= unpaired.in_flight() + 1).all()


def test_tick_segments_fold_a_recurring_block_of_runs():
  flags = np.array([0, 0, 2, 3, 1, 1, 3, 1, 1, 3, 1, 1, 3, 1])
  assert S.tick_segments(flags) == [
      (0, 1, [(0, 2, 0)]), (2, 1, [(0, 1, 2)]), (3, 3, [(0, 1, 3), (1, 2, 1)]),
      (12, 1, [(0, 1, 3)]), (13, 1, [(0, 1, 1)])]
  # The 70B TP4 PP8 VP5 recipe's 687 ticks: 8 with the head in every 40 of the steady state.
  table = S.make("paired_1f1b", 8, 128, 5)
  heads = S.head_ticks(table)
  assert heads.sum() == 128 and not heads[:39].any()
  assert S.tick_segments(S.loop_flags(table)) == [
      (0, 1, [(0, 39, 4)]), (39, 1, [(0, 1, 6)]), (40, 1, [(0, 7, 7)]),
      (47, 15, [(0, 32, 5), (32, 8, 7)]), (647, 1, [(0, 40, 1)])]


def test_the_drain_loop_holds_no_forward_nor_head():
  """DeepSeek-V3-like PP8 EP64's schedule (8 microbatches on 8 stages): its last 8 ticks run
  backwards only. Their run without a head is shorter than 2 x stages, so it held the head (and
  with it the forward slot): the step-time model priced both conditionals there at their
  costliest branch. Now the drain is a loop of its own, flagged with neither; the 1F1B steady
  state's lone tick without a forward, and 4 stages' drain of 4 ticks (shorter than 8), stay
  in their loops."""
  table = S.make("paired_1f1b", 8, 8, 1)
  assert not table.forward_ticks()[15:].any() and table.forward_ticks()[:15].all()
  assert S.tick_segments(S.loop_flags(table)) == [
      (0, 1, [(0, 8, 6)]), (8, 1, [(0, 7, 7)]), (15, 1, [(0, 8, 1)])]
  before = table.backward_ticks() + 2 * S.head_ticks(table)
  assert S.tick_segments(before) == [(0, 1, [(0, 8, 2)]), (8, 1, [(0, 15, 3)])]
  one_f_one_b = S.make("1f1b", 4, 8, 1)
  assert not one_f_one_b.forward_ticks()[4]  # the lone tick: stage 3's first backward only
  assert not one_f_one_b.forward_ticks()[18:].any()
  assert S.tick_segments(S.loop_flags(one_f_one_b)) == [(0, 1, [(0, 4, 6)]), (4, 1, [(0, 18, 7)])]


@pytest.mark.parametrize("args", [("1f1b", 4, 8, 1), ("afab", 4, 8, 1), ("zero_bubble", 4, 8, 1),
                                  ("interleaved_1f1b", 4, 16, 2), ("zbv", 4, 8, 2),
                                  ("dualpipev", 4, 8, 2), ("paired_1f1b", 8, 128, 5)])
def test_kept_slots_hold_each_chunk_from_its_forward_to_its_last_use(args):
  """Schedule.kept_slots (the executor's kept residuals): a forward's slot is free (never held by
  another microbatch chunk, nor released in the same tick: the tick's forward runs before its
  backward), its backward and weight pass read that slot, and a stage needs as many as it holds
  at once: the 70B recipe's 8 stages x 5 virtual x 128 microbatches 48 (its in-flight chunks),
  not 80 (a slot per chunk and buffer slot)."""
  table = S.make(*args)
  count, slot_of = table.kept_slots()
  for s in range(table.stages):
    held = {}  # slot -> (m, c)
    for t in range(table.ticks):
      released = []
      for k, (op, m, c) in enumerate(table.slots_at(t, s)):
        if op == S.FORWARD:
          assert slot_of[t, s, k] not in held and 0 <= slot_of[t, s, k] < count
          held[int(slot_of[t, s, k])] = (m, c)
        elif op != S.IDLE:
          assert held[int(slot_of[t, s, k])] == (m, c)
          if op in S.RELEASES:
            released.append(int(slot_of[t, s, k]))
      for slot in released:
        del held[slot]
  if args[0] != "dualpipev":  # its pairs release and take a slot in one tick
    assert count == round(S.in_flight_microbatches(*args) * args[3])
  if args == ("paired_1f1b", 8, 128, 5):
    assert (count, table.buffer_slots() * 5) == (48, 80)
