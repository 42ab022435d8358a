"""Hugging Face ViT / DeiT: the adapter's forward equals the model's, and a Hugging Face
model holding a timm model's weights gets exactly the timm model's maps from every method."""

from __future__ import annotations

import pytest
import torch
from timm.models.deit import VisionTransformerDistilled
from timm.models.vision_transformer import VisionTransformer

from captum_vit import GAE, DecompX
from captum_vit.adapters import HFViTAdapter, adapt
from captum_vit.registry import available_methods, build_method
from tests.helpers import (
    assert_close_scaled,
    assert_unchanged,
    make_hf_model,
    make_inputs,
    needs_transformers,
    randomize_,
    snapshot,
)

pytestmark = [needs_transformers, pytest.mark.lower_bounds]
KW = dict(img_size=32, patch_size=8, in_chans=3, embed_dim=32, depth=3, num_heads=4,
          mlp_ratio=2.0, num_classes=5, qkv_bias=True)


def hf_twin(timm_model: torch.nn.Module, distilled: bool = False) -> torch.nn.Module:
    """A Hugging Face ViT (or DeiT with teacher) holding ``timm_model``'s weights."""
    import transformers

    cfg_cls = transformers.DeiTConfig if distilled else transformers.ViTConfig
    cfg = cfg_cls(image_size=32, patch_size=8, num_channels=3, hidden_size=32,
                  num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
                  num_labels=5, layer_norm_eps=1e-6)
    cls = (transformers.DeiTForImageClassificationWithTeacher if distilled
           else transformers.ViTForImageClassification)
    hf = cls(cfg).to(torch.float64).eval()
    ad, t = adapt(hf), timm_model
    bb = ad.backbone
    with torch.no_grad():
        emb = bb.embeddings
        emb.patch_embeddings.projection.weight.copy_(t.patch_embed.proj.weight)
        emb.patch_embeddings.projection.bias.copy_(t.patch_embed.proj.bias)
        emb.cls_token.copy_(t.cls_token)
        emb.position_embeddings.copy_(t.pos_embed)
        if distilled:
            emb.distillation_token.copy_(t.dist_token)
        for p, blk in zip(ad.blocks, t.blocks, strict=True):
            a = p.inner_dim
            w, b = blk.attn.qkv.weight, blk.attn.qkv.bias
            for i, (hw, hb) in enumerate(((p.q_weight, p.q_bias), (p.k_weight, p.k_bias),
                                          (p.v_weight, p.v_bias))):
                hw.copy_(w[i * a:(i + 1) * a])
                hb.copy_(b[i * a:(i + 1) * a])
            for dst, src in ((p.proj_weight, blk.attn.proj.weight),
                             (p.proj_bias, blk.attn.proj.bias),
                             (p.norm1.weight, blk.norm1.weight), (p.norm1.bias, blk.norm1.bias),
                             (p.norm2.weight, blk.norm2.weight), (p.norm2.bias, blk.norm2.bias),
                             (p.fc1_weight, blk.mlp.fc1.weight), (p.fc1_bias, blk.mlp.fc1.bias),
                             (p.fc2_weight, blk.mlp.fc2.weight), (p.fc2_bias, blk.mlp.fc2.bias)):
                dst.copy_(src)
        bb.layernorm.weight.copy_(t.norm.weight)
        bb.layernorm.bias.copy_(t.norm.bias)
        heads = ((hf.cls_classifier, t.head), (hf.distillation_classifier, t.head_dist)) \
            if distilled else ((hf.classifier, t.head),)
        for dst, src in heads:
            dst.weight.copy_(src.weight)
            dst.bias.copy_(src.bias)
    return hf


@pytest.mark.parametrize("distilled", [False, True])
@pytest.mark.long
def test_hf_twin_of_a_timm_model_gets_identical_maps_from_every_method(distilled):
    torch.manual_seed(0)
    timm_model = (VisionTransformerDistilled if distilled else VisionTransformer)(**KW)
    timm_model = randomize_(timm_model, 0).double().eval()
    hf = hf_twin(timm_model, distilled)
    x = make_inputs("vit", batch=2)
    assert_close_scaled(adapt(hf).model_logits(x), timm_model(x))
    kw = {"tis": {"n_masks": 16}}
    for name in available_methods(compositions=True):
        ours = build_method(name, hf).attribute(x, target=[1, 3], output="tokens",
                                                **kw.get(name, {}))
        ref = build_method(name, timm_model).attribute(x, target=[1, 3], output="tokens",
                                                       **kw.get(name, {}))
        scale = ref.abs().max().item()
        assert (ours - ref).abs().max().item() <= 1e-10 * max(scale, 1.0), name


