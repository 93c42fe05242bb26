"""Tests for sharding.xla.hlo: hand-written HLO in every syntax, and programs compiled on 8 CPUs."""

import os

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from sharding.xla import branches, hlo

F32_128x64 = 128 * 64 * 4

# ---------------------------------------------------------------- hand-written HLO

_GROUPS = """\
HloModule groups, is_scheduled=true, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

ENTRY %main (p: f32[16,8]) -> f32[16,8] {
  %p = f32[16,8]{1,0} parameter(0)
  %explicit = f32[16,8]{1,0} all-reduce(%p), channel_id=1, replica_groups={{0,2},{4,6},{1,3},{5,7}}, use_global_device_ids=true, to_apply=%add
  %iota = f32[64,8]{1,0} all-gather(%explicit), channel_id=2, replica_groups=[2,4]<=[2,2,2]T(0,2,1), dimensions={0}, use_global_device_ids=true
  %mesh = f32[16,8]{1,0} all-reduce(%p), channel_id=3, replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2] {'axis_1','axis_2'}, use_global_device_ids=true, to_apply=%add
  %mesh_ids = bf16[16,8]{1,0} all-reduce(%p), channel_id=4, replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}, use_global_device_ids=true, to_apply=%add
  %sub_axis = f32[16,8]{1,0} all-reduce(%p), channel_id=5, replica_groups=mesh['a'=8] {'a':(1)2}, use_global_device_ids=true, to_apply=%add
  ROOT %everyone = f32[16,8]{1,0} all-reduce(%p), channel_id=6, replica_groups={}, use_global_device_ids=true, to_apply=%add
}
"""


def test_replica_group_syntaxes():
  by_name = {c.name: c for c in hlo.collectives(_GROUPS)}
  assert {n: c.group_size for n, c in by_name.items()} == {
      "explicit": 2, "iota": 4, "mesh": 4, "mesh_ids": 4, "sub_axis": 2, "everyone": 8}
  assert by_name["mesh_ids"].dtype == "bf16" and by_name["mesh_ids"].bytes == 16 * 8 * 2
  assert by_name["iota"].kind == "all-gather" and by_name["iota"].bytes == 64 * 8 * 4
  assert by_name["iota"].wire_bytes == 3 / 4 * 64 * 8 * 4
  assert all(c.count == 1 and not c.is_async and c.computation == "main"
             for c in by_name.values())


def test_empty_groups_need_a_device_count():
  text = _GROUPS.replace(", num_partitions=8", "")
  with pytest.raises(ValueError, match="num_devices"):
    hlo.collectives(text)
  assert hlo.collectives(text, num_devices=16)[-1].group_size == 16
  # The header wins over the argument.
  assert hlo.collectives(_GROUPS, num_devices=16)[-1].group_size == 8


