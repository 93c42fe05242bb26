"""Expert parallelism for dropless MoE: per-device sort, all-to-all token exchange, grouped FFN."""

import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from kernels.residuals import keep
from sharding.mesh import LayoutError, mesh_sizes
from sharding.rules import entry_axes
from sharding.scope import spec
from sharding.shard_map import stage_shard_map, varying_over

Names = tuple[str | None, ...]
TOKEN_NAMES = ("batch", "seq", None)  # x [B, L, D] (D whole), expert ids and weights [B, L, k]
FOLDED_TOKEN_NAMES = ("batch", "res_seq", None)  # the same, split as the residual stream
EXCHANGES = ("auto", "padded", "ragged")


class ExpertAxes(NamedTuple):
  """The mesh axes of the per-device expert FFN, for what must see past one device's rows,
  experts and hidden columns (fp8 amaxes: models/fp8/grouped.py). Empty outside a context."""
  experts: tuple[str, ...] = ()  # split the experts
  hidden: tuple[str, ...] = ()  # split the params' `partial_over` dims
  rows: tuple[str, ...] = ()  # hold other tokens routed to the same (local) experts

  @property
  def every(self) -> tuple[str, ...]:
    return tuple(sorted({*self.experts, *self.hidden, *self.rows}))


def dropless_experts(layout, expert_fn: Callable, x_BLD: jax.Array, ids_BLk: jax.Array,
                     weights_BLk: jax.Array, params: Sequence[jax.Array],
                     param_names: Sequence[Names], *, num_experts: int,
                     partial_over: str | None = None, check_vma: bool = True) -> jax.Array:
  """y[t] = sum_k weights[t, k] * expert_fn_{ids[t, k]}(x[t]): every assignment computed.

  On the layout's mesh this runs per device under `jax.shard_map` over the whole mesh, with
  specs from logical names: tokens keep their batch/seq sharding and are sorted by expert
  locally; each param's first dim (the experts) keeps its mesh axes, and when those axes have
  N > 1 devices, the tokens travel to the devices holding their experts and back by all-to-all
  (a padded buffer of worst-case size, or `ragged_all_to_all` on GPUs). Param dims named
  `partial_over` (e.g. the expert hidden dim over `tensor`) stay split: `expert_fn` then
  returns partial sums, reduced by psum at the end. Every other param dim is gathered by XLA
  before the region (e.g. `embed` over fsdp; its gradient is reduce-scattered back).

  Args:
    layout: the run's sharding.Layout: its mesh, its token exchange ("padded" or "ragged";
      XLA:CPU cannot run the ragged one) and whether the model runs in a pipeline stage.
    expert_fn: (x_sorted [A, D], group_sizes [E_local] int32, *local params, axes=ExpertAxes)
      -> [A, D]; rows are grouped by local expert in order, rows past sum(group_sizes) are
      padding (zeros, ignored).
    x_BLD: tokens.
    ids_BLk: int expert of each of the k assignments (top-k slots) of a token.
    weights_BLk: mixing weight of each assignment.
    params: expert weights, each with the experts as its first dim.
    param_names: logical names of each param (its first must be the experts' name).
    num_experts: E.
    partial_over: logical name of param dims whose split makes expert_fn's output partial.
    check_vma: False when expert_fn runs a Pallas kernel, whose outputs shard_map's
      varying-axes check cannot type everywhere: the CPU interpreter re-evaluates the kernel on
      device-varying blocks (sharding/shard_map.py says why), and under the data-parallel
      replicas' vmap (gradient accumulation) pallas_call's batching keeps the output types it
      was traced with, without the vmapped axis. Off, shard_map differentiates as before the
      check existed (inputs a device does not split are summed at the region's boundary);
      tests/test_grouped_matmul.py shows the gradients equal ragged_dot's.
  Returns:
    y [B, L, D] in x's dtype and sharding.
  """
  static = dict(expert_fn=functools.partial(expert_fn, axes=ExpertAxes()),
                num_experts=num_experts)
  if layout.mesh is None:
    return _per_device(x_BLD, ids_BLk, weights_BLk, *params, expert_axes=(), partial_axes=(),
                       exchange="padded", **static)

  def keep(names):  # the experts dim and the partial dims keep their axes; the rest is gathered
    return tuple(n if i == 0 or n == partial_over else None for i, n in enumerate(names))

  param_specs = [spec(keep(n), p.shape, f"moe expert param {i}")
                 for i, (n, p) in enumerate(zip(param_names, params))]
  # In a pipeline stage manual over the expert axes (`Layout.stage_expert_axes`) the weights
  # come split over them and the tokens are the device's own; the exchange still runs over them.
  manual = layout.stage_expert_axes if layout.in_pipeline_stage else ()
  expert_axes = (*manual, *entry_axes(param_specs[0][0]))
  partial_axes = tuple(sorted({a for s, names in zip(param_specs, param_names)
                               for entry, n in zip(s, names) if n == partial_over
                               for a in entry_axes(entry)}))
  sizes = mesh_sizes(layout.mesh)
  shards = math.prod(sizes[a] for a in expert_axes)
  if num_experts % shards:
    raise LayoutError(f"moe: {num_experts} experts cannot be split over"
                      f" {' x '.join(f'{a}={sizes[a]}' for a in expert_axes)}")
  token_names = TOKEN_NAMES
  folded = set(expert_axes) & set(entry_axes(spec(FOLDED_TOKEN_NAMES, x_BLD.shape)[1]))
  if folded and not partial_axes:
    # Experts split over an axis that splits the sequence too (`tensor` under sequence
    # parallelism: sharding.layout.experts_over_tensor): each device routes its own part of
    # it, as Megatron's expert tensor parallelism of 1 does (gathered, each went from each).
    token_names = FOLDED_TOKEN_NAMES
  token_spec = spec(token_names, x_BLD.shape, "moe tokens")
  choice_spec = spec(token_names, ids_BLk.shape, "moe expert choices")
  token_axes = {a for entry in token_spec for a in entry_axes(entry)}
  if unsplit := sorted(set(expert_axes) - token_axes - set(manual)):
    raise LayoutError(f"moe: the experts are split over {', '.join(unsplit)}, which does not"
                      " split the tokens, so each of its devices would route the same tokens;"
                      " split the sequence over it too (mesh.sequence_parallel=true for tensor)"
                      " or drop it from the experts' sharding rule")
  axes = ExpertAxes(expert_axes, partial_axes,
                    tuple(sorted(token_axes - {*expert_axes, *partial_axes})))
  static["expert_fn"] = functools.partial(expert_fn, axes=axes)

  def body(x, ids, weights, *local_params):
    # The rounds' count is agreed over every axis of the region (fp8 amaxes are pmax'ed over
    # them inside each round); not over a pipeline's stages, which run other ticks' work.
    return _per_device(x, ids, weights, *local_params, expert_axes=expert_axes,
                       partial_axes=partial_axes, exchange=layout.exchange,
                       exchange_capacity=layout.exchange_capacity, sync_axes=axes.every,
                       **static)

  in_specs = (token_spec, choice_spec, choice_spec, *param_specs)
  if layout.in_pipeline_stage:
    # Checked on GPUs even with a Pallas expert_fn (its Triton call types its outputs): off, the
    # stage's arguments vary over `pipeline` while the region's results do not, and the
    # backward's pullback refuses the mix. The CPU interpreter still needs it off.
    check_vma = check_vma or layout.platform != "cpu"
    return stage_shard_map(body, layout.stage_mesh(), in_specs, token_spec, check_vma)(
        x_BLD, ids_BLk, weights_BLk, *params)
  mapped = jax.shard_map(body, mesh=layout.mesh, in_specs=in_specs, out_specs=token_spec,
                         check_vma=check_vma)
  return mapped(x_BLD, ids_BLk, weights_BLk, *params)


