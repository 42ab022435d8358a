"""Shared test helpers: small random timm ViTs of every supported family, the parity
fixture, a reference attention capture through timm's own forward, and a snapshot of
everything an attribution call must leave unchanged."""

from __future__ import annotations

import copy
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from timm.models.beit import Beit
from timm.models.deit import VisionTransformerDistilled
from timm.models.eva import Eva
from timm.models.vision_transformer import VisionTransformer
from timm.models.vision_transformer_sam import VisionTransformerSAM
from torch import nn

FIXTURES = Path(__file__).parent / "fixtures"


def _have_fashion_mnist() -> bool:
    from captum_vit.data import load_fashion_mnist

    try:
        load_fashion_mnist("test")  # the loader's own root resolution (root, env, Debian)
    except FileNotFoundError:
        return False
    return True


needs_fashion_mnist = pytest.mark.skipif(
    not _have_fashion_mnist(), reason="Debian package dataset-fashion-mnist not installed")

# name -> (class, kwargs, input size (H, W))
FAMILIES: dict[str, tuple[type, dict, tuple[int, int]]] = {
    "vit": (VisionTransformer, {}, (32, 32)),
    "distilled": (VisionTransformerDistilled, {}, (32, 32)),
    "registers": (VisionTransformer, {"reg_tokens": 2}, (32, 32)),
    "avgpool": (VisionTransformer, {"class_token": False, "global_pool": "avg"}, (32, 32)),
    "layerscale": (VisionTransformer,
                   {"init_values": 0.5, "qk_norm": True, "no_embed_class": True}, (32, 32)),
    "nonsquare": (VisionTransformer, {"dynamic_img_size": True}, (24, 40)),
}


# Other timm families (contract suite and their own test files only; the per-method
# references above read timm VisionTransformer internals).
OTHER_FAMILIES: dict[str, tuple[type, dict, tuple[int, int]]] = {
    "beit": (Beit, {"use_rel_pos_bias": True, "use_abs_pos_emb": False, "global_pool": "avg",
                    "init_values": 0.5}, (32, 32)),
    "beit_shared_token": (Beit, {"use_shared_rel_pos_bias": True, "global_pool": "token"},
                          (32, 32)),
    "beit_swiglu": (Beit, {"use_rel_pos_bias": True, "swiglu_mlp": True, "scale_mlp": True,
                           "global_pool": "avg"}, (32, 32)),
    "eva02": (Eva, {"use_rot_pos_emb": True, "rope_type": "cat", "swiglu_mlp": True,
                    "scale_mlp": True, "scale_attn_inner": True, "global_pool": "avg"},
              (32, 32)),
    "eva_dinov3": (Eva, {"use_rot_pos_emb": True, "rope_type": "dinov3",
                         "rope_rotate_half": True, "rope_temperature": 100,
                         "use_abs_pos_emb": False, "num_reg_tokens": 4, "init_values": 1e-5,
                         "global_pool": "token", "use_fc_norm": False,
                         "dynamic_img_size": True}, (24, 40)),
}

# attention-pool heads (global_pool='map', SigLIP-style; SPEC_NEXT §7.3)
OTHER_FAMILIES.update({
    "map": (VisionTransformer, {"class_token": False, "global_pool": "map"}, (32, 32)),
    "map_cls_reg": (VisionTransformer, {"global_pool": "map", "reg_tokens": 2}, (32, 32)),
    "eva_map": (Eva, {"use_rot_pos_emb": True, "swiglu_mlp": True, "scale_attn_inner": True,
                      "global_pool": "map"}, (32, 32)),
})

# SAM's image encoder (timm VisionTransformerSAM: windowed blocks padded on a 5x5 grid,
# one global block, decomposed relative positions, the conv neck, a linear head)
OTHER_FAMILIES["timm_sam"] = (VisionTransformerSAM, {
    "window_size": 2, "global_attn_indexes": (1,), "use_rel_pos": True, "neck_chans": 16},
    (40, 40))

SAM_FAMILIES = ("timm_sam", "hf_sam")
"""SAM's image encoder (windowed attention): timm's classifier, Hugging Face's embedding."""

# timm models built with num_classes=0: they output the pooled embedding and take vector
# targets (SPEC_NEXT §7.5); not classifiers, so not in ALL_FAMILIES.
TIMM_EMBED_FAMILIES: dict[str, tuple[type, dict, tuple[int, int]]] = {
    "vit_headless": (VisionTransformer, {"num_classes": 0, "reg_tokens": 1}, (32, 32)),
    "eva_headless_map": (Eva, {"num_classes": 0, "use_rot_pos_emb": True, "swiglu_mlp": True,
                               "global_pool": "map"}, (32, 32)),
}
OTHER_FAMILIES.update(TIMM_EMBED_FAMILIES)

