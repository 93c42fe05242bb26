"""fp8 weights quantized once per step, before the microbatches (Megatron's --fp8-param-gather,
torchao's precompute_float8_dynamic_scale_for_fsdp).

With the tensorwise and delayed recipes a weight's fp8 copy is the same in every GEMM of a step:
one scale per tensor, from its current amax (tensorwise) or from the amax history the step
starts with (delayed). The train step (trainer/step.py) therefore quantizes every such weight
once, where its shard lives (the amax is an all-reduce max over the shards), and hands the
projections the fp8 copy with its scale: under FSDP the weight is gathered as e4m3, and the
microbatch loop reads a loop-invariant fp8 array, which XLA gathers as it gathers the bf16
weights, instead of quantizing (and gathering) per microbatch. The parameter itself still
receives dw (the GEMMs' straight-through gradient), and the delayed history its rolled value.
The numbers are those of quantizing in each GEMM: tests/test_fp8_weights.py.

Rowwise and blockwise quantize a weight differently for the forward GEMM and for dx's
(models/fp8/current.py), so their weights stay quantized in each GEMM.
"""

from typing import NamedTuple

import jax
from flax import nnx

from models.fp8 import current as fp8_current, delayed as fp8
from models.layers import Einsum
from sharding import constrain_tree

RECIPES = ("delayed", "tensorwise")  # those whose weight quantization is one per step


class QuantizedWeight(NamedTuple):
  q: jax.Array  # e4m3, the parameter's shape
  scale: jax.Array  # float32, one per layer of a stack
  history: jax.Array | None  # delayed: the weight's amax history with this step's amax rolled in


class Fp8Weight(nnx.Variable):
  """An Einsum's QuantizedWeight for one step: set by `attach`, never a parameter."""


def _quantize(module) -> QuantizedWeight:
  """The module's weight quantized per layer: vmapped over the stacking dims before its own."""
  def one(w, history):
    if module.fp8_recipe == "delayed":
      return QuantizedWeight(*fp8.quantize_weight(w, history, module.fp8_margin))
    return QuantizedWeight(*fp8_current.quantize_weight(w), None)

  w = module.w[...].astype(module.dtype)  # what Einsum quantizes (models/layers.py)
  history = getattr(module, "fp8_w", None)
  history = None if history is None else history[...]
  for _ in range(w.ndim - module.weight_rank):
    one = jax.vmap(one)
  weight = one(w, history)
  # Laid out as the parameter, so each device quantizes its own shard (and FSDP gathers fp8).
  names = tuple(module.w.get_metadata()["out_sharding"])
  return weight._replace(q=constrain_tree(weight.q, names, "params"))


def _quantizable(model):
  return [(path, m) for path, m in nnx.iter_graph(model)
          if isinstance(m, Einsum) and m.fp8_recipe in RECIPES]


def quantize_weights(model) -> dict:
  """{module path: QuantizedWeight} for every fp8 projection of `model` whose recipe is in
  RECIPES; empty when there is none."""
  return {path: _quantize(module) for path, module in _quantizable(model)}


def attach(model, weights: dict) -> None:
  """Hands each projection of `model` (merged inside the differentiated function) its weight
  from quantize_weights, which the layer scans then slice like the parameters. A projection
  `weights` leaves out quantizes in each GEMM (a pipeline stage gets only its chunk's)."""
  for path, module in _quantizable(model):
    if path in weights:
      module.w_fp8 = Fp8Weight(weights[path])
