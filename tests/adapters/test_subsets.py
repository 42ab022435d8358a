"""The one subset-scoring engine (captum_vit/adapters/subsets.py): every job equals its
shortened sequence run alone, for every model family; the length planner; reuse of the
full logits; TIS and the removal metrics going through it."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from captum_vit.adapters import adapt, subset_logits
from captum_vit.adapters.subsets import FORWARD_OVERHEAD_TOKENS, plan_chunks
from captum_vit.metrics import RemovalEngine, ranking
from tests.helpers import FAMILIES, assert_close_scaled, make_inputs, make_model


def _random_keep(batch: int, subsets: int, patches: int, seed: int) -> torch.Tensor:
    """Subsets of many sizes, one keeping every patch and one keeping none per image."""
    g = torch.Generator().manual_seed(seed)
    frac = torch.linspace(0.1, 0.9, subsets)[None, :, None]
    keep = torch.rand(batch, subsets, patches, generator=g) < frac
    keep[:, 0] = True  # all kept: equals the clean forward
    keep[:, 1] = False  # nothing kept: only the prefix tokens (no token at all for avg)
    return keep


def _one_by_one(adapter, x0: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Reference: every (image, subset) alone through ``adapter.run(x0, keep=...)``."""
    rows = []
    for i in range(keep.shape[0]):
        row = []
        for j in range(keep.shape[1]):
            if adapter.num_prefix + int(keep[i, j].sum()) == 0:
                row.append(x0.new_zeros(adapter.num_classes))  # no token: logits 0
            else:
                row.append(adapter.run(x0[i:i + 1], keep=keep[i, j][None])[0])
        rows.append(torch.stack(row))
    return torch.stack(rows)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_job_equals_its_shortened_sequence_alone(family):
    model, x = make_model(family), make_inputs(family, batch=3)
    adapter = adapt(model)
    x0 = adapter.embed(x).detach()
    keep = _random_keep(3, 7, adapter.layout(x).num_patches, seed=4)
    ref = _one_by_one(adapter, x0, keep)
    for batch_size in (None, 1, 4):  # one padded forward / no padding / mixed chunks
        out = subset_logits(adapter, x0, keep, batch_size=batch_size)
        assert out.shape == ref.shape and out.dtype == torch.float64
        assert_close_scaled(out, ref)
    shared = subset_logits(adapter, x0, keep[:1])  # [1, S, P] masks shared by the batch
    assert_close_scaled(shared, _one_by_one(adapter, x0, keep[:1].expand(3, -1, -1)))


def test_empty_job_without_prefix_tokens_has_logits_zero():
    model, x = make_model("avgpool"), make_inputs("avgpool", batch=2)
    adapter = adapt(model)
    assert adapter.num_prefix == 0
    keep = torch.zeros(2, 3, 16, dtype=torch.bool)
    keep[:, 1, 5] = True
    out = subset_logits(adapter, adapter.embed(x), keep, batch_size=2)
    assert torch.equal(out[:, [0, 2]], torch.zeros(2, 2, 5, dtype=torch.float64))
    assert_close_scaled(out[:, 1], adapter.run(adapter.embed(x), keep=keep[:, 1]))


@pytest.mark.parametrize("family", ["eva02", "beit"])
def test_no_patch_under_an_average_readout_has_logits_zero(family):
    """A class token but ``global_pool='avg'`` (BEiT, many EVA-02 classifiers): keeping no
    patch leaves the mean of nothing, so the logits are 0 (uniform), not NaN, and
    deletion's last step is 1/C instead of poisoning every example's AUC."""
    from captum_vit.adapters import pools_patches
    from captum_vit.adapters.subsets import subset_forwards
    from captum_vit.metrics import deletion

    model, x = make_model(family), make_inputs(family, batch=2)
    adapter = adapt(model)
    assert adapter.num_prefix > 0 and pools_patches(adapter)
    keep = torch.zeros(2, 2, 16, dtype=torch.bool)
    keep[:, 1, 3] = True
    out = subset_logits(adapter, adapter.embed(x), keep, batch_size=2)
    assert torch.equal(out[:, 0], torch.zeros(2, 5, dtype=torch.float64))
    assert_close_scaled(out[:, 1], adapter.run(adapter.embed(x), keep=keep[:, 1]))
    assert subset_forwards(keep, adapter.num_prefix, reuse_full=False, pools_patches=True) == 2
    res = deletion(model, x, torch.rand(2, 16, dtype=torch.float64), target=[0, 1], n_steps=4)
    assert torch.isfinite(res.per_example).all()
    assert_close_scaled(res.curves[:, -1], torch.full((2,), 0.2, dtype=torch.float64))


@pytest.mark.parametrize("family", ["vit", "avgpool"])
def test_reusing_the_full_logits_equals_recomputing(family):
    model, x = make_model(family), make_inputs(family, batch=2)
    adapter = adapt(model)
    x0 = adapter.embed(x)
    keep = _random_keep(2, 5, 16, seed=1)
    full = model(x)
    reused = subset_logits(adapter, x0, keep, batch_size=3, full_logits=full)
    assert_close_scaled(reused, subset_logits(adapter, x0, keep, batch_size=3))
    sentinel = torch.full_like(full, 7.0)  # proves the all-kept jobs are not recomputed
    out = subset_logits(adapter, x0, keep, full_logits=sentinel)
    full = keep.all(-1)  # subset 0 and any other that happens to keep every patch
    assert full[:, 0].all() and (out[full] == 7.0).all()
    assert_close_scaled(out[~full], reused[~full])


