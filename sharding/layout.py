"""The parallel layout of a run, resolved once: mesh sizes, ZeRO stage, sequence parallelism, the
pipeline schedule, the batch split, the decisions that follow from them (vocabulary split,
embedding-lookup mode) and every validation error. The trainer (`resolve`), `meshtron
memory/plan` and the analytic model (`layout_of`, `parse`, `Layout`) all ask here.

Axis names are the mesh's (`data, pipeline, fsdp, expert, context, tensor`); the playbook's
`dp=, tp=, pp=, cp=, ep=` are accepted as input aliases only.
"""

import dataclasses
import functools
import math

from jax.sharding import Mesh

from sharding.pipeline import schedules, stage_split
from sharding.scope import active, use_rules
from sharding.context_parallel import load_balanced, ulysses_degree
from sharding.mesh import AXES, BATCH_AXES, LayoutError, MeshConfig, make_mesh, resolve_sizes
from sharding.rules import (DEFAULT_RULES, Rules, layout_rules, lookup_moves_rows,
                            parse_overrides, split_vocab_over_fsdp, with_overrides)

REMATS = ("none", "selective", "full")
# Input aliases (the playbook's names and short switch names) -> Layout fields.
ALIASES = {"dp": "data", "pp": "pipeline", "ep": "expert", "cp": "context", "tp": "tensor",
           "zero": "zero_stage", "sp": "sequence_parallel", "schedule": "pipeline_schedule",
           "vpp": "virtual_stages", "mbs": "micro_batch", "ga": "microbatches"}


@dataclasses.dataclass(frozen=True)
class Layout:
  """A parallel layout: one size per mesh axis, the switches that say how the axes are used, and
  the batch split. `micro_batch` is the sequences each batch shard (data x fsdp x expert) takes
  per microbatch; `microbatches` the gradient-accumulation steps."""

  data: int = 1
  pipeline: int = 1
  fsdp: int = 1
  expert: int = 1
  context: int = 1
  tensor: int = 1
  zero_stage: int = 0
  sequence_parallel: bool = False
  pipeline_schedule: str = "1f1b"
  virtual_stages: int = 1
  stage_layers: str = ""  # layers per pipeline position, "7+8+...+7"; "" = automatic
  micro_batch: int = 1
  microbatches: int = 1
  remat: str = "none"
  vocab_over_fsdp: str = "auto"  # the setting; `splits_vocab` decides

  def sizes(self) -> dict[str, int]:
    return {axis: getattr(self, axis) for axis in AXES}

  def stage_split(self, num_layers: int) -> tuple[int, ...]:
    """Layers per pipeline position (sharding/pipeline/stage_split.py); () without pipeline stages."""
    if self.pipeline == 1:
      return ()
    return stage_split.split(num_layers, self.pipeline * self.virtual_stages, self.stage_layers)

  def layers_per_device(self, num_layers: int) -> int:
    """Layer slots one pipeline stage holds and runs at most: L / pipeline when even, the padded
    stack's share (virtual stages x the largest position) when not."""
    counts = self.stage_split(num_layers)
    return max(counts) * self.virtual_stages if counts else num_layers

  @property
  def num_devices(self) -> int:
    return math.prod(self.sizes().values())

  @property
  def batch_shards(self) -> int:
    """Replicas the batch is split over: the mesh's batch axes."""
    return math.prod(getattr(self, axis) for axis in BATCH_AXES)

  @property
  def global_batch(self) -> int:
    """Sequences per optimizer step."""
    return self.micro_batch * self.microbatches * self.batch_shards

  def group_tokens(self, seq_len: int) -> float:
    """The tokens of one microbatch that an fsdp group shares (split over fsdp, whole over the
    group): what the vocabulary and lookup decisions compare with the vocab."""
    return self.micro_batch * self.fsdp * seq_len / self.context

  def splits_vocab(self, vocab: int, seq_len: int) -> bool:
    """Whether the vocab dims are split over fsdp (sharding.rules.split_vocab_over_fsdp)."""
    return split_vocab_over_fsdp(self.vocab_over_fsdp, fsdp=self.fsdp, tensor=self.tensor,
                                 vocab=vocab, group_tokens=self.group_tokens(seq_len))

  def moves_lookup_rows(self, vocab: int, seq_len: int) -> bool:
    """Whether the embedding lookup moves token rows (sharding.rules.lookup_moves_rows)."""
    return lookup_moves_rows(fsdp=self.fsdp, tensor=self.tensor, pipeline=self.pipeline,
                             vocab=vocab, group_tokens=self.group_tokens(seq_len),
                             context=self.context)

  def rules(self, vocab: int, seq_len: int, overrides: str = "") -> Rules:
    """The logical -> mesh rules of this layout: the default table with `overrides` (rows like
    "embed=fsdp+data"), then the layout's additions (sequence parallelism, vocab split, lookup)."""
    table = with_overrides(DEFAULT_RULES, parse_overrides(overrides))
    return layout_rules(table, sequence_parallel=self.sequence_parallel,
                        vocab_over_fsdp=self.splits_vocab(vocab, seq_len),
                        lookup_rows=self.moves_lookup_rows(vocab, seq_len))

  def string(self) -> str:
    """"data=4,tensor=8,zero=1,mbs=4,ga=16,remat=selective,sp=1,schedule=1f1b": the axes larger
    than 1 (data always), then the switches; `parse` reads it back."""
    axes = [f"{a}={s}" for a, s in self.sizes().items() if s > 1 or a == "data"]
    switches = [f"zero={self.zero_stage}", f"mbs={self.micro_batch}",
                f"ga={self.microbatches}", f"remat={self.remat}",
                f"sp={int(self.sequence_parallel)}", f"schedule={self.pipeline_schedule}"]
    if self.virtual_stages > 1:
      switches.append(f"vpp={self.virtual_stages}")
    if self.stage_layers:
      switches.append(f"stage_layers={self.stage_layers}")
    return ",".join(axes + switches)

  def mesh_config(self) -> MeshConfig:
    """The trainer's mesh config of this layout."""
    return MeshConfig(**self.sizes(), zero_stage=self.zero_stage,
                      sequence_parallel=self.sequence_parallel,
                      vocab_over_fsdp=self.vocab_over_fsdp,
                      pipeline_schedule=self.pipeline_schedule,
                      virtual_stages=self.virtual_stages, stage_layers=self.stage_layers)


