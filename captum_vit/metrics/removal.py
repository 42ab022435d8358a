"""The removal engine of the faithfulness metrics: a model on images with patches removed.

Removal always works on the model's patch grid:

* ``removal="token"`` (default, true token masking, SkipPLUS §4.1): a removed patch's
  token is dropped from the sequence right after the positional embedding
  (``adapter.embed`` then ``adapter.run(x0, keep=...)``); prefix tokens are always kept,
  so no fill value is ever invented. A sequence without patches has no output when the
  model has no prefix tokens or averages the patch rows (``global_pool='avg'``, as BEiT's
  and many EVA-02 classifiers do): its logits are defined as 0 (uniform probabilities).
* pixel baselines: the removed patches' pixels are replaced by ``"black"`` (0 in the
  model's input space), ``"mean"`` (the image's per-channel mean), ``"blur"`` (Gaussian
  blur of the image, kernel 11, σ 5, reflect padding) or ``"random"`` (uniform noise in
  ``[min, max]`` of the image, seeded per example id), and the model runs on the images.

Patch maps from any attribution (:func:`patch_maps`, :func:`ranking`) live in
:mod:`captum_vit.metrics.maps`, the removal names and fills' types in
:mod:`captum_vit.metrics.settings`; both are re-exported here.

Two extensions serve the papers' protocols (:mod:`captum_vit.metrics.protocols`):
``unit="pixel"`` ranks the single pixels of the bilinearly upsampled map instead of the
patches (Chefer et al.'s and TIS's pixel perturbations; needs a pixel baseline), and
``removal`` may be a fill callable ``(images, seeds) -> fill images`` instead of a name
(:func:`image_space_zero`: zero in the ``[0, 1]`` image space before normalisation;
:func:`tis_baseline`: TIS's baselines).

Every (image, step) pair is one job; jobs are evaluated in batched forwards over images
AND steps, at most ``forward_batch`` a forward. With token masking the adapters' one subset
engine (:func:`captum_vit.adapters.subsets.subset_logits`) groups jobs by kept length
with a cost model; a forward mixing lengths pads the shorter sequences and masks the
padding out of attention (as keys) and pooling, which gives the same logits as running
each shortened sequence alone. Steps that remove nothing can reuse the clean logits
(``full_logits``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from captum_vit._base import (
    Prepared,
    TargetLike,
    check_choice,
    check_images,
    check_scalar,
    prepare,
)
from captum_vit._text import count_noun
from captum_vit.adapters import (
    Layout,
    ViTAdapter,
    adapt,
    grid_to_pixels,
    grid_to_video,
    subset_logits,
)
from captum_vit.adapters.subsets import image_logits
from captum_vit.metrics.maps import PIXEL_REDUCES, AttributionLike, patch_maps, ranking
from captum_vit.metrics.settings import REMOVALS, Fill, Removal, forward_batch_of
from captum_vit.targets import as_target, embedding_target

UNITS = ("patch", "pixel")
TIS_BASELINES = ("mean", "blur", "black", "random")
UPSAMPLE_MODES = ("bilinear", "bicubic", "nearest")
Metric = TypeVar("Metric", bound=Callable[..., Any])


def vector_targets(metric: Metric) -> Metric:
    """Let a metric ``f(model, inputs, ..., target=...)`` take vector targets on a model
    that outputs an image embedding (:mod:`captum_vit.targets`).

    A :class:`~captum_vit.targets.Target` (or a plain callable on the logits) likewise
    becomes the model's scores for the whole metric, the metric running on its column of
    each image. The target (a vector, one per image, or an
    :class:`~captum_vit.EmbeddingTarget` set) becomes the model's scores for the whole
    metric (every adapter of the model, the explained method's included, sees it through
    :meth:`ViTAdapter.targeting`), and the metric runs on the vector index of each image;
    its probabilities are the target's (softmax over a set, sigmoid of a single score).
    Classifiers pass through unchanged.
    """
    @functools.wraps(metric)
    def run(model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        adapter = adapt(model)
        obj = as_target(kwargs.get("target"))
        if obj is not None:  # a Target: its columns are the scores of the whole metric
            images, _ = check_images(inputs, video=adapter.video)
            adapter.check_inputs(images)
            adapter.self_check(images)
            obj = obj.resolve(adapter, images)
            with adapter.targeting(obj, grid=adapter.layout(images).grid):
                index = obj.index(images.shape[0])
                return metric(model, inputs, *args, **{**kwargs, "target": index})
        if not adapter.embedding or adapter.head.target is not None:
            return metric(model, inputs, *args, **kwargs)
        images, _ = check_images(inputs, video=adapter.video)
        head, index = embedding_target(kwargs.get("target"), images.shape[0],
                                       adapter.num_classes, images)
        with adapter.targeting(head):
            return metric(model, inputs, *args, **{**kwargs, "target": index})
    return run  # type: ignore[return-value]


# -- inputs -------------------------------------------------------------------------------
def prepare_metric(model: nn.Module, inputs: Any, target: TargetLike
                   ) -> tuple[ViTAdapter, Prepared]:
    """The metrics' way in: :func:`captum_vit._base.prepare` with the prediction.

    Validates the images and the target exactly as every method does, runs the model
    once, and resolves ``target=None`` to the predicted class.

    Returns:
        (adapter, prepared): ``prepared.logits`` holds the clean logits [B, classes].
    """
    adapter = adapt(model)
    return adapter, prepare(adapter, inputs, target, predict=True)


def example_seeds(example_ids: Sequence[int] | Tensor | None, batch: int, seed: int) -> list[int]:
    """One seed per example from its dataset index (never from the rank or the batch)."""
    ids = list(range(batch)) if example_ids is None else [int(i) for i in example_ids]
    if len(ids) != batch:
        raise ValueError(f"example_ids has {count_noun(len(ids), 'entry', 'entries')} for a "
                         f"batch of {batch}")
    return [seed * 1_000_003 + i for i in ids]


def upsample(scores: Tensor, grid: tuple[int, int], patch_size: tuple[int, int],
             size: tuple[int, int], mode: str = "bilinear") -> Tensor:
    """Patch scores [B, P] -> [B, H, W] (float64) by bilinear or bicubic interpolation
    (``align_corners=False``, to the padded grid size, then cropped) or nearest (each
    patch's score copied to its pixels).

    Examples::

        >>> upsample(torch.rand(2, 196), (14, 14), (16, 16), (224, 224)).shape
        torch.Size([2, 224, 224])
    """
    check_choice("mode", mode, UPSAMPLE_MODES)
    g = scores.reshape(scores.shape[0], *grid).double()
    return grid_to_pixels(g, size, patch_size=patch_size, mode=mode)


# -- baselines ----------------------------------------------------------------------------
def gaussian_blur(images: Tensor, kernel_size: int = 11, sigma: float = 5.0) -> Tensor:
    """Separable Gaussian blur with reflect padding, per channel (videos [B, T, C, H, W]:
    per frame)."""
    if images.dim() == 5:
        return gaussian_blur(images.flatten(0, 1), kernel_size, sigma).reshape(images.shape)
    r = kernel_size // 2
    x = torch.arange(kernel_size, dtype=images.dtype, device=images.device) - r
    k = torch.exp(-0.5 * (x / sigma) ** 2)
    k = k / k.sum()
    c = images.shape[1]
    mode = "reflect" if min(images.shape[-2:]) > r else "replicate"
    out = F.pad(images, (r, r, r, r), mode=mode)
    out = F.conv2d(out, k.reshape(1, 1, 1, -1).expand(c, 1, 1, -1), groups=c)
    return F.conv2d(out, k.reshape(1, 1, -1, 1).expand(c, 1, -1, 1), groups=c)


def baseline_images(inputs: Tensor, removal: str, seeds: Sequence[int]) -> Tensor:
    """The fill images [B, C, H, W] of a pixel baseline (see the module docstring);
    videos [B, T, C, H, W]: ``"mean"`` per channel over all frames, ``"blur"`` per
    frame."""
    check_choice("removal", removal, REMOVALS[1:])
    if removal == "black":
        return torch.zeros_like(inputs)
    if removal == "mean":
        dims = (1, 3, 4) if inputs.dim() == 5 else (2, 3)
        return inputs.mean(dims, keepdim=True).expand_as(inputs).clone()
    if removal == "blur":
        return gaussian_blur(inputs)
    out = torch.empty_like(inputs)
    for i, s in enumerate(seeds):
        g = torch.Generator().manual_seed(s)
        u = torch.rand(inputs.shape[1:], generator=g, dtype=torch.float64)
        lo, hi = inputs[i].min().double().cpu(), inputs[i].max().double().cpu()
        out[i] = (lo + (hi - lo) * u).to(inputs.dtype)
    return out


def image_space_zero(mean: Sequence[float] | None, std: Sequence[float] | None) -> Fill:
    r"""The fill of "set the pixel to 0 in the ``[0, 1]`` image space, then normalise"
    (Chefer et al.'s perturbation test, ``pertubation_eval_from_hdf5.py``): per channel
    :math:`(0 - \mathrm{mean}) / \mathrm{std}` in the model's (normalised) input space.

    Args:
        mean, std (Sequence[float], optional): the normalisation of the model's inputs
            (one value or one per channel); ``None``: no normalisation (fill 0).

    Returns:
        Callable: ``fill(images, seeds) -> fill images``, a ``removal`` of the metrics.

    Examples::

        >>> from captum_vit.metrics import deletion
        >>> zero = image_space_zero((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))   # fill = -1
        >>> deletion(model, x, maps, removal=zero, unit="pixel").value
    """
    if (mean is None) != (std is None):
        raise ValueError("image_space_zero needs both mean and std, or neither")

    def fill(images: Tensor, seeds: Sequence[int]) -> Tensor:
        if mean is None or std is None:
            return torch.zeros_like(images)
        m = torch.as_tensor(mean, dtype=images.dtype, device=images.device).reshape(-1, 1, 1)
        s = torch.as_tensor(std, dtype=images.dtype, device=images.device).reshape(-1, 1, 1)
        return (-m / s).expand_as(images).clone()

    fill.__name__ = "image_space_zero"
    return fill


def tis_baseline(name: str) -> Fill:
    """TIS's baselines (Englebert et al., ``metrics/utils.py``), in the normalised input
    space: ``"mean"`` = one scalar, the mean of the whole image (all channels);
    ``"blur"`` = Gaussian 11×11, σ 5; ``"black"`` = 0; ``"random"`` = U[0, 1), seeded per
    example (TIS draws ``torch.rand_like``). They differ from :func:`baseline_images`'s
    ``mean`` (per channel) and ``random`` (within the image's range).

    Examples::

        >>> from captum_vit.metrics import insertion
        >>> insertion(model, x, maps, removal=tis_baseline("mean"), unit="pixel").value
    """
    check_choice("baseline", name, TIS_BASELINES)

    def fill(images: Tensor, seeds: Sequence[int]) -> Tensor:
        if name == "mean":
            return images.mean((1, 2, 3), keepdim=True).expand_as(images).clone()
        if name in ("blur", "black"):
            return baseline_images(images, name, seeds)
        out = torch.empty_like(images)
        for i, s in enumerate(seeds):
            g = torch.Generator().manual_seed(s)
            out[i] = torch.rand(images.shape[1:], generator=g, dtype=torch.float64).to(out)
        return out

    fill.__name__ = f"tis_{name}"
    return fill


def check_removal(removal: Removal, unit: str = "patch") -> None:
    """Validate a ``removal`` (a name of :data:`REMOVALS` or a fill callable) for ``unit``."""
    check_choice("unit", unit, UNITS)
    if not callable(removal):
        check_choice("removal", removal, REMOVALS)
    if unit == "pixel" and removal == "token":
        raise ValueError("unit='pixel' removes single pixels, which needs a pixel baseline: "
                         "pass removal='black', 'mean', 'blur', 'random' or a fill callable")


# -- engine -------------------------------------------------------------------------------
class RemovalEngine:
    """Evaluate a model on images with some patches (or pixels) removed.

    Args:
        model (nn.Module): a supported ViT classifier (never modified).
        removal (str or Callable): ``"token"`` (default) or a pixel baseline ``"black"``,
            ``"mean"``, ``"blur"``, ``"random"``, or a fill callable ``(images, seeds) ->
            fill images`` (:func:`image_space_zero`, :func:`tis_baseline`).
        forward_batch (int): jobs (image, step) per forward pass (``batch_size=`` is its
            deprecated spelling). Default 64.
        adapter (ViTAdapter, optional): an existing adapter of ``model``.
        unit (str): ``"patch"`` (default: ``order`` ranks the P patches) or ``"pixel"``
            (``order`` ranks the H·W pixels; every channel of a removed pixel is filled).

    Examples::

        >>> eng = RemovalEngine(model, removal="token")
        >>> order = ranking(patch_scores)                  # [B, P], most important first
        >>> logits = eng.logits(x, order, [0, 10, 20])     # [B, 3, classes]
    """

    def __init__(self, model: nn.Module, removal: Removal = "token",
                 forward_batch: int | None = None,
                 adapter: ViTAdapter | None = None, unit: str = "patch",
                 **deprecated: Any) -> None:
        forward_batch = forward_batch_of(forward_batch, deprecated, "RemovalEngine")
        forward_batch = 64 if forward_batch is None else forward_batch
        if deprecated:
            raise TypeError(f"RemovalEngine() got unexpected keyword arguments "
                            f"{sorted(deprecated)}")
        check_removal(removal, unit)
        check_scalar(forward_batch, "forward_batch", int, min_val=1)
        self.model = model
        self.adapter = adapter or adapt(model)
        self.removal = removal
        self.forward_batch = forward_batch
        self.unit = unit

    def layout(self, inputs: Tensor) -> Layout:
        self.adapter.check_inputs(inputs)
        return self.adapter.layout(inputs)

    def logits(self, inputs: Tensor, order: Tensor, counts: Sequence[int], *,
               mode: str = "delete", seeds: Sequence[int] | None = None,
               full_logits: Tensor | None = None) -> Tensor:
        """Logits [B, S, classes] with the first ``counts[s]`` units of ``order`` affected.

        Args:
            inputs (Tensor): images [B, C, H, W].
            order (Tensor): [B, P] patch indices (``unit="pixel"``: [B, H·W] pixel
                indices), the first ones are affected first (``ranking(scores)`` for
                MoRF, its flip for LeRF).
            counts (Sequence[int]): number of affected units per step, in ``[0, P]``.
            mode (str): ``"delete"`` removes the affected units; ``"insert"`` keeps only
                them (starting from everything removed).
            seeds (Sequence[int], optional): per-example seeds (``"random"`` baseline).
            full_logits (Tensor, optional): logits [B, classes] of the unperturbed images
                (the metrics' clean forward); steps that remove nothing (``delete`` 0,
                ``insert`` everything) reuse them instead of running the model again.

        Returns:
            Tensor: logits [B, S, classes] (no gradient).
        """
        check_choice("mode", mode, ("delete", "insert"))
        prep = prepare(self.adapter, inputs, None)
        inputs, layout = prep.images, prep.layout
        b = inputs.shape[0]
        if self.unit == "pixel" and layout.frames is not None:
            raise ValueError("unit='pixel' ranks the pixels of one image; this model takes "
                             "videos: use unit='patch' (tubelets, with removal='token' or "
                             "a pixel baseline over each tubelet's frames and pixels)")
        p = layout.num_patches if self.unit == "patch" else inputs.shape[-2] * inputs.shape[-1]
        if order.shape != (b, p):
            raise ValueError(f"order must be [B, {'P' if self.unit == 'patch' else 'H*W'}] = "
                             f"{(b, p)}, got {tuple(order.shape)}")
        counts = [int(c) for c in counts]
        if any(not 0 <= c <= p for c in counts):
            raise ValueError(f"counts must be in [0, {p}], got {counts}")
        order = order.to(inputs.device)
        rank_of = torch.empty_like(order)
        rank_of.scatter_(1, order, torch.arange(p, device=order.device).expand(b, -1))
        steps = torch.as_tensor(counts, device=inputs.device)

        def removed_of(ii: Tensor, jj: Tensor) -> Tensor:  # [n, units] of jobs (ii, jj)
            affected = rank_of[ii] < steps[jj, None]
            return affected if mode == "delete" else ~affected

        if self.unit == "pixel":
            todo = (steps > 0) if mode == "delete" else (steps < p)
            h, w = inputs.shape[-2:]
            return self._pixel_logits(
                inputs, lambda ii, jj: removed_of(ii, jj).reshape(-1, h, w),
                todo.expand(b, -1), seeds, full_logits)
        ii, jj = torch.meshgrid(torch.arange(b, device=inputs.device),
                                torch.arange(len(counts), device=inputs.device), indexing="ij")
        removed = removed_of(ii.flatten(), jj.flatten()).reshape(b, len(counts), p)
        return self.masked_logits(inputs, removed, seeds=seeds, full_logits=full_logits)

    def masked_logits(self, inputs: Tensor, removed: Tensor, *,
                      seeds: Sequence[int] | None = None,
                      full_logits: Tensor | None = None) -> Tensor:
        """Logits [B, S, classes] with any sets of patches removed (``unit="patch"``).

        Args:
            inputs (Tensor): images [B, C, H, W].
            removed (Tensor): bool [B, S, P], ``True`` = patch removed at job ``(b, s)``.
            seeds (Sequence[int], optional): per-example seeds (``"random"`` baseline).
            full_logits (Tensor, optional): clean logits [B, classes], reused by jobs
                that remove nothing.

        Returns:
            Tensor: logits [B, S, classes] (no gradient).

        Examples::

            >>> removed = torch.zeros(len(x), 2, 16, dtype=torch.bool)
            >>> removed[:, 0, :4] = removed[:, 1, 4:8] = True     # two groups of patches
            >>> RemovalEngine(model).masked_logits(x, removed).shape
            torch.Size([4, 2, 10])
        """
        if self.unit != "patch":
            raise ValueError("masked_logits removes patches; build the engine with "
                             "unit='patch'")
        prep = prepare(self.adapter, inputs, None)
        inputs, layout = prep.images, prep.layout
        b, p = inputs.shape[0], layout.num_patches
        if removed.dtype != torch.bool or removed.dim() != 3 or removed.shape[0] != b \
                or removed.shape[2] != p:
            raise ValueError(f"removed must be a bool tensor [B, S, P] = [{b}, S, {p}], got "
                             f"{removed.dtype} {tuple(removed.shape)}")
        if full_logits is not None and tuple(full_logits.shape[:1]) != (b,):
            raise ValueError(f"full_logits must be [B, classes] with B={b}, got "
                             f"{tuple(full_logits.shape)}")
        removed = removed.to(inputs.device)
        with torch.no_grad():
            if self.removal == "token":
                return self._token_logits(inputs, removed, full_logits)
            h, w = inputs.shape[-2:]
            return self._pixel_logits(
                inputs, lambda ii, jj: patch_pixels(removed[ii, jj], layout, (h, w)),
                removed.any(-1), seeds, full_logits)

    def _token_logits(self, inputs: Tensor, removed: Tensor,
                      full_logits: Tensor | None = None) -> Tensor:
        """True token removal through the adapters' subset engine
        (:func:`~captum_vit.adapters.subsets.subset_logits`): jobs of every image and step
        are grouped by kept length; a forward mixing lengths pads the shorter sequences
        and masks the padding out as attention keys (and from average pooling), which
        equals running every job on its own shortened sequence. A job with no token at
        all gets logits 0."""
        x0 = self.adapter.embed(inputs)
        return subset_logits(self.adapter, x0, ~removed, batch_size=self.forward_batch,
                             full_logits=full_logits)

    def fill_images(self, inputs: Tensor, seeds: Sequence[int] | None = None) -> Tensor:
        """The fill images [B, C, H, W] of the engine's pixel baseline."""
        seeds = list(range(inputs.shape[0])) if seeds is None else list(seeds)
        if callable(self.removal):
            return self.removal(inputs, seeds)
        return baseline_images(inputs, self.removal, seeds)

    def _pixel_logits(self, inputs: Tensor, removed_of: Callable[[Tensor, Tensor], Tensor],
                      todo: Tensor, seeds: Sequence[int] | None,
                      full_logits: Tensor | None) -> Tensor:
        """The pixel engine (:func:`~captum_vit.adapters.subsets.image_logits`): job
        ``(b, s)`` replaces the pixels ``removed_of(b, s)`` [n, H, W] by the fill; jobs
        not in ``todo`` [B, S] reuse ``full_logits`` (all jobs run when it is None)."""
        b, s = todo.shape
        fill = self.fill_images(inputs, seeds)
        if full_logits is None:
            todo = torch.ones_like(todo)
        jobs = todo.nonzero()  # (image, step) pairs that need a forward
        out = None if full_logits is None else full_logits[:, None].repeat(1, s, 1)
        if len(jobs):
            def make(j: Tensor) -> tuple[Tensor, Tensor]:
                ii, jj = jobs[j].unbind(1)
                m = removed_of(ii, jj).unsqueeze(-3)  # [n, 1, H, W]; videos [n, T, 1, H, W]
                return torch.where(m, fill[ii], inputs[ii]), ii

            with torch.no_grad():
                logits = image_logits(self.adapter, len(jobs), make,
                                      batch_size=self.forward_batch, device=inputs.device)
            if out is None:
                out = logits.new_zeros(b, s, logits.shape[-1])
            out[jobs[:, 0], jobs[:, 1]] = logits
        assert out is not None
        return out


def patch_pixels(removed: Tensor, layout: Layout, size: tuple[int, int]) -> Tensor:
    """Patch masks [B, P] (bool) as pixel masks [B, H, W] of an image of ``size``; for a
    video layout tubelet masks as frame masks [B, T, H, W] (each tubelet's frames and
    pixels)."""
    if layout.frames is not None:
        grid = removed.reshape(-1, layout.frames, *layout.frame_grid)
        return grid_to_video(grid, size, patch_size=layout.patch_size, tubelet=layout.tubelet)
    return grid_to_pixels(removed.reshape(-1, *layout.grid), size, patch_size=layout.patch_size)


def remove_pixels(inputs: Tensor, fill: Tensor, removed: Tensor, layout: Layout) -> Tensor:
    """Images [B, C, H, W] (videos [B, T, C, H, W]) whose removed patches ([B, P] bool)
    take the ``fill`` pixels."""
    mask = patch_pixels(removed, layout, (inputs.shape[-2], inputs.shape[-1])).unsqueeze(-3)
    return torch.where(mask, fill, inputs)


__all__ = ["PIXEL_REDUCES", "REMOVALS", "TIS_BASELINES", "UNITS", "UPSAMPLE_MODES",
           "AttributionLike", "Fill", "Removal", "RemovalEngine", "baseline_images",
           "check_removal", "example_seeds", "gaussian_blur", "image_space_zero",
           "patch_maps", "patch_pixels", "prepare_metric", "ranking", "remove_pixels",
           "tis_baseline", "upsample", "vector_targets"]
