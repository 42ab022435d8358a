"""Adapter for Hugging Face transformers' TimeSformer (``TimesformerForVideoClassification``,
``TimesformerModel``; Bertasius et al., "Is Space-Time Attention All You Need for Video
Understanding?", ICML 2021).

Only this file knows TimeSformer's attribute names. Verified in the installed transformers
(5.x, ``models/timesformer/modeling_timesformer.py``):

- **Inputs** are videos ``pixel_values`` [B, T, C, H, W] (frames before channels);
  ``TimesformerPatchEmbeddings`` folds the frames into the batch and applies a per-frame
  ``Conv2d`` (kernel = stride = ``patch_size``): ``N = gh·gw`` patches per frame.
- **Embeddings** (``TimesformerEmbeddings``): a class token is prepended *per frame*, the
  position table ``[1, 1 + N, D]`` added (nearest-interpolated if the grid differs); for
  ``divided_space_time`` and ``joint_space_time`` one class token per video is kept
  (``embeddings[:B, 0]``, rows of the ``B·T`` frame batch: every row's class token is the
  same vector, ``cls_token`` plus its position row),
  the patch tokens are reordered to ``(patch, frame)`` order (``[B, N, T, D]``), the time
  table ``time_embeddings`` [1, T, D] added per frame (nearest-interpolated to another frame
  count) and the sequence is ``[CLS, (patch n, frame t) at 1 + n·T + t]``. For
  ``space_only`` there is no time table and the sequence stays ``[B·T, 1 + N, D]``: every
  frame is an image with its own class token.
- **Layers** (``TimesformerLayer``): ``divided_space_time`` reads ``config.num_frames`` and
  ``config.image_size`` (not the input's) to reshape, so the model is only right for
  inputs of exactly that frame count and size (the adapter refuses others). Each layer:

  1. *temporal*: the patch tokens only (the class token is not in it), each patch
     position attends over its ``T`` frames: ``temporal_layernorm``, then
     ``temporal_attention`` (its own fused ``qkv`` and output ``dense``), then
     ``temporal_dense`` (a second linear, the paper's ``temporal_fc``), added to the
     patch tokens: ``x_p ← x_p + W_tf (W_o A_t v + b_o) + b_tf``; the class token is
     unchanged;
  2. *spatial*: per frame, the sequence ``[CLS, patches of frame t]`` (the class token
     repeated into every frame), ``layernorm_before``, ``attention`` (fused ``qkv``,
     output ``dense``); the class token's ``T`` outputs (after ``W_o``) are averaged back
     into one, the patches' go back to their places, and both are added to the states of
     step 1 (the class token to the layer's input class token);
  3. *MLP*: ``layernorm_after``, ``intermediate.dense``, the activation, ``output.dense``,
     residual.

  ``space_only`` and ``joint_space_time`` layers are plain pre-LN ViT layers (step 2 over
  the whole sequence, then 3); the temporal parameters exist only in divided layers.
- **Head**: the final ``layernorm``, then ``classifier`` (Linear, or Identity for
  ``num_labels=0``) on row 0, the class token: readout ``"token"``. With ``space_only``
  the model returns one row of logits per *frame* ([B·T, classes]): it is an image
  classifier applied frame by frame, and the adapter explains it as one (images [B, C, H,
  W]; the model's forward on ``inputs[:, None]``).

The canonical form. The adapter orders the patch tokens frame-major (``1 + t·N + n``, the
order of the maps: ``output="tokens"`` [B, T·gh·gw], ``"grid"`` [B, 1, T, gh, gw], pixels
shaped like the video; :mod:`captum_vit.adapters.layout`) by permuting the model's own
embedding. A divided layer is *two* engine blocks, each with one token mixing:

- the temporal half: ``temporal_layernorm``, attention within the windows of
  :class:`FrameWindows` ``temporal`` (one window of the ``T`` frames per patch position,
  plus one window holding the class token alone, its other slots padding that is no key),
  ``W_O`` = ``temporal_dense ∘ dense`` folded into one linear (exact up to rounding), the
  class-token row of the sublayer's output zeroed (``BlockParts.fixed_rows = 1``), and an
  MLP of width 1 with zero weights (its output is exactly 0): the block maps ``x`` to
  ``x + temporal(x)`` as the model does;
- the spatial half: ``layernorm_before``, attention within :class:`FrameWindows`
  ``spatial`` (one window per frame, ``[CLS, its N patches]``: the class token sits in
  every window and its rows of the windows' outputs are averaged back), ``W_O``, then the
  MLP.

The token map of a divided layer is therefore the product of two structured maps (the
spatial half's times the temporal half's), and every matrix method chains them as vectors
through :meth:`FrameWindows.left_multiply` (``adapter.stages.token_mix``): the dense
``(1 + T·N)²`` matrix is never built. Block indices (``layer=``, ``start_layer=``) count
the engine's blocks, two per divided layer (the temporal half first).
"""

