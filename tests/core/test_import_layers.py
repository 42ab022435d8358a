"""The package's import graph: no circles, nothing upward.

Every ``import`` of every module of ``captum_vit/`` is read from its source (module level
and inside functions, relative and absolute; nothing is imported), giving the graph
module -> modules it names. Two checks:

* no cycle (Tarjan's strongly connected components); a package's ``__init__`` naming its
  own submodules (re-exports) is not an edge of a cycle with them;
* the layers, top to bottom: commands -> metrics (with viz, interop) -> registry ->
  combinators -> methods -> targets / front (``_base``) -> the model families
  (``adapters.families``) -> the adapter engine (the rest of ``adapters``); data, cards, models
  and zoo sit beside (they may import adapters and the front, never methods, combinators,
  registry, metrics or commands; among themselves data < cards < zoo < models), ``_text``
  below everything. A module may import its own layer or lower ones.
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "captum_vit"
PACKAGE = "captum_vit"

LAYERS = {
    "captum_vit.cli": 70, "captum_vit.commands": 70,
    "captum_vit.metrics": 60, "captum_vit.viz": 60, "captum_vit.interop": 60,
    "captum_vit.registry": 50,
    "captum_vit.combinators": 40,
    "captum_vit.methods": 30,
    "captum_vit.targets": 20, "captum_vit._base": 20,
    "captum_vit.methods.table": 20,  # the method table imports nothing of the package
    "captum_vit.adapters.families": 15,
    "captum_vit.adapters": 10,
    "captum_vit._text": 0,
}
"""Module (or package) -> layer; a module may import modules of its layer or below."""

BESIDE = {"captum_vit.data": 1, "captum_vit.cards": 2, "captum_vit.zoo": 3,
          "captum_vit.models": 4}
"""Data and model loading, beside the stack (above the front), in their own order: data,
then model cards, the bundled models, the model specs."""
BESIDE_MAY_IMPORT = 20
"""The highest layer the modules beside may import (the front and targets, adapters)."""
TOP = 100
"""The package's own ``__init__`` (re-exports everything; nothing imports it)."""


@functools.cache
def modules() -> dict[str, Path]:
    """Dotted name -> source file of every module of the package."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (every ``import`` statement)."""
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        pkg = m if path.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")
                    base = base[:len(base) - node.level + 1]
                    name = ".".join(base + ([node.module] if node.module else []))
                else:
                    name = node.module or ""
                # `from pkg import sub` names the submodule; `from mod import obj` the module
                found = [f"{name}.{a.name}" for a in node.names if f"{name}.{a.name}" in mods]
                if len(found) < len(node.names):
                    found.append(name)
            elif isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            else:
                continue
            for name in found:
                while name and name not in mods:  # `import a.b.c` of a non-module attribute
                    name = name.rpartition(".")[0]
                if name.startswith(PACKAGE) and name != m:
                    graph[m].add(name)
    return graph


