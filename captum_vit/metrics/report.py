"""Evaluation reports: the markdown table, CSV, JSON and curve plots, the terminal's text
table; output locations checked before any work; bootstrap confidence intervals over
examples (:func:`bootstrap_ci`, :func:`paired_bootstrap_ci`, :func:`verdict`)."""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

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


Sample = MetricResult | Tensor | Sequence[float]
"""What :func:`bootstrap_ci` resamples: a :class:`MetricResult` (its examples, reduced as
its dataset value is) or one value per example (a [B] tensor or sequence)."""

_IOU_COLUMNS = ("inter_bg", "union_bg", "inter_fg", "union_fg")


@dataclass(frozen=True)
class BootstrapCI:
    r"""A statistic on a sample of examples and its percentile bootstrap confidence
    interval (examples resampled with replacement).

    Attributes:
        estimate (float): the statistic on the sample itself (for a
            :class:`MetricResult`: its ``value``).
        low (float): the lower end of the interval.
        high (float): the upper end of the interval.
        level (float): the interval's coverage (``0.95``: the 2.5th and 97.5th
            percentiles of the resampled statistics).
        n_boot (int): the number of resamples.
    """

    estimate: float
    low: float
    high: float
    level: float = 0.95
    n_boot: int = 2000

    def contains(self, value: float = 0.0) -> bool:
        r"""Whether ``value`` lies in the closed interval ``[low, high]``.

        Args:
            value (float, optional): the value. Default ``0.0`` (for a difference: is it
                within noise?).

        Returns:
            bool: ``low <= value <= high``.
        """
        return self.low <= value <= self.high

    def format(self, digits: int = 3, *, sign: bool = False) -> str:
        r"""``"estimate [low, high]"`` with ``digits`` decimals.

        Args:
            digits (int, optional): decimals. Default 3.
            sign (bool, optional): write ``+`` before positive numbers (differences).
                Default ``False``.

        Returns:
            str: e.g. ``"0.138 [0.129, 0.147]"``.
        """
        f = f"{{:+.{digits}f}}" if sign else f"{{:.{digits}f}}"
        return f"{f.format(self.estimate)} [{f.format(self.low)}, {f.format(self.high)}]"

    def __str__(self) -> str:
        return self.format()


