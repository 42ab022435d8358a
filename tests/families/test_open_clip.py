"""OpenCLIP image towers: the adapter's forward equals ``encode_image`` (CLS and mean pooling,
GELU and QuickGELU, LayerScale, ``final_ln_after_pool``, without ``ln_pre`` or ``proj``, on
``nn.MultiheadAttention``'s fused inference path too); a timm ``VisionTransformer`` holding
the tower's weights, whose logit 0 is ``⟨e, t⟩``, gets the tower's maps for
``EmbeddingTarget(t, similarity="dot")`` from every method; text prompts become targets
(:func:`captum_vit.targets.clip_text_target`, OpenCLIP and Hugging Face); ``--model
open_clip:ARCH[:PATH]`` loads local weights only; what is not supported is refused by name."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from timm.layers import QuickGELU
from timm.models.vision_transformer import VisionTransformer as TimmViT
from torch import nn

from captum_vit import GAE, DecompX, EmbeddingTarget
from captum_vit.adapters import OpenCLIPAdapter, Ops, adapt
from captum_vit.registry import available_methods, build_method
from captum_vit.targets import clip_text_target
from tests.contract.test_contract import FAST
from tests.helpers import (
    assert_close_scaled,
    assert_unchanged,
    make_inputs,
    make_open_clip_model,
    needs_open_clip,
    needs_transformers,
    snapshot,
)

pytestmark = [needs_open_clip, pytest.mark.lower_bounds]
METHODS = available_methods(compositions=True)
FAMILIES = ("open_clip", "open_clip_avg", "open_clip_coca")
_MODELS: dict[str, nn.Module] = {}


def oc_model(family: str) -> nn.Module:
    """One small random model per family for the module (calls never change it; the tests
    check that)."""
    if family not in _MODELS:
        _MODELS[family] = make_open_clip_model(family)
    return _MODELS[family]


def tower(model: nn.Module) -> nn.Module:
    return getattr(model, "visual", model)


def encode(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model.encode_image(x) if hasattr(model, "encode_image") else model(x)


VARIANTS = {  # vision-config overrides beyond the family's, and quick_gelu via the family
    "tok_gelu": ("open_clip", {}),
    "avg_quickgelu_layerscale": ("open_clip_avg", {}),
    "tok_layerscale_no_ln_pre": ("open_clip", {"ls_init_value": 0.5, "no_ln_pre": True}),
    "avg_ln_before_pool_sincos": ("open_clip_avg", {"final_ln_after_pool": False,
                                                    "pos_embed_type": "sin_cos_2d"}),
    "tok_output_tokens": ("open_clip_avg", {"pool_type": "tok", "output_tokens": True}),
    "coca_attention_pool": ("open_clip_coca", {"output_tokens": True}),
    # a pool narrower than the tower: separate q/k/v projections (kdim = width)
    "coca_separate_projections": ("open_clip_coca", {"embed_dim": 16}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_adapter_forward_equals_encode_image(variant, monkeypatch):
    family, overrides = VARIANTS[variant]
    model = make_open_clip_model(family, **overrides)
    fused = []
    native = torch._native_multi_head_attention

    def counted(*args, **kwargs):
        fused.append(1)
        return native(*args, **kwargs)

    monkeypatch.setattr(torch, "_native_multi_head_attention", counted)
    ad = adapt(model)
    assert isinstance(ad, OpenCLIPAdapter) and ad.embedding
    before = snapshot(model)
    x = make_inputs(family, batch=3)
    ours = ad.run(ad.embed(x))
    slow = encode(model, x)  # with grad: nn.MultiheadAttention's plain path
    slow = slow[0] if isinstance(slow, tuple) else slow
    with torch.no_grad():  # eval + no grad: it may take its fused path
        fast = encode(model, x)
        fast = fast[0] if isinstance(fast, tuple) else fast
    assert len(fused) in (0, 3)
    scale = slow.abs().max().item()
    assert slow.shape == (3, ad.num_classes)
    assert_close_scaled(ours, slow, rel=1e-12, scale=scale)
    assert_close_scaled(ours, fast, rel=1e-12, scale=scale)
    assert_close_scaled(ad.model_logits(x), slow, rel=1e-12, scale=scale)
    # the pixel-level route (the patch convolution as a linear map, ln_pre through ops)
    assert_close_scaled(ad.run(ad.embed(x, Ops())), slow, rel=1e-12, scale=scale)
    ad.self_check(x)
    visual = tower(model)
    lay = ad.layout(x)
    readout = "map" if visual.attn_pool is not None else \
        "token" if visual.pool_type == "tok" else "avg"
    assert (lay.grid, lay.patch_size, lay.num_prefix, lay.readout) == ((4, 4), (8, 8), 1,
                                                                       readout)
    assert ad.embedding_norms() == (() if overrides.get("no_ln_pre") else ("ln_pre",))
    assert (ad.blocks[0].ls1 is not None) == (visual.transformer.resblocks[0].ls_1.__class__
                                              .__name__ == "LayerScale")
    assert_unchanged(model, before)


def test_a_tower_without_projection_outputs_its_pooled_vector():
    model = make_open_clip_model("open_clip_avg")
    model.proj = None  # as prune_intermediate_layers(prune_head=True) leaves it
    ad = adapt(model)
    x = make_inputs("open_clip_avg", batch=2)
    ref = model(x)
    assert ref.shape == (2, 32) and ad.num_classes == 32
    assert_close_scaled(ad.run(ad.embed(x)), ref, rel=1e-12)
    assert_close_scaled(ad.run(ad.embed(x, Ops())), ref, rel=1e-12)


def timm_twin(model: nn.Module, t: torch.Tensor) -> nn.Module:
    """A timm ViT with the OpenCLIP tower's weights (timm's OpenCLIP layout:
    ``pre_norm=True``, so a bias-free patch embedding and ``norm_pre``) whose logit 0 is
    ``⟨e, t⟩``: its head row is ``proj t`` (logit 1 is 0).

    CoCa's attention pool becomes timm's ``global_pool='map'`` over every token
    (``pool_include_prefix``): its latent is the first query after ``ln_q``, ``norm`` is
    ``ln_k``, the pool's MLP adds zero (``fc2`` zeroed) and ``fc_norm`` is ``ln_post`` (a
    LayerNorm set after construction: timm builds ``fc_norm`` or ``norm``, not both)."""
    v = tower(model)
    coca = v.attn_pool is not None
    blk0 = v.transformer.resblocks[0]
    quick = type(blk0.mlp.gelu).__name__ == "QuickGELU"
    ls = blk0.ls_1.gamma if hasattr(blk0.ls_1, "gamma") else None
    after = v.final_ln_after_pool
    twin = TimmViT(
        img_size=32, patch_size=8, embed_dim=32, depth=len(v.transformer.resblocks),
        num_heads=4, mlp_ratio=2.0, num_classes=2, qkv_bias=True, pre_norm=True,
        global_pool="map" if coca else "token" if v.pool_type == "tok" else "avg",
        fc_norm=after, pool_include_prefix=coca,
        init_values=None if ls is None else 1.0, act_layer=QuickGELU if quick else nn.GELU,
        norm_layer=functools.partial(nn.LayerNorm, eps=v.ln_post.eps),
    ).double().eval()
    assert twin.patch_embed.proj.bias is None
    if coca:
        twin.fc_norm = nn.LayerNorm(32, eps=v.ln_post.eps).double()
    with torch.no_grad():
        twin.patch_embed.proj.weight.copy_(v.conv1.weight)
        twin.cls_token.copy_(v.class_embedding.reshape(1, 1, -1))
        twin.pos_embed.copy_(v.positional_embedding[None])
        twin.norm_pre.load_state_dict(v.ln_pre.state_dict())
        if coca:
            pool, mha = twin.attn_pool, v.attn_pool.attn
            pool.latent.copy_(v.attn_pool.ln_q(v.attn_pool.query)[:1][None])
            w, b = mha.in_proj_weight, mha.in_proj_bias
            pool.q.weight.copy_(w[:32])
            pool.q.bias.copy_(b[:32])
            pool.kv.weight.copy_(w[32:])
            pool.kv.bias.copy_(b[32:])
            pool.proj.load_state_dict(mha.out_proj.state_dict())
            pool.mlp.fc2.weight.zero_()
            pool.mlp.fc2.bias.zero_()
            twin.norm.load_state_dict(v.attn_pool.ln_k.state_dict())
        (twin.fc_norm if after or coca else twin.norm).load_state_dict(v.ln_post.state_dict())
        for blk, res in zip(twin.blocks, v.transformer.resblocks, strict=True):
            pairs = [(blk.norm1, res.ln_1), (blk.norm2, res.ln_2), (blk.attn.proj,
                     res.attn.out_proj), (blk.mlp.fc1, res.mlp.c_fc),
                     (blk.mlp.fc2, res.mlp.c_proj)]
            for dst, src in pairs:
                dst.load_state_dict(src.state_dict())
            blk.attn.qkv.weight.copy_(res.attn.in_proj_weight)
            blk.attn.qkv.bias.copy_(res.attn.in_proj_bias)
            if ls is not None:
                blk.ls1.gamma.copy_(res.ls_1.gamma)
                blk.ls2.gamma.copy_(res.ls_2.gamma)
        twin.head.weight.zero_()
        twin.head.weight[0] = v.proj @ t  # [width, D'] @ [D']
        twin.head.bias.zero_()
    return twin


def vector(model: nn.Module) -> torch.Tensor:
    return torch.randn(adapt(model).num_classes, generator=torch.Generator().manual_seed(3),
                       dtype=torch.float64)


@pytest.mark.parametrize("family", FAMILIES)
def test_timm_twin_has_the_embeddings_dot_product_as_logit(family):
    model = oc_model(family)
    t = vector(model)
    x = make_inputs(family, batch=2)
    assert_close_scaled(timm_twin(model, t)(x)[:, 0], encode(model, x) @ t, rel=1e-12)


# Chefer'21's α1β0 rule is not invariant to merging two linear maps: the twin's head row is
# the projection and the target vector in one map, OpenCLIP's are two (as for Hugging Face
# CLIP in test_embedding_targets).
NOT_MERGE_INVARIANT = {"chefer21"}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", METHODS)
def test_timm_twin_of_an_open_clip_tower_gets_identical_maps(name, family):
    """Every registered method (compositions included) gives the OpenCLIP model, explained
    for ``⟨e, t⟩``, the maps of the timm twin explained for its logit 0 (float64, <= 1e-10
    of each map's largest magnitude, or of the score's where the map is rounding-sized:
    plain gradients summed over the channels of a pre-normed embedding are zero), and
    leaves the model unchanged."""
    if name in NOT_MERGE_INVARIANT:
        pytest.skip("α1β0 LRP depends on how the head is split into linear maps")
    model = oc_model(family)
    t = vector(model)
    twin = timm_twin(model, t)
    x = make_inputs(family, batch=2)
    before = snapshot(model)
    kw = dict(FAST.get(name, {}))
    if name.endswith("tokentm"):  # its default for one vector is the score, not the sigmoid
        kw["score"] = "probability"
    ours = build_method(name, model).attribute(
        x, target=EmbeddingTarget(t, similarity="dot"), output="tokens", **kw)
    ref = build_method(name, twin).attribute(x, target=0, output="tokens", **kw)
    assert ours.shape == ref.shape == (2, 16)
    score = (encode(model, x) @ t).abs().max().item()
    assert_close_scaled(ours, ref, rel=1e-10, scale=score, msg=name)
    assert_unchanged(model, before)


def test_adapter_answers_and_refuses():
    import open_clip

    model = oc_model("open_clip")
    ad = adapt(model)
    assert adapt(model) is ad and adapt(model.visual) is not ad
    assert (ad.num_prefix, ad.readout, ad.num_classes, ad.num_blocks) == (1, "token", 16, 3)
    assert ad.input_shape == (3, (32, 32))
    v = model.visual
    every = [id(p) for stage in ad.parameter_stages() for p in stage]
    emb = {id(v.conv1.weight), id(v.class_embedding), id(v.positional_embedding),
           *(id(p) for p in v.ln_pre.parameters())}
    assert len(every) == len(set(every))
    assert set(every) | emb == {id(p) for p in v.parameters()} and not set(every) & emb
    q = ad.blocks[0].q_weight  # a view of the packed in-projection
    assert q.data_ptr() == v.transformer.resblocks[0].attn.in_proj_weight.data_ptr()

    with pytest.raises(ValueError, match="fixed image_size"):
        GAE(model).attribute(torch.randn(1, 3, 40, 40, dtype=torch.float64),
                             target=torch.ones(16, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"torch\.float32.*torch\.float64"):
        GAE(model).attribute(torch.randn(1, 3, 32, 32), target=torch.ones(16))
    dropout = make_open_clip_model("open_clip", patch_dropout=0.5).train()
    with pytest.raises(ValueError, match=r"model\.eval\(\)"):
        GAE(dropout).attribute(make_inputs("open_clip", batch=1),
                               target=torch.ones(16, dtype=torch.float64))

    def tiny(**vision):
        cfg = dict(image_size=32, patch_size=8, width=32, head_width=8, layers=1,
                   mlp_ratio=2.0)
        return open_clip.CLIP(16, {**cfg, **vision}, dict(
            context_length=8, vocab_size=100, width=32, heads=4, layers=1))

    with pytest.raises(TypeError, match="attentional_pool='parallel'.*contrastive"):
        adapt(tiny(attentional_pool="parallel", attn_pooler_queries=4, attn_pooler_heads=2))
    with pytest.raises(TypeError, match="pool_type='avg'.*mean over pooled queries"):
        adapt(tiny(attentional_pool=True, attn_pooler_queries=4, attn_pooler_heads=2,
                   pool_type="avg"))
    with pytest.raises(TypeError, match="pool_type='none'"):
        adapt(tiny(pool_type="none").visual)
    if "qk_norm" in open_clip.model.CLIPVisionCfg.__dataclass_fields__:  # OpenCLIP >= 3.0
        with pytest.raises(TypeError, match="CustomResidualAttentionBlock.*qk_norm"):
            adapt(tiny(qk_norm=True))
    with pytest.raises(TypeError, match="ModifiedResNet"):
        adapt(tiny(layers=(1, 1, 1, 1), width=8))
    with pytest.raises(TypeError, match=r"wraps a supported ViT at `model\[1\]`"):
        adapt(nn.Sequential(nn.Identity(), model))


def test_an_adapter_follows_the_model_through_to():
    """``model.to(dtype)`` replaces the in-projection and ``proj`` the views were read
    from."""
    model = make_open_clip_model("open_clip", dtype=torch.float32)
    t = torch.randn(16)
    GAE(model).attribute(make_inputs("open_clip", batch=1, dtype=torch.float32), target=t)
    model.double()
    x = make_inputs("open_clip", batch=2)
    ad = adapt(model)
    assert ad.blocks[0].q_weight.dtype == ad.head.heads[0][1].dtype == torch.float64
    assert_close_scaled(ad.run(ad.embed(x)), model.encode_image(x), rel=1e-12)


# -- text prompts ------------------------------------------------------------------------


def test_clip_text_target_of_an_open_clip_model():
    """OpenCLIP's own tokenizer (its vocabulary ships with the package) and
    ``encode_text``: the target's score is the model's image-to-text logit
    ``logit_scale.exp() · cos + logit_bias``, which DecompX decomposes completely."""
    import open_clip
    from open_clip.tokenizer import SimpleTokenizer

    model = make_open_clip_model("open_clip")
    with torch.no_grad():
        model.logit_bias = nn.Parameter(torch.tensor(-2.0, dtype=torch.float64))
    tokenizer = SimpleTokenizer(context_length=8)
    texts = ["a photo of a dog", "a cat", "a bird"]
    before = snapshot(model)
    target = clip_text_target(model, tokenizer, texts, index=[2, 0])
    text = model.encode_text(tokenizer(texts))
    assert_close_scaled(target.vectors, text, rel=1e-12)
    assert target.similarity == "cosine" and target.index == [2, 0]
    assert target.scale == pytest.approx(model.logit_scale.exp().item(), rel=1e-15)
    assert target.bias == -2.0 and not target.vectors.requires_grad
    x = make_inputs("open_clip", batch=2)
    image_logits, _ = model.get_logits(x, tokenizer(texts))
    ref = image_logits[torch.arange(2), torch.tensor([2, 0])]
    res = DecompX(model, route="explicit").decompose(x, target)
    assert_close_scaled(res.logit, ref.detach(), rel=1e-12)
    torch.testing.assert_close(res.tokens.sum(-1) + res.bias, ref.detach(), rtol=0,
                               atol=1e-10)
    # the tower alone is explained with the same target
    assert_close_scaled(DecompX(model.visual, route="explicit").decompose(x, target).logit,
                        res.logit, rel=1e-12)
    assert_unchanged(model, before)
    assert isinstance(open_clip.get_tokenizer("ViT-B-32"), SimpleTokenizer)  # no download

    with pytest.raises(TypeError, match="text side"):
        clip_text_target(model.visual, tokenizer, texts)
    with pytest.raises(TypeError, match="texts"):
        clip_text_target(model, tokenizer, [1, 2])
    with pytest.raises(TypeError, match="token ids"):
        clip_text_target(model, lambda texts: {"input_ids": None}, texts)


@needs_transformers
@pytest.mark.parametrize("kind", ["CLIP", "Siglip"])
def test_clip_text_target_of_a_hugging_face_model(kind):
    """``get_text_features`` on the tokenizer's ids; the temperature and SigLIP's bias
    become the target's scale and bias; SigLIP's text is padded to the full length."""
    import transformers

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, image_size=32, patch_size=8)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, vocab_size=100, bos_token_id=1, eos_token_id=2,
                max_position_embeddings=8)
    extra = {"projection_dim": 16} if kind == "CLIP" else {}
    cfg = getattr(transformers, f"{kind}Config")(text_config=text, vision_config=vision, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, f"{kind}Model")(cfg).double().eval()
    calls = []

    def tokenizer(*, text, padding, return_tensors):  # a stand-in for CLIPTokenizer
        calls.append(padding)
        ids = [[3 + (sum(map(ord, s)) + i) % 90 for i in range(len(s.split()) + 1)] + [2]
               for s in text]
        width = 8 if padding == "max_length" else max(map(len, ids))
        ids = [row + [0] * (width - len(row)) for row in ids]
        return {"input_ids": torch.tensor(ids), "attention_mask": (torch.tensor(ids) != 0
                                                                   ).long()}

    texts = ["a dog", "a small cat"]
    target = clip_text_target(model, tokenizer, texts)
    assert calls == ["max_length" if kind == "Siglip" else True]
    enc = tokenizer(text=texts, padding=calls[0], return_tensors="pt")
    ref = model.get_text_features(**enc)
    ref = ref if isinstance(ref, torch.Tensor) else ref.pooler_output
    assert_close_scaled(target.vectors, ref.detach(), rel=1e-12)
    assert target.scale == pytest.approx(model.logit_scale.exp().item(), rel=1e-15)
    bias = model.logit_bias.item() if kind == "Siglip" else 0.0
    assert target.bias == pytest.approx(bias, rel=1e-15) and target.index is None
    x = make_inputs("hf_clip", batch=2)
    maps = GAE(model).attribute(x, target=target, output="tokens")
    assert maps.shape == (2, 16) and torch.isfinite(maps).all()


# -- --model open_clip:ARCH[:PATH] ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_arch(tmp_path_factory):
    """A tiny OpenCLIP architecture registered from a config file, as
    ``open_clip.add_model_config`` allows."""
    import open_clip

    folder = tmp_path_factory.mktemp("open_clip_configs")
    cfg = {"embed_dim": 16,
           "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "head_width": 8,
                          "patch_size": 8, "mlp_ratio": 2.0},
           "text_cfg": {"context_length": 8, "vocab_size": 100, "width": 32, "heads": 4,
                        "layers": 1}}
    (folder / "captum-vit-tiny-clip.json").write_text(json.dumps(cfg))
    open_clip.add_model_config(folder)
    return "captum-vit-tiny-clip"


def test_load_model_builds_open_clip_architectures(tiny_arch, tmp_path):
    from safetensors.torch import save_file

    from captum_vit.models import load_model

    a = load_model(f"open_clip:{tiny_arch}", seed=1)
    b = load_model(f"open_clip:{tiny_arch}", seed=1)
    assert a.random_weights and isinstance(adapt(a.model), OpenCLIPAdapter)
    assert a.input_shape == (3, (32, 32)) and a.num_classes == 16
    assert not a.model.training and a.class_names is None
    assert torch.equal(a.model.visual.proj, b.model.visual.proj)
    assert not torch.equal(load_model(f"open_clip:{tiny_arch}", seed=2).model.visual.proj,
                           a.model.visual.proj)
    assert a.preprocess.mean == pytest.approx((0.48145466, 0.4578275, 0.40821073))
    state = a.model.state_dict()
    torch.save(state, tmp_path / "w.pt")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "w.safetensors"))
    for name in ("w.pt", "w.safetensors"):
        c = load_model(f"open_clip:{tiny_arch}:{tmp_path / name}", seed=7)
        assert not c.random_weights
        assert all(torch.equal(v, c.model.state_dict()[k]) for k, v in state.items())

    with pytest.raises(ValueError, match="unknown architecture 'nope'.*list_models"):
        load_model("open_clip:nope")
    with pytest.raises(ValueError, match="state dict file"):
        load_model(f"open_clip:{tiny_arch}:weights.npy")
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_model(f"open_clip:{tiny_arch}:{tmp_path / 'missing.pt'}")
    with pytest.raises(ValueError, match="no pretrained tag"):
        load_model(f"open_clip:{tiny_arch}", pretrained=True)


def test_pretrained_open_clip_weights_come_from_the_local_cache_only(tmp_path, monkeypatch):
    import huggingface_hub.constants as hf_constants

    from captum_vit.models import cached_open_clip_weights, load_model

    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with pytest.raises(FileNotFoundError, match="not in the local cache") as err:
        load_model("open_clip:ViT-B-32:openai", pretrained=True)
    msg = str(err.value)
    assert str(tmp_path / "hf") in msg and str(tmp_path / "home" / ".cache" / "clip") in msg
    assert "nothing is downloaded" in msg
    with pytest.raises(ValueError, match="no tag 'nope'"):
        cached_open_clip_weights("ViT-B-32", "nope")
    # a file where open_clip's URL download puts it is found (never fetched)
    clip_dir = tmp_path / "home" / ".cache" / "clip"
    clip_dir.mkdir(parents=True)
    (clip_dir / "ViT-B-32.pt").write_bytes(b"")
    import open_clip

    cfg = open_clip.get_pretrained_cfg("ViT-B-32", "openai")
    if cfg.get("url", "").endswith("ViT-B-32.pt"):
        path, tag_cfg = cached_open_clip_weights("ViT-B-32", "openai")
        assert path == str(clip_dir / "ViT-B-32.pt") and tag_cfg["mean"]


def test_a_coca_model_is_explained_through_its_unnormalised_image_embedding():
    """``CoCa.encode_image`` normalises by default; the adapter explains the embedding
    before it, and the text target's cosine makes the score the model's own logit."""
    from open_clip.coca_model import CoCa
    from open_clip.tokenizer import SimpleTokenizer

    text = dict(context_length=8, vocab_size=49408, width=32, heads=4, layers=1)
    torch.manual_seed(0)
    coca = CoCa(32, multimodal_cfg=text, text_cfg=dict(text, embed_cls=True, output_tokens=True),
                vision_cfg=dict(image_size=32, patch_size=8, width=32, head_width=8, layers=2,
                                mlp_ratio=2.0, attentional_pool=True, attn_pooler_queries=4,
                                attn_pooler_heads=4, output_tokens=True)).double().eval()
    with torch.no_grad():  # the text decoder's projection is left uninitialised (torch.empty)
        for p in coca.parameters():
            if not torch.isfinite(p).all():
                p.normal_(std=0.02)
    before = snapshot(coca)
    ad = adapt(coca)
    assert isinstance(ad, OpenCLIPAdapter) and ad.readout == "map"
    x = make_inputs("open_clip", batch=2)
    assert_close_scaled(ad.run(ad.embed(x)), coca.encode_image(x, normalize=False), rel=1e-12)
    tokenizer = SimpleTokenizer(context_length=8)
    texts = ["a dog", "a cat"]
    target = clip_text_target(coca, tokenizer, texts, index=[1, 0])
    ref = coca.logit_scale.exp() * (coca.encode_image(x) * coca.encode_text(
        tokenizer(texts))[[1, 0]]).sum(-1)
    res = DecompX(coca, route="explicit").decompose(x, target)
    assert_close_scaled(res.logit, ref.detach(), rel=1e-12)
    torch.testing.assert_close(res.tokens.sum(-1) + res.bias, ref.detach(), rtol=0,
                               atol=1e-10)
    assert_unchanged(coca, before)


def test_explain_command_with_an_open_clip_model(tiny_arch, tmp_path, capsys):
    import numpy as np

    from captum_vit.cli import main

    np.save(tmp_path / "classes.npy", np.random.default_rng(0).standard_normal((3, 16)))
    (tmp_path / "classes.txt").write_text("cat\ndog\nbird\n")
    out = tmp_path / "explain.png"
    args = ["explain", "--model", f"open_clip:{tiny_arch}", "--methods", "gae,decompx",
            "--target-embeddings", str(tmp_path / "classes.npy"), "--classes",
            str(tmp_path / "classes.txt"), "--embedding-scale", "100", "--out", str(out)]
    assert main(args) == 0 and out.stat().st_size > 0
    captured = capsys.readouterr()
    assert any(n in captured.out for n in ("cat", "dog", "bird"))
    assert "--pretrained" in captured.err  # the random-weight note names the fix


def test_the_coca_latent_follows_in_place_updates():
    """The pool's latent ``ln_q(query)`` is computed, not a view: it is recomputed at every
    entry point, so in-place updates (the randomisation metric's) reach it."""
    model = make_open_clip_model("open_clip_coca")
    ad = adapt(model)
    x = make_inputs("open_clip_coca", batch=2)
    with torch.no_grad():
        model.visual.attn_pool.query.mul_(-1.3)
        model.visual.attn_pool.ln_q.weight.add_(0.5)
    assert_close_scaled(ad.run(ad.embed(x)), model.encode_image(x, normalize=False),
                        rel=1e-12)
    stages = ad.parameter_stages()
    assert {id(p) for p in model.visual.attn_pool.parameters()} <= {id(p) for p in stages[0]}
