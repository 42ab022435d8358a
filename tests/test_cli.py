"""The ``captum-vit explain`` command and the README / CI contract."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from captum_vit import zoo
from captum_vit.cli import main

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif("vit_fmnist_loc" not in zoo.available(), reason="bundled model missing")
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
