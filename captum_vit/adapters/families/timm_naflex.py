"""Adapter for timm's ``NaFlexVit`` (``timm.models.naflexvit``: NaViT + FlexiViT, the
``naflexvit_*`` models, SigLIP-style ``naflexvit_*_siglip``).

Verified in the installed timm (``naflexvit.py``):

- ``NaFlexVit.forward`` takes images ``[B, C, H, W]`` (the standard mode:
  ``NaFlexEmbeds`` patchifies them with ``batch_patchify`` for its ``Linear`` projection,
  ``(row, column, channel)`` per patch with ``patchify_channels_last=True``, or runs its
  ``Conv2d``; the learned or factorized position table is resized to the image's grid by
  ``F.interpolate``) or a NaFlex batch: a dict ``{"patches" [B, N, P·P·C], "patch_coord"
  [B, N, 2] (y, x), "patch_valid" [B, N]}`` (timm's ``NaFlexCollator``), where the same
  tables are resized per image to the grid its coordinates span, added to the first
  ``h·w`` rows, and ``create_attention_mask`` masks the padded keys (the dtype's minimum:
  exactly zero probability); ``global_pool_naflex`` and the attention pool read the valid
  rows only.
- The blocks are timm's pre-LN ``Block`` (``EvaBlock`` when RoPE, SwiGLU or other Eva
  features are configured: refused here by name), then ``norm``, the pool (``token``,
  ``avg`` or ``map``: ``AttentionPoolLatent``), ``fc_norm`` and ``head``: the readers of
  :class:`~captum_vit.adapters.families._timm.TimmViTBase`.

The adapter's plain input is images (the standard mode, the model's own ``embeds``,
``norm_pre``); a NaFlex dict goes through :meth:`TimmNaFlexAdapter.processor_images` (each
image's valid patches back into the image, maps per image on its own grid,
:func:`captum_vit._base.attribute_processed`), for a ``Linear`` patch embedding whose
position table is resized by ``F.interpolate`` (with ``pos_embed_use_grid_sample=True``
the NaFlex mode samples positions another way than the image mode: such a dict is
refused by name).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from captum_vit.adapters._typing import ModelTree
from captum_vit.adapters.base import ViTAdapter
from captum_vit.adapters.catalog import Example, register_family
from captum_vit.adapters.families._examples import seeded_model
from captum_vit.adapters.families._hf import pair
from captum_vit.adapters.families._naflex import batch_value, pad_patches, split_padded
from captum_vit.adapters.families._timm import TimmViTBase, has_active_dropout, timm_classes
from captum_vit.adapters.families._torch import is_loaded_instance
from captum_vit.adapters.layout import Layout
from captum_vit.adapters.ops import Ops, patch_projection
from captum_vit.adapters.parts import layer_norm_parts as _norm_parts

_NAFLEX = ("timm.models.naflexvit", "NaFlexVit")


def is_timm_naflex(model: nn.Module) -> bool:
    """``True`` for timm's ``NaFlexVit``."""
    return is_loaded_instance(model, *_NAFLEX)


def naflex_builder(**extra: Any) -> Any:
    """A builder of a tiny random ``NaFlexVit`` (patch 8, width 32, 4 heads, MLP ratio 2,
    a 4x4 position table, SigLIP-style attention pool unless ``extra`` says otherwise)."""

    def build(*, seed: int = 0, depth: int = 3, dtype: torch.dtype = torch.float64,
              num_classes: int = 5, **overrides: Any) -> nn.Module:
        kwargs: dict[str, Any] = dict(
            patch_size=8, embed_dim=32, depth=depth, num_heads=4, mlp_ratio=2.0,
            num_classes=num_classes, pos_embed_grid_size=(4, 4), global_pool="map",
            act_layer="gelu_tanh", pos_embed_interp_mode="bilinear")
        return seeded_model(*_NAFLEX, seed, **{**kwargs, **extra, **overrides}) \
            .to(dtype).eval()

    return build


@register_family(
    is_timm_naflex,
    supports="timm NaFlexVit (naflexvit_*: images, or a NaFlex dict of patches, "
             "patch_coord, patch_valid; not the RoPE / Eva-block variants)",
    tags=("classifier", "embedding", "variable-size"),
    notes=("`NaFlexVit` with timm's `Block` (learned or factorized positions, class / register "
           "tokens, `token` / `avg` / `map` pooling, `num_classes=0` for vector targets): ✅ on "
           "images of any multiple of the patch size and on a NaFlex dict (`patches`, "
           "`patch_coord`, `patch_valid`): maps per image on its own grid, padding never "
           "explained (forward equals the model's padded NaFlex forward to 1e-12). RoPE "
           "(`rope_type`) and Eva-block variants: refused with a `TypeError` naming them"),
    examples={
        "timm_naflex": Example(naflex_builder(), (24, 40)),
        "timm_naflex_avg": Example(naflex_builder(global_pool="avg", reg_tokens=1,
                                                  fc_norm=True, pos_embed="factorized"),
                                   (32, 16), suite=False),
    })