_INTS = (*AXES, "zero_stage", "virtual_stages", "micro_batch", "microbatches")


def parse(text: str) -> Layout:
  """A Layout from "data=4,tensor=2,pipeline=2,zero=1,mbs=4,ga=16,remat=selective,sp=1,
  schedule=1f1b" (any subset, any order; mesh names or the aliases dp/tp/pp/cp/ep). One-line
  LayoutError for anything else."""
  values = {}
  for item in filter(None, (p.strip() for p in text.split(","))):
    key, sep, value = (part.strip() for part in item.partition("="))
    field = ALIASES.get(key, key)
    if not sep or not value:
      raise LayoutError(f"layout item {item!r} must look like key=value")
    if field in _INTS:
      if not value.isdigit() or (int(value) < 1 and field != "zero_stage"):
        raise LayoutError(f"layout {key}={value!r} must be a positive integer")
      values[field] = int(value)
    elif field == "sequence_parallel":
      if value.lower() not in ("0", "1", "true", "false"):
        raise LayoutError(f"layout {key}={value!r} must be 0 or 1")
      values[field] = value.lower() in ("1", "true")
    elif field == "stage_layers":
      stage_split.parse(value)
      values[field] = value
    elif field in ("remat", "pipeline_schedule", "vocab_over_fsdp"):
      allowed = {"remat": REMATS, "pipeline_schedule": schedules.SCHEDULES,
                 "vocab_over_fsdp": ("auto", "on", "off")}[field]
      if value not in allowed:
        raise LayoutError(f"layout {key}={value!r} is not one of {', '.join(allowed)}")
      values[field] = value
    else:
      raise LayoutError(f"unknown layout key {key!r}; keys: {', '.join(_INTS)}, remat,"
                        " sequence_parallel (sp), pipeline_schedule (schedule), vocab_over_fsdp,"
                        " stage_layers;"
                        f" aliases {', '.join(ALIASES)}")
  layout = Layout(**values)
  check_switches(layout)
  return layout


