"""Text prompts as the target of a CLIP-style model's image embedding: one helper for
OpenCLIP and Hugging Face dual models (the model side: :mod:`captum_vit.adapters.families.open_clip`
and :mod:`captum_vit.adapters.families.hf_clip`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from captum_vit.adapters import ModelTree
from captum_vit.targets.embedding import EmbeddingTarget

_HF_TEXT_INPUTS = ("input_ids", "attention_mask", "position_ids")


def _texts(texts: str | Sequence[str]) -> list[str]:
    if isinstance(texts, str):
        prompts = [texts]
    elif isinstance(texts, Sequence) and texts and all(isinstance(t, str) for t in texts):
        prompts = list(texts)
    else:
        raise TypeError(f"texts must be a string or a non-empty sequence of strings, got "
                        f"{texts!r}")
    empty = [i for i, t in enumerate(prompts) if not t.strip()]
    if empty:
        raise ValueError(f"texts {empty} {'is' if len(empty) == 1 else 'are'} empty: an "
                         "empty prompt embeds only the tokenizer's start and end tokens, "
                         "the same vector for every such prompt; give each prompt words "
                         "(e.g. 'a photo of a dog')")
    return prompts


def _token_ids(ids: Any, count: int, hint: str) -> Tensor:
    """The tokenizer's ``ids``, checked: an integer tensor ``[count, L]``, ``L ≥ 1``."""
    if not isinstance(ids, Tensor) or torch.is_floating_point(ids) or ids.is_complex() \
            or ids.dtype == torch.bool or ids.dim() != 2:
        got = (f"a {ids.dtype} tensor of shape {tuple(ids.shape)}" if isinstance(ids, Tensor)
               else type(ids).__name__)
        raise TypeError(f"tokenizer returned no token ids: {hint} must be an integer "
                        f"tensor [T, L] (T prompts, L >= 1 tokens), got {got}; pass the "
                        "model's own tokenizer")
    if ids.shape[1] == 0:
        raise ValueError(f"tokenizer returned no token ids: {hint} has shape "
                         f"{tuple(ids.shape)}, no token per prompt; pass the model's own "
                         "tokenizer (it adds the start and end tokens to every prompt)")
    if ids.shape[0] != count:
        raise ValueError(f"tokenizer returned {ids.shape[0]} rows of token ids for "
                         f"{count} texts: it must tokenize each prompt into one row")
    return ids


def _scalar(value: Any) -> float:
    return float(value.detach().reshape(-1)[0]) if isinstance(value, Tensor) else float(value)


def _open_clip_features(model: ModelTree, tokenizer: Callable[..., Any], texts: list[str]
                        ) -> tuple[Tensor, float, float]:
    tokens = tokenizer(texts)
    if not isinstance(tokens, Tensor):
        raise TypeError(f"tokenizer must return a tensor of token ids for an OpenCLIP model "
                        f"(open_clip.get_tokenizer(NAME)), got {type(tokens).__name__}")
    tokens = _token_ids(tokens, len(texts), "tokenizer(texts)")
    device = next(model.parameters()).device
    features = model.encode_text(tokens.to(device), normalize=False)  # CoCa's default: True
    bias = getattr(model, "logit_bias", None)
    return features, _scalar(model.logit_scale.exp()), 0.0 if bias is None else _scalar(bias)


def _hf_features(model: ModelTree, tokenizer: Callable[..., Any], texts: list[str]
                 ) -> tuple[Tensor, float, float]:
    siglip = "Siglip" in type(model).__name__
    # SigLIP was trained on text padded to the full length (its model card's usage)
    try:
        encoded = tokenizer(text=texts, padding="max_length" if siglip else True,
                            return_tensors="pt")
    except TypeError as e:  # another signature: not a Hugging Face tokenizer
        raise TypeError("tokenizer must be the model's Hugging Face tokenizer or processor, "
                        "called as tokenizer(text=texts, padding=..., return_tensors='pt'); "
                        f"calling {getattr(tokenizer, '__name__', type(tokenizer).__name__)} "
                        f"so raised: {e}") from e
    if not isinstance(encoded, Mapping) or "input_ids" not in encoded:
        raise TypeError("tokenizer must be the model's Hugging Face tokenizer or processor "
                        "(a call returning input_ids), got one returning "
                        f"{type(encoded).__name__}")
    _token_ids(encoded["input_ids"], len(texts), "its input_ids")
    device = next(model.parameters()).device
    inputs = {k: encoded[k].to(device) for k in _HF_TEXT_INPUTS if k in encoded}
    out = model.get_text_features(**inputs)
    features = out if isinstance(out, Tensor) else out.pooler_output
    bias = getattr(model, "logit_bias", None)
    return features, _scalar(model.logit_scale.exp()), 0.0 if bias is None else _scalar(bias)


