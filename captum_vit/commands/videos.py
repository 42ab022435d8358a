"""Video input of ``captum-vit explain --video``: a folder of frames or a tensor file, read
as frames ``[B, T, C, H, W]`` and brought to what a video model takes.

A folder holds one video, its frames as image files
(:data:`~captum_vit.data.images.IMAGE_EXTENSIONS`) in natural order of their names
(``frame2.png`` before ``frame10.png``); a tensor file (``.pt`` / ``.pth``, read with
``torch.load(weights_only=True)``) holds one video ``[T, C, H, W]`` or a batch ``[B, T, C,
H, W]``, frames before channels, pixel values in ``[0, 1]`` (floats) or ``[0, 255]``
(``uint8``). Nothing here names a model family: what a model takes
is read from its adapter (:attr:`~captum_vit.adapters.base.ViTAdapter.video`, its
``num_frames`` where it has one, and
:meth:`~captum_vit.adapters.base.ViTAdapter.check_inputs`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from captum_vit.data.images import IMAGE_EXTENSIONS, is_image_file, read_image

TENSOR_SUFFIXES = (".pt", ".pth")
"""Suffixes of the tensor files ``--video`` reads."""


def _natural_key(path: Path) -> list[Any]:
    """Sort key: digit runs compare as numbers (``f2`` before ``f10``)."""
    return [int(part) if part.isdigit() else part.lower()
            for part in re.split(r"(\d+)", path.name)]


def is_video_path(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a video input: a folder or a tensor file
    (:data:`TENSOR_SUFFIXES`).

    Args:
        path (str or os.PathLike): a path given on the command line.

    Returns:
        bool

    Examples::

        >>> from captum_vit.commands.videos import is_video_path
        >>> is_video_path("clip.pt"), is_video_path("photo.png")
        (True, False)
    """
    p = Path(path)
    return p.is_dir() or p.suffix.lower() in TENSOR_SUFFIXES


def read_frames(folder: str | os.PathLike) -> Tensor:
    r"""The frames of a folder as one video ``[1, T, C, H, W]`` in ``[0, 1]``: its image
    files in natural order of their names (other files are ignored).

    Args:
        folder (str or os.PathLike): the folder.

    Returns:
        Tensor: float32 ``[1, T, C, H, W]`` (``C`` 1 when every frame is grey, else 3).

    Raises:
        FileNotFoundError: no such folder.
        ValueError: no image file in it, or frames of different sizes (the message names
            the first frame of another size).

    Examples::

        >>> import os
        >>> import numpy as np
        >>> from PIL import Image
        >>> from captum_vit.commands.videos import read_frames
        >>> os.makedirs("clip", exist_ok=True)
        >>> for k in range(3):
        ...     Image.fromarray(np.zeros((20, 30, 3), np.uint8)).save(f"clip/frame{k}.png")
        >>> read_frames("clip").shape
        torch.Size([1, 3, 3, 20, 30])
    """
    p = Path(folder)
    if not p.is_dir():
        raise FileNotFoundError(f"--video {p}: no such folder")
    files = sorted((f for f in p.iterdir() if f.is_file() and is_image_file(f)), key=_natural_key)
    if not files:
        raise ValueError(f"--video {p}: the folder has no image file "
                         f"({', '.join(IMAGE_EXTENSIONS)}); put the video's frames there, one "
                         "image per frame, named in order (frame001.png, frame002.png ...)")
    frames = [read_image(f) for f in files]
    size = tuple(frames[0].shape[-2:])
    for f, x in zip(files, frames, strict=True):
        if tuple(x.shape[-2:]) != size:
            raise ValueError(f"--video {p}: frames of different sizes: {f.name} is "
                             f"{tuple(x.shape[-2:])} (H, W) but {files[0].name} is {size}; "
                             "give frames of one size")
    if any(x.shape[0] != frames[0].shape[0] for x in frames):  # grey and colour frames
        frames = [x.expand(3, -1, -1) for x in frames]
    return torch.stack(frames)[None]


