"""Metrics, the evaluation suite and both commands on models that output an image
embedding, with vector targets (SPEC_NEXT §7.5).

The reference is a timm ViT holding a CLIP tower's weights whose classifier rows are
``W_projᵀ t_k``: its logits are the dot products ``⟨e, t_k⟩``, so every metric on it must
give exactly what the same metric gives on the CLIP tower scored against the set
``{t_k}`` (softmax over the set). A single target vector is scored by its sigmoid, which
equals the softmax of the two logits ``[⟨e, t⟩, 0]``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from captum_vit import GAE, EmbeddingTarget
from captum_vit.adapters import adapt
from captum_vit.metrics import faithfulness as fa
from captum_vit.metrics import localization as lo
from captum_vit.metrics import robustness as ro
from captum_vit.metrics.sanity import randomization
from captum_vit.metrics.suite import METRICS, evaluate, evaluate_batch
from captum_vit.registry import method_factory
from captum_vit.targets import read_target_embeddings, scoring
from tests.helpers import make_inputs, make_model, needs_transformers
from tests.targets.test_embedding_targets import timm_twin, vectors

pytestmark = needs_transformers


@pytest.fixture(scope="module")
def clip():
    return make_model("hf_clip")


def set_twin(clip, t: torch.Tensor) -> torch.nn.Module:
    """The timm twin with one logit ``⟨e, t_k⟩`` per row of ``t`` [T, D′]."""
    twin = timm_twin(clip, t[0])
    head = torch.nn.Linear(twin.head.in_features, t.shape[0]).double()
    with torch.no_grad():
        head.weight.copy_(t @ clip.visual_projection.weight)
        head.bias.zero_()
    twin.head = head
    twin.num_classes = t.shape[0]
    return twin


def masks_for(x: torch.Tensor) -> torch.Tensor:
    m = torch.zeros(x.shape[0], *x.shape[-2:], dtype=torch.bool)
    m[:, 4:20, 8:28] = True
    return m


def same(a, b, tol=1e-9):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("method", ["gae", "rollout"])
def test_every_suite_metric_on_a_target_set_equals_the_twin_classifier(clip, method):
    t = vectors(clip, 3)
    twin = set_twin(clip, t)
    x = make_inputs("hf_clip", batch=3)
    names = [m for m in METRICS if m != "randomization"]  # stages hold other parameters
    kw = dict(masks=masks_for(x), labels=torch.tensor([2, 0, 1]), explain="label",
              forward_batch=5)
    ref = evaluate_batch(twin, x, method_factory(method), names, **kw)
    with scoring(clip, EmbeddingTarget(t, similarity="dot")):
        ours = evaluate_batch(clip, x, method_factory(method), names, **kw)
    assert list(ours) == list(ref) and len(ours) >= 15
    for col in ref:
        same(ours[col].per_example, ref[col].per_example)


def test_metric_functions_take_vector_targets(clip):
    """Each metric's own ``target=`` takes an EmbeddingTarget set with an index."""
    t = vectors(clip, 3)
    twin = set_twin(clip, t)
    x = make_inputs("hf_clip", batch=3)
    idx = [1, 1, 2]
    spec = EmbeddingTarget(t, index=idx, similarity="dot")
    maps = GAE(clip).attribute(x, target=spec, output="tokens")
    same(maps, GAE(twin).attribute(x, target=idx, output="tokens"))
    for fn in (fa.deletion, fa.insertion, fa.aopc, fa.lodds):
        same(fn(clip, x, GAE(clip), target=spec).per_example,
             fn(twin, x, GAE(twin), target=idx).per_example)
    same(fa.perturbation_test(clip, x, maps, target=spec).per_example,
         fa.perturbation_test(twin, x, maps, target=idx).per_example)
    ours, ref = fa.token_ratio(clip, x, maps, target=spec), fa.token_ratio(twin, x, maps,
                                                                         target=idx)
    assert list(ours) == list(ref)
    for k in ref:
        same(ours[k].per_example, ref[k].per_example)
    m = masks_for(x)
    same(lo.pointing_game(clip, x, GAE(clip), m, target=spec).per_example,
         lo.pointing_game(twin, x, GAE(twin), m, target=idx).per_example)
    same(ro.sparseness(clip, x, GAE(clip), target=spec).per_example,
         ro.sparseness(twin, x, GAE(twin), target=idx).per_example)
    same(ro.max_sensitivity(clip, x, GAE(clip), target=spec).per_example,
         ro.max_sensitivity(twin, x, GAE(twin), target=idx).per_example)
    rnd = randomization(clip, x, method_factory("gae"), target=spec)
    assert rnd.curves.shape == (3, 4) and torch.isfinite(rnd.per_example).all()
    # "predicted": the best-scoring vector of the set, as the twin's arg-max
    pred = EmbeddingTarget(t, index="predicted", similarity="dot")
    same(fa.deletion(clip, x, GAE(clip), target=pred).per_example,
         fa.deletion(twin, x, GAE(twin)).per_example)
    same(GAE(clip).attribute(x, target=pred), GAE(twin).attribute(x))


