"""Adapter for Hugging Face transformers' YOLOS detector (``YolosForObjectDetection``).

YOLOS (Fang et al., NeurIPS 2021) is a DeiT-style pre-LN ViT whose sequence is
``[CLS, patches, det_1 … det_K]``: ``config.num_detection_tokens`` learned detection
tokens appended after the patches, each with its own position embedding. After the final
LayerNorm two MLPs (three linear layers, ReLU between them) read every detection row:
``class_labels_classifier`` (``C + 1`` logits, the last one "no object") and
``bbox_predictor`` (a sigmoid of four numbers: centre x, centre y, width, height,
normalised to the image). Verified in the installed transformers
(``models/yolos/modeling_yolos.py``): the layers are ViT layers with separate q/k/v
projections (read as :func:`~captum_vit.adapters.families._hf.layer_parts` reads ViT's); the
embedding always resamples the patch position embeddings to the input size (bicubic,
``InterpolateInitialPositionEmbeddings``; the identity at the configured size), so inputs
of any size divisible by the patch size are taken as the model takes them; with
``use_mid_position_embeddings`` the encoder adds a further (resampled) position embedding
to the output of every block but the last.

Canonical form (our choice). :meth:`HFYolosAdapter.embed` returns the model's own
embedding with its rows reordered as ``[CLS, det_1 … det_K, patches]``, so the detection
rows are prefix rows (``num_prefix = 1 + K``, query ``q`` at row ``1 + q``,
:attr:`HFYolosAdapter.detection_rows`). Attention is permutation-equivariant and the
position embeddings are added before the reordering, so every block computes exactly the
model's states (reordered), the attention maps are the model's with rows and columns
permuted, and true token removal (SkipPLUS, TIS, the removal metrics) keeps every
detection row, as it keeps CLS.

What is explained. A detector has no class logits of the image: the scores are per
detection row, read through :class:`~captum_vit.targets.DetectionTarget` (a class logit
or a box error of one query). The adapter exposes them to any target as
``Outputs.extra`` (:meth:`HFYolosAdapter.output_extras`): ``"detection_logits"``
``[n, K, C + 1]`` and ``"boxes"`` ``[n, K, 4]``, computed from the detection rows of the
final-normed tokens with the model's own MLP parameters (plain functional ops; the model
is never modified). Without a target the canonical head is the identity on the normed
CLS row (the model's own ``last_hidden_state[:, 0]``), which nothing explains: an integer
class target (or ``None``) is refused with a ``TypeError`` naming ``DetectionTarget``, and
the self-check compares the canonical forward's detection logits and boxes with the
model's own ``logits`` and ``pred_boxes``.

Mid position embeddings (``use_mid_position_embeddings=True``: the ``YolosConfig``
default, kept by yolos-small, yolos-small-dwr and yolos-base; ``hustvl/yolos-tiny`` has
none). Verified in the installed transformers (5.x, ``YolosEncoder.forward`` and
``InterpolateMidPositionEmbeddings``): the encoder keeps
``interpolation.mid_position_embeddings`` of shape ``[L - 1, 1, 1 + P_cfg + K, D]`` (one
table per block but the last, rows ``[CLS, patches, det]`` of the configured grid); once
per forward it resamples the patch rows of every table to the input's grid (bicubic,
``align_corners=False``, from ``config.image_size // patch_size``; the CLS and detection
rows as they are) and after layer ``i`` for ``i < L - 1`` adds table ``i`` to every token
of the hidden states, the detection tokens included; nothing is added after the last
layer, before the final ``layernorm``. It depends on the image size only, never on the
tokens: a constant on the residual stream. The adapter computes the tables with the
model's own ``encoder.interpolation((H, W))`` when it embeds images (the tables of the
last embedded input size are kept), reorders their rows like the states
(``[CLS, det, patches]``) and gives block ``i`` a
:attr:`~captum_vit.adapters.parts.BlockParts.post_add` that adds table ``i``
(:meth:`~captum_vit.adapters.ops.Ops.add_constant`). So DecompX puts it into the bias
source; the gradient rule sets (IxG, LRP, Chefer'21) pass the residual stream through it
unchanged, the constant absorbing its share like a bias; FullGrad+ counts it among the
biases of its block; the attention maps are unchanged (the next block's attention reads
the states with the constant added, as the model's does); under true token removal a kept
token receives the row of its original position (the same rows are dropped).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from captum_vit.adapters._typing import ModelTree
from captum_vit.adapters.catalog import Example, register_family
from captum_vit.adapters.families._examples import library, transformers_model
from captum_vit.adapters.families._hf import HFPatchGrid, encoder_blocks, is_transformers_model
from captum_vit.adapters.ops import Ops, patch_projection
from captum_vit.adapters.parts import HeadParts, NormParts
from captum_vit.adapters.parts import layer_norm_parts as _norm

CLASSES = ("YolosForObjectDetection",)


def _example(mid: bool = False) -> Callable[..., nn.Module]:
    """A builder of a small ``YolosForObjectDetection`` (32 x 48 px, patch 8, width 32, 4
    heads, 3 detection tokens; ``mid``: mid position embeddings, drawn far from zero)."""
    def build(*, seed: int = 0, depth: int = 3, dtype: torch.dtype = torch.float64,
              num_classes: int = 4, **overrides: Any) -> nn.Module:
        cfg = library("transformers").YolosConfig(
            image_size=[32, 48], patch_size=8, num_channels=3, hidden_size=32,
            num_hidden_layers=depth, num_attention_heads=4, intermediate_size=64,
            num_labels=num_classes, num_detection_tokens=3, use_mid_position_embeddings=mid,
            layer_norm_eps=1e-6, **overrides)
        model = transformers_model("YolosForObjectDetection", cfg, seed, dtype)
        if mid:  # the randomiser's fan-in scale leaves them near zero
            mids = cast(Tensor, cast(Any, model).vit.encoder.interpolation
                        .mid_position_embeddings)
            g = torch.Generator().manual_seed(seed + 7)
            with torch.no_grad():
                mids.copy_(0.5 * torch.randn(mids.shape, generator=g, dtype=mids.dtype))
        return model

    return build

_NO_LOGITS = (
    "{name} is an object detector: it has no class logits of the image to explain. "
    "Explain one detection with target=captum_vit.targets.DetectionTarget(query, label) "
    "(query: a detection token index or 'best'; label: a class index; box=...: the box "
    "error instead of the class logit)")


def _mlp(layers: nn.ModuleList, where: str) -> tuple[tuple[Tensor, Tensor | None], ...]:
    """The (weight, bias) of each linear layer of a ``YolosMLPPredictionHead``."""
    linears = [m for m in layers if isinstance(m, nn.Linear)]
    if len(linears) != len(layers):
        raise TypeError(f"{where} is not a stack of nn.Linear layers; captum_vit reads "
                        "YOLOS's MLP prediction heads")
    return tuple((m.weight, m.bias) for m in linears)


def _run_mlp(x: Tensor, layers: tuple[tuple[Tensor, Tensor | None], ...]) -> Tensor:
    """``YolosMLPPredictionHead.forward`` on the parameters ``layers``: ReLU between the
    linear layers, none after the last."""
    for i, (w, b) in enumerate(layers):
        x = F.linear(x, w, b)
        if i < len(layers) - 1:
            x = F.relu(x)
    return x


def is_hf_yolos(model: nn.Module) -> bool:
    """``True`` for Hugging Face ``YolosForObjectDetection`` (transformers optional)."""
    return is_transformers_model(model, CLASSES)


@register_family(
    is_hf_yolos,
    supports="Hugging Face YolosForObjectDetection (with or without mid position "
             "embeddings; explained through DetectionTarget)",
    tags=("detection",),
    notes=("With or without mid position embeddings (`hustvl/yolos-tiny`, -small, -base); "
           "any input size divisible by the patch: ✅ with `DetectionTarget` (detection tokens "
           "are prefix rows `[CLS, det, patches]`, kept by token removal; the chosen token is "
           "read out as a class token: maps equal a DeiT twin's to 1e-12, every method but "
           "Chefer'21, whose LRP treats a model's linear head by its own rule; the mid position "
           "embeddings, resampled to the input size by the model's own code, are a constant on "
           "the residual stream: DecompX's bias source, dropped with their tokens under token "
           "removal) — refused: class-index targets"),
    examples={
        # support-matrix columns: the detector without and with mid position embeddings
        "hf_yolos": Example(_example(), (32, 48), library="transformers", target="detection",
                            tags=("matrix",), suite=False),
        "hf_yolos_mid": Example(_example(mid=True), (32, 48), library="transformers",
                                target="detection", tags=("matrix",), suite=False),
    })
class HFYolosAdapter(HFPatchGrid):
    """Canonical view of a Hugging Face ``YolosForObjectDetection`` (never modified).

    Attributes:
        num_queries (int): ``K``, the detection tokens.
        detection_rows (tuple of int): the canonical rows of the detection tokens,
            ``(1, …, K)`` (query ``q`` at row ``1 + q``).

    Examples::

        >>> from captum_vit.adapters import adapt
        >>> ad = adapt(yolos)                       # a YolosForObjectDetection
        >>> ad.num_prefix == 1 + yolos.config.num_detection_tokens
        True
    """

    model: ModelTree  # read by attribute names (captum_vit.adapters._typing)

    def __init__(self, model: ModelTree) -> None:
        self.model = model
        name = type(model).__name__
        cfg = model.config
        self.backbone = model.vit
        self.layers = self.backbone.encoder.layer
        self.blocks = encoder_blocks(self.layers, cfg, name)
        self.in_chans = int(cfg.num_channels)
        self.num_queries = int(cfg.num_detection_tokens)
        if self.num_queries < 1:
            raise TypeError(f"{name} has no detection tokens (num_detection_tokens=0)")
        self.num_prefix = 1 + self.num_queries
        self.detection_rows = tuple(range(1, 1 + self.num_queries))
        self.readout = "token"
        self.no_output_reason = _NO_LOGITS.format(name=name)
        self.class_mlp = _mlp(model.class_labels_classifier.layers,
                              f"{name}.class_labels_classifier")
        self.box_mlp = _mlp(model.bbox_predictor.layers, f"{name}.bbox_predictor")
        norm = _norm(self.backbone.layernorm, f"{name}.vit.layernorm")
        self.head = HeadParts(norm, None, ((0, None, None),))  # the normed CLS row
        # mid position embeddings: the tables of the last embedded input size
        self.mid = self.backbone.encoder.interpolation \
            if getattr(cfg, "use_mid_position_embeddings", False) else None
        self._mid_tables: tuple[tuple[int, int], Tensor] | None = None
        if self.mid is not None:
            self.blocks = [dataclasses.replace(p, post_add=functools.partial(self._mid_row, l))
                           for l, p in enumerate(self.blocks[:-1])] + self.blocks[-1:]

    # -- embedding -----------------------------------------------------------------------
    def _reorder(self, x: Tensor) -> Tensor:
        """The model's ``[CLS, patches, det]`` rows as ``[CLS, det, patches]`` (dim 1 of
        ``x`` [..., N, D] counted from the end: also the mid tables [L-1, N, D])."""
        k = self.num_queries
        return torch.cat([x[..., :1, :], x[..., -k:, :], x[..., 1:-k, :]], dim=-2)

    def _mid_embeddings(self, inputs: Tensor) -> None:
        """Keep the mid position embeddings of images of ``inputs``' size: the model's own
        ``encoder.interpolation((H, W))`` [L-1, 1, N, D], rows reordered, [L-1, N, D]."""
        if self.mid is None:
            return
        size = (int(inputs.shape[-2]), int(inputs.shape[-1]))
        tables = self._reorder(self.mid(size)[:, 0])
        self._mid_tables = (size, tables)

    def _mid_row(self, l: int, positions: Tensor | None, n: int) -> Tensor:
        """Block ``l``'s mid position embedding [1, n, D] (or, for the tokens' original
        ``positions`` [B, n] under token removal, [B, n, D]): its
        :attr:`~captum_vit.adapters.parts.BlockParts.post_add`."""
        if self._mid_tables is None:
            raise ValueError("the mid position embeddings depend on the input size: get the "
                             "token states from adapter.embed(images) before running the "
                             "blocks")
        size, tables = self._mid_tables
        table = tables[l]
        if positions is None:
            if n != table.shape[0]:
                raise ValueError(
                    f"the mid position embeddings of the last embedded input size {size} "
                    f"cover {table.shape[0]} tokens but this sequence has {n}; embed these "
                    "images with adapter.embed first, or pass the kept tokens' positions")
            return table[None]
        positions = positions.to(table.device)
        if positions.numel() and int(positions.max()) >= table.shape[0]:
            raise ValueError(f"token positions up to {int(positions.max())} fall outside the "
                             f"{table.shape[0]} tokens of the last embedded input size {size}")
        return table[positions]

    def embed(self, inputs: Tensor, ops: Ops | None = None) -> Tensor:
        """The model's own ``vit.embeddings(pixel_values)`` (CLS, patches, detection
        tokens, resampled position embeddings) with the detection rows moved before the
        patches (the module docstring's canonical form).

        With ``ops`` (:meth:`ViTAdapter.embed`) the value is the model's embedding of the
        detached images and the patch projection runs through ``ops.linear`` as
        ``p - p.detach()`` (exactly 0) on the patch rows, so every pixel gradient goes
        through ``ops.linear``'s backward.
        """
        emb = self.backbone.embeddings
        self._mid_embeddings(inputs)
        if ops is None:
            return self._reorder(emb(inputs))
        x = self._reorder(emb(inputs.detach()))
        name = f"{type(self.model).__name__}.vit.embeddings"
        p = patch_projection(inputs, emb.patch_embeddings.projection, ops,
                             f"{name} patch projection").flatten(1, 2)
        return x + F.pad(p - p.detach(), (0, 0, self.num_prefix, 0))

    # -- what a target reads -------------------------------------------------------------
    def output_extras(self, tokens: Tensor) -> dict[str, Tensor]:
        """Per-detection outputs of the final-normed ``tokens`` [n, N, D]:
        ``"detection_logits"`` [n, K, C + 1] (the last class is "no object") and
        ``"boxes"`` [n, K, 4] (``(cx, cy, w, h)`` in ``[0, 1]``), the model's
        ``class_labels_classifier`` and ``bbox_predictor`` on its parameters."""
        det = tokens[:, 1:self.num_prefix]
        cls, box = self.class_mlp, self.box_mlp
        if self.state.settings.frozen:  # a gradient trace: no parameter gradients
            cls, box = (tuple((w.detach(), None if b is None else b.detach())
                              for w, b in mlp) for mlp in (cls, box))
        return {"detection_logits": _run_mlp(det, cls), "boxes": _run_mlp(det, box).sigmoid()}

    def self_check_outputs(self, inputs: Tensor) -> dict[str, tuple[Any, Tensor]]:
        """The model's own ``logits`` and ``pred_boxes`` against the canonical forward's
        detections (:meth:`detections`), which :meth:`ViTAdapter.self_check` compares."""
        with self.state.override(target=None, hidden=None, frozen=False):
            ref = self.model(pixel_values=inputs)
            ours = self.detections(inputs)
        return {"logit": (ref.logits, ours["detection_logits"]),
                "box": (ref.pred_boxes, ours["boxes"])}

    def detections(self, inputs: Tensor) -> dict[str, Tensor]:
        """The canonical forward's :meth:`output_extras` of images ``inputs``
        [B, C, H, W] (``"detection_logits"`` [B, K, C + 1], ``"boxes"`` [B, K, 4]): the
        model's ``logits`` and ``pred_boxes`` up to rounding.

        Examples::

            >>> out = adapt(yolos).detections(images)
            >>> out["detection_logits"].shape   # [B, num_detection_tokens, num_labels + 1]
        """
        self.refresh()
        ops = Ops()
        with self.state.override(target=None, hidden=None):
            x = self.embed(inputs)
            for l in range(len(self.blocks)):
                x = self.block(x, l, ops)
            # YOLOS always ends with its layernorm (the head's norm is never None)
            return self.output_extras(ops.norm(x, cast(NormParts, self.head.norm)))

    def parameter_stages(self) -> list[list[nn.Parameter]]:
        m = self.model
        stages = [[p for mod in (self.backbone.layernorm, m.class_labels_classifier,
                                 m.bbox_predictor) for p in mod.parameters()]]
        stages += [list(layer.parameters()) for layer in reversed(self.layers)]
        return stages  # the mid position embeddings are position embeddings: no stage
