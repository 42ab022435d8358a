"""Evaluation presets (SPEC_NEXT §9.6): exact settings, the pixel engine against loops,
one end-to-end run per preset, refused options."""

from __future__ import annotations

import json
import math

import pytest
import torch

from captum_vit.cli import main
from captum_vit.commands.evaluate import protocol_factories
from captum_vit.methods import Rollout, TokenIxG
from captum_vit.metrics import deletion, perturbation_test
from captum_vit.metrics.protocols import (
    CHEFER_FRACTIONS,
    PROTOCOLS,
    TOKENTM_FRACTIONS,
    check_fixed_options,
    get_protocol,
    run_protocol,
)
from captum_vit.metrics.removal import image_space_zero, tis_baseline, upsample
from captum_vit.models import Preprocess
from captum_vit.registry import method_factory
from tests.helpers import make_inputs, make_model

NAMES = ("chefer21_perturbation", "tokentm_perturbation", "tokentm_aopc_lodds",
         "tokentm_segmentation", "tis_insdel", "skipplus_token_ratio", "skipplus_seg_ap")


def test_every_preset_of_the_spec_is_there_with_its_exact_settings():
    assert tuple(PROTOCOLS) == NAMES
    assert CHEFER_FRACTIONS == (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    assert TOKENTM_FRACTIONS == tuple(k / 20 for k in range(21)) and len(TOKENTM_FRACTIONS) == 21
    half = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    expected = {  # targets, metrics (with masks), normalisation, labels, masks
        "chefer21_perturbation": (("predicted", "label"), ["perturbation"], half, True, False),
        "tokentm_perturbation": (("predicted", "label"), ["perturbation"], None, True, False),
        "tokentm_aopc_lodds": (("predicted",), ["aopc", "lodds"], None, False, False),
        "tokentm_segmentation": (("predicted",), ["segmentation"], half, False, True),
        "tis_insdel": (("label",), ["insdel_mean", "insdel_blur", "insdel_black",
                                    "insdel_random", "pointing_game", "max_sensitivity"],
                       None, True, False),
        "skipplus_token_ratio": (("label",), ["token_ratio"], None, True, False),
        "skipplus_seg_ap": (("label",), ["raw_ap"], None, True, True),
    }
    for name, (targets, metrics, norm, labels, masks) in expected.items():
        p = get_protocol(name)
        assert (p.explain, p.metric_names(has_masks=True), p.normalization, p.needs_labels,
                p.needs_masks) == (targets, metrics, norm, labels, masks), name
    assert get_protocol("tis_insdel").metric_names(has_masks=False)[-1] == "max_sensitivity"
    assert "pointing_game" not in get_protocol("tis_insdel").metric_names(has_masks=False)
    assert get_protocol("tis_insdel").settings["n_steps"] == 224
    assert get_protocol("chefer21_perturbation").settings["fractions"] == CHEFER_FRACTIONS
    assert get_protocol("tokentm_aopc_lodds").settings["fractions"] == TOKENTM_FRACTIONS
    assert get_protocol("skipplus_token_ratio").settings["ratios"] == tuple(
        k / 10 for k in range(1, 10))
    for name in ("chefer21_perturbation", "tokentm_segmentation"):
        assert dict(get_protocol(name).method_options) == {"rollout": {"start_layer": 1},
                                                           "chefer21": {"start_layer": 1}}
    assert not get_protocol("tis_insdel").method_options
    model = make_model("vit")
    f = protocol_factories(get_protocol("chefer21_perturbation"), ["Rollout", "gae"])
    assert isinstance(f["Rollout"](model), Rollout) and f["Rollout"](model).start_layer == 1
    assert protocol_factories(get_protocol("tis_insdel"), ["rollout"])["rollout"](
        model).start_layer == 0
    own = Preprocess(3, (32, 32), (0.1,), (0.2,))
    assert get_protocol("tokentm_segmentation").preprocess(own) is own  # the model's by default
    pre = get_protocol("tokentm_segmentation").preprocess(own, normalization="paper")
    assert (pre.mean, pre.std) == half
    assert get_protocol("tis_insdel").preprocess(pre) is pre
    with pytest.raises(ValueError, match="unknown --protocol 'nope'"):
        get_protocol("nope")


def _loop_perturbation(model, x, maps, labels, fractions, mean, std, order):
    """Chefer's script as loops: topk pixels of the x-bilinear map (ties: lower index first),
    zeroed in [0, 1] space on every channel, renormalised; accuracy against the labels."""
    b, _, h, w = x.shape
    up = upsample(maps, (4, 4), (8, 8), (h, w)).reshape(b, -1)
    up = -up if order == "negative" else up
    m = torch.tensor(mean, dtype=x.dtype)[:, None, None]
    s = torch.tensor(std, dtype=x.dtype)[:, None, None]
    out = torch.zeros(b, len(fractions), dtype=torch.float64)
    for i in range(b):
        raw = x[i] * s + m  # back to [0, 1] image space
        rank = sorted(range(h * w), key=lambda u: (-float(up[i, u]), u))
        for k, f in enumerate(fractions):
            img = raw.clone().reshape(3, -1)
            img[:, rank[:int(h * w * f)]] = 0
            with torch.no_grad():
                logits = model(((img.reshape(3, h, w) - m) / s)[None])
            out[i, k] = float(logits.argmax() == labels[i])
    return out


def test_pixel_zeroing_perturbation_equals_loops():
    model, x = make_model("vit"), make_inputs("vit", 2)
    maps = TokenIxG(model).attribute(x, output="tokens")
    labels = torch.tensor([3, 1])
    mean, std = (0.5, 0.4, 0.3), (0.5, 0.6, 0.7)
    for order in ("positive", "negative"):
        res = perturbation_test(model, x, maps, order=order, labels=labels,
                                fractions=CHEFER_FRACTIONS, removal=image_space_zero(mean, std),
                                unit="pixel", rounding="floor", forward_batch=7)
        ref = _loop_perturbation(model, x, maps, labels, CHEFER_FRACTIONS, mean, std, order)
        assert torch.equal(res.curves, ref)
        xs = torch.tensor(CHEFER_FRACTIONS, dtype=torch.float64)
        auc = 100 * ((ref[:, 1:] + ref[:, :-1]) * (xs[1:] - xs[:-1])).sum(1) / 2
        torch.testing.assert_close(res.per_example, auc)


def test_tis_deletion_without_start_point_equals_loops():
    model, x = make_model("vit"), make_inputs("vit", 2)
    maps = TokenIxG(model).attribute(x, output="tokens")
    n_steps, (h, w) = 224, x.shape[-2:]
    res = deletion(model, x, maps, removal=tis_baseline("mean"), unit="pixel",
                   n_steps=n_steps, start_point=False, forward_batch=64, target=[0, 1])
    assert res.curves.shape == (2, n_steps)
    torch.testing.assert_close(res.x, torch.arange(1, 225, dtype=torch.float64) / 224)
    per_step = math.ceil(h * w / n_steps)  # 5 pixels of 1024
    up = upsample(maps, (4, 4), (8, 8), (h, w)).reshape(2, -1)
    for i in range(2):
        rank = sorted(range(h * w), key=lambda u: (-float(up[i, u]), u))
        fill = x[i].mean()  # TIS's mean baseline: one scalar of the normalised image
        for s in (1, 57, 204, 205, 224):  # 204 * 5 = 1020 < 1024 <= 205 * 5
            img = x[i].clone().reshape(3, -1)
            img[:, rank[:min(s * per_step, h * w)]] = fill
            with torch.no_grad():
                p = model(img.reshape(1, 3, h, w)).softmax(-1)[0, i]
            torch.testing.assert_close(res.curves[i, s - 1], p, rtol=1e-12, atol=1e-12)
    fills = tis_baseline("random")(x, [5, 6])
    assert (fills >= 0).all() and (fills < 1).all()
    assert torch.equal(fills, tis_baseline("random")(x, [5, 6]))
    assert torch.equal(tis_baseline("black")(x, [0, 0]), torch.zeros_like(x))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.long
def test_each_preset_runs_end_to_end_and_writes_the_seed_table(tmp_path, name, capsys):
    out = tmp_path / name
    argv = ["evaluate", "--model", "random:vit_tiny", "--data", "synthetic", "--n", "3",
            "--batch-size", "3", "--methods", "rollout,random", "--dtype", "float64",
            "--protocol", name, "--out", str(out)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert f"--protocol {name}:" in err and "explained class:" in err
    p = get_protocol(name)
    md = (out / "protocol.md").read_text().splitlines()
    assert md[0] == f"# {p.source}"
    assert md[4] == "| method | " + " | ".join(c.header for c in p.columns) + " |"
    rows = [r for r in md if r.startswith("| rollout |") or r.startswith("| random |")]
    assert len(rows) == 2 and all(r.count("|") == len(p.columns) + 2 for r in rows)
    assert all("|  |" not in r for r in rows)  # every column filled
    data = json.loads((out / "results.json").read_text())
    assert data["config"]["protocol"] == name and data["config"]["n"] == 3
    cols = data["results"]["rollout"]
    assert all(len(c["per_example"]) == 3 for c in cols.values())
    if name == "chefer21_perturbation":
        assert set(cols) == {"perturbation_neg_predicted", "perturbation_pos_predicted",
                             "perturbation_neg_label", "perturbation_pos_label"}
        # the model's own normalisation (random:vit_tiny has none), not the paper's 0.5
        assert data["config"]["normalization"] == [None, None]
        assert data["config"]["protocol_normalization"] == "model"
        assert cols["perturbation_pos_label"]["x"] == list(CHEFER_FRACTIONS)
    if name == "tokentm_aopc_lodds":
        assert cols["aopc"]["x"] == list(TOKENTM_FRACTIONS)
    if name == "tis_insdel":
        assert len(cols["deletion_mean"]["mean_curve"]) == 224 and "pointing_game" in cols
    if name == "tokentm_segmentation":
        assert set(cols) == {"pixel_accuracy", "miou", "map", "mf1"}


def test_options_a_preset_fixes_are_refused(tmp_path, capsys):
    base = ["evaluate", "--model", "random:vit_tiny", "--data", "synthetic", "--n", "2",
            "--methods", "gae", "--out", str(tmp_path / "x")]
    assert main(base + ["--protocol", "tis_insdel", "--steps", "10"]) == 2
    assert "--protocol tis_insdel fixes --steps" in capsys.readouterr().err
    assert main(base + ["--protocol", "skipplus_token_ratio", "--metrics", "aopc",
                        "--removal", "black"]) == 2
    assert "fixes --metrics, --removal" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(base + ["--protocol", "nope"])
    check_fixed_options(get_protocol("tis_insdel"), {"steps": 20}, {"steps": 20})
    model = make_model("vit")
    with pytest.raises(ValueError, match="needs ground-truth masks"):
        run_protocol(get_protocol("skipplus_seg_ap"), model, [],
                     {"gae": method_factory("gae")}, preprocess=None, has_masks=False)
    with pytest.raises(TypeError, match="protocol_factories"):  # names: the caller's step
        run_protocol(get_protocol("tokentm_aopc_lodds"), model, [], ["gae"], preprocess=None)


def _loader_data(name, tmp_path):
    """The --data spec (and extra options) of the seed's data set for ``name``, written in
    its on-disk layout (tests/data_files.py); 10-class model classes via a map or names."""
    from tests import data_files as files

    cmap = tmp_path / "map.json"
    cmap.write_text(json.dumps({w: i for i, w in enumerate(files.WNIDS[:3])}
                               | {files.WNIDS[999]: 3}))
    if name == "tokentm_segmentation":
        pytest.importorskip("h5py")
        path = tmp_path / "gtsegs_ijcv.mat"
        files.write_gtsegs(path, [files.rgb(20, 24) for _ in range(3)],
                           [files.RNG.random((20, 24)) > 0.5 for _ in range(3)])
        return f"imagenet-seg:{path}", []
    if name in ("tokentm_perturbation", "tokentm_aopc_lodds"):
        folder, names = files.write_cifar10(tmp_path, 3)
        classes = tmp_path / "classes.txt"
        classes.write_text("\n".join(names))
        return f"cifar10:{folder}", ["--classes", str(classes)]
    if name == "skipplus_seg_ap":
        return f"imagenet-s:{files.write_imagenet_s(tmp_path)}", ["--class-map", str(cmap)]
    val, _ = files.flat_val(tmp_path)  # chefer21, tis_insdel (boxes), skipplus_token_ratio
    return f"imagenet-val:{val}", ["--class-map", str(cmap)]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.long
def test_each_preset_runs_on_its_seed_data_set_layout(tmp_path, name, capsys):
    data, extra = _loader_data(name, tmp_path)
    out = tmp_path / "out"
    argv = ["evaluate", "--model", "random:vit_tiny", "--data", data, "--n", "3",
            "--batch-size", "3", "--methods", "rollout", "--dtype", "float64",
            "--protocol", name, "--out", str(out), *extra]
    assert main(argv) == 0, capsys.readouterr().err
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["data"] == data and res["config"]["n"] == 3
    cols = res["results"]["rollout"]
    assert cols and all(len(c["per_example"]) == 3 for c in cols.values())
    if name == "tis_insdel":
        assert "pointing_game" in cols  # the VOC boxes are the masks
    assert (out / "protocol.md").read_text().startswith(f"# {get_protocol(name).source}")
