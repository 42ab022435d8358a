"""Faithfulness: perturbation test, AOPC / LOdds, deletion / insertion, top-ratio protocol.

Every function takes ``(model, inputs, attribution)``: ``attribution`` is precomputed maps
or any Captum-style attribution (see :func:`captum_vit.metrics.removal.patch_maps`), and
patches are removed with true token masking by default (``removal``; see
:mod:`captum_vit.metrics.removal`).
Every removal metric also takes ``unit="pixel"`` (rank the single pixels of the bilinearly
upsampled map, Chefer et al. / TIS) with a pixel baseline or fill callable, and
``rounding`` (``"round"``: ``round(k·n)`` units, default; ``"floor"``: ``int(k·n)``, as the
authors' scripts compute ``int(base_size * step)`` / ``int(r * P)``).
The maps explain ``target`` (``None``: the predicted class of each unperturbed image).
On a model that outputs an image embedding, ``target`` is a vector target
(:mod:`captum_vit.targets`) and the scores and probabilities are the target's: softmax over
a set of target embeddings, or the sigmoid of each score against single vectors (whose
"prediction" is the explained vector itself, and which define no accuracy).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

from captum_vit._base import TargetLike, check_choice, check_scalar, check_target
from captum_vit.adapters import adapt, log_probabilities, probabilities, scores_are_classes
from captum_vit.metrics.maps import AttributionLike, patch_maps, ranking
from captum_vit.metrics.removal import (
    RemovalEngine,
    example_seeds,
    prepare_metric,
    upsample,
    vector_targets,
)
from captum_vit.metrics.results import MetricResult
from captum_vit.metrics.settings import EvalSettings, forward_batch_of

PERTURBATION_FRACTIONS = tuple(i / 20 for i in range(21))  # 0, 0.05, ..., 1.0
RATIOS = tuple(i / 10 for i in range(1, 10))  # 0.1 ... 0.9
ROUNDINGS = ("round", "floor")


def trapezoid_auc(curves: Tensor, x: Tensor) -> Tensor:
    """Area under each curve [B, S] over abscissa ``x`` [S] by the trapezoid rule -> [B]."""
    x = x.to(curves)
    return ((curves[:, 1:] + curves[:, :-1]) * (x[1:] - x[:-1])).sum(1) / 2


def check_fractions(name: str, values: Sequence[float], *, closed: bool) -> Tensor:
    """Sorted fractions in [0, 1] (``closed``) or in the open interval (0, 1)."""
    v = torch.as_tensor([float(f) for f in values], dtype=torch.float64)
    if v.numel() == 0:
        raise ValueError(f"{name} must not be empty")
    ok = ((v >= 0) & (v <= 1)) if closed else ((v > 0) & (v < 1))
    if not ok.all():
        rng = "[0, 1]" if closed else "the open interval (0, 1)"
        raise ValueError(f"{name} must lie in {rng}, got {v.tolist()}")
    if (v[1:] <= v[:-1]).any():
        raise ValueError(f"{name} must be strictly increasing, got {v.tolist()}")
    return v


class _Setup:
    """Shared preparation: logits, labels, patch ranking and the removal engine."""

    def __init__(self, model: nn.Module, inputs: Tensor, attribution: AttributionLike,
                 target: TargetLike, removal: Any, forward_batch: int, pixel_reduce: str,
                 attribute_kwargs: dict | None, example_ids: Any, seed: int,
                 unit: str = "patch", rounding: str = "round") -> None:
        check_choice("rounding", rounding, ROUNDINGS)
        adapter, prep = prepare_metric(model, inputs, target)
        self.inputs, self.layout = prep.images, prep.layout
        # prepare_metric runs the model and resolves the target: neither is None
        self.logits, self.target = cast(Tensor, prep.logits), cast(Tensor, prep.target)
        self.engine = RemovalEngine(model, removal, forward_batch, adapter=adapter, unit=unit)
        self.rounding = rounding
        # the "prediction" of AOPC/LOdds: the arg-max class, or, for independent scores
        # against single target vectors (captum_vit.targets), the explained vector itself
        self.probability = adapter.probability  # how scores become probabilities
        self.pred = (self.logits.argmax(-1) if scores_are_classes(self.probability)
                     else self.target)
        self.scores = patch_maps(attribution, self.inputs, self.target, self.layout,
                                 pixel_reduce=pixel_reduce, attribute_kwargs=attribute_kwargs)
        ranked = self.scores
        if unit == "pixel":  # the bilinearly upsampled map, one score per pixel
            size = (int(self.inputs.shape[-2]), int(self.inputs.shape[-1]))
            ranked = upsample(self.scores, self.layout.grid, self.layout.patch_size,
                              size).reshape(len(self.scores), -1)
        self.order = ranking(ranked)
        # LeRF ranks the negated map (Chefer's ``vis = -vis``): ties keep the lower index
        # first, as in MoRF, rather than the reverse the flipped order would give
        self.order_lerf = ranking(-ranked)
        self.seeds = example_seeds(example_ids, self.inputs.shape[0], seed)

    @property
    def num_units(self) -> int:
        """Patches (``unit="patch"``) or pixels (``unit="pixel"``) that can be removed."""
        return self.order.shape[1]

    def counts(self, fractions: Tensor) -> list[int]:
        if self.rounding == "floor":
            return [int(float(f) * self.num_units) for f in fractions]
        return [int(round(float(f) * self.num_units)) for f in fractions]

    def run(self, fractions: Tensor, *, lerf: bool = False, mode: str = "delete",
            counts: Sequence[int] | None = None) -> Tensor:
        order = self.order_lerf if lerf else self.order
        counts = self.counts(fractions) if counts is None else counts
        return self.engine.logits(self.inputs, order, counts, mode=mode,
                                  full_logits=self.logits, seeds=self.seeds)


def _common(kw: dict, where: str) -> dict:
    """The removal options of ``kw``: explicit keywords win over ``settings``
    (:class:`~captum_vit.metrics.settings.EvalSettings`: removal, forward batch, seed)."""
    settings = kw.pop("settings", None)
    s = EvalSettings() if settings is None else settings
    forward_batch = forward_batch_of(kw.pop("forward_batch", None), kw, where)
    return dict(removal=kw.pop("removal", s.removal),
                forward_batch=s.jobs_per_forward if forward_batch is None else forward_batch,
                pixel_reduce=kw.pop("pixel_reduce", "abs"),
                attribute_kwargs=kw.pop("attribute_kwargs", None),
                example_ids=kw.pop("example_ids", None), seed=kw.pop("seed", s.seed),
                unit=kw.pop("unit", "patch"), rounding=kw.pop("rounding", "round"))


@vector_targets
def perturbation_test(model: nn.Module, inputs: Tensor, attribution: AttributionLike, *,
                      order: str = "positive", labels: TargetLike = None,
                      target: TargetLike = None,
                      fractions: Sequence[float] = PERTURBATION_FRACTIONS,
                      **kwargs: Any) -> MetricResult:
    r"""Perturbation test (Chefer et al., CVPR 2021; TokenTM, Wu et al., CVPR 2024, Tables 2–4).

    Removes the fraction ``k`` of patches in MoRF order (``order="positive"``, lower is
    better) or LeRF order (``"negative"``, higher is better) and records top-1 accuracy;
    the score is :math:`100 \cdot \int_0^1 \mathrm{acc}(k)\,dk` (trapezoid rule).

    Args:
        model (nn.Module): a supported ViT classifier.
        inputs (Tensor): images [B, C, H, W].
        attribution: maps or an attribution (see :func:`patch_maps`).
        order (str): ``"positive"`` (MoRF) or ``"negative"`` (LeRF).
        labels (int, list or Tensor, optional): ground-truth labels; accuracy is measured
            against them when given, else against the prediction on the clean image.
        target (optional): class the maps explain (``None``: predicted class).
        fractions (Sequence[float]): removed fractions (default 0, 0.05, ..., 1).
        **kwargs: ``removal``, ``forward_batch`` (jobs per forward), ``pixel_reduce``,
            ``attribute_kwargs``, ``example_ids``, ``seed``, ``unit``, ``rounding`` (see
            :class:`RemovalEngine` and the module docstring), or ``settings``
            (:class:`~captum_vit.metrics.settings.EvalSettings`: its removal,
            ``jobs_per_forward`` and seed; the keywords above win).

    Returns:
        MetricResult: ``per_example`` AUC in percent, ``curves`` 0/1 correctness [B, S].

    Examples::

        >>> res = perturbation_test(model, x, GAE(model), order="positive")
        >>> res.value, res.mean_curve
    """
    check_choice("order", order, ("positive", "negative"))
    x = check_fractions("fractions", fractions, closed=True)
    if not scores_are_classes(adapt(model).probability):
        raise ValueError("perturbation_test measures top-1 accuracy, which needs competing "
                         "classes; this target's scores are independent (a single target "
                         "vector, a multi-label, contrastive or token target): pass classes "
                         "(a classifier's, ClassTarget) or a set of target vectors "
                         "(EmbeddingTarget(vectors [T, D′], index=...)), or use aopc, lodds, "
                         "deletion or insertion")
    st = _Setup(model, inputs, attribution, target, **_common(kwargs, "perturbation_test"))
    _no_extra(kwargs)
    ref = st.pred if labels is None else cast(Tensor, check_target(  # labels: not None
        labels, len(st.pred), st.engine.adapter.num_classes)).to(st.pred.device)
    logits = st.run(x, lerf=order == "negative")
    correct = (logits.argmax(-1) == ref[:, None]).double()
    return MetricResult(f"perturbation_{'pos' if order == 'positive' else 'neg'}",
                        100 * trapezoid_auc(correct, x), order == "negative", x, correct)


def _log_prob_curves(st: _Setup, x: Tensor, *, lerf: bool = False, mode: str = "delete"
                     ) -> tuple[Tensor, Tensor]:
    """``log p(y|x)`` [B] and ``log p(y|x_k)`` [B, S] for the predicted class y."""
    y = st.pred
    lp0 = log_probabilities(st.logits.double(), st.probability).gather(1, y[:, None]).squeeze(1)
    lpk = log_probabilities(st.run(x, lerf=lerf, mode=mode).double(), st.probability)
    return lp0, lpk.gather(2, y[:, None, None].expand(-1, x.numel(), 1)).squeeze(2)


def _ratio_log_probs(model: nn.Module, inputs: Tensor, attribution: AttributionLike,
                     fractions: Sequence[float], mode: str, kwargs: dict
                     ) -> tuple[Tensor, Tensor, Tensor]:
    """Shared part of AOPC and LOdds: the ratios ``x`` [S], ``log p(y|x)`` [B] and
    ``log p(y|x_k)`` [B, S] with the top ratio removed (``"remove"``) or kept (``"keep"``)."""
    check_choice("mode", mode, ("remove", "keep"))
    x = check_fractions("fractions", fractions, closed=True)
    st = _Setup(model, inputs, attribution, kwargs.pop("target", None),
                **_common(kwargs, "aopc/lodds"))
    _no_extra(kwargs)
    return (x, *_log_prob_curves(st, x, mode="delete" if mode == "remove" else "insert"))


@vector_targets
def aopc(model: nn.Module, inputs: Tensor, attribution: AttributionLike, *,
         fractions: Sequence[float] = RATIOS, mode: str = "remove", **kwargs: Any) -> MetricResult:
    r"""AOPC (TokenTM supplement, Wu et al., CVPR 2024, Eq. 1):
    :math:`\mathrm{mean}_k\,[p(y|x) - p(y|x_k)]`, y predicted.

    ``x_k`` removes (``mode="remove"``, higher is better) or keeps only (``"keep"``,
    lower is better) the top fraction ``k`` of patches. Default ``k = 0.1, ..., 0.9``;
    any fractions in ``[0, 1]`` (the TokenTM supplement's ``k = 0, 0.05, ..., 1``).

    Returns:
        MetricResult: per-example AOPC, curves ``p(y|x) - p(y|x_k)`` [B, S].

    Examples::

        >>> aopc(model, x, TokenIxG(model)).value
    """
    x, lp0, lpk = _ratio_log_probs(model, inputs, attribution, fractions, mode, kwargs)
    drop = lp0.exp()[:, None] - lpk.exp()
    return MetricResult("aopc" if mode == "remove" else "aopc_keep", drop.mean(1),
                        mode == "remove", x, drop)


@vector_targets
def lodds(model: nn.Module, inputs: Tensor, attribution: AttributionLike, *,
          fractions: Sequence[float] = RATIOS, mode: str = "remove", **kwargs: Any) -> MetricResult:
    r"""Log-odds (TokenTM supplement, Eq. 2): :math:`-\mathrm{mean}_k \log(p(y|x) / p(y|x_k))`.

    ``mode="remove"``: lower is better; ``"keep"``: higher is better.

    Returns:
        MetricResult: per-example LOdds, curves ``log p(y|x_k) - log p(y|x)`` [B, S].

    Examples::

        >>> lodds(model, x, TokenIxG(model)).value
    """
    x, lp0, lpk = _ratio_log_probs(model, inputs, attribution, fractions, mode, kwargs)
    lo = lpk - lp0[:, None]
    return MetricResult("lodds" if mode == "remove" else "lodds_keep", lo.mean(1),
                        mode == "keep", x, lo)


def _deletion_insertion(mode: str, model: nn.Module, inputs: Tensor,
                        attribution: AttributionLike, n_steps: int, target: TargetLike,
                        kwargs: dict) -> MetricResult:
    check_scalar(n_steps, "n_steps", int, min_val=1)
    start_point = kwargs.pop("start_point", True)
    st = _Setup(model, inputs, attribution, target, **_common(kwargs, f"{mode[:-1]}ion"))
    _no_extra(kwargs)
    counts = None
    if start_point:
        x = torch.linspace(0, 1, n_steps + 1, dtype=torch.float64)
    else:  # TIS: ceil(n / n_steps) units per step, no unperturbed point
        step = math.ceil(st.num_units / n_steps)
        x = torch.arange(1, n_steps + 1, dtype=torch.float64) / n_steps
        counts = [min(s * step, st.num_units) for s in range(1, n_steps + 1)]
    probs = probabilities(st.run(x, mode=mode, counts=counts).double(), st.probability)
    p = probs.gather(2, st.target[:, None, None].expand(-1, x.numel(), 1)).squeeze(2)
    return MetricResult("deletion" if mode == "delete" else "insertion",
                        trapezoid_auc(p, x), mode == "insert", x, p)


@vector_targets
def deletion(model: nn.Module, inputs: Tensor, attribution: AttributionLike, *,
             n_steps: int = 20, target: TargetLike = None, **kwargs: Any) -> MetricResult:
    r"""Deletion curve (RISE, Petsiuk et al., BMVC 2018; TIS Tables 1–2): remove the most
    important patches in ``n_steps`` equal steps; score = target probability; AUC by the
    trapezoid rule over [0, 1] (lower is better).

    ``start_point=False`` is TIS's convention (Englebert et al., ``metrics/``): each step
    affects ``ceil(n / n_steps)`` more units, the curve has no unperturbed point
    (x = 1/n_steps, ..., 1) and the AUC is the trapezoid over that grid.

    Returns:
        MetricResult: per-example AUC, curves [B, n_steps + 1] (``n_steps`` without the
        start point).

    Examples::

        >>> deletion(model, x, GAE(model), removal="blur").value
    """
    return _deletion_insertion("delete", model, inputs, attribution, n_steps, target, kwargs)


@vector_targets
def insertion(model: nn.Module, inputs: Tensor, attribution: AttributionLike, *,
              n_steps: int = 20, target: TargetLike = None, **kwargs: Any) -> MetricResult:
    r"""Insertion curve (RISE; TIS Tables 1–2): start from everything removed and restore the most
    important patches first; AUC of the target probability (higher is better).

    ``start_point=False``: TIS's convention, as in :func:`deletion`.

    Returns:
        MetricResult: per-example AUC, curves [B, n_steps + 1] (``n_steps`` without the
        start point).

    Examples::

        >>> insertion(model, x, GAE(model)).value
    """
    return _deletion_insertion("insert", model, inputs, attribution, n_steps, target, kwargs)


def insertion_minus_deletion(ins: MetricResult, dele: MetricResult) -> MetricResult:
    """Per-example Insertion − Deletion AUC (higher is better)."""
    if len(ins) != len(dele):
        raise ValueError("insertion and deletion results cover different examples")
    return MetricResult("insertion_minus_deletion", ins.per_example - dele.per_example, True)


@vector_targets
def token_ratio(model: nn.Module, inputs: Tensor, attribution: AttributionLike, *,
                ratios: Sequence[float] = RATIOS, labels: TargetLike = None,
                remove_scores: bool = False, **kwargs: Any) -> dict[str, MetricResult]:
    r"""Keep / remove top-ratio protocol of SkipPLUS (§4.1, A.2).

    For each ratio r: ``keep`` runs the model on the top-r patches only, ``remove`` on
    all but them. Reported: top-1 accuracy w.r.t. the reference class for both protocols
    (AUC in percent by the trapezoid rule over the ratios plus the unmasked endpoint:
    r = 0 for remove, r = 1 for keep), and AOPC and LOdds (means over the ratios) of the
    keep protocol. The remove protocol's AOPC and LOdds are :func:`aopc` and :func:`lodds`
    (``mode="remove"``, same ratios): they are not repeated here unless
    ``remove_scores=True``, so that an evaluation table has each metric once.

    Args:
        ratios (Sequence[float]): ratios in (0, 1). Default 0.1, ..., 0.9.
        labels (optional): the reference class of accuracy, AOPC and LOdds (the SkipPLUS
            protocol: the ground-truth label); ``None`` (default): the clean prediction.
        remove_scores (bool): also return ``token_ratio_remove_aopc`` and
            ``token_ratio_remove_lodds`` (the SkipPLUS table's columns). Default False.
        **kwargs: ``target``, ``removal``, ``rounding`` (``"floor"``: ``k = int(r·P)``,
            the authors' code), ``forward_batch``, ... (see :func:`perturbation_test`).

    Returns:
        dict[str, MetricResult]: ``token_ratio_keep_accuracy``, ``token_ratio_keep_aopc``,
        ``token_ratio_keep_lodds`` and ``token_ratio_remove_accuracy`` (the accuracies
        are left out for single target vectors, which define no top-1 class).

    Examples::

        >>> res = token_ratio(model, x, GAE(model))
        >>> res["token_ratio_keep_accuracy"].value, aopc(model, x, GAE(model)).value
    """
    x = check_fractions("ratios", ratios, closed=False)
    st = _Setup(model, inputs, attribution, kwargs.pop("target", None),
                **_common(kwargs, "token_ratio"))
    _no_extra(kwargs)
    ref = st.pred if labels is None else cast(Tensor, check_target(  # labels: not None
        labels, len(st.pred), st.engine.adapter.num_classes)).to(st.pred.device)
    out = {}
    for proto, mode in (("keep", "insert"), ("remove", "delete")):
        logits = st.run(x, mode=mode)
        keep = proto == "keep"
        name = f"token_ratio_{proto}"
        if scores_are_classes(st.probability):  # accuracies: not for single target vectors
            acc = (logits.argmax(-1) == ref[:, None]).double()
            one = (st.logits.argmax(-1) == ref).double()[:, None]  # the unmasked image
            if keep:
                xs, acc = torch.cat([x, x.new_ones(1)]), torch.cat([acc, one], 1)
            else:
                xs, acc = torch.cat([x.new_zeros(1), x]), torch.cat([one, acc], 1)
            out[f"{name}_accuracy"] = MetricResult(f"{name}_accuracy",
                                                   100 * trapezoid_auc(acc, xs), keep, xs, acc)
        if keep or remove_scores:
            lp0 = log_probabilities(st.logits.double(), st.probability).gather(
                1, ref[:, None]).squeeze(1)
            lpk = log_probabilities(logits.double(), st.probability).gather(
                2, ref[:, None, None].expand(-1, x.numel(), 1)).squeeze(2)
            drop = lp0.exp()[:, None] - lpk.exp()
            lo = lpk - lp0[:, None]
            out[f"{name}_aopc"] = MetricResult(f"{name}_aopc", drop.mean(1), not keep, x, drop)
            out[f"{name}_lodds"] = MetricResult(f"{name}_lodds", lo.mean(1), keep, x, lo)
    return out


def _no_extra(kwargs: dict) -> None:
    if kwargs:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(kwargs))}")
