"""Adapter for torchvision's ``VisionTransformer`` (``vit_b_16``, ``vit_b_32``, ``vit_l_16``,
``vit_l_32``, ``vit_h_14`` and any direct construction).

Only this file knows torchvision's attribute names (verified in torchvision's
``models/vision_transformer.py``): ``conv_proj`` (the patch convolution), ``class_token``,
``encoder.pos_embedding`` added to ``[CLS ; patches]``, ``encoder.dropout``,
``encoder.layers`` of ``EncoderBlock`` (``ln_1``, ``self_attention`` =
``nn.MultiheadAttention`` with packed ``in_proj_weight``/``in_proj_bias`` and ``out_proj``,
``ln_2``, ``mlp`` = Linear-GELU-Dropout-Linear-Dropout), ``encoder.ln``, then ``heads``:
``head``, after ``pre_logits`` (Linear) and ``act`` (Tanh) when the model was built with
``representation_size``. The readout is the class token; the input size is fixed
(``image_size``, square).

The adapter recomputes attention from the parameters, so ``nn.MultiheadAttention``'s
fused inference path (taken by ``model(x)`` in eval mode without gradient) only changes
the model's own output by rounding; the self-check compares at a relative tolerance.
A convolutional stem (``conv_stem_configs``) is refused by name.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor, nn

from captum_vit.adapters._typing import ModelTree
from captum_vit.adapters.base import ViTAdapter
from captum_vit.adapters.catalog import Example, register_family
from captum_vit.adapters.families._examples import library, randomize_
from captum_vit.adapters.families._torch import multihead_attention_fields
from captum_vit.adapters.layout import Layout
from captum_vit.adapters.ops import Ops, patch_projection
from captum_vit.adapters.parts import BlockParts, HeadParts, PreLogitsHeadParts
from captum_vit.adapters.parts import layer_norm_parts as _norm
from captum_vit.adapters.parts import linear_module as _linear


def _block_parts(blk: ModelTree, where: str) -> BlockParts:
    """The canonical parts of one ``EncoderBlock``; q/k/v are row views (through
    ``detach()``) of the packed ``in_proj_weight`` / ``in_proj_bias``."""
    mlp = blk.mlp
    attention = multihead_attention_fields(blk.self_attention, f"{where}.self_attention",
                                           batch_first=True)
    if not isinstance(mlp, nn.Sequential) or len(mlp) != 5 \
            or not isinstance(mlp[1], nn.GELU) or mlp[1].approximate != "none":
        raise TypeError(f"{where}.mlp must be torchvision's MLPBlock (Linear, exact GELU, "
                        "Dropout, Linear, Dropout)")
    fc1, fc2 = _linear(mlp[0], f"{where}.mlp[0]"), _linear(mlp[3], f"{where}.mlp[3]")
    return BlockParts(
        norm1=_norm(blk.ln_1, f"{where}.ln_1"), **attention, ls1=None,
        norm2=_norm(blk.ln_2, f"{where}.ln_2"),
        fc1_weight=fc1.weight, fc1_bias=fc1.bias, act=mlp[1],
        fc2_weight=fc2.weight, fc2_bias=fc2.bias, ls2=None,
    )


def is_torchvision_vit(model: nn.Module) -> bool:
    """``True`` for torchvision's ``VisionTransformer`` (and subclasses); torchvision is
    never imported for other models.

    Args:
        model (nn.Module): any model.

    Returns:
        bool: whether :class:`TorchvisionViTAdapter` applies.

    Examples::

        >>> import torchvision
        >>> is_torchvision_vit(torchvision.models.vit_b_32())
        True
    """
    module = sys.modules.get("torchvision.models.vision_transformer")
    if module is None:
        return False  # a torchvision model would have imported it
    return isinstance(model, module.VisionTransformer)


def _example(**extra: Any) -> Callable[..., nn.Module]:
    """A builder of a small torchvision ``VisionTransformer`` (32x32 inputs, patch 8, width
    16, 2 heads) with ``extra`` constructor options; ``overrides`` at build time too."""
    def build(*, seed: int = 0, depth: int = 3, dtype: torch.dtype = torch.float64,
              num_classes: int = 5, **overrides: Any) -> nn.Module:
        kwargs: dict[str, Any] = dict(image_size=32, patch_size=8, num_layers=depth,
                                      num_heads=2, hidden_dim=16, mlp_dim=32,
                                      num_classes=num_classes)
        kwargs.update(extra)
        kwargs.update(overrides)
        torch.manual_seed(seed)
        model = randomize_(library("torchvision.models").VisionTransformer(**kwargs), seed)
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():  # the names randomize_ does not know
            for name, p in model.named_parameters():
                if name.endswith("in_proj_weight"):  # q and k rows: sharper attention
                    p[:2 * p.shape[1]] *= 1.5
                elif ".ln" in name and name.endswith("weight"):
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
                elif name in ("class_token", "encoder.pos_embedding"):
                    p.copy_(0.5 * torch.randn(p.shape, generator=g))
        return model.to(dtype).eval()

    return build


@register_family(
    is_torchvision_vit,
    supports="torchvision VisionTransformer (every vit_* builder, representation_size head "
             "included; not conv_stem_configs)",
    tags=("classifier", "packed"),
    notes=("Every `vit_*` builder; the `representation_size` head, `pre_logits` + Tanh, "
           "included; fixed input size `image_size`: ✅ (maps equal a timm twin's with the same "
           "weights to 1e-10, every method; `nn.MultiheadAttention`'s fused inference path "
           "changes the model's own output only by rounding) — refused: a convolutional stem "
           "(`conv_stem_configs`)"),
    examples={
        "torchvision": Example(_example(), (32, 32), library="torchvision"),
        # pre_logits + Tanh
        "torchvision_representation": Example(_example(representation_size=7), (32, 32),
                                              library="torchvision"),
    })
class TorchvisionViTAdapter(ViTAdapter):
    """Canonical view of a torchvision ``VisionTransformer`` (never modified).

    The q/k/v parts are views of each block's packed ``in_proj_weight``; they are re-read
    when the model's parameters are replaced (``model.to``). A model built with
    ``representation_size`` keeps its ``pre_logits`` Linear and Tanh in the head
    (:class:`PreLogitsHeadParts`).

    Args:
        model (nn.Module): a ``torchvision.models.VisionTransformer``.

    Raises:
        TypeError: a convolutional stem (``conv_stem_configs``), another head layout or a
            block the adapter does not know.

    Examples::

        >>> import torchvision
        >>> from captum_vit.adapters import adapt
        >>> model = torchvision.models.vit_b_16().eval()
        >>> type(adapt(model)).__name__, adapt(model).num_blocks
        ('TorchvisionViTAdapter', 12)
    """

    model: ModelTree  # read by attribute names (captum_vit.adapters._typing)

    def __init__(self, model: ModelTree) -> None:
        self.model = model
        name = type(model).__name__
        if not isinstance(model.conv_proj, nn.Conv2d):
            raise TypeError(f"{name} has a convolutional stem (conv_stem_configs); captum_vit "
                            "supports torchvision ViTs with the plain patch convolution "
                            "(every vit_* builder)")
        layers = list(model.encoder.layers)
        if not layers:
            raise TypeError(f"{name} has no encoder layers")
        self.blocks = [_block_parts(blk, f"{name}.encoder.layers[{i}]")
                       for i, blk in enumerate(layers)]
        self.num_prefix = 1
        self.readout = "token"
        self.in_chans = int(model.conv_proj.in_channels)
        self.head = self._head()

    def _head(self) -> HeadParts:
        """``encoder.ln``, the class token and ``heads`` (``pre_logits`` + Tanh, then
        ``head``)."""
        m, name = self.model, type(self.model).__name__
        heads = dict(m.heads.named_children())
        head = _linear(heads.pop("head", None), f"{name}.heads.head")
        pre = None
        if "pre_logits" in heads:
            act = heads.pop("act", None)
            if not isinstance(act, nn.Tanh):
                raise TypeError(f"{name}.heads.act is {type(act).__name__}; captum_vit "
                                "supports torchvision's Tanh representation layer")
            lin = _linear(heads.pop("pre_logits"), f"{name}.heads.pre_logits")
            pre = (lin.weight, lin.bias, act)
        if heads:
            raise TypeError(f"{name}.heads has {', '.join(heads)}; captum_vit supports "
                            "torchvision's head, optionally after pre_logits + act")
        return PreLogitsHeadParts(_norm(m.encoder.ln, f"{name}.encoder.ln"), None,
                                  ((0, head.weight, head.bias),), pre_logits=pre)

    def refresh(self) -> None:
        name = type(self.model).__name__
        for i, (p, blk) in enumerate(zip(self.blocks, self.model.encoder.layers,
                                         strict=True)):
            if cast(Tensor, p.q_weight).data_ptr() != blk.self_attention.in_proj_weight.data_ptr():
                self.blocks[i] = _block_parts(blk, f"{name}.encoder.layers[{i}]")

    @property
    def input_shape(self) -> tuple[int, tuple[int, int]]:
        size = int(self.model.image_size)
        return self.in_chans, (size, size)

    def parameter_stages(self) -> list[list[nn.Parameter]]:
        m = self.model
        stages = [[*m.encoder.ln.parameters(), *m.heads.parameters()]]
        stages += [list(blk.parameters()) for blk in reversed(m.encoder.layers)]
        return stages

    def check_inputs(self, inputs: Tensor) -> None:
        super().check_inputs(inputs)
        self.check_fixed_size(inputs, self.input_shape[1], "torchvision's VisionTransformer")

    def is_random(self) -> bool:
        return any(m.training and m.p > 0 for m in self.model.modules()
                   if isinstance(m, nn.Dropout)) or any(
            m.training and m.dropout > 0 for m in self.model.modules()
            if isinstance(m, nn.MultiheadAttention))

    def layout(self, inputs: Tensor) -> Layout:
        self.refresh()
        h, w = inputs.shape[-2:]
        p = int(self.model.patch_size)
        return Layout(num_prefix=1, grid=(int(h) // p, int(w) // p), patch_size=(p, p),
                      readout=self.readout, num_blocks=self.num_blocks,
                      num_heads=self.blocks[0].num_heads, image_size=(int(h), int(w)))

    def embed(self, inputs: Tensor, ops: Ops | None = None) -> Tensor:
        """The model's ``_process_input`` (patch convolution), class token, position
        embedding and ``encoder.dropout``; with ``ops`` the patch convolution as
        ``ops.linear`` of the unfolded patches (:meth:`ViTAdapter.embed`)."""
        self.refresh()
        m = self.model
        if ops is None:
            x = m._process_input(inputs)
        else:
            x = patch_projection(inputs, m.conv_proj, ops,
                                 f"{type(m).__name__}.conv_proj").flatten(1, 2)
        x = torch.cat([m.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        return m.encoder.dropout(x + m.encoder.pos_embedding)
