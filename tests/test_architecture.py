"""Layout rules: our generic package names are ours, sharding stays in sharding/, files are small."""

import ast
import importlib
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("trainer", "sharding", "models", "kernels", "configs", "cli")
MESH_AXES = ("data", "pipeline", "fsdp", "expert", "context", "tensor")


def python_files(*dirs):
  for d in dirs:
    for root, _, files in os.walk(os.path.join(REPO, d)):
      for name in files:
        if name.endswith(".py"):
          yield os.path.join(root, name)


@pytest.mark.parametrize("package", PACKAGES)
def test_package_is_ours_not_a_pypi_namesake(package):
  """`kernels`, `trainer`, `models`... exist on PyPI too; ours must be the one imported."""
  module = importlib.import_module(package)
  assert os.path.dirname(os.path.abspath(module.__file__)) == os.path.join(REPO, package)


def test_partition_specs_only_in_sharding():
  for path in python_files("models", "kernels", "trainer", "configs", "cli"):
    source = open(path).read()
    assert not re.search(r"\bPartitionSpec\b|\bP\(", source), path


# Strings that are mesh-axis names but name something else: the orbax item holding the
# data-iterator state is called "data".
NOT_AXES = {("trainer/checkpoint.py", "data")}


def test_only_sharding_names_mesh_axes():
  """Models and kernels speak logical names; the trainer and its commands ask sharding/ (the
  resolved layout) for anything about mesh axes. Mesh-axis names appear as strings in sharding/
  alone."""
  for path in python_files("models", "kernels", "trainer", "cli"):
    strings = {node.value for node in ast.walk(ast.parse(open(path).read()))
               if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    named = {s for s in strings & set(MESH_AXES)
             if (os.path.relpath(path, REPO), s) not in NOT_AXES}
    assert not named, (path, named)


def test_dependencies_point_one_way():
  # One chain, lower to higher (issue [25]): kernels <- sharding (its layout resolves the attention
  # kernel, kernels.attention.resolve) <- models <- trainer <- configs <- cli.
  allowed = {"kernels": set(), "sharding": {"kernels"}, "models": {"sharding", "kernels"},
             "configs": {"models", "sharding", "trainer"}}
  for package, ok in allowed.items():
    for path in python_files(package):
      tree = ast.parse(open(path).read())
      for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        for name in names:
          top = name.split(".")[0]
          assert top not in set(PACKAGES) - ok - {package}, (path, name)


def test_files_are_small_and_no_grab_bags():
  for path in python_files(*PACKAGES, "tests", "benchmarks"):
    assert os.path.basename(path) not in {"utils.py", "helpers.py", "misc.py", "common.py"}, path
    lines = sum(1 for _ in open(path))
    assert lines <= 400, f"{path} has {lines} lines (cap 400: split it by responsibility)"


def imported_modules(path: str) -> list[str]:
  tree = ast.parse(open(path).read())
  names = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names += [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      names += [base] + [f"{base}.{a.name}" for a in node.names]
  return names


def test_runtime_sharding_imports_nothing_from_the_analysis_rooms():
  """sharding/*.py runs in the train step; sharding/plan (the analytic model) and sharding/xla
  (compiled-program readers) analyse, and the step never needs them."""
  runtime = [os.path.join(REPO, "sharding", n) for n in os.listdir(os.path.join(REPO, "sharding"))
             if n.endswith(".py")]
  assert len(runtime) > 8
  for path in runtime:
    bad = [m for m in imported_modules(path) if m.startswith(("sharding.plan", "sharding.xla"))]
    assert not bad, (path, bad)


def wheel_files(tmp_path) -> list[str]:
  """Builds the wheel from a copy of the sources (setuptools leaves build/ behind in the tree it
  builds, whose stale files a later build would package)."""
  source = tmp_path / "source"
  source.mkdir()
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(os.path.join(REPO, name), source / name)
  for package in PACKAGES:
    shutil.copytree(os.path.join(REPO, package), source / package,
                    ignore=shutil.ignore_patterns("__pycache__"))
  subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                  "-w", str(tmp_path), str(source)], check=True, capture_output=True, timeout=300)
  (wheel,) = [p for p in os.listdir(tmp_path) if p.endswith(".whl")]
  return zipfile.ZipFile(os.path.join(tmp_path, wheel)).namelist()


def test_the_wheel_holds_every_package_and_the_gpu_targets(tmp_path):
  """A non-editable install gets every module of the six packages (subpackages included) and
  the GPU target descriptions, and nothing of tests/ or benchmarks/."""
  files = set(wheel_files(tmp_path))
  ours = {os.path.relpath(p, REPO) for p in python_files(*PACKAGES)}
  assert ours <= files, sorted(ours - files)
  targets = {os.path.join("sharding", "xla", "targets", n)
             for n in os.listdir(os.path.join(REPO, "sharding", "xla", "targets"))}
  assert targets and targets <= files
  assert not [f for f in files if f.startswith(("tests/", "benchmarks/"))]


def test_a_non_editable_install_compiles_for_h100s(tmp_path):
  """`pip install .` (here: the wheel into a directory of its own, first on the path, run from
  outside the checkout): `meshtron compile --target=h100x8` finds every module and the GPU
  target descriptions in the installed copy."""
  wheel_files(tmp_path)
  site = tmp_path / "site"
  subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                  *[str(tmp_path / p) for p in os.listdir(tmp_path) if p.endswith(".whl")]],
                 check=True, timeout=300)
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(PYTHONPATH=str(site), JAX_PLATFORMS="cpu")
  where = subprocess.run([sys.executable, "-c",
                          "import sharding.xla.compiled as c; print(c.__file__)"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, check=True)
  assert where.stdout.strip().startswith(str(site)), where.stdout
  run = subprocess.run([sys.executable, "-c",
                        "from cli.main import main; main()", "compile",
                        "--config=debug", "--target=h100x8", "--config.mesh.data=8"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
  assert run.returncode == 0, run.stderr[-2000:]
  assert "h100" in run.stdout.lower() and "peak" in run.stdout.lower(), run.stdout[-2000:]
