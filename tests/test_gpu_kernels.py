"""On an NVIDIA GPU (`make gpu-check`): the Pallas flash kernel (its Triton lowering; also with a
sliding window and with MLA's value head dim) and cuDNN attention against the reference, forward
and backward; the jax-triton RMSNorm; MoE dropless (`ragged_dot`) against the dense reference.
tests/conftest.py says how these run elsewhere.

Inputs are fresh random numbers every run (the seed is recorded in the JUnit report). Errors are
relative L2 norms ||got - want|| / ||want|| per tensor against a float32 reference computed at
`highest` matmul precision on the same (rounded) inputs. Tolerances, fixed before any GPU run:
  * bf16 inputs: 2e-2, as on CPU (tests/test_flash_attention.py; P is rounded to bf16 before P V);
  * fp32 inputs: 2e-3. The GPU's fp32 dots default to TF32 (10-bit mantissa), in the Triton kernel
    as in XLA's own fp32 matmuls; one TF32 product is off by ~3e-4, and attention chains three.
"""

import dataclasses
import functools
import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

import kernels
from kernels import flash_attention, reference
from models import ComputeConfig, ModelConfig
from models.config import MoEConfig
from models.moe import MoE
from sharding import local_layout

pytestmark = pytest.mark.gpu

SEED = int.from_bytes(os.urandom(4), "little")
TOLERANCE = {"float32": 2e-3, "bfloat16": 2e-2}


@pytest.fixture(autouse=True)
def _record_seed(record_property):
  record_property("seed", SEED)


