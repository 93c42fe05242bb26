"""Runs a per-device function under jax.shard_map on the layout's mesh, with specs from logical
names."""

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, PartitionSpec

from kernels.pallas_triton import varying_like
from sharding.mesh import LayoutError, mesh_sizes
from sharding.scope import spec

Names = tuple[str | None, ...]

# The name a nested stage region's forward gives its output and kept pullback leaves where the
# caller asks (`named`), for a layer's remat policy to keep (models/compute.py's "none" keeps
# every named value).
STAGE_REGION = "stage_region"


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
    # One device, or the expert loop's region, manual over every axis that splits (sharding/
    # expert_loop.py): the values are the device's own.
    if layout.mesh is None or layout.in_expert_loop:
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

    check_vma = check_vma_on_cpu or layout.platform != "cpu"
    if layout.in_pipeline_stage:
      # Named: a scanned chunk's layer checkpoint (remat none) keeps the kernel's residuals (a
      # flash kernel's output and row statistics) rather than running it again in the backward.
      mapped = stage_shard_map(per_device, layout.stage_mesh(), in_specs, out_spec, check_vma,
                               named=True)
    else:
      mapped = jax.shard_map(per_device, mesh=layout.mesh, in_specs=in_specs,
                             out_specs=out_spec, check_vma=check_vma)
    return mapped(*(args[i] for i in present))

  return wrapped


def varying_over(x, axes):
  """x typed as varying over `axes` too, those it does not vary over already (shard_map's
  varying-axes check: loop carries typed as what adds to them, an expert's weight that already
  varies over its own axes)."""
  extra = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
  return jax.lax.pcast(x, extra, to="varying") if extra else x


def stage_shard_map(fn: Callable, mesh, in_specs, out_spec, check_vma: bool, *,
                    opaque: bool = False, named: bool = False) -> Callable:
  """`fn` under a shard_map nested in a pipeline stage's (manual over the pipeline axis and the
  replicas'), differentiated by a second shard_map: JAX's own differentiation of a nested
  shard_map names the residuals it keeps with the outer manual axes too, which Shardy rejects
  ("manual axes come before free axes"). The forward's per-device pullback (jax.vjp's, a
  pytree whose leaves are the residuals) is taken apart: its leaves that are not arguments leave
  the region as outputs split over its devices, and the backward's region puts the pullback
  together again and applies it, running no part of the forward twice (it recomputed the whole
  region: the flash kernel's forward, the experts' exchange and matmuls). The floating-point
  arguments get gradients. `mesh`: the stage's abstract mesh (sharding.Layout.stage_mesh).
  `named`: the forward's output and kept leaves named STAGE_REGION, which a layer checkpoint
  under remat "none" keeps rather than running the region again in its backward."""
  region = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec,
                         check_vma=check_vma)
  # The axes the region makes manual (the stage's already are).
  region_axes = tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types)
                      if t != AxisType.Manual)
  found = {}

  def one_trip(f, *args):
    # One trip of a while loop: a layer's remat policy does not look inside (JAX saves nothing
    # from inside a while), where it would otherwise split the region to keep the values inside
    # it it deems saveable (a collective's output), naming them with the stage's manual axes
    # too (JAX 0.10), which Shardy rejects. Nor does a policy keep a while's outputs: JAX's
    # partial evaluation of a while runs it again where they are needed, so run_forward names
    # them (STAGE_REGION) for the policy to keep.
    traced = jax.make_jaxpr(f, return_shape=True)(*args)
    types = jax.tree.unflatten(jax.tree.structure(traced[1]), traced[0].out_avals)

    def zeros(t):  # typed as the output: the manual axes it varies over too
      axes = tuple(sorted(t.manual_axis_type.varying))
      z = jnp.zeros(t.shape, t.dtype)
      return jax.lax.pcast(z, axes, to="varying") if axes else z
    return jax.lax.while_loop(lambda c: c[0] < 1, lambda c: (c[0] + 1, f(*args)),
                              (jnp.int32(0), jax.tree.map(zeros, types)))[1]

  def differentiable(args) -> list[int]:
    return [i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.inexact)]

  def of(args):  # fn of the differentiable arguments, the others as given
    wrt = differentiable(args)

    def call(*values):
      full = list(args)
      for i, value in zip(wrt, values):
        full[i] = value
      return fn(*full)
    return call, [args[i] for i in wrt]

  def forward_keeping(*args):  # per device: fn's output, and its pullback's leaves to keep
    call, primals = of(args)
    out, pullback = jax.vjp(call, *primals)
    leaves, found["treedef"] = jax.tree.flatten(pullback)
    outs = jax.tree.leaves(out)

    def source(leaf):  # an argument (its index), an output leaf (-2 - its index), or kept (-1):
      # the flash kernel's output is a residual of its own pullback, kept once, as the output
      j = next((j for j, a in enumerate(args) if leaf is a), None)
      return j if j is not None else next((-2 - k for k, o in enumerate(outs) if leaf is o), -1)
    found["sources"] = [source(leaf) for leaf in leaves]
    kept = [leaf for leaf, j in zip(leaves, found["sources"]) if j == -1]
    # Each kept leaf leaves split over the axes it varies over (one slice per device of those),
    # so that the backward's region sees it typed as the forward's did; unchecked, over all.
    found["specs"] = [PartitionSpec(tuple(a for a in region_axes if not check_vma or a in
                                          jax.typeof(leaf).manual_axis_type.varying) or None)
                      for leaf in kept]
    return out, [leaf[None] for leaf in kept]

  def keeping(*args):
    jax.eval_shape(jax.shard_map(  # traced once for the kept leaves' specs
        forward_keeping, mesh=mesh, in_specs=in_specs,
        out_specs=(out_spec, PartitionSpec(region_axes)), check_vma=check_vma), *args)
    return jax.shard_map(forward_keeping, mesh=mesh, in_specs=in_specs,
                         out_specs=(out_spec, found["specs"]), check_vma=check_vma)(*args)

  @jax.custom_vjp
  def run(*args):
    return one_trip(region, *args) if opaque else region(*args)

  def run_forward(*args):
    out, kept = one_trip(keeping, *args)
    if named:  # or a layer checkpoint's backward runs the whole region again to get them back
      out, kept = checkpoint_name((out, kept), STAGE_REGION)
    # The output is a residual only where the pullback reads it (a copy of it kept as well was
    # stored twice: in a kept-residual stage's slots, 3.75 GiB of the 70B PP8 program's).
    return out, (args, kept, out if any(j <= -2 for j in found["sources"]) else None)

  def run_backward(residuals, g):
    args, kept, out = residuals
    wrt = differentiable(args)

    def per_device_vjp(g, args, kept, out):
      stored, outs = iter(kept), jax.tree.leaves(out)
      leaves = [args[j] if j >= 0 else next(stored)[0] if j == -1 else outs[-2 - j]
                for j in found["sources"]]
      return jax.tree.unflatten(found["treedef"], leaves)(g)

    backward = jax.shard_map(per_device_vjp, mesh=mesh,
                             in_specs=(out_spec, tuple(in_specs), found["specs"],
                                       None if out is None else out_spec),
                             out_specs=tuple(in_specs[i] for i in wrt), check_vma=check_vma)
    # Typed as the primals: unchecked (check_vma off), the region's results do not vary over
    # the stage's manual axes, though the arguments do (a cast, not a transpose: values as is).
    grads = {i: varying_like(d, args[i]) for i, d in zip(wrt, backward(g, args, kept, out))}
    return tuple(grads.get(i) for i in range(len(args)))

  run.defvjp(run_forward, run_backward)
  return run
