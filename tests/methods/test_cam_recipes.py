"""CAM recipes against slow float64 references: GradCAM++'s and XGradCAM's ε (defaults
from pytorch-grad-cam 1.5.7, and a user ε), the ``at="norm1"`` site (block ``l``'s first
LayerNorm output, the layer of pytorch-grad-cam's ViT recipe) for the gradient CAMs and
Score-CAM, and, when grad-cam is installed, pytorch-grad-cam itself.

The references read ``X`` and ``G`` through the model's OWN forward (a forward hook on the
norm module, or a forward pre-hook on the block) and ``torch.autograd``, never through the
adapter, and apply each rule one scalar at a time in Python floats."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from captum_vit import PLUS
from captum_vit.adapters import adapt
from captum_vit.methods.cam import (
    GRADCAM_PP_EPS,
    XGRADCAM_EPS,
    GradCAM,
    GradCAMElementWise,
    GradCAMPlusPlus,
    HiResCAM,
    LayerCAM,
    XGradCAM,
    block_gradients,
)
from captum_vit.methods.scorecam import ScoreCAM
from tests.helpers import (
    assert_unchanged,
    family_marks,
    make_inputs,
    make_model,
    snapshot,
)

REL = 1e-10
TARGET = torch.tensor([2, 4])
PATCH = 8  # make_model's patch size

# (rule, class, constructor options) of the gradient CAMs read at norm1
NORM1_VARIANTS = [
    ("gradcam", GradCAM, {"weight_tokens": "patches"}),
    ("gradcam", GradCAM, {}),
    ("gradcam_pp", GradCAMPlusPlus, {"weight_tokens": "patches"}),
    ("xgradcam", XGradCAM, {"weight_tokens": "patches"}),
    ("xgradcam_plus", XGradCAM, {"plus": True}),
    ("layercam", LayerCAM, {}),
    ("hirescam", HiResCAM, {}),
    ("elementwise", GradCAMElementWise, {}),
]


# --- the model's own modules ------------------------------------------------------------------

def blocks_of(model: nn.Module) -> list[nn.Module]:
    return list(model.blocks) if hasattr(model, "blocks") else list(model.vit.layers)


def norm1_of(model: nn.Module, layer: int) -> nn.Module:
    """The pre-attention LayerNorm of block ``layer`` by its name in the model's family."""
    block = blocks_of(model)[layer]
    return block.norm1 if hasattr(block, "norm1") else block.layernorm_before


def model_logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x) if hasattr(model, "blocks") else model(pixel_values=x)
    return out if isinstance(out, torch.Tensor) else out.logits


def num_prefix(model: nn.Module) -> int:
    return adapt(model).num_prefix  # a count, not a computation


def hooked_xg(model, x, target, layer, at="norm1", score="logit"):
    """``X`` = block ``layer``'s norm1 output (forward hook) or input (pre-hook) and
    ``G = d s / d X`` through the model's own forward."""
    grabbed = []
    if at == "norm1":
        handle = norm1_of(model, layer).register_forward_hook(
            lambda module, args, out: grabbed.append(out))
    else:
        handle = blocks_of(model)[layer].register_forward_pre_hook(
            lambda module, args, kwargs: grabbed.append(args[0] if args
                                                        else kwargs["hidden_states"]),
            with_kwargs=True)
    try:
        logits = model_logits(model, x)
    finally:
        handle.remove()
    assert len(grabbed) == 1
    s = logits.softmax(-1) if score == "probability" else logits
    (g,) = torch.autograd.grad(s[torch.arange(len(x)), target].sum(), [grabbed[0]])
    return grabbed[0].detach(), g


