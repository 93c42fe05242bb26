"""The analytic cost model: per-device memory, FLOPs and communication of a model under a layout.

Pure Python (no JAX): the playbook's arithmetic, instant for any model size; sources are cited
where used; GB means 1e9 bytes. Time and hardware: sharding/plan/hardware.py."""

import dataclasses
import math
from typing import Any

from sharding.pipeline import schedules
from sharding.layout import Layout
from sharding.plan import context_parallel, expert_rows
from sharding.plan.activations import (GROUPED_PADDING, ActivationTerms,  # noqa: F401
                                       activation_terms, layer_activation_bytes)

GB = 1e9
# CUDA context, NCCL buffers and allocator fragmentation: "1-2 GB" in the playbook's memory note.
DEFAULT_WORKSPACE_BYTES = 1.5e9
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}


@dataclasses.dataclass(frozen=True)
class MoESpec:
  """Mixture-of-experts MLP: each layer's MLP is `num_experts` SwiGLU experts, top-k routed,
  after `dense_layers` leading layers that keep the dense MLP (DeepSeek-V3: 3)."""

  num_experts: int
  experts_per_token: int
  expert_mlp_dim: int
  shared_experts: int = 0  # always-active experts of the same size (DeepSeek style)
  dense_layers: int = 0
  dispatch: str = "dropping"  # models.config's; dropless runs our grouped matmul on GPUs
  exchange_capacity: float = 2.0  # models.config's: the exchange's buffer rows, per balanced row
  grouped_matmul: str = "auto"  # models.config's: "capacity" runs batched GEMMs (hardware.py)


