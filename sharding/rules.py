"""THE table from logical dim names to mesh axes, and the only producer of PartitionSpecs."""

from collections.abc import Mapping, Sequence

from jax.sharding import PartitionSpec

from sharding.mesh import AXES, LayoutError

Rules = tuple[tuple[str, tuple[str, ...]], ...]

# Ordered by priority: when two dims of one array want the same mesh axis, the name listed first
# gets it (e.g. attention heads take `tensor` before `seq` does under sequence parallelism).
# Names absent from the table are replicated.
DEFAULT_RULES: Rules = (
    # activations
    # MoE tokens dispatched to experts [E, groups, capacity, D]: the experts dim takes `expert`
    # before the batch (groups) dim can, so moving tokens to their experts is an all-to-all.
    ("act_experts", ("expert",)),
    # Before `batch`: when the vocab is split over fsdp too (layout_rules), the logits keep their
    # vocab dim split and the group's tokens whole.
    ("act_vocab", ("tensor",)),
    ("batch", ("data", "fsdp", "expert")),
    ("act_heads", ("tensor",)),
    ("act_kv_heads", ("tensor",)),
    ("act_mlp", ("tensor",)),
    ("seq", ("context",)),
    # The sequence dim of the residual stream (embeddings, norms, residual adds): the only one
    # that sequence parallelism also splits over `tensor`.
    ("res_seq", ("context",)),
    ("act_embed", ()),
    # weights
    ("layers", ("pipeline",)),
    # The multi-token prediction modules' stacked dim (models/mtp.py): whole on every stage, as
    # the last pipeline stage runs all of them after the model's last layer.
    ("mtp_layers", ()),
    ("experts", ("expert",)),
    ("expert_bias", ()),  # MoE routing bias [E]: tiny, replicated (set by the train step)
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("mlp", ("tensor",)),
    ("vocab", ("tensor",)),
    ("embed", ("fsdp",)),
    # MLA's up-projections [R, H, d] (q and kv latents to heads; DeepSeek-V3: 1536 and 512 rows)
    # have no `embed` dim: FSDP splits their latent rank, or every device held them whole (3.2B
    # parameters of DeepSeek-V3's 58 MLA layers under fsdp=16 x expert=64).
    ("latent_rank", ("fsdp",)),
    # Embedding lookups [B, L, D] (models/layers.py Embed): the table's columns and the rows'
    # `embed` dim are split over fsdp only when the lookup moves token rows (layout_rules);
    # the batch dim then takes only the batch axes `lookup_embed` does not.
    ("lookup_embed", ()),
    ("lookup_batch", ("data", "fsdp", "expert")),
    ("head_dim", ()),
    # MLA's latents (q and kv, [.., R]): small (DeepSeek-V3: 1536 and 512 + 64), replicated.
    ("latent", ()),
    ("norm", ()),
)


def parse_overrides(text: str) -> dict[str, tuple[str, ...]]:
  """Parses "embed=fsdp+data;mlp=tensor;norm=" into {name: axes}; the names must be the table's
  (a misspelt name would otherwise change nothing, silently)."""
  known = [name for name, _ in DEFAULT_RULES]
  overrides = {}
  for item in filter(None, (part.strip() for part in text.split(";"))):
    name, sep, axes = item.partition("=")
    if not sep:
      raise LayoutError(f"sharding rule {item!r} must look like name=axis+axis (or name= to"
                        " replicate)")
    axes = tuple(a for a in axes.strip().split("+") if a)
    unknown = [a for a in axes if a not in AXES]
    if unknown:
      raise LayoutError(f"sharding rule {item!r} names unknown mesh axes {unknown}; axes are"
                        f" {', '.join(AXES)}")
    if name.strip() not in known:
      raise LayoutError(f"sharding rule {item!r} names no logical dim; logical dims:"
                        f" {', '.join(known)}")
    overrides[name.strip()] = axes
  return overrides


