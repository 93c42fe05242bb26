"""`meshtron <verb>`: parses flags and configs (bad input is one line), then runs the verb."""

import dataclasses
import json
import sys

from absl import app, flags
from ml_collections import config_flags

import configs
from trainer import host_memory
from trainer import plan_cli  # defines the memory/plan flags

VERBS = ("train", "compile", "memory", "plan", "convert")
_CONFIG = None  # defined in run(): ml-collections reads sys.argv overrides at definition time
_WORKDIR = flags.DEFINE_string("workdir", "runs/default", "train: where metrics, plots and"
                               " samples go; convert --to=hf: the run (or --from=hf output) to"
                               " export")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 0, "simulate N CPU devices (0: JAX's default)")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "train: print the sharding of every parameter and"
                             " activation, check the layout, and exit without training")
_TARGET = flags.DEFINE_string("target", "local", "compile: `local` (this machine's devices) or a"
                              " GPU cluster such as h100x8, h100x64, h200x16 (no GPU needed)")
_JSON = flags.DEFINE_bool("json", False, "compile/memory/plan: print JSON")
_HLO = flags.DEFINE_string("hlo", "", "compile: write the optimized HLO to this file")
_COORDINATOR = flags.DEFINE_string("coordinator", "", "multi-process: host:port of process 0"
                                   " (not needed under SLURM or Open MPI: detected)")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 0, "multi-process: number of processes")
_PROCESS_ID = flags.DEFINE_integer("process_id", -1, "multi-process: this process's index")
_FROM = flags.DEFINE_enum("from", "", ["", "hf"], "convert: source format (hf: --model_dir)")
_TO = flags.DEFINE_enum("to", "", ["", "hf"], "convert: target format (source: --workdir)")
_MODEL_DIR = flags.DEFINE_string("model_dir", "", "convert: a Hugging Face model directory")


def _fail(message: str) -> None:
  sys.exit(f"meshtron: error: {message}")


def _check_config_keys(argv: list[str]) -> None:
  """Names the first `--config.a.b=` override that is not a field, with the valid fields."""
  for arg in argv:
    if not arg.startswith("--config."):
      continue
    node = configs.get("debug")
    path = arg[len("--config."):].split("=", 1)[0].split(".")
    for depth, key in enumerate(path):
      if not dataclasses.is_dataclass(node):
        _fail(f"config key --config.{'.'.join(path[:depth])} is a value, not a section")
      fields = [f.name for f in dataclasses.fields(node)]
      if key not in fields:
        _fail(f"unknown config key {arg.split('=', 1)[0]}: {type(node).__name__} has no field"
              f" {key!r} (fields: {', '.join(fields)})")
      node = getattr(node, key)


def _parse(argv: list[str]) -> list[str]:
  """Flag parsing with one-line errors instead of tracebacks (unknown keys, wrong types)."""
  try:
    return flags.FLAGS(argv)
  except KeyError as e:  # ml-collections: a config field that does not exist
    _fail(f"unknown config key: {e.args[0]}")
  except (flags.Error, ValueError, TypeError) as e:
    _fail(str(e).splitlines()[0])


def _compile(config) -> None:
  from sharding.xla import compiled
  from trainer.compile import compile_report
  rep, device_memory = compile_report(config, _TARGET.value, _HLO.value)
  if _JSON.value:
    print(json.dumps(dataclasses.asdict(rep)))
  else:
    print(compiled.format_report(rep, device_memory))


def _main(argv: list[str]) -> None:
  if len(argv) > 1:
    _fail(f"unexpected arguments {argv[1:]}")
  verb = argv[0].split()[-1]
  if verb in ("memory", "plan"):  # analytic: no devices, no compile
    try:
      return plan_cli.run(verb, _CONFIG.value, any(a.startswith("--config") for a in sys.argv))
    except ValueError as e:
      _fail(str(e).splitlines()[0])
  if _CPU_DEVICES.value:  # must precede any JAX backend use
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", _CPU_DEVICES.value)
  from trainer import distributed, loop  # after the device set-up: must not start JAX
  try:
    distributed.initialize(_CONFIG.value.distributed, _COORDINATOR.value, _NUM_PROCESSES.value,
                           _PROCESS_ID.value)
    distributed.exit_hard_on_error(_run_verb, verb, loop)
  except (ValueError, loop.TrainingError) as e:  # bad input, or a stop such as a NaN loss
    _fail(str(e).splitlines()[0])


def _run_verb(verb: str, loop) -> None:
  from trainer import convert
  if verb == "convert":
    # --out is shared with `plan` (defined in plan_cli): here, the output directory.
    convert.run(_FROM.value, _TO.value, _MODEL_DIR.value, flags.FLAGS.out, _WORKDIR.value)
  elif verb == "compile":
    _compile(convert.resolve_init_from(_CONFIG.value))
  elif _DRY_RUN.value:
    print(loop.Trainer(convert.resolve_init_from(_CONFIG.value)).sharding_report())
  else:
    loop.run(convert.resolve_init_from(_CONFIG.value), _WORKDIR.value)


def run() -> None:
  """CLI entry (the `meshtron` script, via host_memory.meshtron, or `python -m trainer.main`):
  `meshtron train --config=debug --workdir=runs/x [--config.x.y=v]`."""
  host_memory.reexec_with_tunables()
  if len(sys.argv) < 2 or sys.argv[1] not in VERBS:
    _fail(f"usage: meshtron {{{'|'.join(VERBS)}}} [--flags]; e.g. meshtron train --config=debug")
  global _CONFIG
  _check_config_keys(sys.argv[2:])
  try:
    _CONFIG = config_flags.DEFINE_config_dataclass(
        "config", configs.get("debug"), "preset name or path/to/config.py; override fields with"
        " --config.a.b=value", parse_fn=configs.get)
  except KeyError as e:
    _fail(f"unknown config key: {e.args[0]}")
  app.run(_main, argv=[f"meshtron {sys.argv[1]}"] + sys.argv[2:], flags_parser=_parse)


if __name__ == "__main__":
  run()
