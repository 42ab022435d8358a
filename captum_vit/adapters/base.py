"""Model-independent part of the adapter layer.

An adapter translates one model family into a *canonical pre-LN ViT*: an embedding
function plus, per block, the parameter tensors of the notation below (views of the
model's own parameters, never copies that could drift, never modifications). Everything
after the embedding is computed here by one canonical forward, written once against an
:class:`Ops` object. Plain tensors give the real forward (with attention probabilities
materialised); DecompX swaps in decomposition ops; the linearised switches of DecompX's
gradient route (:mod:`captum_vit.methods.decompx`: LayerNorm variance, ``q``/``k`` and the
activation gate detached) only change the backward pass.

Notation (a pre-LayerNorm ViT in timm's layout): ``K`` prefix tokens (CLS, DIST,
registers) come first, then the ``P`` patch tokens in raster order, ``N = K + P``. Block
``l`` maps its input ``x_l`` to ``u_l = LN1(x_l)``, the attention probabilities ``A_l``
[B, H, N, N] (row = query, column = key), ``x_mid,l = x_l + ls1(a_l)`` and
``x_{l+1} = x_mid,l + ls2(MLP(LN2(x_mid,l)))``; the logits are ``head(pool(LN_f(x_L)))``,
read through the readout weights of :meth:`Layout.readout_weights`.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import functools
import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from captum_vit._text import count_noun
from captum_vit.adapters._linearize import (
    activation_gate_detached,
    layer_norm_frozen_variance,
)

READOUTS = ("token", "avg", "distilled", "cls_mean", "map")

_CHECKED: weakref.WeakKeyDictionary[nn.Module, set[tuple[Any, ...]]] = weakref.WeakKeyDictionary()
"""Per model (held weakly, the model is never touched): the (adapter, dtype, device, input
size) keys :meth:`ViTAdapter.self_check` has passed, shared by every adapter of it."""


@dataclass(frozen=True)
class Layout:
    """Token layout of one input batch (the notation of the module docstring).

    Attributes:
        num_prefix (int): ``K``, the prefix tokens (CLS, DIST, registers) before the patches.
        grid (tuple[int, int]): ``(gh, gw)`` patch grid.
        patch_size (tuple[int, int]): ``(ph, pw)`` in pixels.
        readout (str): ``"token"`` (row 0), ``"distilled"`` (rows 0 and 1 averaged in the
            logit; maps read row 0), ``"avg"`` (mean of the patch rows) or ``"cls_mean"``
            (DINOv2's classifier on ``[row 0 ; mean of the patch rows]``; maps read
            ``w = α e_0 + (1 − α) u_P``, see ``alpha``) or ``"map"`` (an attention-pool
            head, :class:`PoolParts`: the weights come from the pool's attention of each
            image, :func:`captum_vit._base.readout_rows`).
        num_blocks (int): ``L``.
        num_heads (int): ``H``.
        image_size (tuple[int, int]): ``(H, W)`` of the input images.
        alpha (float or str): the ``"cls_mean"`` readout's CLS share ``α`` (default ½), or
            ``"logit"``: per image and class from the logit's two parts
            (:func:`readout_alpha`).
    """

    num_prefix: int
    grid: tuple[int, int]
    patch_size: tuple[int, int]
    readout: str
    num_blocks: int
    num_heads: int
    image_size: tuple[int, int]
    alpha: float | str = 0.5

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def num_tokens(self) -> int:
        return self.num_prefix + self.num_patches

    def readout_weights(self, num_tokens: int | None = None, *, dtype=None, device=None) -> Tensor:
        """Weights ``w`` [N] with readout row ``r = sum_i w_i row_i`` (row 0 for a class
        token, the mean of the patch rows for average pooling).

        Raises:
            ValueError: for the ``"map"`` readout, whose weights depend on the image.
        """
        if self.readout == "map" or (self.readout == "cls_mean" and self.alpha == "logit"):
            raise ValueError("this readout's weights depend on the image (an attention-pool "
                             "head, or alpha='logit'): use captum_vit._base.readout_rows")
        n = self.num_tokens if num_tokens is None else num_tokens
        w = torch.zeros(n, dtype=dtype, device=device)
        if self.readout in ("avg", "cls_mean"):
            w[self.num_prefix:] = 1.0 / (n - self.num_prefix)
        if self.readout == "cls_mean":
            alpha = float(self.alpha)
            w *= 1.0 - alpha
            w[0] = alpha
        elif self.readout != "avg":
            w[0] = 1.0
        return w


@dataclass(frozen=True)
class NormParts:
    """A LayerNorm over the last dimension."""

    weight: Tensor | None
    bias: Tensor | None
    eps: float


def _consecutive(*parts: Tensor | None) -> Tensor | None:
    """The tensors as one when they are consecutive row slices of one tensor (timm's fused
    ``qkv`` parameter), else ``None`` (separate projections, or a part was replaced)."""
    first = parts[0]
    if first is None or first.dim() == 0:
        return None
    rows = first.shape[0] * first.stride(0)
    for i, t in enumerate(parts[1:], start=1):
        if t is None or t.shape != first.shape or t.stride() != first.stride() \
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() \
                or t.storage_offset() != first.storage_offset() + i * rows:
            return None
    return first.as_strided((len(parts) * first.shape[0], *first.shape[1:]), first.stride())


def patch_projection(inputs: Tensor, conv: nn.Module, ops: Ops, what: str) -> Tensor:
    r"""A patch-embedding convolution as the linear map of the unfolded patches, through
    ``ops.linear`` (the patch conv takes the linear maps' LRP rules, as in AttnLRP,
    Achtibat et al., ICML 2024; :mod:`captum_vit.adapters._lrp`).

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


def key_padding_bias(real: Tensor, dtype: torch.dtype) -> Tensor:
    """Attention-logit bias [B, 1, 1, N] that removes the keys where ``real`` [B, N] is
    ``False`` (``-inf``) and leaves the others (0)."""
    bias = torch.zeros(real.shape, dtype=dtype, device=real.device)
    return bias.masked_fill(~real, -math.inf)[:, None, None, :]


@dataclass(frozen=True)
class AttentionRules:
    """Modified backward rules inside one attention (the LRP family,
    :mod:`captum_vit.adapters._lrp`).

    Every field is a function whose forward returns exactly the plain computation's value
    and whose backward is a rule's (:mod:`captum_vit.adapters._lrp`); ``None`` keeps the
    plain operation. They act in the order of the forward: projections, per-head tensors
    (after the q/k norms and RoPE), softmax, then the probabilities' product with ``v``.
    """

    linear: Callable[[Tensor, Tensor, Tensor | None], Tensor] | None = None
    """The q/k/v projections ``(u, weight, bias) -> u Wᵀ + b`` (``F.linear``)."""
    heads: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]] | None = None
    """``(q, k, v) -> (q, k, v)`` per head [B, H, n, d]."""
    softmax: Callable[[Tensor], Tensor] | None = None
    """Attention logits -> probabilities (``softmax(-1)``)."""
    mix: Callable[[Tensor], Tensor] | None = None
    """Applied to the probabilities where they multiply ``v`` (the probabilities returned
    and recorded are the tensor before it)."""


