"""The `predict` phase, scored here without a GPU: the step predicted from each train-phase
program as XLA compiled it on the GPU itself (same jax), beside the step measured there.

Reads a GPU visit's train lines (train.jsonl: each carries the prediction made there, by the
predictor of that commit) and its artifacts.tgz (benchmarks/gpu_visit.sh: every run's compiled
program `<attention>-<remat>.hlo.txt.gz`, and a `jax.profiler` trace of the first run). Writes one
line per configuration to predict.jsonl: measured, predicted at the visit, predicted now (this
checkout's sharding/xla/step_time.py, the GPU profile unchanged), and the prediction's seconds by
kind (gemm, attention, memory) beside the traced kernels' seconds by the same kinds.

  python -m benchmarks.gpu_predict --visit benchmarks/results/gpu/visits/2026-11-26b \
      [--out benchmarks/results/gpu/predict.jsonl]
"""

import argparse
import collections
import gzip
import io
import json
import os
import re
import tarfile
import tempfile

# Kernel names in a GPU trace by kind: cuBLAS (nvjet), XLA's Triton GEMM fusions, cuDNN attention
# and the Triton flash kernels; the rest moves memory (fusions, copies).
KINDS = (("attention", re.compile(r"sdpa|fmha|flash|attention", re.I)),
         ("gemm", re.compile(r"nvjet|gemm|cutlass|sm90_xmma|matmul|wgmma", re.I)))


def kernel_kind(name: str) -> str:
  return next((kind for kind, pattern in KINDS if pattern.search(name)), "memory")


def traced_kinds(ms_per_step: dict) -> dict:
  out = collections.Counter()
  for name, ms in ms_per_step.items():
    out[kernel_kind(name)] += ms / 1e3
  return {k: round(v, 4) for k, v in out.items()}


def trace_seconds_by_kind(tar: tarfile.TarFile, member_prefix: str) -> dict:
  """Seconds per step by kind of every GPU op in the trace (gpu_train.gpu_op_ms)."""
  from benchmarks import gpu_train
  members = [m for m in tar.getmembers()
             if m.name.startswith(member_prefix) and m.name.endswith(".xplane.pb")]
  if not members:
    return {}
  with tempfile.NamedTemporaryFile(suffix=".xplane.pb") as f:
    f.write(tar.extractfile(members[0]).read())
    f.flush()
    return traced_kinds(gpu_train.gpu_op_ms(f.name)[0])


def predict_rows(visit: str) -> list[dict]:
  from benchmarks import gpu_check
  from sharding.plan import hardware
  from sharding.xla import step_time
  train = [json.loads(line) for line in open(os.path.join(visit, "train.jsonl"))
           if line.strip()]
  tar = tarfile.open(os.path.join(visit, "artifacts.tgz"))
  names = {os.path.basename(m.name): m for m in tar.getmembers()}
  out = []
  for run in train:
    if run.get("status") != "ok":
      continue
    # The train phase's runs (gpu_check.train_runs): attention x remat.
    key = gpu_check.artifact_name({"attention": run["attention"], "remat": run["remat"]})
    member = names.get(f"{key}.hlo.txt.gz")
    if member is None:
      continue
    text = gzip.open(io.BytesIO(tar.extractfile(member).read()), "rt").read()
    profile = hardware.profile_of_device(run["device"])
    now = step_time.predict(text, profile, top=10**6)
    kinds = collections.Counter()
    for op in now.top_ops:
      kinds[op["kind"]] += op["total_s"]
    traced = trace_seconds_by_kind(tar, f"./trace-{key}") or None
    out.append({
        "benchmark": "predict", "attention": run["attention"], "remat": run["remat"],
        "batch": run["batch"], "device": run["device"], "profile": profile.name,
        "measured_step_s": run["step_s"], "predicted_at_visit_s": run.get("predicted_step_s"),
        "predicted_now_s": round(now.step_s, 5),
        "at_visit_over_measured": run.get("predicted_over_measured"),
        "now_over_measured": round(now.step_s / run["step_s"], 3),
        "predicted_by_kind_s": {k: round(v, 4) for k, v in kinds.items()},
        "traced_by_kind_s": traced, "visit_commit": run["commit"], "jax": run["jax"]})
  return out


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--visit", required=True, help="a folder with train.jsonl, artifacts.tgz")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "gpu",
                                                    "predict.jsonl"))
  args = parser.parse_args(argv)
  rows = predict_rows(args.visit)
  with open(args.out, "w", encoding="utf-8") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")
      print(json.dumps(row))


if __name__ == "__main__":
  main()
