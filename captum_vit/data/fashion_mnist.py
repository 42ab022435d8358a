"""Reader for the Fashion-MNIST idx files (gzip-compressed or plain).

The files are the ones distributed by Zalando Research and packaged by Debian as
``dataset-fashion-mnist`` (installed under ``/usr/share/datasets/fashion-mnist``)::

    train-images-idx3-ubyte.gz  train-labels-idx1-ubyte.gz
    t10k-images-idx3-ubyte.gz   t10k-labels-idx1-ubyte.gz

Uncompressed copies (the same names without ``.gz``) are accepted too.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np
import torch

__all__ = ["CLASS_NAMES", "DEFAULT_ROOT", "ENV_VAR", "load_fashion_mnist", "read_idx"]

#: The ten Fashion-MNIST classes, indexed by label.
CLASS_NAMES: tuple[str, ...] = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)

#: Where the Debian package ``dataset-fashion-mnist`` installs the files.
DEFAULT_ROOT = "/usr/share/datasets/fashion-mnist"
#: Environment variable that overrides :data:`DEFAULT_ROOT`.
ENV_VAR = "CAPTUM_VIT_FASHION_MNIST"

_PREFIX = {"train": "train", "test": "t10k"}
# idx magic: two zero bytes, a type code (0x08 = unsigned byte), number of dimensions.
_MAGIC_IMAGES = 0x00000803
_MAGIC_LABELS = 0x00000801


def read_idx(path: str | os.PathLike, expected_magic: int | None = None) -> np.ndarray:
    r"""
    Reads one unsigned-byte idx file (gzip-compressed or plain).

    Args:

        path (str or os.PathLike): File to read. A ``.gz`` suffix or the gzip
                    signature selects decompression.
        expected_magic (int, optional): If given, the 4-byte big-endian magic number
                    the file must start with (``0x803`` for image files, ``0x801``
                    for label files).
                    Default: None (any unsigned-byte idx file).

    Returns:
        *numpy.ndarray* of **data** (dtype uint8), shaped as the dimensions stored
        in the header.

    Raises:
        ValueError: If the magic number is wrong, the data type is not unsigned
                    byte, or the file is truncated.

    Examples::

        >>> labels = read_idx("/usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz")
        >>> labels.shape
        (10000,)
    """
    path = Path(path)
    with open(path, "rb") as fh:
        head = fh.read(2)
    opener = gzip.open if head == b"\x1f\x8b" else open
    with opener(path, "rb") as fh:
        data = fh.read()
    if len(data) < 4:
        raise ValueError(f"{path}: file too short to be an idx file ({len(data)} bytes).")
    magic = int.from_bytes(data[:4], "big")
    if magic >> 16 != 0 or (magic >> 8) & 0xFF != 0x08 or magic & 0xFF == 0:
        raise ValueError(
            f"{path}: bad idx magic number 0x{magic:08x}; expected 0x00000801 (labels) or "
            "0x00000803 (images). The file is not an unsigned-byte idx file or is corrupt."
        )
    if expected_magic is not None and magic != expected_magic:
        raise ValueError(
            f"{path}: bad idx magic number 0x{magic:08x}, expected 0x{expected_magic:08x}. "
            "Check that image and label files are not swapped."
        )
    ndim = magic & 0xFF
    if len(data) < 4 + 4 * ndim:
        raise ValueError(f"{path}: truncated idx header.")
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    offset = 4 + 4 * ndim
    count = int(np.prod(shape))
    if len(data) - offset != count:
        raise ValueError(
            f"{path}: idx header announces {count} bytes of data for shape {shape}, "
            f"found {len(data) - offset}. The file is truncated or corrupt."
        )
    return np.frombuffer(data, dtype=np.uint8, offset=offset).reshape(shape).copy()


def _find(root: Path, stem: str) -> Path:
    for name in (stem + ".gz", stem):
        if (root / name).is_file():
            return root / name
    raise FileNotFoundError(
        f"Fashion-MNIST file {stem}[.gz] not found in {root}. Install the data with "
        f"`apt-get install dataset-fashion-mnist` (files go to {DEFAULT_ROOT}), or pass "
        f"root= (or set the environment variable {ENV_VAR}) to a directory holding the "
        "four idx files."
    )


def load_fashion_mnist(
    split: str = "train", root: str | os.PathLike | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""
    Loads one official split of Fashion-MNIST.

    Args:

        split (str, optional): ``"train"`` (60 000 images) or ``"test"`` (10 000).
                    Default: ``"train"``
        root (str or os.PathLike, optional): Directory holding the idx files. If
                    None, the environment variable ``CAPTUM_VIT_FASHION_MNIST`` is
                    used when set, else ``/usr/share/datasets/fashion-mnist`` (the
                    Debian package ``dataset-fashion-mnist``).
                    Default: None

    Returns:
        2-element tuple of **images**, **labels**:
        - **images** (*torch.Tensor*): uint8 tensor ``[N, 28, 28]``.
        - **labels** (*torch.Tensor*): int64 tensor ``[N]`` with values in ``0..9``
          (names in :data:`CLASS_NAMES`).

    Raises:
        FileNotFoundError: If the files are missing (the message says how to get them).
        ValueError: If ``split`` is unknown or a file is not a valid idx file.

    Examples::

        >>> images, labels = load_fashion_mnist("test")
        >>> images.shape, labels.shape
        (torch.Size([10000, 28, 28]), torch.Size([10000]))
    """
    if split not in _PREFIX:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}.")
    if root is None:
        root = os.environ.get(ENV_VAR) or DEFAULT_ROOT
    root = Path(root)
    prefix = _PREFIX[split]
    images = read_idx(_find(root, f"{prefix}-images-idx3-ubyte"), _MAGIC_IMAGES)
    labels = read_idx(_find(root, f"{prefix}-labels-idx1-ubyte"), _MAGIC_LABELS)
    if images.ndim != 3 or labels.ndim != 1 or images.shape[0] != labels.shape[0]:
        raise ValueError(
            f"Fashion-MNIST files in {root} disagree: images {images.shape}, "
            f"labels {labels.shape}."
        )
    return torch.from_numpy(images), torch.from_numpy(labels.astype(np.int64))
