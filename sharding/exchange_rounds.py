"""The dropless MoE's token exchange (sharding/expert.py): tokens to the devices of their experts
and back in rounds of at most `capacity` rows per device pair, by all_to_all of padded buffers or
by ragged_all_to_all (GPUs), with the received rows regrouped by expert for the grouped matmul.
Every device runs as many rounds as the heaviest pair needs, so nothing is dropped."""

import contextlib
import functools
import math

import jax
import jax.numpy as jnp

from kernels.capacity_matmul import OVERFLOW_ROUNDS
from kernels.per_replica import per_replica
from kernels.residuals import keep
from sharding.shard_map import varying_over


def size_of(axes) -> int:
  """Devices over the mesh `axes` (inside a shard_map manual over them)."""
  return math.prod(jax.lax.axis_size(a) for a in axes)


def _run_received(recv, recv_counts, params, expert_fn):
  """Received rows [N, cap, D] from each source (each sorted by local expert) -> expert_fn's
  outputs in the same slots. Rows are regrouped expert-major for the grouped matmul."""
  n, cap, d = recv.shape
  ends = jnp.cumsum(recv_counts, axis=1)  # [N, E_local]
  slot = jnp.arange(cap)
  # Local expert of each slot: how many group ends it has passed (a compare-and-count, not
  # searchsorted, whose batching under shard_map + vmap(spmd_axis_name) JAX 0.10 mistypes).
  local = jnp.sum(ends[:, :, None] <= slot[None, None, :], axis=1)  # [N, cap]
  key = local.reshape(n * cap)  # == E_local for padding rows: they sort last
  regroup = jnp.argsort(key, stable=True)
  back = inverse_of(regroup)
  group_sizes = jnp.sum(recv_counts, axis=0)
  # The padding rows' outputs are not masked: no sender reads them back (the ragged return
  # sends each source its real rows only; the padded one's sender keeps the rows it sent), and
  # their cotangents are zeros. A mask shared XLA's zeros with the receive buffer, which the
  # ragged all-to-all writes in place, so XLA copied it (Qwen3-30B-A3B EP16: 0.85 s a step).
  # The rows go as received, with their order by expert: expert_fn permutes them, or gathers
  # its slots through the order (moe.grouped_matmul=slots: no sorted copy is written).
  out = expert_fn(recv.reshape(n * cap, d), group_sizes, *params, order=regroup, back=back)
  return out.reshape(n, cap, d)


def inverse_of(perm):
  """The inverse of a permutation of rows (a scatter of ints, not a sort)."""
  rows = jnp.arange(perm.shape[0], dtype=perm.dtype) + perm * 0  # batched like perm under vmap
  return jnp.zeros_like(perm).at[perm].set(rows, unique_indices=True)


@jax.custom_vjp
def permuted(x, perm, inverse):
  """x[perm] for a permutation `perm` of x's rows (`inverse` its inverse). Autodiff would undo a
  gather by a scatter-add into a zeroed buffer, and a scatter (x.at[perm].set) by JAX's general
  scatter JVP, which scatters an id per element to choose among colliding updates: a
  permutation has no collisions, so both directions are one gather of the rows."""
  return x[perm]


def _permuted_forward(x, perm, inverse):
  return x[perm], inverse


def _permuted_backward(inverse, g):
  return g[inverse], None, None


permuted.defvjp(_permuted_forward, _permuted_backward)


def _ceil_div(a, b):
  return (a + b - 1) // b


# OVERFLOW_ROUNDS names the loops that run only the rounds after the first (forward and
# backward), under keep_first_round: the predicted case, every device pair within its capacity.


