"""Score-CAM (SPEC_NEXT §8.3) against a slow float64 reference: every (image, channel) masked
image, or kept-token sequence through timm's own modules, run through the model alone; the
channels of largest variance with max_channels; the channel masks' min-max scaling. Its
option errors are checked with the gradient CAMs in tests/methods/test_cam.py."""

from __future__ import annotations

import math

import pytest
import torch

from captum_vit.adapters import adapt
from captum_vit.methods.scorecam import ScoreCAM, channel_masks
from tests.helpers import (
    assert_close_to_reference,
    assert_unchanged,
    make_inputs,
    make_model,
    snapshot,
)
from tests.methods.test_cam import REL, TARGET, model_logits, num_prefix, reference_xg


def reference_scorecam(model, x, target, layer, removal, score="probability",
                       max_channels=None):
    """SPEC_NEXT §8.3 Score-CAM: every (image, channel) masked image (or kept-token
    sequence, timm VisionTransformer's own modules) through the model ALONE. With
    ``max_channels``: only the channels of largest variance over the patches."""
    X, _ = reference_xg(model, x, target, layer)
    k = num_prefix(model)
    lay = adapt(model).layout(x)
    (gh, gw), (ph, pw) = lay.grid, lay.patch_size
    B, N, D = X.shape
    out = torch.zeros(B, N, dtype=torch.float64)
    with torch.no_grad():
        for b in range(B):
            var = [X[b, k:, c].var(correction=0).item() for c in range(D)]
            channels = sorted(range(D), key=lambda c: -var[c])[:max_channels or D]
            s = []
            for c in channels:
                col = X[b, k:, c]
                lo, hi = col.min(), col.max()
                mask = (col - lo) / (hi - lo) if hi > lo else torch.zeros_like(col)
                if removal == "pixels":
                    up = mask.reshape(gh, gw).repeat_interleave(ph, 0).repeat_interleave(pw, 1)
                    logits = model_logits(model, x[b:b + 1] * up)
                else:
                    kept = (mask >= 0.5).nonzero()[:, 0]
                    t = model.norm_pre(model._pos_embed(model.patch_embed(x[b:b + 1])))
                    seq = torch.cat([t[:, :k], t[:, k + kept]], dim=1)
                    logits = model.forward_head(model.norm(model.blocks(seq)))
                p = logits.softmax(-1) if score == "probability" else logits
                s.append(p[0, int(target[b])].item())
            w = [math.exp(v - max(s)) for v in s]
            w = [v / sum(w) for v in w]
            for j in range(N):
                out[b, j] = sum(w[i] * X[b, j, c].item() for i, c in enumerate(channels))
    return out


@pytest.mark.parametrize("removal", ["pixels", "tokens"])
def test_scorecam_matches_masked_images_run_alone(removal):
    model, x = make_model("vit"), make_inputs("vit", batch=2)
    before = snapshot(model)
    k, d = num_prefix(model), model.embed_dim
    ref = reference_scorecam(model, x, TARGET, 2, removal)[:, k:]
    cam = ScoreCAM(model, relu=False, batch_size=24, removal=removal)
    out = cam.attribute(x, target=TARGET, output="tokens")
    assert_close_to_reference(out, ref, rel=REL)
    if removal == "pixels":
        assert cam.num_forwards == 2 * (1 + d)
    else:
        assert 2 <= cam.num_forwards <= 2 * (1 + d)
    relu = ScoreCAM(model, removal=removal).attribute(x, target=TARGET, output="tokens")
    assert_close_to_reference(relu, ref.clamp(min=0), rel=REL)
    assert_unchanged(model, before)


def test_scorecam_other_family_layer_and_logit_score():
    model, x = make_model("beit"), make_inputs("beit", batch=2)
    k = num_prefix(model)
    ref = reference_scorecam(model, x, TARGET, 0, "pixels", score="logit")[:, k:]
    out = ScoreCAM(model, layer=0, relu=False, batch_size=100, progress=True).attribute(
        x, target=TARGET, score="logit", output="tokens")
    assert_close_to_reference(out, ref, rel=REL)


def test_scorecam_max_channels_scores_the_channels_of_largest_variance():
    model, x = make_model("registers"), make_inputs("registers", batch=2)
    k = num_prefix(model)
    ref = reference_scorecam(model, x, TARGET, 1, "pixels", max_channels=5)[:, k:]
    cam = ScoreCAM(model, layer=1, relu=False)
    out = cam.attribute(x, target=TARGET, max_channels=5, output="tokens")
    assert_close_to_reference(out, ref, rel=REL)
    assert cam.num_forwards == 2 * (1 + 5)
    full = cam.attribute(x, target=TARGET, output="tokens")
    assert torch.equal(cam.attribute(x, target=TARGET, max_channels=32, output="tokens"), full)
    assert torch.equal(cam.attribute(x, target=TARGET, max_channels=99, output="tokens"), full)
    assert cam.num_forwards == 2 * (1 + 32)
    with pytest.raises(ValueError, match="max_channels"):
        cam.attribute(x, target=TARGET, max_channels=0)
    with pytest.raises(TypeError, match="max_channels"):
        cam.attribute(x, target=TARGET, max_channels=4.0)


def test_channel_masks_are_min_max_over_patches_and_zero_when_constant():
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    x[1, 1:, 2] = 0.7  # channel 2 of image 1 is constant over the patches
    m = channel_masks(x, 1)
    assert m.shape == (2, 3, 4)
    assert torch.equal(m[1, 2], torch.zeros(4, dtype=torch.float64))
    for b, c in ((0, 0), (0, 2), (1, 1)):
        col = x[b, 1:, c]
        torch.testing.assert_close(m[b, c], (col - col.min()) / (col.max() - col.min()))
