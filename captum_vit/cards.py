"""Model cards: the JSON description of a model and the model it builds.

A card (the zoo's ``<name>.json``, ``--model file:PATH``'s ``PATH.json``) is a JSON object:
``timm_kwargs`` (keyword arguments of timm's ``VisionTransformer``; the older ``kwargs`` key
is accepted too), optional ``normalization`` (``{"mean": [...], "std": [...]}`` per
channel, or one value for all) and optional ``class_names`` (one name per output class);
other keys (accuracy, learning curve, ...) are kept in :attr:`LoadedModel.card`.

:func:`read_card` reads one, :func:`from_card` builds its model and :func:`loaded_model`
turns any model into the :class:`LoadedModel` every model spec returns. This module sits
below both :mod:`captum_vit.models` (the model specs) and :mod:`captum_vit.zoo` (the bundled
models), which read their cards here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from torch import nn

from captum_vit.adapters import adapt
from captum_vit.data.images import read_json
from captum_vit.data.transforms import Preprocess

_ARCHITECTURES = ("VisionTransformer", "timm.models.vision_transformer.VisionTransformer")


@dataclass(frozen=True)
class LoadedModel:
    """A model with what is needed to feed and read it.

    Attributes:
        model (nn.Module): the model, in eval mode.
        preprocess (Preprocess): image -> normalised input ``[C, H, W]``.
        class_names (tuple[str, ...], optional): a name per output class, or ``None``
            when unknown.
        card (dict, optional): the model card (``zoo:`` and ``file:`` models).
        random_weights (bool): whether the weights are random (``random:``, ``timm:``
            without ``pretrained``).
    """

    model: nn.Module
    preprocess: Preprocess
    class_names: tuple[str, ...] | None = None
    card: dict | None = None
    random_weights: bool = False
    targets: Any = None
    """For a model that outputs an image embedding: the target vectors it is scored
    against (an :class:`~captum_vit.targets.EmbeddingTarget` without index)."""

    @property
    def input_shape(self) -> tuple[int, tuple[int, int]]:
        """The model's ``(channels, (H, W))`` (from its adapter)."""
        return adapt(self.model).input_shape

    @property
    def num_classes(self) -> int:
        """The model's number of output classes (from its adapter), or the number of
        target vectors of an embedding model."""
        if self.targets is not None:
            return int(self.targets.vectors.reshape(-1, self.targets.vectors.shape[-1]
                                                    ).shape[0])
        return adapt(self.model).num_classes

    def scoring(self) -> Any:
        """A context in which the model's scores are its classes: for an embedding model,
        :func:`captum_vit.targets.scoring` against :attr:`targets` (call it after moving
        the model to its device and dtype); for a classifier, nothing.

        Raises:
            ValueError: an embedding model without target vectors.
        """
        import contextlib

        from captum_vit.targets import scoring

        if self.targets is not None:
            return scoring(self.model, self.targets)
        if adapt(self.model).embedding:
            raise ValueError(f"this {type(self.model).__name__} outputs an image embedding, "
                             "not classes: give the vectors to score it against with "
                             "--target-embeddings FILE (.npy/.pt, [T, D′], e.g. text "
                             "embeddings of class prompts; --classes names them)")
        return contextlib.nullcontext()


def read_card(path: str | os.PathLike) -> dict[str, Any]:
    r"""Read a model card (the zoo's format, see the module docstring).

    Args:
        path (str or os.PathLike): the ``.json`` card.

    Returns:
        dict: the card, with ``timm_kwargs`` set (from ``kwargs`` for older cards).

    Raises:
        FileNotFoundError: if the card does not exist.
        ValueError: if it is not JSON or lacks the model's keyword arguments.

    Examples::

        >>> from captum_vit.cards import read_card
        >>> read_card("captum_vit/zoo/vit_fmnist_loc.json")["timm_kwargs"]["patch_size"]
        7
    """
    p = Path(path)
    card = read_json(p, "model card", "put the JSON card (with 'timm_kwargs') beside the "
                     "weights")
    if not isinstance(card, dict):
        raise ValueError(f"model card {p} must hold a JSON object")
    kwargs = card.get("timm_kwargs", card.get("kwargs"))
    if not isinstance(kwargs, dict):
        raise ValueError(f"model card {p} needs 'timm_kwargs': the keyword arguments of timm's "
                         "VisionTransformer")
    arch = card.get("architecture", "VisionTransformer")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"model card {p}: architecture {arch!r} is not supported; cards "
                         "describe a timm VisionTransformer")
    return {**card, "timm_kwargs": kwargs}


