"""Evaluation suite: faithfulness, localisation, robustness, sanity checks.

Every metric takes ``(model, inputs, attribution, ...)`` where ``attribution`` is either
precomputed maps (patch scores [B, P], a grid, or pixel maps) or any Captum-style
attribution (ours, ``IntegratedGradients(model)``, ``NoiseTunnel(Saliency(model))``, a
callable), and returns :class:`MetricResult` objects (per-example values, dataset value,
curves). Devices follow the inputs.

Public here: the metric functions, :class:`MetricResult` and :func:`plot_curves`, the
removal engine (:class:`RemovalEngine`, :data:`REMOVALS`), :func:`patch_maps` /
:func:`ranking` and the evaluation settings (:class:`EvalSettings`). The modules, each
public with its ``__all__``:

* :mod:`~captum_vit.metrics.maps` — any attribution as patch scores, their ranking;
* :mod:`~captum_vit.metrics.removal` — the removal engine, pixel baselines and fills;
* :mod:`~captum_vit.metrics.faithfulness`, :mod:`~captum_vit.metrics.localization`,
  :mod:`~captum_vit.metrics.robustness`, :mod:`~captum_vit.metrics.sanity`,
  :mod:`~captum_vit.metrics.saco` — the metrics;
* :mod:`~captum_vit.metrics.settings` — :class:`EvalSettings`, one frozen object for an
  evaluation's removal, steps, batch sizes, seed and explained class;
* :mod:`~captum_vit.metrics.table` — the metric table (:data:`~captum_vit.metrics.table.
  METRICS`, one row per metric) and what a metric sees of a batch;
* :mod:`~captum_vit.metrics.suite` — the evaluation loop over a data set;
  :mod:`~captum_vit.metrics.parallel` — its processes under ``torchrun``;
* :mod:`~captum_vit.metrics.protocols` — the papers' evaluation presets;
  :mod:`~captum_vit.metrics.report` / :mod:`~captum_vit.metrics.results` — tables, files,
  results.

The metrics take methods as factories or instances and never import the method registry
(:mod:`captum_vit.registry` sits below them; the command line turns names into factories).
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
from captum_vit.metrics.maps import patch_maps, ranking
from captum_vit.metrics.removal import RemovalEngine
from captum_vit.metrics.results import MetricResult, plot_curves
from captum_vit.metrics.robustness import gini, max_sensitivity, sparseness
from captum_vit.metrics.saco import saco
from captum_vit.metrics.sanity import randomization, spearman
from captum_vit.metrics.settings import REMOVALS, EvalSettings

__all__ = [
    "REMOVALS", "EvalSettings", "MetricResult", "RemovalEngine", "aopc", "deletion", "gini",
    "insertion", "insertion_minus_deletion", "lodds", "max_sensitivity", "patch_maps",
    "perturbation_test", "plot_curves", "pointing_game", "randomization", "ranking",
    "saco", "segmentation", "sparseness", "spearman", "token_ratio", "trapezoid_auc",
    "upsampled_maps",
]
