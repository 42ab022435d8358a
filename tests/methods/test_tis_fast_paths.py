"""TIS fast paths (issue 21): the shared first-block work equals the plain forward (to
rounding), the anytime mode at tolerance 1.0 equals the exact algorithm, the batched torch
KMeans finds scikit-learn's clusters, and the progress bar option."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.cluster import KMeans

from captum_vit.adapters import adapt, subset_logits
from captum_vit.methods._kmeans import kmeans, kmeans_plusplus
from captum_vit.methods.tis import TIS, complete_scores, kmeans_masks, layer_features, spearman
from tests.helpers import ALL_FAMILIES, assert_close_scaled, family_marks, make_inputs, make_model

SHARED_FAMILIES = ["vit", "registers", "layerscale", "nonsquare", "beit", "eva02",
                   "eva_dinov3", "map", "hf_vit", "hf_dinov2_reg"]


def _random_keep(adapter, x0, subsets, seed=1):
    g = torch.Generator().manual_seed(seed)
    p = x0.shape[1] - adapter.num_prefix
    keep = torch.rand(x0.shape[0], subsets, p, generator=g) < 0.5
    keep[..., 0] = True  # no empty subset
    return keep


# --- shared first block == plain forward -----------------------------------------------------
# The gathered first block and the plain one run the same arithmetic on differently shaped
# tensors; which GEMM / softmax kernels run depends on the processor and the shapes, so the
# last bit may differ: equal to 1e-12 of the logits' scale, not bit for bit.
@pytest.mark.parametrize("family", [pytest.param(f, marks=family_marks(f))
                                    for f in SHARED_FAMILIES])
def test_shared_first_block_equals_plain_forward(family, monkeypatch):
    from captum_vit.adapters import subsets

    assert family in ALL_FAMILIES
    model, x = make_model(family), make_inputs(family, batch=2)
    adapter = adapt(model)
    x0 = adapter.embed(x)
    assert x0.dtype == torch.float64
    keep = _random_keep(adapter, x0, 24)  # mixed lengths: padded chunks too
    gathered = []  # the cached first block is really used (not silently bypassed)
    real = subsets.FirstBlockShared._gather
    monkeypatch.setattr(subsets.FirstBlockShared, "_gather",
                        lambda self, t: gathered.append(1) or real(self, t))
    shared = subset_logits(adapter, x0, keep, batch_size=16, share_first_block=True)
    assert gathered
    gathered.clear()
    plain = subset_logits(adapter, x0, keep, batch_size=16, share_first_block=False)
    assert not gathered
    assert_close_scaled(shared, plain)


@pytest.mark.parametrize("family", ["vit", "eva02"])
def test_tis_shared_first_block_equals_without(family, monkeypatch):
    import captum_vit.methods.tis as tis_module

    model, x = make_model(family), make_inputs(family, batch=2)
    target = torch.tensor([1, 3])
    tis = TIS(model)
    shared = tis.attribute(x, target=target, n_masks=24, output="tokens")
    real = tis_module.mask_scores
    monkeypatch.setattr(tis_module, "mask_scores",
                        lambda *a, **k: real(*a, **{**k, "share_first_block": False}))
    plain = tis.attribute(x, target=target, n_masks=24, output="tokens")
    assert_close_scaled(shared, plain)  # the scores differ in the last bit at most


# --- anytime mode ----------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["vit", "beit"])
def test_anytime_at_tolerance_one_equals_exact(family):
    model, x = make_model(family), make_inputs(family, batch=2)
    target = torch.tensor([0, 2])
    tis = TIS(model)
    exact = tis.attribute(x, target=target, n_masks=48, output="tokens")
    assert tis.last_masks_used.tolist() == [48, 48]
    anytime = tis.attribute(x, target=target, n_masks=48, tolerance=1.0, round_size=16,
                            output="tokens")
    assert tis.last_masks_used.tolist() == [48, 48]
    # the same masks scored in rounds of 16 instead of one pass: other GEMM shapes, so the
    # scores may differ in the last bit
    assert_close_scaled(anytime, exact)


def test_anytime_stops_early_and_per_image():
    model, x = make_model("vit"), make_inputs("vit", batch=3)
    target = torch.tensor([0, 2, 4])
    tis = TIS(model)
    tis.attribute(x, target=target, n_masks=64, tolerance=0.05, round_size=8,
                  output="tokens")
    used = tis.last_masks_used
    assert used.shape == (3,) and used.dtype == torch.long
    assert (used < 64).all() and (used % 8 == 0).all()
    # an image stops on its own: alone it uses as many masks and gets the same map. The
    # masks are given: on this model k-means++ meets exact ties (two candidates whose
    # potentials agree to the last bit), which rounding decides, so an image's clusters
    # can change with the batch's GEMM shapes or the thread count (seen with 2 threads)
    adapter = adapt(model)
    masks = kmeans_masks(layer_features(adapter, adapter.embed(x))[0], 64, [0.5], 0)
    batch = tis.attribute(x, target=target, masks=masks, tolerance=0.6, round_size=8,
                          output="tokens")
    used = tis.last_masks_used.clone()
    assert (used < 64).all()
    for b in range(3):
        alone = tis.attribute(x[b:b + 1], target=target[b:b + 1], masks=masks[b:b + 1],
                              tolerance=0.6, round_size=8, output="tokens")
        assert tis.last_masks_used.tolist() == [int(used[b])]
        assert_close_scaled(alone, batch[b:b + 1])


def _ridge_reference(w, masks, used, ridge):
    """Slow reference of complete_scores: per image, the normal equations of
    min ||y - b0 - X beta||^2 + ridge ||beta||^2 over the scored rows (b0 unpenalised),
    solved as one augmented system; predictions for every row."""
    out = w.clone()
    for b in range(w.shape[0]):
        x = masks[min(b, masks.shape[0] - 1)].double()
        design = torch.cat([torch.ones(x.shape[0], 1, dtype=torch.float64), x], 1)
        rows = design[used[b]]
        penalty = ridge * torch.eye(design.shape[1], dtype=torch.float64)
        penalty[0, 0] = 0
        coef = torch.linalg.solve(rows.T @ rows + penalty, rows.T @ w[b, used[b]].double())
        out[b] = torch.where(used[b], w[b], (design @ coef).to(w.dtype))
    return out


def test_complete_scores_equals_the_ridge_normal_equations():
    g = torch.Generator().manual_seed(0)
    masks = torch.rand(3, 50, 12, generator=g) < 0.5
    w = torch.rand(3, 50, generator=g, dtype=torch.float64)
    used = torch.rand(3, 50, generator=g) < 0.4
    for ridge in (0.5, 10.0):
        got = complete_scores(w, masks, used, ridge=ridge)
        torch.testing.assert_close(got, _ridge_reference(w, masks, used, ridge),
                                   rtol=1e-10, atol=1e-12)
        assert torch.equal(got[used], w[used])  # measured scores are kept as they are
    shared = complete_scores(w, masks[:1], used, ridge=1.0)  # masks shared by the batch
    torch.testing.assert_close(shared, _ridge_reference(w, masks[:1], used, 1.0),
                               rtol=1e-10, atol=1e-12)


def test_complete_scores_is_exact_for_additive_scores():
    g = torch.Generator().manual_seed(1)
    masks = torch.rand(2, 80, 10, generator=g) < 0.5
    effect = torch.randn(2, 10, generator=g, dtype=torch.float64)
    w = 0.3 + torch.einsum("bmp,bp->bm", masks.double(), effect)
    used = torch.arange(80).expand(2, -1) < 30
    got = complete_scores(torch.where(used, w, torch.zeros_like(w)), masks, used, ridge=0.0)
    torch.testing.assert_close(got, w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("surrogate", [False, True])
def test_anytime_map_from_the_masks_used(surrogate):
    from captum_vit.methods.tis import RIDGE, mask_scores, masks_to_map

    model, x = make_model("vit"), make_inputs("vit", batch=1)
    target = torch.tensor([3])
    tis = TIS(model)
    out = tis.attribute(x, target=target, n_masks=40, tolerance=0.1, round_size=10,
                        surrogate=surrogate, output="tokens")
    m = int(tis.last_masks_used[0])
    assert m < 40
    adapter = adapt(model)
    x0 = adapter.embed(x)
    masks = kmeans_masks(layer_features(adapter, x0)[0], 40, [0.5], 0)
    order = torch.randperm(40, generator=torch.Generator().manual_seed(0))[:m]
    if not surrogate:  # the map of the masks scored
        chosen = masks[:, order.sort().values]
        ref = masks_to_map(mask_scores(adapter, x0, target, chosen), chosen)
    else:  # the map of all masks, the scores of those not scored predicted
        used = torch.zeros(1, 40, dtype=torch.bool)
        used[0, order] = True
        w = mask_scores(adapter, x0, target, masks) * used
        ref = masks_to_map(_ridge_reference(w, masks, used, RIDGE), masks)
    assert_close_scaled(out, ref)


def test_spearman_matches_scipy_with_ties():
    stats = pytest.importorskip("scipy.stats")
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 5, (4, 30), generator=g).double()
    b = a + torch.randn(4, 30, generator=g, dtype=torch.float64)
    ours = spearman(a, b)
    for i in range(4):
        assert ours[i].item() == pytest.approx(stats.spearmanr(a[i], b[i]).statistic, abs=1e-12)
    assert spearman(a, a).tolist() == pytest.approx([1.0] * 4)


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5, True])
def test_bad_tolerance(bad):
    model, x = make_model("vit"), make_inputs("vit", batch=1)
    with pytest.raises((ValueError, TypeError), match="tolerance"):
        TIS(model).attribute(x, n_masks=8, tolerance=bad)


def test_bad_kmeans_choice():
    model, x = make_model("vit"), make_inputs("vit", batch=1)
    with pytest.raises(ValueError, match="kmeans"):
        TIS(model).attribute(x, n_masks=8, kmeans="faiss")


# --- batched torch KMeans == scikit-learn ----------------------------------------------------
def _same_partition(a, b) -> bool:
    a, b = np.asarray(a).tolist(), np.asarray(b).tolist()
    return len(set(zip(a, b, strict=True))) == len(set(a)) == len(set(b))


def test_kmeans_plusplus_draws_sklearns_seeds():
    from sklearn.cluster import kmeans_plusplus as sk_plusplus

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 200, 6, generator=g, dtype=torch.float64)
    ours = kmeans_plusplus(x, 9, seed=5)
    for b in range(3):
        _, idx = sk_plusplus(x[b].numpy(), 9, random_state=5)
        assert ours[b].tolist() == idx.tolist()


def test_kmeans_plusplus_tie_does_not_depend_on_rounding():
    """Two candidates whose potentials are equal in exact arithmetic (mirror images about the
    first centre) are a tie: the first drawn wins whichever rounded lower, so the seeding
    (and TIS's masks) cannot change with the batch an image is in (issue 42: a random CoCa's
    TIS map changed by 1.3 % between a batch and its images one by one)."""
    base = torch.tensor([-9.0, -5.0, -2.0, 0.0, 2.0, 5.0, 9.0], dtype=torch.float64)
    picks = []
    for eps in (1e-14, -1e-14):  # one side nudged by a rounding-sized amount, up or down
        x = torch.where(base > 0, base * (1 + eps), base)[None, :, None]
        picks.append(kmeans_plusplus(x, 3, seed=0, n_local_trials=20)[0].tolist())
    assert picks[0][0] == 3  # seed 0 draws the middle point first
    assert picks[0] == picks[1]


@pytest.mark.parametrize("shape,k,seed", [((3, 300, 5), 6, 0), ((2, 96, 64), 12, 7),
                                          ((2, 1152, 16), 64, 3)])
def test_batched_kmeans_matches_sklearn_on_fixed_seed(shape, k, seed):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    centers, labels = kmeans(x, k, seed=seed)
    for b in range(shape[0]):
        km = KMeans(k, n_init=1, random_state=seed).fit(x[b].numpy())
        assert _same_partition(km.labels_, labels[b])
        assert_close_scaled(centers[b].numpy(), km.cluster_centers_)


def test_batched_kmeans_matches_sklearn_on_separated_clusters():
    g = torch.Generator().manual_seed(1)
    means = 20 * torch.randn(2, 5, 3, generator=g)
    x = (means.repeat_interleave(40, 1) + torch.randn(2, 200, 3, generator=g)).float()
    _, labels = kmeans(x, 5, seed=0)
    for b in range(2):
        km = KMeans(5, n_init=1, random_state=0).fit(x[b].numpy())
        assert _same_partition(km.labels_, labels[b])
        assert _same_partition(labels[b], torch.arange(200) // 40)


def test_empty_clusters_are_relocated():
    x = torch.tensor([[[0.0], [0.0], [0.0], [10.0], [11.0], [30.0]]], dtype=torch.float64)
    centers, labels = kmeans(x, 3, seed=0)
    assert len(set(labels[0].tolist())) == 3
    assert torch.isfinite(centers).all()


def test_kmeans_argument_check():
    with pytest.raises(ValueError, match="n_clusters"):
        kmeans(torch.randn(1, 4, 2), 5)


@pytest.mark.parametrize("family", ["vit", "eva02"])
def test_torch_and_sklearn_kmeans_give_the_same_tis_masks(family):
    model, x = make_model(family), make_inputs(family, batch=2)
    adapter = adapt(model)
    features, _ = layer_features(adapter, adapter.embed(x))
    ours = kmeans_masks(features, 12, [0.5, 0.25], 3, method="torch")
    ref = kmeans_masks(features, 12, [0.5, 0.25], 3, method="sklearn")
    assert torch.equal(ours, ref)


# --- progress bar ----------------------------------------------------------------------------
@pytest.mark.parametrize("tolerance", [None, 0.5])
@pytest.mark.parametrize("show,expect_bar", [(True, True), (False, False), (None, False)])
def test_progress_bar_option(show, expect_bar, tolerance, capsys, monkeypatch):
    import captum_vit.methods.tis as tis_module

    # None shows the bar once the scoring has run PROGRESS_DELAY seconds: out of reach here,
    # so the outcome does not depend on how fast (or how busy) the machine is
    monkeypatch.setattr(tis_module, "PROGRESS_DELAY", 1e9)
    model, x = make_model("vit"), make_inputs("vit", batch=1)
    TIS(model).attribute(x, n_masks=16, round_size=4, tolerance=tolerance,
                         show_progress=show)
    assert ("TIS" in capsys.readouterr().err) == expect_bar
    if show is None:  # ... and with no delay, at once
        monkeypatch.setattr(tis_module, "PROGRESS_DELAY", 0.0)
        TIS(model).attribute(x, n_masks=16, round_size=4, tolerance=tolerance,
                             show_progress=show)
        assert "TIS" in capsys.readouterr().err


# --- the benchmark's re-implementation of the authors' loop ----------------------------------
def test_authors_loop_gives_our_map_on_the_same_masks():
    from benchmarks.authors_tis import authors_masks, authors_tis

    model, x = make_model("vit"), make_inputs("vit", batch=2)
    target = torch.tensor([1, 2])
    masks = torch.stack([authors_masks(model, x[i:i + 1], 10, seed=0) for i in range(2)])
    ours = TIS(model).attribute(x, target=target, masks=masks, output="tokens")
    theirs = authors_tis(model, x, target, 10, masks=masks, batch_size=4)
    assert_close_scaled(ours, theirs)
    assert authors_tis(model, x[:1], target[:1], 10).shape == (1, masks.shape[-1])


def test_converged_correlation_is_spearman_brown_square_root():
    from captum_vit.methods.tis import converged_correlation

    rho = torch.tensor([-0.3, 0.0, 0.5, 0.8, 1.0], dtype=torch.float64)
    want = [0.0, 0.0, (1 / 1.5) ** 0.5, (1.6 / 1.8) ** 0.5, 1.0]
    assert_close_scaled(converged_correlation(rho), torch.tensor(want, dtype=torch.float64))
