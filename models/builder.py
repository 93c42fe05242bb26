"""Builds a model abstractly: its graph definition and its parameters' logical names."""

import jax
from flax import nnx

from models.compute import ComputeConfig
from models.config import ModelConfig
from models.transformer import Transformer
from sharding import Layout
from sharding.pipeline import stage_split


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


# The stacks compute.scan_layers=False stores apart: the layer stacks pipeline stages split.
LAYER_STACKS = stage_split.STACKS


def per_layer(params: dict) -> dict:
  """A pure dict of parameters with stacked layers (the scanned form) in the form of a model
  built with compute.scan_layers=False: each stack a dict of its layers, layer i row i."""
  def rows(stack):
    n = jax.tree.leaves(stack)[0].shape[0]
    return {i: jax.tree.map(lambda a, i=i: a[i], stack) for i in range(n)}
  return {k: rows(v) if k in LAYER_STACKS and v is not None and not is_per_layer(v) else v
          for k, v in params.items()}


def stacked(params: dict) -> dict:
  """`per_layer`'s inverse: each stack stored apart stacked again (a stacked one as it is)."""
  def stack(layers):
    return jax.tree.map(lambda *rows: jax.numpy.stack(rows),
                        *(layers[k] for k in sorted(layers, key=int)))
  return {k: stack(v) if k in LAYER_STACKS and is_per_layer(v) else v for k, v in params.items()}


def is_per_layer(stack) -> bool:
  """Whether a stack's pure dict holds its layers apart (keys are layer numbers; a checkpoint may
  give them back as strings)."""
  return isinstance(stack, dict) and bool(stack) and all(str(k).isdigit() for k in stack)
