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
import logging as pylogging
import os
import sys
import textwrap

from absl import app, flags

from trainer import console, host_memory
from trainer.console import fail

VERBS = {
    "train": "train a config in --workdir; rerunning the same command resumes from its latest"
             " checkpoint",
    "compile": "compile the train step ahead of time, for this machine or a described GPU cluster"
               " (no GPU needed), and report memory, FLOPs and every collective",
    "memory": "per-device memory and predicted step time of one layout (analytic, no devices)",
    "plan": "every valid layout of a model on a cluster, ranked by predicted throughput",
    "convert": "Hugging Face safetensors <-> meshtron checkpoints",
}
# The flags each verb reads (its --help lists them; the config flag is defined in main()).
VERB_FLAGS = {
    "train": ("config", "workdir", "cpu_devices", "dry_run", "show_config", "coordinator",
              "num_processes", "process_id"),
    "compile": ("config", "target", "hlo", "json", "cpu_devices", "show_config"),
    "memory": ("model", "layout", "gpu", "seq", "precision", "plot", "json", "config", "gpus",
               "show_config"),
    "plan": ("model", "gpu", "nodes", "gpus_per_node", "gpus", "seq", "global_batch_tokens",
             "precision", "top_k", "compile_top", "out", "json"),
    "convert": ("from", "to", "model_dir", "workdir", "out", "overwrite"),
}

# All verbs.
_WORKDIR = flags.DEFINE_string("workdir", "runs/default", "train: where metrics, plots and"
                               " samples go; convert --to=hf: the run (or --from=hf output) to"
                               " export")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 0, "simulate N CPU devices (0: JAX's default)")
_JSON = flags.DEFINE_bool("json", False, "compile/memory/plan: print JSON")
_SHOW_CONFIG = flags.DEFINE_bool("show_config", False, "print every config field with its type and"
                                 " value (overrides applied), then exit")
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
_COMPILE_TOP = flags.DEFINE_integer(
    "compile_top", 0, "plan: compile the best K layouts for the cluster without a GPU (h100/h200,"
    " 2 at a time) and rank them again by the step predicted from each program")
_OUT = flags.DEFINE_string("out", "", "plan: write the best layout as a config file here (none"
                           " without it); convert: the output directory")
# convert
_FROM = flags.DEFINE_enum("from", "", ["", "hf"], "convert: source format (hf: --model_dir)")
_TO = flags.DEFINE_enum("to", "", ["", "hf"], "convert: target format (source: --workdir)")
_MODEL_DIR = flags.DEFINE_string("model_dir", "", "convert: a Hugging Face model directory")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "convert: write into a non-empty --out or"
                               " workdir export directory")

_CONFIG = None  # defined in main(): ml-collections reads sys.argv overrides at definition time


def _config_spec(argv: list[str]) -> str:
  """The --config value of the command line (the last one), "debug" without one."""
  spec = "debug"
  for i, arg in enumerate(argv):
    if arg.startswith("--config="):
      spec = arg[len("--config="):]
    elif arg == "--config" and i + 1 < len(argv):
      spec = argv[i + 1]
  return spec


def _check_config_keys(argv: list[str]) -> None:
  """Builds the chosen config (one line for a bad preset or config file) and names the first
  `--config.a.b=` override that is not one of its fields, with the valid fields."""
  import configs
  spec = _config_spec(argv)
  try:
    base = configs.get(spec)
  except ValueError as e:
    fail(str(e).splitlines()[0])
  for arg in argv:
    if not arg.startswith("--config."):
      continue
    node, key_path = base, arg[len("--config."):].split("=", 1)[0].split(".")
    for depth, key in enumerate(key_path):
      section = ".".join(key_path[:depth])
      if node is None:
        hint = (f" (a dense model): start from a MoE preset ({', '.join(configs.moe.MODELS)})"
                if section == "model.moe" else "")
        fail(f"config key {arg.split('=', 1)[0]}: {section} is None in --config={spec}{hint}")
      if not dataclasses.is_dataclass(node):
        fail(f"config key {arg.split('=', 1)[0]}: {section} is a value, not a section")
      fields = [f.name for f in dataclasses.fields(node)]
      if key not in fields:
        fail(f"unknown config key {arg.split('=', 1)[0]}: {type(node).__name__} has no field"
             f" {key!r} (fields: {', '.join(fields)})")
      node = getattr(node, key)


