"""PLUS / SkipPLUS composed with every method (SPEC_NEXT §8.5): the sub-network view, the
fast paths against the generic per-sub-network runs, the layer aggregation, the registry
spellings and ``evaluate --compose``."""

from __future__ import annotations

import json

import pytest
import torch
from captum.attr import Saliency

from captum_vit import (
    ALTI,
    GAE,
    PLUS,
    AttCAT,
    AttnGradCAM,
    GlobEnc,
    PLUSFastPath,
    RawAttention,
    Rollout,
    SkipPLUS,
    TokenTM,
)
from captum_vit.adapters import SubnetworkAdapter, adapt
from captum_vit.cli import main
from captum_vit.methods.tis import masks_to_map
from captum_vit.registry import (
    available_methods,
    build_method,
    canonical_name,
    composition_base,
    parse_methods,
    quick_options,
)
from tests.helpers import (
    ReferenceCapture,
    assert_unchanged,
    family_marks,
    make_inputs,
    make_model,
    snapshot,
)

TARGETS = torch.tensor([1, 4, 0])
_MODELS: dict[str, torch.nn.Module] = {}


def model_of(family: str) -> torch.nn.Module:
    if family not in _MODELS:
        _MODELS[family] = make_model(family)
    return _MODELS[family]


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-10) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=tol * (1 + b.abs().max().item()))


def tokens(method, x, target=TARGETS, **kw):
    return method.attribute(x, target, output="tokens", **kw)


def _refs(model, x):
    """timm's own forward (independent of the adapters): x_l, A_l and dy_c/dA_l."""
    refs = ReferenceCapture(model)
    logits = refs(x)
    logits.gather(1, TARGETS[:, None]).sum().backward()
    return refs


# -- the sub-network view ------------------------------------------------------------------
@pytest.mark.parametrize("family", [
    pytest.param(f, marks=family_marks(f))
    for f in ("vit", "registers", "beit", "eva02", "map", "hf_dinov2")])
def test_view_forward_and_trace_are_the_models(family):
    model, x = model_of(family), make_inputs(family)
    ad = adapt(model)
    logits = ad.model_logits(x)
    full = ad.trace(x)
    L = ad.num_blocks
    for l in range(L):
        for stop in (None, l + 1):
            view = SubnetworkAdapter(ad, l, stop)
            assert adapt(view) is view and view.model is model
            assert view.num_blocks == (L if stop is None else stop) - l
            assert view.layout(x).num_blocks == view.num_blocks
            x_l = view.embed(x)
            assert not x_l.requires_grad
            # bit for bit: the view runs the same plain ops as the trace, on the same shapes
            torch.testing.assert_close(x_l, full.states[l], rtol=0, atol=0)
            close(view.run(x_l), logits, 1e-12)
            tr = view.trace(x)
            for k, rec in enumerate(tr.blocks):  # the full trace's blocks >= l
                ref = full.blocks[l + k]
                for name in ("x", "attn", "mid", "out"):
                    torch.testing.assert_close(getattr(rec, name), getattr(ref, name),
                                               rtol=0, atol=0)
            torch.testing.assert_close(tr.logits, full.logits, rtol=0, atol=0)
            if full.pool_attn is not None:
                torch.testing.assert_close(tr.pool_attn, full.pool_attn, rtol=0, atol=0)
        # called like a model: f_l on token states, the whole model on images
        view = SubnetworkAdapter(ad, l, score="probability")
        close(view(full.states[l]), logits.softmax(-1), 1e-12)
        close(view(x), logits.softmax(-1), 1e-12)


def test_view_parameter_stages_and_errors():
    model = model_of("vit")
    ad = adapt(model)
    stages = ad.parameter_stages()  # head, block 2, block 1, block 0
    window = SubnetworkAdapter(ad, 1, 2).parameter_stages()
    assert [len(s) for s in window] == [len(stages[0]) + len(stages[1]), len(stages[2])]
    assert [len(s) for s in SubnetworkAdapter(ad, 1).parameter_stages()] == \
        [len(s) for s in stages[:3]]
    nested = SubnetworkAdapter(SubnetworkAdapter(ad, 1), 1)  # one flat view
    assert (nested.base, nested.start, nested.stop) == (ad, 2, 3)
    with pytest.raises(ValueError, match="start"):
        SubnetworkAdapter(ad, 3)
    with pytest.raises(ValueError, match="stop"):
        SubnetworkAdapter(ad, 1, 1)
    with pytest.raises(TypeError, match="start"):
        SubnetworkAdapter(ad, 1.0)
    with pytest.raises(ValueError, match="score"):
        SubnetworkAdapter(ad, 0, score="prob")
    with pytest.raises(TypeError, match="adapter"):
        SubnetworkAdapter(model, 0)
    with pytest.raises(ValueError, match="token states"):
        SubnetworkAdapter(ad, 0)(torch.zeros(3, 4))


