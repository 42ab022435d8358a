"""``captum-vit evaluate``: a metrics table (methods × metrics) with curves, under torchrun too.

Model specs (``--model``):

* ``zoo:NAME`` — a bundled model (:func:`captum_vit.zoo.load`), e.g. ``zoo:vit_fmnist_loc``;
* ``timm:NAME`` — ``timm.create_model(NAME)``: random weights seeded by ``--seed``, or with
  ``--pretrained`` the weights already in the local Hugging Face / torch hub cache (nothing
  is downloaded; a clear error names the cache when they are missing);
* ``file:PATH`` — ``PATH`` (``.safetensors``) with ``PATH`` minus suffix + ``.json`` holding
  ``{"kwargs": {...}}`` for timm's ``VisionTransformer``;
* ``random:vit_tiny`` / ``random:vit_small`` — a random-weight timm ViT built from
  ``--seed`` (3×32×32, patch 8, 10 classes / ViT-S/16 224), no download (tests, demos).

Data (``--data``): ``fmnist-loc`` (:class:`captum_vit.data.FashionMNISTLoc`, test split,
with masks), ``sample`` (:func:`captum_vit.data.load_sample`), ``folder:PATH`` (image files,
class = sub-folder index, no masks) or ``synthetic`` (images and rectangle masks drawn
from ``--seed`` and the example index, no download). Images are resized (bilinear) and
masks (nearest) to the model's input size; channels are repeated/averaged to match.

Under ``torchrun --nproc_per_node=K -m captum_vit.cli evaluate --num-examples N ...``
(``WORLD_SIZE`` > 1; spell ``--n`` as ``--num-examples`` there) every rank evaluates the
batches ``i ≡ rank (mod K)`` (gloo on CPU, nccl on CUDA) and rank 0 gathers and writes the
files; every random choice is seeded by ``--seed`` and the example index, so the files
equal those of a single process.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from captum_vit.metrics import faithfulness as fa
from captum_vit.metrics.localization import pointing_game, segmentation
from captum_vit.metrics.removal import REMOVALS, RandomMap, patch_maps
from captum_vit.metrics.results import MetricResult, plot_curves
from captum_vit.metrics.robustness import max_sensitivity, sparseness
from captum_vit.metrics.sanity import randomization

METRICS = ("perturbation", "aopc", "lodds", "deletion", "insertion", "token_ratio",
           "pointing_game", "segmentation", "max_sensitivity", "sparseness", "randomization")
NEEDS_MASKS = ("pointing_game", "segmentation")
RANDOM_MODELS = {
    "vit_tiny": dict(img_size=32, patch_size=8, in_chans=3, embed_dim=48, depth=3, num_heads=4,
                     mlp_ratio=2.0, num_classes=10),
    "vit_small": dict(img_size=224, patch_size=16, embed_dim=384, depth=12, num_heads=6),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``captum-vit evaluate``."""
    p.add_argument("--model", default="zoo:vit_fmnist_loc",
                   help="zoo:NAME | timm:NAME | file:PATH.safetensors | random:vit_tiny")
    p.add_argument("--pretrained", action="store_true",
                   help="with --model timm:NAME: load its pretrained weights from the local "
                        "cache (never downloads); without it the timm model has random weights")
    p.add_argument("--data", default="fmnist-loc",
                   help="fmnist-loc | sample | folder:PATH | synthetic")
    p.add_argument("--methods", nargs="+", default=["all"],
                   help="method names (comma or space separated; 'random' = chance level; "
                        "captum:<Class>; 'all')")
    p.add_argument("--metrics", nargs="+", default=["all"],
                   help=f"{', '.join(METRICS)} or 'all'")
    p.add_argument("--n", "--num-examples", dest="n", type=int, default=100,
                   help="number of examples (write --num-examples under torchrun, whose own "
                        "parser mistakes --n for an abbreviation of its options)")
    p.add_argument("--batch-size", type=int, default=16, help="images per batch")
    p.add_argument("--seed", type=int, default=0, help="seed of data, baselines and noise")
    p.add_argument("--removal", default="token", help=f"patch removal: {', '.join(REMOVALS)}")
    p.add_argument("--steps", type=int, default=20, help="deletion/insertion steps")
    p.add_argument("--target", default="predicted", choices=("predicted", "label"),
                   help="class explained and used for the perturbation accuracy")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    p.add_argument("--out", default="evaluation", help="output folder")


