"""Transformer Input Sampling (Englebert et al., ICCV Workshops 2023).

TIS explains a ViT by *removing* patch tokens instead of painting over pixels: the
model is run on the prefix tokens plus a subset of the patch tokens (each keeps its
positional embedding), so no replacement value is ever invented. The subsets come
from clustering the model's own features, and each patch's score is the mean score of
the subsets that contain it.

Steps, per image (paper Eq. 1-5):

1. ``A = [x_1[K:], x_2[K:], ..., x_L[K:]] in R^{P x L*D}``: every block's output at
   the P patch tokens, layers stacked along the features (no normalisation).
2. KMeans clusters the ``L*D`` COLUMNS of A (each column is a feature's map over the
   patches) into ``n_masks`` centroids ``K in R^{P x n_masks}`` (scikit-learn's
   algorithm, run for all images of the batch at once in torch: :mod:`._kmeans`).
3. Mask ``j`` keeps the ``n_k = floor(ratio * P)`` patches with the largest values
   of centroid ``j`` (one set of masks per ratio, concatenated).
4. ``w_j`` = softmax probability (or logit) of the target when the model sees only
   the prefix tokens and the patch tokens kept by mask ``j``.
5. ``m_t = sum_j w_j M_tj / sum_j M_tj`` (score average over the masks that keep t).

Anytime mode (not in the paper): step 4 in rounds of masks taken in a seeded random
order, stopping an image once the maps of the first and second half of its masks scored
so far agree (:func:`anytime_scores`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any, cast

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
from captum_vit.methods._front import fill_doc
from captum_vit.methods._kmeans import kmeans
from captum_vit.methods.table import register_method

DEFAULT_RANDOM_STATE = 0
"""Seed used when ``random_state=None``: TIS maps are repeatable unless asked otherwise."""

KMEANS = ("torch", "sklearn")
"""Clustering back-ends of step 2 (``kmeans=``): the batched torch KMeans of
:mod:`captum_vit.methods._kmeans` or one scikit-learn ``KMeans`` call per image."""

PROGRESS_DELAY = 2.0
"""Seconds of scoring after which ``show_progress=None`` shows its progress bar."""

DEFAULT_ROUND = 32
"""Masks per round of the anytime mode (``round_size`` default)."""

RIDGE = 10.0
r"""Ridge penalty :math:`\lambda` of the anytime mode's score surrogate
(:func:`complete_scores`). The Gram matrix of the centred 0/1 patch columns grows by about
``ratio * (1 - ratio)`` (1/4 at ``ratio=0.5``) per scored mask, so 10 weighs like some 40
masks: it matters while few masks are scored and fades as they accumulate. Chosen on the
exact scores of 1,024 masks per image (384 on the bundled model): 1 and 3 were within
0.01 Spearman of 10 on the random ViT-S/16 at 112 px, worse on the bundled model and at
224 px, in the same experiment as :func:`complete_scores`'s."""

KMEANS_THREADS = 2
"""Most OpenMP threads for scikit-learn's KMeans (never more than already allowed). Its
Lloyd step adds the per-thread partial centroid sums in whatever order the threads
finish; with at most two threads that order cannot change the floating-point result
(0 + a + b == 0 + b + a), so seeded runs are bit-for-bit repeatable for a given
thread count."""


