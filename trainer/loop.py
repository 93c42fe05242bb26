"""The training loop: one compiled step after another, one-step-late metrics, eval, checkpoints,
preemption and the non-finite-loss guard; the loss plot and a sample at the end."""

import dataclasses
import logging as pylogging
import os
import zlib

import jax
import numpy as np
from absl import logging

from sharding.layout import UNROLLED_STAGE_GROUPS
from trainer import checkpoint, data, metrics, plot, sample, tracking
from trainer.process import preemption, workdir as workdir_lib
from trainer.config import TrainConfig
from trainer.restore import check_resumable, init_or_restore
from trainer.trainer import Trainer


def quiet_library_logs() -> None:
  """orbax logs every step of every save at INFO; keep its warnings and errors only. asyncio's
  "exception was never retrieved" reports orbax's reader futures after a failed restore, which
  the one-line CheckpointError already describes."""
  handler = logging.get_absl_handler()
  if not any(isinstance(f, _NoLibraryInfo) for f in handler.filters):
    handler.addFilter(_NoLibraryInfo())
  pylogging.getLogger("asyncio").setLevel(pylogging.CRITICAL)


class _NoLibraryInfo(pylogging.Filter):
  def filter(self, record: pylogging.LogRecord) -> bool:
    return record.levelno > pylogging.INFO or "/orbax/" not in record.pathname


def enable_compilation_cache(path: str) -> None:
  """Persists compiled programs across runs (a warm cache turns a ~10 s compile into ~1 s)."""
  if path:
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


class TrainingError(RuntimeError):
  """Training stopped on purpose and abnormally (e.g. a non-finite loss with nan_policy=stop)."""


def run(cfg: TrainConfig, workdir: str) -> dict:
  """Trains `cfg` in `workdir`, resuming from its latest committed checkpoint; returns the last
  step's metrics. Preemption signals (SIGTERM, SIGUSR1, Ctrl-C) save and return; a non-finite
  loss raises TrainingError. Every check that needs no step (workdir, data, layout, memory)
  comes before anything is written there."""
  enable_compilation_cache(cfg.compilation_cache_dir)
  quiet_library_logs()
  is_writer = jax.process_index() == 0
  workdir = workdir_lib.check(workdir)
  trainer = Trainer(cfg)  # the layout's errors
  data.check_source(cfg, trainer.tokenizer)
  trainer.check_host_memory_estimate()
  if is_writer:
    tracking.check(cfg)
    checkpoint.check_room_for_one(workdir, trainer.abstract_state)
  workdir_lib.prepare(workdir)  # the first change on disk: every input has been checked
  with workdir_lib.locked(workdir, enabled=is_writer):
    checkpoints = os.path.join(workdir, "checkpoints")
    check_resumable(trainer, checkpoints)  # a checkpoint this run cannot read: before compiling
    # Tracked runs open before compiling: a wrong URI fails before the work, not after.
    runs = tracking.open_runs(cfg, workdir, dataclasses.asdict(cfg)) if is_writer \
        else tracking.Runs()
    for line in tracking.describe(runs):
      logging.info("tracking: %s", line)
    try:
      last = _compile_and_run(trainer, cfg, workdir, checkpoints, runs, is_writer)
    except BaseException:
      runs.close(failed=True)
      raise
    runs.close()
    return last


def _compile_and_run(trainer, cfg, workdir, checkpoints, runs, is_writer) -> dict:
  rep = trainer.compile()
  logging.info("train step compiled in %.1f s: peak %.3f GiB per device, %.1f MiB of"
               " collectives", rep.compile_seconds, rep.memory["peak"] / 2**30,
               rep.wire_bytes / 2**20)
  ckpt = checkpoint.Checkpointer(checkpoints, cfg.checkpoint)
  try:
    train_iter, start, meta = init_or_restore(trainer, ckpt)
  except BaseException:
    ckpt.close()
    raise
  return _run_from(trainer, ckpt, train_iter, start, meta, workdir, is_writer, runs)


