"""DecompX for Vision Transformers (Modarressi et al., ACL 2023; ViT form of the
SkipPLUS paper, Mehri et al. 2024).

Every hidden state from block ``s`` on is written as a sum of one vector per source
token of ``x_s`` plus one bias source, ``x = sum_j x^(j) + x^(bias)``, and the
decomposition is pushed exactly through the rest of the network. The rules below are
numbered D1-D6 and the code cites them:

- D1 LayerNorm: statistics ``mu_i``, ``sigma_i^2`` frozen from the real token;
  each component is centred by its own channel mean, divided by
  ``sqrt(sigma_i^2 + eps)`` and scaled by ``gamma``; ``beta`` goes to the bias source.
- D2 Linear: ``W`` on every component, the bias to the bias source.
- D3 Attention: the probabilities from the real q, k are constants that mix the
  value components of each head; the value bias goes to the bias source.
- D4 GELU: zero-origin slope, every component times ``GELU(z)/z`` (= Phi(z)). Gated MLP
  (SwiGLU; our choice, the gated analogue of the GELU rule): the activated gate
  ``a = SiLU(g)`` comes from the real input and is a constant per hidden unit; the value
  branch ``z`` is decomposed linearly (its bias to the bias source) and every component is
  multiplied by ``a``, so completeness holds exactly. The gradient route detaches ``a``. (No
  parity fixture: the SkipPLUS authors' code has no gated decomposition; completeness and
  the agreement of the two routes are what the tests check.)
- D5 Residual / LayerScale: component-wise.
- D6 Pooling and head: the readout row (the CLS row, or the mean of the patch rows;
  :meth:`~captum_vit.adapters.Layout.readout_weights`), then the classifier (D2).
- D7 A :class:`~captum_vit.targets.Target` (:mod:`captum_vit.targets`): the
  decomposition stops at the states ``z`` the target reads (the logits, through the model's
  own head as in D6, for a target on the logits; the final-normed tokens or block outputs
  for a target that reads token rows) and the score ``s`` is linearised there, every source
  contributing ``Σ_i ⟨z_i^(j), ∂s/∂z_i⟩`` (each read block with its own partial
  derivative). The contributions, bias source included, sum to the linearised score
  ``⟨z, ∂s/∂z⟩``, which :meth:`DecompX.decompose` reports in ``logit``; ``s`` itself is in
  ``score`` and ``score - logit`` is the completeness error
  (:attr:`DecompXResult.completeness_error`): 0 for a score linear in ``z`` (a class
  logit, a contrast), ``-s`` for a quadratic one. Both routes give the same ``tokens``,
  ``bias`` and ``logit``: the gradient route takes ``⟨z, ∂s/∂z⟩`` from the same backward.

Two routes give the same numbers: ``"explicit"`` carries the components through the
adapter's canonical forward (a :class:`DecompositionOps`), ``"gradient"`` is token
Input x Gradient with a linearised backward (LayerNorm variance, q/k and the GELU gate
detached), which gives every start block from one forward and one backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from captum_vit._base import (
    TargetLike,
    accumulation_dtype,
    check_choice,
    check_layer,
    check_scalar,
    gradients,
    prepare,
    resolve_target,
    target_scores,
)
from captum_vit.adapters import (
    AttentionParts,
    BlockParts,
    BlockRecord,
    NormParts,
    Ops,
    PoolParts,
    ViTAdapter,
    activation_gate,
)
from captum_vit.adapters.scoring import Outputs
from captum_vit.methods._engines import GradientRoute, layer_gradients, layer_gradients_each
from captum_vit.methods._front import PlainAttribution
from captum_vit.methods.table import register_method

ROUTES = ("gradient", "explicit")
DEFAULT_MAX_MEMORY = 1 << 30  # bytes of decomposed activations per chunk of sources


@dataclass
class Decomposed:
    """A hidden state and its decomposition.

    Attributes:
        real (Tensor): the real value ``[B, N, D]`` (``[B, D]`` after pooling), computed
            exactly as in the model's forward.
        parts (Tensor): ``[B, S, N, D]`` (``[B, S, D]``): one component per source of
            this chunk; when ``has_bias`` the last one is the bias source.
        has_bias (bool): whether the last component is the bias source.
    """

    real: Tensor
    parts: Tensor
    has_bias: bool

    def with_bias(self, parts: Tensor, bias: Tensor | None) -> Tensor:
        """Add ``bias`` to the bias-source component of freshly computed ``parts``."""
        if self.has_bias and bias is not None:
            parts[:, -1] += bias.to(parts.dtype)
        return parts


class DecompositionOps(Ops):
    """The canonical forward's primitives on :class:`Decomposed` values (rules D1-D6 above)."""

    def __init__(self) -> None:
        super().__init__(linearize=False)

    def norm(self, x: Decomposed, p: NormParts) -> Decomposed:  # D1
        real = super().norm(x.real, p)
        if p.rms:  # RMSNorm: the LayerNorm rule without the mean term
            # the frozen scale carries a compute_dtype's rounding: the parts sum to ``real``
            parts = x.parts * p.frozen_scale(x.real).to(x.parts.dtype).unsqueeze(1)
            if p.weight is not None:
                parts = parts * p.weight.to(parts.dtype)
            return Decomposed(real, parts, x.has_bias)
        var = x.real.var(-1, unbiased=False, keepdim=True)
        inv_std = torch.rsqrt(var + p.eps).to(x.parts.dtype).unsqueeze(1)
        parts = (x.parts - x.parts.mean(-1, keepdim=True)) * inv_std
        if p.weight is not None:
            parts = parts * p.weight.to(parts.dtype)
        return Decomposed(real, x.with_bias(parts, p.bias), x.has_bias)

    def linear(self, x: Decomposed, weight: Tensor, bias: Tensor | None) -> Decomposed:
        parts = F.linear(x.parts, weight.to(x.parts.dtype))  # D2
        return Decomposed(super().linear(x.real, weight, bias), x.with_bias(parts, bias),
                          x.has_bias)

    def act(self, z: Decomposed, act: Callable[[Tensor], Tensor]) -> Decomposed:  # D4
        real = act(z.real)
        gate = activation_gate(z.real, real).to(z.parts.dtype)
        return Decomposed(real, z.parts * gate.unsqueeze(1), z.has_bias)

    def gated(self, g: Decomposed, z: Decomposed,
              act: Callable[[Tensor], Tensor]) -> Decomposed:  # D4, gated (SwiGLU)
        a = act(g.real)  # the activated gate from the real input, a constant per unit
        return Decomposed(a * z.real, z.parts * a.to(z.parts.dtype).unsqueeze(1), z.has_bias)

    def normalize(self, x: Decomposed) -> Decomposed:
        # cosine embedding targets (captum_vit.targets): ‖e‖ frozen like LayerNorm statistics
        n = x.real.norm(dim=-1, keepdim=True)
        return Decomposed(x.real / n, x.parts / n.to(x.parts.dtype).unsqueeze(1), x.has_bias)

    def scale(self, x: Decomposed, gamma: Tensor) -> Decomposed:  # D5
        return Decomposed(x.real * gamma, x.parts * gamma.to(x.parts.dtype), x.has_bias)

    def add(self, x: Decomposed, y: Decomposed) -> Decomposed:  # D5
        return Decomposed(x.real + y.real, x.parts + y.parts, x.has_bias)

    def add_constant(self, x: Decomposed, c: Tensor) -> Decomposed:  # D2's bias rule
        # a constant of the residual stream (YOLOS's mid position embeddings): to the
        # bias source, like a bias
        parts = x.with_bias(x.parts.clone(), c) if x.has_bias else x.parts
        return Decomposed(x.real + c, parts, x.has_bias)

    @staticmethod
    def _mix(u: Decomposed, real: Tensor, attn: Tensor, p: AttentionParts) -> Decomposed:
        """``concat_h A^h v^h`` of every source with the probabilities ``attn`` [B, H, Q, N]
        held constant; ``v`` is linear in ``u`` (its bias to the bias source)."""
        b, s, n, d = u.parts.shape
        win = getattr(p, "window", None)
        if win is not None:  # per window (Swin): padded slots hold the value bias only
            parts = win.partition(u.parts.reshape(b * s, n, d))  # [b*s*n_W, M, D]
            v = F.linear(parts, p.v_weight.to(parts.dtype))
            v = u.with_bias(v.reshape(b, s, win.num_windows, win.area, -1), p.v_bias)
            v = v.reshape(b, s, win.num_windows, win.area, p.num_heads, p.head_dim)
            mixed = torch.einsum("bhwij,bswjhe->bswihe", attn.to(v.dtype), v)
            pool = getattr(p, "pool", None)  # pooled queries (Hiera): their own windows
            out = win if pool is None else pool.query_window(win)
            mixed = out.reverse(mixed.reshape(b * s * win.num_windows, out.area, -1))
            return Decomposed(real, mixed.reshape(b, s, out.num_tokens, p.inner_dim),
                              u.has_bias)
        v = F.linear(u.parts, p.v_weight.to(u.parts.dtype))
        v = u.with_bias(v, p.v_bias).reshape(b, s, n, p.num_heads, p.head_dim)
        mixed = torch.einsum("bhij,bsjhe->bsihe", attn.to(v.dtype), v)
        return Decomposed(real, mixed.reshape(b, s, -1, p.inner_dim), u.has_bias)

    def maxpool(self, x: Decomposed, pool: Any) -> Decomposed:
        """Query pooling's channel-wise maximum (Hiera): piecewise linear, so each channel
        of a pooled token takes the decomposition of its maximal child (the first on exact
        ties), every source alike; exact (the parts still sum to the real value)."""
        kids = pool.children(x.real.device)  # [N', 4]
        top = x.real[:, kids].argmax(2)  # [B, N', C]
        parts = x.parts[:, :, kids]  # [B, S, N', 4, C]
        idx = top[:, None, :, None, :].expand(-1, parts.shape[1], -1, 1, -1)
        return Decomposed(pool.max(x.real), parts.gather(3, idx).squeeze(3), x.has_bias)

    def gather(self, x: Decomposed, merge: Any) -> Decomposed:
        """A patch merge's concatenated children, every source's part alike (Swin)."""
        b, s, n, d = x.parts.shape
        parts = merge.gather(x.parts.reshape(b * s, n, d))
        parts = parts.reshape(b, s, *parts.shape[1:])  # 4 children (9 for a 3x3 neighbourhood)
        return Decomposed(merge.gather(x.real), parts, x.has_bias)

    def attention(self, u: Decomposed, p: BlockParts) -> tuple[Decomposed, Tensor]:  # D3
        real, probs = super().attention(u.real, p)
        attn = cast(Tensor, probs)  # the plain Ops materialise the probabilities
        return self._mix(u, real, attn, p), attn

    def pool_attention(self, x: Decomposed, p: PoolParts) -> tuple[Decomposed, Tensor]:
        # attention-pool head (global_pool="map"): its probabilities are constants (D3), its
        # value path linear
        real, probs = super().pool_attention(x.real, p)
        attn = cast(Tensor, probs)  # the plain Ops materialise the probabilities
        return self._mix(x, real, attn, p), attn

    def pool(self, x: Decomposed, row: int | str, num_prefix: int) -> Decomposed:  # D6
        parts = (x.parts[:, :, num_prefix:].mean(2) if row == "avg"
                 else x.parts[:, :, cast(int, row)])
        return Decomposed(super().pool(x.real, row, num_prefix), parts, x.has_bias)

    def mean(self, xs: Sequence[Decomposed]) -> Decomposed:
        return Decomposed(super().mean([x.real for x in xs]),
                          super().mean([x.parts for x in xs]), xs[0].has_bias)

    def concat(self, xs: Sequence[Decomposed]) -> Decomposed:
        return Decomposed(super().concat([x.real for x in xs]),
                          super().concat([x.parts for x in xs]), xs[0].has_bias)

    def contract(self, x: Decomposed, g: Tensor) -> Decomposed:
        # a target linearised at the states it reads (D7): every source against the
        # gradient; token states [B, S, N, D] or the logits [B, S, C] (g [B, C, K])
        if x.parts.dim() == 3:
            real = torch.einsum("bc,bck->bk", x.real, g.to(x.real.dtype))
            return Decomposed(real, torch.einsum("bsc,bck->bsk", x.parts,
                                                 g.to(x.parts.dtype)), x.has_bias)
        return Decomposed(super().contract(x.real, g),
                          torch.einsum("bsnd,bndk->bsk", x.parts, g.to(x.parts.dtype)),
                          x.has_bias)

    def value(self, x: Decomposed) -> Tensor:
        return x.real


