"""fp8 projections with delayed scaling (models/fp8/delayed.py): the arithmetic against numpy, the amax
state as specified and identical on every device, f8 dots in the CPU and H100 programs, and
training that stays close to bf16.

Tolerances, stated once:
  * fp8 forward / input and weight gradients vs the numpy simulation (ml_dtypes casts, float64
    sums): relative L2 <= 1e-6. The products of fp8 values are exact in float32; only the
    summation order differs.
  * amax histories: exact (a max is order-independent) on one layout; relative <= 1e-5 between
    layouts (the amaxes of activations and gradients differ by float32 rounding across layouts).
  * training: fp8 (bf16 compute) within 3% of bf16 in the mean loss of every 10-step window of
    100 steps (measured: at most 1.7%, 0.07 nats, in the hardest-data window, fp8 being lower).
"""

import collections
import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from configs import llama
from models.fp8.config import Fp8Config
from models.fp8.delayed import E4M3, E5M2, fp8_einsum, scale_from_amax, scale_from_history
from sharding import MeshConfig
from sharding.xla import compiled, hlo
from tests import parallel_harness as harness
from tests import training_runs
from tests.test_parallel import GRAD_RTOL, LOSS_RTOL, UPDATE_RTOL
from trainer.aot import compile_for_gpus
from trainer.trainer import Trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FP8 = Fp8Config(enabled=True, amax_history=4)


def np_quantize(x, history, dtype, margin=0):
  amax = np.max(history)
  fmax = float(ml_dtypes.finfo(dtype).max)
  scale = np.float32(fmax / amax / 2**margin) if amax > 0 else np.float32(1.0)
  q = np.clip(x.astype(np.float32) * scale, -fmax, fmax).astype(dtype)
  return q.astype(np.float64), np.float64(scale)


def rel(a, b) -> float:
  return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def operands():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 5, 16)).astype(np.float32) * 3
  w = rng.normal(size=(16, 4, 8)).astype(np.float32) * 0.1
  c = rng.normal(size=(2, 5, 4, 8)).astype(np.float32) * 1e-3  # the output gradient
  hx = np.array([0.0, 2.5, 7.0, 1.0], np.float32)  # an amax history from earlier steps
  hw = np.array([0.3, 0.0, 0.0, 0.0], np.float32)
  hg = np.array([4e-3, 5e-3, 0.0, 0.0], np.float32)
  return x, w, c, hx, hw, hg


def test_scale_is_fmax_over_amax_with_margin():
  history = jnp.asarray([1.0, 4.0, 2.0])
  assert float(scale_from_history(history, E4M3, 0)) == 448.0 / 4.0
  assert float(scale_from_history(history, E4M3, 2)) == 448.0 / 4.0 / 4.0
  assert float(scale_from_history(history, E5M2, 0)) == 57344.0 / 4.0
  assert float(scale_from_history(jnp.zeros(3), E4M3, 0)) == 1.0  # nothing seen yet
  amaxes = jnp.asarray([jnp.nan, jnp.inf, 0.0, 2.0])  # 1 where nothing finite can be scaled
  np.testing.assert_array_equal(scale_from_amax(amaxes, E4M3), [1.0, 1.0, 1.0, 224.0])


def test_fp8_forward_equals_numpy_simulation(operands):
  x, w, _, hx, hw, hg = operands
  y = fp8_einsum("BLD,DHd->BLHd", 1, jnp.asarray(x), jnp.asarray(w), hx, hw, hg)
  qx, sx = np_quantize(x, hx, ml_dtypes.float8_e4m3fn, margin=1)
  qw, sw = np_quantize(w, hw, ml_dtypes.float8_e4m3fn, margin=1)
  want = np.einsum("BLD,DHd->BLHd", qx, qw) / (sx * sw)
  assert rel(y, want) <= 1e-6
  # The quantization is real: fp8 is measurably off the float32 product.
  assert rel(y, np.einsum("BLD,DHd->BLHd", x.astype(np.float64), w)) > 1e-3


