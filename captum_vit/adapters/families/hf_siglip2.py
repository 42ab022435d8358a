"""Adapter for Hugging Face SigLIP2 NaFlex: ``Siglip2VisionModel``,
the image side of the dual ``Siglip2Model`` (its ``get_image_features``; the text side is
the user's, to make target vectors) and ``Siglip2ForImageClassification``.

Verified in the installed transformers (``models/siglip2/modeling_siglip2.py`` and
``image_processing_siglip2.py``):

- **Inputs.** The model never sees images: its ``pixel_values`` are patches the processor
  flattened channels-last (``convert_image_to_patches``: ``(C, h, P, w, P)`` permuted to
  ``(h, w, P, P, C)``), padded to ``max_num_patches`` rows, with
  ``pixel_attention_mask [B, N]`` (the first ``h·w`` rows 1) and ``spatial_shapes
  [B, 2]`` (each image's ``(h, w)``). The patch embedding is an ``nn.Linear`` on the
  ``C·P·P`` values (SigLIP's ``Conv2d`` weight ``[D, C, P, P]`` permuted to
  ``[D, P, P, C]`` and flattened is the same map).
- **Positions.** ``Siglip2VisionEmbeddings.resize_positional_embeddings`` resizes the
  ``sqrt(num_patches)``-square table to each image's ``(h, w)`` (bilinear with
  antialiasing, as a linear map computed in float32) and adds it to the first ``h·w``
  rows; on the table's own grid it is the table itself (rounded to float32).
- **Padding.** ``create_bidirectional_mask`` turns the mask into a key mask (the dtype's
  minimum added to the padded keys' logits: exactly zero probability), so a valid row
  never reads a padded one; the attention-pool head masks the padded keys the same way
  and ``Siglip2ForImageClassification`` averages the valid rows only.

So an image's output does not depend on its padding, and the adapter explains images:
its plain input is ``[B, C, H, W]`` (``H``, ``W`` multiples of the patch size), which it
patchifies as the processor does and runs through the model's own ``embeddings`` with
``spatial_shapes = (H/P, W/P)`` (the model's own resize of the positions), every patch
valid; the tokens are the image's patches only. (The position resize runs in float32 for
the padded length, whose rounding may differ by an ulp between row counts: the embedding
is computed on the patches padded to ``num_patches`` rows, as the processor pads them,
and the padding rows dropped; tested equal to the model's padded batch to 1e-12.)
A processor's output goes through
:meth:`HFSiglip2Adapter.processor_images`: each image's valid patch rows back into the
image ``[1, C, h·P, w·P]``, images of one grid explained together, maps per image on
its own grid (:func:`captum_vit._base.attribute_processed`). Padding is never explained
and token removal removes valid tokens only.

The tower is the same ViT as SigLIP's (no prefix token, tanh-GELU MLPs,
``post_layernorm`` on every token, the attention-pool head read by
:func:`~captum_vit.adapters.families._hf.siglip_pool`); a tower built with
``vision_use_head=False`` outputs its final-normed tokens only: their mean stands for
its embedding (our choice, as for PaliGemma's SigLIP tower).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from captum_vit.adapters._typing import ModelTree
from captum_vit.adapters.catalog import Example, register_family
from captum_vit.adapters.families._examples import library, transformers_model
from captum_vit.adapters.families._hf import (
    HFPatchGrid,
    encoder_blocks,
    is_transformers_model,
    linear_head,
    pair,
    siglip_pool,
    vision_tower,
)
from captum_vit.adapters.families._naflex import (
    batch_value,
    pad_patches,
    patchify,
    split_padded,
)
from captum_vit.adapters.ops import Ops
from captum_vit.adapters.parts import HeadParts
from captum_vit.adapters.parts import layer_norm_parts as _norm

CLASSES = ("Siglip2VisionModel", "Siglip2Model", "Siglip2ForImageClassification")


def is_hf_siglip2(model: nn.Module) -> bool:
    """``True`` for the Hugging Face SigLIP2 models in :data:`CLASSES`."""
    return is_transformers_model(model, CLASSES)


def siglip2_vision_config(depth: int = 3, **overrides: Any) -> dict[str, Any]:
    """The keywords of the tiny ``Siglip2VisionConfig`` of the examples: width 32, 4
    heads, MLP 64, patch 8, a 4x4 position table (``num_patches=16``), ``depth``
    blocks."""
    return dict(hidden_size=32, intermediate_size=64, num_hidden_layers=depth,
                num_attention_heads=4, num_channels=3, patch_size=8, num_patches=16,
                layer_norm_eps=1e-6, **overrides)


def siglip2_example(cls_name: str) -> Any:
    """A builder of a tiny random SigLIP2 model ``cls_name`` (:data:`CLASSES`; the dual
    model with a 2-layer text tower, the classifier over the tiny tower)."""

    def build(*, seed: int = 0, depth: int = 3, dtype: torch.dtype = torch.float64,
              num_classes: int = 5, **overrides: Any) -> nn.Module:
        transformers = library("transformers")
        vision = transformers.Siglip2VisionConfig(**siglip2_vision_config(depth, **overrides))
        if cls_name == "Siglip2VisionModel":
            cfg = vision
        else:
            text = transformers.Siglip2TextConfig(
                vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=16, projection_size=32,
                pad_token_id=0, bos_token_id=1, eos_token_id=2)
            cfg = transformers.Siglip2Config(vision_config=vision.to_dict(),
                                             text_config=text.to_dict(),
                                             num_labels=num_classes)
        return transformers_model(cls_name, cfg, seed, dtype)

    return build


@register_family(
    is_hf_siglip2,
    supports="Hugging Face Siglip2VisionModel, Siglip2Model, Siglip2ForImageClassification "
             "(SigLIP2 NaFlex: images or the processor's padded patches)",
    tags=("embedding", "vlm-tower", "variable-size"),
    notes=("`Siglip2VisionModel`, the image side of `Siglip2Model` (vector targets) and "
           "`Siglip2ForImageClassification` (masked mean, class targets): ✅ on images "
           "`[B, C, H, W]` (any multiple of the patch size; the model's own position resize) "
           "and on the processor's output (`pixel_values`, `pixel_attention_mask`, "
           "`spatial_shapes`): a batch of several sizes in one call, maps per image on its "
           "own grid, padding never explained (forward equals the padded model's to 1e-12; "
           "maps equal a `SiglipVisionModel` twin's with copied weights, every method, "
           "1e-10)"),
    examples={
        "hf_siglip2": Example(siglip2_example("Siglip2VisionModel"), (24, 40),
                              library="transformers", target="embedding"),
        "hf_siglip2_cls": Example(siglip2_example("Siglip2ForImageClassification"),
                                  (32, 16), library="transformers", tags=("classifier",)),
        "hf_siglip2_dual": Example(siglip2_example("Siglip2Model"), (24, 24),
                                   library="transformers", target="embedding",
                                   suite=False),
    })
class HFSiglip2Adapter(HFPatchGrid):
    """Canonical view of a Hugging Face SigLIP2 vision tower (never modified).

    Its plain input is images ``[B, C, H, W]``; :meth:`processor_images` reads a
    processor's output (the module docstring). The embedding models (``Siglip2VisionModel``,
    ``Siglip2Model``) output the attention-pooled embedding and take vector targets;
    ``Siglip2ForImageClassification`` outputs class logits of the valid rows' mean.

    Examples::

        >>> batch = processor(images=[wide, tall], return_tensors="pt")
        >>> batch["pixel_values"] = batch["pixel_values"].double()   # the model's dtype
        >>> maps = GAE(model).attribute(batch, target=EmbeddingTarget(text))  # two maps
    """

    embedding = True
    processor_keys = ("pixel_attention_mask", "spatial_shapes")
    dropout_fields = ("attention_dropout",)

    def __init__(self, model: ModelTree) -> None:
        self.model = model
        name = type(model).__name__
        self.backbone = vision_tower(model)
        cfg = self.config
        self.layers = self.backbone.encoder.layers
        self.blocks = encoder_blocks(self.layers, cfg, name)
        self.in_chans = int(cfg.num_channels)
        self.num_prefix = 0
        self.interpolates = True
        norm = _norm(self.backbone.post_layernorm, f"{name}.post_layernorm")
        classifier = getattr(model, "classifier", None)
        if classifier is not None:  # Siglip2ForImageClassification: masked mean, linear
            if not isinstance(classifier, nn.Linear | nn.Identity):
                raise TypeError(f"{name}.classifier is {type(classifier).__name__}; "
                                "captum_vit needs its linear classifier (or none, "
                                "num_labels=0)")
            weight, bias = linear_head(classifier)
            self.embedding = weight is None
            self.readout = "avg"
            self.head = HeadParts(norm, None, (("avg", weight, bias),))
        elif getattr(self.backbone, "head", None) is None \
                or not getattr(self.backbone, "use_head", True):
            # no pooling head (vision_use_head=False): the mean of the final-normed
            # tokens stands for its embedding (our choice, as for PaliGemma's tower)
            self.readout = "avg"
            self.head = HeadParts(norm, None, (("avg", None, None),))
        else:
            self.readout = "map"
            self.head = HeadParts(norm, None, (("map", None, None),),
                                  attn_pool=siglip_pool(self.backbone.head, f"{name}.head"))

    @property
    def config(self) -> Any:
        """The vision configuration (``vision_config`` of the dual model and the
        classifier)."""
        return getattr(self.model.config, "vision_config", self.model.config)

    @property
    def patch_size(self) -> tuple[int, int]:
        """``(P, P)``: the patch size of the processor and of the patch embedding."""
        return pair(self.config.patch_size)

    @property
    def input_shape(self) -> tuple[int, tuple[int, int]]:
        """``(C, (s·P, s·P))`` with ``s = sqrt(num_patches)``: the grid of the position
        table (the model takes any grid; its processor picks one per image)."""
        side = math.isqrt(int(self.config.num_patches))
        p = self.patch_size
        return self.in_chans, (side * p[0], side * p[1])

    def is_random(self) -> bool:
        """In training mode with ``attention_dropout > 0`` (the vision configuration's)."""
        return bool(self.model.training) and getattr(self.config, "attention_dropout", 0) > 0

    def refresh(self) -> None:
        """Nothing is sliced but the pool's ``in_proj_weight``: re-read it after
        ``model.to(...)``."""
        pool = self.head.attn_pool
        if pool is not None and cast(Tensor, pool.q_weight).data_ptr() != \
                self.backbone.head.attention.in_proj_weight.data_ptr():
            self.head = dataclasses.replace(self.head, attn_pool=siglip_pool(
                self.backbone.head, f"{type(self.model).__name__}.head"))

    def _model_inputs(self, inputs: Tensor) -> dict[str, Tensor]:
        """The model's keywords for images ``inputs``, laid out as its processor lays them
        out: their patches (the processor's order) padded with zero rows to
        ``num_patches`` (the processor's ``max_num_patches`` of the released models) when
        they are fewer, the mask of the valid rows, and their grid.

        Why pad: the model resizes its position table in float32 for the padded length
        (``resize_positional_embeddings(..., max_length=pixel_values.shape[1])``), and a
        float32 product of another row count may round differently (1 ulp, ~1e-8,
        measured for a 1x3 grid unpadded vs padded); padded as the processor pads, the
        positions are those of the processor's batch. The padded rows are keys of zero
        probability: the valid rows' values do not depend on them."""
        b, _, h, w = inputs.shape
        (ph, pw) = self.patch_size
        patches = patchify(inputs, (ph, pw))
        n = patches.shape[1]
        length = max(n, int(self.config.num_patches))
        shapes = torch.tensor([[h // ph, w // pw]], device=inputs.device).expand(b, 2)
        mask = torch.zeros(b, length, dtype=torch.int32, device=inputs.device)
        mask[:, :n] = 1
        return {"pixel_values": F.pad(patches, (0, 0, 0, length - n)),
                "pixel_attention_mask": mask, "spatial_shapes": shapes}

    def embed(self, inputs: Tensor, ops: Ops | None = None) -> Tensor:
        """The model's own ``embeddings(patches, spatial_shapes)`` of the images'
        patches (padded as the processor pads them, :meth:`_model_inputs`; the valid rows
        kept): the patch ``Linear`` plus the position table resized to the images' grid
        by the model's code. With ``ops`` (:meth:`ViTAdapter.embed`) the embedding of the
        detached images is the value and the patch projection ``p`` through
        ``ops.linear`` is added as ``p - p.detach()`` (exactly 0): every pixel gradient
        runs through ``ops.linear``."""
        kw = self._model_inputs(inputs)
        emb = self.backbone.embeddings
        (ph, pw) = self.patch_size
        n = (inputs.shape[-2] // ph) * (inputs.shape[-1] // pw)
        if ops is None:
            return emb(kw["pixel_values"], kw["spatial_shapes"])[:, :n]
        x = emb(kw["pixel_values"].detach(), kw["spatial_shapes"])[:, :n]
        lin = emb.patch_embedding
        p = ops.linear(kw["pixel_values"][:, :n], lin.weight, lin.bias)
        return x + (p - p.detach())

    def model_outputs(self, inputs: Tensor) -> Tensor:
        """The model's own output for images (laid out as its processor lays them out,
        :meth:`_model_inputs`): the dual model's ``get_image_features``,
        the tower's ``pooler_output`` (the token mean without a head), the classifier's
        logits."""
        kw = self._model_inputs(inputs)
        if hasattr(self.model, "get_image_features"):  # the dual Siglip2Model
            out = self.model.get_image_features(**kw)
            return out if isinstance(out, Tensor) else out.pooler_output
        out = self.model(**kw)
        if hasattr(out, "logits"):
            return out.logits
        if out.pooler_output is None:  # a head-less tower
            return out.last_hidden_state.mean(1)
        return out.pooler_output

    def parameter_stages(self) -> list[list[nn.Parameter]]:
        """Head stage (``post_layernorm`` with the pooling head, or the classifier: the
        classifier's logits do not read the pooling head, which belongs to no stage), then
        the layers ``L-1 .. 0``."""
        bb = self.backbone
        classifier = getattr(self.model, "classifier", None)
        head = [bb.post_layernorm, classifier if classifier is not None
                else getattr(bb, "head", None)]
        stages = [[p for mod in head if mod is not None for p in mod.parameters()]]
        stages += [list(layer.parameters()) for layer in reversed(self.layers)]
        return stages

    # -- the processor's output ------------------------------------------------------------
    def processor_images(self, batch: Mapping[str, Any]) -> list[tuple[Tensor, Tensor]]:
        """Each image of a ``Siglip2ImageProcessor`` output as the image ``[1, C, h·P,
        w·P]`` of its valid patch rows, grouped by grid.

        Args:
            batch (Mapping): ``pixel_values [B, N, P·P·C]``, ``pixel_attention_mask [B, N]``,
                ``spatial_shapes [B, 2]``.

        Returns:
            list of ``(index, images)`` (:meth:`ViTAdapter.processor_images`).

        Raises:
            ValueError: a key missing, a shape that does not fit the patch size, a grid with
                more patches than ``pixel_values`` holds, or a mask that disagrees with
                ``spatial_shapes`` (its valid rows are not the grid's ``h·w`` first ones).
        """
        what = type(self.model).__name__
        pv = batch_value(batch, "pixel_values", what)
        mask = batch_value(batch, "pixel_attention_mask", what)
        shapes = batch_value(batch, "spatial_shapes", what)
        if shapes.dim() != 2 or shapes.shape[-1] != 2:
            raise ValueError(f"spatial_shapes has shape {tuple(shapes.shape)}; expected "
                             "[B, 2], each image's (h, w) in patches")
        grids = [(int(h), int(w)) for h, w in shapes.tolist()]
        return split_padded(pv, mask, grids, self.patch_size, self.in_chans,
                            names=("pixel_values", "pixel_attention_mask", "spatial_shapes"))

    def processor_pixels(self, maps: Sequence[Tensor], batch: Mapping[str, Any]) -> Tensor:
        """Per-image pixel maps as ``batch["pixel_values"]``: each image's patches in the
        processor's order, zero on the padding rows."""
        pv = batch_value(batch, "pixel_values", type(self.model).__name__)
        return pad_patches(maps, pv, self.patch_size)
