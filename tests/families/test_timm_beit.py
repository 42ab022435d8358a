"""timm BEiT: relative position bias per block and shared, forward parity, and true token
removal with the bias sub-matrix of the kept tokens' original positions (SPEC_NEXT §7.2)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from timm.models.beit import Beit

from captum_vit import GAE, DecompX
from captum_vit.adapters import TimmBeitAdapter, adapt
from captum_vit.adapters.subsets import subset_logits
from tests.helpers import assert_close_scaled, randomize_

CONFIGS = {
    "per_block_avg": dict(use_rel_pos_bias=True, use_abs_pos_emb=False, global_pool="avg",
                          init_values=0.5),
    "shared_token": dict(use_shared_rel_pos_bias=True, global_pool="token"),
    "both": dict(use_rel_pos_bias=True, use_shared_rel_pos_bias=True, global_pool="avg"),
}


def beit(config: str) -> Beit:
    torch.manual_seed(0)
    m = Beit(img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=4, mlp_ratio=2.0,
             num_classes=5, **CONFIGS[config])
    return randomize_(m, 0).double().eval()


def reference_kept(model: Beit, x: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Logits of the class token plus the patches ``kept`` [n], written out from timm's
    parameters: the bias of every block is its full matrix indexed at the kept tokens'
    original positions ``S`` (CLS = 0, patch t = 1 + t)."""
    s = torch.cat([torch.zeros(1, dtype=torch.long), 1 + kept])
    h = torch.cat((model.cls_token.expand(len(x), -1, -1), model.patch_embed(x)), dim=1)
    if model.pos_embed is not None:
        h = h + model.pos_embed
    h = h[:, s]
    shared = model.rel_pos_bias() if model.rel_pos_bias is not None else None
    for blk in model.blocks:
        a = blk.attn
        bias = torch.zeros(a.num_heads, 17, 17, dtype=h.dtype)
        if a.relative_position_bias_table is not None:
            bias = bias + a._get_rel_pos_bias()[0]
        if shared is not None:
            bias = bias + shared
        u = blk.norm1(h)
        qkv = F.linear(u, a.qkv.weight, torch.cat((a.q_bias, a.k_bias, a.v_bias)))
        q, k, v = qkv.reshape(len(x), len(s), 3, a.num_heads, -1).permute(2, 0, 3, 1, 4)
        att = ((q * a.scale) @ k.transpose(-2, -1) + bias[:, s][:, :, s]).softmax(-1)
        o = a.proj((att @ v).transpose(1, 2).reshape(len(x), len(s), -1))
        h = h + (o if blk.gamma_1 is None else blk.gamma_1 * o)
        f = blk.mlp(blk.norm2(h))
        h = h + (f if blk.gamma_2 is None else blk.gamma_2 * f)
    pooled = model.fc_norm(h[:, 1:].mean(1)) if model.global_pool == "avg" \
        else model.norm(h)[:, 0]
    return model.head(pooled)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_forward_and_true_token_removal_use_the_bias_of_the_kept_positions(config):
    model = beit(config)
    ad = adapt(model)
    assert isinstance(ad, TimmBeitAdapter)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert_close_scaled(ad.run(ad.embed(x)), model(x))
    kept = torch.tensor([0, 3, 5, 6, 12, 15])
    ref = reference_kept(model, x, kept)
    x0 = ad.embed(x)
    assert_close_scaled(ad.run(x0, keep=kept.expand(2, -1)), ref)
    keep = torch.zeros(2, 2, 16, dtype=torch.bool)
    keep[:, 0, kept] = True
    keep[:, 1] = True  # the full sequence in the same call (mixed lengths, key padding)
    out = subset_logits(ad, x0, keep)
    assert_close_scaled(out[:, 0], ref)
    assert_close_scaled(out[:, 1], model(x))
    # the bias matters: dropping it changes the removal logits
    assert not torch.allclose(ref, reference_kept_without_bias(model, x, kept))


def reference_kept_without_bias(model: Beit, x: torch.Tensor, kept: torch.Tensor):
    """:func:`reference_kept` on a copy whose position bias tables are zero."""
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in clone.named_parameters():
            if "relative_position_bias_table" in name:
                p.zero_()
    return reference_kept(clone, x, kept)


def test_decompx_explicit_route_is_complete_with_the_bias():
    model = beit("both")
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    res = DecompX(model, route="explicit").decompose(x, [1, 3])
    torch.testing.assert_close(res.tokens.sum(-1) + res.bias, res.logit, rtol=0, atol=1e-10)
    grad = DecompX(model).decompose(x, [1, 3])
    torch.testing.assert_close(grad.tokens, res.tokens, rtol=0, atol=1e-10)


def test_other_sizes_are_refused():
    model = beit("per_block_avg")
    with pytest.raises(ValueError, match="img_size") as err:
        GAE(model).attribute(torch.randn(1, 3, 40, 32, dtype=torch.float64))
    assert "dynamic_img_size" not in str(err.value)  # BEiT has no such option


@pytest.mark.parametrize("scale_mlp", [False, True])
def test_swiglu_gated_rule_is_complete_and_both_routes_agree(scale_mlp):
    """SPEC_NEXT §7.1: the activated gate SiLU(g) is a constant per hidden unit, the value
    branch is decomposed linearly (the hidden LayerNorm of scale_mlp by the LayerNorm rule).
    The explicit route carries components; the gradient route detaches the gate: they are
    derived independently and must agree, and the explicit one must be complete."""
    torch.manual_seed(0)
    model = randomize_(Beit(img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=4,
                            num_classes=5, use_rel_pos_bias=True, swiglu_mlp=True,
                            scale_mlp=scale_mlp, global_pool="avg"), 0).double().eval()
    ad = adapt(model)
    assert ad.blocks[0].gate_weight is not None
    assert (ad.blocks[0].mlp_norm is not None) == scale_mlp
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    assert_close_scaled(ad.run(ad.embed(x)), model(x))
    for start in (0, 2):
        exp = DecompX(model, start, route="explicit").decompose(x, [1, 4])
        torch.testing.assert_close(exp.tokens.sum(-1) + exp.bias, exp.logit, rtol=0,
                                   atol=1e-10)
        grad = DecompX(model, start).decompose(x, [1, 4])
        torch.testing.assert_close(grad.tokens, exp.tokens, rtol=0, atol=1e-10)