# Hugging Face transformers classifiers (optional extra): name -> (class name, config class
# name, config overrides, input size (H, W)); the DeiT one runs at a non-native size, so
# its position embeddings go through the model's own interpolation.
HF_FAMILIES: dict[str, tuple[str, str, dict, tuple[int, int]]] = {
    "hf_vit": ("ViTForImageClassification", "ViTConfig", {}, (32, 32)),
    "hf_deit_teacher": ("DeiTForImageClassificationWithTeacher", "DeiTConfig", {}, (24, 40)),
    "hf_dinov2": ("Dinov2ForImageClassification", "Dinov2Config", {"layerscale_value": 0.5},
                  (32, 32)),
    "hf_dinov2_reg": ("Dinov2WithRegistersForImageClassification",
                      "Dinov2WithRegistersConfig", {"num_register_tokens": 2}, (24, 40)),
    "hf_dinov2_swiglu": ("Dinov2ForImageClassification", "Dinov2Config",
                         {"use_swiglu_ffn": True}, (32, 32)),
    # CLIP / SigLIP classifiers: a vision config wrapped in the dual config ("_dual");
    # CLIP's at a non-native size (the tower's interpolated positions)
    "hf_clip_cls": ("CLIPForImageClassification", "CLIPVisionConfig",
                    {"_dual": "CLIPConfig"}, (24, 40)),
    "hf_siglip_cls": ("SiglipForImageClassification", "SiglipVisionConfig",
                      {"_dual": "SiglipConfig"}, (32, 32)),
    # BEiT: each layer's relative position bias, LayerScale, patch mean + pooler norm;
    # data2vec-vision: one shared bias, absolute positions, CLS after the final norm
    "hf_beit": ("BeitForImageClassification", "BeitConfig",
                {"use_relative_position_bias": True, "use_mean_pooling": True,
                 "layer_scale_init_value": 0.5}, (32, 32)),
    "hf_data2vec": ("Data2VecVisionForImageClassification", "Data2VecVisionConfig",
                    {"use_shared_relative_position_bias": True,
                     "use_absolute_position_embeddings": True, "use_mean_pooling": False,
                     "layer_scale_init_value": 0.0}, (32, 32)),
}


# Hugging Face vision towers that output an image embedding (targets are vectors,
# SPEC_NEXT §7.5); the contract runs over them with vector targets.
EMBED_FAMILIES: dict[str, tuple[str, str, dict, tuple[int, int]]] = {
    "hf_clip": ("CLIPVisionModelWithProjection", "CLIPVisionConfig", {"projection_dim": 16},
                (32, 32)),
    "hf_clip_noproj": ("CLIPVisionModel", "CLIPVisionConfig", {}, (24, 40)),
    "hf_siglip": ("SiglipVisionModel", "SiglipVisionConfig", {}, (32, 32)),
    # head-less backbones (SPEC_REACH §10.3): ViTModel's tanh pooler on CLS (at a
    # non-native size: interpolated positions), DINOv2's CLS after the norm, registers
    "hf_vit_model": ("ViTModel", "ViTConfig", {}, (24, 40)),
    "hf_deit_model": ("DeiTModel", "DeiTConfig", {}, (32, 32)),  # CLS + DIST, pooler on CLS
    "hf_dinov2_reg_model": ("Dinov2WithRegistersModel", "Dinov2WithRegistersConfig",
                            {"num_register_tokens": 2}, (32, 32)),
    # SAM's image encoder: windows of 3 padded on the 4x4 grid, a global block, decomposed
    # relative positions; the embedding is the grid mean of the neck's output
}
HF_FAMILIES.update(EMBED_FAMILIES)


def embedding_dim(model: nn.Module) -> int:
    """The image-embedding size of an EMBEDDING_FAMILIES model."""
    if type(model).__module__.startswith("open_clip."):
        visual = getattr(model, "visual", model)
        return int(visual.transformer.width if visual.proj is None else visual.proj.shape[1])
    if not hasattr(model, "config"):  # timm, num_classes=0
        return int(model.num_features)
    cfg = model.config
    if hasattr(cfg, "output_channels"):  # SAM: the neck's channels
        return int(cfg.output_channels)
    return int(getattr(cfg, "projection_dim", 0) if hasattr(model, "visual_projection")
               else cfg.hidden_size)