def reference_cam(rule, X, G, k, weight_tokens="all", eps=None):
    """One rule, one scalar at a time (Python floats), before the ReLU: ``(map [B, N],
    scale)``, ``scale`` = the largest ``sum_c |term_c|`` of a token (a sum over channels is
    only as exact as its terms)."""
    B, N, D = X.shape
    X, G = X.tolist(), G.tolist()
    T = range(k, N) if weight_tokens == "patches" else range(N)
    out = torch.zeros(B, N, dtype=torch.float64)
    scale = 0.0
    for b in range(B):
        m, mags = [0.0] * N, [0.0] * N
        for c in range(D):
            xs, gs = [X[b][t][c] for t in T], [G[b][t][c] for t in T]
            if rule == "gradcam":
                w = sum(gs) / len(gs)
            elif rule == "gradcam_pp":
                total = sum(xs)
                w = sum((gi ** 2 / (2 * gi ** 2 + total * gi ** 3 + eps) if gi != 0 else 0.0)
                        * max(gi, 0.0) for gi in gs)
            elif rule == "xgradcam":
                w = sum(gs[i] * xs[i] for i in range(len(xs))) / (sum(xs) + eps)
            elif rule == "xgradcam_plus":
                w = (sum(gs[i] * abs(xs[i]) for i in range(len(xs)))
                     / (sum(abs(v) for v in xs) + eps))
            for j in range(N):
                x, g = X[b][j][c], G[b][j][c]
                if rule == "layercam":
                    term = max(g, 0.0) * x
                elif rule == "hirescam":
                    term = g * x
                elif rule == "elementwise":
                    term = max(g * x, 0.0)
                else:
                    term = w * x
                m[j] += term
                mags[j] += abs(term)
        out[b] = torch.tensor(m, dtype=torch.float64)
        scale = max(scale, *mags)
    return out, scale


def default_eps(rule):
    return {"gradcam_pp": 1e-6, "xgradcam": 1e-7, "xgradcam_plus": 1e-7}.get(rule)


def assert_close(out, ref, scale):
    assert out.shape == ref.shape, (out.shape, ref.shape)
    scale = max(ref.abs().max().item(), scale)
    err = (out - ref).abs().max().item()
    assert err <= REL * scale, f"max abs error {err:.3g} vs scale {scale:.3g}"


def tokens(method, x, target=TARGET, **kw):
    return method.attribute(x, target=target, output="tokens", **kw)


# --- ε -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("weight_tokens", ["all", "patches"])
def test_gradcam_pp_eps_default_and_user_value(weight_tokens):
    """GradCAM++ uses pytorch-grad-cam's 1e-6 by default and ``eps=`` otherwise; on these
    tokens ε is not negligible (1e-6 and 1e-7 give clearly different maps)."""
    model, x = make_model("vit"), make_inputs("vit", batch=2)
    before = snapshot(model)
    L, k = len(blocks_of(model)), num_prefix(model)
    X, G = hooked_xg(model, x, TARGET, L - 1, at="residual")
    assert GRADCAM_PP_EPS == 1e-6
    maps = {}
    for eps, kw in ((1e-6, {}), (1e-7, {"eps": 1e-7}), (1e-4, {"eps": 1e-4}),
                    (0.0, {"eps": 0.0}), (2e-6, {"eps": 2e-6})):
        ref, scale = reference_cam("gradcam_pp", X, G, k, weight_tokens, eps)
        out = tokens(GradCAMPlusPlus(model, relu=False, weight_tokens=weight_tokens, **kw), x)
        assert out.dtype == torch.float64
        assert_close(out, ref[:, k:], scale)
        maps[eps] = (out, scale)
        relu = tokens(GradCAMPlusPlus(model, weight_tokens=weight_tokens, **kw), x)
        assert_close(relu, ref[:, k:].clamp(min=0), scale)
    assert GradCAMPlusPlus(model, eps=3e-6).eps == 3e-6
    # the default is not the old 1e-7: the maps differ far beyond the tolerance
    (m6, s6), (m7, _) = maps[1e-6], maps[1e-7]
    assert (m6 - m7).abs().max().item() > 1e3 * REL * max(m6.abs().max().item(), s6)
    assert_unchanged(model, before)


@pytest.mark.parametrize("plus", [False, True])
def test_xgradcam_eps_default_and_user_value(plus):
    model, x = make_model("registers"), make_inputs("registers", batch=2)
    L, k = len(blocks_of(model)), num_prefix(model)
    X, G = hooked_xg(model, x, TARGET, L - 1, at="residual")
    rule = "xgradcam_plus" if plus else "xgradcam"
    assert XGRADCAM_EPS == 1e-7
    for eps, kw in ((1e-7, {}), (0.5, {"eps": 0.5})):
        ref, scale = reference_cam(rule, X, G, k, "all", eps)
        out = tokens(XGradCAM(model, relu=False, plus=plus, **kw), x)
        assert_close(out, ref[:, k:], scale)


def test_eps_and_at_are_checked():
    model = make_model("vit")
    for cls in (GradCAMPlusPlus, XGradCAM):
        with pytest.raises(ValueError, match="eps"):
            cls(model, eps=-1e-6)
        with pytest.raises(TypeError, match="eps"):
            cls(model, eps="1e-6")
    for cls in (GradCAM, GradCAMPlusPlus, XGradCAM, LayerCAM, HiResCAM, GradCAMElementWise,
                ScoreCAM):
        with pytest.raises(ValueError, match="at must be one of"):
            cls(model, at="norm2")
        assert cls(model).at == "residual"
    a, x = adapt(model), make_inputs("vit", batch=1)
    with pytest.raises(ValueError, match="norm1"):
        block_gradients(a, x, None, [a.num_blocks], at="norm1")