def _help(verb: str | None) -> str:
  """`meshtron --help` (the verbs) or `meshtron VERB --help` (its flags, the presets and how to
  see every config field)."""
  if verb is None:
    lines = ["usage: meshtron VERB [--flags]   (meshtron VERB --help for a verb's flags)", "",
             "verbs:"]
    lines += [textwrap.fill(text, 99, initial_indent=f"  {name:<9}", subsequent_indent=" " * 11)
              for name, text in VERBS.items()]
    return "\n".join(lines)
  import configs
  lines = [f"meshtron {verb}: {VERBS[verb]}", "",
           f"usage: meshtron {verb} [--flags]" + (" [--config.a.b=value ...]"
                                                 if "config" in VERB_FLAGS[verb] else ""), "",
           "flags:"]
  for name in VERB_FLAGS[verb]:
    flag = flags.FLAGS[name] if name in flags.FLAGS else None
    text = flag.help if flag is not None else (
        "preset name or path/to/config.py (default debug); override fields with"
        " --config.a.b=value")
    default = f" (default {flag.default!r})" if flag is not None and flag.default not in (
        "", None, False) else ""
    lines.append(textwrap.fill(f"{text}{default}", 99, initial_indent=f"  --{name:<21}",
                               subsequent_indent=" " * 25))
  if "config" in VERB_FLAGS[verb]:
    lines += ["", f"presets: {', '.join(configs.names())}",
              f"every config field with its type and value: meshtron {verb} --config=debug"
              " --show_config"]
  return "\n".join(lines)


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
  with console.native_noise_filtered():
    from trainer import planning
  common = dict(gpu=_GPU.value, seq=_SEQ.value, precision=_PRECISION.value, as_json=_JSON.value)
  if verb == "memory":
    config_given = any(a.startswith("--config") for a in sys.argv)
    planning.run_memory(_CONFIG.value, config_given, model=_MODEL.value, layout=_LAYOUT.value,
                        plot=_PLOT.value, gpus=_GPUS.value, **common)
  else:
    planning.run_plan(model=_MODEL.value, gpus=_GPUS.value, nodes=_NODES.value,
                      gpus_per_node=_GPUS_PER_NODE.value, global_batch_tokens=_BATCH.value,
                      top_k=_TOP.value, out=_OUT.value, compile_top=_COMPILE_TOP.value,
                      **common)


def _device_verb(verb: str) -> None:
  """`train`, `compile` and `convert`: after the device set-up and jax.distributed."""
  from trainer import convert, loop
  from trainer.trainer import Trainer
  config = _CONFIG.value
  if verb == "convert":
    convert.run(_FROM.value, _TO.value, _MODEL_DIR.value, _OUT.value, _WORKDIR.value,
                _OVERWRITE.value)
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
  # JAX's own INFO lines (backend probing, the distributed service) are not for the user.
  pylogging.getLogger("jax").setLevel(pylogging.WARNING)
  verb = argv[0].split()[-1]
  if _SHOW_CONFIG.value:
    from trainer.config import describe_fields
    print("\n".join(describe_fields(_CONFIG.value)))
    return
  if verb in ("memory", "plan"):
    try:
      return _plan_verb(verb)
    except ValueError as e:
      fail(str(e).splitlines()[0])
  try:
    _CONFIG.value.validate()  # every setting in range, every path present: before JAX starts
  except ValueError as e:
    fail(str(e).splitlines()[0])
  import jax
  if _CPU_DEVICES.value:  # must precede any JAX backend use
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", _CPU_DEVICES.value)
  from trainer import distributed, loop  # after the device set-up: must not start JAX
  try:
    distributed.initialize(_CONFIG.value.distributed, _COORDINATOR.value, _NUM_PROCESSES.value,
                           _PROCESS_ID.value)
    with console.native_noise_filtered():  # the backends start here
      jax.devices()
    distributed.exit_hard_on_error(_device_verb, verb)
  except (ValueError, loop.TrainingError) as e:  # bad input, or a stop such as a NaN loss
    fail(str(e).splitlines()[0])


def main() -> None:
  """The `meshtron` console script (and `python -m trainer.cli`)."""
  host_memory.reexec_with_tunables()
  console.quiet_unraisable_asyncio()
  try:
    _start()
  except KeyboardInterrupt:  # before training installed its own Ctrl-C handling
    fail("interrupted; nothing was saved", code=130)


def _start() -> None:
  if len(sys.argv) == 2 and sys.argv[1] in ("-h", "--help", "help"):
    print(_help(None))
    return
  if len(sys.argv) < 2 or sys.argv[1] not in VERBS:
    fail(f"usage: meshtron {{{'|'.join(VERBS)}}} [--flags]; e.g. meshtron train --config=debug;"
         " meshtron --help lists the verbs", code=2)
  verb = sys.argv[1]
  if verb in ("memory", "plan"):  # analytic: JAX (imported by sharding/) needs no GPU
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  console.prefer_cpu_without_accelerators()
  if any(a in ("-h", "--help", "--helpshort", "--helpfull") for a in sys.argv[2:]):
    with console.native_noise_filtered():  # the presets' import starts JAX
      text = _help(verb)
    print(text)
    return
  from ml_collections import config_flags
  with console.native_noise_filtered():
    import configs
  global _CONFIG
  _check_config_keys(sys.argv[2:])
  # Re-entrant (tests run several commands in one process): every flag back to its default.
  flags.FLAGS.unparse_flags()
  for name in [n for n in flags.FLAGS if n == "config" or n.startswith("config.")]:
    delattr(flags.FLAGS, name)
  try:
    _CONFIG = config_flags.DEFINE_config_dataclass(
        "config", configs.get("debug"), "preset name or path/to/config.py; override fields with"
        " --config.a.b=value", parse_fn=configs.get)
  except KeyError as e:
    fail(f"unknown config key: {e.args[0]}")
  app.run(_main, argv=[f"meshtron {sys.argv[1]}"] + sys.argv[2:], flags_parser=_parse)


if __name__ == "__main__":
  main()
