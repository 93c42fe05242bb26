"""Activations one layer stores for its backward, per token: the formulas of the analytic memory
estimate (sharding/plan/estimate.memory), by block and remat policy."""

import dataclasses

from sharding.layout import Layout


# kernels/grouped_matmul.py pads its operands' feature dims to this multiple (GroupedBlocks's
# largest block; tests/test_estimate_vs_compiled.py checks the two agree).
GROUPED_PADDING = 128


@dataclasses.dataclass(frozen=True)
class ActivationTerms:
  """Bytes stored per token per layer (Korthikanti et al. 2022, arXiv:2205.05198, sec. 4):
  `replicated` stays whole under TP (split only by SP), `split` is split by TP, `scores` (per unit
  of sequence length) is the attention-score part that selective recomputation drops."""

  replicated: float
  split: float
  scores: float
  layer_input: float  # the residual stream entering the layer: all that full recomputation keeps
  # The parts of `replicated` and `split` that selective recomputation drops besides the scores:
  # a dropless MoE's routed rows and router state (its grouped matmul is a kernel, not a dot).
  unsaved_replicated: float = 0.0
  unsaved_split: float = 0.0
  # Bytes per logit (vocab entry of a token), each formula's: the compute-dtype logits with a
  # float32 copy and gradient; the compiled step fuses the float32 softmax and keeps the logits
  # and their gradient.
  logit: float = 0.0


def activation_terms(model, act_bytes: int, formula: str = "llama",
                     kv_heads: float | None = None, fp8_layers: bool = False) -> ActivationTerms:
  """`playbook`: GPT blocks with dropout, sbh(34 + 5as/h) at 2 bytes, i.e. 10h + 24h + 5as
  (scaled by act_bytes/2). `llama`: our blocks (RMSNorm, GQA, SwiGLU, no dropout): norm inputs and
  outputs 4h whole; q and attention output 2h, k and v 2 K Dh, gate/up/product 3F split; per score
  element the reference attention keeps fp32 scores and probabilities and a compute-dtype copy of
  the probabilities, (8 + e) a s (nothing with fused flash attention). `compiled`: what
  meshtron's step compiled for GPUs keeps (tests/test_activation_formula.py measures it): XLA
  fuses the norms and the SwiGLU product into their consumers, so a layer keeps two residual-
  stream tensors whole (its input and the attention's residual sum; under selective remat the
  input and the output projection's dot), q, k, v, the attention output and gate/up split
  (selective: not the attention output, which the flash kernel recomputes), and the flash
  kernel's float32 log-sum-exp per head; with `fp8_layers` also each dense GEMM input quantized
  (1 byte): the two norms' outputs, the attention output and the SwiGLU product, which selective
  remat recomputes: two copies each with the layer scan (its stacks, to the byte), one with the
  layers stored apart (`layers_apart`: the quantization itself, no other copy). Measured on dense
  layers (one device; tensor=2 with and without SP), not: the fp8 copies under SP, the routed
  experts' fp8 inputs, a dropping MoE's routed terms (the `llama` ones, with 3f). `model`: an
  estimate.ModelSpec; `kv_heads`: the K that attention keeps (default the model's; more where
  Ulysses replicates them)."""
  m, e = model, act_bytes
  if formula == "playbook":
    return ActivationTerms(10 * m.embed_dim * e / 2, 24 * m.embed_dim * e / 2,
                           5 * m.num_heads * e / 2, m.embed_dim * e, logit=e + 8)
  if formula not in ("llama", "compiled"):
    raise ValueError(f"activation formula {formula!r} is not one of llama, compiled, playbook")
  compiled = formula == "compiled"
  mlp = 2 if compiled else 3  # gate and up (and the product, which the compiled step fuses)
  ff, whole, rows, unsaved = mlp * m.mlp_dim, 0.0, 0.0, 0.0
  dense_f = m.mlp_dim  # the dense SwiGLU width per token (MoE: its dense layers, shared experts)
  if m.moe:  # per token of a MoE layer (means over the layers), as its compiled layer keeps
    moe, share, f = m.moe, m.moe_share(), m.moe.expert_mlp_dim  # them (tests/test_estimate...)
    routed = (moe.shared_experts + moe.experts_per_token) * 3 * f + moe.num_experts  # logits
    if moe.dispatch == "dropless":  # each top-k row: its dispatched input and int32 index
      # (whole under TP), its expert's gate and up, padded like the grouped matmul's operands
      # (the product is recomputed); the router: float32 probabilities, int32 expert order.
      # Selective keeps only the router's float32 logits (a dot) of these.
      rows = share * moe.experts_per_token * 2 * -(-f // GROUPED_PADDING) * GROUPED_PADDING
      routed = moe.shared_experts * mlp * f
      whole = share * (moe.experts_per_token * (m.embed_dim + 4 / e) + moe.num_experts * 8 / e)
      unsaved = whole - share * moe.num_experts * 4 / e
    ff = routed * share + ff * (1 - share) + rows
    dense_f = m.mlp_dim * (1 - share) + moe.shared_experts * f * share
  qkvo = 2 * m.num_heads * m.head_dim + 2 * (kv_heads or m.num_kv_heads) * m.v_head_dim()
  # MLA: the compressed q and kv (with the rope key) and their norms' outputs, whole per device.
  latents = 0 if m.mla is None else \
      2 * m.mla.q_lora_rank + 2 * m.mla.kv_lora_rank + m.mla.qk_rope_head_dim
  scores = 0 if m.flash_attention else m.num_heads * (8 + e)
  if not compiled:
    return ActivationTerms((4 * m.embed_dim + latents + whole) * e, (qkvo + ff) * e, scores,
                           m.embed_dim * e, unsaved * e, rows * e, logit=e + 8)
  lse = 4 * m.num_heads if m.flash_attention else 0  # bytes: float32, per head
  attention_out = m.num_heads * m.v_head_dim() * e + lse  # what selective recomputes
  # fp8: 1-byte copies of each dense GEMM input (bytes, like lse); selective recomputes them.
  copies = 0 if not fp8_layers else 1 if m.layers_apart else 2
  fp8_whole = copies * 2 * m.embed_dim
  fp8_split = copies * (m.num_heads * m.v_head_dim() + dense_f)
  return ActivationTerms((2 * m.embed_dim + latents + whole) * e + fp8_whole,
                         (qkvo + ff) * e + lse + fp8_split, scores, m.embed_dim * e,
                         unsaved * e + fp8_whole, rows * e + attention_out + fp8_split,
                         logit=2 * e)


def layer_activation_bytes(terms: ActivationTerms, tokens: float, seq_len: int, layout: Layout,
                           remat: str) -> float:
  """Stored activations of one layer for `tokens` tokens on one device. none: replicated/(t if
  SP) + split/t + scores s/t; selective: neither scores nor the unsaved parts; full: the layer
  input (2sbh), / t under SP."""
  t, sp_div = layout.tensor, (layout.tensor if layout.sequence_parallel else 1)
  if remat == "full":
    return tokens * terms.layer_input / sp_div
  if remat == "none":
    return tokens * (terms.replicated / sp_div + terms.split / t + terms.scores * seq_len / t)
  return tokens * ((terms.replicated - terms.unsaved_replicated) / sp_div
                   + (terms.split - terms.unsaved_split) / t)
