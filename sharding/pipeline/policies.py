"""Each schedule's per-stage policy: what a stage runs next, given which ops' inputs arrived.
AFAB, 1F1B, interleaved 1F1B and paired 1F1B (its F&B pairs) run fixed programs; ZB-H1 adds
deferred weight passes; ZB-V chooses greedily; DualPipeV runs a fixed program whose entries may
be F&B pairs. `policies` builds them for sharding/pipeline/ticks.simulate; nothing here
simulates."""

from collections import deque

from sharding.pipeline.ticks import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, IDLE,
                                     RELEASES, Op)


class Program:
  """Runs a fixed program in order, an entry once all its ops' inputs arrived. An entry is one
  op, or a tuple of ops that run in the same tick (DualPipeV's pairs: then width=2)."""

  def __init__(self, program: list, width: int = 1):
    self.program = deque(entry if isinstance(entry[0], tuple) else (entry,) for entry in program)
    self.width = width

  @property
  def finished(self) -> bool:
    return not self.program

  def step(self, runs) -> tuple[Op, ...]:
    if self.program and all(runs(*op) for op in self.program[0] if op[0] != IDLE):
      return self.program.popleft()
    return ()


class DeferredWeights:
  """ZB-H1 (Qi et al. 2024, arXiv:2401.10241): 1F1B's program with the backward split;
  each input pass (b) queues its weight pass (w), which runs before a forward that would keep
  more inputs alive than 1F1B does on this stage (`cap`, so memory stays at 1F1B's), and
  otherwise fills what would be a bubble."""

  width = 1

  def __init__(self, program: list[Op], cap: int):
    self.program, self.cap = deque(program), cap
    self.weights: deque[Op] = deque()
    self.live = 0  # saved stage inputs

  @property
  def finished(self) -> bool:
    return not self.program and not self.weights

  def step(self, runs) -> tuple[Op, ...]:
    nxt = self.program[0] if self.program else None
    if self.weights and nxt is not None and nxt[0] == FORWARD and self.live >= self.cap:
      step = self.weights.popleft()
    elif nxt is not None and runs(*nxt):
      step = self.program.popleft()
      if step[0] == BACKWARD_INPUT:
        self.weights.append((BACKWARD_WEIGHT, step[1], step[2]))
    elif self.weights:
      step = self.weights.popleft()
    else:
      return ()
    self.live += (step[0] == FORWARD) - (step[0] in RELEASES)
    return (step,)


class Greedy:
  """ZB-V (Qi et al. 2024, arXiv:2401.10241, sec. 6): two chunks in a V, the backward split into
  an input pass (b) and a weight pass (w). Each tick: a ready b (the earlier microbatch; chunk
  1, the later position, on ties), else a ready forward (chunk 1 first) while the saved inputs
  stay within 1F1B's peak (p whole-stage microbatches = 2p half-stage chunks), else a deferred w:
  the w passes fill the bubbles."""

  width = 1

  def __init__(self, microbatches: int, limit: int):
    self.microbatches, self.limit = microbatches, limit
    self.next_f, self.next_b = [0, 0], [0, 0]  # per chunk: the next microbatch
    self.weights: deque[Op] = deque()
    self.live = 0

  @property
  def finished(self) -> bool:
    return min(self.next_b) >= self.microbatches and not self.weights

  def step(self, runs) -> tuple[Op, ...]:
    step = None
    ready_b = [(m, -c) for c in (0, 1)
               if (m := self.next_b[c]) < self.microbatches and runs(BACKWARD_INPUT, m, c)]
    if ready_b:
      m, c = min(ready_b)[0], -min(ready_b)[1]
      step = (BACKWARD_INPUT, m, c)
      self.next_b[c] += 1
      self.weights.append((BACKWARD_WEIGHT, m, c))
    elif self.live < self.limit:
      for c in (1, 0):
        m = self.next_f[c]
        if m < self.microbatches and runs(FORWARD, m, c):
          step = (FORWARD, m, c)
          self.next_f[c] += 1
          break
    if step is None and self.weights:
      step = self.weights.popleft()
    if step is None:
      return ()
    self.live += (step[0] == FORWARD) - (step[0] in RELEASES)
    return (step,)


def one_f_one_b(stages: int, stage: int, microbatches: int, backward: int) -> list[Op]:
  """1F1B (Narayanan et al. 2021, arXiv:2104.04473): p-s-1 warm-up forwards, then one forward,
  one backward, then the remaining backwards."""
  warmup = min(stages - stage - 1, microbatches)
  forwards = [(FORWARD, m, 0) for m in range(microbatches)]
  backwards = [(backward, m, 0) for m in range(microbatches)]
  program = forwards[:warmup]
  for m in range(microbatches - warmup):
    program += [forwards[warmup + m], backwards[m]]
  return program + backwards[microbatches - warmup:]


def interleaved_order(stages: int, microbatches: int, virtual: int) -> tuple[list, list]:
  """Interleaved 1F1B's order of a stage's forwards and of its backwards (Megatron): microbatches
  in groups of `stages`, chunk by chunk, the backwards from the last chunk back."""
  order = [(m, c) for g in range(0, microbatches, stages) for c in range(virtual)
           for m in range(g, g + stages)]
  return ([(FORWARD, m, c) for m, c in order],
          [(BACKWARD, m, virtual - 1 - c) for m, c in order])


