"""Stage geometry as one object (``adapter.stages``, :mod:`captum_vit.adapters.stages`) and
the engine/family split of :class:`~captum_vit.adapters.ViTAdapter`.

The references are written here: merges as dense 0/1 child matrices built by loops over
the grids, windowed token mixing as the dense ``N × N`` matrix
(:meth:`~captum_vit.adapters.windows.Windows.dense`), float64 throughout.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import captum_vit.adapters as adapters_pkg
from captum_vit.adapters import (
    FAMILY_CONTRACT,
    FAMILY_HOOKS,
    Readout,
    Stages,
    SubnetworkAdapter,
    ViTAdapter,
    adapt,
)
from captum_vit.adapters.scoring import Target
from tests.helpers import assert_close_scaled, make_inputs, make_model, make_swin_model

pytestmark = pytest.mark.lower_bounds  # also run against the oldest supported versions

BASE = Path(adapters_pkg.__file__).with_name("base.py")


def _swin():
    """6x6 -> 3x3 -> 2x2 (an odd grid padded by the second merge), windows of 2x2."""
    return make_swin_model("timm_swin", img_size=24, window_size=2, depths=(2, 2, 2),
                           num_heads=(2, 2, 2))


def _children_matrix(merge) -> torch.Tensor:
    """``P`` [N', N]: 1 where grid token ``n`` is a real child of merged token ``t``."""
    (h, w), (oh, ow) = merge.grid, merge.out_grid
    p = torch.zeros(oh * ow, h * w, dtype=torch.float64)
    for i in range(oh):
        for j in range(ow):
            for dh, dw in merge.order:
                r, c = 2 * i + dh, 2 * j + dw
                if r < h and c < w:
                    p[i * ow + j, r * w + c] = 1.0
    return p


def _shared(p: torch.Tensor) -> torch.Tensor:
    return p / p.sum(1, keepdim=True)


# -- a plain ViT: the identity geometry --------------------------------------------------------
def test_plain_vit_has_the_identity_geometry():
    ad = adapt(make_model("vit"))
    st = ad.stages
    assert isinstance(st, Stages)
    assert not st.hierarchical and not st.has_windows and st.final_tokens is None
    assert st.window(0) is None and st.merge(2) is None
    n = ad.layout(make_inputs("vit")).num_tokens
    g = torch.Generator().manual_seed(0)
    v = torch.randn(2, n, generator=g, dtype=torch.float64)
    c = torch.rand(2, 3, n, n, generator=g, dtype=torch.float64)
    assert st.carry(v, 2, split=True) is v and st.unmerge(v, 1) is v
    assert torch.equal(st.carry_down(v, 0), v) and st.real_keys(c, 1) is c
    assert torch.equal(st.token_eye(0, n, torch.float64), torch.eye(n, dtype=torch.float64))
    # vᵀ C per head, v broadcast over the heads
    ref = torch.stack([torch.stack([v[b] @ c[b, h] for h in range(3)]) for b in range(2)])
    assert_close_scaled(st.token_mix(v, c, 1), ref, 1e-13)


# -- Swin: merges and windows ----------------------------------------------------------------
def test_swin_carry_and_unmerge_match_the_child_matrices():
    ad = adapt(_swin())
    st = ad.stages
    assert st.hierarchical and st.has_windows and st.final_tokens == 4
    assert st.merge(3) is ad.blocks[3].merge is not None and st.merge(2) is None
    assert st.window(5) is ad.blocks[5].window and st.window(5).grid == (2, 2)
    p1, p3 = (_children_matrix(ad.blocks[k].merge) for k in (1, 3))  # 9x36, 4x9
    g = torch.Generator().manual_seed(1)
    top = torch.randn(3, 4, generator=g, dtype=torch.float64)  # on x_6's 2x2 grid
    mid = torch.randn(3, 9, generator=g, dtype=torch.float64)  # on x_2 .. x_4's 3x3 grid
    # copy: each child takes its parent's value; split: shared among the real children
    assert_close_scaled(st.carry(top, 6), top @ p3 @ p1, 1e-13)
    assert_close_scaled(st.carry(top, 6, split=True), top @ _shared(p3) @ _shared(p1), 1e-13)
    assert_close_scaled(st.carry(top, split=True), top @ _shared(p3) @ _shared(p1), 1e-13)
    assert_close_scaled(st.carry(mid, 3, split=True), mid @ _shared(p1), 1e-13)
    assert_close_scaled(st.carry(top, 6, down_to=2), top @ p3, 1e-13)
    # a relevance keeps its sum through the merges (the padded children take no share)
    assert_close_scaled(st.carry(top, 6, split=True).sum(-1), top.sum(-1), 1e-13)
    assert_close_scaled(st.unmerge(top, 3), top @ _shared(p3), 1e-13)
    assert torch.equal(st.unmerge(mid, 2), mid)  # block 2 has no merge
    w = torch.rand(3, 4, 4, generator=g, dtype=torch.float64)  # per child, concat order
    ref = torch.zeros(3, 9, dtype=torch.float64)
    children = ad.blocks[3].merge.children()
    for t in range(4):
        for k, n in enumerate(children[t].tolist()):
            if n >= 0:
                ref[:, n] += top[:, t] * w[:, t, k]
    assert_close_scaled(st.unmerge(top, 3, w), ref, 1e-13)
    assert_close_scaled(st.carry_down(top, 1), top @ _shared(p3) @ _shared(p1), 1e-13)
    assert_close_scaled(st.carry_down(top, 4), top, 1e-13)
    with pytest.raises(ValueError, match="no stage's grid"):
        st.carry(torch.zeros(1, 7, dtype=torch.float64))


def test_swin_token_mix_matches_the_dense_block_matrix():
    ad = adapt(make_swin_model("timm_swin_pad"))
    x = make_inputs("timm_swin_pad", 2)
    tr = ad.trace(x)
    st = ad.stages
    l = next(k for k, p in enumerate(ad.blocks) if p.window is not None)
    win = ad.blocks[l].window
    probs = tr.blocks[l].require_attn().detach()  # [B, H, n_W, M, M]
    n = win.num_tokens
    v = torch.randn(2, n, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    dense = win.dense(probs)  # [B, H, N, N]
    assert_close_scaled(st.token_mix(v, probs, l), torch.einsum("bn,bhnm->bhm", v, dense),
                        1e-13)
    # without the padded slots' columns, a real token's row sums are the dense row's
    keys = st.real_keys(probs, l)
    idx = win.index()
    real = idx >= 0
    sums = torch.zeros(2, probs.shape[1], n, dtype=torch.float64)
    sums[..., idx[real]] = keys.sum(-1)[..., real]
    assert_close_scaled(sums, dense.sum(-1), 1e-13)
    assert torch.equal(st.token_eye(l, n, torch.float64),
                       torch.eye(win.area, dtype=torch.float64))


@pytest.mark.timm_windows  # a timm Swin / SAM: timm >= 1.0.31
def test_a_view_reads_the_model_stages_with_its_block_indices():
    ad = adapt(_swin())
    view = SubnetworkAdapter(ad, 2, 5)
    st, vst = ad.stages, view.stages
    assert vst.hierarchical and vst.final_tokens == st.final_tokens
    assert vst.window(0) is view.blocks[0].window is ad.blocks[2].window
    assert vst.merge(1) is view.blocks[1].merge is ad.blocks[3].merge
    g = torch.Generator().manual_seed(3)
    top = torch.randn(2, 4, generator=g, dtype=torch.float64)
    mid = torch.randn(2, 9, generator=g, dtype=torch.float64)
    assert torch.equal(vst.carry(top, 2, split=True), st.carry(top, 4, split=True))
    assert torch.equal(vst.carry(top, 2, down_to=0), st.carry(top, 4, down_to=2))
    assert torch.equal(vst.unmerge(top, 1), st.unmerge(top, 3))
    # readout weights go through the model's merges after the view too
    assert torch.equal(vst.carry_down(top, 0), st.carry_down(top, 2))
    assert vst.carry_down(top, 0).shape[-1] == mid.shape[-1]


# -- the adapter's structure -----------------------------------------------------------------
def _family_classes() -> list[type]:
    out, todo = [], list(ViTAdapter.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.__module__.startswith("captum_vit.adapters") and cls is not SubnetworkAdapter:
            out.append(cls)
    return out


def test_families_override_only_declared_hooks():
    """A family implements the contract and may override the declared hooks; every other
    member of ViTAdapter (the engine, the readout) is never redefined by a family."""
    engine = {n for c in ViTAdapter.__mro__[:-1] for n in vars(c) if not n.startswith("__")}
    allowed = set(FAMILY_CONTRACT) | set(FAMILY_HOOKS) | {"_abc_impl"}
    assert set(FAMILY_HOOKS) <= engine and not set(FAMILY_HOOKS) & set(FAMILY_CONTRACT)
    families = _family_classes()
    assert len(families) >= 15
    bad = {c.__name__: sorted(set(vars(c)) & engine - allowed) for c in families}
    assert not {k: v for k, v in bad.items() if v}, bad


def test_the_engine_is_one_file_of_at_most_700_lines():
    assert len(BASE.read_text(encoding="utf-8").splitlines()) <= 700
    assert issubclass(ViTAdapter, Readout)
    for name in ("carry", "unmerge", "token_mix", "real_keys", "token_eye", "carry_down",
                 "has_stages", "final_tokens"):
        assert not hasattr(ViTAdapter, name), name  # read through adapter.stages


def test_the_self_check_compares_what_the_family_declares():
    """``self_check_outputs`` is the hook: a mismatch is named by its key."""
    model, x = make_model("vit", seed=4), make_inputs("vit")
    base = type(adapt(model))

    class Shifted(base):  # type: ignore[misc, valid-type]
        def self_check_outputs(self, inputs):
            pairs = super().self_check_outputs(inputs)
            ref, ours = pairs["logit"]
            return {**pairs, "box": (ref, ours + 1.0)}

    ad = Shifted(model)
    with pytest.raises(TypeError, match="max box difference"):
        ad.self_check(x)
    base(model).self_check(x)  # the default pair alone passes


@pytest.mark.timm_windows  # a timm Swin / SAM: timm >= 1.0.31
def test_token_removal_keeps_prefix_rows_for_every_family():
    """A target reading only prefix rows of the last state allows true token removal
    (removal keeps every prefix row); one reading other token rows is refused."""

    class Prefix(Target):
        reads_tokens = True
        prefix_rows_only = True

        def columns(self, out):
            return out.tokens[:, 0, :2]

    class Rows(Prefix):
        prefix_rows_only = False

    ad = adapt(make_model("vit"))
    with ad.targeting(Prefix()):
        ad.check_token_removal()
    with ad.targeting(Rows()), pytest.raises(ValueError, match="reads token rows"):
        ad.check_token_removal()
    swin = adapt(_swin())
    with swin.targeting(Prefix()), pytest.raises(ValueError, match="within windows"):
        swin.check_token_removal()
