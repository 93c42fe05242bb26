"""Multi-process start-up faults (tests/test_multihost.py has the runs and the lost peers): a
process that never joins, a coordinator nothing answers at, a coordinator port already taken.
Each ends in one line, well before JAX's own timeouts and never in a native dump."""

import socket
import subprocess
import sys
import time

import pytest

from tests.test_checkpoint import environment
from tests.test_errors import REPO, run_cli  # noqa: F401  (run_cli: a fixture)


def two_free_ports() -> int:
  """A port p with p + 1 free too (the coordinator's and its roll call's)."""
  for _ in range(50):
    with socket.socket() as first:
      first.bind(("127.0.0.1", 0))
      port = first.getsockname()[1]
      try:
        with socket.socket() as second:
          second.bind(("127.0.0.1", port + 1))
          return port
      except OSError:
        continue
  raise RuntimeError("no two consecutive free ports")


def test_a_process_that_never_joins_is_one_line_after_the_timeout(tmp_path):
  """Process 0 of 2 waits for a peer that is never started: after the start-up timeout the user
  set (4 s), one line says how many processes started of how many, and the exit is non-zero
  without a native stack."""
  port = two_free_ports()
  proc = subprocess.run(
      [sys.executable, "-c", "from cli.main import main; main()", "train", "--config=debug",
       f"--workdir={tmp_path}", "--cpu_devices=4", f"--coordinator=127.0.0.1:{port}",
       "--num_processes=2", "--process_id=0", "--config.distributed.initialization_timeout_s=4"],
      capture_output=True, text=True, env=environment(), cwd=REPO, timeout=120)
  lines = [l for l in proc.stderr.splitlines() if l.strip()]
  assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-2000:]
  assert "1 of 2 processes started (missing: 1) within 4 s" in lines[0]


def test_a_coordinator_port_in_use_is_one_line_before_anything(tmp_path, run_cli):
  with socket.create_server(("127.0.0.1", 0)) as taken:  # JAX's service crashed natively here
    port = taken.getsockname()[1]
    code, lines, compiles = run_cli("train", f"--workdir={tmp_path / 'run'}",
                                    f"--coordinator=127.0.0.1:{port}", "--num_processes=2",
                                    "--process_id=0")
  assert code == 1 and not compiles and not (tmp_path / "run").exists()
  assert lines == [f"meshtron: error: --coordinator=127.0.0.1:{port}: port {port} is already in"
                   " use on this host (another run's coordinator?); choose a free port"]


@pytest.mark.parametrize("process_id, fragment", [
    (1, "the coordinator 127.0.0.1:{port} accepts no connection after 3 s (this is process 1)"),
    (0, "no other process reached the coordinator 127.0.0.1:{port} within 3 s"),
])
def test_a_start_up_that_cannot_succeed_ends_after_the_probe_not_the_timeout(
    tmp_path, process_id, fragment):
  """A wrong --coordinator (nothing answers there), or a process 0 that no other process
  reaches: one line after the 3 s probe, not the 300 s start-up timeout."""
  port = two_free_ports()
  started = time.time()
  proc = subprocess.run(
      [sys.executable, "-c", "from cli.main import main; main()", "train", "--config=debug",
       f"--workdir={tmp_path}", "--cpu_devices=4", f"--coordinator=127.0.0.1:{port}",
       "--num_processes=2", f"--process_id={process_id}",
       "--config.distributed.coordinator_probe_s=3"],
      capture_output=True, text=True, env=environment(), cwd=REPO, timeout=120)
  lines = [l for l in proc.stderr.splitlines() if l.strip()]
  assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-2000:]
  assert fragment.format(port=port) in lines[0] and time.time() - started < 60


@pytest.mark.parametrize("environ, address", [
    ({"SLURM_STEP_NODELIST": "gpu-node-[007-015,020],login1", "SLURM_JOB_ID": "4097"},
     "gpu-node-007:57346"),
    ({"SLURM_STEP_NODELIST": "vm", "SLURM_JOB_ID": "12", "JAX_COORDINATOR_PORT": "7000"},
     "vm:7000"),
    ({"OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911"},
     "10.96.0.1:59712"),
    ({"OMPI_MCA_orte_hnp_uri": "1314521088.0;tcp6://[fe80::b9b:ac5d]:43370"}, None),
])
def test_the_launchers_coordinator_is_resolved_for_the_peer_links(monkeypatch, environ, address):
  """SLURM: the step's first node; Open MPI: the launcher's IPv4 address (IPv6: left to JAX, no
  links). The port is even, one per job, so a neighbouring job never takes this one's port + 1."""
  from trainer.process import distributed
  monkeypatch.delenv("JAX_COORDINATOR_PORT", raising=False)
  for name, value in environ.items():
    monkeypatch.setenv(name, value)
  launcher = "slurm" if "SLURM_JOB_ID" in environ else "openmpi"
  assert distributed.launcher_coordinator(launcher) == address
