"""GPU profiles and the step-time model: FLOPs, the collectives a layout sends, and their time."""

import dataclasses
import json
import math
import os

from sharding.pipeline import schedules
from sharding.layout import Layout
from sharding.mesh import AXES
from sharding.plan import context_parallel
from sharding.plan.estimate import Precision, memory, model_spec, param_counts, stage_layers

# nanotron (the playbook's benchmarks) nests ranks as (pp, dp, tp): data parallelism inside nodes.
NANOTRON_ORDER = ("pipeline", "data", "fsdp", "expert", "context", "tensor")
# Gradients travel in buckets (nanotron's and PyTorch DDP's 25 MB): one ring per bucket.
BUCKET_BYTES = 25e6


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
  """One GPU model in a cluster. Peak numbers are dense (no sparsity) spec-sheet values; the
  efficiency and overlap factors are calibrated (see tests/test_planner.py for the points)."""

  name: str
  memory_bytes: float
  peak_bf16_flops: float
  peak_fp8_flops: float
  hbm_bandwidth: float  # bytes/s
  intra_node_bandwidth: float  # NVLink, bytes/s per GPU per direction
  inter_node_bandwidth: float  # NIC bytes/s per GPU per direction
  gpus_per_node: int = 8
  matmul_efficiency: float = 0.40  # fraction of peak the layers' matmuls reach
  collective_efficiency: float = 0.8  # fraction of link bandwidth a ring collective reaches
  intra_latency_s: float = 25e-6  # per ring step
  inter_latency_s: float = 8e-6
  layer_overhead_s: float = 60e-6  # kernel launches and small ops per layer pass
  # Per microbatch hop between pipeline stages on different nodes: the playbook's cross-node
  # pipeline runs lose far more time than their bytes explain (blocking sends per microbatch).
  pipeline_hop_s: float = 8e-3
  # Fraction of each kind of communication hidden behind compute.
  overlap: tuple = (("grad_sync", 0.8), ("param_sync", 0.0), ("zero3", 0.8), ("tensor", 0.2),
                    ("context", 0.8), ("pipeline", 0.5), ("expert", 0.0))
  # ---- the compiled-program model (sharding/xla/step_time.py); each value's source below ----
  gemm_peak_fraction: float = 0.807  # of the peak (bf16, or fp8 for f8 GEMMs) a large GEMM reaches
  flash_triton_fraction: float = 0.35  # of peak, a Triton (Pallas) flash-attention kernel
  flash_cudnn_fraction: float = 0.60  # of peak, cuDNN's fused attention
  copy_bandwidth: float = 3.0e12  # bytes/s read + written by a memory-bound kernel
  kernel_overhead_s: float = 3e-6  # per kernel launch
  nvlink_busbw: float = 460e9  # bus bandwidth of a collective inside a node, bytes/s
  network_busbw_per_gpu: float = 50e9  # bus bandwidth per GPU of a collective across nodes
  collective_latency_s: float = 20e-6  # per collective inside a node
  network_latency_s: float = 30e-6  # per collective across nodes

  def overlap_of(self, phase: str) -> float:
    return dict(self.overlap)[phase]


