"""``scripts/paper_claims.py`` and the pages it feeds: every verdict of the papers' claims
(``docs/paper_claims/``, the Results page) comes with the 95 % bootstrap intervals of the
numbers it compares and of their differences, and "within noise" follows the intervals."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from captum_vit.metrics.report import VERDICTS
from captum_vit.metrics.results import MetricResult

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "paper_claims.py"
CLAIMS_DIR = ROOT / "docs" / "paper_claims"
RESULTS_PAGE = ROOT / "docs" / "source" / "results.md"
NUM = r"[+−-]?\d+(?:\.\d+)?"
INTERVAL = rf"{NUM} \[{NUM}, {NUM}\]"
DELTA = re.compile(rf"Δ[^\[;]*? ({NUM}) \[({NUM}), ({NUM})\]")


def _script():
    spec = importlib.util.spec_from_file_location("paper_claims", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up
    spec.loader.exec_module(mod)
    return mod


def _float(s: str) -> float:
    return float(s.replace("−", "-"))


def _expand_includes(page: Path) -> str:
    """The page's Markdown with each ``{include}`` directive replaced by the file it names
    (what Sphinx renders)."""
    text = page.read_text(encoding="utf-8")

    def sub(m: re.Match) -> str:
        target = (page.parent / m.group(1).strip()).resolve()
        assert target.is_file(), f"{page.name} includes {m.group(1)}, which does not exist"
        return target.read_text(encoding="utf-8")

    return re.sub(r"```\{include\} ([^\n]+)\n(?::[^\n]*\n)*```", sub, text)


def _verdict_cells(markdown: str) -> list[str]:
    """Every table cell that gives a verdict (holds / does not hold / within noise)."""
    cells = []
    for line in markdown.splitlines():
        if not line.startswith("|"):
            continue
        for cell in line.strip("|").split("|")[1:]:
            if re.search(r"\b(holds|does not hold|within noise)\b", cell):
                cells.append(cell.strip())
    return cells


def _check_verdict_cell(cell: str) -> str:
    """The cell states one verdict, every number it compares has an interval, and the
    verdict agrees with the intervals of its differences."""
    m = re.match(r"\*\*(holds|does not hold|within noise)\*\*", cell)
    assert m, f"a verdict cell must start with the verdict in bold: {cell!r}"
    v = m.group(1)
    assert v in VERDICTS
    deltas = [tuple(_float(x) for x in d) for d in DELTA.findall(cell)]
    assert deltas, f"no interval of a difference in {cell!r}"
    assert all(lo <= hi for _, lo, hi in deltas), cell
    # every decimal number of the cell is the estimate of an interval
    bare = re.sub(INTERVAL, "", cell)
    assert not re.search(r"\d\.\d", bare), f"a number without its interval in {cell!r}"
    has_zero = [lo <= 0 <= hi for _, lo, hi in deltas]
    if v == "holds":
        assert not any(has_zero), f"'holds' although a difference's interval contains 0: {cell}"
    if v == "within noise":
        assert any(has_zero), f"'within noise' but no interval contains 0: {cell}"
    return v


def test_every_verdict_on_the_results_page_has_an_interval():
    page = _expand_includes(RESULTS_PAGE)
    section = page.split("## The papers' claims on 4 and 12 blocks", 1)[1].split("\n## ")[0]
    cells = _verdict_cells(section)
    assert len(cells) >= 14, "the claims table (7 claims × 2 models) is missing"
    assert {_check_verdict_cell(c) for c in cells} <= set(VERDICTS)
    # no verdict table elsewhere on the page gives a verdict without an interval
    for cell in _verdict_cells(page):
        _check_verdict_cell(cell)
    # the page includes the generated table, which cannot drift from docs/paper_claims
    assert "{include} ../paper_claims/claims.md" in RESULTS_PAGE.read_text(encoding="utf-8")


def test_paper_claims_readme_gives_every_number_an_interval():
    readme = (CLAIMS_DIR / "README.md").read_text(encoding="utf-8")
    cells = _verdict_cells(readme)
    assert len(cells) >= 14
    for cell in cells:
        _check_verdict_cell(cell)
    assert (CLAIMS_DIR / "claims.md").read_text(encoding="utf-8") in readme
    # the method tables: every metric cell is "value [low, high]"
    for block in readme.split("\n## ")[1:]:
        if not block.startswith("`vit_fmnist_loc"):
            continue
        rows = [r for r in block.splitlines() if r.startswith("| ") and "---" not in r][1:]
        assert len(rows) == 9
        for row in rows:
            cells = [c.strip().strip("*") for c in row.strip("|").split("|")][1:-1]
            assert all(re.fullmatch(INTERVAL, c) for c in cells), row
    # the ablation: every k with its interval and the paired difference to DecompX
    ablation = readme.split("## SkipPLUS ablation")[1]
    rows = [r for r in ablation.splitlines() if re.match(r"\| \d+ \|", r)]
    assert len(rows) == 12
    assert all(re.search(rf"{INTERVAL} \| {INTERVAL}", r) for r in rows[:4])


def test_per_image_values_give_the_summarys_numbers():
    """The kept per-image values reproduce every number of ``summary.json`` (the intervals
    are computed from them)."""
    mod = _script()
    for name in mod.MODELS:
        part = json.loads((CLAIMS_DIR / name / "summary.json").read_text())
        assert part["n"] == 512
        res, abl = mod.read_per_image(CLAIMS_DIR / name / mod.PER_IMAGE, part["reductions"])
        for meth, cols in part["values"].items():
            for col, _, _ in mod.COLUMNS:
                assert len(res[meth][col]) == 512
                assert res[meth][col].value == pytest.approx(cols[col], rel=1e-7, abs=1e-9)
        assert [r.value for r in abl] == pytest.approx(part["ablation"], rel=1e-7)


def _fake_results(n: int, gen: torch.Generator, mod) -> dict[str, dict[str, MetricResult]]:
    """Per-image values for every method and column, some claims decided by construction:
    SkipPLUS deletes clearly worse than DecompX, PLUS clearly better, and SkipPLUS's
    insertion − deletion equals DecompX's up to symmetric noise (within noise)."""
    def r(col: str, v: torch.Tensor) -> MetricResult:
        higher = {c: h for c, _, h in mod.COLUMNS}[col]
        if col == "miou":
            inter = torch.randint(10, 40, (4, n), generator=gen).double()
            union = inter + torch.randint(1, 20, (4, n), generator=gen).double()
            stats = {"inter_bg": inter[0], "union_bg": union[0], "inter_fg": inter[1],
                     "union_fg": union[1]}
            return MetricResult(col, v, higher, stats=stats, reduction="iou")
        red = "nanmean" if col in ("map", "pointing_game") else "mean"
        return MetricResult(col, v, higher, reduction=red)

    base = {c: torch.rand(n, generator=gen, dtype=torch.float64) for c, _, _ in mod.COLUMNS}
    out = {}
    for i, m in enumerate(mod.METHODS):
        out[m] = {c: r(c, base[c] + 0.01 * i + 0.05 * torch.rand(n, generator=gen,
                                                                   dtype=torch.float64))
                  for c, _, _ in mod.COLUMNS}
    d = out["decompx"]
    out["skipplus:decompx"]["deletion"] = r("deletion", d["deletion"].per_example + 0.2)
    out["plus:decompx"]["deletion"] = r("deletion", d["deletion"].per_example - 0.2)
    noise = 0.05 * torch.randn(n, generator=gen, dtype=torch.float64)
    noise -= noise.mean()
    out["skipplus:decompx"]["insertion_minus_deletion"] = r(
        "insertion_minus_deletion", d["insertion_minus_deletion"].per_example + noise + 1e-4)
    return out


