"""LeGrad (SPEC_NEXT §8.7) against slow float64 references written here.

Every reference runs ONE forward and ONE backward per block: the model is run up to block
``l`` only, the readout is applied to that block's output by hand from the model's own
modules, and the gradient of that score is taken w.r.t. the attention the readout sees
(block ``l``'s self-attention, or an attention pool written out from the pool's
parameters). LeGrad itself gets every block from one cut trace and one backward.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from captum_vit import PLUS, EmbeddingTarget, LeGrad, SkipPLUS
from captum_vit.adapters import Ops, adapt
from captum_vit.methods.legrad import min_max
from tests.helpers import (
    assert_close_scaled,
    assert_unchanged,
    embedding_dim,
    make_inputs,
    make_model,
    needs_transformers,
    snapshot,
)

TARGETS = torch.tensor([1, 4, 0])
_MODELS: dict[str, torch.nn.Module] = {}


def model_of(family: str) -> torch.nn.Module:
    if family not in _MODELS:
        _MODELS[family] = make_model(family)
    return _MODELS[family]


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-10) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=tol * (1 + b.abs().max().item()))


def legrad_term(grad: torch.Tensor, num_prefix: int, pool: bool = False) -> torch.Tensor:
    """``mean_h mean_i ReLU(G)[i, j]`` over the patch columns (pool: its one query row)."""
    e = grad.clamp(min=0).mean(1)
    e = e[:, 0] if pool else e.mean(1)
    return e[:, num_prefix:]


# -- timm: the model's own blocks and head ----------------------------------------------------
def timm_blocks(model: torch.nn.Module, x: torch.Tensor, stop: int):
    """The model's own modules up to block ``stop`` (explicit attention, captured by a hook
    on ``attn_drop``); returns the block output and the captured attentions."""
    attns: list[torch.Tensor] = []
    hooks = [blk.attn.attn_drop.register_forward_hook(lambda m, a, out: attns.append(out))
             for blk in model.blocks]
    try:
        h = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x))))
        for blk in model.blocks[:stop + 1]:
            h = blk(h)
    finally:
        for hk in hooks:
            hk.remove()
    return h, attns


def timm_pool(model: torch.nn.Module, xh: torch.Tensor):
    """timm's ``AttentionPoolLatent`` written out: pooled vector and the pool's attention
    over all N tokens (0 at the prefix rows it skips)."""
    p = model.attn_pool
    k0 = 0 if model.pool_include_prefix else model.num_prefix_tokens
    b = xh.shape[0]
    q = p.q(p.latent.expand(b, -1, -1)).reshape(b, -1, p.num_heads, p.head_dim).transpose(1, 2)
    kv = p.kv(xh[:, k0:]).reshape(b, -1, 2, p.num_heads, p.head_dim).permute(2, 0, 3, 1, 4)
    k, v = kv.unbind(0)
    a = ((p.q_norm(q) * p.scale) @ p.k_norm(k).transpose(-2, -1)).softmax(-1)
    o = p.proj((a @ v).transpose(1, 2).reshape(b, -1, a.shape[1] * p.head_dim))
    o = o + p.mlp(p.norm(o))
    assert_close_scaled(o[:, 0], p(xh[:, k0:]))
    return o[:, 0], a, k0


def timm_reference(model, x, target, layers, *, skip_final_norm=False):
    m = copy.deepcopy(model)
    for blk in m.blocks:
        blk.attn.fused_attn = False
    k = m.num_prefix_tokens
    total = 0
    for l in layers:
        z, attns = timm_blocks(m, x, l)
        xh = z if skip_final_norm else m.norm(z)
        if getattr(m, "attn_pool", None) is not None:
            pooled, a, k0 = timm_pool(m, xh)
            logits = m.head(m.fc_norm(pooled))
            (g,) = torch.autograd.grad(logits[torch.arange(len(x)), target].sum(), a)
            total = total + legrad_term(g, k - k0, pool=True)
        else:
            logits = m.forward_head(xh)
            (g,) = torch.autograd.grad(logits[torch.arange(len(x)), target].sum(), attns[l])
            total = total + legrad_term(g, k)
    return total


@pytest.mark.parametrize("family", ["vit", "registers", "avgpool", "distilled"])
def test_timm_equals_one_backward_per_block_through_the_models_modules(family):
    model, x = model_of(family), make_inputs(family)
    before = snapshot(model)
    ours = LeGrad(model).attribute(x, target=TARGETS, output="tokens")
    close(ours, timm_reference(model, x, TARGETS, range(3)))
    some = LeGrad(model, layers=[2, 0]).attribute(x, target=TARGETS, output="tokens")
    close(some, timm_reference(model, x, TARGETS, [0, 2]))
    assert_unchanged(model, before)


@pytest.mark.parametrize("family", ["map", "map_cls_reg"])
def test_map_pool_gradient_is_taken_at_the_pool_attention_on_every_block(family):
    model, x = model_of(family), make_inputs(family)
    ours = LeGrad(model).attribute(x, target=TARGETS, output="tokens")
    close(ours, timm_reference(model, x, TARGETS, range(3)))
    raw = LeGrad(model, skip_final_norm=True).attribute(x, target=TARGETS, output="tokens")
    close(raw, timm_reference(model, x, TARGETS, range(3), skip_final_norm=True))
    assert not torch.allclose(raw, ours)


def test_batched_over_blocks_equals_one_backward_per_block():
    """The cut trace's one backward equals LeGrad block by block (each one backward), and
    differs from a plain single backward of the summed scores (where A^l also receives
    the later blocks' gradients)."""
    model, x = model_of("vit"), make_inputs("vit")
    method = LeGrad(model)
    batched, _ = method.block_maps(x, TARGETS, range(3))
    for l in range(3):
        one, _ = method.block_maps(x, TARGETS, [l])  # its own forward and backward
        close(batched[l], one[l])
        single = LeGrad(model, layers=[l]).attribute(x, target=TARGETS, output="tokens")
        close(batched[l][:, 1:], single)
    a = adapt(model)
    tr = a.trace(x, grad=True)  # no cut: gradients of later scores reach A^l as well
    scores = [a.readout_logits(tr.blocks[l].out, Ops())[torch.arange(3), TARGETS]
              for l in range(3)]
    grads = torch.autograd.grad(torch.stack(scores).sum(), [b.attn for b in tr.blocks])
    naive = sum(legrad_term(g, 1) for g in grads)
    full = LeGrad(model).attribute(x, target=TARGETS, output="tokens")
    assert (naive - full).abs().max() > 1e-3 * full.abs().max()


# -- Hugging Face: the adapter's blocks re-run, the readout from the model's modules ----------
def adapter_blocks(model, x, stop):
    a = adapt(model)
    h = a.embed(x).detach().requires_grad_()
    rec = []
    for l in range(stop + 1):
        h = a.block(h, l, Ops(), rec)
    return h, rec[stop].attn


def hf_reference(model, x, readout, layers):
    """``readout(z) -> scores [B]`` from the model's modules, one backward per block."""
    k = adapt(model).num_prefix
    total = 0
    for l in layers:
        z, attn = adapter_blocks(model, x, l)
        (g,) = torch.autograd.grad(readout(z).sum(), attn)
        total = total + legrad_term(g, k)
    return total


@needs_transformers
def test_hf_vit_classifier():
    model, x = model_of("hf_vit"), make_inputs("hf_vit")

    def readout(z):
        return model.classifier(model.vit.layernorm(z)[:, 0])[torch.arange(3), TARGETS]

    ours = LeGrad(model).attribute(x, target=TARGETS, output="tokens")
    close(ours, hf_reference(model, x, readout, range(3)))


def vectors(model, n, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, embedding_dim(model), generator=g, dtype=torch.float64)


@needs_transformers
def test_clip_tower_with_a_target_vector_model_and_mean_readouts():
    model, x = model_of("hf_clip"), make_inputs("hf_clip")
    before = snapshot(model)
    bb, proj = adapt(model).backbone, model.visual_projection
    t = vectors(model, 1)[0]

    def cls(z):
        return F.cosine_similarity(proj(bb.post_layernorm(z[:, 0])), t[None], dim=-1)

    def mean(z):  # the authors' CLIP code: LN_post(mean of all tokens) W_proj
        return F.cosine_similarity(proj(bb.post_layernorm(z.mean(1))), t[None], dim=-1)

    ours = LeGrad(model).attribute(x, target=t, output="tokens")
    close(ours, hf_reference(model, x, cls, range(3)))
    ours = LeGrad(model, readout="mean").attribute(x, target=t, output="tokens")
    close(ours, hf_reference(model, x, mean, range(3)))
    scaled = LeGrad(model, readout="mean").attribute(
        x, target=EmbeddingTarget(t, scale=5.0, bias=-2.0), output="tokens")
    close(scaled, 5.0 * ours)
    assert_unchanged(model, before)


def siglip_pool(model, xh):
    """``SiglipMultiheadAttentionPoolingHead`` written out from its parameters."""
    head = adapt(model).backbone.head
    mha = head.attention
    b, n, d = xh.shape
    nh, hd = mha.num_heads, d // mha.num_heads
    w, bias = mha.in_proj_weight, mha.in_proj_bias
    q = F.linear(head.probe.expand(b, -1, -1), w[:d], bias[:d])
    k, v = (F.linear(xh, w[i * d:(i + 1) * d], bias[i * d:(i + 1) * d]) for i in (1, 2))
    q, k, v = (t.reshape(b, -1, nh, hd).transpose(1, 2) for t in (q, k, v))
    a = (q @ k.transpose(-2, -1) / hd ** 0.5).softmax(-1)
    o = mha.out_proj((a @ v).transpose(1, 2).reshape(b, -1, d))
    o = o + head.mlp(head.layernorm(o))
    assert_close_scaled(o[:, 0], head(xh))
    return o[:, 0], a


def siglip_reference(model, x, t, *, skip_final_norm=False):
    """One ``[B]`` of target vectors ``t``; maps ``[B, P]``."""
    norm = adapt(model).backbone.post_layernorm
    total = 0
    for l in range(3):
        z, _ = adapter_blocks(model, x, l)
        pooled, a = siglip_pool(model, z if skip_final_norm else norm(z))
        s = F.cosine_similarity(pooled, t, dim=-1)
        (g,) = torch.autograd.grad(s.sum(), a)
        total = total + legrad_term(g, 0, pool=True)
    return total


@needs_transformers
def test_siglip_tower_pool_attention_and_null_correction():
    model, x = model_of("hf_siglip"), make_inputs("hf_siglip")
    before = snapshot(model)
    t, null = vectors(model, 3), vectors(model, 1, seed=7)[0]
    for skip in (False, True):
        method = LeGrad(model, skip_final_norm=skip)
        ref = siglip_reference(model, x, t, skip_final_norm=skip)
        close(method.attribute(x, target=t, output="tokens"), ref)
        ref_null = siglip_reference(model, x, null.expand(3, -1), skip_final_norm=skip)
        mask = min_max(ref_null, 0) > 0.8
        assert mask.any() and not mask.all()
        corrected = method.attribute(x, target=t, null_target=null, output="tokens")
        close(corrected, ref.masked_fill(mask, 0.0))
        normed = LeGrad(model, skip_final_norm=skip, normalize=True).attribute(
            x, target=t, null_target=null, output="tokens")
        close(normed, min_max(ref.masked_fill(mask, 0.0), 0))
    assert_unchanged(model, before)


# -- options, PLUS / SkipPLUS, errors -----------------------------------------------------------
def test_normalize_is_per_image_min_max_of_the_raw_sum():
    model, x = model_of("vit"), make_inputs("vit")
    raw = LeGrad(model).attribute(x, target=TARGETS, output="tokens")
    normed = LeGrad(model, normalize=True).attribute(x, target=TARGETS, output="tokens")
    lo, hi = raw.amin(1, keepdim=True), raw.amax(1, keepdim=True)
    close(normed, (raw - lo) / (hi - lo))
    close(normed.amin(1), torch.zeros(3, dtype=torch.float64))
    close(normed.amax(1), torch.ones(3, dtype=torch.float64))


@pytest.mark.parametrize("family", ["vit", "map"])
def test_plus_and_skipplus_fast_path_equals_legrad_on_every_subnetwork(family):
    """LeGrad of f_l is the sum of the per-block terms of blocks >= l (not layer-local)."""
    model, x = model_of(family), make_inputs(family)
    for make, starts in ((LeGrad, None),
                         (lambda f: LeGrad(f, layers=[0, 1], normalize=True), [0, 1])):
        fast, slow = (PLUS(model, make, layers=starts, fast=f) for f in (True, False))
        assert (fast.route, slow.route) == ("hook", "method")
        close(fast.attribute(x, target=TARGETS, output="tokens"),
              slow.attribute(x, target=TARGETS, output="tokens"))
    skip = SkipPLUS(model, "legrad")  # L = 3: start block ceil(3/2) = 2
    ref = LeGrad(model, layers=[2]).attribute(x, target=TARGETS, output="tokens")
    close(skip.attribute(x, target=TARGETS, output="tokens"), ref)
    plus = PLUS(model, "legrad").attribute(x, target=TARGETS, output="tokens")
    terms = [LeGrad(model, layers=[l]).attribute(x, target=TARGETS, output="tokens")
             for l in range(3)]
    close(plus, terms[0] + 2 * terms[1] + 3 * terms[2])
    for fast in (True, False):  # start block 2 + offset 1 passes the last block
        with pytest.raises(ValueError, match="layers"):
            PLUS(model, lambda f: LeGrad(f, layers=[1]), fast=fast).attribute(x, target=TARGETS)


def test_errors_name_the_argument():
    model, x = model_of("vit"), make_inputs("vit")
    with pytest.raises(ValueError, match="readout"):
        LeGrad(model, readout="cls")
    with pytest.raises(ValueError, match="layers"):
        LeGrad(model, layers=[3])
    with pytest.raises(ValueError, match="layers"):
        LeGrad(model, layers=[])
    with pytest.raises(TypeError, match="layers"):
        LeGrad(model, layers=2)
    with pytest.raises(TypeError, match="normalize"):
        LeGrad(model, normalize="yes")
    with pytest.raises(TypeError, match="skip_final_norm"):
        LeGrad(model, skip_final_norm=1)
    with pytest.raises(ValueError, match="null_target"):
        LeGrad(model).attribute(x, target=TARGETS, null_target=torch.ones(32))
    with pytest.raises(ValueError, match="null_threshold"):
        LeGrad(model).attribute(x, target=TARGETS, null_threshold=1.5)
    with pytest.raises(ValueError, match="score"):
        LeGrad(model).attribute(x, target=TARGETS, score="prob")
