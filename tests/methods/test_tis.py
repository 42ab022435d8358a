"""TIS (SPEC §5): parity with the authors' code given fixed masks, a slow reference
written from SPEC §5 with timm's own modules and scikit-learn called directly (every
model family), determinism, batch invariance, Captum interop, model safety, bad input."""

from __future__ import annotations

import warnings

import pytest
import torch
from captum.attr import NoiseTunnel
from captum.metrics import sensitivity_max
from sklearn.cluster import KMeans

from captum_vit.adapters import FusedOps, Ops, adapt
from captum_vit.methods.tis import (
    TIS,
    kmeans_masks,
    layer_features,
    mask_scores,
)
from tests.helpers import (
    FAMILIES,
    assert_close_scaled,
    assert_close_to_reference,
    assert_unchanged,
    make_inputs,
    make_model,
    snapshot,
)

# --- fixture parity (authors' tis/tis.py with KMeans replaced by fixed masks) --------------


def test_parity_map_given_masks(parity):
    model, x, targets, _, maps, _ = parity
    masks = maps["tis_masks"].bool()
    out = TIS(model).attribute(x, target=targets, masks=masks, output="tokens")
    assert out.dtype == torch.float64
    assert_close_to_reference(out, maps["tis_scores_given_masks"], rel=1e-8)


def test_parity_mask_scores(parity):
    model, x, targets, _, maps, _ = parity
    adapter = adapt(model)
    x0 = adapter.embed(x).detach()
    w = mask_scores(adapter, x0, targets, maps["tis_masks"].bool()[None],
                    internal_batch_size=16)
    assert_close_to_reference(w, maps["tis_mask_scores"], rel=1e-8)


def test_per_image_masks_equal_shared_masks(parity):
    model, x, targets, _, maps, _ = parity
    masks = maps["tis_masks"].bool()
    tis = TIS(model)
    shared = tis.attribute(x, target=targets, masks=masks, output="tokens")
    per_image = tis.attribute(x, target=targets, masks=masks.expand(2, -1, -1),
                              output="tokens")
    # [1, M, P] masks broadcast vs [2, M, P] ones: other strides and GEMM shapes, so the
    # scores may differ in the last bit
    assert_close_scaled(shared, per_image)


# --- slow reference from SPEC §5, through timm's own modules ---------------------------------


def _embed_by_hand(model, image):
    """Tokens after the positional embedding (timm's own patch_embed / _pos_embed)."""
    x = model.patch_embed(image)
    x = model._pos_embed(x)
    x = model.patch_drop(x)
    return model.norm_pre(x)


def reference_masks(model, image, n_masks, ratios, seed):
    """SPEC §5 steps 1-3 for ONE image with scikit-learn called directly."""
    k = model.num_prefix_tokens
    with torch.no_grad():
        h = _embed_by_hand(model, image)
        columns = []
        for blk in model.blocks:  # step 1: every block's output at the patch tokens
            h = blk(h)
            columns.append(h[0, k:])
    a = torch.cat(columns, dim=1)  # [P, L*D]
    km = KMeans(n_clusters=n_masks, n_init=1, random_state=seed).fit(a.T.numpy())
    centroids = torch.from_numpy(km.cluster_centers_)  # [n_masks, P]
    p = a.shape[0]
    masks = []
    for r in ratios:
        for c in centroids:
            m = torch.zeros(p, dtype=torch.bool)
            m[c.topk(int(r * p)).indices] = True
            masks.append(m)
    return torch.stack(masks)


def reference_tis(model, images, target, masks, score="probability"):
    """SPEC §5 steps 4-5 with explicit loops: one forward of timm's modules per mask.

    ``masks`` is bool [B, M, P]. Returns (map [B, P], scores [B, M])."""
    k = model.num_prefix_tokens
    maps, all_scores = [], []
    with torch.no_grad():
        for b in range(len(images)):
            x = _embed_by_hand(model, images[b:b + 1])
            scores = []
            for mask in masks[b]:
                kept = [k + i for i in range(mask.numel()) if mask[i]]
                seq = torch.cat([x[:, :k], x[:, kept]], dim=1)
                logits = model.forward_head(model.norm(model.blocks(seq)))[0]
                s = logits.softmax(-1) if score == "probability" else logits
                scores.append(s[int(target[b])])
            sal = []
            for t in range(masks.shape[-1]):
                covering = [scores[j] for j in range(len(scores)) if masks[b, j, t]]
                sal.append(sum(covering) / len(covering) if covering
                           else torch.tensor(float("nan"), dtype=x.dtype))
            maps.append(torch.stack(sal))
            all_scores.append(torch.stack(scores))
    return torch.stack(maps), torch.stack(all_scores)


