"""Token-level Input x Gradient at every block input from ONE backward pass.

``cat_l[j] = sum_d x_l[j, d] * d s_c / d x_l[j, d]`` (CAT / token IxG) and its
attention-weighted form ``alpha_l * cat_l`` (AttIxG, the AttCAT term of Qiang et al.,
NeurIPS 2022). These per-layer maps are the bases that AttCAT, PLUS/SkipPLUS and DecompX's
gradient route sum; the engine :func:`layer_gradients` lives in
:mod:`captum_vit.methods._engines` (importable from here too).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from captum_vit._base import (
    SCORES,
    check_choice,
    check_layer,
)
from captum_vit.methods._engines import (
    GradientRoute,
    LayerGradients,
    layer_gradients,
    layer_gradients_each,
    states_attention,
)
from captum_vit.methods._front import ScoredAttribution
from captum_vit.methods.table import register_method


class _LayerTerm(GradientRoute, ScoredAttribution):
    """One per-block term of :func:`layer_gradients` (``term``) at block ``layer``; for
    PLUS / SkipPLUS a layer-local gradient-route base (one backward gives every block)."""

    linear_in_read_gradient = True  # one forward; the score's gradients only (ViTFront)

    term = gradient_kind = "ixg"
    allow_end = True  # whether ``layer = L`` (the last block's output) is allowed
    plus_aggregates = ("subnetwork", "layer")
    layer_local = True

    def __init__(self, model: nn.Module, layer: int = 0) -> None:
        super().__init__(model)
        self.layer = check_layer("layer", layer, self.adapter.num_blocks,
                                 allow_end=self.allow_end)

    returns_doc = r"""the signed attribution map in the requested ``output`` format."""
    examples_doc = r"""
        >>> from captum_vit import AttIxG, TokenIxG
        >>> attr = TokenIxG(model, layer=3).attribute(images, target=labels)
        >>> attr = AttIxG(model, layer=5).attribute(images, target=labels)
    """

    traces_read_gradients = True  # a term of one backward: K tokens from one trace

    def _token_maps_each(self, inputs: Tensor, targets: Sequence[Tensor],
                         **_: Any) -> list[Tensor]:
        return [getattr(lg, self.term)()[self.layer]
                for lg in layer_gradients_each(self.adapter, inputs, targets,
                                               attention=self._attention(inputs))]

    def _token_maps(self, inputs: Tensor, target: Tensor | None, *, score: str = "logit",
                    **_: Any) -> Tensor:
        grads = layer_gradients(self.adapter, inputs, target, score=score,
                                attention=self._attention(inputs))
        return getattr(grads, self.term)()[self.layer]

    # takes this method's own options, not any keyword (PLUSFastPath.plus_maps)
    def plus_maps(self, inputs: Tensor, target: Tensor | None, layers: Sequence[int], *,  # type: ignore[override]
                  aggregate: str = "subnetwork", score: str = "logit") -> Tensor:
        """PLUS / SkipPLUS fast path (:mod:`captum_vit.combinators`, gradient route): the
        term at block ``l + layer`` of the model for every start block ``l`` (as the
        method on each sub-network), from one backward, [len(layers), B, N]."""
        check_choice("score", score, SCORES)
        for l in layers:  # the check the method makes on each (L - l)-block sub-network
            check_layer("layer", self.layer, self.adapter.num_blocks - l,
                        allow_end=self.allow_end)
        grads = layer_gradients(self.adapter, inputs, target, score=score,
                                attention=self._attention(inputs))
        return getattr(grads, self.term)()[[l + self.layer for l in layers]]

    def _attention(self, inputs: Tensor) -> str:
        """The trace's attention: the explicit probabilities where the term reads them
        (AttIxG), else as for any map of states and gradients (token IxG:
        :func:`~captum_vit.methods._engines.states_attention`)."""
        return "explicit" if self.term == "att_ixg" else states_attention(self.adapter, inputs)


@register_method("token_ixg", kind="gradient")
class TokenIxG(_LayerTerm):
    r"""Token-level Input x Gradient at the input of block ``layer``:
    :math:`m_j = \sum_d x_l[j, d]\, \partial s_c / \partial x_l[j, d]`.

    ``layer=0`` is the embedding output (patch embedding + prefix tokens + positional
    embedding); ``layer=L`` is the output of the last block.

    Args:
        model (torch.nn.Module): a supported Vision Transformer.
        layer (int, optional): block index ``l`` in ``[0, L]``. Default 0.
    """

    pools_queries = True  # runs through query pooling (Hiera): the forward's own maths

    term = gradient_kind = "ixg"  # the PLUS gradient route's kind (GradientRoute)
    allow_end = True


@register_method("att_ixg", kind="gradient_attention")
class AttIxG(_LayerTerm):
    r"""Attention-weighted token IxG at the input of block ``layer`` (one AttCAT term):
    :math:`m = \alpha_l \odot \mathrm{cat}_l` with
    :math:`\alpha_l[j] = \mathrm{mean}_h \mathrm{mean}_i A_l^h[i, j]`.

    Args:
        model (torch.nn.Module): a supported Vision Transformer.
        layer (int, optional): block index ``l`` in ``[0, L-1]``. Default 0.
    """

    pools_queries = True  # α per key token of each block (Stages.received)

    term = gradient_kind = "att_ixg"  # the PLUS gradient route's kind (GradientRoute)
    allow_end = False


__all__ = ["AttIxG", "LayerGradients", "TokenIxG", "layer_gradients"]