GIB = 2 ** 30
# Public spec sheets. H100 SXM5: 989 TFLOP/s bf16 and 1979 fp8 dense, 80 GB HBM3 at 3.35 TB/s,
# NVLink 900 GB/s bidirectional (nvidia.com/en-us/data-center/h100); DGX H100: 8x 400 Gb/s
# ConnectX-7, 50 GB/s per GPU (the playbook's cluster: AWS p5, 3200 Gb/s EFA per 8 GPUs).
# H200: same compute, 141 GB HBM3e at 4.8 TB/s (nvidia.com/en-us/data-center/h200).
# A100 80GB SXM: 312 TFLOP/s bf16, no fp8, 2.04 TB/s, NVLink 600 GB/s, 200 Gb/s HDR per GPU
# (nvidia.com/en-us/data-center/a100). B200 (HGX B200): 2.25 PFLOP/s bf16 and 4.5 fp8 dense,
# 180 GB HBM3e at 8 TB/s, NVLink 5 1.8 TB/s, 400 Gb/s per GPU (nvidia.com/en-us/data-center/hgx).
#
# The compiled-program model's constants (fixed before its comparison with published anchors):
# - gemm_peak_fraction: a 8192^3 bf16 matrix product of random data ran at 798 TFLOP/s on this
#   workplace's H100 (device machine notes, 2026-11-13) and 769-798 on its H200 (2026-11-04):
#   798 / 989.4 = 0.807 (H100), 0.80 (H200). A100/B200: the H100 figure, not measured. fp8
#   GEMMs (sharding/xla/step_time.py: cuBLASLt fp8 calls, dots on f8 operands) take the same
#   fraction of peak_fp8_flops, not measured here: a public cuBLASLt e4m3 x e4m3 -> bf16 8192^3
#   benchmark on 16 Hopper SXM GPUs ran at 1,599-1,631 TFLOP/s, 0.81-0.82 of 1,979
#   (gitea.d-robotics.cc/han.zhao/test_gpu_scripts, reports_cublaslt_fp8_crosscheck_20260524.md).
# - flash_triton_fraction: FlashAttention-2 (the Triton/Pallas kernel's algorithm) reaches 35% of
#   an H100's bf16 peak (FlashAttention-3, arXiv:2407.08608, abstract). flash_cudnn_fraction:
#   cuDNN's fused attention about 600 of 989 TFLOP/s at head dim 128 (ibid., Fig. 5), approximate.
# - copy_bandwidth: a device-to-device copy moved 3.0 TB/s (read + write) on this workplace's
#   H100 and 4.3 TB/s on its H200 (device machine notes); A100/B200: 90% of the data sheet.
# - kernel_overhead_s: ~2.5 us of dispatch per kernel (a 24 us kernel took 25.8 us from a CUDA
#   graph, 28.3 us by cuLaunchKernel: dogacel.github.io, 2026-03-14); 3 us here.
# - nvlink_busbw: nccl-tests all_reduce_perf bus bandwidth at large sizes on 8x H100 SXM5,
#   460-480 GB/s (docs.alayanew.com, 2026-05-06); the low end. network_busbw_per_gpu: NVLink +
#   NDR InfiniBand clusters reach 400-450 GB/s of all_reduce bus bandwidth per 8-GPU node
#   (saturncloud.io, Crusoe NCCL validation): 400 / 8 = 50 GB/s per GPU, its NIC's line rate.
# - collective_latency_s, network_latency_s: nccl-tests' small-message all_reduce times on one
#   and on several H100 nodes, about 20 and 30 us; approximate readings.
PROFILES = {
    "h100": HardwareProfile("h100", 80e9, 989.4e12, 1978.9e12, 3.35e12, 450e9, 50e9),
    "h200": HardwareProfile("h200", 141e9, 989.4e12, 1978.9e12, 4.8e12, 450e9, 50e9,
                            gemm_peak_fraction=0.80, copy_bandwidth=4.3e12),
    "a100": HardwareProfile("a100", 80e9, 312e12, 312e12, 2.039e12, 300e9, 25e9,
                            copy_bandwidth=0.9 * 2.039e12, nvlink_busbw=240e9,
                            network_busbw_per_gpu=25e9),
    "b200": HardwareProfile("b200", 180e9, 2250e12, 4500e12, 8e12, 900e9, 50e9,
                            copy_bandwidth=0.9 * 8e12, nvlink_busbw=2 * 460e9),
}


def profile_of_device(device_kind: str) -> HardwareProfile | None:
  """The built-in profile of a JAX device kind (e.g. "NVIDIA H100 80GB HBM3"); None for others
  (CPUs, unknown GPUs)."""
  kind = device_kind.lower()
  return next((p for name, p in PROFILES.items() if name in kind), None)


