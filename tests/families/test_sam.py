"""SAM's image encoder (Hugging Face ``SamModel`` / ``SamVisionModel``, timm
``VisionTransformerSAM``) and :class:`~captum_vit.targets.SamMaskTarget`: float64 forward
parity with the models' own forwards (windows padded on the grid, global blocks, decomposed
relative positions on and off), DecompX complete through the neck and a linear head, every
method on the encoder (the contract suite covers timm's classifier through
``tests.helpers``), and the mask target against the model's own masks."""

from __future__ import annotations

import pytest
import torch
from captum.attr import NoiseTunnel

from captum_vit import DecompX
from captum_vit.adapters import adapt
from captum_vit.registry import available_methods, build_method
from captum_vit.targets import EmbeddingTarget, SamMaskTarget
from tests.helpers import (
    WINDOW_REFUSERS,
    assert_close_scaled,
    assert_unchanged,
    make_inputs,
    make_model,
    needs_transformers,
    randomize_,
    snapshot,
)

VISION = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, image_size=32,
              patch_size=4, window_size=3, global_attn_indexes=[1], output_channels=16,
              mlp_dim=64, num_pos_feats=8)
"""An 8x8 grid: windows of 3 padded to 9x9, block 1 global."""
FAST = {"rise": {"n_masks": 8}, "bt_h": {"n_steps": 3}, "bt_t": {"n_steps": 3},
        "tam": {"n_steps": 3, "start_layer": 0}, "tis": {"n_masks": 8}}
# methods that refuse windowed attention by name (their message names the ones that run)
REFUSERS = set(WINDOW_REFUSERS)
METHODS = [m for m in available_methods(compositions=True) if m not in REFUSERS]


def _rel_pos(model: torch.nn.Module, seed: int = 5) -> torch.nn.Module:
    """Non-zero relative positions (the models initialise them to zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "rel_pos" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    return model


def hf_vision(**overrides) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    model = transformers.SamVisionModel(transformers.SamVisionConfig(**{**VISION, **overrides}))
    return _rel_pos(randomize_(model, 0).double().eval())


def hf_sam(**overrides) -> torch.nn.Module:
    """A tiny random ``SamModel``: the encoder above, 16-d prompt encoder and a 2-layer
    mask decoder (masks 32x32, four times the embedding grid)."""
    import transformers

    cfg = transformers.SamConfig(
        vision_config={**VISION, **overrides},
        prompt_encoder_config=dict(hidden_size=16, image_size=32, patch_size=4,
                                   mask_input_channels=4, num_point_embeddings=4),
        mask_decoder_config=dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                 mlp_dim=32, iou_head_hidden_dim=16, num_multimask_outputs=3))
    torch.manual_seed(0)
    return _rel_pos(randomize_(transformers.SamModel(cfg), 0).double().eval())


def timm_sam(**overrides) -> torch.nn.Module:
    from timm.models.vision_transformer_sam import VisionTransformerSAM

    kw = dict(img_size=32, patch_size=4, embed_dim=32, depth=3, num_heads=4, mlp_ratio=2.0,
              window_size=3, global_attn_indexes=(1,), use_rel_pos=True, neck_chans=16,
              num_classes=5)
    torch.manual_seed(0)
    return _rel_pos(randomize_(VisionTransformerSAM(**{**kw, **overrides}), 0).double().eval())


def images(batch: int = 2, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, 32, 32, generator=g, dtype=torch.float64)


POINTS = torch.tensor([[[10.0, 12.0]], [[20.0, 5.0]]], dtype=torch.float64)  # one per image


# -- forward parity -------------------------------------------------------------------------
@needs_transformers
@pytest.mark.parametrize("kw", [{}, {"use_rel_pos": False}, {"use_abs_pos": False},
                                {"window_size": 4, "global_attn_indexes": []},
                                {"global_attn_indexes": [0, 2]}])
def test_hf_encoder_forward_equals_the_model(kw):
    """The canonical forward (windows padded on the 8x8 grid, global blocks, decomposed
    relative positions, the neck) equals the encoder's own output's grid mean, and every
    block output its hidden states."""
    model = hf_vision(**kw)
    x = images()
    ref = model(pixel_values=x, output_hidden_states=True).hidden_states
    before = snapshot(model)  # (transformers installs its output-capturing hooks above)
    a = adapt(model)
    assert type(a).__name__ == "HFSamAdapter" and a.embedding and a.num_classes == 16
    assert_close_scaled(a.run(a.embed(x)), a.model_outputs(x), rel=1e-12)
    tr = a.trace(x)
    for l, rec in enumerate(tr.blocks):
        assert_close_scaled(rec.out, ref[l + 1].reshape(2, 64, -1), rel=1e-12)
    glob = kw.get("global_attn_indexes", [1])
    for l, p in enumerate(a.blocks):  # a global block is one window over the 8x8 grid
        assert p.window.size == ((8, 8) if l in glob else (kw.get("window_size", 3),) * 2)
    assert_unchanged(model, before)


@needs_transformers
def test_hf_attention_probabilities_are_the_models():
    """Eager attention: the per-window probabilities (relative positions inside the
    softmax) are the model's own attention weights, windows in the same order."""
    import transformers

    cfg = transformers.SamVisionConfig(**VISION)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = _rel_pos(randomize_(transformers.SamVisionModel(cfg), 0).double().eval())
    x = images()
    ref = model(pixel_values=x, output_attentions=True).attentions
    tr = adapt(model).trace(x)
    for l, rec in enumerate(tr.blocks):
        a = rec.attn  # [B, H, n_W, M, M]
        ours = a.transpose(1, 2).reshape(-1, *a.shape[-2:])
        # (the eager path computes its softmax in float32, even for a float64 model)
        torch.testing.assert_close(ours, ref[l].reshape(ours.shape), rtol=0, atol=1e-6)


