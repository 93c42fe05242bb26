"""The analytic minimum of collective bytes per step (sharding/plan/minimum.py) on hand-computed
cases: a tiny model whose counts are worked out in the comments, one axis at a time, then a
composition."""

import dataclasses
import json

import pytest

from benchmarks import step_time_anchors
from benchmarks.anchor_recipes import ANCHORS, anchor_layout, config
from sharding.layout import Layout
from sharding.plan.estimate import ModelSpec, MoESpec, Precision, model_spec
from sharding.plan.minimum import AXES, minimum_bytes, minimum_total

# D 8, 2 layers, 2 heads (= kv heads) of 4, MLP 16, vocab 100, untied:
#   a layer's attention 2 (q, o) x 8 x 2 x 4 + 2 (k, v) x 8 x 2 x 4 = 256, its MLP 3 x 8 x 16 = 384:
#   640 a layer, 1,280 for the two; the tables 2 x 100 x 8 = 1,600; norms 2 x 2 x 8 + 8 = 40.
MODEL = ModelSpec(vocab_size=100, embed_dim=8, num_layers=2, num_heads=2, num_kv_heads=2,
                  head_dim=4, mlp_dim=16)
SHARDABLE, NORMS = 1_280 + 1_600, 40
# bf16 parameters and activations, float32 gradients (the fields the minimum reads); FSDP
# reduce-scatters the gradients as the bf16 matmuls give them (2 bytes).
PRECISION = Precision("test", param_bytes=2, master_bytes=0, grad_bytes=4, grad_accum_bytes=0,
                      opt_bytes=0, act_bytes=2)
SEQ = 16


def bytes_of(**layout) -> dict[str, float]:
  return minimum_bytes(MODEL, Layout(**layout), SEQ, PRECISION)


def only(got: dict, **want: float) -> None:
  """The axes named carry these bytes, every other axis none."""
  assert set(want) <= set(AXES)
  assert got == pytest.approx({axis: want.get(axis, 0.0) for axis in AXES})


def test_one_device_moves_nothing():
  only(bytes_of())
  assert minimum_total(MODEL, Layout(), SEQ, PRECISION) == 0


def test_data_parallelism_all_reduces_the_gradients_once_per_step():
  # 4 replicas, 3 microbatches: one all-reduce of all 2,920 gradients, 2 x 3/4 x 2,920 x 4 bytes.
  only(bytes_of(data=4, microbatches=3), data=2 * 0.75 * (SHARDABLE + NORMS) * 4)


def test_zero1_reduce_scatters_the_gradients_and_gathers_the_parameters():
  # 3/4 x 2,920 x 4 (gradients) + 3/4 x 2,920 x 2 (updated parameters), once per step; ZeRO-2
  # reduce-scatters the gradients every microbatch (here 3).
  both = 0.75 * (SHARDABLE + NORMS)
  only(bytes_of(data=4, zero_stage=1, microbatches=3), data=both * 4 + both * 2)
  only(bytes_of(data=4, zero_stage=2, microbatches=3), data=3 * both * 4 + both * 2)


def test_fsdp_gathers_each_weight_twice_and_reduce_scatters_it_once_per_microbatch():
  # 4 shards, 2 microbatches: 2 x 3/4 x 2,880 x (2 + 2 + 2); the norms are not sharded, their
  # gradients all-reduced over no replica (fsdp is not one).
  only(bytes_of(fsdp=4, microbatches=2), fsdp=2 * 0.75 * SHARDABLE * (2 * 2 + 2))


def test_fsdp_moves_float32_weights_and_gradients_in_the_bf16_compute_dtype():
  # float32 parameters and gradients, bf16 compute: the gathers move 2 bytes an element (the
  # cast runs before the gather), the reduce-scatters too (the bf16 matmul's gradients); with
  # float32 compute, 4 each.
  mixed = dataclasses.replace(PRECISION, param_bytes=4, grad_bytes=4, act_bytes=2)
  only(minimum_bytes(MODEL, Layout(fsdp=4), SEQ, mixed), fsdp=0.75 * SHARDABLE * (2 * 2 + 2))
  full = dataclasses.replace(mixed, act_bytes=4)
  only(minimum_bytes(MODEL, Layout(fsdp=4), SEQ, full), fsdp=0.75 * SHARDABLE * (2 * 4 + 4))


def test_zero3_is_fsdp_over_data_too():
  assert bytes_of(data=2, fsdp=2, zero_stage=3) == bytes_of(fsdp=4)


def test_fsdp_with_the_vocab_split_leaves_the_tables_ungathered():
  # Tiny fsdp groups (vocab_over_fsdp "on"): the 1,600 table elements are not gathered.
  split = bytes_of(fsdp=4, vocab_over_fsdp="on")["fsdp"]
  assert split == pytest.approx(0.75 * 1_280 * (2 * 2 + 2))
  assert split < bytes_of(fsdp=4, vocab_over_fsdp="off")["fsdp"]