def have_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


needs_transformers = pytest.mark.skipif(not have_transformers(),
                                        reason="the hf extra (transformers) is not installed")
# torchvision's VisionTransformer (optional: torchvision is not a dependency): name ->
# (constructor overrides, input size (H, W)); the size is fixed by image_size.
TORCHVISION_FAMILIES: dict[str, tuple[dict, tuple[int, int]]] = {
    "torchvision": ({}, (32, 32)),
    "torchvision_representation": ({"representation_size": 7}, (32, 32)),  # pre_logits+Tanh
}


def have_torchvision() -> bool:
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return False
    return True


needs_torchvision = pytest.mark.skipif(not have_torchvision(),
                                       reason="torchvision is not installed")
# OpenCLIP image towers (optional extra openclip): name -> (VisionTransformer config
# overrides, quick_gelu, whether the test model is the dual open_clip.CLIP or its
# ``visual`` alone, input size (H, W)); the size is fixed by image_size. Embedding models.
OPEN_CLIP_FAMILIES: dict[str, tuple[dict, bool, bool, tuple[int, int]]] = {
    "open_clip": ({}, False, True, (32, 32)),  # CLS pooling, GELU, the dual model
    "open_clip_avg": ({"pool_type": "avg", "ls_init_value": 0.5, "final_ln_after_pool": True},
                      True, False, (32, 32)),  # mean pooling, LayerScale, QuickGELU, tower
    # CoCa's attention pool (4 learned queries, ln_q/ln_k, the first query read out); the
    # pool's width is the embedding's (embed_dim 32 = width: one packed in-projection)
    "open_clip_coca": ({"attentional_pool": True, "attn_pooler_queries": 4,
                        "attn_pooler_heads": 4, "embed_dim": 32}, False, True, (32, 32)),
}


def have_open_clip() -> bool:
    try:
        import open_clip  # noqa: F401
    except ImportError:
        return False
    return True


needs_open_clip = pytest.mark.skipif(not have_open_clip(),
                                     reason="the openclip extra (open_clip_torch) is not installed")
# Hugging Face VideoMAE (videos [B, T, C, H, W]): name -> (class name, config overrides,
# input size (T, H, W)); 2 frame slices of 2 x 2 tubelets (t = 2, p = 8).
VIDEO_FAMILIES: dict[str, tuple[str, dict, tuple[int, int, int]]] = {
    "hf_videomae": ("VideoMAEForVideoClassification", {"use_mean_pooling": True}, (4, 16, 16)),
}
HF_VIDEO_EXTRA: dict[str, tuple[str, dict, tuple[int, int, int]]] = {
    # first-tubelet readout after the final LayerNorm; the head-less backbone
    "hf_videomae_token": ("VideoMAEForVideoClassification", {"use_mean_pooling": False},
                          (4, 16, 16)),
    "hf_videomae_model": ("VideoMAEModel", {"use_mean_pooling": True}, (4, 16, 16)),
}


def make_video_model(family: str = "hf_videomae", *, seed: int = 0, depth: int = 3,
                     dtype: torch.dtype = torch.float64, num_classes: int = 5,
                     **overrides) -> nn.Module:
    """A small random Hugging Face VideoMAE of ``family`` (VIDEO_FAMILIES or
    HF_VIDEO_EXTRA; patch 8, width 32, 4 heads), eval mode; ``overrides`` go to the
    ``VideoMAEConfig`` (e.g. ``tubelet_size=1``)."""
    import transformers

    cls_name, extra, (frames, size, _) = {**VIDEO_FAMILIES, **HF_VIDEO_EXTRA}[family]
    kwargs = dict(image_size=size, patch_size=8, num_channels=3, num_frames=frames,
                  tubelet_size=2, hidden_size=32, num_hidden_layers=depth,
                  num_attention_heads=4, intermediate_size=64, num_labels=num_classes,
                  qv_bias=True, layer_norm_eps=1e-6)
    kwargs.update(extra)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(transformers.VideoMAEConfig(**kwargs))
    return randomize_(model, seed).to(dtype).eval()