# Scheduled XLA:GPU style: async pairs, tuple results, a combined all-reduce.
_GPU = """\
HloModule jit_step, is_scheduled=true, entry_computation_layout={(bf16[4,8]{1,0}, f32[32]{0})->(bf16[16,8]{1,0}, bf16[1,8]{1,0})}, num_partitions=4

%add.1 (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %a = f32[] add(f32[] %x, f32[] %y)
}

ENTRY %main.9_spmd (p0: bf16[4,8], p1: f32[32]) -> (bf16[16,8], bf16[1,8]) {
  %p0 = bf16[4,8]{1,0} parameter(0)
  %p1 = f32[32]{0} parameter(1)
  %all-gather-start = (bf16[4,8]{1,0}, bf16[16,8]{1,0}) all-gather-start(bf16[4,8]{1,0} %p0), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true, backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],"collective_backend_config":{"is_sync":false,"no_parallel_custom_call":false},"force_earliest_schedule":false}
  %all-gather-done = bf16[16,8]{1,0} all-gather-done((bf16[4,8]{1,0}, bf16[16,8]{1,0}) %all-gather-start)
  %reduce-scatter-start = ((bf16[4,8]{1,0}), bf16[1,8]{1,0}) reduce-scatter-start(bf16[4,8]{1,0} %p0), channel_id=2, replica_groups={{0,1,2,3}}, use_global_device_ids=true, dimensions={0}, to_apply=%add.1
  %reduce-scatter-done = bf16[1,8]{1,0} reduce-scatter-done(((bf16[4,8]{1,0}), bf16[1,8]{1,0}) %reduce-scatter-start)
  %all-reduce-start = (f32[32]{0}, f32[4,8]{1,0}) all-reduce-start(f32[32]{0} %p1, f32[4,8]{1,0} %p0), channel_id=3, replica_groups={{0,1},{2,3}}, use_global_device_ids=true, to_apply=%add.1
  %all-reduce-done = (f32[32]{0}, f32[4,8]{1,0}) all-reduce-done((f32[32]{0}, f32[4,8]{1,0}) %all-reduce-start)
  %collective-permute-start = (f32[32]{0}, f32[32]{0}, u32[], u32[]) collective-permute-start(f32[32]{0} %p1), channel_id=4, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %collective-permute-done = f32[32]{0} collective-permute-done((f32[32]{0}, f32[32]{0}, u32[], u32[]) %collective-permute-start)
  %zero = f32[] constant(0)
  %combined = (f32[32]{0}, bf16[4,8]{1,0}, /*index=2*/f32[]) all-reduce(%p1, %p0, %zero), channel_id=5, replica_groups={{0,1,2,3}}, use_global_device_ids=true, to_apply=%add.1
  ROOT %tuple = (bf16[16,8]{1,0}, bf16[1,8]{1,0}) tuple(%all-gather-done, %reduce-scatter-done)
}
"""


def test_async_pairs_and_tuple_results():
  cols = hlo.collectives(_GPU)
  assert [c.name for c in cols] == ["all-gather-start", "reduce-scatter-start",
                                    "all-reduce-start", "collective-permute-start", "combined"]
  ag, rs, ar, cp, combined = cols
  assert [c.is_async for c in cols] == [True, True, True, True, False]
  assert (ag.kind, ag.dtype, ag.shape, ag.bytes, ag.group_size) == (
      "all-gather", "bf16", (16, 8), 16 * 8 * 2, 4)
  assert ag.wire_bytes == 3 / 4 * 16 * 8 * 2
  # reduce-scatter: S is the operand, N × the result.
  assert (rs.kind, rs.shape, rs.bytes, rs.group_size) == ("reduce-scatter", (1, 8), 4 * 8 * 2, 4)
  assert rs.wire_bytes == 3 / 4 * 4 * 8 * 2
  assert (ar.kind, ar.shape, ar.bytes, ar.group_size) == ("all-reduce", (32,), (32 + 32) * 4, 2)
  assert ar.wire_bytes == 2 * 1 / 2 * 64 * 4
  assert (cp.kind, cp.shape, cp.bytes, cp.group_size, cp.wire_bytes) == (
      "collective-permute", (32,), 32 * 4, 4, 32 * 4)
  assert (combined.dtype, combined.shape, combined.bytes) == ("f32", (32,), 32 * 4 + 32 * 2 + 4)


def test_unsugared_async_wrapper_counts_once():
  text = """\
HloModule m, num_partitions=2

%wrapped_all_gather (p: f32[2]) -> f32[4] {
  %p = f32[2]{0} parameter(0)
  ROOT %ag = f32[4]{0} all-gather(%p), replica_groups={{0,1}}, dimensions={0}
}

ENTRY %main (x: f32[2]) -> f32[4] {
  %x = f32[2]{0} parameter(0)
  %s = ((f32[2]{0}), f32[4]{0}, s32[]) async-start(%x), calls=%wrapped_all_gather
  ROOT %d = f32[4]{0} async-done(%s), calls=%wrapped_all_gather
}
"""
  (ag,) = hlo.collectives(text)
  assert (ag.kind, ag.is_async, ag.count, ag.bytes, ag.computation) == (
      "all-gather", True, 1, 16, "wrapped_all_gather")


