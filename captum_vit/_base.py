"""The Captum front shared by every method.

A method implements ``_token_maps(inputs, target, **kwargs) -> [B, N]`` on top of the
adapter; this module validates the inputs and target, resolves ``target=None`` to the
predicted class, and formats the patch scores as pixels, a grid or tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast, overload

import numpy as np
import torch
from captum.attr import GradientAttribution, PerturbationAttribution
from captum.log import log_usage
from torch import Tensor, nn

from captum_vit._text import count_noun
from captum_vit.adapters import (
    Layout,
    SubnetworkAdapter,
    TargetHead,
    Trace,
    ViTAdapter,
    adapt,
    grid_to_pixels,
    grid_to_video,
    probabilities,
    tokens_to_grid,
)
from captum_vit.adapters.scoring import Outputs, Target, per_image
from captum_vit.targets import (
    EmbeddingTarget,
    TextEmbeddingTarget,
    as_target,
    embedding_target,
    is_embedding_target,
)

OUTPUTS = ("pixels", "grid", "tokens")
SCORES = ("logit", "probability")
HEADS = ("mean", "all")
"""``attribute(..., heads=)`` of the methods with per-head maps (class attribute
``per_head = True``): ``"mean"`` one map, the head average; ``"all"`` one map per head."""
AGGREGATES = ("subnetwork", "layer")
"""How PLUS / SkipPLUS sum a recursion base over the start blocks
(:mod:`captum_vit.combinators`): ``"subnetwork"`` runs the base on every sub-network
``f_l`` (SkipPLUS, Mehri et al. 2024, Eq. 3 literally), ``"layer"`` sums the readout rows of
its per-block matrices ``w F_l`` (no identity)."""
TargetLike = (int | Sequence[int] | Tensor | np.ndarray | np.integer | Target
              | Callable[..., Tensor] | None)


def check_choice(name: str, value: Any, choices: Sequence[str]) -> str:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is one of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def check_scalar(x: Any, name: str, target_type: type | tuple[type, ...], *,
                 min_val: float | None = None, max_val: float | None = None,
                 include_boundaries: str = "both") -> Any:
    """Validate a scalar option (the shape of scikit-learn's ``check_scalar``).

    ``bool`` is never accepted as a number, and an ``int`` is accepted where a ``float``
    is asked for; numpy scalars are turned into Python numbers.

    Args:
        x: the value.
        name (str): the argument's name, used in the message.
        target_type (type or tuple of types): e.g. ``int`` or ``(int, float)``.
        min_val, max_val (float, optional): bounds.
        include_boundaries (str, optional): ``"both"`` (default), ``"left"``,
            ``"right"`` or ``"neither"``: which bounds are allowed values.

    Returns:
        The value (a Python number for numpy scalars).

    Raises:
        TypeError: wrong type. ValueError: out of bounds.

    Examples::

        >>> check_scalar(8, "n_masks", int, min_val=1)
        8
        >>> check_scalar(0.5, "ratio", float, min_val=0, max_val=1, include_boundaries="neither")
        0.5
    """
    check_choice("include_boundaries", include_boundaries, ("both", "left", "right", "neither"))
    named = target_type if isinstance(target_type, tuple) else (target_type,)
    types = (*named, int) if float in named else named
    if isinstance(x, np.generic):
        x = x.item()
    if (isinstance(x, bool) and bool not in named) or not isinstance(x, types):
        wanted = " or ".join(("an " if t.__name__[0] in "aeiou" else "a ") + t.__name__
                             for t in named)
        raise TypeError(f"{name} must be {wanted}, got {type(x).__name__} ({x!r})")
    v = cast(float, x)  # a number when bounds are given
    low_ok = min_val is None or (v >= min_val if include_boundaries in ("both", "left")
                                 else v > min_val)
    high_ok = max_val is None or (v <= max_val if include_boundaries in ("both", "right")
                                  else v < max_val)
    if not (low_ok and high_ok):
        closed_lo, closed_hi = (include_boundaries in ("both", "left"),
                                include_boundaries in ("both", "right"))
        if min_val is not None and max_val is not None:
            where = (f"in {'[' if closed_lo else '('}{min_val}, {max_val}"
                     f"{']' if closed_hi else ')'}")
        elif min_val is not None:
            where = f"{'>=' if closed_lo else '>'} {min_val}"
        else:
            where = f"{'<=' if closed_hi else '<'} {max_val}"
        raise ValueError(f"{name} must be {where}, got {x!r}")
    return x


PREPROCESS_HINT = (
    "preprocess the images into a float tensor [B, C, H, W] normalised as the model "
    "expects, e.g. torch.stack([preprocess(img) for img in images]) with "
    "preprocess = captum_vit.models.load_model(spec).preprocess, or timm's "
    "timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))")
"""The end of the message for inputs that are not a tensor yet."""


def input_type_hint(inputs: Any) -> str:
    """How to turn ``inputs`` of another type than a tensor into one, for the message.

    Args:
        inputs: what was passed as ``inputs``.

    Returns:
        str: the fix, e.g. ``pass inputs["pixel_values"]`` for a Hugging Face
        ``BatchFeature``.

    Examples::

        >>> input_type_hint({"pixel_values": None})
        'pass inputs["pixel_values"], the image tensor [B, C, H, W], not the whole dict'
    """
    name = type(inputs).__name__
    if isinstance(inputs, Mapping) or hasattr(inputs, "keys"):
        if "pixel_values" in inputs:
            return (f'pass inputs["pixel_values"], the image tensor [B, C, H, W], not the '
                    f"whole {'dict' if type(inputs) is dict else name}")
        return f"pass the image tensor [B, C, H, W] it holds, not the {name}"
    if isinstance(inputs, np.ndarray):
        return ("convert it with torch.from_numpy(array).float(), laid out [B, C, H, W] "
                "(channels first) and normalised as the model expects; or "
                + PREPROCESS_HINT)
    if isinstance(inputs, list) and inputs and all(isinstance(t, Tensor) for t in inputs):
        return ("stack the images into one batch with torch.stack(images) (each [C, H, W]) "
                "or torch.cat(images) (each [1, C, H, W])")
    return PREPROCESS_HINT


def check_images(inputs: Any, *, video: bool = False) -> tuple[Tensor, bool]:
    """Validate a batch of images; accept a tensor, a 1-tuple (Captum style), or a Hugging
    Face image processor's output.

    A mapping with a ``"pixel_values"`` key (transformers' ``BatchFeature``, or a plain
    dict) stands for its ``pixel_values`` tensor. Its other keys are ignored (the image
    classifiers explained here take ``pixel_values`` only), except a ``"pixel_mask"``
    that marks padding (any zero): the padded pixels would be explained as image
    content, so it is refused; crop or resize the images to one size instead.

    Args:
        inputs: a floating-point tensor [B, C, H, W], a 1-tuple holding one, or a mapping
            whose ``"pixel_values"`` is one.
        video (bool, optional): the model takes videos [B, T, C, H, W] instead
            (:attr:`~captum_vit.adapters.ViTAdapter.video`). Default ``False``.

    Returns:
        tuple[Tensor, bool]: the images and whether they came as a 1-tuple.

    Raises:
        TypeError: not a floating-point tensor (numpy arrays, PIL images, lists, a mapping
            without ``pixel_values``: the message says how to get one).
        ValueError: another shape, an empty batch, NaN or infinite values, a
            ``pixel_mask`` with padding.

    Examples::

        >>> batch = processor(images=pil_images, return_tensors="pt")  # a BatchFeature
        >>> images, _ = check_images(batch)  # batch["pixel_values"]
    """
    if isinstance(inputs, Mapping) and "pixel_values" in inputs:
        mask = inputs.get("pixel_mask")
        if isinstance(mask, Tensor) and not bool((mask != 0).all()):
            raise ValueError("inputs has a pixel_mask that marks padded pixels; captum_vit "
                             "would explain the padding as image content: crop or resize "
                             "the images to one size (the processor's do_pad=False) and "
                             "pass inputs['pixel_values']")
        inputs = inputs["pixel_values"]
    was_tuple = isinstance(inputs, tuple)
    if was_tuple:
        if len(inputs) != 1:
            raise ValueError("inputs must be one tensor (or a 1-tuple holding it), got a "
                             f"tuple of {len(inputs)} items")
        inputs = inputs[0]
    if not isinstance(inputs, Tensor):
        module, kind = type(inputs).__module__.split(".")[0], type(inputs).__name__
        kind = kind if module == "builtins" else f"{module}.{kind}"
        raise TypeError(f"inputs must be a torch.Tensor [B, C, H, W], got {kind}: "
                        f"{input_type_hint(inputs)}")
    if video:
        if inputs.dim() != 5:
            hint = (": a batch of images [B, C, H, W] is not a video (stack the T frames of "
                    "each video: [B, T, C, H, W]); one video [T, C, H, W] needs a batch "
                    "dimension (inputs.unsqueeze(0))" if inputs.dim() == 4 else "")
            raise ValueError("inputs must be videos of shape [B, T, C, H, W] (frames before "
                             f"channels), got {tuple(inputs.shape)}{hint}")
    elif inputs.dim() != 4:
        hint = " (add a batch dimension with inputs.unsqueeze(0))" if inputs.dim() == 3 else ""
        raise ValueError(f"inputs must have shape [B, C, H, W], got {tuple(inputs.shape)}{hint}")
    if not torch.is_floating_point(inputs):
        raise TypeError(f"inputs must be a floating-point tensor, got {inputs.dtype} "
                        "(convert with inputs.float())")
    if inputs.shape[0] == 0:
        raise ValueError("inputs is an empty batch")
    if not torch.isfinite(inputs).all():
        raise ValueError("inputs contain NaN or infinite values")
    return inputs, was_tuple


def check_target(target: TargetLike, batch: int, num_classes: int) -> Tensor | None:
    """Validate Captum's ``target`` and return it as a [B] int64 tensor (None stays None).

    Accepts an int, a list/tuple of ints, an integer tensor, a numpy integer or an
    integer numpy array (0-d or 1-D).
    """
    if target is None:
        return None
    if isinstance(target, bool | np.bool_):
        raise TypeError("target must be an int, a list of ints or an integer tensor, got bool")
    if isinstance(target, np.integer):
        target = int(target)
    elif isinstance(target, np.ndarray):
        if not np.issubdtype(target.dtype, np.integer):
            raise TypeError(f"target array must have an integer dtype, got {target.dtype}")
        target = torch.from_numpy(np.ascontiguousarray(target))
    if isinstance(target, int):
        t = torch.full((batch,), target, dtype=torch.long)
    elif isinstance(target, Tensor):
        if torch.is_floating_point(target) or target.dtype == torch.bool or target.is_complex():
            raise TypeError(f"target tensor must have an integer dtype, got {target.dtype}")
        if target.dim() > 1:
            raise ValueError(f"target must be 0-d or 1-D, got shape {tuple(target.shape)}")
        t = target.reshape(-1).long().cpu()
        if t.numel() == 1:
            t = t.expand(batch)
    elif isinstance(target, list | tuple):
        items = [int(c) if isinstance(c, np.integer) else c for c in target]
        if not all(isinstance(c, int) and not isinstance(c, bool) for c in items):
            raise TypeError("target list must contain ints (one class index per "
                            "example); tuples for multi-dimensional outputs are not supported")
        t = torch.tensor(items, dtype=torch.long)
    else:
        raise TypeError(f"target must be an int, a list of ints, an integer tensor or array, "
                        f"or None, got {type(target).__name__}")
    if t.numel() != batch:
        raise ValueError(f"target has {count_noun(t.numel(), 'entry', 'entries')} but the batch "
                         f"has {count_noun(batch, 'image')}; "
                         "give one class per image or a single int")
    if ((t < 0) | (t >= num_classes)).any():
        raise ValueError(f"target values must be in [0, {num_classes}), got {t.tolist()}")
    return t.contiguous()


@dataclass
class Prepared:
    """Validated inputs of one call (methods and metrics alike).

    Attributes:
        images (Tensor): images [B, C, H, W] in the model's dtype.
        target (Tensor or None): [B] int64 class per image; ``None`` = predicted class
            (resolved to the prediction when ``prepare(..., predict=True)``).
        layout (Layout): the token layout of ``images``.
        was_tuple (bool): whether the inputs came as a 1-tuple (Captum style).
        logits (Tensor or None): the model's logits [B, classes] with ``predict=True``.
    """

    images: Tensor
    target: Tensor | None
    layout: Layout
    was_tuple: bool
    logits: Tensor | None = None
    embedding: TargetHead | Target | None = None
    """For an embedding model: the target vectors; for a
    :class:`~captum_vit.targets.Target`: the target. ``target`` then indexes its columns
    and the call runs inside ``adapter.targeting(embedding)`` (:mod:`captum_vit.targets`)."""


def prepare(adapter: ViTAdapter, inputs: Any, target: TargetLike, *,
            predict: bool = False) -> Prepared:
    """The one way in for every method and metric: validate images and target.

    Images must be a floating-point [B, C, H, W] tensor (or a 1-tuple holding one) of the
    model's input size and parameter dtype (the dtype rule: no silent casts; a mismatch
    raises ``TypeError`` naming both dtypes and the fix). Targets are checked against the
    model's number of classes. The adapter checks once per dtype, device and size that
    it reproduces the model's forward.

    Args:
        adapter (ViTAdapter): the model's adapter.
        inputs (Tensor or tuple): the images.
        target (int, list, Tensor, numpy, optional): class per image, ``None`` = predicted;
            for a model that outputs an embedding, target vectors (a float tensor or
            :class:`~captum_vit.targets.EmbeddingTarget`).
        predict (bool, optional): also run the model and resolve ``None`` to the
            predicted class (metrics). Default False.

    Returns:
        Prepared

    Examples::

        >>> from captum_vit.adapters import adapt
        >>> p = prepare(adapt(model), images, [0, 3], predict=True)
        >>> p.target, p.logits.shape
    """
    images, was_tuple = check_images(inputs, video=adapter.video)
    adapter.check_inputs(images)
    emb: TargetHead | None = None
    obj = as_target(target)
    if obj is not None:
        if adapter.head.target is not None and adapter.score_target is None:
            raise TypeError(f"target is a {type(obj).__name__}, but scores against target "
                            "embeddings are in force (captum_vit.targets.scoring): pass the "
                            "index of a vector, or call outside that block")
        if predict:
            raise TypeError("prepare(predict=True) with a Target needs it in force: call it "
                            "inside adapter.targeting(target) with target= its index")
        adapter.self_check(images)
        obj = obj.resolve(adapter, images)
        obj.readout_layers(len(adapter.blocks))  # clear errors before any forward
        with adapter.targeting(obj):
            num = adapter.num_classes
        index = obj.index(images.shape[0])
        t = None if index is None else check_target(index, images.shape[0], num)
        return Prepared(images, t, adapter.layout(images), was_tuple, embedding=obj)
    if adapter.embedding and adapter.head.target is None:
        emb, target = embedding_target(target, images.shape[0], adapter.num_classes, images)
        if predict:
            raise TypeError("prepare(predict=True) on an embedding model needs its target "
                            "embeddings in force: call it inside adapter.targeting(head) "
                            "(the metrics of captum_vit.metrics do so for target=)")
    elif is_embedding_target(target):
        raise TypeError("target vectors (float tensors, EmbeddingTarget) are for models "
                        f"that output an image embedding; this {type(adapter.model).__name__} "
                        "is a classifier: pass class indices (ints or a tensor of an "
                        "integer dtype)")
    num = adapter.num_classes if emb is None else emb.vectors.shape[0]
    t = check_target(target, images.shape[0], num)
    embedding: TargetHead | Target | None = emb
    if adapter.score_target is not None:  # a Target in force (the metrics): its index
        embedding = adapter.score_target
    adapter.self_check(images)
    prep = Prepared(images, t, adapter.layout(images), was_tuple, embedding=embedding)
    if predict:
        with torch.no_grad():
            prep.logits = adapter.model_logits(images)
        prep.target = resolve_target(t, prep.logits)
    return prep


def resolve_target(target: Tensor | None, logits: Tensor) -> Tensor:
    """``None`` -> the predicted class of each image (unlike Captum, see the docs)."""
    if target is None:
        return logits.detach().argmax(-1)
    return target.to(logits.device)


def target_scores(logits: Tensor, target: Tensor, score: str = "logit",
                  probability: str = "softmax") -> Tensor:
    """Per-image score ``s_c`` [B]: the target logit or its probability, of the kind
    ``probability`` (the adapter's :attr:`~captum_vit.adapters.ViTAdapter.probability`:
    ``"softmax"`` or ``"sigmoid"``)."""
    if score == "probability":
        logits = probabilities(logits, probability)
    return logits.gather(1, target[:, None]).squeeze(1)


def score_reduce(target: Tensor, score: str = "probability", dtype: torch.dtype | None = None,
                 probability: str = "softmax") -> Callable[[Tensor, Tensor], Tensor]:
    """``reduce(logits [n, classes], images [n]) -> [n]``: the score of each image's target
    (:func:`target_scores` in ``dtype``, probabilities of the kind ``probability``), the
    form the perturbation engines (:func:`~captum_vit.adapters.subsets.subset_logits`,
    :func:`~captum_vit.adapters.subsets.image_logits`) take, so that they keep one score
    per perturbed input instead of its logits."""

    def reduce(logits: Tensor, images: Tensor) -> Tensor:
        return target_scores(logits if dtype is None else logits.to(dtype),
                             target[images.to(target.device)], score, probability)

    return reduce


def gradients(scores: Tensor, tensors: Sequence[Tensor], *, trace: Trace | None = None,
              retain_graph: bool | None = None) -> list[Tensor]:
    """``d s_c / d T`` for every tensor T from ONE backward pass of ``sum_b s_c(b)``.

    Images do not interact in a ViT, so summing over the batch gives per-image gradients.
    With ``trace``, the same backward also gives the gradient at the states a target
    reading token rows read (``trace.read_grad``, the readout of
    :func:`readout_rows`).
    """
    read = [z for z in (trace.read or []) if z.requires_grad] if trace is not None else []
    grads = list(torch.autograd.grad(scores.sum(), [*tensors, *read],
                                     retain_graph=retain_graph))
    if read:
        trace.read_grad = grads[len(tensors):]  # type: ignore[union-attr]
    return grads[:len(tensors)]


def _size(images: Tensor) -> tuple[int, int]:
    """``(H, W)`` of images [..., H, W]."""
    return int(images.shape[-2]), int(images.shape[-1])


def format_output(tokens: Tensor, layout: Layout, images: Tensor, output: str) -> Tensor:
    """Patch scores [B, P] -> tokens, a grid [B, 1, gh, gw] or pixels shaped like the images.

    Per-head scores [B, H, P] (``heads="all"``) -> tokens [B, H, P], a grid
    [B, H, gh, gw] or pixels [B, H, H_img, W_img]: one channel per head instead of the
    image's channels.

    Videos (``layout.frames`` set): a grid [B, 1, F, gh, gw] (per head [B, H, F, gh, gw])
    or pixels shaped like the video [B, T, C, H, W] (per head [B, T, H, H_img, W_img]),
    each tubelet's score copied to its frames and pixels."""
    if output == "tokens":
        return tokens
    if layout.frames is not None:
        lead = tokens.shape[:-1] if tokens.dim() == 3 else (tokens.shape[0], 1)
        grid = tokens.reshape(*lead, layout.frames, *layout.frame_grid)
        if output == "grid":
            return grid
        pix = grid_to_video(grid, _size(images), patch_size=layout.patch_size,
                            tubelet=layout.tubelet).movedim(1, 2)  # [B, T, c, H, W]
        if tokens.dim() == 3:
            return pix
        return pix.expand(-1, -1, images.shape[2], -1, -1).contiguous()
    if tokens.dim() == 3:
        b, h, _ = tokens.shape
        grid = tokens_to_grid(tokens.reshape(b * h, -1), layout)
        grid = grid.reshape(b, h, *grid.shape[-2:])
        if output == "grid":
            return grid
        return grid_to_pixels(grid, _size(images), patch_size=layout.patch_size)
    grid = tokens_to_grid(tokens, layout)
    if output == "grid":
        return grid
    pix = grid_to_pixels(grid, _size(images), patch_size=layout.patch_size)
    return pix.expand(-1, images.shape[1], -1, -1).contiguous()


