"""Attention rollout (Abnar & Zuidema 2020; SkipPLUS Eq. 2)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from captum.log import log_usage
from torch import Tensor, nn

from captum_vit._base import (
    AGGREGATES,
    TargetLike,
    ViTGradientAttribution,
    accumulation_dtype,
    check_choice,
    check_layer,
    readout_rows,
    resolve_target,
)
from captum_vit.adapters import BlockRecord, Trace
from captum_vit.methods._engines import PLUSFastPath
from captum_vit.methods._front import fill_doc
from captum_vit.methods.table import register_method


@register_method("rollout", kind="attention")
class Rollout(PLUSFastPath, ViTGradientAttribution):
    r"""Attention rollout: :math:`M_l = (\bar A_l + I) / \mathrm{rowsum}(\bar A_l + I)`,
    :math:`R = M_{L-1} \cdots M_s`, map = readout row of :math:`R`.

    Only the readout row is needed, so it is propagated as a vector
    (:math:`r^\top M_{L-1} \cdots M_s`), which costs :math:`O(N^2)` per block instead
    of a matrix product. The forward builds no autograd graph and streams: each block's
    ``[B, H, N, N]`` probabilities are reduced to their head mean ``[B, N, N]`` as soon
    as the block has run.

    Per-head maps (``attribute(..., heads="all")``, our choice): the last factor per head,
    :math:`m_h = r^\top M_{L-1}^h M_{L-2} \cdots M_s` with
    :math:`M_{L-1}^h = (A_{L-1}^h + I) / \mathrm{rowsum}(A_{L-1}^h + I)
    = \tfrac12 I + \tfrac12 A_{L-1}^h` (attention rows sum to one) and the head-averaged
    factors of the blocks below. Then :math:`\mathrm{mean}_h M_{L-1}^h = M_{L-1}`, so
    :math:`\mathrm{mean}_h m_h` is the map of ``heads="mean"`` (equal up to rounding: each
    factor is normalised by its own row sums, all equal to two).

    Composed with :class:`~captum_vit.combinators.PLUS` / ``SkipPLUS`` it takes a fast
    path (:meth:`plus_maps`): the rollout of every sub-network from one trace.

    Args:
        model (torch.nn.Module): a supported Vision Transformer.
        start_layer (int, optional): first block ``s`` to include. Default 0;
            Chefer et al.'s evaluation scripts use 1.
    """

    pools_queries = True  # vector chains through query pooling (Stages.residual_mix)

    class_agnostic = True

    plus_aggregates = AGGREGATES
    per_head = True
    """``attribute`` takes ``heads="all"``: one map per head of the last block."""

    def __init__(self, model: nn.Module, start_layer: int = 0) -> None:
        super().__init__(model)
        self.start_layer = check_layer("start_layer", start_layer, self.adapter.num_blocks)

    @log_usage()
    @fill_doc
    def attribute(self, inputs: Tensor, target: TargetLike = None, *,
                  start_layer: int | None = None, heads: str = "mean",
                  output: str = "pixels") -> Tensor:
        r"""
        Args:
            {inputs}
            target (int, list, Tensor, optional): validated but unused (rollout is
                class-agnostic).
            start_layer (int, optional): overrides the constructor's ``start_layer``.
            {heads}
            {output}

        Returns:
            Tensor: the attribution map in the requested ``output`` format.

        Examples::

            >>> from captum_vit import Rollout
            >>> attr = Rollout(model, start_layer=1).attribute(images, output="grid")
            >>> per_head = Rollout(model).attribute(images, heads="all", output="grid")
        """
        s = self.start_layer if start_layer is None else start_layer
        check_layer("start_layer", s, self.adapter.num_blocks)
        return self._attribute(inputs, target, output, start_layer=s, heads=heads)

    # takes this method's own options, not any keyword (ViTFront._head_maps)
    def _head_maps(self, inputs: Tensor, target: Tensor | None, *, start_layer: int,  # type: ignore[override]
                   **_: Any) -> Tensor:
        """Per-head maps [B, H, N]: the last block's factor per head, then the blocks
        below with their head means."""
        last = self.adapter.num_blocks - 1
        tr, means = self._head_means(inputs, range(start_layer, last + 1), per_head=last)
        dt = accumulation_dtype(tr.x0)
        w = readout_rows(tr, dtype=dt, target=None if tr.logits is None
                         else resolve_target(target, tr.logits))
        st, n = self.adapter.stages, w.shape[-1]
        shares = self._shares
        m = st.real_keys(means.pop(last), last) + st.residual_mix(last, n, dt, w.device,
                                                                  shares.get(last))
        v = st.token_mix(w, m / m.sum(-1, keepdim=True), last)  # [B, H, N]
        for k in reversed(range(start_layer, last)):  # stages: through the merges (¼)
            v = st.unmerge(v, k)
            m = st.real_keys(means.pop(k), k) + st.residual_mix(k, n, dt, w.device,
                                                                shares.get(k))
            v = st.token_mix(v, m / m.sum(-1, keepdim=True), k)
        v = st.carry(v, start_layer, split=True)
        return v

    def _head_means(self, inputs: Tensor, blocks: Sequence[int] | range,
                    per_head: int | None = None) -> tuple[Trace, dict[int, Tensor]]:
        r"""One gradient-free trace keeping only the head means :math:`\bar A_k`
        [B, N, N] of ``blocks``: each block's [B, H, N, N] probabilities are freed as soon
        as the block has run (streamed, :meth:`ViTAdapter.trace`'s ``on_block``). Block
        ``per_head`` keeps its heads [B, H, N, N] instead of their mean."""
        want, means = set(blocks), {}
        # query pooling (Hiera): the residual's token mixing, each child's share of the
        # channels where it is the maximum (Stages.residual_mix)
        self._shares: dict[int, Tensor] = {}

        def keep(l: int, rec: BlockRecord) -> None:
            if rec.pool_shares is not None:
                self._shares[l] = rec.pool_shares
            if l == per_head:
                means[l] = rec.require_attn().to(accumulation_dtype(rec.require_attn()))
            elif l in want:
                means[l] = rec.require_attn().to(accumulation_dtype(rec.require_attn())).mean(1)

        # class-agnostic with fixed readout weights: the last block stops at its
        # attention and no logits are computed
        return self.adapter.trace(inputs, on_block=keep,
                                  logits=not self.adapter.fixed_readout), means

    # takes this method's own options, not any keyword (PLUSFastPath.plus_maps)
    def plus_maps(self, inputs: Tensor, target: Tensor | None, layers: Sequence[int], *,  # type: ignore[override]
                  aggregate: str = "subnetwork", start_layer: int | None = None) -> Tensor:
        r"""PLUS / SkipPLUS fast path (:mod:`captum_vit.combinators`): the rollout of every
        sub-network :math:`f_l`, ``l`` in ``layers``, from one trace, [len(layers), B, N].

        ``aggregate="subnetwork"``: suffix row-vector products :math:`v_L = w`,
        :math:`v_k = v_{k+1} M_k`; the rollout of :math:`f_l` started at its own block
        ``s`` (``start_layer``, relative to the sub-network) is :math:`v_{l+s}`.
        ``aggregate="layer"``: :math:`w \bar A_l` (the per-block matrix without identity;
        needs ``s = 0``).

        Args:
            inputs (Tensor): validated images [B, C, H, W].
            target (Tensor or None): class per image (only for an image-dependent readout).
            layers (sequence of int): sorted start blocks.
            aggregate (str): ``"subnetwork"`` or ``"layer"``.
            start_layer (int, optional): overrides the constructor's ``start_layer``.

        Returns:
            Tensor: token maps [len(layers), B, N].

        Examples::

            >>> from captum_vit import PLUS
            >>> PLUS(model, "rollout").attribute(images)   # calls this
        """
        check_choice("aggregate", aggregate, AGGREGATES)
        s = self.start_layer if start_layer is None else start_layer
        L = self.adapter.num_blocks
        for l in layers:  # the check Rollout makes on each (L - l)-block sub-network
            check_layer("start_layer", s, L - l)
        if aggregate == "layer" and s:
            raise ValueError(f"start_layer must be 0 with aggregate='layer' (the per-block "
                             f"matrices are summed), got {s}")
        need = {l + s for l in layers}
        tr, means = self._head_means(inputs, layers if aggregate == "layer"
                                     else range(min(need), L))
        dt = accumulation_dtype(tr.x0)
        w = readout_rows(tr, dtype=dt, target=None if tr.logits is None
                         else resolve_target(target, tr.logits))
        if aggregate == "layer":
            st = self.adapter.stages
            return torch.stack([st.carry(st.token_mix(st.carry_down(w, l), means[l], l), l,
                                         split=True) for l in layers])
        st, n = self.adapter.stages, w.shape[-1]
        rows, v = {}, w
        for k in reversed(range(min(need), L)):  # r^T M_{L-1} ... M_k, one vector
            v = st.unmerge(v, k)  # stages: through the merge after block k (¼ weights)
            m = st.real_keys(means.pop(k), k) + st.residual_mix(k, n, dt, w.device,
                                                                self._shares.get(k))
            v = st.token_mix(v, m / m.sum(-1, keepdim=True), k)
            if k in need:
                rows[k] = v
        return torch.stack([st.carry(rows[l + s], l + s, split=True) for l in layers])