@jax.custom_vjp
@custom_vmap
def _batch_like(w, x):
  """w, unchanged; but under jax.vmap of x (gradient accumulation vmaps the loss over
  microbatch replicas), w broadcast along the vmapped dim, because jax.lax.ragged_dot has no
  batching rule for unbatched weights (JAX 0.10: "vmap over any dim but 0 - NYI")."""
  del x
  return w


@_batch_like.def_vmap
def _batch_like_rule(axis_size, in_batched, w, x):
  if in_batched[0] or not in_batched[1]:
    return w, in_batched[0]
  # Typed like x too: the replicas' vmap may map its dim to a mesh axis (spmd_axis_name), over
  # which x then varies; a w that did not would fail the varying-axes check of any op meeting
  # x's values (the fp8 scales of models/fp8/grouped.py, reduced from both).
  w = jnp.broadcast_to(w, (axis_size, *w.shape))
  varying = lambda a: jax.typeof(a).manual_axis_type.varying
  extra = tuple(sorted(varying(x) - varying(w)))
  return (jax.lax.pcast(w, extra, to="varying") if extra else w), True


# custom_vmap has no reverse mode: the identity's gradient is given here (per replica under vmap).
_batch_like.defvjp(lambda w, x: (_batch_like(w, x), None), lambda _, g: (g, None))


