"""RawAttention, Rollout, GAE, AttnGradCAM: fixture parity, a slow reference from SPEC
§1 on every model family, batch invariance and output formats."""

from __future__ import annotations

import pytest
import torch

from captum_vit import GAE, AttnGradCAM, RawAttention, Rollout
from tests.helpers import (
    FAMILIES,
    ReferenceCapture,
    assert_close_to_reference,
    make_inputs,
    make_model,
)

pytestmark = pytest.mark.lower_bounds  # also run against the oldest supported versions

METHODS = {
    "raw_attention": lambda m: RawAttention(m),
    "rollout": lambda m: Rollout(m),
    "rollout1": lambda m: Rollout(m, start_layer=1),
    "gae": lambda m: GAE(m),
    "attn_gradcam": lambda m: AttnGradCAM(m),
}


@pytest.mark.parametrize("key,make", [
    ("raw_attention", lambda m: RawAttention(m)),
    ("rollout_start0", lambda m: Rollout(m)),
    ("rollout_start1", lambda m: Rollout(m, start_layer=1)),
    ("gae", lambda m: GAE(m)),
])
def test_parity_with_authors_code(parity, key, make):
    model, x, targets, _, maps, _ = parity
    out = make(model).attribute(x, target=targets, output="tokens")
    assert out.dtype == torch.float64
    assert_close_to_reference(out, maps[key], rel=1e-12)


def test_start_layer_override_matches_constructor(parity):
    model, x, targets, _, maps, _ = parity
    out = Rollout(model).attribute(x, target=targets, start_layer=1, output="tokens")
    assert_close_to_reference(out, maps["rollout_start1"], rel=1e-12)


# --- slow reference written from SPEC §1 (explicit loops, full N x N matrices) -------------

def _readout_row(model, mat):
    """SPEC §0: row 0 for CLS / distilled models, mean of patch rows for avg-pool."""
    k = model.num_prefix_tokens
    if model.global_pool == "avg":
        return mat[k:].mean(0)
    return mat[0]


def reference_maps(model, x, target):
    refs = ReferenceCapture(model)
    logits = refs(x)
    score = logits[torch.arange(len(x)), target].sum()
    score.backward()
    k = model.num_prefix_tokens
    out = {m: [] for m in ("raw_attention", "rollout", "rollout1", "gae", "attn_gradcam")}
    for b in range(len(x)):
        attn = [a[b].detach() for a in refs.attn]
        grad = [a.grad[b] for a in refs.attn]
        n, heads = attn[0].shape[-1], attn[0].shape[0]
        eye = torch.eye(n, dtype=x.dtype)
        out["raw_attention"].append(_readout_row(model, sum(attn[-1]) / heads))
        for name, start in (("rollout", 0), ("rollout1", 1)):
            joint = eye.clone()
            for a in attn[start:]:
                m = sum(a) / heads + eye
                m = m / m.sum(-1, keepdim=True)
                joint = m @ joint
            out[name].append(_readout_row(model, joint))
        rel = eye.clone()
        for a, g in zip(attn, grad, strict=True):
            abar = sum(torch.relu(g[h] * a[h]) for h in range(heads)) / heads
            rel = rel + abar @ rel
        out["gae"].append(_readout_row(model, rel))
        a, g = attn[-1], grad[-1]
        cam = torch.zeros(n, dtype=x.dtype)
        for h in range(heads):
            w = _readout_row(model, g[h])[k:].mean()
            cam += w * _readout_row(model, a[h])
        out["attn_gradcam"].append(torch.relu(cam / heads))
    return {key: torch.stack(v)[:, k:] for key, v in out.items()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_matches_slow_reference_on_every_family(family):
    model = make_model(family)
    x = make_inputs(family, batch=2)
    target = torch.tensor([1, 3])
    ref = reference_maps(model, x, target)
    for name, make in METHODS.items():
        out = make(model).attribute(x, target=target, output="tokens")
        assert_close_to_reference(out, ref[name], rel=1e-10)


def test_class_sensitive_methods_depend_on_target():
    model = make_model("vit")
    x = make_inputs("vit", batch=1)
    for cls in (GAE, AttnGradCAM):
        a = cls(model).attribute(x, target=0, output="tokens")
        b = cls(model).attribute(x, target=1, output="tokens")
        assert not torch.allclose(a, b)


def test_probability_score_differs_from_logit():
    model = make_model("vit")
    x = make_inputs("vit", batch=2)
    a = GAE(model).attribute(x, target=1, output="tokens")
    b = GAE(model).attribute(x, target=1, score="probability", output="tokens")
    assert not torch.allclose(a, b)


def test_float32_and_fused_attention_model():
    model = make_model("vit", dtype=torch.float32)
    assert all(blk.attn.fused_attn for blk in model.blocks)  # timm's default: SDPA
    x = make_inputs("vit", batch=2, dtype=torch.float32)
    ref = reference_maps(model.double(), x.double(), torch.tensor([0, 1]))
    model.float()
    for name, make in METHODS.items():
        out = make(model).attribute(x, target=[0, 1], output="tokens")
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref[name], rtol=1e-3, atol=1e-5)


