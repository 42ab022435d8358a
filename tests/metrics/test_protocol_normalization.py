"""Evaluation presets feed the model its own normalisation unless the paper's is asked for:
the paper's ``Normalize(mean, std)`` belongs to the paper's model. The bundled 1-channel
model (mean 0.1, std 0.25) scores 84.4 % on the 128 shipped samples; under the paper's
``Normalize(0.5, 0.5)`` it scored 25.8 % and the presets reported AUCs without a word."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from captum_vit.cli import main
from captum_vit.data.specs import load_data, model_batch
from captum_vit.metrics import suite
from captum_vit.metrics.protocols import (
    NORMALIZATIONS,
    PROTOCOLS,
    ProtocolNormalizationWarning,
    get_protocol,
    run_protocol,
)
from captum_vit.models import Preprocess, load_model
from captum_vit.registry import method_factory

RANDOM = {"random": method_factory("random")}

PAPER_NORMALIZED = ("chefer21_perturbation", "tokentm_segmentation")


@pytest.fixture(scope="module")
def bundled():
    """The bundled model, the 128 shipped samples and their plain (model-normalised) batch."""
    lm = load_model("zoo:vit_fmnist_loc")
    data = load_data("sample", input_shape=lm.input_shape, num_classes=lm.num_classes,
                     class_names=lm.class_names)
    x, labels, _ = model_batch(data, range(len(data)), input_shape=lm.input_shape,
                               preprocess=lm.preprocess)
    return lm, data, x, labels


def _accuracy(model, x, labels) -> float:
    with torch.no_grad():
        return float((model(x).argmax(-1) == labels).double().mean())


@pytest.mark.parametrize("name", tuple(PROTOCOLS))
def test_every_preset_feeds_the_model_the_images_it_scores_plainly(bundled, name, tmp_path,
                                                                   monkeypatch, capsys):
    """The images a preset feeds the model before any removal are the plain ones (same
    tensors, same accuracy: 108 of 128), for every preset, from the command and from
    Python."""
    lm, data, plain, labels = bundled
    assert _accuracy(lm.model, plain, labels) == pytest.approx(108 / 128)
    fed: list[torch.Tensor] = []

    def record(model, inputs, method, metrics, **kw):  # the batch, before any metric
        fed.append(inputs.detach().clone())
        return {}

    monkeypatch.setattr(suite, "evaluate_batch", record)
    p = get_protocol(name)
    assert main(["evaluate", "--data", "sample", "--n", "128", "--batch-size", "64",
                 "--methods", "random", "--protocol", name, "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProtocolNormalizationWarning)
        run_protocol(p, lm.model, data, RANDOM, preprocess=lm.preprocess, batch_size=64,
                     has_masks=True)
    assert len(fed) == 2 * 2 * len(p.explain)  # 2 batches of 64 per pass, twice
    for k in range(2 * len(p.explain)):
        x = torch.cat(fed[2 * k:2 * k + 2])
        assert torch.equal(x, plain), name
        assert _accuracy(lm.model, x, labels) == pytest.approx(108 / 128), name


def test_chefer21_zero_removed_point_is_the_plain_accuracy(bundled, tmp_path, capsys):
    """The 0 %-removed point of every curve is the model's accuracy on the images (25 of
    the first 32), not that of the paper's normalisation on this model (9 of 32)."""
    out = tmp_path / "o"
    assert main(["evaluate", "--data", "sample", "--n", "32", "--batch-size", "32",
                 "--methods", "random", "--protocol", "chefer21_perturbation",
                 "--out", str(out)]) == 0
    captured = capsys.readouterr()
    lm, _, plain, labels = bundled
    assert _accuracy(lm.model, plain[:32], labels[:32]) == pytest.approx(25 / 32)
    data = json.loads((out / "results.json").read_text())
    cols = data["results"]["random"]
    assert set(cols) == {f"perturbation_{o}_{t}" for o in ("neg", "pos")
                         for t in ("predicted", "label")}
    for c in cols.values():
        assert c["mean_curve"][0] == pytest.approx(25 / 32)
    assert data["config"]["normalization"] == [[0.1], [0.25]]
    assert data["config"]["protocol_normalization"] == "model"
    # the terminal table: the paper's columns and the time per image
    lines = captured.out.splitlines()
    assert lines[0].split()[0] == "method" and "Target Positive AUC ↓" in lines[0]
    assert lines[0].endswith("s/image") and lines[2].startswith("random ")