# Swin (windowed attention, merges between stages): name -> (kwargs, input size); the
# 40-pixel one has a 10x10 grid (padded to whole windows of 3) and an odd 5x5 second stage
SWIN_FAMILIES: dict[str, tuple[dict, tuple[int, int]]] = {
    "timm_swin": ({"window_size": 2}, (32, 32)),
    "timm_swin_pad": ({"window_size": 3}, (40, 40)),
}
HF_SWIN_FAMILIES: dict[str, tuple[dict, tuple[int, int]]] = {
    "hf_swin": ({"window_size": 2}, (32, 32)),
    "hf_swin_pad": ({"window_size": 3}, (40, 40)),
}
"""Hugging Face Swin classifiers: the timm SWIN_FAMILIES' twins (weights mapped)."""


def hf_swin_twin(timm_model: nn.Module, *, pooled: bool = False) -> nn.Module:
    """The Hugging Face ``SwinForImageClassification`` (``pooled``: ``SwinModel``) with the
    weights of a timm ``SwinTransformer`` (same shapes, same dtype), eval mode."""
    import transformers

    m = timm_model
    depths = [len(st.blocks) for st in m.layers]
    cfg = transformers.SwinConfig(
        image_size=tuple(m.patch_embed.img_size), patch_size=m.patch_embed.patch_size[0],
        num_channels=m.patch_embed.proj.in_channels, embed_dim=m.embed_dim, depths=depths,
        num_heads=[st.blocks[0].attn.num_heads for st in m.layers],
        window_size=m.layers[0].blocks[0].attn.window_size[0],
        mlp_ratio=m.layers[0].blocks[0].mlp.fc1.out_features / m.embed_dim, qkv_bias=True,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0,
        use_absolute_embeddings=False, num_labels=m.num_classes, layer_norm_eps=1e-5)
    cls = transformers.SwinModel if pooled else transformers.SwinForImageClassification
    hf = cls(cfg).to(next(m.parameters()).dtype).eval()
    src = m.state_dict()
    pre = "" if pooled else "swin."
    out = {f"{pre}embeddings.patch_embeddings.projection.{k}": src[f"patch_embed.proj.{k}"]
           for k in ("weight", "bias")}
    out.update({f"{pre}embeddings.norm.{k}": src[f"patch_embed.norm.{k}"]
                for k in ("weight", "bias")})
    out.update({f"{pre}layernorm.{k}": src[f"norm.{k}"] for k in ("weight", "bias")})
    if not pooled:
        out.update({f"classifier.{k}": src[f"head.fc.{k}"] for k in ("weight", "bias")})
    for s, st in enumerate(m.layers):
        for j in range(len(st.blocks)):
            a, b = f"layers.{s}.blocks.{j}.", f"{pre}encoder.layers.{s}.blocks.{j}."
            for k in ("weight", "bias"):
                out[f"{b}layernorm_before.{k}"] = src[f"{a}norm1.{k}"]
                out[f"{b}layernorm_after.{k}"] = src[f"{a}norm2.{k}"]
                out[f"{b}mlp.fc1.{k}"] = src[f"{a}mlp.fc1.{k}"]
                out[f"{b}mlp.fc2.{k}"] = src[f"{a}mlp.fc2.{k}"]
                out[f"{b}attention.o_proj.{k}"] = src[f"{a}attn.proj.{k}"]
                for name, t in zip(("q", "k", "v"), src[f"{a}attn.qkv.{k}"].chunk(3),
                                   strict=True):
                    out[f"{b}attention.{name}_proj.{k}"] = t
            out[f"{b}attention.relative_position_bias.relative_position_bias_table"] = \
                src[f"{a}attn.relative_position_bias_table"]
        if s > 0:
            for k in ("reduction.weight", "norm.weight", "norm.bias"):
                out[f"{pre}encoder.layers.{s - 1}.downsample.{k}"] = \
                    src[f"layers.{s}.downsample.{k}"]
    missing, unexpected = hf.load_state_dict(out, strict=False)
    assert not unexpected and all("relative_position_index" in k for k in missing), \
        (missing, unexpected)
    return hf


ALL_FAMILIES = [*FAMILIES, *(f for f in OTHER_FAMILIES if f not in TIMM_EMBED_FAMILIES),
                *(f for f in HF_FAMILIES if f not in EMBED_FAMILIES), *TORCHVISION_FAMILIES,
                *VIDEO_FAMILIES, *SWIN_FAMILIES, *HF_SWIN_FAMILIES]
