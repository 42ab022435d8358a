"""RISE (SPEC_NEXT §8.10), and ViT-CX (§8.11) where both share a check: the mask generators
against scipy, RISE against a slow loop over the model's own forward (and timm's own modules
for token removal), seeding, batch invariance, forwards counted, a known-answer toy model,
PLUS/SkipPLUS per block, and clear errors. ViT-CX's own checks: tests/methods/test_vitcx.py."""

from __future__ import annotations

import math

import pytest
import scipy.ndimage as ndi
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer

import captum_vit.methods.rise as rise_module
from captum_vit import PLUS, RISE, SkipPLUS, ViTCX
from captum_vit.adapters import SubnetworkAdapter, adapt
from captum_vit.methods._masks import interpolation_matrix, patch_means
from captum_vit.methods.rise import rise_masks
from tests.helpers import assert_close_scaled, assert_unchanged, make_inputs, make_model, snapshot

TARGETS = torch.tensor([1, 4, 0])
_MODELS: dict[str, torch.nn.Module] = {}


def model_of(family: str = "vit") -> torch.nn.Module:
    if family not in _MODELS:
        _MODELS[family] = make_model(family)
    return _MODELS[family]


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-10) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=tol * (1 + b.abs().max().item()))


class CountForwards:
    """Images passed through the model's own ``forward`` (not the adapter's)."""

    def __init__(self, model: torch.nn.Module) -> None:
        adapt(model).self_check(make_inputs("vit"))  # once per model: not the method's
        self.images = 0
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, module, args, out) -> None:
        self.images += args[0].shape[0]

    def __enter__(self) -> CountForwards:
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


