"""What reaches the user's terminal: one-line errors, and no start-up noise from native libraries.

JAX's CUDA plugin (installed for deviceless GPU compiles) logs "Could not find cuda drivers" from
C++ on a machine without a GPU, each time behind absl's "All log messages before
absl::InitializeLog() is called" preamble: 6-8 lines before every command. They are written to
file descriptor 2 directly, so Python's logging cannot filter them; `native_noise_filtered`
captures fd 2 around the imports and backend start that produce them and passes every other line.
"""

import contextlib
import glob
import os
import re
import sys
import tempfile

NOISE = (re.compile(r"^WARNING: All log messages before absl::InitializeLog\(\) is called"),
         re.compile(r"cudart_stub\.cc:\d+\] Could not find cuda drivers"))


def prefer_cpu_without_accelerators() -> None:
  """With JAX_PLATFORMS unset on a machine with no accelerator device nodes (NVIDIA, AMD, TPU),
  JAX runs on the CPU without probing the CUDA plugin, which would log a traceback ("Unable to
  load CUDA") before every command. Set JAX_PLATFORMS to choose otherwise."""
  if not os.environ.get("JAX_PLATFORMS") and not any(
      glob.glob(pattern) for pattern in ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/accel*")):
    os.environ["JAX_PLATFORMS"] = "cpu"


def quiet_unraisable_asyncio() -> None:
  """After a failed orbax restore, its reader coroutines and event loops are collected at
  interpreter exit and Python prints "Exception ignored ... Event loop is closed" tracebacks
  (sys.unraisablehook). Those say nothing the one-line error did not; other unraisable
  exceptions are reported as before."""
  default = sys.unraisablehook

  def hook(unraisable):
    error, where = unraisable.exc_value, repr(unraisable.object)
    if (isinstance(error, RuntimeError) and "Event loop is closed" in str(error)) or (
        "coroutine" in where or "Future" in where or "EventLoop" in where):
      return
    default(unraisable)

  sys.unraisablehook = hook


def fail(message: str, code: int = 1, at_once: bool = False) -> None:
  """Ends the command with one line on stderr; `at_once`: without the interpreter's shutdown
  (os._exit, the streams flushed), which native threads still running can crash."""
  print(f"meshtron: error: {message}", file=sys.stderr, flush=True)
  if at_once:
    sys.stdout.flush()
    os._exit(code)
  sys.exit(code)


@contextlib.contextmanager
def native_noise_filtered():
  """Routes file descriptor 2 into a temporary file while the block runs (keep it short: JAX's
  import and backend start), then writes every captured line but the known noise to stderr."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as capture:
    os.dup2(capture.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      capture.seek(0)
      kept = [line for line in capture.read().decode(errors="replace").splitlines(keepends=True)
              if not any(pattern.search(line) for pattern in NOISE)]
      sys.stderr.write("".join(kept))
      sys.stderr.flush()
