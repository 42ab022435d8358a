"""Hugging Face VideoMAE (videos [B, T, C, H, W], tubelet tokens): the adapter's forward
equals the model's own; true token removal equals the model's own ``bool_masked_pos``
(kept tubelets keep their positions); a one-slice video is exactly a timm ViT without class
token on the sinusoid table, for every registered method; identical frames; the
removal metrics against a slow reference; clear errors; ``viz.plot_video``."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from timm.models.vision_transformer import VisionTransformer as TimmViT
from torch import nn

from captum_vit import CPLRP, GAE, RISE, AttnLRP, EmbeddingTarget
from captum_vit.adapters import HFVideoMAEAdapter, adapt
from captum_vit.metrics import (
    aopc,
    deletion,
    insertion,
    lodds,
    pointing_game,
    randomization,
    saco,
    sparseness,
)
from captum_vit.registry import available_methods, build_method
from tests.contract.test_contract import FAST
from tests.families._video import assert_one_slice_twin_maps
from tests.families._video import video as _video
from tests.helpers import (
    assert_close_scaled,
    assert_unchanged,
    make_inputs,
    make_video_model,
    needs_transformers,
    snapshot,
)

pytestmark = needs_transformers
METHODS = available_methods(compositions=True)
CONFIGS = {  # name -> (family, config overrides)
    "mean_t2": ("hf_videomae", {}),
    "token_t2": ("hf_videomae_token", {}),
    "mean_t1": ("hf_videomae", {"tubelet_size": 1}),
    "model_mean": ("hf_videomae_model", {}),
    "model_token": ("hf_videomae_model", {"use_mean_pooling": False}),
}


def _reference(model: nn.Module, x: torch.Tensor, mask: torch.Tensor | None = None):
    """The model's own output through its own modules: the logits, or for VideoMAEModel
    the pooled last hidden state (mean, or row 0 after its final LayerNorm)."""
    if hasattr(model, "classifier"):
        hidden = model.videomae(x, bool_masked_pos=mask).last_hidden_state
        pooled = hidden.mean(1) if model.fc_norm is not None else hidden[:, 0]
        if model.fc_norm is not None:
            pooled = model.fc_norm(pooled)
        return model.classifier(pooled)
    hidden = model(x, bool_masked_pos=mask).last_hidden_state
    return hidden.mean(1) if model.config.use_mean_pooling else hidden[:, 0]


@pytest.mark.parametrize("config", CONFIGS)
def test_forward_equals_the_models_own(config):
    family, overrides = CONFIGS[config]
    model = make_video_model(family, **overrides)
    ad = adapt(model)
    assert isinstance(ad, HFVideoMAEAdapter) and ad.video
    assert ad.embedding == (family == "hf_videomae_model")
    before = snapshot(model)
    x = _video()
    with torch.no_grad():
        ours = ad.run(ad.embed(x))
        own = model(pixel_values=x)
        ref = own.logits if hasattr(own, "logits") else _reference(model, x)
    assert_close_scaled(ours, ref, rel=1e-12)
    assert_close_scaled(ad.model_logits(x), ref, rel=1e-12)
    ad.self_check(x)
    t = int(model.config.tubelet_size)
    lay = ad.layout(x)
    assert (lay.frames, lay.tubelet, lay.frame_grid, lay.num_prefix) == (4 // t, t, (2, 2), 0)
    assert lay.num_patches == 4 // t * 4
    assert lay.readout == ("avg" if model.config.use_mean_pooling else "token")
    # the canonical parts: no key bias, the model's query / value biases
    blk, layer = ad.blocks[0], ad.layers[0].attention.attention
    assert blk.k_bias is None and blk.q_bias is layer.query.bias and blk.v_bias is layer.value.bias
    assert blk.ls1 is None and blk.ls2 is None
    assert_unchanged(model, before)


@pytest.mark.parametrize("config", ["mean_t2", "token_t2"])
def test_token_removal_keeps_positions_as_the_models_own_mask(config):
    """``run(x0, keep=...)`` equals the model's own ``bool_masked_pos`` forward (which keeps
    the visible tubelets with their own rows of the sinusoid table)."""
    family, overrides = CONFIGS[config]
    model = make_video_model(family, **overrides)
    ad = adapt(model)
    x = _video()
    g = torch.Generator().manual_seed(3)
    keep = torch.stack([torch.randperm(8, generator=g)[:5].sort().values for _ in range(2)])
    mask = torch.ones(2, 8, dtype=torch.bool).scatter(1, keep, False)  # True = masked
    with torch.no_grad():
        ours = ad.run(ad.embed(x), keep=keep)
        ref = _reference(model, x, mask)
    assert_close_scaled(ours, ref, rel=1e-12)


def _one_slice_model() -> nn.Module:
    """A VideoMAE of one frame slice (num_frames = tubelet_size = 1)."""
    return make_video_model("hf_videomae", num_frames=1, tubelet_size=1)


def timm_twin(vm: nn.Module) -> nn.Module:
    """A timm ViT without class token, mean pooling and fc_norm, holding a one-slice
    VideoMAE's weights: the sinusoid table as its position embedding, the key bias 0."""
    cfg = vm.config
    twin = TimmViT(img_size=16, patch_size=8, in_chans=3, embed_dim=32, depth=3, num_heads=4,
                   mlp_ratio=2.0, num_classes=5, qkv_bias=True, class_token=False,
                   global_pool="avg").to(torch.float64).eval()
    twin.fc_norm = nn.LayerNorm(32, eps=vm.fc_norm.eps).to(torch.float64)
    enc, emb = vm.videomae.encoder, vm.videomae.embeddings
    assert all(m.eps == cfg.layer_norm_eps for m in twin.blocks.modules()
               if isinstance(m, nn.LayerNorm))
    with torch.no_grad():
        twin.patch_embed.proj.weight.copy_(emb.patch_embeddings.projection.weight[:, :, 0])
        twin.patch_embed.proj.bias.copy_(emb.patch_embeddings.projection.bias)
        twin.pos_embed.copy_(emb.position_embeddings)
        for dst, src in [(twin.fc_norm, vm.fc_norm), (twin.head, vm.classifier)]:
            dst.weight.copy_(src.weight)
            dst.bias.copy_(src.bias)
        for blk, layer in zip(twin.blocks, enc.layer, strict=True):
            att = layer.attention.attention
            blk.attn.qkv.weight.copy_(torch.cat([att.query.weight, att.key.weight,
                                                 att.value.weight]))
            blk.attn.qkv.bias.copy_(torch.cat([att.query.bias, torch.zeros_like(att.query.bias),
                                               att.value.bias]))
            pairs = [(blk.attn.proj, layer.attention.output.dense),
                     (blk.norm1, layer.layernorm_before), (blk.norm2, layer.layernorm_after),
                     (blk.mlp.fc1, layer.intermediate.dense), (blk.mlp.fc2, layer.output.dense)]
            for dst, src in pairs:
                dst.weight.copy_(src.weight)
                dst.bias.copy_(src.bias)
    return twin


