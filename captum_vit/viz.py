"""Plots of attribution maps: overlays on the image and grids of several methods."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch.nn.functional as F
from torch import Tensor

SIGNS = ("auto", "all", "positive", "negative", "absolute_value")


def _image_to_numpy(image: Tensor) -> np.ndarray:
    """[C, H, W] -> [H, W, C] or [H, W] in [0, 1] (min-max per image for display)."""
    img = image.detach().float().cpu()
    img = (img - img.min()) / (img.max() - img.min()).clamp(min=1e-12)
    return img[0].numpy() if img.shape[0] == 1 else img.permute(1, 2, 0).numpy()


def upsample_map(attr: Tensor, size: tuple[int, int]) -> Tensor:
    """A map ([P] with a square grid, [gh, gw], [1, gh, gw] or [C, H, W]) -> [H, W], bilinear."""
    a = attr.detach().float().cpu()
    if a.dim() == 3:
        a = a.mean(0) if a.shape[0] > 1 or a.shape[-2:] == size else a[0]
    if a.dim() == 1:
        side = int(round(a.numel() ** 0.5))
        a = a.reshape(side, side)
    return F.interpolate(a[None, None], size=size, mode="bilinear", align_corners=False)[0, 0]


def plot_overlay(ax, image: Tensor, attr: Tensor, *, title: str | None = None,
                 sign: str = "auto", cmap: Any = None, alpha: float = 0.5,
                 outlier_perc: float = 2, colorbar: bool = True):
    """Draw ``attr`` (any map shape) over ``image`` [C, H, W] on a matplotlib axis.

    The map is upsampled bilinearly to the image size for display and drawn by Captum's
    ``visualize_image_attr(method="blended_heat_map")``, so values are scaled as in Captum:
    divided by the value below which ``100 - outlier_perc`` % of the absolute mass lies,
    then clipped.

    Args:
        ax (matplotlib.axes.Axes): the axis to draw on.
        image (Tensor): the image [C, H, W].
        attr (Tensor): the map (tokens, grid or pixels).
        title (str, optional): axis title.
        sign (str, optional): Captum's ``"all"``, ``"positive"``, ``"negative"`` or
            ``"absolute_value"``; ``"auto"`` (default) is ``"all"`` (red-white-green around
            zero) for a map with negative values, and otherwise ``"positive"`` after
            subtracting the map's minimum, so that a constant offset (attention rollout's
            identity share, TIS's mean score) does not tint the whole image.
        cmap (str or Colormap, optional): colour map; ``None`` = Captum's for the sign.
        alpha (float, optional): opacity of the map. Default 0.5.
        outlier_perc (float, optional): percentage of the largest values clipped for the
            colour scale (Captum's). Default 2.
        colorbar (bool, optional): add a colour bar. Default True.

    Returns:
        matplotlib.axes.Axes: ``ax``.

    Examples::

        >>> import matplotlib.pyplot as plt
        >>> from captum_vit import DecompX
        >>> from captum_vit.viz import plot_overlay
        >>> fig, ax = plt.subplots()
        >>> plot_overlay(ax, images[0], DecompX(model).attribute(images, output="grid")[0])
    """
    from captum.attr import visualization

    if sign not in SIGNS:
        raise ValueError(f"sign must be one of {', '.join(map(repr, SIGNS))}, got {sign!r}")
    h, w = image.shape[-2:]
    heat = upsample_map(attr, (h, w)).numpy()
    if sign == "auto":
        sign = "all" if (heat < 0).any() else "positive"
        if sign == "positive":
            heat = heat - heat.min()
    img = _image_to_numpy(image)
    visualization.visualize_image_attr(
        heat[..., None], img[..., None] if img.ndim == 2 else img, method="blended_heat_map",
        sign=sign, plt_fig_axis=(ax.figure, ax), outlier_perc=outlier_perc, cmap=cmap,
        alpha_overlay=alpha, show_colorbar=colorbar, use_pyplot=False)
    if title:
        ax.set_title(title, fontsize=9)
    ax.axis("off")
    return ax


def plot_grid(images: Tensor, maps: Mapping[str, Tensor], *,
              row_titles: Sequence[str] | None = None, path: str | None = None,
              max_cols: int = 5):
    """The input and every method's map: one row per image, or, for a single image, the
    panels wrapped into rows of ``max_cols``.

    Args:
        images (Tensor): [B, C, H, W].
        maps (Mapping[str, Tensor]): method name -> maps for the batch (any map shape).
        row_titles (Sequence[str], optional): a title for each input image.
        path (str, optional): save the figure there (PNG).
        max_cols (int, optional): panels per row for a single image. Default 5.

    Returns:
        matplotlib.figure.Figure

    Examples::

        >>> from captum_vit import GAE, Rollout
        >>> from captum_vit.viz import plot_grid
        >>> fig = plot_grid(images, {"GAE": GAE(model).attribute(images),
        ...                          "Rollout": Rollout(model).attribute(images)})
    """
    import matplotlib.pyplot as plt

    b = images.shape[0]
    panels = len(maps) + 1
    if b == 1:
        cols = min(max_cols, panels)
        rows = -(-panels // cols)
    else:
        cols, rows = panels, b
    fig, axes = plt.subplots(rows, cols, figsize=(2.8 * cols, 2.6 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for i in range(b):
        cells = list(axes.flat) if b == 1 else list(axes[i])
        img = _image_to_numpy(images[i])
        cells[0].imshow(img, cmap="gray" if img.ndim == 2 else None)
        cells[0].set_title(row_titles[i] if row_titles else "input", fontsize=9)
        for ax, (name, m) in zip(cells[1:], maps.items(), strict=False):
            plot_overlay(ax, images[i], m[i], title=name)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
        plt.close(fig)
    return fig


__all__ = ["plot_grid", "plot_overlay", "upsample_map"]

