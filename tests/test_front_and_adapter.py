"""The adapter layer and the Captum front: self-check, sub-networks and token removal,
Captum interop, bad inputs, and the model left untouched by every call."""

from __future__ import annotations

import matplotlib
import pytest
import torch
from captum.attr import NoiseTunnel, visualization
from captum.metrics import infidelity, sensitivity_max
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from captum_vit import GAE, AttnGradCAM, RawAttention, Rollout, adapt
from captum_vit.methods import AttIxG, TokenIxG
from tests.helpers import FAMILIES, assert_unchanged, make_inputs, make_model, snapshot

matplotlib.use("Agg")

ALL_METHODS = [RawAttention, Rollout, GAE, AttnGradCAM, TokenIxG, AttIxG]


# --- adapter ------------------------------------------------------------------------------

@pytest.mark.parametrize("family", list(FAMILIES))
def test_canonical_forward_equals_model(family):
    model = make_model(family)
    x = make_inputs(family)
    adapter = adapt(model)
    ours = adapter.run(adapter.embed(x))
    torch.testing.assert_close(ours, model(x), rtol=0, atol=1e-12)
    tr = adapter.trace(x)
    assert len(tr.blocks) == 3 and tr.blocks[0].attn.shape[-1] == adapter.layout(x).num_tokens
    rowsum = tr.blocks[0].attn.sum(-1)
    torch.testing.assert_close(rowsum, torch.ones_like(rowsum))


def test_layout_of_every_family():
    expect = {"vit": (1, "token"), "distilled": (2, "distilled"), "registers": (3, "token"),
              "avgpool": (0, "avg"), "layerscale": (1, "token"), "nonsquare": (1, "token")}
    for family, (k, readout) in expect.items():
        lay = adapt(make_model(family)).layout(make_inputs(family))
        assert (lay.num_prefix, lay.readout) == (k, readout)
    assert adapt(make_model("nonsquare")).layout(make_inputs("nonsquare")).grid == (3, 5)


def test_run_from_a_middle_block_equals_full_forward():
    model = make_model("vit")
    x = make_inputs("vit")
    adapter = adapt(model)
    tr = adapter.trace(x)
    for l in range(adapter.num_blocks + 1):
        torch.testing.assert_close(adapter.run(tr.states[l], start=l), model(x), rtol=0, atol=1e-12)
    torch.testing.assert_close(adapter.run(tr.states[0], 0, 2), tr.states[2], rtol=0, atol=0)


@pytest.mark.parametrize("family", ["vit", "registers", "avgpool"])
def test_keep_is_true_token_removal(family):
    model = make_model(family)
    x = make_inputs(family, batch=2)
    adapter = adapt(model)
    keep = torch.tensor([[0, 5, 9], [15, 2, 7]])
    ours = adapter.run(adapter.embed(x), keep=keep)
    # by hand with timm's own modules: embed, drop tokens, run the blocks and the head
    k = model.num_prefix_tokens
    tokens = model._pos_embed(model.patch_embed(x))
    rows = [torch.cat([tokens[b, :k], tokens[b, k + keep[b]]]) for b in range(2)]
    ref = model.forward_head(model.norm(model.blocks(torch.stack(rows))))
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    mask = torch.zeros(2, 16, dtype=torch.bool)
    mask[0, [0, 5, 9]] = True
    mask[1, [2, 7, 15]] = True
    sorted_keep = keep.sort(1).values
    torch.testing.assert_close(adapter.run(adapter.embed(x), keep=mask),
                               adapter.run(adapter.embed(x), keep=sorted_keep))


def test_linearised_forward_is_bit_identical():
    model = make_model("layerscale")
    x = make_inputs("layerscale")
    adapter = adapt(model)
    a = adapter.trace(x, grad=True)
    b = adapter.trace(x, grad=True, linearize=True)
    assert torch.equal(a.logits, b.logits)
    for ra, rb in zip(a.blocks, b.blocks, strict=True):
        assert torch.equal(ra.out, rb.out) and torch.equal(ra.attn, rb.attn)


