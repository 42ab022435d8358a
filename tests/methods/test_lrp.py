"""The LRP family (SPEC_NEXT §8.6): CP-LRP and AttnLRP (Chefer'21's own references:
tests/methods/test_chefer.py; the PLUS fast path and options of all three are here).

The efficient implementations (custom backward rules, "relevance as gradient") are checked
against slow float64 references written here rule by rule on 2-block models: every
relevance is redistributed explicitly from its contributions (``x_i w_ji`` of a linear map,
``a_ik b_kj`` of a matmul, the LN rule's centring map, LXT's explicit softmax rule, the
zennit γ-rule), without autograd except for the vector-Jacobian products of RoPE and
average pooling (linear maps without bias) and ∂y_c/∂A.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from captum_vit import CPLRP, PLUS, AttnLRP, DecompX, SkipPLUS, TransformerAttribution
from captum_vit.adapters import adapt
from tests.helpers import (
    assert_close_scaled,
    assert_unchanged,
    family_marks,
    have_transformers,
    make_inputs,
    make_model,
    snapshot,
)

TARGET = torch.tensor([1, 3])
_MODELS: dict[tuple[str, int], nn.Module] = {}


def model_of(family: str, depth: int = 2) -> nn.Module:
    if (family, depth) not in _MODELS:
        _MODELS[family, depth] = make_model(family, depth=depth)
    return _MODELS[family, depth]


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-10) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=tol * (1 + b.abs().max().item()))


def tokens(method, x, target=TARGET, **kw):
    return method.attribute(x, target, output="tokens", **kw)


# -- explicit LRP rules (float64) -------------------------------------------------------------
def flat(t):
    """Per-head [B, H, N, d] -> heads concatenated [B, N, H*d]."""
    return t.transpose(1, 2).flatten(2)


def _sign0(z):
    return torch.where(z >= 0, torch.ones_like(z), -torch.ones_like(z))


def _div(a, b, eps=0.0):
    return a / (b + eps * _sign0(b))


def linear_rule(x, w, b, r, gamma=0.0, eps=0.0):
    """ε-rule (γ = 0) or zennit's generalised γ-rule from the contributions x_i w_ji."""
    xi = x[..., None, :]
    y = (xi * w).sum(-1) + (0 if b is None else b)
    b = torch.zeros_like(y) if b is None else b.expand_as(y)
    if gamma == 0:
        c, d = xi * w, y
    else:
        wp, wn = w + gamma * w.clamp(min=0), w + gamma * w.clamp(max=0)
        up = (y > 0)[..., None]
        c = torch.where(up, torch.where(xi > 0, xi * wp, xi * wn),
                        torch.where(xi > 0, xi * wn, xi * wp))
        c = c * (y != 0)[..., None]
        d = c.sum(-1) + torch.where(y > 0, b + gamma * b.clamp(min=0),
                                    b + gamma * b.clamp(max=0))
    return (c * _div(r, d, eps)[..., None]).sum(-2)


def ln_rule(x, weight, bias, eps, r):
    """LayerNorm with σ frozen as a linear map (centring kept), ε-rule, β absorbing."""
    d = x.shape[-1]
    sigma = torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + eps)
    c = x[..., None, :] * (torch.eye(d, dtype=x.dtype) - 1.0 / d) / sigma[..., None]
    if weight is not None:
        c = c * weight[:, None]
    y = c.sum(-1) + (0 if bias is None else bias)
    return (c * (r / y)[..., None]).sum(-2)


def add_rule(a, b, r):
    return a / (a + b) * r, b / (a + b) * r


def softmax_rule(x, s, r):
    """LXT's explicit softmax rule (``lxt.explicit.functional.softmax_fn``, AttnLRP Prop. 3.1)."""
    return x * (r - s * r.sum(-1, keepdim=True))


