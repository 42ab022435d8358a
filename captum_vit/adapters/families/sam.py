"""Adapters for the image encoder of the Segment Anything Model (SAM; Kirillov et al., ICCV
2023): Hugging Face ``SamModel`` / ``SamVisionModel`` (their ``vision_encoder``) and timm
``VisionTransformerSAM`` (``samvit_*``).

Only this file knows SAM's attribute names. SAM's image encoder is a plain pre-LN ViT
without class token on one grid of ``image_size / patch_size`` tokens (one stage, no
merge), verified in the installed sources (transformers ``modeling_sam.py``, timm
``vision_transformer_sam.py``):

- **embedding**: the patch convolution, plus the absolute position embedding
  ``pos_embed`` ``[1, h, w, D]`` when the model has one (``use_abs_pos``); timm's
  ``norm_pre`` when ``pre_norm``.
- **windowed blocks**: every block not in ``global_attn_indexes`` attends inside
  ``window_size × window_size`` windows of the grid; the grid is padded at the bottom and
  right to whole windows *after* the block's first LayerNorm (zero vectors: their keys and
  values are the projections' biases) and the padded rows are dropped afterwards. This is
  :class:`~captum_vit.adapters.windows.Windows` with no shift. The **global blocks**
  attend over the whole grid; they are the same :class:`Windows` with one window covering
  the grid (so their probabilities are ``[B, H, 1, N, N]``, the dense matrix of a global
  block, and every block of the encoder has the windowed form).
- **decomposed relative position** (``use_rel_pos``; MViTv2, Li et al., CVPR 2022): each
  block adds to its logits ``q_i · R^h[r_i, r_j] + q_i · R^w[c_i, c_j]`` for query ``i`` and
  key ``j`` at rows ``r`` and columns ``c`` of their window (or of the grid in a global
  block), with ``R^h``, ``R^w`` read from the block's ``rel_pos_h`` / ``rel_pos_w`` by the
  model's own ``get_rel_pos``. The term depends on the query, so it enters the one
  attention through :attr:`BlockParts.query_bias <captum_vit.adapters.parts.BlockParts>`
  (:class:`DecomposedRelPos`). How the methods treat it (our choice, as BEiT's bias): it is
  part of the logits, inside the softmax. The attention-based methods read the
  probabilities it produced; gradients flow through it into ``q`` as through ``q kᵀ``
  (gradient methods, Chefer'21's and GAE's attention gradients); the LRP rule sets compute
  it from ``q`` after their rule on ``q`` (AttnLRP's uniform rule scales what reaches
  ``q`` through it alike); DecompX's linearised routes detach ``q`` and ``k`` and so hold
  it constant, as they hold the probabilities constant; CP-LRP holds the probabilities
  constant.
- **neck**: ``conv 1×1 (no bias) → LayerNorm2d → conv 3×3 (padding 1, no bias) →
  LayerNorm2d`` to ``output_channels`` (256): :class:`SamNeck`, written with the ops
  (the 3×3 convolution as a linear map of each token's zero-padded 3×3 neighbourhood,
  :class:`Neighbourhood`), so DecompX and the LRP rules pass it exactly like the blocks'
  linear maps and LayerNorms.

**What is explained** (the head). Hugging Face's encoder has no classifier: its output
here is the **image embedding** ``[B, output_channels]``, the mean over the grid of the
neck's output (the ``image_embeddings`` ``SamModel`` hands its mask decoder, pooled; a
choice of captum_vit, as for the other head-less backbones), explained with a vector
target (:class:`~captum_vit.targets.EmbeddingTarget`); a mask of SAM is explained with
:class:`~captum_vit.targets.SamMaskTarget`, which runs SAM's prompt encoder and mask
decoder on the neck's output. timm's ``VisionTransformerSAM`` pools the neck's output
(``global_pool='avg'``) into its classifier ``head.fc``, so a timm SAM with
``num_classes > 0`` is a classifier and with ``num_classes=0`` outputs the same pooled
embedding. The matrix methods read the neck's mean as the mean of the encoder's tokens
(uniform readout weights; the neck's 3×3 mixing of neighbours is not a token-mixing step
of their chains: our choice).

The image size is the model's (``image_size``): the global blocks' relative positions
and the position embedding are sized for that grid. True token removal and TIS's token
subsets are refused (a window keeps every token of its grid): remove pixels instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from captum_vit.adapters._typing import ModelTree
from captum_vit.adapters.base import ViTAdapter
from captum_vit.adapters.catalog import Example, register_family
from captum_vit.adapters.families._examples import (
    hf_builder,
    library,
    timm_builder,
    transformers_model,
)
from captum_vit.adapters.families._hf import is_transformers_model
from captum_vit.adapters.families._timm import (
    TimmViTBase,
    has_active_dropout,
    timm_attention_fields,
    timm_classes,
    timm_gelus,
    timm_head,
)
from captum_vit.adapters.families._torch import is_loaded_instance
from captum_vit.adapters.layout import Layout
from captum_vit.adapters.ops import Ops, patch_projection
from captum_vit.adapters.parts import BlockParts, HeadParts, NeckHeadParts, NormParts, require_timm
from captum_vit.adapters.parts import layer_norm_parts as _norm_parts
from captum_vit.adapters.windows import Windows

HF_CLASSES = ("SamModel", "SamVisionModel", "SamVisionEncoder")
"""The Hugging Face classes :class:`HFSamAdapter` explains: their ``vision_encoder`` (the
encoder itself for a ``SamVisionEncoder``)."""


@dataclass(frozen=True)
class DecomposedRelPos:
    r"""The decomposed relative position term of one SAM attention (MViTv2, Li et al.,
    CVPR 2022) as a function of the queries: for a window (or grid) of ``(q_h, q_w)``
    slots in raster order,
    :math:`b_{ij} = q_i \cdot R^h_{r_i r_j} + q_i \cdot R^w_{c_i c_j}` with
    ``R^h = lookup(q_h, q_h, rel_h)`` ``[q_h, q_h, d]`` (and ``R^w`` alike), the model's
    own ``get_rel_pos`` on views of its ``rel_pos_h`` / ``rel_pos_w``.

    Attributes:
        rel_h (Tensor): ``rel_pos_h`` ``[2 q_h - 1, d]``.
        rel_w (Tensor): ``rel_pos_w`` ``[2 q_w - 1, d]``.
        size (tuple[int, int]): ``(q_h, q_w)``, the window (the grid in a global block).
        lookup (Callable): ``(q_size, k_size, rel_pos) -> [q_size, k_size, d]``.

    Examples::

        >>> term = adapter.blocks[0].query_bias   # of a SAM adapter
        >>> term(torch.zeros(2, 4, 9, 8)).shape   # q of 2 windows of 3x3, 4 heads
        torch.Size([2, 4, 9, 9])
    """

    rel_h: Tensor
    rel_w: Tensor
    size: tuple[int, int]
    lookup: Callable[[int, int, Tensor], Tensor]

    def __call__(self, q: Tensor) -> Tensor:
        """The logit term ``[B', H, n, n]`` of queries ``q`` ``[B', H, n, d]`` (``n = q_h
        q_w``, after the q norm, unscaled, as the models compute it)."""
        qh, qw = self.size
        rh = self.lookup(qh, qh, self.rel_h).to(q.dtype)
        rw = self.lookup(qw, qw, self.rel_w).to(q.dtype)
        b, h, n, d = q.shape
        r = q.reshape(b, h, qh, qw, d)
        rel_h = torch.einsum("bnhwc,hkc->bnhwk", r, rh)
        rel_w = torch.einsum("bnhwc,wkc->bnhwk", r, rw)
        return (rel_h[..., :, None] + rel_w[..., None, :]).reshape(b, h, n, n)


@dataclass(frozen=True)
class Neighbourhood:
    """The zero-padded 3×3 neighbourhood of every token of a grid, concatenated along the
    features (row offset, then column offset, then the feature): what a 3×3 convolution
    with padding 1 multiplies by its kernel (``ops.gather``, as a patch merge's children).

    Examples::

        >>> Neighbourhood((2, 2)).gather(torch.ones(1, 4, 1))[0, 0]
        tensor([0., 0., 0., 0., 1., 1., 0., 1., 1.])
    """

    grid: tuple[int, int]

    def gather(self, x: Tensor) -> Tensor:
        """``[B, N, 9 C]`` for token states ``x`` ``[B, N, C]`` on :attr:`grid`."""
        b, n, c = x.shape
        h, w = self.grid
        if n != h * w:
            raise ValueError(f"a 3x3 neighbourhood on the {h}x{w} grid needs {h * w} tokens, "
                             f"got {n}")
        p = F.pad(x.reshape(b, h, w, c), (0, 0, 1, 1, 1, 1))
        parts = [p[:, dy:dy + h, dx:dx + w] for dy in range(3) for dx in range(3)]
        return torch.cat(parts, -1).reshape(b, n, 9 * c)


@dataclass(frozen=True)
class SamNeck:
    """SAM's neck on the token states, through the ops: ``LN₂(conv₃ₓ₃(LN₁(x W₁ᵀ)))``
    (the convolutions without bias, the LayerNorms over the channels of each token).

    Attributes:
        grid (tuple[int, int]): the encoder's grid.
        conv1 (Tensor): the 1×1 kernel ``[C', D, 1, 1]``.
        norm1 (NormParts): the first LayerNorm2d.
        conv2 (Tensor): the 3×3 kernel ``[C', C', 3, 3]``.
        norm2 (NormParts): the second LayerNorm2d.
    """

    grid: tuple[int, int]
    conv1: Tensor
    norm1: NormParts
    conv2: Tensor
    norm2: NormParts

    @property
    def weight(self) -> Tensor:
        """The 3×3 kernel as the ``[C', 9 C']`` matrix of :class:`Neighbourhood`'s
        order."""
        return self.conv2.permute(0, 2, 3, 1).reshape(self.conv2.shape[0], -1)

    def __call__(self, x: object, ops: Ops) -> object:
        """The neck's output ``[B, N, C']`` of token states ``x`` ``[B, N, D]``."""
        x = ops.norm(ops.linear(x, self.conv1.flatten(1), None), self.norm1)
        x = ops.linear(ops.gather(x, Neighbourhood(self.grid)), self.weight, None)
        return ops.norm(x, self.norm2)


def _neck(neck: ModelTree, convs: tuple[ModelTree, ...], norms: tuple[ModelTree, ...],
          grid: tuple[int, int], where: str) -> SamNeck:
    """The :class:`SamNeck` of a model's neck (``convs``, ``norms``: its modules)."""
    c1, c2 = convs
    ok = (isinstance(c1, nn.Conv2d) and isinstance(c2, nn.Conv2d) and c1.bias is None
          and c2.bias is None and tuple(c1.kernel_size) == (1, 1)
          and tuple(c2.kernel_size) == (3, 3) and tuple(c2.padding) == (1, 1)
          and tuple(c1.stride) == (1, 1) and tuple(c2.stride) == (1, 1)
          and c1.groups == 1 and c2.groups == 1 and tuple(c2.dilation) == (1, 1))
    if not ok:
        raise TypeError(f"{where} is not SAM's neck (conv 1x1, LayerNorm2d, conv 3x3 with "
                        "padding 1, LayerNorm2d, no biases)")
    n1 = _norm_parts(norms[0], f"{where} LayerNorm2d")
    n2 = _norm_parts(norms[1], f"{where} LayerNorm2d")
    return SamNeck(grid, c1.weight, n1, c2.weight, n2)


def _pair(v: int | tuple[int, ...] | list[int]) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _windows(grid: tuple[int, int], window: int) -> Windows:
    """A windowed block's partition, or (``window == 0``) one window over the grid."""
    return Windows(grid=grid, size=grid if window == 0 else (window, window))


def is_hf_sam(model: nn.Module) -> bool:
    """``True`` for Hugging Face's ``SamModel``, ``SamVisionModel`` and
    ``SamVisionEncoder``."""
    if is_transformers_model(model, HF_CLASSES[:2]):
        return True
    if not type(model).__module__.startswith("transformers.models.sam."):
        return False
    return is_loaded_instance(  # not at transformers' top
        model, "transformers.models.sam.modeling_sam", "SamVisionEncoder")


def is_timm_sam(model: nn.Module) -> bool:
    """``True`` for timm's ``VisionTransformerSAM``."""
    return is_loaded_instance(model, "timm.models.vision_transformer_sam",
                              "VisionTransformerSAM")


class _SamAdapter(ViTAdapter):
    """What the two readers share: one grid, no prefix, mean readout, fixed image size,
    the encoder's blocks and neck."""

    num_prefix = 0
    readout = "avg"

    model: ModelTree  # read by attribute names (captum_vit.adapters._typing)
    grid: tuple[int, int]
    patch: tuple[int, int]
    image_size: tuple[int, int]

    def _block(self, where: str, fields: dict, window: int, attn: ModelTree,
               lookup: Callable[[int, int, Tensor], Tensor], use_rel_pos: bool) -> BlockParts:
        """:class:`BlockParts` of one encoder block from its attention and MLP fields."""
        win = _windows(self.grid, window)
        rel = None
        if use_rel_pos:
            if attn.rel_pos_h.shape[0] != 2 * win.size[0] - 1 \
                    or attn.rel_pos_w.shape[0] != 2 * win.size[1] - 1:
                raise TypeError(f"{where}'s relative positions cover "
                                f"{attn.rel_pos_h.shape[0]}x{attn.rel_pos_w.shape[0]} offsets, "
                                f"not the {win.size[0]}x{win.size[1]} window it attends in")
            rel = DecomposedRelPos(attn.rel_pos_h.detach(), attn.rel_pos_w.detach(),
                                   win.size, lookup)
        return BlockParts(**fields, window=win, query_bias=rel)

    def layout(self, inputs: Tensor) -> Layout:
        self.refresh()
        h, w = inputs.shape[-2:]
        return Layout(num_prefix=0, grid=self.grid, patch_size=self.patch,
                      readout=self.readout, num_blocks=self.num_blocks,
                      num_heads=self.blocks[0].num_heads, image_size=(int(h), int(w)))

    @property
    def input_shape(self) -> tuple[int, tuple[int, int]]:
        return self.in_chans, self.image_size

    def check_inputs(self, inputs: Tensor) -> None:
        super().check_inputs(inputs)
        self.check_fixed_size(inputs, self.image_size, type(self.model).__name__)


def _sam_model(*, seed: int = 0, depth: int = 3, dtype: torch.dtype = torch.float64,
               num_classes: int = 5, **overrides: Any) -> nn.Module:
    """A small ``SamModel``: its image encoder at 32 px, patch 4 (an 8 x 8 grid), 3 x 3
    windows padded to whole windows, one global block, decomposed relative positions, the
    conv neck; a small prompt encoder and mask decoder (for ``SamMaskTarget``)."""
    transformers = library("transformers")
    cfg = transformers.SamConfig(
        vision_config=dict(hidden_size=32, num_hidden_layers=depth, num_attention_heads=4,
                           image_size=32, patch_size=4, window_size=3, global_attn_indexes=[1],
                           output_channels=16, mlp_dim=64, num_pos_feats=8),
        prompt_encoder_config=dict(hidden_size=16, image_size=32, patch_size=4),
        mask_decoder_config=dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                 mlp_dim=32, iou_head_hidden_dim=16), **overrides)
    return transformers_model("SamModel", cfg, seed, dtype)


