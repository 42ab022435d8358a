r"""ViT-CX: Causal Explanation of Vision Transformers (Xie et al., IJCAI 2023).

ViT-CX turns the model's own patch embeddings into masks and scores them causally:

1. Feature maps: the patch rows of the output of ``blocks[L-1].norm1`` (``LN1(x_{L-1})``),
   one map per channel, resized bilinearly to the image and min-max normalised.
2. Agglomerative clustering (complete linkage, cosine distance, ``distance_threshold``
   0.1) merges redundant maps; a cluster's mask is the sum of its maps, min-max
   normalised.
3. Causal impact score of mask :math:`M_i` with Gaussian noise :math:`\varepsilon_i`:
   :math:`s_i = p_c(X \odot M_i + \varepsilon_i \odot (1 - M_i)) - p_c(X + \varepsilon_i
   \odot (1 - M_i)) + p_c(X)`.
4. :math:`S = \frac{1}{N_m} \sum_i s_i\, M_i / \sum_j M_j` (pixel-wise coverage
   normalisation).
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import torch
from captum.log import log_usage
from torch import Tensor, nn

from captum_vit._base import (
    SCORES,
    TargetLike,
    ViTPerturbationAttribution,
    accumulation_dtype,
    check_choice,
    check_layer,
    check_scalar,
    resolve_target,
    score_reduce,
    target_scores,
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

NOISE_SEED_STRIDE = 1_000_003
"""Mask ``i``'s noise is drawn from a generator seeded with ``seed * stride + i``."""


def cosine_distances(grids: Tensor, up: tuple[Tensor, Tensor] | None = None) -> Tensor:
    r"""``1 - cos`` between every pair of masks ``U_h G_a U_w^T`` [D, D] (NaN
    similarity, i.e. an all-zero mask, counts as 0), computed on the grids: with
    :math:`K = U^\top U` the pixel inner product is
    :math:`\langle U_h G_a U_w^\top, U_h G_b U_w^\top\rangle = \mathrm{vec}(G_a)^\top
    (K_h \otimes K_w)\, \mathrm{vec}(G_b)`, so the D masks are never upsampled
    (``O(D^2 P)`` instead of ``O(D^2 H W)``).

    Args:
        grids (Tensor): [D, gh, gw].
        up (tuple of Tensor, optional): ``(U_h, U_w)``; ``None`` = the grids themselves.

    Returns:
        Tensor [D, D], symmetric.
    """
    g = grids
    if up is not None:
        kh, kw = (u.T @ u for u in up)
        g2 = kh @ g @ kw
    else:
        g2 = g
    gram = g.flatten(1) @ g2.flatten(1).T
    gram = (gram + gram.T) / 2
    norm = gram.diagonal().clamp(min=0).sqrt()
    denom = norm[:, None] * norm[None, :]
    cos = torch.where(denom > 0, gram / torch.where(denom > 0, denom, 1), 0)
    return 1 - cos


def cluster_labels(distances: Tensor, distance_threshold: float) -> np.ndarray:
    """Complete-linkage agglomerative clustering of precomputed ``distances`` [D, D], cut
    where merges reach ``distance_threshold`` (scikit-learn's ``AgglomerativeClustering(
    n_clusters=None, distance_threshold=t, metric="precomputed", linkage="complete")``,
    the authors' call; clusters are merged while their distance is ``< t``).

    Returns:
        np.ndarray [D] int: cluster label of every mask, ``0 .. N_m - 1``.
    """
    from sklearn.cluster import AgglomerativeClustering

    d = distances.detach().to("cpu", torch.float64).numpy()
    if d.shape[0] < 2:
        return np.zeros(d.shape[0], dtype=np.int64)
    model = AgglomerativeClustering(n_clusters=None, distance_threshold=distance_threshold,
                                    metric="precomputed", linkage="complete")
    return model.fit(d).labels_.astype(np.int64)