def patch_means_loop(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """Mean of a [H, W] map over each patch x patch square, raster order (loops)."""
    h, w = pixels.shape
    return torch.stack([pixels[r:r + patch, c:c + patch].mean()
                        for r in range(0, h, patch) for c in range(0, w, patch)])


# -- interpolation and the RISE masks --------------------------------------------------------
def test_interpolation_matrices_match_torch_and_scipy():
    g = torch.rand(3, 5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ours = interpolation_matrix(5, 24, "clamp") @ g @ interpolation_matrix(7, 40, "clamp").T
    assert_close_scaled(ours, F.interpolate(g[None], size=(24, 40), mode="bilinear",
                                            align_corners=False)[0])
    for s, out in ((7, 40), (8, 36), (3, 16)):  # skimage resize(order=1, mode="reflect")
        grid = (torch.rand(s, s, generator=torch.Generator().manual_seed(s)) < 0.5).double()
        ref = ndi.zoom(grid.numpy(), out / s, order=1, mode="mirror", grid_mode=True)
        u = interpolation_matrix(s, out, "mirror")
        assert_close_scaled(u @ grid @ u.T, torch.from_numpy(ref))
        assert torch.allclose(u.sum(1), torch.ones(out, dtype=torch.float64))


@pytest.mark.parametrize(("size", "s", "p"), [((32, 32), 7, 0.5), ((24, 40), 5, 0.1)])
def test_rise_masks_follow_the_authors_construction(size, s, p):
    """Grids, then row offsets, then column offsets from the generator; each mask is
    skimage's linear resize (scipy zoom, mirror edges) to (s+1)·ceil(H/s), cropped at its
    offset; values in [0, 1], mean ≈ p."""
    n, (h, w) = 1500, size
    masks = rise_masks(n, s, p, size, generator=torch.Generator().manual_seed(3))
    m = masks.materialize(torch.arange(n), torch.float64)
    assert m.shape == (n, h, w) and m.min() >= 0 and m.max() <= 1
    assert abs(m.mean().item() - p) < 0.02
    g = torch.Generator().manual_seed(3)
    grids = (torch.rand(n, s, s, generator=g, dtype=torch.float64) < p).double().numpy()
    ch, cw = math.ceil(h / s), math.ceil(w / s)
    ox = torch.randint(0, ch, (n,), generator=g)
    oy = torch.randint(0, cw, (n,), generator=g)
    assert ox.max() < ch and oy.max() < cw
    for i in range(0, n, 97):
        up = ndi.zoom(grids[i], ((s + 1) * ch / s, (s + 1) * cw / s), order=1, mode="mirror",
                      grid_mode=True)
        assert up.shape == ((s + 1) * ch, (s + 1) * cw)
        ref = torch.from_numpy(up[ox[i]:ox[i] + h, oy[i]:oy[i] + w].copy())
        assert_close_scaled(m[i], ref)
    tokens = rise_masks(200, (3, 5), p, generator=torch.Generator().manual_seed(0))
    assert tokens.grids.shape == (200, 3, 5) and tokens.grids.dtype == torch.bool


# -- RISE against slow references ----------------------------------------------------------
def rise_reference(model, x, target, masks, p, fill=None):
    """The paper's sum, one masked image at a time through the model's own forward."""
    out = []
    for b in range(len(x)):
        sal = torch.zeros(x.shape[-2:], dtype=torch.float64)
        for m in masks:
            xm = x[b] * m if fill is None else x[b] * m + fill * (1 - m)
            with torch.no_grad():
                prob = model(xm[None]).softmax(-1)[0, target[b]]
            sal += prob * m
        out.append(patch_means_loop(sal / (len(masks) * p), 8))
    return torch.stack(out)


def test_rise_pixels_equals_the_slow_loop_and_counts_forwards():
    model, x = model_of(), make_inputs("vit")
    before = snapshot(model)
    n, p = 24, 0.5
    masks = rise_masks(n, 7, p, (32, 32), generator=torch.Generator().manual_seed(5))
    m = masks.materialize(torch.arange(n), torch.float64)
    rise = RISE(model, seed=5)
    with CountForwards(model) as count:
        got = rise.attribute(x, TARGETS, n_masks=n, output="tokens", batch_size=7)
    assert count.images == rise.num_forwards == n * 3
    close(got, rise_reference(model, x, TARGETS, m, p))
    baseline = torch.rand(3, 32, 32, dtype=torch.float64)
    close(rise.attribute(x, TARGETS, n_masks=n, fill=baseline, output="tokens"),
          rise_reference(model, x, TARGETS, m, p, fill=baseline))
    rise.attribute(x, None, n_masks=n)
    assert rise.num_forwards == n * 3 + 3  # + the clean forward for the predicted class
    # pixel output: the token map copied to the patch's pixels (the library's formats)
    pixels = rise.attribute(x, TARGETS, n_masks=n)
    close(pixels[:, 0, ::8, ::8].reshape(3, -1), got)
    assert_unchanged(model, before)


def timm_removed_logits(model, x, keep):
    """timm's own modules on the class token plus the kept patch tokens (one image)."""
    with torch.no_grad():
        t = model._pos_embed(model.patch_embed(x[None]))
        t = torch.cat([t[:, :1], t[:, 1 + keep]], 1)
        return model.forward_head(model.norm(model.blocks(model.norm_pre(t))))[0]


def test_rise_tokens_uses_the_subset_engine_and_equals_timm(monkeypatch):
    model, x = model_of(), make_inputs("vit")
    n, p = 20, 0.5
    calls = []
    engine = rise_module.subset_logits
    monkeypatch.setattr(rise_module, "subset_logits",
                        lambda *a, **k: calls.append(1) or engine(*a, **k))
    rise = RISE(model, seed=2)
    with CountForwards(model) as count:
        got = rise.attribute(x, TARGETS, n_masks=n, removal="tokens", output="tokens")
    assert calls and count.images == 0  # no pixel-masked image went through the model
    grids = rise_masks(n, (4, 4), p, generator=torch.Generator().manual_seed(2)).grids
    keep = grids.reshape(n, 16)
    ref = torch.zeros(3, 16, dtype=torch.float64)
    for b in range(3):
        for mk in keep:
            prob = timm_removed_logits(model, x[b], mk.nonzero()[:, 0]).softmax(-1)[TARGETS[b]]
            ref[b] += prob * mk
    close(got, ref / (n * p))
    assert rise.num_forwards == 3 * n  # a target given: no clean logits to reuse
    rise.attribute(x, None, n_masks=n, removal="tokens")
    assert rise.num_forwards == 3 + 3 * (n - int(keep.all(-1).sum()))


# -- seeding, batches, families, dtypes ------------------------------------------------------
@pytest.mark.parametrize("family", ["vit", "registers", "nonsquare", "eva02", "map"])
def test_seeded_repeatable_and_batch_invariant(family):
    model, x = make_model(family), make_inputs(family)
    before = snapshot(model)
    for cls, kw in ((RISE, {"n_masks": 12}), (ViTCX, {})):
        a = cls(model, seed=1).attribute(x, TARGETS, output="tokens", **kw)
        assert torch.equal(a, cls(model, seed=1).attribute(x, TARGETS, output="tokens", **kw))
        assert not torch.equal(a, cls(model, seed=2).attribute(x, TARGETS, output="tokens",
                                                                **kw))
        one = torch.cat([cls(model, seed=1).attribute(x[i:i + 1], int(TARGETS[i]),
                                                      output="tokens", **kw)
                         for i in range(3)])
        close(one, a)
        tokens = cls(model, seed=1).attribute(x, TARGETS, removal="tokens", output="tokens",
                                              **kw)
        assert torch.isfinite(tokens).all()
    assert_unchanged(model, before)


def test_float32_inputs_give_float32_maps():
    model, x = make_model("vit", dtype=torch.float32), make_inputs("vit", dtype=torch.float32)
    for method, kw in ((RISE(model), {"n_masks": 8}), (ViTCX(model), {})):
        out = method.attribute(x, TARGETS, **kw)
        assert out.dtype == torch.float32 and out.shape == x.shape
        assert torch.isfinite(out).all()


# -- known answer ------------------------------------------------------------------------------
def one_patch_model(j: int = 5) -> torch.nn.Module:
    """A timm ViT whose output depends on patch ``j`` only: the class token attends to
    patch ``j`` (its position embedding is the only key), or, if ``j`` is removed, to
    itself (= ``j`` with no content); the class-0 logit increases with the mean pixel
    value of patch ``j``; blocks' MLPs are off."""
    m = VisionTransformer(img_size=32, patch_size=8, embed_dim=8, depth=1, num_heads=1,
                          mlp_ratio=1.0, num_classes=2, qkv_bias=True).double().eval()
    s = 7.0
    with torch.no_grad():
        for prm in m.parameters():
            prm.zero_()
        for norm in (m.blocks[0].norm1, m.blocks[0].norm2, m.norm):
            norm.weight.fill_(1)
        m.patch_embed.proj.weight[2] = 1 / 192  # feature 2: mean pixel value of a patch
        m.cls_token[0, 0, 1] = 10  # the query direction
        m.pos_embed[0, 1 + j, 0] = 10  # the key of patch j
        qkv = m.blocks[0].attn.qkv.weight  # rows: q 0..7, k 8..15, v 16..23
        qkv[0, 1], qkv[8, 0], qkv[8, 1], qkv[16 + 3, 2] = s, s, s / 2, 1
        m.blocks[0].attn.proj.weight[3, 3] = 1
        m.head.weight[0, 3], m.head.bias[0] = 60, 60 * 0.44
    return m


def test_known_answer_one_patch_model():
    model = one_patch_model(5)
    x = 1 + 0.1 * torch.rand(2, 3, 32, 32, dtype=torch.float64,
                             generator=torch.Generator().manual_seed(0))
    other = x.clone()
    other[:, :, :8, :8] = 0  # patch 0 (not j) changes nothing
    assert_close_scaled(model(other), model(x))
    for removal in ("pixels", "tokens"):
        r = RISE(model).attribute(x, 0, n_masks=200, removal=removal, output="tokens")
        c = ViTCX(model).attribute(x, 0, removal=removal, output="tokens")
        assert (r.argmax(1) == 5).all() and (c.argmax(1) == 5).all(), (removal, r, c)


# -- PLUS / SkipPLUS ---------------------------------------------------------------------------
def test_plus_removes_tokens_of_the_block_input():
    model, x = model_of(), make_inputs("vit")
    ad = adapt(model)
    before = snapshot(model)
    n, p = 6, 0.5
    with pytest.warns(UserWarning, match="perturbation method RISE once per included block"):
        plus = PLUS(model, "rise", layers=[1, 2])
    got = plus.attribute(x, TARGETS, n_masks=n, output="tokens")
    keep = rise_masks(n, (4, 4), p, generator=torch.Generator().manual_seed(0)).grids
    keep = keep.reshape(n, 16)
    states = ad.trace(x).states
    ref = 0
    for l in (1, 2):
        with torch.no_grad():
            probs = torch.stack([ad.run(states[l], start=l, keep=mk[None].expand(3, -1))
                                 .softmax(-1).gather(1, TARGETS[:, None])[:, 0]
                                 for mk in keep], 1)
        ref = ref + probs @ keep.double() / (n * p)
    close(got, ref)
    for name in ("rise", "vit_cx"):
        out = SkipPLUS(model, name).attribute(x, TARGETS, output="tokens",
                                              **({"n_masks": 8} if name == "rise" else {}))
        assert out.shape == (3, 16) and torch.isfinite(out).all()
    assert_unchanged(model, before)


# -- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kw", "err", "match"), [
    ({"n_masks": 0}, ValueError, "n_masks"), ({"n_masks": 2.0}, TypeError, "n_masks"),
    ({"p": 0.0}, ValueError, "p must"), ({"p": 1.5}, ValueError, "p must"),
    ({"grid_size": 0}, ValueError, "grid_size"), ({"removal": "blur"}, ValueError, "removal"),
    ({"removal": "tokens", "grid_size": 4}, ValueError, "grid_size"),
    ({"removal": "tokens", "fill": 0.5}, ValueError, "fill"),
    ({"fill": torch.zeros(2, 32, 32, dtype=torch.float64)}, ValueError, "fill"),
    ({"fill": torch.zeros(3, 32, 32, dtype=torch.long)}, TypeError, "fill"),
    ({"fill": "grey"}, TypeError, "fill"), ({"batch_size": 0}, ValueError, "batch_size"),
    ({"score": "prob"}, ValueError, "score"), ({"show_progress": 1}, TypeError, "show_progress"),
])
def test_rise_errors_name_the_argument(kw, err, match):
    model, x = model_of(), make_inputs("vit")
    with pytest.raises(err, match=match):
        RISE(model).attribute(x, TARGETS, **{"n_masks": 4, **kw})


def test_constructor_and_subnetwork_errors():
    model, x = model_of(), make_inputs("vit")
    with pytest.raises(ValueError, match="seed"):
        RISE(model, seed=-1)
    with pytest.raises(TypeError, match="seed"):
        ViTCX(model, seed="0")
    view = SubnetworkAdapter(adapt(model), 1)
    with pytest.raises(ValueError, match="removal='tokens'"):
        RISE(view).attribute(x, TARGETS, n_masks=4, removal="pixels")
    assert RISE(view).attribute(x, TARGETS, n_masks=4, output="tokens").shape == (3, 16)


def test_patch_means_handles_partial_patches():
    from captum_vit.adapters import Layout

    lay = Layout(1, (2, 3), (4, 4), "token", 1, 1, (2, 3))
    pix = torch.arange(7 * 10, dtype=torch.float64).reshape(1, 7, 10)
    got = patch_means(pix, lay)
    ref = torch.stack([pix[0, r:r + 4, c:c + 4].mean() for r in (0, 4) for c in (0, 4, 8)])
    assert_close_scaled(got[0], ref)