def matmul_rule(a, b, r, share):
    """``z = a @ b`` from the contributions ``a_ik b_kj``; each operand gets ``share`` of
    each product's relevance (½: AttnLRP's uniform rule, LXT's ``matmul_fn``)."""
    c = a[..., :, None, :] * b.transpose(-1, -2)[..., None, :, :]  # [.., i, j, k]
    s = c * (r / c.sum(-1))[..., None] * share
    return s.sum(-2), s.sum(-3).transpose(-1, -2)


def linear_map_rule(f, x, r):
    """A linear map without bias (RoPE, average pooling): R_x = x ⊙ Jᵀ(R_y / y)."""
    x = x.detach().requires_grad_()
    with torch.enable_grad():
        y = f(x)
        (g,) = torch.autograd.grad(y, x, r / y.detach())
    return x.detach() * g


def norm_rule(norm, x, r):
    """A NormParts or a q/k-norm module by the LN rule; identity for ``None``/Identity."""
    if norm is None or isinstance(norm, nn.Identity):
        return r
    return ln_rule(x, norm.weight, norm.bias, norm.eps, r)


def _ln(x, norm):
    if norm is None or isinstance(norm, nn.Identity):
        return x
    return F.layer_norm(x, x.shape[-1:], norm.weight, norm.bias, norm.eps)


# -- reference forward from the adapter's parts ------------------------------------------------
def reference_forward(model, x, target):
    """The canonical forward written out from the adapter's parts, keeping every
    intermediate (one classifier head), and ∂y_c/∂A_l of every block."""
    with torch.enable_grad():
        recs, head = _forward(model, x)
        grads = torch.autograd.grad(head["logits"].gather(1, target[:, None]).sum(),
                                    [r["A"] for r in recs])
    for r, g in zip(recs, grads, strict=True):
        r["gradA"] = g
    detach = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in head.items()}
    return [{k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in r.items()}
            for r in recs], detach


def _forward(model, x):
    ad = adapt(model)
    h = ad.embed(x).detach()
    recs = []
    for p in ad.blocks:
        r = {"x": h}
        b, n, _ = h.shape
        nh, hd = p.num_heads, p.head_dim
        r["u"] = u = _ln(h, p.norm1)

        def heads(t, b=b, n=n, nh=nh, hd=hd):
            return t.reshape(b, n, nh, hd).transpose(1, 2)

        r["q0"], r["k0"] = heads(F.linear(u, p.q_weight, p.q_bias)), heads(
            F.linear(u, p.k_weight, p.k_bias))
        r["v"] = heads(F.linear(u, p.v_weight, p.v_bias))
        r["q1"], r["k1"] = _ln(r["q0"], p.q_norm), _ln(r["k0"], p.k_norm)
        rot = (lambda t, p=p: p.rotary(t, None)) if p.rotary is not None else (lambda t: t)
        r["q"], r["k"] = rot(r["q1"]), rot(r["k1"])
        r["qk"] = (r["q"] * p.scale) @ r["k"].transpose(-1, -2)
        bias = p.logit_bias(n)
        r["scores"] = r["qk"] + (0 if bias is None else bias)
        r["A"] = r["scores"].softmax(-1)
        r["mix"] = r["A"] @ r["v"]
        r["o0"] = r["mix"].transpose(1, 2).reshape(b, n, nh * hd)
        r["o"] = _ln(r["o0"], p.inner_norm)
        r["a0"] = F.linear(r["o"], p.proj_weight, p.proj_bias)
        r["a"] = r["a0"] if p.ls1 is None else r["a0"] * p.ls1
        r["mid"] = h + r["a"]
        r["u2"] = _ln(r["mid"], p.norm2)
        r["z"] = F.linear(r["u2"], p.fc1_weight, p.fc1_bias)
        if p.gate_weight is None:
            r["hid0"] = p.act(r["z"])
        else:
            r["g"] = F.linear(r["u2"], p.gate_weight, p.gate_bias)
            r["ga"] = p.act(r["g"])
            r["hid0"] = r["ga"] * r["z"]
        r["hid"] = _ln(r["hid0"], p.mlp_norm)
        r["f0"] = F.linear(r["hid"], p.fc2_weight, p.fc2_bias)
        r["f"] = r["f0"] if p.ls2 is None else r["f0"] * p.ls2
        r["out"] = h = r["mid"] + r["f"]
        r["p"] = p
        recs.append(r)
    hp = ad.head
    assert len(hp.heads) == 1 and hp.attn_pool is None and hp.target is None
    row, w, bias = hp.heads[0]
    hn = _ln(h, hp.norm)
    k = ad.num_prefix
    pooled = hn[:, k:].mean(1) if row == "avg" else hn[:, row]
    z = _ln(pooled, hp.fc_norm)
    logits = F.linear(z, w, bias)
    torch.testing.assert_close(logits, ad.model_logits(x), rtol=0, atol=1e-10)
    head = {"hL": h, "hn": hn, "pooled": pooled, "z": z, "logits": logits, "w": w, "b": bias,
            "row": row, "hp": hp, "k": k}
    return recs, head


