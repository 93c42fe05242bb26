"""The error contract: bad input and faults end in exactly one line on stderr that says what is
wrong and how to fix it, before anything compiles, with the workdir's files byte-identical.

Most cases run the CLI in this process (cli.main.run; a `meshtron` start costs ~4 s);
those that need a process of their own (a dead peer, a second Ctrl-C) are at the end.
"""

import dataclasses
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import time

import jax
import pytest

from tests.test_checkpoint import environment
from cli import main as cli
from trainer.process import workdir as workdir_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def snapshot(root) -> dict:
  """Every file under `root` with its bytes' hash (directories too, as None)."""
  out = {}
  for base, dirs, files in os.walk(root):
    for name in dirs:
      out[os.path.relpath(os.path.join(base, name), root)] = None
    for name in files:
      path = os.path.join(base, name)
      out[os.path.relpath(path, root)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
  return out


@pytest.fixture
def run_cli(capfd, caplog, monkeypatch):
  """Runs `meshtron ARGV...` in this process: (exit code, stderr lines, compiles logged of the
  run's programs: the train step, its init and the eval step; building a Trainer also runs a
  few scalar ops eagerly, e.g. optax's init of a step counter, which are not those)."""
  jax.config.update("jax_log_compiles", True)

  def run(*argv):
    monkeypatch.setattr(sys, "argv", ["meshtron", *argv])
    capfd.readouterr()
    caplog.clear()
    with caplog.at_level(logging.DEBUG), pytest.raises(SystemExit) as exited:
      cli.run()
    err = capfd.readouterr().err
    compiles = [r.getMessage() for r in caplog.records if r.getMessage().startswith(
        ("Compiling jit(train_step", "Compiling jit(eval_step", "Compiling jit(init"))]
    return exited.value.code, [line for line in err.splitlines() if line.strip()], compiles

  yield run
  jax.config.update("jax_log_compiles", False)


def write(path, data: bytes) -> str:
  with open(path, "wb") as f:
    f.write(data)
  return str(path)


def cases(tmp):
  """(name, argv, fragment of the one error line)."""
  bad_syntax = write(tmp / "syntax.py", b"def get_config(:\n  pass\n")
  bad_import = write(tmp / "imports.py", b"import nosuchmodule\n")
  empty = write(tmp / "empty.txt", b"")
  binary = write(tmp / "binary.txt", bytes(range(256)) * 64)
  no_field = write(tmp / "docs.jsonl", b'{"body": "hello"}\n{"body": "again"}\n')
  not_a_dir = write(tmp / "a_file", b"x")
  (tmp / "hf_empty").mkdir()
  (tmp / "full").mkdir()
  write(tmp / "full" / "config.json", b"{}")
  steps = ["--config.steps=2", "--config.model.num_layers=1"]
  odd_runs = {}  # workdirs holding one of the run's entries as the wrong kind
  for name, is_dir in (("metrics.jsonl", False), ("tensorboard", True), ("checkpoints", True),
                       ("loss.png", False)):
    odd_runs[name] = tmp / f"odd_{name}"
    (odd_runs[name] / name).parent.mkdir()
    if is_dir:
      write(odd_runs[name] / name, b"a file")
    else:
      (odd_runs[name] / name).mkdir()
  return [
      *((f"workdir {name} of the wrong kind", ["train", f"--workdir={path}", *steps],
         f"{name} is a") for name, path in odd_runs.items()),
      ("unknown key", ["train", "--config.model.nope=3"], "unknown config key"),
      ("moe key on a dense preset", ["train", "--config=debug",
                                     "--config.model.moe.num_experts=6"], "model.moe is None"),
      ("unknown moe key", ["train", "--config=debug_moe", "--config.model.moe.nope=1"],
       "MoEConfig has no field 'nope'"),
      ("wrong type", ["train", "--config.steps=many"], "many"),
      ("unknown preset", ["train", "--config=llama9"], "unknown config 'llama9'"),
      ("config syntax", ["train", f"--config={bad_syntax}"], "line 1: SyntaxError"),
      ("config import", ["train", f"--config={bad_import}"], "ModuleNotFoundError"),
      ("eval_every=0", ["train", "--config.eval_every=0"], "eval_every=0 is out of range"),
      ("adam b2", ["train", "--config.optim.b2=1.5"], "optim.b2=1.5 is out of range"),
      ("spike factor", ["train", "--config.loss_spike_factor=0.5"], "loss_spike_factor=0.5"),
      ("fp8 dropless experts", ["train", "--config=debug_moe", "--config.compute.fp8.enabled=true",
                                "--config.model.moe.dispatch=dropless"],
       "compute.fp8.recipe='delayed' does not run the MoE experts"),
      ("unknown logical name", ["train", "--config.sharding_rules=embedz=fsdp", *steps],
       "names no logical dim"),
      ("mesh size", ["train", "--config.mesh.data=3", *steps], "3 devices but 8 are available"),
      ("batch split", ["train", "--config.mesh.data=8", "--config.batch_size=12", *steps],
       "batch_size=12 is not divisible by the data-parallel size 8"),
      ("missing data", ["train", "--config.data.source=/nonexistent/corpus"], "does not exist"),
      ("empty corpus", ["train", f"--config.data.source={empty}", *steps],
       "hold no documents"),
      ("binary corpus", ["train", f"--config.data.source={binary}", "--config.data.eval_fraction=0",
                         *steps], "is not UTF-8 text"),
      ("jsonl field", ["train", f"--config.data.source={no_field}", *steps], "no 'text' field"),
      ("tokenizer", ["train", "--config.data.tokenizer=/nope/tokenizer.json"],
       "data.tokenizer='/nope/tokenizer.json'"),
      ("restore_from", ["train", "--config.checkpoint.restore_from=/nowhere"],
       "restore_from='/nowhere' is not a directory"),
      ("init_from", ["train", f"--config.init_from=hf:{tmp / 'hf_empty'}"], "holds no config.json"),
      ("workdir under a file", ["train", f"--workdir={not_a_dir}/run", *steps],
       "lies under the file"),
      ("host memory", ["train", "--config.device_memory_gib=0.0001", *steps],
       "analytic estimate"),
      ("unknown model", ["memory", "--model=gpt5", "--layout=dp=8"], "unknown model 'gpt5'"),
      ("unknown gpu", ["plan", "--model=llama3_8b", "--gpu=tpu"], "unknown gpu 'tpu'"),
      ("compile_top gpu", ["plan", "--model=llama3_8b", "--gpu=a100", "--compile_top=2"],
       "--gpu=a100 has no deviceless target"),
      ("compile_top count", ["plan", "--model=llama3_8b", "--compile_top=-1"],
       "--compile_top=-1 must be 0"),
      ("convert model_dir", ["convert", "--from=hf", f"--model_dir={tmp / 'hf_empty'}",
                             f"--out={tmp / 'out'}"], "holds no config.json"),
      ("convert overwrite", ["convert", "--to=hf", f"--workdir={tmp}", f"--out={tmp / 'full'}"],
       "is not empty"),
      ("plan --out exists", ["plan", "--model=llama3_8b", f"--out={tmp / 'full' / 'config.json'}"],
       "exists; pass --overwrite to replace it"),
      ("memory --plot folder", ["memory", "--model=llama3_8b", "--layout=dp=8",
                                f"--plot={tmp / 'nowhere' / 'memory.png'}"], "does not exist"),
      ("compile --hlo exists", ["compile", f"--hlo={tmp / 'full' / 'config.json'}"],
       "exists; pass --overwrite to replace it"),
      ("compile --hlo folder", ["compile", f"--hlo={tmp / 'full'}"], "is a directory"),
      ("plan --seq=0", ["plan", "--model=llama3_8b", "--seq=0"], "--seq=0"),
      ("plan --gpus=-8", ["plan", "--model=llama3_8b", "--gpus=-8"], "--gpus=-8"),
      ("plan --nodes=-1", ["plan", "--model=llama3_8b", "--nodes=-1"], "--nodes=-1"),
      ("plan --gpus=0", ["plan", "--model=llama3_8b", "--gpus=0"], "--gpus=0: 0 is not a"),
      ("plan --gpus_per_node=0", ["plan", "--model=llama3_8b", "--gpus_per_node=0"],
       "--gpus_per_node=0: 0 is not a"),
      ("unknown flag", ["plan", "--model=llama3_8b", "--bogus=1"],
       "unknown flag --bogus for `meshtron plan`; its flags: --model"),
      ("memory --seq=-5", ["memory", "--model=llama3_8b", "--layout=dp=8", "--seq=-5"],
       "--seq=-5"),
      ("cpu_devices=-1", ["train", "--cpu_devices=-1"], "--cpu_devices=-1"),
      ("cpu_devices=100000", ["train", "--cpu_devices=100000"], "--cpu_devices=100000"),
      ("empty workdir", ["train", "--workdir="], "--workdir is empty"),
      ("preemption signal", ["train", "--config.checkpoint.preemption_signals=SIGTERM,SIGFOO"],
       "'SIGFOO' is not a signal a process can catch"),
      ("uncatchable signal", ["train", "--config.checkpoint.preemption_signals=SIGKILL"],
       "'SIGKILL' is not a signal"),
      ("rope_theta=0", ["train", "--config.model.rope_theta=0"], "model.rope_theta must be"),
      ("rope scaling 0", ["train", "--config.model.rope_scaling_factor=0"],
       "model.rope_scaling_factor must be positive"),
      ("rope freq factors", ["train", "--config.model.rope_scaling_factor=8",
                             "--config.model.rope_low_freq_factor=4"], "0 < model.rope_low_freq"),
      ("cudnn on a cpu", ["train", "--config.compute.attention_impl=cudnn", *steps],
       "attention_impl=cudnn runs only on NVIDIA GPUs with cuDNN, not on cpu devices"),
      ("cudnn deviceless", ["compile", "--target=h100x1", "--config.compute.attention_impl=cudnn"],
       "not on a deviceless GPU compile"),
      ("mesh.dcn syntax", ["train", "--config.mesh.dcn=data:2"],
       "mesh.dcn item 'data:2' must be axis=factor"),
      ("local device ids", ["train", "--config.distributed.local_device_ids=gpu0"],
       "distributed.local_device_ids='gpu0' must be 'auto' or GPU indices"),
      ("infinite learning rate", ["train", "--config.optim.learning_rate=inf"],
       "optim.learning_rate=inf is not a finite number"),
      ("plan: no tokens", ["plan", "--model=llama3_8b", "--global_batch_tokens=0"],
       "--global_batch_tokens='0' must be a positive number"),
      ("tracking backend", ["train", "--config.tracking=mlflow,neptune"],
       "'neptune' is not a tracking backend"),
      ("W&B mode", ["train", "--config.tracking=wandb", "--config.tracking_wandb_mode=sometimes"],
       "tracking_wandb_mode='sometimes' is not one of online"),
      ("W&B online, no login", ["train", "--config.tracking=wandb", *steps], "no W&B login"),
      ("unknown verb", ["fly"], "usage: meshtron"),
      ("a flag of another verb", ["plan", "--model=llama3_8b", f"--workdir={tmp}"],
       "--workdir does not apply to `meshtron plan`; its flags: --model,"),
      ("config override to plan", ["plan", "--model=llama3_8b", "--config.steps=3"],
       "--config.steps does not apply to `meshtron plan`"),
      ("compile --workdir", ["compile", f"--workdir={tmp}"],
       "--workdir does not apply to `meshtron compile`"),
      ("convert --json", ["convert", "--to=hf", f"--workdir={tmp}", "--json",
                          f"--out={tmp / 'new'}"], "--json does not apply to `meshtron convert`"),
      ("memory --model with overrides", ["memory", "--model=llama3_8b", "--layout=dp=8",
                                         "--config.steps=3"], "not both"),
      ("coordinator", ["train", "--coordinator=nohost", "--num_processes=2", "--process_id=0"],
       "--coordinator='nohost' must be host:port"),
      ("process id", ["train", "--coordinator=127.0.0.1:1234", "--num_processes=2",
                      "--process_id=2"], "--process_id=2 must be in [0, --num_processes=2)"),
  ]


def refusals_that_fail_the_contract(tmp_path, run_cli, table) -> list:
  """Runs each (name, argv, fragment) of `table`; returns those that do not end in exactly one
  line (naming `fragment`) with a non-zero exit, nothing compiled and no file changed."""
  workdir = tmp_path / "run"
  workdir.mkdir(exist_ok=True)
  (workdir / "notes.txt").write_text("a user's file")
  failures = []
  for name, argv, fragment in table:
    if argv[0] == "train" and not any(a.startswith("--workdir") for a in argv):
      argv = [*argv, f"--workdir={workdir}"]
    before = snapshot(tmp_path)
    code, lines, compiles = run_cli(*argv)
    problems = [f"exit code {code}" if code in (0, None) else "",
                f"{len(lines)} stderr lines" if len(lines) != 1 else "",
                "" if lines and lines[-1].startswith("meshtron: error:") and fragment in lines[-1]
                else f"message {lines[-1:]!r}",
                f"compiled {compiles[:1]}" if compiles else "",
                "files changed" if snapshot(tmp_path) != before else ""]
    if any(problems):
      failures.append((name, [p for p in problems if p], lines[-3:]))
  return failures


def test_every_bad_input_is_one_line_before_compiling_and_changes_nothing(tmp_path, run_cli,
                                                                          monkeypatch):
  for name in ("WANDB_API_KEY", "WANDB_MODE"):  # this machine's W&B login is not the case's
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
  inputs = tmp_path / "inputs"
  inputs.mkdir()
  failures = refusals_that_fail_the_contract(tmp_path, run_cli, cases(inputs))
  assert not failures, json.dumps(failures, indent=1)
  # The control: the same harness sees a good run compile its step and write its files.
  code, _, compiles = run_cli("train", f"--workdir={tmp_path / 'ok'}", "--config.steps=1",
                              "--config.model.num_layers=1", "--config.sample_tokens=0")
  assert code in (0, None) and compiles and (tmp_path / "ok" / "metrics.jsonl").exists()


def field_cases() -> list:
  """A value outside its range for every ranged setting, and nan for every float setting of
  every section (the debug preset's model included), each as the CLI override."""
  from configs import llama
  from trainer import config_checks
  cfg, table = llama.debug(), []
  for dotted, allowed in config_checks.RANGES.items():
    default = config_checks.value_of(cfg, dotted)
    if allowed.low > -config_checks.INF:
      bad = allowed.low if allowed.low_open else allowed.low - 1
    else:
      bad = allowed.high if allowed.high_open else allowed.high + 1
    bad = int(bad) if isinstance(default, int) else float(bad)
    table.append((dotted, ["train", f"--config.{dotted}={bad}"], f"{dotted}={bad!r}"))

  def floats(obj, prefix=""):
    for field in dataclasses.fields(obj):
      value = getattr(obj, field.name)
      if dataclasses.is_dataclass(value):
        yield from floats(value, f"{prefix}{field.name}.")
      elif isinstance(value, float):
        yield f"{prefix}{field.name}"
  table += [(f"{dotted}=nan", ["train", "--config=debug", f"--config.{dotted}=nan"], dotted)
            for dotted in floats(cfg)]
  return table


def test_every_setting_out_of_its_range_is_one_line_naming_it(tmp_path, run_cli):
  table = field_cases()
  assert len(table) > 50  # every ranged setting (34) and every float one (24)
  failures = refusals_that_fail_the_contract(tmp_path, run_cli, table)
  assert not failures, json.dumps(failures, indent=1)


@pytest.mark.parametrize("argv, fragment, platforms", [
    (["train", "--config.model.nope=3"], "unknown config key", None),
    (["train", "--cpu_devices=2", "--config.mesh.data=4"], "2 are available", None),
    (["train"], "JAX could not start the devices JAX_PLATFORMS=cuda asks for", "cuda"),
])
def test_a_fresh_process_prints_only_the_error(tmp_path, argv, fragment, platforms):
  """The console script in its own process: JAX's start-up lines on a machine without a GPU
  (the CUDA plugin's "Could not find cuda drivers") do not reach the terminal, nor, when
  JAX_PLATFORMS asks for a GPU this machine lacks, the plugin's traceback."""
  env = {k: v for k, v in environment().items() if k != "JAX_PLATFORMS"}  # as a user runs it
  if platforms:
    env["JAX_PLATFORMS"] = platforms
  proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "meshtron"), *argv,
                         f"--workdir={tmp_path}"], capture_output=True, text=True, env=env,
                        cwd=REPO, timeout=300)
  lines = [l for l in proc.stderr.splitlines() if l.strip()]
  assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-2000:]
  assert lines[0].startswith("meshtron: error:") and fragment in lines[0]


