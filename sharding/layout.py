"""The layout of a run: one object, resolved once (sharding/resolution.py) and handed to whoever
needs a decision. Its first fields are the parallel layout the planner ranks and `parse` reads:
mesh sizes, ZeRO stage, sequence parallelism, the pipeline schedule, the batch split and remat.
The rest are a run's decisions on its devices: the mesh, the logical rules, the platform, the
attention and context kernels, the MoE kernels, the uneven pipeline split, and the region of the
train step a model built with it runs in. Their defaults are one device's, so `Layout()` is a
valid single-device layout; properties derive the rest (sequence axes, token split, gradient
replicas) from the rules and sizes. Nothing here reads an ambient scope.

Axis names are the mesh's (`data, pipeline, fsdp, expert, context, tensor`); the playbook's
`dp=, tp=, pp=, cp=, ep=` are accepted as input aliases only.
"""

import contextlib
import dataclasses
import functools
import math

from jax.sharding import AxisType, Mesh

from sharding.mesh import AXES, BATCH_AXES, MeshConfig
from sharding.pipeline import stage_split
from sharding.rules import (DEFAULT_RULES, Rules, layout_rules, lookup_moves_rows,
                            parse_overrides, split_vocab_over_fsdp, with_overrides)
from sharding.scope import active, use_rules

REMATS = ("none", "selective", "full")
# The most layer groups a pipeline stage's chunk runs unrolled (models/transformer.py); interleaved
# and V schedules cut the stack into chunks of 1-4 layers.
UNROLLED_STAGE_GROUPS = 4
# Input aliases (the playbook's names and short switch names) -> Layout fields.
ALIASES = {"dp": "data", "pp": "pipeline", "ep": "expert", "cp": "context", "tp": "tensor",
           "zero": "zero_stage", "sp": "sequence_parallel", "schedule": "pipeline_schedule",
           "vpp": "virtual_stages", "mbs": "micro_batch", "ga": "microbatches",
           "cp_impl": "context_impl"}
# The switches a MeshConfig and a Layout share (besides the six sizes).
MESH_SWITCHES = ("zero_stage", "sequence_parallel", "pipeline_schedule", "virtual_stages",
                 "stage_layers", "pipeline_recompute", "vocab_over_fsdp")


