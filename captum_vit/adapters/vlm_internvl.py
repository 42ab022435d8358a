"""InternVL and Gemma 3 answers explained on their vision towers: the
:class:`~captum_vit.adapters.hf_vlm.VLMParts` of ``InternVLForConditionalGeneration`` and
``Gemma3ForConditionalGeneration`` (read by :class:`captum_vit.targets.VLMAnswer`).

Verified in the installed transformers (5.x):

- **InternVL** (``models/internvl/modeling_internvl.py``, ``InternVLModel.get_image_features``):
  the tower (``InternVLVisionModel``,
  :mod:`~captum_vit.adapters.families.hf_internvl`) runs on every tile; its
  ``last_hidden_state`` when ``config.vision_feature_layer == -1`` (the default; the
  final ``layernorm``, an identity under ``use_mean_pooling``), else
  ``hidden_states[vision_feature_layer]`` (an inner block: the target reads that block's
  output ``x_l``; ``hidden_states[0]`` is the embedding); the CLS row dropped under
  ``vision_feature_select_strategy="default"`` (``"full"`` would keep it and the model's
  own square reshape then fails: refused); the ``√P × √P`` patch rows pixel-shuffled by the
  model's own ``pixel_shuffle`` (``downsample_ratio`` 0.5: 2×2 tokens into one of 4× the
  width, ``P/4`` features per tile); ``multi_modal_projector`` (LayerNorm, Linear, GELU,
  Linear). The forward takes them as ``mm_encoder_outputs={"image": ...}`` and
  ``masked_scatter``\\ s the features of all tiles, in the order of ``pixel_values``' rows,
  into the ``image_token_id`` positions of all prompts, in order. **Tiles**: the processor
  (``GotOcr2ImageProcessor``, ``crop_to_patches``) cuts an image into ``n`` tiles of
  ``image_size`` (row-major) plus a thumbnail (the whole image resized, last), all rows of
  ``pixel_values [ΣN_tiles, C, H, W]``, and writes ``<img>`` + ``<IMG_CONTEXT>`` ×
  ``image_seq_length · N_tiles`` + ``</img>`` into the prompt: one prompt's image tokens
  are fed by that prompt's consecutive tiles.
- **Gemma 3** (``models/gemma3/modeling_gemma3.py``): the tower is a
  ``SiglipVisionModel`` (:mod:`~captum_vit.adapters.families.hf_clip`), its
  ``last_hidden_state`` (after ``post_layernorm``, every row); ``Gemma3MultiModalProjector``
  average-pools the ``patches_per_image²`` rows to ``mm_tokens_per_image`` (4×4 → 1 for the
  released 896 px / patch 14 / 256 tokens), RMS-norms them (``mm_soft_emb_norm``) and
  projects them (``mm_input_projection_weight``). The forward takes ``mm_encoder_outputs``
  and merges them itself; its attention is causal except among the tokens of one image,
  which attend to each other both ways: the model builds that mask from ``token_type_ids``
  (1 at the image tokens: what the processor returns as ``token_type_ids``), which
  :meth:`Gemma3Parts.forward_kwargs` passes (1 at the ``image_token_id`` positions). With
  ``do_pan_and_scan`` the processor adds crops of an image after it, each its own image
  block: tiles, grouped as InternVL's.

Only the model's own modules run (``pixel_shuffle``, ``multi_modal_projector``, the
forward); nothing is re-implemented or modified.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any, cast

from torch import Tensor

from captum_vit.adapters.hf_vlm import VLMParts, _part

SUPPORTED = ("InternVLForConditionalGeneration", "Gemma3ForConditionalGeneration")


def _pair(v: Any) -> tuple[int, int]:
    return (int(v[0]), int(v[1])) if isinstance(v, list | tuple) else (int(v), int(v))


@dataclasses.dataclass(frozen=True)
class InternVLParts(VLMParts):
    """What the answer score reads of an ``InternVLForConditionalGeneration``: the tower's
    state at :attr:`layers` (``None``: ``last_hidden_state``), CLS dropped, the model's
    ``pixel_shuffle`` by :attr:`ratio`, ``multi_modal_projector``.

    Attributes:
        ratio (float): ``config.downsample_ratio`` (0.5: 2×2 tokens into one).
    """

    ratio: float = 0.5

    def num_features(self, num_tokens: int) -> int:
        """Image positions of one tile for tower states of ``num_tokens`` rows (CLS and a
        square grid of patches); 0 for rows the model's reshape does not take."""
        p = num_tokens - 1
        side = math.isqrt(max(p, 0))
        out = side * self.ratio
        if side * side != p or out != int(out):
            return 0
        return int(out) ** 2

    def features(self, states: list[Tensor]) -> Tensor:
        """``multi_modal_projector(pixel_shuffle(x[:, 1:]))`` ``[n, P·r², D_text]``."""
        x = states[0][:, 1:]
        n, p, d = x.shape
        side = math.isqrt(p)
        shuffled = _part(self.model, "pixel_shuffle")(x.reshape(n, side, side, d),
                                                      scale_factor=self.ratio)
        return self.projector(shuffled.reshape(n, -1, shuffled.shape[-1]))

    def tile_features(self) -> int | None:
        """Image positions of one tile of ``vision_config.image_size``."""
        cfg = self.tower.config
        (h, w), (ph, pw) = _pair(cfg.image_size), _pair(cfg.patch_size)
        return self.num_features(1 + (h // ph) * (w // pw))


@dataclasses.dataclass(frozen=True)
class Gemma3Parts(VLMParts):
    """What the answer score reads of a ``Gemma3ForConditionalGeneration``: the tower's
    ``last_hidden_state`` (every row) through ``multi_modal_projector`` (average pool to
    ``mm_tokens_per_image``, RMSNorm, projection); ``token_type_ids`` for the model's
    bidirectional attention among one image's tokens."""

    def num_features(self, num_tokens: int) -> int:
        """``mm_tokens_per_image`` for the projector's ``patches_per_image²`` rows (the
        only grid it reshapes to), else 0."""
        side = int(cast(Any, self.projector).patches_per_image)
        if num_tokens != side ** 2:
            return 0
        return int(self.model.config.mm_tokens_per_image)

    def tile_features(self) -> int | None:
        """``mm_tokens_per_image``: an image and its pan-and-scan crops are tiles."""
        return int(self.model.config.mm_tokens_per_image)

    def forward_kwargs(self, input_ids: Tensor, answer_tokens: int) -> dict[str, Any]:
        """``token_type_ids``: 1 at the image tokens (the model's bidirectional image
        attention), 0 elsewhere."""
        return {"token_type_ids": (input_ids == self.image_token_id).long()}


def vlm_parts(model: Any) -> VLMParts | None:
    """The :class:`VLMParts` of an InternVL or Gemma 3 model (``None`` for other models).

    Raises:
        TypeError: a transformers version whose forward does not take
            ``mm_encoder_outputs``, InternVL's ``"full"`` strategy or a list of feature
            layers (the model's own ``get_image_features`` takes neither).
    """
    name = type(model).__name__
    if name not in SUPPORTED or not type(model).__module__.startswith("transformers."):
        return None
    cfg = model.config
    if "mm_encoder_outputs" not in inspect.signature(model.forward).parameters:
        raise TypeError(f"{name}: VLMAnswer needs a transformers version whose forward takes "
                        "mm_encoder_outputs (transformers >= 5)")
    tower = _part(model, "vision_tower")
    image_token_id = int(cfg.image_token_id)
    if name.startswith("InternVL"):
        layer = cfg.vision_feature_layer
        if not isinstance(layer, int):
            raise TypeError(f"{name}: vision_feature_layer {layer!r} is not one int (the "
                            "model's get_image_features indexes hidden_states with it)")
        strategy = cfg.vision_feature_select_strategy
        if strategy != "default":
            raise TypeError(f"{name}: vision_feature_select_strategy {strategy!r}: the model "
                            "pixel-shuffles a square grid of patch rows, so only 'default' "
                            "(CLS dropped) runs")
        layers = None if layer == -1 else (int(layer),)
        return InternVLParts(model, tower, "internvl", layers, False, image_token_id, "model",
                             ratio=float(cfg.downsample_ratio))
    return Gemma3Parts(model, tower, "gemma3", None, False, image_token_id, "model")
