"""The canonical parameters of a model and THE one attention.

Design. An adapter translates one model family into a *canonical pre-LN ViT*: per block
the parameter tensors of the notation of :mod:`captum_vit.adapters.layout` (views of the
model's own parameters, never copies that could drift, never modifications), held in
frozen dataclasses: :class:`NormParts`, :class:`AttentionParts` and its two uses
:class:`BlockParts` (a block) and :class:`PoolParts` (an attention-pool head),
:class:`HeadParts` (final norm, pooling, classifier). :meth:`BlockParts.attention` is the
only attention of the package (the role ``timm/layers/attention.py`` plays in timm): its
explicit and fused paths, the key mask, positions (rotary embedding, relative-position
bias) and modified backward rules side by side.

A family feature that changes what a method reads (EVA-02's inner norms) is exposed here
once as a derived view (:meth:`BlockParts.value_path`, :meth:`BlockParts.value_outputs`),
so no method re-implements a family's rule (:data:`BLOCK_FEATURES` lists the features a
block can have beyond the plain pre-LN block).

Block ``l`` maps its input ``x_l`` to ``u_l = LN1(x_l)``, the attention probabilities
``A_l`` [B, H, N, N] (row = query, column = key), ``x_mid,l = x_l + ls1(a_l)`` and
``x_{l+1} = x_mid,l + ls2(MLP(LN2(x_mid,l)))``; the logits are ``head(pool(LN_f(x_L)))``.
A residual post-norm block (Swin V2) has no ``LN1``/``LN2`` (``None``: ``u_l = x_l``) and
a LayerNorm on each branch's output instead (:attr:`BlockParts.post_norm1`,
:attr:`BlockParts.post_norm2`): ``x_mid,l = x_l + LN(ls1(a_l))``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, overload

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from captum_vit.adapters.scoring import Target, TargetHead


class _LayerNormFrozenVariance(torch.autograd.Function):
    """LayerNorm whose backward treats ``1/sqrt(var + eps)`` as a constant.

    With ``y = (x - mean(x)) / s * w + b`` and ``s`` frozen, the input gradient is
    ``(g*w - mean(g*w)) / s``: the centring stays differentiable, the scale does not.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        # one fused kernel gives the output and 1/sqrt(var + eps) (no second pass)
        y, _, inv_std = torch.native_layer_norm(x, (x.shape[-1],), weight, bias, eps)
        inv_std = inv_std.to(x.dtype)
        ctx.save_for_backward(inv_std, weight)
        return y

    @staticmethod
    def backward(ctx, g):
        inv_std, weight = ctx.saved_tensors
        gw = g * weight if weight is not None else g
        gx = (gw - gw.mean(-1, keepdim=True)) * inv_std
        return gx, None, None, None


def layer_norm_frozen_variance(x: Tensor, weight: Tensor | None, bias: Tensor | None,
                               eps: float) -> Tensor:
    return _LayerNormFrozenVariance.apply(x, weight, bias, eps)


@dataclass(frozen=True)
class NormParts:
    r"""A normalisation over the last dimension: a LayerNorm
    :math:`y = \gamma \odot (x - \bar x) / \sqrt{\operatorname{var} x + \epsilon} + \beta`,
    or with :attr:`rms` an RMSNorm :math:`y = \gamma \odot x / \sqrt{\overline{x^2} + \epsilon}`
    (no centring, no bias; Qwen2.5-VL's vision blocks).

    The rules that decompose through a norm (DecompX, GlobEnc/ALTI, the LRP rules) freeze its
    scale :math:`1/\sigma` (:meth:`inv_scale`), which makes it linear in :math:`x`: the
    RMSNorm's rule is the LayerNorm's without the mean term (:meth:`frozen_scale`)."""

    weight: Tensor | None
    bias: Tensor | None
    eps: float
    rms: bool = False
    """An RMSNorm (``bias`` is then ``None``); ``False`` = a LayerNorm."""
    compute_dtype: torch.dtype | None = None
    """An RMSNorm's normalisation computed in this dtype and cast back to the input's
    before ``weight`` multiplies it (Hugging Face's ``Qwen2RMSNorm``-style modules compute in
    ``torch.float32``: a float64 model's normed states are rounded to float32 there, and the
    canonical forward does the same); ``None`` = the input's dtype."""

    def inv_scale(self, x: Tensor, keepdim: bool = True) -> Tensor:
        """The norm's scale ``1/σ`` of the states ``x`` [..., D]: ``rsqrt(var x + eps)``
        (LayerNorm) or ``rsqrt(mean(x²) + eps)`` (RMSNorm), in ``x``'s dtype."""
        if self.rms:
            return torch.rsqrt(x.pow(2).mean(-1, keepdim=keepdim) + self.eps)
        return torch.rsqrt(x.var(-1, unbiased=False, keepdim=keepdim) + self.eps)

    def frozen_scale(self, x: Tensor) -> Tensor:
        """An RMSNorm's frozen scale of the states ``x`` [..., D], such that
        ``x * frozen_scale(x)`` is the model's normed value before ``weight``: ``1/σ``
        [..., 1]; with a :attr:`compute_dtype` other than ``x``'s the model's normed value
        over ``x`` per channel [..., D] (``1/σ`` where ``x`` is 0), so the rounding to
        ``compute_dtype`` is carried by the scale and a decomposition through it (DecompX's
        parts, the LRP rule's relevance) stays complete in ``x``'s dtype."""
        if self.compute_dtype is None or x.dtype == self.compute_dtype:
            return self.inv_scale(x)
        xc = x.to(self.compute_dtype)
        inv = self.inv_scale(xc)
        y = (xc * inv).to(x.dtype)
        return torch.where(x != 0, y / torch.where(x != 0, x, 1), inv.to(x.dtype))

    def __call__(self, x: Tensor, frozen: bool = False) -> Tensor:
        """The norm of ``x`` [..., D] as the model computes it; ``frozen``: with its scale
        ``1/σ`` a constant of the backward (the LN rule of the LRP literature; the centring
        stays differentiable)."""
        if not self.rms:
            if frozen:
                return layer_norm_frozen_variance(x, self.weight, self.bias, self.eps)
            return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        if frozen:
            y = x * self.frozen_scale(x.detach())
        else:
            xc = x if self.compute_dtype is None else x.to(self.compute_dtype)
            y = (xc * self.inv_scale(xc)).to(x.dtype)
        return y if self.weight is None else self.weight * y


