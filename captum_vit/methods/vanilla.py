"""Vanilla token gradient and attention-weight gradient (SkipPLUS App. E.1).

- ``VanillaGrad_l[j] = reduce_c g_l[j, c]`` with ``g_l = d s_c / d x_l`` at the input of
  block ``l`` (``l = L``: the last block's output).
- ``AttnGrad_l[j] = w . mean_h f(d s_c / d A_l^h)[:, j]`` with ``f`` the identity, ``abs``
  or ``ReLU`` applied per head and ``w`` the readout weights (row 0 for a class token).

Both are layer-local (PLUS of them sums the per-layer maps) and cost one forward and one
backward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from captum_vit._base import (
    accumulation_dtype,
    check_choice,
    check_layer,
    gradients_with_pool,
    readout_rows,
    resolve_target,
    target_scores,
)
from captum_vit.methods._engines import PLUSFastPath, block_gradients
from captum_vit.methods._front import ScoredAttribution
from captum_vit.methods.table import register_method

REDUCTIONS = ("sum", "l2", "l1", "relu_sum")
VARIANTS = ("plain", "abs", "relu")


def reduce_channels(grad: Tensor, reduce: str = "sum") -> Tensor:
    r"""Token scores ``[..., N]`` of a token gradient ``[..., N, D]`` (VanillaGrad's ``reduce``).

    Args:
        grad (Tensor): gradient w.r.t. a residual state, ``[..., N, D]``.
        reduce (str, optional): ``"sum"`` (default, signed :math:`\sum_c g[j, c]`),
            ``"l2"`` (:math:`\lVert g[j] \rVert_2`), ``"l1"`` (:math:`\sum_c |g[j, c]|`)
            or ``"relu_sum"`` (:math:`\sum_c \mathrm{ReLU}(g[j, c])`).

    Returns:
        Tensor ``[..., N]``.

    Examples::

        >>> reduce_channels(torch.tensor([[[1.0, -2.0]]]), "relu_sum")
        tensor([[1.]])
    """
    check_choice("reduce", reduce, REDUCTIONS)
    if reduce == "sum":
        return grad.sum(-1)
    if reduce == "l2":
        return torch.linalg.vector_norm(grad, ord=2, dim=-1)
    if reduce == "l1":
        return grad.abs().sum(-1)
    return grad.clamp(min=0).sum(-1)


@register_method("vanilla_grad", kind="gradient")
class VanillaGrad(PLUSFastPath, ScoredAttribution):
    r"""Vanilla token gradient at the input of block ``layer`` (SkipPLUS App. E.1):
    :math:`m_j = \sum_c g_l[j, c]` with :math:`g_l = \partial s_c / \partial x_l`.

    ``layer=0`` is the embedding output (patch embedding + prefix tokens + positional
    embedding, the input of block 0); ``layer=L`` is the output of the last block (the
    convention of :class:`~captum_vit.TokenIxG`). ``reduce`` chooses how the ``D``
    channels of each token's gradient are combined: ``"sum"`` (default, signed),
    ``"l2"`` (``VanillaGrad:Norm2`` of the paper, :math:`\lVert g_l[j]\rVert_2`), ``"l1"``
    or ``"relu_sum"`` (:math:`\sum_c \mathrm{ReLU}(g_l[j, c])`). The gradient is taken
    w.r.t. the residual state ``x_l`` (every path from it to the score), from one
    backward pass. ``reduce="sum"`` summed over ``l = 0 .. L-1`` is PLUS's ``"gradient"``
    base.

    In a pre-LN ViT every path from ``x_l`` to the score passes a LayerNorm, whose input
    gradient sums to zero over the channels, so ``reduce="sum"`` is zero up to round-off
    there; ``"l2"`` (the paper's "VanillaGrad:Norm2") or ``"l1"`` carry the signal.

    Args:
        model (torch.nn.Module): a supported Vision Transformer.
        layer (int, optional): block index ``l`` in ``[0, L]``. Default 0.
        reduce (str, optional): ``"sum"`` (default), ``"l2"``, ``"l1"`` or ``"relu_sum"``.

    Examples::

        >>> from captum_vit.methods.vanilla import VanillaGrad
        >>> attr = VanillaGrad(model, layer=4, reduce="l2").attribute(images, target=labels)
    """

    linear_in_read_gradient = True  # one forward; the score's gradients only (ViTFront)

    pools_queries = True  # runs through query pooling (Hiera): the forward's own maths

    @property
    def linear_in_backward(self) -> bool:
        """``reduce="sum"``: the map is a sum of the backward's gradient (several read
        blocks in one pass, :meth:`~captum_vit._base.ViTFront._reads_blocks_in_one_pass`);
        the norms are not linear in it."""
        return self.reduce == "sum"

    def __init__(self, model: nn.Module, layer: int = 0, reduce: str = "sum") -> None:
        self.reduce = check_choice("reduce", reduce, REDUCTIONS)
        super().__init__(model)
        self.layer = check_layer("layer", layer, self.adapter.num_blocks, allow_end=True)

    score_doc = r"""score (str, optional): ``"logit"`` (default) or ``"probability"`` (the
        softmax probability, as the SkipPLUS authors' later code)."""
    returns_doc = r"""the attribution map (signed for ``reduce="sum"``) in the requested
        ``output`` format."""
    examples_doc = r"""
        >>> from captum_vit.methods.vanilla import VanillaGrad
        >>> attr = VanillaGrad(model).attribute(images, target=3, output="tokens")
    """

    # takes this method's own options, not any keyword (PLUSFastPath.plus_maps)
    def plus_maps(self, inputs: Tensor, target: Tensor | None, layers: Sequence[int], *,  # type: ignore[override]
                  aggregate: str = "subnetwork", score: str = "logit") -> Tensor:
        """PLUS / SkipPLUS fast path (:mod:`captum_vit.combinators`): the map of every sub-network
        :math:`f_l`, ``l`` in ``layers`` — its block ``layer`` is the model's block
        ``l + layer`` — from one forward and one backward, [len(layers), B, N].

        Examples::

            >>> from captum_vit import PLUS
            >>> maps = PLUS(model, "vanilla_grad").attribute(images)
        """
        self.check_plus_options(aggregate, score)
        at = [l + self.layer for l in layers]
        if at and max(at) > self.adapter.num_blocks:
            raise ValueError(f"layer={self.layer} from start block {max(layers)} passes the "
                             f"last block ({self.adapter.num_blocks}); use a smaller layer")
        _, gs, _t = block_gradients(self.adapter, inputs, target, at, score=score)
        with torch.no_grad():
            return torch.stack([reduce_channels(g.to(accumulation_dtype(g)), self.reduce)
                                for g in gs])


@register_method("attn_grad", kind="gradient_attention")
class AttnGrad(ScoredAttribution):
    r"""Gradient of the score w.r.t. the attention probabilities of block ``layer``, read
    at the classifier's readout row (SkipPLUS App. E.1, Fig. 8):
    :math:`m_j = \mathrm{mean}_h\, f(\nabla A_l^h)[r, j]` with
    :math:`\nabla A_l^h = \partial s_c / \partial A_l^h` and :math:`f` the identity
    (``variant="plain"``, default, signed), :math:`|\cdot|` (``"abs"``) or ReLU
    (``"relu"``), applied per head before the head mean.

    For poolings other than a class token the readout is the weighted row
    :math:`m = w\, \mathrm{mean}_h f(\nabla A_l^h)` with the readout weights ``w`` of
    :func:`captum_vit._base.readout_rows` (uniform over patches for average pooling,
    DINOv2's CLS+mean, ...); ``f`` is applied to the whole matrix before the readout.
    With an attention-pool head (``global_pool='map'``) ``w`` is the gradient-weighted
    pool row :math:`\mathrm{mean}_h \mathrm{ReLU}(\nabla A_p^h \odot A_p^h)[0, :]`, as
    for the other gradient-weighted attention methods (e.g. :class:`~captum_vit.GAE`).

    Args:
        model (torch.nn.Module): a supported Vision Transformer.
        layer (int, optional): block index in ``[0, L-1]``. Default ``None``: the last
            block, ``L-1``.
        variant (str, optional): ``"plain"`` (default), ``"abs"`` or ``"relu"``.

    Examples::

        >>> from captum_vit.methods.vanilla import AttnGrad
        >>> attr = AttnGrad(model, variant="relu").attribute(images, target=labels)
    """

    linear_in_read_gradient = True  # one forward; the score's gradients only (ViTFront)

    pools_queries = True  # the readout carried down through later pooling (¼ shares)

    layer_local = True
    """PLUS evaluates it on a one-block window: the map at block ``l``
    (:mod:`captum_vit.combinators`)."""

    def __init__(self, model: nn.Module, layer: int | None = None,
                 variant: str = "plain") -> None:
        self.variant = check_choice("variant", variant, VARIANTS)
        super().__init__(model)
        self._layer_option = layer
        _ = self.layer  # checked now

    @property
    def layer(self) -> int:
        """The block read: the ``layer`` given, else the model's last block (under a target
        reading block outputs, the last block it reads)."""
        num = self.adapter.num_blocks
        return num - 1 if self._layer_option is None else check_layer(
            "layer", self._layer_option, num)

    examples_doc = r"""
        >>> from captum_vit.methods.vanilla import AttnGrad
        >>> attr = AttnGrad(model, layer=2, variant="abs").attribute(
        ...     images, target=3, output="grid")
    """

    def _token_maps(self, inputs: Tensor, target: Tensor | None, *, score: str = "logit",
                    **_: Any) -> Tensor:
        tr = self.adapter.trace(inputs, grad=True)
        t = resolve_target(target, tr.require_logits())
        attn = tr.blocks[self.layer].require_attn()
        scores = target_scores(tr.require_logits(), t, score, self.adapter.probability)
        (grad,), pool_grad = gradients_with_pool(tr, scores, [attn])
        dt = accumulation_dtype(attn)
        with torch.no_grad():
            g = grad.to(dt)
            if self.variant == "abs":
                g = g.abs()
            elif self.variant == "relu":
                g = g.clamp(min=0)
            w = readout_rows(tr, pool_grad, dtype=dt, target=t)
            ad = self.adapter
            return ad.stages.token_mix(ad.stages.carry_down(w, self.layer), g.mean(1), self.layer)
