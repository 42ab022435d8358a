"""Issue 42 items the front owns: an all-zero map because the score is flat is not silent
(item 4), and a video model's shape errors say what the user passed and the fix."""

from __future__ import annotations

import warnings

import pytest
import torch

from captum_vit import GAE, DecompX, Rollout, TokenIxG
from tests.helpers import (
    assert_unchanged,
    have_torchvision,
    have_transformers,
    make_inputs,
    make_model,
    make_torchvision_model,
    make_video_model,
    snapshot,
)


def _zero_head(model):
    """torchvision's ``vit_b_16(weights=None)`` zero-initialises ``heads.head``."""
    with torch.no_grad():
        model.heads.head.weight.zero_()
        model.heads.head.bias.zero_()
    return model


@pytest.mark.skipif(not have_torchvision(), reason="torchvision not installed")
@pytest.mark.parametrize("method", [TokenIxG, GAE, DecompX])
def test_a_flat_score_warns_and_says_why(method):
    model = _zero_head(make_torchvision_model())
    x = make_inputs("torchvision", batch=2)
    before = snapshot(model)
    with pytest.warns(UserWarning, match=r"exactly zero for 2 images.*gradient is zero"):
        attr = method(model).attribute(x, target=[0, 1], output="tokens")
    assert bool((attr == 0).all())
    assert_unchanged(model, before)


def test_no_warning_when_the_score_has_a_gradient():
    model = make_model("vit")
    x = make_inputs("vit", batch=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for method in (TokenIxG, GAE, Rollout):
            method(model).attribute(x, target=[0, 1], output="tokens")


def test_a_zero_map_with_a_gradient_is_not_blamed_on_the_score(monkeypatch):
    """A map that is zero for the method's own reasons (a rectified CAM whose every value
    was negative) passes silently: the check looks at the score's gradient."""
    model = make_model("vit")
    x = make_inputs("vit", batch=2)
    method = TokenIxG(model)
    monkeypatch.setattr(type(method), "_token_maps",
                        lambda self, inputs, target, **_: torch.zeros(
                            inputs.shape[0], self.adapter.layout(inputs).num_tokens,
                            dtype=inputs.dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attr = method.attribute(x, target=[0, 1], output="tokens")
    assert bool((attr == 0).all())


@pytest.mark.skipif(not have_transformers(), reason="transformers not installed")
def test_video_models_name_the_layout_they_need():
    model = make_video_model()
    video = make_inputs("hf_videomae", batch=2)  # [B, T, C, H, W]
    before = snapshot(model)
    images = video[:, 0]  # a batch of images [B, C, H, W]
    with pytest.raises(ValueError, match=r"batch of images \[B, C, H, W\] is not a video"):
        GAE(model).attribute(images)
    with pytest.raises(ValueError, match=r"channels before frames.*permute\(0, 2, 1, 3, 4\)"):
        GAE(model).attribute(video.permute(0, 2, 1, 3, 4).contiguous())
    assert_unchanged(model, before)
