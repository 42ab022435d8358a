"""Adapter for timm's ``Eva`` (EVA, EVA-02, DINOv3 and the other rotary ViTs of timm's
``eva.py``): rotary position embedding, inner attention norm, gated MLPs.

The embedding is the model's own code (``patch_embed``, ``_pos_embed``, ``norm_pre``):
class token, register tokens and the absolute position embedding (if any) come in the
model's order, and ``_pos_embed`` also returns the rotary table ``[P, 2d]`` of the current
patch grid (``model.rope.get_embed``, so ``dynamic_img_size=True`` grids are timm's own).
With ``dynamic_img_size=True`` the adapter keeps the table of the last embedded input,
validated by its number of patch tokens: a sequence of another length raises instead of
being rotated with the wrong rows (a fixed-size model's table is the same for every input
and is read from the model each time). ``embed(inputs, ops)`` runs the patch projection
and the norms through an :class:`Ops` rule set as for timm's ViT; ``_pos_embed`` and the
rotary table stay the model's.
Each block's ``rotary`` (:attr:`BlockParts.rotary`) applies timm's ``apply_rot_embed_cat``
to that table, exactly as ``EvaAttention.forward`` does, on the patch rows of ``q`` and
``k`` only (rows ``0..K-1``, CLS and registers, are left unrotated); under true token
removal a kept patch is rotated by the row of its original position (the gather of timm's
``apply_keep_indices_nlc``, as in timm's patch dropout), so a kept token never changes
position. RoPE is never re-derived here. ``scale_attn_inner`` is the inner LayerNorm
``N_in`` (:attr:`BlockParts.inner_norm`); the MLP is timm's GELU ``Mlp``, ``SwiGLU`` or
the packed ``GluMlp``, each with its optional hidden LayerNorm (``scale_mlp``); LayerScale
is ``gamma_1``/``gamma_2`` (either may be ``None``). q/k/v are views of the fused ``qkv``
weight with timm's separate ``q_bias``, zero ``k_bias`` and ``v_bias`` (or the separate
``q_proj``/``k_proj``/``v_proj``). The readout is the class token after ``norm``
(``global_pool='token'``) or the mean of the patch rows, all prefix rows excluded, followed
by ``fc_norm`` (``'avg'``).

Verified in the installed timm (1.0.x ``timm/models/eva.py``,
``timm/layers/pos_embed_sincos.py``, ``timm/layers/attention.py``, ``timm/layers/mlp.py``):

- ``EvaAttention.forward`` applies ``q_norm``/``k_norm`` first and RoPE after them,
  ``apply_rot_embed_cat(q[:, :, K:], rope, half=self.rotate_half)`` with ``K`` the
  attention's ``num_prefix_tokens``; the rotation layout is the attention's own
  ``rotate_half`` (``rope_rotate_half``, DINOv3), else timm's interleaved pairs (EVA-02).
  ``AttentionRope`` (``attn_type='rope'``) has the same maths (q/k norm, then RoPE on the
  patch rows, ``norm`` before ``proj``) with an ordinary ``qkv``/``k_proj`` bias: it is
  supported unless it is grouped-query (``num_kv_heads != num_heads``).
- ``Eva._pos_embed`` with ``no_embed_class=False`` concatenates ``[CLS, reg_1..reg_R]``
  before adding an absolute ``pos_embed`` of ``K + P`` rows, so in this timm register
  tokens *do* receive an absolute position when ``no_embed_class=False``; with
  ``no_embed_class=True`` only the patches do, and timm's DINOv3 configurations have no
  absolute embedding at all. The adapter runs ``_pos_embed`` itself, so either way the
  model's own order and additions are reproduced.
- ``GluMlp.forward`` splits ``fc1``'s output as ``x1, x2 = chunk(2)`` and computes
  ``act(x1) * x2`` when ``gate_last=False`` (``EvaBlock``'s packed SwiGLU, used when
  ``swiglu_mlp`` has neither ``scale_mlp`` nor ``swiglu_align_to``): the gate is the
  **first** half of ``fc1``'s rows, the value the second (``gate_last=True``: the
  reverse). Both halves become row views of ``fc1``'s parameters.

Refused with a ``TypeError`` naming the reason: post-norm blocks (``use_post_norm``),
``rope_type='mixed'`` (depth-dependent) and ``'mrope'``, gated attention, grouped-query
attention, ``global_pool`` other than ``'avg'``/``'token'``/``'map'`` (the attention pool
attends over every token, prefix included, as ``Eva.pool`` does) and head-less models
(``num_classes=0``).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from captum_vit.adapters._typing import ModelTree
from captum_vit.adapters.catalog import Example, register_family
from captum_vit.adapters.families._examples import timm_builder
from captum_vit.adapters.families._timm import (
    TimmViTBase,
    has_active_dropout,
    mlp_fields,
    optional_norm,
    pool_parts,
    timm_attention_fields,
    timm_classes,
    timm_gelus,
    timm_head,
)
from captum_vit.adapters.families._torch import is_loaded_instance
from captum_vit.adapters.ops import Ops
from captum_vit.adapters.parts import BlockParts, HeadParts, rotary_rows


def _gated_acts() -> tuple[type, ...]:
    return (nn.SiLU, nn.Sigmoid, nn.GELU, *timm_gelus())


def _eva_mlp_fields(mlp: ModelTree, where: str) -> dict:
    """BlockParts fields of an Eva MLP: ``Mlp`` (with its hidden norm), ``SwiGLU`` or the
    packed ``GluMlp`` (gate and value as row views of ``fc1``)."""
    GluMlp, Mlp, SwiGLU = timm_classes("timm.layers", "GluMlp", "Mlp", "SwiGLU")

    if type(mlp) is GluMlp:
        if not isinstance(mlp.fc1, nn.Linear) or not isinstance(mlp.act, _gated_acts()):
            raise TypeError(f"{where}.mlp is a convolutional GluMlp or has an unsupported "
                            f"gate activation {type(mlp.act).__name__}")
        w = mlp.fc1.weight.detach()
        b = None if mlp.fc1.bias is None else mlp.fc1.bias.detach()
        h = w.shape[0] // 2
        gate, value = (slice(h, None), slice(None, h)) if mlp.gate_last \
            else (slice(None, h), slice(h, None))  # gate_last=False: act(first half) * second
        return dict(fc1_weight=w[value], fc1_bias=None if b is None else b[value],
                    gate_weight=w[gate], gate_bias=None if b is None else b[gate],
                    act=mlp.act, mlp_norm=optional_norm(mlp.norm, f"{where}.mlp.norm"),
                    fc2_weight=mlp.fc2.weight, fc2_bias=mlp.fc2.bias)
    if type(mlp) is SwiGLU and isinstance(mlp.act, _gated_acts()):
        return mlp_fields(mlp, where)
    if type(mlp) is Mlp and isinstance(mlp.act, (nn.GELU, *timm_gelus())):
        return dict(mlp_fields(mlp, where),
                    mlp_norm=optional_norm(mlp.norm, f"{where}.mlp.norm"))
    raise TypeError(f"{where}.mlp is {type(mlp).__name__} with {type(mlp.act).__name__}; "
                    "captum_vit supports Eva's GELU `Mlp`, `SwiGLU` and `GluMlp`")


def _views_of(blk: ModelTree) -> tuple[Tensor, ...]:
    """The model parameters whose row views a block's parts hold (re-read on change)."""
    out = []
    if blk.attn.qkv is not None:
        out.append(blk.attn.qkv.weight)
        if blk.attn.qkv.bias is not None:
            out.append(blk.attn.qkv.bias)
    if hasattr(blk.mlp, "gate_last"):  # GluMlp
        out += [t for t in (blk.mlp.fc1.weight, blk.mlp.fc1.bias) if t is not None]
    return tuple(out)