# -- argument checks ---------------------------------------------------------------------
def check_ratios(ratio: float | Sequence[float], num_patches: int) -> list[float]:
    """``ratio`` as a non-empty list of floats in (0, 1) that each keep >= 1 patch."""
    ratios = list(ratio) if isinstance(ratio, list | tuple) else [cast(float, ratio)]
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
                 random_state: int | None = None, *, method: str = "torch") -> Tensor:
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
        method (str): ``"torch"`` (default): all images at once with
            :func:`captum_vit.methods._kmeans.kmeans` (scikit-learn's greedy k-means++
            seeding with its random numbers, ``n_init=1``, Lloyd iterations, on the
            device of ``features``); ``"sklearn"``: one
            ``sklearn.cluster.KMeans(n_init=1)`` call per image on the CPU. Both find
            the same clusters up to rounding (see :mod:`captum_vit.methods._kmeans`).

    Returns:
        Tensor: bool masks [B, len(ratios) * n_masks, P] on the device of ``features``.
    """
    check_choice("method", method, KMEANS)
    b, p, f = features.shape
    if n_masks > f:
        warnings.warn(f"n_masks={n_masks} is more than the {f} feature columns KMeans can "
                      f"cluster (L*D); using n_masks={f}", UserWarning, stacklevel=2)
        n_masks = f
    seed = DEFAULT_RANDOM_STATE if random_state is None else random_state
    dt = torch.float64 if features.dtype == torch.float64 else torch.float32
    columns = features.detach().to(dtype=dt).transpose(1, 2)  # samples = the L*D columns
    if n_masks == f:
        # As many centroids as columns: KMeans' optimum (zero inertia) is every column
        # its own centroid; step 5 does not depend on the order of the masks.
        centroids = columns.contiguous()
    elif method == "torch":
        centroids = kmeans(columns, n_masks, seed=seed)[0]  # K^T, [B, n_masks, P]
    else:
        centroids = torch.stack([_sklearn_centroids(a, n_masks, seed) for a in columns.cpu()])
    per_ratio = []
    for r in ratios:
        top = centroids.topk(int(r * p), dim=-1).indices  # n_k = floor(ratio * P)
        per_ratio.append(torch.zeros(b, n_masks, p, dtype=torch.bool,
                                     device=top.device).scatter_(2, top, True))
    return torch.cat(per_ratio, dim=1).to(features.device)


def _sklearn_centroids(columns: Tensor, n_masks: int, seed: int) -> Tensor:
    """scikit-learn's KMeans centroids [n_masks, P] of one image's columns [L*D, P]."""
    from sklearn.cluster import KMeans
    from threadpoolctl import ThreadpoolController

    openmp = ThreadpoolController().select(user_api="openmp")
    threads = min([KMEANS_THREADS] + [lib.num_threads for lib in openmp.lib_controllers])
    km = KMeans(n_clusters=n_masks, n_init=1, random_state=seed)
    with openmp.limit(limits=threads):
        km.fit(columns.numpy())
    return torch.from_numpy(km.cluster_centers_)


# -- step 4: scores of the token subsets -----------------------------------------------------
def mask_scores(adapter: ViTAdapter, x0: Tensor, target: Tensor, masks: Tensor, *,
                score: str = "probability", internal_batch_size: int | None = 128,
                show_progress: bool = False, full_logits: Tensor | None = None,
                progress_delay: float = 0.0, share_first_block: bool = True) -> Tensor:
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
        progress_delay (float): seconds before the progress bar appears.
        share_first_block (bool): compute the first block's token-wise work (``LN1``,
            ``q``, ``k``, ``v``) once per image and gather it per mask (default); ``False``
            recomputes it for every shortened sequence (same scores).

    Returns:
        Tensor: ``w`` [B, M], in the accumulation dtype of ``x0``.
    """
    scores = score_reduce(target.to(x0.device), score, accumulation_dtype(x0),
                          adapter.probability)
    return subset_logits(adapter, x0, masks.to(x0.device), batch_size=internal_batch_size,
                         full_logits=full_logits, reduce=scores, show_progress=show_progress,
                         desc="TIS", progress_delay=progress_delay,
                         share_first_block=share_first_block)


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


# -- anytime mode: step 4 in rounds, stopped when the map has converged ----------------------
def spearman(a: Tensor, b: Tensor) -> Tensor:
    """Spearman rank correlation of the rows of ``a`` and ``b`` [B, P] (ties get their
    average rank), [B]; 1 for two constant rows, 0 for one constant row."""
    def ranks(x: Tensor) -> Tensor:  # average ranks, O(P^2) comparisons per row
        below = (x[:, None, :] < x[:, :, None]).sum(-1)
        ties = (x[:, None, :] == x[:, :, None]).sum(-1)
        return (below + (ties - 1) / 2).to(torch.float64)

    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(-1, keepdim=True), rb - rb.mean(-1, keepdim=True)
    na, nb = ra.norm(dim=-1), rb.norm(dim=-1)
    rho = (ra * rb).sum(-1) / (na * nb).clamp_min(torch.finfo(torch.float64).tiny)
    return torch.where((na == 0) & (nb == 0), torch.ones_like(rho), rho)


