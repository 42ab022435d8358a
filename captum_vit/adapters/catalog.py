"""The family catalogue: ``@register_family`` beside every adapter class fills one table
that dispatch (:func:`captum_vit.adapters.adapt`), the refusal's supported-models text, the
tests, the support matrix and the docs' families table (its ``notes``) read.

A model family is one file in :mod:`captum_vit.adapters.families` plus one import line in
that package's ``__init__`` (whose order is the dispatch order)::

    @register_family(is_timm_vit, supports="timm VisionTransformer (ViT, DeiT, ...)",
                     tags=("classifier", "embedding", "variable-size"),
                     examples={"vit": Example(build_vit, size=(32, 32))})
    class TimmViTAdapter(ViTAdapter):
        ...

An :class:`Example` is a named builder of a tiny random model of the family, with the size of
its inputs and its default target kind; the contract suite, the twin tests, the support
matrix and the docs iterate over them. Tags say what a family or an example is
(:data:`TAGS`); tests pick their expectations from tags, never from family names.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch
from torch import nn

TAGS: dict[str, str] = {
    "classifier": "outputs class scores (integer targets)",
    "embedding": "outputs an image embedding (vector targets)",
    "windowed": "attends within windows (no true token removal)",
    "shared_windows": "windows that share a token (divided space-time attention: the class "
                      "token in every frame's window); methods reading window slots one "
                      "token each refuse it",
    "hierarchical": "stages with patch merges between them",
    "pooling": "query pooling at the stage changes (Hiera): methods reading the blocks' "
               "token-mixing matrices refuse by name",
    "video": "takes videos [B, T, C, H, W]",
    "vlm-tower": "the vision tower of a vision-language model",
    "packed": "one packed q/k/v in-projection (nn.MultiheadAttention)",
    "variable-size": "runs at input sizes other than the configured one",
    "detection": "an object detector (explained through DetectionTarget)",
    "dense": "a dense-prediction backbone (depth, segmentation)",
    "reference": "a timm VisionTransformer the per-method reference implementations read",
    "matrix": "a support-matrix column only (a whole model around the explained tower, or a "
              "twin its family's own tests read): the tests' family tables leave it out",
}
"""The tags a family or an example may carry, and what each says."""

TARGETS = ("class", "embedding", "detection", "vlm", "depth", "sam_mask")
"""An example's default target kind: a class index, an embedding vector, a detection, a
vision-language model's answer (``VLMAnswer``), the depth of a region (``DepthTarget``), a
mask of SAM's prompt encoder and mask decoder (``SamMaskTarget``)."""

LIBRARIES = ("timm", "transformers", "torchvision", "open_clip")
"""The library an example's model comes from (timm is a dependency, the others extras)."""

A = TypeVar("A", bound=type)


