"""Evaluation reports: the markdown table, CSV, JSON and curve plots, the terminal's text
table; output locations checked before any work."""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from captum_vit.metrics.results import MetricResult, plot_curves

Results = dict[str, dict[str, MetricResult]]


def ensure_folder(path: str | os.PathLike, *, option: str = "--out") -> Path:
    r"""Create the folder ``path`` (and its parents) now, so that a location that cannot
    hold the outputs fails before any work.

    Args:
        path (str or os.PathLike): the folder.
        option (str, optional): the option that named it, for the message. Default
            ``"--out"``.

    Returns:
        Path: the folder.

    Raises:
        ValueError: the folder cannot be created (a file is in the way, no permission).

    Examples::

        >>> from captum_vit.metrics.report import ensure_folder
        >>> ensure_folder("results/run1")
        PosixPath('results/run1')
    """
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        blocker = next((q for q in (p, *p.parents) if q.exists() and not q.is_dir()), None)
        why = f"{blocker} is a file, not a folder" if blocker else (e.strerror or str(e))
        raise ValueError(f"{option} {p}: cannot create the folder ({why}); choose another "
                         "location") from e
    if not os.access(p, os.W_OK):
        raise ValueError(f"{option} {p}: the folder is not writable; choose another location")
    return p


def ensure_file_location(path: str | os.PathLike, *, option: str = "--out",
                         formats: Sequence[str] | None = None) -> Path:
    r"""Check that a file can be written at ``path``: create its folder now and refuse an
    existing folder at ``path`` itself or an unknown file type, before any work.

    Args:
        path (str or os.PathLike): the file to write later.
        option (str, optional): the option that named it, for the message. Default
            ``"--out"``.
        formats (Sequence[str], optional): accepted suffixes without the dot (e.g.
            ``("png", "pdf")``); a path without a suffix is accepted. Default: any.

    Returns:
        Path: the file path.

    Raises:
        ValueError: ``path`` is a folder, or its folder cannot be created.

    Examples::

        >>> from captum_vit.metrics.report import ensure_file_location
        >>> ensure_file_location("figures/new/explain.png")
        PosixPath('figures/new/explain.png')
    """
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{option} {p} is a folder; give a file name such as "
                         f"{p / 'explain.png'}")
    suffix = p.suffix[1:].lower()
    if formats is not None and suffix and suffix not in formats:
        raise ValueError(f"{option} {p}: cannot write a .{suffix} file; use one of "
                         f"{', '.join('.' + f for f in formats)}")
    ensure_folder(p.parent, option=f"{option} {p}: its folder")
    return p


def _fmt(v: float) -> str:
    return "nan" if math.isnan(v) else f"{v:.4g}"


def _columns(results: Results) -> tuple[list[str], dict[str, str]]:
    """Every column of the results in first-seen order, and its better direction's arrow."""
    methods = list(results)
    cols = list(dict.fromkeys(c for m in methods for c in results[m]))
    arrows = {c: "↑" if next(results[m][c] for m in methods if c in results[m]).higher_is_better
              else "↓" for c in cols}
    return cols, arrows


def aligned_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    r"""Plain-text table with aligned columns (the first left-aligned, the others
    right-aligned), a rule under the header, two spaces between columns.

    Args:
        header (Sequence[str]): the column titles.
        rows (Sequence[Sequence[str]]): the cells, one row per sequence.

    Returns:
        str: the table, one line per row, ending with a newline.

    Examples::

        >>> from captum_vit.metrics.report import aligned_table
        >>> print(aligned_table(["method", "deletion ↓"], [["gae", "0.1234"]]), end="")
        method  deletion ↓
        ------  ----------
        gae         0.1234
    """
    widths = [max(len(str(r[i])) if i < len(r) else 0 for r in [header, *rows])
              for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        out = [str(c).ljust(w) if i == 0 else str(c).rjust(w)
               for i, (c, w) in enumerate(zip(cells, widths, strict=False))]
        return "  ".join(out).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]),
                      *(line(r) for r in rows)]) + "\n"


def text_table(results: Results, seconds_per_image: Mapping[str, float] | None = None) -> str:
    r"""The results as an aligned plain-text table for the terminal: one row per method,
    one column per metric (arrows give the better direction), and the seconds per image
    when given.

    Args:
        results (dict): method -> column -> :class:`MetricResult`.
        seconds_per_image (Mapping[str, float], optional): method -> seconds per image
            (:func:`captum_vit.metrics.suite.evaluate`'s ``timings``). Default ``None``.

    Returns:
        str: the table.

    Examples::

        >>> from captum_vit.metrics.report import text_table
        >>> print(text_table(results, {"gae": 0.012, "random": 0.001}))
    """
    cols, arrows = _columns(results)
    header = ["method", *(f"{c} {arrows[c]}" for c in cols)]
    rows = [[m, *(_fmt(results[m][c].value) if c in results[m] else "" for c in cols)]
            for m in results]
    if seconds_per_image is not None:
        header.append("s/image")
        for row, m in zip(rows, results, strict=True):
            row.append(_fmt(seconds_per_image[m]) if m in seconds_per_image else "")
    return aligned_table(header, rows)


