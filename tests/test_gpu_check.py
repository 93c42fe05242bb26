"""`make gpu-check` without a GPU: one clear line, nothing changed; its whole code path rehearsed on
the CPU (every phase; the gpu tests' phase in the slow set), so a GPU session spends its minutes
measuring; the docs/gpu-check.md section it feeds; the wheels it carries."""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
import tomllib

import pytest

from benchmarks import gpu_check, gpu_install, gpu_report
from tests.docs_text import section

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FACTS = ("gpu", "driver", "jax", "jaxlib", "python", "commit", "date", "rehearsal")
# What exists only on an NVIDIA GPU: a rehearsal skips exactly these gpu tests.
GPU_ONLY = {"test_auto_attention_is_cudnn_on_this_gpu",
            "test_cudnn_attention_equals_the_reference[False]",
            "test_cudnn_attention_equals_the_reference[True]",
            "test_cudnn_attention_with_a_sliding_window_equals_the_reference",
            "test_cudnn_under_ulysses_equals_the_reference",
            "test_jax_triton_rmsnorm_equals_the_reference[float32]",
            "test_jax_triton_rmsnorm_equals_the_reference[bfloat16]"}


def cpu_env(**extra) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "MESHTRON_GPU_TESTS")}
  return {**env, "JAX_PLATFORMS": "cpu", **extra}


def test_without_a_gpu_it_fails_with_one_line_and_changes_nothing(tmp_path):
  assert shutil.which("nvidia-smi") is None, "this test expects a machine without NVIDIA GPUs"
  out = tmp_path / "results"
  proc = subprocess.run(["make", "--no-print-directory", "gpu-check",
                         f"GPU_PYTHON={sys.executable}", f"GPU_OUT={out}"],
                        cwd=REPO, capture_output=True, text=True,
                        env=cpu_env(), timeout=120)
  assert proc.returncode != 0
  # make adds its own "make: *** ... Error 2" (make[1] when run under another make).
  ours = [line for line in proc.stderr.splitlines() if not re.match(r"make(\[\d+\])?: ", line)]
  assert ours == ["gpu-check: no NVIDIA GPU on this machine (nvidia-smi finds none); run it on a"
                  " GPU machine, see docs/gpu-check.md 'GPU results'"], proc.stderr
  assert not out.exists()  # checked before installing or writing anything


# The `tests` phase (the gpu tests' own code at small sizes, ~60 s of the rehearsal's ~110 s on 2
# cores, 3 CLI runs among them) is rehearsed in the slow set; the default suite rehearses the rest.
FAST_PHASES = tuple(phase for phase in gpu_check.PHASES if phase != "tests")


def rehearse(out, phase: str) -> None:
  """One phase on the CPU at tiny sizes into `out`, as `--phase=all` runs each (a fresh process).
  One remat policy: the train phase's code path is the same for each."""
  proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check",
                         "--rehearse", f"--phase={phase}", f"--out_dir={out}", "--remat=full"],
                        cwd=REPO, capture_output=True, text=True, env=cpu_env(), timeout=900)
  assert proc.returncode == 0, (phase, proc.stdout[-3000:], proc.stderr[-3000:])


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
  """Every phase but `tests` on the CPU (~50 s): one output directory."""
  out = tmp_path_factory.mktemp("gpu_rehearsal")
  for phase in FAST_PHASES:
    rehearse(out, phase)
  return out


@pytest.fixture(scope="module")
def rehearsal_with_tests(rehearsal, tmp_path_factory):
  """A copy of that directory with the `tests` phase too: every phase, as `make gpu-check`
  writes (a copy: the default tests see the fast phases alone, in any order)."""
  out = tmp_path_factory.mktemp("gpu_rehearsal_all") / "out"
  shutil.copytree(rehearsal, out)
  rehearse(out, "tests")
  return out


def lines(directory, phase) -> list[dict]:
  return [json.loads(l) for l in (directory / f"{phase}.jsonl").read_text().splitlines()]