def test_self_check_refuses_a_model_the_adapter_does_not_reproduce():
    class Tampered(VisionTransformer):
        def forward(self, x):
            return super().forward(x) + 1.0

    model = Tampered(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4,
                     num_classes=5).double().eval()
    with pytest.raises(TypeError, match="does not reproduce"):
        GAE(model).attribute(make_inputs("vit"))


@pytest.mark.parametrize("model,match", [
    (nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten()), "cannot explain a Sequential"),
    (nn.Conv2d(3, 4, 3), "supported models"),
    ("vit", "must be a torch.nn.Module"),
    (VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=4,
                       num_classes=0), "linear classifier head"),
    (VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=4,
                       num_classes=5, global_pool="max", class_token=False), "global_pool"),
    (VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=4,
                       num_classes=5, global_pool="map"), "map"),
])
def test_unsupported_models_get_a_type_error(model, match):
    with pytest.raises(TypeError, match=match):
        GAE(model)


def test_training_mode_with_dropout_is_refused_and_left_alone():
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=4,
                              num_classes=5, drop_rate=0.1).double().train()
    snap = snapshot(model)
    with pytest.raises(ValueError, match="model.eval()"):
        GAE(model).attribute(make_inputs("vit"))
    assert_unchanged(model, snap)
    assert model.training


# --- model never changed --------------------------------------------------------------------

@pytest.mark.parametrize("cls", ALL_METHODS)
def test_model_unchanged_after_call_and_after_error(cls):
    model = make_model("vit", dtype=torch.float32)  # fused attention flag stays True
    model.blocks[0].register_forward_hook(lambda *a: None)
    model.head.weight.grad = torch.ones_like(model.head.weight)
    model.blocks[1].mlp.fc1.weight.requires_grad_(False)
    snap = snapshot(model)
    method = cls(model)
    method.attribute(make_inputs("vit", dtype=torch.float32), target=[0, 1, 2])
    assert_unchanged(model, snap)
    with pytest.raises(ValueError):
        method.attribute(make_inputs("vit", dtype=torch.float32), target=[0, 1, 99])
    with pytest.raises(ValueError):
        method.attribute(torch.full((1, 3, 32, 32), float("nan")))
    assert_unchanged(model, snap)
    assert all(blk.attn.fused_attn for blk in model.blocks)


# --- Captum interop ---------------------------------------------------------------------------

@pytest.mark.parametrize("cls", ALL_METHODS)
def test_noise_tunnel_smoothgrad(cls):
    model = make_model("vit")
    x = make_inputs("vit", batch=2)
    out = NoiseTunnel(cls(model)).attribute(x, nt_type="smoothgrad", nt_samples=3, stdevs=0.1,
                                            target=[1, 2])
    assert out.shape == x.shape and torch.isfinite(out).all()


def test_noise_tunnel_averages_the_method_over_noisy_copies():
    model = make_model("vit")
    x = make_inputs("vit", batch=1)
    torch.manual_seed(7)
    out = NoiseTunnel(GAE(model)).attribute(x, nt_type="smoothgrad", nt_samples=3, stdevs=0.1,
                                            target=1, output="tokens")
    torch.manual_seed(7)
    noisy = x.repeat(3, 1, 1, 1) + torch.normal(0, torch.tensor(0.1).repeat(3, *x.shape[1:]))
    ref = GAE(model).attribute(noisy, target=1, output="tokens").mean(0, keepdim=True)
    torch.testing.assert_close(out, ref)


def test_visualization_takes_the_output():
    model = make_model("vit")
    x = make_inputs("vit", batch=1)
    attr = GAE(model).attribute(x, target=1)
    fig, _ = visualization.visualize_image_attr(
        attr[0].permute(1, 2, 0).numpy(), x[0].permute(1, 2, 0).numpy(),
        method="blended_heat_map", sign="all", use_pyplot=False)
    assert fig is not None


