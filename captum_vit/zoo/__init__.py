"""Small ViTs trained on FashionMNIST-Loc, shipped with the package (safetensors).

Each model has ``<name>.safetensors`` (the state dict) and ``<name>.json`` (the model
card: timm kwargs, normalisation, accuracies, learning curve, training command, seed,
duration) in this directory. ``scripts/train_zoo.py`` trains them. The card is read by
:func:`captum_vit.cards.read_card`, the same reader as ``--model file:PATH``'s card, so a
zoo model copied elsewhere loads as ``file:PATH.safetensors``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import cast

from torch import nn

from captum_vit.cards import from_card, read_card
from captum_vit.data.fashion_mnist import CLASS_NAMES
from captum_vit.data.transforms import Preprocess
from captum_vit.zoo.seeded import seeded_init

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
    preprocess: Preprocess
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
    card = read_card(ZOO_DIR / f"{name}.json")
    # the bundled cards predate the card's class_names: they are Fashion-MNIST's classes
    lm = from_card(card, ZOO_DIR / f"{name}.safetensors",
                   class_names=card.get("class_names", CLASS_NAMES))
    # from_card with class_names gives both (never None here)
    return ZooModel(lm.model, lm.preprocess, cast(tuple[str, ...], lm.class_names),
                    cast(dict, lm.card))


__all__ = ["ZooModel", "available", "load", "ZOO_DIR", "seeded_init"]
