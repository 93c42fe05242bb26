"""Multi-process start-up: jax.distributed under SLURM / Open MPI or explicit coordinates (e.g.
Kubernetes), timeouts that never hang, and hard exits so no peer waits in a collective."""

import errno
import glob
import os
import re
import socket

import jax

from trainer.config import DistributedConfig
from trainer.process import stderr_filter
from trainer.process.join_watch import JoinWatch, end

_watch: JoinWatch | None = None  # this process's roll call and peer links, when multi-process


def detect_launcher() -> str | None:
  """The launcher whose environment JAX's auto-detection reads, or None outside one.

  SLURM only inside an `srun` step (SLURM_STEP_NODELIST), since JAX needs the step's node list.
  """
  if all(v in os.environ for v in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS",
                                   "SLURM_PROCID", "SLURM_LOCALID")):
    return "slurm"
  if "OMPI_MCA_orte_hnp_uri" in os.environ:
    return "openmpi"
  return None


def _tasks_per_node() -> int | None:
  for name in ("SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
    value = os.environ.get(name, "").split("(")[0].split(",")[0]
    if value.isdigit():
      return int(value)
  return None


def local_device_ids(spec: str) -> list[int] | None:
  """Which local GPUs this process drives. "auto": with one process per node, all of the node's
  GPUs (JAX's launcher detection would otherwise give it only GPU number <local rank>); with
  several per node, JAX's default (one GPU per process). Or an explicit list "0,1,2,3"."""
  if spec != "auto":
    return [int(i) for i in spec.split(",")] if spec else None
  if _tasks_per_node() != 1:
    return None
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  count = len(visible.split(",")) if visible else len(glob.glob("/dev/nvidia[0-9]*"))
  return list(range(count)) if count else None


def initialize(cfg: DistributedConfig, coordinator: str = "", num_processes: int = 0,
               process_id: int = -1) -> bool:
  """Starts jax.distributed when coordinates are given or a launcher is detected; returns
  whether this is a multi-process run. Must run before any other JAX call."""
  explicit = (coordinator, num_processes, process_id)
  if any((coordinator, num_processes, process_id >= 0)) and not all(
      (coordinator, num_processes > 0, process_id >= 0)):
    raise ValueError("--coordinator, --num_processes and --process_id go together; got"
                     f" {explicit}")
  if coordinator:
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
      raise ValueError(f"--coordinator={coordinator!r} must be host:port of process 0 (port"
                       " 1-65535), e.g. 10.0.0.1:1234")
    if num_processes < 1 or not 0 <= process_id < num_processes:
      raise ValueError(f"--process_id={process_id} must be in [0, --num_processes="
                       f"{num_processes})")
  launcher = None if coordinator else detect_launcher()
  if not coordinator and launcher is None:
    return False
  # Under a launcher the coordinator is resolved here, not by JAX, so the peer links know where
  # process 0 is; JAX still reads the process count, index and local GPU from the launcher.
  resolved = launcher and launcher_coordinator(launcher)
  rank = process_id if process_id >= 0 else launcher_rank()
  if coordinator and rank == 0:
    check_port_free(coordinator)
  elif resolved and rank == 0:
    check_port_free(resolved, f"the coordinator {resolved} (under {launcher})",
                    "set JAX_COORDINATOR_PORT to a free one")
  # JAX's own start-up timeout ends in a native abort dump: ours fires first, in one line.
  kwargs = dict(initialization_timeout=cfg.initialization_timeout_s + 60,
                heartbeat_timeout_seconds=cfg.heartbeat_timeout_s,
                shutdown_timeout_seconds=cfg.shutdown_timeout_s)
  if coordinator:
    kwargs.update(coordinator_address=coordinator, num_processes=num_processes,
                  process_id=process_id)
  elif resolved:
    kwargs["coordinator_address"] = resolved
  ids = local_device_ids(cfg.local_device_ids)
  if ids is not None:
    kwargs["local_device_ids"] = ids
  expected = num_processes or os.environ.get("SLURM_NTASKS") or os.environ.get(
      "OMPI_COMM_WORLD_SIZE") or "?"
  global _watch
  stderr_filter.start()  # a lost peer is then told once, by _watch's line
  _watch = JoinWatch(coordinator or resolved or "", "?" if rank is None else rank, expected,
                     cfg.initialization_timeout_s,
                     silence_s=0.75 * cfg.heartbeat_timeout_s, probe_s=cfg.coordinator_probe_s,
                     launcher=launcher)
  jax.distributed.initialize(**kwargs)
  _watch.joined()
  return True


def launcher_rank() -> int | None:
  rank = os.environ.get("SLURM_PROCID", os.environ.get("OMPI_COMM_WORLD_RANK", ""))
  return int(rank) if rank.isdigit() else None


def launcher_coordinator(launcher: str) -> str | None:
  """host:port of process 0 under `launcher`: SLURM's first node of the step, or Open MPI's
  launcher address (IPv4). The port is $JAX_COORDINATOR_PORT, else one per job id (even, so a
  neighbouring job's coordinator is never this job's port + 1). None: left to JAX's detection."""
  if launcher == "slurm":
    first = re.match(r"([^,\[]*)(?:\[([^,\-\]]*))?", os.environ["SLURM_STEP_NODELIST"])
    host, job = first.group(1) + (first.group(2) or ""), os.environ["SLURM_JOB_ID"]
  else:
    uri = os.environ["OMPI_MCA_orte_hnp_uri"]  # e.g. 1531576320.0;tcp://10.96.0.1,10.1.0.1:349
    address = re.search(r"tcp://([^,:;]+)", uri)
    host, job = (address.group(1) if address else ""), str(int(uri.split(".")[0]) // 4096)
  if not host or not job.isdigit():
    return None
  port = os.environ.get("JAX_COORDINATOR_PORT") or str(57344 + 2 * (int(job) % 4096))
  return f"{host}:{port}"


def check_port_free(coordinator: str, named: str = "", fix: str = "choose a free port") -> None:
  """ValueError when process 0's coordinator port is already taken on this host (JAX's service
  would crash natively trying to serve on it)."""
  port = int(coordinator.rpartition(":")[2])
  try:
    socket.create_server(("", port)).close()  # SO_REUSEADDR: a past run's TIME_WAIT is no owner
  except OSError as e:
    if e.errno != errno.EADDRINUSE:
      return  # not ours to judge (e.g. no IPv4): JAX reports it
    raise ValueError(f"{named or '--coordinator=' + coordinator}: port {port} is already in use"
                     f" on this host (another run's coordinator?); {fix}") from None


def exit_hard_on_error(fn, *args, describe=None, **kwargs):
  """Runs fn. In a multi-process run an uncaught error prints one line (`describe(error)`: the
  refusal's own, or a bug report's) and exits the process at once, so the launcher ends the job
  and peers end on the lost link instead of waiting in JAX's shutdown barrier. SystemExit passes
  through (already a deliberate exit)."""
  try:
    result = fn(*args, **kwargs)
  except SystemExit as e:
    if _watch is not None and e.code in (0, None):
      _watch.finished()
    raise
  except BaseException as e:  # noqa: BLE001 - every error must end the process
    if jax.process_count() == 1:
      raise
    message = describe(e) if describe is not None else (
        str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
    end(f"process {jax.process_index()}: {message}")
  if _watch is not None:
    _watch.finished()
  return result
