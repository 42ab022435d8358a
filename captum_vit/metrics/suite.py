"""The metric table and the evaluation loop (methods × metrics over a data set).

:data:`METRICS` maps a metric name to a :class:`MetricSpec`: a function of one
:class:`MetricBatch` (a method's maps, the model, the batch and the settings) returning
``{column: MetricResult}``, and whether it needs ground-truth masks or the attribution
itself (re-run on perturbed inputs or randomised models) rather than its maps. Adding a
metric is one function plus one row; :func:`evaluate_batch` and :func:`evaluate` read the
table, so the command line never names a metric.

:func:`evaluate` also runs under ``torchrun``: with a process group initialised (see
:func:`distributed`), rank ``r`` of ``K`` evaluates the batches ``i ≡ r (mod K)`` and the
shards are gathered on every rank. Every random choice is seeded by ``seed`` and the
example index, so the results equal those of a single process.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from captum.attr import Attribution
from torch import Tensor, nn

from captum_vit._base import check_choice, check_scalar
from captum_vit.adapters import adapt, scores_are_classes
from captum_vit.metrics import faithfulness as fa
from captum_vit.metrics.localization import pointing_game, segmentation
from captum_vit.metrics.removal import REMOVALS, patch_maps
from captum_vit.metrics.results import MetricResult
from captum_vit.metrics.robustness import max_sensitivity, sparseness
from captum_vit.metrics.saco import saco
from captum_vit.metrics.sanity import randomization

MethodFactory = Callable[[nn.Module], Attribution]
TARGETS = ("predicted", "label")


@dataclass(frozen=True)
class MetricBatch:
    """Everything a metric sees for one method on one batch.

    Attributes:
        model (nn.Module): the model.
        inputs (Tensor): images ``[B, C, H, W]``.
        maps (Tensor): the method's patch maps ``[B, P]`` for ``target`` (computed once,
            shared by every map metric).
        attribution (Attribution): the method, for metrics that re-run it.
        factory (Callable): ``model -> Attribution``, for metrics that rebuild it.
        target (Tensor): the explained class of each image ``[B]``.
        labels (Tensor, optional): ground-truth classes for accuracies (``None``: the
            clean prediction).
        masks (Tensor, optional): ground-truth regions ``[B, H, W]``.
        example_ids (list[int]): data set index of each image (seeds per example).
        removal (str): patch removal (:data:`captum_vit.metrics.removal.REMOVALS`).
        batch_size (int): forward batch of the removal engine.
        n_steps (int): deletion / insertion steps.
        seed (int): seed of baselines, noise and randomisation.
        data_labels (Tensor, optional): the data set's labels ``[B]`` whatever the target
            (``-1`` unknown), for protocols that explain the prediction but score accuracy
            against the labels (:mod:`captum_vit.metrics.protocols`).
    """

    model: nn.Module
    inputs: Tensor
    maps: Tensor | None
    attribution: Attribution
    factory: MethodFactory
    target: Tensor
    labels: Tensor | None
    masks: Tensor | None
    example_ids: list[int]
    removal: str = "token"
    batch_size: int = 64
    n_steps: int = 20
    seed: int = 0
    data_labels: Tensor | None = None

    @property
    def removal_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the removal metrics (:mod:`faithfulness`)."""
        return dict(removal=self.removal, batch_size=self.batch_size,
                    example_ids=self.example_ids, seed=self.seed, target=self.target)


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


def _named(*results: MetricResult) -> dict[str, MetricResult]:
    return {r.name: r for r in results}


def _perturbation(b: MetricBatch) -> dict[str, MetricResult]:
    return _named(*(fa.perturbation_test(b.model, b.inputs, b.maps, order=order,
                                         labels=b.labels, **b.removal_kwargs)
                    for order in ("positive", "negative")))


