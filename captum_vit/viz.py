"""Plots of attribution maps: overlays on the image, grids of several methods, and videos
(an animation or a contact sheet of frames × maps)."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from captum_vit.adapters import grid_to_pixels
from captum_vit.adapters.vlm_tiles import stitch

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
            raise ValueError(f"grid {(gh, gw)} does not fit a token map of {a.numel()} "
                             f"patch{'es' if a.numel() != 1 else ''}")
        a = a.reshape(gh, gw)
    elif grid is not None and tuple(a.shape) != tuple(grid):
        raise ValueError(f"grid {tuple(grid)} does not fit a map of shape {tuple(a.shape)}")
    if a.dim() != 2:
        raise ValueError(f"cannot display a map of shape {tuple(attr.shape)}; give [P], "
                         "[gh, gw], [1, gh, gw] or [C, H, W]")
    if tuple(a.shape) == size:
        return a
    return grid_to_pixels(a, size, mode=display)


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


def plot_heads(image: Tensor, maps: Tensor, *, title: str | None = None,
               path: str | None = None, max_cols: int = 6, display: str = "nearest"):
    """One image and its per-head maps (``attribute(..., heads="all")``), one panel a head.

    Each head's panel is normalised on its own (:func:`plot_overlay`), as in DINO's
    per-head attention figures.

    Args:
        image (Tensor): the image [C, H, W].
        maps (Tensor): the image's per-head maps, heads first: ``[heads, P]`` (tokens),
            ``[heads, gh, gw]`` (grid) or ``[heads, H, W]`` (pixels), i.e. one row of
            a ``heads="all"`` output.
        title (str, optional): the figure's title.
        path (str, optional): save the figure there (PNG).
        max_cols (int, optional): panels per row (the input included). Default 6.
        display (str, optional): ``"nearest"`` (default) or ``"bilinear"``, see
            :func:`upsample_map`.

    Returns:
        matplotlib.figure.Figure: also when saved (then closed).

    Raises:
        ValueError: ``maps`` of a whole batch (4 dimensions) or of one map only.

    Examples::

        >>> from captum_vit import RawAttention
        >>> from captum_vit.viz import plot_heads
        >>> heads = RawAttention(model).attribute(images, heads="all", output="grid")
        >>> fig = plot_heads(images[0], heads[0])   # one panel per head
    """
    import matplotlib.pyplot as plt

    if maps.dim() not in (2, 3):
        hint = " of a whole batch: pass one image's, maps[b]" if maps.dim() == 4 else ""
        raise ValueError(f"maps must be one image's per-head maps [heads, P], [heads, gh, gw] "
                         f"or [heads, H, W]; got shape {tuple(maps.shape)}{hint}")
    if display not in DISPLAYS:
        raise ValueError(f"display must be one of {', '.join(map(repr, DISPLAYS))}, "
                         f"got {display!r}")
    n = maps.shape[0]
    cols = max(1, min(max_cols, n + 1))
    rows = -(-(n + 1) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.8 * cols, 2.6 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    cells = list(axes.flat)
    img = _image_to_numpy(image)
    cells[0].imshow(img, cmap="gray" if img.ndim == 2 else None)
    cells[0].set_title("input", fontsize=9)
    for h in range(n):
        plot_overlay(cells[h + 1], image, maps[h], title=f"head {h}", display=display)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
        plt.close(fig)
    return fig


NEAR_ZERO_RTOL = 1e-6
"""Relative size below which :func:`near_zero` calls a map numerically zero."""

NEAR_ZERO_NOTE = "≈ 0 on this input (measured)"
"""What :func:`plot_grid` writes on the panel of a numerically zero map, above what was
measured: the map's largest absolute value and the scale it was compared with (the largest
score or map of the image). It says what this call gave, not what the method does: the
same method gives a real map on another model or input (a map is numerically zero where
the score's gradient is, e.g. a random head initialised to zero or a model whose output is
itself ~0, or where the method's reduction of it cancels, e.g. the plain gradient summed
over channels behind a LayerNorm)."""

REFUSED_NOTE = "refused"
"""What :func:`plot_grid` writes on the panel of a method that refused the model or the
target, above the refusal's message."""


