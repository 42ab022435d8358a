"""Adapters for Swin Transformers (Liu et al., ICCV 2021): timm's ``SwinTransformer``.

Only this file knows Swin's attribute names. A Swin is a list of stages; its canonical
form (:mod:`captum_vit.adapters.windows`) is one :class:`BlockParts` per block whose
``window`` is the block's window partition (cyclic shift in every other block, padding of
the grid to whole windows, the seam mask of ``-100``, all as the model computes them) and
whose ``attn_bias`` is the model's own relative position bias of one window; the last
block of a stage carries the next stage's patch merge (LayerNorm + linear). The tokens
have no prefix rows, the maps land on the first stage's grid, and the logits read the mean
of the final stage's tokens after the final norm (``readout="avg"``).

Swin V2 (timm ``SwinTransformerV2``, Hugging Face ``Swinv2*``: cosine attention,
continuous position bias, residual post-norm) is its own family,
:mod:`captum_vit.adapters.families.swin_v2`, dispatched before this one; these readers
refuse it by name when built directly, and timm's ``SwinTransformerV2Cr`` always.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from captum_vit.adapters._typing import ModelTree
from captum_vit.adapters.base import ViTAdapter
from captum_vit.adapters.catalog import Example, register_family
from captum_vit.adapters.families._examples import library, seeded_model, twin_builder
from captum_vit.adapters.families._hf import (
    HFSwinBase,
    is_transformers_model,
    pair,
    swin_twin_config,
    swin_twin_weights,
)
from captum_vit.adapters.families._timm import (
    TimmSwinBase,
    gelu_mlp_fields,
    timm_attention_fields,
    timm_classes,
)
from captum_vit.adapters.families._torch import is_loaded_instance, loaded_class
from captum_vit.adapters.parts import BlockParts, require_timm
from captum_vit.adapters.parts import layer_norm_parts as _norm_parts
from captum_vit.adapters.windows import Windows

TIMM_SWIN_V2_CLASSES = (("timm.models.swin_transformer_v2", "SwinTransformerV2"),
                        ("timm.models.swin_transformer_v2_cr", "SwinTransformerV2Cr"))
"""timm's Swin V2 classes, refused by name (see the module docstring)."""


def _timm_swin_v2(model: nn.Module) -> bool:
    """Whether ``model`` is one of timm's Swin V2 classes."""
    v2 = tuple(c for c in (loaded_class(m, n) for m, n in TIMM_SWIN_V2_CLASSES) if c)
    return bool(v2) and isinstance(model, v2)


def is_timm_swin(model: nn.Module) -> bool:
    """``True`` for timm's ``SwinTransformer`` (and, to refuse them by name, its V2
    classes)."""
    return (is_loaded_instance(model, "timm.models.swin_transformer", "SwinTransformer")
            or _timm_swin_v2(model))


def is_hf_swin(model: nn.Module) -> bool:
    """``True`` for Hugging Face ``SwinForImageClassification`` / ``SwinModel`` (and, to
    refuse them by name, the Swin V2 classes); transformers is never imported for other
    models."""

    return is_transformers_model(model, HF_SWIN_CLASSES + HF_SWIN_V2_CLASSES)


def _example(**extra: Any) -> Callable[..., nn.Module]:
    """A builder of a small timm ``SwinTransformer`` (32x32 unless ``extra`` says, patch 4,
    width 16, heads (2, 4), two stages of two blocks unless ``depths=``); ``extra`` and
    build-time ``overrides`` go to the constructor. Its depth is ``depths``, so ``depth``
    is not used."""
    def build(*, seed: int = 0, depth: int = 3, dtype: torch.dtype = torch.float64,
              num_classes: int = 5, depths: tuple[int, ...] = (2, 2),
              **overrides: Any) -> nn.Module:
        heads = (2, 4)[:len(depths)] if len(depths) <= 2 else (2,) * len(depths)
        kwargs: dict[str, Any] = dict(img_size=(32, 32), patch_size=4, in_chans=3,
                                      embed_dim=16, depths=depths, num_heads=heads,
                                      mlp_ratio=2.0, num_classes=num_classes,
                                      drop_path_rate=0.0)
        return seeded_model("timm.models.swin_transformer", "SwinTransformer", seed,
                            **{**kwargs, **extra, **overrides}).to(dtype).eval()

    return build


@register_family(
    is_timm_swin,
    name="timm_swin",
    supports="timm SwinTransformer (v1; not SwinTransformerV2)",
    tags=("classifier", "windowed", "hierarchical"),
    notes=("Windowed attention with cyclic shift, seam mask, padding to whole windows and "
           "relative position bias, patch merges between stages (read through "
           "`adapters/windows.py`), mean readout after the final norm; the configured "
           "`img_size`: ✅ maps on the first stage's grid (56 × 56 for Swin-T at 224 px; see "
           "[Swin](#swin-transformers) below for what each method does there) — refused by name: "
           "TIS and true token removal (use RISE / ViT-CX and the metrics' pixel removal), "
           "`SwinTransformerV2Cr` (Swin V2 has its own family)"),
    examples={
        "timm_swin": Example(_example(window_size=2), (32, 32)),
        # a 10x10 grid padded to whole windows of 3, an odd 5x5 second stage
        "timm_swin_pad": Example(_example(window_size=3, img_size=(40, 40)), (40, 40)),
    })
