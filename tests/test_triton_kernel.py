"""The raw Triton kernel (residual add + RMSNorm) without a GPU: it compiles for sm_90, and under
Triton's interpreter its arithmetic matches the JAX reference. jax-triton, which calls it from
JAX, needs a CUDA jaxlib; here we check only that its absence is a clear error.

Both checks run in subprocesses: TRITON_INTERPRET must be set before the kernel is decorated,
and a failed `import jax_triton` breaks later `triton.compile` calls in the same process.
"""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

from kernels import triton_rmsnorm  # needs triton, from the gpu-aot extra that `make test` installs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

COMPILE = r"""
import json
from kernels import triton_rmsnorm
kernel = triton_rmsnorm.compile_for_gpu(4096, "bfloat16", capability=90)
ptx = kernel.asm["ptx"]
print(json.dumps({"stages": sorted(kernel.asm), "cubin_bytes": len(kernel.asm["cubin"]),
                  "targets": [l.split()[1] for l in ptx.splitlines() if l.startswith(".target")],
                  "num_warps": kernel.metadata.num_warps}))
"""

# Triton's interpreter reads arguments through the torch tensor interface (data_ptr, storage,
# stride) and the torch dtype name. torch is not a dependency: a numpy array behind that small
# interface is enough, since the interpreter's loads and stores are host-memory pointers.
INTERPRET = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from kernels import reference, triton_rmsnorm
jax.config.update("jax_numpy_rank_promotion", "raise")  # as tests/conftest.py sets it

class HostTensor:
  def __init__(self, array, dtype_name):
    self.array, self.dtype = np.ascontiguousarray(array), f"torch.{dtype_name}"
  def data_ptr(self): return self.array.ctypes.data
  def untyped_storage(self): return self
  def cpu(self): return self
  def new_empty(self, *args, **kwargs): return self
  def set_(self, *args): return self
  def copy_(self, other): pass  # the interpreter wrote through the pointers already
  def storage_offset(self): return 0
  def size(self): return self.array.shape
  def stride(self, *args): return tuple(s // self.array.itemsize for s in self.array.strides)

result = {}
rows, dim, eps = 6, 96, 1e-5  # a row that is not a power of two: masked lanes
for dtype in ("float32", "bfloat16"):
  kx, kr, ks = jax.random.split(jax.random.PRNGKey(0), 3)
  x, r = (jax.random.normal(key, (rows, dim), dtype) for key in (kx, kr))
  scale = jax.random.uniform(ks, (dim,), dtype, 0.5, 1.5)
  want_y, want_h = reference.rmsnorm_residual(x, r, scale, eps)
  args = [HostTensor(np.asarray(a), dtype) for a in (x, r, scale)]
  outs = [HostTensor(np.zeros((rows, dim), x.dtype), dtype) for _ in range(2)]
  params = triton_rmsnorm.launch_params(dim)
  triton_rmsnorm.rmsnorm_residual_kernel[(rows,)](*args, *outs, D=dim,
                                                  BLOCK_D=params["BLOCK_D"], EPS=eps)
  for name, got, want in (("y", outs[0].array, want_y), ("h", outs[1].array, want_h)):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    result[f"{dtype}_{name}"] = float(np.max(np.abs(got - want) / np.maximum(np.abs(want), 1e-3)))
print(json.dumps(result))
"""


def run(script: str, **env) -> dict:
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        env={**os.environ, "JAX_PLATFORMS": "cpu", "TRITON_DEFAULT_FP_FUSION": "1",
                             **env}, cwd=REPO, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_triton_source_compiles_for_sm90():
  result = run(COMPILE)
  assert {"ttir", "ttgir", "llir", "ptx", "cubin"} <= set(result["stages"])
  assert result["targets"] and result["targets"][0].startswith("sm_90")
  assert result["cubin_bytes"] > 0 and result["num_warps"] == 16  # 4096 lanes / 256


def test_interpreted_kernel_matches_the_reference():
  """float32: to rounding (1e-5 relative), h exact. bf16: the interpreter casts float32 -> bf16
  by truncation where GPUs (and XLA) round to nearest, so h may differ by one bf16 ulp (at most
  2^-7 relative) and y by two (its own cast too): within the bf16 tolerance of 2e-2."""
  result = run(INTERPRET, TRITON_INTERPRET="1")
  assert result["float32_y"] < 1e-5 and result["float32_h"] == 0.0
  assert result["bfloat16_h"] <= 2 ** -7 and result["bfloat16_y"] < 2e-2


def test_jax_entry_point_needs_the_gpu_extra():
  try:
    import jax_triton  # noqa: F401
  except ImportError:
    pass
  else:
    pytest.skip("jax-triton is importable here: this is a GPU machine")
  x = jnp.ones((2, 64), jnp.bfloat16)
  with pytest.raises(ImportError, match=r"install the gpu extra"):
    triton_rmsnorm.rmsnorm_residual(x, x, jnp.ones((64,), jnp.bfloat16))
