"""Attribution methods: one file per method, each readable beside its paper."""

from captum_vit.methods.attn_gradcam import AttnGradCAM
from captum_vit.methods.gae import GAE
from captum_vit.methods.ixg import AttIxG, TokenIxG, layer_gradients
from captum_vit.methods.raw_attention import RawAttention
from captum_vit.methods.rollout import Rollout

__all__ = ["AttIxG", "AttnGradCAM", "GAE", "RawAttention", "Rollout", "TokenIxG", "layer_gradients"]
