"""Memory and communication of compiled train steps (8 fake CPU devices) against the playbook.

Psi is the parameter bytes (float32). Adam adds 2 Psi of moments. Formulas are stated next to
each assertion. XLA:CPU lowers a reduce-scatter as all-reduce + dynamic-slice, so on CPU the
gradient reduction of ZeRO-2/3 and the reductions of sequence parallelism appear as all-reduces;
the deviceless GPU programs (tests/test_compile.py) show the reduce-scatters.
"""

import functools
import hashlib
import os
import subprocess
import sys

import pytest

from sharding import MeshConfig
from sharding.xla import hlo
from tests import parallel_harness as harness

CFG = harness.MODEL
PSI = CFG.num_params() * 4
PSI_LAYERS = CFG.num_layers * CFG.layer_params() * 4  # the scanned stack
PSI_REST = PSI - PSI_LAYERS  # embedding, head, final norm
B, L, D = harness.BATCH, harness.SEQ, CFG.embed_dim


@functools.lru_cache(maxsize=None)
def program(microbatches=1, **mesh):
  compiled = harness.compile_step(MeshConfig(**{"data": 1, **mesh}), microbatches=microbatches)
  return compiled.memory_analysis(), hlo.collectives(compiled.as_text())


def batch_bytes(data_parallel: int) -> int:
  return 5 * B * L * 4 // data_parallel  # inputs, targets, positions, segment ids, loss mask


def payload(cols, kind) -> int:
  return sum(c.bytes * c.count for c in cols if c.kind == kind)


def wire(cols) -> float:
  return sum(c.total_wire_bytes for c in cols)


def looped(cols, kind) -> int:
  """Executions of [B, L, D] activation collectives inside the layer scans ([B·L, D] where the
  projections see token rows: no mesh axis splits the sequence, models/layers.Einsum)."""
  return sum(c.count for c in cols if c.kind == kind and c.shape in ((B, L, D), (B * L, D))
             and c.count > 1)


SP_MESH = dict(data=1, fsdp=4, tensor=2, sequence_parallel=True)
HLO_OF_THE_DEFAULT_BUILD = f"""
import hashlib
from sharding import MeshConfig
from sharding.xla import hlo
from tests import parallel_harness as harness
text = harness.compile_step(MeshConfig(**{SP_MESH!r})).as_text()
print(hashlib.sha256(hlo.without_source_info(text).encode()).hexdigest())
"""


def test_the_suites_llvm_o0_compiles_the_default_builds_hlo():
  """tests/conftest.py compiles at LLVM -O0 for speed; a fresh interpreter at XLA's default
  level emits the same optimized HLO for a sharded step, so the facts proven on programs here
  hold for the programs `meshtron` runs."""
  assert "--xla_backend_optimization_level=0" in os.environ["XLA_FLAGS"]
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  default = subprocess.run([sys.executable, "-c", HLO_OF_THE_DEFAULT_BUILD], env=env, cwd=repo,
                           capture_output=True, text=True, timeout=600, check=True)
  here = harness.compile_step(MeshConfig(**SP_MESH))
  text = hlo.without_source_info(here.as_text())
  assert "ENTRY" in text and "FileNames" not in text and "source_line" not in text
  assert hlo.collectives(text) == hlo.collectives(here.as_text())  # the program is all there
  assert default.stdout.split()[-1] == hashlib.sha256(text.encode()).hexdigest()


def test_model_is_big_enough_to_measure():
  assert PSI > 100_000 and PSI_LAYERS > PSI_REST


def test_memory_scales_as_the_zero_stage_says():
  dp, _ = program(data=8)
  zero1, _ = program(data=8, zero_stage=1)
  zero3, _ = program(data=8, zero_stage=3)
  fsdp, _ = program(fsdp=8)
  # DP: params + Adam moments whole on every device: 3 Psi.
  assert dp.argument_size_in_bytes - batch_bytes(8) == pytest.approx(3 * PSI, rel=0.01)
  # ZeRO-1: params whole, moments split 8 ways: Psi + 2 Psi / 8 (norm scales stay whole).
  assert zero1.argument_size_in_bytes - batch_bytes(8) == pytest.approx(PSI + 2 * PSI / 8,
                                                                        rel=0.02)
  # ZeRO-3: everything split 8 ways: 3 Psi / 8, within 5% of the ideal; ZeRO-3 over `data` is
  # the same program as fsdp=8.
  assert zero3.argument_size_in_bytes - batch_bytes(8) == pytest.approx(3 * PSI / 8, rel=0.05)
  assert zero3.argument_size_in_bytes == fsdp.argument_size_in_bytes
  # The donated state is aliased to the output: no second copy of it.
  assert zero3.alias_size_in_bytes >= 3 * PSI / 8


def test_data_parallel_all_reduces_the_gradients_once():
  _, cols = program(data=8)
  assert {c.kind for c in cols} == {"all-reduce"}
  # One gradient all-reduce of Psi (plus scalar metrics): wire 2 Psi (N-1)/N per device.
  assert payload(cols, "all-reduce") == pytest.approx(PSI, rel=0.001)
  assert wire(cols) == pytest.approx(2 * PSI * 7 / 8, rel=0.001)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_1_and_2_reduce_gradients_and_gather_parameters(stage):
  _, cols = program(data=8, zero_stage=stage)
  # Gradient reduction Psi, then the updated parameter shards all-gathered: Psi. Together the
  # playbook's 2 Psi (reduce-scatter + all-gather on GPU).
  assert payload(cols, "all-reduce") == pytest.approx(PSI, rel=0.002)
  assert payload(cols, "all-gather") == pytest.approx(PSI, rel=0.01)


