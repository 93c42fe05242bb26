"""The overlap view of compiled programs: what runs between each async collective's start and done;
and, on deviceless 8xH100 / 64xH100 programs of the tiny Llama, what the XLA presets change."""

import dataclasses
import functools
import os

import jax
import pytest

from configs import llama
from models import param_names
from sharding import MeshConfig
from sharding.xla import compiled, hlo, overlap
from trainer.aot import compile_for_gpus

SAMPLES = os.path.join(os.path.dirname(__file__), "hlo_samples")

_PROGRAM = """\
HloModule m, is_scheduled=true, num_partitions=4

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%gemm (a: f32[8,16], b: f32[16,32]) -> f32[8,32] {
  %a = f32[8,16]{1,0} parameter(0)
  %b = f32[16,32]{1,0} parameter(1)
  ROOT %d = f32[8,32]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%scale (a: f32[8,32]) -> f32[8,32] {
  %a = f32[8,32]{1,0} parameter(0)
  ROOT %m = f32[8,32]{1,0} multiply(%a, %a)
}

%wrapped (p: f32[8,32]) -> f32[32,32] {
  %p = f32[8,32]{1,0} parameter(0)
  ROOT %ag2 = f32[32,32]{1,0} all-gather(%p), replica_groups={{0,1,2,3}}, dimensions={0}
}

%body (t: (s32[], f32[8,16], f32[16,32])) -> (s32[], f32[8,16], f32[16,32]) {
  %t = (s32[], f32[8,16]{1,0}, f32[16,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[8,16]{1,0} get-tuple-element(%t), index=1
  %w = f32[16,32]{1,0} get-tuple-element(%t), index=2
  %next = (f32[4,32]{1,0}, f32[16,32]{1,0}) all-gather-start(%w), replica_groups={{0,1,2,3}}, dimensions={0}
  %y = f32[8,32]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm
  %got = f32[16,32]{1,0} all-gather-done(%next)
  %now = f32[8,16]{1,0} all-reduce-start(%x), replica_groups={{0,1,2,3}}, to_apply=%add
  %now.done = f32[8,16]{1,0} all-reduce-done(%now)
  %carry = f32[16,32]{1,0} bitcast(%got)
  %used = f32[8,16]{1,0} negate(%now.done)
  ROOT %r = (s32[], f32[8,16]{1,0}, f32[16,32]{1,0}) tuple(%i, %used, %carry)
}

%cond (t: (s32[], f32[8,16], f32[16,32])) -> pred[] {
  %t = (s32[], f32[8,16]{1,0}, f32[16,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(6)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: f32[8,16], w: f32[16,32]) -> f32[32,32] {
  %x = f32[8,16]{1,0} parameter(0)
  %w = f32[16,32]{1,0} parameter(1)
  %ar = f32[8,16]{1,0} all-reduce-start(%x), replica_groups={{0,1,2,3}}, to_apply=%add
  %mm = f32[8,32]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm
  %sq = f32[8,32]{1,0} fusion(%mm), kind=kLoop, calls=%scale
  %ar.done = f32[8,16]{1,0} all-reduce-done(%ar)
  %s = ((f32[8,32]{1,0}), f32[32,32]{1,0}) async-start(%sq), calls=%wrapped
  %bc = f32[8,32]{1,0} bitcast(%sq)
  %d = f32[32,32]{1,0} async-done(%s), calls=%wrapped
  %init = (s32[], f32[8,16]{1,0}, f32[16,32]{1,0}) tuple(%x, %ar.done, %w)
  %loop = (s32[], f32[8,16]{1,0}, f32[16,32]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
  ROOT %out = f32[32,32]{1,0} copy(%d)
}
"""


def test_windows_count_kernels_and_matmul_flops_between_start_and_done():
  w = overlap.windows(_PROGRAM)
  assert (w["ar"].compute_ops, w["ar"].matmul_ops, w["ar"].between) == (2, 1, ("mm", "sq"))
  assert w["ar"].matmul_flops == 2 * 8 * 32 * 16
  # An async-start wrapper is keyed by the collective inside; only a bitcast runs meanwhile.
  assert (w["ag2"].computation, w["ag2"].compute_ops, w["ag2"].found_done) == ("main", 0, True)
  assert (w["next"].compute_ops, w["next"].matmul_ops) == (1, 1)
  assert w["now"].compute_ops == 0


def test_annotated_rows_summarize_hidden_and_exposed_bytes():
  rows = [dict(dataclasses.asdict(c), wire_bytes=c.wire_bytes, total_wire_bytes=c.total_wire_bytes)
          for c in hlo.collectives(_PROGRAM)]
  overlap.annotate(rows, _PROGRAM)
  by_name = {r["name"]: r for r in rows}
  assert by_name["next"]["count"] == 6 and by_name["next"]["matmul_between"] == 1
  s = overlap.summarize(rows)
  hidden = by_name["ar"]["total_wire_bytes"] + by_name["next"]["total_wire_bytes"]
  assert s["hidden_bytes"] == hidden and s["exposed_bytes"] == s["wire_bytes"] - hidden
  assert s["ops_with_compute"] == 2 and s["async_ops"] == 4
  assert overlap.summarize(rows, large_bytes=10**9)["wire_bytes"] == 0


def test_carried_finds_collectives_issued_one_iteration_ahead():
  # `next` reaches the loop's ROOT through a bitcast: gathered for the next iteration.
  assert overlap.carried(_PROGRAM) == {"next": True, "now": False}
  scan = open(os.path.join(SAMPLES, "h100x8_scan.hlo")).read()
  assert list(overlap.carried(scan).values()) == [False]  # its psum feeds this iteration