@dataclass(frozen=True)
class CosineNorm:
    r"""The per-head normalisation of cosine attention (Swin V2, Liu et al., CVPR 2022):
    ``q`` and ``k`` [B, H, n, d] divided by their L2 norm over ``d`` (``F.normalize``,
    floored at ``eps``), ``q`` also multiplied by the learned per-head temperature
    :math:`\exp(\min(\tau_h, \text{max\_log}))`, so that with a softmax scale of 1 the
    logits are :math:`\cos(q_i, k_j)\, e^{\min(\tau_h, \log 100)}`. A ``q_norm`` /
    ``k_norm`` of :class:`BlockParts`; the LRP rules treat it like a LayerNorm (the norm
    detached, :meth:`frozen`).

    Attributes:
        logit_scale (Tensor or None): :math:`\tau` [H, 1, 1] (a view of the model's
            parameter); ``None`` = no temperature (the key side).
        max_log (float): the clamp of :math:`\tau` (Swin V2: :math:`\log 100`).
        eps (float): the floor of the norm.
    """

    logit_scale: Tensor | None = None
    max_log: float = math.log(100.0)
    eps: float = 1e-12

    def _scaled(self, y: Tensor) -> Tensor:
        if self.logit_scale is None:
            return y
        return y * torch.clamp(self.logit_scale, max=self.max_log).exp().to(y.dtype)

    def __call__(self, x: Tensor) -> Tensor:
        return self._scaled(F.normalize(x, dim=-1, eps=self.eps))

    def frozen(self, x: Tensor) -> Tensor:
        """The same values with the norm a constant of the backward (the LN rule)."""
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(self.eps)
        return self._scaled(x / norm.detach())


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



SMALL_ATTENTION_KEYS = 4
"""An attention is *small* when each head's keys per query are at most this many times its
head width (``n_keys <= 4 d``): its ``[n, n]`` probabilities per head then take at most
four times the memory of its ``[n, d]`` values (ViT-S/B at 224 px: 197 <= 256; Swin's
windows: 49), and keeping them for the backward is cheaper than the fused kernel, which
recomputes them (:func:`small_attention`)."""


def small_attention(n_keys: int, head_dim: int, *, inclusive: bool = True) -> bool:
    """Whether an attention with ``n_keys`` keys per query and heads of width ``head_dim``
    is small (:data:`SMALL_ATTENTION_KEYS`): the explicit softmax with its probabilities
    kept for the backward is then faster than the fused kernel on the CPU, for little
    memory. ``inclusive=False``: strictly below the bound, for the maps that need no
    probabilities (token states and their gradients,
    :func:`~captum_vit.methods._engines.states_attention`; AttnLRP's uniform rule) and
    GAE's: at the bound (SigLIP's 256 patches at head width 64, alone or per tile) the
    fused kernel measured as fast for the first (token IxG 0.70× against 0.73× a
    forward+backward, AttnLRP 0.71× against 0.73×, SigLIP-B at 256 px, one thread) and
    GAE 0.77× against 0.70×, for far less memory (a SmolVLM-shaped VLM of four 256-patch
    tiles: token IxG 413 MB against 674 MB, GAE 371 MB against 640 MB, its SDPA
    forward+backward 470 MB). TokenTM keeps the bound (its explicit trace is what
    brought it within 1.2× on SigLIP2 NaFlex at 256 patches)."""
    return n_keys <= SMALL_ATTENTION_KEYS * head_dim if inclusive else (
        n_keys < SMALL_ATTENTION_KEYS * head_dim)


