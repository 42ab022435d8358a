"""The fast paths of the trace equal the exact computations (float64), never by timing.

- TokenTM on the streamed fused-attention trace == the same recursion on an explicit
  trace (every ``[B, H, N, N]`` kept, autograd through the explicit softmax); Rollout's,
  RawAttention's and GAE's fast paths are checked in their own modules
  (tests/methods/test_rollout.py, test_raw_attention.py, test_gae.py).
- The fused trace's recomputed probabilities and their gradients are the explicit ones;
  ``on_block`` streams records; gradient traces never reach the model's parameters.
"""

from __future__ import annotations

import pytest
import torch

from captum_vit import GAE, DecompX, Rollout, TokenTM
from captum_vit._base import gradients, readout_rows, target_scores
from captum_vit.adapters import adapt
from tests.helpers import (
    TOKEN_FAMILIES,
    assert_close_scaled,
    assert_close_to_reference,
    assert_unchanged,
    family_marks,
    make_inputs,
    make_model,
    snapshot,
)

TARGET = torch.tensor([1, 3])


def _explicit(model, x, target=TARGET):
    """An explicit gradient trace with ``∂s/∂A_l`` of every block (the slow path)."""
    ad = adapt(model)
    with torch.enable_grad():
        tr = ad.trace(x, grad=True)
        grads = gradients(target_scores(tr.logits, target), [r.attn for r in tr.blocks])
    return ad, tr, grads


def test_fused_trace_recomputes_probabilities_and_their_gradients():
    model, x = make_model("layerscale"), make_inputs("layerscale", batch=2)
    ad, tr, grads = _explicit(model, x)
    kept = []
    with torch.enable_grad():
        fused = ad.trace(x, grad=True, attention="fused",
                         on_block=lambda l, rec: kept.append((l, rec)))
        heads = [rec.heads for _, rec in kept]
        g_o = gradients(target_scores(fused.logits, TARGET), [h.o for h in heads])
    assert fused.blocks == [] and [l for l, _ in kept] == list(range(len(tr.blocks)))
    assert all(rec.attn is None for _, rec in kept)
    assert_close_scaled(fused.logits, tr.logits)
    for rec, h, g, go in zip(tr.blocks, heads, grads, g_o, strict=True):
        assert_close_scaled(h.probs(), rec.attn)
        assert_close_scaled(h.probs_grad(go), g)


@pytest.mark.parametrize("variant", ["paper", "residual"])
def test_tokentm_streamed_equals_explicit_trace(variant):
    """TokenTM's streamed path against its recursion on an explicit trace (the block
    weights from the recorded tensors, ∇A from autograd through the explicit softmax)."""
    from captum_vit.methods.tokentm import head_weights, transformation_weights

    model, x = make_model("vit"), make_inputs("vit", batch=2)
    ad = adapt(model)
    score = "probability" if variant == "paper" else "logit"
    with torch.enable_grad():
        tr = ad.trace(x, grad=True)
        grads = gradients(target_scores(tr.logits, TARGET, score), [r.attn for r in tr.blocks])
    r = readout_rows(tr)
    with torch.no_grad():
        for rec, p, g in zip(reversed(tr.blocks), reversed(ad.blocks), reversed(grads),
                             strict=True):
            a = rec.attn
            if variant == "paper":
                r = r * (1 + transformation_weights(rec.mid, rec.ffn_out))
                w = head_weights(rec.x, rec.u, p.v_weight, p.proj_weight, p.num_heads)
                rh = torch.einsum("bn,bhnm->bhm", r, g.relu() * a)
                r = r + (rh * w).mean(1)
            else:
                r = r * (1 + transformation_weights(rec.mid, rec.out))
                m = a.mean(1) * g.relu().mean(1)
                r = r + torch.einsum("bn,bnm->bm", r, m) * transformation_weights(rec.x,
                                                                                  rec.mid)
        ref = (r * tr.x0.norm(dim=-1))[:, 1:]
    out = TokenTM(model, variant=variant).attribute(x, target=TARGET, output="tokens")
    assert_close_to_reference(out, ref, rel=1e-12)


