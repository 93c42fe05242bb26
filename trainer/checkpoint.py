"""Checkpoints on orbax: async saves of state + data-iterator state + metadata, exact resume,
restore into any layout, and one-line errors for unusable checkpoints."""

import dataclasses
import errno
import json
import re
import os
import shutil
import threading
import time

import grain
import jax
import orbax.checkpoint as ocp
from absl import logging
from sharding.pipeline import stage_split

from trainer import checksums
from trainer.config import CheckpointConfig

ITEMS = ("state", "data", "meta")
# Model fields that change parameter shapes: a checkpoint written with other values cannot load.
SHAPE_FIELDS = ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                "mlp_dim", "tie_embeddings")


class CheckpointError(ValueError):
  """An unusable checkpoint (corrupt, incompatible, missing); the message names it."""


class ChecksumError(CheckpointError):
  """A checkpoint whose files differ from the checksums written when it was saved; `finding`
  says which and how, without the advice the message adds."""

  def __init__(self, finding: str, advice: str):
    super().__init__(f"{finding}; {advice}")
    self.finding = finding


def check_room_for_one(workdir: str, abstract_state) -> None:
  """Before anything is written: CheckpointError when the disk holding `workdir` (or its nearest
  existing parent) cannot hold even one checkpoint of this state (every array once, plus 5%)."""
  needed = 1.05 * sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(abstract_state)
                      if hasattr(leaf, "dtype"))
  existing = os.path.abspath(workdir)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  free = shutil.disk_usage(existing).free
  if needed > free:
    raise CheckpointError(
        f"the disk holding {workdir} has {_size(free)} free, and one checkpoint of this run"
        f" needs about {_size(needed)}; free some space or use another --workdir")


def _size(nbytes: float) -> str:
  return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


class _IteratorState:
  """A data-iterator state captured when a step's batch was drawn (the loop prefetches ahead, so
  the live iterator is already past it when the checkpoint is written). grain's handler stores
  a non-iterator's `get_state()` bytes as is: the same JSON it writes for an iterator."""

  def __init__(self, state):
    self._state = state

  def get_state(self) -> bytes:
    return json.dumps(self._state, indent=4).encode()


