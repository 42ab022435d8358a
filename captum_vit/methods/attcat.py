"""AttCAT: Attentive Class Activation Tokens (Qiang et al., NeurIPS 2022)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from captum_vit.methods._engines import layer_gradients, layer_gradients_each
from captum_vit.methods._front import ScoredAttribution
from captum_vit.methods.table import register_method


@register_method("attcat", kind="gradient_attention")
class AttCAT(ScoredAttribution):
    r"""Attentive Class Activation Tokens.

    For every block input :math:`x_l` the class activation token
    :math:`\mathrm{cat}_l[j] = \sum_d x_l[j, d]\, \partial s_c / \partial x_l[j, d]`
    (token Input x Gradient) is weighted by the attention token :math:`j` receives,
    :math:`\alpha_l[j] = \mathrm{mean}_h \mathrm{mean}_i A_l^h[i, j]` (averaged over the
    heads and ALL query rows), and the blocks are summed:
    :math:`m = \sum_{l=0}^{L-1} \alpha_l \odot \mathrm{cat}_l`. Signed (no ReLU);
    every block's gradient comes from one backward pass. In SkipPLUS terms this is
    ``PLUS(AttIxG)``; :class:`~captum_vit.methods.ixg.AttIxG` gives one term.

    Args:
        model (torch.nn.Module): a supported Vision Transformer.
    """

    linear_in_read_gradient = True  # one forward; the score's gradients only (ViTFront)

    pools_queries = True  # α per key token of each block (Stages.received)

    score_doc = r"""score (str, optional): ``"logit"`` (default, as the paper) or
        ``"probability"``."""
    returns_doc = r"""the signed attribution map in the requested ``output`` format."""
    examples_doc = r"""
        >>> from captum_vit import AttCAT
        >>> attr = AttCAT(model).attribute(images, target=labels, output="grid")
    """

    def _token_maps(self, inputs: Tensor, target: Tensor | None, *, score: str = "logit",
                    **_: Any) -> Tensor:
        return layer_gradients(self.adapter, inputs, target, score=score).att_ixg().sum(0)

    traces_read_gradients = True  # terms of one backward: K tokens from one trace
    sums_block_terms = True  # Σ over the blocks below the read block: one pass per block

    def _token_maps_each(self, inputs: Tensor, targets: Sequence[Tensor],
                         **_: Any) -> list[Tensor]:
        return [lg.att_ixg().sum(0)
                for lg in layer_gradients_each(self.adapter, inputs, targets)]
