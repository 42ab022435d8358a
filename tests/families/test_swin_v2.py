"""Swin V2 (timm ``SwinTransformerV2``, Hugging Face ``Swinv2ForImageClassification`` /
``Swinv2Model``): forward parity with each model in float64, the cosine attention and the
continuous position bias against references written here, the timm ↔ Hugging Face twins
(weights mapped) giving the same maps for every method, vector chains equal to dense
references through windows and merges, DecompX complete through the post-norms and the
reduce-then-norm merges."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from captum_vit import GAE, DecompX, EmbeddingTarget, TokenTM
from captum_vit.adapters import adapt, catalog
from captum_vit.adapters.families.swin_v2 import (
    HFSwinV2Adapter,
    TimmSwinV2Adapter,
    hf_swin_v2_twin,
)
from captum_vit.registry import available_methods, build_method
from tests.families.test_swin_methods import (
    DenseSwin,
    assert_chains_equal_references,
    dense_setup,
)
from tests.helpers import (
    assert_close_scaled,
    assert_unchanged,
    make_inputs,
    make_model,
    needs_transformers,
    snapshot,
)

FAST = {"rise": {"n_masks": 8}, "tam": {"n_steps": 3, "start_layer": 0},
        "bt_h": {"n_steps": 3, "start_layer": 0}, "bt_t": {"n_steps": 3, "start_layer": 0},
        "scorecam": {"max_channels": 8}}


def _timm(family: str = "timm_swinv2", **overrides):
    return catalog.example(family)[1].model(**overrides)


@pytest.mark.parametrize("family", ["timm_swinv2", "timm_swinv2_pad"])
def test_timm_forward_parity(family):
    """Cosine attention, continuous position bias, windows (rolled then padded), seam
    masks, post-norms and reduce-then-norm merges as the model computes them: logits equal
    to 1e-12 in float64, through the plain and the ops forward."""
    from captum_vit.adapters.ops import Ops

    model = make_model(family)
    before = snapshot(model)
    x = make_inputs(family, batch=2)
    adapter = adapt(model)
    assert isinstance(adapter, TimmSwinV2Adapter)
    assert all(p.norm1 is None and p.post_norm1 is not None for p in adapter.blocks)
    assert "post_norm" in adapter.blocks[0].features()
    with torch.no_grad():
        ref = model(x)
        assert (ref - adapter.run(adapter.embed(x))).abs().max() <= 1e-12
        assert (ref - adapter.run(adapter.embed(x, Ops()), ops=Ops())).abs().max() <= 1e-12
        assert (ref - adapter.trace(x).logits).abs().max() <= 1e-12
    assert_unchanged(model, before)


def test_padding_shift_and_clamp_are_exercised():
    """The pad example pads 10x10 to 12x12 windows of 4 with a shift of 2, and its odd
    5x5 second stage to 8x8 (shifted); the plain example's second stage (4x4) clamps its
    window to the grid and drops the shift, as the model does."""
    pad = adapt(make_model("timm_swinv2_pad")).blocks
    assert [(b.window.grid, b.window.padded, b.window.shift) for b in pad] == [
        ((10, 10), (12, 12), (0, 0)), ((10, 10), (12, 12), (2, 2)),
        ((5, 5), (8, 8), (0, 0)), ((5, 5), (8, 8), (2, 2))]
    plain = adapt(make_model("timm_swinv2")).blocks
    assert [b.window.shift for b in plain] == [(0, 0), (2, 2), (0, 0), (0, 0)]
    assert plain[1].merge.norm_last and plain[1].merge.out_grid == (4, 4)


@pytest.mark.parametrize("family", ["timm_swinv2", "timm_swinv2_pad"])
def test_cosine_attention_and_position_bias_reference(family):
    """Every block's probabilities equal a reference written here from the model's
    parameters: ``softmax(cos(q, k) · exp(min(τ, log 100)) + 16 σ(CPB(ĉ)) + seam)`` with
    ``ĉ = sign(c) log2(1 + 8 |c| / (P - 1)) / 3`` (``P`` the pretrained window where set),
    compared with the probabilities captured at the model's own softmax."""
    model = make_model(family)
    x = make_inputs(family, batch=2)
    adapter = adapt(model)
    dense = DenseSwin(model)
    dense(x)  # with a graph: it keeps the probabilities' gradients
    with torch.no_grad():
        recs = adapter.trace(x).blocks
    blocks = [b for st in model.layers for b in st.blocks]
    for l, blk in enumerate(blocks):
        attn = blk.attn
        mh, mw = blk.window_size
        pre = attn.pretrained_window_size
        div = (pre[0] - 1, pre[1] - 1) if pre[0] > 0 else (mh - 1, mw - 1)
        dh, dw = torch.meshgrid(torch.arange(-(mh - 1), mh), torch.arange(-(mw - 1), mw),
                                indexing="ij")
        c = torch.stack([dh / max(div[0], 1), dw / max(div[1], 1)], -1).float() * 8
        c = (torch.sign(c) * torch.log2(c.abs() + 1) / 3).double()  # float32 as the model
        table = attn.cpb_mlp(c.reshape(-1, 2))  # [(2M-1)^2, H]
        ys, xs = torch.meshgrid(torch.arange(mh), torch.arange(mw), indexing="ij")
        ys, xs = ys.reshape(-1), xs.reshape(-1)
        rel = (ys[:, None] - ys[None] + mh - 1) * (2 * mw - 1) + (xs[:, None] - xs[None] + mw - 1)
        bias = 16 * torch.sigmoid(table[rel].permute(2, 0, 1))  # [H, M, M]
        torch.testing.assert_close(adapter.blocks[l].attn_bias()[0], bias, rtol=0, atol=1e-12)
        # the probabilities of one window: the model's softmax output vs ours
        ours = recs[l].attn  # [B, H, n_W, M, M]
        theirs = dense.probs[l].reshape(2, -1, *dense.probs[l].shape[1:]).transpose(1, 2)
        torch.testing.assert_close(ours, theirs.detach(), rtol=0, atol=1e-12)
        # and the logits by the formula, in the first (unshifted, unpadded) window
        if not any(blk.shift_size):
            u = recs[l].x.reshape(2, *blk.input_resolution, -1)[:, :mh, :mw].reshape(2, mh * mw, -1)
            qkv = F.linear(u, attn.qkv.weight, torch.cat([attn.q_bias, attn.k_bias, attn.v_bias]))
            q, k, _ = qkv.reshape(2, mh * mw, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
            cos = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-1, -2)
            tau = torch.clamp(attn.logit_scale, max=math.log(100)).exp()
            ref = (cos * tau + bias).softmax(-1)
            torch.testing.assert_close(ours[:, :, 0], ref.detach(), rtol=0, atol=1e-12)