def test_fp8_gradients_and_history_updates_as_specified(operands):
  """d/dx and d/dw use the e4m3 operands and the e5m2-quantized output gradient; the "gradient"
  of each history is the history with this step's amax rolled in (newest first)."""
  x, w, c, hx, hw, hg = operands

  def f(x, w, hx, hw, hg):
    return jnp.sum(fp8_einsum("BLD,DHd->BLHd", 0, x, w, hx, hw, hg) * c)

  dx, dw, new_hx, new_hw, new_hg = jax.grad(f, argnums=range(5))(x, w, hx, hw, hg)
  np.testing.assert_array_equal(new_hx, np.r_[np.abs(x).max(), hx[:-1]])
  np.testing.assert_array_equal(new_hw, np.r_[np.abs(w).max(), hw[:-1]])
  np.testing.assert_array_equal(new_hg, np.r_[np.abs(c).max(), hg[:-1]])
  qx, sx = np_quantize(x, hx, ml_dtypes.float8_e4m3fn)
  qw, sw = np_quantize(w, hw, ml_dtypes.float8_e4m3fn)
  qg, sg = np_quantize(c, hg, ml_dtypes.float8_e5m2)
  assert rel(dx, np.einsum("BLHd,DHd->BLD", qg, qw) / (sg * sw)) <= 1e-6
  assert rel(dw, np.einsum("BLD,BLHd->DHd", qx, qg) / (sx * sg)) <= 1e-6


def fp8_config(mesh: MeshConfig, microbatches: int = 1):
  return harness.config(mesh, microbatches=microbatches,
                        compute=dataclasses.replace(harness.COMPUTE, fp8=FP8))


def one_step(mesh: MeshConfig, devices=None, microbatches: int = 1):
  """(initial params, params after one step) of the harness model with fp8."""
  trainer = Trainer(fp8_config(mesh, microbatches), devices)
  trainer.init_state()
  initial = jax.device_get(trainer.state.params)
  with trainer.scope():
    state, _ = trainer.train_step(trainer.state, trainer.to_device(harness.batches()[0]))
  return initial, state.params


def fp8_leaves(params) -> dict:
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  return {jax.tree_util.keystr(k): v for k, v in flat if "'fp8_" in jax.tree_util.keystr(k)}


@pytest.fixture(scope="module")
def single_device_step():
  return one_step(MeshConfig(data=1), jax.devices()[:1])


@pytest.mark.parametrize("mesh,microbatches", [
    (MeshConfig(data=1, fsdp=4, tensor=2), 1),
    (MeshConfig(data=2, fsdp=2, tensor=2), 2),  # replicas + accumulation: max over both
])
def test_fp8_state_is_identical_on_every_device(mesh, microbatches, single_device_step):
  initial, reference = single_device_step
  _, params = one_step(mesh, microbatches=microbatches)
  leaves, want = fp8_leaves(params), fp8_leaves(jax.device_get(reference))
  assert len(leaves) == 7 * 3  # (q, k, v, o, gate, up, down) x (x, w, g), stacked over layers
  for path, array in leaves.items():
    shards = [np.asarray(s.data) for s in array.addressable_shards]
    assert len(shards) == 8 and all(np.array_equal(s, shards[0]) for s in shards), path
    got = shards[0]
    np.testing.assert_allclose(got, want[path], rtol=1e-5, err_msg=path)
    assert np.all(got[:, 0] > 0) and np.all(got[:, 1:] == 0), path  # one amax rolled in
  # The weight amax is exact: max |w| of each layer's initial weights.
  for name in ("q", "o"):
    w = initial["layers"]["attn"][name]["w"]
    history = np.asarray(jax.device_get(params["layers"]["attn"][name]["fp8_w"]))
    np.testing.assert_array_equal(history[:, 0], np.abs(w).reshape(w.shape[0], -1).max(axis=1))


