"""Which :class:`~captum_vit.adapters.hf_vlm.VLMParts` serve a vision-language model: the
one dispatch over the VLM modules, each building on :mod:`captum_vit.adapters.hf_vlm`:

- :mod:`~captum_vit.adapters.vlm_qwen`: Qwen2-VL, Qwen3-VL;
- :mod:`~captum_vit.adapters.vlm_internvl`: InternVL, Gemma 3;
- :mod:`~captum_vit.adapters.vlm_tiles`: Idefics3, SmolVLM, LLaVA-OneVision, LLaVA-NeXT;
- :mod:`~captum_vit.adapters.hf_vlm`: LLaVA, PaliGemma (and the refusals).
"""

from __future__ import annotations

from typing import Any

from captum_vit.adapters import vlm_internvl, vlm_qwen, vlm_tiles
from captum_vit.adapters.hf_vlm import VLMParts, llava_parts


def vlm_parts(model: Any) -> VLMParts:
    """The :class:`~captum_vit.adapters.hf_vlm.VLMParts` of a supported vision-language
    model.

    Args:
        model (nn.Module): a Hugging Face VLM
            (:data:`~captum_vit.adapters.hf_vlm.ALL_SUPPORTED`).

    Returns:
        VLMParts: what :class:`~captum_vit.targets.VLMAnswer` reads of it.

    Raises:
        TypeError: a video LLaVA, another model, or a layout this transformers version
            does not have.

    Examples::

        >>> from captum_vit.adapters.vlms import vlm_parts
        >>> vlm_parts(llava).tower is llava.model.vision_tower
        True
    """
    for find in (vlm_qwen.qwen_parts, vlm_internvl.vlm_parts, vlm_tiles.tiled_parts):
        parts = find(model)
        if parts is not None:
            return parts
    return llava_parts(model)


__all__ = ["vlm_parts"]