_NESTED = """\
HloModule nested, num_partitions=4

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%inner_body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[], f32[8]{0}) parameter(0)
  %v = f32[8]{0} get-tuple-element(%t), index=1
  %i = s32[] get-tuple-element(%t), index=0
  %ar = f32[8]{0} all-reduce(%v), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %r = (s32[], f32[8]{0}) tuple(%i, %ar)
}

%inner_cond (t: (s32[], f32[8])) -> pred[] {
  %t = (s32[], f32[8]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%branch (v: f32[8]) -> f32[8] {
  %v = f32[8]{0} parameter(0)
  ROOT %cp = f32[8]{0} collective-permute(%v), channel_id=2, source_target_pairs={{0,1},{1,0}}
}

%outer_body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[], f32[8]{0}) parameter(0)
  %w = (s32[], f32[8]{0}) while(%t), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"4"},"known_init_step":{"init":"0","step":"1"}}
  %v = f32[8]{0} get-tuple-element(%w), index=1
  %i = s32[] get-tuple-element(%w), index=0
  %c = f32[8]{0} call(%v), to_apply=%branch
  %ag = f32[32]{0} all-gather(%c), channel_id=3, replica_groups=[1,4]<=[4], dimensions={0}
  ROOT %r = (s32[], f32[8]{0}) tuple(%i, %v)
}

%loose_body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[], f32[8]{0}) parameter(0)
  %v = f32[8]{0} get-tuple-element(%t), index=1
  %i = s32[] get-tuple-element(%t), index=0
  %a2a = f32[8]{0} all-to-all(%v), channel_id=4, replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %r = (s32[], f32[8]{0}) tuple(%i, %a2a)
}

ENTRY %main (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[], f32[8]{0}) parameter(0)
  %outer = (s32[], f32[8]{0}) while(%t), condition=%inner_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %loose = (s32[], f32[8]{0}) while(%outer), condition=%inner_cond, body=%loose_body
}
"""


def test_nested_while_trip_counts():
  by_name = {c.name: c for c in hlo.collectives(_NESTED)}
  assert {n: (c.count, c.unknown_trip_count) for n, c in by_name.items()} == {
      "ar": (12, False), "cp": (3, False), "ag": (3, False), "a2a": (1, True)}
  assert by_name["ar"].computation == "inner_body"
  assert by_name["ar"].total_wire_bytes == 12 * 2 * 3 / 4 * 32
  assert by_name["cp"].group_size == 2
  summary = hlo.summarize(list(by_name.values()))
  assert list(summary) == ["all-reduce", "all-gather", "all-to-all", "collective-permute"]
  assert summary["all-reduce"] == {"ops": 1, "executions": 12, "wire_bytes": 12 * 48.0,
                                   "payload_bytes": 12 * 32}


def test_the_exchanges_later_rounds_run_no_times_in_the_prediction():
  """The same loose loop (no known trip count: taken as 1, flagged) named by JAX's op_name as
  the MoE exchange's rounds after the first (sharding/exchange_rounds.OVERFLOW_ROUNDS) runs 0
  times: the predicted case, every device pair within its capacity, never enters it."""
  from sharding.exchange_rounds import OVERFLOW_ROUNDS

  scope = f'jit(step)/jvp()/shard_map/{OVERFLOW_ROUNDS}/while'
  text = _NESTED.replace("body=%loose_body",
                         f'body=%loose_body, metadata={{op_name="{scope}"}}')
  assert text != _NESTED
  by_name = {c.name: c for c in hlo.collectives(text)}
  assert (by_name["a2a"].count, by_name["a2a"].unknown_trip_count) == (0, False)
  assert by_name["ar"].count == 12  # the other loops as before
  # As the step-time model prices it too: the loop's bytes drop out, not counted once.
  before, after = (branches.costliest_branch_wire_bytes(t) for t in (_NESTED, text))
  assert before["all-to-all"] > 0 and "all-to-all" not in after
  assert after["all-reduce"] == before["all-reduce"]
  (loose,) = [i for i in hlo.computations(text)["main"] if i.name == "loose"]
  assert hlo.unrun(loose) and loose.op_name == scope and "metadata" not in loose.attrs


