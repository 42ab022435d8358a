"""The target protocol (SPEC_REACH §10.1-10.2): class, multi-label, contrastive, callable,
token and head targets, several-block readouts, and the readout rule of the matrix methods.

Every comparison is float64 on tiny random models; references are written here from the
spec (autograd through the model's own forward, per-row maps)."""

from __future__ import annotations

import inspect

import pytest
import torch
from captum.attr import NoiseTunnel

from captum_vit import GAE, Rollout, TokenTM, targets
from captum_vit._base import gradients, readout_rows
from captum_vit.adapters import adapt
from captum_vit.metrics import deletion
from captum_vit.registry import available_methods, build_method
from captum_vit.targets import (
    ClassTarget,
    Contrastive,
    EmbeddingTarget,
    HeadTarget,
    MultiLabel,
    Target,
    TokenTarget,
    as_target,
)
from tests.helpers import (
    EMBEDDING_FAMILIES,
    assert_unchanged,
    family_marks,
    make_inputs,
    make_model,
    snapshot,
)

pytestmark = pytest.mark.lower_bounds  # also run against the oldest supported versions

FAST = {"tis": {"n_masks": 16}, "rise": {"n_masks": 16},
        "bt_h": {"n_steps": 3, "start_layer": 1}, "bt_t": {"n_steps": 3, "start_layer": 1},
        "tam": {"n_steps": 3, "start_layer": 0}}
METHODS = available_methods(compositions=True)
LINEAR_IN_SCORE = [m for m, options in targets.LINEAR_IN_SCORE.items() if not options] + [
    "plus:decompx"]
"""Methods whose map is linear in the explained score at their defaults (the package's
list, ``captum_vit.targets.LINEAR_IN_SCORE``), and a composition of one."""
PERTURBATION = {"tis", "rise", "vit_cx", "scorecam"}
"""Methods that score perturbed inputs (no gradient readout)."""
GRADIENT_FREE = {"raw_attention", "rollout", "globenc", "alti", "random"}
"""Class-agnostic methods: a token-reading target's rows are read out uniformly."""


@pytest.fixture(scope="module")
def vit():
    return make_model("vit", dtype=torch.float64)


@pytest.fixture(scope="module")
def images():
    return make_inputs("vit", 2, dtype=torch.float64)


def attribute(name, model, x, target, **kw):
    return build_method(name, model).attribute(x, target=target, output="tokens",
                                               **{**FAST.get(name, {}), **kw})


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


# -- logits targets: the model's own head ------------------------------------------------
@pytest.mark.parametrize("name", METHODS)
def test_a_callable_on_the_logits_and_class_target_give_the_integer_targets_map(
        name, vit, images):
    c = torch.tensor([1, 3])
    ref = attribute(name, vit, images, c)
    via_callable = attribute(name, vit, images, as_target(lambda z: z).__class__(
        lambda z: z, index=c))
    via_class = attribute(name, vit, images, ClassTarget(c))
    assert rel(via_callable, ref) <= 1e-12
    assert rel(via_class, ref) <= 1e-12


def test_a_plain_callable_returning_one_score_is_a_target(vit, images):
    c = 2
    ref = GAE(vit).attribute(images, target=c, output="tokens")
    got = GAE(vit).attribute(images, target=lambda z: z[:, c], output="tokens")
    assert rel(got, ref) <= 1e-12


@pytest.mark.parametrize("name", LINEAR_IN_SCORE)
def test_contrastive_is_the_difference_of_maps_for_methods_linear_in_the_score(
        name, vit, images):
    a, b = torch.tensor([1, 4]), torch.tensor([0, 2])
    ma, mb = attribute(name, vit, images, a), attribute(name, vit, images, b)
    got = attribute(name, vit, images, Contrastive(a, b))
    # relative to the maps (VanillaGrad's channel sum is 0 up to rounding in a pre-LN ViT)
    scale = max(ma.abs().max().item(), mb.abs().max().item())
    assert (got - (ma - mb)).abs().max().item() <= 1e-10 * scale + 1e-14


