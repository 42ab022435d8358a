"""Data specs: one string names a set of labelled images (and masks) for a model.

* ``fmnist-loc`` — :class:`captum_vit.data.FashionMNISTLoc`, test split, with masks;
* ``sample`` — the 128 FashionMNIST-Loc examples shipped in the package, with masks;
* ``folder:PATH`` — image files under ``PATH``; a file's class is the name of its
  sub-folder of ``PATH`` (``PATH/dress/001.png``), matched to the model's class names
  (:func:`match_class_names`); no masks;
* ``synthetic`` — images with a brighter random rectangle and its mask, drawn from the
  seed and the example index; no download (tests, demos);
* ``imagenet-seg:PATH`` — :class:`~captum_vit.data.imagenet_seg.ImageNetSegmentation`,
  ``PATH`` = ``gtsegs_ijcv.mat`` (extra ``data``: h5py); foreground masks, no labels;
* ``imagenet-val:PATH`` — :class:`~captum_vit.data.imagenet.ImageNetVal`: ``PATH`` holds
  ``ILSVRC2012_val_*.JPEG`` (devkit beside it) or class folders ``<WNID>/*.JPEG``; box
  masks from ``.xml`` annotations beside the images, if any;
* ``cifar10:PATH`` / ``cifar100:PATH`` — :class:`~captum_vit.data.cifar.CIFAR10` /
  :class:`~captum_vit.data.cifar.CIFAR100`, test split, ``PATH`` = ``cifar-10-batches-py``
  / ``cifar-100-python`` (python version) or the folder holding it; no masks;
* ``imagenet-s:PATH`` — :class:`~captum_vit.data.imagenet_s.ImageNetS`: ``PATH`` =
  ``ImageNetS919`` (``validation/``, ``validation-segmentation/``, category list); the
  mask of each image's main class.

Nothing is downloaded: a missing path raises ``FileNotFoundError`` saying what to put where.

Labels are always indices of the **model's** classes, matched by name: an explicit
``class_map`` (``{data class name: model index}``, ``--class-map FILE``) wins; otherwise a
data set's own class names are matched by name to the model's (``fmnist-loc`` and
``sample`` name Fashion-MNIST's classes, a folder its sub-folders, CIFAR its meta file),
each to exactly one model class (:func:`match_class_names`); WNIDs (ImageNet data, folders
named ``n01440764``) are matched through the model's WNIDs
(:func:`captum_vit.data.imagenet.model_wnids`: timm / Hugging Face ImageNet heads). When the
model's class names are unknown the labels are unknown (``-1``) and asking for them
(``need_labels=True``, i.e. ``--target label``) is an error that says to pass
``--classes FILE``. ``synthetic`` labels are model class indices by construction.

``subset=N`` (``--subset N --subset-seed S``) draws a seeded random subset of N examples
(:func:`subset_indices`); :attr:`Examples.indices` records which.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol, cast

import torch
from torch import Tensor

from captum_vit.data.classes import (
    WNID,
    class_key,
    match_class_names,
    model_wnids,
    wnid_descriptions,
)
from captum_vit.data.images import conform, conform_mask, is_image_file, read_image, read_json

SPEC_HELP = ("fmnist-loc | sample | folder:PATH | synthetic | imagenet-seg:gtsegs_ijcv.mat | "
             "imagenet-val:PATH | cifar10:PATH | cifar100:PATH | imagenet-s:PATH")
"""One-line summary of the data specs (command-line help)."""

log = logging.getLogger(__name__)


class IndexedData(Protocol):
    """What the loaders and the metrics read of a data set: its length and its items by
    index (a list, a ``torch.utils.data.Dataset`` with ``__len__``, :class:`Examples`)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> Any: ...


class Example(NamedTuple):
    """One example: an image ``[C, H, W]``, its label (model class index, ``-1`` when
    unknown) and its ground-truth mask ``[H, W]`` (or ``None``)."""

    image: Tensor
    label: int
    mask: Tensor | None


