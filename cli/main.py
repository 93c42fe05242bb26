"""`meshtron <verb>`: the console script. It restarts under the trainer's malloc settings
(trainer/process/host_memory.py) before anything heavy (JAX, the configs) is imported, parses the
command line (cli/flags.py: one line on stderr for anything wrong), starts the devices and
jax.distributed where a verb needs them, and hands the verb to its module. The logic lives there.

  meshtron train --config=debug --workdir=runs/x [--config.a.b=value ...]
  meshtron compile --config=llama3_8b --target=h100x64
  meshtron memory --model=llama3_70b --layout=data=8,tensor=8,zero=1
  meshtron plan --model=llama3_70b --nodes=8
  meshtron convert --from=hf --model_dir=DIR --out=DIR
"""

import logging as pylogging
import os
import signal
import sys

from absl import app, flags as absl_flags

from cli import bug_report, console, flags
from cli.console import fail
from trainer.process import cpu_threads, host_memory

CONFIG = None  # the --config flag, defined in run(): ml-collections reads sys.argv's overrides


def main() -> None:
  """The `meshtron` console script (and `python -m cli.main`)."""
  host_memory.reexec_with_tunables()
  console.quiet_unraisable_asyncio()
  if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    # Ends the command from the handler: raised as KeyboardInterrupt, a Ctrl-C landing in a
    # garbage-collection callback (JAX's) was printed and dropped by Python, and training ran on.
    signal.signal(signal.SIGINT, _interrupted)
  try:
    run()
  except KeyboardInterrupt:  # before training installed its own Ctrl-C handling
    _interrupted()


def _interrupted(*_) -> None:
  # At once: a Ctrl-C during start-up can leave native threads (a compile, the data loader)
  # running, and the interpreter's shutdown around them crashed (a segmentation fault dump
  # after the line). Nothing is left to save.
  from trainer.process import workdir  # light: no JAX
  workdir.remove_if_unused()
  fail("interrupted; nothing was saved", code=130, at_once=True)


def run() -> None:
  """Runs the command in sys.argv (["meshtron", VERB, --flags...]) in this process."""
  argv = sys.argv
  if len(argv) == 2 and argv[1] in ("-h", "--help", "help"):
    print(flags.help_text(None))
    return
  if len(argv) < 2 or argv[1] not in flags.VERBS:
    fail(f"usage: meshtron {{{'|'.join(flags.VERBS)}}} [--flags]; e.g. meshtron train"
         " --config=debug; meshtron --help lists the verbs", code=2)
  verb = argv[1]
  if verb in ("memory", "plan"):  # analytic: JAX (imported by sharding/) needs no GPU
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  console.prefer_cpu_without_accelerators()
  if any(a in ("-h", "--help", "--helpshort", "--helpfull") for a in argv[2:]):
    with console.native_noise_filtered():  # the presets' import starts JAX
      text = flags.help_text(verb)
    print(text)
    return
  from ml_collections import config_flags
  with console.native_noise_filtered():
    import configs
  global CONFIG
  flags.check_config_keys(argv[2:])
  # Re-entrant (tests run several commands in one process): every flag back to its default.
  absl_flags.FLAGS.unparse_flags()
  for name in [n for n in absl_flags.FLAGS if n == "config" or n.startswith("config.")]:
    delattr(absl_flags.FLAGS, name)
  try:
    CONFIG = config_flags.DEFINE_config_dataclass(
        "config", configs.get("debug"), "preset name or path/to/config.py; override fields with"
        " --config.a.b=value", parse_fn=configs.get)
  except KeyError as e:
    fail(f"unknown config key: {e.args[0]}")
  try:
    app.run(_dispatch, argv=[f"meshtron {verb}"] + argv[2:], flags_parser=flags.parse)
  except Exception as e:  # noqa: BLE001  (what no one-line refusal caught is a bug: reported)
    refuse_or_report(e)


