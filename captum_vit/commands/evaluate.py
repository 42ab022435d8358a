"""``captum-vit evaluate``: a metrics table (methods × metrics) with curves, under torchrun too.

Models (``--model``): :mod:`captum_vit.models`; data (``--data``):
:mod:`captum_vit.data.specs`; methods (``--methods``): :mod:`captum_vit.registry`; metrics
(``--metrics``): :data:`captum_vit.metrics.suite.METRICS`; compositions (``--compose``):
:func:`captum_vit.registry.parse_methods`; files:
:func:`captum_vit.metrics.report.write_outputs`. This module only parses options.

Under ``torchrun --nproc_per_node=K -m captum_vit.cli evaluate --num-examples N ...``
(``WORLD_SIZE`` > 1; spell ``--n`` as ``--num-examples`` there) every rank evaluates the
batches ``i ≡ rank (mod K)`` (gloo on CPU, nccl on CUDA) and rank 0 writes the files;
every random choice is seeded by ``--seed`` and the example index, so the files equal
those of a single process (except the measured time per image).

The command shows one progress bar per method (``method 3/7: gae``), prints the results
as an aligned table on standard output at the end (with each method's seconds per image,
also stored in ``results.json`` and ``results.md``), and its messages on standard error.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from captum_vit.adapters import adapt
from captum_vit.commands.options import (
    add_target_embedding_arguments,
    add_target_kind_argument,
    target_embeddings,
    target_kind,
)
from captum_vit.data.specs import SPEC_HELP as DATA_HELP
from captum_vit.data.specs import load_data
from captum_vit.metrics import parallel, protocols, report, suite
from captum_vit.metrics.settings import REMOVALS, EvalSettings
from captum_vit.metrics.table import MethodFactory
from captum_vit.models import SPEC_HELP as MODEL_HELP
from captum_vit.models import load_model
from captum_vit.registry import METHODS, canonical_name, method_factory, parse_methods
from captum_vit.targets import Contrastive


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``captum-vit evaluate``."""
    p.add_argument("--model", default="zoo:vit_fmnist_loc", help=MODEL_HELP)
    p.add_argument("--pretrained", action="store_true",
                   help="with --model timm:NAME, torchvision:NAME or open_clip:ARCH[:TAG]: load "
                        "its pretrained weights from the local cache (never downloads); "
                        "without it the model has random weights")
    p.add_argument("--classes", default=None, metavar="FILE",
                   help="class names of the model, one per line (for timm/file/random models; "
                        "matches folder names with --target label)")
    p.add_argument("--data", default="fmnist-loc", help=DATA_HELP)
    p.add_argument("--methods", nargs="+", default=["all"],
                   help="method names, comma or space separated (GAE, skipplus:decompx, "
                        "plus:<any method>, captum:<Class>, random = chance level, 'all')")
    p.add_argument("--compose", default=None, metavar="COMBINATORS",
                   help="also evaluate every selected method composed with these "
                        "combinators, e.g. 'plus,skipplus' adds plus:<m> and skipplus:<m> "
                        "after each method m (not after compositions, FullGrad+ or random)")
    p.add_argument("--metrics", nargs="+", default=["all"],
                   help=f"{', '.join(suite.METRICS)} or 'all'")
    p.add_argument("--n", "--num-examples", dest="n", type=positive_int, default=None,
                   help="number of examples: 100 by default, all of --subset with it (write "
                        "--num-examples under torchrun, whose own parser mistakes --n for an "
                        "abbreviation of its options)")
    p.add_argument("--subset", type=positive_int, default=None, metavar="N",
                   help="a seeded random subset of N examples of --data (as the papers' "
                        "seeded subsets, e.g. TIS's 5,000 ImageNet val images); its indices "
                        "are saved in results.json")
    p.add_argument("--subset-seed", type=int, default=0, metavar="S",
                   help="seed of --subset (default 0)")
    p.add_argument("--class-map", default=None, metavar="FILE",
                   help='JSON {"data class name": model class index}: labels of --data by '
                        "this map instead of matching class names")
    p.add_argument("--batch-size", type=positive_int, default=16, help="images per batch")
    p.add_argument("--seed", type=int, default=0, help="seed of data, baselines and noise")
    p.add_argument("--removal", default="token", choices=REMOVALS, help="patch removal")
    p.add_argument("--steps", type=positive_int, default=20, help="deletion/insertion steps")
    p.add_argument("--target", default="predicted", choices=suite.TARGETS,
                   help="class explained and used for the perturbation accuracy")
    add_target_kind_argument(p)
    add_target_embedding_arguments(p)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    p.add_argument("--autocast", default="none", choices=tuple(suite.AUTOCAST),
                   help="bf16: run forwards and backwards under torch.autocast in bfloat16 "
                        "(GPU throughput; maps and metrics stay float32; --dtype float32)")
    p.add_argument("--protocol", default=None, choices=tuple(protocols.PROTOCOLS),
                   help="a paper's evaluation protocol: fixes the metrics, removal, steps and "
                        "explained class, prints them and also writes protocol.md in the "
                        "paper's table layout")
    p.add_argument("--protocol-normalization", default="model",
                   choices=protocols.NORMALIZATIONS,
                   help="with --protocol: 'model' (default) feeds the model its own "
                        "normalisation; 'paper' the paper's Normalize(mean, std), meant for "
                        "the paper's own model (refused when its channel count differs from "
                        "the model's). A warning says when the two differ")
    p.add_argument("--out", default="evaluation", help="output folder (created at once)")


