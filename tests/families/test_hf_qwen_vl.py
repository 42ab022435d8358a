"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: the vision towers' adapter against the models' own packed
forward, processor outputs, and VLMAnswer against the VLMs' own forward (tiny random
configs, float64; ids are given, no tokenizer)."""

from __future__ import annotations

import pytest
import torch

from captum_vit.adapters import adapt
from captum_vit.adapters.families._examples import VLM_IMAGE_ID as IMAGE
from captum_vit.adapters.families.hf_qwen_vl import (
    merge_order,
    qwen_tower_example,
    qwen_vlm_example,
)
from captum_vit.registry import available_methods, build_method
from captum_vit.targets import VLMAnswer
from tests.helpers import assert_close_scaled, assert_token_maps_sum, assert_unchanged, snapshot

transformers = pytest.importorskip("transformers")

START, END = 297, 298  # vision_start, vision_end of the tiny configs
TOWERS = ("Qwen2VisionTransformerPretrainedModel", "Qwen3VLVisionModel",
          "Qwen2_5_VisionTransformerPretrainedModel")
VLMS = ("Qwen2VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration")
_MODELS: dict[str, torch.nn.Module] = {}


def model_of(cls_name: str) -> torch.nn.Module:
    if cls_name not in _MODELS:
        build = qwen_tower_example(cls_name) if cls_name in TOWERS else qwen_vlm_example(cls_name)
        _MODELS[cls_name] = build()
    return _MODELS[cls_name]


def images(batch: int = 2, size: tuple[int, int] = (16, 24), seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, *size, generator=g, dtype=torch.float64)


def patchify(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Qwen image processor's own packing (``Qwen2VLImageProcessor.patchify``, patch 4,
    merge 2, 2 temporal copies): ``(pixel_values [ΣN, 96], image_grid_thw [B, 3])``."""
    rows, gh, gw = transformers.Qwen2VLImageProcessor().patchify(
        x, patch_size=4, merge_size=2, temporal_patch_size=2)
    return rows.reshape(-1, rows.shape[-1]), torch.tensor([[1, gh, gw]] * x.shape[0])