def test_hsdp_reduces_the_fsdp_shard_over_data():
  # fsdp 2: each device reduces its half of the shardable gradients (1,440) and the norms (40)
  # over the 2 data replicas: 2 x 1/2 x 1,480 x 4; fsdp as above over a group of 2.
  got = bytes_of(data=2, fsdp=2)
  only(got, fsdp=0.5 * SHARDABLE * 6, data=2 * 0.5 * (SHARDABLE / 2 + NORMS) * 4)


def test_tensor_parallelism_all_reduces_four_activations_a_layer():
  # tensor 2: a microbatch of 1 sequence has 16 tokens x 8 x 2 bytes = 256 bytes of activations;
  # (4 x 2 layers + 2) all-reduces of 2 x 1/2 x 256; full recomputation adds 2 a layer.
  # Tensor splits the weights: no gradient to reduce over it.
  act = 16 * 8 * 2
  only(bytes_of(tensor=2), tensor=10 * 2 * 0.5 * act)
  only(bytes_of(tensor=2, remat="full"), tensor=14 * 2 * 0.5 * act)
  # Sequence parallelism: an all-gather and a reduce-scatter in place of each all-reduce.
  assert bytes_of(tensor=2, sequence_parallel=True) == bytes_of(tensor=2)


def test_context_parallelism_passes_the_kv_blocks_three_times_a_layer():
  # context 4: 4 tokens a device; K and V of 2 heads x 4 each: 4 x 2 x 8 x 2 bytes = 128 bytes a
  # hop, 3 hops, 3 passes, 2 layers; the gradients are all-reduced over the 4 context shards.
  got = bytes_of(context=4)
  only(got, context=2 * 3 * 3 * 128, data=2 * 0.75 * (SHARDABLE + NORMS) * 4)


def test_ulysses_exchanges_q_k_v_and_the_output_forward_and_backward():
  # Ulysses over context 2: q, k, v and the output of 8 tokens, 2 + 2 heads x (4 + 4) x 2 bytes
  # = 512 bytes forward, their gradients backward: 2 x 512 x 1/2 a layer.
  ulysses = dataclasses.replace(MODEL, context_impl="ulysses")
  got = minimum_bytes(ulysses, Layout(context=2), SEQ, PRECISION)
  assert got["context"] == pytest.approx(2 * 2 * 512 * 0.5)


def test_pipeline_sends_each_microbatchs_activations_and_gradients():
  # 2 stages, 4 microbatches: 2 x 4 sends of 256 bytes (a middle stage's share: both ways); each
  # stage holds one layer and no gradient is reduced (its weights are its own). With 2 chunks a
  # stage (4 layers on 2 x 2 positions) each microbatch crosses twice as many boundaries.
  only(bytes_of(pipeline=2, microbatches=4), pipeline=2 * 4 * 256)
  deep = dataclasses.replace(MODEL, num_layers=4)
  interleaved = minimum_bytes(deep, Layout(pipeline=2, microbatches=4, virtual_stages=2,
                                           pipeline_schedule="interleaved_1f1b"), SEQ, PRECISION)
  assert interleaved["pipeline"] == 2 * 4 * 2 * 256


def test_expert_parallelism_exchanges_the_routed_tokens_and_spares_the_experts_gradients():
  # 4 experts of width 16, top-2, in both layers; expert 2 (each device holds 2 experts): the 16
  # tokens' 2 copies (16 x 2 x 8 x 2 bytes = 512) to their experts and back, forward and
  # backward: 4 x 1/2 x 512 a layer. The gradients of attention (256 a layer), the router (8 x 4
  # a layer), the tables and the norms (1,640) are all-reduced over the 2 expert ranks; the
  # experts' own (4 x 384 a layer, 2 of them a device) are not.
  moe = dataclasses.replace(MODEL, moe=MoESpec(num_experts=4, experts_per_token=2,
                                               expert_mlp_dim=16))
  got = minimum_bytes(moe, Layout(expert=2), SEQ, PRECISION)
  assert got["expert"] == pytest.approx(2 * 4 * 0.5 * 512)
  assert got["data"] == pytest.approx(2 * 0.5 * (2 * (256 + 32) + 1_600 + NORMS) * 4)


