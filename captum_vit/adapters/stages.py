"""Stage geometry: the token grids of a model's blocks, as one object a method reads.

Design. A plain ViT has one token grid for every block, and its token-mixing matrices are
dense ``N × N``. A model made of *stages* (Swin, SAM's image encoder,
:mod:`captum_vit.adapters.windows`) has per stage its own grid, attention within windows
(block-diagonal mixing, ``[n_W, M, M]`` per block, never built densely) and a patch merge
between stages. A method that chains per-block matrices, carries a map from a later block
to the maps' grid or reads a token-mixing matrix goes through :class:`Stages`
(``adapter.stages``), never through the windows and merges themselves, so the same code
runs on both: for a model without windows and merges every member is the identity or the
dense operation.

The geometry is the blocks' (their :class:`~captum_vit.adapters.windows.Windows` and
:class:`~captum_vit.adapters.windows.MergeParts`), read live from the adapter: the blocks
re-read after ``model.to`` and the blocks a target in force ends at
(:attr:`~captum_vit.adapters.ViTAdapter.num_blocks`) are those of the moment. A view of
blocks ``start .. stop-1`` (:class:`~captum_vit.adapters.subnetwork.SubnetworkAdapter`)
reads the model's stages with its block indices shifted by ``start``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from captum_vit.adapters.parts import BlockParts
from captum_vit.adapters.windows import MergeParts, Windows


class _Blocks(Protocol):
    """What the geometry is read from: an adapter's blocks and its block count."""

    @property
    def blocks(self) -> Sequence[BlockParts]: ...

    @property
    def num_blocks(self) -> int: ...


