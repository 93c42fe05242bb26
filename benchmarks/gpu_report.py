"""Writes the "GPU results" section of docs/gpu-check.md from benchmarks/results/gpu/ (what `make gpu-check`
wrote on a GPU machine and a session committed): the device, versions and date; the gpu tests
with their measured errors; the measured peak; the attention kernels; the train step with its
MFU and memory; the targets of the GPU issue, met or not.

Rehearsal lines (gpu_check.py --rehearse: the CPU) are never reported as GPU results.

  python -m benchmarks.gpu_report [--results benchmarks/results/gpu] [--doc docs/gpu-check.md]
"""

import collections
import os
import re

from benchmarks.report import rows, section_main

BEGIN, END = "<!-- gpu-results:begin -->", "<!-- gpu-results:end -->"
PHASES = ("smoke", "tests", "kernels", "train", "fp8", "moe", "predict")
NO_RUN = ("No GPU run yet: no session so far had a GPU machine at hand. `make gpu-check` on one"
          " writes benchmarks/results/gpu/ and this section (docs/gpu-check.md).")


def gpu_rows(results: str) -> dict[str, list[dict]]:
  """Each phase's lines, without rehearsal lines."""
  return {phase: [r for r in rows(results, f"{phase}.jsonl") if not r.get("rehearsal")]
          for phase in PHASES}


def header(phases: dict[str, list[dict]]) -> list[str]:
  out = []
  for phase, lines in phases.items():
    if lines and "gpu" in lines[0]:  # predict lines are written here, not on the GPU
      r = lines[0]
      plugin = ", ".join(f"{k} {v}" for k, v in sorted(r.get("cuda_plugin", {}).items()))
      out.append(f"- `{phase}`: {r['gpu']} ({r.get('gpu_memory') or '?'}), driver"
                 f" {r.get('driver') or '?'}, jax {r['jax']} / jaxlib {r['jaxlib']}"
                 f"{f' ({plugin})' if plugin else ''}, Python {r['python']}, commit"
                 f" `{r['commit'][:10]}`, {r['date']}.")
  return out + [""] if out else []


def tests_section(lines: list[dict]) -> list[str]:
  """The gpu tests, one row each; the counts summed over the pytest runs whose lines these are (a
  later run may take the tests a cut-short one did not reach)."""
  tests = [r for r in lines if "test" in r]
  summaries = [r for r in lines if "summary" in r]
  if not tests:
    return []
  out = ["| gpu test | outcome | s | measured |", "| --- | --- | --- | --- |"]
  for r in tests:
    measured = ", ".join(f"{k} {_short(v)}" for k, v in r.get("properties", {}).items()
                         if k.startswith(("rel_error", "max_", "f8_", "cublaslt")))
    detail = measured or (r["message"][:120] if r["outcome"] != "passed" else "")
    seconds = "–" if r.get("seconds") is None else f"{r['seconds']:.1f}"
    out.append(f"| `{r['test'].split('::')[-1]}` | {r['outcome']} | {seconds} | {detail} |")
  if summaries:
    total = {k: sum(r[k] for r in summaries) for k in ("passed", "failed", "error", "skipped")}
    runs = f" over {len(summaries)} pytest runs" if len(summaries) > 1 else ""
    cut = any(r.get("note") for r in tests)
    out += ["", f"pytest -m gpu{runs}: {total['passed']} passed, {total['failed']} failed,"
                f" {total['error']} errors, {total['skipped']} skipped"
                + (" (a phase's budget cut pytest short: its rows are the tests that ended)."
                   if cut else ".")]
  return out + [""]


def smoke_section(lines: list[dict]) -> list[str]:
  checks = [r for r in lines if "check" in r]
  if not checks:
    return []
  return ["Smoke: " + "; ".join(
      f"{r['check']} {r['status']}" + (f" ({r['error'][:160]})" if r.get("error") else "")
      for r in checks) + ".", ""]


def _short(value) -> str:
  try:
    return f"{float(value):.3g}"
  except (TypeError, ValueError):
    return str(value)[:40]