# -- names ----------------------------------------------------------------------------------
def _names(values: Sequence[str]) -> list[str]:
    return [n for v in values for n in v.split(",") if n]


def resolve_metrics(values: Sequence[str]) -> list[str]:
    """Metric names, ``all`` expanded; unknown names raise ``ValueError``."""
    names = _names(values)
    if "all" in names:
        return list(METRICS)
    for n in names:
        if n not in METRICS:
            raise ValueError(f"unknown metric {n!r}; choose from {', '.join(METRICS)} or 'all'")
    if not names:
        raise ValueError("--metrics is empty")
    return list(dict.fromkeys(names))


def resolve_methods(values: Sequence[str]) -> list[str]:
    """Method names, ``all`` = every registered method plus ``random``."""
    from captum_vit.registry import available_methods

    names = _names(values)
    if "all" in names:
        return list(dict.fromkeys(available_methods() + ["random"]))
    known = set(available_methods()) | {"random"}
    for n in names:
        if n not in known and not n.startswith("captum:"):
            raise ValueError(f"unknown method {n!r}; choose from {', '.join(sorted(known))}, "
                             "captum:<Class> or 'all'")
    if not names:
        raise ValueError("--methods is empty")
    return list(dict.fromkeys(names))


def build_method(name: str, model: nn.Module, seed: int) -> Any:
    from captum_vit.registry import build_method as build

    return RandomMap(model, seed=seed) if name == "random" else build(name, model)


# -- models ---------------------------------------------------------------------------------
def load_model(spec: str, seed: int, pretrained: bool = False
               ) -> tuple[nn.Module, Callable[[Tensor], Tensor] | None, tuple[str, ...] | None]:
    """The model of ``spec`` (eval mode), an optional tensor preprocessing and class names.

    Class names are known for ``zoo:NAME`` only (``None`` otherwise).

    ``pretrained`` applies to ``timm:NAME`` only (cached weights, see
    :func:`cached_timm_weights`); without it a timm model has random weights from ``seed``.
    """
    if pretrained and not spec.startswith("timm:"):
        raise ValueError(f"--pretrained applies to --model timm:NAME only, not {spec!r}")
    kind, _, name = spec.partition(":")
    if kind == "random":
        from timm.models.vision_transformer import VisionTransformer

        if name not in RANDOM_MODELS:
            raise ValueError(f"unknown random model {name!r}; choose from "
                             f"{', '.join(RANDOM_MODELS)}")
        torch.manual_seed(seed)
        return VisionTransformer(**RANDOM_MODELS[name]).eval(), None, None
    if kind == "file":
        from safetensors.torch import load_file
        from timm.models.vision_transformer import VisionTransformer

        path = Path(name)
        meta = path.with_suffix(".json")
        if not path.is_file() or not meta.is_file():
            raise FileNotFoundError(f"--model file:PATH needs {path} and {meta}")
        model = VisionTransformer(**json.loads(meta.read_text())["kwargs"])
        model.load_state_dict(load_file(str(path)))
        return model.eval(), None, None
    if kind == "timm":
        import timm

        try:
            torch.manual_seed(seed)
            model = timm.create_model(name, pretrained=False)
        except RuntimeError as e:  # timm: "Unknown model (...)"
            raise ValueError(f"--model timm:{name}: {e}; see timm.list_models()") from e
        if pretrained:
            path = cached_timm_weights(model.pretrained_cfg)
            model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(
                file=path, custom_load=path.endswith(".npz")))
        cfg = model.pretrained_cfg
        mean = torch.tensor(cfg.get("mean", (0.5, 0.5, 0.5)))[:, None, None]
        std = torch.tensor(cfg.get("std", (0.5, 0.5, 0.5)))[:, None, None]
        return model.eval(), lambda x: (x - mean.to(x)) / std.to(x), None
    if kind == "zoo":
        from captum_vit import zoo

        zm = zoo.load(name)
        return zm.model.eval(), zm.preprocess, zm.class_names
    raise ValueError(f"unknown model {spec!r}; use zoo:NAME, timm:NAME, file:PATH or "
                     f"random:{'|'.join(RANDOM_MODELS)}")


