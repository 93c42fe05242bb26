"""The published H100 training runs meshtron is held against (issue [26]): each anchor's recipe as
its source gives it (model, GPUs, layout, global batch, microbatches, sequence, precision,
recomputation, release), and the meshtron config that compiles it for the anchor's own cluster.

Megatron-Bridge rows are read from NVIDIA-NeMo/Megatron-Bridge `docs/performance-summary-archive.md`
(no H100 rows are in the current `docs/performance-summary.md`, release 26.08) and its
`src/megatron/bridge/perf_recipes/*/h100/` recipes (recomputation); where several releases list
the same model, GPU count and precision, the newest is taken and named. Its MoE rows run
dropless with the token distribution force-balanced across experts (the archive's footnote);
meshtron's routing is its real router. Its dropless exchange runs in rounds of buffers sized by
`model.moe.exchange_capacity` (a multiple of a device pair's balanced share); the prediction is
of one round, which holds while no pair receives more than that. A force-balanced row sets the
capacity to exactly the balanced share, beside a real-router row at the default capacity (2x). "Before" rows are the programs of commit
76117c7 (before issue [26]'s program changes), measured with this tree's benchmarks/ and
sharding/xla/ on a worktree of that commit, and kept so the changes show against them.
"""

import dataclasses

from configs import llama, moe
from models.fp8.config import Fp8Config
from sharding.mesh import LayoutError, MeshConfig
from sharding.xla import compiled

MEGATRON_BRIDGE = "Megatron-Bridge docs/performance-summary-archive.md, DGX-H100"
FP8_CS = "fp8 current scaling (meshtron: tensorwise)"
PEAK_LIMIT_GIB = 76  # issue [26]: what a row's program may peak at on an 80 GB H100


# What the pipelined recipes' meshtron programs change in the anchor's schedule.
PAIRED = ("meshtron pairs a forward and a backward in each steady tick (paired_1f1b, in the"
          " anchor's order: its executor's stages tick in lock step) and runs the head on every"
          " stage, each on 1/stages of the tokens;")

@dataclasses.dataclass(frozen=True)
class Anchor:
  name: str
  source: str  # where the published figure is
  release: str  # the publisher's release or date of that figure
  published: float  # tokens/s/GPU
  precision: str  # as the anchor ran it: "bf16" or an fp8 recipe
  preset: str
  gpus: int  # the anchor's cluster; meshtron compiles for h100x<gpus>
  mesh: dict
  batch_size: int  # global sequences per step
  seq_len: int
  microbatches: int  # meshtron's: gradient-accumulation steps of batch_size / microbatches
  remat: str
  differences: str  # what the published run does that meshtron's program does not, or ""
  compute: tuple = ()  # compute config overrides, (field, value) pairs
  routing: str = ""  # MoE rows: how tokens reach experts in the anchor's run and in ours
  moe: tuple = ()  # model.moe overrides, (field, value) pairs
  before: str = ""  # a "before" row: what it stands for
  # bf16 parameters with float32 master copies in the optimizer (Megatron's distributed
  # optimizer); else float32 parameters, gathered and computed in bf16 (FSDP2, MaxText).
  master_weights: bool = False

  @property
  def target(self) -> str:
    return f"h100x{self.gpus}"


def _fp8(recipe: str = "tensorwise") -> tuple:
  return (("fp8", Fp8Config(enabled=True, recipe=recipe)),)


# Each layer's weights apart and the layers unrolled (compute.scan_layers=False) where that
# program is faster and fits (docs/parallelism.md, "Layers stored apart"). Not taken: the
# torchtitan Float8 row's program peaks at 79.7 GiB so, MaxText 70B's at 77.2 GiB (and 1,157
# tok/s/GPU); torchtitan's bf16 row (10,074 against 9,398, 59.5 GiB) because the `compiled`
# activation estimate, fitted on scanned programs, reads 1.12x that program's peak, past the
# 1.1x it holds on every anchor row (tests/test_activation_formula.py); pipelined rows need
# the stacked layers.
APART = (("scan_layers", False),)

