"""Pipeline schedules as static tick tables: AFAB (GPipe), 1F1B, interleaved 1F1B, zero-bubble
(ZB-H1), the V-shaped zero-bubble schedule (ZB-V) and DualPipeV.

This module owns the `Schedule` table and what is read off it (messages, buffer slots, bubble,
in-flight microbatches), `make` (validation, then sharding/pipeline/ticks.simulate over the
policies of sharding/pipeline/policies.py) and the analytic helpers the planner asks. The
executor (sharding/pipeline/executor.py) runs a table; the bubble fraction and the peak number
of in-flight microbatches come from the same table (and feed the analytic model).
"""

import dataclasses
import functools

import numpy as np

from sharding.pipeline import policies
# The tick model lives in ticks.py; callers read it from here (re-exported: `ready` is unused).
from sharding.pipeline.ticks import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, IDLE,
                                     NAMES, RELEASES, V_SHAPED, position, simulate)
from sharding.pipeline.ticks import ready  # noqa: F401

SCHEDULES = ("afab", "1f1b", "interleaved_1f1b", "paired_1f1b", "zero_bubble", "zbv",
             "dualpipev")
# Schedules whose bubble and memory are read off their tables (the others have closed forms).
TABLED = ("paired_1f1b", "zero_bubble", *V_SHAPED)
# Schedules that may interleave virtual stages (the V-shaped ones need exactly 2).
INTERLEAVING = ("interleaved_1f1b", "paired_1f1b", *V_SHAPED)
# Where a tick's message goes: to the next stage (s + 1, round the ring), the previous one, or
# this stage itself (the V's turn); and the sources a stage receives from, in that order.
NOWHERE, RIGHT, LEFT, HERE = range(4)


