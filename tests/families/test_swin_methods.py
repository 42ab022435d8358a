"""Methods on Swin: the vector chains through windows and merges equal dense references
built here from the model's own forward (the full ``N × N`` attention of every block and
the merge matrices ``P``, on tiny grids); DecompX is complete through the merges; the
window reduction (one stage whose window covers the grid) gives the plain ViT's maps."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from timm.models.swin_transformer import window_partition

from captum_vit import (
    GAE,
    AttnGradCAM,
    DecompX,
    GradSAM,
    LeGrad,
    RawAttention,
    Rollout,
)
from captum_vit.adapters import adapt
from tests.helpers import assert_close_scaled, assert_unchanged, make_swin_model, snapshot


class DenseSwin:
    """Dense token-mixing matrices of a timm Swin from its own forward: every block's
    probabilities [B, H, N, N] (captured at ``WindowAttention.softmax`` with the explicit
    path, scattered with timm's own ``window_partition`` of the rolled, padded token ids)
    and their gradients, and every merge's ``P`` [N', N] (¼ on the real children)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = copy.deepcopy(model)
        self.blocks = [b for st in self.model.layers for b in st.blocks]
        self.probs: list[torch.Tensor] = []
        for blk in self.blocks:
            blk.attn.fused_attn = False
            blk.attn.softmax.register_forward_hook(self._grab)

    def _grab(self, module, args, out):
        out.retain_grad()
        self.probs.append(out)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.probs.clear()
        return self.model(x)

    @staticmethod
    def slots(blk) -> torch.Tensor:
        """[n_W, M] token id at each window slot, -1 at padding (timm's own partition)."""
        h, w = blk.input_resolution
        ids = torch.arange(h * w, dtype=torch.float64).reshape(1, h, w, 1)
        sh, sw = blk.shift_size
        if sh or sw:
            ids = torch.roll(ids, shifts=(-sh, -sw), dims=(1, 2))
        mh, mw = blk.window_size
        ids = F.pad(ids, (0, 0, 0, (mw - w % mw) % mw, 0, (mh - h % mh) % mh), value=-1)
        return window_partition(ids, (mh, mw)).reshape(-1, mh * mw).long()

    def dense(self, l: int, t: torch.Tensor) -> torch.Tensor:
        """Block ``l``'s window tensor [B * n_W, H, M, M] as [B, H, N, N]."""
        blk = self.blocks[l]
        idx = self.slots(blk)
        n = blk.input_resolution[0] * blk.input_resolution[1]
        nw, m = idx.shape
        t = t.reshape(-1, nw, *t.shape[1:])
        out = t.new_zeros(t.shape[0], t.shape[2], n, n)
        for w in range(nw):
            real = idx[w] >= 0
            r = idx[w][real]
            out[:, :, r[:, None], r[None, :]] = t[:, w][:, :, real][:, :, :, real]
        return out

    def merges(self) -> dict[int, torch.Tensor]:
        """Block index -> ``P`` [N', N] of the merge after it."""
        out, l = {}, -1
        for s, st in enumerate(self.model.layers):
            if s > 0:
                h, w = self.blocks[l].input_resolution
                hh, ww = (h + 1) // 2, (w + 1) // 2
                p = torch.zeros(hh * ww, h * w, dtype=torch.float64)
                for i in range(hh):
                    for j in range(ww):
                        kids = [(2 * i + a) * w + 2 * j + b for a in (0, 1) for b in (0, 1)
                                if 2 * i + a < h and 2 * j + b < w]
                        p[i * ww + j, kids] = 1.0 / len(kids)
                out[l] = p
            l += len(st.blocks)
        return out


def dense_setup(model, x):
    """The model, ``x``, the argmax targets, the :class:`DenseSwin` reference and every
    block's dense probabilities ``a`` and their gradients ``g`` (of the target logits)."""
    ref = DenseSwin(model)
    logits = ref(x)
    t = logits.argmax(-1)
    logits.gather(1, t[:, None]).sum().backward()
    a = [ref.dense(l, p.detach()) for l, p in enumerate(ref.probs)]
    g = [ref.dense(l, p.grad) for l, p in enumerate(ref.probs)]
    return model, x, t, ref, a, g


def _setup(family="timm_swin_pad", **kw):
    model = make_swin_model(family, **kw)
    size = model.patch_embed.img_size[0]
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(5),
                    dtype=torch.float64)
    return dense_setup(model, x)


CASES = [("timm_swin_pad", {}),  # padded windows, shifts, one merge
         ("timm_swin", {"img_size": 24, "depths": (2, 2, 2), "num_heads": (2, 2, 2)})]  # odd


