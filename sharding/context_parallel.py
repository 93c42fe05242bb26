"""Context parallelism: the sequence order (load-balanced "zigzag", or contiguous for a sliding
window) and the shard_map that runs per-device context attention over the mesh axes splitting
the sequence. `load_balanced` is the one place the order is chosen: `zigzag` reorders the batch
by it and `context_attention` tells the kernel which order it got."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from sharding.context import axes_of, constrain, current, mesh_sizes, spec


def sequence_axes() -> tuple[str, ...]:
  """Mesh axes (size > 1) that split the `seq` dim in the current context; () without one."""
  return axes_of("seq")


def tokens_split() -> bool:
  """Whether a mesh axis (size > 1) splits the sequence of any activation in the current context:
  `seq` under context parallelism, `res_seq` also under sequence parallelism. When none does,
  each device holds whole sequences, so [B, L, ...] activations are [B·L, ...] token rows
  without moving data (models/layers.Einsum uses that)."""
  return bool(axes_of("seq") or axes_of("res_seq"))


def zigzag_permutation(length: int, parts: int) -> np.ndarray:
  """The order that gives device i sequence chunks i and 2·parts−1−i (of 2·parts chunks), so
  every device gets the same amount of causal attention work."""
  if length % (2 * parts):
    raise ValueError(f"seq_len={length} is not divisible by 2 x context={2 * parts} (the"
                     " load-balanced order splits the sequence into 2 chunks per device)")
  chunks = np.arange(length).reshape(2 * parts, length // (2 * parts))
  return np.concatenate([np.concatenate([chunks[i], chunks[2 * parts - 1 - i]])
                         for i in range(parts)])


def load_balanced(window: int = 0) -> bool:
  """Whether a split sequence is in the zigzag order (else contiguous: device i holds the i-th
  block). Full causal attention: zigzag, which balances the causal work. With a sliding window
  every query attends at most `window` keys, so the contiguous order is balanced already (except
  over the first window of the sequence, where queries have fewer keys), and it lets the ring
  skip the hops no window reaches; zigzag would need hops in both directions."""
  return not window


def zigzag(batch: dict, window: int = 0) -> dict:
  """Reorders the sequence dim of every [B, L] batch array into the zigzag order when the
  sequence is split and `load_balanced(window)` (identity otherwise). The loss is a sum over
  tokens and attention masks come from positions and segment ids, so nothing has to be undone
  afterwards. `window`: the model's sliding window (0: none)."""
  axes = sequence_axes()
  if not axes or not load_balanced(window):
    return batch
  parts = int(np.prod([mesh_sizes(current().mesh)[a] for a in axes]))
  order = zigzag_permutation(next(iter(batch.values())).shape[1], parts)
  return {k: constrain(jnp.take(v, order, axis=1), ("batch", "seq")) for k, v in batch.items()}


def context_attention(kernel: Callable, q, k, v, positions, segment_ids, *, window: int = 0,
                      model_window: int | None = None,
                      q_names=("batch", "seq", "act_heads", "head_dim"),
                      kv_names=("batch", "seq", "act_kv_heads", "head_dim"), v_names=None):
  """Runs `kernel(q, k, v, positions, segment_ids, axis_name=..., window=..., contiguous=...)`
  (kernels.ring_attention or allgather_attention) per device with the sequence split over the
  context axes.

  `window`: this layer's sliding window (0: full attention). `model_window`: the model's (None:
  `window`), which chose the batch's order (`zigzag(batch, model_window)`): with one the batch
  is in the contiguous order, and a windowed layer's ring skips the hops it does not need (a
  full-attention layer of such a model runs every hop). v may have its own head dim (MLA) and
  names (`v_names`, default `kv_names`); the output has q's names with v's head dim.

  The shard_map is manual over every mesh axis, with specs from the logical names: attention is
  independent across batch rows and heads, so each device attends its own rows and heads over
  its part of the sequence, and the kernel only communicates over the context axes. (A region
  manual over the context axes alone could not sit inside the data-parallel vmap of gradient
  accumulation.)
  """
  axes = sequence_axes()
  token_names = (q_names[0], q_names[1])
  q_spec = spec(q_names, q.shape, "context attention q")
  k_spec = spec(kv_names, k.shape, "context attention k")
  v_spec = spec(v_names or kv_names, v.shape, "context attention v")
  out_spec = spec(q_names, (*q.shape[:-1], v.shape[-1]), "context attention output")
  token_spec = spec(token_names, positions.shape, "context attention positions")
  contiguous = not load_balanced(window if model_window is None else model_window)

  def per_device(q, k, v, positions, segment_ids):
    return kernel(q, k, v, positions, segment_ids, axis_name=axes[0] if len(axes) == 1 else axes,
                  window=window, contiguous=contiguous)

  # Inside the data-parallel replicas' vmap (gradient accumulation, trainer/step.py), JAX 0.10's
  # varying-axes check rejects the batched ring's transposes ("mul requires varying manual axes
  # to match"). It is off there only: every input is split over every mesh axis the layout uses
  # (batch over the data axes, sequence over context, heads over tensor), so no value is
  # replicated whose gradient the check would have to sum; tests/test_context_parallel.py shows
  # the result equal to one device.
  ctx = current()
  mapped = jax.shard_map(per_device, mesh=ctx.mesh,
                         in_specs=(q_spec, k_spec, v_spec, token_spec, token_spec),
                         out_specs=out_spec, check_vma=not ctx.excluded)
  return mapped(q, k, v, positions, segment_ids)