@dataclasses.dataclass(frozen=True)
class Schedule:
  """op/microbatch/chunk: int arrays [ticks, stages]; virtual: chunks per stage; paired: None,
  or [ticks, stages, 3] (op, microbatch, chunk) of a backward that runs in the same tick as the
  forward in `op` (DualPipeV's overlapped F&B), op IDLE where there is none."""

  kind: str
  stages: int
  microbatches: int
  virtual: int
  op: np.ndarray
  microbatch: np.ndarray
  chunk: np.ndarray
  paired: np.ndarray | None = None

  def slots_at(self, t: int, s: int) -> list[tuple[int, int, int]]:
    """Stage s's (op, microbatch, chunk) in each of tick t's slots, idle ones included: one slot,
    or two in a paired schedule (the executor's switches and message slots, in order)."""
    slots = [(int(self.op[t, s]), int(self.microbatch[t, s]), int(self.chunk[t, s]))]
    if self.paired is not None:
      slots.append(tuple(int(x) for x in self.paired[t, s]))
    return slots

  def ops_at(self, t: int, s: int) -> list[tuple[int, int, int]]:
    """The operations stage s runs in tick t, forward first: none, one, or an F&B pair."""
    return [o for o in self.slots_at(t, s) if o[0] != IDLE]

  @property
  def ticks(self) -> int:
    return self.op.shape[0]

  def position(self, chunk: int, stage: int) -> int:
    return position(self.kind, self.stages, chunk, stage)

  def positions(self) -> np.ndarray:
    """[virtual, stages]: the model position (0 = first) of each stage's chunks."""
    return np.asarray([[self.position(c, s) for s in range(self.stages)]
                       for c in range(self.virtual)])

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
        for op, _, _ in self.ops_at(t, s):
          live += int(op == FORWARD)
          peaks[s] = max(peaks[s], live)
          live -= int(op in RELEASES)
    return peaks

  def backward_ticks(self) -> np.ndarray:
    """[ticks] bool: the ticks in which some stage runs a backward (or a part of one)."""
    return np.any(np.isin(self._slot_ops(), (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)),
                  axis=(1, 2))

  def forward_ticks(self) -> np.ndarray:
    """[ticks] bool: the ticks in which some stage runs a forward."""
    return np.any(self._slot_ops() == FORWARD, axis=(1, 2))

  def _slot_ops(self) -> np.ndarray:
    """[ticks, stages, slots] int: the operation of each slot (paired schedules: 2)."""
    return self.op[..., None] if self.paired is None else np.stack(
        [self.op, self.paired[..., 0]], axis=-1)

  def head_ops(self) -> np.ndarray:
    """[ticks, 3] int: (microbatch, stage, chunk) of the forward each tick runs at the pipeline's
    last position, or -1s where none runs: the ticks after whose first slot the executor runs
    the head, its tokens split over all stages. That forward is never a pair's second slot."""
    last = self.stages * self.virtual - 1
    at_last = (self.op == FORWARD) & (self.positions()[self.chunk, np.arange(self.stages)] == last)
    if self.paired is not None:
      paired_at_last = self.positions()[self.paired[..., 2], np.arange(self.stages)] == last
      assert not np.any((self.paired[..., 0] == FORWARD) & paired_at_last), self.kind
    assert np.all(at_last.sum(axis=1) <= 1), self.kind  # one last position, one op a tick
    out = np.full((self.ticks, 3), -1, np.int32)
    t, s = np.nonzero(at_last)
    out[t] = np.stack([self.microbatch[t, s], s, self.chunk[t, s]], axis=-1)
    return out

  def buffer_slots(self) -> int:
    """Slots per chunk for saved inputs: the most microbatches one chunk holds at a time, each
    from the tick its input arrives (the previous position's forward ended; its own forward at
    position 0) until its last use (the backward, or the weight pass)."""
    arrive, release = {}, {}
    for t in range(self.ticks):
      for s in range(self.stages):
        for op, m, c in self.ops_at(t, s):
          q = self.position(c, s)
          if op == FORWARD:
            arrive.setdefault((m, q), t)  # position 0: from its own forward
            arrive[(m, q + 1)] = min(arrive.get((m, q + 1), t + 1), t + 1)
          if op in RELEASES:
            release[(m, q)] = t
    most = 1
    for q in range(self.stages * self.virtual):  # the most spans holding one tick: a sweep
      change = np.zeros(self.ticks + 2, np.int64)
      np.add.at(change, [arrive[(m, q)] for m in range(self.microbatches)], 1)
      np.add.at(change, [release[(m, q)] + 1 for m in range(self.microbatches)], -1)
      most = max(most, int(np.cumsum(change).max()))
    return most

  def kept_slots(self) -> tuple[int, np.ndarray]:
    """(slots, [ticks, stages, k] slot of each op slot) for residuals a stage keeps from a
    forward to its last use (the backward, or the weight pass): each forward takes the lowest
    slot free since the tick before (a tick's forward runs before its backward), its release
    reads the same slot. As many as a stage holds at once (sharding/pipeline/kept_residuals.py):
    one per chunk and buffer slot would count every chunk at its own peak."""
    out = np.zeros((self.ticks, self.stages, 1 if self.paired is None else 2), np.int32)
    most = 1
    for s in range(self.stages):
      free, held, released = list(range(self.microbatches * self.virtual)), {}, []
      for t in range(self.ticks):
        for k, (op, m, c) in enumerate(self.slots_at(t, s)):
          if op == FORWARD:
            held[(m, c)] = free.pop(0)
          if op != IDLE:
            out[t, s, k] = held[(m, c)]
          if op in RELEASES:
            released.append(held.pop((m, c)))
        most = max(most, len(held) + len(released))
        free, released = sorted(free + released), []
    return most, out

  def messages(self) -> tuple[np.ndarray, np.ndarray]:
    """(send [ticks, stages, k]: NOWHERE/RIGHT/LEFT/HERE, receive [ticks, stages, 3k, 4]) with
    k = 2 for paired schedules (the forward's and the backward's message), else 1: what each
    tick's operations send (a forward its output to the next position, a backward its input
    gradient to the previous one) and, per receiving stage and source (from the left, from the
    right, from itself; per message), (1, is_gradient, chunk, buffer slot) of what arrives."""
    p, last, slots = self.stages, self.stages * self.virtual - 1, self.buffer_slots()
    k = 1 if self.paired is None else 2
    holder = {self.position(c, s): (s, c) for s in range(p) for c in range(self.virtual)}
    send = np.zeros((self.ticks, p, k), np.int32)
    receive = np.zeros((self.ticks, p, 3 * k, 4), np.int32)
    for t in range(self.ticks):
      for s in range(p):
        # The message slot is the op's slot: a lone backward in a pair's second slot too.
        for index, (op, m, c) in enumerate(self.slots_at(t, s)):
          if op == IDLE:
            continue
          q = self.position(c, s)
          gradient = op in (BACKWARD, BACKWARD_INPUT)
          if not (op == FORWARD and q < last or gradient and q > 0):
            continue
          dest, dest_chunk = holder[q - 1 if gradient else q + 1]
          down = (not gradient) if self.kind not in V_SHAPED else (c == 0) != gradient
          way = HERE if dest == s else RIGHT if down else LEFT
          send[t, s, index] = way
          source = 3 * index + {RIGHT: 0, LEFT: 1, HERE: 2}[way]
          receive[t, dest, source] = (1, gradient, dest_chunk, m % slots)
    return send, receive

  def render(self) -> str:
    """One row per stage, e.g. `F0 F1 B0 F2 B1 ...` (chunk as a suffix when interleaved)."""
    rows = []
    for s in range(self.stages):
      cells = []
      for t in range(self.ticks):
        ops = self.ops_at(t, s)
        suffix = lambda c: f".{c}" if self.virtual > 1 else ""  # noqa: E731
        cells.append("&".join(f"{NAMES[o]}{m}{suffix(c)}" for o, m, c in ops) or NAMES[IDLE])
      width = 11 if self.paired is not None else 5
      rows.append(" ".join(f"{c:<{width}}" for c in cells).rstrip())
    return "\n".join(rows)


