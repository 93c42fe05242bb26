"""XLA option presets: every preset is accepted by the pinned XLA, bad options fail at start-up in
one line naming the option and the versions, explicit xla_options win, CPU programs unchanged."""

import re

import jax
import pytest

from configs import llama
from sharding import MeshConfig
from sharding.xla import compiled, hlo, presets
from trainer.aot import compile_for_gpus
from trainer.config import compiler_options
from trainer.trainer import Trainer

VERSIONS = f"jax {jax.__version__}, jaxlib"
SIZES = dict(data=1, pipeline=1, fsdp=8, expert=1, context=1, tensor=1)


def tiny(**fields):
  cfg = llama.debug()
  cfg.model.num_layers, cfg.batch_size, cfg.seq_len = 2, 16, 32
  cfg.mesh = MeshConfig(data=1, fsdp=8)
  for name, value in fields.items():
    setattr(cfg, name, value)
  return cfg


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_every_preset_is_accepted_by_this_xla(name):
  options = presets.compiler_options(name)
  assert presets.check_options(options) == options
  text = presets.describe(name)  # each option says what it does and what it did
  assert all(f"{o.name}={o.value}: " in text and len(o.effect) > 40
             for o in presets.preset(name).options)


def test_presets_are_versioned_and_auto_pipelines_only_data_and_fsdp_meshes():
  assert all(re.fullmatch(r"none|[a-z_]+_v\d+", name) for name in presets.PRESETS)
  assert presets.DEFAULT_PRESET == "auto" and presets.compiler_options("none") == {}
  sizes = dict(data=2, pipeline=1, fsdp=4, expert=1, context=1, tensor=1)
  assert presets.resolve("auto", sizes) == "overlap_v1"
  default = presets.compiler_options("auto", mesh_sizes=sizes)
  assert default["xla_gpu_enable_pipelined_all_gather"] is True
  assert default["xla_gpu_enable_latency_hiding_scheduler"] is True
  for axis in ("tensor", "context", "expert", "pipeline"):
    assert presets.resolve("auto", {**sizes, axis: 2}) == "scheduler_v1"
  assert presets.resolve("overlap_v1", {**sizes, "tensor": 2}) == "overlap_v1"  # as asked
  assert presets.resolve("auto", sizes, microbatches=2) == "scheduler_v1"
  assert compiler_options(tiny(microbatches=4), SIZES) == presets.compiler_options(
      "scheduler_v1")  # the train step's options follow its microbatches


def _loops(text: str) -> tuple[int, int]:
  """(while loops in the entry computation, in the whole module) of an HLO module's text."""
  comps = hlo.computations(text)
  entry = re.search(r"^ENTRY %?([\w.\-]+)", text, re.M).group(1)
  count = lambda body: sum(ins.op == "while" for ins in body)  # noqa: E731
  return count(comps[entry]), sum(map(count, comps.values()))


def test_auto_keeps_the_microbatch_loop_whole_where_loop_pipelining_peels_it(tmp_path):
  """With gradient accumulation, overlap_v1's collective pipeliner peels one microbatch out of
  the microbatch loop (it gathers the tables) and the step holds two microbatches' residual
  stacks; `auto` runs the loop whole (sharding/xla/presets.py). 4 layers, fsdp=8, h100x8."""
  programs = {}
  for preset in ("overlap_v1", "auto"):
    cfg = tiny(xla_preset=preset, microbatches=4, batch_size=64)
    cfg.model.num_layers = 4
    hlo = str(tmp_path / f"{preset}.hlo")
    rep = compile_for_gpus(cfg, compiled.parse_gpu_target("h100x8"), hlo)
    with open(hlo) as f:
      programs[preset] = rep, f.read()
  (pipelined, pipelined_text), (auto, auto_text) = programs["overlap_v1"], programs["auto"]
  assert pipelined.extra["xla options"] == "preset overlap_v1 (overlap_v1)"
  assert auto.extra["xla options"] == "preset auto (scheduler_v1)"
  # The microbatch loop and its two layer scans; peeled: one more microbatch's scans in the
  # entry computation beside the loop.
  assert _loops(auto_text) == (1, 3) and _loops(pipelined_text) == (3, 5)
  assert auto.memory["peak"] < 0.7 * pipelined.memory["peak"]


