"""Hugging Face DeepseekV3ForCausalLM ⇄ meshtron: MLA weights and the DeepSeek-V3 MoE.

Owns the rope-dims permutation of MLA's weights (`RopeDeinterleaved`), DeepSeek-V3's parameter
table, its config.json conversions and `ARCHITECTURE`, its entry in the registry. It builds on
layouts.py only: the embedding, head and dense-MLP rows it shares with Llama live there.
"""

import numpy as np

from models.config import MLAConfig, MoEConfig, ModelConfig
from models.hf.layouts import (DENSE_MLP_ROWS, GLOBAL_ROWS, HEADS_IN, HEADS_OUT, LAYER_PREFIX, SAME,
                               TRANSPOSED, Architecture, Entry, llama_fields, rope_fields)

HF_NAME = "DeepseekV3ForCausalLM"


class RopeDeinterleaved:
  """A layout whose last dim (ours) ends in a rope part stored in DeepSeek's interleaved pairs
  (x0, x1), (x2, x3), ...; ours holds the same dims as halves (x0, x2, ...), (x1, x3, ...), the
  order models/rope.py rotates. Queries and keys are permuted alike, so every q.k is unchanged.
  Our last dim is never sharded (head_dim and latent are replicated), so reads take it whole."""

  def __init__(self, base, rope_dim: int):
    self.base, self.rope_dim = base, rope_dim

  def _order(self, size: int) -> np.ndarray:
    start = size - self.rope_dim
    rope = np.arange(start, size)
    return np.concatenate([np.arange(start), rope[0::2], rope[1::2]])

  def hf_shape(self, shape):
    return self.base.hf_shape(shape)

  def to_hf(self, x: np.ndarray) -> np.ndarray:
    return self.base.to_hf(x[..., np.argsort(self._order(x.shape[-1]))])

  def read(self, hf, index, shape):
    if index[-1] != slice(0, shape[-1]):
      raise ValueError("the rope dims' permutation needs the last dim whole (it is replicated)")
    return self.base.read(hf, index, shape)[..., self._order(shape[-1])]


def table(cfg: ModelConfig) -> tuple[Entry, ...]:
  """Every parameter of a DeepSeek-V3 model: MLA in both stacks, the dense layers' MLP, and the
  MoE layers' router (with its correction bias), experts and shared experts. HF numbers layers
  from 0 across both stacks: a MoE row i is HF layer first_dense_layers + i."""
  rope = cfg.mla.qk_rope_head_dim
  attn = LAYER_PREFIX + "self_attn."
  mla = (
      (("attn", "q_a", "w"), attn + "q_a_proj.weight", TRANSPOSED),
      (("attn", "q_a_norm", "scale"), attn + "q_a_layernorm.weight", SAME),
      (("attn", "q_b", "w"), attn + "q_b_proj.weight", RopeDeinterleaved(HEADS_IN, rope)),
      (("attn", "q", "w"), attn + "q_proj.weight", RopeDeinterleaved(HEADS_IN, rope)),
      (("attn", "kv_a", "w"), attn + "kv_a_proj_with_mqa.weight",
       RopeDeinterleaved(TRANSPOSED, rope)),
      (("attn", "kv_a_norm", "scale"), attn + "kv_a_layernorm.weight", SAME),
      (("attn", "kv_b", "w"), attn + "kv_b_proj.weight", HEADS_IN),
      (("attn", "o", "w"), attn + "o_proj.weight", HEADS_OUT),
      (("attn_norm", "scale"), LAYER_PREFIX + "input_layernorm.weight", SAME),
      (("mlp_norm", "scale"), LAYER_PREFIX + "post_attention_layernorm.weight", SAME))
  moe = LAYER_PREFIX + "mlp."
  moe_rows = (
      (("moe", "router", "w"), moe + "gate.weight", TRANSPOSED),
      (("moe", "router", "bias"), moe + "gate.e_score_correction_bias", SAME),
      *((("moe", "experts", ours, "w"), moe + "experts.{expert_id}." + theirs + ".weight",
         TRANSPOSED) for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"),
                                          ("down", "down_proj"))),
      *((("moe", "shared", ours, "w"), moe + f"shared_experts.{ours}_proj.weight", TRANSPOSED)
        for ours in ("gate", "up", "down")))
  dense_mlp = tuple((e.path[1:], e.hf_name, e.layout) for e in DENSE_MLP_ROWS)
  first_moe = cfg.moe.first_dense_layers if cfg.moe is not None else 0
  return (GLOBAL_ROWS
          + tuple(Entry(("layers",) + path, name, layout) for path, name, layout in mla + dense_mlp)
          + tuple(Entry(("moe_layers",) + path, name, layout, layer_offset=first_moe)
                  for path, name, layout in mla + moe_rows))


