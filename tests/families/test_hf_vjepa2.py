"""Hugging Face V-JEPA 2 (videos [B, T, C, H, W], tubelet tokens without class token, 3-D
RoPE; the classifier's attentive pooler): the adapter's forward equals the model's own at
three frame counts; true token removal equals the model's own layers with
``position_mask`` (kept tubelets keep their RoPE positions); the pooler's self-attention
layers are blocks and its cross-attention an attention pool without identity, checked
against a slow float64 reference written here (every probability materialised from the
model's own modules and the model's own RoPE); DecompX complete; token IxG is the model's
own input×gradient; clear errors.

No twin: no other installed model has V-JEPA 2's 3-D RoPE (its channel split and
interleaved pairs differ from timm's Eva rotary)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from captum_vit import GAE, AttnGradCAM, DecompX, EmbeddingTarget, RawAttention, Rollout
from captum_vit.adapters import adapt
from captum_vit.adapters.families.hf_vjepa2 import HFVJEPA2Adapter
from captum_vit.registry import build_method
from tests.families._video import assert_video_refusals
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


def _encoder(model: nn.Module) -> nn.Module:
    return getattr(model, "vjepa2", model).encoder


def _reference(model: nn.Module, x: torch.Tensor, keep: torch.Tensor | None = None):
    """The model's output through its own modules, the kept tokens (``keep`` [B, n]
    original indices) through its layers' ``position_mask`` path: logits, or the token
    mean of the encoder's output for ``VJEPA2Model``."""
    enc = _encoder(model)
    h = enc.embeddings(x)
    if keep is not None:
        h = h.gather(1, keep[..., None].expand(-1, -1, h.shape[-1]))
    for layer in enc.layer:
        h = layer(h, position_mask=keep)[0]
    h = enc.layernorm(h)
    if not hasattr(model, "pooler"):
        return h.mean(1)
    return model.classifier(model.pooler(h))