from __future__ import annotations

import dataclasses
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
    linear_head,
    pair,
)
from captum_vit.adapters.layout import Layout
from captum_vit.adapters.ops import Ops, patch_projection
from captum_vit.adapters.parts import BlockParts, HeadParts
from captum_vit.adapters.parts import layer_norm_parts as _norm
from captum_vit.adapters.windows import SlotWindows

CLASSES = ("TimesformerForVideoClassification", "TimesformerModel")
ATTENTION_TYPES = ("divided_space_time", "space_only", "joint_space_time")


def is_hf_timesformer(model: nn.Module) -> bool:
    """``True`` for the Hugging Face TimeSformer models in :data:`CLASSES` (transformers
    is never imported for other models).

    Args:
        model (nn.Module): any model.

    Returns:
        bool: whether :class:`HFTimesformerAdapter` applies.
    """
    return is_transformers_model(model, CLASSES)


class FrameWindows(SlotWindows):
    """The two token mixings of a divided space-time layer (:meth:`temporal`,
    :meth:`spatial`) as :class:`~captum_vit.adapters.windows.SlotWindows`: windows of token
    slots, a token possibly in several windows (its outputs averaged back), padded slots no
    keys."""

    @classmethod
    def temporal(cls, frames: int, patches: int) -> FrameWindows:
        """The temporal mixing over ``[CLS, frame-major patches]``: window 0 holds the class
        token alone (slot 0, the others padding), window ``1 + n`` the patch ``n`` of every
        frame in frame order."""
        t = torch.arange(frames)
        rows = [torch.cat([torch.zeros(1, dtype=torch.long),
                           torch.full((frames - 1,), -1, dtype=torch.long)])]
        rows += [1 + t * patches + n for n in range(patches)]
        return cls(torch.stack(rows), 1 + frames * patches)

    @classmethod
    def spatial(cls, frames: int, patches: int) -> FrameWindows:
        """The spatial mixing: window ``t`` is ``[CLS, the patches of frame t]`` (the class
        token in every window, its outputs averaged)."""
        n = torch.arange(patches)
        rows = [torch.cat([torch.zeros(1, dtype=torch.long), 1 + t * patches + n])
                for t in range(frames)]
        return cls(torch.stack(rows), 1 + frames * patches)


def _example(cls_name: str, **extra: Any) -> Callable[..., nn.Module]:
    """A builder of a small Hugging Face TimeSformer (2 frames of 16x16, 2 x 2 patches of
    8; width 32, 2 heads); ``extra`` and build-time ``overrides`` go to the
    ``TimesformerConfig`` (e.g. ``num_frames=3``, ``attention_type="joint_space_time"``)."""
    def build(*, seed: int = 0, depth: int = 2, dtype: torch.dtype = torch.float64,
              num_classes: int = 5, **overrides: Any) -> nn.Module:
        transformers = library("transformers")
        kwargs: dict[str, Any] = dict(
            image_size=16, patch_size=8, num_channels=3, num_frames=2, hidden_size=32,
            num_hidden_layers=depth, num_attention_heads=2, intermediate_size=64,
            num_labels=num_classes, qkv_bias=True, layer_norm_eps=1e-6,
            attention_type="divided_space_time")
        kwargs.update(extra)
        kwargs.update(overrides)
        return transformers_model(cls_name, transformers.TimesformerConfig(**kwargs), seed, dtype)

    return build


def _fused_qkv(att: ModelTree, d: int) -> tuple[Tensor, ...]:
    """q, k, v weights and biases: views of a ``TimesformerSelfAttention``'s fused ``qkv``."""
    w, b = att.qkv.weight, att.qkv.bias
    bias = (None, None, None) if b is None else (b[:d], b[d:2 * d], b[2 * d:])
    return (w[:d], w[d:2 * d], w[2 * d:], *bias)


