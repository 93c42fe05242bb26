"""The fp8 projection GEMMs in the deviceless H100 program (the gpu-aot extra): which kernels XLA
emits for each recipe, under its default options and with Triton GEMMs off.

Deviceless there is no autotuning, so XLA gives every f8 dot to the first backend that takes it,
Triton (a GEMM fusion on the f8 operands); on a GPU its autotuner times Triton against cuBLASLt.
With `xla_gpu_enable_triton_gemm=false` every projection GEMM is a cuBLASLt fp8 call, provided
the target states a CUDA runtime >= 12.0 (sharding/xla/targets: without one XLA refuses the fp8
call and widens the operands to bf16 for a plain cuBLASLt GEMM, which a test here shows).
"""

import dataclasses
import re

import pytest

from configs import llama
from models.fp8.config import Fp8Config
from models.fp8.current import RECIPES, Gemm
from sharding import MeshConfig
from sharding.xla import compiled
from trainer.aot import compile_for_gpus

TRITON_OFF = "xla_gpu_enable_triton_gemm=false"
HEAD = "TD,DV->TV"  # the loss's output head: bf16, not fp8


def h100_dots(text: str) -> list[tuple[str, tuple[str, ...], bool]]:
  """(op_name, operand element types, inside a Triton GEMM fusion) of every dot in an HLO text."""
  types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", text))
  out, computation = [], ""
  for line in text.splitlines():
    header = re.match(r"(?:ENTRY )?%([\w.\-]+) \(", line)  # unindented: a computation starts
    computation = header.group(1) if header else computation
    dot = re.search(r" dot\(([^)]*)\).*?op_name=\"([^\"]*)\"", line)
    if dot:
      operands = tuple(types.get(op, "?") for op in re.findall(r"%([\w.\-]+)", dot.group(1)))
      out.append((dot.group(2), operands, computation.startswith("gemm_fusion")))
  return out


