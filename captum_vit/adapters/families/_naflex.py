"""What the NaFlex families share (Hugging Face SigLIP2, timm ``NaFlexVit``): the patch
layout of their processors and the reading of a padded, patchified batch back into
images.

A NaFlex processor resizes each image to a grid of whole patches (its own ``(h, w)``, at
most ``max_num_patches``), flattens each patch and pads the patch rows of a batch to one
length: ``patches [B, N, P·P·C]``, a validity mask ``[B, N]`` (the first ``h·w`` rows
valid, in raster order) and the grid (``spatial_shapes`` [B, 2] in transformers,
``patch_coord`` [B, N, 2] in timm). Both libraries flatten a patch channels-last,
``(row in patch, column in patch, channel)`` (verified: transformers'
``siglip2.image_processing_siglip2.convert_image_to_patches`` permutes ``(C, h, P, w, P)``
to ``(h, w, P, P, C)``; timm's ``naflexvit.batch_patchify`` with
``channels_last=True``, the NaFlex default).

The families explain a padded batch image by image: :func:`split_padded` turns each
image's valid patch rows back into the image ``[1, C, h·P, w·P]`` and groups images of
one grid (:meth:`~captum_vit.adapters.ViTAdapter.processor_images`); the padded keys
get exactly zero attention probability in the model (a key mask of the dtype's
minimum added before the softmax) and the pooling reads valid rows only, so the model's
output for an image does not depend on its padding and the unpadded forward is the
padded one. :func:`pad_patches` lays per-image pixel maps out as the batch's patches
(``output="inputs"``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor


def patchify(images: Tensor, patch: tuple[int, int], channels_last: bool = True) -> Tensor:
    """Images ``[B, C, H, W]`` as flattened patches ``[B, gh·gw, ph·pw·C]`` in raster
    order, each patch flattened ``(row, column, channel)`` (``channels_last``, the NaFlex
    processors' order) or ``(channel, row, column)``.

    Args:
        images (Tensor): ``[B, C, H, W]``, ``H`` and ``W`` multiples of the patch size.
        patch (tuple of int): ``(ph, pw)``.
        channels_last (bool, optional): the flattening order. Default ``True``.

    Returns:
        Tensor: the patches.
    """
    b, c, h, w = images.shape
    ph, pw = patch
    x = images.reshape(b, c, h // ph, ph, w // pw, pw)
    x = x.permute(0, 2, 4, 3, 5, 1) if channels_last else x.permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // ph) * (w // pw), -1)


def unpatchify(patches: Tensor, grid: tuple[int, int], patch: tuple[int, int],
               channels: int, channels_last: bool = True) -> Tensor:
    """The inverse of :func:`patchify` for one image: ``gh·gw`` patch rows to the image
    ``[1, C, gh·ph, gw·pw]``.

    Args:
        patches (Tensor): ``[gh·gw, ph·pw·C]``.
        grid (tuple of int): ``(gh, gw)``.
        patch (tuple of int): ``(ph, pw)``.
        channels (int): ``C``.
        channels_last (bool, optional): the flattening order. Default ``True``.

    Returns:
        Tensor: the image.
    """
    (gh, gw), (ph, pw) = grid, patch
    if channels_last:
        x = patches.reshape(gh, gw, ph, pw, channels).permute(4, 0, 2, 1, 3)
    else:
        x = patches.reshape(gh, gw, channels, ph, pw).permute(2, 0, 3, 1, 4)
    return x.reshape(1, channels, gh * ph, gw * pw)


def batch_value(batch: Mapping[str, Any], key: str, family: str) -> Tensor:
    """``batch[key]`` as a tensor (a processor's ``BatchFeature`` or a dict).

    Raises:
        ValueError: the key is missing (the message names it and the keys there are).
    """
    if key not in batch:
        raise ValueError(f"the processor's output has no {key!r} (it has "
                         f"{', '.join(map(repr, batch.keys())) or 'no keys'}); {family} "
                         "needs the processor's whole output (return_tensors='pt'), unchanged")
    value = batch[key]
    return value if isinstance(value, Tensor) else torch.as_tensor(value)


def split_padded(patches: Tensor, valid: Tensor, grids: Sequence[tuple[int, int]],
                 patch: tuple[int, int], channels: int, *, names: tuple[str, str, str],
                 channels_last: bool = True) -> list[tuple[Tensor, Tensor]]:
    """A padded, patchified batch as groups of unpadded images of one grid.

    Args:
        patches (Tensor): ``[B, N, ph·pw·C]``.
        valid (Tensor): ``[B, N]``, nonzero where a patch row is an image's.
        grids (sequence of (int, int)): each image's ``(h, w)``.
        patch (tuple of int): ``(ph, pw)``.
        channels (int): ``C``.
        names (tuple of str): the batch's keys of ``patches``, ``valid`` and the grids,
            for the messages.
        channels_last (bool, optional): the patches' flattening order. Default ``True``.

    Returns:
        list of ``(index, images)``: the images' positions ``[k]`` (int64) and the images
        ``[k, C, h·ph, w·pw]``, one entry per grid in order of first appearance.

    Raises:
        ValueError: a shape that does not fit the patch size, or an image whose valid
            rows are not the first ``h·w`` of its row (the mask and the grid disagree).
    """
    pkey, vkey, gkey = names
    (ph, pw), dim = patch, patch[0] * patch[1] * channels
    if patches.dim() != 3 or patches.shape[-1] != dim:
        raise ValueError(f"{pkey} has shape {tuple(patches.shape)}; expected [B, N, {dim}] "
                         f"(patches of {ph}x{pw} pixels, {channels} channels, flattened)")
    b, n = patches.shape[:2]
    if tuple(valid.shape) != (b, n):
        raise ValueError(f"{vkey} has shape {tuple(valid.shape)} but {pkey} has {b} images "
                         f"of {n} patch rows; pass the processor's output unchanged")
    if len(grids) != b:
        raise ValueError(f"{gkey} gives {len(grids)} grids for the {b} images of {pkey}")
    rows = torch.arange(n, device=valid.device)
    groups: dict[tuple[int, int], list[int]] = {}
    images: dict[tuple[int, int], list[Tensor]] = {}
    for i, (h, w) in enumerate(grids):
        if h <= 0 or w <= 0 or h * w > n:
            raise ValueError(f"{gkey}[{i}] is a {h}x{w} grid, but {pkey} holds {n} patch "
                             "rows per image: the grid does not match "
                             f"{pkey}; pass the processor's output unchanged")
        count = int((valid[i] != 0).sum())
        if not torch.equal(valid[i] != 0, rows < h * w):
            raise ValueError(f"{vkey}[{i}] marks {count} valid patch rows but {gkey}[{i}] "
                             f"is a {h}x{w} grid, whose {h * w} patches are the first rows: "
                             f"{vkey} and {gkey} disagree; pass the processor's output "
                             "unchanged")
        groups.setdefault((h, w), []).append(i)
        images.setdefault((h, w), []).append(
            unpatchify(patches[i, :h * w], (h, w), patch, channels, channels_last))
    return [(torch.tensor(index, dtype=torch.int64), torch.cat(images[g]))
            for g, index in groups.items()]


def pad_patches(maps: Sequence[Tensor], like: Tensor, patch: tuple[int, int],
                channels_last: bool = True) -> Tensor:
    """Per-image pixel maps ``[1, C, h·ph, w·pw]`` laid out as a padded patch batch
    ``like`` ``[B, N, ph·pw·C]`` (each image's patches first, zero padding): Captum's
    rule that an attribution has its input's shape.

    Args:
        maps (sequence of Tensor): one map per image, in the batch's order.
        like (Tensor): the batch's patches.
        patch (tuple of int): ``(ph, pw)``.
        channels_last (bool, optional): the flattening order. Default ``True``.

    Returns:
        Tensor: the maps, shaped like ``like``.
    """
    first = maps[0]
    out = first.new_zeros(like.shape)
    for i, m in enumerate(maps):
        p = patchify(m, patch, channels_last)[0]
        out[i, :p.shape[0]] = p
    return out