def test_fp8_state_is_not_moved_by_the_optimizer(single_device_step):
  """Two steps: each history is the previous one shifted by one, with the new amax in front
  (AdamW's update and weight decay never reach them)."""
  _, params = single_device_step
  trainer = Trainer(fp8_config(MeshConfig(data=1)), jax.devices()[:1])
  trainer.init_state()
  with trainer.scope():
    for batch in harness.batches()[:2]:
      trainer.state, _ = trainer.train_step(trainer.state, trainer.to_device(batch))
  first, second = fp8_leaves(jax.device_get(params)), fp8_leaves(
      jax.device_get(trainer.state.params))
  for path in first:
    np.testing.assert_array_equal(second[path][:, 1:], first[path][:, :-1], err_msg=path)


def dot_operand_types(hlo: str) -> list[tuple[str, ...]]:
  """Element types of the operands of every dot in an HLO module's text."""
  types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", hlo))
  return [tuple(types.get(op, "?") for op in re.findall(r"%([\w.\-]+)", args))
          for args in re.findall(r" dot\(([^)]*)\)", hlo)]


def test_fp8_dots_in_the_cpu_program():
  """The step XLA receives has its projection dots on f8 operands (e4m3 x e4m3 forward, e5m2 x
  e4m3 backward). XLA:CPU has no fp8 GEMM: its compiled program keeps the fp8 casts and runs each
  such dot on the fp8 values widened to float32 (numerically the same dot)."""
  lowered = {}
  for fp8 in (False, True):
    cfg = harness.config(MeshConfig(data=1, fsdp=8), compute=dataclasses.replace(
        harness.COMPUTE, fp8=Fp8Config(enabled=fp8)))
    trainer = Trainer(cfg)
    with trainer.scope():
      lowered[fp8] = trainer.train_step.lower(trainer.abstract_state, trainer.abstract_batch())
  assert lowered[True].as_text() != lowered[False].as_text()
  f8_dots = lambda text: [l for l in text.splitlines()
                          if "dot_general" in l and "f8E4M3FN" in l]
  assert not f8_dots(lowered[False].as_text())
  dots = f8_dots(lowered[True].as_text())
  # 7 projections per layer body: forward (e4m3 x e4m3), dx and dw (e5m2 x e4m3).
  assert sum("f8E5M2" not in l for l in dots) >= 7 and sum("f8E5M2" in l for l in dots) >= 14
  text = lowered[True].compile().as_text()
  assert "f8e4m3fn[" in text and "f8e5m2[" in text


@pytest.mark.slow
def test_fp8_dots_in_the_h100_program(tmp_path):
  """Deviceless compile for 8 H100s (data=4 x tensor=2, bf16 compute): XLA:GPU keeps the dots on
  f8 operands (Triton/cuBLASLt fp8 GEMMs on sm_90)."""
  cfg = llama.debug()
  cfg.model = dataclasses.replace(cfg.model, num_layers=2, dtype="bfloat16")
  cfg.compute.fp8 = FP8
  cfg.mesh, cfg.batch_size, cfg.seq_len = MeshConfig(data=4, tensor=2), 8, 64
  hlo = tmp_path / "step.hlo"
  compile_for_gpus(cfg, compiled.parse_gpu_target("h100x8"), str(hlo))  # the gpu-aot extra
  text = hlo.read_text()
  f8 = [t for t in dot_operand_types(text) if all(x.startswith("f8") for x in t)]
  f8 += re.findall(r"__cublas\$lt\$matmul\$f8", text)
  assert len(f8) >= 3 * 7, f8  # forward, dx, dw of the 7 projections (one layer body)
  assert any("f8e5m2" in t for t in f8 if isinstance(t, tuple))


