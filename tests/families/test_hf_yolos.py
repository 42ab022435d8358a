"""YOLOS (Hugging Face ``YolosForObjectDetection``) and ``DetectionTarget``
(SPEC_REACH §10.5): the canonical forward is the model's, every method explains a
detection, the chosen detection row is read out as a class token, true token removal
keeps the detection rows, and what cannot be explained is refused by name."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from captum.attr import NoiseTunnel

from captum_vit import GAE, DecompX
from captum_vit.adapters import HFYolosAdapter, Ops, adapt
from captum_vit.metrics.faithfulness import deletion
from captum_vit.registry import available_methods, build_method
from captum_vit.targets import DetectionTarget
from tests.helpers import (
    assert_close_scaled,
    assert_unchanged,
    make_hf_model,
    needs_transformers,
    randomize_,
    snapshot,
)

pytestmark = needs_transformers
FAST = {"tis": {"n_masks": 16}, "rise": {"n_masks": 16},
        "bt_h": {"n_steps": 3, "start_layer": 1}, "bt_t": {"n_steps": 3, "start_layer": 1},
        "tam": {"n_steps": 3, "start_layer": 0}}  # as tests/contract/test_contract.py
METHODS = available_methods(compositions=True)


def make_yolos(*, queries: int = 3, size: tuple[int, int] = (32, 48), labels: int = 4,
               mid: bool = False, seed: int = 0) -> torch.nn.Module:
    """A tiny random YOLOS detector (float64, eval): 3 layers, width 32, patch 8."""
    import transformers

    cfg = transformers.YolosConfig(
        image_size=list(size), patch_size=8, num_channels=3, hidden_size=32,
        num_hidden_layers=3, num_attention_heads=4, intermediate_size=64, num_labels=labels,
        num_detection_tokens=queries, use_mid_position_embeddings=mid, layer_norm_eps=1e-6)
    torch.manual_seed(seed)
    model = randomize_(transformers.YolosForObjectDetection(cfg), seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # prefix tokens and positions far from zero, a non-trivial final LN
        emb = model.vit.embeddings
        for t in (emb.cls_token, emb.detection_tokens, emb.position_embeddings):
            t.copy_(0.5 * torch.randn(t.shape, generator=g))
        ln = model.vit.layernorm
        ln.weight.copy_(1 + 0.1 * torch.randn(ln.weight.shape, generator=g))
        if mid:  # mid position embeddings as large as the first ones
            t = model.vit.encoder.interpolation.mid_position_embeddings
            t.copy_(0.5 * torch.randn(t.shape, generator=g))
    return model.double().eval()


def images(size: tuple[int, int] = (32, 48), batch: int = 2, seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, *size, generator=g, dtype=torch.float64)


def attribute(name: str, model, x, target, **kw):
    method = build_method(name, model)
    return method.attribute(x, target=target, **{**FAST.get(name, {}), **kw})


# -- the canonical forward ------------------------------------------------------------------
@pytest.mark.parametrize("mid", [False, True], ids=["plain", "mid"])
@pytest.mark.parametrize("size", [(32, 48), (40, 24)])
def test_forward_parity_with_the_models_logits_and_boxes(size, mid):
    """Detection logits and boxes of the canonical forward (rows reordered as [CLS, det,
    patches]) equal the model's own ``logits`` and ``pred_boxes``, at the configured size
    and at another one (the model resamples its position embeddings, and with
    ``mid`` its mid position embeddings, added after every block but the last)."""
    model = make_yolos(mid=mid)
    ad = adapt(model)
    assert isinstance(ad, HFYolosAdapter) and ad.num_prefix == 4
    x = images(size)
    with torch.no_grad():
        ref = model(pixel_values=x)
        ours = ad.detections(x)
    assert_close_scaled(ours["detection_logits"], ref.logits)
    assert_close_scaled(ours["boxes"], ref.pred_boxes)
    with torch.no_grad():  # the states: the model's last_hidden_state, rows permuted
        x0 = ad.embed(x)
        emb = model.vit.embeddings(x)
    k = model.config.num_detection_tokens
    assert torch.equal(x0, torch.cat([emb[:, :1], emb[:, -k:], emb[:, 1:-k]], 1))
    ad.self_check(x)  # the front's check passes at both sizes


def test_detection_target_scores_are_the_models_outputs():
    """Under a resolved DetectionTarget the adapter's output is the model's own logit of
    each image's query and label, or minus the L1 error of its box; ``"best"`` is the
    query with the highest probability of the label on the model's own output."""
    model = make_yolos()
    ad = adapt(model)
    x = images()
    with torch.no_grad():
        ref = model(pixel_values=x)
    prob = ref.logits.softmax(-1)
    labels = torch.tensor([1, 3])
    best = prob[torch.arange(2), :, labels].argmax(-1)
    cases = [
        (DetectionTarget("best", label=labels), ref.logits[torch.arange(2), best, labels]),
        (DetectionTarget([2, 0], label=2), ref.logits[torch.arange(2), torch.tensor([2, 0]), 2]),
    ]
    top = prob[:, 1, :-1].argmax(-1)  # query 1's most probable object class
    cases.append((DetectionTarget(1), ref.logits[torch.arange(2), 1, top]))
    box = torch.tensor([[0.5, 0.4, 0.2, 0.3], [0.1, 0.9, 0.5, 0.5]], dtype=torch.float64)
    cases.append((DetectionTarget(2, label=0, score="probability"), prob[:, 2, 0]))
    cases.append((DetectionTarget(2, label=[0, 4], score="log_probability"),
                  ref.logits.log_softmax(-1)[torch.arange(2), 2, torch.tensor([0, 4])]))
    cases.append((DetectionTarget(0, box=box),
                  -(ref.pred_boxes[:, 0] - box).abs().sum(-1)))
    for target, expected in cases:
        resolved = target.resolve(ad, x)
        with torch.no_grad(), ad.targeting(resolved):
            cols = ad.run(ad.embed(x))
        got = cols.gather(1, resolved.index(2)[:, None])[:, 0]
        assert_close_scaled(got, expected)
    assert DetectionTarget("best", label=labels).resolve(ad, x).rows == tuple(
        sorted({1 + int(q) for q in best}))


