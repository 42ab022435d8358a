"""TAM (SPEC_NEXT §8.9) without the integration, against the closed form from timm's own
gradient (float64). TAM's integrated form is checked with BT-H / BT-T against the slow
references of tests/methods/test_bt.py, which share its attention chain."""

from __future__ import annotations

import torch

from captum_vit import TAM
from tests.helpers import ReferenceCapture, make_inputs
from tests.methods.test_bt import DEPTH, TARGETS, close, model_of


def test_tam_plain_gradient_closed_form():
    """integrated=False: ω = w · mean_h ReLU(∇A_{L-1}(X)) from the one backward at X; it
    equals the single-step limit of nothing else, so compare with timm's own gradient."""
    model, x = model_of("vit"), make_inputs("vit")
    refs = ReferenceCapture(model)
    refs(x).gather(1, TARGETS[:, None]).sum().backward()
    a = [z.detach() for z in refs.attn]
    omega = refs.attn[-1].grad.clamp(min=0).mean(1)[:, 0]
    sigma = a[-1].mean(1)[:, 0]
    for i in reversed(range(2, DEPTH - 1)):
        sigma = sigma + torch.einsum("bn,bnm->bm", sigma, a[i].mean(1))
    got = TAM(model, start_layer=2, integrated=False).attribute(x, TARGETS, output="tokens")
    close(got, (sigma * omega)[:, 1:])
