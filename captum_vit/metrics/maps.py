"""Any attribution as patch scores on the model's grid, and their ranking.

:func:`patch_maps` is the one way from what a user gives a metric (precomputed maps of
any shape, a captum_vit method, any Captum attribution, a callable) to patch scores
``[B, P]`` in raster order; :func:`ranking` orders them most important first. The removal
metrics (:mod:`captum_vit.metrics.removal`), the localisation and robustness metrics and
the evaluation loop all start here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias, cast

import torch
import torch.nn.functional as F
from captum.attr import Attribution
from torch import Tensor

from captum_vit._base import check_choice
from captum_vit._text import count_noun
from captum_vit.adapters import Layout

PIXEL_REDUCES = ("abs", "sum")
"""Poolings of a pixel map over each patch (``pixel_reduce=``)."""
AttributionLike: TypeAlias = Tensor | Attribution | Callable[..., Tensor]
"""What a metric takes as the attribution: maps, an attribution or a callable."""


def patch_maps(attribution: AttributionLike, inputs: Tensor, target: Tensor | None,
               layout: Layout, *,
               pixel_reduce: str = "abs", attribute_kwargs: dict | None = None) -> Tensor:
    """The attribution as patch scores [B, P] on the model's grid (raster order).

    Args:
        attribution: precomputed maps or an attribution:

            * a tensor of patch scores [B, P], a grid [B, gh, gw] / [B, 1, gh, gw], or a
              pixel map [B, H, W] / [B, C, H, W] at the image size (summed over the
              channels and the pixels of each patch, see ``pixel_reduce``);
            * a captum_vit method: called with ``output="tokens"`` (exact patch scores);
            * any Captum attribution (``IntegratedGradients(model)``, ``Saliency``,
              ``NoiseTunnel(...)``): ``attribute(inputs, target=target, **attribute_kwargs)``
              gives a pixel map, pooled as above;
            * a callable ``f(inputs, target) -> map`` (any of the shapes above).
        inputs (Tensor): images [B, C, H, W] (or videos [B, T, C, H, W]: maps [B, P],
            grids [B, 1, F, gh, gw] or frame maps shaped like the video, pooled per
            tubelet).
        target (Tensor or None): class per image [B] (``None``: as the attribution
            treats it, the predicted class for the methods of this package).
        layout (Layout): the model's token layout for ``inputs``.
        pixel_reduce (str): ``"abs"`` (default: sum of ``|a|`` over channels and patch
            pixels, the usual pooling of gradient maps) or ``"sum"`` (signed sum).
        attribute_kwargs (dict, optional): extra keyword arguments of ``attribute``.

    Returns:
        Tensor: [B, P] patch scores (detached).
    """
    from captum_vit._base import ViTFront

    check_choice("pixel_reduce", pixel_reduce, PIXEL_REDUCES)
    kw = dict(attribute_kwargs or {})
    if isinstance(attribution, Tensor):
        maps = attribution
    elif isinstance(attribution, ViTFront):
        front = cast(Attribution, attribution)  # ViTFront mixes into a Captum Attribution
        maps = front.attribute(inputs, target=target, output="tokens", **kw)
    elif isinstance(attribution, Attribution):
        maps = attribution.attribute(inputs, target=target, **kw)
    elif callable(attribution):
        maps = attribution(inputs, target)
    else:
        raise TypeError("attribution must be a tensor of maps, a Captum Attribution or a "
                        f"callable f(inputs, target); got {type(attribution).__name__}")
    if isinstance(maps, tuple) and len(maps) == 1:
        maps = maps[0]
    return _to_patches(maps.detach(), inputs, layout, pixel_reduce)


def _to_patches(maps: Tensor, inputs: Tensor, layout: Layout, pixel_reduce: str) -> Tensor:
    b = inputs.shape[0]
    (gh, gw), p = layout.grid, layout.num_patches
    h, w = inputs.shape[-2:]
    shape = tuple(maps.shape)
    if shape[:1] != (b,):
        raise ValueError(f"attribution maps have shape {shape} but the batch has "
                         f"{count_noun(b, 'image' if layout.frames is None else 'video')}")
    if maps.dim() == 2 and shape[1] == p:
        return maps
    if layout.frames is not None:
        return _video_to_patches(maps, inputs, layout, pixel_reduce)
    if maps.dim() == 2 and shape[1] == layout.num_tokens:
        raise ValueError(f"attribution maps have {shape[1]} columns = all tokens; drop the "
                         f"{layout.num_prefix} prefix columns (keep the {p} patch scores)")
    if maps.dim() == 4 and shape[1] == 1 and shape[2:] == (gh, gw):
        return maps.reshape(b, p)
    if maps.dim() == 3 and shape[1:] == (gh, gw):
        return maps.reshape(b, p)
    if maps.dim() in (3, 4) and shape[-2:] == (h, w):
        pix = maps.abs() if pixel_reduce == "abs" else maps
        pix = pix.sum(1) if pix.dim() == 4 else pix  # channels
        ph, pw = layout.patch_size
        pix = F.pad(pix, (0, gw * pw - w, 0, gh * ph - h))
        return pix.reshape(b, gh, ph, gw, pw).sum((2, 4)).reshape(b, p)
    raise ValueError(
        f"attribution maps of shape {shape} match neither the patch grid ({p} patches, grid "
        f"{(gh, gw)}) nor the image size {(h, w)}; give [B, P], [B, 1, gh, gw] or pixel maps")


def _video_to_patches(maps: Tensor, inputs: Tensor, layout: Layout, pixel_reduce: str
                      ) -> Tensor:
    """Tubelet scores [B, P] of video maps: [B, P], a grid [B, 1, F, gh, gw] / [B, F, gh,
    gw], or frame maps [B, T, H, W] / [B, T, C, H, W] pooled over each tubelet's frames,
    channels and pixels (``pixel_reduce``); the batch size and [B, P] are checked by
    :func:`_to_patches`."""
    b, t = inputs.shape[0], inputs.shape[1]
    f, (gh, gw), p = cast(int, layout.frames), layout.frame_grid, layout.num_patches  # a video
    h, w = inputs.shape[-2:]
    shape = tuple(maps.shape)
    if shape[1:] in ((1, f, gh, gw), (f, gh, gw)):
        return maps.reshape(b, p)
    if maps.dim() in (4, 5) and shape[1] == t and shape[-2:] == (h, w):
        pix = maps.abs() if pixel_reduce == "abs" else maps
        pix = pix.sum(2) if pix.dim() == 5 else pix  # channels -> [B, T, H, W]
        ph, pw = layout.patch_size
        pix = F.pad(pix[:, :f * layout.tubelet], (0, gw * pw - w, 0, gh * ph - h))
        pix = pix.reshape(b, f, layout.tubelet, gh, ph, gw, pw)
        return pix.sum((2, 4, 6)).reshape(b, p)
    raise ValueError(
        f"attribution maps of shape {shape} match neither the tubelet grid ({p} tubelets, "
        f"{f} frame slices of {(gh, gw)}) nor the video's frames {(t, h, w)}; give [B, P], "
        "[B, 1, F, gh, gw] or frame maps [B, T, C, H, W]")


def ranking(scores: Tensor) -> Tensor:
    """Patch indices from most to least important [B, P] (ties: lower index first)."""
    return torch.argsort(scores, dim=1, descending=True, stable=True)


__all__ = ["PIXEL_REDUCES", "AttributionLike", "patch_maps", "ranking"]
