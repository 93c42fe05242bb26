"""ModelConfig and MoEConfig: the architecture's numbers, derived sizes, parameter and FLOP counts."""

import dataclasses

from sharding.expert import EXCHANGES
from sharding.plan.estimate import attention_span

DTYPES = ("float32", "bfloat16", "float16")
ROUTERS = ("softmax", "sigmoid")
DISPATCHES = ("dropping", "dropless")
GROUPED_MATMULS = ("auto", "ragged_dot", "pallas", "capacity", "slots")


@dataclasses.dataclass(unsafe_hash=True)
class MoEConfig:
  """Mixture-of-experts feed-forward for the layers after `first_dense_layers` (models/moe.py).

  Routers: "softmax" (Mixtral: softmax over the experts, top-k, top-k weights renormalized when
  k > 1; Switch for k = 1) or "sigmoid" (DeepSeek-V3: sigmoid scores, top-k weights normalized to
  sum 1, times `routed_scaling`). With `bias_update_rate` > 0 each layer has a per-expert bias
  (DeepSeek-V3's auxiliary-loss-free balancing) that shifts which experts are selected, not how
  their outputs are mixed; the train step moves it by rate x sign(mean load - load).
  """

  num_experts: int = 8
  experts_per_token: int = 2  # top-k
  expert_mlp_dim: int = 0  # 0: model.mlp_dim
  num_shared_experts: int = 0  # always-active experts of expert_mlp_dim each, fused into one MLP
  first_dense_layers: int = 0  # leading layers that keep the dense MLP (DeepSeek-V3: 3)
  router: str = "softmax"
  load_balance_loss: float = 0.01  # weight of the Switch-style auxiliary loss
  router_z_loss: float = 0.001  # weight of the router z-loss (ST-MoE)
  bias_update_rate: float = 0.0  # > 0: aux-loss-free bias, updated by the train step
  # "dropping": each expert takes at most capacity_factor x its fair share of a sequence's
  # tokens (one-hot dispatch einsums; the rest are dropped and counted); "dropless": tokens
  # sorted by expert and run through a grouped matmul (nothing dropped).
  dispatch: str = "dropping"
  capacity_factor: float = 1.25
  routed_scaling: float = 1.0  # multiplies the routed experts' output (DeepSeek-V3: 2.5)
  # Dropless token exchange with expert > 1: "padded" all-to-all of worst-case buffers (works
  # everywhere), "ragged" all-to-all (GPU; XLA:CPU does not implement it), "auto": ragged on GPU.
  exchange: str = "auto"
  # Rows one device sends another per round of that exchange, as a multiple of the balanced
  # share (its tokens x k / expert devices): a heavier pair takes more rounds (all devices run
  # as many as the heaviest pair needs), nothing is dropped, and the buffers are sized by this,
  # not by the worst case (every token to one device). 0: worst-case buffers, one round.
  exchange_capacity: float = 2.0
  # True: the exchange's first round is differentiated as written, its received rows and expert
  # activations kept as the layer's remat policy says (remat=none: all of them), so the backward
  # runs neither its way there nor its expert FFN again; the rounds after it (a pair over its
  # capacity) are recomputed. More memory: one round's buffers per layer (Qwen3-30B-A3B FP8
  # EP16, exchange_capacity 2: 65.2 -> 75.9 GiB). False: every round recomputed from its inputs.
  keep_first_round: bool = False
  # The device's tokens split into this many equal chunks, each sorted, exchanged and run
  # through its experts on its own, so XLA's scheduler can run one chunk's exchange behind
  # another's expert matmuls (what Megatron's MoE all-to-all overlap and DeepSeek-V3's two
  # micro-batches do by hand). Each chunk's exchange has its own rounds and buffers (capacity
  # from its own rows); results are the same, only sums over rows (dW) in another order, and
  # fp8 scales per chunk. 1: one exchange of all the tokens. With expert > 1 only.
  exchange_chunks: int = 1
  # The dropless grouped matmul: "ragged_dot" (XLA's; on GPUs a dense GEMM over a masked copy
  # of the rows per expert, E times the FLOPs), "pallas" (kernels/grouped_matmul.py: each row
  # tile through its own experts only; Triton on GPUs, interpreted on CPU), "capacity"
  # (kernels/capacity_matmul.py: batched GEMMs over M / E slots per expert, in rounds until every
  # row ran), "slots" (models/slot_experts.py: the same slots, but the whole SwiGLU runs on them:
  # the rows gathered in and the products out once a round, not around every GEMM), "auto":
  # pallas on GPUs, ragged_dot elsewhere.
  grouped_matmul: str = "auto"
  # The top-k weights renormalized to sum 1 (Mixtral, DeepSeek-V3; Qwen3-MoE's norm_topk_prob);
  # False: the router's own probabilities of the chosen experts.
  normalize_top_k: bool = True
  # Group-limited routing (DeepSeek-V3: 8 groups, 4 per token): the experts form `expert_groups`
  # equal groups, each token keeps the `groups_per_token` groups whose two best selection scores
  # sum highest, and picks its top-k among their experts only. 1 group: no limit.
  expert_groups: int = 1
  groups_per_token: int = 1

  def mlp_dim(self, model_mlp_dim: int) -> int:
    return self.expert_mlp_dim or model_mlp_dim

  def validate(self, num_layers: int) -> None:
    """Raises ValueError with a one-line message for an inconsistent MoE."""
    for name in ("num_experts", "experts_per_token", "capacity_factor", "routed_scaling"):
      if getattr(self, name) <= 0:
        raise ValueError(f"model.moe.{name} must be positive, got {getattr(self, name)}")
    for name in ("expert_mlp_dim", "num_shared_experts", "first_dense_layers",
                 "load_balance_loss", "router_z_loss", "bias_update_rate",
                 "exchange_capacity"):
      if getattr(self, name) < 0:
        raise ValueError(f"model.moe.{name} must be >= 0, got {getattr(self, name)}")
    if self.exchange_chunks < 1:
      raise ValueError(f"model.moe.exchange_chunks must be >= 1, got {self.exchange_chunks}")
    if self.experts_per_token > self.num_experts:
      raise ValueError(f"model.moe.experts_per_token={self.experts_per_token} exceeds"
                       f" model.moe.num_experts={self.num_experts}")
    if self.first_dense_layers >= num_layers:
      raise ValueError(f"model.moe.first_dense_layers={self.first_dense_layers} leaves no MoE"
                       f" layer of model.num_layers={num_layers}")
    if self.expert_groups < 1 or self.num_experts % self.expert_groups:
      raise ValueError(f"model.moe.expert_groups={self.expert_groups} must divide"
                       f" model.moe.num_experts={self.num_experts}")
    if self.expert_groups > 1:
      per_group = self.num_experts // self.expert_groups
      if not 1 <= self.groups_per_token <= self.expert_groups or \
          self.groups_per_token * per_group < self.experts_per_token or per_group < 2:
        raise ValueError(f"model.moe.groups_per_token={self.groups_per_token} must be 1 to"
                         f" expert_groups={self.expert_groups}, keep at least experts_per_token="
                         f"{self.experts_per_token} experts, and groups need 2 experts each")
    for name, allowed in (("router", ROUTERS), ("dispatch", DISPATCHES), ("exchange", EXCHANGES),
                          ("grouped_matmul", GROUPED_MATMULS)):
      if getattr(self, name) not in allowed:
        raise ValueError(f"model.moe.{name}={getattr(self, name)!r} is not one of {allowed}")


