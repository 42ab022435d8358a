"""Adapters for Hiera (Ryali et al., ICML 2023): timm's ``Hiera`` and Hugging Face's
``HieraModel`` / ``HieraForImageClassification``.

Only this file knows Hiera's attribute names. What the two implementations compute
(verified in ``timm/models/hiera.py`` and ``transformers/models/hiera/modeling_hiera.py``):

- **Token order.** After the patch embedding (a ``7×7`` convolution of stride 4 and padding
  3: overlapping patches) and the absolute position embedding, the tokens are *unrolled*:
  each of the ``S - 1`` unroll steps (``S`` stages, query stride ``2×2``) moves the 2×2
  phase of the grid to the front, so after them token ``(y, x)`` of the ``(h, w)`` grid,
  ``y = 2^{S-1} Y + … + 2 a_2 + a_1``, sits at the flat index whose most significant
  digits are ``(a_1, b_1)``, then ``(a_2, b_2)``, …, and whose least significant are the
  raster index of ``(Y, X)`` on the ``(h/2^{S-1}, w/2^{S-1})`` grid. Intermediate states
  are *rerolled* to raster order for the feature maps (``Reroll`` / ``HieraEncoder.reroll``);
  once every unroll step is consumed by a query pooling the order is raster again.
- **Mask-unit attention.** A block with ``use_mask_unit_attn`` and ``T = q_stride ·
  window_size`` tokens per window splits its ``N`` tokens into ``N / T`` windows by flat
  index modulo ``N / T``: with ``k`` unroll steps left, the tokens of one window are the
  ``2^k × 2^k`` block of the grid at ``(Y, X)`` (the mask unit, ``8×8`` tokens in the
  first stage of Hiera-T), so the attention is windowed attention on the raster grid
  (:class:`~captum_vit.adapters.windows.Windows` of side ``2^k``, no shift, no position
  bias: inside a window the order of the slots does not matter). Other blocks attend
  globally (here: one window of the whole grid). The first block of a stage uses the
  previous stage's kind (both libraries lag the switch by one block).
- **Query pooling.** The first block of each of the ``num_query_pool`` later stages takes
  ``q`` and the residual ``proj(LN1(x))`` through ``view(B, 4, N/4, C).amax(1)`` (inside
  the windows for ``q``): with the 2×2 phase as the leading digits this is the channel-wise
  maximum over each 2×2 group of the grid
  (:class:`~captum_vit.adapters.windows.QueryPool`); keys and values stay on the input grid.
  The block's output lies on the ``(h/2, w/2)`` grid.
- **Head.** The mean of the last tokens, then a LayerNorm, then the classifier (timm's
  ``ClNormMlpClassifierHead``, Hugging Face's ``HieraPooler`` + ``classifier``).

The canonical form keeps every state in *raster* order of its stage's grid (never
unrolled): the embedding is the model's own patch embedding and position embedding,
every block has a :class:`~captum_vit.adapters.windows.Windows` (the mask units, or one
window of the whole grid for global attention) and the pooling blocks a
:class:`~captum_vit.adapters.windows.QueryPool`; the maps land on the first stage's grid
(``56 × 56`` for Hiera-T at 224 px). Pooling is piecewise linear: DecompX and the LRP
rules pass the maximum exactly (each channel takes its maximal child's decomposition or
relevance). The matrix methods carry row vectors through a pooling block as
``vᵀ(R + Ā)``: ``Ā`` per mask unit with the pooled queries as rows
(:meth:`~captum_vit.adapters.stages.Stages.token_mix`) and ``R`` the residual's pooling,
each child weighted by its share of the channels where it is the maximum (the maximum's
sub-gradient averaged over the channels, ¼ each on exact ties;
:meth:`~captum_vit.adapters.stages.Stages.residual`); TokenTM's, BT's and GlobEnc/ALTI's
chains use the same ``R`` (GlobEnc/ALTI decompose a pooling block through the DecompX
rules), and LeGrad reads the last stage from its pooling block on. TIS (true token
removal) refuses by name: the mask units need every token.

Refused by name: inputs of another size than the configured one (the position embedding
and the unroll are fixed; a size not a multiple of the mask unit is named as such),
``use_expand_proj=False``, a stage change without query pooling, a query stride other
than ``2×2``, an MLP head (``head_hidden_size``), pooling other than the average.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor, nn

from captum_vit.adapters._typing import ModelTree
from captum_vit.adapters.base import ViTAdapter
from captum_vit.adapters.catalog import Example, register_family
from captum_vit.adapters.families._examples import library, seeded_model, twin_builder
from captum_vit.adapters.families._hf import is_transformers_model
from captum_vit.adapters.families._timm import (
    has_active_dropout,
    timm_classes,
    timm_gelus,
    timm_head,
)
from captum_vit.adapters.families._torch import conv_projection, is_loaded_instance
from captum_vit.adapters.layout import Layout
from captum_vit.adapters.ops import Ops
from captum_vit.adapters.parts import BlockParts, HeadParts
from captum_vit.adapters.parts import layer_norm_parts as _norm_parts
from captum_vit.adapters.windows import QueryPool, Windows

HF_HIERA_CLASSES = ("HieraForImageClassification", "HieraModel")
"""The Hugging Face Hiera classes :class:`HFHieraAdapter` reads."""


def is_timm_hiera(model: nn.Module) -> bool:
    """``True`` for timm's ``Hiera``."""
    return is_loaded_instance(model, "timm.models.hiera", "Hiera")


