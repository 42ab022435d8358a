"""A VLM's answer explained through its gradient at the tower states it reads
(``ViTFront.linear_in_read_gradient``, ``Target.linearises``, ``Target.read_gradients``):
the language model runs once per call (tiles: once per prompt, not ``N²`` sequences) and
once for all answer tokens of ``per_token_maps``, with the maps of the columns' path.

Tiny random float64 models of the family tests: LLaVA (one read block), InternVL (tiles as
rows, the last block's output) and Idefics3 (tiles marked in the prompt, the final-normed
tokens). The reference of every fast path is the same target with ``linearises = False``
(the methods then evaluate the target's columns inside their own passes, as before)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from captum_vit._base import ViTFront
from captum_vit.registry import available_methods, build_method
from captum_vit.targets import VLMAnswer
from captum_vit.targets.vlm import per_token_maps
from tests.families import test_hf_idefics3 as idefics3
from tests.families import test_hf_internvl as internvl
from tests.helpers import (
    TokenNames,
    assert_close_scaled,
    assert_unchanged,
    needs_transformers,
    snapshot,
)

pytestmark = needs_transformers
ANSWER = torch.tensor([11, 12, 13])
LINEAR = [n for n in available_methods(baselines=False)
          if getattr(build_method(n, VLMAnswer.tower(internvl.internvl())),
                     "linear_in_read_gradient", False)]
"""The registered methods that declare it (by their tag, not by name)."""
PER_TOKEN = ["token_ixg", "decompx", "attnlrp", "cp_lrp", "gae", "tokentm"]


def case(family: str, per_token: bool = False) -> tuple[nn.Module, torch.Tensor, VLMAnswer]:
    """``(model, inputs, target)``: LLaVA on 2 images (one prompt), InternVL on one prompt
    of 2 tiles, Idefics3 on a processor's batch of 2 prompts (5 + 3 tiles)."""
    if family == "llava":
        model = internvl.llava()
        ids = torch.tensor([1, *[internvl.IMAGE] * 16, 5, 7])
        return model, internvl.images(), VLMAnswer(model, ids, ANSWER, per_token=per_token)
    if family == "internvl":
        model = internvl.internvl()
        return model, internvl.images(), VLMAnswer(model, internvl.prompt(5, 7), ANSWER,
                                                   per_token=per_token)
    model = idefics3.model_of()
    target = VLMAnswer(model, idefics3.processed(), ANSWER, per_token=per_token)
    return model, target.images(), target


def columns_path(target: VLMAnswer) -> VLMAnswer:
    """``target`` explained through its columns (the path before this change)."""
    slow = copy.copy(target)
    slow.linearises = False
    return slow