@pytest.mark.slow  # ~55 s; the default suite's training check is test_fp8_recipes' 20-step one
def test_fp8_training_stays_close_to_bf16():
  """100 steps of the tiny Llama, bf16 compute with and without fp8 projections, same data and
  init: every 10-step window mean of fp8 within 3% of bf16's."""
  assert training_runs.config(100, dtype="bfloat16", fp8=True).compute.fp8.enabled
  bf16 = training_runs.losses(100, dtype="bfloat16")
  fp8 = training_runs.losses(100, dtype="bfloat16", fp8=True)
  assert fp8 != bf16  # really a different computation
  # It learns (windows 40-50: about 2.3 nats from 4.8; the corpus gets harder after step 80).
  assert training_runs.mean(bf16, 40, 50) < training_runs.mean(bf16, 0, 10) - 1.5
  gaps = [abs(training_runs.mean(fp8, i, i + 10) / training_runs.mean(bf16, i, i + 10) - 1)
          for i in range(0, 100, 10)]
  assert max(gaps) <= 0.03, gaps



# The training comparison runs in the default build, not the suite's LLVM -O0 (tests/conftest):
# a 1-ulp difference in a value before quantization can flip an e4m3 rounding (3 mantissa bits),
# and under -O0 that happens for the non-pipelined fsdp=4 x tensor=2 layout too (update 3.8e-5).
_FP8_TRAINING = """
import dataclasses, json, jax
from sharding import MeshConfig
from tests import parallel_harness as harness
from tests.test_fp8 import FP8
from tests.test_parallel import relative_l2
compute = dataclasses.replace(harness.COMPUTE, fp8=FP8)
ref = harness.run(MeshConfig(data=1), devices=jax.devices()[:1], compute=compute, microbatches=2)
got = harness.run(MeshConfig(data=1, pipeline=2, fsdp=2, tensor=2), compute=compute,
                  microbatches=2)
print(json.dumps(dict(
    losses=[got.losses, ref.losses],
    grads=max(relative_l2(a, b) for a, b in zip(got.grads, ref.grads)),
    updates=max(relative_l2(a - s, b - s) for a, b, s in
                zip(got.params, ref.params, ref.initial_params)),
    leaves=len(got.grads))))
"""


def test_fp8_histories_under_a_pipeline_equal_one_device(single_device_step):
  """pipeline=2 x fsdp=2 x tensor=2, 2 microbatches: the stages' histories are combined by max
  over microbatches and stages (not summed, not divided) and equal the single-device step's."""
  mesh = MeshConfig(data=1, pipeline=2, fsdp=2, tensor=2)
  _, params = one_step(mesh, microbatches=2)
  leaves, want = fp8_leaves(params), fp8_leaves(jax.device_get(single_device_step[1]))
  assert len(leaves) == 7 * 3
  for path, array in leaves.items():
    got = np.asarray(jax.device_get(array))
    np.testing.assert_allclose(got, want[path], rtol=1e-5, err_msg=path)
    assert np.all(got[:, 0] > 0) and np.all(got[:, 1:] == 0), path


