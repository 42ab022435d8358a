"""The evaluation loop: methods × metrics over a data set, batch by batch.

:func:`evaluate_batch` runs every metric of the metric table (:mod:`captum_vit.metrics.table`)
for one method on one batch; :func:`evaluate` runs it over a data set, method by method.
Their settings travel as one :class:`~captum_vit.metrics.settings.EvalSettings`; the loose
keyword arguments of older versions still build it.

:func:`evaluate` also runs under ``torchrun``: with a process group initialised (see
:func:`captum_vit.metrics.parallel.distributed`), rank ``r`` of ``K`` evaluates the batches
``i ≡ r (mod K)`` and the shards are gathered on every rank. Every random choice is seeded
by ``seed`` and the example index, so the results equal those of a single process.

The table (:data:`METRICS`, :class:`MetricSpec`, :class:`MetricBatch`, ...) and the process
helpers (:func:`distributed`) are re-exported here, where they were defined before.
"""

from __future__ import annotations

import contextlib
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch
from captum.attr import Attribution
from torch import Tensor, nn

from captum_vit._base import check_choice
from captum_vit.adapters import adapt, scores_are_classes
from captum_vit.data.specs import IndexedData
from captum_vit.metrics.maps import patch_maps
from captum_vit.metrics.parallel import distributed, gather, rank_world, shard
from captum_vit.metrics.results import MetricResult
from captum_vit.metrics.settings import (
    AUTOCAST,
    EXPLAINED,
    EvalSettings,
    forward_batch_of,
    settings_from,
)
from captum_vit.metrics.table import (
    DERIVED,
    METRICS,
    BoundMethod,
    MethodFactory,
    MetricBatch,
    MetricSpec,
    available_metrics,
    parse_metrics,
)

TARGETS = EXPLAINED
"""The choices of ``--target`` (:data:`captum_vit.metrics.settings.EXPLAINED`)."""