def clip_text_target(model: nn.Module, tokenizer: Callable[..., Any],
                     texts: str | Sequence[str], *,
                     index: int | Sequence[int] | Tensor | str | None = None
                     ) -> EmbeddingTarget:
    r"""Text prompts as an :class:`EmbeddingTarget` of a CLIP-style model's image embedding.

    The prompts are embedded by the model's own text side: OpenCLIP's
    ``model.encode_text(tokenizer(texts), normalize=False)``, Hugging Face ``CLIPModel`` /
    ``SiglipModel``'s ``get_text_features`` on
    ``tokenizer(text=texts, padding=..., return_tensors="pt")`` (``padding="max_length"``
    for SigLIP, as it was trained; ``True`` for CLIP). The
    target scores the cosine similarity times the model's temperature
    ``logit_scale.exp()``, plus ``logit_bias`` where the model has one (SigLIP, OpenCLIP's
    SigLIP models): the image-to-text logits of Radford et al. (ICML 2021) and Zhai et
    al. (ICCV 2023), the similarity itself before any softmax or sigmoid. The text side
    runs without gradients; its embeddings are constants of the explanation.

    Explain the image side of the same model: the dual model itself (its
    ``encode_image`` / ``get_image_features``) or its vision tower
    (``model.visual``; Hugging Face's ``CLIPVisionModelWithProjection``).

    Args:
        model (nn.Module): an OpenCLIP model with a text side (``open_clip.CLIP``,
            ``CustomTextCLIP``, ``CoCa``) or a Hugging Face ``CLIPModel`` /
            ``SiglipModel``.
        tokenizer (callable): the model's tokenizer: ``open_clip.get_tokenizer(NAME)``
            (or ``open_clip.tokenizer.SimpleTokenizer``, whose vocabulary ships with
            ``open_clip``) for OpenCLIP; the Hugging Face tokenizer or processor
            (``CLIPProcessor``, ``AutoTokenizer``) otherwise.
        texts (str or sequence of str): the prompts, ``T`` of them.
        index (int, list, Tensor or str, optional): as
            :class:`EmbeddingTarget`'s: which prompt each image is explained for (one int
            for all, ``[B]``, or ``"predicted"``: each image's best prompt, a zero-shot
            prediction). Default ``None``: one prompt for every image, or one prompt per
            image when ``T`` equals the batch.

    Returns:
        EmbeddingTarget: the text embeddings ``[T, D′]`` (detached, in the model's dtype),
        ``similarity="cosine"``, ``scale = logit_scale.exp()``, ``bias = logit_bias``
        (0 without one).

    Raises:
        TypeError: ``model`` has no text side this helper knows, ``texts`` are not
            strings, or ``tokenizer`` does not return token ids (an integer tensor
            ``[T, L]``, ``L ≥ 1``; for Hugging Face in ``input_ids``).
        ValueError: an empty prompt (``""`` or blank), or token ids without a token or
            with another number of rows than ``texts``.

    Examples::

        >>> import open_clip
        >>> from captum_vit import GAE
        >>> from captum_vit.targets import clip_text_target
        >>> model = open_clip.create_model("ViT-B-32", pretrained=None).eval()
        >>> tokenizer = open_clip.get_tokenizer("ViT-B-32")
        >>> target = clip_text_target(model, tokenizer, ["a dog", "a cat"], index=[0, 1])
        >>> maps = GAE(model).attribute(images, target=target)   # images [2, 3, 224, 224]
    """
    prompts = _texts(texts)
    name = type(model).__name__
    is_open_clip = type(model).__module__.startswith("open_clip.") \
        and hasattr(model, "encode_text")
    is_hf = type(model).__module__.startswith("transformers.") \
        and hasattr(model, "get_text_features")
    if not (is_open_clip or is_hf):
        raise TypeError(f"clip_text_target needs a model with a text side: an OpenCLIP "
                        f"model (open_clip.CLIP, CustomTextCLIP) or a Hugging Face "
                        f"CLIPModel / SiglipModel, got {name} (a vision tower alone has no "
                        "text side: pass the dual model, then explain either)")
    if not callable(tokenizer):
        raise TypeError(f"tokenizer must be callable (the model's tokenizer), got "
                        f"{type(tokenizer).__name__}")
    with torch.no_grad():
        read = _open_clip_features if is_open_clip else _hf_features
        features, scale, bias = read(model, tokenizer, prompts)
    return EmbeddingTarget(features.detach(), index=index, similarity="cosine", scale=scale,
                           bias=bias)


__all__ = ["clip_text_target"]