def exchange_rows(x_sorted, counts, params, expert_fn, axes, capacity, worst, exchange, sync_axes,
                  keep_first_round=False):
  """Tokens to the devices of their experts and back, in rounds of at most `capacity` rows per
  device pair: round r moves rows [r·capacity, (r+1)·capacity) of each pair's share. Every
  device in `sync_axes` runs as many rounds as the heaviest pair needs, so nothing is dropped
  and the buffers are sized by `capacity`, not by the worst case. `capacity` == `worst` (the
  most one device can send another) is one round, differentiated as it is written; fewer rows
  run a while loop of rounds under `_rounds`' custom gradient, which recomputes each round in
  the backward. `keep_first_round`: the first round outside the loop, differentiated as it is
  written (its received rows and expert activations kept as the layer's remat policy says), the
  loop running only the rounds after it."""
  round_fn = functools.partial(_ROUNDS[exchange], expert_fn=expert_fn, axes=axes,
                               capacity=capacity)
  if capacity >= worst:
    return round_fn(x_sorted, counts, params, 0)
  n = size_of(axes)
  heaviest = jnp.max(jnp.sum(counts.reshape(n, -1), axis=1)).astype(jnp.int32)
  rounds = _ceil_div(jax.lax.pmax(varying_over(heaviest, sync_axes), sync_axes), capacity)
  first = (round_fn(x_sorted, counts, params, 0) if keep_first_round
           else jnp.zeros_like(x_sorted))
  # Named (kept by remat="none", models/compute.py): else the backward would run the forward's
  # rounds again only to have their output.
  return keep(_rounds(round_fn, int(keep_first_round), varying_over(first, sync_axes), rounds,
                      x_sorted, counts, *params))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _rounds(round_fn, start, done, rounds, x_sorted, counts, *params):
  """`done` (the rows of the rounds before `start`: zeros, or the first round's) plus
  round_fn(x_sorted, counts, params, r) for start <= r < rounds, in a while loop: its trip count
  is the data's, so autodiff cannot reverse it; the backward below runs those rounds again,
  each round's forward recomputed inside its vjp (residuals: the inputs only). The rounds write
  disjoint rows, so `done`'s gradient is the output's."""
  return per_replica(functools.partial(_forward_rounds, round_fn, start))(
      done, rounds, x_sorted, counts, *params)


def _loop_scope(start):
  """The loop of the rounds after the first alone is named for the analysis (OVERFLOW_ROUNDS)."""
  return jax.named_scope(OVERFLOW_ROUNDS) if start else contextlib.nullcontext()


def _forward_rounds(round_fn, start, done, rounds, x_sorted, counts, *params):
  # Typed like the rows too: one replica's rows (per_replica) vary over the vmapped mesh axis.
  done = varying_over(done, tuple(jax.typeof(x_sorted).manual_axis_type.varying))

  def body(carry):  # each round writes its rows of y, which no other round writes, in place
    r, y = carry
    return r + 1, round_fn(x_sorted, counts, params, r, into=y)
  with _loop_scope(start):
    return jax.lax.while_loop(lambda c: c[0] < rounds, body,
                              (jnp.full_like(rounds, start), done))[1]


def _backward_rounds(round_fn, start, rounds, x_sorted, counts, g, *params):
  def body(carry):
    r, dx, dparams = carry
    _, pullback = jax.vjp(lambda x, p: round_fn(x, counts, p, r), x_sorted, params)
    ddx, ddparams = pullback(g)
    return r + 1, dx + ddx, jax.tree.map(jnp.add, dparams, ddparams)

  init = (jnp.full_like(rounds, start), jnp.zeros_like(x_sorted),
          jax.tree.map(jnp.zeros_like, params))
  with _loop_scope(start):
    _, dx, dparams = jax.lax.while_loop(lambda c: c[0] < rounds, body, init)
  return dx, *dparams


def _rounds_forward(round_fn, start, done, rounds, x_sorted, counts, *params):
  y = _rounds(round_fn, start, done, rounds, x_sorted, counts, *params)
  # With the first round apart, the rows and weights are left to the layer's remat policy (a
  # gather, a broadcast to recompute), as that round's own backward needs neither: kept, they
  # held 6 GiB more at Qwen3-30B-A3B EP16's peak. (The loop of every round keeps them, as it
  # was measured.)
  inputs = (x_sorted, params) if start else keep((x_sorted, params))
  return y, (*keep((rounds, counts)), *inputs)


