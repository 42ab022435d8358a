"""Hugging Face vision-language models whose answers are explained on their vision
tower: ``LlavaForConditionalGeneration`` (CLIP tower) and
``PaliGemmaForConditionalGeneration`` (SigLIP tower).

The methods explain the vision tower (:mod:`captum_vit.adapters.families.hf_clip` runs it); the
score, :class:`captum_vit.targets.VLMAnswer`, continues from the tower's token states
through what the VLM does with them:

- **LLaVA** (``LlavaModel.get_image_features``): the tower's ``hidden_states`` at
  ``config.vision_feature_layer`` (an index into ``hidden_states``, default ``-2``; a list
  of them is concatenated along the features, in the order given), the class token
  dropped under ``vision_feature_select_strategy="default"`` (``"full"`` keeps it), then
  ``multi_modal_projector``.
- **PaliGemma** (``PaliGemmaModel.get_image_features``): the tower's
  ``last_hidden_state`` (``post_layernorm`` of the last block: the adapter's final-normed
  tokens), every row, then ``multi_modal_projector``.

The projected features then enter the VLM's own forward: where it takes them
(``mm_encoder_outputs``, transformers 5), the model merges them itself (``masked_scatter``
at the ``image_token_id`` positions, PaliGemma's out-of-vocabulary image id, prefix mask
and 1-based positions included); otherwise (transformers 4) they are put at the image-token
positions of the input embeddings as the model's forward does and the forward gets
``inputs_embeds``. Nothing of the model is modified or re-implemented: the language model
and its head run as they are.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
from torch import Tensor, nn

from captum_vit.adapters._typing import ModelTree

SUPPORTED = ("LlavaForConditionalGeneration", "PaliGemmaForConditionalGeneration")
"""The VLMs of this module (:func:`llava_parts`)."""
ALL_SUPPORTED = (*SUPPORTED, "InternVLForConditionalGeneration",
                 "Gemma3ForConditionalGeneration", "Idefics3ForConditionalGeneration",
                 "SmolVLMForConditionalGeneration", "LlavaOnevisionForConditionalGeneration",
                 "LlavaNextForConditionalGeneration", "Qwen2VLForConditionalGeneration",
                 "Qwen3VLForConditionalGeneration")
"""Every VLM :class:`~captum_vit.targets.VLMAnswer` serves (:mod:`captum_vit.adapters.vlms`),
for the refusal messages."""
TILED = ("VideoLlava", "LlavaNextVideo")
"""Class-name prefixes of VLMs that tile an image into crops (``anyres``): refused."""


def _part(model: nn.Module, name: str) -> Any:
    """``model.model.<name>`` (transformers ≥ 4.52) or ``model.<name>`` (older)."""
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, name):
        return getattr(inner, name)
    if hasattr(model, name):
        return getattr(model, name)
    raise TypeError(f"{type(model).__name__} has no {name}; this transformers layout is "
                    "not supported")


@dataclasses.dataclass(frozen=True)
class VLMParts:
    """What the answer score reads of a vision-language model (never modified).

    Attributes:
        model (nn.Module): the VLM itself; its forward runs the language model.
        tower (nn.Module): the vision tower the methods explain.
        family (str): ``"llava"``, ``"paligemma"`` (or a subclass's: ``"internvl"``,
            ``"gemma3"``, :mod:`captum_vit.adapters.vlm_internvl`).
        layers (tuple of int or None): the tower's ``hidden_states`` indices read (LLaVA),
            ``None``: its final-normed last state (PaliGemma).
        keep_cls (bool): the class token is kept (LLaVA's ``"full"`` strategy).
        image_token_id (int): the placeholder id of the image positions.
        merge (str): ``"model"`` (the forward takes ``mm_encoder_outputs``) or
            ``"embeds"`` (merged here into ``inputs_embeds``).
    """

    model: ModelTree  # transformers models, read by attribute names
    tower: ModelTree
    family: str
    layers: tuple[int, ...] | None
    keep_cls: bool
    image_token_id: int
    merge: str

    packed_pixels = False
    """Whether the VLM's ``pixel_values`` are packed patches rather than images
    ``[B, C, H, W]`` (Qwen-VL, :mod:`captum_vit.adapters.vlm_qwen`): a processor's output
    given as ``input_ids`` is then not refused as tiled."""

    def bind(self, target: Any, batch: Any) -> None:
        """Hook: a family whose answer needs more than the prompts (image grids, the other
        images of a prompt) reads it from the processor's output ``batch`` (``None``:
        ids were given) at the end of :class:`~captum_vit.targets.VLMAnswer`'s
        construction. Default: nothing."""
        return None

    def columns(self, target: Any, out: Any) -> Tensor | None:
        """Hook: the target's columns ``[n, K]`` computed by the family
        (:mod:`captum_vit.adapters.vlm_qwen`); ``None`` (default): the projector and the
        merge at the image positions below."""
        return None

    @property
    def projector(self) -> nn.Module:
        return _part(self.model, "multi_modal_projector")

    def num_features(self, num_tokens: int) -> int:
        """Image positions per prompt for tower states of ``num_tokens`` rows."""
        return num_tokens if self.family == "paligemma" or self.keep_cls else num_tokens - 1

    def features(self, states: list[Tensor]) -> Tensor:
        """The projected image features ``[n, P', D_text]`` of the tower states read
        (one per entry of :attr:`layers`, or the final-normed tokens)."""
        if self.family == "llava" and not self.keep_cls:
            states = [s[:, 1:] for s in states]
        x = states[0] if len(states) == 1 else torch.cat(states, dim=-1)
        return self.projector(x)

    def tile_features(self) -> int | None:
        """Image positions of one tile for a VLM whose processor cuts an image into tiles
        (rows of ``pixel_values`` feeding one prompt's image tokens in turn); ``None``: one
        image is one row."""
        return None

    def forward_kwargs(self, input_ids: Tensor, answer_tokens: int) -> dict[str, Any]:
        """Further keywords of the VLM's forward for ``input_ids`` ``[m, T + A]`` (the
        last ``answer_tokens`` are the answer)."""
        return {}

    def answer_log_probs(self, features: Tensor, input_ids: Tensor, attention_mask: Tensor,
                         answer: Tensor, per_token: bool = False) -> Tensor:
        """``Σ_t log p(answer_t | prompt, image, answer_<t)`` for each of ``m`` sequences.

        Args:
            features (Tensor): projected image features ``[m, P', D_text]``.
            input_ids (Tensor): prompt then answer ids ``[m, T + A]`` (answer padding
                already replaced by a valid id).
            attention_mask (Tensor): ``[m, T + A]``.
            answer (Tensor): the answer ids ``[m, A]``, ``-100`` where not scored.

            per_token (bool, optional): return each answer token's log-probability
                ``[m, A]`` (0 where not scored) instead of their sum. Default False.

        Returns:
            Tensor: ``[m]`` summed log-probabilities (float32 at least).
        """
        a = answer.shape[1]
        kwargs: dict[str, Any] = {"attention_mask": attention_mask, "use_cache": False}
        params = inspect.signature(self.model.forward).parameters
        if self.family == "paligemma":  # the prompt is the prefix, the answer the suffix
            tt = torch.zeros_like(input_ids)
            tt[:, -a:] = 1
            kwargs["token_type_ids"] = tt
        kwargs.update(self.forward_kwargs(input_ids, a))
        for name in ("logits_to_keep", "num_logits_to_keep"):
            if name in params:
                kwargs[name] = a + 1
                break
        if self.merge == "model":
            from transformers.modeling_outputs import BaseModelOutputWithPooling

            pooled: Any = list(features) if self.family == "llava" else features
            out = self.model(input_ids=input_ids, mm_encoder_outputs={
                "image": BaseModelOutputWithPooling(pooler_output=pooled)}, **kwargs)
        else:
            out = self.model(inputs_embeds=self._merged(features, input_ids), **kwargs)
        logits = out.logits[:, -(a + 1):-1]
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        logp = logits.log_softmax(-1)
        scored = answer != -100
        picked = logp.gather(-1, answer.clamp_min(0)[..., None].to(logp.device))[..., 0]
        tokens = picked * scored.to(logp.device)
        return tokens if per_token else tokens.sum(-1)

    def _merged(self, features: Tensor, input_ids: Tensor) -> Tensor:
        """Input embeddings with the image features at the image positions (the forward's
        own ``masked_scatter``; transformers 4)."""
        embed = self.model.get_input_embeddings()
        image = input_ids == self.image_token_id
        ids = input_ids.masked_fill(image, 0) if self.image_token_id >= embed.num_embeddings \
            else input_ids
        x = embed(ids)
        mask = image[..., None].expand_as(x).to(x.device)
        return x.masked_scatter(mask, features.to(x.dtype))


def tower_states(tower: nn.Module, pixels: Tensor, layers: tuple[int, ...] | None
                 ) -> list[Tensor]:
    """The tower states a VLM reads of clean images ``pixels`` (no gradient): its
    ``last_hidden_state`` when ``layers`` is ``None``, else its ``hidden_states[k]`` for
    every ``k`` of ``layers``, computed by the adapter's canonical forward (the tower's own
    to rounding, checked once per model): the tower's forward with
    ``output_hidden_states=True`` would install transformers' output-capturing hooks on
    the model for good (transformers 5), and the model is never changed."""
    param = next(tower.parameters())
    pixels = pixels.to(param.device, param.dtype)  # as the model's get_image_features
    with torch.no_grad():
        if layers is None:
            return [tower(pixel_values=pixels).last_hidden_state]
        from captum_vit.adapters import adapt  # the package imports this module
        from captum_vit.adapters.ops import Ops

        a = adapt(tower)
        total = a.num_blocks
        wanted = [k if k >= 0 else k + total + 1 for k in layers]
        states: dict[int, Tensor] = {}
        x = a.embed(pixels)
        for l in range(max(wanted) + 1):
            if l in wanted:
                states[l] = x
            if l < max(wanted):
                x = a.block(x, l, Ops())
        return [states[k] for k in wanted]


def llava_parts(model: Any) -> VLMParts:
    """The :class:`VLMParts` of a LLaVA or PaliGemma (the other VLMs:
    :func:`captum_vit.adapters.vlms.vlm_parts`).

    Raises:
        TypeError: a video LLaVA, another model, or a layout this transformers version
            does not have.
    """
    name = type(model).__name__
    if any(name.startswith(p) for p in TILED):
        raise TypeError(f"{name} tiles each image into crops (anyres) and packs their "
                        "features with newline embeddings: not supported; explain a "
                        f"{' or '.join(ALL_SUPPORTED)}")
    if name not in SUPPORTED or not type(model).__module__.startswith("transformers."):
        raise TypeError(f"model must be one of {', '.join(ALL_SUPPORTED)} (Hugging Face), got "
                        f"{name}; for a vision tower alone use a class or embedding target")
    cfg = model.config
    tower = _part(model, "vision_tower")
    params = inspect.signature(model.forward).parameters
    merge = "model" if "mm_encoder_outputs" in params else "embeds"
    image_token_id = getattr(cfg, "image_token_id", None)
    image_token_id = int(cfg.image_token_index if image_token_id is None else image_token_id)
    if name.startswith("Llava"):
        layer = cfg.vision_feature_layer
        layers = (int(layer),) if isinstance(layer, int) else tuple(int(v) for v in layer)
        strategy = cfg.vision_feature_select_strategy
        if strategy not in ("default", "full"):
            raise TypeError(f"{name}: vision_feature_select_strategy {strategy!r} is not "
                            "'default' or 'full'")
        return VLMParts(model, tower, "llava", layers, strategy == "full", image_token_id,
                        merge)
    if merge == "embeds" and not hasattr(model.get_input_embeddings(), "embed_scale"):
        raise TypeError(f"{name}: this transformers version scales PaliGemma's image "
                        "features inside get_image_features; VLMAnswer needs a version "
                        "whose forward takes mm_encoder_outputs (transformers 5)")
    return VLMParts(model, tower, "paligemma", None, False, image_token_id, merge)
