"""Context parallelism: the sequence order (load-balanced "zigzag", or contiguous) and the
shard_map that runs per-device context attention (ring, all-gather, Ulysses or their USP hybrid)
over the mesh axes splitting the sequence. `load_balanced` is the one place the order is chosen
(the layout records it when resolved): `zigzag` reorders the batch by it and `context_attention`
tells the kernel which order it got."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from sharding.mesh import LayoutError
from sharding.scope import constrain, spec
from sharding.shard_map import stage_shard_map

CONTEXT_IMPLS = ("ring", "allgather", "ulysses", "ulysses_ring")
# The impls that pass blocks around a ring by collective-permutes, which cannot run inside a
# pipeline stage: the permutes would sit in the stage's per-tick branch, which the other stages
# do not take at that tick, and a collective-permute is one collective over every device (the
# CPU runtime waits for all of them: a deadlock). All-gathers and all-to-alls run within the
# context group, whose devices share a stage and so its branch.
RING_IMPLS = ("ring", "ulysses_ring")
# The hybrid's two factors of `context`: axes of a mesh view that exists only inside its shard_map
# (`factored`); the run's mesh keeps its six axes.
RING_AXIS, ULYSSES_AXIS = "context_ring", "context_ulysses"
# The vmap axis over which each data-parallel replica's devices differentiate their own parts
# of a sequence (trainer/step.py, `Layout.gradient_sequence_axes`).
SEQUENCE_PARTS = "sequence_parts"


def zigzag_permutation(length: int, parts: int) -> np.ndarray:
  """The order that gives device i sequence chunks i and 2·parts−1−i (of 2·parts chunks), so
  every device gets the same amount of causal attention work."""
  if length % (2 * parts):
    raise ValueError(f"seq_len={length} is not divisible by 2 x context={2 * parts} (the"
                     " load-balanced order splits the sequence into 2 chunks per device)")
  chunks = np.arange(length).reshape(2 * parts, length // (2 * parts))
  return np.concatenate([np.concatenate([chunks[i], chunks[2 * parts - 1 - i]])
                         for i in range(parts)])


def load_balanced(window: int = 0, impl: str = "ring") -> bool:
  """Whether a split sequence is in the zigzag order (else contiguous: device i holds the i-th
  block). Full causal attention: zigzag, which balances the causal work of the ring (and of
  the hybrid's ring, `kernels.ulysses_ring_attention`). With a sliding window every query
  attends at most `window` keys, so the contiguous order is balanced already (except over the
  first window of the sequence, where queries have fewer keys), and it lets the ring skip the
  hops no window reaches; zigzag would need hops in both directions. Ulysses (`impl`
  "ulysses"): contiguous, always: its all-to-all concatenates the blocks in device order, so
  the kernel gets each sequence whole and in its natural order, which its causal mask (by
  index) needs; every device attends whole sequences, so there is nothing to balance."""
  return not window and impl != "ulysses"


def zigzag(batch: dict, layout) -> dict:
  """Reorders the sequence dim of every [B, L] batch array into the zigzag order when the
  layout splits the sequence in the load-balanced order (`layout.load_balanced`, decided by
  `load_balanced` from the model's window and context impl); identity otherwise. The loss is a
  sum over tokens and attention masks come from positions and segment ids, so nothing has to be
  undone afterwards."""
  if not layout.sequence_axes or not layout.load_balanced:
    return batch
  order = zigzag_permutation(next(iter(batch.values())).shape[1], layout.sequence_parts)
  return {k: constrain(jnp.take(v, order, axis=1), ("batch", "seq")) for k, v in batch.items()}


def whole_sequence_sum(x, layout, axis: int = 1):
  """(sum, length) over the sequence dim `axis` of a [B, L, ...] value, over the whole sequence
  also where the train step differentiates each device's part of it apart (in a pipeline
  stage manual over the sequence axes, `Layout.stage_sequence_axes`; inside the replicas'
  vmap with `layout.gradient_sequence_axes`, whose axis SEQUENCE_PARTS runs over R replicas x
  C parts, replica-major): the sums of the C parts of this replica are added up. (A gather of
  the [R·C, B, ...] sums: psum takes no groups under vmap.)"""
  total, length = jnp.sum(x, axis=axis), x.shape[axis]
  if layout.in_pipeline_stage and layout.stage_sequence_axes:  # manual there: its parts psum
    return (jax.lax.psum(total, layout.stage_sequence_axes),
            length * layout.sequence_parts)
  if layout.in_replica_vmap and layout.gradient_sequence_axes:
    parts = layout.sequence_parts
    every = jax.lax.all_gather(total, SEQUENCE_PARTS)
    replica = jax.lax.axis_index(SEQUENCE_PARTS) // parts
    mine = jax.lax.dynamic_index_in_dim(every.reshape(-1, parts, *total.shape), replica,
                                        keepdims=False)
    total, length = jnp.sum(mine, axis=0), length * parts
  return total, length


def check_ulysses_degree(impl: str, degree: int) -> None:
  """One-line ValueError for a compute.ulysses_degree its context_impl cannot take."""
  if not {"ulysses": degree >= 0, "ulysses_ring": degree > 0}.get(impl, degree == 0):
    raise ValueError(f"compute.ulysses_degree={degree} does not fit"
                     f" compute.context_impl={impl!r}: ulysses takes 0 or the context size,"
                     " ulysses_ring its inner factor (> 0), ring and allgather 0")


def ulysses_degree(impl: str, degree: int, context: int) -> int:
  """The devices one Ulysses all-to-all spans: the whole context split for "ulysses" (degree 0
  or `context`), the inner factor `degree` for "ulysses_ring", 1 (none) for the others."""
  if impl == "ulysses":
    return context
  return degree if impl == "ulysses_ring" else 1


def factored(mesh: Mesh, degree: int) -> Mesh:
  """`mesh` with its `context` axis split into (RING_AXIS, ULYSSES_AXIS) = (context / degree,
  degree), the Ulysses factor inner: context index c = ring position x degree + Ulysses index,
  so the all-to-alls stay within groups of adjacent devices (the fastest links) and a sequence
  split over `context` is split over (ring, Ulysses) alike.

  Why a mesh view rather than `axis_index_groups` on one axis: jax 0.10's all_to_all rejects
  index groups under vmap (NotImplementedError), which the gradient-accumulation replicas need
  (trainer/step.py), and the ring would need group-aware gathers and index arithmetic; with two
  real axes both kernels run unchanged. The view holds the same devices in the same order, so
  the shard_map's inputs and outputs keep the run mesh's layout (no resharding)."""
  names = list(mesh.axis_names)
  i = names.index("context")
  shape = list(mesh.devices.shape)
  shape[i:i + 1] = [shape[i] // degree, degree]
  types = list(mesh.axis_types)
  types[i:i + 1] = [types[i]] * 2
  return Mesh(mesh.devices.reshape(shape), (*names[:i], RING_AXIS, ULYSSES_AXIS, *names[i + 1:]),
              axis_types=tuple(types))


def _factor_spec(spec: PartitionSpec) -> PartitionSpec:
  """A spec on the run's mesh, on the `factored` view: `context` becomes (ring, Ulysses)."""
  def entry(axes):
    if axes is None:
      return None
    axes = (axes,) if isinstance(axes, str) else axes
    out = tuple(a for axis in axes for a in ((RING_AXIS, ULYSSES_AXIS) if axis == "context"
                                             else (axis,)))
    return out[0] if len(out) == 1 else out
  return PartitionSpec(*(entry(axes) for axes in spec))


def context_attention(layout, kernel: Callable, q, k, v, positions, segment_ids, *,
                      window: int = 0, check_vma_on_cpu: bool = True,
                      q_names=("batch", "seq", "act_heads", "head_dim"),
                      kv_names=("batch", "seq", "act_kv_heads", "head_dim"), v_names=None):
  """Runs `kernel(q, k, v, positions, segment_ids, axis_name=..., window=..., contiguous=...)`
  (kernels.ring_attention, allgather_attention, ulysses_attention or ulysses_ring_attention)
  per device with the sequence split over the layout's sequence axes.

  The layout's context_impl chose the batch's order (`zigzag`, `layout.load_balanced`);
  "ulysses_ring" also splits `context` into its ring and Ulysses factors (`factored`, Ulysses
  `layout.ulysses_degree` inner) and hands the kernel both axis names. `window`: this layer's
  sliding window (0: full attention); in the contiguous order a windowed layer's ring skips
  the hops it does not need (a full-attention layer of such a model runs every hop). v may have
  its own head dim (MLA) and names (`v_names`, default `kv_names`); the output has q's names
  with v's head dim. `check_vma_on_cpu`: False for a Pallas kernel interpreted on CPU inside
  the kernel (sharding.shard_map_logical says why).

  The shard_map is manual over every mesh axis, with specs from the logical names: attention is
  independent across batch rows and heads, so each device attends its own rows and heads over
  its part of the sequence, and the kernel only communicates over the context axes. (A region
  manual over the context axes alone could not sit inside the data-parallel vmap of gradient
  accumulation.)
  """
  axes = layout.sequence_axes
  token_names = (q_names[0], q_names[1])
  specs = (spec(q_names, q.shape, "context attention q"),
           spec(kv_names, k.shape, "context attention k"),
           spec(v_names or kv_names, v.shape, "context attention v"),
           spec(token_names, positions.shape, "context attention positions"),
           spec(token_names, positions.shape, "context attention segment ids"))
  out_spec = spec(q_names, (*q.shape[:-1], v.shape[-1]), "context attention output")
  contiguous = not layout.load_balanced
  mesh, axis_name = layout.mesh, axes[0] if len(axes) == 1 else axes
  if layout.context_impl == "ulysses_ring":
    if axes != ("context",):
      raise LayoutError(f"context_impl=ulysses_ring factors the `context` axis, but the sequence"
                        f" is split over {axes}; keep the `seq` rule at context alone")
    mesh, axis_name = factored(mesh, layout.ulysses_degree), (RING_AXIS, ULYSSES_AXIS)
    specs, out_spec = tuple(map(_factor_spec, specs)), _factor_spec(out_spec)

  def per_device(q, k, v, positions, segment_ids):
    return kernel(q, k, v, positions, segment_ids, axis_name=axis_name, window=window,
                  contiguous=contiguous)

  # Inside the data-parallel replicas' vmap (gradient accumulation, trainer/step.py), JAX 0.10's
  # varying-axes check rejects the batched ring's transposes ("mul requires varying manual axes
  # to match"). It is off there only: every input is split over every mesh axis the layout uses
  # (batch over the data axes, sequence over context, heads over tensor), so no value is
  # replicated whose gradient the check would have to sum; tests/test_context_parallel.py shows
  # the result equal to one device.
  check = not layout.in_replica_vmap and (check_vma_on_cpu or layout.platform != "cpu")
  if layout.in_pipeline_stage:
    # Nested in a stage's shard_map (manual over the pipeline and the replicas' axes, and over
    # the sequence's where `Layout.stage_sequence_axes`): the region names the stage's abstract
    # mesh and is manual over the rest (tensor: a Pallas kernel called on the stage's values
    # as they are would run every head on every device); its gradient recomputes the attention
    # (sharding.shard_map.stage_shard_map says why JAX's own cannot be used there). The ring is
    # refused in stages (sharding/resolution.py). Named: a scanned chunk's layer checkpoint
    # (remat none) keeps the region's outputs and residuals rather than running it again in
    # the backward tick.
    return stage_shard_map(per_device, layout.stage_mesh(), specs, out_spec, check,
                           opaque=True, named=True)(q, k, v, positions, segment_ids)
  mapped = jax.shard_map(per_device, mesh=mesh, in_specs=specs, out_specs=out_spec,
                         check_vma=check)
  return mapped(q, k, v, positions, segment_ids)