def test_every_phase_rehearses_on_the_cpu(rehearsal):
  for phase in FAST_PHASES:
    rows = lines(rehearsal, phase)
    assert rows, phase
    for row in rows:  # every line says where, with what and when it was measured
      assert all(key in row for key in FACTS) and row["rehearsal"] is True, row
  smoke = {r["check"]: r for r in lines(rehearsal, "smoke")}
  assert set(smoke) == {"imports", "flash_attention", "train_step"}
  assert all(r["status"] == "ok" for r in smoke.values()), smoke
  assert smoke["imports"]["versions"]["flax"] and smoke["train_step"]["platform"] == "cpu"
  kernels = lines(rehearsal, "kernels")
  assert {r["benchmark"] for r in kernels} == {"matmul_peak", "copy_bandwidth", "attention",
                                               "rmsnorm_residual"}
  assert all(r["status"] == "ok" for r in kernels if "status" in r), kernels
  train = lines(rehearsal, "train")
  # cuDNN cannot run on a CPU: a rehearsal swaps in the same call's XLA implementation.
  assert {(r["attention"], r["remat"]) for r in train} == {
      (a, "full") for a in ("dot_product", "pallas_flash")}
  for row in train:
    assert row["status"] == "ok" and row["tokens_per_s"] > 0 and row["compiled_peak_gib"] > 0
  fp8 = lines(rehearsal, "fp8")  # a rehearsal runs two of the phase's six
  assert [(r["fp8"], r["xla_options"]) for r in fp8] == [
      ("tensorwise", "xla_gpu_enable_triton_gemm=false"), ("none", "")]
  assert all(r["status"] == "ok" and r["remat"] == "full" for r in fp8), fp8
  moe = lines(rehearsal, "moe")  # each cut dropless and dropping, named in its line; the first
  assert [(r["model"], r["dispatch"], r["grouped_matmul"]) for r in moe] == [  # + 2 kernels
      ("qwen3_30b_a3b_dims", "dropless", "auto"), ("qwen3_30b_a3b_dims", "dropless", "ragged_dot"),
      ("qwen3_30b_a3b_dims", "dropless", "capacity"), ("qwen3_30b_a3b_dims", "dropping", "auto"),
      ("deepseek_v3_like_dims", "dropless", "auto"),
      ("deepseek_v3_like_dims", "dropping", "auto")]
  assert "ragged_dot grouped matmul" in moe[1]["cut"]
  assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 and "experts top-" in r["cut"]
             for r in moe), moe


@pytest.mark.slow
def test_the_gpu_tests_rehearse_on_the_cpu_and_skip_only_gpu_only_parts(rehearsal_with_tests):
  rows = lines(rehearsal_with_tests, "tests")
  assert all(key in row for row in rows for key in FACTS) and all(r["rehearsal"] for r in rows)
  tests = {r["test"].split("::")[-1]: r for r in rows if "test" in r}
  assert {name for name, r in tests.items() if r["outcome"] == "skipped"} == GPU_ONLY
  assert all(tests[name]["message"].startswith("rehearsal on the CPU") for name in GPU_ONLY)
  assert all(r["outcome"] == "passed" for name, r in tests.items() if name not in GPU_ONLY)
  assert len(tests) == 23
  assert all(r["properties"]["seed"] for r in rows if "test_gpu_kernels" in r.get("test", ""))
  summary = next(r for r in rows if "summary" in r)
  assert summary["ok"] and summary["passed"] == 16 and summary["skipped"] == 7


