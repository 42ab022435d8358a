"""Faithfulness metrics: known answers, a linear toy ViT, true token removal, batching."""

from __future__ import annotations

import math

import pytest
import torch

from captum_vit.methods import GAE, RandomMap, TokenIxG
from captum_vit.metrics import (
    RemovalEngine,
    aopc,
    deletion,
    insertion,
    lodds,
    perturbation_test,
    ranking,
    token_ratio,
    trapezoid_auc,
)
from captum_vit.metrics.removal import (
    baseline_images,
    gaussian_blur,
    remove_pixels,
)
from tests.helpers import assert_unchanged, make_inputs, make_model, snapshot
from tests.metrics_toys import linear_toy, toy_contributions, toy_inputs


# -- known answers ---------------------------------------------------------------------------
def test_trapezoid_auc_known_answers():
    x = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)
    curves = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.2, 0.4, 0.6]], dtype=torch.float64)
    assert trapezoid_auc(curves, x).tolist() == pytest.approx([0.75, 0.25, 0.4])
    uneven = torch.tensor([0.0, 0.1, 1.0], dtype=torch.float64)
    assert trapezoid_auc(curves[:1], uneven).item() == pytest.approx(0.1 + 0.45)


def _toy_probs(model, x, removed_sets):
    """p(class | x with the given patch sets blacked out), by direct model calls."""
    out = []
    for i, sets in enumerate(removed_sets):
        row = []
        for s in sets:
            img = x[i:i + 1].clone()
            for j in s:
                r, c = divmod(int(j), 4)
                img[..., 4 * r:4 * r + 4, 4 * c:4 * c + 4] = 0
            row.append(model(img).softmax(-1)[0])
        out.append(torch.stack(row))
    return torch.stack(out)  # [B, S, classes]


def test_aopc_lodds_deletion_match_hand_computation_on_the_toy():
    model, x = linear_toy(), toy_inputs(3)
    contrib = toy_contributions(model, x)
    pred = model(x).argmax(-1)
    maps = contrib[torch.arange(3), :, pred] - contrib[torch.arange(3), :, 1 - pred]
    order = ranking(maps)
    fr = [0.25, 0.5, 0.75]
    sets = [[order[i, :round(f * 16)] for f in fr] for i in range(3)]
    p = _toy_probs(model, x, sets)[torch.arange(3), :, pred]  # [B, S]
    p0 = model(x).softmax(-1)[torch.arange(3), pred]
    kw = dict(removal="black", fractions=fr)
    res = aopc(model, x, maps, **kw)
    assert res.per_example.tolist() == pytest.approx((p0[:, None] - p).mean(1).tolist(), rel=1e-12)
    res = lodds(model, x, maps, **kw)
    ref = -(p0[:, None] / p).log().mean(1)
    assert res.per_example.tolist() == pytest.approx(ref.tolist(), rel=1e-12)
    # deletion with 4 steps: AUC = trapezoid of p at k = 0, .25, .5, .75, 1
    full = _toy_probs(model, x, [[order[i, :k] for k in (0, 4, 8, 12, 16)] for i in range(3)])
    pk = full[torch.arange(3), :, pred]
    ref = ((pk[:, 1:] + pk[:, :-1]) / 2 * 0.25).sum(1)
    res = deletion(model, x, maps, n_steps=4, removal="black")
    assert res.per_example.tolist() == pytest.approx(ref.tolist(), rel=1e-12)
    assert res.curves.shape == (3, 5) and res.x.tolist() == [0, 0.25, 0.5, 0.75, 1]


