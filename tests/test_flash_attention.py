"""The Pallas flash-attention kernel in interpret mode: equal to the reference forward and
backward (also with a sliding window and with MLA's value head dim), a different program (no
[S, S] buffer), causal and window block skipping (counted), and the sharded model.

Errors are relative L2 norms ||kernel - reference|| / ||reference|| per tensor, against the
float32 reference on the same (bf16-rounded) inputs: < 1e-5 for float32, < 2e-2 for bf16.
"""

import functools
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sharding
import kernels
from kernels import BlockSizes, flash_attention, reference
from kernels.flash_attention import visit_counts
from models import ComputeConfig
from tests import parallel_harness

TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
SMALL_BLOCKS = BlockSizes(block_q=64, block_k=32, block_q_bwd=32, block_k_bwd=64)


def random_cases(n: int, seed: int = 0):
  """Random shapes: lengths (most not a multiple of any block), head dim 64/128, GQA 1/4/8,
  causal or not, packed segments or not, both dtypes; batch and heads kept small for CPU."""
  rng = np.random.default_rng(seed)
  cases = []
  for i in range(n):
    groups = (1, 4, 8)[i % 3]
    kv_heads = 1 if groups == 8 else int(rng.integers(1, 3))
    cases.append(dict(batch=int(rng.integers(1, 3)), length=int(rng.integers(17, 257)),
                      kv_heads=kv_heads, groups=groups, head_dim=(64, 128)[i % 2],
                      causal=bool(i % 4 != 3), packed=bool(i % 2 == 0),
                      dtype=("float32", "bfloat16")[(i // 2) % 2]))
  return cases


def make_inputs(case, seed=0):
  rng = np.random.default_rng(seed)
  b, length, k, g, d = (case[x] for x in ("batch", "length", "kv_heads", "groups", "head_dim"))
  q = jnp.asarray(rng.normal(size=(b, length, k * g, d)), case["dtype"])
  k_, v = (jnp.asarray(rng.normal(size=(b, length, k, n)), case["dtype"])
           for n in (d, case.get("v_head_dim", d)))
  segments = None
  if case["packed"]:  # 1-4 documents per row, boundaries anywhere (also inside blocks)
    cuts = np.sort(rng.integers(1, length, size=(b, 3)), axis=1)
    segments = jnp.asarray((np.arange(length)[None, :, None] >= cuts[:, None, :]).sum(-1),
                           jnp.int32)
  return q, k_, v, segments


def rel_error(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def outputs_and_grads(attend, q, k, v, cotangent):
  def loss(q, k, v):
    return jnp.sum(attend(q, k, v).astype(jnp.float32) * cotangent)
  out = attend(q, k, v)
  return (out, *jax.grad(loss, argnums=(0, 1, 2))(q, k, v))


@pytest.mark.parametrize("case", random_cases(6), ids=lambda c: "-".join(
    f"{k}{v}" for k, v in c.items()))
def test_forward_and_gradients_equal_the_reference(case):
  q, k, v, segments = make_inputs(case)
  cotangent = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)
  kernel = jax.jit(lambda q, k, v: outputs_and_grads(
      lambda q, k, v: flash_attention(q, k, v, segments, causal=case["causal"],
                                      block_sizes=SMALL_BLOCKS, interpret=True),
      q, k, v, cotangent))
  upcast = [x.astype(jnp.float32) for x in (q, k, v)]
  expected = outputs_and_grads(
      lambda q, k, v: reference.attention(q, k, v, segments, causal=case["causal"]),
      *upcast, cotangent)
  got = kernel(q, k, v)
  for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected):
    assert a.dtype == q.dtype, name
    assert rel_error(a, b) < TOLERANCE[case["dtype"]], (name, rel_error(a, b))


# Windows below a block (5 < 16), not a multiple of one (40), past the length (64 >= 48, all
# causal keys); MLA value head dims below and above q's (odd 48 padded to 64), also without
# causality; packed or not, lengths padded to a multiple of 64. The first case's forward has
# query blocks of padding that no key's window reaches (they visit no key block at all) inside
# the backward's larger query blocks.
WINDOW_AND_MLA_CASES = [
    dict(batch=1, length=70, kv_heads=1, groups=2, head_dim=32, v_head_dim=32, causal=True,
         window=5, packed=True, dtype="float32", blocks=BlockSizes(16, 16, 64, 32)),
    dict(batch=2, length=100, kv_heads=2, groups=2, head_dim=64, v_head_dim=32, causal=True,
         window=40, packed=False, dtype="bfloat16"),
    dict(batch=1, length=48, kv_heads=1, groups=4, head_dim=48, v_head_dim=128, causal=True,
         window=64, packed=True, dtype="float32"),
    dict(batch=1, length=40, kv_heads=2, groups=1, head_dim=64, v_head_dim=16, causal=False,
         window=0, packed=True, dtype="bfloat16"),
]


@pytest.mark.parametrize("case", WINDOW_AND_MLA_CASES, ids=lambda c: "-".join(
    f"{k}{v}" for k, v in c.items() if k in ("length", "head_dim", "v_head_dim", "window")))
def test_window_and_mla_head_dims_equal_the_reference(case):
  q, k, v, segments = make_inputs(case, seed=5)
  options = dict(causal=case["causal"], window=case["window"])
  cotangent = jnp.asarray(np.random.default_rng(1).normal(size=(*q.shape[:3], v.shape[3])),
                          jnp.float32)
  kernel = jax.jit(lambda q, k, v: outputs_and_grads(
      lambda q, k, v: flash_attention(q, k, v, segments, interpret=True, **options,
                                      block_sizes=case.get("blocks", SMALL_BLOCKS)),
      q, k, v, cotangent))
  expected = jax.jit(lambda q, k, v: outputs_and_grads(  # jitted: eager ops compile one by one
      lambda q, k, v: reference.attention(q, k, v, segments, **options), q, k, v, cotangent))
  for name, a, b in zip(("out", "dq", "dk", "dv"), kernel(q, k, v),
                        expected(*(x.astype(jnp.float32) for x in (q, k, v)))):
    assert a.dtype == q.dtype and a.shape == b.shape, name
    assert rel_error(a, b) < TOLERANCE[case["dtype"]], (name, rel_error(a, b))


def expected_visits(length: int, padded: int, rows: int, cols: int, window: int):
  """[query blocks, key blocks] of `rows` x `cols` tiles: does some query (padding rows too, the
  kernels compute them) see some key of the tile, by the causal and window geometry alone."""
  r, c = np.arange(padded)[:, None], np.arange(padded)[None, :]
  sees = (c <= r) & ((r - c < window) if window else True)
  tiles = sees.reshape(padded // rows, rows, padded // cols, cols).any(axis=(1, 3))
  real_rows, real_cols = np.arange(0, padded, rows) < length, np.arange(0, padded, cols) < length
  return tiles, real_rows, real_cols


def test_the_window_skips_key_and_query_blocks_outside_it():
  """Each program's loop visits exactly the blocks the geometry needs: forward and dQ, key
  blocks holding a real key in some row's window; dK/dV, query blocks holding a real row that
  sees the key block, for each of the group's 2 heads. A window of 7 keys over 200 tokens
  visits under half of causal's blocks."""
  length, padded, kv_heads, groups = 200, 224, 1, 2  # padded to a multiple of 32
  blocks = BlockSizes(block_q=32, block_k=16, block_q_bwd=16, block_k_bwd=32)
  case = dict(batch=1, length=length, kv_heads=kv_heads, groups=groups, head_dim=16,
              packed=True, dtype="float32")
  q, k, v, segments = make_inputs(case)
  totals = {}
  for window in (0, 7, 24):
    got = jax.jit(functools.partial(visit_counts, window=window, block_sizes=blocks,
                                    interpret=True))(q, k, v, segments)
    tiles, real_q, real_k = expected_visits(length, padded, 32, 16, window)
    want_fwd = (tiles & real_k[None]).sum(1)
    tiles, real_q, real_k = expected_visits(length, padded, 16, 32, window)
    want_dq, want_dkv = (tiles & real_k[None]).sum(1), groups * (tiles & real_q[:, None]).sum(0)
    for name, want in (("fwd", want_fwd), ("dq", want_dq), ("dkv", want_dkv)):
      count = np.asarray(got[name])
      assert (count == want[:, None, None]).all(), (window, name, count[:, 0, 0], want)
    totals[window] = {name: int(np.asarray(c).sum()) for name, c in got.items()}
  for name in ("fwd", "dq", "dkv"):
    assert 2 * totals[7][name] < totals[0][name], totals


def test_the_attention_entry_point_runs_the_window_in_the_kernel():
  case = dict(batch=1, length=40, kv_heads=1, groups=2, head_dim=16, packed=True,
              dtype="float32")
  q, k, v, segments = make_inputs(case)
  got, want = jax.jit(lambda q, k, v: [kernels.attention(q, k, v, segments, impl=impl, window=9)
                                        for impl in ("pallas_flash", "xla")])(q, k, v)
  assert rel_error(got, want) < 1e-5


def test_default_blocks_and_odd_head_dim_are_handled():
  """Default (H100) blocks shrink for a short sequence; a head dim of 48 is zero-padded to 64."""
  case = dict(batch=1, length=40, kv_heads=2, groups=2, head_dim=48, causal=True, packed=True,
              dtype="float32")
  q, k, v, segments = make_inputs(case, seed=3)
  got = flash_attention(q, k, v, segments, interpret=True)
  assert rel_error(got, reference.attention(q, k, v, segments)) < 1e-5


def test_invalid_arguments_are_rejected_clearly():
  q = jnp.zeros((1, 32, 4, 64))
  kv = jnp.zeros((1, 32, 3, 64))
  with pytest.raises(ValueError, match="do not fit q"):
    flash_attention(q, kv, kv, interpret=True)  # 4 query heads over 3 kv heads
  with pytest.raises(ValueError, match="block_k=48 must be a power of two"):
    flash_attention(q, q, q, block_sizes=BlockSizes(block_k=48), interpret=True)
  with pytest.raises(ValueError, match="dtypes differ"):
    flash_attention(q, q.astype(jnp.bfloat16), q, interpret=True)
  with pytest.raises(ValueError, match="do not fit q"):
    flash_attention(q, q[..., :32], q, interpret=True)  # k's head dim is not q's (v's may be)
  with pytest.raises(ValueError, match="window=8 must be 0 .none., or > 0 with causal"):
    flash_attention(q, q, q, causal=False, window=8, interpret=True)


def test_kernel_program_has_no_seq_by_seq_buffer():
  """The reference materializes [.., S, S] scores; the kernel's whole forward+backward HLO holds
  nothing larger than a tile per score matrix (S = 256, tiles of 64 x 32)."""
  case = dict(batch=1, length=256, kv_heads=2, groups=2, head_dim=64, causal=True, packed=True,
              dtype="float32")
  q, k, v, segments = make_inputs(case)
  cotangent = jnp.ones(q.shape, jnp.float32)

  def hlo(attend):
    fn = jax.jit(lambda q, k, v: outputs_and_grads(attend, q, k, v, cotangent))
    return fn.lower(q, k, v).compile().as_text()

  seq_by_seq = re.compile(r"\[[0-9,]*256,256\]")
  assert seq_by_seq.search(hlo(lambda q, k, v: reference.attention(q, k, v, segments)))
  kernel_hlo = hlo(lambda q, k, v: flash_attention(q, k, v, segments, block_sizes=SMALL_BLOCKS,
                                                   interpret=True))
  assert not seq_by_seq.search(kernel_hlo)
  assert "f32[64,32]" in kernel_hlo  # the score tiles


def test_causal_kernel_skips_key_blocks_past_the_diagonal():
  """NaN values in the last key block poison any query row that touches that block, even
  through a zero probability (0 * NaN = NaN). Query blocks before it must not even load it."""
  case = dict(batch=1, length=128, kv_heads=1, groups=4, head_dim=64, causal=True, packed=False,
              dtype="float32")
  q, k, v, _ = make_inputs(case)
  poisoned = v.at[:, 96:].set(jnp.nan)
  blocks = BlockSizes(block_q=32, block_k=32, block_q_bwd=32, block_k_bwd=32)
  got = flash_attention(q, k, poisoned, block_sizes=blocks, interpret=True)
  assert np.isfinite(np.asarray(got[:, :96])).all()
  assert np.isnan(np.asarray(got[:, 96:])).all()
  np.testing.assert_allclose(got[:, :96], reference.attention(q, k, v)[:, :96], atol=1e-5)
  # Without causality every row reads every block.
  assert np.isnan(np.asarray(flash_attention(q, k, poisoned, causal=False, block_sizes=blocks,
                                             interpret=True))).all()


def test_sharded_train_step_with_kernels_equals_one_device():
  """pallas_flash attention (under shard_map: batch over data x fsdp, heads over tensor) and the
  chunked loss, in the real train step on data=2 x fsdp=2 x tensor=2 with 2 microbatches (the
  per-replica vmap), give the loss and gradients of one device with the XLA paths."""
  compute = ComputeConfig(attention_impl="pallas_flash", loss_impl="chunked",
                          loss_chunk_size=4)
  one = parallel_harness.run(sharding.MeshConfig(data=1), devices=jax.devices()[:1])
  got = parallel_harness.run(sharding.MeshConfig(data=2, fsdp=2, tensor=2), compute=compute,
                             microbatches=2)
  np.testing.assert_allclose(got.losses, one.losses, rtol=1e-5)
  for a, b in zip(got.grads, one.grads):
    assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b)


def test_the_kernel_refuses_a_split_sequence_and_context_parallelism_takes_over():
  """The kernel needs whole sequences per device: called on a sequence split over `context` it
  refuses; the model instead routes attention to the context-parallel kernels (ring), so a
  pallas_flash model still trains under context=2 (tests/test_context_parallel.py)."""
  from models.attention import flash_per_device
  cfg = parallel_harness.config(sharding.MeshConfig(data=4, context=2),
                                compute=ComputeConfig(attention_impl="pallas_flash"))
  from trainer.trainer import Trainer
  trainer = Trainer(cfg)
  q = jax.ShapeDtypeStruct((8, 16, 16, 8), jnp.float32)
  kv = jax.ShapeDtypeStruct((8, 16, 8, 8), jnp.float32)
  segments = jax.ShapeDtypeStruct((8, 16), jnp.int32)
  with trainer.scope(), pytest.raises(sharding.LayoutError,
                                        match="'seq' is split over context=2"):
    jax.eval_shape(flash_per_device(trainer.layout, 0), q, kv, kv, segments)
  with trainer.scope(), sharding.record_constraints():
    jax.eval_shape(trainer.step_fn, trainer.abstract_state, trainer.abstract_batch())


def test_auto_means_flash_on_gpus_and_the_reference_elsewhere(monkeypatch):
  """On NVIDIA GPUs with the cuDNN library, 16-bit attention is cuDNN's (measured 2.9x faster
  than pallas_flash on an H200); without the library (deviceless compiles here), in float32 and
  on ROCm, pallas_flash."""
  attention = importlib.import_module("kernels.attention")  # the package exports the function
  assert not attention.cudnn_available()  # this machine: JAX's CUDA plugin, no cuDNN library
  assert attention.resolve("auto", "gpu") == attention.resolve("auto", "cuda") == "pallas_flash"
  assert attention.resolve("auto", "cpu") == "xla" and attention.resolve("cudnn", "gpu") == "cudnn"
  assert attention.resolve("xla", "gpu") == "xla"
  monkeypatch.setattr(attention, "cudnn_available", lambda: True)  # as on the GPU machine
  assert attention.resolve("auto", "gpu") == attention.resolve("auto", "cuda", "float16") == "cudnn"
  assert attention.resolve("auto", "gpu", "float32") == "pallas_flash"
  assert attention.resolve("auto", "rocm") == "pallas_flash"
  assert attention.resolve("auto", "cpu") == "xla"
