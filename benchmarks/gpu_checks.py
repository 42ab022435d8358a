"""GPU correctness checks: every registered method on CUDA against the CPU, in float64.

Run on a machine with a GPU::

    python benchmarks/gpu_checks.py [--methods gae tokentm ...] [--families timm hf torchvision]

For each model family (a tiny random model built from a config, float64) and each method
of the registry (plus the featured compositions), the same images are explained on the CPU
and on the GPU. A row reports

- ``device``: the map is on the inputs' device (``cuda:0``);
- ``rel. diff``: ``max |m_gpu - m_cpu| / max |m_cpu|`` (float64, so only the order of
  reductions differs between the two devices; seeded perturbation methods draw their masks
  on the CPU and agree too), and ``max |m|``. A map that is a cancellation (say the channel
  sum of a gradient that every path through a LayerNorm makes zero-sum: ``max |m|`` near
  1e-16 of the model's scale) is rounding noise on either device; such rows are compared by
  their absolute difference instead, ``≤ tol × max |logits|``;
- ``unchanged``: the model's parameters, buffers, flags and ``.grad`` are identical after the
  call;
- ``status``: ``ok``, ``refused`` (the method refuses this family by name: same as on the
  CPU) or the exception.

Prints a markdown table and exits non-zero when any row is neither ok nor refused on both
devices, or when a relative difference exceeds ``--tol`` (default 1e-8).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn

from captum_vit.registry import available_methods, build_method, quick_options


def tiny_models() -> dict[str, nn.Module]:
    """Tiny random models, one per installed family (float64, eval mode)."""
    out: dict[str, nn.Module] = {}
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    out["timm"] = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=3,
                                    num_heads=2, num_classes=5)
    try:
        from transformers import ViTConfig, ViTForImageClassification

        cfg = ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=3,
                        num_attention_heads=2, intermediate_size=64, num_labels=5)
        out["hf"] = ViTForImageClassification(cfg)
    except ImportError:
        pass
    try:
        from torchvision.models.vision_transformer import VisionTransformer as TVViT

        out["torchvision"] = TVViT(image_size=32, patch_size=8, num_layers=3, num_heads=2,
                                   hidden_dim=32, mlp_dim=64, num_classes=5)
    except ImportError:
        pass
    return {k: m.double().eval() for k, m in out.items()}


def snapshot(model: nn.Module) -> dict:
    """Everything a call must leave as it was."""
    return {
        "params": {k: (v.detach().clone(), v.requires_grad,
                       None if v.grad is None else v.grad.clone())
                   for k, v in model.named_parameters()},
        "buffers": {k: v.clone() for k, v in model.named_buffers()},
        "training": [m.training for m in model.modules()],
    }


def same(a: dict, b: dict) -> bool:
    """Two snapshots are equal (values compared exactly: nothing may change at all)."""
    if a["training"] != b["training"] or a["params"].keys() != b["params"].keys():
        return False
    for k, (v, rg, g) in a["params"].items():
        w, rg2, g2 = b["params"][k]
        if rg != rg2 or not torch.equal(v, w) or (g is None) != (g2 is None):
            return False
    return all(torch.equal(v, b["buffers"][k]) for k, v in a["buffers"].items())


def run(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor
        ) -> tuple[torch.Tensor | None, str]:
    """The map of method ``name`` (``None`` and the reason when it raises)."""
    try:
        method = build_method(name, model)
        opts = quick_options(name)
        out = method.attribute(x, target=y, **opts)
        return out.detach(), "ok"
    except (TypeError, ValueError) as e:
        return None, f"refused: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
    except Exception as e:  # noqa: BLE001 - reported in the table
        return None, f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:80]}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", default=None)
    ap.add_argument("--families", nargs="+", default=None)
    ap.add_argument("--tol", type=float, default=1e-8)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    gpu = torch.device("cuda")
    methods = args.methods or available_methods(compositions=True)
    models = tiny_models()
    if args.families:
        models = {k: v for k, v in models.items() if k in args.families}
    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    print("| family | method | device | rel. diff | max abs m | unchanged | status | s (gpu) |")
    print("|---|---|---|---|---|---|---|---|")
    bad = 0
    for fam, model in models.items():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2, 3, 32, 32, generator=g, dtype=torch.float64)
        y = torch.tensor([1, 3])
        model_gpu = _copy_to(model, gpu)
        with torch.no_grad():
            logit_scale = model(x).abs().max().item()
        for name in methods:
            m_cpu, s_cpu = run(name, model, x, y)
            before = snapshot(model_gpu)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            m_gpu, s_gpu = run(name, model_gpu, x.to(gpu), y.to(gpu))
            torch.cuda.synchronize()
            secs = time.perf_counter() - t0
            unchanged = same(before, snapshot(model_gpu))
            dev, diff, size = "-", "-", "-"
            status = s_gpu
            if m_gpu is not None and m_cpu is not None:
                dev = str(m_gpu.device)
                scale = m_cpu.abs().max().clamp_min(1e-300)
                rel = ((m_gpu.cpu() - m_cpu).abs().max() / scale).item()
                absdiff = (m_gpu.cpu() - m_cpu).abs().max().item()
                diff, size = f"{rel:.1e}", f"{scale.item():.1e}"
                cancels = scale.item() < 1e-9 * logit_scale
                if cancels and absdiff <= args.tol * logit_scale:
                    status = "ok (cancelling map: absolute difference compared)"
                elif (rel > args.tol or m_gpu.device.type != "cuda"
                        or not torch.isfinite(m_gpu).all()):
                    status, bad = "MISMATCH", bad + 1
            elif s_cpu.split(":")[0] != s_gpu.split(":")[0]:
                status, bad = f"cpu {s_cpu} / gpu {s_gpu}", bad + 1
            elif s_gpu.startswith("FAILED"):
                bad += 1
            if not unchanged:
                status, bad = status + " (MODEL CHANGED)", bad + 1
            print(f"| {fam} | {name} | {dev} | {diff} | {size} | {unchanged} | {status} "
                  f"| {secs:.3f} |",
                  flush=True)
    print(f"\n{bad} problem row(s)")
    return 1 if bad else 0


def _copy_to(model: nn.Module, device: torch.device) -> nn.Module:
    import copy

    return copy.deepcopy(model).to(device)


if __name__ == "__main__":
    sys.exit(main())
