"""Bootstrap confidence intervals over examples (``captum_vit.metrics.report``): the
intervals against a slow reference written here (a Python loop over resamples and numpy's
percentiles), the paired difference, the verdicts, seeded reproducibility, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from captum_vit.metrics.report import (
    BootstrapCI,
    bootstrap_ci,
    bootstrap_indices,
    paired_bootstrap_ci,
    verdict,
)
from captum_vit.metrics.results import MetricResult


def _reference(stat_of_rows, n: int, n_boot: int, seed: int, level: float = 0.95):
    """The percentile interval by hand: one resample at a time, numpy's percentiles."""
    idx = bootstrap_indices(n, n_boot=n_boot, seed=seed).numpy()
    stats = np.array([stat_of_rows(row) for row in idx])
    a = 100 * (1 - level) / 2
    return float(np.percentile(stats, a)), float(np.percentile(stats, 100 - a))


def test_indices_are_a_resample_with_replacement_and_seeded():
    a = bootstrap_indices(50, n_boot=400, seed=3)
    assert a.shape == (400, 50) and a.dtype == torch.int64
    assert int(a.min()) >= 0 and int(a.max()) < 50
    # with replacement: some rows repeat an example (a permutation never would)
    assert any(len(set(r.tolist())) < 50 for r in a)
    assert torch.equal(a, bootstrap_indices(50, n_boot=400, seed=3))
    assert not torch.equal(a, bootstrap_indices(50, n_boot=400, seed=4))


def test_mean_interval_equals_the_loop_reference():
    v = np.random.default_rng(0).gamma(2.0, 1.0, 97)
    ci = bootstrap_ci(torch.tensor(v), n_boot=500, level=0.9, seed=7)
    lo, hi = _reference(lambda r: v[r].mean(), 97, 500, 7, level=0.9)
    assert ci.estimate == pytest.approx(v.mean(), abs=1e-12)
    assert (ci.low, ci.high) == (pytest.approx(lo, abs=1e-12), pytest.approx(hi, abs=1e-12))
    assert ci.level == 0.9 and ci.n_boot == 500
    # a sequence of floats gives the same interval as the tensor
    assert bootstrap_ci(v.tolist(), n_boot=500, level=0.9, seed=7) == ci


def test_interval_narrows_like_one_over_root_n():
    """A sanity check of scale: the 95% interval of a mean is about ±1.96 σ/√n."""
    v = torch.tensor(np.random.default_rng(1).normal(0.0, 1.0, 2000))
    ci = bootstrap_ci(v, n_boot=2000, seed=0)
    half = 1.96 * float(v.std()) / 2000 ** 0.5
    assert (ci.high - ci.low) / 2 == pytest.approx(half, rel=0.1)
    assert ci.low < float(v.mean()) < ci.high


def test_nan_examples_are_skipped_like_nanmean():
    v = np.array([1.0, np.nan, 3.0, 4.0, np.nan, 0.5, 2.0, 7.0])
    res = MetricResult("pointing_game", torch.tensor(v), True, reduction="nanmean")
    ci = bootstrap_ci(res, n_boot=300, seed=2)
    lo, hi = _reference(lambda r: np.nanmean(v[r]), 8, 300, 2)
    assert ci.estimate == pytest.approx(res.value, abs=1e-12)
    assert (ci.low, ci.high) == (pytest.approx(lo, abs=1e-12), pytest.approx(hi, abs=1e-12))


def test_iou_result_is_reaccumulated_over_each_resample():
    """mIoU is not a mean of per-image values: each resample sums its images' stats."""
    g = np.random.default_rng(2)
    n = 40
    inter_fg, inter_bg = g.integers(0, 50, n).astype(float), g.integers(0, 50, n).astype(float)
    union_fg, union_bg = inter_fg + g.integers(1, 30, n), inter_bg + g.integers(1, 30, n)
    stats = {k: torch.tensor(x) for k, x in (("inter_fg", inter_fg), ("union_fg", union_fg),
                                             ("inter_bg", inter_bg), ("union_bg", union_bg))}
    per = (inter_fg / union_fg + inter_bg / union_bg) / 2
    res = MetricResult("miou", torch.tensor(per), True, stats=stats, reduction="iou")

    def miou(r):
        return (inter_fg[r].sum() / union_fg[r].sum() + inter_bg[r].sum() / union_bg[r].sum()) / 2

    ci = bootstrap_ci(res, n_boot=300, seed=5)
    lo, hi = _reference(miou, n, 300, 5)
    assert ci.estimate == pytest.approx(res.value, abs=1e-12)
    assert (ci.low, ci.high) == (pytest.approx(lo, abs=1e-12), pytest.approx(hi, abs=1e-12))
    # the mean of per-image IoUs would be a different statistic
    assert abs(per.mean() - res.value) > 1e-4


def test_custom_statistic_equals_the_loop_reference():
    v = np.random.default_rng(3).normal(size=(60, 2))
    ci = bootstrap_ci(torch.tensor(v), lambda t: t[:, 0].median() - t[:, 1].mean(),
                      n_boot=200, seed=1)
    lo, hi = _reference(lambda r: np.quantile(v[r, 0], 0.5, method="lower")
                        - v[r, 1].mean(), 60, 200, 1)
    assert (ci.low, ci.high) == (pytest.approx(lo, abs=1e-12), pytest.approx(hi, abs=1e-12))