def _removal(fn: Callable[..., MetricResult], **extra: Any) -> Callable[[MetricBatch], dict]:
    """A removal metric with the batch's removal settings (``extra``: attribute names of
    the batch passed as keyword arguments, e.g. ``n_steps``)."""
    def compute(b: MetricBatch) -> dict[str, MetricResult]:
        kw = {k: getattr(b, v) for k, v in extra.items()}
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
    "saco": MetricSpec(lambda b: _named(saco(b.model, b.inputs, b.maps, removal=b.removal,
                                             batch_size=b.batch_size, target=b.target,
                                             example_ids=b.example_ids, seed=b.seed))),
    "pointing_game": MetricSpec(lambda b: _named(pointing_game(
        b.model, b.inputs, b.maps, b.masks, target=b.target)), needs_masks=True),
    "segmentation": MetricSpec(lambda b: segmentation(b.model, b.inputs, b.maps, b.masks,
                                                      target=b.target), needs_masks=True),
    "max_sensitivity": MetricSpec(lambda b: _named(max_sensitivity(
        b.model, b.inputs, b.attribution, target=b.target, seed=b.seed,
        example_ids=b.example_ids)), needs_callable=True),
    "sparseness": MetricSpec(lambda b: _named(sparseness(b.model, b.inputs, b.maps,
                                                         target=b.target))),
    "randomization": MetricSpec(lambda b: _named(randomization(
        b.model, b.inputs, b.factory, target=b.target, seed=b.seed)), needs_callable=True),
}
"""Metric name -> :class:`MetricSpec`, in table order."""

DERIVED: dict[str, tuple[str, str, Callable[[MetricResult, MetricResult], MetricResult]]] = {
    "insertion_minus_deletion": ("insertion", "deletion", fa.insertion_minus_deletion),
}
"""Columns computed from two others (placed right after the first) when both are there."""