def protocol_factories(protocol: protocols.Protocol, methods: Sequence[str], *, seed: int = 0
                       ) -> dict[str, MethodFactory]:
    r"""Method factories (``model -> Attribution``) for a preset, from method names: the
    preset's :attr:`~captum_vit.metrics.protocols.Protocol.method_options` for the methods
    it sets options of (Chefer's scripts: Rollout and Chefer'21 with ``start_layer=1``),
    :func:`captum_vit.registry.method_factory` for the others.

    Args:
        protocol (Protocol): the preset.
        methods (Sequence[str]): method names (any spelling of the registry).
        seed (int, optional): seed of seeded methods. Default 0.

    Returns:
        dict[str, Callable]: name as given -> factory, for
        :func:`captum_vit.metrics.protocols.run_protocol`.

    Raises:
        ValueError: an unknown method name.

    Examples::

        >>> from captum_vit.commands.evaluate import protocol_factories
        >>> from captum_vit.metrics.protocols import get_protocol
        >>> f = protocol_factories(get_protocol("chefer21_perturbation"), ["rollout", "gae"])
        >>> f["rollout"](model).start_layer
        1
    """
    out: dict[str, MethodFactory] = {}
    for m in methods:
        opts = protocol.method_options.get(canonical_name(m))
        if opts:
            cls = next(e.cls for e in METHODS if e.name == canonical_name(m))
            out[m] = _bound(cls, dict(opts))
        else:
            out[m] = method_factory(m, seed=seed)
    return out


def _bound(cls: type, opts: dict) -> MethodFactory:
    def factory(model: Any) -> Any:
        return cls(model, **opts)
    return factory


def settings_of(args: argparse.Namespace) -> EvalSettings:
    """The :class:`~captum_vit.metrics.settings.EvalSettings` of the command's options.

    Args:
        args (argparse.Namespace): parsed options: ``--removal``, ``--steps``,
            ``--batch-size``, ``--seed``, ``--target`` (the settings' ``explain``),
            ``--autocast``.

    Returns:
        EvalSettings: the settings (``forward_batch``: 4 jobs per image of a batch).

    Examples::

        >>> p = argparse.ArgumentParser()
        >>> add_arguments(p)
        >>> settings_of(p.parse_args(["--target", "label"])).explain
        'label'
    """
    return EvalSettings(removal=args.removal, n_steps=args.steps, batch_size=args.batch_size,
                        seed=args.seed, explain=args.target, autocast=args.autocast)


def subset_config(args: argparse.Namespace, data: Any) -> dict[str, Any]:
    """The ``--subset`` / ``--class-map`` entries of the saved config: the subset's size,
    seed and the source index of every example (``{}`` without them)."""
    out: dict[str, Any] = {}
    if args.subset is not None:
        out.update(subset=args.subset, subset_seed=args.subset_seed, indices=list(data.indices))
    if args.class_map is not None:
        out["class_map"] = args.class_map
    return out


