"""Adapter for Hugging Face transformers' head-less ViT backbones: ``ViTModel``,
``DeiTModel``, ``Dinov2Model`` and ``Dinov2WithRegistersModel`` (what
``AutoModel.from_config`` builds for their configurations), and ``Dinov2Backbone`` (the
backbone of ``DPTForDepthEstimation`` / ``DepthAnythingForDepthEstimation``).

They output an image embedding (``embedding = True``): their targets are vectors
(:class:`captum_vit.targets.EmbeddingTarget`), scored against the model's own
``pooler_output``. Verified in the installed transformers (5.x, ``modeling_vit.py``,
``modeling_deit.py``, ``modeling_dinov2.py``, ``modeling_dinov2_with_registers.py``):

- **ViTModel, DeiTModel**: ``sequence_output = layernorm(last hidden state)``;
  ``pooler_output = pooler(sequence_output)`` where ``ViTPooler`` / ``DeiTPooler`` is
  ``activation(dense(sequence_output[:, 0]))``: a Linear ``hidden_size ->
  pooler_output_size`` and ``ACT2FN[config.pooler_act]`` (``"tanh"`` by default) on the
  CLS row (for DeiT too: the pooler reads row 0, not the distillation token). The pooler
  exists when the model is built with ``add_pooling_layer=True``, the constructor's
  default (so ``AutoModel.from_config`` and ``from_pretrained`` have it); the classifiers
  build their backbone with ``add_pooling_layer=False``, and then ``pooler_output`` is
  ``None``. The pooler is the head's representation layer
  (:class:`~captum_vit.adapters.parts.PreLogitsHeadParts`, the mechanism of torchvision's
  ``representation_size`` head) with no classifier after it. **Without a pooler** the
  embedding explained here is the CLS row after the final LayerNorm,
  ``last_hidden_state[:, 0]`` (a choice of captum_vit: it is what the classifiers read).
- **Dinov2Model, Dinov2WithRegistersModel**: ``pooler_output = sequence_output[:, 0, :]``,
  the CLS row after the final LayerNorm (registers and patches are not read).
- **Dinov2Backbone** (``BackboneMixin``): the same embeddings, encoder and final
  ``layernorm`` as ``Dinov2Model``, no pooler; its forward returns ``feature_maps``, the
  hidden states of ``out_features`` (``hidden_states[k]`` for stage ``"stage{k}"``,
  ``hidden_states[0]`` the embedding; after ``layernorm`` when ``config.apply_layernorm``,
  without CLS and on the patch grid when ``config.reshape_hidden_states``). It has no
  pooled output of its own: **the embedding explained here is Dinov2Model's**
  ``pooler_output``, the CLS row of ``layernorm(hidden_states[-1])`` (a choice of
  captum_vit; :meth:`HFBackboneAdapter.model_outputs` computes it from the model's own
  forward with ``output_hidden_states=True`` and its own ``layernorm``, whatever
  ``out_features`` says). Its depth heads are explained with
  :class:`captum_vit.targets.DepthTarget`, which reads the ``out_features`` block outputs.

The blocks, embeddings and input sizes are those of the classifiers
(:mod:`captum_vit.adapters.families._hf`): the model's own ``embeddings`` (position embeddings
interpolated by the model's code at other sizes), both transformers layouts, any
attention implementation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from captum_vit.adapters.catalog import Example, register_family
from captum_vit.adapters.families._examples import hf_builder, library, transformers_model
from captum_vit.adapters.families._hf import HFViTBase, is_transformers_model
from captum_vit.adapters.parts import HeadParts, PreLogitsHeadParts
from captum_vit.adapters.parts import layer_norm_parts as _norm

CLASSES = ("ViTModel", "DeiTModel", "Dinov2Model", "Dinov2WithRegistersModel",
           "Dinov2Backbone")


def is_hf_backbone(model: nn.Module) -> bool:
    """``True`` for the Hugging Face backbones in :data:`CLASSES` (transformers is never
    imported for other models).

    Args:
        model (nn.Module): any model.

    Returns:
        bool: whether :class:`HFBackboneAdapter` applies.
    """
    return is_transformers_model(model, CLASSES)


def _depth_example(cls_name: str) -> Callable[..., nn.Module]:
    """A builder of a small DPT (``DPTForDepthEstimation``: 5 backbone blocks, x_1 .. x_4
    read, the CLS projected into the patches) or Depth Anything (4 blocks, all read) on a
    DINOv2 backbone (28 x 28 px, patch 7); its depth is fixed, so ``depth`` is not used."""
    def build(*, seed: int = 0, depth: int = 3, dtype: torch.dtype = torch.float64,
              num_classes: int = 5, **overrides: Any) -> nn.Module:
        transformers = library("transformers")
        dpt = cls_name == "DPTForDepthEstimation"
        backbone = transformers.Dinov2Config(
            image_size=28, patch_size=7, num_channels=3, hidden_size=32,
            num_hidden_layers=5 if dpt else 4, num_attention_heads=4,
            intermediate_size=64, layer_norm_eps=1e-6, layerscale_value=0.5,
            apply_layernorm=True, reshape_hidden_states=False, out_indices=[1, 2, 3, 4])
        common: dict[str, Any] = dict(backbone_config=backbone,
                                      neck_hidden_sizes=[8, 16, 16, 32], fusion_hidden_size=16,
                                      reassemble_factors=[4, 2, 1, 0.5], **overrides)
        if dpt:
            cfg = transformers.DPTConfig(is_hybrid=False, hidden_size=32,
                                         readout_type="project", **common)
        else:
            cfg = transformers.DepthAnythingConfig(patch_size=7, head_hidden_size=8,
                                                   reassemble_hidden_size=32, **common)
        return transformers_model(cls_name, cfg, seed, dtype)

    return build


@register_family(
    is_hf_backbone,
    supports="the head-less Hugging Face ViTModel, DeiTModel, Dinov2(WithRegisters)Model, "
             "Dinov2Backbone (DPT and Depth Anything's backbone)",
    tags=("embedding", "dense", "variable-size"),
    notes=("Head-less `ViTModel`, `DeiTModel`, `Dinov2Model`, `Dinov2WithRegistersModel` (also "
           "via `AutoModel`): ✅ with vector targets on the model's own `pooler_output`: ViT/DeiT "
           "`tanh(dense(CLS))` (their pooler, `add_pooling_layer=True` by default), else — and "
           "for DINOv2 — the CLS row after the final norm; a `ViTModel` with a classifier's "
           "backbone and `EmbeddingTarget(W[c], similarity=\"dot\", bias=b[c])` gives the "
           "classifier's maps of class `c` (1e-10, every method). `Dinov2Backbone` (the backbone "
           "of `DPTForDepthEstimation`, `DepthAnythingForDepthEstimation`; the depth target in "
           "`adapters/hf_depth.py`): ✅ with vector targets on Dinov2Model's `pooler_output` (CLS "
           "after the final norm), and `DepthTarget` (depth of a region through the model's own "
           "neck and head: PLUS, SkipPLUS, FullGrad+ refuse its several blocks, TIS its token "
           "rows)"),
    examples={
        # ViTModel's tanh pooler on CLS at a non-native size (interpolated positions)
        "hf_vit_model": Example(hf_builder("ViTModel", "ViTConfig"), (24, 40),
                                library="transformers", target="embedding"),
        "hf_deit_model": Example(hf_builder("DeiTModel", "DeiTConfig"), (32, 32),
                                 library="transformers", target="embedding"),
        "hf_dinov2_reg_model": Example(hf_builder("Dinov2WithRegistersModel",
                                                  "Dinov2WithRegistersConfig",
                                                  num_register_tokens=2), (32, 32),
                                       library="transformers", target="embedding"),
        # support-matrix columns: depth models, their backbones explained through DepthTarget
        "hf_dpt": Example(_depth_example("DPTForDepthEstimation"), (28, 28),
                          library="transformers", target="depth", tags=("matrix",),
                          suite=False),
        "hf_depth_anything": Example(_depth_example("DepthAnythingForDepthEstimation"),
                                     (28, 28), library="transformers", target="depth",
                                     tags=("matrix",), suite=False),
    })
class HFBackboneAdapter(HFViTBase):
    """Canonical view of a Hugging Face ``ViTModel`` / ``DeiTModel`` / ``Dinov2Model`` /
    ``Dinov2WithRegistersModel`` / ``Dinov2Backbone`` (never modified).

    Its output is the model's own ``pooler_output`` (the CLS row after the final norm when
    a ViT/DeiT has no pooler, and for a ``Dinov2Backbone``); explain it with a vector
    target:
    ``GAE(model).attribute(pixel_values, target=EmbeddingTarget(t))``.

    Args:
        model (nn.Module): one of the classes of :data:`CLASSES`.

    Raises:
        TypeError: a pooler that is not ``activation(dense(CLS))``, or a layer layout the
            adapter does not know.

    Examples::

        >>> import transformers
        >>> from captum_vit.adapters import adapt
        >>> cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2,
        ...                              num_attention_heads=4, intermediate_size=64)
        >>> a = adapt(transformers.AutoModel.from_config(cfg).eval())
        >>> type(a).__name__, a.embedding, a.num_classes
        ('HFBackboneAdapter', True, 32)
    """

    embedding = True

    def _head(self) -> HeadParts:
        """Final ``layernorm``, the CLS row and the pooler (ViT, DeiT) when there is one;
        sets :attr:`readout`."""
        model = self.model
        name = type(model).__name__
        self.readout = "token"
        norm = _norm(model.layernorm, f"{name}.layernorm")
        pooler = getattr(model, "pooler", None)
        if pooler is None:
            return HeadParts(norm, None, ((0, None, None),))
        dense, act = getattr(pooler, "dense", None), getattr(pooler, "activation", None)
        if not isinstance(dense, nn.Linear) or not isinstance(act, nn.Module):
            raise TypeError(f"{name}.pooler is {type(pooler).__name__}; captum_vit supports "
                            "the pooler activation(dense(CLS)) of ViTPooler / DeiTPooler")
        return PreLogitsHeadParts(norm, None, ((0, None, None),),
                                  pre_logits=(dense.weight, dense.bias, act))

    def model_outputs(self, inputs: Tensor) -> Tensor:
        """The model's own ``pooler_output`` [B, D′] (``last_hidden_state[:, 0]`` when a
        ViT/DeiT has no pooler; for a ``Dinov2Backbone`` the CLS row of its own
        ``layernorm`` on the last of its forward's ``hidden_states``)."""
        if not hasattr(self.model, "pooler") and hasattr(self.model, "stage_names"):
            out = self.model(pixel_values=inputs, output_hidden_states=True)
            return self.model.layernorm(out.hidden_states[-1])[:, 0]
        out = self.model(pixel_values=inputs, **self._size_kwargs(inputs))
        pooled = out.pooler_output
        return out.last_hidden_state[:, 0] if pooled is None else pooled

    def parameter_stages(self) -> list[list[nn.Parameter]]:
        m = self.model
        head = [m.layernorm, getattr(m, "pooler", None)]
        stages = [[p for mod in head if mod is not None for p in mod.parameters()]]
        stages += [list(layer.parameters()) for layer in reversed(self.layers)]
        return stages