# -- every method ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", METHODS)
def test_every_method_explains_a_detection(name):
    """Every registered method returns a finite, non-constant map of every image with a
    DetectionTarget (query "best", a label per image), and leaves the model unchanged."""
    model = make_yolos()
    x = images()
    before = snapshot(model)
    maps = attribute(name, model, x, DetectionTarget("best", label=[1, 3]))
    assert_unchanged(model, before)
    assert maps.shape == x.shape
    assert torch.isfinite(maps).all()
    if name != "random":
        assert (maps.flatten(1).std(1) > 0).all()
    grid = attribute(name, model, x, DetectionTarget(0, label=2), output="grid")
    assert grid.shape == (2, 1, 4, 6)


def deit_twin(yolos: torch.nn.Module) -> torch.nn.Module:
    r"""A classifier with ``yolos``'s weights whose class token is its detection token.

    ``yolos`` has one detection token, and its class MLP's ReLUs are active on the whole
    range of the final LayerNorm (biases above the bound ``‖W_row‖ · ‖z‖_max``), so the
    MLP is the affine map ``W_3 W_2 W_1 z + b``. The twin is a Hugging Face DeiT with
    teacher (rows ``[CLS, DIST, patches]``): its CLS is YOLOS's detection token, its DIST
    YOLOS's CLS (each with its own position embedding), the same layers and final norm;
    its class head is ``2 (W_3 W_2 W_1)`` on CLS and its distillation head is zero, so its
    logits (the mean of the two heads) are YOLOS's detection logits. A DeiT classifier is
    read out at its class token (``w = e_0``), so equal maps mean that the chosen
    detection row is read out as a class token by every method.
    """
    import transformers

    y = yolos
    with torch.no_grad():
        ln = y.vit.layernorm
        (w1, b1), (w2, b2), (w3, b3) = [(m.weight, m.bias)
                                        for m in y.class_labels_classifier.layers]
        d = ln.weight.shape[0]
        bound = math.sqrt(d) * ln.weight.abs().max() + ln.bias.norm()  # ‖LN(x)‖ <= bound
        b1.fill_(w1.norm(dim=1).max() * bound + 1)  # W1 z + b1 >= 1
        b2.fill_(w2.norm(dim=1).max() * math.sqrt(d) * 2 * b1[0] + 1)  # W2 h + b2 >= 1
    cfg = transformers.DeiTConfig(
        image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=3,
        num_attention_heads=4, intermediate_size=64, num_labels=y.config.num_labels + 1,
        layer_norm_eps=1e-6)
    deit = transformers.DeiTForImageClassificationWithTeacher(cfg).double().eval()
    with torch.no_grad():
        de, ye = deit.deit.embeddings, y.vit.embeddings
        de.patch_embeddings.projection.load_state_dict(
            ye.patch_embeddings.projection.state_dict())
        de.cls_token.copy_(ye.detection_tokens)
        de.distillation_token.copy_(ye.cls_token)
        pe = ye.position_embeddings
        de.position_embeddings.copy_(torch.cat([pe[:, -1:], pe[:, :1], pe[:, 1:-1]], 1))
        for dst, src in zip(adapt(deit).blocks, adapt(y).blocks, strict=True):
            for f in ("q_weight", "k_weight", "v_weight", "q_bias", "k_bias", "v_bias",
                      "proj_weight", "proj_bias", "fc1_weight", "fc1_bias", "fc2_weight",
                      "fc2_bias"):  # the canonical parts are views of each model's tensors
                getattr(dst, f).copy_(getattr(src, f))
            for n in ("norm1", "norm2"):
                getattr(dst, n).weight.copy_(getattr(src, n).weight)
                getattr(dst, n).bias.copy_(getattr(src, n).bias)
        deit.deit.layernorm.load_state_dict(ln.state_dict())
        deit.cls_classifier.weight.copy_(2 * (w3 @ w2 @ w1))
        deit.cls_classifier.bias.copy_(2 * (w3 @ (w2 @ b1 + b2) + b3))
        deit.distillation_classifier.weight.zero_()
        deit.distillation_classifier.bias.zero_()
    return deit


