"""Targets checked from outside (issue 42): DecompX's rule for a score nonlinear in the
states it reads (both routes, the same numbers), the detection box in the model's dtype,
which methods are linear in the score, and bad target inputs refused by name."""

from __future__ import annotations

import pytest
import torch

from captum_vit import DecompX
from captum_vit.methods.table import split_composition
from captum_vit.registry import available_methods, build_method
from captum_vit.targets import LINEAR_IN_SCORE, ClassTarget, Contrastive, TokenTarget
from tests.helpers import make_inputs, make_model, needs_transformers

ROUTES = ("gradient", "explicit")


@pytest.fixture(scope="module")
def vit():
    return make_model("vit", dtype=torch.float64)


@pytest.fixture(scope="module")
def images():
    return make_inputs("vit", 2, dtype=torch.float64)


def _quadratic(z):
    w = torch.linspace(-1, 1, z.shape[-1], dtype=z.dtype)
    return ((z[:, 1:] @ w) ** 2).mean(1)


def _close(a, b, tol=1e-10):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol * (1 + b.abs().max().item()))


# -- DecompX: the decomposition stops at the read states, the score is linearised there --
def test_decompx_routes_agree_on_a_quadratic_token_head(vit, images):
    """D7: both routes give the same tokens, bias and linearised score; for a quadratic
    head ``⟨z, ∂s/∂z⟩ = 2 s`` (Euler), so ``logit = 2 score`` and the completeness error
    is ``-score``."""
    t = TokenTarget(_quadratic)
    res = {r: DecompX(vit, route=r).decompose(images, t) for r in ROUTES}
    g, e = res["gradient"], res["explicit"]
    for name in ("tokens", "bias", "logit", "score"):
        _close(getattr(g, name), getattr(e, name))
    with torch.no_grad():
        ref = _quadratic(vit.forward_features(images))  # the score, by hand (normed)
    for r in res.values():
        _close(r.score, ref)
        _close(r.tokens.sum(-1) + r.bias, r.logit)
        _close(r.logit, 2 * ref)
        _close(r.completeness_error, -ref)


def test_decompx_routes_agree_on_a_probability_of_the_logits(vit, images):
    """A target on the logits is linearised at the logits, through the model's own head
    (D6): ``ℓ = Σ_c z_c ∂p_t/∂z_c = p_t (z_t − Σ_c p_c z_c)``, written here by hand; the
    explicit route used to fail on any target on the logits."""
    c = torch.tensor([1, 3])
    with torch.no_grad():
        z = vit(images)
    p = z.softmax(-1)
    pt = p.gather(1, c[:, None])[:, 0]
    ref = pt * (z.gather(1, c[:, None])[:, 0] - (p * z).sum(-1))
    for route in ROUTES:
        r = DecompX(vit, route=route).decompose(images, ClassTarget(c, score="probability"))
        _close(r.score, pt)
        _close(r.logit, ref)
        _close(r.tokens.sum(-1) + r.bias, ref)


@pytest.mark.parametrize("route", ROUTES)
def test_decompx_class_target_is_the_integer_target(vit, images, route):
    """A class as a ClassTarget decomposes like the integer target (complete: the score
    is linear in the logits, the classifier's bias in the bias source)."""
    c = torch.tensor([1, 3])
    a = DecompX(vit, route=route).decompose(images, c)
    b = DecompX(vit, route=route).decompose(images, ClassTarget(c))
    for name in ("tokens", "bias", "logit", "score"):
        _close(getattr(b, name), getattr(a, name))
    _close(a.completeness_error, torch.zeros(2, dtype=torch.float64), 1e-12)
    with torch.no_grad():
        _close(a.logit, vit(images).gather(1, c[:, None])[:, 0])


