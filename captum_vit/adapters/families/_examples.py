"""What the families' example builders share: the weight randomiser (attention far from
uniform, like the parity fixture), the library import of a builder, and the two generic
builders (timm keyword models, Hugging Face config models).

The optional libraries (transformers, torchvision, open_clip) are imported when an example is
built, never when :mod:`captum_vit` is imported.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn


def library(name: str) -> ModuleType:
    """The module ``name`` of a model library, imported on first use.

    Args:
        name (str): e.g. ``"transformers"``, ``"torchvision.models"``, ``"open_clip"``.

    Returns:
        ModuleType: the module.

    Raises:
        ImportError: the library is not installed (the message names the extra).
    """
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f"this example model needs {name.split('.')[0]} "
                          f"(pip install captum-vit[hf|openclip] or torchvision): {e}") from e


def randomize_(model: nn.Module, seed: int) -> nn.Module:
    """Re-initialise ``model``'s weights from ``seed`` so attention is far from uniform
    (like the parity fixture); in place.

    Args:
        model (nn.Module): the model.
        seed (int): the generator's seed.

    Returns:
        nn.Module: ``model``.
    """
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


def seeded_model(module: str, cls_name: str, seed: int, **kwargs: Any) -> nn.Module:
    """The model ``module.cls_name(**kwargs)`` built after ``torch.manual_seed(seed)`` and
    re-initialised by :func:`randomize_` from ``seed`` (float32, train mode as built).

    Args:
        module (str): the library module, e.g. ``"timm.models.hiera"``.
        cls_name (str): the model class there, e.g. ``"Hiera"``.
        seed (int): the seed of construction and of the weights.
        **kwargs: the constructor's keywords.

    Returns:
        nn.Module: the model.
    """
    cls = getattr(library(module), cls_name)
    torch.manual_seed(seed)
    return randomize_(cls(**kwargs), seed)


def timm_builder(module: str, cls_name: str, size: tuple[int, int],
                 **extra: Any) -> Callable[..., nn.Module]:
    """A builder of a small timm model taking ``VisionTransformer``'s keywords (patch 8,
    width 32, 4 heads, MLP ratio 2) plus ``extra``.

    Args:
        module (str): the timm module, e.g. ``"timm.models.eva"``.
        cls_name (str): the model class there, e.g. ``"Eva"``.
        size (tuple of int): the image size ``(H, W)``.
        **extra: further constructor keywords.

    Returns:
        Callable: ``build(*, seed, depth, dtype, num_classes)``.
    """
    def build(*, seed: int = 0, depth: int = 3, dtype: torch.dtype = torch.float64,
              num_classes: int = 5) -> nn.Module:
        kwargs: dict[str, Any] = dict(
            img_size=size, patch_size=8, in_chans=3, embed_dim=32, depth=depth,
            num_heads=4, mlp_ratio=2.0, num_classes=num_classes, qkv_bias=True)
        return seeded_model(module, cls_name, seed, **{**kwargs, **extra}).to(dtype).eval()

    return build


def twin_builder(timm_build: Callable[..., nn.Module], twin: Callable[..., nn.Module], *,
                 pooled: bool = False) -> Callable[..., nn.Module]:
    """A builder of the Hugging Face twin of a timm example: ``twin(timm_model,
    pooled=pooled)`` of the model ``timm_build`` draws.

    Args:
        timm_build (Callable): the timm example's builder.
        twin (Callable): the family's twin converter (e.g. ``hf_swin_twin``).
        pooled (bool, optional): build the head-less model. Default ``False``.

    Returns:
        Callable: ``build(*, seed, depth, dtype, num_classes, **overrides)`` (``depth`` is
        not used).
    """
    def build(*, seed: int = 0, depth: int = 3, dtype: torch.dtype = torch.float64,
              num_classes: int = 5, **overrides: Any) -> nn.Module:
        return twin(timm_build(seed=seed, dtype=dtype, num_classes=num_classes, **overrides),
                    pooled=pooled)

    return build


def hf_builder(cls_name: str, cfg_name: str, *, dual: str | None = None,
               **extra: Any) -> Callable[..., nn.Module]:
    """A builder of a small Hugging Face model from its config (image size 32, patch 8,
    width 32, 4 heads, MLP 64) plus ``extra`` config options.

    Args:
        cls_name (str): the transformers model class, e.g. ``"ViTForImageClassification"``.
        cfg_name (str): its (vision) config class, e.g. ``"ViTConfig"``.
        dual (str, optional): a dual config class wrapping the vision config (CLIP and
            SigLIP classifiers), e.g. ``"CLIPConfig"``.
        **extra: further config options.

    Returns:
        Callable: ``build(*, seed, depth, dtype, num_classes)``.
    """
    def build(*, seed: int = 0, depth: int = 3, dtype: torch.dtype = torch.float64,
              num_classes: int = 5) -> nn.Module:
        transformers = library("transformers")
        cfg = getattr(transformers, cfg_name)(
            image_size=32, patch_size=8, num_channels=3, hidden_size=32,
            num_hidden_layers=depth, num_attention_heads=4, intermediate_size=64,
            num_labels=num_classes, layer_norm_eps=1e-6, **extra)
        if dual is not None:  # a classifier over the vision tower of a dual config
            cfg = getattr(transformers, dual)(vision_config=cfg.to_dict(),
                                              num_labels=num_classes)
        torch.manual_seed(seed)
        model = getattr(transformers, cls_name)(cfg)
        return randomize_(model, seed).to(dtype).eval()

    return build


VLM_IMAGE_ID = 299
"""The image placeholder id of the tiny vision-language examples' prompts (LLaVA,
PaliGemma)."""


def transformers_model(cls_name: str, cfg: Any, seed: int, dtype: torch.dtype) -> nn.Module:
    """The Hugging Face model ``cls_name`` built from ``cfg`` with the weights of ``seed``
    (:func:`randomize_`), in ``dtype`` and eval mode: the last step of the examples that
    build a whole model around the explained tower (detectors, VLMs, depth, SAM).

    Args:
        cls_name (str): the transformers model class, e.g. ``"SamModel"``.
        cfg (Any): its config.
        seed (int): the weights' seed.
        dtype (torch.dtype): the parameters' dtype.

    Returns:
        nn.Module: the model.
    """
    torch.manual_seed(seed)
    model = getattr(library("transformers"), cls_name)(cfg)
    return randomize_(model, seed).to(dtype).eval()