def test_help_lists_each_verbs_flags_and_the_presets(capfd, run_cli):
  for argv in (["--help"], ["train", "--help"], ["plan", "--help"]):
    sys.argv = ["meshtron", *argv]
    cli.run()
    out = capfd.readouterr().out
    assert "usage: meshtron" in out
  sys.argv = ["meshtron", "train", "--help"]
  cli.run()
  text = capfd.readouterr().out
  assert "--workdir" in text and "--dry_run" in text and "presets: debug" in text
  assert "--show_config" in text and "--gpus_per_node" not in text  # train's flags, not plan's


def test_show_config_prints_every_field_with_overrides_applied(capfd):
  sys.argv = ["meshtron", "train", "--config=debug_moe", "--config.model.moe.num_experts=6",
              "--show_config"]
  with pytest.raises(SystemExit) as exited:
    cli.run()
  assert exited.value.code in (0, None)
  lines = capfd.readouterr().out.splitlines()
  assert "model.moe.num_experts: int = 6" in lines and "steps: int = 500" in lines
  assert len(lines) > 80  # every leaf field, nested ones included


def test_overwrite_lets_plan_replace_its_out_file(tmp_path, run_cli):
  """The control of the refusals above: with --overwrite, plan replaces the file it was asked
  to write."""
  out = tmp_path / "best.py"
  out.write_text("# an older plan")
  code, lines, _ = run_cli("plan", "--model=llama3_8b", "--gpus=8", f"--out={out}",
                           "--overwrite")
  assert code in (0, None), lines
  assert out.read_text() != "# an older plan"