def with_overrides(rules: Rules, overrides: Mapping[str, tuple[str, ...]]) -> Rules:
  """Replaces rows by name, keeping their priority; new names go last."""
  known = {name for name, _ in rules}
  replaced = tuple((name, tuple(overrides.get(name, axes))) for name, axes in rules)
  added = tuple((name, tuple(axes)) for name, axes in overrides.items() if name not in known)
  return replaced + added


# The ZeRO stage from which each role is also sharded over ZERO_AXES.
ZERO_STAGE_OF_ROLE = {"opt_state": 1, "grads": 2, "params": 3}
# The axes whose devices hold the same parameters, so ZeRO splits their state over them: the
# data-parallel replicas, context parallelism's devices (each holds a part of the same
# sequences) and expert parallelism's (each holds other tokens). Megatron's distributed
# optimizer shards over the same data x context group, expert ranks included for the weights
# they share. The experts' own weights take `expert` on their experts dim first (each mesh axis
# once per array), so their state is split over data x context only.
ZERO_AXES = ("data", "context", "expert")


def layout_rules(rules: Rules, *, sequence_parallel: bool = False,
                 vocab_over_fsdp: bool = False, lookup_rows: bool = False,
                 experts_over_tensor: bool = False) -> Rules:
  """The rules of a layout. Sequence parallelism adds `tensor` to `res_seq`: the residual stream
  is sequence-sharded between the tensor-parallel regions (attention, MLP, head), which keep the
  whole sequence and split heads / hidden / vocab instead. `vocab_over_fsdp` (see
  `split_vocab_over_fsdp`) adds `fsdp` to the vocab dims of the weights and the logits.
  `lookup_rows` (see `lookup_moves_rows`) adds it to `lookup_embed`. `experts_over_tensor`
  (sharding.layout.experts_over_tensor) adds `tensor` to the experts' dim."""
  experts = dict(rules).get("experts", ())
  added = {"res_seq": ("tensor",) if sequence_parallel else (),
           "experts": ("tensor",) if experts_over_tensor and "tensor" not in experts else (),
           "vocab": ("fsdp",) if vocab_over_fsdp else (),
           "act_vocab": ("fsdp",) if vocab_over_fsdp else (),
           "lookup_embed": ("fsdp",) if lookup_rows else ()}
  return tuple((name, axes + added.get(name, ())) for name, axes in rules)


VOCAB_OVER_FSDP = ("auto", "on", "off")
VOCAB_MARGIN = 4


def split_vocab_over_fsdp(setting: str, *, fsdp: int, tensor: int, vocab: int,
                          group_tokens: float) -> bool:
  """Whether FSDP splits the vocab dims (embedding table, head, logits) instead of the `embed` dim.

  FSDP gathers a weight over its `fsdp` group before using it. For the head [D, V] that moves
  D x V / tensor values per microbatch, and as many gradient values back. With the vocab dim
  split over `fsdp`, the group gathers its activations instead (group_tokens x D) and each device
  computes the logits of all the group's tokens for its vocab slice: Megatron's vocab-parallel
  head, over `fsdp`; its weight gradient needs no reduction. "auto" picks it when the head's
  vocab slice is at least VOCAB_MARGIN x the tokens of a microbatch of the group (the tokens
  split over fsdp), as in small-batch runs; large batches keep the weight gathers. The margin
  covers what the split adds per token besides its hidden state: the gradient of the hidden
  state, the loss statistics reduced over the vocab, and the embedding rows summed over the
  vocab slices. At 2x, the test model (D = 32) moved 4% more bytes with the split than without;
  at 16x (the benchmarks' tiny and 100M models, fsdp=8) it moved 51% and 21% fewer and ran
  14-16% faster.
  """
  if setting not in VOCAB_OVER_FSDP:
    raise LayoutError(f"mesh.vocab_over_fsdp={setting!r} is not a choice; set it to one of"
                      f" {', '.join(VOCAB_OVER_FSDP)}")
  if fsdp == 1 or setting == "off":
    return False
  return setting == "on" or (vocab % (fsdp * tensor) == 0
                             and VOCAB_MARGIN * group_tokens <= vocab / tensor)


