"""Test set-up, configured before JAX starts: 8 fake CPU devices and a persistent compile cache;
or, with MESHTRON_GPU_TESTS set (benchmarks/gpu_check.py sets it), the `gpu`-marked tests alone.

MESHTRON_GPU_TESTS:
  unset       the CPU suite: JAX_PLATFORMS=cpu, 8 fake devices; `gpu` tests skip, saying why.
  "gpu"       the `gpu` tests on the machine's GPU (JAX's CUDA plugin picks it); each asserts
              that it really ran there. Other tests skip: they assume 8 fake CPU devices.
  "rehearse"  the `gpu` tests' own code on one CPU device at small sizes, so a GPU session does
              not spend its minutes on a typo; GPU-only parts (cuDNN, jax-triton) skip. Not a GPU
              result: tests/test_gpu_check.py runs it in the CPU suite.
"""

import dataclasses
import json
import os

import pytest

from trainer.process import cpu_threads

GPU_MODE = os.environ.get("MESHTRON_GPU_TESTS", "")
if GPU_MODE not in ("", "gpu", "rehearse"):
  raise pytest.UsageError(f"MESHTRON_GPU_TESTS={GPU_MODE!r}: expected 'gpu', 'rehearse' or unset")

if GPU_MODE != "gpu":
  os.environ["JAX_PLATFORMS"] = "cpu"
else:  # GPU memory on demand: some gpu tests start processes of their own beside this one
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
if not GPU_MODE:
  # LLVM -O0 for the CPU programs compiled in the test processes: XLA's optimized HLO (sharding,
  # collectives, buffer sizes) is the default build's (tests/test_layout_programs.py) and
  # compiles in ~40% less time; the machine code differs (floats by rounding, ~3e-6 after 3 AdamW
  # steps, on both sides of every in-process comparison). Tests that start `meshtron` drop
  # XLA_FLAGS. Never on a GPU: the flag would also build the GPU kernels unoptimized.
  # XLA:CPU aborts the process when a device waits 40 s for its peers at a collective. On a
  # loaded 2-core machine a peer can be that late without being stuck, so the tests allow 300 s.
  # (A `make test-all` worker aborted in a case that passes alone while the machine also ran
  # GPU compiles; pytest's capture kept XLA's message, so the cause is not known for sure.)
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8"
                             + " --xla_backend_optimization_level=0"
                             + " --xla_cpu_collective_call_terminate_timeout_seconds=300").strip()
  cpu_threads.ensure_threads_for(8)  # or a test's collectives can starve (the module says how)

import jax  # noqa: E402  (must follow the environment set-up above)

jax.config.update("jax_numpy_rank_promotion", "raise")
_CACHE = os.path.join(os.path.dirname(os.path.dirname(__file__)), ".jax_cache")
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


XDIST_WORKER = []  # set by pytest_configure: whether this process is a pytest-xdist worker


def pytest_configure(config):
  XDIST_WORKER.append(hasattr(config, "workerinput"))
  config.addinivalue_line("markers", "gpu: runs on an NVIDIA GPU (`make gpu-check`); skipped, with"
                                     " the reason shown, everywhere else")


SLOW_CASES = os.path.join(os.path.dirname(__file__), "slow_cases.txt")


def slow_case_ids() -> set[str]:
  """The test ids tests/slow_cases.txt moves out of the default suite into `make test-all`."""
  with open(SLOW_CASES, encoding="utf-8") as f:
    return {line.strip() for line in f if line.strip() and not line.startswith("#")}


@pytest.hookimpl(tryfirst=True)  # before `-m 'not slow'` deselects by the marks
def pytest_collection_modifyitems(config, items):
  slow, collected = slow_case_ids(), {item.nodeid for item in items}
  for item in items:
    if item.nodeid in slow:
      item.add_marker(pytest.mark.slow)
  # A renamed test would leave its line behind and run in the default suite again: checked for
  # each file collected whole (not where the command line named some of its tests).
  root = str(config.rootpath)
  named_in_part = {os.path.relpath(os.path.abspath(a.split("::")[0]), root)
                   for a in config.args if "::" in a}
  whole = {i.split("::")[0] for i in collected} - named_in_part
  stale = sorted(i for i in slow if i.split("::")[0] in whole and i not in collected)
  if stale:
    raise pytest.UsageError(f"{SLOW_CASES} names {stale[0]}, which is no test: fix or remove that"
                            " line")


def pytest_runtest_setup(item):
  on_gpu_marker = item.get_closest_marker("gpu") is not None
  if on_gpu_marker and not GPU_MODE:
    pytest.skip("needs an NVIDIA GPU: `make gpu-check` runs it on a GPU machine (docs/gpu-check.md,"
                " GPU results)")
  if GPU_MODE and not on_gpu_marker:
    pytest.skip(f"MESHTRON_GPU_TESTS={GPU_MODE} runs only the gpu tests (this one assumes 8 fake"
                " CPU devices)")


def pytest_runtest_logreport(report):
  """With MESHTRON_GPU_TEST_LOG set (gpu_check's tests phase): one JSON line per test as it
  ends, with its failure message, so a phase its budget cuts short keeps what finished."""
  path = os.environ.get("MESHTRON_GPU_TEST_LOG")
  # Under pytest-xdist the controller logs every worker's reports: a worker logging too doubles.
  # (This process's config says whether it is a worker; the environment may be inherited.)
  worker = XDIST_WORKER and XDIST_WORKER[-1]
  if not path or worker or (report.when != "call" and report.outcome == "passed"):
    return
  message = ""
  if report.outcome != "passed" and report.longrepr is not None:
    crash = getattr(report.longrepr, "reprcrash", None)  # failures: the raising line
    message = crash.message if crash else str(report.longrepr)
  with open(path, "a", encoding="utf-8") as f:
    f.write(json.dumps({"test": report.nodeid, "outcome": report.outcome, "when": report.when,
                        "seconds": round(report.duration, 2), "message": message[:2000]}) + "\n")


@dataclasses.dataclass(frozen=True)
class GpuRun:
  """Where a `gpu` test runs: the GPU, or (rehearsal) the CPU at small sizes."""

  device: jax.Device
  rehearsal: bool

  def pick(self, on_gpu, in_rehearsal):
    """The GPU-sized value, or the small one in a rehearsal."""
    return in_rehearsal if self.rehearsal else on_gpu

  def needs_gpu(self, what: str) -> None:
    """Skips in a rehearsal: `what` exists only on an NVIDIA GPU."""
    if self.rehearsal:
      pytest.skip(f"rehearsal on the CPU: {what} runs only on an NVIDIA GPU")


@pytest.fixture(scope="session")
def gpu() -> GpuRun:
  device = jax.devices()[0]
  if GPU_MODE == "gpu":
    assert device.platform == "gpu", (
        f"MESHTRON_GPU_TESTS=gpu but JAX's first device is {device.platform} ({device}): the"
        " CUDA plugin found no GPU")
  return GpuRun(device=device, rehearsal=GPU_MODE == "rehearse")
