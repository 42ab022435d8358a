"""RawAttention (SPEC §1.1): the readout row of the last block's mean-head attention, read from the
adapter's trace and written here as one product (float64). Fixture parity and the slow
reference through timm's own forward: tests/methods/test_attention_methods.py."""

from __future__ import annotations

import pytest
import torch

from captum_vit import RawAttention
from captum_vit._base import readout_rows
from captum_vit.adapters import adapt
from tests.helpers import (
    assert_close_scaled,
    make_inputs,
    make_model,
)


@pytest.mark.parametrize("family", ["vit", "avgpool", "layerscale", "registers"])
def test_raw_attention_streams_the_last_block(family):
    model, x = make_model(family), make_inputs(family, batch=2)
    tr = adapt(model).trace(x)
    ref = torch.einsum("bn,bnm->bm", readout_rows(tr), tr.blocks[-1].attn.mean(1))
    out = RawAttention(model).attribute(x, output="tokens")
    # the same product written another way (another einsum, a streamed trace): last bits
    assert_close_scaled(out, ref[:, tr.layout.num_prefix:])