@dataclass(frozen=True)
class AttentionParts:
    """The projections of one multi-head attention: ``q``, ``k``, ``v`` weights
    ``[H*d, D]`` (rows head-major) with biases ``[H*d]`` or ``None``, the per-head q/k norms,
    the softmax scale and the output projection ``W_O`` ``[D, H*d]``. Shared by the
    blocks' self-attention (:class:`BlockParts`) and attention-pool heads
    (:class:`PoolParts`)."""

    q_weight: Tensor | None
    k_weight: Tensor
    v_weight: Tensor
    q_bias: Tensor | None
    k_bias: Tensor | None
    v_bias: Tensor | None
    num_heads: int
    head_dim: int
    scale: float
    q_norm: Callable[[Tensor], Tensor]
    k_norm: Callable[[Tensor], Tensor]
    proj_weight: Tensor  # [D, H*d]
    proj_bias: Tensor | None

    @property
    def inner_dim(self) -> int:
        return self.num_heads * self.head_dim

    def _heads(self, u: Tensor, weight: Tensor | None, bias: Tensor | None,
               linear: Callable[..., Tensor] = F.linear) -> Tensor:
        """``u W^T + b`` (``u`` itself for ``weight = None``) split into heads,
        [B, H, N, d]."""
        b, n, _ = u.shape
        y = u if weight is None else linear(u, weight, bias)
        return y.reshape(b, n, self.num_heads, self.head_dim).transpose(1, 2)