def test_reduce_stores_its_values_instead_of_the_logits():
    model, x = make_model("registers"), make_inputs("registers", batch=2)
    adapter = adapt(model)
    x0 = adapter.embed(x)
    keep = _random_keep(2, 6, 16, seed=2)
    target = torch.tensor([3, 1])
    logits = subset_logits(adapter, x0, keep, batch_size=4)
    probs = subset_logits(adapter, x0, keep, batch_size=4, full_logits=model(x),
                          reduce=lambda z, i: z.softmax(-1).gather(1, target[i, None])[:, 0])
    assert probs.shape == (2, 6)
    ref = logits.softmax(-1).gather(2, target[:, None, None].expand(-1, 6, 1))[..., 0]
    assert_close_scaled(probs, ref)


def test_progress_bar_counts_every_job(capsys):
    model, x = make_model("vit"), make_inputs("vit", batch=1)
    adapter = adapt(model)
    keep = _random_keep(1, 5, 16, seed=3)
    subset_logits(adapter, adapter.embed(x), keep, show_progress=True, desc="scoring")
    err = capsys.readouterr().err
    assert "scoring" in err and "5/5" in err
    subset_logits(adapter, adapter.embed(x), keep)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("kwargs,error,match", [
    ({"keep": torch.ones(2, 3, 16)}, TypeError, "bool"),
    ({"keep": torch.ones(2, 3, 15, dtype=torch.bool)}, ValueError, "shape"),
    ({"keep": torch.ones(3, 3, 16, dtype=torch.bool)}, ValueError, "shape"),
    ({"keep": torch.ones(3, 16, dtype=torch.bool)}, ValueError, "shape"),
    ({"batch_size": 0}, ValueError, "batch_size"),
    ({"full_logits": torch.zeros(3, 5)}, ValueError, "full_logits"),
])
def test_bad_arguments(kwargs, error, match):
    model, x = make_model("vit"), make_inputs("vit", batch=2)
    adapter = adapt(model)
    args = {"keep": torch.ones(2, 3, 16, dtype=torch.bool), **kwargs}
    with pytest.raises(error, match=match):
        subset_logits(adapter, adapter.embed(x), args.pop("keep"), **args)


# --- the planner ----------------------------------------------------------------------------

def _plan_cost(lengths, plan, overhead, width=math.inf):
    return sum(len(c) * (n + n * n / width) + overhead
               for c in plan for n in [max(lengths[i] for i in c)])


def _best_cost_by_brute_force(lengths, batch_size, overhead):
    """Every split of the sorted distinct lengths into contiguous groups."""
    values = sorted(set(lengths))
    best = math.inf
    for cuts in itertools.product([False, True], repeat=len(values) - 1):
        cost, count = 0.0, 0
        for v, cut in zip(values, list(cuts) + [True], strict=True):
            count += lengths.count(v)
            if cut:
                cost += count * v + math.ceil(count / batch_size) * overhead
                count = 0
        best = min(best, cost)
    return best


def test_plan_is_optimal_for_the_cost_model_and_keeps_every_job_once():
    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        n_jobs = int(torch.randint(1, 25, (1,), generator=g))
        pool = torch.randint(1, 60, (10,), generator=g)  # at most 10 distinct lengths
        lengths = pool[torch.randint(0, 10, (n_jobs,), generator=g)].tolist()
        batch_size = int(torch.randint(1, 9, (1,), generator=g))
        overhead = [0.0, 8.0, 32.0, 500.0][trial % 4]
        plan = plan_chunks(lengths, batch_size, overhead=overhead)
        assert sorted(i for c in plan for i in c) == list(range(n_jobs))
        assert all(1 <= len(c) <= batch_size for c in plan)
        # chunk costs never exceed the group estimate the DP minimised
        assert _plan_cost(lengths, plan, overhead) <= _best_cost_by_brute_force(
            lengths, batch_size, overhead) + 1e-9


def test_plan_examples():
    assert plan_chunks([]) == []
    assert plan_chunks([50] * 10, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert plan_chunks([5, 5, 100], overhead=32.0) == [[0, 1], [2]]
    assert plan_chunks([7, 5, 6], overhead=32.0) == [[1, 2, 0]]  # padding 1-2 tokens pays
    assert plan_chunks([7, 5, 6], overhead=0.0) == [[1], [2], [0]]  # no overhead: no padding


def test_deletion_curve_at_batch_8_is_planned_without_padding():
    # ViT-S/16: 21 removal levels of 196 patches + CLS, 8 images, CPU overhead
    levels = [197 - round(196 * s / 20) for s in range(21)]
    lengths = [n for n in levels for _ in range(8)]
    plan = plan_chunks(lengths, 64, overhead=FORWARD_OVERHEAD_TOKENS["cpu"],
                       attention_width=2304.0)
    assert len(plan) == 21 and all(len({lengths[i] for i in c}) == 1 for c in plan)


# --- callers ----------------------------------------------------------------------------------

@pytest.mark.parametrize("removal", ["token", "black"])
def test_removal_engine_reuses_the_clean_logits(removal):
    model, x = make_model("vit"), make_inputs("vit", batch=2)
    eng = RemovalEngine(model, removal, forward_batch=5)
    order = ranking(torch.rand(2, 16, generator=torch.Generator().manual_seed(0)))
    clean = model(x).detach()
    for mode, counts in (("delete", [0, 4, 16]), ("insert", [0, 8, 16])):
        ref = eng.logits(x, order, counts, mode=mode)
        out = eng.logits(x, order, counts, mode=mode, full_logits=clean)
        assert_close_scaled(out, ref)
        full_step = 0 if mode == "delete" else 2
        assert torch.equal(out[:, full_step], clean)
    with pytest.raises(ValueError, match="full_logits"):
        eng.logits(x, order, [0], full_logits=clean[:1])
