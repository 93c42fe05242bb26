"""The model cut into pipeline pieces, and the gradient function that runs them by schedule."""

import jax
import jax.numpy as jnp
from flax import nnx

from sharding import pipeline, schedules
from trainer import loss


def stage_fns(graphdef, z_loss: float, layer_chunk_shape) -> pipeline.StageFns:
  """Embedding, a chunk of the layer stack, and final norm + head + summed loss as pure
  functions. The model is rebuilt from (shared weights, layers) for each piece; pieces that do
  not use the layers get zeros of a chunk's shape (unused, removed by XLA)."""
  placeholder = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), layer_chunk_shape)

  def model_of(shared, layers):
    return nnx.merge(graphdef, {**shared, "layers": layers})

  def first(shared, mb):
    return model_of(shared, placeholder()).embed_tokens(mb["inputs"])

  def stage(shared, chunk, x, mb):
    return model_of(shared, chunk).run_layers(x, mb["positions"], mb["segment_ids"])

  def last(shared, x, mb):
    model = model_of(shared, placeholder())
    hidden = model.final_norm(x)
    if model.loss_impl == "chunked":
      loss_sum, stats = loss.chunked_cross_entropy_sums(
          hidden, model.head_weights(), mb["targets"], mb["loss_mask"], z_loss,
          model.loss_chunk_size)
    else:
      loss_sum, stats = loss.cross_entropy_sums(model.logits(hidden), mb["targets"],
                                                mb["loss_mask"], z_loss)
    return loss_sum, dict(stats, loss_sum=loss_sum)

  return pipeline.StageFns(first, stage, last)


def make_pipeline_grads_fn(graphdef, *, microbatches: int, z_loss: float, schedule: str,
                           virtual: int, split_microbatches):
  """grads_fn(params, batch) -> (summed-over-tokens-normalized grads, stats), like
  make_grads_fn, with the microbatches flowing through the pipeline stages by `schedule`."""

  def grads_fn(params, batch):
    stages = pipeline.pipeline_stages()
    plan = schedules.make(schedule, stages, microbatches, virtual)
    layers = params["layers"]
    shared = {k: v for k, v in params.items() if k != "layers"}
    chunk = jax.eval_shape(lambda l: jax.tree.map(
        lambda w: w[: w.shape[0] // (stages * virtual)], l), layers)
    micro = split_microbatches(batch, microbatches)
    layer_grads, shared_grads, _, stats = pipeline.pipeline_grads(
        stage_fns(graphdef, z_loss, chunk), plan, layers, shared, micro)
    tokens = jnp.maximum(stats["tokens"], 1.0)
    grads = jax.tree.map(lambda g: g / tokens, {**shared_grads, "layers": layer_grads})
    return grads, stats

  return grads_fn

