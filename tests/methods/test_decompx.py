"""DecompX (SPEC §3) and the linearised backward it rests on."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from captum_vit.adapters import (
    activation_gate_detached,
    adapt,
    layer_norm_frozen_variance,
)
from captum_vit.methods.decompx import DecompX, sources_per_chunk
from captum_vit.methods.ixg import layer_gradients
from tests.helpers import assert_close_scaled, assert_unchanged, make_inputs, make_model, snapshot

DECOMP_FAMILIES = ["vit", "distilled", "registers", "avgpool", "layerscale", "nonsquare"]
TARGETS = torch.tensor([1, 4, 0])


# -- linearised backward ---------------------------------------------------------------
@pytest.mark.parametrize("family", DECOMP_FAMILIES)
def test_linearize_keeps_forward_bit_identical(family):
    model, x = make_model(family), make_inputs(family)
    ad = adapt(model)
    plain = ad.trace(x)
    lin = ad.trace(x, linearize=True, grad=True)
    # bit for bit by construction: the linearised functions' forward is the model's own ops
    assert torch.equal(plain.logits, lin.logits)
    for a, b in zip(plain.blocks, lin.blocks, strict=True):
        for name in ("x", "u", "attn", "attn_out", "mid", "ffn_out", "out"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name


def _grad(fn, x, g):
    x = x.detach().clone().requires_grad_()
    out = fn(x)
    return out, torch.autograd.grad(out, x, g)[0]


def test_layer_norm_variance_is_detached():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 7, generator=gen, dtype=torch.float64) * 2 + 0.5
    w = torch.randn(7, generator=gen, dtype=torch.float64)
    b = torch.randn(7, generator=gen, dtype=torch.float64)
    g = torch.randn(2, 3, 7, generator=gen, dtype=torch.float64)
    eps = 1e-6

    def by_hand(t):
        var = t.var(-1, unbiased=False, keepdim=True).detach()
        return (t - t.mean(-1, keepdim=True)) / torch.sqrt(var + eps) * w + b

    y_ref, g_ref = _grad(by_hand, x, g)
    y, gx = _grad(lambda t: layer_norm_frozen_variance(t, w, b, eps), x, g)
    _, g_full = _grad(lambda t: F.layer_norm(t, (7,), w, b, eps), x, g)
    assert torch.equal(y, F.layer_norm(x, (7,), w, b, eps))
    assert_close_scaled(y, y_ref)
    assert_close_scaled(gx, g_ref)
    assert (gx - g_full).abs().max() > 1e-3  # it really differs from the full gradient


def test_gelu_gate_is_detached():
    z = torch.tensor([[-3.0, -0.7, 0.0, 0.2, 1.5, 4.0]], dtype=torch.float64)
    g = torch.linspace(-1, 1, 6, dtype=torch.float64)[None]
    act = torch.nn.GELU()
    y, gz = _grad(lambda t: activation_gate_detached(t, act), z, g)
    phi = 0.5 * (1 + torch.erf(z / 2 ** 0.5))  # GELU(z)/z = Phi(z), also at z = 0
    assert torch.equal(y, act(z))
    assert_close_scaled(gz, g * phi)
    nz = z != 0
    _, g_ref = _grad(lambda t: t * (act(t) / t).detach(), z[nz][None], g[nz][None])
    assert_close_scaled(gz[nz][None], g_ref)


def test_attention_qk_are_detached():
    model = make_model("layerscale")  # with qk-norm
    p, at = adapt(model).blocks[0], model.blocks[0].attn
    gen = torch.Generator().manual_seed(5)
    u = torch.randn(2, 17, 32, generator=gen, dtype=torch.float64)
    g = torch.randn(2, 4, 17, 8, generator=gen, dtype=torch.float64)

    def ours(t, detach):
        attn, v = p.attention_probs(t, detach_qk=detach)
        return attn @ v

    def by_hand(t):
        q, k, v = at.qkv(t).reshape(2, 17, 3, 4, 8).permute(2, 0, 3, 1, 4)
        q, k = at.q_norm(q).detach(), at.k_norm(k).detach()
        return (q * at.scale @ k.transpose(-2, -1)).softmax(-1) @ v

    y, gu = _grad(lambda t: ours(t, True), u, g)
    y_ref, g_ref = _grad(by_hand, u, g)
    _, g_full = _grad(lambda t: ours(t, False), u, g)
    assert torch.equal(y, ours(u, False))
    assert_close_scaled(y, y_ref)
    assert_close_scaled(gu, g_ref)
    assert (gu - g_full).abs().max() > 1e-3


def _handwritten_linearized_logits(model, x0):
    """Pre-LN ViT (token readout) written from SPEC §0 with the §3 detaches, on timm's
    own modules."""
    def ln(mod, t):
        var = t.var(-1, unbiased=False, keepdim=True).detach()
        return (t - t.mean(-1, keepdim=True)) / torch.sqrt(var + mod.eps) * mod.weight + mod.bias

    x = x0
    for blk in model.blocks:
        at = blk.attn
        u = ln(blk.norm1, x)
        b, n, d = u.shape
        q, k, v = at.qkv(u).reshape(b, n, 3, at.num_heads, at.head_dim).permute(2, 0, 3, 1, 4)
        q, k = at.q_norm(q).detach(), at.k_norm(k).detach()
        attn = (q * at.scale @ k.transpose(-2, -1)).softmax(-1)
        x = x + blk.ls1(at.proj((attn @ v).transpose(1, 2).reshape(b, n, d)))
        h = blk.mlp.fc1(ln(blk.norm2, x))
        h = h * (blk.mlp.act(h) / h).detach()
        x = x + blk.ls2(blk.mlp.fc2(h))
    return model.head(ln(model.norm, x)[:, 0])


@pytest.mark.parametrize("family", ["vit", "layerscale"])
def test_linearized_gradients_match_handwritten_detaches(family):
    model, x = make_model(family), make_inputs(family)
    ref_model = copy.deepcopy(model)
    x0 = ref_model._pos_embed(ref_model.patch_embed(x)).detach().requires_grad_()
    logits = _handwritten_linearized_logits(ref_model, x0)
    (g_ref,) = torch.autograd.grad(logits.gather(1, TARGETS[:, None]).sum(), x0)
    lg = layer_gradients(adapt(model), x, TARGETS, linearize=True)
    torch.testing.assert_close(lg.grads[0], g_ref, rtol=0, atol=1e-10 * g_ref.abs().max())
    plain = layer_gradients(adapt(model), x, TARGETS)
    assert (plain.grads[0] - g_ref).abs().max() > 1e-4  # the switches matter


# -- DecompX: completeness, routes, parity -------------------------------------------
@pytest.mark.parametrize("family", DECOMP_FAMILIES)
def test_completeness_and_routes_agree_for_every_start_layer(family):
    model, x = make_model(family), make_inputs(family)
    with torch.no_grad():
        y = model(x).gather(1, TARGETS[:, None])[:, 0]
    for s in range(3):
        ex = DecompX(model, start_layer=s, route="explicit").decompose(x, TARGETS)
        gr = DecompX(model, start_layer=s, route="gradient").decompose(x, TARGETS)
        assert ex.tokens.shape == (3, adapt(model).layout(x).num_tokens)
        torch.testing.assert_close(ex.tokens.sum(-1) + ex.bias, y, rtol=0, atol=1e-10)
        torch.testing.assert_close(ex.logit, y, rtol=0, atol=1e-10)
        torch.testing.assert_close(gr.tokens, ex.tokens, rtol=0, atol=1e-10)
        torch.testing.assert_close(gr.bias, ex.bias, rtol=0, atol=1e-10)


def test_parity_with_authors_decompx_gradient_route(parity):
    model, x, t, logits, maps, _ = parity
    lg = layer_gradients(adapt(model), x, t, linearize=True)
    ixg = lg.ixg()
    y = logits.gather(1, t[:, None])[:, 0]
    for s in range(6):
        # the authors' GELU slope is GELU(z)/(z + 1e-12): up to ~2e-10 apart (README)
        torch.testing.assert_close(ixg[s, :, 1:], maps["decompx_from_layer"][s],
                                   rtol=0, atol=1e-9)
        torch.testing.assert_close(ixg[s, :, :1], maps["decompx_prefix_from_layer"][s],
                                   rtol=0, atol=1e-9)
        torch.testing.assert_close(y - ixg[s].sum(-1), maps["decompx_bias_from_layer"][s],
                                   rtol=0, atol=1e-9)
    for s in (0, 3):
        res = DecompX(model, start_layer=s).decompose(x, t)
        # DecompX streams a fused-attention trace: the same numbers up to rounding
        assert_close_scaled(res.tokens, ixg[s])
        torch.testing.assert_close(res.bias, maps["decompx_bias_from_layer"][s],
                                   rtol=0, atol=1e-9)
        assert_close_scaled(res.logit, y)


@pytest.mark.parametrize("s", [0, 5])
def test_parity_with_authors_decompx_explicit_route(parity, s):
    model, x, t, logits, maps, _ = parity
    res = DecompX(model, start_layer=s, route="explicit").decompose(x, t)
    grad = DecompX(model, start_layer=s).decompose(x, t)
    ref = maps["decompx_from_layer"][s]
    torch.testing.assert_close(res.tokens[:, 1:], ref, rtol=0, atol=1e-9)
    torch.testing.assert_close(res.tokens[:, :1], maps["decompx_prefix_from_layer"][s],
                               rtol=0, atol=1e-9)
    torch.testing.assert_close(res.bias, maps["decompx_bias_from_layer"][s], rtol=0, atol=1e-9)
    # authors' own completeness holds to ~1e-12 and so does ours
    y = logits.gather(1, t[:, None])[:, 0]
    # a sum is as exact as its terms: the scale is sum |tokens|, not |y|
    assert_close_scaled(res.tokens.sum(-1) + res.bias, y,
                        scale=res.tokens.abs().sum(-1).max().item())
    assert_close_scaled(res.tokens, grad.tokens)


def test_attribute_returns_patch_tokens_of_decompose():
    model, x = make_model("registers"), make_inputs("registers")
    dx = DecompX(model, start_layer=1)
    res = dx.decompose(x, TARGETS)
    k = adapt(model).num_prefix
    assert torch.equal(dx.attribute(x, TARGETS, output="tokens"), res.tokens[:, k:])
    pix = dx.attribute(x, TARGETS)
    assert pix.shape == x.shape
    pred = dx.decompose(x)  # None -> predicted class
    assert torch.equal(pred.target, model(x).argmax(-1))


def test_max_memory_chunking_gives_the_same_numbers():
    model, x = make_model("vit"), make_inputs("vit")
    ad = adapt(model)
    x0 = ad.embed(x)
    assert sources_per_chunk(ad, x0, None) == 18
    assert sources_per_chunk(ad, x0, 1) == 1
    assert sources_per_chunk(ad, x0, 2 * 3 * 17 * 8 * (2 * 64 + 4 * 32) * 5) == 5
    whole = DecompX(model, route="explicit", max_memory=None).decompose(x, TARGETS)
    for mem in (1, 2 * 3 * 17 * 8 * (2 * 64 + 4 * 32) * 5):  # 1 and 5 sources per pass
        part = DecompX(model, route="explicit", max_memory=mem).decompose(x, TARGETS)
        assert_close_scaled(part.tokens, whole.tokens)
        assert_close_scaled(part.bias, whole.bias, scale=whole.logit.abs().max().item())


@pytest.mark.parametrize("route", ["gradient", "explicit"])
def test_batch_invariance(route):
    model, x = make_model("avgpool"), make_inputs("avgpool")
    dx = DecompX(model, start_layer=1, route=route)
    batch = dx.decompose(x, TARGETS)
    logit_scale = batch.logit.abs().max().item()  # bias = logit - sum(tokens): its scale
    for i in range(3):
        one = dx.decompose(x[i:i + 1], TARGETS[i:i + 1])
        assert_close_scaled(one.tokens[0], batch.tokens[i], scale=logit_scale)
        assert_close_scaled(one.bias[0], batch.bias[i], scale=logit_scale)


def test_model_unchanged_also_on_error():
    model, x = make_model("layerscale"), make_inputs("layerscale")
    model.blocks[0].attn.fused_attn = True
    snap = snapshot(model)
    for route in ("gradient", "explicit"):
        dx = DecompX(model, start_layer=1, route=route)
        dx.attribute(x, TARGETS)
        dx.decompose(x)
        with pytest.raises(ValueError):
            dx.attribute(x, target=[9, 9, 9])
        with pytest.raises(ValueError):
            dx.decompose(x[:, :, :8])
    assert_unchanged(model, snap)


def test_low_precision_accumulates_in_float32():
    model, x = make_model("vit", dtype=torch.bfloat16), make_inputs("vit", dtype=torch.bfloat16)
    for route in ("gradient", "explicit"):
        res = DecompX(model, route=route).decompose(x, TARGETS)
        assert res.tokens.dtype == torch.float32
        assert torch.isfinite(res.tokens).all()


def test_bad_arguments():
    model = make_model("vit")
    with pytest.raises(ValueError, match="route"):
        DecompX(model, route="lrp")
    with pytest.raises(ValueError, match="start_layer"):
        DecompX(model, start_layer=3)
    with pytest.raises(ValueError, match="max_memory"):
        DecompX(model, route="explicit", max_memory=-1)
    with pytest.raises(TypeError, match="max_memory"):
        DecompX(model, route="explicit", max_memory="1GB")
    with pytest.raises(TypeError, match="inputs"):
        DecompX(model).decompose([1.0])
