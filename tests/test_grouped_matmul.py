"""The MoE's grouped matmul kernel (kernels/grouped_matmul.py) in interpret mode: equal to
jax.lax.ragged_dot forward and backward over ragged groups, and inside the MoE under expert
parallelism; its program for H100 is in tests/test_kernels_gpu.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sharding
from kernels.capacity_matmul import capacity_grouped
from kernels.grouped_matmul import GroupedBlocks, grouped_matmul
from models import ComputeConfig
from models.moe import MoE
from sharding import MeshConfig
from tests import parallel_harness as harness
from tests.test_moe_parallel import MOE

SMALL = GroupedBlocks(block_m=16, block_k=16, block_n=32)
CASES = {  # rows, K, N, group sizes (empty groups, rows past the groups, tiles straddling groups)
    "ragged": (100, 48, 72, [10, 0, 33, 40, 7]),
    "one_group": (64, 32, 32, [64]),
    "leading_empty_and_tail": (130, 64, 128, [0, 0, 50, 1]),
}


def rel_error(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# The Pallas kernel (interpreted), and the batched GEMMs over equal slots per group of
# kernels/capacity_matmul.py (whose later rounds these cases need: tests/test_capacity_matmul.py).
KERNELS = {"pallas": lambda x, w, sizes: grouped_matmul(x, w, sizes, blocks=SMALL, interpret=True),
           "capacity": capacity_grouped}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", CASES)
def test_equals_ragged_dot_forward_and_gradients(case, dtype, kernel):
  rows, k, n, sizes = CASES[case]
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(rows, k)), dtype)
  w = jnp.asarray(rng.normal(size=(len(sizes), k, n)), dtype)
  dy = jnp.asarray(rng.normal(size=(rows, n)), dtype)
  sizes = jnp.asarray(sizes, jnp.int32)
  got, pullback = jax.jit(lambda x, w: jax.vjp(
      lambda x, w: KERNELS[kernel](x, w, sizes), x, w))(x, w)
  upcast = [a.astype(jnp.float32) for a in (x, w)]
  want, want_pullback = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, sizes), *upcast)
  tolerance = {"float32": 1e-6, "bfloat16": 1e-2}[dtype]
  for a, b in zip((got, *pullback(dy)), (want, *want_pullback(dy.astype(jnp.float32)))):
    assert a.dtype == x.dtype and rel_error(a, b) < tolerance
  # Not vacuous: every row through the first group's weights differs where there are several.
  if len(CASES[case][3]) > 1:
    assert rel_error(upcast[0] @ upcast[1][0], want) > 0.1


def test_bad_arguments_are_refused_in_one_line():
  x, w = jnp.zeros((8, 4)), jnp.zeros((2, 4, 8))
  with pytest.raises(ValueError, match="wants x"):
    grouped_matmul(x, w[:, :3], jnp.ones((2,), jnp.int32))
  with pytest.raises(ValueError, match="power of two"):
    grouped_matmul(x, w, jnp.ones((2,), jnp.int32), blocks=GroupedBlocks(block_m=12))


@pytest.mark.parametrize("impl", ["pallas", "capacity"])
def test_the_moe_runs_the_kernel_under_expert_parallelism(impl):
  """expert=4 x fsdp=2 (the padded exchange, experts' hidden dims whole): the MoE with the kernel
  (or the batched GEMMs of kernels/capacity_matmul.py) gives ragged_dot's loss and gradients;
  the program really holds the kernel, and no ragged dot."""
  x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 16, harness.MODEL.embed_dim)),
                  jnp.float32)
  results = {}
  for run in ("ragged_dot", impl):
    cfg = dataclasses.replace(harness.MODEL, moe=dataclasses.replace(MOE, grouped_matmul=run))
    # Built for the mesh: the dropless region takes its mesh and kernel from the layout.
    layout = sharding.resolve(MeshConfig(data=1, expert=4, fsdp=2), jax.devices(), cfg,
                              batch_size=8, seq_len=16)
    assert layout.grouped_matmul == run
    graphdef, state = nnx.split(MoE(cfg, ComputeConfig(), layout, rngs=nnx.Rngs(0)))

    def loss(state, x, graphdef=graphdef):
      return jnp.sum(jnp.sin(nnx.merge(graphdef, state)(x, "dropless")[0]))

    step = jax.value_and_grad(loss, argnums=(0, 1))
    with layout.scope():
      program = str(jax.make_jaxpr(step)(state, x))
      assert ("pallas_call" in program) == (run == "pallas")
      assert ("ragged_dot" in program) == (run == "ragged_dot")
      results[run] = jax.jit(step)(state, x)
  (want_loss, want_grads), (got_loss, got_grads) = results["ragged_dot"], results[impl]
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    assert np.linalg.norm(a - b) <= 1e-5 * max(np.linalg.norm(b), 1e-30)