def attention_span(seq_len: int, window: int = 0, full_every: int = 0) -> float:
  """Twice the mean number of keys a query attends to over the layers: seq_len when causal (s/2
  keys a query), 2W - W^2/s for a window W; with `full_every` = N every Nth layer attends fully."""
  if not window or window >= seq_len:
    return float(seq_len)
  windowed = 2 * window - window * window / seq_len
  full_share = 1 / full_every if full_every else 0.0
  return full_share * seq_len + (1 - full_share) * windowed


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """The numbers the estimator needs from a Llama-style model (ModelConfig duck-types to it)."""

  vocab_size: int
  embed_dim: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  tie_embeddings: bool = False
  moe: MoESpec | None = None
  # Fused attention (cuDNN, Pallas flash) keeps no score matrices; "xla" stores them.
  flash_attention: bool = False
  qk_norm: bool = False  # Qwen3: two more norm scales of head_dim per layer
  mtp_depth: int = 0  # DeepSeek-V3's multi-token prediction modules (models/mtp.py)
  mla: Any = None  # models.config.MLAConfig (its fields, params(), norm_params()); None: GQA
  sliding_window: int = 0  # models.config.ModelConfig's window and its full-attention period
  full_attention_every: int = 0
  context_impl: str = "ring"  # and its context-parallel attention (sharding/plan/context_parallel)
  ulysses_degree: int = 0
  attention_impl: str = "xla"  # the run's request ("auto": flash on GPUs, pipeline stages too)
  layers_apart: bool = False  # compute.scan_layers=false: each layer's weights apart, unrolled

  def attention_params(self) -> int:
    d, dh = self.embed_dim, self.head_dim
    if self.mla is not None:
      return self.mla.params(d, self.num_heads)
    return 2 * d * self.num_heads * dh + 2 * d * self.num_kv_heads * dh  # q, o + k, v

  def v_head_dim(self) -> int:
    return self.head_dim if self.mla is None else self.mla.v_head_dim

  def norm_params(self) -> int:
    """A layer's norm scales: before attention and the MLP, QK-norm's, MLA's latent norms."""
    mla = self.mla.norm_params() if self.mla is not None else 0
    return 2 * self.embed_dim + (2 * self.head_dim if self.qk_norm else 0) + mla

  def attention_flops(self, seq_len: int) -> float:
    """Training FLOPs of one layer's causal attention per token: QK^T and AV, 2 H (Dh + Dv) seq
    forward without the mask, halved by it, x3 with the backward."""
    span = attention_span(seq_len, self.sliding_window, self.full_attention_every)
    return 3 * self.num_heads * (self.head_dim + self.v_head_dim()) * span

  def moe_share(self) -> float:
    """The fraction of MoE layers (per-layer figures below are means over the layers)."""
    return (self.num_layers - self.moe.dense_layers) / self.num_layers

  def expert_params(self, per_token: bool = False) -> float:
    """A layer's routed experts (`per_token`: the top-k a token uses), mean over the layers."""
    m = self.moe
    return ((m.experts_per_token if per_token else m.num_experts) * 3 * self.embed_dim *
            m.expert_mlp_dim * self.moe_share()) if m else 0

  def dense_mlp_params(self) -> float:
    """MLP weights every token uses (mean over layers): SwiGLU, or shared experts + router."""
    m, d = self.moe, self.embed_dim
    if not m:
      return 3 * d * self.mlp_dim
    share = self.moe_share()
    return (m.shared_experts * 3 * d * m.expert_mlp_dim + d * m.num_experts) * share + \
        3 * d * self.mlp_dim * (1 - share)

  def layer_params(self) -> int:
    return (self.attention_params() + self.dense_mlp_params() + self.expert_params()
            + self.norm_params())

  def num_params(self) -> int:
    tables = 1 if self.tie_embeddings else 2
    return tables * self.vocab_size * self.embed_dim + self.num_layers * self.layer_params() + \
        self.embed_dim + self.mtp_params()

  def mtp_block(self, experts: int | None = None) -> tuple[float, float]:
    """(matrices, norm scales) of one multi-token prediction block: a whole layer of the last
    stack's kind (MoE: `experts` routed experts, all by default), not a mean over the layers."""
    m, d = self.moe, self.embed_dim
    norms = self.norm_params()
    if not m:
      return self.attention_params() + 3 * d * self.mlp_dim, norms
    routed = m.num_experts if experts is None else experts
    mlp = (routed + m.shared_experts) * 3 * d * m.expert_mlp_dim + d * m.num_experts
    return self.attention_params() + mlp, norms

  def mtp_params(self) -> float:
    """The MTP modules: block, [2D, D] projection, 3 norms each (embedding and head shared)."""
    d = self.embed_dim
    return self.mtp_depth * (sum(self.mtp_block()) + 2 * d * d + 3 * d)

  def active_matmul_params(self) -> int:
    """Matmul weights one token passes through (experts: top-k only), head included."""
    m = self.moe
    per_layer = self.attention_params() + self.dense_mlp_params() + self.expert_params(True)
    mtp = self.mtp_block(m.experts_per_token if m else None)[0] + 2 * self.embed_dim ** 2
    mtp = self.mtp_depth * (mtp + self.vocab_size * self.embed_dim)  # block, projection, head
    return self.num_layers * per_layer + self.vocab_size * self.embed_dim + mtp

  def flops_per_token(self, seq_len: int) -> float:
    """Model FLOPs per trained token: 6 x active matmul params + 6 L H Dh seq (causal attention;
    the same formula as models.config.ModelConfig.flops_per_token, MoE counting active experts)."""
    attention = (self.num_layers + self.mtp_depth) * self.attention_flops(seq_len)
    return 6.0 * self.active_matmul_params() + attention


# The estimator's own entries for models the trainer cannot build yet (issue [7] adds MoE).
ESTIMATOR_MODELS = {
    # Mixtral 8x7B (arXiv:2401.04088): 46.7B parameters, 12.9B active.
    "mixtral_8x7b": ModelSpec(vocab_size=32_000, embed_dim=4096, num_layers=32, num_heads=32,
                              num_kv_heads=8, head_dim=128, mlp_dim=14_336, moe=MoESpec(
                                  num_experts=8, experts_per_token=2, expert_mlp_dim=14_336)),
}