def test_class_target_probability_and_multilabel_scores(vit, images):
    c = torch.tensor([1, 3])
    ixg = build_method("token_ixg", vit)
    p = ixg.attribute(images, target=c, score="probability", output="tokens")
    assert rel(ixg.attribute(images, target=ClassTarget(c, score="probability"),
                             output="tokens"), p) <= 1e-12
    # multi-label: d sigmoid(z_c) = sigmoid'(z_c) dz_c, no softmax over the classes; token
    # IxG is linear in the score's gradient
    z = vit(images)[torch.arange(2), c].detach()
    slope = (z.sigmoid() * (1 - z.sigmoid()))[:, None]
    logit_map = ixg.attribute(images, target=c, output="tokens")
    got = ixg.attribute(images, target=MultiLabel(c, score="probability"), output="tokens")
    assert rel(got, slope * logit_map) <= 1e-10
    same = ixg.attribute(images, target=MultiLabel(c), score="probability", output="tokens")
    assert rel(same, got) <= 1e-12
    assert rel(got, p) > 1e-3  # not the softmax probability


# -- token-reading targets ---------------------------------------------------------------
def _cls_logit(model, c):
    W, b = model.head.weight, model.head.bias
    return TokenTarget(lambda z: z[:, 0] @ W.T + b, index=c, rows=[0])


@pytest.mark.parametrize("name", METHODS)
def test_a_token_target_reading_the_class_token_is_the_class_target(name, vit, images):
    """The readout rule gives w = e_CLS for a score read from the class token alone;
    Chefer'21 applies its α1β0 LRP rule inside the model's own head, and a user's head is
    differentiated as it is, so it differs there (documented)."""
    if name in ("chefer21",):
        pytest.skip("Chefer'21's LRP rule acts in the model's head, not in a user's")
    if name == "tis":
        pytest.skip("TIS removes tokens: refused for token-reading targets (tested below)")
    c = torch.tensor([1, 3])
    ref = attribute(name, vit, images, c)
    got = attribute(name, vit, images, _cls_logit(vit, c))
    assert rel(got, ref) <= 1e-10


def test_the_readout_rule_against_a_hand_computed_relevance(vit, images):
    """w_i = ReLU(<z_i, ds/dz_i>) / Σ_j ReLU(...), z the final-normed tokens."""
    probe = torch.randn(vit.embed_dim, dtype=torch.float64, generator=torch.Generator()
                        .manual_seed(3))
    t = TokenTarget(lambda z: ((z[:, 1:] @ probe) ** 2).sum(1))
    ad = adapt(vit)
    with torch.enable_grad(), ad.targeting(t, grid=(4, 4)):
        tr = ad.trace(images, grad=True)
        gradients(tr.logits[:, 0], [tr.x0], trace=tr)
        w = readout_rows(tr)
    z = vit.norm(vit.blocks(vit._pos_embed(vit.patch_embed(images)))).detach()
    z.requires_grad_()
    (g,) = torch.autograd.grad(((z[:, 1:] @ probe) ** 2).sum(), z)
    r = (z * g).sum(-1).clamp(min=0)
    ref = r / r.sum(-1, keepdim=True)
    assert rel(w, ref) <= 1e-10
    assert w[:, 0].abs().max() == 0  # the class token is not read


def test_gradient_free_methods_read_the_rows_uniformly(vit, images):
    """Rollout's map for a target reading rows R is the mean of its per-row maps."""
    rows = [1, 6, 11]
    fn = lambda z: z[:, 1:].sum((1, 2))  # noqa: E731
    whole = Rollout(vit).attribute(images, target=TokenTarget(fn, rows=rows), output="tokens")
    per_row = torch.stack([Rollout(vit).attribute(images, target=TokenTarget(fn, rows=[r]),
                                                  output="tokens") for r in rows])
    assert rel(whole, per_row.mean(0)) <= 1e-12


def test_a_block_target_is_the_gradient_of_its_block_output(vit, images):
    """blocks=(l,): the score reads x_l (the model's own forward, hooked): token IxG at
    x_0 equals autograd through the model's forward."""
    l = 2
    fn = lambda h: (h[:, 1:] ** 2).sum((1, 2))  # noqa: E731
    got = build_method("token_ixg", vit).attribute(images, target=TokenTarget(fn, blocks=l),
                                                   output="tokens")
    seen = {}

    def leaf(module, args, out):  # x_0 as a leaf of the model's own forward
        seen["x0"] = out.detach().requires_grad_()
        return seen["x0"]

    hooks = [vit.norm_pre.register_forward_hook(leaf),
             vit.blocks[l - 1].register_forward_hook(lambda m, i, o: seen.setdefault("x", o))]
    try:
        vit(images)
    finally:
        for h in hooks:
            h.remove()
    (g,) = torch.autograd.grad(fn(seen["x"]).sum(), seen["x0"])
    ref = (seen["x0"] * g).sum(-1)[:, 1:]
    assert rel(got, ref) <= 1e-10


