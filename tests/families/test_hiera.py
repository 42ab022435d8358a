"""Hiera (timm ``Hiera``, Hugging Face ``HieraForImageClassification`` / ``HieraModel``):
forward parity, the timm ↔ Hugging Face twin, the query pooling and mask units against
references written here, DecompX's completeness, bad inputs and refusals by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from captum_vit.adapters import adapt, catalog
from captum_vit.adapters.windows import QueryPool, pool_tokens
from captum_vit.methods.decompx import DecompX
from captum_vit.methods.table import pooling_methods
from captum_vit.registry import build_method
from tests.helpers import assert_unchanged, needs_transformers, snapshot

pytestmark = needs_transformers

FAST = {"rise": {"n_masks": 16}, "vit_cx": {}, "scorecam": {}}


def _model(name: str):
    _, ex = catalog.example(name)
    return ex.model(), ex.inputs(2)


@pytest.mark.parametrize("name", ["timm_hiera", "timm_hiera_mu", "hf_hiera", "hf_hiera_model"])
def test_forward_parity(name):
    """The canonical forward (raster order, windows, query pooling) equals the model's own
    (unrolled) forward in float64."""
    model, x = _model(name)
    a = adapt(model)
    with torch.no_grad():
        ref = a.model_outputs(x)
        ours = a.run(a.embed(x))
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    # the geometry read from the blocks: an 8x8 grid pooled twice
    assert [b.window.grid for b in a.blocks] == [(8, 8), (8, 8), (4, 4), (4, 4)]
    assert [b.pool is not None for b in a.blocks] == [False, True, False, True]
    assert a.stages.hierarchical and a.stages.has_windows


def test_twin_maps_equal():
    """timm ↔ Hugging Face with copied weights: the same logits and, for every registered
    method that runs through query pooling, the same maps (1e-10)."""
    tm, x = _model("timm_hiera")
    hf, _ = _model("hf_hiera")
    with torch.no_grad():
        torch.testing.assert_close(hf(pixel_values=x).logits, tm(x), rtol=0, atol=1e-12)
    t = torch.tensor([1, 3])
    methods = pooling_methods()
    assert {"decompx", "token_ixg", "cp_lrp", "attnlrp", "gradcam"} <= set(methods)
    for name in methods:
        kw = FAST.get(name, {})
        a = build_method(name, tm).attribute(x, target=t, output="tokens", **kw)
        b = build_method(name, hf).attribute(x, target=t, output="tokens", **kw)
        assert a.shape == (2, 64) and torch.isfinite(a).all(), name
        torch.testing.assert_close(b, a, rtol=0, atol=1e-10 * (1 + a.abs().max().item()),
                                   msg=name)


def test_query_pool_reference():
    """Query pooling equals a 2x2 max pool of the grid; the merge weights are each child's
    share of the channels where it is the maximum (¼ each on exact ties)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 36, 5, generator=g, dtype=torch.float64)
    ref = F.max_pool2d(x.reshape(2, 6, 6, 5).permute(0, 3, 1, 2), 2)
    torch.testing.assert_close(pool_tokens(x, (6, 6)),
                               ref.permute(0, 2, 3, 1).reshape(2, 9, 5), rtol=0, atol=0)
    pool = QueryPool(grid=(6, 6), weight=torch.zeros(5, 5, dtype=torch.float64))
    shares = pool.shares(x)
    torch.testing.assert_close(shares.sum(-1), torch.ones(2, 9, dtype=torch.float64))
    kids = x[:, pool.children()]  # [2, 9, 4, 5]
    expect = (kids == kids.amax(2, keepdim=True)).double().mean(-1)
    torch.testing.assert_close(shares, expect)
    tied = pool.shares(torch.ones(1, 36, 5, dtype=torch.float64))
    torch.testing.assert_close(tied, torch.full((1, 9, 4), 0.25, dtype=torch.float64))
    with pytest.raises(ValueError, match="even"):
        QueryPool(grid=(5, 6), weight=pool.weight)


