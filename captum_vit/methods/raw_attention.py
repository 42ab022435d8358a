"""Raw attention of the last block (Jain & Wallace; Chefer et al.'s baseline)."""

from __future__ import annotations

from typing import Any

from captum.log import log_usage
from torch import Tensor, nn

from captum_vit._base import (
    TargetLike,
    check_choice,
    readout_rows,
    resolve_target,
)
from captum_vit.adapters import BlockRecord
from captum_vit.methods._front import PlainAttribution, fill_doc
from captum_vit.methods.table import register_method

SOURCES = ("pool", "last_block")


@register_method("raw_attention", kind="attention")
class RawAttention(PlainAttribution):
    r"""Attention probabilities of the last block, averaged over heads, read at the
    classifier's readout row: :math:`m = \mathrm{mean}_h A_{L-1}^h[r, :]`.

    No gradient is used, so the map does not depend on ``target``; the forward builds no
    autograd graph and keeps no block's probabilities but the last one's head mean.

    With an attention-pool head (``global_pool='map'``, SigLIP) the classifier reads the
    pool's attention :math:`w = \mathrm{mean}_h A_p^h[0, :]` over the tokens; by default
    (``source="pool"``) that is the map, and ``source="last_block"``
    gives :math:`w \bar A_{L-1}`. For every other head the two are the same map, the
    last block's readout row.

    Args:
        model (torch.nn.Module): a supported Vision Transformer (see
            :func:`captum_vit.adapters.adapt`). It is never modified.
        source (str, optional): ``"pool"`` (default) or ``"last_block"``.

    Per-head maps (``attribute(..., heads="all")``): head :math:`h`'s attention read at the
    same row, :math:`m_h = w A_{L-1}^h` (with ``source="pool"`` and an attention-pool
    head: the pool's own heads, :math:`m_h = A_p^h[0, :]`); their head mean is the map
    of ``heads="mean"``.

    Layer-local: composed with :class:`~captum_vit.combinators.PLUS` / ``SkipPLUS`` it
    gives the map at every block ``l``, :math:`\sum_l w \bar A_l` (with
    ``source="pool"`` an attention-pool head's map does not depend on the block).
    """

    pools_queries = True  # vector chains through query pooling (Stages.residual_mix)

    class_agnostic = True

    layer_local = True
    """PLUS evaluates it on a one-block window: the map at block ``l``."""
    per_head = True
    """``attribute`` takes ``heads="all"``: one map per head."""

    def __init__(self, model: nn.Module, source: str = "pool") -> None:
        self.source = check_choice("source", source, SOURCES)
        super().__init__(model)

    @log_usage()
    @fill_doc
    def attribute(self, inputs: Tensor, target: TargetLike = None, *, heads: str = "mean",
                  output: str = "pixels") -> Tensor:
        r"""
        Args:
            {inputs}
            target (int, list, Tensor, optional): accepted for API compatibility and
                validated; raw attention is class-agnostic.
            {heads}
            {output}

        Returns:
            Tensor: the attribution map in the requested ``output`` format.

        Examples::

            >>> import timm, torch
            >>> from captum_vit import RawAttention
            >>> model = timm.create_model("vit_tiny_patch16_224", num_classes=10).eval()
            >>> attr = RawAttention(model).attribute(torch.randn(2, 3, 224, 224))
            >>> attr.shape
            torch.Size([2, 3, 224, 224])
            >>> RawAttention(model).attribute(torch.randn(2, 3, 224, 224), heads="all",
            ...                               output="grid").shape   # 3 heads
            torch.Size([2, 3, 14, 14])
        """
        return self._attribute(inputs, target, output, heads=heads)

    def _token_maps(self, inputs: Tensor, target: Tensor | None, **_: Any) -> Tensor:
        last = self.adapter.num_blocks - 1
        kept: list[Tensor] = []

        def keep(l: int, rec: BlockRecord) -> None:  # stream: only the last block's mean
            if l == last:
                kept.append(rec.require_attn().mean(1))

        tr = self.adapter.trace(inputs, on_block=keep, logits=not self.adapter.fixed_readout)
        w = readout_rows(tr, target=None if tr.logits is None
                         else resolve_target(target, tr.logits))
        if tr.pool_attn is not None and self.source == "pool":
            return w
        return self.adapter.stages.token_mix(self.adapter.stages.carry_down(w, last), kept[0], last)

    def _head_maps(self, inputs: Tensor, target: Tensor | None, **_: Any) -> Tensor:
        last = self.adapter.num_blocks - 1
        kept: list[Tensor] = []

        def keep(l: int, rec: BlockRecord) -> None:  # stream: only the last block's heads
            if l == last:
                kept.append(rec.require_attn())

        tr = self.adapter.trace(inputs, on_block=keep, logits=not self.adapter.fixed_readout)
        if tr.pool_attn is not None and self.source == "pool":
            return tr.pool_attn.detach()[:, :, 0]  # [B, H_pool, N]
        w = readout_rows(tr, target=None if tr.logits is None
                         else resolve_target(target, tr.logits))
        return self.adapter.stages.token_mix(self.adapter.stages.carry_down(w, last), kept[0], last)
