"""Hugging Face ⇄ meshtron tables: config.json fields and parameter names and layouts."""

import dataclasses
import itertools

import numpy as np

from models.config import ModelConfig, MoEConfig

# HF class name -> the meshtron architecture it maps to.
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MixtralForCausalLM": "mixtral",
                 "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
                 "MistralForCausalLM": "mistral", "DeepseekV3ForCausalLM": "deepseek_v3"}
# Tensors some HF checkpoints carry that hold no parameter (recomputed buffers).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


# ---- layouts: how one HF tensor (torch Linear weights are [out, in]) relates to ours ----

class Same:
  """HF and meshtron store the tensor identically (embedding table, norm scales)."""

  def hf_shape(self, shape):
    return tuple(shape)

  def to_hf(self, x: np.ndarray) -> np.ndarray:
    return x

  def read(self, hf, index, shape):
    del shape
    return np.asarray(hf[index])


class Transposed:
  """HF [out, in] is our [in, out]: gate/up [F, D] -> [D, F], down [D, F] -> [F, D], head."""

  def hf_shape(self, shape):
    return tuple(shape[::-1])

  def to_hf(self, x: np.ndarray) -> np.ndarray:
    return x.T

  def read(self, hf, index, shape):
    del shape
    return np.asarray(hf[index[1], index[0]]).T


class HeadsIn:
  """q/k/v: HF [N*Dh, D] (rows grouped by head, then head dim) is our [D, N, Dh].

  HF's Llama already stores q and k in the half-split ("rotate_half") order that models/rope.py
  rotates, so this is a plain reshape: no interleave permutation.
  """

  def hf_shape(self, shape):
    d, n, dh = shape
    return (n * dh, d)

  def to_hf(self, x: np.ndarray) -> np.ndarray:
    d, n, dh = x.shape
    return x.reshape(d, n * dh).T

  def read(self, hf, index, shape):
    dh = shape[2]
    d_slice, n_slice, dh_slice = index
    rows = slice(n_slice.start * dh, n_slice.stop * dh)  # whole heads covering the request
    block = np.asarray(hf[rows, d_slice]).T
    return block.reshape(block.shape[0], -1, dh)[:, :, dh_slice]


class HeadsOut:
  """o: HF [D, H*Dh] is our [H, Dh, D]."""

  def hf_shape(self, shape):
    n, dh, d = shape
    return (d, n * dh)

  def to_hf(self, x: np.ndarray) -> np.ndarray:
    n, dh, d = x.shape
    return x.reshape(n * dh, d).T

  def read(self, hf, index, shape):
    dh = shape[1]
    n_slice, dh_slice, d_slice = index
    cols = slice(n_slice.start * dh, n_slice.stop * dh)
    block = np.asarray(hf[d_slice, cols]).T
    return block.reshape(-1, dh, block.shape[1])[:, dh_slice, :]


SAME, TRANSPOSED, HEADS_IN, HEADS_OUT = Same(), Transposed(), HeadsIn(), HeadsOut()


@dataclasses.dataclass(frozen=True)
class Entry:
  """One meshtron parameter and the HF tensors it is made of.

  `hf_name` has one placeholder per leading stacked dim of ours, in order: `{layer}` for the
  `layers` dim, then `{expert_id}` for an `experts` dim. Each (layer[, expert]) HF tensor is one
  slice of the stacked parameter, related to it by `layout`. HF layer = our row + `layer_offset`
  (DeepSeek's MoE stack follows its dense layers in one numbering).
  """

  path: tuple[str, ...]
  hf_name: str
  layout: object
  layer_offset: int = 0

  @property
  def stacked(self) -> int:
    return self.hf_name.count("{")

  def hf_names(self, lead_shape) -> list[tuple[tuple[int, ...], str]]:
    """(leading index, HF name) for every HF tensor of this parameter."""
    keys = ("layer", "expert_id")[:self.stacked]
    offsets = (self.layer_offset, 0)
    return [(idx, self.hf_name.format(**{k: i + o for k, i, o in zip(keys, idx, offsets)}))
            for idx in itertools.product(*(range(n) for n in lead_shape))]