def test_paired_difference_uses_the_same_resample_for_both_methods():
    g = np.random.default_rng(4)
    base = g.normal(0.0, 1.0, 80)  # a large per-image effect shared by both methods
    a, b = base + 0.05 + g.normal(0, 0.01, 80), base + g.normal(0, 0.01, 80)
    d = paired_bootstrap_ci(torch.tensor(a), torch.tensor(b), n_boot=400, seed=9)
    lo, hi = _reference(lambda r: a[r].mean() - b[r].mean(), 80, 400, 9)
    assert d.estimate == pytest.approx(a.mean() - b.mean(), abs=1e-12)
    assert (d.low, d.high) == (pytest.approx(lo, abs=1e-12), pytest.approx(hi, abs=1e-12))
    # paired, the shared per-image effect cancels: the difference is clear of 0 although
    # each method's own interval overlaps the other's
    ca, cb = bootstrap_ci(a, n_boot=400, seed=9), bootstrap_ci(b, n_boot=400, seed=9)
    assert ca.low < cb.high and d.low > 0
    assert verdict([d], higher_is_better=True) == "holds"
    assert verdict([d], higher_is_better=False) == "does not hold"
    # a custom statistic is applied to each side of the same resample
    dm = paired_bootstrap_ci(torch.tensor(a), torch.tensor(b), lambda t: t.median(),
                             n_boot=100, seed=9)
    lo, hi = _reference(lambda r: np.quantile(a[r], 0.5, method="lower")
                        - np.quantile(b[r], 0.5, method="lower"), 80, 100, 9)
    assert (dm.low, dm.high) == (pytest.approx(lo, abs=1e-12), pytest.approx(hi, abs=1e-12))


def test_a_difference_whose_interval_contains_zero_is_within_noise():
    g = np.random.default_rng(5)
    a = g.normal(0.5, 0.2, 64)
    b = a + g.normal(0.0, 0.2, 64)  # no real difference, noisy per image
    b += a.mean() - b.mean() + 0.001  # the point estimate favours b by a hair
    d = paired_bootstrap_ci(a, b, n_boot=1000, seed=0)
    assert d.estimate < 0 and d.contains(0.0)
    assert verdict([d], higher_is_better=True) == "within noise"
    assert verdict([d], higher_is_better=False) == "within noise"


def test_verdict_rules_for_several_differences():
    up, down, zero = BootstrapCI(0.02, 0.01, 0.03), BootstrapCI(-0.02, -0.03, -0.01), \
        BootstrapCI(0.0, -0.01, 0.01)
    assert verdict([up, up], higher_is_better=True) == "holds"
    assert verdict([up, zero], higher_is_better=True) == "within noise"
    # one other method better beyond noise decides, whatever the rest
    assert verdict([zero, down], higher_is_better=True) == "does not hold"
    assert verdict([down, down], higher_is_better=False) == "holds"
    assert verdict([down, zero], higher_is_better=False) == "within noise"
    assert verdict([up], higher_is_better=False) == "does not hold"
    with pytest.raises(ValueError, match="differences is empty"):
        verdict([], higher_is_better=True)


def test_seeded_reproducibility():
    v = torch.rand(33, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    w = torch.rand(33, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert bootstrap_ci(v, seed=11) == bootstrap_ci(v, seed=11)
    assert paired_bootstrap_ci(v, w, seed=11) == paired_bootstrap_ci(v, w, seed=11)
    assert bootstrap_ci(v, seed=11) != bootstrap_ci(v, seed=12)
    # the same seed resamples the same examples for every method: the difference of two
    # bootstrap means is the paired difference, resample by resample
    idx = bootstrap_indices(33, n_boot=2000, seed=11)
    diff = (v[idx].mean(1) - w[idx].mean(1)).numpy()
    d = paired_bootstrap_ci(v, w, seed=11)
    assert d.low == pytest.approx(float(np.percentile(diff, 2.5)), abs=1e-12)


def test_format():
    ci = BootstrapCI(0.1384, 0.1301, 0.1467)
    assert ci.format() == str(ci) == "0.138 [0.130, 0.147]"
    assert BootstrapCI(0.013, -0.0042, 0.03).format(3, sign=True) == "+0.013 [-0.004, +0.030]"
    assert ci.contains(0.14) and not ci.contains(0.0)


@pytest.mark.parametrize("call, error, match", [
    (lambda: bootstrap_ci([]), ValueError, r"one value per example"),
    (lambda: bootstrap_ci(torch.zeros(3, 2)), ValueError, r"pass a statistic"),
    (lambda: bootstrap_ci("abc"), TypeError, r"values must be a MetricResult"),
    (lambda: bootstrap_ci([1.0, 2.0], n_boot=0), ValueError, r"n_boot must be at least 1"),
    (lambda: bootstrap_ci([1.0, 2.0], n_boot=2.5), TypeError, r"n_boot must be an int"),
    (lambda: bootstrap_ci([1.0, 2.0], level=95), ValueError, r"level must be in \(0, 1\)"),
    (lambda: paired_bootstrap_ci([1.0, 2.0], [1.0, 2.0, 3.0]), ValueError,
     r"same examples; got 2 and 3"),
    (lambda: bootstrap_ci(MetricResult("m", torch.ones(3), True), lambda t: t.sum()),
     TypeError, r"pass result.per_example"),
    (lambda: bootstrap_ci(MetricResult("miou", torch.ones(3), True, reduction="iou")),
     ValueError, r"lacks the per-example stats"),
])
def test_bad_input_is_refused_clearly(call, error, match):
    with pytest.raises(error, match=match):
        call()
