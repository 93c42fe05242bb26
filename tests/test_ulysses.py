"""Ulysses and USP context parallelism (kernels/ulysses.py, sharding/context_parallel.py): the
kernels against kernels/reference.py with packed documents, GQA replication, MLA's v head dim and
windows; the real train step equal to one device (tests/test_parallel.py's tolerances) under
Ulysses, with GQA, and the hybrid; the compiled all-to-all bytes equal to the analytic model's;
the one-line layout errors."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from kernels import ulysses_attention, ulysses_ring_attention
from kernels.ring_attention import ring_hops
from kernels.ulysses import kv_repeats
from models.config import MLAConfig
from sharding import LayoutError, MeshConfig, layout_of
from sharding.context_parallel import RING_AXIS, ULYSSES_AXIS, zigzag_permutation
from sharding.layout import Layout
from sharding.plan import estimate, hardware, planner
from sharding.xla import hlo
from tests import parallel_harness as harness
from tests.test_context_parallel import assert_close, reference_attention, value_and_grads
from tests.test_parallel import assert_same_training, reference  # noqa: F401

ULYSSES = dataclasses.replace(harness.COMPUTE, context_impl="ulysses")
HYBRID = dataclasses.replace(harness.COMPUTE, context_impl="ulysses_ring", ulysses_degree=4)
# 2 kv heads: fewer than every Ulysses degree below, so they are replicated.
GQA = dataclasses.replace(harness.MODEL, num_kv_heads=2)

# ---- the kernels alone: rows of 32 tokens over 4 devices, two packed documents per row ----

PARTS, ROW = 4, 32


def kernel_inputs(heads=4, kv_heads=2, v_dim=8, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (2, ROW, heads, 8))
  k = jax.random.normal(keys[1], (2, ROW, kv_heads, 8))
  v = jax.random.normal(keys[2], (2, ROW, kv_heads, v_dim))
  index, cut = np.arange(ROW)[None], np.asarray([[11], [21]])  # cuts inside device blocks
  positions = jnp.asarray(np.where(index < cut, index, index - cut), jnp.int32)
  segments = jnp.asarray(np.where(index < cut, 1, 2), jnp.int32)
  return q, k, v, positions, segments


def whole_sequence(q, k, v, positions, segments, *, window):
  """What Ulysses runs between its all-to-alls: the reference over whole sequences."""
  return reference_attention(q, k, v, positions, segments, window)


def sharded(kernel, axes, shape, order=None, **kw):
  """`kernel` over a mesh of `shape` devices named `axes` (all splitting the sequence), taking
  and returning whole [B, ROW, ...] arrays in the natural order; `order`: the sequence order the
  devices hold (default contiguous)."""
  mesh = Mesh(np.asarray(jax.devices()[:int(np.prod(shape))]).reshape(shape), axes)
  tokens = P(None, axes if len(axes) > 1 else axes[0])
  name = axes if len(axes) > 1 else axes[0]
  mapped = jax.shard_map(functools.partial(kernel, axis_name=name, **kw), mesh=mesh,
                         in_specs=(tokens,) * 5, out_specs=tokens)
  if order is None:
    return mapped
  return lambda *a: jnp.take(mapped(*(jnp.take(x, order, axis=1) for x in a)),
                             np.argsort(order), axis=1)


def test_kv_heads_fewer_than_the_degree_are_replicated():
  assert kv_repeats(8, 4) == 1 and kv_repeats(2, 4) == 2 and kv_repeats(1, 8) == 8
  assert kv_repeats(6, 4) == 2  # 12 kv heads: 3 a device


@pytest.mark.parametrize("heads,kv_heads,v_dim,window", [
    (4, 4, 8, 0), (4, 2, 8, 0), (8, 1, 8, 0), (4, 4, 4, 0), (8, 2, 8, 5)],
    ids=["mha", "gqa-2-kv-heads", "mqa", "mla-v-head-dim", "gqa-window"])
def test_ulysses_kernel_equals_the_reference(heads, kv_heads, v_dim, window):
  """Forward and gradients over 4 devices in the contiguous order, packed documents; kv heads
  fewer than 4 are replicated; MLA's v head dim (4) other than q's (8); a window of 5."""
  inputs = kernel_inputs(heads, kv_heads, v_dim)
  want = value_and_grads(lambda *a: reference_attention(*a, window), inputs)
  got = value_and_grads(sharded(ulysses_attention, ("context",), (PARTS,), window=window,
                                attend=whole_sequence), inputs)
  assert_close(got, want)


def test_packed_documents_stay_isolated():
  """The documents change the result (the comparison means something), and a token's output
  does not depend on the other document's tokens."""
  q, k, v, positions, segments = kernel_inputs()
  ulysses = jax.jit(sharded(ulysses_attention, ("context",), (PARTS,), attend=whole_sequence))
  packed = ulysses(q, k, v, positions, segments)
  one_document = ulysses(q, k, v, jnp.broadcast_to(jnp.arange(ROW), positions.shape),
                         jnp.ones_like(segments))
  second = np.asarray(segments) == 2
  assert not np.allclose(np.asarray(packed)[second], np.asarray(one_document)[second])
  first = ~second
  k2 = jnp.where(jnp.asarray(first)[..., None, None], k, -k)  # the second document's keys
  changed = ulysses(q, k2, v, positions, segments)
  np.testing.assert_array_equal(np.asarray(changed)[first], np.asarray(packed)[first])
  assert not np.allclose(np.asarray(changed)[second], np.asarray(packed)[second])


