"""The optax optimizer from OptimConfig: warmup + cosine, AdamW or Muon, clipping, weight-decay
mask, the parameters no optimizer moves (MoE routing biases, fp8 amax histories), and float32
master weights for bf16 parameters."""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers

from models.fp8.delayed import FP8_HISTORY
from models.moe import EXPERT_BIAS
from trainer.config import OptimConfig

# The stacked dims of the layers and of the multi-token prediction modules: one matrix per row.
_STACKED = ("layers", "mtp_layers")


def schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
  """Linear warmup to the peak, then cosine decay to min_learning_rate_ratio x peak.

  Evaluated at step + 1 so that the first step trains at the first warmup increment, not at 0.
  """
  warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
  base = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=warmup,
      decay_steps=max(total_steps, warmup + 1),
      end_value=cfg.learning_rate * cfg.min_learning_rate_ratio)
  return lambda step: base(step + 1)


def decay_mask(cfg: OptimConfig, names) -> dict:
  """True for parameters that get weight decay, from their logical names: matrices yes; norm
  scales and the embedding table only when configured."""
  def decays(param_names):
    dims = tuple(n for n in param_names if n not in _STACKED)
    if dims == ("norm",):
      return cfg.decay_norms
    if dims == ("vocab", "embed"):  # the input embedding table (also the head when tied)
      return cfg.decay_embeddings
    return len(dims) >= 2
  return jax.tree.map(decays, names, is_leaf=lambda x: isinstance(x, tuple))


def is_frozen(names: tuple) -> bool:
  """Whether the optimizer must leave a parameter alone, from its logical names: the MoE routing
  biases (`expert_bias`) and the fp8 amax histories, which the train step sets itself."""
  return EXPERT_BIAS in names or FP8_HISTORY in names


def frozen_mask(names) -> dict:
  """`is_frozen` of every parameter."""
  return jax.tree.map(is_frozen, names, is_leaf=lambda x: isinstance(x, tuple))


# Dims that index independent matrices of one parameter: each gets its own orthogonalization.
_BATCH_DIMS = (*_STACKED, "experts")


def muon_dims(names) -> MuonDimensionNumbers | None:
  """How Muon sees a parameter as fan-in x fan-out matrices, from its logical names; None: not a
  hidden matrix (embedding, head, norms, router, biases, fp8 state), which AdamW trains.

  Projections are embed -> rest (q/k/v [D, H, Dh], gate/up [D, F]), rest -> embed
  (o [H, Dh, D], down [F, D]) or, in MLA, latent -> rest (q_b, kv_b [R, H, Dh]); the stacked
  dims (`layers`, `mtp_layers`) and `experts` are batch dims.
  """
  if "vocab" in names or None in names or is_frozen(names):
    return None
  dims = [i for i, n in enumerate(names) if n not in _BATCH_DIMS]
  if len(dims) < 2 or not {"embed", "latent", "latent_rank"} & {names[i] for i in dims}:
    return None
  if names[dims[-1]] == "embed":
    return MuonDimensionNumbers(tuple(dims[:-1]), (dims[-1],))
  return MuonDimensionNumbers((dims[0],), tuple(dims[1:]))


def scale_to_adamw_rms(dims, rms: float) -> optax.GradientTransformation:
  """Moonlight (arXiv:2502.16982): x rms * sqrt(max(fan_in, fan_out)). An orthogonalized
  fan_in x fan_out update has RMS 1/sqrt(max(fan_in, fan_out)); this gives it AdamW's ~0.2, so
  AdamW's learning rate and weight decay carry over."""
  def scale(u, d):
    fan_in = math.prod(u.shape[i] for i in d.reduction_axis)
    fan_out = math.prod(u.shape[i] for i in d.output_axis)
    return u * jnp.asarray(rms * math.sqrt(max(fan_in, fan_out)), u.dtype)

  def update(updates, state, params=None):
    del params
    return jax.tree.map(scale, updates, dims,
                        is_leaf=lambda x: isinstance(x, MuonDimensionNumbers)), state
  return optax.GradientTransformation(optax.init_empty_state, update)


