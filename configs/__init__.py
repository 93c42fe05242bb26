"""Config registry: `get(name or path.py)` is the CLI's parse function; `names()` lists presets."""

import os
import runpy

from configs import llama, moe
from trainer.config import TrainConfig

_PRESETS = {"debug": llama.debug,
            **{name: (lambda n=name: llama.large(n)) for name in llama.MODELS if name != "debug"},
            "debug_moe": moe.debug_moe,
            **{name: (lambda n=name: moe.large(n)) for name in moe.MODELS if name != "debug_moe"}}


def names() -> list[str]:
  return sorted(_PRESETS)


def get(spec: str) -> TrainConfig:
  """A preset by name, or a Python file whose `get_config()` returns a TrainConfig."""
  if spec in _PRESETS:
    return _PRESETS[spec]()
  if spec.endswith(".py"):
    if not os.path.exists(spec):
      raise ValueError(f"config file {spec} does not exist")
    config = runpy.run_path(spec).get("get_config", lambda: None)()
    if not isinstance(config, TrainConfig):
      raise ValueError(f"{spec} must define get_config() returning a TrainConfig")
    return config
  raise ValueError(f"unknown config {spec!r}; presets: {', '.join(names())}, or a path/to/file.py")