def near_zero(maps: Mapping[str, Tensor], *, reference: float | Sequence[float] | Tensor | None
              = None, rtol: float = NEAR_ZERO_RTOL) -> dict[str, Tensor]:
    r"""Which maps are numerically zero, per image: round-off drawn at full contrast would
    show noise as signal.

    The rule: the map :math:`m_i` of image :math:`i` is near zero when

    .. math::
        \max_p |m_i(p)| \le \text{rtol} \cdot s_i, \qquad
        s_i = \max\big(r_i,\ \max_{m'} \max_p |m'_i(p)|\big),

    with :math:`r_i` the ``reference`` scale of image :math:`i` (``captum-vit explain``
    passes the largest absolute logit, the size of the explained scores) and the inner
    maximum over every map given for that image. The float32 round-off of a quantity of
    size :math:`s` is about :math:`10^{-7} s`, so with the default ``rtol = 1e-6`` a map
    whose every value is within ten round-offs of zero is flagged: e.g. the plain gradient
    summed over the channels of a class-token ViT (the gradient of a LayerNorm's input sums
    to zero) or HiResCAM at the last block, around 1e-8 next to logits of order 1, while the
    smallest real maps of the bundled model (TokenTM's probability-score products) sit
    more than 100 times above the threshold. A heuristic: a map that is genuinely tiny
    relative to the logits (scores of another unit) may also be flagged; pass
    ``rtol=0`` to flag only exact zeros.

    Args:
        maps (Mapping[str, Tensor]): name -> maps of a batch ``[B, ...]`` (any map
            shape).
        reference (float, sequence or Tensor, optional): a scale per image ``[B]`` or one
            for all; ``None`` (default): the maps' own largest value only.
        rtol (float, optional): the relative threshold. Default :data:`NEAR_ZERO_RTOL`.

    Returns:
        dict[str, Tensor]: name -> bool ``[B]``, True where the map is near zero.

    Examples::

        >>> from captum_vit.viz import near_zero
        >>> maps = {"gae": torch.rand(1, 16), "grad": 1e-9 * torch.randn(1, 16)}
        >>> {k: v.tolist() for k, v in near_zero(maps, reference=3.0).items()}
        {'gae': [False], 'grad': [True]}
    """
    if not maps:
        return {}
    peaks, scale = _peaks_and_scale(maps, reference)
    return {k: p <= rtol * scale for k, p in peaks.items()}


def _peaks_and_scale(maps: Mapping[str, Tensor],
                     reference: float | Sequence[float] | Tensor | None
                     ) -> tuple[dict[str, Tensor], Tensor]:
    """Each map's largest absolute value per image, and :func:`near_zero`'s scale
    :math:`s_i` per image."""
    peaks = {k: v.detach().abs().float().cpu().reshape(v.shape[0], -1).amax(1)
             for k, v in maps.items()}
    scale = torch.stack(list(peaks.values())).amax(0)
    if reference is not None:
        ref = torch.as_tensor(reference, dtype=torch.float32).abs().reshape(-1)
        scale = torch.maximum(scale, ref.expand_as(scale) if ref.numel() == 1 else ref)
    return peaks, scale


def _plot_note(ax, image: Tensor, text: str, title: str | None) -> None:
    """A panel without a map: the image, faded, with ``text`` in a box."""
    img = _image_to_numpy(image)
    ax.imshow(img, cmap="gray" if img.ndim == 2 else None, alpha=0.35)
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", fontsize=7,
            bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "0.6"})
    if title:
        ax.set_title(title, fontsize=9)
    ax.axis("off")


def _plot_flat(ax, image: Tensor, attr: Tensor, title: str | None,
               scale: float | None = None) -> None:
    """A near-zero map's panel: the image, faded, with :data:`NEAR_ZERO_NOTE` and what was
    measured (the map's largest absolute value, the scale it was compared with), without a
    colour scale."""
    peak = float(attr.detach().abs().max())
    against = (f"\nnext to {scale:.1e}, the largest\nscore or map of this input"
               if scale else "")
    _plot_note(ax, image, f"{NEAR_ZERO_NOTE}\nmax |map| = {peak:.1e}{against};\ndrawn flat",
               title)


def _plot_refused(ax, image: Tensor, message: str, title: str | None) -> None:
    """A refusing method's panel: the image, faded, with :data:`REFUSED_NOTE` and the
    refusal's message, wrapped to the panel (at most eight lines)."""
    lines = textwrap.wrap(" ".join(str(message).split()), 34) or [""]
    if len(lines) > 8:
        lines = lines[:7] + [lines[7][:30] + " …"]
    _plot_note(ax, image, REFUSED_NOTE + ":\n" + "\n".join(lines), title)


def _grouped(names: Sequence[str], groups: Mapping[str, str] | None) -> list[tuple[str, list[str]]]:
    """``(label, names)`` per group, groups in order of first appearance (one unnamed
    group without ``groups``; a name missing from ``groups`` is its own label)."""
    if groups is None:
        return [("", list(names))]
    out: dict[str, list[str]] = {}
    for n in names:
        out.setdefault(groups.get(n, n), []).append(n)
    return list(out.items())


