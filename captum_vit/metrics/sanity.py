"""Model-randomisation sanity check (Adebayo et al., NeurIPS 2018).

The maps of the model are compared (Spearman rank correlation over the patches) with the
maps of copies whose parameters are randomised in cascade from the top: first the head
(final norm and classifier), then block L-1, L-2, ..., 0. Randomisation replaces every
parameter tensor of a stage by Gaussian noise with the tensor's own mean and standard
deviation (seeded); it is applied to a deep copy, never to the user's model. A method
that explains the model must change: low correlation is better.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, TypeAlias

import torch
from captum.attr import Attribution
from torch import Tensor, nn

from captum_vit._base import TargetLike
from captum_vit.adapters import adapt
from captum_vit.metrics.maps import patch_maps
from captum_vit.metrics.removal import prepare_metric, vector_targets
from captum_vit.metrics.results import MetricResult

MethodLike: TypeAlias = Attribution | Callable[[nn.Module], Attribution]


def spearman(a: Tensor, b: Tensor) -> Tensor:
    """Spearman rank correlation of each row pair [B, n] (average ranks for ties; NaN
    when a row is constant)."""
    from scipy.stats import rankdata

    ra = torch.as_tensor(rankdata(a.double().cpu().numpy(), axis=1))
    rb = torch.as_tensor(rankdata(b.double().cpu().numpy(), axis=1))
    ra, rb = ra - ra.mean(1, keepdim=True), rb - rb.mean(1, keepdim=True)
    den = (ra.norm(dim=1) * rb.norm(dim=1))
    return torch.where(den > 0, (ra * rb).sum(1) / den.clamp_min(1e-300), torch.nan)


def _model_of(attr: Any) -> nn.Module:
    f = getattr(attr, "forward_func", None)
    if isinstance(f, nn.Module):
        return f
    inner = getattr(attr, "attribution_method", None)
    if inner is not None:
        return _model_of(inner)
    raise TypeError("cannot find the model of this attribution; pass a method name or a "
                    "factory `model -> Attribution` as method")


def _build(method: MethodLike, model: nn.Module) -> tuple[Attribution, nn.Module, Callable | None]:
    """An attribution for a deep copy of its model and a way to rebuild it on another copy."""
    if isinstance(method, Attribution):
        orig = _model_of(method)
        memo: dict[int, Any] = {}
        clone = copy.deepcopy(method, memo)
        return clone, memo.get(id(orig), _model_of(clone)), None
    if isinstance(method, str) or not callable(method):
        raise TypeError("method must be a Captum Attribution or a factory model -> Attribution "
                        f"(got {type(method).__name__}); for a method name use "
                        "captum_vit.registry.method_factory(name)")
    return method(model), model, method


@vector_targets
def randomization(model: nn.Module, inputs: Tensor, method: MethodLike, *,
                  target: TargetLike = None, seed: int = 0, pixel_reduce: str = "abs",
                  attribute_kwargs: dict | None = None) -> MetricResult:
    """Cascading model-randomisation check (see the module docstring).

    Args:
        model (nn.Module): a supported ViT classifier (never modified).
        inputs (Tensor): images [B, C, H, W].
        method: a factory ``model -> Attribution`` (e.g.
            ``captum_vit.registry.method_factory("gae")`` or ``lambda m: Saliency(m)``),
            rebuilt on every randomised copy, or an attribution instance (deep-copied
            together with its model).
        target (optional): explained class (``None``: the original model's prediction,
            kept fixed for the randomised models).
        seed (int): seed of the randomisation.

    Returns:
        MetricResult: per-example mean correlation over the stages; ``curves`` [B, L + 1]
        correlation after randomising the head (x = 1), the head and the top block (x = 2), ...

    Examples::

        >>> from captum_vit.registry import method_factory
        >>> randomization(model, x, method_factory("gae")).value
    """
    adapter, p = prepare_metric(model, inputs, target)
    inputs, layout, t = p.images, p.layout, p.target
    kw: dict[str, Any] = dict(pixel_reduce=pixel_reduce, attribute_kwargs=attribute_kwargs)
    if isinstance(method, Attribution):
        base = method
        attr, rmodel, factory = _build(method, model)  # deep copy of method and model
    else:
        base = _build(method, model)[0]
        attr, rmodel, factory = _build(method, copy.deepcopy(model))
    ref = patch_maps(base, inputs, t, layout, **kw)
    g = torch.Generator().manual_seed(seed)
    curves = []
    radapter = adapt(rmodel)
    # the copy scores like the model (its target, its kind of probabilities)
    with radapter.probability_kind(adapter.probability), \
            radapter.targeting(adapter.head.target):
        for tensors in radapter.parameter_stages():
            with torch.no_grad():
                for w in tensors:
                    # statistics as Python floats: the noise is drawn on the CPU (the same
                    # weights on every device) while the parameter may live on a GPU
                    mean = w.double().mean().item()
                    std = w.double().std().item() if w.numel() > 1 else 0.0
                    noise = torch.randn(w.shape, generator=g, dtype=torch.float64) * std + mean
                    w.copy_(noise.to(device=w.device, dtype=w.dtype))
            if factory is not None:
                attr = factory(rmodel)  # fresh adapter state for the new weights
            curves.append(spearman(ref, patch_maps(attr, inputs, t, layout, **kw)))
    c = torch.stack(curves, 1)
    x = torch.arange(1, c.shape[1] + 1, dtype=torch.float64)
    return MetricResult("randomization", c.nanmean(1), False, x, c, reduction="nanmean")