def test_zero2_reduce_scatters_every_microbatch_over_the_expert_replicas_too():
  # ZeRO splits over data x context x expert (sharding.rules.ZERO_AXES): at expert 2 with 3
  # microbatches, ZeRO-2 reduce-scatters the shared weights' gradients (the 2,216 above) in each
  # microbatch, 3 x 1/2 x 2,216 x 4, and gathers their updated parameters once, 1/2 x 2,216 x 2;
  # the experts' own gradients stay on their devices. ZeRO-1 moves what the all-reduce does.
  moe = dataclasses.replace(MODEL, moe=MoESpec(num_experts=4, experts_per_token=2,
                                               expert_mlp_dim=16))
  shared = 2 * (256 + 32) + 1_600 + NORMS
  zero2 = minimum_bytes(moe, Layout(expert=2, zero_stage=2, microbatches=3), SEQ, PRECISION)
  assert zero2["data"] == pytest.approx(0.5 * shared * (3 * 4 + 2))
  zero1 = minimum_bytes(moe, Layout(expert=2, zero_stage=1, microbatches=3), SEQ, PRECISION)
  assert zero1["data"] == pytest.approx(2 * 0.5 * shared * 4)


def test_experts_over_expert_and_tensor_exchange_each_devices_sequence_part():
  # expert 2 x tensor 2 with sequence parallelism: the experts split over the 4 devices
  # (sharding.layout.experts_over_tensor) and each device sends its own 8 of the 16 tokens: 4 x
  # 3/4 x 256 a layer; without sequence parallelism the tokens are whole on each tensor device
  # and each expert's hidden dim is split instead: the exchange over the 2 expert devices.
  moe = dataclasses.replace(MODEL, moe=MoESpec(num_experts=4, experts_per_token=2,
                                               expert_mlp_dim=16, dispatch="dropless"))
  folded = minimum_bytes(moe, Layout(expert=2, tensor=2, sequence_parallel=True), SEQ,
                         PRECISION)
  split = minimum_bytes(moe, Layout(expert=2, tensor=2), SEQ, PRECISION)
  assert folded["expert"] == pytest.approx(2 * 4 * 0.75 * 256)
  assert split["expert"] == pytest.approx(2 * 4 * 0.5 * 512)


def test_a_composed_layout_adds_its_axes():
  """fsdp 2 x tensor 2 x pipeline 2, 2 microbatches: each axis as on its own, over its share."""
  got = bytes_of(fsdp=2, tensor=2, pipeline=2, microbatches=2)
  # A stage: 1 layer of 640 / 2 (tensor) = 320, one table 100 x 8 / 2 = 400: 720 shardable.
  assert got["fsdp"] == pytest.approx(2 * 0.5 * 720 * (2 * 2 + 2))
  # Tokens a device: 16 (tensor does not split them): 256 bytes; (4 x 1 layer + 2) all-reduces.
  assert got["tensor"] == pytest.approx(2 * 6 * 2 * 0.5 * 256)
  assert got["pipeline"] == 2 * 2 * 256
  assert got["data"] == 0


def test_the_anchors_table_holds_each_row_to_its_own_context_parallel_algorithm():
  """benchmarks/step_time_anchors.py computes a row's minimum with its compute settings: the
  Ulysses rows' context axis is Ulysses' all-to-alls, not the ring's K/V passes (until the
  twenty-third session it was the ring's, 40% less for Llama-3.1-8B's 8 kv heads). And every
  committed row's minimum is what the code computes for it now."""
  anchors = {a.name: a for a in ANCHORS}
  a = anchors["NeMo Llama-3.1-8B, TP1 CP2, meshtron's Ulysses"]
  cfg = config(a)
  layout = anchor_layout(a)
  ulysses, ring = model_spec(cfg.model, cfg.compute), model_spec(cfg.model)
  assert (ulysses.context_impl, ring.context_impl) == ("ulysses", "ring")
  mine = step_time_anchors.minimum_fields(a, layout, 1.0)["minimum_bytes"]
  precision = cfg.precision()
  assert mine == minimum_bytes(ulysses, layout, a.seq_len, precision)
  # 32 microbatches x 32 layers x 2 passes (the forward's 4 all-to-alls, the backward's 4) x 1/2
  # sent of 4,096 tokens x (32 + 8 heads) x (128 + 128) x 2 bytes (q and k, v and the output);
  # the ring's 3 passes of K and V over 1 hop: 3 x 4,096 tokens x 8 kv heads x 256 x 2 bytes.
  assert mine["context"] == 32 * 32 * 2 * 0.5 * 4096 * 40 * 256 * 2
  assert minimum_bytes(ring, layout, a.seq_len, precision)["context"] == \
      32 * 32 * 3 * 4096 * 8 * 256 * 2
  for line in open(step_time_anchors.RESULTS):
    row = json.loads(line)
    if row["status"] != "compiled":
      continue
    b = anchors[row["anchor"]]
    want = step_time_anchors.minimum_fields(b, anchor_layout(b), row["collective_bytes"])
    assert row["minimum_total_bytes"] == pytest.approx(want["minimum_total_bytes"]), b.name
