"""VLMAnswer: a vision-language model's answer explained on its vision
tower, on tiny random LLaVA (CLIP tower + Llama) and PaliGemma (SigLIP tower + Gemma)
models built from configs; ids are given, no tokenizer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from captum_vit.adapters import adapt
from captum_vit.methods.gradsam import GradSAM
from captum_vit.methods.scorecam import ScoreCAM
from captum_vit.methods.vanilla import AttnGrad
from captum_vit.registry import available_methods, build_method
from captum_vit.targets import VLMAnswer
from tests.helpers import assert_unchanged, snapshot

transformers = pytest.importorskip("transformers")

IMAGE = 299  # the image placeholder id
P = 16  # 32×32 images, 8×8 patches


def llava(layers: int = 3, **kw) -> torch.nn.Module:
    """A 3-layer CLIP tower (the default vision_feature_layer -2 then reads x_2, leaving
    two blocks to explain) and a 2-layer Llama."""
    torch.manual_seed(0)
    vc = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=layers, num_attention_heads=4,
                                       image_size=32, patch_size=8)
    tc = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=128)
    cfg = transformers.LlavaConfig(vision_config=vc, text_config=tc, image_token_id=IMAGE, **kw)
    return transformers.LlavaForConditionalGeneration(cfg).double().eval()


def paligemma() -> torch.nn.Module:
    """A 2-layer SigLIP tower without pooling head (as PaliGemma's) and a 2-layer Gemma;
    the image id is out of the vocabulary, as PaliGemma's processor's is not."""
    torch.manual_seed(0)
    cfg = transformers.PaliGemmaConfig(
        vision_config={"model_type": "siglip_vision_model", "hidden_size": 32,
                       "intermediate_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "image_size": 32, "patch_size": 8,
                       "vision_use_head": False},
        text_config={"model_type": "gemma", "vocab_size": 299, "hidden_size": 24,
                     "intermediate_size": 48, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 12},
        image_token_id=IMAGE, projection_dim=24, hidden_size=24, vocab_size=299)
    return transformers.PaliGemmaForConditionalGeneration(cfg).double().eval()


_MODELS: dict[str, torch.nn.Module] = {}


def model_of(family: str) -> torch.nn.Module:
    if family not in _MODELS:
        _MODELS[family] = llava() if family == "llava" else paligemma()
    return _MODELS[family]


def images(batch: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, 3, 32, 32, generator=g, dtype=torch.float64)


def prompt(*text: int, image_tokens: int = P) -> torch.Tensor:
    return torch.tensor([1, *[IMAGE] * image_tokens, *text])


def reference(model, pixels, ids, answer) -> torch.Tensor:
    """``Σ log_softmax`` of the model's own logits (its forward on the pixels) at the
    answer tokens, one image and prompt at a time: [B]."""
    out = []
    with torch.no_grad():
        for x, p, a in zip(pixels, ids, answer, strict=True):
            a = a[a != -100]
            seq = torch.cat([p, a])[None]
            kw = {"token_type_ids": torch.cat([torch.zeros_like(p), torch.ones_like(a)])[None]} \
                if "PaliGemma" in type(model).__name__ else {}
            logits = model(input_ids=seq, pixel_values=x[None], use_cache=False, **kw).logits
            logp = logits[0, -len(a) - 1:-1].log_softmax(-1)
            out.append(logp.gather(-1, a[:, None]).sum())
    return torch.stack(out)


def scores(model, pixels, target) -> torch.Tensor:
    """The target's columns ``[B, K]`` through the tower's adapter."""
    adapter = adapt(VLMAnswer.tower(model))
    with torch.no_grad(), adapter.targeting(target):
        return adapter.model_logits(pixels)


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-10) -> None:
    torch.testing.assert_close(a, b, rtol=tol, atol=tol * (1 + b.abs().max().item()))


@pytest.mark.parametrize("family", ["llava", "paligemma"])
def test_answer_log_probability_equals_the_models_own_forward(family):
    model = model_of(family)
    x = images()
    ids, answer = prompt(5, 7, 8), torch.tensor([11, 12, 13])
    got = scores(model, x, VLMAnswer(model, ids, answer))
    assert got.shape == (2, 1)
    close(got[:, 0], reference(model, x, ids.expand(2, -1), answer.expand(2, -1)))
    assert (got[0] != got[1]).all()  # the image matters


def test_llava_answer_equals_its_labels_loss():
    """``-loss × answer tokens`` of the model's own ``labels=`` loss (computed by
    transformers in float32)."""
    model = model_of("llava")
    x = images(1)
    ids, answer = prompt(5, 7), torch.tensor([11, 12, 13, 14])
    seq = torch.cat([ids, answer])[None]
    labels = torch.full_like(seq, -100)
    labels[:, -4:] = answer
    with torch.no_grad():
        loss = model(input_ids=seq, pixel_values=x, labels=labels, use_cache=False).loss
    got = scores(model, x, VLMAnswer(model, ids, answer))
    close(got[0, 0], (-4 * loss).to(got.dtype), tol=1e-6)


@pytest.mark.parametrize("family", ["llava", "paligemma"])
def test_per_image_prompts_give_one_column_per_prompt(family):
    """Every forward row is scored against every prompt; padded prompts (left, with the
    attention mask) and shorter answers (-100) are handled as the model's forward does."""
    model = model_of(family)
    x = images()
    ids = torch.stack([torch.cat([torch.tensor([0]), prompt(5, 7)]), prompt(9, 4, 3)])
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    answer = torch.tensor([[11, 12, 13], [21, 22, -100]])
    target = VLMAnswer(model, ids, answer, attention_mask=mask)
    got = scores(model, x, target)
    assert got.shape == (2, 2)
    assert target.index(2).tolist() == [0, 1] and target.index(4).tolist() == [0, 0, 1, 1]
    # column 1 (no padding) against the model's forward
    close(got[:, 1], reference(model, x, ids[1].expand(2, -1), answer[1].expand(2, -1)))
    # column 0: the same prompt without its padding token
    close(got[:, 0], reference(model, x, ids[0, 1:].expand(2, -1), answer[0].expand(2, -1)),
          tol=1e-9)


