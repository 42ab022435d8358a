"""Helpers shared by the tests of the Hugging Face video families (VideoMAE, ViViT, V-JEPA 2):
their catalogue examples take 16 x 16 frames."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from captum_vit.adapters import catalog
from captum_vit.registry import build_method
from tests.contract.test_contract import FAST
from tests.helpers import assert_close_scaled, assert_unchanged, make_model, snapshot


def example_model(family: str, **overrides) -> nn.Module:
    """The catalogue's example ``family`` with config ``overrides``."""
    return catalog.example(family)[1].model(**overrides)


def video(batch: int = 2, frames: int = 4, seed: int = 1) -> torch.Tensor:
    """A float64 video batch [B, T, 3, 16, 16] of ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, frames, 3, 16, 16, generator=g, dtype=torch.float64)


def assert_video_refusals(family: str, size_field: str, frame_errors: dict[int, str]) -> None:
    """GAE on the example ``family`` refuses, by name and leaving the model unchanged: the
    frame counts of ``frame_errors`` (each with its message pattern), a video [B, T, C, H,
    W] passed as [B, C, T, H, W] (naming the permutation back), its first frames as images,
    and 24 x 24 frames (naming the configuration's ``size_field``)."""
    model = make_model(family)
    before = snapshot(model)
    gae = build_method("gae", model)
    for frames, match in frame_errors.items():
        with pytest.raises(ValueError, match=match):
            gae.attribute(video(frames=frames), target=0)
    x = video()
    with pytest.raises(ValueError, match=r"\[B, C, T, H, W\].*permute\(0, 2, 1, 3, 4\)"):
        gae.attribute(x.permute(0, 2, 1, 3, 4).contiguous(), target=0)
    with pytest.raises(ValueError, match=r"images \[B, C, H, W\] is not a video"):
        gae.attribute(x[:, 0], target=0)
    with pytest.raises(ValueError, match=rf"frame size \(24, 24\).*{size_field}"):
        gae.attribute(torch.zeros(1, 4, 3, 24, 24, dtype=torch.float64), target=0)
    assert_unchanged(model, before)


def assert_one_slice_twin_maps(name: str, model: nn.Module, twin: nn.Module,
                               twin_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Method ``name`` (the contract suite's fast options) gives a one-slice video
    (T = t = 1) of ``model`` the maps of its frame under the image ``twin``, tokens and
    pixels, to 1e-10 of the map's largest magnitude (of ``twin_logits``' for a
    rounding-sized map); RISE and ViT-CX run on the twin with ``removal="tokens"`` (they
    mask tubelets on videos). ``model`` stays unchanged."""
    x = video(frames=1)
    before = snapshot(model)
    kw = dict(FAST.get(name, {}))
    if name in ("rise", "vit_cx"):
        kw["removal"] = "tokens"
    ours = build_method(name, model).attribute(x, target=[1, 3], output="tokens", **kw)
    ref = build_method(name, twin).attribute(x[:, 0], target=[1, 3], output="tokens", **kw)
    assert ours.shape == ref.shape == (2, 4)
    scale = None if ref.abs().max() > 1e-10 else twin_logits(x[:, 0]).abs().max().item()
    assert_close_scaled(ours, ref, rel=1e-10, scale=scale, msg=name)
    pixels = build_method(name, model).attribute(x, target=[1, 3], **kw)
    ref_pixels = build_method(name, twin).attribute(x[:, 0], target=[1, 3], **kw)
    assert pixels.shape == x.shape
    assert_close_scaled(pixels[:, 0], ref_pixels, rel=1e-10, scale=scale, msg=name)
    assert_unchanged(model, before)