def check_switches(layout: Layout) -> None:
  """One-line LayoutError for switches that contradict each other or the sizes."""
  if layout.zero_stage not in (0, 1, 2, 3):
    raise LayoutError(f"zero stage {layout.zero_stage} must be 0, 1, 2 or 3")
  if layout.sequence_parallel and layout.tensor == 1:
    raise LayoutError("sequence parallelism needs tensor > 1 (it splits the sequence over"
                      " tensor): set tensor to more than 1 or turn sequence_parallel off")
  if layout.pipeline_schedule in schedules.V_SHAPED and layout.virtual_stages != 2:
    raise LayoutError(f"schedule {layout.pipeline_schedule} runs two chunks per stage (its V):"
                      " set virtual_stages=2 (vpp=2)")
  if layout.virtual_stages > 1 and layout.pipeline_schedule not in ("interleaved_1f1b",
                                                                    *schedules.V_SHAPED):
    raise LayoutError(f"virtual_stages={layout.virtual_stages} needs the interleaved_1f1b"
                      " pipeline schedule")


def layout_of(mesh: MeshConfig, num_devices: int, model, *, batch_size: int, seq_len: int,
              microbatches: int = 1) -> Layout:
  """The Layout of a mesh config on `num_devices` devices for `model` (a ModelConfig, read by
  field names) and the batch, after every check that needs no compile: one-line LayoutErrors."""
  sizes = resolve_sizes(mesh, num_devices)
  shards = math.prod(sizes[a] for a in BATCH_AXES)
  if batch_size % (shards * microbatches):
    axes = " x ".join(f"{a}={sizes[a]}" for a in BATCH_AXES if sizes[a] > 1) or "1"
    raise LayoutError(
        f"batch_size={batch_size} is not divisible by the data-parallel size {shards} ({axes})"
        f" x microbatches={microbatches}; each microbatch is split over the data-parallel"
        " devices")
  layout = Layout(**sizes, zero_stage=mesh.zero_stage,
                  sequence_parallel=mesh.sequence_parallel,
                  pipeline_schedule=mesh.pipeline_schedule, virtual_stages=mesh.virtual_stages,
                  stage_layers=mesh.stage_layers,
                  micro_batch=batch_size // (shards * microbatches), microbatches=microbatches,
                  remat=model.remat, vocab_over_fsdp=mesh.vocab_over_fsdp)
  _check_model_fits(layout, model, seq_len)
  layout.splits_vocab(model.vocab_size, seq_len)  # a bad vocab_over_fsdp setting is an error
  return layout


