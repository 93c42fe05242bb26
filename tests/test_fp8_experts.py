"""fp8 for the MoE experts under the dropless dispatch (models/fp8/grouped.py, the fp8 kernels of
kernels/grouped_matmul.py): against a numpy simulation, against float32, under expert
parallelism, in training, and in the H100 program; and what XLA does with an f8 ragged_dot.

Tolerances, stated once:
  * forward, dx and dW vs the numpy simulation (per group, 2-D products of the ml_dtypes-cast
    operands in float64): relative L2 <= 1e-6 on both GEMM paths (measured <= 6.4e-8); each is
    also > 1e-3 off float32 (the quantization is real) and within 5e-2 of it (the straight-through
    gradients: each backward GEMM quantizes along its own contraction; measured 1.7e-2 to 3.7e-2).
  * layouts: the grouped fp8 FFN (fixed routing) under expert=4 x fsdp=2 and expert=2 x tensor=2 x
    data=2 equals one device within 1e-6 (measured <= 1.4e-7; with the amax reductions left out,
    2e-2 to 7e-2). Whole training steps only in their first loss (LOSS_RTOL), then within 2e-3,
    as in tests/test_fp8_recipes.py: fp8 turns float32 rounding differences into rounding flips.
  * the dropless layer in fp8 vs float32: > 1e-3 apart, < 1e-1 (measured in the test's comment);
    its forward equals the einsum dispatch's fp8 forward within 1e-6 when nothing drops.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import sharding
import sharding.expert
from configs import moe as moe_configs
from models import ComputeConfig
from models.config import ModelConfig
from models.fp8.config import Fp8Config
from models.fp8.grouped import RECIPES, GemmAxes, quantized_grouped
from models.moe import MoE, Experts
from sharding import MeshConfig, dropless_experts
from sharding.xla import compiled
from tests import parallel_harness as harness
from tests.test_fp8_h100_program import h100_dots
from tests.test_fp8_recipes import rel
from tests.test_moe_parallel import MOE
from tests.test_parallel import LOSS_RTOL
from trainer.aot import compile_for_gpus

FMAX = np.float32(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
IMPLS = ("ragged_dot", "pallas", "capacity")


def np_scale(amax):
  amax = np.asarray(amax, np.float32)
  return np.where(amax > 0, FMAX / np.where(amax > 0, amax, 1), np.float32(1)).astype(np.float32)


def np_quantize(t, scale):
  """t in e4m3 (every operand here, gradients included) at `scale`, as float64."""
  q = np.clip(t.astype(np.float32) * scale, -FMAX, FMAX).astype(ml_dtypes.float8_e4m3fn)
  return q.astype(np.float64)


def simulate(recipe, x, w, sizes, c):
  """(y, dx, dW) of ragged_dot(x [M, K], w [G, K, N]) in fp8 with output gradient c [M, N]:
  each GEMM per group as a 2-D product of quantized operands divided by their scales."""
  ends = np.cumsum(sizes)
  starts, (m, k), (g_count, _, n) = ends - sizes, x.shape, w.shape
  y, dx, dw = np.zeros((m, n)), np.zeros((m, k)), np.zeros(w.shape)
  if recipe == "tensorwise":  # one scale per operand, the forward's fp8 operands reused
    sx, sw, sc = (np.float64(np_scale(np.abs(t).max())) for t in (x, w, c))
    qx, qw, qc = np_quantize(x, sx), np_quantize(w, sw), np_quantize(c, sc)
    for g in range(g_count):
      r = slice(starts[g], ends[g])
      y[r], dx[r] = qx[r] @ qw[g] / (sx * sw), qc[r] @ qw[g].T / (sc * sw)
      dw[g] = qx[r].T @ qc[r] / (sx * sc)
    return y, dx, dw
  sx, sw = np_scale(np.abs(x).max(1)), np_scale(np.abs(w).max(1))  # rows; (expert, column)
  sc, swt = np_scale(np.abs(c).max(1)), np_scale(np.abs(w).max(2))  # rows; (expert, k)
  qx, qw = np_quantize(x, sx[:, None]), np_quantize(w, sw[:, None, :])
  qc, qwt = np_quantize(c, sc[:, None]), np_quantize(w, swt[:, :, None])
  for g in range(g_count):
    r = slice(starts[g], ends[g])
    y[r] = qx[r] @ qw[g] / np.outer(sx[r], sw[g])
    dx[r] = qc[r] @ qwt[g].T / np.outer(sc[r], swt[g])
    if sizes[g]:  # dW: per column, the amax over this group's rows
      sxg, scg = np_scale(np.abs(x[r]).max(0)), np_scale(np.abs(c[r]).max(0))
      dw[g] = np_quantize(x[r], sxg).T @ np_quantize(c[r], scg) / np.outer(sxg, scg)
  return y, dx, dw


def operands():
  """x [100, 48] over 5 groups (an empty one, 10 rows past the groups, row tiles straddling
  groups), w [5, 48, 72], an output gradient; outlier rows, columns and an expert's column."""
  rng = np.random.default_rng(0)
  sizes = np.array([10, 0, 33, 40, 7])
  x = rng.normal(size=(100, 48)).astype(np.float32)
  x[3] *= 50
  x[:, 5] *= 20
  w = (rng.normal(size=(5, 48, 72)) * 0.05).astype(np.float32)
  w[2, :, 7] *= 10
  c = (rng.normal(size=(100, 72)) * 1e-3).astype(np.float32)
  c[10] *= 30
  return x, w, sizes, c


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_fp8_equals_numpy_simulation(recipe, impl):
  """Forward, dx and dW (the straight-through gradients) of both GEMM paths: the Pallas fp8
  kernels (interpreted) and ragged_dot on f8 operands."""
  x, w, sizes, c = operands()
  group_sizes = jnp.asarray(sizes, jnp.int32)
  got = jax.jit(lambda x, w, c: (lambda y, vjp: (y, *vjp(c)))(*jax.vjp(
      lambda x, w: quantized_grouped(recipe, impl, GemmAxes(), True, x, w, group_sizes), x, w)))(
          x, w, c)
  exact_y, pullback = jax.vjp(lambda x, w: jax.lax.ragged_dot(
      x, w, group_sizes, precision=jax.lax.Precision.HIGHEST), x, w)
  exact = (exact_y, *pullback(c))
  for name, g, want, f32 in zip(("y", "dx", "dw"), got, simulate(recipe, x, w, sizes, c), exact):
    assert rel(g, want) <= 1e-6, name
    assert 1e-3 < rel(g, f32) < 5e-2, name


