"""captum_vit: Vision-Transformer explanation methods as Captum attributions."""

from captum_vit.adapters import adapt
from captum_vit.methods import GAE, AttnGradCAM, RawAttention, Rollout

__version__ = "0.1.0"

__all__ = ["GAE", "AttnGradCAM", "RawAttention", "Rollout", "adapt", "__version__"]