def raster(tokens: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """One image's tokens in the tower's merge-group order back in raster order (the
    order written out here: groups of 2x2 patches, groups row by row)."""
    h, w = grid
    out = torch.empty_like(tokens)
    k = 0
    for gr in range(h // 2):
        for gc in range(w // 2):
            for dr in range(2):
                for dc in range(2):
                    out[(2 * gr + dr) * w + 2 * gc + dc] = tokens[k]
                    k += 1
    return out


def merge_rows(model, tokens: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """One image's ``last_hidden_state`` rows in merge-group order: Qwen2.5-VL's come in
    window order (its groups permuted by ``get_vision_window_index``, not restored)."""
    if not hasattr(model, "fullatt_block_indexes"):
        return tokens
    from transformers.vision_utils import get_vision_window_index

    index, _ = get_vision_window_index(torch.tensor([[1, *grid]]), spatial_merge_size=2,
                                       window_size=model.config.window_size, patch_size=4)
    out = torch.empty_like(tokens)
    for g, group in enumerate(index.tolist()):
        out[4 * group:4 * group + 4] = tokens[4 * g:4 * g + 4]
    return out


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-12) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=tol * (1 + b.abs().max().item()))


def canonical_tokens(adapter, x: torch.Tensor) -> torch.Tensor:
    from captum_vit.adapters.ops import Ops

    h = adapter.embed(x)
    for l in range(len(adapter.blocks)):
        h = adapter.block(h, l, Ops())
    return h


@pytest.mark.parametrize("cls_name", TOWERS)
def test_tower_forward_equals_the_models_packed_forward(cls_name):
    """Two images per call at several sizes, and images of two sizes packed into ONE call
    of the model (block-diagonal attention per image): the adapter's last tokens equal the
    model's own ``last_hidden_state`` (1e-12, float64)."""
    model = model_of(cls_name)
    adapter = adapt(model)
    assert merge_order((2, 4), 2).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    parts = []
    with torch.no_grad():
        for size in ((16, 24), (24, 16), (8, 8)):
            x = images(2, size)
            grid = (size[0] // 4, size[1] // 4)
            rows, thw = patchify(x)
            parts.append((x, rows, thw, grid))
            ref = model(rows, grid_thw=thw).last_hidden_state.reshape(2, grid[0] * grid[1], -1)
            ours = canonical_tokens(adapter, x)
            for i in range(2):
                close(ours[i], raster(merge_rows(model, ref[i], grid), grid))
        # one packed call holding images of three grids
        rows = torch.cat([p[1] for p in parts])
        thw = torch.cat([p[2] for p in parts])
        ref = model(rows, grid_thw=thw).last_hidden_state
        start = 0
        for x, _, _, grid in parts:
            ours = canonical_tokens(adapter, x)
            for i in range(2):
                n = grid[0] * grid[1]
                close(ours[i], raster(merge_rows(model, ref[start:start + n], grid), grid))
                start += n


@pytest.mark.parametrize("cls_name", TOWERS)
def test_a_processors_output_gives_maps_per_image(cls_name):
    """``attribute`` takes ``pixel_values`` + ``image_grid_thw`` of images of two sizes:
    each image's map equals the map of the image alone; ``output="inputs"`` is shaped like
    ``pixel_values`` (each pixel's value spread over its 2 temporal copies)."""
    model = model_of(cls_name)
    small, large = images(1, (8, 8), seed=3), images(2, (16, 24), seed=4)
    r1, t1 = patchify(small)
    r2, t2 = patchify(large)
    batch = {"pixel_values": torch.cat([r2[:24], r1, r2[24:]]),
             "image_grid_thw": torch.cat([t2[:1], t1, t2[1:]])}  # large, small, large
    method = build_method("gae", model)
    t = torch.randn(3, 32, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    maps = method.attribute(batch, target=t)  # one target vector per image
    assert isinstance(maps, list) and [m.shape for m in maps] == [
        (1, 3, 16, 24), (1, 3, 8, 8), (1, 3, 16, 24)]
    close(maps[1], method.attribute(small, target=t[1:2]))
    close(torch.cat([maps[0], maps[2]]), method.attribute(large, target=t[[0, 2]]))
    packed = method.attribute(batch, target=t, output="inputs")
    assert packed.shape == batch["pixel_values"].shape
    close(packed[24:28], patchify(maps[1])[0] / 2)  # the small image's rows
    close(packed[:24], patchify(maps[0])[0] / 2)
    bad = dict(batch, image_grid_thw=torch.tensor([[1, 4, 6], [1, 2, 2], [1, 4, 4]]))
    with pytest.raises(ValueError, match="image_grid_thw .* covers 44 patches but pixel_values "
                                         "has 52 rows"):
        method.attribute(bad, target=t)
    with pytest.raises(ValueError, match="t > 1 is a video"):
        method.attribute(dict(batch, image_grid_thw=torch.tensor([[2, 4, 6], [1, 2, 2],
                                                                   [1, 4, 6]])), target=t)
    with pytest.raises(ValueError, match="image_grid_thw"):
        method.attribute({"pixel_values": batch["pixel_values"]}, target=t)


def prompt(*text: int, tokens: int = 6) -> torch.Tensor:
    return torch.tensor([1, START, *[IMAGE] * tokens, END, *text])


def reference(model, x: torch.Tensor, ids: torch.Tensor, answer: torch.Tensor
              ) -> torch.Tensor:
    """``Σ log_softmax`` of the VLM's own forward (its tower on the processor's packing,
    its own mRoPE positions) at the answer tokens, one image and prompt at a time: [B]."""
    out = []
    with torch.no_grad():
        for i in range(x.shape[0]):
            rows, thw = patchify(x[i:i + 1])
            seq = torch.cat([ids, answer])[None]
            logits = model(input_ids=seq, pixel_values=rows, image_grid_thw=thw,
                           mm_token_type_ids=(seq == IMAGE).int(), use_cache=False).logits
            logp = logits[0, -len(answer) - 1:-1].log_softmax(-1)
            out.append(logp.gather(-1, answer[:, None]).sum())
    return torch.stack(out)


def scores(model, x, target) -> torch.Tensor:
    adapter = adapt(VLMAnswer.tower(model))
    with torch.no_grad(), adapter.targeting(target, grid=adapter.layout(x).grid):
        return adapter.model_logits(x)


@pytest.mark.parametrize("cls_name", VLMS)
def test_answer_log_probability_equals_the_vlms_own_forward(cls_name):
    model = model_of(cls_name)
    x = images()
    ids, answer = prompt(5, 7, 8), torch.tensor([11, 12, 13])
    target = VLMAnswer(model, ids, answer)
    if cls_name.startswith("Qwen3"):  # deepstack: block 0's output and the last block's
        assert target.blocks == (1, 2)
    want = reference(model, x, ids, answer)
    cache = model.model.rope_deltas  # the model's own forward caches its mRoPE deltas
    got = scores(model, x, target)
    assert model.model.rope_deltas is cache  # the target passes positions: no cache write
    assert got.shape == (2, 1)
    close(got[:, 0], want, tol=1e-10)
    assert (got[0] != got[1]).all()


def test_two_images_per_prompt():
    """A processor's output with one prompt holding two images: each image is explained in
    its own slot (a column per image), the other held at the model's features; the
    diagonal equals the VLM's own forward on the prompt with both images."""
    model = model_of("Qwen2VLForConditionalGeneration")
    x = images(2)
    rows, thw = patchify(x)
    ids = torch.cat([prompt(5), torch.tensor([START, *[IMAGE] * 6, END, 9])])[None]
    answer = torch.tensor([11, 12])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "pixel_values": rows, "image_grid_thw": thw}
    before = snapshot(model)
    target = VLMAnswer(model, batch, answer)
    assert target.num_columns(0) == 2 and target.index(2).tolist() == [0, 1]
    got = scores(model, x, target)
    seq = torch.cat([ids[0], answer])[None]
    with torch.no_grad():
        logits = model(input_ids=seq, pixel_values=rows, image_grid_thw=thw,
                       mm_token_type_ids=(seq == IMAGE).int(), use_cache=False).logits
    want = logits[0, -3:-1].log_softmax(-1).gather(-1, answer[:, None]).sum()
    close(got.diagonal(), want.expand(2), tol=1e-10)
    # explained through the processor's output: one map per image, on its own slot
    tower = VLMAnswer.tower(model)
    maps = build_method("gae", tower).attribute(batch, target=target)
    assert maps.shape == x.shape and torch.isfinite(maps).all()
    close(maps, build_method("gae", tower).attribute(x, target=target))
    assert_unchanged(model, before)


@pytest.mark.parametrize("cls_name", VLMS)
def test_a_processors_batch_of_prompts(cls_name):
    """A processor's batch of two prompts (the shorter padded on the left), one image and
    one answer each: a column per prompt, each image scored by its own prompt as the VLM's
    own forward scores it; one question repeated is one column."""
    model = model_of(cls_name)
    x = images(2)
    rows, thw = patchify(x)
    long, short = prompt(5, 7, 8), prompt(9, 4)
    ids = torch.stack([long, torch.cat([torch.zeros(1, dtype=torch.long), short])])
    mask = torch.ones_like(ids)
    mask[1, 0] = 0
    answer = torch.tensor([[11, 12], [21, 22]])
    batch = {"input_ids": ids, "attention_mask": mask, "pixel_values": rows,
             "image_grid_thw": thw}
    target = VLMAnswer(model, batch, answer)
    assert target.num_columns(0) == 2 and target.index(4).tolist() == [0, 0, 1, 1]
    got = scores(model, x, target)
    close(got[0, 0], reference(model, x[:1], long, answer[0])[0], tol=1e-10)
    close(got[1, 1], reference(model, x[1:], short, answer[1])[0], tol=1e-9)
    same = VLMAnswer(model, dict(batch, input_ids=long.expand(2, -1),
                                 attention_mask=torch.ones(2, len(long), dtype=torch.long)),
                     answer[0])
    assert same.num_columns(0) == 1 and same.index(2).tolist() == [0, 0]
    close(scores(model, x, same)[:, 0], reference(model, x, long, answer[0]), tol=1e-10)


# -- images of several sizes in one call ----------------------------------------------------
def mixed_batch() -> tuple[dict, list[torch.Tensor], torch.Tensor]:
    """A processor's batch of two prompts: prompt 0 holds image A (16 × 24 px: 4 × 6
    patches, 6 image tokens) then image B (16 × 16: 4 tokens), prompt 1 image C (16 × 24),
    padded on the left; the images in order A, B, C."""
    a, b, c = images(1, (16, 24), seed=3), images(1, (16, 16), seed=4), images(1, (16, 24), 5)
    rows, thw = zip(*(patchify(x) for x in (a, b, c)), strict=True)
    p0 = torch.tensor([1, START, *[IMAGE] * 6, END, START, *[IMAGE] * 4, END, 5, 7])
    p1 = torch.cat([torch.zeros(6, dtype=torch.long), prompt(9, 4)])
    mask = torch.ones(2, len(p0), dtype=torch.long)
    mask[1, :6] = 0
    batch = {"input_ids": torch.stack([p0, p1]), "attention_mask": mask,
             "pixel_values": torch.cat(rows), "image_grid_thw": torch.cat(thw)}
    return batch, [a, b, c], torch.tensor([[11, 12], [21, 22]])


def own_token_ixg(model, batch: dict, answer: torch.Tensor) -> list[torch.Tensor]:
    """Token input×gradient at the patch embedding, written from the VLM's own forward:
    per prompt, the gradient of its answer's log-probability (all its images in the
    forward) at ``visual.patch_embed``'s output (merge-group order) times that output,
    summed over the features, back in raster order; one ``[N_i]`` per image."""
    grids = [tuple(t[1:]) for t in batch["image_grid_thw"].tolist()]
    starts = [0]
    for h, w in grids:
        starts.append(starts[-1] + h * w)
    out: list[torch.Tensor] = []
    first = 0
    for p in range(batch["input_ids"].shape[0]):
        ids, mask = batch["input_ids"][p], batch["attention_mask"][p]
        n = int(((ids == IMAGE) & (mask != 0) & (ids.roll(1) != IMAGE)).sum())  # runs
        imgs = range(first, first + n)
        first += n
        seq = torch.cat([ids, answer[p]])[None]
        am = torch.cat([mask, torch.ones_like(answer[p])])[None]
        kept: list[torch.Tensor] = []
        hook = model.model.visual.patch_embed.register_forward_hook(
            lambda m, i, o, kept=kept: kept.append(o))
        try:
            rows = batch["pixel_values"][starts[imgs[0]]:starts[imgs[-1] + 1]]
            logits = model(input_ids=seq, attention_mask=am, pixel_values=rows,
                           image_grid_thw=batch["image_grid_thw"][list(imgs)],
                           mm_token_type_ids=(seq == IMAGE).int(), use_cache=False).logits
        finally:
            hook.remove()
        a = len(answer[p])
        score = logits[0, -a - 1:-1].log_softmax(-1).gather(-1, answer[p][:, None]).sum()
        emb = kept[0]
        ixg = (emb * torch.autograd.grad(score, emb)[0]).sum(-1).detach()
        for i in imgs:
            lo = starts[i] - starts[imgs[0]]
            h, w = grids[i]
            out.append(raster(ixg[lo:lo + h * w, None], (h, w))[:, 0])
    return out


def _rope_vision_exact(q, k, cos, sin):
    """The model's ``apply_rotary_pos_emb_vision`` with the queries and keys kept in their
    dtype (the adapter's, :func:`_rotate_exact`)."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import rotate_half

    cos, sin = cos.unsqueeze(-2).to(q.dtype), sin.unsqueeze(-2).to(q.dtype)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def test_images_of_several_sizes_in_one_call(monkeypatch):
    """One ``attribute`` call on a processor's batch whose images have two sizes (one
    prompt holding two sizes, another prompt one): a map per image on its own grid, each
    image scored in its prompt with the prompt's other image clean; token IxG equals the
    VLM's own input×gradient written here (≤ 1e-10; both sides' float32 roundings of the
    RMSNorms and vision RoPE, which round the gradients too, kept in float64), and a
    prompt's map equals the map of its own one-size call."""
    from transformers.models.qwen2_vl import modeling_qwen2_vl

    model = exact("Qwen2VLForConditionalGeneration")
    monkeypatch.setattr(modeling_qwen2_vl, "apply_rotary_pos_emb_vision", _rope_vision_exact)
    tower = VLMAnswer.tower(model)
    batch, (a, b, c), answer = mixed_batch()
    before = snapshot(model)
    target = VLMAnswer(model, batch, answer)
    assert target.num_columns(0) == 3 and target.index(3).tolist() == [0, 1, 2]
    method = exact_tower(build_method("token_ixg", tower))
    tokens = method.attribute(batch, target=target, output="tokens")
    want = own_token_ixg(model, batch, answer)
    assert tokens.shape == (24 + 16 + 24,)
    close(tokens, torch.cat(want), tol=1e-10)
    maps = method.attribute(batch, target=target)
    assert [m.shape for m in maps] == [a.shape, b.shape, c.shape]
    one = VLMAnswer(model, {k: v[1:] for k, v in batch.items()
                            if k in ("input_ids", "attention_mask")}, answer[1])
    for name in ("token_ixg", "decompx", "attnlrp"):
        m = build_method(name, tower).attribute(batch, target=target)
        close(m[2], build_method(name, tower).attribute(c, target=one), tol=1e-10)
    # per-token columns through the same split
    per = VLMAnswer(model, batch, answer, per_token=True)
    close(method.attribute(batch, target=per.token(0), output="tokens")
          + method.attribute(batch, target=per.token(1), output="tokens"), tokens, tol=1e-9)
    assert_unchanged(model, before)


def test_images_of_several_sizes_bad_input():
    """``image_grid_thw`` that does not match the packed rows is refused naming it; a
    VLMAnswer of another VLM cannot be split per grid; the model unchanged."""
    model = model_of("Qwen2VLForConditionalGeneration")
    tower = VLMAnswer.tower(model)
    batch, _, answer = mixed_batch()
    before = snapshot(model)
    target = VLMAnswer(model, batch, answer)
    method = build_method("token_ixg", tower)
    short = dict(batch, pixel_values=batch["pixel_values"][:-4])
    with pytest.raises(ValueError, match=r"image_grid_thw .* covers 64 patches but "
                                         r"pixel_values has 60 rows"):
        method.attribute(short, target=target)
    with pytest.raises(ValueError, match=r"image_grid_thw .* covers 64 patches but "
                                         r"pixel_values has 60 rows"):
        VLMAnswer(model, short, answer)
    swapped = dict(batch, image_grid_thw=batch["image_grid_thw"][[1, 0, 2]])
    with pytest.raises(ValueError, match=r"image_grid_thw \[\[1, 4, 4\], \[1, 4, 6\], "
                                         r"\[1, 4, 6\]\] gives \[4, 6, 6\] image tokens"):
        VLMAnswer(model, swapped, answer)
    assert_unchanged(model, before)


# -- memory: the fused attention on a large grid ----------------------------------------------
@pytest.mark.parametrize("name", ["token_ixg", "vanilla_grad", "attnlrp", "hirescam"])
def test_large_attention_keeps_no_probabilities_and_the_same_maps(name, monkeypatch):
    """On a grid whose attention is large (more keys than four head widths: a VLM tower at
    1,024 patches) the maps of states and gradients (token IxG, the gradient, the CAMs'
    block gradients) and AttnLRP's uniform rule run the fused kernel, which keeps no
    ``[B, H, N, N]`` probabilities for the backward; the maps equal those of the explicit
    softmax (≤ 1e-10)."""
    from captum_vit.adapters import rules
    from captum_vit.methods import _engines, ixg

    model = model_of("Qwen2VLForConditionalGeneration")
    tower = VLMAnswer.tower(model)
    x = images(1, (32, 48))  # 8 × 12 patches: 96 keys per query
    assert not adapt(tower).small_attention(x)
    target = VLMAnswer(model, prompt(5, 7, tokens=24), torch.tensor([11, 12]))
    if name == "vanilla_grad":  # the signed sum is round-off in a pre-LN tower
        from captum_vit.methods.vanilla import VanillaGrad

        method = VanillaGrad(tower, reduce="l2")
    else:
        method = build_method(name, tower)
    shapes: list[tuple[int, ...]] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        fused = method.attribute(x, target=target, output="tokens")
    assert shapes and not [s for s in shapes if s[-2:] == (96, 96)]
    for where in (_engines, ixg):
        monkeypatch.setattr(where, "states_attention", lambda adapter, inputs: "explicit")
    monkeypatch.setattr(rules, "small_attention", lambda keys, head_dim, **_: True)
    explicit = method.attribute(x, target=target, output="tokens")
    assert_close_scaled(fused, explicit, rel=1e-10)
    assert (explicit.abs() > 0).any()


# -- one map per answer token ----------------------------------------------------------------
def _exact_rms_norm(self, x: torch.Tensor) -> torch.Tensor:
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) +
                                          self.variance_epsilon))