def is_hf_hiera(model: nn.Module) -> bool:
    """``True`` for Hugging Face ``HieraForImageClassification`` / ``HieraModel``."""
    return is_transformers_model(model, HF_HIERA_CLASSES)


class _HieraBase(ViTAdapter):
    """What the timm and Hugging Face readers share: the geometry of the stages (windows and
    query pooling from each block's attention settings), the size checks and the layout."""

    grid0: tuple[int, int]
    """The first stage's token grid."""
    stride: tuple[int, int]
    """The patch embedding's stride in pixels."""
    levels: int
    """The unroll steps ``S - 1`` (the mask unit's side is ``2^levels`` tokens)."""
    image_size: tuple[int, int]

    def _geometry(self, name: str, layers: list[tuple[str, ModelTree, Any, int, bool, int]]
                  ) -> list[tuple[Windows, QueryPool | None]]:
        """Each block's key windows and query pooling from ``(where, block, proj, q_stride,
        mask_unit, window_size)`` in order (``proj``: the residual projection or ``None``)."""
        grid, left = self.grid0, self.levels
        out: list[tuple[Windows, QueryPool | None]] = []
        for where, _blk, proj, q_stride, mask_unit, window_size in layers:
            if q_stride not in (1, 4):
                raise TypeError(f"{where} pools queries with a flat stride {q_stride}; "
                                "captum_vit supports Hiera's 2x2 query pooling")
            if mask_unit:
                if q_stride * window_size != 4 ** left:
                    raise TypeError(
                        f"{where}'s mask units of {q_stride * window_size} tokens are not "
                        f"the {2 ** left}x{2 ** left} blocks of its unrolled grid; captum_vit "
                        "supports mask units that match the unroll schedule "
                        "(mask_unit_size = q_stride ** (stages - 1))")
                win = Windows(grid=grid, size=(2 ** left, 2 ** left))
            else:
                win = Windows(grid=grid, size=grid)
            pool = None
            if q_stride == 4:
                if proj is None:
                    raise TypeError(f"{where} pools without a residual projection "
                                    "(use_expand_proj=False); captum_vit supports Hiera's "
                                    "projected residual")
                pool = QueryPool(grid=grid, weight=proj.weight, bias=proj.bias)
                grid, left = pool.out_grid, left - 1
            elif proj is not None:
                raise TypeError(f"{where} changes the width without query pooling "
                                "(q_pool < stages - 1); captum_vit supports Hiera with a "
                                "query pooling at every stage change")
            out.append((win, pool))
        if not out:
            raise TypeError(f"{name} has no blocks")
        return out

    def _block_parts(self, where: str, norm1: nn.Module, attn: ModelTree, num_heads: int,
                     norm2: nn.Module, mlp: ModelTree, act: Callable[[Tensor], Tensor],
                     ls: tuple[Tensor | None, Tensor | None], window: Windows,
                     pool: QueryPool | None) -> BlockParts:
        w = attn.qkv.weight.detach()
        a = w.shape[0] // 3
        b = attn.qkv.bias.detach() if attn.qkv.bias is not None else None
        biases = (None, None, None) if b is None else (b[:a], b[a:2 * a], b[2 * a:])
        identity = nn.Identity()
        return BlockParts(
            norm1=_norm_parts(norm1, f"{where} norm1"),
            q_weight=w[:a], k_weight=w[a:2 * a], v_weight=w[2 * a:],
            q_bias=biases[0], k_bias=biases[1], v_bias=biases[2], num_heads=num_heads,
            head_dim=a // num_heads, scale=float((a // num_heads) ** -0.5),
            q_norm=identity, k_norm=identity, proj_weight=attn.proj.weight,
            proj_bias=attn.proj.bias, norm2=_norm_parts(norm2, f"{where} norm2"),
            ls1=ls[0], fc1_weight=mlp.fc1.weight, fc1_bias=mlp.fc1.bias, act=act,
            fc2_weight=mlp.fc2.weight, fc2_bias=mlp.fc2.bias, ls2=ls[1],
            window=window, pool=pool)

    @property
    def mask_unit(self) -> tuple[int, int]:
        """The mask unit in pixels (the patch stride times ``2^levels``): the input sides
        must be multiples of it."""
        return (self.stride[0] * 2 ** self.levels, self.stride[1] * 2 ** self.levels)

    @property
    def input_shape(self) -> tuple[int, tuple[int, int]]:
        return self.in_chans, self.image_size

    @property
    def patch_size(self) -> tuple[int, int]:
        """The patch stride ``(sh, sw)``: one token per ``sh × sw`` pixels."""
        return self.stride

    def check_inputs(self, inputs: Tensor) -> None:
        super().check_inputs(inputs)
        h, w = inputs.shape[-2:]
        mh, mw = self.mask_unit
        if h % mh or w % mw:
            raise ValueError(
                f"inputs size {(int(h), int(w))} is not a multiple of "
                f"{type(self.model).__name__}'s mask unit of {mh}x{mw} pixels (patch stride "
                f"{self.stride} times {2 ** self.levels} tokens): Hiera unrolls its tokens "
                f"into whole mask units; resize the images to {self.image_size}")
        self.check_fixed_size(inputs, self.image_size, type(self.model).__name__)

    def layout(self, inputs: Tensor) -> Layout:
        self.refresh()
        h, w = inputs.shape[-2:]
        return Layout(num_prefix=0, grid=self.grid0, patch_size=self.stride,
                      readout=self.readout, num_blocks=self.num_blocks,
                      num_heads=self.blocks[0].num_heads, image_size=(int(h), int(w)))