# -- fast path == generic path ---------------------------------------------------------------
BASES = {"rollout": Rollout, "gae": GAE, "tokentm": TokenTM,
         "tokentm_residual": lambda f: TokenTM(f, variant="residual"),
         "globenc": GlobEnc, "alti": lambda f: ALTI(f, residual_strength=0.5)}


@pytest.mark.parametrize("family", ["vit", "beit", "map"])
@pytest.mark.parametrize("base", list(BASES))
def test_fast_paths_equal_the_method_on_every_subnetwork(family, base):
    model, x = model_of(family), make_inputs(family)
    factory = BASES[base]
    for kw in ({}, {"layers": [0, 2]}):
        fast = PLUS(model, factory, **kw)
        slow = PLUS(model, factory, fast=False, **kw)
        assert (fast.route, slow.route) == ("hook", "method")
        close(tokens(fast, x), tokens(slow, x))
    fast = SkipPLUS(model, base).layer_maps(x, TARGETS)  # prefix columns too
    slow = SkipPLUS(model, base, fast=False).layer_maps(x, TARGETS)
    k = adapt(model).num_prefix
    close(fast[..., k:], slow[..., k:])
    if base in ("gae", "tokentm", "tokentm_residual"):  # a score reaches both paths
        score = "logit" if base == "tokentm" else "probability"
        close(tokens(PLUS(model, factory), x, score=score),
              tokens(PLUS(model, factory, fast=False), x, score=score))
    # the sub-network starting at block 0 is the model: A(f_0) is the method itself
    method = factory(model)
    close(tokens(PLUS(model, factory, layers=[0]), x), tokens(method, x))


def test_rollout_and_gae_by_hand_from_timms_forward():
    """A(f_l) from timm's own attention and gradients: w M_{L-1}..M_l and
    w (I + Ā_{L-1})..(I + Ā_l), summed over the start blocks."""
    model, x = model_of("vit"), make_inputs("vit")
    refs = _refs(model, x)
    n = refs.attn[0].shape[-1]
    eye = torch.eye(n, dtype=x.dtype)
    w = eye[0].expand(3, n)
    rollout, gae = 0, 0
    for l in range(3):
        r, g = w, w
        for a in reversed(refs.attn[l:]):
            m = a.detach().mean(1) + eye
            r = torch.einsum("bn,bnm->bm", r, m / m.sum(-1, keepdim=True))
            abar = (a.grad * a.detach()).clamp(min=0).mean(1)
            g = g + torch.einsum("bn,bnm->bm", g, abar)
        rollout, gae = rollout + r, gae + g
    close(tokens(PLUS(model, "rollout"), x), rollout[:, 1:])
    close(tokens(PLUS(model, "gae"), x), gae[:, 1:])


def test_tokentm_starts_at_the_subnetwork_input():
    """A(f_l) is TokenTM run on the sub-network (C_0 = diag‖x_l‖ at its input); at l = 0
    it is TokenTM itself."""
    model, x = model_of("registers"), make_inputs("registers")
    maps = PLUS(model, "tokentm").layer_maps(x, TARGETS)
    ad = adapt(model)
    for l in range(3):
        view = SubnetworkAdapter(ad, l)
        tr = view.trace(x)
        torch.testing.assert_close(tr.x0, ad.trace(x).states[l], rtol=0, atol=0)
        close(maps[l], TokenTM(view)._token_maps(x, TARGETS, score="probability"))
    close(maps[0], TokenTM(model)._token_maps(x, TARGETS, score="probability"))


# -- layer-local bases, AttIxG, aggregate="layer" ------------------------------------------
def test_plus_of_att_ixg_is_attcat_on_every_route():
    model, x = model_of("registers"), make_inputs("registers")
    ref = tokens(AttCAT(model), x)
    for base, fast in (("att_ixg", True), ("att_ixg", False), ("AttIxG", True)):
        close(tokens(PLUS(model, base, fast=fast), x), ref, 1e-12)


def test_globenc_alti_layer_aggregate_sums_the_block_rows():
    """``aggregate="layer"`` of GlobEnc / ALTI is the SkipPLUS authors' sum of ``w T_l``."""
    model, x = model_of("vit"), make_inputs("vit")
    for cls in (GlobEnc, ALTI):
        mats = cls(model).block_matrices(x)  # [L, B, N, N], CLS readout: row 0
        k = adapt(model).num_prefix
        skip = SkipPLUS(model, cls, aggregate="layer")
        assert list(skip.layers) == [2]  # ⌈3/2⌉
        close(tokens(skip, x), mats[2:, :, 0, k:].sum(0))
        close(tokens(PLUS(model, cls, aggregate="layer"), x), mats[:, :, 0, k:].sum(0))


