"""The CAM family on ViT tokens (SPEC_NEXT §8.3): every variant against a slow float64
reference written from the SPEC (explicit loops over channels and tokens; X and G read
through the model's OWN forward with a hook and torch.autograd, not through the adapter),
the identities between variants, batch invariance and the option errors (Score-CAM's too; its
reference: tests/methods/test_scorecam.py)."""

from __future__ import annotations

import pytest
import torch

from captum_vit.adapters import adapt
from captum_vit.methods.cam import (
    EPS,
    GRADCAM_PP_EPS,
    XGRADCAM_EPS,
    GradCAM,
    GradCAMElementWise,
    GradCAMPlusPlus,
    HiResCAM,
    LayerCAM,
    XGradCAM,
    block_gradient,
)
from captum_vit.methods.ixg import TokenIxG, layer_gradients
from captum_vit.methods.scorecam import ScoreCAM
from tests.helpers import (
    assert_close_scaled,
    assert_unchanged,
    family_marks,
    make_inputs,
    make_model,
    snapshot,
)

REL = 1e-10
CAM_FAMILIES = [pytest.param(f, marks=family_marks(f))
                for f in ("vit", "beit", "registers", "hf_vit")]
TARGET = torch.tensor([2, 4])

# (name, class, constructor options) of every gradient CAM and its reference rule
VARIANTS = [
    ("gradcam", GradCAM, {}),
    ("gradcam", GradCAM, {"weight_tokens": "patches"}),
    ("gradcam_pp", GradCAMPlusPlus, {}),
    ("gradcam_pp", GradCAMPlusPlus, {"weight_tokens": "patches"}),
    ("xgradcam", XGradCAM, {}),
    ("xgradcam", XGradCAM, {"weight_tokens": "patches"}),
    ("xgradcam_plus", XGradCAM, {"plus": True}),
    ("xgradcam_plus", XGradCAM, {"plus": True, "weight_tokens": "patches"}),
    ("layercam", LayerCAM, {}),
    ("hirescam", HiResCAM, {}),
    ("elementwise", GradCAMElementWise, {}),
]


# --- references through the model's own forward ------------------------------------------

def blocks_of(model):
    return list(model.blocks) if hasattr(model, "blocks") else list(model.vit.layers)


def model_logits(model, x):
    out = model(x) if hasattr(model, "blocks") else model(pixel_values=x)
    return out if isinstance(out, torch.Tensor) else out.logits


def reference_xg(model, x, target, layer, score="logit"):
    """``X = x_l`` (the input of block ``layer`` seen by a forward pre-hook) and
    ``G = d s / d X`` by torch.autograd through the model's own forward."""
    grabbed = []

    def hook(module, args, kwargs):
        grabbed.append(args[0] if args else kwargs["hidden_states"])

    handle = blocks_of(model)[layer].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        logits = model_logits(model, x)
    finally:
        handle.remove()
    s = logits.softmax(-1) if score == "probability" else logits
    (g,) = torch.autograd.grad(s[torch.arange(len(x)), target].sum(), [grabbed[0]])
    return grabbed[0].detach(), g


