"""The docs' family sections, generated from the family catalogue.

``docs/source/api/adapters.rst`` holds, between its ``begin-generated:families`` and
``end-generated:families`` comments, one entry per registered family (its supported-models
line, tags and examples, the adapter class and the predicate), rendered by :func:`render`;
``docs/source/guide/families.md`` holds, between its ``begin-generated:families-table`` and
``end-generated:families-table`` comments, the families table (one row per registered family:
its name and supported-models line, its adapter file, its ``notes``), rendered by
:func:`render_table`; both read :mod:`captum_vit.adapters.catalog`.
``tests/families/test_catalog.py`` checks that the committed pages are what the renderers
give. Regenerate with::

    python docs/families_api.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "source" / "api" / "adapters.rst"
BEGIN = ".. begin-generated:families (python docs/families_api.py)"
END = ".. end-generated:families"
GUIDE = ROOT / "docs" / "source" / "guide" / "families.md"
TABLE_BEGIN = "<!-- begin-generated:families-table (python docs/families_api.py) -->"
TABLE_END = "<!-- end-generated:families-table -->"
LAST_ROW = ("| anything else, or a wrapper around a supported ViT "
            "(`nn.Sequential(Normalize(...), vit)`) | — | `TypeError` naming what is missing, "
            "or the inner module to pass |")
INHERITED = "Attribution, GradientAttribution, PerturbationAttribution, Module, tuple"


def render() -> str:
    """The section's text (without the markers), one entry per registered family."""
    from captum_vit.adapters import catalog

    out: list[str] = []
    for fam in catalog.families():
        examples = ", ".join(f"``{n}``" for n in fam.examples) or "none"
        tags = ", ".join(f"``{t}``" for t in fam.tags) or "none"
        out += [f"**{fam.name}**: {fam.supports}. Tags: {tags}; examples: {examples}.", "",
                f".. autoclass:: captum_vit.adapters.{fam.adapter.__name__}",
                "   :members:", f"   :inherited-members: {INHERITED}", "",
                f".. autofunction:: captum_vit.adapters.{fam.predicate.__name__}", ""]
    return "\n".join(out).rstrip("\n")


def adapter_file(cls: type) -> str:
    """The file of ``cls``'s module, relative to the package (``adapters/families/x.py``)."""
    parts = cls.__module__.split(".")
    return "/".join(parts[1:] if parts[0] == "captum_vit" else parts) + ".py"


def render_table() -> str:
    """The guide's families table (without the markers): one row per registered family, in
    dispatch order, and a closing row for what no family explains."""
    from captum_vit.adapters import catalog

    out = ["| family | adapter | every registered method |", "|---|---|---|"]
    for fam in catalog.families():
        supports = fam.supports.replace("|", "\\|")
        out.append(f"| `{fam.name}`: {supports} | `{adapter_file(fam.adapter)}` | "
                   f"{fam.notes or 'see the support matrix'} |")
    out.append(LAST_ROW)
    return "\n".join(out)


def section(text: str, begin: str = BEGIN, end: str = END) -> str:
    """The committed section of the page ``text`` between ``begin`` and ``end`` (without
    the markers)."""
    if text.count(begin) != 1 or text.count(end) != 1:
        raise ValueError(f"expected one pair of markers {begin!r} ... {end!r}")
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n")


SECTIONS = ((PAGE, BEGIN, END, render), (GUIDE, TABLE_BEGIN, TABLE_END, render_table))
"""``(page, begin marker, end marker, renderer)`` of every generated section."""


def main() -> int:
    for page, begin, end, renderer in SECTIONS:
        text = page.read_text(encoding="utf-8")
        section(text, begin, end)  # exactly one pair of markers
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1]
        new = f"{head}{begin}\n\n{renderer()}\n\n{end}{tail}"
        if new != text:
            page.write_text(new, encoding="utf-8")
            print(f"rewrote {page.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