# --- at="norm1": pytorch-grad-cam's ViT layer ------------------------------------------------

@pytest.mark.parametrize("family", [pytest.param(f, marks=family_marks(f))
                                    for f in ("vit", "registers", "beit", "hf_vit")])
def test_norm1_gradcam_recipe_equals_the_hooked_reference(family):
    """GradCAM(at="norm1", weight_tokens="patches"): A = norm1's output of block l, G its
    gradient, w = mean of G over the patch tokens, map = ReLU(sum_c w_c A[t, c])."""
    model, x = make_model(family), make_inputs(family, batch=2)
    before = snapshot(model)
    L, k = len(blocks_of(model)), num_prefix(model)
    for layer in (L - 1, 0):
        A, G = hooked_xg(model, x, TARGET, layer)
        Ap, Gp = A[:, k:], G[:, k:]  # pytorch-grad-cam's reshape drops the prefix tokens
        w = Gp.mean(1)  # [B, D]
        recipe = torch.einsum("bpd,bd->bp", Ap, w).clamp(min=0)
        kw = {} if layer == L - 1 else {"layer": layer}
        out = tokens(GradCAM(model, at="norm1", weight_tokens="patches", **kw), x)
        scale = (Ap.abs() * w.abs()[:, None]).sum(-1).max().item()
        assert_close(out, recipe, scale)
        # not the residual stream's map
        residual = tokens(GradCAM(model, weight_tokens="patches", **kw), x)
        assert (out - residual).abs().max() > 1e-3 * out.abs().max()
    assert_unchanged(model, before)


@pytest.mark.parametrize("family", [pytest.param(f, marks=family_marks(f))
                                    for f in ("vit", "hf_vit")])
def test_every_cam_at_norm1_equals_the_slow_reference(family):
    model, x = make_model(family), make_inputs(family, batch=2)
    before = snapshot(model)
    L, k = len(blocks_of(model)), num_prefix(model)
    for layer, score in ((L - 1, "logit"), (1, "probability")):
        A, G = hooked_xg(model, x, TARGET, layer, score=score)
        for rule, cls, kw in NORM1_VARIANTS:
            ref, scale = reference_cam(rule, A, G, k, kw.get("weight_tokens", "all"),
                                       default_eps(rule))
            out = tokens(cls(model, layer=layer, relu=False, at="norm1", **kw), x,
                         score=score)
            assert_close(out, ref[:, k:], scale)
            out = tokens(cls(model, layer=layer, at="norm1", **kw), x, score=score)
            assert_close(out, ref[:, k:].clamp(min=0), scale)
    assert_unchanged(model, before)


def test_norm1_plus_fast_path_and_block_gradients():
    """The PLUS hook (one backward, every block's norm1) equals the method at each block
    and the generic one-block-window route."""
    model, x = make_model("vit"), make_inputs("vit", batch=2)
    a, k = adapt(model), num_prefix(model)
    layers = list(range(a.num_blocks))
    xs, gs, t = block_gradients(a, x, TARGET, layers, at="norm1")
    assert torch.equal(t, TARGET)
    for l in layers:
        A, G = hooked_xg(model, x, TARGET, l)
        torch.testing.assert_close(xs[l], A, rtol=0, atol=1e-12 * A.abs().max().item())
        torch.testing.assert_close(gs[l], G, rtol=0, atol=1e-12 * G.abs().max().item())
    for cls in (GradCAM, GradCAMPlusPlus, LayerCAM):
        maps = cls(model, at="norm1").plus_maps(x, TARGET, layers)
        for l in layers:
            own = tokens(cls(model, layer=l, at="norm1"), x)
            assert_close(maps[l][:, k:], own, 0.0)

        def factory(view, cls=cls):
            return cls(view, at="norm1")

        fast, slow = PLUS(model, factory), PLUS(model, factory, fast=False)
        assert (fast.route, slow.route) == ("hook", "method")
        f, s = tokens(fast, x), tokens(slow, x)
        assert_close(f, s, 0.0)


# --- Score-CAM at norm1 --------------------------------------------------------------------------

