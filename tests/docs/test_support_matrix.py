"""The generated support matrix (``docs/support_matrix.py``): on a small subset (two
methods × two families, every target kind they have) each cell is measured and classified,
known refusals are recorded with their message, failures are told from refusals, and the
page renders the counts, the cells and the footnotes; a cached run is rendered without
measuring again."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("support_matrix",
                                                  ROOT / "docs" / "support_matrix.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("support_matrix", module)
    spec.loader.exec_module(module)
    return module


sm = _load()
_RESULT: dict = {}


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def subset() -> dict:
    """Rollout and TIS on the timm ViT and the Hugging Face ViT (measured once)."""
    if not _RESULT:
        families = ["timm_vit", "hf_vit"] if _have("transformers") else ["timm_vit"]
        _RESULT.update(sm.generate(["Rollout", "tis"], families))
    return _RESULT


def cell(result: dict, method: str, family: str, kind: str) -> dict:
    found = [c for c in result["cells"]
             if (c["method"], c["family"], c["kind"]) == (method, family, kind)]
    assert len(found) == 1, (method, family, kind)
    return found[0]


def test_every_cell_of_the_subset_is_measured_and_classified():
    result = subset()
    assert result["methods"] == ["rollout", "tis"]  # canonical names
    families = [f for f in result["families"] if result["families"][f]["installed"]]
    expected = sum(len(sm.FAMILIES[f].kinds) for f in families) * 2
    assert len(result["cells"]) == expected
    for f in families:
        assert result["families"][f]["forward_backward"] > 0
        assert result["families"][f]["unchanged"] is True
    for c in result["cells"]:
        assert c["status"] in ("works", "refused"), c  # a failure here is a bug
        assert c["seconds"] >= 0
        if c["status"] == "works":
            assert c["ratio"] > 0 and "message" not in c
        else:
            assert c["message"].startswith(("ValueError: ", "TypeError: "))
    for f in families:
        assert cell(result, "rollout", f, "class")["status"] == "works"
        assert cell(result, "tis", f, "class")["status"] == "works"


def test_known_refusals_are_recorded_with_their_message():
    """TIS removes tokens, so it refuses a target that reads token rows; Rollout is
    class-agnostic, so it refuses a contrast of two classes."""
    result = subset()
    for f in [f for f in result["families"] if result["families"][f]["installed"]]:
        tis = cell(result, "tis", f, "token")
        assert tis["status"] == "refused"
        assert tis["message"].startswith("ValueError: TokenTarget reads token rows")
        rollout = cell(result, "rollout", f, "contrastive")
        assert rollout["status"] == "refused"
        assert "class-agnostic" in rollout["message"]
        assert cell(result, "rollout", f, "token")["status"] == "works"


def test_the_page_shows_counts_cells_and_footnotes():
    result = subset()
    page = sm.render(result, "abc")
    counts = sm._counts(result["cells"])
    assert counts["measured"] == counts["works"] + counts["refused"] + counts["failed"]
    assert (f"**{counts['measured']} cells measured: {counts['works']} work, "
            f"{counts['refused']} refused, {counts['failed']} failed.**") in page
    assert sm.COMMAND in page and "sources hash `abc`" in page
    assert "## Target: class index" in page and "## Target: Contrastive" in page
    row = next(line for line in page.splitlines() if line.startswith("| `rollout` |")
               and "refused[^" in line)
    label = row.split("refused[^")[1].split("]")[0]
    footnote = next(line for line in page.splitlines() if line.startswith(f"[^{label}]:"))
    assert "refused: `ValueError: Rollout is class-agnostic" in footnote
    assert "✓\u00a0" in page


def test_failures_are_told_from_refusals():
    """An exception raised outside captum_vit (here by the target's own code), or one that
    is not a ValueError/TypeError, is a failure; a non-finite map is one too."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4,
                              num_classes=5).eval()
    x = torch.randn(2, 3, 32, 32)

    def outside():
        return int("not a class")  # a ValueError, but not captum_vit's

    def broken():
        return torch.zeros(2).view(3)  # a RuntimeError

    s = sm.Setup(model, x, {"outside": outside, "broken": broken, "class": lambda: [0, 1],
                            "bad": lambda: [0, 7]})
    got = sm.run_cell("gae", s, "outside")
    assert got["status"] == "failed" and got["message"].startswith("ValueError: invalid")
    assert sm.run_cell("gae", s, "broken")["status"] == "failed"
    assert sm.run_cell("gae", s, "class")["status"] == "works"
    bad = sm.run_cell("gae", s, "bad")  # class 7 of 5: captum_vit's own refusal
    assert bad["status"] == "refused" and "target" in bad["message"]
    nan = sm.Setup(model, torch.full((2, 3, 32, 32), float("nan")), {"class": lambda: [0, 1]})
    got = sm.run_cell("gae", nan, "class")  # NaN inputs: refused by the input check
    assert got == {"status": "refused", "seconds": got["seconds"],
                   "message": "ValueError: inputs contain NaN or infinite values"}


