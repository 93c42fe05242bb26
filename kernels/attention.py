"""One attention entry point; `impl` picks the implementation, all with the same semantics."""

import jax
import jax.numpy as jnp

from kernels import reference
from kernels.flash_attention import flash_attention

IMPLS = ("auto", "xla", "dot_product", "cudnn", "pallas_flash")
# What "auto" runs, by platform. On GPUs a flash kernel: pallas_flash, because it also compiles
# without a GPU (cuDNN's fused attention needs the cuDNN library at compile time) and until the
# GPU check of issue [15] measures cuDNN faster on our H100. Elsewhere the XLA reference.
AUTO = {"gpu": "pallas_flash", "cuda": "pallas_flash", "rocm": "pallas_flash"}


def resolve(impl: str, platform: str) -> str:
  """The implementation `impl` means on `platform` ("cpu", "gpu", ...): "auto" is a flash kernel
  on GPUs and "xla" elsewhere; any other impl is itself."""
  return AUTO.get(platform, "xla") if impl == "auto" else impl


def attention(q, k, v, segment_ids=None, *, causal: bool = True, impl: str = "xla",
              window: int = 0):
  """Causal/packed grouped-query attention.

  Args:
    q: [B, L, H, d]; k: [B, L, K, d], v: [B, L, K, dv] with H a multiple of K (dv != d: MLA).
    segment_ids: optional [B, L] document ids (packed sequences never attend across documents).
    causal: mask future positions.
    impl: "auto" (resolve(impl, JAX's default backend)), "xla" (the plain-jnp reference), "dot_product" (`jax.nn.dot_product_attention`, XLA
      lowering), "cudnn" (the same call with the cuDNN fused kernel; GPU only) or
      "pallas_flash" (`kernels.flash_attention`: Triton on GPUs, the Pallas interpreter on CPU).
    window: > 0: sliding-window attention over the last `window` keys, the query's own
      included; pallas_flash (causal only) skips the key blocks outside it.
  Returns:
    [B, L, H, dv] attention output.
  """
  if impl == "auto":  # callers with a layout pass its resolved kernel: nothing read here
    impl = resolve(impl, jax.default_backend())
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