def test_pretrained_window_size_changes_the_table():
    """``pretrained_window_sizes`` rescales the coordinates of the position table: the
    same weights without it give another bias (and other logits), and each adapter reads
    its model's."""
    a = _timm("timm_swinv2_pad")
    b = _timm("timm_swinv2_pad", pretrained_window_sizes=(0, 0))
    assert a.layers[0].blocks[0].attn.pretrained_window_size == (6, 6)
    x = make_inputs("timm_swinv2_pad", batch=2)
    ba, bb = adapt(a).blocks[0].attn_bias(), adapt(b).blocks[0].attn_bias()
    assert (ba - bb).abs().max() > 1e-3
    with torch.no_grad():
        assert (a(x) - b(x)).abs().max() > 1e-6
        assert (adapt(b).run(adapt(b).embed(x)) - b(x)).abs().max() <= 1e-12


# -- vector chains and DecompX ------------------------------------------------------------
def _setup(family):
    model = make_model(family)
    return dense_setup(model, make_inputs(family, batch=2, seed=5))


@pytest.mark.parametrize("family", ["timm_swinv2", "timm_swinv2_pad"])
def test_vector_chains_equal_dense_references(family):
    """Rollout, GAE and Grad-SAM on Swin V2 equal the dense products of the full N x N
    matrices (the model's own probabilities and their gradients) and the merges' P."""
    model, x, t, ref, a, g = _setup(family)
    before = snapshot(model)
    merges = ref.merges()
    n_last = a[-1].shape[-1]
    w = torch.full((2, n_last), 1.0 / n_last, dtype=torch.float64)
    assert_chains_equal_references(model, x, t, a, g, merges, w)
    assert_unchanged(model, before)


