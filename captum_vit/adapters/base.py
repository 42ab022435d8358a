"""Model-independent part of the adapter layer.

An adapter translates one model family into a *canonical pre-LN ViT*: an embedding
function plus, per block, the parameter tensors of SPEC §0 (views of the model's own
parameters, never copies that could drift, never modifications). Everything after the
embedding is computed here by one canonical forward, written once against an
:class:`Ops` object. Plain tensors give the real forward (with attention probabilities
materialised); DecompX swaps in decomposition ops; the linearised switches of SPEC §3
only change the backward pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from captum_vit.adapters._linearize import (
    activation_gate_detached,
    layer_norm_frozen_variance,
)

READOUTS = ("token", "avg", "distilled")


@dataclass(frozen=True)
class Layout:
    """Token layout of one input batch (SPEC §0).

    Attributes:
        num_prefix (int): ``K``, the prefix tokens (CLS, DIST, registers) before the patches.
        grid (tuple[int, int]): ``(gh, gw)`` patch grid.
        patch_size (tuple[int, int]): ``(ph, pw)`` in pixels.
        readout (str): ``"token"`` (row 0), ``"distilled"`` (rows 0 and 1 averaged in the
            logit; maps read row 0) or ``"avg"`` (mean of the patch rows).
        num_blocks (int): ``L``.
        num_heads (int): ``H``.
        image_size (tuple[int, int]): ``(H, W)`` of the input images.
    """

    num_prefix: int
    grid: tuple[int, int]
    patch_size: tuple[int, int]
    readout: str
    num_blocks: int
    num_heads: int
    image_size: tuple[int, int]

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def num_tokens(self) -> int:
        return self.num_prefix + self.num_patches

    def readout_weights(self, num_tokens: int | None = None, *, dtype=None, device=None) -> Tensor:
        """Weights ``w`` [N] with readout row ``r = sum_i w_i row_i`` (SPEC §0)."""
        n = self.num_tokens if num_tokens is None else num_tokens
        w = torch.zeros(n, dtype=dtype, device=device)
        if self.readout == "avg":
            w[self.num_prefix:] = 1.0 / (n - self.num_prefix)
        else:
            w[0] = 1.0
        return w


@dataclass(frozen=True)
class NormParts:
    """A LayerNorm over the last dimension."""

    weight: Tensor | None
    bias: Tensor | None
    eps: float


@dataclass(frozen=True)
class BlockParts:
    """Canonical parameters of one pre-LN block (SPEC §0)."""

    norm1: NormParts
    qkv_weight: Tensor  # [3*H*d, D], rows ordered q, k, v and head-major within each
    qkv_bias: Tensor | None
    num_heads: int
    head_dim: int
    scale: float
    q_norm: Callable[[Tensor], Tensor]
    k_norm: Callable[[Tensor], Tensor]
    proj_weight: Tensor  # [D, H*d]
    proj_bias: Tensor | None
    ls1: Tensor | None
    norm2: NormParts
    fc1_weight: Tensor
    fc1_bias: Tensor | None
    act: Callable[[Tensor], Tensor]
    fc2_weight: Tensor
    fc2_bias: Tensor | None
    ls2: Tensor | None

    @property
    def inner_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def v_weight(self) -> Tensor:
        a = self.inner_dim
        return self.qkv_weight[2 * a:3 * a]

    @property
    def v_bias(self) -> Tensor | None:
        a = self.inner_dim
        return None if self.qkv_bias is None else self.qkv_bias[2 * a:3 * a]

    def attention_probs(self, u: Tensor, *, detach_qk: bool = False) -> tuple[Tensor, Tensor]:
        """Attention probabilities ``A`` [B, H, N, N] and values ``v`` [B, H, N, d] of ``u``."""
        b, n, _ = u.shape
        qkv = F.linear(u, self.qkv_weight, self.qkv_bias)
        qkv = qkv.reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        if detach_qk:
            q, k = q.detach(), k.detach()
        q = q * self.scale
        attn = (q @ k.transpose(-2, -1)).softmax(dim=-1)
        return attn, v

    def head_value_outputs(self, u: Tensor) -> Tensor:
        """Per-head ``u W_V^h W_O^h`` without biases, [B, H, N, D] (TokenTM Eq. 5)."""
        b, n, _ = u.shape
        v = F.linear(u, self.v_weight).reshape(b, n, self.num_heads, self.head_dim)
        wo = self.proj_weight.reshape(-1, self.num_heads, self.head_dim)  # [D, H, d]
        return torch.einsum("bnhe,dhe->bhnd", v, wo)


@dataclass(frozen=True)
class HeadParts:
    """Final norm, pooling and classifier(s).

    ``heads`` holds ``(row, weight, bias)``; ``row`` is a token index or ``"avg"``; the
    logits are the mean of the heads' outputs (one head, or CLS + DIST for DeiT).
    """

    norm: NormParts | None
    fc_norm: NormParts | None
    heads: tuple[tuple[int | str, Tensor, Tensor | None], ...]


class Ops:
    """The primitive operations of the canonical forward, on plain tensors.

    Subclasses (DecompX) override them to carry decomposed values instead.
    ``linearize=True`` keeps the forward and linearises the backward (SPEC §3).
    """

    def __init__(self, linearize: bool = False) -> None:
        self.linearize = linearize

    def norm(self, x: Any, p: NormParts) -> Any:
        if self.linearize:
            return layer_norm_frozen_variance(x, p.weight, p.bias, p.eps)
        return F.layer_norm(x, (x.shape[-1],), p.weight, p.bias, p.eps)

    def linear(self, x: Any, weight: Tensor, bias: Tensor | None) -> Any:
        return F.linear(x, weight, bias)

    def act(self, z: Any, act: Callable[[Tensor], Tensor]) -> Any:
        return activation_gate_detached(z, act) if self.linearize else act(z)

    def scale(self, x: Any, gamma: Tensor) -> Any:
        return x * gamma

    def add(self, x: Any, y: Any) -> Any:
        return x + y

    def attention(self, u: Any, p: BlockParts) -> tuple[Any, Tensor]:
        """Attention mix before the output projection, [B, N, H*d], and the probabilities."""
        attn, v = p.attention_probs(u, detach_qk=self.linearize)
        b, _, n, _ = attn.shape
        return (attn @ v).transpose(1, 2).reshape(b, n, p.inner_dim), attn

    def pool(self, x: Any, row: int | str, num_prefix: int) -> Any:
        return x[:, num_prefix:].mean(1) if row == "avg" else x[:, row]

    def mean(self, xs: Sequence[Any]) -> Any:
        return xs[0] if len(xs) == 1 else sum(xs[1:], xs[0]) / len(xs)

    def value(self, x: Any) -> Tensor:
        """The real tensor behind a value of these ops."""
        return x


@dataclass
class BlockRecord:
    """What one block saw and produced (SPEC §0 names)."""

    x: Tensor  # x_l, the block input
    u: Tensor  # LN1(x_l)
    attn: Tensor  # A_l [B, H, N, N]
    attn_out: Tensor  # ls1(a_l)
    mid: Tensor  # x_mid,l
    ffn_out: Tensor  # ls2(MLP(LN2(x_mid,l)))
    out: Tensor  # x_{l+1}


@dataclass
class Trace:
    """One forward pass: the embedding output, every block's record and the logits."""

    layout: Layout
    x0: Tensor
    blocks: list[BlockRecord] = field(default_factory=list)
    logits: Tensor | None = None
    start: int = 0

    @property
    def states(self) -> list[Tensor]:
        """Residual states ``x_start .. x_L``."""
        return [b.x for b in self.blocks] + [self.blocks[-1].out] if self.blocks else [self.x0]


