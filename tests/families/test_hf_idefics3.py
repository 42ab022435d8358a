"""Idefics3 / SmolVLM: the vision tower (family ``hf_idefics3``) and VLMAnswer on the
tiles their processor makes, on tiny random models built from configs (ids are given, no
tokenizer; the image processor is built from its options)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from captum_vit.adapters import adapt
from captum_vit.adapters.vlm_tiles import TileLayout
from captum_vit.registry import available_methods, build_method
from captum_vit.targets import VLMAnswer
from captum_vit.viz import stitch
from tests.helpers import assert_close_scaled, assert_unchanged, make_model, snapshot

transformers = pytest.importorskip("transformers")

IMAGE = 299
L = 4  # image features per 32 px tile: 4 × 4 patches, pixel shuffle by 2


def vlm(kind: str = "Idefics3") -> torch.nn.Module:
    """A 2-block tower (32 px tiles, patch 8), the pixel-shuffle connector (scale 2) and a
    2-layer Llama; float64."""
    torch.manual_seed(0)
    vc = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, image_size=32, patch_size=8)
    tc = dict(model_type="llama", vocab_size=300, hidden_size=32, intermediate_size=64,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, pad_token_id=0)
    cfg = getattr(transformers, f"{kind}Config")(vision_config=vc, text_config=tc,
                                                 image_token_id=IMAGE, scale_factor=2)
    return getattr(transformers, f"{kind}ForConditionalGeneration")(cfg).double().eval()


_MODELS: dict[str, torch.nn.Module] = {}


def model_of(kind: str = "Idefics3") -> torch.nn.Module:
    if kind not in _MODELS:
        _MODELS[kind] = vlm(kind)
    return _MODELS[kind]


def processed(tiles: tuple[int, ...] = (5, 3)) -> dict:
    """A processor's batch: prompt i has ``tiles[i]`` real tiles (the last its global
    image), the rest all-zero padding images; prompts padded on the left."""
    g = torch.Generator().manual_seed(1)
    b, m = len(tiles), max(tiles)
    px = torch.randn(b, m, 3, 32, 32, generator=g, dtype=torch.float64)
    mask = torch.ones(b, m, 32, 32, dtype=torch.long)
    prompts = []
    for i, t in enumerate(tiles):
        px[i, t:] = 0
        mask[i, t:] = 0
        prompts.append([1, 5 + i] + [IMAGE] * (t * L) + [7, 8])
    width = max(len(p) for p in prompts)
    ids = torch.zeros(b, width, dtype=torch.long)
    am = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        am[i, width - len(p):] = 1
    return {"input_ids": ids, "attention_mask": am, "pixel_values": px,
            "pixel_attention_mask": mask}


ANSWER = torch.tensor([11, 12, 13])


def own_log_probs(model, batch, answer=ANSWER, pixels=None) -> torch.Tensor:
    """``Σ log_softmax`` of the model's own logits at the answer, prompt by prompt (its
    forward on the processor's 5-D pixel_values): [B]."""
    px = batch["pixel_values"] if pixels is None else pixels
    out = []
    for i in range(px.shape[0]):
        seq = torch.cat([batch["input_ids"][i], answer])[None]
        am = torch.cat([batch["attention_mask"][i], torch.ones_like(answer)])[None]
        logits = model(input_ids=seq, attention_mask=am, pixel_values=px[i:i + 1],
                       pixel_attention_mask=batch["pixel_attention_mask"][i:i + 1],
                       use_cache=False).logits
        out.append(logits[0, -len(answer) - 1:-1].log_softmax(-1)
                   .gather(-1, answer[:, None]).sum())
    return torch.stack(out)


def picked(model, target, x) -> torch.Tensor:
    """The target's score of every row ``[n]`` (its own column) through the adapter."""
    adapter = adapt(VLMAnswer.tower(model))
    with adapter.targeting(target):
        cols = adapter.model_logits(x)
    return cols.gather(1, target.index(x.shape[0])[:, None].to(cols.device))[:, 0]


# --- the tower -------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["Idefics3", "SmolVLM"])
def test_tower_forward_equals_the_models_own(kind):
    """The adapter's embedding (the patch mean of the final-normed tokens) equals the
    tower's own forward at the configured size and at others (bucketed positions); the
    tokens themselves are checked through VLMAnswer's parity below."""
    tower = VLMAnswer.tower(model_of(kind))
    adapter = adapt(tower)
    assert type(adapter).__name__ == "HFIdefics3TowerAdapter"
    for size in ((32, 32), (24, 40), (16, 48)):
        x = torch.randn(2, 3, *size, dtype=torch.float64)
        with torch.no_grad():
            want = tower(pixel_values=x).last_hidden_state
            assert_close_scaled(adapter.run(adapter.embed(x)), want.mean(1))


