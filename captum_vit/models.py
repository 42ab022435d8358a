"""Model specs: one string names a model, its preprocessing and its class names.

* ``zoo:NAME`` — a bundled model (:func:`captum_vit.zoo.load`), e.g. ``zoo:vit_fmnist_loc``;
* ``timm:NAME`` — ``timm.create_model(NAME)``: random weights seeded by ``seed``, or with
  ``pretrained=True`` the weights already in the local Hugging Face / torch hub cache
  (nothing is downloaded; :func:`cached_timm_weights` names the folders searched);
  normalisation from its ``pretrained_cfg`` (mean, std; input size from the model), class
  names for ImageNet heads (:func:`timm_class_names`);
* ``torchvision:NAME`` — ``torchvision.models.get_model(NAME, weights=None)``: random
  weights seeded by ``seed``, or with ``pretrained=True`` its default weights from the
  local torch hub cache only (``torch.hub.get_dir()/checkpoints``, nothing is downloaded;
  :func:`cached_torchvision_weights`); normalisation from the weights' transforms, class
  names from the weights' ``meta["categories"]`` when pretrained;
* ``file:PATH.safetensors`` — the state dict at ``PATH.safetensors`` and the model card
  ``PATH.json`` beside it, in the zoo's card format (:func:`read_card`);
* ``hf:NAME_OR_PATH`` — a Hugging Face image classifier (extra ``hf``) from a local folder
  or the local Hugging Face cache, never downloaded; preprocessing from its image
  processor, class names from ``config.id2label``;
* ``open_clip:ARCH[:PATH]`` — ``open_clip.create_model(ARCH, pretrained=None)`` (extra
  ``openclip``; ``ARCH`` one of ``open_clip.list_models()``): random weights seeded by
  ``seed``, the state dict at ``PATH`` (``.pt``, ``.pth``, ``.bin`` or ``.safetensors``,
  read by ``open_clip.load_checkpoint``), or with ``pretrained=True`` the weights of the
  tag ``PATH`` (default: the architecture's first tag) already in the local cache
  (:func:`cached_open_clip_weights`; nothing is downloaded); normalisation from the
  model's ``preprocess_cfg`` (or the tag's). An image-embedding model: its targets are
  vectors (:func:`captum_vit.targets.clip_text_target`);
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

The card reader and :class:`LoadedModel` live in :mod:`captum_vit.cards` (below this module
and :mod:`captum_vit.zoo`), :class:`Preprocess` in :mod:`captum_vit.data.transforms` and
:func:`class_index` in :mod:`captum_vit.data.classes`; all are re-exported here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from captum_vit.adapters import adapt
from captum_vit.cards import LoadedModel, from_card, loaded_model, read_card
from captum_vit.data.classes import class_index
from captum_vit.data.transforms import Preprocess

RANDOM_MODELS: dict[str, dict[str, Any]] = {
    "vit_tiny": dict(img_size=32, patch_size=8, in_chans=3, embed_dim=48, depth=3, num_heads=4,
                     mlp_ratio=2.0, num_classes=10),
    "vit_small": dict(img_size=224, patch_size=16, embed_dim=384, depth=12, num_heads=6),
}
"""``random:NAME`` models: keyword arguments of timm's ``VisionTransformer``."""

SPEC_HELP = ("zoo:NAME | timm:NAME [--pretrained] | torchvision:NAME [--pretrained] | "
             "file:PATH.safetensors (+ PATH.json card) | hf:NAME_OR_PATH (local only) | "
             "open_clip:ARCH[:PATH | :TAG --pretrained] | "
             f"random:{'|'.join(RANDOM_MODELS)}")
"""One-line summary of the model specs (command-line help)."""

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


