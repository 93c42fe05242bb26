"""The analytic model's formulas against hand-computed values, and the playbook's published numbers.

The small model: V=100, D=16, L=2, H=4 heads, K=2 kv heads, Dh=4, F=32, untied. By hand:
attention 2*16*4*4 (q, o) + 2*16*2*4 (k, v) = 768; MLP 3*16*32 = 1536; norms 2*16 = 32; a layer
2336; N = 2*100*16 (embedding, head) + 2*2336 + 16 (final norm) = 7888, of which the 80 norm
scales are never sharded (they have no embed dim) and 7808 are.
"""

import dataclasses

import pytest

from cli.presets import precision_by_name
from configs import llama, moe
from configs.llama import MODELS
from models import ComputeConfig
from models.config import ModelConfig
from models.fp8.config import Fp8Config
from sharding.plan import hardware
from sharding.layout import Layout
from sharding.plan.estimate import (FULL_FP32, GB, PLAYBOOK_MIXED, PLAYBOOK_MIXED_FP32_ACCUM,
                               ModelSpec, activation_terms, layer_activation_bytes, memory,
                               model_spec, param_counts, state_bytes, trainer_precision)
from sharding.pipeline import schedules
from sharding.pipeline.schedules import bubble_ratio, in_flight_microbatches, table_if_valid

SMALL = ModelSpec(vocab_size=100, embed_dim=16, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=4, mlp_dim=32)
SEQ = 8


def test_parameter_count_by_hand_and_equal_to_the_model_config():
  assert SMALL.layer_params() == 2336
  assert SMALL.num_params() == 7888
  counts = param_counts(SMALL, Layout())
  assert (counts.shardable, counts.replicated) == (7808, 80)
  config = ModelConfig(vocab_size=100, embed_dim=16, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=4, mlp_dim=32)
  assert model_spec(config).num_params() == config.num_params()
  # Published counts (README): Llama-3 8B 8,030,261,248; 70.55B; 405.85B.
  assert model_spec(MODELS["llama3_8b"]).num_params() == 8_030_261_248
  assert model_spec(MODELS["llama3_70b"]).num_params() == pytest.approx(70.55e9, rel=1e-3)
  assert model_spec(MODELS["llama3_405b"]).num_params() == pytest.approx(405.85e9, rel=1e-3)


def test_flops_per_token_by_hand():
  # 6 x matmul params (2 layers x (768 + 1536) + head 1600 = 6208) + 6 L H Dh s (causal).
  assert SMALL.flops_per_token(SEQ) == 6 * 6208 + 6 * 2 * 4 * 4 * SEQ == 38_784
  config = ModelConfig(vocab_size=100, embed_dim=16, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=4, mlp_dim=32)
  assert SMALL.flops_per_token(SEQ) == config.flops_per_token(SEQ)


def test_mixed_precision_state_and_zero_stages_by_hand():
  # Mixed precision: params 2N, grads 2N, fp32 master + Adam 12N.
  params, grads, opt = state_bytes(7808, 80, Layout(), PLAYBOOK_MIXED)
  assert (params, grads, opt) == (2 * 7888, 2 * 7888, 12 * 7888)
  # ZeRO-1 over dp=4: optimizer 12 x (7808/4 + 80) = 24384; ZeRO-2 also grads 2 x 2032 = 4064;
  # ZeRO-3 also params.
  assert state_bytes(7808, 80, Layout(data=4, zero_stage=1), PLAYBOOK_MIXED) == (15776, 15776, 24384)
  assert state_bytes(7808, 80, Layout(data=4, zero_stage=2), PLAYBOOK_MIXED) == (15776, 4064, 24384)
  assert state_bytes(7808, 80, Layout(data=4, zero_stage=3), PLAYBOOK_MIXED) == (4064, 4064, 24384)
  # fsdp=4 is ZeRO-3 on its own axis.
  assert state_bytes(7808, 80, Layout(fsdp=4), PLAYBOOK_MIXED) == (4064, 4064, 24384)
  # Context parallelism's devices hold the same parameters: ZeRO splits over data x context.
  assert state_bytes(7808, 80, Layout(data=2, context=2, zero_stage=1), PLAYBOOK_MIXED) == \
      (15776, 15776, 24384)
  # And expert parallelism's, for all but the routed experts' weights (say 4096 of the 7808,
  # already split by `expert`): ZeRO-1 over data=2 x expert=2 splits the other 3712 over 4 and
  # the experts' over data=2: 12 x (928 + 2048 + 80) = 36672.
  assert state_bytes(7808, 80, Layout(data=2, expert=2, zero_stage=1), PLAYBOOK_MIXED,
                     experts=4096) == (15776, 15776, 36672)
  # fp32 gradient accumulation adds 4 bytes to the gradient term: 2 + 4 per parameter.
  assert state_bytes(7808, 80, Layout(), PLAYBOOK_MIXED_FP32_ACCUM)[1] == 6 * 7888
  # ZeRO-2 over data=2 x context=2: the gradients split 4 ways, 2 x (1952 + 80) = 4064; in
  # pipeline stages, which keep each device's sums of its parts of the sequences whole
  # (Layout.stage_sequence_axes), only over data: 2 x (3904 + 80) = 7968.
  assert Layout(data=2, context=2, pipeline=2).stage_sequence_axes == ("context",)
  assert state_bytes(7808, 80, Layout(data=2, context=2, zero_stage=2),
                     PLAYBOOK_MIXED)[1] == 4064
  assert state_bytes(7808, 80, Layout(data=2, context=2, pipeline=2, zero_stage=2),
                     PLAYBOOK_MIXED) == (15776, 7968, 24384)


