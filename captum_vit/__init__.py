"""captum_vit: Vision-Transformer explanation methods as Captum attributions."""

from captum_vit import metrics
from captum_vit.adapters import adapt
from captum_vit.combinators import PLUS, FullGradPlus, SkipPLUS
from captum_vit.methods import (
    ALTI,
    GAE,
    TIS,
    AttCAT,
    AttIxG,
    AttnGrad,
    AttnGradCAM,
    DecompX,
    GlobEnc,
    GradCAM,
    GradCAMElementWise,
    GradCAMPlusPlus,
    GradSAM,
    HiResCAM,
    LayerCAM,
    RandomMap,
    RawAttention,
    Rollout,
    ScoreCAM,
    TokenIxG,
    TokenTM,
    VanillaGrad,
    XGradCAM,
)
from captum_vit.targets import EmbeddingTarget

__version__ = "0.1.0"

__all__ = [
    "GAE", "AttCAT", "AttIxG", "AttnGradCAM", "RawAttention", "Rollout", "TokenIxG", "TokenTM",
    "DecompX", "FullGradPlus", "PLUS", "SkipPLUS", "TIS", "RandomMap", "metrics", "adapt",
    "EmbeddingTarget", "__version__", "ALTI", "AttnGrad", "GlobEnc", "GradCAM",
    "GradCAMElementWise", "GradCAMPlusPlus", "GradSAM", "HiResCAM", "LayerCAM", "ScoreCAM",
    "VanillaGrad", "XGradCAM",
]
