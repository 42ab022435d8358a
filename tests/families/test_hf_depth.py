"""Segmentation and depth heads on DINOv2 (SPEC_REACH §10.1-10.3).

- ``Dinov2Backbone`` (the backbone of Hugging Face's DPT and Depth Anything) is adapted as
  a head-less embedding model: our forward equals Dinov2Model's ``pooler_output`` computed
  from its own forward;
- :class:`~captum_vit.targets.DepthTarget` on ``DPTForDepthEstimation`` /
  ``DepthAnythingForDepthEstimation``: the neck's inputs built from our block outputs equal
  the backbone's own ``feature_maps`` (and what the model's neck receives in its own
  forward, hooked); the target's score equals the model's ``predicted_depth`` summed over
  the selection; token Input×Gradient equals autograd through the model's own forward;
  every registered method gives a finite, non-constant map or refuses by name (PLUS,
  SkipPLUS, FullGrad+: several blocks; TIS: token removal); the model is unchanged;
- a linear segmentation probe (1x1 convolution) on Dinov2Model's patch tokens with
  :class:`~captum_vit.targets.HeadTarget` and a region mask: every method.

Tiny random configurations, float64, nothing downloaded.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from captum.attr import NoiseTunnel
from torch import nn

from captum_vit import GAE
from captum_vit.adapters import HFBackboneAdapter, Ops, adapt
from captum_vit.adapters.scoring import Outputs
from captum_vit.metrics import deletion
from captum_vit.registry import available_methods, build_method
from captum_vit.targets import DepthTarget, HeadTarget
from tests.helpers import (
    assert_close_scaled,
    assert_unchanged,
    needs_transformers,
    randomize_,
    snapshot,
)

pytestmark = needs_transformers
METHODS = available_methods(compositions=True)
FAST = {"tis": {"n_masks": 16}, "rise": {"n_masks": 16},
        "bt_h": {"n_steps": 3, "start_layer": 0}, "bt_t": {"n_steps": 3, "start_layer": 0},
        "tam": {"n_steps": 3, "start_layer": 0}}
"""Fast options; BT's start block 0: a several-block target is explained block by block,
and its first read block (x_1) ends a one-block model."""
SEVERAL_BLOCKS_REFUSED = {"fullgrad_plus", "skip_fullgrad_plus"} | {
    m for m in METHODS if m.startswith(("plus:", "skipplus:"))}
"""Methods summing sub-networks that end at the model's output refuse several-block
targets by name."""
TOKEN_REMOVAL = {"tis"}
"""True token removal: refused for targets reading token rows."""

# name -> (model class, backbone overrides, model config overrides)
DEPTH_MODELS: dict[str, tuple[str, dict, dict]] = {
    # Depth Anything reads x_1 .. x_4 of 4 blocks after the final layernorm
    "depth_anything": ("DepthAnythingForDepthEstimation", {"out_indices": [1, 2, 3, 4]}, {}),
    # metric depth (sigmoid · max_depth), blocks 2, 3, 5 and 6 of 6
    "depth_anything_metric": ("DepthAnythingForDepthEstimation",
                              {"out_indices": [2, 3, 5, 6], "num_hidden_layers": 6},
                              {"depth_estimation_type": "metric", "max_depth": 20}),
    # DPT, CLS projected into the patches; x_1 .. x_4 of 5 blocks: the last block unread
    "dpt": ("DPTForDepthEstimation", {"out_indices": [1, 2, 3, 4], "num_hidden_layers": 5},
            {"readout_type": "project"}),
    # DPT adding the CLS, without the backbone's final layernorm
    "dpt_add_nonorm": ("DPTForDepthEstimation",
                       {"out_indices": [1, 2, 3, 4], "apply_layernorm": False},
                       {"readout_type": "add"}),
}
SIZES = ((28, 28), (21, 35))
_MODELS: dict[str, nn.Module] = {}


def backbone_config(**extra):
    import transformers

    kw = dict(image_size=28, patch_size=7, num_channels=3, hidden_size=32,
              num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
              layer_norm_eps=1e-6, layerscale_value=0.5, apply_layernorm=True,
              reshape_hidden_states=False)
    kw.update(extra)
    return transformers.Dinov2Config(**kw)


def depth_model(name: str) -> nn.Module:
    """A small random depth estimator of :data:`DEPTH_MODELS` (float64, eval)."""
    if name not in _MODELS:
        import transformers

        cls_name, bb, extra = DEPTH_MODELS[name]
        common = dict(backbone_config=backbone_config(**bb), neck_hidden_sizes=[8, 16, 16, 32],
                      fusion_hidden_size=16, reassemble_factors=[4, 2, 1, 0.5])
        if cls_name == "DPTForDepthEstimation":
            cfg = transformers.DPTConfig(is_hybrid=False, hidden_size=32, **common, **extra)
        else:
            cfg = transformers.DepthAnythingConfig(patch_size=7, head_hidden_size=8,
                                                   reassemble_hidden_size=32, **common, **extra)
        torch.manual_seed(0)
        model = getattr(transformers, cls_name)(cfg)
        _MODELS[name] = randomize_(model, 0).double().eval()
    return _MODELS[name]


def images(size=(28, 28), batch: int = 2, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, *size, generator=g, dtype=torch.float64)


def region(shape, batch: int | None = None) -> torch.Tensor:
    """A rectangle (``batch``: a different one per image)."""
    h, w = shape
    if batch is None:
        sel = torch.zeros(h, w, dtype=torch.float64)
        sel[h // 2:, w // 4: 3 * w // 4] = 1
        return sel
    sel = torch.zeros(batch, h, w, dtype=torch.float64)
    for i in range(batch):
        sel[i, i * h // (2 * batch): h // 2 + i * h // (2 * batch), : w // 2 + i] = 1 + i
    return sel


def own_depth(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(pixel_values=x).predicted_depth


def our_states(model: nn.Module, x: torch.Tensor) -> dict[int, torch.Tensor]:
    """``x_l`` for every block of our canonical forward on the backbone."""
    a = adapt(model.backbone)
    h, out = a.embed(x), {}
    for l in range(a.num_blocks):
        h = a.block(h, l, Ops())
        out[l + 1] = h
    return out


def outputs_of(model: nn.Module, x: torch.Tensor, blocks) -> Outputs:
    a = adapt(model.backbone)
    states = our_states(model, x)
    layout = a.layout(x)
    return Outputs(hidden={l: states[l] for l in blocks}, num_prefix=a.num_prefix,
                   grid=layout.grid, num_blocks=a.num_blocks)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def non_constant(m: torch.Tensor) -> bool:
    """Every image's map varies (relative to its own scale)."""
    spread = m.amax(-1) - m.amin(-1)
    return bool((spread > 1e-8 * m.abs().amax(-1)).all() and (spread > 0).all())


