"""Data specs: one string names a set of labelled images (and masks) for a model.

* ``fmnist-loc`` — :class:`captum_vit.data.FashionMNISTLoc`, test split, with masks;
* ``sample`` — the 128 FashionMNIST-Loc examples shipped in the package, with masks;
* ``folder:PATH`` — image files under ``PATH``; a file's class is the name of its
  sub-folder of ``PATH`` (``PATH/dress/001.png``), matched to the model's class names
  (:func:`match_class_names`); no masks;
* ``synthetic`` — images with a brighter random rectangle and its mask, drawn from the
  seed and the example index; no download (tests, demos).

Labels are always indices of the **model's** classes: a data set's own class names are
matched by name to the model's (``fmnist-loc`` and ``sample`` name Fashion-MNIST's
classes; a folder names its sub-folders). When the model's class names are unknown
the labels are unknown (``-1``) and asking for them (``need_labels=True``, i.e.
``--target label``) is an error that says to pass ``--classes FILE``. ``synthetic`` labels
are model class indices by construction.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from captum_vit.data.images import conform, conform_mask, is_image_file, read_image

SPEC_HELP = "fmnist-loc | sample | folder:PATH | synthetic"
"""One-line summary of the data specs (command-line help)."""


class Example(NamedTuple):
    """One example: an image ``[C, H, W]``, its label (model class index, ``-1`` when
    unknown) and its ground-truth mask ``[H, W]`` (or ``None``)."""

    image: Tensor
    label: int
    mask: Tensor | None


def class_key(name: str) -> str:
    """The matching key of a class name: lower case, letters and digits only.

    Examples::

        >>> from captum_vit.data.specs import class_key
        >>> class_key("T-shirt/top") == class_key("t-shirt_top") == "tshirttop"
        True
    """
    return re.sub(r"[^0-9a-z]", "", str(name).lower())


def match_class_names(names: Sequence[str], class_names: Sequence[str], *,
                      what: str = "class", strict: bool = True) -> list[int]:
    r"""The index in ``class_names`` of each of ``names``, matched case-insensitively and
    ignoring everything but letters and digits (:func:`class_key`).

    Args:
        names (Sequence[str]): the data set's class names (e.g. folder names).
        class_names (Sequence[str]): the model's class names.
        what (str, optional): what a name is, for the error message. Default ``"class"``.
        strict (bool, optional): raise for a name that matches no class; otherwise its
            index is ``-1``. Default True.

    Returns:
        list[int]: one index per name (the first matching class).

    Raises:
        ValueError: (``strict``) naming the unmatched names and the known classes.

    Examples::

        >>> from captum_vit.data.specs import match_class_names
        >>> match_class_names(["t-shirt_top", "DRESS"], ["T-shirt/top", "Trouser", "Dress"])
        [0, 2]
    """
    keys: dict[str, int] = {}
    for i, c in enumerate(class_names):
        keys.setdefault(class_key(c), i)
    idx = [keys.get(class_key(n), -1) for n in names]
    missing = [n for n, i in zip(names, idx, strict=True) if i < 0]
    if strict and missing:
        raise ValueError(
            f"{what} {', '.join(map(repr, missing))} matches no class of the model (names are "
            "compared ignoring case and non-alphanumerics); known classes: "
            f"{', '.join(class_names)}")
    return idx


class SyntheticLoc:
    """Seeded images ``[C, H, W]`` with a brighter random rectangle and its mask.

    Example ``i`` depends only on ``seed`` and ``i``; its label is ``i % num_classes``.

    Args:
        n (int): number of examples.
        channels (int): image channels.
        size (tuple[int, int]): ``(H, W)``.
        num_classes (int): labels cycle through ``0 .. num_classes - 1``.
        seed (int): base seed.

    Examples::

        >>> from captum_vit.data.specs import SyntheticLoc
        >>> img, label, mask = SyntheticLoc(4, 3, (32, 32), 10, seed=0)[2]
        >>> img.shape, label, mask.shape
        (torch.Size([3, 32, 32]), 2, torch.Size([32, 32]))
    """

    def __init__(self, n: int, channels: int, size: tuple[int, int], num_classes: int,
                 seed: int) -> None:
        self.n, self.c, self.size, self.k, self.seed = n, channels, size, num_classes, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Tensor, int, Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(f"index {i} out of range for {self.n} examples")
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        h, w = self.size
        img = 0.3 * torch.randn(self.c, h, w, generator=g, dtype=torch.float64)
        bh = int(torch.randint(h // 4, h // 2 + 1, (1,), generator=g))
        bw = int(torch.randint(w // 4, w // 2 + 1, (1,), generator=g))
        y = int(torch.randint(0, h - bh + 1, (1,), generator=g))
        x = int(torch.randint(0, w - bw + 1, (1,), generator=g))
        mask = torch.zeros(h, w, dtype=torch.bool)
        mask[y:y + bh, x:x + bw] = True
        img[:, mask] += 1.0
        return img.float(), i % self.k, mask


class FolderImages:
    """Image files under a folder (searched recursively, in sorted path order).

    A file's class folder is the first path component below ``root``
    (``root/dress/a.png`` and ``root/dress/more/b.png`` are both ``"dress"``); files
    directly in ``root`` have none. Items are ``(image, class folder index, None)``
    with index ``-1`` for no class folder; :attr:`classes` lists the folders.

    Args:
        root (str or os.PathLike): the folder.

    Raises:
        FileNotFoundError: if ``root`` is not a folder.

    Examples::

        >>> from captum_vit.data.specs import FolderImages
        >>> ds = FolderImages("photos")
        >>> ds.classes, len(ds)
        (('cat', 'dog'), 120)
    """

    def __init__(self, root: str | os.PathLike) -> None:
        r = Path(root)
        if not r.is_dir():
            raise FileNotFoundError(f"--data folder:{root}: no such folder")
        self.root = r
        self.files = sorted(p for p in r.rglob("*") if p.is_file() and is_image_file(p))
        folders = [p.relative_to(r).parts[0] if len(p.relative_to(r).parts) > 1 else None
                   for p in self.files]
        self.classes: tuple[str, ...] = tuple(sorted({f for f in folders if f is not None}))
        index = {c: i for i, c in enumerate(self.classes)}
        self.folder_index = [index[f] if f is not None else -1 for f in folders]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[Tensor, int, None]:
        return read_image(self.files[i]), self.folder_index[i], None


class _Sample:
    """The shipped sample as a sequence of ``(image, label, mask)``."""

    def __init__(self) -> None:
        from captum_vit.data.sample import load_sample

        self.s = load_sample()

    def __len__(self) -> int:
        return len(self.s["labels"])

    def __getitem__(self, i: int) -> tuple[Tensor, int, Tensor]:
        return self.s["images"][i], int(self.s["labels"][i]), self.s["masks"][i]


class Examples:
    """The first ``n`` items of a data set as :class:`Example` s, labels mapped to the
    model's classes (what :func:`load_data` returns).

    Args:
        source (Sequence): items ``(image, label, mask)``, ``(image, label)`` or dicts
            with ``image``, ``label`` and ``mask``.
        n (int, optional): keep the first ``n`` items. Default None (all).
        label_map (Sequence[int], optional): model class of each source label
            (``-1`` unknown); ``None`` keeps the source labels.

    Examples::

        >>> ex = Examples(SyntheticLoc(4, 3, (32, 32), 10, seed=0))
        >>> ex[0].label, ex.has_masks
        (0, True)
    """

    def __init__(self, source: Sequence[Any], n: int | None = None,
                 label_map: Sequence[int] | None = None) -> None:
        self.source = source
        self.n = len(source) if n is None else min(int(n), len(source))
        self.label_map = None if label_map is None else list(label_map)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Example:
        if not 0 <= i < self.n:
            raise IndexError(f"index {i} out of range for {self.n} examples")
        raw = self.source[i]
        if isinstance(raw, dict):
            img, label, mask = raw["image"], raw.get("label", -1), raw.get("mask")
        else:
            img, label = raw[0], raw[1]
            mask = raw[2] if len(raw) > 2 else None
        label = int(label)
        if self.label_map is not None:
            label = self.label_map[label] if 0 <= label < len(self.label_map) else -1
        return Example(torch.as_tensor(img), label,
                       None if mask is None else torch.as_tensor(mask))

    @property
    def has_masks(self) -> bool:
        """Whether the examples have ground-truth masks (judged by the first one)."""
        return self.n > 0 and self[0].mask is not None


def load_data(spec: str, *, n: int, input_shape: tuple[int, tuple[int, int]],
              num_classes: int, class_names: Sequence[str] | None = None, seed: int = 0,
              need_labels: bool = False) -> Examples:
    r"""The first ``n`` examples of the data named by ``spec`` (see the module docstring).

    Args:
        spec (str): ``fmnist-loc``, ``sample``, ``folder:PATH`` or ``synthetic``.
        n (int): number of examples (fewer when the data set is smaller).
        input_shape (tuple): the model's ``(channels, (H, W))`` (``synthetic`` is drawn
            at this shape; others are converted by :func:`model_batch`).
        num_classes (int): the model's number of classes.
        class_names (Sequence[str], optional): the model's class names (to match the
            data set's labels to); ``None`` = unknown.
        seed (int, optional): seed of ``fmnist-loc`` and ``synthetic``. Default 0.
        need_labels (bool, optional): labels will be used (``--target label``): every
            example must have a label of the model's classes, checked here before any
            work. Default False.

    Returns:
        Examples: a sequence of :class:`Example`, with ``has_masks``.

    Raises:
        ValueError: unknown spec; an empty data set; with ``need_labels``, class names
            that match none of the model's, files without a class folder, or unknown
            model class names (pass ``--classes FILE`` or use ``--target predicted``).
        FileNotFoundError: a missing folder or data set.

    Examples::

        >>> from captum_vit.data.specs import load_data
        >>> data = load_data("folder:photos", n=100, input_shape=(3, (224, 224)),
        ...                  num_classes=3, class_names=["cat", "dog", "bird"],
        ...                  need_labels=True)
        >>> image, label, mask = data[0]
    """
    channels, size = input_shape
    kind, _, arg = spec.partition(":")
    names: Sequence[str] | None
    if spec == "synthetic":
        source: Sequence[Any] = SyntheticLoc(n, channels, tuple(size), num_classes, seed)
        names = None
    elif spec == "fmnist-loc":
        from captum_vit.data.fashion_mnist import CLASS_NAMES
        from captum_vit.data.loc import FashionMNISTLoc

        source, names = FashionMNISTLoc(split="test", seed=seed), CLASS_NAMES
    elif spec == "sample":
        from captum_vit.data.fashion_mnist import CLASS_NAMES

        source, names = _Sample(), CLASS_NAMES
    elif kind == "folder" and arg:
        source = FolderImages(arg)
        names = source.classes
    else:
        raise ValueError(f"unknown data {spec!r}; use {SPEC_HELP}")
    data = Examples(source, n, _label_map(spec, source, names, class_names, need_labels))
    if len(data) == 0:
        raise ValueError(f"the dataset {spec!r} is empty; nothing to evaluate")
    return data


def _label_map(spec: str, source: Any, names: Sequence[str] | None,
               class_names: Sequence[str] | None, need_labels: bool) -> list[int] | None:
    if names is None:
        return None
    if need_labels:
        if isinstance(source, FolderImages) and -1 in source.folder_index:
            loose = source.files[source.folder_index.index(-1)]
            raise ValueError(f"--data {spec}: {loose} is not in a class sub-folder, so it has "
                             "no label; put every image in a folder named after its class or "
                             "use --target predicted")
        if class_names is None:
            raise ValueError(
                f"labels are needed (--target label) but the model's class names are unknown, "
                f"so the labels of --data {spec} cannot be matched to its classes; pass "
                "--classes FILE (one class name per line, in the model's class order) or use "
                "--target predicted")
    if class_names is None:
        return [-1] * len(names)
    what = "class folder" if isinstance(source, FolderImages) else f"--data {spec} class"
    return match_class_names(names, class_names, what=what, strict=need_labels)


def model_batch(data: Sequence[Any], indices: Sequence[int], *,
                input_shape: tuple[int, tuple[int, int]],
                preprocess: Callable[[Tensor], Tensor] | None = None,
                device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                ) -> tuple[Tensor, Tensor, Tensor | None]:
    r"""A batch for the model: images converted to its input shape and preprocessed,
    labels and masks.

    Images get the model's channels and size (:func:`captum_vit.data.images.conform`:
    luminance / repetition, bilinear antialiased resize), then ``preprocess``; masks are
    resized by nearest neighbour.

    Args:
        data (Sequence): :class:`Example` s (or ``(image, label, mask)`` items).
        indices (Sequence[int]): which examples.
        input_shape (tuple): the model's ``(channels, (H, W))``.
        preprocess (Callable, optional): applied to each converted image (normalisation).
        device (torch.device or str, optional): device of the batch. Default ``"cpu"``.
        dtype (torch.dtype, optional): dtype of the images. Default float32.

    Returns:
        tuple: images ``[B, C, H, W]``, labels ``[B]`` (int64, ``-1`` unknown) and masks
        ``[B, H, W]`` (bool), or ``None`` when an example has no mask.

    Examples::

        >>> from captum_vit.data.specs import load_data, model_batch
        >>> data = load_data("sample", n=8, input_shape=(1, (56, 56)), num_classes=10)
        >>> x, labels, masks = model_batch(data, range(4), input_shape=(1, (56, 56)))
        >>> x.shape, masks.shape
        (torch.Size([4, 1, 56, 56]), torch.Size([4, 56, 56]))
    """
    channels, size = input_shape
    imgs, labels, masks = [], [], []
    for i in indices:
        raw = data[i]
        img, label = raw[0], int(raw[1])
        mask = raw[2] if len(raw) > 2 else None
        img = conform(img, channels, size)
        imgs.append(preprocess(img) if preprocess is not None else img)
        labels.append(label)
        masks.append(None if mask is None else conform_mask(mask, size))
    x = torch.stack(imgs).to(device=device, dtype=dtype)
    m = None if any(k is None for k in masks) else torch.stack(masks).to(device)
    return x, torch.tensor(labels, dtype=torch.long, device=device), m


__all__ = ["Example", "Examples", "FolderImages", "SPEC_HELP", "SyntheticLoc", "class_key",
           "load_data", "match_class_names", "model_batch"]
