"""The V-shaped schedules' tick tables (two chunks per stage: chunk 0 down the stages, chunk 1
back up): ZB-V, built greedily, and DualPipeV, whose ticks pair one microbatch's forward with
another's backward. sharding/pipeline/schedules.make calls them; the executor runs them like the others."""

from collections import deque

from sharding.pipeline.schedules import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, IDLE,
                                RELEASES, position, ready)


def zbv_rows(stages: int, microbatches: int) -> list:
  """ZB-V (Qi et al. 2024, arXiv:2401.10241, sec. 6): two chunks per stage in a V, the backward
  split into an input pass (b) and a weight pass (w). Each tick a stage runs, by preference, a
  ready b (the earlier microbatch; chunk 1, the later position, on ties), a ready forward
  (chunk 1 first) while its saved inputs stay within 1F1B's peak (p whole-stage microbatches =
  2p half-stage chunks), a deferred w, else nothing: the w passes fill the bubbles."""
  p, limit = stages, 2 * stages
  where = lambda c, s: position("zbv", p, c, s)  # noqa: E731
  next_f = [[0, 0] for _ in range(p)]
  next_b = [[0, 0] for _ in range(p)]
  weights = [[] for _ in range(p)]
  live, done, rows, tick = [0] * p, {}, [], 0
  runs = lambda op, m, c, s: ready(op, m, c, s, done, p, 2, tick, "zbv")  # noqa: E731
  while any(n < microbatches for per in next_b for n in per) or any(weights):
    row = []
    for s in range(p):
      step = None
      ready_b = [(m, -c) for c in (0, 1) if (m := next_b[s][c]) < microbatches
                 and runs(BACKWARD_INPUT, m, c, s)]
      if ready_b:
        m, c = min(ready_b)[0], -min(ready_b)[1]
        step = (BACKWARD_INPUT, m, c)
        next_b[s][c] += 1
        weights[s].append((BACKWARD_WEIGHT, m, c))
      elif live[s] < limit:
        for c in (1, 0):
          m = next_f[s][c]
          if m < microbatches and runs(FORWARD, m, c, s):
            step = (FORWARD, m, c)
            next_f[s][c] += 1
            break
      if step is None and weights[s]:
        step = weights[s].pop(0)
      if step is not None:
        live[s] += (step[0] == FORWARD) - (step[0] in RELEASES)
      row.append(step or (IDLE, 0, 0))
    for s, (op, m, c) in enumerate(row):
      if op != IDLE:
        done[(op, m, where(c, s))] = tick
    rows.append(row)
    tick += 1
    if tick > 30 * (2 * microbatches + stages):
      raise RuntimeError("schedule zbv deadlocked")  # a bug here, never user input
  return rows



def dualpipev_programs(stages: int, microbatches: int) -> list[list[tuple]]:
  """Each stage's DualPipeV program (DeepSeek-V3 report; deepseek-ai/DualPipe dualpipev.py, its
  eight steps per rank r of p): warm-up forwards of chunk 0, then of both chunks; backward-
  forward-weight triples (zero bubble); the main phase of F&B pairs (chunk 0's forward with chunk
  1's backward, then chunk 1's forward with chunk 0's backward); the drain of backwards whose
  weight passes are deferred into the remaining gaps. An entry is (op, microbatch, chunk), or a
  pair ((FORWARD, m, c), (BACKWARD, m', c'))."""
  p, programs = stages, []
  for r in range(p):
    program, deferred = [], deque()
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
    programs.append(program)
  return programs


def dualpipev_rows(stages: int, microbatches: int) -> list:
  """Runs each stage's DualPipeV program in order, an entry once its inputs arrived (one tick of
  transfer); a pair takes one tick. Rows of (op, m, c, paired op, m, c)."""
  p = stages
  programs = dualpipev_programs(p, microbatches)
  where = lambda c, s: position("dualpipev", p, c, s)  # noqa: E731
  done, rows, tick, cursor = {}, [], 0, [0] * p

  while any(cursor[s] < len(programs[s]) for s in range(p)):
    row = []
    for s in range(p):
      entry = programs[s][cursor[s]] if cursor[s] < len(programs[s]) else None
      parts = [] if entry is None else list(entry) if isinstance(entry[0], tuple) else [entry]
      if parts and all(ready(*part, s, done, p, 2, tick, "dualpipev") for part in parts):
        cursor[s] += 1
        row.append(tuple(parts[0]) + (tuple(parts[1]) if len(parts) == 2 else (IDLE, 0, 0)))
      else:
        row.append((IDLE, 0, 0, IDLE, 0, 0))
    for s, (op, m, c, op2, m2, c2) in enumerate(row):
      for o, mb, ch in ((op, m, c), (op2, m2, c2)):
        if o != IDLE:
          done[(o, mb, where(ch, s))] = tick
    rows.append(row)
    tick += 1
    if tick > 30 * (2 * microbatches + stages):
      raise RuntimeError("schedule dualpipev deadlocked")  # a bug here, never user input
  return rows
