"""Evaluation suite: faithfulness, localisation, robustness, sanity checks.

Every metric takes ``(model, inputs, attribution, ...)`` where ``attribution`` is either
precomputed maps (patch scores [B, P], a grid, or pixel maps) or any Captum-style
attribution (ours, ``IntegratedGradients(model)``, ``NoiseTunnel(Saliency(model))``, a
callable), and returns :class:`MetricResult` objects (per-example values, dataset value,
curves). Devices follow the inputs.
"""

from captum_vit.metrics.faithfulness import (
    aopc,
    deletion,
    insertion,
    insertion_minus_deletion,
    lodds,
    perturbation_test,
    token_ratio,
    trapezoid_auc,
)
from captum_vit.metrics.localization import pointing_game, segmentation, upsampled_maps
from captum_vit.metrics.removal import REMOVALS, RemovalEngine, patch_maps, ranking
from captum_vit.metrics.results import MetricResult, plot_curves
from captum_vit.metrics.robustness import gini, max_sensitivity, sparseness
from captum_vit.metrics.saco import saco
from captum_vit.metrics.sanity import randomization, spearman

__all__ = [
    "REMOVALS", "MetricResult", "RemovalEngine", "aopc", "deletion", "gini",
    "insertion", "insertion_minus_deletion", "lodds", "max_sensitivity", "patch_maps",
    "perturbation_test", "plot_curves", "pointing_game", "randomization", "ranking",
    "saco", "segmentation", "sparseness", "spearman", "token_ratio", "trapezoid_auc",
    "upsampled_maps",
]