@pytest.mark.parametrize("shape,zigzag,window", [((2, 2), True, 0), ((2, 2), False, 0),
                                                  ((4, 2), False, 6)],
                         ids=["2x2-zigzag", "2x2-contiguous", "4x2-contiguous-window"])
def test_the_hybrid_kernel_equals_the_reference(shape, zigzag, window):
  """USP on ring positions x Ulysses devices, GQA with 2 kv heads over 4 query heads: in the
  zigzag order over all devices (ring position o of R holds chunks o and 2R-1-o at the Ulysses
  degree's grain) and in the contiguous one, where a window of 6 (< a ring block of 8) cuts the
  ring of 4 positions to 1 hop."""
  inputs = kernel_inputs()
  assert ring_hops(shape[0], ROW // shape[0], window, contiguous=not zigzag) == (
      1 if window else shape[0] - 1)
  order = zigzag_permutation(ROW, int(np.prod(shape))) if zigzag else None
  want = value_and_grads(lambda *a: reference_attention(*a, window), inputs)
  got = value_and_grads(sharded(ulysses_ring_attention, (RING_AXIS, ULYSSES_AXIS), shape,
                                order, window=window, contiguous=not zigzag), inputs)
  assert_close(got, want)


# ---- the real train step, equal to one device ----


@pytest.fixture(scope="module")
def gqa_reference():
  return harness.run(MeshConfig(data=1), devices=jax.devices()[:1], model=GQA)


@pytest.mark.parametrize("mesh,compute,options", [
    (dict(context=8), ULYSSES, {}),
    (dict(context=4, data=2), ULYSSES, {}),
    (dict(context=8), HYBRID, {}),
    pytest.param(dict(context=4, data=2), dataclasses.replace(HYBRID, ulysses_degree=2),
                 dict(microbatches=2), marks=pytest.mark.slow),
], ids=["ulysses,context=8", "ulysses,context=4,data=2", "hybrid,ring=2xulysses=4",
        "hybrid,ring=2xulysses=2,data=2,ga=2"])
def test_ulysses_trains_like_one_device(mesh, compute, options, reference):  # noqa: F811
  """Packed documents (2 a row); with 16 heads / 8 kv heads, 2 q and 1 kv head a device under
  context=8. The hybrid's ring runs over 2 positions of 4 (or 2) Ulysses devices; with 2
  microbatches it runs inside the data-parallel replicas' vmap."""
  assert_same_training(harness.run(MeshConfig(**{"data": 1, **mesh}), compute=compute,
                                   **options), reference)


@pytest.mark.parametrize("mesh,compute", [
    (dict(context=8), ULYSSES),
    (dict(context=4, tensor=2), ULYSSES),
    pytest.param(dict(context=8), HYBRID, marks=pytest.mark.slow),
], ids=["context=8", "context=4,tensor=2", "hybrid,ring=2xulysses=4"])
def test_ulysses_with_replicated_kv_heads_trains_like_one_device(mesh, compute, gqa_reference):
  """2 kv heads: 8 copies of each under context=8 (1 a device), 4 of the 1 a tensor shard holds
  under context=4 x tensor=2, 2 under the hybrid's Ulysses 4."""
  assert_same_training(harness.run(MeshConfig(data=1, **mesh), model=GQA, compute=compute),
                       gqa_reference)


WINDOWED = dataclasses.replace(harness.MODEL, sliding_window=5)


@pytest.fixture(scope="module")
def window_reference():
  return harness.run(MeshConfig(data=1), devices=jax.devices()[:1], model=WINDOWED)