@dataclass
class DecompXResult:
    r"""Signed contributions of DecompX started at block ``start_layer``, the same on both
    routes.

    The decomposition runs through the model up to the states ``z`` the score reads: the
    logits for a class, target vectors or a target on the logits (the model's own head
    is decomposed exactly, D6), the token states or block outputs for a target of the
    user's own on them (:class:`~captum_vit.targets.TokenTarget`, ``HeadTarget``,
    ``SamMaskTarget``, ...). There the score ``s`` is linearised (D7): source ``j``
    contributes :math:`\sum_i ⟨z_i^{(j)}, ∂s/∂z_i⟩`, and the contributions sum to the
    linearised score :math:`\ell = \sum_i ⟨z_i, ∂s/∂z_i⟩` reported in ``logit``:
    ``tokens.sum(-1) + bias == logit`` always. ``score`` is ``s`` itself;
    :attr:`completeness_error` ``= score - logit`` is 0 (to rounding) where ``s`` is
    linear in ``z`` (a class logit, :class:`~captum_vit.targets.Contrastive`, a linear
    head without bias), and otherwise what the decomposition leaves unexplained (a
    quadratic head: ``logit = 2 score``; a probability; a head's own bias).

    Attributes:
        tokens (Tensor): ``[B, N]`` contribution of every token of ``x_s`` (prefix first).
        bias (Tensor): ``[B]`` contribution of the bias source.
        logit (Tensor): ``[B]`` the linearised score; ``tokens.sum(-1) + bias == logit``
            (the target logit itself for a class).
        target (Tensor): ``[B]`` explained class (column of the target).
        score (Tensor or None): ``[B]`` the score ``s`` (``None``: the same as ``logit``).
    """

    tokens: Tensor
    bias: Tensor
    logit: Tensor
    target: Tensor
    score: Tensor | None = None

    def __post_init__(self) -> None:
        if self.score is None:
            self.score = self.logit

    @property
    def completeness_error(self) -> Tensor:
        """``score - logit`` [B]: what linearising the score at the states it reads
        leaves out (0 for a score linear in them)."""
        return cast(Tensor, self.score) - self.logit