def _values_only_backward(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> bool:
    """Whether only ``v`` of a fused attention can receive a gradient (``q`` and ``k``
    detached under grad, DecompX's linearised trace) and the logit ``bias`` is a constant:
    the backward is then ``Aᵀ ∂s/∂o`` alone (:meth:`AttentionParts._mix`: a small
    attention multiplies probabilities computed without a graph, a large one
    :class:`_ValuesOnlyAttention`), where the fused kernel's backward would recompute
    ``A`` and also form the gradients of ``q`` and ``k``."""
    return (torch.is_grad_enabled() and v.requires_grad and not q.requires_grad
            and not k.requires_grad and (bias is None or not bias.requires_grad))


QUERY_CHUNK_BYTES = 64 * 2**20
"""At most this many bytes of probabilities at once in :class:`_ValuesOnlyAttention`'s
backward (a chunk of query rows)."""


class _ValuesOnlyAttention(torch.autograd.Function):
    """``A v`` by the fused kernel, ``A = softmax(scale · q kᵀ + bias)`` with ``q``, ``k``
    and ``bias`` constants: the backward recomputes ``A`` (``probs(q, k, bias)``, the
    explicit path's own softmax) a chunk of query rows at a time (at most
    :data:`QUERY_CHUNK_BYTES`) and returns ``∂s/∂v = Aᵀ ∂s/∂o`` only, so no ``[B, H, N,
    N]`` tensor is kept between the passes (two products backward where the fused
    kernel's takes four)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, scale, probs):  # noqa: ANN001, ANN205
        ctx.save_for_backward(q, k, bias)
        ctx.probs = probs
        mask = None if bias is None else bias.to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        q, k, bias = ctx.saved_tensors
        n = q.shape[-2]
        per_row = q.shape[:-2].numel() * k.shape[-2] * q.element_size()
        rows = max(1, QUERY_CHUNK_BYTES // max(1, per_row))
        dv = None
        for i in range(0, n, rows):
            b = bias if bias is None or bias.shape[-2] == 1 else bias[..., i:i + rows, :]
            a = ctx.probs(q[..., i:i + rows, :], k, b)
            part = a.transpose(-2, -1) @ grad[..., i:i + rows, :]
            dv = part if dv is None else dv.add_(part)
        return None, None, dv, None, None, None


class _ScaleGradientRows(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, x, scale):  # noqa: ANN001, ANN205
        ctx.save_for_backward(scale)
        return x.view_as(x)  # no copy: the backward alone differs

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        (scale,) = ctx.saved_tensors
        return grad * scale, None


def scale_gradient_rows(x: Tensor, scale: Tensor) -> Tensor:
    """``x`` in the forward, the gradient times ``scale`` (broadcast) in the backward."""
    return _ScaleGradientRows.apply(x, scale)


class _TrailingRowsLinear(torch.autograd.Function):
    """``x W^T + b`` in one product; the backward reaches ``x`` through the rows of ``W``
    from ``start`` on only (the other outputs are detached by the caller)."""

    @staticmethod
    def forward(ctx, x, weight, bias, start):  # noqa: ANN001, ANN205
        ctx.save_for_backward(weight)
        ctx.start = start
        return affine(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        (weight,) = ctx.saved_tensors
        s = ctx.start
        return grad[..., s:] @ weight[s:], None, None, None


def trailing_rows_linear(x: Tensor, weight: Tensor, bias: Tensor | None, start: int
                         ) -> Tensor:
    """``affine(x, weight, bias)`` whose outputs before column ``start`` the caller
    detaches: the same one product forward (so the same values as the model's fused
    projection), a backward through ``weight[start:]`` only.

    DecompX's linearised attention (``detach_qk``) reads only ``v`` of timm's fused
    ``qkv``; autograd's own backward of the fused product multiplies the whole ``[N, 3D]``
    gradient, zeros of ``q`` and ``k`` included, by the ``[3D, D]`` weight (three times
    the work). Falls back to :func:`affine` when ``weight`` or ``bias`` needs a gradient.

    Examples::

        >>> x, w = torch.randn(2, 5, 4, requires_grad=True), torch.randn(6, 4)
        >>> y = trailing_rows_linear(x, w, None, 4)
        >>> y[..., 4:].sum().backward()
        >>> torch.allclose(x.grad, w[4:].sum(0).expand(2, 5, 4))
        True
    """
    if weight.requires_grad or (bias is not None and bias.requires_grad) \
            or not (torch.is_grad_enabled() and x.requires_grad):
        return affine(x, weight, bias)
    return _TrailingRowsLinear.apply(x, weight, bias, start)


def key_padding_bias(real: Tensor, dtype: torch.dtype) -> Tensor:
    """Attention-logit bias [B, 1, 1, N] that removes the keys where ``real`` [B, N] is
    ``False`` (``-inf``) and leaves the others (0)."""
    bias = torch.zeros(real.shape, dtype=dtype, device=real.device)
    return bias.masked_fill(~real, -math.inf)[:, None, None, :]


@dataclass(frozen=True)
class AttentionRules:
    """Modified backward rules inside one attention (the LRP family,
    :mod:`captum_vit.adapters.rules`).

    Every field is a function whose forward returns exactly the plain computation's value
    and whose backward is a rule's (:mod:`captum_vit.adapters.rules`); ``None`` keeps the
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
               linear: Callable[..., Tensor] | None = None) -> Tensor:
        """``u W^T + b`` (``u`` itself for ``weight = None``) split into heads,
        [B, H, N, d]."""
        b, n, _ = u.shape
        y = u if weight is None else (linear or affine)(u, weight, bias)
        return y.reshape(b, n, self.num_heads, self.head_dim).transpose(1, 2)