@dataclasses.dataclass(unsafe_hash=True)
class MLAConfig:
  """Multi-head latent attention (DeepSeek-V2/V3; models/mla.py). Queries come from a low-rank
  latent of `q_lora_rank` (0: a full projection), keys and values from one shared latent of
  `kv_lora_rank`, each latent RMS-normed. Each head's query/key is a `qk_nope_head_dim` part
  without position and a `qk_rope_head_dim` part with RoPE (one rope key shared by every head);
  values have `v_head_dim`. The model's head_dim is the q/k head dim (nope + rope) and its
  num_kv_heads equals num_heads: keys and values are expanded per head from the latent."""

  q_lora_rank: int = 0
  kv_lora_rank: int = 64
  qk_nope_head_dim: int = 32
  qk_rope_head_dim: int = 16
  v_head_dim: int = 32

  def validate(self, model) -> None:
    """Raises ValueError with a one-line message for an inconsistent MLA."""
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
      if getattr(self, name) <= 0:
        raise ValueError(f"model.mla.{name} must be positive, got {getattr(self, name)}")
    if self.q_lora_rank < 0 or self.qk_rope_head_dim % 2:
      raise ValueError(f"model.mla.q_lora_rank must be >= 0 (0: no query latent) and"
                       f" qk_rope_head_dim even, got {self.q_lora_rank}, {self.qk_rope_head_dim}")
    qk = self.qk_nope_head_dim + self.qk_rope_head_dim
    if model.head_dim != qk or model.num_kv_heads != model.num_heads:
      raise ValueError(f"with model.mla, set model.head_dim={qk} (qk_nope_head_dim +"
                       f" qk_rope_head_dim) and model.num_kv_heads={model.num_heads}"
                       f" (= num_heads), got {model.head_dim} and {model.num_kv_heads}")

  def params(self, embed_dim: int, heads: int) -> int:
    """Projection weights of one MLA layer (q, kv latent with the rope key, kv up, o)."""
    d, qk = embed_dim, self.qk_nope_head_dim + self.qk_rope_head_dim
    q = d * self.q_lora_rank + self.q_lora_rank * heads * qk if self.q_lora_rank else d * heads * qk
    kv = d * (self.kv_lora_rank + self.qk_rope_head_dim)
    kv += self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
    return q + kv + heads * self.v_head_dim * d

  def norm_params(self) -> int:
    return self.q_lora_rank + self.kv_lora_rank


