"""Every notebook under notebooks/ runs top to bottom without an error (nbclient, python3 kernel).

Shapes are shrunk with FLEXJAX_NOTEBOOK_SMALL=1 unless the environment already sets it
(FLEXJAX_NOTEBOOK_SMALL=0 runs them at their committed size).
"""

import os
import pathlib

import pytest
from catalog import sweep

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NAMES = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))


def test_notebooks_exist():
    assert len(NAMES) >= 4, NAMES


# `make test` runs the performance plots (the lightest that reads BENCHMARKS-style JSON and
# plots); `make test-all` every notebook, the quickstart included; `make example` the GPT (07).
DEFAULT = ("04_performance.ipynb",)


@pytest.mark.parametrize("name", sweep(NAMES, DEFAULT, ids=NAMES))
def test_notebook_runs(name, monkeypatch):
    monkeypatch.setenv("FLEXJAX_NOTEBOOK_SMALL", os.environ.get("FLEXJAX_NOTEBOOK_SMALL", "1"))
    # The kernel inherits this environment; the simulated 8-device CPU of conftest.py is
    # not what notebook readers run.
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f)
    monkeypatch.setenv("XLA_FLAGS", flags)
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    images = sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
    assert images >= 1, f"{name} drew no figure"
