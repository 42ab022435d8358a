"""InternVL (``InternVLVisionModel`` tower, ``InternVLForConditionalGeneration`` answers with
tiles) and Gemma 3 (SigLIP tower, ``Gemma3ForConditionalGeneration`` answers), and
``VLMAnswer(..., per_token=True)``, on tiny random float64 models built from configs; ids
are given, no tokenizer (SPEC_FRONTIER §14)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from captum_vit import CPLRP, AttnLRP, DecompX, EmbeddingTarget
from captum_vit.adapters import Ops, adapt
from captum_vit.adapters.catalog import example
from captum_vit.adapters.families.hf_internvl import HFInternVLAdapter, internvl_tower_example
from captum_vit.registry import available_methods, build_method
from captum_vit.targets import VLMAnswer
from captum_vit.targets.vlm import per_token_maps
from tests.helpers import (
    assert_close_scaled,
    assert_token_maps_sum,
    assert_unchanged,
    needs_transformers,
    snapshot,
)

pytestmark = needs_transformers
IMAGE = 299  # the image placeholder id
F = 4  # features per tile / image: 32 px, patch 8 -> 16 patches -> 4 (pixel shuffle or pool)
FAST = {"tis": {"n_masks": 16}, "rise": {"n_masks": 8, "score": "logit"},
        "vit_cx": {"score": "logit"}, "scorecam": {"score": "logit"},
        "bt_h": {"n_steps": 3, "start_layer": 1}, "bt_t": {"n_steps": 3, "start_layer": 1},
        "tam": {"n_steps": 3, "start_layer": 0}}
_MODELS: dict[str, nn.Module] = {}


def internvl(layer: int = -1, rms: bool = False) -> nn.Module:
    """The catalogue's tiny InternVL (a 3-block InternViT tower, 32 px, patch 8, LayerScale;
    a 2-layer Qwen2): the pixel shuffle makes 4 image features of a tile's 16 patches;
    ``rms``: InternViT-6B's RMSNorm blocks (``norm_type="rms_norm"``)."""
    key = f"internvl{layer}{rms}"
    if key not in _MODELS:
        vision = {"norm_type": "rms_norm"} if rms else None
        _MODELS[key] = _rms_weights(example("hf_internvl")[1].model(
            vision_feature_layer=layer, vision_overrides=vision))
    return _MODELS[key]


def gemma3() -> nn.Module:
    """The catalogue's tiny Gemma 3 (a SigLIP tower without head, 32 px, patch 8: 16 rows
    pooled 2×2 to 4; a 2-layer Gemma 3 with a sliding window of 4)."""
    if "gemma3" not in _MODELS:
        _MODELS["gemma3"] = example("hf_gemma3")[1].model(depth=2)
    return _MODELS["gemma3"]


def llava() -> nn.Module:
    if "llava" not in _MODELS:
        _MODELS["llava"] = example("hf_llava")[1].model()
    return _MODELS["llava"]


def images(batch: int = 2, size: tuple[int, int] = (32, 32), seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, *size, generator=g, dtype=torch.float64)


def prompt(*text: int, tiles: int = 2, per_tile: int = F) -> torch.Tensor:
    """``<s> (<img> IMG×per_tile </img>)×tiles text``: InternVL's ``<img>`` + image tokens of
    every tile + ``</img>``, here one block per tile (Gemma 3's crops)."""
    blocks = [t for _ in range(tiles) for t in (297, *[IMAGE] * per_tile, 298)]
    return torch.tensor([1, *blocks, *text])


def reference(model: nn.Module, pixels: torch.Tensor, ids: torch.Tensor,
              answer: torch.Tensor) -> torch.Tensor:
    """``Σ log_softmax`` of the model's own logits (its forward on all of a prompt's tiles)
    at the answer tokens."""
    seq = torch.cat([ids, answer])[None]
    kw = {"token_type_ids": (seq == IMAGE).long()} if "Gemma3" in type(model).__name__ else {}
    with torch.no_grad():
        logits = model(input_ids=seq, pixel_values=pixels, use_cache=False, **kw).logits
    return logits[0, -len(answer) - 1:-1].log_softmax(-1).gather(-1, answer[:, None]).sum()


