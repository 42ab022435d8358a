r"""Layer-wise Relevance Propagation rules as modified backward passes.

Every rule here is a custom autograd function whose forward returns exactly the model's
value and whose backward returns a modified gradient :math:`\tilde g`, so that the
relevance of any tensor :math:`z` of the forward is :math:`R_z = z \odot \tilde g_z`
("relevance as gradient", Arras et al. 2025; LXT's ``efficient`` module). Operations
without a rule keep their true Jacobian: for a linear map with bias that is the
:math:`\varepsilon`-rule with :math:`\varepsilon \to 0`, the bias absorbing its share.

Two rule sets are :class:`~captum_vit.adapters.Ops` for the adapter's canonical
forward:

- :class:`LRPOps` — CP-LRP (Ali et al., ICML 2022) and AttnLRP (Achtibat et al., ICML
  2024). With its defaults (``method="cp"``) it *is* the linearised forward
  ``Ops(linearize=True)`` of DecompX's gradient route (:mod:`captum_vit.methods.decompx`):
  CP-LRP at the tokens of block ``s`` equals DecompX started at ``s``.
- :class:`CheferOps` — the LRP pass of Chefer, Gur & Wolf (CVPR 2021): α1β0 on linear
  maps, identity on LayerNorm, GELU and softmax, halved LRP-0 on the attention matmuls and
  the rescaled residual add of their ``layers_ours.py``.

LRP is patented (Fraunhofer); see :class:`~captum_vit.methods.lrp.AttnLRP`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from captum_vit.adapters.ops import Ops, activation_gate_detached, layer_norm_frozen_variance
from captum_vit.adapters.parts import (
    AttentionParts,
    AttentionRules,
    BlockParts,
    CosineNorm,
    NormParts,
    PoolParts,
    small_attention,
)

LRP_METHODS = ("cp", "attnlrp")
ATTENTION_RULES = ("attnlrp", "cp")
ACT_RULES = ("identity", "gradient")
CHEFER_STABILIZER = 1e-9


# -- helpers ------------------------------------------------------------------------------
def divide(a: Tensor, b: Tensor) -> Tensor:
    """``a / b`` with 0 where ``b`` is 0 (the gradient form's conversions
    :math:`\\tilde g = R / z`: a zero input carries no relevance); an infinite ``b`` (a
    masked attention logit) gives 0 too."""
    return (a / b).masked_fill_(b == 0, 0)


def chefer_divide(a: Tensor, b: Tensor) -> Tensor:
    """``safe_divide`` of Chefer's ``layers_ours.py``: :math:`a / (b + 10^{-9})` (the
    stabiliser added whatever the sign of ``b``; ``10^{-9}`` where that sum is 0), and 0
    where ``b`` is 0."""
    den = b + CHEFER_STABILIZER
    den = den + (den == 0).to(den.dtype) * CHEFER_STABILIZER
    return a / den * (b != 0).to(b.dtype)


def stabilized_divide(a: Tensor, b: Tensor, eps: float) -> Tensor:
    r""":math:`a / (b + \varepsilon\,\mathrm{sign}(b))` with :math:`\mathrm{sign}(0) = 1`
    (zennit's ``Stabilizer``); for :math:`\varepsilon = 0`, 0 where ``b`` is 0."""
    if eps == 0:
        return divide(a, b)
    sign = torch.where(b >= 0, torch.ones_like(b), -torch.ones_like(b))
    return a / (b + eps * sign)


class BackwardMode:
    """A switch shared by the rules of one forward: ``lrp=True`` (default) runs their
    modified backward, ``False`` the true gradient. One graph then serves a plain backward
    and an LRP backward (Chefer'21 needs both)."""

    def __init__(self) -> None:
        self.lrp = True


def _plain(ctx: Any) -> bool:
    return ctx.mode is not None and not ctx.mode.lrp


class _ScaleGradient(torch.autograd.Function):
    """The identity forward; the gradient times ``factor`` (the uniform rule's split of a
    product's relevance, AttnLRP Eq. 7; Chefer's halving)."""

    @staticmethod
    def forward(ctx, x, factor, mode):
        ctx.factor, ctx.mode = factor, mode
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return (g if _plain(ctx) else g * ctx.factor), None, None


def scale_gradient(x: Tensor, factor: float, mode: BackwardMode | None = None) -> Tensor:
    """``x`` in the forward, ``factor`` times the gradient in the backward (the true
    gradient while ``mode.lrp`` is off)."""
    return _ScaleGradient.apply(x, factor, mode)


class _EpsilonLinear(torch.autograd.Function):
    r""":math:`y = x W^\top + b`; backward of the :math:`\varepsilon`-rule,
    :math:`\tilde g_x = W^\top (\tilde g_y \odot y / (y + \varepsilon\,\mathrm{sign}(y)))`
    (relevance :math:`R_x = x \odot W^\top (R_y / (y + \varepsilon\,\mathrm{sign}\,y))`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y = F.linear(x, weight, bias)
        ctx.save_for_backward(weight, y)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, g):
        weight, y = ctx.saved_tensors
        s = stabilized_divide(y * g, y, ctx.eps)
        return s @ weight.to(s.dtype), None, None, None


class _GammaLinear(torch.autograd.Function):
    r""":math:`y = x W^\top + b`; backward of the generalised :math:`\gamma`-rule (zennit's
    ``Gamma``, the semantics LXT uses for ViTs): for an output with :math:`y_j > 0` the
    positive contributions are boosted, :math:`W^\pm = W + \gamma W^{+}` on positive inputs and
    :math:`W + \gamma W^{-}` on negative ones (bias :math:`b + \gamma b^{+}` in the
    denominator); for :math:`y_j < 0` the roles swap. Relevance
    :math:`R_x = x^{+} \odot (S^{+} W_{+} + S^{-} W_{-}) + x^{-} \odot (S^{+} W_{-} + S^{-} W_{+})`
    with :math:`S^{\pm} = [\pm y > 0]\, R_y / d^{\pm}`; the denominators have the sign of
    :math:`y` and :math:`|d| \geq |y|`. :math:`\gamma = 0` is the
    :math:`\varepsilon`-rule."""

    @staticmethod
    def forward(ctx, x, weight, bias, gamma, eps):
        y = F.linear(x, weight, bias)
        ctx.save_for_backward(x, weight, bias, y)
        ctx.gamma, ctx.eps = gamma, eps
        return y

    @staticmethod
    def backward(ctx, g):
        x, weight, bias, y = ctx.saved_tensors
        gamma, eps = ctx.gamma, ctx.eps
        dt = g.dtype
        w = weight.to(dt)
        wp = w + gamma * w.clamp(min=0)  # W + γW⁺
        wn = w + gamma * w.clamp(max=0)  # W + γW⁻
        xp, xn = x.clamp(min=0), x.clamp(max=0)
        bp = bn = None
        if bias is not None:
            b = bias.to(dt)
            bp, bn = b + gamma * b.clamp(min=0), b + gamma * b.clamp(max=0)
        r = y * g
        d_pos = F.linear(xp, wp, bp) + F.linear(xn, wn)
        d_neg = F.linear(xp, wn, bn) + F.linear(xn, wp)
        zero = torch.zeros_like(r)
        s_pos = torch.where(y > 0, stabilized_divide(r, d_pos, eps), zero)
        s_neg = torch.where(y < 0, stabilized_divide(r, d_neg, eps), zero)
        # R_x / x: the x⁺ terms where x > 0, the x⁻ terms where x < 0
        gx = torch.where(x > 0, s_pos @ wp + s_neg @ wn,
                         torch.where(x < 0, s_pos @ wn + s_neg @ wp, torch.zeros_like(x)))
        return gx, None, None, None, None


def lrp_linear(x: Tensor, weight: Tensor, bias: Tensor | None, gamma: float = 0.0,
               epsilon: float = 0.0) -> Tensor:
    r"""A linear map with the :math:`\varepsilon`-rule (:math:`\gamma = 0`) or the
    :math:`\gamma`-rule in its backward; ``gamma = epsilon = 0`` is ``F.linear`` (the
    true gradient: :math:`\varepsilon \to 0`)."""
    if gamma:
        return _GammaLinear.apply(x, weight, bias, gamma, epsilon)
    if epsilon:
        return _EpsilonLinear.apply(x, weight, bias, epsilon)
    return F.linear(x, weight, bias)


class _IdentityRule(torch.autograd.Function):
    r"""``y = fn(x)`` (shape-preserving); backward of the identity rule
    :math:`R_x = R_y`, i.e. :math:`\tilde g_x = y \odot \tilde g_y / x` (0 where
    :math:`x = 0`). With a :class:`BackwardMode` the forward keeps ``fn``'s own graph
    (whose saved tensors are ``x``, ``y`` or small statistics) for the true gradient,
    which then does not compute ``fn`` again."""

    @staticmethod
    def forward(ctx, x, fn, mode):
        ctx.mode, ctx.graph = mode, None
        if mode is None:
            y = fn(x)
        else:
            with torch.enable_grad():
                xx = x.detach().requires_grad_()
                yy = fn(xx)
            ctx.graph = (xx, yy)
            y = yy.detach()
        ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        if _plain(ctx):  # the true vector-Jacobian product of fn, through its graph
            xx, yy = ctx.graph
            (gx,) = torch.autograd.grad(yy, xx, g, retain_graph=True)
            return gx, None, None
        return divide(y * g, x), None, None


def identity_rule(x: Tensor, fn: Callable[[Tensor], Tensor],
                  mode: BackwardMode | None = None) -> Tensor:
    """``fn(x)`` whose relevance passes through unchanged (Chefer's LayerNorm, softmax,
    activations)."""
    return _IdentityRule.apply(x, fn, mode)


class _AlphaBetaLinear(torch.autograd.Function):
    r""":math:`y = x W^\top + b`; backward of Chefer's α1β0 rule (``layers_ours.Linear``,
    ``alpha=1``): :math:`R_x = x^{+} \odot (S W^{+}) + x^{-} \odot (S W^{-})`,
    :math:`S = R_y / (x^{+} W^{+\top} + x^{-} W^{-\top})` with their ``safe_divide``, the
    bias ignored.

    Computed with one extra product instead of two: per pair,
    :math:`x_i^{+} w^{+} + x_i^{-} w^{-} = (x_i w + |x_i||w|)/2`, so the denominator is
    :math:`z = (x W^\top + |x| |W|^\top)/2` with :math:`x W^\top = y - b` from the forward,
    and :math:`S W^{\pm} = (S W \pm S |W|)/2`. Where :math:`z` is below the rounding
    noise of that sum (:math:`\le 8\,\epsilon\,(|x||W|^\top)`, the case of a zero
    :math:`z`, e.g. every contribution negative) it is taken as 0, as the reference's
    exact zero."""

    @staticmethod
    def forward(ctx, x, weight, bias, mode):
        y = F.linear(x, weight, bias)
        ctx.save_for_backward(x, weight, bias, y)
        ctx.mode = mode
        return y

    @staticmethod
    def backward(ctx, g):
        x, weight, bias, y = ctx.saved_tensors
        w = weight.to(g.dtype)
        if _plain(ctx):
            return g @ w, None, None, None
        wabs = w.abs()
        mag = F.linear(x.abs(), wabs)  # |x| |W|^T
        den = y + mag if bias is None else (y - bias.to(y.dtype)).add_(mag)  # 2z = xWᵀ + |x||W|ᵀ
        # chefer_divide(R, z) / 2 for z >= 0: R / (2 z + 2e-9), 0 where z is 0 (or below
        # the rounding noise of the sum)
        keep = den > (16 * torch.finfo(den.dtype).eps) * mag
        t = (y * g).div_(den.add_(2 * CHEFER_STABILIZER)).mul_(keep)
        sgn = x.sign()  # S W^± = (S W ± S |W|) / 2 by the input's sign; 0 where x = 0
        gx = torch.addcmul(t @ wabs, sgn, t @ w).mul_(sgn)
        return gx, None, None, None


class _RescaledAdd(torch.autograd.Function):
    r"""``a + b``; backward of Chefer's residual ``Add.relprop`` per image: LRP-0 split
    :math:`R_a = a \odot \tilde g`, :math:`R_b = b \odot \tilde g`, then each branch scaled
    so that it receives :math:`|\Sigma R_a| / (|\Sigma R_a| + |\Sigma R_b|)` of
    :math:`\Sigma R` (sums over one image's tensor; the reference code sums over its batch
    of one)."""

    @staticmethod
    def forward(ctx, a, b, mode):
        y = a + b
        ctx.save_for_backward(a, b, y)
        ctx.mode = mode
        return y

    @staticmethod
    def backward(ctx, g):
        a, b, y = ctx.saved_tensors
        if _plain(ctx):
            return g.sum_to_size(a.shape), g.sum_to_size(b.shape), None
        dims = tuple(range(1, g.dim()))
        sa = (a * g).sum(dims) if dims else a * g
        sb = (b * g).sum(dims) if dims else b * g
        total = (y * g).sum(dims) if dims else y * g
        both = sa.abs() + sb.abs()
        ca = chefer_divide(chefer_divide(sa.abs(), both) * total, sa)
        cb = chefer_divide(chefer_divide(sb.abs(), both) * total, sb)
        shape = (-1,) + (1,) * len(dims)
        ga = g * ca.reshape(shape)
        gb = g * cb.reshape(shape)
        return ga.sum_to_size(a.shape), gb.sum_to_size(b.shape), None


def _norm_module_rule(module: Callable[[Tensor], Tensor], rule: str, what: str,
                      mode: BackwardMode | None = None) -> Callable[[Tensor], Tensor]:
    """A q/k-norm callable of a :class:`BlockParts` with an LRP rule: ``"frozen"`` (the LN
    rule, σ detached) or ``"identity"`` (Chefer); the identity module stays as it is; a
    cosine attention's L2 norm (:class:`~captum_vit.adapters.parts.CosineNorm`) is treated
    as a LayerNorm (its norm detached)."""
    if isinstance(module, nn.Identity):
        return module
    if isinstance(module, CosineNorm):  # Swin V2's cosine attention: the norm detached
        cosine = module
        if rule == "frozen":
            return cosine.frozen
        return lambda t: identity_rule(t, cosine, mode)
    if isinstance(module, nn.LayerNorm) and len(module.normalized_shape) == 1:
        w, b, eps = module.weight, module.bias, module.eps
        if rule == "frozen":
            return lambda t: layer_norm_frozen_variance(t, w, b, eps)
        return lambda t: identity_rule(
            t, lambda s: F.layer_norm(s, s.shape[-1:], w, b, eps), mode)
    raise TypeError(f"{what} has no LRP rule for the attention's q/k norm "
                    f"{type(module).__name__} (LayerNorm and identity are supported); "
                    "use attention='cp', which detaches q and k")


_Parts = TypeVar("_Parts", bound=AttentionParts)


def _with_qk_norm_rule(p: _Parts, rule: str, what: str,
                       mode: BackwardMode | None = None) -> _Parts:
    if isinstance(p.q_norm, nn.Identity) and isinstance(p.k_norm, nn.Identity):
        return p
    return dataclasses.replace(p, q_norm=_norm_module_rule(p.q_norm, rule, what, mode),
                               k_norm=_norm_module_rule(p.k_norm, rule, what, mode))


# -- CP-LRP and AttnLRP -------------------------------------------------------------------
class LRPOps(Ops):
    r"""CP-LRP (Ali et al., ICML 2022) and AttnLRP (Achtibat et al., ICML 2024, in the
    efficient form of Arras et al. 2025) as primitive operations of the canonical forward;
    the forward values are the model's.

    Common to both: LayerNorm (and a cosine target's norm) by the LN rule — the standard
    deviation detached, the centring kept — and linear maps by the :math:`\varepsilon`-rule
    (the true gradient for ``epsilon=0``) or the :math:`\gamma`-rule.

    - ``method="cp"`` (CP-LRP, Ali et al. 2022): element-wise activations by the identity
      rule :math:`\tilde g_z = \tilde g_y \cdot \mathrm{act}(z) / z` (``act_rule="identity"``)
      or their true gradient (``"gradient"``); a gated MLP's activated gate is a constant.
    - ``method="attnlrp"`` (AttnLRP, Achtibat et al. 2024): activations by the identity rule
      (Eq. 9); a gated MLP's product by the uniform rule (gradient × ½ into both factors).

    Inside the attention, ``attention="cp"`` keeps the probabilities constant (``q`` and
    ``k`` detached; an attention pool's ``k``), ``attention="attnlrp"`` applies the uniform
    rule to ``q kᵀ`` and ``A v`` (gradient × ¼ into q and k, × ½ into v; the softmax keeps
    its true Jacobian, which in this form is AttnLRP's softmax rule
    :math:`R_x = x \odot (R_s - s\,\Sigma R_s)`, Prop. 3.1) and the LN rule to q/k norms.

    ``LRPOps()`` (CP-LRP, identity rule, :math:`\gamma = \varepsilon = 0`) is exactly
    ``Ops(linearize=True)``, the linearised forward of DecompX's gradient route.

    Args:
        method (str): ``"cp"`` (default) or ``"attnlrp"``.
        attention (str): ``"cp"`` (default) or ``"attnlrp"``.
        act_rule (str): ``"identity"`` (default) or ``"gradient"`` (``method="cp"`` only).
        gamma (float): γ of the linear maps' γ-rule; 0 = ε-rule.
        epsilon (float): ε of the linear maps' rule; 0 = exact.
        positions (Tensor, optional): as for :class:`~captum_vit.adapters.ops.Ops`.

    Examples::

        >>> from captum_vit.adapters.rules import LRPOps
        >>> tr = adapter.trace(images, grad=True, ops=LRPOps(method="attnlrp",
        ...                                                  attention="attnlrp"))
    """

    def __init__(self, *, method: str = "cp", attention: str = "cp",
                 act_rule: str = "identity", gamma: float = 0.0, epsilon: float = 0.0,
                 positions: Tensor | None = None) -> None:
        super().__init__(linearize=True, positions=positions)
        if method not in LRP_METHODS or attention not in ATTENTION_RULES \
                or act_rule not in ACT_RULES:
            raise ValueError(f"unknown LRP rule set {(method, attention, act_rule)!r}")
        self.method, self.attention_rule, self.act_rule = method, attention, act_rule
        self.gamma, self.epsilon = float(gamma), float(epsilon)

    def _linear(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return lrp_linear(x, weight, bias, self.gamma, self.epsilon)

    def linear(self, x: Any, weight: Tensor, bias: Tensor | None) -> Any:
        return self._linear(x, weight, bias)

    def act(self, z: Any, act: Callable[[Tensor], Tensor]) -> Any:
        if self.method == "cp" and self.act_rule == "gradient":
            return act(z)
        return activation_gate_detached(z, act)  # identity rule (AttnLRP Eq. 9)

    def gated(self, g: Any, z: Any, act: Callable[[Tensor], Tensor]) -> Any:
        if self.method == "cp":  # the gate a constant (LXT's cp_gated_mlp_forward)
            return super().gated(g, z, act)
        return scale_gradient(activation_gate_detached(g, act) * z, 0.5)

    def _rules(self) -> AttentionRules | None:
        plain = not (self.gamma or self.epsilon)
        if self.attention_rule == "cp":
            return None if plain else AttentionRules(linear=self._linear)
        return AttentionRules(linear=None if plain else self._linear, heads=_uniform_qkv)

    def attention(self, u: Any, p: BlockParts) -> tuple[Any, Tensor | None]:
        if self.attention_rule == "cp" and not (self.gamma or self.epsilon):
            return super().attention(u, p)  # Ops(linearize=True): q, k detached
        cp = self.attention_rule == "cp"
        if not cp:
            p = _with_qk_norm_rule(p, "frozen", "AttnLRP")
        rules = self._rules()
        # rules on the projections and heads only (AttnLRP's uniform rule) on a large
        # attention: the fused kernel's backward is the softmax's true one, and no
        # [B, H, N, N] is kept (a small one keeps the explicit softmax, faster on the CPU)
        keys = u.shape[1] if p.window is None else p.window.area
        fused = (rules is None or (rules.softmax is None and rules.mix is None)) \
            and not small_attention(keys, p.head_dim, inclusive=False)
        return p.attention(u, materialize=not fused, positions=self.positions,
                           detach_qk=cp, rules=rules)

    def pool_attention(self, x: Any, p: PoolParts) -> tuple[Any, Tensor | None]:
        if self.attention_rule == "cp" and not (self.gamma or self.epsilon):
            return super().pool_attention(x, p)
        cp = self.attention_rule == "cp"
        if not cp:
            p = _with_qk_norm_rule(p, "frozen", "AttnLRP")
        return p.attention(x, materialize=True, detach_k=cp, rules=self._rules())


def _uniform_qkv(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """AttnLRP's uniform rule on ``softmax(q kᵀ) v``: ½ of each product's relevance to
    each factor, i.e. the gradient × ¼ into q and k and × ½ into v (LXT's
    ``wrap_attention_forward``)."""
    return scale_gradient(q, 0.25), scale_gradient(k, 0.25), scale_gradient(v, 0.5)


# -- Chefer et al. 2021 -------------------------------------------------------------------
class CheferOps(Ops):
    r"""The LRP pass of Chefer, Gur & Wolf (CVPR 2021; Transformer-Explainability
    ``layers_ours.py`` and ``ViT_LRP.py``) as primitive operations; the forward values
    are the model's.

    - Linear maps (q/k/v, output projection, MLP, head): α1β0, bias ignored, Chefer's
      stabiliser :math:`10^{-9}`.
    - LayerNorm (also q/k norms, EVA's inner and MLP norms), a cosine target's norm,
      element-wise activations, softmax: identity :math:`R_{in} = R_{out}`.
    - ``q kᵀ`` and ``A v``: LRP-0 to both operands, each halved (the gradient × ½ into q,
      k, v and A); the stored :math:`R^{A}` is after the halving.
    - Adds (residual, heads summed, an attention pool's MLP): LRP-0 split, then each
      branch rescaled to :math:`|\Sigma R_a| / (|\Sigma R_a| + |\Sigma R_b|)` of
      :math:`\Sigma R` per image.
    - Extensions beyond the reference ViT (captum_vit choices): LayerScale, RoPE, pooling
      and head averaging keep their true gradient (LRP-0; a relative position bias in the
      logits absorbs its share); a gated MLP ``act(g) ⊙ z`` splits its relevance in
      halves like the matmuls, the gate's activation by the identity rule.

    Every rule follows ``self.mode`` (:class:`BackwardMode`): with ``mode.lrp = False`` a
    backward through the same graph is the true gradient, so one forward serves the plain
    backward (:math:`\nabla A`) and the LRP backward.
    """

    def __init__(self, *, positions: Tensor | None = None) -> None:
        super().__init__(linearize=False, positions=positions)
        self.mode = mode = BackwardMode()

        def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
            return _AlphaBetaLinear.apply(x, weight, bias, mode)

        def halve3(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            return (scale_gradient(q, 0.5, mode), scale_gradient(k, 0.5, mode),
                    scale_gradient(v, 0.5, mode))

        self.rules = AttentionRules(
            linear=linear, heads=halve3,
            softmax=lambda s: identity_rule(s, lambda t: t.softmax(-1), mode),
            mix=lambda a: scale_gradient(a, 0.5, mode))

    def norm(self, x: Any, p: NormParts) -> Any:
        if p.rms:
            return identity_rule(x, p, self.mode)
        return identity_rule(
            x, lambda t: F.layer_norm(t, t.shape[-1:], p.weight, p.bias, p.eps), self.mode)

    def linear(self, x: Any, weight: Tensor, bias: Tensor | None) -> Any:
        return _AlphaBetaLinear.apply(x, weight, bias, self.mode)

    def act(self, z: Any, act: Callable[[Tensor], Tensor]) -> Any:
        return identity_rule(z, act, self.mode)

    def gated(self, g: Any, z: Any, act: Callable[[Tensor], Tensor]) -> Any:
        return scale_gradient(identity_rule(g, act, self.mode) * z, 0.5, self.mode)

    def normalize(self, x: Any) -> Any:
        return identity_rule(x, lambda t: t / t.norm(dim=-1, keepdim=True), self.mode)

    def add(self, x: Any, y: Any) -> Any:
        return _RescaledAdd.apply(x, y, self.mode)

    def attention(self, u: Any, p: BlockParts) -> tuple[Any, Tensor | None]:
        p = _with_qk_norm_rule(p, "identity", "Chefer'21", self.mode)
        return p.attention(u, materialize=True, positions=self.positions, rules=self.rules)

    def pool_attention(self, x: Any, p: PoolParts) -> tuple[Any, Tensor | None]:
        p = _with_qk_norm_rule(p, "identity", "Chefer'21", self.mode)
        return p.attention(x, materialize=True, rules=self.rules)


__all__ = ["ACT_RULES", "ATTENTION_RULES", "BackwardMode", "CheferOps", "LRPOps", "LRP_METHODS",
           "chefer_divide", "identity_rule", "lrp_linear", "scale_gradient"]
