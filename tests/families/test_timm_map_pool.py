"""Attention-pool heads (timm ``global_pool='map'``, SigLIP-style; SPEC_NEXT §7.3).

Every readout is checked against a slow float64 reference written here from the spec: the
model's own modules run step by step with every attention probability (blocks and pool)
materialised, and each method's formula applied to the full matrices.
"""

from __future__ import annotations

import pytest
import torch

from captum_vit import GAE, AttnGradCAM, DecompX, RawAttention, Rollout, TokenTM
from captum_vit._base import gradients_with_pool
from captum_vit.adapters import adapt
from captum_vit.methods.tokentm import transformation_weights
from tests.helpers import assert_close_scaled, make_inputs, make_model

MAP_FAMILIES = ["map", "map_cls_reg"]


def reference(model, x, target):
    """Eager forward from the model's modules; returns logits, block attentions and the
    pool attention (over all N tokens, 0 at skipped prefix rows), gradients attached."""
    m = model
    h = m.norm_pre(m._pos_embed(m.patch_embed(x)))
    attns = []
    for blk in m.blocks:
        at = blk.attn
        u = blk.norm1(h)
        b, n, d = u.shape
        qkv = at.qkv(u).reshape(b, n, 3, at.num_heads, at.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        a = ((at.q_norm(q) * at.scale) @ at.k_norm(k).transpose(-2, -1)).softmax(-1)
        a.retain_grad()
        attns.append(a)
        h = h + blk.ls1(at.proj((a @ v).transpose(1, 2).reshape(b, n, d)))
        h = h + blk.ls2(blk.mlp(blk.norm2(h)))
    xh = m.norm(h)
    k0 = 0 if m.pool_include_prefix else m.num_prefix_tokens
    p = m.attn_pool
    hd, nh = p.head_dim, p.num_heads
    q = p.q(p.latent).reshape(1, 1, nh, hd).transpose(1, 2)
    kv = p.kv(xh[:, k0:]).reshape(b, -1, 2, nh, hd).permute(2, 0, 3, 1, 4)
    k, v = kv.unbind(0)
    ap = ((q * p.scale) @ k.transpose(-2, -1)).softmax(-1)  # [B, H, 1, N - k0]
    ap.retain_grad()
    o = p.proj((ap @ v).transpose(1, 2).reshape(b, 1, -1))
    o = o + p.mlp(p.norm(o))
    logits = m.head(m.fc_norm(o[:, 0]))
    logits.gather(1, target[:, None]).sum().backward()
    pad = torch.zeros(b, nh, 1, k0, dtype=x.dtype)
    ap_full = torch.cat([pad, ap.detach()], -1)
    gp_full = torch.cat([pad, ap.grad], -1)
    return logits.detach(), attns, ap_full, gp_full, xh.detach()


@pytest.fixture(params=MAP_FAMILIES)
def case(request):
    model = make_model(request.param)
    x = make_inputs(request.param, batch=2)
    target = torch.tensor([1, 3])
    return model, x, target, reference(model, x, target)


def test_adapter_forward_equals_model(case):
    model, x, _, (logits, *_) = case
    a = adapt(model)
    assert a.layout(x).readout == "map"
    assert_close_scaled(a.run(a.embed(x)), model(x))
    assert_close_scaled(logits, model(x))


def test_raw_attention_reads_the_pool(case):
    model, x, t, (_, attns, ap, _, _) = case
    k = adapt(model).num_prefix
    w = ap.mean(1)[:, 0]
    got = RawAttention(model).attribute(x, t, output="tokens")
    assert_close_scaled(got, w[:, k:])
    last = torch.einsum("bn,bnm->bm", w, attns[-1].detach().mean(1))
    got = RawAttention(model, source="last_block").attribute(x, t, output="tokens")
    assert_close_scaled(got, last[:, k:])


def test_rollout_starts_from_the_pool_row(case):
    model, x, t, (_, attns, ap, _, _) = case
    n = ap.shape[-1]
    r = ap.mean(1)[:, 0]
    for a in reversed(attns):
        m = a.detach().mean(1) + torch.eye(n, dtype=a.dtype)
        r = torch.einsum("bn,bnm->bm", r, m / m.sum(-1, keepdim=True))
    k = adapt(model).num_prefix
    assert_close_scaled(Rollout(model).attribute(x, t, output="tokens"), r[:, k:])


def test_gae_treats_the_pool_as_a_layer_without_identity(case):
    model, x, t, (_, attns, ap, gp, _) = case
    n = ap.shape[-1]
    big_r = torch.eye(n, dtype=ap.dtype).expand(x.shape[0], n, n)
    for a in attns:  # R <- R + Ā R, block 0 first (Chefer et al. 2021b)
        abar = (a.grad * a.detach()).clamp(min=0).mean(1)
        big_r = big_r + abar @ big_r
    w = (gp * ap).clamp(min=0).mean(1)[:, 0]
    ref = torch.einsum("bn,bnm->bm", w, big_r)
    k = adapt(model).num_prefix
    assert_close_scaled(GAE(model).attribute(x, t, output="tokens"), ref[:, k:])


def test_attn_gradcam_runs_on_the_pool(case):
    model, x, t, (_, _, ap, gp, _) = case
    k = adapt(model).num_prefix
    g, a = gp[:, :, 0], ap[:, :, 0]  # [B, H, N]
    wh = g[..., k:].mean(-1, keepdim=True)
    ref = (wh * a).mean(1).clamp(min=0)
    assert_close_scaled(AttnGradCAM(model).attribute(x, t, output="tokens"), ref[:, k:])


def test_tokentm_pool_row_uses_pool_transformation_weights(case):
    model, x, t, (_, _, ap, gp, xh) = case
    p = model.attn_pool
    nh, hd = p.num_heads, p.head_dim
    v = torch.nn.functional.linear(xh, p.kv.weight[nh * hd:])  # x̂ W_v (no bias, Eq. 5)
    b, n, _ = v.shape
    wo = p.proj.weight.reshape(-1, nh, hd)
    e_t = torch.einsum("bnhe,dhe->bhnd", v.reshape(b, n, nh, hd), wo)  # x̂ W_v^h W_p^h
    w = torch.stack([transformation_weights(xh, e_t[:, h]) for h in range(nh)], 1)
    u = (gp.relu() * ap)[:, :, 0]  # [B, H, N]
    ref = (u * w).mean(1)
    tm = TokenTM(model)
    tr = tm.adapter.trace(x, grad=True)
    _, pool_grad = gradients_with_pool(tr, tr.logits.gather(1, t[:, None])[:, 0], [])
    got = tm._readout(tr, pool_grad, torch.float64, tr.logits.argmax(-1))
    assert_close_scaled(got, ref)


@pytest.mark.parametrize("route", ["explicit", "gradient"])
def test_decompx_is_complete_through_the_pool(case, route):
    model, x, t, (logits, *_) = case
    res = DecompX(model, route=route).decompose(x, t)
    y = logits.gather(1, t[:, None])[:, 0]
    torch.testing.assert_close(res.tokens.sum(-1) + res.bias, y, rtol=0, atol=1e-10)


def test_decompx_routes_agree_through_the_pool(case):
    model, x, t, _ = case
    ex = DecompX(model, route="explicit").decompose(x, t)
    gr = DecompX(model, route="gradient").decompose(x, t)
    torch.testing.assert_close(gr.tokens, ex.tokens, rtol=0, atol=1e-10)


def test_true_token_removal_pools_over_the_kept_tokens(case):
    model, x, _, _ = case
    a = adapt(model)
    keep = torch.tensor([[0, 5, 9], [2, 3, 15]])
    got = a.run(a.embed(x), keep=keep)
    m = model  # by hand: kept tokens through the model's own blocks and pool
    h = m._pos_embed(m.patch_embed(x))
    k = m.num_prefix_tokens
    idx = torch.cat([torch.arange(k).expand(2, k), k + keep], 1)
    h = torch.gather(h, 1, idx[..., None].expand(-1, -1, h.shape[-1]))
    for blk in m.blocks:
        h = blk(h)
    ref = m.forward_head(m.norm(h))
    assert_close_scaled(got, ref)
