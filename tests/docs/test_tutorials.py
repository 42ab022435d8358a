"""The tutorials execute from top to bottom (nbclient, a fresh kernel each, with the
documentation build's kernel settings), their outputs show no path of the machine that ran
them (the build renders these outputs), and the pages that name the tutorials count them
right."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from captum_vit import zoo

nbformat = pytest.importorskip("nbformat")  # the test extra (absent in the lower-bounds venv)
NotebookClient = pytest.importorskip("nbclient").NotebookClient

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "tutorials").glob("*.ipynb"))
MACHINE_PATH = re.compile(r"(?:/home/|/root/|/work/|/Users/|/tmp/|[A-Za-z]:\\Users|"
                          r"site-packages|dist-packages|\.venv/lib)")
"""What a path of the machine that executed a notebook looks like in an output (a
warning's file, a traceback's frames)."""


def kernel_warnings() -> str:
    """The documentation build's ``PYTHONWARNINGS`` for the notebooks' kernels
    (``KERNEL_WARNINGS`` of ``docs/source/conf.py``, read from its source)."""
    conf = (ROOT / "docs" / "source" / "conf.py").read_text(encoding="utf-8")
    return re.search(r'^KERNEL_WARNINGS = "([^"]*)"', conf, re.MULTILINE).group(1)


def machine_paths(nb) -> list[str]:
    """The outputs of ``nb`` that contain a machine path: ``cell i: line``."""
    found = []
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            texts = [out.get("text", "")] + [v for k, v in out.get("data", {}).items()
                                             if k.startswith("text/")]
            texts += out.get("traceback", [])
            for text in texts:
                text = "".join(text) if isinstance(text, list) else str(text)
                found += [f"cell {i}: {line[:200]}" for line in text.splitlines()
                          if MACHINE_PATH.search(line)]
    return found


def test_a_machine_path_is_found():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x")])
    nb.cells[0].outputs = [nbformat.v4.new_output(
        "stream", name="stderr",
        text="/work/main/.venv/lib/python3.11/site-packages/tqdm/auto.py:21: TqdmWarning")]
    assert machine_paths(nb) == [
        "cell 0: /work/main/.venv/lib/python3.11/site-packages/tqdm/auto.py:21: TqdmWarning"]
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", name="stdout", text="GAE (2, 64)")]
    assert machine_paths(nb) == []


@pytest.mark.docs_build  # minutes (a kernel each): run by CI's docs step (.ci/docs)
@pytest.mark.skipif("vit_fmnist_loc" not in zoo.available(), reason="bundled model missing")
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
        "commit notebooks with outputs stripped"
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONWARNINGS", kernel_warnings())
    # timeout: a guard against a hung cell, not a speed check (generous for a busy machine)
    NotebookClient(nb, timeout=1800, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT)}}).execute()
    paths = machine_paths(nb)
    assert not paths, "machine paths in the rendered outputs:\n" + "\n".join(paths)
    # a printed "max |map| v" is a map of a random model: numerically zero ones blamed the
    # method (tutorial 05's SAM, ~1e-26, before seeded_init)
    peaks = [float(v) for cell in nb.cells for out in cell.get("outputs", [])
             for v in re.findall(r"max \|map\| ([-+.e0-9]+)", out.get("text", ""))]
    assert all(p > 1e-3 for p in peaks), peaks
    if path.name.startswith("05"):
        assert len(peaks) == 3, "tutorial 05 prints its three SAM maps' peaks"


def test_there_are_seven_tutorials():
    assert [p.name[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04", "05", "06", "07"]


NUMBERS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}


@pytest.mark.parametrize("page", ["README.md", "docs/source/guide/recipes.md",
                                  "docs/source/tutorials/index.md"])
def test_pages_count_the_notebooks_right(page):
    """"The five notebooks", "all five": a page that counts the tutorials counts them
    all."""
    text = " ".join((ROOT / page).read_text(encoding="utf-8").split())
    counts = re.findall(r"\b(two|three|four|five|six|seven|eight)\b (?:notebooks|tutorials)"
                        r"|\ball (two|three|four|five|six|seven|eight)\b", text)
    for said in (a or b for a, b in counts):
        assert said == NUMBERS[len(NOTEBOOKS)], f"{page} says {said!r} notebooks"
