"""PLUS and SkipPLUS (Mehri et al., CVPRW 2024, "SkipPLUS") over any method; FullGrad+ lives
in :mod:`captum_vit.methods.fullgrad` (importable from here too).

For a base attribution method ``A`` and the sub-network ``f_l`` that runs blocks
``l .. L-1`` and the head on the block input ``x_l``:

- ``PLUS(A) = sum_{l=0}^{L-1} A(f_l)(x_l)`` (Eq. 3),
- ``SkipPLUS(A) = sum_{l=m}^{L-1} A(f_l)(x_l)`` with ``m = ceil(L/2)`` (Eq. 4),
- ``FullGrad+ = sum_l IxG(f_l)(x_l) + sum_l sum_{b in B_l} IxG(f_b)(b)`` (Eq. 5-6).

Raw sums, no per-layer normalisation; token maps ``[B, N, D]`` are summed over ``D``.

``A(f_l)`` is the base run on the sub-network: every method of this package is built on a
:class:`~captum_vit.adapters.subnetwork.SubnetworkAdapter` (blocks ``>= l``, input
``x_l``), a Captum attribution on the token states ``x_l`` with ``f_l`` as its forward
function. Where one pass serves every start block the base takes a *fast path*.

Hook API (what a method class implements to compose with PLUS; all optional; the base
class :class:`~captum_vit.methods.PLUSFastPath` declares it and gives the default
``_token_maps``; the fast path is found by that type, and this module knows no method
class, only the protocol and the names of :mod:`captum_vit.methods.table`):

- ``plus_maps(inputs, target, layers, *, aggregate="subnetwork", **options) -> Tensor``:
  the maps ``A(f_l)(x_l)`` of every start block in ``layers`` (sorted distinct ints),
  ``[len(layers), B, N]`` with the prefix columns, from ONE trace / backward. ``inputs``
  are validated images, ``target`` a ``[B]`` class tensor or ``None`` (= predicted),
  ``options`` the keyword options the user gave to ``attribute`` (``output`` excluded; the
  hook applies the method's own defaults). It runs inside the caller's
  ``torch.enable_grad()`` and target-embedding context, on the method's own adapter (the
  sub-network ``f_0``, i.e. the whole model). It must equal building the method on every
  sub-network (``fast=False``); recursion bases get it from suffix row-vector products,
  ``v_L = w``, ``v_l = v_{l+1} F_l``, ``m_l = v_l R_init(x_l)`` (Rollout, GAE, TokenTM).
- ``plus_aggregates``: the ``aggregate`` values ``plus_maps`` accepts (default
  ``("subnetwork",)``); ``"layer"`` sums the readout rows ``w F_l`` of the per-block
  matrices without identity (Rollout: ``w Ā_l``; GAE: Grad-SAM).
- ``layer_local = True``: the method acts at the LAST block of its model (raw attention,
  attention Grad-CAM, token CAMs, attention gradient); ``A(f_l)`` is then "the map at block
  ``l``": it is built on a one-block window (block ``l``, the later blocks
  folded into the head), and both aggregates coincide.

Token IxG, AttIxG, DecompX and the vanilla gradient take the gradient route: one forward
and ONE backward give every block's map. The combinator base kinds ``"ixg"`` and
``"gradient"`` (:data:`~captum_vit.methods.table.COMBINATOR_BASES`) are that route; a
registered method whose class is a :class:`~captum_vit.methods.GradientRoute`
(``"token_ixg"``, ``"att_ixg"``, ``"decompx"``) takes it under its registered name, with
the kind its class declares (``gradient_kind``).
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from captum.attr import Attribution, PerturbationAttribution
from captum.log import log_usage
from torch import Tensor, nn

from captum_vit._base import (
    AGGREGATES,
    SCORES,
    TargetLike,
    ViTFront,
    ViTGradientAttribution,
    accumulation_dtype,
    check_choice,
    check_layers,
    check_scalar,
    resolve_target,
)
from captum_vit.adapters.subnetwork import SubnetworkAdapter
from captum_vit.methods import (
    FullGradPlus,
    GradientRoute,
    PLUSFastPath,
    per_layer_fast,
    skip_start,
)
from captum_vit.methods.table import (
    composition_base,
    lookup,
    refuses_windows,
    register_combinator,
    sums_blocks,
)

_LAYER_KINDS = ("ixg", "att_ixg", "gradient")
"""Fast kinds without a layer recursion (maps at the block input): both aggregates agree."""

BaseLike = str | type | Callable[[Callable[..., Tensor]], Attribution]


def _package_method(method: Attribution) -> ViTFront | None:
    """The captum_vit method of ``method``: itself, or the method a Captum wrapper
    (``NoiseTunnel``) wraps; ``None`` for a plain Captum attribution."""
    if isinstance(method, ViTFront):
        return method
    inner = getattr(method, "attribution_method", None)
    return inner if isinstance(inner, ViTFront) else None


def _accepted_options(method: Attribution) -> set[str] | None:
    """Keyword options of ``method.attribute`` (``None``: it takes any)."""
    params = inspect.signature(method.attribute).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind is not inspect.Parameter.VAR_POSITIONAL} - {
        "inputs", "target", "output"}


@register_combinator("plus")
class PLUS(ViTGradientAttribution):
    r"""PLUS (Eq. 3 of SkipPLUS): :math:`\sum_{l \in \mathcal{L}} A(f_l)(x_l)` summed over
    all blocks :math:`\mathcal{L} = 0..L-1`, where :math:`f_l` runs blocks
    :math:`l..L-1` and the head on the block input :math:`x_l` (see the module docstring).

    ``base`` is any method:

    - a registered name (``"gae"``, ``"tokentm_residual"``, ``"TIS"``, ...; see
      :mod:`captum_vit.registry`) or a class of this package (``Rollout``, ``TokenTM``,
      ...). The method is built on every sub-network
      (:class:`~captum_vit.adapters.subnetwork.SubnetworkAdapter`): it reads only blocks
      :math:`\geq l`, starts its recursion at :math:`x_l` (TokenTM's
      :math:`C_0 = \mathrm{diag}\|x_{l,i}\|`), removes tokens of :math:`x_l` (TIS), and
      takes its gradients from the model's own score. Layer-local methods (class attribute
      ``layer_local = True``: raw attention, attention Grad-CAM) give their map at block
      :math:`l` (a one-block window, see the module docstring). Methods with a
      fast path (Rollout, GAE, TokenTM, token IxG, AttIxG, DecompX) compute every
      :math:`A(f_l)` from one trace / backward (``fast=False`` runs the base on every
      sub-network instead, same numbers); the others run once per included block
      (perturbation methods: a ``UserWarning`` about the cost).
    - ``"ixg"`` (PLUS(IxG) = CAT), ``"att_ixg"`` (= AttCAT), ``"decompx"`` (gradient
      route, logit only) or ``"gradient"`` (vanilla gradient summed over channels): one
      forward and one backward for all blocks.
    - a Captum attribution class (``Saliency``, ``InputXGradient``,
      ``IntegratedGradients``, ...): built on :math:`f_l` and run on the detached token
      states :math:`x_l`, once per block; token maps ``[B, N, D]`` are summed over ``D``.
    - a factory ``f -> Attribution``, called with each sub-network ``f`` (a
      :class:`~captum_vit.adapters.subnetwork.SubnetworkAdapter`, which is both the
      forward function :math:`f_l` of token states and a model for this package's
      methods): ``lambda f: NoiseTunnel(Saliency(f))`` (a Captum attribution: on
      :math:`x_l`), ``lambda f: TokenTM(f, variant="residual")`` (a method of this
      package: on the images through the sub-network).

    Extra keyword arguments of :meth:`attribute` go to the base's ``attribute``.

    Args:
        model (torch.nn.Module): a supported Vision Transformer.
        base (str, type or callable): the base method (see above).
        layers (iterable of int, optional): the start blocks :math:`\mathcal{L}` to sum
            (any subset, e.g. the cut-off study of the paper's Fig. 7); default all.
        aggregate (str, optional): ``"subnetwork"`` (default, Eq. 3 literally: the base on
            every sub-network) or ``"layer"``: the sum of the readout rows of the base's
            per-block matrices without identity, :math:`\sum_l w F_l` (Rollout:
            :math:`w \bar A_l`; GAE: Grad-SAM, :mod:`~captum_vit.methods.gradsam`), the
            SkipPLUS authors' aggregation of attention bases. For bases without a layer recursion
            (layer-local maps, token IxG, AttIxG, vanilla gradient) both are the same;
            bases with a recursion but no layer form (TokenTM) and bases with no
            per-block matrix (DecompX, Captum methods, TIS) refuse ``"layer"``.
        fast (bool, optional): use the base's one-pass fast path where it has one
            (default True); ``False`` builds the base on every sub-network (for checks).

    Examples::

        >>> from captum.attr import IntegratedGradients, NoiseTunnel, Saliency
        >>> from captum_vit import PLUS, SkipPLUS, TokenTM
        >>> cat = PLUS(model, "ixg").attribute(images, target=labels)
        >>> gae = SkipPLUS(model, "gae").attribute(images, target=labels)
        >>> gradsam = PLUS(model, "gae", aggregate="layer").attribute(images, target=labels)
        >>> ttm = PLUS(model, lambda f: TokenTM(f, variant="residual")).attribute(images)
        >>> tis = SkipPLUS(model, "tis").attribute(images, target=labels, n_masks=64)
        >>> cut = PLUS(model, "rollout", layers=range(4, 12)).attribute(images)
        >>> ig = SkipPLUS(model, IntegratedGradients).attribute(images, target=labels,
        ...                                                     n_steps=16)
    """

    @property
    def removes_tokens(self) -> bool:  # type: ignore[override]
        """The base method's declaration (:attr:`captum_vit._base.ViTFront.removes_tokens`;
        False for the gradient route and Captum bases)."""
        return refuses_windows(type(self.__dict__.get("_probe")))

    sums_subnetworks = True

    @property
    def pools_queries(self) -> bool:  # type: ignore[override]
        """Whether the sub-networks' maps run through query pooling (Hiera): a gradient
        route's kind or a Captum base (the forward's gradients), a package method (its
        fast path included) as it declares."""
        route = getattr(self, "route", "kind")
        if route in ("kind", "captum"):
            return True
        return bool(getattr(getattr(self, "_probe", None), "pools_queries", False))

    def __init__(self, model: nn.Module, base: BaseLike, *,
                 layers: Iterable[int] | None = None, aggregate: str = "subnetwork",
                 fast: bool = True) -> None:
        super().__init__(model)
        L = self.adapter.num_blocks
        self.layers = check_layers(self._default_layers(L) if layers is None else layers, L)
        self.aggregate = check_choice("aggregate", aggregate, AGGREGATES)
        self.fast = check_scalar(fast, "fast", bool)
        self.base = base
        self.kind: str | None = None  # the gradient route's kind (per_layer_fast)
        self.route = "kind"  # "kind", "hook", "method" (package method) or "captum"
        self.layer_local = False
        resolved = self._resolve(base)
        if isinstance(resolved, str):
            self.kind = resolved
            if aggregate == "layer" and self.kind not in _LAYER_KINDS:
                raise ValueError("aggregate='layer' is not defined for DecompX (it decomposes "
                                 "the whole sub-network, there is no per-block matrix); use "
                                 "aggregate='subnetwork'")
            return
        self._factory = resolved
        self._probe = self._make(SubnetworkAdapter(self.adapter, 0))  # f_0: the whole model
        self._classify(self._probe)

    def _default_layers(self, num_blocks: int) -> Iterable[int]:
        return range(num_blocks)

    # -- what the base is ----------------------------------------------------------------
    def _resolve(self, base: BaseLike) -> str | Callable[[SubnetworkAdapter], Attribution]:
        """The gradient route's kind (``"ixg"``, ...: a combinator base kind, or the
        ``gradient_kind`` of a registered :class:`~captum_vit.methods.GradientRoute`
        named in its default configuration) or the factory building the base on a
        sub-network (with ``fast=False`` the registered methods behind the names; the
        vanilla gradient ``"gradient"`` has only its one-backward form)."""
        if isinstance(base, str):
            try:
                resolved = composition_base(base)
            except ValueError as e:
                raise ValueError(f"unknown base {base!r}: {e}") from None
            if isinstance(resolved, str):  # a combinator base kind
                if not self.fast and resolved == "ixg":
                    return composition_base("token_ixg")  # the registered TokenIxG
                return resolved
            entry = lookup(base)
            if self.fast and entry is not None and entry.class_alias \
                    and issubclass(entry.cls, GradientRoute):
                return entry.cls.gradient_kind
            return resolved
        if isinstance(base, type):
            if sums_blocks(base):
                raise TypeError(f"base {base.__name__} is itself a sum over blocks; PLUS and "
                                "SkipPLUS take one base method (nested compositions are not "
                                "supported)")
            if not issubclass(base, Attribution):
                raise TypeError(f"base must be a Captum Attribution class, got {base.__name__}")
            return base
        if isinstance(base, Attribution) or not callable(base):
            raise TypeError("base must be a method name, an Attribution class or a factory "
                            f"f -> Attribution, got {type(base).__name__} "
                            "(pass the class, not an instance)")
        return base

    def _make(self, view: SubnetworkAdapter) -> Attribution:
        method = self._factory(view)
        if not isinstance(method, Attribution):
            raise TypeError(f"base factory returned {type(method).__name__}, not a Captum "
                            "Attribution")
        if sums_blocks(type(method)):
            raise TypeError(f"base {type(method).__name__} is itself a sum over blocks; PLUS "
                            "and SkipPLUS take one base method (nested compositions are not "
                            "supported)")
        return method

    def _classify(self, probe: Attribution) -> None:
        name = type(probe).__name__
        method = _package_method(probe)
        if method is None:
            self.route = "captum"
            if self.aggregate == "layer":
                raise ValueError(f"aggregate='layer' is not defined for the Captum base {name} "
                                 "(no per-block matrix); use aggregate='subnetwork'")
            return
        self.layer_local = bool(getattr(method, "layer_local", False))
        if self.fast and isinstance(probe, PLUSFastPath):  # the fast-path protocol
            hook_aggregates = tuple(probe.plus_aggregates)
            self.route = "hook"
            if self.aggregate not in hook_aggregates:
                raise ValueError(f"aggregate={self.aggregate!r} is not defined for {name}: it "
                                 f"has no per-block matrix without identity; "
                                 f"use aggregate={hook_aggregates[0]!r}")
            return
        self.route = "method"
        if self.aggregate == "layer" and not self.layer_local:
            raise ValueError(f"aggregate='layer' needs per-block matrices: {name} is neither "
                             "layer-local nor has a fast path that defines them (plus_maps "
                             "with 'layer' in plus_aggregates); use aggregate='subnetwork'")
        if isinstance(method, PerturbationAttribution) and len(self.layers) > 1:
            warnings.warn(f"PLUS/SkipPLUS run the perturbation method {name} once per "
                          f"included block ({len(self.layers)} runs, about "
                          f"{len(self.layers)}x its cost)", UserWarning, stacklevel=3)

    # -- attribution ---------------------------------------------------------------------
    @log_usage()
    def attribute(self, inputs: Tensor, target: TargetLike = None, *, score: str | None = None,
                  output: str = "pixels", **base_kwargs: Any) -> Tensor:
        r"""
        Args:
            inputs (Tensor): images [B, C, H, W] (or a 1-tuple holding them).
            target (int, list, Tensor, optional): class per image. ``None`` (default)
                explains the predicted class of each image (Captum's ``None`` means a
                scalar output; here it means "predicted"); every block explains the same
                class.
            score (str, optional): ``"logit"`` or ``"probability"``. For the fast base
                names and Captum bases ``None`` (default) is ``"logit"`` (a softmax is
                appended to every :math:`f_l` for ``"probability"``; DecompX needs
                ``"logit"``); for methods of this package ``None`` keeps the method's own
                default (TokenTM: probability) and a given score is passed on.
            output (str, optional): ``"pixels"`` (default), ``"grid"`` or ``"tokens"``.
            **base_kwargs: passed to the base's ``attribute`` (e.g. ``n_steps``,
                ``nt_type``, ``stdevs`` for Captum bases; ``n_masks`` for TIS); not
                accepted by the fast base names.

        Returns:
            Tensor: the summed signed map in the requested ``output`` format.

        Examples::

            >>> from captum.attr import IntegratedGradients, NoiseTunnel, Saliency
            >>> from captum_vit import PLUS, SkipPLUS
            >>> cat = PLUS(model, "ixg").attribute(images, target=labels)
            >>> dx = SkipPLUS(model, "decompx").attribute(images, target=labels)
            >>> ttm = SkipPLUS(model, "tokentm").attribute(images, score="logit")
            >>> ig = SkipPLUS(model, IntegratedGradients).attribute(
            ...     images, target=labels, n_steps=16)
            >>> sg = PLUS(model, lambda f: NoiseTunnel(Saliency(f))).attribute(
            ...     images, target=labels, nt_type="smoothgrad", nt_samples=4, stdevs=0.1)
        """
        self._check_options(score, base_kwargs)
        return self._attribute(inputs, target, output, score=score, base_kwargs=base_kwargs)

    def _check_options(self, score: str | None, base_kwargs: dict[str, Any]) -> None:
        if score is not None or self.route in ("kind", "captum"):
            check_choice("score", "logit" if score is None else score, SCORES)
        if self.route == "kind":
            if base_kwargs:
                raise TypeError(f"unexpected keyword arguments {sorted(base_kwargs)}: the base "
                                f"{self.base!r} takes no options")
            if self.kind == "decompx" and score not in (None, "logit"):
                raise ValueError("score must be 'logit' with the DecompX base (it decomposes "
                                 "the logit)")
            return
        if self.route == "captum":
            return  # Captum checks its own options
        accepted = _accepted_options(self._probe)
        given = set(base_kwargs) | ({"score"} if score is not None else set())
        if accepted is not None and given - accepted:
            raise TypeError(f"unexpected keyword arguments {sorted(given - accepted)} for "
                            f"{type(self._probe).__name__}.attribute; it takes "
                            f"{sorted(accepted) or 'none'}")

    def layer_maps(self, inputs: Tensor, target: Tensor | None, *, score: str | None = None,
                   base_kwargs: dict[str, Any] | None = None) -> Tensor:
        """The base's token maps ``A(f_l)(x_l)`` ``[len(layers), B, N]`` of the included
        start blocks (inside an ``attribute`` call: validated inputs, gradients enabled).

        Args:
            inputs (Tensor): validated images [B, C, H, W].
            target (Tensor or None): class per image [B]; ``None`` = predicted.
            score (str, optional): ``"logit"`` or ``"probability"`` (see :meth:`attribute`).
            base_kwargs (dict, optional): keyword options of the base's ``attribute``.

        Returns:
            Tensor: one signed token map per included block (prefix tokens first; the
            methods of this package that drop them give zeros there).
        """
        kwargs = dict(base_kwargs or {})
        if self.route == "kind":
            kind = cast(str, self.kind)  # the "kind" route has one
            return per_layer_fast(kind, self.adapter, inputs, target, score or "logit")[
                list(self.layers)]
        if self.route == "captum":
            return self._captum_maps(inputs, target, score or "logit", kwargs)
        if score is not None:
            kwargs["score"] = score
        if self.route == "hook":
            return self._hook_maps(inputs, target, kwargs)
        return self._method_maps(inputs, target, kwargs)

    def _hook_maps(self, inputs: Tensor, target: Tensor | None,
                   kwargs: dict[str, Any]) -> Tensor:
        probe = cast(PLUSFastPath, self._probe)  # the "hook" route: a PLUSFastPath
        maps = probe.plus_maps(inputs, target, self.layers, aggregate=self.aggregate,
                               **kwargs)
        want = (len(self.layers), inputs.shape[0], self.adapter.layout(inputs).num_tokens)
        if not isinstance(maps, Tensor) or tuple(maps.shape) != want:
            raise RuntimeError(f"{type(probe).__name__}.plus_maps returned "
                               f"{getattr(maps, 'shape', type(maps).__name__)}; the hook must "
                               f"return token maps of shape {list(want)} (layers, B, N)")
        return maps

    def _method_maps(self, inputs: Tensor, target: Tensor | None,
                     kwargs: dict[str, Any]) -> Tensor:
        if target is None:  # every block explains the model's predicted class
            with torch.no_grad():
                target = resolve_target(None, self.adapter.run(self.adapter.embed(inputs)))
        k = self.adapter.num_prefix
        maps = []
        for l in self.layers:
            view = SubnetworkAdapter(self.adapter, l, l + 1 if self.layer_local else None)
            patches = self._make(view).attribute(inputs, target=target, output="tokens",
                                                 **kwargs)
            m = patches.new_zeros(patches.shape[0], k + patches.shape[1])
            m[:, k:] = patches
            maps.append(m)
        return torch.stack(maps)

    def _captum_maps(self, inputs: Tensor, target: Tensor | None, score: str,
                     kwargs: dict[str, Any]) -> Tensor:
        with torch.no_grad():
            tr = self.adapter.trace(inputs)
        t = resolve_target(target, tr.require_logits())
        maps = []
        for l in self.layers:
            x_l = tr.states[l].detach().requires_grad_()
            method = self._make(SubnetworkAdapter(self.adapter, l, score=score))
            attr = method.attribute(x_l, target=t, **kwargs)
            m = attr.detach().to(accumulation_dtype(x_l)).sum(-1)
            maps.append(self.adapter.stages.carry(m, l, split=True))  # stages: onto the maps' grid
        return torch.stack(maps)

    def _token_maps(self, inputs: Tensor, target: Tensor | None, *,
                    score: str | None = None, base_kwargs: dict[str, Any] | None = None,
                    **_: Any) -> Tensor:
        return self.layer_maps(inputs, target, score=score, base_kwargs=base_kwargs).sum(0)


@register_combinator("skipplus")
class SkipPLUS(PLUS):
    r"""SkipPLUS (Eq. 4): PLUS summed over the second half of the blocks only,
    :math:`\sum_{l=m}^{L-1} A(f_l)(x_l)` with :math:`m = \lceil L/2 \rceil`.

    The authors' code starts at ``L // 2``: the same block for even ``L``, one block
    earlier for odd ``L``; pass ``layers=range(L // 2, L)`` to reproduce it.

    Args:
        model (torch.nn.Module): a supported Vision Transformer.
        base (str, type or callable): the base method, as for :class:`PLUS`.
        layers (iterable of int, optional): overrides the summed blocks.
        aggregate (str, optional): ``"subnetwork"`` (default) or ``"layer"``, as for
            :class:`PLUS`.
        fast (bool, optional): use the base's fast path (default True).

    Examples::

        >>> from captum_vit import SkipPLUS
        >>> attr = SkipPLUS(model, "decompx").attribute(images, target=labels)
        >>> gradsam = SkipPLUS(model, "gae", aggregate="layer").attribute(images)
    """

    def _default_layers(self, num_blocks: int) -> Iterable[int]:
        return range(skip_start(num_blocks), num_blocks)


def __getattr__(name: str) -> Any:
    """The method classes and engines this module imported before they moved to
    :mod:`captum_vit.methods` (``TokenIxG``, ``AttIxG``, ``DecompX``, ``layer_gradients``)
    stay importable from here."""
    methods = importlib.import_module("captum_vit.methods")
    if name in methods.__all__:
        return getattr(methods, name)
    raise AttributeError(f"module 'captum_vit.combinators' has no attribute {name!r}")


__all__ = ["PLUS", "BaseLike", "FullGradPlus", "SkipPLUS", "check_layers",
           "per_layer_fast", "skip_start"]
