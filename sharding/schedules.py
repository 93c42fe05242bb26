"""Pipeline schedules as static tick tables: AFAB (GPipe), 1F1B, interleaved 1F1B, zero-bubble.

A table says, for every tick and stage (device), which operation runs on which microbatch and
virtual chunk. The executor (sharding/pipeline.py) runs it; the bubble fraction and the peak
number of in-flight microbatches come from the same table (and feed the analytic model).
"""

import dataclasses
import functools

import numpy as np

SCHEDULES = ("afab", "1f1b", "interleaved_1f1b", "zero_bubble")
IDLE, FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = range(5)
NAMES = {IDLE: ".", FORWARD: "F", BACKWARD: "B", BACKWARD_INPUT: "b", BACKWARD_WEIGHT: "w"}
_RELEASES = (BACKWARD, BACKWARD_WEIGHT)  # the last use of a saved stage input


@dataclasses.dataclass(frozen=True)
class Schedule:
  """op/microbatch/chunk: int arrays [ticks, stages]; virtual: chunks per stage."""

  kind: str
  stages: int
  microbatches: int
  virtual: int
  op: np.ndarray
  microbatch: np.ndarray
  chunk: np.ndarray

  @property
  def ticks(self) -> int:
    return self.op.shape[0]

  def bubble_fraction(self) -> float:
    """Idle stage-ticks over all stage-ticks (every operation takes one tick)."""
    return float(np.mean(self.op == IDLE))

  def in_flight(self) -> np.ndarray:
    """[stages]: the most microbatch-chunks whose forward ran and whose saved input is still
    needed (until the backward, or for zero-bubble the weight pass, which recomputes from it)."""
    peaks = np.zeros(self.stages, int)
    for s in range(self.stages):
      live = 0
      for t in range(self.ticks):
        live += int(self.op[t, s] == FORWARD)
        peaks[s] = max(peaks[s], live)
        live -= int(self.op[t, s] in _RELEASES)
    return peaks

  def buffer_slots(self) -> int:
    """Slots per chunk for saved inputs: the most in-flight microbatches of one chunk."""
    most = 1
    for s in range(self.stages):
      for c in range(self.virtual):
        live = 0
        for t in range(self.ticks):
          here = self.chunk[t, s] == c
          live += int(here and self.op[t, s] == FORWARD)
          most = max(most, live)
          live -= int(here and self.op[t, s] in _RELEASES)
    return most

  def render(self) -> str:
    """One row per stage, e.g. `F0 F1 B0 F2 B1 ...` (chunk as a suffix when interleaved)."""
    rows = []
    for s in range(self.stages):
      cells = []
      for t in range(self.ticks):
        op = self.op[t, s]
        tag = "" if op == IDLE else str(self.microbatch[t, s])
        if op != IDLE and self.virtual > 1:
          tag += f".{self.chunk[t, s]}"
        cells.append(f"{NAMES[op]}{tag}")
      rows.append(" ".join(f"{c:<5}" for c in cells).rstrip())
    return "\n".join(rows)


def _programs(kind: str, stages: int, microbatches: int, virtual: int) -> list[list[tuple]]:
  """Each stage's ordered list of (op, microbatch, chunk)."""
  programs = []
  for s in range(stages):
    if kind == "afab":
      program = [(FORWARD, m, 0) for m in range(microbatches)]
      program += [(BACKWARD, m, 0) for m in range(microbatches)]
    elif kind in ("1f1b", "zero_bubble"):
      backward = BACKWARD_INPUT if kind == "zero_bubble" else BACKWARD
      warmup = min(stages - s - 1, microbatches)
      forwards = [(FORWARD, m, 0) for m in range(microbatches)]
      backwards = [(backward, m, 0) for m in range(microbatches)]
      program = forwards[:warmup]
      for m in range(microbatches - warmup):  # steady state: one forward, one backward
        program += [forwards[warmup + m], backwards[m]]
      program += backwards[microbatches - warmup:]
    else:  # interleaved 1F1B (Megatron): microbatches in groups of `stages`, chunk by chunk
      order = [(m, c) for g in range(0, microbatches, stages) for c in range(virtual)
               for m in range(g, g + stages)]
      forwards = [(FORWARD, m, c) for m, c in order]
      backwards = [(BACKWARD, m, virtual - 1 - c) for m, c in order]
      total = len(forwards)
      warmup = min((stages - s - 1) * 2 + (virtual - 1) * stages, total)
      program = forwards[:warmup]
      for k in range(total - warmup):
        program += [forwards[warmup + k], backwards[k]]
      program += backwards[total - warmup:]
    programs.append(program)
  return programs


def _ready(op, m, c, s, done, stages, virtual, tick) -> bool:
  """Dependencies, with one tick of transfer between stages."""
  position = c * stages + s  # the virtual stage's place in the whole model
  last = stages * virtual - 1
  def finished(what, pos):
    return done.get((what, m, pos), tick) < tick
  if op == FORWARD:
    return position == 0 or finished(FORWARD, position - 1)
  if op in (BACKWARD, BACKWARD_INPUT):
    previous = BACKWARD
    upstream = position == last or finished(previous, position + 1) or finished(
        BACKWARD_INPUT, position + 1)
    return finished(FORWARD, position) and upstream
  return finished(BACKWARD_INPUT, position)  # BACKWARD_WEIGHT


