"""Token geometry: the layout of one batch and every patch <-> pixel <-> token map.

Design. A method sees tokens; a user sees pixels. This module is the ONE place that knows
how they correspond (the Captum front's output formatting, the removal metrics' pixel masks
and upsampled maps, and the plots all call :func:`grid_to_pixels`), so a family whose
tokens sit differently on the image changes the geometry here and nowhere else.

Notation (a pre-LayerNorm ViT in timm's layout): ``K`` prefix tokens (CLS, DIST,
registers) come first, then the ``P`` patch tokens in raster order, ``N = K + P``; the
``P`` patches form a ``(gh, gw)`` grid of ``(ph, pw)``-pixel patches, and the readout
reads the last state through :meth:`Layout.readout_weights`.

Extending it. A model made of *stages* (Swin, SAM's image encoder: each stage has its own
token grid, windowed attention inside it and a patch merge between stages) still returns
its maps on one grid: a :class:`Layout` is the geometry of the token rows a map is
*returned on* (the grid of the patches whose scores the methods output, and the pixel size
of one such patch), not of every block. A family with stages returns the layout of its
first stage's grid (maps are carried back through the merges onto it, as the matrix
methods' chains do), with no prefix rows; the windows, per-stage grids and merges are
part of its blocks (:mod:`captum_vit.adapters.base`). The front, the metrics and the plots
then need no change: they only ever go from that grid to pixels here. A score read from
the rows of any block (not only the readout) needs no geometry beyond this either: its
rows are token rows of the block's own grid, named by index.

Videos. A video model whose patch embedding cuts the video ``[B, T, C, H, W]`` into
*tubelets* of ``t`` frames and ``(ph, pw)`` pixels (VideoMAE, Tong et al., NeurIPS 2022)
has ``F = T / t`` frame slices of ``(gh, gw)`` patches, its tokens in the order
``(slice, row, column)``. Its :class:`Layout` sets ``frames = F`` and ``tubelet = t`` and
stacks the slices' grids along the height: ``grid = (F * gh, gw)``, so the tokens are
still the grid in raster order and every method that works on token rows or on the patch
grid (true token removal, masks on the grid) runs unchanged; :attr:`Layout.frame_grid`
is ``(gh, gw)``. Maps leave as ``[B, 1, F, gh, gw]`` grids (:func:`tokens_to_grid`) or
as pixels shaped like the video (:func:`grid_to_video`: each tubelet's score copied to
its ``t`` frames and ``ph × pw`` pixels).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

READOUTS = ("token", "avg", "distilled", "cls_mean", "map", "rows")


@dataclass(frozen=True)
class Layout:
    """Token layout of one input batch (the notation of the module docstring).

    Attributes:
        num_prefix (int): ``K``, the prefix tokens (CLS, DIST, registers) before the patches.
        grid (tuple[int, int]): ``(gh, gw)`` patch grid.
        patch_size (tuple[int, int]): ``(ph, pw)`` in pixels.
        readout (str): ``"token"`` (row 0), ``"distilled"`` (rows 0 and 1 averaged in the
            logit; maps read row 0), ``"avg"`` (mean of the patch rows) or ``"cls_mean"``
            (DINOv2's classifier on ``[row 0 ; mean of the patch rows]``; maps read
            ``w = α e_0 + (1 − α) u_P``, see ``alpha``) or ``"map"`` (an attention-pool
            head, :class:`PoolParts`: the weights come from the pool's attention of each
            image, :func:`captum_vit._base.readout_rows`) or ``"rows"`` (a target that
            reads token rows through code of its own, :mod:`captum_vit.targets`: uniform over
            ``rows`` for the gradient-free methods, the rows' input×gradient relevance
            for the others).
        num_blocks (int): ``L``.
        num_heads (int): ``H``.
        image_size (tuple[int, int]): ``(H, W)`` of the input images.
        alpha (float or str): the ``"cls_mean"`` readout's CLS share ``α`` (default ½), or
            ``"logit"``: per image and class from the logit's two parts
            (:func:`readout_alpha`).
    """

    num_prefix: int
    grid: tuple[int, int]
    patch_size: tuple[int, int]
    readout: str
    num_blocks: int
    num_heads: int
    image_size: tuple[int, int]
    alpha: float | str = 0.5
    rows: tuple[int, ...] | None = None
    """The ``"rows"`` readout's rows (``None``: the patch rows)."""
    frames: int | None = None
    """Videos: ``F``, the frame slices of tubelets (the grid is their ``F`` grids stacked
    along the height, see the module docstring); ``None`` for images."""
    tubelet: int = 1
    """Videos: ``t``, the frames of one tubelet (``T = F * t``)."""

    @classmethod
    def of_tokens(cls, num_tokens: int, num_prefix: int, readout: str, num_blocks: int,
                  num_heads: int) -> Layout:
        """The layout of token states without images: a square grid when the patch count
        is a square, else one row; each token is a one-pixel patch.

        Args:
            num_tokens (int): ``N``, prefix tokens included.
            num_prefix (int): ``K``.
            readout (str): one of :data:`READOUTS`.
            num_blocks (int): ``L``.
            num_heads (int): ``H``.

        Returns:
            Layout: with ``image_size`` equal to the grid.

        Examples::

            >>> Layout.of_tokens(17, 1, "token", 12, 3).grid
            (4, 4)
        """
        p = num_tokens - num_prefix
        side = math.isqrt(p)
        grid = (side, side) if side * side == p else (1, p)
        return cls(num_prefix, grid, (1, 1), readout, num_blocks, num_heads, grid)

    @property
    def frame_grid(self) -> tuple[int, int]:
        """``(gh, gw)``: the patch grid of one image, or of one frame slice of a video."""
        if self.frames is None:
            return self.grid
        return (self.grid[0] // self.frames, self.grid[1])

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def num_tokens(self) -> int:
        return self.num_prefix + self.num_patches

    def readout_weights(self, num_tokens: int | None = None, *, dtype=None, device=None) -> Tensor:
        """Weights ``w`` [N] with readout row ``r = sum_i w_i row_i`` (row 0 for a class
        token, the mean of the patch rows for average pooling).

        Raises:
            ValueError: for the ``"map"`` readout, whose weights depend on the image.
        """
        if self.readout == "map" or (self.readout == "cls_mean" and self.alpha == "logit"):
            raise ValueError("this readout's weights depend on the image (an attention-pool "
                             "head, or alpha='logit'): use captum_vit._base.readout_rows")
        n = self.num_tokens if num_tokens is None else num_tokens
        w = torch.zeros(n, dtype=dtype, device=device)
        if self.readout == "rows":
            rows = list(range(self.num_prefix, n)) if self.rows is None else list(self.rows)
            w[rows] = 1.0 / len(rows)
            return w
        if self.readout in ("avg", "cls_mean"):
            w[self.num_prefix:] = 1.0 / (n - self.num_prefix)
        if self.readout == "cls_mean":
            alpha = float(self.alpha)
            w *= 1.0 - alpha
            w[0] = alpha
        elif self.readout != "avg":
            w[0] = 1.0
        return w



GRID_MODES = ("nearest", "bilinear", "bicubic")


def grid_to_pixels(grid: Tensor, size: tuple[int, int], *,
                   patch_size: tuple[int, int] | None = None,
                   mode: str = "nearest") -> Tensor:
    """Patch-grid maps ``[..., gh, gw]`` as pixel maps ``[..., H, W]``: the one
    patch -> pixel map of the package.

    With ``patch_size`` the grid covers ``(gh * ph, gw * pw)`` pixels (the image padded to
    whole patches) and is cropped to ``size``: ``"nearest"`` copies each patch's value to
    its pixels (what the methods compute), ``"bilinear"`` / ``"bicubic"`` interpolate
    between patch centres (``align_corners=False``). Without ``patch_size`` the grid is
    stretched over ``size`` (display of a map whose patch size is unknown;
    ``"nearest"`` is ``nearest-exact``).

    Args:
        grid (Tensor): maps ``[..., gh, gw]`` (any dtype for ``"nearest"`` with
            ``patch_size``; floating point otherwise).
        size (tuple[int, int]): ``(H, W)`` of the images.
        patch_size (tuple[int, int], optional): ``(ph, pw)`` in pixels.
        mode (str, optional): ``"nearest"`` (default), ``"bilinear"`` or ``"bicubic"``.

    Returns:
        Tensor: ``[..., H, W]`` with the leading dimensions of ``grid``.

    Raises:
        ValueError: an unknown ``mode``.

    Examples::

        >>> from captum_vit.adapters import grid_to_pixels
        >>> grid_to_pixels(torch.rand(2, 1, 14, 14), (224, 224), patch_size=(16, 16)).shape
        torch.Size([2, 1, 224, 224])
    """
    if mode not in GRID_MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, GRID_MODES))}, "
                         f"got {mode!r}")
    h, w = int(size[0]), int(size[1])
    if patch_size is not None and mode == "nearest":
        ph, pw = patch_size
        return grid.repeat_interleave(ph, dim=-2).repeat_interleave(pw, dim=-1)[..., :h, :w]
    lead, (gh, gw) = grid.shape[:-2], grid.shape[-2:]
    g = grid.reshape(-1, 1, gh, gw)
    if patch_size is None:
        out = F.interpolate(g, size=(h, w), mode="nearest-exact") if mode == "nearest" \
            else F.interpolate(g, size=(h, w), mode=mode, align_corners=False)
    else:
        full = (gh * patch_size[0], gw * patch_size[1])
        out = F.interpolate(g, size=full, mode=mode, align_corners=False)[..., :h, :w]
    return out.reshape(*lead, *out.shape[-2:])


