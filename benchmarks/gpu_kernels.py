"""GPU kernel measurements for `make gpu-check` (benchmarks/gpu_check.py): the smoke check, the
measured matmul peak and copy bandwidth, the attention kernels and the jax-triton RMSNorm.

Each function takes `emit` (writes one JSON line) and `rehearse` (CPU, tiny sizes: runs the code
path, measures nothing worth keeping). Timing: every input is fresh random data (never zeros,
which run faster than real data on GPUs), the first call compiles and warms up, then `calls`
back-to-back calls are timed to the last one's completion (the device runs them in order), and
the median over `repeats` such windows is reported.
"""

import math
import statistics
import time
import traceback

import jax
import jax.numpy as jnp


def time_ms(fn, *args, calls: int = 10, repeats: int = 5) -> float:
  """Median milliseconds per call of a jitted `fn` (see the module docstring)."""
  jax.block_until_ready(fn(*args))
  windows = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    windows.append((time.perf_counter() - start) / calls)
  return 1e3 * statistics.median(windows)


def random(key_index: int, shape, dtype):
  return jax.random.normal(jax.random.PRNGKey(key_index), shape, jnp.float32).astype(dtype)


def failure(error: BaseException) -> dict:
  """An error as fields of a result line: its kind, and the first line of its message (OOM
  stays recognizable: RESOURCE_EXHAUSTED)."""
  text = str(error).strip().splitlines()
  return {"status": "oom" if "RESOURCE_EXHAUSTED" in str(error) else "error",
          "error": f"{type(error).__name__}: {text[0][:400] if text else ''}"}


def smoke(emit, rehearse: bool) -> bool:
  """Imports, one flash-attention forward+backward against the reference, one tiny train step.
  Returns True when every part worked (each part emits its own line either way)."""
  ok = True
  parts = {"imports": _smoke_imports, "flash_attention": _smoke_flash,
           "train_step": _smoke_train_step}
  for name, part in parts.items():
    start = time.perf_counter()
    try:
      fields = part(rehearse)
      emit(check=name, status="ok", seconds=round(time.perf_counter() - start, 2), **fields)
    except Exception as e:  # noqa: BLE001  (a smoke check reports any failure and goes on)
      ok = False
      emit(check=name, seconds=round(time.perf_counter() - start, 2), **failure(e),
           traceback=traceback.format_exc()[-3000:])
  return ok


def _smoke_imports(rehearse: bool) -> dict:
  import importlib.metadata
  import configs, kernels, models, sharding, trainer  # noqa: F401,E401  (our five packages)
  from trainer import loop  # noqa: F401  (flax, optax, orbax, grain, tensorboardX, ...)
  versions = {}
  for dist in ("flax", "optax", "orbax-checkpoint", "grain", "ml-collections", "tensorboardX",
               "jax-triton", "triton", "numpy"):
    try:
      versions[dist] = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
      versions[dist] = None
  return {"versions": versions, "devices": [str(d) for d in jax.devices()]}


def _smoke_flash(rehearse: bool) -> dict:
  from kernels import flash_attention, reference
  length = 64 if rehearse else 1024
  q = random(0, (1, length, 4, 64), jnp.bfloat16)
  k, v = random(1, (1, length, 2, 64), jnp.bfloat16), random(2, (1, length, 2, 64), jnp.bfloat16)

  def loss(attend):
    return jax.jit(jax.value_and_grad(lambda q: jnp.sum(attend(q, k, v).astype(jnp.float32))))
  got, got_dq = loss(flash_attention)(q)
  with jax.default_matmul_precision("highest"):
    want, want_dq = loss(lambda q, k, v: reference.attention(
        *(x.astype(jnp.float32) for x in (q, k, v))))(q)
  error = float(jnp.linalg.norm((got_dq - want_dq).astype(jnp.float32))
                / jnp.linalg.norm(want_dq.astype(jnp.float32)))
  if not error < 2e-2:
    raise AssertionError(f"flash attention dq differs from the reference: {error:.3g}")
  return {"dq_rel_error": error, "loss": float(got), "reference_loss": float(want)}


def _smoke_train_step(rehearse: bool) -> dict:
  from configs import llama
  from trainer.config import DataConfig
  from trainer.trainer import Trainer
  cfg = llama.debug()
  cfg.model.num_layers, cfg.model.dtype = 2, "bfloat16"
  cfg.compute.attention_impl = "pallas_flash"  # the Pallas interpreter in a rehearsal
  cfg.batch_size, cfg.seq_len, cfg.steps, cfg.sample_tokens = 4, 128, 2, 0
  cfg.data = DataConfig(source="synthetic")
  trainer = Trainer(cfg, jax.devices()[:1])
  rep = trainer.compile()
  trainer.init_state()
  batches = trainer.iterator("train")
  losses = []
  with trainer.scope():
    for _ in range(2):
      trainer.state, metrics = trainer.compiled_step(trainer.state,
                                                     trainer.to_device(next(batches)))
      losses.append(float(metrics["loss"]))
  if not all(map(math.isfinite, losses)):
    raise AssertionError(f"non-finite losses {losses}")
  return {"losses": losses, "compile_s": round(rep.compile_seconds, 2),
          "platform": trainer.mesh.devices.flat[0].platform}


