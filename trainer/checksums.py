"""Checkpoint integrity: a SHA-256 of every file of a committed checkpoint, written beside its
files (`<step>/checksums.json`) once the save has committed, and compared before a restore
reads them. Orbax checks a checkpoint's structure, not its bytes: a file altered in place (a
flipped bit on the storage, a partial copy) would otherwise restore without a word."""

import hashlib
import json
import os

NAME = "checksums.json"
_BLOCK = 1 << 22  # bytes read at a time


def _digest(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(_BLOCK):
      h.update(block)
  return h.hexdigest()


def _files(step_dir: str) -> list[str]:
  """Every file of the checkpoint, as sorted paths relative to it (the checksums excluded)."""
  found = []
  for root, _, names in os.walk(step_dir):
    for name in names:
      relative = os.path.relpath(os.path.join(root, name), step_dir)
      if relative not in (NAME, NAME + ".partial"):
        found.append(relative)
  return sorted(found)


def write(step_dir: str) -> None:
  """Hashes the committed checkpoint `step_dir` and writes its checksums (atomically: a reader
  sees all of them or none)."""
  sums = {name: _digest(os.path.join(step_dir, name)) for name in _files(step_dir)}
  partial = os.path.join(step_dir, NAME + ".partial")
  with open(partial, "w") as f:
    json.dump({"algorithm": "sha256", "files": sums}, f, indent=1)
  os.replace(partial, os.path.join(step_dir, NAME))


def verify(step_dir: str) -> str | None:
  """None if every file of `step_dir` has the bytes its checksums name (or it has none: written
  before checksums were, or stopped before they were written); else what differs, as words."""
  path = os.path.join(step_dir, NAME)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    sums = json.load(f)["files"]
  for name, expected in sums.items():
    full = os.path.join(step_dir, name)
    if not os.path.exists(full):
      return f"{name} is missing"
    if _digest(full) != expected:
      return f"{name} has changed since it was written"
  extra = sorted(set(_files(step_dir)) - set(sums))
  return f"{extra[0]} was added after it was written" if extra else None


def has_checksums(step_dir: str) -> bool:
  return os.path.exists(os.path.join(step_dir, NAME))
