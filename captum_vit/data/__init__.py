"""Fashion-MNIST reader, the FashionMNIST-Loc localisation set and a bundled sample."""

from captum_vit.data.fashion_mnist import CLASS_NAMES, load_fashion_mnist, read_idx
from captum_vit.data.loc import (
    FashionMNISTLoc,
    build_arrays,
    center_on_canvas,
    make_batch,
    mask_to_box,
)
from captum_vit.data.sample import load_sample

__all__ = [
    "CLASS_NAMES",
    "FashionMNISTLoc",
    "build_arrays",
    "center_on_canvas",
    "load_fashion_mnist",
    "load_sample",
    "make_batch",
    "mask_to_box",
    "read_idx",
]
