"""Before/after check of a refactoring: every map and metric value must stay the same.

Runs every registered method (with the contract suite's compositions and fast options) on
every model family of the contract suite in float64, plus every metric of the suite on two
families, and saves the results (``--save FILE``) or compares them with a saved run
(``--compare FILE``; exit status 1 if any map differs by more than ``--rtol`` times the
largest magnitude of the saved map).

Run it on the commit before a refactoring and on the commit after::

    git stash; python scripts/refactor_parity.py --save /tmp/before.pt; git stash pop
    python scripts/refactor_parity.py --compare /tmp/before.pt
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from captum_vit.adapters import adapt  # noqa: E402
from captum_vit.metrics.suite import available_metrics, evaluate_batch  # noqa: E402
from captum_vit.registry import available_methods, build_method, method_factory  # noqa: E402
from tests.helpers import ALL_FAMILIES, EMBEDDING_FAMILIES, make_inputs, make_model  # noqa: E402

EXTRA = ["plus:ixg", "plus:gradient", "plus:captum:InputXGradient", "skipplus:captum:Saliency"]
FAST = {"tis": {"n_masks": 16}, "bt_h": {"n_steps": 3, "start_layer": 1},
        "bt_t": {"n_steps": 3, "start_layer": 1}, "tam": {"n_steps": 3, "start_layer": 0},
        "rise": {"n_masks": 16}}
METRIC_FAMILIES = ["vit", "eva02"]
METRIC_METHODS = ["gae", "tokentm", "random", "plus:decompx"]
# jobs per removal forward: `forward_batch` since the evaluation settings object, before
# that `evaluate_batch`'s `batch_size` (the script runs on commits before and after)
FORWARD_BATCH = ({"forward_batch": 4} if "forward_batch" in inspect.signature(
    evaluate_batch).parameters else {"batch_size": 4})


def model_embedding(model, x):
    return adapt(model).model_logits(x)


def target_kinds(target: torch.Tensor) -> list[tuple[str, object]]:
    """The other target kinds of the contract suite: a plain callable on the logits, a
    contrast of two classes and a multi-label sum."""
    from captum_vit.targets import Contrastive, MultiLabel

    return [("callable", lambda z: z[:, 3]), ("contrastive", Contrastive(target, 2)),
            ("multilabel", MultiLabel([0, 3]))]


def families() -> list[str]:
    """The contract suite's classifier families whose libraries are installed."""
    try:
        import transformers  # noqa: F401
        return list(ALL_FAMILIES)
    except ImportError:
        return [f for f in ALL_FAMILIES if not f.startswith("hf")]


def run() -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    out: dict[str, torch.Tensor] = {}
    target = torch.tensor([1, 0, 4])
    for fam in families():
        model = make_model(fam, dtype=torch.float64)
        x = make_inputs(fam, batch=3)
        for name in available_methods(compositions=True) + EXTRA:
            kw = FAST.get(name, {})
            method = build_method(name, model)
            for kind, tgt in [("map", target), *target_kinds(target)]:
                try:
                    out[f"{kind}/{name}/{fam}"] = method.attribute(
                        x, target=tgt, output="tokens", **kw).detach()
                except ValueError:  # a stated refusal (TIS on windows) is a result too
                    out[f"{kind}/{name}/{fam}"] = torch.tensor([-1.0])
        if fam in METRIC_FAMILIES:
            g = torch.Generator().manual_seed(3)
            masks = torch.rand(x.shape[0], x.shape[2], x.shape[3], generator=g) > 0.6
            for name in METRIC_METHODS:
                cols = evaluate_batch(model, x, method_factory(name),
                                      available_metrics(masks=True), masks=masks,
                                      labels=target, n_steps=5, **FORWARD_BATCH)
                for col, res in cols.items():
                    out[f"metric/{col}/{name}/{fam}"] = res.per_example.double()
    for fam in EMBEDDING_FAMILIES:
        try:
            model = make_model(fam, dtype=torch.float64)
        except ImportError:
            continue
        x = make_inputs(fam, batch=2)
        with torch.no_grad():
            dim = model_embedding(model, x).shape[-1]
        vec = torch.randn(dim, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        for name in ["gae", "tokentm", "decompx", "chefer21"]:
            if name in available_methods():
                out[f"embed/{name}/{fam}"] = build_method(name, model).attribute(
                    x, target=vec, output="tokens").detach()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--save", type=Path)
    g.add_argument("--compare", type=Path)
    p.add_argument("--rtol", type=float, default=1e-12)
    a = p.parse_args()
    t0 = time.perf_counter()
    now = run()
    print(f"{len(now)} results in {time.perf_counter() - t0:.0f} s")
    if a.save:
        torch.save(now, a.save)
        return 0
    before = torch.load(a.compare)
    missing = sorted(set(before) - set(now))
    worst, bad = 0.0, []
    for key, ref in before.items():
        if key not in now:
            continue
        nan_ok = torch.equal(torch.isnan(now[key]), torch.isnan(ref))
        fin = ~torch.isnan(ref)
        scale = max(ref[fin].abs().max().item(), 1e-300) if fin.any() else 1.0
        diff = ((now[key] - ref)[fin].abs().max().item() / scale if nan_ok and fin.any()
                else 0.0)
        if not nan_ok or not diff <= a.rtol:
            bad.append((key, diff))
        worst = max(worst, diff if diff == diff else float("inf"))
    print(f"compared {len(before) - len(missing)} of {len(before)}; largest relative "
          f"difference {worst:.2e} (allowed {a.rtol:g}); new: {len(set(now) - set(before))}")
    for key in missing:
        print("missing:", key)
    for key, d in bad:
        print(f"differs: {key}: {d:.2e}")
    return 1 if bad or missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
