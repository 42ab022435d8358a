"""Resizing as the source papers' evaluation scripts do it (torchvision's ``Resize`` /
``CenterCrop`` on PIL images), for the evaluation presets
(:mod:`captum_vit.metrics.protocols`), and the file checks every loader shares.

The models' own preprocessing (:class:`Preprocess`, here so that the data layer needs
nothing of the model loader; :mod:`captum_vit.models` re-exports it) resizes a float
image with antialiased bilinear interpolation in torch; the papers' scripts resize the
uint8 PIL image (PIL's filters, 8-bit rounding). :func:`seed_transforms` reproduces the
latter exactly so a preset feeds the model the same numbers as the paper's script.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from captum_vit._text import count_noun
from captum_vit.data.images import as_image, conform

INTERPOLATIONS = ("nearest", "bilinear", "bicubic")
"""PIL filters :func:`resize` takes (torchvision's ``InterpolationMode`` names)."""


def require(path: str | os.PathLike, spec: str, what: str, *, folder: bool = False) -> Path:
    r"""``path`` as a :class:`~pathlib.Path`, or a ``FileNotFoundError`` saying what to put
    there (the one message shape of every loader).

    Args:
        path (str or os.PathLike): the file or folder.
        spec (str): the data spec or argument it came from (``"--data cifar10:PATH"``).
        what (str): what belongs there (``"the folder cifar-10-batches-py (data_batch_1
            .. 5, test_batch, batches.meta)"``).
        folder (bool, optional): ``path`` must be a folder (else a file). Default False.

    Returns:
        Path: the path.

    Raises:
        FileNotFoundError: ``path`` is missing: names ``spec`` and ``what``.

    Examples::

        >>> from captum_vit.data.transforms import require
        >>> require("/data/gtsegs_ijcv.mat", "--data imagenet-seg:PATH",
        ...         "gtsegs_ijcv.mat")  # doctest: +SKIP
    """
    p = Path(path)
    if not (p.is_dir() if folder else p.is_file()):
        kind = "folder" if folder else "file"
        raise FileNotFoundError(f"{spec}: no {kind} {p}; put {what} there (nothing is "
                                "downloaded)")
    return p


def _size(size: int | Sequence[int], h: int, w: int) -> tuple[int, int]:
    """torchvision ``Resize(size)``'s output ``(H, W)``: an int sets the shorter side."""
    if isinstance(size, int):
        if h <= w:
            return size, int(size * w / h)
        return int(size * h / w), size
    if len(size) != 2:
        raise ValueError(f"size must be an int (shorter side) or (H, W), got {size!r}")
    return int(size[0]), int(size[1])


def resize(image: Any, size: int | Sequence[int], *, interpolation: str = "bilinear"
           ) -> Tensor:
    r"""torchvision's ``Resize(size, interpolation)`` applied to the PIL image of ``image``.

    The image goes through uint8 (exact for images read from 8-bit files) and PIL's
    filter, as in the papers' scripts' ``transforms.Resize`` on a PIL image.

    Args:
        image (Tensor, numpy.ndarray or PIL image): ``[C, H, W]`` in ``[0, 1]`` (any
            form :func:`captum_vit.data.images.as_image` takes), 1 or 3 channels.
        size (int or tuple[int, int]): ``(H, W)``, or an int: the shorter side (the
            other keeps the aspect ratio, truncated as torchvision does).
        interpolation (str, optional): one of :data:`INTERPOLATIONS`. Default
            ``"bilinear"``.

    Returns:
        Tensor: float32 ``[C, H', W']`` in ``[0, 1]``.

    Raises:
        ValueError: an unknown ``interpolation`` or a bad ``size``.

    Examples::

        >>> from captum_vit.data.transforms import resize
        >>> resize(torch.rand(3, 375, 500), 256).shape
        torch.Size([3, 256, 341])
    """
    from PIL import Image

    if interpolation not in INTERPOLATIONS:
        raise ValueError(f"interpolation must be one of {', '.join(INTERPOLATIONS)}, got "
                         f"{interpolation!r}")
    x = as_image(image)
    h, w = _size(size, int(x.shape[-2]), int(x.shape[-1]))
    arr = (x.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    pil = Image.fromarray(arr[..., 0] if arr.shape[-1] == 1 else arr)
    out = pil.resize((w, h), getattr(Image.Resampling, interpolation.upper()))
    return as_image(np.asarray(out, dtype=np.float32) / 255.0)


def resize_mask(mask: Any, size: int | Sequence[int]) -> Tensor:
    r"""torchvision's ``Resize(size, NEAREST)`` of a mask (PIL's nearest filter).

    Args:
        mask (Tensor or numpy.ndarray): ``[H, W]``, bool or integer (values kept).
        size (int or tuple[int, int]): as in :func:`resize`.

    Returns:
        Tensor: ``[H', W']`` of the mask's dtype.

    Examples::

        >>> from captum_vit.data.transforms import resize_mask
        >>> resize_mask(torch.ones(375, 500, dtype=torch.bool), (224, 224)).shape
        torch.Size([224, 224])
    """
    from PIL import Image

    m = torch.as_tensor(np.asarray(mask) if isinstance(mask, np.ndarray) else mask)
    h, w = _size(size, int(m.shape[-2]), int(m.shape[-1]))
    arr = m.reshape(m.shape[-2:]).to(torch.int32).numpy()
    out = np.asarray(Image.fromarray(arr).resize((w, h), Image.Resampling.NEAREST))
    return torch.from_numpy(out.astype(np.int64)).to(m.dtype)


def center_crop(x: Tensor, size: int | Sequence[int]) -> Tensor:
    r"""torchvision's ``CenterCrop(size)`` of an image ``[C, H, W]`` or a mask ``[H, W]``
    (offsets ``round((H - h) / 2)``; no padding: the input must be at least ``size``).

    Args:
        x (Tensor): the image or mask.
        size (int or tuple[int, int]): ``(h, w)`` or one int for both.

    Returns:
        Tensor: ``[..., h, w]``.

    Raises:
        ValueError: the input is smaller than ``size``.

    Examples::

        >>> from captum_vit.data.transforms import center_crop
        >>> center_crop(torch.rand(3, 256, 341), 224).shape
        torch.Size([3, 224, 224])
    """
    th, tw = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    h, w = int(x.shape[-2]), int(x.shape[-1])
    if h < th or w < tw:
        raise ValueError(f"center crop {(th, tw)} is larger than the input {(h, w)}; resize "
                         "first")
    top, left = int(round((h - th) / 2.0)), int(round((w - tw) / 2.0))
    return x[..., top:top + th, left:left + tw]


@dataclass(frozen=True)
class Preprocess:
    """An image of any size -> the model's normalised input ``[C, H, W]``.

    Takes what :func:`captum_vit.data.images.as_image` takes (PIL image, numpy array in
    ``[0, 255]`` or ``[0, 1]``, ``[C, H, W]`` tensor), converts the channels (3 -> 1 by
    luminance, 1 -> 3 by repetition), resizes bilinearly to ``size`` and subtracts ``mean``
    and divides by ``std`` per channel (no normalisation when they are ``None``).

    Attributes:
        channels (int): channels of the model's input.
        size (tuple[int, int]): ``(H, W)`` of the model's input.
        mean (tuple[float, ...], optional): per-channel mean (one value for all channels).
        std (tuple[float, ...], optional): per-channel standard deviation.

    Examples::

        >>> pre = Preprocess(1, (56, 56), (0.1,), (0.25,))
        >>> pre(torch.rand(3, 100, 80)).shape
        torch.Size([1, 56, 56])
    """

    channels: int
    size: tuple[int, int]
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("mean", "std"):
            v = getattr(self, name)
            if v is not None and len(v) not in (1, self.channels):
                give = "1 value" if self.channels == 1 else f"1 or {self.channels} values"
                raise ValueError(f"normalization {name} has {count_noun(len(v), 'value')} for "
                                 f"a model with {count_noun(self.channels, 'channel')}; "
                                 f"give {give}")
        if (self.mean is None) != (self.std is None):
            raise ValueError("normalization needs both mean and std")

    def __call__(self, image: Any) -> Tensor:
        x = conform(image, self.channels, self.size)
        if self.mean is None or self.std is None:
            return x
        mean = x.new_tensor(self.mean)[:, None, None]
        std = x.new_tensor(self.std)[:, None, None]
        return (x - mean) / std


class SeedTransforms(NamedTuple):
    """What a preset applies: ``image`` and ``mask`` transforms of the raw examples (for
    :func:`captum_vit.data.load_data`'s ``transform`` / ``mask_transform``) and the
    ``preprocess`` normalising the resized image (for
    :func:`captum_vit.metrics.suite.evaluate`)."""

    image: Callable[[Any], Tensor]
    mask: Callable[[Any], Tensor]
    preprocess: Any


def seed_transforms(size: int | Sequence[int] = (224, 224), *,
                    crop: int | Sequence[int] | None = None,
                    mean: float | Sequence[float] = 0.5, std: float | Sequence[float] = 0.5,
                    interpolation: str = "bilinear", channels: int = 3) -> SeedTransforms:
    r"""The papers' torchvision pipeline ``Resize(size) [-> CenterCrop(crop)] -> ToTensor ->
    Normalize(mean, std)`` for images, and ``Resize(size, NEAREST) [-> CenterCrop(crop)]``
    for masks.

    The defaults are the paper's pipeline of the ``tokentm_segmentation`` preset (Chefer's
    ``imagenet_seg_eval.py``): ``Resize((224, 224))`` bilinear, no crop,
    ``Normalize(0.5, 0.5)`` on three channels, masks nearest. ``seed_transforms(256,
    crop=224)`` is the ``Resize(256) -> CenterCrop(224)`` of ImageNet scripts.

    ``Normalize(0.5, 0.5)`` is the normalisation of the paper's model: for another model
    pass its own (``mean=pre.mean, std=pre.std, channels=pre.channels`` with
    ``pre = load_model(...).preprocess``), as ``captum-vit evaluate --protocol`` does by
    default; a model fed another normalisation than its training one loses accuracy
    (the bundled 1-channel model: 84.4 % -> 25.8 % on the shipped samples).

    Args:
        size (int or tuple[int, int], optional): ``Resize`` argument (an int sets the
            shorter side). Default ``(224, 224)``.
        crop (int or tuple[int, int], optional): ``CenterCrop`` size; ``None`` = no crop.
        mean (float or Sequence[float], optional): ``Normalize`` mean (one value, or one
            per channel). Default 0.5 (the paper's model).
        std (float or Sequence[float], optional): ``Normalize`` std. Default 0.5.
        interpolation (str, optional): image filter (:data:`INTERPOLATIONS`). Default
            ``"bilinear"``.
        channels (int, optional): channels of the model's input. Default 3.

    Returns:
        SeedTransforms: ``(image, mask, preprocess)``; ``preprocess`` is a
        :class:`Preprocess` at the final size.

    Raises:
        ValueError: an int ``size`` without ``crop`` (the output size would vary per
            image), a bad ``interpolation``, or a ``mean`` / ``std`` whose number of
            values is neither 1 nor ``channels``.

    Examples::

        >>> from captum_vit.data import load_data, seed_transforms
        >>> t = seed_transforms()  # tokentm_segmentation
        >>> data = load_data("imagenet-seg:gtsegs_ijcv.mat", n=100, input_shape=(3, (224, 224)),
        ...                  num_classes=1000, transform=t.image, mask_transform=t.mask)
        >>> # evaluate(model, data, methods, metrics, preprocess=t.preprocess)
    """
    if interpolation not in INTERPOLATIONS:
        raise ValueError(f"interpolation must be one of {', '.join(INTERPOLATIONS)}, got "
                         f"{interpolation!r}")
    if isinstance(size, int) and crop is None:
        raise ValueError(f"size={size} sets only the shorter side, so images would differ in "
                         "size; give size=(H, W) or a crop")
    final = crop if crop is not None else size
    out = (final, final) if isinstance(final, int) else (int(final[0]), int(final[1]))

    def image(x: Any) -> Tensor:
        y = resize(x, size, interpolation=interpolation)
        return y if crop is None else center_crop(y, crop).contiguous()

    def mask(m: Any) -> Tensor:
        y = resize_mask(m, size)
        return y if crop is None else center_crop(y, crop).contiguous()

    def values(v: float | Sequence[float]) -> tuple[float, ...]:
        return (float(v),) if isinstance(v, (int, float)) else tuple(float(f) for f in v)

    return SeedTransforms(image, mask, Preprocess(channels, out, values(mean), values(std)))


__all__ = ["INTERPOLATIONS", "Preprocess", "SeedTransforms", "center_crop", "require", "resize",
           "resize_mask", "seed_transforms"]