"""Every classifier family (timm ViT, other timm families, Hugging Face, torchvision,
Hugging Face VideoMAE on videos)."""
WINDOWED_FAMILIES = [*SWIN_FAMILIES, *HF_SWIN_FAMILIES, *SAM_FAMILIES]
"""The families with windowed attention (no true token removal, see WINDOW_REFUSERS)."""
TOKEN_FAMILIES = [f for f in ALL_FAMILIES if f not in WINDOWED_FAMILIES]
"""Every classifier family whose tokens can be removed (global attention)."""
EMBEDDING_FAMILIES = [*TIMM_EMBED_FAMILIES, *EMBED_FAMILIES, *OPEN_CLIP_FAMILIES]
"""Every family that outputs an image embedding (timm head-less, Hugging Face, OpenCLIP)."""

# SAM's image encoder in Hugging Face (windows of 3 padded on the 4x4 grid, a global block,
# decomposed relative positions; the embedding is the grid mean of the neck's output):
# not in the lists above: tests/test_sam.py runs the embedding contract over it
HF_FAMILIES["hf_sam"] = ("SamVisionModel", "SamVisionConfig",
                         {"window_size": 3, "global_attn_indexes": [1], "output_channels": 16,
                          "mlp_dim": 64}, (32, 32))


from captum_vit.registry import windowed_methods  # noqa: E402

WINDOW_REFUSERS = set(windowed_methods(refused=True))
"""Methods that refuse windowed models (Swin, SAM) by name: those declaring
``removes_tokens`` (TIS; use RISE or ViT-CX), read from the registry."""


def family_marks(family: str, method: str | None = None) -> tuple:
    """pytest marks of a family: Hugging Face ones skip without transformers, torchvision
    ones without torchvision; a method that refuses the family by name (``method`` in
    :data:`WINDOW_REFUSERS` on a Swin or SAM) is expected to raise its ValueError (strict:
    a test that passes anyway must not take this mark; pass no ``method`` and expect the
    refusal in the test)."""
    if family in SAM_FAMILIES and method in WINDOW_REFUSERS:  # windowed too
        return ((needs_transformers,) if family in HF_FAMILIES else ()) + (
            pytest.mark.xfail(raises=ValueError, strict=True,
                              reason=f"{method} refuses windowed models by name"),)
    if family in SWIN_FAMILIES or family in HF_SWIN_FAMILIES:
        marks: tuple = (needs_transformers,) if family in HF_SWIN_FAMILIES else ()
        if method in WINDOW_REFUSERS:
            marks += (pytest.mark.xfail(raises=ValueError, strict=True,
                                        reason=f"{method} refuses windowed models by name"),)
        return marks
    if family in TORCHVISION_FAMILIES:
        return (needs_torchvision,)
    if family in OPEN_CLIP_FAMILIES:
        return (needs_open_clip,)
    hf = family in HF_FAMILIES or family in VIDEO_FAMILIES or family in HF_VIDEO_EXTRA
    return (needs_transformers,) if hf else ()


def make_hf_model(family: str, *, seed: int = 0, depth: int = 3,
                  dtype: torch.dtype = torch.float64, num_classes: int = 5) -> nn.Module:
    """A small random Hugging Face classifier of ``family`` (see HF_FAMILIES), eval mode."""
    import transformers

    cls_name, cfg_name, extra, _ = HF_FAMILIES[family]
    extra = dict(extra)
    dual = extra.pop("_dual", None)
    cfg = getattr(transformers, cfg_name)(
        image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=depth,
        num_attention_heads=4, intermediate_size=64, num_labels=num_classes,
        layer_norm_eps=1e-6, **extra)
    if dual is not None:  # a classifier over the vision tower of a dual config
        cfg = getattr(transformers, dual)(vision_config=cfg.to_dict(), num_labels=num_classes)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(cfg)
    return randomize_(model, seed).to(dtype).eval()


