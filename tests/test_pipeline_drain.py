"""The drain of a pipeline schedule (the last ticks, where no stage runs a forward) as a loop of
its own, which holds neither the forward nor the head: as many microbatches as stages (8 on 8,
DeepSeek-V3-like PP8 EP64's recipe) trains like one device, and the program's ticks execute
fewer dots than with the drain inside the steady state's loop (sharding.pipeline.schedules.
loop_flags)."""

from unittest import mock

from sharding import MeshConfig
from sharding.pipeline import schedules
from tests import parallel_harness as harness
from tests.test_parallel import assert_same_training
from tests.test_pipeline import MODELS, loop_counts, references  # noqa: F401 (a fixture)

MESH = MeshConfig(data=1, pipeline=8, pipeline_schedule="paired_1f1b")


def _executed_dots(text: str) -> int:
  return sum(trips * dots for trips, dots in loop_counts(text, lambda i: i.op == "dot") if trips)


def _old_loop_flags(table):  # the flags before: the drain kept the forward and head flags
  return table.backward_ticks() + 2 * schedules.head_ticks(table)


def test_eight_microbatches_on_eight_stages_train_like_one_device(references):
  assert_same_training(harness.run(MESH, microbatches=8, model=MODELS[8]), references(8))


def test_the_drain_loop_runs_no_forward():
  """The drain's 8 ticks ran the forward slot's conditional and the head's, each priced at its
  costliest branch by the step-time model though every stage takes the idle one. Now they are
  out of its loop: the loops' executed dots (trips x dots in the body) drop by 8 ticks of the
  forward and the head's dots, and the last loop (8 trips) holds fewer dots than the steady
  state's (7 trips), which runs a forward beside each backward."""
  table = schedules.make("paired_1f1b", 8, 8)
  assert len(schedules.tick_segments(schedules.loop_flags(table))) == 3
  text = harness.compile_step(MESH, microbatches=8, model=MODELS[8]).as_text()
  with mock.patch.object(schedules, "loop_flags", _old_loop_flags):
    before = harness.compile_step(MESH, microbatches=8, model=MODELS[8]).as_text()
  ticks = [(trips, dots) for trips, dots in loop_counts(text, lambda i: i.op == "dot")
           if dots]
  assert [trips for trips, _ in ticks] == [8, 7, 8], ticks  # warm-up, steady state, drain
  (_, warm), (_, steady), (_, drain) = ticks
  assert drain < steady and steady == warm + drain, ticks  # a forward tick's dots: warm's
  assert _executed_dots(before) - _executed_dots(text) == 8 * warm > 0
