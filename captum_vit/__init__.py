"""captum_vit: Vision-Transformer explanation methods as Captum attributions.

The names below are imported on first use (``from captum_vit import GAE`` imports the
methods, and torch, then), so that ``import captum_vit`` and ``captum-vit --help`` are
quick.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_METHODS = (
    "ALTI", "BTH", "BTT", "CPLRP", "GAE", "RISE", "TAM", "TIS", "AttCAT", "AttIxG", "AttnGrad",
    "AttnGradCAM", "AttnLRP", "DecompX", "GlobEnc", "GradCAM", "GradCAMElementWise",
    "GradCAMPlusPlus", "GradSAM", "HiResCAM", "LayerCAM", "LeGrad", "RandomMap", "RawAttention",
    "Rollout", "ScoreCAM", "TokenIxG", "TokenTM", "TransformerAttribution", "VanillaGrad",
    "ViTCX", "XGradCAM",
)

_LAZY: dict[str, str] = {
    **dict.fromkeys(_METHODS, "captum_vit.methods"),
    "PLUS": "captum_vit.combinators",
    "SkipPLUS": "captum_vit.combinators",
    "FullGradPlus": "captum_vit.combinators",
    "adapt": "captum_vit.adapters",
    "export_quantus": "captum_vit.interop",
    "quantus_explain_func": "captum_vit.interop",
    "EmbeddingTarget": "captum_vit.targets",
}
"""Public name -> the module defining it."""

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ imports lazily
    from captum_vit import metrics
    from captum_vit.adapters import adapt
    from captum_vit.combinators import PLUS, FullGradPlus, SkipPLUS
    from captum_vit.interop import export_quantus, quantus_explain_func
    from captum_vit.methods import (
        ALTI,
        BTH,
        BTT,
        CPLRP,
        GAE,
        RISE,
        TAM,
        TIS,
        AttCAT,
        AttIxG,
        AttnGrad,
        AttnGradCAM,
        AttnLRP,
        DecompX,
        GlobEnc,
        GradCAM,
        GradCAMElementWise,
        GradCAMPlusPlus,
        GradSAM,
        HiResCAM,
        LayerCAM,
        LeGrad,
        RandomMap,
        RawAttention,
        Rollout,
        ScoreCAM,
        TokenIxG,
        TokenTM,
        TransformerAttribution,
        VanillaGrad,
        ViTCX,
        XGradCAM,
    )
    from captum_vit.targets import EmbeddingTarget


def __getattr__(name: str) -> Any:
    """Import a public name (or the ``metrics`` sub-package) on first use."""
    if name == "metrics":
        return importlib.import_module("captum_vit.metrics")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'captum_vit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "GAE", "AttCAT", "AttIxG", "AttnGradCAM", "RawAttention", "Rollout", "TokenIxG", "TokenTM",
    "DecompX", "FullGradPlus", "PLUS", "SkipPLUS", "TIS", "RandomMap", "metrics", "adapt",
    "EmbeddingTarget", "__version__", "ALTI", "AttnGrad", "GlobEnc", "GradCAM",
    "GradCAMElementWise", "GradCAMPlusPlus", "GradSAM", "HiResCAM", "LayerCAM", "LeGrad",
    "ScoreCAM", "VanillaGrad", "XGradCAM", "RISE", "ViTCX", "BTH", "BTT", "TAM",
    "CPLRP", "AttnLRP", "TransformerAttribution", "export_quantus", "quantus_explain_func",
]
