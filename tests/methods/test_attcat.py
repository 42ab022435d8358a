"""AttCAT (SPEC §1.4) and AttIxG, whose layers it sums: fixture parity, a slow reference
through timm's own forward on every family, and the front-end guarantees."""

from __future__ import annotations

import pytest
import torch

from captum_vit.adapters import adapt
from captum_vit.methods.attcat import AttCAT
from captum_vit.methods.ixg import AttIxG, TokenIxG, layer_gradients
from tests.helpers import (
    FAMILIES,
    ReferenceCapture,
    assert_close_to_reference,
    make_inputs,
    make_model,
)

# --- fixture parity -------------------------------------------------------------------------


def test_attcat_matches_authors_code(parity):
    model, x, targets, _, maps, _ = parity
    out = AttCAT(model).attribute(x, target=targets, output="tokens")
    assert out.dtype == torch.float64
    assert_close_to_reference(out, maps["attcat"], rel=1e-12)


def test_att_ixg_layers_sum_to_attcat(parity):
    model, x, targets, _, maps, _ = parity
    total = sum(AttIxG(model, layer=l).attribute(x, target=targets, output="tokens")
                for l in range(6))
    assert_close_to_reference(total, maps["attcat"], rel=1e-12)


# --- slow reference from SPEC §1.4 through timm's own forward --------------------------------

def reference_layers(model, x, target, score="logit"):
    """(cat_l, alpha_l) per block [L, B, N] with explicit loops over tokens and heads."""
    refs = ReferenceCapture(model)
    logits = refs(x)
    s = logits.softmax(-1) if score == "probability" else logits
    s[torch.arange(len(x)), target].sum().backward()
    cats, alphas = [], []
    with torch.no_grad():
        for xl, a in zip(refs.block_inputs, refs.attn, strict=True):
            b, heads, n, _ = a.shape
            cat = torch.zeros(b, n, dtype=x.dtype)
            alpha = torch.zeros(b, n, dtype=x.dtype)
            for i in range(b):
                for j in range(n):
                    cat[i, j] = (xl[i, j] * xl.grad[i, j]).sum()
                    alpha[i, j] = sum(a[i, h, :, j].sum() for h in range(heads)) / (heads * n)
            cats.append(cat)
            alphas.append(alpha)
    return torch.stack(cats), torch.stack(alphas)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_attcat_and_per_layer_match_slow_reference(family):
    model, x = make_model(family), make_inputs(family, batch=2)
    target = torch.tensor([2, 4])
    cats, alphas = reference_layers(model, x, target)
    k = model.num_prefix_tokens
    out = AttCAT(model).attribute(x, target=target, output="tokens")
    assert_close_to_reference(out, (alphas * cats).sum(0)[:, k:], rel=1e-12)
    lg = layer_gradients(adapt(model), x, target)
    assert_close_to_reference(lg.ixg()[:-1], cats, rel=1e-12)
    assert_close_to_reference(lg.attention_received(), alphas, rel=1e-12)
    layer = model.blocks.__len__() - 1
    one = AttIxG(model, layer=layer).attribute(x, target=target, output="tokens")
    assert_close_to_reference(one, (alphas * cats)[layer][:, k:], rel=1e-12)


def test_probability_score_matches_reference():
    model, x = make_model("avgpool"), make_inputs("avgpool", batch=2)
    target = torch.tensor([0, 1])
    cats, alphas = reference_layers(model, x, target, score="probability")
    out = AttCAT(model).attribute(x, target=target, score="probability", output="tokens")
    assert_close_to_reference(out, (alphas * cats).sum(0), rel=1e-12)
    logit = AttCAT(model).attribute(x, target=target, output="tokens")
    assert (out - logit).abs().max() > 1e-3 * logit.abs().max()


# --- behaviour ------------------------------------------------------------------------------

def test_float32_and_bfloat16():
    m32 = make_model("vit", dtype=torch.float32)
    x = make_inputs("vit", batch=2)
    out32 = AttCAT(m32).attribute(x.float(), target=[1, 2], output="tokens")
    out64 = AttCAT(make_model("vit")).attribute(x, target=[1, 2], output="tokens")
    assert out32.dtype == torch.float32
    assert_close_to_reference(out32.double(), out64, rel=1e-4)
    mbf = make_model("vit", dtype=torch.bfloat16)
    outbf = AttCAT(mbf).attribute(x.bfloat16(), target=[1, 2], output="tokens")
    assert outbf.dtype == torch.float32 and torch.isfinite(outbf).all()


def test_bad_layers_and_scores_raise_clear_errors():
    model = make_model("vit")  # 3 blocks
    for bad in (-1, 4):
        with pytest.raises(ValueError, match=r"layer must be in \[0, 3\]"):
            TokenIxG(model, layer=bad)
    for bad in (-1, 3):
        with pytest.raises(ValueError, match=r"layer must be in \[0, 2\]"):
            AttIxG(model, layer=bad)
    for cls in (TokenIxG, AttIxG):
        for bad in (1.0, "1", True, None):
            with pytest.raises(TypeError, match="layer must be an int"):
                cls(model, layer=bad)
    x = make_inputs("vit", batch=1)
    for method in (AttCAT(model), TokenIxG(model), AttIxG(model)):
        with pytest.raises(ValueError, match="score"):
            method.attribute(x, score="softmax")