_ONE: dict[str, nn.Module] = {}


def _one_slice_pair() -> tuple[nn.Module, nn.Module]:
    if not _ONE:
        _ONE["vm"] = _one_slice_model()
        _ONE["twin"] = timm_twin(_ONE["vm"])
    return _ONE["vm"], _ONE["twin"]


def test_one_slice_video_is_the_timm_twin():
    vm, twin = _one_slice_pair()
    x = _video(frames=1)
    assert_close_scaled(vm(pixel_values=x).logits, twin(x[:, 0]), rel=1e-12)


@pytest.mark.parametrize("name", METHODS)
def test_one_slice_video_gets_the_timm_twins_maps(name):
    """A video of one frame slice (T = t = 1) is an image: VideoMAE is then exactly a ViT
    without class token on the sinusoid table, so every registered method (compositions
    included, same seeds) gives the twin's maps of the frame (<= 1e-10 of the map's
    largest magnitude, of the logits' for a rounding-sized map). RISE and ViT-CX mask
    tubelets on videos (true token removal), so the twin runs them with
    ``removal="tokens"``."""
    vm, twin = _one_slice_pair()
    assert_one_slice_twin_maps(name, vm, twin, lambda x: twin(x))


_HEADLESS: dict[str, nn.Module] = {}


def _headless_pair() -> tuple[nn.Module, nn.Module]:
    """A classifier with a bias-free head and the same model built with ``num_labels=0``
    (an ``nn.Identity`` classifier: its output is ``fc_norm`` of the token mean)."""
    if not _HEADLESS:
        clf = make_video_model("hf_videomae")
        with torch.no_grad():
            clf.classifier.bias.zero_()
        emb = make_video_model("hf_videomae", num_classes=0)
        state = {k: v for k, v in clf.state_dict().items() if not k.startswith("classifier")}
        emb.load_state_dict(state)
        _HEADLESS.update(clf=clf, emb=emb)
    return _HEADLESS["clf"], _HEADLESS["emb"]