class Stages:
    """The token geometry of an adapter's blocks: grids, windows, merges, and the
    operations a method needs to move per-token values between them.

    Obtained as ``adapter.stages`` (:attr:`~captum_vit.adapters.ViTAdapter.stages`).
    Notation: ``x_l`` is the input of block ``l`` (``x_L`` the last state), ``N_l`` its
    token count; a *token-mixing matrix* of block ``l`` has the form of its attention
    probabilities (``[..., N, N]``, or ``[..., n_W, M, M]`` for a windowed block).

    Args:
        source: the adapter (anything with ``blocks`` and ``num_blocks``).
        offset (int): the index of the source's block that is this object's block 0
            (a view of a model's blocks ``start ..``: ``start``).

    Examples::

        >>> st = adapt(swin).stages
        >>> st.hierarchical, st.has_windows
        (True, True)
        >>> maps = st.carry(values_of_x_l, l, split=True)   # onto the maps' grid
        >>> adapt(vit).stages.carry(v, 5) is v              # a plain ViT: the identity
        True
    """

    def __init__(self, source: _Blocks, offset: int = 0) -> None:
        self._source = source
        self._offset = offset

    def __repr__(self) -> str:
        kind = "hierarchical" if self.hierarchical else "windowed" if self.has_windows else "flat"
        return f"Stages({kind}, offset={self._offset})"

    def _block(self, layer: int) -> BlockParts:
        return self._source.blocks[self._offset + layer]

    # -- what the geometry is ---------------------------------------------------------------
    @property
    def hierarchical(self) -> bool:
        """Whether the blocks form stages joined by patch merges (Swin) or query pooling
        (Hiera, :attr:`~captum_vit.adapters.parts.BlockParts.regrid`): token maps of a
        later stage are carried to the maps' grid by :meth:`carry`."""
        return any(p.regrid is not None for p in self._source.blocks)

    @property
    def has_windows(self) -> bool:
        """Whether some block attends within windows of its grid (Swin, SAM)."""
        return any(p.window is not None for p in self._source.blocks)

    @property
    def final_tokens(self) -> int | None:
        """The token count of the last state for a model with windows (its last block's
        grid), ``None`` otherwise (the embedding's count, which depends on the images)."""
        last = self._source.blocks[self._source.num_blocks - 1]
        if last.window is None:
            return None
        regrid = last.regrid  # a last block that pools (Hiera) writes the pooled grid
        return last.window.num_tokens if regrid is None \
            else regrid.out_grid[0] * regrid.out_grid[1]

    def window(self, layer: int) -> Windows | None:
        """Block ``layer``'s window partition (:class:`~captum_vit.adapters.windows.Windows`),
        ``None`` for a block attending globally."""
        return self._block(layer).window

    def merge(self, layer: int) -> MergeParts | None:
        """The patch merge after block ``layer``
        (:class:`~captum_vit.adapters.windows.MergeParts`), ``None`` if none."""
        return self._block(layer).merge

    # -- moving per-token values between grids ----------------------------------------------
    def carry(self, values: Tensor, layer: int | None = None, *, split: bool = False,
              down_to: int | None = None) -> Tensor:
        """Per-token values ``[..., N_l]`` of the state ``x_l`` on the first stage's grid,
        the grid the maps land on (:mod:`captum_vit.adapters.windows`). Each merge is
        undone from the top: a merged token's value goes to its children, copied
        (``split=False``: a score per token, as a map is upsampled to pixels) or shared
        equally among its real children (``split=True``: a relevance, whose sum is kept;
        the ¼ weights of the merge's token mixing, a padded child of an odd grid taking no
        share). A model without merges returns ``values`` unchanged.

        Args:
            values (Tensor): ``[..., N_l]``.
            layer (int, optional): ``l``; ``None`` = the stage whose token count is
                ``N_l`` (the stages' counts differ).
            split (bool): share rather than copy.
            down_to (int, optional): stop at the grid of ``x_{down_to}`` (the merges of
                blocks ``down_to .. l-1`` are undone); ``None`` = the maps' grid (the
                model's first stage's).

        Returns:
            Tensor ``[..., N_{down_to}]``.

        Raises:
            ValueError: ``N_l`` is no stage's token count.
        """
        if not self.hierarchical:
            return values
        blocks = self._source.blocks
        first = 0 if down_to is None else self._offset + down_to
        stop = len(blocks) if layer is None else self._offset + layer
        merges = [p.regrid for p in blocks[first:stop] if p.regrid is not None]
        if layer is None:
            while merges and merges[-1].out_grid[0] * merges[-1].out_grid[1] != values.shape[-1]:
                merges.pop()
        for m in reversed(merges):
            values = _unmerge(values, m, split)
        window = blocks[first].window
        if window is not None and values.shape[-1] != window.num_tokens:
            raise ValueError(f"values of {values.shape[-1]} tokens are on no stage's grid")
        return values

    def unmerge(self, v: Tensor, layer: int, weights: Tensor | None = None) -> Tensor:
        """Row vectors ``v`` ``[..., N_{l+1}]`` on the grid of ``x_{l+1}`` times the
        token mixing ``P_l`` of block ``l``'s merge (``vᵀ P_l``, ``[..., N_l]``: each
        merged token's weight shared equally among its real children, the merge weights
        of the gradient-free and gradient-weighted matrix methods, or by ``weights``
        ``[B, N_{l+1}, 4]`` per child in concatenation order, a method's own); ``v``
        itself for a block without merge. The step of a vector chain through a merge."""
        m = self._block(layer).merge  # a query pooling is in the block's own mixing
        return v if m is None else _unmerge(v, m, True, weights)

    def carry_down(self, w: Tensor, layer: int) -> Tensor:
        """Readout weights ``w`` ``[..., N_L]`` of the last state through the merges of
        blocks ``layer .. L-1`` (:meth:`unmerge`; of a view, the model's blocks after it
        included), on the grid of ``x_layer``: the readout of a single block's matrix in a
        model with stages."""
        source = self._source
        first = self._offset + layer
        for k in reversed(range(first, source.num_blocks)):
            # a later block's query pooling as a merge (¼); block ``layer``'s own is in its
            # token mixing, whose rows are on its output grid
            m = source.blocks[k].merge if k == first else source.blocks[k].regrid
            if m is not None:
                w = _unmerge(w, m, True)
        return w

    # -- token-mixing matrices --------------------------------------------------------------
    def token_mix(self, v: Tensor, matrix: Tensor, layer: int) -> Tensor:
        """``vᵀ C`` for row vectors ``v`` ``[..., N]`` and a token-mixing matrix ``C`` of
        block ``layer``: ``[..., N, N]``, or ``[..., n_W, M, M]`` for a windowed block
        (block-diagonal in window order, never built densely;
        :meth:`~captum_vit.adapters.windows.Windows.left_multiply`). The leading
        dimensions broadcast (``v`` [B, N] against per-head ``C`` [B, H, ...] gives
        [B, H, N])."""
        p = self._block(layer)
        win = p.window
        v = v.to(matrix.dtype)
        lead = matrix.dim() - (2 if win is None else 3)  # matrix dims before [(n_W,) N, N]
        while v.dim() - 1 < lead:
            v = v.unsqueeze(1)
        while lead < v.dim() - 1:
            matrix, lead = matrix.unsqueeze(1), lead + 1
        if win is None:
            return torch.einsum("...n,...nm->...m", v, matrix)
        if p.pool is not None:  # pooled queries: rows on the output grid's windows
            return win.left_multiply(v, matrix, rows=p.pool.query_window(win))
        return win.left_multiply(v, matrix)

    def received(self, probs: Tensor, layer: int) -> Tensor:
        """The attention each key token of block ``layer`` receives, averaged over its
        queries: ``mean_i A[i, j]`` [B, H, N] (:meth:`token_mix` of the uniform row
        vector; a pooling block's queries are the ``N/4`` of its output grid)."""
        p = self._block(layer)
        if p.window is None:
            return probs.mean(-2)
        rows = p.window if p.pool is None else p.pool.query_window(p.window)
        ones = probs.new_ones(probs.shape[0], 1, rows.num_tokens)
        return self.token_mix(ones, probs, layer) / rows.num_tokens

    def dense(self, matrix: Tensor, layer: int) -> Tensor:
        """A token-mixing matrix of block ``layer`` (:meth:`token_mix`'s form) as the
        dense ``[..., N_out, N_in]``: ``matrix`` itself for global attention; a windowed
        block's ``[..., n_W, M, M]`` (:meth:`~captum_vit.adapters.windows.Windows.dense`),
        or with query pooling (Hiera) its ``[..., n_W, M/4, M]`` with the rows on the
        pooled grid. Only for small grids (a model's last stage), never a first stage."""
        p = self._block(layer)
        win = p.window
        if win is None:
            return matrix
        if p.pool is None:
            return win.dense(matrix)
        rows = p.pool.query_window(win)  # windows that tile the grid: no padded slots
        ri, ci = rows.index(matrix.device), win.index(matrix.device)
        out = matrix.new_zeros(*matrix.shape[:-3], rows.num_tokens, win.num_tokens)
        out[..., ri[:, :, None], ci[:, None, :]] = matrix
        return out

    def real_keys(self, matrix: Tensor, layer: int) -> Tensor:
        """A token-mixing matrix of block ``layer`` (:meth:`token_mix`) without the
        columns of padded window slots (no tokens: the dense ``N × N`` matrix has no such
        columns), for a method that normalises rows; ``matrix`` itself for global
        attention."""
        win = self._block(layer).window
        if win is None:
            return matrix
        return matrix * (win.index(matrix.device) >= 0).to(matrix.dtype)[..., None, :]

    def token_eye(self, layer: int, n: int, dtype: torch.dtype,
                  device: torch.device | None = None) -> Tensor:
        """The identity in the form of block ``layer``'s token-mixing matrices
        (:meth:`token_mix`): ``[n, n]`` (``n = N``), or ``[M, M]`` (every window's) for a
        windowed block."""
        p = self._block(layer)
        win = p.window
        if p.pool is not None:
            return self._pool_mix(layer, dtype, device)
        return torch.eye(n if win is None else win.area, dtype=dtype, device=device)

    def residual(self, v: Tensor, layer: int, shares: Tensor | None = None) -> Tensor:
        """Row vectors ``v`` ``[..., N_out]`` times the token mixing of block ``layer``'s
        residual branch: ``v`` itself (the identity), or for a block with query pooling
        (Hiera) each pooled token's weight shared among its children by ``shares``
        ``[B, N', 4]`` (the record's ``pool_shares``; ``None`` = ¼ each), ``[..., N_in]``.
        The identity term of a vector chain ``vᵀ(R_l + Ā_l)``."""
        pool = self._block(layer).pool
        if pool is None:
            return v
        w = None if shares is None else shares.reshape(
            shares.shape[0], *([1] * (v.dim() - 2)), *shares.shape[1:])
        return _unmerge(v, pool, True, w)

    def residual_mix(self, layer: int, n: int, dtype: torch.dtype,
                     device: torch.device | None = None, shares: Tensor | None = None
                     ) -> Tensor:
        """The token mixing of block ``layer``'s residual branch in the form of its
        token-mixing matrices (:meth:`token_mix`): the identity (:meth:`token_eye`), or for
        a block with query pooling (Hiera) the pooling's ``[B or 1, n_W, M/4, M]``, each
        pooled token's row holding its children's ``shares`` ``[B, N', 4]`` (the record's
        ``pool_shares``: each child's share of the channels where it is the maximum; ``None``
        = ¼ each)."""
        if self._block(layer).pool is None:
            return self.token_eye(layer, n, dtype, device)
        return self._pool_mix(layer, dtype, device, shares)

    def _pool_mix(self, layer: int, dtype: torch.dtype, device: torch.device | None,
                  shares: Tensor | None = None) -> Tensor:
        p = self._block(layer)
        pool, win = p.pool, p.window
        assert pool is not None
        keys = win if win is not None else Windows(grid=pool.grid, size=pool.grid)
        rows = pool.query_window(keys)
        kids = pool.children(device)  # [N', 4] grid indices of the input grid
        if shares is None:
            shares = torch.full((1, *kids.shape), 0.25, dtype=dtype, device=device)
        shares = shares.to(dtype)
        b = shares.shape[0]
        # per input token: its slot in its window; per output token: its window and slot
        # (padded slots of windows padded on the grid, index -1, hold no token: left out)
        slot_in = torch.empty(keys.num_tokens, dtype=torch.long, device=device)
        idx_in = keys.index(device)
        real_in = idx_in >= 0
        slot_in[idx_in[real_in]] = torch.arange(keys.area, device=device).expand_as(
            idx_in)[real_in]
        idx_out = rows.index(device)  # [n_W, M']
        real_out = idx_out >= 0
        out = torch.zeros(b, keys.num_windows, rows.area, keys.area, dtype=dtype,
                          device=device)
        w_of = torch.arange(keys.num_windows, device=device)[:, None].expand_as(idx_out)
        s_of = torch.arange(rows.area, device=device)[None].expand_as(idx_out)
        tok = idx_out[real_out]  # output tokens in window order
        cols = slot_in[kids[tok]]  # [n_W M', 4]
        out[:, w_of[real_out][:, None], s_of[real_out][:, None], cols] = shares[:, tok]
        return out


def _unmerge(values: Tensor, merge: MergeParts, split: bool, weights: Tensor | None = None
             ) -> Tensor:
    """Values ``[..., N']`` of a merged grid on the grid before the merge: each merged
    token's value copied to its real children (``split``: shared equally among them;
    ``weights`` [B, N', 4]: shared by them, per child)."""
    child = merge.children(values.device)  # [N', 4]
    if values.shape[-1] != child.shape[0]:
        raise ValueError(f"values of {values.shape[-1]} tokens are not on the "
                         f"{merge.out_grid[0]}x{merge.out_grid[1]} grid after a merge")
    real = child >= 0
    v = values.unsqueeze(-1).expand(*values.shape, 4)
    if weights is not None:
        v = v * weights.to(values.dtype)
    elif split:
        v = v / real.sum(-1).to(values.dtype)[:, None]
    out = values.new_zeros(*values.shape[:-1], merge.grid[0] * merge.grid[1])
    out[..., child[real]] = v[..., real]
    return out
