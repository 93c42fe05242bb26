"""Pipeline parallelism in one SPMD program: every schedule trains exactly like one device; the
schedule's memory and transfers show up in the compiled program; bad layouts are clear errors."""

import dataclasses
import re

import jax
import numpy as np
import pytest

from sharding import Layout, MeshConfig
from sharding.pipeline import schedules
from sharding.xla import hlo
from tests import parallel_harness as harness
from tests.test_parallel import assert_same_training
from trainer.loop import remat_note
from trainer.trainer import Trainer

MODELS = {layers: dataclasses.replace(harness.MODEL, num_layers=layers)
          for layers in (4, 8, 12, 16)}


@pytest.fixture(scope="module")
def references():
  """references(layers): the one-device run of the harness model with that many layers (cached
  per module; tests/test_uneven_stages.py uses it too)."""
  cache = {}

  def get(layers):
    if layers not in cache:
      cache[layers] = harness.run(MeshConfig(data=1), devices=jax.devices()[:1],
                                  model=dataclasses.replace(harness.MODEL, num_layers=layers))
    return cache[layers]
  return get


def case(stages, schedule, extra=None, layers=4, virtual=None):
  virtual = virtual or (2 if schedule in ("interleaved_1f1b", *schedules.V_SHAPED) else 1)
  mesh = {"data": 8 // stages, **(extra or {})}
  return pytest.param(stages, schedule, virtual, mesh, layers,
                      id=f"pipeline={stages},{schedule}" + "".join(
                          f",{k}={v}" for k, v in (extra or {}).items()))


FAST = [case(2, kind) for kind in schedules.SCHEDULES if kind not in schedules.V_SHAPED] + [
    case(4, "1f1b"), case(8, "1f1b", layers=8),
    case(2, "1f1b", {"data": 1, "fsdp": 2, "tensor": 2}),
    # ZeRO-1: the layer gradients reduce-scattered into the optimizer state's parts.
    case(4, "interleaved_1f1b", {"data": 2, "zero_stage": 1}, layers=8),
    # ZeRO-2: each tick's layer gradients reduce-scattered into their parts over `data`.
    case(2, "paired_1f1b", {"data": 4, "zero_stage": 2}),
    case(4, "zbv", {"data": 2}, layers=8),
    case(4, "dualpipev", {"data": 2}, layers=8),
]
SLOW = [case(p, kind, layers={4: 8, 8: 16}[p])
        for p in (4, 8) for kind in schedules.SCHEDULES if (p, kind) != (4, "1f1b")
        and (p, kind) not in ((8, "1f1b"), (4, "zbv"), (4, "dualpipev"))
        and (p, kind) != (8, "dualpipev")] + [case(2, "zbv"), case(2, "dualpipev")] + [
    # Its sibling in the default suite: 3 virtual stages, 16 microbatches (the head's loops).
    case(4, "paired_1f1b", {"data": 2}, layers=8, virtual=2)]


def check(stages, schedule, virtual, mesh, layers, references):
  """8 microbatches through the stages by `schedule`; loss, gradients and parameters after 3
  AdamW steps equal the non-pipelined single-device run (tolerances of tests/test_parallel)."""
  cfg = MeshConfig(**{**mesh, "pipeline": stages}, pipeline_schedule=schedule,
                   virtual_stages=virtual)
  result = harness.run(cfg, microbatches=8, model=MODELS[layers])
  assert_same_training(result, references(layers))


@pytest.mark.parametrize("stages,schedule,virtual,mesh,layers", FAST)
def test_pipeline_equals_one_device(stages, schedule, virtual, mesh, layers, references):
  check(stages, schedule, virtual, mesh, layers, references)


@pytest.mark.slow
@pytest.mark.parametrize("stages,schedule,virtual,mesh,layers", SLOW)
def test_every_schedule_on_4_and_8_stages_equals_one_device(stages, schedule, virtual, mesh,
                                                            layers, references):
  check(stages, schedule, virtual, mesh, layers, references)


@pytest.mark.parametrize("mesh,impl", [
    (dict(data=2, context=2, zero_stage=1), "allgather"),
    (dict(tensor=2, context=2, sequence_parallel=True), "ulysses"),
    (dict(context=4, pipeline_schedule="interleaved_1f1b", virtual_stages=2), "allgather"),
], ids=["context=2,data=2,zero=1,allgather", "context=2,tensor=2,sp,ulysses",
        "context=4,interleaved,allgather"])
def test_context_parallelism_inside_the_stages_equals_one_device(mesh, impl, references):
  """Each stage's attention runs the context-parallel kernel in a region nested in the stage's
  (sharding.shard_map.stage_shard_map): 2 stages x the sequence split, 8 microbatches."""
  cfg = MeshConfig(**{"data": 1, **mesh, "pipeline": 2})
  compute = dataclasses.replace(harness.COMPUTE, context_impl=impl)
  result = harness.run(cfg, microbatches=8, model=MODELS[4], compute=compute)
  assert_same_training(result, references(4))


def tick_loops(table) -> list[tuple[int, int, int]]:
  """(repeats, ticks, flags: 1 a backward, 2 the head, 4 a forward) of each loop the executor
  runs the ticks of `table` in (a loop of `repeats` iterations around it where repeats > 1)."""
  return [(repeats, length, f)
          for _, repeats, block in schedules.tick_segments(schedules.loop_flags(table))
          for _, length, f in block]


def compiled(schedule, microbatches=32, batch=128, seq=16):
  cfg = harness.config(MeshConfig(data=2, pipeline=4, pipeline_schedule=schedule),
                       microbatches=microbatches, model=MODELS[4])
  cfg.batch_size, cfg.seq_len = batch, seq
  trainer = Trainer(cfg)
  with trainer.scope():
    return trainer.train_step.lower(trainer.abstract_state, trainer.abstract_batch()).compile()


def test_one_f_one_b_keeps_fewer_activations_and_transfers_what_the_table_says():
  """4 stages, 32 microbatches. Each stage keeps a slot per in-flight microbatch for its inputs
  and one for the gradients it receives: AFAB 32 slots, 1F1B 4, the tick loop's [1, slots, ...]
  buffers, both carried by every loop over the ticks. The compiled temporaries differ by more
  than (32 - 4) activations and by at most (32 - 4) x 4 (measured 41.7: AFAB's backward loop
  holds no head, whose write into the gradient buffer had it copied, 58 before); every tick both
  rings (forward activations, backward gradients) move one activation: exactly 2 x ticks x
  activation bytes. The head's pieces move apart: a quarter of an activation from the last
  stage to each other stage and back, 6 permutes charged a tick (they run in the ticks of the
  last stage's forwards), in each loop over ticks that hold the head."""
  activation = (128 // 32 // 2) * 16 * MODELS[4].embed_dim * 4  # microbatch rows per data shard
  programs = {kind: compiled(kind) for kind in ("afab", "1f1b")}
  temp = {k: p.memory_analysis().temp_size_in_bytes for k, p in programs.items()}
  slots = {k: schedules.make(k, 4, 32).buffer_slots() for k in programs}
  assert (slots["afab"], slots["1f1b"]) == (32, 4)
  for kind, count in slots.items():
    assert f"f32[1,{count},{128 // 32 // 2},16,{MODELS[4].embed_dim}]" in programs[kind].as_text()
  assert (32 - 4) * activation < temp["afab"] - temp["1f1b"] <= (32 - 4) * 4 * activation
  assert temp["1f1b"] < 0.85 * temp["afab"], temp
  for kind, program in programs.items():
    text = program.as_text()
    buffer = f"f32[1,{slots[kind]},{128 // 32 // 2},16,{MODELS[4].embed_dim}]"
    assert [line.count(buffer) for line in text.splitlines() if " while(" in line
            and buffer in line] == [2] * len(tick_loops(schedules.make(kind, 4, 32)))
    permutes = [c for c in hlo.collectives(text) if c.kind == "collective-permute"]
    ticks = schedules.make(kind, 4, 32).ticks
    ring = [c for c in permutes if c.bytes == activation]
    assert sum(c.bytes * c.count for c in ring) == 2 * ticks * activation
    pieces = [c for c in permutes if c not in ring]
    with_head = [(r, n) for r, n, flags in tick_loops(schedules.make(kind, 4, 32)) if flags & 2]
    assert len(pieces) == 6 * len(with_head) and {c.bytes for c in pieces} == {activation // 4}
    assert sum(c.count for c in pieces) == 6 * sum(r * n for r, n in with_head)


def test_data_parallel_replicas_reduce_their_gradients_once_per_step():
  """pipeline=2 x data=4, 8 microbatches: each data-parallel replica keeps its own gradient sums
  through the schedule, so every reduction over the 4 replicas runs once per step, outside the
  tick loop (before: one all-reduce of the stage's weight gradients per tick), and the loop
  holds no collective but permutes: the two stage-to-stage ones and the head's pieces of the
  tokens (to the other stage, their gradients back)."""
  cfg = harness.config(MeshConfig(data=4, pipeline=2), microbatches=8, model=MODELS[4])
  trainer = Trainer(cfg)
  with trainer.scope():
    text = trainer.train_step.lower(trainer.abstract_state, trainer.abstract_batch()).compile(
        ).as_text()
  cols = hlo.collectives(text)
  reductions = [c for c in cols if c.kind == "all-reduce" and c.group_size == 4]
  assert reductions and all(c.count == 1 for c in reductions)
  in_loop = [c for c in cols if c.count > 1]
  assert in_loop and {c.kind for c in in_loop} == {"collective-permute"}, in_loop


def test_every_stage_runs_the_head_on_its_part_of_the_tokens():
  """pipeline=4 x data=2, 8 microbatches of 2 rows x 16 tokens per replica: the head's logits
  GEMM runs on every stage over 16 / 4 tokens of each row (8 rows of [8, vocab] logits), not on
  the last stage over all 32 tokens (which held the other stages waiting in that tick)."""
  model = MODELS[4]
  cfg = harness.config(MeshConfig(data=2, pipeline=4), microbatches=8, model=model)
  trainer = Trainer(cfg)
  with trainer.scope():
    text = trainer.train_step.lower(trainer.abstract_state, trainer.abstract_batch()).compile(
        ).as_text()
  pattern = rf"= f32\[(\d+),{model.vocab_size}\]\S* dot\(.*, lhs_contracting_dims=\{{1\}},"
  logits = [m.group(1) for m in map(re.compile(pattern).search, text.splitlines()) if m]
  assert logits and set(logits) == {str(2 * 16 // 4)}, logits


def test_the_sequence_parts_reduce_their_gradients_once_per_step():
  """pipeline=2 x context=2 x data=2 (all-gather), 8 microbatches: the stage's shard_map is
  manual over `context` too, so each device keeps the gradient sums of its part of the
  sequence, and every all-reduce (over data x context) runs once per step; in the tick loop
  only the kernel's all-gathers over context (and their reduce-scatters in the backward) and
  the stage-to-stage permutes. Before: XLA all-reduced every weight gradient over context at
  every tick (the 405B anchor: 17.9 TB a step; now 1.5 TB)."""
  cfg = harness.config(MeshConfig(data=2, pipeline=2, context=2), microbatches=8,
                       model=MODELS[4], compute=dataclasses.replace(harness.COMPUTE,
                                                                    context_impl="allgather"))
  trainer = Trainer(cfg)
  with trainer.scope():
    text = trainer.train_step.lower(trainer.abstract_state, trainer.abstract_batch()).compile(
        ).as_text()
  cols = hlo.collectives(text)
  reductions = [c for c in cols if c.kind == "all-reduce"]
  assert reductions and all(c.count == 1 for c in reductions), reductions
  in_loop = {c.kind for c in cols if c.count > 1}
  assert "collective-permute" in in_loop and "all-gather" in in_loop and "all-reduce" not in in_loop


@pytest.mark.parametrize("mesh,layers,microbatches,message", [
    (dict(pipeline=8), 6, 8, "8 pipeline stages .x virtual stages. for 6 layers"),
    (dict(pipeline=2, data=4, stage_layers="2+3"), 6, 8, "gives 2 stages with 5 layers"),
    (dict(pipeline=4, data=2), 4, 2, "at least as many microbatches as stages"),
    (dict(pipeline=2, data=4, pipeline_schedule="interleaved_1f1b", virtual_stages=2), 4, 3,
     "microbatches a multiple of the stages"),
    (dict(pipeline=2, data=4, pipeline_schedule="1f1b", virtual_stages=2), 4, 8,
     "need schedule=interleaved_1f1b"),
])
def test_invalid_pipeline_layouts_fail_before_compiling(mesh, layers, microbatches, message):
  cfg = harness.config(MeshConfig(**mesh), microbatches=microbatches,
                       model=dataclasses.replace(harness.MODEL, num_layers=layers))
  cfg.batch_size = 8 * microbatches
  with pytest.raises(ValueError, match=message):
    Trainer(cfg)


def test_bf16_parameters_sum_their_gradients_in_grad_accum_dtype():
  """bf16 parameters, pipeline=2 x data=4, 8 microbatches: the tick loop carries the stage's
  gradient sums in grad_accum_dtype, float32 by default as the unpipelined step does (they were
  carried in the parameters' bf16: 8 roundings of the partial sums), and in bf16 when asked.
  Both compile: XLA:CPU aborted on the bf16 reduction of the sums over the replicas."""
  carried = {}
  for dtype in ("float32", "bfloat16"):
    cfg = harness.config(MeshConfig(data=4, pipeline=2), microbatches=8, model=MODELS[4])
    cfg.model = dataclasses.replace(cfg.model, param_dtype="bfloat16", dtype="bfloat16")
    cfg.grad_accum_dtype = dtype
    trainer = Trainer(cfg)
    with trainer.scope():
      text = trainer.train_step.lower(trainer.abstract_state, trainer.abstract_batch()).compile(
          ).as_text()
    # The tick loop: the while over the schedule's ticks, whose carry holds the stage's
    # [virtual, rows, ...] stacks; the MLP's up and gate sums are [1, 2, embed, mlp].
    shape = f"[1,2,{MODELS[4].embed_dim},{MODELS[4].mlp_dim}]"
    loops = [line for line in text.splitlines() if " while(" in line and shape in line]
    assert loops, "no loop carries the stage's MLP weights"
    carried[dtype] = max(line.count("f32" + shape) for line in loops)
  assert carried["float32"] >= 2 and carried["bfloat16"] == 0, carried


def test_a_stage_of_few_layers_runs_them_unrolled():
  """pipeline=2 x data=4: with 2 layers a stage, the stage runs them unrolled, so the compiled
  program's only loops are the embedding's lookup over the microbatches and the schedule's
  ticks (two scans: the warm-up's, which runs no backward, and the rest; scanned layers
  stacked every layer's residuals for the backward and sliced each layer's weights at each
  tick); with 8 layers a stage they stay scanned."""
  loops = {}
  for layers in (4, 16):
    cfg = harness.config(MeshConfig(data=4, pipeline=2), microbatches=8, model=MODELS[layers])
    trainer = Trainer(cfg)
    with trainer.scope():
      text = trainer.train_step.lower(trainer.abstract_state, trainer.abstract_batch()).compile(
          ).as_text()
    loops[layers] = sum(" while(" in line for line in text.splitlines())
  scans = len(tick_loops(schedules.make("1f1b", 2, 8)))
  lookups = 1  # position 0's inputs: the embedding of each microbatch, before the ticks
  assert scans == 2 and loops[4] == scans + lookups and loops[16] > scans + lookups, loops


def test_tick_runs_cut_the_ticks_where_backwards_start():
  assert schedules.tick_runs(np.zeros(10, bool)) == [(0, 10)]
  flags = np.array([0, 1, 1, 0, 1, 1, 0, 1, 1, 0, 0], bool)
  assert schedules.tick_runs(flags) == [(0, 1), (1, 2), (3, 1), (4, 2), (6, 1), (7, 2), (9, 2)]
  table = schedules.make("1f1b", 4, 8)  # the last stage's first backward is its 4th tick's
  assert table.backward_ticks()[:5].tolist() == [False] * 4 + [True]
  assert schedules.tick_runs(table.backward_ticks()) == [(0, 4), (4, 18)]


def test_ticks_without_the_head_loop_apart_and_train_like_one_device(references):
  """paired_1f1b, 4 stages x 3 virtual, 16 microbatches: the steady state alternates 8 ticks
  without the head and 4 with it, 3 times, which the executor runs as a loop of 3 around a loop
  of each (before, one loop priced the head's conditional at every tick)."""
  assert tick_loops(schedules.make("paired_1f1b", 4, 16, 3)) == [
      (1, 11, 0), (1, 1, 2), (1, 3, 3), (3, 8, 1), (3, 4, 3), (1, 12, 1)]
  cfg = MeshConfig(data=2, pipeline=4, pipeline_schedule="paired_1f1b", virtual_stages=3)
  assert_same_training(harness.run(cfg, microbatches=16, model=MODELS[12]), references(12))


def loop_counts(text: str, matches) -> list[tuple[int, int]]:
  """(trip count, instructions where matches(instruction) in the body and what it calls) of
  each while loop of a program."""
  comps = hlo.computations(text)
  return [(hlo.trip_count(i, comps, c),
           sum(hlo.count_within(comps, b, matches) for b in hlo.callees(i) if b in comps))
          for c, instrs in comps.items() for i in instrs if i.op == "while"]


def test_the_warm_up_ticks_compile_no_backward():
  """1F1B on 4 stages, 8 microbatches: no stage runs a backward in the first 4 ticks, so they
  run as a scan of their own whose tick holds the forward and the head only (12 dots measured,
  against 38 in the other scan's tick, whose backward recomputes the forward: more than 3x).
  The step-time model prices a conditional by its costliest branch, as a lock-step tick waits
  for its slowest stage: with one scan, every warm-up tick was priced as a backward."""
  cfg = harness.config(MeshConfig(data=2, pipeline=4), microbatches=8, model=MODELS[4])
  trainer = Trainer(cfg)
  with trainer.scope():
    text = trainer.train_step.lower(trainer.abstract_state, trainer.abstract_batch()).compile(
        ).as_text()
  loops = sorted(loop_counts(text, lambda i: i.op == "dot"))
  (warm_trips, warm_dots), lookups, (trips, dots) = loops
  assert (warm_trips, trips) == (4, 18)
  assert lookups == (8, 0), loops  # the embedding of each microbatch, once, before the ticks
  assert 0 < 3 * warm_dots <= dots, (warm_dots, dots)
  # The embedding's gradient is taken once after the ticks, from position 0's input gradients
  # kept per microbatch: a tick adds one vocabulary-sized float32 table, the head's gradient in
  # the ticks that run it. Before, the other scan's ticks also scattered the embedding's rows
  # into a zero table and added that: [1, 3].
  vocab, dim = MODELS[4].vocab_size, MODELS[4].embed_dim
  table = lambda i: i.op in ("add", "scatter") and re.match(
      rf"f32\[({vocab},{dim}|{dim},{vocab})\]", i.type)
  assert [n for _, n in sorted(loop_counts(text, table))] == [1, 0, 1]


def test_a_region_nested_in_a_stage_keeps_its_residuals_for_the_backward():
  """Ulysses attention inside the stages (tensor=2, context=2, 2 stages of 2 layers): a tick's
  branches (idle, forward, backward) run 0, 4 and 8 all-to-alls a layer, the backward the
  recomputed forward's 4 and its own 4. The region's backward used to run its forward again
  (sharding.shard_map.stage_shard_map kept only its arguments): 21 for the 2 layers."""
  cfg = harness.config(MeshConfig(data=1, tensor=2, context=2, sequence_parallel=True,
                                  pipeline=2), microbatches=8, model=MODELS[4])
  cfg.compute = dataclasses.replace(harness.COMPUTE, context_impl="ulysses")
  trainer = Trainer(cfg)
  with trainer.scope():
    text = trainer.train_step.lower(trainer.abstract_state, trainer.abstract_batch()).compile(
        ).as_text()
  comps = hlo.computations(text)
  branches = [[hlo.count_within(comps, b, lambda x: x.op == "all-to-all")
               for b in hlo.callees(i) if b in comps]
              for instrs in comps.values() for i in instrs if i.op == "conditional"]
  assert [b for b in branches if len(b) == 3 and max(b) > 0] == [[0, 8, 16]], branches


def dots_outside_conditionals(comps: dict, comp: str, path=()) -> int:
  """Dots in `comp` and what it calls, but not in a conditional's branches."""
  return sum((i.op == "dot") + (0 if i.op == "conditional" else sum(
      dots_outside_conditionals(comps, c, (*path, comp)) for c in hlo.callees(i)
      if c in comps and c not in path)) for i in comps.get(comp, []))


def test_the_paired_backward_slot_runs_outside_a_conditional():
  """paired_1f1b's backward slot (idle or a backward) runs the backward at every tick, its
  results masked where the slot is idle: a conditional's branch materializes its results, so
  every tick wrote the chunk's weight gradients, concatenated the unrolled rows' and copied them
  before adding them to the float32 sums (the 70B TP4 PP8 VP5 program: 1,162 -> 1,187
  predicted tok/s/GPU without). The warm-up's ticks, which run no backward, compile none."""
  cfg = harness.config(MeshConfig(data=2, pipeline=4, pipeline_schedule="paired_1f1b",
                                  virtual_stages=2), microbatches=8, model=MODELS[8])
  trainer = Trainer(cfg)
  with trainer.scope():
    text = trainer.train_step.lower(trainer.abstract_state, trainer.abstract_batch()).compile(
        ).as_text()
  comps = hlo.computations(text)
  loops = [(hlo.trip_count(i, comps, c), dots_outside_conditionals(
      comps, re.search(r"\bbody=%?([\w.\-]+)", i.attrs).group(1)))
      for c, instrs in comps.items() for i in instrs if i.op == "while"]
  runs = tick_loops(schedules.make("paired_1f1b", 4, 8, 2))
  assert runs == [(1, 8, 6), (1, 11, 7), (1, 8, 1)]  # warm-up (with the head), steady, cool-down
  ticks = [(trips, n > 0) for trips, n in loops if trips in (8, 11)]  # and the lookups' map
  assert sorted(ticks) == [(8, False), (8, False), (8, True), (11, True)], loops


def test_an_unrolled_chunk_runs_its_forward_once_in_the_backward_whatever_remat():
  """The executor recomputes a chunk's forward in its backward tick and differentiates it at
  once, so a layer checkpoint there (remat selective or full) only ran each layer's forward a
  third time: 4 stages of 2 layers now compile the same tick for every remat (74 dots in the
  backward scan's tick; before, selective 78 and full 82). Where a stage's layers are scanned
  (8 a stage), remat still recomputes: full adds the forward's dots to the tick."""
  def tick_dots(layers, pipeline, remat):
    cfg = harness.config(MeshConfig(data=8 // pipeline, pipeline=pipeline), microbatches=8,
                         model=MODELS[layers], remat=remat)
    trainer = Trainer(cfg)
    with trainer.scope():
      text = trainer.train_step.lower(trainer.abstract_state, trainer.abstract_batch()).compile(
          ).as_text()
    return max(n for _, n in loop_counts(text, lambda i: i.op == "dot"))

  unrolled = {remat: tick_dots(8, 4, remat) for remat in ("none", "selective", "full")}
  assert unrolled == {"none": 74, "selective": 74, "full": 74}, unrolled
  scanned = {remat: tick_dots(16, 2, remat) for remat in ("none", "full")}
  assert scanned["full"] > scanned["none"], scanned


def test_a_run_says_where_remat_does_not_act():
  """The log line of a run whose stages' chunks are unrolled (2 layers a stage, not 32)."""
  staged = Layout(pipeline=2, microbatches=4, remat="full")
  assert "compute.remat=full runs as none" in remat_note(staged, 4)
  assert remat_note(staged, 64) == "" == remat_note(Layout(remat="full"), 4)
