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
from captum_vit.data.specs import SyntheticLoc
from captum_vit.metrics.suite import parse_metrics
from captum_vit.registry import parse_methods

ROOT = Path(__file__).resolve().parents[2]
BASE = ["evaluate", "--model", "random:vit_tiny", "--data", "synthetic", "--n", "5",
        "--batch-size", "2", "--methods", "gae,random", "--dtype", "float64"]
FILES = ("results.csv", "results.json", "results.md")


def _read(out: Path) -> dict[str, str]:
    """The result files without the measured time per image (wall-clock, never equal)."""
    files = {f: (out / f).read_text() for f in FILES}
    data = json.loads(files["results.json"])
    assert all(t > 0 for t in data.pop("seconds_per_image").values())
    files["results.json"] = json.dumps(data)
    files["results.md"] = files["results.md"].split("\n## Time per image")[0]
    return files


@pytest.mark.long
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
    with pytest.raises(SystemExit):  # argparse: --removal has choices
        main(BASE + ["--metrics", "deletion", "--removal", "white"] + out)
    assert "invalid choice: 'white'" in capsys.readouterr().err
    assert main(BASE[:-4] + ["--methods", "bogus", "--metrics", "deletion"] + out) == 2
    assert "unknown method 'bogus'" in capsys.readouterr().err
    assert main(["evaluate", "--model", "bogus:x", "--data", "synthetic"] + out) == 2
    assert "unknown model" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["evaluate", "--model", "random:vit_tiny", "--data", f"folder:{empty}",
                 "--metrics", "deletion", "--methods", "gae"] + out) == 2
    assert "is empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: --n is a positive int
        main(BASE + ["--metrics", "deletion", "--n", "0"] + out)
    assert "--n" in capsys.readouterr().err


def test_name_resolution_and_synthetic_data():
    assert parse_metrics(["all"])[0] == "perturbation" and len(parse_metrics(["all"])) == 12
    assert parse_metrics(["aopc,lodds", "aopc"]) == ["aopc", "lodds"]
    assert "pointing_game" not in parse_metrics("all", has_masks=False)
    with pytest.raises(ValueError, match="pointing_game need ground-truth masks"):
        parse_metrics("deletion,pointing_game", has_masks=False)
    assert "random" in parse_methods(["all"])
    assert parse_methods(["captum:Saliency"]) == ["captum:Saliency"]
    data = SyntheticLoc(4, 3, (32, 32), 10, seed=0)
    img, label, mask = data[2]
    img2, _, mask2 = SyntheticLoc(9, 3, (32, 32), 10, seed=0)[2]
    assert torch.equal(img, img2) and torch.equal(mask, mask2) and label == 2
    assert 0 < mask.float().mean() < 0.5


@pytest.mark.integration
@pytest.mark.skipif(shutil.which("torchrun") is None and
                    not (Path(sys.executable).parent / "torchrun").exists(),
                    reason="torchrun not installed")
def test_torchrun_two_processes_equals_one(tmp_path):
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    args = [a.replace("--n", "--num-examples") if a == "--n" else a for a in BASE]
    args += ["--metrics", "deletion,token_ratio,pointing_game,max_sensitivity",
                   "--device", "cpu"]
    # Both runs on one thread each: the files hold 4 significant digits, and a value near a
    # rounding boundary can print differently when another thread count picks other kernels.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(args + ["--out", str(tmp_path / "one")]) == 0
    finally:
        torch.set_num_threads(threads)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [torchrun, "--standalone", "--nproc_per_node=2", "-m", "captum_vit.cli", *args,
           "--out", str(tmp_path / "two")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=1800)  # a hang guard, not a speed check
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

    from captum_vit.methods.tis import kmeans_masks
    from captum_vit.metrics.suite import each_warning_once

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


# -- issue "One adapter, one registry, thin commands" ------------------------------------------
def test_evaluate_takes_every_registry_spelling(tmp_path):
    out = tmp_path / "o"
    argv = ["evaluate", "--model", "random:vit_tiny", "--data", "synthetic", "--n", "2",
            "--methods", "GAE", "skipplus:decompx", "--metrics", "sparseness", "--out", str(out)]
    assert main(argv) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["config"]["methods"] == ["gae", "skipplus:decompx"]
    assert set(data["results"]) == {"gae", "skipplus:decompx"}