class ViTAdapter:
    """Canonical pre-LN ViT on top of a concrete model (subclasses fill in the parts).

    Subclasses set ``model``, ``blocks`` (list of :class:`BlockParts`), ``head``
    (:class:`HeadParts`), ``num_prefix``, ``readout``, ``in_chans`` and implement
    :meth:`layout` and :meth:`embed`.
    """

    model: nn.Module
    blocks: list[BlockParts]
    head: HeadParts
    num_prefix: int
    readout: str
    in_chans: int

    def __init__(self) -> None:
        self._checked: set[tuple[Any, ...]] = set()

    # -- to implement ------------------------------------------------------------------
    def layout(self, inputs: Tensor) -> Layout:  # pragma: no cover - abstract
        raise NotImplementedError

    def embed(self, inputs: Tensor) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def check_inputs(self, inputs: Tensor) -> None:
        """Raise a clear error for inputs the model cannot take (subclasses extend)."""

    # -- canonical forward ----------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def block(self, x: Any, l: int, ops: Ops,
              record: list[BlockRecord] | None = None) -> Any:
        """Block ``l`` on ``x`` (SPEC §0): attention sublayer then FFN sublayer."""
        p = self.blocks[l]
        u = ops.norm(x, p.norm1)
        a, attn = ops.attention(u, p)
        a = ops.linear(a, p.proj_weight, p.proj_bias)
        if p.ls1 is not None:
            a = ops.scale(a, p.ls1)
        mid = ops.add(x, a)
        h = ops.linear(ops.norm(mid, p.norm2), p.fc1_weight, p.fc1_bias)
        f = ops.linear(ops.act(h, p.act), p.fc2_weight, p.fc2_bias)
        if p.ls2 is not None:
            f = ops.scale(f, p.ls2)
        out = ops.add(mid, f)
        if record is not None:
            v = ops.value
            record.append(BlockRecord(v(x), v(u), attn, v(a), v(mid), v(f), v(out)))
        return out

    def logits(self, x: Any, ops: Ops) -> Any:
        """Final norm, pooling and head(s) on the last residual state."""
        h = self.head
        if h.norm is not None:
            x = ops.norm(x, h.norm)
        outs = []
        for row, weight, bias in h.heads:
            z = ops.pool(x, row, self.num_prefix)
            if h.fc_norm is not None:
                z = ops.norm(z, h.fc_norm)
            outs.append(ops.linear(z, weight, bias))
        return ops.mean(outs)

    def run(self, x: Tensor, start: int = 0, stop: int | None = None,
            keep: Tensor | None = None, *, ops: Ops | None = None) -> Tensor:
        """Run blocks ``start..stop-1`` on token states ``x`` (and the head if ``stop == L``).

        Args:
            x (Tensor): token states ``x_start`` of shape [B, N, D].
            start (int): first block to run.
            stop (int, optional): one past the last block; ``None`` = L, which also
                applies the final norm and head and returns logits.
            keep (Tensor, optional): patch indices [B, n] (or a bool mask [B, P] with the
                same count per row) of the patch tokens to keep; prefix tokens are always
                kept. This is true token removal (SPEC §6.3).
            ops (Ops, optional): primitive operations (default: plain forward).

        Returns:
            Logits [B, classes] when ``stop == L``, else the token states ``x_stop``.
        """
        L = self.num_blocks
        stop = L if stop is None else stop
        if not 0 <= start <= stop <= L:
            raise ValueError(f"need 0 <= start <= stop <= {L}, got start={start}, stop={stop}")
        ops = ops or Ops()
        if keep is not None:
            x = self.select_tokens(x, keep)
        for l in range(start, stop):
            x = self.block(x, l, ops)
        return self.logits(x, ops) if stop == L else x

    def select_tokens(self, x: Tensor, keep: Tensor) -> Tensor:
        """Prefix tokens plus the kept patch tokens of ``x`` [B, N, D]."""
        k = self.num_prefix
        b, n, d = x.shape
        if keep.dtype == torch.bool:
            if keep.shape != (b, n - k):
                raise ValueError(f"keep mask must have shape {(b, n - k)}, got {tuple(keep.shape)}")
            counts = keep.sum(1)
            if (counts != counts[0]).any():
                raise ValueError("keep mask must keep the same number of patches in every row")
            keep = keep.nonzero()[:, 1].reshape(b, -1)
        if keep.dim() != 2 or keep.shape[0] != b:
            raise ValueError(f"keep must be [B, n] patch indices with B={b}, "
                             f"got {tuple(keep.shape)}")
        patches = torch.gather(x[:, k:], 1, keep.to(x.device)[..., None].expand(-1, -1, d))
        return torch.cat([x[:, :k], patches], dim=1)

    def trace(self, inputs: Tensor | None = None, *, x: Tensor | None = None, start: int = 0,
              linearize: bool = False, grad: bool = False) -> Trace:
        """One forward pass recording every block (SPEC §0 names).

        Args:
            inputs (Tensor, optional): images [B, C, H, W]; embedded first.
            x (Tensor, optional): token states of block ``start`` instead of images.
            start (int): first block (with ``x``).
            linearize (bool): linearised backward (LN variance, q/k, GELU gate detached).
            grad (bool): build the autograd graph so gradients w.r.t. recorded tensors
                can be taken (:func:`captum_vit.methods._core.grads`).

        Returns:
            :class:`Trace`.
        """
        with torch.set_grad_enabled(grad):
            if x is None:
                assert inputs is not None
                layout = self.layout(inputs)
                x = self.embed(inputs)
            else:
                layout = self._layout_of_tokens(x, inputs)
            if grad and not x.requires_grad:
                x = x.detach().requires_grad_()
            tr = Trace(layout=layout, x0=x, start=start)
            ops = Ops(linearize=linearize)
            h = x
            for l in range(start, self.num_blocks):
                h = self.block(h, l, ops, tr.blocks)
            tr.logits = self.logits(h, ops)
        return tr

    def _layout_of_tokens(self, x: Tensor, inputs: Tensor | None) -> Layout:
        if inputs is not None:
            return self.layout(inputs)
        p = x.shape[1] - self.num_prefix
        side = math.isqrt(p)
        grid = (side, side) if side * side == p else (1, p)
        return Layout(self.num_prefix, grid, (1, 1), self.readout, self.num_blocks,
                      self.blocks[0].num_heads, grid)

    # -- safety ---------------------------------------------------------------------------
    def self_check(self, inputs: Tensor) -> None:
        """Compare the canonical forward with ``model(inputs)`` once per dtype/device/size."""
        key = (inputs.dtype, inputs.device, tuple(inputs.shape[1:]))
        if key in self._checked:
            return
        with torch.no_grad():
            ref = self.model(inputs[:2])
            ours = self.run(self.embed(inputs[:2]))
        if not isinstance(ref, Tensor) or ref.shape != ours.shape:
            raise TypeError(
                f"{type(self.model).__name__} returned {type(ref).__name__} of an unexpected "
                "shape; captum_vit needs a classifier returning logits [B, classes]"
            )
        tol = {torch.float64: 1e-9, torch.float32: 1e-4}.get(inputs.dtype, 1e-2)
        err = (ref - ours).abs().max().item()
        scale = ref.abs().max().item() + 1.0
        if not err <= tol * scale:
            raise TypeError(
                f"captum_vit's {type(self).__name__} does not reproduce this "
                f"{type(self.model).__name__} (max logit difference {err:.3g}): the model "
                "has a component the adapter does not know (custom block, attention or "
                "head). Supported: standard pre-LN ViT blocks as in timm's VisionTransformer."
            )
        self._checked.add(key)
