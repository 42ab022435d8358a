"""Adapter for Hugging Face transformers' BEiT and data2vec-vision image classifiers
(``BeitForImageClassification``, ``Data2VecVisionForImageClassification``).

Only this file knows their attribute names. Verified in the installed transformers:

- **Blocks**: pre-LN layers (``layernorm_before`` / ``layernorm_after``) with separate q, k,
  v projections (``k`` without bias), read as in :mod:`~captum_vit.adapters.families._hf`
  (BEiT: ``attention.{q,k,v,o}_proj`` and ``mlp.{fc1,fc2}``; data2vec-vision keeps the
  transformers-4 names ``attention.attention.{query,key,value}``, ``attention.output.dense``,
  ``intermediate.dense``, ``output.dense``). LayerScale is ``lambda_1`` / ``lambda_2``
  (absent, or the float ``1.0`` in BEiT, when ``layer_scale_init_value`` is 0).
- **Relative position bias** (Bao et al., BEiT, ICLR 2022): each layer's own
  (BEiT ``relative_position_bias``, data2vec ``attention.attention.relative_position_bias``)
  and/or one shared by all layers (BEiT ``shared_position_bias``, data2vec
  ``encoder.relative_position_bias``), added to the attention logits before the softmax.
  The bias is the model's own module called as the model calls it for the configured
  image size; it enters :meth:`BlockParts.attention` as ``attn_bias``, as for timm's
  BEiT (:mod:`~captum_vit.adapters.families.timm_beit`): a constant inside the softmax, and a kept
  subset ``S`` under token removal uses the sub-matrix ``B[:, S, S]``.
- **Readout**: with ``use_mean_pooling`` (the fine-tuning default) the backbone's
  ``layernorm`` is the identity and the pooler averages the patch rows (CLS excluded)
  then applies ``pooler.layernorm``: ``readout="avg"`` with that norm after the pooling;
  otherwise ``layernorm`` on every row and the CLS row: ``readout="token"``.

The models build the bias for any input size (interpolating the table); the adapter
explains inputs of the configured ``image_size`` (other sizes are refused before any
work: resize the images).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from captum_vit.adapters._typing import ModelTree
from captum_vit.adapters.catalog import Example, register_family
from captum_vit.adapters.families._examples import hf_builder
from captum_vit.adapters.families._hf import HFViTBase, is_transformers_model, pair
from captum_vit.adapters.ops import Ops, patch_projection
from captum_vit.adapters.parts import HeadParts
from captum_vit.adapters.parts import layer_norm_parts as _norm

CLASSES = ("BeitForImageClassification", "Data2VecVisionForImageClassification")


def _own_bias(layer: ModelTree) -> nn.Module | None:
    """The layer's own relative position bias module (BEiT or data2vec naming)."""
    own = getattr(layer, "relative_position_bias", None)
    if own is None:
        own = getattr(getattr(getattr(layer, "attention", None), "attention", None),
                      "relative_position_bias", None)
    return own


def _bias_fn(modules: list[nn.Module], window: tuple[int, int],
             n: int) -> Callable[[], Tensor] | None:
    """``() -> [1, H, N, N]``: the sum of the bias ``modules`` (the model's own code) for
    the token grid ``window``, ``None`` without any."""
    if not modules:
        return None

    def bias() -> Tensor:
        out = modules[0](window, False, dim_size=n)
        for m in modules[1:]:
            out = out + m(window, False, dim_size=n)
        return out

    return bias


def _layer_scale(v: object) -> Tensor | None:
    return v if isinstance(v, Tensor) else None  # absent or the float 1.0


def is_hf_beit(model: nn.Module) -> bool:
    """``True`` for the Hugging Face classifiers in :data:`CLASSES`."""
    return is_transformers_model(model, CLASSES)


@register_family(
    is_hf_beit,
    supports="Hugging Face BeitForImageClassification, Data2VecVisionForImageClassification "
             "(at the configured image_size)",
    tags=("classifier",),
    notes=("Relative position bias per layer and/or shared, absolute positions or none, "
           "LayerScale `lambda_1`/`lambda_2` or none, patch mean + `pooler.layernorm` or CLS; "
           "the configured `image_size`: ✅ (maps equal a timm `Beit` twin's to 1e-10, every "
           "method) — refused: other input sizes"),
    examples={
        # each layer's relative position bias, LayerScale, patch mean + pooler norm
        "hf_beit": Example(hf_builder("BeitForImageClassification", "BeitConfig",
                                      use_relative_position_bias=True, use_mean_pooling=True,
                                      layer_scale_init_value=0.5), (32, 32),
                           library="transformers"),
        # one shared bias, absolute positions, CLS after the final norm
        "hf_data2vec": Example(hf_builder("Data2VecVisionForImageClassification",
                                          "Data2VecVisionConfig",
                                          use_shared_relative_position_bias=True,
                                          use_absolute_position_embeddings=True,
                                          use_mean_pooling=False, layer_scale_init_value=0.0),
                               (32, 32), library="transformers"),
    })
