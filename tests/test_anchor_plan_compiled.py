"""`make anchor-plans`' verdict and candidates (benchmarks/anchor_plan_compiled.py): how `plan`'s
top 3 are judged against an anchor's own program, and how a candidate is compiled."""

from benchmarks import anchor_plan_compiled
from benchmarks.anchor_recipes import ANCHORS
from sharding.layout import Layout
from sharding.xla.compiled import CompiledReport


def test_the_compiled_top_3_check_needs_the_anchors_layout_or_a_faster_fitting_program():
  """The issue's "the anchor's layout, or one faster by the compiled-program prediction": a
  faster program over the 76 GiB line, or a slower one, does not count."""
  def row(rank, *candidates):
    return {"rank": rank, "anchor_predicted_tokens_per_s_per_gpu": 100.0, "candidates": [
        {"layout": f"l{i}", "status": "compiled", "predicted_tokens_per_s_per_gpu": speed,
         "fits_76gib": fits} for i, (speed, fits) in enumerate(candidates)]}
  verdict = anchor_plan_compiled.verdict
  assert verdict(row(2))["top_3_holds"] and not verdict(row(4))["top_3_holds"]
  assert verdict(row(None, (99.0, True), (150.0, False)))["top_3_holds"] is False
  assert verdict(row(None, (99.0, True), (100.0, True), (120.0, True))) == {
      "top_3_holds": True, "fastest_faster": "l2"}


def test_a_candidate_whose_layers_apart_do_not_fit_is_compiled_with_them_stacked(monkeypatch):
  """A row that stores its layers apart compiles `plan`'s candidates so; one whose program then
  peaks over 76 GiB is compiled again with its layers stacked, and judged by that program, with
  the apart peak kept; a stacked row's candidates compile once."""
  calls = []

  def fake_compile(cfg, target, timeout):
    calls.append(cfg.compute.scan_layers)
    peak = (60 if cfg.compute.scan_layers else 90) * 2**30
    return CompiledReport(target.name, target.num_devices, "gpu", {"peak": peak}, None, [], {},
                          True, step_time={"tokens_per_s_per_gpu": 5000.0, "mfu": 0.1})

  monkeypatch.setattr(anchor_plan_compiled, "compile_for_gpus", fake_compile)
  apart = next(a for a in ANCHORS if a.name == "Megatron-Bridge Llama-3-8B FP8, FSDP 8")
  assert dict(apart.compute)["scan_layers"] is False
  layout = Layout(fsdp=8, microbatches=16)
  entry = anchor_plan_compiled.compile_candidate(apart, layout)
  assert calls == [False, True]
  assert entry["fits_76gib"] and entry["compiled_peak_gib"] == 60
  assert entry["layers"] == "stacked: apart, its program peaked at 90.0 GiB"
  calls.clear()
  stacked = next(a for a in ANCHORS if a.name == "torchtitan Llama-3.1-8B, FSDP 8")
  assert "scan_layers" not in dict(stacked.compute)
  assert anchor_plan_compiled.compile_candidate(stacked, layout)["compiled_peak_gib"] == 60
  assert calls == [True]