def test_xla_cpu_runs_an_f8_ragged_dot_as_an_exact_float32_dot():
  """What ragged_dot on f8 operands is on CPU: XLA:CPU converts them to float32 before its dot
  (no f8 arithmetic on the host); exact, as each product of two f8 values fits float32's
  mantissa, so the CPU path computes what an f8 GEMM with float32 accumulation does."""
  x, w, sizes, _ = operands()
  qx, qw = (jnp.asarray(np_quantize(t, np_scale(np.abs(t).max()))).astype(jnp.float8_e4m3fn)
            for t in (x, w))
  dot = jax.jit(lambda x, w, g: jax.lax.ragged_dot(x, w, g, preferred_element_type=jnp.float32))
  text = dot.lower(qx, qw, jnp.asarray(sizes, jnp.int32)).compile().as_text()
  types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", text))
  widened = re.findall(r"= f32\[[^\]]*\]\S* convert\(%([\w.\-]+)\)", text)
  assert any(types.get(operand) == "f8e4m3fn" for operand in widened)
  dots = h100_dots(text)  # (op name, operand types, in a GEMM fusion): any HLO text
  assert dots and all(d[1] == ("f32", "f32") for d in dots), dots
  got = dot(qx, qw, jnp.asarray(sizes, jnp.int32))
  ends = np.cumsum(sizes)
  x64, w64 = np.asarray(qx, np.float64), np.asarray(qw, np.float64)
  want = np.concatenate([x64[e - s:e] @ w64[g] for g, (s, e) in enumerate(zip(sizes, ends))])
  assert rel(np.asarray(got)[:ends[-1]], want) <= 1e-6


