"""The analytic step time of a MoE (sharding/plan/hardware.py) against hand-computed values: the
token exchange across nodes through each GPU's NIC, and dropless MoE's routed experts at the
grouped matmul's measured rate.

The small MoE: V=100, D=16, L=2, H=4, K=2, Dh=4, 8 experts of width 8, top-2, no dense layer.
By hand: attention 768 per layer, router 16*8 = 128, top-2 routed experts 2*3*16*8 = 768: a
layer's active linear weights 1664, of which the routed experts' 768.
"""

import dataclasses

import pytest

from sharding.layout import Layout
from sharding.plan import hardware, memory_bound
from sharding.plan.estimate import ModelSpec, MoESpec, model_spec, trainer_precision

MOE = ModelSpec(vocab_size=100, embed_dim=16, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=4, mlp_dim=32, moe=MoESpec(num_experts=8, experts_per_token=2,
                                                    expert_mlp_dim=8))
DROPLESS = dataclasses.replace(MOE, moe=dataclasses.replace(MOE.moe, dispatch="dropless"))
SEQ = 8
H100 = hardware.PROFILES["h100"]
PRECISION = trainer_precision("bfloat16")


def test_the_routed_share_of_the_linear_flops_by_hand():
  assert MOE.expert_params(per_token=True) == 768 and MOE.expert_params() == 3072
  assert MOE.active_matmul_params() - 100 * 16 == 2 * 1664
  assert hardware.grouped_share(DROPLESS) == pytest.approx(768 / 1664)
  assert hardware.grouped_share(MOE) == 0.0  # dropping dispatch: dense GEMMs over buffers


def test_the_model_config_s_dispatch_reaches_the_spec():
  from configs import moe
  cfg = moe.debug_moe()
  cfg.model.moe = dataclasses.replace(cfg.model.moe, dispatch="dropless")
  assert model_spec(cfg.model).moe.dispatch == "dropless"


def test_dropless_experts_run_at_the_grouped_matmul_s_rate():
  """Only the routed experts' FLOPs change: at grouped_matmul_fraction of the bf16 peak where
  the dense GEMMs reach gemm_peak_fraction (under the fitted uniform efficiency of the
  playbook's runs, that ratio times as long as the efficiency gives)."""
  layout = Layout(micro_batch=2, microbatches=1)
  dropping = hardware.step_time(MOE, layout, SEQ, PRECISION, H100)
  dropless = hardware.step_time(DROPLESS, layout, SEQ, PRECISION, H100)
  linear, _ = hardware.flops_split(MOE, layout, SEQ)
  routed = linear * 768 / 1664
  slower = H100.gemm_peak_fraction / H100.grouped_matmul_fraction
  extra = routed / H100.peak_bf16_flops * (slower - 1) / H100.gemm_peak_fraction
  assert slower > 3.5  # the kernel measured 0.21 of the peak, dense GEMMs 0.807
  assert dropless.compute_s == pytest.approx(dropping.compute_s + extra)
  dropping, dropless = (hardware.step_time(m, layout, SEQ, PRECISION, H100, uniform_matmuls=True)
                        for m in (MOE, DROPLESS))
  extra = routed / H100.peak_bf16_flops * (slower - 1) / H100.matmul_efficiency
  assert dropless.compute_s == pytest.approx(dropping.compute_s + extra)



def test_experts_as_batched_gemms_run_at_the_dense_gemms_rate():
  """moe.grouped_matmul=capacity (kernels/capacity_matmul.py): the routed experts' matmuls at
  the dense GEMMs' rate, as the dropping dispatch's, over their slots: with every expert on the
  device, `exchange_capacity` x the balanced share (models/moe.Experts.slots): at 1, dropping's
  matmul seconds; at the default 2, the routed FLOPs twice. The memory-bound kernels add the
  slots' gathers (memory_bound.py)."""
  layout = Layout(micro_batch=2, microbatches=1)
  linear, _ = hardware.flops_split(MOE, layout, SEQ)
  routed, peak = linear * 768 / 1664, H100.peak_bf16_flops
  dropping = hardware.matmul_seconds(MOE, layout, SEQ, H100, linear, peak)
  for headroom, extra in ((1.0, 0.0), (2.0, routed / (peak * H100.gemm_peak_fraction))):
    for kernel in ("capacity", "slots"):  # the slots: the same GEMMs, the SwiGLU whole on them
      batched = dataclasses.replace(DROPLESS, moe=dataclasses.replace(
          DROPLESS.moe, grouped_matmul=kernel, exchange_capacity=headroom))
      assert hardware.grouped_rows_ratio(batched, layout) == headroom
      assert hardware.matmul_seconds(batched, layout, SEQ, H100, linear, peak) == \
          pytest.approx(dropping + extra)
  plain = hardware.step_time(DROPLESS, layout, SEQ, PRECISION, H100)
  assert hardware.step_time(batched, layout, SEQ, PRECISION, H100).memory_bound_s > \
      plain.memory_bound_s  # twice the rows, and their gathers
  assert model_spec(batched).moe.grouped_matmul == kernel == "slots"