@register_family(
    is_hf_timesformer,
    supports="Hugging Face TimesformerForVideoClassification and TimesformerModel (videos "
             "[B, T, C, H, W]; divided_space_time, joint_space_time; space_only as a "
             "per-frame image classifier)",
    tags=("classifier", "embedding", "video", "windowed", "shared_windows"),
    notes=("Videos `[B, T, C, H, W]` of the model's fixed `num_frames` and `image_size`: "
           "each divided layer is two blocks (temporal attention over the frames at each "
           "patch, the CLS not in it; spatial attention per frame with the CLS repeated and "
           "averaged back), structured token maps chained as vectors (no dense "
           "`(1+T·N)²` matrix); `joint_space_time` is the plain ViT on `1+T·N` tokens; "
           "`space_only` is an image classifier applied per frame (images `[B, C, H, W]`) "
           "— ✅ maps per frame: `output=\"tokens\"` `[B, T·gh·gw]`, `\"grid\"` `[B, 1, T, "
           "gh, gw]`; `layer=` counts two blocks per divided layer — refused: true token "
           "removal (TIS, RISE, ViT-CX, removal='token'), the methods reading window slots "
           "one token each (BT-H, BT-T, TAM, GlobEnc, ALTI)"),
    examples={
        "hf_timesformer": Example(_example("TimesformerForVideoClassification"),
                                  (2, 16, 16), library="transformers"),
        "hf_timesformer_joint": Example(
            _example("TimesformerForVideoClassification", attention_type="joint_space_time"),
            (2, 16, 16), library="transformers", suite=False),
        "hf_timesformer_model": Example(_example("TimesformerModel"), (2, 16, 16),
                                        library="transformers", target="embedding",
                                        suite=False),
    })
