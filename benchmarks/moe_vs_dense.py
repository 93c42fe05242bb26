"""Trains the tiny MoE and the dense model of the same active parameters on the real corpus.

Same data (the Python standard library sources, byte tokens), seed, batch, steps and optimizer;
the dense model is the `debug` Llama (MLP 384), the MoE `debug_moe` (8 experts of 192, top-2:
the same active parameters per token + a 128 x 8 router per layer). Prints one JSON line per
model: final train loss (mean next-token NLL over the last 20 steps), held-out eval loss,
parameter counts, median step time and, for the MoE, the routing metrics of the last step.

Usage:
  python -m benchmarks.moe_vs_dense [--steps=300] [--variants=dense,dropless,dropping]
      [--batch=32 --seq=128] [--workdir=/tmp/moe_vs_dense]
"""

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import sys

VARIANTS = ("dense", "dropless", "dropping")


def make_config(variant: str, *, steps: int, batch: int, seq: int):
  from configs import llama, moe
  cfg = llama.debug() if variant == "dense" else moe.debug_moe()
  if variant == "dropping":
    cfg.model.moe = dataclasses.replace(cfg.model.moe, dispatch="dropping")
  cfg.steps, cfg.batch_size, cfg.seq_len = steps, batch, seq
  cfg.eval_every, cfg.eval_batches, cfg.log_every = steps, 8, max(steps // 10, 1)
  cfg.sample_tokens, cfg.compilation_cache_dir = 0, ""
  cfg.checkpoint.every_steps, cfg.checkpoint.async_save = steps, False
  return cfg


def run(variant: str, workdir: str, **kw) -> dict:
  from trainer import loop
  cfg = make_config(variant, **kw)
  shutil.rmtree(workdir, ignore_errors=True)
  with contextlib.redirect_stdout(sys.stderr):  # the progress lines; stdout is JSON only
    last = loop.run(cfg, workdir)
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  tail = rows[-20:]
  out = {"benchmark": "moe_vs_dense", "variant": variant, "steps": cfg.steps,
         "tokens_per_step": cfg.batch_size * cfg.seq_len,
         "params": cfg.model.num_params(), "active_params": cfg.model.active_params(),
         "train_nll_last20": round(statistics.fmean(r["nll"] for r in tail), 4),
         "eval_loss": round(last["eval_loss"], 4),
         "step_s_median": round(statistics.median(r["step_time_s"] for r in rows[1:]), 4)}
  if cfg.model.moe is not None:
    out["moe"] = cfg.model.moe.dispatch
    out.update({k: round(v, 4) for k, v in last.items() if k.startswith("moe_")})
  return out


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--seq", type=int, default=128)
  parser.add_argument("--variants", default="dense,dropless")
  parser.add_argument("--workdir", default="/tmp/moe_vs_dense")
  args = parser.parse_args(argv)
  variants = [v.strip() for v in args.variants.split(",") if v.strip()]
  unknown = set(variants) - set(VARIANTS)
  if unknown:
    sys.exit(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from trainer.process import host_memory
  if argv is None:
    host_memory.reexec_with_tunables()  # the trainer's malloc settings (trainer/process/)
  for variant in variants:
    print(json.dumps(run(variant, os.path.join(args.workdir, variant), steps=args.steps,
                         batch=args.batch, seq=args.seq)), flush=True)


if __name__ == "__main__":
  main()