_EVA = ("timm.models.eva", "Eva")
_SQUARE = (32, 32)


def is_timm_eva(model: nn.Module) -> bool:
    """``True`` for timm's ``Eva`` (EVA, EVA-02, DINOv3, ...)."""
    return is_loaded_instance(model, *_EVA)


@register_family(
    is_timm_eva,
    supports="timm Eva (EVA, EVA-02, DINOv3: RoPE, gated MLP)",
    tags=("classifier", "embedding", "variable-size"),
    notes=("EVA-01/EVA-02 (absolute + rotary position embedding, SwiGLU or packed GluMlp, inner "
           "attention norm, LayerScale), DINOv3-style (RoPE with rotate-half, registers, no "
           "absolute embedding), separate or fused q/k/v, q/k norm, `AttentionRope`, dynamic "
           "size, token/avg/map pooling: ✅ (RoPE only on patch rows, from timm's own tables; "
           "under token removal and TIS a kept token keeps the RoPE row of its original "
           "position; TokenTM applies the inner norm's frozen linear map) — refused: post-norm "
           "blocks, depth-dependent (`mixed`) RoPE, `mrope`, gated or grouped-query attention"),
    examples={
        "eva02": Example(timm_builder(*_EVA, _SQUARE, use_rot_pos_emb=True, rope_type="cat",
                                      swiglu_mlp=True, scale_mlp=True, scale_attn_inner=True,
                                      global_pool="avg"), _SQUARE),
        "eva_dinov3": Example(timm_builder(
            *_EVA, (24, 40), use_rot_pos_emb=True, rope_type="dinov3", rope_rotate_half=True,
            rope_temperature=100, use_abs_pos_emb=False, num_reg_tokens=4, init_values=1e-5,
            global_pool="token", use_fc_norm=False, dynamic_img_size=True), (24, 40)),
        "eva_map": Example(timm_builder(*_EVA, _SQUARE, use_rot_pos_emb=True, swiglu_mlp=True,
                                        scale_attn_inner=True, global_pool="map"), _SQUARE),
        "eva_headless_map": Example(timm_builder(*_EVA, _SQUARE, num_classes=0,
                                                 use_rot_pos_emb=True, swiglu_mlp=True,
                                                 global_pool="map"),
                                    _SQUARE, target="embedding"),
    })
