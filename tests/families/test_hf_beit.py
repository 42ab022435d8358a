"""Hugging Face BEiT and data2vec-vision classifiers: the adapter's forward equals the
model's own (each layer's relative position bias, a shared one, both; LayerScale or none;
patch mean + pooler norm or CLS), other sizes are refused, and a timm ``Beit`` holding a
Hugging Face BEiT's weights gets exactly its maps from every registered method."""

from __future__ import annotations

import pytest
import torch
from timm.models.beit import Beit
from torch import nn

from captum_vit import GAE
from captum_vit.adapters import HFBeitAdapter, Ops, adapt
from captum_vit.registry import available_methods, build_method
from tests.contract.test_contract import FAST
from tests.helpers import (
    assert_close_scaled,
    assert_unchanged,
    make_inputs,
    make_model,
    needs_transformers,
    randomize_,
    snapshot,
)

pytestmark = needs_transformers
METHODS = available_methods(compositions=True)

# config overrides beyond tests.helpers' families: data2vec with its own and a shared
# bias and LayerScale; BEiT with a shared bias and no LayerScale
EXTRA = {
    "data2vec_both_avg": ("Data2VecVisionForImageClassification", "Data2VecVisionConfig",
                          {"use_relative_position_bias": True,
                           "use_shared_relative_position_bias": True,
                           "use_mean_pooling": True, "layer_scale_init_value": 0.5}),
    "beit_shared_token": ("BeitForImageClassification", "BeitConfig",
                          {"use_shared_relative_position_bias": True,
                           "use_mean_pooling": False, "layer_scale_init_value": 0.0}),
}


def extra_model(name: str, depth: int = 3) -> nn.Module:
    import transformers

    cls, cfg_name, extra = EXTRA[name]
    cfg = getattr(transformers, cfg_name)(
        image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=depth,
        num_attention_heads=4, intermediate_size=64, num_labels=5, layer_norm_eps=1e-6,
        **extra)
    torch.manual_seed(0)
    return randomize_(getattr(transformers, cls)(cfg), 0).to(torch.float64).eval()


MODELS = ["hf_beit", "hf_data2vec", *EXTRA]


def model_of(name: str) -> nn.Module:
    return make_model(name) if name.startswith("hf_") else extra_model(name)


@pytest.mark.parametrize("name", MODELS)
def test_adapter_forward_equals_the_models_own(name):
    model = model_of(name)
    ad = adapt(model)
    assert isinstance(ad, HFBeitAdapter)
    assert all(b.attn_bias is not None for b in ad.blocks)
    before = snapshot(model)
    x = make_inputs("hf_beit", batch=3)
    want = model(pixel_values=x).logits
    scale = want.abs().max().item()
    assert_close_scaled(ad.run(ad.embed(x)), want, rel=1e-12, scale=scale)
    assert_close_scaled(ad.run(ad.embed(x, Ops())), want, rel=1e-12, scale=scale)
    ad.self_check(x)
    lay = ad.layout(x)
    pooled = name in ("hf_beit", "data2vec_both_avg")
    assert (lay.grid, lay.patch_size, lay.num_prefix, lay.readout) == (
        (4, 4), (8, 8), 1, "avg" if pooled else "token")
    # the bias matters: without it the logits differ
    with torch.no_grad():
        tables = [p for n, p in model.named_parameters() if "relative_position_bias" in n]
        saved = [t.clone() for t in tables]
        for t in tables:
            t.zero_()
        assert not torch.allclose(model(pixel_values=x).logits, want)
        for t, s in zip(tables, saved, strict=True):
            t.copy_(s)
    assert_unchanged(model, before)


def test_other_sizes_and_no_classifier_are_refused():
    import transformers

    model = make_model("hf_beit")
    with pytest.raises(ValueError, match="image_size.*resize"):
        GAE(model).attribute(torch.randn(1, 3, 40, 32, dtype=torch.float64))
    cfg = transformers.BeitConfig(image_size=32, patch_size=8, hidden_size=32,
                                  num_hidden_layers=1, num_attention_heads=4,
                                  intermediate_size=64, num_labels=0)
    with pytest.raises(TypeError, match="num_labels > 0"):
        adapt(transformers.BeitForImageClassification(cfg))


