"""Enough threads for simulated CPU devices to reach their collectives.

XLA:CPU runs every simulated device's program on one thread pool of the process. By default the
pool is as large as the machine's core count or the device count, whichever is larger. A
collective holds its thread while it waits for its peers, and a device's program can have several
collectives in flight at once. So on a 2-core machine with 8 devices the pool can fill up with
waiting collectives. Devices 0-3 then wait in a permute and in two all-gathers and all-reduces,
devices 4-7 get no thread to reach them, and after 40 s XLA aborts the process ("Termination
timeout ... exceeded"). tests/test_mtp.py::test_depth_two_trains_like_one_device_under_more_layouts
did this on every run. XLA reads the pool's size from NPROC (xla/pjrt/utils.cc,
DefaultThreadPoolSize) when the CPU backend starts, so this must run before then.
"""

import os

# Two collectives waiting on every device and one thread running: the MTP case needed 12 (two
# waiting on each of 4 devices, one for each of the other 4). More may cost time: with 8 per
# device, two copies of a pipeline test side by side took 217 s once and 45 s once, against
# 42 s twice with the default pool.
THREADS_PER_DEVICE = 3


_OURS = "MESHTRON_SIMULATED_DEVICES_NPROC"  # the NPROC this module set, so it can be left out


def ensure_threads_for(devices: int, environ=None) -> None:
  """Sizes XLA:CPU's pool for `devices` simulated devices, unless NPROC is set already."""
  environ = os.environ if environ is None else environ
  if not environ.get("NPROC"):
    environ["NPROC"] = environ[_OURS] = str(max(os.cpu_count() or 1,
                                                THREADS_PER_DEVICE * devices))


def without_ours(environ: dict) -> dict:
  """`environ` without the NPROC set above, for a process that simulates no devices: a GPU
  compile sizes its own pools by it (a compile-only test took 53 s with NPROC=24, 46 s without)."""
  env = dict(environ)
  if env.get(_OURS) and env.get(_OURS) == env.get("NPROC"):
    del env["NPROC"], env[_OURS]
  return env
