"""TokenTM (SPEC §2): fixture parity of the residual variant, a slow reference written
from the paper's equations (explicit loops over heads and tokens, full N x N matrices,
attention captured through timm's own forward) on every model family, and the usual
front-end guarantees."""

from __future__ import annotations

import pytest
import torch

from captum_vit.methods.tokentm import (
    TokenTM,
    head_weights,
    necc,
    transformation_weights,
)
from tests.helpers import (
    FAMILIES,
    ReferenceCapture,
    assert_close_scaled,
    assert_close_to_reference,
    make_inputs,
    make_model,
)

EPS = 1e-8


# --- fixture parity (authors' decompv transform_TokenTM) ---------------------------------

@pytest.mark.parametrize("key,score", [("tokentm_residual", "logit"),
                                       ("tokentm_residual_probgrad", "probability")])
def test_residual_variant_matches_authors_code(parity, key, score):
    model, x, targets, _, maps, _ = parity
    out = TokenTM(model, variant="residual").attribute(x, target=targets, score=score,
                                                       output="tokens")
    assert out.dtype == torch.float64
    assert_close_to_reference(out, maps[key], rel=1e-12)


def test_residual_variant_defaults_to_logit(parity):
    model, x, targets, _, maps, _ = parity
    out = TokenTM(model, variant="residual").attribute(x, target=targets, output="tokens")
    assert_close_to_reference(out, maps["tokentm_residual"], rel=1e-12)


# --- slow reference from SPEC §2 ----------------------------------------------------------

def _readout_row(model, mat):
    """SPEC §0: row 0 for CLS / distilled models, mean of patch rows for avg-pool."""
    k = model.num_prefix_tokens
    if model.global_pool == "avg":
        return mat[k:].mean(0)
    return mat[0]


def _ref_weight_matrix(e, e_t):
    """W = diag(L(Ẽ_i) / (L(E_i) + eps) * NECC_i) (Eq. 12-13), one token at a time."""
    n = e.shape[0]
    cos = torch.stack([e[i] @ e_t[i] / (max(e[i].norm(), EPS) * max(e_t[i].norm(), EPS))
                       for i in range(n)])
    necc_ = torch.exp(cos) / torch.exp(cos).sum()
    return torch.diag(torch.stack([e_t[i].norm() / (e[i].norm() + EPS) * necc_[i]
                                   for i in range(n)]))


def reference_tokentm(model, x, target, variant="paper", score="probability"):
    refs = ReferenceCapture(model)
    mids = []
    for blk in refs.model.blocks:
        blk.norm2.register_forward_pre_hook(lambda m, a: mids.append(a[0]))
    logits = refs(x)
    s = logits.softmax(-1) if score == "probability" else logits
    s[torch.arange(len(x)), target].sum().backward()
    outs = refs.block_inputs[1:] + [None]
    maps = []
    with torch.no_grad():
        for b in range(len(x)):
            x0 = refs.block_inputs[0][b]
            n = x0.shape[0]
            eye = torch.eye(n, dtype=x0.dtype)
            c = torch.diag(torch.stack([x0[i].norm() for i in range(n)]))  # Eq. 18
            for l, blk in enumerate(refs.model.blocks):
                xl, mid = refs.block_inputs[l][b], mids[l][b]
                a, g = refs.attn[l][b], refs.attn[l].grad[b]
                heads = a.shape[0]
                if variant == "paper":
                    dim = xl.shape[-1]
                    d = dim // heads
                    u = blk.norm1(xl)
                    terms = []
                    for h in range(heads):
                        wv = blk.attn.qkv.weight[2 * dim + h * d:2 * dim + (h + 1) * d]
                        wo = blk.attn.proj.weight[:, h * d:(h + 1) * d]
                        e_t = u @ wv.T @ wo.T  # Eq. 5, biases excluded
                        w_h = _ref_weight_matrix(xl, e_t)
                        terms.append(g[h].clamp(min=0) * (a[h] @ w_h))  # Eq. 14
                    u_attn = eye + sum(terms) / heads  # Eq. 15
                    ffn = blk.ls2(blk.mlp(blk.norm2(mid[None])))[0]
                    u_ffn = eye + _ref_weight_matrix(mid, ffn)  # Eq. 16-17
                else:
                    out = outs[l][b] if outs[l] is not None else mid + blk.ls2(
                        blk.mlp(blk.norm2(mid[None])))[0]
                    relu_g = sum(g[h].clamp(min=0) for h in range(heads)) / heads
                    u_attn = eye + (a.mean(0) @ _ref_weight_matrix(xl, mid)) * relu_g
                    u_ffn = eye + _ref_weight_matrix(mid, out)
                c = u_ffn @ u_attn @ c  # Eq. 19
            maps.append(_readout_row(model, c))  # Eq. 20
    return torch.stack(maps)[:, model.num_prefix_tokens:]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("variant", ["paper", "residual"])
