"""What the fp8 dropless experts keep for their backward under remat="none" (models/compute.py's
policy over models/fp8/grouped.py's named residuals): the fp8 copy of the rows they read and the
gate and up outputs, not the fp8 copy of the down projection's input, the SwiGLU product of those
two outputs, which the backward makes again (`quantized_grouped(..., input_kept=False)`). On the
Qwen3-30B-A3B EP16 recipe that copy held [65,536, 768] per layer, 2.25 GiB over 48 layers."""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models.moe
from models.compute import REMAT_POLICIES
from models.fp8.grouped import RECIPES
from tests import parallel_harness as harness
from tests.test_fp8_experts import moe_layer
from tests.test_models import saved_residuals
from tests.test_moe_parallel import MOE


def saved_and_gradients(recipe):
  """The residuals (one "dtype[shape]" each) the MoE layer's backward reads under remat="none",
  and its parameter gradients (cotangent cos(y))."""
  graphdef, state = moe_layer(recipe)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 16, harness.MODEL.embed_dim)),
                  jnp.float32)
  policy = REMAT_POLICIES["none"]

  def loss(state):
    y = jax.checkpoint(lambda s: nnx.merge(graphdef, s)(x, "dropless")[0], policy=policy)(state)
    return jnp.sum(jnp.sin(y))

  saved = [line.split(" ")[0] for line in saved_residuals(loss, state)]
  return saved, jax.jit(jax.grad(loss))(state)


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_down_projections_fp8_input_is_made_again_not_kept(recipe, monkeypatch):
  rows = 8 * 16 * MOE.experts_per_token  # every token's k copies, sorted by expert (one device)
  hidden, embed = MOE.expert_mlp_dim, harness.MODEL.embed_dim
  kept, grads = saved_and_gradients(recipe)
  # Keeping every input (what the layer did before): the same gradients, one residual more.
  original = models.moe.quantized_grouped

  def every_input_kept(recipe, impl, axes, input_kept, *args):
    return original(recipe, impl, axes, True, *args)
  monkeypatch.setattr(models.moe, "quantized_grouped", functools.wraps(original)(every_input_kept))
  every, grads_every = saved_and_gradients(recipe)

  # The two variants differ by exactly that residual: tensorwise keeps its fp8 copy, rowwise the
  # product itself (each backward GEMM quantizes it along its own contraction).
  product = f"{'f8_e4m3fn' if recipe == 'tensorwise' else 'f32'}[{rows},{hidden}]"
  assert collections.Counter(every) - collections.Counter(kept) == {product: 1}
  assert not collections.Counter(kept) - collections.Counter(every)
  if recipe == "tensorwise":  # the rows' fp8 copy (made after an exchange) stays kept
    assert f"f8_e4m3fn[{rows},{embed}]" in kept
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_every)):
    np.testing.assert_array_equal(a, b)