def lookup_moves_rows(*, fsdp: int, tensor: int, pipeline: int, vocab: int,
                      group_tokens: float, context: int = 1) -> bool:
  """Whether an FSDP embedding lookup moves token rows instead of gathering the table.

  Gathering the table moves V / tensor rows to every device of the fsdp group (and reduces as
  many gradient rows). Moving token rows: each device looks up the group's tokens in its `embed`
  columns and an all-to-all returns its own tokens' full rows, group_tokens / fsdp rows a device
  each way. Chosen when the group has fewer tokens than the table has rows. Not under pipeline
  parallelism: there XLA's SPMD partitioner aborts on the lookup inside the pipeline's partly
  manual shard_map (CHECK in ExpandDeviceGroupsWithIota, jaxlib 0.10.2, fsdp x tensor). Not with
  the sequence split either: with data x fsdp x context (e.g. 2 x 2 x 2, 2 sequences a shard)
  the partitioned lookup returned wrong rows (loss off by 0.3%, jaxlib 0.10.2; the table-gather
  lookup is exact, tests/test_context_parallel.py)."""
  return fsdp > 1 and pipeline == 1 and context == 1 and group_tokens < vocab / tensor


# The weight dims ZeRO splits, as FSDP does: `embed`, and MLA's latent rank, which its
# up-projections have in its place (their state was whole on each of DeepSeek-V3's 64 `expert`
# ZeRO ranks).
ZERO_DIMS = ("embed", "latent_rank")


def role_rules(rules: Rules, role: str, zero_stage: int) -> Rules:
  """The rules for one part of the train state: from its ZeRO stage on, a role's ZERO_DIMS are
  sharded over ZERO_AXES (`data`, `context`, `expert`) too (stage 1: optimizer state, 2: + gradients,
  3: + parameters)."""
  if role not in ZERO_STAGE_OF_ROLE or zero_stage < ZERO_STAGE_OF_ROLE[role]:
    return rules
  return tuple((name, ZERO_AXES + axes if name in ZERO_DIMS else axes) for name, axes in rules)


def entry_axes(entry) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry (None, an axis, or a tuple of them)."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def spec_entry(axes: Sequence[str]):
  """The PartitionSpec entry of a dim split over `axes` (entry_axes' inverse)."""
  return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def logical_to_spec(names: Sequence[str | None], shape: Sequence[int], mesh_sizes: Mapping[str, int],
                    rules: Rules, what: str = "array") -> PartitionSpec:
  """Resolves logical dim names to a PartitionSpec for one array.

  Rules are applied in table order; each mesh axis is used at most once per array; axes of size
  1 are dropped. A dim whose size does not divide the product of its axes raises LayoutError
  naming `what`, its shape, the logical names and the axes, before anything is compiled.
  """
  if len(names) != len(shape):
    raise LayoutError(f"{what}: {len(names)} logical names {tuple(names)} for shape {tuple(shape)}")
  priority = {name: i for i, (name, _) in enumerate(rules)}
  table = dict(rules)
  order = sorted((i for i, n in enumerate(names) if n in table), key=lambda i: priority[names[i]])
  used: set[str] = set()
  per_dim: list[tuple[str, ...]] = [()] * len(names)
  for i in order:
    axes = tuple(a for a in table[names[i]] if a not in used and mesh_sizes.get(a, 1) > 1)
    split = 1
    for axis in axes:
      split *= mesh_sizes[axis]
    if shape[i] % split:
      over = " x ".join(f"{a}={mesh_sizes[a]}" for a in axes)
      raise LayoutError(
          f"{what} {tuple(shape)} {tuple(names)}: {names[i]}={shape[i]} cannot be split over"
          f" {over}; choose mesh sizes that divide it or override the rule for {names[i]!r}")
    used.update(axes)
    per_dim[i] = axes
  return PartitionSpec(*map(spec_entry, per_dim))
