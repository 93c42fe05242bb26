"""Collective matmul: equal to the plain sharded matmul (forward and gradient) on 8 CPU devices,
and N - 1 collective-permutes interleaved with matmuls in the compiled 8xH100 program."""

import dataclasses
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sharding
from sharding import collective_matmul as cm
from sharding.xla import hlo, overlap
from tests import parallel_harness as harness
from tests.test_parallel import assert_same_training, reference  # noqa: F401
from trainer.trainer import Trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RES = ("batch", "res_seq", "act_embed")  # the sequence-parallel residual stream
MLP = ("batch", "seq", "act_mlp")
# float32, 8 devices: the decomposed sums add the same terms in another order.
TOL = dict(rtol=1e-5, atol=1e-5)


def layout_of(sequence_parallel=True, **mesh) -> sharding.Layout:
  """A layout on the 8 devices with these mesh sizes, its rules with or without sequence
  parallelism (what the collective matmuls take their mesh from; `.scope()` for the specs)."""
  cfg = sharding.MeshConfig(**{"data": 1, **mesh})
  rules = sharding.layout_rules(sharding.DEFAULT_RULES, sequence_parallel=sequence_parallel)
  return sharding.Layout(**sharding.resolve_sizes(cfg, 8), sequence_parallel=sequence_parallel,
                         mesh=sharding.make_mesh(cfg), rules=rules)


def gather_matmul(layout):
  return functools.partial(cm.logical_all_gather_matmul, layout)


def matmul_scatter(layout):
  return functools.partial(cm.logical_matmul_reduce_scatter, layout)


def plain(x, w, x_names, out_names, contract=1):
  """The reference: the same matmul under jit with the layout's shardings, XLA's collectives."""
  def f(x, w):
    return sharding.constrain(jnp.tensordot(x, w, axes=contract), out_names)
  x_sharding = sharding.named_sharding(x_names, x.shape)
  return jax.jit(f, in_shardings=(x_sharding, None))


def check(fn, x, w, x_names, out_names, contract=1):
  """fn == plain matmul, forward and the gradient of a nonlinear loss, in the current scope."""
  ref = plain(x, w, x_names, out_names, contract)
  got = jax.jit(lambda x, w: fn(x, w, x_names, out_names, contract=contract))
  np.testing.assert_allclose(got(x, w), ref(x, w), **TOL)
  loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)))  # noqa: E731
  for g, r in zip(jax.jit(jax.grad(loss(got), argnums=(0, 1)))(x, w),
                  jax.jit(jax.grad(loss(ref), argnums=(0, 1)))(x, w)):
    np.testing.assert_allclose(g, r, **TOL)
  return got


def arrays(*shapes):
  keys = jax.random.split(jax.random.key(0), len(shapes))
  return [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes)]


@pytest.mark.parametrize("mesh", [dict(tensor=8), dict(fsdp=2, tensor=4),
                                  dict(data=2, tensor=2, context=2)])
def test_all_gather_matmul_equals_the_sharded_matmul(mesh):
  x, w = arrays((4, 32, 16), (16, 24))
  layout = layout_of(**mesh)
  with layout.scope():
    got = check(gather_matmul(layout), x, w, RES, MLP)
    text = got.lower(x, w).compile().as_text()
  assert "collective-permute" in text


@pytest.mark.parametrize("mesh", [dict(tensor=8), dict(fsdp=2, tensor=4)])
def test_matmul_reduce_scatter_equals_the_sharded_matmul(mesh):
  h, w = arrays((4, 32, 24), (24, 16))
  layout = layout_of(**mesh)
  with layout.scope():
    check(matmul_scatter(layout), h, w, MLP, RES)


def test_attention_shaped_projections_contract_two_dims():
  """q = x . Wq with Wq [D, H, Dh] (heads split), out = o . Wo contracting [H, Dh]."""
  x, wq, o, wo = arrays((2, 16, 32), (32, 8, 4), (2, 16, 8, 4), (8, 4, 32))
  heads = ("batch", "seq", "act_heads", None)
  layout = layout_of(fsdp=2, tensor=4)
  with layout.scope():
    check(gather_matmul(layout), x, wq, RES, heads, contract=1)
    check(matmul_scatter(layout), o, wo, heads, RES, contract=2)


