"""Token-level Input x Gradient at every block input from ONE backward pass.

``cat_l[j] = sum_d x_l[j, d] * d s_c / d x_l[j, d]`` (CAT / token IxG) and its
attention-weighted form ``alpha_l * cat_l`` (AttIxG, the AttCAT term of Qiang et al.,
NeurIPS 2022). These per-layer maps are the bases that AttCAT, PLUS/SkipPLUS and DecompX's
gradient route sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from captum.log import log_usage
from torch import Tensor, nn

from captum_vit._base import (
    SCORES,
    TargetLike,
    ViTGradientAttribution,
    accumulation_dtype,
    check_choice,
    check_layer,
    gradients,
    resolve_target,
    target_scores,
)
from captum_vit.adapters import Trace, ViTAdapter


@dataclass
class LayerGradients:
    """A traced forward pass with ``d s_c / d x_l`` for every residual state.

    Attributes:
        trace (Trace): the forward pass (``trace.states`` are ``x_0 .. x_L``).
        target (Tensor): the resolved target class per image [B].
        grads (list[Tensor]): gradients of the score w.r.t. ``x_0 .. x_L``.
    """

    trace: Trace
    target: Tensor
    grads: list[Tensor]

    def ixg(self) -> Tensor:
        """Token IxG ``sum_d x_l * grad_l`` for ``l = 0 .. L``, shape [L+1, B, N]."""
        states = self.trace.states
        dt = accumulation_dtype(states[0])
        with torch.no_grad():
            return torch.stack([(x.detach().to(dt) * g.to(dt)).sum(-1)
                                for x, g in zip(states, self.grads, strict=True)])

    def attention_received(self) -> Tensor:
        """``alpha_l[j] = mean_h mean_i A_l^h[i, j]`` for every block, shape [L, B, N]."""
        dt = accumulation_dtype(self.trace.x0)
        with torch.no_grad():
            return torch.stack([rec.attn.detach().to(dt).mean(dim=(1, 2))
                                for rec in self.trace.blocks])

    def att_ixg(self) -> Tensor:
        """AttIxG ``alpha_l * cat_l`` for every block input, shape [L, B, N]."""
        return self.attention_received() * self.ixg()[:-1]


def layer_gradients(adapter: ViTAdapter, inputs: Tensor, target: Tensor | None, *,
                    score: str = "logit", linearize: bool = False) -> LayerGradients:
    """One forward and ONE backward giving ``d s_c / d x_l`` at every block input.

    Args:
        adapter (ViTAdapter): the model's adapter.
        inputs (Tensor): validated images [B, C, H, W].
        target (Tensor or None): class per image; ``None`` = predicted class.
        score (str): ``"logit"`` or ``"probability"``.
        linearize (bool): linearised backward (LayerNorm variance, q/k and the GELU gate
            detached; :mod:`captum_vit.methods.decompx`). With it, ``ixg()[l]`` is DecompX
            started at block ``l``.

    Returns:
        LayerGradients
    """
    with torch.enable_grad():  # also under Captum's no_grad (NoiseTunnel, sensitivity_max)
        tr = adapter.trace(inputs, linearize=linearize, grad=True)
        t = resolve_target(target, tr.logits)
        grads = gradients(target_scores(tr.logits, t, score), tr.states)
    return LayerGradients(tr, t, grads)


class _LayerTerm(ViTGradientAttribution):
    """One per-block term of :func:`layer_gradients` (``term``) at block ``layer``."""

    term = "ixg"
    allow_end = True  # whether ``layer = L`` (the last block's output) is allowed

    def __init__(self, model: nn.Module, layer: int = 0) -> None:
        super().__init__(model)
        self.layer = check_layer("layer", layer, self.adapter.num_blocks,
                                 allow_end=self.allow_end)

    @log_usage()
    def attribute(self, inputs: Tensor, target: TargetLike = None, *, score: str = "logit",
                  output: str = "pixels") -> Tensor:
        r"""
        Args:
            inputs (Tensor): images [B, C, H, W] (or a 1-tuple holding them).
            target (int, list, Tensor, optional): class per image; ``None`` explains the
                predicted class.
            score (str, optional): ``"logit"`` (default) or ``"probability"``.
            output (str, optional): ``"pixels"`` (default), ``"grid"`` or ``"tokens"``.

        Returns:
            Tensor: the signed attribution map in the requested ``output`` format.

        Examples::

            >>> from captum_vit import AttIxG, TokenIxG
            >>> attr = TokenIxG(model, layer=3).attribute(images, target=labels)
            >>> attr = AttIxG(model, layer=5).attribute(images, target=labels)
        """
        check_choice("score", score, SCORES)
        return self._attribute(inputs, target, output, score=score)

    def _token_maps(self, inputs: Tensor, target: Tensor | None, *, score: str = "logit",
                    **_: Any) -> Tensor:
        grads = layer_gradients(self.adapter, inputs, target, score=score)
        return getattr(grads, self.term)()[self.layer]


class TokenIxG(_LayerTerm):
    r"""Token-level Input x Gradient at the input of block ``layer``:
    :math:`m_j = \sum_d x_l[j, d]\, \partial s_c / \partial x_l[j, d]`.

    ``layer=0`` is the embedding output (patch embedding + prefix tokens + positional
    embedding); ``layer=L`` is the output of the last block.

    Args:
        model (torch.nn.Module): a supported Vision Transformer.
        layer (int, optional): block index ``l`` in ``[0, L]``. Default 0.
    """

    term, allow_end = "ixg", True


class AttIxG(_LayerTerm):
    r"""Attention-weighted token IxG at the input of block ``layer`` (one AttCAT term):
    :math:`m = \alpha_l \odot \mathrm{cat}_l` with
    :math:`\alpha_l[j] = \mathrm{mean}_h \mathrm{mean}_i A_l^h[i, j]`.

    Args:
        model (torch.nn.Module): a supported Vision Transformer.
        layer (int, optional): block index ``l`` in ``[0, L-1]``. Default 0.
    """

    term, allow_end = "att_ixg", False
