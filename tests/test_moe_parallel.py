"""Expert parallelism: MoE layouts train exactly like one device; the compiled all-to-alls.

Tolerances are test_parallel.py's, unchanged. The MoE's routing biases get no gradient by
design: where the one-device gradient is exactly zero, the layout's must be exactly zero too.
"""

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sharding
from sharding.mesh import LayoutError
from configs import moe as moe_configs
from models import ComputeConfig
from models.config import MoEConfig

MOE_DEFAULTS = MoEConfig()
from models.moe import MoE
from sharding import MeshConfig
from sharding.xla import compiled, hlo
from tests import parallel_harness as harness
from tests.test_parallel import assert_same_training
from trainer.aot import compile_for_gpus

# 8 experts of 32 (the harness model's MLP is 64) top-2, one shared expert, the first layer
# dense; the sigmoid router with the aux-loss-free bias, so its update is compared as well.
MOE = MoEConfig(num_experts=8, experts_per_token=2, expert_mlp_dim=32, num_shared_experts=1,
                first_dense_layers=1, router="sigmoid", bias_update_rate=0.01,
                dispatch="dropless")
# Dropping with capacity factor 1: tokens really drop (the same ones in every layout).
DROPPING = dataclasses.replace(MOE, dispatch="dropping", capacity_factor=1.0)


def M(**sizes) -> MeshConfig:
  return MeshConfig(**{"data": 1, **sizes})


_REFERENCES = {}


def reference(moe: MoEConfig):
  """One-device training of `moe` (each dispatch's run once per session)."""
  if moe.dispatch not in _REFERENCES:
    _REFERENCES[moe.dispatch] = harness.run(M(), devices=jax.devices()[:1], moe=moe)
  return _REFERENCES[moe.dispatch]