def test_matches_slow_reference_on_every_family(family, variant):
    model = make_model(family)
    x = make_inputs(family, batch=2)
    target = torch.tensor([1, 3])
    score = {"paper": "probability", "residual": "logit"}[variant]
    ref = reference_tokentm(model, x, target, variant=variant, score=score)
    out = TokenTM(model, variant=variant).attribute(x, target=target, output="tokens")
    assert_close_to_reference(out, ref, rel=1e-12)


def test_paper_variant_with_logit_matches_reference():
    model, x = make_model("registers"), make_inputs("registers", batch=2)
    target = torch.tensor([0, 4])
    ref = reference_tokentm(model, x, target, "paper", score="logit")
    out = TokenTM(model).attribute(x, target=target, score="logit", output="tokens")
    assert_close_to_reference(out, ref, rel=1e-12)


def test_paper_variant_on_fixture_model_matches_reference(parity):
    model, x, targets, _, _, _ = parity
    ref = reference_tokentm(model, x, targets, "paper")
    out = TokenTM(model).attribute(x, target=targets, output="tokens")
    assert_close_to_reference(out, ref, rel=1e-12)


# --- pieces -------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["vit", "layerscale"])
def test_head_weights_fast_path_equals_materialised_heads(family):
    model = make_model(family)
    from captum_vit.adapters import adapt

    adapter = adapt(model)
    tr = adapter.trace(make_inputs(family, batch=2))
    for rec, p in zip(tr.blocks, adapter.blocks, strict=True):
        slow = transformation_weights(rec.x[:, None], p.head_value_outputs(rec.u))
        fast = head_weights(rec.x, rec.u, p.v_weight, p.proj_weight, p.num_heads)
        assert fast.shape == slow.shape == rec.attn.shape[:3]
        assert_close_to_reference(fast, slow, rel=1e-12)


@pytest.mark.parametrize("heads", [1, 2, 4])
def test_head_weights_equal_materialised_heads_for_any_head_count(heads):
    """Both routes of ``head_weights`` (``Ẽ^h`` formed for one or two heads, the Gram
    product for more), and the values handed in, against ``Ẽ^h = u W_V^h W_O^hᵀ``
    formed head by head, with a post-norm's per-token scale."""
    g = torch.Generator().manual_seed(heads)
    b, n, dim, d, f64 = 2, 5, 6, 3, torch.float64
    x = torch.randn(b, n, dim, generator=g, dtype=f64)
    u = torch.randn(b, n, dim, generator=g, dtype=f64)
    wv = torch.randn(heads * d, dim, generator=g, dtype=f64)
    wo = torch.randn(dim, heads * d, generator=g, dtype=f64)
    scale = torch.rand(b, n, generator=g, dtype=f64) + 0.5
    et = torch.stack([u @ wv[h * d:(h + 1) * d].T @ wo[:, h * d:(h + 1) * d].T
                      for h in range(heads)], 1) * scale[:, None, :, None]
    slow = transformation_weights(x[:, None], et)
    assert_close_to_reference(head_weights(x, u, wv, wo, heads, scale=scale), slow,
                              rel=1e-12)
    assert_close_to_reference(head_weights(x, u, wv, wo, heads, scale=scale,
                                           values=u @ wv.T), slow, rel=1e-12)


def test_necc_sums_to_one_per_image_and_head():
    model = make_model("vit")
    from captum_vit.adapters import adapt

    adapter = adapt(model)
    tr = adapter.trace(make_inputs("vit", batch=3))
    rec, p = tr.blocks[1], adapter.blocks[1]
    e_t = p.head_value_outputs(rec.u)  # [B, H, N, D]
    e = rec.x[:, None]
    nc = necc(e.norm(dim=-1), e_t.norm(dim=-1), (e * e_t).sum(-1))
    assert nc.shape == rec.attn.shape[:3]
    assert_close_scaled(nc.sum(-1), torch.ones(3, p.num_heads, dtype=nc.dtype))
    assert (nc > 0).all()


def test_zero_tokens_give_finite_weights():
    e = torch.zeros(2, 5, 4, dtype=torch.float64)
    e_t = torch.randn(2, 5, 4, dtype=torch.float64)
    w = transformation_weights(e, e_t)
    assert torch.isfinite(w).all()


# --- behaviour ------------------------------------------------------------------------------