def model_spec(model, compute=None) -> ModelSpec:
  """A ModelSpec from any object with ModelConfig's field names (and optionally `moe`: experts,
  top-k, expert width (0: the MLP's), shared experts, leading dense layers, as models.config's
  MoEConfig). Not counted: the aux-loss-free routing bias (E parameters per MoE layer)."""
  if isinstance(model, ModelSpec):
    return model
  moe = getattr(model, "moe", None)
  if moe is not None and not isinstance(moe, MoESpec):
    shared = getattr(moe, "num_shared_experts", None)
    moe = MoESpec(moe.num_experts, getattr(moe, "experts_per_token", None) or moe.top_k,
                  getattr(moe, "expert_mlp_dim", None) or model.mlp_dim,
                  getattr(moe, "shared_experts", 0) if shared is None else shared,
                  getattr(moe, "first_dense_layers", 0), getattr(moe, "dispatch", "dropping"),
                  getattr(moe, "exchange_capacity", 2.0), getattr(moe, "grouped_matmul", "auto"))
  # Compute settings from `compute` (a ComputeConfig by field names; None: its defaults). "auto"
  # is flash: GPUs are what the estimator plans for (a CPU run passes its resolved impl).
  impl = getattr(compute, "attention_impl", "auto")
  return ModelSpec(model.vocab_size, model.embed_dim, model.num_layers, model.num_heads,
                   model.num_kv_heads, model.head_dim, model.mlp_dim, model.tie_embeddings, moe,
                   impl in ("auto", "cudnn", "pallas_flash"), getattr(model, "qk_norm", False),
                   getattr(model, "mtp_depth", 0), getattr(model, "mla", None),
                   getattr(model, "sliding_window", 0), getattr(model, "full_attention_every", 0),
                   getattr(compute, "context_impl", "ring"), getattr(compute, "ulysses_degree", 0),
                   impl, not getattr(compute, "scan_layers", True))


@dataclasses.dataclass(frozen=True)
class Precision:
  """Bytes per element of everything stored for training."""

  name: str
  param_bytes: int  # the parameters the forward pass reads
  master_bytes: int  # fp32 master copy kept by the optimizer (0: none)
  grad_bytes: int  # gradients as backward produces them
  grad_accum_bytes: int  # a separate accumulation buffer (0: accumulate in place)
  opt_bytes: int  # each of Adam's two moments
  act_bytes: int  # activations (compute dtype)
  accum_only_when_microbatching: bool = False  # the trainer's: a scan carry only while ga > 1
  fp8_layers: bool = False  # the layers' linear GEMMs on fp8 tensor cores (not scores, not head)
  # Sequence parallelism's gathers in fp8: tensorwise fp8 gathers each layer input once,
  # quantized, and the output gradients of o and down in e5m2 (models/layers.py project_shared).
  fp8_gathers: bool = False


# The playbook's mixed precision: bf16 params and grads, fp32 master and Adam ("2Psi + 2Psi +
# 12Psi"); nanotron also accumulates gradients in fp32 (+4Psi); fp8 recipes' GEMMs in fp8.
PLAYBOOK_MIXED = Precision("bf16 mixed (playbook)", 2, 4, 2, 0, 4, 2)
PLAYBOOK_MIXED_FP32_ACCUM = Precision("bf16 mixed + fp32 grad accumulation", 2, 4, 2, 4, 4, 2)
FULL_FP32 = Precision("fp32", 4, 0, 4, 0, 4, 4)
PLAYBOOK_FP8 = Precision("bf16 mixed + fp8 layer GEMMs", 2, 4, 2, 0, 4, 2, fp8_layers=True)


