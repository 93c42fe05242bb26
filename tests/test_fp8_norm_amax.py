"""Tensorwise fp8 scales of a norm's output taken from per-token statistics of its input
(models/layers.py RMSNorm.sequence_amax; what that leaves out of the H100 program:
tests/test_fp8_h100_program.py).

Tolerances: in float32 the amax is the max of the norm's output to 2 units in the last place (the
products r·x·w are rounded in another order); in bf16, after rounding to the compute dtype as
the output's elements are, equal (a differing rounding needs a float32 product within 2 ulps of
a bf16 rounding boundary: about one amax in 2^15, none with these seeds).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.fp8.current import quantized_einsum
from models.layers import RMSNorm

F32_ULP = 2.0 ** -23


def norm_and_input(dtype, seed=0):
  """A norm over 64 channels with a learned scale, and x [3, 16, 64]: a token whose root mean
  square one element makes in sequence 0, a sequence of zeros (amax 0: scale 1) in sequence
  2."""
  rng = np.random.default_rng(seed)
  norm = RMSNorm(64, 1e-5, param_dtype=jnp.float32, dtype=dtype)
  norm.scale[...] = jnp.asarray(rng.uniform(0.2, 2.0, 64), jnp.float32)
  x = rng.normal(size=(3, 16, 64)).astype(np.float32)
  x[0, 5, 7] = 300.0
  x[2] = 0.0
  return norm, jnp.asarray(x, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sequence_amax_is_the_max_of_the_norms_output_per_sequence(dtype):
  for seed in range(4):
    norm, x = norm_and_input(dtype, seed)
    expected = np.asarray(jnp.max(jnp.abs(norm(x)), axis=(1, 2)), np.float32)
    got = np.asarray(norm.sequence_amax(x), np.float32)
    assert norm.sequence_amax(x).dtype == dtype and got.shape == (3,)
    assert expected[2] == got[2] == 0.0 and expected[0] > expected[1] > 0  # each its own
    if dtype == jnp.float32:
      np.testing.assert_allclose(got, expected, rtol=2 * F32_ULP)
    else:
      np.testing.assert_array_equal(got, expected)


def test_a_projection_scaled_by_the_norms_amax_equals_one_taking_its_own():
  """bf16: the forward, dx and dw of a tensorwise projection of norm(x), given the norm's amax,
  equal the projection that takes the amax of its input itself, bit for bit."""
  norm, x = norm_and_input(jnp.bfloat16)
  w = jnp.asarray(np.random.default_rng(1).normal(size=(64, 32)) * 0.1, jnp.bfloat16)

  def step(amax_from_norm):
    def loss(x, w):
      h = norm(x)
      amax = norm.sequence_amax(x) if amax_from_norm else None
      y = quantized_einsum("tensorwise", "BLD,DF->BLF", h, w, None, amax)
      return jnp.sum(y.astype(jnp.float32) ** 2), y
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)

  (_, y_given), (dx_given, dw_given) = step(True)
  (_, y_own), (dx_own, dw_own) = step(False)
  float32 = np.asarray(jnp.einsum("BLD,DF->BLF", norm(x).astype(jnp.float32),
                                  w.astype(jnp.float32)))
  assert not np.allclose(np.asarray(y_own, np.float32), float32, rtol=1e-3)  # fp8 for real
  for given, own in ((y_given, y_own), (dx_given, dx_own), (dw_given, dw_own)):
    np.testing.assert_array_equal(np.asarray(given, np.float32), np.asarray(own, np.float32))
