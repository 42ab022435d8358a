"""Fashion-MNIST reader, the FashionMNIST-Loc localisation set, a bundled sample, image
reading, the benchmark loaders (ImageNet-Segmentation, ImageNet validation, CIFAR-10/100,
ImageNet-S; local files only), the papers' resizing and the data specs of the command line."""

from captum_vit.data.cifar import CIFAR10, CIFAR100, read_cifar_batch
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
    match_class_names,
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
