"""Adapter for the image encoder of Segment Anything 2 (SAM 2; Ravi et al., 2024): Hugging
Face ``Sam2Model`` / ``Sam2VisionModel`` (their ``vision_encoder``).

Only this file knows SAM 2's attribute names. What the encoder computes (verified in the
installed ``transformers/models/sam2/modeling_sam2.py``):

- **Trunk** (``Sam2HieraDetModel``, "Hiera-Det"): a ``7×7`` patch convolution of stride 4
  and padding 3 (overlapping patches) plus a **windowed absolute position embedding**
  (Bolya et al., 2023: ``pos_embed`` interpolated bicubically to the grid, plus
  ``pos_embed_window`` tiled over it: a constant of the grid, added once), then blocks in
  stages. Unlike the classification Hiera the tokens stay in **raster order** (no unroll):
  a block with ``window_size > 0`` attends inside ``window_size × window_size`` windows of
  its grid, padded at the bottom and right to whole windows *after* its first LayerNorm
  (zero vectors: their keys and values are the projections' biases) and cropped after;
  ``window_size == 0`` (``global_attention_blocks``) attends over the whole grid (here one
  window covering it). The first block of a stage keeps the previous stage's window size.
- **Query pooling** at the first block of each of the ``num_query_pool_stages`` later
  stages: ``q`` is max-pooled over 2×2 inside each window (``max_pool2d``), and the
  residual is ``maxpool(proj(LN1(x)))`` (the width changes there): the same operation as
  Hiera's (:class:`~captum_vit.adapters.windows.QueryPool`), the output on the
  ``(h/2, w/2)`` grid.
- **Neck** (``Sam2VisionNeck``, an FPN): a lateral ``1×1`` convolution per stage to
  ``fpn_hidden_size``, each level in ``fpn_top_down_levels`` plus the nearest 2×
  upsampling of the level below it (linear: exact for DecompX and the LRP rules). The mask
  decoder reads the ``num_feature_levels`` finest levels: the coarsest of them is the
  image embedding (plus ``no_memory_embedding``), the two finer ones go through the
  decoder's ``conv_s0`` / ``conv_s1`` as its high-resolution features.

**What is explained.** The token states are the trunk's (maps land on the first stage's
grid, ``256 × 256`` for SAM 2.1-T at 1024 px). The encoder has no classifier: its output
here is the **grid mean of the neck's top level** ``[B, fpn_hidden_size]``, the lateral
convolution of the last stage's tokens (the FPN level whose top-down upsampling reaches
the image embedding; a choice of captum_vit, as SAM v1's grid mean of its neck): a
linear head on the mean of the last tokens, explained with vector targets
(:class:`~captum_vit.targets.EmbeddingTarget`) or its components as integer targets. A
mask of SAM 2 is explained with :class:`~captum_vit.targets.Sam2MaskTarget`, which reads
the stage outputs the mask decoder uses (a several-block readout) and runs the model's own
neck, prompt encoder and mask decoder on them.

Methods: as Hiera's (:mod:`captum_vit.adapters.families.hiera`): the pooling blocks carry
row vectors as ``vᵀ(R + Ā)`` with each child weighted by its share of the channels where it
is the maximum; DecompX and the LRP rules pass the maximum exactly. Methods that do not
carry query pooling refuse by name (tag ``pooling``), true token removal and TIS's token
subsets too (tag ``windowed``: remove pixels instead).

**Image sizes.** The encoder (trunk and neck) runs at other sizes than the configured
one (``backbone_config.image_size``), and so does the adapter, its windows and poolings
read for the images of each call (:meth:`HFSam2Adapter.grid_of`): the sides must be
multiples of the patch stride (captum_vit's rule: one token per stride), the first grid a
whole number of ``pos_embed_window`` tiles (the model tiles it over the grid and fails
otherwise) and every query pooling must halve a grid of even sides, i.e. multiples of
:attr:`HFSam2Adapter.size_unit` px (32 px for the SAM 2.1 checkpoints and the tiny
examples); other sizes are refused with a ``ValueError`` naming the rule. Embedding
targets take any such size on ``Sam2VisionModel`` and ``Sam2Model``. **Masks** only at the
configured size: ``Sam2Model.forward`` itself fails elsewhere (it reshapes the FPN levels
to the fixed ``vision_config.backbone_feature_sizes``, and the prompt encoder's dense
embedding, the decoder's image-wide positional embedding and the prompts' scale are those
of ``prompt_encoder_config.image_size``), so :class:`~captum_vit.targets.Sam2MaskTarget`
refuses other sizes saying so (:func:`sam2_check_mask_size`).

Refused by name: a stage change without query pooling (``num_query_pool_stages < stages -
1``), a query stride other than 2×2, a neck with lateral kernels other than ``1×1``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

from captum_vit.adapters._typing import ModelTree
from captum_vit.adapters.base import ViTAdapter
from captum_vit.adapters.catalog import Example, register_family
from captum_vit.adapters.families._examples import library, transformers_model
from captum_vit.adapters.families._hf import is_transformers_model
from captum_vit.adapters.families._torch import conv_projection
from captum_vit.adapters.layout import Layout
from captum_vit.adapters.ops import Ops
from captum_vit.adapters.parts import BlockParts, HeadParts
from captum_vit.adapters.parts import layer_norm_parts as _norm_parts
from captum_vit.adapters.windows import QueryPool, Windows

HF_SAM2_CLASSES = ("Sam2Model", "Sam2VisionModel")
"""The Hugging Face classes :class:`HFSam2Adapter` explains: their image encoder."""


def is_hf_sam2(model: nn.Module) -> bool:
    """``True`` for Hugging Face's ``Sam2Model`` and ``Sam2VisionModel``."""
    return is_transformers_model(model, HF_SAM2_CLASSES)


