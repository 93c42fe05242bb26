"""The analytic minimum of collective bytes per step for a layout, per axis: what the playbook's
algorithm for each parallelism must move, each transfer counted once where that algorithm needs
it; the yardstick a compiled program's collectives are held against (issue [26]).

Bytes are what one device sends per optimizer step under ring algorithms, the convention of
sharding.xla.hlo.Collective.wire_bytes and sharding.plan.hardware.Collective: an all-reduce of S
bytes over n devices sends 2 (n-1)/n S, an all-gather (S gathered), a reduce-scatter (S reduced)
or an all-to-all (S exchanged) (n-1)/n S, a point-to-point send S. The device is the most loaded
one (a middle pipeline stage, the stage holding the most layers). Per axis:

  fsdp      FSDP / ZeRO-3 over `fsdp` (and `data` at ZeRO-3): per microbatch, each sharded weight
            gathered for its forward and again for its backward (reshard after forward, which
            keeps one layer's weights in memory), and its gradient reduce-scattered, each in the
            narrower of its own dtype and the compute dtype (a float32 weight cast to bf16
            before its gather, its gradient reduced as the bf16 matmul gives it, as XLA does;
            FSDP2's param_dtype and reduce_dtype the same). A program that keeps a gathered
            weight from the forward for the backward trades memory to move less. The vocabulary
            tables are not gathered when the layout splits them over fsdp (their hidden states
            move instead: not counted).
  data      the gradient reduction over the replicas: `data` (below ZeRO-3), `context` (each
            holds part of every sequence) and `expert` (each holds other tokens; not for the
            experts' own weights, which it splits), once per step, in the gradient dtype (the
            reduction runs after the microbatches are summed): an all-reduce, or under ZeRO-1
            a reduce-scatter of the gradients and an all-gather of the updated parameters
            (ZeRO-2: the gradients reduce-scattered every microbatch, over data, context and
            expert, as ZeRO splits them).
  tensor    Megatron tensor parallelism: per microbatch and layer, the attention and MLP outputs
            all-reduced forward and their input gradients backward (4 all-reduces of the [tokens,
            D] activations; under sequence parallelism an all-gather and a reduce-scatter each,
            the same bytes), 2 more with full recomputation; per microbatch one for the embedding
            (vocab-parallel) and one for the head's input gradient.
  context   context parallelism's attention, per microbatch and layer: the ring passes the K/V
            blocks (context - 1 hops, fewer with a sliding window) forward, again backward, and
            the K/V gradients back: 3 passes; Ulysses' 4 all-to-alls (q, k, v, output) forward
            and 4 backward, 2 more with full recomputation; the hybrid both over its factors.
  expert    the MoE token exchange, per microbatch and MoE layer: the routed token copies
            (top-k) to their experts and back, forward and backward: 4 all-to-alls, 2 more with
            full recomputation.
  pipeline  per microbatch and chunk (virtual stage), the activations sent to the next stage and
            their gradients sent back (a [tokens, D] tensor, split over `tensor` under sequence
            parallelism).
"""

import math

from sharding.layout import Layout
from sharding.plan import context_parallel
from sharding.plan.estimate import Precision, model_spec, param_counts, stage_layers
from sharding.plan.expert_rows import exchange_group

AXES = ("fsdp", "data", "tensor", "context", "expert", "pipeline")


def _ring(n: int) -> float:
  """The fraction of a gathered, reduced or exchanged buffer one device sends: (n-1)/n."""
  return (n - 1) / n


def minimum_bytes(model, layout: Layout, seq_len: int, precision: Precision) -> dict[str, float]:
  """{axis: bytes one device sends per step} for the axes in AXES (0 where the layout does not
  split it), as the module docstring defines them; `model` a ModelSpec or a ModelConfig."""
  m, lay, pr = model_spec(model), layout, precision
  ga, layers = lay.microbatches, stage_layers(m, lay)
  counts = param_counts(m, lay)
  full = 1 if lay.remat == "full" else 0
  tokens = lay.micro_batch * seq_len / lay.context  # per device and microbatch
  act = tokens * m.embed_dim * pr.act_bytes  # one [tokens, D] activation
  out = dict.fromkeys(AXES, 0.0)

  fsdp_group = lay.fsdp * (lay.data if lay.zero_stage == 3 else 1)
  gathered = counts.shardable
  if lay.splits_vocab(m.vocab_size, seq_len):
    gathered -= counts.tables
  gather_bytes = min(pr.param_bytes, pr.act_bytes)
  reduce_bytes = min(pr.grad_bytes, pr.act_bytes)
  out["fsdp"] = ga * _ring(fsdp_group) * gathered * (2 * gather_bytes + reduce_bytes)

  # The gradient shard each device reduces over the replicas: FSDP has split the shardable part.
  shard = counts.shardable / fsdp_group + counts.replicated
  experts = layers * m.expert_params() / (lay.tensor * lay.expert) / fsdp_group
  data = lay.data if lay.zero_stage < 3 else 1
  if lay.zero_stage == 2:
    # ZeRO-2 splits the gradients over data x context x expert (sharding.rules.ZERO_AXES; the
    # experts' own over data x context): every microbatch's are reduce-scattered over all of
    # them, the updated parameters gathered once.
    for group, part in ((data * lay.context * lay.expert, shard - experts),
                        (data * lay.context, experts)):
      out["data"] += _ring(group) * part * (ga * pr.grad_bytes + pr.param_bytes)
  else:
    if lay.zero_stage == 1 and data > 1:
      # Reduce-scattered over data first: what remains to reduce over context and expert is the
      # 1/data part each device owns.
      out["data"] += _ring(data) * shard * (pr.grad_bytes + pr.param_bytes)
      shard, experts, data = shard / data, experts / data, 1
    out["data"] += 2 * _ring(data * lay.context * lay.expert) * (shard - experts) * pr.grad_bytes
    out["data"] += 2 * _ring(data * lay.context) * experts * pr.grad_bytes

  if lay.tensor > 1:
    out["tensor"] = ga * ((4 + 2 * full) * layers + 2) * 2 * _ring(lay.tensor) * act

  ring, degree = context_parallel.factors(m, lay)
  if ring > 1:
    kv = tokens * context_parallel.attended_kv_heads(m, lay) * (m.head_dim + m.v_head_dim())
    hops = context_parallel.ring_hops(m, ring, seq_len)
    out["context"] += ga * layers * 3 * hops * kv * pr.act_bytes
  if degree > 1:
    payload = context_parallel.ulysses_payload(m, lay, tokens, pr.act_bytes)
    out["context"] += ga * layers * (2 + full) * _ring(degree) * payload

  _, group, share = exchange_group(m, lay)
  if group > 1:
    routed = act * share * m.moe.experts_per_token
    out["expert"] = ga * layers * m.moe_share() * (4 + 2 * full) * _ring(group) * routed

  if lay.pipeline > 1:
    sent = act / (lay.tensor if lay.sequence_parallel else 1)
    out["pipeline"] = 2 * ga * lay.virtual_stages * sent
  return out


def minimum_total(model, layout: Layout, seq_len: int, precision: Precision) -> float:
  """All axes' minimum bytes per device and step."""
  return math.fsum(minimum_bytes(model, layout, seq_len, precision).values())
