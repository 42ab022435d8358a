"""Adapter for Hugging Face transformers' VideoMAE (``VideoMAEForVideoClassification``,
``VideoMAEModel``; Tong et al., "VideoMAE: Masked Autoencoders are Data-Efficient Learners
for Self-Supervised Video Pre-Training", NeurIPS 2022).

Only this file knows VideoMAE's attribute names. Verified in the installed transformers
(5.x, ``models/videomae/modeling_videomae.py``):

- **Inputs** are videos ``pixel_values`` [B, T, C, H, W] (frames before channels);
  ``VideoMAEPatchEmbeddings`` permutes them to [B, C, T, H, W] and applies a ``Conv3d``
  with kernel = stride = ``(tubelet_size, patch_size, patch_size)``, then flattens the
  ``(T / t, H / p, W / p)`` grid in that order: tokens are ordered (frame slice, row,
  column). The image size is fixed (the model raises on another one) and so is the frame
  count (the position table has ``num_frames / t · (H / p) · (W / p)`` rows).
- **Position embeddings**: a fixed sinusoid table (a plain tensor, not a parameter),
  added to the patch embeddings; no class token, no prefix rows (``num_prefix = 0``); no
  embedding dropout. The adapter calls the model's own ``embeddings`` module, so a kept
  token under true token removal keeps its own row of that table.
- **Layers** are ViT layers in transformers' older naming (``layernorm_before``,
  ``attention.attention.{query, key, value}``, ``attention.output.dense``,
  ``layernorm_after``, ``intermediate.dense``, ``output.dense``): pre-LayerNorm, the key
  projection without bias and query / value biases only when ``qv_bias`` (the canonical
  parts take ``k_bias=None``); no LayerScale (``init_values`` is not read by
  ``VideoMAELayer``). The parts are read by :func:`captum_vit.adapters.families._hf.layer_parts`.
- **Head** (``VideoMAEForVideoClassification``): with ``use_mean_pooling`` the backbone
  has no final LayerNorm and the classifier reads ``fc_norm(mean of all tokens)``
  (``fc_norm`` built with LayerNorm's default eps 1e-5): readout ``"avg"``; without it
  the backbone's final ``layernorm`` is applied and the classifier reads row 0, which is
  the *first tubelet* (there is no class token): readout ``"token"``.
- **VideoMAEModel** (head-less, ``embedding = True``): its output here is the pooled
  vector of the classifier's convention, before any classifier: the mean of
  ``last_hidden_state`` over the tokens with ``use_mean_pooling`` (no ``fc_norm``: it
  belongs to the classifier), else row 0 of ``last_hidden_state`` (after its final
  ``layernorm``); a choice of captum_vit. A classifier built with ``num_labels=0`` outputs
  its own ``logits``, ``fc_norm`` of the mean (an ``nn.Identity`` classifier).

Maps are returned per tubelet, as for every
:class:`~captum_vit.adapters.families._hf.HFVideoAdapter`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from captum_vit.adapters._typing import ModelTree
from captum_vit.adapters.catalog import Example, register_family
from captum_vit.adapters.families._examples import library, transformers_model
from captum_vit.adapters.families._hf import (
    HFVideoAdapter,
    is_transformers_model,
    layer_parts,
    linear_head,
    pair,
)
from captum_vit.adapters.ops import Ops
from captum_vit.adapters.parts import HeadParts
from captum_vit.adapters.parts import layer_norm_parts as _norm

CLASSES = ("VideoMAEForVideoClassification", "VideoMAEModel")


def is_hf_videomae(model: nn.Module) -> bool:
    """``True`` for the Hugging Face VideoMAE models in :data:`CLASSES` (transformers is
    never imported for other models).

    Args:
        model (nn.Module): any model.

    Returns:
        bool: whether :class:`HFVideoMAEAdapter` applies.
    """
    return is_transformers_model(model, CLASSES)


def _example(cls_name: str, **extra: Any) -> Callable[..., nn.Module]:
    """A builder of a small Hugging Face VideoMAE (4 frames of 16x16, 2 frame slices of
    2 x 2 tubelets: t = 2, p = 8; width 32, 4 heads); ``extra`` and build-time
    ``overrides`` go to the ``VideoMAEConfig`` (e.g. ``tubelet_size=1``)."""
    def build(*, seed: int = 0, depth: int = 3, dtype: torch.dtype = torch.float64,
              num_classes: int = 5, **overrides: Any) -> nn.Module:
        transformers = library("transformers")
        kwargs: dict[str, Any] = dict(
            image_size=16, patch_size=8, num_channels=3, num_frames=4, tubelet_size=2,
            hidden_size=32, num_hidden_layers=depth, num_attention_heads=4,
            intermediate_size=64, num_labels=num_classes, qv_bias=True, layer_norm_eps=1e-6)
        kwargs.update(extra)
        kwargs.update(overrides)
        return transformers_model(cls_name, transformers.VideoMAEConfig(**kwargs), seed, dtype)

    return build


@register_family(
    is_hf_videomae,
    supports="Hugging Face VideoMAEForVideoClassification and VideoMAEModel (videos "
             "[B, T, C, H, W])",
    tags=("classifier", "embedding", "video"),
    notes=("Videos `[B, T, C, H, W]`: tubelet tokens of `tubelet_size` frames × `patch_size`², "
           "the fixed sinusoid table, mean pooling + `fc_norm` or the first-tubelet row; fixed "
           "`num_frames` and `image_size`: ✅ maps per tubelet: `output=\"tokens\"` `[B, "
           "F·gh·gw]`, `\"grid\"` `[B, 1, F, gh, gw]`, pixels shaped like the video (a one-slice "
           "video's maps equal a timm twin's to 1e-10, every method; token removal equals the "
           "model's own `bool_masked_pos`); RISE and ViT-CX mask tubelets (token removal); "
           "deletion/insertion with token removal or pixel baselines over tubelets; LRP "
           "`at=\"pixels\"` through the tubelet projection; `viz.plot_video` writes a GIF/MP4 "
           "or a PNG contact sheet — "
           "refused: RISE/ViT-CX pixel masks, the localisation metrics, the removal metrics' "
           "`unit=\"pixel\"`"),
    examples={
        "hf_videomae": Example(_example("VideoMAEForVideoClassification",
                                        use_mean_pooling=True), (4, 16, 16),
                               library="transformers"),
        # first-tubelet readout after the final LayerNorm; the head-less backbone
        "hf_videomae_token": Example(_example("VideoMAEForVideoClassification",
                                              use_mean_pooling=False), (4, 16, 16),
                                     library="transformers", suite=False),
        "hf_videomae_model": Example(_example("VideoMAEModel", use_mean_pooling=True),
                                     (4, 16, 16), library="transformers", target="embedding",
                                     suite=False),
    })
class HFVideoMAEAdapter(HFVideoAdapter):
    """Canonical view of a Hugging Face ``VideoMAEForVideoClassification`` or
    ``VideoMAEModel`` (never modified): the ViT on tubelet tokens.

    Inputs are videos [B, T, C, H, W] of the model's ``num_frames`` and ``image_size``.
    A classifier built with ``num_labels=0`` (an ``nn.Identity`` classifier) and a
    ``VideoMAEModel`` output their pooled vector and take vector targets
    (:class:`captum_vit.targets.EmbeddingTarget`).

    Args:
        model (nn.Module): one of the classes of :data:`CLASSES`.

    Raises:
        TypeError: a layer layout or head the adapter does not know.

    Examples::

        >>> import transformers
        >>> from captum_vit.adapters import adapt
        >>> cfg = transformers.VideoMAEConfig(image_size=32, patch_size=8, num_frames=4,
        ...     tubelet_size=2, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        ...     intermediate_size=64, num_labels=5)
        >>> a = adapt(transformers.VideoMAEForVideoClassification(cfg).eval())
        >>> a.layout(torch.zeros(1, 4, 3, 32, 32)).grid   # 2 frame slices of 4 x 4
        (8, 4)
    """

    def __init__(self, model: ModelTree) -> None:
        self.model = model
        name = type(model).__name__
        self.backbone = getattr(model, "videomae", model)
        cfg = model.config
        self.layers = self.backbone.encoder.layer
        if len(self.layers) == 0:
            raise TypeError(f"{name} has no transformer layers")
        self.blocks = [layer_parts(layer, int(cfg.num_attention_heads),
                                    f"{name}.encoder.layer[{i}]")
                       for i, layer in enumerate(self.layers)]
        self.in_chans = int(cfg.num_channels)
        self.num_prefix = 0
        self.tubelet = int(cfg.tubelet_size)
        self.patch_size = pair(cfg.patch_size)
        self.read_classifier("VideoMAE")
        self.head = self._head()

    def _head(self) -> HeadParts:
        """Final ``layernorm`` or ``fc_norm`` on the token mean, and the classifier; sets
        :attr:`readout`."""
        model, name = self.model, type(self.model).__name__
        classifier = getattr(model, "classifier", None)
        w, b = linear_head(classifier)
        final = self.backbone.layernorm
        fc_norm = getattr(model, "fc_norm", None)
        if final is None:  # use_mean_pooling: the mean of all tokens (no class token)
            self.readout = "avg"
            fc = None if fc_norm is None else _norm(fc_norm, f"{name}.fc_norm")
            return HeadParts(None, fc, (("avg", w, b),))
        self.readout = "token"  # row 0: the first tubelet
        return HeadParts(_norm(final, f"{name}.videomae.layernorm"), None, ((0, w, b),))

    def check_inputs(self, inputs: Tensor) -> None:
        super().check_inputs(inputs)
        self.check_fixed_video(inputs)

    def embed(self, inputs: Tensor, ops: Ops | None = None) -> Tensor:
        """The model's own ``embeddings(pixel_values, None)`` (tubelet projection plus the
        sinusoid table); with ``ops`` as :meth:`HFVideoAdapter.tubelet_embed
        <captum_vit.adapters.families._hf.HFVideoAdapter.tubelet_embed>`."""
        emb = self.backbone.embeddings
        return self.tubelet_embed(inputs, ops, lambda x: emb(x, None),
                                  emb.patch_embeddings.projection)

    def model_outputs(self, inputs: Tensor) -> Tensor:
        """The logits; for an embedding model the pooled vector (module docstring)."""
        if hasattr(self.model, "classifier"):  # an Identity classifier: fc_norm's output
            return self.model(pixel_values=inputs).logits
        hidden = self.backbone(pixel_values=inputs).last_hidden_state
        return hidden.mean(1) if self.readout == "avg" else hidden[:, 0]

    def parameter_stages(self) -> list[list[nn.Parameter]]:
        m = self.model
        return self.head_then_layers(self.backbone.layernorm, getattr(m, "fc_norm", None),
                                     getattr(m, "classifier", None))
