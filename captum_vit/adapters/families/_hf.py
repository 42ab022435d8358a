"""Readers of Hugging Face transformers' ViT-like modules, written once for the
Hugging Face families: the layer reader :func:`layer_parts` (ViT, DeiT, DINOv2, CLIP,
SigLIP, VideoMAE and YOLOS layers) and :func:`encoder_blocks`, the patch-grid geometry
:class:`HFPatchGrid` (with YOLOS), the ViT engine :class:`HFViTBase` that the ViT, BEiT,
backbone and CLIP/SigLIP adapters extend, the Swin engine :class:`HFSwinBase` of the Swin
and Swin V2 adapters, the SigLIP / SigLIP2 pieces (:func:`vision_tower`,
:func:`siglip_pool`: the attention-pool head both versions share), and
:func:`is_transformers_model`.

(``ViTForImageClassification``, ``DeiTForImageClassification``,
``DeiTForImageClassificationWithTeacher``, ``Dinov2ForImageClassification``,
``Dinov2WithRegistersForImageClassification``).

With the family files, only this file knows their attribute names, in both layouts
transformers has used:
transformers 5 (``layers[l]`` or ``encoder.layer[l]``, ``attention.{q,k,v,o}_proj``,
``mlp.{fc1, fc2}``) and transformers 4 (``encoder.layer[l].attention.attention.{query, key,
value}``, ``attention.output.dense``, ``intermediate.dense`` / ``mlp.fc1``, ``output.dense``
/ ``mlp.fc2``); ViT/DeiT name the norms ``layernorm_before``/``layernorm_after``, DINOv2
``norm1``/``norm2`` with LayerScale ``layer_scale{1,2}.lambda1``. All are pre-LN ViTs with
separate q, k, v projections, which :class:`BlockParts` takes as they are. DINOv2's
classifier reads ``[CLS ; mean of the patch tokens]`` (registers excluded): its weight
splits into a CLS head and a patch-mean head whose outputs add (``readout="cls_mean"``).
DINOv2's gated MLP (``use_swiglu_ffn``) is read as
``gate_proj``/``up_proj``/``down_proj`` (transformers >= 5; the packed ``weights_in`` of
transformers 4 is refused). Verified in the installed transformers: in
``Dinov2WithRegistersEmbeddings`` the position embeddings are added to CLS and the patches
before the register tokens are inserted after CLS, so registers carry no position; the
adapter calls the model's own ``embeddings`` and reproduces its forward (tested at two
sizes).
The attention implementation (``sdpa``, ``eager``, ...) does not matter: the
adapter recomputes attention from the parameters and never asks for an eager reload.

The embedding is the model's own ``embeddings(pixel_values, interpolate_pos_encoding=...)``:
inputs of another size than ``config.image_size`` use the model's own interpolation of the
position embeddings, exactly as ``model(pixel_values, interpolate_pos_encoding=True)``.
``embed(inputs, ops)`` routes the pixel gradient through the patch projection as an
:class:`Ops` linear map (:meth:`HFViTAdapter.embed`).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch.nn.functional as F
from torch import Tensor, nn

from captum_vit.adapters._typing import ModelTree
from captum_vit.adapters.base import ViTAdapter
from captum_vit.adapters.layout import Layout
from captum_vit.adapters.ops import Ops, patch_projection, tubelet_projection
from captum_vit.adapters.parts import BlockParts, HeadParts, PoolParts
from captum_vit.adapters.parts import layer_norm_parts as _norm
from captum_vit.adapters.windows import MergeParts


def pair(v: Any) -> tuple[int, int]:
    return (int(v[0]), int(v[1])) if isinstance(v, list | tuple) else (int(v), int(v))




DROPOUT_FIELDS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "drop_path_rate")
"""The configuration fields of the usual Hugging Face dropout rates."""


def has_config_dropout(model: ModelTree, fields: tuple[str, ...] = DROPOUT_FIELDS) -> bool:
    """Whether a Hugging Face ``model`` in training mode drops out (one of its
    configuration's rates ``fields`` is positive)."""
    cfg = model.config
    return bool(model.training) and any(getattr(cfg, n, 0) > 0 for n in fields)


def first_attribute(m: ModelTree, *names: str) -> ModelTree:
    """The first of the dotted attribute paths ``names`` that ``m`` has."""
    for name in names:
        obj: object = m
        for part in name.split("."):
            obj = getattr(obj, part, None)
        if obj is not None:
            return obj
    raise TypeError(f"{type(m).__name__} has none of {', '.join(names)}: this layer layout is "
                    "not supported")


def layer_parts(layer: ModelTree, num_heads: int, where: str) -> BlockParts:
    """The canonical parts of one ViT / DeiT / DINOv2 layer (either naming)."""
    att = first_attribute(layer, "attention", "self_attn")
    if hasattr(att, "q_proj"):  # transformers >= 5; CLIP and SigLIP name it out_proj
        q, k, v, o = att.q_proj, att.k_proj, att.v_proj, first_attribute(att, "o_proj", "out_proj")
    else:  # transformers 4
        q, k, v = att.attention.query, att.attention.key, att.attention.value
        o = att.output.dense
    mlp = getattr(layer, "mlp", None)
    gate = getattr(mlp, "gate_proj", None)
    if gate is None and "swiglu" in type(mlp).__name__.lower():
        raise TypeError(f"{where}.mlp is a packed SwiGLU (transformers 4 `weights_in`); "
                        "captum_vit reads the gated MLP of transformers >= 5 (gate_proj, "
                        "up_proj, down_proj): upgrade transformers")
    fc1 = first_attribute(layer, "mlp.up_proj", "mlp.fc1", "intermediate.dense")
    act = first_attribute(layer, "mlp.act_fn", "mlp.activation_fn", "mlp.activation",
                 "intermediate.intermediate_act_fn")
    fc2 = first_attribute(layer, "mlp.down_proj", "mlp.fc2", "output.dense")
    ls1, ls2 = (getattr(getattr(layer, n, None), "lambda1", None)
                for n in ("layer_scale1", "layer_scale2"))
    head_dim = q.weight.shape[0] // num_heads
    return BlockParts(
        norm1=_norm(first_attribute(layer, "layernorm_before", "norm1", "layer_norm1"),
                    f"{where}.norm1"),
        q_weight=q.weight, k_weight=k.weight, v_weight=v.weight,
        q_bias=q.bias, k_bias=k.bias, v_bias=v.bias,
        num_heads=num_heads, head_dim=head_dim, scale=head_dim ** -0.5,
        q_norm=nn.Identity(), k_norm=nn.Identity(),
        proj_weight=o.weight, proj_bias=o.bias, ls1=ls1,
        norm2=_norm(first_attribute(layer, "layernorm_after", "norm2", "layer_norm2"),
                    f"{where}.norm2"),
        fc1_weight=fc1.weight, fc1_bias=fc1.bias, act=act,
        fc2_weight=fc2.weight, fc2_bias=fc2.bias, ls2=ls2,
        gate_weight=None if gate is None else gate.weight,
        gate_bias=None if gate is None else gate.bias,
    )


def encoder_blocks(layers: Sequence[nn.Module], cfg: Any, name: str) -> list[BlockParts]:
    """The blocks of a Hugging Face encoder's ``layers`` (:func:`layer_parts` each).

    Args:
        layers (sequence of nn.Module): the encoder's layers, in order.
        cfg: the model's configuration (``num_attention_heads``).
        name (str): the model's class name, for the messages.

    Returns:
        list of BlockParts: one per layer.

    Raises:
        TypeError: the encoder has no layers.
    """
    if len(layers) == 0:
        raise TypeError(f"{name} has no transformer layers")
    return [layer_parts(layer, int(cfg.num_attention_heads), f"{name}.layer[{i}]")
            for i, layer in enumerate(layers)]


def vision_tower(model: ModelTree) -> ModelTree:
    """The module of a Hugging Face CLIP / SigLIP / SigLIP2 model holding ``embeddings``,
    ``encoder`` and ``post_layernorm`` (the model itself, or its ``vision_model``)."""
    while not hasattr(model, "embeddings") and hasattr(model, "vision_model"):
        model = model.vision_model
    return model


def siglip_pool(head: ModelTree, where: str) -> PoolParts:
    """The canonical parts of SigLIP's and SigLIP2's attention-pool head
    (``SiglipMultiheadAttentionPoolingHead``, ``Siglip2MultiheadAttentionPoolingHead``:
    ``probe`` attends over the tokens through a batch-first ``nn.MultiheadAttention``
    whose ``in_proj_weight`` rows are ``[q; k; v]``, then ``o + mlp(layernorm(o))``).

    Args:
        head (nn.Module): the pooling head.
        where (str): its name in the model, for the messages.

    Returns:
        PoolParts: views of the head's parameters (q/k/v row slices of ``in_proj``).

    Raises:
        TypeError: the attention is not a plain batch-first ``nn.MultiheadAttention``.
    """
    mha = head.attention
    if not (isinstance(mha, nn.MultiheadAttention) and mha._qkv_same_embed_dim
            and mha.batch_first and mha.bias_k is None and not mha.add_zero_attn):
        raise TypeError(f"{where}.attention is not a plain batch-first "
                        "nn.MultiheadAttention; this pooling head is not supported")
    w, b = mha.in_proj_weight.detach(), mha.in_proj_bias
    d = mha.embed_dim
    qb, kb, vb = (None, None, None) if b is None else b.detach().split(d)
    head_dim = d // mha.num_heads
    return PoolParts(
        latent=head.probe[0], q_weight=w[:d], q_bias=qb,
        k_weight=w[d:2 * d], k_bias=kb, v_weight=w[2 * d:], v_bias=vb,
        num_heads=mha.num_heads, head_dim=head_dim, scale=head_dim ** -0.5,
        q_norm=nn.Identity(), k_norm=nn.Identity(),
        proj_weight=mha.out_proj.weight, proj_bias=mha.out_proj.bias,
        norm=_norm(head.layernorm, f"{where}.layernorm"),
        fc1_weight=head.mlp.fc1.weight, fc1_bias=head.mlp.fc1.bias,
        act=head.mlp.activation_fn, fc2_weight=head.mlp.fc2.weight,
        fc2_bias=head.mlp.fc2.bias,
    )


class HFConfigured(ViTAdapter):
    """What every Hugging Face adapter built on :class:`HFPatchGrid` or
    :class:`HFVideoAdapter` reads from ``model.config``: the configuration itself, the
    input shape from ``image_size`` and the dropout test on :attr:`dropout_fields`."""

    model: ModelTree  # read by attribute names (captum_vit.adapters._typing)

    dropout_fields: tuple[str, ...] = DROPOUT_FIELDS
    """The configuration's dropout rates; the model is random in training mode when one
    is positive."""

    @property
    def config(self) -> Any:
        """The configuration of the vision transformer (image and patch size, heads)."""
        return self.model.config

    @property
    def input_shape(self) -> tuple[int, tuple[int, int]]:
        """``(channels, (H, W))`` (of one frame for a video model: the frame count is
        ``num_frames``)."""
        return self.in_chans, pair(self.config.image_size)

    def is_random(self) -> bool:
        return has_config_dropout(self.model, self.dropout_fields)


class HFPatchGrid(HFConfigured):
    """The geometry shared by the Hugging Face adapters with a fixed patch size (ViT, DeiT,
    DINOv2, BEiT, CLIP/SigLIP towers, YOLOS): the input check and the token layout. A
    subclass sets :attr:`model`, ``in_chans``, ``num_prefix``, ``readout`` and the
    blocks."""

    def check_inputs(self, inputs: Tensor) -> None:
        super().check_inputs(inputs)
        self.check_patch_multiple(inputs, pair(self.config.patch_size))

    def layout(self, inputs: Tensor) -> Layout:
        h, w = inputs.shape[-2:]
        ph, pw = pair(self.config.patch_size)
        return Layout(num_prefix=self.num_prefix, grid=(int(h) // ph, int(w) // pw),
                      patch_size=(ph, pw), readout=self.readout,
                      num_blocks=self.num_blocks, num_heads=self.blocks[0].num_heads,
                      image_size=(int(h), int(w)),
                      alpha=self.cls_alpha if self.readout == "cls_mean" else 0.5)


class HFViTBase(HFPatchGrid):
    """Canonical view of a Hugging Face ViT / DeiT image classifier (never modified): the
    engine of :class:`~captum_vit.adapters.HFViTAdapter` and its kin."""

    model: ModelTree  # read by attribute names (captum_vit.adapters._typing)
    backbone: ModelTree

    def __init__(self, model: ModelTree) -> None:
        self.model = model
        name = type(model).__name__
        # a classifier holds its backbone under base_model_prefix; a backbone is its own
        self.backbone = getattr(model, model.base_model_prefix, model)
        cfg = model.config
        layers = getattr(self.backbone, "layers", None)
        self.layers = self.backbone.encoder.layer if layers is None else layers
        self.blocks = encoder_blocks(self.layers, cfg, name)
        self.in_chans = int(cfg.num_channels)
        emb = self.backbone.embeddings
        self.num_prefix = 1 + hasattr(emb, "distillation_token") + int(
            getattr(cfg, "num_register_tokens", 0) or 0)
        self.interpolates = "interpolate_pos_encoding" in inspect.signature(
            emb.forward).parameters  # DINOv2 always interpolates
        heads = [getattr(model, n, None) for n in ("classifier", "cls_classifier",
                                                    "distillation_classifier")]
        for head in heads:
            if head is not None and not isinstance(head, nn.Linear):
                raise TypeError(f"{name} has no linear classifier head (num_labels=0?); "
                                "captum_vit needs a classifier returning logits, or pass "
                                f"its backbone model.{model.base_model_prefix} (an "
                                "embedding model) with vector targets")
        self.head = self._head()

    def _head(self) -> HeadParts:
        """Final norm and classifier(s); sets :attr:`readout`."""
        model, cfg = self.model, self.model.config
        norm = _norm(self.backbone.layernorm, f"{type(model).__name__}.layernorm")
        combine = "mean"
        rows: tuple[tuple[int | str, Tensor | None, Tensor | None], ...]
        if hasattr(model, "cls_classifier"):  # DeiT with teacher: mean of the two heads
            self.readout = "distilled"
            rows = ((0, model.cls_classifier.weight, model.cls_classifier.bias),
                    (1, model.distillation_classifier.weight,
                     model.distillation_classifier.bias))
        elif model.classifier.in_features == 2 * cfg.hidden_size:  # DINOv2: [CLS ; mean]
            self.readout, combine = "cls_mean", "sum"
            w, d = model.classifier.weight, cfg.hidden_size
            rows = ((0, w[:, :d], model.classifier.bias), ("avg", w[:, d:], None))
        else:
            self.readout = "token"
            rows = ((0, model.classifier.weight, model.classifier.bias),)
        return HeadParts(norm, None, rows, combine)

    def refresh(self) -> None:
        """DINOv2's two head halves are slices of ``classifier.weight``: re-slice them when
        ``model.to(...)`` replaced its storage."""
        if self.readout == "cls_mean" and (cast(Tensor, self.head.heads[0][1]).data_ptr()
                                           != self.model.classifier.weight.data_ptr()):
            self.head = self._head()

    def _size_kwargs(self, inputs: Tensor) -> dict[str, bool]:
        """``interpolate_pos_encoding`` for another size than the config's (ViT, DeiT)."""
        if not self.interpolates:
            return {}
        return {"interpolate_pos_encoding": tuple(inputs.shape[-2:]) != self.input_shape[1]}

    def embed(self, inputs: Tensor, ops: Ops | None = None) -> Tensor:
        """The model's own ``embeddings(pixel_values, interpolate_pos_encoding=...)``.

        With ``ops`` (:meth:`ViTAdapter.embed`) the patch rows (the last ``P`` rows, after
        CLS, distillation and register tokens) are the model's projection plus terms that
        do not depend on the pixels (position embeddings; no mask tokens here), so the
        model's embedding of the detached images is kept as the value and the patch
        projection ``p`` as ``ops.linear`` of the unfolded patches is added as
        ``p - p.detach()`` (exactly 0): the forward is exactly the model's, every pixel
        gradient runs through ``ops.linear``'s backward.
        """
        kwargs = self._size_kwargs(inputs)
        emb = self.backbone.embeddings
        if ops is None:
            return emb(inputs, **kwargs)
        x = emb(inputs.detach(), **kwargs)  # prefix tokens, positions: the model's code
        name = f"{type(self.model).__name__}.embeddings"
        conv = first_attribute(emb, "patch_embedding", "patch_embeddings.projection")
        p = patch_projection(inputs, conv, ops, f"{name} patch projection").flatten(1, 2)
        k = x.shape[1] - p.shape[1]
        if k != self.num_prefix:
            raise TypeError(f"{name} returned {x.shape[1]} tokens for {p.shape[1]} patches "
                            f"and {self.num_prefix} prefix tokens; this embedding layout is "
                            "not supported by the LRP rules (explain at='tokens')")
        return x + F.pad(p - p.detach(), (0, 0, k, 0))

    def model_outputs(self, inputs: Tensor) -> Tensor:
        return self.model(pixel_values=inputs, **self._size_kwargs(inputs)).logits

    def parameter_stages(self) -> list[list[nn.Parameter]]:
        m = self.model
        heads = [getattr(m, n, None) for n in ("classifier", "cls_classifier",
                                                "distillation_classifier")]
        stages = [[p for mod in [self.backbone.layernorm, *heads] if mod is not None
                   for p in mod.parameters()]]
        stages += [list(layer.parameters()) for layer in reversed(self.layers)]
        return stages


class HFSwinBase(ViTAdapter):
    """The reading shared by the Hugging Face Swin and Swin V2 adapters (the same
    ``embeddings``, ``encoder.layers[s].blocks`` / ``downsample``, ``layernorm``,
    ``pooler`` and ``classifier`` names): the pooler check, the mean head, the input and
    patch size, the parameter stages, the dropout test, the embedding and the outputs
    (logits, or ``pooler_output`` for the head-less model). A subclass sets
    :attr:`backbone` (``model.swin`` / ``model.swinv2`` or the head-less model itself).
    """

    model: ModelTree  # read by attribute names (captum_vit.adapters._typing)
    backbone: ModelTree

    def _read_parts(self) -> None:
        raise NotImplementedError

    def _adopt_hf(self, model: ModelTree, backbone_name: str) -> None:
        """Read ``model`` (its backbone ``model.<backbone_name>``, or the head-less model
        itself): the pooler check, the mean readout without prefix tokens, the blocks."""
        self.model = model
        self.backbone = getattr(model, backbone_name, model)
        self._check_pooler()
        self.readout = "avg"
        self.num_prefix = 0
        self.in_chans = int(model.config.num_channels)
        self._read_parts()

    def _first_grid(self) -> tuple[int, int]:
        """The first stage's token grid: the configured image padded to whole patches."""
        cfg = self.model.config
        ph, pw = pair(cfg.patch_size)
        h, w = pair(cfg.image_size)
        return (-(-h // ph), -(-w // pw))

    def _layers_and_merges(self, *, norm_last: bool = False
                           ) -> Iterator[tuple[str, ModelTree, tuple[int, int], MergeParts | None]]:
        """Every layer as ``(where, layer, grid, merge)``: ``grid`` is its token grid,
        ``merge`` the stage's ``downsample`` on its last layer, read as
        :class:`MergeParts` (``norm_last``: Swin V2's reduce-then-norm), else ``None``."""
        name = type(self.model).__name__
        grid = self._first_grid()
        for s, stage in enumerate(self.backbone.encoder.layers):
            for j, layer in enumerate(stage.blocks):
                where = f"{name}.encoder.layers[{s}].blocks[{j}]"
                merge = None
                if j == len(stage.blocks) - 1 and stage.downsample is not None:
                    down = stage.downsample
                    merge = MergeParts(grid=grid, norm=_norm(down.norm, f"{where} merge"),
                                       weight=down.reduction.weight, bias=down.reduction.bias,
                                       norm_last=norm_last)
                yield where, layer, grid, merge
                if merge is not None:
                    grid = merge.out_grid

    def _check_pooler(self) -> None:
        """Refuse a head-less model built without its pooling layer."""
        if getattr(self.backbone, "pooler", None) is None:
            raise TypeError(f"{type(self.model).__name__} has no pooling layer "
                            "(add_pooling_layer=False): captum_vit explains its pooled "
                            "embedding; build it with add_pooling_layer=True")

    def _read_hf_head(self, backbone_name: str) -> None:
        """The final ``layernorm`` and the ``classifier`` of the mean readout (an embedding
        without one); ``backbone_name`` is the attribute the refusal names."""
        m = self.model
        name = type(m).__name__
        classifier = getattr(m, "classifier", None)
        self.embedding = classifier is None
        if classifier is not None and not isinstance(classifier, nn.Linear):
            raise TypeError(f"{name} has no linear classifier (num_labels=0?); pass its "
                            f"backbone model.{backbone_name} (an embedding model) with vector "
                            "targets")
        weight = None if classifier is None else classifier.weight
        bias = None if classifier is None else classifier.bias
        self.head = HeadParts(_norm(self.backbone.layernorm, f"{name}.layernorm"), None,
                              (("avg", weight, bias),))

    @property
    def input_shape(self) -> tuple[int, tuple[int, int]]:
        return self.in_chans, pair(self.model.config.image_size)

    def parameter_stages(self) -> list[list[nn.Parameter]]:
        """The head (final norm, classifier), then the layers from the top; a merge's
        parameters go with the layer it follows."""
        m, bb = self.model, self.backbone
        head = [bb.layernorm, getattr(m, "classifier", None)]
        stages = [[p for mod in head if mod is not None for p in mod.parameters()]]
        blocks: list[list[nn.Parameter]] = []
        for stage in bb.encoder.layers:
            blocks += [list(layer.parameters()) for layer in stage.blocks]
            if stage.downsample is not None:
                blocks[-1] += list(stage.downsample.parameters())
        return stages + blocks[::-1]

    @property
    def patch_size(self) -> tuple[int, int]:
        return pair(self.model.config.patch_size)

    def is_random(self) -> bool:
        return has_config_dropout(self.model)

    def embed(self, inputs: Tensor, ops: Ops | None = None) -> Tensor:
        """The model's ``embeddings`` (patch projection, norm, absolute positions if
        configured); with ``ops`` the projection through ``ops.linear`` and the norm
        through ``ops.norm`` (:meth:`ViTAdapter.embed`)."""
        emb = self.backbone.embeddings
        if ops is None:
            return emb(inputs)[0]
        name = f"{type(self.model).__name__}.embeddings"
        pe = emb.patch_embeddings
        x = patch_projection(pe.maybe_pad(inputs, *inputs.shape[-2:]), pe.projection, ops,
                             f"{name}.patch_embeddings.projection")
        x = ops.norm(x.reshape(x.shape[0], -1, x.shape[-1]), _norm(emb.norm, f"{name}.norm"))
        pos = emb.position_embeddings
        return x if pos is None else x + pos.to(x.dtype)

    def embedding_norms(self) -> tuple[str, ...]:
        return ("embeddings.norm",)

    def model_outputs(self, inputs: Tensor) -> Tensor:
        out = self.model(pixel_values=inputs)
        return out.pooler_output if self.embedding else out.logits


def swin_twin_config(timm_model: nn.Module) -> dict[str, Any]:
    """The configuration keywords a Hugging Face Swin / Swin V2 twin of a timm
    ``SwinTransformer`` / ``SwinTransformerV2`` shares (sizes, depths, heads, window, MLP
    ratio, no dropout, no absolute positions, eps 1e-5).

    Args:
        timm_model (nn.Module): the timm model.

    Returns:
        dict: ``SwinConfig`` / ``Swinv2Config`` keywords.
    """
    m = cast(ModelTree, timm_model)
    return dict(
        image_size=tuple(m.patch_embed.img_size), patch_size=m.patch_embed.patch_size[0],
        num_channels=m.patch_embed.proj.in_channels, embed_dim=m.embed_dim,
        depths=[len(st.blocks) for st in m.layers],
        num_heads=[st.blocks[0].attn.num_heads for st in m.layers],
        window_size=m.layers[0].blocks[0].attn.window_size[0],
        mlp_ratio=m.layers[0].blocks[0].mlp.fc1.out_features / m.embed_dim, qkv_bias=True,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0,
        use_absolute_embeddings=False, num_labels=m.num_classes, layer_norm_eps=1e-5)


def swin_twin_weights(timm_model: nn.Module, pre: str, pooled: bool) -> dict[str, Tensor]:
    """The Hugging Face names of the weights a timm Swin / Swin V2 shares with its twin:
    patch embedding and its norm, final norm, classifier (unless ``pooled``), every block's
    ``norm1`` / ``norm2`` (``layernorm_before`` / ``layernorm_after``), stage ``s``'s merge
    (stage ``s - 1``'s ``downsample`` in Hugging Face). The attention and MLP are the
    family's own.

    Args:
        timm_model (nn.Module): the timm model.
        pre (str): the backbone's prefix in the twin (``"swin."``, ``"swinv2."`` or ``""``).
        pooled (bool): the twin is head-less.

    Returns:
        dict: twin name -> timm tensor.
    """
    m = cast(ModelTree, timm_model)
    src = timm_model.state_dict()
    out = {f"{pre}embeddings.patch_embeddings.projection.{k}": src[f"patch_embed.proj.{k}"]
           for k in ("weight", "bias")}
    out.update({f"{pre}embeddings.norm.{k}": src[f"patch_embed.norm.{k}"]
                for k in ("weight", "bias")})
    out.update({f"{pre}layernorm.{k}": src[f"norm.{k}"] for k in ("weight", "bias")})
    if not pooled:
        out.update({f"classifier.{k}": src[f"head.fc.{k}"] for k in ("weight", "bias")})
    for s, st in enumerate(m.layers):
        for j in range(len(st.blocks)):
            a, b = f"layers.{s}.blocks.{j}.", f"{pre}encoder.layers.{s}.blocks.{j}."
            for k in ("weight", "bias"):
                out[f"{b}layernorm_before.{k}"] = src[f"{a}norm1.{k}"]
                out[f"{b}layernorm_after.{k}"] = src[f"{a}norm2.{k}"]
        if s > 0:
            for k in ("reduction.weight", "norm.weight", "norm.bias"):
                out[f"{pre}encoder.layers.{s - 1}.downsample.{k}"] = \
                    src[f"layers.{s}.downsample.{k}"]
    return out


def is_transformers_model(model: nn.Module, names: Sequence[str]) -> bool:
    """Whether ``model`` is an instance of one of the transformers classes ``names`` (those
    the installed version has); transformers is never imported for other models.

    Examples::

        >>> is_transformers_model(torch.nn.Linear(2, 2), ["ViTModel"])
        False
    """
    if not type(model).__module__.startswith("transformers."):
        return False
    transformers = sys.modules["transformers"]  # imported: the model's class is from it
    return isinstance(model, tuple(getattr(transformers, n) for n in names
                                   if hasattr(transformers, n)))


def linear_head(classifier: nn.Module | None) -> tuple[Tensor | None, Tensor | None]:
    """``(weight, bias)`` of a linear ``classifier``; ``(None, None)`` for none or an
    ``nn.Identity`` (a model built with ``num_labels=0``)."""
    if isinstance(classifier, nn.Linear):
        return classifier.weight, classifier.bias
    return None, None


class HFVideoAdapter(HFConfigured):
    """What the Hugging Face video adapters (VideoMAE, ViViT, V-JEPA 2, TimeSformer) share:
    the frame count ``config.num_frames``, the classifier check, and for tubelet models
    (``tubelet`` frames x ``patch_size``) the layout, the fixed-size input check and the
    embedding through :func:`~captum_vit.adapters.ops.tubelet_projection`.

    Maps are returned per tubelet: ``output="tokens"`` [B, F·gh·gw], ``"grid"`` [B, 1, F,
    gh, gw] and pixels shaped like the video [B, T, C, H, W]
    (:mod:`captum_vit.adapters.layout`).
    """

    backbone: ModelTree
    layers: Any  # the transformer layers, in order
    tubelet: int
    patch_size: tuple[int, int]

    video = True
    dropout_fields: tuple[str, ...] = ("hidden_dropout_prob", "attention_probs_dropout_prob")

    @property
    def num_frames(self) -> int:
        """``T``: the frames of a video the model takes (``config.num_frames``)."""
        return int(self.config.num_frames)

    def read_classifier(self, family: str) -> None:
        """Set :attr:`embedding`: the model has no ``classifier``, or an ``nn.Identity`` one
        (built with ``num_labels=0``).

        Raises:
            TypeError: a classifier other than the linear one of ``family``.
        """
        classifier = getattr(self.model, "classifier", None)
        if classifier is not None and not isinstance(classifier, nn.Linear | nn.Identity):
            raise TypeError(f"{type(self.model).__name__}.classifier is "
                            f"{type(classifier).__name__}; captum_vit supports {family}'s "
                            "linear classifier")
        self.embedding = classifier is None or isinstance(classifier, nn.Identity)

    def check_fixed_video(self, inputs: Tensor) -> None:
        """Refuse frames of another size than ``image_size`` and another frame count than
        :attr:`num_frames` (a model with a fixed position table)."""
        t, (h, w) = inputs.shape[1], tuple(inputs.shape[-2:])
        size = self.input_shape[1]
        if (h, w) != size:
            raise ValueError(f"inputs frame size {(h, w)} does not match the model's fixed "
                             f"image_size {size}; resize the frames")
        if t != self.num_frames:
            raise ValueError(f"inputs have {t} frames but the model takes num_frames="
                             f"{self.num_frames} (its fixed position table); sample "
                             f"{self.num_frames} frames from the video")

    def layout(self, inputs: Tensor) -> Layout:
        t, h, w = (int(s) for s in inputs.shape[-4:-3] + inputs.shape[-2:])
        ph, pw = self.patch_size
        frames = t // self.tubelet
        return Layout(num_prefix=self.num_prefix, grid=(frames * (h // ph), w // pw),
                      patch_size=(ph, pw), readout=self.readout, num_blocks=self.num_blocks,
                      num_heads=self.blocks[0].num_heads, image_size=(h, w),
                      frames=frames, tubelet=self.tubelet)

    def tubelet_embed(self, inputs: Tensor, ops: Ops | None, embeddings: Any,
                      conv: nn.Module) -> Tensor:
        """``embeddings(inputs)``; with ``ops`` (:meth:`ViTAdapter.embed`) the embedding of
        the detached video is the value and the tubelet projection ``p`` (``conv``, a
        ``Conv3d``, as ``ops.linear`` of the unfolded tubelets,
        :func:`~captum_vit.adapters.ops.tubelet_projection`) is added to the patch rows as
        ``p - p.detach()`` (exactly 0): every pixel gradient runs through ``ops.linear``.
        """
        if ops is None:
            return embeddings(inputs)
        x = embeddings(inputs.detach())
        p = tubelet_projection(inputs, conv, ops,
                               f"{type(self.model).__name__} tubelet projection")
        zero = p - p.detach()
        if self.num_prefix:
            zero = F.pad(zero, (0, 0, self.num_prefix, 0))
        return x + zero

    def head_then_layers(self, *head: nn.Module | None) -> list[list[nn.Parameter]]:
        """:meth:`ViTAdapter.parameter_stages`: the parameters of the ``head`` modules
        (``None`` skipped), then each layer's, last first."""
        stages = [[p for mod in head if mod is not None for p in mod.parameters()]]
        stages += [list(layer.parameters()) for layer in reversed(self.layers)]
        return stages
