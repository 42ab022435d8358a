r"""ImageNet-Segmentation (Guillaumin et al. 2014): ``gtsegs_ijcv.mat``, the 4,276 images
and foreground masks of Chefer et al.'s segmentation test (CVPR 2021).

The file is MATLAB v7.3, i.e. HDF5, read with ``h5py`` (extra ``data``:
``pip install 'captum_vit[data]'``). Layout: ``f["/value/img"]`` is an ``[n, 1]`` array of
object references; ``f[f["/value/img"][i, 0]]`` is uint8 stored ``(3, W, H)`` (transposed
to ``H x W x 3``); ``f["/value/gt"][i, 0]`` references a cell whose ``[0, 0]`` entry
references the mask, stored ``(W, H)`` (transposed to ``H x W``, 1 = foreground). There
are no class labels: the predicted class is explained.

The images and masks come back at their own size; the papers' resizing is
:func:`captum_vit.data.transforms.seed_transforms` (``Resize((224, 224))`` bilinear, no
crop, ``Normalize(0.5, 0.5)``, masks nearest).
"""

from __future__ import annotations

import os
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from captum_vit.data.transforms import require

WHAT = ("gtsegs_ijcv.mat, the ImageNet-Segmentation file of Guillaumin et al. (MATLAB v7.3 / "
        "HDF5; e.g. from the links in Chefer et al.'s Transformer-Explainability README)")


def _h5py() -> Any:
    try:
        import h5py
    except ImportError as e:
        raise ImportError("reading gtsegs_ijcv.mat (MATLAB v7.3 = HDF5) needs h5py: "
                          "pip install 'captum_vit[data]'") from e
    return h5py


class ImageNetSegmentation(Dataset):
    r"""The images and foreground masks of ``gtsegs_ijcv.mat``.

    Items are ``(image, -1, mask)``: float32 ``[3, H, W]`` in ``[0, 1]`` (the stored
    uint8 divided by 255), label ``-1`` (none: explain the predicted class) and a bool
    ``[H, W]`` foreground mask. The file is opened on first access (once per process, so
    the dataset works in ``DataLoader`` workers).

    Args:
        path (str or os.PathLike): the ``gtsegs_ijcv.mat`` file.

    Raises:
        FileNotFoundError: ``path`` is missing (the message says what to put there).
        ImportError: ``h5py`` is not installed.
        ValueError: the file is not HDF5 or lacks ``/value/img`` and ``/value/gt`` as
            ``[n, 1]`` reference arrays of equal length.

    Examples::

        >>> from captum_vit.data import ImageNetSegmentation
        >>> ds = ImageNetSegmentation("gtsegs_ijcv.mat")
        >>> image, label, mask = ds[0]
        >>> len(ds), image.shape[0], label, mask.dtype
        (4276, 3, -1, torch.bool)
    """

    classes: tuple[str, ...] | None = None
    """No class names: the labels are unknown (``-1``)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = require(path, "--data imagenet-seg:PATH", WHAT)
        h5py = _h5py()
        try:
            f = h5py.File(self.path, "r")
        except OSError as e:
            raise ValueError(f"--data imagenet-seg:{self.path} is not an HDF5 file (MATLAB "
                             f"v7.3); give {WHAT}") from e
        with f:
            shapes = {k: f[k].shape if k in f and isinstance(f[k], h5py.Dataset) else None
                      for k in ("/value/img", "/value/gt")}
            bad = [k for k, s in shapes.items() if s is None or len(s) != 2 or s[1] != 1
                   or f[k].dtype != h5py.ref_dtype]
            if bad or shapes["/value/img"] != shapes["/value/gt"]:
                where = ", ".join(bad) or "img and gt"
                raise ValueError(
                    f"--data imagenet-seg:{self.path}: wrong layout ({where}"
                    " missing or not an [n, 1] array of object references of equal length); "
                    f"give {WHAT}")
            self.n = int(cast(tuple[int, ...], shapes["/value/img"])[0])  # checked above
        self._file: Any = None

    def __len__(self) -> int:
        return self.n

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_file": None}  # h5py handles do not pickle

    def __getitem__(self, i: int) -> tuple[Tensor, int, Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(f"index {i} out of range for {self.n} images")
        if self._file is None:
            self._file = _h5py().File(self.path, "r")
        f = self._file
        img = np.asarray(f[f["/value/img"][i, 0]])
        img = img.T[..., None].repeat(3, 2) if img.ndim == 2 else img.transpose(2, 1, 0)  # grey
        gt = np.asarray(f[f[f["/value/gt"][i, 0]][0, 0]]).transpose(1, 0)
        image = torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1).float() / 255.0
        return image, -1, torch.from_numpy(np.ascontiguousarray(gt)) > 0


__all__ = ["ImageNetSegmentation"]