@dataclass(frozen=True)
class BlockParts(AttentionParts):
    """Canonical parameters of one pre-LN block (the notation of the module docstring): the
    attention's projections
    (:class:`AttentionParts`; for timm views, i.e. slices, of the model's fused ``qkv``
    parameter, Hugging Face models keep separate q/k/v projections), the norms, LayerScale
    and the MLP."""

    norm1: NormParts | None
    """``LN1`` before the attention; ``None`` = none (``u_l = x_l``: Swin V2's blocks,
    whose only norms are on the branches, :attr:`post_norm1`)."""
    ls1: Tensor | None
    norm2: NormParts | None
    """``LN2`` before the MLP; ``None`` = none (the MLP reads ``x_mid,l``)."""
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
    """Rotary position embedding (timm's Eva family, :mod:`captum_vit.adapters.families.timm_eva`),
    ``(heads, positions) -> heads``: applied
    to ``q`` and to ``k`` [B, H, n, d] after ``q_norm``/``k_norm`` (the order of the
    installed timm's ``EvaAttention.forward``, verified) and before any detaching. It
    rotates the patch rows only (the prefix rows keep their values) with the rotary rows
    of the tokens' original ``positions`` [B, n] (``None`` = the full sequence
    ``0..n-1``); ``None`` = no RoPE."""
    inner_norm: NormParts | None = None
    """LayerNorm ``N_in`` over the concatenated head outputs before ``W_O`` (EVA-02's
    ``scale_attn_inner``, Fang et al. 2023); ``None`` = identity."""
    window: Any = None
    """Windowed attention (a :class:`~captum_vit.adapters.windows.Windows`, which builds on
    this module, hence ``Any`` here), or ``None``: the block
    attends inside the windows of its stage's grid; ``attn_bias`` then returns one
    window's bias ``[1, H, M, M]`` and the probabilities are per window,
    ``[B, H, n_W, M, M]``. ``None`` = global attention."""
    out_norm: NormParts | None = None
    """A LayerNorm on the block's output, before the next block (and before a
    :attr:`merge`): V-JEPA 2's encoder norm between its last encoder layer and its
    attentive pooler's self-attention layers
    (:mod:`captum_vit.adapters.families.hf_vjepa2`). A per-token map (no token mixing):
    the record's ``out`` is the normed state; ``None`` = none."""
    merge: Any = None
    """A patch merge after the block (a
    :class:`~captum_vit.adapters.windows.MergeParts`), or ``None``:
    the last block of a stage hands the next stage its grid; ``None`` = none."""
    fixed_rows: int = 0
    """The first ``fixed_rows`` tokens pass the attention sublayer unchanged (their rows of
    its output, after ``W_O``, are multiplied by 0): TimeSformer's temporal attention,
    which updates the patch tokens only (:mod:`captum_vit.adapters.families.hf_timesformer`);
    0 = every row is updated."""
    query_bias: Callable[[Tensor], Tensor] | None = None
    """A logit term computed from the queries, ``q [B', H, n, d] -> [B', H, n, n]``
    (after the q/k norms, before any scaling), added to the logits like
    :attr:`attn_bias` (SAM's decomposed relative position of MViTv2, Li et al., CVPR
    2022: :class:`~captum_vit.adapters.families.sam.DecomposedRelPos`); a windowed block calls it
    on each window's queries. It sees ``q`` after ``detach_qk`` and the rules' ``heads``,
    so a linearised backward treats it as a constant of the logits. ``None`` = none."""
    post_add: Callable[[Tensor | None, int], Tensor] | None = None
    """A constant added to every token of the block's output (after the FFN's residual add,
    and after a merge if any), ``(positions, n) -> [1 or B, n, D]``: YOLOS's mid position
    embeddings (:mod:`captum_vit.adapters.families.hf_yolos`). ``positions`` are the
    tokens' original indices [B, n] under true token removal (``None``: the full sequence
    of ``n`` tokens), so a kept token gets the row of its original position. It is the
    model's own value, not a function of the tokens: :meth:`Ops.add_constant` adds it
    (DecompX: to the bias source; the gradient rules: the identity, the constant absorbing
    its share like a bias). ``None`` = nothing added."""
    post_norm1: NormParts | None = None
    """A LayerNorm on the attention branch's output, after ``W_O`` (and ``ls1``) and
    before the residual add: ``x_mid = x + LN(ls1(a))`` (Swin V2's residual post-norm,
    Liu et al., CVPR 2022); ``None`` = none. It is one more LayerNorm of the branch: the
    ops' ``norm`` (DecompX's decomposition, the LRP rules) applies to it."""
    post_norm2: NormParts | None = None
    """The MLP branch's post-norm, ``x_{l+1} = x_mid + LN(ls2(MLP(·)))``; ``None`` =
    none."""

    pool: Any = None
    """Query pooling at the block's input (a
    :class:`~captum_vit.adapters.windows.QueryPool`, Hiera), or ``None``: the queries and
    the residual branch (``pool.weight`` applied to ``LN1(x)``) are max-pooled over each
    2×2 group of the input grid, so the block's output lies on the pooled grid; keys and
    values are every input token's. With :attr:`window` the key windows are on the input
    grid and the queries' windows are the same windows on the pooled grid (probabilities
    ``[B, H, n_W, M/4, M]``). ``None`` = none."""

    @property
    def regrid(self) -> Any:
        """What takes this block's input grid to the next block's: its :attr:`merge` (at
        the end of the block) or its :attr:`pool` (at its start); ``None`` = neither. Both
        list each new token's children (``children()``), so per-token values go back
        alike (:mod:`captum_vit.adapters.stages`)."""
        return self.merge if self.merge is not None else self.pool

    def _qkv(self, u: Tensor, detach_qk: bool, positions: Tensor | None = None,
             rules: AttentionRules | None = None, pool_grid: tuple[int, int] | None = None
             ) -> tuple[Tensor, Tensor, Tensor]:
        weight = _consecutive(self.q_weight, self.k_weight, self.v_weight)
        bias = _consecutive(self.q_bias, self.k_bias, self.v_bias)
        no_bias = self.q_bias is None and self.k_bias is None and self.v_bias is None
        linear = affine if rules is None or rules.linear is None else rules.linear
        if weight is not None and (bias is not None or no_bias):
            # one fused matmul, exactly as the model computes it (same rounding forward
            # and backward); the heads then split as in timm's Attention.forward
            b, n, _ = u.shape
            if detach_qk and linear is affine:  # v's rows alone reach u (backward)
                qkv = trailing_rows_linear(u, weight, bias, 2 * self.inner_dim)
            else:
                qkv = linear(u, weight, bias)
            qkv = qkv.reshape(b, n, 3, self.num_heads, self.head_dim)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
            q, k = self.q_norm(q), self.k_norm(k)
        else:
            q = self.q_norm(self._heads(u, self.q_weight, self.q_bias, linear))
            k = self.k_norm(self._heads(u, self.k_weight, self.k_bias, linear))
            v = self._heads(u, self.v_weight, self.v_bias, linear)
        if self.rotary is not None:  # after q/k norm, before detaching (timm's Eva)
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        if pool_grid is not None:  # query pooling (Hiera): the 2x2 maximum of q
            q = pool_tokens(q, pool_grid)
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
                :mod:`captum_vit.adapters.rules`); the forward values are unchanged. Rules
                on the softmax or the mix need ``materialize=True``; those on the
                projections and the per-head tensors also run with the fused kernel.
            heads (list, optional): receives this call's :class:`Heads` (per-head ``q``,
                ``k``, ``v``, output and logit bias), from which the probabilities can be
                recomputed later (:meth:`Heads.probs`) when the fused path kept none.

        Returns:
            (mix [B, N, H*d], probabilities [B, H, N, N] or ``None``): the head mix
            :math:`\sum_j A^h_{ij} v^h_j` with heads concatenated, before ``W_O``.
        """
        if rules is not None and not materialize and (rules.softmax is not None
                                                      or rules.mix is not None):
            raise ValueError("attention rules on the softmax or the mix need the explicit "
                             "path (materialize=True)")
        if self.window is not None:
            return self._windowed(u, materialize, key_mask, positions, detach_qk, rules, heads)
        pool_grid = None
        if self.pool is not None:
            if key_mask is not None or positions is not None:
                raise ValueError("a block with query pooling keeps every token of its grid: "
                                 "true token removal and token subsets do not apply; "
                                 "remove pixels instead")
            pool_grid = self.pool.grid
        q, k, v = self._qkv(u, detach_qk, positions, rules, pool_grid)
        return self.attend(q, k, v, materialize=materialize, key_mask=key_mask,
                           positions=positions, rules=rules, heads=heads)

    def _windowed(self, u: Tensor, materialize: bool, key_mask: Tensor | None,
                  positions: Tensor | None, detach_qk: bool, rules: AttentionRules | None,
                  heads: list[Heads] | None) -> tuple[Tensor, Tensor | None]:
        """:meth:`attention` inside the windows of :attr:`window`: the same projections,
        softmax and rules on the ``B · n_W`` windows, the mix put back on the grid and the
        probabilities returned per window, [B, H, n_W, M, M]."""
        win = self.window
        assert win is not None
        if key_mask is not None or positions is not None:
            raise ValueError("windowed attention keeps every token of its grid: true token "
                             "removal and token subsets do not apply to windowed models; "
                             "remove pixels instead (the metrics' removal='mean', 'black' "
                             "or 'blur'; RISE or ViT-CX instead of TIS)")
        b = u.shape[0]
        # query pooling (Hiera): each window's queries pooled on its own slots
        out = win if self.pool is None else self.pool.query_window(win)
        q, k, v = self._qkv(win.partition(u), detach_qk, None, rules,
                            None if self.pool is None else win.size)
        rel = None if self.attn_bias is None else self.attn_bias()
        bias = self._query_bias(q, win.logit_bias(rel, b, q.dtype, q.device))
        if not materialize:
            mix, _ = self._mix(q, k, v, bias, False, rules, heads)
            return out.reverse(mix), None
        # the probabilities returned are the tensor the mix reads (gradients reach them)
        attn = self.by_window(self._probs(q, k, bias, rules))  # [B, H, n_W, M, M]
        read = attn
        counts = getattr(win, "slot_counts", None)
        c = None if counts is None else counts(attn.dtype, attn.device)  # [n_W, M]
        if c is not None:  # a token in several windows (its rows averaged back)
            c = c[:, :, None]
            # the gradient at the returned tensor is the dense matrix's, ∂s/∂C (identity
            # forward; the true gradient reaches q and k): FrameWindows' docstring
            attn = scale_gradient_rows(attn, 1 / c)
            read = scale_gradient_rows(attn, c)
        probs = read.transpose(1, 2).reshape(q.shape[0], *read.shape[1:2], *read.shape[3:])
        mixing = probs if rules is None or rules.mix is None else rules.mix(probs)
        o = mixing @ v
        if heads is not None:
            heads.append(Heads(q, k, v, o, bias, self))
        mix = o.transpose(1, 2).reshape(q.shape[0], q.shape[2], self.inner_dim)
        return out.reverse(mix), attn

    def by_window(self, probs: Tensor) -> Tensor:
        """Windowed per-head matrices ``[B · n_W, H, M, M]`` as ``[B, H, n_W, M, M]`` (the
        form a windowed block's probabilities are returned in)."""
        win = self.window
        assert win is not None
        b = probs.shape[0] // win.num_windows
        return probs.reshape(b, win.num_windows, *probs.shape[1:]).transpose(1, 2)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, materialize: bool,
               key_mask: Tensor | None = None, positions: Tensor | None = None,
               rules: AttentionRules | None = None, heads: list[Heads] | None = None
               ) -> tuple[Tensor, Tensor | None]:
        """The second half of :meth:`attention`, from its heads ``q``, ``k``, ``v``
        [B, H, N, d] (after q/k norms and rotary embedding) on: for callers that compute
        the token-wise projections once and gather them (TIS's shared first block,
        :mod:`~captum_vit.adapters.subsets`). Arguments and returns as in
        :meth:`attention`."""
        bias = self.logit_bias(q.shape[2], key_mask, positions)
        if self.query_bias is not None and positions is not None:
            raise ValueError("a block whose logits depend on the queries' grid positions "
                             "(decomposed relative position) keeps every token: remove "
                             "pixels instead of tokens")
        return self._mix(q, k, v, self._query_bias(q, bias), materialize, rules, heads)

    def _query_bias(self, q: Tensor, bias: Tensor | None) -> Tensor | None:
        """``bias`` plus :attr:`query_bias` of the queries ``q`` (``bias`` without one)."""
        if self.query_bias is None:
            return bias
        term = self.query_bias(q)
        return term if bias is None else bias.to(term.dtype) + term

    def _mix(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, materialize: bool,
             rules: AttentionRules | None, heads: list[Heads] | None
             ) -> tuple[Tensor, Tensor | None]:
        """The probabilities' mix of ``v`` under the logit ``bias`` (:meth:`attend`)."""
        b, _, n, _ = q.shape
        if materialize:
            probs = self._probs(q, k, bias, rules)
            attn: Tensor | None = probs
            mixing = probs if rules is None or rules.mix is None else rules.mix(probs)
            mix = mixing @ v
        elif _values_only_backward(q, k, v, bias):
            # detached q and k (a linearised backward): the backward is v's alone,
            # probs^T grad; the fused kernel's would recompute the probabilities and
            # form gradients for q and k that nothing asks for
            attn = None
            if small_attention(k.shape[-2], q.shape[-1]):  # keep them: cheaper
                with torch.no_grad():
                    probs = self._probs(q, k, bias)
                mix = probs @ v
            else:  # recomputed in the backward, as the fused kernel's memory
                mix = _ValuesOnlyAttention.apply(q, k, v, bias, self.scale, self._probs)
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
        path = self.value_path(dt)
        if path.centre is None:
            out = F.linear(v, path.weight)
            return out if self.post_norm1 is None else self.post_norm_linear(out, u)
        if attn is None:
            raise ValueError("value_outputs of a block with an inner attention norm "
                             "needs the block's attention probabilities (attn=)")
        if self.post_norm1 is not None:
            raise TypeError("value_outputs of a block with both an inner attention norm and "
                            "a post-norm on its branch is not defined")
        b, n, a = v.shape
        o = attn.to(v.dtype) @ v.reshape(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        return path.outputs(v, path.inv_std(o.transpose(1, 2).reshape(b, n, a)))

    def branch_output(self, u: Tensor) -> Tensor:
        """The attention branch's real output before its post-norm, ``ls1(a)`` [B, N, D]
        (``W_O`` and its bias included) of ``u = LN1(x)`` (``x`` without ``LN1``), in
        ``u``'s dtype, without a graph (a frozen statistic's input)."""
        dt = self.k_weight.dtype
        with torch.no_grad():
            return self._branch_output(u.to(dt)).to(u.dtype)

    def _branch_output(self, u: Tensor) -> Tensor:
        mix, _ = self.attention(u, materialize=False)
        if self.inner_norm is not None:
            inner = self.inner_norm
            mix = F.layer_norm(mix, mix.shape[-1:], inner.weight, inner.bias, inner.eps)
        a = F.linear(mix, self.proj_weight.to(mix.dtype),
                     None if self.proj_bias is None else self.proj_bias.to(mix.dtype))
        return a if self.ls1 is None else a * self.ls1.to(a.dtype)

    def post_norm_linear(self, vectors: Tensor, u: Tensor) -> Tensor:
        r"""Per-token vectors ``[B, N, D]`` of the attention branch (parts of ``ls1(a)``,
        biases excluded) through :attr:`post_norm1` linearised: centred over channels,
        divided by the standard deviation :math:`\sigma_i` of the real branch output of
        the same token (frozen, as DecompX's LayerNorm rule) and scaled by ``γ``; ``β``
        excluded. Identity without a post-norm.

        Args:
            vectors (Tensor): [B, N, D], token ``i``'s vector in row ``i``.
            u (Tensor): ``LN1(x)`` [B, N, D] (``x`` when the block has no ``LN1``), from
                which the real branch output is recomputed.

        Returns:
            Tensor: [B, N, D].
        """
        p = self.post_norm1
        if p is None:
            return vectors
        real = self.branch_output(u).to(vectors.dtype)
        inv = torch.rsqrt(real.var(-1, unbiased=False, keepdim=True) + p.eps)
        y = (vectors - vectors.mean(-1, keepdim=True)) * inv
        return y if p.weight is None else y * p.weight.to(y.dtype)

    def value_path(self, dtype: torch.dtype | None = None) -> ValuePath:
        """The path of the values through this block's output projection, with the inner
        norm's rule (EVA-02's ``scale_attn_inner``) folded in (:class:`ValuePath`).

        Args:
            dtype (torch.dtype, optional): the dtype of the returned tensors (default:
                the parameters').

        Returns:
            ValuePath: ``W'_O``, the centring vector and the frozen scale of the inner
            norm (``centre=None`` without one).

        Examples::

            >>> path = adapter.blocks[0].value_path(torch.float64)
            >>> path.weight.shape     # [D, H*d]
            torch.Size([192, 192])
        """
        return ValuePath.of(self.proj_weight if dtype is None else self.proj_weight.to(dtype),
                            self.inner_norm)

    def features(self) -> tuple[str, ...]:
        """The names of this block's features beyond the plain pre-LN block
        (:data:`BLOCK_FEATURES`): ``"inner_norm"``, ``"mlp_norm"``, ``"gated_mlp"``,
        ``"rotary"``, ``"attn_bias"``, ``"layer_scale"``, ``"qk_norm"``, ``"out_norm"``,
        ``"post_norm"``.

        Returns:
            tuple[str, ...]: the features present, in :data:`BLOCK_FEATURES` order.
        """
        present = {
            "inner_norm": self.inner_norm is not None,
            "mlp_norm": self.mlp_norm is not None,
            "gated_mlp": self.gate_weight is not None,
            "rotary": self.rotary is not None,
            "attn_bias": self.attn_bias is not None,
            "layer_scale": self.ls1 is not None or self.ls2 is not None,
            "qk_norm": not (_is_identity(self.q_norm) and _is_identity(self.k_norm)),
            "out_norm": self.out_norm is not None,
            "post_norm": self.post_norm1 is not None or self.post_norm2 is not None,
        }
        return tuple(f for f in BLOCK_FEATURES if present[f])


BLOCK_FEATURES: dict[str, str] = {
    "inner_norm": "a LayerNorm before the attention's output projection, EVA-02's "
                  "scale_attn_inner",
    "mlp_norm": "a LayerNorm on the MLP's hidden units, timm's scale_mlp",
    "gated_mlp": "a gated MLP such as SwiGLU",
    "rotary": "rotary position embedding",
    "attn_bias": "a relative position bias on the attention logits",
    "layer_scale": "LayerScale",
    "qk_norm": "normalised queries and keys",
    "out_norm": "a LayerNorm on the block's output (V-JEPA 2's encoder norm before its "
                "attentive pooler's layers)",
    "post_norm": "a LayerNorm on a branch's output before the residual add, Swin V2's "
                 "residual post-norm",
}
"""The features a :class:`BlockParts` may have beyond the plain pre-LN block, with what
each is (:meth:`BlockParts.features`)."""


def _is_identity(fn: Callable[[Tensor], Tensor]) -> bool:
    return isinstance(fn, torch.nn.Identity)


@dataclass(frozen=True)
class ValuePath:
    r"""How the values of an attention reach its output projection, linearised at an inner
    LayerNorm :math:`N_{in}` before :math:`W_O` (EVA-02's ``scale_attn_inner``, Fang et
    al. 2023), the one place of this rule.

    A value vector :math:`v_i` [H*d] (any part of one, e.g. one head's values zero-padded
    to the full width) leaves the projection as
    :math:`(v_i W'^{\top}_O - m_i c)\, s_i` with :math:`W'_O = W_O \mathrm{diag}(\gamma)`,
    :math:`c = W_O \gamma`, :math:`m_i` the mean of :math:`v_i` over the full width and
    :math:`s_i = 1/\sigma_i` the inverse standard deviation of the *real* attention
    output of token ``i`` (frozen statistics, as in DecompX's LayerNorm rule); ``β`` and
    every bias are excluded. Without an inner norm it is :math:`v_i W_O^\top`.

    Attributes:
        weight (Tensor): :math:`W'_O` [D, H*d] (:math:`W_O` without an inner norm).
        centre (Tensor or None): :math:`c` [D]; ``None`` = no inner norm.
        eps (float): the inner norm's epsilon (0 without one).
    """

    weight: Tensor
    centre: Tensor | None
    eps: float = 0.0

    @classmethod
    def of(cls, proj_weight: Tensor, inner_norm: NormParts | None) -> ValuePath:
        """The path through ``proj_weight`` (:math:`W_O` [D, H*d]) and ``inner_norm``
        (``None`` = none), in ``proj_weight``'s dtype."""
        if inner_norm is None:
            return cls(proj_weight, None)
        gamma = torch.ones(proj_weight.shape[1], dtype=proj_weight.dtype,
                           device=proj_weight.device) if inner_norm.weight is None \
            else inner_norm.weight.to(proj_weight.dtype)
        return cls(proj_weight * gamma, proj_weight @ gamma, inner_norm.eps)

    def inv_std(self, mix: Tensor) -> Tensor | None:
        r""":math:`s_i = 1/\sigma_i` [B, N] of the real attention output ``mix``
        [B, N, H*d] (before :math:`W_O`); ``None`` without an inner norm."""
        if self.centre is None:
            return None
        return torch.rsqrt(mix.var(-1, unbiased=False) + self.eps)

    def outputs(self, v: Tensor, inv_std: Tensor | None) -> Tensor:
        """The linearised outputs [..., N, D] of values ``v`` [..., N, H*d] with the scale
        ``inv_std`` [..., N] of :meth:`inv_std`."""
        y = F.linear(v, self.weight)
        if self.centre is None:
            return y
        if inv_std is None:
            raise ValueError("inv_std is None but this value path has an inner norm; pass "
                             "inv_std(mix) of the real attention output")
        return (y - v.mean(-1, keepdim=True) * self.centre) * inv_std[..., None]


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
        """The probabilities ``A`` [B, H, N, N] (the explicit path's own computation;
        a windowed block's [B, H, n_W, M, M])."""
        return self._form(self.parts._probs(self.q, self.k, self.bias))

    def probs_grad(self, grad_o: Tensor) -> Tensor:
        """``∂s/∂A`` [B, H, N, N] from ``∂s/∂o`` [B, H, N, d] (``mix = A v``; a windowed
        block's [B, H, n_W, M, M])."""
        g = self._form(grad_o @ self.v.detach().transpose(-2, -1))
        counts = getattr(self.parts.window, "slot_counts", None)
        c = None if counts is None else counts(g.dtype, g.device)
        if c is not None:  # the dense matrix's gradient (as the explicit path's)
            g = g * c[:, :, None]
        return g

    def _form(self, m: Tensor) -> Tensor:
        return m if self.parts.window is None else self.parts.by_window(m)


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
                :mod:`captum_vit.adapters.rules`), as in :meth:`BlockParts.attention`; needs
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
            probs = scores.softmax(-1) if softmax is None else softmax(scores)
            attn: Tensor | None = probs
            mixing = probs if rules is None or rules.mix is None else rules.mix(probs)
            mix = mixing @ v
        else:
            attn = None
            mix = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=self.scale)
        return mix.transpose(1, 2).reshape(b, -1, self.inner_dim), attn



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
    target: TargetHead | Target | None = None
    """Scores against target embeddings, applied to the model's output (embedding
    models inside :meth:`ViTAdapter.targeting`)."""


