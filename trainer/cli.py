"""`meshtron <verb>`: every flag and the verb dispatch. Bad input ends in one line on stderr.

  meshtron train --config=debug --workdir=runs/x [--config.a.b=value ...]
  meshtron compile --config=llama3_8b --target=h100x64
  meshtron memory --model=llama3_70b --layout=data=8,tensor=8,zero=1
  meshtron plan --model=llama3_70b --nodes=8
  meshtron convert --from=hf --model_dir=DIR --out=DIR

The console script first restarts under the trainer's malloc settings (trainer/host_memory.py),
before anything heavy (JAX, the configs) is imported, so those imports happen once.
"""

import dataclasses
import json
import os
import sys

from absl import app, flags

from trainer import host_memory

VERBS = ("train", "compile", "memory", "plan", "convert")

# All verbs.
_WORKDIR = flags.DEFINE_string("workdir", "runs/default", "train: where metrics, plots and"
                               " samples go; convert --to=hf: the run (or --from=hf output) to"
                               " export")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 0, "simulate N CPU devices (0: JAX's default)")
_JSON = flags.DEFINE_bool("json", False, "compile/memory/plan: print JSON")
# train
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "train: print the sharding of every parameter and"
                             " activation, check the layout, and exit without training")
_COORDINATOR = flags.DEFINE_string("coordinator", "", "multi-process: host:port of process 0"
                                   " (not needed under SLURM or Open MPI: detected)")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 0, "multi-process: number of processes")
_PROCESS_ID = flags.DEFINE_integer("process_id", -1, "multi-process: this process's index")
# compile
_TARGET = flags.DEFINE_string("target", "local", "compile: `local` (this machine's devices) or a"
                              " GPU cluster such as h100x8, h100x64, h200x16 (no GPU needed)")
_HLO = flags.DEFINE_string("hlo", "", "compile: write the optimized HLO to this file")
# memory / plan
_MODEL = flags.DEFINE_string("model", "", "memory/plan: model preset (e.g. llama3_70b,"
                             " playbook_8b, mixtral_8x7b); memory without it reads --config")
_GPU = flags.DEFINE_string("gpu", "h100", "memory/plan: h100, h200, a100, b200 or a profile .json")
_SEQ = flags.DEFINE_integer("seq", 4096, "memory/plan: sequence length")
_LAYOUT = flags.DEFINE_string("layout", "", "memory: e.g. data=4,tensor=2,pipeline=2,zero=1,mbs=4,"
                              "ga=16,remat=selective,sp=1,schedule=1f1b (also fsdp=, context=,"
                              " expert=, vpp=; aliases dp=, tp=, pp=, cp=, ep=)")
_PRECISION = flags.DEFINE_string("precision", "playbook", "memory/plan: playbook (bf16 + fp32"
                                 " master, Adam fp32), playbook_fp32_accum, fp32, or trainer"
                                 " (what trainer/ stores today: fp32 params, grads and moments)")
_PLOT = flags.DEFINE_string("plot", "", "memory: write a stacked bar chart of the breakdown here")
_GPUS = flags.DEFINE_integer("gpus", 0, "plan: number of GPUs (default nodes x gpus_per_node);"
                             " memory --config: devices the mesh fills")
_NODES = flags.DEFINE_integer("nodes", 1, "plan: number of nodes")
_GPUS_PER_NODE = flags.DEFINE_integer("gpus_per_node", 0, "plan: GPUs per node (default: the"
                                      " profile's, 8)")
_BATCH = flags.DEFINE_string("global_batch_tokens", "1M", "plan: tokens per step (1M = 2**20)")
_TOP = flags.DEFINE_integer("top_k", 10, "plan: layouts to print")
_OUT = flags.DEFINE_string("out", "", "plan: config file to write for the best layout (default"
                           " plan_<model>_<gpus>.py); convert: the output directory")
# convert
_FROM = flags.DEFINE_enum("from", "", ["", "hf"], "convert: source format (hf: --model_dir)")
_TO = flags.DEFINE_enum("to", "", ["", "hf"], "convert: target format (source: --workdir)")
_MODEL_DIR = flags.DEFINE_string("model_dir", "", "convert: a Hugging Face model directory")

_CONFIG = None  # defined in main(): ml-collections reads sys.argv overrides at definition time


def fail(message: str) -> None:
  sys.exit(f"meshtron: error: {message}")


