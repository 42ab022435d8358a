"""The adapter layer and the Captum front: self-check, sub-networks and token removal,
Captum interop, bad inputs, and the model left untouched by every call."""

from __future__ import annotations

import itertools
from dataclasses import replace

import matplotlib
import pytest
import torch
from captum.attr import NoiseTunnel, visualization
from captum.metrics import infidelity, sensitivity_max
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from captum_vit import GAE, AttnGradCAM, RawAttention, Rollout, adapt
from captum_vit.adapters import ADAPTERS, FusedOps, Ops, TimmViTAdapter
from captum_vit.methods import AttIxG, TokenIxG
from tests.helpers import (
    FAMILIES,
    assert_close_scaled,
    assert_unchanged,
    make_inputs,
    make_model,
    snapshot,
)

pytestmark = pytest.mark.lower_bounds  # also run against the oldest supported versions

matplotlib.use("Agg")

ALL_METHODS = [RawAttention, Rollout, GAE, AttnGradCAM, TokenIxG, AttIxG]


# --- adapter ------------------------------------------------------------------------------

@pytest.mark.parametrize("family", list(FAMILIES))
def test_canonical_forward_equals_model(family):
    model = make_model(family)
    x = make_inputs(family)
    adapter = adapt(model)
    ours = adapter.run(adapter.embed(x))
    assert_close_scaled(ours, model(x))
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
        assert_close_scaled(adapter.run(tr.states[l], start=l), model(x))
    # bit for bit: run and trace are the same plain ops (explicit softmax) on the same shapes
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
    assert_close_scaled(ours, ref)
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
    # bit for bit by construction: linearising changes only the backward (same kernels)
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


def _with_head(model: nn.Module, head: nn.Module) -> nn.Module:
    model.head = head
    return model


@pytest.mark.parametrize("model,match", [
    (nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten()), "cannot explain a Sequential"),
    (nn.Conv2d(3, 4, 3), "supported models"),
    ("vit", "must be a torch.nn.Module"),
    (_with_head(VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1,
                                  num_heads=4, num_classes=0), nn.Sequential(nn.Linear(32, 5))),
     "linear classifier head, or none"),
    (VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=4,
                       num_classes=5, global_pool="max", class_token=False), "global_pool"),
    (nn.Sequential(nn.Identity(), VisionTransformer(img_size=32, patch_size=8, embed_dim=32,
                                                    depth=1, num_heads=4, num_classes=5)),
     r"wraps a supported ViT at `model\[1\]` \(VisionTransformer\): pass that module "
     r"\(e\.g\. GAE\(model\[1\]\)\).*"
     "normalisation"),
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


def _attention_inputs(family):
    """(block parts, LN1 input) of every block (float64) and a key mask [3, N] whose rows
    keep different numbers of tokens."""
    adapter = adapt(make_model(family))
    tr = adapter.trace(make_inputs(family))
    n = tr.blocks[0].u.shape[1]
    valid = torch.arange(n)[None] < torch.tensor([n, n - 5, 3])[:, None]
    return list(zip(adapter.blocks, [rec.u for rec in tr.blocks], strict=True)), valid


@pytest.mark.parametrize("family", ["vit", "layerscale", "avgpool"])
def test_fused_attention_equals_materialised(family):
    blocks, valid = _attention_inputs(family)
    for p, u in blocks:
        for key_mask in (None, valid):
            fused, none = p.attention(u, materialize=False, key_mask=key_mask)
            mix, attn = p.attention(u, materialize=True, key_mask=key_mask)
            assert none is None and attn.shape == (3, 4, u.shape[1], u.shape[1])
            assert_close_scaled(fused, mix)
        positions = torch.arange(u.shape[1]).expand(3, -1)  # accepted, unused for timm ViT
        assert torch.equal(p.attention(u, materialize=True, positions=positions)[0],
                           p.attention(u, materialize=True)[0])


@pytest.mark.parametrize("family", ["vit", "layerscale"])
def test_key_mask_padding_equals_the_shortened_sequence_alone(family):
    blocks, valid = _attention_inputs(family)
    for (p, u), materialize in itertools.product(blocks, (True, False)):
        out, attn = p.attention(u, materialize=materialize, key_mask=valid)
        for i, n in enumerate(valid.sum(1).tolist()):
            alone, _ = p.attention(u[i:i + 1, :n], materialize=materialize)
            assert_close_scaled(out[i:i + 1, :n], alone)
        if materialize:  # padded keys get exactly zero probability
            assert (attn.masked_select(~valid[:, None, None, :]) == 0).all()


@pytest.mark.parametrize("family", ["vit", "avgpool", "distilled"])
def test_fused_ops_on_padded_tokens_equal_the_shortened_sequence(family):
    adapter = adapt(make_model(family))
    x0 = adapter.embed(make_inputs(family, batch=2))
    k = adapter.num_prefix
    valid = torch.ones(2, x0.shape[1], dtype=torch.bool)
    valid[1, k + 6:] = False  # image 1 keeps patches 0..5 only
    padded = adapter.run(x0, ops=FusedOps(key_mask=valid))
    alone = adapter.run(x0[1:], keep=torch.arange(6)[None], ops=Ops())
    assert_close_scaled(padded[1:], alone)
    assert_close_scaled(padded[:1], adapter.run(x0[:1]))


