"""``viz.plot_video`` and ``viz.video_sheet``: which map each frame shows (tubelets spanning
their frames, frames in no tubelet, pixel maps, batches, several methods), the shared colour
scale, the files written, clear errors, and the docstring examples."""

from __future__ import annotations

import doctest

import matplotlib
import numpy as np
import pytest
import torch

from captum_vit import viz
from captum_vit.viz import frame_slices, plot_video, upsample_map, video_sheet

matplotlib.use("Agg")


@pytest.fixture(autouse=True)
def _close_figures():
    import matplotlib.pyplot as plt

    yield
    plt.close("all")


def overlay(fig, row: int, frames: int, k: int):
    """The map image drawn on frame ``k`` of sheet row ``row`` (``None``: frame alone)."""
    images = fig.axes[row * frames + k].images
    return images[1] if len(images) > 1 else None


def test_frame_slices_span_each_tubelets_frames():
    assert frame_slices(4, 4) == [0, 1, 2, 3]
    assert frame_slices(8, 4) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert frame_slices(6, 3) == [0, 0, 1, 1, 2, 2]
    assert frame_slices(5, 2) == [0, 0, 1, 1, None]  # a stride-2 tubelet drops frame 5
    assert frame_slices(3, 1) == [0, 0, 0]
    with pytest.raises(ValueError, match="between 1 and 4 slices"):
        frame_slices(4, 5)


def test_sheet_shows_each_tubelets_map_on_its_frames():
    video = torch.rand(5, 3, 16, 16)
    grid = torch.arange(8.0).reshape(1, 2, 2, 2)  # [1, F=2, gh, gw]: tubelets of 2 frames
    fig = video_sheet(video, grid)
    for k, s in enumerate([0, 0, 1, 1]):
        drawn = overlay(fig, 1, 5, k).get_array()
        expected = upsample_map(grid[0, s], (16, 16)).numpy()
        np.testing.assert_array_equal(np.asarray(drawn), expected)
        assert fig.axes[k].get_title() == f"frame {k + 1}\ntubelet {s + 1}"
    assert overlay(fig, 1, 5, 4) is None  # frame 5 is in no tubelet
    assert "no tubelet" in [t.get_text() for t in fig.axes[5 + 4].texts]
    # one colour scale for the row: the map's range over all its tubelets
    assert {overlay(fig, 1, 5, k).get_clim() for k in range(4)} == {(0.0, 7.0)}


def test_sheet_takes_pixel_maps_shaped_like_the_video():
    video = torch.rand(3, 3, 8, 8)
    pixels = torch.randn(3, 3, 8, 8)  # [T, C, H, W]: signed, averaged over channels
    fig = video_sheet(video, {"IxG": pixels})
    lim = float(pixels.mean(1).abs().max())
    for k in range(3):
        img = overlay(fig, 1, 3, k)
        np.testing.assert_allclose(np.asarray(img.get_array()), pixels[k].mean(0).numpy(),
                                   rtol=1e-6)
        assert img.get_clim() == pytest.approx((-lim, lim)) and img.get_cmap().name == "bwr"
        assert fig.axes[k].get_title() == f"frame {k + 1}"  # per-frame maps: no tubelet line
    assert fig.axes[3].get_ylabel() == "IxG"


def test_a_numerically_zero_map_is_drawn_flat_and_marked():
    video = torch.rand(2, 3, 8, 8)
    maps = {"real": torch.rand(1, 2, 2, 2), "flat": 1e-9 * torch.randn(1, 2, 2, 2)}
    fig = video_sheet(video, maps, reference=3.0)
    assert overlay(fig, 1, 2, 0) is not None and overlay(fig, 2, 2, 0) is None
    assert fig.axes[4].get_ylabel().startswith("flat\n≈ 0 (max ")
    assert [t.get_text() for t in fig.axes[4].texts] == ["≈ 0"]
    fig = video_sheet(video, maps, reference=3.0, near_zero_rtol=-1)  # the check off
    assert overlay(fig, 2, 2, 0) is not None and fig.axes[4].get_ylabel() == "flat"


def test_a_one_frame_videos_pixel_map_is_not_read_as_a_grid():
    video = torch.rand(1, 3, 8, 8)
    pixels = torch.rand(1, 3, 8, 8)  # [T=1, C, H, W] (once read as 3 tubelets of 8 x 8)
    fig = video_sheet(video, pixels)
    np.testing.assert_allclose(np.asarray(overlay(fig, 1, 1, 0).get_array()),
                               pixels[0].mean(0).numpy(), rtol=1e-6)


