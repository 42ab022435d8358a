"""Model specs: one string names a model, its preprocessing and its class names.

* ``zoo:NAME`` — a bundled model (:func:`captum_vit.zoo.load`), e.g. ``zoo:vit_fmnist_loc``;
* ``timm:NAME`` — ``timm.create_model(NAME)``: random weights seeded by ``seed``, or with
  ``pretrained=True`` the weights already in the local Hugging Face / torch hub cache
  (nothing is downloaded; :func:`cached_timm_weights` names the folders searched);
  normalisation from its ``pretrained_cfg`` (mean, std; input size from the model), class
  names for ImageNet heads (:func:`timm_class_names`);
* ``file:PATH.safetensors`` — the state dict at ``PATH.safetensors`` and the model card
  ``PATH.json`` beside it, in the zoo's card format (:func:`read_card`);
* ``hf:NAME_OR_PATH`` — a Hugging Face image classifier (extra ``hf``) from a local folder
  or the local Hugging Face cache, never downloaded; preprocessing from its image
  processor, class names from ``config.id2label``;
* ``random:vit_tiny`` / ``random:vit_small`` — a random-weight timm ViT built from ``seed``
  (3×32×32, patch 8, 10 classes / ViT-S/16 224); no download (tests, demos).

Model cards (the zoo's ``<name>.json`` and ``file:PATH``'s ``PATH.json``) are JSON objects
read by one reader: ``timm_kwargs`` (keyword arguments of timm's ``VisionTransformer``;
the older ``kwargs`` key is accepted too), optional ``normalization``
(``{"mean": [...], "std": [...]}`` per channel, or one value for all) and optional
``class_names`` (one name per output class); other keys (accuracy, learning curve, ...)
are kept in :attr:`LoadedModel.card`.

Class names may also come from a text file (one name per line, :func:`read_class_names`),
which ``--classes FILE`` passes for any model.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from captum_vit._text import count_noun
from captum_vit.adapters import adapt
from captum_vit.data.images import conform, read_json

RANDOM_MODELS: dict[str, dict[str, Any]] = {
    "vit_tiny": dict(img_size=32, patch_size=8, in_chans=3, embed_dim=48, depth=3, num_heads=4,
                     mlp_ratio=2.0, num_classes=10),
    "vit_small": dict(img_size=224, patch_size=16, embed_dim=384, depth=12, num_heads=6),
}
"""``random:NAME`` models: keyword arguments of timm's ``VisionTransformer``."""

SPEC_HELP = ("zoo:NAME | timm:NAME [--pretrained] | file:PATH.safetensors (+ PATH.json card) | "
             f"hf:NAME_OR_PATH (local only) | random:{'|'.join(RANDOM_MODELS)}")
"""One-line summary of the model specs (command-line help)."""

_ARCHITECTURES = ("VisionTransformer", "timm.models.vision_transformer.VisionTransformer")


@dataclass(frozen=True)
class Preprocess:
    """An image of any size -> the model's normalised input ``[C, H, W]``.

    Takes what :func:`captum_vit.data.images.as_image` takes (PIL image, numpy array in
    ``[0, 255]`` or ``[0, 1]``, ``[C, H, W]`` tensor), converts the channels (3 -> 1 by
    luminance, 1 -> 3 by repetition), resizes bilinearly to ``size`` and subtracts ``mean``
    and divides by ``std`` per channel (no normalisation when they are ``None``).

    Attributes:
        channels (int): channels of the model's input.
        size (tuple[int, int]): ``(H, W)`` of the model's input.
        mean (tuple[float, ...], optional): per-channel mean (one value for all channels).
        std (tuple[float, ...], optional): per-channel standard deviation.

    Examples::

        >>> pre = Preprocess(1, (56, 56), (0.1,), (0.25,))
        >>> pre(torch.rand(3, 100, 80)).shape
        torch.Size([1, 56, 56])
    """

    channels: int
    size: tuple[int, int]
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("mean", "std"):
            v = getattr(self, name)
            if v is not None and len(v) not in (1, self.channels):
                give = "1 value" if self.channels == 1 else f"1 or {self.channels} values"
                raise ValueError(f"normalization {name} has {count_noun(len(v), 'value')} for "
                                 f"a model with {count_noun(self.channels, 'channel')}; "
                                 f"give {give}")
        if (self.mean is None) != (self.std is None):
            raise ValueError("normalization needs both mean and std")

    def __call__(self, image: Any) -> Tensor:
        x = conform(image, self.channels, self.size)
        if self.mean is None or self.std is None:
            return x
        mean = x.new_tensor(self.mean)[:, None, None]
        std = x.new_tensor(self.std)[:, None, None]
        return (x - mean) / std