def test_sample_program_and_timeline():
  text = open(os.path.join(SAMPLES, "h100x8_scan.hlo")).read()
  (window,) = overlap.windows(text).values()
  assert (window.compute_ops, window.matmul_ops) == (1, 0)  # the loop counter's add
  lines = overlap.timeline(_PROGRAM, "main")
  assert lines[0].startswith("all-reduce-start") and lines[1].startswith("fusion")
  assert lines[2] == "  +1 ops"


def test_old_reports_without_overlap_still_load_and_format():
  rep = compiled.CompiledReport("t", 1, "cpu", dict.fromkeys(
      ("argument", "output", "temp", "alias", "generated_code", "peak"), 0), None, [], {}, False)
  data = dataclasses.asdict(rep)
  del data["overlap"]
  assert "overlap:" not in compiled.format_report(compiled.from_json(data))


# ---------------------------------------------------------------- deviceless GPU programs

LAYERS = llama.debug().model.num_layers
# FSDP-sharded weights per layer: those with an `embed` dim (q, k, v, o, gate, up, down).
LAYER_WEIGHTS = sum("embed" in names for names in jax.tree.leaves(
    param_names(llama.debug().model)["layers"], is_leaf=lambda x: isinstance(x, tuple)))


@functools.lru_cache(maxsize=None)
def gpu(preset: str, target: str = "h100x8", **mesh) -> compiled.CompiledReport:
  cfg = llama.debug()
  cfg.mesh = MeshConfig(**{"data": 1, **mesh})
  cfg.batch_size, cfg.seq_len, cfg.xla_preset = 64, 64, preset
  return compile_for_gpus(cfg, compiled.parse_gpu_target(target))


def in_loops(rep):
  return [c for c in rep.collectives if c["count"] > 1]


@pytest.mark.parametrize("target, mesh", [("h100x8", dict(fsdp=8)),
                                          ("h100x64", dict(data=8, fsdp=8))])
def test_default_preset_hides_every_layer_collective(target, mesh):
  rep = gpu("auto", target, **mesh)  # the default; overlap_v1 on data/fsdp meshes
  assert rep.is_scheduled and rep.async_fraction == 1.0
  layer = in_loops(rep)
  assert layer and all(c["is_async"] and c["compute_between"] >= 1 for c in layer)
  # What is exposed at all is outside the layer loops (h100x64: the last gradient reduction,
  # 3% of the bytes, which the optimizer's global norm waits for).
  assert rep.overlap["hidden_fraction"] >= 0.95
  assert compiled.fits(rep, compiled.parse_gpu_target(target).device_memory_bytes)[0]


def test_fsdp_prefetch_gathers_the_next_layer_during_this_one():
  """With the preset, every weight all-gather in the layer loops is carried to the next
  iteration (layer i+1's weights gathered while layer i computes); XLA's default gathers each
  layer's weights in its own iteration, behind only its norm in the forward loop."""
  after, before = gpu("auto", fsdp=8), gpu("none", fsdp=8)
  gathers = lambda rep: [c for c in in_loops(rep) if c["kind"] == "all-gather"]  # noqa: E731
  assert gathers(after) and all(c["carried"] for c in gathers(after))
  assert gathers(before) and not any(c["carried"] for c in gathers(before))
  assert min(c["matmul_between"] for c in gathers(before)) == 0  # the forward one: norm only
  assert all(c["matmul_between"] >= 1 for c in gathers(after))
  # The price: buffers live across iterations (a second layer of gathered weights, and the
  # peeled iteration's); on this model +15% of a small peak, within the budget.
  assert LAYER_WEIGHTS == 7 and after.memory["peak"] <= 1.2 * before.memory["peak"]


def test_combine_thresholds_set_the_number_of_gathers_and_scatters():
  """Threshold 0: one all-gather per weight per layer pass (forward and backward) plus the
  embedding and head, one reduce-scatter per weight gradient; XLA's 30 MiB default: a layer's
  weights travel together, at most one collective per layer pass. Same bytes either way."""
  fine, default = gpu("overlap_unbucketed_v1", fsdp=8), gpu("auto", fsdp=8)
  assert fine.summary["all-gather"]["executions"] == 2 * LAYERS * LAYER_WEIGHTS + 2
  assert fine.summary["reduce-scatter"]["executions"] == LAYERS * LAYER_WEIGHTS + 2
  assert default.summary["all-gather"]["executions"] <= 2 * LAYERS + 2
  assert default.summary["reduce-scatter"]["executions"] <= LAYERS + 2
  for kind in ("all-gather", "reduce-scatter"):
    assert fine.summary[kind]["payload_bytes"] == default.summary[kind]["payload_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("target, mesh", [("h100x8", dict(fsdp=8)),
                                          ("h100x64", dict(data=8, fsdp=8))])
def test_default_preset_hides_the_8b_models_layer_collectives(target, mesh):
  """The playbook's 8.86B model (bf16, full remat, seq 4096, batch 8 per fsdp group): with the
  default preset every collective in the layer loops is async with compute between start and
  done, at least 95% of the bytes are hidden, and the program fits in 80 GB."""
  cfg = llama.large("playbook_8b")
  cfg.mesh = MeshConfig(**{"data": 1, **mesh})
  cfg.batch_size, cfg.seq_len = 8 * mesh.get("data", 1), 4096
  cfg.model = dataclasses.replace(cfg.model, dtype="bfloat16", param_dtype="float32")
  cfg.compute = dataclasses.replace(cfg.compute, remat="full")
  target = compiled.parse_gpu_target(target)
  rep = compile_for_gpus(cfg, target)
  layer = in_loops(rep)
  assert layer and all(c["is_async"] and c["compute_between"] >= 1 for c in layer)
  assert rep.overlap["hidden_fraction"] >= 0.95
  assert compiled.fits(rep, target.device_memory_bytes)[0]