def available_metrics(*, masks: bool = True) -> list[str]:
    """Names of :data:`METRICS` (without those needing masks when ``masks`` is False).

    Examples::

        >>> from captum_vit.metrics.suite import available_metrics
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

        >>> from captum_vit.metrics.suite import parse_metrics
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


def evaluate_batch(model: nn.Module, inputs: Tensor, method: MethodFactory,
                   metrics: Sequence[str], *, attribution: Attribution | None = None,
                   labels: Tensor | None = None, masks: Tensor | None = None,
                   target: str = "predicted", example_ids: Sequence[int] | None = None,
                   removal: str = "token", batch_size: int = 64, n_steps: int = 20,
                   seed: int = 0, table: Mapping[str, MetricSpec] | None = None
                   ) -> dict[str, MetricResult]:
    r"""Every metric of ``metrics`` for one method on one batch.

    The method's patch maps are computed once and shared by all map metrics; metrics
    that need the method itself get it (:attr:`MetricSpec.needs_callable`).

    Args:
        model (nn.Module): a supported ViT classifier.
        inputs (Tensor): images ``[B, C, H, W]``.
        method (Callable): factory ``model -> Attribution`` (e.g.
            :func:`captum_vit.registry.method_factory`).
        metrics (Sequence[str]): names of :data:`METRICS`.
        attribution (Attribution, optional): ``method(model)`` built once by the caller.
        labels (Tensor, optional): ground-truth classes ``[B]``.
        masks (Tensor, optional): ground-truth regions ``[B, H, W]`` (mask metrics).
        target (str, optional): ``"predicted"`` (explain the prediction; accuracies
            against it) or ``"label"`` (explain ``labels``; accuracies against them).
        example_ids (Sequence[int], optional): data set index of each image.
        removal (str, optional): patch removal. Default ``"token"``.
        batch_size (int, optional): forward batch of the removal engine. Default 64.
        n_steps (int, optional): deletion / insertion steps. Default 20.
        seed (int, optional): seed of baselines, noise and randomisation. Default 0.
        table (Mapping[str, MetricSpec], optional): the metric table ``metrics`` name
            (a protocol's own, :mod:`captum_vit.metrics.protocols`). Default
            :data:`METRICS`.

    Returns:
        dict[str, MetricResult]: one entry per column, on the CPU, in table order
        (``insertion_minus_deletion`` right after ``insertion``).

    Examples::

        >>> from captum_vit.metrics.suite import evaluate_batch
        >>> from captum_vit.registry import method_factory
        >>> cols = evaluate_batch(model, x, method_factory("gae"), ["deletion", "insertion"])
        >>> list(cols)
        ['deletion', 'insertion', 'insertion_minus_deletion']
    """
    check_choice("target", target, TARGETS)
    table = METRICS if table is None else table
    unknown = [m for m in metrics if m not in table]
    if unknown:
        raise ValueError(f"unknown metric(s) {unknown}; choose from {', '.join(table)}")
    if any(table[m].needs_masks for m in metrics) and masks is None:
        raise ValueError(f"{', '.join(m for m in metrics if table[m].needs_masks)} need "
                         "ground-truth masks; pass masks=")
    if target == "label" and (labels is None or bool((labels < 0).any())):
        raise ValueError("target='label' needs a label (>= 0) for every image")
    adapter = adapt(model)
    if adapter.embedding and adapter.head.target is None:
        raise ValueError(f"this {type(model).__name__} outputs an image embedding: evaluate it "
                         "against target vectors (evaluate(..., targets=vectors [T, D′]), or "
                         "inside captum_vit.targets.scoring(model, vectors))")
    if not scores_are_classes():  # a single target vector defines no top-1 accuracy
        skipped = [m for m in metrics if table[m].needs_classes]
        if skipped:
            warnings.warn(f"{', '.join(skipped)} skipped: a single target vector defines no "
                          "accuracy (give a set of target vectors)", stacklevel=2)
        metrics = [m for m in metrics if not table[m].needs_classes]
    attr = method(model) if attribution is None else attribution
    with torch.no_grad():
        pred = adapter.model_logits(inputs).argmax(-1)
    t = pred if target == "predicted" else labels.to(pred.device)
    maps = None
    if not all(table[m].needs_callable for m in metrics):  # computed once, reused
        maps = patch_maps(attr, inputs, t, adapter.layout(inputs))
    ids = list(range(inputs.shape[0])) if example_ids is None else [int(i) for i in example_ids]
    batch = MetricBatch(model, inputs, maps, attr, method, t,
                        labels if target == "label" else None, masks, ids, removal,
                        batch_size, n_steps, seed, labels)
    out: dict[str, MetricResult] = {}
    for m in metrics:
        out.update(table[m].compute(batch))
    cols: dict[str, MetricResult] = {}
    for name, res in out.items():
        cols[name] = res.to("cpu")
        for derived, (first, second, fn) in DERIVED.items():
            if name == first and second in out:
                cols[derived] = fn(out[first], out[second]).to("cpu")
    return cols


def evaluate(model: nn.Module, data: Sequence[Any],
             methods: Mapping[str, MethodFactory], metrics: Sequence[str], *,
             preprocess: Callable[[Tensor], Tensor] | None = None, batch_size: int = 16,
             target: str = "predicted", removal: str = "token", n_steps: int = 20,
             seed: int = 0, progress: bool = False, targets: Any = None,
             table: Mapping[str, MetricSpec] | None = None, autocast: str = "none",
             timings: dict[str, float] | None = None
             ) -> dict[str, dict[str, MetricResult]]:
    r"""Evaluate methods × metrics over a data set, method by method, batch by batch.

    Images are converted to the model's input shape, preprocessed and cast to the
    model's device and dtype (:func:`captum_vit.data.specs.model_batch`). The methods run
    one after another, each over every batch (the batches are read again for each method),
    so progress and timings are per method; every random choice is seeded by ``seed`` and
    the example index, so the order changes no result. Under an initialised process group
    each rank evaluates its share of the batches and the results are gathered on every
    rank.

    Args:
        model (nn.Module): a supported ViT classifier (on its device and dtype).
        data (Sequence): examples ``(image, label, mask)``
            (:func:`captum_vit.data.specs.load_data`).
        methods (Mapping[str, Callable]): table label -> factory ``model -> Attribution``
            (for a registry name: :func:`captum_vit.registry.method_factory`).
        metrics (Sequence[str]): names of :data:`METRICS`.
        preprocess (Callable, optional): per-image normalisation.
        batch_size (int, optional): images per batch (the removal engine runs
            ``4 * batch_size`` jobs per forward). Default 16.
        target (str, optional): ``"predicted"`` or ``"label"``. Default ``"predicted"``.
        removal (str, optional): patch removal. Default ``"token"``.
        n_steps (int, optional): deletion / insertion steps. Default 20.
        seed (int, optional): seed of every random choice. Default 0.
        progress (bool, optional): on rank 0, a progress bar over the batches of each
            method in turn (``method 3/7: gae``). Default False.
        targets (Tensor or EmbeddingTarget, optional): for a model that outputs an image
            embedding, the target vectors ``[T, D′]`` it is scored against (e.g. text
            embeddings of the class prompts, in label order): the set acts as ``T``
            classes (:func:`captum_vit.targets.scoring`). Default ``None``.
        table (Mapping[str, MetricSpec], optional): the metric table (default
            :data:`METRICS`; a protocol passes its own).
        autocast (str, optional): ``"bf16"`` runs every forward and backward (methods
            and metrics) under ``torch.autocast`` in bfloat16 on the model's device, for
            GPU throughput; the model stays float32, the maps come back in float32
            (:func:`captum_vit._base.accumulation_dtype`) and the metrics reduce in
            float32/float64. The adapter's self-check runs at full precision first.
            Default ``"none"``.
        timings (dict, optional): filled with method -> seconds per image: the wall-clock
            time of the method's maps and metrics (data loading excluded), summed over
            the batches (and over the processes under ``torchrun``), divided by the number
            of examples. Default ``None`` (not reported).

    Returns:
        dict[str, dict[str, MetricResult]]: method -> column -> result over every example.

    Raises:
        ValueError: unknown removal, metric, method or autocast; a non-positive batch size;
            ``autocast="bf16"`` with a model that is not float32.

    Examples::

        >>> from captum_vit.data.specs import load_data
        >>> from captum_vit.metrics.suite import evaluate
        >>> from captum_vit.registry import method_factory
        >>> data = load_data("sample", n=32, input_shape=(1, (56, 56)), num_classes=10)
        >>> methods = {n: method_factory(n) for n in ("gae", "random")}
        >>> res = evaluate(model, data, methods, ["deletion", "insertion"])
        >>> res["gae"]["deletion"].value
    """
    from tqdm import tqdm

    from captum_vit.data.specs import model_batch

    check_choice("removal", removal, REMOVALS)
    check_scalar(batch_size, "batch_size", int, min_val=1)
    if not isinstance(methods, Mapping):
        raise TypeError("methods must map a label to a factory model -> Attribution; for "
                        "registry names use {n: captum_vit.registry.method_factory(n) ...}")
    factories = dict(methods)
    param = next(model.parameters())
    check_choice("autocast", autocast, tuple(AUTOCAST))
    if AUTOCAST[autocast] is not None and param.dtype != torch.float32:
        raise ValueError(f"autocast={autocast!r} runs a float32 model in reduced precision; "
                         f"this model is {param.dtype}: pass model.float() (--dtype float32) "
                         "or autocast='none'")
    shape = adapt(model).input_shape
    rank, world = _rank_world()
    n = len(data)
    if n == 0:
        raise ValueError("the data set is empty; nothing to evaluate")
    batches = [list(range(i, min(i + batch_size, n))) for i in range(0, n, batch_size)]
    attrs = {m: f(model) for m, f in factories.items()}
    local: dict[int, dict[str, dict[str, MetricResult]]] = {}
    seconds = dict.fromkeys(factories, 0.0)
    with each_warning_once(), _scored(model, targets):
        for k, m in enumerate(factories, 1):
            for b in tqdm(range(rank, len(batches), world), disable=not progress or rank != 0,
                          desc=f"method {k}/{len(factories)}: {m}"
                          + (f" (rank {rank})" if world > 1 else ""), file=sys.stderr):
                x, labels, masks = model_batch(data, batches[b], input_shape=shape,
                                               preprocess=preprocess, device=param.device,
                                               dtype=param.dtype)
                start = time.perf_counter()
                with autocasting(model, x, autocast):
                    local.setdefault(b, {})[m] = evaluate_batch(
                        model, x, factories[m], metrics, attribution=attrs[m], labels=labels,
                        masks=masks, target=target, example_ids=batches[b], removal=removal,
                        batch_size=batch_size * 4, n_steps=n_steps, seed=seed, table=table)
                seconds[m] += time.perf_counter() - start  # results are on the CPU: synced
    parts: list[Any] = [(local, seconds)]
    if world > 1:
        parts = [None] * world
        torch.distributed.all_gather_object(parts, (local, seconds))
    merged = {k: v for p, _ in parts for k, v in p.items()}
    if timings is not None:
        timings.update({m: sum(t[m] for _, t in parts) / n for m in factories})
    return {m: {c: MetricResult.cat([merged[b][m][c] for b in range(len(batches))])
                for c in merged[0][m]} for m in factories}


def _scored(model: nn.Module, targets: Any) -> contextlib.AbstractContextManager:
    """:func:`captum_vit.targets.scoring` when ``targets`` are given."""
    if targets is None:
        return contextlib.nullcontext()
    from captum_vit.targets import scoring

    return scoring(model, targets)


AUTOCAST: dict[str, torch.dtype | None] = {"none": None, "bf16": torch.bfloat16}
"""``evaluate(autocast=...)`` / ``--autocast``: name -> the dtype of ``torch.autocast``."""


@contextmanager
def autocasting(model: nn.Module, inputs: Tensor, name: str = "bf16") -> Iterator[None]:
    """``torch.autocast`` in ``AUTOCAST[name]`` on the inputs' device (nothing for
    ``"none"``), after the adapter's self-check at full precision (remembered per model,
    so the checks inside the block do not compare two reduced-precision runs).

    Args:
        model (nn.Module): the float32 model the block runs.
        inputs (Tensor): a batch of its images (for the self-check).
        name (str, optional): a key of :data:`AUTOCAST`. Default ``"bf16"``.

    Examples::

        >>> from captum_vit.metrics.suite import autocasting
        >>> with autocasting(model, x, "bf16"):
        ...     maps = GAE(model).attribute(x, output="tokens")   # float32 maps
    """
    dtype = AUTOCAST[check_choice("autocast", name, tuple(AUTOCAST))]
    if dtype is None:
        yield
        return
    adapt(model).self_check(inputs)
    with torch.autocast(inputs.device.type, dtype=dtype):
        yield


def _rank_world() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextmanager
def distributed(device: str = "auto") -> Iterator[tuple[torch.device, int, int]]:
    r"""The device, rank and world size of this process; under ``torchrun``
    (``WORLD_SIZE`` > 1) a process group (nccl on CUDA, gloo on CPU) is set up for the
    block and torn down after it (behind a barrier).

    Args:
        device (str, optional): ``"auto"`` (CUDA when available), ``"cpu"`` or
            ``"cuda"``; under torchrun CUDA ranks use their ``LOCAL_RANK`` device.

    Yields:
        tuple: ``(device, rank, world)``.

    Examples::

        >>> from captum_vit.metrics.suite import distributed
        >>> with distributed("cpu") as (device, rank, world):
        ...     results = evaluate(model.to(device), data, ["gae"], ["deletion"])
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    spec = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    dev = torch.device(spec)
    if spec == "cuda" and world > 1:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    dist = torch.distributed
    started = world > 1 and not dist.is_initialized()
    if started:
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    try:
        yield dev, int(os.environ.get("RANK", "0")), world
    finally:
        if started and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