def exact_language_model(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose language model's and merger's RMSNorms compute in
    float64: Qwen's compute in float32 whatever the input's dtype, so the gradients of the
    answer's tokens would carry float32 rounding (~1e-7) and their sum would not be the
    whole answer's gradient to float64 precision. The tower's blocks are as built."""
    import copy
    import types

    model = copy.deepcopy(model)
    for part in (model.model.language_model, model.model.visual.merger):
        for module in part.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.forward = types.MethodType(_exact_rms_norm, module)
    return model


def _rotate_exact(self, h: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """The vision RoPE with the queries and keys kept in their dtype (the model rounds them
    to float32); its float32 tables as the adapter's."""
    cos, sin = (t.to(h.dtype) for t in self._rope)
    assert positions is None
    return h * cos + self._rotate_half(h) * sin


def _rotate_windows_exact(self, h: torch.Tensor, positions: torch.Tensor | None
                          ) -> torch.Tensor:
    cos, sin = (t.to(h.dtype) for t in self._rope_windows)
    assert positions is None
    w = h.reshape(-1, cos.shape[0], *h.shape[1:])
    cos, sin = cos[None, :, None], sin[None, :, None]
    return (w * cos + self._rotate_half(w) * sin).reshape(h.shape)


def exact_tower(method, x: torch.Tensor | None = None):
    """``method`` with its adapter's vision RoPE not rounding the queries and keys to
    float32 and Qwen2.5-VL's block RMSNorms computing in float64, where the model (and the
    adapter, for parity) compute in float32: a gradient through that rounding is
    float32-rounded (~1e-8 relative), so the tower is then linear in its backward to
    float64 precision. Patched on the built adapter (one per model) once it has checked its
    forward on ``x`` against the model's (``None``: the model's own RoPE is made exact
    too, :func:`_rope_vision_exact`, and the check runs later)."""
    import dataclasses
    import types

    ad = method.adapter
    if x is not None:
        ad.self_check(x)
    exact = {"_rotate": _rotate_exact, "_rotate_windows": _rotate_windows_exact}
    exact.update({f.__name__: f for f in list(exact.values())})  # already patched

    def norm(n):
        return dataclasses.replace(n, compute_dtype=None) if n.rms else n

    ad.blocks = [dataclasses.replace(
        b, rotary=types.MethodType(exact[b.rotary.__func__.__name__], b.rotary.__self__),
        norm1=norm(b.norm1), norm2=norm(b.norm2)) for b in ad.blocks]
    return method


_EXACT: dict[str, torch.nn.Module] = {}


def exact(cls_name: str) -> torch.nn.Module:
    if cls_name not in _EXACT:
        _EXACT[cls_name] = exact_language_model(model_of(cls_name))
    return _EXACT[cls_name]


# the test copies' RMSNorms and vision RoPE compute in float64 (exact_language_model,
# exact_tower): the model's float32 rounding there would round the gradients too
PER_TOKEN = [(name, cls) for cls in VLMS for name in ("token_ixg", "decompx", "attnlrp",
                                                      "cp_lrp")]


@pytest.mark.parametrize(("name", "cls_name"), PER_TOKEN)
def test_per_token_maps_sum_to_the_answers_map(name, cls_name):
    """For a method linear in the score the maps of the answer's tokens add up to the whole
    answer's map (float64 ≤ 1e-10); the whole answer is the default column and equals the
    plain target's; the labels are the tokenizer's."""
    model = exact(cls_name)
    tower = VLMAnswer.tower(model)
    x = images()
    ids, answer = prompt(5, 7), torch.tensor([11, 12, 13])
    before = snapshot(model)
    target = VLMAnswer(model, ids, answer, per_token=True)
    assert target.num_columns(0) == 4 and target.token(1).index(2).tolist() == [2, 2]
    assert_token_maps_sum(model, exact_tower(build_method(name, tower), x), x, ids, answer)
    assert_unchanged(model, before)


@pytest.mark.parametrize("name", ["token_ixg", "attnlrp", "decompx", "cp_lrp", "vanilla_grad"])
def test_qwen3_deepstack_answer_in_one_tower_pass(name):
    """Qwen3-VL's answer reads two tower blocks (deepstack): a method linear in the gradient
    its backward carries explains it in ONE tower pass, equal (float64 ≤ 1e-10) to the sum
    of the single-block maps (``sums_block_terms`` forces that route: a forward to the read
    states, then one pass per read block)."""
    model = exact(VLMS[1])
    x = images()
    target = VLMAnswer(model, prompt(5, 7), torch.tensor([11, 12]))
    method = exact_tower(build_method(name, VLMAnswer.tower(model)), x)
    calls = []
    hook = model.model.visual.patch_embed.register_forward_hook(lambda *a: calls.append(1))
    try:
        got = method.attribute(x, target=target, output="tokens")
        one = len(calls)
        method.sums_block_terms = True
        ref = method.attribute(x, target=target, output="tokens")
    finally:
        hook.remove()
    assert_close_scaled(got, ref, rel=1e-10)
    reads = 1 + len(model.config.vision_config.deepstack_visual_indexes)
    assert one == 1 and len(calls) - one == 1 + reads  # the read states' forward + a pass each


@pytest.mark.parametrize("name", ["token_ixg", "decompx"])
def test_a_tokens_map_is_the_map_of_that_token_alone(name):
    """Token ``t``'s map is the map of a VLMAnswer that scores answer token ``t`` alone:
    the answer's first ``t`` tokens moved into the prompt (teacher forcing gives them as
    input either way) and the answer ``[answer_t]``."""
    model = exact("Qwen2VLForConditionalGeneration")
    x = images()
    method = exact_tower(build_method(name, VLMAnswer.tower(model)), x)
    ids, answer = prompt(5, 7), torch.tensor([11, 12, 13])
    target = VLMAnswer(model, ids, answer, per_token=True)
    for t in (0, 2):
        got = method.attribute(x, target=target.token(t), output="tokens")
        alone = VLMAnswer(model, torch.cat([ids, answer[:t]]), answer[t:t + 1])
        assert_close_scaled(got, method.attribute(x, target=alone, output="tokens"),
                            rel=1e-10)
    with pytest.raises(ValueError, match=r"t must be an answer position in \[0, 3\)"):
        target.token(3)


def test_per_token_columns_with_two_images_per_prompt():
    """A processor's prompt holding two images and ``per_token=True``: a column per image,
    each with the whole answer (slot 0) and every token (slot 1 + t), the other image held
    at the model's features; each image's own columns are the VLM's own log-probabilities
    of the answer's tokens, and a shorter answer's padded token scores 0."""
    model = model_of("Qwen2VLForConditionalGeneration")
    x = images(2)
    rows, thw = patchify(x)
    ids = torch.cat([prompt(5), torch.tensor([START, *[IMAGE] * 6, END, 9])])[None]
    answer = torch.tensor([11, 12, -100])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "pixel_values": rows, "image_grid_thw": thw}
    target = VLMAnswer(model, batch, answer, per_token=True)
    assert target.num_columns(0) == 8 and target.index(2).tolist() == [0, 4]
    assert target.token(1).index(2).tolist() == [2, 6]
    got = scores(model, x, target)
    assert got.shape == (2, 8)
    seq = torch.cat([ids[0], answer[:2]])[None]
    with torch.no_grad():
        logits = model(input_ids=seq, pixel_values=rows, image_grid_thw=thw,
                       mm_token_type_ids=(seq == IMAGE).int(), use_cache=False).logits
    want = logits[0, -3:-1].log_softmax(-1).gather(-1, answer[:2, None])[:, 0]
    for i in range(2):
        close(got[i, 4 * i + 1:4 * i + 3], want, tol=1e-10)
        close(got[i, 4 * i], want.sum(), tol=1e-10)
        assert got[i, 4 * i + 3] == 0
    maps = build_method("token_ixg", VLMAnswer.tower(model)).attribute(
        batch, target=target.token(0))
    assert maps.shape == x.shape and torch.isfinite(maps).all()