def load_profile(name_or_path: str) -> HardwareProfile:
  """A built-in profile by name, or a JSON file of HardwareProfile fields (optionally
  `"base": "h100"` to start from a built-in one)."""
  key = name_or_path.strip().lower()
  if key in PROFILES:
    return PROFILES[key]
  if not key.endswith(".json"):
    raise ValueError(f"unknown gpu {name_or_path!r}; use one of {', '.join(PROFILES)} or a"
                     " path/to/profile.json")
  if not os.path.exists(name_or_path):
    raise ValueError(f"hardware profile file {name_or_path} does not exist")
  with open(name_or_path) as f:
    values = json.load(f)
  base = PROFILES.get(values.pop("base", "h100"))
  fields = {f.name for f in dataclasses.fields(HardwareProfile)}
  unknown = set(values) - fields
  if base is None or unknown:
    raise ValueError(f"{name_or_path}: unknown keys {sorted(unknown)} or base; fields:"
                     f" {', '.join(sorted(fields))}")
  if "overlap" in values:
    values["overlap"] = tuple(dict(dict(base.overlap), **values["overlap"]).items())
  return dataclasses.replace(base, **values)


# ---- what a layout sends ----


@dataclasses.dataclass(frozen=True)
class Collective:
  """`count` operations of one kind on one (combination of) mesh axes, per device per step."""

  axes: tuple  # mesh axes of the group
  kind: str  # all-reduce, all-gather, reduce-scatter, all-to-all, p2p
  phase: str  # which overlap factor applies
  payload: float  # bytes of the whole buffer per operation
  count: float
  group: int

  @property
  def wire_bytes(self) -> float:
    """Bytes each device sends (ring formulas, NCCL's PERFORMANCE.md): all-reduce 2(n-1)/n,
    all-gather / reduce-scatter / all-to-all (n-1)/n of the buffer; p2p the buffer."""
    n = self.group
    factor = {"all-reduce": 2 * (n - 1) / n, "p2p": 1.0}.get(self.kind, (n - 1) / n)
    return self.count * self.payload * factor

  @property
  def ring_steps(self) -> float:
    n = self.group
    per_op = 1 if self.kind == "p2p" else (2 if self.kind == "all-reduce" else 1) * (n - 1)
    return self.count * per_op