def grouped_ffn(experts: Experts, impl: str, layout: sharding.Layout = sharding.Layout()):
  """The dropless region with fixed routing: (y, its vjp at c) of x, mixing weights, params;
  on `layout`'s mesh (default: one device's, no mesh)."""
  def run(x, ids, weights, params, c):
    y, pullback = jax.vjp(lambda x, weights, params: dropless_experts(
        layout, experts.grouped, x, ids, weights, params, Experts.NAMES,
        num_experts=MOE.num_experts, partial_over="mlp", check_vma=impl != "pallas"),
        x, weights, params)
    return y, pullback(c)
  return run


def fp8_experts(recipe: str, impl: str) -> tuple[ModelConfig, ComputeConfig, Experts]:
  """The harness model with MOE's experts on grouped matmul `impl` in fp8 (`recipe`), and its
  experts built on one device."""
  cfg = dataclasses.replace(harness.MODEL, moe=dataclasses.replace(MOE, grouped_matmul=impl))
  compute = ComputeConfig(fp8=Fp8Config(enabled=True, recipe=recipe, targets="experts"))
  return cfg, compute, Experts(cfg, compute, sharding.local_layout(cfg, compute),
                               rngs=nnx.Rngs(0))


def mesh_layout(name: str, cfg: ModelConfig, compute: ComputeConfig) -> sharding.Layout:
  """The resolved layout of LAYOUTS[name] for ffn_inputs' batch."""
  return sharding.resolve(LAYOUTS[name], jax.devices(), cfg, compute, batch_size=8, seq_len=16)


def ffn_inputs(cfg: ModelConfig):
  rng = np.random.default_rng(0)
  b, l, k = 8, 16, MOE.experts_per_token
  x = jnp.asarray(rng.normal(size=(b, l, cfg.embed_dim)), jnp.float32)
  ids = jnp.asarray(rng.integers(0, MOE.num_experts, (b, l, k)), jnp.int32)
  weights = jnp.asarray(rng.random((b, l, k)), jnp.float32)
  return x, ids, weights, jnp.asarray(rng.normal(size=x.shape), jnp.float32)


LAYOUTS = {"expert=4,fsdp=2": MeshConfig(data=1, expert=4, fsdp=2),  # an expert's rows over fsdp
           "expert=2,tensor=2,data=2": MeshConfig(data=2, expert=2, tensor=2)}  # hidden dim too


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_sharded_grouped_fp8_ffn_equals_one_device(recipe, impl, layout):
  """Output and gradients (tokens, mixing weights, the three expert weights) of the dropless
  region in fp8 under expert parallelism equal one device's: each amax is reduced over the mesh
  axes its elements lie on (sharding.expert.ExpertAxes)."""
  cfg, compute, experts = fp8_experts(recipe, impl)
  x, ids, weights, c = ffn_inputs(cfg)
  args = (x, ids, weights, experts.weights(), c)
  want = jax.tree.leaves(jax.jit(grouped_ffn(experts, impl))(*args))
  mesh = mesh_layout(layout, cfg, compute)
  with mesh.scope():
    got = jax.tree.leaves(jax.jit(grouped_ffn(experts, impl, mesh))(*args))
  assert len(got) == len(want) == 6
  for a, b in zip(got, want):
    assert rel(a, b) <= 1e-6


