"""Engines shared by several methods and by the combinators (below every method file).

- :func:`layer_gradients`: one forward and ONE backward give ``d s_c / d x_l`` at every
  block input, hence token Input x Gradient (CAT), AttIxG (the AttCAT term of Qiang et
  al., NeurIPS 2022) and DecompX's gradient route at every block (:func:`per_layer_fast`);
  :func:`layer_gradients_each`: the same for several columns from one forward.
- :class:`PLUSFastPath`: the protocol a method implements to give PLUS / SkipPLUS
  (Mehri et al., CVPRW 2024) every start block's map from one pass, with the default
  ``_token_maps`` (the map of the whole model is the start block 0 of the fast path).
- :class:`GradientRoute`: a fast path whose every start block's map is one term of
  :func:`layer_gradients` (token IxG, AttIxG, DecompX): PLUS / SkipPLUS over the method's
  registered name take :func:`per_layer_fast` of its :attr:`~GradientRoute.gradient_kind`.
- :func:`block_gradients`: the inputs (or first LayerNorm outputs) of some blocks and their
  gradients from one backward (the token CAMs, the vanilla and attention gradients).
- :func:`skip_start`: SkipPLUS's first block.

The role Captum's ``captum._utils.gradient`` plays for its layer methods: the methods only
call these engines.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from captum_vit._base import (
    SCORES,
    accumulation_dtype,
    check_choice,
    check_layer,
    gradients,
    resolve_target,
    target_scores,
)
from captum_vit.adapters import Trace, ViTAdapter


def skip_start(num_blocks: int) -> int:
    """SkipPLUS's first layer ``m = ceil(L/2)`` (Eq. 4; the authors' code uses ``L // 2``,
    which is the same for even ``L`` and one block earlier for odd ``L``).

    Args:
        num_blocks (int): the number of blocks ``L``.

    Returns:
        int: the first summed block.

    Examples::

        >>> from captum_vit.combinators import skip_start
        >>> skip_start(12), skip_start(7)
        (6, 4)
    """
    return math.ceil(num_blocks / 2)


@dataclass
class LayerGradients:
    """A traced forward pass with ``d s_c / d x_l`` for every residual state.

    Attributes:
        trace (Trace): the forward pass (``trace.states`` are ``x_0 .. x_L``).
        target (Tensor): the resolved target class per image [B].
        grads (list[Tensor]): gradients of the score w.r.t. ``x_0 .. x_L``.
    """

    trace: Trace
    target: Tensor
    grads: list[Tensor]
    adapter: ViTAdapter | None = None
    """The model's adapter: per-block maps of a model with stages (Swin) are carried to
    the first stage's grid (:meth:`~captum_vit.adapters.Stages.carry`)."""

    def _stack(self, maps: list[Tensor]) -> Tensor:
        """Per-state relevance maps stacked, each on the maps' grid (shared among a merged
        token's children: the sums are kept)."""
        st = None if self.adapter is None else self.adapter.stages
        if st is not None and st.hierarchical:
            start = self.trace.start
            maps = [st.carry(m, start + l, split=True) for l, m in enumerate(maps)]
        return torch.stack(maps)

    def ixg(self) -> Tensor:
        """Token IxG ``sum_d x_l * grad_l`` for ``l = 0 .. L``, shape [L+1, B, N]."""
        states = self.trace.states
        dt = accumulation_dtype(states[0])
        with torch.no_grad():
            return self._stack([(x.detach().to(dt) * g.to(dt)).sum(-1)
                                for x, g in zip(states, self.grads, strict=True)])

    def attention_received(self) -> Tensor:
        """``alpha_l[j] = mean_h mean_i A_l^h[i, j]`` for every block, shape [L, B, N]
        (windowed blocks: :meth:`~captum_vit.adapters.windows.Windows.received`)."""
        dt = accumulation_dtype(self.trace.x0)
        with torch.no_grad():
            out = []
            st = None if self.adapter is None else self.adapter.stages
            for l, rec in enumerate(self.trace.blocks):
                win = None if st is None else st.window(self.trace.start + l)
                attn = rec.require_attn().detach().to(dt)
                out.append(attn.mean(dim=(1, 2)) if st is None or win is None
                           else st.received(attn, self.trace.start + l).mean(1))  # per key
            if st is not None and st.hierarchical:
                out = [st.carry(a, self.trace.start + l) for l, a in enumerate(out)]
            return torch.stack(out)

    def att_ixg(self) -> Tensor:
        """AttIxG ``alpha_l * cat_l`` for every block input, shape [L, B, N]."""
        return self.attention_received() * self.ixg()[:-1]


