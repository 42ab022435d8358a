r"""ImageNet validation set (ILSVRC2012) from local files.

Two layouts:

* **flat** — ``PATH/ILSVRC2012_val_00000001.JPEG ...`` plus the devkit's
  ``ILSVRC2012_validation_ground_truth.txt`` (line ``i`` = ILSVRC2012_ID of image ``i``)
  and ``meta.mat`` (``synsets``: ``ILSVRC2012_ID``, ``WNID``; read with
  ``scipy.io.loadmat``), found in ``PATH``, ``PATH/ILSVRC2012_devkit_t12/data`` or
  ``PATH/../ILSVRC2012_devkit_t12/data`` (or the ``devkit`` argument). Instead of
  ``meta.mat`` a text file ``synsets.txt`` may give the WNID of ILSVRC2012_ID ``i`` as the
  first word of line ``i``.
* **class folders** — ``PATH/<WNID>/*.JPEG`` (e.g. after the usual ``valprep.sh``).

Labels are positions in the **sorted list of the 1000 ImageNet-1k WNIDs** (n01440764 tench
= 0), the order of timm's and Hugging Face's ImageNet-1k heads; ILSVRC2012_ID order is not
that order (ID 1 is n02119789, kit fox: checked against the ILSVRC2012 WNID-to-ID table
listed in arthw/imagenet_label's README, "n02119789 1 kit_fox"; no real devkit is
available offline, the tests use a meta.mat written with the devkit's field names). The
sorted-WNID order is checked against timm's ``ImageNetInfo`` (index 0 "tench, Tinca
tinca"). Bounding boxes: a PASCAL VOC ``.xml`` with the image's stem beside it (or in
``boxes``) gives a box mask (the union of its objects of the image's class) for the
pointing game.

The WNID <-> model class matching (:func:`model_wnids`, :func:`imagenet_wnids`,
:func:`wnid_descriptions`) lives in :mod:`captum_vit.data.classes` and is re-exported here.
"""

from __future__ import annotations

import logging
import os
import re
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import Dataset

from captum_vit.data.classes import (
    IMAGENET_SUBSETS,
    WNID,
    imagenet_wnids,
    model_wnids,
    wnid_descriptions,
)
from captum_vit.data.images import is_image_file, read_image
from captum_vit.data.transforms import require

log = logging.getLogger(__name__)

GROUND_TRUTH = "ILSVRC2012_validation_ground_truth.txt"
"""The devkit file: line ``i`` is the ILSVRC2012_ID (1..1000) of validation image ``i``."""

_VAL_NAME = re.compile(r"^ILSVRC2012_val_(\d{8})$")


def read_devkit(folder: str | os.PathLike, spec: str = "--data imagenet-val:PATH"
                ) -> tuple[list[int], dict[int, str]]:
    r"""The devkit's ground truth and the WNID of each ILSVRC2012_ID.

    Args:
        folder (str or os.PathLike): the folder holding
            ``ILSVRC2012_validation_ground_truth.txt`` and ``meta.mat`` (or
            ``synsets.txt``: line ``i`` starts with the WNID of ILSVRC2012_ID ``i``).
        spec (str, optional): named in error messages.

    Returns:
        tuple: the ILSVRC2012_ID of validation image 1, 2, ... and ``{ID: WNID}``.

    Raises:
        FileNotFoundError: a file is missing.
        ValueError: ``meta.mat`` lacks ``synsets`` with ``ILSVRC2012_ID`` and ``WNID``.

    Examples::

        >>> from captum_vit.data.imagenet import read_devkit
        >>> ids, wnid = read_devkit("ILSVRC2012_devkit_t12/data")
        >>> wnid[ids[0]]
        'n01751748'
    """
    d = Path(folder)
    gt = require(d / GROUND_TRUTH, spec, f"the devkit's {GROUND_TRUTH} "
                 "(ILSVRC2012_devkit_t12/data)")
    ids = [int(line) for line in gt.read_text().split()]
    if (d / "meta.mat").is_file():
        from scipy.io import loadmat

        syn = loadmat(d / "meta.mat", squeeze_me=True).get("synsets")
        if syn is None or syn.dtype.names is None or not {"ILSVRC2012_ID", "WNID"} <= set(
                syn.dtype.names):
            raise ValueError(f"{spec}: {d / 'meta.mat'} has no 'synsets' struct array with "
                             "ILSVRC2012_ID and WNID; give the devkit's meta.mat")
        wnid = {int(i): str(w) for i, w in zip(syn["ILSVRC2012_ID"].ravel(),
                                              syn["WNID"].ravel(), strict=True)}
    else:
        text = require(d / "synsets.txt", spec,
                       "the devkit's meta.mat (or synsets.txt: the WNID of ILSVRC2012_ID i at "
                       "the start of line i)")
        wnid = {i + 1: line.split()[0] for i, line in
                enumerate(ln for ln in text.read_text().splitlines() if ln.strip())}
    unknown = sorted(set(ids) - set(wnid))
    if unknown:
        raise ValueError(f"{spec}: ILSVRC2012_IDs {unknown[:5]} of {GROUND_TRUTH} are not in "
                         "the devkit's synsets")
    return ids, wnid


