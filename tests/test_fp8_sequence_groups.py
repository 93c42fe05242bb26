"""compute.fp8.sequences_per_scale: tensorwise fp8 with one scale per group of consecutive
sequences (a device's micro-batch, as torchao's Float8 and Transformer Engine scale each rank's),
models/layers.py's Einsum. A group is scaled as one sequence of its tokens; layouts holding
whole groups train like one device; the weight gradient's GEMM sums a group's sequences itself."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import llama
from models.fp8.config import Fp8Config
from models.layers import Einsum
from sharding import MeshConfig
from sharding.mesh import LayoutError
from sharding.xla import compiled
from tests import parallel_harness as harness
from tests.test_parallel import LOSS_RTOL
from trainer.aot import compile_for_gpus

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EQN = "BLD,DF->BLF"


def projection(group: int) -> Einsum:
  fp8 = Fp8Config(enabled=True, recipe="tensorwise", sequences_per_scale=group)
  return Einsum((32, 48), ("embed", "mlp"), (0,), param_dtype=jnp.float32, dtype=jnp.float32,
                rngs=nnx.Rngs(0), fp8=fp8)


def test_a_group_is_scaled_as_one_sequence_of_its_tokens():
  """sequences_per_scale=2 on 4 sequences: the output and both gradients equal per-sequence
  scaling of the 2 groups laid end to end (whose own recipe tests/test_fp8_recipes.py holds to a
  numpy simulation), and differ from per-sequence scaling where a group's sequences differ."""
  x = jax.random.normal(jax.random.key(1), (4, 8, 32)) * jnp.asarray([1, 30, 1, 1])[:, None, None]
  cotangent = jax.random.normal(jax.random.key(2), (4, 8, 48))

  def value_and_grads(module, x, as_groups):
    graph, params = nnx.split(module)
    def f(params, x):
      xs = x.reshape(2, 16, 32) if as_groups else x
      return jnp.sum(nnx.merge(graph, params)(EQN, xs).reshape(4, 8, 48) * cotangent)
    return jax.value_and_grad(f, argnums=(0, 1))(params, x)

  grouped = value_and_grads(projection(2), x, as_groups=False)
  laid_end_to_end = value_and_grads(projection(1), x, as_groups=True)
  per_sequence = value_and_grads(projection(1), x, as_groups=False)
  for got, want in zip(jax.tree.leaves(grouped), jax.tree.leaves(laid_end_to_end)):
    np.testing.assert_array_equal(got, want)
  assert not np.allclose(grouped[1][1], per_sequence[1][1], rtol=1e-3)  # the scales differ


def test_sequences_per_scale_is_checked_in_one_line():
  with pytest.raises(ValueError, match="sequences_per_scale=0 must be 1"):
    Fp8Config(enabled=True, recipe="tensorwise", sequences_per_scale=0).validate()
  with pytest.raises(ValueError, match="more with recipe 'tensorwise'"):
    Fp8Config(enabled=True, recipe="rowwise", sequences_per_scale=2).validate()
  fp8 = Fp8Config(enabled=True, recipe="tensorwise", sequences_per_scale=4)
  compute = dataclasses.replace(harness.COMPUTE, fp8=fp8)
  # 32 sequences over data=4 x fsdp=2 in 2 microbatches: 2 a device, which 4 does not divide.
  with pytest.raises(LayoutError, match="does not divide the 2 sequences each device takes"):
    harness.run(MeshConfig(data=4, fsdp=2), compute=compute, microbatches=2)
  with pytest.raises(LayoutError, match="not proven under context parallelism in the load-bal"):
    harness.run(MeshConfig(data=2, context=2, fsdp=2), compute=compute)


# Run in the default build, not the suite's LLVM -O0 (as tests/test_fp8_recipes.py's training).
_TRAINING = """
import dataclasses, json, sys, jax
from models.fp8.config import Fp8Config
from sharding import MeshConfig
from tests import parallel_harness as harness
def compute(group):
  fp8 = Fp8Config(enabled=True, recipe="tensorwise", sequences_per_scale=group)
  return dataclasses.replace(harness.COMPUTE, fp8=fp8, context_impl="ulysses")
one = lambda group: harness.run(MeshConfig(data=1), devices=jax.devices()[:1],
                                compute=compute(group)).losses
got = harness.run(MeshConfig(**json.loads(sys.argv[1])), compute=compute(4)).losses
print(json.dumps([one(1), one(4), got]))
"""


