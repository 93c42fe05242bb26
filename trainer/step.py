"""THE pure train step and eval step: no mesh, no branch on the parallel layout."""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from models.fp8 import FP8_HISTORY
from models.moe import EXPERT_BIAS, update_bias
from sharding import constrain, constrain_tree, excluding, gradient_replica_axes, zigzag
from sharding.pipeline import pipeline_stages
from trainer import loss
from trainer.pipeline_step import make_pipeline_grads_fn
from trainer.loss import moe_metrics
from trainer.state import TrainState

BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")


def _loss_sums(graphdef, z_loss: float):
  def loss_sums(params, batch):
    model = nnx.merge(graphdef, params)
    if model.loss_impl == "chunked":  # the model's config decides; the head meets the loss here
      hidden, aux = model.hidden(batch["inputs"], batch["positions"], batch["segment_ids"],
                                 return_aux=True)
      loss_sum, stats = loss.chunked_cross_entropy_sums(
          hidden, model.head_weights(), batch["targets"], batch["loss_mask"], z_loss,
          model.loss_chunk_size)
    else:
      logits, aux = model(batch["inputs"], batch["positions"], batch["segment_ids"],
                          return_aux=True)
      loss_sum, stats = loss.cross_entropy_sums(logits, batch["targets"], batch["loss_mask"],
                                                z_loss)
    if aux:  # MoE layers: router losses join the loss, routing counts the stats
      loss_sum, stats = loss.add_moe_losses(loss_sum, stats, aux, batch["loss_mask"],
                                            *model.moe_loss_weights)
    return loss_sum, dict(stats, loss_sum=loss_sum)
  return loss_sums


def split_microbatches(batch: dict, n: int) -> dict:
  """[B, L] -> [n, B/n, L], taking every n-th row so each microbatch stays spread over all
  data-parallel devices (a contiguous split would put each microbatch on a subset of them)."""
  def split(x):
    x = x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1)
    return constrain(x, (None, "batch", "seq"))
  return {k: split(v) for k, v in batch.items()}


def fp8_mask(names) -> dict:
  """True for the fp8 amax histories (models/fp8.py), whose "gradients" are their new values."""
  return jax.tree.map(lambda n: n[-1] == FP8_HISTORY, names,
                      is_leaf=lambda x: isinstance(x, tuple))


