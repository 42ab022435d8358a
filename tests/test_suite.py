"""captum_vit.metrics.suite (the metric table, per-batch evaluation) and .report."""

from __future__ import annotations

import pytest
import torch

from captum_vit.data.specs import load_data, model_batch
from captum_vit.metrics import report, suite
from captum_vit.models import load_model
from captum_vit.registry import method_factory


@pytest.fixture(scope="module")
def batch():
    lm = load_model("random:vit_tiny", seed=0)
    model = lm.model.double()
    data = load_data("synthetic", n=3, input_shape=lm.input_shape, num_classes=lm.num_classes)
    x, labels, masks = model_batch(data, range(3), input_shape=lm.input_shape,
                                   dtype=torch.float64)
    return model, x, labels, masks


def test_table_rows_and_flags():
    assert list(suite.METRICS) == [
        "perturbation", "aopc", "lodds", "deletion", "insertion", "token_ratio", "saco",
        "pointing_game", "segmentation", "max_sensitivity", "sparseness", "randomization"]
    assert {m for m, s in suite.METRICS.items() if s.needs_masks} == {"pointing_game",
                                                                     "segmentation"}
    assert {m for m, s in suite.METRICS.items() if s.needs_callable} == {"max_sensitivity",
                                                                        "randomization"}
    assert suite.available_metrics(masks=False) == [
        m for m in suite.METRICS if m not in ("pointing_game", "segmentation")]
    with pytest.raises(ValueError, match="unknown metric 'auc'"):
        suite.parse_metrics("deletion, auc")
    with pytest.raises(ValueError, match="empty"):
        suite.parse_metrics([" , "])


def test_evaluate_batch_reads_the_table(batch):
    model, x, labels, masks = batch
    gae = method_factory("gae")
    cols = suite.evaluate_batch(model, x, gae, ["insertion", "pointing_game", "deletion"],
                                masks=masks, n_steps=4)
    assert list(cols) == ["insertion", "insertion_minus_deletion", "pointing_game", "deletion"]
    torch.testing.assert_close(cols["insertion_minus_deletion"].per_example,
                               cols["insertion"].per_example - cols["deletion"].per_example)
    assert all(r.per_example.device.type == "cpu" and len(r) == 3 for r in cols.values())
    # only-callable metrics need no maps; the factory reaches randomization
    rnd = suite.evaluate_batch(model, x, method_factory("random", seed=1), ["randomization"])
    assert set(rnd) == {"randomization"}
    with pytest.raises(ValueError, match="need ground-truth masks"):
        suite.evaluate_batch(model, x, gae, ["segmentation"])
    with pytest.raises(ValueError, match="target='label' needs a label"):
        suite.evaluate_batch(model, x, gae, ["sparseness"], target="label")
    with pytest.raises(ValueError, match="target must be one of"):
        suite.evaluate_batch(model, x, gae, ["sparseness"], target="labels")


def test_evaluate_over_a_data_set_equals_its_batches(batch):
    model, x, labels, masks = batch
    lm = load_model("random:vit_tiny", seed=0)
    data = load_data("synthetic", n=3, input_shape=lm.input_shape, num_classes=lm.num_classes)
    res = suite.evaluate(model, data, {"gae": method_factory("gae")}, ["sparseness", "deletion"],
                         batch_size=2, n_steps=4)
    one = suite.evaluate_batch(model, x, method_factory("gae"), ["sparseness", "deletion"],
                               n_steps=4, batch_size=8)
    for c in ("sparseness", "deletion"):
        torch.testing.assert_close(res["gae"][c].per_example, one[c].per_example)
    with pytest.raises(ValueError, match="removal must be one of"):
        suite.evaluate(model, data, {"gae": method_factory("gae")}, ["deletion"],
                       removal="white")
    with pytest.raises(TypeError, match="method_factory"):  # names go through the registry
        suite.evaluate(model, data, ["gae"], ["deletion"])


def test_output_locations_fail_early(tmp_path):
    assert report.ensure_folder(tmp_path / "a" / "b").is_dir()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=r"--out .*file is a file, not a folder"):
        report.ensure_folder(blocker / "sub")
    with pytest.raises(ValueError, match="is a folder"):
        report.ensure_file_location(tmp_path)
    with pytest.raises(ValueError, match="cannot write a .foo file"):
        report.ensure_file_location(tmp_path / "x.foo", formats=("png", "pdf"))
    assert report.ensure_file_location(tmp_path / "n" / "x.png").parent.is_dir()