@dataclass(frozen=True)
class PreLogitsHeadParts(HeadParts):
    """:class:`HeadParts` with a representation layer between the pooling and the
    classifier: each pooled ``z`` becomes ``act(W z + b)`` before its head row
    (``ops.linear`` then ``ops.act``). torchvision's ``representation_size`` head
    (``pre_logits`` + Tanh) and the pooler of Hugging Face's ``ViTModel`` / ``DeiTModel``
    (``pooler.dense`` + ``pooler.activation`` on the CLS row, no head row after it) are
    this layer.

    Attributes:
        pre_logits (tuple or None): ``(weight, bias, act)``; ``None`` = no such layer.
    """

    pre_logits: tuple[Tensor, Tensor | None, Callable[[Tensor], Tensor]] | None = None


@dataclass(frozen=True)
class NeckHeadParts(HeadParts):
    """:class:`HeadParts` with a *neck* between the final norm and the pooling: a
    function ``neck(x, ops) -> x'`` of the token states ``[B, N, D] -> [B, N, D']`` built
    from the ops (``ops.linear``, ``ops.norm``, ``ops.gather``), so every rule set passes
    it. Its output is what :class:`~captum_vit.adapters.scoring.Outputs` reports as the
    tokens. SAM's convolutional neck (:class:`~captum_vit.adapters.families.sam.SamNeck`) is one.

    Attributes:
        neck: an object with ``__call__(x, ops)`` and ``weight`` (its last projection
            ``[D', ...]``: ``D'`` is the embedding width of a head-less model).
    """

    neck: Any = None



