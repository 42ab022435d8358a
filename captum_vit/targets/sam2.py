"""A mask of Segment Anything 2 as the target of a map of its image encoder (the model
side: :mod:`captum_vit.adapters.families.hf_sam2`)."""

from __future__ import annotations

from typing import Any, cast

from torch import Tensor, nn

from captum_vit.adapters.families.hf_sam2 import (
    sam2_check_mask_size,
    sam2_mask_logits,
    sam2_model,
    sam2_read_stages,
    sam2_stage_grids,
)
from captum_vit.adapters.scoring import Outputs
from captum_vit.targets.sam import SamMaskTarget, prompt_doc


@prompt_doc
class Sam2MaskTarget(SamMaskTarget):
    r"""The logits of one of SAM 2's masks summed over the pixels that mask covers: the
    evidence the image encoder gives the mask SAM 2 draws for a prompt (Ravi et al., 2024),
    defined as :class:`~captum_vit.targets.SamMaskTarget`'s.

    Any method explains SAM 2's **image encoder** (pass the ``Sam2Model`` itself: its
    ``vision_encoder`` is what the methods see, :mod:`captum_vit.adapters.families.hf_sam2`).
    SAM 2's mask decoder reads several scales: the image embedding (the FPN level of
    stride 16, which adds the upsampled level below it) and two high-resolution levels of
    the first stages. This target therefore reads the **outputs of the trunk's stages**
    the decoder uses (:attr:`blocks`: the last block of each such stage, a several-block
    readout) and continues from them through the model's own FPN neck, the decoder's
    ``conv_s0`` / ``conv_s1`` and ``no_memory_embedding``, prompt encoder and mask decoder
    (``Sam2Model.forward`` with ``image_embeddings``). It picks mask ``k`` of the decoder's
    outputs for the prompt and scores

    .. math:: s = \sum_{p \in R} z_k(p),

    the mask's low-resolution logits :math:`z_k` (``pred_masks[:, :, k]``) summed over its
    region :math:`R`, the pixels where the mask is positive on the **clean** forward of the
    images the method receives (:meth:`resolve`, called by the methods and metrics once
    per call). The region stays fixed on perturbed forwards. The matrix methods weigh each
    read stage's rows by their positive input×gradient relevance (gradient-weighted methods)
    or uniformly (gradient-free methods) and sum the stages' maps; DecompX's explicit route
    is linearised at the read stage outputs (the decoder is not linear; the neck is, but it
    is run as the model's code here). True token removal is refused (a windowed encoder
    keeps every token; remove pixels instead).

    With ``multimask_output=False`` the decoder picks its single mask as the model does in
    eval mode (``dynamic_multimask_via_stability``).

    Prompts are in pixel coordinates of the model's input images (what ``Sam2Processor``
    returns as ``input_points`` / ``input_boxes``, for the resized image). Each image has
    one prompt: points (with labels), a box, or both.

    Images must have the model's configured size (``Sam2Processor``'s resize):
    ``Sam2Model.forward`` itself draws no mask at another one (it reshapes the FPN levels
    to the fixed ``backbone_feature_sizes``; the prompt encoder's dense embedding and the
    decoder's positional embedding keep the configured grid). Embedding targets explain
    the image encoder at other sizes too (:mod:`captum_vit.adapters.families.hf_sam2`).

    Args:
        model (nn.Module): a Hugging Face ``Sam2Model``.
        {prompt_args}

    Raises:
        TypeError: ``model`` is not a ``Sam2Model``; prompts or ``mask`` of another type.
        ValueError: no prompt, prompts of the wrong shape, labels that do not match the
            points, a mask out of range, prompts outside the images (``points`` /
            ``boxes`` named), images of another size than the configured one or an empty
            mask region (:meth:`resolve`), or encoder states of another model.

    Examples::

        >>> import torch
        >>> from captum_vit import GAE
        >>> from captum_vit.adapters.families.hf_sam2 import sam2_example
        >>> from captum_vit.targets import Sam2MaskTarget
        >>> sam2 = sam2_example()()   # a tiny random Sam2Model; or Sam2Model.from_pretrained
        >>> x = torch.randn(2, 3, 32, 32, dtype=torch.float64,
        ...                 generator=torch.Generator().manual_seed(1))
        >>> target = Sam2MaskTarget(sam2, points=[[10.0, 12.0]], mask=0)
        >>> target.blocks             # the last block of each stage the decoder reads
        (1, 2, 4, 5)
        >>> GAE(sam2).attribute(x, target=target, output="grid").shape
        torch.Size([2, 1, 8, 8])

        With a checkpoint, prompts come from ``Sam2Processor`` for the resized image
        (``inputs["input_points"][0, 0]``: the points of the first image's first mask).
    """

    model_name = "Sam2Model"

    def __init__(self, model: nn.Module, points: Any = None, labels: Any = None,
                 boxes: Any = None, mask: int = 0, multimask_output: bool = True) -> None:
        super().__init__(model, points=points, labels=labels, boxes=boxes, mask=mask,
                         multimask_output=multimask_output)
        self.stages = sam2_read_stages(self.model)
        """The trunk stages the decoder reads (finest first)."""
        ends = [int(e) for e in self.model.vision_encoder.backbone.stage_ends]
        self.read = tuple(ends[s] + 1 for s in self.stages)
        """The block outputs ``x_l`` read: the last block of each stage in :attr:`stages`."""
        self.blocks = self.read
        self.grids = sam2_stage_grids(self.model)

    @staticmethod
    def _own_model(model: nn.Module) -> nn.Module:
        """``model`` if it is a ``Sam2Model`` (:func:`sam2_model`)."""
        return sam2_model(model)

    def resolve(self, adapter: Any, images: Tensor) -> Sam2MaskTarget:
        """This target with each image's mask region fixed
        (:meth:`SamMaskTarget.resolve <captum_vit.targets.SamMaskTarget.resolve>`), for
        images of the ``Sam2Model``'s configured size only.

        Raises:
            ValueError: as :meth:`SamMaskTarget.resolve`, or images of another size than
                the configured one (``Sam2Model.forward`` fixes it,
                :func:`~captum_vit.adapters.families.hf_sam2.sam2_check_mask_size`).
        """
        sam2_check_mask_size(self.model, (int(images.shape[-2]), int(images.shape[-1])))
        return cast(Sam2MaskTarget, super().resolve(adapter, images))

    def mask_logits(self, out: Outputs) -> Tensor:
        """Mask :attr:`mask`'s logits ``[n, u, h_m, w_m]`` of every prompt on the stage
        outputs ``out.hidden`` of ``n`` images (SAM 2's own neck and decoder)."""
        if not out.hidden:
            raise ValueError("Sam2MaskTarget reads the outputs of the image encoder's stages "
                             f"(blocks {list(self.read)}); explain the Sam2Model given to "
                             "the target")
        read = dict(zip(self.stages, self.read, strict=True))
        stages = {s: out.hidden[l] for s, l in read.items()}
        pts, lab, box = self._prompts()
        z = sam2_mask_logits(self.model, stages, self.grids, pts, lab, box,
                             self.multimask_output)
        return z[:, :, self.mask]

    def _mask_size(self) -> tuple[int, int]:
        h, w = self.model.prompt_encoder.image_embedding_size
        return 4 * int(h), 4 * int(w)
