"""The process's host-memory allocator: glibc malloc keeps freed memory and backs it with huge pages.

XLA:CPU allocates a step's temporaries afresh on every step (gigabytes for the 100M benchmark
model). With glibc's defaults each large block is a new mmap, which the kernel faults in and zeroes
4 KiB at a time, and frees with munmap. Measured on the 100M model, one device:

- About 740k page faults per step.
- A quarter of the process's CPU time spent in the kernel.

With one arena, no mmap, no trimming and transparent huge pages, the heap is reused from step to
step: 0–500 faults per step, and the step went from 9.5 s to 5.9 s.
`benchmarks/train_step.py` reports `page_faults_per_step`.

glibc reads GLIBC_TUNABLES once, at process start. So the command-line entry points call
`reexec_with_tunables()` first, and the process replaces itself (same pid, same arguments) once;
the `meshtron` script (cli/main.py) does it before importing anything heavy.
Notebooks and other embedders can set the variable before starting Python (see docs/training.md).
"""

import os
import platform
import sys

TUNABLES = ("glibc.malloc.hugetlb=1:glibc.malloc.mmap_max=0:glibc.malloc.arena_max=1"
            ":glibc.malloc.trim_threshold=68719476736")
OPT_OUT = "MESHTRON_DEFAULT_MALLOC"  # set to 1 to keep glibc's default allocator settings


def tunables_env(environ=None) -> dict:
  """`environ` (default os.environ) with TUNABLES added to GLIBC_TUNABLES; settings already in
  GLIBC_TUNABLES win."""
  env = dict(os.environ if environ is None else environ)
  present = env.get("GLIBC_TUNABLES", "")
  keys = {item.split("=")[0] for item in present.split(":") if item}
  ours = [item for item in TUNABLES.split(":") if item.split("=")[0] not in keys]
  env["GLIBC_TUNABLES"] = ":".join(filter(None, [present] + ours))
  return env


def wanted() -> bool:
  """Whether this process should run with TUNABLES: Linux and glibc, no opt-out, not yet set."""
  return (sys.platform == "linux" and platform.libc_ver()[0] == "glibc"
          and os.environ.get(OPT_OUT, "") in ("", "0")
          and tunables_env()["GLIBC_TUNABLES"] != os.environ.get("GLIBC_TUNABLES"))


def reexec_with_tunables() -> None:
  """Replaces the process with itself under TUNABLES, unless it already runs with them. Call it
  first thing in a command-line entry point (before JAX or threads start)."""
  if wanted():
    os.execve(sys.executable, [sys.executable] + sys.orig_argv[1:], tunables_env())


if __name__ == "__main__":
  # `python -m trainer.process.host_memory CMD [ARGS...]` runs CMD under the tunables (e.g. pytest, or
  # jupyter, whose kernels inherit them).
  if len(sys.argv) < 2:
    sys.exit("usage: python -m trainer.process.host_memory CMD [ARGS...]")
  os.execvpe(sys.argv[1], sys.argv[1:], tunables_env())