def assert_close(out, ref, X, G):
    """``max|out - ref| <= REL * scale``, ``scale`` = the larger of ``max|ref|`` and the
    largest ``sum_c |G[j, c] X[j, c]|``: a sum over channels is only as exact as its terms
    (at block L-1 of a class-token model the patch rows of HiResCAM cancel to ~1e-7 of
    their terms, LayerNorm being scale-invariant)."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    terms = (G * X).abs().sum(-1).max().item()
    scale = max(ref.abs().max().item(), terms)
    err = (out - ref).abs().max().item()
    assert err <= REL * scale, f"max abs error {err:.3g} vs scale {scale:.3g}"


def num_prefix(model):
    return adapt(model).num_prefix  # a count, not a computation


def reference_cam(rule, X, G, k, weight_tokens="all"):
    """SPEC_NEXT §8.3, one scalar at a time (Python floats, i.e. float64), before ReLU."""
    B, N, D = X.shape
    X, G = X.tolist(), G.tolist()
    T = range(k, N) if weight_tokens == "patches" else range(N)
    out = torch.zeros(B, N, dtype=torch.float64)
    for b in range(B):
        m = [0.0] * N
        for c in range(D):
            xs, gs = [X[b][t][c] for t in T], [G[b][t][c] for t in T]
            if rule == "gradcam":
                w = sum(gs) / len(gs)
            elif rule == "gradcam_pp":
                total = sum(xs)
                w = sum((gi ** 2 / (2 * gi ** 2 + total * gi ** 3 + 1e-6) if gi != 0 else 0.0)
                        * max(gi, 0.0) for gi in gs)
            elif rule == "xgradcam":
                w = sum(gs[i] * xs[i] for i in range(len(T))) / (sum(xs) + 1e-7)
            elif rule == "xgradcam_plus":
                w = (sum(gs[i] * abs(xs[i]) for i in range(len(T)))
                     / (sum(abs(v) for v in xs) + 1e-7))
            for j in range(N):
                x, g = X[b][j][c], G[b][j][c]
                if rule == "layercam":
                    m[j] += max(g, 0.0) * x
                elif rule == "hirescam":
                    m[j] += g * x
                elif rule == "elementwise":
                    m[j] += max(g * x, 0.0)
                else:
                    m[j] += w * x
        out[b] = torch.tensor(m, dtype=torch.float64)
    return out


# --- every variant against the reference ---------------------------------------------------

@pytest.mark.parametrize("family", CAM_FAMILIES)
def test_every_variant_matches_the_slow_reference(family):
    model, x = make_model(family), make_inputs(family, batch=2)
    before = snapshot(model)
    L, k = len(blocks_of(model)), num_prefix(model)
    X, G = reference_xg(model, x, TARGET, L - 1)
    # pytorch-grad-cam 1.5.7's constants: 1e-6 in GradCAM++, 1e-7 in XGradCAM
    assert GRADCAM_PP_EPS == 1e-6 and EPS == XGRADCAM_EPS == 1e-7
    for rule, cls, kw in VARIANTS:
        ref = reference_cam(rule, X, G, k, kw.get("weight_tokens", "all"))[:, k:]
        signed = cls(model, relu=False, **kw).attribute(x, target=TARGET, output="tokens")
        assert signed.dtype == torch.float64
        assert_close(signed, ref, X, G)
        default = cls(model, **kw).attribute(x, target=TARGET, output="tokens")  # relu=True
        assert_close(default, ref.clamp(min=0), X, G)
        if rule not in ("elementwise",):  # signed maps really have both signs here
            assert (signed < 0).any() and (signed > 0).any(), rule
    assert_unchanged(model, before)


@pytest.mark.parametrize(("family", "layer", "score"),
                         [("vit", 0, "probability"), ("beit", 1, "logit")])
def test_other_layers_and_the_probability_score(family, layer, score):
    model, x = make_model(family), make_inputs(family, batch=2)
    k = num_prefix(model)
    X, G = reference_xg(model, x, TARGET, layer, score)
    for rule, cls, kw in VARIANTS:
        out = cls(model, layer=layer, relu=False, **kw).attribute(
            x, target=TARGET, score=score, output="tokens")
        ref = reference_cam(rule, X, G, k, kw.get("weight_tokens", "all"))[:, k:]
        assert_close(out, ref, X, G)


def test_block_gradient_equals_layer_gradients():
    model, x = make_model("registers"), make_inputs("registers", batch=2)
    a = adapt(model)
    lg = layer_gradients(a, x, TARGET)
    for layer in (0, 2):
        X, G, t = block_gradient(a, x, TARGET, layer)
        # bit for bit: the same forward, and the same backward graph down to block `layer`
        assert torch.equal(X, lg.trace.states[layer].detach())
        assert torch.equal(G, lg.grads[layer])
        assert torch.equal(t, TARGET)
        # the per-block hook PLUS/SkipPLUS use gives the method's own map
        for _, cls, kw in VARIANTS:
            method = cls(model, layer=layer, **kw)
            own = method.attribute(x, target=TARGET, output="tokens")
            hook = method.layer_map(lg.trace.states[layer], lg.grads[layer], a.num_prefix)
            assert torch.equal(hook[:, a.num_prefix:], own)


# --- identities ---------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["vit", "beit"])
def test_hirescam_is_token_ixg_and_elementwise_is_above_it(family):
    model, x = make_model(family), make_inputs(family, batch=3)
    target = [0, 3, 1]
    for layer in (0, 2):
        hires = HiResCAM(model, layer=layer, relu=False).attribute(x, target=target,
                                                                   output="tokens")
        ixg = TokenIxG(model, layer=layer).attribute(x, target=target, output="tokens")
        assert torch.equal(hires, ixg)  # both (X * G).sum(-1) on the same X, G: bit for bit
        elem = GradCAMElementWise(model, layer=layer, relu=False).attribute(
            x, target=target, output="tokens")
        assert (elem >= hires).all() and (elem >= 0).all()
        assert (elem > hires).any()
        relu = HiResCAM(model, layer=layer).attribute(x, target=target, output="tokens")
        assert torch.equal(relu, hires.clamp(min=0))


def test_default_layer_is_the_last_block():
    model, x = make_model("vit"), make_inputs("vit", batch=2)
    for cls in (GradCAM, LayerCAM):
        assert cls(model).layer == 2
        torch.testing.assert_close(cls(model).attribute(x, target=TARGET),
                                   cls(model, layer=2).attribute(x, target=TARGET),
                                   rtol=0, atol=0)
    assert ScoreCAM(model).layer == 2


@pytest.mark.parametrize("family", ["registers", "beit"])
def test_batch_equals_images_one_by_one(family):
    model, x = make_model(family), make_inputs(family, batch=3)
    target = torch.tensor([1, 0, 4])
    methods = [cls(model, relu=False, **kw) for _, cls, kw in VARIANTS]
    methods += [ScoreCAM(model, relu=False, batch_size=5),
                ScoreCAM(model, relu=False, batch_size=7, removal="tokens")]
    # a batch and its images one by one are different GEMM shapes (last bits may differ);
    # a last-block CAM of a class-token model cancels to ~1e-7 of its terms (LayerNorm is
    # scale-invariant), so rounding is measured against the logits' scale, not the map's
    with torch.no_grad():
        logit_scale = model_logits(model, x).abs().max().item()
    for method in methods:
        batch = method.attribute(x, target=target, output="tokens")
        one = torch.cat([method.attribute(x[i:i + 1], target=int(target[i]), output="tokens")
                         for i in range(3)])
        # XGradCAM divides by the channel sums sum_j X[j, c], which cancel (to ~1e-3 of
        # sum_j |X[j, c]| on beit): their rounding is amplified ~1e3, hence 1e-11
        rel = 1e-11 if isinstance(method, XGradCAM) else 1e-12
        assert_close_scaled(one, batch, rel=rel, scale=logit_scale, msg=type(method).__name__)


def test_half_precision_gives_float32_maps():
    model = make_model("vit", dtype=torch.bfloat16)
    x = make_inputs("vit", batch=2, dtype=torch.bfloat16)
    for method in (GradCAMPlusPlus(model), XGradCAM(model, plus=True),
                   ScoreCAM(model, removal="tokens"), ScoreCAM(model)):
        out = method.attribute(x, target=[0, 1], output="tokens")
        assert out.dtype == torch.float32 and torch.isfinite(out).all()


# --- Score-CAM against each masked image run alone -----------------------------------------


# --- errors --------------------------------------------------------------------------------

def test_bad_options_raise_errors_naming_the_argument():
    model, x = make_model("vit"), make_inputs("vit", batch=2)
    before = snapshot(model)
    for cls in (GradCAM, XGradCAM, LayerCAM, ScoreCAM):
        with pytest.raises(ValueError, match="layer"):
            cls(model, layer=3)
        with pytest.raises(ValueError, match="layer"):
            cls(model, layer=-1)
        with pytest.raises(TypeError, match="layer"):
            cls(model, layer=1.0)
        with pytest.raises(TypeError, match="relu"):
            cls(model, relu=1)
        with pytest.raises(ValueError, match="score"):
            cls(model).attribute(x, target=TARGET, score="softmax")
        with pytest.raises(ValueError, match="output"):
            cls(model).attribute(x, target=TARGET, output="heatmap")
    for cls in (GradCAM, GradCAMPlusPlus, XGradCAM):
        with pytest.raises(ValueError, match="weight_tokens"):
            cls(model, weight_tokens="cls")
    with pytest.raises(TypeError, match="weight_tokens"):
        LayerCAM(model, weight_tokens="all")  # position-wise: no channel weights
    with pytest.raises(TypeError, match="plus"):
        XGradCAM(model, plus="yes")
    with pytest.raises(ValueError, match="batch_size"):
        ScoreCAM(model, batch_size=0)
    with pytest.raises(TypeError, match="batch_size"):
        ScoreCAM(model, batch_size=2.0)
    with pytest.raises(ValueError, match="removal"):
        ScoreCAM(model, removal="token")
    with pytest.raises(TypeError, match="progress"):
        ScoreCAM(model, progress=None)
    assert_unchanged(model, before)
