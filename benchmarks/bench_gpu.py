"""ImageNet-size throughput on a GPU: images/s per method and per metric, peak GPU memory.

Run::

    python benchmarks/bench_gpu.py [--n 5000] [--batch-size 64] [--autocast none|bf16]
        [--methods gae tokentm ...] [--metrics deletion insertion ...]
    python benchmarks/bench_gpu.py --device cpu --arch tiny --n 8    # smoke run, no GPU

A random timm ViT-B/16 at 224 px (width 768, 12 blocks, 12 heads, 1,000 classes; float32)
explains ``--n`` synthetic images with masks (``load_data("synthetic")``: seeded, so every
run sees the same images), batch by batch as ``captum-vit evaluate`` does. **Methods**:
the patch maps of each method (``patch_maps``, the call every metric shares), timed
alone. **Metrics**: each row of the suite's metric table (``captum_vit.metrics.suite.METRICS``)
on GAE's precomputed maps (max_sensitivity and randomization re-run GAE, as in the
suite), with the suite's settings (token removal, 20 steps, removal engine batch
``4 × --batch-size``). Times exclude building the images; the GPU is synchronised around
every timed call. Peak memory is ``torch.cuda.max_memory_allocated`` over the row's calls
(reset before each row). ``--autocast bf16`` runs everything under
:func:`captum_vit.metrics.suite.autocasting`. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch
from timm.models.vision_transformer import VisionTransformer

from captum_vit.adapters import adapt
from captum_vit.data.specs import load_data, model_batch
from captum_vit.metrics.removal import patch_maps
from captum_vit.metrics.settings import EvalSettings
from captum_vit.metrics.suite import AUTOCAST, METRICS, autocasting
from captum_vit.metrics.table import BoundMethod, MetricBatch
from captum_vit.models import RANDOM_MODELS
from captum_vit.registry import method_factory

ARCHS = {
    "vit_base_patch16_224": dict(img_size=224, patch_size=16, embed_dim=768, depth=12,
                                 num_heads=12, num_classes=1000),
    "tiny": RANDOM_MODELS["vit_tiny"],
}
METHODS = ["raw_attention", "rollout", "gae", "attn_gradcam", "attcat", "tokentm", "decompx",
           "gradcam", "cp_lrp", "legrad", "plus:gae", "skipplus:decompx"]


def build_model(arch: str, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return VisionTransformer(**ARCHS[arch]).to(device).eval()


class Meter:
    """Seconds and peak memory of one table row, over the batches."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.seconds, self.peak, self.images = device, 0.0, 0, 0

    def __call__(self, fn: Callable[[], object], images: int) -> object:
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize(self.device)
            self.peak = max(self.peak, torch.cuda.max_memory_allocated(self.device))
        self.seconds += time.perf_counter() - start
        self.images += images
        return out

    def row(self, name: str, reference: Meter | None = None) -> str:
        rate = self.images / self.seconds if self.seconds else float("nan")
        peak = f"{self.peak / 2**30:.2f}" if self.device.type == "cuda" else "–"
        ratio = (f"{self.seconds / reference.seconds * reference.images / self.images:.2f}"
                 if reference is not None and reference.seconds else "–")
        return f"| {name} | {rate:.1f} | {1e3 / rate:.2f} | {ratio} | {peak} |"


def forward_backward(model: torch.nn.Module, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The reference cost: one forward and one backward to the input of the target logits."""
    x = x.detach().requires_grad_(True)
    score = model(x).gather(1, t[:, None]).sum()
    return torch.autograd.grad(score, x)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=5000, help="synthetic images (default 5000)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--device", default="cuda", help="cuda | cuda:K | cpu (smoke run)")
    ap.add_argument("--arch", default="vit_base_patch16_224", choices=tuple(ARCHS))
    ap.add_argument("--autocast", default="none", choices=tuple(AUTOCAST))
    ap.add_argument("--methods", nargs="+", default=METHODS)
    ap.add_argument("--metrics", nargs="+", default=list(METRICS))
    ap.add_argument("--steps", type=int, default=20, help="deletion/insertion steps")
    ap.add_argument("--warmup", type=int, default=1,
                    help="batches run first and not timed (CUDA context, kernel choice)")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: CUDA is not available (torch "
              f"{torch.__version__}, built for CUDA {torch.version.cuda}); run it on a machine "
              "with an NVIDIA GPU, or smoke-test it with --device cpu --arch tiny --n 8",
              file=sys.stderr)
        return 1
    unknown = [m for m in args.metrics if m not in METRICS]
    if unknown:
        ap.error(f"unknown metric(s) {unknown}; choose from {', '.join(METRICS)}")
    model = build_model(args.arch, device)
    adapter = adapt(model)
    channels, size = adapter.input_shape
    data = load_data("synthetic", n=args.n, input_shape=(channels, size),
                     num_classes=adapter.num_classes)
    factories = {m: method_factory(m) for m in args.methods}
    gae = method_factory("gae")
    attrs = {m: f(model) for m, f in factories.items()}
    methods = {m: Meter(device) for m in factories}
    metrics = {m: Meter(device) for m in args.metrics}
    reference = Meter(device)
    first = time.perf_counter()
    starts = list(range(0, args.n, args.batch_size))
    for i, start in enumerate([0] * args.warmup + starts):
        ids = list(range(start, min(start + args.batch_size, args.n)))
        x, _, masks = model_batch(data, ids, input_shape=(channels, size), device=device)
        if i < args.warmup:  # untimed: the same calls, meters thrown away
            warm = {m: Meter(device) for m in list(methods) + list(metrics) + ["ref"]}
            meters = (warm, warm, warm["ref"])
        else:
            meters = (methods, metrics, reference)
        timed_methods, timed_metrics, ref = meters
        with autocasting(model, x, args.autocast):
            with torch.no_grad():
                t = adapter.model_logits(x).argmax(-1)
            layout = adapter.layout(x)
            ref(lambda x=x, t=t: forward_backward(model, x, t), len(ids))
            for m, attr in attrs.items():
                timed_methods[m](lambda a=attr, x=x, t=t, lay=layout: patch_maps(a, x, t, lay),
                           len(ids))
            maps = patch_maps(gae(model), x, t, layout)
            batch = MetricBatch(model=model, inputs=x, maps=maps,
                                method=BoundMethod(gae, model), target=t, labels=None,
                                masks=masks, example_ids=ids,
                                settings=EvalSettings(batch_size=args.batch_size,
                                                      n_steps=args.steps))
            for m in metrics:
                timed_metrics[m](lambda m=m, b=batch: METRICS[m].compute(b), len(ids))
        print(f"{ids[-1] + 1}/{args.n} images, {time.perf_counter() - first:.0f} s",
              file=sys.stderr)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"\n{name}, torch {torch.__version__}, {args.arch} float32, autocast "
          f"{args.autocast}, {args.n} images, batch {args.batch_size}\n")
    print("| method | images/s | ms/image | × fwd+bwd | peak GiB |")
    print("|---|---:|---:|---:|---:|")
    print(reference.row("forward+backward (reference)", reference))
    for m, meter in methods.items():
        print(meter.row(m, reference))
    print("\n| metric (GAE maps) | images/s | ms/image | × fwd+bwd | peak GiB |")
    print("|---|---:|---:|---:|---:|")
    for m, meter in metrics.items():
        print(meter.row(m, reference))
    return 0


if __name__ == "__main__":
    sys.exit(main())
