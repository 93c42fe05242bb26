"""Checkpoints and faults: exact resume after SIGKILL, interrupted saves, resharding restore,
preemption, the NaN guard, and unusable checkpoints — nothing lost, nothing overwritten."""

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
import types

import jax
import numpy as np
import pytest

from configs import llama
from models.fp8.config import Fp8Config
from sharding import MeshConfig
from trainer import checkpoint, loop, metrics, sample
from trainer.trainer import Trainer

MESHTRON = os.path.join(os.path.dirname(sys.executable), "meshtron")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 12 steps, a checkpoint every 4; steps slow enough (~0.2 s) to signal a run between them.
RUN = ["train", "--config=debug", "--config.steps=12", "--config.checkpoint.every_steps=4",
       "--config.batch_size=32", "--config.seq_len=128", "--config.sample_tokens=0",
       "--config.eval_every=1000", "--cpu_devices=1"]


def command(workdir, *extra):
  return [MESHTRON, *RUN, f"--workdir={workdir}", *extra]


def environment():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  return {**env, "JAX_PLATFORMS": "cpu"}


def train(workdir, *extra, check=True):
  result = subprocess.run(command(workdir, *extra), capture_output=True, text=True,
                          env=environment(), cwd=REPO, timeout=600)
  if check:
    assert result.returncode == 0, result.stderr[-3000:]
  return result


def rows(workdir) -> dict:
  """The last metrics row of each step (a resumed run repeats the steps after its checkpoint)."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r for r in map(json.loads, f)}


def committed(workdir):
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    return []
  return sorted(int(n) for n in os.listdir(directory) if n.isdigit()
                and os.path.exists(os.path.join(directory, n, "commit_success.txt")))


def wait_for(predicate, timeout=300.0, interval=0.002):
  deadline = time.time() + timeout
  while not predicate():
    assert time.time() < deadline, "timed out"
    time.sleep(interval)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("uninterrupted")
  train(workdir)
  return rows(workdir)


def assert_same_steps(workdir, reference, steps):
  got = rows(workdir)
  for step in steps:
    assert got[step]["loss"] == reference[step]["loss"], step  # bitwise (float32 in JSON)
    assert got[step]["data_crc32"] == reference[step]["data_crc32"], step


def test_sigkill_after_a_save_resumes_bitwise(tmp_path, uninterrupted):
  """Killed at a random point after step 8's checkpoint; the rerun continues from step 8 and
  steps 9-12 have the uninterrupted run's losses and batches, bit for bit."""
  proc = subprocess.Popen(command(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          env=environment(), cwd=REPO)
  wait_for(lambda: 8 in committed(tmp_path) or proc.poll() is not None)
  time.sleep(random.uniform(0.0, 0.3))
  proc.send_signal(signal.SIGKILL)
  assert proc.wait() == -signal.SIGKILL, "the run ended before it could be killed"
  assert max(committed(tmp_path)) == 8
  result = train(tmp_path)
  assert "resuming at step 8" in result.stderr
  assert_same_steps(tmp_path, uninterrupted, range(9, 13))


def test_sigkill_during_an_async_save_falls_back_to_the_previous_checkpoint(
    tmp_path, uninterrupted):
  directory = tmp_path / "checkpoints"
  for _ in range(3):  # the save of step 8 lasts tens of ms: retry if the kill came too late
    proc = subprocess.Popen(command(tmp_path), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=environment(), cwd=REPO)
    wait_for(lambda: directory.exists() and any(
        n.startswith("8.orbax-checkpoint-tmp") for n in os.listdir(directory)))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if 8 not in committed(tmp_path):
      break
    subprocess.run(["rm", "-rf", str(tmp_path)], check=True)
  assert max(committed(tmp_path)) == 4  # step 8 never committed
  result = train(tmp_path)
  assert "resuming at step 4" in result.stderr
  assert os.listdir(directory / "partial")  # the interrupted save was set aside, not deleted
  assert_same_steps(tmp_path, uninterrupted, range(5, 13))


# One handler serves every signal: SIGTERM (what schedulers send) runs in the default suite.
@pytest.mark.parametrize("name", ["SIGTERM", pytest.param("SIGINT", marks=pytest.mark.slow),
                                  pytest.param("SIGHUP", marks=pytest.mark.slow)])
def test_sigterm_and_ctrl_c_save_the_current_step_and_exit_zero(tmp_path, uninterrupted, name):
  """A preemption signal (SIGTERM), a Ctrl-C (SIGINT) or a closed terminal (SIGHUP) finishes the
  step, saves it and exits 0; the rerun resumes there bit for bit."""
  proc = subprocess.Popen(command(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=environment(), cwd=REPO)
  metrics = tmp_path / "metrics.jsonl"
  wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 5
           or proc.poll() is not None, interval=0.01)
  proc.send_signal(getattr(signal, name))
  stdout, stderr = proc.communicate(timeout=300)
  assert proc.returncode == 0, stderr[-2000:]
  assert "Traceback" not in stderr
  stopped = max(committed(tmp_path))
  assert f"{name}: checkpoint of step {stopped} saved" in stdout
  assert 5 < stopped < 12 and stopped not in (8,)  # a step that was not a checkpoint step
  result = train(tmp_path)
  assert f"resuming at step {stopped}" in result.stderr
  assert_same_steps(tmp_path, uninterrupted, range(stopped + 1, 13))


def tiny_run(**overrides):
  cfg = llama.debug()
  cfg.mesh = MeshConfig(data=1, fsdp=4, tensor=2)
  cfg.model.num_layers, cfg.model.num_kv_heads, cfg.batch_size, cfg.seq_len = 2, 4, 8, 32
  cfg.steps, cfg.checkpoint.every_steps, cfg.sample_tokens, cfg.eval_every = 8, 4, 0, 1000
  for key, value in overrides.items():
    setattr(cfg, key, value)
  return cfg


def test_nan_stop_exits_without_a_new_checkpoint(tmp_path):
  with pytest.raises(loop.TrainingError, match="non-finite or spiking loss at step 6"):
    loop.run(tiny_run(inject_nan_at_step=6), str(tmp_path))
  assert committed(tmp_path) == [4]
  assert rows(tmp_path)[6]["skipped"] == 1.0


def test_nan_skip_skips_exactly_that_step(tmp_path):
  loop.run(tiny_run(inject_nan_at_step=6, nan_policy="skip"), str(tmp_path))
  skipped = {step: row["skipped"] for step, row in rows(tmp_path).items()}
  assert skipped == {s: float(s == 6) for s in range(1, 9)}
  trainer = Trainer(tiny_run())
  state, _, _ = checkpoint.Checkpointer(str(tmp_path / "checkpoints"), trainer.cfg.checkpoint) \
      .restore(8, _target(trainer), trainer.iterator("train"), vars(trainer.cfg.model))
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))
  assert int(state.step) == 8
  # Adam counts applied updates: 8 steps, one skipped.
  assert int(jax.tree.leaves(state.opt_state)[0]) == 7