@pytest.mark.slow
@pytest.mark.parametrize("compute", [ULYSSES, dataclasses.replace(HYBRID, ulysses_degree=2)],
                         ids=["ulysses", "hybrid,ring=4xulysses=2"])
def test_a_sliding_window_trains_like_one_device(compute, window_reference):
  """A window of 5 under context=8, in the contiguous order: Ulysses' kernel masks it by index
  over whole sequences; the hybrid's ring (4 positions of 4 tokens) runs 1 hop of 3."""
  assert_same_training(harness.run(MeshConfig(data=1, context=8), model=WINDOWED,
                                   compute=compute), window_reference)


def test_ulysses_runs_the_pallas_flash_kernel_like_one_device(reference):  # noqa: F811
  """The Pallas flash kernel (interpreted on CPU) between the all-to-alls, context=4 x data=2,
  against one device running the XLA reference."""
  compute = dataclasses.replace(ULYSSES, attention_impl="pallas_flash")
  assert_same_training(harness.run(MeshConfig(data=2, context=4), compute=compute), reference)


@pytest.mark.slow
def test_mla_with_a_window_trains_like_one_device_under_ulysses():
  """MLA (v's head dim 4, q/k's 10; 16 heads, 2 a device) with a window of 5, Ulysses over 8."""
  model = dataclasses.replace(harness.MODEL, num_kv_heads=16, head_dim=10, sliding_window=5,
                              mla=MLAConfig(q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=6,
                                            qk_rope_head_dim=4, v_head_dim=4))
  ref = harness.run(MeshConfig(data=1), devices=jax.devices()[:1], model=model, compute=ULYSSES)
  assert_same_training(harness.run(MeshConfig(data=1, context=8), model=model, compute=ULYSSES),
                       ref)


# ---- what the compiled program sends ----


def all_to_all_bytes(compiled) -> tuple[int, set]:
  """(bytes per step of every all-to-all, their group sizes) of a compiled program."""
  ops = [c for c in hlo.collectives(compiled.as_text()) if c.kind == "all-to-all"]
  return sum(c.bytes * c.count for c in ops), {c.group_size for c in ops}


def predicted(model, compute, mesh: MeshConfig) -> dict:
  """{kind: (payload bytes per step, group size)} of the analytic model (float32, context)."""
  layout = layout_of(mesh, 8, model, compute, batch_size=harness.BATCH, seq_len=harness.SEQ)
  precision = estimate.trainer_precision("float32")
  return {c.kind: (c.payload * c.count, c.group) for c in
          hardware.collectives(estimate.model_spec(model, compute), layout, harness.SEQ,
                               precision) if c.phase == "context"}


@pytest.mark.parametrize("model,kv_heads", [
    (harness.MODEL, 8), pytest.param(GQA, 8, marks=pytest.mark.slow)], ids=["kv=8", "kv=2x4"])
def test_compiled_all_to_all_bytes_are_the_predicted_ones(model, kv_heads):
  """context=8: per layer, q, k, v and the output forward and their gradients backward, each a
  device's [B, L/8, heads, 8] float32 buffer: 16 query heads, 8 kv heads (GQA: 2 kv heads,
  replicated 4 times to 8, so the same bytes as without GQA). Bytes, not ops: XLA may merge."""
  compiled = harness.compile_step(MeshConfig(data=1, context=8), model=model, compute=ULYSSES)
  local = harness.BATCH * harness.SEQ // 8 * 8 * 4  # tokens x head dim x bytes, per head
  per_layer = 2 * (16 + 16 + kv_heads + kv_heads) * local
  sent, groups = all_to_all_bytes(compiled)
  assert groups == {8}
  assert sent == model.num_layers * per_layer
  assert predicted(model, ULYSSES, MeshConfig(data=1, context=8)) == {"all-to-all": (sent, 8)}


