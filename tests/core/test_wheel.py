"""The distributions a user installs work on their own: ``python -m build`` makes an sdist
and, from that sdist (as pip does from PyPI when no wheel fits), a wheel; the sdist holds
the bundled models, the sample data, ``py.typed``, the licence and the README, and the
wheel, installed into a fresh venv without the editable checkout, runs ``captum-vit
explain`` on the bundled model and sample image (so both are inside it)."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# what the package needs at run time besides its modules (pyproject's package-data)
DATA = ("captum_vit/py.typed", "captum_vit/data/sample.safetensors",
        "captum_vit/zoo/vit_fmnist_loc.safetensors", "captum_vit/zoo/vit_fmnist_loc.json")


def _build(tmp_path: Path, env: dict[str, str]) -> tuple[Path, Path]:
    """``python -m build`` of a copy of the source tree: the sdist, then the wheel built
    from the unpacked sdist (no build isolation: the build requirements of this venv)."""
    dist = tmp_path / "dist"
    # build from a copy: setuptools writes build/ and *.egg-info beside the sources
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", "docs", "tests",
        "tutorials", ".*_cache"))
    run = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir",
                          str(dist), str(src)], env=env, cwd=tmp_path, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "Building wheel from sdist" in run.stdout + run.stderr, run.stderr[-2000:]
    (sdist,) = dist.glob("captum_vit-*.tar.gz")
    (wheel,) = dist.glob("captum_vit-*.whl")
    return sdist, wheel


@pytest.mark.integration
def test_the_sdist_and_its_wheel_install_and_explain_without_the_checkout(tmp_path):
    pytest.importorskip("setuptools")
    pytest.importorskip("build")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    sdist, wheel = _build(tmp_path, env)

    with tarfile.open(sdist) as tar:
        top = sdist.name[:-len(".tar.gz")]
        in_sdist = {name.removeprefix(top + "/") for name in tar.getnames()}
    missing = {*DATA, "LICENSE", "README.md", "pyproject.toml", "captum_vit/__init__.py",
               "captum_vit/cli.py"} - in_sdist
    assert not missing, f"not in the sdist: {sorted(missing)}"
    # every bundled model's weights travel with its card
    cards = {n for n in in_sdist if n.startswith("captum_vit/zoo/") and n.endswith(".json")}
    assert cards and {c[:-5] + ".safetensors" for c in cards} <= in_sdist

    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    assert not set(DATA) - in_wheel, f"not in the wheel: {sorted(set(DATA) - in_wheel)}"
    assert {c[:-5] + ".safetensors" for c in cards} <= in_wheel
    modules = {n for n in in_sdist if n.startswith("captum_vit/") and n.endswith(".py")}
    assert modules <= in_wheel, f"modules of the sdist not in its wheel: {modules - in_wheel}"

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
