"""Shared pieces of the soft-mask perturbation methods (RISE, ViT-CX):
linear interpolation matrices, pixel maps to patch scores, and where a mask is applied."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

from captum_vit._base import check_choice
from captum_vit.adapters import Layout, SubnetworkAdapter, ViTAdapter
from captum_vit.methods.scorecam import REMOVALS

EDGES = ("clamp", "mirror")


def interpolation_matrix(n_in: int, n_out: int, edge: str = "clamp", *,
                         dtype: torch.dtype = torch.float64,
                         device: torch.device | str | None = None) -> Tensor:
    r"""The 1-D linear interpolation from ``n_in`` to ``n_out`` samples as a matrix
    ``U`` [n_out, n_in] (``y = U x``), with pixel-centre alignment: output sample ``i``
    reads the input at :math:`(i + \tfrac12)\,n_{in}/n_{out} - \tfrac12`.

    A 2-D bilinear resize is ``U_h X U_w^T``. Outside ``[0, n_in - 1]`` the coordinate is
    clamped (``edge="clamp"``: exactly ``torch.nn.functional.interpolate(...,
    mode="bilinear", align_corners=False)``) or mirrored about the edge sample
    (``edge="mirror"``: scikit-image's ``resize(..., order=1, mode="reflect",
    anti_aliasing=False)``, which is ``scipy.ndimage.zoom(..., order=1, mode="mirror",
    grid_mode=True)``). Every row sums to 1, so constants are kept.

    Args:
        n_in (int): input samples (>= 1).
        n_out (int): output samples (>= 1).
        edge (str): ``"clamp"`` or ``"mirror"``.
        dtype (torch.dtype): dtype of the matrix.
        device (torch.device, optional): its device.

    Returns:
        Tensor [n_out, n_in].

    Examples::

        >>> U = interpolation_matrix(7, 256, "mirror")        # RISE's upsampling
        >>> mask = U @ grid.double() @ U.T                    # [256, 256]
    """
    check_choice("edge", edge, EDGES)
    x = (torch.arange(n_out, dtype=torch.float64) + 0.5) * (n_in / n_out) - 0.5
    if n_in == 1:
        x = torch.zeros_like(x)
    elif edge == "mirror":  # one reflection suffices: |x| and x - (n_in-1) stay below 1/2
        x = x.abs()
        x = torch.where(x > n_in - 1, 2 * (n_in - 1) - x, x)
    else:
        x = x.clamp(0, n_in - 1)
    lo = x.floor().long().clamp(0, max(n_in - 2, 0))
    frac = x - lo
    u = torch.zeros(n_out, n_in, dtype=torch.float64)
    rows = torch.arange(n_out)
    u.index_put_((rows, lo), 1 - frac, accumulate=True)
    if n_in > 1:
        u.index_put_((rows, lo + 1), frac, accumulate=True)
    return u.to(dtype=dtype, device=device)


def patch_sums(pixels: Tensor, layout: Layout) -> Tensor:
    """Per-patch sums [B, P] (raster order) of a pixel map [B, H, W], cropped or
    zero-padded to the patch grid as the patch embedding sees the image; for a video
    layout per-tubelet sums of frame maps [B, T, H, W]."""
    b = pixels.shape[0]
    if layout.frames is not None:
        f, t, (gh, gw), (ph, pw) = (layout.frames, layout.tubelet, layout.frame_grid,
                                    layout.patch_size)
        pixels = pixels[:, :f * t, :gh * ph, :gw * pw]
        return pixels.reshape(b, f, t, gh, ph, gw, pw).sum((2, 4, 6)).reshape(b, -1)
    (gh, gw), (ph, pw) = layout.grid, layout.patch_size
    h, w = gh * ph, gw * pw
    pixels = pixels[:, :h, :w]
    pixels = F.pad(pixels, (0, w - pixels.shape[-1], 0, h - pixels.shape[-2]))
    return pixels.reshape(b, gh, ph, gw, pw).sum((2, 4)).reshape(b, gh * gw)


def patch_means(pixels: Tensor, layout: Layout) -> Tensor:
    """The mean of a pixel map [B, H, W] over every patch -> patch scores [B, P] (raster
    order); a patch partly outside the image averages its pixels inside."""
    return patch_sums(pixels, layout) / patch_sums(pixels.new_ones(1, *pixels.shape[1:]),
                                                   layout)


def resolve_removal(adapter: ViTAdapter, removal: Any) -> str:
    """``removal`` checked, with ``None`` resolved: ``"pixels"`` for a model of images,
    ``"tokens"`` for a video model (masks over tubelets) and for a sub-network ``f_l``
    (PLUS / SkipPLUS, :mod:`captum_vit.combinators`: its input is the token states
    ``x_l``, so its masks are applied to them by true removal)."""
    view = isinstance(adapter, SubnetworkAdapter)
    if removal is None:
        if adapter.video and not view and adapter.stages.has_windows:
            raise ValueError(
                f"{type(adapter.model).__name__} takes videos, whose masks are over tokens "
                "(true token removal), and attends within windows of a fixed token grid "
                "(divided space-time attention), which need every token: RISE and ViT-CX "
                "do not apply to it; use a gradient, decomposition or LRP method (e.g. "
                "'decompx', 'attnlrp', 'gae')")
        return "tokens" if view or adapter.video else "pixels"
    check_choice("removal", removal, REMOVALS)
    if removal == "pixels" and adapter.video:
        raise ValueError("removal='pixels' masks images [B, C, H, W]; this model takes "
                         "videos, whose masks are over tubelets: use removal='tokens' (true "
                         "token removal on the tubelet grid) or leave removal=None")
    if removal == "pixels" and view:
        raise ValueError("removal='pixels' masks images, but this method runs on a "
                         "sub-network f_l (PLUS/SkipPLUS) whose input is the token states "
                         "x_l; use removal='tokens' or leave removal=None")
    return removal


class GridMasks:
    r"""Soft masks defined on a coarse grid, materialised on demand, a few at a time.

    Mask ``i`` is :math:`U_h[r_i]\, G_i\, U_w[c_i]^\top`: the grid ``G_i`` [gh, gw]
    upsampled by the interpolation matrices ``U_h``, ``U_w`` (:func:`interpolation_matrix`)
    and cropped to ``size`` at the offset ``(r_i, c_i)``; with ``minmax`` it is then
    min-max normalised over its pixels, :math:`(M - \ell_i) / (h_i - \ell_i)` (a constant
    mask becomes 0). Without interpolation matrices the grid is the mask (token masks on
    the patch grid). RISE (random binary grids, random offsets) and ViT-CX (cluster sums of
    feature maps, min-max normalised) are both of this form, so N masks at image size
    never have to be held at once.

    Args:
        grids (Tensor): [N, gh, gw] (any real dtype).
        size (tuple of int): ``(H, W)`` of a mask.
        up (tuple of Tensor, optional): ``(U_h [Hu, gh], U_w [Wu, gw])``, ``Hu >= H``,
            ``Wu >= W``; ``None``: ``size`` must be ``(gh, gw)`` and the grid is the mask.
        offsets (Tensor, optional): [N, 2] int64 crop offsets (default 0).
        minmax (bool): min-max normalise every mask over its pixels.
    """

    def __init__(self, grids: Tensor, size: tuple[int, int],
                 up: tuple[Tensor, Tensor] | None = None, offsets: Tensor | None = None,
                 *, minmax: bool = False) -> None:
        if up is None and tuple(grids.shape[1:]) != tuple(size):
            raise ValueError(f"grids of shape {tuple(grids.shape[1:])} need interpolation "
                             f"matrices to give masks of size {tuple(size)}")
        self.grids = grids
        self.size = (int(size[0]), int(size[1]))
        self.up = up
        self.offsets = offsets
        self.range: tuple[Tensor, Tensor] | None = None
        if minmax:  # the pixel range of every mask, a chunk at a time
            lo, hi = [], []
            for idx in self.chunks(64):
                m = self._upsampled(idx, grids.dtype, grids.device).flatten(1)
                lo.append(m.amin(1))
                hi.append(m.amax(1))
            self.range = (torch.cat(lo), torch.cat(hi))

    def __len__(self) -> int:
        return self.grids.shape[0]

    def chunks(self, size: int) -> tuple[Tensor, ...]:
        """Mask indices (CPU, int64) in consecutive chunks of at most ``size``."""
        return torch.arange(len(self)).split(max(1, size))

    def _upsampled(self, idx: Tensor, dtype: torch.dtype,
                   device: torch.device | str | None) -> Tensor:
        g = self.grids[idx.to(self.grids.device)].to(dtype=dtype, device=device)
        if self.up is None:
            return g
        uh, uw = (u.to(dtype=dtype, device=device) for u in self.up)
        h, w = self.size
        if self.offsets is None:
            return uh[:h] @ g @ uw[:w].T
        off = self.offsets[idx.to(self.offsets.device)].to(device)
        rows = uh[off[:, :1] + torch.arange(h, device=device)]  # [n, H, gh]
        cols = uw[off[:, 1:] + torch.arange(w, device=device)]  # [n, W, gw]
        return rows @ g @ cols.transpose(1, 2)

    def materialize(self, idx: Tensor, dtype: torch.dtype,
                    device: torch.device | str | None = None) -> Tensor:
        """Masks ``idx`` [n] -> [n, H, W] in ``dtype`` on ``device``."""
        m = self._upsampled(idx, dtype, device)
        if self.range is None:
            return m
        lo, hi = (r[idx.to(r.device)].to(dtype=dtype, device=device)[:, None, None]
                  for r in self.range)
        span = hi - lo
        m = (m - lo) / torch.where(span > 0, span, torch.ones_like(span))
        return torch.where(span > 0, m.clamp(0, 1), torch.zeros_like(m))
