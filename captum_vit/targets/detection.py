"""Detection targets: one detection token of a detector (YOLOS; Fang et al., NeurIPS 2021).

A detector scores each of its ``K`` detection tokens ("queries"): ``C + 1`` class logits
(the last one "no object") and a box. The adapter of a detection model exposes them to
any target as ``Outputs.extra["detection_logits"]`` ``[n, K, C + 1]`` and
``Outputs.extra["boxes"]`` ``[n, K, 4]`` and names the token row of each query
(``adapter.detection_rows``); :class:`DetectionTarget` reads one query per image.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor

from captum_vit.adapters.scoring import Outputs, Target, per_image
from captum_vit.targets.score import CLASS_SCORES

Indices = int | Sequence[int] | Tensor


def _indices(value: Indices | None, name: str) -> Tensor | None:
    """``value`` as a 1-D int64 CPU tensor (``None`` stays ``None``)."""
    if value is None:
        return None
    if isinstance(value, bool) or isinstance(value, str):
        raise TypeError(f"{name} must be an int, a list of ints or an integer tensor, "
                        f"got {value!r}")
    t = torch.as_tensor(value)
    if torch.is_floating_point(t) or t.dtype == torch.bool or t.is_complex() or t.dim() > 1:
        raise TypeError(f"{name} must be an int, a list of ints or a 1-D integer tensor, "
                        f"got {value!r}")
    t = t.reshape(-1).long().cpu()
    if t.numel() == 0:
        raise ValueError(f"{name} is empty; give one entry per image or one for all")
    if (t < 0).any():
        raise ValueError(f"{name} must be non-negative, got {t.tolist()}")
    return t


def _box(box: Sequence[float] | Tensor | None) -> Tensor | None:
    """``box`` as ``[m, 4]`` floats (CPU): a tensor keeps its dtype, Python numbers become
    float64 (the score casts the box to the model's dtype, so a float64 model scores the
    box as given and a float32 model loses nothing)."""
    if box is None:
        return None
    if isinstance(box, Tensor):
        t = box
    else:
        try:
            t = torch.as_tensor(box, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError("box must be 4 floats (cx, cy, w, h), normalised to [0, 1] as "
                             f"the model predicts them, or [B, 4]; got {box!r}") from e
    if not torch.is_floating_point(t) or t.dim() not in (1, 2) or t.shape[-1] != 4:
        raise ValueError("box must be 4 floats (cx, cy, w, h), normalised to [0, 1] as the "
                         "model predicts them, or [B, 4] (one box per image); got "
                         f"{tuple(t.shape)} of {t.dtype}")
    return t.reshape(-1, 4).cpu()


@dataclasses.dataclass(frozen=True)
class _Resolved:
    """The per-image choices of a resolved :class:`DetectionTarget` (``m`` entries)."""

    query: Tensor  # [m] int64
    label: Tensor | None  # [m] int64, None: box score only
    box: Tensor | None  # [m, 4]
    rows: tuple[int, ...]


class DetectionTarget(Target):
    r"""One detection of a detector (YOLOS): the class logit of a
    detection token, or the error of its box.

    The score of each image is read on one detection token ``q`` (its *query*):

    - ``box=None``: the class logit ``z_{q, label}``, or with ``score`` its probability
      or log-probability (softmax over the token's ``C + 1`` classes, "no object"
      included, as the model's post-processing reads it);
    - ``box=b``: :math:`-\lVert \hat b_q - b \rVert_1`, minus the L1 error of the
      token's predicted box ``(cx, cy, w, h)`` (normalised to ``[0, 1]``) to ``b``; a
      second score on the same token row (high where the box fits).

    ``query="best"`` chooses, per image, the token with the highest probability of
    ``label`` (softmax over the token's ``C + 1`` classes); with ``label=None`` the
    token with the highest probability of any object class (background excluded). An
    integer ``query`` with ``label=None`` and no box explains that token's most probable
    object class. Both choices are made on the model's clean forward of the images the
    method receives (:meth:`resolve`, which the methods and metrics call once per call;
    under ``NoiseTunnel`` that is each noisy copy), never on the perturbed forwards of
    the perturbation methods: each image's query and label are fixed columns, as
    :class:`~captum_vit.targets.Contrastive`'s classes are.

    For the matrix methods the chosen token plays the class token's role: the
    gradient-free ones (Rollout, raw attention, GlobEnc, ALTI) read out the chosen rows
    (``rows``: the union of the batch's chosen rows, one row when the batch explains
    one query), the gradient-weighted ones the positive input×gradient relevance of the
    rows, which the detection heads make ``e_query`` (:func:`captum_vit._base.readout_rows`).
    True token removal keeps every detection token (they are prefix rows of the canonical
    form), so TIS and the removal metrics remove tokens as for a classifier.

    Args:
        query (int, list of int, Tensor or str, optional): the detection token of every
            image (``0 … K-1``, one for all or one per image), or ``"best"`` (default).
        label (int, list of int or Tensor, optional): the class of every image
            (``0 … C``; ``C`` is "no object"); ``None``: the query's most probable
            object class (for a box score: no class needed, except to choose
            ``"best"``).
        box (sequence of 4 floats or Tensor, optional): the reference box ``(cx, cy, w,
            h)`` in ``[0, 1]``, ``[4]`` or ``[B, 4]``; ``None``: the class logit is the
            score. Python numbers are kept in float64, a tensor in its dtype; the box
            is cast to the model's dtype when scored.
        score (str, optional): the class score: ``"logit"`` (default),
            ``"probability"`` or ``"log_probability"`` (over the token's classes). A
            method's own ``score="probability"`` is the sigmoid of this score (the
            columns are independent detections, not competing classes): leave it at
            ``"logit"`` and ask here.

    Raises:
        TypeError: ``query`` or ``label`` of another type. ValueError: an unknown
            ``query`` string, a malformed ``box``, negative indices.

    Examples::

        >>> from captum_vit import GAE
        >>> from captum_vit.targets import DetectionTarget
        >>> maps = GAE(yolos).attribute(images, target=DetectionTarget("best", label=17))
        >>> maps = GAE(yolos).attribute(images, target=DetectionTarget(
        ...     [4, 9], box=[[0.5, 0.5, 0.2, 0.3], [0.3, 0.6, 0.1, 0.1]]))
    """

    reads_tokens = True
    prefix_rows_only = True
    """It reads detection rows only, which true token removal keeps."""

    def __init__(self, query: Indices | str = "best", label: Indices | None = None,
                 box: Sequence[float] | Tensor | None = None, *, score: str = "logit"
                 ) -> None:
        if score not in CLASS_SCORES:
            raise ValueError(f"score must be one of {', '.join(map(repr, CLASS_SCORES))}, "
                             f"got {score!r}")
        if box is not None and score != "logit":
            raise ValueError("score applies to the class score; a box target scores minus "
                             "the L1 error of the box: leave score='logit'")
        self.kind = score
        if isinstance(query, str):
            if query != "best":
                raise ValueError(f"query must be a detection token index (int, list, "
                                 f"tensor) or 'best', got {query!r}")
            self.query: Tensor | None = None
        else:
            self.query = _indices(query, "query")
        self.label = _indices(label, "label")
        self.box = _box(box)
        sizes = {t.shape[0] for t in (self.query, self.label, self.box) if t is not None}
        if len(sizes - {1}) > 1:
            raise ValueError("query, label and box must have one entry for all images or "
                             f"the same number of entries (one per image), got "
                             f"{sorted(sizes)}")
        self.count = max(sizes, default=1)
        self.resolved: _Resolved | None = None

    def __repr__(self) -> str:
        q = "'best'" if self.query is None else self.query.tolist()
        label = None if self.label is None else self.label.tolist()
        box = None if self.box is None else self.box.tolist()
        return f"DetectionTarget({q}, label={label}, box={box}, score={self.kind!r})"

    @property
    def rows(self) -> tuple[int, ...] | None:  # type: ignore[override]
        """The token rows of the chosen queries (known once resolved)."""
        return None if self.resolved is None else self.resolved.rows

    def resolve(self, adapter: Any, images: Tensor) -> DetectionTarget:
        """This target with every image's query and label fixed: ``"best"`` and a
        missing label are chosen on the model's clean forward of ``images``.

        Args:
            adapter: the adapter of a detection model (one with ``detection_rows`` and
                detection outputs, :func:`captum_vit.adapters.adapt` of a
                ``YolosForObjectDetection``).
            images (Tensor): the images [B, C, H, W] explained.

        Returns:
            DetectionTarget: resolved (integer query and label per entry, token rows).

        Raises:
            TypeError: the model is not a detector.
            ValueError: a query or label out of range, or entries that do not match the
                batch.
        """
        rows = getattr(adapter, "detection_rows", None)
        if rows is None:
            raise TypeError(f"DetectionTarget explains a detection token; this "
                            f"{type(getattr(adapter, 'model', adapter)).__name__} has none "
                            "(supported: Hugging Face YolosForObjectDetection)")
        b = images.shape[0]
        num_queries = len(rows)
        query, label = self.query, self.label
        if query is not None and (query >= num_queries).any():
            raise ValueError(f"query must be in [0, {num_queries}) (the model's detection "
                             f"tokens), got {query.tolist()}")
        need = query is None or (label is None and self.box is None)
        if need:
            with torch.no_grad(), adapter.targeting(_Detections()):
                logits = adapter.run(adapter.embed(images))  # [B, K*(C+1)]
            logits = logits.reshape(b, num_queries, -1)
            num_labels = logits.shape[-1]
        if label is not None and need and (label >= num_labels).any():
            raise ValueError(f"label must be in [0, {num_labels}) (the model's classes and "
                             f"'no object' = {num_labels - 1}), got {label.tolist()}")
        m = self.count
        if need:
            if m not in (1, b):
                raise ValueError(f"DetectionTarget has {m} entries for a batch of {b} "
                                 "images: give one per image or one for all")
            m = b
            probs = logits.softmax(-1).cpu()
            if label is not None:  # the probability of each image's label per query
                lab = per_image(label, b, "label")
                score = probs.gather(2, lab[:, None, None].expand(b, num_queries, 1))[..., 0]
            else:  # the most probable object class of each query
                score = probs[..., :-1].amax(-1)
            if query is None:
                query = score.argmax(-1)
            query = per_image(query, b, "query")
            if label is None and self.box is None:
                label = probs[torch.arange(b), query, :-1].argmax(-1)
        query = per_image(cast(Tensor, query), m, "query")  # given or chosen above
        label = None if label is None else per_image(label, m, "label")
        box = None if self.box is None else per_image(self.box, m, "box")
        out = DetectionTarget.__new__(DetectionTarget)
        out.__dict__.update(self.__dict__)
        out.count = m
        out.resolved = _Resolved(query, label, box,
                                 tuple(sorted({int(rows[int(q)]) for q in query})))
        return out

    def _choices(self) -> _Resolved:
        if self.resolved is None:
            raise ValueError("DetectionTarget is not resolved: its query and label are "
                             "chosen on the clean forward; call target.resolve(adapt(model), "
                             "images) first (the methods and metrics do)")
        return self.resolved

    def num_columns(self, num_classes: int) -> int:
        return self._choices().query.shape[0]

    def index(self, batch: int) -> Tensor:
        return per_image(torch.arange(self._choices().query.shape[0]), batch,
                         "DetectionTarget's entries")

    def columns(self, out: Outputs) -> Tensor:
        r = self._choices()
        extra = out.extra
        if "detection_logits" not in extra:
            raise ValueError("DetectionTarget reads a detector's outputs "
                             "(Outputs.extra['detection_logits']); this model has none")
        q = r.query.to(extra["detection_logits"].device)
        if r.box is not None:
            boxes = extra["boxes"][:, q]  # [n, m, 4]
            return -(boxes - r.box.to(boxes)).abs().sum(-1)
        z = extra["detection_logits"]
        label = cast(Tensor, r.label)  # None only when a box is scored (above)
        if self.kind == "probability":
            z = z.softmax(-1)
        elif self.kind == "log_probability":
            z = z.log_softmax(-1)
        if (label >= z.shape[-1]).any():
            raise ValueError(f"label must be in [0, {z.shape[-1]}) (the model's classes and "
                             f"'no object' = {z.shape[-1] - 1}), got {label.tolist()}")
        return z[:, q, label.to(z.device)]  # [n, m]


class _Detections(Target):
    """Every query's class logits, flattened ``[n, K·(C+1)]``: what
    :meth:`DetectionTarget.resolve` reads on the clean forward."""

    reads_tokens = True
    prefix_rows_only = True

    def num_columns(self, num_classes: int) -> int:
        return 1

    def columns(self, out: Outputs) -> Tensor:
        z = out.extra["detection_logits"]
        return z.reshape(z.shape[0], -1)
