r"""FashionMNIST-Loc: a deterministic localisation dataset built from Fashion-MNIST.

Generation recipe (one example, defaults in brackets)
-----------------------------------------------------

Every example ``i`` of a split is built from Fashion-MNIST image ``i`` of the same
official split (``"train"`` or ``"test"``) with its own random generator
``numpy.random.default_rng([seed, split_id, i])`` (``split_id`` 0 for train, 1 for
test), or ``default_rng([seed, split_id, i, epoch])`` when an ``epoch`` is given (a
fresh placement per training epoch). Item ``i`` therefore never depends on which
other items were built or in which order. Draws, in this order:

1. **Garment position**: top-left corner ``(y0, x0)`` uniform in
   ``0 .. canvas_size - 28`` (each axis independently).
2. **Clutter** (``n_clutter`` [2] pieces): for each piece, a source image drawn
   uniformly from the same split among images whose label differs from the
   example's label (redrawn until it does), a square side ``s`` uniform in
   ``clutter_size`` [8..12] (inclusive), a crop corner uniform in ``2 .. 26 - s`` of the
   source image (so the crop comes from the garment-rich centre), and a paste
   corner uniform in ``0 .. canvas_size - s``.

Composition on a black ``canvas_size`` x ``canvas_size`` [56 x 56] uint8 canvas:

- clutter pieces are scaled to ``round(pixel * clutter_intensity)`` [0.35] and
  combined by pixel-wise maximum;
- the garment is pasted on top: wherever the garment pixel is nonzero the canvas
  takes exactly the garment value (so ``image[mask] == garment[garment > 0]``);
  elsewhere the clutter stays visible.

Ground truth:

- ``mask``: bool ``[H, W]``, true at the garment's nonzero pixels (pasted position);
- ``box``: int64 ``(x0, y0, x1, y1)``, the tight half-open box of the mask, i.e.
  ``mask[y0:y1, x0:x1]`` holds every true pixel and each border row/column of the
  box holds at least one.

With the default 56 x 56 canvas the 28 x 28 garment covers at most 784 / 3136 = 25 %
of the canvas (always less than a third), and a ViT with patch size 7 sees an 8 x 8
grid.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from captum_vit.data.fashion_mnist import CLASS_NAMES, load_fashion_mnist

__all__ = ["FashionMNISTLoc", "build_arrays", "make_batch", "mask_to_box", "center_on_canvas"]

_SPLIT_ID = {"train": 0, "test": 1}
_GARMENT = 28


def _check_params(canvas_size: int, n_clutter: int, clutter_size: Sequence[int],
                  clutter_intensity: float) -> tuple[int, int]:
    if not isinstance(canvas_size, int) or canvas_size < _GARMENT:
        raise ValueError(f"canvas_size must be an int >= 28, got {canvas_size!r}.")
    if _GARMENT * _GARMENT * 3 >= canvas_size * canvas_size:
        raise ValueError(
            f"canvas_size={canvas_size} lets the 28x28 garment cover a third of the canvas or "
            "more; use canvas_size >= 49."
        )
    if not isinstance(n_clutter, int) or n_clutter < 0:
        raise ValueError(f"n_clutter must be a non-negative int, got {n_clutter!r}.")
    if len(clutter_size) != 2:
        raise ValueError(f"clutter_size must be a (min, max) pair, got {clutter_size!r}.")
    smin, smax = int(clutter_size[0]), int(clutter_size[1])
    if not 1 <= smin <= smax <= 24:
        raise ValueError(f"clutter_size must satisfy 1 <= min <= max <= 24, got {clutter_size!r}.")
    if not 0.0 <= clutter_intensity <= 1.0:
        raise ValueError(f"clutter_intensity must lie in [0, 1], got {clutter_intensity!r}.")
    return smin, smax


def mask_to_box(mask: torch.Tensor | np.ndarray) -> torch.Tensor:
    r"""
    Tight half-open bounding box of a boolean mask.

    Args:

        mask (torch.Tensor or numpy.ndarray): Boolean ``[H, W]`` or ``[B, H, W]``.

    Returns:
        *torch.Tensor* of **box**: int64 ``[4]`` (or ``[B, 4]``) holding
        ``(x0, y0, x1, y1)`` with ``mask[y0:y1, x0:x1]`` containing every true pixel;
        all zeros for an empty mask.

    Examples::

        >>> m = torch.zeros(5, 5, dtype=torch.bool); m[1:3, 2:4] = True
        >>> mask_to_box(m)
        tensor([2, 1, 4, 3])
    """
    m = torch.as_tensor(np.asarray(mask) if isinstance(mask, np.ndarray) else mask).bool()
    single = m.dim() == 2
    if single:
        m = m[None]
    if m.dim() != 3:
        raise ValueError(f"mask must be [H, W] or [B, H, W], got shape {tuple(m.shape)}.")
    rows, cols = m.any(2), m.any(1)
    h, w = m.shape[1:]
    ar_h, ar_w = torch.arange(h), torch.arange(w)
    big = max(h, w) + 1
    y0 = torch.where(rows, ar_h, big).min(1).values
    y1 = torch.where(rows, ar_h, -1).max(1).values + 1
    x0 = torch.where(cols, ar_w, big).min(1).values
    x1 = torch.where(cols, ar_w, -1).max(1).values + 1
    box = torch.stack([x0, y0, x1, y1], 1)
    box[~rows.any(1)] = 0
    return box[0] if single else box


def _example_rng(seed: int, split_id: int, index: int, epoch: int | None) -> np.random.Generator:
    key = [int(seed), split_id, int(index)] if epoch is None else [
        int(seed), split_id, int(index), int(epoch)]
    return np.random.default_rng(key)


def build_arrays(
    images: torch.Tensor | np.ndarray,
    labels: torch.Tensor | np.ndarray,
    indices: Sequence[int] | np.ndarray | torch.Tensor | None = None,
    *,
    split: str = "train",
    seed: int = 0,
    epoch: int | None = None,
    canvas_size: int = 56,
    n_clutter: int = 2,
    clutter_size: Sequence[int] = (8, 12),
    clutter_intensity: float = 0.35,
) -> dict[str, torch.Tensor]:
    r"""
    Builds FashionMNIST-Loc examples for the given source indices (batched builder).

    The recipe is documented in :mod:`captum_vit.data.loc`. Example ``indices[k]``
    is identical to ``FashionMNISTLoc(split, seed)[indices[k]]`` whenever the
    parameters agree, whatever the other indices are.

    Args:

        images (torch.Tensor or numpy.ndarray): uint8 ``[N, 28, 28]``, a whole official
                    split as returned by :func:`load_fashion_mnist` (clutter is cut
                    from it too).
        labels (torch.Tensor or numpy.ndarray): int ``[N]`` labels of ``images``.
        indices (sequence of int, optional): Which source images to build.
                    Default: None (all ``N``).
        split (str, optional): ``"train"`` or ``"test"``; part of the random key.
                    Default: ``"train"``
        seed (int, optional): Dataset seed. Default: 0
        epoch (int, optional): If given, part of the random key, giving a fresh
                    placement per training epoch. Default: None
        canvas_size (int, optional): Canvas side in pixels. Default: 56
        n_clutter (int, optional): Number of clutter pieces. Default: 2
        clutter_size (tuple of int, optional): Inclusive ``(min, max)`` side of the
                    square clutter crops. Default: ``(8, 12)``
        clutter_intensity (float, optional): Clutter brightness factor in ``[0, 1]``.
                    Default: 0.35

    Returns:
        *dict* with
        - **images** (*torch.Tensor*): uint8 ``[B, canvas_size, canvas_size]``;
        - **labels** (*torch.Tensor*): int64 ``[B]``;
        - **masks** (*torch.Tensor*): bool ``[B, canvas_size, canvas_size]``;
        - **boxes** (*torch.Tensor*): int64 ``[B, 4]`` ``(x0, y0, x1, y1)``, half-open;
        - **indices** (*torch.Tensor*): int64 ``[B]`` source indices.

    Examples::

        >>> imgs, labs = load_fashion_mnist("test")
        >>> batch = build_arrays(imgs, labs, range(8), split="test")
        >>> batch["images"].shape
        torch.Size([8, 56, 56])
    """
    if split not in _SPLIT_ID:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}.")
    smin, smax = _check_params(canvas_size, n_clutter, clutter_size, clutter_intensity)
    src = np.asarray(images, dtype=np.uint8)
    lab = np.asarray(labels, dtype=np.int64)
    if src.ndim != 3 or src.shape[1:] != (_GARMENT, _GARMENT):
        raise ValueError(f"images must be uint8 [N, 28, 28], got shape {src.shape}.")
    if lab.shape != (src.shape[0],):
        raise ValueError(f"labels must have shape [{src.shape[0]}], got {lab.shape}.")
    n_src = src.shape[0]
    idx = np.arange(n_src) if indices is None else np.asarray(indices, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= n_src):
        raise ValueError(f"indices must lie in [0, {n_src}), got range [{idx.min()}, {idx.max()}].")
    if n_clutter and np.all(lab == lab[0]):
        raise ValueError("clutter needs at least two classes in labels; set n_clutter=0.")
    split_id = _SPLIT_ID[split]
    b, c = idx.size, canvas_size
    out = np.zeros((b, c, c), dtype=np.uint8)
    masks = np.zeros((b, c, c), dtype=bool)
    span = c - _GARMENT + 1
    for k, i in enumerate(idx):
        rng = _example_rng(seed, split_id, int(i), epoch)
        y0, x0 = rng.integers(0, span, size=2)
        canvas = out[k]
        label = lab[i]
        for _ in range(n_clutter):
            j = int(rng.integers(0, n_src))
            while lab[j] == label:
                j = int(rng.integers(0, n_src))
            s = int(rng.integers(smin, smax + 1))
            cy, cx = rng.integers(2, _GARMENT - 2 - s + 1, size=2) if s <= 22 else (0, 0)
            py, px = rng.integers(0, c - s + 1, size=2)
            piece = np.rint(src[j, cy:cy + s, cx:cx + s] * clutter_intensity).astype(np.uint8)
            region = canvas[py:py + s, px:px + s]
            np.maximum(region, piece, out=region)
        g = src[i]
        gm = g > 0
        canvas[y0:y0 + _GARMENT, x0:x0 + _GARMENT][gm] = g[gm]
        masks[k, y0:y0 + _GARMENT, x0:x0 + _GARMENT] = gm
    masks_t = torch.from_numpy(masks)
    return {
        "images": torch.from_numpy(out),
        "labels": torch.from_numpy(lab[idx].copy()),
        "masks": masks_t,
        "boxes": mask_to_box(masks_t) if b else torch.zeros(0, 4, dtype=torch.int64),
        "indices": torch.from_numpy(idx.copy()),
    }


def make_batch(
    images: torch.Tensor | np.ndarray,
    labels: torch.Tensor | np.ndarray,
    indices: Sequence[int] | np.ndarray | torch.Tensor,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""
    Training-ready batch: float images in ``[0, 1]`` and labels.

    Args:

        images (torch.Tensor or numpy.ndarray): Source split, uint8 ``[N, 28, 28]``.
        labels (torch.Tensor or numpy.ndarray): Its labels ``[N]``.
        indices (sequence of int): Source indices of the batch.
        **kwargs: Passed to :func:`build_arrays` (``split``, ``seed``, ``epoch``, ...).

    Returns:
        2-element tuple of **x** (*torch.Tensor*, float32 ``[B, 1, H, W]`` in
        ``[0, 1]``) and **y** (*torch.Tensor*, int64 ``[B]``).

    Examples::

        >>> x, y = make_batch(imgs, labs, [0, 1, 2], split="train", seed=0, epoch=3)
        >>> x.shape
        torch.Size([3, 1, 56, 56])
    """
    arrays = build_arrays(images, labels, indices, **kwargs)
    return arrays["images"][:, None].float().div_(255.0), arrays["labels"]