@pytest.mark.parametrize("name", sorted(set(METHODS) - PERTURBATION - {
    "plus:decompx", "skipplus:decompx", "skipplus:gae", "skipplus:tokentm", "random",
    "bt_h", "bt_t", "tam", "chefer21", "legrad",  # use the score's value along a path
    "plus:attn_gradcam", "skipplus:attcat", "fullgrad_plus", "skip_fullgrad_plus"}))
def test_a_several_block_readout_is_the_sum_of_single_block_readouts(name, vit, images):
    """Σ_l w^(l)ᵀ C_l (§10.2): for f_a(x_2) + f_b(x_3), the maps of f_a read at block 2
    plus f_b read at block 3 (the scores themselves: score="logit")."""
    fa = lambda h: (h[:, 1:, :4] ** 2).sum((1, 2))  # noqa: E731
    fb = lambda h: h[:, 0, :6].sum(1)  # noqa: E731
    kw = {"score": "logit"} if "score" in inspect.signature(
        build_method(name, vit).attribute).parameters else {}
    opts: dict = {}
    both = TokenTarget(lambda hs: fa(hs[0]) + fb(hs[1]), blocks=(2, 3))
    got = attribute(name, vit, images, both, **opts)
    ref = attribute(name, vit, images, TokenTarget(fa, blocks=2), **kw, **opts) + attribute(
        name, vit, images, TokenTarget(fb, blocks=3), **kw, **opts)
    assert rel(got, ref) <= 1e-10


def test_negative_blocks_count_from_the_end(vit, images):
    fn = lambda h: h[:, 0].sum(1)  # noqa: E731
    a = GAE(vit).attribute(images, target=TokenTarget(fn, blocks=-1), output="tokens")
    b = GAE(vit).attribute(images, target=TokenTarget(fn, blocks=3), output="tokens")
    assert rel(a, b) == 0


def test_head_target_on_the_patch_grid(vit, images):
    head = torch.nn.Conv2d(vit.embed_dim, 3, 1).double()
    select = torch.zeros(2, 3, 4, 4, dtype=torch.float64)
    select[0, 1, :2] = 1
    select[1, 2, 2:] = 1
    got = TokenTM(vit).attribute(images, target=HeadTarget(head, select), output="tokens")
    ref = torch.cat([TokenTM(vit).attribute(images[i:i + 1], target=HeadTarget(
        head, select[i]), output="tokens") for i in range(2)])
    assert rel(got, ref) <= 1e-10  # per-image selections are per-image columns
    assert torch.isfinite(got).all() and got.std() > 0


def test_noise_tunnel_expands_per_image_targets(vit, images):
    nt = NoiseTunnel(build_method("token_ixg", vit))
    for t in (ClassTarget(torch.tensor([1, 3])), Contrastive([1, 4], [0, 2])):
        got = nt.attribute(images, target=t, nt_samples=3, nt_type="smoothgrad", stdevs=0.0)
        ref = build_method("token_ixg", vit).attribute(images, target=t)
        assert rel(got, ref) <= 1e-10


# -- refusals ----------------------------------------------------------------------------
def test_token_removal_is_refused_for_a_token_reading_target(vit, images):
    t = TokenTarget(lambda z: z[:, 1:].sum((1, 2)))
    before = snapshot(vit)
    with pytest.raises(ValueError, match="removal='mean'"):
        build_method("tis", vit).attribute(images, target=t, n_masks=8)
    with pytest.raises(ValueError, match="reads token rows"):
        deletion(vit, images, GAE(vit), target=t)
    res = deletion(vit, images, GAE(vit), target=t, removal="mean", n_steps=4)
    assert torch.isfinite(torch.as_tensor(res.value)).all()
    assert_unchanged(vit, before)