@pytest.mark.parametrize("mesh", [dict(fsdp=2, tensor=4), dict(data=2, tensor=2, context=2)])
def test_model_with_collective_matmul_trains_like_one_device(mesh, reference):  # noqa: F811
  """`compute.collective_matmul` in the MLP under sequence parallelism: 3 AdamW steps equal one
  device (test_parallel's tolerances); the program really differs (collective-permutes)."""
  compute = dataclasses.replace(harness.COMPUTE, collective_matmul=True)
  cfg = sharding.MeshConfig(**{"data": 1, **mesh}, sequence_parallel=True)
  permutes = lambda c: [op for op in hlo.collectives(  # noqa: E731
      harness.compile_step(cfg, compute=c).as_text()) if op.kind == "collective-permute"]
  assert permutes(compute) and len(permutes(compute)) > len(permutes(harness.COMPUTE))
  assert_same_training(harness.run(cfg, compute=compute), reference)


def test_collective_matmul_needs_sequence_parallelism():
  cfg = harness.config(sharding.MeshConfig(data=2, tensor=4),
                       compute=dataclasses.replace(harness.COMPUTE, collective_matmul=True))
  with pytest.raises(ValueError, match="set mesh.sequence_parallel=true"):
    Trainer(cfg)


def test_without_context_or_sequence_parallelism_it_is_the_plain_matmul():
  x, w = arrays((4, 32, 16), (16, 24))
  np.testing.assert_array_equal(gather_matmul(sharding.Layout())(x, w, RES, MLP), x @ w)
  layout = layout_of(sequence_parallel=False, tensor=4, fsdp=2)
  with layout.scope():
    got = check(gather_matmul(layout), x, w, RES, MLP)
    assert "collective-permute" not in got.lower(x, w).compile().as_text()


def test_per_device_functions_match_the_collectives():
  """Inside shard_map, on one mesh axis, against all_gather / psum_scatter directly."""
  x, w, h, v = arrays((8, 16, 16), (16, 32), (8, 64, 24), (24, 16))
  mesh = sharding.make_mesh(sharding.MeshConfig(data=1, tensor=8))
  P = jax.sharding.PartitionSpec

  def run(fn, a, b, a_spec, b_spec, out_spec):
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=(a_spec, b_spec), out_specs=out_spec)
    return jax.jit(mapped)(a, b)

  ag = lambda a, b: jax.lax.all_gather(a, "tensor", axis=1, tiled=True) @ b  # noqa: E731
  specs = (P(None, "tensor"), P(None, "tensor"), P(None, None, "tensor"))  # column-parallel w
  got = run(lambda a, b: cm.all_gather_matmul(a, b, "tensor", gather_dim=1), x, w, *specs)
  np.testing.assert_allclose(got, run(ag, x, w, *specs), **TOL)
  rs = lambda a, b: jax.lax.psum_scatter(  # noqa: E731
      a @ b, "tensor", scatter_dimension=1, tiled=True)
  got = run(lambda a, b: cm.matmul_reduce_scatter(a, b, "tensor", scatter_dim=1), h, v,
            P(None, None, "tensor"), P("tensor"), P(None, "tensor"))
  want = run(rs, h, v, P(None, None, "tensor"), P("tensor"), P(None, "tensor"))
  np.testing.assert_allclose(got, want, **TOL)


def test_layouts_it_cannot_decompose_are_one_line_errors():
  h, w = arrays((4, 32, 24), (24, 16))
  layout = layout_of(tensor=8)
  with layout.scope(), pytest.raises(sharding.LayoutError, match="contracted dims of x"):
    # the hidden dim is whole (act_embed): there are no partial sums to reduce-scatter
    matmul_scatter(layout)(h, w, ("batch", "seq", "act_embed"), RES)


def gpu_program(*args: str) -> str:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  result = subprocess.run([sys.executable, "-m", "benchmarks.sp_mlp_block", "h100x8", "8", *args],
                          capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={**env, "JAX_PLATFORMS": "cpu"})
  assert result.returncode == 0, result.stderr[-2000:]
  return result.stdout