LAYER_PREFIX = "model.layers.{layer}."
LLAMA = (
    Entry(("embed", "table"), "model.embed_tokens.weight", SAME),
    Entry(("final_norm", "scale"), "model.norm.weight", SAME),
    Entry(("head", "w"), "lm_head.weight", TRANSPOSED),  # absent when tied
    Entry(("layers", "attn_norm", "scale"), LAYER_PREFIX + "input_layernorm.weight", SAME),
    Entry(("layers", "attn", "q", "w"), LAYER_PREFIX + "self_attn.q_proj.weight", HEADS_IN),
    Entry(("layers", "attn", "k", "w"), LAYER_PREFIX + "self_attn.k_proj.weight", HEADS_IN),
    Entry(("layers", "attn", "v", "w"), LAYER_PREFIX + "self_attn.v_proj.weight", HEADS_IN),
    Entry(("layers", "attn", "o", "w"), LAYER_PREFIX + "self_attn.o_proj.weight", HEADS_OUT),
    # Qwen3's QK-norm scales (only in models with model.qk_norm).
    Entry(("layers", "attn", "q_norm", "scale"), LAYER_PREFIX + "self_attn.q_norm.weight", SAME),
    Entry(("layers", "attn", "k_norm", "scale"), LAYER_PREFIX + "self_attn.k_norm.weight", SAME),
    Entry(("layers", "mlp_norm", "scale"), LAYER_PREFIX + "post_attention_layernorm.weight", SAME),
    Entry(("layers", "mlp", "gate", "w"), LAYER_PREFIX + "mlp.gate_proj.weight", TRANSPOSED),
    Entry(("layers", "mlp", "up", "w"), LAYER_PREFIX + "mlp.up_proj.weight", TRANSPOSED),
    Entry(("layers", "mlp", "down", "w"), LAYER_PREFIX + "mlp.down_proj.weight", TRANSPOSED),
)
# Mixtral: every layer is a MoE block (our `moe_layers` stack) with the same attention and norms;
# on disk (transformers 5 still saves this per-expert format) each layer has a router and, per
# expert, w1 (gate) and w3 (up) [F, D] and w2 (down) [D, F]: one HF tensor per (layer, expert).
def _moe_table(block: str, gate: str, up: str, down: str) -> tuple[Entry, ...]:
  """Every layer a MoE block (`moe_layers`) with Llama's attention and norms; `block` holds the
  router `gate.weight` and, per expert, the gate/up [F, D] and down [D, F] weights."""
  prefix = LAYER_PREFIX + block
  experts = (("gate", gate), ("up", up), ("down", down))
  return tuple(
      dataclasses.replace(e, path=("moe_layers",) + e.path[1:]) for e in LLAMA
      if e.path[0] == "layers" and e.path[1] != "mlp") + tuple(
      e for e in LLAMA if e.path[0] != "layers") + (
      Entry(("moe_layers", "moe", "router", "w"), prefix + "gate.weight", TRANSPOSED),) + tuple(
      Entry(("moe_layers", "moe", "experts", ours, "w"),
            prefix + "experts.{expert_id}." + theirs + ".weight", TRANSPOSED)
      for ours, theirs in experts)


MIXTRAL = _moe_table("block_sparse_moe.", "w1", "w3", "w2")
# Qwen3-MoE: the same with QK-norm (in LLAMA's rows), Llama's projection names per expert.
QWEN3_MOE = _moe_table("mlp.", "gate_proj", "up_proj", "down_proj")


def entries(params: dict, cfg: ModelConfig) -> list[Entry]:
  """The table rows whose parameter exists in `params` (a pure dict; no head when tied)."""
  def has(path):
    node = params
    for key in path:
      if not isinstance(node, dict) or key not in node:
        return False
      node = node[key]
    return True
  if cfg.mla is not None:
    from models.hf import deepseek as hf_deepseek  # pylint: disable=import-outside-toplevel  (it builds on us)
    table = hf_deepseek.table(cfg)
  else:
    table = LLAMA if cfg.moe is None else QWEN3_MOE if cfg.qk_norm else MIXTRAL
  return [e for e in table if has(e.path)]


# ---- config.json <-> ModelConfig ----

def rope_fields(hf: dict) -> dict:
  """Rope fields from transformers 5 (`rope_parameters`) or 4 (`rope_theta` + `rope_scaling`)."""
  params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
  kind = params.get("rope_type", params.get("type", "default"))
  out = {"rope_theta": float(params.get("rope_theta", hf.get("rope_theta", 10_000.0)))}
  if kind == "default":
    return out
  if kind != "llama3":
    raise ValueError(f"rope type {kind!r} is not supported (supported: default, llama3)")
  return dict(out, rope_scaling_factor=float(params["factor"]),
              rope_low_freq_factor=float(params["low_freq_factor"]),
              rope_high_freq_factor=float(params["high_freq_factor"]),
              rope_original_max_len=int(params["original_max_position_embeddings"]))


