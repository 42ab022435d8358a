"""Adapters for Swin Transformers (Liu et al., ICCV 2021): timm's ``SwinTransformer``.

Only this file knows Swin's attribute names. A Swin is a list of stages; its canonical
form (:mod:`captum_vit.adapters.windows`) is one :class:`BlockParts` per block whose
``window`` is the block's window partition (cyclic shift in every other block, padding of
the grid to whole windows, the seam mask of ``-100``, all as the model computes them) and
whose ``attn_bias`` is the model's own relative position bias of one window; the last
block of a stage carries the next stage's patch merge (LayerNorm + linear). The tokens
have no prefix rows, the maps land on the first stage's grid, and the logits read the mean
of the final stage's tokens after the final norm (``readout="avg"``).

``SwinTransformerV2`` (cosine attention with a learned logit scale, a continuous position
bias from an MLP over log-spaced coordinates, post-norm residual blocks) does not fit the
pre-LN canonical block and is refused by name.
"""

from __future__ import annotations

from torch import Tensor, nn

from captum_vit.adapters.base import ViTAdapter
from captum_vit.adapters.layout import Layout
from captum_vit.adapters.ops import Ops, patch_projection
from captum_vit.adapters.parts import BlockParts, HeadParts
from captum_vit.adapters.parts import layer_norm_parts as _norm_parts
from captum_vit.adapters.windows import MergeParts, Windows


def _timm_swin_classes() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """(timm's Swin v1 class, the Swin v2 classes it refuses)."""
    from timm.models import swin_transformer, swin_transformer_v2, swin_transformer_v2_cr

    return ((swin_transformer.SwinTransformer,),
            (swin_transformer_v2.SwinTransformerV2, swin_transformer_v2_cr.SwinTransformerV2Cr))


def is_timm_swin(model: nn.Module) -> bool:
    """``True`` for timm's ``SwinTransformer`` (and, to refuse them by name, its V2
    classes)."""
    try:
        v1, v2 = _timm_swin_classes()
    except ImportError:  # pragma: no cover - timm is a dependency
        return False
    return isinstance(model, v1 + v2)


class TimmSwinAdapter(ViTAdapter):
    """Canonical view of a timm ``SwinTransformer`` (v1): windowed blocks, merges between
    stages, mean readout (:mod:`captum_vit.adapters.swin`).

    The q/k/v parts are row views of each block's fused ``qkv`` parameter and the relative
    position bias is the model's own ``WindowAttention._get_rel_pos_bias``; the model is
    never changed.

    Raises:
        TypeError: ``SwinTransformerV2`` / ``SwinTransformerV2Cr``, a head without global
            average pooling, or blocks of another kind.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        from timm.models.swin_transformer import SwinTransformerBlock

        v1, v2 = _timm_swin_classes()
        name = type(model).__name__
        if isinstance(model, v2) or not isinstance(model, v1):
            raise TypeError(
                f"captum_vit cannot explain timm's {name}: Swin V2's cosine attention with "
                "a learned logit scale, continuous position bias (an MLP over log-spaced "
                "coordinates) and post-norm blocks do not fit the pre-LN canonical block; "
                "use a Swin v1 (timm SwinTransformer, e.g. swin_tiny_patch4_window7_224)")
        self.model = model
        blocks = [blk for stage in model.layers for blk in stage.blocks]
        if not blocks or any(len(stage.blocks) == 0 for stage in model.layers):
            raise TypeError(f"{name} has a stage without blocks; captum_vit needs every "
                            "stage to have at least one block")
        for i, blk in enumerate(blocks):
            if type(blk) is not SwinTransformerBlock:
                raise TypeError(f"{name} block {i} is {type(blk).__name__}; captum_vit "
                                "supports timm's SwinTransformerBlock")
        head = model.head
        pool = getattr(getattr(head, "global_pool", None), "pool_type", None)
        if pool != "avg" or getattr(head, "use_conv", False):
            raise TypeError(f"{name}.head pools with {pool!r}; captum_vit supports Swin's "
                            "global average pooling (global_pool='avg')")
        self.readout = "avg"
        self.num_prefix = 0
        self.in_chans = int(model.patch_embed.proj.in_channels)
        self._read_parts()

    def _read_parts(self) -> None:
        """The canonical parts of every block and of the head (views of the model)."""
        from captum_vit.adapters.timm_vit import _timm_gelus, timm_attention_fields, timm_head

        m = self.model
        name = type(m).__name__
        parts: list[BlockParts] = []
        for s, stage in enumerate(m.layers):
            nxt = m.layers[s + 1] if s + 1 < len(m.layers) else None
            for j, blk in enumerate(stage.blocks):
                where = f"{name}.layers[{s}].blocks[{j}]"
                mlp = blk.mlp
                if not isinstance(mlp.norm, nn.Identity) \
                        or not isinstance(mlp.act, (nn.GELU, *_timm_gelus())):
                    raise TypeError(f"{where}.mlp must be timm's Mlp with a GELU activation")
                merge = None
                if nxt is not None and j == len(stage.blocks) - 1:
                    merge = _timm_merge(nxt.downsample, tuple(blk.input_resolution),
                                        f"{name}.layers[{s + 1}].downsample")
                parts.append(BlockParts(
                    **timm_attention_fields(blk, where), ls1=None,
                    fc1_weight=mlp.fc1.weight, fc1_bias=mlp.fc1.bias, act=mlp.act,
                    fc2_weight=mlp.fc2.weight, fc2_bias=mlp.fc2.bias, ls2=None,
                    attn_bias=blk.attn._get_rel_pos_bias,
                    window=Windows(grid=_pair(blk.input_resolution), size=_pair(blk.window_size),
                                   shift=_pair(blk.shift_size)),
                    merge=merge))
        self.blocks = parts
        weight, bias = timm_head(m.head.fc, f"{name}.head.fc")
        self.embedding = weight is None
        self.head = HeadParts(_norm_parts(m.norm, f"{name}.norm"), None,
                              (("avg", weight, bias),))

    def refresh(self) -> None:
        first = self.model.layers[0].blocks[0].attn.qkv.weight
        if self.blocks[0].q_weight.data_ptr() != first.data_ptr():  # storage replaced
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

    def check_inputs(self, inputs: Tensor) -> None:
        super().check_inputs(inputs)
        self.check_fixed_size(inputs, tuple(self.model.patch_embed.img_size),
                              type(self.model).__name__)

    def is_random(self) -> bool:
        from captum_vit.adapters.timm_vit import _has_active_dropout

        return _has_active_dropout(self.model)

    def layout(self, inputs: Tensor) -> Layout:
        self.refresh()
        h, w = inputs.shape[-2:]
        return Layout(num_prefix=0, grid=self.blocks[0].window.grid,  # type: ignore[union-attr]
                      patch_size=tuple(self.model.patch_embed.patch_size), readout=self.readout,
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


def _pair(v: int | tuple[int, ...] | list[int]) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _timm_merge(down: nn.Module, grid: tuple[int, int], where: str) -> MergeParts:
    """The :class:`MergeParts` of timm's ``PatchMerging`` on the ``grid`` before it."""
    from timm.models.swin_transformer import PatchMerging

    if type(down) is not PatchMerging:
        raise TypeError(f"{where} is {type(down).__name__}; captum_vit supports timm's "
                        "PatchMerging between Swin stages")
    return MergeParts(grid=grid, norm=_norm_parts(down.norm, f"{where}.norm"),
                      weight=down.reduction.weight, bias=down.reduction.bias)