def test_variants_and_scores_differ():
    model, x = make_model("vit"), make_inputs("vit", batch=2)
    t = torch.tensor([1, 2])
    paper = TokenTM(model).attribute(x, target=t, output="tokens")
    paper_logit = TokenTM(model).attribute(x, target=t, score="logit", output="tokens")
    resid = TokenTM(model, variant="residual").attribute(x, target=t, score="probability",
                                                         output="tokens")
    assert (paper - resid).abs().max() > 1e-3 * paper.abs().max()
    assert (paper - paper_logit).abs().max() > 1e-3 * paper.abs().max()
    other = TokenTM(model).attribute(x, target=torch.tensor([3, 0]), output="tokens")
    assert (paper - other).abs().max() > 1e-3 * paper.abs().max()


def test_float32_runs_and_agrees_with_float64():
    m64, x64 = make_model("vit"), make_inputs("vit", batch=2)
    m32 = make_model("vit", dtype=torch.float32)
    t = torch.tensor([1, 2])
    out32 = TokenTM(m32).attribute(x64.float(), target=t, output="tokens")
    out64 = TokenTM(m64).attribute(x64, target=t, output="tokens")
    assert out32.dtype == torch.float32
    assert_close_to_reference(out32.double(), out64, rel=1e-4)


def test_bad_arguments_raise_clear_errors():
    model, x = make_model("vit"), make_inputs("vit", batch=1)
    with pytest.raises(ValueError, match="variant"):
        TokenTM(model, variant="chefer")
    with pytest.raises(ValueError, match="score"):
        TokenTM(model).attribute(x, score="prob")
    with pytest.raises(ValueError, match="output"):
        TokenTM(model).attribute(x, output="heatmap")
    with pytest.raises(ValueError, match="inputs"):
        TokenTM(model).attribute(x[0])


def test_zero_attention_gradients_leave_only_ffn_weights():
    """With ∇A = 0, U_attn = I (Eq. 15): the readout row is prod_l (1 + W_ffn,l) * L(x_0)."""
    model, x = make_model("vit"), make_inputs("vit", batch=1)
    method = TokenTM(model)
    tr = method.adapter.trace(x, attention="fused")
    norms = tr.x0.norm(dim=-1)
    with torch.no_grad():
        r = method._readout(tr, None, x.dtype, tr.logits.argmax(-1))
        for l in reversed(range(len(tr.blocks))):  # ∇o_l = 0, so ∇A_l = 0
            terms = method._block_terms(tr.blocks[l], l)
            r = method._block_row(r, terms, torch.zeros_like(terms.heads.o), x.dtype)
        r = r * norms
    # Only U_ffn acts on the readout row (no attention term): r_0 = prod_l (1 + w_ffn,l)[0]
    expected = torch.zeros_like(r)
    w = torch.ones(1, dtype=r.dtype)
    for rec in tr.blocks:
        w = w * (1 + transformation_weights(rec.mid, rec.ffn_out)[:, 0])
    expected[:, 0] = w * norms[:, 0]
    assert_close_scaled(r, expected)


def test_tokentm_variant_is_case_insensitive():
    model = make_model()
    assert TokenTM(model, variant="Paper").variant == "paper"
    assert TokenTM(model, variant="RESIDUAL").variant == "residual"
    x = make_inputs(batch=1)
    torch.testing.assert_close(TokenTM(model, variant="Residual").attribute(x, output="tokens"),
                               TokenTM(model, variant="residual").attribute(x, output="tokens"))
    with pytest.raises(ValueError, match="variant must be one of"):
        TokenTM(model, variant="papers")


@pytest.mark.parametrize("example", ["vit", "map", "timm_swin_pad", "timm_swinv2",
                                     "timm_hiera_mu", "hf_timesformer"])
@pytest.mark.parametrize("variant", ["paper", "residual"])
def test_explicit_and_fused_traces_agree(example, variant, monkeypatch):
    """Small attention traces the explicit softmax (``∇A`` from the backward), large the
    fused kernel (``A`` and ``∇A`` recomputed from the heads): the same maps, on a global
    ViT, an attention-pool head, shifted and padded windows, Swin V2's post-norms,
    Hiera's mask units and query pooling, and TimeSformer's windows that share tokens."""
    from captum_vit.adapters import ViTAdapter, catalog

    _, ex = catalog.example(example)
    model, x = ex.model(), ex.inputs(2)
    maps = {}
    for small in (True, False):
        monkeypatch.setattr(ViTAdapter, "small_attention", lambda self, inputs, s=small, **_: s)
        maps[small] = TokenTM(model, variant=variant).attribute(x, output="tokens")
    assert x.dtype == torch.float64 and maps[True].abs().max() > 0
    assert_close_to_reference(maps[True], maps[False], rel=1e-10)