def test_decompx_routes_agree_on_several_blocks(vit, images):
    """A head on two block outputs: each read block is linearised with its own partial
    derivative on both routes (``s = Σ a·b + b₀`` gives ``ℓ = 2 Σ a·b + b₀``)."""
    def head(xs):
        a, b = xs
        return (a[:, 1:, 2] * b[:, 1:, 3]).sum(1) + b[:, 0, 1]

    t = TokenTarget(head, blocks=(1, 3))
    g, e = (DecompX(vit, route=r).decompose(images, t) for r in ROUTES)
    for name in ("tokens", "bias", "logit", "score"):
        _close(getattr(g, name), getattr(e, name))
    with torch.no_grad():
        x = vit.patch_embed(images)
        x = vit._pos_embed(x)
        x1 = vit.blocks[0](x)
        x3 = vit.blocks[2](vit.blocks[1](x1))
    q = (x1[:, 1:, 2] * x3[:, 1:, 3]).sum(1)
    _close(g.score, q + x3[:, 0, 1])
    _close(g.logit, 2 * q + x3[:, 0, 1])
    _close(g.tokens.sum(-1) + g.bias, g.logit)


@needs_transformers
def test_decompx_routes_agree_on_a_sam_mask():
    """SAM's mask score (prompt encoder and mask decoder, nonlinear in the neck's output
    the target reads): the same tokens, bias and linearised score on both routes, which
    sum to each other; ``score`` is SAM's own."""
    from captum_vit.targets import SamMaskTarget
    from tests.families.test_sam import POINTS, hf_sam
    from tests.families.test_sam import images as sam_images

    model = hf_sam()
    x = sam_images()
    t = SamMaskTarget(model, points=POINTS, mask=0)
    g, e = (DecompX(model, route=r).decompose(x, t) for r in ROUTES)
    for name in ("tokens", "bias", "logit", "score"):
        _close(getattr(g, name), getattr(e, name))
    _close(e.tokens.sum(-1) + e.bias, e.logit)
    assert (e.completeness_error.abs() > 1e-6 * e.score.abs()).all()  # nonlinear: not 0


# -- DetectionTarget: the box in the model's dtype ----------------------------------------
@needs_transformers
def test_a_box_of_python_floats_is_scored_in_a_float64_model_to_float64_precision():
    """``box=[...]`` of Python floats is kept in float64 and cast to the model's dtype
    at score time: the score is ``-|b̂ - b|₁`` to float64 rounding (float32 storage
    was off by ~1.5e-8)."""
    from captum_vit.adapters import adapt
    from captum_vit.targets import DetectionTarget
    from tests.families.test_hf_yolos import images as yolos_images
    from tests.families.test_hf_yolos import make_yolos

    model = make_yolos()
    ad = adapt(model)
    x = yolos_images()
    box = [0.123456789, 0.987654321, 0.314159265, 0.271828182]
    with torch.no_grad():
        ref = -(model(pixel_values=x).pred_boxes[:, 1]
                - torch.tensor(box, dtype=torch.float64)).abs().sum(-1)
    for target in (DetectionTarget(1, box=box), DetectionTarget(1, box=[box, box])):
        assert target.box.dtype == torch.float64
        resolved = target.resolve(ad, x)
        with torch.no_grad(), ad.targeting(resolved):
            cols = ad.run(ad.embed(x))
        got = cols.gather(1, resolved.index(2)[:, None])[:, 0]
        torch.testing.assert_close(got, ref, rtol=1e-13, atol=1e-13)
    f32 = DetectionTarget(1, box=torch.tensor(box, dtype=torch.float32))
    assert f32.box.dtype == torch.float32  # a tensor keeps the dtype it was given


def test_a_callable_written_for_the_batch_names_the_fix_under_perturbation(vit, images):
    """A plain callable closing over a class per image is called on the perturbed
    copies too: the refusal says so and names ``CallableTarget(..., index=)``."""
    c = torch.tensor([1, 3])
    with pytest.raises(ValueError, match=r"index=.*CallableTarget\(lambda z: z, index="):
        build_method("rise", vit).attribute(images, target=lambda z: z.gather(1, c[:, None])[:, 0],
                                            n_masks=8)