@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_fp8_ffn_under_the_replicas_vmap_equals_each_replica_alone(recipe):
  """Gradient accumulation vmaps the loss over data-parallel replicas with spmd_axis_name
  (trainer/step.py), around the scan over the layer stack: here expert=2 x tensor=2 inside, 2
  replicas over `data`, a one-layer scan. Each replica scales by its own rows' amaxes, as the
  dense projections' current-scaling recipes do under that vmap, and equals that replica run
  alone on one device. (The ragged_dot path failed this vmap's varying-axes check until
  sharding/expert.py typed the weights it broadcasts over the replicas like the rows.)"""
  cfg, compute, experts = fp8_experts(recipe, "ragged_dot")
  x, ids, weights, c = (a.reshape(2, a.shape[0] // 2, *a.shape[1:]) for a in ffn_inputs(cfg))
  stacked = [p[None] for p in experts.weights()]  # a layer stack of one

  def make(layout=sharding.Layout()):
    def run(x, ids, weights, stacked, c):
      def layers(x, weights, stacked):
        step = lambda _, params: (None, grouped_ffn(experts, "ragged_dot", layout)(
            x, ids, weights, params, c))
        return jax.lax.scan(step, None, stacked)[1]
      return jax.tree.map(lambda a: a[0], layers(x, weights, stacked))
    return run

  alone = [jax.tree.leaves(jax.jit(make())(x[r], ids[r], weights[r], stacked, c[r]))
           for r in range(2)]
  mesh = mesh_layout("expert=2,tensor=2,data=2", cfg, compute)
  with mesh.scope():
    with sharding.excluding(("data",)):
      got = jax.jit(jax.vmap(make(mesh), in_axes=(0, 0, 0, None, 0), spmd_axis_name="data"))(
          x, ids, weights, stacked, c)
  assert len(jax.tree.leaves(got)) == 6
  for a, *per_replica in zip(jax.tree.leaves(got), *alone):
    assert rel(a, np.stack(per_replica)) <= 1e-6


def test_the_layout_check_sees_missing_amax_reductions(monkeypatch):
  """Not vacuous: with no axes handed to the expert FFN (each device scaling by its own amaxes)
  the rowwise FFN under expert=2 x tensor=2 x data=2 is percents off one device."""
  cfg, compute, experts = fp8_experts("rowwise", "ragged_dot")
  x, ids, weights, c = ffn_inputs(cfg)
  args = (x, ids, weights, experts.weights(), c)
  want = jax.tree.leaves(jax.jit(grouped_ffn(experts, "ragged_dot"))(*args))
  none = sharding.expert.ExpertAxes()
  monkeypatch.setattr(sharding.expert, "ExpertAxes", lambda *_: none)
  mesh = mesh_layout("expert=2,tensor=2,data=2", cfg, compute)
  with mesh.scope():
    got = jax.tree.leaves(jax.jit(grouped_ffn(experts, "ragged_dot", mesh))(*args))
  assert min(rel(a, b) for a, b in zip(got, want)) > 1e-2


def moe_layer(recipe: str | None, dispatch: str = "dropless", capacity_factor: float = 1.25):
  compute = ComputeConfig(fp8=Fp8Config(enabled=recipe is not None, recipe=recipe or "delayed",
                                         targets="experts"))
  moe = dataclasses.replace(MOE, dispatch=dispatch, capacity_factor=capacity_factor)
  cfg = dataclasses.replace(harness.MODEL, moe=moe)
  return nnx.split(MoE(cfg, compute, sharding.local_layout(cfg, compute), rngs=nnx.Rngs(0)))


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_dropless_layer_against_float32_and_the_einsum_dispatch(recipe):
  """The MoE layer (router, 8 experts top-2, a shared expert) with its routed experts in fp8,
  output and parameter gradients (cotangent cos(y)), against the float32 layer:
    * dropless moves them (its experts ran in float32 before) but stays within 1e-1 (measured:
      output 3.7e-2 / 3.4e-2 for tensorwise / rowwise, gradients 1.3e-2 to 7.2e-2);
    * with capacity for every token, the einsum dispatch's fp8 forward is the same to float32
      rounding: its Einsums scale alike (rowwise: per row and per (expert, column); tensorwise:
      the dispatched [E, B, C, D] holds every token, its empty slots zeros);
    * the expert weights' gradients, from e4m3 output gradients here, are no further from
      float32 than the einsum dispatch's from e5m2 ones (measured 5.3e-2 to 6.7e-2 vs 6.4e-2
      to 8.9e-2)."""
  x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 16, harness.MODEL.embed_dim)),
                  jnp.float32)
  no_drops = MOE.num_experts / MOE.experts_per_token  # capacity = the whole sequence
  results = {}
  for name, r, dispatch in (("dropless", recipe, "dropless"), ("dropping", recipe, "dropping"),
                            ("float32", None, "dropless")):
    graphdef, state = moe_layer(r, dispatch, no_drops)

    def output_and_grads(state, graphdef=graphdef, dispatch=dispatch):
      (y, stats), pullback = jax.vjp(lambda s: nnx.merge(graphdef, s)(x, dispatch), state)
      grads = pullback((jnp.cos(y), jax.tree.map(jnp.zeros_like, stats)))[0]
      return y, stats["dropped"], grads
    y, dropped, grads = jax.jit(output_and_grads)(state)
    assert float(dropped) == 0
    results[name] = y, {jax.tree_util.keystr(p): g for p, g in
                        jax.tree_util.tree_flatten_with_path(grads)[0] if np.any(g)}
  (y8, g8), (y_einsum, g_einsum), (y32, g32) = (results[n] for n in results)
  assert rel(y8, y_einsum) <= 1e-6
  assert 1e-3 < rel(y8, y32) < 1e-1
  assert len(g8) == len(g32) == 7  # router, routed and shared experts (the bias gets none)
  for path, g in g8.items():
    assert 1e-3 < rel(g, g32[path]) < 1e-1, path
    if "'experts'" in path:
      assert rel(g, g32[path]) <= rel(g_einsum[path], g32[path]), path


