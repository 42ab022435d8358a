"""What a score is: the head that scores an embedding against target vectors, and how
scores become probabilities.

Design. A method explains *a score*; which score is the adapter's business (the head and,
inside :meth:`~captum_vit.adapters.ViTAdapter.targeting`, a :class:`TargetHead`), and
what a probability of it means is this module's (softmax over competing classes, or the
sigmoid of single independent scores). :mod:`captum_vit.targets` builds its ready-made
targets on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

PROBABILITY_KINDS = ("softmax", "sigmoid")
"""How scores become probabilities: ``"softmax"`` over the classes (or over a set of target
embeddings), ``"sigmoid"`` per score (independent scores: one target vector, multi-label
heads). The kind in force for a model is adapter state
(:attr:`~captum_vit.adapters.ViTAdapter.probability`: the target head's, or
:meth:`~captum_vit.adapters.ViTAdapter.probability_kind`), passed to the functions below."""


def check_probability_kind(kind: str) -> str:
    """``kind`` if it is one of :data:`PROBABILITY_KINDS`.

    Raises:
        ValueError: another ``kind``.
    """
    if kind not in PROBABILITY_KINDS:
        raise ValueError(f"kind must be 'softmax' or 'sigmoid'; got {kind!r}")
    return kind


def probabilities(logits: Tensor, kind: str = "softmax") -> Tensor:
    """The probabilities of ``logits`` [B, classes]: softmax over the classes, or, for
    ``kind="sigmoid"`` (an embedding target with single target vectors, a multi-label
    head; :mod:`captum_vit.targets`), the sigmoid of each score (a softmax over one score
    would be constant).

    Args:
        logits (Tensor): scores [..., classes].
        kind (str, optional): ``"softmax"`` (default) or ``"sigmoid"``: the adapter's
            :attr:`~captum_vit.adapters.ViTAdapter.probability`.

    Returns:
        Tensor: probabilities, shaped as ``logits``.

    Examples::

        >>> probabilities(torch.zeros(1, 1), adapter.probability)
        tensor([[1.]])
    """
    return logits.sigmoid() if check_probability_kind(kind) == "sigmoid" \
        else logits.softmax(-1)


def log_probabilities(logits: Tensor, kind: str = "softmax") -> Tensor:
    """``log`` of :func:`probabilities` ``(logits, kind)``, computed stably (log-softmax or
    log-sigmoid)."""
    if check_probability_kind(kind) == "sigmoid":
        return F.logsigmoid(logits)
    return logits.log_softmax(-1)


def scores_are_classes(kind: str = "softmax") -> bool:
    """Whether scores whose probabilities are of ``kind`` compete like classes (a
    classifier or a set of target embeddings under a softmax), so that an arg-max
    "prediction" and accuracies mean something; ``False`` for independent scores
    (``"sigmoid"``: single target vectors, multi-label heads)."""
    return check_probability_kind(kind) != "sigmoid"


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


    @property
    def num_columns(self) -> int:
        """``T``: the number of target vectors (scores per image)."""
        return int(self.vectors.shape[0])


@dataclass
class Outputs:
    r"""What a :class:`Target` may read of one forward pass (:mod:`captum_vit.targets`), built by
    the adapter from its canonical forward; a target never touches the model's modules.

    Attributes:
        logits (Tensor or None): the model's output ``[n, classes]`` (the image embedding
            ``[n, D′]`` of a model without a classifier); ``None`` when the target reads
            intermediate blocks only.
        pooled (Tensor or None): the readout vector before the classifier ``[n, D]`` (the
            class token after the final norm, the patch mean, the attention pool's
            output, ...; for several pooled parts, e.g. DINOv2's ``[CLS ; mean]``, their
            concatenation).
        tokens (Tensor or None): the final-normed token states ``[n, N, D]``, the rows the
            model's own head sees (prefix rows first, then the patches row by row).
        hidden (dict[int, Tensor]): ``x_l`` ``[n, N, D]`` (the output of block ``l-1``,
            before any final norm; ``x_0`` the embedding) for every ``l`` of the
            target's ``blocks``.
        num_prefix (int): the prefix rows (class token, distillation token, registers,
            detection tokens) before the patches.
        grid (tuple of int): the patch grid ``(gh, gw)``.
        num_blocks (int): the model's ``L`` (negative block indices count from it).
        extra (dict): what a family adds (YOLOS: ``"boxes"``, per-detection logits).
    """

    logits: Tensor | None = None
    pooled: Tensor | None = None
    tokens: Tensor | None = None
    hidden: dict[int, Tensor] = dataclasses.field(default_factory=dict)
    num_prefix: int = 0
    grid: tuple[int, int] = (0, 0)
    num_blocks: int = 0
    extra: dict[str, Tensor] = dataclasses.field(default_factory=dict)

    def patches(self, states: Tensor | None = None) -> Tensor:
        """The patch rows of ``states`` (default :attr:`tokens`) on the grid:
        ``[n, D, gh, gw]`` (channels first, as a segmentation head takes them)."""
        x = self.tokens if states is None else states
        if x is None:
            raise ValueError("this target reads intermediate blocks: pass the states, e.g. "
                             "out.patches(out.hidden[l])")
        gh, gw = self.grid
        p = x[:, self.num_prefix:self.num_prefix + gh * gw]
        return p.transpose(1, 2).reshape(x.shape[0], x.shape[-1], gh, gw)


class Target:
    r"""The target protocol: any differentiable scalar of the model, per image
    (:mod:`captum_vit.targets`). Subclass it, or pass a plain callable ``f(logits) -> [B]``.

    A target computes ``K`` candidate scores per forward row (:meth:`columns`) and picks
    one column per image (:meth:`index`): a class per image is a column of the logits,
    a per-image parameter (a contrast pair, a mask) becomes one column per parameter.
    The perturbation methods and the removal metrics score many perturbed copies of
    each image in one forward, so a row's per-image parameters come from its column,
    never from its position in the batch. A target without per-image parameters has
    one column (the default :meth:`index`: column 0).

    Class attributes a subclass may set:

    - ``blocks`` (tuple of int or None): the block outputs ``x_l`` the score reads
      (``l`` in ``[1, L]``; negative counts from the end as in Hugging Face's
      ``hidden_states``, ``-1`` = ``x_L``); ``None`` = the model's output.
    - ``reads_tokens`` (bool): the score reads token rows through code of its own (not
      only the model's logits): the matrix methods then weigh the rows by their readout rule,
      and true token removal is refused.
    - ``prefix_rows_only`` (bool): the token rows it reads are prefix rows of the last
      state (a detector's detection rows), which true token removal keeps: removal is
      allowed.
    - ``rows`` (sequence of int, or None): the rows the score reads, for the gradient-
      free matrix methods' uniform weights (default: the patch rows).
    - ``probability`` (str): ``"softmax"`` (the columns compete like classes) or
      ``"sigmoid"`` (independent scores, the default): what ``score="probability"`` of
      a method means.
    - ``linearises`` (bool): the methods linear in the read gradient explain it through
      :meth:`read_gradients` (columns that cost far more than the picked scores).

    Examples::

        >>> class CenterFeature(Target):          # feature 3 of the centre patch
        ...     reads_tokens = True
        ...     def columns(self, out):
        ...         gh, gw = out.grid
        ...         return out.patches()[:, 3, gh // 2, gw // 2][:, None]
        >>> GAE(model).attribute(images, target=CenterFeature())
    """

    blocks: tuple[int, ...] | None = None
    reads_tokens: bool = False
    prefix_rows_only: bool = False
    rows: tuple[int, ...] | None = None
    probability: str = "sigmoid"
    classes: bool = False
    """Whether the columns are the model's classes (an arg-max is a prediction)."""
    contrast: bool = False
    """Whether the score is a difference of scores (class-agnostic methods refuse it)."""
    linearises: bool = False
    """Whether a method whose map depends on the score only through the score's gradient at
    the states it reads (``ViTFront.linear_in_read_gradient``) explains this target through
    that gradient: one forward to the read states, :meth:`read_gradients` there, then the
    method on the linear score ``Σ_l ⟨x_l, ∂s/∂x_l⟩`` (equal maps by the chain rule). For
    targets whose :meth:`columns` cost much more than the picked scores (a VLM's answer
    with tiles: every row scored in every tile's place). Default False."""

    def columns(self, out: Outputs) -> Tensor:
        """``[n, K]`` candidate scores of ``n`` forward rows (default: :meth:`score` as
        one column)."""
        return self.score(out)[:, None]

    def score(self, out: Outputs) -> Tensor:
        """``[n]``: the score of every row (override this or :meth:`columns`)."""
        raise NotImplementedError(f"{type(self).__name__} must define score(out) or "
                                  "columns(out)")

    def num_columns(self, num_classes: int) -> int:
        """``K`` (``num_classes``: the model's number of outputs)."""
        return 1

    def index(self, batch: int) -> Tensor | None:
        """The column of each of ``batch`` images ``[batch]`` (int64, CPU); ``None``: the
        highest-scoring column (a prediction)."""
        return torch.zeros(batch, dtype=torch.long)

    def read_states(self, images: Tensor) -> dict[int | None, Tensor] | None:
        """The states this target reads of ``images`` when it already holds them (made by
        its construction or :meth:`resolve` from these very images): keyed by the entries
        of :attr:`blocks` (``None``: the final-normed tokens), ``[n, N, D]`` each. The
        read-gradient path (:attr:`linearises`) then skips its forward to them. Default
        ``None``: not held."""
        return None

    def read_gradients(self, out: Outputs, leaves: Sequence[Tensor],
                       indices: Sequence[Tensor | None]) -> list[list[Tensor]]:
        """The gradients of the picked scores w.r.t. the read states, at one forward's
        states: for each ``index`` of ``indices`` (a column per row ``[n]``; ``None``: the
        highest-scoring column), ``∂ Σ_i columns(out)[i, index_i] / ∂ leaves``.

        The methods that depend on the score only through these gradients
        (``ViTFront.linear_in_read_gradient``) take them from here for a target with
        :attr:`linearises` (and :func:`~captum_vit.targets.vlm.per_token_maps` for every
        answer token at once). Default: :meth:`columns` once, one backward per index
        (``retain_graph`` between them). A target may override it to compute only what the
        picked columns need at these states (it must return the same gradients).

        Args:
            out (Outputs): the forward's outputs, whose read states (``hidden`` of
                :attr:`blocks`, or ``tokens``) are ``leaves``.
            leaves (sequence of Tensor): the read states, leaves that require grad.
            indices (sequence of Tensor or None): the picked columns, one ``[n]`` each.

        Returns:
            list: for each index, the gradients w.r.t. every leaf (zero where unused).
        """
        cols = self.columns(out)
        grads = []
        for j, index in enumerate(indices):
            pick = cols.detach().argmax(-1) if index is None else index.to(cols.device)
            grads.append(list(torch.autograd.grad(
                cols.gather(1, pick[:, None]).sum(), list(leaves),
                retain_graph=j < len(indices) - 1, allow_unused=True,
                materialize_grads=True)))
        return grads

    def resolve(self, adapter: Any, images: Tensor) -> Target:
        """The target for these ``images``, with per-image choices that depend on the
        model's clean forward fixed (a detection query ``"best"``); called once per call
        by the front and the metrics, before any perturbed forward. Default: itself."""
        return self

    def readout_layers(self, num_blocks: int) -> tuple[int, ...] | None:
        """:attr:`blocks` as sorted indices in ``[1, L]`` (``None``: the output)."""
        if self.blocks is None:
            return None
        out = set()
        for l in self.blocks:
            if isinstance(l, bool) or not isinstance(l, int):
                raise TypeError(f"{type(self).__name__}.blocks must be ints (block "
                                f"outputs x_l), got {l!r}")
            k = l + num_blocks + 1 if l < 0 else l
            if not 1 <= k <= num_blocks:
                raise ValueError(f"{type(self).__name__}.blocks: {l} is not a block output "
                                 f"of this {num_blocks}-block model (x_1 .. x_{num_blocks}, "
                                 f"or -1 .. -{num_blocks}; x_0 is the embedding, which no "
                                 "block explains)")
            out.add(k)
        if not out:
            raise ValueError(f"{type(self).__name__}.blocks is empty; use None for the "
                             "model's output")
        return tuple(sorted(out))


def per_image(values: Tensor, batch: int, name: str) -> Tensor:
    """``values`` ``[B, ...]`` for a batch of ``batch = k·B`` images: each entry repeated
    ``k`` times in place (``repeat_interleave``, as Captum expands targets for
    ``NoiseTunnel``); a single entry serves every image.

    Raises:
        ValueError: ``batch`` is not a multiple of the entries.
    """
    n = values.shape[0]
    if n == batch:
        return values
    if n == 1:
        return values.expand(batch, *values.shape[1:])
    if n == 0 or batch % n:
        raise ValueError(f"{name} has {n} entries for a batch of {batch} images: give one "
                         "per image or one for all")
    return values.repeat_interleave(batch // n, dim=0)
