"""Parameters the optimizer does not train, and how the step carries them.

- fp8 amax histories (models/fp8/delayed.py): the backward pass returns their new values in the gradient
  slot. Microbatches and replicas combine them by max (an amax over the whole batch); they are
  never divided by the token count, kept out of the gradient norm, clipping and the optimizer,
  and written into the parameters after the update.
- MoE routing biases (DeepSeek-V3's aux-loss-free balancing, `expert_bias` [layers, E]): no
  gradient reaches them; after the update each moves by rate x sign(mean load - load) of the
  step's routing counts: the model's layers' by stats["moe_load"], the multi-token prediction
  modules' blocks (under `mtp`) by stats["mtp_moe_load"] [depth, E].
"""

import jax
import jax.numpy as jnp

from models.fp8.delayed import FP8_HISTORY
from models.moe import EXPERT_BIAS, update_bias


def _is_names(x) -> bool:
  return isinstance(x, tuple)


class NonGradient:
  """The masks of one model's parameter tree (its logical names), and the operations on them."""

  def __init__(self, names, bias_rate: float = 0.0):
    self.names = names
    self.is_fp8 = jax.tree.map(lambda n: n[-1] == FP8_HISTORY, names, is_leaf=_is_names)
    self.bias_rate = bias_rate

  def zeros(self, shapes, accum_dtype):
    """Accumulators for a gradient tree: fp8 histories keep their dtype, gradients the
    accumulation dtype."""
    return jax.tree.map(lambda f, s: jnp.zeros(s.shape, s.dtype if f else accum_dtype),
                        self.is_fp8, shapes)

  def combine(self, total, new):
    """Adds a microbatch's gradients to the running sums (fp8 histories: the max)."""
    return jax.tree.map(lambda f, t, n: jnp.maximum(t, n) if f else t + n.astype(t.dtype),
                        self.is_fp8, total, new)

  def reduce_replicas(self, per_replica, params):
    """Per-replica partial sums [R, ...] -> one sum in each parameter's dtype (fp8: the max)."""
    return jax.tree.map(lambda f, x, p: jnp.max(x, axis=0) if f
                        else jnp.sum(x, axis=0).astype(p.dtype), self.is_fp8, per_replica, params)

  def normalize(self, grads, tokens):
    """Summed-over-tokens gradients -> means; fp8 histories as they are."""
    return jax.tree.map(lambda f, g: g if f else g / tokens, self.is_fp8, grads)

  def split(self, grads):
    """(gradients with zeros where fp8 histories are, the new fp8 histories' tree)."""
    return jax.tree.map(lambda f, g: jnp.zeros_like(g) if f else g, self.is_fp8, grads), grads

  def apply(self, params, fp8_values, stats):
    """Parameters after the optimizer update: the new fp8 histories written in, and the routing
    biases moved by the step's expert loads (stats["moe_load"] [layers, E], when a MoE)."""
    params = jax.tree.map(lambda f, p, new: new if f else p, self.is_fp8, params, fp8_values)
    if "moe_load" in stats:
      def move(path, p, n):
        if n[-1] != EXPERT_BIAS:
          return p
        in_mtp = getattr(path[0], "key", None) == "mtp"
        load = stats["mtp_moe_load" if in_mtp else "moe_load"]  # [the stack's layers, E]
        if p.ndim < load.ndim:  # a layer stored apart (compute.scan_layers=false): its row
          load = load[path[1].key]
        return update_bias(p, load, self.bias_rate)
      params = jax.tree_util.tree_map_with_path(move, params, self.names, is_leaf=_is_names)
    return params