def cached_timm_weights(cfg: Any) -> str:
    """Path of the pretrained weights of a timm config in the local cache; never downloads.

    Looks in the Hugging Face hub cache (``cfg.hf_hub_id``; ``model.safetensors``, then
    ``pytorch_model.bin``, or ``cfg.hf_hub_filename``) and in torch hub's checkpoint folder
    (``cfg.url``), the two places ``timm.create_model(NAME, pretrained=True)`` stores them.

    Raises:
        FileNotFoundError: the weights are in neither cache; the message names both folders.
    """
    from urllib.parse import urlparse

    from huggingface_hub import constants, try_to_load_from_cache

    cfg = cfg if isinstance(cfg, dict) else cfg.to_dict()
    hub_id, url = cfg.get("hf_hub_id"), cfg.get("url")
    if hub_id:
        repo, _, rev = hub_id.partition("@")
        names = [cfg["hf_hub_filename"]] if cfg.get("hf_hub_filename") else [
            "model.safetensors", "pytorch_model.bin"]
        for fname in names:
            hit = try_to_load_from_cache(repo, fname, revision=rev or None)
            if isinstance(hit, str):
                return hit
    ckpt_dir = Path(torch.hub.get_dir()) / "checkpoints"
    if url and (ckpt_dir / Path(urlparse(url).path).name).is_file():
        return str(ckpt_dir / Path(urlparse(url).path).name)
    where = [f"Hugging Face cache {constants.HF_HUB_CACHE} ({hub_id})"] if hub_id else []
    where += [f"torch hub cache {ckpt_dir} ({Path(urlparse(url).path).name})"] if url else []
    raise FileNotFoundError(
        f"--pretrained: the weights of {cfg.get('architecture')} are not in the local cache "
        f"(looked in {' and '.join(where) or 'no source: the config names none'}); run "
        "timm.create_model(NAME, pretrained=True) once where the hub can be reached, or drop "
        "--pretrained for random weights")


def model_input(model: nn.Module) -> tuple[int, tuple[int, int]]:
    """Channels and (H, W) the model expects."""
    pe = model.patch_embed
    return int(pe.proj.in_channels), tuple(int(s) for s in pe.img_size)


