"""Sphinx configuration of the captum_vit documentation.

Build (from the repository root)::

    sphinx-build -W --keep-going -b html docs/source docs/_build/html

The pages hold the documentation's text (the top-level ``README.md`` is a landing page; the
front page and Getting started include its intro, set-up and build sections, between
``<!-- start:NAME -->`` / ``<!-- end:NAME -->`` markers), the tutorials are the notebooks of
``tutorials/`` (linked into ``tutorials/`` here), executed at build time and cached under
``docs/_build/``; ``-D nb_execution_mode=off`` renders them without running them.

``support_matrix.md`` is generated when the build starts (``builder-inited``) by
``docs/support_matrix.py``, which runs every method on every model family and target kind
(1 to 8 minutes on two shared cores, measured); the run is cached under
``docs/_build/support_matrix/`` by a hash of the package's sources, the script's measuring
code and the installed versions, so a rebuild without changes renders the cached run. The
build then checks the run against ``docs/support_status.json``, from which the README's and
the Targets page's support tables are generated.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
# the notebooks' kernels import the package of this checkout too
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
os.environ.setdefault("OMP_NUM_THREADS", "1")
KERNEL_WARNINGS = "ignore:IProgress not found"
"""The notebooks' kernels ignore tqdm's warning that ipywidgets is missing (tqdm.auto,
imported by Captum, warns at import in a kernel without widgets): it carried the path of
the builder's venv into the rendered page, and no page shows a machine path
(``tests/docs/test_tutorials.py`` executes the notebooks the same way and checks their outputs;
``docs/check_links.py`` checks the built pages)."""
os.environ["PYTHONWARNINGS"] = ",".join(
    p for p in (os.environ.get("PYTHONWARNINGS", ""), KERNEL_WARNINGS) if p)

import captum_vit  # noqa: E402

sys.path.insert(0, str(ROOT / "docs"))
import support_matrix  # noqa: E402

project = "captum_vit"
author = "captum_vit developers"
copyright = "captum_vit developers"  # noqa: A001
release = captum_vit.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx-mathjax-offline",  # MathJax shipped with the site: equations render offline
    "myst_nb",  # Markdown pages (it loads myst_parser) and notebooks
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "**.ipynb_checkpoints"]

# Captum-style docstrings: Google sections (Args:, Returns:, Raises:, Examples::)
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True  # "Attributes:" as fields: no second entry beside :members:
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"

myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3

# notebooks: executed at build time on the bundled model, outputs cached between builds
nb_execution_mode = "cache"
nb_execution_cache_path = str(ROOT / "docs" / "_build" / ".jupyter_cache")
nb_execution_timeout = 1800
nb_execution_raise_on_error = True
nb_kernel_rgx_aliases = {".*": "python3"}

html_theme = "furo"
html_title = f"captum_vit {release}"


def _drop_type_docstrings(app, what, name, obj, options, lines):
    """A constant re-exported without a docstring of its own shows its value (and the
    directive's text), not the docstring of its type (``dict``'s or ``tuple``'s) or of the
    object (``typing.Any``'s, for a type alias)."""
    if what not in ("data", "attribute"):
        return
    # the object's own docstring only for module constants: an attribute's (a property's)
    # is its documentation
    docs = (getattr(obj, "__doc__", None) if what == "data" else None, type(obj).__doc__)
    # a class's __doc__ can be a descriptor of its instances: only strings count
    firsts = {doc.strip().splitlines()[0].strip() for doc in docs
              if isinstance(doc, str) and doc.strip()}
    if lines and lines[0].strip() in firsts:
        lines.clear()


CAPTUM_MEMBERS_OF_ITS_OWN = ("attribute_future", "has_convergence_delta",
                             "compute_convergence_delta")
"""Members every method inherits from Captum's base classes: Captum documents them (and
``attribute_future`` is not implemented by Captum's own methods either)."""


def internal_member(owner: object, name: str, obj: object) -> bool:
    """Whether a member autodoc found on ``owner`` is internal, so not on the API pages:

    * a name starting with ``_`` (dunders of a module, such as ``__version__``, are
      documented by an ``autodata`` directive of their own, not by this hook);
    * a member inherited from Captum itself (:data:`CAPTUM_MEMBERS_OF_ITS_OWN`, or any
      member defined in a ``captum`` module);
    * on a method class (a Captum ``Attribution``), a name that some class of its MRO
      defines as a plain class attribute: data, not a method or a property
      (``examples_doc``, ``conserves``, ``removes_tokens``, ``per_head``,
      ``layer_local``, ...: flags and docstring pieces the package reads, not the user's
      options, which are ``__init__``'s and ``attribute``'s arguments), also where a
      subclass turns it into a property.
    """
    import inspect

    from captum.attr import Attribution

    if name.startswith("_") or name in CAPTUM_MEMBERS_OF_ITS_OWN:
        return True
    if not isinstance(owner, type):
        return False
    for klass in owner.__mro__:
        if name in vars(klass):
            if (getattr(klass, "__module__", "") or "").split(".")[0] == "captum":
                return True
            break
    if not issubclass(owner, Attribution):
        return False
    for klass in owner.__mro__:
        if name not in vars(klass):
            continue
        value = vars(klass)[name]
        if not (inspect.isroutine(value) or isinstance(value, (property, classmethod,
                                                               staticmethod))):
            return True
    return False


def _skip_internal(app, what, name, obj, skip, options):
    """``autodoc-skip-member``: an :func:`internal_member` is skipped; otherwise autodoc
    decides."""
    owner = _CURRENT.get("class") if what == "class" else None
    if owner is not None and internal_member(owner, name, obj):
        return True
    if name.startswith("_") and what in ("class", "module"):
        return True
    return None


_CURRENT: dict = {}


def _remember_class(app, what, name, obj, options, lines):
    """Remember the class whose members autodoc is about to document (its docstring is
    processed first), for :func:`_skip_internal`."""
    if what == "class":
        _CURRENT["class"] = obj


def setup_autodoc(app):
    """The autodoc hooks of the site (also used by the tests' build of the API pages)."""
    app.connect("autodoc-process-docstring", _remember_class, priority=100)
    app.connect("autodoc-process-docstring", _drop_type_docstrings)
    app.connect("autodoc-skip-member", _skip_internal)


def _write_support_matrix(app):
    """Generate ``support_matrix.md`` before the sources are read (cached between builds
    while the package's sources are unchanged), and check the generated tables of the
    README and the Targets page against the run."""
    from sphinx.util import logging

    log = logging.getLogger(__name__)
    log.info("support matrix: measuring, or reusing the cached run of these sources")
    result = support_matrix.write_page(
        Path(app.srcdir) / "support_matrix.md",
        progress=lambda line: log.info(f"support matrix: {line}"))
    # the README's and the Targets page's tables are rendered from the committed outcome
    # (docs/support_status.json): it must be what this run measured, and the tables what
    # it renders (a warning: an error under -W)
    committed = support_matrix.read_status()
    for line in (support_matrix.status_drift(support_matrix.statuses(result), committed)
                 + support_matrix.table_drift(committed)):
        log.warning(f"support matrix: {line}; run {support_matrix.TABLES_COMMAND}")


def setup(app):
    setup_autodoc(app)
    app.connect("builder-inited", _write_support_matrix)
