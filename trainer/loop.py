"""The training loop: mesh and rules, sharded init, one jitted step, one-step-late metrics, eval."""

import dataclasses
import json
import logging as pylogging
import os
import time
import uuid
import zlib

import jax
import numpy as np
from absl import logging

import sharding
from sharding.xla import compiled, presets
from sharding import report
from models import abstract_model, param_names
from trainer import checkpoint, convert, data, metrics, plot, preemption, sample
from trainer.config import TrainConfig, compiler_options
from trainer.optim import make_optimizer
from trainer.state import make_init_fn, state_shardings
from trainer.step import BATCH_KEYS, make_eval_step, make_train_step
from trainer.tokenizer import make_tokenizer


def quiet_library_logs() -> None:
  """orbax logs every step of every save at INFO; keep its warnings and errors only."""
  handler = logging.get_absl_handler()
  if not any(isinstance(f, _NoLibraryInfo) for f in handler.filters):
    handler.addFilter(_NoLibraryInfo())


class _NoLibraryInfo(pylogging.Filter):
  def filter(self, record: pylogging.LogRecord) -> bool:
    return record.levelno > pylogging.INFO or "/orbax/" not in record.pathname


def enable_compilation_cache(path: str) -> None:
  """Persists compiled programs across runs (a warm cache turns a ~10 s compile into ~1 s)."""
  if path:
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


class Trainer:
  """Everything built once for a run: mesh, rules, model, optimizer, shardings and jitted steps.

  Construction is abstract (nothing allocated), so a dry run can describe any model size;
  `init_state()` materializes the state directly into its shardings.
  """

  def __init__(self, cfg: TrainConfig, devices=None):
    cfg.validate()
    self.cfg = cfg
    self.tokenizer = make_tokenizer(cfg.data.tokenizer)
    if self.tokenizer.vocab_size > cfg.model.vocab_size:
      raise ValueError(f"tokenizer has {self.tokenizer.vocab_size} tokens but model.vocab_size is"
                       f" {cfg.model.vocab_size}; set --config.model.vocab_size to at least that")
    # The whole layout, resolved once (sharding/layout.py): mesh, rules and their decisions.
    self.layout = sharding.resolve(cfg.mesh, jax.devices() if devices is None else devices,
                                   cfg.model, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                                   microbatches=cfg.microbatches,
                                   rule_overrides=cfg.sharding_rules)
    self.mesh, self.rules = self.layout.mesh, self.layout.rules
    with self.context():
      self.graphdef, abstract_params = abstract_model(cfg.model)
      self.names = param_names(cfg.model)
      self.param_rows = report.param_rows(self.names, abstract_params)
      report.check_replication(self.param_rows, cfg.max_replicated_fraction,
                               self.layout.layout.rules(cfg.model.vocab_size, cfg.seq_len))
      self.tx, self.lr = make_optimizer(cfg.optim, self.names, cfg.steps)
      self._init = make_init_fn(cfg.model, self.tx, cfg.seed)
      self.abstract_state = jax.eval_shape(self._init)
      self.shardings = state_shardings(self.abstract_state, self.names, self.tx)
      shape = (cfg.batch_size, cfg.seq_len)
      self.batch_sharding = {
          k: sharding.named_sharding(("batch", "seq"), shape, f"batch/{k}") for k in BATCH_KEYS}
      replicated = sharding.replicated()
      options = presets.check_options(  # fails at start-up, not deep in a run
          compiler_options(cfg, sharding.mesh_sizes(self.mesh)))
      # Bound to the layout: whoever traces them, they trace with this mesh and these rules.
      self.step_fn = self.layout.bind(make_train_step(self.graphdef, self.names, self.tx,
                                                      self.lr, cfg.step()))
      self.train_step = jax.jit(self.step_fn, in_shardings=(self.shardings, self.batch_sharding),
                                out_shardings=(self.shardings, replicated), donate_argnums=0,
                                compiler_options=options or None)
      self.eval_step = jax.jit(self.layout.bind(make_eval_step(self.graphdef, cfg.step())),
                               in_shardings=(self.shardings.params, self.batch_sharding),
                               out_shardings=replicated)
    self.state = None
    self.compiled_step = None  # set by compile()

  def compile(self) -> "compiled.CompiledReport":
    """Compiles the train step ahead of time (the program training runs) and refuses a layout
    whose compiled peak memory exceeds the device memory."""
    start = time.perf_counter()
    with self.context():
      executable = self.train_step.lower(self.abstract_state, self.abstract_batch()).compile()
    self.compiled_step = executable
    rep = compiled.report(executable, "local", list(self.mesh.devices.flat),
                          time.perf_counter() - start)
    limit = self.cfg.device_memory_gib * 2**30 or _device_memory_limit()
    if limit and not compiled.fits(rep, limit)[0]:
      raise ValueError(
          f"the compiled train step needs {rep.memory['peak'] / 2**30:.2f} GiB per device (peak:"
          f" arguments {rep.memory['argument'] / 2**30:.2f}, temporaries"
          f" {rep.memory['temp'] / 2**30:.2f}) but the device has {limit / 2**30:.2f} GiB; shard"
          " more (fsdp, tensor, zero_stage), recompute more (model.remat) or shrink the batch")
    return rep

  def init_state(self) -> None:
    """Creates the train state sharded from the start (no unsharded copy ever exists)."""
    with self.context():
      self.state = jax.jit(self._init, out_shardings=self.shardings)()

  def abstract_batch(self) -> dict:
    return {k: jax.ShapeDtypeStruct((self.cfg.batch_size, self.cfg.seq_len),
                                    "float32" if k == "loss_mask" else "int32", sharding=sh)
            for k, sh in self.batch_sharding.items()}

  def sharding_report(self) -> str:
    """Every parameter (shape, logical names, spec, bytes per device) and every activation
    constraint of the train step, traced abstractly."""
    with self.context(), sharding.record_constraints() as recorded:
      jax.eval_shape(self.step_fn, self.abstract_state, self.abstract_batch())
    per_device = sum(r.bytes_per_device for r in self.param_rows)
    return "\n".join([
        self.layout.describe(),
        "parameters:", report.format_rows(self.param_rows),
        f"parameter bytes per device: {per_device:,}"
        f" ({report.replicated_fraction(self.param_rows):.1%} of bytes replicated)",
        "activations:", report.format_rows(report.activation_rows(recorded), with_bytes=False)])

  def context(self):
    return self.layout.context()

  def iterator(self, split: str):
    return data.make_iterator(self.cfg, self.tokenizer, split, jax.process_index(),
                              jax.process_count())

  def to_device(self, local_batch: dict) -> dict:
    """Host-local numpy rows -> global arrays sharded on (batch, seq)."""
    return {k: jax.make_array_from_process_local_data(self.batch_sharding[k], local_batch[k])
            for k in BATCH_KEYS}

  def evaluate(self) -> float:
    """Mean eval loss over the same `eval_batches` batches every time."""
    if self.cfg.data.eval_fraction == 0 or self.cfg.data.source == "synthetic":
      it = None
    else:
      it = self.iterator("eval")
    if it is None:
      return float("nan")
    nll, tokens = 0.0, 0.0
    with self.context():
      for _ in range(self.cfg.eval_batches):
        out = jax.device_get(self.eval_step(self.state.params, self.to_device(next(it))))
        nll, tokens = nll + float(out["nll_sum"]), tokens + float(out["tokens"])
    return nll / max(tokens, 1.0)