def _rounds_backward(round_fn, start, residuals, g):
  rounds, counts, x_sorted, params = residuals
  dx, *dparams = per_replica(functools.partial(_backward_rounds, round_fn, start))(
      rounds, x_sorted, counts, g, *params)
  return (g if start else None, None, dx, None, *dparams)


_rounds.defvjp(_rounds_forward, _rounds_backward)


def _received_counts(recv_counts, offset, capacity):
  """[N, E_local] rows per local expert in the window [offset, offset + capacity) of each
  source's rows for me (sorted by local expert)."""
  ends = jnp.clip(jnp.cumsum(recv_counts, axis=1) - offset, 0, capacity)
  return jnp.diff(ends, axis=1, prepend=0).astype(jnp.int32)


def _padded_round(x_sorted, counts, params, r, *, expert_fn, axes, capacity, into=None):
  """One round by all_to_all of [N, capacity, D] buffers: row j holds this round's rows for
  device j's experts; the result holds the round's rows of x_sorted's outputs, and elsewhere
  `into`'s rows (None: zeros)."""
  n = size_of(axes)
  a, d = x_sorted.shape
  per_device = counts.reshape(n, -1)  # [N, E_local]: tokens for each expert of each device
  offset = r * capacity
  sent = jnp.sum(per_device, axis=1)
  start = jnp.cumsum(sent) - sent
  slot = jnp.arange(capacity)
  rows = jnp.clip(start[:, None] + offset + slot[None], 0, a - 1)  # [N, cap]
  valid = offset + slot[None] < sent[:, None]
  send = jnp.where(valid[..., None], x_sorted[rows], 0)
  recv = jax.lax.all_to_all(send, axes, 0, 0)
  recv_counts = _received_counts(jax.lax.all_to_all(per_device, axes, 0, 0), offset, capacity)
  back = jax.lax.all_to_all(_run_received(recv, recv_counts, params, expert_fn), axes, 0, 0)
  # Sorted assignment i went to device dest[i], at position i - start[dest[i]] of that share.
  dest = jnp.sum(jnp.cumsum(sent)[None, :] <= jnp.arange(a)[:, None], axis=1)
  at = jnp.arange(a) - start[dest] - offset
  inside = (at >= 0) & (at < capacity)
  return jnp.where(inside[:, None], back[dest, jnp.clip(at, 0, capacity - 1)],
                   0 if into is None else into)


def _ragged_round(x_sorted, counts, params, r, *, expert_fn, axes, capacity, into=None):
  """The same round with ragged_all_to_all: only the real rows travel (GPU). The return writes
  into `into`, whose other rows it leaves as they are: the rounds' loop passes its sum, so a
  round adds no buffer of zeros and no sum (Qwen3-30B-A3B EP16: about 1.1 s a step each)."""
  n = size_of(axes)
  a, d = x_sorted.shape
  me = jax.lax.axis_index(axes)
  per_device = counts.reshape(n, -1)
  offset = jnp.asarray(r * capacity, jnp.int32)
  sent = jnp.sum(per_device, axis=1).astype(jnp.int32)
  start = (jnp.cumsum(sent) - sent).astype(jnp.int32)
  recv_total = jax.lax.all_to_all(per_device, axes, 0, 0)
  received = jnp.sum(recv_total, axis=1).astype(jnp.int32)
  their_start = jax.lax.all_to_all(start.reshape(n, 1), axes, 0, 0).reshape(n)
  sending = jnp.clip(sent - offset, 0, capacity).astype(jnp.int32)
  receiving = jnp.clip(received - offset, 0, capacity).astype(jnp.int32)
  # Offsets computed from `sent` (x 0, not zeros_like, which vmap leaves unbatched): under
  # gradient accumulation's replica vmap every offset and size must carry the batch dim, or
  # ragged_all_to_all's batching rule fails (an assert in jax/_src/lax/parallel.py).
  batched = sent * 0
  slots = jnp.arange(n, dtype=jnp.int32) * capacity + batched
  # Sender's chunk for device j lands in j's buffer at slot (my index) x capacity. Each output
  # buffer is its exchange's own (_zeros_like): a shared receive buffer was copied
  # (Qwen3-30B-A3B EP16: 0.56 s a step).
  recv = ragged_exchange(x_sorted, _zeros_like(x_sorted, (n * capacity, d), sent),
                         jnp.minimum(start + offset, a), sending, me * capacity + batched,
                         receiving, axes)
  out = _run_received(recv.reshape(n, capacity, d),
                      _received_counts(recv_total, offset, capacity), params, expert_fn)
  # Back: my slot of source s returns to s's sorted array at the offset s sent it from.
  return ragged_exchange(out.reshape(n * capacity, d),
                         _zeros_like(out, (a, d), receiving) if into is None else into,
                         slots, receiving, jnp.minimum(their_start + offset, a), sending, axes)


