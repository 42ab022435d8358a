"""The method table and the decorators that fill it, beside each class.

A method registers itself where it is defined (as timm's ``@register_model`` and zennit's
``@register_composite``)::

    @register_method("tokentm", kind="gradient_attention",
                     variants={"tokentm_residual": {"variant": "residual"}})
    class TokenTM(ViTGradientAttribution):
        ...

and the one import list, :mod:`captum_vit.methods`, fills the table in the order of its
lines (the order of tables and plots). The combinators register with
:func:`register_combinator`. This module also holds the grammar of a single method name
(:func:`canonical_name`, :func:`composition_base`), which the combinators need to resolve a
base named by a string; :mod:`captum_vit.registry` builds the command-line grammar on it.

A name is one of

* a registered method's canonical snake_case name (``"gae"``, ``"tokentm_residual"``,
  ``"random"`` — the chance-level baseline), its class name (``"GAE"``, ``"TokenTM"``) or
  any spelling of either that differs only in case, ``_`` or ``-`` (``"Raw-Attention"``);
* a composition ``plus:<name>`` / ``skipplus:<name>``, also written ``PLUS(<name>)`` /
  ``SkipPLUS(<name>)``, where ``<name>`` is any registered method except those registered
  with ``composable=False`` (FullGrad+, itself a sum over blocks), a base kind of the
  combinators (``ixg``, ``gradient``) or ``captum:<ClassName>``; nested compositions
  (``plus:skipplus:gae``) are refused;
* ``captum:<ClassName>``: any attribution class of ``captum.attr`` built from the model.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from captum.attr import Attribution
from torch import nn

KINDS: dict[str, str] = {
    "attention": "attention & rollout",
    "gradient_attention": "gradient × attention",
    "gradient": "gradient & input × gradient",
    "cam": "CAM on tokens",
    "decomposition": "decomposition & LRP",
    "perturbation": "perturbation",
    "composition": "PLUS / SkipPLUS",
    "captum": "Captum",
    "baseline": "baseline",
}
"""Method kinds, key -> label, in the order ``captum-vit explain`` groups its panels.
Every :class:`MethodEntry` names one; compositions (``plus:<name>``) and
``captum:<Class>`` have their own. (A *kind* of method: what its map is computed from;
"family" always means a model family.)"""

COMBINATOR_BASES = ("ixg", "gradient")
"""Base kinds the combinators take that are not methods of their own: token IxG and the
vanilla gradient (:mod:`captum_vit.combinators`)."""


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
        composable (bool): whether ``plus:<name>`` / ``skipplus:<name>`` exist.
        kind (str): a key of :data:`KINDS` (keyword only, required): what the
            method computes its map from (attention, gradients and attention, CAM, a
            decomposition or relevance propagation, perturbations).
    """

    name: str
    cls: type[Attribution]
    build: Callable[[nn.Module, int], Attribution]
    class_alias: bool = True
    baseline: bool = False
    quick: dict = field(default_factory=dict)
    composable: bool = True
    """Whether PLUS / SkipPLUS may take it as a base (False for FullGrad+, itself a sum
    over blocks)."""
    kind: str = field(kw_only=True)
    """The method's kind, a key of :data:`KINDS`."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind must be one of "
                             f"{', '.join(map(repr, KINDS))}, got {self.kind!r}")


_ENTRIES: dict[str, MethodEntry] = {}
"""Canonical name -> entry, in the order of registration."""

COMBINATORS: dict[str, type] = {}
"""Composition prefixes (``plus:<name>``) and the combinator each builds, filled by
:func:`register_combinator`."""

_LOOKUP: dict[str, MethodEntry] = {}

T = TypeVar("T", bound=type)


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _builder(cls: type, options: Mapping[str, Any], seeded: bool
             ) -> Callable[[nn.Module, int], Attribution]:
    def build(model: nn.Module, seed: int) -> Attribution:
        return cls(model, **options, **({"seed": seed} if seeded else {}))

    return build


def _refresh() -> None:
    _LOOKUP.clear()
    for e in _ENTRIES.values():
        _LOOKUP[_key(e.name)] = e
    for e in _ENTRIES.values():
        if e.class_alias:
            _LOOKUP.setdefault(_key(e.cls.__name__), e)


def _same_class(a: type, b: type) -> bool:
    return (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__)


def register_method(name: str, *, kind: str,
                    variants: Mapping[str, Mapping[str, Any]] | None = None,
                    quick: Mapping[str, Any] | None = None, baseline: bool = False,
                    composable: bool = True, seeded: bool = False) -> Callable[[T], T]:
    """Class decorator: register a method under ``name`` (and its ``variants``).

    Args:
        name (str): the canonical snake_case name (``"tokentm"``); the class name is an
            alias of it.
        kind (str): a key of :data:`KINDS`: what the method computes its map from.
        variants (dict, optional): further names of non-default configurations, name ->
            constructor keywords (``{"tokentm_residual": {"variant": "residual"}}``);
            their class name is no alias. Registered right after ``name``.
        quick (dict, optional): ``attribute`` options for a quick look
            (``captum-vit explain``), e.g. ``{"n_masks": 128}``; also the variants'.
        baseline (bool, optional): a reference row (``random``), not an explanation.
            Default False.
        composable (bool, optional): whether PLUS / SkipPLUS may take it as a base.
            Default True.
        seeded (bool, optional): whether the constructor takes ``seed`` (the registry
            passes its ``seed`` on). Default False.

    Returns:
        Callable: the decorator; it returns the class unchanged.

    Raises:
        ValueError: an unknown kind, or a name (or its normalised spelling) that
            another class registered already.

    Examples::

        >>> from captum_vit._base import ViTGradientAttribution
        >>> from captum_vit.methods.table import register_method
        >>> @register_method("my_method", kind="gradient", quick={"n_steps": 4})
        ... class MyMethod(ViTGradientAttribution):
        ...     ...
    """
    configs = {name: {}, **dict(variants or {})}

    def decorate(cls: T) -> T:
        entries = [MethodEntry(n, cls, _builder(cls, dict(opts), seeded),
                               class_alias=n == name, baseline=baseline,
                               quick=dict(quick or {}), composable=composable, kind=kind)
                   for n, opts in configs.items()]
        for e in entries:
            old = _LOOKUP.get(_key(e.name))
            if old is not None and not _same_class(old.cls, cls):
                raise ValueError(f"method name {e.name!r} is taken by {old.cls.__name__} "
                                 f"({old.name!r}); choose another name")
        for e in entries:  # a re-imported class (importlib.reload) replaces its rows
            _ENTRIES[e.name] = e
        _refresh()
        return cls

    return decorate


def unregister_method(name: str) -> list[MethodEntry]:
    """Remove the method ``name`` and every other name of its class from the table.

    Args:
        name (str): a registered name (any spelling).

    Returns:
        list[MethodEntry]: the removed entries.

    Raises:
        ValueError: an unknown name.

    Examples::

        >>> from captum_vit.methods.table import unregister_method
        >>> removed = unregister_method("my_method")
    """
    entry = _LOOKUP.get(_key(name))
    if entry is None:
        raise _unknown(name)
    removed = [e for e in _ENTRIES.values() if e.cls is entry.cls]
    for e in removed:
        del _ENTRIES[e.name]
    _refresh()
    return removed


def register_combinator(prefix: str) -> Callable[[T], T]:
    """Class decorator: register a combinator (PLUS, SkipPLUS) under the composition
    prefix ``prefix`` (``plus:<name>``, also written ``PLUS(<name>)``).

    Args:
        prefix (str): the lower-case prefix.

    Returns:
        Callable: the decorator; it returns the class unchanged.

    Examples::

        >>> from captum_vit.methods.table import register_combinator
        >>> @register_combinator("skipplus")
        ... class SkipPLUS(PLUS):
        ...     ...
    """
    def decorate(cls: T) -> T:
        COMBINATORS[_key(prefix)] = cls
        return cls

    return decorate


def method_entries() -> tuple[MethodEntry, ...]:
    """Every registered method, in the order of tables and plots.

    Returns:
        tuple[MethodEntry, ...]

    Examples::

        >>> from captum_vit.methods.table import method_entries
        >>> [e.name for e in method_entries()][:3]
        ['raw_attention', 'rollout', 'gae']
    """
    return tuple(_ENTRIES.values())


def lookup(name: str) -> MethodEntry | None:
    """The entry of a registered method's name in any spelling, ``None`` for another
    name (a composition, ``captum:<Class>``, a combinator base kind or an unknown one)."""
    return _LOOKUP.get(_key(name))


def method_names(baselines: bool = True, compositions: tuple[str, ...] | list[str] = ()
                 ) -> list[str]:
    """Canonical names in table order: the methods, then ``compositions``, then the
    baselines (with ``baselines=True``)."""
    entries = _ENTRIES.values()
    names = [e.name for e in entries if not e.baseline] + list(compositions)
    return names + [e.name for e in entries if e.baseline and baselines]


def refuses_windows(cls: type) -> bool:
    """Whether the method class ``cls`` declares that it removes tokens from the model's
    input (``removes_tokens = True``, :attr:`captum_vit._base.ViTFront.removes_tokens`:
    TIS's token subsets), so that a model with windowed attention refuses it."""
    return bool(getattr(cls, "removes_tokens", False))


def windowed_methods(*, refused: bool = False) -> list[str]:
    """Canonical names of the registered methods that run on models with windowed
    attention (Swin, SAM's image encoder), in table order; with ``refused=True`` those
    that such a model refuses by name: the methods whose class declares
    ``removes_tokens = True`` (the window partition needs every token of its grid).

    Args:
        refused (bool, optional): list the refused methods instead. Default False.

    Returns:
        list[str]: canonical names, read from the table and each class's declaration.

    Examples::

        >>> from captum_vit.registry import windowed_methods
        >>> windowed_methods(refused=True)
        ['tis']
        >>> "rise" in windowed_methods()
        True
    """
    return [e.name for e in _ENTRIES.values() if refuses_windows(e.cls) == refused]


def pooling_methods() -> list[str]:
    """Canonical names of the registered methods that run through query pooling (Hiera),
    in table order: those whose class declares ``pools_queries = True`` and keeps every
    token.

    Returns:
        list[str]: canonical names.

    Examples::

        >>> "decompx" in pooling_methods(), "tis" in pooling_methods()
        (True, False)
    """
    return [e.name for e in _ENTRIES.values() if getattr(e.cls, "pools_queries", False)
            and not refuses_windows(e.cls)]


def windowed_refusal(method: str, model: str) -> str:
    """The message of a model with windowed attention refusing a method that removes
    tokens: the registered methods that mask pixels instead (the perturbation methods
    that keep every token) and every registered method that runs there, read from the
    table and each class's declaration (:func:`windowed_methods`).

    Args:
        method (str): the refused method's name.
        model (str): the model's class name.

    Returns:
        str: the message.
    """
    runs = [e for e in _ENTRIES.values() if e.class_alias and not e.baseline
            and not refuses_windows(e.cls)]
    names = list(dict.fromkeys(e.cls.__name__ for e in runs))
    pixels = list(dict.fromkeys(e.cls.__name__ for e in runs if e.kind == "perturbation"))
    instead = f" ({' or '.join(pixels)} mask pixels)" if pixels else ""
    return (f"{method} removes tokens (true token removal), and this {model} attends within "
            f"windows of a fixed token grid, which need every token: remove pixels "
            f"instead{instead}; on windowed models run {', '.join(names)}")


def sums_blocks(cls: type) -> bool:
    """Whether instances of ``cls`` are themselves sums over blocks (a combinator or a
    method registered with ``composable=False``), so no base of PLUS / SkipPLUS."""
    classes = [*COMBINATORS.values(), *(e.cls for e in _ENTRIES.values() if not e.composable)]
    return any(issubclass(cls, c) for c in classes)


_COMPOSED = re.compile(r"^\s*([A-Za-z_-]+)\s*(?::\s*(.+?)|\(\s*(.+?)\s*\))\s*$")


def _unknown(name: str) -> ValueError:
    return ValueError(
        f"unknown method {name!r}; choose from {', '.join(method_names())}, "
        "'plus:<name>', 'skipplus:<name>' (or 'SkipPLUS(<name>)') or 'captum:<ClassName>'")


def captum_class(name: str) -> type:
    """The ``captum.attr`` class of ``captum:<ClassName>``.

    Raises:
        ValueError: no attribution class of that name in ``captum.attr``.
    """
    import captum.attr

    cls = getattr(captum.attr, name.split(":", 1)[1].strip(), None)
    if not (isinstance(cls, type) and issubclass(cls, Attribution)):
        raise ValueError(f"unknown Captum attribution class in {name!r}; use a class name "
                         "from captum.attr such as 'captum:IntegratedGradients'")
    return cls


def split_composition(canon: str) -> tuple[str, str] | None:
    """``(prefix, base)`` of a canonical composition name, ``None`` for another name."""
    prefix, sep, inner = canon.partition(":")
    return (prefix, inner) if sep and prefix in COMBINATORS else None


def _base_name(inner: str, name: str) -> str:
    """The canonical name of the base of composition ``name``."""
    if _key(inner) in COMBINATOR_BASES:
        return _key(inner)
    canon = canonical_name(inner)
    if split_composition(canon) is not None:
        raise ValueError(f"nested composition {name!r}: PLUS and SkipPLUS take one base method, "
                         f"not another composition ({canon!r})")
    entry = lookup(canon)
    if entry is not None and not entry.composable:
        raise ValueError(f"{name!r}: {entry.name} is itself a sum over blocks (FullGrad+), "
                         "not a base for PLUS/SkipPLUS; compose its base instead (plus:ixg)")
    return canon


def canonical_name(name: str) -> str:
    """The canonical spelling of a method name (see the module docstring).

    Args:
        name (str): any accepted spelling.

    Returns:
        str: the canonical name, e.g. ``"skipplus:decompx"`` for ``"SkipPLUS(DecompX)"``.

    Raises:
        TypeError: if ``name`` is not a str.
        ValueError: for an unknown name (the message lists the known ones) or a nested
            composition.

    Examples::

        >>> from captum_vit.registry import canonical_name
        >>> canonical_name("GAE"), canonical_name("SkipPLUS(DecompX)")
        ('gae', 'skipplus:decompx')
        >>> canonical_name("PLUS(TokenTM_Residual)")
        'plus:tokentm_residual'
    """
    if not isinstance(name, str):
        raise TypeError(f"method name must be a str, got {type(name).__name__}")
    if name.strip().lower().startswith("captum:"):
        cls = captum_class(name)
        return f"captum:{cls.__name__}"
    m = _COMPOSED.match(name)
    if m and _key(m.group(1)) in COMBINATORS:
        return f"{_key(m.group(1))}:{_base_name((m.group(2) or m.group(3)).strip(), name)}"
    entry = lookup(name)
    if entry is None:
        raise _unknown(name)
    return entry.name


def composition_base(name: str, *, seed: int = 0) -> str | type | Callable:
    """What :class:`~captum_vit.combinators.PLUS` / ``SkipPLUS`` take as base for the
    method called ``name``.

    Args:
        name (str): a registered method (any spelling), a combinator base kind (``ixg``,
            ``gradient``) or ``captum:<ClassName>``; not a composition.
        seed (int, optional): seed of seeded methods. Default 0.

    Returns:
        The base kind (str), the Captum class, or a factory ``f -> Attribution`` building
        the registered method on each sub-network ``f``.

    Raises:
        ValueError: unknown name, a composition, or a method that cannot be a base.

    Examples::

        >>> from captum_vit import PLUS
        >>> from captum_vit.registry import composition_base
        >>> plus = PLUS(model, composition_base("tokentm_residual"))
    """
    if not isinstance(name, str):
        raise TypeError(f"method name must be a str, got {type(name).__name__}")
    canon = _base_name(name, name)
    if canon in COMBINATOR_BASES:
        return canon
    if canon.startswith("captum:"):
        return captum_class(canon)
    entry = _LOOKUP[_key(canon)]

    def factory(f: nn.Module) -> Attribution:
        return entry.build(f, seed)

    factory.__name__ = canon
    return factory


__all__ = [
    "COMBINATORS", "COMBINATOR_BASES", "KINDS", "MethodEntry", "canonical_name",
    "captum_class", "composition_base", "lookup", "method_entries", "method_names",
    "refuses_windows", "register_combinator", "register_method", "split_composition",
    "sums_blocks", "unregister_method", "windowed_methods", "windowed_refusal",
]