@pytest.mark.parametrize("kw", [{}, {"use_rel_pos": False}, {"init_values": 0.5},
                                {"pre_norm": True}, {"neck_chans": None},
                                {"num_classes": 0}, {"window_size": 8}])
def test_timm_forward_equals_the_model(kw):
    model = timm_sam(**kw)
    before = snapshot(model)
    a = adapt(model)
    assert type(a).__name__ == "TimmSamAdapter"
    x = images()
    assert_close_scaled(a.run(a.embed(x)), model(x), rel=1e-12)
    assert a.embedding == (kw.get("num_classes") == 0)
    assert_unchanged(model, before)


def test_timm_refuses_what_it_cannot_run():
    with pytest.raises(TypeError, match="rotary"):
        adapt(timm_sam(use_rel_pos=False, use_rope=True))
    with pytest.raises(TypeError, match="head_hidden_size"):
        adapt(timm_sam(head_hidden_size=8))


def test_relative_position_term_is_the_models():
    """The query-dependent logit term equals timm's own ``get_decomposed_rel_pos_bias``."""
    from timm.models.vision_transformer_sam import get_decomposed_rel_pos_bias

    model = timm_sam()
    for blk, parts in zip(model.blocks, adapt(model).blocks, strict=True):
        m = parts.window.area
        q = torch.randn(3, 4, m, 8, dtype=torch.float64)
        ref = get_decomposed_rel_pos_bias(q.reshape(12, m, 8), blk.attn.rel_pos_h,
                                          blk.attn.rel_pos_w, parts.window.size,
                                          parts.window.size)
        torch.testing.assert_close(parts.query_bias(q), ref.reshape(3, 4, m, m), rtol=0,
                                   atol=1e-12)


def test_token_removal_is_refused_by_name():
    model = timm_sam()
    a = adapt(model)
    x0 = a.embed(images())
    with pytest.raises(ValueError, match="remove pixels"):
        a.run(x0, keep=torch.arange(10)[None].expand(2, -1))
    with pytest.raises(ValueError, match="RISE or ViTCX"):
        build_method("tis", model).attribute(images(), target=0, n_masks=8)


# -- DecompX complete -----------------------------------------------------------------------
@pytest.mark.parametrize("route", ["explicit", "gradient"])
@pytest.mark.parametrize("kw", [{}, {"neck_chans": None}])
def test_decompx_is_complete_through_the_neck_and_a_linear_head(route, kw):
    """SAM's encoder + neck (convolutions and LayerNorm2d through the ops) + a linear head:
    the token contributions and the bias sum to the logit (1e-10)."""
    model = timm_sam(**kw)
    x = images()
    res = DecompX(model, route=route).decompose(x, torch.tensor([1, 3]))
    ref = model(x)[torch.arange(2), torch.tensor([1, 3])].detach()
    assert_close_scaled(res.logit, ref, rel=1e-12)
    torch.testing.assert_close(res.tokens.sum(-1) + res.bias, ref, rtol=0, atol=1e-10)


