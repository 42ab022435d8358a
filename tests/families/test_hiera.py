"""Hiera (timm ``Hiera``, Hugging Face ``HieraForImageClassification`` / ``HieraModel``):
forward parity, the timm ↔ Hugging Face twin, the query pooling and mask units against
references written here, DecompX's completeness, bad inputs and refusals by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from captum_vit.adapters import adapt, catalog
from captum_vit.adapters.windows import QueryPool, pool_tokens
from captum_vit.methods.decompx import DecompX
from captum_vit.methods.table import pooling_methods
from captum_vit.registry import build_method
from tests.helpers import assert_unchanged, needs_transformers, snapshot

pytestmark = needs_transformers

FAST = {"rise": {"n_masks": 16}, "vit_cx": {}, "scorecam": {}, "bt_h": {"n_steps": 3},
        "bt_t": {"n_steps": 3}, "tam": {"n_steps": 3}}


def _model(name: str):
    _, ex = catalog.example(name)
    return ex.model(), ex.inputs(2)


@pytest.mark.parametrize("name", ["timm_hiera", "timm_hiera_mu", "hf_hiera", "hf_hiera_model"])
def test_forward_parity(name):
    """The canonical forward (raster order, windows, query pooling) equals the model's own
    (unrolled) forward in float64."""
    model, x = _model(name)
    a = adapt(model)
    with torch.no_grad():
        ref = a.model_outputs(x)
        ours = a.run(a.embed(x))
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    # the geometry read from the blocks: an 8x8 grid pooled twice
    assert [b.window.grid for b in a.blocks] == [(8, 8), (8, 8), (4, 4), (4, 4)]
    assert [b.pool is not None for b in a.blocks] == [False, True, False, True]
    assert a.stages.hierarchical and a.stages.has_windows


def test_twin_maps_equal():
    """timm ↔ Hugging Face with copied weights: the same logits and, for every registered
    method that runs through query pooling, the same maps (1e-10)."""
    from captum_vit.adapters.families.hiera import hf_hiera_twin

    mu, x = _model("timm_hiera_mu")  # mask units in the pooling block and stage 2 too
    with torch.no_grad():
        torch.testing.assert_close(hf_hiera_twin(mu)(pixel_values=x).logits, mu(x), rtol=0,
                                   atol=1e-12)
    tm, x = _model("timm_hiera")
    hf, _ = _model("hf_hiera")
    with torch.no_grad():
        torch.testing.assert_close(hf(pixel_values=x).logits, tm(x), rtol=0, atol=1e-12)
    t = torch.tensor([1, 3])
    methods = pooling_methods()
    assert {"decompx", "token_ixg", "cp_lrp", "attnlrp", "gradcam", "rollout", "gae",
            "gradsam", "raw_attention"} <= set(methods)
    for name in methods:
        kw = FAST.get(name, {})
        a = build_method(name, tm).attribute(x, target=t, output="tokens", **kw)
        b = build_method(name, hf).attribute(x, target=t, output="tokens", **kw)
        assert a.shape == (2, 64) and torch.isfinite(a).all(), name
        torch.testing.assert_close(b, a, rtol=0, atol=1e-10 * (1 + a.abs().max().item()),
                                   msg=name)


def test_query_pool_reference():
    """Query pooling equals a 2x2 max pool of the grid; the merge weights are each child's
    share of the channels where it is the maximum (¼ each on exact ties)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 36, 5, generator=g, dtype=torch.float64)
    ref = F.max_pool2d(x.reshape(2, 6, 6, 5).permute(0, 3, 1, 2), 2)
    torch.testing.assert_close(pool_tokens(x, (6, 6)),
                               ref.permute(0, 2, 3, 1).reshape(2, 9, 5), rtol=0, atol=0)
    pool = QueryPool(grid=(6, 6), weight=torch.zeros(5, 5, dtype=torch.float64))
    shares = pool.shares(x)
    torch.testing.assert_close(shares.sum(-1), torch.ones(2, 9, dtype=torch.float64))
    kids = x[:, pool.children()]  # [2, 9, 4, 5]
    expect = (kids == kids.amax(2, keepdim=True)).double().mean(-1)
    torch.testing.assert_close(shares, expect)
    tied = pool.shares(torch.ones(1, 36, 5, dtype=torch.float64))
    torch.testing.assert_close(tied, torch.full((1, 9, 4), 0.25, dtype=torch.float64))
    with pytest.raises(ValueError, match="even"):
        QueryPool(grid=(5, 6), weight=pool.weight)


