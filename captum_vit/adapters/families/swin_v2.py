"""Adapters for Swin Transformer V2 (Liu et al., CVPR 2022): timm's ``SwinTransformerV2`` and
Hugging Face's ``Swinv2ForImageClassification`` / ``Swinv2Model``.

Only this file knows Swin V2's attribute names. Read from the installed timm
(``timm/models/swin_transformer_v2.py``, 1.0.31) and transformers
(``models/swinv2/modeling_swinv2.py``, 5.x), a Swin V2 differs from a Swin (v1,
:mod:`captum_vit.adapters.families.swin`) in four places, each read here into the
canonical block (:class:`~captum_vit.adapters.parts.BlockParts`):

- **Scaled cosine attention.** The logits of head ``h`` are
  :math:`\\cos(q_i, k_j)\\, e^{\\min(\\tau_h, \\log 100)} + B_{ij}`: ``q`` and ``k`` are
  L2-normalised per head (``F.normalize``, eps 1e-12) and ``q`` is multiplied by the
  clamped temperature (``logit_scale``, ``[H, 1, 1]``); the softmax scale is 1. In the
  canonical block these are the q/k norms
  (:class:`~captum_vit.adapters.parts.CosineNorm`; the LRP rules treat them like a
  LayerNorm, norm detached).
- **Continuous position bias.** :math:`B = 16\\,\\sigma(\\mathrm{CPB}(\\hat c))` with a
  two-layer ReLU MLP (``cpb_mlp`` / ``continuous_position_bias_mlp``, 512 hidden units, no
  output bias) over the log-spaced relative coordinates
  :math:`\\hat c = \\mathrm{sign}(c) \\log_2(1 + 8 |c| / (P - 1)) / 3`, gathered by the
  relative position index. ``P`` is the *pretrained* window size where the model was
  built with one (``pretrained_window_sizes``, per stage), else the block's own window:
  both libraries compute the table once, in float32, at construction (timm floors the
  divisor at 1, Hugging Face does not and divides by the window only when it is larger
  than 1); :class:`ContinuousPositionBias` reads the model's own buffers and MLP, so it
  is what the model adds for either.
- **Residual post-norm.** ``x_mid = x + LN(attn(x))``, ``x_{l+1} = x_mid + LN(MLP(x_mid))``:
  no norm before the branches (``norm1 = norm2 = None`` in the canonical block) and one on
  each branch's output (``post_norm1`` / ``post_norm2``, timm's ``norm1`` / ``norm2``,
  Hugging Face's ``layernorm_before`` / ``layernorm_after`` — the latter names notwithstanding,
  both are applied after their branch). DecompX decomposes through them with its
  LayerNorm rule, AttnLRP/CP-LRP apply their LN rule (they are ``ops.norm`` calls).
- **Patch merging reduces, then norms:** ``y = LN(concat(x_{c_1..c_4}) W)`` (LayerNorm over
  ``2C``; :attr:`~captum_vit.adapters.windows.MergeParts.norm_last`); the children's order
  is Swin's (``MERGE_ORDER``) in both libraries.

Windows are as in Swin v1: each block's window and shift as the model resolved them
(clamped to a stage grid not larger than the window, shift 0 there), the grid padded to
whole windows — **timm rolls, then pads; Hugging Face pads, then rolls** (``pad_first``),
so with padding and a shift the two differ and each adapter follows its model — and the
seam mask between regions of the rolled grid: ``-100`` in timm; **Hugging Face adds its
mask twice** (``Swinv2SelfAttention.forward`` adds ``attention_mask`` in the reshaped sum and
again after it), so its seam logit is ``-200``. Both are ``exp(-100) ≈ 4e-44`` or less of
a probability: the twins' maps agree to far below 1e-10.

The tokens have no prefix rows, the maps land on the first stage's grid and the logits
read the mean of the final stage's tokens after the final norm (``readout="avg"``); inputs
must have the configured size (``img_size`` / ``image_size``). True token removal (TIS)
is refused by name as for every windowed model.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor, nn

from captum_vit.adapters._typing import ModelTree
from captum_vit.adapters.base import ViTAdapter
from captum_vit.adapters.catalog import Example, register_family
from captum_vit.adapters.families._examples import library, seeded_model, twin_builder
from captum_vit.adapters.families._hf import (
    HFSwinBase,
    is_transformers_model,
    pair,
    swin_twin_config,
    swin_twin_weights,
)
from captum_vit.adapters.families._timm import (
    TimmSwinBase,
    gelu_mlp_fields,
    timm_classes,
)
from captum_vit.adapters.families._torch import is_loaded_instance
from captum_vit.adapters.parts import BlockParts, CosineNorm, require_timm
from captum_vit.adapters.parts import layer_norm_parts as _norm_parts
from captum_vit.adapters.windows import Windows

HF_SWIN_V2_CLASSES = ("Swinv2ForImageClassification", "Swinv2Model")
"""The Hugging Face Swin V2 classes :class:`HFSwinV2Adapter` reads."""


def is_timm_swin_v2(model: nn.Module) -> bool:
    """``True`` for timm's ``SwinTransformerV2`` (not ``SwinTransformerV2Cr``)."""
    return is_loaded_instance(model, "timm.models.swin_transformer_v2", "SwinTransformerV2")