def remat_note(layout, num_layers: int) -> str:
  """The line a run logs where compute.remat does not act (Layout.stage_remat), else ''."""
  if layout.stage_remat(num_layers) == layout.remat:
    return ""
  return (f"compute.remat={layout.remat} runs as none in the pipeline stages' chunks of at most"
          f" {UNROLLED_STAGE_GROUPS} layers: the executor recomputes each chunk in its backward"
          " (docs/parallelism.md)")


def _run_from(trainer, ckpt, train_iter, start, meta, workdir, is_writer, runs) -> dict:
  cfg = trainer.cfg
  logging.info("process %d of %d; mesh %s over %d %s devices; data %s; %.2fM parameters;"
               " %s at step %d (the whole config: %s/config.json)", jax.process_index(),
               jax.process_count(), dict(trainer.mesh.shape), jax.device_count(),
               jax.devices()[0].platform, data.describe_source(cfg), cfg.model.num_params() / 1e6,
               "resuming" if start else "starting", start, workdir)
  if start >= cfg.steps:
    print(f"{workdir} is already trained to step {start} of {cfg.steps}; nothing to do (raise"
          " --config.steps to train further)")
    ckpt.close()
    return {}
  if is_writer:
    workdir_lib.write_config(workdir, dataclasses.asdict(cfg), start)
  peak, peak_source = (cfg.peak_flops_per_device * jax.device_count(), "config") \
      if cfg.peak_flops_per_device else metrics.peak_flops(cfg.model.dtype)
  logging.info("MFU denominator: %.1f GFLOP/s (%s)", peak / 1e9, peak_source)
  if note := remat_note(trainer.layout, cfg.model.num_layers):
    logging.info(note)
  progress = metrics.Progress(
      workdir, steps=cfg.steps, start=start, tokens_per_step=cfg.batch_size * cfg.seq_len,
      flops_per_step=cfg.model.flops_per_token(cfg.seq_len) * cfg.batch_size * cfg.seq_len,
      peak_flops=peak, log_every=cfg.log_every, enabled=is_writer, tracked=runs)
  stops = preemption.StopRequests(cfg.checkpoint.preemption_signals)
  try:
    if _train(trainer, ckpt, train_iter, start, meta, progress, stops, workdir):
      finish(trainer, workdir, is_writer, stops)
  finally:
    stops.close()
    progress.close()
    ckpt.close()
  return progress.last