def read_video_tensor(path: str | os.PathLike) -> Tensor:
    r"""The videos of a tensor file as ``[B, T, C, H, W]`` in ``[0, 1]``.

    Args:
        path (str or os.PathLike): a ``.pt`` / ``.pth`` file holding one tensor ``[T, C,
            H, W]`` or ``[B, T, C, H, W]`` (frames before channels, 1 or 3 channels;
            floats in ``[0, 1]`` or ``uint8`` in ``[0, 255]``).

    Returns:
        Tensor: float32 ``[B, T, C, H, W]``.

    Raises:
        FileNotFoundError: no such file.
        TypeError: the file does not hold a tensor.
        ValueError: a tensor of another rank, or channels before frames (the message
            says how to permute it).

    Examples::

        >>> from captum_vit.commands.videos import read_video_tensor
        >>> torch.save(torch.rand(8, 3, 32, 32), "clip.pt")
        >>> read_video_tensor("clip.pt").shape
        torch.Size([1, 8, 3, 32, 32])
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--video {p}: no such file")
    try:
        value = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle and zip errors of many kinds: say what the file must be
        raise ValueError(f"--video {p}: not a tensor file torch.load can read ({e})") from e
    if not isinstance(value, Tensor):
        raise TypeError(f"--video {p} holds a {type(value).__name__}; save one tensor "
                        "[T, C, H, W] or [B, T, C, H, W] with torch.save(video, path)")
    x = value.detach()
    if x.dim() == 4:
        x = x[None]
    if x.dim() != 5:
        raise ValueError(f"--video {p} holds a tensor of shape {tuple(value.shape)}; a video "
                         "is [T, C, H, W] and a batch of videos [B, T, C, H, W]")
    if x.shape[2] not in (1, 3):
        hint = ""
        if x.shape[1] in (1, 3):
            order = "[B, C, T, H, W]" if value.dim() == 5 else "[C, T, H, W]"
            perm = "(0, 2, 1, 3, 4)" if value.dim() == 5 else "(1, 0, 2, 3)"
            hint = (f": it looks like {order} (channels before frames); save "
                    f"video.permute{perm}")
        raise ValueError(f"--video {p} holds a tensor of shape {tuple(value.shape)} whose "
                         f"frames have {x.shape[2]} channels, not 1 or 3; frames come before "
                         f"channels, [T, C, H, W] or [B, T, C, H, W]{hint}")
    if not (torch.is_floating_point(x) or x.dtype == torch.uint8):
        raise TypeError(f"--video {p} holds a {x.dtype} tensor; give floats in [0, 1] or "
                        "uint8 in [0, 255]")
    return x.float() / 255.0 if x.dtype == torch.uint8 else x.float()


def read_video(path: str | os.PathLike) -> Tensor:
    r"""A folder of frames (:func:`read_frames`) or a tensor file
    (:func:`read_video_tensor`) as videos ``[B, T, C, H, W]`` in ``[0, 1]``.

    Args:
        path (str or os.PathLike): the folder or the file.

    Returns:
        Tensor: float32 ``[B, T, C, H, W]`` (``B`` 1 for a folder).

    Raises:
        FileNotFoundError: no such folder or file.
        ValueError: anything else :func:`read_frames` or :func:`read_video_tensor`
            refuse, or a file that is neither (the message names both forms).

    Examples::

        >>> from captum_vit.commands.videos import read_video
        >>> torch.save(torch.rand(2, 4, 3, 16, 16), "clips.pt")
        >>> read_video("clips.pt").shape
        torch.Size([2, 4, 3, 16, 16])
    """
    p = Path(path)
    if p.is_dir():
        return read_frames(p)
    if p.suffix.lower() in TENSOR_SUFFIXES:
        return read_video_tensor(p)
    if not p.exists():
        raise FileNotFoundError(f"--video {p}: no such folder or file")
    raise ValueError(f"--video {p}: give a folder of frames (image files) or a tensor file "
                     f"({', '.join(TENSOR_SUFFIXES)}) holding [T, C, H, W] or [B, T, C, H, W]")


def video_inputs(videos: Tensor, adapter: Any, preprocess: Any, source: str
                 ) -> tuple[Tensor, Tensor]:
    r"""Videos ``[B, T, C, H, W]`` in ``[0, 1]`` as a video model's inputs: every frame
    through the model's preprocessing (channels, size, normalisation), then checked
    against what the model takes.

    Args:
        videos (Tensor): ``[B, T, C, H, W]`` (:func:`read_video`).
        adapter (ViTAdapter): the model's adapter.
        preprocess (Callable): one image -> the model's normalised input ``[C, H, W]``
            (:class:`~captum_vit.data.transforms.Preprocess`).
        source (str): what was read, for the messages (e.g. ``"--video clip.pt"``).

    Returns:
        tuple[Tensor, Tensor]: the model's inputs ``[B, T, C', H', W']`` (its dtype) and
        the frames as the model sees them before normalisation, for display.

    Raises:
        ValueError: the model takes images, or a frame count (or anything else) it cannot
            take; the message names the count it expects where the adapter says it.

    Examples::

        >>> import transformers
        >>> from captum_vit.adapters import adapt
        >>> from captum_vit.data.transforms import Preprocess
        >>> from captum_vit.commands.videos import video_inputs
        >>> cfg = transformers.VideoMAEConfig(image_size=16, patch_size=8, num_frames=4,
        ...     tubelet_size=2, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        ...     intermediate_size=64, num_labels=5)
        >>> a = adapt(transformers.VideoMAEForVideoClassification(cfg).eval())
        >>> x, shown = video_inputs(torch.rand(1, 4, 3, 40, 30), a,
        ...                         Preprocess(3, (16, 16), (0.5,), (0.5,)), "a clip")
        >>> x.shape
        torch.Size([1, 4, 3, 16, 16])
    """
    if not getattr(adapter, "video", False):
        raise ValueError(f"{source} is a video, but the model takes images [C, H, W]: pass "
                         "--image FILE, or a video model with --model")
    b, t = videos.shape[:2]
    want = getattr(adapter, "num_frames", None)
    if want is not None and t != int(want):
        raise ValueError(f"{source} has {t} frames but the model takes {int(want)} frames "
                         f"(num_frames={int(want)}); give a video of {int(want)} frames")
    from captum_vit.data.images import conform

    channels, size = adapter.input_shape
    flat = videos.reshape(b * t, *videos.shape[2:])
    x = torch.stack([preprocess(f) for f in flat]).to(adapter.dtype)
    shown = torch.stack([conform(f, channels, size) for f in flat])
    x, shown = x.reshape(b, t, *x.shape[1:]), shown.reshape(b, t, *shown.shape[1:])
    try:
        adapter.check_inputs(x)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{source}: {e}") from e
    return x, shown


__all__ = ["TENSOR_SUFFIXES", "is_video_path", "read_frames", "read_video", "read_video_tensor",
           "video_inputs"]
