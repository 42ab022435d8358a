"""Ready-made targets: any differentiable scalar of the model (:mod:`captum_vit.targets`).

Every method and metric of the package takes one as ``target=``; the adapter builds the
:class:`~captum_vit.adapters.scoring.Outputs` a target reads from its canonical forward,
so a target never touches the model's modules. What each target asks of the methods:

- targets that read only the model's logits (:class:`ClassTarget`, :class:`MultiLabel`,
  :class:`Contrastive`, a plain callable on the logits) go through the model's own head:
  every method explains them as it explains a class, with the readout it has today;
- targets that read token rows through code of their own (:class:`TokenTarget`,
  :class:`HeadTarget`) make the matrix methods weigh the read rows by their positive
  input×gradient relevance (gradient-weighted methods) or uniformly (gradient-free ones),
  our choice; true token removal (TIS's and the metrics' default) changes the rows such a target
  reads and is refused, with the pixel removal as the fix;
- a target reading several blocks is explained as the sum of one single-block readout
  per block, each with the gradient of the score at that block's output (a method linear
  in its backward's gradient gets that sum from one pass reading every block).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from captum_vit.adapters.scoring import Outputs, Target, per_image

CLASS_SCORES = ("logit", "probability", "log_probability")

LINEAR_IN_SCORE: dict[str, dict[str, Any]] = {
    "attn_grad": {}, "att_ixg": {}, "attcat": {}, "attnlrp": {}, "cp_lrp": {},
    "decompx": {}, "fullgrad_plus": {}, "skip_fullgrad_plus": {}, "token_ixg": {},
    "vanilla_grad": {},
    "gradcam": {"relu": False}, "hirescam": {"relu": False}, "xgradcam": {"relu": False},
    "xgradcam_plus": {"relu": False},
    "rise": {"score": "logit"}, "tis": {"score": "logit"}, "vit_cx": {"score": "logit"},
}
"""The registered methods whose map is linear in the explained score, with the options
(of the constructor or of ``attribute``) under which it is; ``{}``: at their defaults.
For these ``map(Contrastive(a, b)) == map(a) − map(b)`` (and any linear combination of
scores is the same combination of maps); PLUS / SkipPLUS of a method linear at its
defaults is linear too (a sum of linear maps). Every other method explains a contrast as
one score: a ReLU (GAE, TokenTM, Chefer'21, AttnGradCAM, LeGrad, the CAMs' default
``relu=True``, Grad-CAM++'s and LayerCAM's weights), a normalisation or a probability
(VanillaGrad's ``reduce="l2"``, the perturbation methods' default
``score="probability"``, ScoreCAM's softmax weights) is not a difference of maps; the
class-agnostic methods (raw attention, Rollout, GlobEnc, ALTI) refuse it."""


def _classes(value: int | Sequence[int] | Tensor | None, name: str) -> Tensor | None:
    """``value`` as a ``[B]`` (or ``[1]``) int64 CPU tensor; ``None`` stays ``None``."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, a list of ints or an integer tensor, got bool")
    t = torch.as_tensor(value)
    if torch.is_floating_point(t) or t.dtype == torch.bool or t.dim() > 1:
        raise TypeError(f"{name} must be an int, a list of ints or a 1-D integer tensor, "
                        f"got {value!r}")
    return t.reshape(-1).long().cpu()


def _logits(out: Outputs, who: str) -> Tensor:
    if out.logits is None:
        raise ValueError(f"{who} reads the model's logits; it cannot read block outputs")
    return out.logits


