"""What Hugging Face's depth estimators do after their DINOv2 backbone's encoder:
``DPTForDepthEstimation`` and ``DepthAnythingForDepthEstimation`` with a ``Dinov2Backbone``
(``config.backbone_config`` a ``Dinov2Config``). :class:`captum_vit.targets.DepthTarget`
reads it; the backbone itself is explained by
:class:`~captum_vit.adapters.families.hf_backbone.HFBackboneAdapter`.

Verified in the installed transformers (5.x, ``modeling_dinov2.py``, ``modeling_dpt.py``,
``modeling_depth_anything.py``, ``backbone_utils.py``):

- **the backbone's feature maps**: ``Dinov2Backbone.forward`` runs the encoder with every
  hidden state (``hidden_states[0]`` the embedding, ``hidden_states[k]`` the output of
  layer ``k-1``, i.e. ``x_k``; ``stage_names = ["stem", "stage1", …]``) and keeps, in
  stage order, those of ``out_features`` (``out_indices`` are their positions in
  ``stage_names``, so ``out_indices = (k, …)`` reads ``x_k``). Each is passed through the
  backbone's final ``layernorm`` when ``config.apply_layernorm`` and, when
  ``config.reshape_hidden_states``, loses its CLS row (``[:, 1:]``) and becomes
  ``[B, D, H/p, W/p]``;
- **DPT** (``backbone`` set, ``is_hybrid=False``): ``neck(feature_maps, H/p, W/p)`` with
  ``p = config.backbone_config.patch_size`` (reassemble: CLS read out by
  ``config.readout_type`` — ``"ignore"``, ``"add"`` or ``"project"`` — then projection and
  resizing; then fusion), and ``head(neck_outputs)`` (its ``head_in_index``, optional
  ``projection``, three convolutions, x2 upsampling, ReLU) -> ``predicted_depth [B, h, w]``;
- **Depth Anything**: ``neck(feature_maps, H/p, W/p)`` with ``p = config.patch_size``
  (reassemble drops the CLS row, ``[:, 1:]``; then fusion), and ``head(neck_outputs, H/p,
  W/p)`` (upsampling to ``(H/p·p, W/p·p)``, ReLU or sigmoid·``max_depth``) ->
  ``predicted_depth [B, H, W]``.

The model's own ``layernorm``, ``neck`` and ``head`` modules are called as they are;
nothing is copied or changed.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from captum_vit.adapters._typing import ModelTree
from captum_vit.adapters.scoring import Outputs

CLASSES = ("DPTForDepthEstimation", "DepthAnythingForDepthEstimation")
"""The depth estimators :class:`HFDepthHead` reads (with a ``Dinov2Backbone``)."""


class HFDepthHead:
    """The part of a Hugging Face depth estimator after its DINOv2 backbone's encoder:
    block outputs ``x_l`` -> ``predicted_depth``.

    Args:
        model (nn.Module): a ``DPTForDepthEstimation`` or
            ``DepthAnythingForDepthEstimation`` whose ``backbone`` is a ``Dinov2Backbone``.

    Attributes:
        blocks (tuple of int): the block outputs the neck reads, ``x_l`` for ``l`` in the
            backbone's ``out_indices`` (stage ``"stage{l}"`` is ``hidden_states[l]``).

    Raises:
        TypeError: another model, a DPT without a separate backbone (its own ViT,
            ``model.dpt``) or a backbone other than ``Dinov2Backbone``.
        ValueError: ``out_features`` containing the embedding (``"stem"``), or a Depth
            Anything ``config.patch_size`` different from the backbone's.

    Examples::

        >>> head = HFDepthHead(depth_model)
        >>> head.blocks
        (3, 6, 9, 12)
    """

    def __init__(self, model: ModelTree) -> None:
        name = type(model).__name__
        if name not in CLASSES or not type(model).__module__.startswith("transformers."):
            raise TypeError(f"model is {name}; captum_vit reads the depth heads of Hugging "
                            f"Face {' and '.join(CLASSES)} (with a DINOv2 backbone)")
        backbone = getattr(model, "backbone", None)
        if backbone is None or type(backbone).__name__ != "Dinov2Backbone":
            got = "its own ViT (model.dpt)" if backbone is None else type(backbone).__name__
            raise TypeError(f"{name} runs {got}; captum_vit reads depth estimators whose "
                            "backbone is a Dinov2Backbone (config.backbone_config a "
                            "Dinov2Config)")
        self.model = model
        self.backbone = backbone
        self.depth_anything = name == "DepthAnythingForDepthEstimation"
        cfg = backbone.config
        stages = list(backbone.out_indices)
        if 0 in stages:
            raise ValueError(f"{name}.backbone reads the embedding (out_features 'stem'); "
                             "DepthTarget explains block outputs x_1 .. x_L: build the "
                             "backbone with out_indices in [1, num_hidden_layers]")
        patch = backbone.embeddings.patch_embeddings.patch_size
        own = int(model.config.patch_size) if self.depth_anything else int(
            model.config.backbone_config.patch_size)
        if tuple(patch) != (own, own):
            raise ValueError(f"{name}.config.patch_size is {own} but its backbone's patches "
                             f"are {tuple(patch)}: the model's own forward cannot reshape "
                             "its tokens; make them equal")
        self.blocks: tuple[int, ...] = tuple(stages)
        self.apply_layernorm = bool(cfg.apply_layernorm)
        self.reshape = bool(cfg.reshape_hidden_states)

    def feature_maps(self, states: Sequence[Tensor], out: Outputs) -> list[Tensor]:
        """The backbone's ``feature_maps`` from the block outputs ``states`` (``x_l`` for
        the :attr:`blocks`, in order) of images on the patch grid ``out.grid``: its
        ``layernorm`` (``apply_layernorm``), then the patch rows on the grid
        ``[n, D, gh, gw]`` (``reshape_hidden_states``; the CLS row dropped)."""
        maps = []
        for h in states:
            if self.apply_layernorm:
                h = self.backbone.layernorm(h)
            maps.append(out.patches(h) if self.reshape else h)
        return maps

    def __call__(self, states: Sequence[Tensor], out: Outputs) -> Tensor:
        """``predicted_depth`` ``[n, h, w]`` of the model's own neck and head on the
        :meth:`feature_maps` of ``states``.

        Raises:
            ValueError: the neck or head is in training mode (dropout, batch-norm
                statistics would change the model): call ``model.eval()``.
        """
        m = self.model
        if m.neck.training or m.head.training:
            raise ValueError(f"{type(m).__name__}'s neck or head is in training mode; "
                             "DepthTarget runs them as they are: call model.eval() first")
        gh, gw = out.grid
        feats = m.neck(self.feature_maps(states, out), gh, gw)
        return m.head(feats, gh, gw) if self.depth_anything else m.head(feats)


def is_hf_depth(model: nn.Module) -> bool:
    """``True`` for the Hugging Face depth estimators of :data:`CLASSES` (with any
    backbone; :class:`HFDepthHead` checks it)."""
    return (type(model).__name__ in CLASSES
            and type(model).__module__.startswith("transformers."))