def layer_gradients(adapter: ViTAdapter, inputs: Tensor, target: Tensor | None, *,
                    score: str = "logit", linearize: bool = False,
                    attention: str = "explicit") -> LayerGradients:
    """One forward and ONE backward giving ``d s_c / d x_l`` at every block input.

    Args:
        adapter (ViTAdapter): the model's adapter.
        inputs (Tensor): validated images [B, C, H, W].
        target (Tensor or None): class per image; ``None`` = predicted class.
        score (str): ``"logit"`` or ``"probability"``.
        linearize (bool): linearised backward (LayerNorm variance, q/k and the GELU gate
            detached; :mod:`captum_vit.methods.decompx`). With it, ``ixg()[l]`` is DecompX
            started at block ``l``.
        attention (str): ``"explicit"`` (default): the trace's records carry the
            attention probabilities (:meth:`LayerGradients.attention_received`);
            ``"fused"``: the fused attention kernel, no ``[B, H, N, N]`` probabilities
            kept for the backward (the same gradients up to rounding; for the maps that
            read only states and gradients, :meth:`LayerGradients.ixg`).

    Returns:
        LayerGradients

    Examples::

        >>> from captum_vit.adapters import adapt
        >>> from captum_vit.methods import layer_gradients
        >>> cat = layer_gradients(adapt(model), images, labels).ixg()  # [L+1, B, N]
    """
    with torch.enable_grad():  # also under Captum's no_grad (NoiseTunnel, sensitivity_max)
        tr = adapter.trace(inputs, linearize=linearize, grad=True, attention=attention)
        t = resolve_target(target, tr.require_logits())
        scores = target_scores(tr.require_logits(), t, score, adapter.probability)
        grads = gradients(scores, tr.states)
    return LayerGradients(tr, t, grads, adapter)


def states_attention(adapter: ViTAdapter, inputs: Tensor) -> str:
    """The trace's attention for a map that reads only token states and their gradients:
    ``"explicit"`` while every block's attention is below the small bound
    (:meth:`~captum_vit.adapters.ViTAdapter.small_attention` with ``inclusive=False``: its
    backward is then faster on the CPU, for little memory), else ``"fused"`` (no
    ``[B, H, N, N]`` probabilities kept for the backward: a VLM tower at 1,024 patches).

    Args:
        adapter (ViTAdapter): the model's adapter.
        inputs (Tensor): the images.

    Returns:
        str: a ``TraceOptions.attention`` value.
    """
    return "explicit" if adapter.small_attention(inputs, inclusive=False) else "fused"


SITES = ("residual", "norm1")
"""Where a CAM reads block ``l``: its input ``x_l`` or its first LayerNorm's output."""

def block_layer(name: str, value: Any, num_blocks: int) -> int:
    """A block index in ``[0, L-1]``; ``None`` = the last block ``L-1`` (the CAMs' default)."""
    return num_blocks - 1 if value is None else check_layer(name, value, num_blocks)


def block_gradients(adapter: ViTAdapter, inputs: Tensor, target: Tensor | None,
                    layers: Sequence[int], *, score: str = "logit", at: str = "residual"
                    ) -> tuple[list[Tensor], list[Tensor], Tensor]:
    """Block inputs ``x_l`` (or their first LayerNorm's outputs ``u_l``) and the gradients
    ``g = d s_c / d x_l`` (``d s_c / d u_l``) of every block in ``layers`` from one forward
    and one backward.

    With ``at="residual"`` the same values as
    :func:`~captum_vit.methods.ixg.layer_gradients` at those blocks; the backward asks for
    them only, so it stops at the lowest one.

    Args:
        adapter (ViTAdapter): the model's adapter.
        inputs (Tensor): validated images [B, C, H, W].
        target (Tensor or None): class per image; ``None`` = predicted class.
        layers (sequence of int): block indices (``L`` = the last block's output, with
            ``at="residual"`` only).
        score (str): ``"logit"`` or ``"probability"``.
        at (str): ``"residual"`` (default): the block input ``x_l``; ``"norm1"``: the
            output ``u_l = LN1(x_l)`` of block ``l``'s first (pre-attention) LayerNorm,
            the adapter's ``BlockParts.norm1`` (timm's ``norm1``, Hugging Face's
            ``layernorm_before``).

    Returns:
        (X per layer [B, N, D] detached, G per layer [B, N, D], resolved target [B]).

    Raises:
        ValueError: ``at="norm1"`` with ``L`` in ``layers`` (no block ``L``).

    Examples::

        >>> from captum_vit.adapters import adapt
        >>> xs, gs, t = block_gradients(adapt(model), images, None, [5, 11], at="norm1")
    """
    check_choice("at", at, SITES)
    if at == "norm1" and any(l >= adapter.num_blocks for l in layers):
        raise ValueError(f"at='norm1' reads a block's first LayerNorm: layers must be below "
                         f"{adapter.num_blocks}; got {list(layers)}")
    with torch.enable_grad():  # also under Captum's no_grad (NoiseTunnel, sensitivity_max)
        # states and gradients only: a large attention fused, keeping no [B, H, N, N]
        tr = adapter.trace(inputs, grad=True, attention=states_attention(adapter, inputs))
        t = resolve_target(target, tr.require_logits())
        if at == "norm1":  # BlockRecord.u = LN1(x_l), in the graph of the score
            xs = [tr.blocks[l - tr.start].u for l in layers]
        else:
            xs = [tr.states[l] for l in layers]
        gs = gradients(target_scores(tr.require_logits(), t, score, adapter.probability), xs)
    return [x.detach() for x in xs], [g.detach() for g in gs], t


