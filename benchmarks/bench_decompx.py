"""Speed of DecompX and the PLUS / SkipPLUS / FullGrad+ combinators.

Each case alternates with one forward + backward of the same model
``--repeat`` times after one warm-up of both; the table gives the median times and
the median of the per-pair ratios (alternating keeps drifting load on a shared machine
from biasing the ratio). The reference is
``torch.autograd.grad(model(x)[range(B), t].sum(), x)``. Model: a ViT-S/16-sized
random timm ``VisionTransformer`` (224 px, width 384, 12 blocks, 6 heads), float32.

The explicit DecompX route carries ``N + 1`` components of every hidden state, so it
is timed on the same architecture at a smaller image size (``--explicit-img``, default
96 px = 37 tokens) and batch 1, once per start block, against the gradient route on
that model; its peak memory is the peak growth of the resident set during one call,
sampled in a fresh child process per case (run with glibc's default malloc thresholds
so that freed tensors leave the resident set).

Run with ``MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=4294967296``:

    python benchmarks/bench_decompx.py
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import threading
import time

import torch
from timm.models.vision_transformer import VisionTransformer

from captum_vit.combinators import PLUS, FullGradPlus, SkipPLUS
from captum_vit.methods.decompx import DecompX, sources_per_chunk

MALLOC_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def vit_s(img_size: int = 224) -> torch.nn.Module:
    torch.manual_seed(0)
    return VisionTransformer(img_size=img_size, patch_size=16, embed_dim=384, depth=12,
                             num_heads=6).eval()


def median_time(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fwd_bwd(model, x, t):
    def run():
        xi = x.detach().requires_grad_()
        torch.autograd.grad(model(xi)[torch.arange(len(t)), t].sum(), xi)
    return run


def paired(ref, fn, repeat: int) -> tuple[float, float, float]:
    """Median times of ``ref`` and ``fn`` and the median of their per-pair ratios; the
    two alternate so that load drifting on a shared machine hits both alike."""
    ref(), fn()
    rt, ft, ratios = [], [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        ref()
        t1 = time.perf_counter()
        fn()
        t2 = time.perf_counter()
        rt.append(t1 - t0)
        ft.append(t2 - t1)
        ratios.append((t2 - t1) / (t1 - t0))
    return statistics.median(rt), statistics.median(ft), statistics.median(ratios)


def speed_table(batches: list[int], repeat: int) -> None:
    model = vit_s()
    print("\n## Fast paths, ViT-S/16 224 px float32 (ratio to one forward+backward, "
          f"median of {repeat} alternating pairs)\n")
    print("| method | batch | time (s) | fwd+bwd (s) | ratio |")
    print("|---|---|---|---|---|")
    for b in batches:
        x = torch.randn(b, 3, 224, 224, generator=torch.Generator().manual_seed(b))
        t = torch.arange(b) % 1000
        cases = {
            "DecompX (gradient route, s=0)": DecompX(model),
            "DecompX o SkipPLUS (fast)": SkipPLUS(model, "decompx"),
            "DecompX o PLUS (fast)": PLUS(model, "decompx"),
            "IxG o PLUS (fast)": PLUS(model, "ixg"),
            "AttIxG o PLUS (fast, = AttCAT)": PLUS(model, "att_ixg"),
            "FullGrad+ (skip)": FullGradPlus(model, skip=True),
        }
        for name, method in cases.items():
            ref, sec, ratio = paired(
                fwd_bwd(model, x, t),
                lambda m=method, x=x, t=t: m.attribute(x, t, output="tokens"), repeat)
            print(f"| {name} | {b} | {sec:.3f} | {ref:.3f} | {ratio:.2f} |", flush=True)


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
    model = vit_s(img)
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
    ad = DecompX(vit_s(img)).adapter
    x0 = torch.zeros(1, n, 384)
    for mem in (None, 64 << 20, 16 << 20):
        print(f"sources per pass with max_memory={mem}: {sources_per_chunk(ad, x0, mem)} "
              f"of {n + 1}")
    if len(starts) == 12:
        print(f"\nexplicit route over every start block: {total:.2f} s; gradient route: "
              f"{grad:.3f} s; speed-up {total / grad:.0f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--explicit-img", type=int, default=96)
    ap.add_argument("--starts", type=int, nargs="+", default=list(range(12)))
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-explicit", action="store_true")
    args = ap.parse_args()
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        print("note: MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ are not set")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    with torch.inference_mode(False):
        if not args.skip_speed:
            speed_table(args.batches, args.repeat)
        if not args.skip_explicit:
            explicit_table(args.explicit_img, args.starts)


if __name__ == "__main__":
    main()
