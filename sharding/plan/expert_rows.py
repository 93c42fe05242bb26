"""The rows a dropless MoE layer's experts run over, and the buffers the batched experts hold for
them: what the time model (hardware.py, memory_bound.py) and the memory estimate (estimate.py)
both read. Functions of an estimate.ModelSpec (this module imports no estimate, which imports it).
"""

import math

from sharding.layout import Layout, experts_over_tensor


def exchange_group(m, layout: Layout) -> tuple[tuple[str, ...], int, float]:
  """(mesh axes, devices, share of a microbatch's tokens on a device that it routes) of the
  MoE's token exchange: over `expert`, and over `tensor` too where the experts span it
  (sharding.layout.experts_over_tensor), each device then routing its own sequence part."""
  if not m.moe:
    return (), 1, 1.0
  folded = experts_over_tensor(layout, m.moe.num_experts, m.moe.dispatch)
  axes = ("expert", "tensor") if folded else ("expert",)
  return axes, math.prod(getattr(layout, a) for a in axes), 1 / layout.tensor if folded else 1.0


# The grouped matmuls that run the experts as batched GEMMs over equal slots per expert
# (kernels/capacity_matmul.py; models/slot_experts.py runs the whole SwiGLU on the slots).
BATCHED = ("capacity", "slots")


def batched(moe) -> bool:
  """Whether the model's experts run as batched GEMMs over slots (priced as dense GEMMs)."""
  return bool(moe) and moe.grouped_matmul in BATCHED


def grouped_rows_ratio(m, layout: Layout) -> float:
  """Rows the grouped matmul runs over per routed row: with the experts split over `expert`, the
  exchange's receive buffer, `exchange_capacity` x a device pair's balanced share from each peer
  (0: the worst case), as sharding/expert.py sizes it; the compiled-program model prices the
  kernel over all its buffer's rows. Without: 1, or batched GEMMs' slots (models/moe.py)."""
  _, n, _ = exchange_group(m, layout)
  if n <= 1:
    e = m.moe.num_experts if batched(m.moe) else 1
    return min(e, m.moe.exchange_capacity or e) if e > 1 else 1.0
  k = m.moe.experts_per_token
  worst = n * min(k, m.moe.num_experts // n) / k
  return min(worst, m.moe.exchange_capacity) if m.moe.exchange_capacity else worst


# The slot buffers the batched experts' backward holds at its peak, per slot row, in hidden-width
# (D) and expert-width (F) rows: read from meshtron's compiled H100 programs, not derived from the
# code (tests/test_estimate_slots.py: the peak's growth with the slots, exact in bf16; XLA held 4
# D-wide ones at tensor=2). 2 of the D-wide ones counted in the GEMMs' dtype (1 byte under fp8),
# as the gathered GEMM inputs are.
SLOT_ROWS_D, SLOT_ROWS_F, SLOT_INPUTS_D = 5, 3, 2
# The same read for moe.grouped_matmul=slots (models/slot_experts.py; a round's backward holds the
# SwiGLU's F-wide intermediates and their gradients in the slots, one D-wide buffer): D- and
# F-wide rows in the compute dtype, and under fp8 more of 1 byte. Growth estimate / compiled
# (tests/test_estimate_slots.py): bf16 1.03 (F 512: 1.08), fp8 tensorwise 1.20.
WHOLE_ROWS_D, WHOLE_ROWS_F, WHOLE_FP8_D, WHOLE_FP8_F = 1, 8, 2, 3


def slot_bytes(m, layout: Layout, tokens: float, act_bytes: int, fp8: bool) -> float:
  """Bytes of the slot buffers one MoE layer's backward holds at once under
  moe.grouped_matmul=capacity (kernels/capacity_matmul.py) or slots (models/slot_experts.py;
  its own counts, WHOLE_*): [experts, slots, width] gathers of
  the rows, grouped_rows_ratio x the routed rows (`exchange_capacity` x them where every expert
  is on the device; the exchange's buffer where one sized it). `tokens`: a device's microbatch
  tokens; the experts' width split over `tensor` unless the experts span it. 0 otherwise: the
  grouped kernel reads the rows in place."""
  moe = m.moe
  if not moe or moe.dispatch != "dropless" or not batched(moe) or \
      m.moe_share() == 0:
    return 0.0
  _, _, share = exchange_group(m, layout)
  rows = grouped_rows_ratio(m, layout) * tokens * share * moe.experts_per_token
  width = moe.expert_mlp_dim / (1 if share < 1 else layout.tensor)
  if moe.grouped_matmul == "slots":
    return rows * (m.embed_dim * (WHOLE_ROWS_D * act_bytes + WHOLE_FP8_D * fp8) +
                   width * (WHOLE_ROWS_F * act_bytes + WHOLE_FP8_F * fp8))
  inputs = 1 if fp8 else act_bytes
  per_row = m.embed_dim * (SLOT_INPUTS_D * inputs + (SLOT_ROWS_D - SLOT_INPUTS_D) * act_bytes) \
      + SLOT_ROWS_F * width * act_bytes
  return rows * per_row