@pytest.mark.slow  # ~60 s: 3 steps of both layouts compiled by the default build in a subprocess
def test_fp8_under_a_pipeline_trains_like_one_device():
  """pipeline=2 x fsdp=2 x tensor=2, 2 microbatches: loss, gradients and parameter updates over 3
  steps equal one device's at the tolerances of tests/test_parallel.py."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  result = subprocess.run([sys.executable, "-c", _FP8_TRAINING], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-2000:]
  out = json.loads(result.stdout.strip().splitlines()[-1])
  assert out["leaves"] > 0
  np.testing.assert_allclose(out["losses"][0], out["losses"][1], rtol=LOSS_RTOL)
  assert out["grads"] <= GRAD_RTOL and out["updates"] <= UPDATE_RTOL


def fsdp8_collectives(tmp_path, fp8: Fp8Config, microbatches: int = 1, width: int = 256) -> dict:
  """{(kind, dtype, shape): wire bytes per step} of each array the all-gathers and
  reduce-scatters move in the deviceless fsdp=8 H100 program of a 2-layer bf16 model `width`
  wide (MLP 2x and 8 heads of 32, or from 1024 wide MLP 4x and 16 heads of 64). A combined
  collective's bytes are split over its arrays by size: XLA's combiner packs some weights'
  gathers behind another array (the bf16 program's MLP weights behind the embedding table's)."""
  cfg = llama.debug()
  heads, head_dim, mlp = (8, 32, 2 * width) if width < 1024 else (16, 64, 4 * width)
  cfg.model = dataclasses.replace(cfg.model, num_layers=2, dtype="bfloat16",
                                  embed_dim=width, mlp_dim=mlp, head_dim=head_dim,
                                  num_heads=heads, num_kv_heads=heads)
  cfg.compute.fp8 = fp8
  cfg.mesh, cfg.microbatches = MeshConfig(data=1, fsdp=8), microbatches
  cfg.batch_size, cfg.seq_len = 8 * microbatches, 64
  path = tmp_path / f"{fp8.enabled}-{fp8.recipe}-{microbatches}-{width}.hlo"
  compile_for_gpus(cfg, compiled.parse_gpu_target("h100x8"), str(path))
  text = path.read_text()
  instrs = {(comp, i.name): i for comp, body in hlo.computations(text).items() for i in body}
  out = collections.Counter()
  for c in hlo.collectives(text):
    if c.kind in ("all-gather", "reduce-scatter"):
      ins = instrs[(c.computation, c.name)]
      arrays = hlo.arrays(ins.type)  # an async start's: (operands, results), as many of each
      arrays = arrays[len(arrays) // 2:] if ins.op.endswith("-start") else arrays
      for dtype, shape in arrays:
        share = hlo.bytes_of([(dtype, shape)]) / hlo.bytes_of(arrays)
        out[(c.kind, dtype, shape)] += c.total_wire_bytes * share
  return out


@pytest.mark.slow
@pytest.mark.parametrize("microbatches,width", [(1, 256), (2, 1024)])
def test_fsdp_moves_the_projection_weights_in_fp8(tmp_path, microbatches, width):
  """fsdp=8 on 8 H100s: each weight is quantized once per step where its shard lives
  (models/fp8/weights.py) and gathered as e4m3 wherever the bf16 program gathers it: exactly
  half the bytes the bf16 program gathers for the same projection weights, with either recipe,
  at one and two microbatches (issue [21] asked for at most half). Both programs gather each
  layer's weights in the forward and again in the backward, as FSDP does to hold only one
  layer's whole weights at a time. When this test was written XLA kept the forward's gathered
  fp8 copies for the backward (0.25x-0.46x), which holds every layer's whole fp8 weights
  between the passes; by 2026-11-29 it gathered them again (2026-12-01: 2.29 MB of e4m3 at
  256 wide, one microbatch, against 4.59 MB of bf16, each twice one pass's bytes). The weight
  gradients leave the fp8 GEMMs in bf16 and are reduce-scattered in bf16: the same bytes as the
  bf16 step, no float32 collective."""
  heads, head_dim, mlp = (8, 32, 2 * width) if width < 1024 else (16, 64, 4 * width)
  # The projection weights' shapes, in any layout XLA gathers them in (dims sorted).
  projections = {(width, mlp), tuple(sorted((width, heads, head_dim)))}
  bf16 = fsdp8_collectives(tmp_path, Fp8Config(enabled=False), microbatches, width)
  assert {tuple(sorted(s)) for k, d, s in bf16 if k == "all-gather"} >= projections
  want = sum(b for (k, d, s), b in bf16.items()
             if k == "all-gather" and tuple(sorted(s)) in projections)
  scatter = lambda got: sum(b for (k, d, s), b in got.items() if k == "reduce-scatter")
  for recipe in ("tensorwise", "delayed"):
    fp8 = fsdp8_collectives(tmp_path, Fp8Config(enabled=True, recipe=recipe), microbatches, width)
    assert {tuple(sorted(s)) for k, d, s in fp8 if d == "f8e4m3fn"} == projections
    gathered = sum(b for (k, d, s), b in fp8.items() if d == "f8e4m3fn")
    assert gathered == pytest.approx(0.5 * want, rel=1e-9)
    assert scatter(fp8) == scatter(bf16) and "f32" not in {d for k, d, s in fp8}