def test_sheet_of_a_batch_and_two_methods():
    videos = torch.rand(2, 4, 3, 8, 8)
    a = torch.rand(2, 1, 2, 2, 2)  # grids [B, 1, F, gh, gw]
    b = torch.rand(2, 4, 3, 8, 8)  # pixel maps [B, T, C, H, W]
    fig = video_sheet(videos, {"A": a, "B": b}, row_titles=["first", "second"])
    rows = [fig.axes[r * 4].get_ylabel() for r in range(6)]
    assert rows == ["first", "A", "B", "second", "A", "B"]
    for i in range(2):
        for k in range(4):
            np.testing.assert_array_equal(
                np.asarray(overlay(fig, 3 * i + 1, 4, k).get_array()),
                upsample_map(a[i, 0, k // 2], (8, 8)).numpy())
            np.testing.assert_allclose(np.asarray(overlay(fig, 3 * i + 2, 4, k).get_array()),
                                       b[i, k].mean(0).numpy(), rtol=1e-6)


def test_tubelet_maps_at_pixel_resolution():
    videos = torch.rand(2, 4, 3, 8, 8)
    maps = torch.rand(2, 1, 2, 8, 8)  # [B, 1, F, H, W]: a map per tubelet, on the pixels
    fig = video_sheet(videos, maps)
    for i in range(2):
        for k in range(4):
            np.testing.assert_array_equal(np.asarray(overlay(fig, 2 * i + 1, 4, k).get_array()),
                                          maps[i, 0, k // 2].numpy())


def test_a_batch_of_one_takes_batched_or_single_maps():
    video = torch.rand(1, 4, 3, 8, 8)
    grid = torch.rand(1, 1, 2, 2, 2)
    for maps in (grid, grid[0], grid[0, 0]):  # [1, 1, F, ..], [1, F, ..], [F, gh, gw]
        fig = video_sheet(video, maps)
        np.testing.assert_array_equal(np.asarray(overlay(fig, 1, 4, 3).get_array()),
                                      upsample_map(grid[0, 0, 1], (8, 8)).numpy())


def test_animation_frame_k_shows_frame_ks_map(tmp_path):
    videos = torch.rand(2, 4, 3, 8, 8)
    grid = torch.rand(2, 1, 2, 2, 2)
    anim = plot_video(videos, {"A": grid})
    fig = anim._fig
    anim._func(3)  # draw the fourth frame: the second tubelet
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(fig.axes[2 * i + 1].images[1].get_array()),
                                      upsample_map(grid[i, 0, 1], (8, 8)).numpy())
    assert fig._suptitle.get_text() == "frame 4/4"
    anim._draw_was_started = True  # drawn by hand: no "deleted without rendering" warning


def test_gif_of_a_batch_has_one_image_per_frame(tmp_path):
    from PIL import Image

    path = tmp_path / "clip.gif"
    plot_video(torch.rand(2, 4, 1, 8, 8), {"A": torch.rand(2, 1, 2, 2, 2),
                                          "B": torch.rand(2, 4, 1, 8, 8)},
               path=str(path), fps=5)
    with Image.open(path) as gif:
        assert gif.format == "GIF" and gif.n_frames == 4 and gif.info["duration"] == 200


def test_png_path_writes_the_contact_sheet(tmp_path):
    from matplotlib.figure import Figure

    path = tmp_path / "clip.png"
    fig = plot_video(torch.rand(4, 3, 8, 8), torch.rand(1, 2, 2, 2), path=str(path),
                     title="GAE", note="quick settings")
    assert isinstance(fig, Figure) and len(fig.axes) == 2 * 4 + 1  # + a colour bar
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("call,error,message", [
    (lambda: plot_video(torch.rand(4, 3, 8, 8), torch.rand(4, 3, 8, 8), path="x.avi"),
     ValueError, r"\.gif or \.mp4"),
    (lambda: plot_video(torch.rand(4, 3, 8, 8), torch.rand(3, 3, 8, 8)),
     ValueError, "one map per frame"),
    (lambda: plot_video(torch.rand(4, 3, 8, 8), torch.rand(1, 5, 2, 2)),
     ValueError, "one map per frame"),
    (lambda: plot_video(torch.rand(4, 3, 8, 8), torch.rand(4, 3, 8, 8), fps=0),
     ValueError, "fps"),
    (lambda: plot_video(torch.rand(3, 8, 8), torch.rand(3, 8, 8)),
     ValueError, r"one video \[T, C, H, W\]"),
    (lambda: plot_video(torch.rand(2, 4, 3, 8, 8), torch.rand(3, 1, 2, 2, 2)),
     ValueError, "batch of 2"),
    (lambda: plot_video(torch.rand(4, 3, 8, 8), {}), ValueError, "maps is empty"),
    (lambda: plot_video(torch.rand(4, 3, 8, 8), {"A": [1, 2]}), TypeError, r"maps\['A'\]"),
    (lambda: video_sheet(torch.rand(4, 3, 8, 8), torch.rand(1, 2, 2, 2), display="cubic"),
     ValueError, "display"),
    (lambda: video_sheet(torch.rand(4, 3, 8, 8), torch.rand(1, 2, 2, 2),
                         row_titles=["a", "b"]), ValueError, "row_titles"),
])
def test_bad_arguments_are_named(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("func", [viz.frame_slices, viz.video_sheet, viz.plot_video],
                         ids=lambda f: f.__name__)
def test_docstring_example_runs(func, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in doctest.DocTestFinder().find(func, globs={"torch": torch}):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted > 0 and result.failed == 0
