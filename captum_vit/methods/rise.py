r"""RISE: Randomized Input Sampling for Explanation (Petsiuk, Das & Saenko, BMVC 2018).

The model is probed with the image seen through N random soft masks; a pixel's saliency is
the mean target probability of the masked images, weighted by how much each mask keeps
that pixel (the paper's Eq. 6, Monte-Carlo form):

.. math::
    S = \frac{1}{N\,p} \sum_{i=1}^{N} f_c(X \odot M_i)\, M_i .

Masks (Sec. 3.2): binary grids :math:`G_i \in \{0,1\}^{s \times s}`, cells i.i.d.
Bernoulli(p), upsampled bilinearly to :math:`(s+1)C` with cell size
:math:`C = \lceil H/s \rceil` (per axis) and cropped to :math:`H \times W` at a uniform
random integer offset in :math:`[0, C_h) \times [0, C_w)`.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from captum.log import log_usage
from torch import Tensor, nn

from captum_vit._base import (
    SCORES,
    TargetLike,
    ViTPerturbationAttribution,
    accumulation_dtype,
    check_choice,
    check_scalar,
    resolve_target,
    score_reduce,
)
from captum_vit.adapters import (
    FusedOps,
    image_logits,
    pools_patches,
    subset_forwards,
    subset_logits,
)
from captum_vit.methods._front import fill_doc
from captum_vit.methods._masks import (
    GridMasks,
    interpolation_matrix,
    patch_means,
    resolve_removal,
)
from captum_vit.methods.scorecam import REMOVALS
from captum_vit.methods.table import register_method


def rise_masks(n_masks: int, grid_size: int | tuple[int, int], p: float,
               size: tuple[int, int] | None = None, *,
               generator: torch.Generator | None = None) -> GridMasks:
    r"""RISE's random masks (Sec. 3.2), drawn at once, materialised on demand.

    Draws, in this order from ``generator``: the grids ``torch.rand(N, s_h, s_w) < p``
    (float64 uniforms), then the row offsets, then the column offsets
    (``torch.randint(0, C, (N,))``). With ``size`` each grid is upsampled with
    :func:`~captum_vit.methods._masks.interpolation_matrix` (``edge="mirror"``) to
    :math:`((s_h+1) C_h, (s_w+1) C_w)`, :math:`C = \lceil H / s \rceil` per axis, and
    cropped to ``size`` at its offset: scikit-image's ``resize(grid, up_size, order=1,
    mode="reflect", anti_aliasing=False)[x:x+H, y:y+W]`` as in the authors' code. Without
    ``size`` the grids are the masks (token masks on the patch grid; no offsets drawn).

    Args:
        n_masks (int): N.
        grid_size (int or tuple of int): ``s`` (an ``s × s`` grid) or ``(s_h, s_w)``.
        p (float): probability that a cell is kept, in (0, 1].
        size (tuple of int, optional): ``(H, W)`` of the masks.
        generator (torch.Generator, optional): CPU generator (default: a fresh one
            seeded with 0).

    Returns:
        GridMasks: N masks with values in [0, 1], mean ``p`` in expectation.

    Examples::

        >>> masks = rise_masks(4000, 7, 0.5, (224, 224),
        ...                    generator=torch.Generator().manual_seed(0))
        >>> masks.materialize(torch.arange(8), torch.float32).shape
        torch.Size([8, 224, 224])
    """
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    sh, sw = (grid_size, grid_size) if isinstance(grid_size, int) else grid_size
    grids = torch.rand(n_masks, sh, sw, generator=gen, dtype=torch.float64) < p
    if size is None:
        return GridMasks(grids, (sh, sw))
    h, w = size
    ch, cw = math.ceil(h / sh), math.ceil(w / sw)
    up = (interpolation_matrix(sh, (sh + 1) * ch, "mirror"),
          interpolation_matrix(sw, (sw + 1) * cw, "mirror"))
    offsets = torch.stack([torch.randint(0, ch, (n_masks,), generator=gen),
                           torch.randint(0, cw, (n_masks,), generator=gen)], 1)
    return GridMasks(grids, (h, w), up, offsets)


def _check_fill(fill: Any, inputs: Tensor) -> Tensor | None:
    """``fill`` as a tensor broadcast to the inputs' shape, or None for 0."""
    if isinstance(fill, Tensor):
        if not torch.is_floating_point(fill):
            raise TypeError(f"fill must be a float or a floating-point tensor (a baseline "
                            f"image), got a tensor of dtype {fill.dtype}")
        try:
            shape = torch.broadcast_shapes(fill.shape, inputs.shape)
        except RuntimeError:
            shape = None
        if shape != inputs.shape:
            raise ValueError(f"fill must broadcast to the inputs' shape {tuple(inputs.shape)} "
                             f"(e.g. a baseline image [C, H, W]), got {tuple(fill.shape)}")
        return fill.to(dtype=inputs.dtype, device=inputs.device).expand(inputs.shape)
    fill = check_scalar(fill, "fill", float)
    return None if fill == 0 else torch.full_like(inputs, fill)


