"""Expert parallelism for dropless MoE: per-device sort, all-to-all token exchange, grouped FFN."""

import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from sharding.exchange_rounds import exchange_rows, inverse_of, permuted, size_of
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
    expert_fn: (x [A, D], group_sizes [E_local] int32, *local params, axes=ExpertAxes,
      order=None, back=None) -> [A, D]; rows are grouped by local expert in order (or, given
      `order` and its inverse `back`, sorted row i is x[order[i]], and the outputs come in x's
      order), rows past sum(group_sizes) are padding (zeros; their outputs are never read).
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
  # In a region manual over the expert axes (a pipeline stage's, `Layout.stage_expert_axes`, or
  # the microbatch loop's, `Layout.loop_expert_axes`) the weights come split over them and the
  # tokens are the device's own; the exchange still runs over them.
  manual = layout.region_expert_axes
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
                       keep_first_round=layout.keep_first_round,
                       chunks=layout.exchange_chunks, **static)

  in_specs = (token_spec, choice_spec, choice_spec, *param_specs)
  if layout.in_pipeline_stage:
    # Checked on GPUs even with a Pallas expert_fn (its Triton call types its outputs): off, the
    # stage's arguments vary over `pipeline` while the region's results do not, and the
    # backward's pullback refuses the mix. The CPU interpreter still needs it off.
    check_vma = check_vma or layout.platform != "cpu"
    # Not named (stage_shard_map): a scanned chunk's layer checkpoint runs the region again in
    # the backward tick, its exchange included. Kept, its leaves (the exchange's buffers) took
    # 3.6 GiB a layer in DeepSeek-V3-like PP8 EP64: 87 GiB peak, and 17.85 s a step against
    # 17.58 with neither region named (the reruns' exchanges run mostly hidden).
    return stage_shard_map(body, layout.stage_mesh(), in_specs, token_spec, check_vma)(
        x_BLD, ids_BLk, weights_BLk, *params)
  if layout.in_expert_loop:
    # Manual over every axis that splits (`Layout.loop_expert_axes`): the values are the
    # device's own. Not a nested shard_map: JAX 0.10's differentiation of one fails to lower,
    # and a layer's checkpoint would run stage_shard_map's forward again in the backward.
    return body(x_BLD, ids_BLk, weights_BLk, *params)
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
                partial_axes, exchange, exchange_capacity=0.0, sync_axes=(),
                keep_first_round=False, chunks=1):
  """One device's tokens: sort by expert, run (locally or across `expert_axes`), unsort, mix;
  with an exchange, in `chunks` independent chunks of the tokens (model.moe.exchange_chunks)."""
  b, l, d = x_BLD.shape
  k = ids_BLk.shape[-1]
  tokens = b * l
  # Typed as varying over the split hidden dim's axes from here: the rows' gradient is a partial
  # sum over them, and the psum that ends it then runs on these [b*l, D] tokens, once, where the
  # experts' matmul would sum each round's received buffer (k x the exchange capacity x their
  # rows: DeepSeek-V3's [65536, 7168] over `tensor`, five times a tick).
  x_TD = varying_over(x_BLD, partial_axes).reshape(tokens, d)
  ids_Tk, weights_Tk = ids_BLk.reshape(tokens, k), weights_BLk.reshape(tokens, k)
  chunks = chunks if expert_axes else 1  # without an exchange there is nothing to overlap
  if tokens % chunks:
    raise LayoutError(f"moe: model.moe.exchange_chunks={chunks} does not divide a device's"
                      f" {tokens} tokens (batch x sequence per device); pick a divisor")
  size = tokens // chunks
  run = functools.partial(_sorted_through_experts, params=params, expert_fn=expert_fn,
                          num_experts=num_experts, expert_axes=expert_axes, exchange=exchange,
                          exchange_capacity=exchange_capacity, sync_axes=sync_axes,
                          keep_first_round=keep_first_round)
  # Python-unrolled, not a loop: the chunks must be independent instructions of one
  # computation for the scheduler to interleave them.
  y = jnp.concatenate([run(x_TD[c * size:(c + 1) * size], ids_Tk[c * size:(c + 1) * size],
                           weights_Tk[c * size:(c + 1) * size]) for c in range(chunks)])
  if partial_axes:  # expert_fn split its hidden dim: its outputs were partial sums
    y = jax.lax.psum(y, partial_axes)
  return y.reshape(b, l, d).astype(x_BLD.dtype)


def _sorted_through_experts(x_TD, ids_Tk, weights_Tk, *, params, expert_fn, num_experts,
                            expert_axes, exchange, exchange_capacity, sync_axes,
                            keep_first_round):
  """Tokens [T, D]: their k assignments sorted by expert, run, unsorted and mixed: [T, D]."""
  tokens, d = x_TD.shape
  k = ids_Tk.shape[-1]
  assignments = tokens * k
  expert = ids_Tk.reshape(assignments).astype(jnp.int32)
  order = jnp.argsort(expert, stable=True)  # assignments grouped by expert, token order kept
  back = inverse_of(order)
  # Each token's k copies, sorted (the broadcast fuses into the gather; its transpose, a sum
  # over the k copies, into the backward's gather, where x[order // k] would scatter-add).
  x_sorted = permuted(jnp.broadcast_to(x_TD.reshape(tokens, 1, d), (tokens, k, d)).reshape(
      assignments, d), order, back)
  counts = jnp.bincount(expert, length=num_experts).astype(jnp.int32)
  # Typed as varying like the rows here, where the rows' mesh axes are known: else each GEMM
  # meeting them records a pcast of its own, which the replicas' vmap then applies to weights
  # its rule (_batch_like) already typed so ("pvary ... must not be present").
  rows_vary = tuple(sorted(jax.typeof(x_sorted).manual_axis_type.varying))
  params = [_batch_like(varying_over(p, rows_vary), x_sorted) for p in params]
  if not expert_axes:
    y_sorted = expert_fn(x_sorted, counts, *params)
  else:
    n = size_of(expert_axes)
    worst = tokens * min(k, num_experts // n)  # all my tokens' assignments to one device
    capacity = worst if not exchange_capacity else min(
        worst, max(1, math.ceil(exchange_capacity * assignments / n)))
    y_sorted = exchange_rows(x_sorted, counts, params, expert_fn, expert_axes, capacity,
                             worst, exchange, sync_axes, keep_first_round)
  y = permuted(y_sorted, back, order).reshape(tokens, k, d)
  return jnp.sum(y * weights_Tk.reshape(tokens, k, 1).astype(y.dtype), axis=1)