def _target(trainer):
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      trainer.abstract_state, trainer.shardings)


def test_restore_into_other_layouts_and_device_counts(tmp_path):
  """Saved under fsdp=4 x tensor=2; restored under data=8, fsdp=2 x tensor=4 and 4 devices:
  identical parameters; training continued under data=8 matches the original layout."""
  source = tmp_path / "source"
  loop.run(tiny_run(steps=6, checkpoint=_every(3)), str(source))
  original = rows(source)
  params = {}
  for name, mesh, devices in [("data=8", MeshConfig(data=8), None),
                              ("fsdp=2,tensor=4", MeshConfig(data=1, fsdp=2, tensor=4), None),
                              ("4 devices", MeshConfig(data=1, fsdp=2, tensor=2),
                               jax.devices()[:4])]:
    cfg = tiny_run(mesh=mesh)
    trainer = Trainer(cfg, devices)
    state, _, _ = checkpoint.Checkpointer(str(source / "checkpoints"), cfg.checkpoint).restore(
        3, _target(trainer), trainer.iterator("train"), vars(cfg.model))
    assert jax.tree.leaves(state.params)[0].sharding.mesh.devices.size == len(
        devices or jax.devices())
    params[name] = [np.asarray(p) for p in jax.tree.leaves(state.params)]
  for a, b, c in zip(*params.values()):
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)
  resumed = tmp_path / "resumed"
  cfg = tiny_run(steps=6, mesh=MeshConfig(data=8), checkpoint=_every(3))
  cfg.checkpoint.restore_from = str(source / "checkpoints" / "3")
  loop.run(cfg, str(resumed))
  for step in (4, 5, 6):
    assert rows(resumed)[step]["data_crc32"] == original[step]["data_crc32"]
    np.testing.assert_allclose(rows(resumed)[step]["loss"], original[step]["loss"], rtol=1e-5)


def _every(n):
  from trainer.config import CheckpointConfig
  return CheckpointConfig(every_steps=n)