# -- which methods are linear in the score -------------------------------------------------
def _split_options(method, options):
    """``LINEAR_IN_SCORE`` options as (constructor, attribute) keywords."""
    import inspect

    params = inspect.signature(method.attribute).parameters
    return ({k: v for k, v in options.items() if k not in params},
            {k: v for k, v in options.items() if k in params})


VARIANT_INIT = {"xgradcam_plus": {"plus": True}}
"""The constructor options of registered variants that take constructor options here."""
CONTRAST_FAST = {"tis": {"n_masks": 16}, "rise": {"n_masks": 16}, "bt_h": {"n_steps": 3},
                 "bt_t": {"n_steps": 3}, "tam": {"n_steps": 3, "start_layer": 0}}


def _contrast_gap(name, model, x, options):
    """``(|map(Contrastive(1, 3)) − (map(1) − map(3))|_max, max |map|)`` of ``name``."""
    m = build_method(name, model)
    init, call = _split_options(m, options)
    if init:  # constructor options on top of the registered configuration
        m = type(m)(model, **VARIANT_INIT.get(name, {}), **init)
    kw = {**CONTRAST_FAST.get(name, {}), **call}
    a, b = (m.attribute(x, target=c, output="tokens", **kw) for c in (1, 3))
    both = m.attribute(x, target=Contrastive(1, 3), output="tokens", **kw)
    return (both - (a - b)).abs().max().item(), max(a.abs().max().item(), b.abs().max().item())


@pytest.mark.parametrize("name", sorted(LINEAR_IN_SCORE))
def test_every_listed_method_is_linear_in_the_score(name, vit, images):
    """``LINEAR_IN_SCORE``: with the options listed, ``map(Contrastive(a, b))`` is
    ``map(a) − map(b)`` to float64 rounding; at the defaults the methods listed with
    options are not."""
    options = LINEAR_IN_SCORE[name]
    gap, scale = _contrast_gap(name, vit, images, options)
    assert gap <= 1e-9 * scale + 1e-14
    if options:
        gap, scale = _contrast_gap(name, vit, images, {})
        assert gap > 1e-3 * scale


@pytest.mark.parametrize("name", [m for m in available_methods(compositions=True)
                                  if m not in LINEAR_IN_SCORE])
def test_no_other_method_is_linear_in_the_score(name, vit, images):
    """The list is exact: every other registered method (and composition) explains a
    contrast as one score, not as a difference of maps, or refuses it (class-agnostic);
    PLUS / SkipPLUS are linear exactly where their base is, at its defaults."""
    base = split_composition(name)
    if base is not None and LINEAR_IN_SCORE.get(base[1]) == {}:
        gap, scale = _contrast_gap(name, vit, images, {})
        assert gap <= 1e-9 * scale + 1e-14  # a sum of linear maps
        return
    method = build_method(name, vit)
    if getattr(method, "class_agnostic", False):
        with pytest.raises(ValueError, match="class-agnostic"):
            method.attribute(images, target=Contrastive(1, 3))
        return
    gap, scale = _contrast_gap(name, vit, images, {})
    assert scale > 1e-8 and gap > 1e-3 * scale


def test_the_targets_guide_lists_the_linear_methods():
    """The Targets guide's "Linear in the score" paragraph names exactly the methods of
    ``LINEAR_IN_SCORE`` and their options."""
    import re
    from pathlib import Path

    page = (Path(__file__).parents[2] / "docs/source/guide/targets.md").read_text()
    para = page[page.index("**Linear in the score**"):]
    para = para[:para.index("\n\n")]
    names = set(re.findall(r"`([a-z_]+)`", para)) & set(available_methods(compositions=True))
    assert names == set(LINEAR_IN_SCORE)
    for options in LINEAR_IN_SCORE.values():
        for k, v in options.items():
            assert f"`{k}={v}`" in para or f'`{k}="{v}"`' in para


