"""Check the papers' claims (TokenTM, TIS, SkipPLUS) about deep ViTs on both bundled models.

Evaluates those methods and the baselines they compare against on the first ``--n`` images of the
FashionMNIST-Loc test split (seed 0, predicted class, true token removal) for the 4-block
``vit_fmnist_loc`` and the 12-block ``vit_fmnist_loc_deep``, then the SkipPLUS ablation
(deletion of DecompX summed over the sub-networks starting at blocks ``k .. L-1``, for every
``k``), and writes ``docs/paper_claims/``: ``<model>/results.*`` (the suite's files),
``<model>/per_image.csv`` (every image's value of every compared number),
``<model>/summary.json``, ``ablation.csv``, ``ablation.png``, ``README.md`` (the table,
each claim's verdict on each model, the ablation) and ``claims.md`` (the claims table,
included by the documentation's Results page). Every number has its 95 % bootstrap
interval over the images and every difference its paired interval (the same resampled
images for both methods); a claim whose difference's interval contains 0 is "within
noise". ``--summary-only`` rewrites the summary files from the kept per-image values.

Example (44 minutes on the project's 2-core CPU with two processes, shared with other jobs)::

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
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from captum_vit._text import count_noun  # noqa: E402
from captum_vit.combinators import PLUS  # noqa: E402
from captum_vit.data.specs import load_data  # noqa: E402
from captum_vit.metrics import report, suite  # noqa: E402
from captum_vit.metrics.report import (  # noqa: E402
    BootstrapCI,
    bootstrap_ci,
    paired_bootstrap_ci,
    verdict,
)
from captum_vit.metrics.results import MetricResult  # noqa: E402
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
NAMES = {"gae": "GAE", "chefer21": "Chefer'21"}
N_BOOT = 2000
"""Bootstrap resamples of the images for every interval (95 %, percentile, seed 0)."""


def _values(results: dict) -> dict[str, dict[str, float]]:
    return {m: {c: r.value for c, r in cols.items()} for m, cols in results.items()}


def _ci(ci: BootstrapCI, digits: int = 3, *, sign: bool = False) -> str:
    """``0.138 [0.129, 0.147]`` (minus signs as in the tables' text); more decimals where
    a non-zero number would round to 0 (the side of 0 an interval lies on must show)."""
    while digits < 6 and any(x != 0 and round(x, digits) == 0
                             for x in (ci.estimate, ci.low, ci.high)):
        digits += 1
    return ci.format(digits, sign=sign).replace("-", "−")


@dataclass(frozen=True)
class Claim:
    """One claim on one model: its text, the verdict from the paired intervals
    (:func:`captum_vit.metrics.report.verdict`), whether it holds on the point estimates,
    and the numbers with their intervals."""

    text: str
    verdict: str
    point_holds: bool
    detail: str

    def cell(self) -> str:
        """The claims table's cell: the verdict, how the point estimates fall when the
        difference is within noise, and the numbers."""
        lean = ""
        if self.verdict == "within noise":
            lean = f" (point estimates: {'holds' if self.point_holds else 'does not hold'})"
        return f"**{self.verdict}**{lean}: {self.detail}"


def claims(res: dict[str, dict[str, MetricResult]], *, n_boot: int = N_BOOT,
           seed: int = 0) -> list[Claim]:
    """Each claim on one model's per-image results: the compared numbers with their 95 %
    bootstrap intervals over images and the paired interval of every difference (the same
    resampled images for both methods; the same resamples for every number)."""
    def ci(m: str, col: str) -> BootstrapCI:
        return bootstrap_ci(res[m][col], n_boot=n_boot, seed=seed)

    def diff(a: str, b: str, col: str) -> BootstrapCI:
        return paired_bootstrap_ci(res[a][col], res[b][col], n_boot=n_boot, seed=seed)

    def claim(text: str, a: str, others: list[str], col: str, higher: bool,
              label: str = "", digits: int = 3) -> Claim:
        ds = [diff(a, b, col) for b in others]
        point = all((d.estimate > 0) == higher and d.estimate != 0 for d in ds)
        nums = f"{label}{_ci(ci(a, col), digits)} vs " + ", ".join(
            f"{NAMES.get(b, b) + ' ' if len(others) > 1 else ''}{_ci(ci(b, col), digits)}"
            for b in others)
        deltas = "; ".join(
            f"Δ{' ' + NAMES.get(b, b) if len(others) > 1 else ''} {_ci(d, digits, sign=True)}"
            for b, d in zip(others, ds, strict=True))
        return Claim(text, verdict(ds, higher_is_better=higher), point, f"{nums}; {deltas}")

    out = [claim("SkipPLUS: skipping the first blocks improves DecompX's deletion",
                 "skipplus:decompx", ["decompx"], "deletion", False, "deletion "),
           claim("SkipPLUS: … and its insertion − deletion", "skipplus:decompx", ["decompx"],
                 "insertion_minus_deletion", True),
           claim("PLUS improves DecompX's deletion", "plus:decompx", ["decompx"], "deletion",
                 False, "deletion ")]
    col = "insertion_minus_deletion"
    ranked = sorted((m for m in res if m != "random"), key=lambda m: -res[m][col].value)
    others = [m for m in ranked if m != "tis"]
    ds = {b: diff("tis", b, col) for b in others}
    rank = ranked.index("tis")
    # the decisive differences: to every method ranked above TIS, or to the runner-up
    shown = ranked[:rank] if rank else ranked[1:2]
    detail = (f"TIS {_ci(ci('tis', col))}, rank {rank + 1} of {len(ranked)}; "
              + "; ".join(f"{b} {_ci(ci(b, col))}, Δ {_ci(ds[b], sign=True)}"
                          for b in shown))
    beyond = [b for b in others if ds[b].high < 0]
    if beyond:
        detail += f"; better beyond noise: {', '.join(beyond)}"
    out.append(Claim("TIS has the best insertion − deletion",
                     verdict(list(ds.values()), higher_is_better=True), rank == 0, detail))
    for c, name in (("miou", "mIoU"), ("map", "mAP")):
        out.append(claim(f"TokenTM beats GAE and Chefer'21 on segmentation ({name})",
                         "tokentm", ["gae", "chefer21"], c, True))
    out.append(claim("TokenTM beats GAE and Chefer'21 on positive perturbation", "tokentm",
                     ["gae", "chefer21"], "perturbation_pos", False, digits=2))
    return out


PER_IMAGE = "per_image.csv"
CLAIMS = "claims.md"
"""The claims table alone (included by the Results page)."""
IOU_STATS = ("inter_bg", "union_bg", "inter_fg", "union_fg")


def write_per_image(path: Path, results: dict[str, dict[str, MetricResult]],
                    ablation: list[MetricResult]) -> None:
    """Every image's value of every table column (mIoU as its intersections and unions,
    which the dataset value accumulates) and of every ablation row, one row per image."""
    cols: dict[str, Tensor] = {}
    for m, rs in results.items():
        for col, _, _ in COLUMNS:
            r = rs[col]
            if r.reduction == "iou":
                cols.update({f"{m}/{col}.{k}": r.stats[k] for k in IOU_STATS})
            else:
                cols[f"{m}/{col}"] = r.per_example
    cols.update({f"skip{k}/deletion": r.per_example for k, r in enumerate(ablation)})
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["image", *cols])
        rows = torch.stack([v.detach().cpu().double() for v in cols.values()], 1).tolist()
        for i, row in enumerate(rows):
            w.writerow([i, *(format(v, ".9g") for v in row)])


def read_per_image(path: Path, reductions: dict[str, str]
                   ) -> tuple[dict[str, dict[str, MetricResult]], list[MetricResult]]:
    """The results and ablation rows that :func:`write_per_image` wrote, as
    :class:`MetricResult` objects (reduced as the suite reduced them)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header, data = rows[0][1:], torch.tensor([[float(v) for v in r[1:]] for r in rows[1:]],
                                             dtype=torch.float64)
    col_of = {h: data[:, i] for i, h in enumerate(header)}
    higher = {c: h for c, _, h in COLUMNS}
    results: dict[str, dict[str, MetricResult]] = {}
    ablation: dict[int, MetricResult] = {}
    for h, v in col_of.items():
        key, col = h.split("/", 1)
        if key.startswith("skip") and col == "deletion" and key[4:].isdigit():
            ablation[int(key[4:])] = MetricResult("deletion", v, False)
        elif "." in col:
            col, stat = col.split(".")
            if stat != IOU_STATS[0]:
                continue
            stats = {k: col_of[f"{key}/{col}.{k}"] for k in IOU_STATS}
            per = (stats["inter_bg"] / stats["union_bg"].clamp_min(1)
                   + stats["inter_fg"] / stats["union_fg"].clamp_min(1)) / 2
            results.setdefault(key, {})[col] = MetricResult(col, per, higher[col],
                                                            stats=stats, reduction="iou")
        else:
            results.setdefault(key, {})[col] = MetricResult(col, v, higher[col],
                                                            reduction=reductions[col])
    return results, [ablation[k] for k in sorted(ablation)]


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
    ap.add_argument("--summary-only", action="store_true",
                    help="only rewrite README.md, ablation.csv and ablation.png from the "
                         "per-image values kept in --out (no evaluation)")
    args = ap.parse_args()
    out = Path(args.out)
    if args.summary_only:
        write_summary(out, args.n)
        return
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
                write_per_image(out / name / PER_IMAGE, results,
                                [abl[f"skip{k}"]["deletion"] for k in range(L)])
                part = {"n": args.n, "processes": world, "values": _values(results),
                        "reductions": {c: results[METHODS[0]][c].reduction
                                       for c, _, _ in COLUMNS},
                        "seconds": seconds, "blocks": L,
                        "ablation": [abl[f"skip{k}"]["deletion"].value for k in range(L)],
                        "minutes": (time.time() - start) / 60}
                (out / name / "summary.json").write_text(json.dumps(part, indent=1) + "\n")
                print(report.text_table(results, seconds), flush=True)
        if rank == 0:
            write_summary(out, args.n)


