"""TrainConfig: everything a run needs, composed of typed dataclasses, validated in one place.

Plain mutable dataclasses because ml-collections applies `--config.a.b=v` overrides by setattr;
read-only by convention after `validate()`.
"""

import dataclasses

from models.compute import ComputeConfig
from models.config import ModelConfig
from sharding import Layout, MeshConfig, layout_of
from sharding.pipeline import schedules
from sharding.plan.estimate import Precision, trainer_precision
from sharding.xla import presets
from trainer import config_checks, tracking


@dataclasses.dataclass
class DataConfig:
  """Where tokens come from and how they are packed."""

  # "stdlib": the Python standard library sources of the running interpreter (no download);
  # "synthetic": uniform random tokens (benchmarks); otherwise a file, directory or glob of
  # .txt / .jsonl / .parquet files.
  source: str = "stdlib"
  text_field: str = "text"  # field holding the document in .jsonl / .parquet
  tokenizer: str = "byte"  # "byte" or a path to a Hugging Face tokenizer.json
  eval_fraction: float = 0.02  # of documents held out for eval (by a fixed hash of the index)
  seed: int = 0  # shuffle seed
  num_threads: int = 2  # grain read threads
  # Documents cut into pieces of at most this many tokens before packing (0 = no limit).
  max_document_tokens: int = 0
  # Multi-process: False (default) = every process reads the whole stream and keeps its rows of
  # each global batch (batches independent of the process count, exact resume on any count);
  # True = each process reads only its share of the documents (scales reading to huge corpora).
  shard_documents_by_process: bool = False
  # True: attention never crosses a document boundary inside a packed row (Llama 3's choice).
  # False: one causal mask over the whole row (Megatron's default, reset_attention_mask=False),
  # which lets cuDNN run without a mask bias. Synthetic rows are one document each: either way.
  document_mask: bool = True


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """The train step's own settings (trainer/step.py), besides the model (its architecture and
  how it is computed travel in its graph definition) and the layout (microbatches, pipeline
  schedule and split): the z-loss, the update guard and the gradient-accumulation dtype. Built
  from a TrainConfig by `TrainConfig.step()`."""

  z_loss: float = 0.0
  spike_factor: float = 0.0  # > 0: skip steps whose loss exceeds this x its running average
  grad_accum_dtype: str = "float32"
  document_mask: bool = True  # False: attention gets no document ids (trainer.step)


OPTIMIZERS = ("adamw", "muon")
GRAD_ACCUM_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass
class OptimConfig:
  """AdamW (or Muon for hidden matrices) with linear warmup and cosine decay, global-norm
  clipping. The learning rate, schedule and weight decay are shared by both."""

  learning_rate: float = 3e-3
  warmup_steps: int = 20
  min_learning_rate_ratio: float = 0.1  # cosine ends at this fraction of the peak
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  decay_embeddings: bool = False
  decay_norms: bool = False
  clip_norm: float = 1.0  # 0 disables clipping
  # "muon": attention/MLP/expert matrices take Muon (trainer/optim.py), the rest AdamW.
  name: str = "adamw"
  muon_beta: float = 0.95  # momentum (Nesterov)
  muon_ns_steps: int = 5  # Newton-Schulz iterations
  # Moonlight: the orthogonalized update times rms_scale x sqrt(max(fan_in, fan_out)) has AdamW's
  # update RMS (about 0.2), so Muon reuses AdamW's learning rate and weight decay.
  muon_rms_scale: float = 0.2
  # With model.param_dtype=bfloat16: the optimizer keeps float32 master copies of the parameters
  # (sharded like its moments, so ZeRO-1 and up split them over `data`) and updates those; the
  # parameters are their bf16 rounding (trainer/optim.py with_master_weights).
  master_weights: bool = False

  def validate(self) -> None:
    """Raises ValueError with a one-line message for a bad optimizer setting."""
    if self.name not in OPTIMIZERS:
      raise ValueError(f"optim.name={self.name!r} is not one of {OPTIMIZERS}")
    if not 0.0 <= self.muon_beta < 1.0:
      raise ValueError(f"optim.muon_beta must be in [0, 1), got {self.muon_beta}")
    if self.muon_ns_steps <= 0 or self.muon_rms_scale <= 0:
      raise ValueError(f"optim.muon_ns_steps and optim.muon_rms_scale must be positive, got"
                       f" {self.muon_ns_steps} and {self.muon_rms_scale}")


