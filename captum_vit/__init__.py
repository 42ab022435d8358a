"""captum_vit: Vision-Transformer explanation methods as Captum attributions.

The names below are imported on first use (``from captum_vit import GAE`` imports the
methods, and torch, then), so that ``import captum_vit`` and ``captum-vit --help`` are
quick. The methods' names are those of :mod:`captum_vit.methods` (its ``__all__``, the one
import list); ``__all__`` and ``dir()`` read it on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    "PLUS": "captum_vit.combinators",
    "SkipPLUS": "captum_vit.combinators",
    "adapt": "captum_vit.adapters",
    "export_quantus": "captum_vit.interop",
    "quantus_explain_func": "captum_vit.interop",
    "EmbeddingTarget": "captum_vit.targets",
}
"""Public names beside the methods' -> the module defining them."""

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ imports lazily
    from captum_vit import metrics  # noqa: F401
    from captum_vit.adapters import adapt  # noqa: F401
    from captum_vit.combinators import PLUS, SkipPLUS  # noqa: F401
    from captum_vit.interop import export_quantus, quantus_explain_func  # noqa: F401
    from captum_vit.methods import *  # noqa: F403
    from captum_vit.targets import EmbeddingTarget  # noqa: F401


def _methods() -> list[str]:
    return list(importlib.import_module("captum_vit.methods").__all__)


def __getattr__(name: str) -> Any:
    """Import a public name, ``__all__`` or the ``metrics`` sub-package on first use."""
    if name == "__all__":
        value: Any = [*_methods(), *_LAZY, "metrics", "__version__"]
    elif name == "metrics":
        return importlib.import_module("captum_vit.metrics")
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif not name.startswith("_") and name in _methods():
        value = getattr(importlib.import_module("captum_vit.methods"), name)
    else:
        raise AttributeError(f"module 'captum_vit' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__getattr__("__all__")))
