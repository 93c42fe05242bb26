"""Models: logical names only, no mesh. Build abstractly, then materialize into shardings."""

from models.config import ModelConfig, MoEConfig
from models.transformer import Transformer
from models.builder import abstract_model, param_names

__all__ = ["ModelConfig", "MoEConfig", "Transformer", "abstract_model", "param_names"]