def scores(model: nn.Module, pixels: torch.Tensor, target: VLMAnswer) -> torch.Tensor:
    """The target's columns ``[rows, K]`` through the tower's adapter (resolved first)."""
    ad = adapt(VLMAnswer.tower(model))
    t = target.resolve(ad, pixels)
    with torch.no_grad(), ad.targeting(t):
        return ad.model_logits(pixels)


def picked(model: nn.Module, pixels: torch.Tensor, target: VLMAnswer) -> torch.Tensor:
    """Each row's own column (``target.index``)."""
    ad = adapt(VLMAnswer.tower(model))
    t = target.resolve(ad, pixels)
    with torch.no_grad(), ad.targeting(t):
        cols = ad.model_logits(pixels)
    return cols.gather(1, t.index(pixels.shape[0])[:, None])[:, 0]


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-10) -> None:
    torch.testing.assert_close(a, b, rtol=tol, atol=tol * (1 + b.abs().max().item()))


# -- the tower ------------------------------------------------------------------------------
def rms_tower(qk_norm: bool = False, mean_pooling: bool = True) -> nn.Module:
    """The example tower with InternViT-6B's RMSNorm blocks (``norm_type="rms_norm"``), its
    norm weights drawn far from 1."""
    model = internvl_tower_example(qk_norm, mean_pooling)(norm_type="rms_norm")
    return _rms_weights(model)


