"""What an adapter remembers about its model: the settings in force and the self-check memo.

Per-model settings (target embeddings or a :class:`~captum_vit.adapters.scoring.Target`,
the CLS share of a ``[CLS ; mean]`` readout, the detached parameters of a gradient trace)
live in a context variable owned by the adapter's :class:`AdapterState`, not in a module
global keyed by the model; :func:`captum_vit.adapters.adapt` keeps one adapter per model,
and a view of the model shares its model adapter's state.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

from captum_vit.adapters.scoring import Target, TargetHead


@dataclasses.dataclass(frozen=True)
class AdapterSettings:
    """The per-model settings in force in the current context (:class:`AdapterState`).

    Attributes:
        target (TargetHead, Target or None): target embeddings the outputs are scored
            against, or a :class:`~captum_vit.adapters.scoring.Target` whose columns
            the outputs are (:meth:`~captum_vit.adapters.ViTAdapter.targeting`); ``None``
            = the model's own output.
        alpha (float or str): the ``"cls_mean"`` readout's CLS share ``α``
            (:meth:`~captum_vit.adapters.ViTAdapter.with_cls_alpha`).
        frozen (bool): inside a gradient trace, the blocks and the head run on detached
            views of the model's parameters
            (:meth:`~captum_vit.adapters.ViTAdapter.trace` with ``grad``).
    """

    target: TargetHead | Target | None = None
    alpha: float | str = 0.5
    frozen: bool = False
    hidden: dict[int, Any] | None = None
    """A target reading several blocks: the block outputs ``x_l`` of the current
    forward it reads, filled by :meth:`~captum_vit.adapters.ViTAdapter.block`."""
    grid: tuple[int, int] | None = None
    """The patch grid of the images explained under a target (its :class:`Outputs`)."""
    probability: str = "softmax"
    """How the outputs' scores become probabilities, one of
    :data:`~captum_vit.adapters.scoring.PROBABILITY_KINDS` (the target's, or
    :meth:`~captum_vit.adapters.ViTAdapter.probability_kind`'s)."""


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
        """The (adapter type, dtype, device, input size) keys
        :meth:`~captum_vit.adapters.ViTAdapter.self_check` has passed."""

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
