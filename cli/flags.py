"""Every flag of `meshtron`, which verb reads which, the `--help` texts, and the parsing steps
that turn a bad command line into one line on stderr (cli/console.py) before anything runs."""

import dataclasses
import os
import textwrap

from absl import flags

from cli.console import fail

VERBS = {
    "train": "train a config in --workdir; rerunning the same command resumes from its latest"
             " checkpoint",
    "compile": "compile the train step ahead of time, for this machine or a described GPU cluster"
               " (no GPU needed), and report memory, FLOPs and every collective",
    "memory": "per-device memory and predicted step time of one layout (analytic, no devices)",
    "plan": "every valid layout of a model on a cluster, ranked by predicted throughput",
    "convert": "Hugging Face safetensors <-> meshtron checkpoints",
}
# The flags each verb reads (its --help lists them; the config flag is defined by cli.main).
VERB_FLAGS = {
    "train": ("config", "workdir", "cpu_devices", "dry_run", "show_config", "coordinator",
              "num_processes", "process_id"),
    "compile": ("config", "target", "hlo", "timeline", "json", "cpu_devices", "show_config",
                "overwrite"),
    "memory": ("model", "layout", "gpu", "seq", "precision", "activations", "plot", "json",
               "config", "gpus", "show_config", "overwrite"),
    "plan": ("model", "gpu", "nodes", "gpus_per_node", "gpus", "seq", "global_batch_tokens",
             "precision", "activations", "top_k", "compile_top", "out", "json", "overwrite"),
    "convert": ("from", "to", "model_dir", "workdir", "out", "overwrite", "cpu_devices"),
}

# All verbs.
WORKDIR = flags.DEFINE_string("workdir", "runs/default", "train: where metrics, plots and"
                              " samples go; convert --to=hf: the run (or --from=hf output) to"
                              " export")
CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 0, "simulate N CPU devices (0: JAX's default;"
                                   " at most 1024: each holds its own buffers)", lower_bound=0,
                                   upper_bound=1024)
JSON = flags.DEFINE_bool("json", False, "compile/memory/plan: print JSON")
SHOW_CONFIG = flags.DEFINE_bool("show_config", False, "print every config field with its type and"
                                " value (overrides applied), then exit")
# train
DRY_RUN = flags.DEFINE_bool("dry_run", False, "train: print the sharding of every parameter and"
                            " activation, check the layout, and exit without training")
COORDINATOR = flags.DEFINE_string("coordinator", "", "multi-process: host:port of process 0"
                                  " (not needed under SLURM or Open MPI: detected)")
NUM_PROCESSES = flags.DEFINE_integer("num_processes", 0, "multi-process: number of processes")
PROCESS_ID = flags.DEFINE_integer("process_id", -1, "multi-process: this process's index")
# compile
TARGET = flags.DEFINE_string("target", "local", "compile: `local` (this machine's devices) or a"
                             " GPU cluster such as h100x8, h100x64, h200x16 (no GPU needed)")
HLO = flags.DEFINE_string("hlo", "", "compile: write the optimized HLO to this file")
TIMELINE = flags.DEFINE_bool("timeline", False, "compile: print the scheduled order of the"
                             " collectives and matmul kernels in the computation with the most"
                             " collectives (on GPUs the layer loop's body)")
# memory / plan
MODEL = flags.DEFINE_string("model", "", "memory/plan: model preset (e.g. llama3_70b,"
                            " playbook_8b, mixtral_8x7b); memory without it reads --config")
GPU = flags.DEFINE_string("gpu", "h100", "memory/plan: h100, h200, a100, b200 or a profile .json")
SEQ = flags.DEFINE_integer("seq", 4096, "memory/plan: sequence length", lower_bound=1)
LAYOUT = flags.DEFINE_string("layout", "", "memory: e.g. data=4,tensor=2,pipeline=2,zero=1,mbs=4,"
                             "ga=16,remat=selective,sp=1,schedule=1f1b (also fsdp=, context=,"
                             " expert=, vpp=; aliases dp=, tp=, pp=, cp=, ep=)")
PRECISION = flags.DEFINE_string("precision", "playbook", "memory/plan: playbook (bf16 + fp32"
                                " master, Adam fp32, gradients accumulated in bf16),"
                                " playbook_fp32_accum (in fp32, as Megatron accumulates bf16"
                                " runs), playbook_fp8 (its layer GEMMs fp8, as Megatron's FP8"
                                " recipes), fp32, or trainer (what trainer/ stores by default:"
                                " fp32 params, grads and moments); plan --compile_top and --out"
                                " build it")
ACTIVATIONS = flags.DEFINE_enum(
    "activations", "compiled", ["compiled", "llama"], "memory/plan: the activation formula."
    " compiled: what meshtron's GPU programs keep (docs/planning.md, Analytic and instant);"
    " llama: Korthikanti et al.'s per-layer terms (norm outputs, the SwiGLU product and a"
    " float32 copy of the logits besides)")
PLOT = flags.DEFINE_string("plot", "", "memory: write a stacked bar chart of the breakdown here")
GPUS = flags.DEFINE_integer("gpus", None, "plan: number of GPUs (default nodes x gpus_per_node);"
                            " memory --config: devices the mesh fills (default a node)",
                            lower_bound=1)