def siglip_twin(tower: torch.nn.Module) -> torch.nn.Module:
    """HF SiglipVisionModel without head, the tower's weights copied (the same names)."""
    c = tower.config
    twin = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        image_size=c.image_size, patch_size=c.patch_size, layer_norm_eps=c.layer_norm_eps,
        hidden_act=c.hidden_act, vision_use_head=False)).double().eval()
    missing, unexpected = twin.load_state_dict(tower.state_dict(), strict=False)
    assert not unexpected and all("position_ids" in k for k in missing)
    return twin


TWIN_FAST = {"tis": {"n_masks": 8}, "rise": {"n_masks": 8}, "vit_cx": {},
             "bt_h": {"n_steps": 3}, "bt_t": {"n_steps": 3}, "tam": {"n_steps": 3}}


def test_maps_equal_a_siglip_twins_for_every_method():
    """At the configured size the tower IS a head-less SigLIP tower: every registered
    method gives the same maps on both (vector target), 1e-10."""
    tower = make_model("hf_idefics3")
    twin = siglip_twin(tower)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    t = torch.randn(32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert_close_scaled(twin(pixel_values=x).last_hidden_state,
                            tower(pixel_values=x).last_hidden_state)
    for name in available_methods(compositions=True, baselines=False):
        kw = TWIN_FAST.get(name, {})
        got = build_method(name, tower).attribute(x, target=t, **kw)
        want = build_method(name, twin).attribute(x, target=t, **kw)
        assert_close_scaled(got, want, 1e-10, msg=name)


# --- VLMAnswer on tiles -----------------------------------------------------------------

@pytest.mark.parametrize("kind", ["Idefics3", "SmolVLM"])
def test_answer_log_probability_equals_the_models_own_forward(kind):
    """Every tile row scores the model's own answer log-probability of its prompt (two
    prompts of 5 and 3 tiles, padded images and left-padded prompts as a processor makes
    them)."""
    model = model_of(kind)
    batch = processed()
    target = VLMAnswer(model, batch, ANSWER)
    x = target.images()
    assert x.shape == (8, 3, 32, 32) and target.num_columns(0) == 8
    assert torch.equal(x, torch.cat([batch["pixel_values"][0, :5], batch["pixel_values"][1, :3]]))
    with torch.no_grad():
        want = own_log_probs(model, batch)
        got = picked(model, target, x)
    assert_close_scaled(got, want.repeat_interleave(torch.tensor([5, 3])), 1e-10)
    assert (want[0] != want[1]).all()


def test_gradient_on_the_tiles_is_the_whole_answers_gradient():
    """A tile row's gradient is the gradient of the model's own answer log-probability
    with respect to that tile of its 5-D pixel_values (the other tiles clean)."""
    model = model_of()
    batch = processed()
    target = VLMAnswer(model, batch, ANSWER)
    x = target.images().clone().requires_grad_(True)
    (gx,) = torch.autograd.grad(picked(model, target, x).sum(), x)
    px = batch["pixel_values"].clone().requires_grad_(True)
    (gp,) = torch.autograd.grad(own_log_probs(model, batch, pixels=px).sum(), px)
    want = torch.cat([gp[0, :5], gp[1, :3]])
    assert_close_scaled(gx, want, 1e-9)
    assert gp[1, 3:].abs().max() == 0  # the padding images do not count


FAST = {"tis": {"n_masks": 8}, "rise": {"n_masks": 8, "score": "logit"},
        "vit_cx": {"score": "logit"}, "bt_h": {"n_steps": 2, "start_layer": 1},
        "bt_t": {"n_steps": 2, "start_layer": 1}, "tam": {"n_steps": 2, "start_layer": 0},
        "scorecam": {"score": "logit"}}
REFUSED = ("tis",)  # true token removal: refused for every target reading token rows


def test_every_method_explains_the_answer_on_tiles_and_leaves_the_vlm_unchanged():
    model = model_of()
    batch = processed((3,))
    target = VLMAnswer(model, batch, ANSWER[:2])
    tower = VLMAnswer.tower(model)
    x = target.images()
    before = snapshot(model)
    for name in available_methods(compositions=True, baselines=False):
        method = build_method(name, tower)
        if name in REFUSED:
            with pytest.raises(ValueError, match="VLMAnswer"):
                method.attribute(x, target=target, **FAST.get(name, {}))
            continue
        maps = method.attribute(x, target=target, **FAST.get(name, {}))
        assert maps.shape == x.shape and torch.isfinite(maps).all(), name
        assert (maps.flatten(1).std(1) > 0).any(), f"{name}: constant"
    assert_unchanged(model, before)


def test_bad_input_is_refused_by_name_and_leaves_the_vlm_unchanged():
    model = model_of()
    before = snapshot(model)
    batch = processed()
    target = VLMAnswer(model, batch, ANSWER)
    tower = VLMAnswer.tower(model)
    gae = build_method("gae", tower)
    # mismatched tiles: 7 images for the 8 real tiles
    with pytest.raises(ValueError, match="8 real tiles: explain target.images"):
        gae.attribute(target.images()[:7], target=target)
    # tiles of another size than the tiles the target was made for
    with pytest.raises(ValueError, match="explain VLMAnswer.tower.*target.images"):
        picked(model, target, torch.randn(8, 3, 24, 24, dtype=torch.float64))
    # a prompt with no image tokens
    no_image = dict(batch, input_ids=batch["input_ids"].masked_fill(
        (batch["input_ids"] == IMAGE) & (torch.arange(2)[:, None] == 1), 3))
    with pytest.raises(ValueError, match="input_ids: prompt 1 holds no image token"):
        VLMAnswer(model, no_image, ANSWER)
    # image tokens for another tile count (the prompts of another processor call)
    other = processed((5, 2))
    with pytest.raises(ValueError, match=r"input_ids: the prompts hold \[20, 8\] image "
                                         r"tokens.*make \[20, 12\]"):
        VLMAnswer(model, dict(batch, input_ids=other["input_ids"],
                              attention_mask=other["attention_mask"]), ANSWER)
    with pytest.raises(ValueError, match="input_ids has 1 prompts but the processor's batch "
                                         "has 2 images"):
        VLMAnswer(model, dict(batch, input_ids=batch["input_ids"][:1],
                              attention_mask=batch["attention_mask"][:1]), ANSWER)
    with pytest.raises(ValueError, match="pass the processor's whole output"):
        VLMAnswer(model, batch["input_ids"], ANSWER)
    with pytest.raises(ValueError, match=r"pixel_values must be the processor's tiles"):
        VLMAnswer(model, dict(batch, pixel_values=batch["pixel_values"][0]), ANSWER)
    mask = batch["pixel_attention_mask"].clone()
    mask[0, 1, -4:] = 0
    with pytest.raises(ValueError, match="pixel_attention_mask marks padded pixels"):
        VLMAnswer(model, dict(batch, pixel_attention_mask=mask), ANSWER)
    with pytest.raises(ValueError, match="answer_ids is empty"):
        VLMAnswer(model, batch, torch.tensor([], dtype=torch.long))
    # stitch: another number of maps than tiles
    with pytest.raises(ValueError, match=r"maps must be \[8, ...\]"):
        target.stitch(torch.zeros(7, 1, 4, 4))
    assert_unchanged(model, before)


# --- layouts and stitching ---------------------------------------------------------------

def coordinates(h: int, w: int) -> np.ndarray:
    """An image whose channel 0 grows down the rows and channel 1 along the columns
    (channel 2 constant), values in [0.25, 1]."""
    y = np.linspace(0.25, 1.0, h, dtype=np.float32)[:, None].repeat(w, 1)
    x = np.linspace(0.25, 1.0, w, dtype=np.float32)[None, :].repeat(h, 0)
    return np.stack([y, x, np.full_like(x, 0.5)], -1)


def processor() -> transformers.Idefics3Processor:
    """Idefics3's processor built offline: a word-level tokenizer holding the tile tokens
    (``<image>`` is the model's id 299), the image processor splitting at 32 pixels
    without rescaling or normalising (the pixels stay the image's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    special = ["<fake_token_around_image>", "<global-img>", "<end_of_utterance>",
               *[f"<row_{r}_col_{c}>" for r in (1, 2) for c in (1, 2)]]
    vocab = {w: i for i, w in enumerate(["<unk>", "User", ":", "Colour", "?", "Assistant",
                                         "red", *special])}
    vocab["<image>"] = IMAGE
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>", *special]})
    return transformers.Idefics3Processor(
        image_processor=transformers.Idefics3ImageProcessor(
            max_image_size={"longest_edge": 32}, size={"longest_edge": 64},
            do_rescale=False, do_normalize=False),
        tokenizer=tokenizer, image_seq_len=L)


def test_the_processors_batch_and_layout_put_every_tile_in_its_place():
    """The processor's own output (its prompt with the tile tokens, the split rows × cols in
    raster order, the global image last): the answer's score is the model's own, and the
    tiles' pixels stitched back form the resized image (rows grow down, columns grow right,
    across the tiles' seams), the global view the whole image."""
    proc = processor()
    image = coordinates(30, 90)
    batch = dict(proc(images=[[image]], return_tensors="pt",
                      text=["User:<image>Colour?<end_of_utterance>\nAssistant:"]))
    assert batch["pixel_values"].shape == (1, 3, 3, 32, 32)
    assert (batch["input_ids"] == IMAGE).sum() == 3 * L
    split = proc.image_processor([[image]], return_row_col_info=True)
    assert split["rows"] == [[1]] and split["cols"] == [[2]]
    model = model_of()
    batch["pixel_values"] = batch["pixel_values"].double()
    with pytest.raises(ValueError, match="rows and columns are not in the batch"):
        VLMAnswer(model, batch, ANSWER).layouts()
    target = VLMAnswer(model, dict(batch, rows=split["rows"], cols=split["cols"]), ANSWER)
    with torch.no_grad():
        assert_close_scaled(picked(model, target, target.images()),
                            own_log_probs(model, batch).expand(3), 1e-10)
    assert target.layouts() == [TileLayout(1, 2, 2, (32, 32))]
    [(canvas, whole)] = target.stitch(target.images())
    assert canvas.shape == (3, 32, 64) and whole is not None and whole.shape == (3, 32, 32)
    for img in (canvas, whole):
        assert (img[0].diff(dim=0) >= -1e-6).all() and (img[1].diff(dim=1) >= -1e-6).all()
        assert img[1, :, :4].mean() < 0.4 and img[1, :, -4:].mean() > 0.9