# -- the backbone ------------------------------------------------------------------------
@pytest.mark.parametrize("size", SIZES)
def test_dinov2_backbone_is_an_embedding_model_on_its_own_forward(size):
    """Dinov2Backbone has no pooled output: ours is Dinov2Model's ``pooler_output``
    (``layernorm(last hidden state)[:, 0]``), equal to a Dinov2Model holding the same
    weights."""
    import transformers

    bb = depth_model("dpt").backbone
    a = adapt(bb)
    assert isinstance(a, HFBackboneAdapter) and a.embedding and a.num_blocks == 5
    x = images(size)
    twin = transformers.Dinov2Model(bb.config).double().eval()
    twin.load_state_dict(bb.state_dict())
    ref = twin(pixel_values=x).pooler_output
    assert_close_scaled(a.model_outputs(x), ref)
    assert_close_scaled(a.run(a.embed(x)), ref)
    hidden = bb(pixel_values=x, output_hidden_states=True).hidden_states
    assert len(hidden) == 6  # the embedding, then every block: hidden_states[l] = x_l
    for l, h in our_states(depth_model("dpt"), x).items():
        assert_close_scaled(h, hidden[l])


# -- DepthTarget: parity -----------------------------------------------------------------
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", DEPTH_MODELS)
def test_the_necks_inputs_are_the_backbones_feature_maps(name, size):
    """The feature maps DepthTarget builds from our x_l equal the backbone's own
    ``feature_maps`` and what the model's neck receives in its own forward."""
    model = depth_model(name)
    x = images(size)
    t = DepthTarget(model, torch.ones(1, 1))
    assert t.blocks == tuple(model.backbone.out_indices)
    out = outputs_of(model, x, t.blocks)
    ours = t.head.feature_maps([out.hidden[l] for l in t.blocks], out)
    seen = {}
    hook = model.neck.register_forward_pre_hook(lambda m, args: seen.setdefault("in", args))
    try:
        own_depth(model, x)
    finally:
        hook.remove()
    feature_maps = model.backbone(pixel_values=x).feature_maps
    assert len(ours) == len(feature_maps) == 4
    for got, ref, neck_in in zip(ours, feature_maps, seen["in"][0], strict=True):
        assert_close_scaled(got, ref)
        assert_close_scaled(got, neck_in)
    assert seen["in"][1:] == out.grid  # the neck's patch grid


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", DEPTH_MODELS)
def test_the_score_is_the_models_own_depth_summed_over_the_region(name, size):
    model = depth_model(name)
    x = images(size)
    depth = own_depth(model, x).detach()
    assert depth.abs().amax() > 0 and depth.std() > 0
    one, per = region(depth.shape[1:]), region(depth.shape[1:], batch=2)
    ref_one = (depth * one).sum((1, 2))
    ref_per = torch.einsum("nhw,bhw->nb", depth, per)
    a = adapt(model.backbone)
    t_one, t_per = DepthTarget(model, one), DepthTarget(model, per)
    grid = a.layout(x).grid
    with torch.no_grad():
        assert_close_scaled(t_one.depth(outputs_of(model, x, t_one.blocks)), depth, 1e-10)
        for t, ref in ((t_one, ref_one[:, None]), (t_per, ref_per)):
            with a.targeting(t, grid=grid):  # the library's forward under the target
                got = a.run(a.embed(x))
            assert rel(got, ref) <= 1e-10
    assert t_per.num_columns(0) == 2 and t_per.index(4).tolist() == [0, 0, 1, 1]


