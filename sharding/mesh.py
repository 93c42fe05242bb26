"""The one device mesh: six named axes in a fixed order, sizes and layout switches from the config."""

import dataclasses
import math

import jax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

# Outer (slowest links) to inner (fastest links). Every mesh has all six; unused ones have size 1.
AXES = ("data", "pipeline", "fsdp", "expert", "context", "tensor")
# Axes that shard the batch: the data-parallel group whose size the global batch must divide.
BATCH_AXES = ("data", "fsdp", "expert")


class LayoutError(ValueError):
  """An invalid parallel layout, reported before anything is compiled."""


@dataclasses.dataclass
class MeshConfig:
  """One size per mesh axis, plus the switches that decide how the axes are used.

  At most one size may be -1 (fills the remaining devices). The default fills every device
  with data parallelism.
  """

  data: int = -1
  pipeline: int = 1
  fsdp: int = 1
  expert: int = 1
  context: int = 1
  tensor: int = 1
  # ZeRO over the `data` axis: 1 shards the optimizer state, 2 also the gradients, 3 also the
  # parameters (then `data` acts like `fsdp`). 0 is plain data parallelism.
  zero_stage: int = 0
  # With tensor > 1: activations between tensor-parallel regions are sharded on the sequence dim
  # over `tensor` (all-gather + reduce-scatter instead of all-reduce).
  sequence_parallel: bool = False
  # With fsdp > 1: split the vocab dims (embedding table, head, logits) over `fsdp` instead of
  # gathering those weights; "auto" does when the head is at least 4x larger than the token rows
  # of the group (sharding.rules.split_vocab_over_fsdp).
  vocab_over_fsdp: str = "auto"
  # With pipeline > 1: the schedule (afab, 1f1b, interleaved_1f1b, paired_1f1b: 1F1B with a
  # forward and a backward in each steady-state tick; zero_bubble; zbv and dualpipev, the
  # V-shaped ones, with virtual_stages=2) of the
  # microbatches (TrainConfig.microbatches) and the layer chunks per stage (interleaving).
  pipeline_schedule: str = "1f1b"
  virtual_stages: int = 1
  # Layers per pipeline position (stage x virtual stage) in model order, e.g. "7+8+8+8+8+8+8+7";
  # "" = even, or when the positions do not divide the layers one fewer on the last and first
  # stages (sharding/pipeline/stage_split.py).
  stage_layers: str = ""
  # With pipeline > 1: a backward tick runs its chunk's forward again from the chunk's input
  # (True), or the forward tick keeps what compute.remat's policy keeps of it for the backward,
  # as Megatron's stages do: faster, more memory (sharding/pipeline/kept_residuals.py).
  pipeline_recompute: bool = True
  # Multi-host: the across-hosts factor of each axis, e.g. "data=4,pipeline=2"; the rest of each
  # axis stays within a host. "" = outer axes span hosts first (data, then pipeline, ...).
  dcn: str = ""
  # Tensor parallelism across hosts is slow (it runs on every layer); refuse unless allowed.
  allow_tensor_across_hosts: bool = False

  def sizes(self) -> tuple[int, ...]:
    return tuple(getattr(self, a) for a in AXES)


def resolve_sizes(config: MeshConfig, num_devices: int) -> dict[str, int]:
  """Returns {axis: size} with -1 filled in; raises LayoutError if the product != num_devices."""
  sizes = dict(zip(AXES, config.sizes()))
  bad = [f"{a}={s}" for a, s in sizes.items() if s == 0 or s < -1]
  if bad:
    raise LayoutError(f"mesh sizes must be positive or -1, got {', '.join(bad)}")
  fill = [a for a, s in sizes.items() if s == -1]
  if len(fill) > 1:
    raise LayoutError(f"only one mesh axis may be -1, got {', '.join(fill)}")
  known = math.prod(s for s in sizes.values() if s != -1)
  if fill:
    if num_devices % known:
      raise LayoutError(
          f"mesh axis {fill[0]}=-1 cannot fill {num_devices} devices: the other axes multiply to"
          f" {known}, which does not divide {num_devices}")
    sizes[fill[0]] = num_devices // known
  product = math.prod(sizes.values())
  if product != num_devices:
    desc = " x ".join(f"{a}={s}" for a, s in sizes.items() if s != 1) or "all axes 1"
    raise LayoutError(
        f"mesh {desc} has {product} devices but {num_devices} are available; change the"
        " --config.mesh.* sizes so they multiply to the device count, or set one of them to -1")
  if config.zero_stage not in (0, 1, 2, 3):
    raise LayoutError(f"mesh.zero_stage must be 0, 1, 2 or 3, got {config.zero_stage}")
  if config.sequence_parallel and sizes["tensor"] == 1:
    raise LayoutError("mesh.sequence_parallel=True needs tensor parallelism: set"
                      " --config.mesh.tensor to more than 1 (or turn sequence_parallel off)")
  return sizes


