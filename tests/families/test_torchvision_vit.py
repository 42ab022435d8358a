"""torchvision ``VisionTransformer``: the adapter's forward equals the model's own (also on
``nn.MultiheadAttention``'s fused inference path), the ``representation_size`` head
(``pre_logits`` + Tanh) is kept, and a timm ``VisionTransformer`` holding a torchvision
model's weights gets exactly the torchvision model's maps from every method."""

from __future__ import annotations

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer as TimmViT
from torch import nn

from captum_vit import GAE, DecompX
from captum_vit.adapters import PreLogitsHeadParts, TorchvisionViTAdapter, adapt
from captum_vit.registry import available_methods, build_method
from tests.contract.test_contract import FAST
from tests.helpers import (
    assert_close_scaled,
    assert_unchanged,
    make_inputs,
    make_torchvision_model,
    needs_torchvision,
    snapshot,
)

pytestmark = [needs_torchvision, pytest.mark.lower_bounds]
METHODS = available_methods(compositions=True)
_MODELS: dict[object, nn.Module] = {}


def tv_model(representation_size: int | None = None) -> nn.Module:
    """One small random torchvision ViT per head kind for the module (calls never change
    it; the tests check that)."""
    if representation_size not in _MODELS:
        _MODELS[representation_size] = make_torchvision_model(
            representation_size=representation_size)
    return _MODELS[representation_size]


def timm_twin(tv: nn.Module) -> nn.Module:
    """A timm ``VisionTransformer`` of the same shape holding ``tv``'s weights."""
    timm_model = TimmViT(img_size=32, patch_size=8, in_chans=3, embed_dim=16, depth=3,
                         num_heads=2, mlp_ratio=2.0, num_classes=5, qkv_bias=True)
    timm_model = timm_model.to(torch.float64).eval()
    assert all(m.eps == 1e-6 for m in timm_model.modules() if isinstance(m, nn.LayerNorm))
    t = timm_model
    with torch.no_grad():
        pairs = [(t.patch_embed.proj.weight, tv.conv_proj.weight),
                 (t.patch_embed.proj.bias, tv.conv_proj.bias),
                 (t.cls_token, tv.class_token), (t.pos_embed, tv.encoder.pos_embedding),
                 (t.norm.weight, tv.encoder.ln.weight), (t.norm.bias, tv.encoder.ln.bias),
                 (t.head.weight, tv.heads.head.weight), (t.head.bias, tv.heads.head.bias)]
        for blk, layer in zip(t.blocks, tv.encoder.layers, strict=True):
            attn, mlp = layer.self_attention, layer.mlp
            pairs += [(blk.norm1.weight, layer.ln_1.weight), (blk.norm1.bias, layer.ln_1.bias),
                      (blk.attn.qkv.weight, attn.in_proj_weight),
                      (blk.attn.qkv.bias, attn.in_proj_bias),
                      (blk.attn.proj.weight, attn.out_proj.weight),
                      (blk.attn.proj.bias, attn.out_proj.bias),
                      (blk.norm2.weight, layer.ln_2.weight), (blk.norm2.bias, layer.ln_2.bias),
                      (blk.mlp.fc1.weight, mlp[0].weight), (blk.mlp.fc1.bias, mlp[0].bias),
                      (blk.mlp.fc2.weight, mlp[3].weight), (blk.mlp.fc2.bias, mlp[3].bias)]
        for dst, src in pairs:
            dst.copy_(src)
    return timm_model


@pytest.mark.parametrize("representation_size", [None, 7])
def test_adapter_forward_equals_the_models_own(representation_size, monkeypatch):
    model = tv_model(representation_size)
    fused = []
    native = torch._native_multi_head_attention

    def counted(*args, **kwargs):
        fused.append(1)
        return native(*args, **kwargs)

    monkeypatch.setattr(torch, "_native_multi_head_attention", counted)
    ad = adapt(model)
    assert isinstance(ad, TorchvisionViTAdapter)
    assert isinstance(ad.head, PreLogitsHeadParts)
    assert (ad.head.pre_logits is None) == (representation_size is None)
    before = snapshot(model)
    x = make_inputs("torchvision", batch=3)
    ours = ad.run(ad.embed(x))
    with torch.no_grad():  # eval + no grad: nn.MultiheadAttention may take its fused path
        fast = model(x)
    mha = getattr(torch.backends, "mha", None)  # torch >= 2.3 can switch the fast path off
    if mha is None or mha.get_fastpath_enabled():
        assert len(fused) == 3  # one fused call per block: the path really differs
    slow = model(x)  # with grad: the plain path
    assert len(fused) in (0, 3)
    scale = slow.abs().max().item()
    assert_close_scaled(ours, fast, rel=1e-12, scale=scale)
    assert_close_scaled(ours, slow, rel=1e-12, scale=scale)
    assert_close_scaled(ad.model_logits(x), slow, rel=1e-12, scale=scale)
    # the pixel-level route (ops: the patch convolution as a linear map) has the same values
    from captum_vit.adapters import Ops

    assert_close_scaled(ad.run(ad.embed(x, Ops())), slow, rel=1e-12, scale=scale)
    ad.self_check(x)
    lay = ad.layout(x)
    assert (lay.grid, lay.patch_size, lay.num_prefix, lay.readout) == ((4, 4), (8, 8), 1,
                                                                       "token")
    assert_unchanged(model, before)


