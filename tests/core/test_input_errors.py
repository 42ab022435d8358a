"""Errors at the front that name the fix: grayscale inputs (expand to 3 channels), a model
inside a wrapper (the hint is valid Python that reaches the ViT), non-tensor inputs (numpy,
PIL, lists, a processor's output, dicts)."""

from __future__ import annotations

from collections import UserDict

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from captum_vit import GAE
from tests.helpers import make_inputs, make_model


# -- errors that name the fix -----------------------------------------------------------------
def test_grayscale_inputs_error_names_the_fix():
    model = make_model()
    gray = make_inputs(batch=1)[:, :1]
    with pytest.raises(ValueError) as info:
        GAE(model).attribute(gray)
    message = str(info.value)
    assert "1 channel (grayscale)" in message and "expects 3 channels" in message
    assert "expand(-1, 3, -1, -1)" in message and "repeat(1, 3, 1, 1)" in message
    assert "1-channel" in message
    GAE(model).attribute(gray.expand(-1, 3, -1, -1))  # the fix works


def test_wrapper_hint_is_valid_python():
    vit = make_model()
    for wrapper, path in [
        (nn.Sequential(nn.Identity(), vit), "model[1]"),
        (nn.Sequential(nn.ModuleDict({"back-bone": nn.Sequential(vit)})),
         "model[0]['back-bone'][0]"),
    ]:
        with pytest.raises(TypeError) as info:
            GAE(wrapper)
        message = str(info.value)
        assert f"`{path}`" in message and f"GAE({path})" in message
        assert eval(path, {"model": wrapper}) is vit  # noqa: S307 - the hint runs as written


class BatchFeature(UserDict):
    """Stands in for transformers' BatchFeature (a UserDict of tensors)."""


@pytest.mark.parametrize("inputs,fix", [
    (np.zeros((1, 3, 32, 32), np.float32), "torch.from_numpy"),
    (Image.new("RGB", (32, 32)), "preprocess"),
    ([torch.zeros(3, 32, 32), torch.zeros(3, 32, 32)], "torch.stack"),
    # a processor's output stands for its pixel_values (checked as such)
    (BatchFeature(pixel_values=np.zeros((1, 3, 32, 32), np.float32)), "torch.from_numpy"),
    ({"images": torch.zeros(1, 3, 32, 32)}, "the image tensor [B, C, H, W] it holds"),
    ([[0.0]], "[B, C, H, W]"),
])
def test_non_tensor_inputs_get_a_type_error_with_the_fix(inputs, fix):
    with pytest.raises(TypeError, match="inputs must be a torch.Tensor") as info:
        GAE(make_model()).attribute(inputs)
    assert fix in str(info.value)