def tick_runs(flags: np.ndarray) -> list[tuple[int, int]]:
  """(start, length) of each run of ticks with equal `flags`, in order."""
  starts = [0, *(np.flatnonzero(flags[1:] != flags[:-1]) + 1).tolist(), len(flags)]
  return [(a, b - a) for a, b in zip(starts, starts[1:])]


Run = tuple[int, int, int]  # (first tick, from its block's start; length; flags)


def tick_segments(flags: np.ndarray, longest: int = 4) -> list[tuple[int, int, list[Run]]]:
  """The runs of `tick_runs`, as (start, repeats, block) segments in order: a block of up to
  `longest` consecutive runs that recurs right after itself (the same flags and lengths, as an
  interleaved steady state's few ticks with a head and many without) is one segment, repeated.
  A loop per segment (nested where it repeats) compiles one body per run of a block, not one per
  run of the schedule. Runs of equal flags but other lengths stay apart: the warm-up's and
  cool-down's ticks compile only the operations they run (a cool-down run cut to the steady
  state's length and run in its loop, priced with the forwards it does not run, made the
  70B TP4 PP8 VP5 program 1.3% slower)."""
  runs = [(start, length, int(flags[start])) for start, length in tick_runs(flags)]
  out, i = [], 0
  while i < len(runs):
    period, repeats = 1, 1
    for k in range(2, longest + 1):
      r = 1
      while i + (r + 1) * k <= len(runs) and all(
          runs[i + r * k + j][1:] == runs[i + j][1:] for j in range(k)):
        r += 1
      if r > 1 and k * r > period * repeats:
        period, repeats = k, r
    start = runs[i][0]
    out.append((start, repeats, [(s - start, n, f) for s, n, f in runs[i:i + period]]))
    i += period * repeats
  return out


def loop_flags(schedule: Schedule) -> np.ndarray:
  """[ticks] int: the flags by which the executor's loops over the ticks run each run of ticks
  apart: 1 where some stage runs a backward, 2 where the loop holds the head (`head_ticks`), 4
  where some stage runs a forward. A loop compiles the operations its ticks run: the drain's,
  where no stage runs a forward, holds neither a forward nor the head that follows one (the
  step-time model priced their conditionals in each of those ticks at the costliest branch,
  though every stage takes the idle one: DeepSeek-V3-like PP8 EP64's last 8 of 23 ticks, whose
  short run without a head shared the head's loop). Runs without a forward shorter than the
  stages, or than 8, keep it: a loop is another compile of the whole tick (the 1F1B steady
  state's lone tick without one, a few stages' short drain)."""
  forwards = _gaps_filled(schedule.forward_ticks(), max(8, schedule.stages))
  return schedule.backward_ticks() + 2 * (head_ticks(schedule) & forwards) + 4 * forwards


