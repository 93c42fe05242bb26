"""models/accumulating_scan.py: a layer scan whose backward adds each layer's weight gradient into
the gradient-accumulation buffer in place. Its "cotangent" for the buffer is the buffer plus the
gradient (by max for fp8 histories), also under the train step's replicas' vmap, and the
backward holds no second stacked gradient beside the buffer."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.accumulating_scan import accumulating_scan
from models.fp8.config import Fp8Config
from sharding import MeshConfig
from tests import parallel_harness as harness
from tests.test_moe_parallel import MOE
from tests.test_parallel import GRAD_RTOL, LOSS_RTOL, assert_same_training, relative_l2

LAYERS, DIM = 4, 8


def weights(dim=DIM, layers=LAYERS):
  keys = jax.random.split(jax.random.key(0), 3)
  return {"w": jax.random.normal(keys[0], (layers, dim, dim)) / np.sqrt(dim),
          "b": jax.random.normal(keys[1], (layers, dim)),
          "history": jax.random.normal(keys[2], (layers, 3))}


def body(h, rows):
  """A layer that a row mask may skip (the padded stacks' `present`), with a per-layer output
  that carries gradient (like the MoE's router losses)."""
  p, here = rows
  y = jnp.where(here, jnp.tanh(h @ p["w"] + p["b"][None]), h)
  return y, {"aux": jnp.sum(y ** 2) + jnp.sum(p["history"] ** 2)}


PRESENT = jnp.asarray([True, True, False, True])
X = jax.random.normal(jax.random.key(1), (2, DIM))
USE_MAX = ({"w": False, "b": False, "history": True}, None)


def loss(h, ys):
  return jnp.sum(h ** 3) + jnp.sum(ys["aux"])


def plain_loss(params):
  return loss(*jax.lax.scan(jax.checkpoint(body), X, (params, PRESENT)))


def accumulating_loss(params, acc):
  return loss(*accumulating_scan(jax.checkpoint(body), X, (params, PRESENT), (acc, None),
                                 USE_MAX))


def test_the_accumulators_cotangent_is_the_accumulator_plus_the_gradient():
  params = weights()
  acc = {"w": jnp.full((LAYERS, DIM, DIM), 0.5), "b": jnp.full((LAYERS, DIM), -1.0),
         "history": jnp.full((LAYERS, 3), 0.25)}
  grads = jax.grad(plain_loss)(params)
  assert float(jnp.abs(grads["w"][0]).max()) > 0 and not np.any(grads["w"][2])  # row 2 skipped
  assert accumulating_loss(params, acc) == plain_loss(params)
  own, new = jax.jit(jax.grad(accumulating_loss, argnums=(0, 1)))(params, acc)
  np.testing.assert_allclose(new["w"], acc["w"] + grads["w"], rtol=1e-6)
  np.testing.assert_allclose(new["b"], acc["b"] + grads["b"], rtol=1e-6)
  np.testing.assert_allclose(new["history"], np.maximum(acc["history"], grads["history"]))
  assert not any(np.any(g) for g in jax.tree.leaves(own))  # the weights' own: all in `new`

  # Under the replicas' vmap: each replica's accumulator, and no scatter (JAX batches an
  # indexed update as one, which XLA lowers with a bounds-check select that re-reads the row).
  replicas = jax.tree.map(lambda a: jnp.stack([a, 2 * a]), acc)
  step = jax.jit(jax.vmap(jax.grad(accumulating_loss, argnums=1), in_axes=(None, 0)))
  new = step(params, replicas)
  np.testing.assert_allclose(new["w"][1], 2 * acc["w"] + grads["w"], rtol=1e-6)
  np.testing.assert_allclose(new["history"][1], np.maximum(2 * acc["history"], grads["history"]))
  assert "scatter" not in step.lower(params, replicas).as_text()


def test_the_backward_holds_no_second_stacked_gradient():
  """Accumulating after plain autodiff keeps the microbatch's stacked gradient [L, D, D] beside
  the accumulator; the accumulating scan's backward adds each layer's rows in place. Both
  programs take the accumulator donated and compute the same values."""
  dim, layers = 256, 8
  params = weights(dim, layers)
  stacked = layers * dim * dim * 4
  acc = jax.tree.map(jnp.zeros_like, params)
  x = jax.random.normal(jax.random.key(1), (2, dim))

  def layer(h, p):
    return jnp.tanh(h @ p["w"] + p["b"][None]) + jnp.sum(p["history"]), None

  def after(params, acc):
    grads = jax.grad(lambda p: jnp.sum(jax.lax.scan(layer, x, p)[0] ** 2))(params)
    return jax.tree.map(jnp.add, acc, grads)

  def inside(params, acc):
    return jax.grad(lambda a: jnp.sum(accumulating_scan(
        layer, x, params, a, jax.tree.map(lambda _: False, params))[0] ** 2))(acc)

  compiled = [jax.jit(f, donate_argnums=1).lower(params, acc).compile() for f in (after, inside)]
  np.testing.assert_allclose(compiled[1](params, acc)["w"],
                             compiled[0](params, jax.tree.map(jnp.zeros_like, params))["w"],
                             rtol=1e-5, atol=1e-6)
  temp = [c.memory_analysis().temp_size_in_bytes for c in compiled]
  assert temp[0] >= stacked  # the variants differ: plain autodiff stacks the gradient
  # In place: the backward's temporaries (residuals, a layer's gradient) are a fraction of it.
  assert temp[1] < stacked / 2


def compare_storage_forms(what: str) -> None:
  """Trains the scanned and the stored-apart step 3 steps each and asserts they agree."""
  compute, moe, mesh = harness.COMPUTE, None, MeshConfig(data=2, fsdp=2, tensor=2)
  if what.startswith("fp8"):
    compute = dataclasses.replace(compute, fp8=Fp8Config(enabled=True, recipe=what.split()[1]))
  else:
    moe, mesh = MOE, MeshConfig(data=2, expert=2, tensor=2)
  runs = [harness.run(mesh, microbatches=2, moe=moe,
                      compute=dataclasses.replace(compute, scan_layers=scan))
          for scan in (True, False)]
  if what != "fp8 tensorwise":
    assert_same_training(*runs)
    return
  # The two programs add in other orders: initial gradients 1e-7 apart, parameters after one
  # step up to 1.4e-6 (measured; with one scale per tensor, before tensorwise scaled each
  # sequence, 1e-7 and 7e-7, and the 3 losses happened to agree to the last bit). fp8 turns such
  # differences into rounding flips (losses 4e-4 apart by step 3), so the later losses are held
  # to the fp8 standard of tests/test_fp8_recipes.py.
  scanned, apart = runs
  np.testing.assert_allclose(scanned.losses[0], apart.losses[0], rtol=LOSS_RTOL)
  for got, want in zip(scanned.grads, apart.grads):
    assert relative_l2(got, want) <= GRAD_RTOL
  np.testing.assert_allclose(scanned.losses, apart.losses, rtol=2e-3)


@pytest.mark.parametrize("what", ["fp8 tensorwise", "fp8 delayed", "moe"])
def test_the_train_step_accumulates_as_plain_autodiff_does(what):
  """2 microbatches: the step with the accumulating scan (the layers scanned) trains as the same
  step with the layers stored apart and unrolled (`compute.scan_layers=False`: plain autodiff,
  accumulated after each microbatch; compared in the stacked form): fp8 weights quantized
  outside the differentiated function and attached to the layers, delayed-scaling histories
  combined by max (data=2 x fsdp=2 x tensor=2), the MoE stack and its router losses (data=2 x
  expert=2 x tensor=2). The fp8 cases run in a fresh interpreter with XLA's default CPU build:
  under the suite's LLVM -O0 (tests/conftest.py) the two programs round differently by ~1e-6,
  which moves an fp8 scale, and their losses part by ~2e-4. Built as users run them, delayed
  scaling's agree to the last bit; tensorwise's, whose dw sums per-sequence products, agree
  in the first step (compare_storage_forms says how far)."""
  if not what.startswith("fp8"):
    compare_storage_forms(what)
    return
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "2",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  code = f"from tests.test_accumulating_scan import compare_storage_forms as c; c({what!r})"
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]


# Runs in a fresh interpreter with JAX_PLATFORMS=cpu and the CUDA plugin (the gpu-aot extra): an
# MLP's three weights, each with its accumulator under the replicas' vmap (one replica, as a
# device holds), the accumulating scan's backward compiled for one H100 as it is and with the
# form before (the row squeezed out of its slice and expanded back around the sum). Prints, per
# form, the in-place updates of an accumulator that take a row of it computed outside them (a
# second read and a temporary), and the memory-bound kernels' predicted seconds.
ROWS_ON_H100 = r"""
import json, re
import jax, jax.numpy as jnp
from models import accumulating_scan as scan
from sharding.plan import hardware
from sharding.xla import compiled, step_time

device = compiled.gpu_devices(compiled.parse_gpu_target("h100x1"))[0]
LAYERS, TOKENS, D, F = 4, 2048, 512, 1024
spec = lambda shape, dtype: jax.ShapeDtypeStruct(
    shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device))

def layer(h, p):
  return h + (jax.nn.silu(h @ p["gate"]) * (h @ p["up"])) @ p["down"], None

def squeezed(a, i, row):
  old = jax.lax.dynamic_index_in_dim(a, i, keepdims=False)
  return jax.lax.dynamic_update_index_in_dim(a, old + row, i, 0)

def grad(params, acc, x):
  none = jax.tree.map(lambda _: False, params)
  return jax.grad(lambda a: jnp.sum(scan.accumulating_scan(layer, x, params, a, none)[0]
                                    .astype(jnp.float32) ** 2))(acc)

params = {"gate": spec((LAYERS, D, F), jnp.bfloat16), "up": spec((LAYERS, D, F), jnp.bfloat16),
          "down": spec((LAYERS, F, D), jnp.bfloat16)}
acc = jax.tree.map(lambda s: spec((1, *s.shape), jnp.float32), params)
result = {}
for form in ("kept", "squeezed"):
  if form == "squeezed":
    scan._COMBINE_ROW[False] = squeezed
  step = jax.jit(jax.vmap(grad, in_axes=(None, 0, None)), donate_argnums=1)
  text = step.lower(params, acc, spec((TOKENS, D), jnp.bfloat16)).compile().as_text()
  updates = re.findall(r"^%\S+ \((.*)\) -> f32\[1,4,(\d+),(\d+)\]", text, re.M)
  p = step_time.predict(text, hardware.PROFILES["h100"], top=10000)
  result[form] = {
      "updates": len(updates),
      "row_from_outside": sum(f"f32[1,1,{a},{b}]" in args for args, a, b in updates),
      "memory_s": sum(o["total_s"] for o in p.top_ops if o["kind"] == "memory")}
print(json.dumps(result))
"""


def test_an_accumulators_row_is_read_inside_its_in_place_update_on_h100():
  """Each layer's weight gradient is added into its accumulator row by one in-place update
  that reads the row itself. Squeezed out of its slice and expanded back (the form before),
  XLA's GPU fusion read the three weights' rows in one fusion of their own and handed them to
  the updates: every row read twice and written to a temporary."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "2"}
  env.pop("XLA_FLAGS", None)  # fake CPU device counts do not belong in a GPU compile
  proc = subprocess.run([sys.executable, "-c", ROWS_ON_H100], capture_output=True, text=True,
                        env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  kept, before = result["kept"], result["squeezed"]
  assert kept["updates"] == before["updates"] == 3  # an in-place update per weight, each form
  assert before["row_from_outside"] == 3  # the variants differ: the waste is visible
  assert kept["row_from_outside"] == 0
  assert kept["memory_s"] < before["memory_s"]