def is_hf_swin_v2(model: nn.Module) -> bool:
    """``True`` for Hugging Face ``Swinv2ForImageClassification`` / ``Swinv2Model``;
    transformers is never imported for other models."""
    return is_transformers_model(model, HF_SWIN_V2_CLASSES)


class ContinuousPositionBias:
    """Swin V2's continuous relative position bias of one window, ``() -> [1, H, M, M]``,
    computed by the model's own MLP from its own coordinate table and index buffers
    (``16 · sigmoid(MLP(table))`` gathered by the index, as both libraries' forward).

    Args:
        attn (nn.Module): the window attention (timm's ``WindowAttention``, Hugging
            Face's ``Swinv2SelfAttention``): its ``relative_coords_table`` and
            ``relative_position_index`` buffers.
        mlp (nn.Module): its position-bias MLP.
        num_heads (int): ``H``.
    """

    def __init__(self, attn: nn.Module, mlp: nn.Module, num_heads: int) -> None:
        self.attn, self.mlp, self.num_heads = attn, mlp, num_heads

    def __call__(self) -> Tensor:
        attn = cast(ModelTree, self.attn)
        table = self.mlp(attn.relative_coords_table).view(-1, self.num_heads)
        index = attn.relative_position_index
        m = index.shape[0]
        bias = table[index.view(-1)].view(m, m, -1).permute(2, 0, 1).contiguous()
        return (16 * torch.sigmoid(bias))[None]



def _cosine(logit_scale: Tensor) -> dict[str, Any]:
    """The q/k norms and softmax scale of cosine attention with ``logit_scale``."""
    return dict(q_norm=CosineNorm(logit_scale.detach(), math.log(1.0 / 0.01)),
                k_norm=CosineNorm(None), scale=1.0)


def _example(**extra: Any) -> Callable[..., nn.Module]:
    """A builder of a small timm ``SwinTransformerV2`` (32x32 unless ``extra`` says, patch
    4, width 16, heads (2, 4), window 4, two stages of two blocks unless ``depths=``);
    ``extra`` and build-time ``overrides`` go to the constructor (``depth`` is not used).
    The temperatures are drawn around ``log 10`` (the models' initial value), so the
    cosine attention is far from uniform."""
    def build(*, seed: int = 0, depth: int = 3, dtype: torch.dtype = torch.float64,
              num_classes: int = 5, depths: tuple[int, ...] = (2, 2),
              **overrides: Any) -> nn.Module:
        heads = (2, 4)[:len(depths)] if len(depths) <= 2 else (2,) * len(depths)
        kwargs: dict[str, Any] = dict(img_size=(32, 32), patch_size=4, in_chans=3,
                                      embed_dim=16, depths=depths, num_heads=heads,
                                      window_size=4, mlp_ratio=2.0, num_classes=num_classes,
                                      drop_path_rate=0.0)
        model = seeded_model("timm.models.swin_transformer_v2", "SwinTransformerV2", seed,
                             **{**kwargs, **extra, **overrides})
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("logit_scale"):
                    p.copy_(math.log(10.0) + 0.5 * torch.randn(p.shape, generator=g))
        return model.to(dtype).eval()

    return build