def test_zero_3_gathers_each_layer_forward_and_backward():
  _, cols = program(data=8, zero_stage=3)
  # The scan all-gathers each layer's weights in the forward and again in the backward (they are
  # not kept whole between the passes): 2 Psi_layers; embedding and head once: Psi_rest. Plus
  # the gradient reduction Psi: about 3 Psi in all.
  assert payload(cols, "all-gather") == pytest.approx(2 * PSI_LAYERS + PSI_REST, rel=0.02)
  assert payload(cols, "all-reduce") == pytest.approx(PSI, rel=0.002)
  assert max(c.count for c in cols if c.kind == "all-gather") == CFG.num_layers


def test_fsdp_looks_up_embeddings_without_gathering_the_table():
  """When the fsdp group has fewer tokens per microbatch (32 x 16 / 4 = 128) than the table has
  rows (264), the lookup moves token rows, not the [V, D] table (sharding.rules.
  lookup_moves_rows): each device looks up its columns of the table for the group's tokens, and
  an all-to-all hands each device its tokens' full rows, B L D / 8 values a step, forward and
  (the gradient) backward. With 512 tokens per microbatch the table is gathered instead."""
  table = (CFG.vocab_size, D)
  _, whole = program(fsdp=8)
  assert [c for c in whole if c.kind == "all-gather" and c.shape == table]  # the variants differ
  assert payload(whole, "all-to-all") == 0
  _, rows = program(microbatches=4, fsdp=8)
  assert not [c for c in rows if c.shape == table]
  assert payload(rows, "all-to-all") == 2 * B * L * D * 4 // 8


def test_zero3_over_data_gathers_the_tables_data_shards_for_the_lookup():
  """ZeRO-3 over data=2 x fsdp=4 stores the table's embed dim over both axes; the lookup wants
  it over fsdp. The program gathers the table's data shards [V, D/4] (and reduces their
  gradient) over data, reorders shards with two collective-permutes of [V, D/8], and moves token
  rows over fsdp: what sharding/hardware.collectives counts for this layout."""
  _, cols = program(data=2, fsdp=4, zero_stage=3)
  v = CFG.vocab_size
  assert [c for c in cols if c.kind == "all-gather" and c.shape == (v, D // 4)
          and c.group_size == 2]
  assert [c for c in cols if c.kind == "all-reduce" and c.shape == (v, D // 4)
          and c.group_size == 2]  # a reduce-scatter on GPU (module docstring)
  assert sum(c.count for c in cols if c.kind == "collective-permute"
             and c.shape == (v, D // 8)) == 2
  assert [c for c in cols if c.kind == "all-to-all" and c.group_size == 4]
  assert not [c for c in cols if c.shape == (v, D)]  # the table is never whole


def test_vocab_over_fsdp_gathers_the_group_tokens_instead_of_the_head():
  """With the vocab split over fsdp the head [D, V] is not gathered; the group's hidden states
  are gathered instead (sharding.rules.split_vocab_over_fsdp). XLA then gathers the embedding
  table [V, D] (split over its vocab) for the lookup, as FSDP does with any weight. Whether
  that moves fewer bytes depends on tokens vs vocab: "auto" keeps it off for this model's 512
  tokens per step and 264 vocab columns."""
  _, off = program(fsdp=8)
  _, on = program(fsdp=8, vocab_over_fsdp="on")
  head = (D, CFG.vocab_size)
  assert [c for c in off if c.kind == "all-gather" and c.shape == head]  # the variants differ
  assert not [c for c in on if c.shape == head]
  assert [c for c in on if c.kind == "all-gather" and c.shape[-1] == D and c.bytes == B * L * D * 4]


def test_tensor_parallel_all_reduces_activations_twice_per_layer_each_way():
  _, cols = program(tensor=8)
  # Megatron: after attention and after the MLP in the forward, at their inputs in the
  # backward: 4 all-reduces of b x s x h per layer; nothing gathered.
  assert looped(cols, "all-reduce") == 4 * CFG.num_layers
  assert payload(cols, "all-gather") == 0


def test_sequence_parallel_turns_all_reduces_into_gathers_and_reductions():
  _, tp = program(tensor=8)
  _, sp = program(tensor=8, sequence_parallel=True)
  # Forward: all-gather before attention and MLP, reduce(-scatter) after: 2 + 2 per layer.
  # Backward: the reduce-scatters' gradients are all-gathers (2), the inputs are re-gathered
  # for the weight gradients (2), the all-gathers' gradients are reduce-scatters (2).
  assert looped(sp, "all-gather") == 6 * CFG.num_layers
  assert looped(sp, "all-reduce") == looped(tp, "all-reduce") == 4 * CFG.num_layers
  # Between the regions the residual stream is sequence-sharded: activations per device shrink.
  assert program(tensor=8, sequence_parallel=True)[0].temp_size_in_bytes < \
      program(tensor=8)[0].temp_size_in_bytes


def test_gradient_accumulation_reduces_once_per_step():
  """Data-parallel replicas accumulate their own partial gradients over the 4 microbatches and
  reduce once (as DDP's no_sync does): the same Psi as without accumulation, not 4 Psi. ZeRO-2
  keeps gradients sharded, so it reduces every microbatch: 4 Psi."""
  _, once = program(data=8)
  _, accumulated = program(data=8, microbatches=4)
  assert payload(accumulated, "all-reduce") == pytest.approx(payload(once, "all-reduce"),
                                                             rel=0.001)
  _, zero2 = program(data=8, zero_stage=2, microbatches=4)
  assert payload(zero2, "all-reduce") == pytest.approx(4 * PSI, rel=0.002)
