"""Quantus interop: the explain_func contract, export_quantus, and Quantus's MaxSensitivity and
PointingGame against captum_vit's own metrics (exact where the definitions match)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from captum.attr import Saliency

from captum_vit import GAE, RawAttention
from captum_vit.adapters import adapt
from captum_vit.interop import export_quantus, quantus_explain_func, quantus_maps
from captum_vit.metrics.localization import patch_centres_in, pointing_game, upsample
from captum_vit.metrics.removal import example_seeds
from captum_vit.metrics.robustness import max_sensitivity
from captum_vit.registry import method_factory
from tests.helpers import assert_close_scaled, assert_unchanged, make_inputs, make_model, snapshot


def _tokens(model, x, y, cls=GAE):
    return cls(model).attribute(x, target=y, output="tokens")


def _pixels(tokens, x, model):
    """The patch-constant map [B, 1, H, W], written out with repeat_interleave."""
    layout = adapt(model).layout(x)
    (gh, gw), (ph, pw) = layout.grid, layout.patch_size
    grid = tokens.reshape(-1, 1, gh, gw)
    return grid.repeat_interleave(ph, 2).repeat_interleave(pw, 3).numpy()


def test_explain_func_signature_numpy_in_out_and_device_ignored():
    model, x = make_model(), make_inputs(batch=3)
    y = np.array([0, 3, 1])
    before = snapshot(model)
    explain = quantus_explain_func("gae")
    assert list(inspect.signature(explain).parameters) == ["model", "inputs", "targets",
                                                            "kwargs"]
    a = explain(model=model, inputs=x.numpy(), targets=y, device="cuda:7", method="GAE")
    assert isinstance(a, np.ndarray) and a.dtype == np.float64
    assert a.shape == (3, 1, *x.shape[-2:])
    np.testing.assert_array_equal(a, _pixels(_tokens(model, x, torch.tensor(y)), x, model))
    # tensors in, float32 numpy (cast to the model's dtype), int or float labels
    a2 = explain(model, x, torch.tensor(y))
    a3 = explain(model, x.float().numpy(), y.astype(np.float32))
    np.testing.assert_array_equal(a, a2)
    np.testing.assert_array_equal(a3, explain(model, x.float().double(), y))
    assert_unchanged(model, before)


def test_a_fresh_model_every_call_is_explained_as_it_is():
    x, y = make_inputs(batch=2), np.array([1, 2])
    explain = quantus_explain_func(GAE)
    for seed in (0, 1, 2):
        model = make_model(seed=seed)
        np.testing.assert_array_equal(explain(model, x.numpy(), y),
                                      _pixels(_tokens(model, x, torch.tensor(y)), x, model))
    # a model changed in place between calls (Quantus's cascading randomisation)
    model = make_model(seed=3)
    first = explain(model, x.numpy(), y)
    with torch.no_grad():
        model.blocks[-1].attn.qkv.weight.mul_(-2.0)
    again = explain(model, x.numpy(), y)
    assert not np.array_equal(first, again)
    np.testing.assert_array_equal(again, _pixels(_tokens(model, x, torch.tensor(y)), x, model))


@pytest.mark.filterwarnings("ignore:Input Tensor 0 did not already require gradients")
def test_method_kinds_attribute_kwargs_and_modes():
    model, x = make_model(), make_inputs(batch=2)
    y = np.array([4, 0])
    t = torch.tensor(y)
    raw = _pixels(_tokens(model, x, t, RawAttention), x, model)
    for method in ("raw_attention", RawAttention, method_factory("raw-attention"),
                   RawAttention(model)):
        np.testing.assert_array_equal(quantus_explain_func(method)(model, x.numpy(), y), raw)
    # another Captum attribution: its pixel map summed over the channels
    sal = Saliency(model).attribute(x, target=t, abs=False)
    np.testing.assert_array_equal(
        quantus_explain_func("captum:Saliency", abs=False)(model, x.numpy(), y),
        sal.sum(1, keepdim=True).numpy())
    # call-time keywords reach attribute and override the bound ones
    np.testing.assert_array_equal(
        quantus_explain_func("captum:Saliency")(model, x.numpy(), y, abs=False),
        sal.sum(1, keepdim=True).numpy())
    layout = adapt(model).layout(x)
    tokens = _tokens(model, x, t)
    bil = quantus_explain_func("gae", mode="bilinear")(model, x.numpy(), y)
    np.testing.assert_allclose(bil[:, 0], upsample(tokens, layout.grid, layout.patch_size,
                                                   x.shape[-2:]).numpy(), rtol=0, atol=0)
    # every map shape quantus_maps takes gives the same pixels
    gh, gw = layout.grid
    for maps in (tokens, tokens.reshape(2, gh, gw), tokens.reshape(2, 1, gh, gw)):
        np.testing.assert_array_equal(quantus_maps(maps, x, layout), _pixels(tokens, x, model))
    pix = torch.rand(2, 3, *x.shape[-2:], dtype=torch.float64)
    np.testing.assert_array_equal(quantus_maps(pix, x, layout), pix.sum(1, keepdim=True))
    np.testing.assert_array_equal(quantus_maps(pix[:, 0], x, layout), pix[:, :1])


def test_errors_name_the_argument_and_the_fix():
    model, x = make_model(), make_inputs(batch=2)
    other = make_model(seed=5)
    with pytest.raises(TypeError, match="rebuilt for each model"):
        quantus_explain_func(GAE(model))(other, x.numpy(), np.array([0, 1]))
    with pytest.raises(TypeError, match="registry name"):
        quantus_explain_func(3)
    with pytest.raises(TypeError, match="Captum Attribution"):
        quantus_explain_func(dict)
    with pytest.raises(ValueError, match="unknown method"):
        quantus_explain_func("no_such_method")
    with pytest.raises(ValueError, match="mode must be one of"):
        quantus_explain_func("gae", mode="cubic")
    with pytest.raises(TypeError, match="floating-point"):
        quantus_explain_func("gae")(model, x.numpy().astype(np.int64), np.array([0, 1]))
    layout = adapt(model).layout(x)
    with pytest.raises(ValueError, match="expected patch scores"):
        quantus_maps(torch.zeros(2, 7), x, layout)
    with pytest.raises(ValueError, match="one map per image"):
        export_quantus(model, x, torch.zeros(3, layout.num_patches))
    with pytest.raises(ValueError, match="batch_size"):
        export_quantus(model, x, "gae", batch_size=0)


def test_export_quantus_arrays_chunks_and_file(tmp_path):
    model, x = make_model(), make_inputs(batch=5)
    masks = torch.zeros(5, *x.shape[-2:], dtype=torch.bool)
    masks[:, 4:12, 8:20] = True
    pred = model(x).argmax(-1)
    out = export_quantus(model, x, "gae", masks=masks, batch_size=2, path=tmp_path / "b.npz")
    assert set(out) == {"x_batch", "y_batch", "a_batch", "s_batch"}
    np.testing.assert_array_equal(out["x_batch"], x.numpy())
    np.testing.assert_array_equal(out["y_batch"], pred.numpy())
    assert out["y_batch"].dtype == np.int64
    # chunks of 2 vs one batch of 5: batched matmuls round differently (float64)
    assert_close_scaled(out["a_batch"], _pixels(_tokens(model, x, pred), x, model))
    np.testing.assert_array_equal(out["s_batch"], masks[:, None].numpy())
    saved = np.load(tmp_path / "b.npz")
    assert sorted(saved.files) == ["a_batch", "s_batch", "x_batch", "y_batch"]
    for k in saved.files:
        np.testing.assert_array_equal(saved[k], out[k])
    # a given target, precomputed maps, no masks
    tokens = _tokens(model, x, torch.full((5,), 2))
    fixed = export_quantus(model, x, tokens, target=2)
    assert fixed["s_batch"] is None and fixed["y_batch"].tolist() == [2] * 5
    np.testing.assert_array_equal(fixed["a_batch"], _pixels(tokens, x, model))


# -- Quantus itself ------------------------------------------------------------------------
def _quantus():
    """Quantus (the ``quantus`` extra, also in ``test``), or a skip when it is missing or
    does not import (its OpenCV needs system libraries)."""
    return pytest.importorskip("quantus", exc_type=ImportError)


@pytest.fixture(scope="module")
def bundled():
    """The bundled model in float64 and 8 sample images with masks; y = the prediction."""
    from captum_vit.data.specs import load_data, model_batch
    from captum_vit.models import load_model

    lm = load_model("zoo:vit_fmnist_loc")
    model = lm.model.double().eval()
    data = load_data("sample", n=8, input_shape=lm.input_shape, num_classes=lm.num_classes)
    x, _, masks = model_batch(data, range(8), input_shape=lm.input_shape,
                              preprocess=lm.preprocess, dtype=torch.float64)
    return model, x, masks


def test_quantus_pointing_game_equals_captum_vit_on_patch_centre_masks(bundled):
    quantus = _quantus()
    model, x, masks = bundled
    batch = export_quantus(model, x, "gae", masks=masks)
    hits = quantus.PointingGame(disable_warnings=True)(model, **batch)  # the one line
    y = torch.as_tensor(batch["y_batch"])
    tokens = _tokens(model, x, y)
    assert ((tokens == tokens.amax(1, keepdim=True)).sum(1) == 1).all()  # unique top patch
    ours = pointing_game(model, x, tokens, masks, target=y).per_example
    assert not ours.isnan().any()  # every region < 50 % of the image: none skipped
    # captum_vit asks whether the top patch's centre lies in the region; Quantus whether any
    # pixel of the top patch does. Given the mask of the patches whose centre is in the
    # region, Quantus decides exactly as captum_vit; with the raw mask it is never lower.
    layout = adapt(model).layout(x)
    centres = patch_centres_in(masks, layout.grid, layout.patch_size).double()
    s_centre = upsample(centres, layout.grid, layout.patch_size, x.shape[-2:], "nearest")
    on_centres = quantus.PointingGame(disable_warnings=True)(
        model, **{**batch, "s_batch": s_centre.bool()[:, None].numpy()})
    assert np.asarray(on_centres, dtype=float).tolist() == ours.tolist()
    assert (np.asarray(hits, dtype=float) >= ours.numpy()).all()
    assert 0 < ours.mean() < 1  # the comparison sees hits and misses


def test_quantus_max_sensitivity_equals_captum_vit_with_the_same_noise(bundled):
    quantus = _quantus()
    model, x, _ = bundled
    batch = export_quantus(model, x, "gae")
    explain = quantus_explain_func("gae")
    # the one line, Quantus's own noise: runs and is finite
    own = quantus.MaxSensitivity(nr_samples=2, lower_bound=0.02, disable_warnings=True)(
        model, **batch, explain_func=explain)
    assert np.isfinite(own).all() and len(own) == 8
    # captum_vit's noise (SPEC §6.7: 10 samples, radius 0.02, seeded per example) replayed
    n, r, seed = 10, 0.02, 3
    noise = np.stack([
        (torch.rand((n, *x.shape[1:]), generator=torch.Generator().manual_seed(s),
                    dtype=torch.float64) * 2 * r - r).reshape(n, -1).numpy()
        for s in example_seeds(None, x.shape[0], seed)])

    class Replay:
        step = 0

        def __call__(self, arr, indices, **kwargs):
            self.step += 1
            return arr + noise[:, self.step - 1]

    theirs = quantus.MaxSensitivity(nr_samples=n, lower_bound=r, perturb_func=Replay(),
                                    disable_warnings=True)(model, **batch, explain_func=explain)
    ours = max_sensitivity(model, x, GAE(model), radius=r, n_samples=n, seed=seed).per_example
    assert_close_scaled(theirs, ours.numpy())
    assert ours.min() > 0


def test_quantus_randomisation_metric_rebuilds_the_method(bundled):
    quantus = _quantus()
    model, x, _ = bundled
    batch = export_quantus(model, x[:2], "gae")
    before = snapshot(model)
    scores = quantus.MPRT(return_last_correlation=True, disable_warnings=True)(
        model, **batch, explain_func=quantus_explain_func("gae"))
    assert len(scores) == 2 and np.isfinite(scores).all()
    assert_unchanged(model, before)
