"""Multi-process training: 2 processes x 4 CPU devices over loopback (jax.distributed), and the
same under a real SLURM `srun` when the machine has one (CI installs it: .ci/run)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

MESHTRON = os.path.join(os.path.dirname(sys.executable), "meshtron")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# fsdp=4 x data=2: data spans the two processes (the hybrid mesh puts hosts on outer axes).
# Constant learning rate, so a 3-step run is a prefix of a 5-step run.
TRAIN = ["train", "--config=debug", "--config.mesh.data=2", "--config.mesh.fsdp=4",
         "--config.batch_size=16", "--config.seq_len=64", "--config.model.num_layers=2",
         "--config.sample_tokens=0", "--config.eval_every=1000", "--config.checkpoint.every_steps=3",
         "--config.optim.warmup_steps=0", "--config.optim.min_learning_rate_ratio=1.0",
         "--config.distributed.heartbeat_timeout_s=10", "--config.compilation_cache_dir="]


def environment():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  return {**env, "JAX_PLATFORMS": "cpu"}


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def two_processes(workdir, steps, *extra):
  port = free_port()
  return [subprocess.Popen(
      [MESHTRON, *TRAIN, f"--workdir={workdir}", f"--config.steps={steps}", "--cpu_devices=4",
       f"--coordinator=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}", *extra],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment(), cwd=REPO)
      for i in range(2)]


def one_process(workdir, steps):
  result = subprocess.run([MESHTRON, *TRAIN, f"--workdir={workdir}", f"--config.steps={steps}",
                           "--cpu_devices=8"], capture_output=True, text=True,
                          env=environment(), cwd=REPO, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def losses(workdir) -> dict:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r["loss"] for r in map(json.loads, f)}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("single")
  one_process(workdir, 5)
  return losses(workdir)


def test_two_processes_train_like_one_and_hand_over_their_checkpoint(tmp_path, single):
  procs = two_processes(tmp_path, 3)
  logs = []
  for proc in procs:
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    logs.append(stderr)
  assert "process 0 of 2" in logs[0] and "process 1 of 2" in logs[1]
  two = losses(tmp_path)  # written by process 0 only
  np.testing.assert_allclose([two[s] for s in (1, 2, 3)], [single[s] for s in (1, 2, 3)],
                             rtol=1e-5)
  # The 2-process checkpoint of step 3 resumes in a single process with 8 devices.
  result = one_process(tmp_path, 5)
  assert "resuming at step 3" in result.stderr
  resumed = losses(tmp_path)
  np.testing.assert_allclose([resumed[4], resumed[5]], [single[4], single[5]], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("killed, how", [(1, signal.SIGKILL), (0, signal.SIGKILL),
                                         (1, signal.SIGSTOP)])
def test_a_dead_peer_ends_the_survivor_at_once_in_one_line(tmp_path, killed, how):
  """SIGKILL one of two training processes: the other ends within seconds (JAX alone would wait
  for its heartbeat timeout, then abort natively), printing one line that names the lost one.
  SIGSTOP stands for a host that vanished (nothing closes its connections): the survivor ends
  on the silence, after 3/4 of the 10 s heartbeat timeout, before JAX's abort."""
  procs = two_processes(tmp_path, 10_000)
  metrics = tmp_path / "metrics.jsonl"
  deadline = time.time() + 300
  while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
    assert time.time() < deadline and procs[0].poll() is None, procs[0].stderr
    time.sleep(0.2)
  procs[killed].send_signal(how)
  killed_at = time.time()
  survivor = procs[1 - killed]
  _, stderr = survivor.communicate(timeout=120)
  took = time.time() - killed_at
  procs[killed].kill()
  procs[killed].communicate()
  assert survivor.returncode == 1, stderr[-3000:]
  assert took < 10  # the heartbeat timeout is 10 s: this is the link, not JAX
  errors = [line for line in stderr.splitlines() if "rror" in line or "Fatal" in line
            or "Traceback" in line or line.startswith(("F1", "E1", "*** "))]
  lost = "process 0 (the coordinator" if killed == 0 else "process 1 of 2"
  what = "sent nothing for 8 s" if how == signal.SIGSTOP else "stopped: its connection closed"
  assert len(errors) == 1 and errors[0].startswith(f"meshtron: error: {lost}"), errors
  assert what in errors[0]