class ClassTarget(Target):
    r"""A class of a classifier (today's integer ``target``), as a logit, a probability or
    a log-probability.

    Args:
        classes (int, list of int, Tensor or None): the class of every image (one for
            all); ``None``: the predicted class.
        score (str, optional): ``"logit"`` (default; the same maps as ``target=c``),
            ``"probability"`` (softmax over the classes) or ``"log_probability"``.
            Leave a method's own ``score`` option at ``"logit"``.

    Examples::

        >>> from captum_vit import GAE
        >>> from captum_vit.targets import ClassTarget
        >>> GAE(model).attribute(images, target=ClassTarget([3, 5], score="probability"))
    """

    probability = "softmax"
    classes = True

    def __init__(self, classes: int | Sequence[int] | Tensor | None = None, *,
                 score: str = "logit") -> None:
        if score not in CLASS_SCORES:
            raise ValueError(f"score must be one of {', '.join(map(repr, CLASS_SCORES))}, "
                             f"got {score!r}")
        self.value = _classes(classes, "classes")
        self.kind = score

    def __repr__(self) -> str:
        c = None if self.value is None else self.value.tolist()
        return f"ClassTarget({c}, score={self.kind!r})"

    def num_columns(self, num_classes: int) -> int:
        return num_classes

    def index(self, batch: int) -> Tensor | None:
        return None if self.value is None else per_image(self.value, batch, "classes")

    def columns(self, out: Outputs) -> Tensor:
        z = _logits(out, "ClassTarget")
        if self.kind == "probability":
            return z.softmax(-1)
        return z.log_softmax(-1) if self.kind == "log_probability" else z


class MultiLabel(ClassTarget):
    r"""A label of a multi-label head: ``logit_c`` or ``sigmoid(logit_c)``; no softmax over
    the classes (labels do not compete), so a method's ``score="probability"`` is the
    sigmoid.

    Args:
        classes (int, list of int, Tensor or None): the label of every image; ``None``:
            the highest-scoring label.
        score (str, optional): ``"logit"`` (default) or ``"probability"`` (sigmoid).

    Examples::

        >>> from captum_vit.targets import MultiLabel
        >>> TokenTM(model).attribute(images, target=MultiLabel(14))
    """

    probability = "sigmoid"

    def __init__(self, classes: int | Sequence[int] | Tensor | None = None, *,
                 score: str = "logit") -> None:
        if score not in ("logit", "probability"):
            raise ValueError(f"MultiLabel score must be 'logit' or 'probability', got {score!r}")
        super().__init__(classes, score="logit")
        self.kind = score

    def __repr__(self) -> str:
        c = None if self.value is None else self.value.tolist()
        return f"MultiLabel({c}, score={self.kind!r})"

    def columns(self, out: Outputs) -> Tensor:
        z = _logits(out, "MultiLabel")
        return z.sigmoid() if self.kind == "probability" else z


class Contrastive(Target):
    r"""``logit_a − logit_b``: "why ``a`` rather than ``b``".

    Linear in the logits, so the methods that are linear in the score
    (:data:`LINEAR_IN_SCORE`, with the options listed there) give ``map(a) − map(b)``;
    the others (ReLUs, normalisations, probabilities) explain the difference as one
    score; the class-agnostic ones (raw attention, Rollout, GlobEnc, ALTI) refuse it. A
    method's ``score="probability"`` is ``sigmoid(logit_a − logit_b) = p_a / (p_a +
    p_b)``.

    Args:
        a (int, list of int or Tensor): the class explained, per image or one for all.
        b (int, list of int or Tensor): the class it is contrasted with.

    Examples::

        >>> from captum_vit.targets import Contrastive
        >>> TokenIxG(model).attribute(images, target=Contrastive(243, 242))
    """

    contrast = True

    def __init__(self, a: int | Sequence[int] | Tensor, b: int | Sequence[int] | Tensor
                 ) -> None:
        ca, cb = _classes(a, "a"), _classes(b, "b")
        if ca is None or cb is None:
            raise ValueError("Contrastive needs both classes a and b")
        self.a: Tensor = ca
        self.b: Tensor = cb
        n = max(self.a.numel(), self.b.numel())
        if n > 1:
            self.a = per_image(self.a, n, "a")
            self.b = per_image(self.b, n, "b")

    def __repr__(self) -> str:
        return f"Contrastive({self.a.tolist()}, {self.b.tolist()})"

    def num_columns(self, num_classes: int) -> int:
        if (torch.cat([self.a, self.b]) >= num_classes).any() or (
                torch.cat([self.a, self.b]) < 0).any():
            raise ValueError(f"Contrastive classes must be in [0, {num_classes}), got "
                             f"a={self.a.tolist()}, b={self.b.tolist()}")
        return self.a.numel()

    def index(self, batch: int) -> Tensor:
        return per_image(torch.arange(self.a.numel()), batch, "Contrastive's classes")

    def columns(self, out: Outputs) -> Tensor:
        z = _logits(out, "Contrastive")
        a, b = self.a.to(z.device), self.b.to(z.device)
        return z[:, a] - z[:, b]


