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


# --- a processor's output as inputs -------------------------------------------------------

def _batch_feature(**data):
    """transformers' ``BatchFeature`` (a ``UserDict``), as an image processor returns it."""
    from transformers import BatchFeature

    return BatchFeature(data=data)


@pytest.mark.parametrize("method", ["GAE", "TokenTM"])
def test_a_batch_feature_is_explained_as_its_pixel_values(method):
    pytest.importorskip("transformers")
    import captum_vit
    from tests.helpers import make_inputs, make_model

    model = make_model("vit")
    x = make_inputs("vit", batch=2)
    explainer = getattr(captum_vit, method)(model)
    want = explainer.attribute(x, target=[1, 2])
    for inputs in (_batch_feature(pixel_values=x), {"pixel_values": x},
                   _batch_feature(pixel_values=x, pixel_mask=torch.ones(2, 32, 32)),
                   {"pixel_values": x, "labels": torch.tensor([1, 2])}):
        got = explainer.attribute(inputs, target=[1, 2])
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def test_a_batch_feature_is_accepted_by_the_metrics():
    pytest.importorskip("transformers")
    from captum_vit import GAE
    from captum_vit.metrics import deletion
    from tests.helpers import make_inputs, make_model

    model = make_model("vit")
    x = make_inputs("vit", batch=2)
    maps = GAE(model).attribute(x, target=[1, 2])
    want = deletion(model, x, maps, target=[1, 2], n_steps=4)
    got = deletion(model, _batch_feature(pixel_values=x), maps, target=[1, 2], n_steps=4)
    torch.testing.assert_close(got.per_example, want.per_example, rtol=1e-12, atol=0)


def test_a_pixel_mask_with_padding_is_refused():
    pytest.importorskip("transformers")
    from captum_vit import GAE
    from tests.helpers import make_inputs, make_model

    x = make_inputs("vit", batch=2)
    mask = torch.ones(2, 32, 32, dtype=torch.long)
    mask[1, :, 24:] = 0
    with pytest.raises(ValueError, match="pixel_mask.*padded.*pixel_values"):
        GAE(make_model("vit")).attribute(_batch_feature(pixel_values=x, pixel_mask=mask),
                                         target=[1, 2])


# --- CLIP / SigLIP image classifiers --------------------------------------------------------

@pytest.mark.parametrize("family", ["hf_clip_cls", "hf_siglip_cls"])
def test_clip_and_siglip_classifiers_keep_their_classifier(family):
    """The adapter's forward equals the model's logits (float64, <= 1e-12; CLIP's at a
    non-native size through the tower's interpolated positions), with the model's own
    pooling: CLIP's patch mean without any final norm, SigLIP's mean of every row after
    ``post_layernorm`` (its attention-pool head unused)."""
    pytest.importorskip("transformers")
    from captum_vit.adapters import HFCLIPClassifierAdapter, Ops
    from tests.helpers import (
        assert_close_scaled,
        assert_unchanged,
        make_inputs,
        make_model,
        snapshot,
    )

    model = make_model(family)
    before = snapshot(model)
    ad = adapt(model)
    assert isinstance(ad, HFCLIPClassifierAdapter) and not ad.embedding
    assert (ad.readout, ad.num_classes, ad.num_prefix) == ("avg", 5, int(family == "hf_clip_cls"))
    x = make_inputs(family, batch=3)
    size = tuple(x.shape[-2:])
    kw = {"interpolate_pos_encoding": True} if size != (32, 32) else {}
    want = model(pixel_values=x, **kw).logits
    scale = want.abs().max().item()
    assert_close_scaled(ad.run(ad.embed(x)), want, rel=1e-12, scale=scale)
    assert_close_scaled(ad.run(ad.embed(x, Ops())), want, rel=1e-12, scale=scale)
    ad.self_check(x)
    # the pooling, by hand from the tower's tokens
    tower = model.vision_model
    tokens = tower(pixel_values=x, **kw).last_hidden_state
    pooled = tokens[:, 1:].mean(1) if family == "hf_clip_cls" else tokens.mean(1)
    assert_close_scaled(model.classifier(pooled), want, rel=1e-12, scale=scale)
    assert_unchanged(model, before)


def test_a_clip_classifier_is_explained_with_class_targets():
    pytest.importorskip("transformers")
    from captum_vit import GAE
    from tests.helpers import make_inputs, make_model

    model = make_model("hf_siglip_cls")
    x = make_inputs("hf_siglip_cls", batch=2)
    maps = GAE(model).attribute(x, target=[0, 4], output="tokens")
    assert maps.shape == (2, 16) and torch.isfinite(maps).all()


def test_a_clip_classifier_without_labels_is_an_embedding_model():
    pytest.importorskip("transformers")
    import transformers

    from captum_vit import GAE

    vision = transformers.CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=32,
                                           num_hidden_layers=2, num_attention_heads=4,
                                           intermediate_size=64)
    model = transformers.CLIPForImageClassification(transformers.CLIPConfig(
        vision_config=vision.to_dict(), num_labels=0)).double().eval()
    ad = adapt(model)
    assert ad.embedding and ad.num_classes == 32
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    maps = GAE(model).attribute(x, target=torch.randn(32, dtype=torch.float64), output="tokens")
    assert maps.shape == (2, 16) and torch.isfinite(maps).all()
