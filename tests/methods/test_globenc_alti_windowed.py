"""GlobEnc and ALTI on windowed models (Swin, SAM's image encoder): the vector chains
through per-window matrices and merges (equal ¼ weights) equal dense references built
here: every block's ``N × N`` matrix from the reset decomposition of all ``N`` sources at
once (the DecompX rules through the block), row-normalised, and the merges' ``P``; the
block output the decomposition reads is the model's own (before a patch merge)."""

from __future__ import annotations

import pytest
import torch

from captum_vit import ALTI, GlobEnc
from captum_vit.adapters import adapt
from captum_vit.methods.globenc_alti import decompose_block, token_scores, window_scores
from tests.families.test_swin_methods import DenseSwin
from tests.helpers import (
    assert_close_scaled,
    assert_unchanged,
    hf_swin_twin,
    make_inputs,
    make_model,
    make_swin_model,
    needs_transformers,
    snapshot,
)

CLASSES = {"globenc": GlobEnc, "alti": ALTI}


def _dense_matrices(model: torch.nn.Module, x: torch.Tensor, measure: str,
                    mlp: str) -> list[torch.Tensor]:
    """Row-normalised dense ``T_l`` [B, N, N]: all ``N`` reset sources of each block's
    input carried through the block in one pass."""
    adapter = adapt(model)
    out = []
    for l, rec in enumerate(adapter.trace(x).blocks):
        t = token_scores(decompose_block(adapter, rec.x, l, mlp=mlp), measure)
        out.append(t / t.sum(-1, keepdim=True).clamp_min(1e-300))
    return out


def _dense_map(mats: list[torch.Tensor], merges: dict[int, torch.Tensor], r: float
               ) -> torch.Tensor:
    """``w T′_{L-1} P ... T′_0`` with the uniform (mean) readout ``w``."""
    n = mats[-1].shape[-1]
    v = torch.full((mats[-1].shape[0], n), 1.0 / n, dtype=torch.float64)
    for k in reversed(range(len(mats))):
        if k in merges:
            v = v @ merges[k]
        v = (1 - r) * torch.einsum("bn,bnm->bm", v, mats[k]) + r * v
    return v


SWIN_CASES = [("timm_swin_pad", {}),  # padded windows, shifts, one merge
              ("timm_swin", {"img_size": 24, "depths": (2, 2, 2), "num_heads": (2, 2, 2)})]


def _swin(family: str, kw: dict) -> tuple[torch.nn.Module, torch.Tensor]:
    model = make_swin_model(family, **kw)
    size = model.patch_embed.img_size[0]
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(5),
                    dtype=torch.float64)
    return model, x


def _check_chains(model, x, merges, target=None) -> None:
    before = snapshot(model)
    for measure, cls in CLASSES.items():
        for mlp in ("ln2", "decompx"):
            mats = _dense_matrices(model, x, measure, mlp)
            for r in (0.0, 0.5):
                ref = _dense_map(mats, merges, r)
                for fast in (True, False):
                    ours = cls(model, mlp=mlp, residual_strength=r, fast=fast).attribute(
                        x, target, output="tokens")
                    assert ours.shape == ref.shape
                    assert (ours.std(-1) > 0).all()
                    assert_close_scaled(ours, ref, rel=1e-10)
    assert_unchanged(model, before)


@pytest.mark.parametrize(("family", "kw"), SWIN_CASES)
def test_swin_chains_equal_dense_references(family, kw):
    """Both measures, both MLP rules, with and without the residual, fast and carried
    scores: the chain through window-form matrices and merges (¼) equals the dense
    ``N × N`` products."""
    model, x = _swin(family, kw)
    _check_chains(model, x, DenseSwin(model).merges())


@needs_transformers
def test_hf_swin_chains_equal_dense_references():
    """Hugging Face Swin (padded before the shift): the same dense reference."""
    timm_model, x = _swin("timm_swin_pad", {})
    _check_chains(hf_swin_twin(timm_model), x, DenseSwin(timm_model).merges())


def test_sam_chains_equal_dense_references():
    """timm SAM encoder: windowed blocks padded on the grid and a global block, no merge."""
    model = make_model("timm_sam")
    _check_chains(model, make_inputs("timm_sam", batch=2), {})


@needs_transformers
def test_hf_sam_chains_equal_dense_references():
    """Hugging Face SAM encoder (an embedding model: the target is a vector)."""
    from tests.families.test_sam import hf_vision, images

    _check_chains(hf_vision(), images(), {}, target=torch.ones(16, dtype=torch.float64))