def timm_twin(hf: nn.Module) -> nn.Module:
    """A timm ``Beit`` of the same shape holding the Hugging Face BEiT's weights (each
    layer's bias, LayerScale, patch mean + fc_norm)."""
    t = Beit(img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=4, mlp_ratio=2.0,
             num_classes=5, use_abs_pos_emb=False, use_rel_pos_bias=True, init_values=0.5,
             global_pool="avg").to(torch.float64).eval()
    assert all(m.eps == 1e-6 for m in t.modules() if isinstance(m, nn.LayerNorm))
    bb = hf.beit
    emb = bb.embeddings
    pairs = [(t.cls_token, emb.cls_token),
             (t.patch_embed.proj.weight, emb.patch_embeddings.projection.weight),
             (t.patch_embed.proj.bias, emb.patch_embeddings.projection.bias),
             (t.fc_norm.weight, bb.pooler.layernorm.weight),
             (t.fc_norm.bias, bb.pooler.layernorm.bias),
             (t.head.weight, hf.classifier.weight), (t.head.bias, hf.classifier.bias)]
    for blk, layer in zip(t.blocks, bb.layers, strict=True):
        att = layer.attention
        pairs += [
            (blk.norm1.weight, layer.layernorm_before.weight),
            (blk.norm1.bias, layer.layernorm_before.bias),
            (blk.attn.qkv.weight, torch.cat([att.q_proj.weight, att.k_proj.weight,
                                             att.v_proj.weight])),
            (blk.attn.q_bias, att.q_proj.bias), (blk.attn.v_bias, att.v_proj.bias),
            (blk.attn.relative_position_bias_table,
             layer.relative_position_bias.relative_position_bias_table),
            (blk.attn.proj.weight, att.o_proj.weight), (blk.attn.proj.bias, att.o_proj.bias),
            (blk.norm2.weight, layer.layernorm_after.weight),
            (blk.norm2.bias, layer.layernorm_after.bias),
            (blk.mlp.fc1.weight, layer.mlp.fc1.weight), (blk.mlp.fc1.bias, layer.mlp.fc1.bias),
            (blk.mlp.fc2.weight, layer.mlp.fc2.weight), (blk.mlp.fc2.bias, layer.mlp.fc2.bias),
            (blk.gamma_1, layer.lambda_1), (blk.gamma_2, layer.lambda_2)]
    with torch.no_grad():
        for dst, src in pairs:
            assert dst.shape == src.shape
            dst.copy_(src)
    return t


_TWINS: dict[str, tuple[nn.Module, nn.Module]] = {}


def twins() -> tuple[nn.Module, nn.Module]:
    if "beit" not in _TWINS:
        hf = make_model("hf_beit")
        _TWINS["beit"] = (hf, timm_twin(hf))
    return _TWINS["beit"]


def test_timm_twin_has_the_same_logits():
    hf, twin = twins()
    x = make_inputs("hf_beit", batch=2)
    assert_close_scaled(twin(x), hf(pixel_values=x).logits, rel=1e-12)


@pytest.mark.parametrize("name", METHODS)
def test_timm_twin_of_a_hf_beit_gets_identical_maps(name):
    """Every registered method (compositions included) gives the Hugging Face BEiT the
    maps of its timm twin (float64, <= 1e-10 of each map's largest magnitude), and leaves
    the model unchanged."""
    hf, twin = twins()
    x = make_inputs("hf_beit", batch=2)
    before = snapshot(hf)
    kw = FAST.get(name, {})
    ours = build_method(name, hf).attribute(x, target=[1, 3], output="tokens", **kw)
    ref = build_method(name, twin).attribute(x, target=[1, 3], output="tokens", **kw)
    assert ours.shape == ref.shape == (2, 16)
    assert_close_scaled(ours, ref, rel=1e-10, msg=name)
    assert_unchanged(hf, before)