def timing_table(seconds_per_image: Mapping[str, float]) -> str:
    r"""The markdown section of ``results.md`` giving each method's seconds per image.

    Args:
        seconds_per_image (Mapping[str, float]): method -> seconds per image.

    Returns:
        str: the section (a ``## Time per image`` title and a table).
    """
    lines = ["## Time per image", "",
             "Wall-clock seconds per image of each method's maps and metrics (data loading "
             "excluded; summed over processes under torchrun).", "",
             "| method | seconds per image |", "|---|---:|"]
    lines += [f"| {m} | {_fmt(t)} |" for m, t in seconds_per_image.items()]
    return "\n".join(lines) + "\n"


def markdown_table(results: Results, config: dict[str, Any],
                   seconds_per_image: Mapping[str, float] | None = None) -> str:
    r"""The results as a markdown table (one row per method, arrows give the better
    direction of each column), followed by the time per image when given.

    Args:
        results (dict): method -> column -> :class:`MetricResult`.
        config (dict): ``model``, ``data``, ``n``, ``removal`` and ``seed`` for the title.
        seconds_per_image (Mapping[str, float], optional): method -> seconds per image
            (:func:`timing_table`). Default ``None``.

    Returns:
        str: the markdown text.

    Examples::

        >>> print(markdown_table(results, {"model": "zoo:vit_fmnist_loc", "data": "sample",
        ...                                "n": 32, "removal": "token", "seed": 0}))
    """
    methods = list(results)
    cols, arrows = _columns(results)
    lines = [f"# Evaluation: {config['model']} on {config['data']} (n={config['n']}, "
             f"removal={config['removal']}, seed={config['seed']})", "",
             "| method | " + " | ".join(f"{c} {arrows[c]}" for c in cols) + " |",
             "|---|" + "---:|" * len(cols)]
    for m in methods:
        vals = [_fmt(results[m][c].value) if c in results[m] else "" for c in cols]
        lines.append(f"| {m} | " + " | ".join(vals) + " |")
    text = "\n".join(lines) + "\n"
    if seconds_per_image is not None:
        text += "\n" + timing_table(seconds_per_image)
    return text


def write_outputs(out: str | os.PathLike, results: Results, config: dict[str, Any],
                  seconds_per_image: Mapping[str, float] | None = None) -> None:
    r"""Write ``results.csv``, ``results.json``, ``results.md`` and ``curve_<column>.png``.

    Args:
        out (str or os.PathLike): the folder (created if missing).
        results (dict): method -> column -> :class:`MetricResult`.
        config (dict): the run's settings (stored in the JSON; see :func:`markdown_table`).
        seconds_per_image (Mapping[str, float], optional): method -> seconds per image,
            stored in ``results.json`` (``"seconds_per_image"``) and ``results.md`` (a
            section after the table). Default ``None``.

    Examples::

        >>> from captum_vit.metrics.report import write_outputs
        >>> write_outputs("results", evaluate(model, data, ["gae"], ["deletion"]),
        ...               {"model": "zoo:vit_fmnist_loc", "data": "sample", "n": 32,
        ...                "removal": "token", "seed": 0})
    """
    folder = ensure_folder(out)
    methods = list(results)
    with open(folder / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "metric", "value", "higher_is_better", "n"])
        for m in methods:
            for c, r in results[m].items():
                w.writerow([m, c, repr(r.value), int(r.higher_is_better), len(r)])
    payload: dict[str, Any] = {
        "config": config,
        "results": {m: {c: r.to_dict() for c, r in results[m].items()} for m in methods}}
    if seconds_per_image is not None:
        payload["seconds_per_image"] = {m: float(t) for m, t in seconds_per_image.items()}
    (folder / "results.json").write_text(json.dumps(payload, indent=1, allow_nan=False))
    (folder / "results.md").write_text(markdown_table(results, config, seconds_per_image))
    for c in dict.fromkeys(c for m in methods for c in results[m]):
        curves = {m: results[m][c] for m in methods
                  if c in results[m] and results[m][c].curves is not None}
        if curves:
            plot_curves(curves, folder / f"curve_{c}.png",
                        xlabel="randomised stages" if c == "randomization" else "fraction")


__all__ = ["aligned_table", "ensure_file_location", "ensure_folder", "markdown_table",
           "text_table", "timing_table", "write_outputs"]
