"""PLUS / SkipPLUS / FullGrad+ (SPEC §4)."""

from __future__ import annotations

import copy

import pytest
import torch
from captum.attr import InputXGradient, IntegratedGradients, NoiseTunnel, Saliency

from captum_vit.adapters import adapt
from captum_vit.combinators import PLUS, FullGradPlus, SkipPLUS, check_layers, skip_start
from captum_vit.methods.decompx import DecompX
from captum_vit.methods.ixg import AttIxG, TokenIxG
from tests.helpers import (
    ReferenceCapture,
    assert_close_scaled,
    assert_close_to_reference,
    assert_unchanged,
    make_inputs,
    make_model,
    snapshot,
)

TARGETS = torch.tensor([1, 4, 0])


def _block_inputs(model, x):
    """x_0 .. x_{L-1} through timm's own forward (independent of the adapter)."""
    refs = ReferenceCapture(model)
    refs(x)
    return [b.detach() for b in refs.block_inputs], refs


def _by_hand(model, x, layers, make, **kwargs):
    """sum_l Captum(f_l)(x_l) summed over channels, calling Captum directly."""
    ad = adapt(model)
    xs, _ = _block_inputs(model, x)
    total = 0
    for l in layers:
        method = make(lambda t, l=l: ad.run(t, start=l))
        total = total + method.attribute(xs[l].clone().requires_grad_(), target=TARGETS,
                                         **kwargs).sum(-1)
    return total[:, ad.num_prefix:]


# -- parity with the fixture -----------------------------------------------------------
@pytest.mark.parametrize("base", ["ixg", TokenIxG])
def test_plus_of_ixg_matches_fixture_sums(parity, base):
    model, x, t, _, maps, _ = parity
    ref = maps["ixg_per_layer"]
    assert_close_to_reference(PLUS(model, base).attribute(x, t, output="tokens"),
                              ref.sum(0), 1e-12)
    assert_close_to_reference(SkipPLUS(model, base).attribute(x, t, output="tokens"),
                              ref[3:].sum(0), 1e-12)


@pytest.mark.parametrize("base", ["decompx", DecompX])
def test_plus_of_decompx_matches_fixture_sums(parity, base):
    model, x, t, _, maps, _ = parity
    ref = maps["decompx_from_layer"]
    assert SkipPLUS(model, base).layers == (3, 4, 5)
    torch.testing.assert_close(PLUS(model, base).attribute(x, t, output="tokens"),
                               ref.sum(0), rtol=0, atol=6e-9)
    torch.testing.assert_close(SkipPLUS(model, base).attribute(x, t, output="tokens"),
                               ref[3:].sum(0), rtol=0, atol=3e-9)


def test_plus_of_att_ixg_is_attcat(parity):
    model, x, t, _, maps, _ = parity
    assert_close_to_reference(PLUS(model, AttIxG).attribute(x, t, output="tokens"),
                              maps["attcat"], 1e-12)


# -- fast path == generic path -----------------------------------------------------------
@pytest.mark.parametrize("family", ["vit", "distilled", "avgpool", "layerscale"])
def test_fast_paths_equal_generic_captum_paths(family):
    model, x = make_model(family), make_inputs(family)
    for cls in (PLUS, SkipPLUS):
        fast = cls(model, "ixg").attribute(x, TARGETS, output="tokens")
        slow = cls(model, InputXGradient).attribute(x, TARGETS, output="tokens")
        torch.testing.assert_close(fast, slow, rtol=0, atol=1e-10)
        fast = cls(model, "gradient").attribute(x, TARGETS, output="tokens")
        slow = cls(model, Saliency).attribute(x, TARGETS, output="tokens", abs=False)
        torch.testing.assert_close(fast, slow, rtol=0, atol=1e-10)
    # probability score: f_l gets a softmax on both paths
    fast = PLUS(model, "ixg").attribute(x, TARGETS, score="probability", output="tokens")
    slow = PLUS(model, InputXGradient).attribute(x, TARGETS, score="probability",
                                                  output="tokens")
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-10)