def rel_error(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert np.isfinite(got).all(), "non-finite values"
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def attention_inputs(key, batch, length, heads, kv_heads, head_dim, dtype, packed,
                     v_head_dim=None):
  """q, k, v (v's head dim v_head_dim, default head_dim), segment ids (1-4 documents per row,
  boundaries anywhere) and an output cotangent."""
  kq, kk, kv, ks, kc = jax.random.split(key, 5)
  q = jax.random.normal(kq, (batch, length, heads, head_dim), dtype)
  k = jax.random.normal(kk, (batch, length, kv_heads, head_dim), dtype)
  v = jax.random.normal(kv, (batch, length, kv_heads, v_head_dim or head_dim), dtype)
  segments = None
  if packed:
    cuts = jnp.sort(jax.random.randint(ks, (batch, 3), 1, length), axis=1)
    segments = (jnp.arange(length)[None, :, None] >= cuts[:, None, :]).sum(-1).astype(jnp.int32)
  cotangent = jax.random.normal(kc, (*q.shape[:3], v.shape[3]), jnp.float32)
  return q, k, v, segments, cotangent


def outputs_and_grads(attend, q, k, v, cotangent):
  def loss(q, k, v):
    return jnp.sum(attend(q, k, v).astype(jnp.float32) * cotangent)
  return (attend(q, k, v), *jax.grad(loss, argnums=(0, 1, 2))(q, k, v))


def reference_outputs(q, k, v, segments, cotangent, causal, window=0):
  """The reference forward and gradients in float32 at full matmul precision."""
  upcast = [x.astype(jnp.float32) for x in (q, k, v)]
  with jax.default_matmul_precision("highest"):
    fn = jax.jit(lambda q, k, v: outputs_and_grads(
        lambda q, k, v: reference.attention(q, k, v, segments, causal=causal, window=window),
        q, k, v, cotangent))
    return jax.device_get(fn(*upcast))


def check_against_reference(attend, case, gpu, record_property, name):
  """Runs `attend` (forward + gradients) on the case's fresh inputs and records its errors."""
  key = jax.random.fold_in(jax.random.PRNGKey(SEED), zlib.crc32(name.encode()) % 2**31)
  q, k, v, segments, cotangent = jax.device_put(attention_inputs(key, **case["shape"]),
                                                gpu.device)
  got = jax.jit(lambda q, k, v: outputs_and_grads(
      lambda q, k, v: attend(q, k, v, segments), q, k, v, cotangent))(q, k, v)
  want = reference_outputs(q, k, v, segments, cotangent, case["causal"], case.get("window", 0))
  errors = {}
  for part, a, b in zip(("out", "dq", "dk", "dv"), got, want):
    assert a.dtype == q.dtype and a.shape == b.shape, part
    errors[part] = rel_error(a, b)
    record_property(f"rel_error_{part}", errors[part])
  tolerance = TOLERANCE[case["shape"]["dtype"]]
  assert max(errors.values()) < tolerance, errors


def flash_cases(gpu):
  """GPU: head dim 128 (and one 64), GQA 4 and MHA, packed and causal mixes, up to 16k tokens.
  Rehearsal: the same mixes at lengths the Pallas interpreter runs in seconds."""
  long, mid = gpu.pick((16384, 4096), (96, 80))
  return [
      dict(causal=True, shape=dict(batch=1, length=long, heads=8, kv_heads=2, head_dim=128,
                                   dtype="bfloat16", packed=False)),
      dict(causal=True, shape=dict(batch=2, length=mid, heads=8, kv_heads=2, head_dim=128,
                                   dtype="bfloat16", packed=True)),
      dict(causal=True, shape=dict(batch=2, length=mid, heads=4, kv_heads=4, head_dim=64,
                                   dtype="float32", packed=True)),
      dict(causal=False, shape=dict(batch=1, length=gpu.pick(2000, 72), heads=8, kv_heads=2,
                                    head_dim=128, dtype="float32", packed=False)),
      dict(causal=True, shape=dict(batch=1, length=gpu.pick(8192, 64), heads=16, kv_heads=2,
                                   head_dim=128, dtype="bfloat16", packed=True)),
  ]


@pytest.mark.parametrize("index", range(5))
def test_flash_kernel_equals_the_reference(gpu, record_property, index):
  case = flash_cases(gpu)[index]
  record_property("case", repr(case))
  check_against_reference(
      lambda q, k, v, seg: flash_attention(q, k, v, seg, causal=case["causal"]), case, gpu,
      record_property, f"flash{index}")


def window_and_mla_cases(gpu):
  """GPU: Mistral-like windows (4096 of 16k tokens; 1000, not a multiple of any block, over
  packed 4k), and DeepSeek-V3's MLA head dims (q/k 192, padded to 256 in the kernel; v 128)
  with a window and without. Rehearsal: the same mixes at lengths the interpreter runs fast."""
  return [
      dict(causal=True, window=gpu.pick(4096, 24),
           shape=dict(batch=1, length=gpu.pick(16384, 96), heads=8, kv_heads=2, head_dim=128,
                      dtype="bfloat16", packed=False)),
      dict(causal=True, window=gpu.pick(1000, 33),
           shape=dict(batch=2, length=gpu.pick(4096, 80), heads=4, kv_heads=4, head_dim=64,
                      dtype="float32", packed=True)),
      dict(causal=True, shape=dict(batch=1, length=gpu.pick(4096, 64), heads=16, kv_heads=16,
                                   head_dim=gpu.pick(192, 48), v_head_dim=gpu.pick(128, 32),
                                   dtype="bfloat16", packed=True)),
      dict(causal=True, window=gpu.pick(2048, 20),
           shape=dict(batch=1, length=gpu.pick(8192, 72), heads=16, kv_heads=16,
                      head_dim=gpu.pick(192, 48), v_head_dim=gpu.pick(128, 32),
                      dtype="bfloat16", packed=False)),
  ]


@pytest.mark.parametrize("index", range(4))
def test_flash_kernel_with_a_window_or_mla_head_dims_equals_the_reference(gpu, record_property,
                                                                          index):
  """The kernel paths of issue [20]: key blocks outside the window skipped (forward, dQ, dK/dV),
  and a value head dim other than q's (q/k and v padded to their own powers of two)."""
  case = window_and_mla_cases(gpu)[index]
  record_property("case", repr(case))
  check_against_reference(
      lambda q, k, v, seg: flash_attention(q, k, v, seg, causal=True,
                                           window=case.get("window", 0)),
      case, gpu, record_property, f"flash_window_mla{index}")


def cudnn_attention(q, k, v, segments, causal):
  mask = None if segments is None else reference.attention_mask(q.shape[1], segments,
                                                                causal=False)
  return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                      implementation="cudnn")


@pytest.mark.parametrize("packed", [False, True])
def test_cudnn_attention_equals_the_reference(gpu, record_property, packed):
  """jax.nn.dot_product_attention's cuDNN kernel (bf16; cuDNN's flash attention takes no fp32),
  causal, GQA 4; packed documents through the boolean mask."""
  gpu.needs_gpu("cuDNN attention")
  case = dict(causal=True, shape=dict(batch=1, length=8192 if not packed else 2048, heads=8,
                                      kv_heads=2, head_dim=128, dtype="bfloat16", packed=packed))
  check_against_reference(lambda q, k, v, seg: cudnn_attention(q, k, v, seg, True), case, gpu,
                          record_property, f"cudnn{packed}")


def test_auto_attention_is_cudnn_on_this_gpu(gpu):
  """What a bf16 run's `attention_impl=auto` resolves to here: cuDNN, measured faster than
  pallas_flash on the H200 (kernels.attention.resolve); float32 keeps pallas_flash."""
  gpu.needs_gpu("cuDNN attention")
  compute = ComputeConfig(attention_impl="auto")
  assert local_layout(dataclasses.replace(BASE, dtype="bfloat16"), compute).attention == "cudnn"
  assert local_layout(dataclasses.replace(BASE, dtype="float32"), compute).attention == \
      "pallas_flash"


