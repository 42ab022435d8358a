"""Autograd functions whose forward is the model's own computation and whose
backward is linearised (the "gradient route" of DecompX; see
:mod:`captum_vit.methods.decompx`).

Forward values are bit-identical to the ordinary operation; only the backward pass
changes, so a linearised trace gives exactly the same logits as the model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


class _LayerNormFrozenVariance(torch.autograd.Function):
    """LayerNorm whose backward treats ``1/sqrt(var + eps)`` as a constant.

    With ``y = (x - mean(x)) / s * w + b`` and ``s`` frozen, the input gradient is
    ``(g*w - mean(g*w)) / s``: the centring stays differentiable, the scale does not.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps):  # type: ignore[override]
        # one fused kernel gives the output and 1/sqrt(var + eps) (no second pass)
        y, _, inv_std = torch.native_layer_norm(x, (x.shape[-1],), weight, bias, eps)
        inv_std = inv_std.to(x.dtype)
        ctx.save_for_backward(inv_std, weight)
        return y

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        inv_std, weight = ctx.saved_tensors
        gw = g * weight if weight is not None else g
        gx = (gw - gw.mean(-1, keepdim=True)) * inv_std
        return gx, None, None, None


class _GateDetachedActivation(torch.autograd.Function):
    """``act(z)`` in the forward; ``g * act(z)/z`` in the backward (zero-origin slope).

    For the exact GELU the gate ``act(z)/z`` is ``Phi(z)``, the standard normal CDF.
    """

    @staticmethod
    def forward(ctx, z, act):  # type: ignore[override]
        y = act(z)
        ctx.save_for_backward(activation_gate(z, y))
        return y

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        (gate,) = ctx.saved_tensors
        return g * gate, None


def activation_gate(z: Tensor, y: Tensor) -> Tensor:
    """Zero-origin slope ``y / z`` of an activation ``y = act(z)``.

    At ``z == 0`` the limit of the GELU family (``0.5``) is used.
    """
    return (y / z).masked_fill_(z == 0, 0.5)  # three passes over the MLP width


def layer_norm_frozen_variance(x: Tensor, weight: Tensor | None, bias: Tensor | None,
                               eps: float) -> Tensor:
    return _LayerNormFrozenVariance.apply(x, weight, bias, eps)


def activation_gate_detached(z: Tensor, act: Callable[[Tensor], Tensor]) -> Tensor:
    return _GateDetachedActivation.apply(z, act)