@pytest.mark.parametrize("name", METHODS)
def test_embedding_output_with_vector_targets_gives_the_classifiers_maps(name):
    """A VideoMAE without classifier outputs its pooled vector and takes vector targets:
    the classifier's weight rows as targets (dot product) give the classifier's maps."""
    clf, emb = _headless_pair()
    assert adapt(emb).embedding and not adapt(clf).embedding
    x = make_inputs("hf_videomae", batch=2)
    kw = FAST.get(name, {})
    target = EmbeddingTarget(clf.classifier.weight.detach(), index=[1, 3], similarity="dot")
    ours = build_method(name, emb).attribute(x, target=target, output="tokens", **kw)
    ref = build_method(name, clf).attribute(x, target=[1, 3], output="tokens", **kw)
    scale = None if ref.abs().max() > 1e-10 else clf(pixel_values=x).logits.abs().max().item()
    assert_close_scaled(ours, ref, rel=1e-10, scale=scale, msg=name)


@pytest.mark.parametrize("method", [CPLRP, AttnLRP])
def test_lrp_to_the_pixels_of_a_video(method):
    """``at="pixels"``: the rules run through the tubelet projection (a Conv3d as a linear
    map); a one-slice video gets the timm twin's pixel relevance per patch, and on a
    4-frame video the relevance of each tubelet is its pixels' (all t frames)."""
    vm, twin = _one_slice_pair()
    x = _video(frames=1)
    ours = method(vm, at="pixels").attribute(x, target=[1, 3], output="tokens")
    ref = method(twin, at="pixels").attribute(x[:, 0], target=[1, 3], output="tokens")
    assert_close_scaled(ours, ref, rel=1e-10)
    model = make_video_model("hf_videomae")
    video = make_inputs("hf_videomae", batch=2)
    before = snapshot(model)
    pix = method(model, at="pixels").attribute(video, target=[1, 3], output="tokens")
    tok = method(model).attribute(video, target=[1, 3], output="tokens")
    assert pix.shape == tok.shape == (2, 8) and torch.isfinite(pix).all()
    assert_unchanged(model, before)


IDENTICAL_FRAME_METHODS = ("raw_attention", "rollout", "token_ixg")


@pytest.mark.parametrize("name", IDENTICAL_FRAME_METHODS)
def test_identical_frames_reduce_to_the_image_map_over_T(name):
    """T identical frames, tubelet 1. VideoMAE's sinusoid table is one table over the
    flattened (slice, row, column) index, so frame k's tokens carry positions k·P ... and
    the frames' tokens differ: no per-frame reduction holds for the model as built. With a
    table that repeats the one-frame table in every frame (set on a copy of the model, no
    longer VideoMAE's own), every frame's tokens are copies of the image's: each query
    attends to T copies of every key with 1/T of the image's weight, so every token state
    and the logits are the image model's; the mean-readout attention row, the rollout
    (the frame-mixing part (I - J/T) of each factor is orthogonal to the readout) and the
    token gradient (the T copies share the image's gradient) then give on every frame the
    image map divided by T. Methods that multiply such factors (GAE's gradient ⊙ attention
    plus the identity) are not proportional, and random-mask methods break the frames'
    symmetry: this test covers the three linear cases."""
    vm, _ = _one_slice_pair()
    frames = 3
    image = _video(frames=1)
    x = image.expand(-1, frames, -1, -1, -1).contiguous()
    # VideoMAE's own table: identical frames, tokens that differ by their table rows only
    own = make_video_model("hf_videomae", num_frames=frames, tubelet_size=1)
    x0 = adapt(own).embed(x)
    table = own.videomae.embeddings.position_embeddings[0].double()  # float32 values
    for k in range(1, frames):
        assert_close_scaled(x0[:, 4 * k:4 * k + 4] - x0[:, :4],
                            (table[4 * k:4 * k + 4] - table[:4]).expand(2, -1, -1),
                            rel=1e-12)
        assert (x0[:, 4 * k:4 * k + 4] - x0[:, :4]).abs().max() > 0.1
    video = copy.deepcopy(vm)
    video.config.num_frames = frames
    emb = video.videomae.embeddings
    emb.position_embeddings = vm.videomae.embeddings.position_embeddings.repeat(1, frames, 1)
    emb.patch_embeddings.num_patches *= frames
    with torch.no_grad():
        assert_close_scaled(video(pixel_values=x).logits, vm(pixel_values=image).logits,
                            rel=1e-12)
    ours = build_method(name, video).attribute(x, target=[1, 3], output="grid")
    ref = build_method(name, vm).attribute(image, target=[1, 3], output="grid")
    assert ours.shape == (2, 1, frames, 2, 2) and ref.shape == (2, 1, 1, 2, 2)
    for k in range(frames):
        assert_close_scaled(ours[:, :, k] * frames, ref[:, :, 0], rel=1e-10, msg=name)