def subset_indices(length: int, size: int, seed: int = 0) -> list[int]:
    r"""A seeded random subset of ``range(length)``: the first ``size`` entries of the
    permutation ``numpy.random.default_rng(seed).permutation(length)`` (so the subset of
    size ``k`` starts the subset of size ``k + 1`` for the same seed).

    Args:
        length (int): size of the data set.
        size (int): size of the subset, at most ``length``.
        seed (int, optional): the seed (``--subset-seed``). Default 0.

    Returns:
        list[int]: ``size`` distinct indices, in drawn order.

    Raises:
        ValueError: ``size`` is not in ``1 .. length``.

    Examples::

        >>> from captum_vit.data.specs import subset_indices
        >>> len(subset_indices(50_000, 5_000, seed=0))
        5000
        >>> subset_indices(10, 3, seed=1) == subset_indices(10, 3, seed=1)
        True
    """
    import numpy as np

    if not 1 <= int(size) <= length:
        raise ValueError(f"subset (--subset) must be in 1 .. {length} (the data set's size), "
                         f"got {size}")
    return [int(i) for i in np.random.default_rng(seed).permutation(length)[:int(size)]]


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
    """The first ``n`` items of a data set (or of a list of its indices) as
    :class:`Example` s, labels mapped to the model's classes (what :func:`load_data`
    returns).

    Args:
        source (Sequence): items ``(image, label, mask)``, ``(image, label)`` or dicts
            with ``image``, ``label`` and ``mask``.
        n (int, optional): keep the first ``n`` items. Default None (all).
        label_map (Sequence[int], optional): model class of each source label
            (``-1`` unknown); ``None`` keeps the source labels.
        indices (Sequence[int], optional): the source items to use, in this order
            (e.g. :func:`subset_indices`); default all. Recorded in :attr:`indices`.
        transform (Callable, optional): applied to each image (e.g.
            :func:`captum_vit.data.transforms.seed_transforms`'s ``image``).
        mask_transform (Callable, optional): applied to each mask.

    Examples::

        >>> ex = Examples(SyntheticLoc(4, 3, (32, 32), 10, seed=0))
        >>> ex[0].label, ex.has_masks
        (0, True)
    """

    def __init__(self, source: IndexedData, n: int | None = None,
                 label_map: Sequence[int] | None = None, *,
                 indices: Sequence[int] | None = None,
                 transform: Callable[[Any], Any] | None = None,
                 mask_transform: Callable[[Any], Any] | None = None) -> None:
        self.source = source
        base = list(range(len(source))) if indices is None else [int(i) for i in indices]
        self.indices: list[int] = base if n is None else base[:int(n)]
        """The source index of each example."""
        self.n = len(self.indices)
        self.label_map = None if label_map is None else list(label_map)
        self.transform, self.mask_transform = transform, mask_transform

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Example:
        if not 0 <= i < self.n:
            raise IndexError(f"index {i} out of range for {self.n} examples")
        raw = self.source[self.indices[i]]
        if isinstance(raw, dict):
            img, label, mask = raw["image"], raw.get("label", -1), raw.get("mask")
        else:
            img, label = raw[0], raw[1]
            mask = raw[2] if len(raw) > 2 else None
        label = int(label)
        if self.label_map is not None:
            label = self.label_map[label] if 0 <= label < len(self.label_map) else -1
        if self.transform is not None:
            img = self.transform(img)
        if mask is not None and self.mask_transform is not None:
            mask = self.mask_transform(mask)
        return Example(torch.as_tensor(img), label,
                       None if mask is None else torch.as_tensor(mask))

    @property
    def has_masks(self) -> bool:
        """Whether the examples have ground-truth masks (judged by the first one)."""
        return self.n > 0 and self[0].mask is not None


DATASETS: dict[str, tuple[str, str]] = {
    "imagenet-seg": ("captum_vit.data.imagenet_seg", "ImageNetSegmentation"),
    "imagenet-val": ("captum_vit.data.imagenet", "ImageNetVal"),
    "cifar10": ("captum_vit.data.cifar", "CIFAR10"),
    "cifar100": ("captum_vit.data.cifar", "CIFAR100"),
    "imagenet-s": ("captum_vit.data.imagenet_s", "ImageNetS"),
}
"""``KIND:PATH`` specs read by a data set class ``(module, class)`` taking the path; its
:attr:`classes` (or ``None``) name its labels."""