def _pair(v: int | tuple[int, ...] | list[int]) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _conv_out(size: tuple[int, int], conv: nn.Conv2d) -> tuple[int, int]:
    """The output grid of ``conv`` on images of ``size``."""
    k, s, p = conv.kernel_size, conv.stride, cast(tuple[int, int], conv.padding)
    return cast(tuple[int, int], tuple((size[i] + 2 * p[i] - k[i]) // s[i] + 1
                                       for i in range(2)))


def _lateral(conv: ModelTree, where: str) -> tuple[Tensor, Tensor | None]:
    """The ``[C', D]`` matrix and bias of a ``1×1`` lateral convolution of the FPN."""
    ok = isinstance(conv, nn.Conv2d) and tuple(conv.kernel_size) == (1, 1) \
        and tuple(conv.stride) == (1, 1) and tuple(conv.padding) == (0, 0) \
        and conv.groups == 1
    if not ok:
        raise TypeError(f"{where} is not a 1x1 convolution (fpn_kernel_size=1, fpn_stride=1, "
                        "fpn_padding=0); captum_vit supports SAM 2's 1x1 FPN laterals")
    return conv.weight.flatten(1), conv.bias


def _sam2_config(*, image_size: int = 32, windows: tuple[int, ...] = (4, 2, 2, 1),
                 global_blocks: tuple[int, ...] = (3,)) -> Any:
    """A small ``Sam2Config``: ``image_size`` px, patch stride 4, four stages of ``(1, 1, 2,
    1)`` blocks of widths ``4, 8, 16, 32``, windows per stage, global blocks, query pooling
    at every stage change; an FPN of 16 channels reading the three finest levels (the image
    embedding at stride 16 with the top-down level of stride 32, as SAM 2's), a small prompt
    encoder and mask decoder."""
    s = image_size // 4
    trunk = dict(model_type="sam2_hiera_det_model", hidden_size=4, num_attention_heads=1,
                 image_size=[image_size, image_size],
                 window_positional_embedding_background_size=[2, 2],
                 num_query_pool_stages=3, blocks_per_stage=[1, 1, 2, 1],
                 embed_dim_per_stage=[4, 8, 16, 32], num_attention_heads_per_stage=[1, 1, 2, 2],
                 window_size_per_stage=list(windows), global_attention_blocks=list(global_blocks),
                 mlp_ratio=2.0)
    vision = dict(backbone_config=trunk, backbone_channel_list=[32, 16, 8, 4],
                  backbone_feature_sizes=[[s, s], [s // 2, s // 2], [s // 4, s // 4]],
                  fpn_hidden_size=16, fpn_top_down_levels=[2, 3], num_feature_levels=3)
    return library("transformers").Sam2Config(
        vision_config=vision,
        prompt_encoder_config=dict(hidden_size=16, image_size=image_size, patch_size=16,
                                   mask_input_channels=4),
        mask_decoder_config=dict(hidden_size=16, mlp_dim=32, num_hidden_layers=2,
                                 num_attention_heads=2, iou_head_hidden_dim=16))


def sam2_example(vision: bool = False, **config: Any) -> Callable[..., nn.Module]:
    """A builder of a small ``Sam2Model`` (``vision``: its ``Sam2VisionModel``) from
    :func:`_sam2_config` ``(**config)``; its depth is the config's (``depth`` unused)."""

    def build(*, seed: int = 0, depth: int = 3, dtype: torch.dtype = torch.float64,
              num_classes: int = 5, **overrides: Any) -> nn.Module:
        cfg = _sam2_config(**{**config, **overrides})
        if vision:
            return transformers_model("Sam2VisionModel", cfg.vision_config, seed, dtype)
        return transformers_model("Sam2Model", cfg, seed, dtype)

    return build


@register_family(
    is_hf_sam2,
    name="hf_sam2",
    supports="SAM 2's image encoder: Hugging Face Sam2Model and Sam2VisionModel",
    tags=("embedding", "windowed", "hierarchical", "pooling"),
    notes=("`Sam2Model`, `Sam2VisionModel`: SAM 2's image encoder (`vision_encoder`: the "
           "Hiera trunk with windowed and global blocks in raster order, windowed absolute "
           "position embedding, 2x2 query pooling at the stage changes, the FPN neck; the "
           "configured image size): ✅ with vector targets on the grid mean of the FPN's top "
           "level, and `Sam2MaskTarget` (a mask of SAM 2's own prompt encoder and mask "
           "decoder, reading the stages its decoder uses); other image sizes for the encoder "
           "(sides multiples of the patch stride, whole pos_embed_window tiles, stage grids "
           "halving exactly: 32 px for SAM 2.1), masks only at the configured size "
           "(Sam2Model's own decoder fixes it); pooling as in Hiera — refused by "
           "name: the methods that do not carry query pooling, TIS and true token removal "
           "(remove pixels), stage changes without pooling"),
    examples={
        # 32 px, four stages (8x8 ... 1x1 grids), windows of 4 and 2 (the pooling blocks'
        # windows pooled inside), one global block; vector targets on its 16-d output
        # (other sizes: multiples of 32 px; the embedding suite expects global attention:
        # its own tests)
        "hf_sam2": Example(sam2_example(vision=True), (32, 32), library="transformers",
                           target="embedding", suite=False),
        # a support-matrix column: Sam2Model, vector targets and Sam2MaskTarget's masks
        "hf_sam2_model": Example(sam2_example(), (32, 32), library="transformers",
                                 target="sam_mask", tags=("matrix",), suite=False),
    })
class HFSam2Adapter(ViTAdapter):
    """Canonical view of the image encoder of a Hugging Face ``Sam2Model`` or
    ``Sam2VisionModel`` (:mod:`captum_vit.adapters.families.hf_sam2`); never modified:
    raster-order states, windowed or global blocks, query pooling at the stage changes,
    and the grid mean of the FPN's top level as the output.

    Any ``attn_implementation`` in float32 and half precision; a float64 model needs
    ``"sdpa"`` (the default): the eager path computes its softmax in float32. Images of
    any size the encoder takes (:meth:`grid_of`: multiples of :attr:`size_unit` px); the
    blocks' windows and poolings are read for the images of each call.

    Args:
        model (nn.Module): a ``Sam2Model`` or ``Sam2VisionModel``.

    Raises:
        TypeError: another model, or settings the canonical form does not have (module
            docstring).

    Examples::

        >>> from captum_vit.adapters import adapt
        >>> a = adapt(sam2)                      # a transformers.Sam2Model
        >>> type(a).__name__, a.embedding
        ('HFSam2Adapter', True)
    """

    num_prefix = 0
    readout = "avg"
    embedding = True

    model: ModelTree  # read by attribute names (captum_vit.adapters._typing)
    encoder: ModelTree
    trunk: ModelTree

    def __init__(self, model: ModelTree) -> None:
        super().__init__()
        name = type(model).__name__
        if name not in HF_SAM2_CLASSES:
            raise TypeError(f"HFSam2Adapter explains {' or '.join(HF_SAM2_CLASSES)}, got {name}")
        self.model = model
        self.encoder = getattr(model, "vision_encoder", model)
        self.trunk = self.encoder.backbone
        self.where = name if self.encoder is model else f"{name}.vision_encoder"
        if not hasattr(self.trunk, "blocks") or not hasattr(self.trunk, "pos_embed_window"):
            raise TypeError(f"{self.where}.backbone is {type(self.trunk).__name__}; captum_vit "
                            "supports SAM 2's Hiera trunk (Sam2HieraDetModel)")
        cfg = self.trunk.config
        stride = _pair(cfg.query_stride)
        if stride != (2, 2):
            raise TypeError(f"{name} pools queries with stride {stride}; captum_vit supports "
                            "a 2x2 query stride")
        conv = self.trunk.patch_embed.projection
        self.in_chans = int(conv.in_channels)
        self.stride = _pair(conv.stride)
        self.image_size = _pair(cfg.image_size)
        self.window0 = cast(tuple[int, int], tuple(int(s) for s in
                                                   self.trunk.pos_embed_window.shape[-2:]))
        """The window position embedding's size (``pos_embed_window``), tiled by the model
        over the first grid."""
        self.grid0 = _conv_out(self.image_size, conv)
        """The first stage's grid of the images of the moment (:meth:`check_inputs`,
        :meth:`layout` and :meth:`embed` set it; the configured size's at first)."""
        self._read_parts()

    @property
    def size_unit(self) -> tuple[int, int]:
        """``(u_h, u_w)`` px: the image sides the encoder takes are the multiples of these
        (the patch stride times the least common multiple of the window position
        embedding's size and ``2^pools``, every stage grid halving exactly)."""
        pools = sum(1 for b in self.trunk.blocks if b.query_stride)
        return cast(tuple[int, int], tuple(
            self.stride[i] * math.lcm(self.window0[i], 2 ** pools) for i in range(2)))

    def grid_of(self, size: Sequence[int]) -> tuple[int, int]:
        """The first stage's token grid for images of ``size`` ``(H, W)``.

        The model's own encoder runs at other sizes than the configured one when its
        first grid is a whole number of ``pos_embed_window`` tiles and each query
        pooling halves a grid of even sides; captum_vit also takes only sides that are
        multiples of the patch stride (one token per ``stride`` pixels).

        Raises:
            ValueError: a size outside these rules, naming the rule and the sizes to use.
        """
        h, w = (int(size[0]), int(size[1]))
        name, unit = type(self.model).__name__, self.size_unit
        fix = (f"resize the images to a multiple of {unit[0]}x{unit[1]} px (e.g. the "
               f"configured {self.image_size[0]}x{self.image_size[1]})")
        if h % self.stride[0] or w % self.stride[1]:
            raise ValueError(f"inputs size {(h, w)} is not a multiple of {name}'s patch "
                             f"stride {self.stride}, so its tokens do not tile the images; "
                             f"{fix}")
        grid = (h // self.stride[0], w // self.stride[1])
        if grid[0] % self.window0[0] or grid[1] % self.window0[1]:
            raise ValueError(
                f"inputs size {(h, w)} gives a {grid[0]}x{grid[1]} token grid, not a whole "
                f"number of {name}'s {self.window0[0]}x{self.window0[1]} window position "
                "embedding (backbone.pos_embed_window, tiled over the grid: the model itself "
                f"fails there); {fix}")
        g = grid
        for i, blk in enumerate(self.trunk.blocks):
            if blk.query_stride:
                if min(g) < 2 or g[0] % 2 or g[1] % 2:
                    raise ValueError(
                        f"inputs size {(h, w)} gives a {g[0]}x{g[1]} grid at "
                        f"{self.where}.backbone.blocks[{i}], which pools its queries 2x2: "
                        f"the stage grids must halve exactly; {fix}")
                g = (g[0] // 2, g[1] // 2)
        return grid

    def _use_grid(self, grid: tuple[int, int]) -> None:
        """Read the blocks' windows and poolings for a first grid of ``grid``."""
        if grid != self.grid0:
            self.grid0 = grid
            self._read_parts()

    def _read_parts(self) -> None:
        trunk, where = self.trunk, self.where
        grid = self.grid0
        parts = []
        for i, blk in enumerate(trunk.blocks):
            at = f"{where}.backbone.blocks[{i}]"
            attn, mlp = blk.attn, blk.mlp
            if not isinstance(getattr(attn, "qkv", None), nn.Linear) \
                    or not isinstance(getattr(mlp, "proj_in", None), nn.Linear) \
                    or len(mlp.layers) or mlp.sigmoid_output:
                raise TypeError(f"{at} is not a Sam2MultiScaleBlock (attn.qkv; an MLP "
                                "proj_in, activation, proj_out)")
            size = int(blk.window_size)
            win = Windows(grid=grid, size=grid if size == 0 else (size, size))
            proj = getattr(blk, "proj", None)
            pool = None
            if blk.query_stride:
                if proj is None:
                    raise TypeError(f"{at} pools queries without a residual projection; "
                                    "captum_vit supports SAM 2's projected residual")
                if min(grid) < 2 or grid[0] % 2 or grid[1] % 2:
                    raise TypeError(f"{at} pools the {grid[0]}x{grid[1]} grid, not of even "
                                    "sides; use an image size whose stage grids halve exactly")
                pool = QueryPool(grid=grid, weight=proj.weight, bias=proj.bias)
            elif proj is not None:
                raise TypeError(f"{at} changes the width without query pooling "
                                "(num_query_pool_stages < stages - 1); captum_vit supports "
                                "a query pooling at every stage change")
            w = attn.qkv.weight.detach()
            a = w.shape[0] // 3
            b = None if attn.qkv.bias is None else attn.qkv.bias.detach()
            heads = int(attn.num_attention_heads)
            identity = nn.Identity()
            parts.append(BlockParts(
                norm1=_norm_parts(blk.layer_norm1, f"{at}.layer_norm1"),
                q_weight=w[:a], k_weight=w[a:2 * a], v_weight=w[2 * a:],
                q_bias=None if b is None else b[:a], k_bias=None if b is None else b[a:2 * a],
                v_bias=None if b is None else b[2 * a:], num_heads=heads,
                head_dim=a // heads, scale=float(attn.scale), q_norm=identity,
                k_norm=identity, proj_weight=attn.proj.weight, proj_bias=attn.proj.bias,
                norm2=_norm_parts(blk.layer_norm2, f"{at}.layer_norm2"), ls1=None,
                fc1_weight=mlp.proj_in.weight, fc1_bias=mlp.proj_in.bias,
                act=cast(Callable[[Tensor], Tensor], mlp.activation),
                fc2_weight=mlp.proj_out.weight, fc2_bias=mlp.proj_out.bias, ls2=None,
                window=win, pool=pool))
            if pool is not None:
                grid = pool.out_grid
        if not parts:
            raise TypeError(f"{where}.backbone has no blocks")
        # the blocks whose outputs are the stages' outputs (the neck's inputs)
        self.stage_ends: list[int] = [int(e) for e in trunk.stage_ends]
        self.blocks = parts
        convs = self.encoder.neck.convs
        # the FPN's lateral of the last stage is convs[0] (the neck runs top-down)
        weight, bias = _lateral(convs[0], f"{where}.neck.convs[0]")
        for j, c in enumerate(convs):
            _lateral(c, f"{where}.neck.convs[{j}]")
        self.head = HeadParts(None, None, (("avg", weight, bias),))

    def refresh(self) -> None:
        first = self.trunk.blocks[0].attn.qkv.weight
        # storage replaced (a block's q_weight is never None)
        if cast(Tensor, self.blocks[0].q_weight).data_ptr() != first.data_ptr():
            self._read_parts()

    def stage_grids(self) -> list[tuple[int, int]]:
        """The token grid of each stage's output (the neck's inputs), finest first."""
        grids, grid = [], self.grid0
        for l, p in enumerate(self.blocks):
            if p.pool is not None:
                grid = p.pool.out_grid
            if l in self.stage_ends:
                grids.append(grid)
        return grids

    @property
    def input_shape(self) -> tuple[int, tuple[int, int]]:
        return self.in_chans, self.image_size

    @property
    def patch_size(self) -> tuple[int, int]:
        """The patch stride ``(sh, sw)``: one token per ``sh × sw`` pixels."""
        return self.stride

    def check_inputs(self, inputs: Tensor) -> None:
        super().check_inputs(inputs)
        self._use_grid(self.grid_of(inputs.shape[-2:]))

    def layout(self, inputs: Tensor) -> Layout:
        self.refresh()
        h, w = inputs.shape[-2:]
        self._use_grid(self.grid_of((h, w)))
        return Layout(num_prefix=0, grid=self.grid0, patch_size=self.stride,
                      readout=self.readout, num_blocks=self.num_blocks,
                      num_heads=self.blocks[0].num_heads, image_size=(int(h), int(w)))

    def embed(self, inputs: Tensor, ops: Ops | None = None) -> Tensor:
        """The patch embedding plus the windowed position embedding, tokens [B, N, D] in
        raster order; with ``ops`` the overlapping patch convolution through
        ``ops.linear`` (:func:`~captum_vit.adapters.families._torch.conv_projection`)."""
        self.refresh()
        self._use_grid(self.grid_of(inputs.shape[-2:]))
        trunk = self.trunk
        conv = trunk.patch_embed.projection
        if ops is None:
            x = trunk.patch_embed(inputs)  # [B, h, w, D]
            x = x + trunk._get_pos_embed(x.shape[1:3])
            return x.reshape(x.shape[0], -1, x.shape[-1])
        x = conv_projection(inputs, conv, ops, f"{self.where}.backbone.patch_embed.projection")
        pos = trunk._get_pos_embed(self.grid0)
        return x + pos.reshape(1, -1, pos.shape[-1]).to(inputs.dtype)

    def model_outputs(self, inputs: Tensor) -> Tensor:
        """The grid mean of the top FPN level of the encoder's own trunk and neck,
        ``[B, fpn_hidden_size]``."""
        states = self.trunk(pixel_values=inputs).intermediate_hidden_states
        fpn, _ = self.encoder.neck(states)
        return fpn[0].mean((-2, -1))

    def parameter_stages(self) -> list[list[nn.Parameter]]:
        """The neck, then the blocks from the top (a ``Sam2Model``'s prompt encoder and
        mask decoder are not part of the explained encoder: in none)."""
        return [list(self.encoder.neck.parameters())] + \
            [list(b.parameters()) for b in self.trunk.blocks][::-1]

    def is_random(self) -> bool:
        return False  # SAM 2's encoder has no dropout


def sam2_model(model: object) -> nn.Module:
    """``model`` if it is a Hugging Face ``Sam2Model`` (with its prompt encoder and mask
    decoder).

    Raises:
        TypeError: another model (a ``Sam2VisionModel`` has no mask decoder).
    """
    if not isinstance(model, nn.Module) or not is_transformers_model(model, ("Sam2Model",)):
        raise TypeError(f"model must be a Hugging Face Sam2Model (image encoder, prompt "
                        f"encoder and mask decoder), got {type(model).__name__}; an image "
                        "encoder alone (Sam2VisionModel) has no masks: explain its embedding "
                        "with an EmbeddingTarget")
    return model


def sam2_check_mask_size(model: nn.Module, size: tuple[int, int]) -> None:
    """Refuse images of another size than the one a ``Sam2Model`` draws masks for: its
    prompt encoder's ``image_size`` (the configured size, ``Sam2Processor``'s resize).

    ``Sam2Model.forward`` itself fixes it: it reshapes the FPN levels to the configured
    ``vision_config.backbone_feature_sizes``, and its prompt encoder builds the dense
    prompt embedding and the image-wide positional embedding of the mask decoder on the
    ``image_size // patch_size`` grid and scales the prompts by ``image_size`` (at other
    sizes the model's own forward raises). Its image encoder alone takes other sizes
    (:meth:`HFSam2Adapter.grid_of`).

    Raises:
        ValueError: ``size`` is not the configured one.
    """
    pe = cast(ModelTree, model).prompt_encoder
    want = (int(pe.input_image_size), int(pe.input_image_size))
    got = (int(size[0]), int(size[1]))
    if got != want:
        feats = [list(map(int, f)) for f in cast(ModelTree, model).backbone_feature_sizes]
        emb = tuple(int(e) for e in pe.image_embedding_size)
        raise ValueError(
            f"Sam2MaskTarget: a Sam2Model draws masks only for images of its configured size "
            f"{want[0]}x{want[1]}, got {got[0]}x{got[1]}: Sam2Model.forward reshapes the FPN "
            f"levels to the fixed vision_config.backbone_feature_sizes {feats}, and its prompt "
            "encoder builds the dense prompt embedding and the image-wide positional "
            f"embedding on the fixed {emb[0]}x{emb[1]} grid (prompt_encoder_config.image_size "
            "// patch_size) and scales the prompts by that image_size, so the model itself "
            f"fails on {got[0]}x{got[1]} images; resize the images to {want[0]}x{want[1]} (as "
            "Sam2Processor does), or explain the image embedding at this size with an "
            "EmbeddingTarget (the image encoder takes other sizes)")


def sam2_read_stages(model: nn.Module) -> tuple[int, ...]:
    """The trunk stages whose outputs reach the mask decoder of a ``Sam2Model``: the
    ``num_feature_levels`` finest, and every coarser one a top-down connection of the FPN
    brings into them (sorted, finest first)."""
    enc = cast(ModelTree, model).vision_encoder
    n = len(enc.neck.convs) - 1
    read = set(range(int(enc.num_feature_levels)))
    levels = {int(i) for i in enc.neck.fpn_top_down_levels}
    for i in sorted(read):
        j = i
        while j in levels and j != n:  # level j adds the upsampled level j + 1
            j += 1
            read.add(j)
    return tuple(sorted(read))


def sam2_stage_grids(model: nn.Module) -> list[tuple[int, int]]:
    """The token grid of each trunk stage of a ``Sam2Model`` at its configured size (finest
    first)."""
    return HFSam2Adapter(cast(ModelTree, model)).stage_grids()


def sam2_mask_logits(model: nn.Module, stages: dict[int, Tensor],
                     grids: list[tuple[int, int]], points: Tensor | None,
                     labels: Tensor | None, boxes: Tensor | None,
                     multimask_output: bool) -> Tensor:
    """The low-resolution mask logits of SAM 2's own neck, prompt encoder and mask decoder
    on trunk stage outputs, for ``u`` prompts on each of ``n`` images:
    ``[n, u, masks, h_m, w_m]`` (``Sam2Model.forward``'s ``pred_masks``).

    As ``Sam2Model.forward`` computes them from ``pixel_values``: the FPN neck on the
    stage outputs, its ``num_feature_levels`` finest levels (finest first), the decoder's
    ``conv_s0`` / ``conv_s1`` on the two finest and ``no_memory_embedding`` added to the
    coarsest (the image embedding), then ``Sam2Model.forward`` with ``image_embeddings``.

    Args:
        model (nn.Module): a ``Sam2Model``.
        stages (dict[int, Tensor]): token states ``[n, h_s w_s, D_s]`` (raster order) of
            the stages :func:`sam2_read_stages` lists; the other stages do not reach the
            masks (zeros are passed for them).
        grids (list): every stage's grid (:func:`sam2_stage_grids`).
        points (Tensor, optional): ``[u, P, 2]`` pixel coordinates ``(x, y)`` of the
            model's input images.
        labels (Tensor, optional): ``[u, P]`` (1 foreground, 0 background).
        boxes (Tensor, optional): ``[u, 4]`` ``(x0, y0, x1, y1)`` in pixels.
        multimask_output (bool): the decoder's three masks, or its single one.

    Raises:
        ValueError: stage states of another grid than the model's.
    """
    m = cast(ModelTree, model)
    enc = m.vision_encoder
    widths = [int(c.in_channels) for c in enc.neck.convs][::-1]  # finest first
    some = next(iter(stages.values()))
    n = some.shape[0]
    states = []
    for s, (grid, width) in enumerate(zip(grids, widths, strict=True)):
        x = stages.get(s)
        if x is None:
            states.append(some.new_zeros(n, *grid, width))
            continue
        if tuple(x.shape[1:]) != (grid[0] * grid[1], width):
            raise ValueError(f"stage {s} of this Sam2Model has {grid[0]}x{grid[1]} tokens of "
                             f"width {width}, got states of shape {tuple(x.shape)}: explain "
                             "the Sam2Model given to the target")
        states.append(x.reshape(n, *grid, width))
    fpn, _ = enc.neck(tuple(states))
    maps = list(fpn[-int(enc.num_feature_levels):][::-1])
    maps[0] = m.mask_decoder.conv_s0(maps[0])
    maps[1] = m.mask_decoder.conv_s1(maps[1])
    maps[-1] = maps[-1] + m.no_memory_embedding.reshape(1, -1, 1, 1)
    kw: dict = {}
    ref = maps[-1]
    if points is not None:
        kw["input_points"] = points.to(ref)[None].expand(n, *points.shape)
        labels = cast(Tensor, labels)  # labels go with points
        kw["input_labels"] = labels.to(ref.device)[None].expand(n, *labels.shape)
    if boxes is not None:
        kw["input_boxes"] = boxes.to(ref)[None].expand(n, *boxes.shape)
    out = model(image_embeddings=maps, multimask_output=multimask_output, **kw)
    return out.pred_masks