class TimmSwinAdapter(TimmSwinBase):
    """Canonical view of a timm ``SwinTransformer`` (v1): windowed blocks, merges between
    stages, mean readout (:mod:`captum_vit.adapters.families.swin`).

    The q/k/v parts are row views of each block's fused ``qkv`` parameter and the relative
    position bias is the model's own ``WindowAttention._get_rel_pos_bias``; the model is
    never changed.

    Raises:
        TypeError: ``SwinTransformerV2`` / ``SwinTransformerV2Cr``, a head without global
            average pooling, or blocks of another kind.
    """

    model: ModelTree  # read by attribute names (captum_vit.adapters._typing)

    def __init__(self, model: ModelTree) -> None:
        super().__init__()
        SwinTransformer, SwinTransformerBlock = timm_classes(
            "timm.models.swin_transformer", "SwinTransformer", "SwinTransformerBlock")
        name = type(model).__name__
        require_timm((1, 0, 31), name, "sizes a stage's windows differently where its grid is "
                     "smaller than the window (timm 1.0.31 resolves one window size per stage)")
        if _timm_swin_v2(model) or not isinstance(model, SwinTransformer):
            raise TypeError(
                f"captum_vit cannot explain timm's {name}: Swin V2's cosine attention with "
                "a learned logit scale, continuous position bias (an MLP over log-spaced "
                "coordinates) and post-norm blocks do not fit the pre-LN canonical block; "
                "use a Swin v1 (timm SwinTransformer, e.g. swin_tiny_patch4_window7_224)")
        self._adopt(model, SwinTransformerBlock, "Swin")

    def _read_parts(self) -> None:
        """The canonical parts of every block and of the head (views of the model)."""

        (PatchMerging,) = timm_classes("timm.models.swin_transformer", "PatchMerging")
        parts: list[BlockParts] = []
        for where, blk, merge in self._blocks_and_merges(PatchMerging):
            parts.append(BlockParts(
                **timm_attention_fields(blk, where), **gelu_mlp_fields(blk.mlp, where),
                attn_bias=blk.attn._get_rel_pos_bias,
                window=Windows(grid=pair(blk.input_resolution), size=pair(blk.window_size),
                               shift=pair(blk.shift_size)),
                merge=merge))
        self.blocks = parts
        self._read_head()



HF_SWIN_CLASSES = ("SwinForImageClassification", "SwinModel")
"""The Hugging Face Swin classes :class:`HFSwinAdapter` reads."""
HF_SWIN_V2_CLASSES = ("Swinv2ForImageClassification", "Swinv2Model")
"""Hugging Face Swin V2 classes, refused by name (see the module docstring)."""


def hf_swin_twin(timm_model: nn.Module, *, pooled: bool = False) -> nn.Module:
    """The Hugging Face ``SwinForImageClassification`` (``pooled``: ``SwinModel``) with the
    weights of a timm ``SwinTransformer`` (same shapes, same dtype), eval mode.

    Args:
        timm_model (nn.Module): a timm ``SwinTransformer`` (no absolute positions).
        pooled (bool, optional): build the head-less ``SwinModel``. Default ``False``.

    Returns:
        nn.Module: the twin.
    """
    transformers = library("transformers")
    m = cast(ModelTree, timm_model)
    cfg = transformers.SwinConfig(**swin_twin_config(timm_model))
    cls = transformers.SwinModel if pooled else transformers.SwinForImageClassification
    hf = cls(cfg).to(next(timm_model.parameters()).dtype).eval()
    src = timm_model.state_dict()
    pre = "" if pooled else "swin."
    out = swin_twin_weights(timm_model, pre, pooled)
    for s, st in enumerate(m.layers):
        for j in range(len(st.blocks)):
            a, b = f"layers.{s}.blocks.{j}.", f"{pre}encoder.layers.{s}.blocks.{j}."
            for k in ("weight", "bias"):
                out[f"{b}mlp.fc1.{k}"] = src[f"{a}mlp.fc1.{k}"]
                out[f"{b}mlp.fc2.{k}"] = src[f"{a}mlp.fc2.{k}"]
                out[f"{b}attention.o_proj.{k}"] = src[f"{a}attn.proj.{k}"]
                for name, t in zip(("q", "k", "v"), src[f"{a}attn.qkv.{k}"].chunk(3),
                                   strict=True):
                    out[f"{b}attention.{name}_proj.{k}"] = t
            out[f"{b}attention.relative_position_bias.relative_position_bias_table"] = \
                src[f"{a}attn.relative_position_bias_table"]
    missing, unexpected = hf.load_state_dict(out, strict=False)
    if unexpected or not all("relative_position_index" in k for k in missing):
        raise ValueError(f"the timm weights do not map onto {cls.__name__}: missing "
                         f"{missing}, unexpected {unexpected}")
    return hf


