"""``captum-vit explain``: a PNG grid of the input and every method's map.

Models (``--model``): :mod:`captum_vit.models`; methods (``--methods``):
:mod:`captum_vit.registry`; image reading: :mod:`captum_vit.data.images`; drawing:
:mod:`captum_vit.viz`. This module only parses options.
"""

from __future__ import annotations

import argparse
import sys

import torch
from tqdm import tqdm

from captum_vit import viz
from captum_vit.adapters import adapt
from captum_vit.adapters.base import probabilities
from captum_vit.commands.options import add_target_embedding_arguments, target_embeddings
from captum_vit.data.images import conform, read_image
from captum_vit.metrics.report import ensure_file_location
from captum_vit.models import SPEC_HELP, load_model
from captum_vit.registry import available_methods, build_method, parse_methods, quick_options

DEFAULT_MODEL = "zoo:vit_fmnist_loc"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``captum-vit explain``."""
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"{SPEC_HELP} (default: the bundled model)")
    p.add_argument("--pretrained", action="store_true",
                   help="with --model timm:NAME: load its pretrained weights from the local "
                        "cache (never downloads); without it the timm model has random weights")
    p.add_argument("--classes", default=None, metavar="FILE",
                   help="class names of the model, one per line (for timm/file/random models)")
    p.add_argument("--image", default=None,
                   help="image file of any size (default: a bundled FashionMNIST-Loc sample)")
    p.add_argument("--methods", default="all",
                   help="comma-separated names or 'all' "
                        f"({', '.join(available_methods(baselines=False))}; also GAE, "
                        "plus:<name>, SkipPLUS(<name>), captum:<Class>)")
    p.add_argument("--target", type=int, default=None,
                   help="class to explain, or the row of --target-embeddings (default: "
                        "predicted)")
    add_target_embedding_arguments(p)
    p.add_argument("--seed", type=int, default=0, help="seed of random models")
    p.add_argument("--display", default="nearest", choices=viz.DISPLAYS,
                   help="nearest: each patch one colour, as computed (default); bilinear: "
                        "smoothed for display")
    p.add_argument("--out", default="explain.png", help="output PNG path (its folder is created)")


def run(args: argparse.Namespace) -> int:
    """Explain one image with every requested method and write the PNG grid."""
    names = parse_methods(args.methods, for_explain=True)
    out = ensure_file_location(args.out, formats=viz.figure_formats())
    lm = load_model(args.model, seed=args.seed, pretrained=args.pretrained,
                    class_names=args.classes, targets=target_embeddings(args))
    scoring = lm.scoring()  # embedding models: scored against --target-embeddings
    if lm.random_weights:
        hint = ("; add --pretrained for the trained weights in the local cache"
                if args.model.startswith("timm:") else "")
        print(f"note: explaining a random-weight ViT{hint}", file=sys.stderr)
    if args.image is None:
        from captum_vit.data import load_sample

        image = load_sample()["images"][0]
    else:
        image = read_image(args.image)
    x = lm.preprocess(image)[None]
    with scoring:
        with torch.no_grad():
            probs = probabilities(adapt(lm.model).model_logits(x))[0]
        if args.target is not None and not 0 <= args.target < probs.shape[0]:
            raise ValueError(f"--target must be in [0, {probs.shape[0]}), got {args.target}")
        target = int(probs.argmax()) if args.target is None else args.target
        maps = {name: build_method(name, lm.model, seed=args.seed).attribute(
                    x, target=target, output="grid", **quick_options(name))
                for name in tqdm(names, desc="methods", file=sys.stderr)}
    shown = conform(image, *lm.input_shape)  # the model's view, before normalisation
    viz.plot_grid(shown[None], maps, path=str(out), display=args.display,
                  row_titles=[viz.prediction_title(probs, target, lm.class_names, sep="\n")])
    print(f"wrote {out}: {len(maps)} methods, "
          f"{viz.prediction_title(probs, target, lm.class_names)}")
    return 0
