"""Errors that are meshtron's fault: one line that says so, the whole story in a file.

meshtron's own refusals of bad input are ValueErrors (and training stops) raised by meshtron's
code, one line each. Anything else reaching the command line (an exception of any other type,
or a ValueError raised inside JAX, Flax or XLA, such as a compiler's multi-line verifier
message) is a bug: the user gets one line naming it as one and the path of a file with the
full traceback, the command and the resolved config, to attach to a report.
"""

import dataclasses
import datetime
import json
import os
import platform
import sys
import tempfile
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = tuple(os.path.join(REPO, package) + os.sep
             for package in ("cli", "configs", "kernels", "models", "sharding", "trainer"))


def is_refusal(error: BaseException, refusal_types: tuple) -> bool:
  """Whether `error` is one of meshtron's one-line refusals: of `refusal_types`, raised by a
  line of meshtron's own packages (the innermost frame of its traceback)."""
  if not isinstance(error, refusal_types):
    return False
  frames = traceback.extract_tb(error.__traceback__)
  return bool(frames) and os.path.abspath(frames[-1].filename).startswith(OURS)


def write(error: BaseException, config=None, workdir: str = "") -> str:
  """Writes the report; returns its path: in `workdir` when that is an existing directory
  (beside the run it belongs to), else in the system's temp directory."""
  folder = workdir if workdir and os.path.isdir(workdir) else tempfile.gettempdir()
  stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
  path = os.path.join(folder, f"meshtron-bug-{stamp}.txt")
  versions = {}
  for name in ("jax", "jaxlib", "flax", "optax", "orbax.checkpoint"):
    module = sys.modules.get(name)
    versions[name] = getattr(module, "__version__", "not imported")
  lines = [f"meshtron bug report, {stamp}", f"command: {' '.join(sys.argv)}",
           f"python {platform.python_version()} on {platform.platform()}",
           "versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()), "",
           "".join(traceback.format_exception(error)).rstrip(), "", "config:",
           _config_text(config)]
  try:
    with open(path, "w", encoding="utf-8") as f:
      f.write("\n".join(lines) + "\n")
  except OSError:  # a full or read-only disk: the traceback goes to stderr instead
    traceback.print_exception(error)
    return "(could not be written; the traceback is above)"
  return path


def summary(error: BaseException, path: str) -> str:
  """The one line: what failed, that it is a bug, and where its report is."""
  text = str(error).strip()
  first = text.splitlines()[0] if text else ""
  return (f"internal error, a bug in meshtron: {type(error).__name__}"
          f"{': ' + first[:200] if first else ''}; the traceback and config are in {path}"
          " (please attach it to an issue)")


def _config_text(config) -> str:
  if config is None:
    return "(not parsed yet)"
  if dataclasses.is_dataclass(config):
    return json.dumps(dataclasses.asdict(config), indent=1, default=str)
  return repr(config)