@dataclass(frozen=True)
class LoadedModel:
    """A model with what is needed to feed and read it.

    Attributes:
        model (nn.Module): the model, in eval mode.
        preprocess (Preprocess): image -> normalised input ``[C, H, W]``.
        class_names (tuple[str, ...], optional): a name per output class, or ``None``
            when unknown.
        card (dict, optional): the model card (``zoo:`` and ``file:`` models).
        random_weights (bool): whether the weights are random (``random:``, ``timm:``
            without ``pretrained``).
    """

    model: nn.Module
    preprocess: Preprocess
    class_names: tuple[str, ...] | None = None
    card: dict | None = None
    random_weights: bool = False
    targets: Any = None
    """For a model that outputs an image embedding: the target vectors it is scored
    against (an :class:`~captum_vit.targets.EmbeddingTarget` without index)."""

    @property
    def input_shape(self) -> tuple[int, tuple[int, int]]:
        """The model's ``(channels, (H, W))`` (from its adapter)."""
        return adapt(self.model).input_shape

    @property
    def num_classes(self) -> int:
        """The model's number of output classes (from its adapter), or the number of
        target vectors of an embedding model."""
        if self.targets is not None:
            return int(self.targets.vectors.reshape(-1, self.targets.vectors.shape[-1]
                                                    ).shape[0])
        return adapt(self.model).num_classes

    def scoring(self) -> Any:
        """A context in which the model's scores are its classes: for an embedding model,
        :func:`captum_vit.targets.scoring` against :attr:`targets` (call it after moving
        the model to its device and dtype); for a classifier, nothing.

        Raises:
            ValueError: an embedding model without target vectors.
        """
        import contextlib

        from captum_vit.targets import scoring

        if self.targets is not None:
            return scoring(self.model, self.targets)
        if adapt(self.model).embedding:
            raise ValueError(f"this {type(self.model).__name__} outputs an image embedding, "
                             "not classes: give the vectors to score it against with "
                             "--target-embeddings FILE (.npy/.pt, [T, D′], e.g. text "
                             "embeddings of class prompts; --classes names them)")
        return contextlib.nullcontext()


