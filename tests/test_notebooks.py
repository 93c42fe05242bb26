"""Every notebook in notebooks/ runs top to bottom without errors, on small settings.

Each runs in its own ipykernel (nbclient), which sets its own 8 fake CPU devices before importing
JAX; MESHTRON_NOTEBOOK_SMALL=1 shortens the training and the layout list. Budget: all notebooks
together under 3 minutes on the 2-core machine (each prints its time; run with -s to see it).
"""

import glob
import os
import time

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")

NOTEBOOKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks")
PATHS = sorted(glob.glob(os.path.join(NOTEBOOKS, "*.ipynb")))
EXPECTED = {"quickstart.ipynb", "memory_planner.ipynb", "parallelism_tour.ipynb"}


def test_all_expected_notebooks_exist():
  assert EXPECTED <= {os.path.basename(p) for p in PATHS}


@pytest.mark.parametrize("path", PATHS, ids=os.path.basename)
def test_notebook_runs(path, monkeypatch):
  monkeypatch.setenv("MESHTRON_NOTEBOOK_SMALL", "1")
  nb = nbformat.read(path, as_version=4)
  start = time.perf_counter()
  client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                   resources={"metadata": {"path": NOTEBOOKS}})
  client.execute()  # raises CellExecutionError (with the cell and traceback) on any error
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if o.get("output_type") == "error"]
  assert not errors
  # Measured on the 2-core machine (quiet): see the report of issue [14]. Not asserted: the
  # machine is shared, and a wall-clock bound would make this test flaky.
  print(f"{os.path.basename(path)}: {time.perf_counter() - start:.1f} s")