def _device_memory_limit() -> int:
  """Bytes per device where the backend reports a limit (GPUs); 0 when unknown (CPU)."""
  stats = jax.local_devices()[0].memory_stats() or {}
  return int(stats.get("bytes_limit", 0))


class TrainingError(RuntimeError):
  """Training stopped on purpose and abnormally (e.g. a non-finite loss with nan_policy=stop)."""


def run(cfg: TrainConfig, workdir: str) -> dict:
  """Trains `cfg` in `workdir`, resuming from its latest committed checkpoint; returns the last
  step's metrics. Preemption signals save and return; a non-finite loss raises TrainingError."""
  enable_compilation_cache(cfg.compilation_cache_dir)
  quiet_library_logs()
  os.makedirs(workdir, exist_ok=True)
  trainer = Trainer(cfg)
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), cfg.checkpoint)
  rep = trainer.compile()
  logging.info("train step compiled in %.1f s: peak %.3f GiB per device, %.1f MiB of collectives",
               rep.compile_seconds, rep.memory["peak"] / 2**30, rep.wire_bytes / 2**20)
  train_iter, start, meta = _init_or_restore(trainer, ckpt)
  is_writer = jax.process_index() == 0
  if is_writer:
    with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
      json.dump(dataclasses.asdict(cfg), f, indent=2)
  logging.info("config:\n%s", json.dumps(dataclasses.asdict(cfg), indent=2))
  logging.info("process %d of %d; mesh %s over %d %s devices; data %s; %.2fM parameters;"
               " %s at step %d", jax.process_index(), jax.process_count(),
               dict(trainer.mesh.shape), jax.device_count(), jax.devices()[0].platform,
               data.describe_source(cfg), cfg.model.num_params() / 1e6,
               "resuming" if start else "starting", start)
  if start >= cfg.steps:
    print(f"{workdir} is already trained to step {start} of {cfg.steps}; nothing to do")
    ckpt.close()
    return {}
  peak, peak_source = (cfg.peak_flops_per_device * jax.device_count(), "config") \
      if cfg.peak_flops_per_device else metrics.peak_flops(cfg.model.dtype)
  logging.info("MFU denominator: %.1f GFLOP/s (%s)", peak / 1e9, peak_source)
  progress = metrics.Progress(
      workdir, steps=cfg.steps, start=start, tokens_per_step=cfg.batch_size * cfg.seq_len,
      flops_per_step=cfg.model.flops_per_token(cfg.seq_len) * cfg.batch_size * cfg.seq_len,
      peak_flops=peak, log_every=cfg.log_every, enabled=is_writer)
  stops = preemption.StopRequests(cfg.checkpoint.preemption_signals)
  try:
    finished = _train(trainer, ckpt, train_iter, start, meta, progress, stops, workdir)
  finally:
    stops.close()
    progress.close()
    ckpt.close()
  if finished:
    finish(trainer, workdir, is_writer)
  return progress.last


