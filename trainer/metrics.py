"""Metric writers (stdout progress, JSONL, TensorBoard), model FLOPs, peak FLOP/s and MFU."""

import contextlib
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from sharding.plan import hardware

def measure_matmul_flops(dtype: str = "float32", size: int = 1024, repeats: int = 5) -> float:
  """Best-of-`repeats` FLOP/s of a square matmul on the first device (the machine's ceiling)."""
  a = jnp.ones((size, size), dtype)
  matmul = jax.jit(lambda x: x @ x)
  matmul(a).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2.0 * size ** 3 / best


def peak_flops(dtype: str) -> tuple[float, str]:
  """(peak FLOP/s of the whole machine, where the number came from) for the MFU denominator.

  GPUs: the data-sheet dense bf16 peak per device (sharding/plan/profiles.py, the one home of GPU
  figures) times the device count. CPU: one measured matmul, since fake CPU devices share the
  same cores.
  """
  kind = jax.devices()[0].device_kind
  profile = hardware.profile_of_device(kind)
  if profile is not None:
    return (profile.peak_bf16_flops * jax.device_count(),
            f"{profile.name} data sheet x {jax.device_count()}")
  return measure_matmul_flops(dtype), f"measured {dtype} matmul on {kind}"


class MetricsWriter:
  """Appends one JSON object per step to metrics.jsonl and mirrors its numbers to TensorBoard and
  the tracked runs (trainer/tracking.py; opened and closed by the caller).

  Only the writing process (process 0) writes; others get a writer that does nothing.
  """

  def __init__(self, workdir: str, enabled: bool = True, tracked=None):
    self.enabled = enabled
    self.tracked = tracked
    self._jsonl = None
    self._tb = None
    if enabled:
      os.makedirs(workdir, exist_ok=True)
      self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", encoding="utf-8")
      from tensorboardX import SummaryWriter  # imported here: only process 0 needs it
      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, values: dict) -> None:
    if not self.enabled:
      return
    row = {"step": step, **{k: _plain(v) for k, v in values.items()}}
    self._jsonl.write(json.dumps(row) + "\n")
    self._jsonl.flush()
    scalars = {k: v for k, v in row.items()
               if k != "step" and isinstance(v, (int, float))}
    for key, value in scalars.items():
      self._tb.add_scalar(key, value, step)
    if self.tracked is not None:
      self.tracked.log(step, scalars)

  def close(self) -> None:
    if self.enabled:
      self._jsonl.close()
      self._tb.close()


def _plain(value):
  value = np.asarray(value)
  return value.item() if value.ndim == 0 else value.tolist()


class Progress:
  """Reads each step's metrics (one step late, so dispatch stays asynchronous), adds timing,
  throughput and MFU, writes them, and drives the progress bar and the periodic log lines."""

  def __init__(self, workdir: str, *, steps: int, start: int, tokens_per_step: int,
               flops_per_step: float, peak_flops: float, log_every: int, enabled: bool,
               tracked=None):
    self.steps, self.tokens, self.log_every = steps, tokens_per_step, log_every
    self.flops_per_step, self.peak = flops_per_step, peak_flops
    self.enabled = enabled
    self.writer = MetricsWriter(workdir, enabled=enabled, tracked=tracked)
    # The live bar only on a terminal; logs (CI, files) get the periodic step lines alone.
    self.bar = tqdm(total=steps, initial=start, dynamic_ncols=True, mininterval=1.0,
                    disable=not (enabled and sys.stderr.isatty()))
    self.last_done = time.perf_counter()
    self.last: dict = {}

  def report(self, step: int, device_metrics: dict, extra: dict | None = None) -> dict:
    values = jax.device_get(device_metrics)  # blocks until that step has finished
    now = time.perf_counter()
    step_time, self.last_done = now - self.last_done, now
    values = {k: float(v) for k, v in values.items()}
    values.update(step_time_s=step_time, tokens_per_s=self.tokens / step_time,
                  mfu=self.flops_per_step / step_time / self.peak, **(extra or {}))
    self.writer.write(step, values)
    self.bar.update(1)
    self.bar.set_postfix(loss=f"{values['loss']:.3f}", tok_s=f"{values['tokens_per_s']:.0f}",
                         mfu=f"{values['mfu']:.1%}", refresh=False)
    if self.enabled and (step % self.log_every == 0 or step == self.steps
                         or "eval_loss" in values):
      tqdm.write(" ".join([f"step {step}/{self.steps}"] + [
          f"{k} {values[k]:.4g}" for k in ("loss", "mtp_loss", "eval_loss", "grad_norm",
                                           "learning_rate", "tokens_per_s", "mfu")
          if k in values]))
    self.last = values
    return values

  @contextlib.contextmanager
  def off_the_clock(self, running=None):
    """Time in the block (an eval, a checkpoint save) is not counted in any step's time, once
    `running` (the metrics of a step still on the device) are ready: that step's own time is."""
    if running is not None:
      jax.block_until_ready(running)
    start = time.perf_counter()
    try:
      yield
    finally:
      self.last_done += time.perf_counter() - start

  def close(self) -> None:
    self.bar.close()
    self.writer.close()
