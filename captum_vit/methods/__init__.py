"""Attribution methods: one file per method, each readable beside its paper."""

from captum_vit.methods.attcat import AttCAT
from captum_vit.methods.attn_gradcam import AttnGradCAM
from captum_vit.methods.decompx import DecompX, DecompXResult
from captum_vit.methods.gae import GAE
from captum_vit.methods.ixg import AttIxG, TokenIxG, layer_gradients
from captum_vit.methods.random_map import RandomMap
from captum_vit.methods.raw_attention import RawAttention
from captum_vit.methods.rollout import Rollout
from captum_vit.methods.tis import TIS
from captum_vit.methods.tokentm import TokenTM

__all__ = [
    "AttCAT", "AttIxG", "AttnGradCAM", "DecompX", "DecompXResult", "GAE", "RandomMap",
    "RawAttention",
    "Rollout", "TIS", "TokenIxG", "TokenTM",
    "layer_gradients",
]
