"""The run's working directory: usable before anything else happens, held by one trainer at a
time, and its config.json rewritten only when training really continues.

The lock is an exclusive `flock` on WORKDIR/.meshtron.lock (released by the kernel when the
process ends, however it ends), whose text names the holder: host, pid and start time. A second
trainer fails at once naming the holder. A lock file left by a process that is gone is taken over
with a warning. Only process 0 of a multi-process run takes it (the others share the directory).
"""

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import tempfile

from absl import logging

LOCK_NAME = ".meshtron.lock"
# What a run keeps in its workdir: name -> whether it is a directory (trainer/loop.py,
# trainer/metrics.py, write_config below).
RUN_ENTRIES = {"checkpoints": True, "tensorboard": True, "metrics.jsonl": False,
               "loss.png": False, "config.json": False, LOCK_NAME: False,
               # trainer/tracking.py: the tracked runs' ids, MLflow's default store, W&B's files
               "tracking.json": False, "mlflow.db": False, "mlartifacts": True, "wandb": True}


class WorkdirError(ValueError):
  """The workdir cannot be used; the message says why and what to do."""


def check(path: str) -> str:
  """Checks, changing nothing, that `path` is a writable directory or can be created as one
  (its nearest existing ancestor is writable); returns it absolute."""
  path = os.path.abspath(os.path.expanduser(path))
  existing = path
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    what = "is a file" if existing == path else f"lies under the file {existing}"
    raise WorkdirError(f"workdir {path} {what}, not a directory; choose another --workdir")
  try:  # a real write (deleted at once): permissions, read-only mounts and quotas all show
    with tempfile.TemporaryFile(dir=existing):
      pass
  except OSError as e:
    made = "is not writable" if existing == path else f"cannot be created in {existing}"
    raise WorkdirError(f"workdir {path} {made} ({e.strerror}); fix the permissions or choose"
                       " another --workdir") from None
  for name, want_dir in RUN_ENTRIES.items():  # what the run writes: each of its own kind
    entry = os.path.join(path, name)
    if os.path.lexists(entry) and os.path.isdir(entry) != want_dir:
      raise WorkdirError(f"workdir {path}: {name} is a {'file' if want_dir else 'directory'},"
                         f" where the run keeps its {'directory' if want_dir else 'file'};"
                         " move it away or choose another --workdir")
  return path


_created: list[str] = []  # the directories prepare() made, innermost first


def prepare(path: str) -> None:
  """Creates the checked workdir `path` (and its missing parents)."""
  missing, parent = [], os.path.abspath(path)
  while not os.path.exists(parent):
    missing.append(parent)
    parent = os.path.dirname(parent)
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise WorkdirError(f"workdir {path} cannot be created ({e.strerror}); choose another"
                       " --workdir") from None
  _created[:] = missing


def remove_if_unused() -> None:
  """Removes what prepare() made when the run stopped before writing anything there (a Ctrl-C
  during start-up): the directories it created, if they hold nothing but the lock file."""
  for directory in _created:
    try:
      if os.path.exists(lock := os.path.join(directory, LOCK_NAME)) and os.listdir(directory) == [
          LOCK_NAME]:
        os.remove(lock)
      os.rmdir(directory)  # fails, and stops here, when anything else is in it
    except OSError:
      return


def _holder(text: str) -> str:
  try:
    info = json.loads(text)
    return f"pid {info['pid']} on {info['host']} (started {info['started']})"
  except (ValueError, KeyError, TypeError):
    return "another process"


@contextlib.contextmanager
def locked(path: str, enabled: bool = True):
  """Holds the workdir's lock for the block (a no-op when not `enabled`: processes > 0)."""
  if not enabled:
    yield
    return
  lock_path = os.path.join(path, LOCK_NAME)
  fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      if e.errno not in (errno.EAGAIN, errno.EACCES):
        raise
      held_by = _holder(os.pread(fd, 4096, 0).decode(errors="replace"))
      raise WorkdirError(f"workdir {path} is in use by {held_by}; wait for that run to end, or"
                         " use another --workdir") from None
    previous = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    if previous:
      logging.warning("taking over the lock of %s, which is no longer running", _holder(previous))
    me = {"host": socket.gethostname(), "pid": os.getpid(),
          "started": datetime.datetime.now().isoformat(timespec="seconds")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)
    try:
      yield
    finally:
      os.ftruncate(fd, 0)  # released cleanly: nothing to take over
  finally:
    os.close(fd)


def write_config(path: str, config: dict, start: int) -> None:
  """Writes config.json for a run that trains from step `start`: unchanged when the file says the
  same; otherwise the earlier one is kept beside it as config.before-step-<start>.json."""
  target = os.path.join(path, "config.json")
  text = json.dumps(config, indent=2)
  if os.path.exists(target):
    with open(target, encoding="utf-8") as f:
      if f.read() == text:
        return
    os.replace(target, os.path.join(path, f"config.before-step-{start}.json"))
  with open(target, "w", encoding="utf-8") as f:
    f.write(text)