HIDDEN_SPLIT = "experts=expert"  # each expert's hidden dim over tensor (the default without SP)
# Gradient accumulation vmaps the loss over microbatch replicas (over `data` with data > 1):
# the dropless executor's shard_map, sort and ragged_dot must survive that vmap too.
LAYOUTS = {
    "expert=8,dropless": (M(expert=8), MOE, {}),
    "expert=4,fsdp=2,dropless": (M(expert=4, fsdp=2), MOE, {}),
    "expert=4,fsdp=2,dropping,ga=4,remat=selective": (M(expert=4, fsdp=2), DROPPING,
                                                      dict(microbatches=4, remat="selective")),
    "expert=2,tensor=2,data=2,dropless,ga=2,remat=full": (M(expert=2, tensor=2, data=2), MOE,
                                                          dict(microbatches=2, remat="full")),
    "expert=2,tensor=2,data=2,dropping": (M(expert=2, tensor=2, data=2), DROPPING, {}),
    # Rounds of a quarter of a pair's balanced share (4 of 16 rows): the heaviest pair has at
    # least the mean 16 rows, so at least 4 rounds run in every MoE layer.
    "expert=8,dropless,exchange_capacity=0.25": (
        M(expert=8), dataclasses.replace(MOE, exchange_capacity=0.25), {}),
    # The rounds inside the replicas' vmap (gradient accumulation over data): 0.25 x 32 rows.
    "expert=4,data=2,dropless,ga=2,exchange_capacity=0.25": (
        M(expert=4, data=2), dataclasses.replace(MOE, exchange_capacity=0.25),
        dict(microbatches=2)),
    # The first round outside the loop, differentiated as written (model.moe.keep_first_round),
    # the loop running the rounds after it; under the replicas' vmap, and under remat=full,
    # whose checkpoint runs the first round's forward again in the backward.
    "expert=4,data=2,dropless,ga=2,exchange_capacity=0.25,keep_first_round": (
        M(expert=4, data=2),
        dataclasses.replace(MOE, exchange_capacity=0.25, keep_first_round=True),
        dict(microbatches=2)),
    "expert=8,dropless,exchange_capacity=0.25,keep_first_round,remat=full": (
        M(expert=8), dataclasses.replace(MOE, exchange_capacity=0.25, keep_first_round=True),
        dict(remat="full")),
    # Each device's tokens exchanged in two chunks apart (model.moe.exchange_chunks), each with
    # its own rounds (2 rows a pair: a quarter of a chunk's balanced 8) and kept first round,
    # under the replicas' vmap.
    "expert=4,data=2,dropless,ga=2,exchange_chunks=2,keep_first_round": (
        M(expert=4, data=2), dataclasses.replace(MOE, exchange_capacity=0.25,
                                                 keep_first_round=True, exchange_chunks=2),
        dict(microbatches=2)),
    # The experts as batched GEMMs over equal slots per expert (model.moe.grouped_matmul=
    # capacity): a quarter of a pair's share in the exchange's rounds, so an expert's slots
    # hold a quarter of its rows and later rounds run; under the replicas' vmap, chunks apart.
    "expert=4,data=2,dropless,ga=2,exchange_chunks=2,keep_first_round,capacity": (
        M(expert=4, data=2), dataclasses.replace(MOE, exchange_capacity=0.25,
                                                 keep_first_round=True, exchange_chunks=2,
                                                 grouped_matmul="capacity"),
        dict(microbatches=2)),
    # The whole SwiGLU on those slots (model.moe.grouped_matmul=slots), later rounds included.
    "expert=4,data=2,dropless,ga=2,exchange_chunks=2,keep_first_round,slots": (
        M(expert=4, data=2), dataclasses.replace(MOE, exchange_capacity=0.25,
                                                 keep_first_round=True, exchange_chunks=2,
                                                 grouped_matmul="slots"),
        dict(microbatches=2)),
    # Every expert on every device, the tokens over fsdp, under the replicas' vmap (its rule
    # typed the weights as varying over fsdp, where each GEMM had recorded a cast of its own:
    # "pvary ... must not be present", the planner's fsdp=16 layout for Qwen3-30B-A3B).
    "fsdp=8,dropless,ga=2": (M(fsdp=8), MOE, dict(microbatches=2)),
    # The same over data x fsdp as batched GEMMs, slots a quarter of the balanced share (later
    # rounds run): batched by the replicas' vmap over `data`, the later rounds' loop took a
    # batched predicate that shard_map's check refused ("Primitive lt requires varying manual
    # axes to match", DeepSeek-V3's data=2 x fsdp=128 candidate); each replica runs its own.
    "data=2,fsdp=4,dropless,ga=2,capacity": (
        M(data=2, fsdp=4), dataclasses.replace(MOE, exchange_capacity=0.25,
                                               grouped_matmul="capacity"),
        dict(microbatches=2)),
    "data=2,fsdp=4,dropless,ga=2,slots": (
        M(data=2, fsdp=4), dataclasses.replace(MOE, exchange_capacity=0.25,
                                               grouped_matmul="slots"),
        dict(microbatches=2)),
    # ZeRO-1 over data x expert for the shared weights, over data for the experts' own.
    "expert=4,data=2,zero=1,dropless": (M(expert=4, data=2, zero_stage=1), MOE, {}),
    # Under sequence parallelism the experts split over expert x tensor, each device routing
    # its own part of the sequence (Megatron's expert tensor parallelism of 1); the rule
    # experts=expert splits each expert's hidden dim over tensor instead.
    "expert=2,tensor=2,data=2,sp,dropless": (
        M(expert=2, tensor=2, data=2, sequence_parallel=True), MOE, {}),
    "expert=2,tensor=2,data=2,sp,dropless,experts=expert": (
        M(expert=2, tensor=2, data=2, sequence_parallel=True), MOE,
        dict(sharding_rules=HIDDEN_SPLIT)),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_expert_parallel_layout_equals_one_device(name):
  mesh_cfg, moe, options = LAYOUTS[name]
  assert_same_training(harness.run(mesh_cfg, moe=moe, **options), reference(moe))


def test_references_are_not_trivial():
  """Training moves the loss and the routing biases; dropping drops (so layouts agree on which
  tokens drop, not merely on none)."""
  for moe in (MOE, DROPPING):
    ref = reference(moe)
    assert ref.losses[-1] < ref.losses[0]
    for start, end in zip(ref.initial_params, ref.params):
      assert np.abs(end - start).max() > 1e-4
  cfg = harness.config(M(), moe=DROPPING).model
  assert cfg.moe.capacity_factor * cfg.moe.experts_per_token < cfg.moe.num_experts


def test_experts_over_expert_and_tensor_exchange_each_devices_own_tokens():
  """Under sequence parallelism the experts split over tensor too by default, and the sequence
  stays split over tensor into the exchange: every device sends its own tokens over 4 devices,
  where with each expert's hidden dim split over tensor (HIDDEN_SPLIT) both devices of a tensor
  pair gather the pair's tokens and send all of them over 2."""
  mesh = M(expert=2, tensor=2, data=2, sequence_parallel=True)

  def exchanges(rules):
    cols = hlo.collectives(harness.compile_step(mesh, moe=MOE, sharding_rules=rules).as_text())
    return {(c.group_size, c.shape) for c in cols if c.kind == "all-to-all" and c.dtype == "f32"}
  (hidden_group, hidden_rows), = exchanges(HIDDEN_SPLIT)
  (folded_group, folded_rows), = exchanges("")
  assert (hidden_group, folded_group) == (2, 4)
  # The buffer for all 4 devices holds a quarter of the rows the pair's 2 did: half the
  # tokens, each worst case spread over twice the devices.
  assert folded_rows[1] * 4 == hidden_rows[1]


def test_experts_over_an_axis_that_leaves_the_tokens_whole_are_refused():
  """Without sequence parallelism the tokens are whole on every tensor device: experts split
  over tensor too would have each of them route the same tokens."""
  with pytest.raises(LayoutError, match="split over tensor, which does not split the tokens"):
    harness.compile_step(M(expert=2, tensor=2, data=2), moe=MOE,
                         sharding_rules="experts=expert+tensor")


@functools.lru_cache(maxsize=None)
def ep_program(dispatch: str, exchange_capacity: float = MOE.exchange_capacity,
               keep_first_round: bool = False):
  moe = dataclasses.replace(MOE, dispatch=dispatch, capacity_factor=1.0, first_dense_layers=0,
                            exchange_capacity=exchange_capacity,
                            keep_first_round=keep_first_round)
  return hlo.collectives(harness.compile_step(M(expert=8), moe=moe).as_text())


def test_dropping_exchanges_tokens_by_all_to_all_with_the_predicted_bytes():
  """expert=8: each MoE layer moves its dispatched tokens to their experts and back, forward and
  backward: 4 all-to-alls of T k c D values per device (T = tokens per device, k = 2, capacity
  factor c = 1, D = 32, float32), i.e. T k c D (N-1)/N x 4 bytes on the wire per direction.
  Nothing is gathered, and the only all-reduces are the gradients of the weights that are
  data-parallel over `expert` (all but the experts, which each device owns) and metrics."""
  cols = ep_program("dropping")
  cfg = harness.config(M(), moe=dataclasses.replace(MOE, first_dense_layers=0)).model
  tokens = harness.BATCH * harness.SEQ // 8
  per_direction = tokens * MOE.experts_per_token * 1.0 * cfg.embed_dim * 4
  a2a = [c for c in cols if c.kind == "all-to-all"]
  assert len(a2a) == 4 and all(c.count == cfg.moe_layers() and c.group_size == 8 for c in a2a)
  assert all(c.bytes == per_direction for c in a2a)
  assert all(c.wire_bytes == per_direction * 7 / 8 for c in a2a)
  assert not [c for c in cols if c.kind == "all-gather"]
  experts = cfg.moe_layers() * 3 * MOE.num_experts * cfg.embed_dim * MOE.expert_mlp_dim
  replicated_bytes = (cfg.num_params() - experts) * 4
  reduced = sum(c.bytes * c.count for c in cols if c.kind == "all-reduce")
  assert replicated_bytes <= reduced <= replicated_bytes + 1024  # + routing counts, losses


def test_dropless_padded_exchange_of_worst_case_buffers():
  """exchange_capacity=0, the worst case in one round: each device sends N buffers of
  T min(k, E/N) rows, 4x the dropping payload here (N = 8, k = 2, E/N = 1)."""
  cols = [c for c in ep_program("dropless", 0.0) if c.kind == "all-to-all"]
  cfg = harness.config(M(), moe=dataclasses.replace(MOE, first_dense_layers=0)).model
  tokens = harness.BATCH * harness.SEQ // 8
  padded = 8 * tokens * min(2, 1) * cfg.embed_dim * 4
  assert sorted(c.bytes for c in cols if c.dtype == "f32") == [padded] * 4
  assert all(c.count == cfg.moe_layers() and not c.unknown_trip_count for c in cols)


def test_dropless_exchange_runs_rounds_of_capacity_sized_buffers():
  """The default exchange_capacity (2): buffers of 2x a pair's balanced share (T k / N rows)
  per round, half the worst case here, in while loops whose trip count is the data's (the
  heaviest pair's rounds): there and back in the forward; in the backward each round's
  exchange there again (its forward recomputed; the way back is not needed) and both
  transposes. No worst-case buffer is left."""
  assert MOE.exchange_capacity == MOE_DEFAULTS.exchange_capacity == 2.0
  cfg = harness.config(M(), moe=dataclasses.replace(MOE, first_dense_layers=0)).model
  tokens = harness.BATCH * harness.SEQ // 8
  capacity = math.ceil(2.0 * tokens * MOE.experts_per_token / 8)
  worst = tokens * min(MOE.experts_per_token, MOE.num_experts // 8)
  assert capacity < worst
  rows = [c for c in ep_program("dropless") if c.kind == "all-to-all" and c.dtype == "f32"]
  assert sorted(c.bytes for c in rows) == [8 * capacity * cfg.embed_dim * 4] * 5
  assert all(c.unknown_trip_count for c in rows)
  worst_bytes = 8 * worst * cfg.embed_dim * 4
  assert not [c for c in ep_program("dropless") if c.bytes >= worst_bytes]


def test_a_kept_first_round_runs_four_exchanges_and_the_later_rounds_none_predicted():
  """model.moe.keep_first_round: the first round differentiated as written, there and back in
  the forward and both transposes in the backward, once per MoE layer (the fifth exchange, the
  way there run again to recompute the round, is gone); the rounds after it still in while loops
  of the same 5 exchanges (a pair over its capacity runs them), which the analysis counts 0
  times: the predicted case, every pair within its capacity (hlo.unrun)."""
  cfg = harness.config(M(), moe=dataclasses.replace(MOE, first_dense_layers=0)).model
  tokens = harness.BATCH * harness.SEQ // 8
  buffer = 8 * math.ceil(2.0 * tokens * MOE.experts_per_token / 8) * cfg.embed_dim * 4
  rows = {keep: [c for c in ep_program("dropless", keep_first_round=keep)
                 if c.kind == "all-to-all" and c.dtype == "f32"] for keep in (False, True)}
  assert sorted(c.bytes for c in rows[True]) == [buffer] * 9
  assert sorted(c.count for c in rows[True]) == [0] * 5 + [cfg.moe_layers()] * 4
  assert not any(c.unknown_trip_count for c in rows[True])
  # Without it: the loop of every round, its 5 exchanges counted once per MoE layer (one round).
  assert len(rows[False]) == 5 and all(c.unknown_trip_count for c in rows[False])
  moved = {keep: sum(c.total_wire_bytes for c in rows[keep]) for keep in rows}
  assert moved[True] == 4 / 5 * moved[False] > 0


def test_ragged_all_to_all_compiles_for_8_h100s(tmp_path):
  """XLA:CPU cannot run ragged_all_to_all; the deviceless 8xH100 compile proves the GPU path:
  exchange "auto" picks it there, asynchronous, 4 executions per MoE layer (there and back, in
  the forward and the backward), and nothing is gathered."""
  cfg = moe_configs.debug_moe()
  cfg.mesh = M(expert=8)
  cfg.batch_size, cfg.seq_len = 16, 64
  cfg.model.num_layers = 2
  cfg.model.moe = dataclasses.replace(cfg.model.moe, exchange_capacity=0.0)  # one round
  path = tmp_path / "step.hlo"
  rep = compile_for_gpus(cfg, compiled.parse_gpu_target("h100x8"), hlo_path=str(path))
  assert rep.platform != "cpu" and rep.num_devices == 8
  text = path.read_text()
  # sharding.xla.hlo's report does not list ragged-all-to-all yet: count its executions with the
  # report's own loop-trip accounting (XLA peels some layer-loop iterations out of the loop).
  comps = hlo.computations(text)
  runs, _, _ = hlo.executions(comps)
  executions = sum(runs[c] for c, instrs in comps.items() for i in instrs
                   if i.op == "ragged-all-to-all-start")
  assert executions == 4 * cfg.model.moe_layers()
  assert not re.search(r"\ball-gather(-start)?\(", text)
  # Nor is an exchange buffer all-reduced in the backward (it was, over all 8 devices, while the
  # buffers were constants cast to varying: the cast's transpose is a psum).
  tokens, moe = cfg.batch_size * cfg.seq_len // 8, cfg.model.moe
  buffers = {8 * tokens * min(moe.experts_per_token, moe.num_experts // 8) * cfg.model.embed_dim,
             tokens * moe.experts_per_token * cfg.model.embed_dim}
  reduced = [math.prod(c.shape) for c in hlo.collectives(text) if c.kind == "all-reduce"]
  assert reduced and not buffers & set(reduced), (buffers, reduced)


def test_ragged_rounds_compile_for_8_h100s(tmp_path):
  """The default exchange_capacity on the GPU path: each ragged_all_to_all receives into
  N x capacity rows (2x a pair's balanced share), half the worst case's N x T min(k, E/N)
  here, inside while loops of data-dependent trip count: there and back in the forward, there
  again and both transposes in the backward."""
  cfg = moe_configs.debug_moe()
  cfg.mesh = M(expert=8)
  cfg.batch_size, cfg.seq_len = 16, 64
  cfg.model.num_layers = 2
  path = tmp_path / "step.hlo"
  compile_for_gpus(cfg, compiled.parse_gpu_target("h100x8"), hlo_path=str(path))
  comps = hlo.computations(path.read_text())
  _, unknown, _ = hlo.executions(comps)
  moe, d = cfg.model.moe, cfg.model.embed_dim
  tokens = cfg.batch_size * cfg.seq_len // 8
  capacity = math.ceil(moe.exchange_capacity * tokens * moe.experts_per_token / 8)
  worst = tokens * min(moe.experts_per_token, moe.num_experts // 8)
  assert capacity < worst
  starts = [(c, i) for c, instrs in comps.items() for i in instrs
            if i.op == "ragged-all-to-all-start"]
  assert len(starts) == 5 and all(unknown[c] for c, _ in starts)
  received = {re.search(r"\), f32\[(\d+),(\d+)\]", i.type).groups() for _, i in starts}
  assert received == {(str(8 * capacity), str(d)), (str(tokens * moe.experts_per_token), str(d))}
  # The exchange's row permutations (sorted rows back to token order; received rows regrouped by
  # expert and back) are gathers both ways: no scatter writes rows of those buffers (autodiff
  # made scatter-adds of the gathers, and JAX's scatter JVP id scatters of u32 rows).
  # Each receive buffer is its ragged all-to-all's own: no copy of one (a mask of the padding
  # rows' outputs shared XLA's zeros with it, which the in-place collective then had copied).
  copies = [i.type for instrs in comps.values() for i in instrs
            if i.op == "copy" and f"[{8 * capacity},{d}]" in i.type]
  assert not copies, copies
  # The forward's rounds (the loop with 2 exchanges) return their rows into the loop's carried
  # sum: no buffer of zeros for the return and no sum of the round's rows into the carry (before:
  # a broadcast and an add of [T k, D] each round, about 1.1 s a step each on Qwen3-30B-A3B EP16).
  returned = f"f32[{tokens * moe.experts_per_token},{d}]"
  forward = [instrs for instrs in comps.values()
             if sum(i.op == "ragged-all-to-all-start" for i in instrs) == 2]
  assert len(forward) == 1
  made = [(i.name, i.op) for i in forward[0] if i.type.startswith(returned + "{")
          and i.op not in ("get-tuple-element", "ragged-all-to-all-done")]
  assert not made, made
  rows = {(8 * capacity, d), (tokens * moe.experts_per_token, d)}
  scatters = [i.type for instrs in comps.values() for i in instrs if i.op == "scatter"]
  assert scatters and not [t for t in scatters
                           if {tuple(map(int, m)) for m in re.findall(r"\[(\d+),(\d+)\]", t)}
                           & rows], scatters


def test_ragged_all_to_all_compiles_under_gradient_accumulation():
  """Accumulation vmaps the loss over data-parallel replicas: ragged_all_to_all's batching rule
  needs every offset and size batched (its output offsets once came from axis_index alone, and
  the deviceless compile of this layout failed on an assert inside jax)."""
  cfg = moe_configs.debug_moe()
  cfg.mesh = M(data=2, expert=4)
  cfg.batch_size, cfg.seq_len, cfg.microbatches = 16, 64, 2
  cfg.model.num_layers = 1
  rep = compile_for_gpus(cfg, compiled.parse_gpu_target("h100x8"))
  assert rep.platform != "cpu" and rep.num_devices == 8


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name):
  """jax.lax.ragged_all_to_all's documented semantics from all_gathers (runs on CPU)."""
  del recv_sizes  # implied by the senders' sizes
  me, n = jax.lax.axis_index(axis_name), jax.lax.axis_size(axis_name)
  operands, starts, sizes, offsets = (jax.lax.all_gather(a, axis_name) for a in (
      operand, input_offsets, send_sizes, output_offsets))
  rows = jnp.arange(output.shape[0])
  for source in range(n):
    start, size, offset = starts[source, me], sizes[source, me], offsets[source, me]
    inside = (rows >= offset) & (rows < offset + size)
    taken = operands[source][jnp.clip(rows - offset + start, 0, operand.shape[0] - 1)]
    output = jnp.where(inside[:, None], taken, output)
  return output


def test_ragged_exchange_offsets_against_emulated_collective(monkeypatch):
  """The ragged path's offsets and sizes, run on CPU through an emulation of the collective's
  documented semantics: output and gradients equal the dense reference (expert=8, and 2 experts
  per device with expert=4 x tensor=2)."""
  monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
  cfg = dataclasses.replace(harness.MODEL, moe=dataclasses.replace(MOE, exchange="ragged"))
  compute = ComputeConfig()
  graphdef, state = nnx.split(MoE(cfg, compute, sharding.local_layout(cfg), rngs=nnx.Rngs(0)))
  x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 16, cfg.embed_dim)), jnp.float32)

  def loss(graphdef, state, x, dispatch):
    return jnp.sum(jnp.sin(nnx.merge(graphdef, state)(x, dispatch)[0]))

  want = jax.value_and_grad(functools.partial(loss, graphdef), argnums=(0, 1))(state, x,
                                                                               "dense")
  # One worst-case round, and rounds of a quarter of a pair's balanced share (several each).
  for sizes, capacity in ((dict(expert=8), 0.0), (dict(expert=4, tensor=2), 0.0),
                          (dict(expert=8), 0.25), (dict(expert=4, tensor=2), 0.25)):
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, exchange_capacity=capacity))
    # The layer built for the mesh: its dropless exchange takes the mesh from its layout.
    layout = sharding.resolve(M(**sizes), jax.devices(), cfg, compute, batch_size=8, seq_len=16)
    assert layout.exchange == "ragged"
    sharded, _ = nnx.split(MoE(cfg, compute, layout, rngs=nnx.Rngs(0)))
    with layout.scope():
      got = jax.jit(jax.value_and_grad(functools.partial(loss, sharded), argnums=(0, 1)),
                    static_argnums=2)(state, x, "dropless")
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
      assert np.linalg.norm(a - b) <= 1e-5 * max(np.linalg.norm(b), 1e-30)
