"""Adapter for timm's ``VisionTransformer`` family (ViT, DeiT, distilled DeiT, registers,
avg-pool, attention-pool heads, LayerScale, qk-norm, dynamic image size).

The reading of timm's modules is :class:`~captum_vit.adapters.families._timm.TimmViTBase`
(shared with BEiT and Eva); this file declares the family: its predicate, its catalogue
entry and its example models.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from captum_vit.adapters.catalog import Example, register_family
from captum_vit.adapters.families._examples import timm_builder
from captum_vit.adapters.families._timm import TimmViTBase
from captum_vit.adapters.families._torch import is_loaded_instance

_VIT = ("timm.models.vision_transformer", "VisionTransformer")
_SQUARE = (32, 32)


def is_timm_vit(model: nn.Module) -> bool:
    """``True`` for timm's ``VisionTransformer`` and its subclasses (DeiT distilled)."""
    return is_loaded_instance(model, *_VIT)


def _vit(size: tuple[int, int] = _SQUARE, **extra: Any) -> Example:
    """A timm ``VisionTransformer`` example read by the per-method references."""
    return Example(timm_builder(*_VIT, size, **extra), size, tags=("reference",))


@register_family(
    is_timm_vit,
    supports="timm VisionTransformer family (ViT, DeiT, distilled DeiT, register tokens, "
             "global_pool='token'/'avg'/'map', LayerScale, qk-norm, dynamic_img_size; not the "
             "hybrid CNN-stem ViTs)",
    tags=("classifier", "embedding", "variable-size"),
    notes=("Token or avg pooling, registers, LayerScale, qk-norm, dynamic size: ✅ (with "
           "`num_classes=0` the model outputs its pooled embedding and takes vector targets, as "
           "do `Eva` and `Beit`). Attention-pool heads (`global_pool='map'`, SigLIP-style, with "
           "or without class/register tokens; read as `PoolParts`): ✅ attention maps read the "
           "pool's attention over the tokens (`mean_h A_p[0, :]`; gradient-weighted methods "
           "`mean_h ReLU(∇A_p ⊙ A_p)[0, :]`, no identity); `RawAttention` returns it "
           "(`source=\"last_block\"`: times the last block's attention); AttnGradCAM runs on "
           "`A_p`; TokenTM uses the pool's transformation weights; DecompX propagates through "
           "the pool (complete); token removal pools over the kept tokens. Hybrid ViTs "
           "(`vision_transformer_hybrid`, e.g. `vit_small_r26_s32_224`; ViTamin; `HybridEmbed` "
           "with a CNN (ResNet) stem): refused with a `TypeError` naming `HybridEmbed` and the "
           "stem: the tokens are the CNN's feature map, not pixel patches; use a plain ViT, or "
           "Captum's `LayerGradCam(model, model.patch_embed.backbone)`"),
    examples={
        "vit": _vit(),
        "distilled": Example(timm_builder("timm.models.deit", "VisionTransformerDistilled",
                                          _SQUARE), _SQUARE, tags=("reference",)),
        "registers": _vit(reg_tokens=2),
        "avgpool": _vit(class_token=False, global_pool="avg"),
        "layerscale": _vit(init_values=0.5, qk_norm=True, no_embed_class=True),
        "nonsquare": _vit((24, 40), dynamic_img_size=True),
        # attention-pool heads (global_pool='map', SigLIP-style; SPEC_NEXT §7.3)
        "map": Example(timm_builder(*_VIT, _SQUARE, class_token=False, global_pool="map"),
                       _SQUARE),
        "map_cls_reg": Example(timm_builder(*_VIT, _SQUARE, global_pool="map", reg_tokens=2),
                               _SQUARE),
        # num_classes=0: the pooled embedding, vector targets (SPEC_NEXT §7.5)
        "vit_headless": Example(timm_builder(*_VIT, _SQUARE, num_classes=0, reg_tokens=1),
                                _SQUARE, target="embedding"),
    })
class TimmViTAdapter(TimmViTBase):
    """Canonical view of a timm ``VisionTransformer`` (or ``VisionTransformerDistilled``).

    The q/k/v parts of every block are views (row slices) of timm's fused ``qkv``
    parameter; they are re-read when the model's parameters are replaced (``model.to``).
    """
