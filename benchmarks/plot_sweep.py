"""Draws the sweep of benchmarks/sweep.py the playbook's way: a heatmap of throughput per layout
and (micro-batches, remat), the scaling lines of each strategy over 1-8 devices, and measured
against predicted throughput and memory.

Usage: python -m benchmarks.plot_sweep [--csv benchmarks/results/sweep.csv]
           [--out_dir benchmarks/results]   -> sweep_heatmap.png, sweep_scaling.png
"""

import argparse
import csv
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def read(path: str) -> list[dict]:
  with open(path, newline="", encoding="utf-8") as f:
    return list(csv.DictReader(f))


def num(row: dict, key: str) -> float:
  try:
    return float(row[key])
  except (KeyError, TypeError, ValueError):
    return float("nan")


def spearman(a, b) -> float:
  """Rank correlation (no ties expected in measured throughput)."""
  a, b = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
  return float(np.corrcoef(a, b)[0, 1]) if len(a) > 2 else float("nan")


def heatmap(rows: list[dict], path: str, metric: str = "tokens_per_s") -> None:
  sweep = [r for r in rows if r["kind"] == "sweep"]
  layouts = list(dict.fromkeys(r["layout"] for r in sweep))
  columns = list(dict.fromkeys((r["microbatches"], r["remat"]) for r in sweep))
  grid = np.full((len(layouts), len(columns)), np.nan)
  notes = {}
  for r in sweep:
    i, j = layouts.index(r["layout"]), columns.index((r["microbatches"], r["remat"]))
    if r["status"] == "ok":
      grid[i, j] = num(r, metric)
    else:
      notes[i, j] = r["status"]
  fig, ax = plt.subplots(figsize=(1.6 * len(columns) + 3, 0.42 * len(layouts) + 1.6))
  image = ax.imshow(np.ma.masked_invalid(grid), cmap="viridis", aspect="auto")
  best = np.nanmax(grid) if np.isfinite(grid).any() else np.nan
  for i in range(len(layouts)):
    for j in range(len(columns)):
      if np.isfinite(grid[i, j]):
        ax.text(j, i, f"{grid[i, j]:.0f}", ha="center", va="center", fontsize=8,
                color="k" if grid[i, j] > 0.6 * best else "w",
                fontweight="bold" if grid[i, j] == best else None)
      else:
        ax.text(j, i, notes.get((i, j), ""), ha="center", va="center", fontsize=7, color="0.4")
  ax.set_xticks(range(len(columns)), [f"mb={m}\nremat={r}" for m, r in columns], fontsize=8)
  ax.set_yticks(range(len(layouts)), layouts, fontsize=8)
  label = {"tokens_per_s": "tokens/s", "tokens_per_cpu_s": "tokens per CPU-second"}[metric]
  fig.colorbar(image, ax=ax, label=label)
  ax.set_title(f"meshtron layout sweep on 8 fake CPU devices: {label}\n"
               "(grey: skipped or invalid; see the CSV reason)", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def scaling(rows: list[dict], path: str) -> None:
  fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(14, 4))
  scale = [r for r in rows if r["kind"] == "scaling" and r["status"] == "ok"]
  base = [num(r, "tokens_per_s") for r in scale if int(r["devices"]) == 1]
  for i, axis in enumerate(("data", "fsdp", "tensor")):
    points = sorted((int(r["devices"]), num(r, "tokens_per_s")) for r in scale
                    if int(r[axis]) > 1 and int(r["devices"]) == int(r[axis]))
    points = [(1, base[0])] + points if base else points
    if points:
      ax1.plot(*zip(*points), "o-", color=f"C{i}", label=axis)
  ax1.set_xscale("log", base=2)
  ax1.set_xlabel("devices (fake, sharing the same cores)")
  ax1.set_ylabel("tokens/s")
  ax1.set_title("each strategy alone", fontsize=9)
  ax1.legend(fontsize=8)
  ok = [r for r in rows if r["status"] == "ok" and np.isfinite(num(r, "predicted_tokens_per_s"))]
  for ax, measured, predicted, label in (
      (ax2, "tokens_per_s", "predicted_tokens_per_s", "tokens/s"),
      (ax3, "mem_peak_gib", "predicted_mem_gib", "memory per device (GiB)")):
    x = np.array([num(r, predicted) for r in ok])
    y = np.array([num(r, measured) for r in ok])
    if len(x):
      ax.scatter(x, y, s=14, c=["C0" if r["kind"] == "sweep" else "C3" for r in ok])
      lo, hi = min(x.min(), y.min()), max(x.max(), y.max())
      ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"predicted {label} (sharding/plan/estimate.py, hardware.py)")
    ax.set_ylabel(f"measured {label}")
    ax.set_title(f"{label}: rank correlation {spearman(x, y):.2f}", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main() -> None:
  here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--csv", default=os.path.join(here, "sweep.csv"))
  parser.add_argument("--out_dir", default=here)
  parser.add_argument("--metric", default="tokens_per_cpu_s",
                      choices=("tokens_per_s", "tokens_per_cpu_s"),
                      help="heatmap values (tokens per CPU-second: robust to other load)")
  args = parser.parse_args()
  rows = read(args.csv)
  os.makedirs(args.out_dir, exist_ok=True)
  heatmap(rows, os.path.join(args.out_dir, "sweep_heatmap.png"), args.metric)
  scaling(rows, os.path.join(args.out_dir, "sweep_scaling.png"))
  print(f"wrote {args.out_dir}/sweep_heatmap.png, sweep_scaling.png")


if __name__ == "__main__":
  main()