@pytest.mark.parametrize("internal", [
    lambda cfg: {}["a key that is not there"],  # a KeyError in meshtron's own code
    lambda cfg: json.loads("{"),  # a ValueError raised outside meshtron (as JAX's verifier's)
])
def test_an_internal_error_is_one_line_naming_a_bug_and_its_report(tmp_path, run_cli,
                                                                    monkeypatch, internal):
  """What no one-line refusal catches is a bug: one line that says so, and a report file in the
  workdir with the whole traceback, the command and the resolved config; nothing else on disk
  changes."""
  from cli import train
  monkeypatch.setattr(train, "run", internal)
  before = snapshot(tmp_path)
  code, lines, _ = run_cli("train", f"--workdir={tmp_path}", "--config.steps=2",
                           "--config.model.num_layers=1")
  assert code == 1 and len(lines) == 1, lines
  assert "internal error, a bug in meshtron" in lines[0], lines
  path = lines[0].split("the traceback and config are in ")[1].split(" (please")[0]
  assert os.path.dirname(path) == str(tmp_path)
  report = open(path, encoding="utf-8").read()
  assert "Traceback (most recent call last)" in report and "meshtron train" in report
  assert '"num_layers": 1' in report and f"--workdir={tmp_path}" in report
  assert set(snapshot(tmp_path)) - set(before) == {os.path.basename(path)}