def test_gae_layer_aggregate_is_grad_sam():
    """Σ_l w · mean_h ReLU(∇A_l ⊙ A_l), by hand from timm's forward, = PLUS(GAE, layer)."""
    model, x = model_of("vit"), make_inputs("vit")
    refs = _refs(model, x)
    terms = [(a.grad * a.detach()).clamp(min=0).mean(1)[:, 0, 1:] for a in refs.attn]
    close(tokens(PLUS(model, "gae", aggregate="layer"), x), sum(terms))
    close(tokens(SkipPLUS(model, GAE, aggregate="layer"), x), terms[2])
    gradsam = pytest.importorskip("captum_vit.methods.gradsam")
    close(tokens(PLUS(model, "gae", aggregate="layer"), x), tokens(gradsam.GradSAM(model), x))
    close(tokens(SkipPLUS(model, "gae", aggregate="layer"), x),
          tokens(gradsam.GradSAM(model, layers=[2]), x))


def test_layer_local_bases_give_the_map_at_every_block():
    """Raw attention and attention Grad-CAM on the one-block window: the map at block l
    with the model's own gradients; PLUS(raw attention) = PLUS(Rollout, layer) = Σ w Ā_l."""
    model, x = model_of("vit"), make_inputs("vit")
    refs = _refs(model, x)
    raw = sum(a.detach().mean(1)[:, 0, 1:] for a in refs.attn)
    cams = []
    for a in refs.attn:
        wh = a.grad[:, :, 0, 1:].mean(-1, keepdim=True)
        cams.append((wh * a.detach()[:, :, 0, :]).mean(1).clamp(min=0)[:, 1:])
    for agg in ("subnetwork", "layer"):  # the same for layer-local bases
        plus = PLUS(model, RawAttention, aggregate=agg)
        assert plus.route == "method" and plus.layer_local
        close(tokens(plus, x), raw)
        close(tokens(PLUS(model, "attn_gradcam", aggregate=agg), x), sum(cams))
    close(tokens(PLUS(model, "rollout", aggregate="layer"), x), raw)
    close(tokens(PLUS(model, AttnGradCAM, layers=[0]), x), cams[0])
    close(tokens(SkipPLUS(model, "attn_gradcam"), x), tokens(AttnGradCAM(model), x))


def test_relative_start_layer_of_a_configured_base():
    model, x = model_of("vit"), make_inputs("vit")

    def factory(f):
        return Rollout(f, start_layer=1)

    close(tokens(PLUS(model, factory, layers=[0, 1]), x),
          tokens(PLUS(model, factory, layers=[0, 1], fast=False), x))
    for fast in (True, False):
        with pytest.raises(ValueError, match="start_layer"):
            tokens(PLUS(model, factory, fast=fast), x)  # f_2 has one block


# -- generic runs: perturbation methods, Captum, hooks of new methods -------------------------
def test_tis_removes_tokens_of_the_block_input():
    model, x = model_of("vit"), make_inputs("vit")
    ad = adapt(model)
    g = torch.Generator().manual_seed(0)
    masks = torch.rand(6, 16, generator=g) < 0.5
    masks[:, 0] = True
    before = snapshot(model)
    with pytest.warns(UserWarning, match="perturbation method TIS once per included block"):
        plus = PLUS(model, "tis", layers=[1, 2])
    got = tokens(plus, x, masks=masks)
    states = ad.trace(x).states
    ref = 0
    for l in (1, 2):
        probs = torch.stack([ad.run(states[l], start=l, keep=mk[None].expand(3, -1))
                             .softmax(-1).gather(1, TARGETS[:, None])[:, 0] for mk in masks], 1)
        ref = ref + masks_to_map(probs, masks[None])
    close(got, ref, 1e-12)
    tokens(SkipPLUS(model, "TIS"), x, n_masks=4)  # clustered masks of x_2's features
    assert_unchanged(model, before)


def test_captum_base_runs_on_token_states():
    model, x = model_of("vit"), make_inputs("vit")
    ad = adapt(model)
    states = ad.trace(x).states
    ref = sum(Saliency(lambda t, l=l: ad.run(t, start=l)).attribute(
        states[l].clone().requires_grad_(), target=TARGETS, abs=False).sum(-1)
        for l in range(3))
    close(tokens(PLUS(model, Saliency), x, abs=False), ref[:, 1:])
    close(tokens(PLUS(model, "gradient"), x), ref[:, 1:])


