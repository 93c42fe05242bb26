"""On an NVIDIA GPU (`make gpu-check`): the train step equals the CPU step, fp8 runs real fp8
GEMMs and tracks bf16, and a run resumes bit for bit from its checkpoint.
tests/conftest.py says how these run elsewhere."""

import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from sharding import MeshConfig
from tests import parallel_harness as harness
from tests import training_runs
from tests.test_fp8 import dot_operand_types
from tests.test_parallel import GRAD_RTOL, LOSS_RTOL, UPDATE_RTOL, relative_l2
from trainer.trainer import Trainer

pytestmark = pytest.mark.gpu
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_step_on_the_gpu_equals_the_cpu_step(gpu, record_property):
  """The tiny Llama's real train step (packed batches, GQA, AdamW) for 3 steps on the GPU and on
  the CPU, float32 at `highest` matmul precision (the GPU's default fp32 matmul is TF32): the
  tolerances of tests/test_parallel.py (loss and gradients 1e-5 relative, updates 1e-2)."""
  with jax.default_matmul_precision("highest"):
    on_gpu = harness.run(MeshConfig(data=1), devices=[gpu.device])
    on_cpu = harness.run(MeshConfig(data=1), devices=jax.devices("cpu")[:1])
  record_property("losses", on_gpu.losses)
  np.testing.assert_allclose(on_gpu.losses, on_cpu.losses, rtol=LOSS_RTOL)
  grad_errors = [relative_l2(a, b) for a, b in zip(on_gpu.grads, on_cpu.grads)]
  record_property("max_grad_rel_error", max(grad_errors))
  assert max(grad_errors) <= GRAD_RTOL, grad_errors
  for got, want, start in zip(on_gpu.params, on_cpu.params, on_cpu.initial_params):
    assert relative_l2(got - start, want - start) <= UPDATE_RTOL


def test_fp8_step_runs_fp8_gemms_and_tracks_bf16(gpu, record_property):
  """The bf16 step with fp8 projections, compiled for this GPU, keeps its projection dots on f8
  operands (cuBLASLt f8 calls or f8 GEMM fusions; XLA:CPU widens them instead), and its loss
  stays within 3% of bf16's in every 10-step window (the CPU test's criterion), both runs with
  deterministic reductions so that each is one reproducible function."""
  steps = gpu.pick(100, 20)
  cfg = training_runs.config(steps, dtype="bfloat16", fp8=True)
  trainer = Trainer(cfg, [gpu.device])
  with trainer.scope():
    text = trainer.train_step.lower(trainer.abstract_state,
                                    trainer.abstract_batch()).compile().as_text()
  f8_dots = [t for t in dot_operand_types(text) if t and all(x.startswith("f8") for x in t)]
  cublas_f8 = re.findall(r"__cublas\$lt\$matmul\$f8", text)
  record_property("f8_dots", len(f8_dots))
  record_property("cublaslt_f8_calls", len(cublas_f8))
  if gpu.rehearsal:  # XLA:CPU runs the dots on widened values; the casts to fp8 stay
    assert "f8e4m3fn[" in text and "f8e5m2[" in text
  else:  # forward, dx and dw of the 7 projections of the scanned layer body
    assert len(f8_dots) + len(cublas_f8) >= 3 * 7, (len(f8_dots), len(cublas_f8))

  # Deterministic GPU reductions: by default two runs of one program drift apart (on the lent
  # H200, 2026-11-28, bf16 against bf16 up to 0.14% and fp8 against fp8 up to 0.99% in a window;
  # fp8 against bf16 0.015-0.030 over five runs), so the criterion judged the noise, not fp8.
  exact = "xla_gpu_deterministic_ops=true"
  bf16 = training_runs.losses(steps, dtype="bfloat16", xla_options=exact)
  fp8 = training_runs.losses(steps, dtype="bfloat16", fp8=True, xla_options=exact)
  record_property("bf16_losses", bf16)
  record_property("fp8_losses", fp8)
  assert fp8 != bf16  # really a different computation
  assert all(np.isfinite(fp8))
  gaps = [abs(training_runs.mean(fp8, i, i + 10) / training_runs.mean(bf16, i, i + 10) - 1)
          for i in range(0, steps, 10)]
  record_property("max_window_gap", max(gaps))
  assert max(gaps) <= 0.03, gaps


# 12 steps of the debug preset, a checkpoint every 4 steps.
RUN = ["train", "--config=debug", "--config.steps=12", "--config.checkpoint.every_steps=4",
       "--config.batch_size=32", "--config.seq_len=128", "--config.sample_tokens=0",
       "--config.eval_every=1000"]


def train(gpu, workdir, *extra):
  """The `meshtron` CLI in a fresh process on this machine's default device. On the GPU with
  XLA's deterministic ops: bit-exact resume needs the same reductions in the same order."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  if not gpu.rehearsal:
    env["XLA_FLAGS"] = "--xla_gpu_deterministic_ops=true"
  command = [sys.executable, "-c", "from cli.main import main; main()",
             *RUN, f"--workdir={workdir}", *extra]
  return subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)


def losses_by_step(workdir) -> dict:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: (r["loss"], r["data_crc32"]) for r in map(json.loads, f)}


def test_checkpoint_resume_is_bitwise_on_the_gpu(gpu, tmp_path, record_property):
  """A run stopped at step 10 (an injected NaN loss: it exits keeping the checkpoint of step 8)
  resumes from step 8, and steps 9-12 repeat the uninterrupted run's losses and batches bit
  for bit."""
  whole = train(gpu, tmp_path / "whole")
  assert whole.returncode == 0, whole.stderr[-3000:]
  platform = "cpu" if gpu.rehearsal else "gpu"
  assert f"over 1 {platform} devices" in whole.stderr, whole.stderr[-2000:]
  stopped = train(gpu, tmp_path / "resumed", "--config.inject_nan_at_step=10")
  assert stopped.returncode != 0 and "non-finite" in (stopped.stderr + stopped.stdout), \
      stopped.stderr[-2000:]
  resumed = train(gpu, tmp_path / "resumed")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "resuming at step 8" in resumed.stderr
  want, got = losses_by_step(tmp_path / "whole"), losses_by_step(tmp_path / "resumed")
  record_property("losses", [want[s][0] for s in range(1, 13)])
  for step in range(9, 13):
    assert got[step] == want[step], step
