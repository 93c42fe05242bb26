"""Hugging Face Llama family ⇄ meshtron: Llama, Mistral, Qwen3, Mixtral and Qwen3-MoE.

Owns these architectures' parameter tables and config.json conversions, and `ARCHITECTURE`, the
family's entry in the registry. They share Llama's attention and norms (Qwen3 adds QK-norm) and
differ in the MLP (dense, or every layer a MoE) and the sliding window (Mistral, Mixtral).
"""

import dataclasses

from models.config import ModelConfig, MoEConfig
from models.hf.layouts import (DENSE_MLP_ROWS, GLOBAL_ROWS, HEADS_IN, HEADS_OUT, LAYER_PREFIX, SAME,
                               TRANSPOSED, Architecture, Entry, llama_fields, rope_fields)

# HF class name -> the variant it is (what config_from_hf reads differently).
KINDS = {"LlamaForCausalLM": "llama", "MixtralForCausalLM": "mixtral",
         "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
         "MistralForCausalLM": "mistral"}

LLAMA = GLOBAL_ROWS + (
    Entry(("layers", "attn_norm", "scale"), LAYER_PREFIX + "input_layernorm.weight", SAME),
    Entry(("layers", "attn", "q", "w"), LAYER_PREFIX + "self_attn.q_proj.weight", HEADS_IN),
    Entry(("layers", "attn", "k", "w"), LAYER_PREFIX + "self_attn.k_proj.weight", HEADS_IN),
    Entry(("layers", "attn", "v", "w"), LAYER_PREFIX + "self_attn.v_proj.weight", HEADS_IN),
    Entry(("layers", "attn", "o", "w"), LAYER_PREFIX + "self_attn.o_proj.weight", HEADS_OUT),
    # Qwen3's QK-norm scales (only in models with model.qk_norm).
    Entry(("layers", "attn", "q_norm", "scale"), LAYER_PREFIX + "self_attn.q_norm.weight", SAME),
    Entry(("layers", "attn", "k_norm", "scale"), LAYER_PREFIX + "self_attn.k_norm.weight", SAME),
    Entry(("layers", "mlp_norm", "scale"), LAYER_PREFIX + "post_attention_layernorm.weight", SAME),
) + DENSE_MLP_ROWS


def _moe_table(block: str, gate: str, up: str, down: str) -> tuple[Entry, ...]:
  """Every layer a MoE block (`moe_layers`) with Llama's attention and norms; `block` holds the
  router `gate.weight` and, per expert, the gate/up [F, D] and down [D, F] weights."""
  prefix = LAYER_PREFIX + block
  experts = (("gate", gate), ("up", up), ("down", down))
  return tuple(
      dataclasses.replace(e, path=("moe_layers",) + e.path[1:]) for e in LLAMA
      if e.path[0] == "layers" and e.path[1] != "mlp") + GLOBAL_ROWS + (
      Entry(("moe_layers", "moe", "router", "w"), prefix + "gate.weight", TRANSPOSED),) + tuple(
      Entry(("moe_layers", "moe", "experts", ours, "w"),
            prefix + "experts.{expert_id}." + theirs + ".weight", TRANSPOSED)
      for ours, theirs in experts)


# Mixtral: on disk (transformers 5 still saves this per-expert format) each layer has a router
# and, per expert, w1 (gate) and w3 (up) [F, D] and w2 (down) [D, F]: one HF tensor per
# (layer, expert).
MIXTRAL = _moe_table("block_sparse_moe.", "w1", "w3", "w2")
# Qwen3-MoE: the same with QK-norm (in LLAMA's rows), Llama's projection names per expert.
QWEN3_MOE = _moe_table("mlp.", "gate_proj", "up_proj", "down_proj")


def table(cfg: ModelConfig) -> tuple[Entry, ...]:
  """Every row a model of this family may have (QK-norm rows only exist with model.qk_norm)."""
  return LLAMA if cfg.moe is None else QWEN3_MOE if cfg.qk_norm else MIXTRAL


