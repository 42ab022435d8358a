"""GlobEnc and ALTI (SPEC_NEXT §8.2) against a slow float64 reference written from the
spec: timm's own forward supplies the real block inputs, attention probabilities, LN2
inputs, MLP pre-activations and block outputs (hooks), and the reference decomposes
each block source by source and scores every token pair in Python loops."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from captum_vit.adapters import adapt
from captum_vit.methods.globenc_alti import ALTI, GlobEnc, decompose_block
from tests.helpers import (
    EMBEDDING_FAMILIES,
    TOKEN_FAMILIES,
    assert_unchanged,
    embedding_dim,
    family_marks,
    make_inputs,
    make_model,
    snapshot,
)

TOL = 1e-10
CLASSES = {"globenc": GlobEnc, "alti": ALTI}
_MODELS: dict[tuple[str, int], torch.nn.Module] = {}


def model_of(family: str, depth: int = 2) -> torch.nn.Module:
    key = (family, depth)
    if key not in _MODELS:
        _MODELS[key] = make_model(family, depth=depth)
    return _MODELS[key]


def close(a: torch.Tensor, b: torch.Tensor, tol: float = TOL) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a - b).abs().max().item()
    assert err <= tol * (1 + b.abs().max().item()), f"max abs error {err:.3g}"


# -- the reference ------------------------------------------------------------------------
def capture(model: torch.nn.Module, x: torch.Tensor) -> list[dict]:
    """Per block, from timm's own forward (a deep copy, attention unfused): input ``x``,
    probabilities ``A``, LN2 input ``mid``, MLP pre-activation ``z``, output ``out``."""
    model = copy.deepcopy(model)
    recs: list[dict] = [{} for _ in model.blocks]
    for rec, blk in zip(recs, model.blocks, strict=True):
        blk.attn.fused_attn = False
        blk.register_forward_pre_hook(lambda m, a, r=rec: r.__setitem__("x", a[0]))
        blk.attn.attn_drop.register_forward_hook(lambda m, a, o, r=rec: r.__setitem__("A", o))
        blk.norm2.register_forward_pre_hook(lambda m, a, r=rec: r.__setitem__("mid", a[0]))
        blk.mlp.fc1.register_forward_hook(lambda m, a, o, r=rec: r.__setitem__("z", o))
        blk.register_forward_hook(lambda m, a, o, r=rec: r.__setitem__("out", o))
    with torch.no_grad():
        model(x)
    return recs


def gammas(blk) -> tuple[torch.Tensor | float, torch.Tensor | float]:
    """LayerScale of the attention and MLP branches (timm ViT ``ls1``/``ls2``, BEiT
    ``gamma_1``/``gamma_2``); 1 without."""
    if getattr(blk, "gamma_1", None) is not None:
        return blk.gamma_1, blk.gamma_2
    return (getattr(blk.ls1, "gamma", 1.0), getattr(blk.ls2, "gamma", 1.0))


def ln_lin(c: torch.Tensor, real: torch.Tensor, ln) -> torch.Tensor:
    """SPEC §3 LayerNorm rule: statistics of the real rows, each component centred by its
    own mean, scaled by gamma, no beta."""
    sigma = torch.sqrt(real.var(-1, unbiased=False) + ln.eps)[:, None]
    return (c - c.mean(-1, keepdim=True)) / sigma * ln.weight


def reference_vectors(blk, rec: dict, b: int, mlp: str) -> torch.Tensor:
    """``v[i, j]`` [N, N, D] of image ``b``: source token ``j`` of the block input carried
    through the block alone, biases dropped."""
    x, attn, mid, z = rec["x"][b], rec["A"][b], rec["mid"][b], rec["z"][b]
    n, d = x.shape
    heads = blk.attn.num_heads
    w_v = blk.attn.qkv.weight[2 * d:]
    g1, g2 = gammas(blk)
    gate = F.gelu(z) / z
    v = torch.zeros(n, n, d, dtype=x.dtype)
    for j in range(n):
        c = torch.zeros_like(x)
        c[j] = x[j]
        val = (ln_lin(c, x, blk.norm1) @ w_v.T).reshape(n, heads, d // heads)
        mix = torch.einsum("hit,the->ihe", attn, val).reshape(n, d)
        mid_c = c + g1 * (mix @ blk.attn.proj.weight.T)
        u2 = ln_lin(mid_c, mid, blk.norm2)
        if mlp == "ln2":
            branch = u2
        else:
            branch = ((u2 @ blk.mlp.fc1.weight.T) * gate) @ blk.mlp.fc2.weight.T
        v[:, j] = mid_c + g2 * branch
    return v


def reference_matrices(model, x: torch.Tensor, measure: str, mlp: str) -> torch.Tensor:
    """Row-normalised ``T_l`` [L, B, N, N], every entry from its own loop iteration."""
    recs = capture(model, x)
    out = []
    with torch.no_grad():
        for blk, rec in zip(model.blocks, recs, strict=True):
            bsz, n, _ = rec["x"].shape
            t = torch.zeros(bsz, n, n, dtype=x.dtype)
            for b in range(bsz):
                v = reference_vectors(blk, rec, b, mlp)
                o = rec["out"][b]
                for i in range(n):
                    for j in range(n):
                        if measure == "globenc":
                            t[b, i, j] = v[i, j].pow(2).sum().sqrt()
                        else:
                            t[b, i, j] = max(0.0, (o[i].abs().sum()
                                                   - (o[i] - v[i, j]).abs().sum()).item())
                t[b] = t[b] / t[b].sum(-1, keepdim=True)
            out.append(t)
    return torch.stack(out)


# -- tests --------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["vit", "beit"])
@pytest.mark.parametrize("mlp", ["ln2", "decompx"])
@pytest.mark.parametrize("measure", ["globenc", "alti"])
def test_block_matrices_match_the_slow_reference(family, mlp, measure):
    """T_l of the method equals the per-pair reference (float64, 1e-10); rows are
    non-negative and sum to 1."""
    model = model_of(family)
    x = make_inputs(family, batch=2)
    before = snapshot(model)
    ours = CLASSES[measure](model, mlp=mlp).block_matrices(x)
    ref = reference_matrices(model, x, measure, mlp)
    close(ours, ref)
    assert (ours >= 0).all()
    close(ours.sum(-1), torch.ones_like(ours[..., 0]))
    if measure == "alti":  # ALTI's max(0, ·) bites on these models
        assert (ours == 0).any()
    assert_unchanged(model, before)


@pytest.mark.parametrize("family", ["vit", "beit"])
def test_reset_decomposition_is_complete(family):
    """mlp='decompx': the N source vectors plus the (dropped) bias part sum to the real
    block output (timm's own), and dropping the bias source leaves the token parts
    unchanged; mlp='ln2': they sum to x_mid + ls2 ⊙ LN2(x_mid)."""
    model = model_of(family)
    x = make_inputs(family, batch=2)
    adapter = adapt(model)
    recs = capture(model, x)
    for l, (blk, rec) in enumerate(zip(model.blocks, recs, strict=True)):
        full = decompose_block(adapter, rec["x"], l, mlp="decompx", bias=True)
        tokens = decompose_block(adapter, rec["x"], l, mlp="decompx")
        n = rec["x"].shape[1]
        assert full.parts.shape[1] == n + 1 and tokens.parts.shape[1] == n
        close(full.real, rec["out"])
        close(tokens.parts.sum(1) + full.parts[:, -1], rec["out"])
        close(tokens.parts, full.parts[:, :n])
        ln2 = decompose_block(adapter, rec["x"], l, mlp="ln2", bias=True)
        close(ln2.real, rec["out"])  # the real output is the real block's
        _, g2 = gammas(blk)
        with torch.no_grad():
            close(ln2.parts.sum(1), rec["mid"] + g2 * blk.norm2(rec["mid"]))
        half = decompose_block(adapter, rec["x"], l, mlp="ln2", sources=range(3, 7))
        close(half.parts, ln2.parts[:, 3:7])


@pytest.mark.parametrize("family", ["vit", "beit"])
@pytest.mark.parametrize("residual_strength", [0.0, 0.5])
def test_rollout_is_the_matrix_product(family, residual_strength):
    """attribute = readout row of ((1-r) T_{L-1} + r I) ··· ((1-r) T_0 + r I), prefix
    columns dropped; the target is validated but does not change the map."""
    model = model_of(family, depth=3)
    x = make_inputs(family, batch=2)
    layout = adapt(model).layout(x)
    for cls in (GlobEnc, ALTI):
        method = cls(model, residual_strength=residual_strength)
        mats = method.block_matrices(x)
        eye = torch.eye(mats.shape[-1], dtype=mats.dtype)
        r = eye.expand_as(mats[0])
        for t in mats:
            r = ((1 - residual_strength) * t + residual_strength * eye) @ r
        w = layout.readout_weights(dtype=mats.dtype)
        expected = (w @ r)[:, layout.num_prefix:]
        got = method.attribute(x, output="tokens")
        close(got, expected)
        close(method.attribute(x, [3, 1], output="tokens"), got)
        assert (got >= 0).all()


@pytest.mark.parametrize("cls", [GlobEnc, ALTI])
def test_batch_and_chunk_invariance(cls):
    """A batch equals its images one by one; carrying one source per pass
    (``max_memory=1``) equals carrying all at once."""
    model = model_of("beit")
    x = make_inputs("beit", batch=3)
    method = cls(model, mlp="decompx", max_memory=None)
    mats = method.block_matrices(x)
    close(mats, torch.cat([method.block_matrices(x[i:i + 1]) for i in range(3)], dim=1))
    close(cls(model, mlp="decompx", max_memory=1).block_matrices(x), mats)
    tokens = method.attribute(x, output="tokens")
    close(tokens, torch.cat([method.attribute(x[i:i + 1], output="tokens")
                             for i in range(3)]))


@pytest.mark.parametrize("family", [pytest.param(f, marks=family_marks(f))
                                    for f in [*TOKEN_FAMILIES, *EMBEDDING_FAMILIES]])
def test_every_family(family):  # Swin: refused by name (tests/families/test_timm_swin.py)
    """Every supported family: rows sum to 1, the exact block decomposition is complete,
    and the map is finite (embedding models with a vector target)."""
    model = model_of(family, depth=1)
    x = make_inputs(family, batch=2)
    before = snapshot(model)
    adapter = adapt(model)
    x0 = adapter.embed(x)
    h = decompose_block(adapter, x0, 0, mlp="decompx", bias=True)
    close(h.parts.sum(1), h.real)
    close(h.real, adapter.trace(x).blocks[0].out)
    target = None
    if family in EMBEDDING_FAMILIES:
        target = torch.randn(embedding_dim(model), dtype=x.dtype)
    for cls in (GlobEnc, ALTI):
        method = cls(model)
        mats = method.block_matrices(x)
        # the one-pass scores (reset_scores) == the N reset sources carried through
        close(mats, cls(model, fast=False).block_matrices(x))
        close(cls(model, max_memory=1).block_matrices(x), mats)  # one output row per pass
        assert (mats >= 0).all()
        close(mats.sum(-1), torch.ones_like(mats[..., 0]))
        out = method.attribute(x, target, output="tokens")
        assert out.shape == (2, adapter.layout(x).num_patches) and torch.isfinite(out).all()
    assert_unchanged(model, before)


def test_half_precision_gives_float32():
    model = make_model("vit", depth=1, dtype=torch.bfloat16)
    x = make_inputs("vit", batch=2, dtype=torch.bfloat16)
    method = ALTI(model)
    mats = method.block_matrices(x)
    assert mats.dtype == torch.float32 and torch.isfinite(mats).all()
    out = method.attribute(x, output="tokens")
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_clear_errors():
    model = model_of("vit")
    x = make_inputs("vit", batch=2)
    with pytest.raises(ValueError, match="mlp"):
        GlobEnc(model, mlp="ffn")
    with pytest.raises(ValueError, match="residual_strength"):
        ALTI(model, residual_strength=1.5)
    with pytest.raises(TypeError, match="residual_strength"):
        ALTI(model, residual_strength=True)
    with pytest.raises(ValueError, match="max_memory"):
        GlobEnc(model, max_memory=0)
    method = GlobEnc(model)
    with pytest.raises(TypeError, match=r"torch\.float32.*torch\.float64"):
        method.block_matrices(x.float())
    with pytest.raises(ValueError, match="inputs"):
        method.block_matrices(x[0])
    with pytest.raises(ValueError, match="target"):
        method.attribute(x, 5)
    with pytest.raises(ValueError, match="output"):
        method.attribute(x, output="heatmap")
    adapter = adapt(model)
    with pytest.raises(ValueError, match="sources"):
        decompose_block(adapter, adapter.embed(x), 0, sources=range(0, 99))
    with pytest.raises(ValueError, match="mlp"):
        decompose_block(adapter, adapter.embed(x), 0, mlp="none")