@contextmanager
def each_warning_once() -> Iterator[None]:
    """Show each distinct warning (message and category) once while the block runs.

    Python shows a warning once per code location, but every change to the warning filters
    (``warnings.catch_warnings`` in third-party code, e.g. during Max-Sensitivity) forgets
    what was shown, including the ``"once"`` registry, so a per-call warning such as TIS's
    ``n_masks`` clamp came back for every batch of an evaluation. This de-duplicates at
    ``warnings.showwarning`` instead; the previous hook and filters are restored on exit.

    Examples::

        >>> from captum_vit.metrics.suite import each_warning_once
        >>> with each_warning_once():
        ...     for x in batches:
        ...         TIS(model).attribute(x, n_masks=10_000)   # the clamp warning shows once
    """
    seen: set[tuple[str, type]] = set()
    with warnings.catch_warnings():
        show = warnings.showwarning

        def show_once(message: Warning | str, category: type[Warning], *args: Any,
                      **kwargs: Any) -> None:
            key = (str(message), category)
            if key not in seen:
                seen.add(key)
                show(message, category, *args, **kwargs)

        warnings.showwarning = show_once
        yield


__all__ = ["AUTOCAST", "DERIVED", "METRICS", "MetricBatch", "MetricSpec", "autocasting",
           "available_metrics", "distributed", "each_warning_once", "evaluate",
           "evaluate_batch", "parse_metrics"]