@dataclass(frozen=True)
class BlockParts(AttentionParts):
    """Canonical parameters of one pre-LN block (the notation of the module docstring): the
    attention's projections
    (:class:`AttentionParts`; for timm views, i.e. slices, of the model's fused ``qkv``
    parameter, Hugging Face models keep separate q/k/v projections), the norms, LayerScale
    and the MLP."""

    norm1: NormParts
    ls1: Tensor | None
    norm2: NormParts
    fc1_weight: Tensor
    fc1_bias: Tensor | None
    act: Callable[[Tensor], Tensor]
    fc2_weight: Tensor
    fc2_bias: Tensor | None
    ls2: Tensor | None
    attn_bias: Callable[[], Tensor] | None = None
    """Additive attention-logit bias of the full sequence, ``() -> [1, H, N, N]`` (BEiT's
    relative position bias, computed by the model's own code); ``None`` = no bias."""
    gate_weight: Tensor | None = None
    """Gated MLP (SwiGLU): ``h = act(u W_g + b_g) ⊙ (u W_1 + b_1)``; ``None`` = the plain
    MLP ``h = act(u W_1 + b_1)``."""
    gate_bias: Tensor | None = None
    mlp_norm: NormParts | None = None
    """LayerNorm on the MLP's hidden units before ``fc2`` (timm's ``scale_mlp``)."""
    rotary: Callable[[Tensor, Tensor | None], Tensor] | None = None
    """Rotary position embedding (timm's Eva family, :mod:`captum_vit.adapters.timm_eva`),
    ``(heads, positions) -> heads``: applied
    to ``q`` and to ``k`` [B, H, n, d] after ``q_norm``/``k_norm`` (the order of the
    installed timm's ``EvaAttention.forward``, verified) and before any detaching. It
    rotates the patch rows only (the prefix rows keep their values) with the rotary rows
    of the tokens' original ``positions`` [B, n] (``None`` = the full sequence
    ``0..n-1``); ``None`` = no RoPE."""
    inner_norm: NormParts | None = None
    """LayerNorm ``N_in`` over the concatenated head outputs before ``W_O`` (EVA-02's
    ``scale_attn_inner``, Fang et al. 2023); ``None`` = identity."""

    def _qkv(self, u: Tensor, detach_qk: bool, positions: Tensor | None = None,
             rules: AttentionRules | None = None) -> tuple[Tensor, Tensor, Tensor]:
        weight = _consecutive(self.q_weight, self.k_weight, self.v_weight)
        bias = _consecutive(self.q_bias, self.k_bias, self.v_bias)
        no_bias = self.q_bias is None and self.k_bias is None and self.v_bias is None
        linear = F.linear if rules is None or rules.linear is None else rules.linear
        if weight is not None and (bias is not None or no_bias):
            # one fused matmul, exactly as the model computes it (same rounding forward
            # and backward); the heads then split as in timm's Attention.forward
            b, n, _ = u.shape
            qkv = linear(u, weight, bias).reshape(b, n, 3, self.num_heads, self.head_dim)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
            q, k = self.q_norm(q), self.k_norm(k)
        else:
            q = self.q_norm(self._heads(u, self.q_weight, self.q_bias, linear))
            k = self.k_norm(self._heads(u, self.k_weight, self.k_bias, linear))
            v = self._heads(u, self.v_weight, self.v_bias, linear)
        if self.rotary is not None:  # after q/k norm, before detaching (timm's Eva)
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        if detach_qk:
            q, k = q.detach(), k.detach()
        if rules is not None and rules.heads is not None:
            q, k, v = rules.heads(q, k, v)
        return q, k, v

    def logit_bias(self, n: int, key_mask: Tensor | None = None,
                   positions: Tensor | None = None) -> Tensor | None:
        """What is added to the attention logits: the position bias of the tokens at
        ``positions`` (the sub-matrix ``B[:, S, S]`` of their original indices ``S``) and
        ``-inf`` at padded keys; ``None`` when there is neither.

        Args:
            n (int): sequence length.
            key_mask (Tensor, optional): [B, n] bool, ``True`` = real token.
            positions (Tensor, optional): [B, n] original token indices; ``None`` =
                ``0..n-1`` (the full sequence).

        Returns:
            Tensor [B or 1, H or 1, n, n] or ``None``.
        """
        bias = None
        if self.attn_bias is not None:
            full = self.attn_bias()  # [1, H, N, N]
            if positions is None:
                if full.shape[-1] != n:
                    raise ValueError(f"a sequence of {n} tokens needs their positions: the "
                                     f"position bias covers {full.shape[-1]} tokens")
                bias = full
            else:
                pos = positions.to(full.device)
                bias = full[0][:, pos[:, :, None], pos[:, None, :]].transpose(0, 1)
        if key_mask is not None:
            pad = key_padding_bias(key_mask, torch.get_default_dtype() if bias is None
                                   else bias.dtype)
            bias = pad if bias is None else bias + pad
        return bias

    def _probs(self, q: Tensor, k: Tensor, bias: Tensor | None,
               rules: AttentionRules | None = None) -> Tensor:
        scores = (q * self.scale) @ k.transpose(-2, -1)
        if bias is not None:
            scores = scores + bias.to(scores.dtype)
        if rules is not None and rules.softmax is not None:
            return rules.softmax(scores)
        return scores.softmax(dim=-1)

    def attention(self, u: Tensor, *, materialize: bool, key_mask: Tensor | None = None,
                  positions: Tensor | None = None, detach_qk: bool = False,
                  rules: AttentionRules | None = None, heads: list[Heads] | None = None
                  ) -> tuple[Tensor, Tensor | None]:
        r"""Multi-head self-attention of ``u = LN1(x_l)`` up to the output projection.

        The one attention of the package (modelled on timm's ``Attention.forward``): the
        explicit path materialises :math:`A^h = \mathrm{softmax}(q k^\top / \sqrt{d})`
        (the trace and the attention-based methods need it); the fused path calls
        ``F.scaled_dot_product_attention`` and keeps no probabilities (scoring token
        subsets). Both give the same mix up to rounding.

        Args:
            u (Tensor): normed token states [B, N, D].
            materialize (bool): ``True`` = explicit softmax, probabilities returned;
                ``False`` = fused kernel, ``None`` returned for them.
            key_mask (Tensor, optional): bool [B, N], ``True`` = real token. Padded keys
                (``False``) take no part in any query's attention, so the real tokens'
                outputs equal those of the shortened sequence alone; the padded rows are
                meaningless. Every row needs at least one real token.
            positions (Tensor, optional): [B, N] original token indices of the tokens in
                ``u`` (prefix tokens ``0..K-1``, patch ``t`` at ``K + t``): the hook for
                rotary embeddings and relative-position bias: with a position bias
                (``attn_bias``, BEiT) they pick its sub-matrix ``B[:, S, S]``; with a
                ``rotary`` embedding (Eva) each kept patch is rotated by the row of its
                original position; otherwise they are unused (an absolute positional
                embedding is already in ``u``, so a kept token carries its own).
            detach_qk (bool): detach ``q`` and ``k`` (the linearised backward of DecompX's
                gradient route, :mod:`captum_vit.methods.decompx`); the forward values are
                unchanged.
            rules (AttentionRules, optional): modified backward rules (LRP,
                :mod:`captum_vit.adapters._lrp`); the forward values are unchanged. Needs
                ``materialize=True``.
            heads (list, optional): receives this call's :class:`Heads` (per-head ``q``,
                ``k``, ``v``, output and logit bias), from which the probabilities can be
                recomputed later (:meth:`Heads.probs`) when the fused path kept none.

        Returns:
            (mix [B, N, H*d], probabilities [B, H, N, N] or ``None``): the head mix
            :math:`\sum_j A^h_{ij} v^h_j` with heads concatenated, before ``W_O``.
        """
        if rules is not None and not materialize:
            raise ValueError("attention rules need the explicit path (materialize=True)")
        q, k, v = self._qkv(u, detach_qk, positions, rules)
        return self.attend(q, k, v, materialize=materialize, key_mask=key_mask,
                           positions=positions, rules=rules, heads=heads)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, materialize: bool,
               key_mask: Tensor | None = None, positions: Tensor | None = None,
               rules: AttentionRules | None = None, heads: list[Heads] | None = None
               ) -> tuple[Tensor, Tensor | None]:
        """The second half of :meth:`attention`, from its heads ``q``, ``k``, ``v``
        [B, H, N, d] (after q/k norms and rotary embedding) on: for callers that compute
        the token-wise projections once and gather them (TIS's shared first block,
        :mod:`~captum_vit.adapters.subsets`). Arguments and returns as in
        :meth:`attention`."""
        b, _, n, _ = q.shape
        bias = self.logit_bias(n, key_mask, positions)
        if materialize:
            attn: Tensor | None = self._probs(q, k, bias, rules)
            mixing = attn if rules is None or rules.mix is None else rules.mix(attn)
            mix = mixing @ v
        else:
            attn = None
            mask = None if bias is None else bias.to(q.dtype)
            mix = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        if heads is not None:
            heads.append(Heads(q, k, v, mix, bias, self))
        return mix.transpose(1, 2).reshape(b, n, self.inner_dim), attn

    def attention_probs(self, u: Tensor, *, detach_qk: bool = False,
                        positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The explicit path's pieces: probabilities ``A`` [B, H, N, N] and values ``v``
        [B, H, N, d] of ``u`` (for inspection and tests; forwards use :meth:`attention`);
        ``positions`` as in :meth:`attention`."""
        q, k, v = self._qkv(u, detach_qk, positions)
        return self._probs(q, k, self.logit_bias(u.shape[1], positions=positions)), v

    def head_value_outputs(self, u: Tensor) -> Tensor:
        """Per-head ``u W_V^h W_O^h`` without biases, [B, H, N, D] (TokenTM Eq. 5)."""
        b, n, _ = u.shape
        v = F.linear(u, self.v_weight).reshape(b, n, self.num_heads, self.head_dim)
        wo = self.proj_weight.reshape(-1, self.num_heads, self.head_dim)  # [D, H, d]
        return torch.einsum("bnhe,dhe->bhnd", v, wo)

    def value_outputs(self, u: Tensor, attn: Tensor | None = None) -> Tensor:
        r"""Every token's value vector through the output projection, heads concatenated:
        :math:`(u W_V^\top + b_V) W_O^\top` [B, N, D], the value bias included and the
        output bias and LayerScale excluded (the ``vproj`` of Beyond Intuition's token-wise
        BT-T, Chen et al., TMLR 2023).

        With an inner LayerNorm :math:`N_{in}` before :math:`W_O` (EVA-02's
        ``scale_attn_inner``) the value vector passes it linearised, as in TokenTM
        (:mod:`captum_vit.methods.tokentm`): centred by its own mean, divided by the
        standard deviation of the real attention output
        :math:`o = \mathrm{concat}_h A^h v^h` of the same token (frozen) and scaled by
        :math:`\gamma`; :math:`\beta` excluded. That needs the block's probabilities
        ``attn``.

        Args:
            u (Tensor): ``LN1(x_l)`` [B, N, D].
            attn (Tensor, optional): the block's probabilities [B, H, N, N] (only read with
                an inner norm).

        Returns:
            Tensor [B, N, D].
        """
        dt = u.dtype  # parameters follow u (maps accumulate in float32 for half models)
        v = F.linear(u, self.v_weight.to(dt), None if self.v_bias is None
                     else self.v_bias.to(dt))  # [B, N, H*d]
        if self.inner_norm is not None:
            if attn is None:
                raise ValueError("value_outputs of a block with an inner attention norm "
                                 "needs the block's attention probabilities (attn=)")
            b, n, a = v.shape
            o = attn.to(v.dtype) @ v.reshape(b, n, self.num_heads, self.head_dim).transpose(1, 2)
            o = o.transpose(1, 2).reshape(b, n, a)
            inv = torch.rsqrt(o.var(-1, unbiased=False, keepdim=True) + self.inner_norm.eps)
            v = (v - v.mean(-1, keepdim=True)) * inv
            if self.inner_norm.weight is not None:
                v = v * self.inner_norm.weight.to(dt)
        return F.linear(v, self.proj_weight.to(dt))


@dataclass(frozen=True)
class Heads:
    r"""The per-head tensors of one :meth:`BlockParts.attention` call, [B, H, N, d]:
    ``q`` and ``k`` as the softmax saw them (after the q/k norms and RoPE), ``v``, the
    output :math:`o^h = A^h v^h` and the logit ``bias`` (``None`` = none).

    A fused forward keeps these instead of the probabilities (the kernel saves them for
    its backward anyway), so a method that needs :math:`A_l` and
    :math:`\partial s / \partial A_l` only block by block recomputes them:
    :math:`A = ` :meth:`probs` and :math:`\partial s / \partial A^h = (\partial s /
    \partial o^h)\, v^{h\top}` (:meth:`probs_grad`), one ``[B, H, N, N]`` at a time.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    o: Tensor
    bias: Tensor | None
    parts: BlockParts

    def probs(self) -> Tensor:
        """The probabilities ``A`` [B, H, N, N] (the explicit path's own computation)."""
        return self.parts._probs(self.q, self.k, self.bias)

    def probs_grad(self, grad_o: Tensor) -> Tensor:
        """``∂s/∂A`` [B, H, N, N] from ``∂s/∂o`` [B, H, N, d] (``mix = A v``)."""
        return grad_o @ self.v.detach().transpose(-2, -1)