def test_cudnn_attention_with_a_sliding_window_equals_the_reference(gpu, record_property):
  """What model.sliding_window runs with attention_impl=cudnn: cuDNN's local window (bf16,
  causal, GQA 4), a 1024-token window over 8192 tokens, forward and backward."""
  gpu.needs_gpu("cuDNN attention")
  case = dict(causal=True, window=1024, shape=dict(batch=1, length=8192, heads=8, kv_heads=2,
                                                   head_dim=128, dtype="bfloat16", packed=False))
  check_against_reference(
      lambda q, k, v, seg: kernels.attention(q, k, v, seg, causal=True, impl="cudnn",
                                             window=1024),
      case, gpu, record_property, "cudnn_window")


def test_cudnn_under_ulysses_equals_the_reference(gpu, record_property):
  """compute.context_impl=ulysses with attention_impl=cudnn: the model's per-device kernel
  (models.attention.context_kernel) over every GPU present, the sequence split over them; cuDNN
  attends whole sequences between the all-to-alls (bf16, causal, packed, GQA 4: 2 kv heads,
  replicated where the GPUs outnumber them). On one GPU the all-to-alls are trivial (degree 1):
  it checks cuDNN through the wrapper; on 8 the exchange too."""
  gpu.needs_gpu("cuDNN attention")
  from models.attention import context_kernel
  mesh = Mesh(np.asarray(jax.devices()), ("context",))
  tokens = P(None, "context")
  ulysses = jax.shard_map(functools.partial(context_kernel("ulysses", "cudnn"),
                                            axis_name="context"),
                          mesh=mesh, in_specs=(tokens,) * 5, out_specs=tokens)
  case = dict(causal=True, shape=dict(batch=1, length=4096, heads=8, kv_heads=2, head_dim=128,
                                      dtype="bfloat16", packed=True))
  record_property("gpus", len(jax.devices()))
  check_against_reference(
      lambda q, k, v, seg: ulysses(q, k, v, jnp.broadcast_to(jnp.arange(seg.shape[1]), seg.shape),
                                   seg),
      case, gpu, record_property, "cudnn_ulysses")


def test_flash_ring_equals_the_reference(gpu, record_property):
  """compute.context_impl=ring with the flash kernel (kernels/ring_flash_attention.py) over every
  GPU present, the sequence in the zigzag order (bf16, causal, packed, GQA 4). On one GPU the
  ring is its first hop alone (the local causal call); on 8 the hops' unmasked calls on
  half-length pieces, with the queries' and keys' own segment ids, too."""
  from sharding.context_parallel import zigzag_permutation
  n = len(jax.devices())
  mesh = Mesh(np.asarray(jax.devices()), ("context",))
  tokens = P(None, "context")
  ring = jax.shard_map(functools.partial(kernels.ring_flash_attention, axis_name="context"),
                       mesh=mesh, in_specs=(tokens,) * 5, out_specs=tokens,
                       check_vma=not gpu.rehearsal)
  length = gpu.pick(8192, 64)
  order = zigzag_permutation(length, n)

  def attend(q, k, v, seg):
    zig = lambda x: jnp.take(x, order, axis=1)  # noqa: E731
    out = ring(zig(q), zig(k), zig(v), zig(jnp.broadcast_to(jnp.arange(length), seg.shape)),
               zig(seg))
    return jnp.take(out, np.argsort(order), axis=1)
  case = dict(causal=True, shape=dict(batch=1, length=length, heads=8, kv_heads=2,
                                      head_dim=128, dtype="bfloat16", packed=True))
  record_property("gpus", n)
  check_against_reference(attend, case, gpu, record_property, "flash_ring")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_triton_rmsnorm_equals_the_reference(gpu, record_property, dtype):
  """The raw Triton residual-add + RMSNorm through jax-triton: h bit-exact (one rounding of the
  float32 sum, as XLA's), y within float32 rounding, or 2 bf16 ulps (the product's own cast)."""
  gpu.needs_gpu("jax-triton")
  from kernels import triton_rmsnorm
  kx, kr, ks = jax.random.split(jax.random.PRNGKey(SEED), 3)
  rows, dim = 4096, 4096
  x, r = (jax.device_put(jax.random.normal(key, (rows, dim), dtype), gpu.device)
          for key in (kx, kr))
  scale = jax.device_put(jax.random.uniform(ks, (dim,), dtype, 0.5, 1.5), gpu.device)
  y, h = jax.jit(triton_rmsnorm.rmsnorm_residual)(x, r, scale)
  want_y, want_h = jax.jit(lambda *a: reference.rmsnorm_residual(*a, 1e-5))(x, r, scale)
  assert y.dtype == x.dtype and h.dtype == x.dtype
  np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(want_h, np.float32))
  error = rel_error(y, want_y)
  record_property("rel_error_y", error)
  assert error < (1e-6 if dtype == "float32" else 2 * 2.0 ** -8), error


