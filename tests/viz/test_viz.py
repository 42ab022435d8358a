"""captum_vit.viz: upsampling for display, overlays drawn by Captum, method grids."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from captum_vit.viz import plot_grid, plot_overlay, upsample_map  # noqa: E402


def test_upsample_map_bilinear_for_every_map_shape():
    grid = torch.rand(8, 8)
    ref = F.interpolate(grid[None, None], size=(56, 56), mode="bilinear",
                        align_corners=False)[0, 0]
    for m in (grid, grid.flatten(), grid[None]):
        torch.testing.assert_close(upsample_map(m, (56, 56), display="bilinear"), ref)
    pixels = torch.rand(3, 56, 56)
    torch.testing.assert_close(upsample_map(pixels, (56, 56)), pixels.mean(0))


def _heat(ax):
    return ax.images[-1]  # Captum draws the image first, then the map


def test_overlay_signed_map_uses_captums_all_scale_and_a_colour_bar():
    fig, ax = plt.subplots()
    m = torch.zeros(8, 8)
    m[0, 0], m[7, 7] = -1.0, 2.0
    plot_overlay(ax, torch.rand(1, 56, 56), m, title="signed")
    heat = _heat(ax)
    assert heat.get_clim() == (-1.0, 1.0)
    assert heat.get_array().min() < 0 < heat.get_array().max()
    assert len(fig.axes) == 2 and ax.get_title() == "signed"
    plt.close(fig)


def test_overlay_positive_map_drops_its_offset():
    fig, ax = plt.subplots()
    m = 5.0 + torch.rand(8, 8)
    plot_overlay(ax, torch.rand(3, 56, 56), m, colorbar=False)
    data = _heat(ax).get_array()
    assert _heat(ax).get_clim() == (0.0, 1.0) and float(data.min()) == 0.0
    assert len(fig.axes) == 1
    plt.close(fig)
    fig, ax = plt.subplots()
    plot_overlay(ax, torch.rand(3, 56, 56), m, sign="positive", colorbar=False)
    assert float(_heat(ax).get_array().min()) > 0.5  # explicit Captum sign: no offset removal
    plt.close(fig)


def test_overlay_rejects_unknown_sign():
    fig, ax = plt.subplots()
    with pytest.raises(ValueError, match="sign must be one of"):
        plot_overlay(ax, torch.rand(1, 8, 8), torch.rand(4), sign="abs")
    plt.close(fig)


def test_grid_rows_per_image_and_wrapping_for_one_image(tmp_path):
    maps = {"a": torch.rand(2, 64), "b": torch.randn(2, 1, 8, 8), "c": torch.rand(2, 1, 56, 56)}
    fig = plot_grid(torch.rand(2, 1, 56, 56), maps, row_titles=["x", "y"])
    titles = [ax.get_title() for ax in fig.axes]
    assert titles.count("a") == 2 and "x" in titles and "y" in titles
    assert fig.axes[0].get_gridspec().get_geometry() == (2, 4)
    plt.close(fig)
    one = {k: v[:1] for k, v in maps.items()}
    path = tmp_path / "g.png"
    fig = plot_grid(torch.rand(1, 1, 56, 56), one, max_cols=2, path=str(path))
    assert fig.axes[0].get_gridspec().get_geometry() == (2, 2)
    assert path.read_bytes()[:4] == b"\x89PNG"


# -- issue "One adapter, one registry, thin commands" ------------------------------------------
def test_upsample_map_token_map_on_a_non_square_grid():
    grid = torch.rand(8, 4)  # 8 rows, 4 columns of patches of a 56 x 28 image
    up = upsample_map(grid.flatten(), (56, 28))
    assert up.shape == (56, 28)
    torch.testing.assert_close(up, grid.repeat_interleave(7, 0).repeat_interleave(7, 1))
    wide = torch.rand(4, 8)
    torch.testing.assert_close(upsample_map(wide.flatten(), (28, 56)),
                               wide.repeat_interleave(7, 0).repeat_interleave(7, 1))
    # the grid can be given; a wrong one is refused
    torch.testing.assert_close(upsample_map(wide.flatten(), (28, 56), grid=(4, 8)),
                               upsample_map(wide.flatten(), (28, 56)))
    with pytest.raises(ValueError, match="grid"):
        upsample_map(wide.flatten(), (28, 56), grid=(5, 8))


def test_upsample_map_draws_patch_constant_maps_by_default():
    grid = torch.rand(8, 8)
    nearest = grid.repeat_interleave(7, 0).repeat_interleave(7, 1)
    for m in (grid, grid.flatten(), grid[None]):
        torch.testing.assert_close(upsample_map(m, (56, 56)), nearest)
        torch.testing.assert_close(upsample_map(m, (56, 56), display="nearest"), nearest)
    with pytest.raises(ValueError, match="display"):
        upsample_map(grid, (56, 56), display="cubic")


def test_overlay_and_grid_take_display_and_label_the_colour_bar():
    m = torch.rand(8, 8)
    for display in ("nearest", "bilinear"):
        fig, ax = plt.subplots()
        plot_overlay(ax, torch.rand(1, 56, 56), m, display=display)
        data = torch.as_tensor(_heat(ax).get_array())
        blocks = data.reshape(8, 7, 8, 7)
        constant = bool((blocks == blocks[:, :1, :, :1]).all())
        assert constant == (display == "nearest")
        bar = fig.axes[1]
        assert "normalised per panel" in (bar.get_xlabel() + bar.get_ylabel())
        plt.close(fig)
    fig = plot_grid(torch.rand(1, 1, 56, 56), {"a": m[None]}, display="bilinear")
    assert any("normalised per panel" in a.get_xlabel() + a.get_ylabel() for a in fig.axes)
    plt.close(fig)
