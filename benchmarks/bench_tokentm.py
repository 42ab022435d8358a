"""Speed of TokenTM and AttCAT relative to one forward + backward of the same model.

Run (allocator settings keep large buffers mapped between calls):

    MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=4294967296 \\
        python benchmarks/bench_tokentm.py [--repeats 5] [--batches 1 8] [--device cpu] \\
        [--threads 1]

The baseline is ``torch.autograd.grad(model(x)[range(B), t].sum(), x)`` on a random
ViT-S/16-sized timm model (224 px, width 384, 12 blocks, 6 heads), float32, measured in
the same run and interleaved with the method so machine load affects both alike. The
ratio is median(method) / median(baseline). Goals: TokenTM <= 2x, AttCAT <= 1.3x.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from timm.models.vision_transformer import VisionTransformer

from captum_vit.methods.attcat import AttCAT
from captum_vit.methods.tokentm import TokenTM

GOALS = {"TokenTM(paper)": 2.0, "TokenTM(residual)": 2.0, "AttCAT": 1.3}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def bench(batches: list[int], repeats: int, device: torch.device) -> list[dict]:
    torch.manual_seed(0)
    model = VisionTransformer(img_size=224, patch_size=16, embed_dim=384, depth=12,
                              num_heads=6).to(device).eval()
    methods = {
        "TokenTM(paper)": TokenTM(model),
        "TokenTM(residual)": TokenTM(model, variant="residual"),
        "AttCAT": AttCAT(model),
    }
    rows = []
    for b in batches:
        x = torch.randn(b, 3, 224, 224, device=device)
        t = torch.arange(b, device=device) % 1000

        rows_idx = torch.arange(b, device=device)

        def baseline(x: torch.Tensor = x, t: torch.Tensor = t,
                     rows_idx: torch.Tensor = rows_idx) -> object:
            xi = x.detach().requires_grad_()
            return torch.autograd.grad(model(xi)[rows_idx, t].sum(), xi)

        for name, m in methods.items():
            def run(m=m, x: torch.Tensor = x, t: torch.Tensor = t) -> object:
                return m.attribute(x, target=t, output="tokens")

            run(), baseline()  # warm-up (adapter self-check, allocator)
            base_t, meth_t = [], []
            for _ in range(repeats):
                base_t.append(_time(baseline, device))
                meth_t.append(_time(run, device))
            base, meth = statistics.median(base_t), statistics.median(meth_t)
            rows.append(dict(method=name, batch=b, ms_per_image=1e3 * meth / b,
                             base_ms_per_image=1e3 * base / b, ratio=meth / base,
                             goal=GOALS[name]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads (default: torch's own choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = bench(args.batches, args.repeats, device)
    print(f"device={device} threads={torch.get_num_threads()} repeats={args.repeats} "
          f"torch={torch.__version__}")
    print(f"{'method':<18} {'batch':>5} {'ms/img':>9} {'fwd+bwd ms/img':>15} "
          f"{'ratio':>6} {'goal':>5}")
    for r in rows:
        print(f"{r['method']:<18} {r['batch']:>5} {r['ms_per_image']:>9.1f} "
              f"{r['base_ms_per_image']:>15.1f} {r['ratio']:>6.2f} {r['goal']:>5.1f}")


if __name__ == "__main__":
    main()