# Chefer'21 starts its LRP pass at the classifier's logits: on the twin the class head is a
# linear layer of the model (α1β0 rule), on YOLOS it is part of the target, which every
# propagating method differentiates as it is (SPEC_REACH §10.2): the maps differ by design.
HEAD_RULES = {"chefer21"}


@pytest.mark.parametrize("name", [m for m in METHODS if m not in HEAD_RULES])
def test_the_chosen_detection_row_is_read_out_as_a_class_token(name):
    """Every method's map of a DetectionTarget equals its map of the class on the DeiT
    twin (:func:`deit_twin`), patch by patch."""
    yolos = make_yolos(queries=1, size=(32, 32))
    twin = deit_twin(yolos)
    x = images((32, 32))
    with torch.no_grad():
        assert_close_scaled(twin(pixel_values=x).logits,
                            yolos(pixel_values=x).logits[:, 0])
    kw = {}
    params = inspect.signature(build_method(name, yolos).attribute).parameters
    if "score" in params and not name.endswith(":decompx"):  # DecompX: the logit, no option
        kw["score"] = "logit"  # the twin's probability is a softmax, the target's a sigmoid
    ours = attribute(name, yolos, x, DetectionTarget(0, label=[1, 4]), **kw)
    ref = attribute(name, twin, x, [1, 4], **kw)
    # at least at the scale 1 of the inputs: a few maps of this model are rounding-sized
    # (vanilla_grad's are ~1e-16, HiResCAM's ~1e-7)
    assert_close_scaled(ours, ref, scale=1.0)


# -- token removal --------------------------------------------------------------------------
def test_token_removal_keeps_every_detection_row():
    """True token removal under a DetectionTarget keeps CLS and every detection token and
    gives the model's own detection logits of the shortened sequence (the model's encoder
    run on [CLS, kept patches, det])."""
    model = make_yolos()
    ad = adapt(model)
    x = images()
    target = DetectionTarget([0, 2], label=[1, 3]).resolve(ad, x)
    keep = torch.tensor([[0, 3, 5, 8, 20, 23], [1, 2, 4, 9, 10, 17]])
    k = model.config.num_detection_tokens
    with torch.no_grad(), ad.targeting(target):
        x0 = ad.embed(x)
        kept = ad.select_tokens(x0, keep)
        cols = ad.run(x0, keep=keep)
        full = ad.run(x0, keep=torch.arange(24).expand(2, -1))
        whole = ad.run(x0)
    assert torch.equal(kept[:, :1 + k], x0[:, :1 + k])
    assert_close_scaled(full, whole)
    with torch.no_grad():
        emb = model.vit.embeddings(x)  # [CLS, patches, det]
        patches = torch.gather(emb[:, 1:-k], 1, keep[..., None].expand(-1, -1, emb.shape[-1]))
        seq = torch.cat([emb[:, :1], patches, emb[:, -k:]], 1)
        h = model.vit.layernorm(model.vit.encoder(seq, height=32, width=48).last_hidden_state)
        logits = model.class_labels_classifier(h[:, -k:])
    expected = logits[torch.arange(2)[:, None], torch.tensor([0, 2]), torch.tensor([1, 3])]
    assert_close_scaled(cols, expected)