class _IndexedScores(Target):
    """A score function's columns with an optional column per image (``index``): one
    column without it (a single score, sigmoid probabilities), else columns that compete
    like classes (softmax)."""

    def _set_index(self, index: Any) -> None:
        self.value = _classes(index, "index")
        self.probability = "sigmoid" if index is None else "softmax"

    def num_columns(self, num_classes: int) -> int:
        return 1 if self.value is None else int(self.value.max()) + 1

    def index(self, batch: int) -> Tensor:
        value = torch.zeros(1, dtype=torch.long) if self.value is None else self.value
        return per_image(value, batch, "index")


class CallableTarget(_IndexedScores):
    """A plain callable ``f(logits) -> [n]`` (or ``[n, K]`` with ``index``) as a target;
    on a model without a classifier ``logits`` is the image embedding. What
    ``target=f`` becomes (:func:`as_target`)."""

    def __init__(self, fn: Callable[[Tensor], Tensor], index: Any = None) -> None:
        self.fn = fn
        self._set_index(index)

    def __repr__(self) -> str:
        return f"CallableTarget({getattr(self.fn, '__name__', type(self.fn).__name__)})"

    def columns(self, out: Outputs) -> Tensor:
        return _as_columns(self.fn(_logits(out, "a callable target")), out, self)


def _as_columns(s: Any, out: Outputs, who: Target) -> Tensor:
    """A score function's result as ``[n, K]`` columns, checked."""
    n = next(t for t in (out.logits, out.tokens, *out.hidden.values()) if t is not None).shape[0]
    if not isinstance(s, Tensor) or s.dim() not in (1, 2) or s.shape[0] != n:
        got = tuple(s.shape) if isinstance(s, Tensor) else type(s).__name__
        hint = ""
        if isinstance(s, Tensor) and s.dim() in (1, 2) and s.shape[0] != n:
            hint = (f"; it was called on {n} rows (perturbation methods, BT/TAM and the "
                    "metrics score many copies of each image in one forward): a score "
                    "with a parameter per image (a class, a mask) must not depend on the "
                    "batch it was written for: return every candidate as columns "
                    "[n, K] and give each image's column with index=, e.g. "
                    "CallableTarget(lambda z: z, index=classes)")
        raise ValueError(f"{who!r} must return one score per image, a tensor [{n}] (or "
                         f"[{n}, K] with an index per image), got {got}{hint}")
    if not torch.is_floating_point(s):
        raise TypeError(f"{who!r} returned a {s.dtype} tensor; a score must be a float "
                        "tensor that depends on the model's output (differentiable)")
    return s[:, None] if s.dim() == 1 else s