class HFBeitAdapter(HFViTBase):
    """Canonical view of a Hugging Face BEiT / data2vec-vision classifier (never
    modified)."""

    def __init__(self, model: ModelTree) -> None:
        if not isinstance(model.classifier, nn.Linear):
            raise TypeError(f"{type(model).__name__}.classifier is "
                            f"{type(model.classifier).__name__}; captum_vit needs a linear "
                            "classifier (build the model with num_labels > 0)")
        super().__init__(model)
        bb, cfg = self.backbone, self.config
        ph, pw = pair(cfg.patch_size)
        h, w = self.input_shape[1]
        window, n = (h // ph, w // pw), (h // ph) * (w // pw) + 1
        shared = getattr(bb, "shared_position_bias", None)
        if shared is None:
            shared = getattr(getattr(bb, "encoder", None), "relative_position_bias", None)
        self.blocks = [dataclasses.replace(
            parts, ls1=_layer_scale(getattr(layer, "lambda_1", None)),
            ls2=_layer_scale(getattr(layer, "lambda_2", None)),
            attn_bias=_bias_fn([m for m in (_own_bias(layer), shared) if m is not None],
                               window, n))
            for parts, layer in zip(self.blocks, self.layers, strict=True)]

    def _head(self) -> HeadParts:
        """``pooler.layernorm`` after the patch mean, or ``layernorm`` and the CLS row."""
        name = type(self.model).__name__
        clf = self.model.classifier
        pool_norm = getattr(getattr(self.backbone, "pooler", None), "layernorm", None)
        if pool_norm is not None:
            self.readout = "avg"
            return HeadParts(None, _norm(pool_norm, f"{name}.pooler.layernorm"),
                             (("avg", clf.weight, clf.bias),))
        self.readout = "token"
        return HeadParts(_norm(self.backbone.layernorm, f"{name}.layernorm"), None,
                         ((0, clf.weight, clf.bias),))

    def check_inputs(self, inputs: Tensor) -> None:
        super().check_inputs(inputs)
        size = tuple(int(s) for s in inputs.shape[-2:])
        if size != self.input_shape[1]:
            raise ValueError(
                f"inputs size {size} differs from the model's image_size "
                f"{self.input_shape[1]}; captum_vit explains BEiT / data2vec-vision at the "
                "configured size (its relative position bias is built for that grid): "
                "resize the images")

    def embed(self, inputs: Tensor, ops: Ops | None = None) -> Tensor:
        """The model's own ``embeddings`` (data2vec-vision's returns ``(tokens, grid)``:
        the tokens); with ``ops`` the patch projection as ``ops.linear`` added as
        ``p - p.detach()`` to the embedding of the detached images (exactly the model's
        values, every pixel gradient through ``ops.linear``; :meth:`HFViTBase.embed`)."""
        emb = self.backbone.embeddings
        if ops is None:
            out = emb(inputs)
            return out[0] if isinstance(out, tuple) else out
        x = self.embed(inputs.detach())
        name = f"{type(self.model).__name__}.embeddings.patch_embeddings.projection"
        p = patch_projection(inputs, emb.patch_embeddings.projection, ops, name).flatten(1, 2)
        return x + F.pad(p - p.detach(), (0, 0, x.shape[1] - p.shape[1], 0))

    def model_outputs(self, inputs: Tensor) -> Tensor:
        return self.model(pixel_values=inputs).logits

    def parameter_stages(self) -> list[list[nn.Parameter]]:
        """Head stage (final norm, pooler norm, classifier), then layers ``L-1 .. 0``; a
        shared relative position bias, like the embedding, belongs to no stage."""
        bb = self.backbone
        head = [bb.layernorm, getattr(bb, "pooler", None), self.model.classifier]
        stages = [[p for mod in head if mod is not None for p in mod.parameters()]]
        return stages + [list(layer.parameters()) for layer in reversed(self.layers)]
