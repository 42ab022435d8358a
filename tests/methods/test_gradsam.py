"""Grad-SAM (SPEC_NEXT §8.4) against slow float64 references written here from the spec:
timm's own forward with every attention probability and its gradient kept (the reference of
tests/methods/test_vanilla.py), the single-layer maps against the adapter's trace, and one
block's Grad-SAM against GAE less the readout."""

from __future__ import annotations

import pytest
import torch

from captum_vit import GAE
from captum_vit._base import gradients_with_pool, readout, readout_rows, target_scores
from captum_vit.adapters import adapt
from captum_vit.methods.gradsam import GradSAM
from tests.helpers import make_inputs, make_model
from tests.methods import test_vanilla
from tests.methods.test_vanilla import ATOL, gradsam_ref

# the module-scoped fixture: each family's model, inputs, targets and slow reference
case = test_vanilla.case


@pytest.mark.parametrize("layers", [None, [1], range(1, 3), (2, 0)])
def test_gradsam_matches_reference(case, layers):
    model, x, t, ref, k = case
    got = GradSAM(model, layers=layers).attribute(x, t, output="tokens")
    use = range(len(model.blocks)) if layers is None else layers
    torch.testing.assert_close(got, gradsam_ref(ref, use)[:, k:], rtol=0, atol=ATOL)
    mean = GradSAM(model, layers=layers, average=True).attribute(x, t, output="tokens")
    torch.testing.assert_close(mean, got / len(use), rtol=0, atol=ATOL)


@pytest.mark.parametrize("family", ["vit", "map", "beit", "hf_vit"])
def test_gradsam_single_layer_is_the_genatt_readout(family):
    """GradSAM(layers=[l]) = w Ā_l with Ā_l = mean_h ReLU(∇A_l ⊙ A_l) from the adapter's
    trace, and the full GradSAM is the sum of its single-layer maps (PLUS by layers)."""
    if family == "hf_vit":
        pytest.importorskip("transformers")
    model, x = make_model(family), make_inputs(family, batch=2)
    a = adapt(model)
    t = torch.tensor([3, 1])
    tr = a.trace(x, grad=True)
    attns = [rec.attn for rec in tr.blocks]
    grads, pool_grad = gradients_with_pool(tr, target_scores(tr.logits, t), attns)
    w = readout_rows(tr, pool_grad, target=t)
    total = 0
    for l in range(a.num_blocks):
        abar = (grads[l] * attns[l].detach()).clamp(min=0).mean(1)
        want = readout(w, abar)[:, a.num_prefix:]
        got = GradSAM(model, layers=[l]).attribute(x, t, output="tokens")
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=ATOL)
        total = total + got
    torch.testing.assert_close(GradSAM(model).attribute(x, t, output="tokens"), total,
                               rtol=0, atol=ATOL)


@pytest.mark.parametrize("family", ["vit", "beit"])
def test_gradsam_of_one_block_is_gae_less_the_readout(family):
    """With one block GAE is ``w (I + Ā_0) = w + GradSAM``: equal on patches for a class
    token (w = e_0), and off by the uniform ``1/P`` for average pooling."""
    model, x = make_model(family, depth=1), make_inputs(family, batch=2)
    k = adapt(model).num_prefix
    t = torch.tensor([4, 2])
    gae = GAE(model).attribute(x, t, output="tokens")
    gs = GradSAM(model).attribute(x, t, output="tokens")
    offset = 0.0 if family == "vit" else 1.0 / (x.shape[-1] // 8 * x.shape[-2] // 8)
    assert k >= 1
    torch.testing.assert_close(gae - offset, gs, rtol=0, atol=ATOL)