def _rms_weights(model: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ == "InternVLVisionRMSNorm":
                m.weight.copy_(1 + 0.5 * torch.randn(m.weight.shape, generator=g,
                                                     dtype=m.weight.dtype))
    return model


@pytest.mark.parametrize("norm_type", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qknorm"])
@pytest.mark.parametrize("mean_pooling", [True, False], ids=["mean", "cls"])
def test_tower_forward_equals_the_models(qk_norm, mean_pooling, norm_type):
    """Every block's output is the model's ``hidden_states[l]`` and the embedding the
    patch mean (or the CLS row) of its ``last_hidden_state``, at the configured size and
    another one (the model's bicubic position interpolation); with LayerNorm or RMSNorm
    blocks (InternViT-6B's, computed in float32 as the model does)."""
    if norm_type == "rms_norm":
        model = rms_tower(qk_norm, mean_pooling)
    else:
        model = internvl_tower_example(qk_norm, mean_pooling)()
    ad = adapt(model)
    assert isinstance(ad, HFInternVLAdapter) and ad.num_prefix == 1 and ad.embedding
    rms = norm_type == "rms_norm"
    for b in ad.blocks:
        for norm in (b.norm1, b.norm2):
            assert norm.rms == rms
            assert norm.compute_dtype == (torch.float32 if rms else None)
    for size in ((32, 32), (24, 40)):
        x = images(size=size)
        with torch.no_grad():
            out = model(pixel_values=x, output_hidden_states=True)
            h = ad.embed(x)
            for l in range(3):
                h = ad.block(h, l, Ops())
                assert_close_scaled(h, out.hidden_states[l + 1])
            last = out.last_hidden_state
            want = last[:, 1:].mean(1) if mean_pooling else last[:, 0]
            assert_close_scaled(ad.run(ad.embed(x)), want)


def test_rms_norm_blocks_round_to_float32_as_the_model():
    """The parity above is not that of a float64 RMSNorm: the model's float32 rounding is
    ~1e-8 of the states, far above the 1e-12 the adapter matches."""
    model = rms_tower()
    ad = adapt(model)
    x = images()
    with torch.no_grad():
        want = model(pixel_values=x, output_hidden_states=True).hidden_states[1]
        h = ad.embed(x)
        exact = dataclasses.replace(ad.blocks[0], norm1=dataclasses.replace(
            ad.blocks[0].norm1, compute_dtype=None), norm2=dataclasses.replace(
            ad.blocks[0].norm2, compute_dtype=None))
        ad.blocks[0], kept = exact, ad.blocks[0]
        try:
            off = (ad.block(h, 0, Ops()) - want).abs().max().item()
        finally:
            ad.blocks[0] = kept
        assert_close_scaled(ad.block(h, 0, Ops()), want)
    assert off > 1e-10 * want.abs().max().item()


def test_other_norm_types_are_refused_by_name():
    model = internvl_tower_example()()
    model.config.norm_type = "batch_norm"
    with pytest.raises(TypeError, match="norm_type='batch_norm'"):
        adapt(model)


def _embedding_target(model: nn.Module, x: torch.Tensor) -> tuple[EmbeddingTarget, torch.Tensor]:
    """A dot-product target and its score from the model's own embedding."""
    g = torch.Generator().manual_seed(5)
    t = torch.randn(x.shape[0], 32, generator=g, dtype=torch.float64)
    with torch.no_grad():
        e = model(pixel_values=x).last_hidden_state[:, 1:].mean(1)
    return EmbeddingTarget(t, index=list(range(x.shape[0])), similarity="dot"), (e * t).sum(-1)


def test_rms_norm_tower_decompx_is_complete_and_lrp_conservative():
    """DecompX's tokens (CLS and patches) plus its bias source equal the score (both
    routes) through the float32-rounded RMSNorms; CP-LRP's and AttnLRP(attention="cp")'s
    patch relevance plus DecompX's CLS row and bias source are the score too."""
    model = rms_tower()
    x = images(size=(24, 40))
    spec, score = _embedding_target(model, x)
    for route in ("explicit", "gradient"):
        res = DecompX(model, route=route).decompose(x, spec)
        assert res.tokens.shape == (2, 16)  # CLS + 3 × 5 patches
        close(res.logit, score, 1e-12)
        close(res.tokens.sum(-1) + res.bias, score, 1e-10)
    for method in (CPLRP(model), AttnLRP(model, attention="cp")):
        patches = method.attribute(x, target=spec, output="tokens")
        close(patches.sum(-1) + res.tokens[:, 0] + res.bias, score, 1e-10)


def dinov2_twin(tower: nn.Module) -> nn.Module:
    """A ``Dinov2Model`` with the weights of an InternVL tower without qk-norm, LayerNorm
    blocks and ``use_mean_pooling=False`` (CLS after the final LayerNorm in both)."""
    import transformers

    cfg = tower.config
    twin = transformers.Dinov2Model(transformers.Dinov2Config(
        hidden_size=32, num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=4,
        mlp_ratio=2, image_size=32, patch_size=8, qkv_bias=True, layer_norm_eps=1e-6,
        layerscale_value=1.0, hidden_act=cfg.hidden_act)).double().eval()
    names = {"lambda_1": "layer_scale1.lambda1", "lambda_2": "layer_scale2.lambda1",
             "projection_layer": "o_proj", "layernorm_before": "norm1",
             "layernorm_after": "norm2"}
    sd = {}
    for k, v in tower.state_dict().items():
        for a, b in names.items():
            k = k.replace(a, b)
        sd[k] = v.detach().clone()
    missing, unexpected = twin.load_state_dict(sd, strict=False)
    assert missing == ["embeddings.mask_token"] and not unexpected
    return twin


_TWINS: list[tuple[nn.Module, nn.Module]] = []


def twins() -> tuple[nn.Module, nn.Module]:
    if not _TWINS:
        tower = internvl_tower_example(mean_pooling=False)()
        _TWINS.append((tower, dinov2_twin(tower)))
    return _TWINS[0]


def test_the_dinov2_twin_has_the_same_forward():
    tower, twin = twins()
    x = images()
    with torch.no_grad():
        assert_close_scaled(tower(pixel_values=x).last_hidden_state,
                            twin(pixel_values=x).last_hidden_state)


@pytest.mark.parametrize("name", available_methods(compositions=True))
def test_every_method_equals_the_dinov2_twin(name):
    """Every registered method gives the InternVL tower the maps of its DINOv2 twin (the
    same embedding target, token maps) and changes neither model."""
    tower, twin = twins()
    x = images()
    target = EmbeddingTarget(torch.randn(2, 32, generator=torch.Generator().manual_seed(3),
                                         dtype=torch.float64))
    before, before_twin = snapshot(tower), snapshot(twin)
    kw = dict(FAST.get(name, {}), output="tokens")
    kw.pop("score", None)
    ours = build_method(name, tower).attribute(x, target=target, **kw)
    ref = build_method(name, twin).attribute(x, target=target, **kw)
    assert torch.isfinite(ours).all()
    if name != "random":
        assert (ref.std(1) > 0).any()
    assert_close_scaled(ours, ref, rel=1e-10)
    assert_unchanged(tower, before)
    assert_unchanged(twin, before_twin)


# -- the answers ----------------------------------------------------------------------------
@pytest.mark.parametrize(("layer", "rms"), [(-1, False), (-2, False), (-1, True), (-2, True)])
def test_internvl_answer_with_tiles_equals_the_models_own_forward(layer, rms):
    """Two prompts of 2 tiles each (4 rows of pixel_values): each row's own column is the
    log-probability the model gives its prompt's answer with the prompt's 2 tiles; the
    feature layer may be an inner block (read there); LayerNorm or RMSNorm blocks."""
    model = internvl(layer, rms)
    x = images(4)
    ids = torch.stack([prompt(5, 7), prompt(9, 4)])
    answer = torch.tensor([[11, 12, 13], [21, 22, 23]])
    target = VLMAnswer(model, ids, answer)
    assert target.tiles == 2 and target.blocks == (None if layer == -1 else (layer,))
    got = picked(model, x, target)
    want = torch.stack([reference(model, x[:2], ids[0], answer[0]),
                        reference(model, x[2:], ids[1], answer[1])])
    close(got, want.repeat_interleave(2))
    assert scores(model, x, target).shape == (4, 4)  # one column per tile
    # one prompt for all: 2 images of 2 tiles
    one = VLMAnswer(model, ids[1], answer[1])
    close(picked(model, x, one), torch.stack([reference(model, x[:2], ids[1], answer[1]),
                                              reference(model, x[2:], ids[1], answer[1])
                                              ]).repeat_interleave(2))


@pytest.mark.parametrize("tiles", [1, 2])
def test_gemma3_answer_equals_the_models_own_forward(tiles):
    """Gemma 3: pooled, RMS-normed and projected features, the bidirectional attention
    among one image's tokens (token_type_ids); 2 tiles: an image and a crop, each its own
    image block."""
    model = gemma3()
    x = images(2)
    ids, answer = prompt(5, 7, tiles=tiles), torch.tensor([11, 12, 13])
    got = picked(model, x, VLMAnswer(model, ids, answer))
    if tiles == 1:
        want = torch.stack([reference(model, x[i:i + 1], ids, answer) for i in range(2)])
    else:
        want = reference(model, x, ids, answer).expand(2)
    close(got, want)
    assert got.std() > 0 or tiles == 2


def test_gemma3_tower_is_the_siglip_adapter():
    """Gemma 3's tower is a SigLIP vision model adapted by its family; its final-normed
    tokens are the model's last_hidden_state."""
    tower = VLMAnswer.tower(gemma3())
    ad = adapt(tower)
    assert type(ad).__name__ == "HFEmbeddingAdapter"
    x = images()
    with torch.no_grad():
        close(ad.run(ad.embed(x)), tower(pixel_values=x).last_hidden_state.mean(1))


REFUSED = ("tis",)
# Gemma 3's tower is a SigLIP vision model, explained by every method under PaliGemma
# (tests/families/test_hf_vlm.py): here one method of each kind through Gemma 3's answer
GEMMA3 = ("rollout", "gae", "token_ixg", "decompx", "attnlrp", "gradcam", "legrad", "rise",
          "vit_cx", "skipplus:decompx", "tis")
CASES = [(name, "internvl") for name in available_methods(compositions=True, baselines=False)]
CASES += [(name, "gemma3") for name in GEMMA3]
CASES += [(name, "internvl_rms") for name in available_methods(compositions=True,
                                                                 baselines=False)]


@pytest.mark.parametrize(("name", "family"), CASES)
def test_every_method_explains_the_answer_and_leaves_the_vlm_unchanged(name, family):
    """InternVL with 2 tiles (its final state), with LayerNorm or RMSNorm (InternViT-6B)
    blocks: every method; Gemma 3 with one image per prompt: one method of each kind."""
    model = gemma3() if family == "gemma3" else internvl(rms=family == "internvl_rms")
    tower = VLMAnswer.tower(model)
    x = images()
    target = VLMAnswer(model, prompt(5, 7, tiles=1 if family == "gemma3" else 2),
                       torch.tensor([11, 12]))
    before = snapshot(model)
    method = build_method(name, tower)
    if name in REFUSED:
        with pytest.raises(ValueError, match="VLMAnswer"):
            method.attribute(x, target=target, **FAST.get(name, {}))
    else:
        maps = method.attribute(x, target=target, **FAST.get(name, {}))
        assert maps.shape == x.shape and torch.isfinite(maps).all()
        varies = maps.flatten(1).std(1) > 0
        assert varies.any(), f"{name}: constant"
    assert_unchanged(model, before)


# -- one map per answer token ---------------------------------------------------------------
def _exact_rms_norm(self, x: torch.Tensor) -> torch.Tensor:
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) +
                                          self.variance_epsilon))


