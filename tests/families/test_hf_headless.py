"""Hugging Face head-less backbones (``ViTModel``, ``DeiTModel``, ``Dinov2Model``,
``Dinov2WithRegistersModel``; SPEC_REACH §10.3) as embedding models.

- the adapter's forward equals the model's own ``pooler_output`` (float64, two input
  sizes: the second interpolates the position embeddings), with and without ViT's tanh
  pooler, for another pooler width and activation, and for what ``AutoModel.from_config``
  builds;
- a ``ViTModel`` holding a ``ViTForImageClassification``'s backbone (no pooler: the
  classifier reads the CLS row after the final norm) explained with
  ``EmbeddingTarget(W[c], similarity="dot", bias=b[c])`` gives the classifier's maps for
  class ``c`` (GAE, Rollout, IxG), and every method gives the maps of a two-class twin
  whose logit 0 is that score;
- every method runs on the backbones outside the contract tables; the model is unchanged;
  clear errors.

The contract over every method (vector targets, NoiseTunnel, errors) runs on the
``hf_vit_model``, ``hf_deit_model`` and ``hf_dinov2_reg_model`` families of
``tests.helpers.EMBED_FAMILIES`` (tests/targets/test_embedding_targets.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from captum_vit import GAE, EmbeddingTarget
from captum_vit.adapters import HFBackboneAdapter, PreLogitsHeadParts, adapt
from captum_vit.registry import available_methods, build_method
from tests.helpers import (
    assert_close_scaled,
    assert_unchanged,
    make_hf_model,
    needs_transformers,
    randomize_,
    snapshot,
)

pytestmark = needs_transformers
METHODS = available_methods(baselines=True, compositions=True)
FAST = {"tis": {"n_masks": 16}, "rise": {"n_masks": 16}}
SIZES = ((32, 32), (24, 40))

# name -> (class name, config class name, config overrides, constructor keyword arguments)
BACKBONES: dict[str, tuple[str, str, dict, dict]] = {
    "vit": ("ViTModel", "ViTConfig", {}, {}),
    "vit_nopool": ("ViTModel", "ViTConfig", {}, {"add_pooling_layer": False}),
    "vit_wide_gelu_pool": ("ViTModel", "ViTConfig",
                           {"pooler_output_size": 24, "pooler_act": "gelu"}, {}),
    "deit": ("DeiTModel", "DeiTConfig", {}, {}),
    "deit_nopool": ("DeiTModel", "DeiTConfig", {}, {"add_pooling_layer": False}),
    "dinov2": ("Dinov2Model", "Dinov2Config", {"layerscale_value": 0.5}, {}),
    "dinov2_swiglu": ("Dinov2Model", "Dinov2Config", {"use_swiglu_ffn": True}, {}),
    "dinov2_reg": ("Dinov2WithRegistersModel", "Dinov2WithRegistersConfig",
                   {"num_register_tokens": 3}, {}),
}
_MODELS: dict[str, nn.Module] = {}


def config(cfg_name: str, **extra):
    import transformers

    return getattr(transformers, cfg_name)(
        image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=3,
        num_attention_heads=4, intermediate_size=64, layer_norm_eps=1e-6, **extra)


def backbone(name: str) -> nn.Module:
    """A small random backbone of :data:`BACKBONES` (float64, eval), one per name."""
    if name not in _MODELS:
        import transformers

        cls_name, cfg_name, extra, kwargs = BACKBONES[name]
        torch.manual_seed(0)
        model = getattr(transformers, cls_name)(config(cfg_name, **extra), **kwargs)
        _MODELS[name] = randomize_(model, 0).double().eval()
    return _MODELS[name]


def images(size=(32, 32), batch: int = 2, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, *size, generator=g, dtype=torch.float64)


def own_pooled(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's own pooled output, straight from its forward."""
    kw = {"interpolate_pos_encoding": True} if "Dinov2" not in type(model).__name__ else {}
    out = model(pixel_values=x, **kw)
    return out.last_hidden_state[:, 0] if out.pooler_output is None else out.pooler_output


def close(a, b, tol=1e-10):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol * (1 + b.abs().max().item()))


