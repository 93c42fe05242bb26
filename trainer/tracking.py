"""Run tracking beside metrics.jsonl and TensorBoard: MLflow and Weights & Biases, optional extras
(`pip install 'meshtron[tracking]'`), chosen with --config.tracking=mlflow,wandb.

Each backend gets every numeric value of every metrics.jsonl row at its step, and the resolved
config. The tracked runs' ids are kept in WORKDIR/tracking.json, so rerunning the command (a
resume) logs into the same tracked runs. Only process 0 tracks. Backends are opened before the
step compiles: a wrong URI or a missing login fails in one line before any work.
"""

import importlib.util
import json
import logging as pylogging
import netrc
import os
import socket
import time
import urllib.parse
import uuid

from absl import logging

BACKENDS = ("mlflow", "wandb")
WANDB_MODES = ("online", "offline", "disabled")
IDS_FILE = "tracking.json"
# Extra packages per backend: (module, pip distribution).
REQUIRES = {"mlflow": (("mlflow", "mlflow-skinny"), ("sqlalchemy", "sqlalchemy"),
                       ("alembic", "alembic")),
            "wandb": (("wandb", "wandb"),)}


class TrackingError(ValueError):
  """A tracking backend cannot be used; the message says what to do."""


def backends_of(value: str) -> tuple[str, ...]:
  """The backends a comma-separated `tracking` setting names ("" = none)."""
  names = tuple(dict.fromkeys(n.strip() for n in value.split(",") if n.strip()))
  for name in names:
    if name not in BACKENDS:
      raise TrackingError(f"tracking={value!r}: {name!r} is not a tracking backend; use a"
                          f" comma-separated list of {', '.join(BACKENDS)} (TensorBoard and"
                          " metrics.jsonl are always written) (--config.tracking)")
  return names


def wandb_mode(cfg) -> str:
  """The W&B mode: tracking_wandb_mode, else $WANDB_MODE, else online ("dryrun" is offline)."""
  mode = cfg.tracking_wandb_mode or os.environ.get("WANDB_MODE", "") or "online"
  return {"dryrun": "offline", "run": "online"}.get(mode, mode)


def check(cfg) -> None:
  """TrackingError for a backend that cannot run here: unknown, not installed, or W&B online
  without a login. Changes nothing."""
  names = backends_of(cfg.tracking)
  for name in names:
    missing = [dist for module, dist in REQUIRES[name] if importlib.util.find_spec(module) is None]
    if missing:
      raise TrackingError(f"tracking={cfg.tracking!r} needs {', '.join(missing)}, not installed:"
                          " pip install 'meshtron[tracking]', or drop it from --config.tracking")
  uri = mlflow_uri(cfg, workdir="")
  if "mlflow" in names and uri.startswith(("http://", "https://")):
    _check_server_answers(uri)
  if "wandb" in names:
    mode = wandb_mode(cfg)
    if mode not in WANDB_MODES:
      raise TrackingError(f"W&B mode {mode!r} is not one of {', '.join(WANDB_MODES)}"
                          " (--config.tracking_wandb_mode, or $WANDB_MODE)")
    if mode == "online" and not _wandb_logged_in():
      raise TrackingError("tracking=wandb is online but this machine has no W&B login: run"
                          " `wandb login` (or set WANDB_API_KEY), or log offline with"
                          " --config.tracking_wandb_mode=offline and `wandb sync` later")


def mlflow_uri(cfg, workdir: str) -> str:
  """tracking_mlflow_uri, else $MLFLOW_TRACKING_URI, else the workdir's sqlite store ("" when no
  `workdir` is given)."""
  default = f"sqlite:///{os.path.join(workdir, 'mlflow.db')}" if workdir else ""
  return cfg.tracking_mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI") or default


def _check_server_answers(uri: str) -> None:
  """TrackingError when nothing accepts a connection at an MLflow server's host and port: its
  client would retry for about 4 minutes before failing."""
  parsed = urllib.parse.urlsplit(uri)
  port = parsed.port or (443 if parsed.scheme == "https" else 80)
  try:
    socket.create_connection((parsed.hostname, port), timeout=5).close()
  except OSError as e:
    why = "cannot be resolved" if isinstance(e, socket.gaierror) else "accepts no connection"
    raise TrackingError(f"MLflow at {uri}: {parsed.hostname}:{port} {why}; start the tracking"
                        " server, or fix --config.tracking_mlflow_uri ($MLFLOW_TRACKING_URI)"
                        ) from None


def _wandb_logged_in() -> bool:
  """An API key in the environment or in ~/.netrc, where `wandb login` writes it."""
  if os.environ.get("WANDB_API_KEY"):
    return True
  host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
  try:
    return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
  except (OSError, netrc.NetrcParseError):
    return False