def peak(emit, rehearse: bool) -> None:
  """Matmul FLOP/s (bf16, and fp32 at the default TF32 and at `highest`) and the bandwidth of a
  large in-place copy (bytes read + written)."""
  size = 256 if rehearse else 8192
  for dtype, precision in (("bfloat16", "default"), ("float32", "default"),
                           ("float32", "highest")):
    a, b = random(0, (size, size), dtype), random(1, (size, size), dtype)
    with jax.default_matmul_precision(precision):
      ms = time_ms(jax.jit(jnp.matmul), a, b, calls=2 if rehearse else 20)
    emit(benchmark="matmul_peak", dtype=dtype, precision=precision, size=size, ms=round(ms, 4),
         tflops=round(2 * size ** 3 / ms / 1e9, 1))
  n = (1 if rehearse else 1024) * 2**20  # float32 elements: 4 GiB on the GPU
  x = random(2, (n,), jnp.float32)
  copy = jax.jit(lambda a: a + 1.0, donate_argnums=0)  # donated: written in place, no allocation
  x = copy(x)
  windows = []
  for _ in range(5):
    start = time.perf_counter()
    for _ in range(5):
      x = copy(x)
    jax.block_until_ready(x)
    windows.append((time.perf_counter() - start) / 5)
  seconds = statistics.median(windows)
  emit(benchmark="copy_bandwidth", gib=round(n * 4 / 2**30, 3), ms=round(1e3 * seconds, 4),
       tbytes_per_s=round(2 * n * 4 / seconds / 1e12, 3))


def attention_flops(batch: int, heads: int, length: int, head_dim: int, backward: bool) -> float:
  """Causal attention FLOPs: forward 4·B·H·L²·d (QKᵀ and PV) halved by the mask; forward +
  backward 3.5x the forward (the backward's five matmuls, FlashAttention-2's count)."""
  forward = 2.0 * batch * heads * length * length * head_dim
  return forward * (3.5 if backward else 1.0)


def attention(emit, rehearse: bool, deadline: float) -> None:
  """pallas_flash, cudnn and xla at seq 2k/4k/8k/16k, head dim 128, GQA 8:1 (32 query heads, 4
  kv heads), causal, bf16: forward and forward+backward ms and TFLOP/s."""
  from kernels import attention as attend
  batch, heads, kv_heads, head_dim = 1, (4 if rehearse else 32), (1 if rehearse else 4), 128
  lengths = (64, 128) if rehearse else (2048, 4096, 8192, 16384)
  impls = ("pallas_flash", "xla") if rehearse else ("pallas_flash", "cudnn", "xla")
  for length in lengths:
    q = random(0, (batch, length, heads, head_dim), jnp.bfloat16)
    k = random(1, (batch, length, kv_heads, head_dim), jnp.bfloat16)
    v = random(2, (batch, length, kv_heads, head_dim), jnp.bfloat16)
    for impl in impls:
      forward = lambda q, k, v, impl=impl: attend(q, k, v, impl=impl)
      both = jax.grad(lambda q, k, v, f=forward: jnp.sum(f(q, k, v).astype(jnp.float32)),
                      argnums=(0, 1, 2))
      for name, fn in (("forward", forward), ("forward+backward", both)):
        fields = dict(benchmark="attention", impl=impl, **{"pass": name}, batch=batch,
                      seq=length, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                      dtype="bfloat16", causal=True)
        if time.monotonic() > deadline:
          emit(**fields, status="skipped", reason="the phase's time budget is spent")
          continue
        try:
          ms = time_ms(jax.jit(fn), q, k, v, calls=2 if rehearse else 10)
        except Exception as e:  # noqa: BLE001  (xla at 16k runs out of memory: say so, go on)
          emit(**fields, **failure(e))
          continue
        flops = attention_flops(batch, heads, length, head_dim, name != "forward")
        emit(**fields, status="ok", ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1))


def rmsnorm(emit, rehearse: bool) -> None:
  """The jax-triton residual-add + RMSNorm against XLA's fusion of the reference, bf16: ms and
  bandwidth (x, residual read; y, h written). The model uses the XLA path unless this wins."""
  from kernels import reference
  rows, dim = (64, 256) if rehearse else (8192, 4096)
  x, r = random(0, (rows, dim), jnp.bfloat16), random(1, (rows, dim), jnp.bfloat16)
  scale = random(2, (dim,), jnp.bfloat16)
  paths = {"xla_fusion": jax.jit(lambda x, r, s: reference.rmsnorm_residual(x, r, s, 1e-5))}
  if not rehearse:
    from kernels import triton_rmsnorm
    paths["jax_triton"] = jax.jit(triton_rmsnorm.rmsnorm_residual)
  for name, fn in paths.items():
    fields = dict(benchmark="rmsnorm_residual", impl=name, rows=rows, dim=dim, dtype="bfloat16")
    try:
      ms = time_ms(fn, x, r, scale, calls=2 if rehearse else 50)
    except Exception as e:  # noqa: BLE001  (jax-triton may not load: record why)
      emit(**fields, **failure(e))
      continue
    emit(**fields, status="ok", ms=round(ms, 4),
         tbytes_per_s=round(4 * rows * dim * 2 / ms / 1e9, 3))