def _down(v: torch.Tensor, merges: dict[int, torch.Tensor], l: int) -> torch.Tensor:
    """``v P_{l-1} ... P_0``: a row vector of block ``l``'s grid onto the first grid."""
    for k in sorted((k for k in merges if k < l), reverse=True):
        v = v @ merges[k]
    return v


def assert_chains_equal_references(model, x, t, a, g, merges, w):
    """Rollout, GAE and Grad-SAM of ``model`` equal their dense products over the blocks'
    probabilities ``a`` (gradients ``g``) and the merges' P, from the readout row ``w``."""
    L = len(a)
    # Rollout: v <- v P_k; v <- v (Ā_k + I) / rowsum
    v = w
    for k in reversed(range(L)):
        if k in merges:
            v = v @ merges[k]
        m = a[k].mean(1) + torch.eye(a[k].shape[-1], dtype=torch.float64)
        v = torch.einsum("bn,bnm->bm", v, m / m.sum(-1, keepdim=True))
    assert_close_scaled(Rollout(model).attribute(x, output="tokens"), v, rel=1e-10)

    # GAE: v <- v P_k; v <- v + v Ā_k, Ā = mean_h ReLU(∇A ⊙ A); Grad-SAM: Σ_l (w P) Ā_l
    abar = [(gk * ak).clamp(min=0).mean(1) for gk, ak in zip(g, a, strict=True)]
    v, gradsam = w, 0
    for k in reversed(range(L)):
        if k in merges:
            v = v @ merges[k]
        v = v + torch.einsum("bn,bnm->bm", v, abar[k])
        wk = w
        for j in sorted((j for j in merges if j >= k), reverse=True):
            wk = wk @ merges[j]
        gradsam = gradsam + _down(torch.einsum("bn,bnm->bm", wk, abar[k]), merges, k)
    assert_close_scaled(GAE(model).attribute(x, t, output="tokens"), v, rel=1e-10)
    assert_close_scaled(GradSAM(model).attribute(x, t, output="tokens"), gradsam, rel=1e-10)


@pytest.mark.parametrize(("family", "kw"), CASES)
def test_vector_chains_equal_dense_references(family, kw):
    """Rollout, RawAttention, GAE, Grad-SAM and attention Grad-CAM on Swin equal the
    dense products of the full N x N matrices and the merges' P (¼ weights)."""
    model, x, t, ref, a, g = _setup(family, **kw)
    before = snapshot(model)
    merges = ref.merges()
    L = len(a)
    n_last = a[-1].shape[-1]
    w = torch.full((2, n_last), 1.0 / n_last, dtype=torch.float64)
    assert_chains_equal_references(model, x, t, a, g, merges, w)

    # RawAttention and attention Grad-CAM read the last block; the last-stage map is
    # copied to its children on the first grid
    def up(m: torch.Tensor) -> torch.Tensor:
        for k in sorted(merges, reverse=True):
            m = m @ (merges[k] > 0).to(m.dtype)
        return m
    raw = up(torch.einsum("bn,bnm->bm", w, a[-1].mean(1)))
    assert_close_scaled(RawAttention(model).attribute(x, output="tokens"), raw, rel=1e-10)
    g_r = torch.einsum("bn,bhnm->bhm", w, g[-1])
    a_r = torch.einsum("bn,bhnm->bhm", w, a[-1])
    cam = up((g_r.mean(-1, keepdim=True) * a_r).mean(1).clamp(min=0))
    assert_close_scaled(AttnGradCAM(model).attribute(x, t, output="tokens"), cam, rel=1e-10)
    # LeGrad of the last block: mean_h mean_i ReLU(∂s/∂A)[i, j] over the N real queries
    legrad = up(g[-1].clamp(min=0).mean(1).sum(1) / n_last)
    assert_close_scaled(LeGrad(model, layers=[L - 1]).attribute(x, t, output="tokens"), legrad,
                        rel=1e-10)
    with pytest.raises(ValueError, match="last stage"):
        LeGrad(model, layers=[0]).attribute(x, t)
    assert_unchanged(model, before)


