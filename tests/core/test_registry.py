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

    @register_method("throwaway_norm", family="gradient", quick={"scale": 2.0},
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
            register_method("throwaway-norm", family="gradient")(GAE)
    finally:
        removed = unregister_method("throwaway_norm")
    assert [e.name for e in removed] == ["throwaway_norm", "throwaway_norm_half"]
    assert "throwaway_norm" not in available_methods()
    with pytest.raises(ValueError, match="unknown method"):
        canonical_name("throwaway_norm")
