"""Adapter for Hugging Face vision towers that output an image embedding:
``CLIPVisionModel``, ``CLIPVisionModelWithProjection`` and ``SiglipVisionModel``, and the
image side of the dual ``CLIPModel`` / ``SiglipModel`` (their ``get_image_features``; the
text side is the user's, to make target vectors).

These models have no classifier: their targets are vectors (a text embedding the user
computed; see the embedding targets of :mod:`captum_vit.targets`), scored against the image
embedding inside :meth:`ViTAdapter.targeting`.

- **CLIP**: CLS token first; ``pre_layrnorm`` (sic) on the embedding output, like timm's
  ``norm_pre``; QuickGELU MLPs; the embedding is ``post_layernorm`` of the CLS row, times
  ``visual_projection`` (no bias) for the ``WithProjection`` model (``image_embeds``),
  un-projected for ``CLIPVisionModel`` (``pooler_output``).
- **SigLIP**: no prefix token (K = 0); tanh-GELU MLPs; ``post_layernorm`` on every token,
  then the attention-pool head ``SiglipMultiheadAttentionPoolingHead`` (``probe`` attends
  over all tokens through ``nn.MultiheadAttention``, whose ``in_proj_weight`` rows are
  ``[q; k; v]``; ``o + mlp(layernorm(o))``): the embedding is ``pooler_output``. A tower
  without the head (``vision_use_head=False``, PaliGemma's) outputs its final-normed tokens
  only (``last_hidden_state``): their patch mean stands for its embedding (our choice);
  :class:`~captum_vit.targets.VLMAnswer` reads the tokens themselves.
- **Classifiers**: ``CLIPForImageClassification`` and ``SiglipForImageClassification``
  are the tower, a mean pooling and a linear ``classifier``
  (:class:`HFCLIPClassifierAdapter`).
- The towers inside LLaVA (``CLIPVisionModel``) and PaliGemma (``SiglipVisionModel``)
  are these classes: explain them as they are (``model.model.vision_tower``).

Both transformers layouts are read: transformers 5 puts ``embeddings``/``encoder``/
``post_layernorm`` on the model itself (``CLIPVisionModelWithProjection.vision_model`` is
the flattened ``CLIPVisionModel``), transformers 4 under ``vision_model``. The embedding
is the model's own ``embeddings(pixel_values, interpolate_pos_encoding=...)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import Tensor, nn

from captum_vit.adapters._typing import ModelTree
from captum_vit.adapters.catalog import Example, register_family
from captum_vit.adapters.families._examples import (
    VLM_IMAGE_ID,
    hf_builder,
    library,
    transformers_model,
)
from captum_vit.adapters.families._hf import (
    HFViTBase,
    encoder_blocks,
    is_transformers_model,
    siglip_pool,
    vision_tower,
)
from captum_vit.adapters.ops import Ops
from captum_vit.adapters.parts import HeadParts
from captum_vit.adapters.parts import layer_norm_parts as _norm
from captum_vit.adapters.text import TextTower

CLASSES = ("CLIPVisionModel", "CLIPVisionModelWithProjection", "SiglipVisionModel",
           "CLIPModel", "SiglipModel")


def text_tower(model: ModelTree) -> TextTower:
    """The text side of a dual ``CLIPModel`` / ``SiglipModel``
    (:class:`~captum_vit.adapters.text.TextTower`): ``text_model`` (its ``embeddings
    .token_embedding``, the encoder's layers with ``self_attn.q_proj/k_proj/v_proj`` and
    ``mlp.activation_fn``, every LayerNorm and ``nn.Linear`` of it: SigLIP's ``head``) and
    CLIP's ``text_projection``; the features are ``get_text_features``.

    Args:
        model (nn.Module): the dual model.

    Returns:
        TextTower: ``blockers`` name what the LRP rules do not know (input×gradient runs
        anyway).

    Raises:
        TypeError: no ``text_model`` with a token embedding.
    """
    name = type(model).__name__
    text = getattr(model, "text_model", None)
    while text is not None and not hasattr(text, "embeddings") and hasattr(text, "text_model"):
        text = text.text_model
    emb = getattr(getattr(text, "embeddings", None), "token_embedding", None)
    if text is None or not isinstance(emb, nn.Embedding):
        raise TypeError(f"text_relevance needs the text tower of a Hugging Face CLIPModel / "
                        f"SiglipModel (text_model.embeddings.token_embedding); {name} has "
                        "none")
    qkv: list[tuple[nn.Module, nn.Module, nn.Module]] = []
    acts: list[nn.Module] = []
    blockers: list[str] = []
    for i, layer in enumerate(getattr(getattr(text, "encoder", None), "layers", [])):
        att = getattr(layer, "self_attn", None)
        q, k, v = (getattr(att, n, None) for n in ("q_proj", "k_proj", "v_proj"))
        if isinstance(q, nn.Linear) and isinstance(k, nn.Linear) and isinstance(v, nn.Linear):
            qkv.append((q, k, v))
        else:
            blockers.append(f"text layer {i}'s attention {type(att).__name__}")
        act = getattr(getattr(layer, "mlp", None), "activation_fn", None)
        if isinstance(act, nn.Module):
            acts.append(act)
        else:
            blockers.append(f"text layer {i}'s MLP without an activation module")
    if not qkv and not blockers:
        blockers.append("a text encoder without layers")
    parts = [text] + [m for m in (getattr(model, "text_projection", None),)
                      if isinstance(m, nn.Module)]
    modules = [m for part in parts for m in part.modules()]

    def features(inputs: Mapping[str, Tensor]) -> Tensor:
        out = model.get_text_features(**inputs)
        return out if isinstance(out, Tensor) else out.pooler_output

    return TextTower(embedding=emb, features=features,
                     norms=[m for m in modules if isinstance(m, nn.LayerNorm)], acts=acts,
                     qkv=qkv, linears=[m for m in modules if isinstance(m, nn.Linear)],
                     blockers=tuple(blockers))


def is_hf_clip_classifier(model: nn.Module) -> bool:
    """``True`` for the Hugging Face CLIP / SigLIP image classifiers in
    :data:`CLASSIFIERS`."""
    return is_transformers_model(model, CLASSIFIERS)


def is_hf_embedding(model: nn.Module) -> bool:
    """``True`` for the Hugging Face vision towers in :data:`CLASSES`."""
    return is_transformers_model(model, CLASSES)


def _llava(*, seed: int = 0, depth: int = 3, dtype: torch.dtype = torch.float64,
           num_classes: int = 5, **overrides: Any) -> nn.Module:
    """A small ``LlavaForConditionalGeneration``: a CLIP tower (32 px, patch 8, ``depth``
    blocks) and a 2-layer Llama whose image placeholder is :data:`VLM_IMAGE_ID`."""
    transformers = library("transformers")
    vc = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=depth, num_attention_heads=4,
                                       image_size=32, patch_size=8)
    tc = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=128)
    cfg = transformers.LlavaConfig(vision_config=vc, text_config=tc,
                                   image_token_id=VLM_IMAGE_ID, **overrides)
    return transformers_model("LlavaForConditionalGeneration", cfg, seed, dtype)


def _paligemma(*, seed: int = 0, depth: int = 3, dtype: torch.dtype = torch.float64,
               num_classes: int = 5, **overrides: Any) -> nn.Module:
    """A small ``PaliGemmaForConditionalGeneration``: a 2-block SigLIP tower without head
    (32 px, patch 8) and a 2-layer Gemma whose image placeholder is :data:`VLM_IMAGE_ID`."""
    cfg = library("transformers").PaliGemmaConfig(
        vision_config={"model_type": "siglip_vision_model", "hidden_size": 32,
                       "intermediate_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "image_size": 32, "patch_size": 8,
                       "vision_use_head": False},
        text_config={"model_type": "gemma", "vocab_size": 299, "hidden_size": 24,
                     "intermediate_size": 48, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 12},
        image_token_id=VLM_IMAGE_ID, projection_dim=24, hidden_size=24, vocab_size=299,
        **overrides)
    return transformers_model("PaliGemmaForConditionalGeneration", cfg, seed, dtype)


def _gemma3(*, seed: int = 0, depth: int = 2, dtype: torch.dtype = torch.float64,
            num_classes: int = 5, **overrides: Any) -> nn.Module:
    """A small ``Gemma3ForConditionalGeneration``: a SigLIP tower without head (32 px,
    patch 8: 16 rows average-pooled 2×2 to 4 image tokens) and a 2-layer Gemma 3 whose
    image placeholder is :data:`VLM_IMAGE_ID`."""
    cfg = library("transformers").Gemma3Config(
        vision_config={"model_type": "siglip_vision_model", "hidden_size": 32,
                       "intermediate_size": 64, "num_hidden_layers": depth,
                       "num_attention_heads": 4, "image_size": 32, "patch_size": 8,
                       "vision_use_head": False},
        text_config={"model_type": "gemma3_text", "vocab_size": 300, "hidden_size": 24,
                     "intermediate_size": 48, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 12,
                     "sliding_window": 4, "max_position_embeddings": 256},
        mm_tokens_per_image=4, image_token_id=VLM_IMAGE_ID, boi_token_id=297,
        eoi_token_id=298, **overrides)
    return transformers_model("Gemma3ForConditionalGeneration", cfg, seed, dtype)


@register_family(
    is_hf_embedding,
    name="hf_embedding",
    supports="Hugging Face CLIPVisionModel(WithProjection), SiglipVisionModel, CLIPModel, "
             "SiglipModel (image embeddings)",
    tags=("embedding", "vlm-tower", "variable-size"),
    notes=("`CLIPVisionModel`, `CLIPVisionModelWithProjection`, `SiglipVisionModel` "
           "(attention-pool head, or none: PaliGemma's tower), and the image side of `CLIPModel` "
           "/ `SiglipModel`; the towers of `LlavaForConditionalGeneration` and "
           "`PaliGemmaForConditionalGeneration` with `VLMAnswer`: ✅ with vector targets (a CLIP "
           "tower's maps equal a timm twin's whose logit is `⟨e, t⟩`, 1e-10, every method; so "
           "does every metric of the suite, 1e-9), in the metrics and both commands too"),
    examples={
        "hf_clip": Example(hf_builder("CLIPVisionModelWithProjection", "CLIPVisionConfig",
                                      projection_dim=16), (32, 32), library="transformers",
                           target="embedding"),
        "hf_clip_noproj": Example(hf_builder("CLIPVisionModel", "CLIPVisionConfig"),
                                  (24, 40), library="transformers", target="embedding"),
        "hf_siglip": Example(hf_builder("SiglipVisionModel", "SiglipVisionConfig"), (32, 32),
                             library="transformers", target="embedding"),
        # support-matrix columns: whole VLMs, their towers explained through VLMAnswer
        "hf_llava": Example(_llava, (32, 32), library="transformers", target="vlm",
                            tags=("matrix",), suite=False),
        "hf_paligemma": Example(_paligemma, (32, 32), library="transformers", target="vlm",
                                tags=("matrix",), suite=False),
        "hf_gemma3": Example(_gemma3, (32, 32), library="transformers", target="vlm",
                             tags=("matrix",), suite=False),
    })
class HFEmbeddingAdapter(HFViTBase):
    """Canonical view of a Hugging Face CLIP / SigLIP vision tower (never modified).

    Its output is the image embedding (:attr:`embedding` is ``True``); explain it with a
    vector target: ``GAE(model).attribute(pixel_values, target=text_embedding)``.
    """

    embedding = True

    def __init__(self, model: ModelTree) -> None:
        self.model = model
        name = type(model).__name__
        self.backbone = vision_tower(model)
        cfg = self.config
        self.layers = self.backbone.encoder.layers
        self.blocks = encoder_blocks(self.layers, cfg, name)
        self.in_chans = int(cfg.num_channels)
        self.siglip = not hasattr(self.backbone.embeddings, "class_embedding")
        self.num_prefix = 0 if self.siglip else 1
        self.interpolates = True
        norm = _norm(self.backbone.post_layernorm, f"{name}.post_layernorm")
        if self.siglip:
            head = getattr(self.backbone, "head", None)
            if head is None or not getattr(self.backbone, "use_head", True):
                # PaliGemma's tower (vision_use_head=False): no embedding of its own; the
                # patch mean of its final-normed tokens stands for one (our choice)
                self.readout = "avg"
                self.head = HeadParts(norm, None, (("avg", None, None),))
            else:
                self.readout = "map"
                self.head = HeadParts(norm, None, (("map", None, None),),
                                      attn_pool=siglip_pool(head, f"{name}.head"))
        else:
            self.readout = "token"
            proj = getattr(model, "visual_projection", None)
            self.head = HeadParts(norm, None, ((0, None if proj is None else proj.weight,
                                                None),))

    def refresh(self) -> None:
        """Nothing is sliced but the pool's ``in_proj_weight``: re-read it after
        ``model.to(...)``."""
        pool = self.head.attn_pool
        if pool is not None and cast(Tensor, pool.q_weight).data_ptr() != \
                self.backbone.head.attention.in_proj_weight.data_ptr():
            self.head = dataclasses.replace(self.head, attn_pool=siglip_pool(
                self.backbone.head, f"{type(self.model).__name__}.head"))

    def embed(self, inputs: Tensor, ops: Ops | None = None) -> Tensor:
        """The model's ``embeddings`` then CLIP's ``pre_layrnorm``; with ``ops`` the patch
        projection as in :meth:`HFViTBase.embed` and ``pre_layrnorm`` as ``ops.norm``."""
        x = super().embed(inputs, ops)
        pre = getattr(self.backbone, "pre_layrnorm", None)
        if pre is None:
            return x
        if ops is None:
            return pre(x)
        return ops.norm(x, _norm(pre, f"{type(self.model).__name__}.pre_layrnorm"))

    def embedding_norms(self) -> tuple[str, ...]:
        """CLIP's ``pre_layrnorm`` (SigLIP has none)."""
        return ("pre_layrnorm",) if getattr(self.backbone, "pre_layrnorm", None) is not None \
            else ()

    def model_outputs(self, inputs: Tensor) -> Tensor:
        kw = self._size_kwargs(inputs)
        if hasattr(self.model, "get_image_features"):  # the dual CLIPModel / SiglipModel
            out = self.model.get_image_features(pixel_values=inputs, **kw)
            return out if isinstance(out, Tensor) else out.pooler_output
        out = self.model(pixel_values=inputs, **kw)
        emb = getattr(out, "image_embeds", None)
        if emb is None and out.pooler_output is None:  # a head-less SigLIP tower
            return out.last_hidden_state.mean(1)
        return out.pooler_output if emb is None else emb

    @property
    def config(self) -> Any:
        """The vision configuration (``vision_config`` of a dual CLIP/SigLIP model)."""
        return getattr(self.model.config, "vision_config", self.model.config)

    def is_random(self) -> bool:
        cfg = self.config
        return self.model.training and getattr(cfg, "attention_dropout", 0) > 0

    def parameter_stages(self) -> list[list[nn.Parameter]]:
        bb = self.backbone
        heads = [bb.post_layernorm, getattr(bb, "head", None),
                 getattr(self.model, "visual_projection", None)]
        stages = [[p for mod in heads if mod is not None for p in mod.parameters()]]
        stages += [list(layer.parameters()) for layer in reversed(self.layers)]
        return stages


CLASSIFIERS = ("CLIPForImageClassification", "SiglipForImageClassification")


@register_family(
    is_hf_clip_classifier,
    name="hf_clip_classifier",
    supports="Hugging Face CLIPForImageClassification, SiglipForImageClassification",
    tags=("classifier", "vlm-tower", "variable-size"),
    notes=("`CLIPForImageClassification` (patch mean of the tower's last tokens, no final norm), "
           "`SiglipForImageClassification` (mean of every token after `post_layernorm`): ✅ class "
           "targets through the model's own pooling and `classifier` (forward equals the model's "
           "to 1e-12, CLIP's at other sizes through its interpolated positions)"),
    examples={
        # a vision config wrapped in the dual config; CLIP's at a non-native size
        "hf_clip_cls": Example(hf_builder("CLIPForImageClassification", "CLIPVisionConfig",
                                          dual="CLIPConfig"), (24, 40),
                               library="transformers"),
        "hf_siglip_cls": Example(hf_builder("SiglipForImageClassification",
                                            "SiglipVisionConfig", dual="SiglipConfig"),
                                 (32, 32), library="transformers"),
    })
class HFCLIPClassifierAdapter(HFEmbeddingAdapter):
    """Canonical view of a Hugging Face ``CLIPForImageClassification`` or
    ``SiglipForImageClassification``: the vision tower, its mean pooling and the linear
    ``classifier`` (never modified).

    Verified in the installed transformers (their ``forward``):

    - ``CLIPForImageClassification`` averages the patch rows of the tower's
      ``last_hidden_state`` (CLS excluded) with **no** final norm (CLIP's
      ``post_layernorm`` only normalises the pooled CLS row, which the classifier does not
      read): ``readout="avg"`` without a norm;
    - ``SiglipForImageClassification`` averages all rows of ``last_hidden_state`` (no
      prefix token), which is after ``post_layernorm``; the attention-pool ``head`` of the
      tower is computed by the model but unused: ``readout="avg"`` after the norm.

    A classifier built with ``num_labels=0`` (``nn.Identity``) outputs the pooled
    embedding and is explained with vector targets.
    """

    def __init__(self, model: ModelTree) -> None:
        super().__init__(model)
        name = type(model).__name__
        clf = model.classifier
        if isinstance(clf, nn.Identity):
            self.embedding, weight, bias = True, None, None
        elif isinstance(clf, nn.Linear):
            self.embedding, weight, bias = False, clf.weight, clf.bias
        else:
            raise TypeError(f"{name}.classifier is {type(clf).__name__}; captum_vit needs "
                            "its linear classifier (or none, num_labels=0)")
        norm = _norm(self.backbone.post_layernorm, f"{name}.post_layernorm") \
            if self.siglip else None
        self.readout = "avg"
        self.head = HeadParts(norm, None, (("avg", weight, bias),))

    def refresh(self) -> None:
        """Nothing is sliced: the parts are the model's own parameters."""

    def model_outputs(self, inputs: Tensor) -> Tensor:
        return self.model(pixel_values=inputs, **self._size_kwargs(inputs)).logits

    def parameter_stages(self) -> list[list[nn.Parameter]]:
        """Head stage (the classifier, and SigLIP's ``post_layernorm``), then the layers
        ``L-1 .. 0``; parameters the logits do not use (CLIP's ``post_layernorm``,
        SigLIP's attention-pool head) belong to no stage."""
        head = [self.model.classifier] + ([self.backbone.post_layernorm] if self.siglip
                                          else [])
        stages = [[p for mod in head for p in mod.parameters()]]
        return stages + [list(layer.parameters()) for layer in reversed(self.layers)]
