"""Patch maps from any attribution, and the removal engine of the faithfulness metrics.

Removal always works on the model's patch grid (SPEC §6.3):

* ``removal="token"`` (default, true token masking, SkipPLUS §4.1): a removed patch's
  token is dropped from the sequence right after the positional embedding
  (``adapter.embed`` then ``adapter.run(x0, keep=...)``); prefix tokens are always kept,
  so no fill value is ever invented. For a model without prefix tokens (``global_pool=
  'avg'``, no class token) an empty sequence has no output; its logits are defined as 0
  (uniform probabilities).
* pixel baselines: the removed patches' pixels are replaced by ``"black"`` (0 in the
  model's input space), ``"mean"`` (the image's per-channel mean), ``"blur"`` (Gaussian
  blur of the image, kernel 11, σ 5, reflect padding) or ``"random"`` (uniform noise in
  ``[min, max]`` of the image, seeded per example id), and the model runs on the images.

Every (image, step) pair is one job; jobs are evaluated in batched forwards over images
AND steps, at most ``batch_size`` a forward. With token masking the adapters' one subset
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
from captum.attr import Attribution
from torch import Tensor, nn

from captum_vit._base import (
    Prepared,
    TargetLike,
    check_choice,
    check_images,
    check_scalar,
    prepare,
)
from captum_vit.adapters import Layout, ViTAdapter, adapt, subset_logits
from captum_vit.targets import embedding_target

REMOVALS = ("token", "black", "mean", "blur", "random")
PIXEL_REDUCES = ("abs", "sum")
AttributionLike = Tensor | Attribution | Callable[..., Tensor]
Metric = TypeVar("Metric", bound=Callable[..., Any])


def vector_targets(metric: Metric) -> Metric:
    """Let a metric ``f(model, inputs, ..., target=...)`` take vector targets on a model
    that outputs an image embedding (SPEC_NEXT §7.5).

    The target (a vector, one per image, or an :class:`~captum_vit.EmbeddingTarget` set)
    becomes the model's scores for the whole metric (every adapter of the model, the
    explained method's included, sees it through :meth:`ViTAdapter.targeting`), and the
    metric runs on the vector index of each image; its probabilities are the target's
    (softmax over a set, sigmoid of a single score). Classifiers pass through unchanged.
    """
    @functools.wraps(metric)
    def run(model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        adapter = adapt(model)
        if not adapter.embedding or adapter.head.target is not None:
            return metric(model, inputs, *args, **kwargs)
        images, _ = check_images(inputs)
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
        raise ValueError(f"example_ids has {len(ids)} entries for a batch of {batch}")
    return [seed * 1_000_003 + i for i in ids]


# -- patch maps ---------------------------------------------------------------------------
def patch_maps(attribution: AttributionLike, inputs: Tensor, target: Tensor, layout: Layout, *,
               pixel_reduce: str = "abs", attribute_kwargs: dict | None = None) -> Tensor:
    """The attribution as patch scores [B, P] on the model's grid (raster order).

    Args:
        attribution: precomputed maps or an attribution:

            * a tensor of patch scores [B, P], a grid [B, gh, gw] / [B, 1, gh, gw], or a
              pixel map [B, H, W] / [B, C, H, W] at the image size (summed over the
              channels and the pixels of each patch, see ``pixel_reduce``);
            * a captum_vit method: called with ``output="tokens"`` (exact patch scores);
            * any Captum attribution (``IntegratedGradients(model)``, ``Saliency``,
              ``NoiseTunnel(...)``): ``attribute(inputs, target=target, **attribute_kwargs)``
              gives a pixel map, pooled as above;
            * a callable ``f(inputs, target) -> map`` (any of the shapes above).
        inputs (Tensor): images [B, C, H, W].
        target (Tensor): class per image [B].
        layout (Layout): the model's token layout for ``inputs``.
        pixel_reduce (str): ``"abs"`` (default: sum of ``|a|`` over channels and patch
            pixels, the usual pooling of gradient maps) or ``"sum"`` (signed sum).
        attribute_kwargs (dict, optional): extra keyword arguments of ``attribute``.

    Returns:
        Tensor: [B, P] patch scores (detached).
    """
    from captum_vit._base import _ViTFront

    check_choice("pixel_reduce", pixel_reduce, PIXEL_REDUCES)
    kw = dict(attribute_kwargs or {})
    if isinstance(attribution, Tensor):
        maps = attribution
    elif isinstance(attribution, _ViTFront):
        maps = attribution.attribute(inputs, target=target, output="tokens", **kw)
    elif isinstance(attribution, Attribution):
        maps = attribution.attribute(inputs, target=target, **kw)
    elif callable(attribution):
        maps = attribution(inputs, target)
    else:
        raise TypeError("attribution must be a tensor of maps, a Captum Attribution or a "
                        f"callable f(inputs, target); got {type(attribution).__name__}")
    if isinstance(maps, tuple) and len(maps) == 1:
        maps = maps[0]
    return _to_patches(maps.detach(), inputs, layout, pixel_reduce)


def _to_patches(maps: Tensor, inputs: Tensor, layout: Layout, pixel_reduce: str) -> Tensor:
    b = inputs.shape[0]
    (gh, gw), p = layout.grid, layout.num_patches
    h, w = inputs.shape[-2:]
    shape = tuple(maps.shape)
    if shape[:1] != (b,):
        raise ValueError(f"attribution maps have shape {shape} but the batch has {b} images")
    if maps.dim() == 2 and shape[1] == p:
        return maps
    if maps.dim() == 2 and shape[1] == layout.num_tokens:
        raise ValueError(f"attribution maps have {shape[1]} columns = all tokens; drop the "
                         f"{layout.num_prefix} prefix columns (keep the {p} patch scores)")
    if maps.dim() == 4 and shape[1] == 1 and shape[2:] == (gh, gw):
        return maps.reshape(b, p)
    if maps.dim() == 3 and shape[1:] == (gh, gw):
        return maps.reshape(b, p)
    if maps.dim() in (3, 4) and shape[-2:] == (h, w):
        pix = maps.abs() if pixel_reduce == "abs" else maps
        pix = pix.sum(1) if pix.dim() == 4 else pix  # channels
        ph, pw = layout.patch_size
        pix = F.pad(pix, (0, gw * pw - w, 0, gh * ph - h))
        return pix.reshape(b, gh, ph, gw, pw).sum((2, 4)).reshape(b, p)
    raise ValueError(
        f"attribution maps of shape {shape} match neither the patch grid ({p} patches, grid "
        f"{(gh, gw)}) nor the image size {(h, w)}; give [B, P], [B, 1, gh, gw] or pixel maps")


def ranking(scores: Tensor) -> Tensor:
    """Patch indices from most to least important [B, P] (ties: lower index first)."""
    return torch.argsort(scores, dim=1, descending=True, stable=True)


# -- baselines ----------------------------------------------------------------------------
def gaussian_blur(images: Tensor, kernel_size: int = 11, sigma: float = 5.0) -> Tensor:
    """Separable Gaussian blur with reflect padding, per channel."""
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
    """The fill images [B, C, H, W] of a pixel baseline (SPEC §6.3)."""
    check_choice("removal", removal, REMOVALS[1:])
    if removal == "black":
        return torch.zeros_like(inputs)
    if removal == "mean":
        return inputs.mean((2, 3), keepdim=True).expand_as(inputs).clone()
    if removal == "blur":
        return gaussian_blur(inputs)
    out = torch.empty_like(inputs)
    for i, s in enumerate(seeds):
        g = torch.Generator().manual_seed(s)
        u = torch.rand(inputs.shape[1:], generator=g, dtype=torch.float64)
        lo, hi = inputs[i].min().double().cpu(), inputs[i].max().double().cpu()
        out[i] = (lo + (hi - lo) * u).to(inputs.dtype)
    return out


# -- engine -------------------------------------------------------------------------------
class RemovalEngine:
    """Evaluate a model on images with some patches removed.

    Args:
        model (nn.Module): a supported ViT classifier (never modified).
        removal (str): ``"token"`` (default) or a pixel baseline ``"black"``, ``"mean"``,
            ``"blur"``, ``"random"``.
        batch_size (int): images per forward pass (over images and steps).
        adapter (ViTAdapter, optional): an existing adapter of ``model``.

    Examples::

        >>> eng = RemovalEngine(model, removal="token")
        >>> order = ranking(patch_scores)                  # [B, P], most important first
        >>> logits = eng.logits(x, order, [0, 10, 20])     # [B, 3, classes]
    """

    def __init__(self, model: nn.Module, removal: str = "token", batch_size: int = 64,
                 adapter: ViTAdapter | None = None) -> None:
        check_choice("removal", removal, REMOVALS)
        check_scalar(batch_size, "batch_size", int, min_val=1)
        self.model = model
        self.adapter = adapter or adapt(model)
        self.removal = removal
        self.batch_size = batch_size

    def layout(self, inputs: Tensor) -> Layout:
        self.adapter.check_inputs(inputs)
        return self.adapter.layout(inputs)

    def logits(self, inputs: Tensor, order: Tensor, counts: Sequence[int], *,
               mode: str = "delete", seeds: Sequence[int] | None = None,
               full_logits: Tensor | None = None) -> Tensor:
        """Logits [B, S, classes] with the first ``counts[s]`` patches of ``order`` affected.

        Args:
            inputs (Tensor): images [B, C, H, W].
            order (Tensor): [B, P] patch indices, the first ones are affected first
                (``ranking(scores)`` for MoRF, its flip for LeRF).
            counts (Sequence[int]): number of affected patches per step, in ``[0, P]``.
            mode (str): ``"delete"`` removes the affected patches; ``"insert"`` keeps only
                them (starting from everything removed).
            seeds (Sequence[int], optional): per-example seeds (``"random"`` baseline).
            full_logits (Tensor, optional): logits [B, classes] of the unperturbed images
                (the metrics' clean forward); steps that remove nothing (``delete`` 0,
                ``insert`` P) reuse them instead of running the model again.

        Returns:
            Tensor: logits [B, S, classes] (no gradient).
        """
        check_choice("mode", mode, ("delete", "insert"))
        prep = prepare(self.adapter, inputs, None)
        inputs, layout = prep.images, prep.layout
        b, p = inputs.shape[0], layout.num_patches
        if order.shape != (b, p):
            raise ValueError(f"order must be [B, P] = {(b, p)}, got {tuple(order.shape)}")
        counts = [int(c) for c in counts]
        if any(not 0 <= c <= p for c in counts):
            raise ValueError(f"counts must be in [0, {p}], got {counts}")
        seeds = list(range(b)) if seeds is None else list(seeds)
        order = order.to(inputs.device)
        # removed[b, s, j]: patch j is removed at step s
        affected = torch.zeros(b, len(counts), p, dtype=torch.bool, device=inputs.device)
        rank_of = torch.empty_like(order)
        rank_of.scatter_(1, order, torch.arange(p, device=order.device).expand(b, -1))
        for s, c in enumerate(counts):
            affected[:, s] = rank_of < c
        removed = affected if mode == "delete" else ~affected
        if full_logits is not None and tuple(full_logits.shape[:1]) != (b,):
            raise ValueError(f"full_logits must be [B, classes] with B={b}, got "
                             f"{tuple(full_logits.shape)}")
        with torch.no_grad():
            if self.removal == "token":
                return self._token_logits(inputs, removed, full_logits)
            return self._pixel_logits(inputs, removed, layout, seeds, full_logits)

    def _token_logits(self, inputs: Tensor, removed: Tensor,
                      full_logits: Tensor | None = None) -> Tensor:
        """True token removal through the adapters' subset engine
        (:func:`~captum_vit.adapters.subsets.subset_logits`): jobs of every image and step
        are grouped by kept length; a forward mixing lengths pads the shorter sequences
        and masks the padding out as attention keys (and from average pooling), which
        equals running every job on its own shortened sequence. A job with no token at
        all gets logits 0."""
        x0 = self.adapter.embed(inputs)
        return subset_logits(self.adapter, x0, ~removed, batch_size=self.batch_size,
                             full_logits=full_logits)

    def _pixel_logits(self, inputs: Tensor, removed: Tensor, layout: Layout,
                      seeds: Sequence[int], full_logits: Tensor | None = None) -> Tensor:
        b, s, p = removed.shape
        fill = baseline_images(inputs, self.removal, seeds)
        todo = removed.any(-1) if full_logits is not None else removed.new_ones(b, s)
        jobs = todo.nonzero().tolist()  # (image, step) pairs that need a forward
        out = None if full_logits is None else full_logits[:, None].repeat(1, s, 1)
        for lo in range(0, len(jobs), self.batch_size):
            ii, jj = torch.tensor(jobs[lo:lo + self.batch_size], device=inputs.device).unbind(1)
            logits = self.adapter.model_logits(
                remove_pixels(inputs[ii], fill[ii], removed[ii, jj], layout))
            if out is None:
                out = logits.new_zeros(b, s, logits.shape[-1])
            out[ii, jj] = logits
        assert out is not None
        return out


def remove_pixels(inputs: Tensor, fill: Tensor, removed: Tensor, layout: Layout) -> Tensor:
    """Images [B, C, H, W] whose removed patches ([B, P] bool) take the ``fill`` pixels."""
    (gh, gw), (ph, pw) = layout.grid, layout.patch_size
    h, w = inputs.shape[-2:]
    m = removed.reshape(-1, 1, gh, gw).repeat_interleave(ph, 2).repeat_interleave(pw, 3)
    return torch.where(m[..., :h, :w], fill, inputs)
