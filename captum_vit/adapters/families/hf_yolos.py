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

Not supported: ``use_mid_position_embeddings=True`` (the default of ``YolosConfig`` and
of the small and base checkpoints; ``hustvl/yolos-tiny`` has none). Those embeddings are
an additive term between blocks that the canonical block has no place for (every
decomposition and rule set of the methods would have to carry it); such a model is
refused by name with a ``TypeError``.
"""

from __future__ import annotations

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
    heads, 3 detection tokens; ``mid``: mid-position embeddings, which the family refuses)."""
    def build(*, seed: int = 0, depth: int = 3, dtype: torch.dtype = torch.float64,
              num_classes: int = 4, **overrides: Any) -> nn.Module:
        cfg = library("transformers").YolosConfig(
            image_size=[32, 48], patch_size=8, num_channels=3, hidden_size=32,
            num_hidden_layers=depth, num_attention_heads=4, intermediate_size=64,
            num_labels=num_classes, num_detection_tokens=3, use_mid_position_embeddings=mid,
            layer_norm_eps=1e-6, **overrides)
        return transformers_model("YolosForObjectDetection", cfg, seed, dtype)

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
    supports="Hugging Face YolosForObjectDetection (use_mid_position_embeddings=False; "
             "explained through DetectionTarget)",
    tags=("detection",),
    notes=("`use_mid_position_embeddings=False`, e.g. `hustvl/yolos-tiny`; any input size "
           "divisible by the patch: ✅ with `DetectionTarget` (detection tokens are prefix rows "
           "`[CLS, det, patches]`, kept by token removal; the chosen token is read out as a "
           "class token: maps equal a DeiT twin's to 1e-12, every method but Chefer'21, whose "
           "LRP treats a model's linear head by its own rule) — refused: class-index targets, "
           "mid-position embeddings"),
    examples={
        # support-matrix columns: the detector, and the mid-position one it refuses
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
        if getattr(cfg, "use_mid_position_embeddings", False):
            raise TypeError(
                f"captum_vit cannot explain this {name}: its config has "
                "use_mid_position_embeddings=True (a position embedding added between "
                "blocks, which the canonical ViT block has no place for); supported are "
                "YOLOS models with use_mid_position_embeddings=False, such as "
                "hustvl/yolos-tiny")
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

    # -- embedding -----------------------------------------------------------------------
    def _reorder(self, x: Tensor) -> Tensor:
        """The model's ``[CLS, patches, det]`` rows as ``[CLS, det, patches]``."""
        k = self.num_queries
        return torch.cat([x[:, :1], x[:, -k:], x[:, 1:-k]], dim=1)

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
        return stages