class TimmNaFlexAdapter(TimmViTBase):
    """Canonical view of a timm ``NaFlexVit`` (never modified).

    Its plain input is images ``[B, C, H, W]``; a NaFlex dict is read by
    :meth:`processor_images` (the module docstring).
    """

    processor_keys = ("patch_coord", "patch_valid")

    def __init__(self, model: ModelTree) -> None:
        ViTAdapter.__init__(self)  # TimmViTBase's reads patch_embed
        self.model = model
        name = type(model).__name__
        if getattr(model, "rope", None) is not None:
            raise TypeError(f"{name} uses rotary position embeddings (rope_type) in Eva "
                            "blocks; captum_vit supports NaFlexVit with timm's Block and "
                            "learned or factorized positions (rope_type='')")
        self._read_vit(model)
        self.in_chans = int(model.embeds.in_chans)

    # -- geometry -------------------------------------------------------------------------
    @property
    def patch_size(self) -> tuple[int, int]:
        """``(ph, pw)`` of the patch embedding."""
        return pair(self.model.embeds.patch_size)

    @property
    def input_shape(self) -> tuple[int, tuple[int, int]]:
        """The position table's grid in pixels (the model takes any grid)."""
        e = self.model.embeds
        grid = e.pos_embed_grid_size or (16, 16)
        ph, pw = self.patch_size
        return self.in_chans, (int(grid[0]) * ph, int(grid[1]) * pw)

    def _grid(self, h: int, w: int) -> tuple[int, int]:
        ph, pw = self.patch_size
        if self.model.embeds.dynamic_img_pad:
            return -(-h // ph), -(-w // pw)
        return h // ph, w // pw

    def check_inputs(self, inputs: Tensor) -> None:
        """Images ``[B, C, H, W]`` of a multiple of the patch size (unless the model pads,
        ``dynamic_img_pad``)."""
        if inputs.dim() != 4:
            raise ValueError(f"inputs of shape {tuple(inputs.shape)} are not images "
                             "[B, C, H, W]; pass images, or the NaFlex dict (patches, "
                             "patch_coord, patch_valid) itself")
        ViTAdapter.check_inputs(self, inputs)  # TimmViTBase's reads patch_embed
        if not self.model.embeds.dynamic_img_pad:
            self.check_patch_multiple(inputs, self.patch_size)

    def is_random(self) -> bool:
        m = self.model
        return has_active_dropout(m) or (m.training and m.patch_drop is not None)

    def layout(self, inputs: Tensor) -> Layout:
        self.refresh()
        h, w = (int(s) for s in inputs.shape[-2:])
        return Layout(num_prefix=self.num_prefix, grid=self._grid(h, w),
                      patch_size=self.patch_size, readout=self.readout,
                      num_blocks=self.num_blocks, num_heads=self.blocks[0].num_heads,
                      image_size=(h, w))

    # -- embedding ------------------------------------------------------------------------
    def embed(self, inputs: Tensor, ops: Ops | None = None) -> Tensor:
        """The model's own ``embeds(images)`` (patches, positions resized to the grid,
        class / register tokens) and ``norm_pre``. With ``ops`` (:meth:`ViTAdapter.embed`)
        the embedding of the detached images is the value and the patch rows' projection
        ``t`` (``norm_input``, the ``Linear`` or ``Conv2d`` projection, ``norm``, through
        ``ops``) is added as ``t - t.detach()`` (exactly 0; the positions do not depend
        on the pixels); ``norm_pre`` runs through ``ops.norm``."""
        self.refresh()
        m, e = self.model, self.model.embeds
        if ops is None:
            return self._norm_pre(e(inputs)[0], None)
        name = type(m).__name__
        x = e(inputs.detach())[0]
        if e.is_linear:
            (batch_patchify,) = timm_classes("timm.models.naflexvit", "batch_patchify")
            t, _ = batch_patchify(inputs, e.patch_size, pad=e.dynamic_img_pad,
                                  channels_last=e.channels_last)
            if e.norm_input is not None:
                t = ops.norm(t, _norm_parts(e.norm_input, f"{name}.embeds.norm_input"))
            t = ops.linear(t, e.proj.weight, e.proj.bias)
        else:
            img = inputs
            if e.dynamic_img_pad:
                ph, pw = self.patch_size
                img = F.pad(img, (0, (pw - img.shape[-1] % pw) % pw,
                                  0, (ph - img.shape[-2] % ph) % ph))
            t = patch_projection(img, e.proj, ops, f"{name}.embeds.proj").flatten(1, 2)
        if not isinstance(e.norm, nn.Identity):
            t = ops.norm(t, _norm_parts(e.norm, f"{name}.embeds.norm"))
        x = x + F.pad(t - t.detach(), (0, 0, self.num_prefix, 0))
        return self._norm_pre(x, ops)

    def embedding_norms(self) -> tuple[str, ...]:
        """The non-identity ``embeds.norm_input``, ``embeds.norm`` and ``norm_pre``."""
        m, e = self.model, self.model.embeds
        found = (("embeds.norm_input", e.norm_input), ("embeds.norm", e.norm),
                 ("norm_pre", m.norm_pre))
        return tuple(n for n, mod in found
                     if mod is not None and not isinstance(mod, nn.Identity))

    # -- a NaFlex dict --------------------------------------------------------------------
    def processor_images(self, batch: Mapping[str, Any]) -> list[tuple[Tensor, Tensor]]:
        """Each image of a NaFlex dict as the image of its valid patches, grouped by grid.

        Args:
            batch (Mapping): ``patches [B, N, P·P·C]``, ``patch_coord [B, N, 2]`` (y, x),
                ``patch_valid [B, N]`` (timm's ``NaFlexCollator``).

        Returns:
            list of ``(index, images)`` (:meth:`ViTAdapter.processor_images`).

        Raises:
            TypeError: the model cannot take patches as the image mode reads images (a
                ``Conv2d`` embedding, ``pos_embed_use_grid_sample``), or the dict has its
                own ``attn_mask``.
            ValueError: a key missing, a shape that does not fit the patch size, or valid
                patches whose coordinates are not their grid's raster order from the first
                row (``patch_coord`` and ``patch_valid`` disagree).
        """
        name, e = type(self.model).__name__, self.model.embeds
        if not e.is_linear:
            raise TypeError(f"{name} embeds patches with a Conv2d (embed_proj_type='conv') "
                            "and takes images only; pass images [B, C, H, W]")
        if e.pos_embed_use_grid_sample and e.pos_embed_type != "none":
            raise TypeError(f"{name} samples NaFlex positions with grid_sample "
                            "(pos_embed_use_grid_sample=True), another resize than its "
                            "image mode's; pass the images [B, C, H, W] themselves")
        if batch.get("attn_mask") is not None:
            raise TypeError("the NaFlex dict has its own attn_mask; captum_vit explains "
                            "the mask patch_valid makes: drop attn_mask")
        patches = batch_value(batch, "patches", name)
        valid = batch_value(batch, "patch_valid", name)
        coord = batch_value(batch, "patch_coord", name)
        dim = self.patch_size[0] * self.patch_size[1] * self.in_chans
        if patches.dim() != 3 or patches.shape[-1] != dim:
            raise ValueError(f"patches has shape {tuple(patches.shape)}; expected [B, N, "
                             f"{dim}] (flattened patches of the model's patch size)")
        if tuple(valid.shape) != tuple(patches.shape[:2]):
            raise ValueError(f"patch_valid has shape {tuple(valid.shape)}; expected "
                             f"{list(patches.shape[:2])}, one flag per patch row")
        if tuple(coord.shape) != (*patches.shape[:2], 2):
            raise ValueError(f"patch_coord has shape {tuple(coord.shape)}; expected "
                             f"[{patches.shape[0]}, {patches.shape[1]}, 2] (y, x) for "
                             "patches")
        grids = []
        for i in range(coord.shape[0]):
            k = int((valid[i] != 0).sum())
            rows = coord[i, :max(k, 1)]
            h, w = int(rows[:, 0].max()) + 1, int(rows[:, 1].max()) + 1
            ys, xs = torch.div(torch.arange(h * w), w, rounding_mode="floor"), \
                torch.arange(h * w) % w
            if k != h * w or not torch.equal(rows.cpu(), torch.stack([ys, xs], 1)):
                raise ValueError(f"patch_coord[{i}] of the {k} patches patch_valid[{i}] "
                                 "marks valid are not the raster order of one grid from "
                                 "the first row: patch_coord and patch_valid disagree; "
                                 "pass the NaFlex collator's output unchanged")
            grids.append((h, w))
        return split_padded(patches, valid, grids, self.patch_size, self.in_chans,
                            names=("patches", "patch_valid", "patch_coord"),
                            channels_last=e.channels_last)

    def processor_pixels(self, maps: Sequence[Tensor], batch: Mapping[str, Any]) -> Tensor:
        """Per-image pixel maps laid out as ``batch["patches"]`` (zero on padding)."""
        patches = batch_value(batch, "patches", type(self.model).__name__)
        return pad_patches(maps, patches, self.patch_size,
                           self.model.embeds.channels_last)

