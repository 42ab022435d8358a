"""The metric table: what one metric computes from one method's maps on one batch.

:data:`METRICS` maps a metric name to a :class:`MetricSpec`: a function of one
:class:`MetricBatch` (the method, its maps, the model, the batch and the
:class:`~captum_vit.metrics.settings.EvalSettings`) returning ``{column: MetricResult}``,
and whether it needs ground-truth masks or the attribution itself (re-run on perturbed
inputs or randomised models) rather than its maps. Adding a metric is one function plus one
row; the evaluation loop (:mod:`captum_vit.metrics.suite`) and the command line read the
table and never name a metric.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from captum.attr import Attribution
from torch import Tensor, nn

from captum_vit.metrics import faithfulness as fa
from captum_vit.metrics.localization import pointing_game, segmentation
from captum_vit.metrics.results import MetricResult
from captum_vit.metrics.robustness import max_sensitivity, sparseness
from captum_vit.metrics.saco import saco
from captum_vit.metrics.sanity import randomization
from captum_vit.metrics.settings import EvalSettings

MethodFactory = Callable[[nn.Module], Attribution]
"""A method as the metrics take it: ``model -> Attribution`` (e.g.
:func:`captum_vit.registry.method_factory`)."""


class BoundMethod:
    r"""A method factory together with the one instance it built for the evaluated model.

    Calling it builds a fresh method for any model (what a metric that rebuilds the
    method on randomised copies needs); :attr:`attribution` is the instance of the
    evaluated model, built once and shared by every metric of the batch (and, in
    :func:`~captum_vit.metrics.suite.evaluate`, by every batch).

    Args:
        factory (Callable): ``model -> Attribution``.
        model (nn.Module): the evaluated model.
        attribution (Attribution, optional): ``factory(model)`` built by the caller;
            built here when not given.

    Examples::

        >>> from captum_vit.registry import method_factory
        >>> gae = BoundMethod(method_factory("gae"), model)
        >>> gae.attribution is gae.attribution
        True
        >>> gae(model) is gae.attribution          # a call always builds a new one
        False
    """

    factory: MethodFactory
    model: nn.Module
    attribution: Attribution

    def __init__(self, factory: MethodFactory, model: nn.Module,
                 attribution: Attribution | None = None) -> None:
        if isinstance(factory, BoundMethod):
            attribution = attribution if attribution is not None else (
                factory.attribution if factory.model is model else None)
            factory = factory.factory
        self.factory = factory
        self.model = model
        self.attribution = factory(model) if attribution is None else attribution

    def __call__(self, model: nn.Module) -> Attribution:
        return self.factory(model)

    def __repr__(self) -> str:
        return f"BoundMethod({getattr(self.factory, '__name__', self.factory)!r})"


_RENAMED = {"factory": "method", "removal": "settings.removal",
            "batch_size": "settings.jobs_per_forward", "n_steps": "settings.n_steps",
            "seed": "settings.seed"}


@dataclass(frozen=True)
class MetricBatch:
    """Everything a metric sees for one method on one batch.

    Attributes:
        model (nn.Module): the model.
        inputs (Tensor): images ``[B, C, H, W]``.
        maps (Tensor): the method's patch maps ``[B, P]`` for ``target`` (computed once,
            shared by every map metric); ``None`` when only callable metrics run.
        method (BoundMethod): the method: :attr:`BoundMethod.attribution` is its instance
            for ``model`` (metrics that re-run it), calling it builds a new one (metrics
            that rebuild it, e.g. on randomised copies).
        target (Tensor): the explained class of each image ``[B]``.
        labels (Tensor, optional): the classes accuracies are measured against ``[B]``
            (``None``: the clean prediction).
        masks (Tensor, optional): ground-truth regions ``[B, H, W]``.
        example_ids (list[int]): data set index of each image (seeds per example).
        settings (EvalSettings): removal, steps, forward batch and seed.
        data_labels (Tensor, optional): the data set's labels ``[B]`` whatever the
            explained class (``-1`` unknown), for protocols that explain the prediction
            but score accuracy against the labels (:mod:`captum_vit.metrics.protocols`).
    """

    model: nn.Module
    inputs: Tensor
    maps: Tensor | None
    method: BoundMethod
    target: Tensor
    labels: Tensor | None
    masks: Tensor | None
    example_ids: list[int]
    settings: EvalSettings = field(default_factory=EvalSettings)
    data_labels: Tensor | None = None

    @property
    def attribution(self) -> Attribution:
        """The method's instance for :attr:`model` (:attr:`BoundMethod.attribution`)."""
        return self.method.attribution

    @property
    def removal_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the removal metrics (:mod:`faithfulness`, :func:`saco`):
        the settings (their removal, ``jobs_per_forward`` and seed), the example ids and the
        explained class."""
        return dict(settings=self.settings, example_ids=self.example_ids, target=self.target)

    def __getattr__(self, name: str) -> Any:
        if name in _RENAMED:  # the loose settings of older versions
            warnings.warn(f"MetricBatch.{name} is deprecated; use MetricBatch."
                          f"{_RENAMED[name]}", DeprecationWarning, stacklevel=2)
            if name == "factory":
                return self.method
            if name == "batch_size":
                return self.settings.jobs_per_forward
            return getattr(self.settings, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


@dataclass(frozen=True)
class MetricSpec:
    """A row of :data:`METRICS`.

    Attributes:
        compute (Callable): :class:`MetricBatch` -> ``{column: MetricResult}``.
        needs_masks (bool): needs ground-truth masks.
        needs_callable (bool): needs the attribution itself, not only its maps.
        needs_classes (bool): measures top-1 accuracy, so it needs competing scores (a
            classifier or a set of target embeddings); skipped for a single target vector.
    """

    compute: Callable[[MetricBatch], dict[str, MetricResult]]
    needs_masks: bool = False
    needs_callable: bool = False
    needs_classes: bool = False


def _masks(b: MetricBatch) -> Tensor:
    """The batch's masks, for a metric with ``needs_masks`` (the batch then has them)."""
    return cast(Tensor, b.masks)


