"""Class-name matching: a data set's class names (or WordNet ids) to a model's classes.

One place for every comparison of class names: :func:`class_key` (case, spaces and
punctuation ignored), :func:`match_class_names` (a data set's names to the model's, each to
exactly one class), :func:`class_index` (one name given on the command line) and the
ImageNet WordNet ids (:func:`model_wnids`, :func:`wnid_descriptions`: timm's
``ImageNetInfo``, as timm and Hugging Face name their ImageNet heads). The readers
(:mod:`captum_vit.data.specs`, :mod:`captum_vit.data.imagenet`) and the model loader
(:mod:`captum_vit.models`) build on it; it imports nothing of the package.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from functools import cache

log = logging.getLogger(__name__)

WNID = re.compile(r"^n\d{8}$")
"""A WordNet id (``n01440764``)."""

IMAGENET_SUBSETS = ("imagenet-1k", "imagenet-12k", "imagenet-21k-goog", "imagenet-21k-miil",
                    "imagenet-22k-ms", "imagenet-22k")
"""timm ImageNet label sets (``timm.data.ImageNetInfo``) that :func:`model_wnids` knows."""



@cache
def imagenet_wnids(subset: str = "imagenet-1k") -> tuple[str, ...]:
    r"""The WNIDs of an ImageNet label set in model class order (timm's
    ``ImageNetInfo``; for ImageNet-1k the sorted 1000 WNIDs).

    Args:
        subset (str, optional): a timm ImageNet subset (``imagenet-1k``,
            ``imagenet-21k-goog``, ...). Default ``"imagenet-1k"``.

    Returns:
        tuple[str, ...]: one WNID per model class.

    Examples::

        >>> from captum_vit.data.classes import imagenet_wnids
        >>> imagenet_wnids()[:2], len(imagenet_wnids())
        (('n01440764', 'n01443537'), 1000)
    """
    from timm.data import ImageNetInfo

    return tuple(ImageNetInfo(subset).label_names())


@cache
def _descriptions(subset: str) -> tuple[str, ...]:
    from timm.data import ImageNetInfo

    return tuple(ImageNetInfo(subset).label_descriptions())


def _first(name: str) -> str:
    return class_key(str(name).split(",")[0])


def model_wnids(class_names: Sequence[str] | None, num_classes: int
                ) -> tuple[str, ...] | None:
    r"""The WNID of each of a model's classes, or ``None`` when they cannot be told.

    From, in order: class names that are WNIDs; class names that are an ImageNet label set's
    descriptions in order (timm's ``ImageNetInfo``, as timm and Hugging Face
    ``config.id2label`` name ImageNet heads; compared by their first synonym, at least
    99 % in place); no names and 1000 classes: the ImageNet-1k head order (logged).

    Args:
        class_names (Sequence[str], optional): the model's class names.
        num_classes (int): the model's number of classes.

    Returns:
        tuple[str, ...] or None: one WNID per class.

    Examples::

        >>> from captum_vit.data.classes import model_wnids
        >>> model_wnids(None, 1000)[0]
        'n01440764'
        >>> model_wnids(["cat", "dog"], 2) is None
        True
    """
    if class_names is None:
        if num_classes == 1000:
            log.info("model class names unknown: assuming the ImageNet-1k order of timm and "
                     "Hugging Face heads (sorted WNIDs)")
            return imagenet_wnids()
        return None
    names = [str(n).strip() for n in class_names]
    if names and all(WNID.match(n) for n in names):
        return tuple(names)
    for subset, size in ((s, len(_descriptions(s))) for s in IMAGENET_SUBSETS):
        if size != len(names):
            continue
        same = sum(_first(a) == _first(b) for a, b in zip(names, _descriptions(subset),
                                                            strict=True))
        if same >= 0.99 * size:
            return imagenet_wnids(subset)
    return None


def wnid_descriptions(wnids: Sequence[str]) -> list[str]:
    r"""The ImageNet description (``"tench, Tinca tinca"``) of each WNID (the WNID itself
    when timm's ImageNet info does not know it).

    Args:
        wnids (Sequence[str]): WNIDs.

    Returns:
        list[str]: one description per WNID.

    Examples::

        >>> from captum_vit.data.classes import wnid_descriptions
        >>> wnid_descriptions(["n01440764"])
        ['tench, Tinca tinca']
    """
    from timm.data import ImageNetInfo

    info = ImageNetInfo("imagenet-22k")

    def describe(w: str) -> str:
        try:
            return str(info.label_name_to_description(w))
        except (KeyError, ValueError):
            return w

    return [describe(w) for w in wnids]


def class_key(name: str) -> str:
    """The matching key of a class name: lower case, letters and digits only.

    Examples::

        >>> from captum_vit.data.classes import class_key
        >>> class_key("T-shirt/top") == class_key("t-shirt_top") == "tshirttop"
        True
    """
    return re.sub(r"[^0-9a-z]", "", str(name).lower())


def match_class_names(names: Sequence[str], class_names: Sequence[str], *,
                      what: str = "class", strict: bool = True) -> list[int]:
    r"""The index in ``class_names`` of each of ``names``, matched case-insensitively and
    ignoring everything but letters and digits (:func:`class_key`); a name that matches
    no whole class name may match the first synonym of one (``"tench"`` matches
    ``"tench, Tinca tinca"``). Each name must match exactly one class.

    Args:
        names (Sequence[str]): the data set's class names (e.g. folder names).
        class_names (Sequence[str]): the model's class names.
        what (str, optional): what a name is, for the error message. Default ``"class"``.
        strict (bool, optional): raise for a name that matches no class or several;
            otherwise its index is ``-1``. Default True.

    Returns:
        list[int]: one index per name.

    Raises:
        ValueError: (``strict``) listing the unmatched names (and the known classes) and
            the ambiguous ones (with their candidates); the fix: ``--class-map FILE``.

    Examples::

        >>> from captum_vit.data.classes import match_class_names
        >>> match_class_names(["t-shirt_top", "DRESS"], ["T-shirt/top", "Trouser", "Dress"])
        [0, 2]
    """
    whole: dict[str, list[int]] = {}
    first: dict[str, list[int]] = {}
    for i, c in enumerate(class_names):
        whole.setdefault(class_key(c), []).append(i)
        first.setdefault(class_key(str(c).split(",")[0]), []).append(i)
    found = [whole.get(class_key(n)) or first.get(class_key(n), []) for n in names]
    idx = [f[0] if len(f) == 1 else -1 for f in found]
    missing = [n for n, f in zip(names, found, strict=True) if not f]
    double = [f"{n!r} ({', '.join(repr(class_names[i]) for i in f)})"
              for n, f in zip(names, found, strict=True) if len(f) > 1]
    if strict and (missing or double):
        parts = []
        if missing:
            parts.append(f"{what} {', '.join(map(repr, missing))} matches no class of the model "
                         "(names are compared ignoring case and non-alphanumerics); known "
                         f"classes: {_listing(class_names)}")
        if double:
            parts.append(f"{what} {', '.join(double)} matches several classes of the model")
        raise ValueError("; ".join(parts) + "; rename them or give --class-map FILE (JSON "
                         '{"name": model_index})')
    return idx


def _listing(names: Sequence[str], most: int = 30) -> str:
    """``names`` joined by commas, the first ``most`` of them."""
    more = f", ... ({len(names)} in all)" if len(names) > most else ""
    return ", ".join(str(n) for n in names[:most]) + more


def class_index(name: str, class_names: Sequence[str]) -> int:
    r"""The index of the class called ``name``: compared ignoring case, spaces and
    punctuation (``"sneaker"``, ``"T-shirt top"``); a name that is no whole class name
    may be the first synonym of one (``"tench"`` for ``"tench, Tinca tinca"``).

    Args:
        name (str): the class name.
        class_names (Sequence[str]): the model's class names (index = class).

    Returns:
        int: the class index.

    Raises:
        ValueError: ``name`` matches no class (the message lists some valid names) or
            several.

    Examples::

        >>> from captum_vit.data.classes import class_index
        >>> class_index("sneaker", ["T-shirt/top", "Sandal", "Sneaker"])
        2
    """
    text = str(name).strip()
    for key in (str.lower, class_key):
        found = [i for i, c in enumerate(class_names) if key(str(c).strip()) == key(text)]
        if not found:
            found = [i for i, c in enumerate(class_names)
                     if key(str(c).split(",")[0].strip()) == key(text)]
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise ValueError(f"{text!r} matches several classes of the model: "
                             + ", ".join(f"{class_names[i]!r} ({i})" for i in found))
    shown = ", ".join(str(c) for c in class_names[:12])
    more = f", ... ({len(class_names)} in all)" if len(class_names) > 12 else ""
    raise ValueError(f"{text!r} is not a class name of the model (compared ignoring case "
                     f"and punctuation); valid names: {shown}{more}")


__all__ = ["IMAGENET_SUBSETS", "WNID", "class_index", "class_key", "imagenet_wnids",
           "match_class_names", "model_wnids", "wnid_descriptions"]