def slurm_available() -> bool:
  if not shutil.which("srun") or not shutil.which("sinfo"):
    return False
  state = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
  return state.returncode == 0 and any(s.startswith(("idle", "mixed")) for s in state.stdout.split())


def require_slurm() -> None:
  """Skips where no SLURM controller answers; fails instead under CI (MESHTRON_REQUIRE_SLURM)."""
  if not slurm_available():
    if os.environ.get("MESHTRON_REQUIRE_SLURM"):
      pytest.fail("MESHTRON_REQUIRE_SLURM is set but no SLURM controller answers (.ci/slurm.sh)")
    pytest.skip("no SLURM on this machine: .ci/run installs and starts one (.ci/slurm.sh start)")


def test_training_under_slurm_srun(tmp_path, request):
  """`srun -N1 -n2`: jax.distributed.initialize() with no arguments finds SLURM's variables."""
  require_slurm()
  # The one-process reference is asked for only once SLURM answers: where the test skips, its
  # 30 s run would feed nothing (the other test using it is in `make test-all` only).
  single = request.getfixturevalue("single")
  result = subprocess.run(
      ["srun", "-N1", "-n2", "--time=10", "--kill-on-bad-exit=1", MESHTRON, *TRAIN,
       f"--workdir={tmp_path}", "--config.steps=3", "--cpu_devices=4"],
      capture_output=True, text=True, env=environment(), cwd=REPO, timeout=900)
  assert result.returncode == 0, result.stderr[-3000:]
  two = losses(tmp_path)
  np.testing.assert_allclose([two[s] for s in (1, 2, 3)], [single[s] for s in (1, 2, 3)],
                             rtol=1e-5)


def test_a_peer_killed_under_slurm_ends_the_step_in_one_line(tmp_path):
  """Under `srun` the coordinator is resolved by meshtron (not JAX), so the peer links exist
  there too: SIGKILL task 1 and task 0 ends within seconds in one line, not JAX's native abort."""
  require_slurm()
  step = subprocess.Popen(
      ["srun", "-N1", "-n2", "--time=10", "--kill-on-bad-exit=0", MESHTRON, *TRAIN,
       f"--workdir={tmp_path}", "--config.steps=10000", "--cpu_devices=4"],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment(), cwd=REPO)
  metrics, deadline = tmp_path / "metrics.jsonl", time.time() + 300
  while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
    assert time.time() < deadline and step.poll() is None, step.communicate()[1][-3000:]
    time.sleep(0.2)
  os.kill(task_pid(tmp_path, rank=1), signal.SIGKILL)
  killed_at = time.time()
  _, stderr = step.communicate(timeout=120)
  assert time.time() - killed_at < 10, stderr[-3000:]  # heartbeat 10 s: the link, not JAX
  errors = [line for line in stderr.splitlines() if line.startswith("meshtron: error")
            or "Traceback" in line or line.startswith(("F1", "E1", "*** "))]
  assert errors == [line for line in errors if line.startswith(
      "meshtron: error: process 1 of 2 stopped: its connection closed; this is process 0")]
  assert len(errors) == 1, stderr[-3000:]


def task_pid(workdir, rank: int) -> int:
  """The pid of the srun task of SLURM rank `rank` training into `workdir`."""
  for entry in os.listdir("/proc"):
    try:
      with open(f"/proc/{entry}/cmdline", "rb") as f:
        command = f.read().split(b"\0")
      with open(f"/proc/{entry}/environ", "rb") as f:
        environ = f.read().split(b"\0")
    except OSError:
      continue
    if f"--workdir={workdir}".encode() in command and f"SLURM_PROCID={rank}".encode() in environ:
      return int(entry)
  raise AssertionError(f"no task of rank {rank} training into {workdir}")