def layer_norm_parts(m: nn.Module, where: str) -> NormParts:
    """The :class:`NormParts` of a model's ``nn.LayerNorm`` over the last dimension (views of
    its parameters); ``where`` names it in the error.

    Raises:
        TypeError: another normalisation.
    """
    if not isinstance(m, nn.LayerNorm) or len(m.normalized_shape) != 1:
        raise TypeError(f"{where} is {type(m).__name__}; captum_vit supports LayerNorm here")
    return NormParts(m.weight, m.bias, m.eps)


def rms_norm_parts(m: nn.Module, where: str, compute_dtype: torch.dtype | None = None
                   ) -> NormParts:
    """The :class:`NormParts` of a model's RMSNorm over the last dimension (``rms=True``):
    ``nn.RMSNorm``, or a module with a ``weight`` [D] and a ``variance_epsilon`` (Hugging
    Face's ``*RMSNorm``, computed in ``compute_dtype``: pass ``torch.float32`` where its
    forward casts to float32 and back); ``where`` names it in the error.

    Raises:
        TypeError: another normalisation.
    """
    if isinstance(m, nn.RMSNorm) and len(m.normalized_shape) == 1:
        eps = m.eps if m.eps is not None else torch.finfo(
            m.weight.dtype if m.weight is not None else torch.float32).eps
        return NormParts(m.weight, None, float(eps), rms=True)
    weight, variance_eps = getattr(m, "weight", None), getattr(m, "variance_epsilon", None)
    if not isinstance(weight, Tensor) or weight.dim() != 1 \
            or not isinstance(variance_eps, float):
        raise TypeError(f"{where} is {type(m).__name__}; captum_vit supports RMSNorm here "
                        "(nn.RMSNorm or a module with weight [D] and variance_epsilon)")
    return NormParts(weight, None, variance_eps, rms=True, compute_dtype=compute_dtype)


