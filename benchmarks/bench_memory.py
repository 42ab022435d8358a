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
``--model swin --img-size 224 --batch 16``. ``--model vjepa2`` measures a V-JEPA 2-L-shaped
Hugging Face ``VJEPA2ForVideoClassification`` on 16 frames (``--img-size 256``: 2048 tokens;
3-D RoPE, attentive pooler), ``--model vjepa2-s`` the same at ViT-S width on 4 frames.

``--model timm-swinv2``, ``timm-hiera``, ``hf-dinov3`` and ``hf-siglip2`` measure the
realistic-size builders of ``benchmarks/speed.py`` (Swin V2-T at 256 px, Hiera-T and DINOv3-S
at 224 px, SigLIP2-B NaFlex at 256 patches; issue 45, ``--img-size`` is then ignored); the
reference and the methods' targets are those of ``speed.py`` (a classifier's logit; DINOv3's
and SigLIP2's cosine with one random vector per image), e.g.
``--model timm-hiera --batch 16 --methods GAE TokenTM AttnLRP``.

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
from typing import Any

import torch
from timm.models.vision_transformer import VisionTransformer

from captum_vit import GAE, DecompX, RawAttention, Rollout, TokenTM
from captum_vit.registry import build_method

PLAIN = "plain forward+backward"
METHODS = {
    "Rollout": lambda m: Rollout(m).attribute,
    "RawAttention": lambda m: RawAttention(m).attribute,
    "GAE": lambda m: GAE(m).attribute,
    "TokenTM": lambda m: TokenTM(m).attribute,
    "DecompX": lambda m: DecompX(m).attribute,
    "Chefer21": lambda m: build_method("chefer21", m).attribute,
    "AttnLRP": lambda m: build_method("attnlrp", m).attribute,
    "TokenIxG": lambda m: build_method("token_ixg", m).attribute,
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


def vjepa2_l16(img_size: int, frames: int = 16, width: int = 1024, depth: int = 24,
               heads: int = 16) -> torch.nn.Module:
    """A random V-JEPA 2-L-shaped Hugging Face ``VJEPA2ForVideoClassification`` (16 frames
    of ``img_size`` px, tubelets 2 x 16 x 16, 3-D RoPE, attentive pooler with 3
    self-attention layers)."""
    from transformers import VJEPA2Config, VJEPA2ForVideoClassification

    torch.manual_seed(0)
    cfg = VJEPA2Config(patch_size=16, crop_size=img_size, frames_per_clip=frames,
                       tubelet_size=2, hidden_size=width, num_attention_heads=heads,
                       num_hidden_layers=depth, num_pooler_layers=3, pred_hidden_size=64,
                       pred_num_attention_heads=2, pred_num_hidden_layers=1, num_labels=1000)
    return VJEPA2ForVideoClassification(cfg).eval()


def vjepa2_s16(img_size: int) -> torch.nn.Module:
    """:func:`vjepa2_l16` at ViT-S width and depth (384, 12 blocks, 6 heads), 4 frames."""
    return vjepa2_l16(img_size, frames=4, width=384, depth=12, heads=6)


MODELS = {"vit": vit_b16, "swin": swin_t, "vjepa2": vjepa2_l16, "vjepa2-s": vjepa2_s16}
SPEED_MODELS = ("timm-swinv2", "timm-hiera", "hf-dinov3", "hf-siglip2")
"""Issue 45's realistic-size builders, read from ``benchmarks/speed.py``."""


def _speed() -> Any:
    """``benchmarks/speed.py`` as a module (its builders, inputs and targets)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import speed

    return speed


def logits_of(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's own logits (a Hugging Face model returns an output object)."""
    out = model(x)
    return out.logits if hasattr(out, "logits") else out


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def child(name: str, img_size: int, batch: int, threads: int,
          model_name: str = "vit") -> dict[str, float]:
    """Peak resident-set growth (MB) of one call of ``name`` in this process."""
    torch.set_num_threads(threads)
    if model_name in SPEED_MODELS:  # issue 45's builders, inputs and targets
        sp = _speed()
        model = sp.MODELS[model_name]()
        x = sp.inputs_of(model, batch, torch.Generator().manual_seed(0))
        score, target = sp.targets_of(model, batch)
        if name == PLAIN:
            def call() -> None:
                sp.score_backward(score, x)
        else:
            fn = METHODS[name](model)

            def call() -> None:
                fn(x, target=target)
        base = _rss_mb()
        call()
        return {"peak_mb": _peak_mb() - base, "base_mb": base}
    model = MODELS[model_name](img_size)
    frames = getattr(getattr(model, "config", None), "frames_per_clip", None)
    shape = (batch, 3, img_size, img_size) if frames is None else \
        (batch, frames, 3, img_size, img_size)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    t = torch.arange(batch) % 1000
    if name == PLAIN:
        def call() -> None:
            xx = x.clone().requires_grad_()
            torch.autograd.grad(logits_of(model, xx)[torch.arange(batch), t].sum(), xx)
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
    ap.add_argument("--model", default="vit", choices=[*MODELS, *SPEED_MODELS])
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.img_size, args.batch, args.threads,
                               args.model)))
        return
    if args.model in SPEED_MODELS:
        what = {"timm-swinv2": "Swin V2-T, 256 px", "timm-hiera": "Hiera-T, 224 px",
                "hf-dinov3": "DINOv3-S (HF DINOv3ViTModel, cosine target), 224 px",
                "hf-siglip2": "SigLIP2-B NaFlex (HF Siglip2VisionModel, cosine target), "
                              "256 patches"}[args.model]
    elif args.model.startswith("vjepa2"):
        frames = 16 if args.model == "vjepa2" else 4
        what = (f"V-JEPA 2-{'L' if args.model == 'vjepa2' else 'S'}/16, {frames} frames of "
                f"{args.img_size} px ({frames // 2 * (args.img_size // 16) ** 2} tokens)")
    elif args.model == "swin":
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
        goal = 1.3 if args.model in SPEED_MODELS else GOAL  # issue 45's goal
        flag = "" if ratio <= goal else f" (goal ≤ {goal})"
        print(f"| {name} | {peak:,.0f} | {ratio:.2f}{flag} |", flush=True)


if __name__ == "__main__":
    main()
