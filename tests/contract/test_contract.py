"""The API contract every registered method owes users, on every supported model family.

Generated from the registry (``available_methods(compositions=True)``, ``random``
included) × the classifier examples of the family catalogue
(``tests.helpers.classifier_families()``): a new method or family is covered by registering
it, not by copying tests; what a family is expected to do comes from its tags. Per-method
files keep only their references and parity checks.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from captum.attr import NoiseTunnel
from captum.metrics import sensitivity_max

from captum_vit.adapters import adapt, catalog
from captum_vit.registry import available_methods, build_method
from tests.helpers import (
    VIDEO_WINDOW_REFUSERS,
    WINDOW_REFUSERS,
    assert_unchanged,
    classifier_families,
    family_marks,
    make_inputs,
    make_model,
    pools_queries,
    refuses_shared_windows,
    snapshot,
    windowed_families,
)


def contract_methods() -> list[str]:
    """Every registered method, plus compositions over the other kinds of base the
    combinators take (read from the registry at each call)."""
    return available_methods(compositions=True) + [
        "plus:ixg", "plus:gradient", "plus:captum:InputXGradient", "skipplus:captum:Saliency"]


def contract_cases() -> list:
    """The ``(name, family)`` parameters of the contract tests: every name of
    :func:`contract_methods` on every classifier example of the catalogue (read at each
    call)."""
    families = classifier_families()
    return [pytest.param(m, f, marks=family_marks(f, m)) for m in contract_methods()
            for f in families]


METHODS = contract_methods()
CASES = contract_cases()
LOWER_BOUND_METHODS = ("gae", "tokentm", "decompx", "gradcam", "attnlrp", "tis", "skipplus:gae")
"""A few methods of each kind (attention flow, decomposition, CAM, LRP, perturbation, a
composition) whose output contract also runs against the oldest supported versions."""
OUTPUT_CASES = [pytest.param(*c.values, marks=(*c.marks, pytest.mark.lower_bounds))
                if c.values[0] in LOWER_BOUND_METHODS else c for c in CASES]
FAST = {"tis": {"n_masks": 16}}  # TIS: fewer masks than the paper's 1024 (still clustered)
# BT-H / BT-T / TAM: 3 integration steps instead of 20, and a start block inside the
# 3-block contract models (the defaults 3 and 4 leave R = I / σ = w Ā_{L-1} there)
FAST.update({"bt_h": {"n_steps": 3, "start_layer": 1}, "bt_t": {"n_steps": 3, "start_layer": 1},
             "tam": {"n_steps": 3, "start_layer": 0}})
FAST["rise"] = {"n_masks": 16}  # RISE: 16 random masks instead of the paper's 4000
_MODELS: dict[tuple[str, torch.dtype], torch.nn.Module] = {}


def model_of(family: str, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """One model per family and dtype for the whole module (the contract says calls never
    change it, and every test checks that)."""
    key = (family, dtype)
    if key not in _MODELS:
        _MODELS[key] = make_model(family, dtype=dtype)
    return _MODELS[key]


def attribute(method, x, target=None, **kw):
    return method.attribute(x, target=target, **{**FAST.get(_name(method), {}), **kw})


def _name(method) -> str:
    return getattr(method, "_contract_name", "")


def build(name: str, model):
    method = build_method(name, model)
    method._contract_name = name
    return method


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9 * (1 + b.abs().max().item()))


def tag_representatives() -> list[str]:
    """The first classifier example of each (library, example tags) pair in catalogue
    order (read at each call): what Captum's wrappers see of a family is the method's
    signature and the output shapes, which the tags decide and
    :func:`test_outputs_batch_and_targets` checks on every example."""
    seen: dict[tuple, str] = {}
    for f in classifier_families():
        fam, ex = catalog.example(f)
        seen.setdefault((ex.library, tuple(sorted(fam.example_tags(f)))), f)
    return list(seen.values())


@pytest.mark.parametrize(("name", "family"), OUTPUT_CASES)
def test_outputs_batch_and_targets(name, family):
    """Three output formats that agree; a batch equals its images one by one; target=None
    is the predicted class. The ways of spelling a target and Captum's tuple inputs, which
    the front reads alike for every family, are
    :func:`test_captum_tuples_and_numpy_targets`'s."""
    model = model_of(family)
    x = make_inputs(family, batch=2)
    before = snapshot(model)
    method = build(name, model)
    lay = adapt(model).layout(x)
    (gh, gw), (ph, pw) = lay.grid, lay.patch_size

    pred = adapt(model).model_logits(x).argmax(-1)
    tokens = attribute(method, x, None, output="tokens")
    assert tokens.shape == (2, lay.num_patches) and torch.isfinite(tokens).all()
    assert tokens.dtype == torch.float64
    close(attribute(method, x, pred, output="tokens"), tokens)
    grid = attribute(method, x, None, output="grid")
    pixels = attribute(method, x, None)
    assert pixels.shape == x.shape
    if lay.frames is None:
        assert grid.shape == (2, 1, gh, gw)
        up = grid.repeat_interleave(ph, 2).repeat_interleave(pw, 3)[..., :x.shape[2],
                                                                      :x.shape[3]]
    else:  # videos: one grid per frame slice, each tubelet copied to its t frames
        assert grid.shape == (2, 1, lay.frames, gh // lay.frames, gw)
        up = grid[:, 0, :, None].repeat_interleave(lay.tubelet, 1)
        up = up.repeat_interleave(ph, 3).repeat_interleave(pw, 4)
    close(grid.reshape(2, -1), tokens)
    close(pixels, up.expand_as(x))

    target = torch.tensor([1, 4])
    batch = attribute(method, x, target, output="tokens")
    one_by_one = torch.cat([attribute(method, x[i:i + 1], int(target[i]), output="tokens")
                            for i in range(2)])
    close(batch, one_by_one)
    assert_unchanged(model, before)


@pytest.mark.parametrize(("name", "family"), [
    pytest.param(*c.values, marks=c.marks) for c in OUTPUT_CASES
    if c.values[1] in tag_representatives()])
def test_captum_tuples_and_numpy_targets(name, family):
    """numpy arrays, lists of numpy integers and a numpy scalar are targets like the
    integers they hold; Captum's 1-tuple inputs give a 1-tuple. On one example of each
    kind of family (:func:`tag_representatives`)."""
    model = model_of(family)
    x = make_inputs(family, batch=2)
    before = snapshot(model)
    method = build(name, model)
    target = torch.tensor([1, 4])
    batch = attribute(method, x, target, output="tokens")
    close(attribute(method, x, np.array([1, 4]), output="tokens"), batch)
    close(attribute(method, x, [np.int64(1), 4], output="tokens"), batch)
    close(attribute(method, x[:1], np.int64(1), output="tokens"), batch[:1])
    out = attribute(method, (x,), target, output="tokens")
    assert isinstance(out, tuple) and len(out) == 1
    close(out[0], batch)
    assert_unchanged(model, before)


TARGET_FAMILIES = [next(f for f in classifier_families() if catalog.example(f)[1].library == lib)
                   for lib in ("timm", "transformers")]
"""The families of the target axis: the first timm and the first Hugging Face classifier
example of the catalogue."""
TARGET_CASES = [pytest.param(m, f, k, marks=family_marks(f)) for m in METHODS
                for f in TARGET_FAMILIES for k in ("callable", "token")]
TOKEN_REFUSERS = {"tis"}
"""Methods that remove tokens: they refuse a target reading token rows by name."""
USER_HEAD_RULES = {"chefer21"}
"""Methods whose relevance pass runs the user's head by its gradient (LRP-0) where the
model's own classifier has its own rule (Chefer'21's α1β0): a ``TokenTarget`` running
the classifier gives another map than the class, the same for any ``rows``."""


def _token_target():
    """A head of the user's own on the token states: a fixed random probe on the patches."""
    from captum_vit.targets import TokenTarget

    def probe(z):
        w = torch.linspace(-1, 1, z.shape[-1], dtype=z.dtype, device=z.device)
        return ((z[:, 1:] @ w) ** 2).mean(1)
    return TokenTarget(probe)


def _classifier(model):
    """The model's own classifier on the final-normed tokens' class-token row."""
    head = getattr(model, "classifier", None)  # Hugging Face
    if head is not None:
        return lambda z: head(z[:, 0])
    return lambda z: model.head(model.fc_norm(z[:, 0]))  # timm


def _logit(method) -> dict:
    """``score="logit"`` for a method that takes a score (the class's own logit, which a
    single score of the user's own is: its "probability" would be a sigmoid)."""
    probe = getattr(method, "_probe", None)
    params = inspect.signature((method if probe is None else probe).attribute).parameters
    return {"score": "logit"} if "score" in params else {}


@pytest.mark.parametrize(("name", "family", "kind"), TARGET_CASES)
def test_target_kinds(name, family, kind):
    """The target axis (SPEC_REACH §10.1-10.2), against the integer target's map:

    - ``"callable"``: ``CallableTarget(lambda z: z, index=c)`` gives the integer
      target's map; so does a plain callable returning one score per image,
      ``lambda z: z[:, c]``, at ``score="logit"`` (a single score's "probability" is its
      sigmoid, not the softmax of a class);
    - ``"token"``: a head of the user's own gives finite, non-constant maps image by
      image, or a refusal that names the fix (TIS); a ``TokenTarget`` running the
      model's own classifier on the class-token row with ``rows`` left at its default:
      the gradient-weighted methods read it out with ``w = e_CLS`` (§10.2: the positive
      input×gradient relevance of the read rows) and every method that propagates the
      score gives the integer target's map; the gradient-free ones (class-agnostic) read
      out uniform weights over the patch rows (the default ``rows``), so their map is the
      mean of the single-row maps, and ``rows=[0]`` is the integer target's map;
      Chefer'21 runs the user's head by its gradient (:data:`USER_HEAD_RULES`).

    The model is unchanged."""
    from captum_vit.targets import CallableTarget, TokenTarget

    model = model_of(family)
    x = make_inputs(family, batch=2)
    before = snapshot(model)
    method = build(name, model)
    if kind == "callable":
        c = torch.tensor([1, 4])
        close(attribute(method, x, CallableTarget(lambda z: z, index=c), output="tokens"),
              attribute(method, x, c, output="tokens"))
        kw = _logit(method)
        close(attribute(method, x, lambda z: z[:, 3], output="tokens", **kw),
              attribute(method, x, 3, output="tokens", **kw))
    else:
        t = _token_target()
        if name in TOKEN_REFUSERS:
            with pytest.raises(ValueError, match="reads token rows"):
                attribute(method, x, t)
        else:
            maps = attribute(method, x, t, output="tokens")
            assert torch.isfinite(maps).all()
            if name != "random":
                assert maps.std() > 0
            close(maps[1:], attribute(method, x[1:], t, output="tokens"))
            head, kw = _classifier(model), _logit(method)
            cls = attribute(method, x, TokenTarget(lambda z: head(z)[:, 3]), output="tokens",
                            **kw)
            ref = attribute(method, x, 3, output="tokens", **kw)
            row0 = attribute(method, x, TokenTarget(lambda z: head(z)[:, 3], rows=[0]),
                             output="tokens", **kw)
            if getattr(method, "class_agnostic", False):
                close(row0, ref)
                n = adapt(model).layout(x).num_tokens
                every = attribute(method, x, TokenTarget(lambda z: head(z)[:, 3],
                                                         rows=range(n)), output="tokens")
                close(every, (row0 + (n - 1) * cls) / n)  # uniform weights, linear in w
                assert (cls - ref).abs().max() > 1e-6 * ref.abs().max()  # not e_CLS
            elif name in USER_HEAD_RULES:
                close(cls, row0)  # gradient-weighted: rows do not matter
            else:
                close(cls, ref)
                close(row0, ref)
    assert_unchanged(model, before)


NOISE_CASES = [c for c in CASES if c.values[1] in tag_representatives()]


@pytest.mark.parametrize(("name", "family"), NOISE_CASES)
def test_captum_noise_tunnel_and_sensitivity(name, family):
    """Captum's NoiseTunnel wraps the method; captum.metrics.sensitivity_max runs on it
    (under no_grad, as Captum calls it). Every method, on one example of each kind of
    family (:func:`tag_representatives`): a family changes nothing Captum's wrappers
    read beyond the output shapes its tags decide."""
    model = model_of(family)
    x = make_inputs(family, batch=2)
    before = snapshot(model)
    method = build(name, model)
    kw = FAST.get(name, {})
    nt = NoiseTunnel(method).attribute(x, nt_type="smoothgrad", nt_samples=2, stdevs=0.05,
                                       target=[0, 1], **kw)
    assert nt.shape == x.shape and torch.isfinite(nt).all()
    sens = sensitivity_max(method.attribute, x, target=[0, 1], n_perturb_samples=2,
                           perturb_radius=0.01, **kw)
    assert sens.shape == (2,) and torch.isfinite(sens).all()
    assert_unchanged(model, before)


# the refusal of a windowed model is expected in the test itself (its bad-input checks
# pass on those models too): the family's marks without the method's xfail
CLEAR_ERROR_CASES = [pytest.param(m, f, marks=family_marks(f)) for m in METHODS
                     for f in classifier_families()]


def test_window_refusal_marks_are_strict_and_narrow():
    """The expected refusals of windowed models are strict xfails (an XPASS fails) that
    expect the refusal's ValueError, and the clear-errors test, which passes on those
    models, does not take them (issue 42: four XPASSes of TIS on Swin)."""
    for family in [f for f in windowed_families() if f in classifier_families()]:
        xfails = [m for m in family_marks(family, "tis") if m.name == "xfail"]
        assert len(xfails) == 1, family
        assert xfails[0].kwargs["strict"] is True and xfails[0].kwargs["raises"] is ValueError
    assert not [c.values for c in CLEAR_ERROR_CASES if any(m.name == "xfail" for m in c.marks)]


@pytest.mark.parametrize(("name", "family"), CLEAR_ERROR_CASES)
def test_clear_errors_leave_the_model_unchanged(name, family, monkeypatch):
    """Bad input gets a TypeError/ValueError naming the argument; the dtype rule (no
    silent casts) names both dtypes; a failure inside the model's forward leaves the model
    exactly as it was."""
    model = model_of(family)
    x = make_inputs(family, batch=2)
    before = snapshot(model)
    method = build(name, model)
    with pytest.raises(TypeError, match=r"torch\.float32.*torch\.float64"):
        attribute(method, x.float())
    with pytest.raises(ValueError, match="target"):
        attribute(method, x, 5)  # the models have 5 classes
    with pytest.raises(ValueError, match="target"):
        attribute(method, x, [0, 1, 2])
    with pytest.raises(TypeError, match="target"):
        attribute(method, x, True)
    with pytest.raises(TypeError, match="target"):
        attribute(method, x, torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="output"):
        attribute(method, x, output="heatmap")
    with pytest.raises(ValueError, match="inputs"):
        attribute(method, x[0])
    assert_unchanged(model, before)

    adapter = adapt(model)
    calls = {"n": 0}
    block = type(adapter).block

    def failing_block(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 1:
            raise RuntimeError("injected failure")
        return block(self, *args, **kwargs)

    monkeypatch.setattr(type(adapter), "block", failing_block)
    try:
        attribute(method, x, [0, 1])
    except RuntimeError as e:
        assert "injected failure" in str(e)
    except ValueError as e:  # TIS refuses a windowed model by name
        if "pools its queries" in str(e):  # a token-mixing method refuses query pooling
            assert not pools_queries(name, family), e
        else:
            assert family in windowed_families(), e
            tags = catalog.example(family)[0].example_tags(family)
            if refuses_shared_windows(name) and "shared_windows" in tags:
                assert "share a token" in str(e), e
            else:
                assert name in WINDOW_REFUSERS | VIDEO_WINDOW_REFUSERS, e
                assert "within windows" in str(e) and "RISE" in str(e)
    monkeypatch.undo()
    assert_unchanged(model, before)


@pytest.mark.parametrize("name", METHODS)
def test_half_precision_model_gives_float32_maps(name):
    """A bfloat16 model with bfloat16 inputs: maps are accumulated and returned in float32."""
    model = model_of("vit", torch.bfloat16)
    x = make_inputs("vit", batch=2, dtype=torch.bfloat16)
    before = snapshot(model)
    out = attribute(build(name, model), x, [0, 1], output="tokens")
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert_unchanged(model, before)


def test_every_registered_name_is_covered():
    """The contract runs over the registry itself, so nothing registered escapes it."""
    assert set(available_methods()) <= set(METHODS)
    assert {"random", "plus:decompx", "skipplus:decompx"} <= set(METHODS)