def head_ticks(schedule: Schedule) -> np.ndarray:
  """[ticks] bool: the ticks whose loop body holds the head, under a conditional where the tick
  runs none. Those with one (`Schedule.head_ops`), and runs of ticks without one shorter than
  2 x stages (at least 8): a body without the head is another compile of the whole tick, worth
  it only where it runs often (the interleaved steady state runs 8 ticks with a head in every
  stages x virtual, the 70B TP4 PP8 VP5 program 32 without)."""
  return _gaps_filled(schedule.head_ops()[:, 0] >= 0, max(8, 2 * schedule.stages))


def _gaps_filled(ticks: np.ndarray, shortest: int) -> np.ndarray:
  """`ticks` (bool) with each run of False shorter than `shortest` set True: a loop of its own
  is another compile of the whole tick, worth it only for a long run."""
  ticks = ticks.copy()
  for start, length in tick_runs(ticks):
    if not ticks[start] and length < shortest:
      ticks[start:start + length] = True
  return ticks


def make(kind: str, stages: int, microbatches: int, virtual: int = 1) -> Schedule:
  """The schedule's table: each stage's policy run tick by tick (an operation starts once its
  inputs arrived). ValueError for a layout the schedule cannot run."""
  if kind not in SCHEDULES:
    raise ValueError(f"pipeline schedule {kind!r} is not one of {', '.join(SCHEDULES)}")
  if kind in V_SHAPED and virtual != 2:
    raise ValueError(f"schedule {kind} runs two chunks per stage (its V): set virtual stages to 2,"
                     f" not {virtual}")
  if kind not in INTERLEAVING and virtual != 1:
    raise ValueError(f"virtual stages (interleaving) need schedule=interleaved_1f1b or"
                     f" paired_1f1b, not {kind}")
  if kind == "dualpipev" and microbatches < 2 * stages:
    raise ValueError(f"schedule dualpipev needs at least twice as many microbatches as stages:"
                     f" got {microbatches} microbatches for {stages} stages")
  if kind in ("1f1b", "paired_1f1b", "zero_bubble") and microbatches < stages:
    raise ValueError(f"schedule {kind} needs at least as many microbatches as stages: got"
                     f" {microbatches} microbatches for {stages} stages")
  if kind == "paired_1f1b" and virtual > 1 and microbatches % stages:
    raise ValueError(f"paired_1f1b with virtual stages needs microbatches a multiple of the"
                     f" stages: got {microbatches} microbatches for {stages} stages")
  if kind == "interleaved_1f1b" and (virtual < 2 or microbatches % stages):
    raise ValueError(f"interleaved_1f1b needs virtual >= 2 and microbatches a multiple of the"
                     f" stages: got virtual={virtual}, {microbatches} microbatches, {stages}"
                     " stages")
  rows = simulate(kind, stages, microbatches, virtual,
                  policies.policies(kind, stages, microbatches, virtual))
  table = np.asarray(rows, dtype=np.int32)  # [ticks, stages, 3 or 6]
  paired = table[..., 3:] if table.shape[-1] == 6 else None
  return Schedule(kind, stages, microbatches, virtual, table[..., 0], table[..., 1],
                  table[..., 2], paired)


@functools.lru_cache(maxsize=512)
def table_if_valid(kind: str, stages: int, microbatches: int, virtual: int = 1) -> Schedule | None:
  """The table the executor runs, or None for a layout it refuses (e.g. fewer microbatches than
  stages for 1F1B). Cached: the planner asks for the same few tables for thousands of layouts."""
  try:
    return make(kind, stages, microbatches, virtual)
  except ValueError:
    return None