def load_model(spec: str, *, seed: int = 0, pretrained: bool = False,
               class_names: Sequence[str] | str | os.PathLike | None = None,
               targets: Any = None) -> LoadedModel:
    r"""The model named by ``spec`` (see the module docstring).

    Args:
        spec (str): ``zoo:NAME``, ``timm:NAME``, ``torchvision:NAME``,
            ``file:PATH.safetensors``, ``hf:NAME_OR_PATH``, ``open_clip:ARCH[:PATH]`` or
            ``random:NAME``.
        seed (int, optional): seed of random weights (``random:``, and ``timm:``,
            ``torchvision:`` and ``open_clip:`` without weights); the global random state
            is left as it was. Default 0.
        pretrained (bool, optional): ``timm:NAME``, ``torchvision:NAME`` and
            ``open_clip:ARCH[:TAG]`` only: load the weights from the local cache
            (:func:`cached_timm_weights`, :func:`cached_torchvision_weights`,
            :func:`cached_open_clip_weights`). Default False.
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
    if pretrained and kind not in ("timm", "torchvision", "open_clip"):
        raise ValueError(f"--pretrained applies to --model timm:NAME and torchvision:NAME "
                         f"only, or to open_clip:ARCH[:TAG], not {spec!r}")
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
    elif kind == "torchvision":
        lm = _torchvision(name, seed, pretrained)
    elif kind == "hf":
        lm = _hf(name)
    elif kind == "open_clip":
        lm = _open_clip(name, seed, pretrained)
    elif kind == "random":
        from timm.models.vision_transformer import VisionTransformer

        if name not in RANDOM_MODELS:
            raise ValueError(f"unknown random model {name!r}; choose from "
                             f"{', '.join(RANDOM_MODELS)}")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = VisionTransformer(**RANDOM_MODELS[name]).eval()
        lm = loaded_model(model, None, None, None, random_weights=True)
    else:
        raise ValueError(f"unknown model {spec!r}; use {SPEC_HELP}")
    if class_names is None and targets is None:
        return lm
    return loaded_model(lm.model, lm.preprocess.mean, lm.preprocess.std, class_names,
                        card=lm.card, random_weights=lm.random_weights, targets=targets)


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
    cfg = cast(dict, model.pretrained_cfg)  # timm's models carry this dict
    return loaded_model(model.eval(), cfg.get("mean", (0.5, 0.5, 0.5)),
                        cfg.get("std", (0.5, 0.5, 0.5)), timm_class_names(model),
                        random_weights=not pretrained)


def _torchvision(name: str, seed: int, pretrained: bool) -> LoadedModel:
    """``torchvision.models.get_model(name, weights=None)``, random or with the default
    weights from the local torch hub cache."""
    try:
        from torchvision import models
    except ImportError as e:
        raise ValueError(f"--model torchvision:{name} needs torchvision: "
                         "pip install torchvision") from e

    if name not in models.list_models():
        raise ValueError(f"--model torchvision:{name}: unknown model; see "
                         "torchvision.models.list_models() (e.g. vit_b_16)")
    try:
        weights = models.get_model_weights(name).DEFAULT
    except (ValueError, AttributeError):  # a builder without weights
        weights = None
    if pretrained and weights is None:
        raise ValueError(f"--pretrained: torchvision {name} has no pretrained weights; drop "
                         "--pretrained for random weights")
    kwargs: dict[str, Any] = {}
    if pretrained:
        kwargs["num_classes"] = len(weights.meta["categories"])
        if name.startswith("vit_") and "min_size" in weights.meta:  # as torchvision's builder
            kwargs["image_size"] = int(weights.meta["min_size"][0])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = models.get_model(name, weights=None, **kwargs)
    names = None
    if pretrained:
        path = cached_torchvision_weights(weights)
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        names = tuple(weights.meta["categories"])
    pre = weights.transforms() if weights is not None else None
    mean = tuple(getattr(pre, "mean", (0.485, 0.456, 0.406)))
    std = tuple(getattr(pre, "std", (0.229, 0.224, 0.225)))
    return loaded_model(model.eval(), mean, std, names, random_weights=not pretrained)


def cached_torchvision_weights(weights: Any) -> str:
    """Path of torchvision weights in the local torch hub cache; never downloads.

    torchvision stores the file of ``weights.url`` under
    ``torch.hub.get_dir()/checkpoints/`` with the URL's file name (its
    ``load_state_dict_from_url``); this looks there only.

    Args:
        weights (torchvision WeightsEnum member): e.g.
            ``torchvision.models.ViT_B_16_Weights.DEFAULT``.

    Returns:
        str: the path of the cached file.

    Raises:
        FileNotFoundError: the file is not there; the message names the path to put it
            at and where it comes from.

    Examples::

        >>> from torchvision.models import ViT_B_16_Weights
        >>> from captum_vit.models import cached_torchvision_weights
        >>> cached_torchvision_weights(ViT_B_16_Weights.DEFAULT)  # doctest: +SKIP
        '/root/.cache/torch/hub/checkpoints/vit_b_16-c867db91.pth'
    """
    from urllib.parse import urlparse

    fname = Path(urlparse(weights.url).path).name
    path = Path(torch.hub.get_dir()) / "checkpoints" / fname
    if path.is_file():
        return str(path)
    raise FileNotFoundError(
        f"--pretrained: the weights {weights} are not in the local torch hub cache: put "
        f"{fname} at {path} (it is {weights.url}; or run torchvision.models.get_model(NAME, "
        "weights='DEFAULT') once where it can be downloaded), or drop --pretrained for "
        "random weights")


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
    return loaded_model(model, 0.5 if mean is None else mean, 0.5 if std is None else std, names)


def _open_clip(name: str, seed: int, pretrained: bool) -> LoadedModel:
    """An OpenCLIP model from a built-in architecture: random, a local state dict, or a
    tag's weights from the local cache (never downloads)."""
    try:
        import open_clip
    except ImportError as e:
        raise ValueError(f"--model open_clip:{name} needs the openclip extra: "
                         "pip install 'captum_vit[openclip]'") from e
    arch, _, rest = name.partition(":")
    if arch not in open_clip.list_models():
        raise ValueError(f"--model open_clip:{name}: unknown architecture {arch!r}; use one "
                         "of open_clip.list_models() (e.g. ViT-B-32), optionally "
                         "open_clip:ARCH:PATH with a local state dict")
    path: str | Path | None = None
    tag_cfg: dict = {}
    if pretrained:
        path, tag_cfg = cached_open_clip_weights(arch, rest or None)
    elif rest:
        path = file = Path(rest)
        if file.suffix not in (".pt", ".pth", ".bin", ".safetensors"):
            raise ValueError(f"--model open_clip:{name}: PATH must be a state dict file (.pt, "
                             f".pth, .bin or .safetensors), got {rest!r}; for a pretrained "
                             "tag use open_clip:ARCH:TAG --pretrained")
        if not file.is_file():
            raise FileNotFoundError(f"--model open_clip:{name}: no such file {file}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = open_clip.create_model(arch, pretrained=None, pretrained_text=False)
    if path is not None:
        open_clip.load_checkpoint(model, str(path))
    cfg = {**getattr(model.visual, "preprocess_cfg", {}), **tag_cfg}
    mean = cfg.get("mean", open_clip.OPENAI_DATASET_MEAN)
    std = cfg.get("std", open_clip.OPENAI_DATASET_STD)
    return loaded_model(model.eval(), tuple(mean), tuple(std), None,
                        random_weights=path is None)


def cached_open_clip_weights(arch: str, tag: str | None = None) -> tuple[str, dict]:
    """Path of an OpenCLIP tag's weights in the local cache; never downloads.

    Looks where ``open_clip.create_model(ARCH, pretrained=TAG)`` stores them: the Hugging
    Face hub cache for tags hosted there (``open_clip_model.safetensors`` before the
    ``.bin``), and ``~/.cache/clip`` for tags downloaded from a URL.

    Args:
        arch (str): an OpenCLIP architecture (``open_clip.list_models()``).
        tag (str, optional): a pretrained tag of it
            (``open_clip.list_pretrained_tags_by_model(arch)``); default the first.

    Returns:
        (str, dict): the path of the cached weights and the tag's configuration (its
        ``mean`` and ``std`` normalise the inputs).

    Raises:
        ValueError: the architecture has no such tag.
        FileNotFoundError: the weights are in neither cache; the message names the
            folders and file names to put them at.

    Examples::

        >>> from captum_vit.models import cached_open_clip_weights
        >>> cached_open_clip_weights("ViT-B-32", "laion2b_s34b_b79k")  # doctest: +SKIP
        ('/root/.cache/huggingface/hub/models--laion--.../open_clip_model.safetensors', {...})
    """
    import open_clip
    from huggingface_hub import constants, try_to_load_from_cache

    tags = open_clip.list_pretrained_tags_by_model(arch)
    if not tags:
        raise ValueError(f"--pretrained: OpenCLIP lists no pretrained tag for {arch}; pass "
                         f"a local state dict as open_clip:{arch}:PATH")
    tag = tags[0] if tag is None else tag
    cfg = open_clip.get_pretrained_cfg(arch, tag)
    if not cfg:
        raise ValueError(f"--pretrained: {arch} has no tag {tag!r}; choose from "
                         f"{', '.join(tags)}")
    where = []
    hub = cfg.get("hf_hub", "")
    if hub:
        # 'org/repo/file' names a file, 'org/repo/' the default ones (open_clip.pretrained)
        repo, _, fname = hub.rpartition("/")
        names = [fname] if fname else ["open_clip_model.safetensors",
                                       "open_clip_pytorch_model.bin"]
        if fname.endswith((".bin", ".pth")):
            names.insert(0, fname[:-4] + ".safetensors")
        for candidate in names:
            hit = try_to_load_from_cache(repo, candidate)
            if isinstance(hit, str):
                return hit, cfg
        where.append(f"Hugging Face cache {constants.HF_HUB_CACHE} ({repo}: "
                     f"{' or '.join(names)})")
    url = cfg.get("url", "")
    if url:
        local = Path("~/.cache/clip").expanduser() / Path(url).name
        if local.is_file():
            return str(local), cfg
        where.append(f"{local}")
    raise FileNotFoundError(
        f"--pretrained: the weights of OpenCLIP {arch} ({tag}) are not in the local cache "
        f"(looked in {' and '.join(where) or 'no source: the tag names none'}); nothing is "
        f"downloaded: run open_clip.create_model({arch!r}, pretrained={tag!r}) once where "
        f"the hub can be reached, or pass a local state dict as open_clip:{arch}:PATH")


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
           "cached_open_clip_weights", "cached_timm_weights", "cached_torchvision_weights",
           "class_index", "from_card", "load_model", "read_card", "read_class_names",
           "timm_class_names"]