@pytest.mark.parametrize("name", PAPER_NORMALIZED)
def test_a_three_channel_paper_normalisation_is_refused_on_a_one_channel_model(
        bundled, name, tmp_path, capsys):
    lm = bundled[0]
    p = get_protocol(name)
    with pytest.raises(ValueError, match=r"--protocol-normalization paper.*3-channel inputs, "
                                         r"but the model takes 1-channel inputs; drop"):
        p.preprocess(lm.preprocess, normalization="paper")
    with pytest.raises(ValueError, match="1-channel"):
        run_protocol(p, lm.model, bundled[1], RANDOM, preprocess=lm.preprocess,
                     has_masks=True, normalization="paper")
    out = tmp_path / "o"
    assert main(["evaluate", "--data", "sample", "--n", "2", "--methods", "random",
                 "--protocol", name, "--protocol-normalization", "paper",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "error: --protocol " + name + " --protocol-normalization paper" in err
    assert "model's own normalisation (mean 0.1, std 0.25)" in err
    assert not (out / "results.json").exists()
    # the model's own (the default) is accepted, and so is an unknown choice refused
    assert p.preprocess(lm.preprocess) is lm.preprocess
    with pytest.raises(ValueError, match="normalization must be one of 'model', 'paper'"):
        p.preprocess(lm.preprocess, normalization="imagenet")


def test_paper_normalisation_where_it_fits_and_presets_without_one():
    """'paper' applies the paper's mean/std to a 3-channel model; presets whose paper fixes
    no normalisation keep the model's own either way."""
    own = Preprocess(3, (32, 32), (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    assert NORMALIZATIONS == ("model", "paper")
    for name, p in PROTOCOLS.items():
        if name in PAPER_NORMALIZED:
            pre = p.preprocess(own, normalization="paper")
            assert (pre.mean, pre.std) == ((0.5,) * 3, (0.5,) * 3)
            assert (pre.channels, pre.size) == (3, (32, 32))
        else:
            assert p.preprocess(own, normalization="paper") is own, name
            assert p.normalization_warning(own, "paper") is None, name


def test_a_warning_says_when_the_paper_normalisation_differs(bundled, tmp_path, capsys,
                                                             monkeypatch):
    lm, data = bundled[:2]
    p = get_protocol("chefer21_perturbation")
    monkeypatch.setattr(suite, "evaluate_batch", lambda *a, **k: {})
    with pytest.warns(ProtocolNormalizationWarning, match="the paper normalised with mean "
                      r"\(0.5, 0.5, 0.5\).*model's own normalisation \(mean 0.1, std 0.25\)"):
        run_protocol(p, lm.model, data, RANDOM, preprocess=lm.preprocess, batch_size=64)
    # no warning when they agree, or when the paper fixes none
    half = Preprocess(3, (32, 32), (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    assert p.normalization_warning(half) is None
    assert p.normalization_warning(Preprocess(3, (32, 32), (0.5,), (0.5,)), "paper") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProtocolNormalizationWarning)
        run_protocol(get_protocol("tokentm_aopc_lodds"), lm.model, data, RANDOM,
                     preprocess=lm.preprocess, batch_size=64)
    # no normalisation at all (random:vit_tiny) differs from the paper's too; with 'paper'
    # the warning says the model gets inputs unlike its training data
    none = Preprocess(3, (32, 32))
    assert "none: inputs in [0, 1]" in p.normalization_warning(none)
    assert "normalised unlike its training data" in p.normalization_warning(none, "paper")
    monkeypatch.undo()

    # the command: on standard error and in protocol.md
    out = tmp_path / "o"
    assert main(["evaluate", "--data", "sample", "--n", "2", "--methods", "random",
                 "--protocol", "tokentm_segmentation", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "warning: --protocol tokentm_segmentation: the paper normalised with" in err
    assert "normalisation: the model's own (mean 0.1, std 0.25); the paper's: mean " in err
    md = (out / "protocol.md").read_text()
    assert "**Warning:** --protocol tokentm_segmentation: the paper normalised" in md
    assert "Normalisation: the model's own (mean 0.1, std 0.25)" in md
    config = json.loads((out / "results.json").read_text())["config"]
    assert "the paper normalised" in config["normalization_warning"]
    # a preset without a paper normalisation: no warning
    assert main(["evaluate", "--data", "sample", "--n", "2", "--methods", "random",
                 "--protocol", "skipplus_seg_ap", "--out", str(tmp_path / "p")]) == 0
    assert "warning:" not in capsys.readouterr().err
    assert "Warning" not in (tmp_path / "p" / "protocol.md").read_text()


def test_paper_option_on_a_three_channel_model_and_without_a_preset(tmp_path, capsys):
    out = tmp_path / "o"
    argv = ["evaluate", "--model", "random:vit_tiny", "--data", "synthetic", "--n", "2",
            "--methods", "random", "--protocol", "tokentm_segmentation",
            "--protocol-normalization", "paper", "--out", str(out)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "normalisation: the paper's (mean (0.5, 0.5, 0.5), std (0.5, 0.5, 0.5)" in err
    assert "warning:" in err and "normalised unlike its training data" in err
    config = json.loads((out / "results.json").read_text())["config"]
    assert config["normalization"] == [[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]
    assert config["protocol_normalization"] == "paper"
    assert main(["evaluate", "--model", "random:vit_tiny", "--data", "synthetic", "--n", "2",
                 "--methods", "random", "--metrics", "sparseness",
                 "--protocol-normalization", "paper", "--out", str(tmp_path / "p")]) == 2
    assert "--protocol-normalization applies to --protocol runs only" in capsys.readouterr().err