def _is_batch(inputs: Any) -> bool:
    """Whether ``inputs`` is a processor's output: a mapping, or transformers'
    ``BatchFeature`` (a ``UserDict``), recognised without importing transformers."""
    return isinstance(inputs, Mapping) or (
        not isinstance(inputs, Tensor) and hasattr(inputs, "keys")
        and hasattr(inputs, "__getitem__"))


def _group_target(target: TargetLike, index: Tensor, total: int, groups: int) -> TargetLike:
    """The target of one group of a processor batch's images (``index``: their positions):
    per-image class indices or vectors are indexed, one for all passes as it is (a vector
    ``[D′]`` too; an :class:`~captum_vit.targets.EmbeddingTarget` has its per-image
    vectors or indices indexed; a target with ``for_images(index, total)``, e.g.
    :class:`~captum_vit.targets.VLMAnswer` on Qwen-VL, gives its own restriction)."""
    if target is None or isinstance(target, int | np.integer):
        return target
    if isinstance(target, Tensor) and torch.is_floating_point(target) and target.dim() == 1:
        return target  # one target vector for every image
    if isinstance(target, EmbeddingTarget):
        v, which = target.vectors, target.index
        if which is None and isinstance(v, Tensor) and v.dim() == 2 and v.shape[0] == total \
                and total > 1:
            return dataclasses.replace(target, vectors=v[index.to(v.device)])
        if which is None or isinstance(which, str | int | np.integer):
            return target
        w = torch.as_tensor(which).reshape(-1)
        if w.numel() == 1:
            return target
        if w.numel() != total:
            entries = count_noun(w.numel(), "entry", "entries")
            raise ValueError(f"EmbeddingTarget.index has {entries} but the processor's "
                             f"batch holds {count_noun(total, 'image')}; give one per "
                             "image or one for all")
        return dataclasses.replace(target, index=w[index.to(w.device)])
    if isinstance(target, Target) or not isinstance(target, Tensor | np.ndarray | list
                                                     | tuple):
        if groups == 1:
            return target
        select = getattr(target, "for_images", None)
        if callable(select):  # a target that knows its images (VLMAnswer on Qwen-VL)
            return cast(TargetLike, select(index, total))
        raise ValueError(f"target is a {type(target).__name__}, and the processor's batch "
                         f"holds images of {groups} different grids, explained one grid at "
                         "a time: give class indices (one per image or one for all), or "
                         "explain the images of each grid in their own call")
    t = torch.as_tensor(np.asarray(target)) if not isinstance(target, Tensor) else target
    if t.dim() == 0 or t.shape[0] == 1:
        return target
    if t.shape[0] != total:
        raise ValueError(f"target has {count_noun(t.shape[0], 'entry', 'entries')} but the "
                         f"processor's batch holds {count_noun(total, 'image')}; give one "
                         "per image or one for all")
    return t[index.to(t.device)]


