"""Hugging Face Swin (``SwinForImageClassification``, ``SwinModel``): the second reader of
the canonical Swin form. Forward parity with the model in float64; with the weights of
a timm twin, the same maps for every method that runs on Swin."""

from __future__ import annotations

import pytest
import torch

from captum_vit.adapters import HFSwinAdapter, adapt
from captum_vit.registry import build_method
from tests.families.test_swin_methods import REDUCTION_METHODS
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

pytestmark = needs_transformers


@pytest.mark.parametrize("family", ["hf_swin", "hf_swin_pad"])
def test_forward_parity(family):
    """Windows (padded before the shift, Hugging Face's order), seam masks, position bias
    and merges as the model computes them: logits equal to 1e-12 in float64."""
    model = make_model(family)
    before = snapshot(model)
    x = make_inputs(family, batch=2)
    adapter = adapt(model)
    assert isinstance(adapter, HFSwinAdapter)
    assert all(b.window.pad_first for b in adapter.blocks)
    with torch.no_grad():
        ref = model(pixel_values=x).logits
        ours = adapter.run(adapter.embed(x))
    assert (ref - ours).abs().max() <= 1e-12
    assert_unchanged(model, before)


def test_odd_grid_and_swin_model_embedding():
    """A 3x3 grid merged with a zero row (three stages) and the head-less ``SwinModel``,
    whose output is its pooled embedding."""
    timm_model = make_swin_model("timm_swin", img_size=24, depths=(2, 2, 2),
                                 num_heads=(2, 2, 2))
    x = torch.randn(2, 3, 24, 24, dtype=torch.float64)
    for pooled in (False, True):
        model = hf_swin_twin(timm_model, pooled=pooled)
        adapter = adapt(model)
        assert adapter.embedding is pooled
        with torch.no_grad():
            out = model(pixel_values=x)
            ref = out.pooler_output if pooled else out.logits
            ours = adapter.run(adapter.embed(x))
        assert (ref - ours).abs().max() <= 1e-12
        if not pooled:  # no padding inside the windows here: the timm twin agrees
            assert (timm_model(x) - ref).abs().max() <= 1e-12


@pytest.mark.long
def test_same_maps_as_the_timm_twin():
    """Mapped weights (windows that divide the grids, so both libraries compute the same
    function): every method that runs on Swin gives the timm twin's maps."""
    timm_model = make_swin_model("timm_swin")
    model = hf_swin_twin(timm_model)
    x = make_inputs("timm_swin", batch=2)
    t = torch.tensor([1, 3])
    fast = {"rise": {"n_masks": 16}, "tam": {"n_steps": 3, "start_layer": 0},
            "bt_h": {"n_steps": 3, "start_layer": 0}, "bt_t": {"n_steps": 3, "start_layer": 0}}
    for name in REDUCTION_METHODS:
        kw = {**fast.get(name, {}), "output": "tokens"}
        ours = build_method(name, model).attribute(x, t, **kw)
        ref = build_method(name, timm_model).attribute(x, t, **kw)
        assert_close_scaled(ours, ref, rel=1e-10)


def test_padding_order_differs_between_the_libraries():
    """With a grid padded to whole windows and a shift, Hugging Face pads before rolling
    and timm after: the two are different functions, and each adapter follows its own
    model (the parity test above); the twins' logits differ."""
    timm_model = make_swin_model("timm_swin_pad")
    model = hf_swin_twin(timm_model)
    x = make_inputs("timm_swin_pad", batch=2)
    with torch.no_grad():
        assert (timm_model(x) - model(pixel_values=x).logits).abs().max() > 1e-6


def test_swin_v2_refused_by_name():
    import transformers

    cfg = transformers.Swinv2Config(image_size=32, patch_size=4, embed_dim=16, depths=[2],
                                    num_heads=[2], window_size=4, num_labels=3)
    from captum_vit.adapters import HFSwinV2Adapter

    model = transformers.Swinv2ForImageClassification(cfg).eval()
    with pytest.raises(TypeError, match="Swinv2ForImageClassification.*cosine attention"):
        HFSwinAdapter(model)  # the v1 reader; adapt() dispatches to the Swin V2 family
    assert isinstance(adapt(model), HFSwinV2Adapter)


def test_swin_model_with_vector_targets():
    """``SwinModel`` outputs its pooled embedding (the last stage's width): explained with
    vector targets; DecompX is complete against the dot product."""
    from captum_vit import GAE, DecompX, EmbeddingTarget

    model = hf_swin_twin(make_swin_model("timm_swin"), pooled=True)
    assert adapt(model).num_classes == 32
    x = make_inputs("timm_swin", batch=2)
    vec = torch.randn(2, 32, dtype=torch.float64)
    target = EmbeddingTarget(vec, similarity="dot")
    assert GAE(model).attribute(x, target=target, output="grid").shape == (2, 1, 8, 8)
    dec = DecompX(model, route="explicit").decompose(x, target)
    with torch.no_grad():
        score = (model(pixel_values=x).pooler_output * vec).sum(-1)
    torch.testing.assert_close(dec.tokens.sum(-1) + dec.bias, score, rtol=0, atol=1e-10)