# -- bad target inputs: a ValueError naming the argument and the fix, the model unchanged --
@needs_transformers
def test_a_sam_point_outside_the_image_is_refused():
    from captum_vit import GAE
    from captum_vit.targets import SamMaskTarget
    from tests.families.test_sam import hf_sam
    from tests.families.test_sam import images as sam_images
    from tests.helpers import assert_unchanged, snapshot

    model = hf_sam()
    x = sam_images()  # 32 x 32
    before = snapshot(model)
    for kw in ({"points": [[40.0, 5.0]]}, {"points": [[5.0, -1.0]]},
               {"boxes": [2.0, 2.0, 33.0, 20.0]}):
        with pytest.raises(ValueError, match=r"outside the 32x32 images.*pixel coordinates"):
            GAE(model).attribute(x, target=SamMaskTarget(model, **kw))
    assert_unchanged(model, before)
    edge = SamMaskTarget(model, points=[[32.0, 0.0]])  # on the border: inside
    edge._check_inside(32, 32)


@needs_transformers
def test_a_depth_target_whose_region_is_empty_is_refused():
    from captum_vit.targets import DepthTarget
    from tests.families.test_hf_depth import depth_model

    model = depth_model("depth_anything")
    with pytest.raises(ValueError, match=r"select selects no pixel.*non-zero"):
        DepthTarget(model, torch.zeros(28, 28))
    sel = torch.zeros(2, 28, 28, dtype=torch.bool)
    sel[0, :4, :4] = True
    with pytest.raises(ValueError, match=r"select of image\(s\) \[1\] selects no pixel"):
        DepthTarget(model, sel)


def _open_clip():
    from tests.helpers import have_open_clip, make_open_clip_model

    if not have_open_clip():
        pytest.skip("open_clip not installed")
    return make_open_clip_model("open_clip")


def test_clip_text_target_refuses_an_empty_prompt():
    from open_clip.tokenizer import SimpleTokenizer

    from captum_vit.targets import clip_text_target

    model = _open_clip()
    tok = SimpleTokenizer(context_length=8)
    for texts in ([""], ["a dog", "  "]):
        with pytest.raises(ValueError, match=r"texts \[\d\] is empty.*give each prompt words"):
            clip_text_target(model, tok, texts)


def test_clip_text_target_refuses_a_tokenizer_without_ids():
    """OpenCLIP and Hugging Face: no ids (an empty tensor, None, a list, floats) get a
    clear error naming the tokenizer, not an error from inside the text encoder."""
    from captum_vit.targets import clip_text_target

    model = _open_clip()
    with pytest.raises(ValueError, match=r"tokenizer returned no token ids.*\(1, 0\)"):
        clip_text_target(model, lambda t: torch.zeros(1, 0, dtype=torch.long), ["a dog"])
    with pytest.raises(TypeError, match=r"tokenizer returned no token ids.*float"):
        clip_text_target(model, lambda t: torch.ones(1, 8), ["a dog"])
    with pytest.raises(ValueError, match=r"3 rows of token ids for 1 texts"):
        clip_text_target(model, lambda t: torch.ones(3, 8, dtype=torch.long), ["a dog"])
    transformers = pytest.importorskip("transformers")
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, image_size=32, patch_size=8)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, vocab_size=100, max_position_embeddings=8)
    hf = transformers.CLIPModel(transformers.CLIPConfig(text_config=text,
                                                        vision_config=vision)).eval()
    for tok in (lambda **k: {"input_ids": None}, lambda **k: {"input_ids": [[1, 2]]}):
        with pytest.raises(TypeError, match=r"tokenizer returned no token ids: its input_ids"):
            clip_text_target(hf, tok, ["a dog"])
    with pytest.raises(ValueError, match=r"tokenizer returned no token ids"):
        clip_text_target(hf, lambda **k: {"input_ids": torch.zeros(1, 0, dtype=torch.long)},
                         ["a dog"])
    with pytest.raises(TypeError, match=r"Hugging Face tokenizer or processor, called as"):
        clip_text_target(hf, lambda texts: torch.ones(1, 3, dtype=torch.long), ["a dog"])