@pytest.mark.filterwarnings("ignore:PLUS/SkipPLUS run the perturbation method")
def test_a_sub_network_keeps_every_detection_row_under_token_removal():
    """PLUS and SkipPLUS run their base on the sub-network of blocks l..L-1: true token
    removal there keeps CLS and every detection token as the model's adapter does, and
    gives the model's own layers 1.. run on [CLS, kept patches of x_1, det]; so PLUS and
    SkipPLUS over TIS and RISE (token masks at x_l) explain a detection."""
    from captum_vit import PLUS, SkipPLUS
    from captum_vit.adapters.subnetwork import SubnetworkAdapter

    model = make_yolos()
    ad = adapt(model)
    x = images()
    target = DetectionTarget([0, 2], label=[1, 3])
    resolved = target.resolve(ad, x)
    keep = torch.tensor([[0, 3, 5, 8, 20, 23], [1, 2, 4, 9, 10, 17]])
    k = model.config.num_detection_tokens
    view = SubnetworkAdapter(ad, 1)
    with torch.no_grad(), ad.targeting(resolved):
        cols = view.run(view.embed(x), keep=keep)
    with torch.no_grad():
        layers = model.vit.encoder.layer
        h = layers[0](model.vit.embeddings(x))  # x_1: [CLS, patches, det]
        patches = torch.gather(h[:, 1:-k], 1, keep[..., None].expand(-1, -1, h.shape[-1]))
        seq = torch.cat([h[:, :1], patches, h[:, -k:]], 1)
        for layer in layers[1:]:
            seq = layer(seq)
        logits = model.class_labels_classifier(model.vit.layernorm(seq)[:, -k:])
    expected = logits[torch.arange(2)[:, None], torch.tensor([0, 2]), torch.tensor([1, 3])]
    assert_close_scaled(cols, expected)

    for combinator, base in ((PLUS, "tis"), (SkipPLUS, "rise")):
        maps = combinator(model, base).attribute(x, target=target, output="tokens",
                                                 n_masks=16)
        assert torch.isfinite(maps).all() and (maps.std(1) > 0).all()
    one = SkipPLUS(model, "tis").attribute(x[1:], target=DetectionTarget(2, label=3),
                                           output="tokens", n_masks=16)
    both = SkipPLUS(model, "tis").attribute(x, target=target, output="tokens", n_masks=16)
    assert_close_scaled(both[1:], one)  # the second image's map does not depend on the first


def test_removal_metric_scores_the_chosen_detection():
    """A removal metric (true token removal by default) under a DetectionTarget: the
    unperturbed point of the deletion curve is the probability (sigmoid) of the model's
    own logit of each image's query and label."""
    model = make_yolos()
    x = images()
    result = deletion(model, x, GAE(model), target=DetectionTarget([0, 2], label=[1, 3]))
    with torch.no_grad():
        z = model(pixel_values=x).logits
    assert_close_scaled(result.curves[:, 0], torch.stack([z[0, 0, 1], z[1, 2, 3]]).sigmoid())
    assert torch.isfinite(result.curves).all()


def test_noise_tunnel_expands_the_detection_target():
    model = make_yolos()
    x = images()
    nt = NoiseTunnel(GAE(model))
    maps = nt.attribute(x, nt_type="smoothgrad", nt_samples=3, stdevs=0.1,
                        target=DetectionTarget([0, 1], label=[2, 1]))
    assert maps.shape == x.shape and torch.isfinite(maps).all()


# -- errors ---------------------------------------------------------------------------------
def test_a_class_target_is_refused_naming_detection_target():
    model = make_yolos()
    x = images()
    for target in (1, None, [0, 1]):
        with pytest.raises(TypeError, match="DetectionTarget"):
            GAE(model).attribute(x, target=target)