def test_a_second_trainer_on_a_workdir_fails_at_once_naming_the_holder(tmp_path, run_cli):
  with workdir_lib.locked(str(tmp_path)):
    code, lines, compiles = run_cli("train", f"--workdir={tmp_path}", "--config.steps=2",
                                    "--config.model.num_layers=1")
  assert code and len(lines) == 1 and not compiles
  assert f"is in use by pid {os.getpid()}" in lines[0]


def test_a_stale_lock_is_taken_over(tmp_path, caplog):
  (tmp_path / workdir_lib.LOCK_NAME).write_text(json.dumps(
      {"host": "gone", "pid": 999999, "started": "2026-01-01T00:00:00"}))
  with caplog.at_level(logging.WARNING), workdir_lib.locked(str(tmp_path)):
    held = json.loads((tmp_path / workdir_lib.LOCK_NAME).read_text())
  assert held["pid"] == os.getpid()
  assert any("pid 999999 on gone" in r.getMessage() for r in caplog.records)


def test_a_second_ctrl_c_stops_at_once_without_saving():
  script = ("import os, signal, time; from trainer.process.preemption import StopRequests;"
            " s = StopRequests('SIGINT'); os.kill(os.getpid(), signal.SIGINT);"
            " assert s.should_stop(); os.kill(os.getpid(), signal.SIGINT); time.sleep(5)")
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        env=environment(), cwd=REPO, timeout=120)
  assert proc.returncode == 130
  assert proc.stderr.strip().splitlines()[-1].startswith("meshtron: error: interrupted again")