def test_scorecam_at_norm1_equals_the_masked_forwards():
    """Masks from block l's norm1 output (min-max over the patch rows, nearest-upsampled
    patch by patch), each masked image run alone, softmax of the target probabilities,
    map = sum_c w_c A[:, c]."""
    model, x = make_model("vit"), make_inputs("vit", batch=2)
    before = snapshot(model)
    k, layer = num_prefix(model), 1
    with torch.no_grad():
        grabbed = []
        handle = norm1_of(model, layer).register_forward_hook(
            lambda module, args, out: grabbed.append(out))
        model_logits(model, x)
        handle.remove()
    A = grabbed[0]
    gh, gw = x.shape[-2] // PATCH, x.shape[-1] // PATCH
    ref = torch.zeros(len(x), A.shape[1], dtype=torch.float64)
    for b in range(len(x)):
        scores = []
        for c in range(A.shape[-1]):
            ch = A[b, k:, c]
            span = (ch.max() - ch.min()).item()
            mask = (ch - ch.min()) / span if span > 0 else torch.zeros_like(ch)
            up = mask.reshape(gh, gw).repeat_interleave(PATCH, 0).repeat_interleave(PATCH, 1)
            with torch.no_grad():
                p = model_logits(model, x[b:b + 1] * up).softmax(-1)[0, TARGET[b]]
            scores.append(p.item())
        w = torch.tensor(scores, dtype=torch.float64).softmax(0)
        ref[b] = A[b] @ w
    out = tokens(ScoreCAM(model, layer=layer, relu=False, batch_size=7, at="norm1"), x)
    scale = (A.abs().sum(-1)).max().item()  # softmax weights are at most 1
    assert_close(out, ref[:, k:], scale)
    resid = tokens(ScoreCAM(model, layer=layer, relu=False, batch_size=7), x)
    assert (out - resid).abs().max() > 1e-3 * out.abs().max()
    assert_unchanged(model, before)


# --- pytorch-grad-cam itself (optional) ----------------------------------------------------------

def _pgc_raw(pgc_cls, model, x, target, layer_module, k, grid):
    """pytorch-grad-cam's map before its ReLU/resize/min-max (its own ``get_cam_image``
    on the activations and gradients its hooks recorded) and its final output."""
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    def reshape(t):  # the documented ViT reshape: drop the prefix tokens, tokens -> grid
        return t[:, k:].reshape(t.shape[0], *grid, t.shape[-1]).permute(0, 3, 1, 2)

    targets = [ClassifierOutputTarget(int(c)) for c in target]
    with pgc_cls(model=model, target_layers=[layer_module], reshape_transform=reshape) as cam:
        final = cam(input_tensor=x, targets=targets)
        acts = cam.activations_and_grads.activations[0].numpy()
        grads = cam.activations_and_grads.gradients[0].numpy()
        raw = cam.get_cam_image(x, layer_module, targets, acts, grads, False)
    assert raw.dtype == np.float64
    return torch.from_numpy(raw), final