def require_timm(minimum: tuple[int, ...], model_name: str, why: str) -> None:
    """Refuse a timm model whose installed timm release is older than ``minimum``.

    Args:
        minimum (tuple of int): the oldest timm release the adapter reads, e.g. ``(1, 0, 31)``.
        model_name (str): the model's class name, for the message.
        why (str): what older releases compute differently.

    Raises:
        TypeError: timm is older than ``minimum`` (the message names the upgrade).

    Examples::

        >>> require_timm((1, 0), "SwinTransformer", "windows")   # the installed timm is newer
    """
    import timm

    release = tuple(int(p) for p in re.findall(r"\d+", timm.__version__)[:len(minimum)])
    if release < minimum:
        need = ".".join(map(str, minimum))
        raise TypeError(f"captum_vit reads timm's {model_name} as timm >= {need} computes it; "
                        f"timm {timm.__version__} {why}. Upgrade timm "
                        f"(pip install 'timm>={need}')")


class _PoolMax2x2(torch.autograd.Function):
    """The 2×2 maximum of :func:`pool_tokens` with ``torch.amax``'s gradient, computed by
    elementwise maxima of the strided children: ``amax`` over the two split grid axes (not
    adjacent in memory) was ~4× timm's ``amax(dim=1)`` of its unrolled layout, forward and
    backward (Hiera-T, batch 8). Backward: each child equal to the maximum gets the
    gradient divided by how many are, the others none (``amax``'s formula ``g / count ·
    mask``: the same values, ties shared equally)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, h: int, w: int, dim: int) -> Tensor:
        pre, post = x.shape[:dim], x.shape[dim + 1:]
        xr = x.reshape(*pre, h // 2, 2, w // 2, 2, *post)
        cols = torch.maximum(xr.select(dim + 3, 0), xr.select(dim + 3, 1))  # [.., h/2, 2, w/2, ..]
        y = torch.maximum(cols.select(dim + 1, 0), cols.select(dim + 1, 1))  # [.., h/2, w/2, ..]
        ctx.save_for_backward(x, y)
        ctx.geometry = (h, w, dim)
        return y.reshape(*pre, (h // 2) * (w // 2), *post)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None, None]:
        x, y = ctx.saved_tensors
        h, w, dim = ctx.geometry
        xr = x.reshape(*x.shape[:dim], h // 2, 2, w // 2, 2, *x.shape[dim + 1:])
        top = xr == y.unsqueeze(dim + 1).unsqueeze(dim + 3)  # the maximal children
        cols = top.select(dim + 3, 0).to(g.dtype) + top.select(dim + 3, 1)
        count = cols.select(dim + 1, 0) + cols.select(dim + 1, 1)
        share = g.reshape(y.shape) / count
        return (share.unsqueeze(dim + 1).unsqueeze(dim + 3) * top).reshape(x.shape), \
            None, None, None


def pool_tokens(x: Tensor, grid: tuple[int, int], dim: int = -2) -> Tensor:
    """The maximum over each 2×2 group of a grid's tokens: ``x`` ``[..., h w, ...]`` with the
    tokens of the ``(h, w)`` grid (raster order) along ``dim`` gives ``[..., h/2 · w/2,
    ...]`` (raster order of the ``(h/2, w/2)`` grid; ``h`` and ``w`` even). The gradient
    goes to each channel's maximal child, shared equally on exact ties (as ``torch.amax``
    shares it).

    Examples::

        >>> pool_tokens(torch.arange(16.0).reshape(1, 16, 1), (4, 4))[0, :, 0]
        tensor([ 5.,  7., 13., 15.])
    """
    h, w = grid
    dim = dim % x.dim()
    if x.shape[dim] != h * w or h % 2 or w % 2:
        raise ValueError(f"query pooling of a {h}x{w} grid needs {h * w} tokens and even "
                         f"sides, got {x.shape[dim]} tokens")
    return _PoolMax2x2.apply(x, h, w, dim)


def affine(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x W^T + b`` where the bias may carry token axes (``[B, N, D_out]``: FullGrad+'s
    per-token bias probes). ``F.linear`` takes a 1-D bias only on torch before 2.10 (its
    fused ``addmm`` refuses a broadcast one), so such a bias is added after the product.

    Examples::

        >>> x, w = torch.randn(2, 5, 4), torch.randn(3, 4)
        >>> affine(x, w, torch.zeros(2, 5, 3)).shape
        torch.Size([2, 5, 3])
    """
    if bias is None or bias.dim() <= 1:
        return F.linear(x, weight, bias)
    return F.linear(x, weight) + bias


