"""Sub-network views of a model: the ``f_l`` of PLUS / SkipPLUS (Mehri et al.,
CVPRW 2024, Eq. 3-4; see :mod:`captum_vit.combinators`).

A :class:`SubnetworkAdapter` is a :class:`~captum_vit.adapters.base.ViTAdapter` whose
blocks are the model's blocks ``start .. stop-1``. Its :meth:`~SubnetworkAdapter.embed`
turns images into the block input ``x_start`` (the real embedding and blocks
``0 .. start-1``, without gradient: the sub-network's input is a constant token tensor),
and its head runs the model's blocks ``stop .. L-1`` (if any) followed by the real final
norm, pooling and classifier. Everything else (layout with ``num_blocks = stop - start``,
positions, RoPE and relative-position bias rows, targeting, readout, the self-check) is
the model's adapter's: the view implements the family contract of
:class:`~captum_vit.adapters.base.ViTAdapter` by delegating to the model's adapter, and
shares its :class:`~captum_vit.adapters.state.AdapterState` (settings in force, self-check
memo).

Every method of this package takes an adapter where it takes a model
(:func:`captum_vit.adapters.adapt` returns an adapter unchanged), so ``GAE(view)`` is GAE
*of the sub-network*: it reads only blocks ``>= start``, starts its recursion at ``x_start``
and takes its gradients from the same score (``f_l(x_l)`` reproduces the model's
activations, so ``d s / d A_k`` and ``d s / d x_k`` for ``k >= l`` are the model's).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor, nn

from captum_vit.adapters.base import ViTAdapter
from captum_vit.adapters.layout import Layout
from captum_vit.adapters.ops import Ops
from captum_vit.adapters.parts import BlockParts, HeadParts
from captum_vit.adapters.scoring import probabilities
from captum_vit.adapters.stages import Stages
from captum_vit.adapters.trace import BlockRecord, Trace

OUTPUT_SCORES = ("logit", "probability")


class SubnetworkAdapter(ViTAdapter):
    r"""The sub-network of ``adapter`` made of blocks ``start .. stop-1``.

    - ``stop = None`` (``L``): :math:`f_l` of PLUS (Mehri et al., Eq. 3), blocks
      ``l .. L-1``, final norm, pooling and head, on the block input :math:`x_l`.
    - ``stop = start + 1``: a one-block window, block ``l`` alone, the blocks after it
      folded into the head. A method that acts at the last block of its model (raw
      attention, attention Grad-CAM, the token CAMs) then acts at block ``l`` with the
      model's own score: "the map at block l" of the layer-local bases
      (see :mod:`captum_vit.combinators`).

    The view owns no parameters and changes nothing: its block parts are the model
    adapter's (re-read at every entry point), its embedding and the blocks before
    ``start`` run under ``torch.no_grad()``, and the output is detached, so gradients
    start at :math:`x_l`.

    Called like a model, a view gives the sub-network's output: on token states
    ``x_l`` [B, N, D] it runs :math:`f_l(x_l)` (the forward function of a Captum
    attribution applied to the sub-network); on images [B, C, H, W] it runs the whole
    model (embedding and blocks before ``start`` with gradient). With
    ``score="probability"`` the output is :func:`~captum_vit.adapters.scoring.probabilities`
    of the scores.

    Args:
        adapter (ViTAdapter): the model's adapter (:func:`captum_vit.adapters.adapt`).
        start (int): first block ``l`` of the sub-network, in ``[0, L-1]``.
        stop (int, optional): one past its last explicit block, in ``[start+1, L]``;
            ``None`` = ``L``.
        score (str, optional): ``"logit"`` (default) or ``"probability"``: what calling
            the view returns.

    Examples::

        >>> from captum_vit import GAE
        >>> from captum_vit.adapters import adapt
        >>> from captum_vit.adapters.subnetwork import SubnetworkAdapter
        >>> f_2 = SubnetworkAdapter(adapt(model), 2)
        >>> x_2 = f_2.embed(images)                       # block-2 input, no gradient
        >>> torch.allclose(f_2.run(x_2), model(images))   # same logits
        True
        >>> gae_2 = GAE(f_2).attribute(images, target=labels)   # GAE of f_2 at x_2
        >>> from captum.attr import Saliency
        >>> grad_2 = Saliency(f_2).attribute(x_2.requires_grad_(), target=labels)
    """

    base: ViTAdapter
    start: int
    stop: int

    def __init__(self, adapter: ViTAdapter, start: int, stop: int | None = None, *,
                 score: str = "logit") -> None:
        if not isinstance(adapter, ViTAdapter):
            raise TypeError(f"adapter must be a ViTAdapter (captum_vit.adapters.adapt(model)), "
                            f"got {type(adapter).__name__}")
        if isinstance(adapter, SubnetworkAdapter):  # a view of a view: one flat view
            stop = adapter.stop if stop is None else adapter.start + stop
            start, adapter = adapter.start + start, adapter.base
        L = adapter.num_blocks
        stop = L if stop is None else stop
        for name, value in (("start", start), ("stop", stop)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if not 0 <= start < stop <= L:
            raise ValueError(f"need 0 <= start < stop <= {L} for this {L}-block model, got "
                             f"start={start}, stop={stop}")
        if score not in OUTPUT_SCORES:
            raise ValueError(f"score must be one of {', '.join(map(repr, OUTPUT_SCORES))}; "
                             f"got {score!r}")
        self.base = adapter
        self.start = start
        self.stop = stop
        self.score = score
        # what the model is, read through the family contract once
        self.model = adapter.model
        self.num_prefix = adapter.num_prefix
        self.readout = adapter.readout
        self.in_chans = adapter.in_chans
        self.embedding = adapter.embedding
        self.video = adapter.video
        self.__dict__["_state"] = adapter.state  # one set of settings per model

    def __repr__(self) -> str:
        return (f"SubnetworkAdapter({type(self.base).__name__}, start={self.start}, "
                f"stop={self.stop})")

    # -- the sub-network --------------------------------------------------------------------
    @property
    def blocks(self) -> list[BlockParts]:  # type: ignore[override]
        return self.base.blocks[self.start:self.stop]

    @property
    def num_blocks(self) -> int:
        return self.stop - self.start

    def read_layers(self) -> tuple[int, ...] | None:
        """A view's head is the model's (:meth:`logits`): the model adapter ends its
        forward where the target in force reads."""
        return None

    def refresh(self) -> None:
        self.base.refresh()

    def embed(self, inputs: Tensor, ops: Ops | None = None) -> Tensor:
        """The block input ``x_start`` of images [B, C, H, W]: the model's embedding and
        blocks ``0 .. start-1`` (plain forward), without gradient, detached (``ops`` is
        not used: no gradient reaches the pixels)."""
        with torch.no_grad():
            x = self.base.embed(inputs)
            if self.start:
                x = self.base.run(x, 0, self.start)
        return x.detach()

    def block(self, x: Any, l: int, ops: Ops, record: list[BlockRecord] | None = None,
              **options: Any) -> Any:
        """Block ``l`` of the sub-network (the model's block ``start + l``); ``options``
        as in :meth:`~captum_vit.adapters.base.ViTAdapter.block`."""
        if not 0 <= l < self.num_blocks:
            raise IndexError(f"block {l} of a {self.num_blocks}-block sub-network")
        return self.base.block(x, self.start + l, ops, record, **options)

    @property
    def readout_row_count(self) -> int | None:
        """The model's (:attr:`ViTAdapter.readout_row_count`) when the sub-network ends at
        the model's last block; ``None`` when blocks ``stop .. L-1`` follow it (they read
        every row)."""
        return self.base.readout_row_count if self.stop == self.base.num_blocks else None

    def logits(self, x: Any, ops: Ops, record: Trace | None = None) -> Any:
        """The model's blocks ``stop .. L-1`` (none for ``stop = L``), then its head."""
        for l in range(self.stop, self.base.num_blocks):
            x = self.base.block(x, l, ops)
        return self.base.logits(x, ops, record)

    def readout_logits(self, x: Any, ops: Ops | None = None, record: Trace | None = None,
                       **options: Any) -> Any:
        """The model's blocks ``stop .. L-1`` (none for ``stop = L``), then its
        :meth:`~captum_vit.adapters.base.ViTAdapter.readout_logits` with ``options``."""
        ops = ops or Ops()
        for l in range(self.stop, self.base.num_blocks):
            x = self.base.block(x, l, ops)
        return self.base.readout_logits(x, ops, record, **options)

    def layout(self, inputs: Tensor) -> Layout:
        return dataclasses.replace(self.base.layout(inputs), num_blocks=self.num_blocks)

    def __call__(self, x: Tensor) -> Tensor:
        """The sub-network's output: ``f_l(x_l)`` for token states [B, N, D], the whole
        model for images [B, C, H, W]; probabilities with ``score="probability"``."""
        if not isinstance(x, Tensor) or x.dim() not in (3, 4):
            raise ValueError("a sub-network takes token states [B, N, D] or images "
                             f"[B, C, H, W], got {getattr(x, 'shape', type(x).__name__)}")
        if x.dim() == 4:
            x = self.base.run(self.base.embed(x), 0, self.start)
        out = self.run(x)
        return probabilities(out, self.probability) if self.score == "probability" else out

    # -- stages (Swin): the model's grids, this view's block indices ----------------------------
    @property
    def stages(self) -> Stages:
        """The model's token geometry (:class:`~captum_vit.adapters.stages.Stages`) with
        this view's block indices: carried maps land on the model's first grid, and
        readout weights go through the merges of the model's blocks after the view too."""
        return Stages(self.base, offset=self.start)

    # -- everything else is the model's ------------------------------------------------------
    @property  # type: ignore[misc]  # a view: its head is the base's, never set
    def head(self) -> HeadParts:
        return self.base.head

    @property
    def input_shape(self) -> tuple[int, tuple[int, int]]:
        return self.base.input_shape

    def check_inputs(self, inputs: Tensor) -> None:
        self.base.check_inputs(inputs)

    def check_token_removal(self) -> None:
        """The model adapter's rule (a detector's sub-network keeps every detection row, so
        a target reading only prefix rows allows token removal there too); a refusal names
        what removes tokens here: a perturbation method on the block input's tokens."""
        try:
            self.base.check_token_removal()
        except ValueError:
            raise ValueError(
                f"{type(self.score_target).__name__} reads token rows, and a perturbation "
                f"method on a sub-network (PLUS, SkipPLUS) removes tokens of its block "
                f"input x_{self.start}, which changes the rows it reads: explain it with "
                "the method alone (RISE and ViT-CX mask pixels)") from None

    def is_random(self) -> bool:
        return self.base.is_random()

    def model_outputs(self, inputs: Tensor) -> Tensor:
        return self.base.model_outputs(inputs)

    def self_check(self, inputs: Tensor) -> None:
        """The model adapter's check (the view composes its parts exactly)."""
        self.base.self_check(inputs)

    def parameter_stages(self) -> list[list[nn.Parameter]]:
        """The model's stages of the sub-network: the head stage (with the blocks folded
        into it, ``stop .. L-1``), then blocks ``stop-1`` down to ``start``; the blocks
        before ``start`` belong to the embedding (no stage)."""
        stages = self.base.parameter_stages()  # head, block L-1, ..., block 0
        L = self.base.num_blocks
        folded = [p for stage in stages[1:1 + L - self.stop] for p in stage]
        return [stages[0] + folded, *stages[1 + L - self.stop:1 + L - self.start]]
