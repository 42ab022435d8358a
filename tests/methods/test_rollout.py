"""Rollout (SPEC §1.2): the streamed vector chain equals the full matrix chain
R = M_{L-1} ... M_s of row-normalised (mean-head attention + I) written here (float64, every
timm family, both start layers). Fixture parity and the slow reference through timm's own
forward: tests/methods/test_attention_methods.py."""

from __future__ import annotations

import pytest
import torch

from captum_vit import Rollout
from captum_vit._base import readout_rows
from captum_vit.adapters import adapt
from tests.helpers import (
    FAMILIES,
    assert_close_to_reference,
    make_inputs,
    make_model,
)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("start", [0, 1])
def test_rollout_vector_chain_equals_matrix_chain(family, start):
    model, x = make_model(family), make_inputs(family, batch=2)
    ad = adapt(model)
    tr = ad.trace(x)
    n = tr.x0.shape[1]
    eye = torch.eye(n, dtype=x.dtype)
    joint = eye.expand(x.shape[0], n, n)
    for rec in tr.blocks[start:]:  # R = M_{L-1} ... M_s, full N x N products
        m = rec.attn.mean(1) + eye
        joint = (m / m.sum(-1, keepdim=True)) @ joint
    ref = torch.einsum("bn,bnm->bm", readout_rows(tr), joint)[:, tr.layout.num_prefix:]
    out = Rollout(model, start_layer=start).attribute(x, output="tokens")
    assert_close_to_reference(out, ref, rel=1e-12)