_TICKS = """\
HloModule ticks, num_partitions=4

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%forward (v: f32[8]) -> f32[8] {
  %v = f32[8]{0} parameter(0)
  ROOT %fwd = f32[8]{0} all-reduce(%v), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add
}

%backward (v: f32[8]) -> f32[8] {
  %v = f32[8]{0} parameter(0)
  %bwd1 = f32[8]{0} all-reduce(%v), channel_id=2, replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %bwd2 = f32[8]{0} all-reduce(%bwd1), channel_id=3, replica_groups={{0,1,2,3}}, to_apply=%add
}

%tick (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[8]{0} get-tuple-element(%t), index=1
  %c = f32[8]{0} conditional(%i, %v, %v), branch_computations={%forward, %backward}
  ROOT %r = (s32[], f32[8]{0}) tuple(%i, %c)
}

%cond (t: (s32[], f32[8])) -> pred[] {
  %t = (s32[], f32[8]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[], f32[8]{0}) parameter(0)
  %w = (s32[], f32[8]{0}) while(%t), condition=%cond, body=%tick, backend_config={"known_trip_count":{"n":"5"}}
  %v = f32[8]{0} get-tuple-element(%w), index=1
  %ag = f32[32]{0} all-gather(%v), channel_id=4, replica_groups=[1,4]<=[4], dimensions={0}
  %i = s32[] get-tuple-element(%w), index=0
  ROOT %r = (s32[], f32[8]{0}) tuple(%i, %v)
}
"""


def test_a_conditional_counts_its_costliest_branch_once_per_run():
  """5 ticks, each running a forward branch (1 all-reduce) or a backward one (2): `summarize`
  counts both branches every tick (15 all-reduces), the costliest-branch count the backward's 2
  (10); the all-gather after the loop runs once either way."""
  all_reduce, gather = 2 * 3 / 4 * 32, 3 / 4 * 128  # ring wire bytes of f32[8] and f32[32]
  summary = hlo.summarize(hlo.collectives(_TICKS))
  assert summary["all-reduce"]["executions"] == 15
  assert branches.costliest_branch_wire_bytes(_TICKS) == pytest.approx(
      {"all-reduce": 10 * all_reduce, "all-gather": gather})


# ---------------------------------------------------------------- programs compiled on 8 CPUs


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)


def _shard_map_hlo(mesh, f, in_spec, out_spec, **kw):
  x = jax.ShapeDtypeStruct((128, 64), jnp.float32, sharding=NamedSharding(mesh, P()))
  fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_spec, out_specs=out_spec, **kw))
  return fn.lower(x).compile().as_text()


def _only(text):
  (col,) = hlo.collectives(text)
  return col


def test_psum(mesh):
  c = _only(_shard_map_hlo(mesh, lambda x: jax.lax.psum(x, "b"), P(), P()))
  assert (c.kind, c.dtype, c.shape, c.group_size, c.count) == (
      "all-reduce", "f32", (128, 64), 4, 1)
  assert c.bytes == F32_128x64
  assert c.wire_bytes == 2 * 3 / 4 * F32_128x64


@pytest.mark.parametrize("kind, f, in_spec, out_spec, nbytes, wire", [
    ("all-gather", lambda x: jax.lax.all_gather(x, "b", tiled=True), P("b"), P(),
     F32_128x64, 3 / 4 * F32_128x64),
    ("reduce-scatter", lambda x: jax.lax.psum_scatter(x, "b", tiled=True), P(), P("b"),
     F32_128x64, 3 / 4 * F32_128x64),
    ("all-to-all", lambda x: jax.lax.all_to_all(x, "b", 0, 0, tiled=True), P("b"), P("b"),
     F32_128x64 // 4, 3 / 4 * F32_128x64 // 4),
    ("collective-permute",
     lambda x: jax.lax.ppermute(x, "b", [(i, (i + 1) % 4) for i in range(4)]), P("b"), P("b"),
     F32_128x64 // 4, F32_128x64 // 4),
])
def test_shard_map_collectives(mesh, kind, f, in_spec, out_spec, nbytes, wire):
  # all_gather's output is not provably replicated, hence check_vma=False.
  c = _only(_shard_map_hlo(mesh, f, in_spec, out_spec, check_vma=False))
  assert (c.kind, c.group_size, c.bytes, c.wire_bytes, c.count) == (kind, 4, nbytes, wire, 1)


def test_scan_multiplies_by_trip_count(mesh):
  def f(x):
    return jax.lax.scan(lambda c, _: (jax.lax.psum(c, "b") * 0.5, None), x, None, length=5)[0]

  c = _only(text := _shard_map_hlo(mesh, f, P(), P()))
  assert (c.kind, c.count, c.unknown_trip_count) == ("all-reduce", 5, False)
  assert c.computation != "main" and "known_trip_count" in text
  assert c.total_wire_bytes == 5 * 2 * 3 / 4 * F32_128x64
  assert hlo.summarize([c])["all-reduce"]["executions"] == 5


def test_sharded_matmul_all_reduce(mesh):
  x = jax.ShapeDtypeStruct((128, 64), jnp.float32, sharding=NamedSharding(mesh, P(None, "b")))
  w = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P("b", None)))
  fn = jax.jit(lambda x, w: x @ w, out_shardings=NamedSharding(mesh, P()))
  c = _only(fn.lower(x, w).compile().as_text())
  assert (c.kind, c.shape, c.group_size, c.bytes) == ("all-reduce", (128, 32), 4, 128 * 32 * 4)
  assert c.wire_bytes == 2 * 3 / 4 * 128 * 32 * 4