def test_pixel_maps_copy_each_tubelet_to_its_frames_and_pixels():
    model = make_video_model("hf_videomae")
    x = make_inputs("hf_videomae", batch=2)
    tokens = GAE(model).attribute(x, target=[0, 1], output="tokens")
    grid = GAE(model).attribute(x, target=[0, 1], output="grid")
    pixels = GAE(model).attribute(x, target=[0, 1])
    assert grid.shape == (2, 1, 2, 2, 2) and pixels.shape == x.shape
    for b in range(2):
        for f in range(2):
            for i in range(2):
                for j in range(2):
                    tube = pixels[b, 2 * f:2 * f + 2, :, 8 * i:8 * i + 8, 8 * j:8 * j + 8]
                    assert (tube == tokens[b, f * 4 + i * 2 + j]).all()
    per_head = GAE(model).attribute(x, target=[0, 1], heads="all")
    assert per_head.shape == (2, 4, 4, 16, 16)  # [B, T, heads, H, W]


# -- metrics ------------------------------------------------------------------------------
def _slow_curve(model, x, scores, target, removal, mode, n_steps):
    """Probability of the target after removing (deleting or keeping) the top patches,
    step by step, one video and one subset at a time, through the model's own forward
    (token removal: its ``bool_masked_pos``; pixel baselines: the tubelet's frames and
    pixels replaced in a loop)."""
    b, p = scores.shape
    t, ph = int(model.config.tubelet_size), 8
    gw = x.shape[-1] // ph
    per_slice = (x.shape[-2] // ph) * gw
    curves = torch.zeros(b, n_steps + 1, dtype=torch.float64)
    for i in range(b):
        order = torch.argsort(scores[i], descending=True, stable=True)
        fill = torch.zeros_like(x[i]) if removal == "black" else \
            x[i].mean((0, 2, 3), keepdim=True).expand_as(x[i])
        for s in range(n_steps + 1):
            count = round(s / n_steps * p)
            chosen = set(order[:count].tolist())
            removed = chosen if mode == "delete" else set(range(p)) - chosen
            with torch.no_grad():
                if removal == "token":
                    if len(removed) == p:  # no token left: logits 0 (uniform)
                        curves[i, s] = 1 / 5
                        continue
                    mask = torch.zeros(1, p, dtype=torch.bool)
                    mask[0, sorted(removed)] = True
                    logits = _reference(model, x[i:i + 1], mask)
                else:
                    v = x[i].clone()
                    for k in removed:
                        f, r = divmod(k, per_slice)
                        r, c = divmod(r, gw)
                        sl = (slice(f * t, f * t + t), slice(None),
                              slice(r * ph, r * ph + ph), slice(c * ph, c * ph + ph))
                        v[sl] = fill[sl]
                    logits = model(pixel_values=v[None]).logits
            curves[i, s] = logits.softmax(-1)[0, target[i]]
    return curves


@pytest.mark.parametrize("removal", ["token", "black", "mean"])
@pytest.mark.parametrize("metric", [deletion, insertion])
def test_deletion_insertion_over_tubelets_match_a_slow_reference(metric, removal):
    model = make_video_model("hf_videomae")
    x = make_inputs("hf_videomae", batch=2)
    target = torch.tensor([1, 3])
    g = torch.Generator().manual_seed(5)
    scores = torch.randn(2, 8, generator=g, dtype=torch.float64)
    before = snapshot(model)
    res = metric(model, x, scores, target=target, removal=removal, n_steps=4)
    mode = "delete" if metric is deletion else "insert"
    ref = _slow_curve(model, x, scores, target, removal, mode, 4)
    assert_close_scaled(res.curves, ref, rel=1e-12)
    # frame maps shaped like the video are pooled per tubelet (|a| over frames, pixels)
    pixels = GAE(model).attribute(x, target=target)
    tokens = GAE(model).attribute(x, target=target, output="tokens")
    res_pix = metric(model, x, pixels, target=target, removal=removal, n_steps=4)
    res_tok = metric(model, x, tokens.abs(), target=target, removal=removal, n_steps=4)
    assert_close_scaled(res_pix.curves, res_tok.curves, rel=1e-12)
    assert_unchanged(model, before)


def test_other_metrics_run_on_videos():
    model = make_video_model("hf_videomae")
    x = make_inputs("hf_videomae", batch=2)
    before = snapshot(model)
    for res in (aopc(model, x, GAE(model), target=[0, 1]),
                lodds(model, x, GAE(model), target=[0, 1]),
                saco(model, x, GAE(model), target=[0, 1], n_groups=4),
                sparseness(model, x, GAE(model), target=[0, 1]),
                randomization(model, x, GAE, target=[0, 1])):
        assert np.isfinite(res.value)
    assert_unchanged(model, before)


# -- errors -------------------------------------------------------------------------------
def test_clear_errors():
    model = make_video_model("hf_videomae")
    x = make_inputs("hf_videomae", batch=2)
    before = snapshot(model)
    gae = GAE(model)
    with pytest.raises(ValueError, match=r"videos of shape \[B, T, C, H, W\].*unsqueeze"):
        gae.attribute(x[0], target=0)
    with pytest.raises(ValueError, match=r"videos of shape \[B, T, C, H, W\]"):
        gae.attribute(x[:, 0], target=0)
    with pytest.raises(ValueError, match="num_frames=4"):
        gae.attribute(x[:, :2], target=0)
    with pytest.raises(ValueError, match="image_size"):
        gae.attribute(x[..., :8, :8], target=0)
    with pytest.raises(ValueError, match="channel"):
        gae.attribute(x[:, :, :2], target=0)
    with pytest.raises(ValueError, match="removal='tokens'"):
        RISE(model).attribute(x, target=0, removal="pixels", n_masks=4)
    with pytest.raises(ValueError, match="unit='patch'"):
        deletion(model, x, GAE(model), target=[0, 1], removal="black", unit="pixel")
    with pytest.raises(ValueError, match="localisation metrics take images"):
        pointing_game(model, x, GAE(model), torch.ones(2, 16, 16, dtype=torch.bool))
    assert_unchanged(model, before)


def test_rise_masks_tubelets_by_default():
    model = make_video_model("hf_videomae")
    x = make_inputs("hf_videomae", batch=2)
    a = RISE(model).attribute(x, target=[0, 1], n_masks=8, output="tokens")
    b = RISE(model).attribute(x, target=[0, 1], n_masks=8, removal="tokens",
                              output="tokens")
    assert torch.equal(a, b) and np.isfinite(a.numpy()).all()


# -- plots --------------------------------------------------------------------------------
def test_plot_video_writes_a_gif_with_one_image_per_frame(tmp_path):
    from PIL import Image

    from captum_vit.viz import plot_video

    model = make_video_model("hf_videomae")
    x = make_inputs("hf_videomae", batch=2)
    pixels = GAE(model).attribute(x, target=[0, 1])
    grid = GAE(model).attribute(x, target=[0, 1], output="grid")
    for i, maps in enumerate((pixels[0], grid[0])):
        path = tmp_path / f"gae{i}.gif"
        plot_video(x[0], maps, path=str(path), fps=4, title="GAE")
        with Image.open(path) as gif:
            assert gif.format == "GIF" and gif.n_frames == x.shape[1]
            assert gif.info["duration"] == 250  # 4 frames per second
    with pytest.raises(ValueError, match=r"\.gif or \.mp4"):
        plot_video(x[0], pixels[0], path=str(tmp_path / "gae.avi"))
    with pytest.raises(ValueError, match="one map per frame"):
        plot_video(x[0], pixels[0, :3])
    with pytest.raises(ValueError, match="fps"):
        plot_video(x[0], pixels[0], fps=0)