@dataclasses.dataclass(unsafe_hash=True)
class ModelConfig:
  """A Llama-style decoder's architecture (dimension letters, as in docs/conventions.md: V vocab,
  D embed, H heads, K kv heads, d head dim, F mlp; the layer count is `num_layers`). How it is
  computed is the run's (models/compute.py). Hashable (a built Transformer keeps a copy of its
  config: models/transformer.py); treat it as read-only once a model is built."""

  vocab_size: int = 264
  embed_dim: int = 128
  num_layers: int = 4
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 32
  mlp_dim: int = 384
  tie_embeddings: bool = False
  norm_eps: float = 1e-5
  rope_theta: float = 10_000.0
  # Llama-3 RoPE frequency scaling; factor 1.0 means no scaling.
  rope_scaling_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_len: int = 8192
  # Std of the embedding init; projections use fan-in scaling.
  embed_init_std: float = 0.02
  param_dtype: str = "float32"
  dtype: str = "float32"  # compute dtype of activations and matmuls
  moe: MoEConfig | None = None  # None: every layer has the dense MLP (Llama)
  # Qwen3's QK-norm: q and k each through an RMSNorm over the head dim (one scale of head_dim
  # shared by the heads) after their projection, before RoPE.
  qk_norm: bool = False
  # Sliding-window attention in every layer (Mistral): each token attends to the last
  # `sliding_window` tokens, itself included; 0: full causal attention.
  sliding_window: int = 0
  # With a window: every `full_attention_every`-th layer (layers N-1, 2N-1, ...) attends fully
  # instead, the others through the window (GPT-OSS: 2, alternating; Gemma 3: 6, five local to
  # one global). 0: the window in every layer (Mistral).
  full_attention_every: int = 0
  # Multi-head latent attention (DeepSeek-V3) in place of grouped-query attention; None: GQA.
  mla: MLAConfig | None = None
  # DeepSeek-V3's multi-token prediction (models/mtp.py): `mtp_depth` sequential modules, module
  # k predicting the token k + 1 positions after the next; their cross-entropy joins the loss
  # times mtp_loss_weight / mtp_depth (DeepSeek-V3: depth 1, weight 0.3, later 0.1). 0: off.
  # Training only: the model's logits never use them.
  mtp_depth: int = 0
  mtp_loss_weight: float = 0.3

  def __post_init__(self):
    if isinstance(self.moe, dict):  # from dataclasses.asdict (e.g. a config sent to a subprocess)
      self.moe = MoEConfig(**self.moe)
    if isinstance(self.mla, dict):
      self.mla = MLAConfig(**self.mla)

  def validate(self) -> None:
    """Raises ValueError with a one-line message for an inconsistent architecture."""
    # The rope and norm settings too: a zero theta or factor would only show as NaN losses.
    positive = ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                "mlp_dim", "norm_eps", "rope_theta", "rope_scaling_factor",
                "rope_original_max_len", "embed_init_std")
    for name in positive:
      if not getattr(self, name) > 0:  # "not > 0": NaN too
        raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
    if self.rope_scaling_factor != 1 and not (
        0 < self.rope_low_freq_factor < self.rope_high_freq_factor):
      raise ValueError(f"with model.rope_scaling_factor={self.rope_scaling_factor}, Llama-3's"
                       " scaling needs 0 < model.rope_low_freq_factor < rope_high_freq_factor,"
                       f" got {self.rope_low_freq_factor} and {self.rope_high_freq_factor}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"model.num_heads={self.num_heads} must be a multiple of"
                       f" model.num_kv_heads={self.num_kv_heads} (grouped-query attention)")
    if self.head_dim % 2:
      raise ValueError(f"model.head_dim={self.head_dim} must be even for rotary embeddings")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"model.{name}={getattr(self, name)!r} is not one of {DTYPES}")
    if self.sliding_window < 0:
      raise ValueError(f"model.sliding_window must be >= 0 (0: full attention), got"
                       f" {self.sliding_window}")
    if self.full_attention_every:
      stacks = (self.dense_layers(), self.moe_layers())
      if not self.sliding_window or self.full_attention_every < 2 or any(
          n % self.full_attention_every for n in stacks):
        raise ValueError(f"model.full_attention_every={self.full_attention_every} needs"
                         f" model.sliding_window > 0, a period >= 2, and dense and MoE layer"
                         f" counts {stacks} that are multiples of it")
    if self.moe is not None:
      self.moe.validate(self.num_layers)
    if self.mla is not None:
      self.mla.validate(self)
    if self.mtp_depth < 0 or self.mtp_loss_weight < 0:
      raise ValueError(f"model.mtp_depth and model.mtp_loss_weight must be >= 0 (depth 0: no"
                       f" multi-token prediction), got {self.mtp_depth} and {self.mtp_loss_weight}")

  # ---- parameter counts (the formulas the tests check against the built model) ----

  def layer_params(self) -> int:
    """One dense layer: attention, the SwiGLU MLP and the norm scales."""
    return self._attention_params() + 3 * self.embed_dim * self.mlp_dim + self._norm_params()

  def _attention_params(self) -> int:
    d, h, k, dh = self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim
    if self.mla is not None:
      return self.mla.params(d, h)
    return d * h * dh + 2 * d * k * dh + h * dh * d  # q, k, v, o

  def v_head_dim(self) -> int:
    """The value (and attention output) head dim: head_dim, or MLA's v_head_dim."""
    return self.head_dim if self.mla is None else self.mla.v_head_dim

  def _norm_params(self) -> int:
    """A layer's norm scales: before attention and the MLP, Qwen3's QK-norm (q and k) and MLA's
    latent norms."""
    mla = self.mla.norm_params() if self.mla is not None else 0
    return 2 * self.embed_dim + (2 * self.head_dim if self.qk_norm else 0) + mla

  def dense_layers(self) -> int:
    return self.num_layers if self.moe is None else self.moe.first_dense_layers

  def moe_layers(self) -> int:
    return self.num_layers - self.dense_layers()

  def moe_layer_params(self, experts: int | None = None) -> int:
    """One MoE layer with all routed experts, or only `experts` of them (the active ones)."""
    m, d = self.moe, self.embed_dim
    f = m.mlp_dim(self.mlp_dim)
    experts = m.num_experts if experts is None else experts
    router = d * m.num_experts + (m.num_experts if m.bias_update_rate > 0 else 0)
    shared = 3 * d * f * m.num_shared_experts
    return self._attention_params() + router + shared + experts * 3 * d * f + self._norm_params()

  def embedding_params(self) -> int:
    return self.vocab_size * self.embed_dim

  def _params(self, moe_layer: int) -> int:
    head = 0 if self.tie_embeddings else self.vocab_size * self.embed_dim
    return (self.embedding_params() + self.dense_layers() * self.layer_params() + moe_layer
            * self.moe_layers() + self.embed_dim + head)

  def num_params(self) -> int:
    """Every parameter (all experts)."""
    return self._params(self.moe_layer_params() if self.moe else 0) + self.mtp_params()

  def active_params(self) -> int:
    """Parameters one token uses: routed experts counted top-k times; embedding and head
    included (Mixtral-8x7B: 12.9B of 46.7B)."""
    return self._params(self.moe_layer_params(self.moe.experts_per_token) if self.moe else 0) + \
        self.mtp_params(self.moe.experts_per_token if self.moe else None)

  def mtp_params(self, experts: int | None = None) -> int:
    """The multi-token prediction modules (models/mtp.py), each: embedding and hidden norms, the
    [2D, D] projection, one block like the last layer (MoE: all routed experts, or `experts` of
    them) and an output norm. The embedding and the head are the model's, counted once."""
    d = self.embed_dim
    block = self.moe_layer_params(experts) if self.moe else self.layer_params()
    return self.mtp_depth * (3 * d + 2 * d * d + block)

  def mtp_matmul_params(self) -> int:
    """Matmul weights a token passes through in the MTP modules: projection, the block's (top-k
    experts; no norms, no routing bias) and the shared head, once per module."""
    if self.moe is None:
      block = self.layer_params()
    else:
      bias = self.moe.num_experts if self.moe.bias_update_rate > 0 else 0
      block = self.moe_layer_params(self.moe.experts_per_token) - bias
    d = self.embed_dim
    return self.mtp_depth * (2 * d * d + block - self._norm_params() + self.vocab_size * d)

  def flops_per_token(self, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (active matmul parameters) + causal attention scores.

    Matmul parameters exclude the embedding lookup, norm scales and router biases but include
    the output head (tied or not) and the routers; MoE layers count their top-k experts.
    Attention: QK^T and AV are 2 x L x H x (Dh + Dv) x seq FLOPs forward per token without
    masking; the causal mask halves it, and backward doubles forward twice (x3 total):
    3 x L x H x (Dh + Dv) x seq (Dv = Dh but for MLA). A sliding window replaces seq by its
    span (sharding.plan.estimate.attention_span).
    """
    matmul = self.dense_layers() * (self.layer_params() - self._norm_params())
    if self.moe is not None:
      bias = self.moe.num_experts if self.moe.bias_update_rate > 0 else 0
      active = self.moe_layer_params(self.moe.experts_per_token)
      matmul += self.moe_layers() * (active - self._norm_params() - bias)
    matmul += self.vocab_size * self.embed_dim
    attention = 3 * self.num_layers * self.num_heads * (self.head_dim + self.v_head_dim())
    attention *= attention_span(seq_len, self.sliding_window, self.full_attention_every)
    # The MTP modules: their matmuls, and each block's attention like one more layer's.
    attention *= 1 + self.mtp_depth / self.num_layers
    return 6.0 * (matmul + self.mtp_matmul_params()) + attention
