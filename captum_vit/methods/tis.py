"""Transformer Input Sampling (Englebert et al., ICCV Workshops 2023). SPEC §5.

TIS explains a ViT by *removing* patch tokens instead of painting over pixels: the
model is run on the prefix tokens plus a subset of the patch tokens (each keeps its
positional embedding), so no replacement value is ever invented. The subsets come
from clustering the model's own features, and each patch's score is the mean score of
the subsets that contain it.

Steps, per image (paper Eq. 1-5, in the order SPEC §5 lists them):

1. ``A = [x_1[K:], x_2[K:], ..., x_L[K:]] in R^{P x L*D}``: every block's output at
   the P patch tokens, layers stacked along the features (no normalisation).
2. KMeans clusters the ``L*D`` COLUMNS of A (each column is a feature's map over the
   patches) into ``n_masks`` centroids ``K in R^{P x n_masks}``.
3. Mask ``j`` keeps the ``n_k = floor(ratio * P)`` patches with the largest values
   of centroid ``j`` (one set of masks per ratio, concatenated).
4. ``w_j`` = softmax probability (or logit) of the target when the model sees only
   the prefix tokens and the patch tokens kept by mask ``j``.
5. ``m_t = sum_j w_j M_tj / sum_j M_tj`` (score average over the masks that keep t).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from captum.log import log_usage
from torch import Tensor

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
from captum_vit.adapters import FusedOps, ViTAdapter, subset_logits

DEFAULT_RANDOM_STATE = 0
"""Seed used when ``random_state=None``: TIS maps are repeatable unless asked otherwise."""

KMEANS_THREADS = 2
"""Most OpenMP threads for scikit-learn's KMeans (never more than already allowed). Its
Lloyd step adds the per-thread partial centroid sums in whatever order the threads
finish; with at most two threads that order cannot change the floating-point result
(0 + a + b == 0 + b + a), so seeded runs are bit-for-bit repeatable for a given
thread count."""


# -- argument checks ---------------------------------------------------------------------
def check_ratios(ratio: float | Sequence[float], num_patches: int) -> list[float]:
    """``ratio`` as a non-empty list of floats in (0, 1) that each keep >= 1 patch."""
    ratios = list(ratio) if isinstance(ratio, list | tuple) else [ratio]
    if not ratios:
        raise ValueError("ratio must be a float in (0, 1) or a non-empty list of them")
    for r in ratios:
        check_scalar(r, "ratio", float, min_val=0.0, max_val=1.0, include_boundaries="neither")
        if int(r * num_patches) < 1:
            raise ValueError(f"ratio={r} keeps int({r} * {num_patches}) = 0 of the "
                             f"{num_patches} patches; use ratio >= {1 / num_patches:.3g}")
    return [float(r) for r in ratios]


def check_masks(masks: Any, batch: int, num_patches: int) -> Tensor:
    """Validate user masks: bool [M, P] (shared) or [B, M, P] (per image) -> [B|1, M, P]."""
    if not isinstance(masks, Tensor):
        raise TypeError(f"masks must be a torch.Tensor of dtype bool, got {type(masks).__name__}")
    if masks.dtype != torch.bool:
        raise TypeError(f"masks must have dtype torch.bool (True = patch kept), got "
                        f"{masks.dtype}; convert 0/1 masks with masks.bool()")
    if masks.dim() == 2:
        masks = masks[None]
    if masks.dim() != 3 or masks.shape[-1] != num_patches or masks.shape[1] == 0 \
            or masks.shape[0] not in (1, batch):
        raise ValueError(f"masks must have shape [n_masks, {num_patches}] or "
                         f"[{batch}, n_masks, {num_patches}] (n_masks >= 1, one column per "
                         f"patch), got {tuple(masks.shape)}")
    if not masks.any(-1).all():
        raise ValueError("every mask must keep at least one patch; masks has a row of "
                         "all False")
    return masks


# -- steps 1-3: masks from clustered features ------------------------------------------------
def layer_features(adapter: ViTAdapter, x0: Tensor) -> tuple[Tensor, Tensor]:
    """Step 1: every block's output at the patch tokens, stacked along features.

    Runs the blocks with fused attention (no attention matrices are kept).

    Args:
        adapter (ViTAdapter): the model's adapter.
        x0 (Tensor): embedding output [B, N, D].

    Returns:
        (A [B, P, L*D], logits [B, classes]) of the full sequence.
    """
    k, h, columns, ops = adapter.num_prefix, x0, [], FusedOps()
    with torch.no_grad():
        for l in range(adapter.num_blocks):
            h = adapter.block(h, l, ops)  # x_{l+1}
            columns.append(h[:, k:])
        logits = adapter.logits(h, ops)  # final norm, pooling and head
    return torch.cat(columns, dim=-1), logits


def kmeans_masks(features: Tensor, n_masks: int, ratios: Sequence[float],
                 random_state: int | None = None) -> Tensor:
    """Steps 2-3: binary masks from KMeans centroids of the feature columns.

    Args:
        features (Tensor): ``A`` per image, [B, P, F] (F = L*D columns).
        n_masks (int): centroids per image; clamped to F with a ``UserWarning``. With
            ``n_masks == F`` every column is its own centroid (KMeans' exact optimum,
            no clustering is run).
        ratios (list of float): fraction of patches each mask keeps; one set of
            ``n_masks`` masks per ratio, concatenated in this order.
        random_state (int, optional): KMeans seed (``None`` = ``DEFAULT_RANDOM_STATE``).
            Every image is clustered with the same seed, so an image gets the same masks
            in any batch.

    Returns:
        Tensor: bool masks [B, len(ratios) * n_masks, P] on the device of ``features``.
    """
    from sklearn.cluster import KMeans
    from threadpoolctl import ThreadpoolController

    b, p, f = features.shape
    if n_masks > f:
        warnings.warn(f"n_masks={n_masks} is more than the {f} feature columns KMeans can "
                      f"cluster (L*D); using n_masks={f}", UserWarning, stacklevel=2)
        n_masks = f
    seed = DEFAULT_RANDOM_STATE if random_state is None else random_state
    dt = torch.float64 if features.dtype == torch.float64 else torch.float32
    openmp = ThreadpoolController().select(user_api="openmp")
    threads = min([KMEANS_THREADS] + [lib.num_threads for lib in openmp.lib_controllers])
    masks = []
    for a in features.detach().to("cpu", dt):
        if n_masks == f:
            # As many centroids as columns: KMeans' optimum (zero inertia) is every column
            # its own centroid; step 5 does not depend on the order of the masks.
            centroids = a.T.contiguous()
        else:
            km = KMeans(n_clusters=n_masks, n_init=1, random_state=seed)
            with openmp.limit(limits=threads):
                km.fit(a.T.numpy())  # samples = the L*D columns of A, maps over P patches
            centroids = torch.from_numpy(km.cluster_centers_)  # K^T, [n_masks, P]
        per_ratio = []
        for r in ratios:
            top = centroids.topk(int(r * p), dim=-1).indices  # n_k = floor(ratio * P)
            per_ratio.append(torch.zeros(n_masks, p, dtype=torch.bool).scatter_(1, top, True))
        masks.append(torch.cat(per_ratio))
    return torch.stack(masks).to(features.device)


# -- step 4: scores of the token subsets -----------------------------------------------------
def mask_scores(adapter: ViTAdapter, x0: Tensor, target: Tensor, masks: Tensor, *,
                score: str = "probability", internal_batch_size: int | None = 128,
                show_progress: bool = False, full_logits: Tensor | None = None) -> Tensor:
    """Step 4: the target score with only the prefix and the kept patch tokens.

    Every (image, mask) pair is one shortened sequence, scored by the adapters' subset
    engine (:func:`~captum_vit.adapters.subsets.subset_logits`): sequences are batched
    across masks AND images, ``internal_batch_size`` per forward, grouped by length
    (masks keeping different numbers of patches share a forward, padded with key masks,
    only where that is cheaper).

    Args:
        adapter (ViTAdapter): the model's adapter.
        x0 (Tensor): embedding output [B, N, D] (tokens after the positional embedding).
        target (Tensor): class per image [B].
        masks (Tensor): bool [B or 1, M, P], True = patch kept; masks may keep different
            numbers of patches.
        score (str): ``"probability"`` (softmax of the target) or ``"logit"``.
        internal_batch_size (int, optional): sequences per forward; ``None`` = all.
        show_progress (bool): tqdm progress bar over the sequences.
        full_logits (Tensor, optional): logits [B, classes] of the full sequences; masks
            keeping every patch reuse them instead of a forward.

    Returns:
        Tensor: ``w`` [B, M], in the accumulation dtype of ``x0``.
    """
    scores = score_reduce(target.to(x0.device), score, accumulation_dtype(x0))
    return subset_logits(adapter, x0, masks.to(x0.device), batch_size=internal_batch_size,
                         full_logits=full_logits, reduce=scores, show_progress=show_progress,
                         desc="TIS")


# -- step 5: score average over covering masks ---------------------------------------------
def masks_to_map(scores: Tensor, masks: Tensor) -> Tensor:
    """Step 5: ``m_t = sum_j w_j M_tj / sum_j M_tj`` per image, [B, P].

    Coverage guard: a patch that no mask keeps has no score of its own; it gets the
    smallest score of the covered patches of its image (it ranks last, never NaN).
    """
    m = masks.to(scores.dtype).expand(scores.shape[0], -1, -1)  # [B, M, P]
    total = torch.einsum("bm,bmp->bp", scores, m)
    coverage = m.sum(1)
    covered = coverage > 0
    sal = total / coverage.clamp(min=1)
    if not covered.all():
        floor = sal.masked_fill(~covered, math.inf).amin(-1, keepdim=True)
        sal = torch.where(covered, sal, floor)
    return sal


class TIS(ViTPerturbationAttribution):
    r"""Transformer Input Sampling: the mean score of the token subsets keeping a patch.

    Masks come from the model's own features (SPEC §5): every block's output at the
    patch tokens forms :math:`A \in \mathbb{R}^{P \times LD}`; KMeans
    (scikit-learn, ``n_init=1``) groups its :math:`LD` columns into ``n_masks``
    centroids; mask :math:`j` keeps the :math:`\lfloor \text{ratio}\cdot P\rfloor`
    patches where centroid :math:`j` is largest. The model then runs on the prefix
    tokens plus the kept patch tokens only (true token removal: tokens are taken after
    the positional embedding, so each keeps its position), giving a score
    :math:`w_j`, and

    .. math::
        m_t = \frac{\sum_j w_j M_{tj}}{\sum_j M_{tj}}.

    Repeatability: ``random_state=None`` uses the fixed seed
    :data:`DEFAULT_RANDOM_STATE` (0), so two calls give bit-for-bit identical maps;
    pass other ints for other clusterings. Each image is clustered with the same seed,
    so an image's map does not depend on the rest of its batch.

    Coverage: a patch that no mask keeps gets the smallest score of its image's
    covered patches (never NaN). With KMeans masks and ``ratio=0.5`` this is rare.

    Costs ``len(ratio) * n_masks`` forwards of a shortened sequence per image plus
    one KMeans per image. No gradients.

    Args:
        model (torch.nn.Module): a supported Vision Transformer.
    """

    @log_usage()
    def attribute(self, inputs: Tensor, target: TargetLike = None, *, n_masks: int = 1024,
                  ratio: float | Sequence[float] = 0.5, score: str = "probability",
                  masks: Tensor | None = None, random_state: int | None = None,
                  internal_batch_size: int | None = 128, show_progress: bool = False,
                  output: str = "pixels") -> Tensor:
        r"""
        Args:
            inputs (Tensor): images [B, C, H, W] (or a 1-tuple holding them).
            target (int, list, Tensor, optional): class per image. ``None`` (default)
                explains the predicted class of each image (Captum's ``None`` means a
                scalar output; here it means "predicted").
            n_masks (int, optional): KMeans centroids (masks per ratio). Default 1024 as
                the paper; clamped to ``L*D`` (the number of clustered columns) with a
                ``UserWarning``.
            ratio (float or list of float, optional): fraction of the patches each mask
                keeps, in (0, 1). A list gives one set of ``n_masks`` masks per ratio,
                concatenated. Default 0.5.
            score (str, optional): ``"probability"`` (default, softmax of the target as
                the paper) or ``"logit"``.
            masks (Tensor, optional): bool masks (True = patch kept), [n_masks, P] for
                every image or [B, n_masks, P] per image (then ``inputs`` must hold
                exactly B images, so not under NoiseTunnel); skips the clustering, and
                ``n_masks``, ``ratio`` and ``random_state`` are then unused.
            random_state (int, optional): KMeans seed; ``None`` = 0 (repeatable).
            internal_batch_size (int, optional): shortened sequences per forward
                (across masks and images). Default 128; ``None`` = all in one forward.
            show_progress (bool, optional): tqdm progress bar. Default False.
            output (str, optional): ``"pixels"`` (default), ``"grid"`` or ``"tokens"``.

        Returns:
            Tensor: the map (scores are probabilities or logits, not normalised) in the
            requested ``output`` format.

        Examples::

            >>> from captum_vit import TIS
            >>> attr = TIS(model).attribute(images, target=labels, n_masks=256)
            >>> grid = TIS(model).attribute(images, ratio=[0.25, 0.5], output="grid",
            ...                             show_progress=True)
        """
        check_choice("score", score, SCORES)
        check_scalar(n_masks, "n_masks", int, min_val=1)
        if internal_batch_size is not None:
            check_scalar(internal_batch_size, "internal_batch_size", int, min_val=1)
        if random_state is not None and check_scalar(random_state, "random_state", int,
                                                     min_val=0) >= 2**32:
            raise ValueError(f"random_state must be < 2**32 (a KMeans seed), got {random_state}")
        check_scalar(show_progress, "show_progress", bool)
        return self._attribute(inputs, target, output, n_masks=n_masks, ratio=ratio,
                               score=score, masks=masks, random_state=random_state,
                               internal_batch_size=internal_batch_size,
                               show_progress=show_progress)

    def _token_maps(self, inputs: Tensor, target: Tensor | None, *, n_masks: int = 1024,
                    ratio: float | Sequence[float] = 0.5, score: str = "probability",
                    masks: Tensor | None = None, random_state: int | None = None,
                    internal_batch_size: int | None = 128, show_progress: bool = False,
                    **_: Any) -> Tensor:
        layout = self.adapter.layout(inputs)
        p, b = layout.num_patches, inputs.shape[0]
        ratios = check_ratios(ratio, p)
        if masks is not None:
            masks = check_masks(masks, b, p)
        with torch.no_grad():
            x0 = self.adapter.embed(inputs)  # tokens after the positional embedding
            if masks is None:
                features, logits = layer_features(self.adapter, x0)
                masks = kmeans_masks(features, n_masks, ratios, random_state)
            else:  # the full forward is only needed for target=None
                masks = masks.to(inputs.device)
                logits = self.adapter.run(x0, ops=FusedOps()) if target is None else None
        t = target.to(inputs.device) if logits is None else resolve_target(target, logits)
        w = mask_scores(self.adapter, x0, t, masks, score=score,
                        internal_batch_size=internal_batch_size, show_progress=show_progress,
                        full_logits=logits)
        sal = masks_to_map(w, masks)
        full = sal.new_zeros(b, layout.num_tokens)  # prefix tokens are never scored
        full[:, layout.num_prefix:] = sal
        return full