def vitcx_masks(features: Tensor, grid: tuple[int, int], size: tuple[int, int] | None,
                distance_threshold: float = 0.1) -> tuple[GridMasks, np.ndarray]:
    r"""Steps 1-3 of ViT-CX for one image: feature maps -> clustered masks.

    Channel ``d`` of the patch features gives the map :math:`F_d` [gh, gw], resized to
    ``size`` by bilinear interpolation (``align_corners=False``, as ``torchvision``'s
    ``Resize`` in the authors' code; an upsampling, so its anti-aliasing does nothing)
    and min-max normalised over the pixels (a constant map gives 0). As the resize is
    linear with rows summing to 1, the normalised map is the resize of
    :math:`(F_d - \ell_d)/(h_d - \ell_d)`, with :math:`\ell_d, h_d` the extremes of the
    resized map, so every step runs on the grid (:func:`cosine_distances`).

    Args:
        features (Tensor): the patch rows [P, D] of one image (raster order).
        grid (tuple of int): ``(gh, gw)``.
        size (tuple of int, optional): image size ``(H, W)``; ``None`` = masks on the
            patch grid (``removal="tokens"``).
        distance_threshold (float): clustering cut.

    Returns:
        (GridMasks with N_m masks, labels [D]).
    """
    gh, gw = grid
    f = features.T.reshape(-1, gh, gw).to(torch.float64)
    up: tuple[Tensor, Tensor] | None = None
    if size is not None:
        up = (interpolation_matrix(grid[0], size[0], "clamp", device=f.device),
              interpolation_matrix(grid[1], size[1], "clamp", device=f.device))
    channels = GridMasks(f, size or grid, up, minmax=True)
    lo, hi = cast(tuple[Tensor, Tensor], channels.range)  # set with minmax=True
    span = (hi - lo)[:, None, None]
    g = torch.where(span > 0, (f - lo[:, None, None]) / torch.where(span > 0, span, 1), 0)
    labels = cluster_labels(cosine_distances(g, up), distance_threshold)
    idx = torch.as_tensor(labels, device=g.device)
    sums = g.new_zeros(int(labels.max()) + 1, gh, gw).index_add_(0, idx, g)
    return GridMasks(sums, size or grid, up, minmax=True), labels