def test_att_ixg_and_decompx_fast_paths_equal_per_layer_generic():
    model, x = make_model("registers"), make_inputs("registers")
    xs, refs = _block_inputs(model, x)
    ad = adapt(model)
    att, dx = 0, 0
    for l in range(3):
        ixg = InputXGradient(lambda t, l=l: ad.run(t, start=l)).attribute(
            xs[l].clone().requires_grad_(), target=TARGETS).sum(-1)
        att = att + refs.attn[l].detach().mean(dim=(1, 2)) * ixg
        dx = dx + DecompX(model, start_layer=l, route="explicit").decompose(x, TARGETS).tokens
    k = ad.num_prefix
    torch.testing.assert_close(PLUS(model, "att_ixg").attribute(x, TARGETS, output="tokens"),
                               att[:, k:], rtol=0, atol=1e-10)
    torch.testing.assert_close(PLUS(model, "decompx").attribute(x, TARGETS, output="tokens"),
                               dx[:, k:], rtol=0, atol=1e-10)


# -- any Captum base ------------------------------------------------------------------------
def test_integrated_gradients_base_equals_hand_sum():
    model, x = make_model("vit"), make_inputs("vit")
    got = PLUS(model, IntegratedGradients).attribute(x, TARGETS, output="tokens", n_steps=5)
    ref = _by_hand(model, x, range(3), IntegratedGradients, n_steps=5)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)
    got = SkipPLUS(model, IntegratedGradients).attribute(x, TARGETS, output="tokens",
                                                         n_steps=5)
    ref = _by_hand(model, x, [2], IntegratedGradients, n_steps=5)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)


def test_noise_tunnel_base_equals_hand_sum():
    model, x = make_model("layerscale"), make_inputs("layerscale")

    def factory(f):
        return NoiseTunnel(Saliency(f))

    kw = dict(nt_type="smoothgrad", nt_samples=2, stdevs=0.1)
    plus = SkipPLUS(model, factory, layers=[0, 2])
    torch.manual_seed(7)
    got = plus.attribute(x, TARGETS, output="tokens", **kw)
    torch.manual_seed(7)
    ref = _by_hand(model, x, [0, 2], factory, **kw)
    assert_close_scaled(got, ref)


# -- layers, batch, model state, interop ----------------------------------------------
def test_layer_ranges():
    assert [skip_start(L) for L in (1, 2, 3, 6, 7, 12)] == [1, 1, 2, 3, 4, 6]
    model, x = make_model("vit"), make_inputs("vit")
    assert PLUS(model, "ixg").layers == (0, 1, 2)
    assert SkipPLUS(model, "ixg").layers == (2,)  # ceil(3/2); the authors' L//2 gives 1
    one = SkipPLUS(model, "ixg").attribute(x, TARGETS, output="tokens")
    direct = TokenIxG(model, layer=2).attribute(x, TARGETS, output="tokens")
    assert_close_scaled(one, direct)
    two = PLUS(model, "ixg", layers=[2, 1]).attribute(x, TARGETS, output="tokens")
    ref = direct + TokenIxG(model, layer=1).attribute(x, TARGETS, output="tokens")
    assert_close_scaled(two, ref)


def test_model_unchanged_also_on_error():
    model, x = make_model("distilled"), make_inputs("distilled")
    snap = snapshot(model)
    PLUS(model, "att_ixg").attribute(x, TARGETS)
    SkipPLUS(model, IntegratedGradients).attribute(x, TARGETS, n_steps=2)
    FullGradPlus(model, skip=True, head_biases=True).attribute(x, TARGETS)
    with pytest.raises(TypeError):
        PLUS(model, Saliency).attribute(x, TARGETS, no_such_argument=1)
    with pytest.raises(ValueError):
        FullGradPlus(model).attribute(x, target=[0, 99, 0])
    assert_unchanged(model, snap)


@pytest.mark.filterwarnings("ignore:PLUS/SkipPLUS run the perturbation method")
@pytest.mark.parametrize("base", ["tis", "rise", "vit_cx"])
def test_a_token_reading_target_refuses_token_removal_inside_a_sub_network(base):
    """Over a perturbation base, PLUS removes tokens of each block's input (RISE and
    ViT-CX too, which mask pixels on their own): a target reading token rows is refused,
    naming the sub-network and the method alone as the fix; the method alone runs."""
    from captum_vit.registry import build_method
    from captum_vit.targets import TokenTarget

    model, x = make_model("vit"), make_inputs("vit", batch=2)
    target = TokenTarget(lambda z: z[:, 1:].pow(2).mean((1, 2)))
    with pytest.raises(ValueError, match=r"TokenTarget reads token rows, and a perturbation "
                                         r"method on a sub-network \(PLUS, SkipPLUS\) "
                                         r"removes tokens of its block input x_2"):
        SkipPLUS(model, base).attribute(x, target, n_masks=8) if base != "vit_cx" else \
            SkipPLUS(model, base).attribute(x, target)
    if base != "tis":
        kw = {"n_masks": 8} if base == "rise" else {}
        maps = build_method(base, model).attribute(x, target=target, output="tokens", **kw)
        assert torch.isfinite(maps).all()


