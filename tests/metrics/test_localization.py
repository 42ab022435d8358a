"""Pointing game and segmentation on synthetic masks with hand-computed answers."""

from __future__ import annotations

import math

import pytest
import torch

from captum_vit.metrics import MetricResult, pointing_game, segmentation
from tests.helpers import assert_unchanged, snapshot
from tests.metrics_toys import linear_toy, toy_inputs


def _grid(cells):
    """A [1, 16] patch map (4×4 grid) with 1 at the given (row, col) cells."""
    g = torch.zeros(4, 4, dtype=torch.float64)
    for r, c in cells:
        g[r, c] = 1.0
    return g.reshape(1, 16)


def test_pointing_game_hit_miss_skip():
    model, x = linear_toy(), toy_inputs(4)
    maps = torch.cat([_grid([(0, 0)]) * 2 + 0.1 * torch.rand(1, 16, dtype=torch.float64)
                      for _ in range(4)])
    masks = torch.zeros(4, 16, 16, dtype=torch.bool)
    masks[0, :8, :8] = True          # hit
    masks[1, 8:, 8:] = True          # miss
    masks[2, :, :8] = True           # 50% of the image: skipped
    masks[3, 0:3, 0:3] = True        # hit (peak of the upsampled map is in patch (0, 0))
    before = snapshot(model)
    res = pointing_game(model, x, maps, masks)
    assert_unchanged(model, before)
    assert res.per_example[[0, 1, 3]].tolist() == [1.0, 0.0, 1.0]
    assert math.isnan(res.per_example[2].item())
    assert res.value == pytest.approx(2 / 3)


def test_segmentation_known_answers_and_dataset_accumulated_iou():
    model, x = linear_toy(), toy_inputs(2)
    left = _grid([(r, c) for r in range(4) for c in range(2)])  # left half of the patches
    maps = torch.cat([left, left])
    masks = torch.zeros(2, 16, 16, dtype=torch.bool)
    masks[0, :, :8] = True   # = the thresholded map (bilinear edge is symmetric about x=8)
    masks[1, :8, :] = True   # top half: inter 64, union 192 for both classes
    seg = segmentation(model, x, maps, masks)
    assert seg["pixel_accuracy"].per_example.tolist() == pytest.approx([1.0, 0.5])
    assert seg["miou"].per_example.tolist() == pytest.approx([1.0, 1 / 3])
    # accumulated over the dataset: (128 + 64) / (128 + 192) for each class
    assert seg["miou"].value == pytest.approx(0.6)
    assert seg["map"].per_example[0].item() == pytest.approx(1.0)
    assert seg["raw_ap"].per_example[0].item() == pytest.approx(1.0)
    # top-half mask vs left-half map: AP of a map constant on each half = 0.5 with nearest
    assert seg["raw_ap"].per_example[1].item() == pytest.approx(0.5)
    merged = MetricResult.cat([MetricResult.cat([seg["miou"]]), seg["miou"]])
    assert merged.value == pytest.approx(0.6)


def test_segmentation_accepts_pixel_maps_and_checks_masks():
    model, x = linear_toy(), toy_inputs(2)
    pix = torch.zeros(2, 1, 16, 16, dtype=torch.float64)
    pix[:, :, :, :8] = 1.0
    masks = torch.zeros(2, 16, 16, dtype=torch.bool)
    masks[:, :, :8] = True
    seg = segmentation(model, x, pix, masks[:, None])
    assert seg["pixel_accuracy"].value == pytest.approx(1.0)
    with pytest.raises(ValueError, match="masks must have shape"):
        segmentation(model, x, pix, masks[:, :8])
    with pytest.raises(ValueError, match="masks must have shape"):
        pointing_game(model, x, pix, masks[:1])
    with pytest.raises(TypeError, match="masks"):
        pointing_game(model, x, pix, masks.numpy())


# -- issue "One adapter, one registry, thin commands" ------------------------------------------
def test_pointing_game_decides_on_the_patch_grid_at_every_border():
    """The point is the centre of the top patch (central 2x2 pixels of a 4-pixel patch),
    for border and interior patches alike. The old argmax of a bilinearly upsampled map
    ties over the outer corner of a border patch and took the image's edge pixel, so a
    garment at the centre of the top patch but off the edge was judged a miss."""
    model, x = linear_toy(), toy_inputs(5)
    cells = [(0, 0), (3, 3), (0, 3), (3, 0), (1, 2)]
    maps = torch.cat([_grid([c]) for c in cells])
    masks = torch.zeros(5, 16, 16, dtype=torch.bool)
    masks[0, 1:3, 1:3] = True      # the centre of patch (0, 0), not the pixel (0, 0)
    masks[1, 13, 13] = True        # a central pixel of patch (3, 3), off the old (14, 14)
    masks[2, 2, 13] = True         # a central pixel of patch (0, 3), off the old (0, 14)
    masks[3, 12:16, 0] = True      # the edge column of patch (3, 0), off its centre: miss
    masks[4, 6, 10] = True         # an interior patch as before
    res = pointing_game(model, x, maps, masks)
    assert res.per_example.tolist() == [1.0, 1.0, 1.0, 0.0, 1.0]
    # a tolerance grows the region: the edge column is 1 pixel from the central (13, 1)
    assert pointing_game(model, x, maps, masks, tolerance=1).per_example[3] == 1.0
    with pytest.raises(ValueError, match="tolerance"):
        pointing_game(model, x, maps, masks, tolerance=-1)


def test_pointing_game_odd_patches_use_their_central_pixel():
    from captum_vit.metrics.localization import patch_centres_in

    masks = torch.zeros(1, 14, 14, dtype=torch.bool)
    masks[0, 3, 10] = True  # centre of patch (0, 1) of a 2x2 grid of 7-pixel patches
    assert patch_centres_in(masks, (2, 2), (7, 7)).tolist() == [[False, True, False, False]]
    masks[0, 3, 10], masks[0, 4, 10] = False, True
    assert not patch_centres_in(masks, (2, 2), (7, 7)).any()


def test_pointing_game_ties_count_the_expected_hit():
    model, x = linear_toy(), toy_inputs(3)
    maps = torch.cat([_grid([(0, 0), (3, 3)]), _grid([(0, 0), (1, 1), (2, 2), (3, 3)]),
                      torch.zeros(1, 16, dtype=torch.float64)])
    masks = torch.zeros(3, 16, 16, dtype=torch.bool)
    masks[0, 0:4, 0:4] = True      # one of two tied top patches: expected hit 1/2
    masks[1, 4:12, 4:12] = True    # two of four tied top patches: 1/2
    masks[2, 2, 2] = True          # a constant map: all 16 patches tie, one is hit: 1/16
    res = pointing_game(model, x, maps, masks)
    assert res.per_example.tolist() == pytest.approx([0.5, 0.5, 1 / 16])
