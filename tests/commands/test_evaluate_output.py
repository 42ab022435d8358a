"""``captum-vit evaluate`` ergonomics: the results table on the terminal, each method's
time per image in the results, progress by method, readable legends with many methods."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from captum_vit.cli import main
from captum_vit.metrics import MetricResult, plot_curves
from captum_vit.metrics.report import aligned_table, text_table

METHODS = ("gae", "rollout", "random")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One small evaluation: its folder, standard output and standard error."""
    out = tmp_path_factory.mktemp("ux") / "o"
    argv = ["evaluate", "--model", "random:vit_tiny", "--data", "synthetic", "--n", "3",
            "--batch-size", "2", "--methods", ",".join(METHODS), "--metrics",
            "deletion,sparseness", "--dtype", "float64", "--out", str(out)]
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        assert main(argv) == 0
    return out, stdout.getvalue(), stderr.getvalue()


def test_the_terminal_shows_the_results_table_with_each_methods_row(run):
    out, stdout, _ = run
    lines = stdout.splitlines()
    assert lines[0].split() == ["method", "deletion", "↓", "sparseness", "↑", "s/image"]
    assert set(lines[1]) == {"-", " "}
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:]}
    assert list(rows) == list(METHODS)
    res = json.loads((out / "results.json").read_text())["results"]
    for m, cells in rows.items():
        assert float(cells[0]) == pytest.approx(res[m]["deletion"]["value"], rel=1e-3)
        assert float(cells[1]) == pytest.approx(res[m]["sparseness"]["value"], rel=1e-3)
        assert float(cells[2]) > 0
    assert len({len(line) for line in lines}) == 1  # aligned: right-aligned last column


def test_the_results_record_each_methods_seconds_per_image(run):
    out = run[0]
    data = json.loads((out / "results.json").read_text())
    seconds = data["seconds_per_image"]
    assert list(seconds) == list(METHODS) and all(t > 0 for t in seconds.values())
    md = (out / "results.md").read_text()
    table, timing = md.split("\n## Time per image\n")
    assert table.splitlines()[4].startswith("| gae |")
    for m in METHODS:
        assert f"| {m} | {seconds[m]:.4g} |" in timing


def test_progress_is_shown_method_by_method(run):
    err = run[2]
    for k, m in enumerate(METHODS, 1):
        assert f"method {k}/{len(METHODS)}: {m}" in err
    assert err.index("method 1/3: gae") < err.index("method 2/3: rollout") \
        < err.index("method 3/3: random")


def test_text_tables():
    assert aligned_table(["method", "deletion ↓"], [["gae", "0.1234"], ["random", "1"]]) == (
        "method  deletion ↓\n"
        "------  ----------\n"
        "gae         0.1234\n"
        "random           1\n")
    r = MetricResult("deletion", torch.tensor([0.5, 0.25]), False)
    assert text_table({"gae": {"deletion": r}}).splitlines()[2] == "gae" + " " * 10 + "0.375"
    assert text_table({"gae": {"deletion": r}}, {"gae": 0.5}).splitlines()[0].endswith(
        "s/image")


def _curves(n: int) -> dict[str, MetricResult]:
    x = torch.linspace(0, 1, 5, dtype=torch.float64)
    return {f"plus:method_number_{i}": MetricResult(
        "deletion", torch.full((2,), i / n), False, x,
        torch.rand(2, 5, generator=torch.Generator().manual_seed(i))) for i in range(n)}


def _legend_boxes(fig):
    fig.canvas.draw()
    ax = fig.axes[0]
    leg = ax.get_legend()
    return leg, leg.get_window_extent(), ax.get_window_extent(), fig.bbox


def test_a_plot_of_15_methods_keeps_its_legend_outside_the_axes(tmp_path):
    path = tmp_path / "curve.png"
    fig = plot_curves(_curves(15), path)
    assert path.read_bytes()[:4] == b"\x89PNG"
    leg, box, axes, page = _legend_boxes(fig)
    assert len(leg.get_texts()) == 15
    assert all(t.get_fontsize() <= 6 for t in leg.get_texts())
    assert box.x0 >= axes.x1  # beside the axes, not over the curves
    assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 \
        and box.y1 <= page.y1  # and not cut off
    assert leg._ncols == 1
    # very many methods: more columns, still on the page
    leg, box, axes, page = _legend_boxes(plot_curves(_curves(45)))
    assert leg._ncols == 3 and box.x0 >= axes.x1 and box.x1 <= page.x1 and box.y0 >= page.y0
    # a few methods: the legend stays inside the axes
    leg, box, axes, _ = _legend_boxes(plot_curves(_curves(4)))
    assert axes.x0 <= box.x0 and box.x1 <= axes.x1
