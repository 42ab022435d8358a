"""A vision-language model's answer as the target of a map of its vision tower (the
model side: :mod:`captum_vit.adapters.hf_vlm`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from captum_vit.adapters.hf_vlm import VLMParts, vlm_parts
from captum_vit.adapters.scoring import Outputs, Target, per_image


def _ids(value: Any, name: str) -> Tensor:
    """``value`` as a ``[B, T]`` int64 tensor (a 1-D sequence is one row)."""
    if isinstance(value, bool) or value is None:
        raise TypeError(f"{name} must be token ids (a list or an integer tensor [T] or "
                        f"[B, T]), got {value!r}")
    t = torch.as_tensor(value)
    if torch.is_floating_point(t) or t.dtype == torch.bool or t.dim() not in (1, 2):
        raise TypeError(f"{name} must be token ids (a list or an integer tensor [T] or "
                        f"[B, T]), got {t.dtype} of shape {tuple(t.shape)}")
    t = t.long()
    return t[None] if t.dim() == 1 else t


def _vocabulary(model: Any) -> int:
    """The language model's vocabulary size (its token embedding's rows)."""
    text = getattr(getattr(model, "config", None), "text_config", None)
    size = getattr(text, "vocab_size", None)
    if size is None:
        size = model.get_input_embeddings().num_embeddings
    return int(size)


class VLMAnswer(Target):
    r"""``Σ_t log p(answer_t | prompt, image, answer_<t)``: the log-probability a
    vision-language model gives an answer, explained on its vision tower.

    Any method explains the **vision tower** (``VLMAnswer.tower(model)``; a Hugging Face
    CLIP or SigLIP vision model); this target continues from the tower's token states as
    the VLM does and runs the rest of the model as it is, with teacher forcing on the
    answer:

    - ``LlavaForConditionalGeneration``: the tower's ``hidden_states`` at
      ``config.vision_feature_layer`` (default ``-2``: the output of the last block but
      one; a list of layers is concatenated along the features, as the model does), the
      class token dropped under ``vision_feature_select_strategy="default"`` (kept under
      ``"full"``), ``multi_modal_projector``;
    - ``PaliGemmaForConditionalGeneration``: the tower's ``last_hidden_state`` (all rows,
      after ``post_layernorm``), ``multi_modal_projector``;

    then the VLM's own forward on ``prompt ; answer`` with the projected features at the
    image-token positions (the model's own merge; PaliGemma: the prompt is the prefix,
    ``token_type_ids`` 0, the answer the suffix, 1), and the answer tokens' log-softmax
    summed. The score reads token rows through the model's code, so the matrix methods
    weigh the rows by their input×gradient relevance (gradient-weighted methods) or
    uniformly over the rows the VLM reads (gradient-free methods: the patch rows, the
    class token too under ``"full"``), as for :class:`TokenTarget`; true token removal is
    refused (remove pixels instead). A method's ``score="probability"`` (RISE's, ViT-CX's,
    ScoreCAM's default) is the sigmoid of the score, ``p / (1 + p)`` for the answer's
    probability ``p``: close to ``p`` and tiny for long answers; pass ``score="logit"``
    to explain the log-probability itself.

    Per-image prompts: with one prompt (``[T]`` or ``[1, T]``) and one answer, every
    forward row is scored against it (one column). With ``B`` prompts or answers (one per
    image) every forward row is scored against every distinct prompt (``K ≤ B`` columns, so
    ``n·K`` language-model sequences for ``n`` forward rows, in one batch; a processor's
    batch that repeats one question is one column) and each image reads its own column:
    the perturbation methods score many perturbed copies of the images in one forward, and
    a row's prompt must come from its column, not from its position. Explain distinct
    per-image prompts one image at a time where ``B²`` sequences are too many.

    **Qwen2-VL and Qwen3-VL** (``Qwen2VLForConditionalGeneration``,
    ``Qwen3VLForConditionalGeneration``; :mod:`captum_vit.adapters.vlm_qwen`): the tower
    (``model.model.visual``) takes images ``[B, C, H, W]`` (multiples of
    ``patch_size · spatial_merge_size``) or the processor's output itself (its packed
    ``pixel_values`` and ``image_grid_thw``); the score runs the model's ``merger`` on the
    last block's tokens (Qwen3-VL: also its deepstack mergers on the
    ``deepstack_visual_indexes`` blocks, so the target reads several blocks), then the
    VLM's forward with the mRoPE positions of its own ``get_rope_index``. The chat template
    writes each image as ``<|vision_start|>``, ``<|image_pad|>`` once per merged token
    (``h·w / m²`` for ``h × w`` patches), ``<|vision_end|>``; ``config.image_token_id`` is
    ``<|image_pad|>``. Pass the processor's output as ``input_ids`` when a prompt holds
    several images: each image is then explained in its own slot (one column per image),
    the other images of its prompt held at the model's own features.

    Put the model in ``eval()`` mode (dropout makes the score random); the model is
    never modified.

    Args:
        model (nn.Module): a Hugging Face ``LlavaForConditionalGeneration`` or
            ``PaliGemmaForConditionalGeneration``.
        input_ids (Tensor or sequence of int): the prompt ids ``[T]``, ``[1, T]`` (for every
            image) or ``[B, T]`` (one per image), holding the model's image placeholder
            (``config.image_token_id``) once per image feature, as its processor writes
            them (pad batches on the left, as for generation).
        answer_ids (Tensor or sequence of int): the answer ids ``[A]``, ``[1, A]`` or
            ``[B, A]``; shorter answers of a batch end in ``-100`` (not scored, as in
            ``labels``).
        pixel_key (str, optional): the key of the images in a processor's output; when
            ``input_ids`` is that output (a mapping), its ``input_ids`` and
            ``attention_mask`` are read, and the images under ``pixel_key`` (what the
            method explains: pass them as its inputs) must be ``[B, C, H, W]``, not
            tiled. Default ``"pixel_values"``.
        attention_mask (Tensor, optional): ``[B, T]`` (1 = token, 0 = padding) of the
            prompts; default all ones.

    Raises:
        TypeError: ``model`` is not a supported VLM (LLaVA-NeXT and other VLMs that tile
            an image into crops are refused by name), or ids are not integer tensors.
        ValueError: an empty answer, ``-100`` before an answer's last scored token, ids
            outside the model's vocabulary (the image token excepted), tiled
            images in a processor's output,
            prompts and answers of different batch sizes, a prompt whose image tokens do
            not match the tower's features, or tower states of another model.

    Examples::

        >>> from captum_vit import GAE
        >>> from captum_vit.targets import VLMAnswer
        >>> vlm = LlavaForConditionalGeneration.from_pretrained(path).eval()
        >>> batch = processor(images=image, text="USER: <image>\nColour? ASSISTANT:",
        ...                   return_tensors="pt")
        >>> answer = processor.tokenizer(" red", add_special_tokens=False).input_ids
        >>> target = VLMAnswer(vlm, batch["input_ids"], answer)
        >>> maps = GAE(VLMAnswer.tower(vlm)).attribute(batch["pixel_values"], target=target)

        Qwen2-VL / Qwen3-VL (the processor's output is what the tower takes)::

        >>> qwen = Qwen2VLForConditionalGeneration.from_pretrained(path).eval()
        >>> messages = [{"role": "user", "content": [
        ...     {"type": "image", "image": image}, {"type": "text", "text": "Colour?"}]}]
        >>> batch = processor.apply_chat_template(messages, add_generation_prompt=True,
        ...                                       tokenize=True, return_dict=True,
        ...                                       return_tensors="pt")
        >>> # input_ids: ... <|vision_start|> <|image_pad|> × (h·w/4) <|vision_end|> Colour? ...
        >>> answer = processor.tokenizer("Red", add_special_tokens=False).input_ids
        >>> target = VLMAnswer(qwen, batch, answer)
        >>> maps = GAE(VLMAnswer.tower(qwen)).attribute(batch, target=target)  # [1, 3, H, W]
    """

    reads_tokens = True
    probability = "sigmoid"

    def __init__(self, model: nn.Module, input_ids: Any, answer_ids: Any,
                 pixel_key: str = "pixel_values", attention_mask: Any = None) -> None:
        self.parts: VLMParts = vlm_parts(model)
        if not isinstance(pixel_key, str):
            raise TypeError(f"pixel_key must be a str, got {type(pixel_key).__name__}")
        self.pixel_key = pixel_key
        batch = None
        if not isinstance(input_ids, Tensor | Sequence) and hasattr(input_ids, "keys"):
            batch = input_ids
            if "input_ids" not in batch:
                raise ValueError("input_ids is a mapping without 'input_ids'; pass the "
                                 "processor's output or the ids themselves")
            pixels = batch.get(pixel_key)
            if isinstance(pixels, Tensor) and pixels.dim() != 4 \
                    and not self.parts.packed_pixels:
                raise ValueError(f"{pixel_key} has shape {tuple(pixels.shape)}: tiled images "
                                 "(one image as several crops) are not supported; give "
                                 "[B, C, H, W] images")
            if attention_mask is None:
                attention_mask = batch.get("attention_mask")
            input_ids = batch["input_ids"]
        self.input_ids = _ids(input_ids, "input_ids")
        self.answer_ids = _ids(answer_ids, "answer_ids")
        if self.answer_ids.shape[1] == 0 or (self.answer_ids == -100).all(1).any():
            raise ValueError("answer_ids is empty: give at least one answer token per "
                             "answer (the ids the answer's text tokenizes to)")
        scored = self.answer_ids != -100
        if (scored[:, 1:] & ~scored[:, :-1]).any():
            raise ValueError("answer_ids: -100 may only pad the end of a shorter answer")
        vocab = _vocabulary(self.parts.model)
        bad = self.answer_ids[scored & ((self.answer_ids < 0) | (self.answer_ids >= vocab))]
        if bad.numel():
            raise ValueError(f"answer_ids {sorted(set(bad.tolist()))} are not token ids of "
                             f"this model's vocabulary ([0, {vocab})): give the ids the "
                             "model's own tokenizer makes of the answer (-100 pads a shorter "
                             "answer)")
        text = self.input_ids != self.parts.image_token_id  # the image id may lie outside
        bad = self.input_ids[text & ((self.input_ids < 0) | (self.input_ids >= vocab))]
        if bad.numel():
            raise ValueError(f"input_ids {sorted(set(bad.tolist()))} are not token ids of "
                             f"this model's vocabulary ([0, {vocab})) nor its image token "
                             f"({self.parts.image_token_id}): give the ids the model's own "
                             "processor makes of the prompt")
        if attention_mask is None:
            self.attention_mask = torch.ones_like(self.input_ids)
        else:
            self.attention_mask = _ids(attention_mask, "attention_mask")
            if self.attention_mask.shape != self.input_ids.shape:
                raise ValueError(f"attention_mask has shape {tuple(self.attention_mask.shape)}"
                                 f" but input_ids {tuple(self.input_ids.shape)}")
        b = max(self.input_ids.shape[0], self.answer_ids.shape[0])
        if self.input_ids.shape[0] not in (1, b) or self.answer_ids.shape[0] not in (1, b):
            raise ValueError(f"input_ids has {self.input_ids.shape[0]} prompts and answer_ids "
                             f"{self.answer_ids.shape[0]} answers: give one per image or one "
                             "for all")
        counts = (self.input_ids == self.parts.image_token_id).sum(1)
        if (counts == 0).any() or (counts != counts[0]).any():
            raise ValueError(f"every prompt must hold the image token "
                             f"(id {self.parts.image_token_id}) once per image feature; "
                             f"got {counts.tolist()} per prompt")
        self.image_tokens = int(counts[0])
        # one column per DISTINCT (prompt, mask, answer): a processor's batch repeats the same
        # question for every image, and each column costs one language-model run per row
        t, a = self.input_ids.shape[1], self.answer_ids.shape[1]
        rows = torch.cat([per_image(self.input_ids, b, "input_ids"),
                          per_image(self.attention_mask, b, "attention_mask"),
                          per_image(self.answer_ids, b, "answer_ids")], 1)
        distinct, self._column_of = torch.unique(rows, dim=0, return_inverse=True)
        self.input_ids, self.attention_mask = distinct[:, :t], distinct[:, t:2 * t]
        self.answer_ids = distinct[:, 2 * t:2 * t + a]
        self.prompts = int(distinct.shape[0])
        self.blocks = self.parts.layers
        if self.parts.keep_cls:
            self.rows = tuple(range(self.image_tokens))
        self.parts.bind(self, batch)

    def __repr__(self) -> str:
        return (f"VLMAnswer({type(self.parts.model).__name__}, prompts={self.prompts}, "
                f"answer_tokens={self.answer_ids.shape[1]})")

    @staticmethod
    def tower(model: nn.Module) -> nn.Module:
        """The vision tower of ``model`` the methods explain (``model.model.vision_tower``
        in transformers 5)."""
        return vlm_parts(model).tower

    def num_columns(self, num_classes: int) -> int:
        return self.prompts

    def index(self, batch: int) -> Tensor:
        return per_image(self._column_of, batch, "VLMAnswer's prompts")

    def _states(self, out: Outputs) -> list[Tensor]:
        if self.parts.layers is None:
            if out.tokens is None:
                raise ValueError("VLMAnswer reads the tower's final-normed tokens")
            return [out.tokens]
        keys = [l if l > 0 else l + out.num_blocks + 1 for l in self.parts.layers]
        return [out.hidden[k] for k in keys]

    def columns(self, out: Outputs) -> Tensor:
        own = self.parts.columns(self, out)
        if own is not None:
            return own
        states = self._states(out)
        x = states[0]
        n, rows, width = x.shape
        tower_width = int(self.parts.tower.config.hidden_size)
        if width != tower_width or self.parts.num_features(rows) != self.image_tokens:
            raise ValueError(
                f"VLMAnswer read tower states of {rows} rows × {width} features, but the "
                f"prompts hold {self.image_tokens} image tokens and the VLM's tower has "
                f"{tower_width} features: explain VLMAnswer.tower(model) on images of the "
                "size the prompts were made for")
        feats = self.parts.features(states)  # [n, P', D]
        k = self.prompts
        dev = feats.device
        ids = per_image(self.input_ids, k, "input_ids").to(dev)
        mask = per_image(self.attention_mask, k, "attention_mask").to(dev)
        answer = per_image(self.answer_ids, k, "answer_ids").to(dev)
        seq = torch.cat([ids, answer.clamp_min(0)], 1).repeat(n, 1)  # row i·k + j
        am = torch.cat([mask, torch.ones_like(answer)], 1).repeat(n, 1)
        logp = self.parts.answer_log_probs(feats.repeat_interleave(k, 0), seq, am,
                                           answer.repeat(n, 1))
        return logp.reshape(n, k).to(x.dtype)
