"""SAM 2's image encoder (Hugging Face ``Sam2Model`` / ``Sam2VisionModel``) and
:class:`~captum_vit.targets.Sam2MaskTarget`: float64 forward parity with the models' own
trunk and neck (every stage's states, windows padded on the grid inside a query-pooling
block as in SAM 2.1-T's stage 3) at the configured size and at other sizes the encoder
takes, the mask score against ``Sam2Model``'s own ``pred_masks``, DecompX complete, every
registered method runs or refuses by name (the embedding at another size, a mask), masks
refused at other sizes as ``Sam2Model`` itself fails there, clear errors with the model
unchanged."""

from __future__ import annotations

import pytest
import torch

from captum_vit import DecompX
from captum_vit.adapters import adapt
from captum_vit.adapters.ops import Ops
from captum_vit.registry import available_methods, build_method, method_entries
from captum_vit.targets import EmbeddingTarget, Sam2MaskTarget
from tests.helpers import (
    WINDOW_REFUSERS,
    assert_close_scaled,
    assert_unchanged,
    needs_transformers,
    snapshot,
)

pytestmark = needs_transformers

FAST = {"rise": {"n_masks": 8}, "tis": {"n_masks": 8}}
POINTS = torch.tensor([[[10.0, 12.0]], [[20.0, 6.0]]], dtype=torch.float64)
"""One point ``(x, y)`` per image of the 32 px examples."""
SUMS_SUBNETWORKS = {e.name for e in method_entries() if getattr(e.cls, "sums_subnetworks",
                                                                 False)}
"""Methods summing sub-networks that end at the output: they refuse block-reading targets."""


def sam2(**config) -> torch.nn.Module:
    """The ``hf_sam2_model`` example (32 px, four stages on 8x8 ... 1x1 grids)."""
    from captum_vit.adapters.families.hf_sam2 import sam2_example

    return sam2_example(**config)()


def padded() -> torch.nn.Module:
    """64 px: the last two blocks attend in 6x6 windows padded on the 4x4 grid, the last
    one pools its queries inside them (SAM 2.1-T's block 10: windows of 14 on 64x64)."""
    return sam2(image_size=64, windows=(4, 2, 6, 1), global_blocks=())


