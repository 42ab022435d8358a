"""The speed paths of the attention (issue 42, item 12) equal the paths they replace
(float64 parity, never timing).

- GAE traces the explicit attention when it is small
  (:func:`captum_vit.adapters.parts.small_attention`) and the fused kernel otherwise: both
  give the same maps, on a global-attention ViT and on a windowed Swin.
- A fused attention whose ``q`` and ``k`` are detached (DecompX's linearised trace)
  multiplies probabilities computed without a graph when it is small: its output and the
  gradient reaching ``u`` are those of the fused kernel.
- DecompX's linearised attention sends the gradient through ``v`` only: timm's fused
  ``qkv`` product is differentiated through ``v``'s rows alone, and a large attention
  recomputes its probabilities in the backward a chunk of query rows at a time; both equal
  a hand-written attention with ``q`` and ``k`` detached, and the backward's products are
  counted.
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


def _hand_attention_grad(ad, u, grad_out):
    """Reference: block 0's attention mix of a timm ViT with ``q`` and ``k`` detached,
    written out from its fused ``qkv`` weight, and the gradient at ``u``."""
    attn = ad.model.blocks[0].attn
    h = attn.num_heads
    u = u.detach().requires_grad_()
    b, n, dim = u.shape
    qkv = (u @ attn.qkv.weight.T + attn.qkv.bias).reshape(b, n, 3, h, dim // h)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    probs = torch.softmax(q.detach() @ k.detach().transpose(-2, -1) * (dim // h) ** -0.5, -1)
    mix = (probs @ v).transpose(1, 2).reshape(b, n, dim)
    (g,) = torch.autograd.grad(mix, u, grad_out)
    return mix.detach(), g


@pytest.mark.parametrize("path", ["small", "large", "large_chunked"])
def test_detached_qk_attention_equals_hand_written(path, monkeypatch):
    model = make_model("vit")
    ad = adapt(model)
    x = make_inputs("vit", 2)
    with torch.no_grad():
        u = ad.blocks[0].norm1(ad.embed(x))
    grad_out = torch.randn(u.shape, dtype=u.dtype, generator=torch.Generator().manual_seed(5))
    if path != "small":
        monkeypatch.setattr(parts, "SMALL_ATTENTION_KEYS", 0)
    if path == "large_chunked":  # three query rows per chunk
        per_row = u.shape[0] * ad.blocks[0].num_heads * u.shape[1] * u.element_size()
        monkeypatch.setattr(parts, "QUERY_CHUNK_BYTES", 3 * per_row)
    assert parts._consecutive(ad.blocks[0].q_weight, ad.blocks[0].k_weight,
                              ad.blocks[0].v_weight) is not None  # the fused qkv route
    ours = _attention_and_grad(ad.blocks[0], u, grad_out)
    ref = _hand_attention_grad(ad, u, grad_out)
    assert_close_scaled(ours[0], ref[0], rel=1e-12)
    assert_close_scaled(ours[1], ref[1], rel=1e-12)


@pytest.mark.parametrize("family", ["beit", "hf_vit"])
def test_large_values_only_attention_equals_small_path(family, monkeypatch):
    """With a position bias (BEiT) and with separate q/k/v projections (Hugging Face),
    chunked: the recomputing backward equals the kept-probabilities one."""
    model = make_model(family)
    ad = adapt(model)
    x = make_inputs(family, 2)
    with torch.no_grad():
        u = ad.blocks[0].norm1(ad.embed(x)) if ad.blocks[0].norm1 is not None else ad.embed(x)
    p = ad.blocks[0]
    grad_out = torch.randn(u.shape[0], u.shape[1], p.inner_dim, dtype=u.dtype,
                           generator=torch.Generator().manual_seed(6))
    monkeypatch.setattr(parts, "SMALL_ATTENTION_KEYS", 10_000)
    small = _attention_and_grad(p, u, grad_out)
    monkeypatch.setattr(parts, "SMALL_ATTENTION_KEYS", 0)
    monkeypatch.setattr(parts, "QUERY_CHUNK_BYTES", 1)  # one query row per chunk
    large = _attention_and_grad(p, u, grad_out)
    assert_close_scaled(large[0], small[0], rel=1e-12)
    assert_close_scaled(large[1], small[1], rel=1e-12)


def test_trailing_rows_linear_reference():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    w, b = (torch.randn(6, 4, dtype=torch.float64, generator=g),
            torch.randn(6, dtype=torch.float64, generator=g))
    y = parts.trailing_rows_linear(x, w, b, 4)
    assert_close_scaled(y, x @ w.T + b)
    go = torch.randn(2, 5, 6, dtype=torch.float64, generator=g)
    (gx,) = torch.autograd.grad(y, x, go)
    assert_close_scaled(gx, go[..., 4:] @ w[4:])  # the leading columns send nothing
    # a weight that needs its gradient: the plain product
    w.requires_grad_()
    (gx2, gw) = torch.autograd.grad(parts.trailing_rows_linear(x, w, b, 4), (x, w), go)
    assert_close_scaled(gx2, go @ w.detach())
    assert gw is not None


def _backward_ops(fn):
    """(operation, shapes of its first two arguments) of every ATen call made inside the
    backward passes ``fn`` runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if torch._C._current_graph_task_id() != -1:  # inside a backward
                seen.append((str(func.overloadpacket), *(tuple(a.shape) for a in args[:2]
                                                         if isinstance(a, torch.Tensor))))
            return func(*args, **(kwargs or {}))

    with Record():
        fn()
    return seen


@pytest.mark.parametrize("large", [False, True])
def test_decompx_gradient_route_backward_reaches_v_only(large, monkeypatch):
    """DecompX's backward multiplies v's rows of the fused qkv weight, never the [3D, D]
    whole (the gradients of q and k are zero), and a large attention's backward is
    ``Aᵀ ∂s/∂o`` (one product per block), not the fused kernel's backward."""
    if large:
        monkeypatch.setattr(parts, "SMALL_ATTENTION_KEYS", 0)
    model = make_model("vit")
    ad = adapt(model)
    dim, heads = ad.blocks[0].inner_dim, ad.blocks[0].num_heads
    x = make_inputs("vit", 2)
    n = ad.layout(x).num_tokens
    method = DecompX(model, route="gradient")
    method.attribute(x, target=TARGET)  # one-time set-up out of the count
    ops = _backward_ops(lambda: method.attribute(x, target=TARGET))
    products = [o[1:] for o in ops if o[0] in ("aten.mm", "aten.bmm")]
    assert products
    assert not [s for s in products if s[1] == (3 * dim, dim)], products
    assert len([s for s in products if s[1] == (dim, dim)]) >= ad.num_blocks  # v's rows
    assert not [o for o in ops if "scaled_dot_product" in o[0]], ops
    values = [s for s in products if s == ((2 * heads, n, n), (2 * heads, n, dim // heads))]
    assert len(values) == ad.num_blocks  # Aᵀ ∂s/∂o, once per block
