"""Hugging Face ViViT (videos [B, T, C, H, W], tubelet tokens after a class token, joint
attention): the adapter's forward equals the model's own at two frame counts; a one-slice
ViViT is exactly a Hugging Face ViT with copied weights, for every registered method;
DecompX is complete; token IxG is the model's own input×gradient; clear errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from captum_vit import DecompX, EmbeddingTarget
from captum_vit.adapters import adapt
from captum_vit.adapters.families.hf_vivit import HFVivitAdapter
from captum_vit.registry import available_methods, build_method
from tests.families._video import assert_one_slice_twin_maps, assert_video_refusals
from tests.families._video import example_model as _build
from tests.families._video import video as _video
from tests.helpers import (
    assert_close_scaled,
    assert_unchanged,
    make_model,
    needs_transformers,
    snapshot,
)

pytestmark = needs_transformers
METHODS = available_methods(compositions=True)
CONFIGS = {  # name -> (example, overrides, frames)
    "clf_t4": ("hf_vivit", {}, 4),
    "clf_t2": ("hf_vivit", {"num_frames": 2}, 2),
    "clf_t1_tubelet1": ("hf_vivit", {"num_frames": 3, "tubelet_size": [1, 8, 8]}, 3),
    "model_pooler": ("hf_vivit_model", {}, 4),
    "model_pooler_t2": ("hf_vivit_model", {"num_frames": 2}, 2),
}


def _own(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's own output: the logits, or ``VivitModel``'s ``pooler_output``."""
    out = model(pixel_values=x)
    return out.logits if hasattr(out, "logits") else out.pooler_output