def images(n: int = 2, size: int | tuple[int, int] = 32, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    hw = (size, size) if isinstance(size, int) else size
    return torch.randn(n, 3, *hw, generator=g, dtype=torch.float64)


def _direct(model, x, mask, multimask_output=True, **prompt):
    """The score of ``Sam2Model.forward`` on the pixels: mask ``mask``'s low-resolution
    logits summed over its positive pixels, and that region."""
    out = model(pixel_values=x, multimask_output=multimask_output, **prompt)
    z = out.pred_masks[:, 0, mask]
    region = z > 0
    return (z * region).sum((-2, -1)).detach(), region


# -- the encoder ----------------------------------------------------------------------------
@pytest.mark.parametrize("build", ["model", "vision", "padded", "model_64", "vision_32x96"])
def test_forward_equals_the_models_own_trunk_and_neck(build):
    """Every stage's token states equal the trunk's ``intermediate_hidden_states`` and the
    output the grid mean of the neck's top level (1e-12, float64), at the configured 32 px
    and at sizes the model's own encoder takes (64 px; 32x96, not square), one adapter
    for all (its windows and poolings follow the images)."""
    size = {"padded": 64, "model_64": 64, "vision_32x96": (32, 96)}.get(build, 32)
    model, x = (padded() if build == "padded" else sam2()), images(size=size)
    model = model.vision_encoder if build.startswith("vision") else model
    a = adapt(model)
    if build in ("model_64", "vision_32x96"):  # the configured size first, then this one
        a.run(a.embed(images()))
    assert type(a).__name__ == "HFSam2Adapter" and a.embedding
    enc = getattr(model, "vision_encoder", model)
    own = enc.backbone(pixel_values=x).intermediate_hidden_states
    h = a.embed(x)
    states = []
    for l in range(len(a.blocks)):
        h = a.block(h, l, Ops())
        if l in a.stage_ends:
            states.append(h)
    assert len(states) == len(own) == 4
    for ours, ref in zip(states, own, strict=True):
        assert_close_scaled(ours, ref.reshape(ref.shape[0], -1, ref.shape[-1]), rel=1e-12)
    fpn, _ = enc.neck(own)
    assert_close_scaled(a.run(a.embed(x)), fpn[0].mean((-2, -1)), rel=1e-12)
    assert a.num_classes == enc.config.fpn_hidden_size


def test_decompx_is_complete_for_the_embedding():
    """A vector target on the FPN top level's mean (linear): tokens + bias = score, at the
    configured sizes and at 64x32 (not square, another size than configured)."""
    for model, x in ((sam2(), images()), (padded(), images(size=64)),
                     (sam2(), images(size=(64, 32)))):
        t = torch.randn(16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        for route in ("explicit", "gradient"):
            res = DecompX(model, route=route).decompose(x, EmbeddingTarget(t, similarity="dot"))
            ref = adapt(model).model_outputs(x).detach() @ t
            assert res.tokens.shape[-1] == x.shape[-2] * x.shape[-1] // 16
            torch.testing.assert_close(res.tokens.sum(-1) + res.bias, ref, rtol=0,
                                       atol=1e-10 * ref.abs().max())


def test_token_ixg_at_two_sizes_is_autograd_through_the_models_own_encoder():
    """One method object at 64x32 px, then at the configured 32 px, then at 64x32 again:
    token Input×Gradient equals autograd of the target through the model's own trunk and
    neck (``x_0``: the patch embedding hooked as a leaf plus the model's position
    embedding for that grid), 1e-10."""
    model = sam2()
    enc = model.vision_encoder
    t = torch.randn(16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ixg = build_method("token_ixg", model)
    seen = {}

    def leaf(module, args, out):
        seen["p"] = out.detach().requires_grad_()
        return seen["p"]

    for size in ((64, 32), 32, (64, 32)):
        x = images(size=size)
        got = ixg.attribute(x, target=EmbeddingTarget(t, similarity="dot"), output="tokens")
        hook = enc.backbone.patch_embed.register_forward_hook(leaf)
        try:
            fpn, _ = enc.neck(enc.backbone(pixel_values=x).intermediate_hidden_states)
        finally:
            hook.remove()
        (g,) = torch.autograd.grad((fpn[0].mean((-2, -1)) @ t).sum(), seen["p"])
        x0 = seen["p"] + enc.backbone._get_pos_embed(seen["p"].shape[1:3])
        ref = (x0 * g).sum(-1).flatten(1).detach()
        assert got.shape == ref.shape == (2, x.shape[-2] * x.shape[-1] // 16)
        assert_close_scaled(got, ref, rel=1e-10)


# -- Sam2MaskTarget -------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", ["points", "boxes", "both", "labels", "single"])
def test_mask_target_scores_the_models_own_mask(prompt):
    """The target on our forward equals the score of ``Sam2Model``'s own ``pred_masks`` for
    each image's prompt (1e-12), and its region is the model's positive pixels."""
    model = sam2()
    x = images()
    boxes = torch.tensor([[2.0, 3.0, 20.0, 25.0], [8.0, 1.0, 30.0, 14.0]], dtype=torch.float64)
    pts2 = torch.cat([POINTS, POINTS.flip(-1)], 1)  # two points per image
    labels = torch.tensor([[1, 0], [1, 1]])
    kw, direct, mask, multi = {}, {}, 1, True
    if prompt in ("points", "both", "single"):
        kw["points"], direct["input_points"] = POINTS, POINTS[:, None]
    if prompt in ("boxes", "both"):
        kw["boxes"], direct["input_boxes"] = boxes, boxes[:, None]
    if prompt == "labels":
        kw.update(points=pts2, labels=labels)
        direct.update(input_points=pts2[:, None], input_labels=labels[:, None])
    if prompt == "single":  # the decoder's single mask (its stability choice in eval)
        mask, multi = 0, False
    ref, region = _direct(model, x, mask, multi, **direct)
    a = adapt(model)
    target = Sam2MaskTarget(model, mask=mask, multimask_output=multi, **kw)
    assert target.blocks == (1, 2, 4, 5)  # the ends of the four stages the decoder reads
    target = target.resolve(a, x)
    assert torch.equal(target.region, region)
    with a.targeting(target):
        cols = a.run(a.embed(x))  # [2, 2]: each image's score under both images' prompts
    torch.testing.assert_close(cols.diagonal(), ref, rtol=1e-12, atol=1e-12 * ref.abs().max())


def test_decompx_on_a_mask_is_complete_at_the_read_stages():
    """The mask score (a nonlinear decoder on the stages it reads): both routes give the
    same tokens and bias, which sum to the score linearised at the read stage outputs
    (``Σ_l ⟨x_l, ∂s/∂x_l⟩``); ``score`` is SAM 2's own."""
    model = sam2()
    x = images()
    t = Sam2MaskTarget(model, points=POINTS, mask=1)
    ref, _ = _direct(model, x, 1, input_points=POINTS[:, None])
    g, e = (DecompX(model, route=r).decompose(x, t) for r in ("gradient", "explicit"))
    for name in ("tokens", "bias", "logit", "score"):
        torch.testing.assert_close(getattr(g, name), getattr(e, name), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(e.tokens.sum(-1) + e.bias, e.logit, rtol=0,
                               atol=1e-10 * e.logit.abs().max())
    torch.testing.assert_close(e.score, ref, rtol=1e-10, atol=1e-10 * ref.abs().max())
    # the linearisation by hand: the score's gradient at the read stage outputs
    a = adapt(model)
    r = t.resolve(a, x)
    with torch.no_grad(), a.targeting(r):
        a.run(a.embed(x))
        hidden = {l: a.state.settings.hidden[l] for l in r.blocks[:-1]}
    h = a.embed(x)
    for l in range(len(a.blocks)):
        h = a.block(h, l, Ops())
        if l + 1 == r.blocks[-1]:
            hidden[l + 1] = h
    from captum_vit.adapters.scoring import Outputs

    leaves = {l: v.detach().requires_grad_() for l, v in hidden.items()}
    s = r.columns(Outputs(hidden=leaves)).diagonal()
    grads = torch.autograd.grad(s.sum(), list(leaves.values()))
    lin = sum((v * gr).sum((1, 2)) for v, gr in zip(leaves.values(), grads, strict=True))
    torch.testing.assert_close(e.logit, lin.detach(), rtol=1e-9, atol=1e-9)


def _expect(name: str, model) -> str | None:
    """The refusal a method owes SAM 2 by name (``None``: it runs)."""
    if name in WINDOW_REFUSERS:
        return "window"
    if not getattr(build_method(name, model), "pools_queries", False):
        return "pools its queries"
    return None


@pytest.mark.parametrize("kind", ["embedding", "mask"])
def test_every_registered_method_runs_or_refuses_by_name(kind):
    """Every registered method on the embedding (a vector per image) at 32x64 px, another
    size than the configured one (the first grid 8x16), and on a mask at the configured
    32 px (several stages read; the first grid 8x8): finite, non-constant maps on the
    first stage's grid, or a ValueError naming why; the model unchanged either way."""
    model = sam2()
    x = images(size=(32, 64) if kind == "embedding" else 32)
    before = snapshot(model)
    if kind == "embedding":
        target = torch.randn(2, 16, generator=torch.Generator().manual_seed(2),
                             dtype=torch.float64)
    else:
        target = Sam2MaskTarget(model, points=POINTS, mask=1)
    ran = []
    for name in available_methods():
        method = build_method(name, model)
        why = _expect(name, model)
        if why is None and kind == "mask" and name in SUMS_SUBNETWORKS:
            why = "sums maps of the sub-networks"
        if why is None and kind == "mask" and name == "legrad":  # reads earlier stages
            why = "LeGrad applies the model's readout to block outputs from block"
        if why is not None:
            with pytest.raises(ValueError, match=why):
                method.attribute(x, target=target, **FAST.get(name, {}))
            continue
        maps = method.attribute(x, target=target, output="tokens", **FAST.get(name, {}))
        assert maps.shape == (2, 128 if kind == "embedding" else 64), name
        assert torch.isfinite(maps).all(), name
        if name != "random":  # (a last grid of 1x1 may leave one image's CAM at zero)
            assert maps.std() > 0, name
        ran.append(name)
    assert {"rollout", "gae", "chefer21", "decompx", "attnlrp", "gradcam"} <= set(ran)
    assert_unchanged(model, before)


def test_a_batch_equals_its_images_one_by_one_through_padded_pooled_windows():
    """The vector chains and the decomposition through query pooling inside padded
    windows: a batch equals its images one by one, and DecompX of a mask is complete."""
    model = padded()
    x = images(size=64)
    pts = POINTS * 2
    t = Sam2MaskTarget(model, points=pts, mask=0)
    for name in ("rollout", "attnlrp"):
        method = build_method(name, model)
        maps = method.attribute(x, target=t, output="tokens")
        one = torch.cat([build_method(name, model).attribute(
            x[i:i + 1], target=Sam2MaskTarget(model, points=pts[i], mask=0), output="tokens")
            for i in range(2)])
        assert maps.shape == (2, 256) and torch.isfinite(maps).all()
        torch.testing.assert_close(maps, one, rtol=1e-9, atol=1e-9 * maps.abs().max())
    e = DecompX(model).decompose(x, t)
    torch.testing.assert_close(e.tokens.sum(-1) + e.bias, e.logit, rtol=0,
                               atol=1e-10 * e.logit.abs().max())


# -- bad inputs -----------------------------------------------------------------------------
def test_bad_inputs_are_refused_by_name_and_the_model_is_unchanged():
    model = sam2()
    x = images()
    before = snapshot(model)
    gae = build_method("gae", model)
    with pytest.raises(ValueError, match=r"points reach outside the 32x32 images"):
        gae.attribute(x, target=Sam2MaskTarget(model, points=[[40.0, 3.0]]))
    with pytest.raises(ValueError, match=r"boxes reach outside"):
        gae.attribute(x, target=Sam2MaskTarget(model, boxes=[2.0, 3.0, 20.0, -1.0]))
    # sizes the encoder does not take: grids that do not halve at every pooling (48 px:
    # 12, 6, 3), not whole pos_embed_window tiles (40 px: 10 tokens, windows of 4),
    # sides the patch stride does not divide
    for size, why in ((48, r"3x3 grid .*halve exactly"), (40, "pos_embed_window"),
                      (30, "patch stride")):
        for target in (Sam2MaskTarget(model, points=[[3.0, 4.0]]),
                       torch.ones(16, dtype=torch.float64)):
            with pytest.raises(ValueError, match=rf"inputs size \({size}, {size}\).*{why}.*"
                                                 r"multiple of 32x32 px"):
                gae.attribute(images(size=size), target=target)
    with pytest.raises(TypeError, match="Sam2Model"):
        Sam2MaskTarget(model.vision_encoder, points=[[3.0, 4.0]])
    with pytest.raises(ValueError, match="prompt"):
        Sam2MaskTarget(model)
    with pytest.raises(ValueError, match=r"mask must be in \[0, 3\)"):
        Sam2MaskTarget(model, points=[[3.0, 4.0]], mask=3)
    with pytest.raises(ValueError, match="same Sam2Model"):
        gae.attribute(x, target=Sam2MaskTarget(sam2(), points=[[3.0, 4.0]]))
    assert_unchanged(model, before)


def test_masks_at_another_size_are_refused_as_the_model_itself_fails_there():
    """At 64 px the encoder runs (embedding targets, above), but ``Sam2Model.forward``
    itself fails: it reshapes the FPN levels to the configured ``backbone_feature_sizes``
    and its prompt encoder's dense embedding and image-wide positional embedding keep the
    configured grid. ``Sam2MaskTarget`` says so by name; the model unchanged."""
    model = sam2()
    x = images(size=64)
    before = snapshot(model)
    with pytest.raises(RuntimeError):  # the model's own limit
        model(pixel_values=x, input_points=POINTS[:, None])
    with pytest.raises(RuntimeError):  # even given the 64 px image embeddings themselves
        enc = model.vision_encoder(x)
        maps = list(enc.fpn_hidden_states)
        maps[0], maps[1] = model.mask_decoder.conv_s0(maps[0]), model.mask_decoder.conv_s1(maps[1])
        model(image_embeddings=maps, input_points=POINTS[:, None])
    assert tuple(model.prompt_encoder.image_embedding_size) == (2, 2)
    for name in ("gae", "decompx"):
        with pytest.raises(ValueError, match=r"configured size 32x32, got 64x64: "
                                             r"Sam2Model.forward .*backbone_feature_sizes"):
            build_method(name, model).attribute(
                x, target=Sam2MaskTarget(model, points=POINTS * 2, mask=1))
    assert_unchanged(model, before)


def test_settings_the_canonical_form_does_not_have_are_refused_by_name():
    from captum_vit.adapters.families.hf_sam2 import HFSam2Adapter

    with pytest.raises(TypeError, match="HFSam2Adapter explains"):
        HFSam2Adapter(sam2().vision_encoder.backbone)
    model = sam2()
    conv = model.vision_encoder.neck.convs[1]
    model.vision_encoder.neck.convs[1] = torch.nn.Conv2d(
        conv.in_channels, conv.out_channels, 3, padding=1).double()
    with pytest.raises(TypeError, match="1x1"):
        adapt(model)


def _dense_mixing(model, x):
    """Per block the dense head-mean attention over the real keys ``Ā`` [B, N_out, N_in]
    and the residual's token mixing ``R`` (the identity, or each pooled token's children's
    share of the channels where they are the maximum), written here from the trace's LN1
    states with a mask over windows of the zero-padded grid: a padded slot's key is the key
    bias, in the softmax but not a token (independent of the windowed engine)."""
    a = adapt(model)
    tr = a.trace(x)
    out = []
    for p, rec in zip(a.blocks, tr.blocks, strict=True):
        u = rec.u
        b, n, c = u.shape
        (gh, gw), (mh, mw), (ph, pw) = p.window.grid, p.window.size, p.window.padded
        h, d = p.num_heads, p.head_dim
        up = torch.nn.functional.pad(u.reshape(b, gh, gw, c), (0, 0, 0, pw - gw, 0, ph - gh))
        real = torch.zeros(ph, pw, dtype=torch.bool)
        real[:gh, :gw] = True
        q = torch.nn.functional.linear(up, p.q_weight, p.q_bias)  # [b, ph, pw, h d]
        iy, ix = torch.arange(ph).repeat_interleave(pw), torch.arange(pw).repeat(ph)
        win_in = (iy // mh) * 1000 + ix // mw
        oh, ow, qh, qw, win_out = gh, gw, ph, pw, win_in
        if p.pool is not None:  # q max-pooled 2x2 on the padded grid (inside the windows)
            q = torch.nn.functional.max_pool2d(q.permute(0, 3, 1, 2), 2).permute(0, 2, 3, 1)
            oh, ow, qh, qw = gh // 2, gw // 2, ph // 2, pw // 2
            oy, ox = torch.arange(qh).repeat_interleave(qw), torch.arange(qw).repeat(qh)
            win_out = (oy // (mh // 2)) * 1000 + ox // (mw // 2)
        q = q.reshape(b, qh * qw, h, d).transpose(1, 2)
        k = torch.nn.functional.linear(up, p.k_weight, p.k_bias).reshape(b, ph * pw, h, d)
        logits = (q * p.scale) @ k.transpose(1, 2).transpose(-1, -2)
        logits = logits.masked_fill(win_out[:, None] != win_in[None], float("-inf"))
        probs = logits.softmax(-1).mean(1)  # [b, qh qw, ph pw]
        keep_out = torch.zeros(qh, qw, dtype=torch.bool)
        keep_out[:oh, :ow] = True
        mean = probs[:, keep_out.flatten()][:, :, real.flatten()]  # real queries and keys
        if p.pool is None:
            res = torch.eye(n, dtype=u.dtype).expand(b, n, n)
        else:
            vals = torch.nn.functional.linear(u, p.pool.weight, p.pool.bias)
            vals = vals.reshape(b, oh, 2, ow, 2, -1)
            top = (vals == vals.amax(dim=(2, 4), keepdim=True)).double()
            share = (top / top.sum(dim=(2, 4), keepdim=True)).mean(-1)  # [b, oh, 2, ow, 2]
            res = torch.zeros(b, oh, ow, gh, gw, dtype=u.dtype)
            for dy in range(2):
                for dx in range(2):
                    res[:, torch.arange(oh)[:, None], torch.arange(ow)[None],
                        2 * torch.arange(oh)[:, None] + dy, 2 * torch.arange(ow)[None] + dx] = \
                        share[:, :, dy, :, dx]
            res = res.reshape(b, oh * ow, n)
        out.append((mean, res))
    return out


@pytest.mark.parametrize("build", ["padded", "wide"])
def test_rollout_dense_reference_through_padded_pooled_windows(build):
    """Rollout as a vector chain through windows padded on the grid, with the queries
    pooled inside them, equals the dense product of ``(Ā_l + R_l) / rowsum`` written here
    (the embedding's mean readout of the last grid: 2x2; ``wide``: the 32 px model at
    32x64, another size than its configured one, first grid 8x16, last 1x2)."""
    model, x = (padded(), images(size=64)) if build == "padded" else (sam2(), images(size=(32, 64)))
    blocks = _dense_mixing(model, x)
    assert blocks[0][0].shape[-1] == (256 if build == "padded" else 128)
    with torch.no_grad():
        n = blocks[-1][0].shape[1]  # the last grid's tokens
        v = torch.full((2, n), 1 / n, dtype=torch.float64)
        for mean, res in reversed(blocks):
            m = mean + res
            v = torch.einsum("bi,bij->bj", v, m / m.sum(-1, keepdim=True))
    t = torch.ones(16, dtype=torch.float64)
    got = build_method("rollout", model).attribute(x, target=t, output="tokens")
    torch.testing.assert_close(got, v, rtol=0, atol=1e-12)


def test_token_rows_of_a_later_stage_are_weighed_on_its_grid():
    """A ``TokenTarget`` reads the last stage's rows (4 tokens on the padded example's 2x2
    grid): the gradient-free readout is uniform over those rows, so Rollout's map (rows of
    row-stochastic matrices) sums to 1 on the first grid; GAE runs (its readout weights were
    sized for the first grid, 256 tokens)."""
    from captum_vit.targets import TokenTarget

    model = padded()
    x = images(size=64)
    t = TokenTarget(lambda z: (z ** 2).mean((1, 2)))
    maps = build_method("rollout", model).attribute(x, target=t, output="tokens")
    torch.testing.assert_close(maps.sum(-1), torch.ones(2, dtype=torch.float64), rtol=0,
                               atol=1e-12)
    gae = build_method("gae", model).attribute(x, target=t, output="tokens")
    assert gae.shape == (2, 256) and torch.isfinite(gae).all() and (gae.std(-1) > 0).all()