def sources_per_chunk(adapter: ViTAdapter, x: Tensor, max_memory: int | None) -> int:
    """How many sources (of ``N + 1``) one explicit pass may carry within ``max_memory``.

    The estimate is deliberately generous: the largest live set is inside the MLP (two
    ``[B, S, N, W]`` tensors at the MLP width ``W`` and about four ``[B, S, N, D]``
    residual-width tensors); allocator overhead and temporaries are covered by
    doubling it. At least one source is always carried.
    """
    b, n, d = x.shape
    total = n + 1
    if max_memory is None:
        return total
    width = max(p.fc1_weight.shape[0] for p in adapter.blocks)
    itemsize = torch.finfo(accumulation_dtype(x)).bits // 8
    per_source = 2 * b * n * itemsize * (2 * width + 4 * d)
    return max(1, min(total, max_memory // per_source))


def source_parts(x: Tensor, j0: int, j1: int, dtype: torch.dtype) -> Tensor:
    """Initial components [B, j1 - j0, N, D] of sources ``j0..j1-1`` of ``x`` [B, N, D]:
    source ``j < N`` is ``x[:, j]`` at token ``j`` and zero elsewhere; source ``N`` (the
    bias source) starts at zero."""
    b, n, d = x.shape
    tok = torch.arange(j0, min(j1, n), device=x.device)
    parts = x.new_zeros((b, j1 - j0, n, d), dtype=dtype)
    parts[:, tok - j0, tok] = x[:, tok].to(dtype)
    return parts


@torch.no_grad()
def decompose_explicit(adapter: ViTAdapter, x: Tensor, start: int, target: Tensor,
                       max_memory: int | None = DEFAULT_MAX_MEMORY) -> tuple[Tensor, Tensor]:
    """Explicit DecompX from block ``start`` on token states ``x = x_start`` [B, N, D].

    Args:
        adapter (ViTAdapter): the model's adapter.
        x (Tensor): the real block-``start`` input.
        start (int): first block of the decomposition.
        target (Tensor): class per image [B].
        max_memory (int or None): bytes of decomposed activations per pass; the
            ``N + 1`` sources are split into chunks to stay below it (None: one pass).

    Returns:
        (tokens [B, N], bias [B]) signed contributions to the target logit.
    """
    n = x.shape[1]
    dt = accumulation_dtype(x)
    ops = DecompositionOps()
    chunk = sources_per_chunk(adapter, x, max_memory)
    idx = target.to(x.device)[:, None, None]
    out = []
    for j0 in range(0, n + 1, chunk):
        j1 = min(j0 + chunk, n + 1)  # sources j0..j1-1; source n is the bias source
        h = Decomposed(x, source_parts(x, j0, j1, dt), has_bias=j1 == n + 1)
        for l in range(start, adapter.num_blocks):
            h = adapter.block(h, l, ops)
        logits = adapter.logits(h, ops).parts  # [B, S, classes]
        out.append(logits.gather(-1, idx.expand(-1, j1 - j0, 1)).squeeze(-1))
    contrib = torch.cat(out, dim=1)
    return contrib[:, :n], contrib[:, n]


@register_method("decompx", kind="decomposition")
class DecompX(GradientRoute, PlainAttribution):
    r"""DecompX started at block ``s`` (rules D1-D6, see the module docstring): the signed
    contribution of every token of ``x_s`` to the target logit :math:`y_c`, without the bias
    source.

    Writing every hidden state as :math:`x = \sum_j x^{(j)} + x^{(\beta)}` over the
    source tokens :math:`j` of :math:`x_s` and propagating the components exactly
    (LayerNorm with frozen statistics; linear maps; attention with constant
    probabilities; GELU zero-origin slope :math:`\Phi(z)`; residuals; readout and
    classifier), the map is
    :math:`m_j = y_c^{(j)}` and completeness holds:
    :math:`\sum_j m_j + y_c^{(\beta)} = y_c`.

    ``route="gradient"`` (default) computes the same numbers as
    :math:`m_j = \sum_d x_s[j,d]\,\partial y_c/\partial x_s[j,d]` with a linearised
    backward (LayerNorm variance, q, k and the GELU gate detached): one forward and one
    backward for any ``s``. ``route="explicit"`` propagates the decomposition itself,
    ``N (N+1) W`` floats per image at MLP width ``W``; ``max_memory`` chunks the sources
    to bound it. The score is always the logit (the decomposition is of ``y_c``).

    The GELU slope is the exact ratio ``GELU(z)/z`` (its limit 0.5 at ``z = 0``); the
    authors' code divides by ``z + 1e-12``, so on the parity fixture the two differ by
    up to ~2e-10 while completeness here holds to float precision.

    Args:
        model (torch.nn.Module): a supported Vision Transformer.
        start_layer (int, optional): block ``s`` in ``[0, L-1]`` whose input tokens are
            the sources. Default 0 (the embedding output).
        route (str, optional): ``"gradient"`` (default) or ``"explicit"``.
        max_memory (int or None, optional): explicit route only: bytes of decomposed
            activations per pass (default 1 GiB); ``None`` = all sources in one pass.
    """

    linear_in_read_gradient = True  # one forward; the score's gradients only (ViTFront)

    pools_queries = True  # runs through query pooling (Hiera): the forward's own maths

    conserves = True
    gradient_kind = "decompx"  # PLUS / SkipPLUS: IxG with the linearised backward

    def __init__(self, model: nn.Module, start_layer: int = 0, route: str = "gradient",
                 max_memory: int | None = DEFAULT_MAX_MEMORY) -> None:
        super().__init__(model)
        self.start_layer = check_layer("start_layer", start_layer, self.adapter.num_blocks)
        self.route = check_choice("route", route, ROUTES)
        if max_memory is not None:  # bytes; None = no chunking
            max_memory = check_scalar(max_memory, "max_memory", int, min_val=1)
        self.max_memory = max_memory
        # the gradient route is one backward: K answer tokens from one trace (ViTFront)
        self.traces_read_gradients = self.route == "gradient"

    returns_doc = r"""signed per-patch logit contributions (bias source excluded) in the
        requested ``output`` format. Use :meth:`decompose` for the prefix tokens,
        the bias source and the logit."""
    examples_doc = r"""
        >>> from captum_vit import DecompX
        >>> attr = DecompX(model, start_layer=0).attribute(images, target=labels)
        >>> res = DecompX(model, route="explicit").decompose(images, target=labels)
        >>> torch.allclose(res.tokens.sum(-1) + res.bias, res.logit)
        True
    """

    def decompose(self, inputs: Tensor, target: TargetLike = None) -> DecompXResult:
        """All token contributions (prefix included), the bias source and the logit.

        Args:
            inputs (Tensor): images [B, C, H, W].
            target (int, list, Tensor, optional): class per image; ``None`` = predicted.
                For a model that outputs an embedding, target vectors
                (:class:`~captum_vit.EmbeddingTarget`): ``logit`` is then the score
                against them and ``target`` the index of each image's vector.

        Returns:
            DecompXResult: ``tokens`` [B, N], ``bias`` [B], ``logit`` [B] (the
            linearised score, D7; the target logit for a class), ``target`` [B] and
            ``score`` [B] (the target's value).
        """
        p = prepare(self.adapter, inputs, target)
        with self.adapter.targeting(p.embedding):
            return self._decompose(p.images, p.target)

    def _decompose(self, images: Tensor, target: Tensor | None) -> DecompXResult:
        s = self.start_layer
        if self.route == "gradient":
            return self._gradient_route(images, target)
        with torch.no_grad():
            x = self.adapter.embed(images)
            x_s = self.adapter.run(x, 0, s)
            logits = self.adapter.run(x_s, s)
        t = resolve_target(target, logits)
        tokens, bias = decompose_explicit(self.adapter, x_s, s, t, self.max_memory)
        # every source's part of the linearised score (D7): they sum to it
        return DecompXResult(tokens, bias, tokens.sum(-1) + bias, t,
                             target_scores(logits, t).to(tokens.dtype))

    def _gradient_route(self, images: Tensor, target: Tensor | None) -> DecompXResult:
        """Token IxG at ``x_s`` with the linearised backward, streamed: a fused-attention
        forward that keeps only ``x_s`` (no ``[B, H, N, N]`` tensor, no other record) and
        one backward that stops at block ``s``."""
        s = self.start_layer
        kept: list[Tensor] = []

        def keep(l: int, rec: BlockRecord) -> None:
            if l == s:
                kept.append(rec.x)

        with torch.enable_grad():  # also under Captum's no_grad (NoiseTunnel, ...)
            # under a class-token readout the last block's FFN runs on the read rows only
            # (unless the map starts there: it needs every row of that block's input)
            rows = self.adapter.readout_row_count if s < self.adapter.num_blocks - 1 else None
            tr = self.adapter.trace(images, linearize=True, grad=True, attention="fused",
                                    on_block=keep, last_rows=rows)
            t = resolve_target(target, tr.require_logits())
            scores = target_scores(tr.require_logits(), t)
            (g,) = gradients(scores, kept, trace=tr)
            dt = accumulation_dtype(kept[0])
            logit = self._linearised_score(tr, t, dt)
        tokens = (kept[0].detach().to(dt) * g.to(dt)).sum(-1)
        score = scores.detach().to(dt)
        logit = score if logit is None else logit
        return DecompXResult(tokens, logit - tokens.sum(-1), logit, t, score)

    def _linearised_score(self, tr: Any, t: Tensor, dt: torch.dtype) -> Tensor | None:
        r"""D7 on the gradient route: :math:`\sum_z ⟨z, ∂s/∂z⟩` over the states the target
        in force read (``None``: the model's own head, whose score is its logit). Where
        the target reads several block outputs, each gradient is the partial one (the
        other read blocks held fixed), as the explicit route contracts them."""
        target = self.adapter.score_target
        if target is None or tr.read is None or tr.read_grad is None:
            return None
        read, grads = list(tr.read), list(tr.read_grad)
        ad = self.adapter
        layers = target.readout_layers(len(ad.blocks))
        if layers is not None and len(layers) > 1:  # partial derivatives at each block
            leaves = [z.detach().requires_grad_() for z in read]
            out = Outputs(hidden=dict(zip(layers, leaves, strict=True)),
                          **ad._outputs_layout(read[-1]))
            cols = target.columns(out)
            grads = list(torch.autograd.grad(cols.gather(1, t.to(cols.device)[:, None]).sum(),
                                             leaves, allow_unused=True,
                                             materialize_grads=True))
        return cast(Tensor, sum((z.detach().to(dt) * g.to(dt)).flatten(1).sum(1)
                                for z, g in zip(read, grads, strict=True)))

    def _token_maps(self, inputs: Tensor, target: Tensor | None, **_: Any) -> Tensor:
        return self._decompose(inputs, target).tokens

    def _token_maps_each(self, inputs: Tensor, targets: Sequence[Tensor],
                         **_: Any) -> list[Tensor]:
        # the gradient route's IxG at x_s of every column, from one fused-attention trace
        return [lg.ixg()[self.start_layer]
                for lg in layer_gradients_each(self.adapter, inputs, targets, linearize=True,
                                               attention="fused")]

    # takes this method's own options, not any keyword (PLUSFastPath.plus_maps)
    def plus_maps(self, inputs: Tensor, target: Tensor | None, layers: Sequence[int], *,  # type: ignore[override]
                  aggregate: str = "subnetwork", score: str = "logit") -> Tensor:
        """PLUS / SkipPLUS fast path (:mod:`captum_vit.combinators`, gradient route): DecompX
        of every sub-network :math:`f_l` (started at block ``l + start_layer``) from one
        forward and one linearised backward, [len(layers), B, N].

        Examples::

            >>> from captum_vit import DecompX, SkipPLUS
            >>> attr = SkipPLUS(model, DecompX).attribute(images, target=labels)
        """
        if aggregate != "subnetwork":
            raise ValueError("aggregate='layer' is not defined for DecompX (it decomposes the "
                             "whole sub-network, there is no per-block matrix); use "
                             "aggregate='subnetwork'")
        for l in layers:  # the check the method makes on each (L - l)-block sub-network
            check_layer("start_layer", self.start_layer, self.adapter.num_blocks - l)
        lg = layer_gradients(self.adapter, inputs, target, score=score, linearize=True)
        return lg.ixg()[[l + self.start_layer for l in layers]]
