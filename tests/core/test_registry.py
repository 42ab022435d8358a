"""The registry is the only list of names: every spelling resolves to one method."""

from __future__ import annotations

import pytest
import torch
from captum.attr import IntegratedGradients

from captum_vit import GAE, TIS, DecompX, RandomMap, SkipPLUS, TokenTM
from captum_vit._base import check_scalar
from captum_vit.registry import (
    FEATURED_COMPOSITIONS,
    METHODS,
    available_methods,
    build_method,
    canonical_name,
    method_factory,
    parse_methods,
    quick_options,
)
from tests.helpers import make_inputs, make_model

pytestmark = pytest.mark.lower_bounds  # also run against the oldest supported versions


@pytest.mark.parametrize(("spelling", "canonical"), [
    ("GAE", "gae"), ("gae", "gae"), ("G-A-E", "gae"), ("TokenTM", "tokentm"),
    ("tokentm_residual", "tokentm_residual"), ("TokenTM_Residual", "tokentm_residual"),
    ("RawAttention", "raw_attention"), ("raw-attention", "raw_attention"),
    ("AttnGradCAM", "attn_gradcam"), ("FullGradPlus", "fullgrad_plus"),
    ("RandomMap", "random"), ("random", "random"), ("TIS", "tis"),
    ("SkipPLUS(DecompX)", "skipplus:decompx"), ("skipplus:DecompX", "skipplus:decompx"),
    ("PLUS(IxG)", "plus:ixg"), ("plus:token_ixg", "plus:token_ixg"),
    ("captum:IntegratedGradients", "captum:IntegratedGradients"),
    ("SkipPLUS(captum:Saliency)", "skipplus:captum:Saliency"),
])
def test_every_spelling_resolves_to_one_canonical_name(spelling, canonical):
    assert canonical_name(spelling) == canonical


def test_class_name_and_snake_case_build_the_same_method():
    model, x = make_model("vit"), make_inputs("vit", batch=2)
    for a, b in (("GAE", "gae"), ("SkipPLUS(DecompX)", "skipplus:decompx")):
        ma, mb = build_method(a, model), build_method(b, model)
        assert type(ma) is type(mb)
        torch.testing.assert_close(ma.attribute(x, target=[0, 1]), mb.attribute(x, target=[0, 1]))
    assert isinstance(build_method("gae", model), GAE)
    assert isinstance(build_method("tis", model), TIS)
    assert isinstance(build_method("skipplus:decompx", model), SkipPLUS)
    assert isinstance(build_method("captum:IntegratedGradients", model), IntegratedGradients)
    assert build_method("tokentm_residual", model).variant == "residual"
    assert isinstance(build_method("decompx", model), DecompX)
    assert isinstance(build_method("TokenTM", model), TokenTM)


def test_random_is_registered_and_seeded():
    model, x = make_model("vit"), make_inputs("vit", batch=2)
    rnd = build_method("random", model, seed=3)
    assert isinstance(rnd, RandomMap)
    same = method_factory("RandomMap", seed=3)(model)
    torch.testing.assert_close(rnd.attribute(x), same.attribute(x), rtol=0, atol=0)
    other = build_method("random", model, seed=4).attribute(x)
    assert not torch.equal(rnd.attribute(x), other)


def test_parse_methods_expands_all_and_keeps_order():
    assert parse_methods(["GAE,skipplus:DecompX", "random", "gae"]) == [
        "gae", "skipplus:decompx", "random"]
    assert parse_methods("SkipPLUS(DecompX),rollout") == ["skipplus:decompx", "rollout"]
    every = parse_methods(["all"])  # the registered methods and the featured compositions
    assert every == [*available_methods(baselines=False), *FEATURED_COMPOSITIONS, "random"]
    assert {"plus:decompx", "skipplus:decompx", "random"} <= set(every)
    assert set(every) < set(available_methods(compositions=True))  # + representative ones
    assert every[-1] == "random"  # the chance level closes the table
    assert "random" not in parse_methods("all", for_explain=True)


@pytest.mark.parametrize("bad", ["gea", "plus:", "captum:NoSuchThing", "foo:gae", ""])
def test_unknown_names_are_refused_with_the_known_ones(bad):
    with pytest.raises(ValueError, match="unknown|no method"):
        parse_methods([bad])