class TokenTarget(_IndexedScores):
    r"""Any function of the token states: a head of your own.

    ``blocks=None``: ``fn(tokens)`` on the final-normed states ``[n, N, D]`` the model's
    own head sees (prefix rows first, then the patches row by row). ``blocks=(l,)``:
    ``fn(x_l)`` on the output of block ``l-1`` before any norm (Hugging Face's
    ``hidden_states[l]``; negative counts from the end); several blocks: ``fn`` takes the
    list ``[x_l1, x_l2, …]`` in the order given.

    Args:
        fn (Callable): ``states -> [n]`` (or ``[n, K]`` with ``index``).
        blocks (int or tuple of int, optional): block outputs read. Default ``None``.
        rows (sequence of int, optional): the rows ``fn`` reads, for the gradient-free
            matrix methods' uniform readout (Rollout, raw attention, GlobEnc, ALTI);
            default the patch rows. Gradient-weighted methods weigh the rows by
            ``ReLU(⟨z_i, ∂s/∂z_i⟩)`` whatever ``rows`` says.
        index (int, list or Tensor, optional): with ``[n, K]`` scores, the column of each
            image; the columns then compete like classes (a method's
            ``score="probability"`` is their softmax; the sigmoid of a single score
            otherwise).

    Examples::

        >>> from captum_vit.targets import TokenTarget
        >>> probe = torch.nn.Linear(384, 1)                      # a probe on patch tokens
        >>> t = TokenTarget(lambda z: probe(z[:, 1:]).mean((1, 2)))
        >>> maps = GAE(dinov2).attribute(images, target=t)
        >>> t8 = TokenTarget(lambda z: z[:, 0, 5], blocks=8)     # feature 5 of CLS at x_8
    """

    reads_tokens = True

    def __init__(self, fn: Callable[[Any], Tensor], blocks: int | Sequence[int] | None = None,
                 rows: Sequence[int] | None = None, index: Any = None) -> None:
        if not callable(fn):
            raise TypeError(f"TokenTarget's fn must be callable, got {type(fn).__name__}")
        self.fn = fn
        self.order = None if blocks is None else (
            (blocks,) if isinstance(blocks, int) else tuple(blocks))
        self.blocks = self.order
        self.rows = None if rows is None else tuple(int(r) for r in rows)
        self._set_index(index)

    def __repr__(self) -> str:
        return f"TokenTarget({getattr(self.fn, '__name__', 'fn')}, blocks={self.order})"

    def columns(self, out: Outputs) -> Tensor:
        if self.order is None:
            states: Any = out.tokens
        else:
            keys = [l if l > 0 else l + out.num_blocks + 1 for l in self.order]
            got = [out.hidden[k] for k in keys]
            states = got[0] if len(got) == 1 else got
        return _as_columns(self.fn(states), out, self)


class _SelectedTarget(Target):
    """A target that weights a model output by a tensor ``select``: one selection for every
    image, or one per image with a leading ``B`` (:attr:`shared_dims` dimensions, or one
    more). Per image, :meth:`index` hands each image its own selection.

    Attributes:
        select (Tensor): the weights (a boolean mask is stored as 0/1 floats).
        shared_dims (int): the dimensions of a selection that every image shares.
    """

    select: Tensor
    shared_dims: int = 0

    def _set_select(self, select: Tensor) -> None:
        self.select = select.float() if select.dtype == torch.bool else select

    def _per_image(self) -> bool:
        return self.select.dim() == self.shared_dims + 1

    def num_columns(self, num_classes: int) -> int:
        return self.select.shape[0] if self._per_image() else 1

    def index(self, batch: int) -> Tensor:
        k = self.select.shape[0] if self._per_image() else 1
        return per_image(torch.arange(k), batch, f"{type(self).__name__}'s select")


