"""What a score is: the head that scores an embedding against target vectors, and how
scores become probabilities.

Design. A method explains *a score*; which score is the adapter's business (the head and,
inside :meth:`~captum_vit.adapters.ViTAdapter.targeting`, a :class:`TargetHead`), and
what a probability of it means is this module's (softmax over competing classes, or the
sigmoid of single independent scores). :mod:`captum_vit.targets` builds its ready-made
targets on it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

_PROBABILITY: contextvars.ContextVar[str] = contextvars.ContextVar("probability",
                                                                  default="softmax")
"""How scores become probabilities in the current call: ``"softmax"`` over the classes
(or over a set of target embeddings), ``"sigmoid"`` per score (one target vector)."""



@contextlib.contextmanager
def probability_kind(kind: str) -> Iterator[None]:
    """Within the block :func:`probabilities` (and :func:`log_probabilities`,
    :func:`scores_are_classes`) treat scores as ``kind``: ``"softmax"`` (competing classes)
    or ``"sigmoid"`` (independent scores); the previous kind is restored on exit.

    Args:
        kind (str): ``"softmax"`` or ``"sigmoid"``.

    Raises:
        ValueError: another ``kind``.

    Examples::

        >>> with probability_kind("sigmoid"):
        ...     probabilities(torch.zeros(1, 1))
        tensor([[0.5000]])
    """
    if kind not in ("softmax", "sigmoid"):
        raise ValueError(f"kind must be 'softmax' or 'sigmoid'; got {kind!r}")
    token = _PROBABILITY.set(kind)
    try:
        yield
    finally:
        _PROBABILITY.reset(token)


def probabilities(logits: Tensor) -> Tensor:
    """The probabilities of ``logits`` [B, classes]: softmax over the classes, or, inside
    an embedding-target call with single target vectors, the sigmoid of each score
    (a softmax over one score would be constant; :mod:`captum_vit.targets`)."""
    return logits.sigmoid() if _PROBABILITY.get() == "sigmoid" else logits.softmax(-1)


def log_probabilities(logits: Tensor) -> Tensor:
    """``log`` of :func:`probabilities`, computed stably (log-softmax or log-sigmoid)."""
    if _PROBABILITY.get() == "sigmoid":
        return F.logsigmoid(logits)
    return logits.log_softmax(-1)


def scores_are_classes() -> bool:
    """Whether the current scores compete like classes (a classifier or a set of target
    embeddings under a softmax), so that an arg-max "prediction" and accuracies mean
    something; ``False`` for independent scores against single target vectors."""
    return _PROBABILITY.get() != "sigmoid"


@dataclass(frozen=True)
class TargetHead:
    r"""Scores of a model's image embedding ``e`` against target vectors
    (:mod:`captum_vit.targets`).

    ``s_t = scale · ⟨e/‖e‖, t/‖t‖⟩ + bias`` (``cosine=True``) or ``scale · ⟨e, t⟩ + bias``
    for every row ``t`` of ``vectors`` [T, D′]: a linear head on the (normalised)
    embedding, so every method and decomposition rule applies unchanged (DecompX freezes
    ``‖e‖`` like a LayerNorm's statistics).
    """

    vectors: Tensor
    cosine: bool = True
    scale: float = 1.0
    bias: float = 0.0
    probability: str = "softmax"

    def weight(self) -> Tensor:
        t = self.vectors
        if self.cosine:
            t = t / t.norm(dim=-1, keepdim=True)
        return self.scale * t

    def bias_vector(self) -> Tensor | None:
        if self.bias == 0:
            return None
        return torch.full(self.vectors.shape[:1], float(self.bias), dtype=self.vectors.dtype,
                          device=self.vectors.device)

    def scores(self, e: Tensor) -> Tensor:
        """``[B, T]`` scores of embeddings ``e`` [B, D′] (plain tensors)."""
        if self.cosine:
            e = e / e.norm(dim=-1, keepdim=True)
        return F.linear(e, self.weight(), self.bias_vector())