def _per_device(x_BLD, ids_BLk, weights_BLk, *params, expert_fn, num_experts, expert_axes,
                partial_axes, exchange, exchange_capacity=0.0, sync_axes=()):
  """One device's tokens: sort by expert, run (locally or across `expert_axes`), unsort, mix."""
  b, l, d = x_BLD.shape
  k = ids_BLk.shape[-1]
  tokens, assignments = b * l, b * l * k
  # Typed as varying over the split hidden dim's axes from here: the rows' gradient is a partial
  # sum over them, and the psum that ends it then runs on these [b*l, D] tokens, once, where the
  # experts' matmul would sum each round's received buffer (k x the exchange capacity x their
  # rows: DeepSeek-V3's [65536, 7168] over `tensor`, five times a tick).
  x_BLD = varying_over(x_BLD, partial_axes)
  expert = ids_BLk.reshape(assignments).astype(jnp.int32)
  order = jnp.argsort(expert, stable=True)  # assignments grouped by expert, token order kept
  back = _inverse(order)
  # Each token's k copies, sorted (the broadcast fuses into the gather; its transpose, a sum
  # over the k copies, into the backward's gather, where x[order // k] would scatter-add).
  x_sorted = _permuted(jnp.broadcast_to(x_BLD.reshape(tokens, 1, d), (tokens, k, d)).reshape(
      assignments, d), order, back)
  counts = jnp.bincount(expert, length=num_experts).astype(jnp.int32)
  params = [_batch_like(p, x_sorted) for p in params]
  if not expert_axes:
    y_sorted = expert_fn(x_sorted, counts, *params)
  else:
    n = _size(expert_axes)
    worst = tokens * min(k, num_experts // n)  # all my tokens' assignments to one device
    capacity = worst if not exchange_capacity else min(
        worst, max(1, math.ceil(exchange_capacity * assignments / n)))
    y_sorted = _exchange(x_sorted, counts, params, expert_fn, expert_axes, capacity, worst,
                         exchange, sync_axes)
  y = _permuted(y_sorted, back, order).reshape(tokens, k, d)
  y = jnp.sum(y * weights_BLk.reshape(tokens, k, 1).astype(y.dtype), axis=1)
  if partial_axes:  # expert_fn split its hidden dim: its outputs were partial sums
    y = jax.lax.psum(y, partial_axes)
  return y.reshape(b, l, d).astype(x_BLD.dtype)


def _size(axes) -> int:
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
  back = _inverse(regroup)
  group_sizes = jnp.sum(recv_counts, axis=0)
  out = expert_fn(_permuted(recv.reshape(n * cap, d), regroup, back), group_sizes, *params)
  out = jnp.where((jnp.arange(n * cap) < jnp.sum(group_sizes))[:, None], out, 0)
  return _permuted(out, back, regroup).reshape(n, cap, d)


def _inverse(perm):
  """The inverse of a permutation of rows (a scatter of ints, not a sort)."""
  rows = jnp.arange(perm.shape[0], dtype=perm.dtype) + perm * 0  # batched like perm under vmap
  return jnp.zeros_like(perm).at[perm].set(rows, unique_indices=True)


@jax.custom_vjp
def _permuted(x, perm, inverse):
  """x[perm] for a permutation `perm` of x's rows (`inverse` its inverse). Autodiff would undo a
  gather by a scatter-add into a zeroed buffer, and a scatter (x.at[perm].set) by JAX's general
  scatter JVP, which scatters an id per element to choose among colliding updates: a
  permutation has no collisions, so both directions are one gather of the rows."""
  return x[perm]


def _permuted_forward(x, perm, inverse):
  return x[perm], inverse


def _permuted_backward(inverse, g):
  return g[inverse], None, None


_permuted.defvjp(_permuted_forward, _permuted_backward)


def _ceil_div(a, b):
  return (a + b - 1) // b


def _exchange(x_sorted, counts, params, expert_fn, axes, capacity, worst, exchange, sync_axes):
  """Tokens to the devices of their experts and back, in rounds of at most `capacity` rows per
  device pair: round r moves rows [r·capacity, (r+1)·capacity) of each pair's share. Every
  device in `sync_axes` runs as many rounds as the heaviest pair needs, so nothing is dropped
  and the buffers are sized by `capacity`, not by the worst case. `capacity` == `worst` (the
  most one device can send another) is one round, differentiated as it is written; fewer rows
  run a while loop of rounds under `_rounds`' custom gradient."""
  round_fn = functools.partial(_ROUNDS[exchange], expert_fn=expert_fn, axes=axes,
                               capacity=capacity)
  if capacity >= worst:
    return round_fn(x_sorted, counts, params, 0)
  n = _size(axes)
  heaviest = jnp.max(jnp.sum(counts.reshape(n, -1), axis=1)).astype(jnp.int32)
  rounds = _ceil_div(jax.lax.pmax(varying_over(heaviest, sync_axes), sync_axes), capacity)
  # Named (kept by remat="none", models/compute.py): else the backward would run the forward's
  # rounds again only to have their output.
  return keep(_rounds(round_fn, varying_over(jnp.zeros_like(x_sorted), sync_axes), rounds,
                      x_sorted, counts, *params))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rounds(round_fn, zeros, rounds, x_sorted, counts, *params):
  """sum over r < rounds of round_fn(x_sorted, counts, params, r), in a while loop: its trip
  count is the data's, so autodiff cannot reverse it; the backward below runs the rounds again,
  each round's forward recomputed inside its vjp (residuals: the inputs only)."""
  return _per_replica(functools.partial(_forward_rounds, round_fn))(
      zeros, rounds, x_sorted, counts, *params)


def _forward_rounds(round_fn, zeros, rounds, x_sorted, counts, *params):
  # Typed like the rows too: one replica's rows (per_replica) vary over the vmapped mesh axis.
  zeros = varying_over(zeros, tuple(jax.typeof(x_sorted).manual_axis_type.varying))

  def body(carry):
    r, y = carry
    return r + 1, y + round_fn(x_sorted, counts, params, r)
  return jax.lax.while_loop(lambda c: c[0] < rounds, body, (jnp.zeros_like(rounds), zeros))[1]


def _backward_rounds(round_fn, rounds, x_sorted, counts, g, *params):
  def body(carry):
    r, dx, dparams = carry
    _, pullback = jax.vjp(lambda x, p: round_fn(x, counts, p, r), x_sorted, params)
    ddx, ddparams = pullback(g)
    return r + 1, dx + ddx, jax.tree.map(jnp.add, dparams, ddparams)

  init = (jnp.zeros_like(rounds), jnp.zeros_like(x_sorted), jax.tree.map(jnp.zeros_like, params))
  _, dx, dparams = jax.lax.while_loop(lambda c: c[0] < rounds, body, init)
  return dx, *dparams


def _per_replica(fn):
  """fn, which under jax.vmap (the data-parallel replicas' of gradient accumulation) runs once
  per replica in a Python loop instead of batched. Batched, its while loop would take a batched
  predicate, and JAX 0.10 types the batched loop's carry as varying over the vmapped mesh axis
  and its closed-over routing counts as not: ops mixing the two fail shard_map's check."""
  wrapped = custom_vmap(fn)

  @wrapped.def_vmap
  def rule(axis_size, in_batched, *args):
    outs = [fn(*(a[i] if batched else a for a, batched in zip(args, in_batched)))
            for i in range(axis_size)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *outs)
    return stacked, jax.tree.map(lambda _: True, stacked)

  return wrapped


def _rounds_forward(round_fn, zeros, rounds, x_sorted, counts, *params):
  y = _rounds(round_fn, zeros, rounds, x_sorted, counts, *params)
  return y, keep((rounds, x_sorted, counts, params))


def _rounds_backward(round_fn, residuals, g):
  rounds, x_sorted, counts, params = residuals
  dx, *dparams = _per_replica(functools.partial(_backward_rounds, round_fn))(
      rounds, x_sorted, counts, g, *params)
  return (None, None, dx, None, *dparams)


_rounds.defvjp(_rounds_forward, _rounds_backward)


def _received_counts(recv_counts, offset, capacity):
  """[N, E_local] rows per local expert in the window [offset, offset + capacity) of each
  source's rows for me (sorted by local expert)."""
  ends = jnp.clip(jnp.cumsum(recv_counts, axis=1) - offset, 0, capacity)
  return jnp.diff(ends, axis=1, prepend=0).astype(jnp.int32)


def _padded_round(x_sorted, counts, params, r, *, expert_fn, axes, capacity):
  """One round by all_to_all of [N, capacity, D] buffers: row j holds this round's rows for
  device j's experts; the result holds the round's rows of x_sorted's outputs, zeros elsewhere."""
  n = _size(axes)
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
  return jnp.where(inside[:, None], back[dest, jnp.clip(at, 0, capacity - 1)], 0)


def _ragged_round(x_sorted, counts, params, r, *, expert_fn, axes, capacity):
  """The same round with ragged_all_to_all: only the real rows travel (GPU)."""
  n = _size(axes)
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
  # Sender's chunk for device j lands in j's buffer at slot (my index) x capacity. The output
  # buffers are zeros typed like the rows they receive (zeros_like keeps x's varying axes): a
  # plain constant would be cast to varying, and the cast's transpose is an all-reduce of the
  # whole buffer over every device in the backward.
  recv = jax.lax.ragged_all_to_all(
      x_sorted, jnp.zeros_like(x_sorted, shape=(n * capacity, d)),
      jnp.minimum(start + offset, a), sending, me * capacity + batched, receiving,
      axis_name=axes)
  out = _run_received(recv.reshape(n, capacity, d),
                      _received_counts(recv_total, offset, capacity), params, expert_fn)
  # Back: my slot of source s returns to s's sorted array at the offset s sent it from.
  return jax.lax.ragged_all_to_all(
      out.reshape(n * capacity, d), jnp.zeros_like(out, shape=(a, d)), slots, receiving,
      jnp.minimum(their_start + offset, a), sending, axis_name=axes)


_ROUNDS = {"padded": _padded_round, "ragged": _ragged_round}