def relabeled_render(rehearsal, tmp_path) -> str:
  """gpu_report's section of the rehearsal's lines marked as a GPU run: a real run's path."""
  for phase in gpu_report.PHASES:
    if (rehearsal / f"{phase}.jsonl").exists():
      relabeled = [dict(r, rehearsal=False) for r in lines(rehearsal, phase)]
      (tmp_path / f"{phase}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in relabeled))
  return gpu_report.render(str(tmp_path))


def test_rehearsals_never_reach_the_doc_and_gpu_lines_do(rehearsal, tmp_path):
  assert gpu_report.render(str(rehearsal)) == gpu_report.NO_RUN + "\n"
  text = relabeled_render(rehearsal, tmp_path)
  assert "jax 0.10.2" in text and "| gpu test | outcome |" not in text  # no tests phase here
  assert "| attention | remat | batch | tokens/s |" in text
  assert re.search(r"\| pallas_flash \| full \| 2 \| \d+ \|", text), text
  assert re.search(r"\| tensorwise \| cuBLASLt \| 2 \| \d+ \| – \|", text), text
  assert re.search(r"\| none \| autotuned \| 2 \| \d+ \| 1.00x \|", text), text
  assert re.search(r"\| deepseek_v3_like_dims \| 2 layers \(1 dense \+ 1 MoE\), 8 experts"
                   r" top-2, dropping \| 2 \| \d+ \|", text), text


@pytest.mark.slow
def test_the_gpu_tests_phase_reaches_the_section(rehearsal_with_tests, tmp_path):
  text = relabeled_render(rehearsal_with_tests, tmp_path)
  assert "| gpu test | outcome |" in text
  assert "test_flash_kernel_equals_the_reference" in text, text


def test_the_gpu_check_doc_has_the_gpu_section_markers():
  section("gpu-check", gpu_report.BEGIN, gpu_report.END)  # each marker once


def test_gpu_tests_live_in_the_files_gpu_check_collects():
  """gpu_check.py collects tests/test_gpu_*.py only (the CPU suite's other imports stay off the
  GPU machine), so a `gpu` marker anywhere else would never run."""
  for name in os.listdir(os.path.join(REPO, "tests")):
    if name.endswith(".py") and not name.startswith("test_gpu_") and name != "conftest.py":
      text = open(os.path.join(REPO, "tests", name), encoding="utf-8").read()
      assert "mark.gpu" not in text, name


def test_carried_wheels_are_the_pinned_versions():
  makefile = open(os.path.join(REPO, "Makefile"), encoding="utf-8").read()
  block = re.search(r"^GPU_WHEELS := (.*?)\n(?=\S|\n)", makefile, re.M | re.S).group(1)
  carried = dict(item.split("==") for item in block.replace("\\", " ").split())
  pins = {}
  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)["project"]
  for spec in project["dependencies"] + project["optional-dependencies"]["gpu"]:
    name, _, version = spec.split("#")[0].strip().partition("==")
    pins[name.split("[")[0].lower()] = version
  for name, version in carried.items():
    if name.lower() in pins:
      assert pins[name.lower()] == version, name
  assert {"grain", "ml-collections", "tensorboardX", "jax-triton", "flax"} <= set(carried)


def test_carried_wheels_install_only_what_is_missing_unless_pinned():
  files = ["/w/flax-0.12.8-py3-none-any.whl", "/w/not_a_real_package_xyz-1.0-py3-none-any.whl"]
  assert gpu_install.wheels_to_install(files, "missing") == files[1:]  # flax is installed here
  assert gpu_install.wheels_to_install(files, "pinned") == files
  assert gpu_install.wheels_to_install(files, "none") == []


def test_a_cut_short_tests_phase_keeps_what_ended_with_its_message(tmp_path):
  """tests/conftest.py logs each test as it ends (MESHTRON_GPU_TEST_LOG): a pytest killed
  mid-run leaves the outcomes, seconds and failure messages of the tests before."""
  case = tmp_path / "test_cut.py"
  case.write_text("import time\n"
                  "def test_a(): pass\n"
                  "def test_b(): assert 1 == 2, 'one is not two'\n"
                  "def test_c(): time.sleep(600)\n")
  log = tmp_path / "progress.jsonl"
  proc = subprocess.Popen(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
       str(case)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
      env=dict(cpu_env(), MESHTRON_GPU_TEST_LOG=str(log)))
  deadline = time.monotonic() + 300  # pytest and JAX start slowly on a loaded 2-core machine
  while time.monotonic() < deadline and len(gpu_check.outcomes_so_far(str(log))) < 2:
    time.sleep(0.5)
  assert proc.poll() is None  # test_c still sleeping: pytest is killed mid-run, no report
  proc.kill()
  proc.wait()
  rows = gpu_check.outcomes_so_far(str(log))
  assert [(r["test"].split("::")[-1], r["outcome"]) for r in rows] == [
      ("test_a", "passed"), ("test_b", "failed")]
  assert "one is not two" in rows[1]["message"] and rows[0]["seconds"] >= 0


