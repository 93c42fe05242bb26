"""The model cut into the pieces a pipeline stage runs (sharding/pipeline/executor.py)."""

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class StageFns:
  """The model cut into pipeline pieces (pure functions of their parameters).

  first(shared, microbatch) -> x: the embedding (position 0 of the pipeline); row by row, so its
    gradient is taken on several microbatches' rows at once (sharding/pipeline/shared_grads.py).
  stage(shared, chunk, x, microbatch, present, quantized) -> (x, loss_sum, stats, row_stats): one
    chunk of layers (`chunk`: {stack: weights with a leading layers dim}; `shared` is passed so
    the model can be rebuilt, its gradient through `stage` is 0; `present`: {stack: the chunk's
    rows that hold a layer} for padded stacks; `quantized`: the chunk's part of what `quantize`
    returned, or None). Its loss_sum is the chunk's part of the loss (the MoE router losses; 0
    for dense layers), stats are summed scalars, row_stats {name: [chunk rows, ...]} are per
    layer (the experts' loads), both without gradient.
  head(shared, x, microbatch) -> (loss_sum, stats): final norm, head and summed loss of the
    last layer's output; token by token, so it runs on any slice of the sequence (and of the
    microbatch's [b, L] arrays); stats are summed arrays.
  last(shared, x, microbatch) -> (loss_sum, stats), or None: what else runs after the last layer
    on the whole sequence (multi-token prediction), on the last position's stage.
  quantize(shared, chunk) -> a pytree whose leaves have the chunk's leading layers dim, or None:
    the chunk's fp8 weights, computed once per step for each of a device's chunks before the
    ticks (not differentiated; the weights still get their gradients through `stage`).
  """

  first: Callable
  stage: Callable
  head: Callable
  last: Callable | None = None
  quantize: Callable | None = None
