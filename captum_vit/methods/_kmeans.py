"""Batched KMeans in torch: scikit-learn's algorithm for many data sets at once.

:func:`kmeans` clusters ``B`` independent data sets ``x [B, n, d]`` together: every step
is one batched tensor operation over the ``B`` sets (on the device of ``x``), instead of
one scikit-learn call per set. It follows :class:`sklearn.cluster.KMeans` with
``init="k-means++"``, ``n_init=1``, ``algorithm="lloyd"`` step by step:

1. the data are centred by their mean (scikit-learn does this for accurate distances;
   the mean is added back to the centres at the end);
2. **greedy k-means++** (scikit-learn's ``_kmeans_plusplus``): the first centre is drawn
   uniformly, every further one is the best of ``2 + int(log(k))`` candidates drawn with
   probability proportional to the squared distance to the closest centre so far (the
   one that leaves the least potential). The random numbers are those of
   ``numpy.random.RandomState(seed)`` in scikit-learn's order (one ``choice`` for the
   first centre, then ``uniform(size=n_local_trials)`` per centre), so with the same
   seed the same candidates are drawn;
3. **Lloyd iterations**: assign every point to its closest centre (the first on ties),
   move every centre to the mean of its points, relocate the centres of empty clusters to
   the points farthest from their centres (farthest first); stop a set when its labels
   no longer change ("strict convergence") or when the squared centre shift summed over
   the centres is at most ``tol`` times the mean per-feature variance of the set (then
   the labels are recomputed for the final centres), at most ``max_iter`` iterations.

The arithmetic is the same but the rounding is torch's, so centres agree with
scikit-learn's to rounding and the partitions agree unless a point lies (to rounding)
on the boundary of two clusters or a k-means++ draw falls (to rounding) on the boundary
of two candidates; the tests check the same partition on a fixed seed. The k-means++
distances are computed in float64; the Lloyd iterations in the dtype of ``x`` (as
scikit-learn does for float32 and float64 data).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor


def _sq_distances(c: Tensor, c_sq: Tensor, x: Tensor, x_sq: Tensor) -> Tensor:
    """Squared distances ``|c|² - 2 c·x + |x|²`` (clipped at 0) of rows ``c`` [B, m, d]
    to the points ``x`` [B, n, d], [B, m, n] (scikit-learn's ``euclidean_distances``)."""
    d = torch.baddbmm(c_sq[..., None], c, x.transpose(1, 2), alpha=-2.0)
    return (d + x_sq[:, None, :]).clamp_min_(0)


TIE_RTOL = 1e-10
"""Relative gap below which two k-means++ candidates' potentials count as equal
(:func:`first_minimum`): far above float64 rounding (~1e-16), far below any real gap."""


def first_minimum(values: Tensor, rtol: float = TIE_RTOL) -> Tensor:
    """Index of the first entry of each row within ``rtol`` (relative) of the row's
    minimum, [B, 1].

    numpy's ``argmin`` takes the first of EXACTLY equal values; on values equal in exact
    arithmetic but computed with different roundings (a batch of images against one image,
    another GEMM kernel, another thread count) it takes whichever rounded lower, so a
    k-means++ draw between two candidates that leave the same potential (a symmetry of the
    data: measured on a random CoCa tower, where it changed an image's TIS map by 1-10 %
    with its batch) depended on the batch. Counting values within ``rtol`` of the minimum
    as ties and taking the first of them makes the choice the same in any batch; it
    differs from scikit-learn's only where the two potentials agree to ``rtol``.

    Args:
        values (Tensor): [B, m] (float64 potentials).
        rtol (float): relative tie tolerance. Default :data:`TIE_RTOL`.

    Returns:
        Tensor: long [B, 1].

    Examples::

        >>> import torch
        >>> first_minimum(torch.tensor([[3.0, 1.0 + 1e-13, 1.0, 2.0]], dtype=torch.float64))
        tensor([[1]])
    """
    low = values.amin(-1, keepdim=True)
    tied = values <= low + rtol * low.abs()
    return tied.long().argmax(-1, keepdim=True)  # the first True (int64: every torch release)


def kmeans_plusplus(x: Tensor, n_clusters: int, seed: int = 0,
                    n_local_trials: int | None = None) -> Tensor:
    """Greedy k-means++ seeding of every set, scikit-learn's rule and random numbers.

    Args:
        x (Tensor): data [B, n, d] (scikit-learn seeds the centred data).
        n_clusters (int): centres per set, ``1 <= n_clusters <= n``.
        seed (int): ``numpy.random.RandomState`` seed, the same for every set.
        n_local_trials (int, optional): candidates per centre; ``None`` = ``2 +
            int(log(n_clusters))``.

    Returns:
        Tensor: indices [B, n_clusters] of the points chosen as centres, in order.
    """
    b, n, _ = x.shape
    trials = 2 + int(math.log(n_clusters)) if n_local_trials is None else n_local_trials
    rs = np.random.RandomState(seed)
    weight = np.ones(n, dtype=np.float64)
    first = int(rs.choice(n, p=weight / weight.sum()))
    uniforms = torch.from_numpy(rs.uniform(size=(max(n_clusters - 1, 0), trials))).to(x.device)
    xd = x.to(torch.float64)
    x_sq = (xd * xd).sum(-1)  # [B, n]
    rows = torch.arange(b, device=x.device)[:, None]
    chosen = torch.full((b, n_clusters), first, dtype=torch.long, device=x.device)
    closest = _sq_distances(xd[:, first:first + 1], x_sq[:, first:first + 1], xd, x_sq)[:, 0]
    pot = closest.sum(-1)  # [B]
    for c in range(1, n_clusters):
        draws = uniforms[c - 1][None] * pot[:, None]  # [B, trials]
        cand = torch.searchsorted(closest.cumsum(-1), draws).clamp_max_(n - 1)
        d = _sq_distances(xd[rows, cand], x_sq[rows, cand], xd, x_sq)  # [B, trials, n]
        d = torch.minimum(d, closest[:, None])
        pots = d.sum(-1)
        best = first_minimum(pots)
        pot = pots.gather(1, best)[:, 0]
        closest = d[rows[:, 0], best[:, 0]]
        chosen[:, c] = cand.gather(1, best)[:, 0]
    return chosen


def _relocate_empty(x: Tensor, sums: Tensor, counts: Tensor, labels: Tensor,
                    centers: Tensor) -> None:
    """scikit-learn's ``_relocate_empty_clusters_dense`` for one set, in place: each empty
    cluster takes one of the points farthest from their (old) centres, farthest first."""
    empty = (counts == 0).nonzero()[:, 0]
    far = ((x - centers[labels]) ** 2).sum(-1).topk(len(empty)).indices
    for e, i in zip(empty.tolist(), far.tolist(), strict=True):
        old = labels[i]
        sums[old] -= x[i]
        counts[old] -= 1
        sums[e] = x[i]
        counts[e] = 1


def _assign(x: Tensor, centers: Tensor) -> Tensor:
    """Label of the closest centre (first on ties) of every point, [B, n]."""
    c_sq = (centers * centers).sum(-1)
    return torch.baddbmm(c_sq[:, None, :], x, centers.transpose(1, 2), alpha=-2.0).argmin(-1)


def kmeans(x: Tensor, n_clusters: int, *, seed: int = 0, max_iter: int = 300,
           tol: float = 1e-4) -> tuple[Tensor, Tensor]:
    """Batched KMeans: scikit-learn's ``KMeans(n_clusters, n_init=1, random_state=seed)``
    on each of ``B`` sets at once (module docstring: greedy k-means++ seeding with
    scikit-learn's random numbers, then Lloyd iterations with its stopping rules).

    Args:
        x (Tensor): data [B, n, d]: ``B`` independent sets of ``n`` points.
        n_clusters (int): clusters per set, ``1 <= n_clusters <= n``.
        seed (int): seed of the k-means++ draws (scikit-learn's ``random_state``), the same
            for every set, so a set's clusters do not depend on the other sets.
        max_iter (int): most Lloyd iterations per set.
        tol (float): relative tolerance of the centre shift (scikit-learn's ``tol``).

    Returns:
        (centers [B, n_clusters, d], labels [B, n] int64).

    Examples::

        >>> centers, labels = kmeans(torch.randn(8, 4608, 49), 256, seed=0)
    """
    b, n, d = x.shape
    if not 1 <= n_clusters <= n:
        raise ValueError(f"n_clusters must be in [1, {n}] (the number of points), "
                         f"got {n_clusters}")
    x = x.detach()
    mean = x.mean(1, keepdim=True)
    xc = x - mean
    tols = xc.var(1, unbiased=False).mean(-1) * tol  # [B], scikit-learn's _tolerance
    rows = torch.arange(b, device=x.device)[:, None]
    centers = xc[rows, kmeans_plusplus(xc, n_clusters, seed)]
    labels = torch.full((b, n), -1, dtype=torch.long, device=x.device)
    active = torch.arange(b, device=x.device)
    strict = torch.zeros(b, dtype=torch.bool, device=x.device)
    for _ in range(max_iter):
        xa, old = xc[active], centers[active]
        new_labels = _assign(xa, old)
        flat = (new_labels + torch.arange(len(active), device=x.device)[:, None] * n_clusters)
        sums = xa.new_zeros(len(active) * n_clusters, d).index_add_(
            0, flat.flatten(), xa.reshape(-1, d)).view(len(active), n_clusters, d)
        counts = torch.bincount(flat.flatten(), minlength=len(active) * n_clusters
                                ).view(len(active), n_clusters).to(x.dtype)
        for i in (counts == 0).any(-1).nonzero()[:, 0].tolist():
            _relocate_empty(xa[i], sums[i], counts[i], new_labels[i], old[i])
        new = sums / counts[..., None]
        shift = ((new - old) ** 2).sum((-1, -2))
        same = (new_labels == labels[active]).all(-1)
        centers[active] = new
        labels[active] = new_labels
        strict[active] = same
        done = same | (shift <= tols[active])
        active = active[~done]
        if len(active) == 0:
            break
    loose = (~strict).nonzero()[:, 0]
    if len(loose):  # labels of the final centres (scikit-learn's last E-step)
        labels[loose] = _assign(xc[loose], centers[loose])
    return centers + mean, labels
