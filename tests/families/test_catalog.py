"""The family catalogue (captum_vit.adapters.catalog): a model family is one file in
``captum_vit/adapters/families/`` registered beside its adapter class plus one import line,
and dispatch, the refusal's text, ``__all__``, the test tables, the contract suite and the
support matrix all read the catalogue. The contributing guide's walk-through is run here as
it is written."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import captum_vit.adapters as adapters
from captum_vit.adapters import adapt, catalog
from tests import helpers

ROOT = Path(__file__).resolve().parents[2]
FAMILIES_DIR = ROOT / "captum_vit" / "adapters" / "families"
GUIDE = ROOT / "docs" / "source" / "contributing.md"


def family_files() -> list[str]:
    """The family modules (the private ``_*.py`` are the shared readers)."""
    return sorted(p.stem for p in FAMILIES_DIR.glob("*.py") if not p.stem.startswith("_"))


def test_every_family_file_is_imported_once_and_registers_its_adapters():
    """The import list of ``families/__init__.py`` names every family file once, in the
    order of the catalogue (the dispatch order), and each file registers a family."""
    source = (FAMILIES_DIR / "__init__.py").read_text(encoding="utf-8")
    assert "# isort: skip_file" in source  # no formatter reorders the dispatch order
    tree = ast.parse(source)
    imported = [a.name for node in tree.body if isinstance(node, ast.ImportFrom)
                for a in node.names]
    assert sorted(imported) == family_files() and len(set(imported)) == len(imported)
    modules = [f.adapter.__module__.rsplit(".", 1)[-1] for f in catalog.families()]
    assert list(dict.fromkeys(modules)) == imported  # import order = dispatch order
    assert [row for row in adapters.ADAPTERS] == [(f.predicate, f.adapter)
                                                  for f in catalog.families()]


def test_no_family_imports_a_sibling_or_imports_inside_a_function():
    """Family files import the engine and the shared readers (``_torch``, ``_timm``,
    ``_hf``, ``_examples``), never another family file, and only at module level."""
    families = set(family_files())
    for name in families:
        tree = ast.parse((FAMILIES_DIR / f"{name}.py").read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                inner = [n for n in ast.walk(node) if isinstance(n, ast.Import | ast.ImportFrom)]
                assert not inner, f"{name}.{node.name} imports inside a function"
            if isinstance(node, ast.ImportFrom) and node.module:
                target = node.module.rsplit(".", 1)[-1]
                assert not (node.module.startswith("captum_vit.adapters.families.")
                            and target in families), f"{name} imports the family {target}"


def test_the_catalogue_generates_the_tables():
    """``SUPPORTED`` is every family's one line, ``__all__`` holds every adapter class and
    predicate, and every example name of the test tables is a catalogue example."""
    rows = catalog.families()
    assert adapters.SUPPORTED == "; ".join(f.supports for f in rows)
    for f in rows:
        assert "\n" not in f.supports and set(f.tags) <= set(catalog.TAGS)
        for name in (f.adapter.__name__, f.predicate.__name__):
            assert name in adapters.__all__ and getattr(adapters, name) is not None
    names = [n for n, _, _ in catalog.examples()]
    assert len(names) == len(set(names))
    assert set(helpers.ALL_FAMILIES) | set(helpers.EMBEDDING_FAMILIES) <= set(names)
    for name in helpers.WINDOWED_FAMILIES:
        fam, _ = catalog.example(name)
        assert "windowed" in fam.example_tags(name)
    # the support matrix's own columns (tag matrix) are in no test table nor the suite
    matrix = {n for n, fam, ex in catalog.examples() if "matrix" in fam.example_tags(n)}
    assert matrix and all(not catalog.example(n)[1].suite for n in matrix)
    tables = [v for k, v in vars(helpers).items()
              if k.isupper() and isinstance(v, dict | list | tuple)]
    assert all(not matrix & set(t) for t in tables)


def _families_api():
    """``docs/families_api.py``, the renderer of the docs' family sections."""
    spec = importlib.util.spec_from_file_location("families_api",
                                                  ROOT / "docs" / "families_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_api_page_lists_every_family():
    """The families section of the API reference is rendered from the catalogue
    (``python docs/families_api.py`` rewrites it)."""
    module = _families_api()
    page = module.PAGE.read_text(encoding="utf-8")
    assert module.section(page) == module.render(), "run python docs/families_api.py"


def test_the_guide_families_table_is_rendered_from_the_catalogue():
    """The families table of ``guide/families.md`` is one row per registered family (its
    name, supported-models line, adapter file and ``notes``) and a closing row, rendered by
    ``python docs/families_api.py``; every family says what works in its ``notes``."""
    module = _families_api()
    page = module.GUIDE.read_text(encoding="utf-8")
    committed = module.section(page, module.TABLE_BEGIN, module.TABLE_END)
    assert committed == module.render_table(), "stale families table: run python " \
        "docs/families_api.py"
    rows = committed.split("\n")
    assert rows[-1] == module.LAST_ROW and len(rows) == 2 + len(catalog.families()) + 1
    for fam, row in zip(catalog.families(), rows[2:-1], strict=True):
        assert fam.notes, f"family {fam.name!r} has no notes= (its row of the docs' table)"
        file = f"adapters/families/{fam.adapter.__module__.rsplit('.', 1)[-1]}.py"
        assert (ROOT / "captum_vit" / file).is_file()
        assert row == f"| `{fam.name}`: {fam.supports} | `{file}` | {fam.notes} |"
        assert row.count(" | ") == 2  # three cells: no bar inside a cell


def test_the_docs_renderer_is_idempotent(tmp_path, monkeypatch):
    """Rendering a page twice gives the page once: ``main`` rewrites only what changed and
    keeps the text around the markers."""
    module = _families_api()
    monkeypatch.setattr(module, "ROOT", tmp_path)
    for page, begin, end, renderer in module.SECTIONS:
        copy = tmp_path / page.name
        copy.write_text(f"head\n{begin}\nstale\n{end}\ntail\n", encoding="utf-8")
        monkeypatch.setattr(module, "SECTIONS", ((copy, begin, end, renderer),))
        module.main()
        once = copy.read_text(encoding="utf-8")
        module.main()
        assert copy.read_text(encoding="utf-8") == once
        assert once.startswith(f"head\n{begin}\n\n") and once.endswith(f"\n\n{end}\ntail\n")
        assert module.section(once, begin, end) == renderer()


def test_register_family_refuses_what_it_cannot_file():
    with pytest.raises(ValueError, match="unknown tags"):
        catalog.register_family(lambda m: False, supports="x", tags=("resnet",))
    with pytest.raises(ValueError, match="one non-empty line"):
        catalog.register_family(lambda m: False, supports="two\nlines")
    with pytest.raises(ValueError, match=r"notes must be one line with no unescaped '\|'"):
        catalog.register_family(lambda m: False, supports="x", notes="a | b")
    with pytest.raises(ValueError, match="notes must be one line"):
        catalog.register_family(lambda m: False, supports="x", notes="two\nlines")
    with pytest.raises(ValueError, match="registered already"):
        catalog.register_family(lambda m: False, supports="x", name="timm_vit")(type("A", (), {}))
    with pytest.raises(ValueError, match="taken by another family"):
        catalog.register_family(lambda m: False, supports="x", name="fresh", examples={
            "vit": catalog.Example(lambda **kw: nn.Identity(), (32, 32))})(type("B", (), {}))
    assert "fresh" not in [f.name for f in catalog.families()]
    with pytest.raises(ValueError, match="library"):
        catalog.Example(lambda **kw: nn.Identity(), (32, 32), library="keras")
    with pytest.raises(ValueError, match="no family"):
        catalog.unregister_family("no_such_family")
    with pytest.raises(ValueError, match="no example model"):
        catalog.example("no_such_example")


@pytest.mark.long
def test_importing_the_adapters_imports_no_optional_library():
    """The family files import no optional library at module level (predicates look up
    classes of imported modules; examples import their library when built)."""
    code = ("import sys, captum_vit.adapters as a; a.adapt; "
            "print(sorted(m for m in ('transformers', 'torchvision', 'open_clip', 'timm') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "[]"


def _walk_through() -> str:
    """The code of the contributing guide's family walk-through."""
    text = GUIDE.read_text(encoding="utf-8")
    found = re.search(r"<!-- family walk-through -->\n```python\n(.*?)```", text, re.S)
    assert found, f"{GUIDE} lost its family walk-through"
    return found.group(1)


def test_the_contributing_walk_through_is_a_whole_family():
    """The guide's family, registered as written (a throw-away family), is found by
    ``adapt``, in the contract suite's cases (one of which it passes), in the test tables,
    the support matrix, the docs' families table and the refusal text; it is removed
    afterwards."""
    from tests.contract import test_contract

    namespace: dict = {"__name__": "walk_through"}
    exec(compile(_walk_through(), str(GUIDE), "exec"), namespace)
    try:
        assert "wrapped_vit" in [f.name for f in catalog.families()]
        model = helpers.make_model("wrapped_vit")
        assert type(model).__name__ == "WrappedViT"
        assert isinstance(adapt(model), namespace["WrappedViTAdapter"])
        x = helpers.make_inputs("wrapped_vit", batch=2)
        with torch.no_grad():
            torch.testing.assert_close(adapt(model).model_logits(x), model(x), rtol=0,
                                       atol=1e-12)
        assert "wrapped_vit" in helpers.classifier_families()
        cases = [p.values for p in test_contract.contract_cases()]
        assert ("gae", "wrapped_vit") in cases and ("tis", "wrapped_vit") in cases
        test_contract.test_outputs_batch_and_targets("gae", "wrapped_vit")
        from tests.docs.test_support_matrix import sm

        rows = {f.name: f for f in sm.family_list()}
        assert rows["wrapped_vit"].example == "wrapped_vit"
        assert rows["wrapped_vit"].kinds == ("class",)
        assert ("WrappedViT (a timm VisionTransformer in a user's module)",
                ("wrapped_vit",)) in sm.readme_rows()
        assert "WrappedViT (a timm VisionTransformer" in catalog.supported()
        wrapped = catalog.family("wrapped_vit")
        assert (f"| `wrapped_vit`: {wrapped.supports} | `walk_through.py` | {wrapped.notes} |"
                in _families_api().render_table().split("\n"))
        with pytest.raises(TypeError, match=r"WrappedViT \(a timm VisionTransformer"):
            adapt(nn.Linear(2, 2))
    finally:
        catalog.unregister_family("wrapped_vit")
    assert "wrapped_vit" not in helpers.classifier_families()
    assert not any(p.values[1] == "wrapped_vit" for p in test_contract.contract_cases())
