"""Collective matmul for tensor/sequence parallelism: ppermute steps that overlap the matmuls."""

import functools
import operator
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from sharding.mesh import LayoutError
from sharding.rules import entry_axes, spec_entry
from sharding.scope import spec

Names = Sequence[str | None]


def _dot(x: jax.Array, w: jax.Array, contract: int) -> jax.Array:
  """x's last `contract` dims against w's first `contract` dims."""
  return jnp.tensordot(x, w, axes=contract)


def all_gather_matmul(x: jax.Array, w: jax.Array, axis_name: str, *, gather_dim: int = 0,
                      contract: int = 1) -> jax.Array:
  """`all_gather(x, axis_name, axis=gather_dim, tiled=True) . w` in N steps (per device, inside
  shard_map). Step s multiplies the chunk that started on device (i - s) mod N while the next
  chunk travels one hop around the ring, so only the first chunk's matmul waits for nothing and
  each of the N - 1 transfers can hide behind a matmul.

  Args:
    x: This device's shard, split over `axis_name` on `gather_dim` (a dim that is not contracted).
    w: Weights; its first `contract` dims contract with x's last `contract` dims.
    axis_name: The mesh axis to gather over (a single axis).
    gather_dim: The dim of x (and of the result) that is gathered.
    contract: How many trailing dims of x are contracted.

  Returns:
    x.shape[:-contract] + w.shape[contract:], with gather_dim N times larger.
  """
  n = jax.lax.axis_size(axis_name)
  gather_dim %= x.ndim
  if gather_dim >= x.ndim - contract:
    raise ValueError(f"gather_dim {gather_dim} of x {x.shape} is contracted")
  if n == 1:
    return _dot(x, w, contract)
  me = jax.lax.axis_index(axis_name)
  size = x.shape[gather_dim]
  to_next = [(j, (j + 1) % n) for j in range(n)]
  chunk, out = x, None
  for step in range(n):
    # Sent before this step's matmul uses the chunk: the transfer and the matmul are independent.
    incoming = jax.lax.ppermute(chunk, axis_name, to_next) if step < n - 1 else None
    block = _dot(chunk, w, contract)
    if out is None:
      shape = list(block.shape)
      shape[gather_dim] *= n
      out = jnp.zeros(shape, block.dtype)
    start = ((me - step) % n) * size
    out = jax.lax.dynamic_update_slice_in_dim(out, block, start, gather_dim)
    if incoming is not None:
      # Orders step s's matmul before step s+1's: without it XLA sees N independent matmuls of
      # one weight and merges them into one (DotMerger), which then waits for every transfer.
      incoming, out = jax.lax.optimization_barrier((incoming, out))
    chunk = incoming
  return out


def matmul_reduce_scatter(x: jax.Array, w: jax.Array, axis_name: str, *, scatter_dim: int = 0,
                          contract: int = 1) -> jax.Array:
  """`psum_scatter(x . w, axis_name, scatter_dimension=scatter_dim, tiled=True)` in N steps (per
  device, inside shard_map): a partial sum travels the ring, and each device adds its own
  contribution for that block before passing it on. Block (i - s - 1) mod N is computed at step
  s, so after N - 1 hops device i holds block i; each hop can hide behind the next block's matmul.

  Args:
    x: This device's shard; its contracted dims are split over `axis_name` (partial sums).
    w: This device's weights; first `contract` dims contract with x's last `contract` dims.
    axis_name: The mesh axis to reduce and scatter over (a single axis).
    scatter_dim: The dim of the result (a non-contracted dim of x) that is scattered.
    contract: How many trailing dims of x are contracted.

  Returns:
    x.shape[:-contract] + w.shape[contract:], with scatter_dim N times smaller.
  """
  n = jax.lax.axis_size(axis_name)
  scatter_dim %= x.ndim
  if scatter_dim >= x.ndim - contract:
    raise ValueError(f"scatter_dim {scatter_dim} of x {x.shape} is contracted")
  if n == 1:
    return _dot(x, w, contract)
  if x.shape[scatter_dim] % n:
    raise ValueError(f"dim {scatter_dim} of x {x.shape} does not split over {n} devices")
  me = jax.lax.axis_index(axis_name)
  size = x.shape[scatter_dim] // n
  to_next = [(j, (j + 1) % n) for j in range(n)]

  def part(step, x):
    rows = jax.lax.dynamic_slice_in_dim(x, ((me - step - 1) % n) * size, size, scatter_dim)
    return _dot(rows, w, contract)

  acc = part(0, x)
  for step in range(1, n):
    # x passes the barrier with the running sum, so the next block's matmul cannot be merged
    # with this one's (XLA would compute every block in one matmul before the first transfer).
    acc, x = jax.lax.optimization_barrier((acc, x))
    acc = jax.lax.ppermute(acc, axis_name, to_next) + part(step, x)
  return acc