def _example(**extra: Any) -> Callable[..., nn.Module]:
    """A builder of a small timm ``Hiera``: 32x32 images, patch stride 4 (an 8x8 grid),
    three stages of ``(1, 2, 1)`` blocks, width 8 doubling per stage, heads ``1, 2, 4``,
    mask units of 4x4 tokens (mask-unit attention in the first stage, global later), two
    query poolings; ``extra`` and build-time ``overrides`` go to the constructor. Its depth
    is ``stages``, so ``depth`` is not used."""

    def build(*, seed: int = 0, depth: int = 3, dtype: torch.dtype = torch.float64,
              num_classes: int = 5, **overrides: Any) -> nn.Module:
        kwargs: dict[str, Any] = dict(
            img_size=(32, 32), in_chans=3, embed_dim=8, num_heads=1, num_classes=num_classes,
            stages=(1, 2, 1), q_pool=2, q_stride=(2, 2), mask_unit_size=(4, 4),
            mask_unit_attn=(True, False, False), mlp_ratio=2.0, drop_path_rate=0.0)
        return seeded_model("timm.models.hiera", "Hiera", seed,
                            **{**kwargs, **extra, **overrides}).to(dtype).eval()

    return build


@register_family(
    is_timm_hiera,
    name="timm_hiera",
    supports="timm Hiera (hiera_*; at the configured size)",
    tags=("classifier", "embedding", "windowed", "hierarchical", "pooling"),
    notes=("Mask-unit attention (windows of the raster grid) in the first stages, global "
           "later, query pooling (2x2 max of q and of the projected residual) at the stage "
           "changes, mean-then-norm head; tokens kept in raster order (the model's unroll "
           "and reroll verified): maps on the first stage's grid (56 × 56 for Hiera-T at "
           "224 px); every registered method runs but TIS — refused by name: TIS and true "
           "token removal, other input sizes, `use_expand_proj=False`, stage changes "
           "without pooling, MLP heads"),
    examples={
        "timm_hiera": Example(_example(), (32, 32)),
        # mask-unit attention in the pooling block as well (the one-block lag) and in stage 2
        "timm_hiera_mu": Example(_example(mask_unit_attn=(True, True, False)), (32, 32),
                                 suite=False),
    })