def test_factory_checks_the_name_at_once():
    with pytest.raises(ValueError, match="unknown method 'gea'.*gae"):
        method_factory("gea")
    with pytest.raises(TypeError, match="str"):
        canonical_name(3)


def test_names_are_unique_under_normalisation():
    keys = [e.name.replace("_", "") for e in METHODS]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize(("value", "kwargs", "error", "match"), [
    (True, dict(target_type=int), TypeError, "n must be an int, got bool"),
    (1.5, dict(target_type=int), TypeError, "n must be an int, got float"),
    ("3", dict(target_type=(int, float)), TypeError, "n must be an int or a float"),
    (0, dict(target_type=int, min_val=1), ValueError, "n must be >= 1, got 0"),
    (1.0, dict(target_type=float, min_val=0, max_val=1, include_boundaries="left"),
     ValueError, r"n must be in \[0, 1\), got 1.0"),
])
def test_check_scalar_messages(value, kwargs, error, match):
    with pytest.raises(error, match=match):
        check_scalar(value, "n", **kwargs)


def test_check_scalar_accepts_numpy_and_ints_for_floats():
    import numpy as np

    assert check_scalar(np.int64(4), "n", int, min_val=1) == 4
    assert type(check_scalar(np.int64(4), "n", int)) is int
    assert check_scalar(2, "r", float, max_val=2) == 2


def test_quick_options_live_in_the_registry():
    assert quick_options("TIS") == quick_options("tis") == {"n_masks": 128}
    assert quick_options("gae") == {} and quick_options("skipplus:decompx") == {}


def test_a_new_method_is_its_class_and_one_decorator():
    """A method registered with ``@register_method`` beside its class (here a throw-away
    one defined in the test) is in ``available_methods()``, the CLI's name parser, the
    compositions and the contract suite's parameters, and passes the contract; no other
    list names it. It is removed afterwards."""
    from captum.log import log_usage

    from captum_vit._base import ViTGradientAttribution
    from captum_vit.registry import register_method, unregister_method
    from tests.contract import test_contract

    @register_method("throwaway_norm", kind="gradient", quick={"scale": 2.0},
                     variants={"throwaway_norm_half": {"scale": 0.5}})
    class ThrowawayNorm(ViTGradientAttribution):
        """The norm of every embedded token times ``scale`` (a test method)."""

        def __init__(self, model, scale: float = 1.0) -> None:
            super().__init__(model)
            self.scale = scale

        @log_usage()
        def attribute(self, inputs, target=None, *, scale: float | None = None,
                      output: str = "pixels"):
            return self._attribute(inputs, target, output, scale=scale)

        def _token_maps(self, inputs, target, *, scale=None, **_):
            return self.adapter.embed(inputs).norm(dim=-1) * (scale or self.scale)

    try:
        assert {"throwaway_norm", "throwaway_norm_half"} <= set(available_methods())
        assert available_methods()[-1] == "random"  # baselines still close the table
        assert parse_methods("ThrowawayNorm,Throwaway-Norm-Half", compose="skipplus") == [
            "throwaway_norm", "skipplus:throwaway_norm", "throwaway_norm_half",
            "skipplus:throwaway_norm_half"]
        assert "throwaway_norm" in parse_methods("all")
        assert quick_options("skipplus:throwaway_norm") == {"scale": 2.0}
        model, x = make_model("vit"), make_inputs("vit", batch=2)
        assert build_method("throwaway_norm_half", model).scale == 0.5
        assert "throwaway_norm" in test_contract.contract_methods()
        cases = [p.values for p in test_contract.contract_cases()]
        assert ("throwaway_norm", "vit") in cases and ("skipplus:throwaway_norm", "vit") \
            not in cases  # compositions: the representative ones only
        test_contract.test_outputs_batch_and_targets("throwaway_norm", "vit")
        plus = build_method("plus:throwaway_norm", model)
        assert plus.attribute(x, target=[0, 1], output="tokens").shape == (2, 16)
        with pytest.raises(ValueError, match="taken by ThrowawayNorm"):
            register_method("throwaway-norm", kind="gradient")(GAE)
    finally:
        removed = unregister_method("throwaway_norm")
    assert [e.name for e in removed] == ["throwaway_norm", "throwaway_norm_half"]
    assert "throwaway_norm" not in available_methods()
    with pytest.raises(ValueError, match="unknown method"):
        canonical_name("throwaway_norm")