def test_query_pool_gradient_reference():
    """The pooling's gradient equals timm's (``view(B, 4, N/4, C).amax(dim=1)`` on the
    unrolled layout, 2x2 phase first) and, on exact ties, the sub-gradient written here
    (shared equally by the tied children, as ``amax`` shares it), along any token axis
    (the queries' ``[B, H, N, d]`` too)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 48, 5, generator=g, dtype=torch.float64, requires_grad=True)
    up = torch.randn(2, 12, 5, generator=g, dtype=torch.float64)
    (ours,) = torch.autograd.grad(pool_tokens(x, (6, 8)), x, up)
    unrolled = x.reshape(2, 3, 2, 4, 2, 5).permute(0, 2, 4, 1, 3, 5).reshape(2, 48, 5)
    timm = unrolled.view(2, 4, 12, 5).amax(dim=1)
    (ref,) = torch.autograd.grad(timm, x, up)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    # ties (1, 2, 3 or 4 maximal children per channel) on the third axis of [B, H, N, d]
    t = torch.randint(0, 3, (2, 3, 16, 4), generator=g).double().requires_grad_()
    up = torch.randn(2, 3, 4, 4, generator=g, dtype=torch.float64)
    pooled = pool_tokens(t, (4, 4), dim=2)
    (ours,) = torch.autograd.grad(pooled, t, up)
    kids = t.detach().reshape(2, 3, 2, 2, 2, 2, 4).permute(0, 1, 2, 4, 3, 5, 6)
    kids = kids.reshape(2, 3, 4, 4, 4)  # [B, H, N', child, d]
    top = (kids == kids.amax(3, keepdim=True)).double()
    assert {1.0, 2.0, 3.0, 4.0} <= set(top.sum(3).unique().tolist())
    torch.testing.assert_close(pooled, kids.amax(3), rtol=0, atol=0)
    share = (up[:, :, :, None] * top / top.sum(3, keepdim=True)).reshape(2, 3, 2, 2, 2, 2, 4)
    torch.testing.assert_close(ours, share.permute(0, 1, 2, 4, 3, 5, 6).reshape(2, 3, 16, 4),
                               rtol=0, atol=1e-15)


def test_pooling_block_attention_dense_reference():
    """The pooling block's mask-unit attention against a dense reference written here:
    queries max-pooled on the grid, keys masked to the query's mask unit."""
    model, x = _model("timm_hiera_mu")
    a = adapt(model)
    p = a.blocks[1]  # pools; mask units of 4x4 input tokens
    with torch.no_grad():
        u = F.layer_norm(a.run(a.embed(x), 0, 1), (8,), p.norm1.weight, p.norm1.bias,
                         p.norm1.eps)
        mix, probs = p.attention(u, materialize=True)
        h, d = p.num_heads, p.head_dim
        q = F.linear(u, p.q_weight, p.q_bias)
        q = F.max_pool2d(q.reshape(2, 8, 8, -1).permute(0, 3, 1, 2), 2)
        q = q.permute(0, 2, 3, 1).reshape(2, 16, h, d).transpose(1, 2)
        k = F.linear(u, p.k_weight, p.k_bias).reshape(2, 64, h, d).transpose(1, 2)
        v = F.linear(u, p.v_weight, p.v_bias).reshape(2, 64, h, d).transpose(1, 2)
        unit_in = (torch.arange(8)[:, None] // 4 * 2 + torch.arange(8)[None] // 4).reshape(-1)
        unit_out = (torch.arange(4)[:, None] // 2 * 2 + torch.arange(4)[None] // 2).reshape(-1)
        logits = (q * p.scale) @ k.transpose(-1, -2)
        logits = logits.masked_fill(unit_out[:, None] != unit_in[None], float("-inf"))
        dense = logits.softmax(-1)
        ref = (dense @ v).transpose(1, 2).reshape(2, 16, -1)
    torch.testing.assert_close(mix, ref, rtol=0, atol=1e-12)
    assert probs.shape == (2, h, 4, 4, 16)  # [B, H, n_W, M/4, M]


@pytest.mark.parametrize("name", ["timm_hiera", "timm_hiera_mu"])
def test_decompx_complete(name):
    """DecompX through query pooling (each channel its maximal child's decomposition):
    tokens + bias = the logit, the explicit route equal to the gradient route."""
    model, x = _model(name)
    t = torch.tensor([0, 4])
    grad = DecompX(model).decompose(x, target=t)
    expl = DecompX(model, route="explicit").decompose(x, target=t)
    with torch.no_grad():
        logit = model(x).gather(1, t[:, None])[:, 0]
    torch.testing.assert_close(expl.tokens.sum(-1) + expl.bias, logit, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad.tokens, expl.tokens, rtol=0, atol=1e-12)


def test_bad_inputs_and_refusals():
    """A size that is not a multiple of the mask unit, another size, and a method reading
    token-mixing matrices: clear errors by name; the model unchanged."""
    model, x = _model("timm_hiera")
    before = snapshot(model)
    method = build_method("token_ixg", model)
    bad = torch.zeros(1, 3, 36, 36, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"\(36, 36\) is not a multiple of .*mask unit of "
                                         r"16x16 pixels"):
        method.attribute(bad, target=0)
    with pytest.raises(ValueError, match=r"\(48, 48\) does not match"):
        method.attribute(torch.zeros(1, 3, 48, 48, dtype=torch.float64), target=0)
    from captum_vit.methods.tokentm import TokenTM

    class Unpooled(TokenTM):  # a method that does not declare the query pooling
        pools_queries = False

    with pytest.raises(ValueError, match="Unpooled") as err:
        Unpooled(model).attribute(x, target=0)
    assert "pools its queries" in str(err.value) and "tokentm" in str(err.value)
    with pytest.raises(ValueError, match="windows"):
        build_method("tis", model).attribute(x, target=0, n_masks=8)
    assert_unchanged(model, before)


def test_plus_over_stages():
    """PLUS and SkipPLUS over the stages: each base's fast path (one pass, every start
    block's map carried to the first grid through the pooling) equals the sum of the base
    run on each sub-network (``fast=False``), and gradient bases give maps on the first
    grid."""
    from captum_vit.combinators import PLUS, SkipPLUS

    model, x = _model("timm_hiera")
    t = torch.tensor([1, 2])
    for name in ("plus:ixg", "skipplus:captum:Saliency"):
        out = build_method(name, model).attribute(x, target=t, output="tokens")
        assert out.shape == (2, 64) and torch.isfinite(out).all()
    for cls, base in ((SkipPLUS, "attnlrp"), (SkipPLUS, "decompx"), (SkipPLUS, "gae"),
                      (SkipPLUS, "chefer21"), (PLUS, "rollout"), (SkipPLUS, "tokentm"),
                      (SkipPLUS, "tokentm_residual"), (SkipPLUS, "globenc"),
                      (PLUS, "alti"), (SkipPLUS, "bt_t")):
        fast = cls(model, base).attribute(x, target=t, output="tokens")
        slow = cls(model, base, fast=False).attribute(x, target=t, output="tokens")
        torch.testing.assert_close(fast, slow, rtol=0, atol=1e-12, msg=f"{cls.__name__} {base}")


def _dense_blocks(model, x):
    """Per block the dense head-mean attention ``Ā`` [B, N_out, N_in] and the residual's
    token mixing ``R`` (the identity, or each pooled token's children's share of the
    channels where they are the maximum) from the trace's LN1 states, written here with
    a mask over mask units (independent of the windowed engine)."""
    a = adapt(model)
    tr = a.trace(x)
    out = []
    for p, rec in zip(a.blocks, tr.blocks, strict=True):
        u = rec.u
        b, n, _ = u.shape
        (gh, gw), (mh, mw) = p.window.grid, p.window.size
        h, d = p.num_heads, p.head_dim
        q = F.linear(u, p.q_weight, p.q_bias)
        iy, ix = torch.arange(gh).repeat_interleave(gw), torch.arange(gw).repeat(gh)
        unit_in = (iy // mh) * 1000 + ix // mw
        unit_out, oh, ow, nq = unit_in, gh, gw, n
        if p.pool is not None:
            q = F.max_pool2d(q.reshape(b, gh, gw, -1).permute(0, 3, 1, 2), 2)
            q = q.permute(0, 2, 3, 1).reshape(b, -1, h * d)
            oh, ow = gh // 2, gw // 2
            nq = oh * ow
            oy, ox = torch.arange(oh).repeat_interleave(ow), torch.arange(ow).repeat(oh)
            unit_out = (oy // (mh // 2)) * 1000 + ox // (mw // 2)
        q = q.reshape(b, nq, h, d).transpose(1, 2)
        k = F.linear(u, p.k_weight, p.k_bias).reshape(b, n, h, d).transpose(1, 2)
        logits = (q * p.scale) @ k.transpose(-1, -2)
        logits = logits.masked_fill(unit_out[:, None] != unit_in[None], float("-inf"))
        mean = logits.softmax(-1).mean(1)
        if p.pool is None:
            res = torch.eye(n, dtype=u.dtype).expand(b, n, n)
        else:
            vals = F.linear(u, p.pool.weight, p.pool.bias).reshape(b, oh, 2, ow, 2, -1)
            top = (vals == vals.amax(dim=(2, 4), keepdim=True)).double()
            share = (top / top.sum(dim=(2, 4), keepdim=True)).mean(-1)  # [b, oh, 2, ow, 2]
            res = torch.zeros(b, oh, ow, gh, gw, dtype=u.dtype)
            for dy in range(2):
                for dx in range(2):
                    res[:, torch.arange(oh)[:, None], torch.arange(ow)[None],
                        2 * torch.arange(oh)[:, None] + dy, 2 * torch.arange(ow)[None] + dx] = \
                        share[:, :, dy, :, dx]
            res = res.reshape(b, nq, n)
        out.append((mean, res))
    return out


def _upsample(v, grid, factor):
    """Token values [B, h w] copied to the ``factor``-times finer grid."""
    b = v.shape[0]
    up = v.reshape(b, *grid).repeat_interleave(factor, 1).repeat_interleave(factor, 2)
    return up.reshape(b, -1)


@pytest.mark.parametrize("name", ["timm_hiera", "timm_hiera_mu"])
def test_rollout_and_raw_attention_dense_reference(name):
    """Rollout as a vector chain through mask units and query pooling equals the dense
    product of ``(Ā_l + R_l) / rowsum`` (R_l: the identity, or the pooling's child shares);
    raw attention is the readout row of the last block's ``Ā``, copied to the first grid."""
    model, x = _model(name)
    blocks = _dense_blocks(model, x)
    with torch.no_grad():
        v = torch.full((2, 4), 0.25, dtype=torch.float64)  # mean readout of the 2x2 grid
        raw = torch.einsum("bi,bij->bj", v, blocks[-1][0])  # [2, 16] on the 4x4 grid
        for mean, res in reversed(blocks):
            m = mean + res
            v = torch.einsum("bi,bij->bj", v, m / m.sum(-1, keepdim=True))
    got = build_method("rollout", model).attribute(x, target=0, output="tokens")
    torch.testing.assert_close(got, v, rtol=0, atol=1e-12)
    got = build_method("raw_attention", model).attribute(x, target=0, output="tokens")
    torch.testing.assert_close(got, _upsample(raw, (4, 4), 2), rtol=0, atol=1e-12)


def test_pool_mix_is_the_unmerge_with_shares():
    """The pooling's token mixing in window form (Stages.residual_mix) applied to a row
    vector of the pooled grid equals sharing each value among its children by the
    shares."""
    model, x = _model("timm_hiera_mu")
    a = adapt(model)
    tr = a.trace(x)
    st = a.stages
    for l, rec in enumerate(tr.blocks):
        if rec.pool_shares is None:
            continue
        v = torch.randn(2, rec.pool_shares.shape[1], dtype=torch.float64)
        mix = st.residual_mix(l, 0, torch.float64, shares=rec.pool_shares)
        kids = a.blocks[l].pool.children()
        ref = torch.zeros(2, a.blocks[l].pool.grid[0] * a.blocks[l].pool.grid[1],
                          dtype=torch.float64)
        for c in range(4):
            ref[:, kids[:, c]] += v * rec.pool_shares[:, :, c]
        torch.testing.assert_close(st.token_mix(v, mix, l), ref, rtol=0, atol=1e-14)


def _pool2(t, grid):
    """``F.max_pool2d`` of token states [B, h w, C] on the ``grid``: [B, h w / 4, C]."""
    b, (gh, gw) = t.shape[0], grid
    t = F.max_pool2d(t.reshape(b, gh, gw, -1).permute(0, 3, 1, 2), 2)
    return t.permute(0, 2, 3, 1).reshape(b, (gh // 2) * (gw // 2), -1)


def _dense_forward(model, x, record=None):
    """An independent dense forward of a Hiera (raster order, a mask over mask units,
    ``F.max_pool2d`` for the query pooling) from the model's embedding and parameters:
    the logits, each block's probabilities ``A`` [B, H, N_out, N_in] (in the graph, for
    ``∂s/∂A``), the residual's dense token mixing ``R`` and the block inputs ``x_l``.
    ``record`` (a dict) receives per block lists ``u`` (LN1), ``pre`` (the residual's
    projection before the maximum, ``None`` without pooling), ``mid``, ``f`` (the MLP
    branch) and ``out``, and ``readout`` (the head as a function of the last state)."""
    a = adapt(model)
    _, res_mix = zip(*_dense_blocks(model, x), strict=True)
    h_ = a.embed(x)
    probs, states = [], []
    for p in a.blocks:
        states.append(h_)
        b, n, c = h_.shape
        (gh, gw), (mh, mw) = p.window.grid, p.window.size
        heads, d = p.num_heads, p.head_dim
        u = F.layer_norm(h_, (c,), p.norm1.weight, p.norm1.bias, p.norm1.eps)
        q = F.linear(u, p.q_weight, p.q_bias)
        iy, ix = torch.arange(gh).repeat_interleave(gw), torch.arange(gw).repeat(gh)
        unit_in = (iy // mh) * 1000 + ix // mw
        unit_out, res = unit_in, h_
        if p.pool is not None:
            q = _pool2(q, (gh, gw))
            res = _pool2(F.linear(u, p.pool.weight, p.pool.bias), (gh, gw))
            oy = torch.arange(gh // 2).repeat_interleave(gw // 2)
            ox = torch.arange(gw // 2).repeat(gh // 2)
            unit_out = (oy // (mh // 2)) * 1000 + ox // (mw // 2)
        nq = q.shape[1]
        q = q.reshape(b, nq, heads, d).transpose(1, 2)
        k = F.linear(u, p.k_weight, p.k_bias).reshape(b, n, heads, d).transpose(1, 2)
        v = F.linear(u, p.v_weight, p.v_bias).reshape(b, n, heads, d).transpose(1, 2)
        logits = ((q * p.scale) @ k.transpose(-1, -2)).masked_fill(
            unit_out[:, None] != unit_in[None], float("-inf"))
        attn = logits.softmax(-1)
        probs.append(attn)
        o = (attn @ v).transpose(1, 2).reshape(b, nq, heads * d)
        mid = res + F.linear(o, p.proj_weight, p.proj_bias)
        u2 = F.layer_norm(mid, (mid.shape[-1],), p.norm2.weight, p.norm2.bias, p.norm2.eps)
        f = F.linear(p.act(F.linear(u2, p.fc1_weight, p.fc1_bias)), p.fc2_weight, p.fc2_bias)
        h_ = mid + f
        if record is not None:
            pre = None if p.pool is None else F.linear(u, p.pool.weight, p.pool.bias)
            for key, val in (("u", u), ("pre", pre), ("mid", mid), ("f", f), ("out", h_)):
                record.setdefault(key, []).append(val)
    fc = a.head.fc_norm
    _, weight, bias = a.head.heads[0]

    def readout(state):
        z = F.layer_norm(state.mean(1), (state.shape[-1],), fc.weight, fc.bias, fc.eps)
        return F.linear(z, weight, bias)

    if record is not None:
        record["readout"] = readout
    return readout(h_), probs, list(res_mix), states


@pytest.mark.parametrize("name", ["timm_hiera", "timm_hiera_mu"])
def test_gae_dense_reference(name):
    """GAE (Chefer et al. 2021b) as a vector chain ``v (R_l + Ā_l)``, ``Ā_l = mean_h
    ReLU(∂s/∂A_l ⊙ A_l)``, through mask units and query pooling, against the dense
    reference forward's own probabilities and their gradients."""
    model, x = _model(name)
    t = torch.tensor([1, 3])
    logits, probs, res_mix, _ = _dense_forward(model, x)
    with torch.no_grad():
        torch.testing.assert_close(logits, model(x), rtol=0, atol=1e-12)
    grads = torch.autograd.grad(logits.gather(1, t[:, None]).sum(), probs)
    with torch.no_grad():
        v = torch.full((2, 4), 0.25, dtype=torch.float64)
        for a_, g, r in reversed(list(zip(probs, grads, res_mix, strict=True))):
            abar = (g * a_).clamp(min=0).mean(1)
            v = torch.einsum("bi,bij->bj", v, r + abar)
    got = build_method("gae", model).attribute(x, target=t, output="tokens")
    torch.testing.assert_close(got, v, rtol=0, atol=1e-12)


def test_gradsam_dense_reference():
    """Grad-SAM: the sum over blocks of ``w_l Ā_l``, the readout carried down through the
    later blocks' pooling with ¼ shares and each map carried to the first grid sharing ¼
    per child (as through Swin's merges), against the dense reference."""
    model, x = _model("timm_hiera")
    t = torch.tensor([2, 0])
    logits, probs, _, _ = _dense_forward(model, x)
    grads = torch.autograd.grad(logits.gather(1, t[:, None]).sum(), probs)
    a = adapt(model)
    grids = [b.window.grid for b in a.blocks] + [(2, 2)]

    def down(v, grid):  # ¼ of a pooled token's value to each child
        return _upsample(v, grid, 2) / 4

    total = torch.zeros(2, 64, dtype=torch.float64)
    with torch.no_grad():
        for l, (a_, g) in enumerate(zip(probs, grads, strict=True)):
            w = torch.full((2, 4), 0.25, dtype=torch.float64)
            for k in reversed(range(l + 1, len(probs))):
                if a.blocks[k].pool is not None:
                    w = down(w, grids[k + 1])
            m = torch.einsum("bi,bij->bj", w, (g * a_).clamp(min=0).mean(1))
            for k in reversed(range(l)):
                if a.blocks[k].pool is not None:
                    m = down(m, grids[k + 1])
            total += m
    got = build_method("gradsam", model).attribute(x, target=t, output="tokens")
    torch.testing.assert_close(got, total, rtol=0, atol=1e-12)


def test_attn_grad_dense_reference():
    """AttnGrad at the last block (a pooling block: its rows are the final 2x2 grid, its
    keys the 4x4 grid, copied to the first grid) and at block 1 (the readout carried down
    through block 3's pooling with ¼ shares), against the dense reference."""
    model, x = _model("timm_hiera")
    t = torch.tensor([4, 1])
    logits, probs, _, _ = _dense_forward(model, x)
    grads = torch.autograd.grad(logits.gather(1, t[:, None]).sum(), probs)
    w = torch.full((2, 4), 0.25, dtype=torch.float64)
    with torch.no_grad():
        last = _upsample(torch.einsum("bi,bij->bj", w, grads[3].mean(1)), (4, 4), 2)
        w1 = _upsample(w, (2, 2), 2) / 4
        # block 1 attends within mask units: the pairs across units are no entries of its
        # (block-diagonal) matrix, whose gradient has none there
        inside = (probs[1] > 0).double()
        one = torch.einsum("bi,bij->bj", w1, (grads[1] * inside).mean(1))
    for layer, ref in ((None, last), (1, one)):
        got = build_method("attn_grad", model)
        got = type(got)(model, layer=layer).attribute(x, target=t, output="tokens")
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)


def test_attcat_dense_reference():
    """AttCAT = Σ_l α_l ⊙ cat_l (and AttIxG, one term): the attention each key token of
    block l receives (mean over heads and the block's queries, N/4 for a pooling block)
    times token IxG of x_l, each carried to the first grid (α copied, cat shared ¼ per
    child), against the dense reference."""
    model, x = _model("timm_hiera_mu")
    t = torch.tensor([3, 2])
    logits, probs, _, states = _dense_forward(model, x)
    grads = torch.autograd.grad(logits.gather(1, t[:, None]).sum(), states)
    a = adapt(model)
    grids = [b.window.grid for b in a.blocks]
    terms = []
    with torch.no_grad():
        for l, (p_, x_, g) in enumerate(zip(probs, states, grads, strict=True)):
            alpha, cat = p_.mean(dim=(1, 2)), (x_ * g).sum(-1)
            for k in reversed(range(l)):
                if a.blocks[k].pool is not None:
                    alpha = _upsample(alpha, grids[k + 1], 2)
                    cat = _upsample(cat, grids[k + 1], 2) / 4
            terms.append(alpha * cat)
    got = build_method("attcat", model).attribute(x, target=t, output="tokens")
    torch.testing.assert_close(got, sum(terms), rtol=0, atol=1e-12)
    one = build_method("att_ixg", model)
    got = type(one)(model, layer=1).attribute(x, target=t, output="tokens")
    torch.testing.assert_close(got, terms[1], rtol=0, atol=1e-12)


def test_attn_gradcam_dense_reference():
    """Attention Grad-CAM on the last block (a pooling block: readout rows on the final
    grid, keys on the 4x4 grid), against the dense reference."""
    model, x = _model("timm_hiera")
    t = torch.tensor([0, 2])
    logits, probs, _, _ = _dense_forward(model, x)
    (grad,) = torch.autograd.grad(logits.gather(1, t[:, None]).sum(), probs[3])
    w = torch.full((2, 4), 0.25, dtype=torch.float64)
    with torch.no_grad():
        g_r = torch.einsum("bi,bhij->bhj", w, grad)
        a_r = torch.einsum("bi,bhij->bhj", w, probs[3])
        ref = (g_r.mean(-1, keepdim=True) * a_r).mean(1).clamp(min=0)
    got = build_method("attn_gradcam", model).attribute(x, target=t, output="tokens")
    torch.testing.assert_close(got, _upsample(ref, (4, 4), 2), rtol=0, atol=1e-12)


def _window_to_dense(m, grid, unit, pooled):
    """A window-form matrix [B, H, n_W, M_out, M_in] of mask units of side ``unit`` on the
    input ``grid`` (queries on the half grid when ``pooled``) as the dense [B, H, N_out,
    N_in], zero across units (written here from the raster geometry)."""
    gh, gw = grid
    uo = unit // 2 if pooled else unit
    oh, ow = (gh // 2, gw // 2) if pooled else (gh, gw)
    oy, ox = torch.arange(oh).repeat_interleave(ow), torch.arange(ow).repeat(oh)
    iy, ix = torch.arange(gh).repeat_interleave(gw), torch.arange(gw).repeat(gh)
    w_out = (oy // uo) * (gw // unit) + ox // uo
    s_out = (oy % uo) * uo + ox % uo
    w_in = (iy // unit) * (gw // unit) + ix // unit
    s_in = (iy % unit) * unit + ix % unit
    dense = m[:, :, w_out[:, None], s_out[:, None], s_in[None, :]]
    return dense * (w_out[:, None] == w_in[None, :]).to(m.dtype)


def test_chefer21_chain_dense_reference():
    """Chefer'21's vector chain ``v (R_l + Ā_l)``, ``Ā_l = mean_h ReLU(∇A_l ⊙ R^{A_l})``,
    through mask units and query pooling equals the dense product of the same per-block
    matrices (the engine's LRP pass; the residual R_l the pooling's child shares)."""
    from captum_vit.methods.chefer import chefer_pass

    model, x = _model("timm_hiera_mu")
    a = adapt(model)
    t = torch.tensor([1, 4])
    tr, _, grads, rel, _, _ = chefer_pass(a, x, t)
    res_mix = [r for _, r in _dense_blocks(model, x)]
    v = torch.full((2, 4), 0.25, dtype=torch.float64)
    with torch.no_grad():
        for k in reversed(range(len(a.blocks))):
            p = a.blocks[k]
            abar = _window_to_dense((grads[k] * rel[k]).clamp(min=0), p.window.grid,
                                    p.window.size[0], p.pool is not None).mean(1)
            v = torch.einsum("bi,bij->bj", v, res_mix[k] + abar)
    got = build_method("chefer21", model).attribute(x, target=t, output="tokens")
    torch.testing.assert_close(got, v, rtol=0, atol=1e-12)


def test_tam_dense_reference():
    """TAM with the plain gradient: ``σ = w Ā_{L-1} (R_{L-2} + Ā_{L-2}) ⋯ (R_0 + Ā_0)``
    (R: the identity or the pooling's child shares) times ``ω = w mean_h ReLU(∇A_{L-1})``
    copied to the first grid, against the dense reference."""
    from captum_vit.methods.tam import TAM

    model, x = _model("timm_hiera")
    t = torch.tensor([3, 0])
    logits, probs, res_mix, _ = _dense_forward(model, x)
    (grad,) = torch.autograd.grad(logits.gather(1, t[:, None]).sum(), probs[3])
    w = torch.full((2, 4), 0.25, dtype=torch.float64)
    with torch.no_grad():
        omega = torch.einsum("bi,bij->bj", w, grad.clamp(min=0).mean(1))  # on 4x4
        sigma = torch.einsum("bi,bij->bj", w, probs[3].mean(1))
        for k in reversed(range(3)):
            sigma = torch.einsum("bi,bij->bj", sigma, res_mix[k] + probs[k].mean(1))
        ref = sigma * _upsample(omega, (4, 4), 2)
    got = TAM(model, integrated=False, start_layer=0).attribute(x, target=t, output="tokens")
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
