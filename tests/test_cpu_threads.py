"""XLA:CPU's thread pool is sized for the simulated devices (trainer/process/cpu_threads.py), so
that collectives waiting on some devices cannot leave the others without a thread. The case that
hung without it, tests/test_mtp.py::test_depth_two_trains_like_one_device_under_more_layouts, is a
`make test-all` case; these check the pool itself."""

import os

import jax
import jax.numpy as jnp

from trainer.process import cpu_threads


def test_the_pool_is_sized_for_the_devices_unless_nproc_is_set():
  environ = {}
  cpu_threads.ensure_threads_for(8, environ)
  assert environ["NPROC"] == str(max(os.cpu_count(), 8 * cpu_threads.THREADS_PER_DEVICE))
  mine = {"NPROC": "12"}
  cpu_threads.ensure_threads_for(8, mine)
  assert mine == {"NPROC": "12"}  # the user's setting wins
  # A GPU compile's subprocess gets the user's NPROC, not the one set for simulated devices.
  assert "NPROC" not in cpu_threads.without_ours(environ)
  assert cpu_threads.without_ours(mine) == {"NPROC": "12"}


def test_this_process_runs_its_devices_on_the_larger_pool():
  """XLA names the pool's threads (tf_XLAEigen); without NPROC it holds max(cores, devices)."""
  jnp.ones(len(jax.devices())).block_until_ready()  # the CPU backend is up
  names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
  assert len(jax.devices()) == 8
  assert names.count("tf_XLAEigen") >= 8 * cpu_threads.THREADS_PER_DEVICE
