"""``captum-vit explain --video``: a folder of frames or a tensor file explained by a video
model given as ``--model hf:FOLDER``; the contact sheet (and GIF) per video, the maps it
draws equal to the API's on the preprocessed frames, and clear errors.

The models are the catalogue's video examples (tag ``video``, a transformers class, saved
with ``save_pretrained``): a video family registered later takes part without a change
here; nothing names a family."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from captum_vit import GAE, Rollout
from captum_vit.adapters import adapt, catalog
from captum_vit.cli import main
from captum_vit.commands import videos as video_io

PNG = b"\x89PNG\r\n\x1a\n"


def video_examples() -> list[str]:
    """The contract suite's video examples of a transformers class with class targets."""
    return [name for name, fam, ex in catalog.examples()
            if "video" in fam.example_tags(name) and ex.suite and ex.target == "class"
            and ex.library == "transformers"]


VIDEO_EXAMPLES = video_examples()


@pytest.fixture(scope="module", params=VIDEO_EXAMPLES)
def saved(request, tmp_path_factory):
    """``(hf:FOLDER spec, model, (T, H, W))``: a tiny random video model saved with
    ``save_pretrained`` (float32, as the command reads its frames)."""
    pytest.importorskip("transformers")
    example = catalog.example(request.param)[1]
    model = example.model(seed=0, depth=2, dtype=torch.float32)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return f"hf:{folder}", model, tuple(example.size)


