"""Config registry: `get(name or path.py)` is the CLI's parse function; `names()` lists presets."""

import os
import runpy
import traceback

from configs import llama, moe
from trainer.config import TrainConfig

_PRESETS = {"debug": llama.debug,
            **{name: (lambda n=name: llama.large(n)) for name in llama.MODELS if name != "debug"},
            "debug_moe": moe.debug_moe,
            **{name: (lambda n=name: moe.large(n)) for name in moe.MODELS if name != "debug_moe"}}


def names() -> list[str]:
  return sorted(_PRESETS)


def _where(path: str, error: Exception) -> str:
  """"config file PATH line N: Kind: message" for an error raised running a config file."""
  line = getattr(error, "lineno", None) if isinstance(error, SyntaxError) else None
  if line is None:
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if os.path.abspath(f.filename) == os.path.abspath(path)]
    line = frames[-1].lineno if frames else "?"
  message = (error.msg if isinstance(error, SyntaxError) else str(error)).strip().splitlines()
  return (f"config file {path} line {line}: {type(error).__name__}:"
          f" {message[0] if message else ''}")


def get(spec: str) -> TrainConfig:
  """A preset by name, or a Python file whose `get_config()` returns a TrainConfig."""
  if spec in _PRESETS:
    return _PRESETS[spec]()
  if spec.endswith(".py"):
    if not os.path.isfile(spec):
      raise ValueError(f"config file {spec} does not exist")
    try:
      config = runpy.run_path(spec).get("get_config", lambda: None)()
    except Exception as e:  # noqa: BLE001  (whatever the file raises: one line naming where)
      raise ValueError(_where(spec, e)) from None
    if not isinstance(config, TrainConfig):
      raise ValueError(f"{spec} must define get_config() returning a TrainConfig")
    return config
  raise ValueError(f"unknown config {spec!r}; presets: {', '.join(names())}, or a path/to/file.py")
