"""timm Eva (EVA, EVA-02, DINOv3; SPEC_NEXT §7.1): forward parity with the model's own
(fused-attention) forward, true token removal with the RoPE rows of the kept tokens'
original positions, DecompX completeness through RoPE, the inner attention norm and the
gated MLPs, TokenTM with the inner norm against a slow reference, and the refusals."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from timm.layers import RmsNorm
from timm.models.eva import Eva, EvaBlock

from captum_vit import DecompX, TokenTM
from captum_vit.adapters import TimmEvaAdapter, adapt
from captum_vit.adapters.subsets import subset_logits
from captum_vit.methods.tokentm import head_weights_inner_norm, transformation_weights
from tests.helpers import (
    ReferenceCapture,
    assert_close_scaled,
    assert_close_to_reference,
    randomize_,
)

EPS = 1e-8
SIZES = [(32, 32), (24, 40)]
CONFIGS = {
    # EVA-02 with an attention-pool head over every token (SPEC_NEXT §7.3)
    "eva02_map": dict(use_rot_pos_emb=True, rope_type="cat", swiglu_mlp=True, scale_mlp=True,
                      scale_attn_inner=True, init_values=0.5, global_pool="map"),
    # EVA-02: abs + RoPE 'cat' (interleaved), SwiGLU with hidden norm, inner attention norm
    "eva02": dict(use_rot_pos_emb=True, rope_type="cat", swiglu_mlp=True, scale_mlp=True,
                  scale_attn_inner=True, init_values=0.5, global_pool="avg"),
    # DINOv3: RoPE 'dinov3' with rotate-half, 4 registers, no abs pos embed, token pool
    "dinov3": dict(use_rot_pos_emb=True, rope_type="dinov3", rope_rotate_half=True,
                   rope_temperature=100, num_reg_tokens=4, use_abs_pos_emb=False,
                   init_values=1e-5, qkv_bias=False, global_pool="token", use_fc_norm=False),
    # EVA-01: absolute position embedding only, GELU Mlp
    "eva01": dict(global_pool="avg"),
    # packed SwiGLU (GluMlp, gate first), RoPE, registers with no_embed_class
    "glu": dict(use_rot_pos_emb=True, swiglu_mlp=True, num_reg_tokens=2, no_embed_class=True,
                global_pool="avg"),
    # separate q/k/v projections with q/k norm (RoPE after the norm)
    "separate_qknorm": dict(use_rot_pos_emb=True, qkv_fused=False, qk_norm=True,
                            global_pool="token"),
    # timm's AttentionRope (attn_type='rope'): same maths, ordinary qkv bias
    "attention_rope": dict(use_rot_pos_emb=True, attn_type="rope", scale_attn_inner=True,
                           global_pool="token"),
}


def eva(config: str | dict, *, dynamic: bool = True, size=(32, 32), seed: int = 0) -> Eva:
    kw = CONFIGS[config] if isinstance(config, str) else config
    torch.manual_seed(seed)
    m = Eva(img_size=size, patch_size=8, embed_dim=32, depth=3, num_heads=4, mlp_ratio=2.0,
            num_classes=5, dynamic_img_size=dynamic, **kw)
    return randomize_(m, seed).double().eval()


def images(size, batch: int = 2, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, *size, generator=g, dtype=torch.float64)


# --- forward parity ---------------------------------------------------------------------

@pytest.mark.parametrize("config", list(CONFIGS))
def test_forward_equals_the_models_own_at_two_sizes(config):
    model = eva(config)
    assert all(blk.attn.fused_attn for blk in model.blocks)  # the model runs SDPA
    ad = adapt(model)
    assert isinstance(ad, TimmEvaAdapter)
    for size in SIZES:
        x = images(size)
        assert_close_scaled(ad.run(ad.embed(x)), model(x))
        ad.check_inputs(x)
        lay = ad.layout(x)
        assert lay.grid == (size[0] // 8, size[1] // 8)
        assert lay.num_prefix == model.num_prefix_tokens
        assert lay.readout == model.global_pool


def test_parts_are_views_and_read_the_right_modules():
    p = adapt(eva("eva02")).blocks[0]
    assert p.inner_norm is not None and p.mlp_norm is not None and p.rotary is not None
    assert p.gate_weight is not None and p.ls1 is not None and p.ls2 is not None
    model = eva("glu")
    mlp = model.blocks[1].mlp
    assert mlp.gate_last is False
    p = adapt(model).blocks[1]
    h = mlp.fc1.weight.shape[0] // 2
    # GluMlp(gate_last=False): act(first half) * second half, both row views of fc1
    assert p.gate_weight.data_ptr() == mlp.fc1.weight.data_ptr()
    assert p.fc1_weight.data_ptr() == mlp.fc1.weight[h:].data_ptr()
    assert p.gate_bias.data_ptr() == mlp.fc1.bias.data_ptr()
    u = torch.randn(2, 5, 32, dtype=torch.float64)
    g, z = mlp.fc1(u).chunk(2, -1)
    torch.testing.assert_close(mlp.act(g) * z, mlp.act(torch.nn.functional.linear(
        u, p.gate_weight, p.gate_bias)) * torch.nn.functional.linear(u, p.fc1_weight,
                                                                      p.fc1_bias))
    assert adapt(eva("eva01")).blocks[0].rotary is None


def test_registers_get_absolute_positions_unless_no_embed_class():
    """Verified in the installed timm: with ``no_embed_class=False`` the absolute embedding
    has rows for CLS and every register (the adapter runs ``_pos_embed`` either way)."""
    both = eva(dict(num_reg_tokens=2, global_pool="avg"))
    assert both.pos_embed.shape[1] == 3 + 16
    assert eva(dict(num_reg_tokens=2, no_embed_class=True)).pos_embed.shape[1] == 16
    x = images((32, 32))
    ad = adapt(both)
    assert_close_scaled(ad.run(ad.embed(x)), both(x))


@pytest.mark.parametrize("config", ["eva02", "dinov3"])
def test_parameter_stages_cover_every_parameter_once(config):
    model = eva(config)
    stages = adapt(model).parameter_stages()
    assert len(stages) == 1 + len(model.blocks)
    staged = [id(p) for stage in stages for p in stage]
    assert len(staged) == len(set(staged))
    embedding = {id(p) for name, p in model.named_parameters()
                 if name.split(".")[0] in ("patch_embed", "cls_token", "reg_token", "pos_embed",
                                           "norm_pre")}
    assert set(staged) | embedding == {id(p) for p in model.parameters()}
    assert not set(staged) & embedding


def test_rope_and_its_layout_matter():
    """Dropping RoPE, or using the other rotation layout, changes the logits: the parity
    above is not vacuous."""
    for config in ("eva02", "dinov3"):
        model = eva(config)
        x = images((24, 40))
        ad = adapt(model)
        x0 = ad.embed(x)
        real = ad.blocks
        ad.blocks = [replace(p, rotary=functools.partial(
            p.rotary.func, half=not p.rotary.keywords["half"])) for p in real]
        assert not torch.allclose(ad.run(x0), model(x))
        ad.blocks = [replace(p, rotary=None) for p in real]
        assert not torch.allclose(ad.run(x0), model(x))
        ad.blocks = real
        assert_close_scaled(ad.run(x0), model(x))


# --- true token removal -----------------------------------------------------------------

def reference_kept(model: Eva, x: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Logits of the prefix tokens plus the patches ``kept`` [B, n] through the model's own
    embedding, blocks, norm and head, each kept patch rotated by the RoPE row of its
    ORIGINAL position (gathered here by hand)."""
    k = model.num_prefix_tokens
    h, rope = model._pos_embed(model.patch_embed(x))
    h = model.norm_pre(h)
    rows = [torch.cat([torch.arange(k), k + kept[b]]) for b in range(len(x))]
    h = torch.stack([h[b, rows[b]] for b in range(len(x))])
    rope_kept = None
    if rope is not None:  # [P, 2d] -> [B, 1, n, 2d]
        rope_kept = torch.stack([rope[kept[b]] for b in range(len(x))])[:, None]
    for blk in model.blocks:
        h = blk(h, rope=rope_kept)
    return model.forward_head(model.norm(h))