def make(kind: str, stages: int, microbatches: int, virtual: int = 1) -> Schedule:
  """Simulates each stage's program tick by tick (an operation starts once its inputs arrived)."""
  if kind not in SCHEDULES:
    raise ValueError(f"pipeline schedule {kind!r} is not one of {', '.join(SCHEDULES)}")
  if kind != "interleaved_1f1b" and virtual != 1:
    raise ValueError(f"virtual stages (interleaving) need schedule=interleaved_1f1b, not {kind}")
  if kind in ("1f1b", "zero_bubble") and microbatches < stages:
    raise ValueError(f"schedule {kind} needs at least as many microbatches as stages: got"
                     f" {microbatches} microbatches for {stages} stages")
  if kind == "interleaved_1f1b" and (virtual < 2 or microbatches % stages):
    raise ValueError(f"interleaved_1f1b needs virtual >= 2 and microbatches a multiple of the"
                     f" stages: got virtual={virtual}, {microbatches} microbatches, {stages}"
                     " stages")
  programs = _programs(kind, stages, microbatches, virtual)
  weights = [[] for _ in range(stages)]  # zero-bubble: deferred weight-gradient passes
  done: dict = {}
  rows = []
  tick = 0
  live = [0] * stages  # saved stage inputs per stage
  while any(programs) or any(weights):
    row = []
    for s in range(stages):
      step = None
      nxt = programs[s][0] if programs[s] else None
      # ZB-H1: a weight pass goes first when one more forward would keep more inputs alive than
      # 1F1B does on this stage, so memory stays at 1F1B's.
      over = nxt is not None and nxt[0] == FORWARD and live[s] >= stages - s
      if weights[s] and over:
        step = weights[s].pop(0)
      elif nxt is not None and _ready(*nxt, s, done, stages, virtual, tick):
        step = programs[s].pop(0)
        if step[0] == BACKWARD_INPUT:
          weights[s].append((BACKWARD_WEIGHT, step[1], step[2]))
      elif weights[s]:  # fill what would be a bubble with a pending weight gradient
        step = weights[s].pop(0)
      if step is not None:
        live[s] += (step[0] == FORWARD) - (step[0] in _RELEASES)
      row.append(step or (IDLE, 0, 0))
    for s, (op, m, c) in enumerate(row):
      if op != IDLE:
        done[(op, m, c * stages + s)] = tick
    rows.append(row)
    tick += 1
    if tick > 10 * (microbatches * virtual + stages) * 3:
      raise RuntimeError(f"schedule {kind} deadlocked")  # a bug in a program, never user input
  table = np.asarray(rows, dtype=np.int32)  # [ticks, stages, 3]
  return Schedule(kind, stages, microbatches, virtual, table[..., 0], table[..., 1],
                  table[..., 2])


@functools.lru_cache(maxsize=512)
def table_if_valid(kind: str, stages: int, microbatches: int, virtual: int = 1) -> Schedule | None:
  """The table the executor runs, or None for a layout it refuses (e.g. fewer microbatches than
  stages for 1F1B). Cached: the planner asks for the same few tables for thousands of layouts."""
  try:
    return make(kind, stages, microbatches, virtual)
  except ValueError:
    return None


def in_flight_microbatches(kind: str, stages: int, microbatches: int, virtual: int = 1) -> float:
  """Microbatches (in whole-stage units) whose activations the most loaded stage holds at its
  peak: AFAB all m; 1F1B min(m, p); interleaved 1F1B p (1 + (p-1)/(p v)) for m > p (Narayanan et
  al. 2021, arXiv:2104.04473) — closed forms that the tick tables reproduce exactly
  (tests/test_estimate.py) — and zero-bubble (ZB-H1) read off its table (1F1B's by design)."""
  p, m = stages, microbatches
  if p == 1:
    return 1
  table = table_if_valid(kind, p, m, virtual) if kind == "zero_bubble" else None
  if table is not None:
    return float(table.in_flight().max())
  if kind == "afab":
    return m
  if kind == "interleaved_1f1b":
    # With m <= p every chunk of every microbatch runs forward before the first backward.
    return m if m <= p else p * (1 + (p - 1) / (p * virtual))
  return min(m, p)


def bubble_ratio(kind: str, stages: int, microbatches: int, virtual: int = 1) -> float:
  """Idle over busy time of a pipeline stage, with equal-length ticks: (p-1)/m for AFAB and 1F1B,
  (p-1)/(v m) interleaved (closed forms equal to the tick tables), and for zero-bubble its table
  (the deferred weight passes fill most of the bubble; a third of 1F1B's if no table)."""
  if stages == 1:
    return 0.0
  table = table_if_valid(kind, stages, microbatches, virtual) if kind == "zero_bubble" else None
  if table is not None:
    idle = table.bubble_fraction()
    return idle / (1 - idle)
  ratio = (stages - 1) / (virtual * microbatches)
  return ratio / 3 if kind == "zero_bubble" else ratio