def block_gradient(adapter: ViTAdapter, inputs: Tensor, target: Tensor | None, layer: int, *,
                   score: str = "logit", at: str = "residual") -> tuple[Tensor, Tensor, Tensor]:
    """:func:`block_gradients` of one block: ``(X, G, target)``."""
    (x,), (g,), t = block_gradients(adapter, inputs, target, [layer], score=score, at=at)
    return x, g, t


FAST_KINDS = ("ixg", "att_ixg", "decompx", "gradient")
"""Per-layer map kinds of :func:`per_layer_fast`."""


def per_layer_fast(kind: str, adapter: ViTAdapter, inputs: Tensor, target: Tensor | None,
                   score: str = "logit") -> Tensor:
    """Every block's base map ``[L, B, N]`` from one forward and one backward.

    Args:
        kind (str): ``"ixg"`` (``sum_d x_l * grad``), ``"att_ixg"`` (AttCAT term),
            ``"decompx"`` (IxG with the linearised backward,
            :mod:`captum_vit.methods.decompx`) or ``"gradient"`` (``sum_d grad``, i.e.
            Captum's ``Saliency(abs=False)`` summed over channels).
        adapter (ViTAdapter): the model's adapter.
        inputs (Tensor): validated images [B, C, H, W].
        target (Tensor or None): class per image; ``None`` = predicted class.
        score (str): ``"logit"`` or ``"probability"``.

    Returns:
        Tensor: the map at every block input, [L, B, N].

    Examples::

        >>> from captum_vit.adapters import adapt
        >>> from captum_vit.combinators import per_layer_fast
        >>> maps = per_layer_fast("ixg", adapt(model), images, labels)
    """
    lg = layer_gradients(adapter, inputs, target, score=score, linearize=kind == "decompx",
                         attention="explicit" if kind == "att_ixg"
                         else states_attention(adapter, inputs))
    if kind == "att_ixg":
        return lg.att_ixg()
    if kind == "gradient":
        dt = accumulation_dtype(inputs)
        return torch.stack([adapter.stages.carry(g.to(dt).sum(-1), l)
                            for l, g in enumerate(lg.grads[:-1])])
    return lg.ixg()[:-1]


