"""Mixture-of-experts feed-forward: router, aux losses, balancing bias, dropping/dropless dispatch."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from flax import nnx

from models.config import ModelConfig
from models.fp8.grouped import RECIPES as GROUPED_RECIPES, GemmAxes, quantized_grouped
from models.layers import Einsum, logical_param, projection_kw
from models.mlp import MLP
from kernels.capacity_matmul import capacity_grouped, slots_per_group
from kernels.grouped_matmul import grouped_matmul
from models.slot_experts import SlotPrecision, slot_swiglu
from sharding import Layout, constrain, dropless_experts
from sharding.context_parallel import whole_sequence_sum
from sharding.exchange_rounds import permuted
from sharding.expert import ExpertAxes

# The logical name of the per-expert routing bias: the optimizer leaves it alone and the train
# step updates it from the routing counts (DeepSeek-V3's auxiliary-loss-free balancing).
EXPERT_BIAS = "expert_bias"
# The dispatched tokens [E, groups, capacity, D] in two layouts: where the tokens are (groups
# on the batch axes, built and combined locally), and where their experts are (experts on the
# `expert` axis, which the groups dim then gives up: rules.py lists act_experts before batch).
# Constraining both makes the move between them an all-to-all each way; with only the second,
# XLA gathers the tokens for the combine's backward instead.
AT_TOKENS = (None, "batch", None, "act_embed")
AT_EXPERTS = ("act_experts", "batch", None, "act_embed")
AT_EXPERTS_HIDDEN = ("act_experts", "batch", None, "act_mlp")


def update_bias(bias_E: jax.Array, load_E: jax.Array, rate: float) -> jax.Array:
  """bias + rate x sign(mean load - load): under-loaded experts become likelier to be chosen."""
  load = load_E.astype(jnp.float32)
  return bias_E + rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)


def summarize(per_layer: dict, num_layers: int) -> dict:
  """The model's routing stats from MoE layers' (stacked on a leading layer dim): all of the
  model's `num_layers` MoE layers, or some of them (a pipeline stage's; padding rows add zeros).

  Returns:
    {"aux_loss": [B] balance loss of each sequence, "z_loss": [B, L] z-loss of each token (both
    sums over these layers / num_layers: their share of the means over the model's layers;
    trainer/loss.py weights and sums them), "dropped": assignments dropped in these layers,
    "load": [layers, E] assignments per expert}.
  """
  return {"aux_loss": jnp.sum(per_layer["aux_loss"], axis=0) / num_layers,
          "z_loss": jnp.sum(per_layer["z_loss"], axis=0) / num_layers,
          "dropped": jnp.sum(per_layer["dropped"]), "load": per_layer["load"]}


def limit_to_groups(select_BLE: jax.Array, groups: int, keep: int) -> jax.Array:
  """DeepSeek-V3's group-limited routing: the selection scores with every expert outside the
  token's `keep` best groups (a group's score: the sum of its two best experts') set to -inf."""
  *lead, num_experts = select_BLE.shape
  grouped = select_BLE.reshape(*lead, groups, num_experts // groups)
  best_two = -jnp.sort(-grouped, axis=-1)[..., :2]
  order = jnp.argsort(-jnp.sum(best_two, axis=-1), axis=-1, stable=True)  # [..., groups]
  kept = jnp.sum(jax.nn.one_hot(order[..., :keep], groups, dtype=jnp.int32), axis=-2) > 0
  return jnp.where(kept[..., None], grouped, -jnp.inf).reshape(select_BLE.shape)


class Router(nnx.Module):
  """Scores [B, L, E] in float32, top-k choices and their mixing weights, and the aux stats."""

  def __init__(self, cfg: ModelConfig, layout: Layout | None = None, *, rngs: nnx.Rngs):
    m = cfg.moe
    # Where the sequence-wise balance loss finds the whole sequence (default: one device's).
    self.layout = Layout() if layout is None else layout
    init = jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
    self.w = logical_param(init(rngs.params(), (cfg.embed_dim, m.num_experts), cfg.param_dtype),
                           ("embed", None))
    # float32 whatever the param dtype: the bias moves by small sign steps.
    self.bias = logical_param(jnp.zeros((m.num_experts,), jnp.float32), (EXPERT_BIAS,)) \
        if m.bias_update_rate > 0 else None
    self.kind, self.k, self.scaling = m.router, m.experts_per_token, m.routed_scaling
    self.normalize = m.normalize_top_k
    self.groups, self.groups_per_token = m.expert_groups, m.groups_per_token

  def __call__(self, x_BLD: jax.Array):
    """Returns (ids [B, L, k] int32, weights [B, L, k] float32, stats of this layer)."""
    logits = jnp.einsum("BLD,DE->BLE", x_BLD.astype(jnp.float32),
                        self.w[...].astype(jnp.float32))
    num_experts = logits.shape[-1]
    if self.kind == "softmax":
      scores = jax.nn.softmax(logits, axis=-1)
      probs = scores
    else:  # sigmoid: independent affinities; their normalized values play the probabilities
      scores = jax.nn.sigmoid(logits)
      probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    select = scores if self.bias is None else \
        scores + jax.lax.stop_gradient(self.bias[...]).reshape(1, 1, num_experts)
    # The bias picks experts; the scores mix them. A stable sort, not lax.top_k: XLA's TopK
    # custom call does not partition, and would gather every token's scores (same ids, ties to
    # the lower index).
    if self.groups > 1:
      select = limit_to_groups(select, self.groups, self.groups_per_token)
    ids = jnp.argsort(-select, axis=-1, stable=True)[..., :self.k]
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if self.normalize and (self.kind == "sigmoid" or self.k > 1):
      weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights * self.scaling
    load_BE = jnp.sum(jax.nn.one_hot(ids, num_experts, dtype=jnp.float32), axis=2)
    # Switch-style balance per sequence (GShard's groups; DeepSeek-V3's sequence-wise loss):
    # E x sum_e (fraction of the sequence's assignments to e) x (its mean probability of e),
    # 1 when uniform. The fractions are counts (no gradient); the probabilities train. Per
    # sequence, the loss does not depend on how a layout splits the batch into microbatches
    # and replicas (a batch-wise one would).
    assigned, length = whole_sequence_sum(load_BE, self.layout)
    fraction = assigned / (length * self.k)
    probs_sum, _ = whole_sequence_sum(probs, self.layout)
    aux_B = num_experts * jnp.sum(fraction * (probs_sum / length), axis=-1)
    z_BL = jnp.square(jax.nn.logsumexp(logits, axis=-1))  # ST-MoE router z-loss per token
    stats = {"aux_loss": aux_B, "z_loss": z_BL, "load": jnp.sum(load_BE, axis=(0, 1))}
    return ids.astype(jnp.int32), weights, stats


class Experts(nnx.Module):
  """E SwiGLU experts: gate/up [E, D, F], down [E, F, D], experts on the `experts` dim."""

  NAMES = (("experts", "embed", "mlp"), ("experts", "embed", "mlp"), ("experts", "mlp", "embed"))

  def __init__(self, cfg: ModelConfig, compute, layout, *, rngs: nnx.Rngs):
    e, d, f = cfg.moe.num_experts, cfg.embed_dim, cfg.moe.mlp_dim(cfg.mlp_dim)
    # The einsum dispatch ("dropping") runs fp8 in the Einsums (any recipe); "dropless" in its
    # grouped GEMMs (models/fp8/grouped.py: tensorwise, rowwise), so its Einsums keep no state.
    dropless = cfg.moe.dispatch == "dropless"
    compute.fp8.check_dropless_experts(cfg.moe)
    fp8 = compute.fp8.applies_to("experts")
    self.fp8_recipe = compute.fp8.recipe if fp8 else None  # plain str: static
    kw = projection_kw(cfg, compute, layout, rngs, None if dropless else "experts")
    self.gate = Einsum((e, d, f), self.NAMES[0], (1,), **kw)
    self.up = Einsum((e, d, f), self.NAMES[1], (1,), **kw)
    self.down = Einsum((e, f, d), self.NAMES[2], (1,), **kw)
    self.dtype = cfg.dtype
    # `moe.grouped_matmul` as the layout resolved it ("auto": the Pallas kernel on GPUs).
    self.grouped_impl = layout.grouped_matmul
    self.headroom = cfg.moe.exchange_capacity

  def weights(self) -> tuple[jax.Array, ...]:
    return tuple(p.w[...].astype(self.dtype) for p in (self.gate, self.up, self.down))

  def grouped(self, x_AD, group_sizes, gate, up, down, axes=ExpertAxes(), order=None, back=None):
    """Rows grouped by expert through their expert's SwiGLU (`moe.grouped_matmul`), in fp8 when
    it applies; `axes`: the mesh axes of the dropless region (sharding/expert.py). `order`,
    `back`: x's rows unsorted, sorted row i is x[order[i]] (`back` the inverse); the outputs
    in x's order."""
    impl = self.grouped_impl
    if self.fp8_recipe not in (None, *GROUPED_RECIPES):  # a dropping model run dropless
      raise ValueError(f"compute.fp8.recipe={self.fp8_recipe!r} does not run the experts' grouped"
                       f" GEMMs (dropless dispatch), which take {GROUPED_RECIPES}")
    slots = self.slots(x_AD.shape[0], gate.shape[0], axes) if impl in ("capacity", "slots") \
        else 0
    if impl == "slots":  # the whole SwiGLU on the slots (tensorwise fp8 or none)
      return slot_swiglu(x_AD, group_sizes, gate, up, down, order, back, slots,
                         SlotPrecision(self.fp8_recipe is not None, axes.every))
    if order is not None:
      sorted_out = self.grouped(permuted(x_AD, order, back), group_sizes, gate, up, down, axes)
      return permuted(sorted_out, back, order)
    if self.fp8_recipe is None:
      plain = {"pallas": grouped_matmul, "capacity": functools.partial(
          capacity_grouped, slots=slots)}.get(impl, jax.lax.ragged_dot)
      in_matmul = out_matmul = plain
    else:  # the hidden dim: gate/up's output columns, down's contraction
      every = axes.every
      in_matmul = functools.partial(quantized_grouped, self.fp8_recipe, impl, GemmAxes(
          n=axes.hidden, rows=axes.rows, every=every, slots=slots), True)
      out_matmul = functools.partial(quantized_grouped, self.fp8_recipe, impl, GemmAxes(
          k=axes.hidden, rows=axes.rows, every=every, slots=slots), False)
    hidden = jax.nn.silu(in_matmul(x_AD, gate, group_sizes))
    hidden = hidden * in_matmul(x_AD, up, group_sizes)
    return out_matmul(hidden, down, group_sizes)

  def slots(self, rows: int, experts: int, axes: ExpertAxes) -> int:
    """An expert's slots in grouped_matmul=capacity: the buffer's balanced share where an
    exchange sized the buffer with its headroom; with every expert on the device, the rows'
    balanced share times that same headroom, `exchange_capacity` (0: all the rows)."""
    if axes.experts:
      return slots_per_group(rows, experts)
    return min(rows, slots_per_group(math.ceil(self.headroom * rows), experts) or rows)

  def every_token(self, x_BLD) -> jax.Array:
    """Every expert on every token, [B, L, E, D] (the dense reference)."""
    hidden = jax.nn.silu(self.gate("BLD,EDF->BLEF", x_BLD)) * self.up("BLD,EDF->BLEF", x_BLD)
    return self.down("BLEF,EFD->BLED", hidden)


def capacity(group_size: int, experts_per_token: int, num_experts: int, factor: float) -> int:
  """Slots per expert per group: factor x its fair share of the group's assignments."""
  return max(1, min(group_size, math.ceil(group_size * experts_per_token * factor / num_experts)))


def dispatch_masks(ids_BLk, weights_BLk, num_experts: int, slots: int):
  """One-hot dispatch [B, L, E, C] and combine weights [B, L, E, C]; groups are the B rows.

  Slots are handed out first-choice first (all tokens' first choices in sequence order, then the
  second choices, ...), as in GShard; assignments past an expert's C slots are dropped.
  Returns (dispatch, combine, dropped assignments).
  """
  b, l, k = ids_BLk.shape
  chosen = jax.nn.one_hot(ids_BLk, num_experts, dtype=jnp.int32)  # [B, L, k, E]
  by_choice = chosen.transpose(0, 2, 1, 3).reshape(b, k * l, num_experts)
  position = (jnp.cumsum(by_choice, axis=1) - 1).reshape(b, k, l, num_experts)
  position = jnp.sum(position.transpose(0, 2, 1, 3) * chosen, axis=-1)  # [B, L, k]
  kept = (position < slots).astype(jnp.float32)
  slot = jax.nn.one_hot(position, slots, dtype=jnp.float32) * kept[..., None]  # [B, L, k, C]
  expert = chosen.astype(jnp.float32)
  dispatch = jnp.einsum("BLkE,BLkC->BLEC", expert, slot)
  combine = jnp.einsum("BLkE,BLkC,BLk->BLEC", expert, slot, weights_BLk)
  return dispatch, combine, ids_BLk.size - jnp.sum(kept)


class MoE(nnx.Module):
  """Routed experts (+ shared experts): y = sum_k w_k expert_{i_k}(x) (+ shared(x))."""

  def __init__(self, cfg: ModelConfig, compute, layout, *, rngs: nnx.Rngs):
    m = cfg.moe
    self.router = Router(cfg, layout, rngs=rngs)
    self.experts = Experts(cfg, compute, layout, rngs=rngs)
    shared_dim = m.num_shared_experts * m.mlp_dim(cfg.mlp_dim)
    self.shared = MLP(dataclasses.replace(cfg, mlp_dim=shared_dim, moe=None), compute, layout,
                      rngs=rngs) if shared_dim else None
    self.num_experts, self.k = m.num_experts, m.experts_per_token
    self.dispatch, self.capacity_factor = m.dispatch, m.capacity_factor
    self.layout = layout  # the dropless region's mesh, exchange and pipeline stage
    self.dtype = cfg.dtype

  def __call__(self, x_BLD: jax.Array, dispatch: str | None = None):
    """Returns (y [B, L, D], stats {aux_loss [B], z_loss [B, L], dropped, load [E]}).

    Args:
      x_BLD: the normed residual stream.
      dispatch: "dropping", "dropless" or "dense" (every expert on every token: the reference);
        default: the configured one.
    """
    ids, weights, stats = self.router(x_BLD)
    dispatch = dispatch or self.dispatch
    dropped = jnp.zeros((), jnp.float32)
    if dispatch == "dropping":
      y, dropped = self._dropping(x_BLD, ids, weights)
    elif dispatch == "dropless":
      y = dropless_experts(self.layout, self.experts.grouped, x_BLD.astype(self.dtype), ids,
                           weights, self.experts.weights(), Experts.NAMES,
                           num_experts=self.num_experts, partial_over="mlp",
                           check_vma=self.experts.grouped_impl != "pallas")
    elif dispatch == "dense":
      mix = jnp.sum(jax.nn.one_hot(ids, self.num_experts) * weights[..., None], axis=2)
      y = jnp.einsum("BLE,BLED->BLD", mix.astype(self.dtype), self.experts.every_token(x_BLD))
    else:
      raise ValueError(f"unknown MoE dispatch {dispatch!r}")
    if self.shared is not None:
      y = y + self.shared(x_BLD)
    return y, dict(stats, dropped=dropped)

  def _dropping(self, x_BLD, ids, weights):
    """GShard: dispatch einsum to [E, B, C, D], experts, combine einsum. With experts on the
    `expert` axis and tokens on the batch axes, XLA turns the two layout changes into
    all-to-alls (forward and backward)."""
    slots = capacity(x_BLD.shape[1], self.k, self.num_experts, self.capacity_factor)
    dispatch, combine, dropped = dispatch_masks(ids, weights, self.num_experts, slots)
    x = jnp.einsum("BLEC,BLD->EBCD", dispatch.astype(self.dtype), x_BLD.astype(self.dtype))
    # all-to-all to the experts. Named, so remat="none" keeps the exchanged values for the
    # backward instead of exchanging again (models/compute.py: it keeps named values).
    x = checkpoint_name(constrain(constrain(x, AT_TOKENS), AT_EXPERTS), "expert_inputs")
    # The experts' einsums carry a batch dim (E): named, so remat="none" keeps them.
    gate, up = (checkpoint_name(constrain(f("EBCD,EDF->EBCF", x), AT_EXPERTS_HIDDEN), name)
                for f, name in ((self.experts.gate, "expert_gate"), (self.experts.up, "expert_up")))
    hidden = jax.nn.silu(gate) * up
    out = constrain(self.experts.down("EBCF,EFD->EBCD", hidden), AT_EXPERTS)
    out = checkpoint_name(constrain(out, AT_TOKENS), "expert_outputs")  # all-to-all back
    return jnp.einsum("BLEC,EBCD->BLD", combine.astype(self.dtype), out), dropped
