"""Peak memory of the attention-map methods at high resolution.

Every method is measured in a FRESH Python process (``sys.executable`` running this
script with ``--child``): the process builds the model and the inputs, reads its resident
set (``/proc/self/statm``), runs one call, and reports ``ru_maxrss`` (the peak resident set
of its whole life, ``resource.getrusage``) minus that baseline. The reference is one plain
forward+backward of the same model, ``torch.autograd.grad(model(x)[range(B), t].sum(), x)``
(timm's own forward, fused attention, parameters requiring grad), measured the same way.

The model is a random ViT-B/16 (timm ``VisionTransformer``: width 768, 12 blocks, 12
heads) at 448 px, i.e. 785 tokens, batch 8, float32 on the CPU. The children run with
glibc's default ``malloc`` thresholds (the ``MALLOC_*`` variables that the speed
benchmarks set are removed), so that freed tensors leave the resident set and the peak is
that of the live tensors. Run from the repository root (package installed, or
``PYTHONPATH=.``)::

    python benchmarks/bench_memory.py [--img-size 448] [--batch 8] [--threads 2]

``--model swin`` measures a random Swin-T instead (timm ``SwinTransformer``: width 96, depths
2-2-6-2, heads 3-6-12-24, window 7; at 224 px, 56 x 56 tokens in the first stage), e.g.
``--model swin --img-size 224 --batch 16``.

A quick check of the script: ``--img-size 224 --batch 2``. It prints a markdown table:
method, peak growth in MB, and its ratio to the plain forward+backward (goal ≤ 1.25).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

import torch
from timm.models.vision_transformer import VisionTransformer

from captum_vit import GAE, DecompX, RawAttention, Rollout, TokenTM

PLAIN = "plain forward+backward"
METHODS = {
    "Rollout": lambda m: Rollout(m).attribute,
    "RawAttention": lambda m: RawAttention(m).attribute,
    "GAE": lambda m: GAE(m).attribute,
    "TokenTM": lambda m: TokenTM(m).attribute,
    "DecompX": lambda m: DecompX(m).attribute,
}
GOAL = 1.25


def vit_b16(img_size: int) -> torch.nn.Module:
    """A random ViT-B/16-sized timm model (the same weights in every process)."""
    torch.manual_seed(0)
    return VisionTransformer(img_size=img_size, patch_size=16, embed_dim=768, depth=12,
                             num_heads=12, num_classes=1000).eval()


def swin_t(img_size: int) -> torch.nn.Module:
    """A random Swin-T-sized timm model (the same weights in every process)."""
    from timm.models.swin_transformer import SwinTransformer

    torch.manual_seed(0)
    return SwinTransformer(img_size=img_size, patch_size=4, embed_dim=96, depths=(2, 2, 6, 2),
                           num_heads=(3, 6, 12, 24), window_size=7, drop_path_rate=0.0,
                           num_classes=1000).eval()


MODELS = {"vit": vit_b16, "swin": swin_t}


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def child(name: str, img_size: int, batch: int, threads: int,
          model_name: str = "vit") -> dict[str, float]:
    """Peak resident-set growth (MB) of one call of ``name`` in this process."""
    torch.set_num_threads(threads)
    model = MODELS[model_name](img_size)
    x = torch.randn(batch, 3, img_size, img_size, generator=torch.Generator().manual_seed(0))
    t = torch.arange(batch) % 1000
    if name == PLAIN:
        def call() -> None:
            xx = x.clone().requires_grad_()
            torch.autograd.grad(model(xx)[torch.arange(batch), t].sum(), xx)
    else:
        fn = METHODS[name](model)

        def call() -> None:
            fn(x, target=t)
    base = _rss_mb()
    call()
    return {"peak_mb": _peak_mb() - base, "base_mb": base}


def measure(name: str, args: argparse.Namespace) -> float:
    """Run ``name`` in a fresh process; its peak growth in MB."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, __file__, "--child", name, "--img-size", str(args.img_size),
         "--batch", str(args.batch), "--threads", str(args.threads), "--model", args.model],
        env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--img-size", type=int, default=448)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--model", default="vit", choices=list(MODELS))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.img_size, args.batch, args.threads,
                               args.model)))
        return
    if args.model == "swin":
        what = f"Swin-T, {args.img_size} px ({(args.img_size // 4) ** 2} first-stage tokens)"
    else:
        what = f"ViT-B/16, {args.img_size} px ({(args.img_size // 16) ** 2 + 1} tokens)"
    plain = measure(PLAIN, args)
    print(f"{what}, batch {args.batch}, float32, "
          f"{args.threads} threads; peak resident-set growth, one fresh process per row\n")
    print("| method | peak MB | ratio to plain forward+backward |")
    print("|---|---:|---:|")
    print(f"| {PLAIN} | {plain:,.0f} | 1.00 |")
    for name in args.methods:
        peak = measure(name, args)
        ratio = peak / plain
        flag = "" if ratio <= GOAL else f" (goal ≤ {GOAL})"
        print(f"| {name} | {peak:,.0f} | {ratio:.2f}{flag} |", flush=True)


if __name__ == "__main__":
    main()
