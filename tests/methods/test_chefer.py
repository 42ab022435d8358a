"""Chefer'21 Transformer Attribution (SPEC_NEXT §8.6) against a slow float64 reference that
transcribes the authors' ``layers_ours.py`` ``relprop`` chain (``safe_divide`` included) and
``compute_rollout_attention``, and its α1β0 linear backward against the rule written pair by
pair. Its PLUS/SkipPLUS fast path and option checks run with the other LRP methods in
tests/methods/test_lrp.py."""

from __future__ import annotations

import pytest
import torch

from captum_vit import TransformerAttribution
from tests.helpers import (
    family_marks,
    make_inputs,
)
from tests.methods.test_lrp import TARGET, close, flat, model_of, reference_forward, tokens


# -- Chefer'21 -------------------------------------------------------------------------------
def chefer_divide(a, b):
    """``safe_divide`` of ``layers_ours.py``."""
    den = b.clamp(min=1e-9) + b.clamp(max=1e-9)
    den = den + den.eq(0).to(den.dtype) * 1e-9
    return a / den * b.ne(0).to(b.dtype)


def _exact(a, b):
    return torch.where(b != 0, a / torch.where(b != 0, b, torch.ones_like(b)),
                       torch.zeros_like(a))


def alpha_beta(x, w, r):
    """``layers_ours.Linear.relprop`` with alpha=1: positive contributions, bias ignored."""
    xi = x[..., None, :]
    c = xi.clamp(min=0) * w.clamp(min=0) + xi.clamp(max=0) * w.clamp(max=0)
    return (c * chefer_divide(r, c.sum(-1))[..., None]).sum(-2)


def chefer_add(a, b, r, lrp0):
    """``layers_ours.Add.relprop``, its sums per image."""
    s = lrp0(r, a + b)
    ra, rb = a * s, b * s
    dims = tuple(range(1, r.dim()))
    sa, sb, tot = ra.sum(dims, keepdim=True), rb.sum(dims, keepdim=True), r.sum(dims, keepdim=True)
    fa = chefer_divide(sa.abs(), sa.abs() + sb.abs()) * tot
    fb = chefer_divide(sb.abs(), sa.abs() + sb.abs()) * tot
    return ra * chefer_divide(fa, sa), rb * chefer_divide(fb, sb)


def chefer_matmul(a, b, r, lrp0):
    """``layers_ours.einsum.relprop`` (LRP-0 to both operands) followed by the halving of
    ``ViT_LRP.Attention.relprop``."""
    c = a[..., :, None, :] * b.transpose(-1, -2)[..., None, :, :]
    s = c * lrp0(r, c.sum(-1))[..., None] / 2
    return s.sum(-2), s.sum(-3).transpose(-1, -2)


