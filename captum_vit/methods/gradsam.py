"""Grad-SAM (Barkan et al., CIKM 2021; SkipPLUS §3.4)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor, nn

from captum_vit._base import (
    check_layers,
)
from captum_vit.methods._front import ScoredAttribution
from captum_vit.methods.gae import GAE
from captum_vit.methods.table import register_method


@register_method("gradsam", kind="gradient_attention")
class GradSAM(ScoredAttribution):
    r"""Gradient Self-Attention Maps: gradient-weighted attention of every block, read at
    the classifier's readout row and **summed over the blocks** (not rolled out):

    .. math::

        m = \sum_{l \in \text{layers}} w\, \bar A_l, \qquad
        \bar A_l = \mathrm{mean}_h\, \mathrm{ReLU}(\nabla A_l^h \odot A_l^h),

    with :math:`\nabla A_l^h = \partial s_c / \partial A_l^h` (all blocks from one
    backward pass) and ``w`` the readout weights of
    :func:`captum_vit._base.readout_rows` (row 0 for a class token, uniform over patches
    for average pooling, the gradient-weighted pool row for an attention-pool head).
    Barkan et al. write :math:`A \odot \mathrm{ReLU}(\nabla A)`, the same matrix since
    :math:`A \ge 0`.

    This is GenAtt (:class:`~captum_vit.GAE`'s per-block matrix :math:`\bar A_l`) composed
    with PLUS by layer aggregation, :math:`\sum_l w \bar A_l` (SkipPLUS §3.4;
    ``aggregate="layer"``); ``layers=range(ceil(L/2), L)`` gives the SkipPLUS variant
    (:func:`captum_vit.combinators.skip_start`). Barkan et al. average over the layers
    (:math:`1/L`, the same ranking); the SkipPLUS authors' code
    (``MeanReLU__AttnGrad_Attn_sum``) sums, which is the default here (``average=True``
    divides by the number of layers).

    Args:
        model (torch.nn.Module): a supported Vision Transformer.
        layers (iterable of int, optional): the blocks to sum, distinct indices in
            ``[0, L-1]`` (a list, tuple or range). Default ``None``: every block.
        average (bool, optional): divide the sum by the number of layers (Barkan et
            al.). Default False.

    Examples::

        >>> from captum_vit.adapters import adapt
        >>> from captum_vit.combinators import skip_start
        >>> from captum_vit.methods.gradsam import GradSAM
        >>> attr = GradSAM(model).attribute(images, target=labels)
        >>> depth = adapt(model).num_blocks
        >>> skip = GradSAM(model, layers=range(skip_start(depth), depth))
        >>> attr = skip.attribute(images, target=labels, output="tokens")
    """

    linear_in_read_gradient = True  # one forward; the score's gradients only (ViTFront)

    pools_queries = True  # GAE's per-block rows (Stages.carry_down / carry, ¼ shares)

    def __init__(self, model: nn.Module, layers: Iterable[int] | None = None,
                 average: bool = False) -> None:
        if not isinstance(average, bool):
            raise TypeError(f"average must be a bool, got {type(average).__name__}")
        super().__init__(model)
        self._layers_option = None if layers is None else check_layers(
            layers, self.adapter.num_blocks)
        self.average = average
        self._genatt = GAE(self.adapter)  # same adapter: GenAtt's rows come from GAE


    @property
    def layers(self) -> tuple[int, ...]:
        """The blocks summed: the ``layers`` given, else every block of the model (under a
        target reading block outputs, every block up to the last it reads)."""
        if self._layers_option is None:
            return tuple(range(self.adapter.num_blocks))
        return check_layers(self._layers_option, self.adapter.num_blocks)
    score_doc = r"""score (str, optional): ``"logit"`` (default) or ``"probability"`` (the
        softmax probability, as the SkipPLUS authors' later code)."""
    returns_doc = r"""the (non-negative) attribution map in the requested ``output`` format."""
    examples_doc = r"""
        >>> from captum_vit.methods.gradsam import GradSAM
        >>> attr = GradSAM(model, layers=[4, 5]).attribute(images, target=3)
    """

    def _token_maps(self, inputs: Tensor, target: Tensor | None, *, score: str = "logit",
                    **_: Any) -> Tensor:
        # GenAtt's per-layer readout rows, GAE's "layer" aggregate (see the class docstring)
        rows = self._genatt.plus_maps(inputs, target, self.layers, aggregate="layer",
                                     score=score)
        return rows.mean(0) if self.average else rows.sum(0)
