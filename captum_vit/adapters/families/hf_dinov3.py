"""Adapter for Hugging Face transformers' DINOv3 ViT (``DINOv3ViTModel``, what
``AutoModel.from_pretrained("facebook/dinov3-vit*-pretrain-lvd1689m")`` loads).

Verified in the installed transformers (5.x, ``models/dinov3_vit/modeling_dinov3_vit.py``):

- **Embedding** (``DINOv3ViTEmbeddings``): the patch ``Conv2d`` (stride = kernel), then
  ``[CLS, reg_1 … reg_R, patches]``; no absolute position embedding at all, so any input
  size divisible by the patch is taken as it is (the model was trained with random
  rescaling). ``mask_token`` is used only with ``bool_masked_pos`` (pre-training), which
  is never passed here.
- **RoPE** (``DINOv3ViTRopePositionEmbedding``): 2-D rotary tables ``cos``, ``sin``
  ``[P, d]`` of the input's patch grid, computed by the model from ``pixel_values`` on
  every forward (patch-centre coordinates in ``[-1, 1]`` per axis, built in float32;
  ``angles = 2π · coords ⊗ inv_freq``, the ``y`` then the ``x`` frequencies, tiled twice);
  in training mode the coordinates are randomly shifted, jittered and rescaled
  (``pos_embed_*``): such a model is refused as random. ``apply_rotary_pos_emb`` rotates
  the **patch rows only** of ``q`` and ``k`` (the rotate-half layout,
  ``x · cos + rotate_half(x) · sin``), the ``1 + R`` prefix rows unrotated; ``v`` is not
  rotated. There is no q/k norm; the scale is ``head_dim ** -0.5``.
- **Layer** (``DINOv3ViTLayer``): pre-LN, ``x + λ1 ⊙ o_proj(attn(norm1(x)))``, then
  ``x + λ2 ⊙ mlp(norm2(x))`` (LayerScale ``layer_scale{1,2}.lambda1``); the MLP is
  ``down_proj(act(up_proj(u)))`` or, with ``use_gated_mlp`` (the large variants),
  ``down_proj(act(gate_proj(u)) ⊙ up_proj(u))`` (SwiGLU with ``hidden_act="silu"``). The
  q/k/v/o projections are separate ``nn.Linear`` (``query_bias``, ``key_bias``,
  ``value_bias``, ``proj_bias``): read by :func:`~captum_vit.adapters.families._hf.layer_parts`.
- **Output**: ``last_hidden_state = norm(encoder output)`` and ``pooler_output =
  last_hidden_state[:, 0]``, the CLS row after the final LayerNorm (registers and patches
  are not read). transformers has no DINOv3 ViT classifier: the model outputs an image
  embedding (``embedding = True``) explained with vector targets
  (:class:`captum_vit.targets.EmbeddingTarget`), scored against ``pooler_output``.

The adapter runs the model's own ``embeddings`` and ``rope_embeddings`` when it embeds
images and keeps the RoPE tables of the last embedded input (checked by their number of
patch tokens: a sequence of another length raises instead of being rotated with the wrong
rows). Each block's :attr:`~captum_vit.adapters.parts.BlockParts.rotary` applies the
model's own ``rotate_half`` with those tables to the patch rows; under true token removal a
kept patch is rotated with the row of its original position. ``embed(inputs, ops)`` routes
the pixel gradient through the patch projection as an :class:`Ops` linear map. Twin: timm's
DINOv3 ``Eva`` (:mod:`~captum_vit.adapters.families.timm_eva`) with copied weights gives the
same forward and maps (tests/families/test_hf_dinov3.py). Not supported:
``DINOv3ViTBackbone`` (feature maps of several stages; explain its ``DINOv3ViTModel``
twin) and the ConvNeXt DINOv3 models (not transformers).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from captum_vit.adapters._typing import ModelTree
from captum_vit.adapters.catalog import Example, register_family
from captum_vit.adapters.families._examples import library, transformers_model
from captum_vit.adapters.families._hf import HFPatchGrid, encoder_blocks, is_transformers_model
from captum_vit.adapters.ops import Ops, patch_projection
from captum_vit.adapters.parts import HeadParts, rotary_rows
from captum_vit.adapters.parts import layer_norm_parts as _norm

CLASSES = ("DINOv3ViTModel",)


def is_hf_dinov3(model: nn.Module) -> bool:
    """``True`` for Hugging Face ``DINOv3ViTModel`` (transformers is never imported for
    other models).

    Args:
        model (nn.Module): any model.

    Returns:
        bool: whether :class:`HFDinov3Adapter` applies.
    """
    return is_transformers_model(model, CLASSES)


def dinov3_example(gated: bool = False, size: tuple[int, int] = (24, 40)
                   ) -> Callable[..., nn.Module]:
    """A builder of a small ``DINOv3ViTModel`` (patch 8, width 32, 4 heads, 2 register
    tokens, RoPE; ``gated``: the SwiGLU MLP of the large variants), LayerScale and the
    prefix tokens drawn far from their initial values."""
    def build(*, seed: int = 0, depth: int = 3, dtype: torch.dtype = torch.float64,
              num_classes: int = 5, **overrides: Any) -> nn.Module:
        cfg = library("transformers").DINOv3ViTConfig(**{
            **dict(image_size=list(size), patch_size=8, num_channels=3, hidden_size=32,
                   num_hidden_layers=depth, num_attention_heads=4, intermediate_size=64,
                   num_register_tokens=2, layer_norm_eps=1e-6, use_gated_mlp=gated,
                   hidden_act="silu" if gated else "gelu"),
            **overrides})
        model = transformers_model("DINOv3ViTModel", cfg, seed, dtype)
        g = torch.Generator().manual_seed(seed + 7)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("lambda1"):
                    p.copy_(0.5 + 0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
                elif name.endswith(("cls_token", "register_tokens")):
                    p.copy_(0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        return model

    return build


@register_family(
    is_hf_dinov3,
    supports="Hugging Face DINOv3ViTModel (RoPE, registers, LayerScale, GELU or SwiGLU MLP)",
    tags=("embedding", "variable-size"),
    notes=("`DINOv3ViTModel` (`facebook/dinov3-vit*`; transformers has no DINOv3 ViT "
           "classifier): ✅ with vector targets on its `pooler_output` (the CLS row after the "
           "final norm); CLS and register tokens, 2-D RoPE from the model's own tables on the "
           "patch rows only (a kept token keeps its original row under token removal), "
           "LayerScale, GELU or SwiGLU MLP, any size divisible by the patch; maps equal "
           "timm's DINOv3 `Eva` with copied weights — not supported: `DINOv3ViTBackbone`"),
    examples={
        "hf_dinov3": Example(dinov3_example(), (24, 40), library="transformers",
                             target="embedding"),
    })
class HFDinov3Adapter(HFPatchGrid):
    """Canonical view of a Hugging Face ``DINOv3ViTModel`` (never modified).

    Its output is the model's own ``pooler_output`` (the normed CLS row); explain it with a
    vector target: ``GAE(model).attribute(pixel_values, target=EmbeddingTarget(t))``.

    Args:
        model (nn.Module): a ``DINOv3ViTModel``.

    Raises:
        TypeError: a layer layout the adapter does not know.

    Examples::

        >>> from captum_vit.adapters import adapt
        >>> ad = adapt(dinov3)                       # a DINOv3ViTModel
        >>> ad.num_prefix == 1 + dinov3.config.num_register_tokens, ad.embedding
        (True, True)
    """

    model: ModelTree  # read by attribute names (captum_vit.adapters._typing)
    embedding = True

    def __init__(self, model: ModelTree) -> None:
        self.model = model
        name = type(model).__name__
        cfg = model.config
        self.layers = model.model.layer
        rotate_half = getattr(sys.modules[type(model).__module__], "rotate_half", None)
        if rotate_half is None:  # the model's own rotation (modeling_dinov3_vit.rotate_half)
            raise TypeError(f"{type(model).__module__} has no rotate_half: this transformers "
                            f"version's {name} is not supported")
        self._rotate_half = rotate_half
        self.blocks = [dataclasses.replace(p, rotary=self._rotate)
                       for p in encoder_blocks(self.layers, cfg, name)]
        self.in_chans = int(cfg.num_channels)
        self.num_prefix = 1 + int(cfg.num_register_tokens or 0)
        self.readout = "token"
        self.head = HeadParts(_norm(model.norm, f"{name}.norm"), None, ((0, None, None),))
        self._rope: tuple[Tensor, Tensor] | None = None  # (cos, sin) [P, d] of the last embed
        self._gathered: tuple[Tensor, Tensor, Tensor, Tensor] | None = None

    # -- rotary position embedding ----------------------------------------------------------
    def _rotate(self, h: Tensor, positions: Tensor | None) -> Tensor:
        """The model's RoPE on the patch rows of ``h`` [B, H, n, d] (the ``K`` prefix rows
        unrotated), ``x · cos + rotate_half(x) · sin`` with the tables of the last embedded
        input: the rows of the tokens' original ``positions`` [B, n] (``None``: the full
        sequence)."""
        if self._rope is None:
            raise ValueError("the rotary embedding depends on the input grid: get the token "
                             "states from adapter.embed(images) before running the blocks")
        cos, sin = self._rope
        k, num = self.num_prefix, cos.shape[0]
        if positions is None:
            rotary_rows(None, h.shape[2], k, num, cos.device)
        else:
            cached = self._gathered
            if cached is not None and cached[0] is positions and cached[1] is cos:
                cos, sin = cached[2], cached[3]
            else:
                idx = rotary_rows(positions, h.shape[2], k, num, cos.device)
                gathered = (cos[idx].unsqueeze(1), sin[idx].unsqueeze(1))  # [B, 1, n-K, d]
                self._gathered = (positions, cos, *gathered)
                cos, sin = gathered
        patches = h[:, :, k:]
        rotated = patches * cos + self._rotate_half(patches) * sin
        return torch.cat([h[:, :, :k], rotated], dim=2)

    # -- embedding and checks -------------------------------------------------------------
    def embed(self, inputs: Tensor, ops: Ops | None = None) -> Tensor:
        """The model's own ``embeddings(pixel_values)`` (``[CLS, registers, patches]``),
        keeping the model's ``rope_embeddings(pixel_values)`` tables for the blocks.

        With ``ops`` (:meth:`ViTAdapter.embed`) the value is the model's embedding of the
        detached images and the patch projection runs through ``ops.linear`` as
        ``p - p.detach()`` (exactly 0) on the patch rows, so every pixel gradient goes
        through ``ops.linear``'s backward.
        """
        m = self.model
        emb = m.embeddings
        with torch.no_grad():  # the tables depend on the grid only
            cos, sin = m.rope_embeddings(inputs.detach())
        self._rope = (cos, sin)
        if ops is None:
            return emb(inputs)
        x = emb(inputs.detach())
        name = f"{type(m).__name__}.embeddings"
        p = patch_projection(inputs, emb.patch_embeddings, ops,
                             f"{name} patch projection").flatten(1, 2)
        return x + F.pad(p - p.detach(), (0, 0, self.num_prefix, 0))

    def is_random(self) -> bool:
        cfg = self.config
        return self.model.training and (
            any(getattr(cfg, n, 0) for n in ("drop_path_rate", "attention_dropout"))
            or any(getattr(cfg, n, None) is not None
                   for n in ("pos_embed_shift", "pos_embed_jitter", "pos_embed_rescale")))

    def model_outputs(self, inputs: Tensor) -> Tensor:
        """The model's own ``pooler_output`` [B, D] (the CLS row after ``norm``)."""
        return self.model(pixel_values=inputs).pooler_output

    def parameter_stages(self) -> list[list[nn.Parameter]]:
        """Head stage (the final ``norm``), then layers ``L-1 .. 0``; the embedding (patch
        projection, CLS, register and mask tokens) belongs to no stage and the RoPE has no
        parameters."""
        stages = [list(self.model.norm.parameters())]
        return stages + [list(layer.parameters()) for layer in reversed(self.layers)]
