"""The Hugging Face architectures meshtron reads and writes, and dispatch to the right one.

Owns the list of families (each module's `ARCHITECTURE`) and the entry points checkpoint.py and
the tests use: which family a config.json or a ModelConfig is, its parameter rows, and the
config.json conversions. Adding a family: a module building on layouts.py, listed in FAMILIES.
"""

from models.builder import is_per_layer
from models.config import ModelConfig
from models.hf.deepseek import ARCHITECTURE as DEEPSEEK_V3
from models.hf.layouts import Architecture, Entry, check_supported
from models.hf.llama import ARCHITECTURE as LLAMA

# Order: the HF names in the "unsupported architecture" message; `matches` never overlaps.
FAMILIES: tuple[Architecture, ...] = (LLAMA, DEEPSEEK_V3)
# HF class name (config.json `architectures[0]`) -> its family; the keys are what is supported.
ARCHITECTURES: dict[str, Architecture] = {
    name: family for family in FAMILIES for name in family.hf_names}


def architecture_of_hf(hf: dict) -> Architecture:
  """The family of a HF config.json dict; ValueError (one line) naming the supported ones."""
  arch = (hf.get("architectures") or [None])[0]
  if arch not in ARCHITECTURES:
    raise ValueError(f"unsupported architecture {arch or hf.get('model_type')!r}"
                     f" (supported: {', '.join(ARCHITECTURES)})")
  return ARCHITECTURES[arch]


def architecture_of(cfg: ModelConfig) -> Architecture:
  """The family a meshtron ModelConfig exports as (and whose table names its parameters)."""
  return next(family for family in FAMILIES if family.matches(cfg))


def entries(params: dict, cfg: ModelConfig) -> list[Entry]:
  """The table rows whose parameter exists in `params` (a pure dict; no head when tied), per
  layer where a stack holds its layers apart."""
  def has(path):
    node = params
    for key in path:
      if not isinstance(node, dict) or key not in node:
        return False
      node = node[key]
    return True
  def rows(entry):  # a stack stored apart (compute.scan_layers=False): one row per layer
    stack = params.get(entry.path[0])
    return [entry.of_layer(k) for k in stack] if is_per_layer(stack) else [entry]
  return [e for entry in architecture_of(cfg).table(cfg) for e in rows(entry) if has(e.path)]


def config_from_hf(hf: dict, dtype: str = "float32") -> ModelConfig:
  """Our ModelConfig from a HF config.json dict; ValueError (one line) when unsupported."""
  family = architecture_of_hf(hf)
  check_supported(hf)
  return family.config_from_hf(hf, dtype)


def config_to_hf(cfg: ModelConfig, base: dict | None = None) -> dict:
  """A HF config.json dict for `cfg` (ValueError when no supported format holds it); `base`
  (e.g. the imported config) keeps its other fields (token ids, max_position_embeddings)."""
  return architecture_of(cfg).config_to_hf(cfg, base)