def test_a_single_vector_is_scored_by_its_sigmoid(clip):
    """One target vector: probabilities are ``σ(s)`` = the softmax of ``[s, 0]``; the
    "prediction" of AOPC/LOdds is the vector itself; accuracies are refused or left out."""
    x = make_inputs("hf_clip", batch=3)
    e = adapt(clip).model_outputs(x)
    t = e.mean(0).detach()
    assert (e @ t > 0).all()  # so the twin's arg-max is logit 0, the explained one
    twin = timm_twin(clip, t)
    spec = EmbeddingTarget(t, similarity="dot")
    for fn in (fa.deletion, fa.insertion, fa.aopc, fa.lodds):
        same(fn(clip, x, GAE(clip), target=spec).per_example,
             fn(twin, x, GAE(twin), target=0).per_example)
    curve = fa.deletion(clip, x, GAE(clip), target=spec).curves
    same(curve[:, 0], torch.sigmoid(e @ t))
    with pytest.raises(ValueError, match="a single target vector"):
        fa.perturbation_test(clip, x, GAE(clip), target=spec)
    assert sorted(fa.token_ratio(clip, x, GAE(clip), target=spec)) == [
        "token_ratio_keep_aopc", "token_ratio_keep_lodds"]
    with scoring(clip, spec), pytest.warns(UserWarning, match="perturbation skipped"):
        cols = evaluate_batch(clip, x, method_factory("gae"), ["perturbation", "deletion"])
    assert list(cols) == ["deletion"]


def test_evaluate_over_a_data_set_with_target_vectors(clip):
    t = vectors(clip, 3)
    twin = set_twin(clip, t)
    data = [(make_inputs("hf_clip", batch=1, seed=i)[0], i % 3, None) for i in range(5)]
    methods = {"gae": method_factory("gae")}
    kw = dict(batch_size=2, explain="label")
    ours = evaluate(clip, data, methods, ["deletion", "aopc"], targets=EmbeddingTarget(
        t, similarity="dot"), **kw)
    ref = evaluate(twin, data, methods, ["deletion", "aopc"], **kw)
    for col in ref["gae"]:
        same(ours["gae"][col].per_example, ref["gae"][col].per_example)
    with pytest.raises(ValueError, match="image embedding"):
        evaluate(clip, data, methods, ["deletion"])


def test_the_model_is_left_alone_after_a_scored_block(clip):
    x = make_inputs("hf_clip", batch=2)
    a = adapt(clip)
    with scoring(clip, vectors(clip, 3)):
        assert a.num_classes == 3 and adapt(clip).num_classes == 3
    assert a.head.target is None and a.num_classes == 16
    with pytest.raises(ValueError, match="no predicted"):
        GAE(clip).attribute(x)
    with pytest.raises(TypeError, match="classifier"):
        with scoring(make_model("vit"), torch.ones(3, 32)):
            pass
    with pytest.raises(ValueError, match="index"):
        with scoring(clip, EmbeddingTarget(vectors(clip, 3), index=[0])):
            pass


def test_read_target_embeddings(tmp_path):
    t = torch.randn(4, 16)
    np.save(tmp_path / "t.npy", t.numpy())
    torch.save(t.double(), tmp_path / "t.pt")
    same(read_target_embeddings(tmp_path / "t.npy"), t)
    assert read_target_embeddings(tmp_path / "t.pt").dtype == torch.float64
    np.save(tmp_path / "one.npy", t[0].numpy())
    assert read_target_embeddings(tmp_path / "one.npy").shape == (1, 16)
    with pytest.raises(FileNotFoundError, match="target-embeddings"):
        read_target_embeddings(tmp_path / "missing.npy")
    (tmp_path / "t.txt").write_text("1 2")
    with pytest.raises(ValueError, match=".npy"):
        read_target_embeddings(tmp_path / "t.txt")
    np.save(tmp_path / "int.npy", np.arange(4))
    with pytest.raises(ValueError, match="float"):
        read_target_embeddings(tmp_path / "int.npy")


@pytest.fixture()
def saved_clip(tmp_path, clip):
    import transformers

    model = make_model("hf_clip", dtype=torch.float32)
    model.save_pretrained(tmp_path / "clip")
    transformers.CLIPImageProcessor(size={"shortest_edge": 32},
                                    crop_size={"height": 32, "width": 32}).save_pretrained(
        tmp_path / "clip")
    t = vectors(model, 3).float().numpy()
    np.save(tmp_path / "classes.npy", t)
    (tmp_path / "classes.txt").write_text("cat\ndog\nbird\n")
    return tmp_path


def test_explain_command_with_target_embeddings(saved_clip, capsys):
    from captum_vit.cli import main

    d = saved_clip
    out = d / "explain.png"
    args = ["explain", "--model", f"hf:{d / 'clip'}", "--methods", "gae,decompx",
            "--target-embeddings", str(d / "classes.npy"), "--classes", str(d / "classes.txt"),
            "--embedding-scale", "10", "--out", str(out)]
    assert main(args) == 0 and out.stat().st_size > 0
    said = capsys.readouterr().out
    assert any(n in said for n in ("cat", "dog", "bird"))
    assert main(args + ["--target", "2"]) == 0 and "bird" in capsys.readouterr().out
    assert main(["explain", "--model", f"hf:{d / 'clip'}", "--methods", "gae",
                 "--out", str(out)]) == 2
    assert "--target-embeddings FILE" in capsys.readouterr().err


def test_evaluate_command_with_target_embeddings(saved_clip, capsys):
    import json

    from captum_vit.cli import main

    d = saved_clip
    out = d / "eval"
    assert main(["evaluate", "--model", f"hf:{d / 'clip'}", "--data", "synthetic", "--n", "3",
                 "--batch-size", "2", "--methods", "gae,random", "--metrics",
                 "deletion,perturbation", "--target-embeddings", str(d / "classes.npy"),
                 "--similarity", "dot", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["similarity"] == "dot"
    assert set(res["results"]["gae"]) >= {"deletion", "perturbation_pos"}
    assert main(["evaluate", "--model", "random:vit_tiny", "--data", "synthetic", "--n", "2",
                 "--target-embeddings", str(d / "classes.npy"), "--out", str(d / "e2")]) == 2
    assert "is a classifier" in capsys.readouterr().err