def test_norm1_and_gradcam_pp_match_pytorch_grad_cam():
    pgc = pytest.importorskip("pytorch_grad_cam")
    from pytorch_grad_cam.utils.image import scale_cam_image

    model, x = make_model("vit"), make_inputs("vit", batch=2)
    before = snapshot(model)
    copy_ = copy.deepcopy(model)  # pytorch-grad-cam leaves parameter gradients behind
    L, k = len(blocks_of(model)), num_prefix(model)
    grid = (x.shape[-2] // PATCH, x.shape[-1] // PATCH)
    cases = [  # (theirs, ours, its target layer)
        (pgc.GradCAM, GradCAM(model, at="norm1", weight_tokens="patches"),
         copy_.blocks[-1].norm1),
        (pgc.GradCAMPlusPlus, GradCAMPlusPlus(model, at="norm1", weight_tokens="patches"),
         copy_.blocks[-1].norm1),
        (pgc.XGradCAM, XGradCAM(model, at="norm1", weight_tokens="patches"),
         copy_.blocks[-1].norm1),
        (pgc.LayerCAM, LayerCAM(model, at="norm1"), copy_.blocks[-1].norm1),
        (pgc.HiResCAM, HiResCAM(model, at="norm1"), copy_.blocks[-1].norm1),
        # the residual stream: block L-1's input is block L-2's output
        (pgc.GradCAMPlusPlus, GradCAMPlusPlus(model, weight_tokens="patches"),
         copy_.blocks[L - 2]),
    ]
    for theirs, ours, module in cases:
        raw, final = _pgc_raw(theirs, copy_, x, TARGET, module, k, grid)
        signed = copy.copy(ours)
        signed.relu = False
        mine = signed.attribute(x, target=TARGET, output="grid")[:, 0]
        scale = raw.abs().max().item()
        torch.testing.assert_close(mine, raw, rtol=0, atol=1e-10 * scale)
        # its output = ReLU, min-max and resize (float32), twice (per layer, then merged)
        relu = ours.attribute(x, target=TARGET, output="grid")[:, 0].numpy()
        again = scale_cam_image(scale_cam_image(relu, (x.shape[-1], x.shape[-2])))
        np.testing.assert_allclose(again, final, rtol=0, atol=1e-5)
    assert_unchanged(model, before)


# --- what the docstrings state about the references ---------------------------------------------

def test_chefer_on_12_blocks_agrees_with_the_reference_as_documented(monkeypatch):
    """TransformerAttribution's docstring: on a 12-block model the maps differ from the
    reference transcription (``safe_divide``'s 1e-9 in its LRP-0 steps) by at most about
    1.6e-5 of the largest map value, in proportion to that stabiliser, and equal the
    transcription with exact LRP-0 divisions to about 2.3e-11."""
    from captum_vit import TransformerAttribution
    from tests.methods import test_chefer

    model, x = make_model("vit", depth=12), make_inputs("vit", batch=2)
    target = torch.tensor([1, 3])
    ours = tokens(TransformerAttribution(model), x, target)

    def rel(ref):
        return ((ours - ref).abs().max() / ref.abs().max()).item()

    faithful = rel(test_chefer.reference_chefer(model, x, target, faithful=True))
    exact = rel(test_chefer.reference_chefer(model, x, target))
    assert 1e-7 < faithful <= 2e-5  # the documented bound, and not far below it
    assert exact <= 1e-10

    def stabilised(a, b, eps=1e-12):  # safe_divide with a 1000x smaller stabiliser
        den = b.clamp(min=eps) + b.clamp(max=eps)
        den = den + den.eq(0).to(den.dtype) * eps
        return a / den * b.ne(0).to(b.dtype)

    monkeypatch.setattr(test_chefer, "_exact", stabilised)
    small = rel(test_chefer.reference_chefer(model, x, target))
    assert small <= 2e-3 * faithful  # the difference is the stabiliser's


def test_torchvision_attention_never_calls_its_out_proj():
    """AttnLRP's docstring: LXT's module-hook γ never reaches torchvision's attention
    projections, because ``nn.MultiheadAttention`` uses ``out_proj``'s weight without
    calling the module (and its q/k/v in-projection is a plain parameter)."""
    attn = nn.MultiheadAttention(8, 2, batch_first=True).double()
    assert isinstance(attn.in_proj_weight, nn.Parameter)
    called = []
    attn.out_proj.register_forward_hook(lambda module, args, out: called.append(1))
    u = torch.randn(1, 5, 8, dtype=torch.float64, requires_grad=True)
    with torch.enable_grad():
        out, _ = attn(u, u, u, need_weights=False)
        out.sum().backward()
    assert isinstance(attn.out_proj, nn.Linear) and called == []


def test_pytorch_grad_cams_scorecam_weights_are_float32():
    """ScoreCAM's docstring: pytorch-grad-cam collects the masked scores with
    ``torch.Tensor`` (float32) whatever the model's dtype; this class keeps float64."""
    pgc = pytest.importorskip("pytorch_grad_cam")
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    model, x = make_model("vit"), make_inputs("vit", batch=1)
    copy_, k = copy.deepcopy(model), num_prefix(model)
    grid = (x.shape[-2] // PATCH, x.shape[-1] // PATCH)

    def reshape(t):
        return t[:, k:].reshape(t.shape[0], *grid, t.shape[-1]).permute(0, 3, 1, 2)

    layer = copy_.blocks[-1].norm1
    targets = [ClassifierOutputTarget(int(TARGET[0]))]
    with pgc.ScoreCAM(model=copy_, target_layers=[layer], reshape_transform=reshape) as cam:
        cam.batch_size = 64
        cam(input_tensor=x, targets=targets)
        acts = cam.activations_and_grads.activations[0].numpy()
        assert acts.dtype == np.float64
        weights = cam.get_cam_weights(x, layer, targets, acts, None)
    assert weights.dtype == np.float32
    ours = tokens(ScoreCAM(model, at="norm1"), x, TARGET[:1], score="logit")
    assert ours.dtype == torch.float64
