"""The adapter: first what a model family implements, then the engine.

Design (the layers of the package's DESIGN: the adapter owns all model maths). A family
adapter is a *declaration*: it says where the model keeps the canonical parameters
(:mod:`captum_vit.adapters.parts`, views of the model's own tensors), how images become
the first token states, and what geometry a batch has (:mod:`captum_vit.adapters.layout`).
Everything after the embedding is computed by the engine below, once, against an
:class:`~captum_vit.adapters.ops.Ops` object (:mod:`captum_vit.adapters.ops`): the plain,
fused and linearised forwards, the LRP rule sets (:mod:`captum_vit.adapters.rules`) and the
decompositions of the methods are all the same canonical forward with other primitives.

What a family implements is the abstract part of :class:`ViTAdapter` (each member
documented there): the attributes ``model``, ``blocks``, ``head``, ``num_prefix``,
``readout`` and ``in_chans``, and the abstract members :meth:`~ViTAdapter.layout`,
:meth:`~ViTAdapter.embed`, :attr:`~ViTAdapter.input_shape` and
:meth:`~ViTAdapter.parameter_stages` (:data:`FAMILY_CONTRACT`); optional hooks with
defaults (:meth:`~ViTAdapter.refresh`, :meth:`~ViTAdapter.embedding_norms`,
:meth:`~ViTAdapter.check_inputs`, :meth:`~ViTAdapter.is_random`,
:meth:`~ViTAdapter.model_outputs`, ``embedding``). The engine (run, trace, self-check,
targeting) is written against that contract only, so a view of a model
(:class:`~captum_vit.adapters.subnetwork.SubnetworkAdapter`) is one more implementation of
it, delegating to the model's adapter.

Why this contract reaches further models without touching the methods:

- *A score read from any block's token rows.* The methods see a trace (records of every
  block, :mod:`captum_vit.adapters.trace`) and a score, never the head: the score is the
  engine's :meth:`~ViTAdapter.readout_logits` of any block's states, and inside
  :meth:`~ViTAdapter.targeting` the head itself is replaced (a :class:`TargetHead`,
  :mod:`captum_vit.adapters.scoring`). A target reading other rows of another block is one
  more head over the recorded states; no family member changes.
- *Models made of stages* (Swin, SAM's image encoder: per stage its own token grid,
  windowed attention and a patch merge). The engine walks ``blocks`` with
  :meth:`~ViTAdapter.block`, the only place a block's maths lives, and the one attention
  (:meth:`~captum_vit.adapters.parts.BlockParts.attention`) takes the key mask and the
  tokens' positions: a windowed block is an attention whose mask and positions come from
  its window partition, and a merge is one more canonical operation between two blocks of
  a family's ``block``. The family declares these; the :class:`Layout` it returns is the
  grid the maps land on (the first stage's for Swin), so the front, the metrics and the
  plots convert maps to pixels unchanged.

Per-model settings (target embeddings, the CLS share of a ``[CLS ; mean]`` readout, the
detached parameters of a gradient trace) and the self-check memo are state of the adapter
(:class:`AdapterState`), and :func:`captum_vit.adapters.adapt` keeps one adapter per model.
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
import copy
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from captum_vit._text import count_noun
from captum_vit.adapters.layout import Layout
from captum_vit.adapters.ops import FusedOps, HeadsOps, Ops
from captum_vit.adapters.parts import (
    BlockParts,
    HeadParts,
    Heads,
    PoolParts,
    _detached,
    small_attention,
)
from captum_vit.adapters.scoring import Outputs, Target, TargetHead, check_probability_kind
from captum_vit.adapters.trace import BlockRecord, Trace, TraceOptions


def _channel_mismatch(got: int, expected: int) -> str:
    """The message for inputs with ``got`` channels fed to a model taking ``expected``,
    with the fix (a grayscale image for an RGB model: repeat its channel)."""
    want = count_noun(expected, "channel")
    if got == 1 and expected > 1:
        return (f"inputs have 1 channel (grayscale) but the model expects {want}: repeat the "
                f"channel with inputs.expand(-1, {expected}, -1, -1) (or "
                f"inputs.repeat(1, {expected}, 1, 1)), normalised as the model expects, or "
                "use a model built for 1-channel inputs (e.g. timm's in_chans=1)")
    if got == 3 and expected == 1:
        return ("inputs have 3 channels (RGB) but the model expects 1 (grayscale): convert "
                "them, e.g. to luminance with (inputs * torch.tensor([0.299, 0.587, "
                "0.114]).view(1, 3, 1, 1)).sum(1, keepdim=True), or use a 3-channel model")
    return f"inputs have {count_noun(got, 'channel')} but the model expects {want}"


@dataclasses.dataclass(frozen=True)
class AdapterSettings:
    """The per-model settings in force in the current context (:class:`AdapterState`).

    Attributes:
        target (TargetHead, Target or None): target embeddings the outputs are scored
            against, or a :class:`~captum_vit.adapters.scoring.Target` whose columns
            the outputs are (:meth:`ViTAdapter.targeting`); ``None`` = the model's own
            output.
        alpha (float or str): the ``"cls_mean"`` readout's CLS share ``α``
            (:meth:`ViTAdapter.with_cls_alpha`).
        frozen (bool): inside a gradient trace, the blocks and the head run on detached
            views of the model's parameters (:meth:`ViTAdapter.trace` with ``grad``).
    """

    target: TargetHead | Target | None = None
    alpha: float | str = 0.5
    frozen: bool = False
    hidden: dict[int, Any] | None = None
    """A target reading several blocks: the block outputs ``x_l`` of the current
    forward it reads, filled by :meth:`ViTAdapter.block`."""
    grid: tuple[int, int] | None = None
    """The patch grid of the images explained under a target (its :class:`Outputs`)."""
    probability: str = "softmax"
    """How the outputs' scores become probabilities, one of
    :data:`~captum_vit.adapters.scoring.PROBABILITY_KINDS` (the target's, or
    :meth:`ViTAdapter.probability_kind`'s)."""


class AdapterState:
    """What an adapter remembers about its model: the settings in force and the
    self-check memo.

    The settings live in a context variable owned by this object (not a module global
    keyed by the model), so they follow threads and asyncio tasks as Python's
    :mod:`contextvars` do: a setting made in one thread is not seen by another, and a
    ``with`` block restores the previous settings on exit, also after an exception. A
    view of the model (:class:`~captum_vit.adapters.subnetwork.SubnetworkAdapter`) shares
    its model adapter's state.

    Examples::

        >>> state = AdapterState()
        >>> with state.override(alpha="logit"):
        ...     state.settings.alpha
        'logit'
        >>> state.settings.alpha
        0.5
    """

    def __init__(self, settings: contextvars.ContextVar[AdapterSettings] | None = None) -> None:
        self._var = settings if settings is not None else contextvars.ContextVar(
            "captum_vit_adapter_settings", default=AdapterSettings())  # noqa: B039 (frozen)
        self.checked: set[tuple[Any, ...]] = set()
        """The (adapter type, dtype, device, input size) keys :meth:`ViTAdapter.self_check`
        has passed."""

    @property
    def settings(self) -> AdapterSettings:
        """The settings in force in the current context."""
        return self._var.get()

    @contextlib.contextmanager
    def override(self, **changes: Any) -> Iterator[AdapterSettings]:
        """Within the block the settings have ``changes`` (fields of
        :class:`AdapterSettings`); the previous ones are restored on exit."""
        token = self._var.set(dataclasses.replace(self._var.get(), **changes))
        try:
            yield self._var.get()
        finally:
            self._var.reset(token)

    def __deepcopy__(self, memo: dict[int, Any]) -> AdapterState:
        # a deep copy of an adapter (of a method holding one) is the adapter of a copied
        # model: fresh settings and memo (a context variable cannot be copied)
        return AdapterState()

    def __reduce__(self) -> tuple[type[AdapterState], tuple[()]]:
        return AdapterState, ()

    def renewed(self) -> AdapterState:
        """A state for a rebuilt adapter of the same model: the same settings (a rebuild
        inside a ``with`` block keeps them), an empty self-check memo."""
        return AdapterState(self._var)


FAMILY_CONTRACT = ("layout", "embed", "input_shape", "parameter_stages")
"""The abstract members of :class:`ViTAdapter`: what every model family implements
(besides the attributes ``model``, ``blocks``, ``head``, ``num_prefix``, ``readout`` and
``in_chans``)."""


class ViTAdapter(abc.ABC):
    """Canonical pre-LN ViT on top of a concrete model.

    **What a family implements.** A family adapter sets the attributes below in its
    ``__init__`` and implements the abstract members (:data:`FAMILY_CONTRACT`); a subclass
    missing one of them cannot be instantiated. The optional hooks have defaults.

    Attributes:
        model (nn.Module): the model (never modified).
        blocks (list[BlockParts]): the canonical parameters of every block, in order
            (views of the model's parameters, :mod:`captum_vit.adapters.parts`).
        head (HeadParts): final norm, pooling and classifier(s) (set through the
            :attr:`head` property, which adds the target in force when read).
        num_prefix (int): ``K``, the prefix tokens (CLS, DIST, registers) before the
            patches.
        readout (str): how the logits read the last state, one of
            :data:`~captum_vit.adapters.layout.READOUTS`.
        in_chans (int): the number of input channels.
        embedding (bool): whether the model outputs an image embedding (default
            ``False``).

    Abstract members: :meth:`layout` (the geometry of a batch), :meth:`embed` (images to
    ``x_0``), :attr:`input_shape` (the default input size) and :meth:`parameter_stages`
    (the model's parameters by cascade stage). Optional hooks: :meth:`refresh`,
    :meth:`embedding_norms`, :meth:`check_inputs`, :meth:`is_random`,
    :meth:`model_outputs`.
    """

    model: nn.Module
    blocks: list[BlockParts]
    _head_parts: HeadParts
    num_prefix: int
    readout: str
    in_chans: int

    # -- what a family implements --------------------------------------------------------
    @abc.abstractmethod
    def layout(self, inputs: Tensor) -> Layout:
        """The token geometry of images ``inputs`` [B, C, H, W] (:class:`Layout`): prefix
        rows, the patch grid the maps land on, the patch size in pixels, the readout."""

    @abc.abstractmethod
    def embed(self, inputs: Tensor, ops: Ops | None = None) -> Tensor:
        """The token states ``x_0`` [B, N, D] of images [B, C, H, W].

        ``ops=None`` runs the model's own embedding modules. With ``ops`` the patch
        projection (a convolution with stride = kernel, :func:`patch_projection`) goes
        through ``ops.linear`` and each normalisation of the embedding
        (:meth:`embedding_norms`) through ``ops.norm``, so a rule set of modified
        backward passes (LRP at the pixels, :mod:`captum_vit.adapters.rules`) reaches the
        pixels; prefix
        tokens, position embeddings (interpolation included) and rotary tables stay the
        model's own code, and the forward values are the model's up to rounding.
        """

    @property
    @abc.abstractmethod
    def input_shape(self) -> tuple[int, tuple[int, int]]:
        """``(channels, (H, W))``: the model's default input size."""

    @abc.abstractmethod
    def parameter_stages(self) -> list[list[nn.Parameter]]:
        """The model's own parameters by cascade stage, for the model-randomisation check.

        Returns:
            list of lists of ``nn.Parameter`` (the model's objects, not views, so an
            in-place randomisation changes the model): the head stage first (final norm,
            ``fc_norm``, classifier head(s)), then one stage per block from the top block
            ``L-1`` down to 0. Every parameter appears exactly once; the embedding's
            (patch embedding, prefix tokens, positional embedding, pre-norm) appear in
            none.
        """

    # -- optional hooks ------------------------------------------------------------------
    def refresh(self) -> None:
        """Re-read the parts if the model's parameters were replaced (e.g. ``model.to``).

        Called at every entry point (:meth:`layout`, :meth:`embed`, :meth:`run`,
        :meth:`trace`); adapters whose parts are the parameters themselves need nothing.
        """
        return None

    def embedding_norms(self) -> tuple[str, ...]:
        """Names of the normalisations inside :meth:`embed` (a pre-norm such as CLIP's
        ``pre_layrnorm``); empty when the embedding is affine in the pixels (patch
        projection, prefix tokens, position embedding). ``embed(inputs, ops)`` runs each
        of them through ``ops.norm`` (pixel-level LRP: the LN rule,
        :mod:`captum_vit.adapters.rules`)."""
        return ()

    @property
    def state(self) -> AdapterState:
        """This adapter's :class:`AdapterState` (settings in force, self-check memo),
        created on first use; a view of the model shares its model adapter's."""
        state = self.__dict__.get("_state")
        if state is None:
            state = self.__dict__.setdefault("_state", AdapterState())
        return state

    def check_inputs(self, inputs: Tensor) -> None:
        """Raise a clear error for inputs the model cannot take (subclasses add their size
        rules).

        The dtype rule (no silent casts): floating-point inputs must have the dtype of
        the model's parameters, else ``TypeError`` naming both dtypes and the fix. The
        channels must be the model's, and a model whose output is random (training mode
        with active dropout) is refused.
        """
        self.refresh()
        want = self.dtype
        if torch.is_floating_point(inputs) and inputs.dtype != want:
            raise TypeError(
                f"inputs are {inputs.dtype} but the model's parameters are {want}; convert "
                f"the inputs with inputs.to({want}) or the model with "
                f"model.to({inputs.dtype})")
        if inputs.shape[-3] != self.in_chans:  # [B, C, H, W], videos [B, T, C, H, W]
            if self.video and inputs.dim() == 5 and inputs.shape[1] == self.in_chans:
                raise ValueError(
                    f"inputs of shape {tuple(inputs.shape)} look like [B, C, T, H, W] "
                    "(channels before frames); video models take [B, T, C, H, W], frames "
                    "before channels: pass inputs.permute(0, 2, 1, 3, 4)")
            raise ValueError(_channel_mismatch(inputs.shape[-3], self.in_chans))
        if self.is_random():
            raise ValueError("the model is in training mode with active dropout/drop-path, "
                             "so its output is random; call model.eval() before explaining")

    def is_random(self) -> bool:
        """Whether the model's forward is random now (training mode with active dropout)."""
        return False

    @staticmethod
    def check_patch_multiple(inputs: Tensor, patch: tuple[int, int]) -> None:
        """Refuse images whose size is not a multiple of the patch size (for
        :meth:`check_inputs` of families that interpolate their position embedding)."""
        h, w = inputs.shape[-2:]
        if h % patch[0] or w % patch[1]:
            raise ValueError(f"inputs size {(h, w)} is not divisible by the patch size "
                             f"{tuple(patch)}; resize, crop or pad the images to a multiple "
                             "of it")

    @staticmethod
    def check_fixed_size(inputs: Tensor, size: tuple[int, int], why: str) -> None:
        """Refuse images of another size than ``size`` (families whose position embedding
        is not interpolated; ``why`` names the model)."""
        got = tuple(inputs.shape[-2:])
        if got != tuple(size):
            raise ValueError(f"inputs size {got} does not match {why}'s fixed image_size "
                             f"{tuple(size)} (its position embedding is not interpolated); "
                             "resize the images")

    video: bool = False
    """Whether the model takes videos ``[B, T, C, H, W]`` rather than images ``[B, C, H,
    W]`` (its :meth:`layout` then sets ``frames``, :mod:`captum_vit.adapters.layout`)."""

    embedding: bool = False
    """Whether the model outputs an image embedding (CLIP, SigLIP, head-less models)
    rather than class logits: its targets are vectors (:mod:`captum_vit.targets`)."""

    def model_outputs(self, inputs: Tensor) -> Tensor:
        """The model's own output for ``inputs``: logits [B, classes] or the image
        embedding [B, D′] (its forward, not ours)."""
        return self.model(inputs)

    def model_logits(self, inputs: Tensor) -> Tensor:
        """:meth:`model_outputs`, scored against the target embeddings inside
        :meth:`targeting`."""
        target = self.state.settings.target
        if isinstance(target, Target):  # the target reads what only our forward has
            return self.run(self.embed(inputs))
        out = self.model_outputs(inputs)
        return out if target is None else target.scores(out)

    @property
    def head(self) -> HeadParts:
        """The model's head, scoring against the target embeddings in force for this model
        (:meth:`targeting`)."""
        base = self._head_parts
        target = self.state.settings.target
        return base if target is None else dataclasses.replace(base, target=target)

    @head.setter
    def head(self, value: HeadParts) -> None:
        self._head_parts = dataclasses.replace(value, target=None) if value.target is not None \
            else value

    @property
    def score_target(self) -> Target | None:
        """The :class:`~captum_vit.adapters.scoring.Target` in force for this model
        (:meth:`targeting`), ``None`` for the model's own output or target embeddings."""
        target = self.state.settings.target
        return target if isinstance(target, Target) else None

    def read_layers(self) -> tuple[int, ...] | None:
        """The block outputs the target in force reads (sorted, in ``[1, L]``), ``None``
        when it reads the model's output."""
        target = self.score_target
        return None if target is None else target.readout_layers(len(self.blocks))

    @property
    def cls_alpha(self) -> float | str:
        """The CLS share ``α`` of a ``"cls_mean"`` readout in force for this model (½
        unless set by :meth:`with_cls_alpha`)."""
        return self.state.settings.alpha

    @contextlib.contextmanager
    def with_cls_alpha(self, alpha: float | str) -> Iterator[None]:
        """Within the block, maps of this model (every adapter of the same model object)
        read its ``[CLS ; patch mean]`` classifier as ``w = α e_0 + (1 − α) u_P``
        (see :func:`captum_vit.adapters.readout_alpha`)."""
        if self.readout != "cls_mean":
            raise ValueError(f"alpha applies to a classifier on [CLS ; mean of the patches] "
                             f"(Hugging Face DINOv2); this {type(self.model).__name__} reads "
                             f"out {self.readout!r}")
        if isinstance(alpha, str):
            if alpha != "logit":
                raise ValueError(f"alpha must be a float in [0, 1] or 'logit', got {alpha!r}")
        elif isinstance(alpha, bool) or not isinstance(alpha, int | float) \
                or not 0.0 <= float(alpha) <= 1.0:
            raise ValueError(f"alpha must be a float in [0, 1] or 'logit', got {alpha!r}")
        else:
            alpha = float(alpha)
        with self.state.override(alpha=alpha):
            yield

    @contextlib.contextmanager
    def targeting(self, target: TargetHead | Target | None, *,
                  grid: tuple[int, int] | None = None) -> Iterator[None]:
        """Within the block the outputs (:meth:`logits`, :meth:`model_logits`) of every
        adapter of this model are the scores against ``target`` [B, T], or the columns
        ``[B, K]`` of a :class:`~captum_vit.adapters.scoring.Target` (``None``:
        unchanged). A target reading block outputs ``x_l`` (``Target.blocks``) also makes
        the model end at its last read block (:attr:`num_blocks`): later blocks do not
        reach its score. Nested calls replace the target; the previous one is restored on
        exit. The setting lives in a context variable, so threads and other models are not
        affected. ``grid``: the patch grid of the images (what a target's
        :class:`~captum_vit.adapters.scoring.Outputs` report; default square)."""
        if target is None:
            yield
            return
        changes: dict[str, Any] = {"target": target, "grid": grid,
                                   "probability": target.probability}
        if isinstance(target, Target):
            layers = target.readout_layers(len(self.blocks))
            changes["hidden"] = (dict.fromkeys(layers) if layers is not None
                                 and len(layers) > 1 else None)
        with self.state.override(**changes):
            yield

    @property
    def probability(self) -> str:
        """How this model's scores become probabilities in the current context:
        ``"softmax"`` (competing classes, the default) or ``"sigmoid"`` (independent
        scores), the target's in force (:meth:`targeting`) or :meth:`probability_kind`'s.
        Pass it to :func:`~captum_vit.adapters.probabilities`."""
        return self.state.settings.probability

    @contextlib.contextmanager
    def probability_kind(self, kind: str) -> Iterator[None]:
        """Within the block this model's scores (every adapter of the same model object)
        are probabilities of ``kind``: ``"softmax"`` (competing classes) or ``"sigmoid"``
        (independent scores: a multi-label head); the previous kind is restored on exit.
        The setting is adapter state (a context variable of this model's), so threads and
        other models are not affected.

        Args:
            kind (str): ``"softmax"`` or ``"sigmoid"``.

        Raises:
            ValueError: another ``kind``.

        Examples::

            >>> with adapt(model).probability_kind("sigmoid"):
            ...     deletion(model, images, GAE(model))
        """
        with self.state.override(probability=check_probability_kind(kind)):
            yield

    # -- what the model is -------------------------------------------------------------------
    @property
    def readout_row_count(self) -> int | None:
        """How many leading token rows of the last state the logits read: the prefix
        tokens for a class-token (or distilled) readout, ``None`` when they read the
        patch rows too (average pooling, CLS+mean, an attention pool)."""
        h = self.head
        target = self.score_target
        if target is not None and (target.reads_tokens or target.blocks is not None):
            return None
        rows = [row for row, _, _ in h.heads if isinstance(row, int)]
        if h.attn_pool is not None or len(rows) != len(h.heads):
            return None
        return max(rows) + 1

    @property
    def fixed_readout(self) -> bool:
        """Whether the readout weights are the same for every image
        (:meth:`Layout.readout_weights`): no attention-pool head and no per-image CLS
        share (``alpha="logit"``), so a gradient-free map needs no logits."""
        return self.head.attn_pool is None and not (self.readout == "cls_mean"
                                                    and self.cls_alpha == "logit")

    @property
    def num_classes(self) -> int:
        """Number of scores: classes (rows of the classifier head), the embedding size of
        a head-less model, or the number ``T`` of target embeddings in force."""
        head = self.head
        weight = head.heads[0][1]
        pre = getattr(head, "pre_logits", None)
        if weight is None and pre is not None:  # the representation layer's output
            weight = pre[0]
        neck = getattr(head, "neck", None)
        if weight is None and neck is not None:  # the neck's output (NeckHeadParts)
            weight = neck.weight
        last = self.blocks[-1]  # a head-less model outputs its last state's width
        width = (last.proj_weight if last.merge is None else last.merge.weight).shape[0]
        own = int(weight.shape[0] if weight is not None else width)
        target = self.state.settings.target
        if isinstance(target, Target):
            return target.num_columns(own)
        return own if target is None else target.num_columns

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the model's parameters (inputs must have it)."""
        return self.blocks[0].k_weight.dtype

    # -- canonical forward ----------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """``L``; inside :meth:`targeting` with a target reading block outputs, the last
        block it reads (the blocks after it do not reach the score)."""
        layers = self.read_layers()
        return len(self.blocks) if layers is None else layers[-1]

    def block(self, x: Any, l: int, ops: Ops, record: list[BlockRecord] | None = None, *,
              attention_only: bool = False, rows: int | None = None) -> Any:
        """Block ``l`` on ``x`` (the module docstring's notation): attention sublayer then
        FFN sublayer.

        With ``attention_only`` the block stops once it has its attention (for methods
        that read nothing else of it): it returns ``None`` and its record has ``x``,
        ``u`` and ``attn`` (or ``heads``), ``None`` in the other fields. With ``rows``
        (plain-tensor ops) everything after the attention is computed for the first
        ``rows`` tokens only, so the output and the record's later fields have ``rows``
        rows: the last block under a readout of the prefix rows
        (:attr:`readout_row_count`)."""
        p = self.blocks[l]
        if self.state.settings.frozen:
            p = _detached(p)
        u = ops.norm(x, p.norm1)
        a, attn = ops.attention(u, p)
        heads = attn if isinstance(attn, Heads) else None
        if attention_only:
            if record is not None:
                # an attention-only record has None after attn (BlockRecord's docstring)
                record.append(BlockRecord(
                    ops.value(x), ops.value(u), None if heads is not None else attn,
                    None, None, None, None, heads))  # type: ignore[arg-type]
            return None
        if rows is not None:  # only these rows reach the readout
            a, x = a[:, :rows], x[:, :rows]
        if p.inner_norm is not None:  # N_in (EVA-02's scale_attn_inner)
            a = ops.norm(a, p.inner_norm)
        a = ops.linear(a, p.proj_weight, p.proj_bias)
        if p.ls1 is not None:
            a = ops.scale(a, p.ls1)
        mid = ops.add(x, a)
        u2 = ops.norm(mid, p.norm2)
        h = ops.linear(u2, p.fc1_weight, p.fc1_bias)
        if p.gate_weight is None:
            h = ops.act(h, p.act)
        else:
            h = ops.gated(ops.linear(u2, p.gate_weight, p.gate_bias), h, p.act)
        if p.mlp_norm is not None:
            h = ops.norm(h, p.mlp_norm)
        f = ops.linear(h, p.fc2_weight, p.fc2_bias)
        if p.ls2 is not None:
            f = ops.scale(f, p.ls2)
        out = ops.add(mid, f)
        if p.merge is not None:  # the last block of a stage: merge onto the next grid
            m = p.merge
            out = ops.linear(ops.norm(ops.gather(out, m), m.norm), m.weight, m.bias)
        hidden = self.state.settings.hidden
        if hidden is not None and l + 1 in hidden:  # a target reading several blocks
            hidden[l + 1] = out
        if record is not None:
            v = ops.value
            record.append(BlockRecord(v(x), v(u), None if heads is not None else attn, v(a),
                                      v(mid), v(f), v(out), heads))
        return out

    def small_attention(self, inputs: Tensor) -> bool:
        """Whether every block's attention on ``inputs`` is small
        (:func:`~captum_vit.adapters.parts.small_attention`: keys per query, the window's
        area for a windowed block, at most four times the head width): a method that
        needs every block's probabilities and their gradients then traces the explicit
        attention, which keeps them for the backward, rather than the fused kernel, whose
        backward recomputes them (faster on the CPU for little memory).

        Args:
            inputs (Tensor): the images (their layout gives the token count).

        Returns:
            bool
        """
        n = self.layout(inputs).num_tokens
        return all(small_attention(n if p.window is None else p.window.area, p.head_dim)
                   for p in self.blocks)

    @property
    def has_stages(self) -> bool:
        """Whether the blocks form stages joined by patch merges (Swin): token maps of a
        later stage are carried to the maps' grid by :meth:`carry`."""
        return any(p.merge is not None for p in self.blocks)

    @property
    def final_tokens(self) -> int | None:
        """The token count of the last state for a model with windows (its last block's
        grid), ``None`` otherwise (the embedding's count, which depends on the images)."""
        last = self.blocks[self.num_blocks - 1].window
        return None if last is None else last.num_tokens

    def carry(self, values: Tensor, layer: int | None = None, *, split: bool = False,
              down_to: int | None = None) -> Tensor:
        """Per-token values ``[..., N_l]`` of the state ``x_l`` (the input of block
        ``l``; ``l = L``: the last state) on the first stage's grid, the grid the maps
        land on (:mod:`captum_vit.adapters.windows`). Each merge is undone from the top:
        a merged token's value goes to its children, copied (``split=False``: a score per
        token, as a map is upsampled to pixels) or shared equally among its real
        children (``split=True``: a relevance, whose sum is kept; the ¼ weights of
        the merge's token mixing, a padded child of an odd grid taking no share). A
        model without merges returns ``values`` unchanged.

        Args:
            values (Tensor): ``[..., N_l]``.
            layer (int, optional): ``l``; ``None`` = the stage whose token count is
                ``N_l`` (the stages' counts differ).
            split (bool): share rather than copy.
            down_to (int, optional): stop at the grid of ``x_{down_to}`` (the merges of
                blocks ``down_to .. l-1`` are undone); ``None`` = the maps' grid (the
                first stage's).

        Returns:
            Tensor ``[..., N_{down_to}]``.

        Raises:
            ValueError: ``N_l`` is no stage's token count.
        """
        if not self.has_stages:
            return values
        down_to = down_to or 0
        stop = len(self.blocks) if layer is None else layer
        merges = [p.merge for p in self.blocks[down_to:stop] if p.merge is not None]
        if layer is None:
            while merges and merges[-1].out_grid[0] * merges[-1].out_grid[1] != values.shape[-1]:
                merges.pop()
        for m in reversed(merges):
            values = _unmerge(values, m, split)
        first = self.blocks[down_to].window
        if first is not None and values.shape[-1] != first.num_tokens:
            raise ValueError(f"values of {values.shape[-1]} tokens are on no stage's grid")
        return values

    def unmerge(self, v: Tensor, layer: int, weights: Tensor | None = None) -> Tensor:
        """Row vectors ``v`` ``[..., N_{l+1}]`` on the grid of ``x_{l+1}`` times the
        token mixing ``P_l`` of block ``l``'s merge (``vᵀ P_l``, ``[..., N_l]``: each
        merged token's weight shared equally among its real children, the merge weights
        of the gradient-free and gradient-weighted matrix methods, or by ``weights``
        ``[B, N_{l+1}, 4]`` per child in concatenation order, a method's own); ``v``
        itself for a block without merge. The step of a vector chain through a merge."""
        m = self.blocks[layer].merge
        return v if m is None else _unmerge(v, m, True, weights)

    def token_mix(self, v: Tensor, matrix: Tensor, layer: int) -> Tensor:
        """``vᵀ C`` for row vectors ``v`` ``[..., N]`` and a token-mixing matrix ``C`` of
        block ``layer`` in the form of its attention probabilities: ``[..., N, N]``, or
        ``[..., n_W, M, M]`` for a windowed block (block-diagonal in window order, never
        built densely; :meth:`~captum_vit.adapters.windows.Windows.left_multiply`). The
        leading dimensions broadcast (``v`` [B, N] against per-head ``C`` [B, H, ...]
        gives [B, H, N])."""
        win = self.blocks[layer].window
        v = v.to(matrix.dtype)
        lead = matrix.dim() - (2 if win is None else 3)  # matrix dims before [(n_W,) N, N]
        while v.dim() - 1 < lead:
            v = v.unsqueeze(1)
        while lead < v.dim() - 1:
            matrix, lead = matrix.unsqueeze(1), lead + 1
        if win is None:
            return torch.einsum("...n,...nm->...m", v, matrix)
        return win.left_multiply(v, matrix)

    def real_keys(self, matrix: Tensor, layer: int) -> Tensor:
        """A token-mixing matrix of block ``layer`` (:meth:`token_mix`) without the
        columns of padded window slots (no tokens: the dense ``N × N`` matrix has no such
        columns), for a method that normalises rows; ``matrix`` itself for global
        attention."""
        win = self.blocks[layer].window
        if win is None:
            return matrix
        return matrix * (win.index(matrix.device) >= 0).to(matrix.dtype)[..., None, :]

    def token_eye(self, layer: int, n: int, dtype: torch.dtype,
                  device: torch.device | None = None) -> Tensor:
        """The identity in the form of block ``layer``'s token-mixing matrices
        (:meth:`token_mix`): ``[n, n]`` (``n = N``), or ``[M, M]`` (every window's) for a
        windowed block."""
        win = self.blocks[layer].window
        return torch.eye(n if win is None else win.area, dtype=dtype, device=device)

    def carry_down(self, w: Tensor, layer: int) -> Tensor:
        """Readout weights ``w`` ``[..., N_L]`` of the last state through the merges of
        blocks ``layer .. L-1`` (:meth:`unmerge`), on the grid of ``x_layer``: the
        readout of a single block's matrix in a model with stages."""
        for k in reversed(range(layer, self.num_blocks)):
            w = self.unmerge(w, k)
        return w

    def logits(self, x: Any, ops: Ops, record: Trace | None = None) -> Any:
        """Final norm, pooling and head(s) on the last residual state (``record``: a
        trace that keeps the attention pool's probabilities)."""
        return self._head_logits(x, ops, record, self.head)

    def readout_logits(self, x: Any, ops: Ops | None = None, record: Trace | None = None, *,
                       final_norm: bool = True, pool: str = "model") -> Any:
        r"""The model's readout applied to the token states ``x`` [B, N, D] of any block
        (LeGrad's per-layer scores :math:`s^l` on :math:`z^l = x_{l+1}`; Bousselham et
        al., ICCV 2025).

        With the defaults this is :meth:`logits`: final norm, pooling (class token,
        average, attention pool, ...), ``fc_norm``, head(s) and, inside
        :meth:`targeting`, the scores against the target embeddings.

        Args:
            x: token states [B, N, D].
            ops (Ops, optional): primitive operations (default: plain forward).
            record (Trace, optional): receives the attention pool's probabilities
                (``record.pool_attn``) when the pool is used.
            final_norm (bool): apply the model's final norm (``False``: LeGrad's SigLIP
                reference pools the block output directly).
            pool (str): ``"model"`` (the model's own pooling) or ``"mean"``: the mean of
                all N rows (prefix included) first, then the final norm, ``fc_norm`` and
                every head on that one vector (LeGrad's CLIP reference,
                :math:`\mathrm{LN}_{post}(\mathrm{mean}_i z_i) W_{proj}`); an attention
                pool is not used.

        Returns:
            Logits [B, classes] (or scores [B, T] against target embeddings).
        """
        if pool not in ("model", "mean"):
            raise ValueError(f"pool must be 'model' or 'mean'; got {pool!r}")
        ops = ops or Ops()
        if pool == "model" and final_norm:
            return self.logits(x, ops, record)
        h = self.head
        if pool == "mean":
            x = x.mean(1, keepdim=True)  # one token: the mean of all rows
            h = dataclasses.replace(h, heads=tuple((0, w, b) for _, w, b in h.heads),
                                    attn_pool=None)
        if not final_norm:
            h = dataclasses.replace(h, norm=None)
        return self._head_logits(x, ops, record, h)

    def _head_logits(self, x: Any, ops: Ops, record: Trace | None, h: HeadParts) -> Any:
        """Final norm, pooling and head(s) of ``h`` on the token states ``x`` (the
        columns of the :class:`~captum_vit.adapters.scoring.Target` in force)."""
        target = self.score_target
        if target is not None:
            return self._target_columns(x, ops, record, h, target)
        return self._own_logits(x, ops, record, h)[0]

    def _target_columns(self, x: Any, ops: Ops, record: Trace | None, h: HeadParts,
                        target: Target) -> Any:
        """The target's columns ``[n, K]`` on the last state ``x`` (:mod:`captum_vit.targets`).

        The target runs on plain tensors (its own code). Under a rule set whose values
        are not tensors (DecompX's decomposition) a token-reading target is linearised at
        the states it reads, ``Σ_i ⟨z_i, ∂s/∂z_i⟩`` per column (the
        decomposition is complete through the target only where it is linear)."""
        layers = target.readout_layers(len(self.blocks))
        lay = self._outputs_layout(x)
        if layers is not None:
            stash = self.state.settings.hidden
            hidden = {l: (stash.get(l) if stash is not None and l != layers[-1] else x)
                      for l in layers}
            if any(v is None for v in hidden.values()):
                raise RuntimeError(f"the forward did not pass block outputs {list(layers)} "
                                   "this target reads (start the forward at x_0)")
            read: list[Any] = [hidden[l] for l in layers]
            out = Outputs(hidden={l: ops.value(v) for l, v in hidden.items()}, **lay)
        else:
            # a token-reading target's readout is its rows, not the attention pool's
            logits, tokens, pooled = self._own_logits(
                x, ops, None if target.reads_tokens else record, h)
            if record is not None and record.readout_alpha is not None and not target.classes:
                raise ValueError(f"alpha='logit' reads the class-token share of the explained "
                                 f"class's logit; {type(target).__name__} explains no class "
                                 "of the model: use a fixed alpha in [0, 1]")
            # a target on the logits reads them: the model's own head stays whole (DecompX)
            read = [tokens] if target.reads_tokens else [logits]
            out = Outputs(logits=ops.value(logits), pooled=ops.value(pooled),
                          tokens=ops.value(tokens), extra=self.output_extras(ops.value(tokens)),
                          **lay)
        if not all(ops.value(v) is v for v in read):  # decomposed values
            return self._linearised_columns(read, out, ops, target, layers)
        cols = target.columns(out)
        if record is not None:
            record.read = read
        return cols

    def output_extras(self, tokens: Tensor) -> dict[str, Tensor]:
        """Family hook: what a target may read besides the standard
        :class:`~captum_vit.adapters.scoring.Outputs`, computed from the final-normed
        ``tokens`` [n, N, D] (YOLOS: per-detection class logits and boxes). Default none."""
        return {}

    def _outputs_layout(self, x: Any) -> dict[str, Any]:
        """``num_prefix`` and ``grid`` of :class:`Outputs` for the states ``x``."""
        n = self.num_prefix
        p = max(_value_shape(x)[1] - n, 0)  # the last block may keep the prefix rows only
        side = math.isqrt(p)
        grid = self.state.settings.grid or ((side, side) if side * side == p else (1, p))
        return {"num_prefix": n, "grid": grid, "num_blocks": len(self.blocks)}

    def _linearised_columns(self, read: list[Any], out: Outputs, ops: Ops, target: Target,
                            layers: tuple[int, ...] | None) -> Any:
        """Columns of a target on decomposed states: each read state's parts contracted
        with the gradient of the column at the real state (``Σ_i ⟨z_i, ∂s/∂z_i⟩``; a
        target on the logits is linearised at the logits, ``Σ_c z_c ∂s/∂z_c``)."""
        values = [ops.value(v).detach().requires_grad_() for v in read]
        with torch.enable_grad():
            if layers is not None:
                probe = dataclasses.replace(out, hidden=dict(zip(layers, values, strict=True)))
            elif not target.reads_tokens:
                probe = dataclasses.replace(out, logits=values[0])
            else:  # the family's extras (detection heads) are functions of the leaf too
                probe = dataclasses.replace(out, tokens=values[0],
                                            extra=self.output_extras(values[0]))
            cols = target.columns(probe)
            grads = [torch.stack(g, -1) for g in zip(*(
                torch.autograd.grad(cols[:, k].sum(), values, allow_unused=True,
                                    retain_graph=True, materialize_grads=True)
                for k in range(cols.shape[1])), strict=True)]  # [n, N, D, K] per state
        return functools.reduce(ops.add, [ops.contract(v, g) for v, g in
                                          zip(read, grads, strict=True)])

    def _own_logits(self, x: Any, ops: Ops, record: Trace | None, h: HeadParts
                    ) -> tuple[Any, Any, Any]:
        """(logits, final-normed tokens, pooled vector) of the model's own head ``h``."""
        if self.state.settings.frozen:
            h = _detached(h)
        if h.norm is not None:
            x = ops.norm(x, h.norm)
        neck = getattr(h, "neck", None)
        if neck is not None:  # a token-mixing neck before the pooling (NeckHeadParts)
            x = neck(x, ops)
        tokens = x
        pooled, pre = None, getattr(h, "pre_logits", None)
        if h.attn_pool is not None:
            pooled, probs = self._attention_pool(x, h.attn_pool, ops)
            if record is not None:
                record.pool_attn = probs
        outs, zs = [], []
        for row, weight, bias in h.heads:
            z = pooled if row == "map" else ops.pool(x, row, self.num_prefix)
            if h.fc_norm is not None:
                z = ops.norm(z, h.fc_norm)
            if pre is not None:  # a representation layer (PreLogitsHeadParts)
                z = ops.act(ops.linear(z, pre[0], pre[1]), pre[2])
            zs.append(z)
            outs.append(z if weight is None else ops.linear(z, weight, bias))
        if record is not None and self.readout == "cls_mean" and self.cls_alpha == "logit":
            with torch.no_grad():  # |W¹_c·h_0| / (|W¹_c·h_0| + |W²_c·mean h|)
                # a "cls_mean" readout has two classifier rows (never None)
                cls, mean = (F.linear(ops.value(z).detach(), cast(Tensor, w)).abs()
                             for z, (_, w, _) in zip(zs, h.heads, strict=True))
                record.readout_alpha = cls / (cls + mean).clamp_min(torch.finfo(cls.dtype).tiny)
        out = functools.reduce(ops.add, outs) if h.combine == "sum" else ops.mean(outs)
        pooled = zs[0] if len(zs) == 1 else ops.concat(zs)
        if h.target is None or isinstance(h.target, Target):
            return out, tokens, pooled
        if h.target.cosine:
            out = ops.normalize(out)
        return ops.linear(out, h.target.weight(), h.target.bias_vector()), tokens, pooled

    @staticmethod
    def _attention_pool(x: Any, p: PoolParts, ops: Ops) -> tuple[Any, Tensor | None]:
        """``z[0]`` of the attention-pool head (:class:`PoolParts`) and its
        probabilities."""
        mix, probs = ops.pool_attention(x, p)
        o = ops.linear(mix, p.proj_weight, p.proj_bias)
        if p.fc1_weight is not None:
            u = o if p.norm is None else ops.norm(o, p.norm)
            # PoolParts sets fc1, act and fc2 together (or none of them)
            act = cast(Callable[[Tensor], Tensor], p.act)
            hid = ops.act(ops.linear(u, p.fc1_weight, p.fc1_bias), act)
            o = ops.add(o, ops.linear(hid, cast(Tensor, p.fc2_weight), p.fc2_bias))
        return ops.pool(o, 0, 0), probs

    def run(self, x: Tensor, start: int = 0, stop: int | None = None,
            keep: Tensor | None = None, *, ops: Ops | None = None) -> Tensor:
        """Run blocks ``start..stop-1`` on token states ``x`` (and the head if ``stop == L``).

        Args:
            x (Tensor): token states ``x_start`` of shape [B, N, D].
            start (int): first block to run.
            stop (int, optional): one past the last block; ``None`` = L, which also
                applies the final norm and head and returns logits.
            keep (Tensor, optional): patch indices [B, n] (or a bool mask [B, P] with the
                same count per row) of the patch tokens to keep; prefix tokens are always
                kept. This is true token removal (SkipPLUS, Mehri et al., CVPRW 2024,
                §4.1).
            ops (Ops, optional): primitive operations (default: plain forward).

        Returns:
            Logits [B, classes] when ``stop == L``, else the token states ``x_stop``.
        """
        L = self.num_blocks
        stop = L if stop is None else stop
        if not 0 <= start <= stop <= L:
            raise ValueError(f"need 0 <= start <= stop <= {L}, got start={start}, stop={stop}")
        self.refresh()
        ops = ops or Ops()
        if keep is not None:
            x, positions = self.select_tokens(x, keep, with_positions=True)
            if ops.positions is None:  # the kept tokens keep their own positions
                ops = copy.copy(ops)
                ops.positions = positions
        # the logits read the prefix rows only (class-token readouts): the last block's
        # output is computed for those rows (plain-tensor forwards; rule sets keep all rows)
        plain = (type(ops) is Ops or isinstance(ops, FusedOps)) and not ops.linearize
        rows = self.readout_row_count if stop == L and plain else None
        for l in range(start, stop):
            x = self.block(x, l, ops, rows=rows if l == L - 1 else None)
        return self.logits(x, ops) if stop == L else x

    def check_token_removal(self) -> None:
        """Refuse true token removal on a model with windowed attention (the window
        partition needs every token of its grid) and under a target that reads token rows:
        removing tokens changes the rows it reads (:mod:`captum_vit.targets`).

        Raises:
            ValueError: naming the model or the target and the pixel removal that serves
                it.
        """
        if any(p.window is not None for p in self.blocks):
            raise ValueError(
                f"{type(self.model).__name__} attends within windows of a fixed token grid, "
                "and true token removal (TIS's token subsets, the metrics' removal='token') "
                "breaks the window partition: remove pixels instead (the metrics: "
                "removal='mean', 'black' or 'blur'; instead of TIS: RISE or ViT-CX, which "
                "mask pixels)")
        target = self.score_target
        if target is not None and (target.reads_tokens or target.blocks is not None):
            raise ValueError(
                f"{type(target).__name__} reads token rows, and true token removal changes "
                "the rows it reads: remove pixels instead (the metrics: removal='mean', "
                "'black' or 'blur'; TIS: use RISE or ViT-CX, which mask pixels)")

    def select_tokens(self, x: Tensor, keep: Tensor, *, with_positions: bool = False
                      ) -> Tensor | tuple[Tensor, Tensor]:
        """Prefix tokens plus the kept patch tokens of ``x`` [B, N, D] (and, with
        ``with_positions``, their original token indices [B, n])."""
        self.check_token_removal()
        k = self.num_prefix
        b, n, d = x.shape
        if keep.dtype == torch.bool:
            if keep.shape != (b, n - k):
                raise ValueError(f"keep mask must have shape {(b, n - k)}, got {tuple(keep.shape)}")
            counts = keep.sum(1)
            if (counts != counts[0]).any():
                raise ValueError("keep mask must keep the same number of patches in every row")
            keep = keep.nonzero()[:, 1].reshape(b, -1)
        if keep.dim() != 2 or keep.shape[0] != b:
            raise ValueError(f"keep must be [B, n] patch indices with B={b}, "
                             f"got {tuple(keep.shape)}")
        keep = keep.to(x.device)
        patches = torch.gather(x[:, k:], 1, keep[..., None].expand(-1, -1, d))
        out = torch.cat([x[:, :k], patches], dim=1)
        if not with_positions:
            return out
        prefix = torch.arange(k, device=x.device).expand(b, k)
        return out, torch.cat([prefix, k + keep], dim=1)

    def trace(self, inputs: Tensor | None = None, *, x: Tensor | None = None,
              options: TraceOptions | None = None, **kwargs: Any) -> Trace:
        r"""One forward pass recording every block (:class:`BlockRecord`).

        With ``grad`` the blocks and the head run on detached views of the model's
        parameters: gradients reach the token states and every recorded tensor (the
        embedding keeps its own graph, so the inputs can require grad), never the
        parameters, and autograd keeps no activation alive for a weight gradient.

        Args:
            inputs (Tensor, optional): images [B, C, H, W]; embedded first.
            x (Tensor, optional): token states of block ``options.start`` instead of
                images.
            options (TraceOptions, optional): how the pass runs
                (:class:`~captum_vit.adapters.trace.TraceOptions`); default the plain
                explicit forward.
            **kwargs: fields of :class:`~captum_vit.adapters.trace.TraceOptions`
                (``start``, ``linearize``, ``grad``, ``cut_blocks``, ``ops``,
                ``attention``, ``on_block``, ``logits``, ``last_rows``), replacing those
                of ``options``.

        Returns:
            :class:`Trace`.

        Raises:
            ValueError: options that do not go together (see
                :class:`~captum_vit.adapters.trace.TraceOptions`).

        Examples::

            >>> means = []   # head-mean attention per block, [B, N, N] each
            >>> tr = adapter.trace(images, on_block=lambda l, rec: means.append(
            ...     rec.attn.mean(1)))
            >>> tr = adapter.trace(images, options=TraceOptions(grad=True))
        """
        if options is None:
            options = TraceOptions(**kwargs)
        elif kwargs:
            options = dataclasses.replace(options, **kwargs)
        self.refresh()
        with self.state.override(frozen=options.grad):
            return self._trace(inputs, x, options)

    def _trace(self, inputs: Tensor | None, x: Tensor | None, o: TraceOptions) -> Trace:
        ops = HeadsOps(o.linearize) if o.attention == "fused" else o.ops
        start, grad = o.start, o.grad
        with torch.set_grad_enabled(grad):
            if x is None:
                assert inputs is not None
                layout = self.target_layout(self.layout(inputs))
                x = self.embed(inputs)
            else:
                layout = self.target_layout(self._layout_of_tokens(x, inputs))
            if grad and not x.requires_grad:
                x = x.detach().requires_grad_()
            tr = Trace(layout=layout, x0=x, start=start)
            ops = Ops(linearize=o.linearize) if ops is None else ops
            h = x
            for l in range(start, self.num_blocks):
                if o.cut_blocks and l > start:
                    h = h.detach().requires_grad_(grad)
                records = tr.blocks if o.on_block is None else []
                last = l == self.num_blocks - 1
                h = self.block(h, l, ops, records, attention_only=not o.logits and last,
                               rows=o.last_rows if last else None)
                if o.on_block is not None:
                    o.on_block(l, records.pop())
            if o.logits:
                tr.logits = self.logits(h, ops, tr)
            tr.final_tokens = self.final_tokens  # windows: the readout's grid
        return tr

    def target_layout(self, layout: Layout) -> Layout:
        """``layout`` under the target in force: a target reading token rows through
        code of its own reads out ``"rows"`` (:mod:`captum_vit.targets`)."""
        target = self.score_target
        if target is None or not (target.reads_tokens or target.blocks is not None):
            return layout
        rows = None if target.rows is None else tuple(int(r) for r in target.rows)
        if rows is not None and (not rows or not all(0 <= r < layout.num_tokens for r in rows)):
            raise ValueError(f"{type(target).__name__}.rows must be token rows in [0, "
                             f"{layout.num_tokens}), got {list(target.rows or ())}")
        return dataclasses.replace(layout, readout="rows", rows=rows)

    def _layout_of_tokens(self, x: Tensor, inputs: Tensor | None) -> Layout:
        if inputs is not None:
            return self.layout(inputs)
        return Layout.of_tokens(x.shape[1], self.num_prefix, self.readout, self.num_blocks,
                                self.blocks[0].num_heads)

    # -- safety ---------------------------------------------------------------------------
    def self_check(self, inputs: Tensor) -> None:
        """Compare the canonical forward with ``model(inputs)`` once per model and
        dtype/device/input size (remembered by the adapter's :class:`AdapterState`, so
        by every view of the model, and kept by :func:`captum_vit.adapters.adapt`'s one
        adapter per model)."""
        key = (type(self), inputs.dtype, inputs.device, tuple(inputs.shape[1:]))
        checked = self.state.checked
        if key in checked:
            return
        # full precision even under an enclosing autocast (--autocast bf16 builds the
        # randomisation metric's model copies inside it)
        with torch.no_grad(), torch.autocast(inputs.device.type, enabled=False):
            ref = self.model_logits(inputs[:2])
            ours = self.run(self.embed(inputs[:2]))
        if not isinstance(ref, Tensor) or ref.shape != ours.shape:
            raise TypeError(
                f"{type(self.model).__name__} returned {type(ref).__name__} of an unexpected "
                "shape; captum_vit needs a classifier returning logits [B, classes]"
            )
        tol = {torch.float64: 1e-9, torch.float32: 1e-4}.get(inputs.dtype, 1e-2)
        err = (ref - ours).abs().max().item()
        scale = ref.abs().max().item() + 1.0
        if not err <= tol * scale:
            raise TypeError(
                f"captum_vit's {type(self).__name__} does not reproduce this "
                f"{type(self.model).__name__} (max logit difference {err:.3g}): the model "
                "has a component the adapter does not know (custom block, attention or "
                "head). Supported: standard pre-LN ViT blocks as in timm's VisionTransformer."
            )
        checked.add(key)


def _unmerge(values: Tensor, merge: Any, split: bool, weights: Tensor | None = None
             ) -> Tensor:
    """Values ``[..., N']`` of a merged grid on the grid before the merge: each merged
    token's value copied to its real children (``split``: shared equally among them;
    ``weights`` [B, N', 4]: shared by them, per child)."""
    child = merge.children(values.device)  # [N', 4]
    if values.shape[-1] != child.shape[0]:
        raise ValueError(f"values of {values.shape[-1]} tokens are not on the "
                         f"{merge.out_grid[0]}x{merge.out_grid[1]} grid after a merge")
    real = child >= 0
    v = values.unsqueeze(-1).expand(*values.shape, 4)
    if weights is not None:
        v = v * weights.to(values.dtype)
    elif split:
        v = v / real.sum(-1).to(values.dtype)[:, None]
    out = values.new_zeros(*values.shape[:-1], merge.grid[0] * merge.grid[1])
    out[..., child[real]] = v[..., real]
    return out


def _value_shape(x: Any) -> torch.Size:
    """The shape of a forward value (a tensor, or a rule set's value with ``real``)."""
    return x.shape if isinstance(x, Tensor) else x.real.shape
