"""Models: logical names only, no mesh. Build abstractly, then materialize into shardings."""

from models.builder import abstract_model, param_names
from models.compute import ComputeConfig
from models.config import ModelConfig, MoEConfig
from models.transformer import Transformer

__all__ = ["ComputeConfig", "ModelConfig", "MoEConfig", "Transformer", "abstract_model",
           "param_names"]
