"""Cost of a 20-step deletion curve relative to one forward pass of the same model.

Run::

    MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=4294967296 \
        python benchmarks/bench_metrics.py [--batches 1 8] [--repeats 3]

A 20-step deletion curve evaluates 21 removal levels per image (k = 0, 0.05, ..., 1) plus
one clean forward for the prediction; maps are precomputed (random patch scores), so only
the metric is timed. True token masking (``removal="token"``) runs shorter sequences (on
average about half the tokens) through the adapters' subset engine
(``captum_vit.adapters.subsets``: jobs grouped by length with a cost model, the level
k = 0 free when the metric hands its clean logits to ``RemovalEngine.logits(full_logits=)``);
pixel baselines run full images. References measured in
the same run on a ViT-S/16-sized random timm model (224 px, width 384, 12 blocks, 6 heads,
float32): one forward ``model(x)`` under ``no_grad`` and one forward+backward
``torch.autograd.grad(model(x)[range(B), t].sum(), x)``, at the same batch size, so the
ratios are per image too. Timings on a shared VM drift; compare ratios of one run only.
"""

from __future__ import annotations

import argparse
import os

import torch
from speed import forward, forward_backward, timeit, vit_s16

from captum_vit.metrics import deletion


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--removals", nargs="+", default=["token", "black", "blur"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="torch threads (1 gives steadier ratios on a shared machine)")
    args = ap.parse_args()
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        print("warning: MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ not set (see docstring)")
    torch.set_num_threads(args.threads)
    model = vit_s16()
    rows = []
    for b in args.batches:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(b, 3, 224, 224, generator=g)
        t = torch.arange(b) % 1000
        maps = torch.rand(b, 196, generator=g)
        fwd = timeit(lambda x=x: forward(model, x), args.repeats)
        fb = timeit(lambda x=x, t=t: forward_backward(model, x, t), args.repeats)
        rows.append((b, "forward (no_grad)", fwd, fwd, fb))
        rows.append((b, "forward+backward", fb, fwd, fb))
        for r in args.removals:
            sec = timeit(lambda x=x, maps=maps, r=r: deletion(
                model, x, maps, n_steps=args.steps, removal=r, forward_batch=64), args.repeats)
            rows.append((b, f"deletion {args.steps} steps, removal={r}", sec, fwd, fb))
    print(f"\ntorch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"ViT-S/16 float32, median of {args.repeats}")
    print("| batch | case | ms/call | ms/image | × forward | × fwd+bwd |")
    print("|---:|---|---:|---:|---:|---:|")
    for b, name, sec, fwd, fb in rows:
        print(f"| {b} | {name} | {1e3 * sec:.1f} | {1e3 * sec / b:.1f} | {sec / fwd:.2f} | "
              f"{sec / fb:.2f} |")


if __name__ == "__main__":
    main()