@pytest.mark.parametrize("name", BACKBONES)
def test_forward_equals_the_models_own_pooled_output(name):
    model = backbone(name)
    a = adapt(model)
    assert isinstance(a, HFBackboneAdapter) and a.embedding and a.readout == "token"
    has_pooler = getattr(model, "pooler", None) is not None
    assert isinstance(a.head, PreLogitsHeadParts) == has_pooler
    width = model.config.pooler_output_size if has_pooler else model.config.hidden_size
    assert a.num_classes == width
    regs = getattr(model.config, "num_register_tokens", 0)
    assert a.num_prefix == 1 + ("DeiT" in type(model).__name__) + regs
    for size in SIZES:
        x = images(size)
        ref = own_pooled(model, x)
        assert ref.shape == (2, width)
        if not has_pooler and "Dinov2" in type(model).__name__:  # DINOv2: CLS after the norm
            assert_close_scaled(ref, model(pixel_values=x).last_hidden_state[:, 0])
        assert_close_scaled(a.run(a.embed(x)), ref)
        assert_close_scaled(a.model_outputs(x), ref)


def test_without_a_pooler_the_embedding_is_the_cls_row_after_the_final_norm():
    model = backbone("vit_nopool")
    x = images((24, 40))
    out = model(pixel_values=x, interpolate_pos_encoding=True)
    assert out.pooler_output is None
    assert_close_scaled(adapt(model).model_outputs(x), out.last_hidden_state[:, 0])
    pooled = backbone("vit")
    h = pooled(pixel_values=x, interpolate_pos_encoding=True).last_hidden_state[:, 0]
    assert_close_scaled(adapt(pooled).model_outputs(x),
                        torch.tanh(pooled.pooler.dense(h)))  # ViTPooler: tanh(dense(CLS))


@pytest.mark.parametrize("cfg_name", ["ViTConfig", "DeiTConfig", "Dinov2Config",
                                      "Dinov2WithRegistersConfig"])
def test_automodel_from_config_is_supported(cfg_name):
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config(cfg_name)).double().eval()
    assert type(model).__name__ == cfg_name.replace("Config", "Model")
    a = adapt(model)
    assert type(a) is HFBackboneAdapter
    x = images((24, 40))
    assert_close_scaled(a.run(a.embed(x)), own_pooled(model, x))
    every = [p for stage in a.parameter_stages() for p in stage]
    emb = {id(p) for p in model.embeddings.parameters()}
    assert len({id(p) for p in every}) == len(every)
    assert {id(p) for p in every} | emb == {id(p) for p in model.parameters()}
    assert not {id(p) for p in every} & emb


def classifier_and_backbone(num_labels: int = 5):
    """A random ``ViTForImageClassification`` and a ``ViTModel`` (no pooler) holding its
    backbone's weights."""
    import transformers

    clf = make_hf_model("hf_vit", num_classes=num_labels)
    model = transformers.ViTModel(clf.config, add_pooling_layer=False).double().eval()
    model.load_state_dict(clf.vit.state_dict())
    return clf, model


@pytest.mark.parametrize("name", ["gae", "rollout", "token_ixg"])
@pytest.mark.parametrize("size", SIZES)
def test_backbone_with_a_classifier_row_target_equals_the_classifier(name, size):
    """HF's classifier reads ``layernorm(last hidden state)[:, 0]`` (verified in
    ``ViTForImageClassification.forward``), so ``⟨e, W_c⟩ + b_c`` on the backbone is the
    classifier's logit ``c`` and every map of class ``c`` is the classifier's."""
    clf, model = classifier_and_backbone()
    x = images(size)
    kw = {"interpolate_pos_encoding": size != (32, 32)}
    w, b = clf.classifier.weight, clf.classifier.bias
    for c in (0, 3):
        target = EmbeddingTarget(w[c].detach(), similarity="dot", bias=b[c].item())
        assert_close_scaled(adapt(model).model_outputs(x) @ w[c] + b[c],
                            clf(pixel_values=x, **kw).logits[:, c])
        before = snapshot(model)
        ours = build_method(name, model).attribute(x, target=target, output="tokens")
        ref = build_method(name, clf).attribute(x, target=c, output="tokens")
        close(ours, ref)
        assert_unchanged(model, before)