def test_a_ctrl_c_during_start_up_is_one_line_and_exit_130(tmp_path):
  """Issue [27]: a Ctrl-C before training has installed its handlers (here while the step
  compiles) ends with one line and 130. Before, the line was followed by a native segmentation
  fault dump from the interpreter's shutdown around JAX's running threads. The workdir it made
  holds nothing then (it held the lock file): it is removed. The Ctrl-C comes when the workdir
  appears, just before the compile, with the compile cache off (a 6 s wait found training begun),
  to a run with a terminal's SIGINT (a background `make test` passes it on ignored)."""
  workdir, default_sigint = tmp_path / "new" / "run", "import os, signal, sys; signal.signal(" \
      "signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
  proc = subprocess.Popen([sys.executable, "-c", default_sigint, os.path.join(
      os.path.dirname(sys.executable), "meshtron"), "train", "--config=debug",
      f"--workdir={workdir}", "--cpu_devices=1", "--config.compilation_cache_dir="],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment(), cwd=REPO)
  deadline = time.monotonic() + 120
  while not workdir.exists() and proc.poll() is None and time.monotonic() < deadline:
    time.sleep(0.02)
  proc.send_signal(signal.SIGINT)
  _, stderr = proc.communicate(timeout=120)
  assert proc.returncode == 130, stderr[-2000:]
  assert "Fatal Python error" not in stderr and "Traceback" not in stderr
  assert stderr.strip().splitlines()[-1] == "meshtron: error: interrupted; nothing was saved"
  assert os.listdir(tmp_path) == []
