"""sharding/xla/step_time.py: the roofline over a scheduled GPU program, on deviceless H100 HLO.

Each expected number is computed here from the instruction's shapes and the H100 profile's
constants, by the formula the module states.
"""

import dataclasses
import json
import os
import re

import pytest

from benchmarks import anchor_plan_compiled, gpu_predict
from sharding.plan import hardware
from sharding.xla import hlo, step_time

SAMPLES = os.path.join(os.path.dirname(__file__), "hlo_samples")
H100 = hardware.PROFILES["h100"]


def sample(name: str) -> str:
  with open(os.path.join(SAMPLES, f"h100x8_{name}.hlo")) as f:
    return f.read()


def op(prediction, name):
  return next(o for o in prediction.top_ops if o["name"] == name)


def all_reduce_seconds(payload_bytes: int, group: int, bus_bandwidth: float, latency: float):
  return 2 * (group - 1) / group * payload_bytes / bus_bandwidth + latency


def test_gemm_fusion_costs_its_dot_flops_at_the_gemm_fraction():
  """gemm_fusion_dot.6: f32[8,128,256] = dot(bf16[128,8,64], bf16[8,64,256]) contracting 64."""
  prediction = step_time.predict(sample("mlp"), H100, top=50)
  gemm = op(prediction, "gemm_fusion_dot.6")
  flops = 2 * 8 * 128 * 256 * 64
  moved = 128 * 8 * 64 * 2 + 8 * 64 * 256 * 2 + 8 * 128 * 256 * 4  # operands read, result written
  assert gemm["kind"] == "gemm" and gemm["flops"] == flops and gemm["bytes"] == moved
  assert gemm["seconds"] == pytest.approx(
      max(flops / (H100.peak_bf16_flops * H100.gemm_peak_fraction), moved / H100.copy_bandwidth)
      + H100.kernel_overhead_s)
  assert prediction.compute_s <= prediction.step_s


def test_a_loop_body_runs_its_trip_count_times():
  """h100x8_scan: 5 iterations, each an all-reduce of f32[128,64] over groups of 4 in one node."""
  prediction = step_time.predict(sample("scan"), H100)
  reduce = op(prediction, "all-reduce-start")
  one = all_reduce_seconds(128 * 64 * 4, 4, H100.nvlink_busbw, H100.collective_latency_s)
  assert reduce["count"] == 5 and reduce["seconds"] == pytest.approx(one)
  assert prediction.communication_s == pytest.approx(5 * one)


def test_a_group_across_nodes_goes_over_the_network():
  """The same psum over {0,1,2,3}: inside one node of 8, across two nodes of 2 GPUs each (the
  ring then runs at the network's bandwidth per GPU times the GPUs per node)."""
  text = sample("psum")
  inside = step_time.predict(text, H100, gpus_per_node=8)
  across = step_time.predict(text, H100, gpus_per_node=2)
  payload = 128 * 64 * 4
  assert inside.communication_s == pytest.approx(
      all_reduce_seconds(payload, 4, H100.nvlink_busbw, H100.collective_latency_s))
  assert across.communication_s == pytest.approx(
      all_reduce_seconds(payload, 4, 2 * H100.network_busbw_per_gpu, H100.network_latency_s))
  assert across.communication_s > inside.communication_s


_PROGRAM = """HloModule overlap, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%gemm_computation (x: bf16[4096,4096], y: bf16[4096,4096]) -> bf16[4096,4096] {
  %x = bf16[4096,4096]{1,0} parameter(0)
  %y = bf16[4096,4096]{1,0} parameter(1)
  ROOT %d = bf16[4096,4096]{1,0} dot(%x, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (p: f32[16777216], x: bf16[4096,4096]) -> (f32[16777216], bf16[4096,4096]) {
  %p = f32[16777216]{0} parameter(0)
  %x = bf16[4096,4096]{1,0} parameter(1)
{body}
  ROOT %out = (f32[16777216]{0}, bf16[4096,4096]{1,0}) tuple(%all-reduce-done, %gemm)
}
"""
_START = ("  %all-reduce-start = f32[16777216]{0} all-reduce-start(%p), channel_id=1,"
          " replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add")
_DONE = "  %all-reduce-done = f32[16777216]{0} all-reduce-done(%all-reduce-start)"
_GEMM = ("  %gemm = bf16[4096,4096]{1,0} fusion(%x, %x), kind=kCustom,"
         " calls=%gemm_computation")