class _FastRawAttention(RawAttention, PLUSFastPath):
    """A new method plugging into PLUS through the hook API (one trace for all blocks)."""

    plus_aggregates = ("subnetwork", "layer")

    def plus_maps(self, inputs, target, layers, *, aggregate="subnetwork"):
        tr = self.adapter.trace(inputs)
        return torch.stack([tr.blocks[l].attn.mean(1)[:, 0] for l in layers])


class _BrokenHook(RawAttention, PLUSFastPath):
    def plus_maps(self, inputs, target, layers, *, aggregate="subnetwork"):
        return torch.zeros(2)


def test_hook_api_for_new_methods():
    model, x = model_of("vit"), make_inputs("vit")
    fast = PLUS(model, _FastRawAttention)
    assert fast.route == "hook"
    close(tokens(fast, x), tokens(PLUS(model, RawAttention), x))
    close(tokens(PLUS(model, _FastRawAttention, fast=False), x), tokens(fast, x))
    with pytest.raises(RuntimeError, match="plus_maps returned"):
        tokens(PLUS(model, _BrokenHook), x)


class _UndeclaredHook(RawAttention):
    """``plus_maps`` without the protocol's type: not a fast path (no duck typing)."""

    plus_aggregates = ("subnetwork", "layer")

    def plus_maps(self, inputs, target, layers, *, aggregate="subnetwork"):
        raise AssertionError("an undeclared plus_maps must not be called")


def test_the_fast_path_is_found_by_type():
    """PLUS takes a base's fast path when its class is a ``PLUSFastPath`` (a method with
    ``plus_maps`` but not that type runs on every sub-network), and the gradient route of a
    registered name when its class is a ``GradientRoute`` (its declared
    ``gradient_kind``); no table of names is kept."""
    import captum_vit.combinators as combinators
    from captum_vit import DecompX, TokenIxG
    from captum_vit.methods import GradientRoute
    from captum_vit.registry import METHODS

    assert not hasattr(combinators, "FAST_BASES")
    assert "FAST_BASES" not in combinators.__all__
    model, x = model_of("vit"), make_inputs("vit")
    undeclared = PLUS(model, _UndeclaredHook)
    assert undeclared.route == "method" and undeclared.layer_local
    close(tokens(undeclared, x), tokens(PLUS(model, RawAttention), x))
    route = {e.name: e.cls.gradient_kind for e in METHODS
             if e.class_alias and issubclass(e.cls, GradientRoute)}
    assert route == {"token_ixg": "ixg", "att_ixg": "att_ixg", "decompx": "decompx"}
    for name, kind in route.items():
        for spelling in (name, type(build_method(name, model)).__name__):
            plus = PLUS(model, spelling)
            assert (plus.route, plus.kind) == ("kind", kind), spelling
        assert PLUS(model, name, fast=False).route == "method"
    # the class itself (not its registered name) takes its plus_maps
    assert PLUS(model, DecompX).route == PLUS(model, TokenIxG).route == "hook"
    assert (PLUS(model, "ixg").kind, PLUS(model, "gradient").kind) == ("ixg", "gradient")


# -- clear errors ------------------------------------------------------------------------
def test_errors_name_the_argument():
    model, x = model_of("vit"), make_inputs("vit")
    with pytest.raises(ValueError, match="aggregate must be one of"):
        PLUS(model, "gae", aggregate="sum")
    with pytest.raises(TypeError, match="fast"):
        PLUS(model, "gae", fast="yes")
    for base in ("tokentm", TokenTM, "decompx", Saliency, "tis", "attcat"):
        with pytest.raises(ValueError, match="aggregate"):
            PLUS(model, base, aggregate="layer")
    with pytest.raises(ValueError, match="aggregate"):  # no layer form on the generic path
        PLUS(model, "gae", aggregate="layer", fast=False)
    with pytest.raises(ValueError, match="unknown base 'nope'"):
        PLUS(model, "nope")
    with pytest.raises(TypeError, match="nested"):
        PLUS(model, lambda f: SkipPLUS(f, "gae"))
    with pytest.raises(TypeError, match="nested"):
        PLUS(model, SkipPLUS)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['score'\]"):
        tokens(PLUS(model, "rollout"), x, score="logit")
    with pytest.raises(TypeError, match=r"\['n_steps'\] for GAE"):
        tokens(PLUS(model, "gae"), x, n_steps=3)
    with pytest.raises(ValueError, match="score"):
        tokens(PLUS(model, "gae"), x, score="prob")
    with pytest.raises(ValueError, match="score"):
        tokens(PLUS(model, Saliency), x, score="prob")


