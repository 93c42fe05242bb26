"""Builds a model abstractly: its graph definition and its parameters' logical names."""

import jax
from flax import nnx

from models.compute import ComputeConfig
from models.config import ModelConfig
from models.transformer import Transformer
from sharding import Layout


def abstract_model(cfg: ModelConfig, compute: ComputeConfig | None = None, layout=None):
  """Returns (graphdef, abstract params as a pure dict of ShapeDtypeStructs); allocates nothing.
  `compute` and `layout` as for Transformer (the graphdef keeps them)."""
  model = nnx.eval_shape(lambda: Transformer(cfg, compute, layout, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(model)
  return graphdef, nnx.to_pure_dict(state)


def param_names(cfg: ModelConfig, compute: ComputeConfig | None = None):
  """A pure dict matching the params, each leaf the tuple of that parameter's logical dim names
  (fp8's delayed recipe adds amax histories: `compute` decides)."""
  model = nnx.eval_shape(lambda: Transformer(cfg, compute, Layout(), rngs=nnx.Rngs(0)))
  state = nnx.state(model, nnx.Param)
  return nnx.to_pure_dict(jax.tree.map(lambda v: tuple(v.get_metadata()["out_sharding"]), state,
                                      is_leaf=lambda x: isinstance(x, nnx.Variable)))


def init_params(cfg: ModelConfig, key: jax.Array, compute: ComputeConfig | None = None):
  """Random parameters as a pure dict (call under jit with out_shardings to init sharded); the
  layout does not change them, so the model is built with a single device's."""
  model = Transformer(cfg, compute, Layout(), rngs=nnx.Rngs(params=key))
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))