class TimmHieraAdapter(_HieraBase):
    """Canonical view of a timm ``Hiera`` (:mod:`captum_vit.adapters.families.hiera`):
    raster-order states, mask-unit or global windows per block, query pooling at the stage
    changes, mean-then-LayerNorm readout.

    Raises:
        TypeError: settings the canonical form does not have (module docstring).
    """

    model: ModelTree

    def __init__(self, model: ModelTree) -> None:
        super().__init__()
        (Hiera,) = timm_classes("timm.models.hiera", "Hiera")
        name = type(model).__name__
        if not isinstance(model, Hiera):
            raise TypeError(f"{name} is not timm's Hiera")
        self.model = model
        m = self.model
        if any(tuple(s) != (2, 2) for s in m.unroll.schedule):
            raise TypeError(f"{name} unrolls with strides {m.unroll.schedule}; captum_vit "
                            "supports Hiera's 2x2 query stride")
        if getattr(m, "pos_embed_temporal", None) is not None or len(m.patch_stride) != 2:
            raise TypeError(f"{name} is a video Hiera (3-D patches); captum_vit explains "
                            "image Hiera models")
        head = m.head
        if head.pool_type != "avg" or not isinstance(head.pre_logits, nn.Identity):
            raise TypeError(f"{name}.head pools with {head.pool_type!r} or has an MLP "
                            "(head_hidden_size); captum_vit supports the average pool, "
                            "LayerNorm and linear classifier")
        self.readout = "avg"
        self.num_prefix = 0
        self.in_chans = int(m.patch_embed.proj.in_channels)
        self.stride = (int(m.patch_stride[0]), int(m.patch_stride[1]))
        self.grid0 = (int(m.tokens_spatial_shape[0]), int(m.tokens_spatial_shape[1]))
        self.image_size = (self.grid0[0] * self.stride[0], self.grid0[1] * self.stride[1])
        self.levels = len(m.unroll.schedule)
        self._read_parts()

    def _read_parts(self) -> None:
        m = self.model
        name = type(m).__name__
        layers = []
        for i, blk in enumerate(m.blocks):
            where = f"{name}.blocks[{i}]"
            if blk.do_expand and blk.proj is None:
                raise TypeError(f"{where} pools without a residual projection "
                                "(use_expand_proj=False); captum_vit supports Hiera's "
                                "projected residual")
            layers.append((where, blk, blk.proj, int(blk.attn.q_stride),
                           bool(blk.attn.use_mask_unit_attn), int(blk.attn.window_size)))
        geometry = self._geometry(name, layers)
        parts = []
        for i, (blk, (win, pool)) in enumerate(zip(m.blocks, geometry, strict=True)):
            where = f"{name}.blocks[{i}]"
            mlp = blk.mlp
            if not isinstance(mlp.norm, nn.Identity) \
                    or not isinstance(mlp.act, (nn.GELU, *timm_gelus())):
                raise TypeError(f"{where}.mlp must be timm's Mlp with a GELU activation")
            ls = tuple(getattr(blk, n).gamma if hasattr(getattr(blk, n), "gamma") else None
                       for n in ("ls1", "ls2"))
            parts.append(self._block_parts(
                where, blk.norm1, blk.attn, int(blk.attn.heads), blk.norm2, mlp,
                cast(Callable[[Tensor], Tensor], mlp.act), cast(Any, ls), win, pool))
        self.blocks = parts
        weight, bias = timm_head(m.head.fc, f"{name}.head.fc")
        self.embedding = weight is None
        self.head = HeadParts(None, _norm_parts(m.head.norm, f"{name}.head.norm"),
                              (("avg", weight, bias),))

    def refresh(self) -> None:
        first = self.model.blocks[0].attn.qkv.weight
        if cast(Tensor, self.blocks[0].q_weight).data_ptr() != first.data_ptr():
            self._read_parts()

    def parameter_stages(self) -> list[list[nn.Parameter]]:
        """The head (norm, classifier), then the blocks from the top (a pooling block's
        residual projection with its block)."""
        m = self.model
        return [list(m.head.parameters())] + [list(b.parameters()) for b in m.blocks][::-1]

    def is_random(self) -> bool:
        m = self.model
        return has_active_dropout(m) or (m.training and m.patch_drop_rate > 0)

    def embed(self, inputs: Tensor, ops: Ops | None = None) -> Tensor:
        """The model's patch embedding and position embedding, tokens [B, N, C] in raster
        order (not unrolled); with ``ops`` the overlapping patch convolution through
        ``ops.linear`` (:func:`conv_projection`)."""
        self.refresh()
        m = self.model
        if ops is None:
            x = m.patch_embed(inputs)
        else:
            x = conv_projection(inputs, m.patch_embed.proj, ops,
                                f"{type(m).__name__}.patch_embed.proj")
        return m._pos_embed(x)