@pytest.mark.parametrize("frames", [4, 2, 6])
@pytest.mark.parametrize("family", ["hf_vjepa2", "hf_vjepa2_model"])
def test_forward_equals_the_models_own(family, frames):
    model = make_model(family)
    ad = adapt(model)
    assert isinstance(ad, HFVJEPA2Adapter) and ad.video
    assert ad.embedding == (family == "hf_vjepa2_model")
    before = snapshot(model)
    x = _video(frames=frames)
    with torch.no_grad():
        ours = ad.run(ad.embed(x))
        if family == "hf_vjepa2":
            own = model(pixel_values_videos=x).logits
        else:
            own = model(pixel_values_videos=x, skip_predictor=True).last_hidden_state.mean(1)
        assert_close_scaled(_reference(model, x), own, rel=1e-12)
    assert_close_scaled(ours, own, rel=1e-12)
    assert_close_scaled(ad.model_logits(x), own, rel=1e-12)
    ad.self_check(x)
    lay = ad.layout(x)
    assert (lay.frames, lay.tubelet, lay.frame_grid, lay.num_prefix) == (frames // 2, 2, (2, 2), 0)
    assert lay.readout == ("map" if family == "hf_vjepa2" else "avg")
    depth = len(_encoder(model).layer)
    assert all(b.features() == ("rotary",) for b in ad.blocks[:depth - 1])
    if family == "hf_vjepa2":  # the encoder's norm, then the pooler's layers (no RoPE)
        assert ad.blocks[depth - 1].features() == ("rotary", "out_norm")
        assert len(ad.blocks) == depth + model.config.num_pooler_layers
        assert all(b.features() == () for b in ad.blocks[depth:])
    else:
        assert ad.blocks[-1].features() == ("rotary",) and len(ad.blocks) == depth
    assert_unchanged(model, before)


@pytest.mark.parametrize("family", ["hf_vjepa2", "hf_vjepa2_model"])
def test_token_removal_keeps_rope_positions_as_the_models_position_mask(family):
    model = make_model(family)
    ad = adapt(model)
    x = _video()
    g = torch.Generator().manual_seed(3)
    keep = torch.stack([torch.randperm(8, generator=g)[:5].sort().values for _ in range(2)])
    with torch.no_grad():
        ours = ad.run(ad.embed(x), keep=keep)
        ref = _reference(model, x, keep)
        full = _reference(model, x)
    assert_close_scaled(ours, ref, rel=1e-12)
    assert (ours - full).abs().max() > 1e-6  # removal changes the output


def _split(t: torch.Tensor, heads: int) -> torch.Tensor:
    b, n, d = t.shape
    return t.view(b, n, heads, d // heads).transpose(1, 2)


def _eager(model: nn.Module, x: torch.Tensor, target: torch.Tensor):
    """Slow float64 reference of the classifier from its own modules with every
    probability materialised and its gradient kept: (logits, block attentions in the
    adapter's order (encoder layers, then the pooler's self-attention layers), pool
    attention [B, H, 1, N])."""
    enc, pooler = _encoder(model), model.pooler
    attns = []

    def attend(q, k, v, scale):
        a = ((q * scale) @ k.transpose(-2, -1)).softmax(-1)
        a.retain_grad()
        attns.append(a)
        b, hh, n, d = v.shape
        return (a @ v).transpose(1, 2).reshape(b, n, hh * d)

    h = enc.embeddings(x)
    for layer in enc.layer:
        at, u = layer.attention, layer.norm1(h)
        heads, pos = at.num_attention_heads, at.get_position_ids(u)
        q = at.apply_rotary_embeddings(_split(at.query(u), heads), pos)
        k = at.apply_rotary_embeddings(_split(at.key(u), heads), pos)
        h = h + at.proj(attend(q, k, _split(at.value(u), heads), at.scaling))
        h = h + layer.mlp(layer.norm2(h))
    h = enc.layernorm(h)
    for layer in pooler.self_attention_layers:
        sa, u = layer.self_attn, layer.layer_norm1(h)
        q, k, v = (_split(p(u), sa.num_heads) for p in (sa.q_proj, sa.k_proj, sa.v_proj))
        h = h + sa.out_proj(attend(q, k, v, sa.scale))
        h = h + layer.mlp(layer.layer_norm2(h))
    cross = pooler.cross_attention_layer
    ca, u = cross.cross_attn, cross.layer_norm1(h)
    q = _split(ca.q_proj(pooler.query_tokens), ca.num_heads)
    k, v = _split(ca.k_proj(u), ca.num_heads), _split(ca.v_proj(u), ca.num_heads)
    ap = ((q * ca.scale) @ k.transpose(-2, -1)).softmax(-1)
    ap.retain_grad()
    z = pooler.query_tokens + (ap @ v).transpose(1, 2).reshape(x.shape[0], 1, -1)
    z = z + cross.mlp(cross.layer_norm2(z))
    logits = model.classifier(z[:, 0])
    logits.gather(1, target[:, None]).sum().backward()
    model.zero_grad(set_to_none=True)
    return logits.detach(), attns, ap


@pytest.fixture(scope="module")
def case():
    model = make_model("hf_vjepa2")
    x = _video()
    target = torch.tensor([1, 3])
    return model, x, target, _eager(model, x, target)


def test_reference_is_the_model(case):
    model, x, _, (logits, attns, _) = case
    assert len(attns) == len(adapt(model).blocks)
    assert_close_scaled(logits, model(pixel_values_videos=x).logits, rel=1e-12)


def test_raw_attention_reads_the_pool(case):
    model, x, t, (_, _, ap) = case
    got = RawAttention(model).attribute(x, t, output="tokens")
    assert_close_scaled(got, ap.detach().mean(1)[:, 0], rel=1e-10)


def test_rollout_runs_through_the_pooler_layers_and_the_encoder(case):
    model, x, t, (_, attns, ap) = case
    n = ap.shape[-1]
    r = ap.detach().mean(1)[:, 0]
    for a in reversed(attns):
        m = a.detach().mean(1) + torch.eye(n, dtype=a.dtype)
        r = torch.einsum("bn,bnm->bm", r, m / m.sum(-1, keepdim=True))
    assert_close_scaled(Rollout(model).attribute(x, t, output="tokens"), r, rel=1e-10)


def test_gae_treats_the_cross_attention_as_a_layer_without_identity(case):
    model, x, t, (_, attns, ap) = case
    n = ap.shape[-1]
    big_r = torch.eye(n, dtype=ap.dtype).expand(x.shape[0], n, n)
    for a in attns:  # R <- R + Ā R, block 0 first (Chefer et al. 2021b)
        abar = (a.grad * a.detach()).clamp(min=0).mean(1)
        big_r = big_r + abar @ big_r
    w = (ap.grad * ap.detach()).clamp(min=0).mean(1)[:, 0]
    ref = torch.einsum("bn,bnm->bm", w, big_r)
    assert_close_scaled(GAE(model).attribute(x, t, output="tokens"), ref, rel=1e-10)


def test_attn_gradcam_runs_on_the_pool(case):
    model, x, t, (_, _, ap) = case
    g, a = ap.grad[:, :, 0], ap.detach()[:, :, 0]  # [B, H, N]
    ref = (g.mean(-1, keepdim=True) * a).mean(1).clamp(min=0)
    assert_close_scaled(AttnGradCAM(model).attribute(x, t, output="tokens"), ref, rel=1e-10)


@pytest.mark.parametrize("route", ["explicit", "gradient"])
@pytest.mark.parametrize("family", ["hf_vjepa2", "hf_vjepa2_model"])
def test_decompx_is_complete(family, route):
    model = make_model(family)
    x = _video()
    before = snapshot(model)
    ad = adapt(model)
    with torch.no_grad():
        out = ad.model_outputs(x)
    if family == "hf_vjepa2":
        target, score = torch.tensor([1, 3]), out[[0, 1], [1, 3]]
    else:
        t = torch.linspace(-1, 1, out.shape[-1], dtype=torch.float64)
        target, score = EmbeddingTarget(t, similarity="dot"), out @ t
    res = DecompX(model, route=route).decompose(x, target)
    assert res.tokens.shape == (2, 8)
    torch.testing.assert_close(res.tokens.sum(-1) + res.bias, score, rtol=0, atol=1e-10)
    assert_unchanged(model, before)


def test_decompx_routes_agree():
    model = make_model("hf_vjepa2")
    x = _video()
    ex = DecompX(model, route="explicit").decompose(x, [1, 3])
    gr = DecompX(model, route="gradient").decompose(x, [1, 3])
    torch.testing.assert_close(gr.tokens, ex.tokens, rtol=0, atol=1e-10)


@pytest.mark.parametrize("family", ["hf_vjepa2", "hf_vjepa2_model"])
def test_token_ixg_is_the_models_own_input_times_gradient(family):
    """``token_ixg``: ``Σ_d x_0 ⊙ ∂s/∂x_0`` with ``x_0`` the output of the model's own
    embedding module and the gradient through the model's own forward; batch
    invariant."""
    model = make_model(family)
    x = _video()
    seen = {}

    def keep(_module, _inputs, out):
        out.retain_grad()
        seen["x0"] = out

    handle = _encoder(model).embeddings.register_forward_hook(keep)
    try:
        if family == "hf_vjepa2":
            target = torch.tensor([2, 0])
            model(pixel_values_videos=x).logits.gather(1, target[:, None]).sum().backward()
        else:
            t = torch.linspace(-1, 1, model.config.hidden_size, dtype=torch.float64)
            target = EmbeddingTarget(t, similarity="dot")
            hidden = model(pixel_values_videos=x, skip_predictor=True).last_hidden_state
            (hidden.mean(1) @ t).sum().backward()
    finally:
        handle.remove()
    model.zero_grad(set_to_none=True)
    x0 = seen["x0"]
    ref = (x0 * x0.grad).sum(-1).detach()
    method = build_method("token_ixg", model)
    assert_close_scaled(method.attribute(x, target=target, output="tokens"), ref, rel=1e-10)
    one = target[1:] if isinstance(target, torch.Tensor) else target
    assert_close_scaled(method.attribute(x[1:], target=one, output="tokens"), ref[1:],
                        rel=1e-10)


def test_model_to_float32_after_adapting():
    """The pool's identity projection follows the model's dtype (``refresh``)."""
    model = _build("hf_vjepa2")
    ad = adapt(model)
    model.float()
    x = _video().float()
    with torch.no_grad():
        assert_close_scaled(ad.run(ad.embed(x)), model(pixel_values_videos=x).logits,
                            rel=1e-5)


def test_clear_errors_and_the_model_unchanged():
    assert_video_refusals("hf_vjepa2", "crop_size",
                          {3: r"3 frames.*multiple of its tubelet_size=2",
                           1: r"1 frames.*x.repeat\(1, 2, 1, 1, 1\)"})


@pytest.mark.parametrize("method", ["cp_lrp", "attnlrp"])
def test_lrp_to_the_pixels_of_a_video(method):
    """``at="pixels"``: the rules run through the tubelet projection; the relevance of
    each tubelet is its pixels' (finite, batch invariant)."""
    model = make_model("hf_vjepa2")
    before = snapshot(model)
    x = _video()
    lrp = build_method(method, model)
    pix = type(lrp)(model, at="pixels").attribute(x, target=[1, 3], output="tokens")
    one = type(lrp)(model, at="pixels").attribute(x[1:], target=[3], output="tokens")
    assert pix.shape == (2, 8) and torch.isfinite(pix).all()
    assert_close_scaled(one, pix[1:], rel=1e-10)
    assert_unchanged(model, before)