def test_a_repeated_prompt_is_one_column():
    """A processor's batch repeats the question for every image: one distinct prompt is one
    column (one language-model run per forward row), with the maps of the single prompt."""
    model = model_of("llava")
    x = images()
    ids, answer = prompt(5, 7), torch.tensor([11, 12])
    repeated = VLMAnswer(model, ids.expand(2, -1), answer.expand(2, -1))
    assert repeated.num_columns(0) == 1 and repeated.index(2).tolist() == [0, 0]
    tower = VLMAnswer.tower(model)
    close(build_method("gae", tower).attribute(x, target=repeated),
          build_method("gae", tower).attribute(x, target=VLMAnswer(model, ids, answer)))


def test_per_image_maps_equal_one_image_at_a_time():
    """A batch of 2 images with one prompt each gives each image the map of its own
    prompt (a gradient method and a perturbation method)."""
    model = model_of("llava")
    tower = VLMAnswer.tower(model)
    x = images()
    ids = torch.stack([prompt(5, 7), prompt(9, 4)])
    answer = torch.tensor([[11, 12], [21, 22]])
    both = VLMAnswer(model, ids, answer)
    for name, kw in (("gae", {}), ("vanilla_grad", {}), ("rise", {"n_masks": 8, "score": "logit"})):
        method = build_method(name, tower)
        maps = method.attribute(x, target=both, **kw)
        for i in range(2):
            one = method.attribute(x[i:i + 1], target=VLMAnswer(model, ids[i], answer[i]), **kw)
            close(maps[i:i + 1], one, tol=1e-9)


def test_feature_layer_lists_full_strategy_and_own_merge():
    """A list of feature layers (concatenated), the 'full' strategy (the class token
    kept; rows = all of them), and the merge into inputs_embeds (transformers 4's route)
    all equal the model's forward."""
    model = llava(vision_feature_layer=[-3, -1], vision_feature_select_strategy="full")
    x = images()
    ids, answer = prompt(5, 7, image_tokens=P + 1), torch.tensor([11, 12])
    target = VLMAnswer(model, ids, answer)
    assert target.blocks == (-3, -1) and target.rows == tuple(range(P + 1))
    want = reference(model, x, ids.expand(2, -1), answer.expand(2, -1))
    close(scores(model, x, target)[:, 0], want)
    target.parts = dataclasses.replace(target.parts, merge="embeds")
    close(scores(model, x, target)[:, 0], want)
    pg = model_of("paligemma")
    t = VLMAnswer(pg, prompt(5), torch.tensor([11]))
    want = scores(pg, x, t)
    t.parts = dataclasses.replace(t.parts, merge="embeds")
    close(scores(pg, x, t), want)


# Refused by the core for every target that reads token rows (TIS removes tokens; RISE
# and ViT-CX mask pixels instead) or, LLaVA's, an intermediate block (PLUS / FullGrad+ sum
# sub-networks ending at the model's output).
REFUSED = ("tis",)
REFUSED_BLOCKS = ("fullgrad_plus", "skip_fullgrad_plus", "plus:", "skipplus:")  # LLaVA only
FAST = {"tis": {"n_masks": 16}, "rise": {"n_masks": 16, "score": "logit"},
        "vit_cx": {"score": "logit"}, "bt_h": {"n_steps": 3, "start_layer": 1},
        "bt_t": {"n_steps": 3, "start_layer": 1}, "tam": {"n_steps": 3, "start_layer": 0}}


CASES = [(name, family) for family in ("llava", "paligemma")
         for name in available_methods(compositions=True, baselines=False)]


