"""Quantus interoperability: an ``explain_func`` for any method, and batches to evaluate.

`Quantus <https://github.com/understandable-machine-intelligence-lab/Quantus>`_ metrics
take ``x_batch, y_batch, a_batch, s_batch`` as numpy arrays and, for metrics that
explain again (robustness, randomisation), a function
``explain_func(model, inputs, targets, **kwargs) -> a_batch``.
:func:`quantus_explain_func` turns any captum_vit method into one and
:func:`export_quantus` writes the four arrays, so a Quantus metric runs in one line::

    >>> import quantus
    >>> from captum_vit.interop import export_quantus, quantus_explain_func
    >>> batch = export_quantus(model, x, "gae", masks=masks)
    >>> quantus.PointingGame()(model, **batch)
    >>> quantus.MaxSensitivity(nr_samples=10, lower_bound=0.02)(
    ...     model, **batch, explain_func=quantus_explain_func("gae"))

Nothing here imports Quantus (``pip install captum_vit[quantus]`` installs it).

**Shapes.** ``a_batch`` is ``[B, 1, H, W]`` like ``x_batch`` with one channel (what
``quantus.explain`` returns for Captum methods): a captum_vit method's patch scores are
copied to their pixels (``mode="nearest"``, the exact map) or upsampled bilinearly
(``mode="bilinear"``); any other Captum attribution's pixel map is summed over the
channels (Quantus's default ``reduce_axes=(1,)``). ``s_batch`` is ``[B, 1, H, W]``
(bool).

**Agreement with captum_vit's metrics** (tested in ``tests/metrics/test_quantus_interop.py``):

* ``quantus.MaxSensitivity`` equals :func:`captum_vit.metrics.robustness.max_sensitivity`
  (to rounding, in float64) when it draws the same noise: ``nr_samples=n_samples``,
  ``lower_bound=radius`` and a ``perturb_func`` replaying captum_vit's per-example
  uniform noise, with ``mode="nearest"`` (a patch-constant map has the same
  Frobenius-norm ratio as its patch scores) and the clean prediction as ``y_batch``.
  Their defaults differ: Quantus draws 200 samples of radius 0.2 from numpy's global
  generator, captum_vit 10 of radius 0.02 (TIS, Englebert et al., ICCV-W 2023, Table 4)
  seeded per example.
* ``quantus.PointingGame`` on a patch-constant map hits when any pixel of the top patch
  lies in the mask; captum_vit's :func:`~captum_vit.metrics.localization.pointing_game`
  when the **centre** of the top patch does. They are equal example by example when the
  top patch is unique and Quantus gets the mask of the patches whose centre lies in the
  region (:func:`captum_vit.metrics.localization.patch_centres_in`); with the raw mask
  Quantus's hit is never below captum_vit's (``tolerance=0``). captum_vit also skips
  regions covering ``>= max_region`` of the image (NaN) and averages over tied top
  patches; Quantus scores every example, counts a hit on any tied pixel, and (0.6.0)
  scores an empty mask as a hit (the NaN it assigns becomes True in its boolean array).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeAlias, cast

import numpy as np
import torch
from captum.attr import Attribution
from torch import Tensor, nn

from captum_vit._base import (
    ViTFront,
    check_choice,
    check_scalar,
    check_target,
    input_type_hint,
)
from captum_vit._text import count_noun
from captum_vit.adapters import Layout, adapt
from captum_vit.metrics.localization import check_masks, upsample

MODES = ("nearest", "bilinear")
QUANTUS_KEYWORDS = ("device", "method")
"""Keywords Quantus adds to an ``explain_func`` call that are not the method's:
``device`` (every metric, from its ``device=`` argument; the model's own device is used)
and ``method`` (``quantus.evaluate``: the key of ``xai_methods``)."""

MethodLike: TypeAlias = str | type | Attribution | Callable[[nn.Module], Attribution]


def _builder(method: MethodLike, seed: int) -> Callable[[nn.Module], Attribution]:
    """``model -> Attribution`` for a registry name, an Attribution class, a factory or an
    instance (which only explains the model it was built for)."""
    from captum_vit.registry import method_factory

    if isinstance(method, str):
        return method_factory(method, seed=seed)
    if isinstance(method, type):
        if not issubclass(method, Attribution):
            raise TypeError(f"method class must be a Captum Attribution, got {method.__name__}")
        return method
    if isinstance(method, Attribution):
        own = getattr(method, "model", None)
        own = method.forward_func if own is None else own

        def same(model: nn.Module) -> Attribution:
            if model is not own:
                raise TypeError(
                    f"this {type(method).__name__} instance explains another model than the "
                    "one passed (Quantus's randomisation metrics pass a modified copy); "
                    "pass the method's registry name, its class or a factory model -> "
                    "Attribution so it is rebuilt for each model")
            return method

        return same
    if callable(method):
        return method
    raise TypeError("method must be a registry name (e.g. 'gae'), a Captum Attribution class "
                    f"or instance, or a factory model -> Attribution; got {type(method).__name__}")


def _as_images(inputs: Any, model: nn.Module) -> Tensor:
    """Quantus's numpy (or tensor) images as a tensor on the model's device and dtype."""
    if isinstance(inputs, np.ndarray):
        inputs = torch.from_numpy(np.ascontiguousarray(inputs))
    if not isinstance(inputs, Tensor):
        raise TypeError("inputs must be a floating-point numpy array or tensor [B, C, H, W], "
                        f"got {type(inputs).__name__}: {input_type_hint(inputs)}")
    if not torch.is_floating_point(inputs):
        raise TypeError("inputs must be a floating-point numpy array or tensor [B, C, H, W], "
                        f"got {inputs.dtype} (convert with .float())")
    param = next(model.parameters())
    return inputs.to(device=param.device, dtype=param.dtype)


def _as_targets(targets: Any, device: torch.device) -> Any:
    """Quantus's ``y_batch`` (numpy, list, tensor or int) as a target every Captum
    attribution takes: an int stays, anything else becomes an int64 tensor on ``device``
    when its values are whole numbers (Quantus stores labels as floats at times)."""
    if targets is None or isinstance(targets, int | np.integer):
        return targets
    t = targets if isinstance(targets, Tensor) else torch.as_tensor(np.asarray(targets))
    if t.is_floating_point() and torch.equal(t, t.round()):
        t = t.long()
    return t.to(device)


def quantus_maps(maps: Tensor, inputs: Tensor, layout: Layout, mode: str = "nearest"
                 ) -> np.ndarray:
    """Maps of any captum_vit shape as Quantus's ``a_batch`` ``[B, 1, H, W]`` (numpy).

    Args:
        maps (Tensor): patch scores ``[B, P]`` or a grid ``[B, gh, gw]`` /
            ``[B, 1, gh, gw]`` (copied to their pixels or upsampled bilinearly, see
            ``mode``), or a pixel map ``[B, H, W]`` / ``[B, C, H, W]`` (summed over the
            channels).
        inputs (Tensor): the images ``[B, C, H, W]`` the maps explain.
        layout (Layout): the model's token layout for ``inputs``.
        mode (str, optional): ``"nearest"`` or ``"bilinear"`` for patch maps. Default
            ``"nearest"``.

    Returns:
        np.ndarray: ``[B, 1, H, W]`` in the maps' dtype.

    Raises:
        ValueError: maps of another shape, or an unknown ``mode``.

    Examples::

        >>> from captum_vit.adapters import adapt
        >>> a = quantus_maps(GAE(model).attribute(x, output="tokens"), x, adapt(model).layout(x))
        >>> a.shape == (x.shape[0], 1, *x.shape[-2:])
        True
    """
    check_choice("mode", mode, MODES)
    maps = maps.detach()
    b, _, h, w = inputs.shape
    (gh, gw), p = layout.grid, layout.num_patches
    shape = tuple(maps.shape)
    if shape[:1] != (b,):
        raise ValueError(f"maps have shape {shape} but the batch has "
                         f"{count_noun(b, 'image')}")
    if (maps.dim() == 2 and shape[1] == p) or shape[1:] in ((gh, gw), (1, gh, gw)):
        dtype = maps.dtype
        pix = upsample(maps.reshape(b, p), layout.grid, layout.patch_size, (h, w), mode)
        maps = pix.to(dtype)[:, None]
    elif maps.dim() == 3 and shape[1:] == (h, w):
        maps = maps[:, None]
    elif maps.dim() == 4 and shape[2:] == (h, w):
        maps = maps.sum(1, keepdim=True)
    else:
        raise ValueError(f"maps have shape {shape}; expected patch scores [B, {p}], a grid "
                         f"[B, {gh}, {gw}] or pixels [B, (C,) {h}, {w}]")
    return maps.cpu().numpy()


def quantus_explain_func(method: MethodLike, *, mode: str = "nearest", seed: int = 0,
                         **attribute_kwargs: Any) -> Callable[..., np.ndarray]:
    r"""A Quantus ``explain_func(model, inputs, targets, **kwargs)`` for ``method``.

    Each call builds the method for the model Quantus passes (building is cheap and reads
    the model's current parameters, so the modified copies of Quantus's randomisation
    metrics are explained as they are; nothing is cached across calls), converts the
    numpy (or tensor) images to the model's device and dtype, explains ``targets`` and
    returns ``a_batch`` ``[B, 1, H, W]`` as numpy (see :func:`quantus_maps`). The
    keywords of :data:`QUANTUS_KEYWORDS` (``device=``, ``method=``) are ignored; any
    other keyword is passed to ``attribute`` (overriding ``attribute_kwargs``).

    Args:
        method (str, type, Attribution or Callable): a registry name (``"gae"``,
            ``"skipplus:decompx"``, ``"captum:Saliency"``), an Attribution class
            (``GAE``), a factory ``model -> Attribution``, or an instance (explains only
            its own model, so not for randomisation metrics).
        mode (str, optional): how patch scores become pixels, ``"nearest"`` (the exact
            patch-constant map) or ``"bilinear"``. Default ``"nearest"``.
        seed (int, optional): seed of seeded methods (registry names). Default 0.
        **attribute_kwargs: keyword arguments of ``attribute`` (e.g. ``n_masks=128``).

    Returns:
        Callable: ``explain_func(model, inputs, targets, **kwargs) -> np.ndarray``.

    Raises:
        ValueError: an unknown method name or ``mode``.
        TypeError: a ``method`` of another kind.

    Examples::

        >>> import quantus
        >>> from captum_vit.interop import quantus_explain_func
        >>> explain = quantus_explain_func("gae")
        >>> a_batch = explain(model, x_batch, y_batch, device="cpu")   # [B, 1, H, W]
        >>> quantus.MaxSensitivity(nr_samples=10, lower_bound=0.02)(
        ...     model, x_batch, y_batch, explain_func=explain)
    """
    check_choice("mode", mode, MODES)
    seed = check_scalar(seed, "seed", int)
    build = _builder(method, seed)

    def explain_func(model: nn.Module, inputs: Any, targets: Any, **kwargs: Any) -> np.ndarray:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        kw = {**attribute_kwargs,
              **{k: v for k, v in kwargs.items() if k not in QUANTUS_KEYWORDS}}
        x = _as_images(inputs, model)
        attribution = build(model)
        if isinstance(attribution, ViTFront):
            kw.setdefault("output", "tokens")
        maps = attribution.attribute(x, target=_as_targets(targets, x.device), **kw)
        if isinstance(maps, tuple) and len(maps) == 1:
            maps = maps[0]
        return quantus_maps(maps, x, adapt(model).layout(x), mode)

    explain_func.__name__ = f"quantus_explain_{getattr(build, '__name__', 'method')}"
    return explain_func


def export_quantus(model: nn.Module, inputs: Any, method: MethodLike | Tensor, *,
                   target: Any = None, masks: Tensor | None = None, mode: str = "nearest",
                   seed: int = 0, batch_size: int = 64, path: str | os.PathLike | None = None,
                   **attribute_kwargs: Any) -> dict[str, np.ndarray | None]:
    r"""``x_batch, y_batch, a_batch, s_batch`` for Quantus, optionally saved as ``.npz``.

    The maps are computed with :func:`quantus_explain_func` in chunks of ``batch_size``
    images (or taken from precomputed ``method`` maps), so ``metric(model, **batch)``
    evaluates exactly what captum_vit explained.

    Args:
        model (nn.Module): a supported ViT classifier (on its device and dtype).
        inputs (Tensor or np.ndarray): preprocessed images ``[N, C, H, W]`` (e.g. from
            :func:`captum_vit.data.specs.model_batch`).
        method: as in :func:`quantus_explain_func`, or precomputed maps ``[N, ...]`` in
            any shape :func:`quantus_maps` takes.
        target (optional): classes to explain (int, list, array or tensor); ``None``
            (default) explains the model's prediction.
        masks (Tensor, optional): ground-truth regions ``[N, H, W]`` (or ``[N, 1, H, W]``)
            for ``s_batch``. Default ``None`` (``s_batch`` is ``None``).
        mode (str, optional): ``"nearest"`` or ``"bilinear"`` (see :func:`quantus_maps`).
        seed (int, optional): seed of seeded methods. Default 0.
        batch_size (int, optional): images per explanation call. Default 64.
        path (str or PathLike, optional): also save the arrays (all but a ``None``
            ``s_batch``) with ``numpy.savez_compressed`` there.
        **attribute_kwargs: keyword arguments of ``attribute``.

    Returns:
        dict[str, np.ndarray or None]: ``x_batch`` ``[N, C, H, W]`` (the model's dtype),
        ``y_batch`` ``[N]`` (int64), ``a_batch`` ``[N, 1, H, W]``, ``s_batch``
        ``[N, 1, H, W]`` (bool) or ``None``.

    Raises:
        ValueError: masks or maps of the wrong shape, a non-positive ``batch_size``.
        TypeError: images that are not floating point, a ``method`` of another kind.

    Examples::

        >>> import quantus
        >>> from captum_vit.data.specs import load_data, model_batch
        >>> from captum_vit.interop import export_quantus
        >>> from captum_vit.models import load_model
        >>> lm = load_model("zoo:vit_fmnist_loc")                  # the bundled model
        >>> data = load_data("synthetic", n=16, input_shape=lm.input_shape,
        ...                  num_classes=len(lm.class_names))
        >>> x, _, masks = model_batch(data, range(16), input_shape=lm.input_shape,
        ...                           preprocess=lm.preprocess)
        >>> batch = export_quantus(lm.model, x, "gae", masks=masks, path="gae.npz")
        >>> scores = quantus.PointingGame(disable_warnings=True)(lm.model, **batch)
    """
    from captum_vit.metrics.removal import prepare_metric

    check_scalar(batch_size, "batch_size", int, min_val=1)
    check_choice("mode", mode, MODES)
    x = _as_images(inputs, model)
    n = x.shape[0]
    t = check_target(_as_targets(target, x.device), n, adapt(model).num_classes)
    s = None if masks is None else check_masks(masks, x)[:, None].cpu().numpy()
    if isinstance(method, Tensor) and method.shape[:1] != (n,):
        raise ValueError(f"method maps have shape {tuple(method.shape)} but inputs has "
                         f"{count_noun(n, 'image')}; give one map per image")
    explain = None if isinstance(method, Tensor) else quantus_explain_func(
        method, mode=mode, seed=seed, **attribute_kwargs)
    ys, maps = [], []
    for i in range(0, n, batch_size):
        chunk = slice(i, i + batch_size)
        _, p = prepare_metric(model, x[chunk], None if t is None else t[chunk])
        ys.append(cast(Tensor, p.target).cpu())  # prepare_metric resolves the target
        maps.append(explain(model, p.images, ys[-1]) if explain is not None else
                    quantus_maps(cast(Tensor, method)[chunk], p.images, p.layout, mode))
    y, a = torch.cat(ys), np.concatenate(maps)
    out: dict[str, Any] = {"x_batch": x.detach().cpu().numpy(),
                           "y_batch": y.cpu().numpy().astype(np.int64), "a_batch": a,
                           "s_batch": s}
    if path is not None:
        np.savez_compressed(path, **{k: v for k, v in out.items() if v is not None})
    return out


__all__ = ["MODES", "QUANTUS_KEYWORDS", "export_quantus", "quantus_explain_func",
           "quantus_maps"]