def test_bad_targets_name_the_fix(vit, images):
    g = GAE(vit)
    with pytest.raises(ValueError, match="block output"):
        g.attribute(images, target=TokenTarget(lambda h: h.sum((1, 2)), blocks=7))
    with pytest.raises(ValueError, match="one score per image"):
        g.attribute(images, target=TokenTarget(lambda z: z.sum()))
    with pytest.raises(TypeError, match="HeadTarget"):
        g.attribute(images, target=torch.nn.Linear(3, 3))
    with pytest.raises(ValueError, match="base method alone"):
        build_method("skipplus:gae", vit).attribute(
            images, target=TokenTarget(lambda h: h.sum((1, 2)), blocks=2))
    with pytest.raises(ValueError, match="Contrastive classes"):
        g.attribute(images, target=Contrastive(1, 99))

    class NoScore(Target):
        pass

    with pytest.raises(NotImplementedError, match="score"):
        g.attribute(images, target=NoScore())


def test_the_model_is_unchanged_and_batches_are_independent(vit, images):
    before = snapshot(vit)
    t = TokenTarget(lambda z: (z[:, 1:, :5] ** 2).sum((1, 2)))
    for name in ("gae", "tokentm", "decompx", "rollout", "cp_lrp"):
        both = attribute(name, vit, images, t)
        one = attribute(name, vit, images[1:], t)
        assert rel(both[1:], one) <= 1e-10
    assert_unchanged(vit, before)


@pytest.mark.parametrize("family", [pytest.param(f, marks=family_marks(f))
                                    for f in EMBEDDING_FAMILIES])
def test_head_less_models_take_token_targets_and_callables_on_the_embedding(family):
    """§10.3: models without a classifier (CLIP/SigLIP towers, head-less timm and Hugging
    Face backbones) explain a callable on their embedding and a head on their tokens."""
    model = make_model(family, dtype=torch.float64)
    x = make_inputs(family, 2, dtype=torch.float64)
    before = snapshot(model)
    e = adapt(model).model_outputs(x).detach()
    for name in ("gae", "tokentm", "decompx", "rollout"):
        f = build_method(name, model)
        a = f.attribute(x, target=lambda z: z[:, 3], output="tokens")
        # the callable on the embedding is the dot product with a one-hot vector
        onehot = torch.zeros(e.shape[-1], dtype=torch.float64)
        onehot[3] = 1
        b = f.attribute(x, target=EmbeddingTarget(onehot, similarity="dot"), output="tokens")
        assert rel(a, b) <= 1e-10
        t = f.attribute(x, target=TokenTarget(lambda z: z[:, -4:, :2].sum((1, 2))),
                        output="tokens")
        assert torch.isfinite(t).all() and t.std() > 0
    assert_unchanged(model, before)


def test_every_metric_takes_targets(vit, images):
    """The metrics score the target on every perturbed input; accuracy metrics need
    competing classes and say so."""
    from captum_vit.metrics import aopc, insertion, max_sensitivity, perturbation_test, saco

    token = TokenTarget(lambda z: (z[:, 1:, :3] ** 2).sum((1, 2)))
    for t in (Contrastive([1, 4], [0, 2]), token, ClassTarget([1, 2])):
        removal = {"removal": "mean"} if t is token else {}
        for metric in (aopc, insertion, saco):
            res = metric(vit, images, GAE(vit), target=t, **removal)
            assert torch.isfinite(torch.as_tensor(res.value)).all()
        assert torch.isfinite(torch.as_tensor(
            max_sensitivity(vit, images, GAE(vit), target=t, n_samples=2).value)).all()
    perturbation_test(vit, images, GAE(vit), target=ClassTarget([1, 2]))
    with pytest.raises(ValueError, match="competing classes"):
        perturbation_test(vit, images, GAE(vit), target=Contrastive(1, 0))


@pytest.mark.parametrize("name", ["raw_attention", "rollout", "globenc", "alti"])
def test_class_agnostic_methods_refuse_a_contrast(name, vit, images):
    with pytest.raises(ValueError, match="class-agnostic"):
        build_method(name, vit).attribute(images, target=Contrastive(1, 0))


def test_alpha_logit_needs_a_class():
    from captum_vit.adapters import readout_alpha

    model = make_model("hf_dinov2", dtype=torch.float64)
    x = make_inputs("hf_dinov2", 2, dtype=torch.float64)
    with readout_alpha(model, "logit"):
        GAE(model).attribute(x, target=ClassTarget([0, 1]))
        with pytest.raises(ValueError, match="fixed alpha"):
            GAE(model).attribute(x, target=Contrastive(0, 1))