def test_a_method_registers_its_kind_not_a_family():
    """A method's class of computation is its *kind* (``register_method(kind=...)``,
    ``MethodEntry.kind``, :func:`method_kind`, ``KINDS``); "family" means a model family
    only, so the registry has no ``family`` keyword, field or function."""
    import dataclasses

    import captum_vit.registry as registry

    assert {f.name for f in dataclasses.fields(registry.MethodEntry)} >= {"kind"}
    assert "family" not in {f.name for f in dataclasses.fields(registry.MethodEntry)}
    assert registry.method_kind("GAE") == "gradient_attention"
    assert registry.method_kind("rise") in registry.KINDS
    assert not hasattr(registry, "method_family") and not hasattr(registry, "FAMILIES")
    assert {"KINDS", "method_kind"} <= set(registry.__all__)
    with pytest.raises(TypeError, match="family"):
        registry.register_method("never_registered", family="gradient")  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="kind must be one of"):
        registry.register_method("never_registered", kind="nope")(type("X", (), {}))
    assert "never_registered" not in available_methods()


@pytest.mark.timm_windows  # a timm Swin / SAM: timm >= 1.0.31
def test_the_windowed_refusal_is_derived_from_each_methods_declaration():
    """A windowed model (Swin) refuses a method whose class declares ``removes_tokens``;
    the registry lists the refused and running methods from those declarations
    (``windowed_methods``) and the message names every registered method that runs, a
    method registered later included; no hand-kept list."""
    from captum.log import log_usage

    from captum_vit._base import ViTFront, ViTGradientAttribution
    from captum_vit.registry import register_method, unregister_method, windowed_methods
    from tests.helpers import WINDOW_REFUSERS, assert_unchanged, make_swin_model, snapshot

    assert not hasattr(ViTFront, "windowed")  # the flag no method set
    assert windowed_methods(refused=True) == ["tis"] == sorted(WINDOW_REFUSERS)
    assert TIS.removes_tokens and not GAE.removes_tokens
    assert set(windowed_methods()) | {"tis"} == set(available_methods())

    class _Norm(ViTGradientAttribution):
        @log_usage()
        def attribute(self, inputs, target=None, *, output: str = "pixels"):
            return self._attribute(inputs, target, output)

        def _token_maps(self, inputs, target, **_):
            return self.adapter.embed(inputs).norm(dim=-1)

    @register_method("throwaway_keeper", kind="gradient")
    class ThrowawayKeeper(_Norm):
        """Keeps every token: runs on windowed models."""

    @register_method("throwaway_remover", kind="perturbation")
    class ThrowawayRemover(_Norm):
        """Declares token removal: refused by windowed models."""

        removes_tokens = True

    model = make_swin_model("timm_swin")
    before = snapshot(model)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    try:
        assert windowed_methods(refused=True) == ["tis", "throwaway_remover"]
        assert "throwaway_keeper" in windowed_methods()
        assert build_method("throwaway_keeper", model).attribute(x, output="tokens").shape[0] == 2
        with pytest.raises(ValueError, match="within windows") as e:
            build_method("throwaway_remover", model).attribute(x, target=[0, 1])
        text = str(e.value)
        assert text.startswith("ThrowawayRemover removes tokens")
        assert "(RISE or ViTCX mask pixels)" in text  # the perturbations that keep tokens
        ran = text.split("on windowed models run ")[1].split(", ")
        assert "ThrowawayKeeper" in ran and "Rollout" in ran and "DecompX" in ran
        assert "TIS" not in ran and "ThrowawayRemover" not in ran and "RandomMap" not in ran
        with pytest.raises(ValueError, match="TIS removes tokens.*within windows"):
            TIS(model).attribute(x, target=[0, 1], n_masks=8)
        with pytest.warns(UserWarning, match="once per included block"):
            plus = build_method("plus:tis", model)
        with pytest.raises(ValueError, match="PLUS removes tokens"):
            plus.attribute(x, target=[0, 1], n_masks=8)
    finally:
        unregister_method("throwaway_keeper")
        unregister_method("throwaway_remover")
    assert windowed_methods(refused=True) == ["tis"]
    assert_unchanged(model, before)
