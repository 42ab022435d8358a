"""Fashion-MNIST reader, the FashionMNIST-Loc localisation set, a bundled sample, image
reading, the benchmark loaders (ImageNet-Segmentation, ImageNet validation, CIFAR-10/100,
ImageNet-S; local files only), the papers' resizing and the data specs of the command line.

Modules: :mod:`~captum_vit.data.specs` (the ``--data`` specs and batches),
:mod:`~captum_vit.data.classes` (class-name and WordNet-id matching),
:mod:`~captum_vit.data.transforms` (the models' :class:`~captum_vit.data.transforms.Preprocess`
and the papers' resizing), :mod:`~captum_vit.data.images` (reading and converting images) and
one module per data set; the names below are public. The data layer imports nothing of the
package but :mod:`captum_vit._text` (no model, method or metric).
"""

from captum_vit.data.cifar import CIFAR10, CIFAR100, read_cifar_batch
from captum_vit.data.classes import match_class_names
from captum_vit.data.fashion_mnist import CLASS_NAMES, load_fashion_mnist, read_idx
from captum_vit.data.imagenet import (
    ImageNetVal,
    imagenet_wnids,
    model_wnids,
    read_devkit,
    read_voc_boxes,
)
from captum_vit.data.imagenet_s import ImageNetS
from captum_vit.data.imagenet_seg import ImageNetSegmentation
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
    model_batch,
    read_class_map,
    subset_indices,
)
from captum_vit.data.transforms import SeedTransforms, seed_transforms

__all__ = [
    "CIFAR10",
    "CIFAR100",
    "CLASS_NAMES",
    "Example",
    "Examples",
    "FashionMNISTLoc",
    "FolderImages",
    "ImageNetS",
    "ImageNetSegmentation",
    "ImageNetVal",
    "SeedTransforms",
    "SyntheticLoc",
    "as_image",
    "build_arrays",
    "center_on_canvas",
    "conform",
    "imagenet_wnids",
    "load_data",
    "load_fashion_mnist",
    "load_sample",
    "make_batch",
    "mask_to_box",
    "match_class_names",
    "model_batch",
    "model_wnids",
    "read_cifar_batch",
    "read_class_map",
    "read_devkit",
    "read_idx",
    "read_image",
    "read_voc_boxes",
    "seed_transforms",
    "subset_indices",
]