# -- registry and command line -----------------------------------------------------------
@pytest.mark.parametrize(("spelling", "canonical"), [
    ("PLUS(gae)", "plus:gae"), ("SkipPLUS(TokenTM)", "skipplus:tokentm"),
    ("skipplus:TokenTM_Residual", "skipplus:tokentm_residual"),
    ("plus:Raw-Attention", "plus:raw_attention"), ("PLUS(TIS)", "plus:tis"),
    ("SkipPLUS(captum:Saliency)", "skipplus:captum:Saliency"), ("plus:IxG", "plus:ixg"),
])
def test_every_method_composes_in_the_registry(spelling, canonical):
    assert canonical_name(spelling) == canonical


@pytest.mark.parametrize("bad", ["plus:skipplus:gae", "PLUS(SkipPLUS(gae))",
                                 "plus:fullgrad_plus", "SkipPLUS(skip_fullgrad_plus)"])
def test_nested_compositions_are_refused(bad):
    with pytest.raises(ValueError, match="nested|sum over blocks"):
        canonical_name(bad)


def test_registry_builds_compositions_of_any_method():
    model, x = model_of("vit"), make_inputs("vit")
    plus = build_method("PLUS(TokenTM_Residual)", model)
    assert isinstance(plus, PLUS) and plus.route == "hook"
    close(tokens(plus, x), tokens(PLUS(model, lambda f: TokenTM(f, variant="residual")), x),
          0)
    close(tokens(PLUS(model, "gae"), x), tokens(PLUS(model, GAE), x), 0)
    assert isinstance(build_method("skipplus:attn_gradcam", model), SkipPLUS)
    assert build_method("plus:captum:Saliency", model).route == "captum"
    assert isinstance(composition_base("raw_attention")(adapt(model)), RawAttention)
    assert composition_base("IxG") == "ixg"
    assert quick_options("skipplus:tis") == quick_options("tis") == {"n_masks": 128}
    featured = available_methods(compositions=True)
    assert {"plus:decompx", "skipplus:gae", "skipplus:tokentm", "plus:attn_gradcam",
            "skipplus:attcat"} <= set(featured)


def test_parse_methods_composes_every_selected_base():
    got = parse_methods(["gae,random,skipplus:decompx", "fullgrad_plus", "captum:Saliency"],
                        compose="plus,skipplus")
    assert got == ["gae", "plus:gae", "skipplus:gae", "random", "skipplus:decompx",
                   "fullgrad_plus", "captum:Saliency", "plus:captum:Saliency",
                   "skipplus:captum:Saliency"]
    assert parse_methods("rollout", compose=["SkipPLUS"]) == ["rollout", "skipplus:rollout"]
    assert parse_methods("rollout", compose="") == ["rollout"]
    with pytest.raises(ValueError, match="compose must name combinators"):
        parse_methods("gae", compose="plus,foo")


def test_evaluate_compose(tmp_path, capsys):
    out = tmp_path / "o"
    argv = ["evaluate", "--model", "random:vit_tiny", "--data", "synthetic", "--n", "2",
            "--batch-size", "2", "--methods", "gae", "--compose", "plus,skipplus",
            "--metrics", "sparseness", "--out", str(out)]
    assert main(argv) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["config"]["methods"] == ["gae", "plus:gae", "skipplus:gae"]
    assert set(data["results"]) == {"gae", "plus:gae", "skipplus:gae"}
    assert main(argv[:-2] + ["--compose", "minus", "--out", str(tmp_path / "x")]) == 2
    assert "compose must name combinators" in capsys.readouterr().err



@pytest.mark.parametrize("family", ["vit", "beit"])
@pytest.mark.parametrize("name", ["gradcam", "gradcam_pp", "xgradcam", "layercam", "hirescam",
                                  "gradcam_elementwise", "vanilla_grad"])
def test_cam_and_vanilla_fast_paths_equal_the_generic_path(name, family):
    """The CAMs' and VanillaGrad's one-backward ``plus_maps`` == the method run on every
    sub-network (one-block windows for the layer-local CAMs)."""
    model, x = make_model(family), make_inputs(family, batch=2)
    for comp in (PLUS, SkipPLUS):
        fast = comp(model, name).attribute(x, target=[1, 2], output="tokens")
        slow = comp(model, name, fast=False).attribute(x, target=[1, 2], output="tokens")
        torch.testing.assert_close(fast, slow, rtol=0, atol=1e-10 * (1 + slow.abs().max()))