def reference_lrp(model, x, target, *, method="cp", attention="cp", act_rule="identity",
                  gamma=0.0, eps=0.0, ledger=None):
    """CP-LRP / AttnLRP token relevance at x_0 [B, N], rule by rule (``ledger["softmax"]``:
    the relevance [B] the softmax rule gives up, summed over the blocks)."""
    absorbed = 0.0
    recs, hd = reference_forward(model, x, target)

    def lin(inp, w, b, r):
        return linear_rule(inp, w, b, r, gamma, eps)

    logits = hd["logits"]
    r = torch.zeros_like(logits).scatter_(1, target[:, None], 1.0) * logits  # R = y_c
    r = lin(hd["z"], hd["w"], hd["b"], r)
    r = norm_rule(hd["hp"].fc_norm, hd["pooled"], r)
    rh = torch.zeros_like(hd["hn"])
    if hd["row"] == "avg":
        k = hd["k"]
        rh[:, k:] = linear_map_rule(lambda t: t.mean(1), hd["hn"][:, k:], r)
    else:
        rh[:, hd["row"]] = r
    r = norm_rule(hd["hp"].norm, hd["hL"], rh)
    for rec in reversed(recs):
        p = rec["p"]
        r_mid, r_f = add_rule(rec["mid"], rec["f"], r)  # ls2: identity relevance
        r_hid = lin(rec["hid"], p.fc2_weight, p.fc2_bias, r_f)
        r_hid0 = norm_rule(p.mlp_norm, rec["hid0"], r_hid)
        if p.gate_weight is None:
            if act_rule == "gradient" and method == "cp":
                zz = rec["z"].detach().requires_grad_()
                with torch.enable_grad():
                    (slope,) = torch.autograd.grad(p.act(zz).sum(), zz)
                r_z = rec["z"] * slope * r_hid0 / rec["hid0"]
            else:
                r_z = r_hid0  # identity rule
            r_u2 = lin(rec["u2"], p.fc1_weight, p.fc1_bias, r_z)
        else:
            if method == "cp":  # the activated gate is a constant
                r_z, r_g = r_hid0, torch.zeros_like(r_hid0)
            else:  # uniform rule on the product, identity rule on the gate's activation
                r_z = r_g = 0.5 * r_hid0
            r_u2 = (lin(rec["u2"], p.fc1_weight, p.fc1_bias, r_z)
                    + lin(rec["u2"], p.gate_weight, p.gate_bias, r_g))
        r_mid = r_mid + norm_rule(p.norm2, rec["mid"], r_u2)
        r_x, r_a = add_rule(rec["x"], rec["a"], r_mid)  # ls1: identity relevance
        r_o = lin(rec["o"], p.proj_weight, p.proj_bias, r_a)
        r_o0 = norm_rule(p.inner_norm, rec["o0"], r_o)
        b, n, _ = r_o0.shape
        r_mix = r_o0.reshape(b, n, p.num_heads, p.head_dim).transpose(1, 2)
        if attention == "cp":  # A constant: the mix is linear in v
            _, r_v = matmul_rule(rec["A"], rec["v"], r_mix, 1.0)
            r_q = r_k = None
        else:
            r_A, r_v = matmul_rule(rec["A"], rec["v"], r_mix, 0.5)
            r_scores = softmax_rule(rec["scores"], rec["A"], r_A)
            absorbed = absorbed + (r_A - r_scores).sum((1, 2, 3))
            r_qk, _ = add_rule(rec["qk"], rec["scores"] - rec["qk"], r_scores)  # bias absorbs
            r_qs, r_kt = matmul_rule(rec["q"] * p.scale, rec["k"].transpose(-1, -2), r_qk, 0.5)
            r_q, r_k = r_qs, r_kt.transpose(-1, -2)
            if p.rotary is not None:
                r_q = linear_map_rule(lambda t, p=p: p.rotary(t, None), rec["q1"], r_q)
                r_k = linear_map_rule(lambda t, p=p: p.rotary(t, None), rec["k1"], r_k)
            r_q = norm_rule(p.q_norm, rec["q0"], r_q)
            r_k = norm_rule(p.k_norm, rec["k0"], r_k)

        r_u = lin(rec["u"], p.v_weight, p.v_bias, flat(r_v))
        if r_q is not None:
            r_u = (r_u + lin(rec["u"], p.q_weight, p.q_bias, flat(r_q))
                   + lin(rec["u"], p.k_weight, p.k_bias, flat(r_k)))
        r = r_x + norm_rule(p.norm1, rec["x"], r_u)
    if ledger is not None:
        ledger["softmax"] = absorbed
    return r.sum(-1)