def make_grads_fn(graphdef, names, *, microbatches: int = 1, z_loss: float = 0.0,
                  pipeline_schedule: str = "1f1b", virtual_stages: int = 1,
                  grad_accum_dtype: str = "float32"):
  """Returns grads_fn(params, batch) -> (mean gradients, summed stats).

  With the layer stack split over pipeline stages, the microbatches flow through the stages by
  `pipeline_schedule` instead (trainer/pipeline_step.py); the result is the same.

  Gradients are sums over tokens accumulated over a `lax.scan` of microbatches, then divided by
  the batch's token count: N microbatches give the gradient of one batch of N times the size.
  They are constrained to the gradient view of the layout (sharded over `data` from ZeRO-2 on,
  also while accumulating). The sums are carried in `grad_accum_dtype` and the mean is cast back
  to each parameter's dtype. fp8 amax histories are not gradients but new state: microbatches and
  replicas combine them by max (an amax over the whole batch), and they are not divided.
  """
  grad_fn = jax.grad(_loss_sums(graphdef, z_loss), has_aux=True)
  is_fp8 = fp8_mask(names)
  accum_dtype = jnp.dtype(grad_accum_dtype)

  def combine(fp8, total, new):
    return jnp.maximum(total, new) if fp8 else total + new.astype(total.dtype)

  def sharded_grad_fn(params, batch):
    grads, stats = grad_fn(params, batch)
    return constrain_tree(grads, names, "grads"), stats

  def replica_grads(params, micro):
    """Per-replica partial sums [R, ...]: each data-parallel replica differentiates its own rows
    and keeps the result, so accumulation needs no communication (R = 1 without replicas)."""
    axes, replicas = gradient_replica_axes()
    per_replica = {k: v.reshape(replicas, v.shape[0] // replicas, *v.shape[1:])
                   for k, v in micro.items()}
    with excluding(axes):
      return jax.vmap(sharded_grad_fn, in_axes=(None, 0), spmd_axis_name=axes or None)(
          params, per_replica)

  pipelined = make_pipeline_grads_fn(graphdef, microbatches=microbatches, z_loss=z_loss,
                                     schedule=pipeline_schedule, virtual=virtual_stages,
                                     split_microbatches=split_microbatches)

  def grads_fn(params, batch):
    batch = zigzag(batch)  # load-balanced sequence order under context parallelism, else as is
    if pipeline_stages() > 1:  # the one place a layout changes the computation's structure
      grads, stats = pipelined(params, batch)
      return constrain_tree(grads, names, "grads"), stats
    if microbatches == 1:
      grads, stats = sharded_grad_fn(params, batch)
    else:
      def accumulate(carry, micro):
        grads, stats = replica_grads(params, micro)
        return (jax.tree.map(combine, is_fp8, carry[0], grads),
                jax.tree.map(jnp.add, carry[1], stats)), None

      micro = split_microbatches(batch, microbatches)
      first = jax.tree.map(lambda x: x[0], micro)
      shapes, stat_shapes = jax.eval_shape(replica_grads, params, first)
      zeros = (jax.tree.map(lambda f, s: jnp.zeros(s.shape, s.dtype if f else accum_dtype),
                            is_fp8, shapes), jax.tree.map(jnp.zeros_like, stat_shapes))
      (grads, stats), _ = jax.lax.scan(accumulate, zeros, micro)
      # The one reduction over replicas (an all-reduce, or a reduce-scatter under ZeRO-1).
      grads = jax.tree.map(lambda f, x, p: jnp.max(x, axis=0) if f
                           else jnp.sum(x, axis=0).astype(p.dtype), is_fp8, grads, params)
      stats = jax.tree.map(lambda x: jnp.sum(x, axis=0), stats)
      grads = constrain_tree(grads, names, "grads")
    tokens = jnp.maximum(stats["tokens"], 1.0)
    return jax.tree.map(lambda f, g: g if f else g / tokens, is_fp8, grads), stats

  return grads_fn


def make_train_step(graphdef, names, tx: optax.GradientTransformation, lr_schedule, *,
                    microbatches: int = 1, z_loss: float = 0.0, spike_factor: float = 0.0,
                    pipeline_schedule: str = "1f1b", virtual_stages: int = 1,
                    grad_accum_dtype: str = "float32"):
  """Returns train_step(state, batch) -> (state, metrics), pure, to be jitted once.

  Guard: when the loss or the gradient norm is not finite (or, with spike_factor > 0, the loss
  exceeds spike_factor x its running average), the update is not applied: parameters and
  optimizer state stay exactly as they were, `metrics["skipped"]` is 1, and the loop decides
  whether to stop. NaNs therefore never enter the state, nor any checkpoint.
  """
  grads_fn = make_grads_fn(graphdef, names, microbatches=microbatches, z_loss=z_loss,
                           pipeline_schedule=pipeline_schedule, virtual_stages=virtual_stages,
                           grad_accum_dtype=grad_accum_dtype)
  is_fp8 = fp8_mask(names)

  def train_step(state: TrainState, batch: dict):
    grads, stats = grads_fn(state.params, batch)
    tokens = jnp.maximum(stats["tokens"], 1.0)
    # fp8 histories: out of the gradients (norm, clipping, optimizer), then overwritten below.
    fp8_state = grads
    grads = jax.tree.map(lambda f, g: jnp.zeros_like(g) if f else g, is_fp8, grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    params = jax.tree.map(lambda f, p, new: new if f else p, is_fp8, params, fp8_state)
    if "moe_load" in stats:  # MoE: the routing biases follow the step's expert loads
      params = _update_expert_biases(graphdef, names, params, stats["moe_load"])
    loss, grad_norm = stats["loss_sum"] / tokens, optax.tree.norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    if spike_factor > 0:
      ok &= (state.loss_ema == 0) | (loss <= spike_factor * state.loss_ema)
    params, opt_state = jax.tree.map(lambda new, old: jnp.where(ok, new, old),
                                     (params, opt_state), (state.params, state.opt_state))
    loss_ema = jnp.where(ok, jnp.where(state.loss_ema == 0, loss, 0.95 * state.loss_ema
                                       + 0.05 * loss), state.loss_ema)
    metrics = {
        "loss": loss,
        "nll": stats["nll_sum"] / tokens,
        "z_loss": stats["z_loss_sum"] / tokens,
        "grad_norm": grad_norm,
        "param_norm": optax.tree.norm(params),
        "learning_rate": lr_schedule(state.step),
        "tokens": stats["tokens"],
        "skipped": 1.0 - ok.astype(jnp.float32),
    }
    if "moe_load" in stats:
      metrics.update(moe_metrics(stats, tokens))
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                              loss_ema=loss_ema)
    return new_state, metrics

  return train_step


def _update_expert_biases(graphdef, names, params, load):
  """DeepSeek-V3's aux-loss-free balancing: each `expert_bias` [layers, E] moves by rate x
  sign(mean load - load) of the step's routing counts (the optimizer leaves it alone)."""
  rate = nnx.merge(graphdef, params).moe_bias_rate
  return jax.tree.map(lambda p, n: update_bias(p, load, rate) if n[-1] == EXPERT_BIAS else p,
                      params, names, is_leaf=lambda x: isinstance(x, tuple))


def make_eval_step(graphdef):
  """Returns eval_step(params, batch) -> {"nll_sum", "tokens"} (sums, to average over batches)."""
  loss_sums = _loss_sums(graphdef, 0.0)

  def eval_step(params, batch):
    _, stats = loss_sums(params, batch)
    return {"nll_sum": stats["nll_sum"], "tokens": stats["tokens"]}

  return eval_step