def config_from_hf(hf: dict, dtype: str = "float32") -> ModelConfig:
  """Our ModelConfig from a HF config.json dict; ValueError (one line) when unsupported."""
  arch = (hf.get("architectures") or [None])[0]
  if arch not in ARCHITECTURES:
    raise ValueError(f"unsupported architecture {arch or hf.get('model_type')!r}"
                     f" (supported: {', '.join(ARCHITECTURES)})")
  for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
    if hf.get(key) not in (None, want):
      raise ValueError(f"{key}={hf[key]!r} is not supported (only {want!r})")
  if ARCHITECTURES[arch] == "deepseek_v3":
    from models.hf import deepseek as hf_deepseek  # pylint: disable=import-outside-toplevel  (it builds on us)
    return hf_deepseek.config_from_hf(hf, dtype)
  heads = hf["num_attention_heads"]
  if hf.get("use_sliding_window"):
    raise ValueError(f"use_sliding_window=true (window {hf.get('sliding_window')}) is not"
                     " supported (only full attention)")
  moe = None
  if ARCHITECTURES[arch] == "qwen3_moe":
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
  window = hf.get("sliding_window") if ARCHITECTURES[arch] in ("mistral", "mixtral") else None
  if ARCHITECTURES[arch] == "mixtral":
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
      qk_norm=ARCHITECTURES[arch] in ("qwen3", "qwen3_moe"), sliding_window=int(window or 0),
      **rope_fields(hf))
  cfg.validate()
  return cfg


def config_to_hf(cfg: ModelConfig, base: dict | None = None) -> dict:
  """A HF config.json dict: LlamaForCausalLM, Qwen3ForCausalLM (QK-norm), MixtralForCausalLM
  (MoE) or Qwen3MoeForCausalLM (MoE with QK-norm); `base` (e.g. the imported config) keeps its
  other fields (token ids, max_position_embeddings)."""
  moe = cfg.moe
  if moe is not None and cfg.mla is None and (moe.router != "softmax" or moe.num_shared_experts
                          or moe.first_dense_layers or moe.bias_update_rate
                          or moe.routed_scaling != 1.0 or not cfg.qk_norm and (
                              moe.mlp_dim(cfg.mlp_dim) != cfg.mlp_dim or not moe.normalize_top_k)):
    raise ValueError("only Mixtral- and Qwen3-MoE-style MoEs export to Hugging Face: softmax"
                     " router, no shared experts or dense layers, no routing bias or scaling"
                     " (Mixtral: expert width = model.mlp_dim, top-k weights renormalized)")
  rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
  if cfg.rope_scaling_factor != 1.0:
    rope.update(rope_type="llama3", factor=cfg.rope_scaling_factor,
                low_freq_factor=cfg.rope_low_freq_factor,
                high_freq_factor=cfg.rope_high_freq_factor,
                original_max_position_embeddings=cfg.rope_original_max_len)
  out = dict(base or {})
  out.setdefault("max_position_embeddings",
                 int(cfg.rope_original_max_len * max(cfg.rope_scaling_factor, 1.0)))
  # transformers 5 reads `rope_parameters` and `dtype`; 4 reads `rope_theta` + `rope_scaling` and
  # `torch_dtype`: write both spellings.
  legacy = ({k: v for k, v in rope.items() if k != "rope_theta"}
            if cfg.rope_scaling_factor != 1.0 else None)
  out.update(
      rope_theta=cfg.rope_theta, rope_scaling=legacy, torch_dtype=cfg.param_dtype,
      architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=cfg.vocab_size,
      hidden_size=cfg.embed_dim, intermediate_size=cfg.mlp_dim, num_hidden_layers=cfg.num_layers,
      num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
      head_dim=cfg.head_dim, hidden_act="silu", attention_bias=False, mlp_bias=False,
      rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings, rope_parameters=rope,
      dtype=cfg.param_dtype)
  if cfg.mla is not None:
    from models.hf import deepseek as hf_deepseek  # pylint: disable=import-outside-toplevel  (it builds on us)
    return hf_deepseek.config_to_hf(cfg, out)
  if cfg.sliding_window and cfg.qk_norm:
    raise ValueError("a Qwen3 model with model.sliding_window does not export to Hugging Face"
                     " yet (Mistral and Mixtral hold a window in every layer)")
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