@register_family(
    is_timm_swin_v2,
    name="timm_swinv2",
    supports="timm SwinTransformerV2 (not SwinTransformerV2Cr), at the configured size",
    tags=("classifier", "windowed", "hierarchical"),
    notes=("Scaled cosine attention (L2-normed q/k, clamped learned temperature), continuous "
           "position bias (an MLP over log-spaced coordinates, pretrained window sizes "
           "included), residual post-norm blocks and reduce-then-norm merges (read through "
           "`adapters/families/swin_v2.py`), windows as Swin's; the configured `img_size`: "
           "✅ every method as on Swin (maps on the first stage's grid) — refused by name: TIS "
           "and true token removal (use RISE / ViT-CX and the metrics' pixel removal), "
           "`SwinTransformerV2Cr`, other input sizes"),
    examples={
        "timm_swinv2": Example(_example(), (32, 32)),
        # a 10x10 grid padded to whole windows of 4, an odd 5x5 second stage, and
        # pretrained window sizes (the position table scaled to another window)
        "timm_swinv2_pad": Example(_example(img_size=(40, 40), pretrained_window_sizes=(6, 3)),
                                   (40, 40), suite=False),
    })
class TimmSwinV2Adapter(TimmSwinBase):
    """Canonical view of a timm ``SwinTransformerV2``: windowed post-norm blocks with cosine
    attention, reduce-then-norm merges between stages, mean readout
    (:mod:`captum_vit.adapters.families.swin_v2`).

    The q/k/v parts are row views of each block's fused ``qkv`` weight with the model's
    ``q_bias`` / ``k_bias`` (a zero buffer) / ``v_bias``; the position bias is computed by
    the block's own ``cpb_mlp``; the model is never changed.

    Raises:
        TypeError: timm older than 1.0.31, a head without global average pooling, or
            blocks / merges of another kind.
    """

    model: ModelTree  # read by attribute names (captum_vit.adapters._typing)

    def __init__(self, model: ModelTree) -> None:
        super().__init__()
        name = type(model).__name__
        require_timm((1, 0, 31), name, "sizes a stage's windows differently where its grid is "
                     "smaller than the window (timm 1.0.31 resolves one window size per stage)")
        (Block,) = timm_classes("timm.models.swin_transformer_v2", "SwinTransformerV2Block")
        self._adopt(model, Block, "Swin V2")

    def _read_parts(self) -> None:
        """The canonical parts of every block and of the head (views of the model)."""
        (Merging,) = timm_classes("timm.models.swin_transformer_v2", "PatchMerging")
        parts: list[BlockParts] = []
        for where, blk, merge in self._blocks_and_merges(Merging, norm_last=True):
            attn = blk.attn
            w = attn.qkv.weight.detach()
            a = w.shape[0] // 3
            heads = int(attn.num_heads)
            parts.append(BlockParts(
                norm1=None, norm2=None,
                q_weight=w[:a], k_weight=w[a:2 * a], v_weight=w[2 * a:],
                q_bias=attn.q_bias, k_bias=attn.k_bias, v_bias=attn.v_bias,
                num_heads=heads, head_dim=a // heads, **_cosine(attn.logit_scale),
                proj_weight=attn.proj.weight, proj_bias=attn.proj.bias,
                **gelu_mlp_fields(blk.mlp, where),
                attn_bias=ContinuousPositionBias(attn, attn.cpb_mlp, heads),
                window=Windows(grid=pair(blk.input_resolution), size=pair(blk.window_size),
                               shift=pair(blk.shift_size)),
                merge=merge,
                post_norm1=_norm_parts(blk.norm1, f"{where}.norm1"),
                post_norm2=_norm_parts(blk.norm2, f"{where}.norm2")))
        self.blocks = parts
        self._read_head()


