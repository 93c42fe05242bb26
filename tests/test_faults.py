"""Faults on disk: a full disk at a checkpoint and a read-only workdir. Each runs on a tmpfs the
test mounts (root, as in CI), so the filesystem's own errors are what the trainer meets."""

import os
import shutil
import subprocess

import pytest

from tests.test_checkpoint import committed, tiny_run
from trainer import checkpoint, loop


@pytest.fixture
def tmpfs(tmp_path):
  """mount(size, read_only=False) -> a fresh tmpfs directory, unmounted afterwards."""
  mounted = []

  def mount(size: str, read_only: bool = False):
    path = tmp_path / f"fs{len(mounted)}"
    path.mkdir()
    options = f"size={size}" + (",ro" if read_only else "")
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                            capture_output=True, text=True)
    if result.returncode:
      pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip()}): these fault tests need"
                  " root, as CI has")
    mounted.append(path)
    return path

  yield mount
  for path in mounted:
    subprocess.run(["umount", "-l", str(path)], check=False)


def partial_saves(directory) -> list[str]:
  return [n for n in os.listdir(directory) if ".orbax-checkpoint-tmp" in n]


def full_disk_run(tmpfs):
  """A tiny run saving every 2 steps on a 14 MB tmpfs: the checkpoints of steps 2 and 4 (5.3 MB
  each) fit, step 6's does not."""
  workdir = tmpfs("14m") / "run"
  cfg = tiny_run(steps=8)
  cfg.checkpoint.every_steps = 2
  return cfg, workdir


def test_a_save_the_disk_cannot_hold_is_refused_and_the_last_checkpoint_resumes(tmpfs, tmp_path):
  cfg, workdir = full_disk_run(tmpfs)
  with pytest.raises(checkpoint.CheckpointError) as error:
    loop.run(cfg, str(workdir))
  message = str(error.value)
  assert "\n" not in message and "no room for the checkpoint of step 6" in message
  assert "last committed checkpoint: 4" in message
  assert committed(workdir) == [2, 4] and not partial_saves(workdir / "checkpoints")
  moved = tmp_path / "moved"  # the same run, somewhere with room: it resumes at step 4
  shutil.copytree(workdir, moved)
  loop.run(cfg, str(moved))
  assert committed(moved)[-1] == 8


def test_a_save_that_fills_the_disk_fails_there_and_cleans_up(tmpfs, monkeypatch):
  """The free-space check fooled (another process filling the disk meanwhile): the write itself
  fails with ENOSPC; the run stops with one line right after, the partial save is removed and
  the last committed checkpoint is intact."""
  cfg, workdir = full_disk_run(tmpfs)
  real = shutil.disk_usage
  monkeypatch.setattr(checkpoint.shutil, "disk_usage",
                      lambda path: real(path)._replace(free=10**12))
  with pytest.raises(checkpoint.CheckpointError) as error:
    loop.run(cfg, str(workdir))
  message = str(error.value)
  assert "\n" not in message and "the checkpoint of step 6" in message, message
  assert "the disk is full" in message and "last committed checkpoint is step 4" in message
  assert committed(workdir) == [2, 4] and not partial_saves(workdir / "checkpoints")


def test_a_read_only_workdir_is_one_line_before_anything_runs(tmpfs):
  read_only = tmpfs("1m", read_only=True)
  for workdir in (read_only, read_only / "run"):
    with pytest.raises(ValueError, match=r"workdir .* \(Read-only file system\)"):
      loop.run(tiny_run(), str(workdir))


def test_a_checkpoint_directory_removed_mid_run_is_made_again_and_saved_into(
    tmp_path, monkeypatch, caplog):
  """checkpoints/ deleted by hand after step 4's save (a traceback once): the run warns, makes it
  again, and saves step 8 there; the state in memory was the only copy left."""
  cfg = tiny_run(steps=8)
  cfg.checkpoint.every_steps = 4
  save = checkpoint.Checkpointer.save

  def save_then_remove(self, step, *args, **kwargs):
    save(self, step, *args, **kwargs)
    if step == 4:
      self.wait()
      while os.path.exists(self.directory):  # its checksums may be being written (ENOTEMPTY)
        shutil.rmtree(self.directory, ignore_errors=True)
  monkeypatch.setattr(checkpoint.Checkpointer, "save", save_then_remove)
  with caplog.at_level("WARNING"):
    loop.run(cfg, str(tmp_path))
  assert committed(tmp_path) == [8]
  assert "checkpoints was removed during the run (with the checkpoints of steps 4)" in caplog.text


def test_a_disk_too_small_for_one_checkpoint_is_one_line_before_anything(tmpfs):
  """A 4 MB disk for a run whose state is 5.9 MB: refused before compiling (it was found at
  the first save), the workdir not even made."""
  workdir = tmpfs("4m") / "run"
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"has 4.2 MB free, and one checkpoint of this run needs about 6.2 MB"):
    loop.run(tiny_run(steps=8), str(workdir))
  assert not workdir.exists()


def test_the_free_space_is_read_once_the_save_in_flight_has_committed(tmp_path, monkeypatch):
  """A save still writing when the next one starts has its bytes not yet on the disk: read
  then, the free space counts them as free, and the next save was not refused but failed
  mid-write (the full-disk test above, under load). Each save's room check now follows the
  previous save's end (orbax's save waits for it anyway)."""
  import jax.numpy as jnp
  from trainer.config import CheckpointConfig

  ckpt = checkpoint.Checkpointer(str(tmp_path), CheckpointConfig(async_save=True))
  events = []
  wait, usage = ckpt.manager.wait_until_finished, shutil.disk_usage
  monkeypatch.setattr(ckpt.manager, "wait_until_finished",
                      lambda: (events.append("previous save ended"), wait())[1])
  monkeypatch.setattr(checkpoint.shutil, "disk_usage",
                      lambda path: (events.append("free space read"), usage(path))[1])
  state = {"w": jnp.ones((256, 256))}
  ckpt.save(2, state, {"batch": 2}, {})
  assert events[0] == "free space read"  # nothing in flight before the first (orbax waits after)
  events.clear()
  ckpt.save(4, state, {"batch": 4}, {})
  assert events[:2] == ["previous save ended", "free space read"], events
  ckpt.wait()
  assert sorted(ckpt.manager.all_steps()) == [2, 4]
  ckpt.close()