def test_trainer_precision_is_what_the_trainer_stores():
  """float32 params, grads and AdamW moments, no master; an accumulator only with ga > 1."""
  pr = trainer_precision("bfloat16", "float32")
  assert state_bytes(7808, 80, Layout(), pr) == (4 * 7888, 4 * 7888, 8 * 7888)
  assert state_bytes(7808, 80, Layout(microbatches=4), pr)[1] == 8 * 7888
  assert pr.act_bytes == 2


def test_tensor_and_pipeline_split_the_parameters():
  # TP=2: matrices and vocab halve, norms stay: 2 x (4608/2 + 3200/2 + 80) = 7968.
  assert memory(SMALL, Layout(tensor=2), SEQ, PLAYBOOK_MIXED).params == 7968
  # PP=2 (untied): a layer, both tables (the playbook's stage: one), its norms, the final norm.
  staged = Layout(pipeline=2, microbatches=2)
  assert memory(SMALL, staged, SEQ, PLAYBOOK_MIXED).params == 11104 == 2 * (
      2304 + 2 * param_counts(SMALL, staged).tables + 32 + 16)


def playbook_activations(layout, remat="none"):
  terms = activation_terms(SMALL, 2, "playbook")
  return layer_activation_bytes(terms, layout.micro_batch * SEQ / layout.context, SEQ, layout, remat)


def test_activation_formulas_of_the_playbook_by_hand():
  """m_act = L seq bs h (34 + 5 n_heads seq / h) (playbook, "Activations memory"; Korthikanti
  et al. 2022 Table 2 for the TP / SP / selective / full variants). Per layer, s=8, b=1, h=16,
  a=4: sbh = 128."""
  assert playbook_activations(Layout()) == 128 * (34 + 5 * 4 * 8 / 16) == 5632
  full = memory(SMALL, Layout(), SEQ, PLAYBOOK_MIXED, formula="playbook", workspace_bytes=0)
  assert full.activations == 2 * 5632  # L = 2
  # TP without SP: sbh (10 + 24/t + 5as/(ht)) = 128 x 27.
  assert playbook_activations(Layout(tensor=2)) == 128 * (10 + 24 / 2 + 5 * 4 * 8 / (16 * 2))
  # TP with SP: sbh/t (34 + 5as/h): everything split.
  assert playbook_activations(Layout(tensor=2, sequence_parallel=True)) == 128 / 2 * 44 == 5632 / 2
  # Selective recomputation drops the 5as/h term: 34 sbh/t with SP.
  assert playbook_activations(Layout(tensor=2, sequence_parallel=True), "selective") == 34 * 128 / 2
  # Full recomputation keeps the layer input: 2sbh.
  assert playbook_activations(Layout(), "full") == 2 * 128
  # CP halves the tokens per device (each still attends the whole sequence).
  assert playbook_activations(Layout(context=2)) == 5632 / 2