class Checkpointer:
  """Saves every `every_steps` (asynchronously) into DIR/checkpoints/<step>, keeps the last
  `keep` plus every `keep_every`-th; restores only committed (finalized) checkpoints."""

  def __init__(self, directory: str, cfg: CheckpointConfig):
    self.directory = os.path.abspath(directory)
    self.cfg = cfg
    os.makedirs(self.directory, exist_ok=True)
    self._set_aside_partial_saves()
    self._open_manager()
    self._hashing = None  # the thread writing the last committed save's checksums

  def _open_manager(self) -> None:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=self.cfg.keep, keep_period=self.cfg.keep_every or None,
        enable_async_checkpointing=self.cfg.async_save, create=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)
    self._in_flight = None  # the step of the asynchronous save under way, if any
    self._failed = False  # a save failed (and was reported)

  def _recreate_if_removed(self) -> None:
    """A checkpoint directory removed during the run (by hand, by a clean-up job) is made again,
    with a warning, and the run goes on: the state in memory is now the only copy, and the next
    save writes it. Its earlier checkpoints are gone; an async save in flight is abandoned."""
    if os.path.isdir(self.directory):
      return
    lost = self.manager.all_steps()
    try:
      self.manager.wait_until_finished()
    except Exception:  # noqa: BLE001 - the save in flight lost its directory: abandoned
      pass
    try:
      self.manager.close()
    except Exception:  # noqa: BLE001
      pass
    self._finish_checksums()
    os.makedirs(self.directory, exist_ok=True)
    self._open_manager()
    logging.warning("the checkpoint directory %s was removed during the run (with the checkpoints"
                    " of steps %s); made it again: the next save (every %d steps, and at the"
                    " end or a stop) writes there", self.directory,
                    ", ".join(map(str, lost)) or "none", self.cfg.every_steps)

  def _set_aside_partial_saves(self) -> None:
    """Interrupted saves leave `<step>.orbax-checkpoint-tmp*` directories. They are never
    restored; move them to `partial/` (never delete) so orbax does not reuse their names."""
    partial = [n for n in os.listdir(self.directory) if ".orbax-checkpoint-tmp" in n]
    if not partial or jax.process_index() != 0:
      return
    aside = os.path.join(self.directory, "partial")
    os.makedirs(aside, exist_ok=True)
    for name in partial:
      target = os.path.join(aside, f"{name}.{int(time.time())}")
      os.rename(os.path.join(self.directory, name), target)
      logging.warning("ignoring the interrupted checkpoint %s (moved to %s)", name, target)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, data_state, meta: dict, wait: bool = False) -> None:
    """Starts saving `state` (whose arrays may still be computing) with the iterator state as of
    this step's batch; `wait` blocks until it is committed (preemption, end of training).

    A save that cannot fit the free disk space is refused before it starts; one that fails while
    writing (disk full, I/O error) raises CheckpointError at the next `check()`, `save` or
    `wait`, with its partial directory removed: the last committed checkpoint stays usable."""
    self._recreate_if_removed()
    if self._in_flight is not None:
      # orbax's save waits for the previous one anyway; waited for first (and then hashed), its
      # files are on the disk when the free space is read (else a save still writing left it
      # looking free, and the next one failed writing instead of being refused:
      # tests/test_faults.py, under load).
      self.wait()
    self._check_space(step, state)
    args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                              data=grain.checkpoint.CheckpointSave(_IteratorState(data_state)),
                              meta=ocp.args.JsonSave(meta))
    self._guard(lambda: self.manager.save(step, args=args, force=True), starting=step)
    self._in_flight = step
    if wait:
      self.wait()

  def wait(self) -> None:
    self._guard(self.manager.wait_until_finished)
    self._write_checksums(self._in_flight)
    self._in_flight = None

  def _write_checksums(self, step: int | None) -> None:
    """Hashes committed checkpoint `step` on a thread (one at a time; process 0, the storage
    being shared as orbax requires). A run stopped before it finishes leaves that checkpoint
    without checksums: it restores unverified, as those written before checksums were."""
    if step is None or not self.cfg.checksums or jax.process_index() != 0:
      return
    self._finish_checksums()
    step_dir = os.path.join(self.directory, str(step))

    def write():
      try:
        checksums.write(step_dir)
      except OSError as e:  # removed meanwhile (kept checkpoints rotate), or unreadable
        logging.warning("no checksums for %s (%s)", step_dir, _first_line(e))
    self._hashing = threading.Thread(target=write, name=f"checksums-{step}", daemon=True)
    self._hashing.start()

  def _finish_checksums(self) -> None:
    if self._hashing is not None:
      self._hashing.join()
      self._hashing = None

  def check(self) -> None:
    """Raises CheckpointError if an asynchronous save has failed since the last call."""
    self._recreate_if_removed()
    self._guard(self.manager.check_for_errors)

  def _check_space(self, step: int, state) -> None:
    """Refuses a save whose arrays (this process's shards) exceed the free space, plus 5%."""
    needed = 1.05 * sum(shard.data.nbytes for leaf in jax.tree.leaves(state)
                        if isinstance(leaf, jax.Array) for shard in leaf.addressable_shards
                        if shard.replica_id == 0)
    free = shutil.disk_usage(self.directory).free
    if needed > free:
      raise CheckpointError(
          f"no room for the checkpoint of step {step} in {self.directory}: it needs about"
          f" {needed / 1e9:.2f} GB and {free / 1e9:.2f} GB are free; free some space or use"
          f" another --workdir (last committed checkpoint: {self.latest_step()})")

  def _guard(self, action, starting: int | None = None) -> None:
    """Runs an orbax call; a failed save (the one in flight, else the one `starting`) becomes
    one CheckpointError and leaves no partial directory behind (a full disk needs the space)."""
    try:
      action()
    except Exception as e:  # orbax raises many types from its writer threads
      self._failed = True
      failed = self._in_flight if self._in_flight is not None else starting
      for name in os.listdir(self.directory):
        if ".orbax-checkpoint-tmp" in name:  # uncommitted: nothing restores from it
          shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
      reason = "the disk is full" if getattr(e, "errno", None) == errno.ENOSPC or \
          "No space left" in str(e) else _first_line(e)
      raise CheckpointError(f"the checkpoint of step {failed} in {self.directory} failed"
                            f" ({reason}); its partial files are removed, the last committed"
                            f" checkpoint is step {self._last_committed(failed)}") from None

  def _last_committed(self, failed: int | None) -> int | None:
    """The newest step whose directory was committed, read from the disk: orbax's own list
    already holds a step once its save starts, and whether the failure came before or after
    that depends on the writer threads' timing."""
    steps = [int(n) for n in os.listdir(self.directory)
             if n.isdigit() and int(n) != failed]
    return max(steps, default=None)

  def read_meta(self, step: int) -> dict:
    path = os.path.join(self.directory, str(step))
    try:
      return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    except Exception as e:  # orbax raises many types for unreadable files
      raise CheckpointError(f"checkpoint {path} is unreadable ({_first_line(e)}); move it away to"
                            " resume from an earlier one") from None

  def check_fits(self, step: int, model_config: dict, fp8_config=None,
                 optim_config: dict | None = None, scan_layers: bool | None = None) -> dict:
    """The metadata of checkpoint `step`, once it is checked to fit this run: the model's
    shapes, the fp8 state, (`optim_config`) the optimizer whose state it holds and
    (`scan_layers`) the form of its layers, stacked or apart. Cheap (the metadata only): the
    trainer calls it before compiling."""
    path = os.path.join(self.directory, str(step))
    meta = self.read_meta(step)
    saved = meta.get("config", {}).get("model", {})
    mismatched = [f"model.{k}={saved[k]} (checkpoint) vs {model_config[k]} (config)"
                  for k in SHAPE_FIELDS if k in saved and saved[k] != model_config[k]]
    if mismatched:
      raise CheckpointError(f"checkpoint {path} does not fit this model: {', '.join(mismatched)};"
                            " use another --workdir or the checkpoint's model config")
    saved_scan = meta.get("config", {}).get("compute", {}).get("scan_layers", True)
    if scan_layers is not None and saved_scan != scan_layers:
      forms = {True: "stacked", False: "each apart"}
      raise CheckpointError(
          f"checkpoint {path} stores its layers {forms[saved_scan]}"
          f" (compute.scan_layers={str(saved_scan).lower()}), this run {forms[scan_layers]}:"
          f" resume with --config.compute.scan_layers={str(saved_scan).lower()}, or start a new"
          " --workdir")
    # fp8 settings: compute.fp8 (checkpoints written before it moved: model.fp8).
    saved_fp8 = meta.get("config", {}).get("compute", {}).get("fp8", saved.get("fp8"))
    written_fp8, wanted_fp8 = _fp8_state(saved_fp8), _fp8_state(_as_dict(fp8_config))
    if saved_fp8 is not None and written_fp8 != wanted_fp8:
      flags = " ".join(f"--config.compute.fp8.{k}={v}" for k, v in saved_fp8.items()
                       if k in ("enabled", "recipe", "amax_history", "targets"))
      raise CheckpointError(
          f"checkpoint {path} holds {_fp8_words(written_fp8)}, this run's compute.fp8 wants"
          f" {_fp8_words(wanted_fp8)}: resume with the checkpoint's compute.fp8 settings"
          f" ({flags}), or start a new --workdir")
    saved_optim = meta.get("config", {}).get("optim", {})
    for key in ("name", "master_weights"):
      if optim_config is not None and key in saved_optim and saved_optim[key] != optim_config[key]:
        raise CheckpointError(
            f"checkpoint {path} holds the state of optim.{key}={saved_optim[key]!r}, this run"
            f" has {optim_config[key]!r}: resume with --config.optim.{key}={saved_optim[key]},"
            " or start a new --workdir")
    return meta

  def restore(self, step: int, target_state, iterator, model_config: dict,
              shared_data_state: bool = True, stage_layers: stage_split.StackSplit = (),
              fp8_config=None):
    """Restores `step` into the shardings of `target_state` (ShapeDtypeStructs with shardings:
    any layout or device count) and the iterator's position. Returns (state, meta, data_ok).

    `fp8_config`: this run's compute.fp8 (the state's amax histories must be the checkpoint's).
    `stage_layers`: the target's uneven pipeline split (its layer stacks stored padded); a
    checkpoint written with another split (meta "stage_layers") is read with its stacks' rows
    whole over the pipeline axis and restacked into the target's.

    With `shared_data_state` (every process iterates the same global stream) any process count
    resumes exactly from process 0's iterator state; otherwise data_ok is False when the
    process count changed and the iterator could not be resumed."""
    path = os.path.join(self.directory, str(step))
    meta = self.check_fits(step, model_config, fp8_config)
    self.verify(step)
    written = stage_split.from_meta(meta.get("stage_layers"))
    target = target_state
    if written != tuple(stage_layers):
      target = stage_split.stored_like(target_state, written, stage_layers)
    try:
      state = self.manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(target))).state
    except Exception as e:
      raise CheckpointError(f"checkpoint {path} could not be restored ({_first_line(e)}); it is"
                            " left untouched: move it away to resume from an earlier one") from None
    if written != tuple(stage_layers):
      state = jax.jit(lambda s: stage_split.restack(s, written, stage_layers),
                      out_shardings=jax.tree.map(lambda a: a.sharding, target_state))(state)
    same_count = meta.get("process_count") == jax.process_count()
    try:
      if same_count:
        self.manager.restore(step, args=ocp.args.Composite(
            data=grain.checkpoint.CheckpointRestore(iterator)))
      elif shared_data_state:
        saved_file = os.path.join(path, "data", f"process_0-of-{meta.get('process_count')}.json")
        with open(saved_file) as f:
          iterator.set_state(json.load(f))
    except Exception as e:
      raise CheckpointError(f"the data-iterator state in {path} could not be restored"
                            f" ({_first_line(e)})") from None
    return state, meta, same_count or shared_data_state

  def verify(self, step: int) -> None:
    """Raises ChecksumError if checkpoint `step`'s files differ from its checksums."""
    path = os.path.join(self.directory, str(step))
    problem = checksums.verify(path) if self.cfg.checksums else None
    if problem:
      raise ChecksumError(
          f"checkpoint {path} fails its checksums: {problem}", "it is left untouched: set"
          " --config.checkpoint.fallback_on_corruption=true to resume from the newest earlier"
          " checkpoint that passes, or move it away")
    if self.cfg.checksums and not checksums.has_checksums(path):
      logging.warning("checkpoint %s has no checksums (written before they were, or stopped"
                      " before they were written): restoring it unverified", path)

  def set_aside(self, step: int) -> str:
    """Moves checkpoint `step` into `corrupt/` (never deleted) and returns where it went."""
    aside = os.path.join(self.directory, "corrupt")
    os.makedirs(aside, exist_ok=True)
    target = os.path.join(aside, f"{step}.{int(time.time())}")
    os.rename(os.path.join(self.directory, str(step)), target)
    self.manager.reload()
    return target

  def close(self) -> None:
    try:
      if not self._failed:  # a failed save was reported once; waiting would re-raise it
        self.wait()
      self._finish_checksums()
    finally:
      try:
        self.manager.close()
      except Exception:  # noqa: BLE001  (after a failed save orbax may complain again)
        if not self._failed:
          raise


def _as_dict(config) -> dict | None:
  """A config section as the checkpoint's metadata stores it (callers pass dataclasses too)."""
  return config if isinstance(config, dict) or config is None else dataclasses.asdict(config)


def _fp8_state(fp8: dict | None) -> tuple:
  """What of compute.fp8 is in the train state: delayed scaling keeps an amax history per fp8
  projection as a parameter; the current-scaling recipes keep nothing."""
  if not fp8 or not fp8.get("enabled") or fp8.get("recipe", "delayed") != "delayed":
    return ()
  return (fp8.get("amax_history"), fp8.get("targets"))


def _fp8_words(state: tuple) -> str:
  return (f"delayed-scaling amax histories of {state[0]} steps for {state[1]}" if state
          else "no fp8 amax histories")


def _first_line(error: Exception) -> str:
  """The first line of an error, without what only a developer reads (TensorStore's spec dumps,
  object reprs)."""
  text = str(error).strip().splitlines()
  line = text[0] if text else ""
  line = re.split(r"\s*See full TensorStore details", line)[0]
  line = re.sub(r"<[^<>]*(?: at 0x[0-9a-f]+|pybind11)[^<>]*>?", "", line).rstrip(" :({")
  return f"{type(error).__name__}: {line[:300]}"