@dataclasses.dataclass(frozen=True)
class Example:
    """A named builder of a tiny random model of a family.

    Args:
        build (Callable): ``build(*, seed, depth, dtype, num_classes, **overrides)`` -> the
            model in eval mode (the same seed builds the same weights).
        size (tuple of int): the input size, ``(H, W)`` for images or ``(T, H, W)`` for
            videos.
        library (str): where the model class comes from (:data:`LIBRARIES`).
        target (str, optional): the default target kind (:data:`TARGETS`). Default
            ``"class"``.
        tags (tuple of str, optional): tags of this example besides its family's.
        suite (bool, optional): whether the contract suite runs it (``False``: its own
            test module does). Default ``True``.
    """

    build: Callable[..., nn.Module]
    size: tuple[int, ...]
    library: str = "timm"
    target: str = "class"
    tags: tuple[str, ...] = ()
    suite: bool = True

    def __post_init__(self) -> None:
        if self.library not in LIBRARIES:
            raise ValueError(f"library must be one of {LIBRARIES}, got {self.library!r}")
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {self.target!r}")
        unknown = sorted(set(self.tags) - set(TAGS))
        if unknown:
            raise ValueError(f"unknown tags {unknown}: add them to TAGS with what they say")

    def model(self, *, seed: int = 0, depth: int = 3, dtype: torch.dtype = torch.float64,
              num_classes: int = 5, **overrides: Any) -> nn.Module:
        """The example model (eval mode) built from ``seed``.

        Args:
            seed (int, optional): the weights' seed. Default 0.
            depth (int, optional): the number of blocks (where the family has one depth).
                Default 3.
            dtype (torch.dtype, optional): the parameters' dtype. Default float64.
            num_classes (int, optional): the classes of a classifier. Default 5.
            **overrides: constructor or config options of the builder.

        Returns:
            nn.Module: the model.
        """
        return self.build(seed=seed, depth=depth, dtype=dtype, num_classes=num_classes,
                          **overrides)

    def inputs(self, batch: int = 3, *, seed: int = 1,
               dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """Random inputs ``[batch, 3, H, W]`` (videos: ``[batch, T, 3, H, W]``).

        Args:
            batch (int, optional): the batch size. Default 3.
            seed (int, optional): the generator's seed. Default 1.
            dtype (torch.dtype, optional): the dtype. Default float64.

        Returns:
            torch.Tensor: the inputs.
        """
        g = torch.Generator().manual_seed(seed)
        if len(self.size) == 3:
            t, h, w = self.size
            return torch.randn(batch, t, 3, h, w, generator=g).to(dtype)
        h, w = self.size
        return torch.randn(batch, 3, h, w, generator=g).to(dtype)


@dataclasses.dataclass(frozen=True)
class Family:
    """One row of the catalogue (see :func:`register_family`)."""

    name: str
    adapter: type
    predicate: Callable[[nn.Module], bool]
    supports: str
    tags: tuple[str, ...]
    examples: Mapping[str, Example]
    notes: str = ""

    def example_tags(self, example: str) -> frozenset[str]:
        """The tags of ``example``: its family's and its own."""
        return frozenset(self.tags) | frozenset(self.examples[example].tags)


_CATALOG: dict[str, Family] = {}


def register_family(predicate: Callable[[nn.Module], bool], *, supports: str,
                    tags: tuple[str, ...] = (),
                    examples: Mapping[str, Example] | None = None,
                    name: str | None = None, notes: str = "") -> Callable[[A], A]:
    """Class decorator: register an adapter class as a model family.

    Families are tried in the order they are registered (the import order of
    :mod:`captum_vit.adapters.families`): :func:`~captum_vit.adapters.adapt` uses the first
    whose ``predicate`` accepts the model.

    Args:
        predicate (Callable): ``predicate(model) -> bool``, whether the adapter explains
            ``model``; it must not import optional libraries the model did not.
        supports (str): one line a user reads in the refusal of an unsupported model.
        tags (tuple of str, optional): what the family is (:data:`TAGS`).
        examples (dict, optional): example name -> :class:`Example`; example names are
            unique over the catalogue.
        name (str, optional): the family's name. Default: the defining module's last
            name (``timm_vit``).
        notes (str, optional): what works on the family and what is refused, one line of
            Markdown: the "what works" cell of the docs' families table
            (``python docs/families_api.py`` renders it). Default ``""``.

    Returns:
        Callable: the decorator; it returns the class unchanged.

    Raises:
        ValueError: an unknown tag, a family name or an example name taken already.

    Examples::

        >>> @register_family(lambda m: type(m).__name__ == "MyViT", supports="MyViT")
        ... class MyViTAdapter(ViTAdapter):
        ...     ...
    """
    unknown = sorted(set(tags) - set(TAGS))
    if unknown:
        raise ValueError(f"unknown tags {unknown}: add them to TAGS with what they say")
    if not supports or "\n" in supports:
        raise ValueError("supports must be one non-empty line")
    if "\n" in notes or re.search(r"(?<!\\)\|", notes):
        raise ValueError("notes must be one line with no unescaped '|' (a Markdown table "
                         "cell): write '\\|' for a literal bar")

    def decorate(cls: A) -> A:
        family = name or cls.__module__.rsplit(".", 1)[-1]
        if family in _CATALOG:
            raise ValueError(f"family {family!r} is registered already "
                             f"({_CATALOG[family].adapter.__name__}); pass name=")
        taken = {e for f in _CATALOG.values() for e in f.examples}
        clash = sorted(taken & set(examples or {}))
        if clash:
            raise ValueError(f"example names {clash} are taken by another family")
        _CATALOG[family] = Family(family, cls, predicate, supports, tuple(tags),
                                  dict(examples or {}), notes)
        return cls

    return decorate


def unregister_family(name: str) -> None:
    """Remove the family ``name`` from the catalogue (tests register throw-away ones).

    Args:
        name (str): a registered family.

    Raises:
        ValueError: ``name`` is not registered.
    """
    if name not in _CATALOG:
        raise ValueError(f"no family {name!r}; registered: {', '.join(_CATALOG)}")
    del _CATALOG[name]


def families() -> tuple[Family, ...]:
    """Every registered family, in dispatch order.

    Returns:
        tuple of Family: the catalogue's rows.
    """
    return tuple(_CATALOG.values())


def family(name: str) -> Family:
    """The registered family ``name``.

    Args:
        name (str): a family name (``"timm_vit"``).

    Returns:
        Family: its catalogue row.

    Raises:
        ValueError: ``name`` is not registered.
    """
    if name not in _CATALOG:
        raise ValueError(f"no family {name!r}; registered: {', '.join(_CATALOG)}")
    return _CATALOG[name]


def examples() -> Iterator[tuple[str, Family, Example]]:
    """Every example of every family, in dispatch order.

    Returns:
        Iterator: ``(example name, family, example)`` triples.
    """
    for fam in list(_CATALOG.values()):
        for ex_name, ex in fam.examples.items():
            yield ex_name, fam, ex


def example(name: str) -> tuple[Family, Example]:
    """The family and example named ``name``.

    Args:
        name (str): an example name (``"vit"``, ``"hf_dinov2"``).

    Returns:
        tuple: ``(family, example)``.

    Raises:
        ValueError: no family has an example ``name``.
    """
    for ex_name, fam, ex in examples():
        if ex_name == name:
            return fam, ex
    raise ValueError(f"no example model {name!r}; see captum_vit.adapters.catalog.examples()")


def adapters() -> tuple[tuple[Callable[[nn.Module], bool], type], ...]:
    """``(predicate, adapter class)`` rows in dispatch order.

    Returns:
        tuple: the rows :func:`~captum_vit.adapters.adapt` tries in order.
    """
    return tuple((f.predicate, f.adapter) for f in _CATALOG.values())


def supported() -> str:
    """What :func:`~captum_vit.adapters.adapt` supports: every family's ``supports`` line.

    Returns:
        str: the lines joined with ``"; "``.
    """
    return "; ".join(f.supports for f in _CATALOG.values())


__all__ = ["LIBRARIES", "TAGS", "TARGETS", "Example", "Family", "adapters", "example",
           "examples", "families", "family", "register_family", "supported",
           "unregister_family"]