def read_voc_boxes(path: str | os.PathLike) -> list[tuple[str, int, int, int, int]]:
    r"""The objects of a PASCAL VOC annotation: ``(name, xmin, ymin, xmax, ymax)``.

    Args:
        path (str or os.PathLike): the ``.xml`` file.

    Returns:
        list[tuple[str, int, int, int, int]]: one entry per ``object`` with a ``bndbox``.

    Raises:
        ValueError: the file is not XML.

    Examples::

        >>> from captum_vit.data.imagenet import read_voc_boxes
        >>> read_voc_boxes("ILSVRC2012_val_00000001.xml")
        [('n01751748', 111, 108, 441, 375)]
    """
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        raise ValueError(f"{path}: not a PASCAL VOC XML annotation ({e})") from e
    out: list[tuple[str, int, int, int, int]] = []
    for obj in root.iter("object"):
        box = obj.find("bndbox")
        if box is None:
            continue
        v = [int(float(box.findtext(k, "0"))) for k in ("xmin", "ymin", "xmax", "ymax")]
        out.append((obj.findtext("name", "").strip(), v[0], v[1], v[2], v[3]))
    return out


def boxes_mask(boxes: Sequence[tuple[str, int, int, int, int]], size: tuple[int, int],
               name: str | None = None) -> Tensor:
    r"""The union of boxes as a mask: pixels ``ymin <= y < ymax``, ``xmin <= x < xmax``
    (at least one pixel per box), clipped to the image.

    Args:
        boxes (Sequence): ``(name, xmin, ymin, xmax, ymax)`` (:func:`read_voc_boxes`).
        size (tuple[int, int]): the image's ``(H, W)``.
        name (str, optional): keep only the boxes of this name, unless none has it.

    Returns:
        Tensor: bool ``[H, W]``.

    Examples::

        >>> boxes_mask([("n01440764", 1, 2, 3, 4)], (5, 5)).sum()
        tensor(4)
    """
    keep = [b for b in boxes if b[0] == name] if name is not None else []
    m = torch.zeros(size, dtype=torch.bool)
    for _, x0, y0, x1, y1 in keep or boxes:
        x0, y0 = max(x0, 0), max(y0, 0)
        m[y0:max(y1, y0 + 1), x0:max(x1, x0 + 1)] = True
    return m