def trainer_precision(dtype: str = "float32", param_dtype: str = "float32",
                      grad_accum_dtype: str = "", master_weights: bool = False,
                      fp8_layers: bool = False, fp8_gathers: bool = False) -> Precision:
  """What trainer/ does: params, grads, AdamW moments in `param_dtype` (`master_weights`: fp32
  moments and master copy), activations in `dtype`, a `grad_accum_dtype` scan carry;
  `fp8_gathers`: tensorwise fp8 layers (Precision.fp8_gathers)."""
  p, a = DTYPE_BYTES[param_dtype], DTYPE_BYTES[grad_accum_dtype or param_dtype]
  m, master = (4, " + fp32 master weights") if master_weights else (0, "")
  fp8 = ", fp8 layer GEMMs" if fp8_layers else ""
  return Precision(f"trainer ({param_dtype} params{master}, {dtype} compute{fp8})", p, m, p, a,
                   m or p, DTYPE_BYTES[dtype], True, fp8_layers, fp8_layers and fp8_gathers)


PRECISIONS = {"playbook": PLAYBOOK_MIXED, "playbook_fp32_accum": PLAYBOOK_MIXED_FP32_ACCUM,
              "playbook_fp8": PLAYBOOK_FP8, "fp32": FULL_FP32,
              "trainer": trainer_precision("bfloat16")}


@dataclasses.dataclass
class Memory:
  """Bytes per device, the playbook's breakdown (the most loaded pipeline stage)."""

  params: float
  grads: float  # + the gradient accumulation buffer, if any
  optimizer: float  # Adam moments + fp32 master weights
  activations: float
  logits: float  # logits, their fp32 copy and gradient (loss buffers)
  temporaries: float  # gathered ZeRO-3 layers, one recomputed layer, batched experts' slots,
  # workspace allowance

  @property
  def state(self) -> float:
    return self.params + self.grads + self.optimizer

  @property
  def total(self) -> float:
    return self.state + self.activations + self.logits + self.temporaries


@dataclasses.dataclass(frozen=True)
class ParamCounts:
  """Parameters held by one device before ZeRO/FSDP: after tensor, pipeline and expert splits."""

  layers: float  # matrices of the device's layers (shardable by ZeRO/FSDP)
  tables: float  # embedding and/or head on this stage (shardable)
  replicated: float  # norm scales: never sharded (they have no embed dim to split)
  layer_matrices: float  # one layer's matrices (what ZeRO-3 gathers at a time)
  experts: float = 0.0  # the routed experts' matrices among `layers` (split by `expert` already)

  @property
  def shardable(self) -> float:
    return self.layers + self.tables

  @property
  def total(self) -> float:
    return self.shardable + self.replicated


def stage_layers(model: ModelSpec, layout: Layout) -> float:
  """Layer rows the most loaded pipeline stage stores and runs: L / pipeline, or the padded
  stack's share (pipeline/stage_split.py: 8 for 126 layers on 16 stages); L without stages."""
  return layout.layers_per_device(model.num_layers)


def param_counts(model: ModelSpec, layout: Layout) -> ParamCounts:
  m, lay = model, layout
  per_layer = (m.attention_params() + m.dense_mlp_params()) / lay.tensor + \
      m.expert_params() / (lay.tensor * lay.expert)
  layers = stage_layers(m, lay)
  # One stage keeps the embedding and the last the head; tied tables live on both end stages.
  copies = 1 if m.tie_embeddings or lay.pipeline > 1 else 2
  tables = copies * m.vocab_size * m.embed_dim / lay.tensor
  # Multi-token prediction modules, counted like the table: under pipeline parallelism the last
  # stage holds them with the head, and the device estimated is the worst case (the most loaded
  # stage's layers, a table, the modules); the block split like a layer, the projection not.
  matrices, norms = m.mtp_block()
  experts = m.moe.num_experts * 3 * m.embed_dim * m.moe.expert_mlp_dim if m.moe else 0
  mtp = m.mtp_depth * ((matrices - experts) / lay.tensor + experts / (lay.tensor * lay.expert)
                       + 2 * m.embed_dim ** 2)
  routed = (layers * m.expert_params() + m.mtp_depth * experts) / (lay.tensor * lay.expert)
  return ParamCounts(layers * per_layer + mtp, tables, layers * 2 * m.embed_dim + m.embed_dim
                     + m.mtp_depth * (norms + 3 * m.embed_dim), per_layer, routed)