def test_pooling_block_attention_dense_reference():
    """The pooling block's mask-unit attention against a dense reference written here:
    queries max-pooled on the grid, keys masked to the query's mask unit."""
    model, x = _model("timm_hiera_mu")
    a = adapt(model)
    p = a.blocks[1]  # pools; mask units of 4x4 input tokens
    with torch.no_grad():
        u = F.layer_norm(a.run(a.embed(x), 0, 1), (8,), p.norm1.weight, p.norm1.bias,
                         p.norm1.eps)
        mix, probs = p.attention(u, materialize=True)
        h, d = p.num_heads, p.head_dim
        q = F.linear(u, p.q_weight, p.q_bias)
        q = F.max_pool2d(q.reshape(2, 8, 8, -1).permute(0, 3, 1, 2), 2)
        q = q.permute(0, 2, 3, 1).reshape(2, 16, h, d).transpose(1, 2)
        k = F.linear(u, p.k_weight, p.k_bias).reshape(2, 64, h, d).transpose(1, 2)
        v = F.linear(u, p.v_weight, p.v_bias).reshape(2, 64, h, d).transpose(1, 2)
        unit_in = (torch.arange(8)[:, None] // 4 * 2 + torch.arange(8)[None] // 4).reshape(-1)
        unit_out = (torch.arange(4)[:, None] // 2 * 2 + torch.arange(4)[None] // 2).reshape(-1)
        logits = (q * p.scale) @ k.transpose(-1, -2)
        logits = logits.masked_fill(unit_out[:, None] != unit_in[None], float("-inf"))
        dense = logits.softmax(-1)
        ref = (dense @ v).transpose(1, 2).reshape(2, 16, -1)
    torch.testing.assert_close(mix, ref, rtol=0, atol=1e-12)
    assert probs.shape == (2, h, 4, 4, 16)  # [B, H, n_W, M/4, M]


@pytest.mark.parametrize("name", ["timm_hiera", "timm_hiera_mu"])
def test_decompx_complete(name):
    """DecompX through query pooling (each channel its maximal child's decomposition):
    tokens + bias = the logit, the explicit route equal to the gradient route."""
    model, x = _model(name)
    t = torch.tensor([0, 4])
    grad = DecompX(model).decompose(x, target=t)
    expl = DecompX(model, route="explicit").decompose(x, target=t)
    with torch.no_grad():
        logit = model(x).gather(1, t[:, None])[:, 0]
    torch.testing.assert_close(expl.tokens.sum(-1) + expl.bias, logit, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad.tokens, expl.tokens, rtol=0, atol=1e-12)


def test_bad_inputs_and_refusals():
    """A size that is not a multiple of the mask unit, another size, and a method reading
    token-mixing matrices: clear errors by name; the model unchanged."""
    model, x = _model("timm_hiera")
    before = snapshot(model)
    method = build_method("token_ixg", model)
    bad = torch.zeros(1, 3, 36, 36, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"\(36, 36\) is not a multiple of .*mask unit of "
                                         r"16x16 pixels"):
        method.attribute(bad, target=0)
    with pytest.raises(ValueError, match=r"\(48, 48\) does not match"):
        method.attribute(torch.zeros(1, 3, 48, 48, dtype=torch.float64), target=0)
    with pytest.raises(ValueError, match="rollout|Rollout") as err:
        build_method("rollout", model).attribute(x, target=0)
    assert "pools its queries" in str(err.value) and "decompx" in str(err.value)
    with pytest.raises(ValueError, match="windows"):
        build_method("tis", model).attribute(x, target=0, n_masks=8)
    assert_unchanged(model, before)


def test_plus_over_stages():
    """PLUS and SkipPLUS over the stages with gradient bases: maps on the first grid."""
    model, x = _model("timm_hiera")
    for name in ("plus:ixg", "skipplus:captum:Saliency"):
        out = build_method(name, model).attribute(x, target=torch.tensor([1, 2]),
                                                  output="tokens")
        assert out.shape == (2, 64) and torch.isfinite(out).all()
