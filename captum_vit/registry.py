"""The only list of method names: Python, both commands, the metrics and the tutorials
parse names here.

A name is one of

* a registered method's canonical snake_case name (``"gae"``, ``"tokentm_residual"``,
  ``"random"`` — the chance-level baseline), its class name (``"GAE"``, ``"TokenTM"``) or
  any spelling of either that differs only in case, ``_`` or ``-`` (``"Raw-Attention"``);
* a composition ``plus:<name>`` / ``skipplus:<name>``, also written ``PLUS(<name>)`` /
  ``SkipPLUS(<name>)`` (``"SkipPLUS(DecompX)"`` = ``"skipplus:decompx"``), where
  ``<name>`` is a registered name, a base kind of the combinators (``ixg``,
  ``gradient``) or ``captum:<ClassName>``;
* ``captum:<ClassName>``: any attribution class of ``captum.attr`` built from the model.

:func:`canonical_name` turns every spelling into one canonical string, so ``"GAE"``,
``"gae"`` and ``"G_A_E"`` are the same method everywhere (tables, CLI, Python).
Adding a method is one row of :data:`METHODS`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from captum.attr import Attribution
from torch import nn

from captum_vit.combinators import PLUS, FullGradPlus, SkipPLUS
from captum_vit.methods import (
    GAE,
    TIS,
    AttCAT,
    AttIxG,
    AttnGradCAM,
    DecompX,
    RandomMap,
    RawAttention,
    Rollout,
    TokenIxG,
    TokenTM,
)


@dataclass(frozen=True)
class MethodEntry:
    """One registered method.

    Attributes:
        name (str): canonical snake_case name.
        cls (type): the attribution class.
        build (Callable): ``build(model, seed) -> Attribution``.
        class_alias (bool): whether the class name also names this entry (False for a
            non-default configuration of a class, e.g. ``tokentm_residual``).
        baseline (bool): a reference row (``random``), not an explanation: left out of
            ``explain``'s default grid.
        quick (dict): ``attribute`` options for a quick look (``captum-vit explain``);
            the method's own defaults are the paper's.
    """

    name: str
    cls: type
    build: Callable[[nn.Module, int], Attribution]
    class_alias: bool = True
    baseline: bool = False
    quick: dict = field(default_factory=dict)


def _plain(cls: type) -> Callable[[nn.Module, int], Attribution]:
    return lambda model, seed: cls(model)


METHODS: tuple[MethodEntry, ...] = (
    MethodEntry("raw_attention", RawAttention, _plain(RawAttention)),
    MethodEntry("rollout", Rollout, _plain(Rollout)),
    MethodEntry("gae", GAE, _plain(GAE)),
    MethodEntry("attn_gradcam", AttnGradCAM, _plain(AttnGradCAM)),
    MethodEntry("attcat", AttCAT, _plain(AttCAT)),
    MethodEntry("tokentm", TokenTM, _plain(TokenTM)),
    MethodEntry("tokentm_residual", TokenTM, lambda m, s: TokenTM(m, variant="residual"),
                class_alias=False),
    MethodEntry("token_ixg", TokenIxG, _plain(TokenIxG)),
    MethodEntry("att_ixg", AttIxG, _plain(AttIxG)),
    MethodEntry("decompx", DecompX, _plain(DecompX)),
    MethodEntry("tis", TIS, _plain(TIS), quick={"n_masks": 128}),
    MethodEntry("fullgrad_plus", FullGradPlus, _plain(FullGradPlus)),
    MethodEntry("skip_fullgrad_plus", FullGradPlus, lambda m, s: FullGradPlus(m, skip=True),
                class_alias=False),
    MethodEntry("random", RandomMap, lambda m, s: RandomMap(m, seed=s), baseline=True),
)
"""Every registered method, in the order of tables and plots."""

COMBINATORS: dict[str, type] = {"plus": PLUS, "skipplus": SkipPLUS}
"""Composition prefixes (``plus:<name>``) and the combinator each builds."""

COMBINATOR_BASES = ("ixg", "gradient")
"""Base kinds the combinators take that are not methods of their own (SPEC §4)."""

FEATURED_COMPOSITIONS = ("plus:decompx", "skipplus:decompx")
"""Compositions included in ``all`` (the SkipPLUS paper's headline)."""


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _lookup() -> dict[str, MethodEntry]:
    table: dict[str, MethodEntry] = {}
    for e in METHODS:
        table[_key(e.name)] = e
    for e in METHODS:
        if e.class_alias:
            table.setdefault(_key(e.cls.__name__), e)
    return table


_LOOKUP = _lookup()
_COMPOSED = re.compile(r"^\s*([A-Za-z_-]+)\s*(?::\s*(.+?)|\(\s*(.+?)\s*\))\s*$")


def available_methods(*, baselines: bool = True, compositions: bool = False) -> list[str]:
    """Canonical names of the registered methods.

    Args:
        baselines (bool, optional): include reference rows (``random``). Default True.
        compositions (bool, optional): add :data:`FEATURED_COMPOSITIONS` (before the
            baselines). Default False.

    Returns:
        list[str]: names accepted by :func:`build_method`, in table order.

    Examples::

        >>> from captum_vit.registry import available_methods
        >>> available_methods()[:3]
        ['raw_attention', 'rollout', 'gae']
    """
    names = [e.name for e in METHODS if not e.baseline]
    names += list(FEATURED_COMPOSITIONS) if compositions else []
    return names + [e.name for e in METHODS if e.baseline and baselines]


def _unknown(name: str) -> ValueError:
    return ValueError(
        f"unknown method {name!r}; choose from {', '.join(available_methods())}, "
        "'plus:<name>', 'skipplus:<name>' (or 'SkipPLUS(<name>)') or 'captum:<ClassName>'")


def _captum_class(name: str) -> type:
    import captum.attr

    cls = getattr(captum.attr, name.split(":", 1)[1].strip(), None)
    if not (isinstance(cls, type) and issubclass(cls, Attribution)):
        raise ValueError(f"unknown Captum attribution class in {name!r}; use a class name "
                         "from captum.attr such as 'captum:IntegratedGradients'")
    return cls


def canonical_name(name: str) -> str:
    """The canonical spelling of a method name (see the module docstring).

    Args:
        name (str): any accepted spelling.

    Returns:
        str: the canonical name, e.g. ``"skipplus:decompx"`` for ``"SkipPLUS(DecompX)"``.

    Raises:
        TypeError: if ``name`` is not a str.
        ValueError: for an unknown name (the message lists the known ones).

    Examples::

        >>> from captum_vit.registry import canonical_name
        >>> canonical_name("GAE"), canonical_name("SkipPLUS(DecompX)")
        ('gae', 'skipplus:decompx')
    """
    if not isinstance(name, str):
        raise TypeError(f"method name must be a str, got {type(name).__name__}")
    if name.strip().lower().startswith("captum:"):
        cls = _captum_class(name)
        return f"captum:{cls.__name__}"
    m = _COMPOSED.match(name)
    if m and _key(m.group(1)) in COMBINATORS:
        inner = (m.group(2) or m.group(3)).strip()
        if _key(inner) in COMBINATOR_BASES:
            return f"{_key(m.group(1))}:{_key(inner)}"
        return f"{_key(m.group(1))}:{canonical_name(inner)}"
    entry = _LOOKUP.get(_key(name))
    if entry is None:
        raise _unknown(name)
    return entry.name


def parse_methods(values: Sequence[str] | str, *, for_explain: bool = False) -> list[str]:
    """Canonical method names from command-line values (comma or space separated).

    ``all`` expands to every registered method plus :data:`FEATURED_COMPOSITIONS`
    (``explain`` leaves out the ``random`` baseline). Repeats are dropped.

    Args:
        values (str or sequence of str): e.g. ``["gae,rollout", "SkipPLUS(DecompX)"]``.
        for_explain (bool, optional): expand ``all`` without baselines. Default False.

    Returns:
        list[str]: canonical names in the given order.

    Raises:
        ValueError: for an empty list or an unknown name.

    Examples::

        >>> from captum_vit.registry import parse_methods
        >>> parse_methods(["GAE,skipplus:DecompX", "random"])
        ['gae', 'skipplus:decompx', 'random']
    """
    if isinstance(values, str):
        values = [values]
    names = [n.strip() for v in values for n in _split(v) if n.strip()]
    if not names:
        raise ValueError("no method given; name at least one method or 'all'")
    out: list[str] = []
    for n in names:
        if n.lower() == "all":
            out += available_methods(baselines=not for_explain, compositions=True)
        else:
            out.append(canonical_name(n))
    return list(dict.fromkeys(out))


def _split(value: str) -> list[str]:
    """Split on commas outside parentheses (``SkipPLUS(DecompX),gae``)."""
    parts, depth, cur = [], 0, ""
    for ch in value:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return parts + [cur]


def build_method(name: str, model: nn.Module, *, seed: int = 0) -> Attribution:
    """Instantiate the method called ``name`` for ``model``.

    Args:
        name (str): any spelling accepted by :func:`canonical_name`.
        model (torch.nn.Module): the model to explain.
        seed (int, optional): seed of seeded methods (``random``). Default 0.

    Returns:
        Attribution: the method instance.

    Raises:
        ValueError: for an unknown name (the message lists the known ones).

    Examples::

        >>> from captum_vit.registry import build_method
        >>> gae = build_method("GAE", model)
        >>> dx = build_method("SkipPLUS(DecompX)", model)
        >>> ig = build_method("captum:IntegratedGradients", model)
    """
    canon = canonical_name(name)
    if canon.startswith("captum:"):
        return _captum_class(canon)(model)
    prefix, sep, inner = canon.partition(":")
    if sep and prefix in COMBINATORS:
        base = _captum_class(inner) if inner.startswith("captum:") else inner
        return COMBINATORS[prefix](model, base)
    return _LOOKUP[_key(canon)].build(model, seed)


def quick_options(name: str) -> dict:
    """``attribute`` options for a quick look at method ``name`` (e.g. TIS with 128 masks
    instead of the paper's 1024); empty for compositions and Captum classes.

    Examples::

        >>> from captum_vit.registry import quick_options
        >>> quick_options("TIS")
        {'n_masks': 128}
    """
    entry = _LOOKUP.get(_key(canonical_name(name)))
    return dict(entry.quick) if entry is not None else {}


def method_factory(name: str, *, seed: int = 0) -> Callable[[nn.Module], Attribution]:
    """A factory ``model -> Attribution`` for ``name`` (the form the metrics take).

    The name is checked at once, so a typo fails before any work.

    Args:
        name (str): any spelling accepted by :func:`canonical_name`.
        seed (int, optional): seed of seeded methods. Default 0.

    Returns:
        Callable[[nn.Module], Attribution]

    Examples::

        >>> from captum_vit.metrics import randomization
        >>> from captum_vit.registry import method_factory
        >>> randomization(model, images, method_factory("gae")).value
    """
    canon = canonical_name(name)

    def factory(model: nn.Module) -> Attribution:
        return build_method(canon, model, seed=seed)

    factory.__name__ = canon
    return factory


__all__ = [
    "COMBINATORS", "FEATURED_COMPOSITIONS", "METHODS", "MethodEntry", "available_methods",
    "build_method", "canonical_name", "method_factory", "parse_methods", "quick_options",
]
