"""Text prompts as the target of a CLIP-style model's image embedding: one helper for
OpenCLIP and Hugging Face dual models (the model side: :mod:`captum_vit.adapters.families.open_clip`
and :mod:`captum_vit.adapters.families.hf_clip`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from captum_vit.adapters import ModelTree
from captum_vit.adapters.families.hf_clip import text_tower as hf_text_tower
from captum_vit.adapters.families.open_clip import text_tower as open_clip_text_tower
from captum_vit.adapters.rules import LRPOps
from captum_vit.adapters.text import TextTower, explained_text
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


def _open_clip_inputs(model: ModelTree, tokenizer: Callable[..., Any], texts: list[str]
                      ) -> dict[str, Tensor]:
    tokens = tokenizer(texts)
    if not isinstance(tokens, Tensor):
        raise TypeError(f"tokenizer must return a tensor of token ids for an OpenCLIP model "
                        f"(open_clip.get_tokenizer(NAME)), got {type(tokens).__name__}")
    tokens = _token_ids(tokens, len(texts), "tokenizer(texts)")
    return {"input_ids": tokens.to(next(model.parameters()).device)}


def _open_clip_features(model: ModelTree, inputs: Mapping[str, Tensor]
                        ) -> tuple[Tensor, float, float]:
    features = model.encode_text(inputs["input_ids"], normalize=False)  # CoCa's default: True
    bias = getattr(model, "logit_bias", None)
    return features, _scalar(model.logit_scale.exp()), 0.0 if bias is None else _scalar(bias)


def _hf_inputs(model: ModelTree, tokenizer: Callable[..., Any], texts: list[str]
               ) -> dict[str, Tensor]:
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
    return {k: encoded[k].to(device) for k in _HF_TEXT_INPUTS if k in encoded}


def _hf_features(model: ModelTree, inputs: Mapping[str, Tensor]
                 ) -> tuple[Tensor, float, float]:
    out = model.get_text_features(**inputs)
    features = out if isinstance(out, Tensor) else out.pooler_output
    bias = getattr(model, "logit_bias", None)
    return features, _scalar(model.logit_scale.exp()), 0.0 if bias is None else _scalar(bias)


def _decoded(tokenizer: Callable[..., Any], ids: Tensor) -> list[list[str]] | None:
    """The token strings of ``ids`` [K, L] (one per id, padding included), or ``None``
    when ``tokenizer`` cannot decode single ids: a Hugging Face tokenizer's (or a
    processor's ``tokenizer``'s) ``convert_ids_to_tokens``, or OpenCLIP's
    ``SimpleTokenizer.decoder`` (its padding after the end token as ``""``)."""
    tok = getattr(tokenizer, "tokenizer", tokenizer)
    rows = ids.tolist()
    convert = getattr(tok, "convert_ids_to_tokens", None)
    if callable(convert):
        return [[str(t) for t in convert(row)] for row in rows]
    decoder = getattr(tok, "decoder", None)
    if not isinstance(decoder, Mapping):
        return None
    end = getattr(tok, "eot_token_id", None)
    out = []
    for row in rows:
        words = [str(decoder.get(i, i)) for i in row]
        if end in row:  # OpenCLIP pads with 0 after the end token
            cut = row.index(end) + 1
            words = words[:cut] + [""] * (len(row) - cut)
        out.append(words)
    return out


class _TextSide:
    """The text side of a :class:`TextEmbeddingTarget`: the tower, the tokenizer's inputs
    ``[K, L]`` and what the last ``attribute`` call found."""

    def __init__(self, tower: TextTower, inputs: dict[str, Tensor],
                 tokens: list[list[str]] | None) -> None:
        self.tower, self.inputs, self.tokens = tower, inputs, tokens
        self.relevance: Tensor | None = None
        self.index: Tensor | None = None
        self.rules: str | None = None


@dataclass(frozen=True)
class TextEmbeddingTarget(EmbeddingTarget):
    r"""An :class:`EmbeddingTarget` made of text prompts that also explains its text side:
    built by :func:`clip_text_target` with ``text_relevance=True``.

    The image side is the :class:`EmbeddingTarget`'s (the text vectors are constants of
    the image map, which is the same as without ``text_relevance``). After each
    ``attribute`` call of a method of the package with this target, the target holds
    each prompt token's relevance for each image's score, computed by a second pass
    through the text tower with the image embedding a constant (each side explained with
    the other fixed):

    - :attr:`text_relevance` ``[B, L]``: for image ``b`` and its prompt ``k_b``,
      :math:`R_{b,j} = \sum_f X_{k_b,j,f}\,\tilde g_{b,j,f}` with :math:`X` the token
      embeddings (the token embedding's output, before position embeddings are added)
      and :math:`\tilde g` the gradient of the image–text logit
      :math:`s_b = \mathrm{scale}\cdot\cos(e_b, t_{k_b}) + \mathrm{bias}` — the true
      gradient (input×gradient) for every method but CP-LRP and AttnLRP, whose text pass
      runs their own rule set through the text tower's modules
      (:mod:`captum_vit.adapters.text`: LN rule, identity rule on the activations, the
      attention rule of the method, its ε/γ on the linear maps called as modules) and
      freezes ``‖t‖`` as the image side freezes ``‖e‖``. ``L`` is the tokenizer's padded
      length (start, end and padding tokens included).
    - :attr:`text_index` ``[B]``: the prompt of each image (``index="predicted"``
      resolved to each image's best prompt).
    - :attr:`text_tokens`: the token strings of each image's prompt (``B`` lists of
      ``L``), ``None`` when the tokenizer cannot decode single ids.
    - :attr:`text_rules`: ``"input×gradient"`` or the LRP method whose rules ran.

    The text side explains the logit ``s_b`` whatever the method's ``score``; it is
    overwritten by every call (NoiseTunnel's last noisy batch), so read it after the
    call you mean. What the sums mean: input×gradient is a first-order statement,
    :math:`\sum_j R_{b,j} = \frac{d}{d\lambda} s_b(\lambda X)|_{\lambda=1}`; the cosine
    is invariant to the scale of ``t``, so a text tower homogeneous in ``X`` (no biases,
    no position embedding) gives relevances summing to 0, and they are *not* a share of
    the logit. CP-LRP's do sum to it: without biases and position embeddings,
    :math:`\sum_j R_{b,j} = s_b - \mathrm{bias}` exactly (the rules are linear maps of
    ``X`` there); AttnLRP's softmax rule and any bias absorb a part (tested).

    Examples: see :func:`clip_text_target` (the last lines of its example).
    """

    text: _TextSide | None = field(default=None, repr=False, compare=False)

    @property
    def text_relevance(self) -> Tensor | None:
        """``[B, L]`` relevance of each image's prompt tokens (``None`` before a call)."""
        return None if self.text is None else self.text.relevance

    @property
    def text_index(self) -> Tensor | None:
        """``[B]`` the prompt of each image in the last call (``None`` before a call)."""
        return None if self.text is None else self.text.index

    @property
    def text_tokens(self) -> list[list[str]] | None:
        """The token strings of each image's prompt in the last call (``B`` lists of
        ``L``); ``None`` before a call or when the tokenizer cannot decode ids."""
        side = self.text
        if side is None or side.tokens is None or side.index is None:
            return None
        return [side.tokens[i] for i in side.index.tolist()]

    @property
    def text_rules(self) -> str | None:
        """How the last call explained the text: ``"input×gradient"``, or the LRP method
        whose rule set ran through the text tower (``"AttnLRP"``, ``"CPLRP"``)."""
        return None if self.text is None else self.text.rules

    @property
    def text_ids(self) -> Tensor | None:
        """``[T, L]`` the token ids of every prompt (the tokenizer's, padded)."""
        return None if self.text is None else self.text.inputs["input_ids"]

    def explain_text(self, method: Any, images: Tensor, index: Tensor | None) -> None:
        """The text side of one ``attribute`` call (run by the method's front after the
        image map): sets :attr:`text_relevance` and :attr:`text_index`.

        Args:
            method: the method (its ``adapter``; ``ops`` when it is an LRP method).
            images (Tensor): the validated images ``[B, C, H, W]``.
            index (Tensor or None): the prompt of each image ``[B]``; ``None``: each
                image's best prompt.

        Raises:
            TypeError: an LRP method whose rules do not reach the text tower.
        """
        side = self.text
        if side is None:
            return
        with torch.no_grad():
            e = method.adapter.model_outputs(images).detach()
        e = F.normalize(e, dim=-1)
        if index is None:
            v = F.normalize(self.vectors.to(e), dim=-1)
            index = (self.scale * e @ v.T + self.bias).argmax(-1)
        index = index.to(e.device)
        inputs = {k: t[index] for k, t in side.inputs.items()}
        ops = getattr(method, "ops", None)
        ops = ops if isinstance(ops, LRPOps) else None
        with torch.enable_grad(), explained_text(side.tower, ops) as leaf:
            t = side.tower.features(inputs)
            x = leaf.value
            if x is None:
                raise RuntimeError("the text tower's forward did not call its token "
                                   "embedding")
            norm = t.norm(dim=-1, keepdim=True)
            cos = (e.to(t.dtype) * t / (norm.detach() if ops is not None else norm)).sum(-1)
            (g,) = torch.autograd.grad((self.scale * cos + self.bias).sum(), [x])
        dt = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        side.relevance = (x.detach().to(dt) * g.to(dt)).sum(-1)
        side.index = index.cpu()
        side.rules = "input×gradient" if ops is None else type(method).__name__


def clip_text_target(model: nn.Module, tokenizer: Callable[..., Any],
                     texts: str | Sequence[str], *,
                     index: int | Sequence[int] | Tensor | str | None = None,
                     text_relevance: bool = False) -> EmbeddingTarget:
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

    With ``text_relevance=True`` the target (a :class:`TextEmbeddingTarget`) also explains
    the text side: after each ``attribute`` call it holds ``target.text_relevance``
    ``[B, L]``, each prompt token's relevance for each image's logit (input×gradient on
    the token embeddings; the rule set of CP-LRP and AttnLRP through the text tower when
    the method is one of them), ``target.text_tokens`` (the token strings) and
    ``target.text_index`` (the prompt of each image): which words and which regions
    agree. The image map is the same as without it. Text towers read: Hugging Face
    ``CLIPModel`` / ``SiglipModel``'s ``text_model``; OpenCLIP's own text transformer
    (``open_clip.CLIP``, ``CustomTextCLIP``, ``CoCa``), the LRP rules on its plain
    ``ResidualAttentionBlock`` blocks.

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
        text_relevance (bool, optional): also explain the prompt tokens
            (:class:`TextEmbeddingTarget`). Default ``False``.

    Returns:
        EmbeddingTarget: the text embeddings ``[T, D′]`` (detached, in the model's dtype),
        ``similarity="cosine"``, ``scale = logit_scale.exp()``, ``bias = logit_bias``
        (0 without one); a :class:`TextEmbeddingTarget` with ``text_relevance=True``.

    Raises:
        TypeError: ``model`` has no text side this helper knows, ``texts`` are not
            strings, or ``tokenizer`` does not return token ids (an integer tensor
            ``[T, L]``, ``L ≥ 1``; for Hugging Face in ``input_ids``);
            ``text_relevance`` not a bool, or on a text tower this helper cannot read (a
            Hugging Face text encoder inside OpenCLIP).
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
        >>> both = clip_text_target(model, tokenizer, ["a dog", "a cat"], index=[0, 1],
        ...                         text_relevance=True)     # a TextEmbeddingTarget
        >>> maps = GAE(model).attribute(images, target=both)   # the same maps, and:
        >>> both.text_relevance.shape     # image x prompt token (77: OpenCLIP's context)
        torch.Size([2, 77])
        >>> both.text_tokens[1][:4]       # image 1's prompt, "a cat"
        ['<start_of_text>', 'a</w>', 'cat</w>', '<end_of_text>']
        >>> from captum_vit.viz import plot_text_relevance
        >>> ax = plot_text_relevance(both.text_tokens[1], both.text_relevance[1])
    """
    if not isinstance(text_relevance, bool):
        raise TypeError(f"text_relevance must be True or False, got "
                        f"{type(text_relevance).__name__} ({text_relevance!r})")
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
                        "text side: pass the dual model, then explain either"
                        f"{'; text_relevance explains that text side' if text_relevance else ''})")
    if not callable(tokenizer):
        raise TypeError(f"tokenizer must be callable (the model's tokenizer), got "
                        f"{type(tokenizer).__name__}")
    tower = None
    if text_relevance:  # read the text tower first: a clear refusal before any forward
        tower = open_clip_text_tower(model) if is_open_clip else hf_text_tower(model)
    with torch.no_grad():
        inputs = (_open_clip_inputs if is_open_clip else _hf_inputs)(model, tokenizer, prompts)
        read = _open_clip_features if is_open_clip else _hf_features
        features, scale, bias = read(model, inputs)
    if tower is None:
        return EmbeddingTarget(features.detach(), index=index, similarity="cosine",
                               scale=scale, bias=bias)
    side = _TextSide(tower, inputs, _decoded(tokenizer, inputs["input_ids"]))
    return TextEmbeddingTarget(features.detach(), index=index, similarity="cosine",
                               scale=scale, bias=bias, text=side)


__all__ = ["TextEmbeddingTarget", "clip_text_target"]
