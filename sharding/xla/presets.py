"""Named, versioned XLA option presets for compute/communication overlap, checked against XLA."""

import dataclasses
import functools

# A preset never changes once released: new option sets get a new version (overlap_v2), so a
# recorded run names exactly the options it compiled with. An option an XLA release removes
# makes a preset named explicitly fail at start-up (check_options); `auto`, the default, leaves
# it out (removed_options): a run on a newer jax still starts.


@dataclasses.dataclass(frozen=True)
class Option:
  """One XLA option of a preset: what it does, and what it measurably did to the compiled program
  (deviceless 8xH100 compile, jax/jaxlib 0.10.2; benchmarks/overlap.py)."""

  name: str
  value: bool | int | str
  effect: str


@dataclasses.dataclass(frozen=True)
class Preset:
  """A named set of XLA options."""

  name: str
  summary: str
  options: tuple[Option, ...] = ()

  def as_dict(self) -> dict:
    return {o.name: o.value for o in self.options}


_MIB = 2 ** 20
# Numbers: the 8.86B playbook model (bf16 compute, remat=full, 8 x 4096 tokens) unless stated;
# "behind a matmul" = collective bytes with a matrix kernel scheduled between start and done.
_SCHEDULER = Option(
    "xla_gpu_enable_latency_hiding_scheduler", True,
    "Schedules each async collective's start as early and its done as late as data and memory"
    " allow, so kernels run in between. Already on in jaxlib 0.10.2's GPU pipeline (the tiny"
    " model's fsdp=8 program is identical with and without it); set so a default change cannot"
    " drop it. It stops overlapping a program that does not fit: fsdp=8 without remat, when"
    " autodiff kept every intermediate (211 GiB peak), left 94% of its collective bytes"
    " exposed, presets or not; at 32.7 GiB (remat=none keeping matmul and kernel outputs) it"
    " hides them all.")
_PIPELINED = (
    Option("xla_gpu_enable_pipelined_all_gather", True,
           "FSDP prefetch: XLA's collective pipeliner moves the all-gathers of layer i+1's"
           " weights into iteration i of the layer scan (one iteration peeled), behind layer i's"
           " matmuls. fsdp=8: loop all-gathers issued a layer ahead 0/14 -> 14/14, bytes behind"
           " a matmul 74% -> 95%, peak 27.1 -> 26.6 GiB. Cost with sequence parallelism: one more"
           " reduce-scatter per layer (6, not 5: seemingly the recomputed forward's last one,"
           " otherwise removed as dead); tensor=8 SP: +7% collective bytes, +3.6 GiB peak."),
    Option("xla_gpu_enable_pipelined_reduce_scatter", True,
           "The same for reduce-scatters in loops. XLA's default in 0.10.2 (the programs with"
           " and without the preset reduce-scatter gradients the same way); set so it stays."),
    Option("xla_gpu_enable_pipelined_all_reduce", True,
           "The same for all-reduces in loops (tensor-parallel partial sums, data-parallel"
           " gradients per layer). tensor=8 SP with only this option: exposed bytes 14.2 ->"
           " 6.8 GiB, peak 24.4 -> 23.9 GiB."),
)


def _combine(threshold: int, why: str) -> tuple[Option, ...]:
  return tuple(Option(f"xla_gpu_{kind}_combine_threshold_bytes", threshold, why)
               for kind in ("all_gather", "reduce_scatter", "all_reduce"))


PRESETS = {p.name: p for p in (
    Preset("none", "XLA's own defaults: no options set (the 'before' of every measurement)."),
    Preset("scheduler_v1",
           "The latency-hiding scheduler without loop pipelining: XLA 0.10.2's own behaviour,"
           " pinned (the tiny model's fsdp=4 x tensor=2 SP program is identical to `none`'s)."
           " What `auto` picks for tensor, context, expert or pipeline parallelism,"
           " where pipelining adds collectives (see overlap_v1) and the remaining exposure is"
           " the tensor-parallel activations' (collective matmul's job).",
           (_SCHEDULER, _PIPELINED[1])),
    Preset("overlap_v1",
           "The latency-hiding scheduler plus pipelined collectives in the layer scans (FSDP"
           " prefetch, per-layer reductions behind the next layer) with XLA's 30 MiB buckets."
           " Exposed collective bytes: tensor=8 SP 14.2 -> 0 GiB, data=2 x fsdp=4 2.5 -> 0.24,"
           " 64 GPUs fsdp=8 x tensor=8 SP 6.2 -> 2.0, data=8 x fsdp=8 1.1 -> 0.5.",
           (_SCHEDULER,) + _PIPELINED),
    Preset("overlap_unbucketed_v1",
           "overlap_v1 with combining off: one collective per array (the finest overlap, the"
           " most launches).",
           (_SCHEDULER,) + _PIPELINED + _combine(
               0, "0 = never combine (no gradient buckets). Tiny model fsdp=8: 7 all-gathers"
               " per layer pass instead of 1. fsdp=8: reduce-scatters 67 -> 226, all-reduces"
               " 34 -> 95, all-gathers stay 450 (each weight is over the 30 MiB default"
               " already); behind a matmul 95% -> 86%.")),
    Preset("overlap_bucketed_v1",
           "overlap_v1 with 1 GiB buckets: a layer's weights gathered, and its gradients"
           " reduced, as one collective each (fewest launches, coarsest overlap).",
           (_SCHEDULER,) + _PIPELINED + _combine(
               1024 * _MIB, "Combine a step's collectives into buckets of up to 1 GiB."
               " fsdp=8: all-gathers 450 -> 65 (one per layer pass, plus embedding and head),"
               " reduce-scatters 67 -> 32; behind a matmul 95% -> 92%, peak +0.3 GiB.")),
)}
AUTO = "auto"
DEFAULT_PRESET = AUTO
# `auto` pipelines loops only where that was measured to add no collectives: meshes of only
# data and fsdp (FSDP prefetch, per-layer gradient reduction). With tensor parallelism the
# pipeliner keeps collectives XLA otherwise removes (tiny fsdp=4 x tensor=2: one more b.s.h
# all-reduce per step; 8.86B tensor=8 SP: +7% bytes); other axes were not measured.
_PIPELINE_SAFE_AXES = ("data", "fsdp")
# Nor with gradient accumulation: the microbatch loop gathers the embedding and head tables, so
# the pipeliner peels one microbatch out of it too, and XLA schedules that microbatch's zeroed
# residual stacks before the loop, where they sit beside the loop's own. NeMo's Llama-3.1-8B at
# fsdp=8, 2 x 8192 tokens a microbatch, 8 microbatches (h100x8, jaxlib 0.10.2): 119.6 GiB without
# XLA's rematerialization (71.8 GiB unpipelined); XLA recomputed 232 instructions to reach 88.1
# GiB, predicted 8,938 tokens/s/GPU against scheduler_v1's 10,247 at 71.8 GiB. Gathering the
# tables once before the loop stops the peel but peaks at 75.3 GiB, predicted 10,104. The
# Megatron-Bridge Llama-3-8B FP8 recipe (fsdp=8, 16 microbatches): 59.4 -> 55.1 GiB, predicted
# 12,248 -> 12,594 tokens/s/GPU.
_PIPELINE_SAFE_MICROBATCHES = 1