def test_our_llama_activation_terms_by_hand():
  # bf16: norm inputs/outputs 4h x 2 = 128; q, o 2 H Dh + k, v 2 K Dh + SwiGLU 3F = 144 x 2 =
  # 288; scores per unit of s: a (4 + 4 + 2) = 40 (fp32 scores and probabilities + a bf16 copy).
  terms = activation_terms(SMALL, 2, "llama")
  assert (terms.replicated, terms.split, terms.scores) == (128, 288, 40)
  assert layer_activation_bytes(terms, SEQ, SEQ, Layout(), "none") == SEQ * (128 + 288 + 40 * 8)
  flash = activation_terms(dataclasses.replace(SMALL, flash_attention=True), 2, "llama")
  assert flash.scores == 0


def test_pipeline_schedules_hold_these_many_microbatches():
  assert in_flight_microbatches("afab", 4, 16) == 16
  assert in_flight_microbatches("1f1b", 4, 16) == 4
  assert in_flight_microbatches("1f1b", 4, 2) == 2
  # Interleaved: p (1 + (p-1)/(p v)) = 4 x (1 + 3/8).
  assert in_flight_microbatches("interleaved_1f1b", 4, 16, 2) == 5.5
  assert in_flight_microbatches("interleaved_1f1b", 16, 64, 2) == 23.5
  assert in_flight_microbatches("zero_bubble", 4, 16) == 4


def test_pipeline_bubble_comes_from_the_schedule_table():
  # AFAB and 1F1B: (p-1)/m idle per busy tick; interleaved (p-1)/(v m); zero-bubble less than
  # 1F1B at the same memory; the closed form for a layout the executor refuses (m < p).
  assert bubble_ratio("afab", 4, 16) == pytest.approx(3 / 16)
  assert bubble_ratio("1f1b", 4, 16) == pytest.approx(3 / 16)
  assert bubble_ratio("interleaved_1f1b", 4, 16, 2) == \
      pytest.approx(3 / 32)
  zero_bubble = bubble_ratio("zero_bubble", 4, 16)
  assert 0 < zero_bubble < 3 / 16
  assert table_if_valid("1f1b", 4, 2) is None
  assert bubble_ratio("1f1b", 4, 2) == pytest.approx(3 / 2)


@pytest.mark.parametrize("schedule,vpp", [("afab", 1), ("1f1b", 1), ("interleaved_1f1b", 2),
                                          ("interleaved_1f1b", 4)])
def test_closed_forms_equal_the_executors_tick_tables(schedule, vpp):
  for p in (2, 4, 8):
    for m in (p, 2 * p, 4 * p):
      table = table_if_valid(schedule, p, m, vpp)
      idle = table.bubble_fraction()
      assert bubble_ratio(schedule, p, m, vpp) == pytest.approx(idle / (1 - idle)), (p, m)
      peak = table.in_flight().max() / vpp
      assert in_flight_microbatches(schedule, p, m, vpp) == pytest.approx(peak), (p, m)


def test_logits_and_temporaries_by_hand():
  mem = memory(SMALL, Layout(), SEQ, PLAYBOOK_MIXED, workspace_bytes=0)
  assert mem.logits == SEQ * 100 * (2 + 8)  # bf16 logits + their fp32 copy and gradient
  # meshtron's pipeline stages each run the head on half the tokens; Megatron's last one all
  staged = Layout(pipeline=2, microbatches=4)
  assert memory(SMALL, staged, SEQ, PLAYBOOK_MIXED).logits == SEQ / 2 * 100 * (2 + 8)
  assert memory(SMALL, staged, SEQ, PLAYBOOK_MIXED, stages_recompute=False).logits == mem.logits
  assert mem.temporaries == 0
  z3 = memory(SMALL, Layout(fsdp=2), SEQ, PLAYBOOK_MIXED, workspace_bytes=0)
  assert z3.temporaries == 2 * 2304 * 2  # the gathered layer and the prefetched one, bf16