def read_class_map(path: str | os.PathLike | Mapping[str, int]) -> dict[str, int]:
    r"""A class map ``{data class name: model class index}`` (``--class-map FILE``: a JSON
    object).

    Args:
        path (str, os.PathLike or Mapping): the JSON file, or the mapping itself.

    Returns:
        dict[str, int]: the map.

    Raises:
        FileNotFoundError: the file is missing.
        ValueError: not a JSON object of integers.

    Examples::

        >>> from captum_vit.data.specs import read_class_map
        >>> read_class_map({"kitty": 3})
        {'kitty': 3}
    """
    if isinstance(path, Mapping):
        raw: Any = dict(path)
    else:
        raw = read_json(path, "--class-map", 'write a JSON object {"data class name": '
                        'model_index}')
    if not isinstance(raw, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in raw.values()):
        raise ValueError('class_map must map each data class name to a model class index, '
                         'e.g. {"kitty": 3}')
    return {str(k): int(v) for k, v in raw.items()}


def load_data(spec: str, *, n: int | None = None, input_shape: tuple[int, tuple[int, int]],
              num_classes: int, class_names: Sequence[str] | None = None, seed: int = 0,
              need_labels: bool = False, subset: int | None = None, subset_seed: int = 0,
              class_map: Mapping[str, int] | str | os.PathLike | None = None,
              transform: Callable[[Any], Any] | None = None,
              mask_transform: Callable[[Any], Any] | None = None) -> Examples:
    r"""The examples of the data named by ``spec`` (see the module docstring): the first
    ``n``, or of a seeded random subset.

    Args:
        spec (str): ``fmnist-loc``, ``sample``, ``folder:PATH``, ``synthetic``,
            ``imagenet-seg:PATH``, ``imagenet-val:PATH``, ``cifar10:PATH``,
            ``cifar100:PATH`` or ``imagenet-s:PATH``.
        n (int, optional): number of examples (fewer when the data set or subset is
            smaller); ``None`` = all (``synthetic``: 100, or ``subset``). Default None.
        input_shape (tuple): the model's ``(channels, (H, W))`` (``synthetic`` is drawn
            at this shape; others are converted by :func:`model_batch`).
        num_classes (int): the model's number of classes.
        class_names (Sequence[str], optional): the model's class names (to match the
            data set's labels to); ``None`` = unknown.
        seed (int, optional): seed of ``fmnist-loc`` and ``synthetic``. Default 0.
        need_labels (bool, optional): labels will be used (``--target label``): every
            example must have a label of the model's classes, checked here before any
            work. Default False.
        subset (int, optional): use a random subset of this size
            (:func:`subset_indices`, ``--subset``); ``n`` then takes its first ``n``.
        subset_seed (int, optional): seed of the subset (``--subset-seed``). Default 0.
        class_map (Mapping or path, optional): ``{data class name: model index}`` or a
            JSON file of it (:func:`read_class_map`), instead of matching names.
        transform (Callable, optional): applied to each raw image (a preset's resizing,
            :func:`captum_vit.data.transforms.seed_transforms`).
        mask_transform (Callable, optional): applied to each raw mask.

    Returns:
        Examples: a sequence of :class:`Example`, with ``has_masks`` and ``indices``.

    Raises:
        ValueError: unknown spec; an empty data set; a bad subset size or class map; with
            ``need_labels``, class names that match none or several of the model's,
            files without a class folder, or unknown model class names (pass
            ``--classes FILE`` or use ``--target predicted``).
        FileNotFoundError: a missing folder or data set (the message says what to put
            where).

    Examples::

        >>> from captum_vit.data.specs import load_data
        >>> data = load_data("folder:photos", n=100, input_shape=(3, (224, 224)),
        ...                  num_classes=3, class_names=["cat", "dog", "bird"],
        ...                  need_labels=True)
        >>> image, label, mask = data[0]
        >>> val = load_data("imagenet-val:/data/val", subset=5000, subset_seed=0,
        ...                 input_shape=(3, (224, 224)), num_classes=1000)
        >>> val.indices[:3]
        [...]
    """
    channels, size = input_shape
    kind, _, arg = spec.partition(":")
    names: Sequence[str] | None
    if spec == "synthetic":
        total = n if n is not None else (subset if subset is not None else 100)
        source: IndexedData = SyntheticLoc(total, channels, (size[0], size[1]), num_classes,
                                                seed)
        names = None
    elif spec == "fmnist-loc":
        from captum_vit.data.fashion_mnist import CLASS_NAMES
        from captum_vit.data.loc import FashionMNISTLoc

        source, names = FashionMNISTLoc(split="test", seed=seed), CLASS_NAMES
    elif spec == "sample":
        from captum_vit.data.fashion_mnist import CLASS_NAMES

        source, names = _Sample(), CLASS_NAMES
    elif kind == "folder" and arg:
        folder = FolderImages(arg)
        source, names = folder, folder.classes
    elif kind in DATASETS and arg:
        import importlib

        module, cls = DATASETS[kind]
        source = getattr(importlib.import_module(module), cls)(arg)
        names = getattr(source, "classes", None)
    else:
        raise ValueError(f"unknown data {spec!r}; use {SPEC_HELP}")
    if len(source) == 0:
        raise ValueError(f"the dataset {spec!r} is empty; nothing to evaluate")
    indices = None if subset is None else subset_indices(len(source), subset, subset_seed)
    cmap = None if class_map is None else read_class_map(class_map)
    label_map = _label_map(spec, source, names, class_names, need_labels, cmap, num_classes)
    return Examples(source, n, label_map, indices=indices, transform=transform,
                    mask_transform=mask_transform)


