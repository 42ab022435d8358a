"""Adapter for timm's ``Beit`` (BEiT, BEiT-v2): relative position bias.

Each block adds a learned relative position bias ``B^h`` (per block, or one shared by all
blocks) to the attention logits before the softmax. The bias comes from the model's own
code (``Attention._get_rel_pos_bias`` / ``RelativePositionBias``) and enters
:meth:`BlockParts.attention` as ``attn_bias``; under true token removal a kept subset
``S`` uses the sub-matrix ``B[:, S, S]`` of the original positions (the index is never
rebuilt for a smaller grid). The MLP is timm's GELU ``Mlp`` or ``SwiGLU`` (gated, read as in
:mod:`~captum_vit.adapters.families.timm_eva`; with ``scale_mlp`` a hidden LayerNorm). q/k/v are
views of the fused ``qkv`` weight with timm's separate ``q_bias``, zero ``k_bias`` and
``v_bias``; LayerScale is ``gamma_1``/``gamma_2``; the readout is the class token after
``norm``, or the patch mean and ``fc_norm`` (``global_pool='avg'``, BEiT's fine-tuning
default). The
bias is a constant inside the softmax, so no method needs a rule of its own: attention
methods read the probabilities that include it, DecompX keeps them constant.

Verified: the installed timm (1.x) ``Beit`` has no
``dynamic_img_size`` and its patch embedding asserts the configured size, so the bias
table is never resized; inputs of another size are refused before any work.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from captum_vit.adapters._typing import ModelTree
from captum_vit.adapters.catalog import Example, register_family
from captum_vit.adapters.families._examples import timm_builder
from captum_vit.adapters.families._timm import (
    TimmViTBase,
    mlp_fields,
    optional_norm,
    timm_attention_fields,
    timm_classes,
    timm_gelus,
    timm_head,
)
from captum_vit.adapters.families._torch import is_loaded_instance
from captum_vit.adapters.ops import Ops
from captum_vit.adapters.parts import BlockParts, HeadParts


def _bias_of(model: ModelTree, blk: ModelTree) -> Callable[[], Tensor] | None:
    """The block's relative position bias ``() -> [1, H, N, N]`` (own plus shared)."""
    own = blk.attn._get_rel_pos_bias if blk.attn.relative_position_bias_table is not None \
        else None
    shared = model.rel_pos_bias
    if own is None and shared is None:
        return None

    def bias() -> Tensor:
        parts = ([own()] if own is not None else []) + (
            [shared()[None]] if shared is not None else [])
        return parts[0] if len(parts) == 1 else parts[0] + parts[1]

    return bias


_BEIT = ("timm.models.beit", "Beit")
_SQUARE = (32, 32)


def is_timm_beit(model: nn.Module) -> bool:
    """``True`` for timm's ``Beit``."""
    return is_loaded_instance(model, *_BEIT)


@register_family(
    is_timm_beit,
    supports="timm Beit (relative position bias, GELU or SwiGLU MLP)",
    tags=("classifier",),
    notes=("Relative position bias per block or shared, absolute or no position embedding, mean "
           "or class-token pooling, LayerScale; GELU MLP or SwiGLU with optional hidden norm; "
           "fixed image size: ✅ (a kept token keeps its bias row and column under token removal)"),
    examples={
        "beit": Example(timm_builder(*_BEIT, _SQUARE, use_rel_pos_bias=True,
                                     use_abs_pos_emb=False, global_pool="avg",
                                     init_values=0.5), _SQUARE),
        "beit_shared_token": Example(timm_builder(*_BEIT, _SQUARE,
                                                  use_shared_rel_pos_bias=True,
                                                  global_pool="token"), _SQUARE),
        "beit_swiglu": Example(timm_builder(*_BEIT, _SQUARE, use_rel_pos_bias=True,
                                            swiglu_mlp=True, scale_mlp=True,
                                            global_pool="avg"), _SQUARE),
    })
class TimmBeitAdapter(TimmViTBase):
    """Canonical view of a timm ``Beit`` classifier (never modified)."""

    def __init__(self, model: ModelTree) -> None:
        Mlp, SwiGLU = timm_classes("timm.layers", "Mlp", "SwiGLU")

        self.model = model
        name = type(model).__name__
        if len(model.blocks) == 0:
            raise TypeError(f"{name} has no transformer blocks")
        for i, blk in enumerate(model.blocks):
            mlp = blk.mlp
            plain = type(mlp) is Mlp and isinstance(mlp.act, (nn.GELU, *timm_gelus()))
            if not (plain or type(mlp) is SwiGLU):
                raise TypeError(f"{name}.blocks[{i}].mlp is {type(mlp).__name__}; captum_vit "
                                "supports BEiT's GELU `Mlp` and `SwiGLU`")
        self.blocks = [self._parts(blk, f"{name}.blocks[{i}]")
                       for i, blk in enumerate(model.blocks)]
        self.num_prefix = 1
        self.in_chans = int(model.patch_embed.proj.in_channels)
        head = timm_head(model.head, f"{name}.head")
        self.embedding = head[0] is None
        if model.global_pool not in ("avg", "token"):
            raise TypeError(f"global_pool={model.global_pool!r} is not supported for BEiT; "
                            "use 'avg' or 'token'")
        self.readout = model.global_pool
        row = "avg" if model.global_pool == "avg" else 0
        self.head = HeadParts(optional_norm(model.norm, f"{name}.norm"),
                              optional_norm(model.fc_norm, f"{name}.fc_norm"),
                              ((row, *head),))

    def _parts(self, blk: ModelTree, where: str) -> BlockParts:
        return BlockParts(
            **timm_attention_fields(blk, where), ls1=blk.gamma_1,
            **mlp_fields(blk.mlp, where), ls2=blk.gamma_2,
            attn_bias=_bias_of(self.model, blk),
        )

    def embed(self, inputs: Tensor, ops: Ops | None = None) -> Tensor:
        """As the model's ``forward_features``: ``patch_embed``, class token, absolute
        position embedding, ``pos_drop``; with ``ops`` the patch projection through it
        (:meth:`ViTAdapter.embed`)."""
        self.refresh()
        m = self.model
        x = self._patch_embed(inputs, ops)
        x = torch.cat((m.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        if m.pos_embed is not None:
            x = x + m.pos_embed
        return m.pos_drop(x)

    def parameter_stages(self) -> list[list[nn.Parameter]]:
        """Head stage, then blocks ``L-1 .. 0``; a shared relative position bias, like the
        embedding, belongs to no stage."""
        m = self.model
        stages = [[p for mod in (m.norm, m.fc_norm, m.head) for p in mod.parameters()]]
        return stages + [list(blk.parameters()) for blk in reversed(m.blocks)]