@pytest.mark.parametrize(("family", "kw"), CASES)
def test_decompx_complete_through_merges(family, kw):
    """Explicit DecompX on Swin (windows, padding, merges as LayerNorm with frozen
    statistics + linear): the token contributions and the bias source sum to the logit,
    from every start stage, and the gradient route gives the same numbers."""
    model = make_swin_model(family, **kw)
    size = model.patch_embed.img_size[0]
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(2),
                    dtype=torch.float64)
    t = torch.tensor([1, 3])
    with torch.no_grad():
        y = model(x).gather(1, t[:, None])[:, 0]
    for s in (0, 1, 2):
        ex = DecompX(model, start_layer=s, route="explicit").decompose(x, t)
        gr = DecompX(model, start_layer=s, route="gradient").decompose(x, t)
        assert ex.tokens.shape[1] == adapt(model).blocks[s].window.num_tokens
        torch.testing.assert_close(ex.tokens.sum(-1) + ex.bias, y, rtol=0, atol=1e-10)
        torch.testing.assert_close(gr.tokens, ex.tokens, rtol=0, atol=1e-10)
    # started at the second stage, the map on the first grid keeps the sum (shared by ¼)
    dx = DecompX(model, start_layer=2, route="explicit")
    m = dx.attribute(x, t, output="tokens")
    torch.testing.assert_close(m.sum(-1), dx.decompose(x, t).tokens.sum(-1), rtol=0,
                               atol=1e-12)


def _reduction_pair():
    """A one-stage Swin whose window covers its 8x8 grid (no shift, no merge; position
    bias zeroed) and the plain timm ViT with the same weights: no class token, no position
    embedding, the patch norm, mean readout after the final norm."""
    from timm.models.vision_transformer import VisionTransformer
    from torch import nn

    swin = make_swin_model("timm_swin", depths=(2,), num_heads=(2,), window_size=8)
    with torch.no_grad():
        for st in swin.layers:
            for blk in st.blocks:
                blk.attn.relative_position_bias_table.zero_()
    vit = VisionTransformer(img_size=32, patch_size=4, embed_dim=16, depth=2, num_heads=2,
                            mlp_ratio=2.0, num_classes=5, class_token=False,
                            global_pool="avg", fc_norm=False, pos_embed="none",
                            embed_norm_layer=nn.LayerNorm, norm_layer=nn.LayerNorm
                            ).double().eval()
    sd = {"patch_embed.proj.weight": "patch_embed.proj.weight",
          "patch_embed.proj.bias": "patch_embed.proj.bias",
          "patch_embed.norm.weight": "patch_embed.norm.weight",
          "patch_embed.norm.bias": "patch_embed.norm.bias",
          "norm.weight": "norm.weight", "norm.bias": "norm.bias",
          "head.weight": "head.fc.weight", "head.bias": "head.fc.bias"}
    for i in range(2):
        for part in ("norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2"):
            for kind in ("weight", "bias"):
                sd[f"blocks.{i}.{part}.{kind}"] = f"layers.0.blocks.{i}.{part}.{kind}"
    src = swin.state_dict()
    vit.load_state_dict({k: src[v] for k, v in sd.items()}, strict=True)
    return swin, vit


REDUCTION_METHODS = ["raw_attention", "rollout", "gae", "attn_gradcam", "attcat", "tokentm",
                     "legrad", "bt_h", "bt_t",
                     "tokentm_residual", "skipplus:tokentm",
                     "token_ixg", "att_ixg", "decompx", "vanilla_grad", "attn_grad", "gradsam",
                     "gradcam", "gradcam_pp", "xgradcam", "layercam", "hirescam", "cp_lrp",
                     "attnlrp", "chefer21", "tam", "fullgrad_plus", "skip_fullgrad_plus",
                     "rise", "vit_cx", "scorecam", "plus:decompx", "skipplus:gae",
                     "plus:attn_gradcam", "skipplus:attcat", "globenc", "alti",
                     "skipplus:globenc", "plus:alti"]


def test_window_reduction_gives_the_plain_vit_maps():
    """Window = the whole grid, one stage, no shift: every method that runs on Swin gives
    the maps of the equivalent plain ViT (no class token, mean readout)."""
    from captum_vit.registry import build_method

    swin, vit = _reduction_pair()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(4),
                    dtype=torch.float64)
    torch.testing.assert_close(swin(x), vit(x), rtol=0, atol=1e-12)
    win = adapt(swin).blocks[0].window
    assert win.grid == win.size == (8, 8) and win.shift == (0, 0)
    t = torch.tensor([1, 3])
    fast = {"rise": {"n_masks": 16}, "tam": {"n_steps": 3, "start_layer": 0},
            "bt_h": {"n_steps": 3, "start_layer": 0}, "bt_t": {"n_steps": 3, "start_layer": 0}}
    for name in REDUCTION_METHODS:
        kw = {**fast.get(name, {}), "output": "tokens"}
        ours = build_method(name, swin).attribute(x, t, **kw)
        ref = build_method(name, vit).attribute(x, t, **kw)
        assert_close_scaled(ours, ref, rel=1e-9)


