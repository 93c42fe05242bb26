"""`meshtron plan`'s search: every valid layout of a model on a cluster, the invalid ones with why,
the valid ones ranked by predicted throughput (the playbook's "finding the best configuration")."""

import dataclasses

from sharding.layout import REMATS, Layout
from sharding.mesh import AXES
from sharding.pipeline import schedules, stage_split
from sharding.plan import context_parallel, hardware
from sharding.plan.estimate import (GB, Memory, ModelSpec, Precision, memory, memory_parts,
                                    model_spec)

# The activation formula `plan` and `memory` judge the fit by: the compiled programs' own
# (sharding/plan/activations.py), 1.00-1.01x the 8.86B programs' peaks where Korthikanti et
# al.'s `llama` reads 1.07-1.25x (benchmarks/results/compile_vs_estimate.jsonl).
PLANNER_FORMULA = "compiled"
# Kept residuals under remat=none: Qwen3 EP16's kept MoE stages (pipeline=4 x fsdp=2 x tensor=2)
# compile to 0.49x the predicted speed, and three dense 70B layouts on 64 H100s peak 5-10 GiB
# above the memory estimate (74.9, 50.5 and 58.8 GiB where it reads 69.2, 45.2 and 48.9; at
# 0.87-0.92x the predicted speed; docs/planning.md), so `plan` does not rank them.
KEPT_UNPRICED = ("kept residuals under remat=none: their compiled programs peak above meshtron's"
                 " memory estimate and run slower than it predicts; plan ranks them under"
                 " remat=selective or full (or with pipeline_recompute=1)")


def divisibility_errors(model: ModelSpec, layout: Layout, seq_len: int) -> list[str]:
  """Every dim of the model or batch that the layout cannot split evenly, as sentences."""
  m, lay, errors = model, layout, []
  for name, size in (("attention heads", m.num_heads), ("kv heads", m.num_kv_heads),
                     ("mlp dim", m.mlp_dim), ("vocab", m.vocab_size)):
    if size % lay.tensor:
      errors.append(f"{name} {size} not divisible by tensor={lay.tensor}")
  if m.num_layers < lay.pipeline * lay.virtual_stages:  # fewer: uneven stages, padded
    errors.append(f"{m.num_layers} layers for pipeline={lay.pipeline} x virtual stages"
                  f" {lay.virtual_stages}: every stage needs a layer")
  if lay.expert > 1 and (not m.moe or m.moe.num_experts % lay.expert):
    errors.append(f"expert={lay.expert} needs a MoE whose expert count it divides")
  shards = zero_shards(lay)
  if m.embed_dim % shards:
    errors.append(f"embed dim {m.embed_dim} not divisible by the {shards} ZeRO/FSDP shards")
  if any(r % shards for r in mla_ranks(m)):
    errors.append(f"MLA latent ranks {mla_ranks(m)} not divisible by the {shards} ZeRO/FSDP"
                  " shards")
  # Context parallelism cuts each sequence into 2 x context load-balanced chunks (zig-zag ring),
  # or with a sliding window or Ulysses into context contiguous ones (sharding.context_parallel).
  seq_split = context_parallel.sequence_chunks(m, lay.context) * \
      (lay.tensor if lay.sequence_parallel else 1)
  if seq_len % seq_split:
    errors.append(f"seq {seq_len} not divisible by {seq_split} (2 x context, or context with a"
                  " window or Ulysses; x tensor under sequence parallelism)")
  return errors + context_parallel.errors(m, lay)


def zero_shards(layout: Layout) -> int:
  """How many ways the state's `embed` and `latent_rank` dims split (sharding.rules.ZERO_DIMS):
  over fsdp, and from ZeRO-1 on over data x context x expert too (ZERO_AXES; the non-expert
  weights', whose product the experts' data x context divides)."""
  lay = layout
  return lay.fsdp * (lay.data * lay.context * lay.expert if lay.zero_stage else 1)


def mla_ranks(model: ModelSpec) -> tuple[int, ...]:
  """The latent ranks MLA's up-projections split over fsdp (sharding.rules `latent_rank`)."""
  return tuple(r for r in ((model.mla.q_lora_rank, model.mla.kv_lora_rank) if model.mla else ())
               if r)


@dataclasses.dataclass
class Candidate:
  """One layout with its predicted memory and speed."""

  layout: Layout
  memory: Memory
  time: hardware.StepTime
  fits: bool

  def summary(self) -> dict:
    """The JSON fields of `meshtron memory --json` and of each `meshtron plan --json` entry."""
    m = self.memory
    return {"layout": self.layout.string(), "num_gpus": self.layout.num_devices,
            "params_gb": m.params / GB, "grads_gb": m.grads / GB,
            "optimizer_gb": m.optimizer / GB, "activations_gb": m.activations / GB,
            "logits_gb": m.logits / GB, "temporaries_gb": m.temporaries / GB,
            "total_gb": m.total / GB, "fits": self.fits, "step_time_s": self.time.step_s,
            "memory_bound_s": self.time.memory_bound_s,
            "tokens_per_s_per_gpu": self.time.tokens_per_s_per_gpu, "mfu": self.time.mfu}