REF_FAMILIES = [pytest.param(f, marks=family_marks(f)) for f in ("vit", "eva02", "layerscale")]


@pytest.mark.parametrize("family", REF_FAMILIES)
@pytest.mark.parametrize(("name", "options"), [
    ("cp", {}), ("cp", {"act_rule": "gradient"}), ("cp", {"epsilon": 0.01}),
    ("attnlrp", {}), ("attnlrp", {"attention": "cp"}), ("attnlrp", {"gamma": 0.25}),
    ("attnlrp", {"attention": "cp", "gamma": 0.1, "epsilon": 1e-3}),
])
def test_equal_to_the_rule_by_rule_reference(family, name, options):
    model, x = model_of(family), make_inputs(family, batch=2)
    cls = CPLRP if name == "cp" else AttnLRP
    ours = tokens(cls(model, **options), x)
    kw = {"method": name, "gamma": options.get("gamma", 0.0),
          "eps": options.get("epsilon", 0.0), "act_rule": options.get("act_rule", "identity"),
          "attention": options.get("attention", "attnlrp" if name == "attnlrp" else "cp")}
    ref = reference_lrp(model, x, TARGET, **kw)
    close(ours, ref[:, adapt(model).num_prefix:], 1e-10)


@pytest.mark.skipif(not have_transformers(), reason="the hf extra is not installed")
def test_hf_vit_equals_the_reference():
    model, x = model_of("hf_vit"), make_inputs("hf_vit", batch=2)
    for cls, kw in ((CPLRP, {"method": "cp", "attention": "cp"}),
                    (AttnLRP, {"method": "attnlrp", "attention": "attnlrp"})):
        close(tokens(cls(model), x), reference_lrp(model, x, TARGET, **kw)[:, 1:], 1e-10)