def _used(source: Any, names: Sequence[str]) -> list[int]:
    """Indices of the names a source's items use (all when it does not say)."""
    labels = getattr(source, "labels", None)
    if labels is None:
        labels = getattr(source, "folder_index", None)
    if labels is None:
        return list(range(len(names)))
    return sorted({int(k) for k in labels} & set(range(len(names))))


def _label_map(spec: str, source: Any, names: Sequence[str] | None,
               class_names: Sequence[str] | None, need_labels: bool,
               class_map: dict[str, int] | None = None, num_classes: int = 0
               ) -> list[int] | None:
    """The model class of each of the source's class ``names`` (see the module docstring)."""
    if names is None:
        return None
    if need_labels and isinstance(source, FolderImages) and -1 in source.folder_index:
        loose = source.files[source.folder_index.index(-1)]
        raise ValueError(f"--data {spec}: {loose} is not in a class sub-folder, so it has "
                         "no label; put every image in a folder named after its class or "
                         "use --target predicted")
    what = "class folder" if isinstance(source, FolderImages) else f"--data {spec} class"
    used = _used(source, names)
    out = [-1] * len(names)
    if class_map is not None:
        bad = {k: v for k, v in class_map.items() if not 0 <= v < num_classes}
        missing = [names[j] for j in used if names[j] not in class_map]
        if bad or (need_labels and missing):
            raise ValueError(
                "--class-map: " + (f"indices {bad} are not classes of the model (0 .. "
                                    f"{num_classes - 1}); " if bad else "")
                + (f"{what} {', '.join(map(repr, missing))} not in the map; " if missing
                   and need_labels else "") + "give every data class a model class index")
        return [class_map.get(name, -1) for name in names]
    known = None if class_names is None else list(class_names)
    if names and all(WNID.match(str(w)) for w in names):
        wnids = model_wnids(class_names, num_classes)
        if wnids is not None:  # WNIDs matched to the model's WNIDs
            known = list(wnids)
        elif known is not None:  # WNIDs -> descriptions, matched to the model's names
            desc = wnid_descriptions(names)
            names = [desc[j] if j in used else w for j, w in enumerate(names)]
    if known is None:
        if need_labels:
            raise ValueError(
                f"labels are needed (--target label) but the model's class names are unknown, "
                f"so the labels of --data {spec} cannot be matched to its classes; pass "
                "--classes FILE (one class name per line, in the model's class order) or use "
                "--target predicted")
        return out
    if known == sorted(names):
        log.info("--data %s: the model's class names are the data set's sorted class names: "
                 "labels are alphabetical positions", spec)
    matched = match_class_names([names[j] for j in used], known, what=what, strict=need_labels)
    for j, k in zip(used, matched, strict=True):
        out[j] = k
    return out


def model_batch(data: IndexedData, indices: Sequence[int], *,
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
    m = None if any(k is None for k in masks) else torch.stack(
        cast(list[Tensor], masks)).to(device)  # none is None
    return x, torch.tensor(labels, dtype=torch.long, device=device), m


__all__ = ["DATASETS", "Example", "Examples", "FolderImages", "SPEC_HELP", "SyntheticLoc",
           "class_key", "load_data", "match_class_names", "model_batch", "read_class_map",
           "subset_indices"]