BASE = ModelConfig(vocab_size=64, embed_dim=256, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=64, mlp_dim=512)
# Capacity factor E / k: the dropping path could take every token, so nothing drops anywhere.
EXPERTS = MoEConfig(num_experts=8, experts_per_token=2, expert_mlp_dim=256, num_shared_experts=1,
                    capacity_factor=4.0, dispatch="dropless")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_dropless_equals_the_dense_reference(gpu, record_property, dtype):
  """Tokens sorted by expert through `jax.lax.ragged_dot` (the grouped GEMM) equal every expert on
  every token mixed by the router weights, forward and gradients; the reference in float32 at
  `highest` precision. float32 at the CPU test's 1e-5 (also `highest`), bf16 at 2e-2."""
  # The same parameters (same init) under the tested compute dtype and under float32, each
  # built for one device of this machine's platform (its grouped matmul kernel).
  def build(cfg):
    return nnx.split(MoE(cfg, ComputeConfig(), local_layout(cfg), rngs=nnx.Rngs(SEED % 1000)))
  graphdef, state = build(dataclasses.replace(BASE, moe=EXPERTS, dtype=dtype))
  reference_graphdef, reference_state = build(dataclasses.replace(BASE, moe=EXPERTS))
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(reference_state)):
    np.testing.assert_array_equal(a, b)
  tokens = gpu.pick((4, 1024), (2, 16))
  x = jax.random.normal(jax.random.PRNGKey(SEED), (*tokens, BASE.embed_dim), jnp.float32)
  state, x = jax.device_put((state, x), gpu.device)

  def grads(graphdef, dispatch):
    def loss(state, x):
      y, stats = nnx.merge(graphdef, state)(x, dispatch)
      return jnp.sum(jnp.sin(y.astype(jnp.float32))), (y, stats)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(state, x)

  with jax.default_matmul_precision("highest"):
    (_, (want, _)), want_grads = grads(reference_graphdef, "dense")
  with jax.default_matmul_precision("highest" if dtype == "float32" else "default"):
    (_, (got, stats)), got_grads = grads(graphdef, "dropless")
  assert float(stats["dropped"]) == 0
  tolerance = {"float32": 1e-5, "bfloat16": 2e-2}[dtype]
  errors = [rel_error(got, want)] + [
      rel_error(a, b) for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads))]
  record_property("max_rel_error", max(errors))
  assert max(errors) < tolerance, errors


def test_grouped_matmul_kernel_equals_ragged_dot(gpu, record_property):
  """The MoE's grouped GEMM (kernels/grouped_matmul.py, Triton) against jax.lax.ragged_dot,
  forward and gradients, bf16: 16k rows over 8 experts (one empty, rows past the groups), D 1024,
  F 2048; the reference upcast to float32."""
  rows, d, f = gpu.pick((16384, 1024, 2048), (96, 64, 128))
  rng = np.random.default_rng(SEED % 1000)
  sizes = rng.multinomial(rows - rows // 16, np.ones(8) / 8)
  sizes[3] = 0
  sizes = jnp.asarray(sizes, jnp.int32)
  x = jnp.asarray(rng.normal(size=(rows, d)), jnp.bfloat16)
  w = jnp.asarray(rng.normal(size=(8, d, f)) / np.sqrt(d), jnp.bfloat16)
  dy = jnp.asarray(rng.normal(size=(rows, f)), jnp.float32)
  x, w, dy, sizes = jax.device_put((x, w, dy, sizes), gpu.device)

  def grads(matmul, x, w):
    return jax.jit(lambda x, w: jax.vjp(lambda x, w: matmul(x, w, sizes).astype(jnp.float32),
                                        x, w)[1](dy))(x, w)

  with jax.default_matmul_precision("highest"):
    want = jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), sizes)
    want_grads = grads(jax.lax.ragged_dot, x.astype(jnp.float32), w.astype(jnp.float32))
  got = jax.jit(lambda x, w: kernels.grouped_matmul(x, w, sizes))(x, w)
  errors = [rel_error(got, want)] + [rel_error(a, b) for a, b in
                                     zip(grads(kernels.grouped_matmul, x, w), want_grads)]
  record_property("max_rel_error", max(errors))
  assert max(errors) < 2e-2, errors