def _is_reexport(a: str, b: str) -> bool:
    """``a`` is a package's ``__init__`` and ``b`` one of its own submodules."""
    return b.startswith(a + ".") and modules()[a].name == "__init__.py"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    edges = {a: {b for b in bs if not _is_reexport(a, b)} for a, bs in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    try:
        for v in sorted(edges):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return out


def beside(module: str) -> int | None:
    """The rank of ``module`` among the modules beside the stack (``None``: in the stack)."""
    for prefix, rank in BESIDE.items():
        if module == prefix or module.startswith(prefix + "."):
            return rank
    return None


def layer(module: str) -> int | None:
    """The layer of ``module`` (``None`` beside the stack)."""
    if module == PACKAGE:
        return TOP
    if beside(module) is not None:
        return None
    for prefix, rank in sorted(LAYERS.items(), key=lambda kv: -len(kv[0])):
        if module == prefix or module.startswith(prefix + "."):
            return rank
    raise KeyError(module)


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import that goes up the layers, as ``"a -> b"``."""
    bad = []
    for a, bs in sorted(graph.items()):
        for b in sorted(bs):
            if _is_reexport(a, b):
                continue
            la, lb = layer(a), layer(b)
            if la is None and lb is None and beside(b) > beside(a):  # type: ignore[operator]
                bad.append(f"{a} -> {b} (data < cards < zoo < models)")
            elif la is None and lb is not None and lb > BESIDE_MAY_IMPORT:
                bad.append(f"{a} -> {b} (data and model loading import only the front and "
                           "adapters)")
            elif lb is None and la is not None and la <= LAYERS["captum_vit.adapters"]:
                bad.append(f"{a} -> {b} (the adapters are below data and model loading)")
            elif la is not None and lb is not None and lb > la:
                bad.append(f"{a} -> {b} (layer {la} imports layer {lb})")
    return bad


def test_the_walk_sees_imports_inside_functions_and_relative_ones():
    graph = import_graph()
    assert len(graph) > 50
    # module-level, inside a function, `from package import submodule`
    assert "captum_vit.adapters" in graph["captum_vit.cards"]
    assert "captum_vit.data.specs" in graph["captum_vit.metrics.suite"]  # inside evaluate()
    assert "captum_vit.metrics.suite" in graph["captum_vit.metrics.protocols"]
    assert "captum_vit.zoo" in graph["captum_vit.models"]  # `from captum_vit import zoo`


def test_every_module_has_a_layer():
    unplaced = []
    for m in modules():
        try:
            layer(m)
        except KeyError:
            unplaced.append(m)
    assert not unplaced, f"put these modules in a layer of {__name__}.LAYERS: {unplaced}"


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles (each a set of modules importing one another):\n" + \
        "\n".join(" <-> ".join(c) for c in found)


def test_nothing_imports_upward():
    bad = upward(import_graph())
    assert not bad, "imports up the layers (commands -> metrics -> registry -> combinators " \
        "-> methods -> targets/_base -> adapters; data/cards/models/zoo beside):\n" + \
        "\n".join(bad)


@pytest.mark.parametrize("edges, expected", [
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
])
def test_the_cycle_finder(edges, expected, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "_is_reexport", lambda a, b: False)
    assert cycles(edges) == expected


def test_the_layer_rules():
    edges = {"captum_vit.data.transforms": {"captum_vit.models"},   # data up into models
             "captum_vit.metrics.suite": {"captum_vit.registry"},     # down: allowed
             "captum_vit.combinators": {"captum_vit.registry"},       # up
             "captum_vit.models": {"captum_vit.methods.gae"},         # beside into methods
             "captum_vit.adapters.base": {"captum_vit.data.images"},  # adapters into data
             "captum_vit.adapters.parts": {"captum_vit.adapters.families.swin"},  # engine up
             "captum_vit.adapters.families.sam": {"captum_vit.adapters.windows"},  # down
             "captum_vit.cards": {"captum_vit.adapters", "captum_vit.targets"}}
    assert [e.split(" (")[0] for e in upward(edges)] == [
        "captum_vit.adapters.base -> captum_vit.data.images",
        "captum_vit.adapters.parts -> captum_vit.adapters.families.swin",
        "captum_vit.combinators -> captum_vit.registry",
        "captum_vit.data.transforms -> captum_vit.models",
        "captum_vit.models -> captum_vit.methods.gae"]


MOVED = {  # old module -> names now defined below it, still importable from the old one
    "captum_vit.data.specs": ("class_key", "match_class_names"),
    "captum_vit.data.imagenet": ("WNID", "IMAGENET_SUBSETS", "imagenet_wnids", "model_wnids",
                                 "wnid_descriptions"),
    "captum_vit.models": ("Preprocess", "LoadedModel", "read_card", "from_card",
                          "class_index"),
    "captum_vit.metrics.removal": ("patch_maps", "ranking", "AttributionLike",
                                   "PIXEL_REDUCES", "REMOVALS", "Fill", "Removal"),
    "captum_vit.metrics.suite": ("METRICS", "DERIVED", "MetricBatch", "MetricSpec",
                                 "available_metrics", "parse_metrics", "AUTOCAST",
                                 "TARGETS", "distributed", "autocasting",
                                 "each_warning_once", "evaluate", "evaluate_batch"),
}


@pytest.mark.parametrize("module", sorted(MOVED))
def test_moved_names_stay_importable_where_they_were(module):
    import importlib

    mod = importlib.import_module(module)
    for name in MOVED[module]:
        assert hasattr(mod, name), f"{module}.{name}"
