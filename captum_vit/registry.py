"""The only list of method names: Python, both commands, the metrics and the tutorials
parse names here.

A name is one of

* a registered method's canonical snake_case name (``"gae"``, ``"tokentm_residual"``,
  ``"random"`` — the chance-level baseline), its class name (``"GAE"``, ``"TokenTM"``) or
  any spelling of either that differs only in case, ``_`` or ``-`` (``"Raw-Attention"``);
* a composition ``plus:<name>`` / ``skipplus:<name>``, also written ``PLUS(<name>)`` /
  ``SkipPLUS(<name>)`` (``"SkipPLUS(DecompX)"`` = ``"skipplus:decompx"``,
  ``"SkipPLUS(TokenTM)"`` = ``"skipplus:tokentm"``), where ``<name>`` is any registered
  method except the FullGrad+ rows (themselves sums over blocks), a base kind of the
  combinators (``ixg``, ``gradient``) or ``captum:<ClassName>``; nested compositions
  (``plus:skipplus:gae``) are refused;
* ``captum:<ClassName>``: any attribution class of ``captum.attr`` built from the model.

:func:`canonical_name` turns every spelling into one canonical string, so ``"GAE"``,
``"gae"`` and ``"G_A_E"`` are the same method everywhere (tables, CLI, Python).
The table itself is filled by :func:`register_method` beside each class (the decorator
lives in :mod:`captum_vit.methods.table`, below the methods; re-exported here) and the one
import list :mod:`captum_vit.methods`: adding a method is its file plus one import line.
:data:`METHODS` reads the table.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any, cast

from captum.attr import Attribution
from torch import nn

import captum_vit.combinators  # noqa: F401  (registers PLUS and SkipPLUS)
import captum_vit.methods  # noqa: F401  (the one import list: registers every method)
from captum_vit.methods.table import (
    COMBINATOR_BASES,
    COMBINATORS,
    KINDS,
    MethodEntry,
    canonical_name,
    captum_class,
    composition_base,
    lookup,
    method_entries,
    method_names,
    register_combinator,
    register_method,
    split_composition,
    unregister_method,
    windowed_methods,
)

FEATURED_COMPOSITIONS = ("plus:decompx", "skipplus:decompx")
"""Compositions included in ``all`` (the SkipPLUS paper's headline)."""

REPRESENTATIVE_COMPOSITIONS = ("skipplus:gae", "skipplus:tokentm", "plus:attn_gradcam",
                               "skipplus:attcat")
"""Compositions that, with :data:`FEATURED_COMPOSITIONS`, cover every route of
:class:`~captum_vit.combinators.PLUS` over this package's methods, one base each, for the
contract suite (``available_methods(compositions=True)``): the suffix-product fast path of
a gradient-weighted recursion (GAE, with an attention-pool head's gradient) and of one with
a state-dependent start (TokenTM, ``R_init = diag‖x_l‖``); the one-block window of a
layer-local method (attention Grad-CAM at every block, PLUS so that blocks are folded into
the head); the generic per-sub-network run of a method without fast path (AttCAT); the
gradient route (DecompX). Every other registered base composes through one of these
routes, so listing all ``2 × len(METHODS)`` compositions would multiply the contract suite
without covering more code. Perturbation bases (TIS) cost one run per block and are
checked in their own tests."""


def __getattr__(name: str) -> Any:
    """``METHODS``: every registered method, in the order of tables and plots (read from
    the table at each access, so a method registered later is in it); the method and
    combinator classes by name (``from captum_vit.registry import GAE`` still works)."""
    if name == "METHODS":
        return method_entries()
    # the classes this module imported before the table filled itself stay importable
    for module in (captum_vit.methods, captum_vit.combinators):
        if name in module.__all__:
            return getattr(module, name)
    raise AttributeError(f"module 'captum_vit.registry' has no attribute {name!r}")


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def available_methods(*, baselines: bool = True, compositions: bool = False) -> list[str]:
    """Canonical names of the registered methods.

    Args:
        baselines (bool, optional): include reference rows (``random``). Default True.
        compositions (bool, optional): add :data:`FEATURED_COMPOSITIONS` and
            :data:`REPRESENTATIVE_COMPOSITIONS` (before the baselines): the compositions
            the contract suite covers. Default False.

    Returns:
        list[str]: names accepted by :func:`build_method`, in table order.

    Examples::

        >>> from captum_vit.registry import available_methods
        >>> available_methods()[:3]
        ['raw_attention', 'rollout', 'gae']
        >>> "skipplus:gae" in available_methods(compositions=True)
        True
    """
    extra = [*FEATURED_COMPOSITIONS, *REPRESENTATIVE_COMPOSITIONS] if compositions else []
    return method_names(baselines, extra)


def _compositions(compose: str | Sequence[str] | None) -> list[str]:
    """Canonical combinator prefixes named by ``compose`` (``"plus,skipplus"``)."""
    if compose is None:
        return []
    values = [compose] if isinstance(compose, str) else list(compose)
    if not all(isinstance(v, str) for v in values):
        raise TypeError("compose must be a str such as 'plus,skipplus' or a list of them")
    out = []
    for v in values:
        for c in re.split(r"[\s,]+", v.strip()):
            if not c:
                continue
            if _key(c) not in COMBINATORS:
                raise ValueError(f"compose must name combinators from "
                                 f"{', '.join(map(repr, COMBINATORS))}; got {c!r}")
            out.append(_key(c))
    return list(dict.fromkeys(out))


def _composable(canon: str) -> bool:
    """Whether ``--compose`` adds compositions of method ``canon`` (not of compositions,
    FullGrad+ or baselines)."""
    if canon.startswith("captum:"):
        return True
    entry = lookup(canon)
    return entry is not None and entry.composable and not entry.baseline


def parse_methods(values: Sequence[str] | str, *, for_explain: bool = False,
                  compose: str | Sequence[str] | None = None) -> list[str]:
    """Canonical method names from command-line values (comma or space separated).

    ``all`` expands to every registered method plus :data:`FEATURED_COMPOSITIONS`
    (``explain`` leaves out the ``random`` baseline). ``compose`` adds, right after every
    selected method that can be a base (not a composition, FullGrad+ or the ``random``
    baseline), its compositions with the named combinators. Repeats are dropped.

    Args:
        values (str or sequence of str): e.g. ``["gae,rollout", "SkipPLUS(DecompX)"]``.
        for_explain (bool, optional): expand ``all`` without baselines. Default False.
        compose (str or sequence of str, optional): combinators to compose every selected
            base with, e.g. ``"plus,skipplus"`` (``captum-vit evaluate --compose``).

    Returns:
        list[str]: canonical names in the given order.

    Raises:
        ValueError: for an empty list, an unknown name or an unknown combinator.

    Examples::

        >>> from captum_vit.registry import parse_methods
        >>> parse_methods(["GAE,skipplus:DecompX", "random"])
        ['gae', 'skipplus:decompx', 'random']
        >>> parse_methods("gae,random", compose="plus,skipplus")
        ['gae', 'plus:gae', 'skipplus:gae', 'random']
    """
    combos = _compositions(compose)
    if isinstance(values, str):
        values = [values]
    names = [n.strip() for v in values for n in _split(v) if n.strip()]
    if not names:
        raise ValueError("no method given; name at least one method or 'all'")
    out: list[str] = []
    for n in names:
        if n.lower() == "all":
            out += method_names(not for_explain, FEATURED_COMPOSITIONS)
        else:
            out.append(canonical_name(n))
    with_compositions = []
    for n in out:
        with_compositions.append(n)
        if _composable(n):
            with_compositions += [f"{c}:{n}" for c in combos]
    return list(dict.fromkeys(with_compositions))


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
        >>> ttm = build_method("plus:tokentm", model)
        >>> ig = build_method("captum:IntegratedGradients", model)
    """
    canon = canonical_name(name)
    if canon.startswith("captum:"):
        return captum_class(canon)(model)
    composed = split_composition(canon)
    if composed is not None:
        prefix, inner = composed
        return COMBINATORS[prefix](model, composition_base(inner, seed=seed))
    return cast(MethodEntry, lookup(canon)).build(model, seed)  # canonical_name checked it


def quick_options(name: str) -> dict:
    """``attribute`` options for a quick look at method ``name`` (e.g. TIS with 128 masks
    instead of the paper's 1024); a composition takes its base's; empty for Captum
    classes.

    Examples::

        >>> from captum_vit.registry import quick_options
        >>> quick_options("TIS"), quick_options("skipplus:tis")
        ({'n_masks': 128}, {'n_masks': 128})
    """
    canon = canonical_name(name)
    composed = split_composition(canon)
    entry = lookup(composed[1] if composed else canon)
    return dict(entry.quick) if entry is not None else {}


def _entry(name: str) -> MethodEntry | None:
    """The registry entry of ``name`` or of its base (a composition); ``None`` for
    ``captum:<Class>`` and the combinator base kinds."""
    canon = canonical_name(name)
    composed = split_composition(canon)
    return lookup(composed[1] if composed else canon)


def method_kind(name: str) -> str:
    """The kind of method ``name`` (what its map is computed from), a key of
    :data:`KINDS`.

    Args:
        name (str): any spelling accepted by :func:`canonical_name`.

    Returns:
        str: the registered method's kind; ``"composition"`` for ``plus:<name>`` and
        ``skipplus:<name>``, ``"captum"`` for ``captum:<ClassName>``.

    Examples::

        >>> from captum_vit.registry import KINDS, method_kind
        >>> method_kind("GAE"), method_kind("HiResCAM"), method_kind("SkipPLUS(DecompX)")
        ('gradient_attention', 'cam', 'composition')
        >>> KINDS[method_kind("rollout")]
        'attention & rollout'
    """
    canon = canonical_name(name)
    if canon.startswith("captum:"):
        return "captum"
    if split_composition(canon) is not None:
        return "composition"
    return cast(MethodEntry, lookup(canon)).kind  # canonical_name checked it


def takes_option(name: str, option: str) -> bool:
    """Whether the ``attribute`` of method ``name`` (of its base, for a composition) takes
    the keyword ``option``, e.g. ``n_masks`` for TIS and RISE.

    Args:
        name (str): any spelling accepted by :func:`canonical_name`.
        option (str): an ``attribute`` keyword.

    Returns:
        bool: False for ``captum:<ClassName>`` and the combinator base kinds.

    Examples::

        >>> from captum_vit.registry import takes_option
        >>> takes_option("tis", "tolerance"), takes_option("rise", "tolerance")
        (True, False)
    """
    entry = _entry(name)
    return entry is not None and option in inspect.signature(entry.cls.attribute).parameters


def api_defaults(name: str, options: Sequence[str] | None = None) -> dict:
    """The API default of ``attribute`` options of method ``name`` (of its base, for a
    composition): the keyword's default, or the constructor's where ``attribute``'s is
    ``None`` (= the constructor's setting).

    Args:
        name (str): any spelling accepted by :func:`canonical_name`.
        options (Sequence[str], optional): the options (default: those of
            :func:`quick_options`).

    Returns:
        dict: option -> default (``None`` where neither gives one); options the method
        does not take are left out.

    Examples::

        >>> from captum_vit.registry import api_defaults, quick_options
        >>> quick_options("rise"), api_defaults("rise")
        ({'n_masks': 500}, {'n_masks': 4000})
        >>> api_defaults("bt_h"), api_defaults("tis", ["tolerance"])
        ({'n_steps': 20}, {'tolerance': None})
    """
    entry = _entry(name)
    if entry is None:
        return {}
    out = {}
    for option in entry.quick if options is None else options:
        found, value = False, None
        for fn in (entry.cls.attribute, entry.cls.__init__):
            param = inspect.signature(fn).parameters.get(option)
            if param is not None:
                found = True
                if param.default not in (None, inspect.Parameter.empty):
                    value = param.default
                    break
        if found:
            out[option] = value
    return out


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
    "COMBINATORS", "COMBINATOR_BASES", "FEATURED_COMPOSITIONS", "KINDS", "METHODS",  # noqa: F822
    "MethodEntry", "register_combinator", "register_method", "unregister_method",
    "REPRESENTATIVE_COMPOSITIONS", "api_defaults", "available_methods", "build_method",
    "canonical_name", "composition_base", "method_factory", "method_kind", "parse_methods",
    "quick_options", "takes_option", "windowed_methods",
]
