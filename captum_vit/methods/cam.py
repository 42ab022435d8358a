r"""The CAM family on ViT tokens at block ``l`` (SkipPLUS, Mehri et al. 2024, App. E.1.1,
Fig. 12).

A convolutional CAM reads the activations :math:`X` of a layer (channels x positions) and
the gradient :math:`G = \partial s_c / \partial X` of the target score. On a ViT the
"layer" is the input of block ``l``: :math:`X = x_l \in \mathbb{R}^{N \times D}` (the D
features are the channels, the N tokens the positions) and :math:`G = g_l`, both from one
forward and one backward pass. Every variant below is one rule turning ``(X, G)`` into a
map over the N tokens (prefix columns are dropped at the output); ``relu=True`` (default,
the papers) clips the map at 0. The SkipPLUS authors' presets may call the CAMs with
``relu=False``, a reading of their code that is not confirmed (their analysis code has no
licence and was not read for this); pass ``relu=False`` to follow that reading.

Channel-weight variants compute :math:`w_c` over the token set ``T``
(``weight_tokens="all"``, the SkipPLUS authors' code, default; ``"patches"``: the patch
rows only, pytorch-grad-cam's ViT reshape) and map :math:`m_j = \sum_c w_c X[j, c]`:

* :class:`GradCAM`: :math:`w_c = \mathrm{mean}_{t \in T} G[t, c]`.
* :class:`GradCAMPlusPlus`: :math:`\alpha[t, c] = G^2 / (2 G^2 + (\sum_{t' \in T}
  X[t', c]) G^3 + \varepsilon)` (0 where :math:`G = 0`),
  :math:`w_c = \sum_{t \in T} \alpha[t, c]\, \mathrm{ReLU}(G[t, c])`.
* :class:`XGradCAM`: :math:`w_c = \sum_{t} G[t, c] X[t, c] / (\sum_t X[t, c] +
  \varepsilon)`; ``plus=True`` (XGradCAM+, SkipPLUS) uses :math:`|X|` in the numerator
  and the denominator (the map still uses the signed :math:`X`).

Position-wise variants (no channel weights, ``weight_tokens`` does not apply):

* :class:`LayerCAM`: :math:`m_j = \sum_c \mathrm{ReLU}(G[j, c]) X[j, c]`.
* :class:`HiResCAM`: :math:`m_j = \sum_c G[j, c] X[j, c]` (token IxG at block ``l``,
  :class:`~captum_vit.methods.ixg.TokenIxG`).
* :class:`GradCAMElementWise`: :math:`m_j = \sum_c \mathrm{ReLU}(G[j, c] X[j, c])`.

The :math:`\varepsilon` are pytorch-grad-cam 1.5.7's: :math:`10^{-6}` in GradCAM++
(:data:`GRADCAM_PP_EPS`, its ``grad_cam_plusplus.py``), :math:`10^{-7}` in XGradCAM
(:data:`XGRADCAM_EPS`, its ``xgrad_cam.py``); ``eps=`` sets either. On ViT tokens the
gradients are small, so GradCAM++'s :math:`\varepsilon` is not a negligible stabiliser:
it dominates most denominators of :math:`\alpha` and the map depends on it.

Where the activations are read (``at``): ``"residual"`` (default) is the block input
:math:`x_l` above; ``"norm1"`` is the output of block ``l``'s first LayerNorm (the
pre-attention norm), :math:`X = u_l = \mathrm{LN}_1(x_l)` and
:math:`G = \partial s_c / \partial u_l`. That is the layer of pytorch-grad-cam's ViT
recipe (``target_layers=[model.blocks[-1].norm1]`` with a ``reshape_transform`` that
drops the class token: ``at="norm1"`` with ``weight_tokens="patches"`` at the default
block ``L-1``). Score-CAM, which needs no gradient but one forward per channel, is
:class:`~captum_vit.methods.scorecam.ScoreCAM`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from captum_vit._base import (
    accumulation_dtype,
    check_choice,
    check_scalar,
)
from captum_vit.methods._engines import (
    SITES,
    PLUSFastPath,
    block_gradient,
    block_gradients,
    block_layer,
)
from captum_vit.methods._front import ScoredAttribution, fill_doc_with
from captum_vit.methods.table import register_method

GRADCAM_PP_EPS = 1e-6
"""Default ``ε`` of GradCAM++'s denominators (pytorch-grad-cam 1.5.7,
``grad_cam_plusplus.py``)."""

XGRADCAM_EPS = 1e-7
"""Default ``ε`` of XGradCAM's denominators (pytorch-grad-cam 1.5.7, ``xgrad_cam.py``)."""