def test_no_two_columns_of_an_evaluation_are_the_same_metric(tmp_path):
    out = tmp_path / "o"
    assert main(BASE[:-4] + ["--methods", "gae", "--metrics",
                             "aopc,lodds,token_ratio,deletion,insertion", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())["results"]["gae"]
    cols = list(res)
    assert "token_ratio_remove_aopc" not in cols and "token_ratio_remove_lodds" not in cols
    assert {"aopc", "lodds", "token_ratio_keep_aopc", "token_ratio_remove_accuracy"} <= set(cols)
    for i, a in enumerate(cols):
        for b in cols[i + 1:]:
            same = (res[a]["per_example"] == res[b]["per_example"]
                    and res[a]["mean_curve"] == res[b]["mean_curve"])
            assert not same, f"{a} and {b} are the same metric"
    md = (out / "results.md").read_text().splitlines()[2].split("|")
    header = [c.strip().split(" ")[0] for c in md if c.strip()]
    assert len(header) == len(set(header))


def test_evaluate_checks_out_before_any_work(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("in the way")
    # the model spec is bad too: the --out error must come first (nothing loaded or computed)
    argv = ["evaluate", "--model", "bogus:x", "--data", "synthetic", "--methods", "gae",
            "--metrics", "deletion"]
    assert main(argv + ["--out", str(blocker / "sub")]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and str(blocker) in err and "unknown model" not in err
    assert main(argv + ["--out", str(blocker)]) == 2
    assert "--out" in capsys.readouterr().err
    # a missing folder is created before the work starts (and holds the results after)
    deep = tmp_path / "a" / "b" / "c"
    assert main(argv + ["--out", str(deep)]) == 2
    assert deep.is_dir() and "unknown model" in capsys.readouterr().err


def _garment_folder(root: Path, folders: dict[str, int], per_class: int = 2) -> list[int]:
    """PNGs of correctly classified sample garments of class ``folders[name]`` under
    ``root/name``; returns the labels in file order."""
    import numpy as np
    from PIL import Image

    from captum_vit import zoo
    from captum_vit.data import load_sample

    s, zm = load_sample(), zoo.load("vit_fmnist_loc")
    with torch.no_grad():
        pred = zm.model(torch.stack([zm.preprocess(im) for im in s["images"]])).argmax(-1)
    for name, label in folders.items():
        (root / name).mkdir(parents=True)
        idx = [i for i in range(len(pred)) if s["labels"][i] == label == pred[i]][:per_class]
        for i in idx:
            arr = (s["images"][i, 0] * 255).round().to(torch.uint8).numpy()
            Image.fromarray(np.asarray(arr)).save(root / name / f"{i:03d}.png")
    return sorted(folders.values())


def test_folder_labels_are_matched_to_the_models_class_names(tmp_path, capsys):
    """Folder names are class names (case and punctuation ignored), not alphabetical
    indices: every image here is classified correctly, so with the right labels the
    accuracy before any removal is 100% (the alphabetical index gave 0%)."""
    root = tmp_path / "garments"
    _garment_folder(root, {"t-shirt_top": 0, "DRESS": 3})
    out = tmp_path / "o"
    argv = ["evaluate", "--model", "zoo:vit_fmnist_loc", "--data", f"folder:{root}", "--n", "4",
            "--methods", "rollout", "--metrics", "perturbation", "--target", "label"]
    assert main(argv + ["--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())["results"]["rollout"]
    assert res["perturbation_pos"]["mean_curve"][0] == 1.0
    (root / "spaceship").mkdir()
    moved = sorted((root / "DRESS").iterdir())[0]
    moved.rename(root / "spaceship" / moved.name)
    assert main(argv + ["--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert "spaceship" in err and "T-shirt/top" in err


def test_folder_labels_need_class_names(tmp_path, capsys):
    import numpy as np
    from PIL import Image

    root = tmp_path / "imgs"
    for name in ("cat", "dog"):
        (root / name).mkdir(parents=True)
        Image.fromarray(np.zeros((40, 30, 3), np.uint8)).save(root / name / "a.png")
    argv = ["evaluate", "--model", "random:vit_tiny", "--data", f"folder:{root}",
            "--methods", "rollout", "--metrics", "sparseness", "--target", "label"]
    assert main(argv + ["--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--classes" in err and "--target predicted" in err
    assert not (tmp_path / "o" / "results.json").exists()
    classes = tmp_path / "classes.txt"
    classes.write_text("\n".join(["Dog", "bird", "CAT"] + [f"c{i}" for i in range(7)]) + "\n")
    assert main(argv + ["--classes", str(classes), "--out", str(tmp_path / "o")]) == 0
    assert main(argv[:-2] + ["--out", str(tmp_path / "q")]) == 0  # --target predicted


def test_evaluate_target_kinds(tmp_path, capsys):
    """multilabel: sigmoid probabilities (no accuracy); contrastive: the same contrast in
    every image, recorded in the config."""
    for kind in ("multilabel", "contrastive:2,0"):
        out = tmp_path / kind.replace(":", "_")
        assert main([*BASE, "--metrics", "deletion", "--target-kind", kind,
                     "--out", str(out)]) == 0
        data = json.loads((out / "results.json").read_text())
        assert data["config"]["target_kind"] == kind
        assert len(data["results"]["gae"]["deletion"]["per_example"]) == 5
    assert main([*BASE, "--target-kind", "contrastive:2,0", "--target", "label",
                 "--out", str(tmp_path / "x")]) == 2
    assert "drop --target label" in capsys.readouterr().err
