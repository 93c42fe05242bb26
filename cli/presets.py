"""The models and precisions `memory`, `plan` and `plan --compile_top` take by name, and the
TrainConfig (and config file) of a preset under a planned layout."""

import dataclasses
import sys

from configs import llama, moe
from sharding.layout import Layout
from sharding.plan import estimate


def parse_tokens(text: str) -> int:
  """"1M" -> 1048576, "512K" -> 524288, "4096" -> 4096."""
  given, text = text, text.strip().upper()
  scale = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}.get(text[-1:], 1)
  number = text[:-1] if scale > 1 else text
  if not number.isdigit() or int(number) == 0:
    raise ValueError(f"--global_batch_tokens={given!r} must be a positive number with an optional"
                     " K/M/G (e.g. 4M)")
  return int(number) * scale


def preset_module(name: str):
  """The configs module whose `large(name)` builds trainer preset `name`, or None."""
  return next((m for m in (llama, moe) if name in m.MODELS), None)


def model_by_name(name: str):
  """A configs preset (dense or MoE, read by duck typing) or one of the estimator's own models."""
  if module := preset_module(name):
    return estimate.model_spec(module.MODELS[name])
  if name in estimate.ESTIMATOR_MODELS:
    return estimate.ESTIMATOR_MODELS[name]
  names = sorted(set(llama.MODELS) | set(moe.MODELS) | set(estimate.ESTIMATOR_MODELS))
  raise ValueError(f"unknown model {name!r}; models: {', '.join(names)}")


def precision_by_name(name: str, model_dtype: str = "bfloat16") -> estimate.Precision:
  if name == "trainer":
    return estimate.trainer_precision(model_dtype)
  if name not in estimate.PRECISIONS:
    raise ValueError(f"unknown precision {name!r}; one of {', '.join(estimate.PRECISIONS)}")
  return estimate.PRECISIONS[name]


_DTYPE_OF = {2: "bfloat16", 4: "float32"}  # bytes per element -> the trainer's dtype name


def precision_settings(precision: estimate.Precision) -> dict:
  """The trainer settings (dotted config keys) that store what `precision` prices, so that
  `plan --compile_top` compiles, and `plan --out` writes, the program `plan` ranked: the
  playbook's precisions are bf16 parameters with float32 master copies and Adam moments. The
  trainer accumulates microbatch gradients in a carry of `grad_accum_dtype`; a precision with no
  separate accumulation buffer (the playbook's 2 bytes of gradients) accumulates in the
  gradients' own dtype. Its fp8 layers are tensorwise where it gathers in fp8, else delayed."""
  if precision.param_bytes not in _DTYPE_OF or precision.act_bytes not in _DTYPE_OF:
    raise ValueError(f"the trainer stores no {precision.param_bytes}-byte parameters or"
                     f" {precision.act_bytes}-byte activations ({precision.name}); use"
                     " --precision=playbook, playbook_fp32_accum, playbook_fp8, fp32 or trainer")
  param = _DTYPE_OF[precision.param_bytes]
  settings = {"model.param_dtype": param, "model.dtype": _DTYPE_OF[precision.act_bytes],
              "optim.master_weights": precision.master_bytes > 0,
              "grad_accum_dtype": _DTYPE_OF.get(precision.grad_accum_bytes, param)}
  if precision.fp8_layers:
    settings.update({"compute.fp8.enabled": True,
                     "compute.fp8.recipe": "tensorwise" if precision.fp8_gathers else "delayed"})
  return settings


def train_config(model: str, layout: Layout, seq: int,
                 precision: estimate.Precision | None = None):
  """The TrainConfig of a preset under a planned layout, storing what `precision` prices (None:
  the preset's own dtypes): what write_config's file builds."""
  cfg = preset_module(model).large(model)
  cfg.mesh = layout.mesh_config()
  cfg.seq_len, cfg.batch_size, cfg.microbatches = seq, layout.global_batch, layout.microbatches
  cfg.compute = dataclasses.replace(cfg.compute, remat=layout.remat)
  if layout.context > 1:
    cfg.compute = dataclasses.replace(cfg.compute, context_impl=layout.context_impl)
  for key, value in (precision_settings(precision) if precision else {}).items():
    *path, name = key.split(".")  # set as the config file's lines (and --config.a.b=v) do
    node = cfg
    for part in path:
      setattr(node, part, dataclasses.replace(getattr(node, part)))  # the preset's untouched
      node = getattr(node, part)
    setattr(node, name, value)
  return cfg


def write_config(path: str, model: str, layout: Layout, seq: int,
                 precision: estimate.Precision | None = None) -> bool:
  """A config file for `meshtron train` with the layout's mesh, batch and remat, storing what
  `precision` prices (precision_settings)."""
  module = preset_module(model)
  if module is None:
    print(f"note: {model} is not a trainer preset yet; no config written", file=sys.stderr)
    return False
  mesh = ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(layout.mesh_config()).items()
                   if k not in ("dcn", "allow_tensor_across_hosts"))
  impl = (f"\n  cfg.compute.context_impl = {layout.context_impl!r}"
          if layout.context > 1 and layout.context_impl != "ring" else "")
  if precision:
    impl += f"\n  # {precision.name}, as `meshtron plan` priced it"
    impl += "".join(f"\n  cfg.{k} = {v!r}" for k, v in precision_settings(precision).items())
  text = f'''"""{model} with the layout chosen by `meshtron plan`: {layout.string()}."""

from configs import {module.__name__.split(".")[-1]}
from sharding.mesh import MeshConfig


def get_config():
  cfg = {module.__name__.split(".")[-1]}.large({model!r})
  cfg.mesh = MeshConfig({mesh})
  cfg.seq_len = {seq}
  cfg.batch_size = {layout.global_batch}  # sequences per step: mbs x ga x data x fsdp x expert
  cfg.microbatches = {layout.microbatches}
  cfg.compute.remat = {layout.remat!r}{impl}
  return cfg
'''
  with open(path, "w") as f:
    f.write(text)
  return True