def exact_language_model(model: nn.Module) -> nn.Module:
    """``model`` with its language model's RMSNorms in float64: Llama's and Qwen2's compute
    in float32 whatever the input's dtype, so the gradients of the answer's tokens carry
    float32 rounding (~1e-7 of the scale) and their sum is not the whole answer's gradient
    to float64 precision. The rest of the model is as built."""
    import types

    for module in model.modules():
        if type(module).__name__ in ("LlamaRMSNorm", "Qwen2RMSNorm"):
            module.forward = types.MethodType(_exact_rms_norm, module)
    return model


@pytest.mark.parametrize("family", ["llava", "internvl"])
@pytest.mark.parametrize("name", ["token_ixg", "decompx", "attnlrp", "cp_lrp"])
def test_per_token_maps_sum_to_the_answers_map(name, family):
    """For a method linear in the score the maps of the answer's tokens add up to the whole
    answer's map; the whole answer is the default column and equals the plain target's."""
    model = exact_language_model(copy.deepcopy(llava() if family == "llava" else internvl()))
    tower = VLMAnswer.tower(model)
    x = images()
    ids = torch.tensor([1, *[IMAGE] * 16, 5, 7]) if family == "llava" else prompt(5, 7)
    answer = torch.tensor([11, 12, 13])
    assert_token_maps_sum(model, build_method(name, tower), x, ids, answer)


