"""FullGrad+ (Eq. 5-6 of SkipPLUS): float64, the map is a sum over blocks (each block's
token IxG and bias-gradient terms), so the maps of single blocks add up to the map of
several and SkipPLUS's range is the last ⌈L/2⌉ blocks; a batch gives each image's map
alone. Its reference through hooks on timm's own modules is in tests/methods/test_plus.py."""

from __future__ import annotations

import pytest
import torch

from captum_vit.combinators import FullGradPlus
from tests.helpers import make_inputs, make_model

TARGETS = torch.tensor([1, 4, 0])


@pytest.mark.parametrize("family", ["vit", "layerscale", "avgpool"])
def test_single_blocks_add_up_and_skip_is_the_last_half(family):
    model, x = make_model(family, depth=4), make_inputs(family, batch=3)
    per_block = [FullGradPlus(model, layers=[l]).attribute(x, TARGETS, output="tokens")
                 for l in range(4)]
    full = FullGradPlus(model).attribute(x, TARGETS, output="tokens")
    assert full.dtype == torch.float64
    torch.testing.assert_close(full, sum(per_block), rtol=0, atol=1e-12)
    skip = FullGradPlus(model, skip=True).attribute(x, TARGETS, output="tokens")
    torch.testing.assert_close(skip, per_block[2] + per_block[3], rtol=0, atol=1e-12)
    assert (full - skip).abs().max() > 1e-6  # the first blocks do contribute


def test_batch_equals_images_one_by_one():
    model, x = make_model("registers"), make_inputs("registers", batch=3)
    method = FullGradPlus(model, head_biases=True)
    batch = method.attribute(x, TARGETS, output="tokens")
    alone = torch.cat([method.attribute(x[i:i + 1], TARGETS[i:i + 1], output="tokens")
                       for i in range(3)])
    torch.testing.assert_close(batch, alone, rtol=0, atol=1e-12)
