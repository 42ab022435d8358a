"""Check the papers' claims (TokenTM, TIS, SkipPLUS) about deep ViTs on both bundled models.

Evaluates those methods and the baselines they compare against on the first ``--n`` images of the
FashionMNIST-Loc test split (seed 0, predicted class, true token removal) for the 4-block
``vit_fmnist_loc`` and the 12-block ``vit_fmnist_loc_deep``, then the SkipPLUS ablation
(deletion of DecompX summed over the sub-networks starting at blocks ``k .. L-1``, for every
``k``), and writes ``docs/paper_claims/``: ``<model>/results.*`` (the suite's files),
``ablation.csv``, ``ablation.png`` and ``README.md`` (the table, each claim's verdict on each
model, the ablation).

Example (about 25 minutes on the project's 2-core CPU with two processes)::

    torchrun --standalone --nproc_per_node=2 scripts/paper_claims.py --num-examples 512

or ``python scripts/paper_claims.py --num-examples 512`` in one process.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from captum_vit._text import count_noun  # noqa: E402
from captum_vit.combinators import PLUS  # noqa: E402
from captum_vit.data.specs import load_data  # noqa: E402
from captum_vit.metrics import report, suite  # noqa: E402
from captum_vit.models import load_model  # noqa: E402
from captum_vit.registry import method_factory  # noqa: E402

MODELS = ("vit_fmnist_loc", "vit_fmnist_loc_deep")
METHODS = ("decompx", "plus:decompx", "skipplus:decompx", "tis", "tokentm", "gae", "chefer21",
           "attnlrp", "random")
METRICS = ("deletion", "insertion", "aopc", "lodds", "perturbation", "pointing_game",
           "segmentation")
# (results column, header, higher is better)
COLUMNS = (("deletion", "deletion ↓", False), ("insertion", "insertion ↑", True),
           ("insertion_minus_deletion", "ins − del ↑", True), ("aopc", "AOPC ↑", True),
           ("lodds", "LOdds ↓", False), ("perturbation_pos", "pos. pert. AUC ↓", False),
           ("perturbation_neg", "neg. pert. AUC ↑", True), ("miou", "mIoU ↑", True),
           ("map", "mAP ↑", True), ("pointing_game", "pointing ↑", True))


def _values(results: dict) -> dict[str, dict[str, float]]:
    return {m: {c: r.value for c, r in cols.items()} for m, cols in results.items()}


def claims(v: dict[str, dict[str, float]]) -> list[tuple[str, bool, str]]:
    """Each claim as (claim, holds, the numbers it rests on) from one model's values."""
    def better(a: str, b: str, col: str, higher: bool) -> bool:
        return v[a][col] > v[b][col] if higher else v[a][col] < v[b][col]

    out = []
    d, s, p = v["decompx"], v["skipplus:decompx"], v["plus:decompx"]
    out.append(("SkipPLUS: skipping the first blocks improves DecompX's deletion",
                better("skipplus:decompx", "decompx", "deletion", False),
                f"deletion {s['deletion']:.3f} vs {d['deletion']:.3f}"))
    out.append(("SkipPLUS: … and its insertion − deletion",
                better("skipplus:decompx", "decompx", "insertion_minus_deletion", True),
                f"{s['insertion_minus_deletion']:.3f} vs {d['insertion_minus_deletion']:.3f}"))
    out.append(("PLUS improves DecompX's deletion",
                better("plus:decompx", "decompx", "deletion", False),
                f"deletion {p['deletion']:.3f} vs {d['deletion']:.3f}"))
    ranked = sorted((m for m in v if m != "random"),
                    key=lambda m: -v[m]["insertion_minus_deletion"])
    out.append(("TIS has the best insertion − deletion", ranked[0] == "tis",
                f"TIS {v['tis']['insertion_minus_deletion']:.3f}, rank "
                f"{ranked.index('tis') + 1} of {len(ranked)} (best: {ranked[0]} "
                f"{v[ranked[0]]['insertion_minus_deletion']:.3f})"))
    for col, name in (("miou", "mIoU"), ("map", "mAP")):
        out.append((f"TokenTM beats GAE and Chefer'21 on segmentation ({name})",
                    better("tokentm", "gae", col, True)
                    and better("tokentm", "chefer21", col, True),
                    f"{v['tokentm'][col]:.3f} vs GAE {v['gae'][col]:.3f}, Chefer'21 "
                    f"{v['chefer21'][col]:.3f}"))
    out.append(("TokenTM beats GAE and Chefer'21 on positive perturbation",
                better("tokentm", "gae", "perturbation_pos", False)
                and better("tokentm", "chefer21", "perturbation_pos", False),
                f"{v['tokentm']['perturbation_pos']:.2f} vs GAE "
                f"{v['gae']['perturbation_pos']:.2f}, Chefer'21 "
                f"{v['chefer21']['perturbation_pos']:.2f}"))
    return out