@dataclasses.dataclass
class CheckpointConfig:
  """Orbax checkpoints under WORKDIR/checkpoints; rerunning the same command resumes."""

  every_steps: int = 100  # also saved at the end and on preemption
  keep: int = 3  # the last `keep` checkpoints...
  keep_every: int = 0  # ...plus every checkpoint whose step is a multiple of this (0: none)
  async_save: bool = True
  # Signals that mean "finish this step, save, exit 0" (e.g. SLURM's --signal=USR1@120; SIGHUP
  # when the terminal closes); a second Ctrl-C (SIGINT) stops at once without saving.
  preemption_signals: str = "SIGTERM,SIGUSR1,SIGINT,SIGHUP"
  save_on_error: bool = True  # save the last good state when the loop raises
  # A SHA-256 of each file, written once a save commits and checked before restoring it.
  checksums: bool = True
  # A checkpoint failing its checksums: move it to checkpoints/corrupt/ and resume from the
  # newest earlier one that passes (else: stop with an error, changing nothing).
  fallback_on_corruption: bool = False
  # Start from another run's checkpoint directory (or one step directory of it) when this
  # workdir has none; layouts and device counts may differ.
  restore_from: str = ""


@dataclasses.dataclass
class DistributedConfig:
  """jax.distributed timeouts: short enough that a dead peer ends the job within a minute."""

  initialization_timeout_s: int = 300  # waiting for every process to join
  # With --coordinator: a process finding nothing at the coordinator, or process 0 hearing from
  # no other process, ends after this (0: wait the whole initialization_timeout_s).
  coordinator_probe_s: int = 60
  heartbeat_timeout_s: int = 30  # a process silent this long is dead: the others abort
  shutdown_timeout_s: int = 30  # waiting for peers at exit
  # GPUs of this process: "auto" (all of the node's with one process per node, else one per
  # process), or a list "0,1,2,3".
  local_device_ids: str = "auto"


