"""DecompX's explicit route (time and peak memory) against its gradient route.

The speed of DecompX and of the PLUS / SkipPLUS / FullGrad+ fast paths relative to one
forward+backward is in ``benchmarks/speed.py``. The explicit route carries ``N + 1``
components of every hidden state, so it is timed on the ViT-S/16 architecture at a
smaller image size (``--explicit-img``, default 96 px = 37 tokens) and batch 1, once per
start block, against the gradient route (every start block from one backward) on that
model; its peak memory is the peak growth of the resident set during one call, sampled
in a fresh child process per case (run with glibc's default malloc thresholds so that
freed tensors leave the resident set)::

    python benchmarks/bench_decompx.py
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import threading
import time

import torch
from speed import vit_s16

from captum_vit.methods.decompx import DecompX, sources_per_chunk

MALLOC_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_growth(fn) -> float:
    """Peak growth of the resident set (MiB) while ``fn()`` runs, sampled every 0.5 ms."""
    base, peak, done = _rss_mib(), [0.0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_mib())
            time.sleep(5e-4)

    th = threading.Thread(target=sample)
    th.start()
    try:
        fn()
    finally:
        done.set()
        th.join()
    return max(peak[0], _rss_mib()) - base


def _explicit_child(img: int, start: int, route: str, max_memory, queue) -> None:
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", torch.get_num_threads())))
    model = vit_s16(img)
    x = torch.randn(1, 3, img, img, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([3])
    dx = DecompX(model, start_layer=start, route=route, max_memory=max_memory)
    dx.decompose(x, t)  # warm-up: one-off allocations, the adapter's self check
    t0 = time.perf_counter()
    growth = peak_rss_growth(lambda: dx.decompose(x, t))
    queue.put((time.perf_counter() - t0, growth))


def explicit(img: int, start: int, route: str, max_memory=None) -> tuple[float, float]:
    """Time and peak memory in a fresh process. The child runs with glibc's default
    malloc thresholds, so freed tensors leave the resident set and RSS follows the live
    tensors (with the benchmark's large thresholds freed memory stays resident)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    saved = {k: os.environ.pop(k) for k in MALLOC_VARS if k in os.environ}
    try:
        p = ctx.Process(target=_explicit_child, args=(img, start, route, max_memory, q))
        p.start()
    finally:
        os.environ.update(saved)
    out = q.get()
    p.join()
    return out


def explicit_table(img: int, starts: list[int]) -> None:
    n = (img // 16) ** 2 + 1
    print(f"\n## Explicit vs gradient route, ViT-S/16 at {img} px ({n} tokens), batch 1\n")
    print("| route | start block | max_memory | time (s) | peak RSS growth (MiB) |")
    print("|---|---|---|---|---|")
    total = 0.0
    for s in starts:
        sec, mib = explicit(img, s, "explicit")
        total += sec
        print(f"| explicit | {s} | None | {sec:.3f} | {mib:.0f} |")
    for mem in (64 << 20, 16 << 20):
        sec, mib = explicit(img, 0, "explicit", mem)
        print(f"| explicit | 0 | {mem >> 20} MiB | {sec:.3f} | {mib:.0f} |")
    grad, mib = explicit(img, 0, "gradient")
    print(f"| gradient (all start blocks at once) | 0..11 | - | {grad:.3f} | {mib:.0f} |")
    ad = DecompX(vit_s16(img)).adapter
    x0 = torch.zeros(1, n, 384)
    for mem in (None, 64 << 20, 16 << 20):
        print(f"sources per pass with max_memory={mem}: {sources_per_chunk(ad, x0, mem)} "
              f"of {n + 1}")
    if len(starts) == 12:
        print(f"\nexplicit route over every start block: {total:.2f} s; gradient route: "
              f"{grad:.3f} s; speed-up {total / grad:.0f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--explicit-img", type=int, default=96)
    ap.add_argument("--starts", type=int, nargs="+", default=list(range(12)))
    args = ap.parse_args()
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        print("note: MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ are not set")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    with torch.inference_mode(False):
        explicit_table(args.explicit_img, args.starts)


if __name__ == "__main__":
    main()
