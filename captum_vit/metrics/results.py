"""Tidy metric results: per-example values, the dataset value, curves, and a plot helper."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor

REDUCTIONS = ("mean", "nanmean", "iou")
LEGEND_INSIDE = 8
"""Up to this many curves the legend sits inside the axes; beyond, outside on the right."""
LEGEND_ROWS = 20
"""Entries per legend column outside the axes (more curves: more columns)."""


@dataclass
class MetricResult:
    """One metric of one attribution method over a set of examples.

    Attributes:
        name (str): metric name (snake_case).
        per_example (Tensor): [B] value of every example (NaN where an example is
            skipped, e.g. the pointing game's large regions).
        higher_is_better (bool): direction of the metric (the ↑/↓ arrow of tables).
        x (Tensor, optional): [S] abscissa of the curves (fraction of patches, ratio, ...).
        curves (Tensor, optional): [B, S] per-example curve.
        stats (dict[str, Tensor]): extra per-example columns [B] needed by the reduction
            (segmentation's intersections and unions).
        reduction (str): ``"mean"``, ``"nanmean"`` (skip NaN) or ``"iou"`` (mean over the
            classes of ``sum(inter_c) / sum(union_c)`` from ``stats``).
    """

    name: str
    per_example: Tensor
    higher_is_better: bool
    x: Tensor | None = None
    curves: Tensor | None = None
    stats: dict[str, Tensor] = field(default_factory=dict)
    reduction: str = "mean"

    @property
    def value(self) -> float:
        """The dataset value (mean over examples, or the accumulated IoU)."""
        if self.reduction == "iou":
            ious = [self.stats[f"inter_{c}"].sum() / self.stats[f"union_{c}"].sum().clamp_min(1)
                    for c in ("bg", "fg")]
            return float(sum(ious) / 2)
        v = self.per_example.double()
        if self.reduction == "nanmean":
            v = v[~torch.isnan(v)]
        return float(v.mean()) if v.numel() else math.nan

    @property
    def mean_curve(self) -> Tensor | None:
        """The curve averaged over examples [S] (None for scalar metrics)."""
        return None if self.curves is None else self.curves.double().mean(0)

    def __len__(self) -> int:
        return int(self.per_example.shape[0])

    @staticmethod
    def cat(parts: Sequence[MetricResult]) -> MetricResult:
        """Concatenate the results of consecutive example shards (same metric)."""
        if not parts:
            raise ValueError("MetricResult.cat needs at least one result")
        first = parts[0]
        # the shards of one metric all have curves, or none has
        curves = None if first.curves is None else torch.cat(
            [cast(Tensor, p.curves) for p in parts])
        stats = {k: torch.cat([p.stats[k] for p in parts]) for k in first.stats}
        return MetricResult(first.name, torch.cat([p.per_example for p in parts]),
                            first.higher_is_better, first.x, curves, stats, first.reduction)

    def to(self, device: str | torch.device) -> MetricResult:
        """The same result with every tensor on ``device`` (e.g. ``"cpu"`` before gathering)."""
        def mv(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.detach().to(device)

        return MetricResult(self.name, self.per_example.detach().to(device),
                            self.higher_is_better, mv(self.x), mv(self.curves),
                            {k: v.detach().to(device) for k, v in self.stats.items()},
                            self.reduction)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dictionary (lists of floats, NaN as None)."""
        def lst(t: Tensor | None) -> Any:
            if t is None:
                return None
            return [None if math.isnan(v) else v for v in t.double().flatten().tolist()] \
                if t.dim() == 1 else [lst(r) for r in t]

        value = self.value
        return {"name": self.name, "value": None if math.isnan(value) else value,
                "higher_is_better": self.higher_is_better, "n": len(self),
                "per_example": lst(self.per_example), "x": lst(self.x),
                "mean_curve": lst(self.mean_curve)}

    def __repr__(self) -> str:
        arrow = "↑" if self.higher_is_better else "↓"
        return f"MetricResult({self.name}{arrow}={self.value:.4g}, n={len(self)})"


def plot_curves(results: Mapping[str, MetricResult], path: str | Path | None = None, *,
                title: str | None = None, xlabel: str = "fraction of patches",
                ylabel: str | None = None) -> Any:
    """Plot the mean curve of several results (e.g. one per method) on one axis.

    Up to :data:`LEGEND_INSIDE` curves the legend sits inside the axes; with more it goes
    outside on the right, in a smaller font and :data:`LEGEND_ROWS` entries per column,
    and the figure widens to keep the axes' size.

    Args:
        results (Mapping[str, MetricResult]): label -> result with curves.
        path (str or Path, optional): where to save a PNG; the figure is closed after saving.
        title, xlabel, ylabel (str, optional): axis texts (title defaults to the metric name).

    Returns:
        matplotlib.figure.Figure: the figure (closed when ``path`` is given).

    Examples::

        >>> from captum_vit import GAE, RandomMap
        >>> from captum_vit.metrics import deletion, plot_curves
        >>> res = {"gae": deletion(model, x, GAE(model)),
        ...        "random": deletion(model, x, RandomMap(model))}
        >>> fig = plot_curves(res, "deletion.png")
    """
    import matplotlib

    if path is not None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    many = len(results) > LEGEND_INSIDE
    ncol = -(-len(results) // LEGEND_ROWS) if many else 1
    fig, ax = plt.subplots(figsize=(5 + 2.0 * ncol if many else 5, 3.5))
    name = None
    # 20 distinct colours, solid then dashed, so that up to 40 methods stay apart
    # tab20 is a ListedColormap (matplotlib types get_cmap as the Colormap base)
    colours = plt.get_cmap("tab20").colors if len(  # type: ignore[attr-defined]
        results) > 10 else [None] * 10
    for i, (label, res) in enumerate(results.items()):
        if res.curves is None or res.x is None:
            raise ValueError(f"result {label!r} ({res.name}) has no curve to plot")
        name = res.name
        curve = cast(Tensor, res.mean_curve)  # res.curves is not None (checked above)
        ax.plot(res.x.double().cpu().numpy(), curve.cpu().numpy(), marker=".",
                color=colours[i % len(colours)], linestyle="-" if i < 20 else "--",
                label=f"{label} ({res.value:.3g})")
    ax.set_title(title or name or "")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel or "mean over examples")
    ax.grid(alpha=0.3)
    if many:
        ax.legend(fontsize=6, ncol=ncol, loc="upper left", bbox_to_anchor=(1.02, 1.0),
                  borderaxespad=0.0)
    else:
        ax.legend(fontsize=7)
    fig.tight_layout()
    if path is not None:
        fig.savefig(str(path), dpi=100, metadata={"Software": None})
        plt.close(fig)
    return fig