def _check_count(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < least:
        raise ValueError(f"{name} must be at least {least}, got {value}")
    return value


def _check_level(level: Any) -> float:
    if isinstance(level, bool) or not isinstance(level, (int, float)):
        raise TypeError(f"level must be a float in (0, 1), got {type(level).__name__}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1) (0.95 for a 95% interval), got {level}")
    return float(level)


def bootstrap_indices(n: int, *, n_boot: int = 2000, seed: int = 0) -> Tensor:
    r"""The example indices of ``n_boot`` bootstrap resamples of ``n`` examples, drawn
    with replacement from a generator seeded with ``seed`` (the same seed gives the same
    resamples; :func:`bootstrap_ci` and :func:`paired_bootstrap_ci` use these).

    Args:
        n (int): the number of examples.
        n_boot (int, optional): the number of resamples. Default 2000.
        seed (int, optional): the generator's seed. Default 0.

    Returns:
        Tensor: ``[n_boot, n]`` indices (int64) in ``[0, n)``.

    Raises:
        ValueError: ``n`` or ``n_boot`` is below 1.

    Examples::

        >>> from captum_vit.metrics.report import bootstrap_indices
        >>> bootstrap_indices(4, n_boot=2, seed=0).shape
        torch.Size([2, 4])
    """
    _check_count("n", n, 1)
    _check_count("n_boot", n_boot, 1)
    g = torch.Generator().manual_seed(int(seed))
    return torch.randint(n, (n_boot, n), generator=g)


def _as_sample(x: Any, name: str) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
    """``x`` as ``[B, K]`` float64 columns and the reduction of ``[..., B, K]`` to ``[...]``
    that gives its dataset value (a MetricResult's reduction; NaN-skipping mean otherwise)."""
    if isinstance(x, MetricResult):
        if x.reduction == "iou":
            missing = [c for c in _IOU_COLUMNS if c not in x.stats]
            if missing:
                raise ValueError(f"{name}: the IoU result {x.name!r} lacks the per-example "
                                 f"stats {missing}; keep its stats to bootstrap it")
            cols = torch.stack([x.stats[c].detach().cpu().double() for c in _IOU_COLUMNS], 1)

            def iou(v: Tensor) -> Tensor:
                s = v.sum(-2)
                return (s[..., 0] / s[..., 1].clamp_min(1)
                        + s[..., 2] / s[..., 3].clamp_min(1)) / 2

            return cols, iou
        values = x.per_example.detach().cpu().double()
    elif isinstance(x, Tensor):
        values = x.detach().cpu().double()
    else:
        try:
            values = torch.as_tensor(x, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(f"{name} must be a MetricResult, a tensor or a sequence of "
                            f"numbers (one per example), got {type(x).__name__}") from e
    if values.dim() != 1 or values.numel() == 0:
        raise ValueError(f"{name} must hold one value per example ([B], B ≥ 1), got shape "
                         f"{list(values.shape)}; pass a statistic for other shapes")
    return values[:, None], lambda v: v[..., 0].nanmean(-1)


def _interval(estimate: float, boot: Tensor, level: float) -> BootstrapCI:
    a = (1 - level) / 2
    q = torch.nanquantile(boot.double(), torch.tensor([a, 1 - a], dtype=torch.float64))
    return BootstrapCI(float(estimate), float(q[0]), float(q[1]), level, int(boot.numel()))


def _resampled(values: Tensor, reduce: Callable[[Tensor], Tensor], idx: Tensor,
               chunk: int = 256) -> Tensor:
    return torch.cat([reduce(values[idx[i:i + chunk]]) for i in range(0, len(idx), chunk)])


def _custom(values: Any, statistic: Callable[[Tensor], Any], name: str) -> Tensor:
    if isinstance(values, MetricResult):
        raise TypeError(f"{name}: a MetricResult is reduced as its value is; pass "
                        "result.per_example to use your own statistic")
    v = values.detach().cpu() if isinstance(values, Tensor) else torch.as_tensor(values)
    if v.dim() == 0 or v.shape[0] == 0:
        raise ValueError(f"{name} must have one row per example (first axis B ≥ 1), got "
                         f"shape {list(v.shape)}")
    return v


def bootstrap_ci(values: Sample, statistic: Callable[[Tensor], Any] | None = None, *,
                 n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> BootstrapCI:
    r"""Percentile bootstrap confidence interval of a statistic over examples: the
    examples are resampled with replacement ``n_boot`` times (:func:`bootstrap_indices`),
    the statistic is computed on each resample, and the interval is the
    ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles (linear interpolation) of those.

    Args:
        values (MetricResult, Tensor or Sequence[float]): a :class:`MetricResult`
            (resampled per example and reduced as its ``value`` is: mean, NaN-skipping
            mean, or the IoU accumulated over the resampled examples' stats), or one value
            per example ``[B]`` (NaN values are skipped by the mean), or, with
            ``statistic``, any tensor whose first axis is the examples.
        statistic (Callable, optional): computes the statistic (a float or 0-d tensor) of
            a resampled tensor (the rows of ``values`` at the resampled indices). Default
            ``None``: the mean (or the result's reduction), computed for all resamples at
            once.
        n_boot (int, optional): the number of resamples. Default 2000.
        level (float, optional): the interval's coverage. Default 0.95.
        seed (int, optional): the resamples' seed; the same seed, number of examples and
            ``n_boot`` give the same resamples, so intervals of several methods on the same
            examples are computed from the same resamples. Default 0.

    Returns:
        BootstrapCI: the statistic on ``values`` (``estimate``) and its interval.

    Raises:
        TypeError: ``values`` is not one of the types above, or a MetricResult is given
            with a ``statistic``.
        ValueError: ``values`` is empty or not ``[B]`` without a ``statistic``, ``n_boot``
            is below 1 or ``level`` is outside (0, 1).

    Examples::

        >>> import torch
        >>> from captum_vit.metrics.report import bootstrap_ci
        >>> ci = bootstrap_ci(torch.tensor([0.12, 0.15, 0.11, 0.18, 0.14]))
        >>> ci.low <= ci.estimate <= ci.high
        True
        >>> median = bootstrap_ci(torch.rand(100), lambda v: v.median())
        >>> # a MetricResult (e.g. evaluate(...)["gae"]["miou"]) is reduced as its value is
    """
    _check_count("n_boot", n_boot, 1)
    level = _check_level(level)
    if statistic is None:
        data, reduce = _as_sample(values, "values")
        idx = bootstrap_indices(len(data), n_boot=n_boot, seed=seed)
        return _interval(float(reduce(data)), _resampled(data, reduce, idx), level)
    v = _custom(values, statistic, "values")
    idx = bootstrap_indices(v.shape[0], n_boot=n_boot, seed=seed)
    boot = torch.tensor([float(statistic(v[i])) for i in idx], dtype=torch.float64)
    return _interval(float(statistic(v)), boot, level)


def paired_bootstrap_ci(a: Sample, b: Sample, statistic: Callable[[Tensor], Any] | None = None,
                        *, n_boot: int = 2000, level: float = 0.95,
                        seed: int = 0) -> BootstrapCI:
    r"""Paired bootstrap confidence interval of the difference ``stat(a) − stat(b)`` of two
    methods measured on the same examples: each resample draws examples with replacement
    and takes the same examples for ``a`` and ``b``, so the interval reflects the spread
    of the difference, not of each value alone. If it contains 0 the difference is within
    the noise of the examples (:func:`verdict`).

    Args:
        a (MetricResult, Tensor or Sequence[float]): the first method's result or
            per-example values (see :func:`bootstrap_ci`).
        b (MetricResult, Tensor or Sequence[float]): the second, on the same examples in
            the same order.
        statistic (Callable, optional): as in :func:`bootstrap_ci`, applied to each side.
            Default ``None``: each side's mean (or its result's reduction).
        n_boot (int, optional): the number of resamples. Default 2000.
        level (float, optional): the interval's coverage. Default 0.95.
        seed (int, optional): the resamples' seed. Default 0.

    Returns:
        BootstrapCI: ``stat(a) − stat(b)`` on the sample (``estimate``) and its interval.

    Raises:
        TypeError: as :func:`bootstrap_ci`.
        ValueError: ``a`` and ``b`` have different numbers of examples, or as
            :func:`bootstrap_ci`.

    Examples::

        >>> import torch
        >>> from captum_vit.metrics.report import paired_bootstrap_ci, verdict
        >>> a = torch.tensor([0.10, 0.12, 0.09, 0.15, 0.11])   # deletion of method A
        >>> d = paired_bootstrap_ci(a, a + 0.05)                # minus method B's
        >>> verdict([d], higher_is_better=False)   # does A delete better than B?
        'holds'
    """
    _check_count("n_boot", n_boot, 1)
    level = _check_level(level)
    if statistic is None:
        da, ra = _as_sample(a, "a")
        db, rb = _as_sample(b, "b")
        if len(da) != len(db):
            raise ValueError(f"a and b must be measured on the same examples; got {len(da)} "
                             f"and {len(db)} examples")
        idx = bootstrap_indices(len(da), n_boot=n_boot, seed=seed)
        boot = _resampled(da, ra, idx) - _resampled(db, rb, idx)
        return _interval(float(ra(da) - rb(db)), boot, level)
    va, vb = _custom(a, statistic, "a"), _custom(b, statistic, "b")
    if va.shape[0] != vb.shape[0]:
        raise ValueError(f"a and b must be measured on the same examples; got {va.shape[0]} "
                         f"and {vb.shape[0]} examples")
    idx = bootstrap_indices(va.shape[0], n_boot=n_boot, seed=seed)
    boot = torch.tensor([float(statistic(va[i])) - float(statistic(vb[i])) for i in idx],
                        dtype=torch.float64)
    return _interval(float(statistic(va)) - float(statistic(vb)), boot, level)


VERDICTS = ("holds", "does not hold", "within noise")
"""What :func:`verdict` returns."""


def verdict(differences: Sequence[BootstrapCI], *, higher_is_better: bool) -> str:
    r"""The verdict on a claim that one method beats one or more others, from the paired
    intervals of the differences ``claimed − other`` (:func:`paired_bootstrap_ci`).

    ``"does not hold"`` when some interval lies entirely on the wrong side of 0 (that
    other method is better beyond the noise); otherwise ``"holds"`` when every interval
    lies entirely on the claimed side; otherwise (some interval contains 0)
    ``"within noise"``.

    Args:
        differences (Sequence[BootstrapCI]): the intervals of ``claimed − other``, one per
            method the claim is about.
        higher_is_better (bool): the metric's direction (the claim needs positive
            differences when ``True``, negative ones when ``False``).

    Returns:
        str: one of :data:`VERDICTS`.

    Raises:
        ValueError: ``differences`` is empty.

    Examples::

        >>> from captum_vit.metrics.report import BootstrapCI, verdict
        >>> verdict([BootstrapCI(0.01, -0.004, 0.03)], higher_is_better=True)
        'within noise'
    """
    if not differences:
        raise ValueError("differences is empty; give the interval of at least one "
                         "difference claimed − other")
    sign = 1.0 if higher_is_better else -1.0
    # each interval with the claimed direction made positive
    gains = [sorted((sign * d.low, sign * d.high)) for d in differences]
    if any(hi < 0 for _, hi in gains):
        return "does not hold"
    if all(lo > 0 for lo, _ in gains):
        return "holds"
    return "within noise"


__all__ = ["VERDICTS", "BootstrapCI", "Sample", "aligned_table", "bootstrap_ci",
           "bootstrap_indices", "ensure_file_location", "ensure_folder", "markdown_table",
           "paired_bootstrap_ci", "text_table", "timing_table", "verdict", "write_outputs"]
