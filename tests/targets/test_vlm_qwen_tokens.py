"""``per_token_maps`` on Qwen2-VL, Qwen2.5-VL and Qwen3-VL (packed pixels, ``image_grid_thw``)
takes the route of the other VLMs: the language model ONCE for all ``K`` answer tokens (each
row under its own column only, ``QwenVLParts.own_columns``), then for a method whose engine
is one trace and one backward (token IxG, AttnLRP) ONE tower trace and ``K`` backward passes;
any other method linear in the read gradient (GAE) one tower pass per token, the language
model not rerun. A processor's output is split per grid as ``attribute`` splits it (one
language-model run per grid).

Tiny random float64 models of the family tests, their language model's RMSNorms and the
tower's vision RoPE made exact (``exact``, ``exact_tower``): the float32 rounding the model
does there would round the gradients too. The reference is the loop over the tokens, one
``attribute`` call per token (each its own run of the whole VLM)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from captum_vit._base import _Capture, prepare
from captum_vit.adapters.scoring import Target
from captum_vit.registry import build_method
from captum_vit.targets import VLMAnswer
from captum_vit.targets.vlm import per_token_maps
from tests.families import test_hf_qwen_vl as qwen
from tests.helpers import assert_close_scaled, assert_unchanged, snapshot
from tests.targets.test_vlm_trace_once import tower_passes

transformers = pytest.importorskip("transformers")

ANSWER = torch.tensor([[11, 12, 13], [21, 22, 23]])
K = ANSWER.shape[1]
LINEAR_IN_SCORE = ("token_ixg", "attnlrp")


@contextmanager
def lm_forwards(model) -> Iterator[list[int]]:
    """The batch size of every forward of ``model``'s language model."""
    sizes: list[int] = []
    hook = model.model.language_model.register_forward_pre_hook(
        lambda m, args, kwargs: sizes.append(int(kwargs["inputs_embeds"].shape[0])),
        with_kwargs=True)
    try:
        yield sizes
    finally:
        hook.remove()


def processed(x: torch.Tensor) -> dict:
    """A processor's output of two prompts (the second padded on the left), one image
    each, one grid."""
    rows, thw = qwen.patchify(x)
    long, short = qwen.prompt(5, 7, 8), qwen.prompt(9, 4)
    ids = torch.stack([long, torch.cat([torch.zeros(1, dtype=torch.long), short])])
    mask = torch.ones_like(ids)
    mask[1, 0] = 0
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": rows,
            "image_grid_thw": thw}


def method_of(name: str, model, x: torch.Tensor):
    return qwen.exact_tower(build_method(name, VLMAnswer.tower(model)), x)


def loop(method, inputs, target: VLMAnswer, **kwargs):
    """The reference: one ``attribute`` call per token, stacked on dim 1."""
    maps = [method.attribute(inputs, target=target.token(t), **kwargs) for t in range(K)]
    if isinstance(maps[0], list):
        return [torch.stack(each, 1) for each in zip(*maps, strict=True)]
    return torch.stack(maps, 1)


@pytest.mark.parametrize("name", [*LINEAR_IN_SCORE, "gae"])
@pytest.mark.parametrize("cls_name", qwen.VLMS)
def test_token_maps_of_a_processors_output_equal_the_attribute_loop(cls_name, name):
    """A processor's output (two prompts, one grid): the token maps equal one ``attribute``
    call per token (≤ 1e-10) from ONE language-model run of the 2 rows' own columns (the
    loop: one run per token, each scoring both rows under both columns), one tower trace
    for token IxG and AttnLRP (GAE: one pass per token and read block, the language model
    not rerun); for a method linear in the score they sum to the whole answer's map; the
    model unchanged. GAE's chain of clamped products turns the ~1e-15 relative difference
    between the gradients of a 2- and a 4-sequence language-model batch into ~1e-9 here:
    it is compared at 1e-10 on a batch repeating one question (one column, the same
    sequences both ways) and at 1e-8 on the two prompts."""
    model = qwen.exact(cls_name)
    x = qwen.images()
    batch = processed(x)
    method = method_of(name, model, x)
    before = snapshot(model)
    target = VLMAnswer(model, batch, ANSWER, per_token=True)
    assert target.prompts == 2
    with lm_forwards(model) as fast, tower_passes(method) as passes:
        maps = per_token_maps(method, batch, target, output="grid")
    with lm_forwards(model) as slow:
        want = loop(method, batch, target, output="grid")
    assert maps.shape == want.shape == (2, K, *want.shape[2:])
    assert (maps.flatten(2).std(2) > 0).all()
    assert_close_scaled(maps, want, rel=1e-10 if name in LINEAR_IN_SCORE else 1e-8)
    blocks = len(target.blocks or (None,))
    # own columns: n sequences, not n·k (the loop too: two prompts make the answer a
    # costly target, explained through its read gradients, one run per token)
    assert fast == [2] and slow == [2] * K
    if cls_name.startswith("Qwen3"):
        assert blocks == 2  # deepstack: the stacked gradients carry both read blocks
    if name in LINEAR_IN_SCORE:
        assert passes["trace"] == 1
        whole = method.attribute(batch, target=VLMAnswer(model, batch, ANSWER), output="grid")
        assert_close_scaled(maps.sum(1), whole, rel=1e-10)
    else:
        assert passes["trace"] == K * blocks
        one = dict(batch, input_ids=batch["input_ids"][:1].expand(2, -1),
                   attention_mask=torch.ones_like(batch["input_ids"]))
        target = VLMAnswer(model, one, ANSWER[0], per_token=True)
        with lm_forwards(model) as fast:
            maps = per_token_maps(method, one, target, output="grid")
        assert fast == [2]
        assert_close_scaled(maps, loop(method, one, target, output="grid"), rel=1e-10)
    assert_unchanged(model, before)