@pytest.mark.parametrize("grad", [False, True])
def test_h100_program_interleaves_permutes_with_matmuls(grad):
  """8xH100, tensor=8: each of the block's collective matmuls is N - 1 = 7 collective-permutes
  (2 forward, 2 more backward), no all-gather or reduce-scatter, and every permute has a matmul
  scheduled between its start and done."""
  text = gpu_program(*(["grad"] if grad else []))
  cols = hlo.collectives(text)
  assert {c.kind for c in cols} == {"collective-permute"}
  assert len(cols) == 7 * (4 if grad else 2) and all(c.is_async and c.count == 1 for c in cols)
  windows = overlap.windows(text)
  assert all(windows[c.name].matmul_ops >= 1 for c in cols)
  # In schedule order: a matmul between every two consecutive permutes.
  order = [line.split()[0] for line in overlap.timeline(text, windows[cols[0].name].computation)]
  starts = [i for i, op in enumerate(order) if op == "collective-permute-start"]
  assert all("fusion" in order[a:b] for a, b in zip(starts, starts[1:]))


def test_xla_alone_leaves_the_same_block_exposed():
  """The baseline: the plain matmuls with sharding constraints get XLA's all-gather and
  reduce-scatter, each feeding or fed by the adjacent matmul, so nothing runs in between."""
  text = gpu_program("plain")
  cols = hlo.collectives(text)
  assert sorted(c.kind for c in cols) == ["all-gather", "reduce-scatter"]
  windows = overlap.windows(text)
  assert all(windows[c.name].compute_ops == 0 for c in cols)


HEADS = ("batch", "seq", "act_heads", "head_dim")
SUMMED = ("batch", "seq", "act_embed")  # a projection input's gradient before the scatter


def dx_terms(heads_names=HEADS):
  """q-shaped and MLP-shaped input-gradient terms, g . w^T, as the fp8 projections form them."""
  gq, wq, gh, wh = arrays((4, 32, 8, 4), (16, 8, 4), (4, 32, 24), (16, 24))
  terms = [(functools.partial(jnp.einsum, "BLHd,DHd->BLD"), (gq, wq)),
           (functools.partial(jnp.einsum, "BLF,DF->BLD"), (gh, wh))]
  names = [(heads_names, ("act_embed", *heads_names[2:])), (MLP, ("act_embed", "act_mlp"))]
  return terms, names


def reductions(text: str) -> dict:
  counts = {}
  for c in hlo.collectives(text):
    if c.kind in ("all-reduce", "reduce-scatter") and len(c.shape) == 3:
      counts[c.kind] = counts.get(c.kind, 0) + c.count * c.arrays
  return counts


@pytest.mark.parametrize("mesh", [dict(data=2, tensor=4), dict(tensor=2, context=2, data=2)])
def test_summed_terms_are_reduce_scattered_once(mesh):
  """logical_sum_reduce_scatter equals the plain sum XLA partitions, and reduces the two terms'
  partial sums in one reduce-scatter where XLA reduces each term (2 reductions)."""
  terms, names = dx_terms()
  layout = layout_of(**mesh)
  with layout.scope():
    shardings = [[sharding.named_sharding(n, a.shape) for a, n in zip(args, ns)]
                 for (_, args), ns in zip(terms, names)]
    args = [tuple(jax.device_put(a, s) for a, s in zip(args, ss))
            for (_, args), ss in zip(terms, shardings)]
    fns = [fn for fn, _ in terms]
    once = jax.jit(lambda args: cm.logical_sum_reduce_scatter(
        layout, list(zip(fns, args)), names, SUMMED, RES))
    xla = jax.jit(lambda args: sharding.constrain(
        sum(fn(*a) for fn, a in zip(fns, args)), RES))
    np.testing.assert_allclose(once(args), xla(args), **TOL)
    assert reductions(once.lower(args).compile().as_text()) == {"reduce-scatter": 1}
    assert sum(reductions(xla.lower(args).compile().as_text()).values()) == 2


def test_terms_it_cannot_sum_locally_are_the_plain_sum():
  """Without sequence parallelism nothing is scattered, and a term whose heads are whole on each
  device is no partial sum: both are XLA's plain sum (no reduce-scatter of ours), equal to it."""
  for layout, heads in ((layout_of(sequence_parallel=False, data=2, tensor=4), HEADS),
                        (layout_of(data=2, tensor=4), ("batch", "seq", None, "head_dim"))):
    terms, names = dx_terms(heads)
    with layout.scope():
      got = jax.jit(lambda: cm.logical_sum_reduce_scatter(layout, terms, names, SUMMED, RES))
      want = sum(fn(*args) for fn, args in terms)
      np.testing.assert_allclose(got(), want, **TOL)
      assert "shard_map" not in str(got.trace().jaxpr)
