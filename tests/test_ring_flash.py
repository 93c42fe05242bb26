"""Ring attention on the Pallas flash kernel (kernels/ring_flash_attention.py), interpreted on CPU:
equal to kernels/reference.py forward and backward in the zigzag order, with packed documents,
GQA and MLA's value head dim; the XLA ring where it does not apply; a model trained under
context parallelism with the flash kernel equal to one device; and in a deviceless H100
program, the flash kernels at every hop where the XLA ring's score blocks were."""

import dataclasses
import functools
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from configs import llama
from kernels import ring_attention, ring_flash_attention
from kernels.ring_flash_attention import fits
from models import ModelConfig
from models.attention import context_kernel
from sharding import MeshConfig
from sharding.context_parallel import zigzag_permutation
from sharding.xla import compiled
from tests import parallel_harness as harness
from tests.test_context_parallel import (ROW, assert_close, kernel_inputs,
                                         reference_attention, value_and_grads)
from tests.test_parallel import assert_same_training, reference  # noqa: F401
from trainer.aot import compile_for_gpus
from trainer.trainer import Trainer

FLASH = dataclasses.replace(harness.COMPUTE, attention_impl="pallas_flash")


def zigzag_sharded(kernel, parts: int):
  """`kernel` over a context=`parts` mesh on whole [B, ROW, ...] arrays in their natural order:
  the tokens go into the zigzag order the ring flash kernel assumes, and back. (Pallas
  interpreted on CPU inside a shard_map: no varying-axes check, as sharding.shard_map_logical.)"""
  mesh = Mesh(np.asarray(jax.devices()[:parts]), ("context",))
  tokens = P(None, "context")
  mapped = jax.shard_map(functools.partial(kernel, axis_name="context"), mesh=mesh,
                         in_specs=(tokens,) * 5, out_specs=tokens, check_vma=False)
  order = zigzag_permutation(ROW, parts)
  return lambda *a: jnp.take(mapped(*(jnp.take(x, order, axis=1) for x in a)),
                             np.argsort(order), axis=1)


@pytest.mark.parametrize("parts,v_dim", [(4, 8), (2, 8), (4, 4)],
                         ids=["context=4", "context=2", "context=4,mla-v-dim"])
def test_ring_flash_equals_the_reference(parts, v_dim):
  """Two packed documents per row (cut inside device blocks), 4 query heads over 2 kv heads;
  v's head dim 4 against q's 8 is MLA's case."""
  inputs = kernel_inputs(v_dim=v_dim)
  want = value_and_grads(reference_attention, inputs)
  assert_close(value_and_grads(zigzag_sharded(ring_flash_attention, parts), inputs), want)


def test_the_xla_ring_runs_where_the_flash_ring_does_not_apply():
  """A window, the contiguous order, or halves that do not tile the kernel's blocks: the XLA
  ring (no pallas_call in the program); the zigzag full-causal case runs the kernel."""
  q, k, v, positions, segments = kernel_inputs()
  local = lambda n: (q[:, :n], k[:, :n], v[:, :n], positions[:, :n], segments[:, :n])  # noqa

  def traced(n, **kw):
    mesh = Mesh(np.asarray(jax.devices()[:1]), ("context",))
    run = jax.shard_map(functools.partial(ring_flash_attention, axis_name="context", **kw),
                        mesh=mesh, in_specs=(P(),) * 5, out_specs=P(), check_vma=False)
    return str(jax.make_jaxpr(run)(*local(n)))
  assert "pallas_call" in traced(8)
  assert fits(8) and not fits(12) and not fits(1) and fits(256) and not fits(96)
  for n, kw in ((8, dict(window=3)), (8, dict(contiguous=True)), (12, {})):
    assert "pallas_call" not in traced(n, **kw), (n, kw)
  assert traced(8, window=3) == str(jax.make_jaxpr(jax.shard_map(
      functools.partial(ring_attention, axis_name="context", window=3),
      mesh=Mesh(np.asarray(jax.devices()[:1]), ("context",)), in_specs=(P(),) * 5,
      out_specs=P(), check_vma=False))(*local(8)))


@pytest.mark.parametrize("mesh", [dict(context=4, data=2), dict(context=2, fsdp=2, tensor=2)],
                         ids=["context=4,data=2", "context=2,fsdp=2,tensor=2"])
def test_context_parallel_training_with_the_flash_ring_equals_one_device(mesh, reference):  # noqa: F811
  """The harness model (packed documents) with attention_impl=pallas_flash and the sequence split
  over `context`: the ring runs the flash kernel at every hop, training equal to one device."""
  layout = Trainer(harness.config(MeshConfig(**{"data": 1, **mesh}), compute=FLASH)).layout
  assert (layout.context_impl, layout.attention) == ("ring", "pallas_flash")
  assert context_kernel("ring", "pallas_flash") is ring_flash_attention
  assert context_kernel("ring", "xla") is ring_attention
  assert_same_training(harness.run(MeshConfig(**{"data": 1, **mesh}), compute=FLASH), reference)


def test_the_h100_program_runs_the_flash_kernel_at_every_hop():
  """A 2-layer bf16 model (4 heads of 128) at seq 8192 over context=4 x data=2, compiled for 8
  H100s without a GPU: with attention_impl=pallas_flash the ring's hops are flash kernels
  (measured: peak 386 MiB, step predicted 4.3 ms); with the XLA ring, [L, S] score blocks (813
  MiB, 17.2 ms)."""
  model = ModelConfig(vocab_size=1024, embed_dim=512, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=128, mlp_dim=1536, dtype="bfloat16")
  programs = {}
  for impl in ("pallas_flash", "xla"):
    cfg = llama.debug()
    cfg.mesh, cfg.model = MeshConfig(data=2, context=4), model
    cfg.batch_size, cfg.seq_len = 4, 8192
    cfg.compute = dataclasses.replace(cfg.compute, attention_impl=impl)
    with tempfile.TemporaryDirectory() as tmp:
      report = compile_for_gpus(cfg, compiled.parse_gpu_target("h100x8"),
                                hlo_path=os.path.join(tmp, "program.hlo"))
      programs[impl] = report, open(os.path.join(tmp, "program.hlo")).read()
  (flash, flash_text), (xla, xla_text) = programs["pallas_flash"], programs["xla"]
  assert "flash_attention_fwd" in flash_text and "flash_attention_dkv" in flash_text
  assert "flash_attention" not in xla_text
  assert flash.memory["peak"] < 0.6 * xla.memory["peak"]
  assert flash.step_time["step_s"] < 0.5 * xla.step_time["step_s"]
