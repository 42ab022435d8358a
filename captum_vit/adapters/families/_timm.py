"""Readers of timm's modules, written once for the timm families (ViT, BEiT, Eva, Swin,
Swin V2, Hiera, SAM): the ``VisionTransformer`` engine :class:`TimmViTBase` that the ViT,
BEiT and Eva adapters extend, the Swin engine :class:`TimmSwinBase` of the Swin and Swin V2
adapters, the attention, head, attention-pool and dropout readers, and
:func:`timm_classes` (timm's classes, imported when first read: ``import captum_vit``
stays light).

With :mod:`~captum_vit.adapters.families.timm_vit`, only these files know timm's
attribute names. It reads (never changes) the model's
modules and parameters and runs the embedding through the model's own code (with an
:class:`Ops` rule set, the patch projection and the embedding norms through it).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any, cast

import torch.nn.functional as F
from torch import Tensor, nn

from captum_vit.adapters._typing import ModelTree
from captum_vit.adapters.base import ViTAdapter
from captum_vit.adapters.families._hf import pair
from captum_vit.adapters.layout import Layout
from captum_vit.adapters.ops import Ops, patch_projection
from captum_vit.adapters.parts import BlockParts, HeadParts, NormParts, PoolParts
from captum_vit.adapters.parts import layer_norm_parts as _norm_parts
from captum_vit.adapters.windows import MergeParts


def optional_norm(m: ModelTree, what: str) -> NormParts | None:
    return None if isinstance(m, nn.Identity) else _norm_parts(m, what)


def _layer_scale(m: ModelTree) -> Tensor | None:
    return None if isinstance(m, nn.Identity) else m.gamma


def timm_head(head: nn.Module, where: str) -> tuple[Tensor | None, Tensor | None]:
    """A timm classifier's ``(weight, bias)``, or ``(None, None)`` for a model built with
    ``num_classes=0`` (``nn.Identity``): it outputs its pooled embedding and is explained
    with vector targets (:mod:`captum_vit.targets`)."""
    if isinstance(head, nn.Identity):
        return None, None
    if not isinstance(head, nn.Linear):
        raise TypeError(f"{where} is {type(head).__name__}; captum_vit needs a linear "
                        "classifier head, or none (num_classes=0, explained with vector "
                        "targets)")
    return head.weight, head.bias


def has_active_dropout(model: ModelTree) -> bool:
    from timm.layers import DropPath, PatchDropout

    for m in model.modules():
        if m.training and ((isinstance(m, nn.Dropout) and m.p > 0)
                           or (isinstance(m, DropPath) and m.drop_prob > 0)
                           or (isinstance(m, PatchDropout) and m.prob > 0)):
            return True
    return False


class TimmViTBase(ViTAdapter):
    """Canonical view of a timm ``VisionTransformer`` (or ``VisionTransformerDistilled``):
    the engine of :class:`~captum_vit.adapters.TimmViTAdapter` and its BEiT and Eva kin.

    The q/k/v parts of every block are views (row slices) of timm's fused ``qkv``
    parameter; they are re-read when the model's parameters are replaced (``model.to``).
    """

    model: ModelTree  # read by attribute names (captum_vit.adapters._typing)

    def __init__(self, model: ModelTree) -> None:
        super().__init__()
        self.model = model
        _refuse_cnn_stem(model.patch_embed, type(model).__name__)
        self._read_vit(model)
        self.in_chans = int(model.patch_embed.proj.in_channels)

    def _read_vit(self, model: ModelTree) -> None:
        """Read the blocks (timm's pre-LN ``Block`` only), the prefix count and the head
        (norm, ``fc_norm``, token / avg / attention-pool readout, classifier) of a timm
        ``VisionTransformer``-like model (also ``NaFlexVit``, which has the same names)."""
        from timm.layers import Attention, Mlp
        from timm.models.vision_transformer import Block

        name = type(model).__name__
        for i, blk in enumerate(model.blocks):
            where = f"{name}.blocks[{i}]"
            if type(blk) is not Block:
                raise TypeError(f"{where} is {type(blk).__name__}; captum_vit supports timm's "
                                "pre-LN `Block` (not ResPostBlock, parallel or custom blocks)")
            attn, mlp = blk.attn, blk.mlp
            if type(attn) is not Attention or getattr(attn, "gate", None) is not None \
                    or not isinstance(attn.norm, nn.Identity):
                raise TypeError(f"{where}.attn is not timm's plain `Attention` (no gate, no "
                                "scale_norm); this attention variant is not supported")
            if type(mlp) is not Mlp or not isinstance(mlp.norm, nn.Identity) \
                    or not isinstance(mlp.act, (nn.GELU, *timm_gelus())):
                raise TypeError(f"{where}.mlp must be timm's `Mlp` with a GELU activation and "
                                "no hidden norm (GLU/SwiGLU MLPs are not supported)")
        if len(model.blocks) == 0:
            raise TypeError(f"{name} has no transformer blocks")
        self.blocks = [self._parts(blk, f"{name}.blocks[{i}]")
                       for i, blk in enumerate(model.blocks)]
        self.num_prefix = int(model.num_prefix_tokens)

        head = timm_head(model.head, f"{name}.head")
        self.embedding = head[0] is None
        head_norm = optional_norm(model.norm, f"{name}.norm")
        fc_norm = optional_norm(model.fc_norm, f"{name}.fc_norm")
        heads: tuple[tuple[int | str, Tensor | None, Tensor | None], ...]
        if hasattr(model, "head_dist"):  # timm.models.deit.VisionTransformerDistilled
            self.readout = "distilled"
            heads = ((0, *head), (1, *timm_head(model.head_dist, f"{name}.head_dist")))
        elif getattr(model, "attn_pool", None) is not None:  # global_pool='map'
            self.readout = "map"
            heads = (("map", *head),)
        elif model.global_pool == "token":
            self.readout = "token"
            heads = ((0, *head),)
        elif model.global_pool == "avg" and not getattr(model, "pool_include_prefix", False):
            self.readout = "avg"
            heads = (("avg", *head),)
        else:
            raise TypeError(f"global_pool={model.global_pool!r} is not supported; captum_vit "
                            "supports 'token' (class token) and 'avg' (mean of patch tokens)")
        pool = getattr(model, "attn_pool", None)
        self.head = HeadParts(head_norm, fc_norm, heads, attn_pool=None if pool is None
                              else pool_parts(pool, f"{name}.attn_pool", 0 if getattr(
                                  model, "pool_include_prefix", False) else self.num_prefix))

    def refresh(self) -> None:
        name = type(self.model).__name__
        for i, (p, blk) in enumerate(zip(self.blocks, self.model.blocks, strict=True)):
            # storage replaced (a block's q_weight is never None)
            if cast(Tensor, p.q_weight).data_ptr() != blk.attn.qkv.weight.data_ptr():
                self.blocks[i] = self._parts(blk, f"{name}.blocks[{i}]")

    def _parts(self, blk: ModelTree, where: str) -> BlockParts:
        """The canonical parts of one block (families with other blocks override this)."""
        return _block_parts(blk, where)

    @property
    def input_shape(self) -> tuple[int, tuple[int, int]]:
        size = self.model.patch_embed.img_size
        return self.in_chans, (int(size[0]), int(size[1]))

    def parameter_stages(self) -> list[list[nn.Parameter]]:
        m = self.model
        head = [m.norm, getattr(m, "attn_pool", None), m.fc_norm, m.head,
                getattr(m, "head_dist", None)]
        stages = [[p for mod in head if mod is not None for p in mod.parameters()]]
        stages += [list(blk.parameters()) for blk in reversed(m.blocks)]
        return stages

    # ------------------------------------------------------------------------------------
    def _grid(self, h: int, w: int) -> tuple[int, int]:
        pe = self.model.patch_embed
        if getattr(self.model, "dynamic_img_size", False):
            return tuple(pe.dynamic_feat_size((h, w)))
        return tuple(pe.grid_size)

    def check_inputs(self, inputs: Tensor) -> None:
        super().check_inputs(inputs)
        pe = self.model.patch_embed
        h, w = inputs.shape[-2:]
        ph, pw = pe.patch_size
        if getattr(self.model, "dynamic_img_size", False):
            if not getattr(pe, "dynamic_img_pad", False) and (h % ph or w % pw):
                raise ValueError(
                    f"inputs size {(h, w)} is not divisible by the patch size {(ph, pw)}; "
                    "resize or crop the images to a multiple of the patch size")
        elif (h, w) != tuple(pe.img_size):
            hint = (" or build the model with dynamic_img_size=True"
                    if hasattr(self.model, "dynamic_img_size") else "")
            raise ValueError(
                f"inputs size {(h, w)} does not match the model's fixed img_size "
                f"{tuple(pe.img_size)}; resize the images{hint}")

    def is_random(self) -> bool:
        return has_active_dropout(self.model)

    def layout(self, inputs: Tensor) -> Layout:
        self.refresh()
        h, w = inputs.shape[-2:]
        return Layout(
            num_prefix=self.num_prefix,
            grid=self._grid(h, w),
            patch_size=tuple(self.model.patch_embed.patch_size),
            readout=self.readout,
            num_blocks=self.num_blocks,
            num_heads=self.blocks[0].num_heads,
            image_size=(int(h), int(w)),
        )

    def embed(self, inputs: Tensor, ops: Ops | None = None) -> Tensor:
        """The model's ``patch_embed``, ``_pos_embed``, ``patch_drop`` and ``norm_pre``;
        with ``ops`` the patch projection and the norms through it
        (:meth:`ViTAdapter.embed`)."""
        self.refresh()
        m = self.model
        x = self._patch_embed(inputs, ops)
        x = m._pos_embed(x)
        x = m.patch_drop(x)
        return self._norm_pre(x, ops)

    def _patch_embed(self, inputs: Tensor, ops: Ops | None) -> Tensor:
        """timm's ``PatchEmbed`` (also BEiT's and Eva's): ``ops=None`` is the module
        itself; with ``ops`` its forward with the projection as ``ops.linear`` of the
        unfolded patches and its ``norm`` as ``ops.norm`` (timm's own padding and output
        format)."""
        from timm.layers import PatchEmbed
        from timm.layers.format import Format, nchw_to

        pe = self.model.patch_embed
        if ops is None:
            return pe(inputs)
        name = type(self.model).__name__
        if not isinstance(pe, PatchEmbed):
            raise TypeError(f"{name}.patch_embed is {type(pe).__name__}; the LRP rules of "
                            "the embedding need timm's PatchEmbed (explain at='tokens')")
        x = inputs
        if pe.dynamic_img_pad:  # as PatchEmbed.forward
            ph, pw = pe.patch_size
            x = F.pad(x, (0, (pw - x.shape[-1] % pw) % pw, 0, (ph - x.shape[-2] % ph) % ph))
        x = patch_projection(x, pe.proj, ops, f"{name}.patch_embed.proj").permute(0, 3, 1, 2)
        if pe.flatten:  # NCHW -> NLC, as PatchEmbed.forward
            x = x.flatten(2).transpose(1, 2)
        elif pe.output_fmt != Format.NCHW:
            x = nchw_to(x, pe.output_fmt)
        if isinstance(pe.norm, nn.Identity):
            return x
        return ops.norm(x, _norm_parts(pe.norm, f"{name}.patch_embed.norm"))

    def _norm_pre(self, x: Tensor, ops: Ops | None) -> Tensor:
        """The model's ``norm_pre`` (``ops=None``), or ``ops.norm`` with its parameters."""
        norm = getattr(self.model, "norm_pre", None)
        if norm is None or isinstance(norm, nn.Identity):
            return x
        if ops is None:
            return norm(x)
        return ops.norm(x, _norm_parts(norm, f"{type(self.model).__name__}.norm_pre"))

    def embedding_norms(self) -> tuple[str, ...]:
        """The non-identity ``patch_embed.norm`` and ``norm_pre`` (e.g. timm's CLIP ViTs,
        ``pre_norm=True``); the same for BEiT and Eva, which subclass this adapter.
        ``embed(inputs, ops)`` runs them through ``ops.norm`` (LayerNorm only)."""
        m = self.model
        found = (("patch_embed.norm", getattr(m.patch_embed, "norm", None)),
                 ("norm_pre", getattr(m, "norm_pre", None)))
        return tuple(name for name, mod in found
                     if mod is not None and not isinstance(mod, nn.Identity))


def _refuse_cnn_stem(pe: ModelTree, name: str) -> None:
    """Refuse a hybrid ViT (``timm.models.vision_transformer_hybrid``, ViTamin): its
    ``HybridEmbed`` runs a CNN (ResNet) stem and puts tokens on the CNN's feature grid,
    not on pixel patches; the adapter explains a ViT whose tokens are linear projections
    of pixel patches."""
    from timm.layers import HybridEmbed

    if isinstance(pe, HybridEmbed) or hasattr(pe, "backbone"):
        stem = type(getattr(pe, "backbone", None)).__name__
        raise TypeError(
            f"{name}.patch_embed is {type(pe).__name__} with a CNN stem ({stem}): a hybrid "
            "ViT (e.g. vit_small_r26_s32_224) makes its tokens from the CNN's feature map, "
            "not from pixel patches, and captum_vit does not explain the stem. Use a plain "
            "ViT (e.g. vit_small_patch16_224), or Captum's LayerGradCam on a layer of the "
            "hybrid's CNN stem (LayerGradCam(model, model.patch_embed.backbone))")


def mlp_fields(mlp: ModelTree, where: str) -> dict:
    """BlockParts fields of timm's ``Mlp`` or ``SwiGLU`` (gate ``fc1_g``, value ``fc1_x``,
    hidden norm when ``scale_mlp``)."""
    if hasattr(mlp, "fc1_g"):
        return dict(fc1_weight=mlp.fc1_x.weight, fc1_bias=mlp.fc1_x.bias, act=mlp.act,
                    gate_weight=mlp.fc1_g.weight, gate_bias=mlp.fc1_g.bias,
                    mlp_norm=optional_norm(mlp.norm, f"{where}.mlp.norm"),
                    fc2_weight=mlp.fc2.weight, fc2_bias=mlp.fc2.bias)
    return dict(fc1_weight=mlp.fc1.weight, fc1_bias=mlp.fc1.bias, act=mlp.act,
                fc2_weight=mlp.fc2.weight, fc2_bias=mlp.fc2.bias)


def gelu_mlp_fields(mlp: ModelTree, where: str) -> dict:
    """The :class:`BlockParts` MLP fields of timm's plain ``Mlp`` with a GELU (no hidden
    norm), as in Swin and Swin V2 blocks; ``where`` names the block.

    Raises:
        TypeError: another MLP.
    """
    if not isinstance(mlp.norm, nn.Identity) or not isinstance(mlp.act, (nn.GELU, *timm_gelus())):
        raise TypeError(f"{where}.mlp must be timm's Mlp with a GELU activation")
    return dict(fc1_weight=mlp.fc1.weight, fc1_bias=mlp.fc1.bias, act=mlp.act,
                fc2_weight=mlp.fc2.weight, fc2_bias=mlp.fc2.bias, ls1=None, ls2=None)


def timm_attention_fields(blk: ModelTree, where: str) -> dict:
    """The :class:`BlockParts` fields of a timm pre-LN block's norms and attention (ViT,
    BEiT and Eva blocks).

    q/k/v are row slices of the fused ``qkv`` parameters taken through ``detach()``: views
    of the same storage (in-place changes of the model show, ``copy.deepcopy`` keeps them
    views of the copy), never traced by autograd (no gradient is taken w.r.t. parameters).
    Without a ``qkv`` bias, BEiT's and EVA's separate ``q_bias``/``v_bias`` are used (their
    ``k_bias`` is a zero buffer: ``None`` here); Eva's unfused attention has separate
    ``q_proj``/``k_proj``/``v_proj``.
    """
    attn = blk.attn
    qkv = getattr(attn, "qkv", None)
    if qkv is not None:
        w = qkv.weight.detach()
        a = w.shape[0] // 3
        weights = (w[:a], w[a:2 * a], w[2 * a:])
        if qkv.bias is not None:
            b = qkv.bias.detach()
            biases = (b[:a], b[a:2 * a], b[2 * a:])
        else:
            biases = (getattr(attn, "q_bias", None), None, getattr(attn, "v_bias", None))
    else:
        projs = (attn.q_proj, attn.k_proj, attn.v_proj)
        weights = tuple(m.weight for m in projs)
        biases = tuple(m.bias for m in projs)
    identity = nn.Identity()
    return dict(
        norm1=_norm_parts(blk.norm1, f"{where}.norm1"),
        q_weight=weights[0], k_weight=weights[1], v_weight=weights[2],
        q_bias=biases[0], k_bias=biases[1], v_bias=biases[2],
        num_heads=attn.num_heads, head_dim=weights[0].shape[0] // attn.num_heads,
        scale=attn.scale, q_norm=getattr(attn, "q_norm", identity),
        k_norm=getattr(attn, "k_norm", identity),
        proj_weight=attn.proj.weight, proj_bias=attn.proj.bias,
        norm2=_norm_parts(blk.norm2, f"{where}.norm2"),
    )


def _block_parts(blk: ModelTree, where: str) -> BlockParts:
    """The canonical parts of a (validated) timm ``Block``."""
    mlp = blk.mlp
    return BlockParts(
        **timm_attention_fields(blk, where), ls1=_layer_scale(blk.ls1),
        fc1_weight=mlp.fc1.weight, fc1_bias=mlp.fc1.bias, act=mlp.act,
        fc2_weight=mlp.fc2.weight, fc2_bias=mlp.fc2.bias,
        ls2=_layer_scale(blk.ls2),
    )


def pool_parts(pool: ModelTree, where: str, skip_prefix: int = 0) -> PoolParts:
    """The canonical parts of timm's ``AttentionPoolLatent`` (``global_pool='map'``)
    whose keys are the tokens after the first ``skip_prefix``.

    ``k``/``v`` are row views of the fused ``kv`` projection; the pool's GELU ``Mlp``
    follows ``norm``. Position embeddings inside the pool, several pooled latents and a
    pre-logits pool (``out_features=0``) are refused.
    """
    from timm.layers import Mlp

    if getattr(pool, "pos_embed", None) is not None:
        raise TypeError(f"{where} adds its own position embedding; not supported")
    if pool.latent.shape[1] != 1 and pool.pool != "token":
        raise TypeError(f"{where} averages {pool.latent.shape[1]} latent queries; captum_vit "
                        "supports one pooled latent (pool_type='token' or latent_len=1)")
    mlp = pool.mlp
    if mlp is None or type(mlp) is not Mlp or not isinstance(mlp.norm, nn.Identity) \
            or not isinstance(mlp.act, (nn.GELU, *timm_gelus())):
        raise TypeError(f"{where} needs timm's GELU `Mlp` after its projection "
                        "(a pre-logits pool with out_features=0 is not supported)")
    w = pool.kv.weight.detach()
    b = None if pool.kv.bias is None else pool.kv.bias.detach()
    a = w.shape[0] // 2
    q = None if isinstance(pool.q, nn.Identity) else pool.q
    return PoolParts(
        latent=pool.latent[0],
        q_weight=None if q is None else q.weight, q_bias=None if q is None else q.bias,
        k_weight=w[:a], k_bias=None if b is None else b[:a],
        v_weight=w[a:], v_bias=None if b is None else b[a:],
        num_heads=pool.num_heads, head_dim=pool.head_dim, scale=pool.scale,
        q_norm=pool.q_norm, k_norm=pool.k_norm,
        proj_weight=pool.proj.weight, proj_bias=pool.proj.bias,
        norm=optional_norm(pool.norm, f"{where}.norm"),
        fc1_weight=mlp.fc1.weight, fc1_bias=mlp.fc1.bias, act=mlp.act,
        fc2_weight=mlp.fc2.weight, fc2_bias=mlp.fc2.bias, skip_prefix=skip_prefix,
    )


def timm_gelus() -> tuple[type, ...]:
    from timm.layers import activations

    names = ("GELU", "GELUTanh", "QuickGELU")
    return tuple(getattr(activations, n) for n in names if hasattr(activations, n))


def timm_classes(module: str, *names: str) -> tuple[Any, ...]:
    """timm's classes ``names`` of ``module`` (timm is a dependency; imported when first
    read, so ``import captum_vit`` does not import timm).

    Args:
        module (str): e.g. ``"timm.layers"``.
        *names (str): class names there, e.g. ``"Mlp", "SwiGLU"``.

    Returns:
        tuple: the classes, in the order of ``names``.

    Examples::

        >>> (Mlp,) = timm_classes("timm.layers", "Mlp")
    """
    mod = importlib.import_module(module)
    return tuple(getattr(mod, n) for n in names)


class TimmSwinBase(ViTAdapter):
    """The reading shared by timm's Swin and Swin V2 adapters (``SwinTransformer``,
    ``SwinTransformerV2``: the same ``patch_embed``, ``layers[s].blocks`` /
    ``layers[s].downsample``, ``norm`` and ``head.fc`` attribute names): the refresh, input
    size, parameter stages, patch size, fixed-size input check, layout, embedding and mean
    head. A subclass reads its blocks in ``_read_parts``.
    """

    model: ModelTree  # read by attribute names (captum_vit.adapters._typing)

    def _read_parts(self) -> None:
        raise NotImplementedError

    def _adopt(self, model: ModelTree, block_cls: type, what: str) -> None:
        """Read ``model`` after checking it: every stage has blocks, every block is a
        ``block_cls``, the head pools by the mean (``what``: the model, in words)."""
        name = type(model).__name__
        self.model = model
        m = self.model
        if any(len(stage.blocks) == 0 for stage in m.layers):
            raise TypeError(f"{name} has a stage without blocks; captum_vit needs every "
                            "stage to have at least one block")
        for s, stage in enumerate(m.layers):
            for j, blk in enumerate(stage.blocks):
                if type(blk) is not block_cls:
                    raise TypeError(f"{name}.layers[{s}].blocks[{j}] is {type(blk).__name__}; "
                                    f"captum_vit supports timm's {block_cls.__name__}")
        self._check_avg_head(what)
        self.readout = "avg"
        self.num_prefix = 0
        self.in_chans = int(m.patch_embed.proj.in_channels)
        self._read_parts()

    def _blocks_and_merges(self, merging: Any, *, norm_last: bool = False
                           ) -> Iterator[tuple[str, ModelTree, MergeParts | None]]:
        """Every block as ``(where, block, merge)``: ``merge`` is the next stage's
        ``downsample`` (a ``merging`` module, else refused) on the last block of a stage
        that has a next one, read as :class:`MergeParts` (``norm_last``: Swin V2's
        reduce-then-norm), else ``None``."""
        m = self.model
        name = type(m).__name__
        for s, stage in enumerate(m.layers):
            nxt = m.layers[s + 1] if s + 1 < len(m.layers) else None
            for j, blk in enumerate(stage.blocks):
                merge = None
                if nxt is not None and j == len(stage.blocks) - 1:
                    down, where = nxt.downsample, f"{name}.layers[{s + 1}].downsample"
                    if type(down) is not merging:
                        raise TypeError(f"{where} is {type(down).__name__}; captum_vit "
                                        f"supports {merging.__module__}.{merging.__name__} "
                                        "between stages")
                    merge = MergeParts(grid=pair(blk.input_resolution),
                                       norm=_norm_parts(down.norm, f"{where}.norm"),
                                       weight=down.reduction.weight, bias=down.reduction.bias,
                                       norm_last=norm_last)
                yield f"{name}.layers[{s}].blocks[{j}]", blk, merge

    def _check_avg_head(self, what: str) -> None:
        """Refuse a head without global average pooling (``what``: the model, in words)."""
        head = self.model.head
        pool = getattr(getattr(head, "global_pool", None), "pool_type", None)
        if pool != "avg" or getattr(head, "use_conv", False):
            raise TypeError(f"{type(self.model).__name__}.head pools with {pool!r}; captum_vit "
                            f"supports {what}'s global average pooling (global_pool='avg')")

    def _read_head(self) -> None:
        """The final norm and the classifier of the mean readout (an embedding without one)."""
        m = self.model
        name = type(m).__name__
        weight, bias = timm_head(m.head.fc, f"{name}.head.fc")
        self.embedding = weight is None
        self.head = HeadParts(_norm_parts(m.norm, f"{name}.norm"), None, (("avg", weight, bias),))

    def refresh(self) -> None:
        first = self.model.layers[0].blocks[0].attn.qkv.weight
        # storage replaced (a block's q_weight is never None)
        if cast(Tensor, self.blocks[0].q_weight).data_ptr() != first.data_ptr():
            self._read_parts()

    @property
    def input_shape(self) -> tuple[int, tuple[int, int]]:
        size = self.model.patch_embed.img_size
        return self.in_chans, (int(size[0]), int(size[1]))

    def parameter_stages(self) -> list[list[nn.Parameter]]:
        """The head (final norm, classifier), then the blocks from the top; a merge's
        parameters go with the block it follows (the block that carries it)."""
        m = self.model
        stages: list[list[nn.Parameter]] = [list(m.norm.parameters()) + list(m.head.parameters())]
        blocks: list[list[nn.Parameter]] = []
        for s, stage in enumerate(m.layers):
            if s > 0:
                blocks[-1] += list(stage.downsample.parameters())
            blocks += [list(blk.parameters()) for blk in stage.blocks]
        return stages + blocks[::-1]

    @property
    def patch_size(self) -> tuple[int, int]:
        """The patch size ``(ph, pw)`` of the patch embedding."""
        return pair(self.model.patch_embed.patch_size)

    def check_inputs(self, inputs: Tensor) -> None:
        super().check_inputs(inputs)
        self.check_fixed_size(inputs, self.input_shape[1], type(self.model).__name__)

    def is_random(self) -> bool:
        return has_active_dropout(self.model)

    def layout(self, inputs: Tensor) -> Layout:
        self.refresh()
        h, w = inputs.shape[-2:]
        return Layout(num_prefix=0, grid=self.blocks[0].window.grid,
                      patch_size=self.patch_size, readout=self.readout,
                      num_blocks=self.num_blocks, num_heads=self.blocks[0].num_heads,
                      image_size=(int(h), int(w)))

    def embed(self, inputs: Tensor, ops: Ops | None = None) -> Tensor:
        """The model's ``patch_embed`` (projection and norm) as tokens [B, N, C] of the
        first stage's grid; with ``ops`` the projection through ``ops.linear`` and the norm
        through ``ops.norm`` (:meth:`ViTAdapter.embed`)."""
        self.refresh()
        pe = self.model.patch_embed
        name = type(self.model).__name__
        if ops is None:
            x = pe(inputs)  # [B, gh, gw, C]
            return x.reshape(x.shape[0], -1, x.shape[-1])
        x = patch_projection(inputs, pe.proj, ops, f"{name}.patch_embed.proj")
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        if isinstance(pe.norm, nn.Identity):
            return x
        return ops.norm(x, _norm_parts(pe.norm, f"{name}.patch_embed.norm"))

    def embedding_norms(self) -> tuple[str, ...]:
        """The patch embedding's norm (Swin's ``patch_norm``)."""
        return () if isinstance(self.model.patch_embed.norm, nn.Identity) \
            else ("patch_embed.norm",)
