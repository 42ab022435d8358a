"""captum_vit.metrics.suite (the metric table, per-batch evaluation, the settings) and
.report."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from captum_vit.data.specs import load_data, model_batch
from captum_vit.metrics import report, suite
from captum_vit.metrics.settings import EvalSettings
from captum_vit.metrics.table import BoundMethod, MetricBatch, MetricSpec
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
    with pytest.raises(ValueError, match="explain='label' .* needs a label"):
        suite.evaluate_batch(model, x, gae, ["sparseness"], explain="label")
    with pytest.raises(ValueError, match="explain must be one of"):
        suite.evaluate_batch(model, x, gae, ["sparseness"], explain="labels")
    with pytest.warns(DeprecationWarning, match="explain="), \
            pytest.raises(ValueError, match="needs a label"):  # the old keyword still works
        suite.evaluate_batch(model, x, gae, ["sparseness"], target="label")


def test_evaluate_over_a_data_set_equals_its_batches(batch):
    model, x, labels, masks = batch
    lm = load_model("random:vit_tiny", seed=0)
    data = load_data("synthetic", n=3, input_shape=lm.input_shape, num_classes=lm.num_classes)
    res = suite.evaluate(model, data, {"gae": method_factory("gae")}, ["sparseness", "deletion"],
                         batch_size=2, n_steps=4)
    one = suite.evaluate_batch(model, x, method_factory("gae"), ["sparseness", "deletion"],
                               n_steps=4, forward_batch=8)
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


def test_settings_are_one_frozen_object_with_the_old_forward_batch():
    """``EvalSettings``: one meaning per name; the removal engine's jobs per forward are
    ``forward_batch``, by default 4 images' worth (what ``evaluate`` always passed)."""
    s = EvalSettings()
    assert (s.removal, s.n_steps, s.batch_size, s.seed, s.explain, s.autocast) == (
        "token", 20, 16, 0, "predicted", "none")
    assert s.jobs_per_forward == 64 and EvalSettings(batch_size=5).jobs_per_forward == 20
    assert EvalSettings(batch_size=5, forward_batch=7).jobs_per_forward == 7
    assert s.replace(seed=None) is s and s.replace(seed=3).seed == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.seed = 1  # type: ignore[misc]
    for bad, match in ((dict(removal="white"), "removal must be one of"),
                       (dict(explain="labels"), "explain must be one of"),
                       (dict(batch_size=0), "batch_size"), (dict(autocast="fp8"), "autocast")):
        with pytest.raises(ValueError, match=match):
            EvalSettings(**bad)


def test_settings_object_equals_the_loose_keywords(batch):
    model, x, labels, masks = batch
    lm = load_model("random:vit_tiny", seed=0)
    data = load_data("synthetic", n=3, input_shape=lm.input_shape, num_classes=lm.num_classes)
    gae = {"gae": method_factory("gae")}
    loose = suite.evaluate(model, data, gae, ["deletion", "aopc"], batch_size=2, n_steps=4,
                           removal="blur", seed=3)
    one = suite.evaluate(model, data, gae, ["deletion", "aopc"],
                         settings=EvalSettings(batch_size=2, n_steps=4, removal="blur", seed=3))
    assert list(loose["gae"]) == list(one["gae"]) == ["deletion", "aopc"]
    for c in loose["gae"]:
        assert torch.equal(loose["gae"][c].per_example, one["gae"][c].per_example)
    with pytest.warns(DeprecationWarning, match="explain="):
        old = suite.evaluate(model, data, gae, ["deletion"], batch_size=2, n_steps=4,
                             target="predicted")
    assert torch.equal(old["gae"]["deletion"].per_example,
                       suite.evaluate(model, data, gae, ["deletion"], batch_size=2,
                                      n_steps=4)["gae"]["deletion"].per_example)
    with pytest.raises(TypeError, match="unexpected keyword"):
        suite.evaluate(model, data, gae, ["deletion"], steps=4)


def test_a_metric_batch_carries_the_method_once(batch):
    model, x, labels, masks = batch
    seen = []

    def spy(b: MetricBatch) -> dict:
        seen.append(b)
        return {}

    factory = method_factory("gae")
    suite.evaluate_batch(model, x, factory, ["spy"], table={"spy": MetricSpec(spy)},
                         settings=EvalSettings(n_steps=4, seed=2))
    b = seen[0]
    assert isinstance(b.method, BoundMethod) and b.method.factory is factory
    assert b.attribution is b.method.attribution          # built once for the model
    assert b.method(model) is not b.attribution           # a call builds a new one
    assert b.settings.forward_batch == 64 and b.settings.seed == 2
    assert b.removal_kwargs["settings"].jobs_per_forward == 64
    with pytest.warns(DeprecationWarning, match="settings.seed"):
        assert b.seed == 2
    with pytest.warns(DeprecationWarning, match="jobs_per_forward"):
        assert b.batch_size == 64
    with pytest.warns(DeprecationWarning, match="forward_batch"):
        suite.evaluate_batch(model, x, factory, ["spy"], table={"spy": MetricSpec(spy)},
                             batch_size=5)
    assert seen[-1].settings.forward_batch == 5


def test_removal_metrics_take_the_settings_object(batch):
    """The settings reach the removal metrics whole; explicit keywords win."""
    from captum_vit.metrics import aopc, deletion, saco

    model, x, labels, masks = batch
    maps = torch.rand(x.shape[0], 16, generator=torch.Generator().manual_seed(0),
                      dtype=torch.float64)
    s = EvalSettings(removal="random", forward_batch=5, seed=7)
    for fn, kw in ((deletion, dict(n_steps=4)), (aopc, {}), (saco, dict(n_groups=4))):
        a = fn(model, x, maps, settings=s, **kw).per_example
        b = fn(model, x, maps, removal="random", forward_batch=5, seed=7, **kw).per_example
        assert torch.equal(a, b), fn.__name__
    other = deletion(model, x, maps, n_steps=4, settings=s, seed=8).per_example
    assert torch.equal(other, deletion(model, x, maps, n_steps=4, removal="random",
                                       seed=8).per_example)
