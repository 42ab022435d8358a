"""Depth of a region: a target on Hugging Face's DPT and Depth Anything depth estimators
with a DINOv2 backbone."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from captum_vit.adapters.hf_depth import HFDepthHead
from captum_vit.adapters.scoring import Outputs
from captum_vit.targets.score import _SelectedTarget


class DepthTarget(_SelectedTarget):
    r"""``Σ select ⊙ predicted_depth``: the depth a ``DPTForDepthEstimation`` or
    ``DepthAnythingForDepthEstimation`` predicts in a region, explained on its DINOv2
    backbone.

    Explain the backbone (``depth_model.backbone``, a ``Dinov2Backbone``) with this target:
    the score reads the block outputs ``x_l`` of the backbone's ``out_indices``
    (:attr:`blocks`; stage ``"stage{l}"`` is ``hidden_states[l]``), applies what the
    backbone does after its encoder (its final ``layernorm`` when
    ``config.apply_layernorm``; the CLS row dropped and the patches on the grid when
    ``config.reshape_hidden_states``), then runs the model's own ``neck`` and ``head``
    modules as they are (:class:`~captum_vit.adapters.hf_depth.HFDepthHead`), so the
    score equals the model's own ``predicted_depth`` summed over ``select``.

    What each method does with it (captum_vit's choices for targets reading token rows):
    the target reads several blocks, so the matrix methods sum one readout per read block,
    each weighing the rows of ``x_l`` by ``ReLU(⟨x_l,i, ∂s/∂x_l,i⟩)`` (gradient-weighted
    methods) or uniformly over the patch rows (gradient-free ones; DPT's
    ``readout_type="project"``/``"add"`` also reads the CLS row, which this uniform
    readout leaves out); the propagating methods differentiate neck and head as they are.
    PLUS, SkipPLUS and FullGrad+ refuse several-block targets, and TIS (true token
    removal) refuses a token-reading target; the removal metrics need
    ``removal="mean"`` (pixel removal). A depth summed over a region is not a class
    score: methods that explain a probability by default (ScoreCAM, RISE, ViT-CX) would
    explain its sigmoid, which saturates; pass them ``score="logit"``.

    Args:
        model (nn.Module): the depth estimator, in eval mode; its ``backbone`` must be the
            model explained.
        select (Tensor): weights of the predicted depth, ``[h, w]`` for every image or
            ``[B, h, w]`` one per image (a boolean mask counts as 0/1), of the size of
            ``predicted_depth`` for these images (Depth Anything: the input size; DPT:
            what its head upsamples to).

    Raises:
        TypeError: another model, or a backbone other than ``Dinov2Backbone``;
            ``select`` not a tensor.
        ValueError: ``select`` not 2-D or 3-D, all zero (for some image), or of another
            size than the predicted depth (at scoring time); the neck or head in training
            mode.

    Examples::

        >>> from captum_vit import GAE
        >>> from captum_vit.targets import DepthTarget
        >>> near = torch.zeros(518, 518); near[300:, 200:320] = 1    # a region of the image
        >>> maps = GAE(depth_model.backbone).attribute(
        ...     pixel_values, target=DepthTarget(depth_model, near))
    """

    reads_tokens = True
    shared_dims = 2
    blocks: tuple[int, ...]  # always the head's (never None)

    def __init__(self, model: nn.Module, select: Tensor) -> None:
        self.head = HFDepthHead(model)
        if not isinstance(select, Tensor):
            raise TypeError(f"DepthTarget's select must be a tensor [h, w] or [B, h, w], "
                            f"got {type(select).__name__}")
        if select.dim() not in (2, 3):
            raise ValueError(f"DepthTarget's select must be [h, w] (every image) or [B, h, w] "
                             f"(one per image), got shape {tuple(select.shape)}")
        self._set_select(select)
        empty = (~(self.select != 0).reshape(-1, *self.select.shape[-2:]).flatten(1).any(1)
                 ).nonzero()[:, 0].tolist()
        if empty:
            which = "" if select.dim() == 2 else f" of image(s) {empty}"
            raise ValueError(f"DepthTarget's select{which} selects no pixel (all zero): the "
                             "score would be 0 and every map flat; give a region with "
                             "non-zero weights, e.g. select[y0:y1, x0:x1] = 1")
        self.blocks = self.head.blocks

    def __repr__(self) -> str:
        return (f"DepthTarget({type(self.head.model).__name__}, "
                f"select={tuple(self.select.shape)})")

    def depth(self, out: Outputs) -> Tensor:
        """The model's ``predicted_depth`` ``[n, h, w]`` from the block outputs in ``out``."""
        return self.head([out.hidden[l] for l in self.blocks], out)

    def columns(self, out: Outputs) -> Tensor:
        y = self.depth(out)
        sel = self.select.to(device=y.device, dtype=y.dtype)
        if sel.shape[-2:] != y.shape[-2:]:
            raise ValueError(f"DepthTarget's select is {tuple(sel.shape[-2:])} but the model "
                             f"predicts depth maps of {tuple(y.shape[-2:])} for these images: "
                             "give select that size")
        if self._per_image():  # one column per selection: [n, B]
            return torch.einsum("nhw,bhw->nb", y, sel)
        return (y * sel).flatten(1).sum(1)[:, None]
