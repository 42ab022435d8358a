"""The processor-output front (SPEC_FRONTIER §14.2): a batch split into groups of one grid,
each group explained once, the maps returned per image in the batch's order."""

from __future__ import annotations

import pytest
import torch

from captum_vit._base import attribute_processed


class _Fake:
    """An adapter with two grids: images 0 and 2 are 2×3 patches, image 1 is 4×4."""

    processor_keys = ("spatial_shapes",)

    def processor_images(self, batch):
        return [(torch.tensor([0, 2]), batch["small"]), (torch.tensor([1]), batch["large"])]

    def processor_pixels(self, maps, batch):
        return torch.stack([m.flatten()[:4] for m in maps])


def _method(calls):
    def attribute(images, target, output, **kwargs):
        calls.append((images.shape[0], target, output, kwargs))
        k = images.shape[0]
        grid = images.sum(1, keepdim=True)  # [k, 1, gh, gw]: a map that names its image
        if output == "tokens":
            return grid.flatten(1)
        if output == "grid":
            return grid
        return grid.expand(-1, 3, -1, -1) + torch.arange(k)[:, None, None, None] * 0
    return attribute


def _batch():
    small = torch.stack([torch.full((3, 2, 3), 1.0), torch.full((3, 2, 3), 3.0)])
    large = torch.full((1, 3, 4, 4), 2.0)
    return {"small": small, "large": large, "spatial_shapes": None}


def test_maps_come_back_per_image_in_batch_order():
    calls: list = []
    grids = attribute_processed(_method(calls), _Fake(), _batch(), [5, 6, 7], "grid",
                                score="logit")
    assert isinstance(grids, list) and [g.shape for g in grids] == [
        (1, 1, 2, 3), (1, 1, 4, 4), (1, 1, 2, 3)]
    assert [float(g.flatten()[0]) for g in grids] == [3.0, 6.0, 9.0]  # images 0, 1, 2
    # one call per grid, the per-image targets indexed, the options passed on
    assert [(c[0], c[1].tolist(), c[2], c[3]) for c in calls] == [
        (2, [5, 7], "grid", {"score": "logit"}), (1, [6], "grid", {"score": "logit"})]
    tokens = attribute_processed(_method([]), _Fake(), _batch(), None, "tokens")
    assert tokens.shape == (6 + 16 + 6,)
    assert tokens[:6].eq(3).all() and tokens[6:22].eq(6).all() and tokens[22:].eq(9).all()
    inputs = attribute_processed(_method([]), _Fake(), _batch(), 1, "inputs")
    assert inputs.tolist() == [[3.0] * 4, [6.0] * 4, [9.0] * 4]


def test_one_grid_gives_one_tensor():
    class One(_Fake):
        def processor_images(self, batch):
            return [(torch.tensor([1, 0]), batch["small"])]

    pixels = attribute_processed(_method([]), One(), _batch(), None, "pixels")
    assert isinstance(pixels, torch.Tensor) and pixels.shape == (2, 3, 2, 3)
    assert pixels[0].eq(9).all() and pixels[1].eq(3).all()  # back in the batch's order


def test_bad_targets_and_outputs_are_named():
    with pytest.raises(ValueError, match="target has 2 entries.*3 images"):
        attribute_processed(_method([]), _Fake(), _batch(), [1, 2], "grid")
    with pytest.raises(ValueError, match="target is a Marker.*2 different grids"):
        attribute_processed(_method([]), _Fake(), _batch(), type("Marker", (), {})(), "grid")
    with pytest.raises(ValueError, match="output"):
        attribute_processed(_method([]), _Fake(), _batch(), None, "image")