def _collective_axis(wide: tuple, narrow: tuple, what: str) -> str | None:
  """The one mesh axis by which `wide` (the sharded side) exceeds `narrow`, as its minor part."""
  if wide == narrow:
    return None
  if wide[:len(narrow)] != narrow or len(wide) != len(narrow) + 1:
    raise LayoutError(f"{what}: the dim is split over {wide or 'nothing'} on one side and"
                      f" {narrow or 'nothing'} on the other; a collective matmul needs them to"
                      " differ by one minor mesh axis")
  return wide[-1]


def _logical(x, w, x_names, out_names, contract, kind, what):
  """Specs, collective axis and dim for a collective matmul in the sharding scope's rules."""
  out_shape = x.shape[:-contract] + w.shape[contract:]
  x_spec = spec(x_names, x.shape, f"{what} input")
  out_spec = spec(out_names, out_shape, f"{what} output")
  x_axes, out_axes = _dim_axes(x_spec, x.ndim), _dim_axes(out_spec, len(out_shape))
  lead = x.ndim - contract
  found = []
  for d in range(lead):
    wide, narrow = (x_axes[d], out_axes[d]) if kind == "gather" else (out_axes[d], x_axes[d])
    if (axis := _collective_axis(wide, narrow, f"{what} dim {d}")) is not None:
      found.append((d, axis))
  if len(found) > 1:
    raise LayoutError(f"{what}: dims {[d for d, _ in found]} all change sharding; a collective"
                      " matmul handles one")
  # The contracted dims: replicated for an all-gather matmul, split over the collective axis
  # (partial sums to reduce) for a matmul-reduce-scatter.
  contracted = {a for d in range(lead, x.ndim) for a in x_axes[d]}
  expected = {found[0][1]} if kind == "scatter" and found else set()
  if contracted != expected:
    raise LayoutError(f"{what}: contracted dims of x split over {sorted(contracted)}, expected"
                      f" {sorted(expected) or 'none'}")
  w_spec = jax.sharding.PartitionSpec(*(spec_entry(x_axes[d]) for d in range(lead, x.ndim)),
                                       *(spec_entry(a) for a in out_axes[lead:]))
  return x_spec, w_spec, out_spec, (found[0] if found else None)


def _run(layout, kind: str, x, w, x_names, out_names, contract, what):
  if layout.mesh is None:
    return _dot(x, w, contract)
  x_spec, w_spec, out_spec, found = _logical(x, w, x_names, out_names, contract, kind, what)
  if found is None:  # nothing to gather or scatter in this layout: a plain sharded matmul
    per_device = lambda a, b: _dot(a, b, contract)  # noqa: E731
  elif kind == "gather":
    dim, axis = found
    per_device = lambda a, b: all_gather_matmul(  # noqa: E731
        a, b, axis, gather_dim=dim, contract=contract)
  else:
    dim, axis = found
    per_device = lambda a, b: matmul_reduce_scatter(  # noqa: E731
        a, b, axis, scatter_dim=dim, contract=contract)
  return jax.shard_map(per_device, mesh=layout.mesh, in_specs=(x_spec, w_spec),
                       out_specs=out_spec)(x, w)


def logical_all_gather_matmul(layout, x: jax.Array, w: jax.Array, x_names: Names,
                              out_names: Names, *, contract: int = 1) -> jax.Array:
  """`x . w` (x's last `contract` dims against w's first) where x is split on one more mesh axis
  than the result on one dim (sequence parallelism: x's `res_seq` over `tensor`, the result's
  `seq` not): the gather over that axis runs as `all_gather_matmul` under shard_map.

  The weights are taken split as the result's dims require (e.g. `mlp` over `tensor`) and whole
  elsewhere, so FSDP-sharded weights are all-gathered on the way in. Without a mesh, or when
  the layout splits nothing more, it is the plain matmul.

  Args:
    layout: the run's sharding.Layout (its mesh; the specs come from the sharding scope).
    x: Activations, e.g. [B, L, D] named ("batch", "res_seq", "act_embed").
    w: Weights, e.g. [D, F].
    x_names: Logical names of x's dims.
    out_names: Logical names of the result's dims, e.g. ("batch", "seq", "act_mlp").
    contract: How many trailing dims of x are contracted.
  """
  return _run(layout, "gather", x, w, x_names, out_names, contract, "all_gather_matmul")


