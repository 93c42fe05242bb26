"""What every Hugging Face architecture builds on: tensor layouts, table rows, shared config fields.

The architecture modules (llama.py, deepseek.py) import this and models.config only, and the
registry imports them: the imports run one way, so no module needs another's from inside a
function. Owns: the layouts relating one HF tensor to ours (Same, Transposed, HeadsIn, HeadsOut),
`Entry` (one parameter's row), `Architecture` (what a family offers the registry), the rows every
family shares (embedding, final norm, head, the dense SwiGLU MLP), and the config.json fields and
checks common to all of them.
"""

import dataclasses
import itertools
from typing import Callable

import numpy as np

from models.config import ModelConfig


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


# One instance of each, shared by every table (a test wraps HEADS_IN.read to see what is read).
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
    keys = [k for k in ("layer", "expert_id") if "{" + k + "}" in self.hf_name]
    offsets = {"layer": self.layer_offset, "expert_id": 0}
    return [(idx, self.hf_name.format(**{k: i + offsets[k] for k, i in zip(keys, idx)}))
            for idx in itertools.product(*(range(n) for n in lead_shape))]

  def of_layer(self, key) -> "Entry":
    """This row for one layer of a stack stored apart (compute.scan_layers=False), at `key` in
    it: the layer's number is in the path and the HF name instead of a leading dim."""
    return dataclasses.replace(
        self, path=(self.path[0], key, *self.path[1:]), layer_offset=0,
        hf_name=self.hf_name.replace("{layer}", str(int(key) + self.layer_offset)))


@dataclasses.dataclass(frozen=True)
class Architecture:
  """One family of HF architectures: what the registry dispatches to.

  `matches` says whether a meshtron ModelConfig is of this family (export and `entries` pick the
  family by it; exactly one family matches any config). `unmapped_layers_from(cfg)`: HF layers
  numbered from here on hold modules we do not map and import skips (None: there are none).
  """

  name: str
  hf_names: tuple[str, ...]  # the HF class names (config.json `architectures[0]`) it reads
  matches: Callable[[ModelConfig], bool]
  table: Callable[[ModelConfig], tuple[Entry, ...]]
  config_from_hf: Callable[[dict, str], ModelConfig]
  config_to_hf: Callable[[ModelConfig, dict | None], dict]
  unmapped_layers_from: Callable[[ModelConfig], int | None] = lambda cfg: None


# ---- rows every family shares ----

LAYER_PREFIX = "model.layers.{layer}."
# Outside the layer stacks: embedding, final norm and the head (absent from params when tied).
GLOBAL_ROWS = (
    Entry(("embed", "table"), "model.embed_tokens.weight", SAME),
    Entry(("final_norm", "scale"), "model.norm.weight", SAME),
    Entry(("head", "w"), "lm_head.weight", TRANSPOSED),
)
# The dense SwiGLU MLP of a `layers` stack (Llama's every layer, DeepSeek's first dense layers).
DENSE_MLP_ROWS = (
    Entry(("layers", "mlp", "gate", "w"), LAYER_PREFIX + "mlp.gate_proj.weight", TRANSPOSED),
    Entry(("layers", "mlp", "up", "w"), LAYER_PREFIX + "mlp.up_proj.weight", TRANSPOSED),
    Entry(("layers", "mlp", "down", "w"), LAYER_PREFIX + "mlp.down_proj.weight", TRANSPOSED),
)


# ---- config.json <-> ModelConfig: what every family reads and writes alike ----

def check_supported(hf: dict) -> None:
  """ValueError (one line) for the config.json fields no family here supports but their default."""
  for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
    if hf.get(key) not in (None, want):
      raise ValueError(f"{key}={hf[key]!r} is not supported (only {want!r})")


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


def llama_fields(cfg: ModelConfig, base: dict | None) -> dict:
  """A LlamaForCausalLM config.json dict, which every family starts from and amends; `base` (e.g.
  the imported config) keeps its other fields (token ids, max_position_embeddings)."""
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
  return out