@pytest.mark.parametrize("options, culprit, why", [
    ({"xla_gpu_enable_async_all_gather": True}, "xla_gpu_enable_async_all_gather",
     "No such compile option"),  # removed from XLA in 2024
    ({"xla_gpu_all_gather_combine_threshold_bytes": 1, "xla_no_such_flag": 1},
     "xla_no_such_flag", "No such compile option"),
    ({"xla_gpu_enable_pipelined_all_gather": "maybe"}, "xla_gpu_enable_pipelined_all_gather",
     "not a valid bool"),
])
def test_bad_options_are_one_line_errors_naming_the_option_and_versions(options, culprit, why):
  with pytest.raises(ValueError) as e:
    presets.check_options(options)
  message = str(e.value)
  assert "\n" not in message and f"XLA option {culprit}=" in message
  assert VERSIONS in message and why in message


def test_explicit_xla_options_override_the_preset():
  cfg = tiny(xla_options="xla_gpu_enable_pipelined_all_gather=false,"
                         "xla_gpu_all_gather_combine_threshold_bytes=0")
  options = compiler_options(cfg, SIZES)
  assert options["xla_gpu_enable_pipelined_all_gather"] is False
  assert options["xla_gpu_all_gather_combine_threshold_bytes"] == 0
  assert options["xla_gpu_enable_pipelined_reduce_scatter"] is True  # the rest of the preset
  assert compiler_options(tiny(xla_preset="none"), SIZES) == {}


def test_unknown_preset_fails_validation():
  with pytest.raises(ValueError, match="'overlap_v9' is not one of auto, none, scheduler_v1"):
    tiny(xla_preset="overlap_v9").validate()


def test_trainer_start_up_rejects_a_bad_option_before_compiling():
  with pytest.raises(ValueError, match=f"XLA option xla_gpu_bogus=1 is not accepted.*{VERSIONS}"):
    Trainer(tiny(xla_options="xla_gpu_bogus=1"))


def test_gpu_options_leave_the_cpu_program_unchanged():
  """Decision: xla_gpu_* options pass through CPU runs. XLA:CPU accepts them (one DebugOptions
  table for every backend) and ignores them; the compiled CPU program is the same."""
  texts = []
  for preset in ("none", "overlap_bucketed_v1"):
    trainer = Trainer(tiny(xla_preset=preset))
    with trainer.scope():
      lowered = trainer.train_step.lower(trainer.abstract_state, trainer.abstract_batch())
      texts.append(lowered.compile().as_text().split("\n", 1)[1])  # past the HloModule line
  assert texts[0] == texts[1]


def test_meshtron_compile_for_gpus_fails_at_start_up_on_a_bad_option():
  with pytest.raises(ValueError, match="compiling for h100x8 failed: XLA option"
                                       " xla_gpu_enable_async_all_reduce=True is not accepted"):
    compile_for_gpus(tiny(xla_options="xla_gpu_enable_async_all_reduce=true"),
                     compiled.parse_gpu_target("h100x8"))


def test_auto_drops_the_options_this_xla_removed_and_a_named_preset_keeps_them(monkeypatch):
  """jax 0.11.2 (the lent H200) has no xla_gpu_enable_pipelined_all_gather: `auto` leaves it
  out there; a preset named explicitly keeps it and fails in check_options with one line."""
  assert presets.removed_options() == frozenset()  # the pinned XLA takes every preset option
  gone = "xla_gpu_enable_pipelined_all_gather"
  monkeypatch.setattr(presets, "removed_options", lambda: frozenset({gone}))
  sizes = {"data": 2, "fsdp": 4}
  assert presets.resolve("auto", sizes) == "overlap_v1"
  auto = presets.compiler_options("auto", mesh_sizes=sizes)
  assert gone not in auto and "xla_gpu_enable_pipelined_reduce_scatter" in auto
  assert gone in presets.compiler_options("overlap_v1", mesh_sizes=sizes)