@needs_transformers
def test_decompx_is_complete_for_the_hf_embedding():
    model = hf_vision()
    x = images()
    t = torch.randn(16, dtype=torch.float64)
    res = DecompX(model, route="explicit").decompose(x, EmbeddingTarget(t, similarity="dot"))
    ref = adapt(model).model_outputs(x).detach() @ t
    torch.testing.assert_close(res.tokens.sum(-1) + res.bias, ref, rtol=0, atol=1e-10)


# -- every method ---------------------------------------------------------------------------
@needs_transformers
@pytest.mark.parametrize("name", METHODS)
def test_every_method_on_the_hf_encoder(name):
    """The embedding (a vector target): finite, non-constant maps on the 8x8 grid, a batch
    equals its images one by one, the model unchanged."""
    model = hf_vision()
    x = images()
    before = snapshot(model)
    t = torch.randn(2, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    method = build_method(name, model)
    maps = method.attribute(x, target=t, output="tokens", **FAST.get(name, {}))
    assert maps.shape == (2, 64) and torch.isfinite(maps).all()
    if name != "random":
        assert (maps.std(-1) > 0).all()
        one = method.attribute(x[1:], target=t[1:], output="tokens", **FAST.get(name, {}))
        torch.testing.assert_close(maps[1:], one, rtol=1e-8, atol=1e-8 * maps.abs().max())
    assert_unchanged(model, before)


@needs_transformers
@pytest.mark.parametrize("name", sorted(REFUSERS & set(available_methods(compositions=True))))
def test_methods_without_a_windowed_form_refuse_by_name(name):
    model = hf_vision()
    with pytest.raises((TypeError, ValueError), match="window"):
        build_method(name, model).attribute(images(), target=torch.ones(16, dtype=torch.float64),
                                            **FAST.get(name, {}))


def test_timm_family_is_in_the_contract_suite():
    from tests.helpers import ALL_FAMILIES

    assert "timm_sam" in ALL_FAMILIES
    model = make_model("timm_sam")
    assert type(adapt(model)).__name__ == "TimmSamAdapter"
    a = adapt(model)
    x = make_inputs("timm_sam", batch=2)
    assert_close_scaled(a.run(a.embed(x)), model(x), rel=1e-12)


# -- SamMaskTarget --------------------------------------------------------------------------
def _direct(model, x, mask, **prompt):
    """The score computed from the model's own forward on the pixels."""
    out = model(pixel_values=x, multimask_output=True, **prompt).pred_masks[:, 0, mask]
    region = out > 0
    return (out * region).sum((-2, -1)).detach(), region


@needs_transformers
@pytest.mark.parametrize("prompt", ["points", "boxes", "both", "labels"])
def test_mask_target_scores_the_models_own_mask(prompt):
    model = hf_sam()
    x = images()
    boxes = torch.tensor([[2.0, 3.0, 20.0, 25.0], [8.0, 1.0, 30.0, 14.0]], dtype=torch.float64)
    labels = torch.tensor([[1, 0], [1, 1]])
    pts2 = torch.cat([POINTS, POINTS.flip(-1)], 1)  # two points per image
    kw, direct = {}, {}
    if prompt in ("points", "both"):
        kw["points"], direct["input_points"] = POINTS, POINTS[:, None]
    if prompt in ("boxes", "both"):
        kw["boxes"], direct["input_boxes"] = boxes, boxes[:, None]
    if prompt == "labels":
        kw.update(points=pts2, labels=labels)
        direct.update(input_points=pts2[:, None], input_labels=labels[:, None])
    ref, region = _direct(model, x, 1, **direct)
    target = SamMaskTarget(model, mask=1, **kw).resolve(adapt(model), x)
    assert torch.equal(target.region, region)
    a = adapt(model)
    with a.targeting(target):
        cols = a.run(a.embed(x))  # [2, 2]: each image's score under both images' prompts
    torch.testing.assert_close(cols.diagonal(), ref, rtol=1e-12, atol=1e-12 * ref.abs().max())


@needs_transformers
def test_one_prompt_serves_every_image_and_noise_tunnel_runs():
    model = hf_sam()
    x = images(3)
    before = snapshot(model)
    target = SamMaskTarget(model, points=[[12.0, 9.0]], mask=0)
    ref, _ = _direct(model, x, 0, input_points=torch.tensor([[[[12.0, 9.0]]]] * 3,
                                                           dtype=torch.float64))
    res = DecompX(model).decompose(x, target)
    torch.testing.assert_close(res.score, ref, rtol=1e-10, atol=1e-10 * ref.abs().max())
    nt = NoiseTunnel(build_method("gae", model)).attribute(
        x[:2], nt_type="smoothgrad", nt_samples=2, stdevs=0.05, target=target)
    assert nt.shape == x[:2].shape and torch.isfinite(nt).all()
    assert_unchanged(model, before)


@needs_transformers
@pytest.mark.parametrize("name", METHODS)
def test_every_method_explains_a_mask(name):
    """Finite, non-constant maps of a mask on the encoder's grid; the model unchanged."""
    model = hf_sam()
    x = images()
    before = snapshot(model)
    maps = build_method(name, model).attribute(
        x, target=SamMaskTarget(model, points=POINTS, mask=1), output="tokens",
        **FAST.get(name, {}))
    assert maps.shape == (2, 64) and torch.isfinite(maps).all()
    if name != "random":
        assert (maps.std(-1) > 0).all()
    assert_unchanged(model, before)


@needs_transformers
def test_mask_target_refusals():
    model = hf_sam()
    x = images()
    with pytest.raises(TypeError, match="SamModel"):
        SamMaskTarget(hf_vision(), points=POINTS)
    with pytest.raises(ValueError, match="prompt"):
        SamMaskTarget(model)
    with pytest.raises(ValueError, match=r"mask must be in \[0, 3\)"):
        SamMaskTarget(model, points=POINTS, mask=3)
    with pytest.raises(ValueError, match=r"mask must be in \[0, 1\)"):
        SamMaskTarget(model, points=POINTS, mask=1, multimask_output=False)
    with pytest.raises(TypeError, match="mask"):
        SamMaskTarget(model, points=POINTS, mask=1.0)
    with pytest.raises(ValueError, match="points"):
        SamMaskTarget(model, points=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="labels"):
        SamMaskTarget(model, points=POINTS, labels=[[1, 1], [1, 0]])
    with pytest.raises(TypeError, match="labels"):
        SamMaskTarget(model, points=POINTS, labels=[[0.5], [1.0]])
    with pytest.raises(ValueError, match="one per image"):
        build_method("gae", model).attribute(images(3), target=SamMaskTarget(model,
                                                                             points=POINTS))
    with pytest.raises(ValueError, match="not resolved"):
        SamMaskTarget(model, points=POINTS).num_columns(1)
    with pytest.raises(ValueError, match="same SamModel"):
        build_method("gae", hf_sam()).attribute(x, target=SamMaskTarget(model, points=POINTS))
    other = hf_vision()
    with pytest.raises(ValueError, match="same SamModel"):
        build_method("gae", other).attribute(x, target=SamMaskTarget(model, points=POINTS))
    with pytest.raises((TypeError, ValueError), match="remove pixels"):
        build_method("tis", model).attribute(x, target=SamMaskTarget(model, points=POINTS),
                                             n_masks=8)


@needs_transformers
def test_sam_model_is_explained_on_its_image_encoder(monkeypatch):
    """``adapt(SamModel)`` explains its ``vision_encoder``: the embedding is the grid mean
    of ``get_image_embeddings``; an empty mask region is refused by name."""
    import captum_vit.targets.sam as sam_targets

    model = hf_sam()
    x = images()
    a = adapt(model)
    assert type(a).__name__ == "HFSamAdapter"
    assert_close_scaled(a.run(a.embed(x)), model.get_image_embeddings(x).mean((-2, -1)),
                        rel=1e-12)
    enc = adapt(model.vision_encoder)  # the encoder module alone
    assert type(enc).__name__ == "HFSamAdapter"
    assert_close_scaled(enc.run(enc.embed(x)), a.run(a.embed(x)), rel=1e-12)
    monkeypatch.setattr(sam_targets, "sam_mask_logits",
                        lambda *args: -torch.ones(2, 1, 3, 32, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match="no positive pixel on image"):
        SamMaskTarget(model, points=[[3.0, 4.0]]).resolve(a, x)