@register_method("vit_cx", kind="perturbation", seeded=True)
class ViTCX(ViTPerturbationAttribution):
    r"""ViT-CX (Xie et al., IJCAI 2023): masks from the model's clustered patch
    embeddings, scored by their causal impact on the target probability.

    1. The patch rows of ``LN1(x_l)`` (the output of ``blocks[layer].norm1``; default the
       last block, the authors' ``model.blocks[-1].norm1``) give D maps, each resized to
       the image (bilinear) and min-max normalised.
    2. The maps are clustered: complete linkage on ``1 - cos`` (NaN similarity -> 0),
       ``distance_threshold`` 0.1, scikit-learn's ``AgglomerativeClustering`` as the
       authors (vaynexie/CausalX-ViT, CC0-1.0); each cluster's mask :math:`M_i` is the sum
       of its maps, min-max normalised.
    3. With noise :math:`\varepsilon_i \sim` ``noise`` :math:`\cdot\,\mathcal{N}(0, 1)` per
       pixel and channel of the model's input space, one draw per mask:

       .. math::
           s_i = p_c(X \odot M_i + \varepsilon_i \odot (1 - M_i))
                 - p_c(X + \varepsilon_i \odot (1 - M_i)) + p_c(X),

    4. :math:`S = \frac{1}{N_m} \sum_i s_i M_i / \sum_j M_j` per pixel (a pixel no mask
       covers gets 0), and the token map is the mean of :math:`S` over each patch.

    :math:`p_c` is the softmax probability (``score="logit"``: the logit). Repeatability:
    mask ``i``'s noise is drawn in float32 on the CPU from a generator seeded with
    ``seed * 1_000_003 + i`` (the same for every image, independent of the batch and the
    device), so seeded runs are bit-for-bit identical on a device and an image's map does
    not depend on its batch (up to the rounding of batched forwards).

    ``removal="tokens"`` (captum_vit extension): masks on the patch grid (no resize),
    thresholded at 0.5 and scored by true token removal without noise, so
    :math:`s_i = p_c(\text{kept}_i)` (the two last terms cancel); the map aggregates the
    soft masks as in step 4. This is the only form on a sub-network :math:`f_l` (PLUS /
    SkipPLUS, :mod:`captum_vit.combinators`), where ``removal=None`` resolves to it.

    Cost per image: one clean forward (features, :math:`p_c(X)`), then :math:`2 N_m`
    forwards (:math:`N_m` with ``noise=0`` or ``removal="tokens"``), ``batch_size`` per
    forward, and one clustering of D maps (a D × D distance matrix). :math:`N_m` depends
    on the image and the model. After each call :attr:`num_forwards` holds the number of
    model evaluations it ran and :attr:`num_masks` the :math:`N_m` of every image.

    Args:
        model (torch.nn.Module): a supported Vision Transformer.
        seed (int, optional): seed of the noise. Default 0.

    Attributes:
        num_forwards (int): model evaluations of the last ``attribute`` call (0 before).
        num_masks (list of int): :math:`N_m` per image of the last call.

    Examples::

        >>> from captum_vit import ViTCX
        >>> cx = ViTCX(model)
        >>> attr = cx.attribute(images, target=labels)
        >>> cx.num_masks, cx.num_forwards      # N_m per image, sum(2 N_m + 1)
        >>> grid = cx.attribute(images, layer=6, distance_threshold=0.2, output="grid")
    """

    def __init__(self, model: nn.Module, seed: int = 0) -> None:
        super().__init__(model)
        self.seed = check_scalar(seed, "seed", int, min_val=0, max_val=2**40)
        self.num_forwards = 0
        self.num_masks: list[int] = []

    @log_usage()
    @fill_doc
    def attribute(self, inputs: Tensor, target: TargetLike = None, *, layer: int | None = None,
                  distance_threshold: float = 0.1, noise: float = 0.1,
                  removal: str | None = None, score: str = "probability", batch_size: int = 50,
                  show_progress: bool = False, output: str = "pixels") -> Tensor:
        r"""
        Args:
            {inputs}
            target (int, list, Tensor, optional): class per image (or target embeddings
                for a model that outputs an embedding). ``None`` (default) explains the
                predicted class of each image.
            layer (int, optional): block ``l`` whose ``norm1`` output gives the feature
                maps, in ``[0, L-1]``. Default ``None`` = the last block.
            distance_threshold (float, optional): clusters are merged while their
                complete-linkage cosine distance is below it, in (0, 2]. Default 0.1.
            noise (float, optional): standard deviation of the Gaussian noise in the
                masked-out region (model input space), >= 0. Default 0.1. Unused with
                ``removal="tokens"``.
            removal (str, optional): ``"pixels"`` (default on a model) or ``"tokens"``
                (default on a sub-network, PLUS/SkipPLUS).
            score (str, optional): ``"probability"`` (default, the paper) or ``"logit"``.
            batch_size (int, optional): perturbed images (or sequences) per forward.
                Default 50 (the authors' ``gpu_batch``).
            show_progress (bool, optional): tqdm progress bar over the forwards. Default
                False.
            {output}

        Returns:
            Tensor: the saliency in the requested ``output`` format.

        Examples::

            >>> from captum_vit import ViTCX
            >>> attr = ViTCX(model).attribute(images, target=labels, batch_size=128,
            ...                               show_progress=True)
        """
        if layer is not None:
            check_scalar(layer, "layer", int)
        check_scalar(distance_threshold, "distance_threshold", float, min_val=0.0,
                     max_val=2.0, include_boundaries="right")
        check_scalar(noise, "noise", float, min_val=0.0)
        if removal is not None:
            check_choice("removal", removal, REMOVALS)
        check_choice("score", score, SCORES)
        check_scalar(batch_size, "batch_size", int, min_val=1)
        check_scalar(show_progress, "show_progress", bool)
        return self._attribute(inputs, target, output, layer=layer,
                               distance_threshold=distance_threshold, noise=noise,
                               removal=removal, score=score, batch_size=batch_size,
                               show_progress=show_progress)

    def _token_maps(self, inputs: Tensor, target: Tensor | None, *, layer: int | None = None,
                    distance_threshold: float = 0.1, noise: float = 0.1,
                    removal: str | None = None, score: str = "probability",
                    batch_size: int = 50, show_progress: bool = False, **_: Any) -> Tensor:
        adapter = self.adapter
        layout = adapter.layout(inputs)
        removal = resolve_removal(adapter, removal)
        L = adapter.num_blocks
        layer = check_layer("layer", L - 1 if layer is None else layer, L)
        b, k, dt = inputs.shape[0], layout.num_prefix, accumulation_dtype(inputs)
        with torch.no_grad():  # one clean forward, recording LN1(x_l)
            ops = FusedOps()
            x0 = adapter.embed(inputs)
            record: list = []
            h = adapter.block(adapter.run(x0, 0, layer, ops=ops), layer, ops, record)
            logits = adapter.run(h, layer + 1, ops=ops)
        features = record[0].u[:, k:]  # [B, P, D]
        t = resolve_target(target, logits)
        reduce = score_reduce(t, score, dt, adapter.probability)
        clean = target_scores(logits.to(dt), t, score, adapter.probability)  # p_c(X) [B]
        size = None if removal == "tokens" else (int(inputs.shape[-2]), int(inputs.shape[-1]))
        masks = [vitcx_masks(f, layout.grid, size, distance_threshold)[0] for f in features]
        self.num_masks = [len(m) for m in masks]
        if removal == "tokens":
            sal = self._token_scores(x0, masks, logits, reduce, batch_size, show_progress, dt)
        else:
            sal = self._pixel_scores(inputs, masks, clean, reduce, noise, batch_size,
                                     show_progress, dt, layout)
        full = sal.new_zeros(b, layout.num_tokens)  # prefix tokens are never scored
        full[:, k:] = sal
        return full

    def _pixel_scores(self, inputs: Tensor, masks: list[GridMasks], clean: Tensor,
                      reduce: Any, noise: float, batch_size: int, show_progress: bool,
                      dt: torch.dtype, layout: Any) -> Tensor:
        kinds = 2 if noise > 0 else 1  # masked (+ noise), and the noise-only image
        counts = torch.tensor([kinds * len(m) for m in masks])
        starts = torch.cumsum(counts, 0) - counts
        c, h, w = inputs.shape[1:]

        def noise_of(i: int) -> Tensor:
            g = torch.Generator().manual_seed(self.seed * NOISE_SEED_STRIDE + i)
            return torch.randn(c, h, w, generator=g) * noise

        def make(jobs: Tensor) -> tuple[Tensor, Tensor]:
            jobs = jobs.cpu()
            img = torch.searchsorted(starts, jobs, right=True) - 1
            i = (jobs - starts[img]) // kinds
            masked = ((jobs - starts[img]) % kinds == 0).to(inputs.device)
            m = inputs.new_empty(len(jobs), h, w)
            for bb in img.unique().tolist():  # each image's masks of the chunk, once
                sel = img == bb
                used, inv = torch.unique(i[sel], return_inverse=True)
                m[sel.to(inputs.device)] = masks[bb].materialize(
                    used, dt, inputs.device)[inv].to(inputs.dtype)
            owners = img.to(inputs.device)
            x = inputs[owners] * torch.where(masked[:, None, None], m, 1)[:, None]
            if kinds == 2:  # + eps_i (1 - M_i) on both images of mask i
                used, inv = torch.unique(i, return_inverse=True)
                eps = torch.stack([noise_of(int(u)) for u in used])[inv]
                x = x + eps.to(inputs.device, inputs.dtype) * (1 - m)[:, None]
            return x, owners

        values = image_logits(self.adapter, int(counts.sum()), make, batch_size=batch_size,
                              reduce=reduce, show_progress=show_progress, desc="ViT-CX",
                              device=inputs.device)
        self.num_forwards = len(masks) + int(counts.sum())
        maps = []
        for bb, mk in enumerate(masks):
            v = values[int(starts[bb]):int(starts[bb]) + int(counts[bb])].reshape(-1, kinds)
            s = v[:, 0] - v[:, 1] + clean[bb] if kinds == 2 else v[:, 0]  # causal score
            num = inputs.new_zeros(h, w, dtype=dt)
            cover = inputs.new_zeros(h, w, dtype=dt)
            for idx in mk.chunks(batch_size):
                m = mk.materialize(idx, dt, inputs.device)
                num += torch.einsum("n,nhw->hw", s[idx.to(s.device)], m)
                cover += m.sum(0)
            maps.append(torch.where(cover > 0, num / cover.clamp(min=torch.finfo(dt).tiny),
                                    0) / len(mk))
        return patch_means(torch.stack(maps), layout)

    def _token_scores(self, x0: Tensor, masks: list[GridMasks], logits: Tensor, reduce: Any,
                      batch_size: int, show_progress: bool, dt: torch.dtype) -> Tensor:
        p = x0.shape[1] - self.adapter.num_prefix
        soft = [m.materialize(torch.arange(len(m)), dt, x0.device).reshape(len(m), p)
                for m in masks]
        n_max = max(len(m) for m in soft)
        keep = torch.ones(len(soft), n_max, p, dtype=torch.bool, device=x0.device)
        for bb, m in enumerate(soft):  # padding rows keep every patch: no forward
            keep[bb, :len(m)] = m >= 0.5
        s = subset_logits(self.adapter, x0, keep, batch_size=batch_size, full_logits=logits,
                          reduce=reduce, show_progress=show_progress, desc="ViT-CX")
        self.num_forwards = len(soft) + subset_forwards(
            keep, self.adapter.num_prefix, reuse_full=True,
            pools_patches=pools_patches(self.adapter))
        out = []
        for bb, m in enumerate(soft):
            cover = m.sum(0)
            num = s[bb, :len(m)] @ m
            out.append(torch.where(cover > 0, num / cover.clamp(min=torch.finfo(dt).tiny), 0)
                       / len(m))
        return torch.stack(out)
