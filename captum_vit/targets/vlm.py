"""A vision-language model's answer as the target of a map of its vision tower (the
model side: :mod:`captum_vit.adapters.hf_vlm`)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

from captum_vit.adapters.hf_vlm import VLMParts, tower_states
from captum_vit.adapters.scoring import Outputs, Target, per_image
from captum_vit.adapters.vlm_qwen import QwenVLParts
from captum_vit.adapters.vlm_tiles import TiledParts, TileLayout, Tiles, stitch
from captum_vit.adapters.vlms import vlm_parts


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
    CLIP, SigLIP or InternViT vision model); this target continues from the tower's token
    states as the VLM does and runs the rest of the model as it is, with teacher forcing on
    the answer:

    - ``LlavaForConditionalGeneration``: the tower's ``hidden_states`` at
      ``config.vision_feature_layer`` (default ``-2``: the output of the last block but
      one; a list of layers is concatenated along the features, as the model does), the
      class token dropped under ``vision_feature_select_strategy="default"`` (kept under
      ``"full"``), ``multi_modal_projector``;
    - ``PaliGemmaForConditionalGeneration``: the tower's ``last_hidden_state`` (all rows,
      after ``post_layernorm``), ``multi_modal_projector``;
    - ``InternVLForConditionalGeneration`` (InternViT tower,
      :mod:`~captum_vit.adapters.families.hf_internvl`): the tower's state at
      ``config.vision_feature_layer`` (``-1``, the default: ``last_hidden_state``; another
      index: that block's output, which the target reads), the class token dropped, the
      model's ``pixel_shuffle`` (``downsample_ratio`` 0.5: 2×2 tokens into one),
      ``multi_modal_projector``; an image is **several tiles** (below);
    - ``Gemma3ForConditionalGeneration`` (SigLIP tower): the tower's ``last_hidden_state``,
      ``multi_modal_projector`` (average pool to ``mm_tokens_per_image``, RMSNorm,
      projection), ``token_type_ids`` 1 at the image tokens (the model's bidirectional
      attention among one image's tokens); pan-and-scan crops are tiles;

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
    a row's prompt must come from its column, not from its position. A method whose map
    depends on the score only through its gradient (``method.linear_in_read_gradient``:
    gradients, input×gradient, DecompX, the LRPs, GAE, TokenTM, AttCAT, the Grad-CAMs,
    ...; ``score="logit"``) needs only each image's own column: ``B`` sequences, one
    language-model run. The others (perturbation methods, BT, TAM, Chefer'21, LeGrad)
    score the ``B²``: explain distinct per-image prompts one image at a time where that
    is too many.

    Tiles (InternVL's dynamic tiling, Gemma 3's pan-and-scan crops): the processor
    gives an image as several rows of ``pixel_values`` ``[ΣN_tiles, C, H, W]`` (InternVL:
    the tiles row by row, then the thumbnail), and the features of a prompt's tiles fill
    its image tokens in turn. The explained batch is those rows: prompt ``i`` owns rows
    ``i·m … i·m + m - 1`` (``m`` = the prompt's image tokens / one tile's features; one
    prompt for all: every ``m`` rows are an image). Each row is scored in its prompt with
    the **other tiles clean** (their features from the tower's own forward on the
    unperturbed rows, fixed by :meth:`resolve`): one column per tile. So the gradient of a
    row is exactly that tile's share of the gradient of the whole prompt, and a
    perturbation method masks one tile at a time. A row costs one language-model sequence
    per tile of the batch (``N²`` for ``N`` tiles) for the methods that score the columns
    (perturbation methods, BT, TAM, Chefer'21, LeGrad); a method whose map depends on the
    score only through its gradient at the clean tiles (``method.linear_in_read_gradient``,
    ``score="logit"``) runs ONE sequence per prompt with all its tiles
    (:meth:`read_gradients`): the gradient of a tile's own column is that prompt's
    gradient on the tile.

    Per-token maps (``per_token=True``): every answer token ``t`` is
    a column ``log p(answer_t | prompt, image, answer_<t)`` beside the whole answer's (the
    default column, so ``attribute(images, target=target)`` is the answer's map; with
    tiles, each tile's columns in turn). ``target.token(t)`` selects token ``t``'s column
    and :func:`per_token_maps` stacks one map per token, ``[B, A, ...]``, labelled by
    ``target.labels`` (the decoded tokens, when a tokenizer is given); ``attribute``
    itself returns one map, of the column the target selects. All token scores come from
    one language-model run; for a method linear in the read gradient
    :func:`per_token_maps` runs the language model once for all tokens (one backward
    each), then one tower trace and a backward per token (token IxG, AttnLRP, ...:
    ``traces_read_gradients``) or the tower's forward and backward per token (the others;
    Qwen-VL's processor output: once per grid of its images); other methods make one
    ``attribute`` call per token. For a method linear in the score the token maps sum to
    the answer's map.

    Prompt layouts (what each processor's chat template writes; pass its ``input_ids``):

    - LLaVA-1.5: ``"USER: <image>\n{question} ASSISTANT:"``, ``<image>`` expanded to one
      image token per patch (per kept row);
    - PaliGemma: ``<image>`` × 256 (or 1024, 4096) + ``<bos>{question}\n`` (the image
      first);
    - InternVL (``OpenGVLab/InternVL3-*-hf``): ``"<|im_start|>user\n<image>\n{question}
      <|im_end|>\n<|im_start|>assistant\n"``, ``<image>`` expanded to ``<img>`` +
      ``<IMG_CONTEXT>`` × ``256 · N_tiles`` + ``</img>``;
    - Gemma 3: ``"<bos><start_of_turn>user\n<start_of_image>{question}<end_of_turn>\n
      <start_of_turn>model\n"``, ``<start_of_image>`` expanded to ``"\n\n<start_of_image>"``
      + ``<image_soft_token>`` × 256 + ``"<end_of_image>\n\n"`` (pan-and-scan: one such
      block per crop after the image's).

    **VLMs that split an image into tiles and mark each tile in the prompt**
    (:mod:`captum_vit.adapters.vlm_tiles`): pass
    the processor's whole output as ``input_ids`` (one image per prompt) and explain the
    tower on :meth:`images`, the real tiles of every prompt ``[N, C, S, S]``, one row per
    tile (the processor's padding images left out); :meth:`layouts` and :meth:`stitch`
    put the tiles' maps back on the image (:func:`captum_vit.viz.stitch`, the global view
    apart). A tile row's score is the answer's log-probability with that tile from the row
    and the prompt's other tiles clean (our choice): the clean score of every row is the
    model's own, a row's gradient is the whole answer's gradient on its tile, a
    perturbation method perturbs one tile at a time. Every tile is a column (``n·N``
    language-model sequences for ``n`` forward rows and ``N`` tiles, what the perturbation
    methods, BT, TAM, Chefer'21 and LeGrad score: explain one image at a time); a method
    linear in the read gradient runs one sequence per prompt. ``per_token=True`` gives
    every tile ``1 + A`` columns (the whole answer, then each token). The prompt layouts
    (where the processor's chat template puts the image tokens):

    - ``Idefics3ForConditionalGeneration`` / ``SmolVLMForConditionalGeneration``: the
      tower's final-normed tokens, the pixel-shuffle ``connector``; ``"User:<image>What is
      this?<end_of_utterance>\nAssistant:"``, the processor writing for every tile (row r,
      column c, raster order) ``<fake_token_around_image><row_r_col_c>`` and
      ``image_seq_len`` image tokens, ``\n`` after each row, then
      ``\n<fake_token_around_image><global-img>``, the global image's tokens and
      ``<fake_token_around_image>`` (an image not split: the last part only). The tiles
      are ``pixel_values.flatten(0, 1)`` without the all-zero padding images; the
      layout's rows and columns are the image processor's ``rows`` / ``cols``
      (``return_row_col_info=True``; the processor itself drops them: add them to the batch
      for :meth:`layouts` unless the split is square);
    - ``LlavaOnevisionForConditionalGeneration`` (and ``LlavaNextForConditionalGeneration``,
      the same code): LLaVA's feature layers and projector per crop, then the model's own
      ``pack_image_features`` (base image first, the crops' grid unpadded, an
      ``image_newline`` per row, OneVision's ``anyres_max`` downsizing);
      ``"<|im_start|>user <image>\nWhat is this?<|im_end|><|im_start|>assistant\n"``
      (NeXT: ``"[INST] <image>\nWhat is this? [/INST]"``), the processor expanding
      ``<image>`` to as many image tokens as the packed features; the tiles are the first
      crops of each prompt's ``pixel_values`` (their count from ``image_sizes``).

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
    the other images of its prompt held at the model's own features. Images of several
    sizes (in one prompt or across prompts) are one ``attribute`` call on the processor's
    output: it explains the images of each grid together (:meth:`for_images`), every
    image in its prompt with the prompt's other images clean, and returns one map per
    image on its own grid (a list when the grids differ). With
    ``per_token=True`` every such column has the whole answer's slot and one per answer
    token, all from one language-model run; :func:`per_token_maps` takes the processor's
    output too (each image read under its own column only: one sequence per image).

    Put the model in ``eval()`` mode (dropout makes the score random); the model is
    never modified.

    Args:
        model (nn.Module): a Hugging Face ``LlavaForConditionalGeneration``,
            ``PaliGemmaForConditionalGeneration``, ``InternVLForConditionalGeneration``,
            ``Gemma3ForConditionalGeneration``, or a tiled
            ``Idefics3ForConditionalGeneration``, ``SmolVLMForConditionalGeneration``,
            ``LlavaOnevisionForConditionalGeneration``,
            ``LlavaNextForConditionalGeneration``.
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
            tiled (a tiled VLM's: its processor's tiles, explain :meth:`images`). Default
            ``"pixel_values"``.
        attention_mask (Tensor, optional): ``[B, T]`` (1 = token, 0 = padding) of the
            prompts; default all ones.
        per_token (bool, optional): one column per answer token besides the whole
            answer's (above). Default False.
        tokenizer (optional): anything with ``decode(ids)`` (the model's tokenizer or
            processor): ``target.labels[i][t]`` is answer ``i``'s token ``t`` decoded.
            Default ``None`` (``labels`` is ``None``).

    Raises:
        TypeError: ``model`` is not a supported VLM (video LLaVAs are refused by name), or
            ids are not integer tensors.
        ValueError: an empty answer, ``-100`` before an answer's last scored token, ids
            outside the model's vocabulary (the image token excepted), tiled
            images in a processor's output,
            prompts and answers of different batch sizes, a prompt whose image tokens do
            not match the tower's features (or are no whole number of tiles), rows of
            ``pixel_values`` that are not whole prompts' tiles, or tower states of another
            model; for a tiled VLM: ids instead of the processor's output, tiles that do not match
            ``image_sizes`` or the prompts' image tokens, padded pixels inside a tile,
            several images per prompt, or another number of inputs than :meth:`images`.

    Examples::

        >>> from captum_vit import GAE
        >>> from captum_vit.targets import VLMAnswer
        >>> vlm = LlavaForConditionalGeneration.from_pretrained(path).eval()
        >>> batch = processor(images=image, text="USER: <image>\nColour? ASSISTANT:",
        ...                   return_tensors="pt")
        >>> answer = processor.tokenizer(" red", add_special_tokens=False).input_ids
        >>> target = VLMAnswer(vlm, batch["input_ids"], answer)
        >>> maps = GAE(VLMAnswer.tower(vlm)).attribute(batch["pixel_values"], target=target)

        InternVL's tiles with one map per answer token, SmolVLM's tiles stitched back on
        the image and Qwen2-VL from its processor's output run (on tiny random models) in
        the tutorial ``tutorials/07_vlm_answers.ipynb``; with a downloaded checkpoint::

            batch = processor.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=True, return_dict=True,
                                                  return_tensors="pt")
            answer = processor.tokenizer(" red", add_special_tokens=False).input_ids
            target = VLMAnswer(vlm, batch, answer)                      # Qwen2-VL, Qwen3-VL
            maps = GAE(VLMAnswer.tower(vlm)).attribute(batch, target=target)
            target = VLMAnswer(vlm, batch, answer, per_token=True)      # InternVL, Gemma 3
            maps = per_token_maps(TokenIxG(VLMAnswer.tower(vlm)), batch["pixel_values"],
                                  target)                               # [N_tiles, A, ...]

    A VLM that splits the image into tiles: see :meth:`images`.
    """

    reads_tokens = True
    probability = "sigmoid"

    def __init__(self, model: nn.Module, input_ids: Any, answer_ids: Any,
                 pixel_key: str = "pixel_values", attention_mask: Any = None,
                 per_token: bool = False, tokenizer: Any = None) -> None:
        self.parts: VLMParts = vlm_parts(model)
        if not isinstance(pixel_key, str):
            raise TypeError(f"pixel_key must be a str, got {type(pixel_key).__name__}")
        self.pixel_key = pixel_key
        self.tiled: Tiles | None = None  # a VLM that splits images (adapters.vlm_tiles)
        batch = None
        if not isinstance(input_ids, Tensor | Sequence) and hasattr(input_ids, "keys"):
            batch = input_ids
            if "input_ids" not in batch:
                raise ValueError("input_ids is a mapping without 'input_ids'; pass the "
                                 "processor's output or the ids themselves")
            pixels = batch.get(pixel_key)
            if isinstance(self.parts, TiledParts):  # captum_vit.adapters.vlm_tiles
                self.tiled = self.parts.read_tiles(batch, pixel_key)
            elif isinstance(pixels, Tensor) and pixels.dim() != 4 \
                    and not self.parts.packed_pixels:
                raise ValueError(f"{pixel_key} has shape {tuple(pixels.shape)}: tiled images "
                                 "(one image as several crops) are not supported; give "
                                 "[B, C, H, W] images")
            if attention_mask is None:
                attention_mask = batch.get("attention_mask")
            input_ids = batch["input_ids"]
        elif isinstance(self.parts, TiledParts):
            raise ValueError(f"input_ids: {type(model).__name__} splits each image into "
                             "tiles; pass the processor's whole output (a mapping with "
                             f"input_ids, {pixel_key}, ...) as input_ids")
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
        if self.tiled is not None:  # one column per tile (captum_vit.adapters.vlm_tiles)
            assert isinstance(self.parts, TiledParts)
            self._tiled_clean = self.parts.check_prompts(self.tiled, counts)
            self.answer_ids = per_image(self.answer_ids, b, "answer_ids")
            self.prompts = int(self.tiled.pixels.shape[0])
            self._column_of = torch.arange(self.prompts)
            self.blocks = self.parts.layers
            self.image_tokens = int(counts[0])
            self._extend(per_token, tokenizer)
            self.linearises = True  # every row is scored in every tile's place
            if self.parts.keep_cls:
                self.rows = tuple(range(self._tiled_clean[0].shape[1]))
            return
        varies = (counts != counts[0]).any() and not self.parts.packed_pixels  # Qwen: sizes
        if (counts == 0).any() or varies:
            raise ValueError(f"every prompt must hold the image token "
                             f"(id {self.parts.image_token_id}) once per image feature; "
                             f"got {counts.tolist()} per prompt")
        self.image_tokens = int(counts[0])
        self._extend(per_token, tokenizer)
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
        # every row is scored in every tile's place, or against every prompt (Qwen-VL's
        # columns are its adapter's, captum_vit.adapters.vlm_qwen; its read gradients
        # score each image in its own prompt only, QwenVLParts.own_columns)
        self.linearises = self.tiles > 1 or self.prompts > 1
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
        if self.tiles > 1 or self.per_token:
            return self._bases() * self.slots
        return self.prompts

    def index(self, batch: int) -> Tensor:
        if self.tiled is not None and batch % self.prompts:
            raise ValueError(f"inputs has {batch} images but the processor's batch has "
                             f"{self.prompts} real tiles: explain target.images(), the "
                             "tiles VLMAnswer was made for")
        if self.tiles > 1 or self.per_token:
            base = torch.arange(self._bases()) if self.tiles > 1 else self._column_of
            return per_image(base * self.slots + self._slot, batch, "VLMAnswer's columns")
        return per_image(self._column_of, batch, "VLMAnswer's prompts")

    def for_images(self, index: Tensor, total: int) -> VLMAnswer:
        """This target for the images ``index`` of a processor's batch of ``total`` images
        (Qwen-VL: the images of one grid, explained together when ``attribute`` splits a
        batch of several sizes per grid): only their columns, each image still reading its
        own; a prompt's other images stay at the model's own features.

        Raises:
            ValueError: a VLM whose processor output is not split per grid (not Qwen-VL).
        """
        select = getattr(self.parts, "select_images", None)
        if select is None:
            raise ValueError(f"VLMAnswer on {type(self.parts.model).__name__} explains one "
                             "grid at a time: give images of one size")
        return cast(VLMAnswer, select(self, index, total))

    def images(self) -> Tensor:
        """The tensor the methods explain on a tiled VLM: the real tiles of every prompt,
        prompt by prompt in the processor's order, ``[N, C, S, S]`` (for Idefics3 /
        SmolVLM ``pixel_values.flatten(0, 1)`` without the all-zero padding images; for
        LLaVA-OneVision the first ``image_size_to_num_patches`` crops of each prompt).

        Raises:
            ValueError: the VLM does not tile its images (explain its ``pixel_values``).

        Examples::

            >>> from captum_vit import GAE
            >>> from captum_vit.targets import VLMAnswer
            >>> vlm = Idefics3ForConditionalGeneration.from_pretrained(path).eval()
            >>> batch = processor(images=[[image]], return_tensors="pt", text=[
            ...     "User:<image>Colour?<end_of_utterance>\\nAssistant:"])
            >>> split = processor.image_processor([[image]], return_row_col_info=True)
            >>> batch["rows"], batch["cols"] = split["rows"], split["cols"]  # for layouts()
            >>> answer = processor.tokenizer(" red", add_special_tokens=False).input_ids
            >>> target = VLMAnswer(vlm, batch, answer)
            >>> target.images().shape  # 2 × 2 tiles and the global image
            torch.Size([5, 3, 32, 32])
            >>> maps = GAE(VLMAnswer.tower(vlm)).attribute(target.images(), target=target)
            >>> [(stitched, global_view)] = target.stitch(maps)
            >>> stitched.shape, global_view.shape
            (torch.Size([3, 64, 64]), torch.Size([3, 32, 32]))
        """
        if self.tiled is None:
            raise ValueError(f"{type(self.parts.model).__name__} does not tile its images: "
                             f"explain the processor's {self.pixel_key} themselves")
        return self.tiled.pixels

    def layouts(self) -> list[TileLayout]:
        """Where each prompt's tiles lie in its image (:class:`~captum_vit.adapters.
        vlm_tiles.TileLayout`, read from the processor's outputs and the model's
        config), for :func:`captum_vit.viz.stitch`.

        Raises:
            ValueError: the VLM does not tile its images, or Idefics3's rows and columns
                are not in the batch and the tile count does not fix them.
        """
        tiles = self.tiled
        if tiles is None:
            raise ValueError(f"{type(self.parts.model).__name__} does not tile its images")
        assert isinstance(self.parts, TiledParts)
        return [self.parts.layout(tiles, g) for g in range(len(tiles.counts))]

    def stitch(self, maps: Tensor) -> list[tuple[Tensor, Tensor | None]]:
        """Each prompt's ``(stitched, global_view)`` (:func:`captum_vit.viz.stitch`) of the
        maps ``[N, ...]`` of :meth:`images`.

        Raises:
            ValueError: ``maps`` has another number of rows than the tiles.
        """
        tiles = self.tiled
        if tiles is None:
            raise ValueError(f"{type(self.parts.model).__name__} does not tile its images")
        if not isinstance(maps, Tensor) or maps.shape[0] != tiles.pixels.shape[0]:
            got = tuple(maps.shape) if isinstance(maps, Tensor) else type(maps).__name__
            raise ValueError(f"maps must be [{tiles.pixels.shape[0]}, ...] (one map per tile "
                             f"of target.images()), got {got}")
        chunks = maps.split(list(tiles.counts))
        return [stitch(m, lay) for m, lay in zip(chunks, self.layouts(), strict=True)]

    def _states(self, out: Outputs) -> list[Tensor]:
        if self.parts.layers is None:
            if out.tokens is None:
                raise ValueError("VLMAnswer reads the tower's final-normed tokens")
            return [out.tokens]
        keys = [l if l > 0 else l + out.num_blocks + 1 for l in self.parts.layers]
        return [out.hidden[k] for k in keys]

    def columns(self, out: Outputs) -> Tensor:
        own = self.parts.columns(self, out)  # Qwen-VL (captum_vit.adapters.vlm_qwen)
        if own is not None:
            return own
        if self.tiled is not None:  # captum_vit.adapters.vlm_tiles
            assert isinstance(self.parts, TiledParts)
            states = self._states(out)
            return self.parts.tile_columns(self.tiled, self._tiled_clean, states, self.input_ids,
                                           self.attention_mask, self.answer_ids,
                                           per_token=self.per_token).to(states[0].dtype)
        if self.tiles > 1 or self.per_token:
            return self._columns(out)
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

    # -- tiles and per-token columns ---------------------------------------------------------
    def _extend(self, per_token: Any, tokenizer: Any) -> None:
        """Per-token columns, their labels and the tiles of a prompt (set in ``__init__``
        once the prompts' image tokens are counted)."""
        if not isinstance(per_token, bool):
            raise TypeError(f"per_token must be a bool, got {per_token!r}")
        self.per_token = per_token
        self.answer_length = int(self.answer_ids.shape[1])
        self.slots = 1 + self.answer_length if per_token else 1
        self._slot = 0
        self.labels: list[list[str]] | None = None
        if tokenizer is not None:
            decode = getattr(tokenizer, "decode", None)
            if not callable(decode):
                raise TypeError("tokenizer must have decode(ids) (the model's tokenizer or "
                                f"processor), got {type(tokenizer).__name__}")
            self.labels = [[str(decode([int(t)])) for t in row if t != -100]
                           for row in self.answer_ids]
        self.tiles = 1
        self._clean: Tensor | None = None
        self._clean_states: list[Tensor] | None = None  # the tower states resolve read
        self._clean_images: Tensor | None = None
        self._image_column: Tensor | None = None
        tile = self.parts.tile_features()
        if tile is not None and tile > 0:
            if self.image_tokens % tile:
                raise ValueError(
                    f"input_ids: every prompt holds {self.image_tokens} image tokens, not a "
                    f"whole number of tiles of {tile} features ({type(self.parts.model).__name__}"
                    "): give the ids the model's processor made for these images")
            self.tiles = self.image_tokens // tile

    def token(self, t: int) -> VLMAnswer:
        """This target explaining answer token ``t`` alone (``log p(answer_t | …)``, its
        column of a ``per_token=True`` target); the default column is the whole answer.

        Raises:
            ValueError: not a ``per_token=True`` target, or ``t`` outside the answer.
        """
        if not self.per_token:
            raise ValueError("token(t) needs VLMAnswer(..., per_token=True)")
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.answer_length:
            raise ValueError(f"t must be an answer position in [0, {self.answer_length}), "
                             f"got {t!r}")
        out = copy.copy(self)
        out._slot = 1 + t
        return out

    def resolve(self, adapter: Any, images: Tensor) -> VLMAnswer:
        """With tiles (several rows of ``pixel_values`` per prompt): the projected features
        of every clean tile, from the tower's own forward, fixed before any perturbed
        forward (a row is scored in its prompt with the other tiles clean). Without tiles:
        itself.

        Raises:
            ValueError: the rows do not split into whole prompts' tiles.
        """
        if self.tiles == 1:
            return self
        n, m = int(images.shape[0]), self.tiles
        prompts = int(self._column_of.shape[0])
        if n % m or (prompts != 1 and n != prompts * m):
            raise ValueError(
                f"pixel_values has {n} rows (tiles), but the {prompts} prompt(s) of input_ids "
                f"hold {self.image_tokens} image tokens each: {m} tiles of "
                f"{self.image_tokens // m} features per prompt; give the processor's "
                "pixel_values for these prompts (every tile of every image, in order)")
        tower = self.parts.tower
        states = tower_states(tower, images, self.parts.layers)
        with torch.no_grad():
            rows = int(states[0].shape[1])
            if self.parts.num_features(rows) != self.image_tokens // m:
                raise ValueError(
                    f"pixel_values: tiles of {tuple(images.shape[-2:])} pixels make {rows} "
                    f"tower tokens, not the {self.image_tokens // m} image features of a tile "
                    "of this prompt: explain VLMAnswer.tower(model) on the tiles of the size "
                    "the processor made")
            clean = self.parts.features(states)
        out = copy.copy(self)
        out._clean = clean.detach()
        out._clean_states = [v.detach() for v in states]
        out._clean_images = images
        out._image_column = per_image(self._column_of, n // m, "input_ids")
        return out

    def _bases(self) -> int:
        """The columns of the whole answer: one per distinct prompt, or with tiles one per
        tile (a tile's row scored in its prompt)."""
        if self.tiles == 1:
            return self.prompts
        if self._clean is None:
            raise ValueError("VLMAnswer with tiles is not resolved: the other tiles of a "
                             "prompt come from the clean forward; call target.resolve(adapt("
                             "VLMAnswer.tower(model)), pixel_values) first (the methods and "
                             "metrics do)")
        return int(self._clean.shape[0])

    def _features(self, out: Outputs) -> Tensor:
        """The projected features ``[n, f, D]`` of one tile (or image) per forward row.

        Raises:
            ValueError: tower states of another size or width than the prompts need.
        """
        states = self._states(out)
        x = states[0]
        n, rows, width = x.shape
        tower_width = int(self.parts.tower.config.hidden_size)
        per_tile = self.image_tokens // self.tiles
        if width != tower_width or self.parts.num_features(rows) != per_tile:
            raise ValueError(
                f"VLMAnswer read tower states of {rows} rows × {width} features, but the "
                f"prompts hold {self.image_tokens} image tokens ({self.tiles} tile(s)) and the "
                f"VLM's tower has {tower_width} features: explain VLMAnswer.tower(model) on "
                "images of the size the prompts were made for")
        return self.parts.features(states)

    def _answer_log_probs(self, feats: Tensor, which: Tensor) -> Tensor:
        """``[S, slots]``: the whole answer's log-probability (slot 0) and with
        ``per_token`` each answer token's (slot ``1 + t``) of ``S`` sequences, image
        features ``feats`` ``[S, f, D]`` at the image tokens of prompts ``which`` ``[S]``."""
        dev = feats.device
        ids, mask = self.input_ids[which].to(dev), self.attention_mask[which].to(dev)
        answer = self.answer_ids[which].to(dev)
        seq = torch.cat([ids, answer.clamp_min(0)], 1)
        am = torch.cat([mask, torch.ones_like(answer)], 1)
        logp = self.parts.answer_log_probs(feats, seq, am, answer, per_token=self.per_token)
        if self.per_token:
            return torch.cat([logp.sum(-1, keepdim=True), logp], 1)
        return logp[:, None]

    def _columns(self, out: Outputs) -> Tensor:
        """:meth:`columns` with tiles or per-token columns: ``[n, bases · slots]``, slot 0
        the whole answer, slot ``1 + t`` answer token ``t``."""
        feats = self._features(out)  # [n, f, D]
        n = feats.shape[0]
        dev = feats.device
        k = self._bases()
        if self.tiles == 1:
            seq_feats = feats.repeat_interleave(k, 0)  # row i·k + j: image i, prompt j
            which = torch.arange(k).repeat(n)
        else:  # column j: tile j's row among the clean tiles of its prompt
            m, (f, d) = self.tiles, feats.shape[1:]
            clean = cast(Tensor, self._clean).to(device=dev, dtype=feats.dtype)
            cols = torch.arange(k, device=dev)
            context = clean.reshape(k // m, m, f, d)[cols // m]  # [k, m, f, D]
            own = torch.nn.functional.one_hot(cols % m, m).bool()[None, :, :, None, None]
            seq_feats = torch.where(own, feats[:, None, None], context[None])
            seq_feats = seq_feats.reshape(n * k, m * f, d)
            which = cast(Tensor, self._image_column)[torch.arange(k) // m].repeat(n)
        logp = self._answer_log_probs(seq_feats, which)
        return logp.reshape(n, k * self.slots).to(self._states(out)[0].dtype)

    # -- the rows' own columns at one forward (ViTFront.linear_in_read_gradient) -------------
    def read_states(self, images: Tensor) -> dict[int | None, Tensor] | None:
        """The tower states of the clean tiles, when ``images`` are those tiles: the
        tile-marking VLMs' (:meth:`images`, read at construction) or those :meth:`resolve`
        read (tiles as rows); ``None`` otherwise (the read-gradient path then runs the
        tower's forward itself)."""
        held: list[Tensor] | None = self._clean_states
        seen: Tensor | None = self._clean_images
        if self.tiled is not None:
            held, seen = self._tiled_clean, self.tiled.pixels
        if held is None or seen is None or not (images is seen or (
                images.shape == seen.shape and images.dtype == seen.dtype
                and images.device == seen.device and torch.equal(images, seen))):
            return None
        keys: list[int | None] = [None] if self.parts.layers is None else list(self.parts.layers)
        if len(set(keys)) != len(keys) or len(keys) != len(held):
            return None
        return dict(zip(keys, held, strict=True))

    def read_gradients(self, out: Outputs, leaves: Sequence[Tensor],
                       indices: Sequence[Tensor | None]) -> list[list[Tensor]]:
        """The gradients of the picked columns w.r.t. the read tower states, from ONE
        language-model run for all ``indices`` (one backward each) when every index picks
        each row's own column (what :meth:`index` gives, one slot per index: the whole
        answer or one answer token): one sequence per row, or with tiles one per prompt
        with all its tiles from the forward's rows (at the clean tiles the gradient of a
        tile's own column, whose other tiles are the clean ones, is that prompt's
        gradient on the tile: ``N`` tiles cost one run, not ``N²`` sequences). Any other
        index: :meth:`~captum_vit.adapters.scoring.Target.read_gradients` (the columns).
        """
        own = self._own_slots(int(leaves[0].shape[0]), indices)
        if own is None:
            return super().read_gradients(out, leaves, indices)
        bases, slots = own
        if self.tiled is not None:
            assert isinstance(self.parts, TiledParts)
            states = self._states(out)
            if len(states) != len(self._tiled_clean) or any(
                    s.shape[1:] != c.shape[1:]
                    for s, c in zip(states, self._tiled_clean, strict=True)):
                raise ValueError(
                    f"VLMAnswer read tower states of shape {tuple(states[0].shape[1:])}, but "
                    f"the tiles' are {tuple(self._tiled_clean[0].shape[1:])}: explain "
                    "VLMAnswer.tower(model) on target.images(), the tiles the target was "
                    "made for")
            logp = self.parts.prompt_log_probs(self.tiled, states, self.input_ids,
                                               self.attention_mask, self.answer_ids,
                                               per_token=self.per_token)
            logp = logp if self.per_token else logp[:, None]
        elif isinstance(self.parts, QwenVLParts):  # each row under its own column only
            logp = self.parts.own_columns(self, out, bases)
        else:
            feats = self._features(out)  # [n, f, D]
            if self.tiles > 1:  # prompt P: its m rows' features in order
                m, (n, f, d) = self.tiles, feats.shape
                which = cast(Tensor, self._image_column)
                logp = self._answer_log_probs(feats.reshape(n // m, m * f, d), which)
            else:
                logp = self._answer_log_probs(feats, bases)
        grads = []
        for j, s in enumerate(slots):
            grads.append(list(torch.autograd.grad(
                logp[:, s].sum(), list(leaves), retain_graph=j < len(slots) - 1,
                allow_unused=True, materialize_grads=True)))
        return grads

    def _own_slots(self, n: int, indices: Sequence[Tensor | None]
                   ) -> tuple[Tensor, list[int]] | None:
        """``(bases [n], slots)`` when every index picks one slot of each row's own column
        (the same base for every index; with tiles the row's own tile), else ``None``."""
        if not indices or any(i is None for i in indices):
            return None
        bases: Tensor | None = None
        slots = []
        for index in cast(Sequence[Tensor], indices):
            index = index.detach().cpu().long()
            if index.shape != (n,):
                return None
            base, slot = index // self.slots, index % self.slots
            if (slot != slot[0]).any() or (bases is not None and not torch.equal(base, bases)):
                return None
            bases = base
            slots.append(int(slot[0]))
        assert bases is not None
        if self.tiled is not None or self.tiles > 1:  # each row is its own tile
            k = self.prompts if self.tiled is not None else self._bases()
            if n != k or not torch.equal(bases, torch.arange(n)):
                return None
        elif bases.min() < 0 or bases.max() >= self.prompts:
            return None
        return bases, slots


def per_token_maps(method: Any, inputs: Any, target: VLMAnswer, **kwargs: Any
                   ) -> Tensor | tuple[Tensor, ...] | list[Tensor]:
    r"""One map per answer token: ``method``'s map of ``log p(answer_t | …)`` for every
    ``t`` of a ``VLMAnswer(..., per_token=True)``, stacked ``[B, A, ...]`` (``A`` answer
    tokens; a shorter answer's padded tokens get the maps of a zero gradient);
    ``target.labels[i][t]`` names them when a tokenizer was given.

    A method whose map depends on the score only through its gradient at the tower states
    the answer reads (``method.linear_in_read_gradient``: gradients, input×gradient,
    DecompX, AttnLRP, CP-LRP, GAE, TokenTM, AttCAT, the Grad-CAMs, ... with
    ``score="logit"``) runs the language model ONCE: one tower forward (no gradient) to
    the read states (none on tiles: the target holds them), one language-model forward on
    them, one backward per token to its gradient ``g^{(t)}``, then the method's map of the
    linear score ``⟨x, g^{(t)}⟩`` (the same map by the chain rule). A method whose engine
    is one trace and one backward (``method.traces_read_gradients``: token IxG, AttIxG,
    AttCAT, DecompX's gradient route, AttnLRP, CP-LRP) takes all ``K`` maps from ONE
    trace of the tower and ``K`` backward passes; the others (GAE, TokenTM, the
    Grad-CAMs, vanilla gradients, DecompX's explicit route, ``heads="all"``) run the
    tower's forward and backward once per token. Any other method (BT,
    TAM, Chefer'21, LeGrad, the perturbation methods, ``score="probability"``) is called
    once per token with ``target.token(t)``, each call its own forward and backward of the
    whole VLM. For a method linear in the score (input×gradient, DecompX, CP-LRP, AttnLRP,
    plain gradients) the token maps sum to the whole answer's map.

    Qwen-VL's processor output (packed ``pixel_values`` and ``image_grid_thw``) is split per
    grid as ``attribute`` splits it: per grid, the images read under their own columns
    (:meth:`VLMAnswer.for_images`), one language-model run and the path above; each
    token's maps come back as ``attribute(batch, target=target.token(t))`` returns them,
    stacked on dim 1: ``[B, A, ...]`` for one grid, a list of ``[1, A, ...]`` per image for
    several, ``[ΣN, A]`` for ``output="tokens"``, ``[ΣN, A, D]`` for ``"inputs"``.

    Args:
        method: a captum_vit method on ``VLMAnswer.tower(model)``.
        inputs (Tensor or Mapping): the images (or tiles) as for ``method.attribute``, or
            Qwen-VL's processor output.
        target (VLMAnswer): built with ``per_token=True``.
        **kwargs: further options of ``method.attribute``.

    Returns:
        Tensor or list: ``[B, A, *map]`` (a 1-tuple of it for tuple ``inputs``, as Captum
        returns; a processor's output: above).

    Raises:
        TypeError: ``target`` is not a ``per_token=True`` :class:`VLMAnswer`.

    Examples::

        >>> target = VLMAnswer(vlm, batch, answer, per_token=True, tokenizer=processor)
        >>> maps = per_token_maps(IxG(VLMAnswer.tower(vlm)), batch["pixel_values"], target)
        >>> maps.shape[1] == len(target.labels[0])
        True
    """
    if not isinstance(target, VLMAnswer) or not target.per_token:
        raise TypeError("target must be VLMAnswer(..., per_token=True) for per_token_maps, got "
                        f"{target!r}")
    from captum_vit._base import ViTFront, _is_batch, prepare, read_state_gradients

    tokens = range(target.answer_length)
    linear = isinstance(method, ViTFront) and method._explains_read_gradient(kwargs)
    if linear and method.adapter.processor_keys and _is_batch(inputs):
        return _processed_token_maps(method, inputs, target, kwargs)
    if not (linear and isinstance(inputs, Tensor | tuple)):
        return _stack_tokens([method.attribute(inputs, target=target.token(t), **kwargs)
                              for t in tokens])
    p = prepare(method.adapter, inputs, target)
    resolved = cast(VLMAnswer, p.embedding)
    n = int(p.images.shape[0])
    keys, grads = read_state_gradients(method.adapter, p, resolved,
                                       [resolved.token(t).index(n) for t in tokens])
    maps = method._read_gradient_maps(inputs, resolved.rows,
                                      [dict(zip(keys, g, strict=True)) for g in grads],
                                      **kwargs)
    return _stack_tokens(maps)


def _processed_token_maps(method: Any, batch: Any, target: VLMAnswer,
                          kwargs: dict[str, Any]) -> Any:
    """:func:`per_token_maps` of a processor's output (Qwen-VL's packed ``pixel_values``
    and ``image_grid_thw``) under a method linear in the read gradient: per grid of the
    batch (:func:`~captum_vit._base.attribute_processed`'s split, the target restricted to
    that grid's images by :meth:`VLMAnswer.for_images`), ONE language-model run and the
    tower's path of :func:`per_token_maps` for all ``A`` tokens; then each token's maps
    assembled per image as ``attribute(batch, target=target.token(t))`` returns them,
    stacked on dim 1."""
    from captum_vit._base import attribute_processed

    options = dict(kwargs)
    output = options.pop("output", "pixels")
    grids: list[Any] = []  # per grid, in attribute_processed's order: [b, A, ...]

    def first(images: Tensor, group: Any, out: str, **kw: Any) -> Tensor:
        grids.append(per_token_maps(method, images, group, output=out, **kw))
        return cast(Tensor, grids[-1][:, 0])

    def serve(t: int) -> Callable[..., Tensor]:
        """Token ``t``'s maps of each grid in turn (the split's order, as computed)."""
        served = iter(grids)
        return lambda images, group, out, **kw: cast(Tensor, next(served)[:, t])

    maps = [attribute_processed(first, method.adapter, batch, target, output, **options)]
    maps += [attribute_processed(serve(t), method.adapter, batch, target, output, **options)
             for t in range(1, target.answer_length)]
    return _stack_tokens(maps)


def _stack_tokens(maps: Sequence[Any]) -> Any:
    """The token maps stacked ``[B, A, ...]``; maps of tuple inputs (Captum returns a
    1-tuple for them) stay a 1-tuple; per-image maps of a processor's images of several
    grids (a list of ``[1, ...]``) stay a list, of ``[1, A, ...]``."""
    if maps and isinstance(maps[0], tuple):
        return (torch.stack([m[0] for m in maps], 1),)
    if maps and isinstance(maps[0], list):
        return [torch.stack(list(each), 1) for each in zip(*maps, strict=True)]
    return torch.stack(list(maps), 1)
