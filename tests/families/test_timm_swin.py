"""Swin Transformer (timm ``SwinTransformer``): the canonical stages against the model's
own forward in float64 (shifted and regular windows, grids padded to whole windows, odd
grids before a merge), the window geometry, and the refusals."""

from __future__ import annotations

import pytest
import torch

from captum_vit.adapters import adapt
from captum_vit.adapters.windows import MERGE_ORDER, Windows
from tests.helpers import WINDOW_REFUSERS, assert_unchanged, make_swin_model, snapshot


def _parity(model: torch.nn.Module, size: int, batch: int = 2) -> float:
    x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(3),
                    dtype=torch.float64)
    adapter = adapt(model)
    with torch.no_grad():
        ref = model(x)
        ours = adapter.run(adapter.embed(x))
    assert ref.abs().max() > 0.1  # a real signal, not a vanishing one
    return (ref - ours).abs().max().item()


@pytest.mark.parametrize(("kwargs", "size"), [
    ({"window_size": 2}, 32),                       # 8x8 / 4x4 grids, windows divide them
    ({"window_size": 3}, 32),                       # 8x8 padded to 9x9, 4x4 to 6x6
    ({"window_size": 3}, 40),                       # 10x10 padded to 12x12, 5x5 to 6x6
    ({"window_size": 2, "depths": (2, 2, 2), "num_heads": (2, 2, 2)}, 24),  # 3x3 merged (odd)
    ({"window_size": 8}, 32),                       # window = the whole first grid, no shift
])
def test_forward_parity(kwargs, size):
    """The canonical forward (windows, shifts, seam masks, padding, relative position bias,
    merges, mean readout) equals ``model(x)`` to 1e-12 in float64."""
    model = make_swin_model("timm_swin", img_size=size, **kwargs)
    before = snapshot(model)
    adapter = adapt(model)
    shifts = [any(b.window.shift) for b in adapter.blocks]
    assert len(shifts) == sum(kwargs.get("depths", (2, 2)))
    assert _parity(model, size) <= 1e-12
    assert_unchanged(model, before)


def test_shift_and_padding_are_exercised():
    """The 40-pixel model has shifted blocks, grids padded to whole windows, and merges."""
    adapter = adapt(make_swin_model("timm_swin_pad"))
    wins = [b.window for b in adapter.blocks]
    assert [w.grid for w in wins] == [(10, 10), (10, 10), (5, 5), (5, 5)]
    assert [w.shift for w in wins] == [(0, 0), (1, 1), (0, 0), (1, 1)]
    assert all(w.padded != w.grid for w in wins)
    assert [b.merge is not None for b in adapter.blocks] == [False, True, False, False]
    assert adapter.layout(torch.zeros(1, 3, 40, 40, dtype=torch.float64)).grid == (10, 10)


def test_wrong_mask_or_bias_breaks_parity():
    """The seam mask and the position bias matter: dropping either changes the logits (so
    the parity test checks them)."""
    import dataclasses

    model = make_swin_model("timm_swin_pad")
    adapter = adapt(model)
    x = torch.randn(2, 3, 40, 40, dtype=torch.float64)
    with torch.no_grad():
        ref = model(x)
        saved = list(adapter.blocks)
        try:
            adapter.blocks[1] = dataclasses.replace(
                saved[1], window=dataclasses.replace(saved[1].window, seam=0.0))
            no_mask = adapter.run(adapter.embed(x))
            adapter.blocks[1] = dataclasses.replace(saved[1], attn_bias=None)
            no_bias = adapter.run(adapter.embed(x))
        finally:
            adapter.blocks[:] = saved
    assert (no_mask - ref).abs().max() > 1e-6
    assert (no_bias - ref).abs().max() > 1e-6


@pytest.mark.parametrize("pad_first", [False, True])
@pytest.mark.parametrize(("grid", "size", "shift"), [
    ((4, 4), (2, 2), (1, 1)), ((5, 7), (3, 2), (1, 1)), ((5, 5), (3, 3), (0, 0))])
def test_window_partition_round_trip(grid, size, shift, pad_first):
    """``reverse(partition(x)) == x``; :meth:`Windows.index` names the token at every slot
    (padded slots -1, each token exactly once)."""
    win = Windows(grid=grid, size=size, shift=shift, pad_first=pad_first)
    n = grid[0] * grid[1]
    x = torch.randn(2, n, 5, dtype=torch.float64)
    parts = win.partition(x)
    assert parts.shape == (2 * win.num_windows, win.area, 5)
    assert torch.equal(win.reverse(parts), x)
    idx = win.index()
    real = idx >= 0
    assert sorted(idx[real].tolist()) == list(range(n))
    assert torch.equal(parts[:win.num_windows][real], x[0][idx[real]])
    assert (parts[:win.num_windows][~real] == 0).all()


