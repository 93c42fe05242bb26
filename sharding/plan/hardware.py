"""The analytic step-time model: FLOPs, the collectives a layout sends, and their time, on a GPU
profile (sharding/plan/profiles.py; its names are re-exported here for the planner's callers)."""

import dataclasses
import math

from sharding.pipeline import schedules
from sharding.layout import Layout
from sharding.mesh import AXES
from sharding.plan import context_parallel, memory_bound
from sharding.plan.expert_rows import batched, exchange_group, grouped_rows_ratio
from sharding.plan.estimate import (Precision, model_spec, param_counts, stage_layers,
                                    state_bytes)
from sharding.plan.profiles import (GIB, PROFILES, HardwareProfile,  # noqa: F401
                                    load_profile, profile_of_device)

# nanotron (the playbook's benchmarks) nests ranks as (pp, dp, tp): data parallelism inside nodes.
NANOTRON_ORDER = ("pipeline", "data", "fsdp", "expert", "context", "tensor")
# Gradients travel in buckets (nanotron's and PyTorch DDP's 25 MB): one ring per bucket.
BUCKET_BYTES = 25e6


# ---- what a layout sends ----


@dataclasses.dataclass(slots=True)  # not frozen: `plan` builds ~10^5 of them a search
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


def collectives(model, layout: Layout, seq_len: int, precision: Precision,
                stages_recompute: bool = True) -> list[Collective]:
  """The communication of one training step on one device (the most loaded stage).

  DP: all-reduce of the gradients once per step (accumulation reduces once); ZeRO-1/2: reduce-
  scatter + all-gather of the parameters (ZeRO-2 reduce-scatters every microbatch); ZeRO-3/FSDP:
  all-gather each layer forward and again backward plus embedding/head once (2Psi_layers +
  Psi_rest) and a reduce-scatter, per microbatch; TP: 4 all-reduces of b s h per layer (+2 when
  recomputing fully); SP: 6 all-gathers (4 in fp8: Precision.fp8_gathers) + 4 reduce-scatters per
  layer; CP: K/V blocks passed around the ring 3 times (forward, backward K/V and their
  gradients), Ulysses' 4 all-to-alls per layer forward (q, k, v, output) and 4 backward (+4
  recomputing fully), the hybrid both over its factors; PP: activations forward and gradients
  backward per microbatch and virtual stage; EP: 4 all-to-alls per MoE layer (+2 recomputing
  fully). `stages_recompute` (meshtron's pipeline executor): the forward each backward
  recomputes sends its TP/SP, Ulysses and EP collectives again, as full remat's does
  (DeepSeek-V3's stages: 8 exchanges a 2-MoE-layer chunk forward, 16 backward).
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
  sync = [(a, n) for a, n in (("data", lay.data), ("context", lay.context), ("expert", lay.expert))
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
    out.append(Collective(axes, "all-gather", "zero3", (2 * layers + rest) / ops, ga * ops, n_z3))
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
  remat = lay.stage_remat(m.num_layers, stages_recompute)
  again = int(remat == "full") + int(lay.stages_recompute(stages_recompute))  # forwards rerun
  if lay.tensor > 1:
    if lay.sequence_parallel:  # fp8_gathers: a layer's 4 (2 inputs, 2 output gradients), 1 byte
      gathers, gathered = (4, act / pr.act_bytes) if pr.fp8_gathers else (6, act)
      out.append(Collective(("tensor",), "all-gather", "tensor", gathered,
                            layer_passes * (gathers + 2 * again), lay.tensor))
      out.append(Collective(("tensor",), "all-gather", "tensor", act, 2 * ga, lay.tensor))
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
                          3 * context_parallel.ring_hops(m, ring, seq_len) * layer_passes, ring))
  if degree > 1:  # Ulysses: q, k, v and the output forward, their gradients backward
    out.append(Collective(("context",), "all-to-all", "context",
                          context_parallel.ulysses_payload(m, lay, tokens, pr.act_bytes) / 4,
                          (8 + 4 * again) * layer_passes, degree))
  if lay.pipeline > 1:
    sent = act / (lay.tensor if lay.sequence_parallel else 1)
    out.append(Collective(("pipeline",), "p2p", "pipeline", sent,
                          2 * ga * lay.virtual_stages, lay.pipeline))
  axes, group, share = exchange_group(m, lay)
  if group > 1:
    routed = act * share * m.moe.experts_per_token * m.moe_share()
    out.append(Collective(axes, "all-to-all", "expert", routed, (4 + 2 * again) * layer_passes,
                          group))
  return out


# ---- how long a step takes ----


def exchange_seconds(c: Collective, per_node: int, hw: HardwareProfile) -> float:
  """The MoE token exchange across nodes: an all-to-all has no ring to spread over a node's NICs,
  so the rows for peers in other nodes leave through each GPU's own NIC, its node's rows over
  NVLink meanwhile (the compiled-program model's rule for the ragged exchange,
  sharding/xla/step_time.py). One latency per exchange."""
  buffer, n = c.count * c.payload, c.group
  network = buffer * (n - per_node) / n / (hw.inter_node_bandwidth * hw.collective_efficiency)
  nvlink = buffer * (per_node - 1) / n / (hw.intra_node_bandwidth * hw.collective_efficiency)
  return max(network, nvlink) + c.count * hw.inter_latency_s


def hardware_flops_per_device(model, layout: Layout, seq_len: int,
                              stages_recompute: bool = True) -> float:
  """FLOPs one device executes per step: its share of 6 x active params x tokens and attention
  (stages assumed balanced, as nanotron balances layers and head), plus recomputation
  (selective: the attention scores again, 2 H Dh s per layer and token; full: the forward; and
  with `stages_recompute`, meshtron's pipeline executor, the chunk's forward in its backward)."""
  return sum(flops_split(model, layout, seq_len, stages_recompute))


def flops_split(model, layout: Layout, seq_len: int, stages_recompute: bool = True,
                forward_only: bool = False, attention_weights: tuple = (1.0, 1.0)
                ) -> tuple[float, float]:
  """hardware_flops_per_device as (the layers' linear GEMMs, attention scores and the head):
  the first are what fp8 training runs on fp8 tensor cores. `forward_only`: the forward passes'
  share (a third of each product, no recomputation), which the pipeline's ticks price apart.
  `attention_weights`: factors on the scores' FLOPs (their passes, their recomputed forwards)."""
  m, lay = model_spec(model), layout
  # per model replica, per context shard
  tokens = lay.micro_batch * lay.microbatches * seq_len / lay.context
  table = m.vocab_size * m.embed_dim
  per_layer = m.attention_params() + m.dense_mlp_params() + m.expert_params(per_token=True)
  mtp = m.active_matmul_params() - table - m.num_layers * per_layer  # with their heads
  attention = m.attention_flops(seq_len)
  remat = lay.stage_remat(m.num_layers, stages_recompute)
  forwards = {"none": 0, "selective": 0, "full": 1}[remat]  # linear forwards recomputed
  scores = {"none": 0.0, "selective": attention / 3, "full": attention / 3}[remat]
  staged = lay.stages_recompute(stages_recompute)  # meshtron's executor, recomputing
  if staged:  # its stash holds chunk inputs only (estimate.memory)
    forwards, scores = forwards + 1, scores + attention / 3
  passes, head = 6 + 2 * forwards, 6  # x params: forward 2, backward 4, a recomputed forward 2
  if forward_only:
    passes, head, attention, scores = 2, 2, attention / 3, 0.0
  attention, scores = attention_weights[0] * attention, attention_weights[1] * scores
  # The most loaded stage sets the time: uneven stages count their padded share of layers.
  layers = stage_layers(m, lay) * lay.pipeline
  share = tokens / (lay.tensor * lay.pipeline)
  linear, rest = layers * passes * per_layer, layers * (attention + scores) + head * table
  if not m.mtp_depth or forward_only:
    return share * linear, share * rest
  # The multi-token prediction modules (a layer, a projection and a head each): in pipeline
  # stages the last runs them on every token of its microbatches, once in each backward tick
  # (not checkpointed there), and the most loaded stage sets the time.
  mtp_passes, mtp_share = (6, tokens / lay.tensor) if staged else (passes, share)
  mtp_linear = (mtp - m.mtp_depth * table) * mtp_passes
  mtp_rest = m.mtp_depth * (6 * table + attention + (0.0 if staged else scores))
  return share * linear + mtp_share * mtp_linear, share * rest + mtp_share * mtp_rest


def grouped_share(model) -> float:
  """The share of the layers' linear FLOPs that run on the grouped matmul: the routed experts'
  under dropless dispatch (dropping dispatch runs dense GEMMs over capacity buffers), else 0."""
  m = model_spec(model)
  if not m.moe or m.moe.dispatch != "dropless":
    return 0.0
  per_layer = m.active_matmul_params() - m.vocab_size * m.embed_dim
  return m.num_layers * m.expert_params(per_token=True) / per_layer


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


# meshtron's flash kernels run 9 matmuls per attention product where flops_split counts 6: forward
# 2, backward dq 3 and dkv 4 (each recomputes the scores; sharding/xla/step_time.py counts so).
FLASH_MATMULS_PER_COUNTED = 9 / 6


def matmul_seconds(model, layout: Layout, seq_len: int, hw: HardwareProfile, linear: float,
                   linear_peak: float, stages_recompute: bool = True) -> float:
  """A step's matmuls as meshtron's kernels run them, at the compiled-program model's constants
  (profiles.py; measured or published, none fitted to the planner): GEMMs at gemm_peak_fraction
  of their peak (`linear_peak` for the layers' `linear` FLOPs), flash kernels at
  flash_triton_fraction of the bf16 peak (without flash, the scores' dots as GEMMs), the dropless
  experts over the exchange buffer's rows at grouped_matmul_fraction (the Pallas kernel) or as
  the dense GEMMs (moe.grouped_matmul=capacity). Memory-bound kernels: memory_bound.py."""
  m = model_spec(model)
  _, head = flops_split(model, layout, seq_len, stages_recompute, attention_weights=(0.0, 0.0))
  _, scores = flops_split(model, layout, seq_len, stages_recompute, attention_weights=(
      FLASH_MATMULS_PER_COUNTED if m.flash_attention else 1.0, 1.0))
  routed, bf16 = linear * grouped_share(model), hw.peak_bf16_flops
  scores_rate = hw.flash_triton_fraction if m.flash_attention else hw.gemm_peak_fraction
  grouped_rate = linear_peak * hw.gemm_peak_fraction if batched(m.moe) else \
      bf16 * hw.grouped_matmul_fraction
  return (((linear - routed) / linear_peak + head / bf16) / hw.gemm_peak_fraction +
          (scores - head) / (bf16 * scores_rate) +
          routed * grouped_rows_ratio(m, layout) / grouped_rate)


@dataclasses.dataclass
class StepTime:
  step_s: float
  compute_s: float
  bubble_s: float
  exposed_comm_s: float
  comm_s: dict  # per phase, before overlap
  tokens_per_s_per_gpu: float
  mfu: float
  memory_bound_s: float = 0.0  # of compute_s: elementwise kernels (memory_bound.py)


@dataclasses.dataclass(frozen=True)
class StageCosts:
  """A step's costs before the pipeline's bubble, the same under every schedule of a layout
  (`plan` prices a layout's schedules from one): seconds of the stage's compute and of its
  collectives per phase, and what step_time adds them up with."""

  compute: float  # the most loaded stage's kernels
  memory_bound: float  # of compute: elementwise kernels (memory_bound.py)
  comm: dict  # per phase, before overlap
  stage_exposed: float  # the stage's own collectives, not hidden
  dp_exposed: float  # the data-parallel ones, not hidden
  hidden: float  # overlapped (up to the compute's length)
  backward_share: float  # of a tick's compute (pipelined; 0 without stages)
  state: float  # bytes of params, grads and moments (the optimizer's update reads and writes)


def stage_costs(model, layout: Layout, seq_len: int, precision: Precision, hw: HardwareProfile,
                order: tuple = AXES, stages_recompute: bool = True, blocking_sends: bool = False,
                uniform_matmuls: bool = False) -> StageCosts:
  """step_time's costs that do not depend on `layout.pipeline_schedule` (its arguments)."""
  m, lay = model_spec(model), layout
  peak = hw.peak_fp8_flops if precision.act_bytes == 1 else hw.peak_bf16_flops
  # fp8 training's layer GEMMs on the fp8 tensor cores (the compiled-program model's f8 dots).
  linear_peak = hw.peak_fp8_flops if precision.fp8_layers else peak
  linear, rest = flops_split(m, lay, seq_len, stages_recompute)
  passes = 3 * lay.microbatches * lay.virtual_stages * stage_layers(m, lay)
  memory_s = 0.0 if uniform_matmuls else memory_bound.memory_bound_seconds(
      m, lay, seq_len, precision, hw, stages_recompute, grouped_rows_ratio(m, lay))
  if uniform_matmuls:
    routed = linear * grouped_share(m)
    # The routed experts' grouped matmul over the exchange buffer's rows, slower than the
    # efficiency's dense GEMMs by gemm_peak_fraction / grouped_matmul_fraction (profiles.py).
    compute = ((linear - routed) / linear_peak + rest / peak + routed * grouped_rows_ratio(
        m, lay) / peak * hw.gemm_peak_fraction / hw.grouped_matmul_fraction) / \
        hw.matmul_efficiency
  else:
    compute = matmul_seconds(m, lay, seq_len, hw, linear, linear_peak, stages_recompute) + memory_s
  compute += passes * hw.layer_overhead_s
  members = placement(lay, hw.gpus_per_node, order)
  comm, stage_exposed, dp_exposed, hidden = {}, 0.0, 0.0, 0.0
  overlaps = dict(hw.overlap)  # hw.overlap_of's, once (the planner prices ~10^5 layouts)
  for c in collectives(m, lay, seq_len, precision, stages_recompute):
    per_node = math.prod(members[a] for a in c.axes)
    inside = per_node == c.group
    # Across nodes NCCL runs one ring per NIC: a group with k members on each node crosses
    # between nodes over k NICs at once, so its bus bandwidth is k NICs' (NVLink at most), as
    # in the compiled-program model (sharding/xla/step_time.py) and nccl-tests' 400-450 GB/s of
    # all-reduce bus bandwidth for a group of whole 8-GPU nodes (see the profiles above).
    link = min(hw.intra_node_bandwidth, per_node * hw.inter_node_bandwidth)
    bw = (hw.intra_node_bandwidth if inside else link) * hw.collective_efficiency
    latency = hw.intra_latency_s if inside else (
        hw.pipeline_hop_s if c.phase == "pipeline" and blocking_sends else hw.inter_latency_s)
    if c.kind == "all-to-all" and c.phase == "expert" and not inside:
      t = exchange_seconds(c, per_node, hw)
    else:
      t = c.wire_bytes / bw + c.ring_steps * latency
    comm[c.phase] = comm.get(c.phase, 0.0) + t
    o = overlaps[c.phase]
    hidden += o * t
    if c.phase in ("grad_sync", "param_sync", "zero3"):
      dp_exposed += (1 - o) * t
    else:
      stage_exposed += (1 - o) * t
  backward_share = 0.0
  if lay.pipeline > 1:  # the lock-step ticks' forward and backward (step_time)
    f_linear, f_rest = flops_split(m, lay, seq_len, forward_only=True)
    forward = f_linear / linear_peak + f_rest / peak
    backward = linear / linear_peak + rest / peak - forward
    backward_share = round(backward / (forward + backward), 3)
  counts = param_counts(m, lay)  # the state's bytes, as `memory` counts them
  state = sum(state_bytes(counts.shardable, counts.replicated, lay, precision, counts.experts,
                          counts.tables))
  return StageCosts(compute, memory_s, comm, stage_exposed, dp_exposed, hidden, backward_share,
                    state)


def step_time(model, layout: Layout, seq_len: int, precision: Precision, hw: HardwareProfile,
              order: tuple = AXES, stages_recompute: bool = True,
              lockstep: bool = True, blocking_sends: bool = False,
              uniform_matmuls: bool = False, costs: StageCosts | None = None) -> StepTime:
  """Predicted time of one optimizer step: matmuls at meshtron's kernels' rates, every
  collective at link bandwidth (intra- or inter-node by placement) plus ring latency, overlap per
  kind, the pipeline bubble of the schedule's tick table (schedules.bubble_ratio) and the
  optimizer update at HBM bandwidth. `stages_recompute`: as in hardware_flops_per_device (False
  for trainers whose stages store activations, nanotron's in the playbook's sweep). `lockstep`:
  the pipeline's ticks as meshtron's executor runs them (schedules.lockstep_ratio; False for
  trainers whose stages run each operation as its inputs arrive, as nanotron's). `blocking_sends`:
  a cross-node pipeline hop costs `pipeline_hop_s`, the playbook's nanotron runs' blocking send
  per microbatch (their sweep); meshtron's executor sends by asynchronous collective permutes
  inside its ticks, priced as any collective across nodes (bytes and latency), as the
  compiled-program model prices them (sharding/xla/step_time.py). `uniform_matmuls`: every
  matmul at the profile's matmul_efficiency (the playbook's nanotron runs, the CPU sweep).
  `costs`: stage_costs of a layout differing at most in its schedule, with these arguments."""
  m, lay = model_spec(model), layout
  peak = hw.peak_fp8_flops if precision.act_bytes == 1 else hw.peak_bf16_flops
  c = costs or stage_costs(m, lay, seq_len, precision, hw, order, stages_recompute,
                           blocking_sends, uniform_matmuls)
  compute = c.compute
  stage = compute + c.stage_exposed
  ticks = (lay.pipeline_schedule, lay.pipeline, lay.microbatches, lay.virtual_stages)
  if lockstep and lay.pipeline > 1:  # meshtron's executor: a tick waits for its slowest stage
    bubble = stage * (schedules.lockstep_ratio(*ticks, c.backward_share) - 1)
  else:
    bubble = stage * schedules.bubble_ratio(*ticks)
  optimizer = 2 * c.state / hw.hbm_bandwidth  # read and write params, grads, moments
  exposed = c.stage_exposed + c.dp_exposed + max(0.0, c.hidden - compute)
  total = stage + bubble + c.dp_exposed + max(0.0, c.hidden - compute) + optimizer
  tokens = lay.global_batch * seq_len
  model_flops = m.flops_per_token(seq_len) * tokens / lay.num_devices
  return StepTime(total, compute, bubble, exposed, dict(c.comm), tokens / total / lay.num_devices,
                  model_flops / (total * peak), c.memory_bound)
