"""Resolving a run's layout: from the mesh config, the model's dims, how it is computed and the
batch (`layout_of`: every check that needs no devices), then on the devices (`resolve`: the mesh,
the rules and every decision the traced program reads from the Layout). Model and compute
settings are read by field name (sharding imports no models)."""

import dataclasses
import math
import types

import jax

from kernels.attention import (GPU_PLATFORMS, check_runs as check_attention,
                               resolve as resolve_attention)
from sharding.context_parallel import RING_IMPLS, load_balanced, ulysses_degree
from sharding.layout import MESH_SWITCHES, Layout
from sharding.mesh import BATCH_AXES, LayoutError, MeshConfig, make_mesh, resolve_sizes
from sharding.pipeline import schedules, stage_split



# The compute settings the layout reads (models.compute.ComputeConfig), and their defaults.
COMPUTE_DEFAULTS = {"attention_impl": "auto", "context_impl": "ring", "ulysses_degree": 0,
                    "collective_matmul": False, "remat": "none", "fp8": None}


def _settings(compute) -> types.SimpleNamespace:
  return types.SimpleNamespace(**{name: getattr(compute, name, default)
                                  for name, default in COMPUTE_DEFAULTS.items()})


def layout_of(mesh: MeshConfig, num_devices: int, model, compute=None, *, batch_size: int,
              seq_len: int, microbatches: int = 1) -> Layout:
  """The Layout of a mesh config on `num_devices` devices for `model` (a ModelConfig) computed
  as `compute` says (a ComputeConfig; None: its defaults), both read by field names, and the
  batch, after every check that needs no compile: one-line LayoutErrors."""
  compute = _settings(compute)
  sizes = resolve_sizes(mesh, num_devices)
  shards = math.prod(sizes[a] for a in BATCH_AXES)
  if batch_size % (shards * microbatches):
    axes = " x ".join(f"{a}={sizes[a]}" for a in BATCH_AXES if sizes[a] > 1) or "1"
    raise LayoutError(
        f"batch_size={batch_size} is not divisible by the data-parallel size {shards} ({axes})"
        f" x microbatches={microbatches}; each microbatch is split over the data-parallel"
        " devices")
  layout = Layout(**sizes, **{k: getattr(mesh, k) for k in MESH_SWITCHES},
                  micro_batch=batch_size // (shards * microbatches), microbatches=microbatches,
                  remat=compute.remat, context_impl=compute.context_impl,
                  moe_dispatch=getattr(getattr(model, "moe", None), "dispatch", "dropless"),
                  num_experts=getattr(getattr(model, "moe", None), "num_experts", 0))
  _check_model_fits(layout, model, compute, seq_len)
  layout.splits_vocab(model.vocab_size, seq_len)  # a bad vocab_over_fsdp setting is an error
  return layout


