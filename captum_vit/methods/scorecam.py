r"""Score-CAM (Wang et al., CVPRW 2020) on ViT tokens at block ``l`` (as the CAM family of
SkipPLUS, Mehri et al. 2024, App. E.1.1; :mod:`captum_vit.methods.cam`).

Each of the D channels of the block input :math:`X = x_l \in \mathbb{R}^{N \times D}` gives
a mask over the patches, :math:`M_c[j] = (X[j, c] - \min_P X[:, c]) / (\max_P X[:, c] -
\min_P X[:, c])` over the patch rows ``P`` (a channel that is constant over the patches
gives the all-zero mask). The model scores the image seen through every mask,
:math:`s_c = p_{\text{target}}(\text{image} \odot \mathrm{up}(M_c))` (the mask
nearest-upsampled to pixels, patch by patch), or, with ``removal="tokens"``, the
sequence of the prefix tokens plus the patches with :math:`M_c \ge 0.5` (true token
removal). The map is :math:`m_j = \sum_c \mathrm{softmax}_c(s)_c\, X[j, c]` over all
tokens; no gradients. Cost per image: one clean forward plus D masked forwards (768 for
ViT-B), batched over channels and images (``max_channels``: only the channels of largest
variance, "Faster Score-CAM"). With ``at="norm1"`` the channels are those of block
``l``'s first LayerNorm output :math:`\mathrm{LN}_1(x_l)` instead (pytorch-grad-cam's ViT
layer).
"""

from __future__ import annotations

from typing import Any

import torch
from captum.log import log_usage
from torch import Tensor, nn

from captum_vit._base import (
    SCORES,
    TargetLike,
    ViTPerturbationAttribution,
    accumulation_dtype,
    check_choice,
    check_scalar,
    format_output,
    resolve_target,
    score_reduce,
)
from captum_vit.adapters import (
    BlockRecord,
    FusedOps,
    Layout,
    ViTAdapter,
    image_logits,
    pools_patches,
    subset_forwards,
    subset_logits,
)
from captum_vit.methods._front import fill_doc
from captum_vit.methods.cam import SITES, block_layer
from captum_vit.methods.table import register_method

REMOVALS = ("pixels", "tokens")
"""How a channel's mask is applied: pixel multiplication or true token removal."""


def channel_masks(x: Tensor, num_prefix: int) -> Tensor:
    """Min-max normalised channels over the patch rows, one mask per channel.

    Args:
        x (Tensor): activations ``X`` [B, N, D].
        num_prefix (int): ``K``, the prefix tokens (not part of the masks).

    Returns:
        Tensor: masks [B, D, P] in ``[0, 1]``; a channel constant over the patches gives 0.
    """
    xp = x[:, num_prefix:]
    lo, hi = xp.amin(1, keepdim=True), xp.amax(1, keepdim=True)
    span = hi - lo
    m = (xp - lo) / torch.where(span > 0, span, torch.ones_like(span))
    return torch.where(span > 0, m, torch.zeros_like(m)).transpose(1, 2)


def top_variance_channels(x: Tensor, num_prefix: int, n: int) -> Tensor:
    """The ``n`` channels of ``x`` [B, N, D] with the largest variance over the patch rows,
    per image, in decreasing variance (ties: lower channel first) -> [B, N, n]."""
    var = x[:, num_prefix:].var(1, correction=0)
    idx = torch.argsort(var, dim=1, descending=True, stable=True)[:, :n]
    return x.gather(2, idx[:, None, :].expand(-1, x.shape[1], -1))


def masked_image_scores(adapter: ViTAdapter, inputs: Tensor, masks: Tensor, layout: Layout,
                        reduce: Any, *, batch_size: int, show_progress: bool = False,
                        desc: str = "ScoreCAM") -> Tensor:
    """The model's own forward on every image times every one of its patch masks.

    Job ``(b, s)`` is ``inputs[b] * up(masks[b, s])`` (``up`` = nearest upsampling of the
    patch grid to pixels, as :func:`~captum_vit._base.format_output`); jobs of all images
    and masks are batched, ``batch_size`` images per forward, by the pixel engine
    :func:`~captum_vit.adapters.subsets.image_logits`.

    Args:
        adapter (ViTAdapter): the model's adapter (``adapter.model_logits`` runs them).
        inputs (Tensor): images [B, C, H, W].
        masks (Tensor): patch masks [B, S, P].
        layout (Layout): the token layout of ``inputs``.
        reduce (callable): ``reduce(logits [n, classes], images [n]) -> values [n]``.
        batch_size (int): images per forward.
        show_progress (bool): tqdm progress bar over the jobs.
        desc (str): the bar's label.

    Returns:
        Tensor: ``reduce``'s values [B, S].
    """
    b, s, _ = masks.shape

    def make(jobs: Tensor) -> tuple[Tensor, Tensor]:
        ii, jj = jobs // s, jobs % s
        images = inputs[ii]
        up = format_output(masks[ii, jj].to(images.dtype), layout, images, "pixels")
        return images * up, ii

    return image_logits(adapter, b * s, make, batch_size=batch_size, reduce=reduce,
                        show_progress=show_progress, desc=desc,
                        device=inputs.device).reshape(b, s)


