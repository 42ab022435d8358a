"""Image reading and conversion to a model's input: the one reader of ``--image``, of
``--data folder:PATH`` and of the models' preprocessing."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff", ".gif")
"""File suffixes read as images (case-insensitive)."""

LUMA = (0.299, 0.587, 0.114)
"""ITU-R 601 weights of R, G, B in a grey value (PIL's ``convert("L")``)."""

_GREY_BANDS = {("L",), ("1",), ("F",), ("L", "A"), ("La",)}


def read_image(path: str | os.PathLike) -> Tensor:
    r"""Read an image file as a float tensor in ``[0, 1]``.

    Grey-level files (PIL modes ``L``, ``1``, ``I``, ``I;16``, ``F``, ``LA``) give one
    channel, everything else (RGB, RGBA, palette, CMYK ...) three; alpha is dropped.

    Args:
        path (str or os.PathLike): the image file (any format PIL reads).

    Returns:
        Tensor: float32 ``[C, H, W]`` with ``C`` 1 or 3.

    Raises:
        FileNotFoundError: if ``path`` is not a file.
        ValueError: if PIL cannot read it.

    Examples::

        >>> from captum_vit.data.images import read_image
        >>> read_image("photo.jpg").shape
        torch.Size([3, 480, 640])
    """
    from PIL import Image, UnidentifiedImageError

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such file")
    try:
        with Image.open(p) as im:
            return as_image(im)
    except UnidentifiedImageError as e:
        raise ValueError(f"{p}: not an image PIL can read") from e


def as_image(image: Any) -> Tensor:
    r"""A PIL image, a numpy array or a tensor as a float ``[C, H, W]`` image.

    Arrays are ``[H, W]`` or ``[H, W, C]`` (values in ``[0, 255]`` when their maximum
    exceeds 1, else in ``[0, 1]``); tensors are ``[H, W]`` or ``[C, H, W]`` and are
    returned as float32 without rescaling.

    Args:
        image (PIL.Image.Image, numpy.ndarray or Tensor): the image.

    Returns:
        Tensor: float32 ``[C, H, W]``.

    Raises:
        TypeError: for another type.
        ValueError: for a tensor or array of the wrong rank.

    Examples::

        >>> from captum_vit.data.images import as_image
        >>> as_image(np.zeros((28, 28), np.uint8)).shape
        torch.Size([1, 28, 28])
    """
    if hasattr(image, "convert") and hasattr(image, "getbands"):  # PIL image
        if image.mode.startswith("I"):  # 16/32-bit grey: 16-bit range if it exceeds 8 bits
            arr = np.asarray(image, dtype=np.float32)
            image = arr / (65535.0 if arr.max() > 255 else 255.0)
        else:
            grey = tuple(image.getbands()) in _GREY_BANDS
            image = np.asarray(image.convert("L" if grey else "RGB"), dtype=np.float32) / 255.0
    if isinstance(image, np.ndarray):
        pixels = torch.from_numpy(np.ascontiguousarray(image)).float()
        if pixels.dim() == 3:  # H, W, C
            pixels = pixels.permute(2, 0, 1)
        image = pixels / 255.0 if pixels.numel() and pixels.max() > 1.0 else pixels
    if not isinstance(image, Tensor):
        raise TypeError("image must be a PIL image, a numpy array or a torch.Tensor, "
                        f"got {type(image).__name__}")
    x = image.float()
    if x.dim() == 2:
        x = x[None]
    if x.dim() != 3:
        raise ValueError(f"image must be [H, W] or [C, H, W], got shape {tuple(x.shape)}")
    return x


def conform(image: Any, channels: int, size: tuple[int, int]) -> Tensor:
    r"""An image with the channels and size a model takes.

    Three channels become one as their ITU-R 601 luminance (:data:`LUMA`), one channel
    is repeated to three, and the image is resized bilinearly (antialiased, so that a
    large photo is not aliased) when its size differs.

    Args:
        image (PIL image, numpy array or Tensor): any form :func:`as_image` takes.
        channels (int): channels of the model's input.
        size (tuple[int, int]): ``(H, W)`` of the model's input.

    Returns:
        Tensor: float32 ``[channels, H, W]``.

    Raises:
        ValueError: for channel counts that cannot be converted (e.g. 2 to 3).

    Examples::

        >>> from captum_vit.data.images import conform
        >>> conform(torch.rand(3, 100, 80), 1, (56, 56)).shape
        torch.Size([1, 56, 56])
    """
    x = as_image(image)
    c = x.shape[0]
    if c != channels:
        if c == 3 and channels == 1:
            x = (x * x.new_tensor(LUMA)[:, None, None]).sum(0, keepdim=True)
        elif c == 1:
            x = x.expand(channels, -1, -1)
        else:
            raise ValueError(f"image has {c} channels and the model takes {channels}; only "
                             "1 <-> 3 channels are converted")
    if tuple(x.shape[-2:]) != tuple(size):
        x = F.interpolate(x[None], size=tuple(size), mode="bilinear", align_corners=False,
                          antialias=True)[0]
    return x.contiguous()


def conform_mask(mask: Any, size: tuple[int, int]) -> Tensor:
    r"""A ground-truth mask resized (nearest) to ``size``.

    Args:
        mask (Tensor or numpy.ndarray): ``[H, W]`` or ``[1, H, W]``, any dtype.
        size (tuple[int, int]): ``(H, W)`` of the model's input.

    Returns:
        Tensor: bool ``[H, W]``.

    Examples::

        >>> conform_mask(torch.ones(28, 28), (56, 56)).shape
        torch.Size([56, 56])
    """
    m = torch.as_tensor(np.asarray(mask) if isinstance(mask, np.ndarray) else mask).bool()
    m = m.reshape(m.shape[-2:])
    if tuple(m.shape) != tuple(size):
        m = F.interpolate(m[None, None].float(), size=tuple(size), mode="nearest-exact")[0, 0] > 0
    return m


def is_image_file(path: Path) -> bool:
    """Whether ``path`` has one of :data:`IMAGE_EXTENSIONS` (case-insensitive).

    Examples::

        >>> from captum_vit.data.images import is_image_file
        >>> is_image_file(Path("a/B.JPG")), is_image_file(Path("notes.txt"))
        (True, False)
    """
    return path.suffix.lower() in IMAGE_EXTENSIONS




def read_json(path: str | os.PathLike, what: str, missing: str) -> Any:
    """The JSON value in the file ``path``, with errors that name ``what`` it is.

    Args:
        path (str or PathLike): the file.
        what (str): what the file is, for the messages (e.g. ``"model card"``).
        missing (str): what to do when it is missing (appended to the error).

    Returns:
        The parsed JSON value.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not valid JSON.

    Examples::

        >>> from captum_vit.data.images import read_json
        >>> card = read_json("captum_vit/zoo/vit_fmnist_loc.json", "model card", "")
        >>> card["timm_kwargs"]["depth"]
        4
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what} {p} not found; {missing}")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {p} is not valid JSON: {e}") from e


__all__ = ["IMAGE_EXTENSIONS", "LUMA", "as_image", "conform", "conform_mask", "is_image_file",
           "read_image", "read_json"]