def linear_module(m: nn.Module, where: str) -> nn.Linear:
    """``m`` if it is an ``nn.Linear``; ``where`` names it in the error.

    Raises:
        TypeError: another module.
    """
    if not isinstance(m, nn.Linear):
        raise TypeError(f"{where} is {type(m).__name__}; captum_vit needs nn.Linear here")
    return m


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
    post = changes.get("post_add")
    if post is not None:
        changes["post_add"] = lambda positions, n: post(positions, n).detach()
    return dataclasses.replace(parts, **changes)



@overload
def rotary_rows(positions: None, seq_len: int, num_prefix: int, num: int,
                device: torch.device) -> None: ...


@overload
def rotary_rows(positions: Tensor, seq_len: int, num_prefix: int, num: int,
                device: torch.device) -> Tensor: ...


def rotary_rows(positions: Tensor | None, seq_len: int, num_prefix: int, num: int,
                device: torch.device) -> Tensor | None:
    """The row of a rotary table of ``num`` patch rows (that of the last embedded input)
    for each patch row of a sequence of ``seq_len`` tokens, the first ``num_prefix`` of
    them unrotated: ``None`` for the full sequence (``positions`` ``None``; it must hold
    ``num`` patch rows), else the original patch index [B, n - num_prefix] of each kept
    token (``positions`` [B, n], the tokens' original indices), on ``device``.

    Raises:
        ValueError: a sequence or positions that the table does not cover.
    """
    k = num_prefix
    if positions is None:
        if seq_len - k != num:
            raise ValueError(
                f"the rotary embedding of the last embedded input covers {num} patch "
                f"tokens but this sequence has {seq_len - k}; embed these images "
                "with adapter.embed first, or pass the kept tokens' positions")
        return None
    idx = positions[:, k:].to(device) - k  # original patch index of each row
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= num):
        raise ValueError(
            f"token positions {int(idx.min()) + k}..{int(idx.max()) + k} fall "
            f"outside the {num} patch tokens of the last embedded input; embed "
            "the images of these tokens with adapter.embed first")
    return idx