def ablation_factories(num_blocks: int) -> dict[str, Callable]:
    """``skip<k>`` -> DecompX summed over the sub-networks starting at blocks k .. L-1."""
    def make(k: int) -> Callable:
        return lambda model: PLUS(model, "decompx", layers=range(k, num_blocks))
    return {f"skip{k}": make(k) for k in range(num_blocks)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-examples", type=int, default=512, dest="n", help="test images")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--out", default=str(ROOT / "docs" / "paper_claims"))
    args = ap.parse_args()
    out = Path(args.out)
    with suite.distributed("cpu") as (device, rank, world):
        for name in args.models:
            start = time.time()
            lm = load_model(f"zoo:{name}")
            model = lm.model.to(device=device, dtype=torch.float32)
            data = load_data("fmnist-loc", n=args.n, seed=0, input_shape=lm.input_shape,
                             num_classes=lm.num_classes, class_names=lm.class_names)
            factories = {m: method_factory(m, seed=0) for m in METHODS}
            seconds: dict[str, float] = {}
            metrics = suite.parse_metrics(list(METRICS), has_masks=data.has_masks)
            results = suite.evaluate(model, data, factories, metrics, preprocess=lm.preprocess,
                                     batch_size=args.batch_size, seed=0, progress=True,
                                     timings=seconds)
            L = len(model.blocks)
            abl = suite.evaluate(model, data, ablation_factories(L), ["deletion"],
                                 preprocess=lm.preprocess, batch_size=args.batch_size, seed=0,
                                 progress=True)
            if rank == 0:
                config = {"model": f"zoo:{name}", "data": "fmnist-loc", "n": len(data),
                          "methods": list(METHODS), "metrics": metrics, "seed": 0,
                          "target": "predicted", "removal": "token"}
                report.write_outputs(out / name, results, config, seconds)
                part = {"n": args.n, "processes": world, "values": _values(results),
                        "seconds": seconds, "blocks": L,
                        "ablation": [abl[f"skip{k}"]["deletion"].value for k in range(L)],
                        "minutes": (time.time() - start) / 60}
                (out / name / "summary.json").write_text(json.dumps(part, indent=1) + "\n")
                print(report.text_table(results, seconds), flush=True)
        if rank == 0:
            write_summary(out, args.n)


def write_summary(out: Path, n: int) -> None:
    """``README.md``, ``ablation.csv`` and ``ablation.png`` in ``out`` from the
    ``<model>/summary.json`` of every model evaluated on ``n`` images (run the models
    together or one at a time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = {m: json.loads((out / m / "summary.json").read_text()) for m in MODELS
             if (out / m / "summary.json").is_file()}
    parts = {m: p for m, p in parts.items() if p["n"] == n}
    models = list(parts)
    summary = {"n": n, "models": parts, "ablation": {m: p["ablation"] for m, p in parts.items()},
               "minutes": {m: p["minutes"] for m, p in parts.items()}}
    lines = [f"# The papers' claims on both bundled models ({summary['n']} test images)",
             "", "Regenerate with `torchrun --standalone --nproc_per_node=2 "
             f"scripts/paper_claims.py --num-examples {summary['n']}` ("
             + "; ".join(f"`{m}`: {summary['minutes'][m]:.1f} min with "
                         f"{count_noun(parts[m]['processes'], 'process', 'processes')}"
                         for m in models)
             + " on the 2-core CPU, sharing it with other jobs). FashionMNIST-Loc "
             "test split, seed 0, predicted class, true token removal.", ""]
    for m in models:
        v = summary["models"][m]["values"]
        lines += [f"## `{m}` ({summary['models'][m]['blocks']} blocks)", "",
                  "| method | " + " | ".join(h for _, h, _ in COLUMNS) + " | s/image |",
                  "|---|" + "---:|" * (len(COLUMNS) + 1)]
        for meth, cols in v.items():
            cells = []
            for col, _, higher in COLUMNS:
                vals = [v[k][col] for k in v if k != "random"]
                best = max(vals) if higher else min(vals)
                cell = f"{cols[col]:.3f}" if abs(cols[col]) < 10 else f"{cols[col]:.1f}"
                cells.append(f"**{cell}**" if cols[col] == best and meth != "random" else cell)
            sec = summary["models"][m]["seconds"].get(meth, math.nan)
            lines.append(f"| {meth} | " + " | ".join(cells) + f" | {sec:.3g} |")
        lines.append("")
    lines += ["## Claims", "", "| claim | " + " | ".join(f"`{m}`" for m in models) + " |",
              "|---|" + "---|" * len(models)]
    verdicts = {m: claims(summary["models"][m]["values"]) for m in models}
    for i, (text, _, _) in enumerate(verdicts[models[0]]):
        cells = [f"{'holds' if verdicts[m][i][1] else 'does not hold'} ({verdicts[m][i][2]})"
                 for m in models]
        lines.append(f"| {text} | " + " | ".join(cells) + " |")
    lines += ["", "## SkipPLUS ablation: DecompX summed over the sub-networks from block k",
              "", "Deletion ↓ of `PLUS(model, \"decompx\", layers=range(k, L))`: k = 0 is "
              "PLUS, k = ⌈L/2⌉ SkipPLUS, k = L − 1 the last block alone.", "",
              "![ablation](ablation.png)", "",
              "| skipped blocks k | " + " | ".join(f"`{m}`" for m in models) + " |",
              "|---:|" + "---:|" * len(models)]
    depth = max(len(summary["ablation"][m]) for m in models)
    rows = []
    for k in range(depth):
        vals = [summary["ablation"][m][k] if k < len(summary["ablation"][m]) else None
                for m in models]
        rows.append([k, *vals])
        lines.append(f"| {k} | " + " | ".join("" if x is None else f"{x:.4f}" for x in vals)
                     + " |")
    (out / "README.md").write_text("\n".join(lines) + "\n")
    with open(out / "ablation.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["skipped_blocks", *models])
        w.writerows(rows)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for m in models:
        ys = summary["ablation"][m]
        ax.plot(range(len(ys)), ys, marker="o", label=f"{m} ({len(ys)} blocks)")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("skipped blocks k (sum over sub-networks from block k)")
    ax.set_ylabel("deletion AUC (lower is better)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "ablation.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