def test_compute_between_start_and_done_hides_a_collective():
  """The same all-reduce (64 MiB, 8 GPUs) and GEMM (4096^3) in two schedules: the GEMM between
  start and done hides the collective up to the GEMM's time; after done it hides nothing."""
  hidden = _PROGRAM.replace("{body}", "\n".join([_START, _GEMM, _DONE]))
  exposed = _PROGRAM.replace("{body}", "\n".join([_START, _DONE, _GEMM]))
  assert hidden != exposed
  a, b = step_time.predict(hidden, H100), step_time.predict(exposed, H100)
  gemm = 2 * 4096 ** 3 / (H100.peak_bf16_flops * H100.gemm_peak_fraction) + H100.kernel_overhead_s
  reduce = all_reduce_seconds(16777216 * 4, 8, H100.nvlink_busbw, H100.collective_latency_s)
  assert a.compute_s == pytest.approx(gemm) and b.compute_s == pytest.approx(gemm)
  assert a.communication_s == pytest.approx(reduce) == b.communication_s
  assert b.step_s == pytest.approx(gemm + reduce) and b.exposed_communication_s == pytest.approx(
      reduce)
  assert a.step_s == pytest.approx(max(gemm, reduce))
  assert a.exposed_communication_s == pytest.approx(max(0.0, reduce - gemm))


_F8_PROGRAM = """HloModule f8, is_scheduled=true

%gemm_computation (x: f8e4m3fn[4096,4096], y: f8e4m3fn[4096,4096]) -> bf16[4096,4096] {
  %x = f8e4m3fn[4096,4096]{1,0} parameter(0)
  %y = f8e4m3fn[4096,4096]{1,0} parameter(1)
  ROOT %d = bf16[4096,4096]{1,0} dot(%x, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: f8e4m3fn[4096,4096], s: f32[]) -> (bf16[4096,4096], s8[4194304]) {
  %x = f8e4m3fn[4096,4096]{1,0} parameter(0)
  %s = f32[] parameter(1)
  %gemm = bf16[4096,4096]{1,0} fusion(%x, %x), kind=kCustom, calls=%gemm_computation
  ROOT %cublas = (bf16[4096,4096]{1,0}, s8[4194304]{0}) custom-call(%x, %x, %s, %s), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"]}}}
}
"""


def test_gemms_on_f8_operands_run_at_the_fp8_peak():
  """A Triton-style fusion of a dot on two f8 operands and a cuBLASLt fp8 call, each 4096^3
  (compute-bound): FLOPs over peak_fp8_flops x gemm_peak_fraction. The same fusion on bf16
  operands takes the bf16 peak, twice as long on an H100."""
  f8 = step_time.predict(_F8_PROGRAM, H100, top=10)
  flops = 2 * 4096 ** 3
  seconds = flops / (H100.peak_fp8_flops * H100.gemm_peak_fraction) + H100.kernel_overhead_s
  for name in ("gemm", "cublas"):
    assert op(f8, name)["flops"] == flops and op(f8, name)["seconds"] == pytest.approx(seconds)
  bf16 = step_time.predict(_F8_PROGRAM.replace("f8e4m3fn", "bf16"), H100, top=10)
  assert bf16 != f8 and op(bf16, "gemm")["seconds"] == pytest.approx(
      flops / (H100.peak_bf16_flops * H100.gemm_peak_fraction) + H100.kernel_overhead_s)
  assert H100.peak_fp8_flops == pytest.approx(2 * H100.peak_bf16_flops, rel=1e-3)


@pytest.mark.parametrize("attrs, first", [
    ("replica_groups={{0,1,2,3},{4,5,6,7}}", [0, 1, 2, 3]),
    ("replica_groups=[2,4]<=[8]", [0, 1, 2, 3]),
    ("replica_groups=[4,2]<=[2,4]T(1,0)", [0, 4]),
    ("replica_groups=[8,8]<=[8,8]T(1,0)", [0, 8, 16, 24, 32, 40, 48, 56])])
def test_first_replica_group_of_each_text_form(attrs, first):
  assert step_time.first_group(attrs) == first


def test_constants_scale_the_prediction_as_the_formulas_say():
  """Twice the NVLink bandwidth halves the wire time; twice the GEMM fraction halves a
  compute-bound GEMM."""
  text = _PROGRAM.replace("{body}", "\n".join([_START, _DONE, _GEMM]))
  base = step_time.predict(text, H100)
  fast_links = step_time.predict(text, dataclasses.replace(H100, nvlink_busbw=2 * H100.nvlink_busbw))
  wire = base.communication_s - H100.collective_latency_s
  assert fast_links.communication_s - H100.collective_latency_s == pytest.approx(wire / 2)
  fast_gemm = step_time.predict(text, dataclasses.replace(
      H100, gemm_peak_fraction=2 * H100.gemm_peak_fraction))
  kernel = base.compute_s - H100.kernel_overhead_s
  assert fast_gemm.compute_s - H100.kernel_overhead_s == pytest.approx(kernel / 2)
  assert hlo.computations(text)  # the hand-written program parses