class PLUSFastPath:
    r"""The PLUS / SkipPLUS fast-path protocol (:mod:`captum_vit.combinators`).

    A method class that lists this class FIRST among its bases implements
    :meth:`plus_maps`: the maps :math:`A(f_l)(x_l)` of every start block ``l`` of
    ``layers`` from ONE trace / backward, equal to building the method on every
    sub-network. It inherits the default ``_token_maps``: the map of the whole model is
    the map of the sub-network :math:`f_0`, ``plus_maps(inputs, target, [0], **options)[0]``,
    where ``options`` are the keywords its ``attribute`` passes on. The combinators find
    the fast path by this type: a class that defines ``plus_maps`` without deriving from
    this class is run on every sub-network.

    Attributes:
        plus_aggregates (tuple of str): the ``aggregate`` values :meth:`plus_maps`
            accepts: ``"subnetwork"`` (the method on every sub-network) and, for a method
            with per-block matrices :math:`F_l`, ``"layer"`` (the readout rows
            :math:`w F_l` without identity).
        layer_local (bool): whether the method acts at the LAST block of its model (raw
            attention, attention Grad-CAM, token CAMs, one IxG term); PLUS then builds
            it on a one-block window when it runs without fast path.

    Examples::

        >>> from captum_vit._base import ViTGradientAttribution
        >>> from captum_vit.methods import PLUSFastPath
        >>> class MyMethod(PLUSFastPath, ViTGradientAttribution):
        ...     plus_aggregates = ("subnetwork",)
        ...     def plus_maps(self, inputs, target, layers, *, aggregate="subnetwork"):
        ...         ...  # [len(layers), B, N] from one pass
    """

    plus_aggregates: tuple[str, ...] = ("subnetwork",)
    layer_local: bool = False

    def plus_maps(self, inputs: Tensor, target: Tensor | None, layers: Sequence[int], *,
                  aggregate: str = "subnetwork", **options: Any) -> Tensor:
        """The map of every sub-network :math:`f_l`, ``l`` in ``layers``.

        Args:
            inputs (Tensor): validated images [B, C, H, W].
            target (Tensor or None): class per image [B]; ``None`` = predicted.
            layers (sequence of int): sorted distinct start blocks.
            aggregate (str): a value of :attr:`plus_aggregates`.
            **options: the keyword options of the method's ``attribute`` (``output``
                excluded), with the method's own defaults.

        Returns:
            Tensor: token maps [len(layers), B, N] with the prefix columns.
        """
        raise NotImplementedError(f"{type(self).__name__} implements no plus_maps")

    def _token_maps(self, inputs: Tensor, target: Tensor | None, **options: Any) -> Tensor:
        return self.plus_maps(inputs, target, [0], **options)[0]

    def check_plus_options(self, aggregate: str, score: str = "logit") -> None:
        """Check the options a :meth:`plus_maps` reads first: ``aggregate``, a value of
        :attr:`plus_aggregates`, and ``score``, a value of
        :data:`~captum_vit._base.SCORES` (``ValueError`` naming the argument otherwise).

        Args:
            aggregate (str): the ``aggregate`` given to :meth:`plus_maps`.
            score (str, optional): the ``score`` given to :meth:`plus_maps`.
        """
        check_choice("aggregate", aggregate, self.plus_aggregates)
        check_choice("score", score, SCORES)


class GradientRoute(PLUSFastPath):
    """A :class:`PLUSFastPath` on the gradient route: the map of every sub-network
    :math:`f_l` is one per-block term of :func:`layer_gradients` (one forward and ONE
    backward give every block), the term :attr:`gradient_kind` names.

    PLUS / SkipPLUS over the method's registered name in its default configuration
    (``"token_ixg"``, ``"att_ixg"``, ``"decompx"``) compute it with
    :func:`per_layer_fast` ``(gradient_kind, ...)`` on the whole model; a method class or
    factory given as base takes :meth:`~PLUSFastPath.plus_maps`. The combinators find the
    route by this type (no table of names).

    Attributes:
        gradient_kind (str): the kind of :func:`per_layer_fast`: ``"ixg"``,
            ``"att_ixg"`` or ``"decompx"``.

    Examples::

        >>> from captum_vit import DecompX, TokenIxG
        >>> from captum_vit.methods import GradientRoute
        >>> TokenIxG.gradient_kind, issubclass(DecompX, GradientRoute)
        ('ixg', True)
    """

    gradient_kind: ClassVar[str]


def layer_gradients_each(adapter: ViTAdapter, inputs: Tensor, targets: Sequence[Tensor], *,
                         linearize: bool = False, **trace_options: Any
                         ) -> list[LayerGradients]:
    """:func:`layer_gradients` of several logit columns from ONE trace: one backward per
    column (the trace's graph kept between them), each equal to
    ``layer_gradients(adapter, inputs, t, linearize=linearize)`` (``score="logit"``). The
    answer tokens of :func:`~captum_vit.targets.vlm.per_token_maps`
    (``ViTFront._token_maps_each``).

    Args:
        adapter (ViTAdapter): the model's adapter.
        inputs (Tensor): validated images [B, C, H, W].
        targets (sequence of Tensor): the column of every image [B], one per backward.
        linearize (bool): linearised backward, as :func:`layer_gradients`.
        **trace_options: further options of the adapter's ``trace`` (``attention``).

    Returns:
        list[LayerGradients]: one per column of ``targets``, sharing the trace.

    Examples::

        >>> from captum_vit.adapters import adapt
        >>> first, second = layer_gradients_each(adapt(model), images, [t0, t1])
    """
    out: list[LayerGradients] = []
    with torch.enable_grad():  # also under Captum's no_grad
        tr = adapter.trace(inputs, linearize=linearize, grad=True, **trace_options)
        logits = tr.require_logits()
        for k, target in enumerate(targets):
            t = resolve_target(target, logits)
            grads = gradients(target_scores(logits, t), tr.states,
                              retain_graph=k < len(targets) - 1)
            out.append(LayerGradients(tr, t, grads, adapter))
    return out
