"""Attention rollout (Abnar & Zuidema 2020; SkipPLUS Eq. 2). SPEC §1.2."""

from __future__ import annotations

from typing import Any

import torch
from captum.log import log_usage
from torch import Tensor, nn

from captum_vit._base import (
    TargetLike,
    ViTGradientAttribution,
    accumulation_dtype,
    check_layer,
    readout_rows,
    resolve_target,
)


class Rollout(ViTGradientAttribution):
    r"""Attention rollout: :math:`M_l = (\bar A_l + I) / \mathrm{rowsum}(\bar A_l + I)`,
    :math:`R = M_{L-1} \cdots M_s`, map = readout row of :math:`R`.

    Only the readout row is needed, so it is propagated as a vector
    (:math:`r^\top M_{L-1} \cdots M_s`), which costs :math:`O(N^2)` per block instead
    of a matrix product.

    Args:
        model (torch.nn.Module): a supported Vision Transformer.
        start_layer (int, optional): first block ``s`` to include. Default 0;
            Chefer et al.'s evaluation scripts use 1.
    """

    def __init__(self, model: nn.Module, start_layer: int = 0) -> None:
        super().__init__(model)
        self.start_layer = check_layer("start_layer", start_layer, self.adapter.num_blocks)

    @log_usage()
    def attribute(self, inputs: Tensor, target: TargetLike = None, *,
                  start_layer: int | None = None, output: str = "pixels") -> Tensor:
        r"""
        Args:
            inputs (Tensor): images [B, C, H, W] (or a 1-tuple holding them).
            target (int, list, Tensor, optional): validated but unused (rollout is
                class-agnostic).
            start_layer (int, optional): overrides the constructor's ``start_layer``.
            output (str, optional): ``"pixels"`` (default), ``"grid"`` or ``"tokens"``.

        Returns:
            Tensor: the attribution map in the requested ``output`` format.

        Examples::

            >>> from captum_vit import Rollout
            >>> attr = Rollout(model, start_layer=1).attribute(images, output="grid")
        """
        s = self.start_layer if start_layer is None else start_layer
        check_layer("start_layer", s, self.adapter.num_blocks)
        return self._attribute(inputs, target, output, start_layer=s)

    def _token_maps(self, inputs: Tensor, target: Tensor | None, *, start_layer: int = 0,
                    **_: Any) -> Tensor:
        tr = self.adapter.trace(inputs)
        a0 = tr.blocks[0].attn
        dt = accumulation_dtype(a0)
        eye = torch.eye(a0.shape[-1], dtype=dt, device=a0.device)
        r = readout_rows(tr, dtype=dt, target=resolve_target(target, tr.logits))
        for rec in reversed(tr.blocks[start_layer:]):
            m = rec.attn.to(dt).mean(1) + eye
            m = m / m.sum(-1, keepdim=True)
            r = torch.einsum("bn,bnm->bm", r, m)
        return r
