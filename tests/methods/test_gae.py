"""GAE (SPEC §1.3) on the streamed fused-attention trace equals its recursion
v <- v + v mean_h ReLU(∇A_l ⊙ A_l) written here on an explicit trace (every [B, H, N, N]
kept, autograd through the explicit softmax), float64. Fixture parity and the slow
reference through timm's own forward: tests/methods/test_attention_methods.py."""

from __future__ import annotations

import pytest
import torch

from captum_vit import GAE
from captum_vit._base import readout_rows
from tests.helpers import (
    assert_close_to_reference,
    make_inputs,
    make_model,
)
from tests.methods.test_fast_paths import TARGET, _explicit


@pytest.mark.parametrize("family", ["vit", "avgpool", "layerscale", "distilled", "registers",
                                    "nonsquare"])
def test_gae_streamed_equals_explicit_trace(family):
    model, x = make_model(family), make_inputs(family, batch=2)
    _, tr, grads = _explicit(model, x)
    w = readout_rows(tr)
    v = w
    for rec, g in zip(reversed(tr.blocks), reversed(grads), strict=True):
        abar = (g * rec.attn.detach()).clamp(min=0).mean(1)
        v = v + torch.einsum("bn,bnm->bm", v, abar)
    out = GAE(model).attribute(x, target=TARGET, output="tokens")
    assert_close_to_reference(out, v.detach()[:, tr.layout.num_prefix:], rel=1e-12)
