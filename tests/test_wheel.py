"""The wheel a user installs works on its own: built from the source tree, installed into a
fresh venv without the editable checkout, it runs ``captum-vit explain`` on the bundled
model and sample image (so both are inside the wheel)."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_installs_and_explains_without_the_checkout(tmp_path):
    pytest.importorskip("setuptools")
    dist = tmp_path / "dist"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # build from a copy: setuptools writes build/ and *.egg-info beside the sources
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "docs", "tests",
        "tutorials", ".*_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(dist), str(src)], check=True, env=env, cwd=tmp_path,
                   capture_output=True)
    (wheel,) = dist.glob("captum_vit-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("captum_vit/zoo/") and n.endswith(".safetensors") for n in names)
    assert "captum_vit/data/sample.safetensors" in names
    assert "captum_vit/py.typed" in names

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    # the dependencies (torch, timm, captum, ...) from this interpreter's site-packages, added
    # as plain paths (their .pth files, among them the editable checkout's finder, are not run)
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], check=True, capture_output=True, text=True)
    own = Path(purelib.stdout.strip())
    (own / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", str(own), str(wheel)], check=True, env=env,
                   capture_output=True)
    where = subprocess.run([str(py), "-c", "import captum_vit; print(captum_vit.__file__)"],
                           check=True, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout
    out = tmp_path / "explain.png"
    run = subprocess.run([str(py), "-m", "captum_vit.cli", "explain", "--methods", "gae",
                          "--out", str(out)], capture_output=True, text=True,
                         env={**env, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"},
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
