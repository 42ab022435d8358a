"""Robustness and complexity: Max-Sensitivity (Yeh et al., NeurIPS 2019) and
sparseness (Gini index)."""

from __future__ import annotations

from typing import Any, cast

import torch
from captum.metrics import sensitivity_max
from torch import Tensor, nn

from captum_vit._base import TargetLike
from captum_vit.metrics.maps import AttributionLike, patch_maps
from captum_vit.metrics.removal import example_seeds, prepare_metric, vector_targets
from captum_vit.metrics.results import MetricResult


def gini(values: Tensor) -> Tensor:
    r"""Gini index of each row of ``values`` [B, n] (non-negative), in [0, 1 - 1/n].

    :math:`G = \sum_i (2i - n - 1) v_{(i)} / (n \sum_i v_i)` with :math:`v_{(i)}` sorted
    ascending (Hurley & Rickard); an all-zero row has G = 0.
    """
    v = values.double().sort(dim=1).values
    n = v.shape[1]
    i = torch.arange(1, n + 1, dtype=v.dtype, device=v.device)
    total = v.sum(1)
    g = ((2 * i - n - 1) * v).sum(1) / (n * total.clamp_min(1e-300))
    return torch.where(total > 0, g, torch.zeros_like(g))


@vector_targets
def sparseness(model: nn.Module, inputs: Tensor, attribution: AttributionLike, *,
               target: TargetLike = None, pixel_reduce: str = "abs",
               attribute_kwargs: dict | None = None) -> MetricResult:
    """Sparseness: Gini index of ``|map|`` over the patches (higher = sparser).

    Args:
        model (nn.Module): a supported ViT classifier.
        inputs (Tensor): images [B, C, H, W].
        attribution: maps or an attribution (see :func:`patch_maps`).
        target (optional): class the maps explain (``None``: predicted class).

    Returns:
        MetricResult: per-example Gini index.

    Examples::

        >>> sparseness(model, x, GAE(model)).value
    """
    _, p = prepare_metric(model, inputs, target)
    scores = patch_maps(attribution, p.images, p.target, p.layout,
                        pixel_reduce=pixel_reduce, attribute_kwargs=attribute_kwargs)
    return MetricResult("sparseness", gini(scores.abs()), True)


@vector_targets
def max_sensitivity(model: nn.Module, inputs: Tensor, attribution: AttributionLike, *,
                    target: TargetLike = None, radius: float = 0.02, n_samples: int = 10,
                    seed: int = 0, example_ids: Any = None, pixel_reduce: str = "abs",
                    attribute_kwargs: dict | None = None) -> MetricResult:
    r"""Max-Sensitivity (Yeh et al., NeurIPS 2019; TIS Table 4) through
    ``captum.metrics.sensitivity_max``.

    :math:`\max_{\|\delta\|_\infty \le r} \|\Phi(x + \delta) - \Phi(x)\| / \|\Phi(x)\|` over
    ``n_samples`` uniform draws, where :math:`\Phi` is the patch map (the same map every
    other metric uses). The target is fixed to the clean image's class. Each example's
    noise comes from a generator seeded by ``seed`` and its example id, so the value does
    not depend on the batch or the process (lower is better).

    Args:
        model (nn.Module): a supported ViT classifier.
        inputs (Tensor): images [B, C, H, W].
        attribution: an attribution (precomputed maps cannot be re-evaluated).
        radius (float): L∞ radius of the perturbations (default 0.02).
        n_samples (int): perturbations per example (default 10).

    Returns:
        MetricResult: per-example sensitivity.

    Examples::

        >>> from captum.attr import NoiseTunnel, Saliency
        >>> max_sensitivity(model, x, NoiseTunnel(Saliency(model))).value
    """
    if isinstance(attribution, Tensor):
        raise TypeError("max_sensitivity needs an attribution to re-run on perturbed inputs, "
                        "not precomputed maps")
    _, p = prepare_metric(model, inputs, target)
    inputs, layout, t = p.images, p.layout, cast(Tensor, p.target)  # resolved: not None
    seeds = example_seeds(example_ids, inputs.shape[0], seed)

    def explain(x: Tensor | tuple[Tensor], target: Tensor) -> tuple[Tensor]:
        x = x[0] if isinstance(x, tuple) else x
        target = target.reshape(-1).expand(x.shape[0]) if target.numel() == 1 else target
        with torch.enable_grad():  # sensitivity_max runs under no_grad
            return (patch_maps(attribution, x, target, layout, pixel_reduce=pixel_reduce,
                               attribute_kwargs=attribute_kwargs),)

    out = []
    for i in range(inputs.shape[0]):
        g = torch.Generator().manual_seed(seeds[i])

        def perturb(x: Tensor | tuple[Tensor], r: float, g: torch.Generator = g) -> Tensor:
            x = x[0] if isinstance(x, tuple) else x
            noise = torch.rand(x.shape, generator=g, dtype=torch.float64) * 2 * r - r
            return x + noise.to(device=x.device, dtype=x.dtype)

        out.append(sensitivity_max(explain, inputs[i:i + 1], perturb_func=perturb,
                                   perturb_radius=radius, n_perturb_samples=n_samples,
                                   target=t[i:i + 1]).reshape(()).double().cpu())
    return MetricResult("max_sensitivity", torch.stack(out), False)