def hf_swin_v2_twin(timm_model: nn.Module, *, pooled: bool = False) -> nn.Module:
    """The Hugging Face ``Swinv2ForImageClassification`` (``pooled``: ``Swinv2Model``) with
    the weights of a timm ``SwinTransformerV2`` (same shapes, same dtype), eval mode.

    The mapping: ``qkv.weight`` split into ``query``/``key``/``value`` (``q_bias`` and
    ``v_bias`` to the query's and value's biases; Hugging Face's key has none, timm's is a
    zero buffer), ``logit_scale`` and ``cpb_mlp`` to ``logit_scale`` and
    ``continuous_position_bias_mlp``, ``proj`` to ``attention.output.dense``, the
    post-norms ``norm1``/``norm2`` to ``layernorm_before``/``layernorm_after``, ``mlp.fc1``
    / ``fc2`` to ``intermediate.dense`` / ``output.dense``, stage ``s``'s ``downsample`` to
    stage ``s - 1``'s (Hugging Face merges at the end of a stage).

    Args:
        timm_model (nn.Module): a timm ``SwinTransformerV2`` with one window size for all
            stages.
        pooled (bool, optional): build the head-less ``Swinv2Model``. Default ``False``.

    Returns:
        nn.Module: the twin.

    Raises:
        ValueError: the weights do not map (another layout).
    """
    transformers = library("transformers")
    m = cast(ModelTree, timm_model)
    cfg = transformers.Swinv2Config(
        **swin_twin_config(timm_model), hidden_act="gelu",
        pretrained_window_sizes=[st.blocks[0].attn.pretrained_window_size[0]
                                 for st in m.layers])
    cls = transformers.Swinv2Model if pooled else transformers.Swinv2ForImageClassification
    hf = cls(cfg).to(next(timm_model.parameters()).dtype).eval()
    src = timm_model.state_dict()
    pre = "" if pooled else "swinv2."
    out = swin_twin_weights(timm_model, pre, pooled)
    for s, st in enumerate(m.layers):
        for j in range(len(st.blocks)):
            a, b = f"layers.{s}.blocks.{j}.", f"{pre}encoder.layers.{s}.blocks.{j}."
            att = f"{b}attention.self."
            for k in ("weight", "bias"):
                out[f"{b}intermediate.dense.{k}"] = src[f"{a}mlp.fc1.{k}"]
                out[f"{b}output.dense.{k}"] = src[f"{a}mlp.fc2.{k}"]
                out[f"{b}attention.output.dense.{k}"] = src[f"{a}attn.proj.{k}"]
            for nm, t in zip(("query", "key", "value"), src[f"{a}attn.qkv.weight"].chunk(3),
                             strict=True):
                out[f"{att}{nm}.weight"] = t
            out[f"{att}query.bias"] = src[f"{a}attn.q_bias"]
            out[f"{att}value.bias"] = src[f"{a}attn.v_bias"]
            out[f"{att}logit_scale"] = src[f"{a}attn.logit_scale"]
            for k in ("0.weight", "0.bias", "2.weight"):
                out[f"{att}continuous_position_bias_mlp.{k}"] = src[f"{a}attn.cpb_mlp.{k}"]
    missing, unexpected = hf.load_state_dict(out, strict=False)
    if unexpected or missing:
        raise ValueError(f"the timm weights do not map onto {cls.__name__}: missing "
                         f"{missing}, unexpected {unexpected}")
    return hf


def _twin_example(*, pooled: bool = False, **extra: Any) -> Callable[..., nn.Module]:
    """A builder of the Hugging Face twin (:func:`hf_swin_v2_twin`; ``pooled``: the
    head-less ``Swinv2Model``) of a timm Swin V2 example."""
    return twin_builder(_example(**extra), hf_swin_v2_twin, pooled=pooled)


