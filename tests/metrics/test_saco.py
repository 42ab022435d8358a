"""SaCo (SPEC_NEXT §9.1): a slow reference, known answers, batching, the suite and the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from captum_vit.cli import main
from captum_vit.methods import TokenIxG
from captum_vit.metrics import saco
from captum_vit.metrics.saco import group_sizes, saco_coefficient
from captum_vit.metrics.suite import METRICS, evaluate_batch
from captum_vit.registry import method_factory
from tests.helpers import make_inputs, make_model


def _logits_without(model, x, drop, removal):
    """Logits of one image [1, C, H, W] without the patches ``drop`` (timm's own modules,
    not the adapter): tokens dropped after the positional embedding, or pixels zeroed."""
    with torch.no_grad():
        if removal == "black":
            img = x.clone()
            gw = x.shape[-1] // 8
            for j in drop:
                r, c = divmod(int(j), gw)
                img[..., 8 * r:8 * r + 8, 8 * c:8 * c + 8] = 0
            return model(img)[0]
        t = model._pos_embed(model.patch_embed(x))
        k = model.num_prefix_tokens
        kept = [j for j in range(t.shape[1] - k) if j not in set(int(d) for d in drop)]
        t = torch.cat([t[:, :k], t[:, k:][:, kept]], 1)
        for blk in model.blocks:
            t = blk(t)
        return model.forward_head(model.norm(t))[0]


def reference_saco(model, x, maps, n_groups, removal="token"):
    """SPEC_NEXT §9.1 written out: loops over images, groups and pairs."""
    out = []
    for b in range(x.shape[0]):
        m = maps[b].tolist()
        order = sorted(range(len(m)), key=lambda u: (-m[u], u))  # stable, descending
        groups = np.array_split(np.array(order), n_groups)
        with torch.no_grad():
            logits = model(x[b:b + 1])[0]
        y = int(logits.argmax())
        p0 = float(logits.softmax(-1)[y])
        s = [sum(m[u] for u in g) for g in groups]
        d = [p0 - float(_logits_without(model, x[b:b + 1], g, removal).softmax(-1)[y])
             for g in groups]
        num = den = 0.0
        for i in range(n_groups):
            for j in range(i + 1, n_groups):
                sigma = 1.0 if d[i] >= d[j] else -1.0
                num += sigma * (s[i] - s[j])
                den += abs(s[i] - s[j])
        out.append(num / den if den > 0 else 0.0)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize(("removal", "n_groups"), [("token", 10), ("token", 3), ("black", 4)])
def test_saco_equals_the_slow_reference(removal, n_groups):
    model, x = make_model("vit"), make_inputs("vit", 3)
    maps = TokenIxG(model).attribute(x, output="tokens")
    got = saco(model, x, maps, n_groups=n_groups, removal=removal, forward_batch=5)
    ref = reference_saco(model, x, maps, n_groups, removal)
    torch.testing.assert_close(got.per_example, ref, rtol=1e-10, atol=1e-10)
    assert got.curves.shape == (3, n_groups) and got.value == pytest.approx(float(ref.mean()))


def _group_deltas(model, x, groups):
    """Δ of each group (list of patch lists) per image, measured with timm's modules."""
    with torch.no_grad():
        logits = model(x)
    y = logits.argmax(-1)
    p0 = logits.softmax(-1)[torch.arange(len(x)), y]
    return torch.tensor([[float(p0[b] - _logits_without(model, x[b:b + 1], g, "token")
                                .softmax(-1)[y[b]]) for g in groups] for b in range(len(x))],
                        dtype=torch.float64)


def test_a_map_ranking_groups_by_their_true_effect_gives_one_and_its_negation_minus_one():
    model, x = make_model("vit"), make_inputs("vit", 2)
    # K = P: one patch per group; the map = each patch's measured Δ
    delta = _group_deltas(model, x, [[j] for j in range(16)])
    assert saco(model, x, delta, n_groups=16).per_example.tolist() == [1.0, 1.0]
    assert saco(model, x, -delta, n_groups=16).per_example.tolist() == [-1.0, -1.0]
    # K = 4 groups of 4 patches: every patch of group g gets the group's measured Δ_g
    groups = [list(range(4 * g, 4 * g + 4)) for g in range(4)]
    dg = _group_deltas(model, x, groups)
    maps = dg.repeat_interleave(4, dim=1)
    assert saco(model, x, maps, n_groups=4).per_example.tolist() == [1.0, 1.0]
    assert saco(model, x, -maps, n_groups=4).per_example.tolist() == [-1.0, -1.0]


def test_zero_denominator_gives_zero_and_known_coefficients():
    model, x = make_model("vit"), make_inputs("vit", 2)
    res = saco(model, x, torch.ones(2, 16, dtype=torch.float64), n_groups=4)
    assert res.per_example.tolist() == [0.0, 0.0]
    s = torch.tensor([[3.0, 2.0, 1.0], [1.0, 1.0, 1.0]])
    d = torch.tensor([[0.1, 0.5, 0.2], [0.3, 0.2, 0.1]])
    # pairs (0,1): -1*1, (0,2): -1*2, (1,2): +1*1 -> (-1 - 2 + 1) / 4
    assert saco_coefficient(s, d).tolist() == [-0.5, 0.0]
    assert group_sizes(16, 10) == [2] * 6 + [1] * 4 and group_sizes(16, 16) == [1] * 16


def test_batch_invariance_and_errors():
    model, x = make_model("vit"), make_inputs("vit", 3)
    maps = TokenIxG(model).attribute(x, output="tokens")
    full = saco(model, x, maps, n_groups=5, forward_batch=4)
    for i in range(3):
        one = saco(model, x[i:i + 1], maps[i:i + 1], n_groups=5, forward_batch=1)
        torch.testing.assert_close(one.per_example[0], full.per_example[i], rtol=1e-12,
                                   atol=1e-12)
        torch.testing.assert_close(one.curves[0], full.curves[i], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="n_groups"):
        saco(model, x, maps, n_groups=17)
    with pytest.raises(ValueError, match="removal"):
        saco(model, x, maps, removal="white")


def test_saco_in_the_suite_and_the_cli(tmp_path):
    assert "saco" in METRICS
    model, x = make_model("vit"), make_inputs("vit", 2)
    cols = evaluate_batch(model, x, method_factory("tokenixg"), ["saco"])
    maps = TokenIxG(model).attribute(x, output="tokens")
    torch.testing.assert_close(cols["saco"].per_example, saco(model, x, maps).per_example)
    out = tmp_path / "out"
    assert main(["evaluate", "--model", "random:vit_tiny", "--data", "synthetic", "--n", "3",
                 "--batch-size", "2", "--methods", "gae", "--metrics", "saco", "--dtype",
                 "float64", "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    assert len(data["results"]["gae"]["saco"]["per_example"]) == 3
    assert "saco ↑" in (out / "results.md").read_text()