def test_per_head_maps_average_to_the_map():
    """``heads="all"`` on Swin: one map per head of the last block (the last stage's
    heads), whose mean is the map."""
    model = make_swin_model("timm_swin_pad")
    x = torch.randn(2, 3, 40, 40, dtype=torch.float64)
    for cls in (GAE, Rollout, RawAttention, AttnGradCAM):
        per_head = cls(model).attribute(x, [1, 2], heads="all", output="tokens")
        assert per_head.shape == (2, 4, 100)
        mean = per_head.mean(1)
        if cls is AttnGradCAM:
            mean = mean.clamp(min=0)
        assert_close_scaled(mean, cls(model).attribute(x, [1, 2], output="tokens"), rel=1e-12)


@pytest.mark.parametrize(("family", "kw"), CASES)
def test_tokentm_chain_equals_dense_reference(family, kw):
    """TokenTM on Swin: ``r ← r P_k`` with the merge's length weights, then
    ``r ← r U_ffn U_attn`` with the dense ``N × N`` matrices; the map ``r diag(L(x_0))``."""
    from captum_vit import TokenTM
    from captum_vit.methods.tokentm import head_weights, merge_weights, transformation_weights

    model, x, t, ref, a, _ = _setup(family, **kw)
    ad = adapt(model)
    tr = ad.trace(x, grad=True)
    probs = [rec.attn for rec in tr.blocks]
    logits = tr.logits
    score = logits.softmax(-1).gather(1, t[:, None]).sum()  # TokenTM's default score
    grads = torch.autograd.grad(score, probs)
    g = [ref.dense(l, p.transpose(1, 2).reshape(-1, *p.shape[1:2], *p.shape[3:]))
         for l, p in enumerate(grads)]
    merges = {l: b.merge for l, b in enumerate(ad.blocks) if b.merge is not None}
    n_last = a[-1].shape[-1]
    r = torch.full((2, n_last), 1.0 / n_last, dtype=torch.float64)
    with torch.no_grad():
        for l in reversed(range(len(a))):
            rec, p = tr.blocks[l], ad.blocks[l]
            xl, mid, u = rec.x.detach(), rec.mid.detach(), rec.u.detach()
            pre = mid + rec.ffn_out.detach()
            if l in merges:  # dense P with TokenTM's weights, rows = merged tokens
                w = merge_weights(merges[l], pre)
                kids = merges[l].children()
                dense = torch.zeros(2, kids.shape[0], pre.shape[1], dtype=torch.float64)
                for k in range(4):
                    real = kids[:, k] >= 0
                    dense[:, real.nonzero()[:, 0], kids[real, k]] = w[:, real, k]
                r = torch.einsum("bn,bnm->bm", r, dense)
            r = r * (1 + transformation_weights(mid, rec.ffn_out.detach()))  # Eq. 16
            wh = head_weights(xl, u, p.v_weight.detach(), p.proj_weight.detach(), p.num_heads)
            rh = torch.einsum("bn,bhnm->bhm", r, g[l].relu() * a[l])
            r = r + (rh * wh).mean(1)
        expected = r * tr.blocks[0].x.detach().norm(dim=-1)
    assert_close_scaled(TokenTM(model).attribute(x, t, output="tokens"), expected, rel=1e-10)


@pytest.mark.parametrize(("family", "kw"), CASES)
def test_bt_h_chain_equals_dense_reference(family, kw):
    """BT-H on Swin: ``R ← R P_k``, ``R ← R + R Â_k`` (``Â_k = Σ_h I_h A_k^h``) with dense
    matrices from the model's own forward; the map ``w (W ⊙ R)`` with the reasoning
    feedback's columns copied to their children (the method's own ``W``)."""
    from captum_vit import BTH
    from captum_vit.methods.bt import reasoning_feedback

    model, x, t, ref, a, g = _setup(family, **kw)
    # BT's score is the logit (the gradients g of _setup are of the logit too)
    ad = adapt(model)
    merges = ref.merges()
    L, n_last = len(a), a[-1].shape[-1]
    w = torch.full((2, n_last), 1.0 / n_last, dtype=torch.float64)
    fb = ad.blocks[-1].window.dense(reasoning_feedback(ad, x, t, n_steps=3))
    with torch.no_grad():
        r = torch.eye(n_last, dtype=torch.float64).expand(2, -1, -1)
        for k in reversed(range(L)):
            if k in merges:
                r = r @ merges[k]
                fb = fb @ (merges[k] > 0).to(fb.dtype)  # W's columns copied to children
            ih = (a[k].transpose(-1, -2) @ g[k]).abs().mean((-2, -1))
            ih = ih / ih.sum(1, keepdim=True)
            r = r + r @ torch.einsum("bh,bhij->bij", ih, a[k])
        expected = torch.einsum("bs,bsn->bn", w, fb * r)
    got = BTH(model, start_layer=0, n_steps=3).attribute(x, t, output="tokens")
    assert_close_scaled(got, expected, rel=1e-10)
