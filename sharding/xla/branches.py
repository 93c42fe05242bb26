"""A program's collective bytes with each conditional counted by its costliest branch: what one
device sends per run, as the step-time model prices it (sharding/xla/step_time.py), where
hlo.summarize counts every branch as taken."""

import collections

from sharding.xla import hlo


def costliest_branch_wire_bytes(hlo_text: str, num_devices: int | None = None) -> dict:
  """{kind: wire bytes one device sends per program run} when each conditional runs the branch
  that sends the most, as step_time prices a conditional by its costliest branch. Where
  hlo.summarize counts every branch as taken (an upper bound), this counts one per execution: a
  pipeline stage's tick runs one role's branch (first, middle or last stage; forward or
  backward), not all of them."""
  comps = hlo.computations(hlo_text)
  own: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
  for c in hlo.collectives(hlo_text, num_devices):
    own[c.computation][c.kind] += c.wire_bytes
  called = {c for instrs in comps.values() for ins in instrs for c in hlo.callees(ins)}
  memo: dict[str, collections.Counter] = {}

  def total(comp: str, seen: frozenset) -> collections.Counter:
    if comp in memo or comp in seen:
      return memo.get(comp, collections.Counter())
    out = collections.Counter(own.get(comp, {}))
    for ins in comps.get(comp, []):
      if ins.op.endswith(("-done", "-update")):
        continue  # the matching -start already names the same callee
      inner = [total(c, seen | {comp}) for c in hlo.callees(ins) if c in comps]
      if ins.op == "while":
        trip = hlo.trip_count(ins, comps, comp)
        trip = 1 if trip is None else trip
        inner = [collections.Counter({k: v * trip for k, v in part.items()}) for part in inner]
      elif ins.op == "conditional":
        inner = [max(inner, key=lambda part: sum(part.values()), default=collections.Counter())]
      for part in inner:
        out.update(part)
    memo[comp] = out
    return out

  result = collections.Counter()
  for comp in comps:
    if comp not in called:
      result.update(total(comp, frozenset()))
  return {kind: result[kind] for kind in hlo.KINDS if result[kind]}
