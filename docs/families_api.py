"""The families section of the API reference, generated from the family catalogue.

``docs/source/api/adapters.rst`` holds, between its ``begin-generated:families`` and
``end-generated:families`` comments, one entry per registered family (its supported-models
line, tags and examples, the adapter class and the predicate), rendered by :func:`render`
from :mod:`captum_vit.adapters.catalog`; ``tests/families/test_catalog.py`` checks that the
committed page is what :func:`render` gives. Regenerate with::

    python docs/families_api.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "source" / "api" / "adapters.rst"
BEGIN = ".. begin-generated:families (python docs/families_api.py)"
END = ".. end-generated:families"
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


def section(text: str) -> str:
    """The committed section of the page ``text`` (without the markers)."""
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"expected one pair of markers {BEGIN!r} ... {END!r}")
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def main() -> int:
    text = PAGE.read_text(encoding="utf-8")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    new = f"{head}{BEGIN}\n\n{render()}\n\n{END}{tail}"
    if new != text:
        PAGE.write_text(new, encoding="utf-8")
        print(f"rewrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