@pytest.mark.parametrize("config", CONFIGS)
def test_forward_equals_the_models_own(config):
    family, overrides, frames = CONFIGS[config]
    model = _build(family, **overrides)
    ad = adapt(model)
    assert isinstance(ad, HFVivitAdapter) and ad.video
    assert ad.embedding == (family == "hf_vivit_model")
    before = snapshot(model)
    x = _video(frames=frames)
    with torch.no_grad():
        ours = ad.run(ad.embed(x))
        ref = _own(model, x)
    assert_close_scaled(ours, ref, rel=1e-12)
    assert_close_scaled(ad.model_logits(x), ref, rel=1e-12)
    ad.self_check(x)
    t = int(model.config.tubelet_size[0])
    lay = ad.layout(x)
    assert (lay.frames, lay.tubelet, lay.frame_grid, lay.num_prefix) == (frames // t, t, (2, 2), 1)
    assert lay.readout == "token"
    blk, att = ad.blocks[0], ad.layers[0].attention
    assert blk.q_weight is att.q_proj.weight and blk.k_bias is att.k_proj.bias
    assert blk.act is ad.layers[0].mlp.activation_fn  # gelu_fast, the config's default
    assert_unchanged(model, before)


def test_model_without_pooler_outputs_the_normed_cls_row():
    transformers = pytest.importorskip("transformers")
    ref = make_model("hf_vivit_model")
    model = transformers.VivitModel(ref.config, add_pooling_layer=False).to(torch.float64).eval()
    model.load_state_dict({k: v for k, v in ref.state_dict().items()
                           if not k.startswith("pooler")})
    ad = adapt(model)
    x = _video()
    with torch.no_grad():
        want = model(pixel_values=x).last_hidden_state[:, 0]
        assert_close_scaled(ad.run(ad.embed(x)), want, rel=1e-12)
    assert_close_scaled(ad.model_logits(x), want, rel=1e-12)


@pytest.mark.parametrize("route", ["explicit", "gradient"])
@pytest.mark.parametrize("family", ["hf_vivit", "hf_vivit_model"])
def test_decompx_is_complete(family, route):
    model = make_model(family)
    x = _video()
    before = snapshot(model)
    with torch.no_grad():
        out = _own(model, x)
    if family == "hf_vivit":
        target, score = torch.tensor([1, 3]), out[[0, 1], [1, 3]]
    else:
        t = torch.linspace(-1, 1, out.shape[-1], dtype=torch.float64)
        target, score = EmbeddingTarget(t, similarity="dot"), out @ t
    res = DecompX(model, route=route).decompose(x, target)
    assert res.tokens.shape == (2, 1 + 8)
    torch.testing.assert_close(res.tokens.sum(-1) + res.bias, score, rtol=0, atol=1e-10)
    assert_unchanged(model, before)


def test_token_ixg_is_the_models_own_input_times_gradient():
    """``token_ixg`` on the patch rows: ``Σ_d x_0 ⊙ ∂y_c/∂x_0`` with ``x_0`` the output of
    the model's own ``embeddings`` module and the gradient through the model's forward."""
    model = make_model("hf_vivit")
    x = _video()
    target = torch.tensor([2, 0])
    seen = {}

    def keep(_module, _inputs, out):
        out.retain_grad()
        seen["x0"] = out

    handle = model.vivit.embeddings.register_forward_hook(keep)
    try:
        logits = model(pixel_values=x).logits
        logits.gather(1, target[:, None]).sum().backward()
    finally:
        handle.remove()
    model.zero_grad(set_to_none=True)
    x0 = seen["x0"]
    ref = (x0 * x0.grad).sum(-1)[:, 1:].detach()
    got = build_method("token_ixg", model).attribute(x, target=target, output="tokens")
    assert_close_scaled(got, ref, rel=1e-10)
    batch = build_method("token_ixg", model).attribute(x[1:], target=target[1:],
                                                       output="tokens")
    assert_close_scaled(batch, ref[1:], rel=1e-10)  # batch invariance


# -- a one-slice ViViT is a Hugging Face ViT ------------------------------------------------
_ONE: dict[str, nn.Module] = {}


def _one_slice_pair() -> tuple[nn.Module, nn.Module]:
    """A ViViT of one frame slice (num_frames = 1, tubelet (1, 8, 8)) and a Hugging Face
    ``ViTForImageClassification`` holding its weights (the Conv3d kernel's one frame as
    the Conv2d kernel; the same names otherwise, transformers 5)."""
    if not _ONE:
        transformers = pytest.importorskip("transformers")
        vv = _build("hf_vivit", num_frames=1, tubelet_size=[1, 8, 8])
        c = vv.config
        cfg = transformers.ViTConfig(
            image_size=16, patch_size=8, num_channels=3, hidden_size=c.hidden_size,
            num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
            intermediate_size=c.intermediate_size, hidden_act=c.hidden_act,
            layer_norm_eps=c.layer_norm_eps, qkv_bias=c.qkv_bias, num_labels=5)
        twin = transformers.ViTForImageClassification(cfg).to(torch.float64).eval()
        state = {k: v for k, v in vv.state_dict().items()}
        key = "vivit.embeddings.patch_embeddings.projection.weight"
        state[key] = state[key][:, :, 0]
        missing, unexpected = twin.load_state_dict(
            {k.replace("vivit.", "vit.", 1): v for k, v in state.items()}, strict=False)
        assert not missing and not unexpected
        _ONE.update(vv=vv, twin=twin)
    return _ONE["vv"], _ONE["twin"]


def test_one_slice_vivit_is_the_vit_twin():
    vv, twin = _one_slice_pair()
    x = _video(frames=1)
    assert_close_scaled(vv(pixel_values=x).logits, twin(pixel_values=x[:, 0]).logits,
                        rel=1e-12)


@pytest.mark.parametrize("name", METHODS)
def test_one_slice_vivit_gets_the_vit_twins_maps(name):
    """A video of one frame slice (T = t = 1) is an image: ViViT is then exactly a
    Hugging Face ViT, so every registered method (compositions included, same seeds)
    gives the twin's maps of the frame (<= 1e-10 of the map's largest magnitude, of the
    logits' for a rounding-sized map), tokens and pixels. RISE and ViT-CX mask tubelets on
    videos (true token removal), so the twin runs them with ``removal="tokens"``."""
    vv, twin = _one_slice_pair()
    assert_one_slice_twin_maps(name, vv, twin, lambda x: twin(pixel_values=x).logits)


# -- errors ---------------------------------------------------------------------------------
def test_clear_errors_and_the_model_unchanged():
    assert_video_refusals("hf_vivit", "image_size",
                          {3: r"3 frames but the model takes num_frames=4"})


@pytest.mark.parametrize("method", ["cp_lrp", "attnlrp"])
def test_lrp_to_the_pixels_of_a_video(method):
    """``at="pixels"``: the rules run through the tubelet projection (the Conv3d as a
    linear map, the class token's row untouched); a one-slice video gets the ViT twin's
    pixel relevance, and a 4-frame video gets finite maps per tubelet."""
    from captum_vit import CPLRP, AttnLRP

    cls = {"cp_lrp": CPLRP, "attnlrp": AttnLRP}[method]
    vv, twin = _one_slice_pair()
    x = _video(frames=1)
    ours = cls(vv, at="pixels").attribute(x, target=[1, 3])
    ref = cls(twin, at="pixels").attribute(x[:, 0], target=[1, 3])
    assert_close_scaled(ours[:, 0], ref, rel=1e-10)
    model = make_model("hf_vivit")
    before = snapshot(model)
    pix = cls(model, at="pixels").attribute(_video(), target=[1, 3], output="tokens")
    assert pix.shape == (2, 8) and torch.isfinite(pix).all()
    assert_unchanged(model, before)
