"""The ranges and paths every TrainConfig setting is checked against before anything runs
(TrainConfig.validate): one line naming the field, what it must be, and the flag that sets it."""

import dataclasses
import glob
import math
import os
import signal

from sharding.mesh import parse_dcn

INF = float("inf")


@dataclasses.dataclass(frozen=True)
class Range:
  low: float = -INF
  high: float = INF
  low_open: bool = False  # low itself is not allowed
  high_open: bool = False

  def holds(self, value) -> bool:
    above = value > self.low if self.low_open else value >= self.low
    below = value < self.high if self.high_open else value <= self.high
    return above and below

  def describe(self) -> str:
    low = f"{'>' if self.low_open else '>='} {self.low:g}" if self.low > -INF else ""
    high = f"{'<' if self.high_open else '<='} {self.high:g}" if self.high < INF else ""
    return " and ".join(p for p in (low, high) if p)


COUNT, NONNEGATIVE = Range(1), Range(0)
POSITIVE, FRACTION = Range(0, low_open=True), Range(0, 1)
# Dotted TrainConfig field -> the range its value must lie in (model fields: ModelConfig.validate).
RANGES = {
    "steps": COUNT, "batch_size": COUNT, "seq_len": COUNT, "microbatches": COUNT,
    "log_every": COUNT, "eval_every": COUNT, "eval_batches": COUNT,
    "max_consecutive_skips": NONNEGATIVE, "inject_nan_at_step": NONNEGATIVE,
    "z_loss": NONNEGATIVE, "loss_spike_factor": NONNEGATIVE, "sample_tokens": NONNEGATIVE,
    "sample_temperature": POSITIVE, "peak_flops_per_device": NONNEGATIVE,
    "device_memory_gib": NONNEGATIVE, "max_replicated_fraction": FRACTION,
    "optim.learning_rate": POSITIVE, "optim.warmup_steps": NONNEGATIVE,
    "optim.min_learning_rate_ratio": FRACTION, "optim.b1": Range(0, 1, high_open=True),
    "optim.b2": Range(0, 1, high_open=True), "optim.eps": POSITIVE,
    "optim.weight_decay": NONNEGATIVE, "optim.clip_norm": NONNEGATIVE,
    "data.eval_fraction": Range(0, 1, high_open=True), "data.num_threads": COUNT,
    "data.max_document_tokens": NONNEGATIVE,
    "checkpoint.every_steps": COUNT, "checkpoint.keep": COUNT, "checkpoint.keep_every": NONNEGATIVE,
    "distributed.initialization_timeout_s": COUNT, "distributed.heartbeat_timeout_s": COUNT,
    "distributed.shutdown_timeout_s": COUNT, "distributed.coordinator_probe_s": NONNEGATIVE,
    "mesh.virtual_stages": COUNT,
}


def value_of(cfg, dotted: str):
  """The setting a dotted name ("optim.b2") names in `cfg`."""
  for part in dotted.split("."):
    cfg = getattr(cfg, part)
  return cfg


def check_finite(cfg, prefix: str = "") -> None:
  """ValueError for the first float setting, in any section, that is nan or infinite: none
  means "off" or "no limit" (those are 0 where they exist)."""
  for field in dataclasses.fields(cfg):
    value = getattr(cfg, field.name)
    if dataclasses.is_dataclass(value):
      check_finite(value, f"{prefix}{field.name}.")
    elif isinstance(value, float) and not math.isfinite(value):
      raise ValueError(f"{prefix}{field.name}={value} is not a finite number"
                       f" (--config.{prefix}{field.name})")


def check_formats(cfg) -> None:
  """The text settings with a syntax, checked on every run, not only where they are read (mesh.dcn
  on several hosts, local_device_ids with several processes)."""
  parse_dcn(cfg.mesh.dcn)
  ids = cfg.distributed.local_device_ids
  if ids not in ("auto", "") and not all(i.strip().isdigit() for i in ids.split(",")):
    raise ValueError(f"distributed.local_device_ids={ids!r} must be 'auto' or GPU indices such"
                     " as 0,1,2,3 (--config.distributed.local_device_ids)")


def check_ranges(cfg) -> None:
  """ValueError for the first setting outside its range (or not a number)."""
  check_finite(cfg)
  check_formats(cfg)
  for dotted, allowed in RANGES.items():
    value = value_of(cfg, dotted)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not allowed.holds(value):
      raise ValueError(f"{dotted}={value!r} is out of range: it must be {allowed.describe()}"
                       f" (--config.{dotted})")


def check_paths(cfg) -> None:
  """ValueError naming the first path setting that does not exist (data.source, the tokenizer,
  checkpoint.restore_from, init_from); the files' contents are checked where they are read."""
  data = cfg.data
  if data.source not in ("stdlib", "synthetic") and not glob.glob(os.path.expanduser(data.source)):
    raise ValueError(f"data.source={data.source!r} does not exist (a file, directory or glob of"
                     " .txt/.jsonl/.parquet; or 'stdlib' / 'synthetic')")
  if data.tokenizer != "byte" and not os.path.isfile(os.path.expanduser(data.tokenizer)):
    raise ValueError(f"data.tokenizer={data.tokenizer!r} is not 'byte' or an existing"
                     " tokenizer.json file")
  restore = cfg.checkpoint.restore_from
  if restore and not os.path.isdir(os.path.expanduser(restore)):
    raise ValueError(f"checkpoint.restore_from={restore!r} is not a directory (a run's checkpoint"
                     " directory, or one step directory of it)")
  if cfg.init_from.startswith("hf:") and len(cfg.init_from) > 3:
    model_dir = os.path.expanduser(cfg.init_from[3:])
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
      raise ValueError(f"init_from={cfg.init_from!r}: {model_dir} holds no config.json (a Hugging"
                       " Face model directory)")


def preemption_signals(names: str) -> list[signal.Signals]:
  """The signals a comma-separated `names` (checkpoint.preemption_signals) lists; ValueError for
  a name that is not a signal a process can catch (SIGKILL and SIGSTOP cannot be)."""
  out = []
  for name in filter(None, (n.strip() for n in names.split(","))):
    number = getattr(signal, name, None)
    if not isinstance(number, signal.Signals) or name in ("SIGKILL", "SIGSTOP"):
      raise ValueError(f"checkpoint.preemption_signals: {name!r} is not a signal a process can"
                       " catch; use names such as SIGTERM,SIGUSR1,SIGINT"
                       " (--config.checkpoint.preemption_signals)")
    out.append(number)
  return out


def check_signals(cfg) -> None:
  """checkpoint.preemption_signals checked before compiling, not when the loop installs its
  handlers (trainer/process/preemption.py reads them with preemption_signals too)."""
  preemption_signals(cfg.checkpoint.preemption_signals)