class LanguageModelRuns:
    """Counts the language model's forward calls and the sequences they hold."""

    def __init__(self, model: nn.Module) -> None:
        self.calls: list[int] = []
        self.module = model.get_decoder()

    def __enter__(self) -> LanguageModelRuns:
        def hook(_m, args, kwargs):
            x = kwargs.get("inputs_embeds")
            x = x if x is not None else kwargs.get("input_ids", args[0] if args else None)
            self.calls.append(int(x.shape[0]))
        self.handle = self.module.register_forward_pre_hook(hook, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()

    @property
    def sequences(self) -> int:
        return sum(self.calls)


def test_the_tag_is_declared_by_gradient_methods_only():
    """Every method that declares it is a gradient method of the front; the perturbation
    methods and those that read the score's value or a path do not."""
    assert {"token_ixg", "decompx", "attnlrp", "cp_lrp", "gae", "tokentm", "attcat",
            "vanilla_grad", "gradcam"} <= set(LINEAR)
    assert not {"rise", "vit_cx", "tis", "scorecam", "bt_h", "bt_t", "tam", "legrad",
                "chefer21", "rollout"} & set(LINEAR)
    tower = VLMAnswer.tower(internvl.internvl())
    for name in LINEAR:
        assert isinstance(build_method(name, tower), ViTFront)


@pytest.mark.parametrize("family", ["internvl", "idefics3"])
def test_tiles_every_declaring_method_equals_the_columns_path(family):
    """On tiles, every declaring method's map from one language-model run per prompt
    equals its map through the ``N²`` columns (float64)."""
    model, x, target = case(family)
    before = snapshot(model)
    tower = VLMAnswer.tower(model)
    assert target.linearises
    for name in LINEAR:
        method = build_method(name, tower)
        fast = method.attribute(x, target=target, output="tokens")
        slow = method.attribute(x, target=columns_path(target), output="tokens")
        assert torch.isfinite(fast).all() and fast.flatten(1).std(1).gt(0).any(), name
        assert_close_scaled(fast, slow, rel=1e-10)
    assert_unchanged(model, before)


@pytest.mark.parametrize("family", ["llava", "internvl", "idefics3"])
@pytest.mark.parametrize("name", PER_TOKEN)
def test_per_token_maps_equal_one_call_per_token(name, family):
    """``per_token_maps`` of a declaring method (one language-model run) equals the maps of
    one ``attribute`` call per token through the columns."""
    model, x, target = case(family, per_token=True)
    method = build_method(name, VLMAnswer.tower(model))
    maps = per_token_maps(method, x, target, output="tokens")
    slow = columns_path(target)
    want = torch.stack([method.attribute(x, target=slow.token(t), output="tokens")
                        for t in range(3)], 1)
    assert maps.shape == want.shape == (x.shape[0], 3, *want.shape[2:])
    assert_close_scaled(maps, want, rel=1e-10)


@pytest.mark.parametrize("name", ["token_ixg", "decompx", "attnlrp", "cp_lrp"])
def test_tile_marking_token_maps_sum_to_the_answers_map(name):
    """``per_token=True`` on Idefics3's tiles: the token maps of a method linear in the
    score add up to the whole answer's map, the default column (the language model's
    RMSNorms in float64, as in the InternVL test)."""
    model = internvl.exact_language_model(copy.deepcopy(idefics3.model_of()))
    batch = idefics3.processed()
    target = VLMAnswer(model, batch, ANSWER, per_token=True, tokenizer=TokenNames())
    assert target.labels == [["<11>", "<12>", "<13>"]] * 2
    method = build_method(name, VLMAnswer.tower(model))
    x = target.images()
    maps = per_token_maps(method, x, target, output="tokens")
    whole = method.attribute(x, target=VLMAnswer(model, batch, ANSWER), output="tokens")
    assert (maps.flatten(2).std(2) > 0).all()
    assert_close_scaled(maps.sum(1), whole, rel=1e-10)
    assert_close_scaled(method.attribute(x, target=target, output="tokens"), whole, rel=1e-10)


def test_tile_marking_token_columns_are_the_models_token_log_probabilities():
    """Idefics3 with ``per_token=True``: columns are tiles × (1 + A); a tile's own token
    columns are the model's own log-probabilities of the answer tokens (its 5-D forward)."""
    model = idefics3.model_of()
    batch = idefics3.processed()
    target = VLMAnswer(model, batch, ANSWER, per_token=True)
    x = target.images()
    from captum_vit.adapters import adapt

    ad = adapt(VLMAnswer.tower(model))
    with torch.no_grad(), ad.targeting(target):
        cols = ad.model_logits(x)
    assert cols.shape == (8, 8 * 4)
    for g, row in ((0, 2), (1, 6)):
        seq = torch.cat([batch["input_ids"][g], ANSWER])[None]
        am = torch.cat([batch["attention_mask"][g], torch.ones_like(ANSWER)])[None]
        with torch.no_grad():
            logits = model(input_ids=seq, attention_mask=am,
                           pixel_values=batch["pixel_values"][g:g + 1],
                           pixel_attention_mask=batch["pixel_attention_mask"][g:g + 1],
                           use_cache=False).logits[0, -4:-1]
        want = logits.log_softmax(-1).gather(-1, ANSWER[:, None])[:, 0]
        own = cols[row, row * 4:row * 4 + 4]
        assert_close_scaled(own[1:], want, 1e-10)
        assert_close_scaled(own[0], want.sum(), 1e-10)
    with pytest.raises(ValueError, match="t must be an answer position"):
        target.token(3)


@pytest.mark.parametrize("family, fast, slow", [
    ("llava", 2, 3 * 2),  # 2 images, 1 prompt: one run for the 3 tokens, not 3
    ("internvl", 1, 3 * 2 * 2),  # 1 prompt of 2 tiles: 1 sequence, not 3 × 2²
    ("idefics3", 2, 3 * 8 * 8),  # 2 prompts, 8 tiles: 2 sequences, not 3 × 8²
])
def test_per_token_maps_run_the_language_model_once(family, fast, slow):
    model, x, target = case(family, per_token=True)
    method = build_method("gae", VLMAnswer.tower(model))
    with LanguageModelRuns(model) as runs:
        per_token_maps(method, x, target)
    assert len(runs.calls) == 1 and runs.sequences == fast
    with LanguageModelRuns(model) as runs:
        for t in range(3):
            method.attribute(x, target=columns_path(target).token(t))
    assert len(runs.calls) == 3 and runs.sequences == slow


@pytest.mark.parametrize("family, sequences", [("internvl", 1), ("idefics3", 2)])
def test_tiles_cost_one_sequence_per_prompt(family, sequences):
    """A declaring method on tiles: one language-model run with one sequence per prompt
    (the columns' path: every row in every tile's place, ``N²``)."""
    model, x, target = case(family)
    n = x.shape[0]
    for name in ("vanilla_grad", "gae", "token_ixg"):
        method = build_method(name, VLMAnswer.tower(model))
        with LanguageModelRuns(model) as runs:
            method.attribute(x, target=target)
        assert runs.calls == [sequences], name
        with LanguageModelRuns(model) as runs:
            method.attribute(x, target=columns_path(target))
        assert runs.sequences == n * n, name


@pytest.mark.parametrize("name, options", [
    ("bt_h", {"n_steps": 2, "start_layer": 1}),
    ("rise", {"n_masks": 4, "score": "logit"}),
    ("gae", {"score": "probability"}),  # a probability of the score: its value counts
])
def test_other_methods_keep_the_columns(name, options):
    """A method that does not declare it (or ``score="probability"``) still scores the
    columns (every row in every tile's place) and gives the columns path's map."""
    model, x, target = case("internvl")
    method = build_method(name, VLMAnswer.tower(model))
    torch.manual_seed(0)
    with LanguageModelRuns(model) as runs:
        got = method.attribute(x, target=target, output="tokens", **options)
    assert runs.sequences >= 4 and runs.sequences % 4 == 0  # 2 rows × 2 tile columns
    torch.manual_seed(0)
    want = method.attribute(x, target=columns_path(target), output="tokens", **options)
    assert_close_scaled(got, want, rel=1e-12)
    per_token = case("internvl", per_token=True)[2]
    with LanguageModelRuns(model) as runs:
        torch.manual_seed(0)
        per_token_maps(method, x, per_token, **options)
    assert len(runs.calls) >= 3  # one attribute call per token


def test_distinct_prompts_score_each_image_with_its_own():
    """LLaVA with one prompt per image (``B`` columns, ``B²`` sequences through the
    columns): a declaring method runs ``B`` sequences, with the same maps."""
    model = internvl.llava()
    ids = torch.stack([torch.tensor([1, *[internvl.IMAGE] * 16, 5, 7]),
                       torch.tensor([1, *[internvl.IMAGE] * 16, 6, 8])])
    target = VLMAnswer(model, ids, ANSWER)
    x = internvl.images()
    assert target.linearises
    method = build_method("token_ixg", VLMAnswer.tower(model))
    with LanguageModelRuns(model) as runs:
        fast = method.attribute(x, target=target, output="tokens")
    assert runs.sequences == 2
    with LanguageModelRuns(model) as runs:
        slow = method.attribute(x, target=columns_path(target), output="tokens")
    assert runs.sequences == 4
    assert_close_scaled(fast, slow, rel=1e-10)


def test_other_indices_fall_back_to_the_columns():
    """``read_gradients`` with an index that is not each row's own column (both rows in
    tile 1's place) takes the columns: the gradient of that column, row 0's non-zero."""
    from captum_vit._base import prepare, read_state_gradients
    from captum_vit.adapters import adapt

    model, x, target = case("internvl")
    ad = adapt(VLMAnswer.tower(model))
    p = prepare(ad, x, target)
    resolved = p.embedding
    index = torch.tensor([1, 1])
    assert resolved._own_slots(2, [index]) is None
    assert resolved._own_slots(2, [torch.tensor([0, 1])]) is not None
    _, [got] = read_state_gradients(ad, p, resolved, [index])
    generic = copy.copy(resolved)
    generic._own_slots = lambda *a: None
    _, [want] = read_state_gradients(ad, p, generic, [index])
    assert_close_scaled(got[0], want[0], rel=1e-12)
    assert got[0][0].abs().max() > 0


@pytest.mark.parametrize("family", ["internvl", "idefics3"])
def test_held_clean_states_equal_the_towers_forward(family):
    """With tiles the target holds the clean tiles' states (its construction or resolve);
    the read gradients from them equal those from a forward of the adapter, and other
    images are not taken for the clean tiles."""
    from captum_vit._base import prepare, read_state_gradients
    from captum_vit.adapters import adapt

    model, x, target = case(family)
    ad = adapt(VLMAnswer.tower(model))
    p = prepare(ad, x, target)
    resolved = p.embedding
    held = resolved.read_states(p.images)
    assert held is not None and list(held) == [None]
    assert resolved.read_states(p.images + 1e-3) is None
    keys, [got] = read_state_gradients(ad, p, resolved, [p.target])
    forward = copy.copy(resolved)
    forward.read_states = lambda images: None
    _, [want] = read_state_gradients(ad, p, forward, [p.target])
    assert keys == [None]
    assert got[0].abs().max() > 0
    assert_close_scaled(got[0], want[0], rel=1e-10)


@pytest.mark.parametrize("kind", ["full", "layers"])
def test_onevision_crops_read_blocks_through_the_read_gradient(kind):
    """LLaVA-OneVision (a read block; two blocks concatenated under ``"layers"``): the
    read-gradient maps, whole answer and per token, equal the columns', from one
    sequence per prompt."""
    from tests.families import test_hf_llava_onevision as onevision

    model = onevision.model_of(kind)
    batch = onevision.processed(model)
    target = VLMAnswer(model, batch, ANSWER)
    x = target.images()
    n = x.shape[0]
    assert target.read_states(x) is not None
    for name in ("token_ixg", "gae", "decompx"):
        method = build_method(name, VLMAnswer.tower(model))
        with LanguageModelRuns(model) as runs:
            fast = method.attribute(x, target=target, output="tokens")
        assert runs.sequences == 2, name
        slow = method.attribute(x, target=columns_path(target), output="tokens")
        assert_close_scaled(fast, slow, rel=1e-10)
    tokens = VLMAnswer(model, batch, ANSWER, per_token=True)
    method = build_method("attnlrp", VLMAnswer.tower(model))
    with LanguageModelRuns(model) as runs:
        maps = per_token_maps(method, x, tokens, output="tokens")
    assert runs.calls == [2]
    slow = columns_path(tokens)
    want = torch.stack([method.attribute(x, target=slow.token(t), output="tokens")
                        for t in range(3)], 1)
    assert maps.shape[:2] == (n, 3)
    assert_close_scaled(maps, want, rel=1e-10)