@pytest.mark.parametrize("cls", [GAE, Rollout, AttnGradCAM])
def test_captum_metrics_run(cls):
    model = make_model("vit")
    x = make_inputs("vit", batch=2)
    method = cls(model)
    sens = sensitivity_max(method.attribute, x, target=[1, 2], n_perturb_samples=2,
                           perturb_radius=0.02)
    assert sens.shape == (2,) and torch.isfinite(sens).all()

    def perturb(inputs):
        noise = torch.randn_like(inputs) * 0.01
        return noise, inputs - noise

    attr = method.attribute(x, target=[1, 2])
    infid = infidelity(model, perturb, x, attr, target=torch.tensor([1, 2]), n_perturb_samples=2)
    assert infid.shape == (2,) and torch.isfinite(infid).all()


# --- bad inputs ---------------------------------------------------------------------------------

def _vit():
    return make_model("vit")


BAD = [
    ("3-D input", lambda m: GAE(m).attribute(torch.randn(3, 32, 32)), ValueError,
     "unsqueeze"),
    ("wrong channels", lambda m: GAE(m).attribute(torch.randn(1, 1, 32, 32).double()),
     ValueError, "channels"),
    ("fixed size mismatch", lambda m: GAE(m).attribute(torch.randn(1, 3, 36, 36).double()),
     ValueError, "img_size"),
    ("target out of range", lambda m: GAE(m).attribute(make_inputs(), target=5), ValueError,
     r"\[0, 5\)"),
    ("negative target", lambda m: GAE(m).attribute(make_inputs(), target=-1), ValueError,
     "target"),
    ("target length", lambda m: GAE(m).attribute(make_inputs(), target=[0, 1]), ValueError,
     "3 images"),
    ("float target", lambda m: GAE(m).attribute(make_inputs(), target=torch.tensor([0.5] * 3)),
     TypeError, "integer dtype"),
    ("str target", lambda m: GAE(m).attribute(make_inputs(), target="cat"), TypeError,
     "target"),
    ("tuple target entries", lambda m: GAE(m).attribute(make_inputs(), target=[(0,), (1,), (2,)]),
     TypeError, "tuples"),
    ("unknown output", lambda m: GAE(m).attribute(make_inputs(), output="heatmap"), ValueError,
     "output must be one of"),
    ("unknown score", lambda m: GAE(m).attribute(make_inputs(), score="prob"), ValueError,
     "score must be one of"),
    ("start_layer too big", lambda m: Rollout(m, start_layer=3), ValueError, "start_layer"),
    ("start_layer negative", lambda m: Rollout(m).attribute(make_inputs(), start_layer=-1),
     ValueError, "start_layer"),
    ("start_layer float", lambda m: Rollout(m, start_layer=1.0), TypeError, "start_layer"),
    ("layer out of range", lambda m: TokenIxG(m, layer=4), ValueError, "layer"),
    ("NaN input", lambda m: GAE(m).attribute(torch.full((1, 3, 32, 32), float("nan"))),
     ValueError, "NaN"),
    ("integer input", lambda m: GAE(m).attribute(torch.zeros(1, 3, 32, 32, dtype=torch.long)),
     TypeError, "floating-point"),
    ("not a tensor", lambda m: GAE(m).attribute([[1.0]]), TypeError, "torch.Tensor"),
    ("empty batch", lambda m: GAE(m).attribute(torch.zeros(0, 3, 32, 32).double()),
     ValueError, "empty"),
]


@pytest.mark.parametrize("name,call,exc,match", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_give_clear_errors(name, call, exc, match):
    with pytest.raises(exc, match=match):
        call(_vit())


def test_size_not_divisible_by_patch_on_dynamic_model():
    model = make_model("nonsquare")
    with pytest.raises(ValueError, match="not divisible by the patch size"):
        GAE(model).attribute(torch.randn(1, 3, 20, 40).double())