def test_per_token_columns_are_the_tokens_log_probabilities():
    model = internvl()
    x = images()
    ids, answer = prompt(5, 7), torch.tensor([11, 12, 13])
    target = VLMAnswer(model, ids, answer, per_token=True)
    cols = scores(model, x, target)  # [2 tiles, 2 tiles × (1 + 3)]
    assert cols.shape == (2, 8)
    seq = torch.cat([ids, answer])[None]
    with torch.no_grad():
        logp = model(input_ids=seq, pixel_values=x, use_cache=False).logits[0, -4:-1]
    want = logp.log_softmax(-1).gather(-1, answer[:, None])[:, 0]
    close(cols[0, 1:4], want)
    close(cols[1, 5:8], want)
    close(cols[0, 0], want.sum())


# -- bad input ------------------------------------------------------------------------------
def test_clear_errors_and_the_model_unchanged():
    model = internvl()
    before = snapshot(model)
    tower = VLMAnswer.tower(model)
    with pytest.raises(ValueError, match="image token"):
        VLMAnswer(model, torch.tensor([1, 5, 7]), [11])
    with pytest.raises(ValueError, match="answer_ids is empty"):
        VLMAnswer(model, prompt(5), torch.tensor([], dtype=torch.long))
    with pytest.raises(ValueError, match="input_ids: every prompt holds 6 image tokens"):
        VLMAnswer(model, prompt(5, tiles=1, per_tile=6), [11])
    target = VLMAnswer(model, prompt(5), [11])
    with pytest.raises(ValueError, match="pixel_values has 3 rows"):
        build_method("gae", tower).attribute(images(3), target=target)
    two = VLMAnswer(model, torch.stack([prompt(5), prompt(6)]), [11])
    with pytest.raises(ValueError, match="pixel_values has 2 rows"):
        build_method("token_ixg", tower).attribute(images(2), target=two)
    with pytest.raises(ValueError, match="explain VLMAnswer.tower"):  # tiles of another size
        build_method("token_ixg", tower).attribute(images(2, (24, 40)), target=target)
    with pytest.raises(ValueError, match="not resolved"):
        target.num_columns(0)
    with pytest.raises(ValueError, match="per_token=True"):
        target.token(0)
    with pytest.raises(TypeError, match="per_token must be a bool"):
        VLMAnswer(model, prompt(5), [11], per_token=1)
    with pytest.raises(TypeError, match="per_token=True"):
        per_token_maps(build_method("gae", tower), images(), target)
    assert_unchanged(model, before)