def test_qkv_parts_are_views_of_the_fused_timm_parameter():
    model = make_model("vit")
    adapter = adapt(model)
    p, qkv = adapter.blocks[1], model.blocks[1].attn.qkv
    a = p.inner_dim
    for i, (w, b) in enumerate([(p.q_weight, p.q_bias), (p.k_weight, p.k_bias),
                                (p.v_weight, p.v_bias)]):
        assert w.untyped_storage().data_ptr() == qkv.weight.untyped_storage().data_ptr()
        assert torch.equal(w, qkv.weight[i * a:(i + 1) * a])
        assert torch.equal(b, qkv.bias[i * a:(i + 1) * a])
    with torch.no_grad():
        qkv.bias[a] += 1.0  # an in-place change of the model shows through the views
    assert p.k_bias[0] == qkv.bias[a]
    model.float()  # replaced parameters: the adapter re-reads its parts
    x = make_inputs("vit", dtype=torch.float32)
    assert_close_scaled(adapter.run(adapter.embed(x)), model(x), rel=1e-5)
    assert adapter.blocks[1].q_weight.dtype == torch.float32



def test_separate_qkv_projections_equal_the_fused_views():
    """Models with separate q/k/v (Hugging Face) take the per-projection path."""
    blocks, valid = _attention_inputs("layerscale")
    p, u = blocks[2]
    names = ("q_weight", "k_weight", "v_weight", "q_bias", "k_bias", "v_bias")
    separate = replace(p, **{n: getattr(p, n).clone() for n in names})
    no_bias = replace(p, q_bias=None, k_bias=None, v_bias=None)
    for materialize in (True, False):
        a = p.attention(u, materialize=materialize, key_mask=valid)
        b = separate.attention(u, materialize=materialize, key_mask=valid)
        assert_close_scaled(a, b)
        c = no_bias.attention(u, materialize=materialize)[0]
        d = replace(separate, q_bias=None, k_bias=None, v_bias=None).attention(
            u, materialize=materialize)[0]
        assert_close_scaled(c, d)


EMBEDDING = ("patch_embed.", "cls_token", "reg_token", "dist_token", "pos_embed", "norm_pre.")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_parameter_stages_cover_every_parameter_once_except_the_embedding(family):
    model = make_model(family)
    stages = adapt(model).parameter_stages()
    assert len(stages) == 1 + len(model.blocks)
    flat = [p for stage in stages for p in stage]
    assert all(isinstance(p, nn.Parameter) for p in flat)
    assert len({id(p) for p in flat}) == len(flat)  # each exactly once
    named = dict(model.named_parameters())
    embedding = {n for n in named if n.startswith(EMBEDDING)}
    assert {"patch_embed.proj.weight", "pos_embed"} <= embedding
    assert {id(named[n]) for n in named if n not in embedding} == {id(p) for p in flat}
    head_names = {n for n, p in named.items() if any(p is q for q in stages[0])}
    assert head_names and all(n.startswith(("norm.", "fc_norm.", "head.", "head_dist."))
                              for n in head_names)
    for stage, blk in zip(stages[1:], reversed(model.blocks), strict=True):  # top block first
        assert [id(p) for p in stage] == [id(p) for p in blk.parameters()]


@pytest.mark.parametrize("family,classes,shape", [
    ("vit", 5, (3, (32, 32))), ("distilled", 5, (3, (32, 32))),
    ("nonsquare", 5, (3, (24, 40))),
])
def test_num_classes_input_shape_and_dtype(family, classes, shape):
    adapter = adapt(make_model(family))
    assert adapter.num_classes == classes and adapter.input_shape == shape
    assert adapter.dtype == torch.float64
    assert adapt(make_model(family, dtype=torch.float32, num_classes=7)).num_classes == 7
    assert adapt(make_model(family, dtype=torch.float32)).dtype == torch.float32


def test_inputs_of_another_dtype_than_the_model_raise_a_type_error():
    model = make_model("vit")  # float64
    x = make_inputs("vit", dtype=torch.float32)
    msg = (r"inputs are torch\.float32 but the model's parameters are torch\.float64.*"
           r"inputs\.to\(torch\.float64\).*model\.to\(torch\.float32\)")
    with pytest.raises(TypeError, match=msg):
        adapt(model).check_inputs(x)
    with pytest.raises(TypeError, match=msg):
        GAE(model).attribute(x)


def test_adapt_picks_the_adapter_from_the_table():
    assert any(cls is TimmViTAdapter for _, cls in ADAPTERS)
    adapter = adapt(make_model("registers"))
    assert isinstance(adapter, TimmViTAdapter) and adapt(adapter) is adapter


# --- model never changed --------------------------------------------------------------------

# --- Captum interop ---------------------------------------------------------------------------

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
