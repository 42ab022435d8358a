"""Hiera: the chains of TokenTM (both variants), BT-H / BT-T, GlobEnc / ALTI and LeGrad
through mask units and query pooling, each against a slow dense reference written here
(dense token-mixing matrices, the pooling as an explicit ``[N/4, N]`` matrix of each
child's share of the channels where it is the maximum, SPEC_FRONTIER §15.5), float64 on
the tiny timm examples."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from captum_vit.adapters import adapt, catalog
from captum_vit.methods.bt import BTH, BTT
from captum_vit.methods.globenc_alti import ALTI, GlobEnc
from captum_vit.methods.legrad import LeGrad
from captum_vit.methods.table import pooling_methods
from captum_vit.methods.tokentm import TokenTM
from captum_vit.registry import available_methods
from tests.families.test_hiera import _dense_forward, _upsample
from tests.helpers import needs_transformers

pytestmark = needs_transformers

EPS = 1e-8


def _model(name: str = "timm_hiera_mu", **overrides):
    _, ex = catalog.example(name)
    return ex.model(**overrides), ex.inputs(2)


def _tw(e, et):
    """TokenTM's transformation weights (Eq. 12-13) written from the paper: NECC the
    softmax over the tokens of cos(E_i, Ẽ_i), times L(Ẽ_i) / (L(E_i) + ε)."""
    necc = F.cosine_similarity(e, et, dim=-1, eps=EPS).softmax(-1)
    return et.norm(dim=-1) / (e.norm(dim=-1) + EPS) * necc


def _grids(model):
    return [b.window.grid for b in adapt(model).blocks]


def _parent(grid):
    """The pooled token of each token of ``grid`` (raster order): [h w]."""
    h, w = grid
    y, x = torch.arange(h).repeat_interleave(w), torch.arange(w).repeat(h)
    return (y // 2) * (w // 2) + x // 2


def test_every_method_but_tis_runs_through_pooling():
    """The registry's methods all carry query pooling but TIS (true token removal, which
    the mask units refuse by name as windows do)."""
    assert set(available_methods()) - set(pooling_methods()) == {"tis"}


@pytest.mark.parametrize("variant", ["paper", "residual"])
def test_tokentm_dense_reference(variant):
    """TokenTM's row chain ``r U_ffn U_attn`` through query pooling against the dense
    reference: ``U_attn = R + mean_h[ReLU(∇A^h) ⊙ A^h W^h]`` (paper; R the pooling's
    child shares, E the residual's projection before the maximum) or ``R + (Ā ⊙ mean_h
    ReLU(∇A^h)) W_attn`` (residual), ``C_0 = diag(L(x_0))``."""
    model, x = _model()
    a = adapt(model)
    t = torch.tensor([1, 4])
    rec: dict = {}
    logits, probs, res_mix, states = _dense_forward(model, x, rec)
    score = "probability" if variant == "paper" else "logit"
    s = logits.softmax(-1) if score == "probability" else logits
    grads = torch.autograd.grad(s.gather(1, t[:, None]).sum(), probs)
    grids = _grids(model)
    with torch.no_grad():
        r = torch.full((2, 4), 0.25, dtype=torch.float64)
        for l in reversed(range(len(probs))):
            p = a.blocks[l]
            mid, f, out, u, pre = (rec[k][l] for k in ("mid", "f", "out", "u", "pre"))
            e = states[l] if pre is None else pre
            g = grads[l].clamp(min=0)
            if variant == "paper":
                r = r * (1 + _tw(mid, f))
                b, n, _ = u.shape
                v = F.linear(u, p.v_weight).reshape(b, n, p.num_heads, p.head_dim)
                wo = p.proj_weight.reshape(-1, p.num_heads, p.head_dim)
                et = torch.einsum("bnhd,ehd->bhne", v, wo)  # Ẽ^h, biases excluded
                w = _tw(e[:, None], et)  # [B, H, N]
                rh = torch.einsum("bi,bhij->bhj", r, g * probs[l])
                r = torch.einsum("bi,bij->bj", r, res_mix[l]) + (rh * w).mean(1)
            else:
                r = r * (1 + _tw(mid, out))
                up = mid if pre is None else mid[:, _parent(grids[l])]
                w = _tw(e, up)
                m = probs[l].mean(1) * g.mean(1)
                r = torch.einsum("bi,bij->bj", r, res_mix[l]) \
                    + torch.einsum("bi,bij->bj", r, m) * w
        ref = r * states[0].norm(dim=-1)
    got = TokenTM(model, variant=variant).attribute(x, target=t, score=score,
                                                    output="tokens")
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12 * (1 + ref.abs().max().item()))


def _feedback(model, x, t, n_steps):
    """BT's reasoning feedback from the dense forward: the path mean of ``∂s/∂A_{L-1}``
    at ``α X`` (the entries of the mask-unit matrix), ReLU per head, head mean."""
    total = 0
    for alpha in torch.linspace(0, 1, n_steps, dtype=torch.float64):
        logits, probs, _, _ = _dense_forward(model, x * alpha)
        (g,) = torch.autograd.grad(logits.gather(1, t[:, None]).sum(), probs[-1])
        total = total + g * (probs[-1] > 0)
    return (total / n_steps).clamp(min=0).mean(1)


@pytest.mark.parametrize("variant,start", [("head", 0), ("head", 2), ("token", 0)])
def test_bt_dense_reference(variant, start):
    """BT-H / BT-T: ``m = w (W ⊙ R)`` with ``R = Π (R_k + Â_k)`` from block ``start`` (R_k
    the pooling's child shares), ``W`` on the last (pooling, mask-unit) block's pooled
    rows, its columns copied down to ``x_start``'s grid; a map on a later grid shared ¼
    per child onto the first grid; against the dense reference."""
    model, x = _model()
    a = adapt(model)
    t = torch.tensor([2, 0])
    logits, probs, res_mix, states = _dense_forward(model, x)
    grads = torch.autograd.grad(logits.gather(1, t[:, None]).sum(), probs)
    feedback = _feedback(model, x, t, 3)  # [B, 4, 16]
    grids = _grids(model)
    L = len(probs)
    with torch.no_grad():
        v = torch.eye(4, dtype=torch.float64).expand(2, 4, 4)
        for k in reversed(range(start, L)):
            p, a_ = a.blocks[k], probs[k]
            if variant == "head":
                g = grads[k] * (a_ > 0)  # the mask-unit matrix's entries
                ih = (a_.transpose(-1, -2) @ g).abs().sum(dim=(-1, -2))
                ih = ih / ih.sum(1, keepdim=True)
                hat = (ih[..., None, None] * a_).sum(1)
            else:
                u = F.layer_norm(states[k], (states[k].shape[-1],), p.norm1.weight,
                                 p.norm1.bias, p.norm1.eps)
                vo = F.linear(F.linear(u, p.v_weight, p.v_bias), p.proj_weight)
                o = vo.norm(dim=-1) / states[k].norm(dim=-1)
                hat = a_.mean(1) * o[:, None, :]
            v = v @ (res_mix[k] + hat)
        if variant == "token":
            v = v.abs()
        w = feedback
        for k in reversed(range(start, L - 1)):  # W's columns onto x_start's grid
            if a.blocks[k].pool is not None:
                w = _upsample(w.reshape(8, -1), grids[k + 1], 2).reshape(2, 4, -1)
        ref = torch.einsum("s,bsn->bn", torch.full((4,), 0.25, dtype=torch.float64), w * v)
        for k in reversed(range(start)):  # a relevance shared ¼ per child
            if a.blocks[k].pool is not None:
                ref = _upsample(ref, grids[k + 1], 2) / 4
    cls = BTH if variant == "head" else BTT
    got = cls(model, start_layer=start, n_steps=3).attribute(x, target=t, output="tokens")
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12 * (1 + ref.abs().max().item()))


def _reset_vectors(model, l, x_l, rec, probs_l):
    """``v_{i←j}`` [B, N_out, N_in, D'] of block ``l``'s reset decomposition with the
    MLP undecomposed (``mlp="ln2"``), written densely: LayerNorms linearised (each
    source centred by its own mean, the real token's σ, γ; β and every bias dropped), the
    query pooling's maximum per channel taken by the maximal child's source (the first on
    ties), ``x_mid,i←j + LN2^lin(x_mid)_{i←j}``."""
    p = adapt(model).blocks[l]
    u, pre, mid = rec["u"][l], rec["pre"][l], rec["mid"][l]
    b, n, _ = u.shape
    src = u if p.norm1.bias is None else u - p.norm1.bias  # γ (x_j − μ_j) / σ_j
    if pre is None:
        res = torch.diag_embed(x_l.transpose(1, 2)).permute(0, 2, 3, 1)  # δ_ij x_j
    else:
        grid = p.pool.grid
        kids = p.pool.children()  # [N', 4] in the pool's child order
        top = pre[:, kids].argmax(2)  # [B, N', D'] index into the 4 children
        which = kids[torch.arange(kids.shape[0])[None, :, None], top]  # input token
        part = F.linear(src, p.pool.weight)  # [B, N, D'], no bias
        res = torch.zeros(b, kids.shape[0], grid[0] * grid[1], part.shape[-1],
                          dtype=part.dtype)
        for j in range(n):
            res[:, :, j] = part[:, j][:, None] * (which == j)
    vals = F.linear(src, p.v_weight).reshape(b, n, p.num_heads, p.head_dim)
    z = torch.einsum("bnhd,ehd->bhne", vals, p.proj_weight.reshape(-1, p.num_heads,
                                                                      p.head_dim))
    xm = res + torch.einsum("bhij,bhje->bije", probs_l, z)
    sigma = (mid.var(-1, unbiased=False) + p.norm2.eps).sqrt()[:, :, None, None]
    ln2 = (xm - xm.mean(-1, keepdim=True)) / sigma * p.norm2.weight
    assert p.ls2 is None
    return xm + ln2


@pytest.mark.parametrize("measure", ["globenc", "alti"])
def test_globenc_alti_dense_reference(measure):
    """GlobEnc / ALTI: per block the row-normalised ``T_l`` of the reset decomposition
    (``N/4`` pooled rows for a pooling block) rolled out with ``T′ = ½ T + ½ R_l`` (R_l
    the pooling's child shares), against the dense decomposition written here; the map
    sums to 1 (rows of T and R do)."""
    model, x = _model()
    rec: dict = {}
    with torch.no_grad():
        _, probs, res_mix, states = _dense_forward(model, x, rec)
        v = torch.full((2, 4), 0.25, dtype=torch.float64)
        for l in reversed(range(len(probs))):
            vec = _reset_vectors(model, l, states[l], rec, probs[l])
            if measure == "globenc":
                t = vec.norm(dim=-1)
            else:
                o = rec["out"][l][:, :, None]
                t = (o.abs().sum(-1) - (o - vec).abs().sum(-1)).clamp(min=0)
            t = t / t.sum(-1, keepdim=True)
            v = torch.einsum("bi,bij->bj", v, 0.5 * t + 0.5 * res_mix[l])
    cls = GlobEnc if measure == "globenc" else ALTI
    got = cls(model, residual_strength=0.5).attribute(x, output="tokens")
    torch.testing.assert_close(got, v, rtol=0, atol=1e-12)
    torch.testing.assert_close(got.sum(-1), torch.ones(2, dtype=torch.float64), rtol=0,
                               atol=1e-12)


def test_legrad_dense_reference():
    """LeGrad on a Hiera whose last stage has two blocks (stages 1-1-2): the pooling
    block's term (the mean over its pooled query rows of ReLU(∂s^l/∂A^l), on its input
    grid) plus the last block's (copied to its children), each score the model's readout
    of that block's output; earlier blocks are refused by name."""
    model, x = _model("timm_hiera", stages=(1, 1, 2))
    a = adapt(model)
    assert [b.pool is not None for b in a.blocks] == [False, True, True, False]
    t = torch.tensor([3, 1])
    rec: dict = {}
    _, probs, _, _ = _dense_forward(model, x, rec)
    grids = _grids(model)  # 8x8, 8x8, 4x4, 2x2
    total = 0
    for l in (2, 3):
        s = rec["readout"](rec["out"][l]).gather(1, t[:, None]).sum()
        (g,) = torch.autograd.grad(s, probs[l], retain_graph=True)
        with torch.no_grad():
            e = (g * (probs[l] > 0)).clamp(min=0).mean(1)
            e = e.sum(1) / e.shape[1]  # the mean over the block's query rows
            total = total + (e if l == 2 else _upsample(e, grids[3], 2))
    ref = _upsample(total, grids[2], 2)  # a score per token: copied to the first grid
    got = LeGrad(model).attribute(x, target=t, output="tokens")
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12 * (1 + ref.abs().max().item()))
    with pytest.raises(ValueError, match=r"from block 2 on"):
        LeGrad(model, layers=[1, 3]).attribute(x, target=t)
