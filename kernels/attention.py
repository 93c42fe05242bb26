"""One attention entry point; `impl` picks the implementation, all with the same semantics."""

import functools

import jax
import jax.numpy as jnp

from kernels import reference
from kernels.flash_attention import flash_attention

IMPLS = ("auto", "xla", "dot_product", "cudnn", "pallas_flash")
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


@functools.cache
def cudnn_available() -> bool:
  """Whether this JAX can build cuDNN's fused attention: the cuDNN library is loaded (a CUDA GPU
  machine), not only JAX's CUDA plugin (deviceless compiles here, where cuDNN is "not found")."""
  q = jax.ShapeDtypeStruct((1, 128, 1, 64), jnp.bfloat16)
  try:
    jax.eval_shape(functools.partial(jax.nn.dot_product_attention, implementation="cudnn",
                                     is_causal=True), q, q, q)
  except Exception:  # noqa: BLE001  (RuntimeError "cuDNN not found", or no CUDA plugin at all)
    return False
  return True


def resolve(impl: str, platform: str, dtype="bfloat16") -> str:
  """The implementation `impl` means on `platform` ("cpu", "gpu", ...) for `dtype` attention;
  any impl but "auto" is itself. "auto" is the XLA reference off GPUs, and on GPUs a flash kernel:
  cuDNN's where it can run (an NVIDIA GPU with the cuDNN library, 16-bit inputs), else
  pallas_flash. Measured on an H200 (docs/gpu-check.md): cuDNN's forward+backward took 3.7 ms at
  seq 8192 against pallas_flash's 10.6 (2.9x), and the Llama-3-8B-dims train step ran 1.14x
  faster with it. Deviceless compiles (no cuDNN library) keep pallas_flash."""
  if impl != "auto":
    return impl
  if platform not in GPU_PLATFORMS:
    return "xla"
  sixteen_bit = jnp.dtype(dtype).itemsize == 2
  return "cudnn" if platform != "rocm" and sixteen_bit and cudnn_available() else "pallas_flash"


def check_runs(impl: str, platform: str) -> None:
  """Refuses, before anything compiles, an attention `impl` that cannot run on `platform`:
  cuDNN's needs an NVIDIA GPU and the cuDNN library (a deviceless compile here has neither)."""
  if impl == "cudnn" and (platform not in ("gpu", "cuda") or not cudnn_available()):
    where = ("a deviceless GPU compile, without the cuDNN library" if platform in GPU_PLATFORMS
             else f"{platform} devices")
    raise ValueError(f"compute.attention_impl=cudnn runs only on NVIDIA GPUs with cuDNN, not"
                     f" on {where}; use attention_impl=auto (cuDNN where it can run) or"
                     " pallas_flash")


def attention(q, k, v, segment_ids=None, *, causal: bool = True, impl: str = "xla",
              window: int = 0):
  """Causal/packed grouped-query attention.

  Args:
    q: [B, L, H, d]; k: [B, L, K, d], v: [B, L, K, dv] with H a multiple of K (dv != d: MLA).
    segment_ids: optional [B, L] document ids (packed sequences never attend across documents).
    causal: mask future positions.
    impl: "auto" (resolve(impl, JAX's default backend, q's dtype)), "xla" (the plain-jnp
      reference), "dot_product" (`jax.nn.dot_product_attention`, XLA lowering), "cudnn" (the same call with the cuDNN fused kernel; GPU only) or
      "pallas_flash" (`kernels.flash_attention`: Triton on GPUs, the Pallas interpreter on CPU).
    window: > 0: sliding-window attention over the last `window` keys, the query's own
      included; pallas_flash (causal only) skips the key blocks outside it.
  Returns:
    [B, L, H, dv] attention output.
  """
  if impl == "auto":  # callers with a layout pass its resolved kernel: nothing read here
    impl = resolve(impl, jax.default_backend(), q.dtype)
  if impl == "xla":
    return reference.attention(q, k, v, segment_ids, causal=causal, window=window)
  if impl in ("dot_product", "cudnn"):
    mask = None
    if segment_ids is not None:
      mask = reference.attention_mask(q.shape[1], segment_ids, causal=False)
    dv = v.shape[-1]
    if dv < q.shape[-1]:  # MLA: jax.nn.dot_product_attention wants one head dim; zero columns of
      v = jnp.pad(v, ((0, 0),) * 3 + ((0, q.shape[-1] - dv),))  # v give zero output columns
    out = jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=causal,
        local_window_size=(window - 1, 0) if window else None,
        implementation="xla" if impl == "dot_product" else "cudnn")
    return out[..., :dv]
  if impl == "pallas_flash":
    return flash_attention(q, k, v, segment_ids, causal=causal, window=window)
  raise ValueError(f"unknown attention impl {impl!r}; expected one of {IMPLS}")