def run(args: argparse.Namespace) -> int:
    """Run ``captum-vit evaluate``; returns the exit status (files written by rank 0)."""
    methods = parse_methods(args.methods, compose=args.compose)
    proto = None if args.protocol is None else protocols.get_protocol(args.protocol)
    if proto is None and args.protocol_normalization != "model":
        raise ValueError("--protocol-normalization applies to --protocol runs only; drop it "
                         "(without a preset the model's own normalisation is used)")
    if proto is not None:  # the preset's options replace --metrics/--removal/--steps/--target
        defaults = argparse.ArgumentParser()
        add_arguments(defaults)
        protocols.check_fixed_options(proto, vars(args), vars(defaults.parse_args([])))
        args.metrics, args.target = [proto.name], "label" if proto.needs_labels else "predicted"
    else:
        suite.parse_metrics(args.metrics)  # names checked before any work
    report.ensure_folder(args.out)
    with parallel.distributed(args.device) as (device, rank, _):
        lm = load_model(args.model, seed=args.seed, pretrained=args.pretrained,
                        class_names=args.classes, targets=target_embeddings(args))
        model = lm.model.to(device=device, dtype=getattr(torch, args.dtype))
        scoring = lm.scoring()  # embedding models: scored against --target-embeddings
        data = load_data(args.data, n=args.n if args.n or args.subset else 100, seed=args.seed,
                         input_shape=lm.input_shape, num_classes=lm.num_classes,
                         class_names=lm.class_names, need_labels=args.target == "label",
                         subset=args.subset, subset_seed=args.subset_seed,
                         class_map=args.class_map)
        if proto is not None:
            return _run_protocol(args, proto, lm, model, data, methods, scoring, rank)
        metrics = suite.parse_metrics(args.metrics, has_masks=data.has_masks)
        factories = {m: method_factory(m, seed=args.seed) for m in methods}
        seconds: dict[str, float] = {}
        with scoring, _target_kind(args, lm, model):
            results = suite.evaluate(model, data, factories, metrics, settings=settings_of(args),
                                     preprocess=lm.preprocess, progress=True, timings=seconds)
        if rank == 0:
            config = {"model": args.model, "data": args.data, "methods": methods,
                      "metrics": metrics, "n": len(data), "batch_size": args.batch_size,
                      "seed": args.seed, "removal": args.removal, "steps": args.steps,
                      "target": args.target, "dtype": args.dtype}
            if args.target_kind != "class":
                config["target_kind"] = args.target_kind
            if args.autocast != "none":
                config["autocast"] = args.autocast
            config.update(subset_config(args, data))
            if args.target_embeddings is not None:
                config.update(target_embeddings=args.target_embeddings,
                              similarity=args.similarity, embedding_scale=args.embedding_scale,
                              embedding_bias=args.embedding_bias)
            report.write_outputs(args.out, results, config, seconds)
            print(report.text_table(results, seconds), end="", flush=True)
            print(f"wrote {args.out}/results.md, results.csv, results.json", file=sys.stderr)
    return 0


def _target_kind(args: argparse.Namespace, lm: Any, model: Any
                 ) -> contextlib.AbstractContextManager:
    """The scores ``--target-kind`` asks for, in force for the whole evaluation:
    ``multilabel`` makes probabilities sigmoids of the logits (labels do not compete;
    top-1 accuracy is then skipped), ``contrastive:A,B`` makes every image's score
    ``logit_A − logit_B`` (:class:`~captum_vit.targets.Contrastive`)."""
    kind, pair = target_kind(args.target_kind, lm.class_names, lm.num_classes)
    if kind == "class":
        return contextlib.nullcontext()
    if args.target_embeddings is not None:
        raise ValueError("--target-kind applies to classifiers; an embedding model is "
                         "evaluated against --target-embeddings")
    if kind == "multilabel":
        return adapt(model).probability_kind("sigmoid")
    if args.target != "predicted":
        raise ValueError("--target-kind contrastive:A,B explains the same contrast in every "
                         "image; drop --target label")
    assert pair is not None
    return adapt(model).targeting(Contrastive(*pair))


def _run_protocol(args: argparse.Namespace, proto: protocols.Protocol, lm: Any, model: Any,
                  data: Any, methods: list[str], scoring: Any, rank: int) -> int:
    """``--protocol``: print the preset's settings, evaluate, write results.* and protocol.md."""
    own, choice = lm.preprocess, args.protocol_normalization
    preprocess = proto.preprocess(own, choice)  # refuses a paper normalisation that cannot fit
    warning = proto.normalization_warning(own, choice)
    if rank == 0:
        print(proto.summary(own, choice), file=sys.stderr)
        if warning is not None:
            print(f"warning: {warning}", file=sys.stderr)
    seconds: dict[str, float] = {}
    with scoring, warnings.catch_warnings():
        # printed above on rank 0 (and written to protocol.md), not once per process
        warnings.simplefilter("ignore", protocols.ProtocolNormalizationWarning)
        factories = protocol_factories(proto, methods, seed=args.seed)
        results = protocols.run_protocol(proto, model, data, factories, preprocess=own,
                                         batch_size=args.batch_size, seed=args.seed,
                                         progress=True, has_masks=data.has_masks,
                                         autocast=args.autocast, normalization=choice,
                                         timings=seconds)
    if rank == 0:
        config = {"model": args.model, "data": args.data, "methods": methods,
                  "protocol": proto.name, "settings": dict(proto.settings),
                  "normalization": [preprocess.mean, preprocess.std],
                  "protocol_normalization": choice,
                  "normalization_rule": proto.normalization_rule(own, choice), "n": len(data),
                  "batch_size": args.batch_size, "seed": args.seed, "removal": "protocol",
                  "dtype": args.dtype, **subset_config(args, data)}
        if warning is not None:
            config["normalization_warning"] = warning
        report.write_outputs(args.out, results, config, seconds)
        protocols.write_protocol_table(args.out, proto, results, config)
        rows = protocols.protocol_rows(proto, results)
        for row, m in zip(rows, results, strict=True):
            row.append(f"{seconds[m]:.4g}" if m in seconds else "")
        print(report.aligned_table(["method", *(c.header for c in proto.columns), "s/image"],
                                   rows), end="", flush=True)
        print(f"wrote {args.out}/protocol.md, results.md, results.csv, results.json",
              file=sys.stderr)
    return 0