def _digits(x: float) -> int:
    return 3 if abs(x) < 10 else 1


def load(out: Path, n: int) -> dict[str, dict]:
    """Every model's ``summary.json`` for ``n`` images with its per-image results
    (``"results"``, ``"ablation_results"``); refuses per-image values that do not give
    the summary's numbers."""
    parts = {m: json.loads((out / m / "summary.json").read_text()) for m in MODELS
             if (out / m / "summary.json").is_file()}
    parts = {m: p for m, p in parts.items() if p["n"] == n}
    for m, p in parts.items():
        if not (out / m / PER_IMAGE).is_file():
            raise SystemExit(f"{out / m / PER_IMAGE} is missing: rerun `scripts/paper_claims.py "
                             f"--models {m} --num-examples {n}` (it keeps the per-image values "
                             "the intervals need)")
        res, abl = read_per_image(out / m / PER_IMAGE, p["reductions"])
        for meth, cols in p["values"].items():
            for col, _, _ in COLUMNS:
                if not math.isclose(res[meth][col].value, cols[col], rel_tol=1e-7,
                                    abs_tol=1e-9):
                    raise SystemExit(f"{m}: {meth} {col} from {PER_IMAGE} is "
                                     f"{res[meth][col].value}, summary.json says {cols[col]}")
        p["results"], p["ablation_results"] = res, abl
    return parts