@pytest.mark.parametrize(("name", "family"), CASES)
def test_every_method_explains_the_answer_and_leaves_the_vlm_unchanged(name, family):
    model = model_of(family)
    tower = VLMAnswer.tower(model)
    x = images()
    target = VLMAnswer(model, prompt(5, 7), torch.tensor([11, 12]))
    before = snapshot(model)
    method = build_method(name, tower)
    refused = name in REFUSED or (family == "llava" and name.startswith(REFUSED_BLOCKS))
    if refused:
        with pytest.raises(ValueError, match="VLMAnswer"):
            method.attribute(x, target=target, **FAST.get(name, {}))
    else:
        maps = method.attribute(x, target=target, **FAST.get(name, {}))
        assert maps.shape == x.shape and torch.isfinite(maps).all()
        varies = maps.flatten(1).std(1) > 0
        # AttnGradCAM's ReLU(∇A ⊙ A) of one block is all zero on one image of this random
        # model (the method's own answer): the other image must still get a map
        assert varies.any() if name == "attn_gradcam" else varies.all(), f"{name}: constant"
    assert_unchanged(model, before)


@pytest.mark.parametrize(("cls", "explicit"), [
    (AttnGrad, {"layer": 1}), (GradSAM, {"layers": [0, 1]}), (ScoreCAM, {"layer": 1})])
def test_default_layers_end_at_the_block_the_answer_reads(cls, explicit):
    """LLaVA reads x_2 of the 3-block tower: a method's default last block (all blocks)
    is block 1 (blocks 0 and 1) under VLMAnswer, not the tower's last."""
    model = model_of("llava")
    tower = VLMAnswer.tower(model)
    target = VLMAnswer(model, prompt(5, 7), torch.tensor([11, 12]))
    got = cls(tower).attribute(images(), target=target)
    close(got, cls(tower, **explicit).attribute(images(), target=target))
    assert got.flatten(1).std(1).min() > 0


def test_clear_errors():
    model = model_of("llava")
    ids = prompt(5)
    with pytest.raises(ValueError, match="answer_ids is empty"):
        VLMAnswer(model, ids, torch.tensor([], dtype=torch.long))
    with pytest.raises(ValueError, match="answer_ids is empty"):
        VLMAnswer(model, ids, [-100, -100])
    with pytest.raises(ValueError, match="-100 may only pad the end"):
        VLMAnswer(model, ids, [-100, 4])
    with pytest.raises(TypeError, match="input_ids must be token ids"):
        VLMAnswer(model, ids.double(), [4])
    with pytest.raises(ValueError, match="once per image feature"):
        VLMAnswer(model, torch.tensor([1, 2, 3]), [4])
    with pytest.raises(ValueError, match="3 prompts and answer_ids 2 answers"):
        VLMAnswer(model, ids.expand(3, -1), [[4], [5]])
    with pytest.raises(TypeError, match="must be one of LlavaForConditionalGeneration"):
        VLMAnswer(VLMAnswer.tower(model), ids, [4])
    with pytest.raises(TypeError, match="must be one of"):
        VLMAnswer(torch.nn.Linear(2, 2), ids, [4])
    # a prompt made for another image size / the wrong model explained
    target = VLMAnswer(model, prompt(5, image_tokens=P - 1), [4])
    with pytest.raises(ValueError, match="explain VLMAnswer.tower"):
        scores(model, images(), target)
    other = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
        image_size=32, patch_size=8)).double().eval()
    with pytest.raises(ValueError, match="explain VLMAnswer.tower"):
        build_method("gae", other).attribute(images(), target=VLMAnswer(model, ids, [4]))


def test_a_processors_output_gives_the_prompts():
    """The mapping a processor returns: its input_ids and attention_mask are read; tiled
    images under pixel_key are refused."""
    model = model_of("llava")
    x = images()
    ids = prompt(5, 7)[None].expand(2, -1)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": x}
    answer = torch.tensor([11, 12])
    close(scores(model, x, VLMAnswer(model, batch, answer)),
          scores(model, x, VLMAnswer(model, ids, answer)), tol=0)
    with pytest.raises(ValueError, match="tiled images"):
        VLMAnswer(model, {**batch, "images": x[:, None]}, answer, pixel_key="images")
    with pytest.raises(ValueError, match="without 'input_ids'"):
        VLMAnswer(model, {"pixel_values": x}, answer)
    with pytest.raises(TypeError, match="pixel_key must be a str"):
        VLMAnswer(model, ids, answer, pixel_key=0)


def test_video_llava_next_is_refused_by_name():
    """LLaVA-NeXT's and LLaVA-OneVision's tiles are served
    (tests/families/test_hf_llava_onevision.py); its video model is refused by name."""
    vc = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       image_size=32, patch_size=8)
    tc = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=2)
    nxt = transformers.LlavaNextVideoForConditionalGeneration(transformers.LlavaNextVideoConfig(
        vision_config=vc, text_config=tc, image_token_id=IMAGE, video_token_id=298,
        image_grid_pinpoints=[[32, 32]]))
    with pytest.raises(TypeError, match="LlavaNextVideoForConditionalGeneration tiles each "):
        VLMAnswer(nxt, prompt(5), [4])


def test_paligemma_tower_without_head_is_adapted():
    """PaliGemma's SigLIP tower has no pooling head: the adapter reads its final-normed
    tokens (their patch mean stands for an embedding) and reproduces its forward."""
    tower = VLMAnswer.tower(model_of("paligemma"))
    adapter = adapt(tower)
    x = images()
    with torch.no_grad():
        want = tower(pixel_values=x).last_hidden_state.mean(1)
        close(adapter.run(adapter.embed(x)), want)