@register_method("scorecam", kind="cam", quick={"max_channels": 128})
class ScoreCAM(ViTPerturbationAttribution):
    r"""Score-CAM on the tokens of block ``layer``: channel weights from the model's
    scores of the image masked by each channel (Wang et al., CVPRW 2020).

    With :math:`X = x_l \in \mathbb{R}^{N \times D}` and, for every channel :math:`c`, the
    mask :math:`M_c = \mathrm{minmax}(X[P, c])` over the patch rows :math:`P` (0 for a
    channel constant over the patches),

    .. math::
        s_c = p_{\text{target}}\big(\text{image} \odot \mathrm{up}(M_c)\big),\qquad
        w = \mathrm{softmax}_c(s),\qquad m_j = \sum_c w_c X[j, c],

    ``up`` = nearest upsampling of the patch grid to pixels (each pixel takes its patch's
    value), :math:`p` the softmax probability (``score="probability"``, default, the
    paper; the target logit with ``score="logit"``). With ``removal="tokens"`` the masked
    forward instead keeps the prefix tokens and the patch tokens with
    :math:`M_c \ge 0.5` (true token removal, tokens taken after the positional
    embedding, as SkipPLUS §4.1). No baseline score is subtracted. With ``at="norm1"``,
    :math:`X` is block ``l``'s first LayerNorm output :math:`\mathrm{LN}_1(x_l)` (masks
    and map alike).

    pytorch-grad-cam 1.5.7 (``score_cam.py``, ``ScoreCAM`` with a ViT
    ``reshape_transform``) differs in its conventions: it upsamples the activations
    bilinearly (``UpsamplingBilinear2d``, corners aligned) to the image size and
    min-max normalises each channel over the pixels with :math:`10^{-8}` added to the
    denominator (a constant channel gives a zero mask there too); it scores with its
    target, by default ``ClassifierOutputTarget``, the logit; it reads every score as a
    Python number (``.item()``) and collects them with ``torch.Tensor``, i.e. in float32
    whatever the model's dtype, so its softmax and weights are float32 (a float64 model's
    scores are rounded to float32); and it returns the map after a ReLU, per-image min-max
    scaling and a resize (float32). This class masks with the patch-constant upsampling of
    masks normalised over the patch rows (no :math:`10^{-8}`), defaults to the
    probability, keeps the scores, the softmax and the map in the model's dtype (float32
    for half precision), and returns the raw map. ``score="logit"`` and
    ``output="tokens"`` come closest to it; the masks still differ.

    Cost: one clean forward plus D masked forwards per image (768 for ViT-B/16), batched
    ``batch_size`` at a time over channels AND images; no backward. ``attribute(...,
    max_channels=n)`` scores only the n channels of largest variance (Faster Score-CAM, an
    approximation for a quick look). After each call
    :attr:`num_forwards` holds the number of model evaluations (images or shortened
    sequences) that call ran, the clean ones included; with ``removal="tokens"`` a mask
    keeping every patch reuses the clean logits and is not counted.

    Args:
        model (torch.nn.Module): a supported Vision Transformer.
        layer (int, optional): block ``l`` in ``[0, L-1]`` whose input gives the channels;
            ``None`` (default) = the last block ``L-1``.
        relu (bool, optional): clip the map at 0 (default True; with softmax weights a
            negative value comes only from negative features).
        batch_size (int, optional): masked images (or sequences) per forward. Default 64.
        removal (str, optional): ``"pixels"`` (default: the image times the upsampled
            mask, through the model's own forward) or ``"tokens"`` (keep the patches with
            ``M_c >= 0.5``, through the adapters' subset engine,
            :func:`~captum_vit.adapters.subsets.subset_logits`).
        progress (bool, optional): tqdm progress bar over the masked forwards. Default
            False.
        at (str, optional): where block ``layer`` is read: ``"residual"`` (default, its
            input :math:`x_l`) or ``"norm1"`` (its first LayerNorm's output,
            pytorch-grad-cam's ViT layer).

    Attributes:
        num_forwards (int): model evaluations of the last ``attribute`` call (0 before).

    Examples::

        >>> from captum_vit.methods.scorecam import ScoreCAM
        >>> attr = ScoreCAM(model, batch_size=128).attribute(images, target=labels)
        >>> grid = ScoreCAM(model, removal="tokens", progress=True).attribute(
        ...     images, target=labels, output="grid")
        >>> recipe = ScoreCAM(model, at="norm1").attribute(images, target=labels,
        ...                                                 score="logit")
    """

    layer_local = True
    """PLUS evaluates it on a one-block window: the map at block ``l``
    (:mod:`captum_vit.combinators`)."""

    def __init__(self, model: nn.Module, layer: int | None = None, relu: bool = True,
                 batch_size: int = 64, removal: str = "pixels", progress: bool = False, *,
                 at: str = "residual") -> None:
        super().__init__(model)
        self._layer_option = layer
        block_layer("layer", layer, self.adapter.num_blocks)  # checked now
        self.relu = check_scalar(relu, "relu", bool)
        self.batch_size = check_scalar(batch_size, "batch_size", int, min_val=1)
        self.removal = check_choice("removal", removal, REMOVALS)
        self.progress = check_scalar(progress, "progress", bool)
        self.at = check_choice("at", at, SITES)
        self.num_forwards = 0


    @property
    def layer(self) -> int:
        """The block read: the ``layer`` given, else the model's last block (under a target
        reading block outputs, the last block it reads)."""
        return block_layer("layer", self._layer_option, self.adapter.num_blocks)

    @log_usage()
    @fill_doc
    def attribute(self, inputs: Tensor, target: TargetLike = None, *,
                  score: str = "probability", max_channels: int | None = None,
                  output: str = "pixels") -> Tensor:
        r"""
        Args:
            {inputs}
            {target}
            score (str, optional): ``"probability"`` (default, softmax of the target, the
                paper) or ``"logit"``: the masked images' score :math:`s_c`.
            max_channels (int, optional): score only this many channels per image, those
                with the largest variance of :math:`X[P, c]` over the patch rows (ties:
                lower channel first); the softmax and the map then run over them only.
                This is "Faster Score-CAM" (tabayashi0117; tf-keras-vis' ``max_N``, which
                takes the union of the images' top channels, so there a map depends on
                its batch; here each image keeps its own), a quick approximation:
                ``max_channels`` masked forwards per image instead of D. ``None``
                (default) = every channel, the paper.
            {output}

        Returns:
            Tensor: the map (raw, not normalised) in the requested ``output`` format.

        Examples::

            >>> from captum_vit.methods.scorecam import ScoreCAM
            >>> cam = ScoreCAM(model)
            >>> attr = cam.attribute(images, target=labels)
            >>> cam.num_forwards    # len(images) * (1 + D)
            >>> fast = cam.attribute(images, target=labels, max_channels=64)
        """
        check_choice("score", score, SCORES)
        if max_channels is not None:
            check_scalar(max_channels, "max_channels", int, min_val=1)
        return self._attribute(inputs, target, output, score=score, max_channels=max_channels)

    def _token_maps(self, inputs: Tensor, target: Tensor | None, *,
                    score: str = "probability", max_channels: int | None = None,
                    **_: Any) -> Tensor:
        adapter, k = self.adapter, self.adapter.num_prefix
        layout = adapter.layout(inputs)
        dt = accumulation_dtype(inputs)
        with torch.no_grad():
            ops = FusedOps()
            x0 = adapter.embed(inputs)
            x = adapter.run(x0, 0, self.layer, ops=ops)  # X = x_l
            if self.at == "norm1":  # X = LN1(x_l), recorded by block l itself
                rec: list[BlockRecord] = []
                out = adapter.block(x, self.layer, ops, rec)
                x = rec[0].u
                logits = adapter.run(out, self.layer + 1, ops=ops)  # the clean forward
            else:
                logits = adapter.run(x, self.layer, ops=ops)  # the clean forward
        t = resolve_target(target, logits)
        x = x.to(dt)
        if max_channels is not None and max_channels < x.shape[-1]:
            x = top_variance_channels(x, k, max_channels)
        masks = channel_masks(x, k)  # [B, D, P]
        masks = adapter.stages.carry(masks, self.layer)  # stages: block l's grid onto the maps'
        b, d = masks.shape[:2]  # [B, D, P]

        scores = score_reduce(t, score, dt, adapter.probability)
        if self.removal == "pixels":
            s = masked_image_scores(adapter, inputs, masks, layout, scores,
                                    batch_size=self.batch_size, show_progress=self.progress)
            self.num_forwards = b * (1 + d)
        else:
            keep = masks >= 0.5
            s = subset_logits(adapter, x0, keep, batch_size=self.batch_size,
                              full_logits=logits, reduce=scores,
                              show_progress=self.progress, desc="ScoreCAM")
            self.num_forwards = b + subset_forwards(keep, k, reuse_full=True,
                                                    pools_patches=pools_patches(adapter))
        with torch.no_grad():
            m = torch.einsum("bnd,bd->bn", x, s.softmax(-1))
            return m.clamp(min=0) if self.relu else m