class HFTimesformerAdapter(HFVideoAdapter):
    """Canonical view of a Hugging Face ``TimesformerForVideoClassification`` or
    ``TimesformerModel`` (never modified): a divided layer as two blocks with structured
    token maps (module docstring), a joint layer as a plain block.

    Inputs are videos [B, T, C, H, W] of the model's ``num_frames`` and ``image_size``
    (``space_only``: images [B, C, H, W], the model applied to one frame). A classifier
    built with ``num_labels=0`` and a ``TimesformerModel`` output the final-normed class
    token and take vector targets (:class:`captum_vit.targets.EmbeddingTarget`).

    Args:
        model (nn.Module): one of the classes of :data:`CLASSES`.

    Raises:
        TypeError: an attention type, layer layout or head the adapter does not know.

    Examples::

        >>> import transformers
        >>> from captum_vit.adapters import adapt
        >>> cfg = transformers.TimesformerConfig(image_size=16, patch_size=8, num_frames=2,
        ...     hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        ...     intermediate_size=64, num_labels=5)
        >>> a = adapt(transformers.TimesformerForVideoClassification(cfg).eval())
        >>> len(a.blocks), a.layout(torch.zeros(1, 2, 3, 16, 16)).grid   # 2 per layer
        (4, (4, 2))
    """

    dropout_fields = ("hidden_dropout_prob", "attention_probs_dropout_prob", "drop_path_rate")

    def __init__(self, model: ModelTree) -> None:
        self.model = model
        name = type(model).__name__
        self.backbone = getattr(model, "timesformer", model)
        cfg = model.config
        self.attention_type = str(cfg.attention_type)
        if self.attention_type not in ATTENTION_TYPES:
            raise TypeError(f"{name} has attention_type={self.attention_type!r}; captum_vit "
                            f"supports {', '.join(ATTENTION_TYPES)}")
        self.video = self.attention_type != "space_only"
        self.layers = self.backbone.encoder.layer
        if len(self.layers) == 0:
            raise TypeError(f"{name} has no transformer layers")
        self.in_chans = int(cfg.num_channels)
        self.num_prefix = 1
        self.readout = "token"
        self.patch_size = pair(cfg.patch_size)
        self.read_classifier("TimeSformer")
        self._key: tuple = ()
        self.refresh()

    # -- parts -----------------------------------------------------------------------------
    def refresh(self) -> None:
        """Re-read the parts when the model's parameters changed storage, dtype or device
        (the folded temporal projection and the zero MLPs are computed tensors)."""
        key = tuple((p.data_ptr(), p.dtype, p.device) for p in self.model.parameters())
        if key == self._key:
            return
        self.blocks = self._blocks()
        self.head = self._head()
        self._key = key

    def _blocks(self) -> list[BlockParts]:
        name, cfg = type(self.model).__name__, self.config
        heads, d = int(cfg.num_attention_heads), int(cfg.hidden_size)
        frames = int(cfg.num_frames)
        gh, gw = (s // p for s, p in zip(pair(cfg.image_size), self.patch_size, strict=True))
        blocks = []
        for i, layer in enumerate(self.layers):
            where = f"{name}.encoder.layer[{i}]"
            spatial = self._spatial(layer, heads, d, where)
            if self.attention_type == "divided_space_time":
                blocks.append(self._temporal(layer, heads, d, where, frames, gh * gw))
                spatial = dataclasses.replace(spatial,
                                              window=FrameWindows.spatial(frames, gh * gw))
            blocks.append(spatial)
        return blocks

    @staticmethod
    def _spatial(layer: ModelTree, heads: int, d: int, where: str) -> BlockParts:
        """A plain pre-LN block of ``layernorm_before``, ``attention``, ``layernorm_after``
        and the MLP (the spatial half of a divided layer; a whole joint or space-only
        layer)."""
        att = layer.attention
        qw, kw, vw, qb, kb, vb = _fused_qkv(att.attention, d)
        hd = d // heads
        return BlockParts(
            norm1=_norm(layer.layernorm_before, f"{where}.layernorm_before"),
            q_weight=qw, k_weight=kw, v_weight=vw, q_bias=qb, k_bias=kb, v_bias=vb,
            num_heads=heads, head_dim=hd, scale=float(att.attention.scale),
            q_norm=nn.Identity(), k_norm=nn.Identity(),
            proj_weight=att.output.dense.weight, proj_bias=att.output.dense.bias, ls1=None,
            norm2=_norm(layer.layernorm_after, f"{where}.layernorm_after"),
            fc1_weight=layer.intermediate.dense.weight, fc1_bias=layer.intermediate.dense.bias,
            act=layer.intermediate.intermediate_act_fn,
            fc2_weight=layer.output.dense.weight, fc2_bias=layer.output.dense.bias, ls2=None)

    @staticmethod
    def _temporal(layer: ModelTree, heads: int, d: int, where: str, frames: int,
                  patches: int) -> BlockParts:
        """The temporal half of a divided layer (module docstring): ``temporal_dense ∘
        dense`` folded into ``W_O``, the class-token row fixed, a zero MLP of width 1."""
        att = layer.temporal_attention
        qw, kw, vw, qb, kb, vb = _fused_qkv(att.attention, d)
        dense, fc = att.output.dense, layer.temporal_dense
        with torch.no_grad():
            w = fc.weight @ dense.weight
            b = fc.weight @ dense.bias if dense.bias is not None else None
            b = fc.bias if b is None else (b if fc.bias is None else b + fc.bias)
            z = dense.weight
            fc1_w, fc1_b = z.new_zeros(1, d), z.new_zeros(1)
            fc2_w, fc2_b = z.new_zeros(d, 1), z.new_zeros(d)
        norm = _norm(layer.temporal_layernorm, f"{where}.temporal_layernorm")
        return BlockParts(
            norm1=norm, q_weight=qw, k_weight=kw, v_weight=vw, q_bias=qb, k_bias=kb,
            v_bias=vb, num_heads=heads, head_dim=d // heads,
            scale=float(att.attention.scale), q_norm=nn.Identity(), k_norm=nn.Identity(),
            proj_weight=w, proj_bias=b, ls1=None, norm2=norm,
            fc1_weight=fc1_w, fc1_bias=fc1_b, act=layer.intermediate.intermediate_act_fn,
            fc2_weight=fc2_w, fc2_bias=fc2_b, ls2=None,
            window=FrameWindows.temporal(frames, patches), fixed_rows=1)

    def _head(self) -> HeadParts:
        """The final ``layernorm`` and the classifier on row 0 (the class token)."""
        classifier = getattr(self.model, "classifier", None)
        w, b = linear_head(classifier)
        final = _norm(self.backbone.layernorm, f"{type(self.model).__name__}.layernorm")
        return HeadParts(final, None, ((0, w, b),))

    # -- geometry --------------------------------------------------------------------------
    def check_inputs(self, inputs: Tensor) -> None:
        name = type(self.model).__name__
        if not self.video and inputs.dim() == 5:
            raise ValueError(
                f"this {name} has attention_type='space_only': it classifies each frame on "
                f"its own (its logits are [B·T, classes]), so captum_vit explains it as an "
                f"image model; pass the frames as images, inputs.flatten(0, 1) "
                f"([B·T, C, H, W])")
        super().check_inputs(inputs)
        size = self.input_shape[1]
        self.check_fixed_size(inputs, size, name)
        if self.video and inputs.shape[1] != self.num_frames:
            raise ValueError(f"inputs have {inputs.shape[1]} frames but this {name} takes "
                             f"num_frames={self.num_frames} (its layers reshape by the "
                             f"configured count); sample {self.num_frames} frames from the "
                             "video")

    def layout(self, inputs: Tensor) -> Layout:
        self.refresh()
        h, w = (int(s) for s in inputs.shape[-2:])
        ph, pw = self.patch_size
        frames = int(inputs.shape[1]) if self.video else None
        return Layout(num_prefix=1, grid=((frames or 1) * (h // ph), w // pw),
                      patch_size=(ph, pw), readout=self.readout, num_blocks=self.num_blocks,
                      num_heads=self.blocks[0].num_heads, image_size=(h, w), frames=frames,
                      tubelet=1)

    def _frame_major(self, x: Tensor, frames: int) -> Tensor:
        """The model's ``[CLS, (patch, frame)]`` sequence in frame-major order."""
        b, n, d = x.shape
        patches = x[:, 1:].reshape(b, (n - 1) // frames, frames, d).transpose(1, 2)
        return torch.cat([x[:, :1], patches.reshape(b, n - 1, d)], 1)

    def embed(self, inputs: Tensor, ops: Ops | None = None) -> Tensor:
        """The model's own ``embeddings`` (class token, position and time tables), patch
        tokens reordered frame-major.

        With ``ops`` the value is the model's embedding of the detached inputs and the
        per-frame patch projection through ``ops.linear``
        (:func:`~captum_vit.adapters.ops.patch_projection`) is added as ``p - p.detach()``
        (exactly 0): every pixel gradient runs through ``ops.linear``.
        """
        self.refresh()
        emb = self.backbone.embeddings
        video = inputs if self.video else inputs[:, None]
        b, t = video.shape[:2]

        def order(x: Tensor) -> Tensor:
            return self._frame_major(x, t) if self.video else x

        if ops is None:
            return order(emb(video))
        x = order(emb(video.detach()))
        conv = emb.patch_embeddings.projection
        p = patch_projection(video.flatten(0, 1), conv, ops,
                             f"{type(self.model).__name__} patch projection")
        p = p.reshape(b, -1, p.shape[-1])  # frame-major [B, T·N, D]
        p = torch.cat([p.new_zeros(b, 1, p.shape[-1]), p], 1)
        return x + (p - p.detach())

    def model_outputs(self, inputs: Tensor) -> Tensor:
        """The logits; for an embedding model the final-normed class token."""
        video = inputs if self.video else inputs[:, None]
        if hasattr(self.model, "classifier"):
            return self.model(pixel_values=video).logits
        return self.backbone(pixel_values=video).last_hidden_state[:, 0]

    def parameter_stages(self) -> list[list[nn.Parameter]]:
        m = self.model
        head = [self.backbone.layernorm, getattr(m, "classifier", None)]
        stages = [[p for mod in head if mod is not None for p in mod.parameters()]]
        for layer in reversed(self.layers):
            temporal = [getattr(layer, n, None) for n in (
                "temporal_layernorm", "temporal_attention", "temporal_dense")]
            temporal_params = {id(p) for mod in temporal if mod is not None
                               for p in mod.parameters()}
            stages.append([p for p in layer.parameters() if id(p) not in temporal_params])
            if temporal_params:
                stages.append([p for mod in temporal if mod is not None
                               for p in mod.parameters()])
        return stages

