"""Anytime TIS against exact TIS: masks needed, time, deletion / insertion.

For each model (the bundled ``zoo:vit_fmnist_loc`` on the FashionMNIST-Loc sample images,
and a random timm ViT-S/16 at 224 px on random images) and each image:

* ``exact``: ``TIS.attribute(n_masks=M)`` (the paper's algorithm; M = 1,024 in the paper);
* ``anytime``: ``TIS.attribute(n_masks=M, tolerance=T)`` (rounds of ``--round-size``
  masks, stopped when the map's estimated correlation with the converged map, from the
  Spearman correlation of the maps of the first and second half of the masks scored so
  far (``captum_vit.methods.tis.converged_correlation``), is >= T), with the masks it
  used (``TIS.last_masks_used``); the scores of the masks not scored are predicted by
  the ridge surrogate (``complete_scores``) unless ``--no-surrogate``;
* ``needed``: the fewest masks, in the anytime order and in steps of ``--round-size``,
  whose map (completed the same way) has Spearman >= ``--target-rho`` against the exact
  M-mask map (an oracle: it needs the exact map; the anytime mode has to decide without
  it);
* the Spearman of the anytime map against the exact map, the time ratio exact / anytime,
  and the deletion and insertion AUC (``captum_vit.metrics.faithfulness``, token removal)
  of both maps.

Small defaults check that the script runs; the full run (the paper's 1,024 masks) is::

    python benchmarks/bench_tis_anytime.py --n-masks 1024 --images 8 --vit-images 4
    python benchmarks/bench_tis_anytime.py --n-masks 1024 --images 0 --vit-images 8 \\
        --vit-img-size 112

Times are wall-clock on whatever machine runs it (noisy on a shared CPU).
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from torch import nn

from captum_vit import TIS
from captum_vit.adapters import adapt
from captum_vit.methods.tis import (
    DEFAULT_RANDOM_STATE,
    complete_scores,
    kmeans_masks,
    layer_features,
    mask_scores,
    masks_to_map,
    spearman,
)
from captum_vit.metrics.faithfulness import deletion, insertion


def masks_needed(model: nn.Module, x: torch.Tensor, target: torch.Tensor, n_masks: int,
                 step: int, rho: float, surrogate: bool = True) -> torch.Tensor:
    """Fewest masks (multiples of ``step``, in the anytime order) whose map (completed
    over all masks with ``surrogate``, as the anytime mode's) has Spearman >= ``rho``
    against the map of all ``n_masks`` masks, per image [B]."""
    adapter = adapt(model)
    with torch.no_grad():
        x0 = adapter.embed(x)
        masks = kmeans_masks(layer_features(adapter, x0)[0], n_masks, [0.5])
        w = mask_scores(adapter, x0, target, masks)
    full = masks_to_map(w, masks)
    order = torch.randperm(masks.shape[1],
                           generator=torch.Generator().manual_seed(DEFAULT_RANDOM_STATE))
    needed = torch.full((len(x),), masks.shape[1], dtype=torch.long)
    for m in range(masks.shape[1] - step, 0, -step):  # largest m first: keep the fewest
        cols = order[:m]
        used = torch.zeros(w.shape, dtype=torch.bool)
        used[:, cols] = True
        part = (masks_to_map(complete_scores(w, masks, used), masks) if surrogate
                else masks_to_map(w[:, cols], masks[:, cols]))
        needed = torch.where(spearman(part, full) >= rho, torch.tensor(m), needed)
    return needed


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def compare(name: str, model: nn.Module, x: torch.Tensor, args: argparse.Namespace) -> list[str]:
    """Table rows (one per image, then the mean) for one model."""
    tis = TIS(model)
    with torch.no_grad():
        target = model(x).argmax(-1)
    common = {"target": target, "n_masks": args.n_masks, "output": "tokens",
              "show_progress": False}
    tis.attribute(x[:1], **{**common, "target": target[:1], "n_masks": 4})  # warm-up
    rows, stats = [], []
    for i in range(len(x)):  # one image at a time: per-image times
        xi, ci = x[i:i + 1], {**common, "target": target[i:i + 1]}
        exact, t_exact = _timed(lambda xi=xi, ci=ci: tis.attribute(xi, **ci))
        total = int(tis.last_masks_used[0])  # n_masks, or L*D where that is fewer
        fast, t_fast = _timed(lambda xi=xi, ci=ci: tis.attribute(
            xi, tolerance=args.tolerance, round_size=args.round_size,
            surrogate=not args.no_surrogate, **ci))
        used = int(tis.last_masks_used[0])
        need = int(masks_needed(model, xi, target[i:i + 1], args.n_masks, args.round_size,
                                args.target_rho, not args.no_surrogate)[0])
        rho = float(spearman(fast, exact)[0])
        faith = [float(metric(model, xi, m, target=target[i:i + 1]).per_example[0])
                 for m in (exact, fast) for metric in (deletion, insertion)]
        stats.append([need, used, rho, t_exact / t_fast, *faith])
        rows.append(f"| {name} #{i} | {total} | {need} | {used} | {rho:.3f} | "
                    f"{t_exact:.2f} | {t_fast:.2f} | {t_exact / t_fast:.2f}x | "
                    f"{faith[0]:.3f} / {faith[2]:.3f} | {faith[1]:.3f} / {faith[3]:.3f} |")
    s = torch.tensor(stats, dtype=torch.float64).mean(0).tolist()
    rows.append(f"| **{name} mean** | {total} | {s[0]:.0f} | {s[1]:.0f} | {s[2]:.3f} | "
                f" |  | {s[3]:.2f}x | {s[4]:.3f} / {s[6]:.3f} | {s[5]:.3f} / {s[7]:.3f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n-masks", type=int, default=128, help="masks of the exact map (1024)")
    ap.add_argument("--tolerance", type=float, default=0.95, help="anytime tolerance")
    ap.add_argument("--target-rho", type=float, default=0.95,
                    help="Spearman against the exact map that 'needed' asks for")
    ap.add_argument("--round-size", type=int, default=32, help="masks per anytime round")
    ap.add_argument("--no-surrogate", action="store_true",
                    help="anytime maps over the scored masks only (TIS(surrogate=False))")
    ap.add_argument("--images", type=int, default=2, help="bundled-model sample images")
    ap.add_argument("--vit-images", type=int, default=1, help="ViT-S/16 images (0 = skip)")
    ap.add_argument("--vit-img-size", type=int, default=224,
                    help="ViT-S/16 input size (112 = bench_authors.py's 50 tokens)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message="n_masks=")  # the bundled model clamps to L*D
    if args.threads:
        torch.set_num_threads(args.threads)

    print(f"TIS anytime (tolerance {args.tolerance}, rounds of {args.round_size}) against "
          f"exact TIS ({args.n_masks} masks), CPU float32, {torch.get_num_threads()} threads; "
          f"'needed' = fewest masks with Spearman >= {args.target_rho} against the exact "
          f"map; deletion (lower is better) and insertion (higher) with token removal.\n")
    print("| model / image | masks (exact) | needed | anytime used | Spearman anytime vs "
          "exact | exact s | anytime s | speed-up | deletion exact / anytime | "
          "insertion exact / anytime |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    if args.images:
        from captum_vit.data.specs import load_data, model_batch
        from captum_vit.models import load_model

        lm = load_model("zoo:vit_fmnist_loc")
        data = load_data("sample", n=args.images, input_shape=lm.input_shape,
                         num_classes=lm.num_classes)
        x, _, _ = model_batch(data, range(len(data)), input_shape=lm.input_shape,
                              preprocess=lm.preprocess)
        for row in compare("vit_fmnist_loc", lm.model.eval(), x, args):
            print(row, flush=True)
    if args.vit_images:
        from timm.models.vision_transformer import VisionTransformer

        torch.manual_seed(0)
        size = args.vit_img_size
        vit = VisionTransformer(img_size=size, patch_size=16, embed_dim=384, depth=12,
                                num_heads=6).eval()
        x = torch.randn(args.vit_images, 3, size, size)
        for row in compare(f"ViT-S/16 random {size} px", vit, x, args):
            print(row, flush=True)


if __name__ == "__main__":
    main()