def center_on_canvas(images: torch.Tensor, canvas_size: int = 56) -> torch.Tensor:
    r"""
    Places 28 x 28 garments at the centre of an empty canvas ("plain" Fashion-MNIST
    at the FashionMNIST-Loc resolution).

    Args:

        images (torch.Tensor): uint8 or float ``[N, 28, 28]``.
        canvas_size (int, optional): Canvas side. Default: 56

    Returns:
        *torch.Tensor* of **canvases**, same dtype, ``[N, canvas_size, canvas_size]``.

    Examples::

        >>> center_on_canvas(torch.zeros(2, 28, 28, dtype=torch.uint8)).shape
        torch.Size([2, 56, 56])
    """
    if images.dim() != 3 or tuple(images.shape[1:]) != (_GARMENT, _GARMENT):
        raise ValueError(f"images must be [N, 28, 28], got shape {tuple(images.shape)}.")
    if canvas_size < _GARMENT:
        raise ValueError(f"canvas_size must be >= 28, got {canvas_size}.")
    out = images.new_zeros(images.shape[0], canvas_size, canvas_size)
    o = (canvas_size - _GARMENT) // 2
    out[:, o:o + _GARMENT, o:o + _GARMENT] = images
    return out


class FashionMNISTLoc(Dataset):
    r"""
    FashionMNIST-Loc: a labelled garment at a random position among clutter, with its
    pixel mask and bounding box (recipe in :mod:`captum_vit.data.loc`).

    Each item is a dict with

    - ``"image"``: float32 ``[1, H, W]`` in ``[0, 1]``;
    - ``"label"``: int64 scalar tensor (class names in :data:`CLASS_NAMES`);
    - ``"mask"``: bool ``[H, W]``, the garment's nonzero pixels;
    - ``"box"``: int64 ``[4]`` tight half-open ``(x0, y0, x1, y1)``;
    - ``"index"``: int, the source Fashion-MNIST index.

    Items are generated on access from ``(seed, split, index)`` and are the same in
    any access order; the default collate function stacks them into batches.

    Args:

        split (str, optional): ``"train"`` (60 000 examples) or ``"test"`` (10 000),
                    built from the official Fashion-MNIST splits.
                    Default: ``"test"``
        seed (int, optional): Dataset seed. Default: 0
        root (str or os.PathLike, optional): Fashion-MNIST directory, see
                    :func:`load_fashion_mnist`. Default: None
        n (int, optional): Keep only the first ``n`` examples. Default: None (all)
        epoch (int, optional): Fresh placements for a training epoch (part of the
                    random key). Default: None
        canvas_size, n_clutter, clutter_size, clutter_intensity: see
                    :func:`build_arrays`.

    Examples::

        >>> ds = FashionMNISTLoc("test", seed=0, n=100)
        >>> item = ds[0]
        >>> item["image"].shape, item["mask"].shape, item["box"]
        (torch.Size([1, 56, 56]), torch.Size([56, 56]), tensor([...]))
    """

    class_names = CLASS_NAMES

    def __init__(
        self,
        split: str = "test",
        seed: int = 0,
        root: str | os.PathLike | None = None,
        n: int | None = None,
        *,
        epoch: int | None = None,
        canvas_size: int = 56,
        n_clutter: int = 2,
        clutter_size: Sequence[int] = (8, 12),
        clutter_intensity: float = 0.35,
    ) -> None:
        if split not in _SPLIT_ID:
            raise ValueError(f"split must be 'train' or 'test', got {split!r}.")
        _check_params(canvas_size, n_clutter, clutter_size, clutter_intensity)
        self.split, self.seed, self.epoch = split, int(seed), epoch
        self.images, self.labels = load_fashion_mnist(split, root)
        total = self.images.shape[0]
        if n is not None and (not isinstance(n, int) or not 0 < n <= total):
            raise ValueError(f"n must be an int in [1, {total}] or None, got {n!r}.")
        self.n = total if n is None else n
        self.kwargs: dict[str, Any] = dict(
            split=split, seed=self.seed, epoch=epoch, canvas_size=canvas_size,
            n_clutter=n_clutter, clutter_size=tuple(clutter_size),
            clutter_intensity=clutter_intensity,
        )

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        if index < 0:
            index += self.n
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} out of range for {self.n} examples.")
        a = build_arrays(self.images, self.labels, [index], **self.kwargs)
        return {
            "image": a["images"][0, None].float().div_(255.0),
            "label": a["labels"][0],
            "mask": a["masks"][0],
            "box": a["boxes"][0],
            "index": index,
        }

    def arrays(self, indices: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
        r"""
        All (or some) examples at once, as :func:`build_arrays` returns them.

        Args:

            indices (sequence of int, optional): Which examples. Default: None
                        (the first ``n``).

        Returns:
            *dict* of uint8 ``images``, ``labels``, ``masks``, ``boxes``, ``indices``.

        Examples::

            >>> FashionMNISTLoc("test", n=10).arrays()["images"].shape
            torch.Size([10, 56, 56])
        """
        if indices is None:
            indices = range(self.n)
        return build_arrays(self.images, self.labels, list(indices), **self.kwargs)