def _twin_example(*, pooled: bool = False, **extra: Any) -> Callable[..., nn.Module]:
    """A builder of the Hugging Face twin (:func:`hf_swin_twin`; ``pooled``: the head-less
    ``SwinModel``) of a timm Swin example."""
    return twin_builder(_example(**extra), hf_swin_twin, pooled=pooled)


@register_family(
    is_hf_swin,
    name="hf_swin",
    supports="Hugging Face SwinForImageClassification and SwinModel (at the configured size)",
    tags=("classifier", "embedding", "windowed", "hierarchical"),
    notes=("`SwinForImageClassification`; `SwinModel` through its `pooler_output`, with vector "
           "targets: ✅ as timm's Swin (forward equal to 1e-12 in float64 with SDPA attention; "
           "maps equal a timm twin's to 1e-10 where the windows divide the grids — with padding "
           "and a shift the two libraries differ: Hugging Face pads before the roll, timm after, "
           "and each adapter follows its model) — refused: as timm's Swin, other input sizes "
           "(`Swinv2*` have their own family)"),
    examples={
        # the timm examples' twins (weights mapped)
        "hf_swin": Example(_twin_example(window_size=2), (32, 32), library="transformers"),
        # a support-matrix column: the head-less SwinModel twin of timm_swin
        "hf_swin_model": Example(_twin_example(window_size=2, pooled=True), (32, 32),
                                 library="transformers", target="embedding",
                                 tags=("matrix",), suite=False),
        "hf_swin_pad": Example(_twin_example(window_size=3, img_size=(40, 40)), (40, 40),
                               library="transformers"),
    })
class HFSwinAdapter(HFSwinBase, TimmSwinAdapter):
    """Canonical view of a Hugging Face ``SwinForImageClassification`` or ``SwinModel``
    (an image embedding: its ``pooler_output``), the second reader of the same canonical
    form as :class:`TimmSwinAdapter`: separate ``q_proj``/``k_proj``/``v_proj``, the
    grid padded before the cyclic shift (Hugging Face's order), the patch merge at the end
    of a stage, absolute position embeddings when configured. Inputs must have the
    configured ``image_size``.

    Raises:
        TypeError: a Swin V2 class, a ``SwinModel`` without pooling layer, or a layer of
            another kind.
    """

    backbone: ModelTree  # read by attribute names (captum_vit.adapters._typing)

    def __init__(self, model: ModelTree) -> None:  # noqa: D107 - documented on the class
        ViTAdapter.__init__(self)
        name = type(model).__name__
        if name in HF_SWIN_V2_CLASSES:
            raise TypeError(
                f"captum_vit cannot explain {name}: Swin V2's cosine attention with a learned "
                "logit scale, continuous position bias and post-norm blocks do not fit the "
                "pre-LN canonical block; use a Swin v1 (SwinForImageClassification)")
        self._adopt_hf(model, "swin")

    def _read_parts(self) -> None:
        m, cfg = self.model, self.model.config
        name = type(m).__name__
        parts: list[BlockParts] = []
        for where, layer, grid, merge in self._layers_and_merges():
            attn = layer.attention
            ws, shift = int(cfg.window_size), int(layer.shift_size)
            if min(grid) <= ws:  # the model's clamp (set_shift_and_window_size)
                ws, shift = min(grid), 0
            heads = int(attn.num_attention_heads)
            parts.append(BlockParts(
                norm1=_norm_parts(layer.layernorm_before, f"{where}.layernorm_before"),
                q_weight=attn.q_proj.weight, k_weight=attn.k_proj.weight,
                v_weight=attn.v_proj.weight, q_bias=attn.q_proj.bias,
                k_bias=attn.k_proj.bias, v_bias=attn.v_proj.bias, num_heads=heads,
                head_dim=int(attn.head_dim), scale=float(attn.scaling),
                q_norm=nn.Identity(), k_norm=nn.Identity(),
                proj_weight=attn.o_proj.weight, proj_bias=attn.o_proj.bias,
                norm2=_norm_parts(layer.layernorm_after, f"{where}.layernorm_after"),
                ls1=None, fc1_weight=layer.mlp.fc1.weight, fc1_bias=layer.mlp.fc1.bias,
                act=layer.mlp.activation_fn, fc2_weight=layer.mlp.fc2.weight,
                fc2_bias=layer.mlp.fc2.bias, ls2=None,
                attn_bias=attn.relative_position_bias,
                window=Windows(grid=grid, size=(ws, ws), shift=(shift, shift),
                               pad_first=True),
                merge=merge))
        if not parts:
            raise TypeError(f"{name} has no Swin layers")
        self.blocks = parts
        self._read_hf_head("swin")

    def refresh(self) -> None:
        first = self.backbone.encoder.layers[0].blocks[0].attention.q_proj.weight
        if self.blocks[0].q_weight is not first:  # a parameter was replaced
            self._read_parts()