def test_summary_gives_tokens_per_gpu_and_mfu():
  prediction = step_time.StepPrediction(2.0, 1.5, 1.0, 0.5, [])
  summary = prediction.summary(tokens_per_step=8 * 4096, model_flops_per_step=8e15, devices=8,
                               peak_flops=1e15)
  assert summary["tokens_per_s_per_gpu"] == pytest.approx(8 * 4096 / 2.0 / 8)
  assert summary["mfu"] == pytest.approx(8e15 / 8 / 2.0 / 1e15)
  assert "predicted step" in step_time.format_prediction(summary)


_LOOP = """HloModule loop, is_scheduled=true

%less (p: s32[]) -> pred[] {
  %p = s32[] parameter(0)
  %bound = s32[] constant(7)
  ROOT %lt = pred[] compare(%p, %bound), direction=LT
}

%cond (t: (s32[], bf16[4096,4096])) -> pred[] {
  %t = (s32[], bf16[4096,4096]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %test = pred[] fusion(%i), kind=kLoop, calls=%less
}

%gemm_computation (x: bf16[4096,4096], y: bf16[4096,4096]) -> bf16[4096,4096] {
  %x = bf16[4096,4096]{1,0} parameter(0)
  %y = bf16[4096,4096]{1,0} parameter(1)
  ROOT %d = bf16[4096,4096]{1,0} dot(%x, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (t: (s32[], bf16[4096,4096])) -> (s32[], bf16[4096,4096]) {
  %t = (s32[], bf16[4096,4096]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = bf16[4096,4096]{1,0} get-tuple-element(%t), index=1
  %gemm = bf16[4096,4096]{1,0} fusion(%x, %x), kind=kCustom, calls=%gemm_computation
  ROOT %next = (s32[], bf16[4096,4096]{1,0}) tuple(%i, %gemm)
}

ENTRY %main (x: bf16[4096,4096]) -> (s32[], bf16[4096,4096]) {
  %x = bf16[4096,4096]{1,0} parameter(0)
  %start = s32[] constant(2)
  %init = s32[] copy(%start)
  %tuple = (s32[], bf16[4096,4096]{1,0}) tuple(%init, %x)
  ROOT %while = (s32[], bf16[4096,4096]{1,0}) while(%tuple), condition=%cond, body=%body, backend_config={"known_induction_variable":{"tuple_index":"0"}}
}
"""


def test_a_loop_without_known_trip_count_is_counted_from_its_condition():
  """XLA drops known_trip_count from loops it rewrote (the gradient-accumulation loop after
  peeling): `i < 7` from i = 2 runs 5 times. With the initial value unknown it counts once."""
  comps = hlo.computations(_LOOP)
  loop = next(x for x in comps["main"] if x.op == "while")
  assert hlo.trip_count(loop, comps, "main") == 5
  assert op(step_time.predict(_LOOP, H100), "gemm")["count"] == 5
  unknown = _LOOP.replace("%init = s32[] copy(%start)", "%init = s32[] parameter(1)")
  comps = hlo.computations(unknown)
  assert hlo.trip_count(next(x for x in comps["main"] if x.op == "while"), comps, "main") is None
  assert op(step_time.predict(unknown, H100), "gemm")["count"] == 1


def test_the_anchor_table_is_rendered_from_the_committed_results():
  """docs/planning.md's predicted-vs-published table is what benchmarks/step_time_anchors.py
  renders from benchmarks/results/step_time_anchors.jsonl (regenerate both with
  --doc docs/planning.md)."""
  from benchmarks import step_time_anchors
  rows = step_time_anchors.render(step_time_anchors.RESULTS)
  from tests.docs_text import section
  shown = section("planning", step_time_anchors.BEGIN, step_time_anchors.END)
  assert shown.strip() == rows.strip()
  anchors_table, _, rest = rows.partition("\n\n")
  table = [line for line in anchors_table.splitlines()[2:] if line.startswith("| ")]
  assert len(table) == len(step_time_anchors.ANCHORS)  # a row per anchor, in their order
  for a, line in zip(step_time_anchors.ANCHORS, table):
    assert line.startswith(f"| {a.name} ({a.release}) |")
  # Then the planner checks: a row per compiled anchor (benchmarks/anchor_planner.py).
  compiled = [a for a, line in zip(step_time_anchors.ANCHORS, table) if "refused" not in line
              and "failed" not in line]
  tables = [block.splitlines() for block in rest.split("\n\n") if block.startswith("| ")]
  checks = tables[0][2:]  # past its head
  assert [line.split(" | ")[0] for line in checks] == [f"| {a.name}" for a in compiled]
  # And `plan`'s top 3 compiled (benchmarks/anchor_plan_compiled.py): a row per anchor it ran.
  plans = [json.loads(line) for line in open(anchor_plan_compiled.RESULTS)]
  assert [line.split(" | ")[0] for line in tables[1][2:]] == [f"| {r['anchor']}" for r in plans]
  assert {r["anchor"] for r in plans} == {a.name for a in compiled if not a.before}