@needs_transformers
def test_a_vlm_answer_outside_the_vocabulary_is_refused():
    from captum_vit.targets import VLMAnswer
    from tests.families.test_hf_vlm import llava, prompt
    from tests.helpers import assert_unchanged, snapshot

    model = llava()
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"answer_ids \[300\] are not token ids.*\[0, 300\)"):
        VLMAnswer(model, prompt(5, 6), [7, 300])
    with pytest.raises(ValueError, match=r"answer_ids \[-3\] are not token ids"):
        VLMAnswer(model, prompt(5, 6), [-3])
    with pytest.raises(ValueError, match=r"input_ids \[1000\] are not token ids"):
        VLMAnswer(model, prompt(5, 1000), [7])
    VLMAnswer(model, prompt(5, 6), [[7, 8], [9, -100]])  # -100 pads a shorter answer
    assert_unchanged(model, before)


def test_a_head_that_does_not_fit_the_tokens_is_named(vit, images):
    from captum_vit import GAE
    from captum_vit.targets import HeadTarget
    from tests.helpers import assert_unchanged, snapshot

    before = snapshot(vit)
    dim = vit.embed_dim
    head = torch.nn.Conv2d(dim + 1, 3, 1).double()  # expects one channel more
    for name in ("gae", "token_ixg", "decompx"):
        with pytest.raises(ValueError, match=rf"HeadTarget's head \(your Conv2d\) failed on "
                                             rf"the patch grid.*\(2, {dim}, 4, 4\).*D = {dim}"):
            build_method(name, vit).attribute(images, target=HeadTarget(head, torch.ones(3, 4, 4)))
    with pytest.raises(ValueError, match="HeadTarget's head"):
        DecompX(vit, route="explicit").decompose(images, HeadTarget(head, torch.ones(3, 4, 4)))
    assert_unchanged(vit, before)
    GAE(vit).attribute(images, target=HeadTarget(torch.nn.Conv2d(dim, 3, 1).double(),
                                                 torch.ones(3, 4, 4)))


# -- TokenTM: a single score of the user's own is explained as it is --------------------------
def test_tokentm_explains_a_single_score_itself(vit, images):
    """TokenTM's default differentiates the softmax probability where scores compete (an
    integer class, ``index=`` columns) and a single score itself (a plain callable, a
    ``TokenTarget``): their sigmoid saturates. A classifier whose class logit is 100
    (bias shifted): the sigmoid's gradient is exactly 0 there, so the explicit
    ``score="probability"`` map of a ``TokenTarget`` loses ∇A and its readout falls back to
    uniform weights; the default explains the score and gives the class's logit map."""
    import copy

    from captum_vit import TokenTM
    from captum_vit.targets import CallableTarget

    def tokens(m, target, **kw):
        return TokenTM(m).attribute(images, target=target, output="tokens", **kw)

    logit = tokens(vit, 3, score="logit")
    _close(tokens(vit, lambda z: z[:, 3]), logit)
    _close(tokens(vit, TokenTarget(lambda z: vit.head(z[:, 0])[:, 3])), logit)
    _close(tokens(vit, CallableTarget(lambda z: z, index=[3, 3])), tokens(vit, 3))
    sat = copy.deepcopy(vit)
    with torch.no_grad():
        sat.head.bias[3] += 100.0  # sigmoid(≈100) == 1.0 exactly: its gradient is 0
    t = TokenTarget(lambda z: sat.head(z[:, 0])[:, 3])
    _close(tokens(sat, t), logit)  # the bias does not change the logit's gradient
    flat = tokens(sat, t, score="probability")
    assert (flat - logit).abs().max() > 1e-3 * logit.abs().max()
