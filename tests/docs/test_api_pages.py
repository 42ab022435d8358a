"""The API reference documents only public API.

The API pages (``docs/source/api/*.rst``) are built alone with the site's autodoc settings
and hooks (``docs/source/conf.py``: :func:`setup_autodoc`; no notebooks, no support
matrix), and every documented object's name is read from the HTML: none may start with
``_``, none may be one of the method classes' internal class attributes (flags and
docstring pieces the package reads: ``examples_doc``, ``conserves``, ``removes_tokens``, ...),
and none may be a member Captum documents itself (``attribute_future``, which Captum's
own methods do not implement either), and no napoleon "TYPE:" field. The one underscore
name allowed is the package's ``__version__``. The checks are ``docs/check_api.py``'s,
which CI also runs on the full built site (``.ci/docs``). The build is skipped without
Sphinx (the ``docs`` extra).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "docs" / "source"

NAMED_IN_THE_ISSUE = ("examples_doc", "returns_doc", "score_doc", "conserves", "removes_tokens",
                      "class_agnostic", "per_head", "layer_local", "attribute_future")
"""Internal names the API reference once published (issue 42, item 7)."""

CONF = '''
import sys
sys.path.insert(0, {source!r})
from conf import *  # noqa: F403  (the site's settings)
from conf import setup_autodoc as setup  # noqa: F401  (its autodoc hooks only)

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.mathjax"]
source_suffix = {{".rst": "restructuredtext"}}
html_theme = "basic"
'''


def _load_check_api() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_api", ROOT / "docs" / "check_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_api = _load_check_api()
internal_class_attributes = check_api.internal_class_attributes
documented_names = check_api.documented_names


def test_documented_names_are_read_from_a_page():
    page = ('<dt class="sig sig-object py" id="captum_vit.GAE">x</dt>'
            '<dt class="sig sig-object py" id="captum_vit.GAE.attribute">y</dt>')
    assert documented_names(page) == ["captum_vit.GAE", "captum_vit.GAE.attribute"]


def test_internal_attributes_are_found():
    found = internal_class_attributes()
    assert {"examples_doc", "conserves", "removes_tokens", "class_agnostic", "per_head",
            "layer_local"} <= found


def test_the_conf_hook_calls_them_internal():
    sys.path.insert(0, str(SOURCE))
    try:
        conf = importlib.import_module("conf")
    finally:
        sys.path.remove(str(SOURCE))
    from captum.attr import Attribution

    import captum_vit
    from captum_vit import GAE, TokenTM
    from captum_vit.targets import ClassTarget

    internal = internal_class_attributes()
    classes = [getattr(captum_vit, n) for n in captum_vit.__all__]
    classes = [c for c in classes if isinstance(c, type) and issubclass(c, Attribution)]
    assert len(classes) > 30
    for cls in classes:
        for name in internal:
            if hasattr(cls, name):
                assert conf.internal_member(cls, name, getattr(cls, name)), (cls, name)
    assert conf.internal_member(TokenTM, "attribute_future", None)
    assert conf.internal_member(GAE, "_private", None)
    assert not conf.internal_member(GAE, "attribute", GAE.attribute)
    # a public field of a target class stays
    assert not conf.internal_member(ClassTarget, "index", getattr(ClassTarget, "index", None))


@pytest.fixture(scope="module")
def api_site(tmp_path_factory):
    pytest.importorskip("sphinx")
    tmp = tmp_path_factory.mktemp("api")
    src = tmp / "src"
    (src / "api").mkdir(parents=True)
    pages = sorted((SOURCE / "api").glob("*.rst"))
    for page in pages:
        (src / "api" / page.name).write_text(page.read_text(encoding="utf-8"),
                                             encoding="utf-8")
    (src / "index.rst").write_text(
        "API\n===\n\n.. toctree::\n\n" + "".join(f"   api/{p.stem}\n" for p in pages),
        encoding="utf-8")
    (src / "conf.py").write_text(CONF.format(source=str(SOURCE)), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    out = tmp / "html"
    run = subprocess.run([sys.executable, "-m", "sphinx", "-q", "-b", "html",
                          "-d", str(tmp / "doctrees"), str(src), str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return {p.stem: (out / "api" / f"{p.stem}.html").read_text(encoding="utf-8")
            for p in pages}


@pytest.mark.docs_build  # a Sphinx build of the API pages (a minute): CI's docs step runs it
def test_the_api_pages_show_only_public_names(api_site):
    names, bad = check_api.check_pages(api_site)
    assert len(names) > 150  # the pages were built with their autodoc entries
    assert "captum_vit.GAE.attribute" in names and "captum_vit.TokenTM.attribute" in names
    assert not bad, "internal names on the API pages:\n" + "\n".join(bad)
    assert set(NAMED_IN_THE_ISSUE) <= internal_class_attributes() | set(check_api.CAPTUM_OWN)


def test_the_checker_reports_internal_names_and_type_fields(tmp_path, capsys):
    """``docs/check_api.py``, which CI runs on the built site (``.ci/docs``)."""
    page = ('<dt class="sig sig-object py" id="captum_vit.GAE">x</dt>'
            '<dt class="sig sig-object py" id="captum_vit.GAE.attribute">y</dt>')
    assert check_api.check_pages({"methods": page})[1] == []
    bad = page + ('<dt class="sig sig-object py" id="captum_vit.GAE.conserves">z</dt>'
                  '<dt class="sig sig-object py" id="captum_vit.GAE._probe">z</dt>'
                  '<dt class="sig sig-object py" id="captum_vit.TokenTM.attribute_future">'
                  '</dt><p>TYPE: bool</p>')
    problems = check_api.check_pages({"methods": bad})[1]
    assert len(problems) == 4 and any("TYPE:" in p for p in problems)
    (tmp_path / "api").mkdir()
    (tmp_path / "api" / "methods.html").write_text(bad, encoding="utf-8")
    assert check_api.main([str(tmp_path)]) == 1
    assert "captum_vit.GAE.conserves" in capsys.readouterr().err
    (tmp_path / "api" / "methods.html").write_text(page, encoding="utf-8")
    assert check_api.main([str(tmp_path)]) == 0