def _init_or_restore(trainer: Trainer, ckpt: checkpoint.Checkpointer):
  """(train iterator, start step, run metadata): the latest committed checkpoint of this run, or
  `checkpoint.restore_from`, restored into this layout; else a fresh state (from `init_from`'s
  HF weights when set)."""
  cfg = trainer.cfg
  train_iter = trainer.iterator("train")
  source, step = ckpt, ckpt.latest_step()
  if step is None and cfg.checkpoint.restore_from:
    source, step = _other_run(cfg.checkpoint.restore_from, cfg)
  meta = {"run_id": uuid.uuid4().hex, "process_count": jax.process_count(),
          "config": dataclasses.asdict(cfg)}
  if step is None and cfg.init_from:  # fresh optimizer state, parameters from HF weights
    trainer.state = convert.init_state_from_hf(trainer)
    return train_iter, 0, meta
  if step is None:
    trainer.init_state()
    return train_iter, 0, meta
  target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        trainer.abstract_state, trainer.shardings)
  state, saved, data_ok = source.restore(step, target, train_iter, dataclasses.asdict(cfg.model),
                                         not cfg.data.shard_documents_by_process)
  if source is not ckpt:
    source.close()
  trainer.state = state
  if not data_ok:
    logging.warning("the checkpoint was written by %s processes, this run has %d: the data order"
                    " restarts with a new shuffle (seed %d + step %d)", saved.get("process_count"),
                    jax.process_count(), cfg.data.seed, step)
    shifted = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seed=cfg.data.seed + step))
    train_iter = data.make_iterator(shifted, trainer.tokenizer, "train", jax.process_index(),
                                    jax.process_count())
  logging.info("restored step %d from %s", step, source.directory)
  return train_iter, step, dict(meta, run_id=saved.get("run_id", meta["run_id"]))


def _other_run(path: str, cfg: TrainConfig):
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
    with trainer.context():
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
        stop = stops.should_stop()
        eval_due = step % cfg.eval_every == 0 or step == cfg.steps
        if eval_due:
          flush({"eval_loss": trainer.evaluate()})
        if step % cfg.checkpoint.every_steps == 0 or step == cfg.steps or stop:
          flush()  # a non-finite step raises here, before anything is saved
          ckpt.save(step, trainer.state, step_data_state, meta, wait=stop or step == cfg.steps)
          last_saved = (step, step_data_state)
        if stop:
          print(f"{stops.requested}: checkpoint of step {step} saved in {ckpt.directory}; rerun"
                " the same command to resume")
          return False
      flush()
  except TrainingError:
    raise
  except Exception:
    step, state_of_data = dispatched
    if cfg.checkpoint.save_on_error and state_of_data is not None and step > last_saved[0]:
      logging.error("the loop raised at step %d: saving that step's state first", step)
      ckpt.save(step, trainer.state, state_of_data, meta, wait=True)
    raise
  return True


def finish(trainer: Trainer, workdir: str, is_writer: bool) -> None:
  """The run's loss-curve PNG and a sample of generated text (every process samples: the
  parameters are global arrays; only the writer writes)."""
  cfg = trainer.cfg
  if is_writer:
    plot.plot_losses(os.path.join(workdir, "metrics.jsonl"), os.path.join(workdir, "loss.png"),
                     title=f"meshtron: {cfg.model.num_params() / 1e6:.2f}M-parameter Llama")
  if cfg.sample_tokens > 0:
    prompt = list(trainer.tokenizer.encode(cfg.sample_prompt))
    if trainer.tokenizer.bos_id is not None:
      prompt = [trainer.tokenizer.bos_id] + prompt
    ids = sample.generate(trainer.graphdef, trainer.state.params, prompt, cfg.sample_tokens,
                          window=cfg.seq_len, temperature=cfg.sample_temperature, seed=cfg.seed)
    if not is_writer:
      return
    text = cfg.sample_prompt + trainer.tokenizer.decode(ids)
    with open(os.path.join(workdir, "sample.txt"), "w", encoding="utf-8") as f:
      f.write(text)
    logging.info("sample:\n%s", text)
    print(f"--- sample ({cfg.sample_tokens} tokens, temperature {cfg.sample_temperature}) ---")
    print(text)
  print(f"wrote {workdir}/metrics.jsonl, loss.png, sample.txt, tensorboard/")