def test_a_cut_short_command_ends_with_every_process_it_started():
  """The tests phase runs pytest in a process group of its own: a cut kills the xdist workers
  too, which otherwise keep their GPU memory after their controller is gone."""
  child = ("import subprocess, sys, time\n"
           "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
           "print(p.pid, flush=True)\n"
           "time.sleep(600)\n")
  output, timed_out = gpu_check.run_as_group([sys.executable, "-c", child], 5, cpu_env())
  grandchild = int(output.split()[0])
  assert timed_out
  deadline = time.monotonic() + 10
  while time.monotonic() < deadline and not gone(grandchild):
    time.sleep(0.1)
  assert gone(grandchild)
  finished, timed_out = gpu_check.run_as_group([sys.executable, "-c", "print('done')"], 30,
                                               cpu_env())
  assert (finished.strip(), timed_out) == ("done", False)


def gone(pid: int) -> bool:
  """Whether `pid` has ended (a zombie not yet reaped by init counts as ended)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] == "Z"
  except FileNotFoundError:
    return True


VISITS = [os.path.join(REPO, "benchmarks", "results", "gpu", "visits", v) for v in (
    # train, fp8, the moe runs, then the `auto` train step
    "2026-11-26e", "2026-11-26d", "2026-11-27a", "2026-11-27c", "2026-11-28a")]


def test_the_predict_phase_scores_the_programs_compiled_on_the_gpu_here():
  """benchmarks/gpu_predict.py on the H200 visits: every train, fp8 and moe run that ran predicted
  again with this checkout's predictor, one line per run (a later visit's measurement replaces
  an earlier one); the committed predict.jsonl is what it gives now (a predictor change
  regenerates it), and a trace's kernels add up to the GPU's busy time."""
  from benchmarks import gpu_predict
  rows = gpu_predict.latest_per_run(
      [row for visit in VISITS for row in gpu_predict.predict_rows(visit)])
  measured = {}
  for visit in map(pathlib.Path, VISITS):
    for phase in ("train", "fp8", "moe"):
      for run in lines(visit, phase) if (visit / f"{phase}.jsonl").exists() else []:
        if run.get("status") == "ok":
          name = gpu_check.artifact_name(gpu_predict.run_settings(phase, run))
          measured[(phase, name)] = run
  assert [(r["phase"], r["run"]) for r in rows] == list(measured)
  assert {r.get("model") for r in rows if r["phase"] == "moe"} == {"qwen3_30b_a3b",
                                                                  "deepseek_v3_like"}
  for row in rows:
    run = measured[(row["phase"], row["run"])]
    assert row["measured_step_s"] == run["step_s"] and row["remat"] == run["remat"]
    assert row["attention"] == run["attention"] and row.get("fp8", "none") == run["fp8"]
    assert row["profile"] == "h200"
    assert row["now_over_measured"] == round(row["predicted_now_s"] / run["step_s"], 3)
  traced = rows[0]["traced_by_kind_s"]
  busy = measured[("train", rows[0]["run"])]["trace_ops"]["total_ms_per_step"] / 1e3
  assert sum(traced.values()) == pytest.approx(busy, rel=1e-3)
  committed = lines(pathlib.Path(REPO, "benchmarks", "results", "gpu"), "predict")
  assert committed == rows


def test_moe_models_orders_the_cuts_and_refuses_an_unknown_one(capsys):
  assert [cut[0] for cut in gpu_check.moe_cuts("")] == [cut[0] for cut in gpu_check.MOE_CUTS]
  assert [cut[0] for cut in gpu_check.moe_cuts("deepseek_v3_like,qwen3_30b_a3b")] == [
      "deepseek_v3_like", "qwen3_30b_a3b"]
  with pytest.raises(SystemExit):
    gpu_check.moe_cuts("mixtral")
  assert "--moe_models names mixtral; choose among qwen3_30b_a3b" in capsys.readouterr().err


def test_a_failed_gpu_run_shows_its_error_in_the_section():
  """The committed moe line of XLA's ragged_dot on the Qwen3 cut: a compile-time out of memory,
  named in its row rather than a bare 'error'."""
  results = pathlib.Path(REPO, "benchmarks", "results", "gpu")
  failed = [r for r in lines(results, "moe") if r.get("status") == "error"]
  assert [r["grouped_matmul"] for r in failed] == ["ragged_dot"]
  gist = gpu_report.error_gist(failed[0])
  assert gist.startswith("jax.errors.JaxRuntimeError: NOT_FOUND")
  assert gist.endswith("Out of memory while trying to allocate 128.02GiB")
  assert f"| dropless, ragged_dot | error: {gist} |" in gpu_report.render(str(results))
