"""ViT-CX (SPEC_NEXT §8.11): the clustering against scikit-learn / scipy, the method against
the authors' procedure written here as a slow loop over the model's own forward (forwards
counted), token removal scoring the kept tokens without noise, and clear errors. Seeding,
batch invariance and PLUS/SkipPLUS per block are checked with RISE in
tests/methods/test_rise.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.cluster.hierarchy import fcluster, linkage
from sklearn.cluster import AgglomerativeClustering

from captum_vit import ViTCX
from captum_vit.adapters import adapt
from captum_vit.methods.vitcx import NOISE_SEED_STRIDE, vitcx_masks
from tests.helpers import assert_unchanged, make_inputs, snapshot
from tests.methods.test_rise import (
    TARGETS,
    CountForwards,
    close,
    model_of,
    patch_means_loop,
    timm_removed_logits,
)


# -- ViT-CX against the authors' procedure ---------------------------------------------------
def vitcx_reference(model, x, target, seed=0, threshold=0.1, noise=0.1):
    """The authors' ViT_CX() and causal_score(), one image at a time, with timm's own
    forward (features from a hook on ``blocks[-1].norm1``) and scikit-learn's clustering;
    the noise drawn as documented (float32, seed * 1_000_003 + i)."""
    maps, labels_all = [], []
    h, w = x.shape[-2:]
    for b in range(len(x)):
        feats = []
        hook = model.blocks[-1].norm1.register_forward_hook(
            lambda m, a, o, feats=feats: feats.append(o))
        with torch.no_grad():
            p_clean = model(x[b:b + 1]).softmax(-1)[0, target[b]]
        hook.remove()
        f = feats[0][0, 1:].T.reshape(-1, 4, 4)  # patch rows, [D, gh, gw]
        up = F.interpolate(f[None], size=(h, w), mode="bilinear", align_corners=False)[0]
        flat = up.reshape(len(up), -1)
        lo, hi = flat.min(1, keepdim=True).values, flat.max(1, keepdim=True).values
        mask = torch.nan_to_num((flat - lo) / (hi - lo))  # constant map -> 0
        num = mask @ mask.T
        den = mask.norm(dim=1)[:, None] * mask.norm(dim=1)[None]
        dist = 1 - torch.nan_to_num(num / den)
        labels = AgglomerativeClustering(n_clusters=None, distance_threshold=threshold,
                                         metric="precomputed", linkage="complete").fit(
            dist.numpy()).labels_
        labels_all.append((labels, dist))
        sums = torch.zeros(labels.max() + 1, h * w, dtype=torch.float64)
        for i, lab in enumerate(labels):
            sums[lab] += mask[i]
        lo, hi = sums.min(1, keepdim=True).values, sums.max(1, keepdim=True).values
        masks = torch.nan_to_num((sums - lo) / (hi - lo)).reshape(-1, h, w)
        sal = torch.zeros(h, w, dtype=torch.float64)
        for i, m in enumerate(masks):
            g = torch.Generator().manual_seed(seed * NOISE_SEED_STRIDE + i)
            eps = (torch.randn(3, h, w, generator=g) * noise).double() * (1 - m)
            with torch.no_grad():
                pm = model((x[b] * m + eps)[None]).softmax(-1)[0, target[b]]
                po = model((x[b] + eps)[None]).softmax(-1)[0, target[b]]
            sal += (pm - po + p_clean) * m / masks.sum(0)
        maps.append(patch_means_loop(sal / len(masks), 8))
    return torch.stack(maps), labels_all


def test_vitcx_equals_the_authors_procedure_and_counts_forwards():
    model, x = model_of(), make_inputs("vit")
    before = snapshot(model)
    ref, labels = vitcx_reference(model, x, TARGETS, seed=4)
    cx = ViTCX(model, seed=4)
    with CountForwards(model) as count:
        got = cx.attribute(x, TARGETS, output="tokens", batch_size=6)
    close(got, ref)
    assert cx.num_masks == [lab.max() + 1 for lab, _ in labels]
    assert cx.num_forwards == sum(2 * n + 1 for n in cx.num_masks)
    assert count.images == sum(2 * n for n in cx.num_masks)  # + one clean trace each
    cx.attribute(x, TARGETS, noise=0.0)
    assert cx.num_forwards == sum(n + 1 for n in cx.num_masks)
    assert_unchanged(model, before)


def test_vitcx_clustering_matches_sklearn_and_scipy():
    """Our distances (computed on the grid) give scikit-learn's partition of the directly
    computed ones; scipy's complete linkage cut at the same threshold gives it too."""
    model, x = model_of(), make_inputs("vit")
    _, labels = vitcx_reference(model, x, TARGETS)
    tr = adapt(model).trace(x)
    for b, (ref_labels, dist) in enumerate(labels):
        feats = tr.blocks[-1].u[b, 1:]
        masks, ours = vitcx_masks(feats, (4, 4), (32, 32), 0.1)
        np.testing.assert_array_equal(ours, ref_labels)
        assert len(masks) == ref_labels.max() + 1
        condensed = dist.numpy()[np.triu_indices(len(dist), 1)]
        flat = fcluster(linkage(condensed, method="complete"), 0.1, criterion="distance")
        partition = {frozenset(np.flatnonzero(flat == c)) for c in np.unique(flat)}
        assert partition == {frozenset(np.flatnonzero(ref_labels == c))
                             for c in np.unique(ref_labels)}
    fine, coarse = (len(vitcx_masks(tr.blocks[-1].u[0, 1:], (4, 4), (32, 32), t)[0])
                    for t in (0.02, 0.5))
    assert fine >= coarse  # fewer clusters for a larger threshold


def test_vitcx_tokens_scores_kept_tokens_without_noise():
    model, x = model_of(), make_inputs("vit")
    cx = ViTCX(model)
    with CountForwards(model) as count:
        got = cx.attribute(x, TARGETS, removal="tokens", output="tokens")
    assert count.images == 0
    tr = adapt(model).trace(x)
    ref = []
    for b in range(3):
        masks, _ = vitcx_masks(tr.blocks[-1].u[b, 1:], (4, 4), None, 0.1)
        m = masks.materialize(torch.arange(len(masks)), torch.float64).reshape(-1, 16)
        s = torch.stack([timm_removed_logits(model, x[b], (mk >= 0.5).nonzero()[:, 0])
                         .softmax(-1)[TARGETS[b]] for mk in m])
        ref.append((s @ m) / m.sum(0) / len(m))
    close(got, torch.stack(ref))


@pytest.mark.parametrize(("kw", "err", "match"), [
    ({"layer": 3}, ValueError, "layer"), ({"layer": "last"}, TypeError, "layer"),
    ({"distance_threshold": 0.0}, ValueError, "distance_threshold"),
    ({"noise": -0.1}, ValueError, "noise"), ({"removal": "blur"}, ValueError, "removal"),
    ({"batch_size": 0}, ValueError, "batch_size"), ({"score": "p"}, ValueError, "score"),
])
def test_vitcx_errors_name_the_argument(kw, err, match):
    model, x = model_of(), make_inputs("vit")
    with pytest.raises(err, match=match):
        ViTCX(model).attribute(x, TARGETS, **kw)