def converged_correlation(rho: Tensor) -> Tensor:
    r"""Estimated rank correlation between a map and its limit with unlimited masks,
    from the Spearman correlation :math:`\rho` of the maps of two halves of its masks:
    :math:`\sqrt{2\rho / (1 + \rho)}` (0 for :math:`\rho \le 0`).

    The map is a mean over random masks, so its two halves are two independent,
    equally reliable maps: :math:`\rho` estimates the reliability of a half;
    Spearman-Brown's prophecy :math:`2\rho/(1+\rho)` that of the whole map (its
    correlation with a second independent map of as many masks), and the square root its
    correlation with the limit (classical test theory). Measured on a random ViT-S/16
    (112 px, 1,024 masks): split-half :math:`\rho` 0.78-0.80 at 384 masks gives 0.94,
    while the 384-mask map's Spearman against the 1,024-mask map was 0.95-0.98.

    Examples::

        >>> import torch
        >>> from captum_vit.methods.tis import converged_correlation
        >>> converged_correlation(torch.tensor([0.0, 0.8, 1.0]))
        tensor([0.0000, 0.9428, 1.0000])
    """
    rho = rho.clamp(min=0)
    return (2 * rho / (1 + rho)).sqrt()


def complete_scores(w: Tensor, masks: Tensor, used: Tensor, *, ridge: float = RIDGE) -> Tensor:
    r"""The scores of the masks not scored, predicted from those that were (anytime mode).

    Per image, a ridge regression of the scored masks' scores on the patches they keep,
    :math:`w_j \approx \beta_0 + \sum_t \beta_t M_{jt}` (centred columns, penalty
    ``ridge`` on :math:`\beta`, none on :math:`\beta_0`), predicts the score of every
    mask not scored; the scored ones keep their own. :func:`masks_to_map` of the result
    then estimates the exact map of all the masks (the masks are all known after the
    clustering; only their scores cost forwards). A score that is additive in the kept
    patches is predicted exactly, and a random ViT-S/16 (112 px) is close to that: on 8
    random images and 3 random mask orders, the map completed from the first 128 of 1,024
    masks had mean Spearman 0.96 against the exact map (λ from 1 to 10), the map of those
    128 masks alone 0.86 (an experiment on the exact scores, not a shipped benchmark;
    ``benchmarks/bench_tis_anytime.py`` measures the anytime mode itself).

    Args:
        w (Tensor): scores [B, M] (any value where ``used`` is False).
        masks (Tensor): bool masks [B or 1, M, P].
        used (Tensor): bool [B, M], the masks scored; each image needs at least one.
        ridge (float): the penalty :math:`\lambda` (:data:`RIDGE`).

    Returns:
        Tensor: [B, M] in ``w``'s dtype: ``w`` where ``used``, the predictions elsewhere.

    Examples::

        >>> import torch
        >>> from captum_vit.methods.tis import complete_scores
        >>> masks = torch.rand(1, 64, 9) < 0.5
        >>> w = masks[0].double() @ torch.arange(9.0, dtype=torch.float64)  # additive
        >>> used = torch.arange(64) < 40
        >>> filled = complete_scores(w[None] * used, masks, used[None], ridge=1e-9)
        >>> torch.allclose(filled, w[None])
        True
    """
    dt = torch.float64
    x = masks.to(dt).expand(w.shape[0], -1, -1)  # [B, M, P]
    u = used.to(dt)
    count = u.sum(1, keepdim=True)  # [B, 1]
    x_mean = torch.einsum("bm,bmp->bp", u, x) / count  # [B, P]
    y_mean = (w.to(dt) * u).sum(1, keepdim=True) / count  # [B, 1]
    xc = x - x_mean[:, None]
    xu = xc * u[..., None]  # the scored rows only
    gram = xu.transpose(1, 2) @ xc  # [B, P, P]
    gram.diagonal(dim1=1, dim2=2).add_(ridge)
    rhs = torch.einsum("bmp,bm->bp", xu, w.to(dt) - y_mean)
    beta = torch.linalg.solve(gram, rhs[..., None])[..., 0]
    pred = y_mean + torch.einsum("bmp,bp->bm", xc, beta)
    return torch.where(used, w, pred.to(w.dtype))


def half_map(w: Tensor, masks: Tensor, cols: Tensor, surrogate: bool) -> Tensor:
    """The map of the masks ``cols`` of every image: completed over all masks
    (:func:`complete_scores`) with ``surrogate``, else over those masks only, [B, P]."""
    if not surrogate:
        return masks_to_map(w[:, cols], masks[:, cols])
    used = torch.zeros(w.shape, dtype=torch.bool, device=w.device)
    used[:, cols] = True
    return masks_to_map(complete_scores(w, masks, used), masks)


