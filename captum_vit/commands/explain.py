"""``captum-vit explain``: a PNG grid of the input and every method's map."""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from tqdm import tqdm

from captum_vit.commands.evaluate import load_model, model_input
from captum_vit.registry import available_methods, build_method

DEFAULT_MODEL = "zoo:vit_fmnist_loc"
# quick settings for the demo grid (the methods' defaults are the papers')
DEMO_KWARGS = {"tis": {"n_masks": 128}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``captum-vit explain``."""
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="zoo:NAME (default: the bundled model) | timm:NAME | "
                        "file:PATH.safetensors | random:vit_tiny")
    p.add_argument("--pretrained", action="store_true",
                   help="with --model timm:NAME: load its pretrained weights from the local "
                        "cache (never downloads); without it the timm model has random weights")
    p.add_argument("--image", default=None,
                   help="image file of any size (default: a bundled FashionMNIST-Loc sample)")
    p.add_argument("--methods", default="all",
                   help=f"comma-separated names or 'all' ({', '.join(available_methods())})")
    p.add_argument("--target", type=int, default=None, help="class to explain (default: predicted)")
    p.add_argument("--seed", type=int, default=0, help="seed of random models")
    p.add_argument("--out", default="explain.png", help="output PNG path")


def _methods(spec: str) -> list[str]:
    names = available_methods() if spec == "all" else [n for n in spec.split(",") if n]
    for n in names:
        if n not in available_methods() and not n.startswith(("captum:", "plus:", "skipplus:")):
            raise ValueError(f"unknown method {n!r}; choose from {', '.join(available_methods())}, "
                             "plus:<name>, skipplus:<name>, captum:<Class> or 'all'")
    if not names:
        raise ValueError("--methods is empty")
    return names


def _image(path: str | None) -> torch.Tensor:
    """[C, H, W] in [0, 1]: the file, or the first bundled sample image."""
    if path is None:
        from captum_vit.data import load_sample

        return load_sample()["images"][0]
    from pathlib import Path

    import numpy as np
    from PIL import Image, UnidentifiedImageError

    if not Path(path).is_file():
        raise FileNotFoundError(f"--image {path}: no such file")
    try:
        arr = np.asarray(Image.open(path).convert("RGB"), dtype=np.float32) / 255
    except UnidentifiedImageError as e:
        raise ValueError(f"--image {path}: not an image PIL can read") from e
    return torch.from_numpy(arr).permute(2, 0, 1)


def run(args: argparse.Namespace) -> int:
    """Explain one image with every requested method and write the PNG grid."""
    from captum_vit.viz import plot_grid

    names = _methods(args.methods)
    model, pre, class_names = load_model(args.model, args.seed, args.pretrained)
    if args.model.startswith("random:"):
        print("note: explaining a random-weight ViT", file=sys.stderr)
    elif args.model.startswith("timm:") and not args.pretrained:
        print("note: explaining a random-weight ViT; add --pretrained for the trained weights "
              "in the local cache", file=sys.stderr)
    chans, size = model_input(model)
    img = _image(args.image)
    if img.shape[0] != chans:
        img = img.mean(0, keepdim=True).expand(chans, -1, -1)
    if tuple(img.shape[-2:]) != size:
        img = F.interpolate(img[None], size=size, mode="bilinear", align_corners=False,
                            antialias=True)[0]
    x = (pre(img) if pre is not None else img)[None]
    with torch.no_grad():
        probs = model(x).softmax(-1)[0]
    n_classes = probs.shape[0]
    if args.target is not None and not 0 <= args.target < n_classes:
        raise ValueError(f"--target must be in [0, {n_classes}), got {args.target}")
    target = int(probs.argmax()) if args.target is None else args.target
    maps = {}
    for name in tqdm(names, desc="methods", file=sys.stderr):
        maps[name] = build_method(name, model).attribute(x, target=target, output="grid",
                                                         **DEMO_KWARGS.get(name, {}))
    label = class_names[target] if class_names else f"class {target}"
    title = f"{label} (p={probs[target]:.2f})"
    plot_grid(img[None], maps, row_titles=[title], path=args.out)
    print(f"wrote {args.out}: {len(maps)} methods, {title}")
    return 0