# TIS removes tokens: refused for a target that reads token rows (RISE and ViT-CX mask
# pixels); the sub-network sums of PLUS / FullGrad+ end at the model's output, and
# Qwen3-VL's answer reads two blocks (its deepstack block and the last).
REFUSED = ("tis",)
REFUSED_BLOCKS = ("fullgrad_plus", "skip_fullgrad_plus", "plus:", "skipplus:")  # Qwen3-VL
FAST = {"tis": {"n_masks": 16}, "rise": {"n_masks": 8, "score": "logit"},
        "vit_cx": {"score": "logit"}, "bt_h": {"n_steps": 2, "start_layer": 0},
        "bt_t": {"n_steps": 2, "start_layer": 0}, "tam": {"n_steps": 2, "start_layer": 0},
        "scorecam": {"score": "logit"}}
# every method on Qwen3-VL (the deepstack answer reads two blocks); one of each kind on
# Qwen2-VL (the merged last block only), to keep the file fast
QWEN2_KINDS = ("rollout", "gae", "decompx", "attnlrp", "cp_lrp", "token_ixg", "gradcam",
               "alti", "rise", "tis", "plus:gae", "fullgrad_plus")
# Qwen2.5-VL (RMSNorm, SwiGLU, windows): one of each kind; every method runs on its tower
# in the embedding suite (tests/targets/test_embedding_targets.py)
QWEN25_KINDS = ("rollout", "gae", "decompx", "attnlrp", "cp_lrp", "token_ixg", "gradcam",
                "globenc", "alti", "tokentm", "rise", "plus:gae", "fullgrad_plus")