def test_cudnn_attention_backward_costs_five_matmuls_and_the_forward_two():
  """The cuDNN backward's target ends in "Backward" (the H200's program): dQ, dK, dV, dP and the
  recomputed scores, 5 x B·H·L²·d against the forward's 2 (each 2·B·H·L²·d halved, causal)."""
  with open(os.path.join(SAMPLES, "h200_cudnn_attention.hlo")) as f:
    prediction = step_time.predict(f.read(), hardware.PROFILES["h200"], top=50)
  per_matmul = 2 * 4 * 256 * 256 * 64
  forward = op(prediction, "dot_product_attention_fwd.1")
  backward = op(prediction, "dot_product_attention_bwd.2")
  assert forward["kind"] == backward["kind"] == "attention"
  assert (forward["flops"], backward["flops"]) == (2 * per_matmul, 5 * per_matmul)


_VIEWS_PROGRAM = """HloModule views, is_scheduled=true

%slice_computation (stack: bf16[32,1024,1024], i: s32[]) -> bf16[1,1024,1024] {
  %stack = bf16[32,1024,1024]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %zero = s32[] constant(0)
  %view = bf16[32,1,1024,1024]{3,2,1,0} bitcast(%stack)
  %row = bf16[1,1,1024,1024]{3,2,1,0} dynamic-slice(%view, %i, %zero, %zero, %zero), dynamic_slice_sizes={1,1,1024,1024}
  ROOT %out = bf16[1,1024,1024]{2,1,0} bitcast(%row)
}

%update_computation (stack: f32[32,1024,1024], row: f32[1024,1024], i: s32[]) -> f32[32,1024,1024] {
  %stack = f32[32,1024,1024]{2,1,0} parameter(0)
  %row = f32[1024,1024]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %zero = s32[] constant(0)
  %view = f32[32,1,1024,1024]{3,2,1,0} bitcast(%stack)
  %update = f32[1,1,1024,1024]{3,2,1,0} bitcast(%row)
  %put = f32[32,1,1024,1024]{3,2,1,0} dynamic-update-slice(%view, %update, %i, %zero, %zero, %zero)
  ROOT %back = f32[32,1024,1024]{2,1,0} bitcast(%put)
}

ENTRY %main (stack: bf16[32,1024,1024], acc: f32[32,1024,1024], row: f32[1024,1024], i: s32[]) -> (bf16[1,1024,1024], f32[32,1024,1024]) {
  %stack = bf16[32,1024,1024]{2,1,0} parameter(0)
  %acc = f32[32,1024,1024]{2,1,0} parameter(1)
  %row = f32[1024,1024]{1,0} parameter(2)
  %i = s32[] parameter(3)
  %slice = bf16[1,1024,1024]{2,1,0} fusion(%stack, %i), kind=kLoop, calls=%slice_computation
  %update = f32[32,1024,1024]{2,1,0} fusion(%acc, %row, %i), kind=kLoop, calls=%update_computation
  ROOT %t = (bf16[1,1024,1024]{2,1,0}, f32[32,1024,1024]{2,1,0}) tuple(%slice, %update)
}
"""


def test_slices_and_in_place_updates_are_seen_through_bitcasts():
  """A layer's row read from a stack of 32 and a row written in place into a gradient stack,
  each behind a bitcast (XLA's view for a layout change, as in the scanned layers' residuals and
  accumulators): the slice moves its row read and written, the update its row read, and written
  twice (the in-place rule), not the whole stack."""
  prediction = step_time.predict(_VIEWS_PROGRAM, H100)
  row = 1024 * 1024
  assert op(prediction, "slice")["bytes"] == 2 * row * 2 + 4  # the row in and out, the index
  assert op(prediction, "update")["bytes"] == row * 4 + 4 + 2 * row * 4


