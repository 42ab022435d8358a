"""Fashion-MNIST reader, the FashionMNIST-Loc localisation set, a bundled sample, image
reading and the data specs of the command line."""

from captum_vit.data.fashion_mnist import CLASS_NAMES, load_fashion_mnist, read_idx
from captum_vit.data.images import as_image, conform, read_image
from captum_vit.data.loc import (
    FashionMNISTLoc,
    build_arrays,
    center_on_canvas,
    make_batch,
    mask_to_box,
)
from captum_vit.data.sample import load_sample
from captum_vit.data.specs import (
    Example,
    Examples,
    FolderImages,
    SyntheticLoc,
    load_data,
    match_class_names,
    model_batch,
)

__all__ = [
    "CLASS_NAMES",
    "Example",
    "Examples",
    "FashionMNISTLoc",
    "FolderImages",
    "SyntheticLoc",
    "as_image",
    "build_arrays",
    "center_on_canvas",
    "conform",
    "load_data",
    "load_fashion_mnist",
    "load_sample",
    "make_batch",
    "mask_to_box",
    "match_class_names",
    "model_batch",
    "read_idx",
    "read_image",
]
