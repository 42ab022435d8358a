"""Records of one forward pass (:class:`BlockRecord`, :class:`Trace`) and the frozen
options of :meth:`captum_vit.adapters.ViTAdapter.trace` (:class:`TraceOptions`).

Design. A trace is what the methods read: the embedding output, each block's record in
the notation of :mod:`captum_vit.adapters.parts` and the logits. How the pass is run is
one frozen :class:`TraceOptions` value rather than a pile of keywords, so a new need of a
method is one documented field here, validated in one place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import Tensor

from captum_vit.adapters.layout import Layout
from captum_vit.adapters.parts import Heads

if TYPE_CHECKING:
    from captum_vit.adapters.ops import Ops

@dataclass
class BlockRecord:
    """What one block saw and produced (named as in the module docstring). An
    attention-only record
    (:meth:`ViTAdapter.block`) has ``None`` after ``attn``/``heads``."""

    x: Tensor  # x_l, the block input
    u: Tensor  # LN1(x_l)
    attn: Tensor | None  # A_l [B, H, N, N]; None for a fused trace (see heads)
    attn_out: Tensor  # ls1(a_l)
    mid: Tensor  # x_mid,l
    ffn_out: Tensor  # ls2(MLP(LN2(x_mid,l)))
    out: Tensor  # x_{l+1} (after the block's patch merge, if it has one)
    heads: Heads | None = None  # a fused trace's per-head q, k, v, o (attn is None)
    pool_shares: Tensor | None = None
    """A block with query pooling (Hiera): each pooled token's children's shares [B, N', 4]
    of the channels where they are the maximum of the pooled residual
    (:meth:`~captum_vit.adapters.windows.QueryPool.shares`), the pooling's token mixing;
    ``None`` otherwise."""

    def require_attn(self) -> Tensor:
        """:attr:`attn`, for a method that reads the probabilities.

        Raises:
            RuntimeError: the record of a fused trace (``attention="fused"``), which
                carries :attr:`heads` instead.
        """
        if self.attn is None:
            raise RuntimeError("this block record has no attention probabilities (a fused "
                               "trace): trace with attention='explicit'")
        return self.attn


@dataclass
class Trace:
    """One forward pass: the embedding output, every block's record and the logits."""

    layout: Layout
    x0: Tensor
    blocks: list[BlockRecord] = field(default_factory=list)
    logits: Tensor | None = None
    start: int = 0
    pool_attn: Tensor | None = None
    """The attention-pool head's probabilities [B, H, Q, N] (``"map"`` readout)."""
    readout_alpha: Tensor | None = None
    """``"cls_mean"`` readout with ``alpha="logit"``: the CLS share ``α`` [B, classes] of
    every class's logit (:func:`readout_alpha`), a constant of the readout."""
    read: list[Tensor] | None = None
    """A :class:`~captum_vit.adapters.scoring.Target` in force: the states ``z`` it read,
    in the graph (the final-normed tokens, or ``x_l``, for the readout weights of
    :func:`captum_vit._base.readout_rows`; the logits for a target on the logits)."""
    final_tokens: int | None = None
    """The token count of the last state when it differs from the embedding's (a model
    with stages and merges, :mod:`captum_vit.adapters.windows`); ``None`` = that of
    :attr:`x0`."""
    read_grad: list[Tensor] | None = None
    """``∂s/∂z`` of :attr:`read` (set by :func:`captum_vit._base.gradients_with_pool`)."""

    def require_logits(self) -> Tensor:
        """:attr:`logits`, for a method that reads the scores.

        Raises:
            RuntimeError: a trace run with ``logits=False``.
        """
        if self.logits is None:
            raise RuntimeError("this trace has no logits (it was run with logits=False)")
        return self.logits

    @property
    def states(self) -> list[Tensor]:
        """Residual states ``x_start .. x_L``."""
        return [b.x for b in self.blocks] + [self.blocks[-1].out] if self.blocks else [self.x0]



TRACE_ATTENTIONS = ("explicit", "fused")


@dataclass(frozen=True)
class TraceOptions:
    r"""How :meth:`~captum_vit.adapters.ViTAdapter.trace` runs a pass (one frozen value;
    ``trace(images, grad=True)`` builds it from keywords).

    Attributes:
        start (int): first block (with token states ``x`` instead of images). Default 0.
        linearize (bool): linearised backward (LN variance, q/k, GELU gate detached).
        grad (bool): build the autograd graph so gradients w.r.t. recorded tensors can be
            taken (:func:`captum_vit.methods._core.grads`); the blocks and the head then
            run on detached views of the parameters.
        cut_blocks (bool): every block after the first takes a detached copy of the
            previous block's output (a leaf, with ``requires_grad`` under ``grad``): the
            values are unchanged, but a score computed from block ``l``'s output reaches
            the earlier blocks only through block ``l``'s input, so ONE backward of
            :math:`\sum_l s^l(x_{l+1})` gives every :math:`\partial s^l / \partial A_l`
            (LeGrad, Bousselham et al., ICCV 2025). The trace's logits then carry
            gradients into the last block only.
        ops (Ops, optional): the primitive operations of the forward, e.g. an LRP rule
            set (:mod:`captum_vit.adapters.rules`); default ``Ops(linearize)``.
        attention (str): ``"explicit"`` (default): records carry the probabilities
            ``attn`` [B, H, N, N]; ``"fused"``: the fused kernel, records carry
            :class:`~captum_vit.adapters.parts.Heads` instead (``attn`` is ``None``), so
            no ``[B, H, N, N]`` tensor lives beyond its block
            (:meth:`~captum_vit.adapters.parts.Heads.probs` recomputes it).
        on_block (callable, optional): ``on_block(l, record)`` is called with each
            block's record as soon as the block has run, and the record is NOT kept in
            ``Trace.blocks`` (streaming: the method keeps what it needs, the rest is freed
            block by block).
        logits (bool): ``False``: stop once the last block has its attention (its record
            as in :meth:`~captum_vit.adapters.ViTAdapter.block` with ``attention_only``)
            and compute no logits (``Trace.logits`` is ``None``): for methods that read
            only attention probabilities under a fixed readout.
        last_rows (int, optional): the last block computes its output (after its
            attention) for the first ``last_rows`` tokens only (the readout rows): the
            logits and every gradient are those of the full forward up to rounding; the
            last record's ``attn_out``, ``mid``, ``ffn_out`` and ``out`` have
            ``last_rows`` rows. Not with ``ops``.

    Raises:
        ValueError: an unknown ``attention``, ``last_rows`` with ``ops``, or ``ops`` with
            ``attention="fused"``.

    Examples::

        >>> from captum_vit.adapters import TraceOptions
        >>> TraceOptions(grad=True, attention="fused").grad
        True
    """

    start: int = 0
    linearize: bool = False
    grad: bool = False
    cut_blocks: bool = False
    ops: Ops | None = None
    attention: str = "explicit"
    on_block: Callable[[int, BlockRecord], None] | None = None
    logits: bool = True
    last_rows: int | None = None

    def __post_init__(self) -> None:
        if self.attention not in TRACE_ATTENTIONS:
            raise ValueError(f"attention must be 'explicit' or 'fused'; got {self.attention!r}")
        if self.last_rows is not None and self.ops is not None:
            raise ValueError("last_rows needs the plain forward; do not pass ops with it")
        if self.attention == "fused" and self.ops is not None:
            raise ValueError("attention='fused' uses its own ops; pass ops only with "
                             "attention='explicit'")