def _train(trainer, ckpt, train_iter, start, meta, progress, stops, workdir) -> bool:
  """The step loop; True when it reached cfg.steps, False when preempted."""
  cfg = trainer.cfg
  skips = 0
  pending = None  # (step, device metrics, batch fingerprint): read one step late
  last_saved = (start, None)

  def fetch(step):
    batch = next(train_iter)
    state = train_iter.get_state()  # as of this step's batch: what a checkpoint of it holds
    if step == cfg.inject_nan_at_step:
      batch = dict(batch, loss_mask=batch["loss_mask"] * np.float32("nan"))
    return trainer.to_device(batch), zlib.crc32(batch["inputs"].tobytes()), state

  def flush(extra=None):
    nonlocal pending, skips
    if pending is None:
      return
    step, device_metrics, fingerprint = pending
    pending = None
    values = progress.report(step, device_metrics, dict(extra or {}, data_crc32=fingerprint))
    if values["skipped"]:
      skips += 1
      reason = (f"non-finite or spiking loss at step {step} (the step's batch has data_crc32"
                f" {fingerprint}); its update was not applied")
      if cfg.nan_policy == "stop":
        raise TrainingError(f"{reason}; stopping (nan_policy=stop). The last good checkpoint is"
                            f" step {ckpt.latest_step()} in {ckpt.directory}")
      logging.warning("%s; skipped (%d in a row)", reason, skips)
      if skips > cfg.max_consecutive_skips:
        raise TrainingError(f"{skips} consecutive skipped steps (limit"
                            f" max_consecutive_skips={cfg.max_consecutive_skips}); stopping")
    else:
      skips = 0

  dispatched = (start, None)
  try:
    with trainer.scope():
      batch, fingerprint, data_state = fetch(start + 1)
      for step in range(start + 1, cfg.steps + 1):
        trainer.state, step_metrics = trainer.compiled_step(trainer.state, batch)
        dispatched = (step, data_state)
        step_data_state = data_state
        if step < cfg.steps:  # host prepares and transfers the next batch while the step runs
          batch, next_fingerprint, data_state = fetch(step + 1)
        flush()
        pending = (step, step_metrics, fingerprint)
        if step < cfg.steps:
          fingerprint = next_fingerprint
        ckpt.check()  # a failed asynchronous save stops the run here, not steps later
        stop = stops.should_stop()
        # Evals and saves are off the step clock: step_time_s, tokens/s and MFU are the step's.
        if not stop and (step % cfg.eval_every == 0 or step == cfg.steps):
          with progress.off_the_clock(running=step_metrics):
            eval_loss = trainer.evaluate(stops.should_stop)  # None: a stop cut it short
          flush({"eval_loss": eval_loss} if eval_loss is not None else None)
          stop = eval_loss is None
        if step % cfg.checkpoint.every_steps == 0 or step == cfg.steps or stop:
          flush()  # a non-finite step raises here, before anything is saved
          with progress.off_the_clock():
            ckpt.save(step, trainer.state, step_data_state, meta,
                      wait=stop or step == cfg.steps)
          last_saved = (step, step_data_state)
        if stop:
          print(f"{stops.requested}: checkpoint of step {step} saved in {ckpt.directory}; rerun"
                " the same command to resume")
          return False
      flush()
  except (TrainingError, checkpoint.CheckpointError):
    raise  # nothing new to save (a stop), or saving is what failed
  except Exception:
    ckpt.check()  # a failed asynchronous save (a full disk) explains the error and cleans up
    step, state_of_data = dispatched
    if cfg.checkpoint.save_on_error and state_of_data is not None and step > last_saved[0]:
      logging.error("the loop raised at step %d: saving that step's state first", step)
      ckpt.save(step, trainer.state, state_of_data, meta, wait=True)
    raise
  return True


def finish(trainer: Trainer, workdir: str, is_writer: bool, stops) -> None:
  """The run's loss-curve PNG and a sample of generated text (every process samples: the
  parameters are global arrays; only the writer writes). A stop signal while sampling (the last
  checkpoint is saved by then) ends the sample early: what was made is written."""
  cfg = trainer.cfg
  if is_writer:
    plot.plot_losses(os.path.join(workdir, "metrics.jsonl"), os.path.join(workdir, "loss.png"),
                     title=f"meshtron: {cfg.model.num_params() / 1e6:.2f}M-parameter Llama")
  if cfg.sample_tokens > 0:
    prompt = list(trainer.tokenizer.encode(cfg.sample_prompt))
    if trainer.tokenizer.bos_id is not None:
      prompt = [trainer.tokenizer.bos_id] + prompt
    ids = sample.generate(trainer.unsharded_graphdef(), trainer.model_params(), prompt,
                          cfg.sample_tokens, window=cfg.seq_len,
                          temperature=cfg.sample_temperature, seed=cfg.seed,
                          should_stop=stops.should_stop)
    if not is_writer:
      return
    if len(ids) < cfg.sample_tokens:
      print(f"{stops.requested}: sampling stopped after {len(ids)} of {cfg.sample_tokens}"
            " tokens (the final checkpoint was already saved)")
    text = cfg.sample_prompt + trainer.tokenizer.decode(ids)
    with open(os.path.join(workdir, "sample.txt"), "w", encoding="utf-8") as f:
      f.write(text)
    logging.info("sample:\n%s", text)
    print(f"--- sample ({len(ids)} tokens, temperature {cfg.sample_temperature}) ---")
    print(text)
  if is_writer:
    written = ["metrics.jsonl", "loss.png"] + (["sample.txt"] if cfg.sample_tokens > 0 else [])
    print(f"wrote {workdir}/{', '.join(written)}, tensorboard/")