def test_communication_volumes_by_hand():
  def wire(layout, phase=None, precision=PLAYBOOK_MIXED):
    return sum(c.wire_bytes for c in hardware.collectives(SMALL, layout, SEQ, precision)
               if phase in (None, c.phase))
  psi = 2 * 7888  # bf16 gradient (= parameter) bytes
  # DP: one all-reduce, 2 (n-1)/n Psi. ZeRO-1: reduce-scatter + all-gather, the same 2 Psi.
  assert wire(Layout(data=4, microbatches=4)) == pytest.approx(2 * 3 / 4 * psi)
  assert wire(Layout(data=4, zero_stage=1)) == pytest.approx(2 * 3 / 4 * psi)
  # ZeRO-1 over data=2 x context=2: the same reduce-scatter + all-gather over the 4 devices, in
  # place of an all-reduce over context (sharding.rules.ZERO_AXES).
  zero_cp = [c for c in hardware.collectives(SMALL, Layout(data=2, context=2, zero_stage=1), SEQ,
                                               PLAYBOOK_MIXED) if c.phase != "context"]
  assert {(c.kind, c.axes, c.group) for c in zero_cp} == {
      ("reduce-scatter", ("data", "context"), 4), ("all-gather", ("data", "context"), 4)}
  assert sum(c.wire_bytes for c in zero_cp) == pytest.approx(2 * 3 / 4 * psi)
  # ZeRO-2 with accumulation reduce-scatters every microbatch.
  assert wire(Layout(data=4, zero_stage=2, microbatches=4), "grad_sync") == pytest.approx(4 * 3 / 4 * psi)
  # ZeRO-3: layers gathered forward and backward, the head once (3200 B) and the norm scales
  # (160 B), gradients reduce-scattered except the embedding table's (3200 B): its lookup moves
  # token rows, an all-to-all each way of b s h = 8 x 16 x 2 bytes.
  # (n-1)/n (2 x 9216 + 3360 + (15776 - 3200) + 2 x 256).
  assert wire(Layout(fsdp=4)) == pytest.approx(3 / 4 * (2 * 9216 + 3360 + psi - 3200 + 2 * 256))
  # ZeRO-3 over data=2 x fsdp=4: the same over 8 devices, plus the table's data shards
  # (100 x 16 / 4 x 2 bytes) gathered and reduce-scattered over data and two permutes of half a
  # shard (as compiled: tests/test_layout_programs.py).
  assert wire(Layout(data=2, fsdp=4, zero_stage=3)) == pytest.approx(
      7 / 8 * (2 * 9216 + 3360 + psi - 3200) + 3 / 4 * 2 * 256 + 1 / 2 * 2 * 800 + 2 * 400)
  # The vocab split over fsdp: neither table is gathered or reduced; the group's hidden states
  # and embedding rows (4 x 8 tokens x 16 x 2 bytes) are gathered, and their gradients
  # reduce-scattered, once each way.
  assert wire(Layout(fsdp=4, vocab_over_fsdp="on")) == pytest.approx(
      3 / 4 * (2 * 9216 + 160 + psi - 2 * 3200 + 2 * 256 + 4 * 1024))
  # TP: b s h = 8 x 16 x 2 bytes; 4 all-reduces per layer + 2 (embedding, head).
  assert wire(Layout(tensor=2)) == pytest.approx((2 * 4 + 2) * 256 * 2 * 1 / 2)
  # SP: 6 all-gathers + 4 reduce-scatters per layer (+2 and +1 outside the layers).
  assert wire(Layout(tensor=2, sequence_parallel=True)) == pytest.approx((2 * 6 + 2 + 2 * 4 + 1) * 256 / 2)
  # PP: activations forward and gradients backward, per microbatch.
  assert wire(Layout(pipeline=2, microbatches=4)) == 2 * 4 * 256
  # CP ring: K and V blocks (2 x 4 tokens x K Dh x 2 bytes) passed (cp-1) times, 3 ways, per layer.
  assert wire(Layout(context=2)) - wire(Layout(context=2), "grad_sync") == 3 * 2 * (2 * 4 * 8 * 2)


