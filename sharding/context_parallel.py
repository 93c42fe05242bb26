"""Context parallelism: the load-balanced ("zigzag") sequence order and the shard_map that runs
per-device context attention over the mesh axes splitting the sequence."""

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


def zigzag(batch: dict) -> dict:
  """Reorders the sequence dim of every [B, L] batch array into the zigzag order when the
  sequence is split (identity otherwise). The loss is a sum over tokens and attention masks
  come from positions and segment ids, so nothing has to be undone afterwards."""
  axes = sequence_axes()
  if not axes:
    return batch
  parts = int(np.prod([mesh_sizes(current().mesh)[a] for a in axes]))
  order = zigzag_permutation(next(iter(batch.values())).shape[1], parts)
  return {k: constrain(jnp.take(v, order, axis=1), ("batch", "seq")) for k, v in batch.items()}


def context_attention(kernel: Callable, q, k, v, positions, segment_ids, *,
                      q_names=("batch", "seq", "act_heads", "head_dim"),
                      kv_names=("batch", "seq", "act_kv_heads", "head_dim")):
  """Runs `kernel(q, k, v, positions, segment_ids, axis_name=...)` per device with the sequence
  split over the context axes.

  The shard_map is manual over every mesh axis, with specs from the logical names: attention is
  independent across batch rows and heads, so each device attends its own rows and heads over
  its part of the sequence, and the kernel only communicates over the context axes. (A region
  manual over the context axes alone could not sit inside the data-parallel vmap of gradient
  accumulation.)
  """
  axes = sequence_axes()
  token_names = (q_names[0], q_names[1])
  q_spec = spec(q_names, q.shape, "context attention q")
  kv_spec = spec(kv_names, k.shape, "context attention k/v")
  token_spec = spec(token_names, positions.shape, "context attention positions")

  def per_device(q, k, v, positions, segment_ids):
    return kernel(q, k, v, positions, segment_ids, axis_name=axes[0] if len(axes) == 1 else axes)

  # Inside the data-parallel replicas' vmap (gradient accumulation, trainer/step.py), JAX 0.10's
  # varying-axes check rejects the batched ring's transposes ("mul requires varying manual axes
  # to match"). It is off there only: every input is split over every mesh axis the layout uses
  # (batch over the data axes, sequence over context, heads over tensor), so no value is
  # replicated whose gradient the check would have to sum; tests/test_context_parallel.py shows
  # the result equal to one device.
  ctx = current()
  mapped = jax.shard_map(per_device, mesh=ctx.mesh,
                         in_specs=(q_spec, kv_spec, kv_spec, token_spec, token_spec),
                         out_specs=q_spec, check_vma=not ctx.excluded)
  return mapped(q, k, v, positions, segment_ids)
