"""The model cut into pipeline pieces, and the gradient function that runs them by schedule."""

import jax
import jax.numpy as jnp
from flax import nnx

from sharding import pipeline, schedules, stage_split
from trainer import loss
from trainer.config import StepConfig


def stage_fns(graphdef, cfg: StepConfig, layer_chunk_shape) -> pipeline.StageFns:
  """Embedding, a chunk of the layer stack, and final norm + head + summed loss as pure
  functions. The model is rebuilt from (shared weights, layers) for each piece; pieces that do
  not use the layers get zeros of a chunk's shape (unused, removed by XLA)."""
  placeholder = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), layer_chunk_shape)

  def model_of(shared, layers):
    return nnx.merge(graphdef, {**shared, "layers": layers})

  def first(shared, mb):
    return model_of(shared, placeholder()).embed_tokens(mb["inputs"])

  def stage(shared, chunk, x, mb, present):
    return model_of(shared, chunk).run_layers(x, mb["positions"], mb["segment_ids"], present)

  def last(shared, x, mb):
    model = model_of(shared, placeholder())
    loss_sum, stats = loss.head_loss_sums(model, model.final_norm(x), mb, cfg)
    return loss_sum, dict(stats, loss_sum=loss_sum)

  return pipeline.StageFns(first, stage, last)


def make_pipeline_grads_fn(graphdef, cfg: StepConfig, *, split_microbatches, is_fp8=None):
  """grads_fn(params, batch) -> (gradients summed over tokens, stats), the microbatches flowing
  through the pipeline stages by `cfg.pipeline_schedule` (make_grads_fn normalizes them).
  `is_fp8`: a bool per parameter, the fp8 amax histories, which combine by max."""

  def grads_fn(params, batch):
    stages = pipeline.pipeline_stages()
    plan = schedules.make(cfg.pipeline_schedule, stages, cfg.microbatches, cfg.virtual_stages)
    layers = params["layers"]
    shared = {k: v for k, v in params.items() if k != "layers"}
    chunk = jax.eval_shape(lambda l: jax.tree.map(
        lambda w: w[: w.shape[0] // (stages * cfg.virtual_stages)], l), layers)
    micro = split_microbatches(batch, cfg.microbatches)
    present = stage_split.present(cfg.stage_layers) if cfg.stage_layers else None
    by_max = None if is_fp8 is None else (
        is_fp8["layers"], {k: v for k, v in is_fp8.items() if k != "layers"})
    layer_grads, shared_grads, _, stats = pipeline.pipeline_grads(
        stage_fns(graphdef, cfg, chunk), plan, layers, shared, micro, present, by_max)
    return {**shared_grads, "layers": layer_grads}, stats

  return grads_fn