def test_seam_mask_matches_regions():
    """Two slots of a shifted window are masked exactly when the tokens they hold were not
    neighbours before the roll (they come from different regions of the rolled grid)."""
    win = Windows(grid=(4, 4), size=(2, 2), shift=(1, 1))
    mask = win.seam_mask(torch.float64)
    idx = win.index()
    assert mask is not None and mask.shape == (4, 4, 4)
    # the first window holds tokens of rows/cols 1..2: one region, no mask
    assert (mask[0] == 0).all()
    # the last window wraps around: tokens (3, 3), (3, 0), (0, 3), (0, 0): four regions
    assert sorted(idx[-1].tolist()) == [0, 3, 12, 15]
    assert (mask[-1] == -100.0).sum() == 12


def test_merge_children_order():
    """The merge concatenates children in the models' order; odd grids get zero rows."""
    model = make_swin_model("timm_swin", img_size=24, window_size=2, depths=(2, 2, 2),
                            num_heads=(2, 2, 2))
    merge = adapt(model).blocks[3].merge
    assert merge is not None and merge.grid == (3, 3) and merge.out_grid == (2, 2)
    assert merge.order == MERGE_ORDER
    children = merge.children()
    assert children[0].tolist() == [0, 3, 1, 4]
    assert children[-1].tolist() == [8, -1, -1, -1]
    x = torch.randn(1, 9, 2, dtype=torch.float64)
    g = merge.gather(x)
    assert torch.equal(g[0, 0], torch.cat([x[0, 0], x[0, 3], x[0, 1], x[0, 4]]))
    assert torch.equal(g[0, -1], torch.cat([x[0, 8], torch.zeros(6, dtype=torch.float64)]))


def test_swin_v2_refused_by_name():
    """The v1 reader refuses a Swin V2 by name; ``adapt`` dispatches it to its own family
    (:mod:`captum_vit.adapters.families.swin_v2`)."""
    from timm.models.swin_transformer_v2 import SwinTransformerV2

    from captum_vit.adapters import TimmSwinAdapter, TimmSwinV2Adapter

    model = SwinTransformerV2(img_size=32, patch_size=4, embed_dim=16, depths=(2,),
                              num_heads=(2,), window_size=4, num_classes=3)
    with pytest.raises(TypeError, match="SwinTransformerV2.*cosine attention"):
        TimmSwinAdapter(model)
    assert isinstance(adapt(model), TimmSwinV2Adapter)


def test_wrong_size_and_token_removal_refused():
    model = make_swin_model("timm_swin")
    adapter = adapt(model)
    with pytest.raises(ValueError, match="fixed image_size"):
        adapter.check_inputs(torch.zeros(1, 3, 40, 40, dtype=torch.float64))
    x0 = adapter.embed(torch.zeros(1, 3, 32, 32, dtype=torch.float64))
    keep = torch.arange(10)[None]
    with pytest.raises(ValueError, match="remove pixels"):
        adapter.run(x0, keep=keep)


@pytest.mark.parametrize("name", sorted(WINDOW_REFUSERS))
def test_methods_without_a_windowed_form_refuse_by_name(name):
    """A method declaring ``removes_tokens`` (TIS's token subsets) names pixel removal,
    the perturbation methods that mask pixels (RISE, ViT-CX) and every registered method
    that runs on windowed models; the model is unchanged."""
    from captum_vit.registry import build_method

    model = make_swin_model("timm_swin")
    before = snapshot(model)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    kw = {"n_masks": 16} if name == "tis" else {}
    match = "within windows.*RISE or ViTCX.*on windowed models run .*Rollout"
    with pytest.raises(ValueError, match=match):
        build_method(name, model).attribute(x, target=[0, 1], **kw)
    assert_unchanged(model, before)


def test_token_removal_metric_refused_names_pixel_removal():
    from captum_vit.metrics import RemovalEngine

    model = make_swin_model("timm_swin")
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    removed = torch.zeros(2, 2, 64, dtype=torch.bool)
    removed[:, 0, :8] = True
    with pytest.raises(ValueError, match="removal='mean', 'black' or 'blur'"):
        RemovalEngine(model, removal="token").masked_logits(x, removed)
    out = RemovalEngine(model, removal="black").masked_logits(x, removed)  # pixels work
    assert out.shape == (2, 2, 5) and torch.isfinite(out).all()


@pytest.mark.parametrize("family", ["timm_swin", "hf_swin"])
def test_parameter_stages_cover_every_parameter_once(family):
    """The model-randomisation stages: the head first, then every block from the top (a
    merge with the block it follows); every parameter once, the patch embedding in none."""
    from tests.helpers import family_marks, make_model

    if family_marks(family):
        pytest.importorskip("transformers")
    model = make_model(family)
    stages = adapt(model).parameter_stages()
    assert len(stages) == 1 + 4
    seen = [id(p) for st in stages for p in st]
    assert len(seen) == len(set(seen))
    embed = {id(p) for n, p in model.named_parameters() if "patch_embed" in n
             or "embeddings" in n}
    assert set(seen) | embed == {id(p) for p in model.parameters()}
    assert not set(seen) & embed
