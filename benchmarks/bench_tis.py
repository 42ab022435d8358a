"""Speed of TIS against its lower bound (Englebert et al., ICCV Workshops 2023).

TIS costs one forward per (image, mask) of the SHORTENED sequence (prefix + kept patch
tokens) plus one KMeans per image. The lower bound timed here is exactly those forwards
through timm's own modules (``model.blocks``, ``model.norm``, ``model.forward_head``) on
token sequences gathered beforehand, in chunks of ``internal_batch_size``; KMeans is
timed separately. Everything is also expressed in units of one forward+backward
``torch.autograd.grad(model(x)[range(B), t].sum(), x)`` of the same model in the same run.

Columns: ``TIS`` = ``TIS.attribute`` (features, KMeans, scoring); ``KMeans`` = the
clustering alone; ``given`` = ``TIS.attribute(masks=...)`` with those masks (everything
but KMeans); ``bound`` = the unavoidable shortened-sequence forwards; ``img/s`` = B / TIS.

Run from the repository root (package installed, or ``PYTHONPATH=.``)::

    MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=4294967296 \\
        python benchmarks/bench_tis.py --n-masks 128 [--batches 1 8] [--repeat 3]

ViT-S/16 at 224 with the paper's n_masks=1024 is 1024 forwards of 99 tokens per image;
on a small CPU use a smaller ``--n-masks`` (the table header says which). On a CPU shared
with other jobs, ``OMP_NUM_THREADS=1`` gives steadier numbers (no OpenMP spinning).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from timm.models.vision_transformer import VisionTransformer

from captum_vit.methods.tis import TIS, kmeans_masks, layer_features


def _timed(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def lower_bound(model, x0: torch.Tensor, masks: torch.Tensor, chunk: int):
    """The forwards TIS cannot avoid: prefix + kept tokens, timm's own modules."""
    k = model.num_prefix_tokens
    b, m = x0.shape[0], masks.shape[1]
    seqs = []
    for i in range(b):
        for j in range(m):
            kept = masks[i, j].nonzero()[:, 0] + k
            seqs.append(torch.cat([x0[i, :k], x0[i, kept]]))
    seqs = torch.stack(seqs)  # [B*M, K+n_k, D], gathered outside the timed part

    def run():
        with torch.no_grad():
            for s in seqs.split(chunk):
                model.forward_head(model.norm(model.blocks(s)))
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n-masks", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--internal-batch-size", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()

    torch.manual_seed(0)
    model = VisionTransformer(img_size=224, patch_size=16, embed_dim=384, depth=12,
                              num_heads=6).eval()
    tis = TIS(model)
    adapter = tis.adapter
    ibs, m = args.internal_batch_size, args.n_masks
    env = {k: os.environ.get(k, "unset") for k in
           ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}
    print(f"TIS on ViT-S/16 (random timm VisionTransformer, 224px, float32, CPU, "
          f"{torch.get_num_threads()} threads), n_masks={m} (paper: 1024), ratio=0.5, "
          f"internal_batch_size={ibs}, best of {args.repeat}; {env}")
    head = (f"{'B':>2} | {'fwd+bwd s':>9} | {'TIS s':>8} | {'KMeans s':>8} | "
            f"{'given s':>8} | {'bound s':>8} | {'given/bound':>14} | "
            f"{'TIS/bound':>9} | {'TIS/fwd+bwd':>11} | {'img/s':>7}")
    print(head)
    print("-" * len(head))
    # warm-up: thread pools, allocator, sklearn import, TIS self-check
    xw = torch.randn(1, 3, 224, 224, requires_grad=True)
    torch.autograd.grad(model(xw)[:, 0].sum(), xw)
    tis.attribute(xw.detach(), target=0, n_masks=2, output="tokens")
    rate = {}
    for b in args.batches:
        x = torch.randn(b, 3, 224, 224)
        t = torch.randint(0, model.num_classes, (b,))
        xg = x.clone().requires_grad_()
        fb = _timed(lambda xg=xg, t=t, b=b: torch.autograd.grad(
            model(xg)[torch.arange(b), t].sum(), xg), args.repeat)

        with torch.no_grad():
            x0 = adapter.embed(x)
            feats, _ = layer_features(adapter, x0)
            masks = kmeans_masks(feats, m, [0.5])
        km = _timed(lambda feats=feats: kmeans_masks(feats, m, [0.5]), args.repeat)
        bound = _timed(lower_bound(model, x0, masks, ibs), args.repeat)
        given = _timed(lambda x=x, t=t, masks=masks: tis.attribute(
            x, target=t, masks=masks, internal_batch_size=ibs, output="tokens"), args.repeat)
        total = _timed(lambda x=x, t=t: tis.attribute(
            x, target=t, n_masks=m, internal_batch_size=ibs, output="tokens"), args.repeat)
        rate[b] = b / total
        print(f"{b:>2} | {fb:>9.3f} | {total:>8.2f} | {km:>8.2f} | {given:>8.2f} | "
              f"{bound:>8.2f} | {given / bound:>14.3f} | {total / bound:>9.3f} | "
              f"{total / fb:>11.1f} | {rate[b]:>7.3f}")
    if 1 in rate and len(rate) > 1:
        for b, r in rate.items():
            if b != 1:
                print(f"images/s at batch {b} vs batch 1: {r / rate[1]:.2f}x")


if __name__ == "__main__":
    main()
