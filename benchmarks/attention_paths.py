"""Prints JSON lines: CPU wall time of the attention paths, the key and query blocks the Pallas
flash kernel visits under a sliding window (kernels.flash_attention.visit_counts: the work the
window skips), and compiled memory of the kernels.

The CPU times are information only (pallas_flash runs in the Pallas interpreter there). The
memory lines come from `memory_analysis()` of compiled programs: the chunked vs dense loss on
CPU, and with --gpu the train step for 8 H100s (compiled without a GPU) per attention path and
sequence length.

Usage: python -m benchmarks.attention_paths [--lengths 256,512] [--repeats 5] [--gpu]
"""

import argparse
import dataclasses
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import kernels
from configs import llama
from kernels import reference
from kernels.cross_entropy import chunked_cross_entropy
from kernels.flash_attention import visit_counts
from models import ModelConfig
from sharding import MeshConfig
from sharding.xla import compiled
from trainer import loss
from trainer.aot import compile_for_gpus

PATHS = ("xla", "dot_product", "pallas_flash")


def emit(**fields) -> None:
  print(json.dumps({**fields, "load_average_1m": os.getloadavg()[0]}), flush=True)


def time_calls(fn, args, repeats: int) -> tuple[float, float, float]:
  """(compile s, median wall ms, median process CPU ms) of a jitted fn."""
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  compile_s = time.perf_counter() - start
  walls, cpus = [], []
  for _ in range(repeats):
    wall, cpu = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn(*args))
    walls.append(1e3 * (time.perf_counter() - wall))
    cpus.append(1e3 * (time.process_time() - cpu))
  return compile_s, statistics.median(walls), statistics.median(cpus)


def attention_times(lengths, repeats: int) -> None:
  batch, heads, kv_heads, head_dim = 1, 8, 2, 64
  rng = np.random.default_rng(0)
  for length in lengths:
    q = jnp.asarray(rng.normal(size=(batch, length, heads, head_dim)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(batch, length, kv_heads, head_dim)), jnp.float32)
            for _ in range(2))
    segments = jnp.asarray(np.arange(length)[None] >= length // 3, jnp.int32)
    for impl in PATHS:
      attend = lambda q, k, v, impl=impl: kernels.attention(q, k, v, segments, impl=impl)
      grad = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v)), argnums=(0, 1, 2))
      for what, fn in (("forward", attend), ("forward+backward", grad)):
        compile_s, wall_ms, cpu_ms = time_calls(jax.jit(fn), (q, k, v), repeats)
        emit(benchmark="attention_cpu", impl=impl, **{"pass": what}, batch=batch, seq=length,
             heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype="float32",
             compile_s=round(compile_s, 2), wall_ms=round(wall_ms, 2), cpu_ms=round(cpu_ms, 2))


def flash_block_visits(length: int = 1024, windows=(0, 128, 512)) -> None:
  """Blocks each of the flash kernel's loops visits (forward and dQ: key blocks; dK/dV: query
  blocks), summed over programs, per sliding window (0: causal), at H100's default block sizes:
  the fraction of causal attention's block work a window keeps."""
  key = jax.random.PRNGKey(0)
  q = jax.random.normal(key, (1, length, 4, 64), jnp.float32)
  kv = jax.random.normal(key, (1, length, 2, 64), jnp.float32)
  causal = None
  for window in windows:
    counts = jax.jit(lambda q, k, v, w=window: visit_counts(
        q, k, v, window=w, interpret=True))(q, kv, kv)
    visits = {name: int(np.asarray(count).sum()) for name, count in counts.items()}
    causal = causal or visits
    emit(benchmark="flash_block_visits", seq=length, window=window, **visits,
         **{f"{name}_of_causal": round(visits[name] / causal[name], 3) for name in visits})


def loss_memory(length=4096, dim=256, vocab=128 * 1024, chunk=256) -> None:
  args = (jax.ShapeDtypeStruct((1, length, dim), jnp.float32),
          jax.ShapeDtypeStruct((dim, vocab), jnp.float32),
          jax.ShapeDtypeStruct((1, length), jnp.int32),
          jax.ShapeDtypeStruct((1, length), jnp.float32))
  paths = {
      "dense": lambda h, w, t, m: loss.cross_entropy_sums(jnp.einsum("BLD,DV->BLV", h, w), t, m),
      "dense_reference": lambda *a: reference.cross_entropy(*a),
      "chunked": lambda *a: chunked_cross_entropy(*a, chunk=chunk),
  }
  for name, fn in paths.items():
    grads = jax.jit(jax.grad(lambda h, w, t, m, fn=fn: fn(h, w, t, m)[0], argnums=(0, 1)))
    stats = grads.lower(*args).compile().memory_analysis()
    emit(benchmark="loss_memory_cpu", impl=name, seq=length, embed=dim, vocab=vocab,
         chunk=chunk if name == "chunked" else None,
         temp_mib=round(stats.temp_size_in_bytes / 2**20, 1))


def gpu_train_step_memory(lengths=(2048, 4096, 8192)) -> None:
  model = ModelConfig(vocab_size=1024, embed_dim=512, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=128, mlp_dim=1536, dtype="bfloat16")
  for impl in ("pallas_flash", "xla"):
    for length in lengths:
      cfg = llama.debug()
      cfg.mesh = MeshConfig(data=4, tensor=2)
      cfg.batch_size, cfg.seq_len = 8, length
      cfg.model = model
      cfg.compute = dataclasses.replace(cfg.compute, attention_impl=impl)
      rep = compile_for_gpus(cfg, compiled.parse_gpu_target("h100x8"))
      emit(benchmark="train_step_memory_h100x8", impl=impl, seq=length, batch=8,
           mesh="data=4,tensor=2", compile_s=round(rep.compile_seconds, 1),
           temp_mib=round(rep.memory["temp"] / 2**20, 1),
           peak_mib=round(rep.memory["peak"] / 2**20, 1))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--lengths", default="256,512")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--gpu", action="store_true",
                      help="also compile the train step for 8 H100s (gpu-aot extra, ~1 min)")
  args = parser.parse_args()
  attention_times([int(x) for x in args.lengths.split(",")], args.repeats)
  flash_block_visits()
  loss_memory()
  if args.gpu:
    gpu_train_step_memory()


if __name__ == "__main__":
  main()
