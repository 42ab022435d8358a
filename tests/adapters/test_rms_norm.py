"""RMSNorm in the engine (:class:`~captum_vit.adapters.parts.NormParts` with ``rms=True``):
its forward against references written here and against the models' own modules, its
frozen-scale rule, and the decompositions through it on a tiny model whose blocks normalise
with RMSNorm (the Qwen2.5-VL vision tower, float64, RMSNorm computed in float32 as the
model does): DecompX complete, CP-LRP and AttnLRP(attention="cp") conservative without
biases."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

from captum_vit import CPLRP, AttnLRP, DecompX, EmbeddingTarget
from captum_vit.adapters import adapt
from captum_vit.adapters.ops import Ops
from captum_vit.adapters.parts import NormParts, rms_norm_parts

transformers = pytest.importorskip("transformers")

TOWER = "Qwen2_5_VisionTransformerPretrainedModel"


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=tol * (1 + b.abs().max().item()))


def states(seed: int = 0, shape: tuple[int, ...] = (2, 5, 8)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return 3 * torch.randn(*shape, generator=g, dtype=torch.float64)


def rms_reference(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x²) + eps) · w``, written out per token."""
    out = torch.empty_like(x)
    for idx in itertools.product(*(range(n) for n in x.shape[:-1])):
        v = x[idx]
        out[idx] = v / torch.sqrt((v * v).sum() / v.numel() + eps)
    return out if w is None else out * w


def test_forward_equals_the_reference_and_torchs_rms_norm():
    x = states()
    w = torch.linspace(0.5, 2.0, 8, dtype=torch.float64)
    m = nn.RMSNorm(8, eps=1e-5, dtype=torch.float64)
    with torch.no_grad():
        m.weight.copy_(w)
    p = rms_norm_parts(m, "norm")
    assert p.rms and p.bias is None and p.compute_dtype is None
    close(p(x), rms_reference(x, w, 1e-5), 1e-15)
    close(Ops().norm(x, p), m(x), 1e-15)
    close(Ops(linearize=True).norm(x, p), m(x), 1e-15)  # the frozen rule's value
    with pytest.raises(TypeError, match="norm is LayerNorm; captum_vit supports RMSNorm"):
        rms_norm_parts(nn.LayerNorm(8), "norm")


def test_float32_rounding_matches_the_models_rms_norm():
    """Qwen2.5-VL's RMSNorm casts a float64 input to float32 and back before its weight:
    the canonical norm does the same (equal to 1e-15, where the float64 norm is 1e-8
    away), and the frozen rule's value ``x · frozen_scale(x)`` is the model's too."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRMSNorm

    m = Qwen2_5_VLRMSNorm(8, eps=1e-6).double()
    with torch.no_grad():
        m.weight.copy_(torch.linspace(-1.0, 2.0, 8))
    x = states(1)
    x[0, 0, 3] = 0.0  # a zero channel: its frozen scale falls back to 1/σ
    p = rms_norm_parts(m, "norm1", torch.float32)
    want = m(x)
    close(p(x), want, 1e-15)
    exact = rms_reference(x, m.weight.detach(), 1e-6)
    assert (exact - want).abs().max() > 1e-9  # the rounding the parity has to match
    close(p(x, frozen=True), want, 1e-15)
    s = p.frozen_scale(x)
    assert s.shape == x.shape
    close(x * s * m.weight.detach(), want, 1e-15)


@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_frozen_rule_gradient_is_the_frozen_scale(dtype):
    """With the scale frozen the norm is linear in ``x``: the input gradient of
    ``<g, y>`` is ``g · w · s`` (no centring term, unlike the LayerNorm rule)."""
    x = states(2).requires_grad_()
    w = torch.linspace(0.5, 2.0, 8, dtype=torch.float64)
    p = NormParts(w, None, 1e-6, rms=True, compute_dtype=dtype)
    g = states(3)
    (Ops(linearize=True).norm(x, p) * g).sum().backward()
    scale = 1 / torch.sqrt(x.detach().pow(2).mean(-1, keepdim=True) + 1e-6)
    close(x.grad, g * w * scale, 1e-6 if dtype is not None else 1e-15)


_TOWERS: dict[bool, nn.Module] = {}


def tower(zero_biases: bool = False) -> nn.Module:
    from captum_vit.adapters.families.hf_qwen_vl import qwen_tower_example

    if zero_biases not in _TOWERS:
        model = qwen_tower_example(TOWER)()
        if zero_biases:
            model = copy.deepcopy(model)
            with torch.no_grad():
                for name, prm in model.named_parameters():
                    if name.endswith("bias"):
                        prm.zero_()
        _TOWERS[zero_biases] = model
    return _TOWERS[zero_biases]


def inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(4)
    return torch.randn(2, 3, 16, 24, generator=g, dtype=torch.float64)


def target(model: nn.Module) -> tuple[EmbeddingTarget, torch.Tensor]:
    """A dot-product target and its score from the adapter's own embedding."""
    g = torch.Generator().manual_seed(5)
    t = torch.randn(2, 32, generator=g, dtype=torch.float64)
    with torch.no_grad():
        e = adapt(model).model_outputs(inputs())
    return EmbeddingTarget(t, index=[0, 1], similarity="dot"), (e * t).sum(-1)


def test_decompx_is_complete_through_rms_norm():
    """Tokens plus the bias source equal the score (both routes), though every RMSNorm
    rounds to float32: its frozen scale carries the rounding."""
    model = tower()
    spec, score = target(model)
    for route in ("explicit", "gradient"):
        res = DecompX(model, route=route).decompose(inputs(), spec)
        close(res.logit, score, 1e-12)
        close(res.tokens.sum(-1) + res.bias, score, 1e-10)


def test_lrp_is_conservative_through_rms_norm():
    """Without biases CP-LRP and AttnLRP(attention="cp") (RMSNorm's frozen rule, SwiGLU's
    gate, windows) sum to the score; with biases CP-LRP's tokens plus DecompX's bias
    source are the score."""
    model = tower(zero_biases=True)
    spec, score = target(model)
    for method in (CPLRP(model), AttnLRP(model, attention="cp")):
        total = method.attribute(inputs(), target=spec, output="tokens").sum(-1)
        close(total, score, 1e-10)
    model = tower()
    spec, score = target(model)
    res = DecompX(model).decompose(inputs(), spec)
    total = CPLRP(model).attribute(inputs(), target=spec, output="tokens").sum(-1)
    close(total + res.bias, score, 1e-10)
