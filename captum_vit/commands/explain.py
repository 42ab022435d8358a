"""``captum-vit explain``: a PNG grid of every method on one image."""

from __future__ import annotations

import argparse
import sys

import torch
from tqdm import tqdm

from captum_vit.registry import available_methods, build_method


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="random:vit",
                   help="timm:NAME (random weights unless --pretrained) or random:vit "
                        "(a small random-weight ViT, the default until a bundled model exists)")
    p.add_argument("--pretrained", action="store_true",
                   help="with timm:NAME, load weights already in the local cache")
    p.add_argument("--image", default=None, help="image file (any size); default: a sample")
    p.add_argument("--methods", default="all",
                   help=f"comma-separated names or 'all' ({', '.join(available_methods())})")
    p.add_argument("--target", type=int, default=None, help="class to explain (default: predicted)")
    p.add_argument("--out", default="explain.png", help="output PNG path")


def load_model(spec: str, pretrained: bool = False) -> tuple[torch.nn.Module, tuple[int, int], int]:
    """Build the model named by ``spec``; returns (model, input size, channels)."""
    if spec == "random:vit":
        from timm.models.vision_transformer import VisionTransformer

        torch.manual_seed(0)
        model = VisionTransformer(img_size=64, patch_size=8, embed_dim=96, depth=6, num_heads=4,
                                  num_classes=10)
        return model.eval(), (64, 64), 3
    if spec.startswith("timm:"):
        import timm

        name = spec.split(":", 1)[1]
        try:
            model = timm.create_model(name, pretrained=pretrained)
        except RuntimeError as e:
            raise ValueError(f"cannot load {spec!r}: {e}") from e
        except Exception as e:  # noqa: BLE001 - hub errors have many types
            hint = " (pretrained weights must already be in the local cache)" if pretrained else ""
            raise ValueError(f"cannot load {spec!r}{hint}: {e}") from e
        cfg = model.pretrained_cfg
        return model.eval(), tuple(cfg["input_size"][1:]), cfg["input_size"][0]
    raise ValueError(f"unknown model {spec!r}; use timm:NAME or random:vit")


def _load_image(path: str | None, size: tuple[int, int], chans: int) -> torch.Tensor:
    if path is None:
        g = torch.Generator().manual_seed(0)
        return torch.rand(1, chans, *size, generator=g)
    from PIL import Image

    img = Image.open(path).convert("L" if chans == 1 else "RGB").resize(size[::-1])
    t = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).float() / 255
    return t.reshape(size[0], size[1], chans).permute(2, 0, 1)[None]


def run(args: argparse.Namespace) -> int:
    from captum_vit.viz import plot_grid

    model, size, chans = load_model(args.model, args.pretrained)
    if args.model.startswith("random:"):
        print("note: explaining a random-weight ViT (no bundled trained model is installed)",
              file=sys.stderr)
    names = available_methods() if args.methods == "all" else args.methods.split(",")
    methods = {n: build_method(n, model) for n in names}
    x = _load_image(args.image, size, chans)
    with torch.no_grad():
        probs = model(x).softmax(-1)[0]
    target = int(probs.argmax()) if args.target is None else args.target
    maps = {}
    for name, method in tqdm(methods.items(), desc="methods", file=sys.stderr):
        maps[name] = method.attribute(x, target=target)
    title = f"class {target}, p={probs[target]:.2f}"
    plot_grid(x, maps, row_titles=[title], path=args.out)
    print(f"wrote {args.out}")
    return 0