def logical_matmul_reduce_scatter(layout, x: jax.Array, w: jax.Array, x_names: Names,
                                  out_names: Names, *, contract: int = 1) -> jax.Array:
  """`x . w` where x's contracted dims are split over a mesh axis (row-parallel: partial sums)
  and the result is split over that axis on one more dim (sequence parallelism: `res_seq` over
  `tensor`): the reduction runs as `matmul_reduce_scatter` under shard_map. Arguments as for
  `logical_all_gather_matmul`, e.g. x [B, L, F] ("batch", "seq", "act_mlp"), result names
  ("batch", "res_seq", "act_embed").
  """
  return _run(layout, "scatter", x, w, x_names, out_names, contract, "matmul_reduce_scatter")


def logical_sum_reduce_scatter(layout, terms: Sequence[tuple[Callable, tuple]],
                               names: Sequence[Sequence[Names]], summed_names: Names,
                               out_names: Names, what: str = "sum_reduce_scatter") -> jax.Array:
  """`sum(fn(*args) for fn, args in terms)`, where each term contracts dims split over the mesh
  axis by which `out_names` splits one dim more than `summed_names` (sequence parallelism: a
  projection input's gradient, ("batch", "seq", ...) summed, `res_seq` over `tensor` scattered),
  with the terms' partial sums added on each device and reduced by one psum_scatter.
  XLA reduces each term's product where the dot is, before the sum, and can merge those
  reductions only when nothing lies between them and the sum; fp8 GEMMs divide their product by
  the scales, so q, k and v's input gradient took 3 reduce-scatters where 1 does (and gate and
  up's 2). Without a mesh, without such an axis, or when a term's contraction is split otherwise
  (kv heads whole on each device), it is the plain sum, partitioned by XLA.

  Args:
    layout: the run's sharding.Layout (its mesh, and whether this runs in a pipeline stage).
    terms: (per-device function, its array arguments) pairs; each function is an einsum-like
      map whose global result shape its global arguments give.
    names: per term, the logical names of each argument (() for a scalar).
    summed_names: logical names of the sum as XLA would hold it reduced (not scattered).
    out_names: logical names of the result.
  """
  def plain():
    return sum_terms(terms)

  if layout.mesh is None:
    return plain()
  shape = jax.eval_shape(plain).shape
  summed = _dim_axes(spec(summed_names, shape, f"{what} sum"), len(shape))
  out_spec = spec(out_names, shape, f"{what} output")
  out = _dim_axes(out_spec, len(shape))
  try:
    found = [(d, axis) for d in range(len(shape))
             if (axis := _collective_axis(out[d], summed[d], f"{what} dim {d}")) is not None]
  except LayoutError:  # split differently, not by one more axis: XLA partitions the plain sum
    return plain()
  if len(found) != 1:
    return plain()
  dim, axis = found[0]
  kept = {a for axes in summed for a in axes}
  in_specs = []
  for (_, args), arg_names in zip(terms, names):
    specs = [spec(n, arg.shape, f"{what} argument") for arg, n in zip(args, arg_names)]
    split = {a for s in specs for e in tuple(s) for a in entry_axes(e)}
    if split - kept != {axis}:  # this term's products are not partial sums over `axis`
      return plain()
    in_specs.append(tuple(specs))

  def per_device(*groups):
    total = sum_terms([(fn, args) for (fn, _), args in zip(terms, groups)])
    return jax.lax.psum_scatter(total, axis, scatter_dimension=dim, tiled=True)

  mesh = layout.stage_mesh() if layout.in_pipeline_stage else layout.mesh
  return jax.shard_map(per_device, mesh=mesh, in_specs=tuple(in_specs),
                       out_specs=out_spec)(*(tuple(args) for _, args in terms))


def sum_terms(terms: Sequence[tuple[Callable, tuple]]) -> jax.Array:
  """`fn(*args)` of each (fn, args) pair, added in order, ((a + b) + c), on one device."""
  return functools.reduce(operator.add, (fn(*args) for fn, args in terms))


def _dim_axes(partition_spec, ndim: int) -> list[tuple[str, ...]]:
  """The mesh axes of each of an array's `ndim` dims (a spec may leave trailing dims out)."""
  entries = tuple(partition_spec)
  return [entry_axes(e) for e in entries + (None,) * (ndim - len(entries))]