class HeadTarget(_SelectedTarget):
    r"""``Σ select ⊙ head(patch grid)``: a segmentation or depth head of your own on the
    patch tokens, and the region of its output you ask about.

    The head receives the final-normed patch rows on the grid, ``[n, D, gh, gw]``
    (channels first; :meth:`Outputs.patches`), or the states of ``blocks`` as
    :class:`TokenTarget` does; ``select`` weights its output (a mask of the region and
    the class channel, broadcast against the head's output; ``[B, …]`` gives one
    selection per image).

    Args:
        head (Callable or nn.Module): ``[n, D, gh, gw] -> [n, C, h, w]`` (any shape whose
            trailing dimensions ``select`` broadcasts to).
        select (Tensor): the weights of the head's output, ``[C, h, w]`` for every image
            or ``[B, C, h, w]`` one per image (a boolean mask counts as 0/1).
        blocks (int or tuple of int, optional): read block outputs instead (the head then
            gets ``x_l`` on the grid).

    Examples::

        >>> from captum_vit.targets import HeadTarget
        >>> seg = torch.nn.Conv2d(384, 21, 1)                   # a linear probe, 21 classes
        >>> road = torch.zeros(21, 16, 16); road[7, 8:, :] = 1   # class 7, bottom half
        >>> maps = TokenTM(dinov2).attribute(images, target=HeadTarget(seg, road))
    """

    reads_tokens = True
    shared_dims = 3

    def __init__(self, head: Callable[..., Tensor] | nn.Module, select: Tensor,
                 blocks: int | Sequence[int] | None = None) -> None:
        if not callable(head):
            raise TypeError(f"HeadTarget's head must be callable, got {type(head).__name__}")
        if not isinstance(select, Tensor):
            raise TypeError(f"HeadTarget's select must be a tensor, got {type(select).__name__}")
        self.head = head
        self._set_select(select)
        self.blocks = None if blocks is None else (
            (blocks,) if isinstance(blocks, int) else tuple(blocks))

    def __repr__(self) -> str:
        return f"HeadTarget({type(self.head).__name__}, select={tuple(self.select.shape)})"

    def columns(self, out: Outputs) -> Tensor:
        grid: Tensor | list[Tensor]
        if self.blocks is None:
            grid = out.patches()
        else:
            states = [out.hidden[l] for l in sorted(out.hidden)]
            grid = out.patches(states[-1]) if len(states) == 1 else [out.patches(s)
                                                                       for s in states]
        try:
            y = self.head(grid)
        except RuntimeError as e:  # a shape mismatch inside the user's head (conv, linear)
            got = (tuple(grid.shape) if isinstance(grid, Tensor)
                   else [tuple(g.shape) for g in grid])
            raise ValueError(
                f"HeadTarget's head (your {type(self.head).__name__}) failed on the patch "
                f"grid it was given, shape {got} = [n, D, gh, gw] (the final-normed patch "
                "rows, channels first; a list of such grids for several blocks): make the "
                f"head take D = {got[1] if isinstance(got, tuple) else got[0][1]} "
                f"channels on that grid. The head raised: {e}") from e
        if not isinstance(y, Tensor):
            raise TypeError(f"HeadTarget's head returned {type(y).__name__}, not a tensor")
        sel = self.select.to(device=y.device, dtype=y.dtype)
        if self._per_image():  # one column per selection: [n, B]
            if sel.shape[1:] != y.shape[1:]:
                sel = sel.expand(sel.shape[0], *y.shape[1:])
            return torch.einsum("n...,b...->nb", y, sel)
        return (y * sel).flatten(1).sum(1)[:, None]


def as_target(target: Any) -> Target | None:
    """``target`` as a :class:`~captum_vit.adapters.scoring.Target`: a Target is itself, a
    plain callable becomes :class:`CallableTarget`; anything else (class indices, target
    vectors, ``None``) gives ``None``.

    Examples::

        >>> as_target(lambda z: z[:, 3] - z[:, 5])
        CallableTarget(<lambda>)
    """
    if isinstance(target, Target):
        return target
    if callable(target) and not isinstance(target, Tensor | nn.Module | type):
        return CallableTarget(target)
    if isinstance(target, nn.Module):
        raise TypeError("target is an nn.Module: wrap a head of your own in "
                        "HeadTarget(head, select) or TokenTarget(lambda z: head(z))")
    return None