@pytest.mark.parametrize("cls_name", qwen.VLMS)
def test_token_maps_of_images(cls_name):
    """Images ``[B, C, H, W]`` with one prompt: the same route (one language-model run, one
    trace), equal to the loop, every output format."""
    model = qwen.exact(cls_name)
    x = qwen.images()
    method = method_of("token_ixg", model, x)
    target = VLMAnswer(model, qwen.prompt(5, 7), ANSWER[0], per_token=True)
    for output in ("tokens", "pixels"):
        with lm_forwards(model) as fast, tower_passes(method) as passes:
            maps = per_token_maps(method, x, target, output=output)
        assert fast == [2] and passes["trace"] == 1
        assert_close_scaled(maps, loop(method, x, target, output=output), rel=1e-10)


def test_images_of_several_sizes(monkeypatch):
    """A processor's batch of two grids (prompt 0 holds images A and B of two sizes,
    prompt 1 image C): one map per image on its own grid (``[1, K, ...]`` each), equal to
    the loop (≤ 1e-10), summing to the whole answer's maps; one language-model run and one
    trace PER GRID (not per token); ``output="tokens"`` and ``"inputs"`` as the loop's."""
    from transformers.models.qwen2_vl import modeling_qwen2_vl

    model = qwen.exact("Qwen2VLForConditionalGeneration")
    monkeypatch.setattr(modeling_qwen2_vl, "apply_rotary_pos_emb_vision",
                        qwen._rope_vision_exact)  # the fixed image B's features: exact too
    batch, (a, b, c), answer = qwen.mixed_batch()
    method = qwen.exact_tower(build_method("token_ixg", VLMAnswer.tower(model)))
    before = snapshot(model)
    answer = torch.cat([answer, torch.tensor([[13], [23]])], 1)
    target = VLMAnswer(model, batch, answer, per_token=True)
    with lm_forwards(model) as fast, tower_passes(method) as passes:
        maps = per_token_maps(method, batch, target)
    want = loop(method, batch, target)
    assert isinstance(maps, list) and [m.shape for m in maps] == [
        (1, K, *a.shape[1:]), (1, K, *b.shape[1:]), (1, K, *c.shape[1:])]
    assert_close_scaled(maps, want, rel=1e-10)
    assert sorted(fast) == [1, 2] and passes["trace"] == 2  # grid (4, 6): A and C; (4, 4): B
    whole = method.attribute(batch, target=VLMAnswer(model, batch, answer))
    for m, w in zip(maps, whole, strict=True):
        assert_close_scaled(m.sum(1), w, rel=1e-10)
    for output in ("tokens", "inputs"):
        got = per_token_maps(method, batch, target, output=output)
        assert_close_scaled(got, loop(method, batch, target, output=output), rel=1e-10)
    assert got.shape == (*batch["pixel_values"].shape[:1], K, batch["pixel_values"].shape[1])
    # a method not linear in the read gradient keeps a call per token: a list per image too
    chefer = build_method("chefer21", VLMAnswer.tower(model))
    with lm_forwards(model) as runs:
        maps = per_token_maps(chefer, batch, target)
    assert [m.shape for m in maps] == [(1, K, *a.shape[1:]), (1, K, *b.shape[1:]),
                                       (1, K, *c.shape[1:])]
    assert len(runs) >= 2 * K
    assert_unchanged(model, before)


def test_own_columns_equal_the_columns_gradients():
    """The read gradients of each row's own column (``own_columns``: one sequence per row)
    equal the generic ones from every column (``Target.read_gradients``: ``n·k``
    sequences), whole answer and each token, on a prompt holding two images."""
    model = qwen.exact("Qwen3VLForConditionalGeneration")
    x = qwen.images(2)
    rows, thw = qwen.patchify(x)
    ids = torch.cat([qwen.prompt(5), torch.tensor([qwen.START, *[qwen.IMAGE] * 6,
                                                   qwen.END, 9])])[None]
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": rows,
             "image_grid_thw": thw}
    target = VLMAnswer(model, batch, ANSWER[0], per_token=True)
    assert target.prompts == 2  # a column per image, the other image fixed
    method = method_of("token_ixg", model, x)
    p = prepare(method.adapter, x, target)
    ad, capture = method.adapter, _Capture(p.embedding)
    with torch.no_grad(), ad.targeting(capture, grid=p.layout.grid):
        ad.run(ad.embed(x))
    out = capture.out
    indices = [target.index(2), *(target.token(t).index(2) for t in range(K))]

    def grads(read):
        leaves = [out.hidden[l].detach().requires_grad_() for l in target.blocks]
        state = dataclasses.replace(out, hidden=dict(zip(target.blocks, leaves, strict=True)))
        with torch.enable_grad():
            return read(state, leaves, indices)

    with lm_forwards(model) as own_runs:
        own = grads(target.read_gradients)
    with lm_forwards(model) as all_runs:
        every = grads(lambda *a: Target.read_gradients(target, *a))
    assert own_runs == [2] and all_runs == [4]
    assert_close_scaled(own, every, rel=1e-10)
    assert_close_scaled([sum(g[i] for g in own[1:]) for i in range(2)], own[0], rel=1e-10)