@dataclass(frozen=True)
class PoolParts(AttentionParts):
    r"""An attention-pool head: timm's ``AttentionPoolLatent``
    (``global_pool='map'``) and Hugging Face's ``SiglipMultiheadAttentionPoolingHead``.

    A learned latent query ``ℓ`` [Q, D_l] attends over the normed tokens ``x̂``:
    :math:`A_p^h = \mathrm{softmax}(q^h k^{h\top} / \sqrt d)` with ``q = ℓ W_q + b_q``
    (optional q-norm) and ``k, v = x̂ W_{k,v} + b_{k,v}``;
    ``o = concat_h(A_p^h v^h) W_p + b_p``, then ``z = o + MLP(LN_p(o))`` (no residual
    from the latent) and the pooled vector is ``z[0]``. Weights are views of the model's
    parameters (``q_weight = None``: the latent is the query itself).
    """

    latent: Tensor  # [Q, D_l]
    norm: NormParts | None
    fc1_weight: Tensor | None
    fc1_bias: Tensor | None
    act: Callable[[Tensor], Tensor] | None
    fc2_weight: Tensor | None
    fc2_bias: Tensor | None
    skip_prefix: int = 0
    """Leading rows that are no keys (timm's pool drops the prefix tokens unless
    ``pool_include_prefix``); their probabilities are exactly 0."""

    def attention(self, x: Tensor, *, materialize: bool, key_mask: Tensor | None = None,
                  detach_k: bool = False, rules: AttentionRules | None = None
                  ) -> tuple[Tensor, Tensor | None]:
        """The pool's attention of the latent over ``x`` [B, N, D].

        Args:
            x (Tensor): normed token states.
            materialize (bool): explicit softmax with the probabilities returned, or the
                fused kernel (``None`` returned for them).
            key_mask (Tensor, optional): [B, N] bool, ``True`` = real token; padded tokens
                are no keys.
            detach_k (bool): detach ``k`` (linearised backward; ``q`` depends on the
                latent only).
            rules (AttentionRules, optional): modified backward rules (LRP,
                :mod:`captum_vit.adapters._lrp`), as in :meth:`BlockParts.attention`; needs
                ``materialize=True``.

        Returns:
            (mix [B, Q, H*d] before ``W_p``, probabilities [B, H, Q, N] or ``None``).
        """
        if rules is not None and not materialize:
            raise ValueError("attention rules need the explicit path (materialize=True)")
        b = x.shape[0]
        lat = self.latent.to(x.dtype).expand(b, -1, -1)
        linear = F.linear if rules is None or rules.linear is None else rules.linear
        q = self.q_norm(self._heads(lat, self.q_weight, self.q_bias, linear))
        k = self.k_norm(self._heads(x, self.k_weight, self.k_bias, linear))
        v = self._heads(x, self.v_weight, self.v_bias, linear)
        if detach_k:
            k = k.detach()
        if rules is not None and rules.heads is not None:
            q, k, v = rules.heads(q, k, v)
        bias = None
        if key_mask is not None or self.skip_prefix:
            real = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
            if key_mask is not None:
                real = real & key_mask
            real[:, :self.skip_prefix] = False
            bias = key_padding_bias(real, x.dtype)
        if materialize:
            scores = (q * self.scale) @ k.transpose(-2, -1)
            scores = scores if bias is None else scores + bias
            softmax = None if rules is None else rules.softmax
            attn: Tensor | None = scores.softmax(-1) if softmax is None else softmax(scores)
            mixing = attn if rules is None or rules.mix is None else rules.mix(attn)
            mix = mixing @ v
        else:
            attn = None
            mix = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=self.scale)
        return mix.transpose(1, 2).reshape(b, -1, self.inner_dim), attn


_PROBABILITY: contextvars.ContextVar[str] = contextvars.ContextVar("probability",
                                                                  default="softmax")
"""How scores become probabilities in the current call: ``"softmax"`` over the classes
(or over a set of target embeddings), ``"sigmoid"`` per score (one target vector)."""


_TARGETS: contextvars.ContextVar[tuple[tuple[nn.Module, TargetHead], ...]] = \
    contextvars.ContextVar("targets", default=())
"""The target embeddings in force, per model object (innermost last): every adapter of
that model scores against them (:meth:`ViTAdapter.targeting`)."""


_ALPHAS: contextvars.ContextVar[tuple[tuple[nn.Module, float | str], ...]] = \
    contextvars.ContextVar("alphas", default=())
"""The ``"cls_mean"`` readout's ``α`` in force, per model object (innermost last)."""


_FROZEN: contextvars.ContextVar[bool] = contextvars.ContextVar("frozen", default=False)
"""Inside a gradient trace: the blocks and the head run on detached views of the model's
parameters (:func:`_detached`), so autograd saves only what input gradients need."""


def _detached(parts: Any) -> Any:
    """A copy of frozen parts (:class:`BlockParts`, :class:`HeadParts`, ...) whose tensors
    are detached views of the same storage (same values, strides and offsets, so fused
    projections stay fused) and whose logit-bias function returns a detached bias.

    Gradients then reach the token states and the recorded tensors but never the
    model's parameters, which nothing in a trace asks for: autograd no longer keeps
    every projection's input alive for a weight gradient.
    """
    if isinstance(parts, Tensor):
        return parts.detach()
    if isinstance(parts, tuple):
        return tuple(_detached(p) for p in parts)
    if not dataclasses.is_dataclass(parts) or isinstance(parts, type):
        return parts
    changes = {f.name: _detached(getattr(parts, f.name))
               for f in dataclasses.fields(parts) if f.init}
    bias = changes.get("attn_bias")
    if bias is not None:
        changes["attn_bias"] = lambda: bias().detach()
    return dataclasses.replace(parts, **changes)


def probabilities(logits: Tensor) -> Tensor:
    """The probabilities of ``logits`` [B, classes]: softmax over the classes, or, inside
    an embedding-target call with single target vectors, the sigmoid of each score
    (a softmax over one score would be constant; :mod:`captum_vit.targets`)."""
    return logits.sigmoid() if _PROBABILITY.get() == "sigmoid" else logits.softmax(-1)


def log_probabilities(logits: Tensor) -> Tensor:
    """``log`` of :func:`probabilities`, computed stably (log-softmax or log-sigmoid)."""
    if _PROBABILITY.get() == "sigmoid":
        return F.logsigmoid(logits)
    return logits.log_softmax(-1)