def test_gradient_traces_never_reach_the_parameters():
    """A gradient trace runs on detached parameter views: the logits do not depend on
    the blocks' or head's parameters in autograd, and no method touches the model."""
    model, x = make_model("vit"), make_inputs("vit", batch=2)
    before = snapshot(model)
    tr = adapt(model).trace(x, grad=True)
    params = [model.blocks[0].attn.qkv.weight, model.blocks[-1].mlp.fc2.weight,
              model.head.weight]
    assert all(g is None for g in torch.autograd.grad(tr.logits.sum(), params,
                                                      allow_unused=True))
    assert tr.logits.requires_grad
    for method in (GAE(model), TokenTM(model), DecompX(model), Rollout(model)):
        method.attribute(x, target=TARGET)
    assert_unchanged(model, before)


def test_trace_rejects_unknown_attention_and_fused_with_ops():
    ad = adapt(make_model("vit"))
    x = make_inputs("vit", batch=1)
    with pytest.raises(ValueError, match="attention must be"):
        ad.trace(x, attention="flash")
    from captum_vit.adapters import Ops

    with pytest.raises(ValueError, match="own ops"):
        ad.trace(x, attention="fused", ops=Ops())


@pytest.mark.parametrize("family", ["vit", "distilled", "registers"])
def test_last_rows_trace_gives_the_full_logits_and_gradients(family):
    model, x = make_model(family), make_inputs(family, batch=2)
    ad = adapt(model)
    rows = ad.readout_row_count
    assert rows == (2 if family == "distilled" else 1)  # the rows the head reads
    with torch.enable_grad():
        full = ad.trace(x, grad=True)
        short = ad.trace(x, grad=True, last_rows=rows)
        g_full = gradients(target_scores(full.logits, TARGET), [r.attn for r in full.blocks])
        g_short = gradients(target_scores(short.logits, TARGET), [r.attn for r in short.blocks])
    assert short.blocks[-1].out.shape[1] == rows
    assert_close_scaled(short.logits, full.logits)
    for a, b in zip(g_short, g_full, strict=True):
        assert_close_scaled(a, b)
    assert adapt(make_model("avgpool")).readout_row_count is None
    from captum_vit.adapters import Ops

    with pytest.raises(ValueError, match="last_rows"):
        ad.trace(x, last_rows=rows, ops=Ops())


@pytest.mark.parametrize("family", [pytest.param(f, marks=family_marks(f))
                                    for f in TOKEN_FAMILIES])  # removes tokens
def test_run_computes_the_last_block_on_the_readout_rows_only(family):
    """``adapter.run`` restricts the last block to the rows the head reads (class-token
    readouts): the logits equal every block run on every row (1e-12), with and without
    token removal, and the restriction is really taken where it applies."""
    from captum_vit.adapters import FusedOps

    model, x = make_model(family), make_inputs(family)
    ad = adapt(model)
    x0 = ad.embed(x)
    keep = torch.zeros(x0.shape[0], x0.shape[1] - ad.num_prefix, dtype=torch.bool)
    keep[:, ::2] = True
    calls: list = []
    real = ad.block

    def spy(h, l, ops, *a, **k):
        calls.append(k.get("rows"))
        return real(h, l, ops, *a, **k)

    for kept in (None, keep):
        if kept is None:
            h, ops = x0, FusedOps()
        else:  # the kept tokens keep their positions
            h, positions = ad.select_tokens(x0, kept, with_positions=True)
            ops = FusedOps(positions=positions)
        for l in range(ad.num_blocks):  # every row of every block
            h = real(h, l, ops)
        ref = ad.logits(h, ops)
        calls.clear()
        ad.block = spy
        try:
            got = ad.run(x0, keep=kept, ops=FusedOps())
        finally:
            del ad.block
        assert calls[-1] == ad.readout_row_count and set(calls[:-1]) <= {None}
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-12 * (1 + ref.abs().max().item()))