@register_method("rise", kind="perturbation", quick={"n_masks": 500}, seeded=True)
class RISE(ViTPerturbationAttribution):
    r"""RISE (Petsiuk et al., BMVC 2018): the expected target probability of the image
    seen through random soft masks, given that a pixel is kept.

    .. math::
        S = \frac{1}{N\,p} \sum_{i=1}^{N} f_c(X \odot M_i)\, M_i,

    :math:`f_c` the softmax probability of the target (``score="logit"``: its logit),
    :math:`X \odot M_i` computed in the model's normalised input space, so a masked pixel
    is 0 = the dataset mean colour (``fill`` replaces it by a value or a baseline image:
    :math:`X \odot M + F \odot (1 - M)`). The token map is the mean of :math:`S` over each
    patch (``output="pixels"`` copies it back to the patch's pixels, as every method of
    this package).

    Masks (:func:`rise_masks`): grids of ``grid_size × grid_size`` Bernoulli(``p``) cells,
    cell size :math:`C = \lceil H/s \rceil` per axis, upsampled bilinearly to
    :math:`(s+1)C` and cropped to :math:`H \times W` at a uniform random integer offset in
    :math:`[0, C_h) \times [0, C_w)`. Checked against the authors' code (eclique/RISE,
    ``explanations.py``, MIT): the upsampling is scikit-image's ``resize(grid, up_size,
    order=1, mode="reflect", anti_aliasing=False)``: linear interpolation with pixel-centre
    alignment whose edge mode mirrors about the edge cell's centre (``scipy.ndimage``'s
    ``"mirror"``), unlike ``torch``'s bilinear, which clamps; this implementation equals
    scikit-image's output to float32 rounding (3e-8, measured for s = 7, 8, 10 and
    224×224, 32×32, 24×40 images). The authors' code divides by ``N·p`` and wraps the
    model in a softmax, as here. Defaults ``N = 4000, s = 7, p = 0.5``: the setting
    reported as the paper's ImageNet one (not checked against the paper's text, which was
    not available; Xplique's RISE example uses the same values); the authors' notebooks use
    ``(N, s, p) = (6000, 8, 0.1)`` (``Saliency.ipynb``), ``(5000, 10, 0.1)``
    (``Evaluation.ipynb``) and ``(2000, 8, 0.5)`` (``Easy_start.ipynb``); the TIS authors'
    wrapper is reported to use ``(4000, 8, 0.1)``, batch 128 (not checked here).

    Repeatability: the masks are drawn from a CPU generator seeded with ``seed`` at every
    call (grids, then row offsets, then column offsets), shared by all images of the batch;
    seeded runs are bit-for-bit identical on a device, and an image's map does not depend
    on its batch (up to the floating-point rounding of batched forwards).

    ``removal="tokens"`` (captum_vit extension): the grid is the patch grid, not upsampled
    (no offsets); the model runs on the prefix tokens plus the patches of the cells kept
    (true token removal through the adapters' subset engine,
    :func:`~captum_vit.adapters.subsets.subset_logits`) and
    :math:`S = \frac{1}{N p}\sum_i f_c(\text{kept}_i) G_i` on the patches. This is the
    only form on a sub-network :math:`f_l` (PLUS / SkipPLUS, :mod:`captum_vit.combinators`), where
    ``removal=None`` resolves to it.

    Cost: N masked forwards per image (``n_masks · B`` images, ``batch_size`` per
    forward), plus one clean forward per image when ``target=None`` (the predicted class);
    no backward. With ``removal="tokens"`` a mask keeping no token at all (a model without
    prefix tokens) needs no forward, nor, with ``target=None``, one keeping every patch
    (the clean logits). After each call :attr:`num_forwards` holds the number of model
    evaluations (images or shortened sequences) it ran.

    Args:
        model (torch.nn.Module): a supported Vision Transformer.
        seed (int, optional): seed of the mask generator. Default 0.

    Attributes:
        num_forwards (int): model evaluations of the last ``attribute`` call (0 before).

    Examples::

        >>> from captum_vit import RISE
        >>> rise = RISE(model, seed=0)
        >>> attr = rise.attribute(images, target=labels)           # N = 4000 masks
        >>> rise.num_forwards                                       # 4000 * len(images)
        >>> tokens = rise.attribute(images, target=labels, n_masks=500, output="tokens")
        >>> removed = rise.attribute(images, target=labels, removal="tokens")
    """

    def __init__(self, model: nn.Module, seed: int = 0) -> None:
        super().__init__(model)
        self.seed = check_scalar(seed, "seed", int, min_val=0, max_val=2**63 - 1)
        self.num_forwards = 0

    @log_usage()
    @fill_doc
    def attribute(self, inputs: Tensor, target: TargetLike = None, *, n_masks: int = 4000,
                  grid_size: int | None = None, p: float = 0.5, fill: float | Tensor = 0.0,
                  removal: str | None = None, score: str = "probability",
                  batch_size: int = 100, show_progress: bool = False,
                  output: str = "pixels") -> Tensor:
        r"""
        Args:
            {inputs}
            target (int, list, Tensor, optional): class per image (or target embeddings
                for a model that outputs an embedding). ``None`` (default) explains the
                predicted class of each image (Captum's ``None`` means a scalar output;
                here it means "predicted").
            n_masks (int, optional): N, the number of random masks. Default 4000.
            grid_size (int, optional): ``s``, the mask grid is ``s × s`` cells. Default
                ``None`` = 7; must stay ``None`` with ``removal="tokens"`` (the grid is
                the patch grid).
            p (float, optional): probability that a cell is kept, in (0, 1]. Default 0.5.
            fill (float or Tensor, optional): the value of masked pixels in the model's
                input space: 0 (default, the dataset mean of normalised inputs), another
                number, or a baseline image broadcastable to ``inputs`` (e.g. [C, H, W] or
                [B, C, H, W]; a per-image baseline needs exactly B images, so not under
                NoiseTunnel). Pixel removal only.
            removal (str, optional): ``"pixels"`` (masked images through the model's own
                forward) or ``"tokens"`` (true token removal on the patch grid). Default
                ``None``: pixels on a model, tokens on a sub-network (PLUS/SkipPLUS).
            score (str, optional): ``"probability"`` (default, the paper) or ``"logit"``.
            batch_size (int, optional): masked images (or shortened sequences) per forward.
                Default 100 (the authors' ``gpu_batch``).
            show_progress (bool, optional): tqdm progress bar over the forwards. Default
                False.
            {output}

        Returns:
            Tensor: the saliency (a probability scale, not normalised) in the requested
            ``output`` format.

        Examples::

            >>> from captum_vit import RISE
            >>> attr = RISE(model).attribute(images, target=labels, n_masks=1000,
            ...                              batch_size=250, show_progress=True)
            >>> grey = RISE(model).attribute(images, target=labels, fill=baseline)
        """
        check_scalar(n_masks, "n_masks", int, min_val=1)
        if grid_size is not None:
            check_scalar(grid_size, "grid_size", int, min_val=1)
        check_scalar(p, "p", float, min_val=0.0, max_val=1.0, include_boundaries="right")
        if removal is not None:
            check_choice("removal", removal, REMOVALS)
        check_choice("score", score, SCORES)
        check_scalar(batch_size, "batch_size", int, min_val=1)
        check_scalar(show_progress, "show_progress", bool)
        if not isinstance(fill, Tensor):
            check_scalar(fill, "fill", float)
        return self._attribute(inputs, target, output, n_masks=n_masks, grid_size=grid_size,
                               p=p, fill=fill, removal=removal, score=score,
                               batch_size=batch_size, show_progress=show_progress)

    def _token_maps(self, inputs: Tensor, target: Tensor | None, *, n_masks: int = 4000,
                    grid_size: int | None = None, p: float = 0.5, fill: Any = 0.0,
                    removal: str | None = None, score: str = "probability",
                    batch_size: int = 100, show_progress: bool = False,
                    **_: Any) -> Tensor:
        adapter = self.adapter
        layout = adapter.layout(inputs)
        removal = resolve_removal(adapter, removal)
        b, k = inputs.shape[0], layout.num_prefix
        dt = accumulation_dtype(inputs)
        if removal == "tokens":
            if grid_size is not None:
                raise ValueError("grid_size must be None with removal='tokens': the mask "
                                 f"grid is the patch grid {layout.grid}")
            if isinstance(fill, Tensor) or fill != 0:
                raise ValueError("fill applies to removal='pixels' only (removed tokens "
                                 "have no value); leave fill=0 with removal='tokens'")
        else:
            fill = _check_fill(fill, inputs)
        gen = torch.Generator().manual_seed(self.seed)
        logits, forwards = None, 0
        with torch.no_grad():
            x0 = adapter.embed(inputs) if removal == "tokens" or target is None else None
            if target is None:  # the predicted class
                logits = adapter.run(cast(Tensor, x0), ops=FusedOps())  # embedded above
                forwards = b
        t = resolve_target(target, logits) if logits is not None else cast(
            Tensor, target).to(inputs.device)  # no logits: a target was given
        reduce = score_reduce(t, score, dt, adapter.probability)

        if removal == "tokens":
            masks = rise_masks(n_masks, layout.grid, p, generator=gen)
            keep = masks.grids.reshape(1, n_masks, layout.num_patches)
            w = subset_logits(adapter, cast(Tensor, x0), keep, batch_size=batch_size,
                              full_logits=logits,
                              reduce=reduce, show_progress=show_progress, desc="RISE")
            sal = w @ keep[0].to(device=w.device, dtype=dt) / (n_masks * p)
            self.num_forwards = forwards + subset_forwards(
                keep.expand(b, -1, -1), k, reuse_full=logits is not None,
                pools_patches=pools_patches(adapter))
        else:
            masks = rise_masks(n_masks, grid_size or 7, p,
                               (int(inputs.shape[-2]), int(inputs.shape[-1])),
                               generator=gen)

            def make(jobs: Tensor) -> tuple[Tensor, Tensor]:
                i, img = jobs // b, jobs % b  # mask-major: a chunk needs few masks
                used, inv = torch.unique(i, return_inverse=True)
                m = masks.materialize(used, dt, inputs.device)[inv, None].to(inputs.dtype)
                x = inputs[img] * m
                if fill is not None:
                    x = x + fill[img] * (1 - m)
                return x, img

            w = image_logits(adapter, n_masks * b, make, batch_size=batch_size, reduce=reduce,
                             show_progress=show_progress, desc="RISE",
                             device=inputs.device).reshape(n_masks, b).T  # [B, N]
            pixels = inputs.new_zeros(b, *inputs.shape[-2:], dtype=dt)
            for idx in masks.chunks(batch_size):
                m = masks.materialize(idx, dt, inputs.device)
                pixels += torch.einsum("bn,nhw->bhw", w[:, idx.to(w.device)], m)
            sal = patch_means(pixels / (n_masks * p), layout)
            self.num_forwards = forwards + n_masks * b
        full = sal.new_zeros(b, layout.num_tokens)  # prefix tokens are never scored
        full[:, k:] = sal
        return full