def anytime_scores(adapter: ViTAdapter, x0: Tensor, target: Tensor, masks: Tensor, *,
                   tolerance: float, order: Tensor, round_size: int = DEFAULT_ROUND,
                   surrogate: bool = True, show_progress: bool = False,
                   progress_delay: float = 0.0, **scoring: Any) -> tuple[Tensor, Tensor]:
    """Step 4 in rounds until each image's map has converged (the anytime mode).

    The masks are scored in the order ``order``, ``round_size`` more per round for every
    image not yet converged (the rounds of all these images share the forwards). From the
    second round on, an image holding ``m`` scored masks has converged when the Spearman
    rank correlation (:func:`spearman`) :math:`\rho` between the map of its first
    ``m // 2`` masks and the map of the other ``m - m // 2``, corrected to the whole
    map's estimated correlation with its limit (:func:`converged_correlation`), is at
    least ``tolerance``; it is then scored no further. With ``surrogate=True`` each
    half's map is the map of ALL the masks with the scores the half did not measure
    predicted from those it did (:func:`complete_scores`), as the returned map will be;
    with ``False`` it is :func:`masks_to_map` over the half's masks only. Every image stops
    on its own, so its map does not depend on the rest of the batch. ``tolerance >= 1``
    never stops early.

    Args:
        adapter, x0, target, masks: as in :func:`mask_scores` (masks [B or 1, M, P]).
        tolerance (float): the estimated correlation with the converged map that stops
            an image, in (0, 1].
        order (Tensor): a permutation of the M masks [M]: the order they are scored in.
        round_size (int): masks per round and image.
        surrogate (bool): judge convergence on completed maps (see above).
        show_progress (bool): one tqdm bar over the masks of all images.
        progress_delay (float): seconds before the bar appears.
        **scoring: ``score``, ``internal_batch_size``, ``full_logits`` and
            ``share_first_block`` of :func:`mask_scores`.

    Returns:
        (w [B, M] with 0 for the masks not scored, used [B, M] bool: the masks scored).
    """
    from tqdm.auto import tqdm

    b, m = x0.shape[0], masks.shape[1]
    masks = masks.to(x0.device).expand(b, -1, -1)
    order = order.to(x0.device)
    full_logits = scoring.pop("full_logits", None)
    w = torch.zeros(b, m, dtype=accumulation_dtype(x0), device=x0.device)
    used = torch.zeros(b, m, dtype=torch.bool, device=x0.device)
    active = torch.arange(b, device=x0.device)
    with tqdm(total=b * m, desc="TIS", unit="seq", delay=progress_delay,
              disable=not show_progress) as bar:
        for lo in range(0, m, round_size):
            cols = order[lo:lo + round_size]
            sub = masks[active][:, cols]
            w[active[:, None], cols] = mask_scores(
                adapter, x0[active], target[active], sub,
                full_logits=None if full_logits is None else full_logits[active], **scoring)
            used[active[:, None], cols] = True
            bar.update(len(active) * len(cols))
            seen = lo + len(cols)
            if tolerance >= 1 or seen == m or seen < 2 * round_size:
                continue
            halves = [order[:seen // 2], order[seen // 2:seen]]
            first, second = (half_map(w[active], masks[active], h, surrogate) for h in halves)
            converged = converged_correlation(spearman(first, second)) >= tolerance
            bar.total -= int(converged.sum()) * (m - seen)
            active = active[~converged]
            if len(active) == 0:
                break
    return w, used


@register_method("tis", kind="perturbation", quick={"n_masks": 128})
class TIS(ViTPerturbationAttribution):
    r"""Transformer Input Sampling: the mean score of the token subsets keeping a patch.

    Masks come from the model's own features (paper Eq. 1-5): every block's output at the
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

    Cost: ``len(ratio) * n_masks`` forwards of a shortened sequence (the prefix plus
    ``floor(ratio * P)`` patch tokens) per image, plus one forward of the full sequence
    and one KMeans of ``L*D`` points into ``n_masks`` clusters per image; no gradients.
    At the default 1,024 masks that was about 17 s per 224-px image for a ViT-S/16 on 2
    CPU threads (``benchmarks/bench_tis_anytime.py``). The shortened sequences of all masks AND
    images are batched together (``internal_batch_size`` per forward), and the first
    block's token-wise work (``LN1`` and the ``q``, ``k``, ``v`` projections) is
    computed once per image and gathered per mask.

    Anytime mode (``tolerance=``, not in the paper): the masks are scored in rounds of
    ``round_size`` (default 32) per image, in a random order drawn from
    ``random_state``. The masks themselves are all known after the clustering; only
    their scores cost forwards, so the scores not yet measured are predicted from those
    that were, by a ridge regression of the scores on the patches each mask keeps
    (``surrogate=True``, default; :func:`complete_scores`), and the map averages over all
    the masks as the exact map does. From the second round on, an image stops once the
    estimated rank correlation of its map with the map of unlimited masks is
    ``>= tolerance``: the Spearman correlation :math:`\rho` of the (completed) maps of
    the first and second half of its masks scored so far, corrected by Spearman-Brown
    and a square root, :math:`\sqrt{2\rho/(1+\rho)}` (:func:`converged_correlation`).
    Each image stops on its own, so its map does not depend on the batch. The number of
    masks each image used is in :attr:`last_masks_used` after the call.
    ``tolerance=1.0`` never stops early and equals the exact algorithm;
    ``tolerance=None`` (default) is the exact algorithm in one pass. Measured with
    ``tolerance=0.95`` (``benchmarks/bench_tis_anytime.py``): see the documentation's
    Benchmarks page ("TIS anytime mode") for masks used and Spearman against the exact map.

    Clustering: ``kmeans="torch"`` (default) clusters all images of the batch at once
    with scikit-learn's algorithm written in torch (greedy k-means++ seeding with
    scikit-learn's random numbers for the seed, ``n_init=1``, Lloyd iterations;
    :mod:`captum_vit.methods._kmeans`); ``kmeans="sklearn"`` calls
    ``sklearn.cluster.KMeans(n_init=1)`` per image. They give the same clusters up to
    floating-point rounding.

    Args:
        model (torch.nn.Module): a supported Vision Transformer.

    Attributes:
        last_masks_used (Tensor or None): masks scored per image [B] (int64) by the
            last call (``len(ratio) * n_masks`` each unless ``tolerance`` stopped early);
            under NoiseTunnel, those of its last internal call.
    """

    last_masks_used: Tensor | None = None
    removes_tokens = True  # token subsets: windowed models refuse TIS by name

    @log_usage()
    @fill_doc
    def attribute(self, inputs: Tensor, target: TargetLike = None, *, n_masks: int = 1024,
                  ratio: float | Sequence[float] = 0.5, score: str = "probability",
                  masks: Tensor | None = None, random_state: int | None = None,
                  internal_batch_size: int | None = 128, show_progress: bool | None = None,
                  tolerance: float | None = None, round_size: int = DEFAULT_ROUND,
                  surrogate: bool = True, kmeans: str = "torch",
                  output: str = "pixels") -> Tensor:
        r"""
        Args:
            {inputs}
            {target}
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
            show_progress (bool, optional): tqdm progress bar over the shortened
                sequences. ``None`` (default): shown once the scoring has run
                :data:`PROGRESS_DELAY` (2) seconds, so only for long runs; ``True``:
                always; ``False``: never.
            tolerance (float, optional): anytime mode: stop an image once its map's
                estimated rank correlation with the converged map
                (:func:`converged_correlation` of the split-half Spearman correlation) is
                ``>= tolerance`` (in (0, 1]; e.g. 0.95). ``None`` (default):
                every mask is scored. Masks used: :attr:`last_masks_used`.
            round_size (int, optional): masks per image and round of the anytime mode
                (default 32); convergence is first checked after two rounds.
            surrogate (bool, optional): anytime mode: predict the scores of the masks
                an image did not score from those it did (a ridge regression on the
                patches each mask keeps, :func:`complete_scores`) and average over all
                the masks (default ``True``); ``False`` averages over the scored masks
                only (stops later). Unused without ``tolerance``.
            kmeans (str, optional): ``"torch"`` (default, batched) or ``"sklearn"``.
            {output}

        Returns:
            Tensor: the map (scores are probabilities or logits, not normalised) in the
            requested ``output`` format.

        Examples::

            >>> from captum_vit import TIS
            >>> attr = TIS(model).attribute(images, target=labels, n_masks=256)
            >>> grid = TIS(model).attribute(images, ratio=[0.25, 0.5], output="grid",
            ...                             show_progress=True)
            >>> tis = TIS(model)
            >>> quick = tis.attribute(images, target=labels, tolerance=0.95)
            >>> tis.last_masks_used        # e.g. tensor([256, 192])
        """
        check_choice("score", score, SCORES)
        check_scalar(n_masks, "n_masks", int, min_val=1)
        if internal_batch_size is not None:
            check_scalar(internal_batch_size, "internal_batch_size", int, min_val=1)
        if random_state is not None and check_scalar(random_state, "random_state", int,
                                                     min_val=0) >= 2**32:
            raise ValueError(f"random_state must be < 2**32 (a KMeans seed), got {random_state}")
        if show_progress is not None:
            check_scalar(show_progress, "show_progress", bool)
        if tolerance is not None:
            check_scalar(tolerance, "tolerance", float, min_val=0.0, max_val=1.0,
                         include_boundaries="right")
        check_scalar(round_size, "round_size", int, min_val=1)
        check_scalar(surrogate, "surrogate", bool)
        check_choice("kmeans", kmeans, KMEANS)
        return self._attribute(inputs, target, output, n_masks=n_masks, ratio=ratio,
                               score=score, masks=masks, random_state=random_state,
                               internal_batch_size=internal_batch_size,
                               show_progress=show_progress, tolerance=tolerance,
                               round_size=round_size, surrogate=surrogate, kmeans=kmeans)

    def _token_maps(self, inputs: Tensor, target: Tensor | None, *, n_masks: int = 1024,
                    ratio: float | Sequence[float] = 0.5, score: str = "probability",
                    masks: Tensor | None = None, random_state: int | None = None,
                    internal_batch_size: int | None = 128, show_progress: bool | None = None,
                    tolerance: float | None = None, round_size: int = DEFAULT_ROUND,
                    surrogate: bool = True, kmeans: str = "torch", **_: Any) -> Tensor:
        self.adapter.check_token_removal()  # token-row targets refuse (windowed: the front)
        layout = self.adapter.layout(inputs)
        p, b = layout.num_patches, inputs.shape[0]
        ratios = check_ratios(ratio, p)
        if masks is not None:
            masks = check_masks(masks, b, p)
        with torch.no_grad():
            x0 = self.adapter.embed(inputs)  # tokens after the positional embedding
            logits: Tensor | None
            if masks is None:
                features, logits = layer_features(self.adapter, x0)
                masks = kmeans_masks(features, n_masks, ratios, random_state, method=kmeans)
            else:  # the full forward is only needed for target=None
                masks = masks.to(inputs.device)
                logits = self.adapter.run(x0, ops=FusedOps()) if target is None else None
        # no logits: a target was given
        t = cast(Tensor, target).to(inputs.device) if logits is None else resolve_target(
            target, logits)
        progress: dict[str, Any] = {"show_progress": show_progress is not False,
                    "progress_delay": PROGRESS_DELAY if show_progress is None else 0.0}
        if tolerance is None:
            w = mask_scores(self.adapter, x0, t, masks, score=score,
                            internal_batch_size=internal_batch_size, full_logits=logits,
                            **progress)
            self.last_masks_used = torch.full((b,), masks.shape[1], dtype=torch.long)
        else:
            seed = DEFAULT_RANDOM_STATE if random_state is None else random_state
            order = torch.randperm(masks.shape[1], generator=torch.Generator().manual_seed(seed))
            w, used = anytime_scores(self.adapter, x0, t, masks, tolerance=tolerance,
                                     order=order, round_size=round_size,
                                     surrogate=surrogate, score=score,
                                     internal_batch_size=internal_batch_size,
                                     full_logits=logits, **progress)
            if used.all():  # nothing stopped early: the exact map, bit for bit
                pass
            elif surrogate:  # the scores not measured, predicted
                w = complete_scores(w, masks, used)
            else:  # the masks not scored count for nothing
                masks = masks & used[..., None]
            self.last_masks_used = used.sum(-1).cpu()
        sal = masks_to_map(w, masks)
        full = sal.new_zeros(b, layout.num_tokens)  # prefix tokens are never scored
        full[:, layout.num_prefix:] = sal
        return full