@pytest.mark.parametrize("family", ["hf_vit", "hf_deit_teacher"])
def test_adapter_forward_equals_the_models_own_at_two_sizes(family):
    model = make_hf_model(family)
    assert model.config._attn_implementation == "sdpa"  # fused attention stays on
    ad = adapt(model)
    assert isinstance(ad, HFViTAdapter)
    before = snapshot(model)
    for size in ((32, 32), (24, 40)):  # native, then the model's own interpolation
        x = torch.randn(2, 3, *size, dtype=torch.float64)
        ref = model(pixel_values=x, interpolate_pos_encoding=size != (32, 32)).logits
        assert_close_scaled(ad.run(ad.embed(x)), ref)
        assert ad.layout(x).grid == (size[0] // 8, size[1] // 8)
    assert_unchanged(model, before)


def test_adapter_answers_and_refuses():
    model = make_hf_model("hf_deit_teacher")
    ad = adapt(model)
    assert (ad.num_prefix, ad.readout, ad.num_classes) == (2, "distilled", 5)
    assert ad.input_shape == (3, (32, 32))
    every = {id(p) for stage in ad.parameter_stages() for p in stage}
    emb = {id(p) for p in ad.backbone.embeddings.parameters()}
    assert every | emb == {id(p) for p in model.parameters()} and not every & emb
    x = torch.randn(1, 3, 30, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match="not divisible by the patch size"):
        GAE(model).attribute(x)
    model.train()
    model.config.hidden_dropout_prob = 0.1
    with pytest.raises(ValueError, match=r"model\.eval\(\)"):
        GAE(model).attribute(torch.randn(1, 3, 32, 32, dtype=torch.float64))
    headless = make_hf_model("hf_vit", num_classes=0)
    with pytest.raises(TypeError, match="linear classifier head"):
        adapt(headless)


def test_hf_model_spec_loads_a_local_folder_and_never_downloads(tmp_path, monkeypatch):
    import transformers

    from captum_vit.models import load_model

    model = make_hf_model("hf_vit", dtype=torch.float32)
    model.config.id2label = {i: f"class{i}" for i in range(5)}
    model.config.label2id = {f"class{i}": i for i in range(5)}
    model.save_pretrained(tmp_path / "vit")
    transformers.ViTImageProcessor(image_mean=[0.1, 0.2, 0.3], image_std=[0.5, 0.5, 0.5],
                                   size={"height": 32, "width": 32}).save_pretrained(
        tmp_path / "vit")
    lm = load_model(f"hf:{tmp_path / 'vit'}")
    assert isinstance(lm.model, transformers.ViTForImageClassification)
    assert not lm.model.training and lm.class_names == tuple(f"class{i}" for i in range(5))
    assert lm.preprocess.mean == (0.1, 0.2, 0.3) and lm.input_shape == (3, (32, 32))
    x = lm.preprocess(torch.rand(3, 50, 40))[None]
    torch.testing.assert_close(GAE(lm.model).attribute(x, output="tokens"),
                               GAE(model).attribute(x, output="tokens"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        load_model("hf:no-such-org/no-such-model")


def test_explain_command_on_a_local_hf_model(tmp_path):
    from captum_vit.cli import main

    make_hf_model("hf_vit", dtype=torch.float32).save_pretrained(tmp_path / "vit")
    out = tmp_path / "out" / "explain.png"
    assert main(["explain", "--model", f"hf:{tmp_path / 'vit'}", "--methods", "gae,decompx",
                 "--out", str(out)]) == 0
    assert out.stat().st_size > 0


@pytest.mark.parametrize("family", ["hf_dinov2", "hf_dinov2_reg"])
def test_dinov2_cls_mean_readout_and_layerscale(family):
    """DINOv2's classifier on [CLS ; mean of the patches] (registers excluded) is split into
    two summed heads; attention maps read w = 1/2 e_0 + 1/2 u_P (SPEC_NEXT §7.4)."""
    model = make_hf_model(family)
    ad = adapt(model)
    k = 3 if family == "hf_dinov2_reg" else 1
    assert (ad.num_prefix, ad.readout, ad.head.combine) == (k, "cls_mean", "sum")
    assert ad.blocks[0].ls1 is not None  # layer_scale1.lambda1
    h, w = make_inputs(family)[0].shape[-2:]
    for size in ((32, 32), (h, w)):  # DINOv2 always interpolates its position embeddings
        x = torch.randn(2, 3, *size, dtype=torch.float64)
        assert_close_scaled(ad.run(ad.embed(x)), model(pixel_values=x).logits)
    lay = ad.layout(x)
    r = lay.readout_weights(dtype=torch.float64)
    assert r[0] == 0.5 and r[1:k].abs().sum() == 0
    torch.testing.assert_close(r[k:], torch.full((lay.num_patches,), 0.5 / lay.num_patches,
                                                 dtype=torch.float64))
    res = DecompX(model, route="explicit").decompose(x, [1, 2])
    torch.testing.assert_close(res.tokens.sum(-1) + res.bias, res.logit, rtol=0, atol=1e-10)
    torch.testing.assert_close(DecompX(model).decompose(x, [1, 2]).tokens, res.tokens,
                               rtol=0, atol=1e-10)


def test_dinov2_swiglu_gated_rule():
    """transformers 5's gated MLP (gate_proj, up_proj, down_proj): forward parity, the
    explicit DecompX is complete and equals the gradient route (gate detached)."""
    import transformers

    if not hasattr(transformers.models.dinov2.modeling_dinov2.Dinov2SwiGLUFFN(
            transformers.Dinov2Config(hidden_size=8)), "gate_proj"):
        pytest.skip("transformers 4 packs the SwiGLU weights (refused with a clear error)")
    model = make_hf_model("hf_dinov2_swiglu")
    ad = adapt(model)
    assert ad.blocks[0].gate_weight is not None
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    assert_close_scaled(ad.run(ad.embed(x)), model(pixel_values=x).logits)
    exp = DecompX(model, route="explicit").decompose(x, [0, 3])
    torch.testing.assert_close(exp.tokens.sum(-1) + exp.bias, exp.logit, rtol=0, atol=1e-10)
    torch.testing.assert_close(DecompX(model).decompose(x, [0, 3]).tokens, exp.tokens,
                               rtol=0, atol=1e-10)


def test_an_adapter_follows_the_model_through_to():
    """``model.to(dtype)`` replaces the storage the DINOv2 head halves were sliced from."""
    model = make_hf_model("hf_dinov2", dtype=torch.float32)
    method = GAE(model)
    x = torch.randn(2, 3, 32, 32)
    before = method.attribute(x, target=[0, 1], output="tokens")
    model.double()
    after = method.attribute(x.double(), target=[0, 1], output="tokens")
    assert after.dtype == torch.float64
    torch.testing.assert_close(after.float(), before, rtol=1e-4, atol=1e-5)


def _logit_alpha(model, x: torch.Tensor, target: torch.Tensor, k: int) -> torch.Tensor:
    """``α = |W¹_c·h_0| / (|W¹_c·h_0| + |W²_c·mean h|)`` from the model's own final hidden
    states (SPEC_NEXT §7.4), per image, for class ``target``."""
    backbone = getattr(model, "dinov2", None) or model.dinov2_with_registers
    h = backbone(pixel_values=x).last_hidden_state  # after the final LayerNorm
    w, d = model.classifier.weight, h.shape[-1]
    cls = (h[:, 0] @ w[:, :d].T).abs()
    mean = (h[:, k:].mean(1) @ w[:, d:].T).abs()
    return (cls / (cls + mean)).gather(1, target[:, None]).squeeze(1).detach()


@pytest.mark.parametrize("family", ["hf_dinov2", "hf_dinov2_reg"])
@pytest.mark.parametrize("name", ["raw_attention", "rollout", "gae", "tokentm"])
def test_dinov2_logit_alpha_readout(family, name):
    """``readout_alpha(model, "logit")``: every map that is linear in the readout row
    equals ``α·map(α=1) + (1 − α)·map(α=0)`` with ``α`` of the explained class computed
    from the model's own hidden states; numeric α gives the same mixture."""
    from captum_vit.adapters import readout_alpha

    model = make_hf_model(family)
    k = adapt(model).num_prefix
    x = make_inputs(family, batch=3)
    t = torch.tensor([0, 3, 1])
    method = build_method(name, model)

    def maps(alpha, target=t):
        with readout_alpha(model, alpha):
            return method.attribute(x, target=target, output="tokens")

    a = _logit_alpha(model, x, t, k)
    assert ((a > 0.02) & (a < 0.98)).all()  # a real mixture, not an end point
    cls_only, mean_only = maps(1.0), maps(0.0)
    torch.testing.assert_close(maps("logit"), a[:, None] * cls_only + (1 - a[:, None])
                               * mean_only, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(maps(0.3), 0.3 * cls_only + 0.7 * mean_only, rtol=1e-10,
                               atol=1e-12)
    torch.testing.assert_close(maps(0.5), method.attribute(x, target=t, output="tokens"))
    other = torch.tensor([2, 2, 2])  # α depends on the explained class
    a2 = _logit_alpha(model, x, other, k)
    assert not torch.allclose(a, a2)
    torch.testing.assert_close(maps("logit", other), a2[:, None] * maps(1.0, other)
                               + (1 - a2[:, None]) * maps(0.0, other), rtol=1e-10, atol=1e-12)
    predicted = _logit_alpha(model, x, model(pixel_values=x).logits.argmax(-1), k)
    torch.testing.assert_close(maps("logit", None), predicted[:, None] * maps(1.0, None)
                               + (1 - predicted[:, None]) * maps(0.0, None), rtol=1e-10,
                               atol=1e-12)


def test_readout_alpha_errors_and_scope():
    from captum_vit.adapters import readout_alpha

    model = make_hf_model("hf_dinov2")
    with pytest.raises(ValueError, match="CLS ; mean"):
        with readout_alpha(make_hf_model("hf_vit"), "logit"):
            pass
    for bad in (1.5, -0.1, "cls", True):
        with pytest.raises(ValueError, match="alpha"):
            with readout_alpha(model, bad):
                pass
    ad = adapt(model)
    with readout_alpha(model, "logit"):
        assert ad.cls_alpha == "logit" and adapt(model).layout(make_inputs("hf_dinov2")
                                                               ).alpha == "logit"
        with pytest.raises(ValueError, match="readout_rows"):
            ad.layout(make_inputs("hf_dinov2")).readout_weights()
    assert ad.cls_alpha == 0.5