class ImageNetVal(Dataset):
    r"""The ImageNet validation images under a folder (flat with the devkit, or class
    folders; see the module docstring).

    Items are ``(image, label, mask)``: float32 ``[C, H, W]`` in ``[0, 1]``, the sorted-WNID
    index (:attr:`classes` are the 1000 sorted WNIDs, so it is the timm class index), and
    the box mask of the image's ``.xml`` annotation or ``None``.

    Args:
        root (str or os.PathLike): the image folder.
        devkit (str or os.PathLike, optional): the folder of the ground truth and
            ``meta.mat`` (flat layout); default: searched beside ``root``.
        boxes (str or os.PathLike, optional): folder of the ``.xml`` annotations; default:
            beside each image.

    Raises:
        FileNotFoundError: ``root`` or the devkit files are missing.
        ValueError: no images; class folders that are not ImageNet-1k WNIDs; image numbers
            beyond the ground truth.

    Examples::

        >>> from captum_vit.data import ImageNetVal
        >>> ds = ImageNetVal("ILSVRC2012/val")
        >>> image, label, box = ds[0]
        >>> ds.classes[label]
        'n01751748'
    """

    def __init__(self, root: str | os.PathLike, *, devkit: str | os.PathLike | None = None,
                 boxes: str | os.PathLike | None = None) -> None:
        spec = "--data imagenet-val:PATH"
        self.root = require(root, spec, "the validation images: ILSVRC2012_val_*.JPEG with "
                            "the devkit beside them, or class folders <WNID>/*.JPEG",
                            folder=True)
        self.boxes = None if boxes is None else require(boxes, spec, "the .xml boxes",
                                                        folder=True)
        self.classes: tuple[str, ...] = imagenet_wnids()
        index = {w: i for i, w in enumerate(self.classes)}
        flat = sorted(p for p in self.root.iterdir() if p.is_file() and is_image_file(p)
                      and _VAL_NAME.match(p.stem))
        if flat:
            ids, wnid = read_devkit(self._devkit(devkit, spec), spec)
            numbers = [int(_VAL_NAME.match(p.stem).group(1)) for p in flat]  # type: ignore
            beyond = [p.name for p, k in zip(flat, numbers, strict=True) if k > len(ids)]
            if beyond:
                raise ValueError(f"{spec}: {beyond[:3]} beyond the {len(ids)} lines of "
                                 f"{GROUND_TRUTH}")
            wnids = [wnid[ids[k - 1]] for k in numbers]
            self.files = flat
        else:
            folders = sorted(p for p in self.root.iterdir() if p.is_dir())
            bad = [p.name for p in folders if p.name not in index]
            if bad or not folders:
                raise ValueError(
                    f"{spec}: {self.root} holds neither ILSVRC2012_val_*.JPEG files nor only "
                    "class folders named by ImageNet-1k WNIDs"
                    + (f" ({', '.join(bad[:10])} are not)" if bad else ""))
            self.files, wnids = [], []
            for p in folders:
                files = sorted(f for f in p.rglob("*") if f.is_file() and is_image_file(f))
                self.files += files
                wnids += [p.name] * len(files)
        missing = sorted(set(wnids) - set(index))
        if missing:
            raise ValueError(f"{spec}: WNIDs {missing[:5]} of the devkit are not ImageNet-1k "
                             "classes; is meta.mat the ILSVRC2012 devkit's?")
        self.labels = [index[w] for w in wnids]

    def _devkit(self, devkit: str | os.PathLike | None, spec: str) -> Path:
        if devkit is not None:
            return require(devkit, spec, f"the devkit folder ({GROUND_TRUTH}, meta.mat)",
                           folder=True)
        tried = [self.root, self.root / "ILSVRC2012_devkit_t12" / "data",
                 self.root.parent / "ILSVRC2012_devkit_t12" / "data", self.root.parent]
        for d in tried:
            if (d / GROUND_TRUTH).is_file():
                return d
        raise FileNotFoundError(
            f"{spec}: {GROUND_TRUTH} not found in {', '.join(map(str, tried))}; put the "
            "devkit's ILSVRC2012_devkit_t12/data (with meta.mat) beside the images")

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[Tensor, int, Tensor | None]:
        path = self.files[i]
        image = read_image(path)
        xml = (self.boxes or path.parent) / f"{path.stem}.xml"
        mask = None
        if xml.is_file():
            mask = boxes_mask(read_voc_boxes(xml), (int(image.shape[-2]), int(image.shape[-1])),
                              self.classes[self.labels[i]])
        return image, self.labels[i], mask


__all__ = ["GROUND_TRUTH", "IMAGENET_SUBSETS", "ImageNetVal", "WNID", "boxes_mask",
           "imagenet_wnids", "model_wnids", "read_devkit", "read_voc_boxes", "wnid_descriptions"]
