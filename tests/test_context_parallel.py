"""Context parallelism: ring and all-gather attention over `context`, with the load-balanced
(zigzag) sequence order, equal to one device; constant memory per device; the ring's traffic."""

import collections
import dataclasses

import jax
import numpy as np
import pytest

from models import ModelConfig
from sharding import MeshConfig
from sharding.xla import hlo
from sharding.context_parallel import zigzag_permutation
from tests import parallel_harness as harness
from tests.test_parallel import GRAD_RTOL, assert_same_training, reference  # noqa: F401
from trainer.config import DataConfig, TrainConfig
from trainer.trainer import Trainer

ALLGATHER = dataclasses.replace(harness.MODEL, context_impl="allgather")


@pytest.mark.parametrize("mesh,options", [
    (dict(context=8), {}),
    (dict(context=4, data=2), {}),
    (dict(context=2, fsdp=2, tensor=2), {}),
    (dict(context=2, fsdp=2, data=2), dict(microbatches=2, remat="full")),
    (dict(context=2, fsdp=2, data=2), dict(microbatches=4)),
    (dict(context=2, tensor=2, data=2, sequence_parallel=True), {}),
    (dict(context=8), dict(model=ALLGATHER)),
], ids=["context=8", "context=4,data=2", "context=2,fsdp=2,tensor=2",
        "context=2,fsdp=2,data=2,ga=2,remat", "context=2,fsdp=2,data=2,ga=4",
        "context=2,tensor=2,sp,data=2",
        "context=8,allgather"])
def test_context_parallel_equals_one_device(mesh, options, reference):  # noqa: F811
  """Causal attention over packed sequences (2 documents per row) with the sequence split."""
  assert_same_training(harness.run(MeshConfig(**{"data": 1, **mesh}), **options), reference)


def test_ring_and_allgather_agree():
  ring = harness.run(MeshConfig(data=1, context=8))
  gathered = harness.run(MeshConfig(data=1, context=8), model=ALLGATHER)
  for a, b in zip(ring.grads, gathered.grads):
    assert np.linalg.norm(a - b) <= GRAD_RTOL * np.linalg.norm(b)


@pytest.mark.parametrize("parts", [2, 4, 8])
def test_zigzag_balances_causal_work(parts):
  """Score blocks (query chunk, key chunk) a device must compute under the causal mask: equal
  within 1 across devices in the zigzag order; a contiguous split would be lopsided."""
  chunks, size = 2 * parts, 4
  order = zigzag_permutation(chunks * size, parts)
  assert sorted(order) == list(range(chunks * size))

  def work(device_positions):
    query_chunks = set(device_positions // size)
    return sum(q + 1 for q in query_chunks)  # key chunks 0..q are (partly) visible

  per_device = order.reshape(parts, -1)
  zigzag_work = [work(p) for p in per_device]
  assert max(zigzag_work) - min(zigzag_work) <= 1
  contiguous = [work(p) for p in np.arange(chunks * size).reshape(parts, -1)]
  assert max(contiguous) - min(contiguous) > 1


MEMORY_MODEL = ModelConfig(vocab_size=264, embed_dim=64, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=16, mlp_dim=128)


def compiled(seq_len, mesh, devices):
  cfg = TrainConfig(model=MEMORY_MODEL, mesh=mesh, data=DataConfig(source="synthetic"),
                    batch_size=1, seq_len=seq_len)
  trainer = Trainer(cfg, devices)
  with trainer.context():
    return trainer.train_step.lower(trainer.abstract_state, trainer.abstract_batch()).compile()


def test_memory_per_device_stays_constant_and_ring_traffic_matches():
  """seq 8192 over context=8 needs the temporaries of seq 1024 on one device (within 1.3x;
  measured 1.04x), and the ring moves exactly 2 (N-1) (K + V block bytes) per layer: N-1 hops
  forward (K and V) and N-1 backward (their gradients)."""
  short = compiled(1024, MeshConfig(data=1), jax.devices()[:1]).memory_analysis()
  ring = compiled(8192, MeshConfig(data=1, context=8), jax.devices())
  long_temp = ring.memory_analysis().temp_size_in_bytes
  assert long_temp <= 1.3 * short.temp_size_in_bytes, (long_temp, short.temp_size_in_bytes)
  permutes = [c for c in hlo.collectives(ring.as_text()) if c.kind == "collective-permute"]
  hops = 8 - 1
  block = 1 * 1024 * MEMORY_MODEL.num_kv_heads * MEMORY_MODEL.head_dim * 4  # one K or V block
  layers = MEMORY_MODEL.num_layers
  assert sum(c.count for c in permutes) == layers * 2 * (2 * hops)  # K and V, both directions
  assert sum(c.bytes * c.count for c in permutes) == layers * 2 * hops * (2 * block)
  assert collections.Counter(c.bytes for c in permutes) == {block: len(permutes)}


def test_sequence_must_split_into_two_chunks_per_device():
  cfg = TrainConfig(model=MEMORY_MODEL, mesh=MeshConfig(data=1, context=8),
                    data=DataConfig(source="synthetic"), batch_size=1, seq_len=8 * 3)
  with pytest.raises(ValueError, match=r"seq_len=24 is not divisible by 2 x context"):
    Trainer(cfg)


def test_accumulation_with_the_sequence_split_reduces_over_data_once_per_step():
  """context=2 x data=4, 4 microbatches: each data-parallel replica accumulates its own partial
  gradients (the context attention runs inside the replicas' vmap), so the reductions over the
  4 data replicas run once per step, outside the microbatch loop, and move what the program
  without accumulation moves; only the reductions over context (group of 2) run per
  microbatch."""
  def data_reductions(microbatches):
    compiled = harness.compile_step(MeshConfig(data=4, context=2), microbatches=microbatches)
    return [c for c in hlo.collectives(compiled.as_text())
            if c.kind == "all-reduce" and c.group_size == 4]
  once, accumulated = data_reductions(1), data_reductions(4)
  assert accumulated and all(c.count == 1 for c in accumulated)
  assert sum(c.bytes for c in accumulated) == pytest.approx(
      sum(c.bytes * c.count for c in once), rel=0.001)