# The MoE rows keep the exchange's first round for the backward (docs/moe.md): the backward
# runs neither its exchange there nor its experts again (the DeepSeek-V3 rows: 245 -> 267 and
# 108 -> 116 tok/s/GPU when it was taken, Qwen3's force-balanced 4,685 -> 5,495).
# And each device's tokens exchanged in two chunks apart, so XLA runs one chunk's exchange behind
# the other's expert matmuls (docs/moe.md; with the backward's weights read as stored, Qwen3 EP16
# 4,123 -> 4,185, its force-balanced row 5,375 -> 5,587, DeepSeek-V3-like 115.5 -> 118.6).
# And the experts run as batched GEMMs over equal slots per expert (kernels/capacity_matmul.py),
# priced as the dense GEMMs, where the Pallas grouped kernel was measured at about a quarter of
# their rate (Qwen3 EP16 4,230 -> 5,667, its force-balanced row 5,542 -> 6,498).
MOE_EXCHANGE = (("keep_first_round", True), ("exchange_chunks", 2),
                ("grouped_matmul", "capacity"))
# And the SwiGLU run whole on the slots (models/slot_experts.py): the rows gathered in and the
# products out once a round, x quantized once (Qwen3 EP16 5,656 -> 6,042, its force-balanced
# row 6,498 -> 6,845, DeepSeek-V3-like 191.0 -> 207.6). The DeepSeek-V3 rows keep
# grouped_matmul=capacity: its force-balanced row read 489.7 -> 488.7 with slots (kernels 40.41
# -> 39.46 s, but 26.5 -> 27.6 s of its exchanges exposed); the real-router row 445.7 -> 451.5
# (compiled alone: two at once exceed this machine's memory), not adopted yet.
MOE_SLOTS = (("keep_first_round", True), ("exchange_chunks", 2), ("grouped_matmul", "slots"))
_KEPT = ("; the exchange's first round kept for the backward (keep_first_round: its backward"
         " runs neither the exchange nor the experts again); each device's tokens exchanged in"
         " 2 chunks apart (exchange_chunks=2: one chunk's exchange behind the other's experts)")
_SLOTS = ("; the experts as batched GEMMs over {} an expert's balanced share of rows each"
          " (grouped_matmul=capacity: an expert's rows past its slots run in later rounds; {})")
_WHOLE = ("; the experts' SwiGLU run whole on {} an expert's balanced share of slots each"
          " (grouped_matmul=slots: the rows gathered in and the products out once a round; an"
          " expert's rows past its slots run in later rounds; {})")
_TWICE = ("2x", "predicted for one round: no expert over 2x its share")
_EXACTLY = ("exactly", "one round, as forced balance guarantees")
_FORCE_BALANCED = ("anchor: dropless, token distribution force-balanced across experts;"
                   " meshtron: dropless, its real router, exchange buffers 2x a device pair's"
                   " balanced share (predicted for one round: no pair over 2x its share)" + _KEPT)
_AS_IF_BALANCED = ("anchor: dropless, token distribution force-balanced across experts;"
                   " meshtron: dropless, exchange buffers of exactly a device pair's balanced"
                   " share (exchange_capacity=1), predicted for one round, which only forced"
                   " balance guarantees (its real router's excess would run more rounds)" + _KEPT)