def peak_line(lines: list[dict]) -> list[str]:
  best = {}
  for r in lines:
    if r.get("benchmark") == "matmul_peak":
      key = f"{r['dtype']} ({r['precision']})"
      best[key] = max(best.get(key, 0.0), r["tflops"])
    elif r.get("benchmark") == "copy_bandwidth":
      best["copy"] = r["tbytes_per_s"]
  if not best:
    return []
  matmuls = ", ".join(f"{k} {v:.0f} TFLOP/s" for k, v in best.items() if k != "copy")
  return [f"Measured peak (8192³ matmuls of random data; a 4 GiB in-place copy): {matmuls};"
          f" copy {best.get('copy', 0):.2f} TB/s (read + write).", ""]


def attention_section(lines: list[dict]) -> list[str]:
  runs = [r for r in lines if r.get("benchmark") == "attention"]
  if not runs:
    return []
  cell = collections.defaultdict(dict)
  for r in runs:
    value = f"{r['ms']:.2f} ms, {r['tflops']:.0f} TF/s" if r.get("status") == "ok" \
        else r.get("status", "?")
    cell[(r["seq"], r["pass"])][r["impl"]] = (value, r.get("ms"))
  impls = sorted({r["impl"] for r in runs})
  out = [f"Attention, causal bf16, batch 1, {runs[0]['heads']} heads / {runs[0]['kv_heads']} kv"
         f" heads of {runs[0]['head_dim']} (forward 2·B·H·L²·d FLOPs; forward+backward 3.5×):",
         "",
         "| seq | pass | " + " | ".join(impls) + " | pallas_flash / cudnn |",
         "| --- | --- | " + " | ".join("---" for _ in impls) + " | --- |"]
  for (seq, name), by_impl in sorted(cell.items()):
    flash, cudnn = by_impl.get("pallas_flash", (0, None))[1], by_impl.get("cudnn", (0, None))[1]
    ratio = f"{flash / cudnn:.2f}×" if flash and cudnn else "–"
    out.append(f"| {seq} | {name} | " + " | ".join(by_impl.get(i, ("–",))[0] for i in impls)
               + f" | {ratio} |")
  at_8k = cell.get((8192, "forward+backward"), {})
  flash_8k, cudnn_8k = (at_8k.get(impl, (0, None))[1] for impl in ("pallas_flash", "cudnn"))
  if flash_8k and cudnn_8k:
    ratio = flash_8k / cudnn_8k
    out += ["", f"- pallas_flash forward+backward at seq 8k: **{ratio:.2f}×** cuDNN's time"
                f" (target ≤ 1.3×: {'met' if ratio <= 1.3 else 'not met'})."]
  norms = {r["impl"]: r for r in lines if r.get("benchmark") == "rmsnorm_residual"
           and r.get("status") == "ok"}
  if "xla_fusion" in norms and "jax_triton" in norms:
    x, t = norms["xla_fusion"], norms["jax_triton"]
    out.append(f"- Residual add + RMSNorm, {x['rows']}×{x['dim']} bf16: jax-triton {t['ms']:.3f}"
               f" ms ({t['tbytes_per_s']:.2f} TB/s) vs XLA's fusion {x['ms']:.3f} ms"
               f" ({x['tbytes_per_s']:.2f} TB/s).")
  return out + [""]