def _zeros_like(x, shape, sizes, at: int = 0):
  """Zeros of `shape` typed like x, made from `sizes[at]` (a value XLA cannot know is 0), for an
  output buffer that a ragged all-to-all writes in place: zeros from a constant XLA merges with
  the other zeros of that shape (another exchange's buffer, of the other chunk or the other
  direction), and then copies each buffer the collectives share. zeros_like keeps x's varying
  axes: a plain constant would be cast to varying, and the cast's transpose is an all-reduce of
  the whole buffer over every device in the backward."""
  return jnp.zeros_like(x, shape=shape) + jnp.minimum(sizes[at], 0).astype(x.dtype)


def ragged_exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axes):
  """jax.lax.ragged_all_to_all, transposed as JAX transposes it but into a buffer of its own
  (_zeros_like): JAX's rule takes a constant of zeros, which XLA merged across a layer's four
  transposed exchanges of equal shapes and copied for three of them (the Qwen3-30B-A3B EP16
  force-balanced step: 3 copies of bf16 [16384, 2048] a layer, 0.44 s). Its output is named a
  kernel's residual: remat="none" keeps it, as it keeps the primitive's (models/compute.py),
  where the custom gradient would hide the primitive from the policy."""
  return keep(_ragged(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                      axes))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _ragged(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axes):
  return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                   recv_sizes, axis_name=axes)


def _ragged_forward(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                    axes):
  rows = jnp.zeros((operand.shape[0], 0), operand.dtype)  # the operand's rows and type, 0 bytes
  return (_ragged(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axes),
          (rows, input_offsets, send_sizes, output_offsets, recv_sizes))


def _ragged_backward(axes, residuals, t):
  rows, input_offsets, send_sizes, output_offsets, recv_sizes = residuals
  # Each device's rows go back from where they landed to where they were sent from.
  landed = jax.lax.all_to_all(output_offsets, axes, 0, 0, tiled=True)
  sent_from = jax.lax.all_to_all(input_offsets, axes, 0, 0, tiled=True)
  # The buffer from the sizes' last element: the forward's buffers take the first, and the
  # transposed return's sizes are the forward return's (of the same shape where the pairs are
  # balanced).
  operand_t = jax.lax.ragged_all_to_all(
      t, _zeros_like(t, (rows.shape[0], *t.shape[1:]), send_sizes, at=-1), landed, recv_sizes,
      sent_from, send_sizes, axis_name=axes)
  # The output buffer's rows the exchange overwrote get no gradient; the rest pass through.
  # Marked by adds (JAX's rule sets the starts: a source of no rows landing where the next
  # one starts would then unmark that one's rows).
  marks = jnp.zeros(t.shape[0], jnp.int32).at[landed].add(1).at[landed + recv_sizes].add(-1)
  received = (jnp.cumsum(marks) > 0).reshape(-1, *[1] * (t.ndim - 1))
  output_t = jnp.where(received, jnp.zeros((), t.dtype), t)
  return operand_t, output_t, None, None, None, None


_ragged.defvjp(_ragged_forward, _ragged_backward)


_ROUNDS = {"padded": _padded_round, "ragged": _ragged_round}
