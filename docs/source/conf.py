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
(a few minutes on two cores); the run is cached under ``docs/_build/support_matrix/`` by a
hash of the package's sources, so a rebuild without changes renders the cached run.
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


def _write_support_matrix(app):
    """Generate ``support_matrix.md`` before the sources are read (cached between builds
    while the package's sources are unchanged)."""
    from sphinx.util import logging

    log = logging.getLogger(__name__)
    log.info("support matrix: measuring, or reusing the cached run of these sources")
    support_matrix.write_page(Path(app.srcdir) / "support_matrix.md",
                              progress=lambda line: log.info(f"support matrix: {line}"))


def setup(app):
    app.connect("autodoc-process-docstring", _drop_type_docstrings)
    app.connect("builder-inited", _write_support_matrix)