def scores_are_classes() -> bool:
    """Whether the current scores compete like classes (a classifier or a set of target
    embeddings under a softmax), so that an arg-max "prediction" and accuracies mean
    something; ``False`` for independent scores against single target vectors."""
    return _PROBABILITY.get() != "sigmoid"


@dataclass(frozen=True)
class TargetHead:
    r"""Scores of a model's image embedding ``e`` against target vectors
    (:mod:`captum_vit.targets`).

    ``s_t = scale · ⟨e/‖e‖, t/‖t‖⟩ + bias`` (``cosine=True``) or ``scale · ⟨e, t⟩ + bias``
    for every row ``t`` of ``vectors`` [T, D′]: a linear head on the (normalised)
    embedding, so every method and decomposition rule applies unchanged (DecompX freezes
    ``‖e‖`` like a LayerNorm's statistics).
    """

    vectors: Tensor
    cosine: bool = True
    scale: float = 1.0
    bias: float = 0.0
    probability: str = "softmax"

    def weight(self) -> Tensor:
        t = self.vectors
        if self.cosine:
            t = t / t.norm(dim=-1, keepdim=True)
        return self.scale * t

    def bias_vector(self) -> Tensor | None:
        if self.bias == 0:
            return None
        return torch.full(self.vectors.shape[:1], float(self.bias), dtype=self.vectors.dtype,
                          device=self.vectors.device)

    def scores(self, e: Tensor) -> Tensor:
        """``[B, T]`` scores of embeddings ``e`` [B, D′] (plain tensors)."""
        if self.cosine:
            e = e / e.norm(dim=-1, keepdim=True)
        return F.linear(e, self.weight(), self.bias_vector())


@dataclass(frozen=True)
class HeadParts:
    """Final norm, pooling and classifier(s).

    ``heads`` holds ``(row, weight, bias)``; ``row`` is a token index, ``"avg"`` or
    ``"map"`` (the output of ``attn_pool``); ``weight = None`` is the identity (a
    head-less model whose output is the pooled embedding). The logits combine the heads'
    outputs as ``combine`` says.
    """

    norm: NormParts | None
    fc_norm: NormParts | None
    heads: tuple[tuple[int | str, Tensor | None, Tensor | None], ...]
    combine: str = "mean"
    """How the heads' outputs make the logits: ``"mean"`` (DeiT's two heads) or ``"sum"``
    (one classifier split over concatenated pooled parts, DINOv2's ``[CLS ; mean]``)."""
    attn_pool: PoolParts | None = None
    """The attention-pool head read by ``"map"`` rows (:class:`PoolParts`)."""
    target: TargetHead | None = None
    """Scores against target embeddings, applied to the model's output (embedding
    models inside :meth:`ViTAdapter.targeting`)."""


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
        if self.linearize:
            return layer_norm_frozen_variance(x, p.weight, p.bias, p.eps)
        return F.layer_norm(x, (x.shape[-1],), p.weight, p.bias, p.eps)

    def linear(self, x: Any, weight: Tensor, bias: Tensor | None) -> Any:
        return F.linear(x, weight, bias)

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

    def mean(self, xs: Sequence[Any]) -> Any:
        return xs[0] if len(xs) == 1 else sum(xs[1:], xs[0]) / len(xs)

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


@dataclass
class BlockRecord:
    """What one block saw and produced (named as in the module docstring). An
    attention-only record
    (:meth:`ViTAdapter.block`) has ``None`` after ``attn``/``heads``."""

    x: Tensor  # x_l, the block input
    u: Tensor  # LN1(x_l)
    attn: Tensor | None  # A_l [B, H, N, N]; None for a fused trace (see heads)
    attn_out: Tensor  # ls1(a_l)
    mid: Tensor  # x_mid,l
    ffn_out: Tensor  # ls2(MLP(LN2(x_mid,l)))
    out: Tensor  # x_{l+1}
    heads: Heads | None = None  # a fused trace's per-head q, k, v, o (attn is None)


@dataclass
class Trace:
    """One forward pass: the embedding output, every block's record and the logits."""

    layout: Layout
    x0: Tensor
    blocks: list[BlockRecord] = field(default_factory=list)
    logits: Tensor | None = None
    start: int = 0
    pool_attn: Tensor | None = None
    """The attention-pool head's probabilities [B, H, Q, N] (``"map"`` readout)."""
    readout_alpha: Tensor | None = None
    """``"cls_mean"`` readout with ``alpha="logit"``: the CLS share ``α`` [B, classes] of
    every class's logit (:func:`readout_alpha`), a constant of the readout."""

    @property
    def states(self) -> list[Tensor]:
        """Residual states ``x_start .. x_L``."""
        return [b.x for b in self.blocks] + [self.blocks[-1].out] if self.blocks else [self.x0]


def _channel_mismatch(got: int, expected: int) -> str:
    """The message for inputs with ``got`` channels fed to a model taking ``expected``,
    with the fix (a grayscale image for an RGB model: repeat its channel)."""
    want = count_noun(expected, "channel")
    if got == 1 and expected > 1:
        return (f"inputs have 1 channel (grayscale) but the model expects {want}: repeat the "
                f"channel with inputs.expand(-1, {expected}, -1, -1) (or "
                f"inputs.repeat(1, {expected}, 1, 1)), normalised as the model expects, or "
                "use a model built for 1-channel inputs (e.g. timm's in_chans=1)")
    if got == 3 and expected == 1:
        return ("inputs have 3 channels (RGB) but the model expects 1 (grayscale): convert "
                "them, e.g. to luminance with (inputs * torch.tensor([0.299, 0.587, "
                "0.114]).view(1, 3, 1, 1)).sum(1, keepdim=True), or use a 3-channel model")
    return f"inputs have {count_noun(got, 'channel')} but the model expects {want}"