def config_from_hf(hf: dict, dtype: str) -> ModelConfig:
  """Our ModelConfig of a config.json of this family (ValueError, one line, when unsupported);
  the registry has checked the architecture name and the fields every family shares."""
  kind = KINDS[hf["architectures"][0]]
  heads = hf["num_attention_heads"]
  if hf.get("use_sliding_window"):
    raise ValueError(f"use_sliding_window=true (window {hf.get('sliding_window')}) is not"
                     " supported (only full attention)")
  moe = None
  if kind == "qwen3_moe":
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
      raise ValueError("Qwen3-MoE with dense layers (mlp_only_layers, decoder_sparse_step) is not"
                       " supported (only every layer a MoE)")
    # Softmax over the experts, top-k, renormalized when norm_topk_prob; no shared expert.
    moe = MoEConfig(num_experts=hf.get("num_local_experts") or hf["num_experts"],
                    experts_per_token=hf["num_experts_per_tok"],
                    expert_mlp_dim=hf["moe_intermediate_size"], router="softmax",
                    normalize_top_k=bool(hf.get("norm_topk_prob", True)),
                    load_balance_loss=float(hf.get("router_aux_loss_coef", 0.001)),
                    router_z_loss=0.0, dispatch="dropless")
  # Mistral and Mixtral: a sliding window in every layer when config.json sets one.
  window = hf.get("sliding_window") if kind in ("mistral", "mixtral") else None
  if kind == "mixtral":
    # Mixtral routes by softmax over the experts, top-k, the k weights renormalized: our
    # "softmax" router. No z-loss; the HF balance-loss weight is kept. Dropless: nothing dropped.
    moe = MoEConfig(num_experts=hf["num_local_experts"], experts_per_token=hf["num_experts_per_tok"],
                    router="softmax", load_balance_loss=float(hf.get("router_aux_loss_coef", 0.02)),
                    router_z_loss=0.0, dispatch="dropless")
  cfg = ModelConfig(
      vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
      num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, mlp_dim=hf["intermediate_size"],
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)), param_dtype=dtype, dtype=dtype, moe=moe,
      qk_norm=kind in ("qwen3", "qwen3_moe"), sliding_window=int(window or 0), **rope_fields(hf))
  cfg.validate()
  return cfg


def config_to_hf(cfg: ModelConfig, base: dict | None = None) -> dict:
  """A HF config.json dict: LlamaForCausalLM, MistralForCausalLM (window), Qwen3ForCausalLM
  (QK-norm), MixtralForCausalLM (MoE) or Qwen3MoeForCausalLM (MoE with QK-norm); `base` (e.g. the
  imported config) keeps its other fields (token ids, max_position_embeddings)."""
  moe = cfg.moe
  if moe is not None and (moe.router != "softmax" or moe.num_shared_experts
                          or moe.first_dense_layers or moe.bias_update_rate
                          or moe.routed_scaling != 1.0 or not cfg.qk_norm and (
                              moe.mlp_dim(cfg.mlp_dim) != cfg.mlp_dim or not moe.normalize_top_k)):
    raise ValueError("only Mixtral- and Qwen3-MoE-style MoEs export to Hugging Face: softmax"
                     " router, no shared experts or dense layers, no routing bias or scaling"
                     " (Mixtral: expert width = model.mlp_dim, top-k weights renormalized)")
  if cfg.sliding_window and cfg.qk_norm:
    raise ValueError("a Qwen3 model with model.sliding_window does not export to Hugging Face"
                     " yet (Mistral and Mixtral hold a window in every layer)")
  out = llama_fields(cfg, base)
  if cfg.sliding_window and moe is None:  # Mistral: Llama's fields and the window
    out.update(architectures=["MistralForCausalLM"], model_type="mistral",
               sliding_window=cfg.sliding_window)
  if cfg.qk_norm:  # Qwen3: Llama's fields, QK-norm, full attention in every layer
    out.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", use_sliding_window=False,
               sliding_window=None, max_window_layers=cfg.num_layers,
               layer_types=["full_attention"] * cfg.num_layers)
    out.pop("mlp_bias", None)
  if moe is not None and cfg.qk_norm:
    out.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
               num_local_experts=moe.num_experts, num_experts=moe.num_experts,
               num_experts_per_tok=moe.experts_per_token,
               moe_intermediate_size=moe.mlp_dim(cfg.mlp_dim), norm_topk_prob=moe.normalize_top_k,
               decoder_sparse_step=1, mlp_only_layers=[],
               router_aux_loss_coef=moe.load_balance_loss)
  elif moe is not None:
    out.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
               num_local_experts=moe.num_experts, num_experts_per_tok=moe.experts_per_token,
               router_aux_loss_coef=moe.load_balance_loss,
               sliding_window=cfg.sliding_window or None)
    for key in ("mlp_bias", "attention_bias"):
      out.pop(key, None)
  return out


ARCHITECTURE = Architecture(
    name="llama", hf_names=tuple(KINDS), matches=lambda cfg: cfg.mla is None, table=table,
    config_from_hf=config_from_hf, config_to_hf=config_to_hf)