def test_zero3_sends_3_psi_against_2_psi_for_zero2():
  """Playbook, ZeRO-3: "a total communication cost of 3Psi, compared to 2Psi for Zero-2".

  The playbook gathers every weight forward and backward (2 Psi) and reduce-scatters every
  gradient (Psi). Our embedding table is neither gathered (its lookup moves token rows) nor
  reduced, and the head is gathered once: 4 tables T less, 3 Psi - 4 T, where T = V x h is 6%
  of Llama-3 8B's parameters. (The vocab stays whole here; sharding.rules can split it.)"""
  model = model_spec(MODELS["playbook_8b"])
  def wire(layout):
    return sum(c.wire_bytes for c in hardware.collectives(model, layout, 4096, PLAYBOOK_MIXED))
  psi, table = model.num_params(), model.vocab_size * model.embed_dim
  ratio = wire(Layout(fsdp=8, vocab_over_fsdp="off")) / wire(Layout(data=8, zero_stage=2))
  assert ratio == pytest.approx((3 * psi - 4 * table) / (2 * psi), rel=0.01)
  assert ratio == pytest.approx(1.5, rel=0.12)


# ---- published numbers ----


@pytest.mark.parametrize("billions, without, with_fp32", [(1, 16, 20), (7, 112, 140),
                                                          (70, 1120, 1400), (405, 6480, 8100)])
def test_playbook_table_of_model_state_memory(billions, without, with_fp32):
  """Playbook, "Weights/grads/optimizer states memory": FP32 or BF16 w/o FP32 grad acc vs BF16
  w/ FP32 grad acc, e.g. 70B -> 1120 GB / 1400 GB."""
  n = billions * 1e9
  for precision in (FULL_FP32, PLAYBOOK_MIXED):
    assert sum(state_bytes(n, 0, Layout(), precision)) / GB == pytest.approx(without)
  assert sum(state_bytes(n, 0, Layout(), PLAYBOOK_MIXED_FP32_ACCUM)) / GB == \
      pytest.approx(with_fp32)


def test_zero_paper_figure_reproduced_in_the_playbook():
  """ZeRO (arXiv:1910.02054) Figure 1, the playbook's zero_memory figure: Psi = 7.5B, N_d = 64,
  K = 12: baseline 120 GB, ZeRO-1 31.4 GB, ZeRO-2 16.6 GB, ZeRO-3 1.9 GB per device."""
  totals = [sum(state_bytes(7.5e9, 0, Layout(data=64, zero_stage=z), PLAYBOOK_MIXED)) / GB
            for z in range(4)]
  assert totals == pytest.approx([120, 31.4, 16.6, 1.9], abs=0.05)


def test_playbook_tip_70b_needs_140_gb_of_bf16_parameters():
  """Playbook, DP section: "multiplying by 2 e.g. 70B -> 140GB"."""
  mem = memory(MODELS["llama3_70b"], Layout(), 4096, PLAYBOOK_MIXED)
  assert mem.params / GB == pytest.approx(140, rel=0.01)


def test_selective_recomputation_saves_70_percent_on_gpt3():
  """Playbook, "Activation recomputation": selective recomputation on GPT-3 (175B) gives "70%
  activation memory reduction" (Korthikanti et al.: 34 vs 34 + 5as/h at s=2048)."""
  gpt3 = ModelSpec(vocab_size=50_257, embed_dim=12_288, num_layers=96, num_heads=96,
                   num_kv_heads=96, head_dim=128, mlp_dim=4 * 12_288)
  def act(remat):
    return memory(gpt3, Layout(remat=remat), 2048, PLAYBOOK_MIXED, formula="playbook").activations
  assert 1 - act("selective") / act("none") == pytest.approx(0.70, abs=0.005)


def test_activations_overtake_the_state_between_2k_and_8k_tokens_for_llama_8b():
  """Playbook, activation memory of Llama models (bs=1): negligible for short sequences,
  "starting at around 2-4k tokens they come to take a significant amount of memory"."""
  model = MODELS["llama3_8b"]
  def act(seq):
    return memory(model, Layout(), seq, PLAYBOOK_MIXED, formula="playbook").activations
  state = memory(model, Layout(), 1, PLAYBOOK_MIXED).state
  assert act(512) < 0.05 * state
  assert act(2048) < state < act(8192)
  # The quadratic term: at s = 4096, 32 x 4096 x 4096 x (34 + 5 x 32 x 4096 / 4096) bytes.
  assert act(4096) == 32 * 4096 * 4096 * (34 + 160)