@pytest.mark.parametrize("name", ["depth_anything", "dpt"])
def test_token_ixg_is_autograd_through_the_models_own_forward(name):
    """A propagating method differentiates the model's neck and head as they are: token
    Input×Gradient at x_0 equals autograd of the selected depth through the model's own
    forward (x_0 hooked as a leaf)."""
    model = depth_model(name)
    x = images((21, 35))
    sel = region(own_depth(model, x).shape[1:])
    got = build_method("token_ixg", model.backbone).attribute(
        x, target=DepthTarget(model, sel), output="tokens")
    seen = {}

    def leaf(module, args, out):
        seen["x0"] = out.detach().requires_grad_()
        return seen["x0"]

    hook = model.backbone.embeddings.register_forward_hook(leaf)
    try:
        score = (own_depth(model, x) * sel).sum()
    finally:
        hook.remove()
    (g,) = torch.autograd.grad(score, seen["x0"])
    ref = (seen["x0"] * g).sum(-1)[:, 1:]
    assert rel(got, ref) <= 1e-10


# -- DepthTarget: every method -----------------------------------------------------------
def options(method, name: str) -> dict:
    """The fast options, and ``score="logit"`` where a method explains a probability by
    default (ScoreCAM, RISE, ViT-CX): the probability of one score is its sigmoid, which
    saturates for a sum of depths over a region (documented in DepthTarget)."""
    score = inspect.signature(method.attribute).parameters.get("score")
    logit = score is not None and score.default == "probability"
    return {**FAST.get(name, {}), **({"score": "logit"} if logit else {})}


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("family", ["depth_anything", "dpt"])
def test_every_method_explains_the_depth_of_a_region(name, family):
    model = depth_model(family)
    x = images()
    sel = region(own_depth(model, x).shape[1:])
    before, backbone_before = snapshot(model), snapshot(model.backbone)
    method = build_method(name, model.backbone)
    t = DepthTarget(model, sel)
    if name in SEVERAL_BLOCKS_REFUSED:
        with pytest.raises(ValueError, match=r"reads block outputs \[1, 2, 3, 4\]"):
            method.attribute(x, target=t, **FAST.get(name, {}))
    elif name in TOKEN_REMOVAL:
        with pytest.raises(ValueError, match="DepthTarget reads token rows"):
            method.attribute(x, target=t, **FAST.get(name, {}))
    else:
        out = method.attribute(x, target=t, output="tokens", **options(method, name))
        assert out.shape == (2, 16) and out.dtype == torch.float64
        assert torch.isfinite(out).all() and non_constant(out)
    assert_unchanged(model, before)
    assert_unchanged(model.backbone, backbone_before)


def test_per_image_regions_are_per_image_columns():
    model = depth_model("depth_anything")
    x = images()
    per = region((28, 28), batch=2)
    both = GAE(model.backbone).attribute(x, target=DepthTarget(model, per), output="tokens")
    ones = torch.cat([GAE(model.backbone).attribute(
        x[i:i + 1], target=DepthTarget(model, per[i]), output="tokens") for i in range(2)])
    assert rel(both, ones) <= 1e-10
    assert rel(both[0], both[1]) > 1e-3


def test_noise_tunnel_expands_per_image_regions():
    model = depth_model("depth_anything")
    x = images()
    t = DepthTarget(model, region((28, 28), batch=2))
    ixg = build_method("token_ixg", model.backbone)
    got = NoiseTunnel(ixg).attribute(x, target=t, nt_samples=3, nt_type="smoothgrad",
                                     stdevs=0.0)
    assert rel(got, ixg.attribute(x, target=t)) <= 1e-10