def evaluate_batch(model: nn.Module, inputs: Tensor, method: MethodFactory,
                   metrics: Sequence[str], *, attribution: Attribution | None = None,
                   labels: Tensor | None = None, masks: Tensor | None = None,
                   example_ids: Sequence[int] | None = None,
                   settings: EvalSettings | None = None, explain: str | None = None,
                   removal: Any = None, forward_batch: int | None = None,
                   n_steps: int | None = None, seed: int | None = None,
                   table: Mapping[str, MetricSpec] | None = None, **deprecated: Any
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
        example_ids (Sequence[int], optional): data set index of each image.
        settings (EvalSettings, optional): removal, steps, forward batch, seed and
            explained class; the keyword arguments below override its fields. Default
            :class:`EvalSettings` (``forward_batch`` 64).
        explain (str, optional): ``"predicted"`` (explain the prediction; accuracies
            against it) or ``"label"`` (explain ``labels``; accuracies against them).
            Default ``"predicted"``. (``target=`` is its deprecated spelling.)
        removal (str or Callable, optional): patch removal. Default ``"token"``.
        forward_batch (int, optional): jobs per forward of the removal engine. Default 64.
            (``batch_size=`` is its deprecated spelling here.)
        n_steps (int, optional): deletion / insertion steps. Default 20.
        seed (int, optional): seed of baselines, noise and randomisation. Default 0.
        table (Mapping[str, MetricSpec], optional): the metric table ``metrics`` name
            (a protocol's own, :mod:`captum_vit.metrics.protocols`). Default
            :data:`METRICS`.

    Returns:
        dict[str, MetricResult]: one entry per column, on the CPU, in table order
        (``insertion_minus_deletion`` right after ``insertion``).

    Raises:
        ValueError: an unknown metric or setting, mask metrics without masks,
            ``explain="label"`` without a label per image, an embedding model without
            target vectors.

    Examples::

        >>> from captum_vit.metrics.suite import evaluate_batch
        >>> from captum_vit.registry import method_factory
        >>> cols = evaluate_batch(model, x, method_factory("gae"), ["deletion", "insertion"])
        >>> list(cols)
        ['deletion', 'insertion', 'insertion_minus_deletion']
    """
    forward_batch = forward_batch_of(forward_batch, deprecated, "evaluate_batch")
    settings = settings_from(settings, deprecated, where="evaluate_batch", explain=explain,
                             removal=removal, forward_batch=forward_batch, n_steps=n_steps,
                             seed=seed)
    if settings.forward_batch is None:
        settings = settings.replace(forward_batch=settings.jobs_per_forward)
    table = METRICS if table is None else table
    unknown = [m for m in metrics if m not in table]
    if unknown:
        raise ValueError(f"unknown metric(s) {unknown}; choose from {', '.join(table)}")
    if any(table[m].needs_masks for m in metrics) and masks is None:
        raise ValueError(f"{', '.join(m for m in metrics if table[m].needs_masks)} need "
                         "ground-truth masks; pass masks=")
    if settings.explain == "label" and (labels is None or bool((labels < 0).any())):
        raise ValueError("explain='label' (--target label) needs a label (>= 0) for every "
                         "image")
    adapter = adapt(model)
    if adapter.embedding and adapter.head.target is None:
        raise ValueError(f"this {type(model).__name__} outputs an image embedding: evaluate it "
                         "against target vectors (evaluate(..., targets=vectors [T, D′]), or "
                         "inside captum_vit.targets.scoring(model, vectors))")
    if not scores_are_classes(adapter.probability):  # a single target vector: no top-1
        skipped = [m for m in metrics if table[m].needs_classes]
        if skipped:
            warnings.warn(f"{', '.join(skipped)} skipped: a single target vector defines no "
                          "accuracy (give a set of target vectors)", stacklevel=2)
        metrics = [m for m in metrics if not table[m].needs_classes]
    bound = BoundMethod(method, model, attribution)
    with torch.no_grad():
        pred = adapter.model_logits(inputs).argmax(-1)
    by_label = settings.explain == "label"
    t = cast(Tensor, labels).to(pred.device) if by_label else pred  # checked above
    maps = None
    if not all(table[m].needs_callable for m in metrics):  # computed once, reused
        maps = patch_maps(bound.attribution, inputs, t, adapter.layout(inputs))
    ids = list(range(inputs.shape[0])) if example_ids is None else [int(i) for i in example_ids]
    batch = MetricBatch(model, inputs, maps, bound, t, labels if by_label else None, masks,
                        ids, settings, labels)
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


def evaluate(model: nn.Module, data: IndexedData,
             methods: Mapping[str, MethodFactory], metrics: Sequence[str], *,
             settings: EvalSettings | None = None,
             preprocess: Callable[[Tensor], Tensor] | None = None,
             batch_size: int | None = None, forward_batch: int | None = None,
             explain: str | None = None, removal: Any = None, n_steps: int | None = None,
             seed: int | None = None, progress: bool = False, targets: Any = None,
             table: Mapping[str, MetricSpec] | None = None, autocast: str | None = None,
             timings: dict[str, float] | None = None, **deprecated: Any
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
        settings (EvalSettings, optional): every setting below in one object; the keyword
            arguments override its fields. Default :class:`EvalSettings`.
        preprocess (Callable, optional): per-image normalisation.
        batch_size (int, optional): images per batch. Default 16.
        forward_batch (int, optional): jobs per forward of the removal engine. Default
            ``4 * batch_size``.
        explain (str, optional): ``"predicted"`` or ``"label"``: the class the maps
            explain. Default ``"predicted"``. (``target=`` is its deprecated spelling.)
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
        >>> from captum_vit.metrics.settings import EvalSettings
        >>> from captum_vit.metrics.suite import evaluate
        >>> from captum_vit.registry import method_factory
        >>> data = load_data("sample", n=32, input_shape=(1, (56, 56)), num_classes=10)
        >>> methods = {n: method_factory(n) for n in ("gae", "random")}
        >>> res = evaluate(model, data, methods, ["deletion", "insertion"],
        ...                settings=EvalSettings(n_steps=10, batch_size=8))
        >>> res["gae"]["deletion"].value
    """
    from tqdm import tqdm

    from captum_vit.data.specs import model_batch

    settings = settings_from(settings, deprecated, where="evaluate", explain=explain,
                             removal=removal, batch_size=batch_size,
                             forward_batch=forward_batch, n_steps=n_steps, seed=seed,
                             autocast=autocast)
    # every batch's metrics run with the same forward batch (4 images' jobs per image)
    settings = settings.replace(forward_batch=settings.jobs_per_forward)
    if not isinstance(methods, Mapping):
        raise TypeError("methods must map a label to a factory model -> Attribution; for "
                        "registry names use {n: captum_vit.registry.method_factory(n) ...}")
    factories = dict(methods)
    param = next(model.parameters())
    if AUTOCAST[settings.autocast] is not None and param.dtype != torch.float32:
        raise ValueError(f"autocast={settings.autocast!r} runs a float32 model in reduced "
                         f"precision; this model is {param.dtype}: pass model.float() "
                         "(--dtype float32) or autocast='none'")
    shape = adapt(model).input_shape
    rank, world = rank_world()
    n = len(data)
    if n == 0:
        raise ValueError("the data set is empty; nothing to evaluate")
    size = settings.batch_size
    batches = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
    attrs = {m: f(model) for m, f in factories.items()}
    local: dict[int, dict[str, dict[str, MetricResult]]] = {}
    seconds = dict.fromkeys(factories, 0.0)
    with each_warning_once(), _scored(model, targets):
        for k, m in enumerate(factories, 1):
            for b in tqdm(shard(len(batches)), disable=not progress or rank != 0,
                          desc=f"method {k}/{len(factories)}: {m}"
                          + (f" (rank {rank})" if world > 1 else ""), file=sys.stderr):
                x, labels, masks = model_batch(data, batches[b], input_shape=shape,
                                               preprocess=preprocess, device=param.device,
                                               dtype=param.dtype)
                start = time.perf_counter()
                with autocasting(model, x, settings.autocast):
                    local.setdefault(b, {})[m] = evaluate_batch(
                        model, x, factories[m], metrics, attribution=attrs[m], labels=labels,
                        masks=masks, example_ids=batches[b], settings=settings, table=table)
                seconds[m] += time.perf_counter() - start  # results are on the CPU: synced
    parts = gather((local, seconds))
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


__all__ = ["AUTOCAST", "DERIVED", "METRICS", "TARGETS", "BoundMethod", "EvalSettings",
           "MetricBatch", "MetricSpec", "autocasting",
           "available_metrics", "distributed", "each_warning_once", "evaluate",
           "evaluate_batch", "parse_metrics"]
