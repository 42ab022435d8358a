"""Adapter for Hugging Face transformers' ViViT (``VivitForVideoClassification``,
``VivitModel``; Arnab et al., "ViViT: A Video Vision Transformer", ICCV 2021; the
transformers port is the paper's model 1, *spatio-temporal attention*: tubelet embedding
and joint attention over all tokens, i.e. the plain ViT on tubelet tokens).

Only this file knows ViViT's attribute names. Verified in the installed transformers
(5.x, ``models/vivit/modeling_vivit.py``):

- **Inputs** are videos ``pixel_values`` [B, T, C, H, W] (frames before channels);
  ``VivitTubeletEmbeddings`` transposes them to [B, C, T, H, W] and applies a ``Conv3d``
  with kernel = stride = ``config.tubelet_size`` = ``(t, ph, pw)`` (default ``(2, 16,
  16)``), then flattens the ``(T / t, H / ph, W / pw)`` grid in that order: tokens are
  ordered (frame slice, row, column).
- **Class token and positions**: ``cls_token`` is prepended (``num_prefix = 1``), then a
  learned table ``position_embeddings`` [1, 1 + T/t · H/ph · W/pw, D] is added to all
  rows (CLS included); embedding dropout (``hidden_dropout_prob``, identity in eval). The
  table fixes the frame count (``config.num_frames``) and, without
  ``interpolate_pos_encoding``, the frame size (the model raises on another one). Its
  ``interpolate_pos_encoding`` reshapes the patch rows to a *square* of side
  ``sqrt(#rows)``, which holds only for one frame slice of a square grid; the adapter
  therefore refuses another frame size (and frame count) with a clear error rather than
  reproduce it. The adapter calls the model's own ``embeddings``.
- **Layers** (``vivit.layers[l]``, transformers 5 naming): pre-LayerNorm
  (``layernorm_before``, ``layernorm_after``, eps ``config.layer_norm_eps``, 1e-6 by
  default), ``attention.{q_proj, k_proj, v_proj}`` (biases when ``qkv_bias``) and
  ``attention.o_proj``, MLP ``mlp.fc1`` → ``ACT2FN[config.hidden_act]`` (``"gelu_fast"``,
  the tanh approximation, by default) → ``mlp.fc2``; no LayerScale, no relative position,
  no RoPE. Read by :func:`captum_vit.adapters.families._hf.layer_parts`.
- **Head** (``VivitForVideoClassification``): the backbone (built with
  ``add_pooling_layer=False``) ends with its final ``layernorm``; the classifier reads
  row 0 (the class token): readout ``"token"``. With ``num_labels=0`` the classifier is an
  ``nn.Identity`` and the model outputs the normed CLS row (an embedding model).
- **VivitModel** (head-less, ``embedding = True``): its ``pooler_output``,
  ``pooler_act(dense(layernorm(x)[:, 0]))`` (``tanh`` by default) when it has a pooler
  (``add_pooling_layer=True``, the constructor's default), else ``last_hidden_state[:,
  0]`` (a choice of captum_vit: what the classifier reads). The pooler is the head's
  representation layer (:class:`~captum_vit.adapters.parts.PreLogitsHeadParts`).

Maps are returned per tubelet, as VideoMAE's
(:class:`~captum_vit.adapters.families._hf.HFVideoAdapter`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from captum_vit.adapters._typing import ModelTree
from captum_vit.adapters.catalog import Example, register_family
from captum_vit.adapters.families._examples import library, transformers_model
from captum_vit.adapters.families._hf import (
    HFVideoAdapter,
    encoder_blocks,
    is_transformers_model,
    linear_head,
)
from captum_vit.adapters.ops import Ops
from captum_vit.adapters.parts import HeadParts, PreLogitsHeadParts
from captum_vit.adapters.parts import layer_norm_parts as _norm

CLASSES = ("VivitForVideoClassification", "VivitModel")


def is_hf_vivit(model: nn.Module) -> bool:
    """``True`` for the Hugging Face ViViT models in :data:`CLASSES` (transformers is never
    imported for other models).

    Args:
        model (nn.Module): any model.

    Returns:
        bool: whether :class:`HFVivitAdapter` applies.
    """
    return is_transformers_model(model, CLASSES)


def _example(cls_name: str, **extra: Any) -> Callable[..., nn.Module]:
    """A builder of a small Hugging Face ViViT (4 frames of 16x16, tubelets (2, 8, 8): 2
    frame slices of 2 x 2; width 32, 2 heads); ``extra`` and build-time ``overrides`` go to
    the ``VivitConfig`` (e.g. ``num_frames=2``)."""
    def build(*, seed: int = 0, depth: int = 3, dtype: torch.dtype = torch.float64,
              num_classes: int = 5, **overrides: Any) -> nn.Module:
        transformers = library("transformers")
        kwargs: dict[str, Any] = dict(
            image_size=16, num_frames=4, tubelet_size=[2, 8, 8], num_channels=3,
            hidden_size=32, num_hidden_layers=depth, num_attention_heads=2,
            intermediate_size=64, num_labels=num_classes)
        kwargs.update(extra)
        kwargs.update(overrides)
        return transformers_model(cls_name, transformers.VivitConfig(**kwargs), seed, dtype)

    return build


@register_family(
    is_hf_vivit,
    supports="Hugging Face VivitForVideoClassification and VivitModel (videos "
             "[B, T, C, H, W])",
    tags=("classifier", "embedding", "video"),
    notes=("Videos `[B, T, C, H, W]`: tubelet tokens of `tubelet_size` `(t, ph, pw)`, a class "
           "token, the learned position table, joint space-time attention (the plain ViT "
           "form); fixed `num_frames` and `image_size`: ✅ maps per tubelet: "
           "`output=\"tokens\"` `[B, F·gh·gw]`, `\"grid\"` `[B, 1, F, gh, gw]`, pixels shaped "
           "like the video (a one-slice video's maps equal a Hugging Face ViT twin's to 1e-10, "
           "every method); `VivitModel` with vector targets on its `pooler_output`; LRP "
           "`at=\"pixels\"` through the tubelet projection — refused: RISE/ViT-CX pixel masks, "
           "the localisation metrics, the removal metrics' `unit=\"pixel\"` (as VideoMAE)"),
    examples={
        "hf_vivit": Example(_example("VivitForVideoClassification"), (4, 16, 16),
                            library="transformers"),
        # the head-less backbone: tanh pooler on the CLS row
        "hf_vivit_model": Example(_example("VivitModel"), (4, 16, 16), library="transformers",
                                  target="embedding", suite=False),
    })
class HFVivitAdapter(HFVideoAdapter):
    """Canonical view of a Hugging Face ``VivitForVideoClassification`` or ``VivitModel``
    (never modified): the ViT with a class token on tubelet tokens.

    Inputs are videos [B, T, C, H, W] of the model's ``num_frames`` and ``image_size``.
    A ``VivitModel`` (and a classifier built with ``num_labels=0``) outputs its pooled
    vector and takes vector targets (:class:`captum_vit.targets.EmbeddingTarget`).

    Args:
        model (nn.Module): one of the classes of :data:`CLASSES`.

    Raises:
        TypeError: a layer layout, pooler or head the adapter does not know.

    Examples::

        >>> import transformers
        >>> from captum_vit.adapters import adapt
        >>> cfg = transformers.VivitConfig(image_size=32, num_frames=4, tubelet_size=[2, 8, 8],
        ...     hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        ...     intermediate_size=64, num_labels=5)
        >>> a = adapt(transformers.VivitForVideoClassification(cfg).eval())
        >>> a.layout(torch.zeros(1, 4, 3, 32, 32)).grid   # 2 frame slices of 4 x 4
        (8, 4)
    """

    def __init__(self, model: ModelTree) -> None:
        self.model = model
        name = type(model).__name__
        self.backbone = getattr(model, "vivit", model)
        cfg = model.config
        self.layers = self.backbone.layers
        self.blocks = encoder_blocks(self.layers, cfg, name)
        self.in_chans = int(cfg.num_channels)
        self.num_prefix = 1
        self.readout = "token"
        t, ph, pw = (int(s) for s in cfg.tubelet_size)
        self.tubelet, self.patch_size = t, (ph, pw)
        self.read_classifier("ViViT")
        self.head = self._head()

    def _head(self) -> HeadParts:
        """Final ``layernorm``, the CLS row, then the classifier or ``VivitModel``'s
        pooler."""
        model, name = self.model, type(self.model).__name__
        norm = _norm(self.backbone.layernorm, f"{name}.layernorm")
        classifier = getattr(model, "classifier", None)
        if classifier is not None:
            w, b = linear_head(classifier)
            return HeadParts(norm, None, ((0, w, b),))
        pooler = getattr(model, "pooler", None)
        if pooler is None:
            return HeadParts(norm, None, ((0, None, None),))
        dense, act = getattr(pooler, "dense", None), getattr(pooler, "activation", None)
        if not isinstance(dense, nn.Linear) or not isinstance(act, nn.Module):
            raise TypeError(f"{name}.pooler is {type(pooler).__name__}; captum_vit supports "
                            "the pooler activation(dense(CLS)) of VivitPooler")
        return PreLogitsHeadParts(norm, None, ((0, None, None),),
                                  pre_logits=(dense.weight, dense.bias, act))

    def check_inputs(self, inputs: Tensor) -> None:
        if inputs.dim() != 5:
            raise ValueError(f"inputs of shape {tuple(inputs.shape)} are not a video batch: "
                             f"{type(self.model).__name__} takes videos [B, T, C, H, W] of "
                             f"{self.num_frames} frames (an image batch [B, C, H, W] needs "
                             "frames: e.g. x[:, None].repeat(1, T, 1, 1, 1))")
        super().check_inputs(inputs)
        self.check_fixed_video(inputs)

    def embed(self, inputs: Tensor, ops: Ops | None = None) -> Tensor:
        """The model's own ``embeddings(pixel_values)`` (class token, tubelet projection,
        position table); with ``ops`` as :meth:`HFVideoAdapter.tubelet_embed
        <captum_vit.adapters.families._hf.HFVideoAdapter.tubelet_embed>` (the class token's
        row gets no projection)."""
        emb = self.backbone.embeddings
        return self.tubelet_embed(inputs, ops, emb, emb.patch_embeddings.projection)

    def model_outputs(self, inputs: Tensor) -> Tensor:
        """The logits; for a ``VivitModel`` its ``pooler_output`` (the normed CLS row
        without a pooler)."""
        if hasattr(self.model, "classifier"):
            return self.model(pixel_values=inputs).logits
        out = self.model(pixel_values=inputs)
        pooled = out.pooler_output
        return out.last_hidden_state[:, 0] if pooled is None else pooled

    def parameter_stages(self) -> list[list[nn.Parameter]]:
        m = self.model
        return self.head_then_layers(self.backbone.layernorm, getattr(m, "pooler", None),
                                     getattr(m, "classifier", None))