@pytest.mark.parametrize("recipe", ["delayed", "blockwise"])
def test_dropless_refuses_delayed_and_blockwise_in_one_line(recipe):
  model = dataclasses.replace(harness.MODEL, moe=MOE)
  compute = ComputeConfig(fp8=Fp8Config(enabled=True, recipe=recipe))
  with pytest.raises(ValueError) as error:
    compute.validate(model)
  message = str(error.value)
  assert f"compute.fp8.recipe={recipe!r}" in message and "dropless" in message
  assert "\n" not in message
  # Fine with the einsum dispatch, or with the experts out of fp8.
  compute.validate(dataclasses.replace(model, moe=dataclasses.replace(MOE, dispatch="dropping")))
  ComputeConfig(fp8=Fp8Config(enabled=True, recipe=recipe,
                              targets="attention,mlp")).validate(model)
  # A model built for the einsum dispatch and called dropless refuses too, not silently bf16.
  cfg = dataclasses.replace(harness.MODEL, moe=dataclasses.replace(MOE, dispatch="dropping"))
  compute = ComputeConfig(fp8=Fp8Config(enabled=True, recipe=recipe, targets="experts"))
  layer = MoE(cfg, compute, sharding.local_layout(cfg, compute), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="grouped"):
    layer(jnp.ones((2, 8, cfg.embed_dim)), "dropless")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["expert=4,fsdp=2", "expert=2,tensor=2,data=2,ga=2,remat=full",
                                    "pipeline=2,expert=2,data=2,ga=2"])
def test_dropless_fp8_trains_under_expert_parallelism_like_one_device(layout):
  """3 AdamW steps of the harness MoE (experts in fp8, the rest float32) vs one device. Under
  expert=4 x fsdp=2 the first loss within LOSS_RTOL; every loss within 2e-3 (measured at most
  7.8e-5; first gradients 1.0e-6 / 4.7e-4 apart for tensorwise / rowwise: the chaos that
  tests/test_fp8_recipes.py describes, since the FFN alone matches to 1.4e-7 above). With
  gradient accumulation over 2 data-parallel replicas each replica scales by its own rows, so
  its first loss is only within 2e-3 too (measured 1.5e-5 / 2.4e-7), and so under a pipeline
  (1F1B; the MoE layer and its dropless exchange on the second stage)."""
  mesh_cfg, options = {
      "expert=4,fsdp=2": (MeshConfig(data=1, expert=4, fsdp=2), {}),
      "expert=2,tensor=2,data=2,ga=2,remat=full": (MeshConfig(data=2, expert=2, tensor=2),
                                                   dict(microbatches=2, remat="full")),
      "pipeline=2,expert=2,data=2,ga=2": (MeshConfig(data=2, pipeline=2, expert=2),
                                          dict(microbatches=2))}[layout]
  for recipe in RECIPES:
    compute = dataclasses.replace(harness.COMPUTE, fp8=Fp8Config(enabled=True, recipe=recipe,
                                                                 targets="experts"))
    ref = harness.run(MeshConfig(data=1), devices=jax.devices()[:1], compute=compute, moe=MOE)
    got = harness.run(mesh_cfg, compute=compute, moe=MOE, **options)
    assert ref.losses[-1] < ref.losses[0], recipe
    if not options:
      np.testing.assert_allclose(got.losses[0], ref.losses[0], rtol=LOSS_RTOL, err_msg=recipe)
    np.testing.assert_allclose(got.losses, ref.losses, rtol=2e-3, err_msg=recipe)


