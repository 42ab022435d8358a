"""Max-Sensitivity, sparseness, the randomisation check, results and Captum interop."""

from __future__ import annotations

import math

import pytest
import torch
from captum.attr import IntegratedGradients, NoiseTunnel, Saliency

from captum_vit.methods import GAE, RandomMap
from captum_vit.metrics import (
    MetricResult,
    deletion,
    gini,
    max_sensitivity,
    patch_maps,
    plot_curves,
    randomization,
    sparseness,
    spearman,
)
from captum_vit.metrics.removal import RemovalEngine
from captum_vit.registry import method_factory
from tests.helpers import assert_unchanged, make_inputs, make_model, snapshot


def test_gini_and_spearman_known_answers():
    v = torch.tensor([[0, 0, 0, 1.0], [1, 1, 1, 1.0], [0, 0, 0, 0.0], [1, 2, 3, 4.0]])
    # sorted ascending v: G = sum (2i - n - 1) v_i / (n sum v); last row: (−3 −2 + 3 + 12)/40
    assert gini(v).tolist() == pytest.approx([0.75, 0.0, 0.0, 0.25])
    a = torch.tensor([[1.0, 2, 3, 4], [1.0, 2, 3, 4], [1.0, 1, 2, 2]])
    b = torch.tensor([[4.0, 3, 2, 1], [2.0, 4, 6, 9], [1.0, 2, 3, 4]])
    r = spearman(a, b)
    # ties: ranks (1.5, 1.5, 3.5, 3.5) vs (1, 2, 3, 4) -> 2 / sqrt(4 * 5) = 0.8944
    assert r.tolist() == pytest.approx([-1.0, 1.0, 2 / math.sqrt(5)])
    assert math.isnan(spearman(torch.ones(1, 4), a[:1]).item())


def test_patch_pooling_of_captum_pixel_maps():
    model, x = make_model("vit"), make_inputs("vit", 2)
    layout = RemovalEngine(model).layout(x)
    t = torch.tensor([1, 3])
    ig = IntegratedGradients(model)
    pix = ig.attribute(x, target=t, n_steps=8)
    got = patch_maps(ig, x, t, layout, attribute_kwargs={"n_steps": 8})
    ref = torch.zeros(2, 16, dtype=torch.float64)
    for i in range(2):
        for r in range(4):
            for c in range(4):
                ref[i, 4 * r + c] = pix[i, :, 8 * r:8 * r + 8, 8 * c:8 * c + 8].abs().sum()
    torch.testing.assert_close(got, ref)
    signed = patch_maps(pix, x, t, layout, pixel_reduce="sum")
    torch.testing.assert_close(signed[0, 5], pix[0, :, 8:16, 8:16].sum())
    # our methods give exact patch scores
    torch.testing.assert_close(patch_maps(GAE(model), x, t, layout),
                               GAE(model).attribute(x, target=t, output="tokens"))


def test_captum_interop_integrated_gradients_and_noise_tunnel():
    model, x = make_model("vit"), make_inputs("vit", 2)
    before = snapshot(model)
    res = deletion(model, x, IntegratedGradients(model), n_steps=4,
                   attribute_kwargs={"n_steps": 8})
    assert res.curves.shape == (2, 5) and math.isfinite(res.value)
    nt = NoiseTunnel(Saliency(model))
    kw = dict(attribute_kwargs={"nt_type": "smoothgrad", "nt_samples": 2, "stdevs": 0.1})
    ms = max_sensitivity(model, x, nt, n_samples=2, **kw)
    assert ms.per_example.shape == (2,) and (ms.per_example >= 0).all()
    assert math.isfinite(sparseness(model, x, nt, **kw).value)
    assert_unchanged(model, before)


def test_max_sensitivity_is_seeded_per_example_and_batch_invariant():
    model, x = make_model("vit"), make_inputs("vit", 3)
    gae = GAE(model)
    full = max_sensitivity(model, x, gae, n_samples=3, example_ids=[4, 5, 6])
    again = max_sensitivity(model, x, gae, n_samples=3, example_ids=[4, 5, 6])
    assert torch.equal(full.per_example, again.per_example)
    one = max_sensitivity(model, x[1:2], gae, n_samples=3, example_ids=[5])
    torch.testing.assert_close(one.per_example[0], full.per_example[1], rtol=1e-10, atol=0)
    other = max_sensitivity(model, x, gae, n_samples=3, example_ids=[4, 5, 6], seed=1)
    assert not torch.equal(full.per_example, other.per_example)
    with pytest.raises(TypeError, match="precomputed"):
        max_sensitivity(model, x, torch.rand(3, 16))


def test_randomization_check_on_a_copy():
    model, x = make_model("vit"), make_inputs("vit", 2)
    before = snapshot(model)
    res = randomization(model, x, method_factory("gae"))
    assert res.curves.shape == (2, 1 + 3)  # head, then 3 blocks
    assert res.value < 0.9  # GAE depends on the weights
    sal = randomization(model, x, Saliency(model))
    assert sal.curves.shape == (2, 4)
    rnd = randomization(model, x, RandomMap(model))  # a model-independent map fails the check
    assert rnd.per_example.tolist() == pytest.approx([1.0, 1.0])
    again = randomization(model, x, method_factory("GAE"))
    assert torch.equal(res.curves, again.curves)
    with pytest.raises(TypeError, match="method_factory"):  # names go through the registry
        randomization(model, x, "gae")
    assert_unchanged(model, before)


def test_results_cat_dict_and_plot(tmp_path):
    a = MetricResult("pointing_game", torch.tensor([1.0, float("nan")]), True,
                     reduction="nanmean")
    b = MetricResult("pointing_game", torch.tensor([0.0]), True, reduction="nanmean")
    c = MetricResult.cat([a, b])
    assert c.value == pytest.approx(0.5) and len(c) == 3
    assert c.to_dict()["per_example"] == [1.0, None, 0.0]
    x = torch.linspace(0, 1, 3)
    r1 = MetricResult("deletion", torch.zeros(2), False, x, torch.rand(2, 3))
    plot_curves({"m1": r1, "m2": r1}, tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="no curve"):
        plot_curves({"a": a})
    with pytest.raises(ValueError):
        MetricResult.cat([])


def test_plot_curves_keeps_many_methods_apart():
    x = torch.linspace(0, 1, 3)
    r = MetricResult("deletion", torch.zeros(2), False, x, torch.rand(2, 3))
    fig = plot_curves({f"m{i}": r for i in range(14)})
    styles = {(line.get_color(), line.get_linestyle()) for line in fig.axes[0].lines}
    assert len(styles) == 14  # matplotlib's default cycle repeats after 10
