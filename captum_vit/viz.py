"""Plots of attribution maps: overlays on the image and grids of several methods."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch.nn.functional as F
from torch import Tensor

SIGNS = ("auto", "all", "positive", "negative", "absolute_value")
DISPLAYS = ("nearest", "bilinear")
COLORBAR_LABEL = "normalised per panel"


def figure_formats() -> tuple[str, ...]:
    """File suffixes matplotlib can save a figure as (``png``, ``pdf``, ``svg`` ...).

    Examples::

        >>> from captum_vit.viz import figure_formats
        >>> "png" in figure_formats()
        True
    """
    from matplotlib.backend_bases import FigureCanvasBase

    return tuple(FigureCanvasBase.get_supported_filetypes())


def _image_to_numpy(image: Tensor) -> np.ndarray:
    """[C, H, W] -> [H, W, C] or [H, W] in [0, 1] (min-max per image for display)."""
    img = image.detach().float().cpu()
    img = (img - img.min()) / (img.max() - img.min()).clamp(min=1e-12)
    return img[0].numpy() if img.shape[0] == 1 else img.permute(1, 2, 0).numpy()


def patch_grid(num_patches: int, size: tuple[int, int]) -> tuple[int, int]:
    r"""The patch grid ``(gh, gw)`` of a token map of ``num_patches`` on an image of
    ``size``: the factorisation ``gh * gw = num_patches`` whose ratio ``gh / gw`` is
    closest to the image's ``H / W`` (in log scale).

    Args:
        num_patches (int): number of patch tokens.
        size (tuple[int, int]): ``(H, W)`` of the image.

    Returns:
        tuple[int, int]: ``(gh, gw)``.

    Examples::

        >>> from captum_vit.viz import patch_grid
        >>> patch_grid(32, (56, 28))
        (8, 4)
    """
    h, w = size
    target = math.log(h / w)
    pairs = [(d, num_patches // d) for d in range(1, num_patches + 1) if num_patches % d == 0]
    return min(pairs, key=lambda g: abs(math.log(g[0] / g[1]) - target))


def upsample_map(attr: Tensor, size: tuple[int, int], *, grid: tuple[int, int] | None = None,
                 display: str = "nearest") -> Tensor:
    r"""A map of any shape as an image-sized map ``[H, W]`` for display.

    Args:
        attr (Tensor): a token map ``[P]``, a grid ``[gh, gw]`` or ``[1, gh, gw]``, or a
            pixel map ``[C, H, W]`` (averaged over channels).
        size (tuple[int, int]): ``(H, W)`` of the image.
        grid (tuple[int, int], optional): ``(gh, gw)`` of a token map; by default the
            factorisation of ``P`` closest to the image's aspect ratio
            (:func:`patch_grid`).
        display (str, optional): ``"nearest"`` (default): each patch's score fills its
            patch, as the methods return it; ``"bilinear"``: smoothed between patch
            centres (``align_corners=False``) — a display choice, not what was computed.

    Returns:
        Tensor: float32 ``[H, W]`` on the CPU.

    Raises:
        ValueError: unknown ``display``, or a ``grid`` that does not fit the map.

    Examples::

        >>> from captum_vit.viz import upsample_map
        >>> upsample_map(torch.rand(32), (56, 28)).shape      # an 8 x 4 patch grid
        torch.Size([56, 28])
    """
    if display not in DISPLAYS:
        raise ValueError(f"display must be one of {', '.join(map(repr, DISPLAYS))}, "
                         f"got {display!r}")
    a = attr.detach().float().cpu()
    size = (int(size[0]), int(size[1]))
    if a.dim() == 3:
        a = a.mean(0) if a.shape[0] > 1 or tuple(a.shape[-2:]) == size else a[0]
    if a.dim() == 1:
        gh, gw = grid if grid is not None else patch_grid(a.numel(), size)
        if gh * gw != a.numel():
            raise ValueError(f"grid {(gh, gw)} does not fit a token map of {a.numel()} patches")
        a = a.reshape(gh, gw)
    elif grid is not None and tuple(a.shape) != tuple(grid):
        raise ValueError(f"grid {tuple(grid)} does not fit a map of shape {tuple(a.shape)}")
    if a.dim() != 2:
        raise ValueError(f"cannot display a map of shape {tuple(attr.shape)}; give [P], "
                         "[gh, gw], [1, gh, gw] or [C, H, W]")
    if tuple(a.shape) == size:
        return a
    if display == "nearest":
        return F.interpolate(a[None, None], size=size, mode="nearest-exact")[0, 0]
    return F.interpolate(a[None, None], size=size, mode="bilinear", align_corners=False)[0, 0]


def prediction_title(probs: Tensor, target: int, class_names: Sequence[str] | None = None, *,
                     sep: str = " · ") -> str:
    r"""A title naming the prediction and the explained class with their probabilities.

    Args:
        probs (Tensor): class probabilities of one image ``[K]``.
        target (int): the explained class.
        class_names (Sequence[str], optional): names of the classes (``"class k"`` if
            ``None``).
        sep (str, optional): between the two parts (``"\n"`` for two lines). Default
            ``" · "``.

    Returns:
        str: e.g. ``"predicted Coat (p=0.85) · explaining Dress (p=0.03)"``.

    Examples::

        >>> from captum_vit.viz import prediction_title
        >>> prediction_title(torch.tensor([0.1, 0.9]), 0, ["cat", "dog"])
        'predicted dog (p=0.90) · explaining cat (p=0.10)'
    """
    pred = int(probs.argmax())

    def name(k: int) -> str:
        return class_names[k] if class_names else f"class {k}"

    return (f"predicted {name(pred)} (p={float(probs[pred]):.2f}){sep}"
            f"explaining {name(target)} (p={float(probs[target]):.2f})")


def plot_overlay(ax, image: Tensor, attr: Tensor, *, title: str | None = None,
                 sign: str = "auto", cmap: Any = None, alpha: float = 0.5,
                 outlier_perc: float = 2, colorbar: bool = True, display: str = "nearest"):
    """Draw ``attr`` (any map shape) over ``image`` [C, H, W] on a matplotlib axis.

    The map is brought to the image size (:func:`upsample_map`: patch-constant by
    default) and drawn by Captum's ``visualize_image_attr(method="blended_heat_map")``,
    so values are scaled as in Captum, separately for each panel: divided by the value
    below which ``100 - outlier_perc`` % of the absolute mass lies, then clipped; the
    colour bar says so ("normalised per panel").

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
        colorbar (bool, optional): add a colour bar (labelled "normalised per panel").
            Default True.
        display (str, optional): ``"nearest"`` (default; each patch one colour, as the
            map was computed) or ``"bilinear"`` (smoothed for display).

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
    heat = upsample_map(attr, (h, w), display=display).numpy()
    if sign == "auto":
        sign = "all" if (heat < 0).any() else "positive"
        if sign == "positive":
            heat = heat - heat.min()
    img = _image_to_numpy(image)
    visualization.visualize_image_attr(
        heat[..., None], img[..., None] if img.ndim == 2 else img, method="blended_heat_map",
        sign=sign, plt_fig_axis=(ax.figure, ax), outlier_perc=outlier_perc, cmap=cmap,
        alpha_overlay=alpha, show_colorbar=colorbar, use_pyplot=False)
    bar = ax.images[-1].colorbar if colorbar and ax.images else None
    if bar is not None:
        bar.set_label(COLORBAR_LABEL, fontsize=7)
    if title:
        ax.set_title(title, fontsize=9)
    ax.axis("off")
    return ax