def test_tokentm_post_norm_weights_reference():
    """TokenTM's transformed tokens through the branch's post-norm (our extension):
    ``Ẽ^h_i = γ ⊙ C(u_i W_V^h W_O^h) / σ_i`` with ``σ_i`` of the real branch output, formed
    here as the full [B, H, N, D] tensor, give the weights the method uses."""
    from captum_vit.methods.tokentm import _post_norm_path, head_weights, weights_from_norms

    model = make_model("timm_swinv2")
    ad = adapt(model)
    x = make_inputs("timm_swinv2", batch=2)
    with torch.no_grad():
        rec = ad.trace(x).blocks[1]
        p = ad.blocks[1]
        u = rec.u  # = x: no norm before the branch
        blk = model.layers[0].blocks[1]  # the branch before its post-norm, from the model
        real = blk._attn(rec.x.reshape(2, 8, 8, -1)).reshape(2, 64, -1)
        inv = torch.rsqrt(real.var(-1, unbiased=False) + p.post_norm1.eps)
        H, d = p.num_heads, p.head_dim
        v = F.linear(u, p.v_weight).reshape(2, 64, H, d)
        wo = p.proj_weight.reshape(-1, H, d)
        e = torch.einsum("bnhe,dhe->bhnd", v, wo)
        e = (e - e.mean(-1, keepdim=True)) * inv[:, None, :, None] * p.post_norm1.weight
        le, lt = rec.x.norm(dim=-1)[:, None], e.norm(dim=-1)
        dot = (e * rec.x[:, None]).sum(-1)
        expected = weights_from_norms(le, lt, dot)
        wo2, scale = _post_norm_path(p, p.proj_weight, u)
        ours = head_weights(rec.x, u, p.v_weight, wo2, H, scale=scale)
    assert_close_scaled(ours, expected, rel=1e-10)
    assert TokenTM(model).attribute(x, [0, 1]).isfinite().all()


@pytest.mark.parametrize("family", ["timm_swinv2", "timm_swinv2_pad"])
def test_decompx_complete(family):
    """DecompX through the post-norms (its LayerNorm rule) and the reduce-then-norm
    merges: the token contributions and the bias source sum to the logit from every
    start block, and the gradient route gives the same numbers."""
    model = make_model(family)
    before = snapshot(model)
    x = make_inputs(family, batch=2, seed=2)
    t = torch.tensor([1, 3])
    with torch.no_grad():
        y = model(x).gather(1, t[:, None])[:, 0]
    for s in (0, 2, 3):
        ex = DecompX(model, start_layer=s, route="explicit").decompose(x, t)
        gr = DecompX(model, start_layer=s, route="gradient").decompose(x, t)
        torch.testing.assert_close(ex.tokens.sum(-1) + ex.bias, y, rtol=0, atol=1e-10)
        torch.testing.assert_close(gr.tokens, ex.tokens, rtol=0, atol=1e-10)
    assert_unchanged(model, before)


def test_lrp_through_post_norms_and_cosine_norms():
    """CP-LRP (identity rule, ε = 0) is DecompX's linearised backward on Swin V2 too (its
    LN rule on the post-norms and merges); without biases CP-LRP and AttnLRP with
    constant probabilities are conservative (tokens sum to the logit), and AttnLRP's own
    attention rule (LN rule on the cosine norms) runs."""
    import copy

    from captum_vit import CPLRP, AttnLRP

    model = make_model("timm_swinv2")
    x = make_inputs("timm_swinv2", batch=2)
    t = torch.tensor([0, 1])
    cp = CPLRP(model).attribute(x, t, output="tokens")
    assert_close_scaled(cp, DecompX(model).attribute(x, t, output="tokens"), rel=1e-10)
    assert_close_scaled(cp, DecompX(model, route="explicit").attribute(x, t, output="tokens"),
                        rel=1e-10)
    nobias = copy.deepcopy(model)
    with torch.no_grad():
        for name, prm in nobias.named_parameters():
            if name.endswith("bias"):
                prm.zero_()
    logit = adapt(nobias).model_logits(x).gather(1, t[:, None])[:, 0].detach()
    for method in (CPLRP(nobias), AttnLRP(nobias, attention="cp")):
        assert_close_scaled(method._token_maps(x, t).sum(-1), logit, rel=1e-10)
    m = AttnLRP(model).attribute(x, t, output="tokens")
    assert m.shape == (2, 64) and m.isfinite().all() and m.abs().sum() > 0