@dataclasses.dataclass
class TrainConfig:
  """A training run: model, mesh, optimizer, data and the loop's cadence."""

  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  # How the model is computed: kernels, remat, fp8, loss chunking (not the architecture).
  compute: ComputeConfig = dataclasses.field(default_factory=ComputeConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
  # Overrides of the logical->mesh rules table, e.g. "embed=fsdp+data;mlp=tensor" (see sharding/).
  sharding_rules: str = ""
  # "hf:DIR": start (step 0, fresh optimizer state) from a Hugging Face directory's weights; its
  # config.json sets the model architecture, and its tokenizer.json replaces the byte tokenizer.
  # A checkpoint in the workdir (resume) or checkpoint.restore_from takes precedence.
  init_from: str = ""
  steps: int = 300
  batch_size: int = 16  # global, in sequences
  seq_len: int = 128
  microbatches: int = 1  # gradient accumulation: the batch is split into this many scanned pieces
  # dtype of the gradient sums carried across microbatches ("bfloat16" halves that buffer but
  # rounds every partial sum); the mean gradient is cast back to the parameter dtype.
  grad_accum_dtype: str = "float32"
  z_loss: float = 0.0
  # A non-finite loss or gradient norm never updates the state; then "stop" (exit non-zero,
  # keeping the last good checkpoint) or "skip" (go on; stop after max_consecutive_skips).
  nan_policy: str = "stop"
  max_consecutive_skips: int = 3
  loss_spike_factor: float = 0.0  # > 0: also skip steps whose loss exceeds this x its average
  inject_nan_at_step: int = 0  # fault injection for testing the guard: NaN loss at this step
  seed: int = 0
  log_every: int = 10
  # Run tracking beside metrics.jsonl and TensorBoard (trainer/tracking.py): "mlflow", "wandb"
  # or "mlflow,wandb" (the `tracking` extra). A resume logs into the same tracked runs.
  tracking: str = ""
  tracking_project: str = "meshtron"  # the W&B project and the MLflow experiment
  tracking_run_name: str = ""  # "" = the workdir's name
  tracking_mlflow_uri: str = ""  # "" = $MLFLOW_TRACKING_URI, else sqlite:///WORKDIR/mlflow.db
  tracking_wandb_mode: str = ""  # "online", "offline" or "disabled"; "" = $WANDB_MODE, else online
  eval_every: int = 100
  eval_batches: int = 4
  sample_tokens: int = 200  # generated at the end of `train` (0 = none)
  sample_temperature: float = 0.8
  sample_prompt: str = "def "
  # MFU denominator per device in FLOP/s; 0 = known GPU peak, else a measured matmul on CPU.
  peak_flops_per_device: float = 0.0
  compilation_cache_dir: str = "~/.cache/meshtron/xla"  # "" disables the persistent cache
  # Per-compile XLA options, "name=value,name=value" (e.g. GPU collective combine thresholds);
  # passed to jit(compiler_options=...) for training and `meshtron compile` alike.
  xla_options: str = ""
  # A named, versioned set of XLA options for compute/communication overlap (sharding/
  # presets.py: "auto", "none", "overlap_v1", ...); xla_options override it option by option.
  xla_preset: str = presets.DEFAULT_PRESET
  # Where XLA:GPU's rematerialization recomputed instructions to fit its memory estimate, compile
  # the step again with its limit raised and keep that program if its peak fits 95% of device
  # memory (trainer/xla_remat.py); False compiles once.
  recompile_without_xla_remat: bool = True
  # Memory per device in GiB for the fit check before training (the compiled program's peak must
  # fit); 0 = the device's own limit where the backend reports one (GPUs), else no check.
  device_memory_gib: float = 0.0
  # Refuse a layout that shards parameters yet leaves more than this fraction of their bytes
  # whole on every device (catches rule overrides that silently replicate).
  max_replicated_fraction: float = 0.1

  def validate(self) -> None:
    """Raises ValueError with a one-line message naming the bad field and how to fix it: every
    number in its range and every path present (trainer/config_checks.py), every choice known."""
    self.model.validate()
    self.compute.validate(self.model)
    self.optim.validate()
    if self.optim.master_weights and self.model.param_dtype == "float32":
      raise ValueError("optim.master_weights keeps float32 copies of lower-precision parameters,"
                       " but model.param_dtype is float32: set --config.model.param_dtype="
                       "bfloat16, or drop optim.master_weights")
    config_checks.check_ranges(self)
    if self.grad_accum_dtype not in GRAD_ACCUM_DTYPES:
      raise ValueError(f"grad_accum_dtype={self.grad_accum_dtype!r} is not one of"
                       f" {GRAD_ACCUM_DTYPES}")
    if self.batch_size % self.microbatches:
      raise ValueError(f"batch_size={self.batch_size} is not divisible by"
                       f" microbatches={self.microbatches}")
    if self.nan_policy not in ("stop", "skip"):
      raise ValueError(f"nan_policy must be 'stop' or 'skip', got {self.nan_policy!r}")
    if 0 < self.loss_spike_factor <= 1:
      raise ValueError(f"loss_spike_factor={self.loss_spike_factor} would skip ordinary steps: use"
                       " 0 (off) or a factor above 1, e.g. 3")
    if self.mesh.pipeline_schedule not in schedules.SCHEDULES:
      raise ValueError(f"mesh.pipeline_schedule={self.mesh.pipeline_schedule!r} is not one of"
                       f" {', '.join(schedules.SCHEDULES)}")
    if not self.compute.scan_layers and self.mesh.pipeline > 1:
      raise ValueError("compute.scan_layers=false stores each layer apart, but pipeline stages"
                       " split a stack of layers: set compute.scan_layers=true or mesh.pipeline=1")
    if self.init_from and (not self.init_from.startswith("hf:") or self.init_from == "hf:"):
      raise ValueError(f"init_from must be empty or hf:<Hugging Face model directory>, got"
                       f" {self.init_from!r}")
    if self.init_from and self.model.mtp_depth:
      raise ValueError("init_from=hf:... loads no multi-token prediction weights (the Hugging Face"
                       " formats here hold none): set model.mtp_depth=0, or train from scratch")
    config_checks.check_paths(self)
    config_checks.check_signals(self)
    tracking.backends_of(self.tracking)
    if self.tracking_wandb_mode not in ("",) + tracking.WANDB_MODES:
      raise ValueError(f"tracking_wandb_mode={self.tracking_wandb_mode!r} is not one of"
                       f" {', '.join(tracking.WANDB_MODES)} (or empty: $WANDB_MODE)")
    if self.tracking and not self.tracking_project.strip():
      raise ValueError("tracking_project is empty: name the W&B project / MLflow experiment"
                       " (--config.tracking_project)")
    presets.resolve(self.xla_preset)  # names the known presets if not one of them

  def step(self) -> StepConfig:
    """The train step's own settings."""
    return StepConfig(z_loss=self.z_loss, spike_factor=self.loss_spike_factor,
                      grad_accum_dtype=self.grad_accum_dtype,
                      document_mask=self.data.document_mask)

  def precision(self) -> Precision:
    """What this run stores per element, for the analytic memory model (sharding/plan)."""
    # The analytic step prices the layers' GEMMs on fp8 tensor cores when all of them are fp8.
    layers = ("attention", "mlp") + (("experts",) if self.model.moe else ())
    return trainer_precision(self.model.dtype, self.model.param_dtype, self.grad_accum_dtype,
                             self.optim.master_weights,
                             all(self.compute.fp8.applies_to(t) for t in layers),
                             self.compute.fp8.recipe == "tensorwise")

  def layout(self, num_devices: int) -> Layout:
    """This run's parallel layout on `num_devices` devices (sharding.layout_of): the checks that
    need no devices, as one-line errors."""
    return layout_of(self.mesh, num_devices, self.model, self.compute,
                     batch_size=self.batch_size, seq_len=self.seq_len,
                     microbatches=self.microbatches)


def parse_xla_options(text: str) -> dict:
  """"a=1,b=true,c=x" -> {"a": 1, "b": True, "c": "x"} for jit(compiler_options=...)."""
  options = {}
  for item in filter(None, (p.strip() for p in text.split(","))):
    name, sep, value = item.partition("=")
    if not sep or not name.strip():
      raise ValueError(f"xla_options item {item!r} must look like name=value")
    value = value.strip()
    if value.lower() in ("true", "false"):
      options[name.strip()] = value.lower() == "true"
    else:
      try:
        options[name.strip()] = int(value)
      except ValueError:
        try:
          options[name.strip()] = float(value)
        except ValueError:
          options[name.strip()] = value
  return options


def compiler_options(cfg: TrainConfig, mesh_sizes: dict[str, int]) -> dict:
  """The XLA options of the train step on a mesh of these sizes: the preset's (`auto` depends on
  the mesh and the microbatches), overridden by explicit xla_options."""
  return presets.compiler_options(cfg.xla_preset, parse_xla_options(cfg.xla_options),
                                    mesh_sizes, cfg.microbatches)


def config_from_dict(cls, values: dict):
  """Rebuilds a (nested) config dataclass from `dataclasses.asdict` output."""
  kwargs = {}
  for field in dataclasses.fields(cls):
    if field.name in values:
      value = values[field.name]
      kwargs[field.name] = (config_from_dict(field.type, value)
                            if dataclasses.is_dataclass(field.type) else value)
  return cls(**kwargs)


def describe_fields(cfg, prefix: str = "") -> list[str]:
  """Every leaf field of a (nested) config as "a.b: type = value" (`meshtron ... --show_config`);
  a nested config that is None (model.moe of a dense model) is one line."""
  lines = []
  for field in dataclasses.fields(cfg):
    value, name = getattr(cfg, field.name), f"{prefix}{field.name}"
    if dataclasses.is_dataclass(value):
      lines += describe_fields(value, f"{name}.")
    else:
      kind = field.type if isinstance(field.type, str) else getattr(
          field.type, "__name__", str(field.type))
      lines.append(f"{name}: {kind} = {value!r}")
  return lines