def flat(config: dict, prefix: str = "") -> dict:
  """{"model.dim": 64, ...} from a nested config dict."""
  out = {}
  for key, value in config.items():
    if isinstance(value, dict):
      out.update(flat(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


class Runs:
  """The open tracked runs of this workdir; `log` sends one metrics row to each."""

  def __init__(self, backends=()):
    self.backends = list(backends)

  def log(self, step: int, scalars: dict) -> None:
    for backend in self.backends:
      backend.log(step, scalars)

  def close(self, failed: bool = False) -> None:
    for backend in self.backends:
      backend.close(failed)
    self.backends = []


def open_runs(cfg, workdir: str, config: dict) -> Runs:
  """Opens (or, for a workdir that has tracked before, reopens) each configured backend's run
  and records the resolved `config` in it."""
  names = backends_of(cfg.tracking)
  if not names:
    return Runs()
  ids_path = os.path.join(workdir, IDS_FILE)
  ids = {}
  if os.path.exists(ids_path):
    with open(ids_path, encoding="utf-8") as f:
      ids = json.load(f)
  run_name = cfg.tracking_run_name or os.path.basename(os.path.normpath(workdir))
  runs = Runs()
  try:
    for name in names:
      opener = _MlflowRun if name == "mlflow" else _WandbRun
      backend = opener(cfg, workdir, run_name, ids.get(name), config)
      ids[name] = backend.run_id
      runs.backends.append(backend)
  except BaseException:
    runs.close(failed=True)
    raise
  with open(ids_path + ".tmp", "w", encoding="utf-8") as f:
    json.dump(ids, f, indent=2)
  os.replace(ids_path + ".tmp", ids_path)
  return runs


class _MlflowRun:
  """One MLflow run through its client (no global active run). Metrics are sent asynchronously,
  so a slow tracking server does not hold up the steps; `close` waits for them."""

  def __init__(self, cfg, workdir, run_name, run_id, config):
    from mlflow.tracking import MlflowClient  # the optional extra, imported only when asked for
    for name in ("mlflow", "alembic"):  # their INFO lines (database migrations) are noise here;
      pylogging.getLogger(name).setLevel(pylogging.WARNING)  # set after mlflow configured them
    uri = mlflow_uri(cfg, workdir)
    try:
      self.client = MlflowClient(uri)
      if run_id is None:
        experiment = self.client.get_experiment_by_name(cfg.tracking_project)
        # A local store's artifacts (MLflow's default: ./mlruns in the current directory) go to
        # the workdir: a run writes nowhere else. A server keeps its own artifact root.
        local = uri.startswith(("sqlite:", "file:")) or "://" not in uri
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(
                             cfg.tracking_project,
                             artifact_location=(f"file://{os.path.join(workdir, 'mlartifacts')}"
                                                if local else None)))
        run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
      else:
        self.client.update_run(run_id, status="RUNNING")
      logged = self.client.get_run(run_id).data.params
      params = [(k, str(v)[:6000]) for k, v in flat(config).items() if k not in logged]
      from mlflow.entities import Param
      for i in range(0, len(params), 100):  # a batch holds at most 100 params
        self.client.log_batch(run_id, params=[Param(k, v) for k, v in params[i:i + 100]])
      self.client.log_dict(run_id, config, "config.json")  # this start's config, whole
    except Exception as e:  # the backend's own error types; one line with the URI
      resumed = (f"; resuming run {run_id} of {os.path.join(workdir, IDS_FILE)} (remove its"
                 " mlflow entry to start a new tracked run)") if run_id else ""
      raise TrackingError(f"MLflow at {uri}: {str(e).splitlines()[0] if str(e) else type(e)}"
                          f" (--config.tracking_mlflow_uri, or $MLFLOW_TRACKING_URI){resumed}"
                          ) from None
    self.run_id, self.uri = run_id, uri
    self._pending = []

  def log(self, step, scalars):
    from mlflow.entities import Metric
    stamp = int(time.time() * 1000)
    metrics = [Metric(k, float(v), stamp, step) for k, v in scalars.items()]
    self._pending.append(self.client.log_batch(self.run_id, metrics=metrics, synchronous=False))

  def close(self, failed):
    """Waits for the metrics in flight. A tracking server lost mid-run does not fail a run that
    trained: metrics.jsonl holds every row; the warning says what the tracked run lacks."""
    pending, self._pending = self._pending, []
    try:
      for operation in pending:
        operation.wait()
      self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
    except Exception as e:
      logging.warning("MLflow run %s at %s may lack metrics (%s); metrics.jsonl has them all",
                      self.run_id, self.uri, str(e).splitlines()[0] if str(e) else type(e))


class _WandbRun:
  """One W&B run; a resume reopens it by id (offline, each start is a fragment of the same run,
  which `wandb sync --id` uploads together)."""

  def __init__(self, cfg, workdir, run_name, run_id, config):
    import wandb  # the optional extra, imported only when asked for
    run_id = run_id or uuid.uuid4().hex[:8]
    try:
      self.run = wandb.init(
          project=cfg.tracking_project, name=run_name, id=run_id, resume="allow", dir=workdir,
          mode=wandb_mode(cfg), settings=wandb.Settings(silent=True, console="off"))
      self.run.config.update(config, allow_val_change=True)
    except Exception as e:
      raise TrackingError(f"W&B: {str(e).splitlines()[0] if str(e) else type(e)} (W&B mode"
                          f" {wandb_mode(cfg)}; --config.tracking_wandb_mode)") from None
    self.run_id = run_id

  def log(self, step, scalars):
    self.run.log(dict(scalars), step=step)

  def close(self, failed):
    self.run.finish(exit_code=1 if failed else 0)


def describe(runs: Runs) -> list[str]:
  """One line per open backend, for the log: where its run is."""
  out = []
  for backend in runs.backends:
    if isinstance(backend, _MlflowRun):
      out.append(f"MLflow run {backend.run_id} at {backend.uri}")
    else:
      out.append(f"W&B run {backend.run_id} ({backend.run.settings.mode})")
  return out