CASES = [(name, VLMS[1]) for name in available_methods(compositions=True, baselines=False)]
CASES += [(name, VLMS[0]) for name in QWEN2_KINDS]
CASES += [(name, VLMS[2]) for name in QWEN25_KINDS]


@pytest.mark.parametrize(("name", "cls_name"), CASES)
def test_every_method_explains_the_answer_and_leaves_the_vlm_unchanged(name, cls_name):
    model = model_of(cls_name)
    tower = VLMAnswer.tower(model)
    x = images()
    target = VLMAnswer(model, prompt(5, 7), torch.tensor([11, 12]))
    before = snapshot(model)
    method = build_method(name, tower)
    refused = name in REFUSED or (cls_name.startswith("Qwen3")
                                  and name.startswith(REFUSED_BLOCKS))
    if refused:
        with pytest.raises(ValueError, match="VLMAnswer"):
            method.attribute(x, target=target, **FAST.get(name, {}))
    else:
        maps = method.attribute(x, target=target, **FAST.get(name, {}))
        assert maps.shape == x.shape and torch.isfinite(maps).all()
        assert (maps.flatten(1).std(1) > 0).any(), f"{name}: constant"
    assert_unchanged(model, before)


def test_clear_errors_leave_the_model_unchanged():
    model = model_of("Qwen2VLForConditionalGeneration")
    before = snapshot(model)
    answer = torch.tensor([11])
    with pytest.raises(ValueError, match="every prompt must hold the image token"):
        VLMAnswer(model, torch.tensor([1, 5, 7]), answer)
    two = torch.cat([prompt(5), torch.tensor([START, *[IMAGE] * 6, END])])
    with pytest.raises(ValueError, match="input_ids: prompt 0 holds 2 images"):
        VLMAnswer(model, two, answer)
    x = images(2)
    rows, thw = patchify(x)
    batch = {"input_ids": two[None], "pixel_values": rows, "image_grid_thw": thw}
    with pytest.raises(ValueError, match=r"image_grid_thw \[\[1, 4, 6\], \[1, 4, 4\]\] gives "
                                         r"\[6, 4\] image tokens"):
        VLMAnswer(model, dict(batch, image_grid_thw=torch.tensor([[1, 4, 6], [1, 4, 4]])),
                  answer)
    with pytest.raises(ValueError, match="covers 48 patches but pixel_values has 40 rows"):
        VLMAnswer(model, dict(batch, pixel_values=rows[:40]), answer)
    # a prompt made for another image size
    target = VLMAnswer(model, prompt(5, tokens=4), answer)
    with pytest.raises(ValueError, match="explain VLMAnswer.tower"):
        build_method("gae", VLMAnswer.tower(model)).attribute(x, target=target)
    with pytest.raises(ValueError, match="multiple"):
        build_method("gae", VLMAnswer.tower(model)).attribute(
            images(1, (12, 12)), target=VLMAnswer(model, prompt(5), answer))
    assert_unchanged(model, before)


