"""Attribution methods: one file per method, each readable beside its paper.

Each class registers itself with :func:`~captum_vit.methods.table.register_method` beside
its definition; the import lines below are the ONE list of methods, and their order is
the order of the registry's tables and plots. A new method is its file plus one line
here. ``__all__`` is every public name these lines import.
"""
# ruff: noqa: F401  (every import is a re-export: __all__ is computed from them)

from types import ModuleType as _ModuleType

# the order of these lines is the order of tables and plots
# isort: off
from captum_vit.methods.raw_attention import RawAttention
from captum_vit.methods.rollout import Rollout
from captum_vit.methods.gae import GAE
from captum_vit.methods.attn_gradcam import AttnGradCAM
from captum_vit.methods.attcat import AttCAT
from captum_vit.methods.tokentm import TokenTM
from captum_vit.methods.ixg import TokenIxG, AttIxG
from captum_vit.methods.decompx import DecompX, DecompXResult
from captum_vit.methods.tis import TIS
from captum_vit.methods.vanilla import VanillaGrad, AttnGrad
from captum_vit.methods.gradsam import GradSAM
from captum_vit.methods.globenc_alti import GlobEnc, ALTI
from captum_vit.methods.cam import GradCAM, GradCAMPlusPlus, XGradCAM, LayerCAM, HiResCAM
from captum_vit.methods.cam import GradCAMElementWise
from captum_vit.methods.scorecam import ScoreCAM
from captum_vit.methods.legrad import LeGrad
from captum_vit.methods.bt import BTH, BTT
from captum_vit.methods.tam import TAM
from captum_vit.methods.rise import RISE
from captum_vit.methods.vitcx import ViTCX
from captum_vit.methods.lrp import CPLRP, AttnLRP
from captum_vit.methods.chefer import TransformerAttribution
from captum_vit.methods.fullgrad import FullGradPlus
from captum_vit.methods.random_map import RandomMap
# isort: on
from captum_vit.methods._engines import (
    GradientRoute,
    PLUSFastPath,
    layer_gradients,
    per_layer_fast,
    skip_start,
)
from captum_vit.methods.table import register_method

__all__ = [n for n, v in list(globals().items())
           if not n.startswith("_") and not isinstance(v, _ModuleType)]
