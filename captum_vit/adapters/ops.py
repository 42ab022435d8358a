"""Forward strategies: the primitive operations the canonical forward is written against.

Design. :meth:`captum_vit.adapters.ViTAdapter.block` and the head are written once,
against an :class:`Ops` object. Plain tensors give the real forward (with attention
probabilities materialised); :class:`FusedOps` the fused one (no probabilities, optional
padding mask); :class:`HeadsOps` the fused one that keeps each block's per-head tensors;
``Ops(linearize=True)`` keeps every forward value and linearises the backward (DecompX's
gradient route, :mod:`captum_vit.methods.decompx`: LayerNorm variance, ``q``/``k`` and the
activation gate detached) through the autograd functions below. Modified backward rule
sets (LRP) are a second idea and live in :mod:`captum_vit.adapters.rules`; decomposition
ops (DecompX) subclass :class:`Ops` in the methods.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from captum_vit.adapters.parts import (
    BlockParts,
    Heads,
    NormParts,
    PoolParts,
    affine,
    layer_norm_frozen_variance,
)


class _GateDetachedActivation(torch.autograd.Function):
    """``act(z)`` in the forward; ``g * act(z)/z`` in the backward (zero-origin slope).

    For the exact GELU the gate ``act(z)/z`` is ``Phi(z)``, the standard normal CDF.
    """

    @staticmethod
    def forward(ctx, z, act):
        y = act(z)
        ctx.save_for_backward(activation_gate(z, y))
        return y

    @staticmethod
    def backward(ctx, g):
        (gate,) = ctx.saved_tensors
        return g * gate, None


def activation_gate(z: Tensor, y: Tensor) -> Tensor:
    """Zero-origin slope ``y / z`` of an activation ``y = act(z)`` with ``act(0) = 0``
    (the GELU family, QuickGELU, SiLU, ReLU, tanh).

    At ``z == 0`` the limit of the GELU family (``0.5``) is used: there ``y / z`` is
    ``0 / 0``, the only NaN of the quotient for finite ``z``, which is replaced in place
    (two passes over the MLP width instead of a comparison and a masked fill more).
    """
    return (y / z).nan_to_num_(nan=0.5, posinf=math.inf, neginf=-math.inf)


def activation_gate_detached(z: Tensor, act: Callable[[Tensor], Tensor]) -> Tensor:
    return _GateDetachedActivation.apply(z, act)


def patch_projection(inputs: Tensor, conv: nn.Module, ops: Ops, what: str) -> Tensor:
    r"""A patch-embedding convolution as the linear map of the unfolded patches, through
    ``ops.linear`` (the patch conv takes the linear maps' LRP rules, as in AttnLRP,
    Achtibat et al., ICML 2024; :mod:`captum_vit.adapters.rules`).

    A convolution with ``stride == kernel_size``, no padding, dilation 1 and one group
    maps each patch :math:`p` (flattened in the order ``(channel, row, column)`` of the
    kernel) to :math:`W p + b` with :math:`W` the kernel as a ``[D, C k_h k_w]`` matrix;
    rows and columns of the image beyond the last whole patch are dropped, as the
    convolution drops them.

    Args:
        inputs (Tensor): images [B, C, H, W] (already padded as the model pads them).
        conv (nn.Module): the model's patch convolution (its own parameters, reshaped).
        ops (Ops): supplies ``linear``.
        what (str): the convolution's name in the model, for the error message.

    Returns:
        Tensor: the patch embeddings [B, gh, gw, D] (channels last).

    Raises:
        TypeError: ``conv`` is not such a convolution (overlapping or padded patches).
    """
    if not isinstance(conv, nn.Conv2d) or tuple(conv.stride) != tuple(conv.kernel_size) \
            or conv.padding not in ("valid", (0, 0)) or tuple(conv.dilation) != (1, 1) \
            or conv.groups != 1:
        raise TypeError(f"{what} is not a patch projection (a Conv2d with stride == "
                        "kernel_size, no padding, dilation 1, one group), so it has no "
                        "linear-map form for the LRP rules; explain at='tokens'")
    b, c, h, w = inputs.shape
    ph, pw = conv.kernel_size
    gh, gw = h // ph, w // pw
    patches = inputs[:, :, :gh * ph, :gw * pw].reshape(b, c, gh, ph, gw, pw)
    patches = patches.permute(0, 2, 4, 1, 3, 5).reshape(b, gh, gw, c * ph * pw)
    return ops.linear(patches, conv.weight.reshape(conv.out_channels, -1), conv.bias)


def tubelet_projection(inputs: Tensor, conv: nn.Module, ops: Ops, what: str) -> Tensor:
    """A tubelet-embedding ``Conv3d`` (stride = kernel ``(t, ph, pw)``, no padding) as the
    linear map of the unfolded tubelets through ``ops.linear`` (the video form of
    :func:`~captum_vit.adapters.ops.patch_projection`).

    Args:
        inputs (Tensor): videos [B, T, C, H, W].
        conv (nn.Module): the model's ``Conv3d`` (its own parameters, reshaped).
        ops (Ops): supplies ``linear``.
        what (str): the convolution's name in the model, for the error message.

    Returns:
        Tensor: tubelet embeddings [B, F·gh·gw, D] in the order (slice, row, column).

    Raises:
        TypeError: ``conv`` is not such a convolution.
    """
    if not isinstance(conv, nn.Conv3d) or tuple(conv.stride) != tuple(conv.kernel_size) \
            or conv.padding not in ("valid", (0, 0, 0)) or conv.groups != 1 \
            or tuple(conv.dilation) != (1, 1, 1):
        raise TypeError(f"{what} is not a tubelet projection (a Conv3d with stride == "
                        "kernel_size, no padding, one group); explain at='tokens'")
    b, frames, c, h, w = inputs.shape
    t, ph, pw = conv.kernel_size
    f, gh, gw = frames // t, h // ph, w // pw
    x = inputs[:, :f * t, :, :gh * ph, :gw * pw].reshape(b, f, t, c, gh, ph, gw, pw)
    x = x.permute(0, 1, 4, 6, 3, 2, 5, 7).reshape(b, f * gh * gw, c * t * ph * pw)
    return ops.linear(x, conv.weight.reshape(conv.out_channels, -1), conv.bias)



class Ops:
    """The primitive operations of the canonical forward, on plain tensors.

    Subclasses (DecompX, FullGrad+'s bias probes) override them to carry other values;
    :class:`FusedOps` is the plain forward without attention probabilities.

    Args:
        linearize (bool): keep the forward and linearise the backward (DecompX's gradient
            route, :mod:`captum_vit.methods.decompx`).
        positions (Tensor, optional): [B, N] original token indices of the sequence, passed
            to :meth:`BlockParts.attention` (``None`` = ``0..N-1``).
    """

    def __init__(self, linearize: bool = False, *, positions: Tensor | None = None) -> None:
        self.linearize = linearize
        self.positions = positions

    def norm(self, x: Any, p: NormParts) -> Any:
        if p.rms:
            return p(x, frozen=self.linearize)
        if self.linearize:
            return layer_norm_frozen_variance(x, p.weight, p.bias, p.eps)
        return F.layer_norm(x, (x.shape[-1],), p.weight, p.bias, p.eps)

    def linear(self, x: Any, weight: Tensor, bias: Tensor | None) -> Any:
        return affine(x, weight, bias)

    def act(self, z: Any, act: Callable[[Tensor], Tensor]) -> Any:
        return activation_gate_detached(z, act) if self.linearize else act(z)

    def gated(self, g: Any, z: Any, act: Callable[[Tensor], Tensor]) -> Any:
        """Gated unit ``act(g) ⊙ z``; linearised: the activated gate is a constant
        (our choice: the gated analogue of DecompX's zero-origin GELU rule,
        :mod:`captum_vit.methods.decompx`)."""
        a = act(g)
        return (a.detach() if self.linearize else a) * z

    def scale(self, x: Any, gamma: Tensor) -> Any:
        return x * gamma

    def normalize(self, x: Any) -> Any:
        """``x / ‖x‖`` over the last dimension; linearised: the norm is a constant."""
        n = x.norm(dim=-1, keepdim=True)
        return x / (n.detach() if self.linearize else n)

    def add(self, x: Any, y: Any) -> Any:
        return x + y

    def add_constant(self, x: Any, c: Tensor) -> Any:
        """``x + c`` for a constant ``c`` [1 or B, N, D] that depends on no token (a block's
        :attr:`~captum_vit.adapters.parts.BlockParts.post_add`, YOLOS's mid position
        embeddings): its gradient is the identity, so a gradient rule set passes it
        unchanged (the constant absorbs its share, like a bias)."""
        return x + c

    def attention(self, u: Any, p: BlockParts) -> tuple[Any, Tensor | None]:
        """Attention mix before the output projection, [B, N, H*d], and the probabilities."""
        return p.attention(u, materialize=True, positions=self.positions,
                           detach_qk=self.linearize)

    def pool_attention(self, x: Any, p: PoolParts) -> tuple[Any, Tensor | None]:
        """Attention-pool mix before its output projection, [B, Q, H*d], and the pool's
        probabilities [B, H, Q, N] (linearised: ``k`` detached; :class:`PoolParts`)."""
        return p.attention(x, materialize=True, detach_k=self.linearize)

    def pool(self, x: Any, row: int | str, num_prefix: int) -> Any:
        return x[:, num_prefix:].mean(1) if row == "avg" else x[:, row]

    def gather(self, x: Any, merge: Any) -> Any:
        """The concatenated children [B, N', 4C] of a patch merge
        (:class:`~captum_vit.adapters.windows.MergeParts`) on token states [B, N, C]."""
        return merge.gather(x)

    def maxpool(self, x: Any, pool: Any) -> Any:
        """The channel-wise maximum over each 2×2 group of token states [B, N, C] (a block's
        :class:`~captum_vit.adapters.windows.QueryPool`, Hiera): piecewise linear, its
        gradient the maximal child's."""
        return pool.max(x)

    def mean(self, xs: Sequence[Any]) -> Any:
        return xs[0] if len(xs) == 1 else sum(xs[1:], xs[0]) / len(xs)

    def concat(self, xs: Sequence[Any]) -> Any:
        """Pooled parts side by side (DINOv2's ``[CLS ; mean]``), last dimension."""
        return xs[0] if len(xs) == 1 else torch.cat(list(xs), -1)

    def contract(self, x: Any, g: Tensor) -> Any:
        """``Σ_{i,d} x[b, i, d] g[b, i, d, k]``: token states ``[B, N, D]`` against
        per-column weights ``[B, N, D, K]`` -> ``[B, K]`` (a target linearised at the
        states it reads, :meth:`~captum_vit.adapters.ViTAdapter.logits`)."""
        return torch.einsum("bnd,bndk->bk", x, g.to(x.dtype))

    def value(self, x: Any) -> Tensor:
        """The real tensor behind a value of these ops."""
        return x


class FusedOps(Ops):
    """The plain forward with fused attention, optionally on padded token sets.

    Scoring never needs the attention probabilities, so they are not materialised
    (``F.scaled_dot_product_attention``). With ``key_mask`` ([B, N] bool, ``True`` = real
    token) the padded tokens take no part in attention as keys and are left out of
    average pooling, so every real token's state and the logits equal those of the
    unpadded shorter sequence.

    Args:
        key_mask (Tensor, optional): real tokens [B, N]; ``None`` = all real.
        positions (Tensor, optional): [B, N] original token indices (see :class:`Ops`).

    Examples::

        >>> logits = adapter.run(x0, keep=kept_patches, ops=FusedOps())
    """

    def __init__(self, key_mask: Tensor | None = None, positions: Tensor | None = None) -> None:
        super().__init__(positions=positions)
        self.key_mask = key_mask

    def attention(self, u: Tensor, p: BlockParts) -> tuple[Tensor, None]:
        mix, _ = p.attention(u, materialize=False, key_mask=self.key_mask,
                             positions=self.positions)
        return mix, None

    def pool_attention(self, x: Tensor, p: PoolParts) -> tuple[Tensor, None]:
        mix, _ = p.attention(x, materialize=False, key_mask=self.key_mask)
        return mix, None

    def pool(self, x: Tensor, row: int | str, num_prefix: int) -> Tensor:
        if row != "avg" or self.key_mask is None:
            return super().pool(x, row, num_prefix)
        w = self.key_mask[:, num_prefix:].to(x.dtype)[..., None]
        return (x[:, num_prefix:] * w).sum(1) / w.sum(1)


class HeadsOps(Ops):
    """The plain forward with fused attention that hands each block's :class:`Heads` to
    the trace instead of materialised probabilities (``trace(attention="fused")``): no
    ``[B, H, N, N]`` tensor is kept for the backward.

    Args:
        linearize (bool): as in :class:`Ops` (``q``, ``k`` detached in the attention).
    """

    def attention(self, u: Tensor, p: BlockParts) -> tuple[Tensor, Heads]:  # type: ignore[override]
        heads: list[Heads] = []
        mix, _ = p.attention(u, materialize=False, positions=self.positions,
                             detach_qk=self.linearize, heads=heads)
        return mix, heads[0]