def test_wrong_size_refused_model_unchanged():
    model = make_model("timm_swinv2")
    before = snapshot(model)
    with pytest.raises(ValueError, match="fixed image_size"):
        GAE(model).attribute(torch.randn(1, 3, 40, 40, dtype=torch.float64), 0)
    with pytest.raises(ValueError, match="windows"):
        build_method("tis", model).attribute(make_inputs("timm_swinv2", batch=1), 0,
                                             n_masks=4)
    assert_unchanged(model, before)


def test_swin_v2_cr_still_refused_by_name():
    from timm.models.swin_transformer_v2_cr import SwinTransformerV2Cr

    model = SwinTransformerV2Cr(img_size=(32, 32), patch_size=4, embed_dim=16, depths=(2,),
                                num_heads=(2,), window_size=4, num_classes=3)
    with pytest.raises(TypeError, match="SwinTransformerV2Cr"):
        adapt(model)


# -- Hugging Face ---------------------------------------------------------------------------
@needs_transformers
@pytest.mark.parametrize("pad", [False, True])
def test_hf_forward_parity(pad):
    """Hugging Face pads before rolling and adds its seam mask twice (-200): logits equal
    to 1e-12 with and without padding, and equal to the timm twin's where nothing is
    padded."""
    family = "timm_swinv2_pad" if pad else "timm_swinv2"
    timm_model = make_model(family)
    x = make_inputs(family, batch=2)
    for pooled in (False, True):
        model = hf_swin_v2_twin(timm_model, pooled=pooled)
        before = snapshot(model)
        adapter = adapt(model)
        assert isinstance(adapter, HFSwinV2Adapter) and adapter.embedding is pooled
        assert all(b.window.pad_first and b.window.seam == -200.0 for b in adapter.blocks)
        with torch.no_grad():
            out = model(pixel_values=x)
            ref = out.pooler_output if pooled else out.logits
            assert (ref - adapter.run(adapter.embed(x))).abs().max() <= 1e-12
            if not pooled:
                diff = (timm_model(x) - ref).abs().max()
                assert diff > 1e-6 if pad else diff <= 1e-12  # the padding order differs
        assert_unchanged(model, before)


@needs_transformers
def test_hf_attention_probabilities_reference():
    """The probabilities equal Hugging Face's own (``output_attentions``), shifted
    windows (seam -200) included."""
    model = make_model("hf_swinv2")
    x = make_inputs("hf_swinv2", batch=2)
    with torch.no_grad():
        theirs = model(pixel_values=x, output_attentions=True).attentions
        ours = [r.attn for r in adapt(model).trace(x).blocks]
    # Hugging Face returns each stage's last layer's attention
    for s, last in enumerate((1, 3)):
        ref = theirs[s].reshape(2, -1, *theirs[s].shape[1:]).transpose(1, 2)
        torch.testing.assert_close(ours[last], ref, rtol=0, atol=1e-12)


def _twin_methods() -> list[str]:
    out = [m for m in available_methods(compositions=True) if m != "tis"]
    return out + ["plus:ixg", "skipplus:captum:Saliency"]


@needs_transformers
def test_same_maps_as_the_timm_twin():
    """Mapped weights, windows that divide the grids: every registered method (TIS
    refused on both) gives the timm twin's maps to 1e-10, and the head-less
    ``Swinv2Model`` with a vector target gives the pooled timm model's."""
    timm_model = make_model("timm_swinv2")
    model = hf_swin_v2_twin(timm_model)
    x = make_inputs("timm_swinv2", batch=2)
    t = torch.tensor([1, 3])
    for name in _twin_methods():
        kw = {**FAST.get(name, {}), "output": "tokens"}
        torch.manual_seed(0)
        ours = build_method(name, model).attribute(x, t, **kw)
        torch.manual_seed(0)
        ref = build_method(name, timm_model).attribute(x, t, **kw)
        assert_close_scaled(ours, ref, rel=1e-10, msg=name)


