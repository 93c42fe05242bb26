"""Writes the results section of docs/results.md from benchmarks/results/ (the last step of
`make bench`).

Reads peak.jsonl, train_step.jsonl, compile_scaling.jsonl, compare_summary.jsonl,
moe_vs_dense.jsonl and overlap.jsonl (whichever exist) and prints Markdown; with --doc FILE it
replaces the text between the `<!-- results:begin -->` and `<!-- results:end -->` markers of FILE.
Numbers are medians over the rounds of one `make bench` run; "other cores" is the CPU that other
processes used during the timed steps (2 cores: anything well above 0 means they competed).

  python -m benchmarks.report [--results benchmarks/results] [--doc docs/results.md]
"""

import argparse
import collections
import json
import os
import statistics

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def rows(results: str, name: str) -> list[dict]:
  path = os.path.join(results, name)
  if not os.path.exists(path):
    return []
  return [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]


def peak_section(peak: list[dict]) -> list[str]:
  best = {}
  for r in peak:
    if r["benchmark"] == "matmul_peak":
      best[r["dtype"]] = max(best.get(r["dtype"], 0.0), r["gflops"])
    elif r["benchmark"] == "copy_bandwidth":
      best["copy"] = max(best.get("copy", 0.0), r["gbytes_per_s"])
  if not best:
    return []
  return [f"Measured peak of this machine (benchmarks/peak.py, best size): fp32 matmul"
          f" **{best.get('float32', 0):.0f} GFLOP/s**, bf16 matmul {best.get('bfloat16', 0):.0f}"
          f" GFLOP/s, copy {best.get('copy', 0):.1f} GB/s. MFU below = model FLOPs/s ÷ the fp32"
          " matmul peak.", ""]


def throughput_section(steps: list[dict]) -> list[str]:
  groups = collections.defaultdict(list)
  for r in steps:
    if r.get("steps_timed"):
      groups[(r["model"], r["layout"])].append(r)
  if not groups:
    return []
  out = ["| model | params | layout | tokens/s | MFU | step s | peak GiB/device | other cores |",
         "| --- | --- | --- | --- | --- | --- | --- | --- |"]
  single = {}
  for (model, layout), runs in groups.items():
    tps = statistics.median(r["tokens_per_s"] for r in runs)
    if layout == "single":
      single[model] = tps
    out.append(f"| {model} | {runs[0]['params_m']:.0f}M | {layout} | {tps:.0f} |"
               f" {statistics.median(r['mfu'] for r in runs):.1%} |"
               f" {statistics.median(r['step_s'] for r in runs):.2f} |"
               f" {runs[0]['memory_gib_per_device']['peak']:.2f} |"
               f" {statistics.median(r.get('other_cores', float('nan')) for r in runs):.2f} |")
  out.append("")
  if "100m" in single:
    mfu = statistics.median(r["mfu"] for r in groups[("100m", "single")])
    out.append(f"- 100m on one device: **{mfu:.0%} MFU** of the measured fp32 matmul peak"
               f" (target ≥ 60%: {'met' if mfu >= 0.6 else 'not met'}).")
  for model, base in single.items():
    fsdp = groups.get((model, "fsdp=8"))
    if fsdp:
      ratio = statistics.median(r["tokens_per_s"] for r in fsdp) / base
      out.append(f"- {model}: fsdp=8 on 8 fake devices runs at **{ratio:.2f}×** the single-device"
                 " throughput on the same cores (target ≥ 0.8).")
  return out + [""]


def compile_section(scaling: list[dict]) -> list[str]:
  by_layers = collections.defaultdict(list)
  for r in scaling:
    by_layers[r["dims"]["num_layers"]].append(r["compile_s"])
  if len(by_layers) < 2:
    return []
  few, many = min(by_layers), max(by_layers)
  a, b = statistics.median(by_layers[few]), statistics.median(by_layers[many])
  return [f"- Compile time, {many} vs {few} layers of the 100M model (scanned layers):"
          f" {b:.1f} s vs {a:.1f} s = **{b / a:.2f}×** (target ≤ 1.5×).", ""]