def test_softmax_rule_equals_lxts_explicit_rule():
    """The true softmax Jacobian in Gradient × Input form is LXT's explicit rule
    ``R_x = x ⊙ (R_s − s ΣR_s)``: with g̃ = R_s / s, x ⊙ Jᵀ g̃ equals it."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 7, 7, generator=g, dtype=torch.float64).requires_grad_()
    r = torch.randn(3, 4, 7, 7, generator=g, dtype=torch.float64)
    s = x.softmax(-1)
    (grad,) = torch.autograd.grad(s, x, r / s.detach())
    assert_close_scaled(x.detach() * grad, softmax_rule(x.detach(), s.detach(), r))


# -- CP-LRP = DecompX ---------------------------------------------------------------------------
@pytest.mark.parametrize("family", [pytest.param(f, marks=family_marks(f)) for f in (
    "vit", "eva02", "map", "beit_swiglu", "hf_dinov2")])
def test_cp_lrp_is_decompx(family):
    """CP-LRP at the tokens (identity rule, ε = 0) is DecompX's gradient route (the same
    linearised backward; DecompX streams it through the fused attention kernel, so equal
    up to rounding) and its explicit decomposition (float precision); the same holds for
    every start block through SkipPLUS."""
    model, x = model_of(family, 3), make_inputs(family, batch=2)
    cp = tokens(CPLRP(model), x)
    close(cp, tokens(DecompX(model), x), 1e-12)
    close(cp, tokens(DecompX(model, route="explicit"), x), 1e-10)
    close(tokens(SkipPLUS(model, "cp_lrp"), x), tokens(SkipPLUS(model, "decompx"), x), 1e-12)


def _zero_biases(model: nn.Module) -> nn.Module:
    """A copy with every bias (linear maps, LayerNorm shifts) set to zero."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for name, prm in m.named_parameters():
            if name.endswith("bias"):
                prm.zero_()
    return m


@pytest.mark.parametrize("family", ["vit", "eva02"])
def test_conservation(family):
    r"""Without biases the rules are conservative: CP-LRP and AttnLRP(attention="cp")
    (identity, LN and uniform rules, constant probabilities) sum exactly to the logit
    (float64: 1e-10 relative); AttnLRP's softmax rule (Prop. 3.1) gives up
    :math:`\Sigma_j R_{A,j} - \Sigma_j R_{x,j}` per attention row (its implicit bias),
    so its sum is the logit minus exactly that, which on these random models is a large
    part of it. With biases, CP-LRP's tokens plus DecompX's bias source are the logit
    (completeness)."""
    model, x = _zero_biases(model_of(family)), make_inputs(family, batch=2)
    logit = adapt(model).model_logits(x).gather(1, TARGET[:, None])[:, 0].detach()

    def total(method):  # prefix tokens included
        return method._token_maps(x, TARGET).sum(-1)

    for method in (CPLRP(model), AttnLRP(model, attention="cp")):
        close(total(method), logit, 1e-10)
    plain = copy.deepcopy(model)  # no class token or position embedding either:
    with torch.no_grad():  # the pixels then hold all the relevance
        for name, prm in plain.named_parameters():
            if name in ("cls_token", "pos_embed"):
                prm.zero_()
    close(total(CPLRP(plain, at="pixels")),
          adapt(plain).model_logits(x).gather(1, TARGET[:, None])[:, 0].detach(), 1e-10)
    ledger: dict = {}
    reference_lrp(model, x, TARGET, method="attnlrp", attention="attnlrp", ledger=ledger)
    close(total(AttnLRP(model)), logit - ledger["softmax"], 1e-10)
    model = model_of(family)
    res = DecompX(model).decompose(x, TARGET)
    close(total(CPLRP(model)) + res.bias, res.logit, 1e-10)


def test_pixels_equal_tokens_without_position_embedding():
    """``at="pixels"``: with no patch-embedding bias and no position embedding a patch
    token is linear in its pixels, so its pixel relevance is its token relevance."""
    model = copy.deepcopy(model_of("vit"))
    with torch.no_grad():
        model.patch_embed.proj.bias.zero_()
        model.pos_embed.zero_()
    x = make_inputs("vit", batch=2)
    for cls in (CPLRP, AttnLRP):
        close(tokens(cls(model, at="pixels"), x), tokens(cls(model), x), 1e-10)
    assert not torch.allclose(tokens(CPLRP(model_of("vit"), at="pixels"), x),
                              tokens(CPLRP(model_of("vit")), x))


