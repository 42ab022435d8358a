"""``captum-vit explain``: a figure of the input and every method's map, grouped by method kind.

Models (``--model``): :mod:`captum_vit.models`; methods (``--methods``):
:mod:`captum_vit.registry`; image reading: :mod:`captum_vit.data.images`; video reading
(``--video``): :mod:`captum_vit.commands.videos`; drawing: :mod:`captum_vit.viz` (a video
gets a contact sheet of its frames and the maps, :func:`captum_vit.viz.video_sheet`, and
with ``--animation`` an animated GIF or MP4). This module only parses options.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from captum_vit import viz
from captum_vit._text import count_noun
from captum_vit.adapters import adapt, probabilities
from captum_vit.commands.options import (
    add_target_embedding_arguments,
    add_target_kind_argument,
    parse_class,
    target_embeddings,
    target_kind,
)
from captum_vit.data.images import conform, read_image
from captum_vit.metrics.report import ensure_file_location
from captum_vit.models import SPEC_HELP, load_model
from captum_vit.registry import (
    KINDS,
    METHODS,
    api_defaults,
    available_methods,
    build_method,
    method_kind,
    parse_methods,
    quick_options,
    takes_option,
)
from captum_vit.targets import Contrastive, MultiLabel

DEFAULT_MODEL = "zoo:vit_fmnist_loc"

EPILOG = """examples:
  captum-vit explain                                   # bundled model, sample image, all methods
  captum-vit explain --image shoe.png --target Sneaker --methods gae,rollout,tis --out maps.png
  captum-vit explain --methods tis,rise --n-masks 2000 # more masks than the quick look
  captum-vit explain --methods tis --tolerance 0.99     # TIS anytime mode
  captum-vit explain --full --methods all              # every method at its API defaults
  captum-vit explain --model hf:videomae_folder --video frames/ --methods gae,rollout \
      --animation gif                                  # a video: contact sheet + GIF"""