def _named(*results: MetricResult) -> dict[str, MetricResult]:
    return {r.name: r for r in results}


def _perturbation(b: MetricBatch) -> dict[str, MetricResult]:
    return _named(*(fa.perturbation_test(b.model, b.inputs, b.maps, order=order,
                                         labels=b.labels, **b.removal_kwargs)
                    for order in ("positive", "negative")))


def _removal(fn: Callable[..., MetricResult], **extra: Any) -> Callable[[MetricBatch], dict]:
    """A removal metric with the batch's removal settings (``extra``: fields of its
    :class:`~captum_vit.metrics.settings.EvalSettings` passed as keyword arguments, e.g.
    ``n_steps``)."""
    def compute(b: MetricBatch) -> dict[str, MetricResult]:
        kw = {k: getattr(b.settings, v) for k, v in extra.items()}
        return _named(fn(b.model, b.inputs, b.maps, **kw, **b.removal_kwargs))
    return compute


METRICS: dict[str, MetricSpec] = {
    "perturbation": MetricSpec(_perturbation, needs_classes=True),
    "aopc": MetricSpec(_removal(fa.aopc)),
    "lodds": MetricSpec(_removal(fa.lodds)),
    "deletion": MetricSpec(_removal(fa.deletion, n_steps="n_steps")),
    "insertion": MetricSpec(_removal(fa.insertion, n_steps="n_steps")),
    "token_ratio": MetricSpec(lambda b: fa.token_ratio(b.model, b.inputs, b.maps,
                                                       **b.removal_kwargs)),
    "saco": MetricSpec(lambda b: _named(saco(b.model, b.inputs, b.maps, **b.removal_kwargs))),
    "pointing_game": MetricSpec(lambda b: _named(pointing_game(
        b.model, b.inputs, b.maps, _masks(b), target=b.target)), needs_masks=True),
    "segmentation": MetricSpec(lambda b: segmentation(b.model, b.inputs, b.maps, _masks(b),
                                                      target=b.target), needs_masks=True),
    "max_sensitivity": MetricSpec(lambda b: _named(max_sensitivity(
        b.model, b.inputs, b.attribution, target=b.target, seed=b.settings.seed,
        example_ids=b.example_ids)), needs_callable=True),
    "sparseness": MetricSpec(lambda b: _named(sparseness(b.model, b.inputs, b.maps,
                                                         target=b.target))),
    "randomization": MetricSpec(lambda b: _named(randomization(
        b.model, b.inputs, b.method, target=b.target, seed=b.settings.seed)),
        needs_callable=True),
}
"""Metric name -> :class:`MetricSpec`, in table order."""

DERIVED: dict[str, tuple[str, str, Callable[[MetricResult, MetricResult], MetricResult]]] = {
    "insertion_minus_deletion": ("insertion", "deletion", fa.insertion_minus_deletion),
}
"""Columns computed from two others (placed right after the first) when both are there."""


def available_metrics(*, masks: bool = True) -> list[str]:
    """Names of :data:`METRICS` (without those needing masks when ``masks`` is False).

    Examples::

        >>> from captum_vit.metrics.table import available_metrics
        >>> available_metrics()[:3]
        ['perturbation', 'aopc', 'lodds']
    """
    return [m for m, spec in METRICS.items() if masks or not spec.needs_masks]


def parse_metrics(values: Sequence[str] | str, *, has_masks: bool = True) -> list[str]:
    r"""Metric names from command-line values (comma or space separated).

    Args:
        values (str or sequence of str): e.g. ``["aopc,lodds", "deletion"]`` or ``"all"``.
        has_masks (bool, optional): whether the data has ground-truth masks; ``all``
            then leaves out the metrics that need them, and naming one is an error.
            Default True.

    Returns:
        list[str]: names of :data:`METRICS`, repeats dropped, in the given order.

    Raises:
        ValueError: an empty list, an unknown name, or a mask metric without masks.

    Examples::

        >>> from captum_vit.metrics.table import parse_metrics
        >>> parse_metrics(["aopc,lodds", "aopc"])
        ['aopc', 'lodds']
    """
    if isinstance(values, str):
        values = [values]
    names = [n.strip().lower() for v in values for n in v.replace(",", " ").split()]
    if not names:
        raise ValueError("--metrics is empty; name at least one metric or 'all'")
    if "all" in names:
        return available_metrics(masks=has_masks)
    for n in names:
        if n not in METRICS:
            raise ValueError(f"unknown metric {n!r}; choose from {', '.join(METRICS)} or 'all'")
    masked = [n for n in names if METRICS[n].needs_masks]
    if masked and not has_masks:
        raise ValueError(f"{', '.join(dict.fromkeys(masked))} need ground-truth masks, which "
                         "the data lacks; use --data fmnist-loc, sample or synthetic")
    return list(dict.fromkeys(names))


__all__ = ["DERIVED", "METRICS", "BoundMethod", "MethodFactory", "MetricBatch", "MetricSpec",
           "available_metrics", "parse_metrics"]
