"""ComputeConfig: how the model's math runs — kernels, recomputation, fp8, loss chunking. Settings
of a run, not of the architecture (ModelConfig): the same weights train and convert under any of
them. `sharding.resolve` turns the "auto" choices into the run's layout decisions."""

import dataclasses

import jax

from kernels.attention import IMPLS as ATTENTION_IMPLS
from models.fp8.config import Fp8Config
from sharding.context_parallel import CONTEXT_IMPLS, check_ulysses_degree
from sharding.layout import REMATS

LOSS_IMPLS = ("dense", "chunked")
# What a layer's backward may read without recomputing it under remat="none": the outputs of
# the projections (matmuls without batch dims), of attention and expert kernels, of collectives,
# loops and sorts, and named values (the XLA attention's probabilities and output, the dropping
# MoE's exchanged tokens and expert FFN, the residuals kernels declare: kernels/residuals.py).
# That is what a hand-written backward keeps (Megatron, Transformer Engine): norms, activations,
# rope, casts and fp8 scaling run again inside the backward's fused kernels instead of being
# stored, as autodiff would store every intermediate (the f32 norm statistics, SwiGLU's sigmoid
# and products). Dots with batch dims are left to names: a ring-attention block's scores, which
# its own jax.checkpoint recomputes, would otherwise be kept for every hop (an enclosing
# checkpoint's policy decides for the nested one).
_SAVED_PRIMITIVES = frozenset((
    "ragged_dot_general", "scaled_matmul", "pallas_call", "triton_kernel_call",
    "dot_product_attention_fwd", "dot_product_attention_fp8_fwd", "cudnn_fusion", "psum",
    "psum_scatter", "reduce_scatter", "all_gather", "all_to_all", "ragged_all_to_all",
    "ppermute", "scan", "while", "sort", "top_k"))


def _no_recompute(prim, *args, **params) -> bool:
  policies = jax.checkpoint_policies
  return (prim.name in _SAVED_PRIMITIVES
          or policies.dots_with_no_batch_dims_saveable(prim, *args, **params)
          or policies.save_any_names_but_these()(prim, *args, **params))


# A projection whose weight gradient goes into a float32 sum (models/layers.summed_einsum) is a
# custom_vjp, whose output no policy sees as a dot: it is named PROJECTION, and kept where a
# plain projection's dot is.
PROJECTION = "projection"
# q and k after RoPE (models/attention.py), kept where the projections' outputs are: the
# attention kernel's inputs, which the backward (or its recomputed forward) reads, where only
# RoPE reads the projections' outputs.
ROTATED = "rotated"


def _projections(prim, *args, **params) -> bool:
  policies = jax.checkpoint_policies
  return (policies.dots_with_no_batch_dims_saveable(prim, *args, **params)
          or policies.save_only_these_names(PROJECTION, ROTATED)(prim, *args, **params))


# Remat policies by name, each applied to one layer's body (models/transformer.py) and to each
# multi-token prediction module. "selective" keeps the projection matmul outputs (dots without
# batch dims) and recomputes the rest, notably attention (its scores' einsums carry batch dims;
# a flash kernel runs its forward again). "full" keeps only the layer's input. The names are
# the layout's (sharding.layout.REMATS: the analytic model's too).
REMAT_POLICIES = dict(zip(REMATS, (_no_recompute, _projections,
                                   jax.checkpoint_policies.nothing_saveable)))


@dataclasses.dataclass(unsafe_hash=True)
class ComputeConfig:
  """How a run computes its model (TrainConfig.compute). Hashable: a built model keeps it."""

  # "auto": a flash kernel on GPUs (pipeline stages included), the XLA reference on CPU
  # (sharding.layout.attention_kernel).
  attention_impl: str = "auto"
  # With the sequence split over `context`: "ring", "allgather", "ulysses" (head-split all-to-alls
  # around any kernel) or "ulysses_ring" (USP; kernels/ulysses.py, sharding/context_parallel.py).
  context_impl: str = "ring"
  ulysses_degree: int = 0  # ulysses: 0 (= the context size); ulysses_ring: its inner factor
  # The dense MLP's tensor-parallel collectives as collective matmuls (sharding/
  # collective_matmul.py): with sequence parallelism, the all-gather before gate/up and the
  # reduce-scatter after down become N - 1 ppermute steps that overlap the matmul chunks.
  collective_matmul: bool = False
  remat: str = "none"  # one of REMAT_POLICIES, per layer
  # False: each layer's weights are arrays of their own and the layers run unrolled, which
  # spares a scan's per-microbatch copies of weight rows and stacked residuals (faster for a
  # few dozen layers; the compile time grows with the depth). Not with pipeline stages.
  scan_layers: bool = True
  # How the output head meets the loss: "dense" materializes [B, L, V] logits; "chunked" runs
  # the head and the cross-entropy over sequence chunks of `loss_chunk_size` tokens, so only
  # [B, chunk, V] logits ever exist (kernels/cross_entropy.py).
  loss_impl: str = "dense"
  loss_chunk_size: int = 256
  fp8: Fp8Config = dataclasses.field(default_factory=Fp8Config)

  def __post_init__(self):
    if isinstance(self.fp8, dict):  # from dataclasses.asdict (e.g. a config sent to a subprocess)
      self.fp8 = Fp8Config(**self.fp8)

  def validate(self, model) -> None:
    """One-line ValueErrors for a bad setting, or one the architecture `model` cannot run."""
    for name, allowed in (("attention_impl", ATTENTION_IMPLS), ("loss_impl", LOSS_IMPLS),
                          ("context_impl", CONTEXT_IMPLS), ("remat", tuple(REMAT_POLICIES))):
      if getattr(self, name) not in allowed:
        raise ValueError(f"compute.{name}={getattr(self, name)!r} is not one of {allowed}")
    if self.loss_chunk_size <= 0:
      raise ValueError(f"compute.loss_chunk_size must be positive, got {self.loss_chunk_size}")
    check_ulysses_degree(self.context_impl, self.ulysses_degree)
    self.fp8.validate()
    if self.collective_matmul and self.fp8.applies_to("mlp"):
      raise ValueError("compute.collective_matmul runs the MLP matmuls itself, not in fp8: drop"
                       " 'mlp' from compute.fp8.targets or set compute.collective_matmul=false")
    if self.fp8.applies_to("head") and (model.tie_embeddings or self.loss_impl == "chunked"):
      raise ValueError("compute.fp8.targets includes 'head', which needs an untied head and"
                       " compute.loss_impl='dense'")
    if model.mtp_depth and self.fp8.applies_to("head") and self.fp8.recipe == "delayed":
      raise ValueError("compute.fp8.targets includes 'head', whose delayed amax history one use"
                       " updates, but the multi-token prediction modules share it: drop 'head',"
                       " use a current-scaling compute.fp8.recipe, or set model.mtp_depth=0")
    self.fp8.check_dropless_experts(model.moe)