def plot_grid(images: Tensor, maps: Mapping[str, Tensor], *,
              row_titles: Sequence[str] | None = None, path: str | None = None,
              max_cols: int = 5, display: str = "nearest",
              groups: Mapping[str, str] | None = None,
              reference: float | Sequence[float] | Tensor | None = None,
              near_zero_rtol: float = NEAR_ZERO_RTOL, note: str | None = None,
              refused: Mapping[str, str] | None = None):
    """The input and every method's map: one row per image, or, for a single image, the
    panels wrapped into rows of ``max_cols``.

    A map that is numerically zero for an image (:func:`near_zero`) is not stretched to
    full contrast: its panel shows the image faded, marked :data:`NEAR_ZERO_NOTE` with the
    values measured. A method that refused (``refused``) gets a panel too, with its
    message, so that one refusal does not cost the other methods' figure.

    Args:
        images (Tensor): [B, C, H, W].
        maps (Mapping[str, Tensor]): method name -> maps for the batch (any map shape).
        row_titles (Sequence[str], optional): a title for each input image.
        path (str, optional): save the figure there (PNG).
        max_cols (int, optional): panels per row for a single image. Default 5.
        display (str, optional): ``"nearest"`` (default) or ``"bilinear"``, see
            :func:`upsample_map`.
        groups (Mapping[str, str], optional): method name -> group label (e.g. its family).
            The panels are then ordered by group (groups in order of first appearance)
            and labelled: for a single image the input has a row of its own, every group
            starts a new row and its label is written beside its rows; for several
            images the group's label is written above its first column.
        reference (float, sequence or Tensor, optional): the scale of each image's scores
            (e.g. its largest absolute logit) for :func:`near_zero`.
        near_zero_rtol (float, optional): ``rtol`` of :func:`near_zero`; ``-1`` turns the
            check off. Default :data:`NEAR_ZERO_RTOL`.
        note (str, optional): a footnote under the panels (e.g. the settings used).
        refused (Mapping[str, str], optional): method name -> the message of its refusal,
            for methods without a map (not in ``maps``): each gets a panel marked
            :data:`REFUSED_NOTE` with the message, placed with its group (after the
            group's maps).

    Returns:
        matplotlib.figure.Figure: also when saved (then closed).

    Examples::

        >>> from captum_vit import GAE, Rollout
        >>> from captum_vit.viz import plot_grid
        >>> fig = plot_grid(images, {"GAE": GAE(model).attribute(images),
        ...                          "Rollout": Rollout(model).attribute(images)},
        ...                 groups={"GAE": "gradient × attention", "Rollout": "attention"})
    """
    import matplotlib.pyplot as plt

    if display not in DISPLAYS:  # before any drawing
        raise ValueError(f"display must be one of {', '.join(map(repr, DISPLAYS))}, "
                         f"got {display!r}")
    refused = dict(refused or {})
    both = sorted(set(maps) & set(refused))
    if both:
        raise ValueError(f"refused names methods that have a map in maps: {both}; pass each "
                         "method in one of the two")
    b = images.shape[0]
    grouped = _grouped([*maps, *refused], groups)
    order = [n for _, names in grouped for n in names]
    flat = near_zero(maps, reference=reference, rtol=near_zero_rtol)
    scale = _peaks_and_scale(maps, reference)[1] if maps else None
    if b == 1:
        widest = max((len(names) for _, names in grouped), default=0)
        cols = max(1, min(max_cols, len(order) + 1 if groups is None else widest))
        if groups is None:
            slots = list(range(1, len(order) + 1))
            rows = -(-(len(order) + 1) // cols)
        else:  # the input on row 0, every group from a new row
            slots, row = [], 1
            for _, names in grouped:
                slots += [row * cols + k for k in range(len(names))]
                row += -(-len(names) // cols)
            rows = row
    else:
        cols, rows = len(order) + 1, b
    width, height = 2.8 * cols, 2.6 * rows
    fig, axes = plt.subplots(rows, cols, figsize=(width, height), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for i in range(b):
        cells = list(axes.flat) if b == 1 else list(axes[i])
        where = slots if b == 1 else list(range(1, len(order) + 1))
        img = _image_to_numpy(images[i])
        cells[0].imshow(img, cmap="gray" if img.ndim == 2 else None)
        cells[0].set_title(row_titles[i] if row_titles else "input", fontsize=9)
        for slot, name in zip(where, order, strict=True):
            if name in refused:
                _plot_refused(cells[slot], images[i], refused[name], name)
            elif bool(flat[name][i]):
                _plot_flat(cells[slot], images[i], maps[name][i], name,
                           None if scale is None else float(scale[i]))
            else:
                plot_overlay(cells[slot], images[i], maps[name][i], title=name, display=display)
    labelled = groups is not None
    if note:  # wrapped to the figure's width (8 pt: about 15 characters per inch)
        note = "\n".join(textwrap.fill(line, max(int(width * 15), 20))
                         for line in note.splitlines())
    lines = note.count("\n") + 1 if note else 0
    rect = (0.35 / width if labelled and b == 1 else 0,
            (0.2 * lines + 0.05) / height if note else 0,
            1, 1 - 0.3 / height if labelled and b > 1 else 1)
    fig.tight_layout(rect=rect)
    if labelled:
        _label_groups(fig, axes, grouped, slots if b == 1 else None, cols)
    if note:
        fig.text(0.01, 0.01, note, ha="left", va="bottom", fontsize=8, color="0.25")
    if path is not None:
        fig.savefig(path, dpi=100)
        plt.close(fig)
    return fig


VIDEO_FORMATS = ("gif", "mp4")
"""File suffixes :func:`plot_video` writes as animations (GIF with Pillow, MP4 with
ffmpeg); any other format matplotlib saves (``png``, ``pdf``, ``svg`` ...,
:func:`figure_formats`) gets the contact sheet of :func:`video_sheet`."""


def _video_batch(video: Tensor) -> Tensor:
    """``video`` as a batch ``[B, T, C, H, W]`` (one video [T, C, H, W] gets B = 1)."""
    if not isinstance(video, Tensor):
        raise TypeError(f"video must be a torch.Tensor, got {type(video).__name__}")
    v = video.detach()
    if v.dim() == 4:
        v = v[None]
    if v.dim() != 5 or min(v.shape) == 0:
        raise ValueError(f"video must be one video [T, C, H, W] or a batch [B, T, C, H, W], "
                         f"got shape {tuple(video.shape)}")
    return v


def _frame_maps(maps: Tensor, frames: int, size: tuple[int, int] | None = None) -> Tensor:
    """One video's map as ``[S, ...]``, one map per slice of the video's ``frames``
    (``1 <= S <= frames``): pixel maps ``[T, C, H, W]`` (averaged over the channels) or
    ``[T, H, W]``, a tubelet grid ``[1, F, gh, gw]`` or ``[F, gh, gw]``, one map for the
    whole video ``[gh, gw]``; a leading batch of one ``[1, ...]`` of 5 dimensions is
    dropped."""
    m = maps.detach().float().cpu()
    if m.dim() == 5 and m.shape[0] == 1:  # a batch of one: [1, T, C, H, W] / [1, 1, F, ...]
        m = m[0]
    if m.dim() == 4:
        if m.shape[0] == frames and (size is None or tuple(m.shape[-2:]) == tuple(size)):
            m = m.mean(1)  # pixel maps [T, C, H, W]
        elif m.shape[0] == 1:  # grid [1, F, gh, gw]
            m = m[0]
    elif m.dim() == 2:  # one map for all frames
        m = m[None]
    if m.dim() != 3 or not 1 <= m.shape[0] <= frames:
        raise ValueError(f"maps of shape {tuple(maps.shape)} do not give one map per frame "
                         f"or per tubelet of a {frames}-frame video: pass frame maps [T, C, "
                         "H, W] / [T, H, W] (attribute(videos)[i]) or a tubelet grid [1, F, "
                         "gh, gw] (attribute(videos, output='grid')[i])")
    return m


def frame_slices(frames: int, slices: int) -> list[int | None]:
    r"""Which slice of a map covers each frame of a video: slice ``f`` of ``S`` spans the
    ``T // S`` frames ``f·(T // S) … (f+1)·(T // S) - 1`` (a tubelet's frames); the
    ``T mod S`` trailing frames, which a tubelet embedding of stride ``T // S`` drops, are
    covered by none (``None``).

    Args:
        frames (int): ``T``, the video's frames.
        slices (int): ``S``, the map's slices (tubelets along time), ``1 <= S <= T``.

    Returns:
        list[int | None]: the slice of each frame.

    Raises:
        ValueError: ``S`` outside ``[1, T]``.

    Examples::

        >>> from captum_vit.viz import frame_slices
        >>> frame_slices(8, 4)      # tubelets of 2 frames
        [0, 0, 1, 1, 2, 2, 3, 3]
        >>> frame_slices(5, 2)      # the fifth frame is in no tubelet
        [0, 0, 1, 1, None]
    """
    if not 1 <= slices <= frames:
        raise ValueError(f"a map of {slices} slices cannot cover a {frames}-frame video: "
                         f"it needs between 1 and {frames} slices")
    per = frames // slices
    return [k // per if k // per < slices else None for k in range(frames)]


class _VideoPanel:
    """One (video, method) pair ready to draw: frames ``[T, H, W(, C)]`` scaled for
    display over the whole video, heat maps ``[T, H, W]`` at the frame size (zeros where no
    slice covers a frame), the slice of each frame and the colour scale shared by the
    frames."""

    def __init__(self, video: Tensor, m: Tensor | None, display: str, cmap: Any) -> None:
        v = video.float().cpu()
        v = (v - v.min()) / (v.max() - v.min()).clamp(min=1e-12)  # one scale for all frames
        self.frames = [v[k, 0].numpy() if v.shape[1] == 1 else v[k].permute(1, 2, 0).numpy()
                       for k in range(v.shape[0])]
        self.gray = "gray" if v.shape[1] == 1 else None
        t, size = v.shape[0], (int(v.shape[-2]), int(v.shape[-1]))
        self.cover: list[int | None] = [None] * t
        self.slices = t
        self.heats = np.zeros((t, *size), dtype=np.float32)
        self.lo, self.hi, self.cmap = 0.0, 1.0, cmap or "jet"
        self.peak = 0.0  # the map's largest absolute value (near_zero's peak)
        if m is None:
            return
        self.peak = float(m.abs().max())
        self.cover, self.slices = frame_slices(t, m.shape[0]), int(m.shape[0])
        per_slice = [upsample_map(m[s], size, display=display).numpy() for s in range(m.shape[0])]
        for k, s in enumerate(self.cover):
            if s is not None:
                self.heats[k] = per_slice[s]
        seen = np.stack(per_slice)
        if (seen < 0).any():
            lim = float(np.abs(seen).max()) or 1.0
            self.lo, self.hi, self.cmap = -lim, lim, cmap or "bwr"
        else:
            self.lo, self.hi = float(seen.min()), float(seen.max())
            self.hi = self.hi if self.hi > self.lo else self.lo + 1.0


def _video_panels(video: Tensor, maps: Tensor | Mapping[str, Tensor], display: str,
                  cmap: Any) -> tuple[Tensor, list[str], list[list[_VideoPanel]]]:
    """The batch of videos, the maps' names (``""`` for a single tensor) and a
    :class:`_VideoPanel` per video and map."""
    if display not in DISPLAYS:
        raise ValueError(f"display must be one of {', '.join(map(repr, DISPLAYS))}, "
                         f"got {display!r}")
    v = _video_batch(video)
    b, t = v.shape[:2]
    size = (int(v.shape[-2]), int(v.shape[-1]))
    named = {"": maps} if isinstance(maps, Tensor) else dict(maps)
    if not named:
        raise ValueError("maps is empty: give a map tensor or a mapping name -> maps")
    per_video: dict[str, list[Tensor]] = {}
    for name, m in named.items():
        if not isinstance(m, Tensor):
            raise TypeError(f"maps{'[' + repr(name) + ']' if name else ''} must be a "
                            f"torch.Tensor, got {type(m).__name__}")
        if b == 1:
            per_video[name] = [_frame_maps(m, t, size)]
        elif m.shape[0] != b:
            raise ValueError(f"maps{'[' + repr(name) + ']' if name else ''} of shape "
                             f"{tuple(m.shape)} are not a batch of {b} videos' maps: give "
                             f"[{b}, ...] for the batch of shape {tuple(v.shape)}")
        else:
            per_video[name] = [_frame_maps(m[i], t, size) for i in range(b)]
    names = list(named)
    panels = [[_VideoPanel(v[i], None, display, cmap)]
              + [_VideoPanel(v[i], per_video[n][i], display, cmap) for n in names]
              for i in range(b)]
    return v, names, panels


def _hide_axes(ax) -> None:
    """No ticks, no frame (a label set with ``set_ylabel`` still shows)."""
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_visible(False)


def video_sheet(video: Tensor, maps: Tensor | Mapping[str, Tensor], *,
                title: str | None = None, alpha: float = 0.5, display: str = "nearest",
                cmap: Any = None, row_titles: Sequence[str] | None = None,
                note: str | None = None, panel_size: float = 1.6,
                reference: float | Sequence[float] | Tensor | None = None,
                near_zero_rtol: float = NEAR_ZERO_RTOL):
    """A contact sheet of videos and their maps: one column per frame; per video a row of
    its frames, then a row per map with the map over each frame.

    A map is given per tubelet (slice ``f`` of ``F`` spans the frames of
    :func:`frame_slices`: the column titles name each frame's slice when ``F`` differs
    from the frame count) or per frame. Each row's colour scale is shared by its frames
    (a map's values are comparable across frames): ``[-m, m]`` with a diverging colour map
    when the map has negative values, else ``[min, max]``; frames covered by no slice show
    the frame alone, marked "no tubelet". A map that is numerically zero for a video (the
    rule of :func:`near_zero`, per video) is not stretched to full contrast: its row shows
    the frames faded, marked "≈ 0", and its label gives the largest absolute value.

    Args:
        video (Tensor): one video [T, C, H, W] or a batch [B, T, C, H, W].
        maps (Tensor or Mapping[str, Tensor]): the map of each video, or a mapping method
            name -> maps (one row each): pixel maps shaped like the video (``attribute(
            videos)``), the tubelet grid [B, 1, F, gh, gw] (``output="grid"``), or one
            video's [T, C, H, W] / [T, H, W] / [1, F, gh, gw] / [F, gh, gw] for a single
            video.
        title (str, optional): the figure's title.
        alpha (float, optional): opacity of the map. Default 0.5.
        display (str, optional): ``"nearest"`` (default) or ``"bilinear"``
            (:func:`upsample_map`).
        cmap (str or Colormap, optional): colour map; ``None``: ``"bwr"`` for signed
            maps, ``"jet"`` otherwise.
        row_titles (Sequence[str], optional): a label for each video (its frames' row).
        note (str, optional): a footnote under the panels.
        panel_size (float, optional): inches per panel. Default 1.6.
        reference (float, sequence or Tensor, optional): the scale of each video's scores
            (e.g. its largest absolute logit) for :func:`near_zero`.
        near_zero_rtol (float, optional): ``rtol`` of :func:`near_zero`; ``-1`` turns the
            check off. Default :data:`NEAR_ZERO_RTOL`.

    Returns:
        matplotlib.figure.Figure: the sheet.

    Raises:
        ValueError: a video or map of another shape, a batch of maps of another size, or
            an unknown ``display``.

    Examples::

        >>> import transformers
        >>> from captum_vit import GAE
        >>> from captum_vit.viz import video_sheet
        >>> cfg = transformers.VideoMAEConfig(image_size=16, patch_size=8, num_frames=4,
        ...     tubelet_size=2, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        ...     intermediate_size=64, num_labels=5)
        >>> videomae = transformers.VideoMAEForVideoClassification(cfg).eval()
        >>> videos = torch.rand(2, 4, 3, 16, 16)                    # [B, T, C, H, W]
        >>> grid = GAE(videomae).attribute(videos, target=0, output="grid")
        >>> grid.shape                                              # 2 tubelets of 2 frames
        torch.Size([2, 1, 2, 2, 2])
        >>> fig = video_sheet(videos, {"GAE": grid})
        >>> len(fig.axes)           # 2 videos x 2 rows x 4 frames, a colour bar per map row
        18
    """
    import matplotlib.pyplot as plt

    check = _positive(panel_size, "panel_size")
    v, names, panels = _video_panels(video, maps, display, cmap)
    if row_titles is not None and len(row_titles) != v.shape[0]:
        raise ValueError(f"row_titles has {len(row_titles)} titles for {v.shape[0]} videos")
    b, t = v.shape[:2]
    refs = (torch.zeros(b) if reference is None else
            torch.as_tensor(reference, dtype=torch.float32).abs().reshape(-1).expand(b))
    per = 1 + len(names)
    width = check * t + 1.4
    fig, axes = plt.subplots(b * per, t, figsize=(width, check * b * per + 0.6),
                             squeeze=False, layout="constrained")
    for i in range(b):
        scale = max([float(refs[i])] + [p.peak for p in panels[i][1:]])
        for r, panel in enumerate(panels[i]):
            row = axes[i * per + r]
            shown = None
            flat = r > 0 and panel.peak <= near_zero_rtol * scale
            for k in range(t):
                ax = row[k]
                _hide_axes(ax)
                covered = r > 0 and panel.cover[k] is not None and not flat
                ax.imshow(panel.frames[k], cmap=panel.gray,
                          alpha=1.0 if r == 0 or covered else 0.4)
                if covered:
                    shown = ax.imshow(panel.heats[k], cmap=panel.cmap, vmin=panel.lo,
                                      vmax=panel.hi, alpha=alpha)
                elif r > 0:
                    ax.text(0.5, 0.5, "≈ 0" if flat else "no tubelet", transform=ax.transAxes,
                            ha="center", va="center", fontsize=7)
                if r == 0:  # the first map's tubelets, when they are not the frames
                    first = panels[i][1]
                    s = first.cover[k]
                    ax.set_title(f"frame {k + 1}" + (
                        f"\ntubelet {s + 1}" if first.slices != t and s is not None
                        else ""), fontsize=8)
            label = ((row_titles[i] if row_titles else f"video {i + 1}" if b > 1 else "video")
                     if r == 0 else names[r - 1] or "map")
            if flat:
                label += f"\n≈ 0 (max {panel.peak:.0e})"
            row[0].set_ylabel(label, fontsize=9)
            if shown is not None:
                bar = fig.colorbar(shown, ax=list(row), fraction=0.02, pad=0.01)
                bar.ax.tick_params(labelsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    if note:  # wrapped to the figure's width (8 pt: about 15 characters per inch)
        fig.supxlabel("\n".join(textwrap.fill(line, max(int(width * 15), 20))
                                for line in note.splitlines()), fontsize=8, color="0.25")
    return fig


def plot_video(video: Tensor, maps: Tensor | Mapping[str, Tensor], *, path: str | None = None,
               fps: float = 4, title: str | None = None, alpha: float = 0.5,
               display: str = "nearest", cmap: Any = None,
               row_titles: Sequence[str] | None = None, note: str | None = None,
               reference: float | Sequence[float] | Tensor | None = None):
    """Videos and their maps, frame by frame: an animation written as an animated GIF or
    an MP4, or a static contact sheet (:func:`video_sheet`) when ``path`` names a figure
    format (``.png``, ``.pdf``, ``.svg`` ...).

    The animation shows, per video (one row each), the frame and the frame with each map
    over it. Maps per tubelet (``output="grid"``: ``[B, 1, F, gh, gw]``) are shown on the
    frames of their tubelet (:func:`frame_slices`); the colour scale of each map is shared
    by all frames: ``[-m, m]`` with a diverging colour map when the map has negative
    values, else ``[min, max]``.

    Args:
        video (Tensor): one video [T, C, H, W] or a batch [B, T, C, H, W].
        maps (Tensor or Mapping[str, Tensor]): the maps, or a mapping method name -> maps
            (one panel each): pixel maps shaped like the video (as ``attribute(videos)``
            returns them), the tubelet grid [B, 1, F, gh, gw] (``attribute(videos,
            output="grid")``); for one video also its own [T, C, H, W], [T, H, W], [1, F,
            gh, gw] or [F, gh, gw].
        path (str, optional): write there: ``.gif`` (Pillow) or ``.mp4`` (ffmpeg, which
            must be installed) for the animation, another format of
            :func:`figure_formats` for the contact sheet; ``None`` (default): only return
            the animation.
        fps (float, optional): frames per second of the animation. Default 4.
        title (str, optional): figure title.
        alpha (float, optional): opacity of the map. Default 0.5.
        display (str, optional): ``"nearest"`` (default) or ``"bilinear"``
            (:func:`upsample_map`).
        cmap (str or Colormap, optional): colour map; ``None``: ``"bwr"`` for signed
            maps, ``"jet"`` otherwise.
        row_titles (Sequence[str], optional): a label for each video.
        note (str, optional): a footnote (the contact sheet's).
        reference (float, sequence or Tensor, optional): the contact sheet's scale of
            each video's scores, for its numerically zero maps (:func:`video_sheet`).

    Returns:
        matplotlib.animation.FuncAnimation or matplotlib.figure.Figure: the animation, or
        the contact sheet for a figure format (its figure is closed once the file is
        written).

    Raises:
        ValueError: a video or map of another shape, or a suffix that is neither an
            animation (:data:`VIDEO_FORMATS`) nor a figure format.
        RuntimeError: ``.mp4`` without ffmpeg (the message says to write a ``.gif``).

    Examples::

        >>> import transformers
        >>> from captum_vit import GAE
        >>> from captum_vit.viz import plot_video
        >>> cfg = transformers.VideoMAEConfig(image_size=16, patch_size=8, num_frames=4,
        ...     tubelet_size=2, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        ...     intermediate_size=64, num_labels=5)
        >>> videomae = transformers.VideoMAEForVideoClassification(cfg).eval()
        >>> videos = torch.rand(2, 4, 3, 16, 16)                    # [B, T, C, H, W]
        >>> maps = GAE(videomae).attribute(videos, target=[1, 3])   # pixels, like the video
        >>> anim = plot_video(videos[0], maps[0], path="gae.gif", fps=4)
        >>> grid = GAE(videomae).attribute(videos, target=[1, 3], output="grid")
        >>> fig = plot_video(videos, {"GAE": grid}, path="gae.png")  # frames x (video, map)
    """
    import matplotlib.pyplot as plt
    from matplotlib import animation

    check = _positive(fps, "fps")
    suffix = None if path is None else str(path).rsplit(".", 1)[-1].lower()
    if suffix is not None and suffix not in VIDEO_FORMATS and suffix not in figure_formats():
        raise ValueError(f"path must end in {' or '.join('.' + f for f in VIDEO_FORMATS)} "
                         f"(an animation) or a figure format such as .png (a contact sheet), "
                         f"got {path!r}")
    if suffix == "mp4" and not animation.writers.is_available("ffmpeg"):
        raise RuntimeError("writing an .mp4 needs ffmpeg, which matplotlib cannot find: "
                           "install it (e.g. apt-get install ffmpeg) or write a .gif")
    if suffix is not None and suffix not in VIDEO_FORMATS:
        fig = video_sheet(video, maps, title=title, alpha=alpha, display=display, cmap=cmap,
                          row_titles=row_titles, note=note, reference=reference)
        fig.savefig(str(path), dpi=100)
        plt.close(fig)
        return fig
    v, names, panels = _video_panels(video, maps, display, cmap)
    if row_titles is not None and len(row_titles) != v.shape[0]:
        raise ValueError(f"row_titles has {len(row_titles)} titles for {v.shape[0]} videos")
    b, t = v.shape[:2]
    cols = 1 + len(names)
    fig, axes = plt.subplots(b, cols, figsize=(3 * cols, 3.1 * b + 0.3), squeeze=False)
    artists: list[tuple[Any, Any, _VideoPanel]] = []  # (frame image, map image, panel)
    for i in range(b):
        for c, panel in enumerate(panels[i]):
            ax = axes[i, c]
            ax.axis("off")
            under = ax.imshow(panel.frames[0], cmap=panel.gray)
            over = None
            if c > 0:
                over = ax.imshow(panel.heats[0], cmap=panel.cmap, vmin=panel.lo,
                                 vmax=panel.hi, alpha=alpha if panel.cover[0] is not None else 0)
                fig.colorbar(over, ax=ax, fraction=0.046, pad=0.04)
            head = (row_titles[i] if row_titles else f"video {i + 1}" if b > 1 else "frame")
            ax.set_title(head if c == 0 else names[c - 1] or "map", fontsize=9)
            artists.append((under, over, panel))
    lead = f"{title} — " if title else ""
    label = fig.suptitle(f"{lead}frame 1/{t}", fontsize=10)
    fig.tight_layout()

    def draw(k: int):
        changed = [label]
        for under, over, panel in artists:
            under.set_data(panel.frames[k])
            changed.append(under)
            if over is not None:
                over.set_data(panel.heats[k])
                over.set_alpha(alpha if panel.cover[k] is not None else 0)
                changed.append(over)
        label.set_text(f"{lead}frame {k + 1}/{t}")
        return changed

    anim = animation.FuncAnimation(fig, draw, frames=t, interval=1000 / check, blit=False)
    if path is not None:
        # matplotlib annotates fps as int; its writers take any positive frame rate
        writer = (animation.PillowWriter(fps=check) if suffix == "gif"  # type: ignore[arg-type]
                  else animation.FFMpegWriter(fps=check))  # type: ignore[arg-type]
        anim.save(str(path), writer=writer)
        plt.close(fig)
    return anim


def _positive(x: Any, name: str) -> float:
    """``x`` as a positive float, else ``ValueError`` / ``TypeError`` naming ``name``."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise TypeError(f"{name} must be a number, got {type(x).__name__}")
    if not x > 0:
        raise ValueError(f"{name} must be > 0, got {x!r}")
    return float(x)


def _label_groups(fig, axes, grouped: Sequence[tuple[str, list[str]]],
                  slots: Sequence[int] | None, cols: int) -> None:
    """Write each group's label beside its rows (``slots``: one image) or above its first
    column (several images)."""
    start = 0
    for label, names in grouped:
        if slots is None:
            box = axes[0, start + 1].get_position()
            fig.text(box.x0, min(box.y1 + 0.25 / fig.get_figheight(), 0.995), label,
                     ha="left", va="bottom", fontsize=10, fontweight="bold")
        else:
            first, last = slots[start] // cols, slots[start + len(names) - 1] // cols
            top, bottom = axes[first, 0].get_position(), axes[last, 0].get_position()
            fig.text(0.005, (top.y1 + bottom.y0) / 2, label, rotation=90, ha="left",
                     va="center", fontsize=10, fontweight="bold")
        start += len(names)


__all__ = ["COLORBAR_LABEL", "DISPLAYS", "NEAR_ZERO_NOTE", "NEAR_ZERO_RTOL", "REFUSED_NOTE",
           "VIDEO_FORMATS", "figure_formats", "frame_slices", "near_zero", "patch_grid",
           "plot_grid", "plot_heads", "plot_overlay", "plot_video", "prediction_title",
           "stitch", "upsample_map", "video_sheet"]


def plot_text_relevance(tokens: Sequence[str], relevance: Tensor | Sequence[float], *,
                        ax: Any = None, title: str | None = None, cmap: Any = "bwr",
                        per_line: int = 12, skip_empty: bool = True) -> Any:
    r"""Tokens coloured by their relevance: red positive, blue negative, white zero, on a
    scale symmetric about 0 (``max |relevance|``); e.g. a prompt's tokens from
    :class:`~captum_vit.targets.TextEmbeddingTarget` (``clip_text_target(...,
    text_relevance=True)``).

    Args:
        tokens (sequence of str): the token strings, ``L``.
        relevance (Tensor or sequence of float): ``[L]``, one value per token.
        ax (matplotlib axis, optional): draw there; default a new figure's.
        title (str, optional): the axis title.
        cmap (str or Colormap, optional): a diverging colormap. Default ``"bwr"``.
        per_line (int, optional): tokens per line. Default 12.
        skip_empty (bool, optional): leave out empty tokens (OpenCLIP's padding after
            the end token). Default ``True``.

    Returns:
        the matplotlib axis; each token is one of ``ax.texts``, its box coloured.

    Raises:
        TypeError: ``tokens`` is a string or not strings.
        ValueError: ``relevance`` is not one value per token.

    Examples::

        >>> from captum_vit.viz import plot_text_relevance
        >>> ax = plot_text_relevance(target.text_tokens[0], target.text_relevance[0])
    """
    import matplotlib.pyplot as plt
    from matplotlib import colormaps

    if isinstance(tokens, str) or not isinstance(tokens, Sequence) or not all(
            isinstance(t, str) for t in tokens):
        raise TypeError("tokens must be a sequence of token strings (e.g. "
                        "target.text_tokens[b]), not one string")
    r = torch.as_tensor(relevance).detach().double().cpu().reshape(-1)
    if r.numel() != len(tokens):
        raise ValueError(f"relevance has {r.numel()} values for {len(tokens)} tokens: give "
                         "one value per token (e.g. target.text_relevance[b])")
    if ax is None:
        _, ax = plt.subplots(figsize=(min(12.0, 1.0 * per_line), 0.5 + 0.45 * math.ceil(
            max(len(tokens), 1) / per_line)))
    colours = colormaps[cmap] if isinstance(cmap, str) else cmap
    peak = float(r.abs().max()) if r.numel() else 0.0
    shown = [(t, float(v)) for t, v in zip(tokens, r.tolist(), strict=True)
             if t or not skip_empty]
    rows = max(1, math.ceil(len(shown) / per_line))
    for i, (tok, value) in enumerate(shown):
        level = 0.5 + 0.5 * value / peak if peak > 0 else 0.5
        ax.text((i % per_line + 0.5) / per_line, 1 - (i // per_line + 0.5) / rows, tok,
                ha="center", va="center", fontsize=9, transform=ax.transAxes,
                bbox={"boxstyle": "round,pad=0.2", "facecolor": colours(level),
                      "edgecolor": "none"})
    ax.set_axis_off()
    if title is not None:
        ax.set_title(title)
    return ax


__all__ += ["plot_text_relevance"]
