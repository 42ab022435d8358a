"""Hugging Face TimeSformer (divided space-time, joint space-time, space-only): the canonical
forward against the model's own, the reductions (one frame, joint = plain ViT), the
structured token maps against dense references built here, DecompX's completeness and the
clear errors (SPEC_FRONTIER §16)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from captum_vit.adapters import adapt, catalog
from captum_vit.methods import DecompX
from captum_vit.registry import build_method
from tests.helpers import assert_unchanged, needs_transformers, snapshot

pytestmark = needs_transformers

TOL = dict(rtol=0, atol=1e-12)


def build(example="hf_timesformer", **overrides):
    return catalog.example(example)[1].model(**overrides)


def video(frames, batch=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, frames, 3, 16, 16, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("attention_type", ["divided_space_time", "joint_space_time"])
@pytest.mark.parametrize("frames", [2, 3])
def test_forward_equals_the_models_own(attention_type, frames):
    model = build(num_frames=frames, attention_type=attention_type)
    before = snapshot(model)
    a, x = adapt(model), video(frames)
    with torch.no_grad():
        ref = model(pixel_values=x).logits
        torch.testing.assert_close(a.run(a.embed(x)), ref, **TOL)
        # the states in frame-major order are the model's (patch, frame) order permuted
        hidden = model.timesformer(pixel_values=x).last_hidden_state
        ours = a.trace(x, logits=True).states[-1]
        b, n, d = hidden.shape
        perm = hidden[:, 1:].reshape(b, (n - 1) // frames, frames, d).transpose(1, 2)
        final = model.timesformer.layernorm
        ln = final(ours)
        torch.testing.assert_close(ln[:, 1:], perm.reshape(b, n - 1, d), **TOL)
    layers = model.config.num_hidden_layers
    assert len(a.blocks) == (2 if attention_type == "divided_space_time" else 1) * layers
    assert_unchanged(model, before)


def test_embedding_model_and_space_only_forward():
    model = build("hf_timesformer_model")
    a, x = adapt(model), video(2)
    with torch.no_grad():
        ref = model(pixel_values=x).last_hidden_state[:, 0]
        torch.testing.assert_close(a.run(a.embed(x)), ref, **TOL)
    assert a.embedding
    so = build(attention_type="space_only")
    a, img = adapt(so), video(1)[:, 0]
    assert not a.video
    with torch.no_grad():  # an image classifier applied per frame: logits [B·T, classes]
        torch.testing.assert_close(a.run(a.embed(img)), so(pixel_values=img[:, None]).logits,
                                   **TOL)
        assert so(pixel_values=video(3)).logits.shape == (6, 5)
    with pytest.raises(ValueError, match=r"\[B, C, H, W\]"):
        build_method("rollout", so).attribute(video(3), target=0)
    with pytest.raises(ValueError, match="space_only.*flatten"):
        a.check_inputs(video(3))


# -- dense references written here --------------------------------------------------------
def dense_temporal(attn, frames, patches):
    """The temporal half's token map [B, H, N, N] from its probabilities [B, H, 1 + P, T, T]:
    patch p of frame t mixes the patch p of every frame; the class token is unchanged."""
    b, h = attn.shape[:2]
    n = 1 + frames * patches
    out = attn.new_zeros(b, h, n, n)
    out[..., 0, 0] = attn[:, :, 0, 0, 0]
    for p in range(patches):
        for t in range(frames):
            for s in range(frames):
                out[..., 1 + t * patches + p, 1 + s * patches + p] = attn[:, :, 1 + p, t, s]
    return out


def dense_spatial(attn, frames, patches):
    """The spatial half's token map [B, H, N, N] from its per-frame probabilities
    [B, H, T, 1 + P, 1 + P]: the class token's row is its rows' mean over the frames."""
    b, h = attn.shape[:2]
    n = 1 + frames * patches
    out = attn.new_zeros(b, h, n, n)
    for t in range(frames):
        tok = [0] + [1 + t * patches + p for p in range(patches)]
        for i, ti in enumerate(tok):
            for j, tj in enumerate(tok):
                w = 1.0 / frames if ti == 0 else 1.0
                out[..., ti, tj] += w * attn[:, :, t, i, j]
    return out


def dense_maps(a, x):
    tr = a.trace(x)
    frames, patches = x.shape[1], (x.shape[-1] // 8) * (x.shape[-2] // 8)
    mats = []
    for l, rec in enumerate(tr.blocks):
        build_dense = dense_temporal if l % 2 == 0 else dense_spatial
        mats.append(build_dense(rec.attn, frames, patches))
    return tr, mats


def test_spatial_probabilities_are_the_models_and_dense_forms_agree():
    model = build(num_frames=3)
    a, x = adapt(model), video(3)
    with torch.no_grad():
        tr, mats = dense_maps(a, x)
        hf = model(pixel_values=x, output_attentions=True).attentions  # spatial only
    for l, att in enumerate(hf):
        ours = tr.blocks[2 * l + 1].attn  # [B, H, T, 1 + P, 1 + P]
        torch.testing.assert_close(ours.transpose(1, 2).reshape(att.shape), att, **TOL)
    for l, m in enumerate(mats):
        win = a.stages.window(l)
        torch.testing.assert_close(win.dense(tr.blocks[l].attn), m, **TOL)
        v = torch.randn(2, 2, m.shape[-1], dtype=torch.float64)
        torch.testing.assert_close(a.stages.token_mix(v, tr.blocks[l].attn, l),
                                   torch.einsum("bhn,bhnm->bhm", v, m), **TOL)
        torch.testing.assert_close(m.sum(-1), torch.ones_like(m.sum(-1)), **TOL)  # stochastic


def test_rollout_is_the_dense_chain_and_the_block_map_is_the_product():
    model = build(num_frames=3)
    a, x = adapt(model), video(3)
    with torch.no_grad():
        _, mats = dense_maps(a, x)
    ref = None
    n = mats[0].shape[-1]
    eye = torch.eye(n, dtype=torch.float64)
    for m in mats:  # rollout: row-normalised (Ā + I), chained from the first block
        r = m.mean(1) + eye
        r = r / r.sum(-1, keepdim=True)
        ref = r if ref is None else r @ ref
    got = build_method("rollout", model).attribute(x, target=0, output="tokens")
    torch.testing.assert_close(got, ref[:, 0, 1:], **TOL)
    # raw attention of the last (spatial) block: its dense map's class-token row
    raw = build_method("raw_attention", model).attribute(x, target=0, output="tokens")
    torch.testing.assert_close(raw, mats[-1].mean(1)[:, 0, 1:], **TOL)


def test_one_frame_equals_its_spatial_only_form():
    """With one frame the temporal attention of each patch is over itself (probability 1)
    and the spatial window is the whole sequence: the maps equal those of the same blocks
    with global attention (the plain ViT form)."""
    model = build(num_frames=1)
    a, x = adapt(model), video(1)
    with torch.no_grad():
        torch.testing.assert_close(a.run(a.embed(x)), model(pixel_values=x).logits, **TOL)
        tr = a.trace(x)
    for l in range(0, len(a.blocks), 2):
        torch.testing.assert_close(tr.blocks[l].attn, torch.ones_like(tr.blocks[l].attn))
    names = ["rollout", "gae", "decompx", "attnlrp", "token_ixg", "tokentm", "chefer21"]
    want = {n: build_method(n, model).attribute(x, target=[0, 3], output="tokens")
            for n in names}
    blocks = a.blocks
    try:
        a.blocks = [dataclasses.replace(p, window=None) if l % 2 else p
                    for l, p in enumerate(blocks)]
        assert not a.stages.window(1)
        with torch.no_grad():
            torch.testing.assert_close(a.run(a.embed(x)), model(pixel_values=x).logits, **TOL)
        for n in names:
            got = build_method(n, model).attribute(x, target=[0, 3], output="tokens")
            torch.testing.assert_close(got, want[n], rtol=0, atol=1e-10)
    finally:
        a.blocks = blocks


def plain_vit(model, x):
    """A hand-written pre-LN ViT on the joint model's parameters, patch-major tokens."""
    tf = model.timesformer
    emb = tf.embeddings(x)
    ln = torch.nn.functional.layer_norm
    for layer in tf.encoder.layer:
        d = emb.shape[-1]
        u = ln(emb, (d,), layer.layernorm_before.weight, layer.layernorm_before.bias, 1e-6)
        att = layer.attention.attention
        q, k, v = (u @ att.qkv.weight.T + att.qkv.bias).chunk(3, -1)
        def split(z, d=d):
            return z.reshape(*z.shape[:2], 2, d // 2).transpose(1, 2)

        q, k, v = split(q), split(k), split(v)
        p = ((q @ k.transpose(-1, -2)) * (d // 2) ** -0.5).softmax(-1)
        o = (p @ v).transpose(1, 2).reshape(emb.shape)
        emb = emb + layer.attention.output.dense(o)
        u2 = ln(emb, (d,), layer.layernorm_after.weight, layer.layernorm_after.bias, 1e-6)
        emb = emb + layer.output.dense(layer.intermediate(u2))
    d = emb.shape[-1]
    final = ln(emb, (d,), tf.layernorm.weight, tf.layernorm.bias, 1e-6)
    return model.classifier(final[:, 0])


def test_joint_space_time_is_the_plain_form():
    model = build("hf_timesformer_joint", num_frames=3)
    a, x = adapt(model), video(3)
    assert not a.stages.has_windows
    with torch.no_grad():
        torch.testing.assert_close(a.run(a.embed(x)), plain_vit(model, x), **TOL)
        att = model(pixel_values=x, output_attentions=True).attentions
    # rollout from the model's own attentions, patch-major tokens put frame-major
    n = att[0].shape[-1]
    eye = torch.eye(n, dtype=torch.float64)
    ref = None
    for m in att:
        r = m.mean(1) + eye
        r = r / r.sum(-1, keepdim=True)
        ref = r if ref is None else r @ ref
    row = ref[:, 0, 1:].reshape(2, 4, 3).transpose(1, 2).reshape(2, 12)
    got = build_method("rollout", model).attribute(x, target=0, output="tokens")
    torch.testing.assert_close(got, row, **TOL)


@pytest.mark.parametrize("example", ["hf_timesformer", "hf_timesformer_joint"])
def test_decompx_is_complete_and_batch_invariant(example):
    model = build(example)
    before = snapshot(model)
    x, t = video(2, batch=3), torch.tensor([0, 2, 4])
    with torch.no_grad():
        y = model(pixel_values=x).logits.gather(1, t[:, None])[:, 0]
    for s in (0, 1):
        res = DecompX(model, start_layer=s).decompose(x, t)
        torch.testing.assert_close(res.tokens.sum(-1) + res.bias, y, rtol=0, atol=1e-10)
    res = DecompX(model, route="explicit").decompose(x, t)
    torch.testing.assert_close(res.tokens.sum(-1) + res.bias, y, rtol=0, atol=1e-10)
    for name in ("decompx", "attnlrp", "cp_lrp", "gae"):
        m = build_method(name, model)
        batch = m.attribute(x, target=t, output="tokens")
        one = torch.cat([m.attribute(x[i:i + 1], target=int(t[i]), output="tokens")
                         for i in range(3)])
        torch.testing.assert_close(batch, one, rtol=1e-9, atol=1e-12)
    assert_unchanged(model, before)


def test_input_x_gradient_is_the_models_own():
    """Pixel IxG through the canonical forward equals the model's own autograd; token IxG
    at block 0 sums to the first-order term of the embedding."""
    model = build()
    x = video(2)
    a = adapt(model)
    xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    a.run(a.embed(xr))[:, 1].sum().backward()
    model(pixel_values=xo).logits[:, 1].sum().backward()
    torch.testing.assert_close(x * xr.grad, x * xo.grad, **TOL)
    x0 = a.embed(x).detach().requires_grad_()
    a.run(x0)[:, 1].sum().backward()
    tok = build_method("token_ixg", model).attribute(x, target=1, output="tokens")
    torch.testing.assert_close(tok, (x0 * x0.grad).sum(-1)[:, 1:], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", ["attnlrp", "cp_lrp"])
def test_lrp_reaches_the_pixels_through_the_frame_projection(name):
    from captum_vit.methods import CPLRP, AttnLRP

    cls = {"attnlrp": AttnLRP, "cp_lrp": CPLRP}[name]
    model = build()
    before = snapshot(model)
    x = video(2)
    pix = cls(model, at="pixels").attribute(x, target=[1, 3], output="tokens")
    tok = cls(model).attribute(x, target=[1, 3], output="tokens")
    assert pix.shape == tok.shape == (2, 8) and torch.isfinite(pix).all()
    assert pix.abs().sum() > 0
    assert_unchanged(model, before)


def test_clear_errors():
    model = build()
    before = snapshot(model)
    m = build_method("gae", model)
    with pytest.raises(ValueError, match="3 frames.*num_frames=2"):
        m.attribute(video(3), target=0)
    with pytest.raises(ValueError, match=r"\[B, C, T, H, W\].*permute"):
        m.attribute(video(3).transpose(1, 2)[:, :, :2].contiguous().transpose(1, 2)
                    .permute(0, 2, 1, 3, 4), target=0)
    with pytest.raises(ValueError, match="not a video"):
        m.attribute(video(2)[:, 0], target=0)
    with pytest.raises(ValueError, match="image_size"):
        m.attribute(torch.zeros(1, 2, 3, 24, 24, dtype=torch.float64), target=0)
    with pytest.raises(ValueError, match="within windows"):
        build_method("tis", model).attribute(video(2), target=0, n_masks=4)
    with pytest.raises(ValueError, match="RISE and ViT-CX do not apply"):
        build_method("rise", model).attribute(video(2), target=0, n_masks=4)
    assert_unchanged(model, before)


def test_gradient_at_spatial_probabilities_is_the_dense_matrix_gradient():
    """The spatial probabilities come with ∂s/∂C of the dense token map: the model's own
    gradient at its attention probabilities, times T on the class-token rows (the class
    token's output is the mean of its T frame rows)."""
    model = build(num_frames=3)
    a, x = adapt(model), video(3)
    tr = a.trace(x, grad=True)
    score = tr.logits[:, 2].sum()
    ours = torch.autograd.grad(score, [r.attn for r in tr.blocks[1::2]])
    out = model(pixel_values=x, output_attentions=True)
    hf = torch.autograd.grad(out.logits[:, 2].sum(), out.attentions)
    for g, h in zip(ours, hf, strict=True):
        ref = h.reshape(2, 3, *h.shape[1:]).transpose(1, 2).clone()  # [B, H, T, 1+P, 1+P]
        ref[..., 0, :] *= 3
        torch.testing.assert_close(g, ref, **TOL)


@pytest.mark.parametrize("attention", ["explicit", "fused"])
def test_gae_is_the_dense_chain(attention, monkeypatch):
    """GAE through the structured maps equals R ← R + mean_h((∂s/∂C) ⊙ C)⁺ R on the dense
    matrices built here, on the explicit trace and on the fused one (probabilities and
    their gradients recomputed per block)."""
    model = build(num_frames=3)
    a, x = adapt(model), video(3)
    tr = a.trace(x, grad=True)
    attns = [r.attn for r in tr.blocks]
    grads = torch.autograd.grad(tr.logits[:, 1].sum(), attns)
    frames, patches = 3, 4
    v = torch.zeros(2, 1 + frames * patches, dtype=torch.float64)
    v[:, 0] = 1
    for l in reversed(range(len(attns))):
        prod = (grads[l] * attns[l]).detach()
        build_dense = dense_temporal if l % 2 == 0 else dense_spatial
        m = build_dense(prod, frames, patches).clamp(min=0).mean(1)
        v = v + torch.einsum("bn,bnm->bm", v, m)
    if attention == "fused":
        monkeypatch.setattr(type(a), "small_attention", lambda self, inputs, **_: False)
    got = build_method("gae", model).attribute(x, target=1, output="tokens")
    torch.testing.assert_close(got, v[:, 1:], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["rollout", "decompx", "token_ixg"])
def test_identical_frames_sum_to_the_one_frame_map(name):
    """T identical frames and a zero time table: every frame carries the one-frame
    model's states (the temporal attention is uniform over identical copies, each frame's
    spatial window is the one-frame sequence, the class token's mean is each frame's), so
    the logits are the one-frame model's and the maps summed over the frames are its maps
    (the class-token rows shared by T windows and averaged back)."""
    many, one = build(num_frames=3), build(num_frames=1)
    with torch.no_grad():
        many.timesformer.embeddings.time_embeddings.zero_()
        state = {k: v for k, v in many.state_dict().items() if "time_embeddings" not in k}
        one.load_state_dict(state, strict=False)
        one.timesformer.embeddings.time_embeddings.zero_()
    x1 = video(1)
    x3 = x1.expand(-1, 3, -1, -1, -1).contiguous()
    with torch.no_grad():
        torch.testing.assert_close(many(pixel_values=x3).logits, one(pixel_values=x1).logits,
                                   rtol=0, atol=1e-12)
    m3 = build_method(name, many).attribute(x3, target=[2, 0], output="tokens")
    m1 = build_method(name, one).attribute(x1, target=[2, 0], output="tokens")
    torch.testing.assert_close(m3.reshape(2, 3, -1).sum(1), m1, rtol=1e-9, atol=1e-12)
