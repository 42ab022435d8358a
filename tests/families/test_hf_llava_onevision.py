"""LLaVA-OneVision (and LLaVA-NeXT, the same code path): VLMAnswer on its anyres tiles
(base image first, the crops of the best grid resolution, unpadding and image_newline by
the model's own pack_image_features), on tiny random models built from configs (a 2-block
SigLIP tower, 32 px crops, and a 2-layer Qwen2); ids are given, no tokenizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from captum_vit.adapters import adapt
from captum_vit.adapters.vlm_tiles import TileLayout
from captum_vit.registry import available_methods, build_method
from captum_vit.targets import VLMAnswer
from tests.helpers import assert_close_scaled, assert_unchanged, snapshot

transformers = pytest.importorskip("transformers")

IMAGE = 299
PINPOINTS = [[32, 32], [32, 64], [64, 32], [64, 64]]


def onevision(**overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    vc = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
              num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8,
              vision_use_head=False)
    tc = dict(model_type="qwen2", vocab_size=300, hidden_size=32, intermediate_size=64,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512)
    cfg = transformers.LlavaOnevisionConfig(vision_config=vc, text_config=tc,
                                            image_token_id=IMAGE,
                                            image_grid_pinpoints=PINPOINTS, **overrides)
    return transformers.LlavaOnevisionForConditionalGeneration(cfg).double().eval()


def llava_next() -> torch.nn.Module:
    """LLaVA-NeXT: the same tiles and packing (without OneVision's downsizing), here with
    a CLIP tower whose class token the "default" strategy drops."""
    torch.manual_seed(0)
    vc = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       image_size=32, patch_size=8)
    tc = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=512)
    cfg = transformers.LlavaNextConfig(vision_config=vc, text_config=tc, image_token_id=IMAGE,
                                       image_grid_pinpoints=PINPOINTS)
    return transformers.LlavaNextForConditionalGeneration(cfg).double().eval()


_MODELS: dict[str, torch.nn.Module] = {}


def model_of(kind: str = "full") -> torch.nn.Module:
    if kind not in _MODELS:
        # "small": anyres_max_1 makes pack_image_features downsize the crops' grid
        # (bilinear); "layers": two feature layers concatenated; "next": LLaVA-NeXT
        kw = {"full": {}, "small": {"vision_aspect_ratio": "anyres_max_1"},
              "layers": {"vision_feature_layer": [-2, -1]}, "next": {}}[kind]
        _MODELS[kind] = llava_next() if kind == "next" else onevision(**kw)
    return _MODELS[kind]


SIZES = torch.tensor([[40, 70], [50, 30]])  # 2 × 2 crops + base, 2 × 1 crops + base


def processed(model, sizes=SIZES) -> dict:
    """A processor's batch (random crops, zero padding crops), the prompts holding as many
    image tokens as the model packs (left padding)."""
    from transformers.models.llava_onevision.modeling_llava_onevision import (
        image_size_to_num_patches,
    )

    n = [image_size_to_num_patches(s.tolist(), PINPOINTS, 32) for s in sizes]
    g = torch.Generator().manual_seed(1)
    px = torch.randn(len(n), max(n), 3, 32, 32, generator=g, dtype=torch.float64)
    for i, k in enumerate(n):
        px[i, k:] = 0
    with torch.no_grad():
        feats = model.model.get_image_features(px, sizes).pooler_output
    prompts = [[1, 5 + i] + [IMAGE] * len(f) + [7, 8] for i, f in enumerate(feats)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(n), width, dtype=torch.long)
    am = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        am[i, width - len(p):] = 1
    return {"input_ids": ids, "attention_mask": am, "pixel_values": px,
            "image_sizes": sizes, "batch_num_images": torch.ones(len(n), dtype=torch.long)}


ANSWER = torch.tensor([11, 12, 13])


def own_log_probs(model, batch, pixels=None) -> torch.Tensor:
    px = batch["pixel_values"] if pixels is None else pixels
    out = []
    for i in range(px.shape[0]):
        seq = torch.cat([batch["input_ids"][i], ANSWER])[None]
        am = torch.cat([batch["attention_mask"][i], torch.ones_like(ANSWER)])[None]
        logits = model(input_ids=seq, attention_mask=am, pixel_values=px[i:i + 1],
                       image_sizes=batch["image_sizes"][i:i + 1], use_cache=False).logits
        out.append(logits[0, -len(ANSWER) - 1:-1].log_softmax(-1)
                   .gather(-1, ANSWER[:, None]).sum())
    return torch.stack(out)


def picked(model, target, x) -> torch.Tensor:
    adapter = adapt(VLMAnswer.tower(model))
    with adapter.targeting(target):
        cols = adapter.model_logits(x)
    return cols.gather(1, target.index(x.shape[0])[:, None].to(cols.device))[:, 0]


@pytest.mark.parametrize("kind", ["full", "small", "layers", "next"])
def test_answer_log_probability_and_its_gradient_equal_the_models_own(kind):
    """Every crop row scores the model's own answer log-probability of its prompt, and
    its gradient is the slice of the model's own gradient on that crop (the model's
    packing: base first, unpadding, newline, downsizing; a list of feature layers)."""
    model = model_of(kind)
    batch = processed(model)
    target = VLMAnswer(model, batch, ANSWER)
    assert target.num_columns(0) == 8 and target.index(8).tolist() == list(range(8))
    x = target.images().clone().requires_grad_(True)
    got = picked(model, target, x)
    px = batch["pixel_values"].clone().requires_grad_(True)
    want = own_log_probs(model, batch, pixels=px)
    assert_close_scaled(got.detach(), want.detach().repeat_interleave(torch.tensor([5, 3])),
                        1e-10)
    (gx,) = torch.autograd.grad(got.sum(), x)
    (gp,) = torch.autograd.grad(want.sum(), px)
    assert_close_scaled(gx, torch.cat([gp[0, :5], gp[1, :3]]), 1e-9)
    if kind == "layers":
        assert target.blocks == (-2, -1)
    if kind == "next":
        assert type(VLMAnswer.tower(model)).__name__ == "CLIPVisionModel"
        assert target.blocks == (-2,) and target.rows is None  # the class token dropped


FAST = {"tis": {"n_masks": 8}, "rise": {"n_masks": 8, "score": "logit"},
        "vit_cx": {"score": "logit"}, "bt_h": {"n_steps": 2, "start_layer": 1},
        "bt_t": {"n_steps": 2, "start_layer": 1}, "tam": {"n_steps": 2, "start_layer": 0},
        "scorecam": {"score": "logit"}}

# Refused by the core: TIS removes tokens (every target reading token rows), PLUS and
# FullGrad+ sum sub-networks ending at the model's output (the answer reads a block output,
# hidden_states[-1] before post_layernorm, as LLaVA's)
REFUSED_BLOCKS = ("fullgrad_plus", "skip_fullgrad_plus", "plus:", "skipplus:")


def test_every_method_explains_the_answer_on_crops_and_leaves_the_vlm_unchanged():
    model = model_of()
    batch = processed(model, torch.tensor([[30, 30]]))  # one crop and the base image
    target = VLMAnswer(model, batch, ANSWER[:2])
    assert target.images().shape[0] == 2
    tower = VLMAnswer.tower(model)
    x = target.images()
    before = snapshot(model)
    for name in available_methods(compositions=True, baselines=False):
        method = build_method(name, tower)
        if name == "tis" or name.startswith(REFUSED_BLOCKS):
            with pytest.raises(ValueError, match="VLMAnswer"):
                method.attribute(x, target=target, **FAST.get(name, {}))
            continue
        maps = method.attribute(x, target=target, **FAST.get(name, {}))
        assert maps.shape == x.shape and torch.isfinite(maps).all(), name
        assert (maps.flatten(1).std(1) > 0).any(), f"{name}: constant"
    assert_unchanged(model, before)


def test_bad_input_is_refused_by_name_and_leaves_the_vlm_unchanged():
    model = model_of()
    batch = processed(model)  # the model's own get_image_features (transformers 5 installs
    before = snapshot(model)  # its output-capturing hooks there): before the snapshot
    target = VLMAnswer(model, batch, ANSWER)
    with pytest.raises(ValueError, match="8 real tiles: explain target.images"):
        build_method("token_ixg", VLMAnswer.tower(model)).attribute(target.images()[:5],
                                                              target=target)
    with pytest.raises(ValueError, match="no image_sizes"):
        VLMAnswer(model, {k: v for k, v in batch.items() if k != "image_sizes"}, ANSWER)
    with pytest.raises(ValueError, match="image_sizes has 1 entries for 2 prompts"):
        VLMAnswer(model, dict(batch, image_sizes=SIZES[:1]), ANSWER)
    with pytest.raises(ValueError, match="pixel_values has 4 tiles per prompt but "
                                         "image_sizes"):
        VLMAnswer(model, dict(batch, pixel_values=batch["pixel_values"][:, :4]), ANSWER)
    with pytest.raises(ValueError, match="batch_num_images: prompts with several images"):
        VLMAnswer(model, dict(batch, batch_num_images=torch.tensor([2])), ANSWER)
    no_image = dict(batch, input_ids=batch["input_ids"].masked_fill(
        (batch["input_ids"] == IMAGE) & (torch.arange(2)[:, None] == 0), 3))
    with pytest.raises(ValueError, match="input_ids: prompt 0 holds no image token"):
        VLMAnswer(model, no_image, ANSWER)
    swapped = dict(batch, image_sizes=SIZES.flip(0), pixel_values=batch["pixel_values"])
    with pytest.raises(ValueError, match="input_ids: the prompts hold"):
        VLMAnswer(model, swapped, ANSWER)
    assert_unchanged(model, before)


def test_layouts_follow_the_processors_crops():
    """The image processor's own crops: the base image first, then the best resolution's
    crops in raster order, the resized image centred with padding: stitched back (the
    crops' pixels as maps), the layout's content crop holds the image and only it."""
    ip = transformers.LlavaOnevisionImageProcessor(
        size={"height": 32, "width": 32}, crop_size={"height": 32, "width": 32},
        image_grid_pinpoints=PINPOINTS, do_rescale=False, do_normalize=False)
    h, w = 40, 70
    y = np.linspace(0.25, 1.0, h, dtype=np.float32)[:, None].repeat(w, 1)
    xx = np.linspace(0.25, 1.0, w, dtype=np.float32)[None, :].repeat(h, 0)
    out = ip(images=[np.stack([y, xx, np.full_like(xx, 0.5)], -1)], return_tensors="pt")
    model = model_of()
    batch = processed(model, out["image_sizes"])
    batch["pixel_values"] = out["pixel_values"].double()
    target = VLMAnswer(model, batch, ANSWER)
    [layout] = target.layouts()
    assert layout == TileLayout(2, 2, 0, (32, 32), (13, 0, 37, 64))
    [(canvas, base)] = target.stitch(target.images())
    assert canvas.shape == (3, 37, 64) and base is not None and base.shape == (3, 32, 32)
    for img in (canvas, base):  # rows grow down, columns right, across the seams
        assert (img[0].diff(dim=0) >= -1e-6).all() and (img[1].diff(dim=1) >= -1e-6).all()
        assert img.min() > 0.2
    from captum_vit.viz import stitch

    full, _ = stitch(target.images(), TileLayout(2, 2, 0, (32, 32)))
    assert full[:, :13].abs().max() == 0 and full[:, 50:].abs().max() == 0  # the padding