def make_torchvision_model(family: str = "torchvision", *, seed: int = 0, depth: int = 3,
                           dtype: torch.dtype = torch.float64, num_classes: int = 5,
                           **overrides) -> nn.Module:
    """A small random torchvision ``VisionTransformer`` of ``family``
    (TORCHVISION_FAMILIES; 32x32 inputs, patch 8, width 16, 2 heads), eval mode.
    ``overrides`` go to the constructor (e.g. ``representation_size=7``)."""
    from torchvision.models import VisionTransformer as TorchvisionViT

    extra, (size, _) = TORCHVISION_FAMILIES[family]
    kwargs = dict(image_size=size, patch_size=8, num_layers=depth, num_heads=2,
                  hidden_dim=16, mlp_dim=32, num_classes=num_classes)
    kwargs.update(extra)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = randomize_(TorchvisionViT(**kwargs), seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # the names randomize_ does not know
        for name, p in model.named_parameters():
            if name.endswith("in_proj_weight"):  # q and k rows: sharper attention
                p[:2 * p.shape[1]] *= 1.5
            elif ".ln" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name in ("class_token", "encoder.pos_embedding"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return model.to(dtype).eval()


def make_open_clip_model(family: str = "open_clip", *, seed: int = 0, depth: int = 3,
                         dtype: torch.dtype = torch.float64, **overrides) -> nn.Module:
    """A small random OpenCLIP model of ``family`` (OPEN_CLIP_FAMILIES; 32x32 inputs, patch
    8, width 32, 4 heads, embedding 16 unless the family says, a one-block text tower with
    OpenCLIP's own vocabulary size), eval mode: the dual ``open_clip.CLIP`` or its
    ``visual`` tower. ``overrides`` go to the vision config (``embed_dim`` to the model)."""
    open_clip = pytest.importorskip("open_clip")
    extra, quick_gelu, dual, (size, _) = OPEN_CLIP_FAMILIES[family]
    vision = dict(image_size=size, patch_size=8, width=32, head_width=8, layers=depth,
                  mlp_ratio=2.0, embed_dim=16)
    vision.update(extra)
    vision.update(overrides)
    embed_dim = vision.pop("embed_dim")
    text = dict(context_length=8, vocab_size=49408, width=32, heads=4, layers=1)
    torch.manual_seed(seed)
    model = open_clip.CLIP(embed_dim=embed_dim, vision_cfg=vision, text_cfg=text,
                           quick_gelu=quick_gelu)
    logit_scale = model.logit_scale.detach().clone()
    model = randomize_(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # the names randomize_ does not know
        model.logit_scale.copy_(logit_scale)  # CLIP's initial temperature, 1/0.07
        for name, p in model.named_parameters():
            if name.endswith("in_proj_weight"):  # q and k rows: sharper attention
                p[:2 * p.shape[1]] *= 1.5
            elif (".ln" in name or "attn_pool.ln" in name) and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.startswith("visual.") and name.endswith(("class_embedding",
                                                              "positional_embedding",
                                                              "attn_pool.query")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    model = model.to(dtype).eval()
    return model if dual else model.visual


def randomize_(model: nn.Module, seed: int) -> nn.Module:
    """Re-initialise weights so attention is far from uniform (like the parity fixture)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                fan_in = math.prod(p.shape[1:])
                qk = any(k in name for k in ("qkv", "q_proj", "k_proj", "query", "key"))
                std = (1.5 if qk else 1.0) / math.sqrt(fan_in)
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif name.split(".")[-1].startswith("gamma"):
                p.copy_(0.5 + 0.2 * torch.randn(p.shape, generator=g))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
        params = dict(model.named_parameters())
        for token in ("cls_token", "reg_token", "dist_token", "pos_embed",
                      "distillation_token", "position_embeddings"):
            for name, t in params.items():
                if name.split(".")[-1] == token:
                    t.copy_(0.5 * torch.randn(t.shape, generator=g))
    return model


def make_model(family: str = "vit", *, seed: int = 0, depth: int = 3,
               dtype: torch.dtype = torch.float64, num_classes: int = 5) -> nn.Module:
    """A small random ViT of ``family`` (timm FAMILIES, HF_FAMILIES,
    TORCHVISION_FAMILIES or the VideoMAE families), eval mode."""
    if family in HF_FAMILIES:
        return make_hf_model(family, seed=seed, depth=depth, dtype=dtype,
                             num_classes=num_classes)
    if family in TORCHVISION_FAMILIES:
        return make_torchvision_model(family, seed=seed, depth=depth, dtype=dtype,
                                      num_classes=num_classes)
    if family in OPEN_CLIP_FAMILIES:
        return make_open_clip_model(family, seed=seed, depth=depth, dtype=dtype)
    if family in VIDEO_FAMILIES or family in HF_VIDEO_EXTRA:
        return make_video_model(family, seed=seed, depth=depth, dtype=dtype,
                                num_classes=num_classes)
    if family in SWIN_FAMILIES:
        return make_swin_model(family, seed=seed, dtype=dtype, num_classes=num_classes)
    if family in HF_SWIN_FAMILIES:
        return hf_swin_twin(make_swin_model(family.replace("hf_", "timm_"), seed=seed,
                                            dtype=dtype, num_classes=num_classes))
    cls, extra, size = {**FAMILIES, **OTHER_FAMILIES}[family]
    kwargs = dict(img_size=size, patch_size=8, in_chans=3, embed_dim=32, depth=depth,
                  num_heads=4, mlp_ratio=2.0, num_classes=num_classes, qkv_bias=True)
    kwargs.update(extra)
    torch.manual_seed(seed)
    model = cls(**kwargs)
    return randomize_(model, seed).to(dtype).eval()




def make_swin_model(family: str = "timm_swin", *, seed: int = 0, depths: tuple = (2, 2),
                    dtype: torch.dtype = torch.float64, num_classes: int = 5,
                    **overrides) -> nn.Module:
    """A small random timm ``SwinTransformer`` of ``family`` (SWIN_FAMILIES; patch 4,
    width 16, heads (2, 4)), eval mode."""
    from timm.models.swin_transformer import SwinTransformer

    extra, size = SWIN_FAMILIES[family]
    kwargs = dict(img_size=size, patch_size=4, in_chans=3, embed_dim=16, depths=depths,
                  num_heads=(2, 4)[:len(depths)] if len(depths) <= 2 else (2,) * len(depths),
                  mlp_ratio=2.0, num_classes=num_classes, drop_path_rate=0.0)
    kwargs.update(extra)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = SwinTransformer(**kwargs)
    return randomize_(model, seed).to(dtype).eval()


def make_inputs(family: str = "vit", batch: int = 3, *, seed: int = 1,
                dtype: torch.dtype = torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if family in VIDEO_FAMILIES or family in HF_VIDEO_EXTRA:  # videos [B, T, C, H, W]
        t, h, w = {**VIDEO_FAMILIES, **HF_VIDEO_EXTRA}[family][-1]
        return torch.randn(batch, t, 3, h, w, generator=g).to(dtype)
    h, w = {**FAMILIES, **OTHER_FAMILIES, **HF_FAMILIES, **TORCHVISION_FAMILIES,
            **OPEN_CLIP_FAMILIES, **SWIN_FAMILIES, **HF_SWIN_FAMILIES}[family][-1]
    return torch.randn(batch, 3, h, w, generator=g).to(dtype)


def load_parity():
    """The parity fixture (config A): model (float64, eval), x, targets, logits, maps, meta."""
    meta = json.loads((FIXTURES / "meta.json").read_text())
    model = VisionTransformer(**meta["model"]["kwargs"])
    model.load_state_dict(load_file(str(FIXTURES / "model.safetensors")), strict=True)
    model = model.double().eval()
    inp = load_file(str(FIXTURES / "inputs.safetensors"))
    maps = load_file(str(FIXTURES / "maps.safetensors"))
    return model, inp["x"], inp["targets"], inp["logits"], maps, meta


def _is_tensor_sequence(value) -> bool:
    """A tuple or list holding tensors (or ``None``), not a list of numbers."""
    return isinstance(value, tuple | list) and any(
        v is None or isinstance(v, torch.Tensor | tuple | list) for v in value)


def assert_close_scaled(actual, expected, rel: float = 1e-12, scale: float | None = None,
                        msg: str | None = None, check_dtype: bool = True) -> None:
    """``max|actual - expected| <= rel * max(scale, max|expected|)``, rtol 0.

    For two DIFFERENT computations of one quantity (a fast path and a generic one, a batch
    and its images one by one, our code and a reference): which GEMM / softmax / reduction
    kernels run depends on the processor, the thread count and the shapes, so their last
    bits may differ. The allowed difference follows the scale of the quantity, the largest
    magnitude of ``expected`` over the whole tensor, or ``scale`` where that is larger (a
    map that is itself rounding-sized, e.g. ~1e-7 on a model whose logits are O(1), is
    compared at the logits' scale). float64: ``rel = 1e-12`` (a few thousand ulps) is the
    norm; float32: ~1e-5. A NaN fails; infinities must be equal. Tuples and lists of
    tensors are compared item by item (``None`` only with ``None``), each at its own scale.
    Set ``CAPTUM_VIT_TEST_TOLERANCE_LOG=FILE`` to append each comparison's largest
    difference and allowed one to FILE (tab-separated: test id, calling line, msg,
    difference, allowed, rel).
    """
    where = f"{msg}: " if msg else ""
    if _is_tensor_sequence(actual) or _is_tensor_sequence(expected):
        assert isinstance(actual, tuple | list) and isinstance(expected, tuple | list) \
            and len(actual) == len(expected), f"{where}{type(actual)} vs {type(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            if a is None or e is None:
                assert a is None and e is None, f"{where}item {i}: {a!r} vs {e!r}"
            else:
                assert_close_scaled(a, e, rel, scale, f"{msg or ''}[{i}]", check_dtype)
        return
    a = torch.as_tensor(actual).detach().cpu()
    e = torch.as_tensor(expected).detach().cpu()
    assert a.shape == e.shape, f"{where}shape {tuple(a.shape)} != {tuple(e.shape)}"
    if check_dtype:
        assert a.dtype == e.dtype, f"{where}dtype {a.dtype} != {e.dtype}"
    a, e = a.double(), e.double()
    finite = torch.isfinite(e)
    assert not (a.isnan().any() or e.isnan().any()), f"{where}NaN"
    assert torch.equal(a[torch.isinf(e)], e[torch.isinf(e)]), f"{where}infinities differ"
    a, e = a[finite], e[finite]
    big = e.abs().max().item() if e.numel() else 0.0
    ref_scale = max(big, float(scale or 0.0))
    allowed = rel * ref_scale
    err = (a - e).abs().max().item() if e.numel() else 0.0
    log = os.environ.get("CAPTUM_VIT_TEST_TOLERANCE_LOG")
    if log:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
        frame = sys._getframe(1)
        while frame.f_back is not None and frame.f_code.co_filename == __file__:
            frame = frame.f_back  # the calling test's line
        site = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
        with open(log, "a") as f:
            f.write(f"{test}\t{site}\t{msg or ''}\t{err:.3g}\t{allowed:.3g}\t{rel:g}\n")
    assert err <= allowed, (
        f"{where}largest |difference| {err:.3g} > allowed {allowed:.3g} "
        f"(= {rel:g} x scale {ref_scale:.3g})")


def assert_close_to_reference(actual: torch.Tensor, reference: torch.Tensor,
                              rel: float = 1e-8) -> None:
    """``max|actual - reference| <= rel * max|reference|`` (fixture tolerance style)."""
    assert_close_scaled(actual, reference, rel=rel, check_dtype=False)


class ReferenceCapture:
    """Attention probabilities [B, H, N, N] and their gradients captured through timm's
    OWN forward (on a deep copy with fused attention switched off), independent of the
    adapter. Use ``refs = ReferenceCapture(model)``; ``logits = refs(x)``; ``refs.attn``."""

    def __init__(self, model: nn.Module) -> None:
        self.model = copy.deepcopy(model)
        self.attn: list[torch.Tensor] = []
        self.block_inputs: list[torch.Tensor] = []
        for blk in self.model.blocks:
            blk.attn.fused_attn = False
            blk.attn.attn_drop.register_forward_hook(self._grab_attn)
            blk.register_forward_pre_hook(self._grab_input)

    def _grab_attn(self, module, args, out):
        out.retain_grad()
        self.attn.append(out)

    def _grab_input(self, module, args):
        args[0].retain_grad()
        self.block_inputs.append(args[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.attn.clear()
        self.block_inputs.clear()
        return self.model(x)


def snapshot(model: nn.Module) -> dict:
    """Everything an attribution call must leave unchanged (a Hugging Face model's config,
    attention implementation included, too)."""
    state = {}
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        state["config"] = (config.to_dict(), getattr(config, "_attn_implementation", None))
    for name, p in model.named_parameters():
        state[f"param:{name}"] = (p.detach().clone(), p.requires_grad,
                                  None if p.grad is None else p.grad.clone())
    for name, b in model.named_buffers():
        state[f"buffer:{name}"] = b.clone()
    for name, m in model.named_modules():
        hooks = tuple(len(getattr(m, h, {})) for h in (
            "_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
            "_backward_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks"))
        flags = {k: v for k, v in vars(m).items() if isinstance(v, bool | int | float | str)}
        state[f"module:{name}"] = (type(m), m.training, hooks, flags)
    return state


def assert_unchanged(model: nn.Module, before: dict) -> None:
    after = snapshot(model)
    assert before.keys() == after.keys()
    for key, old in before.items():
        new = after[key]
        if key.startswith("param:"):
            assert torch.equal(old[0], new[0]), f"{key} value changed"
            assert old[1] == new[1], f"{key} requires_grad changed"
            assert (old[2] is None) == (new[2] is None), f"{key} .grad changed"
            if old[2] is not None:
                assert torch.equal(old[2], new[2]), f"{key} .grad changed"
        elif key.startswith("buffer:"):
            assert torch.equal(old, new), f"{key} changed"
        else:
            assert old == new, f"{key} changed: {old} -> {new}"