@register_family(
    is_hf_sam,
    name="hf_sam",
    supports="SAM's image encoder: Hugging Face SamModel, SamVisionModel and SamVisionEncoder",
    tags=("embedding", "windowed"),
    notes=("`SamModel`, `SamVisionModel` (or its `SamVisionEncoder`): SAM's image encoder "
           "(`vision_encoder`: windowed blocks padded on the grid, global blocks, decomposed "
           "relative positions, absolute position embedding, the conv neck; the configured "
           "`image_size`): ✅ with vector targets on the grid mean of the neck's output, and "
           "`SamMaskTarget` (a mask of SAM's own prompt encoder and mask decoder); windowed "
           "attention as in Swin: matrix methods as vector chains, global blocks are one window "
           "over the grid — refused by name: TIS and true token removal (remove pixels: RISE, "
           "ViT-CX)"),
    examples={
        # windows of 3 padded on the 4x4 grid, a global block, decomposed relative
        # positions; the embedding is the grid mean of the neck's output (its own tests)
        "hf_sam": Example(hf_builder("SamVisionModel", "SamVisionConfig", window_size=3,
                                     global_attn_indexes=[1], output_channels=16, mlp_dim=64),
                          (32, 32), library="transformers", target="embedding", suite=False),
        # a support-matrix column: SamModel, vector targets and SamMaskTarget's masks
        "hf_sam_model": Example(_sam_model, (32, 32), library="transformers",
                                target="sam_mask", tags=("matrix",), suite=False),
    })