NODES = flags.DEFINE_integer("nodes", 1, "plan: number of nodes", lower_bound=1)
GPUS_PER_NODE = flags.DEFINE_integer("gpus_per_node", None, "plan: GPUs per node (default: the"
                                     " profile's, 8)", lower_bound=1)
BATCH = flags.DEFINE_string("global_batch_tokens", "1M", "plan: tokens per step (1M = 2**20)")
TOP = flags.DEFINE_integer("top_k", 10, "plan: layouts to print", lower_bound=1)
COMPILE_TOP = flags.DEFINE_integer(
    "compile_top", 0, "plan: compile the best K layouts for the cluster without a GPU (h100/h200,"
    " 2 at a time) and rank them again by the step predicted from each program")
OUT = flags.DEFINE_string("out", "", "plan: write the best layout as a config file here (none"
                          " without it); convert: the output directory")
# convert
FROM = flags.DEFINE_enum("from", "", ["", "hf"], "convert: source format (hf: --model_dir)")
TO = flags.DEFINE_enum("to", "", ["", "hf"], "convert: target format (source: --workdir)")
MODEL_DIR = flags.DEFINE_string("model_dir", "", "convert: a Hugging Face model directory")
OVERWRITE = flags.DEFINE_bool("overwrite", False, "convert: write into a non-empty --out or"
                              " workdir export directory; compile, memory, plan: replace an"
                              " existing --hlo, --plot or --out file")
# The files a verb writes where a flag says (convert's --out is a directory: convert checks it).
OUTPUT_FILES = {"compile": ("hlo",), "memory": ("plot",), "plan": ("out",)}


def check_output_files(verb: str) -> None:
  """Each file `verb` was asked to write: its directory exists, and the file does not unless
  --overwrite; train's --workdir is not empty (it would write into the current directory).
  Checked before any work, so a refusal costs nothing and changes nothing."""
  if verb == "train" and not WORKDIR.value.strip():
    raise ValueError("--workdir is empty; name the run's directory (default runs/default)")
  for name in OUTPUT_FILES.get(verb, ()):
    path = flags.FLAGS[name].value
    if not path:
      continue
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
      raise ValueError(f"--{name}={path}: the directory {folder} does not exist; create it"
                       " first")
    if os.path.isdir(path):
      raise ValueError(f"--{name}={path} is a directory; name a file in it")
    if os.path.exists(path) and not OVERWRITE.value:
      raise ValueError(f"--{name}={path} exists; pass --overwrite to replace it")


# How the model is computed (TrainConfig.compute), once ModelConfig fields.
COMPUTE_FIELDS = ("attention_impl", "context_impl", "ulysses_degree", "collective_matmul", "remat",
                  "scan_layers", "loss_impl", "loss_chunk_size", "fp8")


def config_spec(argv: list[str]) -> str:
  """The --config value of the command line (the last one), "debug" without one."""
  spec = "debug"
  for i, arg in enumerate(argv):
    if arg.startswith("--config="):
      spec = arg[len("--config="):]
    elif arg == "--config" and i + 1 < len(argv):
      spec = argv[i + 1]
  return spec


def check_config_keys(argv: list[str]) -> None:
  """Builds the chosen config (one line for a bad preset or config file) and names the first
  `--config.a.b=` override that is not one of its fields, with the valid fields."""
  import configs
  spec = config_spec(argv)
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
        moved = (f"; it moved to --config.compute.{key}" if section == "model"
                 and key in COMPUTE_FIELDS else "")
        fail(f"unknown config key {arg.split('=', 1)[0]}: {type(node).__name__} has no field"
             f" {key!r}{moved} (fields: {', '.join(fields)})")
      node = getattr(node, key)


def help_text(verb: str | None) -> str:
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


def parse(argv: list[str]) -> list[str]:
  """Flag parsing with one-line errors instead of tracebacks (unknown keys, wrong types, a flag
  of another verb). argv[0] is "meshtron VERB"."""
  try:
    rest = flags.FLAGS(argv)
  except KeyError as e:  # ml-collections: a config field that does not exist
    fail(f"unknown config key: {e.args[0]}")
  except flags.UnrecognizedFlagError as e:  # absl: "Unknown command line flag 'x'" alone
    verb = argv[0].split()[-1]
    fail(f"unknown flag --{e.flagname} for `meshtron {verb}`; its flags:"
         f" {', '.join('--' + n for n in VERB_FLAGS[verb])} (meshtron {verb} --help)")
  except (flags.Error, ValueError, TypeError) as e:
    fail(str(e).splitlines()[0])
  check_verb_flags(argv[0].split()[-1])
  return rest


def check_verb_flags(verb: str) -> None:
  """A flag given on the command line that `verb` does not read is refused, not ignored (e.g.
  `plan --workdir=...`, `memory --config.steps=3` with --model). absl's own flags pass."""
  ours = {name for names in VERB_FLAGS.values() for name in names}
  given = [name for name in flags.FLAGS if flags.FLAGS[name].present
           and (name in ours or name.startswith("config."))]
  allowed = set(VERB_FLAGS[verb])
  for name in given:
    if name not in allowed and not (name.startswith("config.") and "config" in allowed):
      fail(f"--{name} does not apply to `meshtron {verb}`; its flags:"
           f" {', '.join('--' + n for n in VERB_FLAGS[verb])} (meshtron {verb} --help)")
