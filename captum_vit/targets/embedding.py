"""Embedding targets: explain a similarity instead of a class.

Models without a classifier (CLIP and SigLIP vision towers) output an image embedding
``e``. Their ``target`` is a vector ``t`` — typically a text embedding the user computed —
and every method explains the score ``s = ⟨e/‖e‖, t/‖t‖⟩`` (``similarity="cosine"``, the
default) or ``s = ⟨e, t⟩`` (``"dot"``), optionally ``scale · s + bias`` (CLIP's
``logit_scale.exp()``, SigLIP's ``logit_scale.exp()`` and ``logit_bias``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard

import torch
from torch import Tensor, nn

from captum_vit._text import count_noun
from captum_vit.adapters import TargetHead, adapt

SIMILARITIES = ("cosine", "dot")


@dataclass(frozen=True)
class EmbeddingTarget:
    r"""Target embeddings for a model that outputs an image embedding.

    A plain float tensor passed as ``target=`` is the same as ``EmbeddingTarget(tensor)``:
    ``[D′]`` is one vector for every image, ``[B, D′]`` one per image.

    Args:
        vectors (Tensor): ``[D′]``, ``[B, D′]`` (one per image) or a set ``[T, D′]``
            with ``index``.
        index (int, list, Tensor or str, optional): with a set, the vector of each image
            (``[B]`` or one int), or ``"predicted"``: the vector that scores highest for
            each image (a zero-shot prediction over the set). Default ``None``: one
            vector, or one per image.
        similarity (str, optional): ``"cosine"`` (default) or ``"dot"``.
        scale (float, optional): multiplies the similarity. Default 1.
        bias (float, optional): added after scaling. Default 0.

    ``score="probability"`` is the softmax over a set of ``T > 1`` vectors given with
    ``index`` (CLIP zero-shot), otherwise the sigmoid of ``scale · s + bias`` (SigLIP).

    Examples::

        >>> from captum_vit import GAE, EmbeddingTarget
        >>> text = clip_text_model(**tokens).text_embeds          # [T, D′]
        >>> target = EmbeddingTarget(text, index=[0, 2], scale=100.0)
        >>> maps = GAE(vision_model).attribute(pixel_values, target=target)
    """

    vectors: Tensor
    index: int | Sequence[int] | Tensor | str | None = None
    similarity: str = "cosine"
    scale: float = 1.0
    bias: float = 0.0


def is_embedding_target(target: object) -> TypeGuard[EmbeddingTarget | Tensor]:
    """Whether ``target`` is a vector target (a float tensor or an EmbeddingTarget)."""
    return isinstance(target, EmbeddingTarget) or (
        isinstance(target, Tensor) and torch.is_floating_point(target))


def embedding_target(target: object, batch: int, dim: int, like: Tensor
                     ) -> tuple[TargetHead, Tensor | None]:
    """Validate a vector target and turn it into a head and one index per image.

    Args:
        target: a float tensor or :class:`EmbeddingTarget`; ``None`` raises.
        batch (int): images in the batch.
        dim (int): the model's embedding size ``D′``.
        like (Tensor): the images (device and dtype of the vectors).

    Returns:
        (TargetHead with vectors [T, D′], index [B] int64 on the CPU, or ``None`` for
        ``index="predicted"``: the caller resolves it to the best-scoring vector).

    Raises:
        ValueError / TypeError: naming the argument and the fix.
    """
    if target is None:
        raise ValueError("this model outputs an image embedding, so there is no predicted "
                         "class: pass target= a vector [D′] (e.g. a text embedding), one "
                         "vector per image [B, D′] or an EmbeddingTarget")
    if not is_embedding_target(target):
        raise TypeError(f"this model outputs an image embedding: target must be a float "
                        f"tensor [D′] or [B, D′] or an EmbeddingTarget, got "
                        f"{type(target).__name__} (class indices need a classifier)")
    spec = target if isinstance(target, EmbeddingTarget) else EmbeddingTarget(target)
    if spec.similarity not in SIMILARITIES:
        raise ValueError(f"similarity must be 'cosine' or 'dot', got {spec.similarity!r}")
    for name in ("scale", "bias"):
        value = getattr(spec, name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    v = spec.vectors
    if not isinstance(v, Tensor) or not torch.is_floating_point(v):
        raise TypeError("EmbeddingTarget.vectors must be a float tensor")
    if v.dim() == 1:
        v = v[None]
    if v.dim() != 2 or v.shape[-1] != dim:
        raise ValueError(f"target vectors must be [{dim}] or [T, {dim}] (the model's "
                         f"embedding size is {dim}), got {tuple(spec.vectors.shape)}")
    if not torch.isfinite(v).all() or (spec.similarity == "cosine"
                                       and (v.norm(dim=-1) == 0).any()):
        raise ValueError("target vectors must be finite (and non-zero for cosine similarity)")
    index = spec.index
    softmax = index is not None and v.shape[0] > 1
    if isinstance(index, str):
        if index != "predicted":
            raise ValueError(f"EmbeddingTarget.index must be indices or 'predicted', got "
                             f"{index!r}")
        index = None
    elif index is None:
        if v.shape[0] == 1:
            index = 0
        elif v.shape[0] == batch:
            index = torch.arange(batch)
        else:
            raise ValueError(f"{count_noun(v.shape[0], 'target vector')} for "
                             f"{count_noun(batch, 'image')}: give one "
                             "vector, one per image, or EmbeddingTarget(vectors, index=...)")
    if index is not None:
        index = torch.as_tensor(index).reshape(-1).long().cpu()
        if index.numel() == 1:
            index = index.expand(batch)
        if index.numel() != batch or ((index < 0) | (index >= v.shape[0])).any():
            raise ValueError(f"EmbeddingTarget.index must give one vector index in [0, "
                             f"{v.shape[0]}) per image ({batch}), got {index.tolist()}")
        index = index.contiguous()
    head = TargetHead(v.detach().to(device=like.device, dtype=like.dtype),
                      cosine=spec.similarity == "cosine", scale=float(spec.scale),
                      bias=float(spec.bias), probability="softmax" if softmax else "sigmoid")
    return head, index


@contextlib.contextmanager
def scoring(model: nn.Module, targets: EmbeddingTarget | Tensor) -> Iterator[TargetHead]:
    r"""Within the block, an embedding model scores against a set of target vectors, as a
    classifier over them: ``target=`` of every method and metric is then an index into
    the set (``None``: the best-scoring vector, a zero-shot prediction), probabilities
    are the softmax over the set (the sigmoid for a single vector), and
    :func:`captum_vit.metrics.suite.evaluate` runs as on a classifier with ``T`` classes.

    The setting holds for every adapter of this model object (methods built before or
    inside the block alike) and lives in a context variable: other threads and models are
    not affected, and nothing in the model changes.

    Args:
        model (nn.Module): a model that outputs an image embedding (CLIP, SigLIP, a timm
            model with ``num_classes=0``).
        targets (Tensor or EmbeddingTarget): the vectors ``[T, D′]`` (or ``[D′]``), e.g.
            text embeddings of class prompts; an ``EmbeddingTarget`` sets ``similarity``,
            ``scale`` and ``bias`` (its ``index`` must be ``None``).

    Yields:
        TargetHead: the scoring head in force.

    Raises:
        TypeError: ``model`` is a classifier, or ``targets`` is not a float tensor.
        ValueError: vectors of the wrong size, or an ``index``.

    Examples::

        >>> from captum_vit import GAE
        >>> from captum_vit.metrics import deletion
        >>> with scoring(clip_vision, class_text_embeds):       # [T, D′]
        ...     maps = GAE(clip_vision).attribute(pixel_values)   # zero-shot prediction
        ...     res = deletion(clip_vision, pixel_values, maps)
    """
    adapter = adapt(model)
    if not adapter.embedding:
        raise TypeError(f"scoring() is for models that output an image embedding; this "
                        f"{type(model).__name__} is a classifier (explain its classes)")
    spec = targets if isinstance(targets, EmbeddingTarget) else EmbeddingTarget(targets)
    if spec.index is not None:
        raise ValueError("scoring() takes the target vectors only; choose the vector of each "
                         "image with target= (an index into the set) in each call")
    like = next(iter(model.parameters()))
    head, _ = embedding_target(dataclasses.replace(spec, index="predicted"), 1,
                               adapter.num_classes, like)
    with adapter.targeting(head):
        yield head


def read_target_embeddings(path: str | os.PathLike) -> Tensor:
    """Target vectors from a file: ``.npy`` (numpy), ``.pt``/``.pth`` (a tensor saved with
    ``torch.save``) or ``.safetensors`` (its only tensor), shaped ``[T, D′]`` or ``[D′]``.

    Args:
        path (str or os.PathLike): the file.

    Returns:
        Tensor: ``[T, D′]`` in the file's float dtype (a single vector becomes
        ``[1, D′]``; the methods cast it to the model's dtype).

    Raises:
        FileNotFoundError: the file is missing.
        ValueError: an unknown suffix, or not a 1-D/2-D float array.

    Examples::

        >>> import numpy as np
        >>> np.save("classes.npy", text_embeds.numpy())   # [T, D′], from the text tower
        >>> read_target_embeddings("classes.npy").shape
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--target-embeddings: no file {str(p)!r}")
    suffix = p.suffix.lower()
    if suffix == ".npy":
        import numpy as np

        t = torch.from_numpy(np.load(p, allow_pickle=False))
    elif suffix in (".pt", ".pth"):
        t = torch.load(p, map_location="cpu", weights_only=True)
    elif suffix == ".safetensors":
        from safetensors.torch import load_file

        tensors = load_file(str(p))
        if len(tensors) != 1:
            raise ValueError(f"{p} holds {len(tensors)} tensors; save only the target vectors")
        t = next(iter(tensors.values()))
    else:
        raise ValueError(f"{p}: target embeddings must be .npy, .pt/.pth or .safetensors")
    if not isinstance(t, Tensor) or not torch.is_floating_point(t) or t.dim() not in (1, 2):
        raise ValueError(f"{p} must hold a float array [T, D′] or [D′]")
    return t.reshape(-1, t.shape[-1])