EPS = XGRADCAM_EPS
"""XGradCAM's default ``ε`` (:data:`XGRADCAM_EPS`); GradCAM++ uses :data:`GRADCAM_PP_EPS`."""

WEIGHT_TOKENS = ("all", "patches")
"""Token sets ``T`` over which channel weights are computed."""

CAM_ARGS = {
    "cam_args": "model (torch.nn.Module): a supported Vision Transformer.\n"
                "layer (int, optional): block ``l`` in ``[0, L-1]``; ``None`` (default) = "
                "``L-1``.\n"
                "relu (bool, optional): clip the map at 0 (default True).",
    "cam_at": "at (str, optional): where block ``layer`` is read: ``\"residual\"`` (default, "
              "its\n    input :math:`x_l`) or ``\"norm1\"`` (its first LayerNorm's output,\n"
              "    pytorch-grad-cam's ViT recipe).",
}
"""The constructor arguments the CAM classes share (placeholders ``{cam_args}``: model,
layer, relu; ``{cam_at}``: at), filled by :func:`~captum_vit.methods._front.fill_doc_with`."""


class _TokenCAM(PLUSFastPath, ScoredAttribution):
    """Shared front of the CAMs: ``(X, G)`` at block ``layer`` (read at ``at``),
    :meth:`cam`, optional ReLU.

    Subclasses implement :meth:`cam` only.
    """

    linear_in_read_gradient = True  # one forward; the score's gradients only (ViTFront)

    pools_queries = True  # runs through query pooling (Hiera): the forward's own maths

    layer_local = True
    """PLUS evaluates it on a one-block window: the map at block ``l``
    (:mod:`captum_vit.combinators`)."""

    def __init__(self, model: nn.Module, layer: int | None = None, relu: bool = True, *,
                 at: str = "residual") -> None:
        super().__init__(model)
        self._layer_option = layer
        block_layer("layer", layer, self.adapter.num_blocks)  # checked now
        self.relu = check_scalar(relu, "relu", bool)
        self.at = check_choice("at", at, SITES)


    @property
    def layer(self) -> int:
        """The block read: the ``layer`` given, else the model's last block (under a target
        reading block outputs, the last block it reads)."""
        return block_layer("layer", self._layer_option, self.adapter.num_blocks)

    score_doc = r"""score (str, optional): ``"logit"`` (default) or ``"probability"`` (softmax of
        the target, the SkipPLUS authors' later code): the score whose gradient
        is :math:`G`."""
    returns_doc = r"""the map (raw, not normalised; ReLU-clipped with ``relu=True``) in the
        requested ``output`` format."""
    examples_doc = r"""
        >>> from captum_vit.methods.cam import GradCAM, HiResCAM
        >>> attr = GradCAM(model).attribute(images, target=labels)
        >>> grid = HiResCAM(model, layer=5, relu=False).attribute(
        ...     images, target=labels, score="probability", output="grid")
    """

    def _token_maps(self, inputs: Tensor, target: Tensor | None, *, score: str = "logit",
                    **_: Any) -> Tensor:
        x, g, _t = block_gradient(self.adapter, inputs, target, self.layer, score=score,
                                  at=self.at)
        return self.layer_map(x, g, self.adapter.num_prefix)

    plus_aggregates = ("subnetwork", "layer")

    # takes this method's own options, not any keyword (PLUSFastPath.plus_maps)
    def plus_maps(self, inputs: Tensor, target: Tensor | None, layers: Sequence[int], *,  # type: ignore[override]
                  aggregate: str = "subnetwork", score: str = "logit") -> Tensor:
        """PLUS / SkipPLUS fast path (:mod:`captum_vit.combinators`): this CAM at every
        block of ``layers`` (layer-local: both aggregates coincide) from one forward and one
        backward, [len(layers), B, N].

        Examples::

            >>> from captum_vit import SkipPLUS
            >>> maps = SkipPLUS(model, "gradcam").attribute(images)
        """
        self.check_plus_options(aggregate, score)
        xs, gs, _t = block_gradients(self.adapter, inputs, target, layers, score=score,
                                     at=self.at)
        k = self.adapter.num_prefix
        return torch.stack([self.layer_map(x, g, k) for x, g in zip(xs, gs, strict=True)])

    def layer_map(self, x: Tensor, g: Tensor, num_prefix: int) -> Tensor:
        """This CAM's token map from any block's ``(X, G)``: :meth:`cam` in the
        accumulation dtype, then the ReLU if ``relu=True``. PLUS/SkipPLUS sum it over
        blocks (a CAM is layer-local: on the sub-network :math:`f_l` it is its map at
        block ``l``; :mod:`captum_vit.combinators`), e.g. from
        :func:`~captum_vit.methods.ixg.layer_gradients`' ``trace.states[l]`` and
        ``grads[l]`` (``at="residual"``) or from :func:`block_gradients`.

        Args:
            x (Tensor): activations ``X`` [B, N, D]: ``x_l``, or ``u_l`` with
                ``at="norm1"``.
            g (Tensor): gradients ``G = d s_c / d X`` [B, N, D].
            num_prefix (int): ``K``, the prefix tokens before the patches.

        Returns:
            Tensor: [B, N] (prefix tokens first), no gradient.
        """
        dt = accumulation_dtype(x)
        with torch.no_grad():
            m = self.cam(x.detach().to(dt), g.detach().to(dt), num_prefix)
            return m.clamp(min=0) if self.relu else m

    def cam(self, x: Tensor, g: Tensor, num_prefix: int) -> Tensor:
        """The map over all N tokens before the optional ReLU.

        Args:
            x (Tensor): activations ``X = x_l`` [B, N, D].
            g (Tensor): gradients ``G = g_l`` [B, N, D].
            num_prefix (int): ``K``, the prefix tokens before the patches.

        Returns:
            Tensor: [B, N].
        """
        raise NotImplementedError  # pragma: no cover