@pytest.mark.parametrize(("grid", "window"), [((4, 6), 2), ((8, 8), 2), ((6, 10), 3),
                                              ((4, 4), 8)])
def test_qwen2_5_windows_as_index_sets(grid, window):
    """Qwen2.5-VL's windows (``get_vision_window_index``: merged-token indices in window
    order, window lengths in patches) are the index sets of ``window_slots`` (variable-size
    edge windows; one window covering the grid when it is large)."""
    from transformers.vision_utils import get_vision_window_index

    from captum_vit.adapters.families.hf_qwen_vl import window_slots

    index, cu = get_vision_window_index(torch.tensor([[1, *grid]]), spatial_merge_size=2,
                                        window_size=window * 2 * 4, patch_size=4)
    lengths = (cu[1:] - cu[:-1]) // 4  # merged tokens per window
    lw = grid[1] // 2
    theirs = []
    for part in torch.split(index, lengths.tolist()):
        theirs.append(sorted((2 * (t // lw) + dr) * grid[1] + 2 * (t % lw) + dc
                             for t in part.tolist() for dr in range(2) for dc in range(2)))
    ours = [sorted(i for i in row.tolist() if i >= 0) for row in window_slots(grid, 2, window)]
    assert ours == theirs
    assert sorted(i for row in ours for i in row) == list(range(grid[0] * grid[1]))


def test_qwen2_5_one_window_covering_the_grid_equals_the_all_global_model():
    """Qwen2.5-VL with windows larger than the grid (one window of every patch, in window
    order) against the same weights with every block global (``fullatt_block_indexes``):
    the maps are equal (1e-10) for gradient, decomposition and LRP methods; the windowed
    tower's forward equals its model's own."""
    windowed = qwen_tower_example(TOWERS[2])(window_size=64)
    full = qwen_tower_example(TOWERS[2])(fullatt_block_indexes=[0, 1])
    assert all(torch.equal(a, b) for a, b in zip(windowed.state_dict().values(),
                                                 full.state_dict().values(), strict=True))
    a = adapt(windowed)
    x = images(2)
    assert a.blocks[0].window is not None and a.blocks[0].window.num_windows == 1
    assert all(b.window is None for b in adapt(full).blocks)
    with torch.no_grad():
        rows, thw = patchify(x)
        ref = windowed(rows, grid_thw=thw).last_hidden_state.reshape(2, 24, -1)
        ours = canonical_tokens(a, x)
        for i in range(2):
            close(ours[i], raster(merge_rows(windowed, ref[i], (4, 6)), (4, 6)))
    t = torch.randn(2, 32, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    for name in ("gae", "token_ixg", "decompx", "attnlrp"):
        got = build_method(name, windowed).attribute(x, target=t, output="tokens")
        want = build_method(name, full).attribute(x, target=t, output="tokens")
        assert torch.isfinite(got).all() and got.std() > 0
        close(got, want, tol=1e-10)


def test_qwen2_5_windows_change_the_maps_and_bad_grids_are_refused():
    """The tiny tower's windows (2×2 merged tokens, an edge window cut) do change the
    first block's attention: its maps differ from the all-global model's; a wrong
    ``image_grid_thw`` is refused by name and the model left unchanged."""
    windowed = model_of(TOWERS[2])
    full = qwen_tower_example(TOWERS[2])(fullatt_block_indexes=[0, 1])
    x = images(2)
    t = torch.randn(2, 32, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    got = build_method("gae", windowed).attribute(x, target=t, output="tokens")
    want = build_method("gae", full).attribute(x, target=t, output="tokens")
    assert (got - want).abs().max() > 1e-3 * want.abs().max()  # 1e-16 were they equal
    win = adapt(windowed).blocks[0].window
    assert (win.num_windows, win.area) == (2, 16)
    before = snapshot(windowed)
    rows, thw = patchify(x)
    method = build_method("gae", windowed)
    with pytest.raises(ValueError, match=r"image_grid_thw \[\[1, 4, 4\], \[1, 4, 6\]\] covers 40 "
                                         "patches but pixel_values has 48 rows"):
        method.attribute({"pixel_values": rows,
                          "image_grid_thw": torch.tensor([[1, 4, 4], [1, 4, 6]])}, target=t)
    with pytest.raises(ValueError, match="h and w must be positive multiples of "
                                         "spatial_merge_size 2"):
        method.attribute({"pixel_values": rows,
                          "image_grid_thw": torch.tensor([[1, 3, 8], [1, 4, 6]])}, target=t)
    vlm = model_of(VLMS[2])
    vbefore = snapshot(vlm)
    batch = {"input_ids": prompt(5)[None], "pixel_values": rows[:24],
             "image_grid_thw": torch.tensor([[1, 4, 4]])}
    with pytest.raises(ValueError, match=r"image_grid_thw \[\[1, 4, 4\]\] gives \[4\] image "
                                         r"tokens"):
        VLMAnswer(vlm, batch, torch.tensor([11]))
    assert_unchanged(windowed, before)
    assert_unchanged(vlm, vbefore)
