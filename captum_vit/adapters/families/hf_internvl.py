"""Adapter for the vision tower of Hugging Face InternVL (``InternVLVisionModel``, the
``model.vision_tower`` of ``InternVLForConditionalGeneration``: InternViT).

Verified in the installed transformers (5.x, ``models/internvl/modeling_internvl.py``):

- **Embedding** (``InternVLVisionEmbeddings``): the patch ``Conv2d`` (stride = kernel), then
  ``[CLS, patches]`` plus the absolute position table (``use_absolute_position_embeddings``,
  the default; bicubic interpolation of the patch part by the model's own
  ``interpolate_pos_encoding`` whenever the grid is not the configured one). No register
  tokens; ``mask_token`` is used only with ``bool_masked_pos`` (never passed here).
- **Layer** (``InternVLVisionLayer``): pre-norm,
  ``x + λ1 ⊙ projection_layer(attn(layernorm_before(x)))`` then
  ``x + λ2 ⊙ fc2(act(fc1(layernorm_after(·))))`` (LayerScale ``lambda_1``/``lambda_2``
  are parameters of the layer itself); separate ``q_proj``/``k_proj``/``v_proj`` (bias per
  ``attention_bias``), softmax scale ``head_dim ** -0.5``. With ``use_qk_norm`` the
  queries and keys are RMS-normed over the **whole width** (``InternVLVisionRMSNorm`` of
  ``hidden_size``, computed in float32) *before* they are split into heads: the adapter
  applies the model's own modules to the heads put back side by side
  (:class:`WidthNorm`). ``norm_type="rms_norm"`` (InternViT-6B) makes both norms of every
  block an ``InternVLVisionRMSNorm`` (``layer_norm_eps``; the input cast to float32,
  normalised, cast back, times ``weight``): the adapter's block norms are then RMSNorm
  :class:`~captum_vit.adapters.parts.NormParts` computed in float32 as the model does
  (:func:`~captum_vit.adapters.parts.rms_norm_parts`). The final ``layernorm`` (only
  without ``use_mean_pooling``) stays an ``nn.LayerNorm`` under either ``norm_type``.
- **Output**: ``last_hidden_state = layernorm(encoder output)``, where ``layernorm`` is
  ``nn.Identity`` under ``use_mean_pooling=True`` (the default; the released InternVL
  checkpoints) and a LayerNorm otherwise; ``pooler_output`` is ``None`` (the docstring's
  "average of the patch tokens" is not computed by the model). The embedding explained
  here (our choice) is the mean of the patch rows of ``last_hidden_state`` under
  ``use_mean_pooling`` (CLS excluded), else its CLS row: :meth:`HFInternVLAdapter.model_outputs`
  computes it from the model's own forward. ``hidden_states[k]`` is the output of layer
  ``k`` (``hidden_states[0]`` the embedding), the adapter's ``x_k``.

Inside a VLM, :class:`captum_vit.targets.VLMAnswer` reads the tower's states the way
``InternVLModel.get_image_features`` does (:mod:`captum_vit.adapters.vlm_internvl`).
Twin: with LayerNorm, no qk-norm and ``use_mean_pooling=False`` the tower is a DINOv2
ViT (``Dinov2Model``) with copied weights: same forward and maps
(tests/families/test_hf_internvl.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from captum_vit.adapters._typing import ModelTree
from captum_vit.adapters.catalog import Example, register_family
from captum_vit.adapters.families._examples import VLM_IMAGE_ID, library, transformers_model
from captum_vit.adapters.families._hf import HFPatchGrid, has_config_dropout, is_transformers_model
from captum_vit.adapters.ops import Ops, patch_projection
from captum_vit.adapters.parts import BlockParts, HeadParts, NormParts, rms_norm_parts
from captum_vit.adapters.parts import layer_norm_parts as _norm

CLASSES = ("InternVLVisionModel",)


def is_hf_internvl(model: nn.Module) -> bool:
    """``True`` for Hugging Face ``InternVLVisionModel`` (transformers is never imported for
    other models).

    Args:
        model (nn.Module): any model.

    Returns:
        bool: whether :class:`HFInternVLAdapter` applies.
    """
    return is_transformers_model(model, CLASSES)


class WidthNorm:
    """InternVL's q/k norm, an RMSNorm over the whole width ``H·d``, applied to heads
    ``[B, H, n, d]``: the heads put side by side ``[B, n, H·d]``, the model's own module,
    split again. A ``q_norm`` / ``k_norm`` of :class:`BlockParts` (the LRP rules have no
    rule for it: AttnLRP and Chefer'21 refuse it by name)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, h: Tensor) -> Tensor:
        b, heads, n, d = h.shape
        y = self.module(h.transpose(1, 2).reshape(b, n, heads * d))
        return y.reshape(b, n, heads, d).transpose(1, 2)


def _block_norm(m: nn.Module, where: str, rms: bool) -> NormParts:
    """A block norm: ``nn.LayerNorm``, or ``InternVLVisionRMSNorm`` (``rms``; computed in
    float32 as the model does)."""
    return rms_norm_parts(m, where, torch.float32) if rms else _norm(m, where)


def _layer(layer: ModelTree, num_heads: int, where: str, rms: bool = False) -> BlockParts:
    """The canonical parts of one ``InternVLVisionLayer`` (``rms``: RMSNorm block norms,
    ``norm_type="rms_norm"``)."""
    att, mlp = layer.attention, layer.mlp
    q, k, v, o = att.q_proj, att.k_proj, att.v_proj, att.projection_layer
    head_dim = q.weight.shape[0] // num_heads
    q_norm: Callable[[Tensor], Tensor] = nn.Identity()
    k_norm: Callable[[Tensor], Tensor] = nn.Identity()
    if not isinstance(att.q_norm, nn.Identity):
        q_norm, k_norm = WidthNorm(att.q_norm), WidthNorm(att.k_norm)
    return BlockParts(
        norm1=_block_norm(layer.layernorm_before, f"{where}.layernorm_before", rms),
        q_weight=q.weight, k_weight=k.weight, v_weight=v.weight,
        q_bias=q.bias, k_bias=k.bias, v_bias=v.bias,
        num_heads=num_heads, head_dim=head_dim, scale=att.scale,
        q_norm=q_norm, k_norm=k_norm,
        proj_weight=o.weight, proj_bias=o.bias, ls1=layer.lambda_1,
        norm2=_block_norm(layer.layernorm_after, f"{where}.layernorm_after", rms),
        fc1_weight=mlp.fc1.weight, fc1_bias=mlp.fc1.bias, act=mlp.activation_fn,
        fc2_weight=mlp.fc2.weight, fc2_bias=mlp.fc2.bias, ls2=layer.lambda_2,
    )


def internvl_tower_example(qk_norm: bool = False, mean_pooling: bool = True
                           ) -> Callable[..., nn.Module]:
    """A builder of a small ``InternVLVisionModel`` (32 px, patch 8, width 32, 4 heads,
    q/k/v biases), LayerScale and CLS drawn far from their initial values; ``qk_norm``:
    InternViT-6B's q/k RMSNorm; ``mean_pooling=False``: a final LayerNorm and the CLS
    row as the embedding."""
    def build(*, seed: int = 0, depth: int = 3, dtype: torch.dtype = torch.float64,
              num_classes: int = 5, **overrides: Any) -> nn.Module:
        cfg = library("transformers").InternVLVisionConfig(**{
            **dict(image_size=32, patch_size=8, num_channels=3, hidden_size=32,
                   num_hidden_layers=depth, num_attention_heads=4, intermediate_size=64,
                   attention_bias=True, use_qk_norm=qk_norm, layer_norm_eps=1e-6,
                   use_mean_pooling=mean_pooling),
            **overrides})
        model = transformers_model("InternVLVisionModel", cfg, seed, dtype)
        g = torch.Generator().manual_seed(seed + 7)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("lambda_1", "lambda_2")):
                    p.copy_(0.5 + 0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
                elif name.endswith("cls_token"):
                    p.copy_(0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        return model

    return build


def internvl_vlm_example(*, seed: int = 0, depth: int = 3, dtype: torch.dtype = torch.float64,
                         num_classes: int = 5, vision_overrides: dict[str, Any] | None = None,
                         **overrides: Any) -> nn.Module:
    """A tiny ``InternVLForConditionalGeneration``: an InternViT tower (32 px, patch 8,
    LayerScale) and a 2-layer Qwen2 (width 32, vocabulary 300); the pixel shuffle makes 4
    image features of a tile's 16 patches, at the placeholder :data:`VLM_IMAGE_ID`.
    ``vision_overrides``: overrides of the tower's config (e.g. ``norm_type="rms_norm"``)."""
    transformers = library("transformers")
    vision = dict(model_type="internvl_vision", hidden_size=32, num_hidden_layers=depth,
                  num_attention_heads=4, intermediate_size=64, image_size=32, patch_size=8,
                  attention_bias=True)
    vision = {**vision, **(vision_overrides or {})}
    text = dict(model_type="qwen2", vocab_size=300, hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=256)
    cfg = transformers.InternVLConfig(vision_config=vision, text_config=text,
                                      image_token_id=VLM_IMAGE_ID, image_seq_length=4,
                                      **overrides)
    return transformers_model("InternVLForConditionalGeneration", cfg, seed, dtype)


@register_family(
    is_hf_internvl,
    supports="Hugging Face InternVLVisionModel (InternVL's InternViT tower: CLS, LayerScale, "
             "optional q/k norm, LayerNorm or RMSNorm blocks)",
    tags=("embedding", "vlm-tower", "variable-size"),
    notes=("`InternVLVisionModel` (the tower of `InternVLForConditionalGeneration`, explained "
           "with `VLMAnswer`: its `vision_feature_layer`, CLS dropped, pixel shuffle, projector, "
           "tiles of a prompt grouped): ✅ with vector targets on the patch mean of "
           "`last_hidden_state` (`use_mean_pooling`, the released models) or its CLS row; "
           "LayerScale, q/k RMSNorm over the whole width (AttnLRP and Chefer'21 refuse it), "
           "RMSNorm blocks (`norm_type='rms_norm'`, InternViT-6B; in float32 as the model), "
           "any size divisible by the patch (the model's bicubic position interpolation); maps "
           "equal a `Dinov2Model` twin's with copied weights"),
    examples={
        "hf_internvl_tower": Example(internvl_tower_example(), (32, 32),
                                     library="transformers", target="embedding"),
        # a support-matrix column: the whole VLM, its tower explained through VLMAnswer
        "hf_internvl": Example(internvl_vlm_example, (32, 32), library="transformers",
                               target="vlm", tags=("matrix",), suite=False),
    })
class HFInternVLAdapter(HFPatchGrid):
    """Canonical view of a Hugging Face ``InternVLVisionModel`` (never modified).

    Its output is an image embedding (the patch mean of ``last_hidden_state``, or its CLS
    row without ``use_mean_pooling``); explain it with a vector target, or explain an
    InternVL's answer with :class:`captum_vit.targets.VLMAnswer`.

    Args:
        model (nn.Module): an ``InternVLVisionModel``.

    Raises:
        TypeError: a ``norm_type`` other than ``"layer_norm"`` / ``"rms_norm"`` or an
            unknown layout.

    Examples::

        >>> from captum_vit.adapters import adapt
        >>> ad = adapt(vlm.model.vision_tower)          # an InternVLForConditionalGeneration
        >>> ad.num_prefix, ad.embedding
        (1, True)
    """

    model: ModelTree  # read by attribute names (captum_vit.adapters._typing)
    embedding = True
    dropout_fields = ("hidden_dropout_prob", "attention_dropout", "projection_dropout")

    def __init__(self, model: ModelTree) -> None:
        self.model = model
        name = type(model).__name__
        cfg = model.config
        norm_type = getattr(cfg, "norm_type", "layer_norm")
        if norm_type not in ("layer_norm", "rms_norm"):
            raise TypeError(f"{name} has norm_type={norm_type!r}; captum_vit reads the "
                            "model's 'layer_norm' and 'rms_norm' (InternViT-6B) blocks")
        self.rms = norm_type == "rms_norm"
        self.layers = model.encoder.layer
        if len(self.layers) == 0:
            raise TypeError(f"{name} has no transformer layers")
        heads = int(cfg.num_attention_heads)
        self.blocks = [_layer(layer, heads, f"{name}.encoder.layer[{i}]", self.rms)
                       for i, layer in enumerate(self.layers)]
        self.in_chans = int(cfg.num_channels)
        self.num_prefix = 1
        final = model.layernorm
        norm = None if isinstance(final, nn.Identity) else _norm(final, f"{name}.layernorm")
        if cfg.use_mean_pooling:
            self.readout = "avg"
            self.head = HeadParts(norm, None, (("avg", None, None),))
        else:
            self.readout = "token"
            self.head = HeadParts(norm, None, ((0, None, None),))

    def embed(self, inputs: Tensor, ops: Ops | None = None) -> Tensor:
        """The model's own ``embeddings(pixel_values)`` (``[CLS, patches]`` plus positions,
        interpolated by the model at other sizes).

        With ``ops`` (:meth:`ViTAdapter.embed`) the value is the model's embedding of the
        detached images and the patch projection runs through ``ops.linear`` as
        ``p - p.detach()`` (exactly 0) on the patch rows, so every pixel gradient goes
        through ``ops.linear``'s backward.
        """
        emb = self.model.embeddings
        if ops is None:
            return emb(inputs)
        x = emb(inputs.detach())
        name = f"{type(self.model).__name__}.embeddings"
        p = patch_projection(inputs, emb.patch_embeddings.projection, ops,
                             f"{name} patch projection").flatten(1, 2)
        return x + F.pad(p - p.detach(), (0, 0, self.num_prefix, 0))

    def is_random(self) -> bool:
        return has_config_dropout(self.model, self.dropout_fields)

    def model_outputs(self, inputs: Tensor) -> Tensor:
        """The embedding from the model's own ``last_hidden_state``: its patch mean
        (``use_mean_pooling``) or its CLS row."""
        h = self.model(pixel_values=inputs).last_hidden_state
        return h[:, 1:].mean(1) if self.readout == "avg" else h[:, 0]

    def parameter_stages(self) -> list[list[nn.Parameter]]:
        """Head stage (the final ``layernorm``, empty under ``use_mean_pooling``), then
        layers ``L-1 .. 0``; the embedding belongs to no stage."""
        stages = [list(self.model.layernorm.parameters())]
        return stages + [list(layer.parameters()) for layer in reversed(self.layers)]
