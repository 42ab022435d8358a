r"""ImageNet-S (Gao et al., TPAMI 2022) semantic-segmentation masks of ImageNet images, as in
the SkipPLUS segmentation-AP protocol (Mehri et al. 2024; the ``skipplus_seg_ap``
protocol of :mod:`captum_vit.metrics.protocols`).

Layout (the official preparation of ``ImageNetS919`` / ``ImageNetS300`` / ``ImageNetS50``):
``PATH/validation/<WNID>/<name>.JPEG``, ``PATH/validation-segmentation/<WNID>/<name>.png``
and the category list ``ImageNetS_categories_im919.txt`` (one WNID per line: class id
``k`` is line ``k``) in ``PATH`` or its parent (or the ``categories`` argument). A mask
pixel's class id is ``R + 256 * G`` of the PNG: 0 = other, 1000 = ignored.

Each image's target is the present class with the largest area, if it covers at least
``min_area`` (5 %) of the pixels; its mask is that class's pixels.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from captum_vit.data.images import is_image_file, read_image
from captum_vit.data.transforms import require

OTHER, IGNORED = 0, 1000
"""Class ids of ImageNet-S masks that name no category."""


def read_class_ids(path: str | os.PathLike) -> Tensor:
    r"""The class-id map ``R + 256 * G`` of an ImageNet-S mask PNG.

    Args:
        path (str or os.PathLike): the ``.png``.

    Returns:
        Tensor: int64 ``[H, W]``.

    Examples::

        >>> from captum_vit.data.imagenet_s import read_class_ids
        >>> read_class_ids("validation-segmentation/n01443537/ILSVRC2012_val_00004677.png")
        tensor([[0, 0, ...]])
    """
    from PIL import Image

    with Image.open(require(path, "ImageNet-S", "the mask PNG")) as im:
        rgb = np.asarray(im.convert("RGB"), dtype=np.int64)
    return torch.from_numpy(rgb[..., 0] + 256 * rgb[..., 1])


def main_class(ids: Tensor, min_area: float = 0.05) -> int:
    r"""The class id with the largest area among those covering at least ``min_area`` of
    the pixels (0 and 1000 excluded; ties: the smaller id), or ``-1`` when none does.

    Args:
        ids (Tensor): a class-id map (:func:`read_class_ids`).
        min_area (float, optional): minimum fraction of the pixels. Default 0.05.

    Returns:
        int: the class id (1-based) or ``-1``.

    Examples::

        >>> main_class(torch.tensor([[0, 3], [3, 1000]]))
        3
    """
    values, counts = torch.unique(ids, return_counts=True)
    keep = (values != OTHER) & (values != IGNORED) & (counts >= min_area * ids.numel())
    if not bool(keep.any()):
        return -1
    values, counts = values[keep], counts[keep]
    return int(values[int(torch.argmax(counts))])


class ImageNetS(Dataset):
    r"""ImageNet-S images with the mask of their main class (see the module docstring).

    Items are ``(image, label, mask)``: float32 ``[C, H, W]`` in ``[0, 1]``, the index of
    the main class in :attr:`classes` (the category WNIDs, so class id ``k`` is label
    ``k - 1``; ``-1`` when no class covers ``min_area``) and the bool ``[H, W]`` mask of
    that class (all False for ``-1``; ignored pixels are not in it).

    Args:
        root (str or os.PathLike): the ImageNet-S folder (``ImageNetS919``).
        split (str, optional): ``"validation"`` or ``"test"`` (folders ``split`` and
            ``split-segmentation``). Default ``"validation"``.
        categories (str or os.PathLike, optional): the category list; default: the
            ``ImageNetS_categories_im*.txt`` in ``root`` or its parent.
        min_area (float, optional): minimum area of the target class. Default 0.05.

    Raises:
        FileNotFoundError: a missing folder, category list or image of a mask.
        ValueError: no masks, or a bad ``min_area``.

    Examples::

        >>> from captum_vit.data import ImageNetS
        >>> ds = ImageNetS("ImageNetS919")
        >>> image, label, mask = ds[0]
        >>> ds.classes[label]
        'n01443537'
    """

    def __init__(self, root: str | os.PathLike, *, split: str = "validation",
                 categories: str | os.PathLike | None = None, min_area: float = 0.05) -> None:
        spec = "--data imagenet-s:PATH"
        if not 0.0 <= float(min_area) <= 1.0:
            raise ValueError(f"min_area must be in [0, 1], got {min_area}")
        r = require(root, spec, "the ImageNet-S folder (ImageNetS919 with validation/ and "
                    "validation-segmentation/)", folder=True)
        images = require(r / split, spec, f"the images {split}/<WNID>/*.JPEG", folder=True)
        masks = require(r / f"{split}-segmentation", spec,
                        f"the masks {split}-segmentation/<WNID>/*.png", folder=True)
        self.categories = self._categories(r, categories, spec)
        self.classes: tuple[str, ...] = tuple(
            line.split()[0] for line in self.categories.read_text().splitlines() if line.strip())
        self.masks = sorted(p for p in masks.rglob("*.png") if p.is_file())
        if not self.masks:
            raise ValueError(f"{spec}: no .png masks under {masks}")
        stems: dict[Path, Path] = {}
        for p in images.rglob("*"):
            if p.is_file() and is_image_file(p):
                stems.setdefault(p.relative_to(images).with_suffix(""), p)
        missing = [m for m in self.masks if m.relative_to(masks).with_suffix("") not in stems]
        if missing:
            raise FileNotFoundError(
                f"{spec}: no image for the masks {', '.join(str(m) for m in missing[:3])}"
                f"{' ...' if len(missing) > 3 else ''}; put each image at the mask's path "
                f"under {images} (e.g. {split}/<WNID>/<name>.JPEG)")
        self.files = [stems[m.relative_to(masks).with_suffix("")] for m in self.masks]
        self.min_area = float(min_area)

    @staticmethod
    def _categories(root: Path, categories: str | os.PathLike | None, spec: str) -> Path:
        if categories is not None:
            return require(categories, spec, "the ImageNet-S category list (one WNID per line)")
        for d in (root, root.parent):
            found = sorted(d.glob("ImageNetS_categories_im*.txt"))
            if found:
                return found[0]
        raise FileNotFoundError(
            f"{spec}: no ImageNetS_categories_im*.txt in {root} or {root.parent}; put the "
            "category list of the ImageNet-S repository (data/categories/"
            "ImageNetS_categories_im919.txt: class id k = line k) there")

    def __len__(self) -> int:
        return len(self.masks)

    def class_ids(self, i: int) -> Tensor:
        """The class-id map ``[H, W]`` of example ``i`` (0 other, 1000 ignored)."""
        return read_class_ids(self.masks[i])

    def __getitem__(self, i: int) -> tuple[Tensor, int, Tensor]:
        ids = self.class_ids(i)
        k = main_class(ids, self.min_area)
        return read_image(self.files[i]), (k - 1 if k > 0 else -1), ids == k


__all__ = ["IGNORED", "OTHER", "ImageNetS", "main_class", "read_class_ids"]