def evaluate(model, layout: Layout, seq_len: int, precision: Precision,
             hw: hardware.HardwareProfile, *, formula: str = PLANNER_FORMULA,
             order: tuple = AXES) -> Candidate:
  """Memory, step time and the fit verdict of one layout."""
  mem = memory(model, layout, seq_len, precision, formula=formula)
  time = hardware.step_time(model, layout, seq_len, precision, hw, order)
  return Candidate(layout, mem, time, mem.total <= hw.memory_bytes)


@dataclasses.dataclass
class Plan:
  ranked: list  # Candidates that fit, fastest first
  rejected: list  # (layout or partial layout, reason)
  considered: int


def divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def plan(model, num_gpus: int, seq_len: int, global_batch_tokens: int, precision: Precision,
         hw: hardware.HardwareProfile, *, max_mbs: int = 64, max_cp: int = 16,
         order: tuple = AXES, formula: str = PLANNER_FORMULA) -> Plan:
  """The playbook's step by step over every combination: (1) a model replica must fit (tensor
  within a node, then pipeline across nodes, ZeRO stage, recomputation); (2) data parallelism and
  accumulation reach the global batch; (3) the fitting layouts are ranked by predicted tokens/s.
  `formula`: the activation formula the fit is judged by (estimate.memory)."""
  m = model_spec(model)
  if global_batch_tokens % seq_len:
    raise ValueError(f"global batch {global_batch_tokens} tokens is not a multiple of seq"
                     f" {seq_len}")
  batch = global_batch_tokens // seq_len
  rejected, ranked, considered = [], [], 0
  experts = [e for e in divisors(num_gpus) if m.moe and m.moe.num_experts % e == 0] or [1]
  ranks = mla_ranks(m)
  dense = m.moe.dense_layers if m.moe else m.num_layers
  for tensor in divisors(num_gpus):
    if tensor > hw.gpus_per_node:
      rejected.append((f"tensor={tensor}", f"tensor parallelism across nodes ({tensor} >"
                       f" {hw.gpus_per_node} GPUs per node); the mesh keeps tensor in a node"))
      continue
    for pipeline in divisors(num_gpus // tensor):
      for context in (c for c in divisors(num_gpus // (tensor * pipeline)) if c <= max_cp):
        for expert in (e for e in experts if (num_gpus // (tensor * pipeline * context)) % e == 0):
          model_split = dict(tensor=tensor, pipeline=pipeline, context=context, expert=expert)
          named = ",".join(f"{k}={v}" for k, v in model_split.items())
          rest = num_gpus // (tensor * pipeline * context * expert)
          impl = context_parallel.runnable_impl(m.context_impl, Layout(**model_split))
          if impl != m.context_impl:
            model_split["context_impl"] = impl
          here = dataclasses.replace(m, context_impl=impl)
          errors = divisibility_errors(here, Layout(data=rest, **model_split), seq_len)
          if errors:
            rejected.append((named, "; ".join(errors)))
            continue
          for data, fsdp, zero in _data_splits(rest, context * expert):
            shards = data * fsdp * expert
            if batch % shards:
              rejected.append((f"{named},data={data},fsdp={fsdp}",
                               f"global batch {batch} sequences not divisible by data x fsdp x"
                               f" expert = {shards}"))
              continue
            split = zero_shards(Layout(data=data, fsdp=fsdp, zero_stage=zero, **model_split))
            if m.embed_dim % split or any(r % split for r in ranks):
              rejected.append((f"{named},data={data},fsdp={fsdp},zero={zero}",
                               f"embed dim {m.embed_dim} or MLA latent ranks {ranks} not"
                               f" divisible by the {split} ZeRO/FSDP shards"))
              continue
            per_replica = batch // shards
            for mbs in (b for b in divisors(per_replica) if b <= max_mbs):
              # A layout's schedules share its memory terms and costs but for the bubble's.
              parts, costs = {}, {}
              for extra in _switches(m, tensor, pipeline):
                lay = Layout(data=data, fsdp=fsdp, zero_stage=zero, micro_batch=mbs,
                             microbatches=per_replica // mbs, **model_split, **extra)
                if lay.stage_remat(m.num_layers) != lay.remat:
                  continue  # remat=none's program (Layout.stage_remat): listed once, as that
                considered += 1
                if pipeline > 1 and schedules.table_if_valid(
                    lay.pipeline_schedule, pipeline, lay.microbatches, lay.virtual_stages) is None:
                  rejected.append((lay.string(), _schedule_refusal(lay)))
                  continue
                if not lay.pipeline_recompute and not stage_split.keeps_residuals(
                    lay.stage_split(m.num_layers), dense, m.mtp_depth):
                  rejected.append((lay.string(), stage_split.KEPT_REFUSAL))
                  continue
                if not lay.pipeline_recompute and lay.remat == "none":
                  rejected.append((lay.string(), KEPT_UNPRICED))
                  continue
                if lay.sequence_parallel and seq_len % (
                    context_parallel.sequence_chunks(here, context) * tensor):
                  continue
                shared = tuple(v for k, v in extra.items() if k != "pipeline_schedule")
                if shared not in parts:
                  parts[shared] = memory_parts(here, lay, seq_len, precision, formula=formula)
                mem = memory(here, lay, seq_len, precision, formula=formula, parts=parts[shared])
                if mem.total > hw.memory_bytes:
                  rejected.append((lay.string(), _too_big(mem, hw)))
                  continue
                if shared not in costs:
                  costs[shared] = hardware.stage_costs(here, lay, seq_len, precision, hw, order)
                time = hardware.step_time(here, lay, seq_len, precision, hw, order,
                                          costs=costs[shared])
                ranked.append(Candidate(lay, mem, time, True))
  ranked.sort(key=lambda c: (-c.time.tokens_per_s_per_gpu, c.memory.total))
  return Plan(ranked, rejected, considered)


def _data_splits(rest: int, zero_group: int):
  """(data, fsdp, zero stage): plain data parallelism and ZeRO-1/2 over data x context x
  expert (`zero_group`: context x expert, sharding.rules.ZERO_AXES), FSDP, and hybrids."""
  for zero in (0, 1, 2):
    if zero == 0 or rest * zero_group > 1:
      yield rest, 1, zero
  for fsdp in divisors(rest)[1:]:
    yield rest // fsdp, fsdp, 0


def _switches(model, tensor: int, pipeline: int):
  # paired_1f1b: 1F1B's order with a forward and a backward in each steady tick, which meshtron's
  # lock-step executor runs faster (schedules.lockstep_ratio); both kept, as users choose.
  schedules = [("1f1b", 1)] + ([("paired_1f1b", 1)] if pipeline > 1 else [])
  if pipeline > 1 and model.num_layers % (2 * pipeline) == 0:
    schedules += [("interleaved_1f1b", 2), ("paired_1f1b", 2)]
  # pipeline_recompute=False: the stages keep their chunks' residuals (sharding.pipeline.
  # kept_residuals) instead of rerunning each chunk's forward, memory for time.
  recomputes = (True, False) if pipeline > 1 else (True,)
  for remat in REMATS:
    for sp in ((False, True) if tensor > 1 else (False,)):
      for schedule, vpp in schedules:
        for recompute in recomputes:
          yield dict(remat=remat, sequence_parallel=sp, pipeline_schedule=schedule,
                     virtual_stages=vpp, pipeline_recompute=recompute)


def _schedule_refusal(lay: Layout) -> str:
  """Why the pipeline executor refuses the layout's schedule (its own sentence)."""
  try:
    schedules.make(lay.pipeline_schedule, lay.pipeline, lay.microbatches, lay.virtual_stages)
  except ValueError as e:
    return str(e)
  raise AssertionError(f"{lay.string()}: table_if_valid refused a schedule make accepts")


def _too_big(mem: Memory, hw: hardware.HardwareProfile) -> str:
  return (f"needs {mem.total / GB:.1f} GB > {hw.memory_bytes / GB:.0f} GB (params"
          f" {mem.params / GB:.1f}, grads {mem.grads / GB:.1f}, optimizer"
          f" {mem.optimizer / GB:.1f}, activations {mem.activations / GB:.1f}, logits"
          f" {mem.logits / GB:.1f})")


def rejection_summary(rejected: list, examples: int = 2) -> list[str]:
  """Rejections grouped by the kind of reason, with a count and a few examples each."""
  groups: dict = {}
  for what, why in rejected:
    kind = why.split(" (")[0].split(" by ")[0].split(": got")[0] if not why.startswith(
        "needs") else "does not fit in memory"
    groups.setdefault(kind, []).append((what, why))
  lines = []
  for kind, items in sorted(groups.items(), key=lambda kv: -len(kv[1])):
    lines.append(f"{len(items):>6} x {kind}")
    lines += [f"         e.g. {what}: {why}" for what, why in items[:examples]]
  return lines
