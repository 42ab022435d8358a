"""Embedding targets: explain a similarity instead of a class (SPEC_NEXT §7.5).

Models without a classifier (CLIP and SigLIP vision towers) output an image embedding
``e``. Their ``target`` is a vector ``t`` — typically a text embedding the user computed —
and every method explains the score ``s = ⟨e/‖e‖, t/‖t‖⟩`` (``similarity="cosine"``, the
default) or ``s = ⟨e, t⟩`` (``"dot"``), optionally ``scale · s + bias`` (CLIP's
``logit_scale.exp()``, SigLIP's ``logit_scale.exp()`` and ``logit_bias``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from captum_vit.adapters.base import TargetHead

SIMILARITIES = ("cosine", "dot")


@dataclass(frozen=True)
class EmbeddingTarget:
    r"""Target embeddings for a model that outputs an image embedding.

    A plain float tensor passed as ``target=`` is the same as ``EmbeddingTarget(tensor)``:
    ``[D′]`` is one vector for every image, ``[B, D′]`` one per image.

    Args:
        vectors (Tensor): ``[D′]``, ``[B, D′]`` (one per image) or a set ``[T, D′]``
            with ``index``.
        index (int, list or Tensor, optional): with a set, the vector of each image
            (``[B]`` or one int). Default ``None``: one vector, or one per image.
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
    index: int | Sequence[int] | Tensor | None = None
    similarity: str = "cosine"
    scale: float = 1.0
    bias: float = 0.0


def is_embedding_target(target: object) -> bool:
    """Whether ``target`` is a vector target (a float tensor or an EmbeddingTarget)."""
    return isinstance(target, EmbeddingTarget) or (
        isinstance(target, Tensor) and torch.is_floating_point(target))


def embedding_target(target: object, batch: int, dim: int, like: Tensor
                     ) -> tuple[TargetHead, Tensor]:
    """Validate a vector target and turn it into a head and one index per image.

    Args:
        target: a float tensor or :class:`EmbeddingTarget`; ``None`` raises.
        batch (int): images in the batch.
        dim (int): the model's embedding size ``D′``.
        like (Tensor): the images (device and dtype of the vectors).

    Returns:
        (TargetHead with vectors [T, D′], index [B] int64 on the CPU).

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
    if index is None:
        if v.shape[0] == 1:
            index = 0
        elif v.shape[0] == batch:
            index = torch.arange(batch)
        else:
            raise ValueError(f"{v.shape[0]} target vectors for {batch} images: give one "
                             "vector, one per image, or EmbeddingTarget(vectors, index=...)")
    if isinstance(index, int):
        index = torch.full((batch,), index, dtype=torch.long)
    index = torch.as_tensor(index).reshape(-1).long().cpu()
    if index.numel() == 1:
        index = index.expand(batch)
    if index.numel() != batch or ((index < 0) | (index >= v.shape[0])).any():
        raise ValueError(f"EmbeddingTarget.index must give one vector index in [0, "
                         f"{v.shape[0]}) per image ({batch}), got {index.tolist()}")
    head = TargetHead(v.detach().to(device=like.device, dtype=like.dtype),
                      cosine=spec.similarity == "cosine", scale=float(spec.scale),
                      bias=float(spec.bias), probability="softmax" if softmax else "sigmoid")
    return head, index.contiguous()