@needs_transformers
def test_swinv2_model_with_vector_targets():
    """``Swinv2Model`` outputs its pooled embedding: explained with vector targets;
    DecompX is complete against the dot product, GAE equals the timm twin's head-less
    reading (``num_classes=0``)."""
    timm_model = make_model("timm_swinv2")
    model = hf_swin_v2_twin(timm_model, pooled=True)
    assert adapt(model).num_classes == 32
    x = make_inputs("timm_swinv2", batch=2)
    vec = torch.randn(2, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    target = EmbeddingTarget(vec, similarity="dot")
    dec = DecompX(model, route="explicit").decompose(x, target)
    with torch.no_grad():
        score = (model(pixel_values=x).pooler_output * vec).sum(-1)
    torch.testing.assert_close(dec.tokens.sum(-1) + dec.bias, score, rtol=0, atol=1e-10)
    headless = _timm(num_classes=0)
    assert_close_scaled(GAE(model).attribute(x, target=target, output="tokens"),
                        GAE(headless).attribute(x, target=target, output="tokens"), rel=1e-10)


def test_value_outputs_through_the_post_norm():
    """BT-T's value vectors (``value_outputs``) pass the attention branch's post-norm
    linearised: ``γ ⊙ C(v_j W_O) / σ_j``, ``σ_j`` of the real branch output of token ``j``
    (from the model's own ``_attn``)."""
    model = make_model("timm_swinv2")
    ad = adapt(model)
    x = make_inputs("timm_swinv2", batch=2)
    with torch.no_grad():
        rec, p = ad.trace(x).blocks[1], ad.blocks[1]
        real = model.layers[0].blocks[1]._attn(rec.x.reshape(2, 8, 8, -1)).reshape(2, 64, -1)
        vo = F.linear(F.linear(rec.u, p.v_weight, p.v_bias), p.proj_weight)
        inv = torch.rsqrt(real.var(-1, unbiased=False, keepdim=True) + p.post_norm1.eps)
        want = (vo - vo.mean(-1, keepdim=True)) * inv * p.post_norm1.weight
        assert_close_scaled(p.value_outputs(rec.u, rec.attn), want, rel=1e-12)


def test_globenc_alti_reset_decomposition_without_ln2():
    """GlobEnc/ALTI on post-norm blocks: with ``mlp="decompx"`` the reset decomposition
    through the ops is complete (sources + bias = the block's output before its merge),
    with ``mlp="ln2"`` the MLP branch carries the decomposition of its input ``x_mid`` (no
    LN2), so the parts sum to ``2 x_mid``; the closed form (``reset_scores``, the default
    fast path) equals the ops' scores (``window_scores``) for both measures; the block
    matrices are row-stochastic."""
    from captum_vit import GlobEnc
    from captum_vit.methods.globenc_alti import decompose_block, reset_scores, window_scores

    model = make_model("timm_swinv2")
    ad = adapt(model)
    x = make_inputs("timm_swinv2", batch=2)
    tr = ad.trace(x)
    for l in (1, 2):
        rec = tr.blocks[l]
        before_merge = rec.mid + rec.ffn_out
        h = decompose_block(ad, rec.x, l, mlp="decompx", bias=True)
        assert_close_scaled(h.parts.sum(1), before_merge, rel=1e-10)
        h = decompose_block(ad, rec.x, l, mlp="ln2", bias=True)
        assert_close_scaled(h.parts.sum(1), 2 * rec.mid, rel=1e-10)
    for l, rec in enumerate(tr.blocks):  # the closed form equals the ops' decomposition
        for measure in ("globenc", "alti"):
            assert_close_scaled(reset_scores(ad, rec, l, measure),
                                window_scores(ad, rec.x, l, measure), rel=1e-10)
    for t in GlobEnc(model).block_matrices(x):  # window form; padded slots' rows are 0
        rows = t.sum(-1)
        rows = rows[rows > 0]
        torch.testing.assert_close(rows, torch.ones_like(rows), rtol=0, atol=1e-12)