class _ChannelWeightCAM(_TokenCAM):
    """CAMs of the form ``m_j = Σ_c w_c X[j, c]``: subclasses implement
    :meth:`channel_weights` on the rows of the token set ``T``."""

    def __init__(self, model: nn.Module, layer: int | None = None, relu: bool = True,
                 weight_tokens: str = "all", *, at: str = "residual") -> None:
        super().__init__(model, layer, relu, at=at)
        self.weight_tokens = check_choice("weight_tokens", weight_tokens, WEIGHT_TOKENS)

    def cam(self, x: Tensor, g: Tensor, num_prefix: int) -> Tensor:
        k = num_prefix if self.weight_tokens == "patches" else 0
        w = self.channel_weights(x[:, k:], g[:, k:])
        return torch.einsum("bnd,bd->bn", x, w)

    def channel_weights(self, x: Tensor, g: Tensor) -> Tensor:
        """Channel weights ``w`` [B, D] from the rows of ``T``: ``x``, ``g`` ``[B, |T|, D]``."""
        raise NotImplementedError  # pragma: no cover


@register_method("gradcam", kind="cam")
@fill_doc_with(CAM_ARGS)
class GradCAM(_ChannelWeightCAM):
    r"""Grad-CAM (Selvaraju et al. 2017) on the tokens of block ``layer``:
    :math:`w_c = \mathrm{mean}_{t \in T} G[t, c]`, :math:`m_j = \sum_c w_c X[j, c]`, with
    :math:`X = x_l`, :math:`G = \partial s_c / \partial x_l` (SkipPLUS App. E.1.1).

    With ``at="norm1"`` :math:`X` is block ``l``'s first LayerNorm output
    :math:`u_l = \mathrm{LN}_1(x_l)` and :math:`G = \partial s_c / \partial u_l`;
    ``GradCAM(model, at="norm1", weight_tokens="patches")`` is pytorch-grad-cam's ViT recipe
    (``target_layers=[model.blocks[-1].norm1]``, class token dropped) before its resize
    and min-max scaling (its ReLU is ``relu=True``).

    Cost: one forward and one backward (down to block ``layer``).

    Args:
        model (torch.nn.Module): a supported Vision Transformer.
        layer (int, optional): block ``l`` in ``[0, L-1]`` that is read; ``None``
            (default) = the last block ``L-1``.
        relu (bool, optional): clip the map at 0 (default True, the paper; the SkipPLUS
            presets use False).
        weight_tokens (str, optional): token set ``T`` of the channel weights: ``"all"``
            (default, prefix and patch tokens, the SkipPLUS authors' code) or
            ``"patches"`` (patch tokens only, pytorch-grad-cam's ViT reshape).
        {cam_at}

    Examples::

        >>> from captum_vit.methods.cam import GradCAM
        >>> attr = GradCAM(model).attribute(images, target=labels)
        >>> signed = GradCAM(model, layer=6, relu=False, weight_tokens="patches").attribute(
        ...     images, target=labels, output="tokens")
        >>> recipe = GradCAM(model, at="norm1", weight_tokens="patches").attribute(
        ...     images, target=labels, output="grid")
    """

    def channel_weights(self, x: Tensor, g: Tensor) -> Tensor:
        return g.mean(1)


