"""Speed of this checkout against an earlier commit, side by side on the same machine.

The earlier commit (default ``c057b64``, 2026-11-25) is checked out into a temporary git
worktree (``git worktree add --detach``, removed at the end). Every *round* runs one
process per checkout, alternating which goes first (``PYTHONPATH`` selects the
``captum_vit`` each imports; timm, torch and the rest are the same interpreter's). Each
process builds the ViT-S/16-sized random timm ``VisionTransformer`` of
``benchmarks/speed.py`` (224 px, width 384, 12 blocks, 6 heads, float32), at batch 8 on
1 thread, and times every method alternately with its own reference, one
``torch.autograd.grad(model(x)[range(B), t].sum(), x)`` (forward+backward), after one
warm-up call each; its figure is the median of the per-pair ratios. A method's figure for
a checkout is the median over the rounds (three by default), so each checkout's ratio is
to the forward+backward of its own processes, and load drifting on a shared machine hits
both alike. Also reported: the ratio of a plain no-grad forward (the model's own) to the
same reference, the floor of a method that needs one full forward (Rollout).

The children run with ``MALLOC_MMAP_THRESHOLD_=1073741824
MALLOC_TRIM_THRESHOLD_=4294967296`` (as the other speed benchmarks do: large temporaries
are reused from the heap instead of being mapped and faulted in again on every call).
``--clock cpu`` (the default with one thread) times with the process's CPU time
(``time.process_time``), which a busy shared machine disturbs less than wall time;
``--clock wall`` uses ``time.perf_counter``. Run from the repository root::

    python benchmarks/bench_regression.py [--commit c057b64] [--rounds 3] [--batch 8]
        [--threads 1] [--pairs 3] [--methods rollout gae decompx tokentm attnlrp]

It prints a markdown table: method, the earlier commit's ratio, this checkout's ratio,
and new / old (below 1: faster than before).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

METHODS: dict[str, str] = {"rollout": "Rollout", "gae": "GAE", "decompx": "DecompX",
                           "tokentm": "TokenTM", "attnlrp": "AttnLRP"}
"""Method key -> class name exported by ``captum_vit`` in both checkouts."""

MALLOC = {"MALLOC_MMAP_THRESHOLD_": "1073741824", "MALLOC_TRIM_THRESHOLD_": "4294967296"}
"""The allocator settings of the project's speed benchmarks."""

ROOT = Path(__file__).resolve().parents[1]


def child(args: argparse.Namespace) -> None:
    """One process: the ratio of every method (and of a plain forward) to its own
    forward+backward, printed as one JSON line."""
    import torch
    from timm.models.vision_transformer import VisionTransformer

    import captum_vit

    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.manual_seed(0)
    model = VisionTransformer(img_size=224, patch_size=16, embed_dim=384, depth=12,
                              num_heads=6, num_classes=1000).eval()
    b = args.batch
    x = torch.randn(b, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    t = torch.arange(b) % 1000

    def reference() -> None:
        xg = x.detach().requires_grad_()
        torch.autograd.grad(model(xg)[torch.arange(b), t].sum(), xg)

    def forward() -> None:
        with torch.no_grad():
            model(x)

    def ratio(fn: Callable[[], object]) -> float:
        reference(), fn()  # warm-up (and the adapter's one-time self-check)
        ratios = []
        for _ in range(args.pairs):
            t0 = clock()
            reference()
            t1 = clock()
            fn()
            t2 = clock()
            ratios.append((t2 - t1) / (t1 - t0))
        return statistics.median(ratios)

    out = {"forward": ratio(forward)}
    for key in args.methods:
        method = getattr(captum_vit, METHODS[key])(model)
        out[key] = ratio(lambda method=method: method.attribute(x, target=t))
    print(json.dumps({"file": captum_vit.__file__, "ratios": out}), flush=True)


def run_child(path: Path, args: argparse.Namespace) -> dict[str, float]:
    """The ratios of one child process importing ``captum_vit`` from ``path``."""
    env = {**os.environ, **MALLOC, "PYTHONPATH": str(path), "OMP_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--batch", str(args.batch),
           "--threads", str(args.threads), "--pairs", str(args.pairs), "--clock", args.clock,
           "--methods", *args.methods]
    proc = subprocess.run(cmd, env=env, cwd=tempfile.gettempdir(), capture_output=True,
                          text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"child for {path} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if not Path(result["file"]).resolve().is_relative_to(path.resolve()):
        raise RuntimeError(f"child imported {result['file']}, not the checkout {path}")
    return result["ratios"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", default="c057b64", help="the earlier commit (default c057b64)")
    ap.add_argument("--rounds", type=int, default=3, help="alternations (median over them)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pairs", type=int, default=3,
                    help="reference/method pairs per process (median of their ratios)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default=None,
                    help="process CPU time or wall time (default: cpu with 1 thread)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.clock is None:
        args.clock = "cpu" if args.threads == 1 else "wall"
    if args.child:
        return child(args)
    tmp = Path(tempfile.mkdtemp(prefix="captum_vit_old_"))
    old = tmp / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old),
                    args.commit], check=True, capture_output=True)
    results: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    try:
        for r in range(args.rounds):
            order = [("old", old), ("new", ROOT)]
            for name, path in order if r % 2 == 0 else order[::-1]:
                results[name].append(run_child(path, args))
                print(f"round {r + 1} {name}: " + ", ".join(
                    f"{k} {v:.2f}" for k, v in results[name][-1].items()), flush=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)],
                       check=False, capture_output=True)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], check=False)
        if tmp.exists() and not any(tmp.iterdir()):
            tmp.rmdir()
    print(f"\n{args.commit} vs this checkout: timm ViT-S/16, 224 px, batch {args.batch}, "
          f"{args.threads} thread(s), {args.clock} clock; ratio to each process's own "
          f"forward+backward, median of {args.rounds} alternating rounds (each the median "
          f"of {args.pairs} pairs)")
    print(f"| method | {args.commit} | this checkout | new / old |")
    print("|---|---:|---:|---:|")
    for key in ["forward", *args.methods]:
        o = statistics.median(r[key] for r in results["old"])
        n = statistics.median(r[key] for r in results["new"])
        label = "plain forward (no grad)" if key == "forward" else METHODS[key]
        print(f"| {label} | {o:.2f} | {n:.2f} | {n / o:.2f} |")


if __name__ == "__main__":
    main()
