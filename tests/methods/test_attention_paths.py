"""The speed paths of the attention (issue 42, item 12) equal the paths they replace
(float64 parity, never timing).

- GAE traces the explicit attention when it is small
  (:func:`captum_vit.adapters.parts.small_attention`) and the fused kernel otherwise: both
  give the same maps, on a global-attention ViT and on a windowed Swin.
- A fused attention whose ``q`` and ``k`` are detached (DecompX's linearised trace)
  multiplies probabilities computed without a graph when it is small: its output and the
  gradient reaching ``u`` are those of the fused kernel.
- The size rule itself.
"""

from __future__ import annotations

import pytest
import torch

from captum_vit import GAE, DecompX
from captum_vit.adapters import ViTAdapter, adapt, parts
from tests.helpers import assert_close_scaled, make_inputs, make_model

TARGET = torch.tensor([1, 3])


def test_small_attention_rule():
    assert parts.small_attention(197, 64)  # ViT-S/B at 224 px
    assert parts.small_attention(49, 32)  # a Swin-T window
    assert not parts.small_attention(785, 64)  # ViT-B at 448 px
    # at the bound (SigLIP's 256 patches, width 64): small for TokenTM, not for the maps
    # that need no probabilities and GAE (memory)
    assert parts.small_attention(256, 64)
    assert not parts.small_attention(256, 64, inclusive=False)
    assert parts.small_attention(255, 64, inclusive=False)
    model = make_model("vit")
    ad = adapt(model)
    d = ad.blocks[0].head_dim
    n = ad.layout(make_inputs("vit", 1)).num_tokens
    assert ad.small_attention(make_inputs("vit", 1)) == (n <= parts.SMALL_ATTENTION_KEYS * d)


@pytest.mark.parametrize("family", ["vit", "timm_swin"])
@pytest.mark.parametrize("heads", ["mean", "all"])
def test_gae_explicit_and_fused_traces_agree(family, heads, monkeypatch):
    model = make_model(family)
    x = make_inputs(family, 2)
    maps = {}
    for small in (True, False):
        monkeypatch.setattr(ViTAdapter, "small_attention", lambda self, inputs, s=small, **_: s)
        maps[small] = GAE(model).attribute(x, target=TARGET, heads=heads, output="tokens")
    assert maps[True].abs().max() > 0
    assert_close_scaled(maps[True], maps[False], rel=1e-10)


def _attention_and_grad(p, u, grad_out):
    u = u.detach().requires_grad_()
    with torch.enable_grad():
        mix, _ = p.attention(u, materialize=False, detach_qk=True)
        (g,) = torch.autograd.grad(mix, u, grad_out)
    return mix.detach(), g


@pytest.mark.parametrize("family", ["vit", "timm_swin"])
def test_detached_qk_values_only_backward_equals_fused(family, monkeypatch):
    model = make_model(family)
    ad = adapt(model)
    x = make_inputs(family, 2)
    with torch.no_grad():
        u = torch.nn.functional.layer_norm(ad.embed(x), (ad.blocks[0].norm1.weight.shape[0],),
                                           ad.blocks[0].norm1.weight, ad.blocks[0].norm1.bias,
                                           ad.blocks[0].norm1.eps)
    p = ad.blocks[0]
    n_keys = u.shape[1] if p.window is None else p.window.area
    monkeypatch.setattr(parts, "SMALL_ATTENTION_KEYS", max(1, -(-n_keys // p.head_dim)))
    assert parts._values_only_backward(*(torch.zeros(1, 1, n_keys, p.head_dim)
                                         for _ in range(2)),
                                       torch.zeros(1, 1, n_keys, p.head_dim,
                                                   requires_grad=True), None)
    grad_out = torch.randn(u.shape[0], u.shape[1], p.inner_dim, dtype=u.dtype,
                           generator=torch.Generator().manual_seed(3))
    explicit = _attention_and_grad(p, u, grad_out)
    monkeypatch.setattr(parts, "SMALL_ATTENTION_KEYS", 0)  # the fused kernel
    fused = _attention_and_grad(p, u, grad_out)
    assert_close_scaled(explicit[0], fused[0], rel=1e-12)
    assert_close_scaled(explicit[1], fused[1], rel=1e-12)


@pytest.mark.parametrize("family", ["vit", "timm_swin"])
def test_decompx_gradient_route_same_on_both_attention_paths(family, monkeypatch):
    model = make_model(family)
    x = make_inputs(family, 2)
    maps = {}
    for keys in (10_000, 0):  # every attention small / the fused kernel everywhere
        monkeypatch.setattr(parts, "SMALL_ATTENTION_KEYS", keys)
        maps[keys] = DecompX(model, route="gradient").attribute(x, target=TARGET,
                                                                 output="tokens")
    assert maps[0].abs().max() > 0
    assert_close_scaled(maps[10_000], maps[0], rel=1e-10)