@register_method("gradcam_pp", kind="cam")
@fill_doc_with(CAM_ARGS)
class GradCAMPlusPlus(_ChannelWeightCAM):
    r"""Grad-CAM++ (Chattopadhyay et al. 2018) on the tokens of block ``layer``, in the
    closed form of pytorch-grad-cam (exponential score, second and third powers of the
    gradient):

    .. math::
        \alpha[t, c] = \frac{G[t,c]^2}{2 G[t,c]^2 + \big(\sum_{t' \in T} X[t', c]\big)
        G[t,c]^3 + \varepsilon},\quad
        w_c = \sum_{t \in T} \alpha[t, c]\,\mathrm{ReLU}(G[t, c]),\quad
        m_j = \sum_c w_c X[j, c],

    with :math:`\alpha = 0` where :math:`G = 0` and :math:`\varepsilon = 10^{-6}` by
    default (pytorch-grad-cam 1.5.7's GradCAM++, :data:`GRADCAM_PP_EPS`).

    **The map depends on** :math:`\varepsilon` **on ViT tokens.** Token gradients are
    small, so :math:`2G^2 + (\sum_{t'} X[t', c]) G^3` is mostly far below
    :math:`\varepsilon`: on the bundled FashionMNIST ViT at block ``L-1`` its median is
    about :math:`10^{-8}`, and the maps of eight sample images change by 1 % to 260 %
    (relative L2) between :math:`\varepsilon = 10^{-7}` and :math:`10^{-6}`. Where
    :math:`\varepsilon` dominates, :math:`\alpha \approx G^2 / \varepsilon` and
    :math:`w_c \approx \sum_t \mathrm{ReLU}(G)^3 / \varepsilon`. Pass ``eps`` to match
    another implementation, and compare maps only at the same :math:`\varepsilon`.

    Args:
        {cam_args}
        weight_tokens (str, optional): ``"all"`` (default) or ``"patches"``: the token set
            ``T`` of :math:`\alpha`'s activation sum and of :math:`w_c`.
        {cam_at}
        eps (float, optional): :math:`\varepsilon` of :math:`\alpha`'s denominator,
            ``>= 0``. Default ``1e-6`` (pytorch-grad-cam's).

    Examples::

        >>> from captum_vit.methods.cam import GradCAMPlusPlus
        >>> attr = GradCAMPlusPlus(model).attribute(images, target=labels, output="grid")
        >>> older = GradCAMPlusPlus(model, eps=1e-7).attribute(images, target=labels)
    """

    def __init__(self, model: nn.Module, layer: int | None = None, relu: bool = True,
                 weight_tokens: str = "all", *, at: str = "residual",
                 eps: float = GRADCAM_PP_EPS) -> None:
        super().__init__(model, layer, relu, weight_tokens, at=at)
        self.eps = float(check_scalar(eps, "eps", float, min_val=0))

    def channel_weights(self, x: Tensor, g: Tensor) -> Tensor:
        g2 = g * g
        alpha = g2 / (2 * g2 + x.sum(1, keepdim=True) * g2 * g + self.eps)
        alpha = torch.where(g != 0, alpha, torch.zeros_like(alpha))
        return (alpha * g.clamp(min=0)).sum(1)