_RAGGED = """HloModule ragged, is_scheduled=true

ENTRY %main (x: bf16[1024,512], out: bf16[2048,512], o: s64[{n}]) -> bf16[2048,512] {{
  %x = bf16[1024,512]{{1,0}} parameter(0)
  %out = bf16[2048,512]{{1,0}} parameter(1)
  %o = s64[{n}]{{0}} parameter(2)
  %ragged-all-to-all-start = ((bf16[1024,512]{{1,0}}, bf16[2048,512]{{1,0}}, s64[{n}]{{0}}, s64[{n}]{{0}}, s64[{n}]{{0}}, s64[{n}]{{0}}), bf16[2048,512]{{1,0}}) ragged-all-to-all-start(%x, %out, %o, %o, %o, %o), channel_id=1, replica_groups={{{{{ids}}}}}
  ROOT %ragged-all-to-all-done = bf16[2048,512]{{1,0}} ragged-all-to-all-done(%ragged-all-to-all-start)
}}
"""


def test_a_ragged_all_to_all_is_priced_as_an_exchange_not_as_a_kernel():
  """The dropless exchange sends 1024 rows of 1 KiB into a receive buffer sized for 2048: the
  payload is the smaller buffer. Inside a node of 8: the all-to-all formula over NVLink. Over 16
  GPUs in 2 nodes: the half for the other node through the GPU's NIC, 7/16 over NVLink meanwhile.
  Neither is charged as a memory-bound kernel."""
  sent = 1024 * 512 * 2
  node = step_time.predict(_RAGGED.format(n=8, ids=",".join(map(str, range(8)))), H100)
  two = step_time.predict(_RAGGED.format(n=16, ids=",".join(map(str, range(16)))), H100,
                          gpus_per_node=8)
  (col,) = [c for c in hlo.collectives(_RAGGED.format(n=8, ids=",".join(map(str, range(8)))))]
  assert col.kind == "ragged-all-to-all" and col.bytes == sent and col.group_size == 8
  assert node.communication_s == pytest.approx(
      7 / 8 * sent / H100.nvlink_busbw + H100.collective_latency_s)
  assert two.communication_s == pytest.approx(
      max(sent * 8 / 16 / H100.network_busbw_per_gpu, sent * 7 / 16 / H100.nvlink_busbw)
      + H100.network_latency_s)
  for prediction in (node, two):
    assert prediction.compute_s == 0 and prediction.step_s == pytest.approx(
        prediction.communication_s)


@pytest.mark.parametrize("cut, rows, d_model, d_hidden, layers, tflops", [
    ("deepseek_v3_like-4-32", 262144, 7168, 2048, 1, 213), ("qwen3_30b_a3b-4", 262144, 2048, 768,
                                                            4, 202)])
def test_the_grouped_matmul_costs_its_flops_at_the_rate_its_gpu_trace_measured(
    cut, rows, d_model, d_hidden, layers, tflops):
  """The Pallas grouped matmul's calls in a dropless MoE cut's program compiled on the lent H200
  (visit 2026-11-27c), each 2 x rows x d_model x d_hidden FLOPs (forward, recomputed forward, dx
  and dW of gate, up and down: 12 calls per MoE layer), priced at grouped_matmul_fraction; the
  fraction is these FLOPs over the kernels' time in the same run's trace (profiles.py)."""
  run = f"cudnn-selective-{cut}-dropless"
  tar = gpu_predict.visit_artifacts("2026-11-27c")
  text = gpu_predict.run_program(tar, run)
  h200 = hardware.profile_of_device("NVIDIA H200")
  grouped = {name for name, path in hlo.op_names(text).items()
             if step_time.GROUPED_MATMUL.search(path)}
  calls = [o for o in step_time.predict(text, h200, top=100000).top_ops if o["name"] in grouped]
  assert sum(o["count"] for o in calls) == 12 * layers and {o["kind"] for o in calls} == {"gemm"}
  assert all(o["flops"] == 2 * rows * d_model * d_hidden for o in calls)
  flops = sum(o["flops"] * o["count"] for o in calls)
  assert sum(o["total_s"] for o in calls) == pytest.approx(12 * layers * h200.kernel_overhead_s
                                                          + flops / (h200.peak_bf16_flops *
                                                                     h200.grouped_matmul_fraction))
  ms_per_step = gpu_predict.trace_ms_per_step(tar, f"./trace-{run}/")
  traced_s = sum(ms for name, ms in ms_per_step.items() if name.startswith("grouped_matmul")) / 1e3
  assert flops / traced_s / 1e12 == pytest.approx(tflops, abs=1)
  assert flops / traced_s / h200.peak_bf16_flops == pytest.approx(
      h200.grouped_matmul_fraction, rel=0.05)
