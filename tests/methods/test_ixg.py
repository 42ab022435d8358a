"""The per-layer TokenIxG (input × gradient of block l's input tokens) and the layer gradients
it rests on (SPEC §1.4): fixture parity with the authors' code and the token readout's zero
rows at the last block's output."""

from __future__ import annotations

import pytest
import torch

from captum_vit.adapters import adapt
from captum_vit.methods.ixg import TokenIxG, layer_gradients
from tests.helpers import (
    assert_close_to_reference,
    make_inputs,
    make_model,
)


def test_token_ixg_per_layer_matches_fixture(parity):
    model, x, targets, _, maps, _ = parity
    ref = maps["ixg_per_layer"]  # tolerance relative to the largest entry of all layers
    out = torch.stack([TokenIxG(model, layer=layer).attribute(x, target=targets,
                                                              output="tokens")
                       for layer in range(ref.shape[0])])
    assert_close_to_reference(out, ref, rel=1e-12)


def test_layer_gradients_prefix_entries_match_fixture(parity):
    model, x, targets, _, maps, _ = parity
    lg = layer_gradients(adapt(model), x, targets)
    ixg = lg.ixg()
    assert ixg.shape == (7, 2, 65)
    assert_close_to_reference(ixg[:6, :, 1:], maps["ixg_per_layer"], rel=1e-12)
    assert_close_to_reference(ixg[:6, :, :1], maps["ixg_per_layer_prefix"], rel=1e-12)


@pytest.mark.parametrize("family", ["vit", "distilled", "registers"])
def test_token_ixg_at_last_block_output_is_zero_on_patches(family):
    """Token readout: the head reads only prefix rows of x_L, so patch IxG there is 0."""
    model, x = make_model(family), make_inputs(family, batch=2)
    L = len(model.blocks)
    out = TokenIxG(model, layer=L).attribute(x, target=[1, 2], output="tokens")
    assert torch.equal(out, torch.zeros_like(out))
    assert TokenIxG(model, layer=L - 1).attribute(x, target=[1, 2]).abs().max() > 0