def from_card(card: dict[str, Any], weights: str | os.PathLike, *,
              class_names: Sequence[str] | None = None) -> LoadedModel:
    r"""Build the model a card describes and load its safetensors weights (strictly).

    Args:
        card (dict): a card as :func:`read_card` returns it.
        weights (str or os.PathLike): the ``.safetensors`` state dict.
        class_names (Sequence[str], optional): class names, overriding the card's.

    Returns:
        LoadedModel: the model (eval mode), the card's preprocessing and class names.

    Examples::

        >>> from captum_vit.cards import from_card, read_card
        >>> lm = from_card(read_card("m.json"), "m.safetensors")
    """
    from safetensors.torch import load_file
    from timm.models.vision_transformer import VisionTransformer

    w = Path(weights)
    if not w.is_file():
        raise FileNotFoundError(f"weights {w} not found (a .safetensors state dict)")
    model = VisionTransformer(**card["timm_kwargs"])
    model.load_state_dict(load_file(str(w)), strict=True)
    norm = card.get("normalization") or {}
    names = class_names if class_names is not None else card.get("class_names")
    return loaded_model(model.eval(), norm.get("mean"), norm.get("std"), names, card=card)


def loaded_model(model: nn.Module, mean: Sequence[float] | float | None,
            std: Sequence[float] | float | None, class_names: Sequence[str] | None, *,
            card: dict | None = None, random_weights: bool = False,
            targets: Any = None) -> LoadedModel:
    r"""The :class:`LoadedModel` of ``model``: preprocessing at its input shape, checked class
    names and target vectors (every model spec ends here).

    Args:
        model (nn.Module): the model, in eval mode.
        mean (Sequence[float] or float, optional): normalisation mean (one value or one
            per channel); ``None`` = no normalisation.
        std (Sequence[float] or float, optional): normalisation standard deviation.
        class_names (Sequence[str], optional): one name per output class (or per target
            vector).
        card (dict, optional): the model card, kept in :attr:`LoadedModel.card`.
        random_weights (bool, optional): whether the weights are random. Default False.
        targets (Tensor, EmbeddingTarget or path, optional): target vectors of an
            embedding model (:func:`captum_vit.targets.read_target_embeddings`).

    Returns:
        LoadedModel: the model with its preprocessing, names, card and targets.

    Raises:
        ValueError: class names whose count differs from the model's classes, or target
            vectors for a classifier or of the wrong size.

    Examples::

        >>> from captum_vit.cards import loaded_model
        >>> lm = loaded_model(model, (0.5,), (0.5,), None)
        >>> lm.preprocess.mean
        (0.5,)
    """
    adapter = adapt(model)
    channels, size = adapter.input_shape
    num_classes = adapter.num_classes
    if targets is not None:
        from captum_vit.targets import EmbeddingTarget, read_target_embeddings

        if not adapter.embedding:
            raise ValueError(f"target embeddings are for models that output an image "
                             f"embedding; this {type(model).__name__} is a classifier")
        if isinstance(targets, (str, os.PathLike)):
            targets = read_target_embeddings(targets)
        if not isinstance(targets, EmbeddingTarget):
            targets = EmbeddingTarget(targets)
        v = targets.vectors
        if v.shape[-1] != num_classes or v.dim() not in (1, 2):
            raise ValueError(f"target embeddings must be [T, {num_classes}] (the model's "
                             f"embedding size), got {tuple(v.shape)}")
        num_classes = 1 if v.dim() == 1 else int(v.shape[0])

    def values(v: Sequence[float] | float | None) -> tuple[float, ...] | None:
        if v is None:
            return None
        return tuple(float(f) for f in v) if isinstance(v, (list, tuple)) else (
            float(cast(float, v)),)

    names = None
    if class_names is not None:
        names = tuple(str(n) for n in class_names)
        if len(names) != num_classes:
            what = "target vectors" if targets is not None else "classes"
            raise ValueError(f"{len(names)} class names for a model with {num_classes} "
                             f"{what}; give one name per output class")
    pre = Preprocess(int(channels), (int(size[0]), int(size[1])), values(mean), values(std))
    return LoadedModel(model, pre, names, card, random_weights, targets)


__all__ = ["LoadedModel", "from_card", "loaded_model", "read_card"]