def test_true_weights_beat_random_and_are_the_best_ordering():
    model, x = linear_toy(), toy_inputs(4)
    contrib = toy_contributions(model, x)
    pred = model(x).argmax(-1)
    b = torch.arange(4)
    true = contrib[b, :, pred] - contrib[b, :, 1 - pred]  # moves p(pred) monotonically
    rnd = RandomMap(model, seed=1)
    kw = dict(removal="black")
    d_true, d_rnd = deletion(model, x, true, **kw), deletion(model, x, rnd, **kw)
    i_true, i_rnd = insertion(model, x, true, **kw), insertion(model, x, rnd, **kw)
    assert d_true.value < d_rnd.value and i_true.value > i_rnd.value
    assert aopc(model, x, true, **kw).value > aopc(model, x, rnd, **kw).value
    assert lodds(model, x, true, **kw).value < lodds(model, x, rnd, **kw).value
    assert perturbation_test(model, x, true, **kw).value <= \
        perturbation_test(model, x, rnd, **kw).value
    assert perturbation_test(model, x, true, order="negative", **kw).value >= \
        perturbation_test(model, x, rnd, order="negative", **kw).value
    tr_true, tr_rnd = token_ratio(model, x, true, **kw), token_ratio(model, x, rnd, **kw)
    # the remove protocol's AOPC / LOdds are aopc() / lodds(), checked above: not repeated
    assert set(tr_true) == {"token_ratio_keep_accuracy", "token_ratio_keep_aopc",
                            "token_ratio_keep_lodds", "token_ratio_remove_accuracy"}
    for name in ("keep_aopc", "keep_lodds"):
        r1, r2 = tr_true[f"token_ratio_{name}"], tr_rnd[f"token_ratio_{name}"]
        assert (r1.value > r2.value) == r1.higher_is_better, name
    # best possible ordering: at every step, no other removal set lowers p(pred) more
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        other = torch.rand(4, 16, generator=g, dtype=torch.float64)
        d_o, i_o = deletion(model, x, other, **kw), insertion(model, x, other, **kw)
        assert (d_true.curves <= d_o.curves + 1e-12).all()
        assert (i_true.curves >= i_o.curves - 1e-12).all()


def test_token_removal_equals_hand_built_shorter_sequence():
    # batch_size=3 mixes sequence lengths in a chunk: the padded, key-masked path
    for family in ("vit", "distilled", "registers", "avgpool", "layerscale"):
        model, x = make_model(family), make_inputs(family, 2)
        p = 16
        order = torch.stack([torch.randperm(p, generator=torch.Generator().manual_seed(i))
                             for i in range(2)])
        counts = [0, 3, 10, p]
        eng = RemovalEngine(model, forward_batch=3)
        for mode in ("delete", "insert"):
            got = eng.logits(x, order, counts, mode=mode)
            for i in range(2):
                for s, c in enumerate(counts):
                    kept = order[i, c:] if mode == "delete" else order[i, :c]
                    kept = kept.sort().values
                    if kept.numel() == 0 and model.num_prefix_tokens == 0:
                        assert (got[i, s] == 0).all()  # no tokens at all: logits 0
                        continue
                    with torch.no_grad():  # timm's own modules, not the adapter
                        t = model._pos_embed(model.patch_embed(x[i:i + 1]))
                        k = model.num_prefix_tokens
                        t = torch.cat([t[:, :k], t[:, k:][:, kept]], 1)
                        for blk in model.blocks:
                            t = blk(t)
                        ref = model.forward_head(model.norm(t))
                    assert torch.isfinite(got[i, s]).all()
                    torch.testing.assert_close(got[i, s], ref[0], rtol=1e-11, atol=1e-11)


def test_token_removal_without_prefix_tokens_gives_uniform_when_empty():
    model, x = make_model("avgpool"), make_inputs("avgpool", 2)
    order = torch.arange(16).expand(2, -1)
    logits = RemovalEngine(model).logits(x, order, [16, 15])
    assert (logits[:, 0] == 0).all() and torch.isfinite(logits).all()


def test_pixel_baselines_change_only_the_chosen_patches():
    model, x = make_model("vit"), make_inputs("vit", 2)
    layout = RemovalEngine(model).layout(x)
    removed = torch.zeros(2, 16, dtype=torch.bool)
    removed[0, [0, 5]] = True
    removed[1, 15] = True
    pix = torch.zeros(2, 32, 32, dtype=torch.bool)
    pix[0, 0:8, 0:8] = pix[0, 8:16, 8:16] = pix[1, 24:32, 24:32] = True
    for name in ("black", "mean", "blur", "random"):
        fill = baseline_images(x, name, [7, 8])
        out = remove_pixels(x, fill, removed, layout)
        changed = (out != x).any(1)
        assert not changed[~pix].any(), name
        assert torch.equal(out.permute(0, 2, 3, 1)[pix], fill.permute(0, 2, 3, 1)[pix]), name
    assert (baseline_images(x, "black", [0, 1]) == 0).all()
    mean = baseline_images(x, "mean", [0, 1])
    torch.testing.assert_close(mean[:, :, 3, 4], x.mean((2, 3)))
    rnd = baseline_images(x, "random", [0, 1])
    assert torch.equal(rnd, baseline_images(x, "random", [0, 1]))
    assert (rnd[0] >= x[0].min()).all() and (rnd[0] <= x[0].max()).all()