def tokens_to_grid(tokens: Tensor, layout: Layout) -> Tensor:
    """Patch scores ``[B, P]`` as the grid ``[B, 1, gh, gw]`` of ``layout``.

    Args:
        tokens (Tensor): one score per patch token, raster order.
        layout (Layout): the batch's layout.

    Returns:
        Tensor: ``[B, 1, gh, gw]``; for a video layout (``frames`` set) ``[B, 1, F, gh,
        gw]``, one grid per frame slice.

    Examples::

        >>> tokens_to_grid(torch.rand(2, 196), layout).shape   # a 14 x 14 grid
        torch.Size([2, 1, 14, 14])
    """
    if layout.frames is not None:
        return tokens.reshape(tokens.shape[0], 1, layout.frames, *layout.frame_grid)
    gh, gw = layout.grid
    return tokens.reshape(tokens.shape[0], 1, gh, gw)


def grid_to_video(grid: Tensor, size: tuple[int, int], *, patch_size: tuple[int, int],
                  tubelet: int) -> Tensor:
    """Tubelet-grid maps ``[..., F, gh, gw]`` as frame maps ``[..., F * t, H, W]``: each
    tubelet's value copied to its ``t`` frames and its ``ph × pw`` pixels (the video
    form of :func:`grid_to_pixels` with ``mode="nearest"``).

    Args:
        grid (Tensor): maps ``[..., F, gh, gw]``.
        size (tuple[int, int]): ``(H, W)`` of the frames.
        patch_size (tuple[int, int]): ``(ph, pw)`` in pixels.
        tubelet (int): ``t``, frames per tubelet.

    Returns:
        Tensor: ``[..., F * t, H, W]`` with the leading dimensions of ``grid``.

    Examples::

        >>> grid_to_video(torch.rand(2, 1, 8, 14, 14), (224, 224), patch_size=(16, 16),
        ...               tubelet=2).shape
        torch.Size([2, 1, 16, 224, 224])
    """
    pixels = grid_to_pixels(grid, size, patch_size=patch_size)
    return pixels.repeat_interleave(int(tubelet), dim=-3)


def merge_order(grid: tuple[int, int], merge: int, device: torch.device | None = None
                ) -> Tensor:
    """The raster index of each token in the tower's merge-group order ``[h·w]``: the
    ``merge × merge`` patches of one merged token consecutive (row-major inside the
    group), groups in raster order (the processor's ``patchify``).

    ``x_merge = x_raster[:, order]``; ``x_raster = x_merge[:, order.argsort()]``.

    Examples::

        >>> merge_order((2, 4), 2)
        tensor([0, 1, 4, 5, 2, 3, 6, 7])
    """
    h, w = grid
    ids = torch.arange(h * w, device=device).reshape(h // merge, merge, w // merge, merge)
    return ids.permute(0, 2, 1, 3).reshape(-1)
