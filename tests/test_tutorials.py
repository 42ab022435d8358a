"""The tutorials execute from top to bottom (nbclient, a fresh kernel each)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from captum_vit import zoo

nbformat = pytest.importorskip("nbformat")  # the test extra (absent in the lower-bounds venv)
NotebookClient = pytest.importorskip("nbclient").NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "tutorials").glob("*.ipynb"))


@pytest.mark.skipif("vit_fmnist_loc" not in zoo.available(), reason="bundled model missing")
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
        "commit notebooks with outputs stripped"
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # timeout: a guard against a hung cell, not a speed check (generous for a busy machine)
    NotebookClient(nb, timeout=1800, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT)}}).execute()


def test_there_are_five_tutorials():
    assert [p.name[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04", "05"]
