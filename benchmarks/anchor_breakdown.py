"""Where an anchor's predicted step goes: one anchor of benchmarks/anchor_recipes.py compiled
deviceless for its cluster, as `make anchors` compiles it, and its step-time prediction
(sharding/xla/step_time.py) summed over every instruction, not only the anchors table's top five.

One JSON line for the step: seconds per kind of kernel (gemm, attention, memory, each collective
kind). Then one line per group of memory-bound kernels, groups with the same fusion kind, pass
(forward, or backward: under a `transpose` in JAX's op name) and the JAX primitive XLA named it
after, costliest first. The anchors' memory-bound kernels are the part of the step that a faster
matmul or attention kernel does not touch. Nothing here is fitted; it reads the same prediction.

  .venv/bin/python -m benchmarks.anchor_breakdown --anchor "NeMo Llama-3.1-8B, TP1 CP2"
      [--groups 20] [--hlo FILE]
"""

import argparse
import collections
import json
import re
import sys
import tempfile

from benchmarks.anchor_plan_compiled import TIMEOUT_S
from benchmarks.anchor_recipes import ANCHORS, config
from sharding.plan.profiles import profile_of_device
from sharding.xla import compiled, hlo, step_time
from trainer.aot import compile_for_gpus

def memory_groups(hlo_text: str, ops: list) -> list:
  """Memory-bound kernels grouped by (fusion kind, pass, JAX primitive), costliest first."""
  op_names = hlo.op_names(hlo_text)
  seconds, launches = collections.Counter(), collections.Counter()
  for op in ops:
    if op["kind"] != "memory":
      continue
    jax_name = op_names.get(op["name"], "")
    fusion = re.sub(r"^(loop|input)_|[.\d]+$", "", op["name"])
    key = (fusion, "backward" if "transpose" in jax_name else "forward",
           jax_name.split("/")[-1] or "?")
    seconds[key] += op["total_s"]
    launches[key] += op["count"]
  return [{"fusion": k[0], "pass": k[1], "primitive": k[2], "seconds": s,
           "launches": launches[k]} for k, s in seconds.most_common()]


def breakdown(name: str, hlo_path: str, groups: int) -> list:
  anchor = next((a for a in ANCHORS if a.name == name), None)
  if anchor is None:
    sys.exit(f"no anchor named {name!r}; the names are benchmarks/anchor_recipes.py's")
  target = compiled.parse_gpu_target(anchor.target)
  rep = compile_for_gpus(config(anchor), target, hlo_path=hlo_path, timeout=TIMEOUT_S)
  with open(hlo_path) as f:
    text = f.read()
  profile = profile_of_device(target.gpu)
  prediction = step_time.predict(text, profile, target.devices_per_host, top=10 ** 9)
  kinds = collections.Counter()
  for op in prediction.top_ops:
    kinds[op["kind"]] += op["total_s"]
  st = rep.step_time
  head = {"anchor": name, "predicted_step_s": st["step_s"],
          "tokens_per_s_per_gpu": st["tokens_per_s_per_gpu"],
          "published_tokens_per_s_per_gpu": anchor.published,
          "kernels_s": st["compute_s"], "exposed_communication_s": st["exposed_communication_s"],
          "seconds_by_kind": dict(kinds.most_common()),
          "compiled_peak_gib": rep.memory["peak"] / 2 ** 30,
          "xla_rematerialization": rep.extra.get("xla rematerialization", "")}
  return [head] + memory_groups(text, prediction.top_ops)[:groups]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--anchor", required=True, help="an anchor's name, as in the table")
  parser.add_argument("--groups", type=int, default=20, help="memory-bound groups to print")
  parser.add_argument("--hlo", default="", help="also keep the compiled program's text here")
  args = parser.parse_args()
  with tempfile.NamedTemporaryFile(suffix=".hlo") as tmp:
    for line in breakdown(args.anchor, args.hlo or tmp.name, args.groups):
      print(json.dumps(line), flush=True)


if __name__ == "__main__":
  main()
