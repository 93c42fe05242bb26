"""THE pure train step and eval step: no mesh, no branch on the parallel layout."""

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from models.fp8.weights import attach as fp8_attach, quantize_weights
from models.layers import attach_gradient_sums
from sharding import Layout, constrain, constrain_tree, excluding, zigzag
from sharding.context_parallel import SEQUENCE_PARTS
from sharding.expert_loop import loop_typed, run_loop
from sharding.pipeline import stage_split
from trainer import loss
from trainer.config import StepConfig
from trainer.loss import moe_metrics, mtp_metrics
from trainer.non_gradient import NonGradient
from trainer.pipeline_step import make_pipeline_grads_fn
from trainer.state import TrainState

BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")
# The view reduced gradients take: the optimizer state's. Under ZeRO-1 each device then reduces
# only the shard of the gradients its optimizer state updates (a reduce-scatter, where the
# replicated "grads" view would all-reduce them whole), and the updated parameters are gathered.
# Without ZeRO and from stage 2 on it is the "grads" view; inside the replicas' vmap too (the
# vmap's axes are excluded).
REDUCED = "opt_state"
# The parameters' layer stacks (models/transformer.py), whose gradients accumulate in the backward.
STACKS = stage_split.STACKS


def make_loss_sums(graphdef, layout: Layout, cfg: StepConfig, mtp: bool = True, use_max=None):
  """loss_sums(params, batch, fp8_weights=None, accumulators=None) -> (loss_sum, stats): the
  model's final hidden states through the head and the loss (trainer.loss.head_loss_sums), plus
  the MoE router losses and, when the model has them and `mtp`, the multi-token prediction loss
  (trainer.loss.add_mtp_losses; the batch gets its shifted targets here unless the caller added
  them before reordering the sequence). `accumulators`: {stack name: gradient accumulator} whose
  gradient is the accumulator plus the stack's weight gradient (models/accumulating_scan.py);
  With layers stored apart, `accumulators` is the whole tree of sums, and its gradient holds
  the projections' weight gradients in float32 (models/layers.attach_gradient_sums); `use_max`:
  the parameters' tree of bools, True where they accumulate by max (fp8 histories)."""
  # Uneven pipeline stages store the layer stacks padded; the padding rows are skipped.
  present = stage_split.present_rows(layout.stacks, flat=True)

  def loss_sums(params, batch, fp8_weights=None, accumulators=None):
    model = nnx.merge(graphdef, params)
    if fp8_weights:  # quantized once per step, outside the differentiated function
      fp8_attach(model, fp8_weights)
    stacks = {}
    if accumulators and not model.compute.scan_layers:  # layers apart: every sum
      attach_gradient_sums(model, nnx.merge(graphdef, accumulators))
    else:
      stacks = {k: (acc, use_max[k]) for k, acc in (accumulators or {}).items()}
    segments = loss.attention_segments(batch, cfg.document_mask)
    x, aux = model.run_layers(model.embed_tokens(batch["inputs"]), batch["positions"],
                              segments, present, stacks)
    loss_sum, stats = loss.head_loss_sums(model, model.final_norm(x), batch, cfg.z_loss)
    if aux:  # MoE layers: router losses join the loss, routing counts the stats
      loss_sum, stats = loss.add_moe_losses(loss_sum, stats, aux, batch["loss_mask"],
                                            model.config.moe)
    depth = model.config.mtp_depth
    if depth and mtp:  # multi-token prediction, from the last layer's output before the norm
      loss_sum, stats = loss.add_mtp_losses(
          model, loss_sum, stats, x, dict(loss.mtp_batch(batch, depth), segment_ids=segments),
          cfg.z_loss)
    return loss_sum, dict(stats, loss_sum=loss_sum)
  return loss_sums



def split_microbatches(batch: dict, n: int) -> dict:
  """[B, L] -> [n, B/n, L], taking every n-th row so each microbatch stays spread over all
  data-parallel devices (a contiguous split would put each microbatch on a subset of them)."""
  def split(x):
    x = x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1)
    return constrain(x, (None, "batch", "seq"))
  return {k: split(v) for k, v in batch.items()}