def test_the_fingerprint_sees_a_changed_model():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2)).eval()
    before = sm.fingerprint(model)
    assert sm.fingerprint(model) == before
    for change in (lambda: model[0].weight.data.add_(1e-3), lambda: model.train(),
                   lambda: model[1].register_forward_hook(lambda *a: None),
                   lambda: model[0].bias.requires_grad_(False)):
        change()
        assert sm.fingerprint(model) != before
        before = sm.fingerprint(model)


def test_a_map_that_is_not_finite_is_a_failure(monkeypatch):
    import captum_vit.registry

    class NaNMethod:
        def attribute(self, inputs, target=None, output="pixels"):
            return torch.full((inputs.shape[0], 16), float("nan"))

    monkeypatch.setattr(captum_vit.registry, "build_method", lambda name, model: NaNMethod())
    s = sm.Setup(torch.nn.Identity(), torch.zeros(2, 3, 32, 32), {"class": lambda: [0, 1]})
    got = sm.run_cell("gae", s, "class", repeats=2)
    assert got["status"] == "failed" and "not finite" in got["message"]


def test_a_family_whose_library_is_missing_is_listed_not_measured(monkeypatch):
    missing = sm.Family("missing", "Missing", sm.GROUPS[0], ("class",), ("no_such_module_xyz",),
                        lambda: torch.nn.Identity(), model_class="Nothing")
    monkeypatch.setitem(sm.FAMILIES, "missing", missing)
    result = sm.generate(["random"], ["missing"])
    assert result["families"] == {"missing": {"installed": False}} and result["cells"] == []
    page = sm.render(result)
    assert "**not installed** (needs `no_such_module_xyz`)" in page
    assert "**0 cells measured" in page


def test_a_cached_run_is_rendered_without_measuring(tmp_path, monkeypatch):
    result = subset()
    digest = sm.sources_hash()
    assert digest == sm.sources_hash() and len(digest) == 16
    text = (ROOT / "docs" / "support_matrix.py").read_text(encoding="utf-8")
    # the hash covers the measuring code; the page's code is below it
    assert text.count(sm.PAGE_SECTION) == 1
    assert text.index("def generate(") < text.index(sm.PAGE_SECTION) < text.index("def render(")
    (tmp_path / f"{digest}.json").write_text(json.dumps(result))

    def no_run(*args, **kwargs):
        raise AssertionError("measured although cached")

    monkeypatch.setattr(sm, "generate", no_run)
    page = tmp_path / "support_matrix.md"
    assert sm.write_page(page, cache=tmp_path) == result
    assert page.read_text(encoding="utf-8") == sm.render(result, digest)


@pytest.mark.skipif(not _have("transformers"), reason="the hf extra is not installed")
def test_every_family_has_a_builder_and_targets():
    """Each family's model builds and each of its target kinds has a target (no cell
    run)."""
    for family in sm.FAMILY_LIST:
        assert family.group in sm.GROUPS and set(family.kinds) <= set(sm.KINDS)
        if not sm.installed(family):
            continue
        s = sm.setup(family)
        assert set(s.targets) == set(family.kinds), family.name
        assert s.inputs.shape[0] == sm.BATCH and s.inputs.dtype == sm.DTYPE


def test_every_column_is_a_catalogue_example():
    """No hand-kept family list: the matrix's columns are the family catalogue's examples,
    one each, and an example's target kind decides the column's target kinds."""
    from captum_vit.adapters import catalog

    assert not hasattr(sm, "OWN_FAMILIES")
    names = [n for n, _, _ in catalog.examples()]
    assert [f.example for f in sm.FAMILY_LIST] == names
    assert len({f.name for f in sm.FAMILY_LIST}) == len(names)
    for f in sm.FAMILY_LIST:
        ex = catalog.example(f.example)[1]
        assert ex.target in f.kinds, f.name
        if f.example not in sm.EXAMPLE_INFO:
            assert f.kinds == sm.KINDS_OF_TARGET.get(ex.target, (ex.target,))
    for kind in ("vlm", "depth", "sam_mask", "detection"):
        assert any(catalog.example(f.example)[1].target == kind for f in sm.FAMILY_LIST)