def attribute_processed(attribute: Callable[..., Any], adapter: ViTAdapter,
                        batch: Mapping[str, Any], target: TargetLike, output: str,
                        **kwargs: Any) -> Tensor | list[Tensor]:
    """Explain a processor's output for a family whose
    ``pixel_values`` are not images ``[B, C, H, W]`` (:attr:`ViTAdapter.processor_keys`:
    SigLIP2 NaFlex, Qwen-VL's packed patches).

    The batch is split into groups of images of one grid
    (:meth:`ViTAdapter.processor_images`: each image unpadded, on its own grid) and each
    group is explained by ``attribute`` (the method's front, one call per grid), so a
    batch of different sizes is one call and padding is never explained. The maps come
    back per image:

    - ``"pixels"`` and ``"grid"``: one tensor ``[B, ...]`` when every image has the same
      grid, else a list of per-image ``[1, ...]`` maps (image order), each on its own
      grid;
    - ``"tokens"``: ``[ΣN]`` (``[H, ΣN]`` per head): every image's patch tokens in raster
      order, one image after the other;
    - ``"inputs"``: shaped like ``batch["pixel_values"]`` (Captum's rule;
      :meth:`ViTAdapter.processor_pixels`), padding zero.

    Args:
        attribute (Callable): the method's ``_attribute(images, target, output,
            **kwargs)``.
        adapter (ViTAdapter): the model's adapter.
        batch (Mapping): the processor's output.
        target (int, list, Tensor, Target, optional): one per image or one for all; a
            :class:`~captum_vit.adapters.scoring.Target` object when the batch holds one
            grid, or one with ``for_images`` (:meth:`~captum_vit.targets.VLMAnswer.
            for_images`).
        output (str): ``"pixels"``, ``"grid"``, ``"tokens"`` or ``"inputs"``.
        **kwargs: the method's options.

    Returns:
        Tensor or list of Tensor: the maps per image (above).

    Raises:
        ValueError: keys missing or inconsistent (the family's rules), a target of
            another length than the images, a ``Target`` object with several grids.

    Examples::

        >>> batch = processor(images=[small, large], return_tensors="pt")  # NaFlex
        >>> maps = GAE(model).attribute(batch, target=[3, 7])  # two [1, C, H_i, W_i]
    """
    check_choice("output", output, (*OUTPUTS, "inputs"))
    groups = adapter.processor_images(batch)
    total = sum(int(index.numel()) for index, _ in groups)
    per_image: list[Tensor | None] = [None] * total
    for index, images in groups:
        maps = attribute(images, _group_target(target, index, total, len(groups)),
                         "pixels" if output == "inputs" else output, **kwargs)
        for j, i in enumerate(index.tolist()):
            per_image[i] = maps[j] if output == "tokens" else maps[j:j + 1]
    done = [m for m in per_image if m is not None]
    if len(done) != total:
        raise ValueError("the processor's batch split into groups that do not cover every "
                         "image once (the family's processor_images)")
    if output == "tokens":
        return torch.cat(done, -1)
    if output == "inputs":
        return adapter.processor_pixels(done, batch)
    if all(m.shape == done[0].shape for m in done):
        return torch.cat(done)
    return done