def test_iota_and_mesh_axis_groups_on_a_3d_mesh():
  mesh = jax.make_mesh((2, 2, 2), ("x", "y", "z"), axis_types=(AxisType.Auto,) * 3)
  x = jax.ShapeDtypeStruct((128, 64), jnp.float32,
                           sharding=NamedSharding(mesh, P(("x", "z"), "y")))
  w = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P("y", "z")))
  fn = jax.jit(lambda x, w: x @ w, out_shardings=NamedSharding(mesh, P()))
  text = fn.lower(x, w).compile().as_text()
  # XLA:CPU prints all three replica_groups syntaxes here.
  assert "replica_groups=[4,2]<=[2,2,2]" in text and "replica_groups=mesh[" in text
  got = sorted((c.kind, c.group_size, c.bytes) for c in hlo.collectives(text))
  assert got == [("all-gather", 2, 32 * 32 * 4), ("all-gather", 4, 128 * 32 * 4),
                 ("all-reduce", 2, 32 * 32 * 4)]


def test_replicated_program_has_no_collectives():
  x = jax.ShapeDtypeStruct((128, 64), jnp.float32)
  text = jax.jit(lambda x: jnp.sin(x) @ x.T).lower(x).compile().as_text()
  assert hlo.collectives(text) == []
  assert hlo.summarize([]) == {}


# ---------------------------------------------------------------- XLA:GPU samples (tests/hlo_samples)

_SAMPLES = os.path.join(os.path.dirname(__file__), "hlo_samples")
_B4 = ("f32", 4, True)  # dtype, group size over "b", async


@pytest.mark.parametrize("sample, expected", [
    ("psum", [("all-reduce", (128, 64), F32_128x64, *_B4, 1)]),
    ("ag", [("all-gather", (128, 64), F32_128x64, *_B4, 1)]),
    ("rs", [("reduce-scatter", (32, 64), F32_128x64, *_B4, 1)]),
    ("a2a", [("all-to-all", (32, 64), F32_128x64 // 4, *_B4, 1)]),
    ("pp", [("collective-permute", (32, 64), F32_128x64 // 4, *_B4, 1)]),
    ("scan", [("all-reduce", (128, 64), F32_128x64, *_B4, 5)]),
    # A combined all-gather of two arrays, then one over the mesh-axis form, then the gradient's
    # reduce-scatter (S_in = 2 × its bf16[256,256] result).
    ("mlp", [("all-gather", (512, 256), 2 * 512 * 256 * 2, "bf16", 2, True, 1),
             ("all-gather", (256, 256), 256 * 256 * 2, "bf16", 2, True, 1),
             ("reduce-scatter", (256, 256), 2 * 256 * 256 * 2, "bf16", 2, True, 1)]),
])
def test_gpu_samples(sample, expected):
  with open(os.path.join(_SAMPLES, f"h100x8_{sample}.hlo")) as f:
    cols = hlo.collectives(f.read())
  assert [(c.kind, c.shape, c.bytes, c.dtype, c.group_size, c.is_async, c.count)
          for c in cols] == expected