def plot_grid(images: Tensor, maps: Mapping[str, Tensor], *,
              row_titles: Sequence[str] | None = None, path: str | None = None,
              max_cols: int = 5, display: str = "nearest"):
    """The input and every method's map: one row per image, or, for a single image, the
    panels wrapped into rows of ``max_cols``.

    Args:
        images (Tensor): [B, C, H, W].
        maps (Mapping[str, Tensor]): method name -> maps for the batch (any map shape).
        row_titles (Sequence[str], optional): a title for each input image.
        path (str, optional): save the figure there (PNG).
        max_cols (int, optional): panels per row for a single image. Default 5.
        display (str, optional): ``"nearest"`` (default) or ``"bilinear"``, see
            :func:`upsample_map`.

    Returns:
        matplotlib.figure.Figure

    Examples::

        >>> from captum_vit import GAE, Rollout
        >>> from captum_vit.viz import plot_grid
        >>> fig = plot_grid(images, {"GAE": GAE(model).attribute(images),
        ...                          "Rollout": Rollout(model).attribute(images)})
    """
    import matplotlib.pyplot as plt

    if display not in DISPLAYS:  # before any drawing
        raise ValueError(f"display must be one of {', '.join(map(repr, DISPLAYS))}, "
                         f"got {display!r}")
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
            plot_overlay(ax, images[i], m[i], title=name, display=display)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
        plt.close(fig)
    return fig


__all__ = ["COLORBAR_LABEL", "DISPLAYS", "figure_formats", "patch_grid", "plot_grid",
           "plot_overlay", "prediction_title", "upsample_map"]

