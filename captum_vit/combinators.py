"""PLUS, SkipPLUS and FullGrad+ (Mehri et al., CVPRW 2024, "SkipPLUS"). SPEC §4.

For a base attribution method ``A`` and the sub-network ``f_l`` that runs blocks
``l .. L-1`` and the head on the block input ``x_l``:

- ``PLUS(A) = sum_{l=0}^{L-1} A(f_l)(x_l)`` (Eq. 3),
- ``SkipPLUS(A) = sum_{l=m}^{L-1} A(f_l)(x_l)`` with ``m = ceil(L/2)`` (Eq. 4),
- ``FullGrad+ = sum_l IxG(f_l)(x_l) + sum_l sum_{b in B_l} IxG(f_b)(b)`` (Eq. 5-6).

Raw sums, no per-layer normalisation; token maps ``[B, N, D]`` are summed over ``D``.
Layer-aware bases (token IxG, AttIxG, DecompX, vanilla gradient) take a fast path: one
forward and ONE backward give every layer's map. Any Captum attribution (class or
factory ``forward_func -> Attribution``) is run on ``f_l`` with a detached ``x_l``,
once per included layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import torch
from captum.attr import Attribution
from captum.log import log_usage
from torch import Tensor, nn

from captum_vit._base import (
    SCORES,
    TargetLike,
    ViTGradientAttribution,
    ViTPerturbationAttribution,
    accumulation_dtype,
    check_choice,
    check_layer,
    gradients,
    resolve_target,
    target_scores,
)
from captum_vit.adapters import BlockParts, NormParts, Ops, PoolParts
from captum_vit.adapters.base import probabilities
from captum_vit.methods.decompx import DecompX
from captum_vit.methods.ixg import AttIxG, TokenIxG, layer_gradients

# names of the one-backward bases -> per-layer map kind
FAST_BASES = {"ixg": "ixg", "token_ixg": "ixg", "att_ixg": "att_ixg", "decompx": "decompx",
              "gradient": "gradient"}
_FAST_CLASSES = {TokenIxG: "ixg", AttIxG: "att_ixg", DecompX: "decompx"}

BaseLike = str | type | Callable[[Callable[..., Tensor]], Attribution]


def skip_start(num_blocks: int) -> int:
    """SkipPLUS's first layer ``m = ceil(L/2)`` (Eq. 4; the authors' code uses ``L // 2``,
    which is the same for even ``L`` and one block earlier for odd ``L``)."""
    return math.ceil(num_blocks / 2)


def check_layers(layers: Iterable[int], num_blocks: int) -> tuple[int, ...]:
    """Validate a non-empty collection of distinct block indices in ``[0, L-1]``."""
    if isinstance(layers, int | str) or not isinstance(layers, Iterable):
        raise TypeError(f"layers must be a list/range of block indices, got "
                        f"{type(layers).__name__}")
    out = tuple(layers)
    if not out:
        raise ValueError("layers is empty; give at least one block index in "
                         f"[0, {num_blocks - 1}]")
    for l in out:
        check_layer("layers", l, num_blocks)
    if len(set(out)) != len(out):
        raise ValueError(f"layers has repeated entries {list(out)}; each block counts once")
    return tuple(sorted(out))


def per_layer_fast(kind: str, adapter: Any, inputs: Tensor, target: Tensor | None,
                   score: str = "logit") -> Tensor:
    """Every block's base map ``[L, B, N]`` from one forward and one backward.

    ``kind``: ``"ixg"`` (``sum_d x_l * grad``), ``"att_ixg"`` (AttCAT term),
    ``"decompx"`` (IxG with the linearised backward, SPEC §3), ``"gradient"``
    (``sum_d grad``, i.e. Captum's ``Saliency(abs=False)`` summed over channels).
    """
    lg = layer_gradients(adapter, inputs, target, score=score, linearize=kind == "decompx")
    if kind == "att_ixg":
        return lg.att_ixg()
    if kind == "gradient":
        dt = accumulation_dtype(inputs)
        return torch.stack([g.to(dt).sum(-1) for g in lg.grads[:-1]])
    return lg.ixg()[:-1]


class PLUS(ViTGradientAttribution):
    r"""PLUS (Eq. 3 of SkipPLUS): :math:`\sum_{l \in \mathcal{L}} A(f_l)(x_l)` summed over
    all blocks :math:`\mathcal{L} = 0..L-1`, where :math:`f_l` runs blocks
    :math:`l..L-1` and the head on the block input :math:`x_l`.

    ``base`` is either

    - a layer-aware method of this package, as a class or name: ``TokenIxG`` /
      ``"ixg"`` (PLUS(IxG) = CAT), ``AttIxG`` / ``"att_ixg"`` (= AttCAT), ``DecompX`` /
      ``"decompx"`` (gradient route, logit only), ``"gradient"`` (vanilla gradient summed
      over channels). These take the fast path: one forward and one backward for all
      layers.
    - any Captum attribution class (``Saliency``, ``InputXGradient``,
      ``IntegratedGradients``, ...) or a factory ``forward_func -> Attribution`` such as
      ``lambda f: NoiseTunnel(Saliency(f))``. It is built on every :math:`f_l` and run
      on the detached :math:`x_l` (from a no-grad forward), once per layer; extra
      keyword arguments of :meth:`attribute` are passed to its ``attribute``. Token maps
      ``[B, N, D]`` are summed over ``D``.

    Args:
        model (torch.nn.Module): a supported Vision Transformer.
        base (str, type or callable): the base method (see above).
        layers (iterable of int, optional): the blocks :math:`\mathcal{L}` to sum;
            default all blocks.
    """

    def __init__(self, model: nn.Module, base: BaseLike, *,
                 layers: Iterable[int] | None = None) -> None:
        super().__init__(model)
        L = self.adapter.num_blocks
        self.layers = check_layers(self._default_layers(L) if layers is None else layers, L)
        self.base = base
        self.fast = self._fast_kind(base)
        if self.fast is None:
            self._build(self.layers[0])  # fail early if it is not an Attribution factory

    def _default_layers(self, num_blocks: int) -> Iterable[int]:
        return range(num_blocks)

    @staticmethod
    def _fast_kind(base: BaseLike) -> str | None:
        if isinstance(base, str):
            if base not in FAST_BASES:
                raise ValueError(f"unknown base {base!r}; use one of "
                                 f"{', '.join(map(repr, FAST_BASES))}, a Captum attribution "
                                 "class or a factory forward_func -> Attribution")
            return FAST_BASES[base]
        if isinstance(base, type):
            for cls, kind in _FAST_CLASSES.items():
                if issubclass(base, cls):
                    return kind
            if issubclass(base, ViTGradientAttribution | ViTPerturbationAttribution):
                raise TypeError(f"{base.__name__} explains images, not token states; PLUS "
                                "needs a layer-aware base (TokenIxG, AttIxG, DecompX, "
                                "'gradient') or a Captum attribution class")
            if not issubclass(base, Attribution):
                raise TypeError(f"base must be a Captum Attribution class, got {base.__name__}")
            return None
        if isinstance(base, Attribution) or not callable(base):
            raise TypeError("base must be a method name, an Attribution class or a factory "
                            f"forward_func -> Attribution, got {type(base).__name__} "
                            "(pass the class, not an instance)")
        return None

    def _sub_network(self, l: int, score: str = "logit") -> Callable[[Tensor], Tensor]:
        def f_l(x_l: Tensor) -> Tensor:
            logits = self.adapter.run(x_l, start=l)
            return probabilities(logits) if score == "probability" else logits

        return f_l

    def _build(self, l: int, score: str = "logit") -> Attribution:
        method = self.base(self._sub_network(l, score))
        if not isinstance(method, Attribution):
            raise TypeError(f"base factory returned {type(method).__name__}, not a Captum "
                            "Attribution")
        return method

    @log_usage()
    def attribute(self, inputs: Tensor, target: TargetLike = None, *, score: str = "logit",
                  output: str = "pixels", **base_kwargs: Any) -> Tensor:
        r"""
        Args:
            inputs (Tensor): images [B, C, H, W] (or a 1-tuple holding them).
            target (int, list, Tensor, optional): class per image. ``None`` (default)
                explains the predicted class of each image (Captum's ``None`` means a
                scalar output; here it means "predicted").
            score (str, optional): ``"logit"`` (default) or ``"probability"``
                (a softmax is appended to every :math:`f_l`); DecompX needs ``"logit"``.
            output (str, optional): ``"pixels"`` (default), ``"grid"`` or ``"tokens"``.
            **base_kwargs: passed to the Captum base's ``attribute`` (e.g. ``n_steps``,
                ``nt_type``, ``nt_samples``, ``stdevs``); not accepted by fast bases.

        Returns:
            Tensor: the summed signed map in the requested ``output`` format.

        Examples::

            >>> from captum.attr import IntegratedGradients, NoiseTunnel, Saliency
            >>> from captum_vit import PLUS, SkipPLUS
            >>> cat = PLUS(model, "ixg").attribute(images, target=labels)
            >>> dx = SkipPLUS(model, "decompx").attribute(images, target=labels)
            >>> ig = SkipPLUS(model, IntegratedGradients).attribute(
            ...     images, target=labels, n_steps=16)
            >>> sg = PLUS(model, lambda f: NoiseTunnel(Saliency(f))).attribute(
            ...     images, target=labels, nt_type="smoothgrad", nt_samples=4, stdevs=0.1)
        """
        check_choice("score", score, SCORES)
        if self.fast is not None and base_kwargs:
            raise TypeError(f"unexpected keyword arguments {sorted(base_kwargs)}: extra "
                            "arguments are only forwarded to Captum bases")
        if self.fast == "decompx" and score != "logit":
            raise ValueError("score must be 'logit' with the DecompX base (it decomposes "
                             "the logit)")
        return self._attribute(inputs, target, output, score=score, base_kwargs=base_kwargs)

    def layer_maps(self, inputs: Tensor, target: Tensor | None, *, score: str = "logit",
                   base_kwargs: dict[str, Any] | None = None) -> Tensor:
        """The base's token maps ``[len(layers), B, N]`` of the included layers.

        Args:
            inputs (Tensor): validated images [B, C, H, W].
            target (Tensor or None): class per image [B]; ``None`` = predicted.
            score (str): ``"logit"`` or ``"probability"``.
            base_kwargs (dict, optional): keyword arguments of the Captum base.

        Returns:
            Tensor: one signed token map per included layer (prefix tokens first).
        """
        if self.fast is not None:
            return per_layer_fast(self.fast, self.adapter, inputs, target, score)[
                list(self.layers)]
        with torch.no_grad():
            tr = self.adapter.trace(inputs)
        t = resolve_target(target, tr.logits)
        maps = []
        for l in self.layers:
            x_l = tr.states[l].detach().requires_grad_()
            attr = self._build(l, score).attribute(x_l, target=t, **(base_kwargs or {}))
            maps.append(attr.detach().to(accumulation_dtype(x_l)).sum(-1))
        return torch.stack(maps)

    def _token_maps(self, inputs: Tensor, target: Tensor | None, *, score: str = "logit",
                    base_kwargs: dict[str, Any] | None = None, **_: Any) -> Tensor:
        return self.layer_maps(inputs, target, score=score, base_kwargs=base_kwargs).sum(0)


class SkipPLUS(PLUS):
    r"""SkipPLUS (Eq. 4): PLUS summed over the second half of the blocks only,
    :math:`\sum_{l=m}^{L-1} A(f_l)(x_l)` with :math:`m = \lceil L/2 \rceil`.

    The authors' code starts at ``L // 2``: the same block for even ``L``, one block
    earlier for odd ``L``; pass ``layers=range(L // 2, L)`` to reproduce it.

    Args:
        model (torch.nn.Module): a supported Vision Transformer.
        base (str, type or callable): the base method, as for :class:`PLUS`.
        layers (iterable of int, optional): overrides the summed blocks.

    Examples::

        >>> from captum_vit import SkipPLUS
        >>> attr = SkipPLUS(model, "decompx").attribute(images, target=labels)
    """

    def _default_layers(self, num_blocks: int) -> Iterable[int]:
        return range(skip_start(num_blocks), num_blocks)


class _BiasProbeOps(Ops):
    """Plain forward that adds a zero "probe" ``[B, N, C]`` to the output of every
    biased linear map and LayerNorm while ``active``; ``d s / d probe`` is the gradient
    at that op's output, so ``sum_c bias_c * grad[..., c]`` is its bias-gradient map."""

    def __init__(self) -> None:
        super().__init__(linearize=False)
        self.active = False
        self.probes: list[tuple[Tensor, Tensor]] = []  # (bias, probe)

    def _probe(self, out: Tensor, bias: Tensor | None) -> Tensor:
        if not self.active or bias is None or out.dim() != 3:
            return out  # post-pooling ops ([B, C]) have no token axis
        probe = torch.zeros_like(out, requires_grad=True)
        self.probes.append((bias, probe))
        return out + probe

    def norm(self, x: Tensor, p: NormParts) -> Tensor:
        return self._probe(super().norm(x, p), p.bias)

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return self._probe(super().linear(x, weight, bias), bias)

    def attention(self, u: Tensor, p: BlockParts) -> tuple[Tensor, Tensor | None]:
        if not self.active:
            return super().attention(u, p)
        b, n, _ = u.shape
        probed = {}
        for name in ("q_bias", "k_bias", "v_bias"):  # each bias counted once
            bias = getattr(p, name)
            if bias is not None:  # the probe enters the q/k/v output via its bias
                probe = torch.zeros((b, n, bias.shape[0]), dtype=u.dtype, device=u.device,
                                    requires_grad=True)
                self.probes.append((bias, probe))
                probed[name] = bias + probe
        return super().attention(u, replace(p, **probed))


    def pool_attention(self, x: Tensor, p: PoolParts) -> tuple[Tensor, Tensor | None]:
        self.active = False  # an attention-pool head's outputs have no token axis
        return super().pool_attention(x, p)


class FullGradPlus(ViTGradientAttribution):
    r"""FullGrad+ (Eq. 5-6 of SkipPLUS): the token IxG maps of the included blocks plus
    the bias-gradient maps of every bias in them,

    .. math::
        m = \sum_{l \in \mathcal{L}} \sum_d x_l \odot \nabla x_l
          + \sum_{l \in \mathcal{L}} \sum_{b \in B_l} \sum_c b_c\, \nabla o_b[:, c]

    where :math:`o_b` is the output of the op owning bias :math:`b`; the biases of a
    block are qkv, output projection, fc1, fc2 and the LayerNorm shifts
    :math:`\beta` of norm1 and norm2, each counted once. All gradients come from one
    backward pass. ``skip=True`` sums blocks :math:`\lceil L/2 \rceil .. L-1` (SkipPLUS).

    The patch-embedding bias is already inside :math:`x_0` (covered by IxG at block 0)
    and the shifts of qk-norm LayerNorms act inside the attention logits; neither is
    counted. Biases after the last block belong to no block; with
    ``head_biases=True`` the final LayerNorm's :math:`\beta` (which has a token axis)
    is added too. The ``fc_norm`` shift and the classifier bias act after pooling, have
    no token position and never count.

    Args:
        model (torch.nn.Module): a supported Vision Transformer.
        skip (bool, optional): SkipPLUS layer range instead of all blocks. Default False.
        layers (iterable of int, optional): overrides the summed blocks.
        head_biases (bool, optional): also count the final norm's shift. Default False.
    """

    def __init__(self, model: nn.Module, skip: bool = False, *,
                 layers: Iterable[int] | None = None, head_biases: bool = False) -> None:
        super().__init__(model)
        L = self.adapter.num_blocks
        if layers is None:
            layers = range(skip_start(L) if skip else 0, L)
        self.layers = check_layers(layers, L)
        self.skip = bool(skip)
        self.head_biases = bool(head_biases)

    @log_usage()
    def attribute(self, inputs: Tensor, target: TargetLike = None, *, score: str = "logit",
                  output: str = "pixels") -> Tensor:
        r"""
        Args:
            inputs (Tensor): images [B, C, H, W] (or a 1-tuple holding them).
            target (int, list, Tensor, optional): class per image. ``None`` (default)
                explains the predicted class of each image.
            score (str, optional): ``"logit"`` (default) or ``"probability"``.
            output (str, optional): ``"pixels"`` (default), ``"grid"`` or ``"tokens"``.

        Returns:
            Tensor: the signed FullGrad+ map in the requested ``output`` format.

        Examples::

            >>> from captum_vit import FullGradPlus
            >>> attr = FullGradPlus(model, skip=True).attribute(images, target=labels)
        """
        check_choice("score", score, SCORES)
        return self._attribute(inputs, target, output, score=score)

    def _token_maps(self, inputs: Tensor, target: Tensor | None, *, score: str = "logit",
                    **_: Any) -> Tensor:
        ops = _BiasProbeOps()
        with torch.enable_grad():
            x = self.adapter.embed(inputs).detach().requires_grad_()
            states = []
            for l in range(self.adapter.num_blocks):
                states.append(x)
                ops.active = l in self.layers
                x = self.adapter.block(x, l, ops)
            ops.active = self.head_biases
            logits = self.adapter.logits(x, ops)
            t = resolve_target(target, logits)
            xs = [states[l] for l in self.layers]
            probes = [p for _, p in ops.probes]
            grads = gradients(target_scores(logits, t, score), xs + probes)
        dt = accumulation_dtype(inputs)
        with torch.no_grad():
            m = sum((x.detach().to(dt) * g.to(dt)).sum(-1)
                    for x, g in zip(xs, grads[:len(xs)], strict=True))
            for (bias, _), g in zip(ops.probes, grads[len(xs):], strict=True):
                m = m + (g.to(dt) * bias.detach().to(dt)).sum(-1)
        return m