def config_from_hf(hf: dict, dtype: str) -> ModelConfig:
  """Our ModelConfig of a DeepseekV3 config.json (ValueError, one line, when unsupported)."""
  if not hf.get("rope_interleave", True):
    raise ValueError("rope_interleave=false is not supported (DeepSeek-V3 checkpoints store the"
                     " rope dims interleaved)")
  heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
  mla = MLAConfig(q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf["kv_lora_rank"],
                  qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                  v_head_dim=hf["v_head_dim"])
  moe = None
  if hf.get("first_k_dense_replace", 0) < layers:
    # The sigmoid router with the correction bias (updated at DeepSeek-V3's rate), top-k weights
    # normalized when norm_topk_prob, times routed_scaling_factor; group-limited; dropless.
    moe = MoEConfig(num_experts=hf["n_routed_experts"], experts_per_token=hf["num_experts_per_tok"],
                    expert_mlp_dim=hf["moe_intermediate_size"],
                    num_shared_experts=hf.get("n_shared_experts") or 0,
                    first_dense_layers=hf.get("first_k_dense_replace", 0), router="sigmoid",
                    normalize_top_k=bool(hf.get("norm_topk_prob", True)),
                    routed_scaling=float(hf.get("routed_scaling_factor", 1.0)),
                    expert_groups=hf.get("n_group") or 1, groups_per_token=hf.get("topk_group") or 1,
                    bias_update_rate=0.001, load_balance_loss=0.0001, router_z_loss=0.0,
                    dispatch="dropless")
  cfg = ModelConfig(
      vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"], num_layers=layers,
      num_heads=heads, num_kv_heads=heads, head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim,
      mlp_dim=hf["intermediate_size"], tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)), param_dtype=dtype, dtype=dtype, moe=moe,
      mla=mla, **rope_fields(hf))
  cfg.validate()
  return cfg


def config_to_hf(cfg: ModelConfig, base: dict | None = None) -> dict:
  """A DeepseekV3 config.json dict: Llama's fields (layouts.llama_fields, `base` keeping its other
  fields) amended with MLA's and the MoE's."""
  m, moe = cfg.mla, cfg.moe
  if cfg.qk_norm or cfg.sliding_window or moe is not None and (
      moe.router != "sigmoid" or not moe.bias_update_rate or not moe.expert_mlp_dim):
    raise ValueError("an MLA model exports as DeepseekV3ForCausalLM: no QK-norm or window, and a"
                     " MoE with the sigmoid router, its routing bias (moe.bias_update_rate > 0)"
                     " and moe.expert_mlp_dim set")
  moe = moe or MoEConfig(expert_mlp_dim=cfg.mlp_dim, first_dense_layers=cfg.num_layers)
  out = llama_fields(cfg, base)
  for key in ("mlp_bias", "sliding_window"):
    out.pop(key, None)
  out.update(
      architectures=[HF_NAME], model_type="deepseek_v3", num_key_value_heads=cfg.num_heads,
      head_dim=m.qk_rope_head_dim, q_lora_rank=m.q_lora_rank or None,
      kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
      qk_rope_head_dim=m.qk_rope_head_dim, qk_head_dim=cfg.head_dim, v_head_dim=m.v_head_dim,
      rope_interleave=True, n_routed_experts=moe.num_experts,
      num_experts_per_tok=moe.experts_per_token, moe_intermediate_size=moe.expert_mlp_dim,
      n_shared_experts=moe.num_shared_experts, first_k_dense_replace=moe.first_dense_layers,
      norm_topk_prob=moe.normalize_top_k, routed_scaling_factor=moe.routed_scaling,
      n_group=moe.expert_groups, topk_group=moe.groups_per_token,
      num_nextn_predict_layers=0)  # multi-token prediction modules are not exported
  return out


ARCHITECTURE = Architecture(
    name="deepseek_v3", hf_names=(HF_NAME,), matches=lambda cfg: cfg.mla is not None, table=table,
    config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    # A checkpoint's multi-token-prediction modules follow the main layers (model.layers.61.* of
    # DeepSeek-V3); they are not mapped, and transformers skips them too.
    unmapped_layers_from=lambda cfg: cfg.num_layers)