def make_grads_fn(graphdef, names, layout: Layout, cfg: StepConfig = StepConfig()):
  """Returns grads_fn(params, batch) -> (mean gradients, summed stats).

  `graphdef`: the model built for the train step's regions (`layout.in_train_step()`). With the
  layer stack split over pipeline stages, the microbatches flow through the stages by the
  layout's pipeline schedule instead (trainer/pipeline_step.py); the result is the same.

  Gradients are sums over tokens accumulated over a `lax.scan` of microbatches, then divided by
  the batch's token count: N microbatches give the gradient of one batch of N times the size.
  Reduced, they take the optimizer state's view (`REDUCED`: sharded over `data` from ZeRO-1 on;
  from ZeRO-2 on also while accumulating). The sums are carried in `cfg.grad_accum_dtype` and
  the mean is cast back to each parameter's dtype. fp8 amax histories travel as new state
  (trainer/non_gradient). Tensorwise and delayed fp8 weights are quantized once, before the
  microbatches (models/fp8/weights.py), so FSDP gathers them in fp8 once per step.
  """
  state = NonGradient(names)
  loss_sums = make_loss_sums(graphdef, layout, cfg, use_max=state.is_fp8)
  grad_fn = jax.grad(loss_sums, has_aux=True)
  # With microbatches, the layer stacks' gradients are added into their accumulators inside the
  # backward, layer by layer (models/accumulating_scan.py), instead of into a new stacked buffer
  # added to the accumulators afterwards.
  accumulating_grad_fn = jax.grad(loss_sums, argnums=(0, 3), has_aux=True)
  accum_dtype = jnp.dtype(cfg.grad_accum_dtype)

  def sharded_grad_fn(params, batch, fp8_weights, stacks=None):
    """(gradients, stats); with `stacks` (accumulators of the layer stacks), ((gradients,
    the stacks' accumulators plus theirs), stats)."""
    if stacks is None:
      grads, stats = grad_fn(params, batch, fp8_weights)
      return constrain_tree(grads, names, REDUCED), stats
    (grads, stacks), stats = accumulating_grad_fn(params, batch, fp8_weights, stacks)
    return (constrain_tree(grads, names, REDUCED),
            constrain_tree(stacks, {k: names[k] for k in stacks}, REDUCED)), stats

  def replica_grads(params, micro, fp8_weights, stacks=None):
    """Per-device partial sums [R·C, ...]: each of the R data-parallel replicas differentiates
    its own rows and, under context parallelism, each of a replica's C devices its own part of
    the sequence (attention exchanges across the parts inside; sequence-wise sums add them up
    over SEQUENCE_PARTS), and keeps the result, so accumulation needs no communication
    (R = C = 1 without replicas or context)."""
    axes, replicas = layout.vmapped_replicas
    part_axes = layout.gradient_sequence_axes
    parts = layout.sequence_parts if part_axes else 1

    def split(x):  # [B, L, ...] -> [R·C, B/R, L/C, ...], replica-major like the mesh's axes
      x = x.reshape(replicas, x.shape[0] // replicas, parts, x.shape[1] // parts, *x.shape[2:])
      return x.swapaxes(1, 2).reshape(replicas * parts, *x.shape[1:2], *x.shape[3:])
    vmapped = (*axes, *part_axes)
    with excluding(vmapped):
      return jax.vmap(sharded_grad_fn, in_axes=(None, 0, None, 0), axis_name=SEQUENCE_PARTS,
                      spmd_axis_name=vmapped or None)(
          params, {k: split(v) for k, v in micro.items()}, fp8_weights, stacks)

  pipelined = make_pipeline_grads_fn(graphdef, names, layout, cfg,
                                     split_microbatches=split_microbatches, is_fp8=state.is_fp8)

  def grads_fn(params, batch):
    model = nnx.merge(graphdef, params)
    # MTP's shifted targets: in the natural order.
    batch = loss.mtp_batch(batch, model.config.mtp_depth)
    # The sequence order under context parallelism: load-balanced, or contiguous with a sliding
    # window or Ulysses (sharding.context_parallel.load_balanced); unchanged without it. The
    # model's attention reads the same decision from the layout, so it knows which order it gets.
    batch = zigzag(batch, layout)
    if layout.pipeline > 1:  # the one place a layout changes the computation's structure
      grads, stats = pipelined(params, batch)
      grads = state.normalize(grads, jnp.maximum(stats["tokens"], 1.0))
      return constrain_tree(grads, names, REDUCED), stats
    fp8_weights = quantize_weights(model)
    if layout.microbatches == 1:
      grads, stats = sharded_grad_fn(params, batch, fp8_weights)
    else:
      stack_names = [k for k in STACKS if k in params] if model.compute.scan_layers else []
      # Layers apart, sums whole on each device: the projections' GEMMs add into the sums.
      summed = not model.compute.scan_layers and layout.keeps_whole_gradient_sums

      def loop(params, micro, fp8_weights):
        def accumulate(carry, micro):
          total, stats_total = carry
          if summed:  # the projections' entries of `grads` are zeros, theirs are in `dws`
            (grads, dws), stats = replica_grads(params, micro, fp8_weights, total)
            total = jax.tree.map(jnp.add, state.combine(total, grads), dws)
          else:
            (grads, stacks), stats = replica_grads(params, micro, fp8_weights,
                                                   {k: total[k] for k in stack_names})
            # The stacks' entries of `grads` are zeros (theirs went into `stacks`), unused.
            total = {**state.combine(total, grads), **stacks}
          return (total, jax.tree.map(jnp.add, stats_total, stats)), None

        first = jax.tree.map(lambda x: x[0], micro)
        shapes, stat_shapes = jax.eval_shape(replica_grads, params, first, fp8_weights)
        zeros = (state.zeros(shapes, accum_dtype),
                 jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), stat_shapes))
        return jax.lax.scan(accumulate, loop_typed(layout, zeros), micro)[0]

      micro = split_microbatches(batch, layout.microbatches)
      # Under the expert axes that split the batch, each device sums its own rows' gradients
      # (sharding/expert_loop.py); elsewhere the loop runs as it is.
      grads, stats = run_loop(layout, names, loop, params, micro, fp8_weights)
      # The one reduction over replicas (an all-reduce, or a reduce-scatter under ZeRO-1).
      grads = state.reduce_replicas(grads, params)
      stats = jax.tree.map(lambda x: jnp.sum(x, axis=0), stats)
      grads = constrain_tree(grads, names, REDUCED)
    return state.normalize(grads, jnp.maximum(stats["tokens"], 1.0)), stats

  return grads_fn