def compare_section(summary: list[dict]) -> list[str]:
  """bf16 (what GPUs train in) as the headline, float32 beside it, one row per configuration."""
  if not summary:
    return []
  by = {(r["model"], r["layout"], r["remat"], r.get("dtype", "float32")): r for r in summary}
  configs = list(dict.fromkeys(key[:3] for key in by))
  out = ["meshtron vs MaxText (benchmarks/compare.py: same dims, batch, sequence, remat, dtype,"
         " AdamW, synthetic data; runs alternate). MFU: model FLOPs over the measured matmul peak"
         " of the dtype (benchmarks/peak.py):", "",
         "| model | layout | remat | bf16: meshtron tokens/s | MaxText tokens/s | **ratio** |"
         " MFU meshtron / MaxText | rounds | float32 ratio (rounds) |",
         "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for config in configs:
    bf16, fp32 = by.get((*config, "bfloat16")), by.get((*config, "float32"))
    cells = ["–"] * 5
    if bf16 and bf16.get("ratio_meshtron_over_maxtext"):
      cells = [f"{bf16['meshtron_median']:.0f}", f"{bf16['maxtext_median']:.0f}",
               f"**{bf16['ratio_meshtron_over_maxtext']:.2f}**",
               f"{_pct(bf16.get('meshtron_mfu'))} / {_pct(bf16.get('maxtext_mfu'))}",
               f"{min(len(bf16['meshtron_tokens_per_s']), len(bf16['maxtext_tokens_per_s']))}"]
    old = "–" if not fp32 or not fp32.get("ratio_meshtron_over_maxtext") else (
        f"{fp32['ratio_meshtron_over_maxtext']:.2f} ({len(fp32['meshtron_tokens_per_s'])})")
    out.append(f"| {' | '.join(config)} | {' | '.join(cells)} | {old} |")
  return out + [""]


def _pct(value) -> str:
  return "–" if value is None else f"{value:.0%}"


def moe_section(moe: list[dict]) -> list[str]:
  if not moe:
    return []
  out = ["Tiny MoE vs the dense model of the same active parameters (benchmarks/moe_vs_dense.py,"
         " the Python standard library sources, same data, seed, batch and steps):", "",
         "| model | params | active | steps | train NLL (last 20) | eval loss | step s |",
         "| --- | --- | --- | --- | --- | --- | --- |"]
  for r in moe:
    name = "dense" if r["variant"] == "dense" else f"MoE 8×top-2, {r['variant']}"
    out.append(f"| {name} | {r['params'] / 1e6:.2f}M | {r['active_params'] / 1e6:.2f}M |"
               f" {r['steps']} | {r['train_nll_last20']:.3f} | {r['eval_loss']:.3f} |"
               f" {r['step_s_median']:.3f} |")
  return out + [""]


def overlap_section(overlap: list[dict]) -> list[str]:
  layouts = [r for r in overlap if "layout" in r]
  if not layouts:
    return []
  out = ["Overlap in the compiled 8.86B programs (benchmarks/overlap.py, deviceless H100"
         " compiles, bf16, seq 4096; compiled-program facts, not wall time):", "",
         "| target | layout | remat | preset | collective GiB | hidden | behind a matmul |"
         " exposed GiB | loop all-gathers prefetched | peak GiB |",
         "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in layouts:
    out.append(f"| {r['target']} | {r['layout']} | {r['remat']} | `{r['preset']}` |"
               f" {r['wire_gib']:.1f} | {r['hidden_fraction']:.0%} |"
               f" {r['behind_matmul_fraction']:.0%} | {r['exposed_gib']:.2f} |"
               f" {r['loop_all_gathers_prefetched']} | {r['peak_gib']:.1f} |")
  blocks = [r for r in overlap if "block" in r]
  if blocks:
    out += ["", "One sequence-parallel MLP block (D=4096, F=14336, 4096 tokens) on tensor=8:", "",
            "| pass | matmuls | collectives | hidden | behind a matmul | exposed MiB |",
            "| --- | --- | --- | --- | --- | --- |"]
    for r in blocks:
      kinds = ", ".join(f"{n} {k}" for k, n in sorted(r["collectives"].items()))
      out.append(f"| {r['pass']} | {r['matmuls']} | {kinds} | {r['hidden_fraction']:.0%} |"
                 f" {r['behind_matmul_fraction']:.0%} | {r['exposed_mib']:.0f} |")
  return out + [""]


def render(results: str) -> str:
  lines = (peak_section(rows(results, "peak.jsonl"))
           + throughput_section(rows(results, "train_step.jsonl"))
           + compile_section(rows(results, "compile_scaling.jsonl"))
           + compare_section(rows(results, "compare_summary.jsonl"))
           + moe_section(rows(results, "moe_vs_dense.jsonl"))
           + overlap_section(rows(results, "overlap.jsonl")))
  return "\n".join(lines).rstrip() + "\n"


def replace_section(path: str, begin: str, end: str, text: str) -> None:
  """Replaces the text between the `begin` and `end` marker lines of a Markdown file."""
  doc = open(path, encoding="utf-8").read()
  if begin not in doc or end not in doc:
    raise SystemExit(f"{path} has no {begin} ... {end} markers to replace")
  head, rest = doc.split(begin, 1)
  tail = rest.split(end, 1)[1]
  with open(path, "w", encoding="utf-8") as f:
    f.write(f"{head}{begin}\n{text}{end}{tail}")


def section_main(doc: str, render_fn, results: str, begin: str, end: str, name: str) -> None:
  """The command line of a generated-section writer (the sections live in docs/): prints the
  section rendered from --results, or with --doc FILE writes it between the markers `begin` and
  `end` of FILE."""
  parser = argparse.ArgumentParser(description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--results", default=results)
  parser.add_argument("--doc", default="", help="the Markdown file holding the section")
  args = parser.parse_args()
  text = render_fn(args.results)
  if not args.doc:
    print(text, end="")
    return
  replace_section(args.doc, begin, end, text)
  print(f"wrote the {name} section of {args.doc}")


def main() -> None:
  section_main(__doc__, render, os.path.join(os.path.dirname(__file__), "results"), BEGIN, END,
               "results")


if __name__ == "__main__":
  main()