def cublas_calls(text: str) -> list[dict]:
  """Every cuBLAS(Lt) GEMM custom call: its target, op_name, and whether a scale operand (an
  f32[] operand after the two matrices) is computed rather than a constant 1, i.e. whether the
  dequantization is folded into the call."""
  definitions = dict(re.findall(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$", text, re.M))
  out = []
  for line in text.splitlines():
    call = re.search(r" custom-call\(([^)]*)\), custom_call_target=\"(__cublas[^\"]*)\"", line)
    if not call:
      continue
    operands = re.findall(r"%([\w.\-]+)", call.group(1))[2:]
    scaled = [op for op in operands if definitions.get(op, "").startswith("f32[] ")
              and " constant(" not in definitions[op]]
    op_name = re.search(r"op_name=\"([^\"]*)\"", line)
    out.append({"target": call.group(2), "op_name": op_name.group(1) if op_name else "",
                "scaled": bool(scaled)})
  return out


def h100_program(tmp_path, recipe: str, xla_options: str = "", config_path: str = "") -> str:
  """The optimized HLO of a 2-layer bf16 debug Llama's train step in fp8 for 8 H100s
  (data=4 x tensor=2)."""
  cfg = llama.debug()
  cfg.model = dataclasses.replace(cfg.model, num_layers=2, dtype="bfloat16")
  cfg.compute.fp8 = Fp8Config(enabled=True, recipe=recipe)
  cfg.mesh, cfg.batch_size, cfg.seq_len = MeshConfig(data=4, tensor=2), 8, 64
  cfg.xla_options = xla_options
  target = compiled.parse_gpu_target("h100x8")
  if config_path:
    target = dataclasses.replace(target, config_path=config_path)
  hlo = tmp_path / f"{recipe}-{bool(xla_options)}-{bool(config_path)}.hlo"
  compile_for_gpus(cfg, target, str(hlo))
  return hlo.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_gemms_in_the_h100_program(recipe, tmp_path):
  """XLA's default options. Every dot but the (bf16) output head's runs on f8 operands, e5m2
  gradients included, as Triton GEMM fusions (no cuBLASLt fp8 call: no autotuning). The scaling
  is separate elementwise fusions around the GEMM; for blockwise the contraction's blocks are a
  batch dim of the f8 GEMM ([blocks, ...] float32 partial products), then rescaled and summed in
  one fusion."""
  text = h100_program(tmp_path, recipe)
  dots = [d for d in h100_dots(text) if HEAD not in d[0]]
  f8 = [d for d in dots if all(t.startswith("f8") for t in d[1])]
  assert len(f8) == len(dots) >= 15, [d for d in dots if d not in f8]
  assert any("f8e5m2" in d[1] for d in f8)
  assert all(d[2] for d in f8) and "__cublas$lt$matmul$f8" not in text
  blocked = [d for d in f8 if Gemm.parse("BLD,DF->BLF").blocks in d[0]]
  assert bool(blocked) == (recipe == "blockwise")


@pytest.mark.parametrize("recipe", [
    "tensorwise", *(pytest.param(r, marks=pytest.mark.slow) for r in ("delayed", "rowwise",
                                                                       "blockwise"))])
def test_cublaslt_fp8_gemms_with_triton_gemms_off(recipe, tmp_path):
  """xla_gpu_enable_triton_gemm=false: every projection GEMM (forward, dx, dw) is a cuBLASLt fp8
  call, no Triton GEMM is left, and the only plain cuBLASLt GEMMs are the bf16 head's forward,
  dx and dw. Delayed scales are folded into the call (models/fp8/delayed.py's scaled_dot)
  where the GEMM's own output is divided: measured 7 of 21 calls here; the others' outputs are
  reduced over devices first (row-parallel forwards, data-parallel dw), and a separate fusion
  divides after the reduction. Tensorwise scales each sequence of an activation or gradient
  (models/fp8/current.py): with 2 sequences per device here none of its calls takes a scale
  (measured: 4 do with one sequence per device, batch 4). Rowwise scales (per row) and
  blockwise's (per block, float32 partial products) are never in the call: cuBLASLt on Hopper
  takes one scale per operand."""
  text = h100_program(tmp_path, recipe, TRITON_OFF)
  calls = cublas_calls(text)
  assert not re.search(r'"kind":"__triton[a-z_]*gemm', text)
  plain = [c for c in calls if c["target"] != "__cublas$lt$matmul$f8"]
  assert len(plain) == 3 and all(HEAD in c["op_name"] for c in plain), plain
  f8 = [c for c in calls if c["target"] == "__cublas$lt$matmul$f8"]
  assert len(f8) >= 15, len(f8)  # 7 projections x 3 GEMMs, some merged (k and v; gate and up)
  folded = sum(c["scaled"] for c in f8)
  assert folded == (7 if recipe == "delayed" else 0), folded


@pytest.mark.slow
def test_no_kernel_writes_the_norms_output_magnitude(tmp_path):
  """Tensorwise, XLA's default options: the layer scan's body quantizes its two norms' outputs
  (bf16 [2, 64, 128] a device) to e4m3, and no fusion writes |norm(x)| (measured before
  RMSNorm.sequence_amax: 2 in the body, which a second kernel reduced)."""
  text = h100_program(tmp_path, "tensorwise")
  kernels = re.findall(r"^\s*(?:ROOT )?%[\w.\-]+ = (\S+) fusion\(.*?op_name=\"([^\"]*)\"", text,
                       re.M)
  assert [t for t, _ in kernels if t.startswith("f8e4m3fn[2,64,128]{")] == [
      "f8e4m3fn[2,64,128]{2,1,0}"] * 2
  assert not [k for k in kernels if k[1].endswith("/abs")]


@pytest.mark.slow
def test_without_a_cuda_runtime_version_xla_widens_the_fp8_gemms(tmp_path):
  """The target without its runtime_version line (CUDA taken as 0.0.0): with Triton GEMMs off,
  XLA refuses the cuBLASLt fp8 call and widens every f8 dot to a plain bf16 cuBLASLt GEMM. The
  same compile with the line has 0 plain GEMMs but the head's (the test above): the line is what
  makes the difference."""
  config = compiled.parse_gpu_target("h100x8").config_path
  text = open(config).read()
  assert "runtime_version" in text
  stripped = tmp_path / "h100_no_runtime.txtpb"
  stripped.write_text(re.sub(r"runtime_version \{[^}]*\}", "", text))
  calls = cublas_calls(h100_program(tmp_path, "tensorwise", TRITON_OFF, str(stripped)))
  assert calls and not [c for c in calls if c["target"] == "__cublas$lt$matmul$f8"]
  assert len([c for c in calls if HEAD not in c["op_name"]]) >= 15