# -- mid position embeddings ----------------------------------------------------------------
def test_mid_position_embeddings_are_the_models_states():
    """Every block's output is the model's layer output (``output_hidden_states``, which
    transformers records at each layer's return, before the encoder adds the mid
    embedding) plus that layer's resampled mid embedding, rows reordered, at a resampled
    size; nothing is added after the last block."""
    model = make_yolos(mid=True)
    ad = adapt(model)
    x = images((40, 24))
    with torch.no_grad():
        hidden = model.vit(pixel_values=x, output_hidden_states=True).hidden_states
        mids = model.vit.encoder.interpolation((40, 24))[:, 0]  # [L-1, N, D]
        h = ad.embed(x)
        for l in range(3):
            h = ad.block(h, l, Ops())
            added = mids[l] if l < 2 else torch.zeros_like(mids[0])
            assert_close_scaled(h, ad._reorder(hidden[l + 1] + added))
    assert [p.post_add is not None for p in ad.blocks] == [True, True, False]


@pytest.mark.parametrize("name", METHODS)
def test_every_method_explains_a_detection_with_mid_position_embeddings(name):
    """With mid position embeddings every registered method gives a finite, non-constant
    map under a DetectionTarget and leaves the model unchanged (no method refuses)."""
    model = make_yolos(mid=True)
    x = images((40, 24))
    before = snapshot(model)
    maps = attribute(name, model, x, DetectionTarget("best", label=[1, 3]))
    assert_unchanged(model, before)
    assert maps.shape == x.shape and torch.isfinite(maps).all()
    if name != "random":
        assert (maps.flatten(1).std(1) > 0).all()


def test_decompx_puts_the_mid_position_embeddings_in_the_bias_source(monkeypatch):
    """DecompX is complete with mid embeddings (both routes agree), and its bias source
    holds their contribution exactly: a decomposition whose constant reaches no source
    has the same tokens and a bias smaller by ``Σ_l ⟨m_l, ∂s_lin/∂m_l⟩``, computed here
    from the parameter with the linearised forward (``m_l`` linear in the parameter ``P``,
    so the sum is ``⟨P, ∂s_lin/∂P⟩``)."""
    from captum_vit.methods.decompx import Decomposed, DecompositionOps

    model = make_yolos(mid=True)
    ad = adapt(model)
    x = images((40, 24))
    target = DetectionTarget([0, 2], label=[1, 3])
    explicit = DecompX(model, route="explicit").decompose(x, target)
    gradient = DecompX(model, route="gradient").decompose(x, target)
    for field in ("tokens", "bias", "logit"):
        assert_close_scaled(getattr(gradient, field), getattr(explicit, field), rel=1e-10)
    assert_close_scaled(explicit.tokens.sum(-1) + explicit.bias, explicit.logit)
    # the reference: <P, d s_lin / dP> through the model's own interpolation
    param = model.vit.encoder.interpolation.mid_position_embeddings
    resolved = target.resolve(ad, x)
    with ad.targeting(resolved):
        cols = ad.run(ad.embed(x), ops=Ops(linearize=True))
    s = cols.gather(1, resolved.index(2)[:, None])[:, 0]
    contribution = torch.stack([(torch.autograd.grad(s[i], param, retain_graph=True)[0]
                                 * param).sum() for i in range(2)]).detach()
    assert contribution.abs().min() > 1e-3  # the test has something to see

    def dropped(self, x, c):  # the constant in the real forward, in no source
        return Decomposed(x.real + c, x.parts, x.has_bias)

    monkeypatch.setattr(DecompositionOps, "add_constant", dropped)
    without = DecompX(model, route="explicit").decompose(x, target)
    assert_close_scaled(without.tokens, explicit.tokens, rel=1e-10)
    assert_close_scaled(explicit.bias - without.bias, contribution, rel=1e-10,
                        scale=explicit.logit.abs().max().item())