# -- DepthTarget: refusals ---------------------------------------------------------------
def test_clear_errors_and_the_model_unchanged():
    import transformers

    model = depth_model("depth_anything")
    x = images()
    before = snapshot(model)
    with pytest.raises(TypeError, match=r"GAE\(model\.backbone\)"):
        GAE(model)  # the depth model wraps the backbone, which is explained
    gae = GAE(model.backbone)
    with pytest.raises(ValueError, match=r"select is \(5, 5\).*\(28, 28\)"):
        gae.attribute(x, target=DepthTarget(model, torch.ones(5, 5, dtype=torch.float64)))
    with pytest.raises(ValueError, match=r"\[h, w\].*\[B, h, w\]"):
        DepthTarget(model, torch.ones(28, dtype=torch.float64))
    with pytest.raises(TypeError, match="select must be a tensor"):
        DepthTarget(model, [[1.0]])
    with pytest.raises(TypeError, match="DPTForDepthEstimation"):
        DepthTarget(model.backbone, torch.ones(28, 28))
    t = DepthTarget(model, region((28, 28)))
    with pytest.raises(ValueError, match="removal='mean'"):
        deletion(model.backbone, x, gae, target=t)
    res = deletion(model.backbone, x, gae, target=t, removal="mean", n_steps=4)
    assert torch.isfinite(torch.as_tensor(res.value)).all()
    assert_unchanged(model, before)

    training = copy.deepcopy(model).train()
    with pytest.raises(ValueError, match=r"model\.eval\(\)"):
        GAE(training.backbone.eval()).attribute(x, target=DepthTarget(training, region(
            (28, 28))))
    vit_dpt = transformers.DPTForDepthEstimation(transformers.DPTConfig(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
        image_size=28, patch_size=7, backbone_out_indices=[0, 1, 2, 3],
        neck_hidden_sizes=[8, 16, 16, 32], fusion_hidden_size=16))
    with pytest.raises(TypeError, match=r"its own ViT \(model\.dpt\)"):
        DepthTarget(vit_dpt, torch.ones(28, 28))
    stem = transformers.DepthAnythingForDepthEstimation(transformers.DepthAnythingConfig(
        backbone_config=backbone_config(out_indices=[0, 1, 2, 3]), patch_size=7,
        neck_hidden_sizes=[8, 16, 16, 32], fusion_hidden_size=16, head_hidden_size=8,
        reassemble_hidden_size=32))
    with pytest.raises(ValueError, match="stem"):
        DepthTarget(stem, torch.ones(28, 28))


# -- a segmentation probe on Dinov2Model's patch tokens (HeadTarget) ---------------------
@pytest.fixture(scope="module")
def dinov2_and_probe():
    import transformers

    cfg = backbone_config(num_hidden_layers=3)
    torch.manual_seed(0)
    model = randomize_(transformers.Dinov2Model(cfg), 0).double().eval()
    probe = randomize_(nn.Conv2d(32, 3, 1), 1).double()
    return model, probe


@pytest.mark.parametrize("name", METHODS)
def test_a_linear_segmentation_probe_on_a_region(name, dinov2_and_probe):
    """``HeadTarget(Conv2d 1x1, class-2 mask of a region)``: Σ over the region of the
    probe's class-2 logits on Dinov2Model's final-normed patch tokens."""
    model, probe = dinov2_and_probe
    x = images()
    sel = torch.zeros(3, 4, 4, dtype=torch.float64)
    sel[2, 2:, 1:3] = 1
    t = HeadTarget(probe, sel)
    before, probe_before = snapshot(model), snapshot(probe)
    method = build_method(name, model)
    if name in TOKEN_REMOVAL:
        with pytest.raises(ValueError, match="HeadTarget reads token rows"):
            method.attribute(x, target=t, **FAST.get(name, {}))
    else:
        out = method.attribute(x, target=t, output="tokens", **FAST.get(name, {}))
        assert out.shape == (2, 16) and torch.isfinite(out).all() and non_constant(out)
    assert_unchanged(model, before)
    assert_unchanged(probe, probe_before)


def test_the_segmentation_score_is_the_probe_on_the_models_own_tokens(dinov2_and_probe):
    model, probe = dinov2_and_probe
    x = images()
    sel = torch.zeros(3, 4, 4, dtype=torch.float64)
    sel[2, 2:, 1:3] = 1
    tokens = model(pixel_values=x).last_hidden_state
    grid = tokens[:, 1:].transpose(1, 2).reshape(2, 32, 4, 4)
    ref = (probe(grid) * sel).sum((1, 2, 3))
    a = adapt(model)
    with torch.no_grad(), a.targeting(HeadTarget(probe, sel), grid=(4, 4)):
        got = a.run(a.embed(x))
    assert rel(got[:, 0], ref) <= 1e-10
