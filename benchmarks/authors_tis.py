"""The TIS authors' batch-1 algorithm, re-implemented for side-by-side timing.

The authors' code (Englebert et al., "Explaining through Transformer Input Sampling")
has no licence, so it is not vendored; this module rewrites its loop structure in our
own code so that a benchmark can time it against ``captum_vit.TIS`` on the same model:

* one image at a time (their ``TIS.__call__`` takes a batch of one);
* a full forward through timm's own modules collecting every block's output at the patch
  tokens (their forward hooks), stacked along the features;
* their KMeans in torch, per image: the one of ``fast_pytorch_kmeans`` (the library the
  authors call) with its defaults: ``n_masks`` distinct points drawn at random as the
  initial centroids, then Lloyd steps (euclidean, a one-hot matmul for the means, an
  empty cluster's centroid set to 0) until the squared centroid change is at most
  ``1e-4`` or after 100 iterations (:func:`authors_kmeans`);
* mask ``j`` keeps the ``floor(0.5 * P)`` patches where centroid ``j`` is largest;
* the masked forwards in chunks of ``batch_size`` masks: the image's tokens after the
  positional embedding, gathered per mask (prefix tokens always kept), through
  ``model.blocks``, ``model.norm`` and ``model.forward_head``;
* ``m_t = sum_j w_j M_tj / sum_j M_tj`` with ``w_j`` the softmax probability of the target.

Given the same masks, :func:`authors_tis` gives captum_vit's exact TIS map (checked by
``python benchmarks/authors_tis.py``; ``benchmarks/bench_authors.py`` imports it). Only
timm ``VisionTransformer`` models are supported, as in the authors' code.
"""

from __future__ import annotations

import argparse

import torch
from torch import Tensor, nn


def _tokens(model: nn.Module, image: Tensor) -> Tensor:
    """Tokens after the positional embedding (timm's own modules), [1, N, D]."""
    x = model._pos_embed(model.patch_embed(image))
    return model.norm_pre(model.patch_drop(x))


def authors_kmeans(columns: Tensor, n_clusters: int, *, seed: int = 0, max_iter: int = 100,
                   tol: float = 1e-4) -> Tensor:
    """Centroids [n_clusters, P] of the rows of ``columns`` [F, P], the way the authors'
    KMeans library (``fast_pytorch_kmeans.KMeans``, defaults) computes them.

    Args:
        columns (Tensor): the points, one per row.
        n_clusters (int): number of centroids.
        seed (int): seed of the random initial centroids.
        max_iter (int): most Lloyd iterations.
        tol (float): stop once the summed squared change of the centroids is at most this.

    Returns:
        Tensor: the centroids [n_clusters, P].
    """
    g = torch.Generator().manual_seed(seed)
    pick = torch.randperm(columns.shape[0], generator=g)[:n_clusters].to(columns.device)
    centroids = columns[pick]
    x_sq = (columns ** 2).sum(1)[:, None]
    clusters = torch.arange(n_clusters, device=columns.device)[:, None]
    for _ in range(max_iter):
        sim = 2 * columns @ centroids.T - x_sq - (centroids ** 2).sum(1)[None, :]
        closest = sim.argmax(-1)
        onehot = (closest[None, :] == clusters).to(columns.dtype)  # [K, F]
        new = onehot @ columns / onehot.sum(-1, keepdim=True)
        new = torch.nan_to_num(new, nan=0.0)  # an empty cluster's centroid becomes 0
        error = (new - centroids).pow(2).sum()
        centroids = new
        if error <= tol:
            break
    return centroids


def authors_masks(model: nn.Module, image: Tensor, n_masks: int, seed: int = 0,
                  ratio: float = 0.5) -> Tensor:
    """One image's masks [n_masks, P] (bool): block outputs, their KMeans, top patches."""
    k = model.num_prefix_tokens
    with torch.no_grad():
        h, columns = _tokens(model, image), []
        for blk in model.blocks:
            h = blk(h)
            columns.append(h[0, k:])  # [P, D] per block
        a = torch.cat(columns, dim=1)  # [P, L*D]
        centroids = authors_kmeans(a.T.contiguous(), min(n_masks, a.shape[1]), seed=seed)
    p = a.shape[0]
    top = centroids.topk(int(ratio * p), dim=-1).indices
    return torch.zeros(centroids.shape[0], p, dtype=torch.bool).scatter_(1, top.cpu(), True)


def authors_tis(model: nn.Module, x: Tensor, target: Tensor | list[int] | int, n_masks: int,
                seed: int = 0, *, masks: Tensor | None = None,
                batch_size: int = 128) -> Tensor:
    """TIS maps [B, P] computed image by image with the authors' loop structure.

    Args:
        model (nn.Module): a timm ``VisionTransformer`` in eval mode.
        x (Tensor): images [B, C, H, W].
        target (int, list or Tensor): class per image.
        n_masks (int): KMeans centroids per image (masks).
        seed (int): seed of the KMeans initialisation.
        masks (Tensor, optional): bool masks [n_masks, P] or [B, n_masks, P] used instead
            of the KMeans ones (to check the map against captum_vit on the same masks).
        batch_size (int): masks per forward.

    Returns:
        Tensor: the maps [B, P] (patch tokens only).
    """
    b = x.shape[0]
    targets = torch.as_tensor(target).reshape(-1).expand(b).tolist()
    k = model.num_prefix_tokens
    maps = []
    with torch.no_grad():
        for i in range(b):  # batch 1, as the authors' code
            image = x[i:i + 1]
            if masks is None:
                m = authors_masks(model, image, n_masks, seed)
            else:
                m = masks if masks.dim() == 2 else masks[i]
            tokens = _tokens(model, image)[0]  # [N, D]
            scores = []
            for chunk in m.split(batch_size):
                idx = chunk.nonzero()[:, 1].reshape(len(chunk), -1) + k  # same count per mask
                seqs = torch.cat([tokens[:k].expand(len(chunk), -1, -1), tokens[idx]], dim=1)
                logits = model.forward_head(model.norm(model.blocks(seqs)))
                scores.append(logits.softmax(-1)[:, targets[i]])
            w = torch.cat(scores)
            mf = m.to(w.dtype)
            maps.append((w @ mf) / mf.sum(0).clamp(min=1))
    return torch.stack(maps)


def main() -> None:
    """Check: on the same masks, the authors' loop gives captum_vit's exact TIS map."""
    from timm.models.vision_transformer import VisionTransformer

    from captum_vit import TIS

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--n-masks", type=int, default=32)
    ap.add_argument("--batch", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = VisionTransformer(img_size=112, patch_size=16, embed_dim=384, depth=12,
                              num_heads=6).double().eval()
    x = torch.randn(args.batch, 3, 112, 112, dtype=torch.float64)
    target = torch.arange(args.batch)
    masks = torch.stack([authors_masks(model, x[i:i + 1], args.n_masks) for i in range(len(x))])
    ours = TIS(model).attribute(x, target=target, masks=masks, output="tokens",
                                show_progress=False)
    theirs = authors_tis(model, x, target, args.n_masks, masks=masks)
    err = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    print(f"max relative difference, same masks (float64): {err:.2e}")
    if err > 1e-10:
        raise SystemExit("authors_tis differs from captum_vit's TIS on the same masks")


if __name__ == "__main__":
    main()