@pytest.mark.parametrize("config", ["eva02", "dinov3", "glu", "eva01", "eva02_map"])
def test_true_token_removal_keeps_original_rope_rows(config):
    model = eva(config)
    ad = adapt(model)
    x = images((24, 40))  # 3 x 5 = 15 patches
    x0 = ad.embed(x)
    kept = torch.tensor([[0, 3, 5, 6, 12, 14], [1, 2, 4, 8, 9, 13]])
    ref = reference_kept(model, x, kept)
    assert_close_scaled(ad.run(x0, keep=kept), ref)
    if model.rope is not None:  # re-indexing the kept patches 0..n-1 would differ
        assert not torch.allclose(ref, reference_kept_reindexed(model, x, kept))
    keep = torch.zeros(2, 2, 15, dtype=torch.bool)
    keep[torch.arange(2)[:, None], 0, kept] = True
    keep[:, 1] = True  # the full sequence in the same call (mixed lengths, key padding)
    out = subset_logits(ad, x0, keep)
    assert_close_scaled(out[:, 0], ref)
    assert_close_scaled(out[:, 1], model(x))


def reference_kept_reindexed(model: Eva, x: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    k = model.num_prefix_tokens
    h, rope = model._pos_embed(model.patch_embed(x))
    h = torch.stack([h[b, torch.cat([torch.arange(k), k + kept[b]])] for b in range(len(x))])
    for blk in model.blocks:
        h = blk(h, rope=rope[:kept.shape[1]])
    return model.forward_head(model.norm(h))


def test_tokens_of_another_grid_are_refused():
    model = eva("eva02")
    ad = adapt(model)
    x0 = ad.embed(images((32, 32)))
    ad.embed(images((24, 40)))  # the adapter now holds the 15-patch table
    with pytest.raises(ValueError, match="rotary embedding of the last embedded input"):
        ad.run(x0)
    with pytest.raises(ValueError, match="outside the 15 patch tokens"):
        ad.run(x0, keep=torch.tensor([[0, 15]]).expand(2, -1))
    fresh = TimmEvaAdapter(model)
    with pytest.raises(ValueError, match="adapter.embed"):
        fresh.run(x0)
    fixed = eva("eva02", dynamic=False)  # a fixed grid needs no embed first
    x = images((32, 32))
    fixed_ad = TimmEvaAdapter(fixed)
    assert_close_scaled(fixed_ad.run(adapt(fixed).embed(x)), fixed(x))
    with pytest.raises(ValueError, match="dynamic_img_size=True"):
        fixed_ad.check_inputs(images((24, 40)))


def test_views_are_re_read_after_model_to():
    model = eva("glu")
    ad = adapt(model)
    model.float()
    x = images((32, 32)).float()
    assert_close_scaled(ad.run(ad.embed(x)), model(x), rel=1e-5)
    assert ad.blocks[0].q_weight.dtype == torch.float32
    assert ad.blocks[0].gate_weight.data_ptr() == model.blocks[0].mlp.fc1.weight.data_ptr()


# --- DecompX ----------------------------------------------------------------------------

@pytest.mark.parametrize("config", ["eva02", "dinov3", "glu", "eva02_map"])
def test_decompx_is_complete_and_routes_agree(config):
    model = eva(config)
    x = images((24, 40))
    target = torch.tensor([1, 3])
    with torch.no_grad():
        y = model(x).gather(1, target[:, None])[:, 0]
    for start in (0, 2):
        exp = DecompX(model, start, route="explicit").decompose(x, target)
        grad = DecompX(model, start, route="gradient").decompose(x, target)
        torch.testing.assert_close(exp.tokens.sum(-1) + exp.bias, y, rtol=0, atol=1e-10)
        torch.testing.assert_close(grad.tokens.sum(-1) + grad.bias, y, rtol=0, atol=1e-10)
        torch.testing.assert_close(grad.tokens, exp.tokens, rtol=0, atol=1e-10)


# --- TokenTM with the inner attention norm ------------------------------------------------

def _ref_weights(e: torch.Tensor, e_t: torch.Tensor) -> torch.Tensor:
    """diag of W (Eq. 12-13) for one image, one token at a time."""
    n = e.shape[0]
    cos = torch.stack([e[i] @ e_t[i] / (max(e[i].norm(), EPS) * max(e_t[i].norm(), EPS))
                       for i in range(n)])
    necc = torch.exp(cos) / torch.exp(cos).sum()
    return torch.stack([e_t[i].norm() / (e[i].norm() + EPS) * necc[i] for i in range(n)])


def _inner_norm_heads(blk: EvaBlock, u: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """Ẽ^h = N_in^lin(u W_V^h ⊕ 0) W_O for every head, built explicitly: [B, H, N, D]
    (SPEC_NEXT §7.1; statistics of the real attention output ``o``, β excluded)."""
    attn = blk.attn
    heads, d = attn.num_heads, attn.head_dim
    a = heads * d
    wv = attn.qkv.weight[2 * a:] if attn.qkv is not None else attn.v_proj.weight
    sigma = (o.var(-1, unbiased=False, keepdim=True) + attn.norm.eps).sqrt()  # [B, N, 1]
    out = []
    for h in range(heads):
        z = torch.zeros(*u.shape[:2], a, dtype=u.dtype)
        z[..., h * d:(h + 1) * d] = u @ wv[h * d:(h + 1) * d].T  # head h's values, padded
        n_lin = (z - z.mean(-1, keepdim=True)) / sigma * attn.norm.weight
        out.append(n_lin @ attn.proj.weight.T)
    return torch.stack(out, dim=1)


def reference_tokentm_inner_norm(model: Eva, x: torch.Tensor, target: torch.Tensor):
    """TokenTM paper variant (SPEC §2, Eq. 9-20) with SPEC_NEXT §7.1's Ẽ^h, from the
    model's own (unfused) forward: attention, its output ``o`` before ``N_in`` and the
    block states captured by hooks; full N x N matrices per image."""
    refs = ReferenceCapture(model)
    mids, outs = [], []
    for blk in refs.model.blocks:
        blk.norm2.register_forward_pre_hook(lambda m, a: mids.append(a[0]))
        blk.attn.norm.register_forward_pre_hook(lambda m, a: outs.append(a[0]))
    logits = refs(x)
    logits.softmax(-1)[torch.arange(len(x)), target].sum().backward()
    maps = []
    with torch.no_grad():
        for b in range(len(x)):
            x0 = refs.block_inputs[0][b]
            n = x0.shape[0]
            eye = torch.eye(n, dtype=x0.dtype)
            c = torch.diag(x0.norm(dim=-1))  # Eq. 18
            for l, blk in enumerate(refs.model.blocks):
                xl, mid = refs.block_inputs[l][b], mids[l][b]
                a, g = refs.attn[l][b], refs.attn[l].grad[b]
                e_t = _inner_norm_heads(blk, blk.norm1(xl)[None], outs[l][b][None])[0]
                terms = [g[h].clamp(min=0) * (a[h] @ torch.diag(_ref_weights(xl, e_t[h])))
                         for h in range(a.shape[0])]  # Eq. 14
                u_attn = eye + sum(terms) / a.shape[0]  # Eq. 15
                ffn = blk.mlp(blk.norm2(mid[None]))[0]
                ffn = ffn if blk.gamma_2 is None else blk.gamma_2 * ffn
                u_ffn = eye + torch.diag(_ref_weights(mid, ffn))  # Eq. 16-17
                c = u_ffn @ u_attn @ c  # Eq. 19
            k = model.num_prefix_tokens
            row = c[k:].mean(0) if model.global_pool == "avg" else c[0]  # Eq. 20
            maps.append(row[k:])
    return torch.stack(maps)


@pytest.mark.parametrize("config", ["eva02", "attention_rope"])
def test_tokentm_with_inner_norm_matches_slow_reference(config):
    model = eva(config)
    x = images((24, 40))
    target = torch.tensor([2, 4])
    ref = reference_tokentm_inner_norm(model, x, target)
    out = TokenTM(model).attribute(x, target=target, output="tokens")
    assert_close_to_reference(out, ref, rel=1e-12)


def test_inner_norm_head_weights_equal_materialised_heads():
    model = eva("eva02")
    ad = adapt(model)
    tr = ad.trace(images((24, 40)))
    for rec, p, blk in zip(tr.blocks, ad.blocks, model.blocks, strict=True):
        b, n, _ = rec.u.shape
        vb = torch.nn.functional.linear(rec.u, p.v_weight, p.v_bias)
        o = (rec.attn @ vb.reshape(b, n, p.num_heads, -1).transpose(1, 2))
        o = o.transpose(1, 2).reshape(b, n, -1)  # the real attention output before N_in
        slow = transformation_weights(rec.x[:, None], _inner_norm_heads(blk, rec.u, o))
        fast = head_weights_inner_norm(rec.x, rec.u, rec.attn, p.v_weight, p.v_bias,
                                       p.proj_weight, p.inner_norm, p.num_heads)
        assert fast.shape == slow.shape == rec.attn.shape[:3]
        assert_close_to_reference(fast, slow, rel=1e-12)


# --- refusals ---------------------------------------------------------------------------

def _gated(model: Eva) -> Eva:
    blk = EvaBlock(32, 4, mlp_ratio=2.0, gated_attn=True, num_prefix_tokens=1)
    model.blocks[1] = blk.double().eval()
    return model


def _with_mlp_head(model: torch.nn.Module) -> torch.nn.Module:
    model.head = torch.nn.Sequential(torch.nn.Linear(32, 5), torch.nn.ReLU())
    return model


REFUSED = {
    "post_norm": (lambda: eva(dict(use_post_norm=True)), r"use_post_norm"),
    "mixed_rope": (lambda: eva(dict(use_rot_pos_emb=True, rope_type="mixed")), r"'mixed'"),
    "mrope": (lambda: eva(dict(use_rot_pos_emb=True, rope_type="mrope")), r"'mrope'"),
    "gated_attention": (lambda: _gated(eva("eva01")), r"gated attention"),
    "grouped_query": (lambda: eva(dict(use_rot_pos_emb=True, attn_type="rope", qkv_fused=False,
                                       num_kv_heads=2)), r"grouped-query"),
    "max_pool": (lambda: eva(dict(global_pool="max")), r"global_pool='max'"),
    "avgmax_pool": (lambda: eva(dict(global_pool="avgmax")), r"global_pool='avgmax'"),
    "mlp_head": (lambda: _with_mlp_head(Eva(img_size=32, patch_size=8, embed_dim=32, depth=2,
                                            num_heads=4, num_classes=0)),
                 r"linear classifier head, or none"),
    "rms_norm": (lambda: eva(dict(norm_layer=RmsNorm)), r"LayerNorm"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_configurations_are_refused(case):
    build, message = REFUSED[case]
    with pytest.raises(TypeError, match=message):
        adapt(build())


def test_training_mode_randomness_is_refused():
    model = eva(dict(use_rot_pos_emb=True, rope_type="dinov3", rope_rotate_half=True,
                     rope_shift_coords=0.5, use_abs_pos_emb=False))
    ad = adapt(model)
    x = images((32, 32))
    ad.check_inputs(x)
    model.rope.train()  # RoPE coordinate augmentation is random in training mode
    with pytest.raises(ValueError, match="training mode"):
        ad.check_inputs(x)
