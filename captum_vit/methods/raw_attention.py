"""Raw attention of the last block (Jain & Wallace; Chefer et al.'s baseline). SPEC §1.1."""

from __future__ import annotations

from typing import Any

from captum.log import log_usage
from torch import Tensor

from captum_vit._base import TargetLike, ViTGradientAttribution, readout


class RawAttention(ViTGradientAttribution):
    r"""Attention probabilities of the last block, averaged over heads, read at the
    classifier's readout row: :math:`m = \mathrm{mean}_h A_{L-1}^h[r, :]`.

    No gradient is used, so the map does not depend on ``target``.

    Args:
        model (torch.nn.Module): a supported Vision Transformer (see
            :func:`captum_vit.adapters.adapt`). It is never modified.
    """

    @log_usage()
    def attribute(self, inputs: Tensor, target: TargetLike = None, *,
                  output: str = "pixels") -> Tensor:
        r"""
        Args:
            inputs (Tensor): images [B, C, H, W] (or a 1-tuple holding them).
            target (int, list, Tensor, optional): accepted for API compatibility and
                validated; raw attention is class-agnostic.
            output (str, optional): ``"pixels"`` (default, shaped like ``inputs``, each
                patch's score copied to its pixels), ``"grid"`` [B, 1, gh, gw] or
                ``"tokens"`` [B, P].

        Returns:
            Tensor: the attribution map in the requested ``output`` format.

        Examples::

            >>> import timm, torch
            >>> from captum_vit import RawAttention
            >>> model = timm.create_model("vit_tiny_patch16_224", num_classes=10).eval()
            >>> attr = RawAttention(model).attribute(torch.randn(2, 3, 224, 224))
            >>> attr.shape
            torch.Size([2, 3, 224, 224])
        """
        return self._attribute(inputs, target, output)

    def _token_maps(self, inputs: Tensor, target: Tensor | None, **_: Any) -> Tensor:
        tr = self.adapter.trace(inputs)
        return readout(tr.layout, tr.blocks[-1].attn.mean(1))
