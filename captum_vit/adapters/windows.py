"""Windowed attention and patch merges: the geometry of models made of stages.

Design. A hierarchical model (Swin, Liu et al., ICCV 2021) is a list of *stages*; inside a
stage every block attends within ``M_h × M_w`` windows of the stage's token grid (after a
cyclic shift of the grid in every other block), and a *merge* joins each 2×2 group of
tokens into one token of the next stage. Both are geometry plus the model's own
parameters, so they live here once, beside the one attention
(:meth:`captum_vit.adapters.parts.BlockParts.attention`), and a family only declares them:

- :class:`Windows`: how a block partitions its grid (window size, cyclic shift, padding
  of the grid to whole windows, the order of shift and padding, and the logit added
  between tokens that the shift brought together across a seam of the image). The
  attention runs on the ``B · n_W`` windows as on short sequences, with the block's
  relative position bias (one ``[H, M, M]`` table per window) and the seam mask; its
  probabilities are returned per window, ``[B, H, n_W, M, M]``: the token-to-token matrix
  of the block is block-diagonal in window order and is never built densely.
  :meth:`Windows.index` says which grid token sits at each window slot, so a method can
  carry a vector through the block's mixing (``rᵀ A``) window by window.
- :class:`MergeParts`: a patch merge ``y = LN(concat(x_{c_1}, …, x_{c_4})) W`` (Swin V2:
  ``y = LN(concat(…) W)``) with the children's order of the model and the zero rows of a
  grid of odd size (:meth:`MergeParts.children`).

Padded window slots are zero vectors after the block's first LayerNorm, as in the models:
they are keys of their window (their key and value are the projections' biases) and
their own rows are dropped when the windows are put back. SAM's image encoder (windowed
blocks with padding and no shift, global blocks without windows) is the same
:class:`Windows` with ``shift = (0, 0)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from captum_vit.adapters.parts import NormParts, pool_tokens

__all__ = ["MERGE_ORDER", "MergeParts", "QueryPool", "SlotWindows", "Windows", "pool_tokens"]

MERGE_ORDER = ((0, 0), (1, 0), (0, 1), (1, 1))
"""The children ``(row offset, column offset)`` of a 2×2 merge in the order their states
are concatenated, as timm's and Hugging Face's ``PatchMerging`` concatenate them
(``x[0::2, 0::2]``, ``x[1::2, 0::2]``, ``x[0::2, 1::2]``, ``x[1::2, 1::2]``)."""


@dataclass(frozen=True)
class Windows:
    """The window partition of one block's token grid.

    Attributes:
        grid (tuple[int, int]): ``(h, w)``, the stage's token grid (tokens in raster
            order).
        size (tuple[int, int]): ``(M_h, M_w)``, the window.
        shift (tuple[int, int]): the cyclic shift ``(s_h, s_w)``: the grid is rolled by
            ``(-s_h, -s_w)`` before partitioning and back after (``(0, 0)``: regular
            windows).
        seam (float): the logit added between two tokens of one window that come from
            different regions of the rolled grid (timm and Hugging Face Swin: ``-100``).
        pad_first (bool): the grid is padded to whole windows before the shift
            (Hugging Face Swin) rather than after it (timm Swin).

    Examples::

        >>> win = Windows(grid=(5, 5), size=(2, 2), shift=(1, 1))
        >>> win.num_windows, win.area
        (9, 4)
        >>> win.partition(torch.zeros(2, 25, 8)).shape
        torch.Size([18, 4, 8])
    """

    grid: tuple[int, int]
    size: tuple[int, int]
    shift: tuple[int, int] = (0, 0)
    seam: float = -100.0
    pad_first: bool = False

    def __post_init__(self) -> None:
        if min(self.size) < 1 or min(self.grid) < 1:
            raise ValueError(f"windows need a positive grid and size, got grid={self.grid}, "
                             f"size={self.size}")

    @property
    def padded(self) -> tuple[int, int]:
        """``(H_p, W_p)``: the grid padded to whole windows."""
        return (math.ceil(self.grid[0] / self.size[0]) * self.size[0],
                math.ceil(self.grid[1] / self.size[1]) * self.size[1])

    @property
    def num_windows(self) -> int:
        """``n_W``, the windows of one image."""
        hp, wp = self.padded
        return (hp // self.size[0]) * (wp // self.size[1])

    @property
    def area(self) -> int:
        """``M = M_h M_w``, the tokens of one window."""
        return self.size[0] * self.size[1]

    @property
    def num_tokens(self) -> int:
        """``N = h w``, the tokens of the grid."""
        return self.grid[0] * self.grid[1]

    def _windows(self, x: Tensor, fill: float = 0.0) -> Tensor:
        """``x`` [B, h, w, C] rolled and padded (with ``fill``) as the model does, cut
        into windows [B * n_W, M, C]."""
        h, w = self.grid
        hp, wp = self.padded
        pad = (0, 0, 0, wp - w, 0, hp - h)
        padded = hp > h or wp > w  # else no copy (F.pad copies even when it adds nothing)
        if self.pad_first and padded:
            x = F.pad(x, pad, value=fill)
        if any(self.shift):
            x = torch.roll(x, shifts=(-self.shift[0], -self.shift[1]), dims=(1, 2))
        if not self.pad_first and padded:
            x = F.pad(x, pad, value=fill)
        b, c = x.shape[0], x.shape[-1]
        mh, mw = self.size
        x = x.reshape(b, hp // mh, mh, wp // mw, mw, c).permute(0, 1, 3, 2, 4, 5)
        return x.reshape(b * self.num_windows, self.area, c)

    def partition(self, x: Tensor) -> Tensor:
        """Token states [B, N, C] (grid raster order) as windows [B * n_W, M, C]
        (image-major, windows in raster order; padded slots are zero).

        Raises:
            ValueError: ``x`` does not have the grid's ``N`` tokens.
        """
        b, n, c = x.shape
        if n != self.num_tokens:
            raise ValueError(f"windowed attention over a {self.grid[0]}x{self.grid[1]} grid "
                             f"needs {self.num_tokens} tokens, got {n}: windowed models keep "
                             "every token (true token removal does not apply; remove "
                             "pixels instead)")
        return self._windows(x.reshape(b, *self.grid, c))

    def reverse(self, y: Tensor) -> Tensor:
        """Windows [B * n_W, M, C] back to token states [B, N, C]: the inverse of
        :meth:`partition` (padded slots dropped, shift undone)."""
        h, w = self.grid
        hp, wp = self.padded
        mh, mw = self.size
        c = y.shape[-1]
        x = y.reshape(-1, hp // mh, wp // mw, mh, mw, c).permute(0, 1, 3, 2, 4, 5)
        x = x.reshape(-1, hp, wp, c)
        if self.pad_first:
            if any(self.shift):
                x = torch.roll(x, shifts=self.shift, dims=(1, 2))
            x = x[:, :h, :w]
        else:
            x = x[:, :h, :w]
            if any(self.shift):
                x = torch.roll(x, shifts=self.shift, dims=(1, 2))
        return x.reshape(x.shape[0], h * w, c)

    def index(self, device: torch.device | None = None) -> Tensor:
        """Which grid token sits at each window slot: [n_W, M] raster indices into the
        ``N`` tokens, ``-1`` at padded slots.

        Examples::

            >>> Windows(grid=(3, 3), size=(2, 2)).index()[0]
            tensor([0, 1, 3, 4])
        """
        ids = torch.arange(self.num_tokens, device=device).reshape(1, *self.grid, 1)
        return self._windows(ids, fill=-1)[..., 0]

    def left_multiply(self, v: Tensor, matrix: Tensor, rows: Windows | None = None) -> Tensor:
        """``vᵀ C`` for a token-mixing matrix ``C`` of this block in window form,
        ``[..., n_W, M, M]`` (the probabilities ``[B, H, n_W, M, M]``, their head mean
        ``[B, n_W, M, M]``, or anything built from them slot by slot), and row vectors
        ``v`` ``[..., N]`` on the grid: ``[..., N]``, the leading dimensions broadcast.
        The block-diagonal ``N × N`` matrix is never built; padded slots (no tokens)
        carry no weight as rows and their columns are dropped.

        Examples::

            >>> win = Windows(grid=(2, 2), size=(2, 2))
            >>> probs = torch.full((1, 1, 4, 4), 0.25)
            >>> win.left_multiply(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), probs)
            tensor([[0.2500, 0.2500, 0.2500, 0.2500]])

        ``rows``: the windows of the matrix's rows when they are not these (pooled queries,
        :meth:`QueryPool.query_window`): ``v`` is then on their grid, ``[..., N_rows]``.
        """
        idx = self.index(v.device)  # [n_W, M]
        real = idx >= 0
        if rows is not None and v.shape[-1] != rows.num_tokens:
            raise ValueError(f"row vectors of {v.shape[-1]} tokens for a mixing whose rows "
                             f"are the {rows.num_tokens} tokens of the pooled grid")
        ridx = idx if rows is None else rows.index(v.device)
        rreal = ridx >= 0
        slots = v.new_zeros(*v.shape[:-1], *ridx.shape)
        slots[..., rreal] = v[..., ridx[rreal]]
        out_w = torch.einsum("...wi,...wij->...wj", slots, matrix.to(v.dtype))
        out = out_w.new_zeros(*out_w.shape[:-2], self.num_tokens)
        out[..., idx[real]] = out_w[..., real]
        return out

    def to_slots(self, v: Tensor) -> Tensor:
        """Per-token values ``[..., N]`` at the window slots, ``[..., n_W, M]`` (0 at
        padded slots): a column scaling ``C diag(v)`` of a window-form matrix is
        ``C * to_slots(v)[..., None, :]``."""
        idx = self.index(v.device)
        real = idx >= 0
        slots = v.new_zeros(*v.shape[:-1], *idx.shape)
        slots[..., real] = v[..., idx[real]]
        return slots

    def dense(self, matrix: Tensor) -> Tensor:
        """A window-form matrix ``[..., n_W, M, M]`` as the dense ``[..., N, N]`` (padded
        slots dropped): only for small grids (a Swin's last stage), never a first stage."""
        idx = self.index(matrix.device)
        real = idx >= 0
        both = real[:, :, None] & real[:, None, :]
        rows = idx[:, :, None].expand_as(both)[both]
        cols = idx[:, None, :].expand_as(both)[both]
        out = matrix.new_zeros(*matrix.shape[:-3], self.num_tokens, self.num_tokens)
        out[..., rows, cols] = matrix[..., both]
        return out

    def received(self, probs: Tensor) -> Tensor:
        """The attention each token receives, averaged over the ``N`` real queries of
        the grid: ``mean_i A[i, j]`` [B, H, N] for windowed probabilities [B, H, n_W, M,
        M] (the global attention's ``A.mean(-2)``)."""
        ones = probs.new_ones(probs.shape[0], 1, self.num_tokens)
        return self.left_multiply(ones, probs) / self.num_tokens

    def seam_mask(self, dtype: torch.dtype, device: torch.device | None = None
                  ) -> Tensor | None:
        """The logit ``[n_W, M, M]`` added inside shifted windows: :attr:`seam` between
        slots of different regions of the rolled, padded grid, 0 elsewhere; ``None``
        without a shift (the models' own construction: nine regions cut at ``-M`` and
        ``-s`` from the end of each padded axis)."""
        if not any(self.shift):
            return None
        hp, wp = self.padded
        label = torch.zeros(1, hp, wp, 1, dtype=dtype, device=device)
        cuts = [((0, -m), (-m, -s), (-s, None)) for m, s in zip(self.size, self.shift,
                                                                strict=True)]
        count = 0
        for h0, h1 in cuts[0]:
            for w0, w1 in cuts[1]:
                label[:, h0:h1, w0:w1] = count
                count += 1
        mh, mw = self.size
        lab = label.reshape(1, hp // mh, mh, wp // mw, mw, 1).permute(0, 1, 3, 2, 4, 5)
        lab = lab.reshape(self.num_windows, self.area)
        diff = lab[:, None, :] - lab[:, :, None]
        return torch.zeros_like(diff).masked_fill(diff != 0, float(self.seam))

    def logit_bias(self, position_bias: Tensor | None, batch: int, dtype: torch.dtype,
                   device: torch.device | None = None) -> Tensor | None:
        """What the attention logits of the ``batch · n_W`` windows get: the block's
        position bias ``[1, H, M, M]`` (one table for every window) plus the seam mask,
        [B * n_W, H or 1, M, M]; ``None`` when there is neither."""
        seam = self.seam_mask(dtype, device)
        if seam is None:
            return None if position_bias is None else position_bias.to(dtype)
        bias = seam[:, None]  # [n_W, 1, M, M]
        if position_bias is not None:
            bias = position_bias.to(dtype) + bias
        return bias.repeat(batch, 1, 1, 1)


class SlotWindows:
    """Attention within windows given as index sets of token slots, where a token may sit
    in several windows (its outputs averaged back) and padded slots are no keys, with the
    interface of :class:`Windows` that the engine and the methods read: TimeSformer's
    divided space-time mixings (:mod:`captum_vit.adapters.families.hf_timesformer`),
    Qwen2.5-VL's windows of merge groups (:mod:`captum_vit.adapters.families.hf_qwen_vl`).

    The dense token-mixing matrix of window-form probabilities ``A`` [..., n_W, M, M] is
    :math:`C_{ij} = \\frac{1}{c_i} \\sum_{s \\in S(i)} \\sum_{r \\in S(j),\\, w(r) = w(s)}
    A_{w(s)}[s, r]`, with ``S(i)`` the slots of token ``i``, ``c_i = |S(i)|`` and ``w(s)``
    the window of slot ``s``; it is never built (:meth:`dense` only for tests and tiny
    grids).

    Args:
        index (Tensor): [n_W, M] token index of each slot, ``-1`` for padding.
        num_tokens (int): ``N``, the tokens of the sequence.
    """

    shift = (0, 0)

    def __init__(self, index: Tensor, num_tokens: int) -> None:
        self._index = index.long()
        self.num_windows, self.area = (int(s) for s in index.shape)
        self.num_tokens = num_tokens
        real = self._index >= 0
        counts = torch.zeros(num_tokens + 1, dtype=torch.float64)
        counts.index_add_(0, self._slot(self._index).flatten(),
                          real.flatten().to(torch.float64))
        if (counts[:num_tokens] == 0).any():
            raise ValueError("every token needs a window slot")
        self._weight = torch.where(real, 1.0 / counts[self._slot(self._index)],
                                   torch.zeros((), dtype=torch.float64))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(num_windows={self.num_windows}, area={self.area}, "
                f"num_tokens={self.num_tokens})")

    @property
    def shares_tokens(self) -> bool:
        """Whether some token sits in several windows (the spatial mixing's class token):
        methods that read the slots one token each refuse such a block by name."""
        return bool((self._weight[self._index >= 0] < 1).any())

    def slot_counts(self, dtype: torch.dtype, device: torch.device | None = None
                    ) -> Tensor | None:
        r"""[n_W, M]: ``c_i`` of the token at each slot (1 at padding), or ``None`` when
        every token has one slot. The attention returns its window probabilities with the
        gradient of the dense matrix, :math:`\partial s / \partial C_{ij} = c_i\,
        \partial s / \partial A_w[s, r]` (identity forward), so that a product of the
        probabilities and their gradient chained by :meth:`left_multiply` is the dense
        ``(∂s/∂C) ⊙ C``; the true gradient still reaches the queries and keys."""
        if not self.shares_tokens:
            return None
        w = self._weight.to(device, dtype)
        return torch.where(w > 0, 1 / w.clamp_min(1e-30), torch.ones_like(w))

    def _slot(self, idx: Tensor) -> Tensor:
        """Slot indices with padding sent to the extra zero row ``N``."""
        return torch.where(idx >= 0, idx, torch.full_like(idx, self.num_tokens))

    def index(self, device: torch.device | None = None) -> Tensor:
        """[n_W, M]: the token at each slot, ``-1`` at padded slots (a token may appear
        in several windows)."""
        return self._index.to(device)

    def _flat(self, device: torch.device | None) -> Tensor:
        return self._slot(self._index).flatten().to(device)

    def partition(self, x: Tensor) -> Tensor:
        """Token states [B, N, C] as windows [B · n_W, M, C] (each token copied to its
        slots; padded slots zero).

        Raises:
            ValueError: ``x`` does not have the ``N`` tokens.
        """
        b, n, c = x.shape
        if n != self.num_tokens:
            raise ValueError(f"attention in windows of token slots needs all "
                             f"{self.num_tokens} tokens, got {n}: true token removal does "
                             "not apply (remove pixels instead)")
        xp = F.pad(x, (0, 0, 0, 1))
        return xp[:, self._flat(x.device)].reshape(b * self.num_windows, self.area, c)

    def reverse(self, y: Tensor) -> Tensor:
        """Windows [B · n_W, M, C] back to tokens [B, N, C]: each token the mean of its
        slots' rows (padded slots dropped)."""
        c = y.shape[-1]
        y = y.reshape(-1, self.num_windows * self.area, c)
        w = self._weight.to(y.device, y.dtype).flatten()
        out = y.new_zeros(y.shape[0], self.num_tokens + 1, c)
        out = out.index_add(1, self._flat(y.device), y * w[:, None])
        return out[:, :self.num_tokens]

    def to_slots(self, v: Tensor) -> Tensor:
        """Per-token values ``[..., N]`` at the slots, ``[..., n_W, M]`` (0 at padding)."""
        vp = F.pad(v, (0, 1))
        return vp[..., self._flat(v.device)].reshape(*v.shape[:-1], self.num_windows,
                                                      self.area)

    def left_multiply(self, v: Tensor, matrix: Tensor) -> Tensor:
        """``vᵀ C`` (the class docstring's ``C``) for row vectors ``v`` ``[..., N]`` and a
        window-form matrix ``[..., n_W, M, M]``; leading dimensions broadcast."""
        w = self._weight.to(v.device, v.dtype)
        slots = self.to_slots(v) * w
        out_w = torch.einsum("...wi,...wij->...wj", slots, matrix.to(v.dtype))
        real = (self._index >= 0).to(v.device, v.dtype)
        flat = (out_w * real).reshape(*out_w.shape[:-2], -1)
        out = flat.new_zeros(*flat.shape[:-1], self.num_tokens + 1)
        return out.index_add(-1, self._flat(v.device), flat)[..., :self.num_tokens]

    def dense(self, matrix: Tensor) -> Tensor:
        """The dense ``[..., N, N]`` of a window-form matrix (tiny clips and tests only)."""
        n1 = self.num_tokens + 1
        slot = self._slot(self._index).to(matrix.device)
        w = self._weight.to(matrix.device, matrix.dtype)
        real = (self._index >= 0).to(matrix.device, matrix.dtype)
        vals = matrix * w[:, :, None] * real[:, None, :]
        pos = (slot[:, :, None] * n1 + slot[:, None, :]).flatten()
        out = matrix.new_zeros(*matrix.shape[:-3], n1 * n1)
        out = out.index_add(-1, pos, vals.reshape(*vals.shape[:-3], -1))
        return out.reshape(*matrix.shape[:-3], n1, n1)[..., :-1, :-1]

    def received(self, probs: Tensor) -> Tensor:
        """``mean_i C[i, j]`` [B, H, N] for window-form probabilities [B, H, n_W, M, M]."""
        ones = probs.new_ones(probs.shape[0], 1, self.num_tokens)
        return self.left_multiply(ones, probs) / self.num_tokens

    def seam_mask(self, dtype: torch.dtype, device: torch.device | None = None) -> None:
        """No shifted windows."""
        return None

    def logit_bias(self, position_bias: Tensor | None, batch: int, dtype: torch.dtype,
                   device: torch.device | None = None) -> Tensor | None:
        """``-inf`` on padded keys (a padded query attends only itself), [B · n_W, 1, M, M];
        ``None`` without padding."""
        real = self._index >= 0
        if bool(real.all()):
            return None if position_bias is None else position_bias.to(dtype)
        eye = torch.eye(self.area, dtype=torch.bool)
        allowed = real[:, None, :] | eye
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, float("-inf"))
        return mask[:, None].to(device).repeat(batch, 1, 1, 1)


@dataclass(frozen=True)
class MergeParts:
    r"""A patch merge between two stages: each 2×2 group of the ``(h, w)`` grid (zero rows
    added to an odd side, as the models pad) becomes one token
    :math:`y = \mathrm{LN}(\mathrm{concat}(x_{c_1}, \dots, x_{c_4}))\, W^\top (+ b)` of the
    ``(⌈h/2⌉, ⌈w/2⌉)`` grid, the children in :data:`MERGE_ORDER` (views of the model's
    parameters).
    With ``norm_last`` (Swin V2) the LayerNorm follows the reduction:
    :math:`y = \mathrm{LN}(\mathrm{concat}(x_{c_1}, \dots, x_{c_4})\, W^\top (+ b))`.

    Attributes:
        grid (tuple[int, int]): the input grid ``(h, w)``.
        norm (NormParts): the LayerNorm over the ``4 C`` concatenated states.
        weight (Tensor): ``W`` [D', 4 C].
        bias (Tensor or None): ``b`` [D'] (``None`` in Swin).
        order (tuple): the children's ``(row, column)`` offsets in concatenation order.
        norm_last (bool): the norm is over the ``D'`` reduced channels, after ``W``
            (Swin V2), rather than over the ``4 C`` concatenated states before it.
    """

    grid: tuple[int, int]
    norm: NormParts
    weight: Tensor
    bias: Tensor | None = None
    order: tuple[tuple[int, int], ...] = MERGE_ORDER
    norm_last: bool = False

    @property
    def out_grid(self) -> tuple[int, int]:
        """The merged grid ``(⌈h/2⌉, ⌈w/2⌉)``."""
        return ((self.grid[0] + 1) // 2, (self.grid[1] + 1) // 2)

    def gather(self, x: Tensor) -> Tensor:
        """The concatenated children [B, N', 4 C] of token states [B, N, C]."""
        b, n, c = x.shape
        h, w = self.grid
        if n != h * w:
            raise ValueError(f"a merge of the {h}x{w} grid needs {h * w} tokens, got {n}")
        x = F.pad(x.reshape(b, h, w, c), (0, 0, 0, w % 2, 0, h % 2))
        parts = [x[:, dh::2, dw::2] for dh, dw in self.order]
        return torch.cat(parts, -1).reshape(b, -1, 4 * c)

    def children(self, device: torch.device | None = None) -> Tensor:
        """[N', 4]: the raster index of each merged token's children in concatenation
        order, ``-1`` for a padded child."""
        h, w = self.grid
        ids = torch.arange(h * w, device=device).reshape(h, w)
        ids = F.pad(ids, (0, w % 2, 0, h % 2), value=-1)
        return torch.stack([ids[dh::2, dw::2].reshape(-1) for dh, dw in self.order], -1)


@dataclass(frozen=True)
class QueryPool:
    r"""Query pooling at the input of a block (Hiera, Ryali et al., ICML 2023; MViT's
    pooling attention): the block reads the ``(h, w)`` grid and writes the ``(h/2, w/2)``
    grid. With :math:`u = \mathrm{LN}_1(x)` on the input grid, its queries are
    :math:`\max_{c} (u_c W_q + b_q)` over the 2×2 children ``c`` of each output token (per
    channel), its keys and values those of every input token, and its residual branch is
    :math:`\max_c (u_c W_p + b_p)` (a projection to the new width, max-pooled alike) in
    place of ``x``. :meth:`children` lists the children in :data:`MERGE_ORDER`, as
    :class:`MergeParts` does, so a per-token value of the output grid goes back to the
    input grid the way a merge's does (:mod:`captum_vit.adapters.stages`).

    Attributes:
        grid (tuple[int, int]): the input grid ``(h, w)`` (even sides).
        weight (Tensor): ``W_p`` [D', D] (views of the model's parameters).
        bias (Tensor or None): ``b_p`` [D'].
        order (tuple): the children's ``(row, column)`` offsets (:data:`MERGE_ORDER`).
    """

    grid: tuple[int, int]
    weight: Tensor
    bias: Tensor | None = None
    order: tuple[tuple[int, int], ...] = MERGE_ORDER

    def __post_init__(self) -> None:
        if self.grid[0] % 2 or self.grid[1] % 2:
            raise ValueError(f"query pooling needs a grid of even sides, got {self.grid}")

    @property
    def out_grid(self) -> tuple[int, int]:
        """The pooled grid ``(h/2, w/2)``."""
        return (self.grid[0] // 2, self.grid[1] // 2)

    def max(self, x: Tensor) -> Tensor:
        """Token states ``[..., N, C]`` of the input grid max-pooled to the output grid
        (:func:`pool_tokens`)."""
        return pool_tokens(x, self.grid)

    def children(self, device: torch.device | None = None) -> Tensor:
        """[N', 4]: the raster index of each pooled token's children in :attr:`order`."""
        h, w = self.grid
        ids = torch.arange(h * w, device=device).reshape(h, w)
        return torch.stack([ids[dh::2, dw::2].reshape(-1) for dh, dw in self.order], -1)

    def shares(self, x: Tensor) -> Tensor:
        """Each child's share ``[..., N', 4]`` (children in :attr:`order`) of the channels
        where it is the maximum, ``x`` ``[..., N, C]`` being what is pooled: the
        sub-gradient of the channel-wise maximum averaged over the channels (¼ each to
        the tied children of a channel). The merge weights of the matrix methods.

        Read from strided views of the grid (no gathered ``[..., N', 4, C]`` copy)."""
        h, w = self.grid
        if x.shape[-2] != h * w:
            raise ValueError(f"query pooling of a {h}x{w} grid needs {h * w} tokens, got "
                             f"{x.shape[-2]}")
        grid = x.reshape(*x.shape[:-2], h // 2, 2, w // 2, 2, x.shape[-1])
        kids = [grid[..., dh, :, dw, :] for dh, dw in self.order]  # [..., h/2, w/2, C] each
        top = torch.maximum(torch.maximum(kids[0], kids[1]), torch.maximum(kids[2], kids[3]))
        hits = [(k == top).to(x.dtype) for k in kids]
        count = (hits[0] + hits[1]) + (hits[2] + hits[3])
        out = torch.stack([(t / count).mean(-1) for t in hits], -1)  # [..., h/2, w/2, 4]
        return out.reshape(*x.shape[:-2], (h // 2) * (w // 2), 4)

    def query_window(self, window: Windows) -> Windows:
        """The windows of the pooled queries for key windows ``window`` of the input grid:
        the same windows, each with half the side on the output grid. Windows padded at the
        bottom and right (SAM 2: a window side that does not divide the even grid) pool
        their padded slots among themselves: the output grid padded to whole half windows
        has the same windows, and a pooled token of the real grid has real children only."""
        if window.size[0] % 2 or window.size[1] % 2 or any(window.shift) \
                or window.grid != self.grid:
            raise ValueError(f"query pooling inside windows needs unshifted windows of even "
                             f"sides on the pooled grid {self.grid}, got {window}")
        out = Windows(grid=self.out_grid, size=(window.size[0] // 2, window.size[1] // 2))
        assert out.num_windows == window.num_windows  # even grid, even window sides
        return out
