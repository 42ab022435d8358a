"""captum_vit: Vision-Transformer explanation methods as Captum attributions."""

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

__version__ = "0.1.0"

__all__ = [
    "GAE", "AttCAT", "AttIxG", "AttnGradCAM", "RawAttention", "Rollout", "TokenIxG", "TokenTM",
    "DecompX", "FullGradPlus", "PLUS", "SkipPLUS", "TIS", "RandomMap", "metrics", "adapt",
    "EmbeddingTarget", "__version__", "ALTI", "AttnGrad", "GlobEnc", "GradCAM",
    "GradCAMElementWise", "GradCAMPlusPlus", "GradSAM", "HiResCAM", "LayerCAM", "LeGrad",
    "ScoreCAM", "VanillaGrad", "XGradCAM", "RISE", "ViTCX", "BTH", "BTT", "TAM",
    "CPLRP", "AttnLRP", "TransformerAttribution", "export_quantus", "quantus_explain_func",
]