class HFSamAdapter(_SamAdapter):
    """Canonical view of the image encoder of a Hugging Face ``SamModel`` or
    ``SamVisionModel`` (or a ``SamVisionEncoder`` itself; :mod:`captum_vit.adapters.families.sam`);
    never modified.

    Its output is the image embedding ``[B, output_channels]``, the grid mean of the
    neck's output (``vision_encoder(pixel_values).last_hidden_state.mean((-2, -1))``):
    explain it with an :class:`~captum_vit.targets.EmbeddingTarget`, or a mask with
    :class:`~captum_vit.targets.SamMaskTarget`. Any ``attn_implementation`` in float32
    and half precision; a float64 model needs ``"sdpa"`` (the default): the eager path
    computes its softmax in float32 (``softmax(..., dtype=torch.float32)``), about 1e-8
    from float64, which the float64 self-check against the model's own output refuses.

    Args:
        model (nn.Module): a ``SamModel``, ``SamVisionModel`` or ``SamVisionEncoder``.

    Raises:
        TypeError: another model, or a layer layout this adapter does not know.

    Examples::

        >>> import transformers
        >>> from captum_vit.adapters import adapt
        >>> cfg = transformers.SamVisionConfig(hidden_size=32, num_hidden_layers=2,
        ...     num_attention_heads=4, image_size=32, patch_size=4, window_size=3,
        ...     global_attn_indexes=[1], output_channels=16)
        >>> a = adapt(transformers.SamVisionModel(cfg).eval())
        >>> type(a).__name__, a.embedding, a.num_classes
        ('HFSamAdapter', True, 16)
    """

    embedding = True

    encoder: ModelTree  # the vision encoder, read by attribute names

    def __init__(self, model: ModelTree) -> None:
        super().__init__()
        name = type(model).__name__
        if name not in HF_CLASSES:
            raise TypeError(f"HFSamAdapter explains {' or '.join(HF_CLASSES)}, got {name}")
        self.model = model
        enc: ModelTree = getattr(model, "vision_encoder", model)
        cfg = enc.config
        self.encoder = enc
        self.in_chans = int(cfg.num_channels)
        self.patch = _pair(cfg.patch_size)
        self.image_size = _pair(cfg.image_size)
        self.grid = (self.image_size[0] // self.patch[0], self.image_size[1] // self.patch[1])
        self._read_parts()

    def _read_parts(self) -> None:
        enc = self.encoder
        name = type(self.model).__name__
        name = name if enc is self.model else f"{name}.vision_encoder"
        parts = []
        for i, layer in enumerate(enc.layers):
            where = f"{name}.layers[{i}]"
            attn, mlp = layer.attn, layer.mlp
            if not isinstance(getattr(attn, "qkv", None), nn.Linear) \
                    or not isinstance(getattr(mlp, "lin1", None), nn.Linear):
                raise TypeError(f"{where} is not a SamVisionLayer (attn.qkv, mlp.lin1/lin2)")
            w = attn.qkv.weight.detach()
            a = w.shape[0] // 3
            b = None if attn.qkv.bias is None else attn.qkv.bias.detach()
            heads = int(attn.num_attention_heads)
            fields = dict(
                norm1=_norm_parts(layer.layer_norm1, f"{where}.layer_norm1"),
                q_weight=w[:a], k_weight=w[a:2 * a], v_weight=w[2 * a:],
                q_bias=None if b is None else b[:a], k_bias=None if b is None else b[a:2 * a],
                v_bias=None if b is None else b[2 * a:], num_heads=heads,
                head_dim=a // heads, scale=float(attn.scale), q_norm=nn.Identity(),
                k_norm=nn.Identity(), proj_weight=attn.proj.weight,
                proj_bias=attn.proj.bias,
                norm2=_norm_parts(layer.layer_norm2, f"{where}.layer_norm2"), ls1=None,
                fc1_weight=mlp.lin1.weight, fc1_bias=mlp.lin1.bias, act=mlp.act,
                fc2_weight=mlp.lin2.weight, fc2_bias=mlp.lin2.bias, ls2=None)
            parts.append(self._block(where, fields, int(layer.window_size), attn,
                                     attn.get_rel_pos, bool(attn.use_rel_pos)))
        self.blocks = parts
        neck = enc.neck
        self.head = NeckHeadParts(None, None, (("avg", None, None),),
                                  neck=_neck(neck, (neck.conv1, neck.conv2),
                                             (neck.layer_norm1, neck.layer_norm2),
                                             self.grid, f"{name}.neck"))

    def refresh(self) -> None:
        first = self.encoder.layers[0].attn.qkv.weight
        # storage replaced (a block's q_weight is never None)
        if cast(Tensor, self.blocks[0].q_weight).data_ptr() != first.data_ptr():
            self._read_parts()

    def embed(self, inputs: Tensor, ops: Ops | None = None) -> Tensor:
        """``patch_embed`` plus ``pos_embed`` as tokens [B, N, D]; with ``ops`` the patch
        convolution through ``ops.linear`` (:meth:`ViTAdapter.embed`)."""
        self.refresh()
        enc = self.encoder
        if ops is None:
            x = enc.patch_embed(inputs)  # [B, h, w, D]
        else:
            x = patch_projection(inputs, enc.patch_embed.projection, ops,
                                 "vision_encoder.patch_embed")
        if enc.pos_embed is not None:
            x = x + enc.pos_embed
        return x.reshape(x.shape[0], -1, x.shape[-1])

    def model_outputs(self, inputs: Tensor) -> Tensor:
        """The grid mean of the encoder's own output (its neck), [B, output_channels]."""
        return self.encoder(pixel_values=inputs).last_hidden_state.mean((-2, -1))

    def parameter_stages(self) -> list[list[nn.Parameter]]:
        """The neck, then the layers from the top (a ``SamModel``'s prompt encoder and
        mask decoder are not part of the explained encoder: in none)."""
        enc = self.encoder
        return [list(enc.neck.parameters())] + [list(layer.parameters())
                                                 for layer in reversed(enc.layers)]

    def is_random(self) -> bool:
        enc = self.encoder
        return enc.training and float(enc.config.attention_dropout) > 0


@register_family(
    is_timm_sam,
    name="timm_sam",
    supports="SAM's image encoder in timm: VisionTransformerSAM",
    tags=("classifier", "windowed"),
    notes=("`samvit_*`: the same encoder as Hugging Face's SAM, `use_rel_pos` or none, "
           "LayerScale, `pre_norm`; the neck or a final LayerNorm2d, average pooling and a "
           "linear `head.fc`, or `num_classes=0` for the pooled embedding; fixed image size: ✅ "
           "as the Hugging Face SAM encoder, with class targets through the neck and the head "
           "(DecompX complete through both, 1e-10) — refused: rotary windows (`use_rope`), an "
           "MLP head (`head_hidden_size`), pooling other than `'avg'`"),
    examples={
        # windowed blocks padded on a 5x5 grid, one global block, decomposed relative
        # positions, the conv neck, a linear head
        "timm_sam": Example(timm_builder("timm.models.vision_transformer_sam",
                                         "VisionTransformerSAM", (40, 40), window_size=2,
                                         global_attn_indexes=(1,), use_rel_pos=True,
                                         neck_chans=16), (40, 40)),
    })
class TimmSamAdapter(_SamAdapter):
    """Canonical view of a timm ``VisionTransformerSAM`` (:mod:`captum_vit.adapters.families.sam`);
    never modified: the neck (or the final LayerNorm2d of a model built with
    ``neck_chans=None``), average pooling and the classifier ``head.fc`` (``num_classes=0``:
    the pooled embedding, explained with vector targets).

    Raises:
        TypeError: rotary embeddings (``use_rope``), an MLP head (``head_hidden_size``),
            a pooling other than ``'avg'``, or blocks of another kind.
    """

    def __init__(self, model: ModelTree) -> None:
        super().__init__()
        (ClassifierHead,) = timm_classes("timm.layers", "ClassifierHead")
        Block, VisionTransformerSAM = timm_classes("timm.models.vision_transformer_sam",
                                                   "Block", "VisionTransformerSAM")

        name = type(model).__name__
        if not isinstance(model, VisionTransformerSAM):
            raise TypeError(f"TimmSamAdapter explains timm's VisionTransformerSAM, got {name}")
        require_timm((1, 0, 31), name, "sets head_hidden_size and pools the neck differently "
                     "(timm 1.0.31 keeps the head's pooling in sync with the model)")
        # read by attribute names and checked here: narrowed to VisionTransformerSAM, model
        # would carry the attribute types inferred from timm's source (head: NormMlpClassifierHead)
        m: ModelTree = model
        if getattr(model, "rope_global", None) is not None:
            raise TypeError(f"{name} uses rotary embeddings in its windows (use_rope=True); "
                            "captum_vit supports SAM's decomposed relative positions "
                            "(use_rel_pos) or none")
        if type(m.head) is not ClassifierHead:
            raise TypeError(f"{name}.head is {type(m.head).__name__} (head_hidden_size); "
                            "captum_vit supports timm's ClassifierHead on the pooled neck")
        pool = getattr(m.head.global_pool, "pool_type", None)
        if pool != "avg" or m.head.use_conv:
            raise TypeError(f"{name}.head pools with {pool!r}; captum_vit supports "
                            "global_pool='avg'")
        for i, blk in enumerate(m.blocks):
            if type(blk) is not Block:
                raise TypeError(f"{name}.blocks[{i}] is {type(blk).__name__}; captum_vit "
                                "supports timm's vision_transformer_sam.Block")
        self.model = m
        pe = m.patch_embed
        self.in_chans = int(pe.proj.in_channels)
        self.patch = _pair(pe.patch_size)
        self.image_size = _pair(pe.img_size)
        self.grid = _pair(pe.grid_size)
        self._read_parts()

    def _read_parts(self) -> None:
        (LayerScale,) = timm_classes("timm.layers", "LayerScale")
        (get_rel_pos,) = timm_classes("timm.models.vision_transformer_sam", "get_rel_pos")

        m = self.model
        name = type(m).__name__
        parts = []
        for i, blk in enumerate(m.blocks):
            where = f"{name}.blocks[{i}]"
            mlp = blk.mlp
            if not isinstance(getattr(mlp, "norm", None), nn.Identity) \
                    or not isinstance(getattr(mlp, "act", None), (nn.GELU, *timm_gelus())):
                raise TypeError(f"{where}.mlp must be timm's Mlp with a GELU activation")
            ls = []
            for k in ("ls1", "ls2"):
                mod = getattr(blk, k)
                ls.append(mod.gamma if isinstance(mod, LayerScale) else None)
            fields = dict(**timm_attention_fields(blk, where), ls1=ls[0],
                          fc1_weight=mlp.fc1.weight, fc1_bias=mlp.fc1.bias, act=mlp.act,
                          fc2_weight=mlp.fc2.weight, fc2_bias=mlp.fc2.bias, ls2=ls[1])
            parts.append(self._block(where, fields, int(blk.window_size), blk.attn,
                                     get_rel_pos, bool(blk.attn.use_rel_pos)))
        self.blocks = parts
        weight, bias = timm_head(m.head.fc, f"{name}.head.fc")
        self.embedding = weight is None
        heads = (("avg", weight, bias),)
        neck = m.neck
        if isinstance(neck, nn.Sequential):
            self.head = NeckHeadParts(None, None, heads, neck=_neck(
                neck, (neck[0], neck[2]), (neck[1], neck[3]), self.grid, f"{name}.neck"))
        else:  # neck_chans=None: a final LayerNorm2d
            self.head = HeadParts(_norm_parts(neck, f"{name}.neck"), None, heads)

    def refresh(self) -> None:
        first = self.model.blocks[0].attn.qkv.weight
        # storage replaced (a block's q_weight is never None)
        if cast(Tensor, self.blocks[0].q_weight).data_ptr() != first.data_ptr():
            self._read_parts()

    def embed(self, inputs: Tensor, ops: Ops | None = None) -> Tensor:
        """``patch_embed``, ``pos_embed`` and ``norm_pre`` as in ``forward_features``, as
        tokens [B, N, D]; with ``ops`` the patch projection and ``norm_pre`` through them
        (:meth:`ViTAdapter.embed`)."""

        self.refresh()
        m = self.model
        # timm's PatchEmbed read as TimmViTBase reads it (it only uses self.model)
        x = TimmViTBase._patch_embed(self, inputs, ops)  # type: ignore[arg-type]
        if m.pos_embed is not None:
            x = x + m.pos_embed
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        if isinstance(m.norm_pre, nn.Identity):
            return x
        norm = _norm_parts(m.norm_pre, f"{type(m).__name__}.norm_pre")
        return m.norm_pre(x) if ops is None else ops.norm(x, norm)

    def embedding_norms(self) -> tuple[str, ...]:
        return () if isinstance(self.model.norm_pre, nn.Identity) else ("norm_pre",)

    def parameter_stages(self) -> list[list[nn.Parameter]]:
        """The neck and the head, then the blocks from the top."""
        m = self.model
        return [list(m.neck.parameters()) + list(m.head.parameters())] + \
            [list(blk.parameters()) for blk in reversed(m.blocks)]

    def is_random(self) -> bool:

        return has_active_dropout(self.model)


def sam_model(model: object) -> nn.Module:
    """``model`` if it is a Hugging Face ``SamModel`` (with its prompt encoder and mask
    decoder).

    Raises:
        TypeError: another model (a ``SamVisionModel`` or timm's ``VisionTransformerSAM``
            has no mask decoder).
    """
    if not isinstance(model, nn.Module) or not is_transformers_model(model, ("SamModel",)):
        raise TypeError(f"model must be a Hugging Face SamModel (image encoder, prompt "
                        f"encoder and mask decoder), got {type(model).__name__}; an image "
                        "encoder alone (SamVisionModel, timm VisionTransformerSAM) has no "
                        "masks: explain its embedding with an EmbeddingTarget")
    return model


def sam_mask_logits(model: nn.Module, embeddings: Tensor, points: Tensor | None,
                    labels: Tensor | None, boxes: Tensor | None,
                    multimask_output: bool) -> Tensor:
    """The low-resolution mask logits of SAM's own prompt encoder and mask decoder
    (``SamModel.forward`` with ``image_embeddings``) for ``u`` prompts on each of ``n``
    images: ``[n, u, masks, h_m, w_m]``.

    Args:
        model (nn.Module): a ``SamModel``.
        embeddings (Tensor): the neck's output ``[n, C', gh, gw]``.
        points (Tensor, optional): ``[u, P, 2]`` pixel coordinates ``(x, y)`` of the
            model's input images.
        labels (Tensor, optional): ``[u, P]`` (1 foreground, 0 background).
        boxes (Tensor, optional): ``[u, 4]`` ``(x0, y0, x1, y1)`` in pixels.
        multimask_output (bool): the decoder's three masks, or its single one.
    """
    n = embeddings.shape[0]
    kw: dict = {}
    if points is not None:
        kw["input_points"] = points.to(embeddings)[None].expand(n, *points.shape)
        # labels go with points (SamMaskTarget fills ones when none are given)
        labels = cast(Tensor, labels)
        kw["input_labels"] = labels.to(embeddings.device)[None].expand(n, *labels.shape)
    if boxes is not None:
        kw["input_boxes"] = boxes.to(embeddings)[None].expand(n, *boxes.shape)
    out = model(image_embeddings=embeddings, multimask_output=multimask_output, **kw)
    return out.pred_masks