@register_family(
    is_hf_swin_v2,
    name="hf_swinv2",
    supports="Hugging Face Swinv2ForImageClassification and Swinv2Model (at the configured "
             "size)",
    tags=("classifier", "embedding", "windowed", "hierarchical"),
    notes=("`Swinv2ForImageClassification`; `Swinv2Model` through its `pooler_output`, with "
           "vector targets: ✅ as timm's Swin V2 (maps equal a timm twin's to 1e-10 where the "
           "windows divide the grids — with padding and a shift Hugging Face pads before the "
           "roll, timm after, and each adapter follows its model; Hugging Face's seam mask is "
           "-200, added twice) — refused: as timm's Swin V2, `Swinv2Backbone`, "
           "`Swinv2ForMaskedImageModeling`, other input sizes"),
    examples={
        "hf_swinv2": Example(_twin_example(), (32, 32), library="transformers",
                             tags=("matrix",), suite=False),
        # a support-matrix column: the head-less Swinv2Model twin of timm_swinv2
        "hf_swinv2_model": Example(_twin_example(pooled=True), (32, 32),
                                   library="transformers", target="embedding",
                                   tags=("matrix",), suite=False),
    })
class HFSwinV2Adapter(HFSwinBase, TimmSwinV2Adapter):
    """Canonical view of a Hugging Face ``Swinv2ForImageClassification`` or ``Swinv2Model``
    (an image embedding: its ``pooler_output``), the second reader of the same canonical
    form as :class:`TimmSwinV2Adapter`: separate ``query``/``key``/``value``, the grid
    padded before the cyclic shift, the seam logit ``-200`` (the mask added twice), the
    patch merge at the end of a stage. Inputs must have the configured ``image_size``.

    Raises:
        TypeError: a ``Swinv2Model`` without pooling layer, or a layer of another kind.
    """

    backbone: ModelTree  # read by attribute names (captum_vit.adapters._typing)

    def __init__(self, model: ModelTree) -> None:  # noqa: D107 - documented on the class
        ViTAdapter.__init__(self)
        self._adopt_hf(model, "swinv2")

    def _read_parts(self) -> None:
        name = type(self.model).__name__
        parts: list[BlockParts] = []
        for where, layer, grid, merge in self._layers_and_merges(norm_last=True):
            attn, heads = layer.attention.self, int(layer.attention.self.num_attention_heads)
            dense = layer.attention.output.dense
            ws, shift = int(layer.window_size), int(layer.shift_size)  # the model's own
            parts.append(BlockParts(
                norm1=None, norm2=None,
                q_weight=attn.query.weight, k_weight=attn.key.weight,
                v_weight=attn.value.weight, q_bias=attn.query.bias,
                k_bias=attn.key.bias, v_bias=attn.value.bias, num_heads=heads,
                head_dim=int(attn.attention_head_size), **_cosine(attn.logit_scale),
                proj_weight=dense.weight, proj_bias=dense.bias,
                ls1=None, fc1_weight=layer.intermediate.dense.weight,
                fc1_bias=layer.intermediate.dense.bias,
                act=layer.intermediate.intermediate_act_fn,
                fc2_weight=layer.output.dense.weight, fc2_bias=layer.output.dense.bias,
                ls2=None,
                attn_bias=ContinuousPositionBias(attn, attn.continuous_position_bias_mlp,
                                                 heads),
                window=Windows(grid=grid, size=(ws, ws), shift=(shift, shift),
                               pad_first=True, seam=-200.0),
                merge=merge,
                post_norm1=_norm_parts(layer.layernorm_before, f"{where}.layernorm_before"),
                post_norm2=_norm_parts(layer.layernorm_after, f"{where}.layernorm_after")))
        if not parts:
            raise TypeError(f"{name} has no Swin V2 layers")
        self.blocks = parts
        self._read_hf_head("swinv2")

    def refresh(self) -> None:
        first = self.backbone.encoder.layers[0].blocks[0].attention.self.query.weight
        if self.blocks[0].q_weight is not first:  # a parameter was replaced
            self._read_parts()