def test_pipeline_keeps_the_first_stage_activations_and_sp_divides_them():
  """Playbook, PP section: with 1F1B "the activation memory remains the same on each GPU" (p
  microbatches of L/p layers); SP: the activations per device become b s h / tp."""
  model = MODELS["playbook_8b"]
  none = memory(model, Layout(), 4096, PLAYBOOK_MIXED, formula="playbook").activations
  pp = memory(model, Layout(pipeline=4, microbatches=8), 4096, PLAYBOOK_MIXED, formula="playbook",
              stages_recompute=False).activations  # Megatron's stages store the activations
  assert pp == none
  sp = memory(model, Layout(tensor=8, sequence_parallel=True), 4096, PLAYBOOK_MIXED, formula="playbook")
  assert sp.activations == none / 8


def test_the_estimator_takes_auto_attention_as_flash():
  """GPU plans assume the flash kernel "auto" runs there: no [s, s] scores stored; naming xla
  adds them back."""
  compute = ComputeConfig()
  assert compute.attention_impl == "auto"
  auto = model_spec(MODELS["llama3_8b"], compute)
  xla = model_spec(MODELS["llama3_8b"], dataclasses.replace(compute, attention_impl="xla"))
  assert auto.flash_attention and not xla.flash_attention
  layout = Layout(fsdp=8, micro_batch=1)
  assert memory(xla, layout, 4096).activations > memory(auto, layout, 4096).activations
  piped = Layout(pipeline=2, data=4, micro_batch=1, microbatches=8)  # stages run flash too
  assert memory(xla, piped, 4096).activations > memory(auto, piped, 4096).activations


def test_meshtron_stages_keep_a_stash_of_chunk_inputs_and_recompute_one_chunk():
  """meshtron's executor keeps an input and a received gradient per chunk and slot (slots: AFAB m,
  1F1B min(m, p), interleaved min(m, 2p), the tables' own count), position 0's input gradient
  per microbatch (the embedding's, differentiated after the ticks), and recomputes one chunk for
  one microbatch in its backward: activations = (2 v slots + m) b s h e (/ t under SP) + that
  chunk's layers' activations for one microbatch."""
  for kind, p, m, v in (("afab", 4, 8, 1), ("1f1b", 4, 2, 1), ("1f1b", 4, 8, 1),
                        ("interleaved_1f1b", 4, 4, 2), ("interleaved_1f1b", 4, 16, 3),
                        ("zero_bubble", 4, 8, 1), ("zbv", 4, 8, 2), ("dualpipev", 2, 8, 2)):
    if schedules.table_if_valid(kind, p, m, v) is not None:
      assert schedules.executor_stash(kind, p, m, v) == \
          2 * v * schedules.make(kind, p, m, v).buffer_slots(), (kind, p, m, v)
  model = model_spec(MODELS["playbook_8b"])
  for sp, t in ((False, 1), (True, 2)):
    lay = Layout(pipeline=4, tensor=t, sequence_parallel=sp, microbatches=16,
                 pipeline_schedule="interleaved_1f1b", virtual_stages=2)
    one_layer = layer_activation_bytes(activation_terms(model, 2), 4096, 4096, lay, "none")
    stash = (2 * 2 * 8 + 16) * 4096 * model.embed_dim * 2 / t
    assert memory(model, lay, 4096, PLAYBOOK_MIXED).activations == pytest.approx(
        stash + one_layer * model.num_layers / 4 / 2)


