"""Small ViTs trained on FashionMNIST-Loc, shipped with the package (safetensors).

Each model has ``<name>.safetensors`` (the state dict) and ``<name>.json`` (the model
card: timm kwargs, normalisation, accuracies, learning curve, training command, seed,
duration) in this directory. ``scripts/train_zoo.py`` trains them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from captum_vit.data.fashion_mnist import CLASS_NAMES

ZOO_DIR = Path(__file__).parent


@dataclass(frozen=True)
class ZooModel:
    """A bundled model with what is needed to use it.

    Attributes:
        model (nn.Module): a timm ``VisionTransformer`` in eval mode (float32).
        preprocess (Callable): PIL image / numpy array / tensor of any size ->
            normalised float tensor [1, 56, 56].
        class_names (tuple[str, ...]): names of the output classes.
        card (dict): the model card.
    """

    model: nn.Module
    preprocess: Callable[[Any], torch.Tensor]
    class_names: tuple[str, ...]
    card: dict


def available() -> list[str]:
    """Names of the bundled models.

    Returns:
        list[str]: names accepted by :func:`load`.

    Examples::

        >>> from captum_vit import zoo
        >>> "vit_fmnist_loc" in zoo.available()
        True
    """
    return sorted(p.stem for p in ZOO_DIR.glob("*.json")
                  if (ZOO_DIR / f"{p.stem}.safetensors").is_file())


def _preprocessor(size: tuple[int, int], mean: float, std: float) -> Callable[[Any], torch.Tensor]:
    def preprocess(image: Any) -> torch.Tensor:
        """Image (PIL, HxW / HxWxC array in [0, 255] or [0, 1], or [C, H, W] tensor) ->
        normalised [1, H, W] at the model's resolution."""
        if hasattr(image, "convert"):  # PIL image
            image = np.asarray(image.convert("L"), dtype=np.float32) / 255.0
        if isinstance(image, np.ndarray):
            arr = torch.from_numpy(np.ascontiguousarray(image)).float()
            if arr.dim() == 3:  # H, W, C
                arr = arr.permute(2, 0, 1)
            image = arr / 255.0 if arr.max() > 1.0 else arr
        if not isinstance(image, torch.Tensor):
            raise TypeError("image must be a PIL image, a numpy array or a torch.Tensor, "
                            f"got {type(image).__name__}")
        x = image.float()
        if x.dim() == 2:
            x = x[None]
        if x.dim() != 3:
            raise ValueError(f"image tensor must be [H, W] or [C, H, W], got {tuple(x.shape)}")
        if x.shape[0] == 3:
            x = (x * torch.tensor([0.299, 0.587, 0.114])[:, None, None]).sum(0, keepdim=True)
        elif x.shape[0] != 1:
            raise ValueError(f"image must have 1 or 3 channels, got {x.shape[0]}")
        if tuple(x.shape[-2:]) != size:
            x = F.interpolate(x[None], size=size, mode="bilinear", align_corners=False,
                              antialias=True)[0]
        return (x - mean) / std

    return preprocess


def load(name: str = "vit_fmnist_loc") -> ZooModel:
    """Load a bundled model.

    Args:
        name (str, optional): one of :func:`available`. Default ``"vit_fmnist_loc"``.

    Returns:
        ZooModel: the model (eval mode), its preprocessing, class names and model card.

    Raises:
        ValueError: for an unknown name (the message lists the available ones).

    Examples::

        >>> from captum_vit import zoo, GAE
        >>> from captum_vit.data import load_sample
        >>> zm = zoo.load("vit_fmnist_loc")
        >>> images = zm.preprocess(load_sample()["images"][0])[None]
        >>> attr = GAE(zm.model).attribute(images)
    """
    names = available()
    if name not in names:
        raise ValueError(f"unknown zoo model {name!r}; available: {', '.join(names) or 'none'}")
    card = json.loads((ZOO_DIR / f"{name}.json").read_text())
    from timm.models.vision_transformer import VisionTransformer

    model = VisionTransformer(**card["timm_kwargs"])
    model.load_state_dict(load_file(str(ZOO_DIR / f"{name}.safetensors")), strict=True)
    model.eval()
    size = int(card["timm_kwargs"]["img_size"])
    norm = card["normalization"]
    pre = _preprocessor((size, size), float(norm["mean"][0]), float(norm["std"][0]))
    return ZooModel(model, pre, CLASS_NAMES, card)


__all__ = ["ZooModel", "available", "load", "ZOO_DIR"]