def _check_model_fits(layout: Layout, model, seq_len: int) -> None:
  stages = layout.pipeline
  if layout.stage_layers and stages == 1:
    raise LayoutError(f"stage_layers={layout.stage_layers} splits layers over pipeline stages,"
                      " but pipeline=1: set pipeline > 1 or stage_layers=''")
  if stages > 1:
    # A shard_map inside a pipeline stage must name the stage's abstract mesh, which the ring
    # attention and flash kernel wrappers do not yet do ("auto" attention runs the reference).
    if layout.context > 1:
      raise LayoutError("pipeline parallelism does not yet support context parallelism; use"
                        " context=1 or pipeline=1")
    if getattr(model, "attention_impl", "xla") == "pallas_flash":
      raise LayoutError("model.attention_impl=pallas_flash does not yet run inside a pipeline"
                        " stage; use attention_impl=auto (the reference there) or pipeline=1")
    layout.stage_split(model.num_layers)  # every position gets a layer; a given split adds up
    schedules.make(layout.pipeline_schedule, stages, layout.microbatches,
                   layout.virtual_stages)  # the schedule's own checks, as one-line errors
  if getattr(model, "collective_matmul", False) and layout.tensor > 1 \
      and not layout.sequence_parallel:
    raise LayoutError("model.collective_matmul decomposes sequence parallelism's all-gather and"
                      " reduce-scatter: set mesh.sequence_parallel=true (or tensor=1)")
  # Context parallelism splits the sequence into 2 chunks per device in the load-balanced order,
  # into 1 in the contiguous order a sliding window or Ulysses runs with.
  context, tensor = layout.context, layout.tensor
  impl = getattr(model, "context_impl", "ring")
  if context > 1:
    _check_ulysses(impl, getattr(model, "ulysses_degree", 0), context, model.num_heads // tensor)
  balanced = load_balanced(getattr(model, "sliding_window", 0), impl)
  chunks = context * (2 if balanced and context > 1 else 1)
  seq_split = math.lcm(chunks, context * (tensor if layout.sequence_parallel else 1))
  if seq_len % seq_split:
    needs = ([f"2 x context = {chunks}" if balanced else f"context = {chunks}"]
             if context > 1 else []) + (
        [f"context x tensor = {context * tensor} (sequence parallelism)"]
        if layout.sequence_parallel else [])
    raise LayoutError(f"seq_len={seq_len} is not divisible by {' and by '.join(needs)}")


def _check_ulysses(impl: str, degree: int, context: int, local_heads: int) -> None:
  """Ulysses' all-to-all splits each tensor shard's query heads over its degree: the degree must
  divide them (kv heads fewer than the degree are replicated, kernels/ulysses.py), and the
  hybrid's degree must divide `context` (the ring takes the rest)."""
  if impl == "ulysses" and degree not in (0, context):
    raise LayoutError(f"model.ulysses_degree={degree} with context_impl=ulysses must be 0 or"
                      f" context={context} (for a part of it, use context_impl=ulysses_ring)")
  if impl == "ulysses_ring" and context % degree:
    raise LayoutError(f"model.ulysses_degree={degree} does not divide context={context}"
                      " (ulysses_ring: Ulysses over that inner factor, the ring over the rest)")
  degree = ulysses_degree(impl, degree, context)
  if local_heads % degree:
    raise LayoutError(f"Ulysses degree {degree} must divide the query heads per tensor shard"
                      f" (num_heads / tensor = {local_heads}); kv heads fewer than the degree"
                      " are replicated, query heads cannot be: lower the degree or tensor")


@dataclasses.dataclass(frozen=True)
class RunLayout:
  """A Layout placed on devices: the mesh and the rules a train step runs with. `bind` ties a
  function to them, so it traces the same program wherever it is called."""

  layout: Layout
  mesh: Mesh
  rules: Rules
  vocab_split: bool
  lookup_rows: bool

  def scope(self):
    """The sharding scope of this layout (sharding.use_rules)."""
    return use_rules(self.mesh, self.rules, self.layout.zero_stage)

  def bind(self, fn):
    """`fn` running inside this layout's context: `jax.jit(run_layout.bind(step))` traces the
    step with its mesh and rules wherever it is called, outside any context or inside another
    layout's. Inside its own context (e.g. one recording constraints) it runs as it is."""
    @functools.wraps(fn)
    def bound(*args, **kwargs):
      ctx = active()
      if ctx is not None and (ctx.mesh, ctx.rules, ctx.zero_stage) == (
          self.mesh, self.rules, self.layout.zero_stage):
        return fn(*args, **kwargs)
      with self.scope():
        return fn(*args, **kwargs)
    return bound

  def describe(self) -> str:
    return (f"mesh {dict(self.mesh.shape)}, zero_stage {self.layout.zero_stage},"
            f" sequence_parallel {self.layout.sequence_parallel},"
            f" vocab_over_fsdp {self.vocab_split}")


def resolve(mesh: MeshConfig, devices, model, *, batch_size: int, seq_len: int,
            microbatches: int = 1, rule_overrides: str = "") -> RunLayout:
  """The whole layout of a run on `devices`: validated (`layout_of`), the six-axis mesh, and the
  rules with the layout's decisions applied."""
  devices = list(devices)
  layout = layout_of(mesh, len(devices), model, batch_size=batch_size, seq_len=seq_len,
                     microbatches=microbatches)
  return RunLayout(layout, make_mesh(mesh, devices),
                   layout.rules(model.vocab_size, seq_len, rule_overrides),
                   layout.splits_vocab(model.vocab_size, seq_len),
                   layout.moves_lookup_rows(model.vocab_size, seq_len))