class ViTAdapter:
    """Canonical pre-LN ViT on top of a concrete model (subclasses fill in the parts).

    Subclasses set ``model``, ``blocks`` (list of :class:`BlockParts`), ``head``
    (:class:`HeadParts`), ``num_prefix``, ``readout``, ``in_chans`` and implement
    :meth:`layout`, :meth:`embed`, :attr:`input_shape` and :meth:`parameter_stages`
    (and :meth:`refresh` when the parts hold views of the model's parameters).
    """

    model: nn.Module
    blocks: list[BlockParts]
    _head_parts: HeadParts
    num_prefix: int
    readout: str
    in_chans: int

    # -- to implement ------------------------------------------------------------------
    def layout(self, inputs: Tensor) -> Layout:  # pragma: no cover - abstract
        raise NotImplementedError

    def embed(self, inputs: Tensor, ops: Ops | None = None
              ) -> Tensor:  # pragma: no cover - abstract
        """The token states ``x_0`` [B, N, D] of images [B, C, H, W].

        ``ops=None`` runs the model's own embedding modules. With ``ops`` the patch
        projection (a convolution with stride = kernel, :func:`patch_projection`) goes
        through ``ops.linear`` and each normalisation of the embedding
        (:meth:`embedding_norms`) through ``ops.norm``, so a rule set of modified
        backward passes (LRP at the pixels, :mod:`captum_vit.adapters._lrp`) reaches the
        pixels; prefix
        tokens, position embeddings (interpolation included) and rotary tables stay the
        model's own code, and the forward values are the model's up to rounding.
        """
        raise NotImplementedError

    @property
    def input_shape(self) -> tuple[int, tuple[int, int]]:  # pragma: no cover - abstract
        """``(channels, (H, W))``: the model's default input size."""
        raise NotImplementedError

    def parameter_stages(self) -> list[list[nn.Parameter]]:  # pragma: no cover - abstract
        """The model's own parameters by cascade stage, for the model-randomisation check.

        Returns:
            list of lists of ``nn.Parameter`` (the model's objects, not views, so an
            in-place randomisation changes the model): the head stage first (final norm,
            ``fc_norm``, classifier head(s)), then one stage per block from the top block
            ``L-1`` down to 0. Every parameter appears exactly once; the embedding's
            (patch embedding, prefix tokens, positional embedding, pre-norm) appear in
            none.
        """
        raise NotImplementedError

    def refresh(self) -> None:
        """Re-read the parts if the model's parameters were replaced (e.g. ``model.to``).

        Called at every entry point (:meth:`layout`, :meth:`embed`, :meth:`run`,
        :meth:`trace`); adapters whose parts are the parameters themselves need nothing.
        """

    def embedding_norms(self) -> tuple[str, ...]:
        """Names of the normalisations inside :meth:`embed` (a pre-norm such as CLIP's
        ``pre_layrnorm``); empty when the embedding is affine in the pixels (patch
        projection, prefix tokens, position embedding). ``embed(inputs, ops)`` runs each
        of them through ``ops.norm`` (pixel-level LRP: the LN rule,
        :mod:`captum_vit.adapters._lrp`)."""
        return ()

    def check_inputs(self, inputs: Tensor) -> None:
        """Raise a clear error for inputs the model cannot take (subclasses add their size
        rules).

        The dtype rule (no silent casts): floating-point inputs must have the dtype of
        the model's parameters, else ``TypeError`` naming both dtypes and the fix. The
        channels must be the model's, and a model whose output is random (training mode
        with active dropout) is refused.
        """
        self.refresh()
        want = self.dtype
        if torch.is_floating_point(inputs) and inputs.dtype != want:
            raise TypeError(
                f"inputs are {inputs.dtype} but the model's parameters are {want}; convert "
                f"the inputs with inputs.to({want}) or the model with "
                f"model.to({inputs.dtype})")
        if inputs.shape[1] != self.in_chans:
            raise ValueError(_channel_mismatch(inputs.shape[1], self.in_chans))
        if self.is_random():
            raise ValueError("the model is in training mode with active dropout/drop-path, "
                             "so its output is random; call model.eval() before explaining")

    def is_random(self) -> bool:
        """Whether the model's forward is random now (training mode with active dropout)."""
        return False

    embedding: bool = False
    """Whether the model outputs an image embedding (CLIP, SigLIP, head-less models)
    rather than class logits: its targets are vectors (:mod:`captum_vit.targets`)."""

    def model_outputs(self, inputs: Tensor) -> Tensor:
        """The model's own output for ``inputs``: logits [B, classes] or the image
        embedding [B, D′] (its forward, not ours)."""
        return self.model(inputs)

    def model_logits(self, inputs: Tensor) -> Tensor:
        """:meth:`model_outputs`, scored against the target embeddings inside
        :meth:`targeting`."""
        out = self.model_outputs(inputs)
        return out if self.head.target is None else self.head.target.scores(out)

    @property
    def head(self) -> HeadParts:
        """The model's head, scoring against the target embeddings in force for this model
        (:meth:`targeting`, seen by every adapter of the same model object)."""
        base = self._head_parts
        for model, target in reversed(_TARGETS.get()):
            if model is self.model:
                return dataclasses.replace(base, target=target)
        return base

    @head.setter
    def head(self, value: HeadParts) -> None:
        self._head_parts = dataclasses.replace(value, target=None) if value.target is not None \
            else value

    @property
    def cls_alpha(self) -> float | str:
        """The CLS share ``α`` of a ``"cls_mean"`` readout in force for this model (½
        unless set by :meth:`with_cls_alpha`)."""
        for model, alpha in reversed(_ALPHAS.get()):
            if model is self.model:
                return alpha
        return 0.5

    @contextlib.contextmanager
    def with_cls_alpha(self, alpha: float | str) -> Iterator[None]:
        """Within the block, maps of this model (every adapter of the same model object)
        read its ``[CLS ; patch mean]`` classifier as ``w = α e_0 + (1 − α) u_P``
        (see :func:`captum_vit.adapters.readout_alpha`)."""
        if self.readout != "cls_mean":
            raise ValueError(f"alpha applies to a classifier on [CLS ; mean of the patches] "
                             f"(Hugging Face DINOv2); this {type(self.model).__name__} reads "
                             f"out {self.readout!r}")
        if isinstance(alpha, str):
            if alpha != "logit":
                raise ValueError(f"alpha must be a float in [0, 1] or 'logit', got {alpha!r}")
        elif isinstance(alpha, bool) or not isinstance(alpha, int | float) \
                or not 0.0 <= float(alpha) <= 1.0:
            raise ValueError(f"alpha must be a float in [0, 1] or 'logit', got {alpha!r}")
        else:
            alpha = float(alpha)
        token = _ALPHAS.set(_ALPHAS.get() + ((self.model, alpha),))
        try:
            yield
        finally:
            _ALPHAS.reset(token)

    @contextlib.contextmanager
    def targeting(self, target: TargetHead | None) -> Iterator[None]:
        """Within the block the outputs (:meth:`logits`, :meth:`model_logits`) of every
        adapter of this model are the scores against ``target`` [B, T] (``None``:
        unchanged). Nested calls replace the target; the previous one is restored on exit.
        The setting lives in a context variable, so threads and other models are not
        affected."""
        if target is None:
            yield
            return
        tokens = (_TARGETS.set(_TARGETS.get() + ((self.model, target),)),
                  _PROBABILITY.set(target.probability))
        try:
            yield
        finally:
            _PROBABILITY.reset(tokens[1])
            _TARGETS.reset(tokens[0])

    # -- what the model is -------------------------------------------------------------------
    @property
    def readout_row_count(self) -> int | None:
        """How many leading token rows of the last state the logits read: the prefix
        tokens for a class-token (or distilled) readout, ``None`` when they read the
        patch rows too (average pooling, CLS+mean, an attention pool)."""
        h = self.head
        if h.attn_pool is not None or not all(isinstance(row, int) for row, _, _ in h.heads):
            return None
        return max(row for row, _, _ in h.heads) + 1

    @property
    def fixed_readout(self) -> bool:
        """Whether the readout weights are the same for every image
        (:meth:`Layout.readout_weights`): no attention-pool head and no per-image CLS
        share (``alpha="logit"``), so a gradient-free map needs no logits."""
        return self.head.attn_pool is None and not (self.readout == "cls_mean"
                                                    and self.cls_alpha == "logit")

    @property
    def num_classes(self) -> int:
        """Number of scores: classes (rows of the classifier head), the embedding size of
        a head-less model, or the number ``T`` of target embeddings in force."""
        head = self.head
        if head.target is not None:
            return int(head.target.vectors.shape[0])
        weight = head.heads[0][1]
        return int(weight.shape[0] if weight is not None else self.blocks[0].proj_weight.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the model's parameters (inputs must have it)."""
        return self.blocks[0].q_weight.dtype

    # -- canonical forward ----------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def block(self, x: Any, l: int, ops: Ops, record: list[BlockRecord] | None = None, *,
              attention_only: bool = False, rows: int | None = None) -> Any:
        """Block ``l`` on ``x`` (the module docstring's notation): attention sublayer then
        FFN sublayer.

        With ``attention_only`` the block stops once it has its attention (for methods
        that read nothing else of it): it returns ``None`` and its record has ``x``,
        ``u`` and ``attn`` (or ``heads``), ``None`` in the other fields. With ``rows``
        (plain-tensor ops) everything after the attention is computed for the first
        ``rows`` tokens only, so the output and the record's later fields have ``rows``
        rows: the last block under a readout of the prefix rows
        (:attr:`readout_row_count`)."""
        p = self.blocks[l]
        if _FROZEN.get():
            p = _detached(p)
        u = ops.norm(x, p.norm1)
        a, attn = ops.attention(u, p)
        heads = attn if isinstance(attn, Heads) else None
        if attention_only:
            if record is not None:
                record.append(BlockRecord(  # type: ignore[arg-type]
                    ops.value(x), ops.value(u), None if heads is not None else attn,
                    None, None, None, None, heads))
            return None
        if rows is not None:  # only these rows reach the readout
            a, x = a[:, :rows], x[:, :rows]
        if p.inner_norm is not None:  # N_in (EVA-02's scale_attn_inner)
            a = ops.norm(a, p.inner_norm)
        a = ops.linear(a, p.proj_weight, p.proj_bias)
        if p.ls1 is not None:
            a = ops.scale(a, p.ls1)
        mid = ops.add(x, a)
        u2 = ops.norm(mid, p.norm2)
        h = ops.linear(u2, p.fc1_weight, p.fc1_bias)
        if p.gate_weight is None:
            h = ops.act(h, p.act)
        else:
            h = ops.gated(ops.linear(u2, p.gate_weight, p.gate_bias), h, p.act)
        if p.mlp_norm is not None:
            h = ops.norm(h, p.mlp_norm)
        f = ops.linear(h, p.fc2_weight, p.fc2_bias)
        if p.ls2 is not None:
            f = ops.scale(f, p.ls2)
        out = ops.add(mid, f)
        if record is not None:
            v = ops.value
            record.append(BlockRecord(v(x), v(u), None if heads is not None else attn, v(a),
                                      v(mid), v(f), v(out), heads))
        return out

    def logits(self, x: Any, ops: Ops, record: Trace | None = None) -> Any:
        """Final norm, pooling and head(s) on the last residual state (``record``: a
        trace that keeps the attention pool's probabilities)."""
        return self._head_logits(x, ops, record, self.head)

    def readout_logits(self, x: Any, ops: Ops | None = None, record: Trace | None = None, *,
                       final_norm: bool = True, pool: str = "model") -> Any:
        r"""The model's readout applied to the token states ``x`` [B, N, D] of any block
        (LeGrad's per-layer scores :math:`s^l` on :math:`z^l = x_{l+1}`; Bousselham et
        al., ICCV 2025).

        With the defaults this is :meth:`logits`: final norm, pooling (class token,
        average, attention pool, ...), ``fc_norm``, head(s) and, inside
        :meth:`targeting`, the scores against the target embeddings.

        Args:
            x: token states [B, N, D].
            ops (Ops, optional): primitive operations (default: plain forward).
            record (Trace, optional): receives the attention pool's probabilities
                (``record.pool_attn``) when the pool is used.
            final_norm (bool): apply the model's final norm (``False``: LeGrad's SigLIP
                reference pools the block output directly).
            pool (str): ``"model"`` (the model's own pooling) or ``"mean"``: the mean of
                all N rows (prefix included) first, then the final norm, ``fc_norm`` and
                every head on that one vector (LeGrad's CLIP reference,
                :math:`\mathrm{LN}_{post}(\mathrm{mean}_i z_i) W_{proj}`); an attention
                pool is not used.

        Returns:
            Logits [B, classes] (or scores [B, T] against target embeddings).
        """
        if pool not in ("model", "mean"):
            raise ValueError(f"pool must be 'model' or 'mean'; got {pool!r}")
        ops = ops or Ops()
        if pool == "model" and final_norm:
            return self.logits(x, ops, record)
        h = self.head
        if pool == "mean":
            x = x.mean(1, keepdim=True)  # one token: the mean of all rows
            h = dataclasses.replace(h, heads=tuple((0, w, b) for _, w, b in h.heads),
                                    attn_pool=None)
        if not final_norm:
            h = dataclasses.replace(h, norm=None)
        return self._head_logits(x, ops, record, h)

    def _head_logits(self, x: Any, ops: Ops, record: Trace | None, h: HeadParts) -> Any:
        """Final norm, pooling and head(s) of ``h`` on the token states ``x``."""
        if _FROZEN.get():
            h = _detached(h)
        if h.norm is not None:
            x = ops.norm(x, h.norm)
        pooled = None
        if h.attn_pool is not None:
            pooled, probs = self._attention_pool(x, h.attn_pool, ops)
            if record is not None:
                record.pool_attn = probs
        outs, zs = [], []
        for row, weight, bias in h.heads:
            z = pooled if row == "map" else ops.pool(x, row, self.num_prefix)
            if h.fc_norm is not None:
                z = ops.norm(z, h.fc_norm)
            zs.append(z)
            outs.append(z if weight is None else ops.linear(z, weight, bias))
        if record is not None and self.readout == "cls_mean" and self.cls_alpha == "logit":
            with torch.no_grad():  # |W¹_c·h_0| / (|W¹_c·h_0| + |W²_c·mean h|)
                cls, mean = (F.linear(ops.value(z).detach(), w).abs()
                             for z, (_, w, _) in zip(zs, h.heads, strict=True))
                record.readout_alpha = cls / (cls + mean).clamp_min(torch.finfo(cls.dtype).tiny)
        out = functools.reduce(ops.add, outs) if h.combine == "sum" else ops.mean(outs)
        if h.target is None:
            return out
        if h.target.cosine:
            out = ops.normalize(out)
        return ops.linear(out, h.target.weight(), h.target.bias_vector())

    @staticmethod
    def _attention_pool(x: Any, p: PoolParts, ops: Ops) -> tuple[Any, Tensor | None]:
        """``z[0]`` of the attention-pool head (:class:`PoolParts`) and its
        probabilities."""
        mix, probs = ops.pool_attention(x, p)
        o = ops.linear(mix, p.proj_weight, p.proj_bias)
        if p.fc1_weight is not None:
            u = o if p.norm is None else ops.norm(o, p.norm)
            hid = ops.act(ops.linear(u, p.fc1_weight, p.fc1_bias), p.act)
            o = ops.add(o, ops.linear(hid, p.fc2_weight, p.fc2_bias))
        return ops.pool(o, 0, 0), probs

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
                kept. This is true token removal (SkipPLUS, Mehri et al., CVPRW 2024,
                §4.1).
            ops (Ops, optional): primitive operations (default: plain forward).

        Returns:
            Logits [B, classes] when ``stop == L``, else the token states ``x_stop``.
        """
        L = self.num_blocks
        stop = L if stop is None else stop
        if not 0 <= start <= stop <= L:
            raise ValueError(f"need 0 <= start <= stop <= {L}, got start={start}, stop={stop}")
        self.refresh()
        ops = ops or Ops()
        if keep is not None:
            x, positions = self.select_tokens(x, keep, with_positions=True)
            if ops.positions is None:  # the kept tokens keep their own positions
                ops = copy.copy(ops)
                ops.positions = positions
        # the logits read the prefix rows only (class-token readouts): the last block's
        # output is computed for those rows (plain-tensor forwards; rule sets keep all rows)
        plain = (type(ops) is Ops or isinstance(ops, FusedOps)) and not ops.linearize
        rows = self.readout_row_count if stop == L and plain else None
        for l in range(start, stop):
            x = self.block(x, l, ops, rows=rows if l == L - 1 else None)
        return self.logits(x, ops) if stop == L else x

    def select_tokens(self, x: Tensor, keep: Tensor, *, with_positions: bool = False
                      ) -> Tensor | tuple[Tensor, Tensor]:
        """Prefix tokens plus the kept patch tokens of ``x`` [B, N, D] (and, with
        ``with_positions``, their original token indices [B, n])."""
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
        keep = keep.to(x.device)
        patches = torch.gather(x[:, k:], 1, keep[..., None].expand(-1, -1, d))
        out = torch.cat([x[:, :k], patches], dim=1)
        if not with_positions:
            return out
        prefix = torch.arange(k, device=x.device).expand(b, k)
        return out, torch.cat([prefix, k + keep], dim=1)

    def trace(self, inputs: Tensor | None = None, *, x: Tensor | None = None, start: int = 0,
              linearize: bool = False, grad: bool = False, cut_blocks: bool = False,
              ops: Ops | None = None, attention: str = "explicit",
              on_block: Callable[[int, BlockRecord], None] | None = None,
              logits: bool = True, last_rows: int | None = None) -> Trace:
        r"""One forward pass recording every block (:class:`BlockRecord`).

        With ``grad`` the blocks and the head run on detached views of the model's
        parameters: gradients reach the token states and every recorded tensor (the
        embedding keeps its own graph, so the inputs can require grad), never the
        parameters, and autograd keeps no activation alive for a weight gradient.

        Args:
            inputs (Tensor, optional): images [B, C, H, W]; embedded first.
            x (Tensor, optional): token states of block ``start`` instead of images.
            start (int): first block (with ``x``).
            linearize (bool): linearised backward (LN variance, q/k, GELU gate detached).
            grad (bool): build the autograd graph so gradients w.r.t. recorded tensors
                can be taken (:func:`captum_vit.methods._core.grads`).
            cut_blocks (bool): every block after the first takes a detached copy of the
                previous block's output (a leaf, with ``requires_grad`` under ``grad``):
                the values are unchanged, but a score computed from block ``l``'s output
                reaches the earlier blocks only through block ``l``'s input, so ONE
                backward of :math:`\sum_l s^l(x_{l+1})` gives every
                :math:`\partial s^l / \partial A_l` (LeGrad, Bousselham et al., ICCV
                2025). The trace's
                logits then carry gradients into the last block only.
            ops (Ops, optional): the primitive operations of the forward, e.g. an LRP
                rule set (:mod:`captum_vit.adapters._lrp`); default ``Ops(linearize)``.
            attention (str): ``"explicit"`` (default): records carry the probabilities
                ``attn`` [B, H, N, N]; ``"fused"``: the fused kernel, records carry
                :class:`Heads` instead (``attn`` is ``None``), so no ``[B, H, N, N]``
                tensor lives beyond its block (:meth:`Heads.probs` recomputes it).
            on_block (callable, optional): ``on_block(l, record)`` is called with each
                block's record as soon as the block has run, and the record is NOT kept
                in ``Trace.blocks`` (streaming: the method keeps what it needs, the rest
                is freed block by block).
            logits (bool): ``False``: stop once the last block has its attention (its
                record as in :meth:`block` with ``attention_only``) and compute no
                logits (``Trace.logits`` is ``None``): for methods that read only
                attention probabilities under a :attr:`fixed_readout`.
            last_rows (int, optional): the last block computes its output (after its
                attention) for the first ``last_rows`` tokens only
                (:attr:`readout_row_count`): the logits and every gradient are those of
                the full forward up to rounding; the last record's ``attn_out``,
                ``mid``, ``ffn_out`` and ``out`` have ``last_rows`` rows. Not with
                ``ops``.

        Returns:
            :class:`Trace`.

        Examples::

            >>> means = []   # head-mean attention per block, [B, N, N] each
            >>> tr = adapter.trace(images, on_block=lambda l, rec: means.append(
            ...     rec.attn.mean(1)))
        """
        if attention not in ("explicit", "fused"):
            raise ValueError(f"attention must be 'explicit' or 'fused'; got {attention!r}")
        if last_rows is not None and ops is not None:
            raise ValueError("last_rows needs the plain forward; do not pass ops with it")
        if attention == "fused" and ops is not None:
            raise ValueError("attention='fused' uses its own ops; pass ops only with "
                             "attention='explicit'")
        self.refresh()
        frozen = _FROZEN.set(grad)
        try:
            return self._trace(inputs, x, start, linearize, grad, cut_blocks,
                               HeadsOps(linearize) if attention == "fused" else ops, on_block,
                               logits, last_rows)
        finally:
            _FROZEN.reset(frozen)

    def _trace(self, inputs: Tensor | None, x: Tensor | None, start: int, linearize: bool,
               grad: bool, cut_blocks: bool, ops: Ops | None,
               on_block: Callable[[int, BlockRecord], None] | None, logits: bool,
               last_rows: int | None) -> Trace:
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
            ops = Ops(linearize=linearize) if ops is None else ops
            h = x
            for l in range(start, self.num_blocks):
                if cut_blocks and l > start:
                    h = h.detach().requires_grad_(grad)
                records = tr.blocks if on_block is None else []
                last = l == self.num_blocks - 1
                h = self.block(h, l, ops, records, attention_only=not logits and last,
                               rows=last_rows if last else None)
                if on_block is not None:
                    on_block(l, records.pop())
            if logits:
                tr.logits = self.logits(h, ops, tr)
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
        """Compare the canonical forward with ``model(inputs)`` once per model and
        dtype/device/input size (remembered across adapters of the same model object)."""
        key = (type(self), inputs.dtype, inputs.device, tuple(inputs.shape[1:]))
        checked = _CHECKED.setdefault(self.model, set())
        if key in checked:
            return
        # full precision even under an enclosing autocast (--autocast bf16 builds the
        # randomisation metric's model copies inside it)
        with torch.no_grad(), torch.autocast(inputs.device.type, enabled=False):
            ref = self.model_logits(inputs[:2])
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
        checked.add(key)
