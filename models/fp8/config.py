"""Fp8Config: which matmuls run in fp8 with which scaling recipe (TrainConfig.compute.fp8), and its
own checks (models/compute.py ties it to the rest of the run)."""

import dataclasses

FP8_RECIPES = ("delayed", "tensorwise", "rowwise", "blockwise")
# Projections that can run in fp8. The router always stays in float32 and the embedding lookup is
# a gather; the output head ("head") is opt-in, as first and last layers are the most sensitive.
FP8_TARGETS = ("attention", "mlp", "experts", "head")
# The recipes the dropless dispatch's grouped expert GEMMs run (models/fp8/grouped.py). Delayed
# scaling's amax histories are parameters, which the dropless region would have to carry and
# reduce; blockwise's 1 x 128 tiles along the tokens would cut across the ragged expert groups.
GROUPED_RECIPES = ("tensorwise", "rowwise")


@dataclasses.dataclass(unsafe_hash=True)
class Fp8Config:
  """fp8 matmuls, off by default: operands e4m3 forward, output gradients e5m2, float32 results.

  The recipe says where each GEMM operand's scale (fmax / amax) comes from:
    "delayed"     per tensor, from amax histories of `amax_history` steps (parameters, so in the
                  train state; fmax / max(history) / 2^margin): a jump saturates (models/fp8).
    "tensorwise"  per tensor, its current amax; no state, as the next two (models/fp8_current).
    "rowwise"     per row of activations and column of weights (every GEMM, backward included).
    "blockwise"   DeepSeek-V3: 1 x 128 tiles of activations and gradients, 128 x 128 weight
                  blocks; contracted and weight dims of at most 128 or a multiple of 128.
  Under model.moe.dispatch="dropless" the experts take tensorwise or rowwise, per expert, with
  e4m3 output gradients (models/fp8/grouped.py).

  `sequences_per_scale`, tensorwise: the sequences of a token array that share one scale, in
  consecutive groups (1: each sequence its own). A device's micro-batch is what torchao's
  Float8 and Transformer Engine scale together, each rank its own; a divisor of it keeps the
  groups on the device (sharding/resolution.py refuses others, and context parallelism in the
  load-balanced order), and with more than one sequence a scale the weight gradient's GEMM sums
  the group's sequences itself instead of holding one product per sequence.
  """

  enabled: bool = False
  recipe: str = "delayed"
  amax_history: int = 16
  margin: int = 0
  targets: str = "attention,mlp,experts"  # comma-separated subset of FP8_TARGETS
  sequences_per_scale: int = 1

  def applies_to(self, target: str) -> bool:
    return self.enabled and target in self.targets.split(",")

  def validate(self) -> None:
    """Raises ValueError with a one-line message for a bad fp8 setting."""
    if self.recipe not in FP8_RECIPES:
      raise ValueError(f"compute.fp8.recipe={self.recipe!r} is not one of {FP8_RECIPES}")
    if self.amax_history <= 0 or self.margin < 0:
      raise ValueError(f"compute.fp8.amax_history must be positive and compute.fp8.margin >= 0,"
                       f" got {self.amax_history} and {self.margin}")
    if self.margin and self.recipe != "delayed":
      raise ValueError(f"compute.fp8.margin={self.margin} is the delayed recipe's headroom;"
                       f" recipe {self.recipe!r} scales by the current amax: set it to 0")
    if self.sequences_per_scale < 1 or (self.sequences_per_scale > 1
                                        and self.recipe != "tensorwise"):
      raise ValueError(f"compute.fp8.sequences_per_scale={self.sequences_per_scale} must be 1, or"
                       f" more with recipe 'tensorwise' (got {self.recipe!r})")
    unknown = [t for t in self.targets.split(",") if t not in FP8_TARGETS]
    if unknown:
      raise ValueError(f"compute.fp8.targets={self.targets!r} names {unknown}, not in"
                       f" {FP8_TARGETS}")

  def check_dropless_experts(self, moe) -> None:
    """ValueError (one line) when the experts would run fp8 under the dropless dispatch with a
    recipe its grouped GEMMs do not take."""
    if moe is not None and moe.dispatch == "dropless" and self.applies_to("experts") and \
        self.recipe not in GROUPED_RECIPES:
      raise ValueError(f"compute.fp8.recipe={self.recipe!r} does not run the MoE experts under"
                       f" model.moe.dispatch='dropless' (their grouped GEMMs take"
                       f" {GROUPED_RECIPES}): set compute.fp8.recipe to one of those,"
                       " model.moe.dispatch='dropping', or drop 'experts' from"
                       " compute.fp8.targets")
    if moe is not None and moe.dispatch == "dropless" and self.applies_to("experts") and \
        moe.grouped_matmul == "slots" and self.recipe != "tensorwise":
      raise ValueError(f"model.moe.grouped_matmul='slots' runs the experts' fp8 GEMMs"
                       f" tensorwise only, not compute.fp8.recipe={self.recipe!r}: set"
                       " compute.fp8.recipe='tensorwise' or model.moe.grouped_matmul='capacity'")
