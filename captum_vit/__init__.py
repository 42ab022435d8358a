"""captum_vit: Vision-Transformer explanation methods as Captum attributions."""

from captum_vit.adapters import adapt
from captum_vit.methods import (
    GAE,
    AttCAT,
    AttIxG,
    AttnGradCAM,
    RawAttention,
    Rollout,
    TokenIxG,
    TokenTM,
)

__version__ = "0.1.0"

__all__ = [
    "GAE", "AttCAT", "AttIxG", "AttnGradCAM", "RawAttention", "Rollout", "TokenIxG", "TokenTM",
    "adapt", "__version__",
]
