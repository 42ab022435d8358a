"""The readout: how the last state becomes the scores a method explains.

Design. The methods see a trace and a score, never the head: the score is
:meth:`Readout.logits` of the last state, or :meth:`Readout.readout_logits` of any block's
states (final norm, pooling, ``fc_norm``, classifier head(s)), and inside
:meth:`Readout.targeting` the head itself is replaced: scores against target embeddings
(a :class:`~captum_vit.adapters.scoring.TargetHead`) or the columns of a
:class:`~captum_vit.adapters.scoring.Target` reading any block's token rows
(:mod:`captum_vit.targets`). A ``[CLS ; patch mean]`` classifier's CLS share
(:meth:`Readout.with_cls_alpha`) and whether the readout weights depend on the image
(:attr:`Readout.fixed_readout`) are read here too.

:class:`Readout` is a part of :class:`~captum_vit.adapters.ViTAdapter` (a base class of
it): written against the family contract's attributes (``model``, ``blocks``, ``head``,
``num_prefix``, ``readout``) and the settings in force
(:class:`~captum_vit.adapters.state.AdapterState`), with no family code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from captum_vit.adapters.layout import Layout
from captum_vit.adapters.ops import Ops
from captum_vit.adapters.parts import BlockParts, HeadParts, PoolParts, _detached
from captum_vit.adapters.scoring import Outputs, Target, TargetHead, check_probability_kind
from captum_vit.adapters.state import AdapterState
from captum_vit.adapters.trace import Trace


class Readout:
    """The readout and scoring members of :class:`~captum_vit.adapters.ViTAdapter`: the
    head in force, the target in force (:meth:`targeting`), the logits of the last state
    or of any block's states, the CLS share of a ``[CLS ; mean]`` readout.

    A base class of :class:`~captum_vit.adapters.ViTAdapter`, which provides the
    attributes it reads (set by the family, :data:`~captum_vit.adapters.FAMILY_CONTRACT`)
    and the hook :meth:`~captum_vit.adapters.ViTAdapter.output_extras`.
    """

    model: nn.Module
    blocks: list[BlockParts]
    _head_parts: HeadParts
    num_prefix: int
    readout: str
    no_output_reason: str | None
    output_extras: Callable[[Tensor], dict[str, Tensor]]

    @property
    def state(self) -> AdapterState:
        """This adapter's :class:`AdapterState` (settings in force, self-check memo),
        created on first use; a view of the model shares its model adapter's."""
        state = self.__dict__.get("_state")
        if state is None:
            state = self.__dict__.setdefault("_state", AdapterState())
        return state

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
        a head-less model, or the number ``T`` of target embeddings in force.

        Raises:
            TypeError: a model without an output of its own to explain (a detector,
                :attr:`~captum_vit.adapters.ViTAdapter.no_output_reason`) and no
                :class:`~captum_vit.adapters.scoring.Target` in force.
        """
        if self.no_output_reason is not None and self.score_target is None:
            raise TypeError(self.no_output_reason)
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


def _value_shape(x: Any) -> torch.Size:
    """The shape of a forward value (a tensor, or a rule set's value with ``real``)."""
    return x.shape if isinstance(x, Tensor) else x.real.shape
