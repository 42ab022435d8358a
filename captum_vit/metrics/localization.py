"""Localisation against ground-truth masks: pointing game and segmentation.

Patch maps come from precomputed maps or any attribution (see
:func:`captum_vit.metrics.removal.patch_maps`). The pointing game is decided on the patch
grid (the top patch against the patches the mask touches); segmentation upsamples the
map bilinearly to the image size before comparing it with the masks, as TokenTM does.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from captum_vit._base import TargetLike, check_choice, check_scalar
from captum_vit.metrics.maps import AttributionLike, patch_maps
from captum_vit.metrics.removal import UPSAMPLE_MODES, prepare_metric, upsample, vector_targets
from captum_vit.metrics.results import MetricResult

AP_MODES = ("foreground", "chefer")


def check_masks(masks: Any, inputs: Tensor) -> Tensor:
    """Boolean masks [B, H, W] matching the images (a [B, 1, H, W] mask is squeezed)."""
    if not isinstance(masks, Tensor):
        raise TypeError(f"masks must be a tensor [B, H, W], got {type(masks).__name__}")
    if masks.dim() == 4 and masks.shape[1] == 1:
        masks = masks[:, 0]
    b, _, h, w = inputs.shape
    if tuple(masks.shape) != (b, h, w):
        raise ValueError(f"masks must have shape [B, H, W] = {(b, h, w)} like the images, got "
                         f"{tuple(masks.shape)}; resize the masks with the images")
    return masks.to(device=inputs.device).bool()


def _images_only(layout: Any) -> None:
    """Refuse videos: the localisation metrics compare a map with one mask per image."""
    if layout.frames is not None:
        raise ValueError("the localisation metrics take images [B, C, H, W] with one mask "
                         "each; this model takes videos: use the faithfulness metrics "
                         "(deletion, insertion, ...), which remove tubelets")


@vector_targets
def upsampled_maps(model: nn.Module, inputs: Tensor, attribution: AttributionLike, *,
                   target: TargetLike = None, mode: str = "bilinear", pixel_reduce: str = "abs",
                   attribute_kwargs: dict | None = None) -> Tensor:
    """Patch maps upsampled to the image size [B, H, W] (``mode``: bilinear, bicubic or
    nearest; see :func:`~captum_vit.metrics.removal.upsample`)."""
    _, p = prepare_metric(model, inputs, target)
    _images_only(p.layout)
    scores = patch_maps(attribution, p.images, p.target, p.layout, pixel_reduce=pixel_reduce,
                        attribute_kwargs=attribute_kwargs)
    size = (p.images.shape[-2], p.images.shape[-1])
    return upsample(scores, p.layout.grid, p.layout.patch_size, size, mode)


@vector_targets
def pointing_game(model: nn.Module, inputs: Tensor, attribution: AttributionLike, masks: Tensor,
                  *, target: TargetLike = None, max_region: float = 0.5, tolerance: int = 0,
                  **kwargs: Any) -> MetricResult:
    """Pointing game (TIS, Englebert et al., ICCV Workshops 2023, Table 3), decided on the
    model's patch grid.

    The point is the **centre of the top patch** (the argmax of the patch scores): its
    central pixel for an odd patch size, its central 2×2 pixels for an even one. The
    example is a **hit** when the ground-truth mask contains that point, or lies within
    ``tolerance`` pixels of it (Euclidean; Zhang et al.'s protocol uses 15). This is the
    argmax of the patch-constant map with its plateau resolved to the plateau's centre,
    so every patch is judged alike. (The argmax of a bilinearly upsampled map, used
    before, ties over the outer corner of a border patch and took the first pixel in
    reading order, i.e. the image's edge, judging objects near the border more harshly.)
    When several patches share the largest score, the example scores the mean hit over
    them, the expected hit of a random tie-break. Examples whose region covers
    ``>= max_region`` of the image are skipped (NaN, left out of the mean).

    Args:
        model (nn.Module): a supported ViT classifier.
        inputs (Tensor): images [B, C, H, W].
        attribution: maps or an attribution (see :func:`patch_maps`).
        masks (Tensor): ground-truth regions [B, H, W] (bool).
        target (optional): class the maps explain (``None``: predicted class).
        max_region (float): skip threshold on the region's area fraction.
        tolerance (int): hit distance in pixels from the point to the region. Default 0.
        **kwargs: ``pixel_reduce``, ``attribute_kwargs``.

    Returns:
        MetricResult: per-example 1 (hit), 0 (miss), the mean hit over tied top patches,
        or NaN (skipped); value = hit rate.

    Examples::

        >>> pointing_game(model, x, GAE(model), masks).value
        >>> pointing_game(model, x, GAE(model), masks, tolerance=15).value
    """
    tolerance = check_scalar(tolerance, "tolerance", int, min_val=0)
    _, p = prepare_metric(model, inputs, target)
    _images_only(p.layout)
    m = check_masks(masks, p.images)
    skip = m.reshape(m.shape[0], -1).double().mean(1) >= max_region
    scores = patch_maps(attribution, p.images, p.target, p.layout, **kwargs)
    if tolerance:  # the region grown by a disk of radius `tolerance`
        r = torch.arange(-tolerance, tolerance + 1, dtype=torch.float32, device=m.device)
        disk = ((r[:, None] ** 2 + r[None] ** 2) <= tolerance ** 2).float()[None, None]
        m = F.conv2d(m.float()[:, None], disk, padding=tolerance)[:, 0] > 0
    hit_at = patch_centres_in(m, p.layout.grid, p.layout.patch_size)  # [B, P]
    top = scores == scores.amax(1, keepdim=True)
    hit = (top & hit_at.to(top.device)).sum(1).double() / top.sum(1).double()
    return MetricResult("pointing_game", torch.where(skip.to(hit.device), torch.nan, hit), True,
                        reduction="nanmean")


def patch_centres_in(masks: Tensor, grid: tuple[int, int], patch_size: tuple[int, int]
                     ) -> Tensor:
    """Whether each patch's centre lies in the region, [B, P] (raster order).

    The centre is the central pixel of an odd-sized patch and any of the central 2×2
    pixels of an even-sized one; centres beyond the image (padded grids) are clamped.
    """
    (gh, gw), (ph, pw) = grid, patch_size
    h, w = masks.shape[-2:]

    def central(n: int, size: int, limit: int) -> list[Tensor]:
        start = torch.arange(n, device=masks.device) * size
        return [(start + o).clamp(max=limit - 1) for o in dict.fromkeys(
            ((size - 1) // 2, size // 2))]

    hits = torch.zeros(masks.shape[0], gh, gw, dtype=torch.bool, device=masks.device)
    for rows in central(gh, ph, h):
        for cols in central(gw, pw, w):
            hits |= masks[:, rows][:, :, cols]
    return hits.reshape(masks.shape[0], -1)


def _average_precision(mask: Tensor, score: Tensor) -> float:
    from sklearn.metrics import average_precision_score

    y = mask.flatten().cpu().numpy()
    if y.all() or not y.any():
        return float("nan")
    return float(average_precision_score(y, score.flatten().cpu().double().numpy()))


def _chefer_average_precision(mask: Tensor, score: Tensor) -> float:
    """Chefer's ``get_ap_scores``: AP of the two-channel score ``[1 - map, map]`` against
    the one-hot mask ``[1 - mask, mask]``, both flattened together (2·H·W entries)."""
    from sklearn.metrics import average_precision_score

    m = mask.flatten().cpu().numpy().astype("float64")
    s = score.flatten().cpu().double().numpy()
    y = np.concatenate([1 - m, m])
    return float(np.nan_to_num(average_precision_score(y, np.concatenate([1 - s, s]))))


def _row_f1(pred: Tensor, mask: Tensor) -> Tensor:
    """Chefer's ``get_f1_scores`` on an ``[H, W]`` map: sklearn's F1 of each ROW (its
    ``reshape(batch_size, -1)`` takes the map's first axis for the batch), 0 where a row
    has no true and no predicted foreground; mean over the rows, per image [B]."""
    tp = (pred & mask).double().sum(-1)
    wrong = (pred ^ mask).double().sum(-1)  # FP + FN
    f1 = torch.where(2 * tp + wrong > 0, 2 * tp / (2 * tp + wrong).clamp_min(1), 0.0)
    return f1.mean(-1)


@vector_targets
def segmentation(model: nn.Module, inputs: Tensor, attribution: AttributionLike, masks: Tensor,
                 *, target: TargetLike = None, ap_mode: str = "foreground",
                 raw_upsample: str = "nearest", **kwargs: Any) -> dict[str, MetricResult]:
    """Segmentation test (TokenTM, Wu et al., CVPR 2024, Table 1; Chefer et al.'s
    ImageNet-Segmentation protocol).

    The map is upsampled bilinearly, min–max normalised per image and thresholded at its
    mean. Reported: pixel accuracy (per image, averaged; every image has the same number
    of labelled pixels, so this equals Chefer's accumulated ``Σ correct / Σ labelled``),
    mIoU (mean of the background and foreground IoU, with intersections and unions
    accumulated over the dataset), mAP (average precision of the normalised continuous
    map against the mask, per image, averaged) and ``raw_ap``: AP of the raw patch map
    upsampled by ``raw_upsample`` (nearest: copied to its pixels, SkipPLUS §4.2;
    ``"bicubic"``: the SkipPLUS authors' code). Images whose mask is empty or full have
    no foreground AP (NaN, left out).

    Args:
        model (nn.Module): a supported ViT classifier.
        inputs (Tensor): images [B, C, H, W].
        attribution: maps or an attribution (see :func:`patch_maps`).
        masks (Tensor): ground-truth foreground [B, H, W] (bool).
        target (optional): class the maps explain (``None``: predicted class).
        ap_mode (str): ``"foreground"`` (default: AP of the map against the foreground
            mask) or ``"chefer"`` (Chefer's ``imagenet_seg_eval.py``: AP of ``[1 - map,
            map]`` against the one-hot two-channel mask, flattened together, NaN -> 0;
            adds ``mf1``: the F1 of the binarised foreground, computed by Chefer's
            ``get_f1_scores`` per row of the image and averaged — verified in
            ``utils/metrices.py``).
        raw_upsample (str): interpolation of ``raw_ap`` (``"nearest"``, ``"bilinear"``,
            ``"bicubic"``). Default ``"nearest"``.
        **kwargs: ``pixel_reduce``, ``attribute_kwargs``.

    Returns:
        dict[str, MetricResult]: ``pixel_accuracy``, ``miou``, ``map``, ``raw_ap`` (and
        ``mf1`` with ``ap_mode="chefer"``).

    Examples::

        >>> seg = segmentation(model, x, TokenTM(model), masks)
        >>> seg["miou"].value
        >>> segmentation(model, x, TokenTM(model), masks, ap_mode="chefer")["mf1"].value
    """
    check_choice("ap_mode", ap_mode, AP_MODES)
    check_choice("raw_upsample", raw_upsample, UPSAMPLE_MODES)
    _, p = prepare_metric(model, inputs, target)
    _images_only(p.layout)
    inputs, layout = p.images, p.layout
    m = check_masks(masks, inputs)
    scores = patch_maps(attribution, inputs, p.target, layout, **kwargs)
    size = (inputs.shape[-2], inputs.shape[-1])
    up = upsample(scores, layout.grid, layout.patch_size, size)
    raw = upsample(scores, layout.grid, layout.patch_size, size, raw_upsample)
    b = up.shape[0]
    flat = up.reshape(b, -1)
    lo, hi = flat.min(1, keepdim=True).values, flat.max(1, keepdim=True).values
    norm = ((flat - lo) / (hi - lo).clamp_min(1e-12)).reshape_as(up)
    pred = norm > norm.mean((1, 2), keepdim=True)
    acc = (pred == m).double().mean((1, 2))
    stats = {}
    for name, pm, gm in (("fg", pred, m), ("bg", ~pred, ~m)):
        stats[f"inter_{name}"] = (pm & gm).double().sum((1, 2))
        stats[f"union_{name}"] = (pm | gm).double().sum((1, 2))
    per_iou = cast(Tensor, sum(stats[f"inter_{c}"] / stats[f"union_{c}"].clamp_min(1)
                               for c in ("bg", "fg"))) / 2
    ap_of = _chefer_average_precision if ap_mode == "chefer" else _average_precision
    ap = torch.tensor([ap_of(m[i], norm[i]) for i in range(b)], dtype=torch.float64)
    raw_ap = torch.tensor([_average_precision(m[i], raw[i]) for i in range(b)],
                          dtype=torch.float64)
    out = {
        "pixel_accuracy": MetricResult("pixel_accuracy", acc.cpu(), True),
        "miou": MetricResult("miou", per_iou.cpu(), True, stats={k: v.cpu() for k, v in
                                                                 stats.items()},
                             reduction="iou"),
        "map": MetricResult("map", ap, True, reduction="nanmean"),
        "raw_ap": MetricResult("raw_ap", raw_ap, True, reduction="nanmean"),
    }
    if ap_mode == "chefer":
        out["mf1"] = MetricResult("mf1", _row_f1(pred, m).cpu(), True)
    return out
