"""The notebooks run top to bottom on the CPU against this checkout (opt-in, ~4 min for the three).

Off by default: nbclient is not a test extra and the run would add minutes to CI. Run it after
changing the engine's data structures or public API (notebook 01 broke silently once, when a
cache dataclass gained an optional field):

    pip install -e ".[notebooks]" && BOLE_RUN_NOTEBOOKS=1 python -m pytest -q tests/test_notebooks.py

Executes each notebook in a fresh kernel, in memory: the saved outputs are not rewritten
(notebooks/README.md says how to re-save them).
"""

import glob
import os

import pytest

NB_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks")
NOTEBOOKS = sorted(glob.glob(os.path.join(NB_DIR, "*.ipynb")))

pytestmark = pytest.mark.skipif(
    os.environ.get("BOLE_RUN_NOTEBOOKS") != "1",
    reason="opt-in: BOLE_RUN_NOTEBOOKS=1 (needs the notebooks extra)",
)


def test_notebooks_found():
    assert len(NOTEBOOKS) >= 3, NB_DIR


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(path, as_version=4)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # the kernel inherits it; saved outputs: CPU
    nbclient.NotebookClient(
        nb, timeout=1200, kernel_name="python3", resources={"metadata": {"path": NB_DIR}}
    ).execute()
    errors = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]
    assert not errors, errors[0].get("evalue")