ANCHORS = (
    Anchor("MaxText Llama-2-70B, FSDP 64", "NVIDIA dgxc-benchmarking, maxtext/README_70b.md"
           " (bf16, 64x H100, GBS 128, MBS 2): 74,909 tok/s", "as issue [18] cites it",
           74_908.99 / 64, "bf16", "llama2_70b", 64, dict(fsdp=64), 128, 4096, 1, "full",
           "MaxText's remat for this recipe is not in its README (its A3 scripts save the q/k/v"
           " projections); ours recomputes the whole layer, up to 1/3 more matmul FLOPs; cuDNN"
           " attention"),
    Anchor("NeMo Llama-3.1-8B, TP1 CP2", "NeMo performance summary, DGX-H100 bf16, 8 GPUs,"
           " TP1 PP1 CP2, seq 8192 (GBS 128 and MBS 1: Megatron-Bridge's recipe"
           " llama3_8b_pretrain_8gpu_h100_bf16_config)", "as issue [18] cites it", 10_153,
           "bf16", "llama3_8b", 8, dict(data=4, context=2, zero_stage=1), 128, 8192, 32, "none",
           "Transformer Engine + cuDNN attention", compute=APART, master_weights=True),
    Anchor("NeMo Llama-3.1-8B, TP1 CP2, meshtron's Ulysses", "as the row above",
           "as issue [18] cites it", 10_153, "bf16", "llama3_8b", 8,
           dict(data=4, context=2, zero_stage=1), 128, 8192, 32, "none",
           "as above, and meshtron splits the context by Ulysses all-to-alls around its flash"
           " kernel where NeMo passes K/V around a ring",
           compute=APART + (("context_impl", "ulysses"),), master_weights=True),
    Anchor("torchtitan Llama-3.1-8B, FSDP 8", "torchtitan benchmarks/llama3_h100_202412_"
           "torchtitan.md Table 1 (FSDP + torch.compile, local batch 2, seq 8192)", "2024-12",
           6_667, "bf16", "llama3_8b", 8, dict(fsdp=8), 16, 8192, 1, "selective",
           "torchtitan's H100s ran at 500 W with 96 GB HBM2e at 2.4 TB/s (below the SXM H100"
           " profile); torch.compile; SDPA flash attention"),
    Anchor("torchtitan Llama-3.1-8B, FSDP 8, Float8", "as the row above (FSDP + torch.compile"
           " + Float8)", "2024-12", 8_532, "fp8 tensorwise (torchao Float8 linears)",
           "llama3_8b", 8, dict(fsdp=8), 16, 8192, 1, "selective",
           "as the row above; torchao's Float8 all-gathers the FSDP weights in fp8",
           compute=_fp8()),
    Anchor("Megatron-Bridge Llama-3-8B FP8, FSDP 8", f"{MEGATRON_BRIDGE}: 8 GPUs, FP8-CS, GBS"
           " 128, MBS 1, seq 8192, FSDP 8, GA 16; recipe llama3_8b_pretrain_8gpu_h100_fp8cs"
           "_config (full recompute of 5 of 32 layers)", "25.11 (no newer H100 row)", 14_451,
           FP8_CS, "llama3_8b", 8, dict(fsdp=8), 128, 8192, 16, "none",
           "Megatron recomputes 5 of the 32 layers (meshtron: none, or every layer);"
           " Transformer Engine", compute=_fp8() + APART, master_weights=True),
    Anchor("Megatron-Bridge Llama-3-70B FP8, TP4 PP8 VP5", f"{MEGATRON_BRIDGE}: 64 GPUs,"
           " FP8-CS, GBS 256, MBS 1, seq 8192, TP4 PP8 VP5 (DP 2), no recompute; recipe"
           " llama3_70b_pretrain_64gpu_h100_fp8cs_config", "26.04.01 (newest H100 row; 26.02:"
           " 1,621)", 1_664, FP8_CS, "llama3_70b", 64,
           # Kept residuals (Megatron's stages keep activations too) under selective remat:
           # 74.5 GiB and 1,487 tok/s/GPU, where recomputing each chunk's forward read 1,363
           # at 42.1 GiB and keeping what remat=none keeps needs 93.6 (docs/planning.md).
           dict(data=2, tensor=4, pipeline=8, virtual_stages=5,
                pipeline_schedule="paired_1f1b", sequence_parallel=True, zero_stage=1,
                pipeline_recompute=False), 256,
           8192, 128, "selective",
           PAIRED + " its stages keep their forward's residuals for the backward, as Megatron's"
           " do, but recompute attention and the elementwise ops between the projections"
           " (remat=selective; Megatron: none); both shard the optimizer state over the 2"
           " data-parallel replicas (Megatron's distributed optimizer, which its recipes'"
           " optimizer configs turn on; meshtron's ZeRO-1). Megatron's layout puts the embedding"
           " and head on stages of their own layers"
           " (Et*2|(t*2|)*34,t*3|(t*2|)*3,tL); TP communication overlapped by userbuffers;"
           " cuDNN attention (meshtron: its Pallas flash kernel)", compute=_fp8(),
           master_weights=True),
    Anchor("Megatron-Bridge Llama-3.1-405B FP8, TP8 PP8 CP2 VP8", f"{MEGATRON_BRIDGE}: 1,024"
           " GPUs, FP8-CS, GBS 1536, MBS 1, seq 8192, TP8 PP8 CP2 VP8 (DP 8); recipe"
           " llama31_405b_pretrain_1024gpu_h100_fp8cs_config", "26.06 (newest H100 row; 26.02:"
           " 311)", 326, FP8_CS, "llama3_405b", 1024,
           dict(data=8, tensor=8, pipeline=8, context=2, virtual_stages=8,
                pipeline_schedule="paired_1f1b", sequence_parallel=True, zero_stage=1),
           1536, 8192, 192,
           "none",
           PAIRED + " TP overlap by userbuffers; cuDNN attention; context parallelism by Ulysses'"
           " all-to-alls around the flash kernel (Megatron's default: the p2p ring, which"
           " meshtron cannot run inside pipeline stages)", compute=_fp8() + (("context_impl", "ulysses"),),
           master_weights=True),
    Anchor("Llama-3.1-405B, PP16 TP8 (before)", "issue [26]'s 'before' program: the 405B on"
           " 16 stages x tensor 8, the layout meshtron accepted nearest the Megatron-Bridge"
           " recipe (which needs pipeline x context)", "26.06 (the figure of the row above)",
           326, "bf16", "llama3_405b", 128,
           dict(tensor=8, pipeline=16, sequence_parallel=True), 16, 4096, 16, "full",
           "not the anchor's layout: 16 stages, no context parallelism, seq 4096, 16 sequences"
           " a step, bf16, full recomputation",
           before="XLA gathered each sequence-parallel activation once per dot reading it"),
    Anchor("Llama-3.1-405B, PP16 TP8, now", "the row above's program after issue [26]'s"
           " changes so far: each sequence-parallel activation gathered once, the flash kernel"
           " inside the stages, a forward and a backward in each steady tick (paired_1f1b), the"
           " head on every stage, bf16 weights with float32 master copies (each tick had cast"
           " its chunk's float32 weights to bf16 again: 54.1 tok/s/GPU at 71.5 GiB without), the"
           " drain's ticks a loop without the forward and the head (64.0 tok/s/GPU with them), each"
           " stage keeping its chunk's residuals where its backward ran the chunk's forward again"
           " (pipeline_recompute=false; 70.0 tok/s/GPU at 73.9 GiB with the rerun)",
           "26.06 (the figure of the row above)", 326, "bf16", "llama3_405b", 128,
           dict(tensor=8, pipeline=16, sequence_parallel=True, pipeline_schedule="paired_1f1b",
                pipeline_recompute=False),
           16, 4096, 16, "full",
           "as the row above", master_weights=True),
    Anchor("Megatron-Bridge Qwen3-30B-A3B FP8, EP16", f"{MEGATRON_BRIDGE}: 16 GPUs, FP8, GBS"
           " 1024, MBS 1, seq 4096, EP16 (DP 16), no recompute; recipe"
           " qwen3_30b_a3b_pretrain_16gpu_h100_fp8cs_config", "26.06 (newest H100 row; 26.02:"
           " 5,113 at PP2 VP12 EP8; 25.09: 10,494 with token dropping)", 8_826, FP8_CS,
           "qwen3_30b_a3b", 16, dict(expert=16, zero_stage=1), 1024, 4096, 64, "none",
           "force-balanced routing; Transformer Engine grouped GEMMs and cuDNN attention."
           " Both shard the optimizer state over the 16 data-parallel ranks (Megatron's"
           " distributed optimizer; meshtron's ZeRO-1 over `expert`), the experts' own state"
           " over none",
           compute=_fp8(), routing=_FORCE_BALANCED + _WHOLE.format(*_TWICE),
           master_weights=True, moe=MOE_SLOTS),
    Anchor("Megatron-Bridge Qwen3-30B-A3B FP8, EP16, buffers as if force-balanced",
           f"{MEGATRON_BRIDGE}: as the row above", "26.06 (the figure of the row above)", 8_826,
           FP8_CS, "qwen3_30b_a3b", 16, dict(expert=16, zero_stage=1), 1024, 4096, 64, "none",
           "as the row above", compute=_fp8(), routing=_AS_IF_BALANCED + _WHOLE.format(
               *_EXACTLY), master_weights=True, moe=(("exchange_capacity", 1.0), *MOE_SLOTS)),
    Anchor("Megatron-Bridge DeepSeek-V3 FP8, TP2 PP8 VP4 EP64", f"{MEGATRON_BRIDGE}: 1,024"
           " GPUs, FP8, GBS 8192, MBS 1, seq 4096, TP2 PP8 VP4 EP64, GA 128, dropless; recipe"
           " deepseek_v3_pretrain_1024gpu_h100_fp8cs_config (recomputes MLA up-projections and"
           " MLPs)", "25.09 (no newer H100 row)", 1_297, FP8_CS, "deepseek_v3", 1024,
           dict(tensor=2, pipeline=8, virtual_stages=4, pipeline_schedule="paired_1f1b",
                expert=64, sequence_parallel=True, zero_stage=1),
           8192, 4096, 128, "selective",
           PAIRED + " force-balanced routing; Megatron recomputes the MLA up-projections and MLPs"
           " (meshtron: remat=selective, which its stages' unrolled chunks of 2 layers run as"
           " none: the executor recomputes each chunk's forward in its backward); both keep each"
           " expert whole on a device and route each device's own part of the sequence (the"
           " recipe's expert tensor parallelism of 1; meshtron, as under any sequence"
           " parallelism: its 256 experts over expert x tensor, 128 devices, where Megatron's 64"
           " hold 4 each, twice)",
           compute=_fp8(), routing=_FORCE_BALANCED + _SLOTS.format(*_TWICE),
           master_weights=True, moe=MOE_EXCHANGE),
    Anchor("Megatron-Bridge DeepSeek-V3 FP8, TP2 PP8 VP4 EP64, buffers as if force-balanced",
           f"{MEGATRON_BRIDGE}: as the row above", "25.09 (the figure of the row above)", 1_297,
           FP8_CS, "deepseek_v3", 1024,
           dict(tensor=2, pipeline=8, virtual_stages=4, pipeline_schedule="paired_1f1b",
                expert=64, sequence_parallel=True, zero_stage=1),
           8192, 4096, 128, "selective", "as the row above", compute=_fp8(),
           routing=_AS_IF_BALANCED + _SLOTS.format(*_EXACTLY), master_weights=True,
           moe=(("exchange_capacity", 1.0), *MOE_EXCHANGE)),
    Anchor("DeepSeek-V3-like, PP8 EP64 (before)", "issue [26]'s 'before' program: DeepSeek-V3's"
           " MoE on GQA attention, 8 stages x 64 expert devices", "25.09 (the figure of the row"
           " above)", 1_297, "bf16", "deepseek_v3_like", 512, dict(pipeline=8, expert=64),
           512, 4096, 8, "none",
           "not the anchor's layout or model: GQA attention, no TP, 512 GPUs, 512 sequences a"
           " step, bf16", routing="meshtron: dropless, its real router",
           before="issue [26]'s settings under today's code; it failed to compile until the"
           " twenty-ninth session (a Pallas expert kernel's region in a pipeline stage, then a"
           " cotangent typed without its pipeline axis, `Expected cotangent type"
           " float32[1,4096,8]{V:pipeline}`), and compiles since that session's exchange"
           " gradient (sharding/exchange_rounds.py), not traced further"),
    Anchor("DeepSeek-V3-like, PP8 EP64, now", "the row above's program after issue [26]'s"
           " changes so far: it compiles (the expert region checks its varying axes in a"
           " pipeline stage on GPUs), the flash kernel inside the stages, remat none keeping"
           " only matmul, kernel and exchange outputs, a forward and a backward in each steady"
           " tick (paired_1f1b), the head on every stage, bf16 weights with float32 master"
           " copies, moments and gradient sums split over `expert` (ZeRO-2: at ZeRO-1 the"
           " whole float32 sums of the shared weights peak at 84 GiB), the drain's ticks a loop"
           " without the forward and the head (207.6 tok/s/GPU with them), the flash kernel's"
           " outputs kept by the scanned chunks' layer checkpoint (233.0 running it again)",
           "25.09 (the figure of"
           " the row above)", 1_297, "bf16", "deepseek_v3_like", 512,
           dict(pipeline=8, expert=64, pipeline_schedule="paired_1f1b", zero_stage=2),
           512, 4096, 8, "none", "as the row above",
           routing="meshtron: dropless, its real router" + _KEPT + _WHOLE.format(*_TWICE),
           master_weights=True, moe=MOE_SLOTS),
)