def ring_hops(m, context: int, seq_len: int) -> float:
  """K/V blocks the ring passes on per layer, mean over the layers: context - 1, or with a sliding
  window (contiguous order: kernels.ring_attention.ring_hops) only the blocks the window reaches;
  with full_attention_every = N, every Nth layer makes every hop."""
  full = context - 1
  if not m.sliding_window:
    return full
  windowed = min(full, -(-(m.sliding_window - 1) // (seq_len // context)))
  share = 1 / m.full_attention_every if m.full_attention_every else 0.0
  return share * full + (1 - share) * windowed


def collectives(model, layout: Layout, seq_len: int, precision: Precision) -> list[Collective]:
  """The communication of one training step on one device (the most loaded stage).

  DP: all-reduce of the gradients once per step (accumulation reduces once); ZeRO-1/2: reduce-
  scatter + all-gather of the parameters (ZeRO-2 reduce-scatters every microbatch); ZeRO-3/FSDP:
  all-gather each layer forward and again backward plus embedding/head once (2Psi_layers +
  Psi_rest) and a reduce-scatter, per microbatch; TP: 4 all-reduces of b s h per layer (+2 when
  recomputing fully); SP: 6 all-gathers + 4 reduce-scatters per layer; CP: K/V blocks passed
  around the ring 3 times (forward, backward K/V and their gradients), Ulysses' 4 all-to-alls per
  layer forward (q, k, v, output) and 4 backward (+4 recomputing fully), the hybrid both over its
  factors; PP: activations forward and gradients backward per microbatch and virtual stage; EP:
  4 all-to-alls per MoE layer.
  """
  m, lay, pr = model_spec(model), layout, precision
  ga = lay.microbatches
  counts = param_counts(m, lay)
  out = []
  # Gradients are reduced in the accumulation dtype when there is one (nanotron: fp32 buffers).
  grads = counts.total * max(pr.grad_bytes, pr.grad_accum_bytes) / lay.fsdp
  params = counts.total * pr.param_bytes / lay.fsdp
  buckets = lambda size: max(1.0, math.ceil(size / BUCKET_BYTES))  # noqa: E731
  # ZeRO splits the state over data x context x expert (sharding.rules.ZERO_AXES; the routed
  # experts' weights over data x context: counted with the others, an upper bound).
  zero_group = lay.data * lay.context * lay.expert
  zero_data = lay.zero_stage in (1, 2) and zero_group > 1
  sync = [(a, n) for a, n in (("data", lay.data), ("context", lay.context),
                              ("expert", lay.expert))
          if n > 1 and lay.zero_stage < 3]
  if zero_data:  # reduce-scatter the gradients, all-gather the updated parameters
    axes = tuple(a for a in ("data", "context", "expert") if getattr(lay, a) > 1)
    n = buckets(grads)
    out.append(Collective(axes, "reduce-scatter", "grad_sync", grads / n,
                          n * (ga if lay.zero_stage == 2 else 1), zero_group))
    n = buckets(params)
    out.append(Collective(axes, "all-gather", "param_sync", params / n, n, zero_group))
    sync = [(a, n) for a, n in sync if a not in axes]
  if sync:
    n = buckets(grads)
    out.append(Collective(tuple(a for a, _ in sync), "all-reduce", "grad_sync", grads / n, n,
                          math.prod(size for _, size in sync)))
  n_z3 = lay.fsdp * (zero_group if lay.zero_stage == 3 else 1)
  tokens = lay.micro_batch * seq_len / lay.context
  act = tokens * m.embed_dim * pr.act_bytes
  if n_z3 > 1:
    axes = ("data", "context", "expert", "fsdp") if lay.zero_stage == 3 else ("fsdp",)
    layers = counts.layers * pr.param_bytes
    # Where the embedding lookup moves token rows (an all-to-all each way; sharding.rules), not
    # the table: only the head (or the tied table as head) is gathered and has its gradient
    # reduced, and neither is with the vocab split over fsdp (models/layers.Embed).
    table = m.vocab_size * m.embed_dim / lay.tensor
    by_rows = lay.moves_lookup_rows(m.vocab_size, seq_len)
    split = lay.splits_vocab(m.vocab_size, seq_len)
    gathered = 0.0 if split else table if by_rows else counts.tables
    local = counts.tables if split else counts.tables - table if by_rows else 0.0
    rest = (gathered + counts.replicated) * pr.param_bytes
    ops = 2 * stage_layers(m, lay) + 1  # each layer forward and backward, the tables once
    out.append(Collective(axes, "all-gather", "zero3", (2 * layers + rest) / ops, ga * ops,
                          n_z3))
    ops = stage_layers(m, lay) + 1
    out.append(Collective(axes, "reduce-scatter", "zero3",
                          (counts.total - local) * pr.grad_bytes / ops, ga * ops, n_z3))
    if by_rows:
      out.append(Collective(("fsdp",), "all-to-all", "zero3", act, 2 * ga, lay.fsdp))
    if by_rows and not split and lay.zero_stage == 3 and lay.data > 1:
      # ZeRO-3 stores the table's embed dim over data x fsdp and the lookup wants it over fsdp:
      # its data shards are gathered, their gradients reduce-scattered, and two permutes reorder
      # the shards between the two device orders (as compiled, e.g. data=2 x fsdp=4).
      shard = table / lay.fsdp
      out.append(Collective(("data",), "all-gather", "zero3", shard * pr.param_bytes, ga,
                            lay.data))
      out.append(Collective(("data",), "reduce-scatter", "zero3", shard * pr.grad_bytes, ga,
                            lay.data))
      out.append(Collective(("data", "fsdp"), "p2p", "zero3", shard / lay.data * pr.param_bytes,
                            2 * ga, n_z3))
    if split:  # the group's hidden states and embedding rows, and their gradients
      group = act * lay.fsdp
      for kind in ("all-gather", "reduce-scatter"):
        out.append(Collective(("fsdp",), kind, "zero3", group, 2 * ga, lay.fsdp))
  layer_passes = ga * stage_layers(m, lay)
  if lay.tensor > 1:
    again = 1 if lay.remat == "full" else 0
    if lay.sequence_parallel:
      out.append(Collective(("tensor",), "all-gather", "tensor", act,
                            layer_passes * (6 + 2 * again) + 2 * ga, lay.tensor))
      out.append(Collective(("tensor",), "reduce-scatter", "tensor", act,
                            layer_passes * (4 + 2 * again) + ga, lay.tensor))
    else:
      out.append(Collective(("tensor",), "all-reduce", "tensor", act,
                            layer_passes * (4 + 2 * again) + 2 * ga, lay.tensor))
  ring, degree = context_parallel.factors(m, lay)
  if ring > 1:  # the ring's hops (the hybrid's over its outer factor, Ulysses' kv heads)
    kv = tokens * context_parallel.attended_kv_heads(m, lay) * (m.head_dim + m.v_head_dim()) * \
        pr.act_bytes
    out.append(Collective(("context",), "p2p", "context", kv,
                          3 * ring_hops(m, ring, seq_len) * layer_passes, ring))
  if degree > 1:  # Ulysses: q, k, v and the output forward, their gradients backward
    again = 1 if lay.remat == "full" else 0
    out.append(Collective(("context",), "all-to-all", "context",
                          context_parallel.ulysses_payload(m, lay, tokens, pr.act_bytes) / 4,
                          (8 + 4 * again) * layer_passes, degree))
  if lay.pipeline > 1:
    sent = act / (lay.tensor if lay.sequence_parallel else 1)
    out.append(Collective(("pipeline",), "p2p", "pipeline", sent,
                          2 * ga * lay.virtual_stages, lay.pipeline))
  if lay.expert > 1 and m.moe:
    routed = act * m.moe.experts_per_token * m.moe_share()
    out.append(Collective(("expert",), "all-to-all", "expert", routed, 4 * layer_passes,
                          lay.expert))
  return out


# ---- how long a step takes ----


def hardware_flops_per_device(model, layout: Layout, seq_len: int,
                              stages_recompute: bool = True) -> float:
  """FLOPs one device executes per step: its share of 6 x active params x tokens and attention
  (stages assumed balanced, as nanotron balances layers and head), plus recomputation
  (selective: the attention scores again, 2 H Dh s per layer and token; full: the forward; and
  with `stages_recompute`, meshtron's pipeline executor, the chunk's forward in its backward)."""
  return sum(flops_split(model, layout, seq_len, stages_recompute))


def flops_split(model, layout: Layout, seq_len: int,
                stages_recompute: bool = True) -> tuple[float, float]:
  """hardware_flops_per_device as (the layers' linear GEMMs, attention scores and the head):
  the first are what fp8 training runs on fp8 tensor cores."""
  m, lay = model_spec(model), layout
  # per model replica, per context shard
  tokens = lay.micro_batch * lay.microbatches * seq_len / lay.context
  per_layer = (m.active_matmul_params() - m.vocab_size * m.embed_dim) / m.num_layers
  attention = m.attention_flops(seq_len)
  forwards = {"none": 0, "selective": 0, "full": 1}[lay.remat]  # linear forwards recomputed
  scores = {"none": 0.0, "selective": attention / 3, "full": attention / 3}[lay.remat]
  if lay.pipeline > 1 and stages_recompute:  # its stash holds chunk inputs only (estimate.memory)
    forwards, scores = forwards + 1, scores + attention / 3
  # The most loaded stage sets the time: uneven stages count their padded share of layers.
  layers = stage_layers(m, lay) * lay.pipeline
  share = tokens / (lay.tensor * lay.pipeline)
  linear = layers * (6 + 2 * forwards) * per_layer
  rest = layers * (attention + scores) + 6 * m.vocab_size * m.embed_dim
  return share * linear, share * rest


def placement(layout: Layout, gpus_per_node: int, order: tuple = AXES) -> dict[str, int]:
  """{axis: how many of its group's members share a node}: inner axes fill a node first, so an
  axis inside a node has all its members there (the group size) and one that spans nodes the
  share of the node its inner axes leave it."""
  members, inner = {}, 1
  for axis in reversed(order):
    size = getattr(layout, axis)
    members[axis] = max(1, min(size, gpus_per_node // inner))
    inner *= size
  return members


@dataclasses.dataclass
class StepTime:
  step_s: float
  compute_s: float
  bubble_s: float
  exposed_comm_s: float
  comm_s: dict  # per phase, before overlap
  tokens_per_s_per_gpu: float
  mfu: float


def step_time(model, layout: Layout, seq_len: int, precision: Precision, hw: HardwareProfile,
              order: tuple = AXES, stages_recompute: bool = True) -> StepTime:
  """Predicted time of one optimizer step: compute at the calibrated matmul efficiency, every
  collective at link bandwidth (intra- or inter-node by placement) plus ring latency, overlap per
  kind, the pipeline bubble of the schedule's tick table (schedules.bubble_ratio) and the
  optimizer update at HBM bandwidth. `stages_recompute`: as in hardware_flops_per_device (False
  for trainers whose stages store activations, nanotron's in the playbook's sweep)."""
  m, lay = model_spec(model), layout
  peak = hw.peak_fp8_flops if precision.act_bytes == 1 else hw.peak_bf16_flops
  # fp8 training's layer GEMMs run on the fp8 tensor cores (2x the bf16 peak on an H100), as
  # the compiled-program model prices dots on f8 operands; attention scores and the head in bf16.
  linear_peak = hw.peak_fp8_flops if precision.fp8_layers else peak
  linear, rest = flops_split(m, lay, seq_len, stages_recompute)
  passes = 3 * lay.microbatches * lay.virtual_stages * stage_layers(m, lay)
  compute = (linear / linear_peak + rest / peak) / hw.matmul_efficiency + \
      passes * hw.layer_overhead_s
  members = placement(lay, hw.gpus_per_node, order)
  comm, stage_exposed, dp_exposed, hidden = {}, 0.0, 0.0, 0.0
  for c in collectives(m, lay, seq_len, precision):
    per_node = math.prod(members[a] for a in c.axes)
    inside = per_node == c.group
    # Across nodes NCCL runs one ring per NIC: a group with k members on each node crosses
    # between nodes over k NICs at once, so its bus bandwidth is k NICs' (NVLink at most), as
    # in the compiled-program model (sharding/xla/step_time.py) and nccl-tests' 400-450 GB/s of
    # all-reduce bus bandwidth for a group of whole 8-GPU nodes (see the profiles above).
    link = min(hw.intra_node_bandwidth, per_node * hw.inter_node_bandwidth)
    bw = (hw.intra_node_bandwidth if inside else link) * hw.collective_efficiency
    latency = hw.intra_latency_s if inside else (
        hw.pipeline_hop_s if c.phase == "pipeline" else hw.inter_latency_s)
    t = c.wire_bytes / bw + c.ring_steps * latency
    comm[c.phase] = comm.get(c.phase, 0.0) + t
    o = hw.overlap_of(c.phase)
    hidden += o * t
    if c.phase in ("grad_sync", "param_sync", "zero3"):
      dp_exposed += (1 - o) * t
    else:
      stage_exposed += (1 - o) * t
  stage = compute + stage_exposed
  bubble = stage * schedules.bubble_ratio(lay.pipeline_schedule, lay.pipeline, lay.microbatches,
                                          lay.virtual_stages)
  mem = memory(m, lay, seq_len, precision, workspace_bytes=0)
  optimizer = 2 * mem.state / hw.hbm_bandwidth  # read and write params, grads, moments
  exposed = stage_exposed + dp_exposed + max(0.0, hidden - compute)
  total = stage + bubble + dp_exposed + max(0.0, hidden - compute) + optimizer
  tokens = lay.global_batch * seq_len
  model_flops = m.flops_per_token(seq_len) * tokens / lay.num_devices
  return StepTime(total, compute, bubble, exposed, comm, tokens / total / lay.num_devices,
                  model_flops / (total * peak))


def gpu_summary(hw: HardwareProfile) -> str:
  return (f"{hw.name}: {hw.memory_bytes / 1e9:.0f} GB, {hw.peak_bf16_flops / 1e12:.0f} TFLOP/s"
          f" bf16, NVLink {hw.intra_node_bandwidth / 1e9:.0f} GB/s, network"
          f" {hw.inter_node_bandwidth / 1e9:.0f} GB/s per GPU, {hw.gpus_per_node} per node")
