"""``per_token_maps`` of a method whose engine is one trace and one backward
(``ViTFront.traces_read_gradients``: token IxG, AttIxG, AttCAT, DecompX's gradient route,
AttnLRP, CP-LRP): the ``K`` answer tokens' maps come from ONE trace of the tower and ``K``
backward passes (``ViTFront._read_gradient_maps``, ``_token_maps_each``).

Tiny random float64 models of the family tests: LLaVA (one read block), InternVL (tiles as
rows) and Idefics3 (tiles marked in the prompt). The reference is the path before: one
``attribute`` call per token on the linear score ``⟨x, g^{(t)}⟩`` (the same method with
``traces_read_gradients = False``), each its own tower forward and backward."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from captum_vit import CPLRP, AttIxG, AttnLRP, DecompX, TokenIxG
from captum_vit._base import _BlockGradient, prepare, read_state_gradients
from captum_vit.registry import build_method
from captum_vit.targets import VLMAnswer
from captum_vit.targets.vlm import per_token_maps
from tests.families import test_hf_idefics3 as idefics3
from tests.families import test_hf_internvl as internvl
from tests.helpers import assert_close_scaled, assert_unchanged, needs_transformers, snapshot

pytestmark = needs_transformers
ANSWER = torch.tensor([11, 12, 13])
K = len(ANSWER)
ONE_TRACE = ["token_ixg", "att_ixg", "attcat", "decompx", "attnlrp", "cp_lrp"]
FAMILIES = ["llava", "internvl", "idefics3"]


def case(family: str, *, per_token: bool = True
         ) -> tuple[nn.Module, torch.Tensor, VLMAnswer, dict]:
    """``(model, inputs, target, batch)`` with the language model's RMSNorms in float64
    (exact sums over the tokens): LLaVA on 2 images (one prompt), InternVL on one prompt of
    2 tiles, Idefics3 on a processor's batch of 2 prompts (5 + 3 tiles)."""
    if family == "llava":
        model = internvl.exact_language_model(copy.deepcopy(internvl.llava()))
        prompt = torch.tensor([1, *[internvl.IMAGE] * 16, 5, 7])
        return (model, internvl.images(),
                VLMAnswer(model, prompt, ANSWER, per_token=per_token), {"prompt": prompt})
    if family == "internvl":
        model = internvl.exact_language_model(copy.deepcopy(internvl.internvl()))
        prompt = internvl.prompt(5, 7)
        return (model, internvl.images(),
                VLMAnswer(model, prompt, ANSWER, per_token=per_token), {"prompt": prompt})
    model = internvl.exact_language_model(copy.deepcopy(idefics3.model_of()))
    batch = idefics3.processed()
    target = VLMAnswer(model, batch, ANSWER, per_token=per_token)
    return model, target.images(), target, {"prompt": batch}


def loop(method):
    """``method`` taking the path before: one ``attribute`` call per token."""
    slow = copy.copy(method)
    slow.traces_read_gradients = False
    return slow


@contextmanager
def tower_passes(method) -> Iterator[dict[str, int]]:
    """Counts the tower's forwards (embeddings of the images) and traces (forwards kept for
    a backward) of ``method``'s adapter."""
    ad = method.adapter
    counts = {"embed": 0, "trace": 0}
    embed, trace = ad.embed, ad.trace

    def counting_embed(*args, **kwargs):
        counts["embed"] += 1
        return embed(*args, **kwargs)

    def counting_trace(*args, **kwargs):
        counts["trace"] += 1
        return trace(*args, **kwargs)

    ad.embed, ad.trace = counting_embed, counting_trace
    try:
        yield counts
    finally:
        del ad.embed, ad.trace


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", ONE_TRACE)
def test_token_maps_from_one_trace_equal_a_call_per_token(name, family):
    """The ``K`` maps from one trace equal one ``attribute`` call per token (≤ 1e-10), sum
    to the whole answer's map, and cost ONE tower trace (the loop: ``K``); the model is
    unchanged."""
    model, x, target, kw = case(family)
    before = snapshot(model)
    method = build_method(name, VLMAnswer.tower(model))
    assert method.traces_read_gradients
    method.adapter.self_check(x)  # the adapter's one check per input size, before counting
    with tower_passes(method) as fast:
        maps = per_token_maps(method, x, target, output="tokens")
    with tower_passes(method) as slow:
        want = per_token_maps(loop(method), x, target, output="tokens")
    assert maps.shape == want.shape == (x.shape[0], K, want.shape[-1])
    assert (maps.flatten(2).std(2) > 0).any()
    assert_close_scaled(maps, want, rel=1e-10)
    whole = method.attribute(x, target=VLMAnswer(model, kw["prompt"], ANSWER),
                             output="tokens")
    assert_close_scaled(maps.sum(1), whole, rel=1e-10)
    assert fast["trace"] == 1 and slow["trace"] == K
    # the read states' forward (none where the target holds them: tiles) and one trace
    assert fast["embed"] == (1 if family == "llava" else 0) + 1
    assert slow["embed"] == fast["embed"] + K - 1
    assert_unchanged(model, before)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("output", ["tokens", "grid", "pixels"])