class TimmEvaAdapter(TimmViTBase):
    """Canonical view of a timm ``Eva`` classifier (never modified).

    Supports ``EvaBlock`` with ``EvaAttention`` (fused ``qkv`` with ``q_bias``/``v_bias``,
    or separate projections) or non-grouped ``AttentionRope``; optional q/k norm; RoPE
    ``rope_type='cat'`` (EVA-02) and ``'dinov3'`` (``rope_rotate_half``); the inner
    attention norm (``scale_attn_inner``); ``Mlp``/``SwiGLU``/``GluMlp`` with optional
    hidden norm (``scale_mlp``); LayerScale; class and register tokens;
    ``no_embed_class``; absolute position embedding present or absent;
    ``dynamic_img_size``; ``global_pool='avg'`` or ``'token'``.

    Args:
        model (torch.nn.Module): a timm ``Eva`` with ``num_classes > 0``.

    Raises:
        TypeError: for the configurations listed in the module docstring.
    """

    def __init__(self, model: ModelTree) -> None:
        (AttentionRope,) = timm_classes("timm.layers", "AttentionRope")
        RotaryEmbeddingCat, RotaryEmbeddingDinoV3 = timm_classes(
            "timm.layers.pos_embed_sincos", "RotaryEmbeddingCat", "RotaryEmbeddingDinoV3")
        EvaAttention, EvaBlock, EvaBlockPostNorm = timm_classes(
            "timm.models.eva", "EvaAttention", "EvaBlock", "EvaBlockPostNorm")

        self.model = model
        name = type(model).__name__
        if len(model.blocks) == 0:
            raise TypeError(f"{name} has no transformer blocks")
        if getattr(model, "rope_mixed", False):
            raise TypeError("rope_type='mixed' (a depth-dependent learned RoPE, "
                            "model.rope_mixed) is not supported; captum_vit supports Eva's "
                            "rope_type='cat' and 'dinov3'")
        rope = getattr(model, "rope", None)
        if rope is not None and type(rope) not in (RotaryEmbeddingCat, RotaryEmbeddingDinoV3):
            kind = "rope_type='mrope'" if "MRope" in type(rope).__name__ else type(rope).__name__
            raise TypeError(f"{kind} ({name}.rope is {type(rope).__name__}) is not supported; "
                            "captum_vit supports Eva's rope_type='cat' and 'dinov3'")
        self.num_prefix = int(model.num_prefix_tokens)
        for i, blk in enumerate(model.blocks):
            where = f"{name}.blocks[{i}]"
            if isinstance(blk, EvaBlockPostNorm):
                raise TypeError(f"{where} is EvaBlockPostNorm (use_post_norm=True): post-norm "
                                "blocks are not supported; captum_vit supports pre-norm EvaBlock")
            if type(blk) is not EvaBlock:
                raise TypeError(f"{where} is {type(blk).__name__}; captum_vit supports timm's "
                                "pre-norm EvaBlock")
            attn = blk.attn
            if type(attn) not in (EvaAttention, AttentionRope):
                raise TypeError(f"{where}.attn is {type(attn).__name__}; captum_vit supports "
                                "EvaAttention and AttentionRope")
            if getattr(attn, "gate", None) is not None:
                raise TypeError(f"{where}.attn is gated attention (gated_attn=True, a sigmoid "
                                "gate on the head outputs); not supported")
            if getattr(attn, "num_kv_heads", attn.num_heads) != attn.num_heads:
                raise TypeError(f"{where}.attn is grouped-query attention (num_kv_heads="
                                f"{attn.num_kv_heads} != num_heads={attn.num_heads}); not "
                                "supported")
            if int(attn.num_prefix_tokens) != self.num_prefix:
                raise TypeError(f"{where}.attn leaves {attn.num_prefix_tokens} rows unrotated "
                                f"but the model has {self.num_prefix} prefix tokens")
        self._rope: tuple[int, Tensor] | None = None  # (patch tokens, table) of the last embed
        self._gathered: tuple[Tensor, Tensor, Tensor] | None = None  # (positions, table, rows)
        self.blocks = [self._parts(blk, f"{name}.blocks[{i}]")
                       for i, blk in enumerate(model.blocks)]
        self._sources = [tuple(t.data_ptr() for t in _views_of(blk)) for blk in model.blocks]
        self.in_chans = int(model.patch_embed.proj.in_channels)

        head = timm_head(model.head, f"{name}.head")
        self.embedding = head[0] is None
        pool = getattr(model, "attn_pool", None)
        if pool is None and model.global_pool not in ("avg", "token"):
            raise TypeError(f"global_pool={model.global_pool!r} is not supported for Eva; use "
                            "'avg' (mean of the patch tokens), 'token' (class token) or "
                            "'map' (attention pool)")
        self.readout = "map" if pool is not None else model.global_pool
        row: int | str = 0 if self.readout == "token" else self.readout  # or "avg", "map"
        # Eva's attention pool attends over every token, prefix included (Eva.pool)
        self.head = HeadParts(optional_norm(model.norm, f"{name}.norm"),
                              optional_norm(model.fc_norm, f"{name}.fc_norm"),
                              ((row, *head),),
                              attn_pool=None if pool is None
                              else pool_parts(pool, f"{name}.attn_pool"))

    # -- parts ------------------------------------------------------------------------------
    def _parts(self, blk: ModelTree, where: str) -> BlockParts:
        attn = blk.attn
        rotary = None
        if self.model.rope is not None:
            rotary = functools.partial(self._rotate, half=bool(getattr(attn, "rotate_half",
                                                                       False)))
        return BlockParts(
            **timm_attention_fields(blk, where), ls1=blk.gamma_1,
            **_eva_mlp_fields(blk.mlp, where), ls2=blk.gamma_2, rotary=rotary,
            inner_norm=optional_norm(attn.norm, f"{where}.attn.norm"),
        )

    def refresh(self) -> None:
        name = type(self.model).__name__
        for i, blk in enumerate(self.model.blocks):
            now = tuple(t.data_ptr() for t in _views_of(blk))
            if now != self._sources[i]:  # storage replaced (model.to): re-read the views
                self.blocks[i] = self._parts(blk, f"{name}.blocks[{i}]")
                self._sources[i] = now

    # -- rotary position embedding ----------------------------------------------------------
    def _table(self) -> tuple[int, Tensor]:
        """``(P, [P, 2d] table)``: a fixed-size model's own table (what its ``_pos_embed``
        returns, read afresh so it follows ``model.to``), else that of the last embedded
        input."""
        m = self.model
        if not m.dynamic_img_size:
            table = m.rope.get_embed() if hasattr(m.rope, "feat_shape") \
                else m.rope.get_embed(shape=m.patch_embed.grid_size)
            return int(table.shape[0]), table
        if self._rope is None:
            raise ValueError("the rotary embedding depends on the input grid of this "
                             "dynamic_img_size model: get the token states from "
                             "adapter.embed(images) before running the blocks")
        return self._rope

    def _rotate(self, h: Tensor, positions: Tensor | None, *, half: bool) -> Tensor:
        """timm's RoPE on the patch rows of ``h`` [B, H, n, d] (prefix rows unrotated): the rows of
        the tokens' original ``positions`` [B, n] (``None``: the full sequence)."""
        apply_keep_indices_nlc, apply_rot_embed_cat = timm_classes(
            "timm.layers", "apply_keep_indices_nlc", "apply_rot_embed_cat")

        k = self.num_prefix
        num, table = self._table()
        table = table.to(h.device)
        if positions is None:
            rotary_rows(None, h.shape[2], k, num, h.device)
            rope = table
        else:
            cached = self._gathered
            if cached is not None and cached[0] is positions and cached[1] is table:
                rope = cached[2]
            else:
                idx = rotary_rows(positions, h.shape[2], k, num, h.device)
                rope = apply_keep_indices_nlc(h, table, idx).unsqueeze(1)  # [B, 1, n-K, 2d]
                self._gathered = (positions, table, rope)
        rotated = apply_rot_embed_cat(h[:, :, k:], rope, half=half)
        return torch.cat([h[:, :, :k], rotated], dim=2).type_as(h)  # as timm's type_as(v)

    # -- embedding and checks -------------------------------------------------------------
    def embed(self, inputs: Tensor, ops: Ops | None = None) -> Tensor:
        """The model's ``patch_embed``, ``_pos_embed`` (keeping its rotary table) and
        ``norm_pre``; with ``ops`` the patch projection and the norms through it
        (:meth:`ViTAdapter.embed`)."""
        self.refresh()
        m = self.model
        x = self._patch_embed(inputs, ops)
        x, rope = m._pos_embed(x)  # the model's own order and additions, and its RoPE table
        x = self._norm_pre(x, ops)
        if rope is not None:
            if rope.dim() != 2:
                raise ValueError("the model dropped patches while embedding (training mode "
                                 "with patch_drop_rate > 0); call model.eval() first")
            num = x.shape[1] - self.num_prefix
            if rope.shape[0] != num:
                raise ValueError(f"{type(m).__name__}'s rotary table has {rope.shape[0]} rows "
                                 f"for {num} patch tokens")
            self._rope = (num, rope)
        return x

    def is_random(self) -> bool:
        m = self.model
        drop = getattr(m, "patch_drop", None)
        rope = getattr(m, "rope", None)
        return (has_active_dropout(m)
                or (drop is not None and drop.training and drop.prob > 0)
                or (rope is not None and rope.training and getattr(rope, "aug_active", False)))

    def parameter_stages(self) -> list[list[nn.Parameter]]:
        """Head stage (``norm``, ``fc_norm``, ``head``), then blocks ``L-1 .. 0``; the
        embedding (patch embedding, class/register tokens, position embedding,
        ``norm_pre``) belongs to no stage and the RoPE tables have no parameters."""
        m = self.model
        head = (m.norm, m.attn_pool, m.fc_norm, m.head)
        stages = [[p for mod in head if mod is not None for p in mod.parameters()]]
        return stages + [list(blk.parameters()) for blk in reversed(m.blocks)]