@functools.lru_cache(maxsize=512)
def executor_stash(kind: str, stages: int, microbatches: int, virtual: int = 1) -> int:
  """Activation-sized buffers the executor (sharding/pipeline/executor.py) holds on each device:
  an input and a received gradient per chunk and slot, slots being Schedule.buffer_slots() (in
  closed form for AFAB m, 1F1B min(m, p), interleaved min(m, 2p), tests/test_estimate.py; read
  off the table for the others)."""
  p, m = stages, microbatches
  slots = {"afab": m, "1f1b": min(m, p), "interleaved_1f1b": min(m, 2 * p)}.get(kind)
  if slots is None:
    table = table_if_valid(kind, p, m, virtual)
    slots = table.buffer_slots() if table is not None else min(m, p)
  return 2 * virtual * slots


@functools.lru_cache(maxsize=4096)  # the planner asks for it per layout; a table read is O(ticks)
def in_flight_microbatches(kind: str, stages: int, microbatches: int, virtual: int = 1) -> float:
  """Microbatches (in whole-stage units) whose activations the most loaded stage holds at its
  peak: AFAB all m; 1F1B min(m, p); interleaved 1F1B p (1 + (p-1)/(p v)) for m > p (Narayanan et
  al. 2021, arXiv:2104.04473) — closed forms that the tick tables reproduce exactly
  (tests/test_estimate.py) — and the zero-bubble schedules read off their tables (ZB-H1 and
  ZB-V keep 1F1B's p; ZB-V's chunks are half stages)."""
  p, m = stages, microbatches
  if p == 1:
    return 1
  tabled = kind in TABLED
  table = table_if_valid(kind, p, m, virtual) if tabled else None
  if table is not None:
    return float(table.in_flight().max()) / table.virtual
  if kind == "afab":
    return m
  if kind == "interleaved_1f1b":
    # With m <= p every chunk of every microbatch runs forward before the first backward.
    return m if m <= p else p * (1 + (p - 1) / (p * virtual))
  return min(m, p)


@functools.lru_cache(maxsize=4096)
def bubble_ratio(kind: str, stages: int, microbatches: int, virtual: int = 1) -> float:
  """Idle over busy time of a pipeline stage, with equal-length ticks: (p-1)/m for AFAB and 1F1B,
  (p-1)/(v m) interleaved (closed forms equal to the tick tables), and for zero-bubble its table
  (the deferred weight passes fill most of the bubble; a third of 1F1B's if no table), and ZB-V
  its table."""
  if stages == 1:
    return 0.0
  tabled = kind in TABLED
  table = table_if_valid(kind, stages, microbatches, virtual) if tabled else None
  if table is not None:
    idle = table.bubble_fraction()
    return idle / (1 - idle)
  ratio = (stages - 1) / (virtual * microbatches)
  return ratio / 3 if kind == "zero_bubble" else ratio


@functools.lru_cache(maxsize=4096)
def lockstep_ratio(kind: str, stages: int, microbatches: int, virtual: int = 1,
                   backward_share: float = 2 / 3) -> float:
  """The executor's step over a stage's busy time. Every stage runs each tick at once (a switch
  per stage, then the tick's collective-permute), so a tick lasts as long as its slowest
  operation: sum over ticks of the costliest stage's, over m v (f + b), where one chunk's
  forward costs f = 1 - backward_share and its backward b = backward_share (recomputation
  included); zero bubble's split backward passes count b / 2 each, a paired F&B f + b. Equal
  operation costs give 1 + bubble_ratio; a backward 3x the forward (the chunk's forward
  recomputed) costs 1F1B about 1.5x that, its forward ticks waiting for a neighbour's backward
  (paired_1f1b does not). The bubble's closed form where the executor refuses the layout."""
  table = table_if_valid(kind, stages, microbatches, virtual) if stages > 1 else None
  if table is None:
    return 1 + bubble_ratio(kind, stages, microbatches, virtual)
  f, b = 1 - backward_share, backward_share
  cost = np.zeros(max(NAMES) + 1)
  cost[[FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT]] = f, b, b / 2, b / 2
  tick = cost[table.op]
  if table.paired is not None:
    tick = tick + cost[table.paired[..., 0]]
  return float(tick.max(axis=1).sum()) / (microbatches * virtual * (f + b))