def parse_dcn(dcn: str) -> dict[str, int]:
  """{axis: across-hosts factor} that mesh.dcn ("data=4,pipeline=2") names; LayoutError for an
  item that is not axis=factor (checked with the config, on one host too)."""
  factors = {}
  for item in filter(None, (p.strip() for p in dcn.split(","))):
    axis, _, value = item.partition("=")
    if axis not in AXES or not value.isdigit() or int(value) < 1:
      raise LayoutError(f"mesh.dcn item {item!r} must be axis=factor with axis one of"
                        f" {', '.join(AXES)} and factor >= 1 (--config.mesh.dcn)")
    factors[axis] = int(value)
  return factors


def split_across_hosts(sizes: dict[str, int], num_hosts: int, dcn: str = "",
                       allow_tensor_across_hosts: bool = False) -> dict[str, int]:
  """Returns {axis: across-hosts factor}; each axis size = factor x its within-host part.

  With `dcn` empty, hosts go to the outer axes first, so the inner ones (tensor, context,
  expert) stay on the fast intra-node links.
  """
  factors = {a: 1 for a in AXES}
  if dcn:
    factors.update(parse_dcn(dcn))
  else:
    remaining = num_hosts
    for axis in AXES:
      factors[axis] = math.gcd(remaining, sizes[axis])
      remaining //= factors[axis]
  for axis in AXES:
    if sizes[axis] % factors[axis]:
      raise LayoutError(f"mesh.dcn: {axis}={sizes[axis]} is not divisible by its across-hosts"
                        f" factor {factors[axis]}")
  if math.prod(factors.values()) != num_hosts:
    raise LayoutError(
        f"the mesh cannot be laid over {num_hosts} hosts: across-hosts factors"
        f" {', '.join(f'{a}={f}' for a, f in factors.items() if f > 1) or 'none'} multiply to"
        f" {math.prod(factors.values())}; set --config.mesh.dcn (e.g. data={num_hosts})")
  if factors["tensor"] > 1 and not allow_tensor_across_hosts:
    raise LayoutError(f"tensor={sizes['tensor']} would span {factors['tensor']} hosts; keep"
                      " tensor within a node or set mesh.allow_tensor_across_hosts=True")
  return factors


def make_mesh(config: MeshConfig, devices=None) -> Mesh:
  """Builds the six-axis mesh over `devices` (default: all), inner axes on the fastest links.

  One process: `jax.make_mesh`. Several: a hybrid mesh, each axis split into its across-hosts
  and within-host parts. Axis types are Auto: shardings come from jit in/out shardings and
  `sharding.constrain`.
  """
  devices = jax.devices() if devices is None else list(devices)
  sizes = resolve_sizes(config, len(devices))
  axis_types = (AxisType.Auto,) * len(AXES)
  num_hosts = len({d.process_index for d in devices})
  if num_hosts == 1:
    return jax.make_mesh(tuple(sizes[a] for a in AXES), AXES, axis_types=axis_types,
                         devices=devices)
  factors = split_across_hosts(sizes, num_hosts, config.dcn, config.allow_tensor_across_hosts)
  within = tuple(sizes[a] // factors[a] for a in AXES)
  across = tuple(factors[a] for a in AXES)
  grid = mesh_utils.create_hybrid_device_mesh(within, across, devices, process_is_granule=True)
  return Mesh(grid, AXES, axis_types=axis_types)


def mesh_sizes(mesh: Mesh) -> dict[str, int]:
  """{axis name: size} of a mesh."""
  return dict(zip(mesh.axis_names, mesh.devices.shape))