@pytest.mark.parametrize("name", METHODS)
def test_every_method_equals_a_two_class_twin(name):
    """A classifier whose logit 0 is ``⟨e, W_c⟩ + b_c`` and logit 1 is 0: its softmax
    probability of class 0 is the sigmoid the single-vector target scores, so the
    probability-scored methods agree too."""
    clf, model = classifier_and_backbone(num_labels=2)
    full = make_hf_model("hf_vit")
    with torch.no_grad():
        clf.classifier.weight[0] = full.classifier.weight[2]
        clf.classifier.bias[0] = full.classifier.bias[2]
        clf.classifier.weight[1] = 0.0
        clf.classifier.bias[1] = 0.0
    x = images()
    target = EmbeddingTarget(clf.classifier.weight[0].detach().clone(), similarity="dot",
                             bias=clf.classifier.bias[0].item())
    assert_close_scaled(clf(pixel_values=x).logits[:, 0],
                        adapt(model).model_outputs(x) @ target.vectors + target.bias)
    kw = dict(FAST.get(name, {}))
    if name.endswith("tokentm"):  # its default for one vector is the score, not the sigmoid
        kw["score"] = "probability"
    ours = build_method(name, model).attribute(x, target=target, output="tokens", **kw)
    ref = build_method(name, clf).attribute(x, target=0, output="tokens", **kw)
    close(ours, ref)


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("family", ["vit_nopool", "dinov2"])
def test_every_method_runs_on_the_other_backbones(name, family):
    """The backbones outside the contract tables: finite maps of the right shape for a
    vector target, and the model unchanged."""
    model = backbone(family)
    x = images()
    before = snapshot(model)
    t = torch.randn(2, adapt(model).num_classes, generator=torch.Generator().manual_seed(3),
                    dtype=torch.float64)
    out = build_method(name, model).attribute(x, target=t, output="tokens",
                                              **FAST.get(name, {}))
    assert out.shape == (2, 16) and out.dtype == torch.float64 and torch.isfinite(out).all()
    assert_unchanged(model, before)


def test_clear_errors_and_the_model_unchanged():
    model = backbone("vit")
    x = images()
    before = snapshot(model)
    gae = GAE(model)
    with pytest.raises(ValueError, match="target"):
        gae.attribute(x)  # an embedding model has no predicted class
    with pytest.raises(TypeError, match="target"):
        gae.attribute(x, target=1)
    with pytest.raises(ValueError, match="target"):
        gae.attribute(x, target=torch.ones(7, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"torch\.float32.*torch\.float64"):
        gae.attribute(x.float(), target=torch.ones(32, dtype=torch.float64))
    with pytest.raises(ValueError, match="patch size"):
        gae.attribute(images((30, 32)), target=torch.ones(32, dtype=torch.float64))
    assert_unchanged(model, before)

    odd = copy.deepcopy(model)
    odd.pooler = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
    with pytest.raises(TypeError, match="pooler"):
        adapt(odd)
    headless_classifier = make_hf_model("hf_vit", num_classes=0)
    with pytest.raises(TypeError, match=r"linear classifier head.*model\.vit"):
        adapt(headless_classifier)


def test_hf_model_spec_loads_a_saved_backbone(tmp_path):
    """``hf:FOLDER`` builds the saved architecture (``Dinov2Model``): an embedding model, no
    class names, the same maps as the model it was saved from."""
    import transformers

    from captum_vit.models import load_model

    model = copy.deepcopy(backbone("dinov2")).float()
    model.save_pretrained(tmp_path / "dinov2")
    lm = load_model(f"hf:{tmp_path / 'dinov2'}")
    assert isinstance(lm.model, transformers.Dinov2Model) and adapt(lm.model).embedding
    assert lm.class_names is None
    x = images().float()
    t = torch.randn(32, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(GAE(lm.model).attribute(x, target=t, output="tokens"),
                               GAE(model).attribute(x, target=t, output="tokens"))