def test_the_hash_covers_the_installed_versions(monkeypatch):
    before = sm.sources_hash()
    monkeypatch.setattr(sm, "_versions", lambda: {"torch": "0.0-other"})
    assert sm.sources_hash() != before


# -- the generated tables of the README and the Targets page ------------------------------
def test_readme_and_targets_tables_are_what_the_committed_statuses_render():
    """README.md's family table and the Targets page's support table are generated from
    docs/support_status.json (the matrix's last full run): a hand edit, or a new status
    without ``python docs/support_matrix.py --tables``, fails here."""
    committed = sm.read_status()
    assert sm.table_drift(committed) == []
    # what issue 42 found drifted: TIS runs on YOLOS, it is refused on Swin
    readme = sm.generated_section((ROOT / "README.md").read_text(encoding="utf-8"),
                                  "family-table")
    yolos = next(line for line in readme.splitlines() if line.startswith("| Hugging Face YOLOS ("))
    assert "❌" not in yolos
    swin = next(line for line in readme.splitlines() if "SwinTransformer" in line)
    assert "`tis` ❌" in swin


def test_a_drifted_table_is_reported(tmp_path):
    committed = sm.read_status()
    changed = json.loads(json.dumps(committed))
    changed["families"]["hf_yolos"]["detection"]["refused"].append("tis")
    readme = tmp_path / "README.md"
    readme.write_text("intro\n" + sm._markers("family-table")[0] + "\n"
                      + sm.readme_table(committed) + "\n" + sm._markers("family-table")[1]
                      + "\nend\n", encoding="utf-8")
    files = ((readme, "family-table", sm.readme_table),)
    assert sm.table_drift(committed, files) == []
    drift = sm.table_drift(changed, files)
    assert len(drift) == 1 and "README.md" in drift[0] and "--tables" in drift[0]
    assert "YOLOS" in sm.readme_table(changed) and "`tis` ❌" in sm.readme_table(changed)
    # the build's check of a run against the committed statuses
    assert sm.status_drift(committed, committed) == []
    lines = sm.status_drift(changed, committed)
    assert len(lines) == 1 and lines[0].startswith("hf_yolos / DetectionTarget: refused")


def test_every_method_is_in_one_column_of_each_table():
    methods = sm.read_status()["methods"]
    for columns in (sm.README_COLUMNS, sm.TARGET_COLUMNS):
        for m in methods:
            taken = [h for h, take in columns if take(m)]
            assert len(taken) == (0 if m in sm.BASELINES else 1), (m, taken)
    named = {f for _, fams in sm.readme_rows() for f in fams}
    assert named <= set(sm.FAMILIES)
    # every measured family is in a README row, or refused by every method
    assert set(sm.read_status()["families"]) - named == set(sm._refused_families(
        sm.read_status()))


@pytest.mark.skipif(not _have("transformers"), reason="the hf extra is not installed")
def test_the_committed_statuses_are_what_tis_and_rise_do_now():
    """A measured slice of the committed statuses: TIS and RISE on YOLOS, a Swin, SAM and
    a VLM (the cells the README once got wrong); the documentation build compares every
    cell (docs/source/conf.py)."""
    result = sm.generate(["tis", "rise"], ["hf_yolos", "hf_swin", "hf_sam", "hf_paligemma"])
    measured = sm.statuses(result)
    assert set(measured["families"]) == {"hf_yolos", "hf_swin", "hf_sam", "hf_paligemma"}
    assert sm.status_drift(measured, sm.read_status()) == [
        f"methods measured differ from {sm.STATUS.name}: "
        f"{sorted(set(sm.read_status()['methods']) - {'tis', 'rise'})}"]
    assert measured["families"]["hf_yolos"]["detection"]["refused"] == []
    assert measured["families"]["hf_swin"]["class"]["refused"] == ["tis"]


DISTRIBUTIONS = {"timm": "timm", "transformers": "transformers", "torchvision": "torchvision",
                 "open_clip": "open_clip_torch"}
"""The distribution that installs each module a family requires."""


def test_the_docs_extra_installs_every_library_the_matrix_measures():
    """A user's ``pip install -e ".[docs]"`` build fills every family's cells (issue 42:
    the OpenCLIP rows said "not installed" where CI's build filled them)."""
    import re

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["docs"]
    names = {re.split(r"[<>=!~\[ ;]", req, maxsplit=1)[0].lower().replace("-", "_")
             for req in wanted}
    for family in sm.FAMILY_LIST:
        for module in family.requires:
            assert DISTRIBUTIONS[module].lower() in names, (family.name, module)
