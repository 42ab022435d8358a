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
Adding a method is one row of :data:`METHODS`.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from captum.attr import Attribution
from torch import nn

from captum_vit.combinators import PLUS, FullGradPlus, SkipPLUS
from captum_vit.methods import (
    ALTI,
    BTH,
    BTT,
    CPLRP,
    GAE,
    RISE,
    TAM,
    TIS,
    AttCAT,
    AttIxG,
    AttnGrad,
    AttnGradCAM,
    AttnLRP,
    DecompX,
    GlobEnc,
    GradCAM,
    GradCAMElementWise,
    GradCAMPlusPlus,
    GradSAM,
    HiResCAM,
    LayerCAM,
    LeGrad,
    RandomMap,
    RawAttention,
    Rollout,
    ScoreCAM,
    TokenIxG,
    TokenTM,
    TransformerAttribution,
    VanillaGrad,
    ViTCX,
    XGradCAM,
)

FAMILIES: dict[str, str] = {
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
"""Method families, key -> label, in the order ``captum-vit explain`` groups its panels.
Every :class:`MethodEntry` names one; compositions (``plus:<name>``) and
``captum:<Class>`` have their own."""


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
        family (str): a key of :data:`FAMILIES` (keyword only, required): what the
            method computes its map from (attention, gradients and attention, CAM, a
            decomposition or relevance propagation, perturbations).
    """

    name: str
    cls: type
    build: Callable[[nn.Module, int], Attribution]
    class_alias: bool = True
    baseline: bool = False
    quick: dict = field(default_factory=dict)
    composable: bool = True
    """Whether PLUS / SkipPLUS may take it as a base (False for FullGrad+, itself a sum
    over blocks)."""
    family: str = field(kw_only=True)
    """The method's family, a key of :data:`FAMILIES`."""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"{self.name}: family must be one of "
                             f"{', '.join(map(repr, FAMILIES))}, got {self.family!r}")


def _plain(cls: type) -> Callable[[nn.Module, int], Attribution]:
    return lambda model, seed: cls(model)


METHODS: tuple[MethodEntry, ...] = (
    MethodEntry("raw_attention", RawAttention, _plain(RawAttention), family="attention"),
    MethodEntry("rollout", Rollout, _plain(Rollout), family="attention"),
    MethodEntry("gae", GAE, _plain(GAE), family="gradient_attention"),
    MethodEntry("attn_gradcam", AttnGradCAM, _plain(AttnGradCAM), family="gradient_attention"),
    MethodEntry("attcat", AttCAT, _plain(AttCAT), family="gradient_attention"),
    MethodEntry("tokentm", TokenTM, _plain(TokenTM), family="gradient_attention"),
    MethodEntry("tokentm_residual", TokenTM, lambda m, s: TokenTM(m, variant="residual"),
                class_alias=False, family="gradient_attention"),
    MethodEntry("token_ixg", TokenIxG, _plain(TokenIxG), family="gradient"),
    MethodEntry("att_ixg", AttIxG, _plain(AttIxG), family="gradient_attention"),
    MethodEntry("decompx", DecompX, _plain(DecompX), family="decomposition"),
    MethodEntry("tis", TIS, _plain(TIS), quick={"n_masks": 128}, family="perturbation"),
    MethodEntry("vanilla_grad", VanillaGrad, _plain(VanillaGrad), family="gradient"),
    MethodEntry("attn_grad", AttnGrad, _plain(AttnGrad), family="gradient_attention"),
    MethodEntry("gradsam", GradSAM, _plain(GradSAM), family="gradient_attention"),
    MethodEntry("globenc", GlobEnc, _plain(GlobEnc), family="decomposition"),
    MethodEntry("alti", ALTI, _plain(ALTI), family="decomposition"),
    MethodEntry("gradcam", GradCAM, _plain(GradCAM), family="cam"),
    MethodEntry("gradcam_pp", GradCAMPlusPlus, _plain(GradCAMPlusPlus), family="cam"),
    MethodEntry("xgradcam", XGradCAM, _plain(XGradCAM), family="cam"),
    MethodEntry("xgradcam_plus", XGradCAM, lambda m, s: XGradCAM(m, plus=True),
                class_alias=False, family="cam"),
    MethodEntry("layercam", LayerCAM, _plain(LayerCAM), family="cam"),
    MethodEntry("hirescam", HiResCAM, _plain(HiResCAM), family="cam"),
    MethodEntry("gradcam_elementwise", GradCAMElementWise, _plain(GradCAMElementWise),
                family="cam"),
    MethodEntry("scorecam", ScoreCAM, _plain(ScoreCAM), quick={"max_channels": 128},
                family="cam"),
    MethodEntry("legrad", LeGrad, _plain(LeGrad), family="gradient_attention"),
    MethodEntry("bt_h", BTH, _plain(BTH), quick={"n_steps": 5}, family="gradient_attention"),
    MethodEntry("bt_t", BTT, _plain(BTT), quick={"n_steps": 5}, family="gradient_attention"),
    MethodEntry("tam", TAM, _plain(TAM), quick={"n_steps": 5}, family="gradient_attention"),
    MethodEntry("rise", RISE, lambda m, s: RISE(m, seed=s), quick={"n_masks": 500},
                family="perturbation"),
    MethodEntry("vit_cx", ViTCX, lambda m, s: ViTCX(m, seed=s), family="perturbation"),
    MethodEntry("cp_lrp", CPLRP, _plain(CPLRP), family="decomposition"),
    MethodEntry("attnlrp", AttnLRP, _plain(AttnLRP), family="decomposition"),
    MethodEntry("chefer21", TransformerAttribution, _plain(TransformerAttribution),
                family="decomposition"),
    MethodEntry("fullgrad_plus", FullGradPlus, _plain(FullGradPlus), composable=False,
                family="gradient"),
    MethodEntry("skip_fullgrad_plus", FullGradPlus, lambda m, s: FullGradPlus(m, skip=True),
                class_alias=False, composable=False, family="gradient"),
    MethodEntry("random", RandomMap, lambda m, s: RandomMap(m, seed=s), baseline=True,
                family="baseline"),
)
"""Every registered method, in the order of tables and plots."""