def test_summary_from_per_image_values(tmp_path, monkeypatch):
    """write_per_image -> read_per_image round trip, the claims' verdicts from the paired
    intervals, and ``--summary-only`` writing README.md, claims.md and ablation.csv."""
    mod = _script()
    gen = torch.Generator().manual_seed(0)
    n = 40
    for name, blocks in zip(mod.MODELS, (4, 12), strict=True):
        res = _fake_results(n, gen, mod)
        abl = [MetricResult("deletion", torch.rand(n, generator=gen, dtype=torch.float64),
                            False) for _ in range(blocks)]
        (tmp_path / name).mkdir()
        mod.write_per_image(tmp_path / name / mod.PER_IMAGE, res, abl)
        reductions = {c: res["decompx"][c].reduction for c, _, _ in mod.COLUMNS}
        back, back_abl = mod.read_per_image(tmp_path / name / mod.PER_IMAGE, reductions)
        for m in res:
            for c, _, _ in mod.COLUMNS:
                assert back[m][c].value == pytest.approx(res[m][c].value, rel=1e-8)
        assert [a.value for a in back_abl] == pytest.approx([a.value for a in abl], rel=1e-8)
        verdicts = {c.text: c for c in mod.claims(back, n_boot=500)}
        assert verdicts["SkipPLUS: skipping the first blocks improves DecompX's deletion"
                        ].verdict == "does not hold"
        assert verdicts["PLUS improves DecompX's deletion"].verdict == "holds"
        tie = verdicts["SkipPLUS: … and its insertion − deletion"]
        assert tie.verdict == "within noise" and tie.point_holds
        assert tie.cell().startswith("**within noise** (point estimates: holds): ")
        part = {"n": n, "processes": 1, "values": mod._values(res), "reductions": reductions,
                "seconds": {m: 0.1 for m in res}, "blocks": blocks,
                "ablation": [a.value for a in abl], "minutes": 0.5}
        (tmp_path / name / "summary.json").write_text(json.dumps(part))
    monkeypatch.setattr(sys, "argv", ["paper_claims.py", "--summary-only", "--num-examples",
                                      str(n), "--out", str(tmp_path)])
    mod.main()
    readme = (tmp_path / "README.md").read_text()
    assert (tmp_path / "claims.md").read_text() in readme
    cells = _verdict_cells(readme)
    assert len(cells) == 14
    for cell in cells:
        _check_verdict_cell(cell)
    header = (tmp_path / "ablation.csv").read_text().splitlines()[0]
    assert header.startswith("skipped_blocks,vit_fmnist_loc,vit_fmnist_loc_low,")
    # per-image values that do not give the summary's numbers are refused
    part = json.loads((tmp_path / mod.MODELS[0] / "summary.json").read_text())
    part["values"]["gae"]["deletion"] += 0.01
    (tmp_path / mod.MODELS[0] / "summary.json").write_text(json.dumps(part))
    with pytest.raises(SystemExit, match="gae deletion"):
        mod.write_summary(tmp_path, n, n_boot=100)