def reference_chefer(model, x, target, start_layer=0, faithful=False):
    """Chefer'21 by ``ViT_LRP.py``'s relprop chain; ``faithful=True`` keeps the reference's
    ``safe_divide`` (stabiliser 1e-9) in its LRP-0 steps too (matmuls, add split, clone,
    the class-token selection); ``False`` divides exactly there (this package's form)."""
    lrp0 = chefer_divide if faithful else _exact
    recs, hd = reference_forward(model, x, target)
    r = torch.zeros_like(hd["logits"]).scatter_(1, target[:, None], 1.0)  # one-hot
    r = alpha_beta(hd["z"], hd["w"], r)
    rh = torch.zeros_like(hd["hn"])
    rh[:, 0] = hd["hn"][:, 0] * lrp0(r, hd["hn"][:, 0])  # IndexSelect
    r = rh  # final norm: identity
    cams = {}
    for l in reversed(range(len(recs))):
        rec, p = recs[l], recs[l]["p"]
        r_mid, r_f = chefer_add(rec["mid"], rec["f"], r, lrp0)
        r_z = alpha_beta(rec["hid"], p.fc2_weight, r_f)  # GELU: identity
        r_u2 = alpha_beta(rec["u2"], p.fc1_weight, r_z)  # norm2: identity
        r = rec["mid"] * lrp0(r_mid + r_u2, rec["mid"])  # clone2
        r_x, r_a = chefer_add(rec["x"], rec["a"], r, lrp0)
        r_o = alpha_beta(rec["o"], p.proj_weight, r_a)
        b, n, _ = r_o.shape
        r_mix = r_o.reshape(b, n, p.num_heads, p.head_dim).transpose(1, 2)
        r_A, r_v = chefer_matmul(rec["A"], rec["v"], r_mix, lrp0)
        cams[l] = r_A  # softmax: identity
        r_q, r_kt = chefer_matmul(rec["q"], rec["k"].transpose(-1, -2), r_A, lrp0)
        r_k = r_kt.transpose(-1, -2)

        r_u = (alpha_beta(rec["u"], p.q_weight, flat(r_q))
               + alpha_beta(rec["u"], p.k_weight, flat(r_k))
               + alpha_beta(rec["u"], p.v_weight, flat(r_v)))  # norm1: identity
        r = rec["x"] * lrp0(r_x + r_u, rec["x"])  # clone1
    # ViT_LRP.VisionTransformer.relprop, method="transformer_attribution"
    mats = [(recs[l]["gradA"] * cams[l]).clamp(min=0).mean(1) for l in range(len(recs))]
    eye = torch.eye(mats[0].shape[-1], dtype=mats[0].dtype)
    mats = [m + eye for m in mats]
    joint = mats[start_layer]
    for i in range(start_layer + 1, len(mats)):
        joint = mats[i].bmm(joint)
    return joint[:, 0, 1:]


@pytest.mark.parametrize("family", [pytest.param(f, marks=family_marks(f))
                                     for f in ("vit", "hf_vit")])
def test_chefer_equals_the_reference_relprop(family):
    """Equal to ``ViT_LRP.py``'s relprop chain with exact LRP-0 divisions (1e-10), and to
    the reference with its 1e-9 stabiliser everywhere up to that stabiliser's effect."""
    model, x = model_of(family, 3), make_inputs(family, batch=2)
    for s in (0, 1):
        ours = tokens(TransformerAttribution(model, start_layer=s), x)
        close(ours, reference_chefer(model, x, TARGET, s), 1e-10)
        close(ours, reference_chefer(model, x, TARGET, s, faithful=True), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_alpha_beta_linear_equals_the_explicit_rule(dtype):
    """Chefer's α1β0 backward (computed as (xW + |x||W|)/2 and S W ± S |W|) equals the rule
    written pair by pair, with exact zeros where an input is 0 and where an output has
    only negative contributions (z = 0: no relevance passes)."""
    from captum_vit.adapters.rules import CHEFER_STABILIZER, BackwardMode, _AlphaBetaLinear

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 12, generator=g, dtype=torch.float64)
    x[0, 1, 4] = 0.0
    x[1, 2] = 0.0  # a token of zeros
    w = torch.randn(7, 12, generator=g, dtype=torch.float64)
    w[2] = -w[2].abs()
    x[2, 3] = x[2, 3].abs()  # output 2 of this token: every contribution negative
    b = torch.randn(7, generator=g, dtype=torch.float64)
    grad_y = torch.randn(3, 5, 7, generator=g, dtype=torch.float64)

    contrib = x[..., None, :] * w  # [.., out, in]: x_i w_ji
    pos = contrib.clamp(min=0)
    y = x @ w.T + b
    z = pos.sum(-1)
    s = torch.where(z == 0, torch.zeros_like(z), y * grad_y / (z + CHEFER_STABILIZER))
    r_x = (pos * s[..., None]).sum(-2)
    ref = torch.where(x == 0, torch.zeros_like(x), r_x / x)

    xt = x.to(dtype).requires_grad_()
    out = _AlphaBetaLinear.apply(xt, w.to(dtype), b.to(dtype), BackwardMode())
    got, = torch.autograd.grad(out, xt, grad_y.to(dtype))
    assert z[2, 3, 2] == 0
    assert (got[x == 0] == 0).all()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got.double() * x, ref * x, rtol=0,
                               atol=tol * (1 + (ref * x).abs().max().item()))