COMBINATORS: dict[str, type] = {"plus": PLUS, "skipplus": SkipPLUS}
"""Composition prefixes (``plus:<name>``) and the combinator each builds."""

COMBINATOR_BASES = ("ixg", "gradient")
"""Base kinds the combinators take that are not methods of their own: token IxG and the
vanilla gradient (:mod:`captum_vit.combinators`)."""

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
    return _names(baselines, extra)


def _names(baselines: bool, compositions: Sequence[str]) -> list[str]:
    names = [e.name for e in METHODS if not e.baseline] + list(compositions)
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


def _split_composition(canon: str) -> tuple[str, str] | None:
    """``(prefix, base)`` of a canonical composition name, ``None`` for another name."""
    prefix, sep, inner = canon.partition(":")
    return (prefix, inner) if sep and prefix in COMBINATORS else None


def _base_name(inner: str, name: str) -> str:
    """The canonical name of the base of composition ``name``."""
    if _key(inner) in COMBINATOR_BASES:
        return _key(inner)
    canon = canonical_name(inner)
    if _split_composition(canon) is not None:
        raise ValueError(f"nested composition {name!r}: PLUS and SkipPLUS take one base method, "
                         f"not another composition ({canon!r})")
    entry = _LOOKUP.get(_key(canon))
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
        cls = _captum_class(name)
        return f"captum:{cls.__name__}"
    m = _COMPOSED.match(name)
    if m and _key(m.group(1)) in COMBINATORS:
        return f"{_key(m.group(1))}:{_base_name((m.group(2) or m.group(3)).strip(), name)}"
    entry = _LOOKUP.get(_key(name))
    if entry is None:
        raise _unknown(name)
    return entry.name


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
    entry = _LOOKUP.get(_key(canon))
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
            out += _names(not for_explain, FEATURED_COMPOSITIONS)
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
        return _captum_class(canon)
    entry = _LOOKUP[_key(canon)]

    def factory(f: nn.Module) -> Attribution:
        return entry.build(f, seed)

    factory.__name__ = canon
    return factory


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
        return _captum_class(canon)(model)
    composed = _split_composition(canon)
    if composed is not None:
        prefix, inner = composed
        return COMBINATORS[prefix](model, composition_base(inner, seed=seed))
    return _LOOKUP[_key(canon)].build(model, seed)


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
    composed = _split_composition(canon)
    entry = _LOOKUP.get(_key(composed[1] if composed else canon))
    return dict(entry.quick) if entry is not None else {}


def _entry(name: str) -> MethodEntry | None:
    """The registry entry of ``name`` or of its base (a composition); ``None`` for
    ``captum:<Class>`` and the combinator base kinds."""
    canon = canonical_name(name)
    composed = _split_composition(canon)
    return _LOOKUP.get(_key(composed[1] if composed else canon))


def method_family(name: str) -> str:
    """The family of method ``name``, a key of :data:`FAMILIES`.

    Args:
        name (str): any spelling accepted by :func:`canonical_name`.

    Returns:
        str: the registered method's family; ``"composition"`` for ``plus:<name>`` and
        ``skipplus:<name>``, ``"captum"`` for ``captum:<ClassName>``.

    Examples::

        >>> from captum_vit.registry import FAMILIES, method_family
        >>> method_family("GAE"), method_family("HiResCAM"), method_family("SkipPLUS(DecompX)")
        ('gradient_attention', 'cam', 'composition')
        >>> FAMILIES[method_family("rollout")]
        'attention & rollout'
    """
    canon = canonical_name(name)
    if canon.startswith("captum:"):
        return "captum"
    if _split_composition(canon) is not None:
        return "composition"
    return _LOOKUP[_key(canon)].family


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
    "COMBINATORS", "FAMILIES", "FEATURED_COMPOSITIONS", "METHODS", "MethodEntry",
    "REPRESENTATIVE_COMPOSITIONS", "api_defaults", "available_methods", "build_method",
    "canonical_name", "composition_base", "method_factory", "method_family", "parse_methods",
    "quick_options", "takes_option",
]
