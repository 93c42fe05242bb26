"""The memory-bound kernels of a step, priced analytically: the bytes the layers' elementwise
operations read and write, at the compiled-program model's copy bandwidth (profiles.py,
`copy_bandwidth`: a device-to-device copy measured on this workplace's H100).

What `plan` had left out of meshtron's kernels (hardware.matmul_seconds prices only matmuls).
Each operation is counted as the model's code writes it, its inputs read once and its outputs
written once (a = the activations' bytes, D the hidden width, per token and layer):

  operation                      forward                      backward
  RMSNorm (2 a layer)            read x, write y: 2aD each    read x, dy, write dx: 3aD each
  residual add (2 a layer)       read 2, write 1: 3aD each    the two paths' sum: 3aD each
  RoPE on q and k                read, write: 2a(q + k)       the same
  SwiGLU (F the MLP width)       read gate, up, write: 3aF    read gate, up, dh, write 2: 5aF
  routed copies (k a token)      4 gathers of a row: 8aD      the same
  combining a token's k rows     read k, write 1: (k + 1)aD   read 1, write k, read k: (2k+1)aD
  fp8 (tensorwise) per element   amax read, cast read, write 1 byte: 2a + 1, of each layer
                                 GEMM's input forward and of its output's gradient backward
  experts as batched GEMMs       each GEMM's rows into their  dy, dh into slots, dx and dh
  (moe.grouped_matmul=capacity,  slots, products back to the  back (gate's and up's dx apart),
  kernels/capacity_matmul.py;    rows: x and h in, gate, up   x and h in again for dW:
  b the GEMM input's bytes)      and down out: 2Db + 4Fa +    4Db + 2Fa + 6Fb + 4Da
                                 2Fb + 2Da
  the SwiGLU whole on the slots  x into the slots, the        dy and x into the slots, dx
  (moe.grouped_matmul=slots,     products out: 2Db + 2Da      out: 4Db + 2Da
  models/slot_experts.py)
  cross-entropy over V logits    read aV                      read, write: 2aV

The recomputed forwards (selective and full remat, the pipeline executor's) run the forward's
operations again. The routed experts' SwiGLU runs over the exchange buffer's rows
(hardware.grouped_rows_ratio), as their grouped matmul does. D-wide operations split over
`tensor` only under sequence parallelism (else each tensor rank runs them on every token); the
rest split over `tensor` always.

meshtron's pipeline executor (sharding/pipeline/executor.py) adds, per microbatch and weight of
the stage (`executor_bytes`): its backward tick adds the chunk's gradient, in the compute dtype,
into the float32 sums (read 2 + read and write 4 + 4 bytes; a chunk's slot is picked by the tick,
so no GEMM can add into it as Megatron's do), and its forward and backward ticks each copy the
chunk's weights out of the stage's stack (read and write, in the GEMMs' dtype: 1 byte under fp8)
where a tick picks a chunk (virtual stages) or cuts it into layers. Seen in the compiled
programs: Llama-3.1-405B TP8 PP8 CP2 VP8, 4.1 s of adds and 1.4 s of fp8 copies a step; a
DeepSeek-V3-like PP32 stage holding all 256 experts, 5.4 and 7.1 s. Under ZeRO-2 each tick's
gradient is reduce-scattered first, and only its part is added.

Not counted: the layer scan's copies into stacked residuals and the unpipelined step's gradient
accumulation (added in place or by the GEMMs: models/accumulating_scan.py, layers apart), the
router's softmax over experts (E values a token, against the rows' D), the multi-token
prediction modules, and launches (hardware.step_time's layer_overhead_s)."""

from sharding.layout import Layout
from sharding.plan.estimate import Precision, model_spec, param_counts, shards, stage_layers