def test_bad_arguments():
    model, x = make_model("vit"), make_inputs("vit")
    with pytest.raises(ValueError, match="unknown base"):
        PLUS(model, "lrp")
    with pytest.raises(TypeError, match="Attribution"):
        PLUS(model, torch.nn.Linear)
    with pytest.raises(TypeError, match="base"):
        PLUS(model, 42)
    with pytest.raises(TypeError, match="instance"):
        PLUS(model, Saliency(model))
    with pytest.raises(TypeError, match="factory returned"):
        PLUS(model, lambda f: 3)
    with pytest.raises(TypeError, match="nested"):  # GAE composes (test_plus_compositions.py)
        SkipPLUS(model, PLUS)
    with pytest.raises(ValueError, match="empty"):
        PLUS(model, "ixg", layers=[])
    with pytest.raises(ValueError, match="layers"):
        PLUS(model, "ixg", layers=[0, 3])
    with pytest.raises(ValueError, match="layers"):
        FullGradPlus(model, layers=[-1])
    with pytest.raises(ValueError, match="repeated"):
        check_layers([1, 1], 3)
    with pytest.raises(TypeError, match="layers"):
        PLUS(model, "ixg", layers=2)
    with pytest.raises(TypeError, match="keyword"):
        PLUS(model, "ixg").attribute(x, TARGETS, n_steps=3)
    with pytest.raises(ValueError, match="logit"):
        PLUS(model, "decompx").attribute(x, TARGETS, score="probability")
    with pytest.raises(ValueError, match="score"):
        FullGradPlus(model).attribute(x, TARGETS, score="prob")


# -- FullGrad+ -----------------------------------------------------------------------------
def _fullgrad_by_hand(model, x, layers, head_biases=False):
    """IxG at the included block inputs + bias * grad at every biased op output, through
    timm's own modules with forward hooks."""
    m = copy.deepcopy(model)
    outs, ins = [], []

    def grab(mod, args, out):
        out.retain_grad()
        outs.append((mod.bias, out))

    def grab_input(mod, args):
        args[0].retain_grad()
        ins.append(args[0])

    for l, blk in enumerate(m.blocks):
        blk.register_forward_pre_hook(grab_input)
        if l in layers:
            for mod in (blk.norm1, blk.attn.qkv, blk.attn.proj, blk.norm2, blk.mlp.fc1,
                        blk.mlp.fc2):
                mod.register_forward_hook(grab)
    if head_biases and isinstance(m.norm, torch.nn.LayerNorm):  # avgpool: fc_norm, no tokens
        m.norm.register_forward_hook(grab)
    logits = m(x)
    logits.gather(1, TARGETS[:, None]).sum().backward()
    total = sum((ins[l] * ins[l].grad).sum(-1) for l in layers)
    for bias, out in outs:
        total = total + (out.grad * bias).sum(-1)
    return total.detach()[:, m.num_prefix_tokens:]


@pytest.mark.parametrize("family", ["vit", "distilled", "avgpool", "layerscale"])
def test_fullgrad_plus_matches_hooks_on_timm(family):
    model, x = make_model(family), make_inputs(family)
    for skip, layers in ((False, range(3)), (True, [2])):
        got = FullGradPlus(model, skip=skip).attribute(x, TARGETS, output="tokens")
        ref = _fullgrad_by_hand(model, x, list(layers))
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)
    got = FullGradPlus(model, layers=[0, 1], head_biases=True).attribute(
        x, TARGETS, output="tokens")
    torch.testing.assert_close(got, _fullgrad_by_hand(model, x, [0, 1], True),
                               rtol=0, atol=1e-10)
    ixg_part = PLUS(model, "ixg").attribute(x, TARGETS, output="tokens")
    full = FullGradPlus(model).attribute(x, TARGETS, output="tokens")
    assert (full - ixg_part).abs().max() > 1e-6  # the bias maps contribute
