"""Chance level: uniform random patch scores (the ``random`` row of every metric table)."""

from __future__ import annotations

import zlib
from typing import Any

import torch
from captum.log import log_usage
from torch import Tensor, nn

from captum_vit._base import TargetLike, ViTPerturbationAttribution
from captum_vit.methods.table import register_method


@register_method("random", kind="baseline", baseline=True, seeded=True)
class RandomMap(ViTPerturbationAttribution):
    r"""Uniform random patch scores: the chance level of every metric table.

    Each image's map is drawn from a generator seeded by ``seed`` and a checksum of the
    image's values, so a map depends only on the image (not on the batch it comes in, the
    process rank or earlier calls) and runs are repeatable.

    Args:
        model (torch.nn.Module): a supported ViT (used for the patch grid; never modified).
        seed (int): base seed.

    Examples::

        >>> from captum_vit.methods import RandomMap
        >>> RandomMap(model, seed=0).attribute(x, output="tokens").shape
        torch.Size([2, 196])
    """

    def __init__(self, model: nn.Module, seed: int = 0) -> None:
        super().__init__(model)
        self.seed = int(seed)

    @log_usage()
    def attribute(self, inputs: Tensor, target: TargetLike = None, *,
                  output: str = "pixels") -> Tensor:
        r"""
        Args:
            inputs (Tensor): images [B, C, H, W].
            target (int, list, Tensor, optional): validated and ignored.
            output (str, optional): ``"pixels"``, ``"grid"`` or ``"tokens"``.

        Returns:
            Tensor: random scores in [0, 1) in the requested format.
        """
        return self._attribute(inputs, target, output)

    def _token_maps(self, inputs: Tensor, target: Tensor | None, **_: Any) -> Tensor:
        layout = self.adapter.layout(inputs)
        maps = []
        for img in inputs:
            crc = zlib.crc32(img.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + crc)
            maps.append(torch.rand(layout.num_tokens, generator=g, dtype=torch.float64))
        return torch.stack(maps).to(device=inputs.device, dtype=inputs.dtype)
