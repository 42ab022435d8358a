"""The ``captum-vit explain`` command and the README / CI contract."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from captum_vit import zoo
from captum_vit.cli import main

pytestmark = pytest.mark.lower_bounds  # also run against the oldest supported versions

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif("vit_fmnist_loc" not in zoo.available(), reason="bundled model missing")
@pytest.mark.long
def test_explain_with_no_arguments_writes_a_png(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["explain"]) == 0
    data = (tmp_path / "explain.png").read_bytes()
    assert data[:8] == PNG and len(data) > 10_000
    assert "methods" in capsys.readouterr().out


def test_explain_any_image_size_on_a_random_model(tmp_path):
    img = tmp_path / "photo.png"
    Image.fromarray((np.random.default_rng(0).random((50, 70, 3)) * 255).astype(np.uint8)).save(img)
    out = tmp_path / "maps.png"
    assert main(["explain", "--model", "random:vit_tiny", "--image", str(img),
                 "--methods", "gae,rollout,plus:ixg", "--target", "2", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG


@pytest.mark.parametrize("argv,message", [
    (["--methods", "nope"], "unknown method 'nope'"),
    (["--model", "bogus:thing"], "unknown model"),
    (["--model", "zoo:nope"], "unknown zoo model"),
    (["--model", "zoo:vit_fmnist_loc", "--pretrained"], "--pretrained applies to --model timm"),
    (["--image", "/does/not/exist.png"], "no such file"),
    (["--target", "99"], "--target must be in"),
])
def test_explain_bad_arguments_exit_nonzero(tmp_path, capsys, argv, message):
    base = ["explain", "--out", str(tmp_path / "x.png"), "--methods", "rollout",
            "--model", "random:vit_tiny"]
    assert main(base + argv) == 2
    assert message in capsys.readouterr().err


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    test_cmd = next(c for c in commands if "pytest" in c).split("&&")[-1].strip()
    assert test_cmd in (ROOT / ".ci" / "run").read_text()


TIMM_NAME = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"


@pytest.fixture
def empty_caches(tmp_path, monkeypatch):
    """Point the Hugging Face and torch hub caches at empty folders (nothing is cached)."""
    import huggingface_hub.constants as hf_constants
    import torch

    hf = tmp_path / "hf"
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(hf))
    old = torch.hub.get_dir()
    torch.hub.set_dir(str(tmp_path / "torch_hub"))
    yield hf
    torch.hub.set_dir(old)


def test_explain_timm_pretrained_without_cached_weights_says_so(tmp_path, empty_caches, capsys):
    argv = ["explain", "--model", f"timm:{TIMM_NAME}", "--pretrained", "--methods", "rollout",
            "--out", str(tmp_path / "x.png")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "not in the local cache" in err and str(empty_caches) in err and "drop" in err
    assert main(["explain", "--model", "timm:no_such_vit", "--out", str(tmp_path / "y.png")]) == 2
    assert "no_such_vit" in capsys.readouterr().err
    assert main(["explain", "--model", "random:vit_tiny", "--pretrained"]) == 2
    assert "timm:NAME and torchvision:NAME only" in capsys.readouterr().err


def test_explain_timm_pretrained_loads_the_cached_weights(tmp_path, empty_caches, capsys,
                                                         monkeypatch):
    """A Hugging Face cache entry (the layout hf_hub_download writes) is found and loaded
    offline; without --pretrained the same model name gets random weights."""
    import timm
    import torch
    from safetensors.torch import save_file

    from captum_vit.models import load_model

    torch.manual_seed(123)
    trained = timm.create_model(TIMM_NAME, pretrained=False).eval()
    repo = empty_caches / f"models--timm--{TIMM_NAME}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    snap = repo / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in trained.state_dict().items()},
              str(snap / "model.safetensors"))

    lm = load_model(f"timm:{TIMM_NAME}", seed=0, pretrained=True)
    for k, v in trained.state_dict().items():
        torch.testing.assert_close(lm.model.state_dict()[k], v, rtol=0, atol=0)
    assert not lm.model.training and not lm.random_weights
    assert lm.preprocess.mean is not None and lm.preprocess.size == (224, 224)
    random_model = load_model(f"timm:{TIMM_NAME}", seed=0)
    assert random_model.random_weights
    assert not torch.equal(random_model.model.head.weight, trained.head.weight)

    out = tmp_path / "maps.png"
    assert main(["explain", "--model", f"timm:{TIMM_NAME}", "--pretrained", "--methods",
                 "rollout", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG
    assert "random-weight" not in capsys.readouterr().err


needs_torchvision = pytest.mark.skipif(
    __import__("importlib").util.find_spec("torchvision") is None,
    reason="torchvision is not installed")


@needs_torchvision
def test_torchvision_spec_builds_the_model_with_random_weights():
    import torch
    import torchvision

    from captum_vit.adapters import TorchvisionViTAdapter, adapt
    from captum_vit.models import load_model

    lm = load_model("torchvision:vit_b_32", seed=3)
    assert isinstance(lm.model, torchvision.models.VisionTransformer)
    assert isinstance(adapt(lm.model), TorchvisionViTAdapter)
    assert lm.random_weights and lm.class_names is None and not lm.model.training
    assert lm.preprocess.size == (224, 224)
    assert lm.preprocess.mean == pytest.approx((0.485, 0.456, 0.406))
    again = load_model("torchvision:vit_b_32", seed=3)
    assert torch.equal(again.model.heads.head.weight, lm.model.heads.head.weight)
    with pytest.raises(ValueError, match="list_models"):
        load_model("torchvision:no_such_vit")


@needs_torchvision
def test_torchvision_pretrained_without_the_cached_file_names_the_path(tmp_path, empty_caches,
                                                                       capsys):
    import torch

    argv = ["explain", "--model", "torchvision:vit_b_32", "--pretrained", "--methods",
            "rollout", "--out", str(tmp_path / "x.png")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    path = Path(torch.hub.get_dir()) / "checkpoints" / "vit_b_32-d86f8d99.pth"
    assert str(path) in err and "download.pytorch.org" in err and "drop --pretrained" in err


@needs_torchvision
@pytest.mark.long
def test_explain_torchvision_pretrained_loads_the_cached_weights(tmp_path, capsys, monkeypatch):
    """A checkpoint in the torch hub cache (where torchvision's downloader puts it; here
    under a TORCH_HOME of the test) is loaded offline, with ImageNet's class names."""
    import torch
    import torchvision

    from captum_vit.models import cached_torchvision_weights, load_model

    monkeypatch.setattr(torch.hub, "_hub_dir", None)  # the folder follows TORCH_HOME
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    weights = torchvision.models.ViT_B_32_Weights.DEFAULT
    ckpt = tmp_path / "torch_home" / "hub" / "checkpoints" / Path(weights.url).name
    ckpt.parent.mkdir(parents=True)
    torch.manual_seed(123)
    trained = torchvision.models.vit_b_32().eval()
    torch.save(trained.state_dict(), ckpt)
    assert cached_torchvision_weights(weights) == str(ckpt)

    lm = load_model("torchvision:vit_b_32", pretrained=True)
    for k, v in trained.state_dict().items():
        torch.testing.assert_close(lm.model.state_dict()[k], v, rtol=0, atol=0)
    assert not lm.random_weights and lm.class_names == tuple(weights.meta["categories"])
    assert lm.class_names[0] == "tench"

    out = tmp_path / "maps.png"
    assert main(["explain", "--model", "torchvision:vit_b_32", "--pretrained", "--methods",
                 "rollout", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG
    assert "random-weight" not in capsys.readouterr().err


# -- issue "One adapter, one registry, thin commands" ------------------------------------------
@pytest.mark.skipif("vit_fmnist_loc" not in zoo.available(), reason="bundled model missing")
def test_explain_title_shows_the_prediction_and_the_explained_class(tmp_path, capsys):
    import torch

    from captum_vit.data import load_sample

    zm = zoo.load("vit_fmnist_loc")
    with torch.no_grad():
        probs = zm.model(zm.preprocess(load_sample()["images"][0])[None]).softmax(-1)[0]
    pred = int(probs.argmax())
    explained = (pred + 3) % 10
    out = tmp_path / "t.png"
    assert main(["explain", "--target", str(explained), "--methods", "rollout",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"predicted {zm.class_names[pred]} (p={probs[pred]:.2f})" in text
    assert f"explaining {zm.class_names[explained]} (p={probs[explained]:.2f})" in text


def test_explain_creates_the_folder_of_out_first(tmp_path, capsys):
    out = tmp_path / "new" / "deeper" / "maps.png"
    argv = ["explain", "--model", "random:vit_tiny", "--methods", "GAE,SkipPLUS(DecompX)"]
    assert main(argv + ["--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG
    blocker = tmp_path / "file"
    blocker.write_text("in the way")
    # the model spec is bad too: the --out error comes first, before any work
    bad = ["explain", "--model", "bogus:x", "--methods", "rollout"]
    assert main(bad + ["--out", str(blocker / "maps.png")]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and str(blocker) in err and "unknown model" not in err
    assert main(bad + ["--out", str(tmp_path)]) == 2  # an existing folder, not a file
    assert "--out" in capsys.readouterr().err


def test_explain_display_option(tmp_path, monkeypatch):
    import captum_vit.viz as viz

    seen = {}
    real = viz.plot_grid

    def spy(*args, **kwargs):
        seen["display"] = kwargs.get("display")
        return real(*args, **kwargs)

    monkeypatch.setattr(viz, "plot_grid", spy)
    argv = ["explain", "--model", "random:vit_tiny", "--methods", "rollout"]
    assert main(argv + ["--out", str(tmp_path / "a.png")]) == 0
    assert seen["display"] == "nearest"
    assert main(argv + ["--display", "bilinear", "--out", str(tmp_path / "b.png")]) == 0
    assert seen["display"] == "bilinear"
    with pytest.raises(SystemExit):
        main(argv + ["--display", "cubic"])


@pytest.mark.parametrize("kind", ["multilabel", "contrastive:1,0"])
def test_explain_target_kinds(tmp_path, capsys, kind):
    out = tmp_path / "k.png"
    assert main(["explain", "--model", "random:vit_tiny", "--methods", "gae,token_ixg",
                 "--target-kind", kind, "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG
    said = capsys.readouterr().out
    assert ("1 vs 0" in said) if kind.startswith("contrastive") else ("explaining" in said)


@pytest.mark.parametrize(("argv", "message"), [
    (["--target-kind", "contrastive:1"], "two classes"),
    (["--target-kind", "contrastive:1,1"], "with itself"),
    (["--target-kind", "contrastive:1,0", "--target", "1"], "drop --target"),
    (["--target-kind", "softmax"], "'class', 'multilabel' or 'contrastive:A,B'"),
])
def test_explain_target_kind_errors(tmp_path, capsys, argv, message):
    assert main(["explain", "--model", "random:vit_tiny", "--methods", "gae",
                 "--out", str(tmp_path / "e.png"), *argv]) == 2
    assert message in capsys.readouterr().err