# -- PLUS / SkipPLUS ------------------------------------------------------------------------
@pytest.mark.parametrize("family", [pytest.param(f, marks=family_marks(f))
                                    for f in ("vit", "map", "hf_dinov2")])
@pytest.mark.parametrize("base", ["cp_lrp", "attnlrp", "chefer21"])
def test_plus_fast_path_equals_the_generic_path(family, base):
    model, x = model_of(family, 3), make_inputs(family)
    target = torch.tensor([1, 4, 0])
    for combinator in (PLUS, SkipPLUS):
        fast, slow = combinator(model, base), combinator(model, base, fast=False)
        assert (fast.route, slow.route) == ("hook", "method")
        close(tokens(fast, x, target), tokens(slow, x, target), 1e-10)
    if base == "chefer21":
        def factory(f):
            return TransformerAttribution(f, start_layer=1)
        kw = {"layers": [0, 1]}
        close(tokens(PLUS(model, factory, **kw), x, target),
              tokens(PLUS(model, factory, fast=False, **kw), x, target), 1e-10)
        with pytest.raises(ValueError, match="start_layer"):
            tokens(PLUS(model, factory), x, target)
        layer = PLUS(model, base, aggregate="layer")
        assert torch.isfinite(tokens(layer, x, target)).all()


# -- options, errors, the model left alone ----------------------------------------------------
def test_options_are_checked():
    model = model_of("vit")
    with pytest.raises(ValueError, match="act_rule"):
        CPLRP(model, act_rule="relu")
    with pytest.raises(ValueError, match="attention"):
        AttnLRP(model, attention="full")
    with pytest.raises(ValueError, match="gamma"):
        AttnLRP(model, gamma=-0.1)
    with pytest.raises(TypeError, match="epsilon"):
        CPLRP(model, epsilon="0.1")
    with pytest.raises(ValueError, match="at"):
        AttnLRP(model, at="patches")
    with pytest.raises(ValueError, match="start_layer"):
        TransformerAttribution(model, start_layer=2)
    with pytest.raises(ValueError, match="score"):
        AttnLRP(model).attribute(make_inputs("vit"), score="prob")
    with pytest.raises(ValueError, match="aggregate"):
        PLUS(model, "attnlrp", aggregate="layer")
    with pytest.raises(ValueError, match="at='tokens'"):
        PLUS(model, lambda f: CPLRP(f, at="pixels")).attribute(make_inputs("vit"))


@pytest.mark.skipif(not have_transformers(), reason="the hf extra is not installed")
def test_pixels_through_a_normalised_embedding():
    """``at="pixels"`` on CLIP (``pre_layrnorm`` in the embedding) runs the LN rule there
    (it used to be refused; references in tests/methods/test_lrp_pixels.py)."""
    model, x = make_model("hf_clip", depth=1), make_inputs("hf_clip", batch=2)
    target = torch.randn(2, 16, dtype=torch.float64)
    before = snapshot(model)
    for method in (CPLRP(model, at="pixels"), AttnLRP(model, gamma=0.25, at="pixels")):
        out = method.attribute(x, target)
        assert out.shape == x.shape and torch.isfinite(out).all()
    assert_unchanged(model, before)


@pytest.mark.parametrize("family", ["layerscale", "eva02"])
def test_model_unchanged_and_gamma_probability_score(family):
    model, x = model_of(family), make_inputs(family, batch=2)
    before = snapshot(model)
    for method in (AttnLRP(model, gamma=0.5, at="pixels"), CPLRP(model, epsilon=1e-6),
                   TransformerAttribution(model)):
        out = method.attribute(x, TARGET, score="probability")
        assert out.shape == x.shape and torch.isfinite(out).all()
    assert_unchanged(model, before)
