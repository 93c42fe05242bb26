"""The dropless MoE's grouped matmul as batched GEMMs over equal slots per expert
(kernels/capacity_matmul.py, `model.moe.grouped_matmul=capacity`): equal to jax.lax.ragged_dot
forward and backward whatever the groups (later rounds take the rows past a group's slots; with
tests/test_grouped_matmul.py's cases, and in the MoE under expert parallelism there), and in the
H100 program batched f8 GEMMs over the buffer's rows, later rounds in loops counted 0 times."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import sharding
from configs import moe as moe_configs
from kernels.capacity_matmul import capacity_grouped, capacity_matmul, slots_per_group
from models import ComputeConfig
from models.compute import REMAT_POLICIES
from models.fp8.config import Fp8Config
from models.moe import Experts
from sharding import MeshConfig
from sharding.expert import ExpertAxes
from sharding.xla import compiled, hlo
from tests import parallel_harness as harness
from tests.test_fp8_h100_program import h100_dots
from tests.test_grouped_matmul import CASES, rel_error
from tests.test_moe_parallel import MOE
from trainer.aot import compile_for_gpus


def test_the_shared_cases_run_later_rounds():
  """tests/test_grouped_matmul.py runs these cases against ragged_dot, forward and gradients:
  in each with several groups one holds more rows than its slots, so later rounds run."""
  for rows, _, _, sizes in CASES.values():
    assert len(sizes) == 1 or max(sizes) > slots_per_group(rows, len(sizes))


def test_equals_ragged_dot_under_vmap():
  """Gradient accumulation vmaps the experts over microbatch replicas: each replica its own
  groups, one needing later rounds and one not."""
  rows, k, n, _ = CASES["ragged"]
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(2, rows, k)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(5, k, n)), jnp.float32)
  sizes = jnp.asarray([[10, 0, 33, 40, 7], [20, 20, 20, 20, 20]], jnp.int32)
  batched = lambda x, w: jax.vmap(capacity_grouped, (0, None, 0))(x, w, sizes)
  each = lambda x, w: jnp.stack([jax.lax.ragged_dot(x[i], w, sizes[i]) for i in range(2)])
  loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)))
  got = jax.jit(jax.value_and_grad(loss(batched), (0, 1)))(x, w)
  want = jax.value_and_grad(loss(each), (0, 1))(x, w)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert rel_error(a, b) < 1e-6


def test_remat_none_keeps_the_products_a_checkpointed_backward_would_recompute():
  """A layer checkpointed with remat="none" (models/compute.py REMAT_POLICIES) keeps kernel
  outputs: its backward runs the batched GEMMs for dx and dW only, as without a checkpoint, not
  the forward's again (a custom gradient's output is no dot to the policy: it is named)."""
  rows, k, n, sizes = CASES["ragged"]
  x = jnp.ones((rows, k), jnp.bfloat16)
  w = jnp.ones((len(sizes), k, n), jnp.bfloat16)
  loss = lambda x, w: jnp.sum(jnp.sin(capacity_grouped(x, w, jnp.asarray(sizes))))
  gemms = {}
  for how, f in (("plain", loss), ("none", jax.checkpoint(loss, policy=REMAT_POLICIES["none"])),
                 ("full", jax.checkpoint(loss, policy=REMAT_POLICIES["full"]))):
    gemms[how] = str(jax.make_jaxpr(jax.grad(f, (0, 1)))(x, w)).count("dot_general")
  # The count sees a recomputed forward: full remat's (nothing kept) has more.
  assert gemms["none"] == gemms["plain"] < gemms["full"], gemms


def test_an_expert_s_slots_carry_the_exchange_s_headroom():
  """Behind an exchange the buffer already holds exchange_capacity x the balanced share: the
  slots split it evenly. With every expert on the device the rows are exactly the routed ones,
  so the slots take the same headroom themselves (0: every row, the worst case)."""
  for headroom, alone in ((2.0, 50), (1.0, 25), (0.0, 100)):
    cfg = dataclasses.replace(harness.MODEL, moe=dataclasses.replace(
        MOE, grouped_matmul="capacity", exchange_capacity=headroom))
    experts = Experts(cfg, ComputeConfig(), sharding.local_layout(cfg, ComputeConfig()),
                      rngs=nnx.Rngs(0))
    assert experts.slots(100, 4, ExpertAxes()) == alone
    assert experts.slots(100, 4, ExpertAxes(experts=("expert",))) == 25


@pytest.mark.slow
def test_h100_program_runs_batched_f8_gemms_over_the_buffer(tmp_path):
  """Deviceless compile for 8 H100s (expert=4 x fsdp=2, bf16, tensorwise fp8 experts): every
  expert GEMM is a batched GEMM fusion on f8e4m3fn operands over [2 local experts, slots] (no
  masked copy of the rows per expert, no Pallas kernel), and the rounds after the first sit in
  loops the analysis counts 0 times: each GEMM is priced once, over the exchange buffer's rows."""
  cfg = moe_configs.debug_moe()
  cfg.mesh, cfg.batch_size, cfg.seq_len = MeshConfig(data=1, expert=4, fsdp=2), 16, 64
  moe = dataclasses.replace(cfg.model.moe, grouped_matmul="capacity")
  cfg.model = dataclasses.replace(cfg.model, num_layers=2, dtype="bfloat16", moe=moe)
  cfg.compute.fp8 = Fp8Config(enabled=True, recipe="tensorwise", targets="experts")
  path = tmp_path / "step.hlo"
  compile_for_gpus(cfg, compiled.parse_gpu_target("h100x8"), str(path))
  text = path.read_text()
  assert "/grouped_matmul" not in text and "ragged_dot" not in text
  expert_dots = [d for d in h100_dots(text) if "gck," in d[0]]
  assert expert_dots and all(d[1] == ("f8e4m3fn", "f8e4m3fn") and d[2] for d in expert_dots)
  # 2 experts a device, each with half the receive buffer: 4 peers x 2x a pair's balanced share
  # of a device's 128 tokens x 2 choices.
  local, d, f = moe.num_experts // 4, cfg.model.embed_dim, moe.expert_mlp_dim
  slots = slots_per_group(4 * 2 * 128 * 2 // 4, local)
  comps, names = hlo.computations(text), hlo.op_names(text)
  shapes = {tuple(s) for instrs in comps.values() for i in instrs
            if i.op == "dot" and "gck," in names.get(i.name, "") for _, s in hlo.arrays(i.type)}
  # (XLA joins gate's and up's GEMMs and splits some contractions: the shapes vary, the
  # experts stay the batch dim and no GEMM reads the whole buffer, local x slots rows.)
  assert shapes and all(s[0] == local for s in shapes), shapes
  assert any(slots in s for s in shapes) and not any(local * slots in s for s in shapes), shapes
  rounds = [i for c, instrs in comps.items() for i in instrs
            if i.op == "while" and hlo.unrun(i)]
  # Forward: gate, up, down; backward: dx and dW of each (and the exchange's rounds recompute
  # gate's and up's forward in their vjp).
  assert len(rounds) >= 9 and all(hlo.trip_count(i, comps, "") == 0 for i in rounds)


@pytest.mark.slow
def test_h100_program_reads_the_weights_as_stored():
  """Over a scan of 4 layers' f8 weights [4, G, K, N], the forward GEMM (which contracts K, not
  the minor dim) takes each layer's weights as stored: XLA:GPU left free laid the whole stack
  out again before the loop, a second copy of every expert weight (Qwen3-30B-A3B EP16: 3.4 GiB
  at the peak)."""
  layers, g, c, k, n = 4, 8, 256, 512, 384
  device = compiled.gpu_devices(compiled.parse_gpu_target("h100x8"))[:1]
  whole = NamedSharding(Mesh(device, ("x",)), PartitionSpec())
  sizes = jnp.full((g,), c, jnp.int32)

  def step(x, stack):
    def layer(x, w):
      q = (w * 2.0).astype(jnp.float8_e4m3fn)
      y = capacity_matmul(x.astype(jnp.float8_e4m3fn), q, sizes,
                          preferred_element_type=jnp.bfloat16, scale=jnp.float32(2.0))
      return x + y[:, :1], None
    return jax.lax.scan(layer, x, stack)[0]

  args = (jax.ShapeDtypeStruct((g * c, k), jnp.bfloat16, sharding=whole),
          jax.ShapeDtypeStruct((layers, g, k, n), jnp.bfloat16, sharding=whole))
  text = jax.jit(step).lower(*args).compile().as_text()
  stacks = [i for instrs in hlo.computations(text).values() for i in instrs
            if i.op in ("fusion", "transpose", "copy") and "[4,8,384,512]" in i.type]
  assert not stacks, [i.type for i in stacks]