def train_section(lines: list[dict]) -> list[str]:
  runs = [r for r in lines if r.get("benchmark") == "train_step"]
  if not runs:
    return []
  out = ["Train step, Llama-3-8B dimensions truncated to 8 layers (2.8B parameters with the"
         " 128k vocabulary), seq 4096, bf16 compute, fp32 AdamW state, one GPU:", "",
         "| attention | remat | batch | tokens/s | MFU (data sheet) | MFU (measured peak) |"
         " step s | predicted s | predicted / measured | compiled peak GiB |"
         " measured peak GiB |",
         "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  ok = [r for r in runs if r.get("status") == "ok"]
  for r in runs:
    if r.get("status") != "ok":
      out.append(f"| {r['attention']} | {r['remat']} | {r.get('status')} | | | | | | | | |")
      continue
    predicted = r.get("predicted_step_s")
    out.append(f"| {r['attention']} | {r['remat']} | {r['batch']} | {r['tokens_per_s']:.0f} |"
               f" {_pct(r['mfu_vs_spec'])} | {_pct(r['mfu_vs_measured_peak'])} |"
               f" {r['step_s']:.3f} | {f'{predicted:.3f}' if predicted else '–'} |"
               f" {r.get('predicted_over_measured') or '–'} | {r['compiled_peak_gib']:.1f} |"
               f" {r['measured_peak_gib']:.1f} |")
  if ok:
    best = max(ok, key=lambda r: r["mfu_vs_spec"] or 0)
    worst_memory = max(ok, key=lambda r: abs((r["measured_over_compiled"] or 0) - 1))
    out += ["", f"- Best MFU {_pct(best['mfu_vs_spec'])} of the data sheet"
                f" ({best['attention']}, remat {best['remat']}; target ≥ 55%:"
                f" {'met' if (best['mfu_vs_spec'] or 0) >= 0.55 else 'not met'}).",
            f"- Measured peak memory / compiled memory analysis: worst"
            f" {worst_memory['measured_over_compiled']:.2f} (target within 10%:"
            f" {'met' if abs(worst_memory['measured_over_compiled'] - 1) <= 0.1 else 'not met'})."]
    ratios = [r["predicted_over_measured"] for r in ok if r.get("predicted_over_measured")]
    if ratios:
      worst = max(ratios, key=lambda x: abs(x - 1))
      out.append(f"- Step predicted from the program compiled on this GPU / measured: "
                 f"{', '.join(f'{x:.2f}' for x in ratios)} (target within ±15% on every"
                 f" configuration: {'met' if abs(worst - 1) <= 0.15 else 'not met'}).")
  for r in ok:
    if r.get("trace_ops", {}) and r["trace_ops"].get("ms_per_step"):
      t = r["trace_ops"]
      top = "; ".join(f"`{name[:60]}` {ms:.0f}" for name, ms in
                      list(t["ms_per_step"].items())[:8])
      out.append(f"- Trace of {r['attention']} / remat {r['remat']} (two steps after the timed"
                 f" ones): GPU busy {t['total_ms_per_step']:.0f} ms of the {r['step_s'] * 1e3:.0f}"
                 f" ms step; top kernels, ms per step: {top}.")
  return out + [""]


def fp8_section(lines: list[dict]) -> list[str]:
  """The fp8 phase: the same step (remat full) in bf16 and fp8, autotuned or cuBLASLt GEMMs."""
  runs = [r for r in lines if r.get("benchmark") == "train_step"]
  if not runs:
    return []
  out = ["fp8, the same step with remat full (tokens/s; GEMMs: XLA's autotuned choice, or"
         " cuBLASLt with Triton GEMMs off):", "",
         "| fp8 | GEMMs | batch | tokens/s | vs bf16 | step s | measured peak GiB |",
         "| --- | --- | --- | --- | --- | --- | --- |"]
  bf16 = {r.get("xla_options", ""): r["tokens_per_s"] for r in runs
          if r.get("fp8") == "none" and r.get("status") == "ok"}
  for r in runs:
    gemms = "cuBLASLt" if "triton_gemm=false" in r.get("xla_options", "") else "autotuned"
    if r.get("status") != "ok":
      out.append(f"| {r.get('fp8')} | {gemms} | {r.get('status')} | | | | |")
      continue
    base = bf16.get(r.get("xla_options", ""))
    ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "–"
    out.append(f"| {r['fp8']} | {gemms} | {r['batch']} | {r['tokens_per_s']:.0f} | {ratio} |"
               f" {r['step_s']:.3f} | {r['measured_peak_gib']:.1f} |")
  return out + [""]


def moe_section(lines: list[dict]) -> list[str]:
  """The moe phase: MoE presets cut to a few layers and experts, bf16, remat selective."""
  runs = [r for r in lines if r.get("benchmark") == "train_step"]
  if not runs:
    return []
  out = ["MoE train steps, bf16, seq 4096, remat selective, one GPU (MFU on active parameters):",
         "", "| model | cut | batch | tokens/s | MFU (data sheet) | step s | compiled peak GiB |"
         " measured peak GiB |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in runs:
    if r.get("status") != "ok":
      kernel = r.get("grouped_matmul", "auto")
      what = r.get("cut") or f"{r.get('dispatch')}{'' if kernel == 'auto' else f', {kernel}'}"
      out.append(f"| {r.get('model')} | {what} | {r.get('status')}: {error_gist(r)} |"
                 " | | | | |")
      continue
    out.append(f"| {r['model']} | {r['cut']} | {r['batch']} | {r['tokens_per_s']:.0f} |"
               f" {_pct(r['mfu_vs_spec'])} | {r['step_s']:.3f} | {r['compiled_peak_gib']:.1f} |"
               f" {r['measured_peak_gib']:.1f} |")
  return out + [""]


def error_gist(r: dict) -> str:
  """A failed run's error in a table cell: the exception's line, and the allocation an out of
  memory asked for."""
  text = r.get("error") or r.get("reason") or ""
  raised = [l.strip() for l in text.splitlines() if re.match(r"\s*[\w.]+(Error|Exception):", l)]
  memory = re.search(r"Out of memory while trying to allocate [\d.]+\s*\w+", text)
  gist = "; ".join(([raised[-1][:110]] if raised else []) + ([memory.group(0)] if memory else []))
  return gist.replace("|", "/") or "see the phase's lines"


def predict_section(lines: list[dict]) -> list[str]:
  """benchmarks/gpu_predict.py: the programs compiled on the GPU, predicted here again."""
  if not lines:
    return []
  out = ["Predicted from the program XLA compiled on the GPU (benchmarks/gpu_predict.py; the"
         " GPU's built-in profile, nothing fitted), against the measured step; seconds per step"
         " by kind, predicted now / traced on the GPU where a trace was taken:", "",
         "| run | measured s | predicted at the visit | predicted now | gemm | attention |"
         " memory |", "| --- | --- | --- | --- | --- | --- | --- |"]
  for r in lines:
    kinds, traced = r["predicted_by_kind_s"], r.get("traced_by_kind_s") or {}
    cell = lambda k: f"{kinds.get(k, 0):.3f}" + (f" / {traced[k]:.3f}" if k in traced else "")
    out.append(f"| {run_label(r)} | {r['measured_step_s']:.3f} |"
               f" {r['predicted_at_visit_s']:.3f} ({r['at_visit_over_measured']:.2f}×) |"
               f" {r['predicted_now_s']:.3f} ({r['now_over_measured']:.2f}×) | {cell('gemm')} |"
               f" {cell('attention')} | {cell('memory')} |")
  # The target is the train phase's (issue [24]); the fp8 and moe runs are reported beside it.
  out.append("")
  for phases, what in ((("train",), "train-phase runs (target within ±15%"),
                       (("fp8", "moe"), "fp8 and moe runs (no target")):
    ratios = [r["now_over_measured"] for r in lines if r.get("phase", "train") in phases]
    if ratios:
      worst = max(ratios, key=lambda x: abs(x - 1))
      met = "" if phases != ("train",) else f": {'met' if abs(worst - 1) <= 0.15 else 'not met'}"
      out.append(f"- Worst predicted / measured now over the {what}{met}): {worst:.2f}.")
  return out + [""]


def run_label(r: dict) -> str:
  """A predict line's run: its phase and the settings that tell it apart."""
  phase = r.get("phase", "train")
  if phase == "fp8":
    return f"fp8 {r['fp8']}, {r['remat']}" + (", Triton GEMMs off" if r["xla_options"] else "")
  if phase == "moe":
    return f"moe {r['model']} {r['dispatch']}"
  return f"{r['attention']}, {r['remat']}"


def _pct(value) -> str:
  return "–" if value is None else f"{value:.1%}"


def render(results: str) -> str:
  phases = gpu_rows(results)
  if not any(phases.values()):
    return NO_RUN + "\n"
  lines = (header(phases) + smoke_section(phases["smoke"]) + tests_section(phases["tests"])
           + peak_line(phases["kernels"])
           + attention_section(phases["kernels"]) + train_section(phases["train"])
           + fp8_section(phases["fp8"]) + moe_section(phases["moe"])
           + predict_section(phases["predict"]))
  return "\n".join(lines).rstrip() + "\n"


def main() -> None:
  section_main(__doc__, render, os.path.join(os.path.dirname(__file__), "results", "gpu"), BEGIN,
               END, "GPU results")


if __name__ == "__main__":
  main()
