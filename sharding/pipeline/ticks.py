"""The tick model every pipeline schedule shares: the op codes, where a stage's chunk sits in the
model (`position`), when an operation's inputs have arrived (`ready`), and the one simulator that
turns per-stage policies (sharding/pipeline/policies.py) into a tick table. Imports no sibling."""

from typing import Callable, Protocol

# Two chunks per stage folded into a V: chunk 0 runs down the stages, chunk 1 back up, so the
# first stage holds the model's first and last positions (embedding and head on one device).
V_SHAPED = ("zbv", "dualpipev")
IDLE, FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = range(5)
NAMES = {IDLE: ".", FORWARD: "F", BACKWARD: "B", BACKWARD_INPUT: "b", BACKWARD_WEIGHT: "w"}
RELEASES = (BACKWARD, BACKWARD_WEIGHT)  # the last use of a saved stage input

Op = tuple[int, int, int]  # (op code, microbatch, chunk)


def position(kind: str, stages: int, chunk: int, stage: int) -> int:
  """A stage's chunk's place in the whole model: round the ring (chunk x stages + stage) for the
  interleaved schedules, down and back up for the V-shaped ones."""
  if kind in V_SHAPED:
    return stage if chunk == 0 else 2 * stages - 1 - stage
  return chunk * stages + stage


def ready(op, m, c, s, done, stages, virtual, tick, kind="1f1b") -> bool:
  """Whether stage s may run `op` on microbatch m, chunk c in `tick`: its inputs arrived, with
  one tick of transfer between stages (and at the V's turn). `done` maps (op, microbatch,
  position) to the tick it ran. Every policy asks here, through `simulate`."""
  here = position(kind, stages, c, s)  # this chunk's place in the whole model
  last = stages * virtual - 1
  def finished(what, pos):
    return done.get((what, m, pos), tick) < tick
  if op == FORWARD:
    return here == 0 or finished(FORWARD, here - 1)
  if op in (BACKWARD, BACKWARD_INPUT):
    # The gradient comes from the next position's backward, whole or input-only.
    upstream = here == last or finished(BACKWARD, here + 1) or finished(
        BACKWARD_INPUT, here + 1)
    return finished(FORWARD, here) and upstream
  return finished(BACKWARD_INPUT, here)  # BACKWARD_WEIGHT


class Policy(Protocol):
  """One stage's choice of work. `width`: ops per tick (2 where a tick pairs an F with a B)."""

  width: int

  @property
  def finished(self) -> bool: ...

  def step(self, runs: Callable[[int, int, int], bool]) -> tuple[Op, ...]:
    """The ops to run this tick (none: idle), given `runs(op, m, c)`: their inputs arrived."""


def simulate(kind: str, stages: int, microbatches: int, virtual: int,
             policies: list[Policy]) -> list[list[tuple[int, ...]]]:
  """Runs the stages' policies tick by tick. Rows [ticks][stages] of (op, m, c), or of
  (op, m, c, op2, m2, c2) where a policy pairs ops (IDLE, 0, 0 pads)."""
  width = max(policy.width for policy in policies)
  done: dict = {}  # (op, microbatch, position) -> the tick it ran
  rows = []
  tick = 0
  while not all(policy.finished for policy in policies):
    row = []
    for s, policy in enumerate(policies):
      ops = policy.step(lambda op, m, c, s=s: ready(op, m, c, s, done, stages, virtual, tick,
                                                    kind))
      row.append(sum(ops, ()) + (IDLE, 0, 0) * (width - len(ops)))
    # Recorded after the row, so every stage decides on the same state of the previous ticks.
    for s, ops in enumerate(row):
      for op, m, c in zip(ops[::3], ops[1::3], ops[2::3]):
        if op != IDLE:
          done[(op, m, position(kind, stages, c, s))] = tick
    rows.append(row)
    tick += 1
    if tick > 30 * (microbatches * virtual + stages):  # far past any schedule's length
      raise RuntimeError(f"schedule {kind} deadlocked")  # a bug in a policy, never user input
  return rows