@dataclasses.dataclass(frozen=True)
class Layout:
  """A parallel layout and, once resolved on devices, every decision a run traces with.

  `micro_batch` is the sequences each batch shard (data x fsdp x expert) takes per microbatch;
  `microbatches` the gradient-accumulation steps.
  """

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
  pipeline_recompute: bool = True  # False: stages keep their forward's residuals (MeshConfig)
  micro_batch: int = 1
  microbatches: int = 1
  remat: str = "none"
  vocab_over_fsdp: str = "auto"  # the setting; `splits_vocab` decides
  # ---- a run's decisions (sharding.resolve); the defaults are one device's ----
  mesh: Mesh | None = None  # None: no mesh, every function runs as on one device
  rules: Rules = DEFAULT_RULES
  platform: str = "cpu"  # of the mesh's devices ("gpu" for a deviceless GPU target too)
  attention: str = "xla"  # the attention kernel (kernels.attention.IMPLS, never "auto")
  stage_attention: str = "xla"  # the kernel inside a pipeline stage
  context_impl: str = "ring"  # context-parallel attention (sharding/context_parallel.py)
  ulysses_degree: int = 0  # compute.ulysses_degree as configured (ulysses_ring's inner factor)
  load_balanced: bool = True  # a split sequence in the zigzag order (else contiguous)
  grouped_matmul: str = "ragged_dot"  # the dropless MoE's grouped matmul ("pallas" on GPUs)
  exchange: str = "padded"  # the dropless MoE's token exchange ("ragged" on GPUs)
  exchange_capacity: float = 0.0  # its rows per device pair and round (model.moe's; 0: worst)
  keep_first_round: bool = False  # its first round's residuals kept (model.moe's)
  exchange_chunks: int = 1  # the tokens exchanged in that many chunks apart (model.moe's)
  # Whether the model's loss is a sum over parts of a sequence, so each device can differentiate
  # its part apart (`gradient_sequence_axes`); not for the dropping MoE, whose capacity slots
  # are handed out along each whole sequence.
  sequence_parts_apart: bool = True
  moe_dispatch: str = "dropless"  # model.moe's ("dropping": XLA partitions its einsums)
  num_experts: int = 0  # model.moe's routed experts (0: a dense model)
  # Uneven pipeline stages: ((stack, its layers per position), ...) (stage_split.StackSplit),
  # each stack stored padded to its largest position; () when every stack divides evenly.
  stacks: tuple = ()
  # The regions of the train step a model built with this layout runs in (`in_train_step`):
  # a pipeline stage's shard_map, manual over `pipeline` (and the replicas' axes), and the
  # data-parallel replicas' vmap of gradient accumulation (trainer/step.py).
  in_pipeline_stage: bool = False
  in_replica_vmap: bool = False
  in_expert_loop: bool = False  # the microbatch loop's shard_map over `loop_expert_axes`

  def sizes(self) -> dict[str, int]:
    return {axis: getattr(self, axis) for axis in AXES}

  def stage_split(self, num_layers: int) -> tuple[int, ...]:
    """Layers per pipeline position (sharding/pipeline/stage_split.py); () without pipeline
    stages."""
    if self.pipeline == 1:
      return ()
    return stage_split.split(num_layers, self.pipeline * self.virtual_stages, self.stage_layers)

  def layers_per_device(self, num_layers: int) -> int:
    """Layer slots one pipeline stage holds and runs at most: L / pipeline when even, the padded
    stack's share (virtual stages x the largest position) when not."""
    return stage_split.slots_per_device(num_layers, self.pipeline, self.virtual_stages,
                                        self.stage_layers)

  def stage_remat(self, num_layers: int, stages_recompute: bool = True) -> str:
    """The recomputation a layer runs: `remat`, but none in a pipeline stage's unrolled chunk.
    meshtron's executor (`stages_recompute`; False for trainers whose stages store activations)
    recomputes a chunk's forward in its backward tick and takes its pullback at once; a layer
    checkpoint there would run each forward a third time (models/transformer.py)."""
    chunk = self.layers_per_device(num_layers) / self.virtual_stages
    unrolled = self.stages_recompute(stages_recompute) and chunk <= UNROLLED_STAGE_GROUPS
    return "none" if unrolled else self.remat

  def stages_recompute(self, executor: bool = True) -> bool:
    """Whether a backward tick runs its chunk's forward again: meshtron's executor (`executor`;
    False for trainers whose stages store activations), unless pipeline_recompute is off."""
    return executor and self.pipeline > 1 and self.pipeline_recompute

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

  def rules_for(self, vocab: int, seq_len: int, overrides: str = "") -> Rules:
    """The logical -> mesh rules of this layout: the default table with `overrides` (rows like
    "embed=fsdp+data"), then the layout's additions (sequence parallelism, vocab split, lookup,
    experts over tensor unless `overrides` sets the experts' row: experts=expert splits each
    expert's hidden dim over tensor instead)."""
    chosen = parse_overrides(overrides)
    table = with_overrides(DEFAULT_RULES, chosen)
    return layout_rules(table, sequence_parallel=self.sequence_parallel,
                        vocab_over_fsdp=self.splits_vocab(vocab, seq_len),
                        lookup_rows=self.moves_lookup_rows(vocab, seq_len),
                        experts_over_tensor="experts" not in chosen and experts_over_tensor(
                            self, self.num_experts, self.moe_dispatch))

  # ---- decisions derived from the rules and sizes ----

  def axes(self, name: str) -> tuple[str, ...]:
    """The mesh axes (size > 1) that split logical dim `name` under this layout's rules."""
    sizes = self.sizes()
    return tuple(a for a in dict(self.rules).get(name, ()) if sizes[a] > 1)

  @property
  def sequence_axes(self) -> tuple[str, ...]:
    """The mesh axes splitting the `seq` dim: context parallelism; () without it."""
    return self.axes("seq")

  @property
  def sequence_parts(self) -> int:
    """Devices one sequence is split over."""
    return math.prod(self.sizes()[a] for a in self.sequence_axes)

  @property
  def tokens_split(self) -> bool:
    """Whether a mesh axis splits the sequence of any activation: `seq` under context
    parallelism, `res_seq` also under sequence parallelism. When none does, each device holds
    whole sequences, so [B, L, ...] activations are [B·L, ...] token rows without moving data
    (models/layers.Einsum uses that)."""
    return bool(self.axes("seq") or self.axes("res_seq"))

  @property
  def pipeline_axis(self) -> str | None:
    """The mesh axis splitting the `layers` dim into pipeline stages; None without stages."""
    axes = self.axes("layers")
    return axes[0] if axes else None

  @property
  def gradient_replica_axes(self) -> tuple[tuple[str, ...], int]:
    """(axes, size) over which gradients are plain replicas: `data` unless ZeRO >= 2 shards the
    gradients over it. Accumulating per-replica partial sums over microbatches and reducing them
    once saves the per-microbatch gradient reductions that SPMD would otherwise emit."""
    if self.data == 1 or self.zero_stage >= 2:
      return (), 1
    return ("data",), self.data

  @property
  def keeps_whole_gradient_sums(self) -> bool:
    """Whether each device keeps its weights' gradient sums whole over the microbatches and
    reduces them once a step: replicas over `data` below ZeRO-2 and over `context` where the
    sequence parts are differentiated apart, no `fsdp`, no pipeline stages. A weight gradient
    can then be added into its float32 sum by its GEMM (models/layers.summed_einsum); where the
    sums are split, each microbatch's gradient is reduced first, better in bf16."""
    return (self.microbatches > 1 and self.pipeline == 1 and self.fsdp == 1
            and (self.data == 1 or bool(self.gradient_replica_axes[0]))
            and (self.context == 1 or bool(self.gradient_sequence_axes)))

  @property
  def gradient_sequence_axes(self) -> tuple[str, ...]:
    """The sequence axes over which accumulated gradients stay per-device partial sums: under
    context parallelism with microbatches, each device differentiates its own part of the
    sequence inside the replicas' vmap (trainer/step.py), so the reduction over `context` runs
    once per step with the replicas', not for every microbatch. () without microbatches, inside
    pipeline stages, and for ulysses_ring, whose shard_map runs on a mesh view that has no
    `context` axis for the vmap to split over (sharding.context_parallel.factored), and for
    a model whose loss does not add up over parts of a sequence (`sequence_parts_apart`).
    Sequence-wise sums inside (the MoE balance loss) add the parts up by
    sharding.context_parallel.whole_sequence_sum."""
    if (self.microbatches == 1 or self.pipeline > 1 or self.context_impl == "ulysses_ring"
        or not self.sequence_parts_apart):
      return ()
    return self.sequence_axes

  @property
  def stage_sequence_axes(self) -> tuple[str, ...]:
    """The sequence axes a pipeline stage's shard_map is manual over too: each device runs its
    part of every sequence through the stages and keeps its gradient sums, reduced once after
    the schedule with the replicas' (else XLA all-reduces each weight's gradient over them at
    every tick). () without stages, and where the loss does not add up over parts of a
    sequence (`sequence_parts_apart`)."""
    if self.pipeline == 1 or not self.sequence_parts_apart:
      return ()
    return self.sequence_axes

  @property
  def stage_expert_axes(self) -> tuple[str, ...]:
    """The expert axes a pipeline stage's shard_map is manual over too: each expert device runs
    its own rows through the stages and keeps whole float32 sums of the gradients of the weights
    the devices share (all but the experts'), reduced once after the schedule, as ZeRO-1 and
    Megatron's distributed optimizer keep them. Automatic, XLA split those sums over `expert`
    and reduce-scattered each tick's gradients into them (DeepSeek-V3's recipe: 3.5 TB a step);
    ZeRO-2, which splits the gradients, keeps that program. The dropless MoE exchanges the
    tokens over these axes inside (sharding/expert.py). () without stages, for the dropping MoE
    (XLA partitions its einsums over `expert`) and under ZeRO >= 2."""
    if self.pipeline == 1 or self.zero_stage >= 2 or self.moe_dispatch == "dropping":
      return ()
    return tuple(a for a in self.axes("experts") if a in self.axes("batch"))

  @property
  def stage_replica_axes(self) -> tuple[str, ...]:
    """The axes besides the pipeline's that a stage's shard_map is manual over: the gradient
    replicas', the experts' and the sequence's (each device's own rows and parts of them)."""
    return (*self.gradient_replica_axes[0], *self.stage_expert_axes, *self.stage_sequence_axes)

  @property
  def loop_expert_axes(self) -> tuple[str, ...]:
    """The same for the step without stages: its microbatch loop runs under a shard_map manual
    over them and the gradient replicas' axes (`loop_axes`, sharding/expert_loop.py), each
    device keeping whole sums of the shared weights' gradients, reduced once a step. Automatic,
    XLA reduce-scattered every microbatch's gradients into ZeRO-1's parts (Qwen3-30B-A3B EP16:
    174 GiB a step). Only where no other axis splits (fsdp, tensor, context): each device then
    runs the model on its own values as one device does, the experts' exchange excepted. ()
    for one microbatch, a dense model, and where `stage_expert_axes` would be."""
    if self.pipeline > 1 or self.microbatches == 1 or not self.num_experts or \
        self.zero_stage >= 2 or self.moe_dispatch == "dropping" or \
        self.fsdp * self.tensor * self.context > 1:
      return ()
    return tuple(a for a in self.axes("experts") if a in self.axes("batch"))

  @property
  def loop_axes(self) -> tuple[str, ...]:
    """The axes the expert loop's shard_map is manual over: the replicas' and the experts'."""
    expert = self.loop_expert_axes
    return (*self.gradient_replica_axes[0], *expert) if expert else ()

  @property
  def vmapped_replicas(self) -> tuple[tuple[str, ...], int]:
    """The gradient replicas the step's vmap splits the rows over: `gradient_replica_axes`,
    but one inside the expert loop, whose region takes those axes."""
    return ((), 1) if self.loop_expert_axes else self.gradient_replica_axes

  @property
  def region_expert_axes(self) -> tuple[str, ...]:
    """The expert axes the model's region is manual over (`in_train_step`); () outside one."""
    return (self.stage_expert_axes if self.in_pipeline_stage else
            self.loop_expert_axes if self.in_expert_loop else ())

  def stage_mesh(self):
    """The abstract mesh inside a pipeline stage's shard_map (manual over the pipeline axis, the
    gradient replicas' axes, the stage's expert and sequence axes, sharding/pipeline/
    executor.py): what a shard_map nested in a stage must name."""
    manual = (self.pipeline_axis, *self.gradient_replica_axes[0], *self.stage_expert_axes,
              *self.stage_sequence_axes)
    return self.mesh.abstract_mesh.update_axis_types({a: AxisType.Manual for a in manual})

  # ---- views ----

  def in_train_step(self) -> "Layout":
    """This layout as the train step's model sees it: inside a pipeline stage when there are
    stages, inside the replicas' vmap when it accumulates gradients over replicas."""
    stages = self.pipeline > 1
    return dataclasses.replace(
        self, in_pipeline_stage=stages, attention=self.stage_attention if stages else
        self.attention, in_replica_vmap=(not stages and self.microbatches > 1 and bool(
            self.vmapped_replicas[0] or self.gradient_sequence_axes)),
        in_expert_loop=bool(self.loop_expert_axes))

  def unsharded(self) -> "Layout":
    """One device's layout with this one's platform and kernels (sampling: the parameters are
    global arrays, jit places the rest)."""
    return Layout(remat=self.remat, platform=self.platform, attention=self.attention,
                  stage_attention=self.stage_attention, context_impl=self.context_impl,
                  ulysses_degree=self.ulysses_degree, grouped_matmul=self.grouped_matmul)

  def scope(self):
    """The sharding scope of this layout (sharding.use_rules): what constrain() resolves in;
    none without a mesh."""
    if self.mesh is None:
      return contextlib.nullcontext()
    return use_rules(self.mesh, self.rules, self.zero_stage)

  def bind(self, fn):
    """`fn` running inside this layout's scope: `jax.jit(layout.bind(step))` traces the step with
    its mesh and rules wherever it is called, outside any scope or inside another layout's.
    Inside its own scope (e.g. one recording constraints) it runs as it is."""
    @functools.wraps(fn)
    def bound(*args, **kwargs):
      ctx = active()
      if self.mesh is None or ctx is not None and (ctx.mesh, ctx.rules, ctx.zero_stage) == (
          self.mesh, self.rules, self.zero_stage):
        return fn(*args, **kwargs)
      with self.scope():
        return fn(*args, **kwargs)
    return bound

  @property
  def vocab_split(self) -> bool:
    """Whether the rules split the vocab dims over fsdp (`splits_vocab` decided it)."""
    return "fsdp" in dict(self.rules).get("vocab", ())

  @property
  def lookup_rows(self) -> bool:
    """Whether the embedding lookup moves token rows (`moves_lookup_rows` decided it)."""
    return "fsdp" in dict(self.rules).get("lookup_embed", ())

  def describe(self) -> str:
    mesh = dict(self.mesh.shape) if self.mesh is not None else "one device"
    return (f"mesh {mesh}, zero_stage {self.zero_stage}, sequence_parallel"
            f" {self.sequence_parallel}, vocab_over_fsdp {self.vocab_split}")

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
    if not self.pipeline_recompute:
      switches.append("pipeline_recompute=0")
    if self.context > 1 and self.context_impl != "ring":
      switches.append(f"cp_impl={self.context_impl}")
    return ",".join(axes + switches)

  def mesh_config(self) -> MeshConfig:
    """The trainer's mesh config of this layout."""
    return MeshConfig(**self.sizes(), **{k: getattr(self, k) for k in MESH_SWITCHES})


def experts_over_tensor(layout: Layout, num_experts: int, dispatch: str) -> bool:
  """Whether a dropless MoE's experts are split over `tensor` as well as `expert`, each device
  routing its own part of the sequence: under sequence parallelism (which splits the sequence
  over `tensor`) with an exchange over `expert` to join, when the experts divide. Megatron's
  expert tensor parallelism of 1: against splitting each expert's hidden dim over `tensor`, a
  device sends 1/tensor of the tokens it did (both devices of a tensor pair sent the pair's
  gathered tokens) and the sequence is not gathered and scattered around the experts
  (sharding/expert.py). Without `expert` it would add an exchange of k copies of each token
  where gathering and scattering the sequence moves one."""
  return (dispatch == "dropless" and layout.tensor > 1 and layout.expert > 1
          and layout.sequence_parallel and num_experts > 0
          and num_experts % (layout.expert * layout.tensor) == 0)
