"""Packaging: every third-party module the package imports is a declared dependency."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
ROOT = Path(__file__).resolve().parents[2]
# import name -> distribution name where they differ
DISTRIBUTION = {"PIL": "pillow", "sklearn": "scikit-learn", "yaml": "pyyaml",
                "open_clip": "open_clip_torch"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_every_imported_third_party_package_is_declared():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [d for group in meta.get("optional-dependencies", {}).values() for d in group]
    declared = {re.split(r"[<>=!~\[; ]", d)[0].lower().replace("_", "-")
                for d in [*meta["dependencies"], *extras]}  # extras' imports are lazy
    used = set().union(*(_imports(p) for p in (ROOT / "captum_vit").rglob("*.py")))
    third_party = {n for n in used
                   if n not in sys.stdlib_module_names and n not in ("captum_vit", "__future__")}
    missing = {DISTRIBUTION.get(n, n).lower().replace("_", "-") for n in third_party} - declared
    assert not missing, f"imported but not declared in pyproject.toml: {sorted(missing)}"


def test_no_extra_installs_what_no_code_uses():
    """An optional extra must serve code in the package (the old ``hf`` extra did not)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get(
        "optional-dependencies", {})
    used = set().union(*(_imports(p) for p in (ROOT / "captum_vit").rglob("*.py")))
    assert "hf" not in extras or "transformers" in used