def hf_hiera_twin(timm_model: nn.Module, *, pooled: bool = False) -> nn.Module:
    """The Hugging Face ``HieraForImageClassification`` (``pooled``: ``HieraModel``) with
    the weights of a timm ``Hiera`` (same dtype), eval mode: the weight mapping of the
    twin tests.

    Args:
        timm_model (nn.Module): a timm ``Hiera`` with a query pooling at every stage change.
        pooled (bool, optional): build the head-less ``HieraModel``. Default ``False``.

    Returns:
        nn.Module: the twin.
    """
    transformers = library("transformers")
    m = cast(ModelTree, timm_model)
    ends = list(m.stage_ends)
    depths = [e - s for s, e in zip([-1] + ends[:-1], ends, strict=True)]
    starts = [0] + [e + 1 for e in ends[:-1]]
    heads = [int(m.blocks[s].attn.heads) for s in starts]
    # a stage's kind shows in the next stage's first block (both libraries lag it by one
    # block); the last stage's in its second block (global if it has one block)
    mu_attn = [bool(m.blocks[s].attn.use_mask_unit_attn) for s in starts[1:]]
    last = starts[-1] + 1
    mu_attn.append(last <= ends[-1] and bool(m.blocks[last].attn.use_mask_unit_attn))
    conv = m.patch_embed.proj
    cfg = transformers.HieraConfig(
        embed_dim=int(m.blocks[0].dim), image_size=[int(s) * int(t) for s, t in zip(
            m.tokens_spatial_shape, m.patch_stride, strict=True)],
        patch_size=list(conv.kernel_size), patch_stride=list(conv.stride),
        patch_padding=list(conv.padding), num_channels=conv.in_channels,
        mlp_ratio=m.blocks[0].mlp.fc1.out_features / m.blocks[0].dim, depths=depths,
        num_heads=heads, embed_dim_multiplier=m.blocks[starts[-1]].dim_out / m.blocks[
            starts[-2]].dim_out if len(starts) > 1 else 2.0,
        num_query_pool=int(m.q_pool), query_stride=list(m.q_stride),
        masked_unit_size=list(m.mask_unit_size), masked_unit_attention=mu_attn,
        drop_path_rate=0.0, hidden_act="gelu", layer_norm_eps=m.blocks[0].norm1.eps,
        num_labels=max(int(m.num_classes), 1))
    cls = transformers.HieraModel if pooled else transformers.HieraForImageClassification
    hf = cls(cfg).to(next(timm_model.parameters()).dtype).eval()
    src = timm_model.state_dict()
    pre = "" if pooled else "hiera."
    out = {f"{pre}embeddings.patch_embeddings.projection.{k}": src[f"patch_embed.proj.{k}"]
           for k in ("weight", "bias")}
    out[f"{pre}embeddings.position_embeddings"] = src["pos_embed"]
    out.update({f"{pre}pooler.layernorm.{k}": src[f"head.norm.{k}"] for k in ("weight", "bias")})
    if not pooled:
        out.update({f"classifier.{k}": src[f"head.fc.{k}"] for k in ("weight", "bias")})
    for s, (start, end) in enumerate(zip(starts, ends, strict=True)):
        for j in range(end - start + 1):
            a, b = f"blocks.{start + j}.", f"{pre}encoder.stages.{s}.layers.{j}."
            for k in ("weight", "bias"):
                out[f"{b}layernorm_before.{k}"] = src[f"{a}norm1.{k}"]
                out[f"{b}layernorm_after.{k}"] = src[f"{a}norm2.{k}"]
                for mod in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"):
                    out[f"{b}{mod}.{k}"] = src[f"{a}{mod}.{k}"]
                if f"{a}proj.{k}" in src:
                    out[f"{b}proj.{k}"] = src[f"{a}proj.{k}"]
    missing, unexpected = hf.load_state_dict(out, strict=False)
    if missing or unexpected:
        raise ValueError(f"the timm weights do not map onto {cls.__name__}: missing "
                         f"{missing}, unexpected {unexpected}")
    return hf