def test_output_formats_equal_the_loops(family, output):
    """Every ``output`` of the one-trace path equals the loop's (token IxG; AttnLRP at the
    pixels, whose rules run through the embedding)."""
    model, x, target, _ = case(family)
    tower = VLMAnswer.tower(model)
    for method in (build_method("token_ixg", tower), AttnLRP(tower, at="pixels")):
        maps = per_token_maps(method, x, target, output=output)
        want = per_token_maps(loop(method), x, target, output=output)
        assert maps.shape == want.shape and maps.shape[:2] == (x.shape[0], K)
        assert_close_scaled(maps, want, rel=1e-10)
    with tower_passes(method) as counts:
        per_token_maps(method, x, target, output=output)
    assert counts["trace"] == 1


def test_tuple_inputs_and_options_pass_through():
    """Captum's 1-tuple inputs come back as the loop's; ``layer`` and ``at`` options of
    the method are kept (token IxG at block 1, AttIxG at block 1, CP-LRP at the
    pixels)."""
    model, x, target, _ = case("llava")
    tower = VLMAnswer.tower(model)
    for method in (TokenIxG(tower, layer=1), AttIxG(tower, layer=1), CPLRP(tower, at="pixels")):
        rows, grads = _grads(method, x, target)
        got = method._read_gradient_maps((x,), rows, grads)
        want = loop(method)._read_gradient_maps((x,), rows, grads)
        assert len(got) == len(want) == K
        for g, w in zip(got, want, strict=True):
            assert isinstance(g, tuple) and len(g) == 1
            assert_close_scaled(g[0], w[0], rel=1e-10)


def test_per_token_maps_of_tuple_inputs():
    """``per_token_maps`` of 1-tuple inputs returns a 1-tuple of the stacked maps (the
    loop and the one-trace path alike), equal to the tensor inputs' maps."""
    model, x, target, _ = case("llava")
    tower = VLMAnswer.tower(model)
    for method in (TokenIxG(tower), loop(TokenIxG(tower)), build_method("gae", tower)):
        got = per_token_maps(method, (x,), target)
        assert isinstance(got, tuple) and len(got) == 1
        assert_close_scaled(got[0], per_token_maps(method, x, target), rel=1e-10)


def _grads(method, x, target):
    p = prepare(method.adapter, x, target)
    resolved = p.embedding
    keys, grads = read_state_gradients(method.adapter, p, resolved,
                                       [resolved.token(t).index(x.shape[0]) for t in range(K)])
    return resolved.rows, [dict(zip(keys, g, strict=True)) for g in grads]


@pytest.mark.parametrize("name", ["gae", "decompx_explicit"])
def test_other_methods_keep_a_call_per_token(name):
    """A method without a one-backward engine (GAE's matrix chain, DecompX's explicit
    route) still runs the tower once per token."""
    model, x, target, _ = case("internvl")
    tower = VLMAnswer.tower(model)
    method = (build_method(name, tower) if name == "gae"
              else DecompX(tower, route="explicit"))
    assert not method.traces_read_gradients
    with tower_passes(method) as counts:
        per_token_maps(method, x, target, output="tokens")
    assert counts["embed"] >= K


def test_stacked_scores_need_the_engine():
    """The stacked scores (one trace, ``K`` backwards) are refused by name by a method
    whose engine does not serve them (GAE's matrix chain)."""
    model, x, target, _ = case("llava")
    method = build_method("token_ixg", VLMAnswer.tower(model))
    rows, grads = _grads(method, x, target)
    stacked = _BlockGradient({l: torch.cat([g[l] for g in grads]) for l in grads[0]}, rows,
                             tokens=K)
    with pytest.raises(ValueError, match="once per token"):
        build_method("gae", VLMAnswer.tower(model)).attribute(x, target=stacked)