def test_unusable_checkpoints_are_one_line_errors_and_left_untouched(tmp_path):
  loop.run(tiny_run(steps=4), str(tmp_path))
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"does not fit this model: model.num_layers=2 \(checkpoint\) vs 3"):
    cfg = tiny_run(steps=8)
    cfg.model.num_layers = 3
    loop.run(cfg, str(tmp_path))
  state_dir = tmp_path / "checkpoints" / "4" / "state"
  victim = max((p for p in state_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
  victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
  size = victim.stat().st_size
  with pytest.raises(checkpoint.ChecksumError, match="checkpoints/4 fails its checksums: state/"):
    loop.run(tiny_run(steps=8), str(tmp_path))
  (tmp_path / "checkpoints" / "4" / "checksums.json").unlink()  # unverified: orbax's own error
  with pytest.raises(checkpoint.CheckpointError, match="checkpoints/4 could not be restored"):
    loop.run(tiny_run(steps=8), str(tmp_path))
  assert victim.stat().st_size == size and committed(tmp_path) == [4]  # nothing overwritten
  with pytest.raises(ValueError, match="restore_from=.*nowhere.* is not a directory"):
    cfg = tiny_run()
    cfg.checkpoint.restore_from = str(tmp_path / "nowhere")
    loop.run(cfg, str(tmp_path / "fresh"))


def _file_hashes(directory) -> dict:
  import hashlib
  return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(directory.rglob("*")) if p.is_file()}


def test_checksums_catch_a_checkpoint_altered_in_place_and_fall_back_only_when_asked(tmp_path):
  """Each committed checkpoint gets a SHA-256 of every file. One bit flipped in the newest: the
  resume stops in one line naming the checkpoint and the file, changing nothing on disk; with
  fallback_on_corruption it is moved to corrupt/ and the run resumes from the one before,
  redoing the lost steps exactly."""
  loop.run(tiny_run(steps=8), str(tmp_path))
  checkpoints = tmp_path / "checkpoints"
  for step in (4, 8):
    listed = json.loads((checkpoints / str(step) / "checksums.json").read_text())["files"]
    on_disk = {str(p.relative_to(checkpoints / str(step))) for p in
               (checkpoints / str(step)).rglob("*") if p.is_file()} - {"checksums.json"}
    assert set(listed) == on_disk and any(name.startswith("state/") for name in listed)
  first_run = rows(tmp_path)
  victim = max((p for p in (checkpoints / "8" / "state").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)
  altered = bytearray(victim.read_bytes())
  altered[len(altered) // 2] ^= 1  # one bit, same size
  victim.write_bytes(bytes(altered))
  snapshot = _file_hashes(checkpoints)
  name = str(victim.relative_to(checkpoints / "8"))
  with pytest.raises(checkpoint.ChecksumError, match=(
      rf"checkpoints/8 fails its checksums: {name} has changed since it was written; it is left"
      r" untouched: set --config.checkpoint.fallback_on_corruption=true")):
    loop.run(tiny_run(steps=8), str(tmp_path))
  assert _file_hashes(checkpoints) == snapshot and committed(tmp_path) == [4, 8]
  cfg = tiny_run(steps=8)
  cfg.checkpoint.fallback_on_corruption = True
  loop.run(cfg, str(tmp_path))
  assert [p.name.split(".")[0] for p in (checkpoints / "corrupt").iterdir()] == ["8"]
  assert committed(tmp_path) == [4, 8]
  assert checkpoint.checksums.verify(str(checkpoints / "8")) is None  # the new step 8 passes
  again = rows(tmp_path)
  assert [again[s]["loss"] for s in range(5, 9)] == [first_run[s]["loss"] for s in range(5, 9)]


def test_a_checkpoint_the_run_cannot_read_is_refused_before_compiling(tmp_path, monkeypatch):
  """A resume whose model shapes or optimizer differ from the checkpoint's metadata ends in one
  line before the step compiles (a compile of a real model takes minutes)."""
  loop.run(tiny_run(steps=4), str(tmp_path))
  monkeypatch.setattr(Trainer, "compile", lambda self: pytest.fail("compiled before the check"))
  cfg = tiny_run(steps=8)
  cfg.model.num_layers = 3
  with pytest.raises(checkpoint.CheckpointError, match=r"model.num_layers=2 \(checkpoint\) vs 3"):
    loop.run(cfg, str(tmp_path))
  cfg = tiny_run(steps=8)
  cfg.optim = dataclasses.replace(cfg.optim, name="muon")
  with pytest.raises(checkpoint.CheckpointError,
                     match="holds the state of optim.name='adamw', this run has 'muon'"):
    loop.run(cfg, str(tmp_path))
  assert committed(tmp_path) == [4]


def test_keeps_the_last_k_and_every_mth(tmp_path):
  cfg = tiny_run(steps=12)
  cfg.checkpoint.every_steps, cfg.checkpoint.keep, cfg.checkpoint.keep_every = 2, 2, 4
  loop.run(cfg, str(tmp_path))
  assert committed(tmp_path) == [4, 8, 10, 12]  # the last 2, plus multiples of 4


def test_switching_the_fp8_recipe_on_resume(tmp_path):
  """The current-scaling recipes keep no state, so a run switches among them on resume; delayed
  scaling's amax histories are parameters, so a switch to or from it is refused in one line
  that names the checkpoint's settings, the checkpoint left untouched."""
  def fp8_run(recipe, steps):
    cfg = tiny_run(steps=steps, checkpoint=_every(2))
    cfg.compute = dataclasses.replace(cfg.compute, fp8=Fp8Config(enabled=True, recipe=recipe))
    return cfg
  loop.run(fp8_run("tensorwise", 2), str(tmp_path))
  files = {p: p.stat().st_mtime_ns for p in (tmp_path / "checkpoints").rglob("*")}
  with pytest.raises(checkpoint.CheckpointError, match=r"holds no fp8 amax histories, this"
                     r" run's compute.fp8 wants delayed-scaling amax histories of 16 steps.*"
                     r"--config.compute.fp8.recipe=tensorwise"):
    loop.run(fp8_run("delayed", 4), str(tmp_path))
  assert {p: p.stat().st_mtime_ns for p in (tmp_path / "checkpoints").rglob("*")} == files
  loop.run(fp8_run("rowwise", 4), str(tmp_path))
  assert committed(tmp_path) == [2, 4] and sorted(rows(tmp_path)) == [1, 2, 3, 4]


def test_eval_and_sampling_stop_between_batches_and_chunks():
  """Issue [27]: long loops honour a pending stop. Eval asks before each batch after the first
  and gives up (None, no eval loss); sampling asks between compiled chunks of tokens and returns
  what it made. The tokens do not depend on the chunk size."""
  trainer = Trainer(tiny_run(eval_batches=6))
  trainer.init_state()
  asked = []
  assert trainer.evaluate(lambda: asked.append(1) or len(asked) == 2) is None
  assert len(asked) == 2  # before batches 2 and 3: two batches ran
  assert np.isfinite(trainer.evaluate())
  args = (trainer.unsharded_graphdef(), trainer.model_params(), [1, 2, 3], 10)
  whole = sample.generate(*args, window=32, temperature=1.0, seed=3)
  assert len(whole) == 10
  np.testing.assert_array_equal(sample.generate(*args, window=32, temperature=1.0, seed=3,
                                                chunk=3), whole)
  cut = sample.generate(*args, window=32, temperature=1.0, seed=3, chunk=4,
                        should_stop=lambda: True)
  np.testing.assert_array_equal(cut, whole[:4])  # the first chunk, then the stop


@pytest.mark.slow
def test_sigterm_while_sampling_ends_the_sample_and_exits_zero(tmp_path):
  """A 10-million-token sample after the last step: SIGTERM stops it at the next chunk; the
  run exits 0 with the final checkpoint and the tokens made so far in sample.txt."""
  proc = subprocess.Popen(command(tmp_path, "--config.sample_tokens=10000000"),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=environment(), cwd=REPO)
  wait_for(lambda: (tmp_path / "loss.png").exists() or proc.poll() is not None, interval=0.05)
  time.sleep(2)  # into the sampling loop
  proc.send_signal(signal.SIGTERM)
  stdout, stderr = proc.communicate(timeout=120)
  assert proc.returncode == 0, stderr[-2000:]
  assert "Traceback" not in stderr
  assert "SIGTERM: sampling stopped after" in stdout and committed(tmp_path)[-1] == 12
  assert (tmp_path / "sample.txt").read_text()


def test_evals_and_saves_are_off_the_step_clock(tmp_path, monkeypatch):
  """A step's time (and its tokens/s and MFU) is its own: an eval or a checkpoint save, which
  here moves the metrics' clock on by 1000 s (no sleeping, no timing), is not counted in it.
  Before, the eval's step and the step after a save took that 1000 s."""
  slowed, offset = [], [0.0]
  monkeypatch.setattr(metrics, "time", types.SimpleNamespace(
      perf_counter=lambda: time.perf_counter() + offset[0]))

  def slower(method):
    def run(self, *args, **kwargs):
      slowed.append(method.__name__)
      offset[0] += 1000
      return method(self, *args, **kwargs)
    return run
  monkeypatch.setattr(Trainer, "evaluate", slower(Trainer.evaluate))
  monkeypatch.setattr(checkpoint.Checkpointer, "save", slower(checkpoint.Checkpointer.save))
  cfg = tiny_run(steps=6, eval_every=2)
  cfg.checkpoint.every_steps = 3
  loop.run(cfg, str(tmp_path))
  assert slowed == ["evaluate", "save", "evaluate", "evaluate", "save"]
  times = {step: row["step_time_s"] for step, row in rows(tmp_path).items()}
  assert all(times[step] < 1000 for step in range(1, 7)), times