def test_stitch_places_constant_tiles_and_keeps_the_global_view_apart():
    maps = torch.arange(7.0)[:, None, None, None].expand(7, 1, 4, 4)
    canvas, whole = stitch(maps, TileLayout(2, 3, 6, (32, 32)))
    want = torch.tensor([[0.0, 1, 2], [3, 4, 5]]).repeat_interleave(4, 0) \
        .repeat_interleave(4, 1)
    assert torch.equal(canvas, want[None]) and torch.equal(whole, torch.full((1, 4, 4), 6.0))
    # the global view first (LLaVA-OneVision's order), maps [T, h, w], a content crop
    maps = torch.arange(5.0)[:, None, None].expand(5, 2, 2)
    canvas, whole = stitch(maps, {"rows": 2, "cols": 2, "global_index": 0,
                                  "tile_size": (32, 32), "crop": (16, 0, 48, 64)})
    assert torch.equal(whole, torch.zeros(2, 2))
    assert torch.equal(canvas, torch.tensor([[1.0, 1, 2, 2], [3, 3, 4, 4], [3, 3, 4, 4]]))
    # no global view
    canvas, whole = stitch(torch.ones(1, 3, 3), TileLayout(1, 1, None, (3, 3)))
    assert whole is None and torch.equal(canvas, torch.ones(3, 3))
    with pytest.raises(ValueError, match=r"maps has 6 tiles but the layout has 7 \(2 × 3 \+ 1 "
                                         r"global view\)"):
        stitch(maps.new_zeros(6, 4, 4), TileLayout(2, 3, 6, (32, 32)))
    with pytest.raises(ValueError, match="global_index must be None or in"):
        TileLayout(2, 3, 7, (32, 32))
    with pytest.raises(ValueError, match="rows must be a positive int"):
        TileLayout(0, 3, None, (32, 32))
    with pytest.raises(TypeError, match="maps must be a tensor"):
        stitch(np.zeros((7, 4, 4)), TileLayout(2, 3, 6, (32, 32)))
    with pytest.raises(ValueError, match="mapping with rows, cols"):
        stitch(maps, {"rows": 2})


def test_tiles_of_a_square_split_need_no_rows_and_columns():
    """5 tiles can only be 2 × 2 + the global image; one tile is an image not split."""
    model = model_of()
    assert VLMAnswer(model, processed((5, 1)), ANSWER).layouts() == [
        TileLayout(2, 2, 4, (32, 32)), TileLayout(1, 1, None, (32, 32))]
    target = VLMAnswer(model, processed((5, 1)), ANSWER)
    assert dataclasses.replace(target.layouts()[0], crop=None).num_tiles == 5
