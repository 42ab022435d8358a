"""Targets: what a method explains.

``target=`` of every method and metric takes class indices (a classifier), target
vectors or an :class:`EmbeddingTarget` (a model that outputs an image embedding), a
:class:`Target` (any differentiable scalar of the model: :class:`ClassTarget`,
:class:`MultiLabel`, :class:`Contrastive`, :class:`TokenTarget`, :class:`HeadTarget`,
:class:`VLMAnswer`, :class:`DetectionTarget` (a detector's detection token),
:class:`DepthTarget`, :class:`SamMaskTarget` (a mask of the Segment Anything Model),
:class:`Sam2MaskTarget` (a mask of SAM 2), or a subclass of your own) or a plain callable
on the logits.
:func:`clip_text_target` turns text prompts into the :class:`EmbeddingTarget` of a CLIP-style
model (OpenCLIP, Hugging Face CLIP and SigLIP); with ``text_relevance=True`` it is a
:class:`TextEmbeddingTarget`, which also explains the prompt's tokens.
"""

from captum_vit.adapters.scoring import Outputs, Target, per_image
from captum_vit.targets.clip_text import TextEmbeddingTarget, clip_text_target
from captum_vit.targets.depth import DepthTarget
from captum_vit.targets.detection import DetectionTarget
from captum_vit.targets.embedding import (
    SIMILARITIES,
    EmbeddingTarget,
    embedding_target,
    is_embedding_target,
    read_target_embeddings,
    scoring,
)
from captum_vit.targets.sam import SamMaskTarget
from captum_vit.targets.sam2 import Sam2MaskTarget
from captum_vit.targets.score import (
    CLASS_SCORES,
    LINEAR_IN_SCORE,
    CallableTarget,
    ClassTarget,
    Contrastive,
    HeadTarget,
    MultiLabel,
    TokenTarget,
    as_target,
)
from captum_vit.targets.vlm import VLMAnswer

__all__ = [
    "CLASS_SCORES", "LINEAR_IN_SCORE", "SIMILARITIES", "CallableTarget", "ClassTarget",
    "Contrastive", "DepthTarget", "DetectionTarget", "EmbeddingTarget", "HeadTarget", "MultiLabel",
    "Outputs", "Sam2MaskTarget", "SamMaskTarget", "Target", "TextEmbeddingTarget",
    "TokenTarget", "VLMAnswer",
    "as_target", "clip_text_target", "embedding_target", "is_embedding_target", "per_image",
    "read_target_embeddings", "scoring",
]