@register_method("xgradcam", kind="cam", variants={"xgradcam_plus": {"plus": True}})
@fill_doc_with(CAM_ARGS)
class XGradCAM(_ChannelWeightCAM):
    r"""XGrad-CAM (Fu et al. 2020) on the tokens of block ``layer``, and XGradCAM+
    (SkipPLUS) with ``plus=True``:

    .. math::
        w_c = \frac{\sum_{t \in T} G[t, c]\, X[t, c]}{\sum_{t \in T} X[t, c] + \varepsilon}
        \quad\text{or (plus)}\quad
        w_c = \frac{\sum_{t \in T} G[t, c]\, |X[t, c]|}{\sum_{t \in T} |X[t, c]|
        + \varepsilon},\qquad m_j = \sum_c w_c X[j, c]

    (the map uses the signed :math:`X` in both; :math:`\varepsilon = 10^{-7}` by default,
    pytorch-grad-cam 1.5.7's XGradCAM, :data:`XGRADCAM_EPS`). A
    transformer's features are signed, so the plain denominator can be near 0; the plus
    form avoids that.

    Args:
        {cam_args}
        weight_tokens (str, optional): ``"all"`` (default) or ``"patches"``: the token set
            ``T`` of the sums.
        plus (bool, optional): XGradCAM+ (default False).
        {cam_at}
        eps (float, optional): :math:`\varepsilon` of the denominator, ``>= 0``. Default
            ``1e-7`` (pytorch-grad-cam's).

    Examples::

        >>> from captum_vit.methods.cam import XGradCAM
        >>> attr = XGradCAM(model).attribute(images, target=labels)
        >>> plus = XGradCAM(model, plus=True, relu=False).attribute(images, target=labels)
    """

    def __init__(self, model: nn.Module, layer: int | None = None, relu: bool = True,
                 weight_tokens: str = "all", plus: bool = False, *, at: str = "residual",
                 eps: float = XGRADCAM_EPS) -> None:
        super().__init__(model, layer, relu, weight_tokens, at=at)
        self.plus = check_scalar(plus, "plus", bool)
        self.eps = float(check_scalar(eps, "eps", float, min_val=0))

    def channel_weights(self, x: Tensor, g: Tensor) -> Tensor:
        a = x.abs() if self.plus else x
        return (g * a).sum(1) / (a.sum(1) + self.eps)


@register_method("layercam", kind="cam")
@fill_doc_with(CAM_ARGS)
class LayerCAM(_TokenCAM):
    r"""LayerCAM (Jiang et al. 2021) at one block: :math:`m_j = \sum_c \mathrm{ReLU}(G[j,
    c])\, X[j, c]` with :math:`X = x_l`, :math:`G = \partial s_c / \partial x_l`.

    Multi-layer LayerCAM (per-layer maps max-normalised and summed) is a PLUS-style
    combination of this map and not part of this class.

    Args:
        {cam_args}
        {cam_at}

    Examples::

        >>> from captum_vit.methods.cam import LayerCAM
        >>> attr = LayerCAM(model, layer=8).attribute(images, target=labels)
    """

    def cam(self, x: Tensor, g: Tensor, num_prefix: int) -> Tensor:
        return (g.clamp(min=0) * x).sum(-1)


@register_method("hirescam", kind="cam")
@fill_doc_with(CAM_ARGS)
class HiResCAM(_TokenCAM):
    r"""HiResCAM (Draelos & Carin 2020) at one block: :math:`m_j = \sum_c G[j, c]\,
    X[j, c]` with :math:`X = x_l`, :math:`G = \partial s_c / \partial x_l`.

    With ``relu=False`` (and ``at="residual"``) this is exactly token Input x Gradient at
    block ``l`` (:class:`~captum_vit.methods.ixg.TokenIxG` ``(model, layer=l)``).

    Args:
        {cam_args}
        {cam_at}

    Examples::

        >>> from captum_vit.methods.cam import HiResCAM
        >>> attr = HiResCAM(model).attribute(images, target=labels)
    """

    def cam(self, x: Tensor, g: Tensor, num_prefix: int) -> Tensor:
        return (x * g).sum(-1)


@register_method("gradcam_elementwise", kind="cam")
@fill_doc_with(CAM_ARGS)
class GradCAMElementWise(_TokenCAM):
    r"""Element-wise Grad-CAM (pytorch-grad-cam's ``GradCAMElementWise``) at one block:
    :math:`m_j = \sum_c \mathrm{ReLU}(G[j, c]\, X[j, c])`. Never below
    :class:`HiResCAM` (the ReLU is taken before the channel sum).

    Args:
        model (torch.nn.Module): a supported Vision Transformer.
        layer (int, optional): block ``l`` in ``[0, L-1]``; ``None`` (default) = ``L-1``.
        relu (bool, optional): clip the map at 0 (default True; the map is non-negative
            anyway).
        {cam_at}

    Examples::

        >>> from captum_vit.methods.cam import GradCAMElementWise
        >>> attr = GradCAMElementWise(model).attribute(images, target=labels)
    """

    def cam(self, x: Tensor, g: Tensor, num_prefix: int) -> Tensor:
        return (g * x).clamp(min=0).sum(-1)
