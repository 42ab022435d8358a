"""Adapter for Hugging Face transformers' V-JEPA 2 (``VJEPA2Model``,
``VJEPA2ForVideoClassification``; Assran et al., "V-JEPA 2: Self-Supervised Video Models
Enable Understanding, Prediction and Planning", 2025).

Only this file knows V-JEPA 2's attribute names. Verified in the installed transformers
(5.x, ``models/vjepa2/modeling_vjepa2.py``):

- **Inputs** are videos ``pixel_values_videos`` [B, T, C, H, W] (frames before
  channels); ``VJEPA2Embeddings`` permutes them to [B, C, T, H, W] and applies a
  ``Conv3d`` with kernel = stride = ``(tubelet_size, patch_size, patch_size)`` (2 x 16 x
  16 in the released models), then flattens the ``(T / t, H / p, W / p)`` grid in that
  order: tokens are ordered (frame slice, row, column). A video of fewer than ``t``
  frames is repeated ``t`` times along time by the model; the adapter refuses it (pass
  ``x.repeat(1, t, 1, 1, 1)``, the same video) and any frame count that is not a multiple
  of ``t`` (the convolution would drop the last frames).
- **No class token, no position table** (``num_prefix = 0``): positions enter only
  through a **3-D RoPE** on ``q`` and ``k`` in every encoder layer
  (``VJEPA2RopeAttention``): the head width ``d`` is cut into three parts of
  ``d' = 2·⌊⌊d/3⌋/2⌋`` channels rotated by the token's frame slice, row and column (the
  rest, if any, unrotated), each part by ``rotate_queries_or_keys``: channel ``c`` gets the
  angle ``θ_c = pos · 10000^{-2 (c mod d'/2) / d'}`` (the frequencies repeated in two
  halves) and ``x_c cos θ_c + y_c sin θ_c`` with ``y`` the interleaved pairs
  ``(−x_{2i+1}, x_{2i})``, so the two channels of a pair turn by different angles (the
  model's own convention, reproduced by calling it). It is applied to ``k`` and ``q``
  after the projections (there is no q/k norm). The token index → (slice, row,
  column) is computed with ``grid_size = crop_size // patch_size`` of the configuration,
  whatever the input size: the adapter therefore takes frames of ``crop_size`` only
  (another size would scramble the rows and columns), any frame count (the RoPE has no
  fixed depth). Each block's ``rotary`` (:attr:`BlockParts.rotary`) calls the model's own
  ``get_position_ids`` (with the kept tokens' original indices under true token
  removal, the ``position_mask`` path of the model's layers) and
  ``apply_rotary_embeddings``.
- **Encoder layers** (``encoder.layer[l]``): pre-LayerNorm ``norm1`` / ``norm2`` (eps
  ``layer_norm_eps``, 1e-6), ``attention.{query, key, value}`` (biases when
  ``qkv_bias``), ``attention.proj``, MLP ``mlp.fc1`` → ``ACT2FN[hidden_act]`` (exact
  GELU by default) → ``mlp.fc2``; no LayerScale; drop-path identity in eval. The
  encoder ends with ``encoder.layernorm`` on every token. The predictor
  (``VJEPA2Model.predictor``) is not part of any output explained here.
- **VJEPA2Model** (``embedding = True``): it has no pooled output (``last_hidden_state``
  [B, N, D] after ``encoder.layernorm``; the predictor's output needs masks). The vector
  explained is the **mean of ``last_hidden_state`` over the tokens** (readout ``"avg"``
  after the final norm; a choice of captum_vit, the usual frozen-feature embedding of a
  head-less V-JEPA 2).
- **VJEPA2ForVideoClassification**: ``VJEPA2AttentivePooler`` on the encoder's output,
  then ``classifier`` (Linear). The pooler runs ``num_pooler_layers`` self-attention
  layers (``self_attention_layers[i]``: pre-LN ``layer_norm1``, ``self_attn.{q, k, v,
  out}_proj``, ``layer_norm2``, ``mlp``; no RoPE) over all tokens, then one
  cross-attention layer: the learned ``query_tokens`` ℓ [1, 1, D] (no norm on it) as
  query over ``k, v = layer_norm1(x)`` projected, **without output projection**, plus a
  residual from ℓ, then ``z + mlp(layer_norm2(z))``; the classifier reads ``z``. Here the
  pooler's self-attention layers are **blocks** (after the encoder's), the encoder's
  ``layernorm`` is the last encoder block's output norm (:attr:`BlockParts.out_norm`:
  per token, it mixes nothing), ``cross_attention_layer.layer_norm1`` is the head's
  final norm and the cross-attention is an attention-pool head (readout ``"map"``,
  :class:`~captum_vit.adapters.parts.PoolParts`, as timm's ``map`` pool:
  one more attention layer without identity for the gradient-weighted methods): its
  output projection is the identity and its bias is ℓ (the residual from the query is a
  constant of the input, so DecompX sends it to the bias source and stays complete).

Maps are returned per tubelet, as VideoMAE's
(:class:`~captum_vit.adapters.families._hf.HFVideoAdapter`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from captum_vit.adapters._typing import ModelTree
from captum_vit.adapters.catalog import Example, register_family
from captum_vit.adapters.families._examples import library, randomize_
from captum_vit.adapters.families._hf import (
    HFVideoAdapter,
    is_transformers_model,
    layer_parts,
    pair,
)
from captum_vit.adapters.ops import Ops
from captum_vit.adapters.parts import BlockParts, HeadParts, PoolParts
from captum_vit.adapters.parts import layer_norm_parts as _norm

CLASSES = ("VJEPA2ForVideoClassification", "VJEPA2Model")


def is_hf_vjepa2(model: nn.Module) -> bool:
    """``True`` for the Hugging Face V-JEPA 2 models in :data:`CLASSES` (transformers is
    never imported for other models).

    Args:
        model (nn.Module): any model.

    Returns:
        bool: whether :class:`HFVJEPA2Adapter` applies.
    """
    return is_transformers_model(model, CLASSES)


def _example(cls_name: str, **extra: Any) -> Callable[..., nn.Module]:
    """A builder of a small Hugging Face V-JEPA 2 (4 frames of 16x16, tubelets 2 x 8 x 8:
    2 frame slices of 2 x 2; width 48, 2 heads of 24 channels: 3 RoPE parts of 8; one
    pooler self-attention layer; a 1-layer predictor); ``extra`` and build-time
    ``overrides`` go to the ``VJEPA2Config``."""
    def build(*, seed: int = 0, depth: int = 3, dtype: torch.dtype = torch.float64,
              num_classes: int = 5, **overrides: Any) -> nn.Module:
        transformers = library("transformers")
        kwargs: dict[str, Any] = dict(
            patch_size=8, crop_size=16, frames_per_clip=4, tubelet_size=2, hidden_size=48,
            in_chans=3, num_attention_heads=2, num_hidden_layers=depth, mlp_ratio=2.0,
            num_pooler_layers=1, pred_hidden_size=16, pred_num_attention_heads=2,
            pred_num_hidden_layers=1, pred_num_mask_tokens=2, num_labels=num_classes)
        kwargs.update(extra)
        kwargs.update(overrides)
        torch.manual_seed(seed)
        model = getattr(transformers, cls_name)(transformers.VJEPA2Config(**kwargs))
        randomize_(model, seed)
        pooler = getattr(model, "pooler", None)
        if pooler is not None:  # randomize_ leaves the query token at 0.05 scale
            with torch.no_grad():
                g = torch.Generator().manual_seed(seed + 1)
                pooler.query_tokens.copy_(torch.randn(pooler.query_tokens.shape, generator=g))
        return model.to(dtype).eval()

    return build


@register_family(
    is_hf_vjepa2,
    supports="Hugging Face VJEPA2ForVideoClassification and VJEPA2Model (videos "
             "[B, T, C, H, W])",
    tags=("classifier", "embedding", "video"),
    notes=("Videos `[B, T, C, H, W]`: tubelets `tubelet_size` × `patch_size`², no class token, "
           "3-D RoPE on q/k (the model's own rotation), frames of `crop_size`, any multiple of "
           "`tubelet_size` frames; the classifier's attentive pooler: its self-attention "
           "layers are blocks, its cross-attention an attention-pool head (`map`, no "
           "identity), the encoder's final norm a per-token norm between blocks: ✅ maps per "
           "tubelet (`[B, 1, F, gh, gw]`); `VJEPA2Model` with vector targets on the token "
           "mean of `last_hidden_state`; DecompX complete; token removal keeps each kept "
           "tubelet's RoPE position — refused: RISE/ViT-CX pixel masks, the localisation "
           "metrics, the removal metrics' `unit=\"pixel\"` (as VideoMAE)"),
    examples={
        "hf_vjepa2": Example(_example("VJEPA2ForVideoClassification"), (4, 16, 16),
                             library="transformers"),
        # the encoder alone: the token mean after its final norm
        "hf_vjepa2_model": Example(_example("VJEPA2Model"), (4, 16, 16),
                                   library="transformers", target="embedding", suite=False),
    })
class HFVJEPA2Adapter(HFVideoAdapter):
    """Canonical view of a Hugging Face ``VJEPA2ForVideoClassification`` or
    ``VJEPA2Model`` (never modified): a ViT without class token on tubelet tokens with a
    3-D RoPE, and the classifier's attentive pooler (module docstring).

    Inputs are videos [B, T, C, H, W]: frames of the model's ``crop_size`` and a multiple
    of ``tubelet_size`` frames. A ``VJEPA2Model`` outputs the token mean of its
    ``last_hidden_state`` and takes vector targets
    (:class:`captum_vit.targets.EmbeddingTarget`).

    Args:
        model (nn.Module): one of the classes of :data:`CLASSES`.

    Raises:
        TypeError: a layer layout or head the adapter does not know.

    Examples::

        >>> import transformers
        >>> from captum_vit.adapters import adapt
        >>> cfg = transformers.VJEPA2Config(patch_size=8, crop_size=32, frames_per_clip=4,
        ...     hidden_size=48, num_attention_heads=2, num_hidden_layers=2,
        ...     num_pooler_layers=1, num_labels=5)
        >>> a = adapt(transformers.VJEPA2ForVideoClassification(cfg).eval())
        >>> a.layout(torch.zeros(1, 4, 3, 32, 32)).grid   # 2 frame slices of 4 x 4
        (8, 4)
    """

    dropout_fields = ("attention_probs_dropout_prob", "attention_dropout", "drop_path_rate")

    def __init__(self, model: ModelTree) -> None:
        self.model = model
        name = type(model).__name__
        self.backbone = getattr(model, "vjepa2", model)
        cfg = model.config
        enc = self.backbone.encoder
        self.layers = list(enc.layer)
        if not self.layers:
            raise TypeError(f"{name} has no encoder layers")
        heads = int(cfg.num_attention_heads)
        blocks = [self._encoder_block(layer, heads, f"{name}.encoder.layer[{i}]")
                  for i, layer in enumerate(self.layers)]
        self.pooler = getattr(model, "pooler", None)
        self.embedding = self.pooler is None
        if self.pooler is not None:
            classifier = getattr(model, "classifier", None)
            if not isinstance(classifier, nn.Linear):
                raise TypeError(f"{name}.classifier is {type(classifier).__name__}; "
                                "captum_vit supports V-JEPA 2's linear classifier")
            # the encoder's final norm sits between the encoder and the pooler's layers
            blocks[-1] = dataclasses.replace(blocks[-1], out_norm=_norm(enc.layernorm,
                                                             f"{name}.encoder.layernorm"))
            pool_layers = list(self.pooler.self_attention_layers)
            blocks += [layer_parts(layer, heads,
                                   f"{name}.pooler.self_attention_layers[{i}]")
                       for i, layer in enumerate(pool_layers)]
            self.layers += pool_layers
        self.blocks = blocks
        self.in_chans = int(cfg.in_chans)
        self.num_prefix = 0
        self.tubelet = int(cfg.tubelet_size)
        self.patch_size = pair(cfg.patch_size)
        self.head = self._head()

    @staticmethod
    def _encoder_block(layer: ModelTree, heads: int, where: str) -> BlockParts:
        """An encoder layer's parts, with the layer's own 3-D RoPE as ``rotary``."""
        att = layer.attention
        if not hasattr(att, "apply_rotary_embeddings"):
            raise TypeError(f"{where}.attention is {type(att).__name__}; captum_vit reads "
                            "VJEPA2RopeAttention")
        head_dim = att.query.weight.shape[0] // heads
        return BlockParts(
            norm1=_norm(layer.norm1, f"{where}.norm1"),
            q_weight=att.query.weight, k_weight=att.key.weight, v_weight=att.value.weight,
            q_bias=att.query.bias, k_bias=att.key.bias, v_bias=att.value.bias,
            num_heads=heads, head_dim=head_dim, scale=float(att.scaling),
            q_norm=nn.Identity(), k_norm=nn.Identity(),
            proj_weight=att.proj.weight, proj_bias=att.proj.bias, ls1=None,
            norm2=_norm(layer.norm2, f"{where}.norm2"),
            fc1_weight=layer.mlp.fc1.weight, fc1_bias=layer.mlp.fc1.bias,
            act=layer.mlp.activation, fc2_weight=layer.mlp.fc2.weight,
            fc2_bias=layer.mlp.fc2.bias, ls2=None,
            rotary=functools.partial(_rotate, att))

    def _head(self) -> HeadParts:
        """The token mean after the encoder's norm (``VJEPA2Model``), or the attentive
        pooler's cross-attention as an attention pool and the classifier; sets
        :attr:`readout`."""
        name = type(self.model).__name__
        if self.pooler is None:
            self.readout = "avg"
            return HeadParts(_norm(self.backbone.encoder.layernorm,
                                   f"{name}.encoder.layernorm"), None, (("avg", None, None),))
        self.readout = "map"
        cross = self.pooler.cross_attention_layer
        att, mlp = cross.cross_attn, cross.mlp
        latent = self.pooler.query_tokens[0]  # [1, D]
        width = latent.shape[-1]
        heads = int(att.num_heads)
        pool = PoolParts(
            latent=latent,
            q_weight=att.q_proj.weight, q_bias=att.q_proj.bias,
            k_weight=att.k_proj.weight, k_bias=att.k_proj.bias,
            v_weight=att.v_proj.weight, v_bias=att.v_proj.bias,
            num_heads=heads, head_dim=width // heads, scale=float(att.scale),
            q_norm=nn.Identity(), k_norm=nn.Identity(),
            # no output projection; the residual from the query is a constant bias
            proj_weight=torch.eye(width, dtype=latent.dtype, device=latent.device),
            proj_bias=latent[0],
            norm=_norm(cross.layer_norm2, f"{name}.pooler.cross_attention_layer.layer_norm2"),
            fc1_weight=mlp.fc1.weight, fc1_bias=mlp.fc1.bias, act=mlp.activation,
            fc2_weight=mlp.fc2.weight, fc2_bias=mlp.fc2.bias, skip_prefix=0)
        clf = self.model.classifier
        return HeadParts(_norm(cross.layer_norm1,
                               f"{name}.pooler.cross_attention_layer.layer_norm1"),
                         None, (("map", clf.weight, clf.bias),), attn_pool=pool)

    def refresh(self) -> None:
        """Rebuild the pool's identity projection when ``model.to(...)`` changed the
        parameters' dtype or device."""
        pool, pooler = self.head.attn_pool, self.pooler
        if pool is not None and pooler is not None and (pool.proj_weight.dtype != pool.latent.dtype
                                 or pool.proj_weight.device != pool.latent.device
                                 or pool.latent.data_ptr()
                                 != pooler.query_tokens.data_ptr()):
            self.head = self._head()

    @property
    def input_shape(self) -> tuple[int, tuple[int, int]]:
        """``(channels, (H, W))`` of one frame (``crop_size``)."""
        return self.in_chans, pair(self.config.crop_size)

    @property
    def num_frames(self) -> int:
        """``frames_per_clip`` of the configuration (the model takes any multiple of
        ``tubelet_size`` frames)."""
        return int(self.config.frames_per_clip)

    def check_inputs(self, inputs: Tensor) -> None:
        name = type(self.model).__name__
        if inputs.dim() != 5:
            raise ValueError(f"inputs of shape {tuple(inputs.shape)} are not a video batch: "
                             f"{name} takes videos [B, T, C, H, W] (an image batch [B, C, "
                             f"H, W] is a video of one frame: x[:, None].repeat(1, "
                             f"{self.tubelet}, 1, 1, 1), the model's own repetition)")
        super().check_inputs(inputs)
        t, (h, w) = inputs.shape[1], tuple(inputs.shape[-2:])
        size = self.input_shape[1]
        if (h, w) != size:
            raise ValueError(f"inputs frame size {(h, w)} does not match the model's "
                             f"crop_size {size} (its RoPE reads rows and columns on that "
                             "grid); resize the frames")
        if t < self.tubelet or t % self.tubelet:
            raise ValueError(f"inputs have {t} frames; {name} takes a multiple of its "
                             f"tubelet_size={self.tubelet} frames (fewer are repeated by the "
                             f"model: pass x.repeat(1, {self.tubelet}, 1, 1, 1) for one "
                             "frame; sample or trim the frames otherwise)")

    def embed(self, inputs: Tensor, ops: Ops | None = None) -> Tensor:
        """The model's own ``encoder.embeddings(pixel_values_videos)`` (the tubelet
        projection; no position table); with ``ops`` as :meth:`HFVideoAdapter.tubelet_embed
        <captum_vit.adapters.families._hf.HFVideoAdapter.tubelet_embed>`."""
        emb = self.backbone.encoder.embeddings
        return self.tubelet_embed(inputs, ops, emb, emb.patch_embeddings.proj)

    def model_outputs(self, inputs: Tensor) -> Tensor:
        """The logits; for a ``VJEPA2Model`` the token mean of its ``last_hidden_state``
        (its forward without the predictor)."""
        if self.pooler is not None:
            return self.model(pixel_values_videos=inputs).logits
        hidden = self.model(pixel_values_videos=inputs, skip_predictor=True).last_hidden_state
        return hidden.mean(1)

    def parameter_stages(self) -> list[list[nn.Parameter]]:
        m = self.model
        if self.pooler is None:
            head = list(self.backbone.encoder.layernorm.parameters())
        else:
            head = [self.pooler.query_tokens,
                    *self.pooler.cross_attention_layer.parameters(),
                    *m.classifier.parameters()]
        stages = [head]
        for i, layer in reversed(list(enumerate(self.layers))):
            params = list(layer.parameters())
            if self.pooler is not None and i == len(self.backbone.encoder.layer) - 1:
                params += list(self.backbone.encoder.layernorm.parameters())  # out_norm
            stages.append(params)
        return stages


def _rotate(att: ModelTree, h: Tensor, positions: Tensor | None) -> Tensor:
    """The model's own 3-D RoPE of ``att`` (a ``VJEPA2RopeAttention``) on per-head
    ``h`` [B, H, n, d]: the tokens' original indices ``positions`` [B, n] (``None``: the
    full sequence ``0..n-1``) through ``att.get_position_ids`` (which reads the token
    count from dimension 1 of its input, hence the transposed view), then
    ``att.apply_rotary_embeddings``."""
    masks = None if positions is None else positions.to(h.device)
    ids = att.get_position_ids(h.transpose(1, 2), masks=masks)
    return att.apply_rotary_embeddings(h, ids)
