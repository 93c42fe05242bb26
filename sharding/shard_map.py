"""Runs a per-device function under jax.shard_map on the layout's mesh, with specs from logical
names."""

from collections.abc import Callable, Sequence

import jax

from sharding.mesh import LayoutError, mesh_sizes
from sharding.scope import spec

Names = tuple[str | None, ...]


def shard_map_logical(layout, fn: Callable, in_names: Sequence[Names | None], out_names: Names,
                      *, whole: Sequence[str] = (), what: str = "shard_map",
                      check_vma_on_cpu: bool = True) -> Callable:
  """Wraps `fn` (single-device semantics, e.g. a Pallas kernel XLA cannot partition) so that, on
  the layout's mesh, each device runs it on its own shards.

  Specs come from the logical names through the rules of the sharding scope (batch over the data
  axes, heads over `tensor`, ...). `fn` must not communicate: dims it needs whole (`whole`, e.g.
  the sequence for attention) are checked to be unsplit, and every other split dim must be
  independent. A layout without a mesh (one device) calls `fn` as it is.

  Args:
    layout: the run's sharding.Layout (its mesh and platform).
    fn: the per-device function of positional array arguments (None arguments pass through).
    in_names: logical dim names per argument (None for an argument that is None).
    out_names: logical dim names of the single array output.
    whole: logical names that must not be split over any mesh axis for `fn` to be correct.
    what: the operation's name for error messages.
    check_vma_on_cpu: False for a Pallas kernel interpreted on CPU meshes. The Pallas
      interpreter re-evaluates the kernel's pre-traced body on device-varying blocks with
      grid indices that vary over no mesh axis, which shard_map's varying-manual-axes check
      rejects ("dynamic_slice requires varying manual axes to match"; a JAX limitation, not a
      spec error). The check stays on for every other platform, where the kernel lowers for
      real (Triton on GPUs). With no collectives in `fn`, the specs derived here are the whole
      contract the check would verify.
  Returns:
    A function with `fn`'s signature.
  """
  def wrapped(*args):
    if layout.mesh is None:
      return fn(*args)
    if len(args) != len(in_names):
      raise ValueError(f"{what}: {len(args)} arguments but {len(in_names)} name tuples")
    present = [i for i, a in enumerate(args) if a is not None]

    def resolve(names, shape, label):
      resolved = spec(names, shape, f"{what} {label}")
      for name, axes in zip(names, resolved):
        if name in whole and axes is not None:
          sizes = mesh_sizes(layout.mesh)
          axes = (axes,) if isinstance(axes, str) else axes
          split = " x ".join(f"{a}={sizes[a]}" for a in axes)
          raise LayoutError(
              f"{what} {label} {tuple(shape)} {tuple(names)}: {name!r} is split over {split}, but"
              f" {what} needs it whole on each device; use a layout that keeps {name!r} unsplit")
      return resolved

    in_specs = tuple(resolve(in_names[i], args[i].shape, f"argument {i}") for i in present)
    out_shape = jax.eval_shape(fn, *args)  # per-device fn: global shapes map like local ones
    out_spec = resolve(out_names, out_shape.shape, "output")

    def per_device(*present_args):
      full = [None] * len(args)
      for i, a in zip(present, present_args):
        full[i] = a
      return fn(*full)

    mapped = jax.shard_map(per_device, mesh=layout.mesh, in_specs=in_specs, out_specs=out_spec,
                           check_vma=check_vma_on_cpu or layout.platform != "cpu")
    return mapped(*(args[i] for i in present))

  return wrapped