def test_timm_twin_has_the_same_logits():
    tv = tv_model()
    twin = timm_twin(tv)
    x = make_inputs("torchvision", batch=2)
    assert_close_scaled(twin(x), tv(x), rel=1e-12)


@pytest.mark.parametrize("name", METHODS)
def test_timm_twin_of_a_torchvision_model_gets_identical_maps(name):
    """Every registered method (compositions included) gives the torchvision model the
    maps of the timm twin (float64, <= 1e-10 of each map's largest magnitude), and leaves
    the model unchanged."""
    tv = tv_model()
    twin = timm_twin(tv)
    x = make_inputs("torchvision", batch=2)
    before = snapshot(tv)
    kw = FAST.get(name, {})
    ours = build_method(name, tv).attribute(x, target=[1, 3], output="tokens", **kw)
    ref = build_method(name, twin).attribute(x, target=[1, 3], output="tokens", **kw)
    assert ours.shape == ref.shape == (2, 16)
    assert_close_scaled(ours, ref, rel=1e-10, msg=name)
    assert_unchanged(tv, before)


@pytest.mark.parametrize("name", METHODS)
def test_every_method_runs_on_the_representation_head(name):
    """``representation_size``: finite maps of the right shape, pixels included, and the
    model unchanged."""
    model = tv_model(7)
    x = make_inputs("torchvision", batch=2)
    before = snapshot(model)
    method = build_method(name, model)
    kw = FAST.get(name, {})
    tokens = method.attribute(x, target=[0, 4], output="tokens", **kw)
    assert tokens.shape == (2, 16) and torch.isfinite(tokens).all()
    pixels = method.attribute(x, target=[0, 4], **kw)
    assert pixels.shape == x.shape and torch.isfinite(pixels).all()
    assert_unchanged(model, before)


def test_decompx_is_complete_through_the_tanh_representation_layer():
    model = tv_model(7)
    x = make_inputs("torchvision", batch=2)
    exp = DecompX(model, route="explicit").decompose(x, [1, 2])
    torch.testing.assert_close(exp.tokens.sum(-1) + exp.bias, exp.logit, rtol=0, atol=1e-10)
    torch.testing.assert_close(DecompX(model).decompose(x, [1, 2]).tokens, exp.tokens,
                               rtol=0, atol=1e-10)


def test_adapter_answers_and_refuses():
    import torchvision

    model = tv_model(7)
    ad = adapt(model)
    assert adapt(model) is ad
    assert (ad.num_prefix, ad.readout, ad.num_classes, ad.num_blocks) == (1, "token", 5, 3)
    assert ad.input_shape == (3, (32, 32))
    every = [id(p) for stage in ad.parameter_stages() for p in stage]
    emb = {id(model.conv_proj.weight), id(model.conv_proj.bias), id(model.class_token),
           id(model.encoder.pos_embedding)}
    assert len(every) == len(set(every))
    assert set(every) | emb == {id(p) for p in model.parameters()} and not set(every) & emb
    q = ad.blocks[0].q_weight  # a view of the packed in-projection
    assert q.data_ptr() == model.encoder.layers[0].self_attention.in_proj_weight.data_ptr()

    with pytest.raises(ValueError, match="fixed image_size"):
        GAE(model).attribute(torch.randn(1, 3, 40, 40, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"torch\.float32.*torch\.float64"):
        GAE(model).attribute(torch.randn(1, 3, 32, 32))

    dropout = make_torchvision_model(dropout=0.1).train()
    with pytest.raises(ValueError, match=r"model\.eval\(\)"):
        GAE(dropout).attribute(make_inputs("torchvision", batch=1))
    attn_dropout = make_torchvision_model(attention_dropout=0.1).train()
    with pytest.raises(ValueError, match=r"model\.eval\(\)"):
        GAE(attn_dropout).attribute(make_inputs("torchvision", batch=1))

    stem = torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32,
        num_classes=5, conv_stem_configs=[
            torchvision.models.vision_transformer.ConvStemConfig(8, 3, 8)])
    with pytest.raises(TypeError, match="convolutional stem"):
        adapt(stem)
    with pytest.raises(TypeError, match="cannot explain a ResNet.*torchvision "
                                        "VisionTransformer"):
        adapt(torchvision.models.resnet18())
    with pytest.raises(TypeError, match=r"wraps a supported ViT at `model\[1\]`"):
        adapt(nn.Sequential(nn.Identity(), model))


def test_an_adapter_follows_the_model_through_to():
    """``model.to(dtype)`` replaces the in-projection the q/k/v views were sliced from."""
    model = make_torchvision_model(dtype=torch.float32)
    method = GAE(model)
    x = make_inputs("torchvision", batch=2, dtype=torch.float32)
    before = method.attribute(x, target=[0, 1], output="tokens")
    model.double()
    after = method.attribute(x.double(), target=[0, 1], output="tokens")
    assert after.dtype == torch.float64
    torch.testing.assert_close(after.float(), before, rtol=1e-4, atol=1e-5)
