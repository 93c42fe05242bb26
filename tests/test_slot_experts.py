"""The dropless experts' SwiGLU run whole on slots (models/slot_experts.py,
`model.moe.grouped_matmul=slots`): equal to the SwiGLU of jax.lax.ragged_dot forward and backward
whatever the groups (later rounds take the rows past an expert's slots), under the replicas'
vmap; in fp8 (tensorwise) equal to grouped_matmul=capacity where one round holds every row; and
under expert parallelism equal to one device (tests/test_moe_parallel.py's layouts)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sharding
from configs import moe as moe_configs
from kernels.capacity_matmul import slots_per_group
from models import ComputeConfig
from models.config import ModelConfig
from models.fp8.config import Fp8Config
from models.moe import Experts
from models.slot_experts import slot_swiglu
from sharding import MeshConfig
from sharding.xla import compiled, hlo
from tests import parallel_harness as harness
from tests.test_fp8_experts import ffn_inputs, grouped_ffn, mesh_layout
from tests.test_fp8_h100_program import h100_dots
from tests.test_grouped_matmul import CASES, rel_error
from tests.test_moe_parallel import MOE
from trainer.aot import compile_for_gpus


def swiglu_of_ragged_dot(x, gate, up, down, group_sizes):
  hidden = jax.nn.silu(jax.lax.ragged_dot(x, gate, group_sizes)) * \
      jax.lax.ragged_dot(x, up, group_sizes)
  return jax.lax.ragged_dot(hidden, down, group_sizes)


def swiglu_operands(case: str, seed: int = 0):
  rows, k, n, sizes = CASES[case]
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(rows, k)), jnp.float32)
  gate, up = (jnp.asarray(rng.normal(size=(len(sizes), k, n)) / 8, jnp.float32) for _ in "gu")
  down = jnp.asarray(rng.normal(size=(len(sizes), n, k)) / 8, jnp.float32)
  return x, gate, up, down, jnp.asarray(sizes, jnp.int32), jnp.asarray(
      rng.normal(size=(rows, k)), jnp.float32)


@pytest.mark.parametrize("case", CASES)
def test_equals_the_swiglu_of_ragged_dot_forward_and_gradients(case):
  """Output and the gradients of x and the three weights, in float32. Each case with several
  groups has one over its slots (tests/test_capacity_matmul.py checks that), so later rounds
  run and are differentiated."""
  x, gate, up, down, sizes, dy = swiglu_operands(case)
  slots = slots_per_group(x.shape[0], sizes.shape[0])
  got, pullback = jax.jit(lambda *a: jax.vjp(
      lambda x, *w: slot_swiglu(x, sizes, *w, None, None, slots), *a))(x, gate, up, down)
  want, want_pullback = jax.vjp(lambda x, *w: swiglu_of_ragged_dot(x, *w, sizes),
                                x, gate, up, down)
  assert rel_error(got, want) < 1e-6
  for a, b in zip(pullback(dy), want_pullback(dy)):
    assert rel_error(a, b) < 1e-6


def test_equals_the_swiglu_of_ragged_dot_under_vmap():
  """Gradient accumulation vmaps the experts over microbatch replicas: each replica its own
  groups, one needing later rounds and one not."""
  rows, *_ = CASES["ragged"]
  x, gate, up, down, _, dy = swiglu_operands("ragged")
  xs, dys = jnp.stack([x, x[::-1]]), jnp.stack([dy, -dy])
  sizes = jnp.asarray([[10, 0, 33, 40, 7], [20, 20, 20, 20, 20]], jnp.int32)
  slots = slots_per_group(rows, 5)
  batched = lambda x, *w: jax.vmap(  # noqa: E731
      lambda x, s: slot_swiglu(x, s, *w, None, None, slots))(x, sizes)
  each = lambda x, *w: jnp.stack([swiglu_of_ragged_dot(x[i], *w, sizes[i])  # noqa: E731
                                  for i in range(2)])
  got, pullback = jax.jit(lambda *a: jax.vjp(batched, *a))(xs, gate, up, down)
  want, want_pullback = jax.vjp(each, xs, gate, up, down)
  assert rel_error(got, want) < 1e-6
  for a, b in zip(pullback(dys), want_pullback(dys)):
    assert rel_error(a, b) < 1e-6


def test_unsorted_rows_gathered_through_their_order_equal_the_sorted_rows():
  """The exchange hands its received rows over unsorted, with their order by expert: the slots
  gather through it and the products land in the rows' own order, forward and backward, equal
  to running the sorted rows (later rounds included)."""
  x, gate, up, down, sizes, dy = swiglu_operands("ragged")
  slots = slots_per_group(x.shape[0], sizes.shape[0])
  shuffle = np.random.default_rng(2).permutation(x.shape[0])
  order = jnp.asarray(np.argsort(shuffle), jnp.int32)  # sorted row i is row order[i]
  back = jnp.asarray(shuffle, jnp.int32)
  unsorted = lambda x, *w: slot_swiglu(x, sizes, *w, order, back, slots)  # noqa: E731
  got, pullback = jax.jit(lambda *a: jax.vjp(unsorted, *a))(x[back], gate, up, down)
  want, want_pullback = jax.vjp(lambda x, *w: slot_swiglu(x, sizes, *w, None, None, slots),
                                x, gate, up, down)
  assert float(jnp.max(jnp.abs(x[back] - x))) > 0  # really shuffled
  assert rel_error(got, want[back]) < 1e-6
  (dx, *dws), (want_dx, *want_dws) = pullback(dy[back]), want_pullback(dy)
  assert rel_error(dx, want_dx[back]) < 1e-6
  for a, b in zip(dws, want_dws):
    assert rel_error(a, b) < 1e-6


def fp8_experts(impl: str) -> tuple[ModelConfig, ComputeConfig, Experts]:
  cfg = dataclasses.replace(harness.MODEL, moe=dataclasses.replace(MOE, grouped_matmul=impl))
  compute = ComputeConfig(fp8=Fp8Config(enabled=True, recipe="tensorwise", targets="experts"))
  return cfg, compute, Experts(cfg, compute, sharding.local_layout(cfg, compute),
                               rngs=nnx.Rngs(0))


@pytest.mark.parametrize("layout", [None, "expert=4,fsdp=2", "expert=2,tensor=2,data=2"])
def test_fp8_equals_capacity_where_one_round_holds_every_row(layout):
  """The dropless region in tensorwise fp8 (output and the gradients of tokens, mixing weights
  and the three expert weights): the slots scale x and the SwiGLU product by the amaxes of the
  rows they hold, which are every row's in one round, so they give grouped_matmul=capacity's
  numbers, on one device and under expert parallelism (amaxes reduced over the mesh)."""
  results = {}
  for impl in ("capacity", "slots"):
    cfg, compute, experts = fp8_experts(impl)
    x, ids, weights, c = ffn_inputs(cfg)
    args = (x, ids, weights, experts.weights(), c)
    if layout is None:
      results[impl] = jax.tree.leaves(jax.jit(grouped_ffn(experts, impl))(*args))
    else:
      mesh = mesh_layout(layout, cfg, compute)
      with mesh.scope():
        results[impl] = jax.tree.leaves(jax.jit(grouped_ffn(experts, impl, mesh))(*args))
  assert len(results["slots"]) == len(results["capacity"]) == 6
  for a, b in zip(results["slots"], results["capacity"]):
    assert rel_error(a, b) <= 1e-6


def test_fp8_rowwise_is_refused_in_one_line():
  cfg = dataclasses.replace(harness.MODEL, moe=dataclasses.replace(MOE, grouped_matmul="slots"))
  compute = ComputeConfig(fp8=Fp8Config(enabled=True, recipe="rowwise", targets="experts"))
  with pytest.raises(ValueError) as error:
    compute.validate(cfg)
  assert "tensorwise only" in str(error.value) and "\n" not in str(error.value)


def h100_program(tmp_path, kernel: str) -> str:
  """The optimized HLO of the debug MoE (2 layers, expert=4 x fsdp=2, bf16, tensorwise fp8
  experts) for 8 H100s, compiled without a GPU."""
  cfg = moe_configs.debug_moe()
  cfg.mesh, cfg.batch_size, cfg.seq_len = MeshConfig(data=1, expert=4, fsdp=2), 16, 64
  moe = dataclasses.replace(cfg.model.moe, grouped_matmul=kernel)
  cfg.model = dataclasses.replace(cfg.model, num_layers=2, dtype="bfloat16", moe=moe)
  cfg.compute.fp8 = Fp8Config(enabled=True, recipe="tensorwise", targets="experts")
  path = tmp_path / f"{kernel}.hlo"
  compile_for_gpus(cfg, compiled.parse_gpu_target("h100x8"), str(path))
  return path.read_text()


def rows_by_width(text: str, rows: int, width: int) -> list[str]:
  """Instructions whose result holds a [rows, width] array (any leading dims of 1)."""
  return [i.name for instrs in hlo.computations(text).values() for i in instrs
          for _, shape in hlo.arrays(i.type)
          if [s for s in shape if s != 1][-2:] == [rows, width]]


def test_h100_program_moves_no_expert_width_rows(tmp_path):
  """The SwiGLU's F-wide values live in the slots only: grouped_matmul=capacity's program moves
  gate's and up's products back to the exchange buffer's rows [512, F] (and h into the slots
  again), the slots program has no [512, F] array at all; its expert GEMMs are batched f8 GEMMs
  over [2 local experts, slots], as capacity's."""
  moe = moe_configs.debug_moe().model.moe
  rows, width = 4 * 2 * 128 * 2 // 4, moe.expert_mlp_dim  # 4 peers x 2x a pair's share
  programs = {k: h100_program(tmp_path, k) for k in ("capacity", "slots")}
  assert rows_by_width(programs["capacity"], rows, width)
  assert not rows_by_width(programs["slots"], rows, width)
  expert_dots = [d for d in h100_dots(programs["slots"]) if "gc" in d[0]]
  assert expert_dots and all(d[1] == ("f8e4m3fn", "f8e4m3fn") and d[2] for d in expert_dots)
