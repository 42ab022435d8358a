"""``captum-vit evaluate``: files, determinism, torchrun equals one process, errors."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from captum_vit.cli import main
from captum_vit.commands.evaluate import SyntheticLoc, resolve_methods, resolve_metrics
from tests.metrics_toys import one_thread

__all__ = ["one_thread"]
ROOT = Path(__file__).resolve().parents[1]
BASE = ["evaluate", "--model", "random:vit_tiny", "--data", "synthetic", "--n", "5",
        "--batch-size", "2", "--methods", "gae,random", "--dtype", "float64"]
FILES = ("results.csv", "results.json", "results.md")


def _read(out: Path) -> dict[str, str]:
    return {f: (out / f).read_text() for f in FILES}


def test_evaluate_writes_table_csv_json_and_plots(tmp_path):
    out = tmp_path / "a"
    metrics = "perturbation,deletion,insertion,pointing_game,segmentation,sparseness"
    assert main(BASE + ["--metrics", metrics, "--out", str(out)]) == 0
    files = _read(out)
    md = files["results.md"].splitlines()
    assert md[2].startswith("| method | perturbation_pos ↓ | perturbation_neg ↑ |")
    assert "deletion ↓" in md[2] and "insertion ↑" in md[2] and "miou ↑" in md[2]
    assert "insertion_minus_deletion ↑" in md[2]
    assert md[4].startswith("| gae |") and md[5].startswith("| random |")
    data = json.loads(files["results.json"])
    assert data["config"]["n"] == 5 and data["config"]["methods"] == ["gae", "random"]
    dele = data["results"]["gae"]["deletion"]
    assert len(dele["per_example"]) == 5 and len(dele["mean_curve"]) == 21
    assert dele["value"] == pytest.approx(sum(dele["per_example"]) / 5)
    rows = files["results.csv"].splitlines()
    assert rows[0] == "method,metric,value,higher_is_better,n" and len(rows) > 10
    for name in ("deletion", "insertion", "perturbation_pos"):
        assert (out / f"curve_{name}.png").read_bytes()[:4] == b"\x89PNG"
    # deterministic for a seed; another seed gives other data
    assert main(BASE + ["--metrics", metrics, "--out", str(tmp_path / "b")]) == 0
    assert _read(tmp_path / "b") == files
    assert main(BASE + ["--metrics", metrics, "--seed", "1", "--out", str(tmp_path / "c")]) == 0
    assert _read(tmp_path / "c")["results.csv"] != files["results.csv"]


def test_evaluate_errors(tmp_path, capsys):
    out = ["--out", str(tmp_path / "x")]
    assert main(BASE + ["--metrics", "nope"] + out) == 2
    assert "unknown metric 'nope'" in capsys.readouterr().err
    assert main(BASE + ["--metrics", "deletion", "--removal", "white"] + out) == 2
    assert "unknown --removal 'white'" in capsys.readouterr().err
    assert main(BASE[:-4] + ["--methods", "bogus", "--metrics", "deletion"] + out) == 2
    assert "unknown method 'bogus'" in capsys.readouterr().err
    assert main(["evaluate", "--model", "bogus:x", "--data", "synthetic"] + out) == 2
    assert "unknown model" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["evaluate", "--model", "random:vit_tiny", "--data", f"folder:{empty}",
                 "--metrics", "deletion", "--methods", "gae"] + out) == 2
    assert "is empty" in capsys.readouterr().err
    assert main(BASE + ["--metrics", "deletion", "--n", "0"] + out) == 2
    assert "--n" in capsys.readouterr().err


def test_name_resolution_and_synthetic_data():
    assert resolve_metrics(["all"])[0] == "perturbation" and len(resolve_metrics(["all"])) == 11
    assert resolve_metrics(["aopc,lodds", "aopc"]) == ["aopc", "lodds"]
    assert "random" in resolve_methods(["all"])
    assert resolve_methods(["captum:Saliency"]) == ["captum:Saliency"]
    data = SyntheticLoc(4, 3, (32, 32), 10, seed=0)
    img, label, mask = data[2]
    img2, _, mask2 = SyntheticLoc(9, 3, (32, 32), 10, seed=0)[2]
    assert torch.equal(img, img2) and torch.equal(mask, mask2) and label == 2
    assert 0 < mask.float().mean() < 0.5


@pytest.mark.skipif(shutil.which("torchrun") is None and
                    not (Path(sys.executable).parent / "torchrun").exists(),
                    reason="torchrun not installed")
def test_torchrun_two_processes_equals_one(tmp_path):
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    args = [a.replace("--n", "--num-examples") if a == "--n" else a for a in BASE]
    args += ["--metrics", "deletion,token_ratio,pointing_game,max_sensitivity",
                   "--device", "cpu"]
    assert main(args + ["--out", str(tmp_path / "one")]) == 0
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [torchrun, "--standalone", "--nproc_per_node=2", "-m", "captum_vit.cli", *args,
           "--out", str(tmp_path / "two")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers only
        proc.communicate()
        raise
    assert proc.returncode == 0, err[-3000:]
    assert _read(tmp_path / "two") == _read(tmp_path / "one")


def test_file_model_spec(tmp_path):
    from safetensors.torch import save_file
    from timm.models.vision_transformer import VisionTransformer

    kwargs = dict(img_size=16, patch_size=8, in_chans=1, embed_dim=16, depth=1, num_heads=2,
                  num_classes=3)
    torch.manual_seed(0)
    model = VisionTransformer(**kwargs)
    save_file(model.state_dict(), str(tmp_path / "m.safetensors"))
    (tmp_path / "m.json").write_text(json.dumps({"kwargs": kwargs}))
    out = tmp_path / "o"
    assert main(["evaluate", "--model", f"file:{tmp_path / 'm.safetensors'}", "--data",
                 "synthetic", "--n", "2", "--methods", "rollout", "--metrics",
                 "deletion,sparseness", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())["results"]["rollout"]
    assert res["deletion"]["n"] == 2 and res["sparseness"]["n"] == 2


def test_each_warning_once_survives_filter_resets():
    """TIS's n_masks clamp warns on every call once anything resets the warning filters
    (as third-party code does between batches); the evaluate loop shows it once."""
    import warnings

    from captum_vit.commands.evaluate import each_warning_once
    from captum_vit.methods.tis import kmeans_masks

    feats = torch.rand(1, 4, 3)

    def two_batches() -> int:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("default")
            for _ in range(2):
                kmeans_masks(feats, 5, [0.5])
                with warnings.catch_warnings():  # a filter reset, as in third-party code
                    warnings.simplefilter("ignore", DeprecationWarning)
        return sum("n_masks=5" in str(w.message) for w in seen)

    assert two_batches() == 2  # the noise being fixed

    def two_batches_once() -> int:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("default")
            with each_warning_once():
                for _ in range(2):
                    kmeans_masks(feats, 5, [0.5])
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", DeprecationWarning)
        return sum("n_masks=5" in str(w.message) for w in seen)

    assert two_batches_once() == 1