def _twin_example(*, pooled: bool = False, **extra: Any) -> Callable[..., nn.Module]:
    """A builder of the Hugging Face twin (:func:`hf_hiera_twin`) of a timm Hiera example."""
    return twin_builder(_example(**extra), hf_hiera_twin, pooled=pooled)


@register_family(
    is_hf_hiera,
    name="hf_hiera",
    supports="Hugging Face HieraForImageClassification and HieraModel (at the configured size)",
    tags=("classifier", "embedding", "windowed", "hierarchical", "pooling"),
    notes=("`HieraForImageClassification`; `HieraModel` through its `pooler_output`, with "
           "vector targets: ✅ as timm's Hiera (forward equal to 1e-12 in float64, maps "
           "equal a timm twin's) — refused: as timm's Hiera"),
    examples={
        "hf_hiera": Example(_twin_example(), (32, 32), library="transformers", suite=False),
        "hf_hiera_model": Example(_twin_example(pooled=True), (32, 32),
                                  library="transformers", target="embedding",
                                  tags=("matrix",), suite=False),
    })
class HFHieraAdapter(_HieraBase):
    """Canonical view of a Hugging Face ``HieraForImageClassification`` or ``HieraModel``
    (its ``pooler_output``), the second reader of the canonical form of
    :class:`TimmHieraAdapter`.

    Raises:
        TypeError: a ``HieraModel`` without pooling layer or settings the canonical form
            does not have (module docstring).
    """

    backbone: ModelTree

    def __init__(self, model: ModelTree) -> None:  # noqa: D107 - documented on the class
        super().__init__()
        name = type(model).__name__
        self.model = model
        self.backbone = getattr(model, "hiera", model)
        if getattr(self.backbone, "pooler", None) is None:
            raise TypeError(f"{name} has no pooling layer (add_pooling_layer=False): "
                            "captum_vit explains its pooled embedding")
        cfg = model.config
        if tuple(cfg.query_stride) != (2, 2) or len(cfg.patch_stride) != 2:
            raise TypeError(f"{name} has query stride {cfg.query_stride}; captum_vit "
                            "supports Hiera's 2x2 query pooling on images")
        self.readout = "avg"
        self.num_prefix = 0
        self.in_chans = int(cfg.num_channels)
        self.stride = (int(cfg.patch_stride[0]), int(cfg.patch_stride[1]))
        self.image_size = (int(cfg.image_size[0]), int(cfg.image_size[1]))
        self.grid0 = (self.image_size[0] // self.stride[0], self.image_size[1] // self.stride[1])
        self.levels = len(self.backbone.unroll_schedule)
        self._read_parts()

    def _layers(self) -> list[tuple[str, ModelTree]]:
        name = type(self.model).__name__
        return [(f"{name}.encoder.stages[{s}].layers[{j}]", layer)
                for s, stage in enumerate(self.backbone.encoder.stages)
                for j, layer in enumerate(stage.layers)]

    def _read_parts(self) -> None:
        m = self.model
        name = type(m).__name__
        layers = self._layers()
        geometry = self._geometry(name, [
            (where, layer, getattr(layer, "proj", None), int(layer.attn.query_stride),
             bool(layer.attn.use_mask_unit_attn), int(layer.attn.window_size))
            for where, layer in layers])
        self.blocks = [self._block_parts(
            where, layer.layernorm_before, layer.attn, int(layer.attn.num_heads),
            layer.layernorm_after, layer.mlp, layer.mlp.activation_fn, (None, None), win, pool)
            for (where, layer), (win, pool) in zip(layers, geometry, strict=True)]
        classifier = getattr(m, "classifier", None)
        self.embedding = classifier is None
        if classifier is not None and not isinstance(classifier, nn.Linear):
            raise TypeError(f"{name} has no linear classifier (num_labels=0?); pass its "
                            "backbone model.hiera (an embedding model) with vector targets")
        weight = None if classifier is None else classifier.weight
        bias = None if classifier is None else classifier.bias
        self.head = HeadParts(None, _norm_parts(self.backbone.pooler.layernorm,
                                                f"{name}.pooler.layernorm"),
                              (("avg", weight, bias),))

    def refresh(self) -> None:
        first = self._layers()[0][1].attn.qkv.weight
        if cast(Tensor, self.blocks[0].q_weight).data_ptr() != first.data_ptr():
            self._read_parts()

    def parameter_stages(self) -> list[list[nn.Parameter]]:
        """The head (pooler norm, classifier), then the layers from the top."""
        m, bb = self.model, self.backbone
        head = [bb.pooler, getattr(m, "classifier", None)]
        stages = [[p for mod in head if mod is not None for p in mod.parameters()]]
        return stages + [list(layer.parameters()) for _, layer in self._layers()][::-1]

    def is_random(self) -> bool:
        return self.model.training and getattr(self.model.config, "drop_path_rate", 0) > 0

    def embed(self, inputs: Tensor, ops: Ops | None = None) -> Tensor:
        """The model's patch embedding plus its position embedding, tokens [B, N, C] in
        raster order; with ``ops`` the overlapping patch convolution through
        ``ops.linear`` (:func:`conv_projection`)."""
        emb = self.backbone.embeddings
        if ops is None:
            x = emb.patch_embeddings.projection(inputs).flatten(2).transpose(2, 1)
        else:
            x = conv_projection(inputs, emb.patch_embeddings.projection, ops,
                                f"{type(self.model).__name__}.embeddings.patch_embeddings"
                                ".projection")
        return x + emb.position_embeddings.to(x.dtype)

    def model_outputs(self, inputs: Tensor) -> Tensor:
        out = self.model(pixel_values=inputs)
        return out.pooler_output if self.embedding else out.logits

