"""Check the internal links of the built documentation site, and that no page shows a path
of the machine that built it.

Every relative ``href`` and ``src`` in the built HTML must point to a file of the build, and
every ``#fragment`` to an ``id`` (or ``<a name=...>``) of the page it names. External links
(``http:``, ``https:``, ``mailto:``, ``data:`` ...) are not followed: ``sphinx-build -b
linkcheck`` is the tool for those. No page may contain a machine path
(:data:`MACHINE_PATH`: a home folder, a venv's ``site-packages``, ...), as a warning
printed by an executed notebook carries.

Usage (from the repository root, after ``sphinx-build -b html docs/source docs/_build/html``)::

    python docs/check_links.py docs/_build/html

Exits 0 when every internal link resolves and no page shows a machine path, 1 otherwise
(each broken link printed as ``page: link (why)``, each machine path as ``page: text``).
"""

from __future__ import annotations

import argparse
import re
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

# pages Sphinx writes that are not part of the site's navigation and may link loosely
_SKIP_DIRS = {"_sources", "_static", ".doctrees", ".jupyter_cache", "jupyter_execute"}

MACHINE_PATH = re.compile(r"(?:/home/|/root/|/work/|/Users/|[A-Za-z]:\\Users\\|"
                          r"site-packages/|dist-packages/|\.venv/lib/)")
"""What a path of the building machine looks like in a page."""


class _PageParser(HTMLParser):
    """Collects a page's links (``href``/``src``) and its anchors (``id``/``name``)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.links: list[str] = []
        self.anchors: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for key, value in attrs:
            if value is None:
                continue
            if key == "id" or (key == "name" and tag == "a"):
                self.anchors.add(value)
            elif key == "href" and tag in ("a", "link", "area"):
                self.links.append(value)
            elif key == "src" and tag in ("img", "script", "iframe", "source", "video"):
                self.links.append(value)


def _parse(path: Path) -> _PageParser:
    parser = _PageParser()
    parser.feed(path.read_text(encoding="utf-8", errors="replace"))
    return parser


def check_site(root: Path) -> tuple[int, list[str]]:
    """Check every internal link of the HTML pages under ``root``.

    Args:
        root (Path): the built site (the ``-b html`` output directory).

    Returns:
        tuple[int, list[str]]: the number of internal links checked and one line per broken
        link (``page: link (why)``); no lines when every link resolves.

    Raises:
        FileNotFoundError: when ``root`` has no ``index.html``.
    """
    root = root.resolve()
    if not (root / "index.html").is_file():
        raise FileNotFoundError(f"{root} has no index.html: build the site first")
    pages = [p for p in sorted(root.rglob("*.html"))
             if not _SKIP_DIRS.intersection(p.relative_to(root).parts)]
    parsed: dict[Path, _PageParser] = {}

    def page(path: Path) -> _PageParser:
        if path not in parsed:
            parsed[path] = _parse(path)
        return parsed[path]

    broken: list[str] = []
    checked = 0
    for source in pages:
        for link in page(source).links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith("//"):
                continue  # external (http, mailto, data ...)
            checked += 1
            where = f"{source.relative_to(root)}: {link}"
            if parts.path:
                if parts.path.startswith("/"):
                    broken.append(f"{where} (absolute path: breaks outside the site root)")
                    continue
                target = (source.parent / unquote(parts.path)).resolve()
                if target.is_dir():
                    target = target / "index.html"
            else:
                target = source
            if not target.is_file():
                broken.append(f"{where} (no such file)")
                continue
            if root not in target.parents:
                broken.append(f"{where} (outside the site)")
                continue
            fragment = unquote(parts.fragment)
            if fragment and target.suffix == ".html" and fragment not in page(target).anchors:
                broken.append(f"{where} (no anchor #{fragment} in {target.relative_to(root)})")
    return checked, broken


def machine_paths(root: Path) -> list[str]:
    """The machine paths shown by the HTML pages under ``root``: one line per occurrence,
    ``page: the text around it``.

    Args:
        root (Path): the built site.

    Returns:
        list[str]: empty when no page shows one.
    """
    root = root.resolve()
    found = []
    for path in sorted(root.rglob("*.html")):
        if _SKIP_DIRS.intersection(path.relative_to(root).parts):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for m in MACHINE_PATH.finditer(text):
            around = text[max(0, m.start() - 40): m.end() + 40].replace("\n", " ")
            found.append(f"{path.relative_to(root)}: ...{around}...")
    return found


def main(argv: list[str] | None = None) -> int:
    """Command line: check the site given as the only argument; print the broken links."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", type=Path, nargs="?", default=Path("docs/_build/html"),
                        help="the built HTML site (default: docs/_build/html)")
    args = parser.parse_args(argv)
    checked, broken = check_site(args.site)
    for line in broken:
        print(f"broken link: {line}", file=sys.stderr)
    paths = machine_paths(args.site)
    for line in paths:
        print(f"machine path: {line}", file=sys.stderr)
    print(f"check_links: {checked} internal links checked, {len(broken)} broken; "
          f"{len(paths)} machine paths shown")
    return 1 if broken or paths else 0


if __name__ == "__main__":
    sys.exit(main())