def _muon(cfg: OptimConfig, names, lr, adamw) -> optax.GradientTransformation:
  """Muon for hidden matrices, `adamw` for the rest, nothing for frozen parameters.

  Newton-Schulz on sharded matrices: the orthogonalization is plain jnp matmuls (X X^T, then
  polynomials of it times X) on the update as sharded as its parameter; under GSPMD each matmul
  runs sharded and XLA inserts the collectives, e.g. with the fan-in dim over `fsdp` an
  all-reduce of the [m, m] Gram matrix per iteration (m = the smaller dim). Nothing is gathered
  per matrix. sharding.plan.optimizer_cost.muon_newton_schulz counts those FLOPs and bytes.
  """
  def label(n):
    if is_frozen(n):
      return "frozen"
    return "muon" if muon_dims(n) else "adamw"

  is_names = lambda x: isinstance(x, tuple)
  labels = jax.tree.map(label, names, is_leaf=is_names)
  # The Muon branch sees the params with the other labels' leaves masked out (optax.MaskedNode).
  dims = jax.tree.map(lambda n: muon_dims(n) if label(n) == "muon" else optax.MaskedNode(),
                      names, is_leaf=is_names)
  muon = optax.chain(
      optax.contrib.scale_by_muon(ns_steps=cfg.muon_ns_steps, beta=cfg.muon_beta,
                                  nesterov=True, weight_dimension_numbers=dims),
      scale_to_adamw_rms(dims, cfg.muon_rms_scale),
      optax.add_decayed_weights(cfg.weight_decay),  # decoupled, as AdamW's: lr x wd x w
      optax.scale_by_learning_rate(lr))
  return optax.partition({"muon": muon, "adamw": adamw, "frozen": optax.set_to_zero()}, labels)


class MasterWeightsState(NamedTuple):
  master: Any  # float32 copies of the parameters (sharded like the moments: optax.tree_map_params)
  inner: Any  # the wrapped optimizer's state, kept for the master copies


def with_master_weights(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """`inner` trains float32 master copies of lower-precision (bf16) parameters, as Megatron's
  distributed optimizer and the playbook's mixed precision keep them: the gradients are cast to
  float32, `inner` updates the masters, and each parameter becomes its master rounded to the
  parameter's dtype. Updates too small for bf16 add up in the master instead of being lost.

  The returned update is master.astype(p.dtype) - p in float32, which optax.apply_updates adds
  exactly (both are bf16 values). A parameter set outside the optimizer (MoE routing biases, fp8
  amax histories: trainer/non_gradient.py) no longer rounds from its master: the master takes
  its value first.
  """
  def init(params):
    master = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
    return MasterWeightsState(master, inner.init(master))

  def update(grads, state, params):
    master = jax.tree.map(lambda m, p: jnp.where(m.astype(p.dtype) == p, m, p.astype(m.dtype)),
                          state.master, params)
    updates, inner_state = inner.update(
        jax.tree.map(lambda g: g.astype(jnp.float32), grads), state.inner, master)
    master = optax.apply_updates(master, updates)
    updates = jax.tree.map(lambda m, p: m.astype(p.dtype).astype(jnp.float32) - p, master, params)
    return updates, MasterWeightsState(master, inner_state)

  return optax.GradientTransformation(init, update)


def make_optimizer(cfg: OptimConfig, names, total_steps: int):
  """Returns (optax transformation, learning-rate schedule).

  Frozen parameters (see `frozen_mask`) get a zero update (and no weight decay: they are not
  matrices); without any, the transformation is exactly the plain one (same state tree). The
  zeroing is chained after AdamW rather than a multi_transform, whose MaskedNode-holding state
  optax.tree_map_params (state shardings) cannot map. With `cfg.master_weights` all of it trains
  float32 master copies of the parameters (with_master_weights).
  """
  tx, lr = _optimizer(cfg, names, total_steps)
  return (with_master_weights(tx) if cfg.master_weights else tx), lr


def _optimizer(cfg: OptimConfig, names, total_steps: int):
  lr = schedule(cfg, total_steps)
  adamw = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                      mask=decay_mask(cfg, names))
  if cfg.name == "muon":
    tx = _muon(cfg, names, lr, adamw)
    tx = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), tx) if cfg.clip_norm else tx
    return tx, lr
  tx = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw) if cfg.clip_norm else adamw
  frozen = frozen_mask(names)
  if any(jax.tree.leaves(frozen)):
    tx = optax.chain(tx, optax.masked(optax.set_to_zero(), frozen))
  return tx, lr
