"""Attribution methods: one file per method, each readable beside its paper."""

from captum_vit.methods.attcat import AttCAT
from captum_vit.methods.attn_gradcam import AttnGradCAM
from captum_vit.methods.bt import BTH, BTT
from captum_vit.methods.cam import (
    GradCAM,
    GradCAMElementWise,
    GradCAMPlusPlus,
    HiResCAM,
    LayerCAM,
    XGradCAM,
)
from captum_vit.methods.chefer import TransformerAttribution
from captum_vit.methods.decompx import DecompX, DecompXResult
from captum_vit.methods.gae import GAE
from captum_vit.methods.globenc_alti import ALTI, GlobEnc
from captum_vit.methods.gradsam import GradSAM
from captum_vit.methods.ixg import AttIxG, TokenIxG, layer_gradients
from captum_vit.methods.legrad import LeGrad
from captum_vit.methods.lrp import CPLRP, AttnLRP
from captum_vit.methods.random_map import RandomMap
from captum_vit.methods.raw_attention import RawAttention
from captum_vit.methods.rise import RISE
from captum_vit.methods.rollout import Rollout
from captum_vit.methods.scorecam import ScoreCAM
from captum_vit.methods.tam import TAM
from captum_vit.methods.tis import TIS
from captum_vit.methods.tokentm import TokenTM
from captum_vit.methods.vanilla import AttnGrad, VanillaGrad
from captum_vit.methods.vitcx import ViTCX

__all__ = [
    "ALTI", "AttCAT", "AttIxG", "AttnGrad", "AttnGradCAM", "DecompX", "DecompXResult", "GAE",
    "GlobEnc", "GradCAM", "GradCAMElementWise", "GradCAMPlusPlus", "GradSAM", "HiResCAM",
    "LayerCAM", "LeGrad", "RandomMap", "RawAttention", "Rollout", "ScoreCAM", "TIS", "TokenIxG",
    "TokenTM", "VanillaGrad", "XGradCAM", "layer_gradients", "RISE", "ViTCX", "BTH", "BTT", "TAM",
    "CPLRP", "AttnLRP", "TransformerAttribution",
]