def describe_settings(options: dict[str, dict]) -> str:
    """Method options as text, with each option's API default, methods with the same
    options together: ``"tis n_masks=128 (API default 1024); bt_h/tam n_steps=5 (API
    default 20)"``.

    Args:
        options (dict[str, dict]): method name -> ``attribute`` options.

    Returns:
        str: ``""`` when no method has options.
    """
    by_setting: dict[str, list[str]] = {}
    for name, opts in options.items():
        if opts:
            api = api_defaults(name, list(opts))
            text = ", ".join(f"{k}={v} (API default {api.get(k)})" for k, v in opts.items())
            by_setting.setdefault(text, []).append(name)
    return "; ".join(f"{'/'.join(ns)} {text}" for text, ns in by_setting.items())


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``captum-vit explain``.

    Args:
        p (argparse.ArgumentParser): the command's parser.
    """
    p.description = (
        "Explain one image with every requested method and save a figure: the input and "
        "one panel per method, grouped by method kind. A map that is numerically zero "
        "(e.g. the plain gradient of a class-token ViT) is marked and drawn flat.\n\n"
        "A video model explains a video (--video: a folder of frames or a tensor file): "
        "the figure is a contact sheet, one column per frame, a row of frames and a row "
        "per method with its map (per tubelet) over each frame; one figure per video of a "
        "batch.\n\n"
        "The slow methods run with quick settings: "
        f"{describe_settings({e.name: e.quick for e in METHODS})}. --full runs every method "
        "at its API defaults (slower); --n-masks (TIS, RISE) and --tolerance (TIS's "
        "anytime mode) set their budget either way.")
    p.epilog = EPILOG
    p.add_argument("--model", default=DEFAULT_MODEL, help=SPEC_HELP)
    p.add_argument("--pretrained", action="store_true",
                   help="with --model timm:NAME, torchvision:NAME or open_clip:ARCH[:TAG]: load "
                        "its pretrained weights from the local cache (never downloads); "
                        "without it the model has random weights")
    p.add_argument("--classes", default=None, metavar="FILE",
                   help="class names of the model, one per line (for timm/file/random models)")
    inputs = p.add_mutually_exclusive_group()
    inputs.add_argument("--image", default=None,
                        help="image file of any size (default: a bundled FashionMNIST-Loc "
                             "sample)")
    inputs.add_argument("--video", default=None, metavar="PATH",
                        help="for a video model: a folder of frames (image files of one size, "
                             "in natural order of their names) or a tensor file (.pt/.pth) "
                             "holding [T, C, H, W] or a batch [B, T, C, H, W], frames before "
                             "channels, floats in [0, 1] or uint8; frames are resized to the "
                             "model's size, their count must be the model's")
    p.add_argument("--methods", default="all",
                   help="comma-separated names or 'all' "
                        f"({', '.join(available_methods(baselines=False))}; also GAE, "
                        "plus:<name>, SkipPLUS(<name>), captum:<Class>)")
    p.add_argument("--target", default=None, metavar="CLASS",
                   help="class to explain: an index or a class name of the model, any case "
                        "(e.g. Sneaker), or the row of --target-embeddings (default: the "
                        "predicted class)")
    add_target_kind_argument(p)
    add_target_embedding_arguments(p)
    p.add_argument("--full", action="store_true",
                   help="run every method at its API defaults instead of the quick settings "
                        "(see above)")
    p.add_argument("--n-masks", type=_positive_int, default=None, metavar="N",
                   help="masks of TIS and RISE (default: the quick settings, or the API "
                        "defaults with --full)")
    p.add_argument("--tolerance", type=float, default=None, metavar="RHO",
                   help="TIS anytime mode: stop scoring masks once the estimated correlation "
                        "with the converged map reaches RHO, e.g. 0.99 (default: off, every "
                        "mask is scored)")
    p.add_argument("--seed", type=int, default=0, help="seed of random models and methods")
    p.add_argument("--display", default="nearest", choices=viz.DISPLAYS,
                   help="nearest: each patch one colour, as computed (default); bilinear: "
                        "smoothed for display")
    p.add_argument("--out", default="explain.png",
                   help="output file, PNG unless its suffix names another format (.pdf, "
                        ".svg ...); its folder is created. A batch of videos writes one "
                        "file per video, NAME_0.png, NAME_1.png ...")
    p.add_argument("--animation", default=None, choices=viz.VIDEO_FORMATS,
                   help="with --video: also write each video's animation (frames beside "
                        "their maps) next to --out, with this suffix (mp4 needs ffmpeg)")
    p.add_argument("--fps", type=float, default=4.0,
                   help="frames per second of --animation")


def _positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def method_options(name: str, args: argparse.Namespace) -> dict:
    """The ``attribute`` options of method ``name`` under the command's options: the quick
    settings (none with ``--full``), then ``--n-masks`` and ``--tolerance`` where the
    method takes them.

    Args:
        name (str): a canonical method name.
        args (argparse.Namespace): the parsed options.

    Returns:
        dict: keyword arguments for ``attribute``.
    """
    opts = {} if args.full else quick_options(name)
    if args.n_masks is not None and takes_option(name, "n_masks"):
        opts["n_masks"] = args.n_masks
    if args.tolerance is not None and takes_option(name, "tolerance"):
        opts["tolerance"] = args.tolerance
    return opts


def settings_note(options: dict[str, dict], full: bool) -> str:
    """The figure's footnote: the settings the methods ran with and how to change them.

    Args:
        options (dict[str, dict]): method name -> the options it ran with.
        full (bool): whether ``--full`` was given.

    Returns:
        str: one or two lines.
    """
    used = describe_settings(options)
    if full:
        return "every method at its API defaults (--full)" + (f", except {used}" if used else "")
    if not any(quick_options(n) for n in options):
        return f"settings: {used}" if used else "every method at its API defaults"
    return (f"quick settings: {used}\n"
            "rerun with --full for every method's API defaults (slower)")


def _out_file(path: str) -> str:
    """The file ``--out`` writes: a name without suffix gets ``.png`` (what matplotlib
    appends), so the message names the real file."""
    out = ensure_file_location(path, formats=viz.figure_formats())
    return str(out if out.suffix else out.with_name(out.name + ".png"))


def run(args: argparse.Namespace) -> int:
    """Explain one image (or the videos of ``--video``) with every requested method and
    write the figure(s).

    Args:
        args (argparse.Namespace): the parsed options.

    Returns:
        int: the exit status.
    """
    names = parse_methods(args.methods, for_explain=True)
    if args.tolerance is not None and not 0 < args.tolerance <= 1:
        raise ValueError(f"--tolerance must be in (0, 1], got {args.tolerance}")
    video = getattr(args, "video", None)
    animation = getattr(args, "animation", None)
    if animation is not None and video is None:
        raise ValueError("--animation applies to --video; give --video FOLDER or FILE.pt")
    if video is not None and not args.fps > 0:
        raise ValueError(f"--fps must be > 0, got {args.fps}")
    out = _out_file(args.out)
    if video is not None and animation == "mp4":
        from matplotlib import animation as mpl_animation

        if not mpl_animation.writers.is_available("ffmpeg"):
            raise ValueError("--animation mp4 needs ffmpeg, which matplotlib cannot find: "
                             "install it (e.g. apt-get install ffmpeg) or use --animation gif")
    for option, value in (("n_masks", args.n_masks), ("tolerance", args.tolerance)):
        if value is not None and not any(takes_option(n, option) for n in names):
            print(f"note: --{option.replace('_', '-')} applies to none of the methods "
                  "given", file=sys.stderr)
    lm = load_model(args.model, seed=args.seed, pretrained=args.pretrained,
                    class_names=args.classes, targets=target_embeddings(args))
    scoring = lm.scoring()  # embedding models: scored against --target-embeddings
    if lm.random_weights:
        hint = ("; add --pretrained for the trained weights in the local cache"
                if args.model.startswith(("timm:", "torchvision:", "open_clip:")) else "")
        print(f"note: explaining a random-weight ViT{hint}", file=sys.stderr)
    adapter = adapt(lm.model)
    if video is not None:
        from captum_vit.commands.videos import read_video, video_inputs

        x_all, shown_all = video_inputs(read_video(video), adapter, lm.preprocess,
                                        f"--video {video}")
    else:
        if args.image is not None:
            from captum_vit.commands.videos import is_video_path

            if is_video_path(args.image):
                raise ValueError(f"--image {args.image} is a folder or a tensor file: pass a "
                                 "video with --video (for a video model), an image file "
                                 "with --image")
        if adapter.video:
            want = getattr(adapter, "num_frames", None)
            frames = f" of {int(want)} frames" if want is not None else ""
            raise ValueError(f"--model {args.model} takes videos [T, C, H, W]{frames}, not "
                             f"{'an image' if args.image else 'the sample image'}: pass "
                             "--video FOLDER (its frames as image files) or --video FILE.pt "
                             "([T, C, H, W])")
        if args.image is None:
            from captum_vit.data import load_sample

            image = load_sample()["images"][0]
        else:
            image = read_image(args.image)
        x_all = lm.preprocess(image)[None]
        shown_all = conform(image, *lm.input_shape)[None]  # the model's view, unnormalised
    kinds = {n: method_kind(n) for n in names}
    order = list(KINDS)
    names = sorted(names, key=lambda n: order.index(kinds[n]))  # stable within a kind
    options = {n: method_options(n, args) for n in names}
    groups = {n: KINDS[kinds[n]] for n in names}
    outs = ([out] if x_all.shape[0] == 1 else
            [_numbered(out, i) for i in range(x_all.shape[0])])
    for i, path in enumerate(outs):
        x, shown = x_all[i:i + 1], shown_all[i]
        with scoring:
            logits, probs, target, pair, maps, refused = _explain_input(
                args, lm, x, names, options)
        for n, message in refused.items():
            print(f"note: {n} refused this model or target ({message.splitlines()[0]})"
                  + ("; its panel says so" if video is None else ""), file=sys.stderr)
        scale = float(logits.detach().abs().max())
        flat = [n for n, z in viz.near_zero(maps, reference=scale).items() if bool(z[0])]
        for n in flat:
            print(f"note: {n}'s map is numerically zero here (max |map| "
                  f"{float(maps[n].abs().max()):.1e} next to logits up to {scale:.3g})"
                  "; drawn flat", file=sys.stderr)
        note = settings_note(options, args.full)
        if video is None:
            viz.plot_grid(shown[None], maps, path=path, display=args.display, groups=groups,
                          reference=scale, note=note, refused=refused,
                          row_titles=[_title(probs, target, lm.class_names, pair, "\n")])
        else:
            if refused:
                note += "\nrefused: " + "; ".join(
                    f"{n} ({m.splitlines()[0]})" for n, m in refused.items())
            written = [path]
            title = _title(probs, target, lm.class_names, pair, " ")
            viz.plot_video(shown, maps, path=path, display=args.display, title=title,
                           note=note, row_titles=["video"], reference=scale)
            if animation is not None:
                moving = str(Path(path).with_suffix("." + animation))
                viz.plot_video(shown, maps, path=moving, fps=args.fps, display=args.display,
                               title=title)
                written.append(moving)
        count = count_noun(len(maps), "method") + (f" ({len(refused)} more refused)"
                                                   if refused else "")
        what = " and ".join(written) if video is not None else path
        print(f"wrote {what}: {count}, {_title(probs, target, lm.class_names, pair, ' ')}")
    return 0


def _numbered(out: str, i: int) -> str:
    """``--out`` of video ``i`` of a batch: ``NAME_i.SUFFIX``."""
    p = Path(out)
    return str(p.with_name(f"{p.stem}_{i}{p.suffix}"))


def _explain_input(args: argparse.Namespace, lm: Any, x: torch.Tensor, names: list[str],
                   options: dict[str, dict]) -> tuple[torch.Tensor, torch.Tensor, int,
                                                      tuple[int, int] | None,
                                                      dict[str, torch.Tensor], dict[str, str]]:
    """One input's logits, probabilities, explained class (and contrasted pair), every
    method's grid map and the refusals (inside the model's scoring)."""
    with torch.no_grad():
        logits = adapt(lm.model).model_logits(x)[0]
    kind, pair = target_kind(args.target_kind, lm.class_names, logits.shape[-1])
    if kind != "class" and lm.targets is not None:
        raise ValueError("--target-kind applies to classifiers; an embedding model is "
                         "explained against --target-embeddings")
    probs = logits.sigmoid() if kind == "multilabel" else probabilities(
        logits[None], adapt(lm.model).probability)[0]
    if pair is not None and args.target is not None:
        raise ValueError("--target-kind contrastive:A,B names the classes; drop --target")
    target = pair[0] if pair is not None else parse_class(args.target, lm.class_names,
                                                          probs.shape[0])
    target = int(probs.argmax()) if target is None else target
    explained: Any = target
    if kind == "multilabel":
        explained = MultiLabel(target)
    elif pair is not None:
        explained = Contrastive(*pair)
    maps, refused = _explain_each(names, lm.model, x, explained, options, args.seed)
    return logits, probs, target, pair, maps, refused


REFUSALS = (ValueError, TypeError, NotImplementedError)
"""The exceptions by which a method refuses a model or a target (with a message saying
why and what to use instead)."""


def _explain_each(names: list[str], model: torch.nn.Module, x: torch.Tensor, target: Any,
                  options: dict[str, dict], seed: int
                  ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every method's grid map, and the message of every method that refused: one refusal
    does not cost the other methods' maps. When every method refuses, the first refusal is
    raised (there is nothing to draw)."""
    maps: dict[str, torch.Tensor] = {}
    refused: dict[str, str] = {}
    first: Exception | None = None
    for name in tqdm(names, desc="methods", file=sys.stderr):
        try:
            maps[name] = build_method(name, model, seed=seed).attribute(
                x, target=target, output="grid", **options[name])
        except REFUSALS as error:
            first = first or error
            refused[name] = f"{type(error).__name__}: {error}"
    if not maps and first is not None:
        raise first
    return maps, refused


def _title(probs: torch.Tensor, target: int, names: Any, pair: tuple[int, int] | None,
           sep: str) -> str:
    """The figure's row title: the explained class (and its probability), or "A vs B"."""
    if pair is None:
        return viz.prediction_title(probs, target, names, sep=sep)
    a, b = (str(names[c]) if names else str(c) for c in pair)
    return f"{a}{sep}vs {b}"