def read_class_names(path: str | os.PathLike) -> tuple[str, ...]:
    r"""Class names from a text file: one name per line, blank lines ignored.

    Args:
        path (str or os.PathLike): the file.

    Returns:
        tuple[str, ...]: the names, in file order (index = class).

    Raises:
        FileNotFoundError: if the file does not exist.
        ValueError: if it names no class.

    Examples::

        >>> from captum_vit.models import read_class_names
        >>> read_class_names("imagenet_classes.txt")[:2]
        ('tench', 'goldfish')
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--classes {p}: no such file (one class name per line)")
    names = tuple(line.strip() for line in p.read_text().splitlines() if line.strip())
    if not names:
        raise ValueError(f"--classes {p}: the file names no class (one class name per line)")
    return names


def class_index(name: str, class_names: Sequence[str]) -> int:
    r"""The index of the class called ``name``: compared ignoring case, spaces and
    punctuation (``"sneaker"``, ``"T-shirt top"``); a name that is no whole class name
    may be the first synonym of one (``"tench"`` for ``"tench, Tinca tinca"``).

    Args:
        name (str): the class name.
        class_names (Sequence[str]): the model's class names (index = class).

    Returns:
        int: the class index.

    Raises:
        ValueError: ``name`` matches no class (the message lists some valid names) or
            several.

    Examples::

        >>> from captum_vit.models import class_index
        >>> class_index("sneaker", ["T-shirt/top", "Sandal", "Sneaker"])
        2
    """
    from captum_vit.data.specs import class_key

    text = str(name).strip()
    for key in (str.lower, class_key):
        found = [i for i, c in enumerate(class_names) if key(str(c).strip()) == key(text)]
        if not found:
            found = [i for i, c in enumerate(class_names)
                     if key(str(c).split(",")[0].strip()) == key(text)]
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise ValueError(f"{text!r} matches several classes of the model: "
                             + ", ".join(f"{class_names[i]!r} ({i})" for i in found))
    shown = ", ".join(str(c) for c in class_names[:12])
    more = f", ... ({len(class_names)} in all)" if len(class_names) > 12 else ""
    raise ValueError(f"{text!r} is not a class name of the model (compared ignoring case "
                     f"and punctuation); valid names: {shown}{more}")


def read_card(path: str | os.PathLike) -> dict[str, Any]:
    r"""Read a model card (the zoo's format, see the module docstring).

    Args:
        path (str or os.PathLike): the ``.json`` card.

    Returns:
        dict: the card, with ``timm_kwargs`` set (from ``kwargs`` for older cards).

    Raises:
        FileNotFoundError: if the card does not exist.
        ValueError: if it is not JSON or lacks the model's keyword arguments.

    Examples::

        >>> from captum_vit.models import read_card
        >>> read_card("captum_vit/zoo/vit_fmnist_loc.json")["timm_kwargs"]["patch_size"]
        7
    """
    p = Path(path)
    card = read_json(p, "model card", "put the JSON card (with 'timm_kwargs') beside the "
                     "weights")
    if not isinstance(card, dict):
        raise ValueError(f"model card {p} must hold a JSON object")
    kwargs = card.get("timm_kwargs", card.get("kwargs"))
    if not isinstance(kwargs, dict):
        raise ValueError(f"model card {p} needs 'timm_kwargs': the keyword arguments of timm's "
                         "VisionTransformer")
    arch = card.get("architecture", "VisionTransformer")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"model card {p}: architecture {arch!r} is not supported; cards "
                         "describe a timm VisionTransformer")
    return {**card, "timm_kwargs": kwargs}


def from_card(card: dict[str, Any], weights: str | os.PathLike, *,
              class_names: Sequence[str] | None = None) -> LoadedModel:
    r"""Build the model a card describes and load its safetensors weights (strictly).

    Args:
        card (dict): a card as :func:`read_card` returns it.
        weights (str or os.PathLike): the ``.safetensors`` state dict.
        class_names (Sequence[str], optional): class names, overriding the card's.

    Returns:
        LoadedModel: the model (eval mode), the card's preprocessing and class names.

    Examples::

        >>> from captum_vit.models import from_card, read_card
        >>> lm = from_card(read_card("m.json"), "m.safetensors")
    """
    from safetensors.torch import load_file
    from timm.models.vision_transformer import VisionTransformer

    w = Path(weights)
    if not w.is_file():
        raise FileNotFoundError(f"weights {w} not found (a .safetensors state dict)")
    model = VisionTransformer(**card["timm_kwargs"])
    model.load_state_dict(load_file(str(w)), strict=True)
    norm = card.get("normalization") or {}
    names = class_names if class_names is not None else card.get("class_names")
    return _finish(model.eval(), norm.get("mean"), norm.get("std"), names, card=card)


def load_model(spec: str, *, seed: int = 0, pretrained: bool = False,
               class_names: Sequence[str] | str | os.PathLike | None = None,
               targets: Any = None) -> LoadedModel:
    r"""The model named by ``spec`` (see the module docstring).

    Args:
        spec (str): ``zoo:NAME``, ``timm:NAME``, ``file:PATH.safetensors``,
            ``hf:NAME_OR_PATH`` or ``random:NAME``.
        seed (int, optional): seed of random weights (``random:``, ``timm:`` without
            ``pretrained``); the global random state is left as it was. Default 0.
        pretrained (bool, optional): ``timm:NAME`` only: load the weights from the local
            cache (:func:`cached_timm_weights`). Default False.
        class_names (Sequence[str] or path, optional): a name per output class, or a
            text file of them (:func:`read_class_names`); overrides the card's. For an
            embedding model with ``targets``: a name per target vector.
        targets (Tensor, EmbeddingTarget or path, optional): for a model that outputs an
            image embedding (CLIP, SigLIP, ``num_classes=0``), the target vectors
            ``[T, D′]`` it is scored against, or a file of them
            (:func:`captum_vit.targets.read_target_embeddings`). Default ``None``.

    Returns:
        LoadedModel: model (eval mode), preprocessing, class names (or ``None``), card.

    Raises:
        ValueError: for an unknown spec, ``pretrained`` with another kind, or class names
            whose count differs from the model's classes.
        FileNotFoundError: for missing files (the message says what to put where).

    Examples::

        >>> from captum_vit.models import load_model
        >>> lm = load_model("zoo:vit_fmnist_loc")
        >>> lm.class_names[3]
        'Dress'
        >>> tiny = load_model("random:vit_tiny", seed=1, class_names="classes.txt")
    """
    if not isinstance(spec, str):
        raise TypeError(f"model spec must be a str, got {type(spec).__name__}")
    kind, _, name = spec.partition(":")
    if pretrained and kind != "timm":
        raise ValueError(f"--pretrained applies to --model timm:NAME only, not {spec!r}")
    if isinstance(class_names, (str, os.PathLike)):
        class_names = read_class_names(class_names)
    if kind == "zoo":
        from captum_vit import zoo

        zm = zoo.load(name)
        lm = LoadedModel(zm.model, zm.preprocess, zm.class_names, zm.card)
    elif kind == "file":
        path = Path(name)
        if path.suffix != ".safetensors":
            raise ValueError(f"--model file:PATH needs a .safetensors file, got {name!r}")
        lm = from_card(read_card(path.with_suffix(".json")), path)
    elif kind == "timm":
        lm = _timm(name, seed, pretrained)
    elif kind == "hf":
        lm = _hf(name)
    elif kind == "random":
        from timm.models.vision_transformer import VisionTransformer

        if name not in RANDOM_MODELS:
            raise ValueError(f"unknown random model {name!r}; choose from "
                             f"{', '.join(RANDOM_MODELS)}")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = VisionTransformer(**RANDOM_MODELS[name]).eval()
        lm = _finish(model, None, None, None, random_weights=True)
    else:
        raise ValueError(f"unknown model {spec!r}; use {SPEC_HELP}")
    if class_names is None and targets is None:
        return lm
    return _finish(lm.model, lm.preprocess.mean, lm.preprocess.std, class_names, card=lm.card,
                   random_weights=lm.random_weights, targets=targets)


def _finish(model: nn.Module, mean: Sequence[float] | float | None,
            std: Sequence[float] | float | None, class_names: Sequence[str] | None, *,
            card: dict | None = None, random_weights: bool = False,
            targets: Any = None) -> LoadedModel:
    """The LoadedModel of ``model``: preprocessing at its input shape, checked names and
    target vectors."""
    adapter = adapt(model)
    channels, size = adapter.input_shape
    num_classes = adapter.num_classes
    if targets is not None:
        from captum_vit.targets import EmbeddingTarget, read_target_embeddings

        if not adapter.embedding:
            raise ValueError(f"target embeddings are for models that output an image "
                             f"embedding; this {type(model).__name__} is a classifier")
        if isinstance(targets, (str, os.PathLike)):
            targets = read_target_embeddings(targets)
        if not isinstance(targets, EmbeddingTarget):
            targets = EmbeddingTarget(targets)
        v = targets.vectors
        if v.shape[-1] != num_classes or v.dim() not in (1, 2):
            raise ValueError(f"target embeddings must be [T, {num_classes}] (the model's "
                             f"embedding size), got {tuple(v.shape)}")
        num_classes = 1 if v.dim() == 1 else int(v.shape[0])

    def values(v: Sequence[float] | float | None) -> tuple[float, ...] | None:
        if v is None:
            return None
        return tuple(float(f) for f in v) if isinstance(v, (list, tuple)) else (float(v),)

    names = None
    if class_names is not None:
        names = tuple(str(n) for n in class_names)
        if len(names) != num_classes:
            what = "target vectors" if targets is not None else "classes"
            raise ValueError(f"{len(names)} class names for a model with {num_classes} "
                             f"{what}; give one name per output class")
    pre = Preprocess(int(channels), (int(size[0]), int(size[1])), values(mean), values(std))
    return LoadedModel(model, pre, names, card, random_weights, targets)


def _timm(name: str, seed: int, pretrained: bool) -> LoadedModel:
    import timm

    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = timm.create_model(name, pretrained=False)
    except RuntimeError as e:  # timm: "Unknown model (...)"
        raise ValueError(f"--model timm:{name}: {e}; see timm.list_models()") from e
    if pretrained:
        path = cached_timm_weights(model.pretrained_cfg)
        model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(
            file=path, custom_load=path.endswith(".npz")))
    cfg = model.pretrained_cfg
    return _finish(model.eval(), cfg.get("mean", (0.5, 0.5, 0.5)), cfg.get("std", (0.5, 0.5, 0.5)),
                   timm_class_names(model), random_weights=not pretrained)


def timm_class_names(model: nn.Module) -> tuple[str, ...] | None:
    r"""The class names of a timm model whose head is an ImageNet label set (timm's
    ``infer_imagenet_subset`` from its ``pretrained_cfg``): the ``ImageNetInfo``
    descriptions (``"tench, Tinca tinca"``), whose positions give the WNIDs
    (:func:`captum_vit.data.imagenet.model_wnids`); ``None`` for other heads.

    Args:
        model (nn.Module): a timm model.

    Returns:
        tuple[str, ...] or None: one name per class.

    Examples::

        >>> import timm
        >>> from captum_vit.models import timm_class_names
        >>> timm_class_names(timm.create_model("deit_tiny_patch16_224"))[0]
        'tench, Tinca tinca'
    """
    from timm.data import ImageNetInfo, infer_imagenet_subset

    subset = infer_imagenet_subset(model)
    if not subset:
        return None
    info = ImageNetInfo(subset)
    if info.num_classes() != getattr(model, "num_classes", None):
        return None
    return tuple(info.label_descriptions())


def _hf(name: str) -> LoadedModel:
    """A Hugging Face classifier from a local folder or the local cache (never downloads)."""
    try:
        import transformers
    except ImportError as e:
        raise ValueError(f"--model hf:{name} needs the hf extra: "
                         "pip install 'captum_vit[hf]'") from e
    try:
        config = transformers.AutoConfig.from_pretrained(name, local_files_only=True)
    except OSError as e:
        from huggingface_hub import constants

        raise FileNotFoundError(
            f"--model hf:{name}: neither a local model folder nor in the local Hugging Face "
            f"cache ({constants.HF_HUB_CACHE}); nothing is downloaded: run "
            f"from_pretrained({name!r}) once where the hub can be reached, or save the model "
            "with save_pretrained(FOLDER) and pass hf:FOLDER") from e
    arch = (getattr(config, "architectures", None) or [""])[0]
    cls = getattr(transformers, arch, None) or transformers.AutoModelForImageClassification
    model = cls.from_pretrained(name, local_files_only=True).eval()
    try:
        proc = transformers.AutoImageProcessor.from_pretrained(name, local_files_only=True)
        mean, std = getattr(proc, "image_mean", None), getattr(proc, "image_std", None)
    except (OSError, ValueError):  # no processor saved: the ViT default
        mean = std = None
    labels = [config.id2label[i] for i in sorted(config.id2label)]
    names = None if labels == [f"LABEL_{i}" for i in range(len(labels))] \
        or adapt(model).embedding else labels
    return _finish(model, 0.5 if mean is None else mean, 0.5 if std is None else std, names)


def cached_timm_weights(cfg: Any) -> str:
    """Path of the pretrained weights of a timm config in the local cache; never downloads.

    Looks in the Hugging Face hub cache (``cfg.hf_hub_id``; ``model.safetensors``, then
    ``pytorch_model.bin``, or ``cfg.hf_hub_filename``) and in torch hub's checkpoint folder
    (``cfg.url``), the two places ``timm.create_model(NAME, pretrained=True)`` stores them.

    Args:
        cfg (dict or timm PretrainedCfg): the model's ``pretrained_cfg``.

    Returns:
        str: the path of the cached weights file.

    Raises:
        FileNotFoundError: the weights are in neither cache; the message names both folders.

    Examples::

        >>> import timm
        >>> from captum_vit.models import cached_timm_weights
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False)
        >>> cached_timm_weights(m.pretrained_cfg)  # doctest: +SKIP
        '/root/.cache/huggingface/hub/models--timm--.../model.safetensors'
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


__all__ = ["LoadedModel", "Preprocess", "RANDOM_MODELS", "SPEC_HELP",
           "cached_timm_weights", "class_index", "from_card", "load_model", "read_card",
           "read_class_names", "timm_class_names"]