@pytest.mark.parametrize("mlp", ["ln2", "decompx"])
def test_window_form_matrices(mlp):
    """``block_matrices`` on Swin: one window-form tensor per block whose dense form is
    the dense reference; rows of real tokens sum to 1 (or 0 for an ALTI row without a
    positive score), padded slots' rows are 0; the
    carried scores (one component per window slot) and chunking agree."""
    model, x = _swin("timm_swin_pad", {})
    adapter = adapt(model)
    for measure, cls in CLASSES.items():
        mats = cls(model, mlp=mlp).block_matrices(x)
        dense = _dense_matrices(model, x, measure, mlp)
        assert isinstance(mats, list) and len(mats) == len(dense)
        for l, (m, d) in enumerate(zip(mats, dense, strict=True)):
            win = adapter.blocks[l].window
            assert m.shape == (2, win.num_windows, win.area, win.area)
            assert_close_scaled(win.dense(m), d, rel=1e-10)
            real = (win.index() >= 0).expand(2, -1, -1)
            rows = m.sum(-1)
            assert (rows[~real] == 0).all()
            if measure == "globenc":
                assert ((rows[real] - 1).abs() < 1e-12).all()
            else:  # an ALTI row whose scores are all 0 stays 0
                assert (((rows[real] - 1).abs() < 1e-12) | (rows[real] == 0)).all()
        slow = cls(model, mlp=mlp, fast=False, max_memory=1).block_matrices(x)
        for m, s in zip(mats, slow, strict=True):
            assert_close_scaled(s, m, rel=1e-10)


def test_reset_decomposition_reads_the_models_block_outputs():
    """The block output the reset decomposition ends on is the model's own (timm's
    stage-final block output, before the next stage's merge), and with ``mlp="decompx"``
    the window-slot components plus the bias source sum to it."""
    model, x = _swin("timm_swin_pad", {})
    outs: list[torch.Tensor] = []
    hooks = [b.register_forward_hook(lambda m, a, o: outs.append(o))
             for st in model.layers for b in st.blocks]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    adapter = adapt(model)
    tr = adapter.trace(x)
    for l, rec in enumerate(tr.blocks):
        h = decompose_block(adapter, rec.x, l, mlp="decompx", bias=True)
        ref = outs[l].reshape(h.real.shape)
        assert_close_scaled(h.real, ref, rel=1e-12)
        assert_close_scaled(h.parts.sum(1), ref, rel=1e-10)
        t = window_scores(adapter, rec.x, l, "globenc", mlp="decompx")
        dense = token_scores(decompose_block(adapter, rec.x, l, mlp="decompx"), "globenc")
        assert_close_scaled(adapter.blocks[l].window.dense(t), dense, rel=1e-10)


def test_window_scores_refuses_a_global_block():
    model = make_model("vit")
    adapter = adapt(model)
    x0 = adapter.embed(make_inputs("vit", batch=1))
    with pytest.raises(ValueError, match="globally"):
        window_scores(adapter, x0, 1, "alti")


@pytest.mark.parametrize("aggregate", ["subnetwork", "layer"])
def test_plus_maps_on_swin_equal_dense_references(aggregate):
    """The PLUS / SkipPLUS fast path on Swin: every start block's map (``subnetwork``: the
    rollout from the top down to block ``l``; ``layer``: ``w P ... T_l``), shared down to
    the first grid through the merges below block ``l`` (¼)."""
    model, x = _swin("timm_swin", {"img_size": 24, "depths": (2, 2, 2), "num_heads": (2, 2, 2)})
    merges = DenseSwin(model).merges()
    method = ALTI(model, residual_strength=0.5)
    layers = list(range(len(adapt(model).blocks)))
    ours = method.plus_maps(x, None, layers, aggregate=aggregate)
    mats = _dense_matrices(model, x, "alti", "ln2")
    n = mats[-1].shape[-1]
    w = torch.full((2, n), 1.0 / n, dtype=torch.float64)
    rows, v = {}, w
    for k in reversed(layers):
        if k in merges:
            v, w = v @ merges[k], w @ merges[k]
        rows[k] = (torch.einsum("bn,bnm->bm", w, mats[k]) if aggregate == "layer"
                   else 0.5 * torch.einsum("bn,bnm->bm", v, mats[k]) + 0.5 * v)
        v = rows[k] if aggregate == "subnetwork" else v
    for l in layers:
        ref = rows[l]
        for k in sorted((k for k in merges if k < l), reverse=True):
            ref = ref @ merges[k]
        assert_close_scaled(ours[l], ref, rel=1e-10)