# -- data -----------------------------------------------------------------------------------
class SyntheticLoc:
    """Seeded images [C, H, W] with a brighter random rectangle and its mask (per index)."""

    def __init__(self, n: int, channels: int, size: tuple[int, int], num_classes: int,
                 seed: int) -> None:
        self.n, self.c, self.size, self.k, self.seed = n, channels, size, num_classes, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Tensor, int, Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        h, w = self.size
        img = 0.3 * torch.randn(self.c, h, w, generator=g, dtype=torch.float64)
        bh = int(torch.randint(h // 4, h // 2 + 1, (1,), generator=g))
        bw = int(torch.randint(w // 4, w // 2 + 1, (1,), generator=g))
        y = int(torch.randint(0, h - bh + 1, (1,), generator=g))
        x = int(torch.randint(0, w - bw + 1, (1,), generator=g))
        mask = torch.zeros(h, w, dtype=torch.bool)
        mask[y:y + bh, x:x + bw] = True
        img[:, mask] += 1.0
        return img.float(), i % self.k, mask


class FolderImages:
    """Image files under a folder; label = index of the sorted sub-folder (or -1)."""

    EXT = (".png", ".jpg", ".jpeg", ".bmp", ".webp")

    def __init__(self, root: str) -> None:
        r = Path(root)
        if not r.is_dir():
            raise FileNotFoundError(f"--data folder:{root}: no such folder")
        self.files = sorted(p for p in r.rglob("*") if p.suffix.lower() in self.EXT)
        classes = sorted({p.parent for p in self.files} - {r})
        self.label = {c: i for i, c in enumerate(classes)}

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[Tensor, int, None]:
        import numpy as np
        from PIL import Image

        arr = np.asarray(Image.open(self.files[i]).convert("RGB"), dtype=np.float32) / 255
        label = self.label.get(self.files[i].parent, -1)
        return torch.from_numpy(arr).permute(2, 0, 1), label, None


def load_data(spec: str, n: int, seed: int, model: nn.Module) -> Any:
    """A sequence of ``(image [C, H, W], label, mask [H, W] or None)``."""
    channels, size = model_input(model)
    kind, _, arg = spec.partition(":")
    if spec == "synthetic":
        return SyntheticLoc(n, channels, size, int(model.num_classes), seed)
    if spec == "fmnist-loc":
        from captum_vit.data import FashionMNISTLoc

        return FashionMNISTLoc(split="test", seed=seed, n=n)
    if spec == "sample":
        from captum_vit.data import load_sample

        s = load_sample()
        count = min(n, len(s["labels"]))
        return [{"image": s["images"][i], "label": s["labels"][i], "mask": s["masks"][i]}
                for i in range(count)]
    if kind == "folder":
        return FolderImages(arg)
    raise ValueError(f"unknown data {spec!r}; use fmnist-loc, sample, folder:PATH or synthetic")


def _item(raw: Any) -> tuple[Tensor, int, Tensor | None]:
    if isinstance(raw, dict):
        return raw["image"], int(raw.get("label", -1)), raw.get("mask")
    img, label = raw[0], raw[1]
    mask = raw[2] if len(raw) > 2 and isinstance(raw[2], Tensor) else None
    return torch.as_tensor(img), int(label), mask


def make_batch(data: Any, indices: Sequence[int], model: nn.Module,
               pre: Callable[[Tensor], Tensor] | None, device: torch.device,
               dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor | None]:
    """Images resized to the model, labels and masks (None if any example has none)."""
    channels, size = model_input(model)
    imgs, labels, masks = [], [], []
    for i in indices:
        img, label, mask = _item(data[i])
        img = img.float()
        if img.dim() == 2:
            img = img[None]
        if img.shape[0] != channels:
            if img.shape[0] != 1 and channels != 1:
                raise ValueError(f"images have {img.shape[0]} channels, the model {channels}")
            img = img.mean(0, keepdim=True).expand(channels, -1, -1)
        if tuple(img.shape[-2:]) != size:
            img = F.interpolate(img[None], size=size, mode="bilinear", align_corners=False)[0]
        if pre is not None:
            img = pre(img)
        if mask is not None:
            mask = torch.as_tensor(mask).bool().reshape(mask.shape[-2:])
            if tuple(mask.shape) != size:
                mask = F.interpolate(mask[None, None].float(), size=size, mode="nearest")[0, 0] > 0
        imgs.append(img)
        labels.append(label)
        masks.append(mask)
    x = torch.stack(imgs).to(device=device, dtype=dtype)
    m = None if any(k is None for k in masks) else torch.stack(masks).to(device)
    return x, torch.tensor(labels, device=device), m


# -- evaluation -----------------------------------------------------------------------------
def evaluate_batch(model: nn.Module, x: Tensor, labels: Tensor, masks: Tensor | None,
                   method: str, attr: Any, metrics: Sequence[str], args: argparse.Namespace,
                   ids: Sequence[int]) -> dict[str, MetricResult]:
    """Every requested metric of one method (``attr``, named ``method``) on one batch."""
    with torch.no_grad():
        logits = model(x)
    target = logits.argmax(-1) if args.target == "predicted" else labels
    from captum_vit.adapters import adapt

    layout = adapt(model).layout(x)
    maps = patch_maps(attr, x, target, layout)  # computed once, reused by map metrics
    kw = dict(removal=args.removal, batch_size=args.batch_size * 4, example_ids=ids,
              seed=args.seed, target=target)
    out: dict[str, MetricResult] = {}
    gt = labels if args.target == "label" else None
    for m in metrics:
        if m == "perturbation":
            for order in ("positive", "negative"):
                r = fa.perturbation_test(model, x, maps, order=order, labels=gt, **kw)
                out[r.name] = r
        elif m in ("aopc", "lodds", "deletion", "insertion"):
            fn = getattr(fa, m)
            extra = {"n_steps": args.steps} if m in ("deletion", "insertion") else {}
            out[m] = fn(model, x, maps, **extra, **kw)
        elif m == "token_ratio":
            out.update(fa.token_ratio(model, x, maps, **kw))
        elif m == "pointing_game":
            out[m] = pointing_game(model, x, maps, masks, target=target)
        elif m == "segmentation":
            out.update(segmentation(model, x, maps, masks, target=target))
        elif m == "sparseness":
            out[m] = sparseness(model, x, maps, target=target)
        elif m == "max_sensitivity":
            out[m] = max_sensitivity(model, x, attr, target=target, seed=args.seed,
                                     example_ids=ids)
        elif m == "randomization":
            out[m] = randomization(model, x, method if method != "random" else attr,
                                   target=target, seed=args.seed)
    cols: dict[str, MetricResult] = {}
    for k, v in out.items():
        cols[k] = v.to("cpu")
        if k == "insertion" and "deletion" in out:  # the column right after insertion
            cols["insertion_minus_deletion"] = fa.insertion_minus_deletion(
                out["insertion"], out["deletion"]).to("cpu")
    return cols


def _dist() -> tuple[int, int, bool]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    return rank, world, world > 1


def _device(spec: str, distributed: bool) -> torch.device:
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cuda" and distributed:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device(spec)


def run(args: argparse.Namespace) -> int:
    """Run ``captum-vit evaluate``; returns the exit status (files written by rank 0)."""
    from tqdm import tqdm

    metrics = resolve_metrics(args.metrics)
    methods = resolve_methods(args.methods)
    if args.removal not in REMOVALS:
        raise ValueError(f"unknown --removal {args.removal!r}; choose from {', '.join(REMOVALS)}")
    if args.n < 1 or args.batch_size < 1:
        raise ValueError("--n and --batch-size must be positive")
    rank, world, distributed = _dist()
    device = _device(args.device, distributed)
    if distributed and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        dtype = getattr(torch, args.dtype)
        model, pre, _ = load_model(args.model, args.seed, args.pretrained)
        model = model.to(device=device, dtype=dtype)
        data = load_data(args.data, args.n, args.seed, model)
        n = min(args.n, len(data))
        if n == 0:
            raise ValueError(f"the dataset {args.data!r} is empty; nothing to evaluate")
        if any(m in NEEDS_MASKS for m in metrics) and _item(data[0])[2] is None:
            if _names(args.metrics) != ["all"]:
                raise ValueError(f"{', '.join(m for m in metrics if m in NEEDS_MASKS)} need "
                                 f"ground-truth masks, which --data {args.data} lacks; use "
                                 "fmnist-loc or synthetic")
            metrics = [m for m in metrics if m not in NEEDS_MASKS]
        batches = [list(range(i, min(i + args.batch_size, n)))
                   for i in range(0, n, args.batch_size)]
        mine = list(range(rank, len(batches), world))
        attrs = {meth: build_method(meth, model, args.seed) for meth in methods}
        local: dict[int, dict[str, dict[str, MetricResult]]] = {}
        with each_warning_once():
            for b in tqdm(mine, desc=f"evaluate (rank {rank})" if distributed else "evaluate",
                          disable=rank != 0, file=sys.stderr):
                x, labels, masks = make_batch(data, batches[b], model, pre, device, dtype)
                local[b] = {meth: evaluate_batch(model, x, labels, masks, meth, attrs[meth],
                                                 metrics, args, batches[b])
                            for meth in methods}
        parts: list[Any] = [local]
        if distributed:
            parts = [None] * world
            torch.distributed.all_gather_object(parts, local)
        if rank == 0:
            merged = {k: v for p in parts for k, v in p.items()}
            results = {meth: _cat([merged[b][meth] for b in range(len(batches))])
                       for meth in methods}
            write_outputs(Path(args.out), results, _config(args, metrics, methods, n))
            print(f"wrote {args.out}/results.md, results.csv, results.json", file=sys.stderr)
    finally:
        if distributed and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
    return 0


@contextmanager
def each_warning_once() -> Iterator[None]:
    """Show each distinct warning (message and category) once while the block runs.

    Python shows a warning once per code location, but every change to the warning filters
    (``warnings.catch_warnings`` in third-party code, e.g. during Max-Sensitivity) forgets
    what was shown, including the ``"once"`` registry, so a per-call warning such as TIS's
    ``n_masks`` clamp came back for every batch of an evaluation. This de-duplicates at
    ``warnings.showwarning`` instead; the previous hook and filters are restored on exit.
    """
    seen: set[tuple[str, type]] = set()
    with warnings.catch_warnings():
        show = warnings.showwarning

        def show_once(message: Warning | str, category: type[Warning], *args: Any,
                      **kwargs: Any) -> None:
            key = (str(message), category)
            if key not in seen:
                seen.add(key)
                show(message, category, *args, **kwargs)

        warnings.showwarning = show_once
        yield


def _cat(parts: Sequence[dict[str, MetricResult]]) -> dict[str, MetricResult]:
    return {k: MetricResult.cat([p[k] for p in parts]) for k in parts[0]}


def _config(args: argparse.Namespace, metrics: list[str], methods: list[str],
            n: int) -> dict[str, Any]:
    return {"model": args.model, "data": args.data, "methods": methods, "metrics": metrics,
            "n": n, "batch_size": args.batch_size, "seed": args.seed,
            "removal": args.removal, "steps": args.steps, "target": args.target,
            "dtype": args.dtype}


# -- outputs --------------------------------------------------------------------------------
def _fmt(v: float) -> str:
    return "nan" if math.isnan(v) else f"{v:.4g}"


def write_outputs(out: Path, results: dict[str, dict[str, MetricResult]],
                  config: dict[str, Any]) -> None:
    """``results.csv``, ``results.json``, ``results.md`` and ``curve_<metric>.png``."""
    out.mkdir(parents=True, exist_ok=True)
    methods = list(results)
    cols = list(dict.fromkeys(c for m in methods for c in results[m]))
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "metric", "value", "higher_is_better", "n"])
        for m in methods:
            for c, r in results[m].items():
                w.writerow([m, c, repr(r.value), int(r.higher_is_better), len(r)])
    payload = {"config": config,
               "results": {m: {c: r.to_dict() for c, r in results[m].items()} for m in methods}}
    (out / "results.json").write_text(json.dumps(payload, indent=1, allow_nan=False))
    arrows = {c: "↑" if next(results[m][c] for m in methods if c in results[m]).higher_is_better
              else "↓" for c in cols}
    lines = [f"# Evaluation: {config['model']} on {config['data']} (n={config['n']}, "
             f"removal={config['removal']}, seed={config['seed']})", "",
             "| method | " + " | ".join(f"{c} {arrows[c]}" for c in cols) + " |",
             "|---|" + "---:|" * len(cols)]
    for m in methods:
        vals = [_fmt(results[m][c].value) if c in results[m] else "" for c in cols]
        lines.append(f"| {m} | " + " | ".join(vals) + " |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    for c in cols:
        curves = {m: results[m][c] for m in methods
                  if c in results[m] and results[m][c].curves is not None}
        if curves:
            plot_curves(curves, out / f"curve_{c}.png",
                        xlabel="randomised stages" if c == "randomization" else "fraction")
