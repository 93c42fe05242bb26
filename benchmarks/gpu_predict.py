"""The `predict` phase, scored here without a GPU: the step predicted from each train, fp8 and
moe program as XLA compiled it on the GPU itself (same jax), beside the step measured there.

Reads a GPU visit's lines (train/fp8/moe.jsonl: each carries the prediction made there, by the
predictor of that commit) and its artifacts.tgz (benchmarks/gpu_visit.sh: every run's compiled
program `<settings>.hlo.txt.gz`, and a `jax.profiler` trace of each phase's first run). Writes one
line per configuration to predict.jsonl: measured, predicted at the visit, predicted now (this
checkout's sharding/xla/step_time.py, the GPU profile unchanged), and the prediction's seconds by
kind (gemm, attention, memory) beside the traced kernels' seconds by the same kinds.

  python -m benchmarks.gpu_predict --visit benchmarks/results/gpu/visits/2026-11-26{e,d} \
      benchmarks/results/gpu/visits/2026-11-27{a,c} benchmarks/results/gpu/visits/2026-11-28a \
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


VISITS = os.path.join(os.path.dirname(__file__), "results", "gpu", "visits")


def visit_artifacts(visit: str) -> tarfile.TarFile:
  """The artifacts.tgz of a committed GPU visit (its folder name under results/gpu/visits)."""
  return tarfile.open(os.path.join(VISITS, visit, "artifacts.tgz"))


def run_program(tar: tarfile.TarFile, run: str) -> str:
  """The compiled program (HLO text) of one of a visit's runs, by its artifact name."""
  return gzip.decompress(tar.extractfile(f"./{run}.hlo.txt.gz").read()).decode()


def trace_ms_per_step(tar: tarfile.TarFile, member_prefix: str) -> dict:
  """Milliseconds per step of each GPU op in the tarred trace (gpu_train.gpu_op_ms); {} if none."""
  from benchmarks import gpu_train
  members = [m for m in tar.getmembers()
             if m.name.startswith(member_prefix) and m.name.endswith(".xplane.pb")]
  if not members:
    return {}
  with tempfile.NamedTemporaryFile(suffix=".xplane.pb") as f:
    f.write(tar.extractfile(members[0]).read())
    f.flush()
    return gpu_train.gpu_op_ms(f.name)[0]


def trace_seconds_by_kind(tar: tarfile.TarFile, member_prefix: str) -> dict:
  """Seconds per step by kind of every GPU op in the trace."""
  ms_per_step = trace_ms_per_step(tar, member_prefix)
  return traced_kinds(ms_per_step) if ms_per_step else {}


def run_settings(phase: str, row: dict) -> dict:
  """The gpu_check run (gpu_check.train_runs) that measured `row`: its artifacts' name."""
  settings = {"attention": row["attention"], "remat": row["remat"]}
  if phase == "fp8":
    settings.update(fp8=row["fp8"], xla_options=row["xla_options"])
  if phase == "moe":
    settings.update(model=row["model"].removesuffix("_dims"), layers=row["layers"],
                    experts=row["experts"], dispatch=row["dispatch"])
    if row.get("grouped_matmul", "auto") != "auto":
      settings["grouped_matmul"] = row["grouped_matmul"]
  return settings


def predict_rows(visit: str) -> list[dict]:
  """One line per measured run of the visit's train, fp8 and moe phases whose compiled program
  is in its artifacts.tgz."""
  from benchmarks import gpu_check
  from sharding.plan import hardware
  from sharding.xla import step_time
  tar = tarfile.open(os.path.join(visit, "artifacts.tgz"))
  names = {os.path.basename(m.name): m for m in tar.getmembers()}
  out = []
  for phase in ("train", "fp8", "moe"):
    path = os.path.join(visit, f"{phase}.jsonl")
    runs = [json.loads(line) for line in open(path) if line.strip()] if os.path.exists(path) else []
    for run in runs:
      settings = run_settings(phase, run) if run.get("status") == "ok" else None
      key = settings and gpu_check.artifact_name(settings)
      member = names.get(f"{key}.hlo.txt.gz")
      if member is None:
        continue
      text = gzip.open(io.BytesIO(tar.extractfile(member).read()), "rt").read()
      profile = hardware.profile_of_device(run["device"])
      now = step_time.predict(text, profile, top=10**6)
      kinds = collections.Counter()
      for op in now.top_ops:
        kinds[op["kind"]] += op["total_s"]
      traced = trace_seconds_by_kind(tar, f"./trace-{key}/") or None
      out.append({
          "benchmark": "predict", "phase": phase, "run": key, **settings, "batch": run["batch"],
          "device": run["device"], "profile": profile.name, "measured_step_s": run["step_s"],
          "predicted_at_visit_s": run.get("predicted_step_s"),
          "predicted_now_s": round(now.step_s, 5),
          "at_visit_over_measured": run.get("predicted_over_measured"),
          "now_over_measured": round(now.step_s / run["step_s"], 3),
          "predicted_by_kind_s": {k: round(v, 4) for k, v in kinds.items()},
          "traced_by_kind_s": traced, "visit_commit": run["commit"], "jax": run["jax"]})
  return out


def latest_per_run(rows: list[dict]) -> list[dict]:
  """One line per run (phase and settings): a run measured again in a later visit (visits in the
  order given) keeps that visit's line, in the place of its first."""
  latest = {}
  for row in rows:
    latest[(row["phase"], row["run"])] = row  # an existing key keeps its place in a dict
  return list(latest.values())


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--visit", required=True, nargs="+",
                      help="folders, each with artifacts.tgz and train/fp8/moe.jsonl")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "gpu",
                                                    "predict.jsonl"))
  args = parser.parse_args(argv)
  rows = latest_per_run([row for visit in args.visit for row in predict_rows(visit)])
  with open(args.out, "w", encoding="utf-8") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")
      print(json.dumps(row))


if __name__ == "__main__":
  main()