def test_the_hybrid_sends_all_to_alls_over_its_inner_factor_and_the_ring_over_the_outer():
  """Ring 2 x Ulysses 4: all-to-alls within groups of 4 (adjacent devices) of the bytes above;
  the ring passes the Ulysses-gathered K/V blocks (2 kv heads of 8, 8 tokens) between the 2
  positions: one hop forward (K, V) and one back (their gradients) per layer."""
  mesh = MeshConfig(data=1, context=8)
  compiled = harness.compile_step(mesh, compute=HYBRID)
  text = compiled.as_text()
  sent, groups = all_to_all_bytes(compiled)
  local = harness.BATCH * harness.SEQ // 8 * 8 * 4
  assert groups == {4} and sent == harness.MODEL.num_layers * 2 * (16 + 16 + 8 + 8) * local
  assert "replica_groups={{0,1,2,3},{4,5,6,7}}" in text.replace(" ", "") or \
      "replica_groups=[2,4]<=[8]" in text
  permutes = [c for c in hlo.collectives(text) if c.kind == "collective-permute"]
  block = harness.BATCH * (harness.SEQ // 2) * 2 * 8 * 4  # [B, L/2, 8/4 kv heads, 8] float32
  assert sum(c.bytes * c.count for c in permutes) == harness.MODEL.num_layers * 2 * 2 * block
  want = predicted(harness.MODEL, HYBRID, mesh)
  assert want["all-to-all"] == (sent, 4)
  assert want["p2p"][1] == 2  # the ring (the analytic model counts K/V 3 times a hop, as ring's)


# ---- what the layout and the analytic model rule out ----


def test_ulysses_layout_errors_are_one_line():
  few_heads = dataclasses.replace(harness.MODEL, num_heads=4, num_kv_heads=2)
  check = lambda model, compute=ULYSSES, **mesh: layout_of(  # noqa: E731
      MeshConfig(**{"data": 1, **mesh}), 8, model, compute, batch_size=8, seq_len=64)
  check(few_heads, context=4, data=2)
  with pytest.raises(LayoutError, match=r"Ulysses degree 8 must divide the query heads per tensor"
                     r" shard \(num_heads / tensor = 4\); kv heads fewer than the degree are"
                     r" replicated"):
    check(few_heads, context=8)
  with pytest.raises(LayoutError, match="num_heads / tensor = 2"):
    check(few_heads, context=4, tensor=2)
  with pytest.raises(LayoutError, match="ulysses_degree=3 does not divide context=8"):
    check(harness.MODEL, dataclasses.replace(HYBRID, ulysses_degree=3), context=8)
  with pytest.raises(LayoutError, match="must be 0 or context=8"):
    check(harness.MODEL, dataclasses.replace(ULYSSES, ulysses_degree=4), context=8)
  # Ulysses runs the contiguous order: one chunk a device, where the ring needs two.
  layout_of(MeshConfig(data=1, context=8), 8, harness.MODEL, ULYSSES, batch_size=8,
            seq_len=8 * 3)
  with pytest.raises(LayoutError, match="seq_len=24 is not divisible by 2 x context"):
    layout_of(MeshConfig(data=1, context=8), 8, harness.MODEL, HYBRID, batch_size=8,
              seq_len=8 * 3)


@pytest.mark.parametrize("impl,degree", [("ring", 2), ("ulysses_ring", 0), ("ulysses", -1)])
def test_the_degree_must_fit_the_impl(impl, degree):
  compute = dataclasses.replace(harness.COMPUTE, context_impl=impl, ulysses_degree=degree)
  with pytest.raises(ValueError, match=f"compute.ulysses_degree={degree} does not fit"):
    compute.validate(harness.MODEL)


def test_the_planner_and_memory_know_ulysses():
  """The planner rejects what the layout rejects (the ring inside pipeline stages too); memory counts the replicated kv heads that
  Ulysses attends (2 kv heads, degree 8: 8 copies) and Ulysses' all-to-alls, not ring hops."""
  llama = estimate.model_spec(dataclasses.replace(harness.MODEL, num_heads=4, num_kv_heads=2),
                              ULYSSES)
  assert planner.divisibility_errors(llama, Layout(context=4), 64) == []
  assert planner.divisibility_errors(llama, Layout(context=8), 64) == [
      "query heads per tensor shard 4 not divisible by the Ulysses degree 8 (kv heads fewer"
      " than it are replicated, query heads cannot be)"]
  ring_model = estimate.model_spec(harness.MODEL)
  assert planner.divisibility_errors(llama, Layout(context=2, pipeline=2), 64) == []
  assert planner.divisibility_errors(ring_model, Layout(context=2, pipeline=2), 64) == [
      "context_impl ring cannot run inside pipeline stages (allgather or ulysses can)"]
  gqa, ring = estimate.model_spec(GQA, ULYSSES), ring_model
  gqa_ring = dataclasses.replace(gqa, context_impl="ring")
  layout, fp32 = Layout(context=8), estimate.trainer_precision("float32")
  extra = estimate.memory(gqa, layout, 64, fp32).activations - \
      estimate.memory(gqa_ring, layout, 64, fp32).activations
  tokens = 64 // 8
  assert extra == ring.num_layers * tokens * 2 * (8 - 2) * ring.head_dim * 4  # k and v
  kinds = {c.kind for c in hardware.collectives(gqa, layout, 64, fp32) if c.phase == "context"}
  assert kinds == {"all-to-all"}
