"""Prints the machine's measured ceiling as JSON lines: large-matmul FLOP/s in each dtype (the MFU
denominator on CPU) and the memory bandwidth of a large copy. On a GPU the same script measures
the GPU.

Usage: python -m benchmarks.peak [--sizes 1024,2048,4096] [--dtypes float32,bfloat16]
                                 [--copy_mib 1024] [--repeats 5]
"""

import argparse
import json
import os
import platform
import time

import jax
import jax.numpy as jnp

from trainer.process import host_memory
from trainer.metrics import measure_matmul_flops


def measure_copy_bandwidth(mib: int = 1024, repeats: int = 5) -> float:
  """Best-of-`repeats` bytes/s of streaming a `mib` MiB float32 array through the first device
  (each element read once and written once: 2 x size bytes moved)."""
  n = mib * 2**20 // 4
  x = jnp.arange(n, dtype=jnp.float32)
  # A real copy XLA cannot elide (a bare copy can be aliased), written in place through donation:
  # a fresh output buffer every call would measure page faults, not memory bandwidth.
  copy = jax.jit(lambda a: a + 1.0, donate_argnums=0)
  x = copy(x).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    x = copy(x).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2.0 * n * 4 / best


def emit(**fields) -> None:
  device = jax.devices()[0]
  print(json.dumps({**fields, "device": device.device_kind, "platform": device.platform,
                    "cpus": os.cpu_count(), "machine": platform.machine(),
                    "load_average_1m": os.getloadavg()[0]}), flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--sizes", default="1024,2048,4096")
  parser.add_argument("--dtypes", default="float32,bfloat16")
  parser.add_argument("--copy_mib", type=int, default=1024, help="0 skips the copy measurement")
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  host_memory.reexec_with_tunables()  # the trainer's malloc settings (trainer/process/)
  for dtype in args.dtypes.split(","):
    for size in map(int, args.sizes.split(",")):
      start = time.perf_counter()
      flops = measure_matmul_flops(dtype, size, args.repeats)
      emit(benchmark="matmul_peak", dtype=dtype, size=size, gflops=round(flops / 1e9, 1),
           wall_s=round(time.perf_counter() - start, 2))
  if args.copy_mib:
    start = time.perf_counter()
    bandwidth = measure_copy_bandwidth(args.copy_mib, args.repeats)
    emit(benchmark="copy_bandwidth", mib=args.copy_mib, gbytes_per_s=round(bandwidth / 1e9, 2),
         wall_s=round(time.perf_counter() - start, 2))


if __name__ == "__main__":
  main()
