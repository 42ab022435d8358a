"""GPU and many processes: ``autocast="bf16"`` / ``--autocast bf16`` (tested with CPU autocast).

torchrun with 2 processes equals one process exactly (float64):
``tests/commands/test_evaluate.py::test_torchrun_two_processes_equals_one``.
"""

from __future__ import annotations

import json

import pytest
import torch

from captum_vit import GAE
from captum_vit.cli import main
from captum_vit.data.specs import load_data, model_batch
from captum_vit.metrics.suite import autocasting, evaluate
from captum_vit.models import load_model
from captum_vit.registry import method_factory

METRICS = ["deletion", "insertion", "token_ratio", "pointing_game", "segmentation",
           "sparseness"]


@pytest.fixture(scope="module")
def bundled():
    lm = load_model("zoo:vit_fmnist_loc")
    data = load_data("sample", n=8, input_shape=lm.input_shape, num_classes=lm.num_classes)
    return lm, data


def test_maps_under_bf16_autocast_are_float32_and_close(bundled):
    lm, data = bundled
    model = lm.model.float().eval()
    x, _, _ = model_batch(data, range(8), input_shape=lm.input_shape, preprocess=lm.preprocess)
    y = model(x).argmax(-1)
    ref = GAE(model).attribute(x, target=y, output="tokens")
    with autocasting(model, x, "bf16"):  # torch.autocast after a full-precision self-check
        assert model.head(x.new_ones(1, model.embed_dim)).dtype == torch.bfloat16  # in force
        out = GAE(model).attribute(x, target=y, output="tokens")
    assert out.dtype == torch.float32
    # bfloat16 keeps 8 significant bits (relative step 2^-8 = 0.4 %) through 4 blocks:
    # each image's map is within 5 % (relative L2) of float32's and has the same top patch
    rel = (out - ref).norm(dim=1) / ref.norm(dim=1)
    assert rel.max() < 0.05 and rel.max() > 0  # bf16 did run
    assert torch.equal(out.argmax(1), ref.argmax(1))


@pytest.mark.long
def test_evaluate_with_bf16_autocast_matches_float32_loosely(bundled):
    lm, data = bundled
    model = lm.model.float().eval()
    methods = {"gae": method_factory("gae")}
    kw = dict(preprocess=lm.preprocess, batch_size=4)
    full = evaluate(model, data, methods, METRICS, **kw)["gae"]
    half = evaluate(model, data, methods, METRICS, autocast="bf16", **kw)["gae"]
    assert list(half) == list(full)
    for col, res in half.items():
        assert res.per_example.dtype == full[col].per_example.dtype, col
        # probabilities and map values in bf16: dataset means within 0.01 (accuracies in
        # percent within one image of 8, i.e. 12.5)
        tol = 12.5 if "accuracy" in col else 0.01
        assert res.value == pytest.approx(full[col].value, abs=tol), col


def test_autocast_errors_name_the_fix(bundled):
    lm, data = bundled
    methods = {"gae": method_factory("gae")}
    with pytest.raises(ValueError, match=r"model\.float\(\)"):
        evaluate(lm.model.double(), data, methods, ["sparseness"], autocast="bf16")
    with pytest.raises(ValueError, match="autocast must be one of 'none', 'bf16'"):
        evaluate(lm.model.float(), data, methods, ["sparseness"], autocast="fp8")


def test_cli_autocast_option_is_recorded(tmp_path):
    out = tmp_path / "o"
    assert main(["evaluate", "--model", "random:vit_tiny", "--data", "synthetic", "--n", "2",
                 "--methods", "gae", "--metrics", "deletion,sparseness", "--device", "cpu",
                 "--autocast", "bf16", "--out", str(out)]) == 0
    config = json.loads((out / "results.json").read_text())["config"]
    assert config["autocast"] == "bf16" and config["dtype"] == "float32"
    with pytest.raises(SystemExit):
        main(["evaluate", "--autocast", "fp16", "--out", str(tmp_path / "x")])


def test_randomization_builds_its_model_copies_under_autocast(bundled):
    # the copies' adapters check themselves at full precision inside the autocast block
    lm, data = bundled
    model = lm.model.float().eval()
    out = evaluate(model, data, {"gae": method_factory("gae")}, ["randomization"],
                   preprocess=lm.preprocess, batch_size=8, autocast="bf16")["gae"]
    assert all(torch.isfinite(torch.as_tensor(r.value)) for r in out.values())