def layer_bytes(model, layout: Layout, precision: Precision,
                rows_ratio: float = 1.0) -> tuple[float, float]:
  """(forward, backward) bytes a layer moves per token, mean over dense and MoE layers, counted
  at the full width as flops_split counts FLOPs (its `share` of tokens divides by `tensor`);
  D-wide work without sequence parallelism, which every tensor rank repeats, counts `tensor`
  times. `rows_ratio`: hardware.grouped_rows_ratio, the expert buffer's rows per routed row."""
  m, lay, a = model_spec(model), layout, precision.act_bytes
  d, q = m.embed_dim, m.num_heads * m.head_dim
  k_width, v_width = m.num_kv_heads * m.head_dim, m.num_kv_heads * m.v_head_dim()
  o_in = m.num_heads * m.v_head_dim()
  moe, moe_layers = m.moe, (m.moe_share() if m.moe else 0.0)
  dense = m.mlp_dim * (1 - moe_layers) + (
      moe.shared_experts * moe.expert_mlp_dim * moe_layers if moe else 0.0)
  copies = moe.experts_per_token * moe_layers if moe else 0.0  # routed rows a token, mean
  rows = copies * rows_ratio
  expert = moe.expert_mlp_dim if moe else 0
  wide = 1 if lay.sequence_parallel else lay.tensor  # D-wide work per device, in tensor shards
  cast = 2 * a + 1 if precision.fp8_layers else 0
  b = 1 if precision.fp8_layers else a  # the experts' GEMM inputs
  slots = {"capacity": (2 * d * b + 4 * expert * a + 2 * expert * b + 2 * d * a,
                        4 * d * b + 2 * expert * a + 6 * expert * b + 4 * d * a),
           "slots": (2 * d * b + 2 * d * a, 4 * d * b + 2 * d * a)}.get(
               moe.grouped_matmul if moe else "", (0, 0))
  forward = (wide * (10 * a * d + 8 * a * d * copies + (copies + moe_layers) * a * d) +
             2 * a * (q + k_width) + 3 * a * dense + 3 * a * expert * rows + slots[0] * rows)
  backward = (wide * (12 * a * d + 8 * a * d * copies + (2 * copies + moe_layers) * a * d) +
              2 * a * (q + k_width) + 5 * a * dense + 5 * a * expert * rows + slots[1] * rows)
  # fp8: the GEMMs' inputs (q/k/v's and the MLP's x, o's and down's inputs; each routed row's
  # x and down input), and their outputs' gradients backward.
  forward += cast * (wide * 2 * d + o_in + dense + wide * d * copies + expert * rows)
  backward += cast * (q + k_width + v_width + wide * 2 * d + 2 * dense +
                      wide * d * copies + 2 * expert * rows)
  return forward, backward


def memory_bound_seconds(model, layout: Layout, seq_len: int, precision: Precision, hw,
                         stages_recompute: bool = True, rows_ratio: float = 1.0) -> float:
  """A step's memory-bound kernels on the most loaded device, at hw.copy_bandwidth: every
  layer's forward (and its recomputed forwards) and backward, and the head's cross-entropy,
  over the tokens of all its microbatches (flops_split's share: the head on every stage, on
  1/stages of the tokens)."""
  m, lay = model_spec(model), layout
  tokens = lay.micro_batch * lay.microbatches * seq_len / lay.context
  share = tokens / (lay.tensor * lay.pipeline)
  remat = lay.stage_remat(m.num_layers, stages_recompute)
  forwards = 1 + int(remat != "none") + int(lay.stages_recompute(stages_recompute))
  forward, backward = layer_bytes(m, lay, precision, rows_ratio)
  layers = stage_layers(m, lay) * lay.pipeline
  head = 3 * precision.act_bytes * m.vocab_size
  executor = executor_bytes(m, lay, precision) if stages_recompute else 0.0
  return (share * (layers * (forwards * forward + backward) + head) + executor) / \
      hw.copy_bandwidth


def executor_bytes(model, layout: Layout, precision: Precision) -> float:
  """Bytes a step's pipeline ticks move over the stage's weights on one device (see the module):
  per microbatch, each weight's gradient added into its float32 sum, and, where ticks cut
  chunks from the stack, the weights copied by a forward and a backward tick. 0 unpipelined."""
  m, lay = model_spec(model), layout
  if lay.pipeline == 1:
    return 0.0
  counts = param_counts(m, lay)
  summed = ((counts.layers - counts.experts) / shards(lay)[1] +
            counts.experts / shards(lay, experts=True)[1])
  added = summed * (precision.act_bytes + 2 * (precision.grad_accum_bytes or 4))
  weight = 1 if precision.fp8_layers else precision.act_bytes
  cut = lay.virtual_stages > 1 or stage_layers(m, lay) > lay.virtual_stages
  copied = counts.layers * 2 * 2 * weight if cut else 0.0
  return lay.microbatches * (added + copied)