@pytest.mark.parametrize("layout", [
    pytest.param(dict(data=2, fsdp=2, tensor=2), marks=pytest.mark.slow),
    dict(data=2, context=2, tensor=2, sequence_parallel=True)])
def test_groups_train_like_one_device(layout):
  """Groups of 4 (16 or 8 sequences a device) vs one device with groups of 4, 3 AdamW steps, at
  tests/test_fp8_recipes.py's fp8 tolerances (the first loss at test_parallel's, the later ones
  within 2e-3); one device trains groups of 4 otherwise than of 1. The second layout splits
  each sequence over context (Ulysses) x tensor: q, k and v's shared fp8 input is gathered, and
  its gradient reduce-scattered, in groups."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  result = subprocess.run([sys.executable, "-c", _TRAINING, json.dumps(layout)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=900,
                          check=False)
  assert result.returncode == 0, result.stderr[-2000:]
  per_sequence, want, got = json.loads(result.stdout.strip().splitlines()[-1])
  assert not np.allclose(per_sequence[1:], want[1:], rtol=1e-6)  # the variants differ
  np.testing.assert_allclose(got[0], want[0], rtol=LOSS_RTOL)
  np.testing.assert_allclose(got, want, rtol=2e-3)


def weight_gradient_products(group: int, tmp_path) -> list[str]:
  """The bf16 [2, D, F] / [2, F, D] arrays of a 2-layer debug Llama's fp8 step on 8 H100s
  (fsdp=8, 2 sequences a device): one weight-gradient product per sequence, before their sum."""
  cfg = llama.debug()
  cfg.model = dataclasses.replace(cfg.model, num_layers=2, dtype="bfloat16")
  cfg.compute.fp8 = Fp8Config(enabled=True, recipe="tensorwise", sequences_per_scale=group)
  cfg.mesh, cfg.batch_size, cfg.seq_len = MeshConfig(data=1, fsdp=8), 16, 64
  path = tmp_path / f"group_{group}.hlo"
  compile_for_gpus(cfg, compiled.parse_gpu_target("h100x8"), str(path))
  d, f = cfg.model.embed_dim, cfg.model.mlp_dim
  shapes = (f"bf16[2,{d},{f}]", f"bf16[2,{f},{d}]")
  return [line.split(" = ")[0].strip() for line in path.read_text().splitlines()
          if re.search(r"= \(?(" + "|".join(re.escape(s) for s in shapes) + r")", line)]


def gradient_dots(group: int) -> list[tuple[int, ...]]:
  """Output shapes of the dots in one projection's gradient on 2 sequences."""
  graph, params = nnx.split(projection(group))
  x = jax.random.normal(jax.random.key(1), (2, 8, 32))
  grad = jax.grad(lambda p: jnp.sum(nnx.merge(graph, p)(EQN, x) ** 2))
  jaxpr = jax.make_jaxpr(grad)(params)
  return [tuple(e.outvars[0].aval.shape) for e in dot_equations(jaxpr.jaxpr)]


def dot_equations(jaxpr) -> list:
  """dot_general equations of a jaxpr and of the jaxprs nested in its equations."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      found.append(eqn)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found += dot_equations(sub)
  return found


def test_the_weight_gradient_gemm_sums_a_groups_sequences():
  """Per-sequence scales: the weight gradient is one product per sequence ([2, D, F]), summed
  after their division by the scales. With the 2 sequences one group, the GEMM contracts over
  both and writes [1, D, F]."""
  assert (2, 32, 48) in gradient_dots(1)
  assert (2, 32, 48) not in gradient_dots(2) and (1, 32, 48) in gradient_dots(2)


@pytest.mark.slow
def test_the_h100_programs_weight_gradients_sum_a_groups_sequences(tmp_path):
  """The same in the debug Llama's 8xH100 program at 2 sequences a device (fsdp=8): per
  sequence, the MLP's weight-gradient GEMMs write bf16 [2, D, F] products; with the device's 2
  sequences one group, no such array is left."""
  assert weight_gradient_products(1, tmp_path)
  assert not weight_gradient_products(2, tmp_path)