def resolve(name: str, mesh_sizes: dict[str, int] | None = None, microbatches: int = 1) -> str:
  """The preset `name` stands for on a mesh of these sizes with this many microbatches a step
  (only `auto` depends on them)."""
  if name != AUTO:
    return preset(name).name
  safe = mesh_sizes is not None and microbatches <= _PIPELINE_SAFE_MICROBATCHES and all(
      size == 1 for axis, size in mesh_sizes.items() if axis not in _PIPELINE_SAFE_AXES)
  return "overlap_v1" if safe else "scheduler_v1"


def preset(name: str) -> Preset:
  """The preset called `name` (`auto` is resolved by `resolve`); one-line ValueError listing
  the known ones."""
  if name not in PRESETS:
    raise ValueError(f"xla_preset {name!r} is not one of {', '.join((AUTO,) + tuple(PRESETS))}")
  return PRESETS[name]


def compiler_options(preset_name: str, overrides: dict | None = None,
                     mesh_sizes: dict[str, int] | None = None, microbatches: int = 1) -> dict:
  """The preset's options (`auto` resolved for the mesh sizes and microbatches) with
  `overrides` (explicit xla_options) taking precedence."""
  options = preset(resolve(preset_name, mesh_sizes, microbatches)).as_dict()
  if preset_name == AUTO:  # `auto` is the best this XLA takes: a named preset fails instead
    options = {k: v for k, v in options.items() if k not in removed_options()}
  return {**options, **(overrides or {})}


@functools.lru_cache(maxsize=1)
def removed_options() -> frozenset:
  """The presets' options this XLA rejects (a later release removed them): jax 0.11.2 has no
  xla_gpu_enable_pipelined_all_gather (seen on the lent H200, 2026-11-26). Once per process:
  one trivial compile with every option, and one per option only when that fails."""
  every = {(o.name, o.value) for p in PRESETS.values() for o in p.options}
  if not _try(tuple(sorted(every))):
    return frozenset()
  return frozenset(name for name, value in every if _try(((name, value),)))


def _versions() -> str:
  import jax
  import jaxlib
  return f"jax {jax.__version__}, jaxlib {jaxlib.__version__}"


def _try(options: tuple) -> str:
  """'' if XLA accepts the options, else its error's first line."""
  import jax
  import jax.numpy as jnp
  lowered = jax.jit(lambda x: x + 1).lower(jax.ShapeDtypeStruct((), jnp.float32))
  try:
    lowered.compile(compiler_options=dict(options))
  except Exception as e:  # noqa: BLE001 - XLA raises JaxRuntimeError; report any failure
    return str(e).strip().splitlines()[0]
  return ""


@functools.lru_cache(maxsize=64)
def _check(options: tuple) -> None:
  if not options or not (error := _try(options)):
    return
  for item in options:  # name the culprit: XLA's message may not
    if item_error := _try((item,)):
      raise ValueError(f"XLA option {item[0]}={item[1]!r} is not accepted by this XLA"
                       f" ({_versions()}): {item_error}")
  raise ValueError(f"XLA options {dict(options)} are not accepted together ({_versions()}):"
                   f" {error}")


def check_options(options: dict) -> dict:
  """Compiles a trivial program with `options` on the default backend and returns them; an
  unknown, removed or mistyped option raises a one-line ValueError naming it and the jax/jaxlib
  versions. Every backend takes every XLA option (they share one DebugOptions table): XLA:CPU
  accepts the `xla_gpu_*` ones and ignores them, so presets pass through CPU runs unchanged
  (the CPU program is the same) and are checked there too."""
  _check(tuple(sorted(options.items())))
  return options


def describe(name: str) -> str:
  """A preset as text: its summary, then each option with its effect."""
  p = preset(resolve(name, {}))
  lines = [f"{p.name}: {p.summary}"]
  lines += [f"  {o.name}={o.value}: {o.effect}" for o in p.options]
  return "\n".join(lines)