def start_backends(jax) -> None:
  """Starts JAX's backends, or ends with one line when none can start (JAX_PLATFORMS=cuda on a
  machine without a usable GPU: JAX logs the plugin's traceback, then asserts)."""
  bridge = pylogging.getLogger("jax._src.xla_bridge")
  level = bridge.level
  bridge.setLevel(pylogging.CRITICAL)  # its plugin tracebacks: the line below says it
  try:
    with console.native_noise_filtered():  # the backends start here
      jax.devices()
  except (RuntimeError, AssertionError) as e:
    platforms = os.environ.get("JAX_PLATFORMS", "")
    cause = str(e).strip().splitlines()[0] if str(e).strip() else "no backend initialized"
    fail(f"JAX could not start the devices JAX_PLATFORMS={platforms or '(unset)'} asks for"
         f" ({cause}); unset JAX_PLATFORMS or set it to cpu, or fix the GPU's drivers")
  finally:
    bridge.setLevel(level)


def refuse_or_report(error: Exception, refusals: tuple = (ValueError,)) -> None:
  """Ends the command with one line: a refusal's own (bad input, a training stop), or, for
  anything else, that it is a bug and where its report (traceback, config) was written."""
  fail(one_line(error, refusals))


def one_line(error: BaseException, refusals: tuple = (ValueError,)) -> str:
  """A refusal's own first line, or the bug line naming the report written for `error`."""
  if bug_report.is_refusal(error, refusals):
    return str(error).splitlines()[0]
  try:
    config = CONFIG.value
  except Exception:  # noqa: BLE001  (not parsed: the report says so)
    config = None
  workdir = flags.WORKDIR.value if flags.WORKDIR.present else ""  # the run's, when named
  return bug_report.summary(error, bug_report.write(error, config, workdir))


def _dispatch(argv: list[str]) -> None:
  if len(argv) > 1:
    fail(f"unexpected arguments {argv[1:]}")
  # JAX's own INFO lines (backend probing, the distributed service) are not for the user.
  pylogging.getLogger("jax").setLevel(pylogging.WARNING)
  verb = argv[0].split()[-1]
  if flags.SHOW_CONFIG.value:
    from trainer.config import describe_fields
    print("\n".join(describe_fields(CONFIG.value)))
    return
  try:
    flags.check_output_files(verb)
  except ValueError as e:
    refuse_or_report(e)
  if verb in ("memory", "plan"):  # analytic: no devices, no compile
    try:
      with console.native_noise_filtered():
        from cli import memory, plan
      if verb == "memory":
        return memory.run(CONFIG.value, any(a.startswith("--config") for a in sys.argv))
      return plan.run()
    except ValueError as e:
      refuse_or_report(e)
  try:
    CONFIG.value.validate()  # every setting in range, every path present: before JAX starts
  except ValueError as e:
    refuse_or_report(e)
  import jax
  if flags.CPU_DEVICES.value:  # must precede any JAX backend use
    cpu_threads.ensure_threads_for(flags.CPU_DEVICES.value)
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", flags.CPU_DEVICES.value)
  # After the device set-up: these must not start JAX.
  from cli import compile as compile_verb, convert, train
  from trainer import loop
  from trainer.process import distributed
  verbs = {"train": train.run, "compile": compile_verb.run, "convert": convert.run_flags}
  try:
    distributed.initialize(CONFIG.value.distributed, flags.COORDINATOR.value,
                           flags.NUM_PROCESSES.value, flags.PROCESS_ID.value)
    start_backends(jax)
    distributed.exit_hard_on_error(
        verbs[verb], CONFIG.value,
        describe=lambda e: one_line(e, (ValueError, loop.TrainingError)))
  except (ValueError, loop.TrainingError) as e:  # bad input, or a stop such as a NaN loss
    refuse_or_report(e, (ValueError, loop.TrainingError))


if __name__ == "__main__":
  main()