def accumulation_dtype(t: Tensor) -> torch.dtype:
    """float32 for half/bfloat16 tensors (maps accumulate products), else the dtype itself."""
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype


class ViTFront:
    """The Captum front of every method of the package: input, target and output handling
    shared by gradient and perturbation methods.

    A method subclasses :class:`ViTGradientAttribution` or
    :class:`ViTPerturbationAttribution` and implements ``_token_maps(inputs, target,
    **kwargs) -> [B, N]``; ``attribute`` (Captum's signature) prepares the inputs and the
    target with :func:`prepare`, computes the token maps inside the adapter's
    :meth:`~captum_vit.adapters.ViTAdapter.targeting` and formats them
    (:func:`format_output`). Other code recognises a method of the package by
    ``isinstance(attribution, ViTFront)`` (it takes ``output="tokens"``).

    Args:
        model (nn.Module): a supported ViT, or an adapter
            (:func:`captum_vit.adapters.adapt`).

    Examples::

        >>> from captum_vit import GAE
        >>> from captum_vit._base import ViTFront
        >>> isinstance(GAE(model), ViTFront)
        True
    """

    adapter: ViTAdapter
    class_agnostic: bool = False
    """Whether the map is the same for every score of the model (gradient-free attention
    flow: raw attention, Rollout, GlobEnc, ALTI): it refuses a contrast between scores."""
    sums_subnetworks: bool = False
    """Whether the method sums maps over sub-networks ``f_l`` that end at the model's
    output (PLUS, SkipPLUS, FullGrad+): it refuses targets reading block outputs."""
    per_head: bool = False
    """Whether ``attribute`` takes ``heads="mean" | "all"`` (per-head maps): the
    method's map is a head average of per-head maps, which ``_head_maps`` returns. The
    ``attribute`` of every other subclass refuses ``heads=`` by name."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("per_head"):
            _PER_HEAD[cls.__name__] = None
        elif "attribute" in cls.__dict__ and not cls.per_head:
            # a Captum Attribution subclass's attribute (this class is its mixin)
            cls.attribute = _refusing_heads(  # type: ignore[attr-defined]
                cls.__dict__["attribute"])

    conserves: bool = False
    """Whether the maps are relevances whose sum is meaningful (decompositions): a map on
    a later stage's grid (Swin) is then shared among each merged token's children on its
    way to the first grid instead of copied to them
    (:meth:`~captum_vit.adapters.Stages.carry`)."""

    removes_tokens: bool = False
    """Whether the method removes tokens from the model's input (true token removal: TIS's
    token subsets). A model whose attention works in windows of a fixed token grid (Swin,
    SAM's image encoder, :mod:`captum_vit.adapters.windows`) needs every token, so it
    refuses such a method by name; the message names the registered methods that run
    there (:func:`captum_vit.registry.windowed_methods`, read from this declaration)."""

    reads_window_slots: bool = False
    """Whether the method reads a windowed block slot by slot, each slot one token (BT's
    and TAM's head-weighted products, GlobEnc's and ALTI's per-window decompositions). A
    block whose windows share a token (TimeSformer's spatial attention: the class token
    in every frame's window, :mod:`captum_vit.adapters.families.hf_timesformer`) refuses
    such a method by name."""
    pools_queries: bool = False
    """Whether the method runs through blocks with query pooling (Hiera's stage changes,
    :class:`~captum_vit.adapters.windows.QueryPool`): methods that need only the canonical
    forward, its gradients, its rule sets or its decomposition, and the matrix methods
    whose chains carry a pooling block's ``N/4 × N`` mixing (``Stages.residual``). Any
    other method refuses such a model by name."""

    linear_in_read_gradient: bool = False
    """Whether the map depends on the explained score ``s`` only through its gradient at the
    states the score reads, ``g_l = ∂s/∂x_l`` at the forward of the given inputs (with
    ``score="logit"``): one forward, the score's gradients (and the read rows'
    input×gradient), never the score's value, a path of scaled inputs, other evaluation
    points or per-layer readouts. The map of ``s`` then equals the map of the linear score
    ``Σ_l ⟨x_l, g_l⟩`` (chain rule), so a costly target (``Target.linearises``: a VLM's
    tiles) is evaluated once per call and :func:`~captum_vit.targets.vlm.per_token_maps`
    runs the language model once for all answer tokens. Default False (the target is
    evaluated inside the method's own passes)."""

    traces_read_gradients: bool = False
    """Whether the method's map is linear in the gradient its engine's ONE backward pass
    carries from the score (input×gradient terms, the LRPs) and it implements
    :meth:`_token_maps_each`: several linear scores ``⟨x, g^{(k)}⟩`` (the answer tokens of
    :func:`~captum_vit.targets.vlm.per_token_maps`) are then explained from one trace of
    the tower and one backward per score (:meth:`_read_gradient_maps`). Default False (one
    ``attribute`` call per score)."""

    sums_block_terms: bool = False
    """Whether the map sums a term per block below the block the score reads (AttCAT's
    ``α_l ⊙ cat_l`` over the block inputs): a target reading several blocks then needs
    one pass per read block (:meth:`_block_sum`), since one pass reading them all would
    add, for a lower read block, the terms of the blocks above it. Default False."""

    def __init__(self, model: nn.Module | ViTAdapter) -> None:
        self.adapter = adapt(model)
        self.model = model
        super().__init__(model)  # type: ignore[call-arg]  # the Captum base next in the MRO

    @property
    def multiplies_by_inputs(self) -> bool:
        return False

    @overload
    def _attribute(self, inputs: Tensor, target: TargetLike, output: str,
                   **kwargs: Any) -> Tensor: ...

    @overload
    def _attribute(self, inputs: tuple[Tensor], target: TargetLike, output: str,
                   **kwargs: Any) -> tuple[Tensor]: ...

    @overload
    def _attribute(self, inputs: Mapping[str, Any], target: TargetLike, output: str,
                   **kwargs: Any) -> Tensor | list[Tensor]: ...

    def _attribute(self, inputs: Any, target: TargetLike, output: str,
                   **kwargs: Any) -> Tensor | tuple[Tensor] | list[Tensor]:
        if self.adapter.processor_keys and _is_batch(inputs):
            return attribute_processed(self._attribute, self.adapter, inputs, target,
                                       output, **kwargs)
        check_choice("output", output, OUTPUTS)
        heads = check_choice("heads", kwargs.pop("heads", "mean"), HEADS)
        maps_of = self._token_maps if heads == "mean" else self._head_maps
        p = prepare(self.adapter, inputs, target)
        if self.removes_tokens and any(b.window is not None for b in self.adapter.blocks):
            raise ValueError(_windowed_refusal(type(self).__name__, type(self.model).__name__))
        if self.reads_window_slots and any(getattr(b.window, "shares_tokens", False)
                                           for b in self.adapter.blocks):
            raise ValueError(
                f"{type(self).__name__} reads each attention window slot by slot, one token "
                f"per slot, but {type(self.model).__name__} has windows that share a token "
                "(divided space-time attention: the class token sits in every frame's "
                "window and its rows are averaged back), so it does not apply; use a "
                "method that chains the token maps (rollout, GAE, TokenTM, Chefer21, "
                "AttCAT) or a decomposition or LRP method (DecompX, AttnLRP, CP-LRP)")
        if not self.pools_queries and any(b.pool is not None for b in self.adapter.blocks):
            raise ValueError(_pooling_refusal(type(self).__name__, type(self.model).__name__))
        obj = p.embedding if isinstance(p.embedding, Target) else None
        layers = None if obj is None else obj.readout_layers(len(self.adapter.blocks))
        if obj is not None and obj.contrast and self.class_agnostic:
            raise ValueError(f"{type(self).__name__} is class-agnostic: its map is the same "
                             f"for both sides of {type(obj).__name__}, so it cannot explain "
                             "their difference; use a gradient-weighted method (GAE, "
                             "TokenTM, Chefer21) or a gradient (TokenIxG, DecompX)")
        if layers is not None and self.sums_subnetworks:
            raise ValueError(f"{type(self).__name__} sums maps of the sub-networks that end "
                             f"at the model's output; {type(obj).__name__} reads block "
                             f"outputs {list(layers)}: explain it with the base method "
                             "alone")
        several = (layers is not None and len(layers) > 1  # else one pass reads them all
                   and not self._reads_blocks_in_one_pass(heads, kwargs))
        if isinstance(obj, _BlockGradient) and obj.tokens > 1:  # _read_gradient_maps
            patches = self._patches(p, self._each_token(p, obj, heads, kwargs))
        elif obj is not None and (several or self._linearises(obj, kwargs)) and not isinstance(
                self, PerturbationAttribution):
            patches = self._block_sum(p, obj, layers, {**kwargs, "heads": heads})
        else:
            # Captum's NoiseTunnel / sensitivity_max may call under no_grad
            with torch.enable_grad(), self.adapter.targeting(p.embedding, grid=p.layout.grid):
                maps = maps_of(p.images, p.target, **kwargs).detach()
            patches = self._patches(p, maps)
        if not isinstance(obj, _BlockGradient) and not isinstance(self.adapter,
                                                                   SubnetworkAdapter):
            self._warn_if_flat(p, patches)
        if isinstance(target, TextEmbeddingTarget):  # its text side, after the image map
            target.explain_text(self, p.images, p.target)
        out = format_output(patches, p.layout, p.images, output)
        return (out,) if p.was_tuple else out

    def _patches(self, p: Prepared, maps: Tensor) -> Tensor:
        """Token maps ``[..., N]`` (on a later stage's grid for Swin) -> the patch scores
        ``[..., P]`` on the first grid that :func:`format_output` takes."""
        if maps.shape[-1] != p.layout.num_tokens:  # a later stage's grid (Swin)
            maps = self.adapter.stages.carry(maps, split=self.conserves)
        return maps.to(accumulation_dtype(p.images))[..., p.layout.num_prefix:]

    def _each_token(self, p: Prepared, target: _BlockGradient, heads: str,
                    kwargs: Mapping[str, Any]) -> Tensor:
        """The token maps ``[K·B, N]`` (token-major) of the ``K`` linear scores a stacked
        :class:`_BlockGradient` holds, from :meth:`_token_maps_each` (one trace, one
        backward per score) under that target."""
        if not self._traces_read_gradient(heads, kwargs, several=len(target.grads) > 1):
            raise ValueError(f"{type(self).__name__} explains one read gradient per call: "
                             "call attribute once per token (per_token_maps does)")
        assert p.target is not None
        n = int(p.images.shape[0])
        with torch.enable_grad(), self.adapter.targeting(target, grid=p.layout.grid):
            maps = self._token_maps_each(p.images, [p.target + k * n
                                                    for k in range(target.tokens)], **kwargs)
        return torch.cat([m.detach() for m in maps])

    def _token_maps_each(self, inputs: Tensor, targets: Sequence[Tensor],
                         **kwargs: Any) -> list[Tensor]:
        """The token maps ``[B, N]`` of each of several target columns (``targets``: the
        column of every image, ``[B]`` each) from ONE trace of ``inputs`` and one backward
        per column, each equal to ``_token_maps(inputs, t, **kwargs)`` (score ``"logit"``),
        where :attr:`traces_read_gradients` is set."""
        raise NotImplementedError  # pragma: no cover

    def _read_gradient_maps(self, inputs: Any, rows: tuple[int, ...] | None,
                            grads: Sequence[Mapping[int | None, Tensor]],
                            **kwargs: Any) -> list[Any]:
        """The maps of the linear scores ``Σ_l ⟨x_l, g^{(k)}_l⟩``, one per gradient set
        ``grads[k]`` (the read states' gradients of one answer token,
        :func:`~captum_vit.targets.vlm.per_token_maps`), each as ``attribute(inputs,
        target=..., **kwargs)`` returns it.

        A method with :attr:`traces_read_gradients` (``heads="mean"``) gets them from ONE
        trace of the tower and one backward per set (:meth:`_token_maps_each`); any
        other calls ``attribute`` once per set (a tower forward and backward each).

        Args:
            inputs (Tensor or tuple): the images, as for ``attribute``.
            rows (tuple of int or None): the token rows the target reads
                (``Target.rows``).
            grads (sequence of Mapping): per score, the gradient ``[B, N, D]`` at each
                read state (block output ``l``, or ``None``: the final tokens).
            **kwargs: further options of ``attribute``.

        Returns:
            list: one ``attribute`` output per gradient set.
        """
        attribute = cast(Any, self).attribute  # a Captum Attribution's (this is its mixin)
        if not (len(grads) > 1 and self._traces_read_gradient(
                kwargs.get("heads", "mean"), kwargs, several=len(grads[0]) > 1)):
            return [attribute(inputs, target=_BlockGradient(g, rows), **kwargs)
                    for g in grads]
        keys = list(grads[0])
        stacked = _BlockGradient({l: torch.cat([g[l] for g in grads]) for l in keys}, rows,
                                 tokens=len(grads))
        out = attribute(inputs, target=stacked, **kwargs)
        each = (out[0] if isinstance(out, tuple) else out).chunk(len(grads))
        return [(m,) if isinstance(out, tuple) else m for m in each]

    def _warn_if_flat(self, p: Prepared, maps: Tensor) -> None:
        """Warn (``UserWarning``) when an image's map is exactly zero because the explained
        score does not depend on the input.

        A map that is zero everywhere is checked once more (one forward and backward of
        those images only, so the common case costs one comparison): when the gradient of
        the score at the embedding output is zero too, the score is flat (e.g. a
        classification head initialised to zeros, as torchvision's
        ``vit_b_16(weights=None)`` has) and the user is told why and what to do. A zero map
        with a non-zero gradient (a rectified CAM whose every value was negative) is the
        method's own result and passes silently.
        """
        zero = (maps.detach().reshape(maps.shape[0], -1) == 0).all(-1)
        if maps.numel() == 0 or not bool(zero.any()):
            return
        which = zero.nonzero()[:, 0].to(p.images.device)
        ad = self.adapter
        with torch.enable_grad(), ad.targeting(p.embedding, grid=p.layout.grid):
            x0 = ad.embed(p.images[which]).detach().requires_grad_()
            cols = ad.run(x0)
            t = resolve_target(None if p.target is None else p.target[which], cols)
            (grad,) = torch.autograd.grad(cols.gather(1, t[:, None]).sum(), [x0],
                                          allow_unused=True, materialize_grads=True)
        flat = (grad.reshape(grad.shape[0], -1) == 0).all(-1)
        if not bool(flat.any()):
            return
        shown = which[flat].tolist()
        warnings.warn(
            f"{type(self).__name__}'s map is exactly zero for "
            f"{count_noun(len(shown), 'image')} (index {', '.join(map(str, shown[:8]))}"
            f"{', ...' if len(shown) > 8 else ''}) because the explained score does not "
            "change with the input: its gradient is zero (e.g. a classification head "
            "initialised to zeros, as torchvision's vit_b_16(weights=None) has). Load "
            "trained weights, or pass a target whose score depends on the image.",
            UserWarning, stacklevel=3)

    def _explains_read_gradient(self, kwargs: Mapping[str, Any]) -> bool:
        """Whether this call's map depends on the score only through its read gradient
        (:attr:`linear_in_read_gradient`, and the score itself: ``score="logit"``)."""
        return (self.linear_in_read_gradient and not isinstance(self, PerturbationAttribution)
                and kwargs.get("score", "logit") == "logit")

    @property
    def linear_in_backward(self) -> bool:
        """Whether the map is linear in the gradient ONE backward pass carries from the
        score (no ReLU, absolute value or norm of it, no second pass): a target reading
        several blocks is then explained by one pass whose backward carries every read
        block's gradient at once (:meth:`_reads_blocks_in_one_pass`). Default
        :attr:`traces_read_gradients`."""
        return self.traces_read_gradients

    def _reads_blocks_in_one_pass(self, heads: str, kwargs: Mapping[str, Any]) -> bool:
        """Whether this call explains a target reading several blocks in one pass: equal to
        the sum of the single-block maps :meth:`_block_sum` adds (chain rule), for a map
        :attr:`linear_in_backward` (head mean, :meth:`_explains_read_gradient`) that does
        not sum terms over the blocks below the read block (:attr:`sums_block_terms`)."""
        return (self.linear_in_backward and not self.sums_block_terms and heads == "mean"
                and self._explains_read_gradient(kwargs))

    def _traces_read_gradient(self, heads: str, kwargs: Mapping[str, Any],
                              several: bool = False) -> bool:
        """Whether this call's maps of several linear scores come from one trace and one
        backward per score (:attr:`traces_read_gradients`, head mean,
        :meth:`_explains_read_gradient`; scores reading ``several`` blocks also
        :meth:`_reads_blocks_in_one_pass`)."""
        return (self.traces_read_gradients and heads == "mean"
                and self._explains_read_gradient(kwargs)
                and (not several or self._reads_blocks_in_one_pass(heads, kwargs)))

    def _linearises(self, target: Target, kwargs: Mapping[str, Any]) -> bool:
        """Whether this call explains ``target`` through its read gradients
        (``Target.linearises`` and :meth:`_explains_read_gradient`)."""
        return target.linearises and self._explains_read_gradient(kwargs)

    def _block_sum(self, p: Prepared, target: Target, layers: tuple[int, ...] | None,
                   kwargs: dict[str, Any]) -> Tensor:
        r"""A target reading several block outputs (:mod:`captum_vit.targets`), or a costly
        target (``Target.linearises``) under a method linear in the read gradient: the sum
        over the read blocks ``l`` (or the final tokens) of the method's map for the
        single-block score ``⟨x_l, g_l⟩``, ``g_l = ∂s/∂x_l`` the score's own gradient at
        that block's output (the partial derivative, the other read blocks held fixed;
        :func:`read_state_gradients`). By the chain rule the gradient of ``s`` w.r.t.
        anything before the blocks is the sum of these scores', so a method linear in the
        score's gradient (gradients, IxG, LRP) gives its map of ``s`` itself; a matrix
        method gets ``Σ_l w^{(l)ᵀ} C_l``. The score is explained as it is
        (``score="logit"``: a probability of the sum has no per-block parts). Methods that
        also use the score's value along a path (BT's and TAM's integrated gradients,
        Chefer'21's relevance, LeGrad's per-layer readouts) see the linearised scores.

        A method whose map is linear in the gradient its one backward carries
        (:meth:`_reads_blocks_in_one_pass`) adds nothing: one pass reads every block's
        gradient at once (the sum of the single-block maps, by the chain rule), so a
        target reading four blocks (Qwen3-VL's deepstack) costs one tower pass, not four."""
        if "score" in kwargs:  # the score itself: a probability of a sum has no block parts
            kwargs = {**kwargs, "score": "logit"}
        keys, (grads,) = read_state_gradients(self.adapter, p, target, [p.target])
        if len(keys) > 1 and self._reads_blocks_in_one_pass(kwargs.get("heads", "mean"),
                                                            kwargs):  # one pass
            return self._attribute(p.images, _BlockGradient(
                {l: g.detach() for l, g in zip(keys, grads, strict=True)}, target.rows),
                "tokens", **kwargs)
        total: Tensor | None = None
        for l, g in zip(keys, grads, strict=True):
            part = self._attribute(p.images, _BlockGradient({l: g.detach()}, target.rows),
                                   "tokens", **kwargs)
            total = part if total is None else total + part
        assert total is not None
        return total

    def _token_maps(self, inputs: Tensor, target: Tensor | None, **kwargs: Any) -> Tensor:
        raise NotImplementedError  # pragma: no cover

    def _head_maps(self, inputs: Tensor, target: Tensor | None, **kwargs: Any) -> Tensor:
        """Per-head token maps [B, H, N] (``heads="all"``) of a ``per_head`` method."""
        raise NotImplementedError  # pragma: no cover


def _windowed_refusal(method: str, model: str) -> str:
    """The refusal of a method that removes tokens by a windowed model, naming the
    registered methods that run there (:func:`captum_vit.methods.table.windowed_refusal`;
    the table sits below the methods, imported here when a refusal is written because its
    package imports every method, which import this module)."""
    from captum_vit.methods.table import windowed_refusal

    return windowed_refusal(method, model)


def _pooling_refusal(method: str, model: str) -> str:
    """The refusal of a method that reads token-mixing matrices by a model with query
    pooling (Hiera), naming the registered methods that run there."""
    from captum_vit.methods.table import pooling_methods

    runs = pooling_methods()
    return (f"{method} reads the blocks' token-mixing matrices, and {model} pools its "
            "queries at the stage changes (each block mixing N tokens into N/4), which "
            f"{method} does not carry: use one of {runs}")


_PER_HEAD: dict[str, None] = {}
"""Names of the classes with ``per_head = True`` (ordered set), for the refusal message."""


def _refusing_heads(attribute: Callable[..., Any]) -> Callable[..., Any]:
    """``attribute`` of a class without per-head maps, refusing ``heads=`` by name (rather
    than Python's bare unexpected-keyword error). The check sits under Captum's
    ``@log_usage()``, so NoiseTunnel (which calls ``attribute.__wrapped__``) meets it too;
    ``inspect.signature`` still reads the method's own signature."""
    inner = getattr(attribute, "__wrapped__", attribute)  # under @log_usage()

    @functools.wraps(inner)
    def refusing(self: Any, *args: Any, **kwargs: Any) -> Any:
        if "heads" in kwargs:
            raise TypeError(
                f"{type(self).__name__}.attribute takes no heads= option: per-head maps "
                f"(heads='all') are offered only by the methods whose map is a head average "
                f"of per-head maps, {', '.join(_PER_HEAD) or 'none'}; call one of them "
                f"directly")
        return inner(self, *args, **kwargs)

    return log_usage()(refusing)


class _BlockGradient(Target):
    """``Σ_l ⟨x_l, g_l⟩`` per image: the read states of a target (block outputs ``x_l``, or
    the final tokens for the key ``None``), linearised at its gradients ``g_l``
    (:meth:`ViTFront._block_sum`, :func:`~captum_vit.targets.vlm.per_token_maps`); one
    column per image."""

    reads_tokens = True

    def __init__(self, grads: Mapping[int | None, Tensor],
                 rows: tuple[int, ...] | None, tokens: int = 1) -> None:
        if not grads or (None in grads and len(grads) > 1):
            raise ValueError("_BlockGradient reads block outputs or the final tokens")
        self.grads = dict(grads)
        self.tokens = tokens
        """How many scores the gradients stack (``[K·B, N, D]``, score-major): the
        columns hold every score of every image; :meth:`index` picks the first's."""
        layers = [l for l in self.grads if l is not None]
        self.blocks = tuple(layers) if layers else None
        self.rows = rows

    @property
    def _batch(self) -> int:
        return int(next(iter(self.grads.values())).shape[0])

    def num_columns(self, num_classes: int) -> int:
        return self._batch

    def index(self, batch: int) -> Tensor:
        return per_image(torch.arange(self._batch // self.tokens), batch,
                         "the read blocks' gradients")

    def columns(self, out: Outputs) -> Tensor:
        total: Tensor | None = None
        for l, g in self.grads.items():
            x = out.tokens if l is None else out.hidden[l]
            assert x is not None
            part = torch.einsum("nid,bid->nb", x, g.to(x.dtype))
            total = part if total is None else total + part
        assert total is not None
        return total


class _Capture(Target):
    """The read states of ``target`` without its score: what :func:`read_state_gradients`'s
    forward stores (one dummy column)."""

    def __init__(self, target: Target) -> None:
        self.blocks = target.blocks
        self.reads_tokens = target.reads_tokens
        self.prefix_rows_only = target.prefix_rows_only
        self.rows = target.rows
        self.out: Outputs | None = None

    def columns(self, out: Outputs) -> Tensor:
        self.out = out
        x = out.tokens if self.blocks is None else next(iter(out.hidden.values()))
        assert x is not None
        return x.new_zeros(x.shape[0], 1)


def read_state_gradients(adapter: ViTAdapter, p: Prepared, target: Target,
                         indices: Sequence[Tensor | None]
                         ) -> tuple[list[int | None], list[list[Tensor]]]:
    r"""The gradients ``g_l = ∂s/∂x_l`` of ``target``'s picked scores at the states it
    reads: one forward of ``p.images`` to those states (no gradient, the target not
    evaluated; none when the target holds them, ``Target.read_states``), then
    :meth:`~captum_vit.adapters.scoring.Target.read_gradients` on them as leaves (a VLM's
    answer: its language model once for every index).

    Args:
        adapter (ViTAdapter): the model's adapter.
        p (Prepared): the prepared call (images, layout).
        target (Target): the resolved target.
        indices (sequence of Tensor or None): the picked columns, ``[n]`` each.

    Returns:
        tuple: the read states' keys (block outputs ``l`` in ``[1, L]``, or ``[None]``:
        the final tokens) and, per index, the gradient ``[n, N, D]`` of each.
    """
    num_blocks = len(adapter.blocks)
    layers = target.readout_layers(num_blocks)
    keys: list[int | None] = [None] if layers is None else list(layers)
    held = target.read_states(p.images)
    if held is not None:  # the target's own clean forward (a VLM's resolve)
        states = {None if l is None else (l + num_blocks + 1 if l < 0 else l): v.detach()
                  for l, v in held.items()}
        if sorted(states, key=lambda l: -1 if l is None else l) != keys:
            raise ValueError(f"{type(target).__name__}.read_states returned the states "
                             f"{sorted(held, key=str)}, not those it reads {keys}")
        out: Outputs | None = Outputs(
            tokens=states.get(None), hidden={l: v for l, v in states.items() if l is not None},
            num_prefix=adapter.num_prefix, grid=p.layout.grid, num_blocks=num_blocks)
    else:
        capture = _Capture(target)
        with torch.no_grad(), adapter.targeting(capture, grid=p.layout.grid):
            adapter.run(adapter.embed(p.images))
        out = capture.out
    assert out is not None
    with torch.enable_grad():
        if layers is None:
            assert out.tokens is not None
            leaves = [out.tokens.detach().requires_grad_()]
            read = dataclasses.replace(out, tokens=leaves[0])
        else:
            leaves = [out.hidden[l].detach().requires_grad_() for l in layers]
            read = dataclasses.replace(out, hidden=dict(zip(layers, leaves, strict=True)))
        grads = target.read_gradients(read, leaves, indices)
    return keys, [[g.detach() for g in gs] for gs in grads]


class ViTGradientAttribution(ViTFront, GradientAttribution):
    """Base of the gradient- and attention-based ViT methods."""


class ViTPerturbationAttribution(ViTFront, PerturbationAttribution):
    """Base of the perturbation-based ViT methods."""

    pools_queries = True  # they run the model's forward only (query pooling included)


def gradients_with_pool(tr: Trace, scores: Tensor, tensors: Sequence[Tensor]
                        ) -> tuple[list[Tensor], Tensor | None]:
    """:func:`gradients` w.r.t. ``tensors`` and, for an attention-pool head, w.r.t. the
    pool's probabilities ``A_p`` (``None`` otherwise), all from one backward pass."""
    pool = [] if tr.pool_attn is None else [tr.pool_attn]
    grads = gradients(scores, [*tensors, *pool], trace=tr)
    return grads[:len(tensors)], (grads[-1] if pool else None)


def readout_rows(tr: Trace, pool_grad: Tensor | None = None, *,
                 dtype: torch.dtype | None = None, target: Tensor | None = None) -> Tensor:
    r"""Readout weights ``w`` [B, N] of one traced batch.

    A method that ends with a token-to-token matrix ``R`` gives the map ``w R``. For the
    class token, average pooling, distillation and DINOv2's CLS+mean the weights are
    fixed (:meth:`Layout.readout_weights`). For an attention-pool head (``"map"``)
    they are the pool's attention over the tokens:
    :math:`w = \mathrm{mean}_h A_p^h[0, :]` for gradient-free methods and, with
    ``pool_grad`` (:math:`\nabla A_p`), :math:`w = \mathrm{mean}_h \mathrm{ReLU}(\nabla
    A_p^h \odot A_p^h)[0, :]` for gradient-weighted ones (the pool counts as one more
    attention layer without identity: its query is not a token). DINOv2's CLS+mean with
    ``alpha="logit"`` (:func:`captum_vit.adapters.readout_alpha`) takes ``α`` of each
    image's explained class from ``tr.readout_alpha``.

    Args:
        tr (Trace): the traced batch.
        pool_grad (Tensor, optional): gradient of the score w.r.t. ``tr.pool_attn``.
        dtype (torch.dtype, optional): dtype of the weights (default: the trace's).
        target (Tensor, optional): the explained class of each image [B] (needed with
            ``alpha="logit"``).

    Returns:
        Tensor [B, N].
    """
    x0 = tr.x0
    dt = dtype or x0.dtype
    if tr.layout.readout == "rows":
        return _read_rows(tr, dt)
    if tr.readout_alpha is not None:  # w = α e_0 + (1 − α) u_P, α per image and class
        if target is None:
            raise ValueError("alpha='logit' needs the explained class of each image")
        alpha = tr.readout_alpha.gather(1, target.to(x0.device)[:, None]).to(dt)
        k, n = tr.layout.num_prefix, x0.shape[1]
        w = x0.new_zeros(x0.shape[0], n, dtype=dt)
        w[:, k:] = (1 - alpha) / (n - k)
        w[:, :1] = alpha
        return w
    if tr.pool_attn is None:
        n = x0.shape[1] if tr.final_tokens is None else tr.final_tokens
        w = tr.layout.readout_weights(n, dtype=dt, device=x0.device)
        return w.expand(x0.shape[0], -1)
    a = tr.pool_attn.detach().to(dt)
    if pool_grad is not None:
        a = (pool_grad.to(dt) * a).clamp(min=0)
    return a.mean(1)[:, 0]


def _read_rows(tr: Trace, dt: torch.dtype) -> Tensor:
    r"""Readout weights of a target that reads token rows ``z`` (our
    choice): with the score's gradient (gradient-weighted methods, after
    :func:`gradients_with_pool`) the positive input×gradient relevance of each row,
    :math:`w_i = \mathrm{ReLU}(⟨z_i, ∂s/∂z_i⟩) / \sum_j \mathrm{ReLU}(⟨z_j, ∂s/∂z_j⟩)`
    (the LRP initialisation at the read layer; a score read from the class token alone
    gives :math:`e_{CLS}`); where no row is positive, :math:`|⟨z_i, ∂s/∂z_i⟩|` normalised
    (so that a negative class-token score still reads the class token). Without the
    gradient (gradient-free methods): uniform over the target's ``rows`` (default the
    patch rows)."""
    x0 = tr.x0
    # the read state's tokens: a later stage's grid on a hierarchical model (Hiera, SAM 2)
    n = x0.shape[1] if tr.final_tokens is None else tr.final_tokens
    uniform = tr.layout.readout_weights(n, dtype=dt, device=x0.device).expand(x0.shape[0], -1)
    if tr.read is None or tr.read_grad is None:
        return uniform
    r = cast(Tensor, sum((z.detach().to(dt) * g.to(dt)).sum(-1) for z, g in
                         zip(tr.read, tr.read_grad, strict=True)))  # read is never empty
    if r.shape[1] != n:  # the target read fewer rows than the trace has
        r = torch.nn.functional.pad(r, (0, n - r.shape[1]))
    w = r.clamp(min=0)
    tot = w.sum(-1, keepdim=True)
    none = tot == 0
    if none.any():
        w = torch.where(none, r.abs(), w)
        tot = w.sum(-1, keepdim=True)
    return torch.where(tot > 0, w / tot.clamp_min(torch.finfo(dt).tiny), uniform)


def readout(weights: Tensor, rows: Tensor) -> Tensor:
    """The readout row ``r = Σ_i w_i row_i`` of per-token matrices [B, ..., N, M] with
    weights [B, N] (:func:`readout_rows`) -> [B, ..., M]."""
    return torch.einsum("bn,b...nm->b...m", weights.to(rows.dtype), rows)


def check_layer(name: str, value: Any, num_blocks: int, *, allow_end: bool = False) -> int:
    """Validate a block index in ``[0, L)`` (``[0, L]`` with ``allow_end``)."""
    hi = num_blocks if allow_end else num_blocks - 1
    try:
        return check_scalar(value, name, int, min_val=0, max_val=hi)
    except ValueError:
        raise ValueError(f"{name} must be in [0, {hi}] for this {num_blocks}-block "
                         f"model, got {value}") from None


def check_layers(layers: Iterable[int], num_blocks: int) -> tuple[int, ...]:
    """Validate a non-empty collection of distinct block indices in ``[0, L-1]``
    (PLUS/SkipPLUS start layers, GradSAM's and LeGrad's blocks); returned sorted.

    Examples::

        >>> check_layers([3, 1], num_blocks=12)
        (1, 3)
    """
    if isinstance(layers, int | str) or not isinstance(layers, Iterable):
        raise TypeError(f"layers must be a list/range of block indices (e.g. "
                        f"range({max(num_blocks - 2, 0)}, {num_blocks})), got "
                        f"{type(layers).__name__}")
    out = tuple(layers)
    if not out:
        raise ValueError("layers is empty; give at least one block index in "
                         f"[0, {num_blocks - 1}]")
    for l in out:
        check_layer("layers", l, num_blocks)
    if len(set(out)) != len(out):
        raise ValueError(f"layers has repeated entries {list(out)}; each block counts once")
    return tuple(sorted(out))