@pytest.mark.parametrize("family", ["vit", "layerscale"])
def test_fused_attention_ops_equal_the_generic_forward(family):
    model, x = make_model(family), make_inputs(family, batch=2)
    adapter = adapt(model)
    x0 = adapter.embed(x)
    keep = torch.tensor([[0, 3, 5, 9], [1, 2, 8, 15]])
    fused = adapter.run(x0, keep=keep, ops=FusedOps())
    assert_close_scaled(fused, adapter.run(x0, keep=keep, ops=Ops()))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_kmeans_path_matches_reference_on_every_family(family):
    model = make_model(family)
    x = make_inputs(family, batch=2)
    target = torch.tensor([1, 3])
    ratios, n_masks, seed = [0.5], 12, 7
    ref_masks = torch.stack([reference_masks(model, x[b:b + 1], n_masks, ratios, seed)
                             for b in range(2)])
    adapter = adapt(model)
    features, logits = layer_features(adapter, adapter.embed(x))
    assert_close_scaled(logits, model(x))
    ours = kmeans_masks(features, n_masks, ratios, seed)
    assert torch.equal(ours, ref_masks)
    ref_map, _ = reference_tis(model, x, target, ref_masks)
    out = TIS(model).attribute(x, target=target, n_masks=n_masks, random_state=seed,
                               internal_batch_size=5, output="tokens")
    assert_close_to_reference(out, ref_map, rel=1e-10)


def test_as_many_masks_as_columns_skips_kmeans_and_matches_sklearn():
    model, x = make_model("vit"), make_inputs("vit", batch=2)  # L*D = 3 * 32 = 96 columns
    target = torch.tensor([2, 4])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sklearn may warn about near-duplicate points
        ref_masks = torch.stack([reference_masks(model, x[b:b + 1], 96, [0.5], 1)
                                 for b in range(2)])
    adapter = adapt(model)
    ours = kmeans_masks(layer_features(adapter, adapter.embed(x))[0], 96, [0.5], 1)

    def as_set(m):  # the masks of one image, whatever their order
        return sorted(tuple(row.tolist()) for row in m)

    for b in range(2):
        assert as_set(ours[b]) == as_set(ref_masks[b])
    ref_map, _ = reference_tis(model, x, target, ref_masks)
    out = TIS(model).attribute(x, target=target, n_masks=96, output="tokens")
    assert_close_to_reference(out, ref_map, rel=1e-10)


def test_several_ratios_concatenate_masks():
    model, x = make_model("vit"), make_inputs("vit", batch=2)
    target = torch.tensor([0, 2])
    ratios = [0.25, 0.5]
    ref_masks = torch.stack([reference_masks(model, x[b:b + 1], 10, ratios, 3)
                             for b in range(2)])
    assert ref_masks.shape == (2, 20, 16)
    assert (ref_masks[:, :10].sum(-1) == 4).all() and (ref_masks[:, 10:].sum(-1) == 8).all()
    ref_map, _ = reference_tis(model, x, target, ref_masks)
    out = TIS(model).attribute(x, target=target, n_masks=10, ratio=ratios, random_state=3,
                               output="tokens")
    assert_close_to_reference(out, ref_map, rel=1e-10)


@pytest.mark.parametrize("score", ["probability", "logit"])
def test_given_masks_of_different_sizes_match_reference(score):
    model, x = make_model("registers"), make_inputs("registers", batch=2)
    target = torch.tensor([4, 1])
    g = torch.Generator().manual_seed(5)
    masks = torch.rand(2, 9, 16, generator=g) < torch.linspace(0.2, 0.8, 9)[None, :, None]
    masks[:, :, 0] |= ~masks.any(-1)  # no empty mask
    ref_map, ref_scores = reference_tis(model, x, target, masks, score)
    out = TIS(model).attribute(x, target=target, masks=masks, score=score,
                               internal_batch_size=4, output="tokens")
    assert_close_to_reference(out, ref_map, rel=1e-10)
    adapter = adapt(model)
    w = mask_scores(adapter, adapter.embed(x), target, masks, score=score)
    assert_close_to_reference(w, ref_scores, rel=1e-10)