def _check_config_keys(argv: list[str]) -> None:
  """Names the first `--config.a.b=` override that is not a field, with the valid fields."""
  import configs
  for arg in argv:
    if not arg.startswith("--config."):
      continue
    node = configs.get("debug")
    path = arg[len("--config."):].split("=", 1)[0].split(".")
    for depth, key in enumerate(path):
      if not dataclasses.is_dataclass(node):
        fail(f"config key --config.{'.'.join(path[:depth])} is a value, not a section")
      fields = [f.name for f in dataclasses.fields(node)]
      if key not in fields:
        fail(f"unknown config key {arg.split('=', 1)[0]}: {type(node).__name__} has no field"
             f" {key!r} (fields: {', '.join(fields)})")
      node = getattr(node, key)


def _parse(argv: list[str]) -> list[str]:
  """Flag parsing with one-line errors instead of tracebacks (unknown keys, wrong types)."""
  try:
    return flags.FLAGS(argv)
  except KeyError as e:  # ml-collections: a config field that does not exist
    fail(f"unknown config key: {e.args[0]}")
  except (flags.Error, ValueError, TypeError) as e:
    fail(str(e).splitlines()[0])


def _plan_verb(verb: str) -> None:
  """`memory` and `plan`: analytic, no devices, no compile."""
  from trainer import planning
  common = dict(gpu=_GPU.value, seq=_SEQ.value, precision=_PRECISION.value, as_json=_JSON.value)
  if verb == "memory":
    config_given = any(a.startswith("--config") for a in sys.argv)
    planning.run_memory(_CONFIG.value, config_given, model=_MODEL.value, layout=_LAYOUT.value,
                        plot=_PLOT.value, gpus=_GPUS.value, **common)
  else:
    planning.run_plan(model=_MODEL.value, gpus=_GPUS.value, nodes=_NODES.value,
                      gpus_per_node=_GPUS_PER_NODE.value, global_batch_tokens=_BATCH.value,
                      top_k=_TOP.value, out=_OUT.value, **common)


def _device_verb(verb: str) -> None:
  """`train`, `compile` and `convert`: after the device set-up and jax.distributed."""
  from trainer import convert, loop
  from trainer.trainer import Trainer
  config = _CONFIG.value
  if verb == "convert":
    convert.run(_FROM.value, _TO.value, _MODEL_DIR.value, _OUT.value, _WORKDIR.value)
  elif verb == "compile":
    from sharding.xla import compiled
    from trainer.compile import compile_report
    rep, device_memory = compile_report(convert.resolve_init_from(config), _TARGET.value,
                                        _HLO.value)
    print(json.dumps(dataclasses.asdict(rep)) if _JSON.value
          else compiled.format_report(rep, device_memory))
  elif _DRY_RUN.value:
    print(Trainer(convert.resolve_init_from(config)).sharding_report())
  else:
    loop.run(convert.resolve_init_from(config), _WORKDIR.value)


def _main(argv: list[str]) -> None:
  if len(argv) > 1:
    fail(f"unexpected arguments {argv[1:]}")
  verb = argv[0].split()[-1]
  if verb in ("memory", "plan"):
    try:
      return _plan_verb(verb)
    except ValueError as e:
      fail(str(e).splitlines()[0])
  if _CPU_DEVICES.value:  # must precede any JAX backend use
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", _CPU_DEVICES.value)
  from trainer import distributed, loop  # after the device set-up: must not start JAX
  try:
    distributed.initialize(_CONFIG.value.distributed, _COORDINATOR.value, _NUM_PROCESSES.value,
                           _PROCESS_ID.value)
    distributed.exit_hard_on_error(_device_verb, verb)
  except (ValueError, loop.TrainingError) as e:  # bad input, or a stop such as a NaN loss
    fail(str(e).splitlines()[0])


def main() -> None:
  """The `meshtron` console script (and `python -m trainer.cli`)."""
  host_memory.reexec_with_tunables()
  if len(sys.argv) < 2 or sys.argv[1] not in VERBS:
    fail(f"usage: meshtron {{{'|'.join(VERBS)}}} [--flags]; e.g. meshtron train --config=debug")
  if sys.argv[1] in ("memory", "plan"):  # analytic: JAX (imported by sharding/) needs no GPU
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from ml_collections import config_flags
  import configs
  global _CONFIG
  _check_config_keys(sys.argv[2:])
  try:
    _CONFIG = config_flags.DEFINE_config_dataclass(
        "config", configs.get("debug"), "preset name or path/to/config.py; override fields with"
        " --config.a.b=value", parse_fn=configs.get)
  except KeyError as e:
    fail(f"unknown config key: {e.args[0]}")
  app.run(_main, argv=[f"meshtron {sys.argv[1]}"] + sys.argv[2:], flags_parser=_parse)


if __name__ == "__main__":
  main()