def _norm(tree) -> jax.Array:
  """The global L2 norm, summed in float32 also for bf16 parameters and gradients."""
  return optax.tree.norm(jax.tree.map(lambda x: x.astype(jnp.float32), tree))


def make_train_step(graphdef, names, tx: optax.GradientTransformation, lr_schedule,
                    layout: Layout, cfg: StepConfig = StepConfig()):
  """Returns train_step(state, batch) -> (state, metrics), pure, to be jitted once (the trainer
  jits it bound to its layout's scope: sharding.Layout.bind). `graphdef`: the model built for the
  train step's regions (`layout.in_train_step()`).

  Guard: when the loss or the gradient norm is not finite (or, with cfg.spike_factor > 0, the
  loss exceeds spike_factor x its running average), the update is not applied: parameters and
  optimizer state stay exactly as they were, `metrics["skipped"]` is 1, and the loop decides
  whether to stop. NaNs therefore never enter the state, nor any checkpoint.
  """
  grads_fn = make_grads_fn(graphdef, names, layout, cfg)

  def train_step(state: TrainState, batch: dict):
    model_cfg = nnx.merge(graphdef, state.params).config
    extra = NonGradient(names, model_cfg.moe.bias_update_rate if model_cfg.moe else 0.0)
    grads, stats = grads_fn(state.params, batch)
    tokens = jnp.maximum(stats["tokens"], 1.0)
    # fp8 histories: out of the gradients (norm, clipping, optimizer), then written in below.
    grads, fp8_values = extra.split(grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = extra.apply(optax.apply_updates(state.params, updates), fp8_values, stats)
    loss, grad_norm = stats["loss_sum"] / tokens, _norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    if cfg.spike_factor > 0:
      ok &= (state.loss_ema == 0) | (loss <= cfg.spike_factor * state.loss_ema)
    params, opt_state = jax.tree.map(lambda new, old: jnp.where(ok, new, old),
                                     (params, opt_state), (state.params, state.opt_state))
    loss_ema = jnp.where(ok, jnp.where(state.loss_ema == 0, loss, 0.95 * state.loss_ema
                                       + 0.05 * loss), state.loss_ema)
    metrics = {
        "loss": loss,
        "nll": stats["nll_sum"] / tokens,
        "z_loss": stats["z_loss_sum"] / tokens,
        "grad_norm": grad_norm,
        "param_norm": _norm(params),
        "learning_rate": lr_schedule(state.step),
        "tokens": stats["tokens"],
        "skipped": 1.0 - ok.astype(jnp.float32),
    }
    if "moe_load" in stats:
      metrics.update(moe_metrics(stats, tokens))
    if "mtp_loss_sum" in stats:
      metrics.update(mtp_metrics(stats, tokens, model_cfg.mtp_loss_weight))
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                              loss_ema=loss_ema)
    return new_state, metrics

  return train_step


def make_eval_step(graphdef, layout: Layout, cfg: StepConfig = StepConfig()):
  """Returns eval_step(params, batch) -> {"nll_sum", "tokens"} (sums, to average over batches)."""
  # The main model's loss only: no z-loss, no multi-token prediction.
  loss_sums = make_loss_sums(graphdef, layout, dataclasses.replace(cfg, z_loss=0.0), mtp=False)

  def eval_step(params, batch):
    _, stats = loss_sums(params, batch)
    return {"nll_sum": stats["nll_sum"], "tokens": stats["tokens"]}

  return eval_step