def config(a: Anchor):
  """The TrainConfig that compiles `a` (attention "auto": the Pallas flash kernel on GPUs)."""
  cfg = (moe.large if a.preset in moe.MODELS else llama.large)(a.preset)
  cfg.mesh = MeshConfig(**{"data": 1, **a.mesh})
  cfg.batch_size, cfg.seq_len, cfg.microbatches = a.batch_size, a.seq_len, a.microbatches
  cfg.compute = dataclasses.replace(cfg.compute, remat=a.remat, **dict(a.compute))
  if a.moe:
    cfg.model = dataclasses.replace(cfg.model, moe=dataclasses.replace(cfg.model.moe,
                                                                       **dict(a.moe)))
  if a.master_weights:
    cfg.model = dataclasses.replace(cfg.model, param_dtype="bfloat16")
    cfg.optim = dataclasses.replace(cfg.optim, master_weights=True)
  return scales_per_rank(cfg, a.gpus)


def scales_per_rank(cfg, num_devices: int):
  """`cfg` with one tensorwise fp8 scale per device's micro-batch
  (compute.fp8.sequences_per_scale) where its layout takes that: each rank's, as torchao's
  Float8 and Transformer Engine scale theirs. The Megatron-Bridge recipes run 1 sequence a
  micro-batch."""
  fp8 = cfg.compute.fp8
  if not (fp8.enabled and fp8.recipe == "tensorwise"):
    return cfg
  sequences = cfg.layout(num_devices).micro_batch
  fp8 = dataclasses.replace(fp8, sequences_per_scale=sequences)
  grouped = dataclasses.replace(cfg, compute=dataclasses.replace(cfg.compute, fp8=fp8))
  try:
    grouped.layout(num_devices)
  except LayoutError:  # context parallelism in the load-balanced order: per sequence
    return cfg
  return grouped


def anchor_layout(a: Anchor):
  """The Layout `config(a)` resolves to on the anchor's cluster."""
  return config(a).layout(compiled.parse_gpu_target(a.target).num_devices)