def _check_model_fits(layout: Layout, model, compute, seq_len: int) -> None:
  stages = layout.pipeline
  if layout.stage_layers and stages == 1:
    raise LayoutError(f"stage_layers={layout.stage_layers} splits layers over pipeline stages,"
                      " but pipeline=1: set pipeline > 1 or stage_layers=''")
  if stages > 1:
    if layout.context > 1 and compute.context_impl in RING_IMPLS:
      raise LayoutError(_PIPELINE_RING.format(impl=compute.context_impl))
    if layout.context > 1 and getattr(getattr(model, "moe", None), "dispatch", "") == "dropping":
      raise LayoutError("model.moe.dispatch=dropping does not run with pipeline x context yet"
                        " (its program aborts natively on CPU); use dispatch=dropless, or"
                        " pipeline=1 or context=1")
    split = layout.stage_split(model.num_layers)  # every position gets a layer; a split adds up
    if not layout.pipeline_recompute and not stage_split.keeps_residuals(
        split, model.dense_layers(), getattr(model, "mtp_depth", 0)):
      raise LayoutError(stage_split.KEPT_REFUSAL)
    schedules.make(layout.pipeline_schedule, stages, layout.microbatches,
                   layout.virtual_stages)  # the schedule's own checks, as one-line errors
  # Context parallelism splits the sequence into 2 chunks per device in the load-balanced order,
  # into 1 in the contiguous order a sliding window or Ulysses runs with.
  context, tensor = layout.context, layout.tensor
  impl = compute.context_impl
  balanced = load_balanced(getattr(model, "sliding_window", 0), impl)
  _check_fp8_groups(layout, compute.fp8, balanced)
  if compute.collective_matmul and layout.tensor > 1 and not layout.sequence_parallel:
    raise LayoutError("compute.collective_matmul decomposes sequence parallelism's all-gather and"
                      " reduce-scatter: set mesh.sequence_parallel=true (or tensor=1)")
  if context > 1:
    _check_ulysses(impl, compute.ulysses_degree, context, model.num_heads // tensor)
  chunks = context * (2 if balanced and context > 1 else 1)
  seq_split = math.lcm(chunks, context * (tensor if layout.sequence_parallel else 1))
  if seq_len % seq_split:
    needs = ([f"2 x context = {chunks}" if balanced else f"context = {chunks}"]
             if context > 1 else []) + (
        [f"context x tensor = {context * tensor} (sequence parallelism)"]
        if layout.sequence_parallel else [])
    raise LayoutError(f"seq_len={seq_len} is not divisible by {' and by '.join(needs)}")


def _check_fp8_groups(layout: Layout, fp8, balanced: bool) -> None:
  """compute.fp8.sequences_per_scale groups sequences of one device (models/layers.py)."""
  group = fp8.sequences_per_scale if fp8 is not None and fp8.enabled else 1
  if group > 1 and layout.context > 1 and balanced:
    # Measured, not traced: the tiny Llama on data=2 x context=2 x fsdp=2 in this order (ring or
    # all-gather attention) took its first loss 3.5e-5 off one device's with groups of 4 (1e-5
    # is the layouts' bound; per-sequence scales 5.5e-7), and within it in the contiguous order.
    raise LayoutError(f"compute.fp8.sequences_per_scale={group} is not proven under context"
                      " parallelism in the load-balanced order (context_impl ring or allgather):"
                      " set it to 1, or use context_impl=ulysses")
  if layout.micro_batch % group:
    raise LayoutError(f"compute.fp8.sequences_per_scale={group} does not divide the"
                      f" {layout.micro_batch} sequences each device takes per microbatch: set it"
                      " to a divisor of batch_size / (microbatches x data-parallel size)")


_PIPELINE_RING = ("context_impl={impl} sends its ring's blocks by collective-permutes, which cannot"
                  " run inside a pipeline stage; with pipeline > 1 set"
                  " compute.context_impl=allgather or ulysses")


def _check_ulysses(impl: str, degree: int, context: int, local_heads: int) -> None:
  """Ulysses' all-to-all splits each tensor shard's query heads over its degree: the degree must
  divide them (kv heads fewer than the degree are replicated, kernels/ulysses.py), and the
  hybrid's degree must divide `context` (the ring takes the rest)."""
  if impl == "ulysses" and degree not in (0, context):
    raise LayoutError(f"compute.ulysses_degree={degree} with context_impl=ulysses must be 0 or"
                      f" context={context} (for a part of it, use context_impl=ulysses_ring)")
  if impl == "ulysses_ring" and context % degree:
    raise LayoutError(f"compute.ulysses_degree={degree} does not divide context={context}"
                      " (ulysses_ring: Ulysses over that inner factor, the ring over the rest)")
  degree = ulysses_degree(impl, degree, context)
  if local_heads % degree:
    raise LayoutError(f"Ulysses degree {degree} must divide the query heads per tensor shard"
                      f" (num_heads / tensor = {local_heads}); kv heads fewer than the degree"
                      " are replicated, query heads cannot be: lower the degree or tensor")


def resolve(mesh: MeshConfig, devices, model, compute=None, *, batch_size: int, seq_len: int,
            microbatches: int = 1, rule_overrides: str = "") -> Layout:
  """The whole layout of a run on `devices`: validated (`layout_of`), the six-axis mesh, the rules
  with the layout's decisions applied, and every kernel choice for the devices' platform."""
  devices = list(devices)
  layout = layout_of(mesh, len(devices), model, compute, batch_size=batch_size,
                     seq_len=seq_len, microbatches=microbatches)
  split = layout.stage_split(model.num_layers)
  if layout.pipeline > 1 and devices[0].platform == "cpu" and \
      _settings(compute).attention_impl == "pallas_flash":
    raise LayoutError("compute.attention_impl=pallas_flash runs inside a pipeline stage only"
                      " where it compiles (GPUs), not in the CPU interpreter; use"
                      " attention_impl=auto (the reference on CPU) or pipeline=1")
  return _kernels(dataclasses.replace(
      layout, mesh=make_mesh(mesh, devices),
      rules=layout.rules_for(model.vocab_size, seq_len, rule_overrides),
      stacks=stage_split.stack_split(split, model.dense_layers()) if split else ()),
      devices[0].platform, model, compute)


def local_layout(model, compute=None, platform: str | None = None) -> Layout:
  """One device's layout (no mesh) with the kernels `compute` asks for resolved for `platform`
  (default: JAX's default backend, read here, when the model is built): what a model built
  outside a run (tests, conversions) runs with."""
  platform = jax.default_backend() if platform is None else platform
  return _kernels(Layout(remat=_settings(compute).remat), platform, model, compute)


def _kernels(layout: Layout, platform: str, model, compute) -> Layout:
  """`layout` with the platform's kernel choices: "auto" attention, MoE grouped matmul and token
  exchange resolved, and the context-parallel settings recorded."""
  settings = _settings(compute)
  moe = getattr(model, "moe", None)
  grouped = getattr(moe, "grouped_matmul", "auto")
  exchange = getattr(moe, "exchange", "auto")
  dtype = getattr(model, "dtype", "bfloat16")  # the compute dtype: cuDNN attends in 16 bits
  check_attention(settings.attention_impl, platform)
  return dataclasses.replace(
      layout, platform=platform,
      attention=resolve_attention(settings.attention_impl, platform, dtype),
      # The same inside a pipeline stage: the flash kernel's shard_map nests in the stage's
      # (sharding/shard_map.py stage_shard_map).
      stage_attention=resolve_attention(settings.attention_impl, platform, dtype),
      context_impl=settings.context_impl, ulysses_degree=settings.ulysses_degree,
      load_balanced=load_balanced(getattr(model, "sliding_window", 0), settings.context_impl),
      sequence_parts_apart=getattr(moe, "dispatch", "dropless") != "dropping",
      grouped_matmul=(grouped if grouped != "auto" else
                      "pallas" if platform in GPU_PLATFORMS else "ragged_dot"),
      exchange=exchange if exchange != "auto" else "padded" if platform == "cpu" else "ragged",
      exchange_capacity=getattr(moe, "exchange_capacity", 0.0),
      keep_first_round=getattr(moe, "keep_first_round", False),
      exchange_chunks=getattr(moe, "exchange_chunks", 1))
