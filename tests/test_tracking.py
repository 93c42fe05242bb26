"""Run tracking (trainer/tracking.py): MLflow through its local sqlite store, read back with its
client; W&B offline, read back only through its public CLI (`wandb leet inspect --json`). Each
records every number of every metrics.jsonl row, and a resume logs into the same tracked runs."""

import glob
import json
import os
import subprocess
import sys

import pytest

from tests.test_checkpoint import rows, tiny_run
from trainer import loop, tracking

WANDB = os.path.join(os.path.dirname(sys.executable), "wandb")


def tracked_run(**overrides):
  return tiny_run(tracking="mlflow,wandb", tracking_wandb_mode="offline", **overrides)


def numbers(workdir) -> dict:
  """{(step, key): value} of every number in metrics.jsonl."""
  return {(step, key): float(value) for step, row in rows(workdir).items()
          for key, value in row.items() if key != "step" and isinstance(value, (int, float))}


def mlflow_numbers(workdir, run_id) -> dict:
  from mlflow.tracking import MlflowClient
  client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
  run = client.get_run(run_id)
  out = {}
  for key in run.data.metrics:
    for metric in client.get_metric_history(run_id, key):
      out[(metric.step, key)] = metric.value  # a repeated step keeps its last value
  return out, run


def wandb_fragments(workdir) -> list[dict]:
  """Each offline start's records, through the public CLI: its run id, config and history."""
  out = []
  for log in sorted(glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb"))):
    text = subprocess.run([WANDB, "leet", "inspect", "--json", log], capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=120, check=True).stdout
    records = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    config = {}
    for record in records:
      if record["type"] == "config":
        config.update(record["config"]["update"])
    out.append({"run_id": next(r["run"]["run_id"] for r in records if r["type"] == "run"),
                "config": config,
                "history": [r["history"]["item"] for r in records if r["type"] == "history"]})
  return out


def test_mlflow_and_wandb_record_every_metric_and_a_resume_continues_the_same_runs(
    tmp_path, monkeypatch):
  elsewhere = tmp_path / "cwd"  # the current directory: a run writes nothing there
  elsewhere.mkdir()
  monkeypatch.chdir(elsewhere)
  workdir = str(tmp_path / "run")
  loop.run(tracked_run(steps=4), workdir)
  with open(os.path.join(workdir, "tracking.json")) as f:
    ids = json.load(f)
  loop.run(tracked_run(steps=6), workdir)  # resumes from the step-4 checkpoint
  with open(os.path.join(workdir, "tracking.json")) as f:
    assert json.load(f) == ids
  assert os.listdir(elsewhere) == []
  expected = numbers(workdir)
  assert {step for step, _ in expected} == set(range(1, 7))
  assert {(6, "eval_loss"), (6, "loss"), (6, "grad_norm")} <= set(expected)

  logged, run = mlflow_numbers(workdir, ids["mlflow"])
  assert logged == expected
  assert run.info.status == "FINISHED" and run.data.params["model.num_layers"] == "2"
  with open(os.path.join(workdir, "mlartifacts", run.info.run_id, "artifacts", "config.json")) as f:
    assert json.load(f)["steps"] == 6  # the resumed start's config

  fragments = wandb_fragments(workdir)
  assert [f["run_id"] for f in fragments] == [ids["wandb"]] * 2  # one run, two starts
  assert fragments[-1]["config"]["steps"] == 6 and fragments[0]["config"]["steps"] == 4
  history = {}
  for fragment in fragments:
    for item in fragment["history"]:
      history.update({(item["_step"], k): float(v) for k, v in item.items()
                      if not k.startswith("_")})
  assert history == expected


def test_a_tracking_backend_that_cannot_run_is_one_line_before_anything_is_written(
    tmp_path, monkeypatch):
  monkeypatch.delenv("WANDB_API_KEY", raising=False)
  monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
  monkeypatch.delenv("WANDB_MODE", raising=False)
  workdir = tmp_path / "run"
  with pytest.raises(tracking.TrackingError, match="no W&B login: run `wandb login`"):
    loop.run(tiny_run(tracking="wandb"), str(workdir))
  monkeypatch.setattr(tracking, "REQUIRES", {"mlflow": (("no_such_module", "mlflow-skinny"),)})
  with pytest.raises(tracking.TrackingError, match=r"needs mlflow-skinny, not installed: pip"):
    loop.run(tiny_run(tracking="mlflow"), str(workdir))
  with pytest.raises(ValueError, match="'neptune' is not a tracking backend"):
    tiny_run(tracking="wandb,neptune").validate()
  assert not workdir.exists()


def test_an_mlflow_store_that_cannot_open_fails_before_compiling(tmp_path, monkeypatch):
  compiled = []
  monkeypatch.setattr(loop.Trainer, "compile", lambda self: compiled.append(1))
  with pytest.raises(tracking.TrackingError, match=r"MLflow at nosuch://store: .*tracking_mlflow"):
    loop.run(tiny_run(tracking="mlflow", tracking_mlflow_uri="nosuch://store"), str(tmp_path))
  assert not compiled and not (tmp_path / "tracking.json").exists()


class _LostServer:
  def wait(self):
    raise ConnectionError("Connection refused: the tracking server went away")


def test_metrics_mlflow_failed_to_take_are_a_warning_not_a_failed_run(tmp_path, caplog):
  cfg = tiny_run(tracking="mlflow")
  runs = tracking.open_runs(cfg, str(tmp_path), {"steps": 8})
  runs.log(1, {"loss": 5.0})
  runs.backends[0]._pending.append(_LostServer())  # a send that failed on the way
  with caplog.at_level("WARNING"):
    runs.close()
  assert "may lack metrics (Connection refused: the tracking server went away)" in caplog.text


def test_a_tracked_run_that_is_gone_names_the_ids_file(tmp_path, monkeypatch):
  """tracking.json names an MLflow run the store does not hold (a store moved or wiped): one
  line naming the file and the entry to remove, before compiling."""
  compiled = []
  monkeypatch.setattr(loop.Trainer, "compile", lambda self: compiled.append(1))
  (tmp_path / "tracking.json").write_text(json.dumps({"mlflow": "0123456789abcdef"}))
  with pytest.raises(tracking.TrackingError, match=r"resuming run 0123456789abcdef of .*"
                     r"tracking.json \(remove its mlflow entry to start a new tracked run\)"):
    loop.run(tiny_run(tracking="mlflow"), str(tmp_path))
  assert not compiled


def test_an_mlflow_server_that_does_not_answer_is_one_line_before_anything(tmp_path):
  """Its client retried for about 4 minutes (246 s measured) before failing."""
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]  # closed again: nothing listens there
  workdir = tmp_path / "run"
  with pytest.raises(tracking.TrackingError,
                     match=rf"MLflow at http://127.0.0.1:{port}: 127.0.0.1:{port} accepts no"
                     " connection; start the tracking server"):
    loop.run(tiny_run(tracking="mlflow", tracking_mlflow_uri=f"http://127.0.0.1:{port}"),
             str(workdir))
  assert not workdir.exists()
