"""What a newcomer tries first: a timm hybrid ViT (refused by name), a processor's
``BatchFeature`` as inputs, and Hugging Face CLIP / SigLIP image classifiers."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn

from captum_vit.adapters import adapt


def _tiny_hybrid() -> nn.Module:
    """A random timm hybrid ViT: a two-conv CNN stem (stride 4) under ``HybridEmbed``,
    built from timm's classes as ``vision_transformer_hybrid`` does."""
    from timm.layers import HybridEmbed
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    stem = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(),
                         nn.Conv2d(8, 16, 3, stride=2, padding=1))
    return VisionTransformer(img_size=32, patch_size=1, embed_dim=24, depth=1, num_heads=2,
                             num_classes=5,
                             embed_layer=partial(HybridEmbed, backbone=stem)).eval()


def test_timm_hybrid_vit_is_refused_by_name_with_the_alternatives():
    model = _tiny_hybrid()
    with pytest.raises(TypeError) as err:
        adapt(model)
    msg = str(err.value)
    for part in ("HybridEmbed", "CNN stem", "Sequential", "plain ViT", "LayerGradCam",
                 "model.patch_embed.backbone"):
        assert part in msg, part
    assert "channels" not in msg  # not the misleading channel-count complaint


def test_the_suggested_layer_gradcam_runs_on_the_hybrid():
    from captum.attr import LayerGradCam

    model = _tiny_hybrid()
    maps = LayerGradCam(model, model.patch_embed.backbone).attribute(
        torch.randn(2, 3, 32, 32), target=1)
    assert maps.shape == (2, 1, 8, 8)
