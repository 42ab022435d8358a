"""Readers of PyTorch's own modules, written once for every family that uses them:
``nn.MultiheadAttention`` with a packed in-projection (torchvision's ViT, OpenCLIP's
towers), overlapping patch convolutions as linear maps (Hiera, SAM 2), and the class
lookup of the predicates."""

from __future__ import annotations

import sys
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from captum_vit.adapters._typing import ModelTree
from captum_vit.adapters.ops import Ops


def multihead_attention_fields(attn: ModelTree, where: str, *,
                               batch_first: bool = False) -> dict[str, Any]:
    """The :class:`~captum_vit.adapters.parts.BlockParts` attention fields of an
    ``nn.MultiheadAttention`` with a packed in-projection: q/k/v are row views (through
    ``detach()``) of ``in_proj_weight`` / ``in_proj_bias``, the output projection is
    ``out_proj``, no q/k norms.

    Args:
        attn (nn.MultiheadAttention): the module.
        where (str): its name, for messages.
        batch_first (bool, optional): whether the block needs ``batch_first=True``
            (torchvision's encoder). Default ``False``.

    Returns:
        dict: ``q_weight`` ... ``proj_bias``, ``num_heads``, ``head_dim``, ``scale``,
        ``q_norm``, ``k_norm``.

    Raises:
        TypeError: not an ``nn.MultiheadAttention`` with a packed in-projection (or not
            batch-first where needed), with ``bias_k``/``bias_v`` or zero attention.
    """
    if not isinstance(attn, nn.MultiheadAttention) or attn.in_proj_weight is None \
            or attn.bias_k is not None or attn.add_zero_attn \
            or (batch_first and not attn.batch_first):
        first = ", batch_first" if batch_first else ""
        raise TypeError(f"{where} must be nn.MultiheadAttention with a packed "
                        f"in-projection{first}, no bias_k/bias_v and no zero attention")
    w = attn.in_proj_weight.detach()
    a = w.shape[0] // 3
    b = None if attn.in_proj_bias is None else attn.in_proj_bias.detach()
    bias = (None, None, None) if b is None else (b[:a], b[a:2 * a], b[2 * a:])
    head_dim = attn.head_dim
    identity = nn.Identity()
    return dict(q_weight=w[:a], k_weight=w[a:2 * a], v_weight=w[2 * a:],
                q_bias=bias[0], k_bias=bias[1], v_bias=bias[2],
                num_heads=attn.num_heads, head_dim=head_dim, scale=head_dim ** -0.5,
                q_norm=identity, k_norm=identity,
                proj_weight=attn.out_proj.weight, proj_bias=attn.out_proj.bias)


def loaded_class(module: str, name: str) -> type | None:
    """The class ``name`` of ``module`` if that module is imported already, else ``None``
    (a model of that class exists only once its module is imported, so a predicate never
    imports a library the model did not).

    Args:
        module (str): a dotted module name, e.g. ``"timm.models.eva"``.
        name (str): a class defined there, e.g. ``"Eva"``.

    Returns:
        type or None: the class.

    Examples::

        >>> loaded_class("no.such.module", "Model") is None
        True
    """
    cls = getattr(sys.modules.get(module), name, None)
    return cls if isinstance(cls, type) else None


def is_loaded_instance(model: object, module: str, name: str) -> bool:
    """Whether ``model`` is an instance of the class ``name`` of ``module``
    (:func:`loaded_class`: ``False`` while that module is not imported).

    Args:
        model (object): the model asked about.
        module (str): a dotted module name, e.g. ``"timm.models.eva"``.
        name (str): a class defined there, e.g. ``"Eva"``.

    Returns:
        bool: ``isinstance(model, module.name)``, without importing ``module``.

    Examples::

        >>> is_loaded_instance(object(), "no.such.module", "Model")
        False
    """
    cls = loaded_class(module, name)
    return cls is not None and isinstance(model, cls)


def conv_projection(inputs: Tensor, conv: nn.Module, ops: Ops, what: str) -> Tensor:
    """A patch-embedding convolution with overlapping patches (any kernel, stride and zero
    padding, one group) as the linear map of each output position's unfolded receptive
    field through ``ops.linear``: tokens ``[B, h w, D]`` in raster order, equal to the
    convolution. The unfolding is linear, so a rule set's relevance of overlapping
    patches sums at the pixels.

    Raises:
        TypeError: ``conv`` is not such a ``Conv2d``.
    """
    if not isinstance(conv, nn.Conv2d) or conv.groups != 1 or conv.padding_mode != "zeros" \
            or isinstance(conv.padding, str):
        raise TypeError(f"{what} is not a zero-padded Conv2d with one group; explain "
                        "at='tokens'")
    cols = F.unfold(inputs, conv.kernel_size, dilation=conv.dilation, padding=conv.padding,
                    stride=conv.stride)  # [B, C kh kw, L]
    return ops.linear(cols.transpose(1, 2), conv.weight.reshape(conv.out_channels, -1),
                      conv.bias)
