"""The model cut into pipeline pieces, and the gradient function that runs them by schedule."""

import jax
import jax.numpy as jnp
from flax import nnx

from models.fp8.weights import attach as fp8_attach, quantize_weights
from sharding import Layout
from sharding.pipeline import executor as pipeline, schedules, stage_split
from sharding.pipeline.stage_fns import StageFns
from sharding.scope import specs_over
from trainer import loss
from trainer.config import StepConfig


def stage_fns(graphdef, cfg: StepConfig, layer_chunk_shape, with_mtp: bool
              ) -> StageFns:
  """Embedding, a chunk of the layer stacks, and final norm + head + summed loss (+ the
  multi-token prediction loss, `with_mtp`) as pure functions. The model is rebuilt from (shared
  weights, stacks) for each piece; pieces that do not use the layers get zeros of a chunk's shape
  (unused, removed by XLA)."""
  placeholder = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), layer_chunk_shape)

  def model_of(shared, stacks):
    return nnx.merge(graphdef, {**shared, **stacks})

  def first(shared, mb):
    return model_of(shared, placeholder()).embed_tokens(mb["inputs"])

  def quantize(shared, chunk):
    """The chunk's tensorwise and delayed fp8 weights (models/fp8/weights.py), {module path:
    QuantizedWeight}; the executor computes them once per step."""
    weights = quantize_weights(model_of(shared, chunk))
    return {path: w for path, w in weights.items() if path[0] in chunk}

  def stage(shared, chunk, x, mb, present, quantized=None):
    """The chunk's layers (`quantized`: its fp8 weights from `quantize`); with MoE layers, their
    share of the router losses (each a sum over the model's layers / their count: the stages'
    shares add up to the one-device loss)."""
    model = model_of(shared, chunk)
    if quantized:
      fp8_attach(model, quantized)
    segments = loss.attention_segments(mb, cfg.document_mask)
    x, aux = model.run_layers(x, mb["positions"], segments, present)
    none = jnp.zeros((), jnp.float32)
    if not aux:
      return x, none, {}, {}
    loss_sum, stats = loss.add_moe_losses(none, {}, aux, mb["loss_mask"], model.config.moe)
    load = stats.pop("moe_load")
    return x, loss_sum, stats, {"moe_load": load}

  def head(shared, x, mb):
    """Final norm, head and summed loss, token by token (the executor splits the tokens over
    the stages)."""
    model = model_of(shared, placeholder())
    return loss.head_loss_sums(model, model.final_norm(x), mb, cfg.z_loss)

  def last(shared, x, mb):
    """The multi-token prediction modules (in `shared`) on x before the norm, and their loss, as
    make_loss_sums adds them (the microbatch holds the shifted tokens, made in the natural order
    before the split)."""
    model = model_of(shared, placeholder())
    return loss.add_mtp_losses(model, jnp.zeros((), jnp.float32), {}, x, mb, cfg.z_loss)

  return StageFns(first, stage, head, last if with_mtp else None, quantize)


def make_pipeline_grads_fn(graphdef, names, layout: Layout, cfg: StepConfig, *,
                           split_microbatches, is_fp8=None):
  """grads_fn(params, batch) -> (gradients summed over tokens, stats), the microbatches flowing
  through the pipeline stages by the layout's schedule (make_grads_fn normalizes them).
  `graphdef`: the model built for a pipeline stage (`layout.in_train_step()`).
  `is_fp8`: a bool per parameter, the fp8 amax histories, which combine by max. With MoE
  layers, stats["moe_load"] holds the experts' loads per stored row of `moe_layers` (padding
  rows: zeros)."""

  def grads_fn(params, batch):
    stages, virtual = layout.pipeline, layout.virtual_stages
    plan = schedules.make(layout.pipeline_schedule, stages, layout.microbatches, virtual)
    stacks = {k: v for k, v in params.items() if k in stage_split.STACKS}
    shared = {k: v for k, v in params.items() if k not in stage_split.STACKS}
    chunk = jax.eval_shape(lambda l: jax.tree.map(
        lambda w: w[: w.shape[0] // (stages * virtual)], l), stacks)
    micro = split_microbatches(batch, layout.microbatches)
    present = stage_split.present_rows(layout.stacks)
    by_max = None if is_fp8 is None else (
        {k: is_fp8[k] for k in stacks}, {k: v for k, v in is_fp8.items() if k in shared})
    fns = stage_fns(graphdef, cfg, chunk, shared.get("mtp") is not None)
    split = None  # each weight's split over the stage's expert axes (Layout.stage_expert_axes)
    if layout.stage_expert_axes:
      split = specs_over({k: names[k] for k in params}, params, layout.stage_expert_axes)
      split = ({k: split[k] for k in stacks}, {k: split[k] for k in shared})
    # ZeRO-1: each layer weight's gradient reduce-scattered into its optimizer state's parts
    # (the `opt_state` view over the executor's replica axes), not all-reduced whole.
    reduced = None
    if layout.zero_stage == 1:
      reduced = specs_over({k: names[k] for k in stacks}, stacks, layout.stage_replica_axes,
                           role="opt_state")
    # ZeRO-2: each tick's layer gradients reduce-scattered into the gradients' parts over the
    # axes the stages leave automatic (the replicas' and experts' at ZeRO >= 2).
    parts = None
    if layout.zero_stage == 2:
      automatic = tuple(a for a in layout.mesh.axis_names if a not in (
          layout.pipeline_axis, *layout.stage_replica_axes))
      parts = specs_over({k: names[k] for k in stacks}, stacks, automatic, role="grads")
    layer_grads, shared_grads, loss_sum, stats, row_stats = pipeline.pipeline_grads(
        layout, fns, plan, stacks, shared, micro, present, by_max, cfg.grad_accum_dtype, split,
        layout.pipeline_recompute, reduced, parts)
    return {**shared_grads, **layer_grads}, dict(stats, **row_stats, loss_sum=loss_sum)

  return grads_fn
