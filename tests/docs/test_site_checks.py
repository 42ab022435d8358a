"""The documentation checks CI runs on the built site: ``docs/check_links.py`` reports every
broken internal link (and none on a sound site) and every machine path a page shows,
``docs/check_pages.py`` fails a page with a
console error, no heading or no figure (the browser test skips without Chromium)."""

from __future__ import annotations

import base64
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

# a 1x1 PNG the browser decodes
PIXEL = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJ"
         "RU5ErkJggg==")
DOCS = Path(__file__).resolve().parents[2] / "docs"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, DOCS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def write_site(root: Path) -> None:
    (root / "sub").mkdir(parents=True)
    (root / "_images").mkdir()
    (root / "_images" / "fig.png").write_bytes(base64.b64decode(PIXEL))
    (root / "index.html").write_text(
        '<html><body><h1 id="top">Site</h1><a href="sub/page.html#sec">ok</a>'
        '<a href="#top">ok</a><a href="sub/">ok (folder index)</a>'
        '<a href="https://example.org/missing">external</a><img src="_images/fig.png">'
        "</body></html>")
    (root / "sub" / "index.html").write_text('<a href="../index.html">up</a>')
    (root / "sub" / "page.html").write_text('<h2 id="sec">Section</h2><a name="old"></a>')


def test_check_links_passes_a_sound_site(tmp_path):
    check_links = load("check_links")
    write_site(tmp_path)
    checked, broken = check_links.check_site(tmp_path)
    assert checked == 5 and broken == []
    assert check_links.main([str(tmp_path)]) == 0


def test_check_links_reports_machine_paths(tmp_path, capsys):
    """Issue 42: the rendered tutorials showed tqdm's warning with the builder's venv
    path."""
    check_links = load("check_links")
    write_site(tmp_path)
    assert check_links.machine_paths(tmp_path) == []
    (tmp_path / "sub" / "nb.html").write_text(
        "<pre>/work/main/.venv/lib/python3.11/site-packages/tqdm/auto.py:21: TqdmWarning: "
        "IProgress not found</pre><p>python3 -m venv .venv &amp;&amp; . .venv/bin/activate</p>")
    found = check_links.machine_paths(tmp_path)
    assert len(found) >= 1 and all(f.startswith("sub/nb.html: ") for f in found)
    assert check_links.main([str(tmp_path)]) == 1
    assert "machine path: sub/nb.html" in capsys.readouterr().err


def test_check_links_reports_each_broken_link(tmp_path):
    check_links = load("check_links")
    write_site(tmp_path)
    (tmp_path / "sub" / "bad.html").write_text(
        '<a href="page.html#nowhere">a</a><a href="gone.html">b</a><img src="../x.png">'
        '<a href="page.html#old">named anchor: fine</a>')
    checked, broken = check_links.check_site(tmp_path)
    assert checked == 9
    assert sorted(broken) == [
        "sub/bad.html: ../x.png (no such file)",
        "sub/bad.html: gone.html (no such file)",
        "sub/bad.html: page.html#nowhere (no anchor #nowhere in sub/page.html)",
    ]
    assert check_links.main([str(tmp_path)]) == 1


def test_check_links_needs_a_built_site(tmp_path):
    with pytest.raises(FileNotFoundError, match="build the site first"):
        load("check_links").check_site(tmp_path)


@pytest.mark.long
def test_check_pages_fails_console_errors_missing_headings_and_figures(tmp_path, capsys):
    check_pages = load("check_pages")
    if check_pages.find_browser() is None:
        pytest.skip("no chromium on this machine (Debian: apt-get install chromium)")
    write_site(tmp_path)
    (tmp_path / "bad.html").write_text(
        '<html><body><p>no heading</p><img src="missing.png">'
        '<script>console.error("broken"); notDefined();</script></body></html>')
    shots = tmp_path / "shots"
    assert check_pages.main([str(tmp_path), "--pages", "index.html", "--figures", "index.html",
                             "--screenshots", str(shots)]) == 0
    assert (shots / "index.png").read_bytes()[:4] == b"\x89PNG"
    assert check_pages.main([str(tmp_path), "--pages", "bad.html", "--figures", "bad.html",
                             "--screenshots", str(shots)]) == 1
    out = capsys.readouterr().out
    for problem in ("console.error: broken", "uncaught exception: ReferenceError",
                    "ERR_FILE_NOT_FOUND", "no <h1> heading", "no rendered figure"):
        assert problem in out