def shards(layout: Layout, experts: bool = False) -> tuple[int, int, int]:
  """(param, grad, optimizer) shard counts: fsdp x the ZeRO group from ZeRO 3/2/1, data x context
  x expert (rules.ZERO_AXES; without `expert` for the routed `experts`, which it splits). From
  ZeRO-2 on, the gradients stay whole over the sequence axes a pipeline stage is manual over: each
  device keeps its sums of its parts of the sequences until the schedule ends
  (Layout.stage_sequence_axes; trainer/pipeline_step.py splits ZeRO-2's over the rest)."""
  f, z, d = layout.fsdp, layout.zero_stage, layout.data * layout.context * (
      1 if experts else layout.expert)
  whole = math.prod(layout.sizes()[a] for a in layout.stage_sequence_axes) if (
      z >= 2 and layout.pipeline > 1) else 1  # asked only where it matters: plan asks 10^5 times
  return f * (d if z >= 3 else 1), f * (d // whole if z >= 2 else 1), f * (d if z >= 1 else 1)


def state_bytes(shardable: float, replicated: float, layout: Layout, precision: Precision,
                experts: float = 0.0, tables: float | None = None) -> tuple[float, float, float]:
  """(params, grads, optimizer) bytes per device (`experts`: the routed experts' share of
  `shardable`). ZeRO (arXiv:1910.02054, the playbook's "ZeRO" section): 2Psi + 2Psi + kPsi/N_d
  (stage 1), 2Psi + (2+k)Psi/N_d (2), (4+k)Psi/N_d (3), k = 12 for Adam with fp32 masters.
  `tables` given: the trainer's microbatches without stages add the layer stacks' gradients into
  the accumulator in the backward (models/accumulating_scan.py); only the tables have a buffer."""
  pr = precision
  accumulating = layout.microbatches > 1 or not pr.accum_only_when_microbatching
  accum = pr.grad_accum_bytes if accumulating else 0
  p, g, o = ((shardable - experts) / n + experts / e  # each role's per-device parameters
             for n, e in zip(shards(layout), shards(layout, experts=True)))
  params = pr.param_bytes * (p + replicated)
  grads = (pr.grad_bytes + accum) * (g + replicated)
  if tables is not None and accum and pr.accum_only_when_microbatching and layout.pipeline == 1:
    grads = accum * (g + replicated) + pr.grad_bytes * tables / shards(layout)[1]
  optimizer = (pr.master_bytes + 2 * pr.opt_bytes) * (o + replicated)
  return params, grads, optimizer


@dataclasses.dataclass(frozen=True)
class MemoryParts:
  """memory's terms that do not depend on `layout.pipeline_schedule` (`plan` sizes a layout's
  schedules from one)."""

  state: tuple  # (params, grads, optimizer)
  per_layer: float  # a layer's activations, one microbatch
  layers: float  # stage_layers
  tokens: float  # per device and microbatch
  logit_bytes: float  # the logits' buffers for one microbatch's tokens
  temporaries: float


def memory_parts(model, layout: Layout, seq_len: int, precision: Precision = PLAYBOOK_MIXED, *,
                 formula: str = "llama", workspace_bytes: float = DEFAULT_WORKSPACE_BYTES,
                 stages_recompute: bool = True) -> MemoryParts:
  """memory's terms but the schedule's (its arguments)."""
  m, lay = model_spec(model), layout
  counts = param_counts(m, lay)
  if lay.pipeline > 1 and not m.tie_embeddings:
    # meshtron's stages each store the embedding and the head, replicated over `pipeline` (the
    # head runs on every stage, on its share of the tokens): param_counts counts one a stage, as
    # Megatron's end stages hold them (the collectives' analytic minimum reads it so).
    counts = dataclasses.replace(counts, tables=2 * counts.tables)
  state = state_bytes(counts.shardable, counts.replicated, lay, precision, counts.experts,
                      counts.tables)
  kv_heads = context_parallel.attended_kv_heads(m, lay) * lay.tensor  # Ulysses: + replicas
  terms = activation_terms(m, precision.act_bytes, formula, kv_heads, precision.fp8_layers)
  tokens = lay.micro_batch * seq_len / lay.context  # per device and microbatch (CP splits seq)
  remat = lay.stage_remat(m.num_layers, stages_recompute)
  per_layer = layer_activation_bytes(terms, tokens, seq_len, lay, remat)
  # The logits' buffers, by the formula (ActivationTerms.logit), the vocab split over tensor.
  logit_bytes = tokens * m.vocab_size / lay.tensor * terms.logit
  temporaries = workspace_bytes
  if remat != "none":  # the layer being recomputed in the backward pass
    temporaries += layer_activation_bytes(terms, tokens, seq_len, lay, "none") - \
        layer_activation_bytes(terms, tokens, seq_len, lay, remat)
  # Batched experts (moe.grouped_matmul=capacity): a MoE layer's backward's slot buffers.
  temporaries += expert_rows.slot_bytes(m, lay, tokens, precision.act_bytes,
                                        precision.fp8_layers)
  if shards(lay)[0] > 1:  # ZeRO-3: the gathered layer and the prefetched next one
    temporaries += 2 * counts.layer_matrices * precision.param_bytes
  return MemoryParts(state, per_layer, stage_layers(m, lay), tokens, logit_bytes, temporaries)


def memory(model, layout: Layout, seq_len: int, precision: Precision = PLAYBOOK_MIXED, *,
           formula: str = "llama", workspace_bytes: float = DEFAULT_WORKSPACE_BYTES,
           stages_recompute: bool = True, parts: MemoryParts | None = None) -> Memory:
  """The per-device memory of training `model` under `layout` at `seq_len` tokens a sequence.
  `stages_recompute`: meshtron's executor (its stash, the head split over the stages, one chunk
  recomputed unless pipeline_recompute is off); False: all in flight (Megatron). `parts`:
  memory_parts of a layout differing at most in its schedule, with these arguments."""
  m, lay = model_spec(model), layout
  p = parts or memory_parts(m, lay, seq_len, precision, formula=formula,
                            workspace_bytes=workspace_bytes, stages_recompute=stages_recompute)
  tokens = p.tokens
  schedule = (lay.pipeline_schedule, lay.pipeline, lay.microbatches, lay.virtual_stages)
  in_flight, stash, head = schedules.in_flight_microbatches(*schedule), 0.0, 1.0
  if lay.pipeline > 1 and stages_recompute:  # + the embedding's output gradient per microbatch
    stash = (schedules.executor_stash(*schedule) + lay.microbatches) * tokens * m.embed_dim * \
        precision.act_bytes / (lay.tensor if lay.sequence_parallel else 1)
    head, in_flight = 1 / lay.pipeline, (1 / lay.virtual_stages if lay.pipeline_recompute
                                         else in_flight)  # its head tokens; kept: all in flight
  # Each multi-token prediction module stores about a layer's activations and its logits for one
  # microbatch (stages: the last runs them, each backward just after its recomputed forward).
  activations = p.per_layer * (p.layers * in_flight + m.mtp_depth) + stash
  logits = p.logit_bytes * (head + m.mtp_depth)
  return Memory(*p.state, activations, logits, p.temporaries)
