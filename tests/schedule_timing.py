"""A schedule's tick table replayed with per-operation durations (tests/test_schedules.py checks
DualPipeV's overlapped F&B against 1F1B with it): the planner and the executor use the unit-tick
tables; this is the tests' model of real operation times."""

import numpy as np

from sharding.pipeline import schedules as S


def idle_times(schedule: S.Schedule, durations: dict) -> np.ndarray:
  """[stages]: each stage's idle time when its operations, in table order, take `durations`
  ({op: time, "pair": time of an overlapped F&B}) and messages take none: the step's span less
  the stage's busy time. Unit durations give the tick table's own bubble."""
  stages = schedule.stages
  order = [[schedule.ops_at(t, s) for t in range(schedule.ticks) if schedule.ops_at(t, s)]
           for s in range(stages)]
  finish, free, busy, cursor = {}, [0.0] * stages, [0.0] * stages, [0] * stages
  last = stages * schedule.virtual - 1

  def ready_at(op, m, c, s):
    q = schedule.position(c, s)
    if op == S.FORWARD:
      return 0.0 if q == 0 else finish.get((S.FORWARD, m, q - 1))
    if op == S.BACKWARD_WEIGHT:
      return 0.0
    up = 0.0 if q == last else finish.get((S.BACKWARD, m, q + 1),
                                          finish.get((S.BACKWARD_INPUT, m, q + 1)))
    mine = finish.get((S.FORWARD, m, q))
    return None if up is None or mine is None else max(up, mine)

  moved = True
  while moved:
    moved = False
    for s in range(stages):
      while cursor[s] < len(order[s]):
        ops = order[s][cursor[s]]
        starts = [ready_at(*o, s) for o in ops]
        if any(x is None for x in starts):
          break
        took = durations["pair"] if len(ops) == 2 else durations[ops[0][0]]
        free[s] = max([free[s], *starts]) + took
        busy[s] += took
        for op, m, c in ops:
          finish[(op, m, schedule.position(c, s))] = free[s]
        cursor[s] += 1
        moved = True
  return max(free) - np.asarray(busy)