def write_frames(folder: Path, frames: np.ndarray, names=None) -> list[Path]:
    """Frames ``[T, H, W, 3]`` uint8 as PNG files in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    names = names or [f"frame{k}.png" for k in range(len(frames))]
    paths = [folder / n for n in names]
    for f, p in zip(frames, paths, strict=True):
        Image.fromarray(f).save(p)
    return paths


def random_frames(t: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (t, h, w, 3), dtype=np.uint8)


def test_video_examples_are_found():
    assert "hf_videomae" in VIDEO_EXAMPLES


def test_folder_of_frames_writes_a_sheet_and_a_gif(saved, tmp_path, capsys):
    spec, _, (t, h, w) = saved
    write_frames(tmp_path / "clip", random_frames(t, h + 5, w + 3))  # resized to the model's
    out = tmp_path / "figs" / "clip.png"
    assert main(["explain", "--model", spec, "--video", str(tmp_path / "clip"), "--methods",
                 "gae,rollout", "--animation", "gif", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG
    with Image.open(out.with_suffix(".gif")) as gif:
        assert gif.format == "GIF" and gif.n_frames == t
    said = capsys.readouterr().out
    assert f"wrote {out} and {out.with_suffix('.gif')}: 2 methods" in said


def test_the_sheet_draws_the_apis_maps_of_the_frames_in_order(saved, tmp_path, monkeypatch):
    """The folder's frames, in order of their names, normalised as the model's
    preprocessing says, give the maps the API gives; the sheet gets them and the frames."""
    spec, model, (t, h, w) = saved
    frames = random_frames(t, h, w, seed=3)
    write_frames(tmp_path / "clip", frames)
    drawn = {}

    def capture(video, maps, **kwargs):
        drawn.update(video=video, maps=maps, path=kwargs["path"])

    monkeypatch.setattr("captum_vit.viz.plot_video", capture)
    assert main(["explain", "--model", spec, "--video", str(tmp_path / "clip"), "--methods",
                 "rollout,gae", "--target", "1", "--out", str(tmp_path / "o.png")]) == 0
    pixels = torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 255  # [T, C, H, W]
    x = ((pixels - 0.5) / 0.5)[None]  # no processor saved: the command's 0.5 / 0.5
    torch.testing.assert_close(drawn["video"], pixels, rtol=0, atol=1e-6)
    for name, method in (("rollout", Rollout), ("gae", GAE)):
        want = method(model).attribute(x, target=1, output="grid")
        torch.testing.assert_close(drawn["maps"][name], want, rtol=1e-5, atol=1e-7)
    assert drawn["path"] == str(tmp_path / "o.png")


def test_a_batch_in_a_tensor_file_writes_one_sheet_per_video(saved, tmp_path, capsys):
    spec, _, (t, h, w) = saved
    torch.save((torch.rand(2, t, 3, h, w) * 255).to(torch.uint8), tmp_path / "clips.pt")
    assert main(["explain", "--model", spec, "--video", str(tmp_path / "clips.pt"),
                 "--methods", "rollout", "--out", str(tmp_path / "maps.png")]) == 0
    for i in range(2):
        assert (tmp_path / f"maps_{i}.png").read_bytes()[:8] == PNG
    assert not (tmp_path / "maps.png").exists()
    assert capsys.readouterr().out.count("wrote ") == 2


def run_error(argv: list[str], capsys) -> str:
    assert main(["explain", "--methods", "rollout"] + argv) == 2
    return capsys.readouterr().err


def test_a_folder_without_images_is_refused(saved, tmp_path, capsys):
    spec = saved[0]
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("no frames here")
    err = run_error(["--model", spec, "--video", str(tmp_path / "empty"),
                     "--out", str(tmp_path / "o.png")], capsys)
    assert "the folder has no image file" in err
    assert not (tmp_path / "o.png").exists()


def test_frames_of_different_sizes_are_refused(saved, tmp_path, capsys):
    spec, _, (t, h, w) = saved
    write_frames(tmp_path / "clip", random_frames(t, h, w))
    Image.fromarray(random_frames(1, h + 2, w)[0]).save(tmp_path / "clip" / "frame1.png")
    err = run_error(["--model", spec, "--video", str(tmp_path / "clip"),
                     "--out", str(tmp_path / "o.png")], capsys)
    assert f"frames of different sizes: frame1.png is {(h + 2, w)}" in err


def test_a_frame_count_the_model_cannot_take_names_the_count(saved, tmp_path, capsys):
    spec, model, (t, h, w) = saved
    if getattr(adapt(model), "num_frames", None) is None:
        pytest.skip("the model takes any number of frames")
    torch.save(torch.rand(t + 1, 3, h, w), tmp_path / "clip.pt")
    err = run_error(["--model", spec, "--video", str(tmp_path / "clip.pt"),
                     "--out", str(tmp_path / "o.png")], capsys)
    assert f"has {t + 1} frames but the model takes {t} frames" in err


def test_channels_before_frames_are_refused_with_the_permutation(saved, tmp_path, capsys):
    spec, _, (t, h, w) = saved
    torch.save(torch.rand(3, t, h, w), tmp_path / "clip.pt")  # [C, T, H, W]
    err = run_error(["--model", spec, "--video", str(tmp_path / "clip.pt"),
                     "--out", str(tmp_path / "o.png")], capsys)
    assert "looks like [C, T, H, W] (channels before frames)" in err
    assert "video.permute(1, 0, 2, 3)" in err


def test_an_image_given_to_a_video_model_is_refused(saved, tmp_path, capsys):
    spec, _, (t, h, w) = saved
    Image.fromarray(random_frames(1, h, w)[0]).save(tmp_path / "photo.png")
    err = run_error(["--model", spec, "--image", str(tmp_path / "photo.png"),
                     "--out", str(tmp_path / "o.png")], capsys)
    assert "takes videos [T, C, H, W]" in err and "--video" in err
    err = run_error(["--model", spec, "--out", str(tmp_path / "o.png")], capsys)
    assert "not the sample image" in err


def test_a_video_given_to_an_image_model_is_refused(tmp_path, capsys):
    torch.save(torch.rand(4, 3, 32, 32), tmp_path / "clip.pt")
    err = run_error(["--model", "random:vit_tiny", "--video", str(tmp_path / "clip.pt"),
                     "--out", str(tmp_path / "o.png")], capsys)
    assert "is a video, but the model takes images" in err
    err = run_error(["--model", "random:vit_tiny", "--image", str(tmp_path / "clip.pt"),
                     "--out", str(tmp_path / "o.png")], capsys)
    assert "pass a video with --video" in err


@pytest.mark.parametrize("argv,message", [
    (["--animation", "gif"], "--animation applies to --video"),
    (["--video", "x.pt", "--fps", "0"], "--fps must be > 0"),
    (["--video", "/does/not/exist.pt"], "no such file"),
    (["--video", "/does/not/exist"], "no such folder or file"),
])
def test_bad_video_options(tmp_path, capsys, argv, message):
    err = run_error(["--model", "random:vit_tiny", "--out", str(tmp_path / "o.png")] + argv,
                    capsys)
    assert message in err


def test_image_and_video_are_exclusive(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["explain", "--image", "a.png", "--video", "b.pt"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_frames_are_read_in_natural_order(tmp_path):
    frames = np.stack([np.full((4, 6, 3), 10 * k, np.uint8) for k in range(12)])
    write_frames(tmp_path, frames, names=[f"f{k}.png" for k in range(12)])
    (tmp_path / "readme.txt").write_text("ignored")
    video = video_io.read_frames(tmp_path)
    assert video.shape == (1, 12, 3, 4, 6)
    assert video[0, :, 0, 0, 0].mul(255).round().tolist() == [10.0 * k for k in range(12)]


@pytest.mark.parametrize("value,message", [
    ({"video": torch.rand(4, 3, 8, 8)}, "holds a dict"),
    (torch.rand(3, 8, 8), "shape (3, 8, 8)"),
    (torch.rand(4, 5, 8, 8), "5 channels"),
    (torch.randint(0, 9, (4, 3, 8, 8)), "torch.int64"),
])
def test_tensor_files_of_other_contents_are_refused(tmp_path, value, message):
    torch.save(value, tmp_path / "v.pt")
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(").replace(
            ")", r"\)")):
        video_io.read_video(tmp_path / "v.pt")


def test_uint8_and_float_tensors_read_alike(tmp_path):
    u = torch.randint(0, 256, (2, 4, 3, 8, 8), dtype=torch.uint8)
    torch.save(u, tmp_path / "u.pt")
    torch.save(u.double() / 255, tmp_path / "f.pt")
    torch.testing.assert_close(video_io.read_video(tmp_path / "u.pt"),
                               video_io.read_video(tmp_path / "f.pt"), rtol=0, atol=1e-7)


@pytest.mark.parametrize("func", [video_io.is_video_path, video_io.read_frames,
                                  video_io.read_video_tensor, video_io.read_video,
                                  video_io.video_inputs], ids=lambda f: f.__name__)
def test_docstring_example_runs(func, tmp_path, monkeypatch):
    import doctest

    monkeypatch.chdir(tmp_path)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in doctest.DocTestFinder().find(func, globs={"torch": torch}):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted > 0 and result.failed == 0