# --- determinism, batching, options ----------------------------------------------------------


def test_seeded_runs_repeat_bit_for_bit_and_seeds_differ():
    model, x = make_model("vit"), make_inputs("vit", batch=2)
    tis = TIS(model)
    a = tis.attribute(x, target=1, n_masks=16, random_state=11, output="tokens")
    b = tis.attribute(x, target=1, n_masks=16, random_state=11, output="tokens")
    c = tis.attribute(x, target=1, n_masks=16, random_state=12, output="tokens")
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    default = tis.attribute(x, target=1, n_masks=16, output="tokens")
    assert torch.equal(default, tis.attribute(x, target=1, n_masks=16, random_state=0,
                                              output="tokens"))


def test_batch_invariance():
    model, x = make_model("avgpool"), make_inputs("avgpool", batch=3)
    target = torch.tensor([0, 4, 2])
    g = torch.Generator().manual_seed(2)
    masks = torch.rand(20, 16, generator=g) < 0.5
    masks[:, 3] = True
    tis = TIS(model)
    for kw in ({"masks": masks}, {"n_masks": 12, "random_state": 4}):
        batched = tis.attribute(x, target=target, output="tokens", internal_batch_size=7, **kw)
        single = torch.cat([tis.attribute(x[i:i + 1], target=target[i:i + 1],
                                          output="tokens", **kw) for i in range(3)])
        assert_close_scaled(batched, single)


def test_internal_batch_size_does_not_change_the_result():
    model, x = make_model("distilled"), make_inputs("distilled", batch=2)
    tis = TIS(model)
    outs = [tis.attribute(x, target=2, n_masks=8, internal_batch_size=ibs, output="tokens")
            for ibs in (1, 3, 128, None)]
    for o in outs[1:]:
        assert_close_scaled(o, outs[0])


def test_target_none_explains_the_predicted_class():
    model, x = make_model("vit"), make_inputs("vit", batch=2)
    pred = model(x).argmax(-1)
    tis = TIS(model)
    assert torch.equal(tis.attribute(x, n_masks=8, output="tokens"),
                       tis.attribute(x, target=pred, n_masks=8, output="tokens"))


def test_n_masks_is_clamped_to_the_number_of_columns():
    model, x = make_model("vit"), make_inputs("vit", batch=1)  # L*D = 3 * 32 = 96 columns
    tis = TIS(model)
    with pytest.warns(UserWarning, match="n_masks=500"):
        big = tis.attribute(x, target=0, n_masks=500, output="tokens")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sklearn may warn about duplicate points
        exact = tis.attribute(x, target=0, n_masks=96, output="tokens")
    assert torch.equal(big, exact)


def test_uncovered_patch_gets_the_smallest_covered_score():
    model, x = make_model("vit"), make_inputs("vit", batch=2)
    g = torch.Generator().manual_seed(9)
    masks = torch.rand(10, 16, generator=g) < 0.5
    masks[:, 1] = True
    masks[:, 5] = False  # nobody keeps patch 5
    out = TIS(model).attribute(x, target=3, masks=masks, output="tokens")
    assert torch.isfinite(out).all()
    others = torch.cat([out[:, :5], out[:, 6:]], dim=1)
    assert torch.equal(out[:, 5], others.min(1).values)
    ref, _ = reference_tis(model, x, torch.tensor([3, 3]), masks.expand(2, -1, -1))
    assert ref[:, 5].isnan().all()
    assert_close_to_reference(others, torch.cat([ref[:, :5], ref[:, 6:]], dim=1), rel=1e-10)


def test_output_formats_and_tuple_input():
    model, x = make_model("nonsquare"), make_inputs("nonsquare", batch=2)
    tis = TIS(model)
    tokens = tis.attribute(x, target=1, n_masks=6, output="tokens")
    assert tokens.shape == (2, 15)
    grid = tis.attribute(x, target=1, n_masks=6, output="grid")
    assert torch.equal(grid.reshape(2, 15), tokens)
    pixels = tis.attribute((x,), target=1, n_masks=6)
    assert isinstance(pixels, tuple) and pixels[0].shape == x.shape
    assert torch.equal(pixels[0][:, :, ::8, ::8].reshape(2, 3, 15)[:, 0], tokens)


