"""Helpers shared by the tests of the Hugging Face video families (VideoMAE, ViViT, V-JEPA 2):
their catalogue examples take 16 x 16 frames."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from captum_vit.adapters import catalog


def example_model(family: str, **overrides) -> nn.Module:
    """The catalogue's example ``family`` with config ``overrides``."""
    return catalog.example(family)[1].model(**overrides)


def video(batch: int = 2, frames: int = 4, seed: int = 1) -> torch.Tensor:
    """A float64 video batch [B, T, 3, 16, 16] of ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, frames, 3, 16, 16, generator=g, dtype=torch.float64)


def assert_refuses_other_layouts(method, x: torch.Tensor) -> None:
    """``method`` refuses the video ``x`` [B, T, C, H, W] as [B, C, T, H, W] (naming the
    permutation back) and its first frames as images, by name."""
    with pytest.raises(ValueError, match=r"\[B, C, T, H, W\].*permute\(0, 2, 1, 3, 4\)"):
        method.attribute(x.permute(0, 2, 1, 3, 4).contiguous(), target=0)
    with pytest.raises(ValueError, match=r"images \[B, C, H, W\] is not a video"):
        method.attribute(x[:, 0], target=0)