def interleaved(stages: int, stage: int, microbatches: int, virtual: int) -> list[Op]:
  """Interleaved 1F1B (Megatron, arXiv:2104.04473): `interleaved_order`; a longer warm-up, then
  1F1B over microbatch-chunks."""
  forwards, backwards = interleaved_order(stages, microbatches, virtual)
  total = len(forwards)
  warmup = min((stages - stage - 1) * 2 + (virtual - 1) * stages, total)
  program = forwards[:warmup]
  for k in range(total - warmup):
    program += [forwards[warmup + k], backwards[k]]
  return program + backwards[total - warmup:]


def paired(stages: int, stage: int, microbatches: int, virtual: int) -> list:
  """paired_1f1b: 1F1B's order (interleaved's with virtual > 1) with each steady-state forward
  and the next backward in one tick, an F&B pair. meshtron's executor runs a tick on every stage
  at once, so a tick of 1F1B costs its slowest stage's operation, a backward (about 3 forwards
  with the chunk's forward recomputed) even on stages that run a forward; a pair costs one of
  each. The warm-up covers a pair's round trip: the backward of a stage's first chunk returns
  2(p - s - 1) + 1 ticks after its forward, interleaving adds (v - 1) p chunk forwards, as
  interleaved 1F1B's does (tests/test_schedules.py: no stall in the steady state). Backwards
  always take a tick's second slot, forwards its first, so each of the executor's two switches
  holds one kind of pass (a program's cost per tick is then a forward plus a backward)."""
  forwards, backwards = interleaved_order(stages, microbatches, virtual)
  total = len(forwards)
  warmup = min(2 * (stages - stage - 1) + 1 + (virtual - 1) * stages, total)
  return (forwards[:warmup] + [(forwards[warmup + k], backwards[k]) for k in range(total - warmup)]
          + [((IDLE, 0, 0), b) for b in backwards[total - warmup:]])


def dualpipev(stages: int, r: int, microbatches: int) -> list:
  """Rank r's DualPipeV program (DeepSeek-V3 report; deepseek-ai/DualPipe dualpipev.py, its
  eight steps): warm-up forwards of chunk 0, then of both chunks; backward-weight-forward triples
  (zero bubble); the main phase of F&B pairs (chunk 0's forward with chunk 1's backward, then
  chunk 1's forward with chunk 0's backward); the drain of backwards whose weight passes are
  deferred into the remaining gaps. An entry is an op or a pair ((FORWARD, ..), (BACKWARD, ..))."""
  p, program, deferred = stages, [], deque()
  next_f, next_b = [0, 0], [0, 0]

  def forward(c):
    program.append((FORWARD, next_f[c], c))
    next_f[c] += 1

  def backward(c, split=False):
    if split:  # input gradient now, weight gradient later
      program.append((BACKWARD_INPUT, next_b[c], c))
      deferred.append((BACKWARD_WEIGHT, next_b[c], c))
    else:
      program.append((BACKWARD, next_b[c], c))
    next_b[c] += 1

  def pair(forward_chunk, backward_chunk):
    program.append(((FORWARD, next_f[forward_chunk], forward_chunk),
                    (BACKWARD, next_b[backward_chunk], backward_chunk)))
    next_f[forward_chunk] += 1
    next_b[backward_chunk] += 1

  for _ in range(2 * (p - r - 1)):  # 1: nF0
    forward(0)
  for _ in range(r + 1):  # 2: nF0F1
    forward(0)
    forward(1)
  for _ in range(p - r - 1):  # 3: nB1W1F1
    backward(1, split=True)
    program.append(deferred.popleft())
    forward(1)
  for i in range(microbatches - 2 * p + r + 1):  # 4: nF0B1F1B0, the overlapped main phase
    if i == 0 and r == p - 1:  # the turn: not overlapped, to shorten the bubble
      forward(0)
      backward(1)
    else:
      pair(0, 1)
    pair(1, 0)
  for _ in range(p - r - 1):  # 5: nB1F1B0
    backward(1)
    pair(1, 0)
  split = False
  for i in range(r + 1):  # 6: nB1B0, the second half with deferred weight passes
    split = split or (i == (r + 1) // 2 and r % 2 == 1)
    backward(1, split)
    split = split or (i == (r + 1) // 2 and r % 2 == 0)
    backward(0, split)
  for _ in range(p - r - 1):  # 7: nWB0
    program.append(deferred.popleft())
    backward(0, split=True)
  for _ in range(r + 1):  # 8: nW
    program.append(deferred.popleft())
  return program


def policies(kind: str, stages: int, microbatches: int, virtual: int) -> list:
  """One policy per stage for a schedule `make` accepted (it validates the arguments)."""
  p, m = stages, microbatches
  if kind == "afab":  # GPipe: every forward, then every backward
    return [Program([(FORWARD, i, 0) for i in range(m)] + [(BACKWARD, i, 0) for i in range(m)])
            for _ in range(p)]
  if kind == "1f1b":
    return [Program(one_f_one_b(p, s, m, BACKWARD)) for s in range(p)]
  if kind == "zero_bubble":  # 1F1B's cap on this stage: p - s saved inputs
    return [DeferredWeights(one_f_one_b(p, s, m, BACKWARD_INPUT), p - s) for s in range(p)]
  if kind == "interleaved_1f1b":
    return [Program(interleaved(p, s, m, virtual)) for s in range(p)]
  if kind == "paired_1f1b":
    return [Program(paired(p, s, m, virtual), width=2) for s in range(p)]
  if kind == "zbv":
    return [Greedy(m, 2 * p) for _ in range(p)]
  if kind == "dualpipev":
    return [Program(dualpipev(p, r, m), width=2) for r in range(p)]
  # Not ValueError: make validated `kind`, and table_if_valid would hide a missing policy.
  raise RuntimeError(f"no policy for pipeline schedule {kind!r}")
