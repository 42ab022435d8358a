"""Check that the built API reference documents only public API.

Every documented object of the built ``api/*.html`` pages (``<dt ... id="captum_vit.X.y">``)
must have a public name: no part starting with ``_`` (the package's ``__version__``
aside), none of the method classes' internal class attributes (plain class attributes,
not methods or properties, that the package reads: ``examples_doc``, ``conserves``,
``removes_tokens``, ...: :func:`internal_class_attributes`), and none of the members Captum
documents itself (``attribute_future``, ...). A page with a napoleon ``TYPE:`` field (what
those attributes' docstrings turned into) fails too.

Usage (from the repository root, after ``sphinx-build -b html docs/source docs/_build/html``)::

    python docs/check_api.py docs/_build/html

Exits 0 when the API pages show only public names, 1 otherwise (each name printed).
"""

from __future__ import annotations

import argparse
import html
import inspect
import re
import sys
from pathlib import Path

CAPTUM_OWN = ("attribute_future", "has_convergence_delta", "compute_convergence_delta")
"""Members every method inherits from Captum's base classes (Captum documents them)."""


def internal_class_attributes() -> set[str]:
    """The plain class attributes (data: not a routine, not a property) that the public
    method classes of ``captum_vit`` define or inherit from ``captum_vit``'s own classes."""
    from captum.attr import Attribution

    import captum_vit

    names: set[str] = set()
    for public in captum_vit.__all__:
        cls = getattr(captum_vit, public)
        if not (isinstance(cls, type) and issubclass(cls, Attribution)):
            continue
        for klass in cls.__mro__:
            if not klass.__module__.startswith("captum_vit"):
                continue
            for name, value in vars(klass).items():
                if not name.startswith("_") and not (
                        inspect.isroutine(value)
                        or isinstance(value, (property, classmethod, staticmethod))):
                    names.add(name)
    return names


def documented_names(page: str) -> list[str]:
    """The ``id`` of every documented object of a built HTML page."""
    return [html.unescape(i) for i in
            re.findall(r'<dt class="sig sig-object py[^"]*" id="([^"]+)"', page)]


def check_pages(pages: dict[str, str]) -> tuple[list[str], list[str]]:
    """``(every documented name, the problems)`` of the API pages ``name -> HTML``."""
    internal = internal_class_attributes() | set(CAPTUM_OWN)
    names, bad = [], []
    for stem, page in sorted(pages.items()):
        if "TYPE:" in page:
            bad.append(f"{stem}: a napoleon 'TYPE:' field (an attribute's docstring)")
        for dotted in documented_names(page):
            names.append(dotted)
            parts = dotted.split(".")
            private = [p for p in parts if p.startswith("_")
                       and not (p == "__version__" and len(parts) == 2)]
            if private or parts[-1] in internal:
                bad.append(f"{stem}: {dotted}")
    return names, bad


def main(argv: list[str] | None = None) -> int:
    """Command line: check the API pages of the site given; print the internal names."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", type=Path, nargs="?", default=Path("docs/_build/html"),
                        help="the built HTML site (default: docs/_build/html)")
    args = parser.parse_args(argv)
    pages = {p.stem: p.read_text(encoding="utf-8") for p in sorted((args.site / "api")
                                                                    .glob("*.html"))}
    if not pages:
        print(f"check_api: no api/*.html under {args.site}: build the site first",
              file=sys.stderr)
        return 1
    names, bad = check_pages(pages)
    for line in bad:
        print(f"internal name on the API pages: {line}", file=sys.stderr)
    print(f"check_api: {len(names)} documented names on {len(pages)} pages, "
          f"{len(bad)} internal")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