def test_token_removal_drops_the_mid_position_embedding_rows():
    """True token removal with mid embeddings equals the model's own layers on [CLS,
    kept patches, det] with the same rows of every resampled mid embedding added after
    each block but the last (the model's tables, rows dropped)."""
    model = make_yolos(mid=True)
    ad = adapt(model)
    x = images((40, 24))
    target = DetectionTarget([0, 2], label=[1, 3]).resolve(ad, x)
    keep = torch.tensor([[0, 3, 5, 8, 11], [1, 2, 4, 9, 14]])
    k = model.config.num_detection_tokens
    with torch.no_grad(), ad.targeting(target):
        x0 = ad.embed(x)
        cols = ad.run(x0, keep=keep)
        assert_close_scaled(ad.run(x0, keep=torch.arange(15).expand(2, -1)), ad.run(x0))
    with torch.no_grad():
        emb = model.vit.embeddings(x)  # [CLS, patches, det]
        rows = torch.cat([torch.zeros(2, 1, dtype=torch.long), 1 + keep,
                          torch.arange(16, 16 + k).expand(2, -1)], 1)
        h = torch.gather(emb, 1, rows[..., None].expand(-1, -1, emb.shape[-1]))
        mids = model.vit.encoder.interpolation((40, 24))[:, 0]  # [L-1, N, D]
        for i, layer in enumerate(model.vit.encoder.layer):
            h = layer(h)
            if i < 2:
                h = h + mids[i][rows]
        logits = model.class_labels_classifier(model.vit.layernorm(h)[:, -k:])
    expected = logits[torch.arange(2)[:, None], torch.tensor([0, 2]), torch.tensor([1, 3])]
    assert_close_scaled(cols, expected)


def test_mid_position_embeddings_need_an_embedded_size():
    """Blocks run on states of another length than the last embedded images' are refused
    by name, and the adapter is unchanged by the refusal."""
    model = make_yolos(mid=True)
    ad = adapt(model)
    with torch.no_grad():
        x0 = ad.embed(images((40, 24)))
        ad.embed(images())
        with pytest.raises(ValueError, match="mid position embeddings of the last embedded"):
            ad.run(x0, 0, 2)
        assert ad.run(ad.embed(images((40, 24))), 0, 2).shape == x0.shape


def test_detection_target_errors():
    model = make_yolos()
    ad = adapt(model)
    x = images()
    with pytest.raises(ValueError, match="query must be"):
        DetectionTarget("first")
    with pytest.raises(TypeError, match="query"):
        DetectionTarget(0.5)
    with pytest.raises(ValueError, match="box must be"):
        DetectionTarget(0, box=[0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="score must be one of"):
        DetectionTarget(0, 1, score="sigmoid")
    with pytest.raises(ValueError, match="leave score='logit'"):
        DetectionTarget(0, box=[0.5, 0.5, 0.1, 0.1], score="probability")
    with pytest.raises(ValueError, match="same number of entries"):
        DetectionTarget([0, 1], label=[1, 2, 3])
    with pytest.raises(ValueError, match=r"query must be in \[0, 3\)"):
        GAE(model).attribute(x, target=DetectionTarget(3, label=0))
    with pytest.raises(ValueError, match=r"label must be in \[0, 5\)"):
        GAE(model).attribute(x, target=DetectionTarget(0, label=5))
    with pytest.raises(ValueError, match="not resolved"):
        DetectionTarget("best", label=0).index(2)
    with pytest.raises(TypeError, match="DetectionTarget explains a detection token"):
        GAE(make_hf_model("hf_vit")).attribute(
            torch.randn(1, 3, 32, 32, dtype=torch.float64), target=DetectionTarget(0, 1))
    assert ad.num_prefix == 4  # nothing above changed the adapter


def test_parameter_stages_and_the_pixel_embedding():
    """The randomisation stages hold every parameter but the embedding's exactly once
    (head first: final norm and both MLPs); ``embed(x, ops)`` has the model's values and
    routes the pixel gradient through the patch projection exactly as autograd does."""
    from captum_vit.adapters import Ops

    model = make_yolos()
    ad = adapt(model)
    stages = ad.parameter_stages()
    ids = [id(p) for stage in stages for p in stage]
    assert len(ids) == len(set(ids))
    embedding = {id(p) for p in model.vit.embeddings.parameters()}
    assert set(ids) | embedding == {id(p) for p in model.parameters()}
    assert not set(ids) & embedding
    assert {id(p) for p in model.bbox_predictor.parameters()} <= {id(p) for p in stages[0]}
    x = images().requires_grad_()
    w = torch.randn(2, 28, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    a = ad.embed(x, Ops())
    assert_close_scaled(a, ad.embed(x))
    (g_ops,) = torch.autograd.grad((a * w).sum(), x)
    (g_ref,) = torch.autograd.grad((ad.embed(x) * w).sum(), x)
    assert_close_scaled(g_ops, g_ref)
