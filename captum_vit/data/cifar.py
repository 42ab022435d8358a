r"""CIFAR-10 and CIFAR-100, "python version" (Krizhevsky 2009), from local files.

``cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta}`` and
``cifar-100-python/{train, test, meta}``: pickles (read with ``encoding="bytes"``) holding
``b"data"`` (uint8 ``[n, 3072]``: 1024 R, 1024 G, 1024 B values, each 32x32 row-major),
``b"labels"`` (CIFAR-10) or ``b"fine_labels"`` (CIFAR-100) and, in the meta file,
``b"label_names"`` / ``b"fine_label_names"``.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from captum_vit.data.transforms import require

SPLITS = ("train", "test")
"""Splits of both CIFAR data sets."""


def read_cifar_batch(path: str | os.PathLike) -> dict[str, Any]:
    r"""One CIFAR pickle with ``str`` keys (``data``, ``labels`` / ``fine_labels``, ...).

    Only trusted files: like every pickle, a CIFAR batch can run code when loaded.

    Args:
        path (str or os.PathLike): the pickle (``test_batch``, ``test``, ``meta`` ...).

    Returns:
        dict[str, Any]: the pickle's dict, keys decoded.

    Raises:
        FileNotFoundError: the file is missing.
        ValueError: it is not a pickled dict.

    Examples::

        >>> from captum_vit.data.cifar import read_cifar_batch
        >>> read_cifar_batch("cifar-10-batches-py/test_batch")["data"].shape
        (10000, 3072)
    """
    p = require(path, "CIFAR", "the CIFAR python-version file")
    try:
        with open(p, "rb") as f:
            raw = pickle.load(f, encoding="bytes")
    except (pickle.UnpicklingError, EOFError, ValueError) as e:
        raise ValueError(f"{p}: not a CIFAR python-version pickle ({e})") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{p}: not a CIFAR python-version pickle (a dict)")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in raw.items()}


class _CIFAR(Dataset):
    folder = ""
    files: dict[str, tuple[str, ...]] = {}
    meta = ""
    labels_key = ""
    names_key = ""
    spec = ""

    def __init__(self, root: str | os.PathLike, split: str = "test") -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        what = (f"the folder {self.folder} ({', '.join(self.files['train'] + self.files['test'])}"
                f", {self.meta}) of the python version")
        r = require(root, f"--data {self.spec}:PATH", what, folder=True)
        if (r / self.folder).is_dir():
            r = r / self.folder
        for name in (*self.files[split], self.meta):
            require(r / name, f"--data {self.spec}:{root}", what)
        data, labels = [], []
        for name in self.files[split]:
            batch = read_cifar_batch(r / name)
            if "data" not in batch or self.labels_key not in batch:
                raise ValueError(f"--data {self.spec}:{root}: {r / name} lacks 'data' or "
                                 f"'{self.labels_key}'; is it {self.folder}?")
            data.append(np.asarray(batch["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
            labels += [int(v) for v in batch[self.labels_key]]
        self.root, self.split = r, split
        self.data = np.concatenate(data)
        self.labels = labels
        names = read_cifar_batch(r / self.meta).get(self.names_key, [])
        self.classes: tuple[str, ...] = tuple(
            n.decode() if isinstance(n, bytes) else str(n) for n in names)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Tensor, int, None]:
        return torch.from_numpy(self.data[i]).float() / 255.0, self.labels[i], None


class CIFAR10(_CIFAR):
    r"""CIFAR-10 from ``cifar-10-batches-py`` (python version).

    Items are ``(image, label, None)``: float32 ``[3, 32, 32]`` in ``[0, 1]`` (the stored
    uint8 divided by 255) and the CIFAR label; :attr:`classes` are ``batches.meta``'s
    ``label_names`` (matched by name to a model's classes).

    Args:
        root (str or os.PathLike): ``cifar-10-batches-py`` or the folder holding it.
        split (str, optional): ``"test"`` (``test_batch``, 10,000 images) or ``"train"``
            (``data_batch_1`` .. ``5``). Default ``"test"``.

    Raises:
        FileNotFoundError: a missing folder or file (the message lists the files).
        ValueError: a bad ``split`` or a file that is not a CIFAR-10 batch.

    Examples::

        >>> from captum_vit.data import CIFAR10
        >>> ds = CIFAR10("data/cifar-10-batches-py")
        >>> len(ds), ds.classes[ds[0][1]]
        (10000, 'cat')
    """

    folder = "cifar-10-batches-py"
    files = {"train": tuple(f"data_batch_{i}" for i in range(1, 6)), "test": ("test_batch",)}
    meta, labels_key, names_key, spec = "batches.meta", "labels", "label_names", "cifar10"


class CIFAR100(_CIFAR):
    r"""CIFAR-100 (fine labels) from ``cifar-100-python`` (python version).

    Items are ``(image, label, None)``: float32 ``[3, 32, 32]`` in ``[0, 1]`` and the fine
    label; :attr:`classes` are ``meta``'s ``fine_label_names``.

    Args:
        root (str or os.PathLike): ``cifar-100-python`` or the folder holding it.
        split (str, optional): ``"test"`` or ``"train"``. Default ``"test"``.

    Raises:
        FileNotFoundError: a missing folder or file.
        ValueError: a bad ``split`` or a file that is not a CIFAR-100 pickle.

    Examples::

        >>> from captum_vit.data import CIFAR100
        >>> ds = CIFAR100("data/cifar-100-python")
        >>> len(ds), ds.classes[:2]
        (10000, ('apple', 'aquarium_fish'))
    """

    folder = "cifar-100-python"
    files = {"train": ("train",), "test": ("test",)}
    meta, labels_key, names_key, spec = "meta", "fine_labels", "fine_label_names", "cifar100"


__all__ = ["CIFAR10", "CIFAR100", "SPLITS", "read_cifar_batch"]