@pytest.mark.parametrize("expert, per_node", [(16, 8), (64, 8)])
def test_an_exchange_across_nodes_leaves_through_each_gpu_s_nic(expert, per_node):
  """expert=16 or 64 on 8-GPU nodes: of each exchange's buffer, (n - 8)/n goes to other nodes
  over the GPU's own NIC (50 GB/s at the collective efficiency), not over the node's 8 NICs as a
  ring would; 7/n over NVLink at the same time. One latency per exchange."""
  layout = Layout(expert=expert, micro_batch=1, microbatches=4)
  exchange = next(c for c in hardware.collectives(MOE, layout, SEQ, PRECISION)
                  if c.phase == "expert")
  buffer, n = exchange.count * exchange.payload, expert
  network = buffer * (n - per_node) / n / (H100.inter_node_bandwidth * H100.collective_efficiency)
  nvlink = buffer * (per_node - 1) / n / (H100.intra_node_bandwidth *
                                          H100.collective_efficiency)
  by_hand = max(network, nvlink) + exchange.count * H100.inter_latency_s
  st = hardware.step_time(MOE, layout, SEQ, PRECISION, H100)
  assert st.comm_s["expert"] == pytest.approx(by_hand)
  ring = exchange.wire_bytes / (min(H100.intra_node_bandwidth, per_node *
                                    H100.inter_node_bandwidth) * H100.collective_efficiency)
  assert st.comm_s["expert"] > 3 * ring  # what the ring formula charged before


def test_an_exchange_inside_a_node_keeps_the_nvlink_ring():
  layout = Layout(expert=8, micro_batch=1, microbatches=4)
  exchange = next(c for c in hardware.collectives(MOE, layout, SEQ, PRECISION)
                  if c.phase == "expert")
  st = hardware.step_time(MOE, layout, SEQ, PRECISION, H100)
  assert st.comm_s["expert"] == pytest.approx(
      exchange.wire_bytes / (H100.intra_node_bandwidth * H100.collective_efficiency)
      + exchange.ring_steps * H100.intra_latency_s)


@pytest.mark.parametrize("expert, capacity, rows", [(4, 2.0, 2.0), (4, 1.0, 1.0), (4, 0.0, 4.0),
                                                     (8, 0.0, 4.0), (8, 9.0, 4.0), (1, 2.0, 1.0)])
def test_the_grouped_matmul_runs_over_the_exchange_buffers_rows(expert, capacity, rows):
  """sharding/expert.py sizes a peer's rows at exchange_capacity x the balanced share, top-2 of
  8 experts: worst case (capacity 0, or above it) every assignment of a peer to this device,
  min(2, 8 / n) of a token's 2 copies from each of n peers: n x min(2, 8/n) / 2 = 4 rows per
  routed row on 4 or 8 devices. Without `expert` the rows are the device's own. The routed
  experts' time grows by that ratio, their matmuls' and their SwiGLU's memory-bound passes
  (sharding/plan/memory_bound.py), nothing else does."""
  spec = dataclasses.replace(DROPLESS, moe=dataclasses.replace(DROPLESS.moe,
                                                               exchange_capacity=capacity))
  layout = Layout(expert=expert, micro_batch=expert, microbatches=1)
  assert hardware.grouped_rows_ratio(spec, layout) == rows
  balanced = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, exchange_capacity=1.0))
  padded, exact = (hardware.step_time(m, layout, SEQ, PRECISION, H100) for m in (spec, balanced))
  linear, _ = hardware.flops_split(spec, layout, SEQ)
  routed = linear * hardware.grouped_share(spec)
  extra = routed * (rows - 1) / (H100.peak_bf16_flops * H100.grouped_matmul_fraction)
  extra += memory_bound.memory_bound_seconds(spec, layout, SEQ, PRECISION, H100, True, rows) - \
      memory_bound.memory_bound_seconds(spec, layout, SEQ, PRECISION, H100, True, 1.0)
  assert (rows > 1) == (extra > 0)
  assert padded.compute_s - exact.compute_s == pytest.approx(extra)
  assert padded.comm_s == exact.comm_s


def test_the_model_config_s_exchange_capacity_reaches_the_spec():
  from configs import moe
  cfg = moe.debug_moe()
  assert model_spec(cfg.model).moe.exchange_capacity == cfg.model.moe.exchange_capacity == 2.0
  cfg.model.moe = dataclasses.replace(cfg.model.moe, exchange_capacity=1.5)
  assert model_spec(cfg.model).moe.exchange_capacity == 1.5


@pytest.mark.parametrize("mesh, remat, recompute, per_layer", [
    (dict(), "none", True, 4), (dict(), "full", True, 6),
    (dict(pipeline=2), "selective", True, 6), (dict(pipeline=2), "selective", False, 4)])
def test_a_recomputed_forward_exchanges_its_tokens_again(mesh, remat, recompute, per_layer):
  """The exchange's all-to-alls per MoE layer and microbatch, by hand: dispatch and combine
  forward, their transposes backward (4), and again in a forward that remat=full or meshtron's
  pipeline executor (stages_recompute) runs a second time (6): the DeepSeek-V3 recipe's program
  runs 8 exchanges in a 2-MoE-layer chunk's forward tick and 16 in its backward tick."""
  layout = Layout(expert=4, micro_batch=1, microbatches=4, remat=remat, **mesh)
  exchange = next(c for c in hardware.collectives(MOE, layout, SEQ, PRECISION, recompute)
                  if c.phase == "expert")
  layers = MOE.num_layers // mesh.get("pipeline", 1)
  assert exchange.count == per_layer * 4 * layers
