"""`plan --compile_top` compiles, and `plan --out` writes, the program `plan` priced: the
precision's parameter, master-copy, gradient-accumulation and compute dtypes (cli/presets)."""

import dataclasses
import importlib.util

import pytest

from cli.presets import precision_settings, train_config, write_config
from sharding.layout_text import parse
from sharding.plan import estimate

LAYOUT = parse("data=1,pipeline=2,fsdp=2,tensor=2,zero=0,mbs=1,ga=8,remat=selective,sp=1,"
               "schedule=paired_1f1b,vpp=2,pipeline_recompute=0")


def stored(cfg) -> tuple:
  """What a config's run stores per element, as the analytic memory model reads it."""
  p = cfg.precision()
  return p.param_bytes, p.master_bytes, p.grad_bytes, p.opt_bytes, p.act_bytes, p.fp8_layers


@pytest.mark.parametrize("name", sorted(estimate.PRECISIONS))
def test_the_compiled_config_stores_what_the_precision_prices(name):
  """Parameters, master copies, gradients, moments and activations in the priced bytes; the
  gradient carry in the precision's accumulation dtype, or the gradients' own where it keeps no
  separate buffer (the playbook's 2 bytes)."""
  precision = estimate.PRECISIONS[name]
  cfg = train_config("llama3_8b", LAYOUT, 4096, precision)
  assert stored(cfg) == (precision.param_bytes, precision.master_bytes, precision.grad_bytes,
                         precision.opt_bytes, precision.act_bytes, precision.fp8_layers)
  carry = cfg.precision().grad_accum_bytes
  assert carry == (precision.grad_accum_bytes or precision.grad_bytes)
  assert cfg.layout(8).pipeline_recompute is False  # the layout as planned


def test_the_playbook_compiles_bf16_weights_with_float32_masters_not_the_presets_float32():
  """The two configs really differ: the preset stores float32 parameters; the playbook's
  config bf16 ones, float32 masters, a bf16 gradient carry. The preset itself is untouched."""
  preset = train_config("llama3_8b", LAYOUT, 4096)
  playbook = train_config("llama3_8b", LAYOUT, 4096, estimate.PLAYBOOK_MIXED)
  assert (preset.model.param_dtype, preset.optim.master_weights) == ("float32", False)
  assert (playbook.model.param_dtype, playbook.optim.master_weights,
          playbook.grad_accum_dtype) == ("bfloat16", True, "bfloat16")
  assert train_config("llama3_8b", LAYOUT, 4096).model.param_dtype == "float32"
  fp8 = train_config("llama3_8b", LAYOUT, 4096, estimate.PLAYBOOK_FP8)
  assert fp8.compute.fp8.enabled and not preset.compute.fp8.enabled


@pytest.mark.parametrize("name", ["playbook", "playbook_fp8", "trainer"])
def test_the_written_config_builds_the_compiled_one(tmp_path, name):
  precision = estimate.PRECISIONS[name]
  path = tmp_path / "best.py"
  assert write_config(str(path), "llama3_8b", LAYOUT, 4096, precision)
  assert precision.name in path.read_text()
  spec = importlib.util.spec_from_file_location("best", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  written = dataclasses.asdict(module.get_config())
  assert written == dataclasses.asdict(train_config("llama3_8b", LAYOUT, 4096, precision))


def test_a_precision_the_trainer_cannot_store_is_one_line():
  odd = dataclasses.replace(estimate.PLAYBOOK_MIXED, name="fp8 params", param_bytes=1)
  with pytest.raises(ValueError, match="the trainer stores no 1-byte parameters"):
    precision_settings(odd)