def test_gaussian_blur_is_a_normalised_11x5_gaussian():
    img = torch.zeros(1, 1, 31, 31, dtype=torch.float64)
    img[0, 0, 15, 15] = 1.0
    out = gaussian_blur(img)
    r = torch.arange(-5, 6, dtype=torch.float64)
    k = torch.exp(-r ** 2 / 50)
    ref = torch.outer(k, k) / k.sum() ** 2
    torch.testing.assert_close(out[0, 0, 10:21, 10:21], ref)
    assert out.sum().item() == pytest.approx(1.0)
    const = torch.full((1, 3, 16, 16), 0.7, dtype=torch.float64)
    torch.testing.assert_close(gaussian_blur(const), const)


@pytest.mark.parametrize("removal", ["token", "blur", "random"])
def test_batched_evaluation_equals_per_image(removal):
    model, x = make_model("vit"), make_inputs("vit", 3)
    maps = TokenIxG(model).attribute(x, output="tokens")
    full = deletion(model, x, maps, n_steps=5, removal=removal, forward_batch=4,
                    example_ids=[10, 11, 12])
    for i in range(3):
        one = deletion(model, x[i:i + 1], maps[i:i + 1], n_steps=5, removal=removal,
                       forward_batch=1, example_ids=[10 + i])
        torch.testing.assert_close(one.curves[0], full.curves[i], rtol=1e-12, atol=1e-12)


def test_metrics_leave_the_model_unchanged_and_accept_our_methods():
    model, x = make_model("layerscale"), make_inputs("layerscale", 2)
    before = snapshot(model)
    gae = GAE(model)
    res = perturbation_test(model, x, gae, labels=[0, 1])
    assert res.curves.shape == (2, 21) and 0 <= res.value <= 100
    assert res.curves[:, 0].tolist() == [float(v) for v in (model(x).argmax(-1) ==
                                                              torch.tensor([0, 1])).tolist()]
    token_ratio(model, x, gae, removal="mean")
    with pytest.raises(ValueError):
        token_ratio(model, x, gae, ratios=[0.0, 0.5])
    assert_unchanged(model, before)


def test_bad_inputs_raise_clear_errors():
    model, x = make_model("vit"), make_inputs("vit", 2)
    maps = torch.rand(2, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="removal"):
        deletion(model, x, maps, removal="white")
    with pytest.raises(ValueError, match="ratios"):
        token_ratio(model, x, maps, ratios=[0.5, 1.0])
    with pytest.raises(ValueError, match="fractions"):
        aopc(model, x, maps, fractions=[-0.1, 0.5])
    with pytest.raises(ValueError, match="empty"):
        deletion(model, x[:0], maps[:0])
    with pytest.raises(ValueError, match="prefix"):
        deletion(model, x, torch.rand(2, 17, dtype=torch.float64))
    with pytest.raises(ValueError, match="patch grid"):
        deletion(model, x, torch.rand(2, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="order"):
        perturbation_test(model, x, maps, order="up")
    with pytest.raises(ValueError, match="n_steps"):
        deletion(model, x, maps, n_steps=0)
    with pytest.raises(ValueError, match="forward_batch"):
        RemovalEngine(model, forward_batch=0)
    assert math.isfinite(deletion(model, x, maps).value)


def test_forward_batch_is_one_name_and_batch_size_still_works_with_a_warning():
    """The removal metrics, SaCo and the engine call the jobs per forward
    ``forward_batch`` (``batch_size`` is images per batch in EvalSettings); the old
    spelling gives the same values and a DeprecationWarning naming the new one."""
    from captum_vit.metrics import saco

    model, x = make_model("vit"), make_inputs("vit", batch=2)
    maps = torch.rand(2, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    new = deletion(model, x, maps, n_steps=4, forward_batch=3)
    with pytest.warns(DeprecationWarning, match="forward_batch"):
        old = deletion(model, x, maps, n_steps=4, batch_size=3)
    assert torch.equal(new.per_example, old.per_example)
    with pytest.warns(DeprecationWarning, match="forward_batch"):
        assert RemovalEngine(model, batch_size=3).forward_batch == 3
    assert RemovalEngine(model).forward_batch == 64
    with pytest.warns(DeprecationWarning, match="forward_batch"):
        old = saco(model, x, maps, n_groups=4, batch_size=2)
    assert torch.equal(saco(model, x, maps, n_groups=4, forward_batch=2).per_example,
                       old.per_example)
    with pytest.raises(TypeError, match="batch_sise"):
        saco(model, x, maps, batch_sise=2)
