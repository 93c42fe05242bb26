"""TrainState, and initializing it directly into its shardings (nothing materialized unsharded)."""

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

import sharding
from sharding.pipeline import stage_split
from models.builder import init_params
from models.compute import ComputeConfig
from models.config import ModelConfig


class TrainState(struct.PyTreeNode):
  """Everything a step reads and writes; a plain pytree (params as a pure dict)."""

  step: jax.Array  # int32 scalar: optimizer steps taken
  params: Any
  opt_state: Any
  rng: jax.Array  # uint32[2]; split per step by whatever needs randomness
  loss_ema: jax.Array  # float32 running average of the loss (the loss-spike guard's baseline)


def _keys(seed: int) -> tuple[jax.Array, jax.Array]:
  """(parameter init key, the state's RNG key) of a run's seed."""
  params_key, state_key = jax.random.split(jax.random.PRNGKey(seed))
  return params_key, state_key


def fresh_state(params, tx: optax.GradientTransformation, seed: int) -> TrainState:
  """Step 0 around `params`: a new optimizer state, the run's RNG key, no loss history."""
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                    rng=_keys(seed)[1], loss_ema=jnp.zeros((), jnp.float32))


def make_init_fn(model_cfg: ModelConfig, tx: optax.GradientTransformation, seed: int,
                 stage_layers: stage_split.StackSplit = (), compute: ComputeConfig | None = None):
  """A pure function () -> TrainState for jax.eval_shape and jit(out_shardings=...): random
  parameters (trainer/hf_init.py starts from Hugging Face weights with `fresh_state` instead),
  the layer stacks padded for uneven pipeline stages (the same draws as unpadded); `compute`
  decides the fp8 state among them."""
  def init() -> TrainState:
    params = init_params(model_cfg, _keys(seed)[0], compute)
    return fresh_state(stored(params, stage_layers), tx, seed)
  return init


def stored(params, stage_layers: stage_split.StackSplit):
  """Parameters as the train state stores them: with uneven pipeline stages the layer stacks
  padded per position (sharding/pipeline/stage_split.py), else as they are."""
  return stage_split.pad_stacks(params, stage_layers)


def unstored(params, stage_layers: stage_split.StackSplit):
  """The model's own parameters (the padding rows dropped): for export and comparisons."""
  return stage_split.unpad_stacks(params, stage_layers)


def state_shardings(abstract: TrainState, names, tx: optax.GradientTransformation) -> TrainState:
  """NamedShardings of the whole state in the current sharding scope.

  Parameters follow their logical names; optimizer moments follow the parameter they belong to
  (optax.tree_map_params) in the optimizer-state view, which ZeRO >= 1 shards over `data` too;
  scalars and the RNG are replicated.
  """
  params = sharding.tree_shardings(names, abstract.params, "params", prefix="params/")
  moments = sharding.tree_shardings(names, abstract.params, "opt_state", prefix="opt_state/")
  # optax.partition (Muon) states hold an empty MaskedNode where a branch skips a parameter.
  masked = lambda x: isinstance(x, optax.MaskedNode)
  opt_state = optax.tree_map_params(
      tx, lambda moment, moment_sharding: moment if masked(moment) else moment_sharding,
      abstract.opt_state, moments, transform_non_params=lambda _: sharding.replicated(),
      is_leaf=masked)
  return TrainState(step=sharding.replicated(), params=params, opt_state=opt_state,
                    rng=sharding.replicated(), loss_ema=sharding.replicated())
