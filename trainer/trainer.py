"""The Trainer: everything built once for a run (layout, model, optimizer, shardings, jitted
steps), abstract until `init_state()` materializes the state directly into its shardings."""

import dataclasses

import jax

import sharding
from models import abstract_model, param_names
from sharding import report
from sharding.plan import estimate, hardware, optimizer_cost
from sharding.xla import compiled, presets, step_time
from trainer import data, xla_remat
from trainer.config import TrainConfig, compiler_options
from trainer.optim import make_optimizer
from trainer.state import make_init_fn, state_shardings, unstored
from trainer.step import BATCH_KEYS, make_eval_step, make_train_step
from trainer.tokenizer import make_tokenizer


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
    # The whole layout, resolved once (sharding/resolution.py): the mesh, the rules and every
    # decision the traced programs read from it; handed to the model and the step explicitly.
    self.layout = sharding.resolve(cfg.mesh, jax.devices() if devices is None else devices,
                                   cfg.model, cfg.compute, batch_size=cfg.batch_size,
                                   seq_len=cfg.seq_len, microbatches=cfg.microbatches,
                                   rule_overrides=cfg.sharding_rules)
    self.mesh, self.rules = self.layout.mesh, self.layout.rules
    with self.scope():
      # The model as the eval step runs it, and as the train step does (inside its pipeline
      # stages or its replicas' vmap: sharding.Layout.in_train_step).
      self.graphdef, _ = abstract_model(cfg.model, cfg.compute, self.layout)
      step_layout = self.layout.in_train_step()
      self.step_graphdef = self.graphdef if step_layout == self.layout else abstract_model(
          cfg.model, cfg.compute, step_layout)[0]
      self.names = param_names(cfg.model, cfg.compute)
      self.tx, self.lr = make_optimizer(cfg.optim, self.names, cfg.steps)
      # Uneven pipeline stages: the layer stacks are stored padded per stage (stage_split.py).
      self.stage_layers = self.layout.stacks
      self.step_config = cfg.step()
      self._init = make_init_fn(cfg.model, self.tx, cfg.seed, self.stage_layers, cfg.compute)
      self.abstract_state = jax.eval_shape(self._init)
      self.param_rows = report.param_rows(self.layout, self.names, self.abstract_state.params)
      report.check_replication(self.layout, self.param_rows, cfg.max_replicated_fraction,
                               self.layout.rules_for(cfg.model.vocab_size, cfg.seq_len))
      self.shardings = state_shardings(self.abstract_state, self.names, self.tx)
      shape = (cfg.batch_size, cfg.seq_len)
      self.batch_sharding = {
          k: sharding.named_sharding(("batch", "seq"), shape, f"batch/{k}") for k in BATCH_KEYS}
      replicated = sharding.replicated()
      self.compiler_options = options = presets.check_options(  # fails at start-up
          compiler_options(cfg, sharding.mesh_sizes(self.mesh)))
      # Bound to the layout: whoever traces them, they trace with this mesh and these rules.
      self.step_fn = self.layout.bind(make_train_step(self.step_graphdef, self.names, self.tx,
                                                      self.lr, self.layout, self.step_config))
      self.train_step = jax.jit(self.step_fn, in_shardings=(self.shardings, self.batch_sharding),
                                out_shardings=(self.shardings, replicated), donate_argnums=0,
                                compiler_options=options or None)
      self.eval_step = jax.jit(self.layout.bind(make_eval_step(self.graphdef, self.layout,
                                                               self.step_config)),
                               in_shardings=(self.shardings.params, self.batch_sharding),
                               out_shardings=replicated)
    self.state = None
    self.compiled_step = None  # set by compile()

  def compile(self) -> "compiled.CompiledReport":
    """Compiles the train step ahead of time (the program training runs) and refuses a layout
    whose compiled peak memory exceeds the device memory."""
    limit, where = self.memory_limit()
    executable, seconds, remat_note = self.compile_step(limit)
    self.compiled_step = executable
    rep = compiled.report(executable, "local", list(self.mesh.devices.flat), seconds)
    if remat_note:
      rep.extra["xla rematerialization"] = remat_note
    if limit and not compiled.fits(rep, limit)[0]:
      raise ValueError(
          f"the compiled train step needs {rep.memory['peak'] / 2**30:.2f} GiB per device (peak:"
          f" arguments {rep.memory['argument'] / 2**30:.2f}, temporaries"
          f" {rep.memory['temp'] / 2**30:.2f}) but {where} {limit / 2**30:.2f} GiB; shard"
          " more (fsdp, tensor, zero_stage), recompute more (compute.remat) or shrink the batch")
    return rep

  def compile_step(self, device_memory_bytes: int, gpus_per_node: int = 0):
    """(compiled train step, seconds, a line on XLA's rematerialization or ""): compiled again
    with XLA's memory limit raised where XLA recomputed instructions, kept if it fits and is
    predicted faster on a GPU with a profile (trainer/xla_remat.py;
    cfg.recompile_without_xla_remat). gpus_per_node: 0 = this process's devices."""
    devices = list(self.mesh.devices.flat)
    profile = hardware.profile_of_device(getattr(devices[0], "device_kind", ""))
    per_node = gpus_per_node or jax.local_device_count()
    step_seconds = None if profile is None else (
        lambda text: step_time.predict(text, profile, per_node).step_s)
    with self.scope():
      lowered = self.train_step.lower(self.abstract_state, self.abstract_batch())
      return xla_remat.compile_step(lowered, device_memory_bytes, self.compiler_options,
                                    self.cfg.recompile_without_xla_remat, step_seconds)

  def memory_limit(self) -> tuple[int, str]:
    """(bytes one device may use, what that is): --config.device_memory_gib, else the GPU's own
    limit, else on CPU the host's available memory shared by this process's devices."""
    if self.cfg.device_memory_gib:
      return int(self.cfg.device_memory_gib * 2**30), "device_memory_gib allows"
    device = jax.local_devices()[0]
    limit = int((device.memory_stats() or {}).get("bytes_limit", 0))
    if limit:
      return limit, "the device has"
    if device.platform == "cpu":
      local = len([d for d in self.mesh.devices.flat if d.process_index == jax.process_index()])
      return host_available_bytes() // max(local, 1), f"each of {local} CPU devices gets of the" \
          " host's available memory"
    return 0, ""

  def check_host_memory_estimate(self) -> None:
    """Before compiling: refuses a layout whose analytic per-device memory (sharding/plan) is
    already above the limit; the compiled figure decides in `compile()`."""
    limit, where = self.memory_limit()
    if not limit:
      return
    cfg = self.cfg
    precision = cfg.precision()
    # The attention this platform runs ("auto" is the XLA reference here, with its [s, s] scores).
    model = estimate.model_spec(cfg.model, dataclasses.replace(
        cfg.compute, attention_impl=self.layout.attention))
    need = optimizer_cost.run_memory(model, self.layout, cfg.seq_len, precision,
                                     optimizer=cfg.optim.name, fp8=cfg.compute.fp8,
                                     workspace_bytes=0).total
    if need > limit:
      raise ValueError(
          f"the train step needs about {need / 2**30:.2f} GiB per device (analytic estimate) but"
          f" {where} {limit / 2**30:.2f} GiB; shard more (fsdp, tensor, zero_stage), recompute"
          " more (compute.remat) or shrink the batch")

  def init_state(self) -> None:
    """Creates the train state sharded from the start (no unsharded copy ever exists)."""
    with self.scope():
      self.state = jax.jit(self._init, out_shardings=self.shardings)()

  def model_params(self):
    """The model's own parameters (the padding rows of uneven pipeline stages dropped)."""
    return unstored(self.state.params, self.stage_layers)

  def abstract_batch(self) -> dict:
    return {k: jax.ShapeDtypeStruct((self.cfg.batch_size, self.cfg.seq_len),
                                    "float32" if k == "loss_mask" else "int32", sharding=sh)
            for k, sh in self.batch_sharding.items()}

  def unsharded_graphdef(self):
    """The model as one device runs it, with this layout's kernels (sampling: the parameters
    are global arrays and jit places the rest)."""
    return abstract_model(self.cfg.model, self.cfg.compute, self.layout.unsharded())[0]

  def sharding_report(self) -> str:
    """Every parameter (shape, logical names, spec, bytes per device) and every activation
    constraint of the train step, traced abstractly."""
    with self.scope(), sharding.record_constraints() as recorded:
      jax.eval_shape(self.step_fn, self.abstract_state, self.abstract_batch())
    per_device = sum(r.bytes_per_device for r in self.param_rows)
    return "\n".join([
        self.layout.describe(),
        "parameters:", report.format_rows(self.param_rows),
        f"parameter bytes per device: {per_device:,}"
        f" ({report.replicated_fraction(self.param_rows):.1%} of bytes replicated)",
        "activations:", report.format_rows(report.activation_rows(recorded), with_bytes=False)])

  def scope(self):
    return self.layout.scope()

  def iterator(self, split: str):
    return data.make_iterator(self.cfg, self.tokenizer, split, jax.process_index(),
                              jax.process_count())

  def to_device(self, local_batch: dict) -> dict:
    """Host-local numpy rows -> global arrays sharded on (batch, seq)."""
    return {k: jax.make_array_from_process_local_data(self.batch_sharding[k], local_batch[k])
            for k in BATCH_KEYS}

  def evaluate(self, should_stop=lambda: False) -> float | None:
    """Mean eval loss over the same `eval_batches` batches every time; None when `should_stop()`
    (asked before each batch after the first, on every process) cut it short."""
    if self.cfg.data.eval_fraction == 0 or self.cfg.data.source == "synthetic":
      it = None
    else:
      it = self.iterator("eval")
    if it is None:
      return float("nan")
    nll, tokens = 0.0, 0.0
    with self.scope():
      for i in range(self.cfg.eval_batches):
        if i and should_stop():
          return None
        out = jax.device_get(self.eval_step(self.state.params, self.to_device(next(it))))
        nll, tokens = nll + float(out["nll_sum"]), tokens + float(out["tokens"])
    return nll / max(tokens, 1.0)


def host_available_bytes() -> int:
  """The host memory available to new allocations (Linux MemAvailable), 0 when unknown."""
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return 0
