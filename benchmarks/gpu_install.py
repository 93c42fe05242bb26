"""The GPU machine's set-up for `make gpu-check`: meshtron installed editable without its
dependencies (nothing over the machine's jax), and the wheels carried in .whl/ (`make gpu-wheels`)
installed into SITE, first on the path of every process that follows."""

import glob
import importlib.metadata
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SITE = "/tmp/meshtron-gpu-site"  # where carried wheels are installed (--target), first on the path


def wheels_to_install(files: list[str], mode: str) -> list[str]:
  """The carried wheels to install: all ("pinned"), none, or those whose distribution this
  Python lacks ("missing"; wheel names carry the normalized distribution name)."""
  def missing(path):
    try:
      importlib.metadata.version(os.path.basename(path).split("-")[0])
      return False
    except importlib.metadata.PackageNotFoundError:
      return True
  if mode == "pinned":
    return files
  return [] if mode == "none" else [f for f in files if missing(f)]


def installed_here() -> bool:
  """Whether this checkout is pip-installed: asked from outside it, since this process (run
  with `-m` from the repo root) finds our packages through its working directory."""
  proc = subprocess.run([sys.executable, "-c", "import trainer; print(trainer.__file__)"],
                        cwd=os.path.dirname(REPO), capture_output=True, text=True, timeout=120)
  return proc.returncode == 0 and proc.stdout.strip().startswith(REPO + os.sep)


def install(wheels: str) -> list[str]:
  """meshtron (editable, no dependencies) and the carried wheels; returns what was installed."""
  done = []
  if not installed_here():
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--no-build-isolation", "-e", REPO], check=True)
    done.append("meshtron (editable)")
  chosen = wheels_to_install(sorted(glob.glob(os.path.join(REPO, ".whl", "*.whl"))), wheels)
  if chosen:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--no-compile", "--upgrade", "--target", SITE, *chosen], check=True)
    done += [os.path.basename(f) for f in chosen]
  paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
  if os.path.isdir(SITE) and SITE not in paths:
    # The carried wheels are third-party packages installed with --target into a directory no
    # site configuration names: every process from here on starts with it first on its path
    # (ahead of the machine's own packages), see `gpu_check.main`.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [SITE, *paths]))
  return done
