"""Adapter for Hugging Face transformers' ViT, DeiT and DINOv2 image classifiers
(``ViTForImageClassification``, ``DeiTForImageClassification``,
``DeiTForImageClassificationWithTeacher``, ``Dinov2ForImageClassification``,
``Dinov2WithRegistersForImageClassification``).

The reading of their modules is :class:`~captum_vit.adapters.families._hf.HFViTBase`
(shared with BEiT, the head-less backbones and CLIP/SigLIP); this file declares the family.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from captum_vit.adapters.catalog import Example, register_family
from captum_vit.adapters.families._examples import hf_builder
from captum_vit.adapters.families._hf import HFViTBase, is_transformers_model

CLASSES = ("ViTForImageClassification", "DeiTForImageClassification",
           "DeiTForImageClassificationWithTeacher", "Dinov2ForImageClassification",
           "Dinov2WithRegistersForImageClassification")


def is_hf_vit(model: nn.Module) -> bool:
    """``True`` for the Hugging Face classifiers in :data:`CLASSES` (transformers optional)."""
    return is_transformers_model(model, CLASSES)


def _hf(cls_name: str, cfg_name: str, size: tuple[int, int] = (32, 32),
        **extra: Any) -> Example:
    return Example(hf_builder(cls_name, cfg_name, **extra), size, library="transformers")


@register_family(
    is_hf_vit,
    supports="Hugging Face transformers ViTForImageClassification, "
             "DeiTForImageClassification(WithTeacher), "
             "Dinov2(WithRegisters)ForImageClassification",
    tags=("classifier", "variable-size"),
    notes=("`ViTForImageClassification`, `DeiTForImageClassification`, "
           "`DeiTForImageClassificationWithTeacher`: ✅ (maps equal a timm twin's to 1e-10). "
           "`Dinov2ForImageClassification`, `Dinov2WithRegistersForImageClassification` (GELU "
           "MLP, or SwiGLU with transformers ≥ 5): ✅ (the classifier's `[CLS ; patch mean]` is "
           "followed exactly by DecompX/IxG; attention maps read `α CLS + (1 − α) patch mean`: "
           "`α = ½` by default (the CLS-plus-patch-mean readout of BT and txv for DINO), any `α` "
           "or `\"logit\"` — the CLS share of the explained logit, per image — inside "
           "`captum_vit.adapters.readout_alpha(model, alpha)`)"),
    examples={
        "hf_vit": _hf("ViTForImageClassification", "ViTConfig"),
        # a non-native size: the model's own interpolation of the position embeddings
        "hf_deit_teacher": _hf("DeiTForImageClassificationWithTeacher", "DeiTConfig",
                               (24, 40)),
        "hf_dinov2": _hf("Dinov2ForImageClassification", "Dinov2Config",
                         layerscale_value=0.5),
        "hf_dinov2_reg": _hf("Dinov2WithRegistersForImageClassification",
                             "Dinov2WithRegistersConfig", (24, 40), num_register_tokens=2),
        "hf_dinov2_swiglu": _hf("Dinov2ForImageClassification", "Dinov2Config",
                                use_swiglu_ffn=True),
    })
class HFViTAdapter(HFViTBase):
    """Canonical view of a Hugging Face ViT / DeiT / DINOv2 image classifier (never
    modified)."""
