"""The settings of an evaluation, as one frozen object.

:class:`EvalSettings` travels unchanged from the command line (``captum-vit evaluate``)
through :func:`captum_vit.metrics.suite.evaluate`, :func:`~captum_vit.metrics.suite.
evaluate_batch` and :class:`~captum_vit.metrics.table.MetricBatch` to the removal metrics
and their :class:`~captum_vit.metrics.removal.RemovalEngine`, so every layer reads the
same value under the same name (the frozen-configuration style of scikit-learn's
``set_config`` and of dataclass options in timm). Each argument name has one meaning:

* ``batch_size``: images per batch of the evaluation loop;
* ``forward_batch``: (image, step) jobs per forward pass of the removal engine (default
  ``4 * batch_size``: the value the evaluation loop has always used);
* ``explain``: which class the maps explain, ``"predicted"`` or ``"label"`` (the command
  line's ``--target``); the class itself is a metric's ``target``, the ground truth of an
  accuracy its ``labels``.

Nothing here imports the rest of the package but the validators of
:mod:`captum_vit._base`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from captum_vit._base import check_choice, check_scalar

REMOVALS = ("token", "black", "mean", "blur", "random")
"""Names of the patch removals (``removal=``, ``--removal``): true token removal and the
pixel baselines (:mod:`captum_vit.metrics.removal`)."""

EXPLAINED = ("predicted", "label")
"""Choices of ``explain`` (``--target``): the maps explain the model's prediction or the
data set's label."""

AUTOCAST: dict[str, torch.dtype | None] = {"none": None, "bf16": torch.bfloat16}
"""``autocast=`` / ``--autocast``: name -> the dtype of ``torch.autocast``."""

FORWARD_BATCH_PER_IMAGE = 4
"""``forward_batch`` when not given: this many removal jobs per image of a batch."""

Fill = Callable[[Tensor, Sequence[int]], Tensor]
"""A fill builder: ``fill(images [B, C, H, W], seeds) -> fill images [B, C, H, W]``."""
Removal = str | Fill


@dataclass(frozen=True)
class EvalSettings:
    r"""What an evaluation fixes, in one frozen object (see the module docstring).

    Attributes:
        removal (str or Callable): patch removal: ``"token"`` (true token removal) or a
            pixel baseline of :data:`REMOVALS`, or a fill callable
            ``(images, seeds) -> fill images``. Default ``"token"``.
        n_steps (int): deletion / insertion steps. Default 20.
        batch_size (int): images per batch of the evaluation loop. Default 16.
        forward_batch (int, optional): (image, step) jobs per forward pass of the removal
            engine; ``None``: ``4 * batch_size`` (:attr:`jobs_per_forward`). Default None.
        seed (int): seed of every random choice (baselines, noise, randomisation), mixed
            with each example's index. Default 0.
        explain (str): the class the maps explain, ``"predicted"`` or ``"label"``
            (:data:`EXPLAINED`). Default ``"predicted"``.
        autocast (str): ``"none"`` or ``"bf16"`` (:data:`AUTOCAST`). Default ``"none"``.

    Raises:
        ValueError: an unknown removal, explained class or autocast, or a non-positive
            size.

    Examples::

        >>> from captum_vit.metrics.settings import EvalSettings
        >>> s = EvalSettings(removal="blur", batch_size=8)
        >>> s.jobs_per_forward
        32
        >>> s.replace(explain="label").explain
        'label'
    """

    removal: Removal = "token"
    n_steps: int = 20
    batch_size: int = 16
    forward_batch: int | None = None
    seed: int = 0
    explain: str = "predicted"
    autocast: str = "none"

    def __post_init__(self) -> None:
        if not callable(self.removal):
            check_choice("removal", self.removal, REMOVALS)
        check_scalar(self.n_steps, "n_steps", int, min_val=1)
        check_scalar(self.batch_size, "batch_size", int, min_val=1)
        if self.forward_batch is not None:
            check_scalar(self.forward_batch, "forward_batch", int, min_val=1)
        check_choice("explain", self.explain, EXPLAINED)
        check_choice("autocast", self.autocast, tuple(AUTOCAST))

    @property
    def jobs_per_forward(self) -> int:
        """``forward_batch``, or ``4 * batch_size`` when it is not given."""
        if self.forward_batch is not None:
            return self.forward_batch
        return FORWARD_BATCH_PER_IMAGE * self.batch_size

    def replace(self, **changes: Any) -> EvalSettings:
        """A copy with ``changes`` (``dataclasses.replace``); ``None`` values are ignored,
        so optional keyword arguments can be passed through as they are."""
        given = {k: v for k, v in changes.items() if v is not None}
        return dataclasses.replace(self, **given) if given else self


def forward_batch_of(forward_batch: int | None, legacy: dict[str, Any], where: str
                     ) -> int | None:
    """``forward_batch``, or the deprecated ``batch_size`` popped from ``legacy`` (which
    meant jobs per forward in ``where``, while :class:`EvalSettings`' ``batch_size`` is
    images per batch); warns when the old keyword is used.

    Args:
        forward_batch (int, optional): the new keyword's value.
        legacy (dict): the caller's other keyword arguments (``batch_size`` is removed).
        where (str): the caller's name, for the warning.

    Returns:
        int or None: the jobs per forward asked for (``None``: not given).

    Examples::

        >>> kw = {"batch_size": 32}
        >>> forward_batch_of(None, kw, "deletion")   # DeprecationWarning
        32
    """
    if "batch_size" not in legacy:
        return forward_batch
    size = legacy.pop("batch_size")
    warnings.warn(f"{where}(batch_size=...) is deprecated: it is the removal engine's "
                  "forward_batch (jobs per forward; batch_size means images per batch in "
                  "EvalSettings)", DeprecationWarning, stacklevel=3)
    return size if forward_batch is None else forward_batch


def settings_from(settings: EvalSettings | None, legacy: Mapping[str, Any], *,
                  where: str, **given: Any) -> EvalSettings:
    """``settings`` (default :class:`EvalSettings`) with the keyword arguments ``given``
    (``None`` = not given) and the deprecated ones in ``legacy``: ``target`` (the explained
    class, now ``explain``).

    Args:
        settings (EvalSettings, optional): the caller's settings.
        legacy (Mapping): deprecated keyword arguments the caller received.
        where (str): the function's name, for the messages.
        **given: the caller's keyword arguments that are fields of :class:`EvalSettings`.

    Returns:
        EvalSettings: the settings to use.

    Raises:
        TypeError: an unknown keyword argument.

    Examples::

        >>> settings_from(None, {}, where="evaluate", n_steps=5, seed=None).n_steps
        5
    """
    extra = dict(legacy)
    if "target" in extra:
        warnings.warn(f"{where}(target=...) is deprecated: the explained class is "
                      "explain='predicted' or 'label' (target names a class elsewhere)",
                      DeprecationWarning, stacklevel=3)
        if given.get("explain") is None:
            given["explain"] = extra.pop("target")
        else:
            extra.pop("target")
    if extra:
        raise TypeError(f"{where}() got unexpected keyword argument(s): "
                        f"{', '.join(sorted(extra))}")
    return (settings if settings is not None else EvalSettings()).replace(**given)


__all__ = ["AUTOCAST", "EXPLAINED", "EvalSettings", "FORWARD_BATCH_PER_IMAGE", "Fill",
           "REMOVALS", "Removal", "settings_from"]
