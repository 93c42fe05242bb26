"""A run's starting state: its latest committed checkpoint (resume), another run's checkpoint
(`checkpoint.restore_from`), Hugging Face weights (`init_from`) or a fresh init; restored into
this run's layout, whatever the layout that saved it."""

import dataclasses
import os
import uuid

import jax
from absl import logging

from trainer import checkpoint, data, hf_init
from trainer.config import TrainConfig
from trainer.trainer import Trainer


def init_or_restore(trainer: Trainer, ckpt: checkpoint.Checkpointer):
  """(train iterator, start step, run metadata): the latest committed checkpoint of this run, or
  `checkpoint.restore_from`, restored into this layout; else a fresh state (from `init_from`'s
  HF weights when set)."""
  cfg = trainer.cfg
  train_iter = trainer.iterator("train")
  source, step = ckpt, ckpt.latest_step()
  if step is None and cfg.checkpoint.restore_from:
    source, step = other_run(cfg.checkpoint.restore_from, cfg)
  meta = {"run_id": uuid.uuid4().hex, "process_count": jax.process_count(),
          "config": dataclasses.asdict(cfg), "stage_layers": [[name, list(counts)] for name, counts in trainer.stage_layers]}
  if step is None and cfg.init_from:  # fresh optimizer state, parameters from HF weights
    trainer.state = hf_init.init_state_from_hf(trainer)
    return train_iter, 0, meta
  if step is None:
    trainer.init_state()
    return train_iter, 0, meta
  target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        trainer.abstract_state, trainer.shardings)
  while True:
    try:
      state, saved, data_ok = source.restore(
          step, target, train_iter, dataclasses.asdict(cfg.model),
          not cfg.data.shard_documents_by_process, trainer.stage_layers,
          fp8_config=cfg.compute.fp8)
      break
    except checkpoint.ChecksumError as e:
      earlier = [s for s in source.manager.all_steps() if s < step]
      if not cfg.checkpoint.fallback_on_corruption or source is not ckpt:
        raise
      if not earlier:
        raise checkpoint.CheckpointError(f"{e.finding}, and no earlier checkpoint is left to"
                                         " fall back to: move it away to start afresh") from None
      logging.warning("%s", e.finding)
      logging.warning("fallback_on_corruption: moved it to %s; trying step %d",
                      source.set_aside(step), max(earlier))
      step = max(earlier)
  if source is not ckpt:
    source.close()
  trainer.state = state
  if not data_ok:
    logging.warning("the checkpoint was written by %s processes, this run has %d: the data order"
                    " restarts with a new shuffle (seed %d + step %d)", saved.get("process_count"),
                    jax.process_count(), cfg.data.seed, step)
    reshuffled = dataclasses.replace(cfg.data, seed=cfg.data.seed + step)
    shifted = dataclasses.replace(cfg, data=reshuffled)
    train_iter = data.make_iterator(shifted, trainer.tokenizer, "train", jax.process_index(),
                                    jax.process_count())
  logging.info("restored step %d from %s", step, source.directory)
  return train_iter, step, dict(meta, run_id=saved.get("run_id", meta["run_id"]))


def check_resumable(trainer: Trainer, checkpoints: str) -> None:
  """Before compiling: the checkpoint this run would start from (its latest in `checkpoints`,
  else `checkpoint.restore_from`) fits its model, fp8 state and optimizer, read from the
  checkpoint's metadata. Creates nothing on disk."""
  cfg = trainer.cfg
  source, step = None, None
  if os.path.isdir(checkpoints):
    source = checkpoint.Checkpointer(checkpoints, cfg.checkpoint)
    step = source.latest_step()
  if step is None and cfg.checkpoint.restore_from:
    if source is not None:
      source.close()
    source, step = other_run(cfg.checkpoint.restore_from, cfg)
  try:
    if step is not None:
      source.check_fits(step, dataclasses.asdict(cfg.model), cfg.compute.fp8,
                        dataclasses.asdict(cfg.optim), cfg.compute.scan_layers)
  finally:
    if source is not None:
      source.close()


def other_run(path: str, cfg: TrainConfig):
  """A Checkpointer over another run's checkpoints and the step to take from it."""
  path = os.path.abspath(os.path.expanduser(path))
  step = None
  if os.path.basename(path).isdigit():
    path, step = os.path.dirname(path), int(os.path.basename(path))
  if not os.path.isdir(path):
    raise checkpoint.CheckpointError(f"checkpoint.restore_from: {path} does not exist")
  other = checkpoint.Checkpointer(path, cfg.checkpoint)
  step = other.latest_step() if step is None else step
  if step is None or step not in other.manager.all_steps():
    raise checkpoint.CheckpointError(f"checkpoint.restore_from: no committed checkpoint"
                                     f" {'' if step is None else step} in {path}")
  return other, step