def test_meshtron_s_kernels_are_priced_at_the_compiled_program_model_s_constants():
  """SMALL per token: 2 layers x 6 x 2,304 linear and 6 x 1,600 head FLOPs on GEMMs at 0.807 of
  the peak, 2 x 768 attention-score FLOPs, which meshtron's flash kernels run as 9 matmuls where
  the count has 6, at 0.35 (without flash, as dots at 0.807); selective remat adds each layer's
  scores forward (256) at its count. Memory-bound kernels move 3,416 bytes a token (4,632 with
  selective's recomputed forwards; tests/test_plan_memory_bound.py) at copy_bandwidth. The
  playbook's nanotron runs price every FLOP at the one fitted matmul_efficiency."""
  hw, bf16 = hardware.PROFILES["h100"], hardware.PROFILES["h100"].peak_bf16_flops
  passes = 3 * SMALL.num_layers * hw.layer_overhead_s  # one microbatch
  flash = dataclasses.replace(SMALL, flash_attention=True)
  gemm = SEQ * (2 * 6 * 2304 + 6 * 1600) / (bf16 * hw.gemm_peak_fraction)
  for remat, recomputed, moved in (("none", 0, 3416), ("selective", 2 * 256, 4632)):
    layout = Layout(remat=remat)
    memory = SEQ * moved / hw.copy_bandwidth
    st = hardware.step_time(flash, layout, SEQ, PLAYBOOK_MIXED, hw)
    assert st.compute_s == pytest.approx(gemm + passes + memory + SEQ * (
        2 * 768 * 9 / 6 + recomputed) / (bf16 * hw.flash_triton_fraction))
    dots = hardware.step_time(SMALL, layout, SEQ, PLAYBOOK_MIXED, hw)
    assert dots.compute_s == pytest.approx(gemm + passes + memory + SEQ * (
        2 * 768 + recomputed) / (bf16 * hw.gemm_peak_fraction))
    uniform = hardware.step_time(flash, layout, SEQ, PLAYBOOK_MIXED, hw, uniform_matmuls=True)
    assert uniform.compute_s == pytest.approx(
        hardware.hardware_flops_per_device(SMALL, layout, SEQ) / bf16 / hw.matmul_efficiency
        + passes)
    assert uniform.compute_s - passes != pytest.approx(st.compute_s - passes)


def test_fp8_training_prices_the_layers_gemms_on_fp8_tensor_cores():
  """compute.fp8 (attention and MLP linears, experts in a MoE) moves the layers' GEMMs, 6 x 2,304
  matmul params a layer and token, to peak_fp8_flops; the scores (6 H Dh s = 768 a layer and
  token) and the head (6 x 1,600) stay on bf16 peak. meshtron's kernels add fp8's amax and cast
  passes, 2 x 1,040 bytes a token (tests/test_plan_memory_bound.py)."""
  layout, hw = Layout(), hardware.PROFILES["h100"]
  linear, rest = hardware.flops_split(SMALL, layout, SEQ)
  assert (linear, rest) == (SEQ * 2 * 6 * 2304, SEQ * (2 * 768 + 6 * 1600))
  assert linear + rest == hardware.hardware_flops_per_device(SMALL, layout, SEQ) == \
      SEQ * SMALL.flops_per_token(SEQ)
  for uniform, efficiency, casts in ((False, hw.gemm_peak_fraction, 2 * 1040),
                                     (True, hw.matmul_efficiency, 0)):
    bf16, fp8 = (hardware.step_time(SMALL, layout, SEQ, trainer_precision(
        "bfloat16", "bfloat16", fp8_layers=on), hw, uniform_matmuls=uniform)
        for on in (False, True))
    assert bf16.compute_s - fp8.compute_s == pytest.approx(
        linear * (1 / hw.peak_bf16_flops - 1 / hw.peak_fp8_flops) / efficiency -
        SEQ * casts / hw.copy_bandwidth)
  assert fp8.mfu / bf16.mfu == pytest.approx(bf16.step_s / fp8.step_s)  # both of the bf16 peak
  cfg = llama.debug()
  assert not cfg.precision().fp8_layers
  cfg.compute = dataclasses.replace(cfg.compute, fp8=Fp8Config(enabled=True))
  assert cfg.precision().fp8_layers and "fp8 layer GEMMs" in cfg.precision().name
  cfg.compute = dataclasses.replace(cfg.compute, fp8=Fp8Config(enabled=True, targets="mlp"))
  assert not cfg.precision().fp8_layers  # the attention projections stay bf16: no discount
  cfg = moe.debug_moe()
  cfg.compute = dataclasses.replace(cfg.compute, fp8=Fp8Config(enabled=True,
                                                               targets="attention,mlp"))
  assert not cfg.precision().fp8_layers  # nor with bf16 experts
  # `meshtron plan/memory --precision=playbook_fp8`: the playbook's state, the GEMMs above.
  fp8_playbook = precision_by_name("playbook_fp8")
  assert fp8_playbook.fp8_layers and dataclasses.replace(
      fp8_playbook, name=PLAYBOOK_MIXED.name, fp8_layers=False) == PLAYBOOK_MIXED
