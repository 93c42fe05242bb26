"""Issue [26]'s planner checks on each anchor: does `meshtron plan`, asked for the anchor's model,
GPU count, sequence and global batch, rank the anchor's layout in its top 3, and does its
analytic speed for that layout agree with the compiled program's prediction within +-20%?

The analytic side is `sharding.plan` (memory, hardware.step_time) at the row's config precision
on the H100 profile; the compiled side is the row's prediction from its deviceless program. The
ratio is analytic / compiled; nothing here is fitted to the other.
"""

from benchmarks.anchor_recipes import Anchor, config
from sharding.plan import hardware, planner
from sharding.plan.estimate import model_spec

TOP = 3  # the rank
AGREEMENT = 0.2  # the issue's +-20%


def planner_fields(a: Anchor, layout, compiled_tokens_per_s: float) -> dict:
  """The anchor's layout evaluated analytically, its rank in the planner's list (None: the
  planner does not generate it, or rejects it), and the planner's first layout."""
  cfg = config(a)
  hw, precision = hardware.PROFILES["h100"], cfg.precision()
  mine = planner.evaluate(model_spec(cfg.model, cfg.compute), layout, a.seq_len, precision, hw)
  result = planner.plan(cfg.model, a.gpus, a.seq_len, a.batch_size * a.seq_len, precision, hw)
  names = [c.layout.string() for c in result.ranked]
  rank = names.index(layout.string()) + 1 if layout.string() in names else None
  analytic = mine.time.tokens_per_s_per_gpu
  best = result.ranked[0] if result.ranked else None
  return {"planner": {
      "layout": layout.string(), "analytic_tokens_per_s_per_gpu": round(analytic, 1),
      "analytic_fits": mine.fits, "analytic_total_gb": round(mine.memory.total / 1e9, 1),
      "analytic_over_compiled": round(analytic / compiled_tokens_per_s, 3),
      "within_20_percent": abs(analytic / compiled_tokens_per_s - 1) <= AGREEMENT,
      "rank": rank, "in_top_3": rank is not None and rank <= TOP, "ranked": len(names),
      "first": best.layout.string() if best else None,
      "first_tokens_per_s_per_gpu": round(best.time.tokens_per_s_per_gpu, 1) if best else None}}


def render(rows: list) -> list[str]:
  """The planner check's table lines."""
  lines = ["| published run | layout (`meshtron plan`'s notation) | rank in `plan` (top 3?) |"
           " analytic tok/s/GPU : compiled prediction (within 20%?) | `plan`'s first layout,"
           " analytic tok/s/GPU |", "| --- | --- | ---: | ---: | --- |"]
  for r in rows:
    p = r.get("planner")
    if not p:
      continue
    rank = f"{p['rank']} of {p['ranked']}" if p["rank"] else f"not ranked (of {p['ranked']})"
    first = f"{p['first']}, {p['first_tokens_per_s_per_gpu']:,.0f}" if p["first"] else "none"
    lines.append(
        f"| {r['anchor']} | {p['layout']} | {rank} ({'yes' if p['in_top_3'] else 'no'}) |"
        f" {p['analytic_tokens_per_s_per_gpu']:,.0f} : {r['predicted_tokens_per_s_per_gpu']:,.0f}"
        f" = {p['analytic_over_compiled']:.2f} ({'yes' if p['within_20_percent'] else 'no'}) |"
        f" {first} |")
  return lines