def claims_table(parts: dict[str, dict], n_boot: int = N_BOOT) -> list[str]:
    """The claims table (markdown lines): one row per claim, one verdict cell per model."""
    models = list(parts)
    lines = ["| claim | " + " | ".join(f"`{m}`" for m in models) + " |",
             "|---|" + "---|" * len(models)]
    verdicts = {m: claims(parts[m]["results"], n_boot=n_boot) for m in models}
    for i, c in enumerate(verdicts[models[0]]):
        lines.append(f"| {c.text} | "
                     + " | ".join(verdicts[m][i].cell() for m in models) + " |")
    return lines


def write_summary(out: Path, n: int, n_boot: int = N_BOOT) -> None:
    """``README.md``, ``claims.md``, ``ablation.csv`` and ``ablation.png`` in ``out`` from the
    ``<model>/summary.json`` and ``<model>/per_image.csv`` of every model evaluated on
    ``n`` images (run the models together or one at a time). Every number comes with its
    95 % bootstrap interval over the images; every difference with its paired interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = load(out, n)
    models = list(parts)

    def ci(r: MetricResult) -> BootstrapCI:
        return bootstrap_ci(r, n_boot=n_boot, seed=0)

    lines = [f"# The papers' claims on both bundled models ({n} test images)",
             "", "Regenerate with `torchrun --standalone --nproc_per_node=2 "
             f"scripts/paper_claims.py --num-examples {n}` ("
             + "; ".join(f"`{m}`: {parts[m]['minutes']:.1f} min with "
                         f"{count_noun(parts[m]['processes'], 'process', 'processes')}"
                         for m in models)
             + " on the 2-core CPU, sharing it with other jobs). FashionMNIST-Loc "
             "test split, seed 0, predicted class, true token removal.", "",
             f"Every number is followed by its 95 % confidence interval over the images "
             f"`[low, high]`: the 2.5th and 97.5th percentiles of the number on {n_boot:,} "
             f"resamples of the {n} images drawn with replacement (seed 0; "
             "`captum_vit.metrics.report.bootstrap_ci`; mIoU re-accumulates the resampled "
             "images' intersections and unions). A difference Δ between two methods is "
             "resampled in pairs: the same images for both (`paired_bootstrap_ci`). A claim "
             "**holds** when the interval of every difference it rests on lies on the "
             "claimed side of 0, **does not hold** when one lies on the other side, and is "
             "**within noise** otherwise (an interval contains 0; how the point estimates "
             "fall is given in brackets).", ""]
    for m in models:
        v = parts[m]["values"]
        res = parts[m]["results"]
        lines += [f"## `{m}` ({parts[m]['blocks']} blocks)", "",
                  "| method | " + " | ".join(h for _, h, _ in COLUMNS) + " | s/image |",
                  "|---|" + "---:|" * (len(COLUMNS) + 1)]
        for meth, cols in v.items():
            cells = []
            for col, _, higher in COLUMNS:
                vals = [v[k][col] for k in v if k != "random"]
                best = max(vals) if higher else min(vals)
                cell = _ci(ci(res[meth][col]), _digits(cols[col]))
                cells.append(f"**{cell}**" if cols[col] == best and meth != "random" else cell)
            sec = parts[m]["seconds"].get(meth, math.nan)
            lines.append(f"| {meth} | " + " | ".join(cells) + f" | {sec:.3g} |")
        lines.append("")
    table = claims_table(parts, n_boot)
    # the Results page includes claims.md: the same table, nothing to copy by hand
    (out / CLAIMS).write_text("\n".join(table) + "\n")
    lines += ["## Claims", "", "Δ: the first method's number minus the other's, with its "
              "paired interval.", "", *table]
    lines += ["", "## SkipPLUS ablation: DecompX summed over the sub-networks from block k",
              "", "Deletion ↓ of `PLUS(model, \"decompx\", layers=range(k, L))`: k = 0 is "
              "PLUS, k = ⌈L/2⌉ SkipPLUS, k = L − 1 the last block alone; Δ: minus the "
              "deletion of DecompX alone on the same images (paired interval; positive: "
              "the sum deletes worse).", "",
              "![ablation](ablation.png)", "",
              "| skipped blocks k | "
              + " | ".join(f"`{m}` | Δ vs DecompX (`{m}`)" for m in models) + " |",
              "|---:|" + "---:|" * (2 * len(models))]
    abl = {m: [ci(r) for r in parts[m]["ablation_results"]] for m in models}
    deltas = {m: [paired_bootstrap_ci(r, parts[m]["results"]["decompx"]["deletion"],
                                      n_boot=n_boot, seed=0)
                  for r in parts[m]["ablation_results"]] for m in models}
    depth = max(len(abl[m]) for m in models)
    rows = []
    for k in range(depth):
        cells, row = [], [k]
        for m in models:
            if k < len(abl[m]):
                a, d = abl[m][k], deltas[m][k]
                cells += [_ci(a, 4), _ci(d, 4, sign=True)]
                row += [a.estimate, a.low, a.high, d.estimate, d.low, d.high]
            else:
                cells += ["", ""]
                row += [None] * 6
        rows.append(row)
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    (out / "README.md").write_text("\n".join(lines) + "\n")
    with open(out / "ablation.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["skipped_blocks", *(f"{m}{s}" for m in models for s in (
            "", "_low", "_high", "_minus_decompx", "_minus_decompx_low",
            "_minus_decompx_high"))])
        w.writerows([["" if x is None else x for x in r] for r in rows])
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for m in models:
        ys = abl[m]
        est = [c.estimate for c in ys]
        err = [[c.estimate - c.low for c in ys], [c.high - c.estimate for c in ys]]
        line = ax.errorbar(range(len(ys)), est, yerr=err, marker="o", capsize=2,
                           label=f"{m} ({len(ys)} blocks)")
        ax.axhline(parts[m]["results"]["decompx"]["deletion"].value, ls="--", lw=0.8,
                   color=line.lines[0].get_color(), label=f"{m}: DecompX alone")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("skipped blocks k (sum over sub-networks from block k)")
    ax.set_ylabel("deletion AUC (lower is better)")
    ax.set_title("95 % bootstrap intervals over images", fontsize=8)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(out / "ablation.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