def test_low_precision_accumulates_in_float32():
    model = make_model("vit", dtype=torch.bfloat16)
    x = make_inputs("vit", batch=2, dtype=torch.bfloat16)
    out = TIS(model).attribute(x, target=0, n_masks=8, output="tokens")
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_progress_bar(capsys):
    model, x = make_model("vit"), make_inputs("vit", batch=1)
    TIS(model).attribute(x, target=0, n_masks=8, internal_batch_size=3, show_progress=True)
    assert "TIS" in capsys.readouterr().err
    TIS(model).attribute(x, target=0, n_masks=8)
    assert capsys.readouterr().err == ""


# --- Captum interop and model safety -----------------------------------------------------


def test_noise_tunnel_and_sensitivity_max_run():
    model, x = make_model("vit"), make_inputs("vit", batch=2)
    target = torch.tensor([1, 2])
    nt = NoiseTunnel(TIS(model)).attribute(x, nt_type="smoothgrad", nt_samples=2, stdevs=0.1,
                                           target=target, n_masks=4)
    assert nt.shape == x.shape and torch.isfinite(nt).all()
    sens = sensitivity_max(TIS(model).attribute, x, target=target, n_perturb_samples=2,
                           n_masks=4)
    assert sens.shape == (2,) and torch.isfinite(sens).all()


def test_model_unchanged_also_on_error():
    model, x = make_model("layerscale"), make_inputs("layerscale", batch=2)
    before = snapshot(model)
    TIS(model).attribute(x, target=1, n_masks=6)
    assert_unchanged(model, before)
    with pytest.raises(ValueError):
        TIS(model).attribute(x, target=1, masks=torch.zeros(3, 16, dtype=torch.bool))
    assert_unchanged(model, before)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"ratio": 0.0}, ValueError, "ratio must be in"),
    ({"ratio": 1.0}, ValueError, "ratio must be in"),
    ({"ratio": -0.2}, ValueError, "ratio must be in"),
    ({"ratio": [0.5, 1.5]}, ValueError, "ratio must be in"),
    ({"ratio": []}, ValueError, "non-empty"),
    ({"ratio": "half"}, TypeError, "ratio"),
    ({"ratio": 0.05}, ValueError, "keeps int"),
    ({"n_masks": 0}, ValueError, "n_masks must be >= 1"),
    ({"n_masks": 2.5}, TypeError, "n_masks must be an int"),
    ({"internal_batch_size": 0}, ValueError, "internal_batch_size must be >= 1"),
    ({"internal_batch_size": -3}, ValueError, "internal_batch_size"),
    ({"random_state": -1}, ValueError, "random_state"),
    ({"random_state": "seed"}, TypeError, "random_state"),
    ({"random_state": 2**32}, ValueError, "random_state must be < 2"),
    ({"score": "prob"}, ValueError, "score must be one of"),
    ({"output": "image"}, ValueError, "output must be one of"),
    ({"masks": torch.ones(4, 16)}, TypeError, "masks.bool()"),
    ({"masks": torch.ones(4, 16, dtype=torch.long)}, TypeError, "dtype torch.bool"),
    ({"masks": torch.ones(4, 15, dtype=torch.bool)}, ValueError, "masks must have shape"),
    ({"masks": torch.ones(3, 4, 16, dtype=torch.bool)}, ValueError, "masks must have shape"),
    ({"masks": torch.ones(16, dtype=torch.bool)}, ValueError, "masks must have shape"),
    ({"masks": torch.ones(0, 16, dtype=torch.bool)}, ValueError, "masks must have shape"),
    ({"masks": torch.eye(16, dtype=torch.bool)[:4] & False}, ValueError, "at least one patch"),
    ({"masks": [[True] * 16]}, TypeError, "torch.Tensor"),
])
def test_bad_arguments(kwargs, error, match):
    model, x = make_model("vit"), make_inputs("vit", batch=2)
    before = snapshot(model)
    with pytest.raises(error, match=match):
        TIS(model).attribute(x, target=0, **kwargs)
    assert_unchanged(model, before)