def triton_dots(text: str, kernel: str) -> list[str]:
  """The tt.dot lines of each Triton custom call named `kernel` in an HLO text (its Triton IR,
  MLIR bytecode in the backend config, parsed in JAX's MLIR context with Triton's dialect)."""
  from jax.extend.mlir import ir  # pylint: disable=import-outside-toplevel
  from jax.interpreters import mlir  # pylint: disable=import-outside-toplevel
  from jaxlib.triton import dialect  # pylint: disable=import-outside-toplevel
  out = []
  for line in text.splitlines():
    if "gpu.triton" not in line or f"/{kernel}/pallas_call" not in line:
      continue
    escaped = re.search(r'ir = "((?:[^"\\]|\\.)*)"', line).group(1)
    raw = re.sub(rb"\\([0-9A-Fa-f]{2})", lambda m: bytes([int(m.group(1), 16)]),
                 escaped.encode("latin-1"))
    raw = raw.replace(b'\\"', b'"').replace(b"\\\\", b"\\")
    context = mlir.make_ir_context()  # JAX's dialects, and Triton's registered into it
    dialect.register_dialect(context)
    context.load_all_available_dialects()
    with context:
      module = str(ir.Module.parse(raw))
    out.append([l for l in module.splitlines() if "tt.dot" in l])
  return out


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["pallas", "ragged_dot"])
def test_expert_gemms_are_f8_in_the_h100_program(impl, tmp_path):
  """Deviceless compile for 8 H100s (expert=4 x fsdp=2, bf16 compute, rowwise experts). pallas
  (what "auto" picks on GPUs): per MoE layer 3 forward, 3 dx and 3 dW fp8 Triton kernels, and 2
  forwards again in the backward (the exchange's rounds recompute each round's forward inside
  their vjp: gate and up; down's output is not needed), each dot in their Triton IR f8E4M3FN x
  f8E4M3FN -> f32, no bf16 grouped kernel left. ragged_dot:
  every ragged_dot dot is a Triton GEMM fusion on f8e4m3fn operands (over XLA's masked copy of
  the rows per expert: tests/test_kernels_gpu.py)."""
  cfg = moe_configs.debug_moe()
  cfg.mesh, cfg.batch_size, cfg.seq_len = MeshConfig(data=1, expert=4, fsdp=2), 16, 64
  moe = dataclasses.replace(cfg.model.moe, dispatch="dropless", grouped_matmul=impl)
  cfg.model = dataclasses.replace(cfg.model, num_layers=2, dtype="bfloat16", moe=moe)
  cfg.compute.fp8 = Fp8Config(enabled=True, recipe="rowwise", targets="experts")
  hlo = tmp_path / "step.hlo"
  compile_for_gpus(cfg, compiled.parse_gpu_target("h100x8"), str(hlo))
  text = hlo.read_text()
  if impl == "ragged_dot":
    dots = [d for d in h100_dots(text) if "ragged_dot" in d[0]]
    assert dots and all(d[1] == ("f8e4m3fn", "f8e4m3fn") and d[2] for d in dots), dots
    return
  assert "/grouped_matmul/pallas_call" not in text and "/grouped_matmul_dw/" not in text
  forward_and_dx, dw = triton_dots(text, "grouped_matmul_fp8"), \
      triton_dots(text, "grouped_matmul_fp8_dw")
  assert len(forward_and_dx) == 3 + 2 + 3 and len(dw) == 3
  for dots in forward_and_dx + dw:
    assert dots and all(re.search(r"xf8E4M3FN> \* tensor<\S+xf8E4M3FN> -> tensor<\S+xf32>", d)
                        for d in dots), dots
