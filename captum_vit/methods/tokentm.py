"""Token Transformation Matters (Wu et al., CVPR 2024).

Eq. numbers are the paper's. A sublayer turns original tokens ``E`` into transformed
tokens ``Ẽ``; its *transformation weights* (Eq. 12-13) are

    NECC_i = exp(cos(E_i, Ẽ_i)) / sum_k exp(cos(E_k, Ẽ_k))          (Eq. 12)
    W      = diag( L(Ẽ_i) / L(E_i) * NECC_i ),   L(z) = ||z||_2         (Eq. 13)

and the token-level contributions are aggregated over the blocks (Eq. 14-19):

    U_attn = I + mean_h [ ReLU(∇A^h) ⊙ (A^h W^h) ]                     (Eq. 14-15)
    U_ffn  = I + W_ffn                                                 (Eq. 16-17)
    C_0    = diag( L(x_0,i) ),   C <- U_ffn U_attn C  for l = 0..L-1     (Eq. 18-19)
    m      = readout row of C                                          (Eq. 20)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from captum.log import log_usage
from torch import Tensor, nn

from captum_vit._base import (
    SCORES,
    TargetLike,
    ViTGradientAttribution,
    accumulation_dtype,
    check_choice,
    gradients_with_pool,
    readout_rows,
    resolve_target,
    target_scores,
)
from captum_vit.adapters import BlockRecord, Heads, NormParts, Ops, PoolParts, Trace, ValuePath
from captum_vit.adapters.scoring import scores_are_classes
from captum_vit.methods._engines import PLUSFastPath
from captum_vit.methods._front import fill_doc, plus_doc
from captum_vit.methods.table import register_method

VARIANTS = ("paper", "residual")


@dataclass
class _Terms:
    """What TokenTM keeps of one block after it has run (the rest is freed)."""

    heads: Heads  # q, k, v, o: A_l and ∇A_l are recomputed from them
    w_ffn: Tensor  # W_ffn [B, N] (Eq. 16)
    w_attn: Tensor  # W^h [B, H, N] ("paper") or W_attn [B, N] ("residual")
    x_norm: Tensor  # L(x_l,i) [B, N] (Eq. 18 at block l)
    merge: Tensor | None = None  # a patch merge after the block: its children's weights
    shares: Tensor | None = None  # query pooling (Hiera): the residual's child shares
DEFAULT_SCORE = {"paper": "probability", "residual": "logit"}
EPS = 1e-8


def default_score(variant: str, probability: str = "softmax") -> str:
    """The score TokenTM differentiates when ``score=None``, read from the scores in
    force (:func:`~captum_vit.adapters.scoring.scores_are_classes`): the variant's own
    (:data:`DEFAULT_SCORE`) where they compete like classes (a classifier's classes,
    several target vectors, a target with ``index=``), whose softmax is the paper's
    :math:`p(c)`; ``"logit"``, the score itself, for a single independent score (a plain
    callable, a :class:`~captum_vit.targets.TokenTarget` without ``index``, one target
    vector, ``MultiLabel``, ``Contrastive``, a detection, mask or answer score). Their
    "probability" is the sigmoid of the score, which saturates: past a score of about 37
    (17 in float32) its gradient is exactly 0, so ``∇A`` vanishes and the readout of a
    token-reading target falls back to uniform weights. ``target=lambda z: z[:, c]``
    therefore explains :math:`z_c` (the integer target's ``score="logit"`` map), and
    ``score="probability"`` still asks for the sigmoid.

    Args:
        variant (str): ``"paper"`` or ``"residual"``.
        probability (str, optional): the kind of the scores' probabilities, the
            adapter's :attr:`~captum_vit.adapters.ViTAdapter.probability` (default
            ``"softmax"``).

    Returns:
        str: ``"probability"`` or ``"logit"``.
    """
    return DEFAULT_SCORE[variant] if scores_are_classes(probability) else "logit"


def transformation_weights(e: Tensor, e_t: Tensor, eps: float = EPS) -> Tensor:
    """Diagonal of ``W`` (Eq. 12-13) for original tokens ``e`` and transformed ``e_t``.

    Args:
        e (Tensor): original tokens [..., N, D].
        e_t (Tensor): transformed tokens [..., N, D].
        eps (float): added to ``L(E_i)`` and used as the norm floor of the cosine
            (the convention of :func:`torch.nn.functional.cosine_similarity`).

    Returns:
        Tensor: ``L(Ẽ_i) / (L(E_i) + eps) * NECC_i`` [..., N]; NECC sums to 1 over N.
    """
    le, lt = e.norm(dim=-1), e_t.norm(dim=-1)
    return weights_from_norms(le, lt, (e * e_t).sum(-1), eps)


def necc(le: Tensor, lt: Tensor, dot: Tensor, eps: float = EPS) -> Tensor:
    """NECC (Eq. 12) from ``L(E_i)``, ``L(Ẽ_i)`` and ``E_i·Ẽ_i`` [..., N]; sums to 1 over N.

    The cosine floors each length at ``eps`` (``torch.nn.functional.cosine_similarity``'s
    convention, which reproduces the authors' numbers; ``dot / (L L + eps)`` does not).
    """
    cos = dot / (le.clamp(min=eps) * lt.clamp(min=eps))
    return cos.softmax(dim=-1)  # softmax over the tokens of one image


def weights_from_norms(le: Tensor, lt: Tensor, dot: Tensor, eps: float = EPS) -> Tensor:
    """Eq. 13 from the lengths ``L(E_i)``, ``L(Ẽ_i)`` and the dot products ``E_i·Ẽ_i``."""
    return lt / (le + eps) * necc(le, lt, dot, eps)


def merge_weights(merge: Any, x: Tensor, eps: float = EPS) -> Tensor:
    r"""TokenTM's weights of a patch merge's children (Swin; our extension), [B, N', 4]:
    the length of each child's share of the merged token,
    :math:`\lVert \tilde x_{c_k} W_k \rVert / \sum_k \lVert \tilde x_{c_k} W_k \rVert`, with
    :math:`\tilde x` the merge's LayerNorm of the concatenated children (frozen
    statistics, no shift), :math:`\tilde x_{c_k}` child ``k``'s slice and :math:`W_k` its
    columns of the merge's linear map (:class:`~captum_vit.adapters.MergeParts`); a
    padded child of an odd grid gets 0. A merge that norms after its reduction (Swin V2,
    ``norm_last``): :math:`\lVert \gamma \odot C(x_{c_k} W_k) \rVert` over their sum,
    ``C`` the centring over the reduced channels (the shared :math:`1/\sigma` cancels).

    Args:
        merge (MergeParts): the merge.
        x (Tensor): the token states it merges [B, N, C].
        eps (float): floor of the sum.

    Returns:
        Tensor: [B, N', 4], rows summing to 1.
    """
    g = merge.gather(x)  # [B, N', 4C]
    n = merge.norm
    c = x.shape[-1]
    if getattr(merge, "norm_last", False):  # Swin V2: LN(concat W^T), one σ per token
        w = merge.weight.to(g.dtype)
        shares = torch.stack([torch.nn.functional.linear(g[..., k * c:(k + 1) * c],
                                                         w[:, k * c:(k + 1) * c])
                              for k in range(4)], -2)  # [B, N', 4, D']
        shares = shares - shares.mean(-1, keepdim=True)
        if n.weight is not None:
            shares = shares * n.weight.to(shares.dtype)
        lengths = shares.norm(dim=-1) * (merge.children(x.device) >= 0).to(g.dtype)
        return lengths / lengths.sum(-1, keepdim=True).clamp(min=eps)
    xt = (g - g.mean(-1, keepdim=True)) * torch.rsqrt(g.var(-1, unbiased=False, keepdim=True)
                                                      + n.eps)
    if n.weight is not None:
        xt = xt * n.weight.to(xt.dtype)
    w = merge.weight.to(xt.dtype)
    lengths = torch.stack([torch.nn.functional.linear(xt[..., k * c:(k + 1) * c],
                                                      w[:, k * c:(k + 1) * c]).norm(dim=-1)
                           for k in range(4)], -1)
    lengths = lengths * (merge.children(x.device) >= 0).to(xt.dtype)
    return lengths / lengths.sum(-1, keepdim=True).clamp(min=eps)


def head_weights(x: Tensor, u: Tensor, v_weight: Tensor, proj_weight: Tensor,
                 num_heads: int, eps: float = EPS, scale: Tensor | None = None) -> Tensor:
    """Per-head weights ``W^h`` of the attention sublayer (Eq. 13 with Eq. 5), [B, H, N].

    ``E = x`` and ``Ẽ^h = u W_V^h W_O^h``. The [B, H, N, D] tensor ``Ẽ`` is never formed:
    with ``v^h = u W_V^h`` [N, d] and ``W_O^h`` the head's [d, D] slice,
    ``E_i·Ẽ^h_i = v^h_i · (x_i W_O^hᵀ)`` and ``L(Ẽ^h_i)² = v^h_i (W_O^h W_O^hᵀ) v^h_iᵀ``.
    ``scale`` [B, N] (default none) multiplies token ``i``'s ``Ẽ^h_i`` (a post-norm's
    frozen ``1/σ_i``, with its centring and ``γ`` folded into ``proj_weight``).
    """
    b, n, _ = x.shape
    d = v_weight.shape[0] // num_heads
    v = torch.nn.functional.linear(u, v_weight).reshape(b * n, num_heads, d)  # v^h_i
    xo = (x @ proj_weight).reshape(b * n, num_heads, d)  # x_i W_O^hᵀ
    dot = (v * xo).sum(-1)  # E_i·Ẽ^h_i, [B*N, H]
    wo = proj_weight.reshape(-1, num_heads, d).transpose(0, 1)  # W_O^hᵀ, [H, D, d]
    vh = v.transpose(0, 1)  # [H, B*N, d]
    sq = (torch.bmm(vh, wo.transpose(1, 2) @ wo) * vh).sum(-1)  # L(Ẽ^h_i)², [H, B*N]
    lt = sq.clamp(min=0).sqrt().reshape(num_heads, b, n).transpose(0, 1)
    dot = dot.reshape(b, n, num_heads).permute(0, 2, 1)
    if scale is not None:
        lt, dot = lt * scale[:, None], dot * scale[:, None]
    return weights_from_norms(x.norm(dim=-1)[:, None], lt, dot, eps)


def _branch_of_heads(p: Any, heads: Heads) -> Tensor:
    """The attention branch's real output before its post-norm, ``ls1(o W_Oᵀ + b_O)``
    [B, N, D], from the heads' mix ``o`` that the forward kept (a windowed block's put
    back on its grid): what :meth:`~captum_vit.adapters.BlockParts.branch_output`
    recomputes from ``LN1(x)``, without recomputing ``q``, ``k``, ``v`` and the
    attention (a block without an inner attention norm)."""
    o = heads.o.detach()
    mix = o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1)
    win = p.window
    if win is not None:
        mix = (win if p.pool is None else p.pool.query_window(win)).reverse(mix)
    a = torch.nn.functional.linear(mix, p.proj_weight.detach().to(mix.dtype),
                                   None if p.proj_bias is None
                                   else p.proj_bias.detach().to(mix.dtype))
    return a if p.ls1 is None else a * p.ls1.detach().to(a.dtype)


def _post_norm_path(p: Any, wo: Tensor, u: Tensor, heads: Heads | None = None
                    ) -> tuple[Tensor, Tensor]:
    r"""``W_O`` [D, H*d] with a post-norm's centring and ``γ`` folded in, and its frozen
    ``1/σ_i`` [B, N] of the real branch output (Swin V2; our extension of Eq. 5:
    :math:`\tilde E^h_i = \gamma \odot C(u_i W_V^h W_O^h) / \sigma_i`, biases and
    ``β`` excluded). The branch output is read from the forward's ``heads`` when given
    (:func:`_branch_of_heads`), else recomputed from ``u``."""
    norm = p.post_norm1
    wo = wo - wo.mean(0, keepdim=True)
    if norm.weight is not None:
        wo = wo * norm.weight.detach().to(wo.dtype)[:, None]
    real = p.branch_output(u) if heads is None else _branch_of_heads(p, heads)
    real = real.detach().to(wo.dtype)
    return wo, torch.rsqrt(real.var(-1, unbiased=False) + norm.eps)


def head_weights_inner_norm(x: Tensor, u: Tensor, attn: Tensor, v_weight: Tensor,
                            v_bias: Tensor | None, proj_weight: Tensor, norm: NormParts,
                            num_heads: int, eps: float = EPS) -> Tensor:
    r"""Per-head weights ``W^h`` [B, H, N] of an attention sublayer with an inner LayerNorm
    ``N_in`` before ``W_O`` (EVA-02's ``scale_attn_inner``; our extension of the paper's
    Eq. 5, which has no such norm: ``N_in`` is linearised with frozen statistics).

    ``E = x`` and :math:`\tilde E^h = N_{in}^{lin}(u W_V^h \oplus 0)\, W_O`: head ``h``'s
    values zero-padded to the full width ``H d``, centred by their own mean
    :math:`m^h = \sum v^h / (H d)`, divided by the standard deviation
    :math:`\sigma` of the real attention output :math:`o = \mathrm{concat}_h A^h (u W_V^h
    + b_V^h)` (frozen, per token) and scaled by ``γ``; ``β`` and all biases are excluded
    (Eq. 5). With :math:`W'_O = W_O \mathrm{diag}(γ)` and :math:`c = W_O γ`,
    :math:`\tilde E^h_i = (v^h_i W'^{h\top}_O - m^h_i c) / \sigma_i`, so, as in
    :func:`head_weights`, the [B, H, N, D] tensor is never formed.

    Args:
        x (Tensor): block input ``E`` [B, N, D].
        u (Tensor): ``LN_1(x)`` [B, N, D].
        attn (Tensor): the block's attention probabilities ``A`` [B, H, N, N].
        v_weight (Tensor): ``W_V`` [H*d, D]; ``v_bias`` [H*d] or ``None`` (it enters only
            the statistics of ``o``).
        proj_weight (Tensor): ``W_O`` [D, H*d].
        norm (NormParts): ``N_in``.
        num_heads (int): ``H``.
        eps (float): as in :func:`transformation_weights`.

    Returns:
        Tensor: ``W^h`` [B, H, N].
    """
    b, n, _ = x.shape
    a = v_weight.shape[0]
    d = a // num_heads
    v = torch.nn.functional.linear(u, v_weight)  # u W_V, [B, N, H*d]
    real = v if v_bias is None else v + v_bias
    o = attn @ real.reshape(b, n, num_heads, d).transpose(1, 2)  # A^h v^h, [B, H, N, d]
    o = o.transpose(1, 2).reshape(b, n, a)
    path = ValuePath.of(proj_weight, norm)  # the inner norm's rule, adapters.parts
    # with an inner norm ValuePath has its centre and scale
    inv = cast(Tensor, path.inv_std(o))[..., None]  # 1/σ_i, [B, N, 1]
    wo, c = path.weight, cast(Tensor, path.centre)  # W'_O = W_O diag(γ) [D, H*d], W_O γ [D]
    vh = v.reshape(b, n, num_heads, d)
    m = vh.sum(-1) / a  # mean of the zero-padded head values, [B, N, H]
    xw = (x @ wo).reshape(b, n, num_heads, d)  # x_i W'^h_O
    dot = ((vh * xw).sum(-1) - m * (x @ c)[..., None]) * inv  # E_i·Ẽ^h_i, [B, N, H]
    woh = wo.reshape(-1, num_heads, d).transpose(0, 1)  # [H, D, d]
    gram = woh.transpose(1, 2) @ woh  # W'^hᵀ W'^h, [H, d, d]
    cw = (c @ wo).reshape(num_heads, d)  # c W'^h
    sq = (torch.einsum("bnhe,hef,bnhf->bnh", vh, gram, vh)
          - 2 * m * (vh * cw).sum(-1) + m * m * (c @ c)) * inv * inv  # L(Ẽ^h_i)²
    lt = sq.clamp(min=0).sqrt()
    return weights_from_norms(x.norm(dim=-1)[:, None], lt.permute(0, 2, 1),
                              dot.permute(0, 2, 1), eps)


@register_method("tokentm", kind="gradient_attention",
                 variants={"tokentm_residual": {"variant": "residual"}})
class TokenTM(PLUSFastPath, ViTGradientAttribution):
    r"""TokenTM: attention weighted by token transformation effects (Wu et al., 2024).

    **variant="paper"** (default, the paper's Eq. 9-20): for block :math:`l` the attention
    sublayer has original tokens :math:`E = x_l` and per-head transformed tokens
    :math:`\tilde E^h = \mathrm{LN_1}(x_l) W_V^h W_O^h` (Eq. 5, biases excluded), giving
    :math:`W^h` (Eq. 12-13) and
    :math:`U_{attn} = I + \mathrm{mean}_h[\mathrm{ReLU}(\nabla A^h) \odot (A^h W^h)]`
    (Eq. 14-15; :math:`A^h W^h` scales column :math:`j` by :math:`W^h_j`). The FFN
    sublayer has :math:`E = x_{mid,l}`, :math:`\tilde E = \mathrm{ls_2}(\mathrm{MLP}(
    \mathrm{LN_2}(x_{mid,l})))` and :math:`U_{ffn} = I + W_{ffn}` (Eq. 16-17). With
    :math:`C_0 = \mathrm{diag}(L(x_{0,i}))` (Eq. 18) and :math:`C \leftarrow U_{ffn}
    U_{attn} C` (Eq. 19) the map is the readout row of :math:`C` (Eq. 20). The gradient
    is of the target probability (the paper differentiates :math:`p(c)`); for a single
    score of the user's own, of the score itself (:func:`default_score`). With an inner
    attention LayerNorm :math:`N_{in}` before :math:`W_O` (EVA-02; our extension),
    :math:`\tilde E^h = N_{in}^{lin}(\mathrm{LN_1}(x_l) W_V^h \oplus 0) W_O` with the
    statistics of the real attention output frozen (:func:`head_weights_inner_norm`).

    **variant="residual"**: the re-implementation of the LibraGrad authors, for
    comparison: one weight set per block from residual states,
    :math:`W_{attn}` from :math:`(x_l, x_{mid,l})`,
    :math:`U_{attn} = I + (\bar A_l W_{attn}) \odot \mathrm{mean}_h \mathrm{ReLU}(\nabla
    A_l^h)`, :math:`W_{ffn}` from :math:`(x_{mid,l}, x_{l+1})`; gradient of the logit.

    :math:`\varepsilon = 10^{-8}` is added to every length in a denominator (the cosine
    floors each length at :math:`\varepsilon`, as ``torch.nn.functional.cosine_similarity``).
    The gradients of every block's attention come from one backward pass. Since
    :math:`C \leftarrow U C` is linear, only the readout row is propagated,
    :math:`m = r^\top U_{ffn,L-1} U_{attn,L-1} \cdots U_{attn,0}\, C_0`, which costs
    :math:`O(H N^2)` per block and equals the matrix recursion. Maps are accumulated in
    float32 for half-precision inputs (magnitudes grow with depth).

    Composed with :class:`~captum_vit.combinators.PLUS` / ``SkipPLUS`` it takes a fast
    path (:meth:`plus_maps`): every sub-network's map from one backward.

    Args:
        model (torch.nn.Module): a supported Vision Transformer.
        variant (str, optional): ``"paper"`` (default) or ``"residual"``, in any case
            (``"Paper"``), like method names.

    **Query pooling** (Hiera; our extension): a pooling block maps
    the ``N`` tokens of its input grid to the ``N/4`` of the pooled grid, and its residual
    branch is :math:`\max_c (\mathrm{LN_1}(x_c) W_p + b_p)` over the 2×2 children ``c``
    (a new width). The identity of :math:`U_{attn}` becomes the residual's token mixing
    :math:`R_l` [N/4, N], each pooled token's row holding its children's shares of the
    channels where they are the maximum (¼ each on exact ties;
    :meth:`~captum_vit.adapters.Stages.residual`), and the original tokens of the
    attention sublayer (per key token ``j``, of the input grid) are the residual's
    projected tokens before the maximum, :math:`E_j = \mathrm{LN_1}(x_j) W_p + b_p`,
    which have the width of :math:`\tilde E^h` (``x_j`` has the old width: the cosine
    of Eq. 12 has no meaning there). The ``"residual"`` variant's :math:`W_{attn}` pairs
    that :math:`E_j` with the ``x_mid`` of ``j``'s pooled token. :math:`U_{ffn}` and
    :math:`C_0 = \mathrm{diag}(L(x_{l,i}))` are unchanged (on the output and input
    grids).
    """

    linear_in_read_gradient = True  # one forward; the score's gradients only (ViTFront)

    pools_queries = True  # the row chain through query pooling (Stages.residual)


    def __init__(self, model: nn.Module, variant: str = "paper") -> None:
        if isinstance(variant, str):
            variant = variant.strip().lower().replace("-", "_")
        check_choice("variant", variant, VARIANTS)
        super().__init__(model)
        self.variant = variant

    @log_usage()
    @fill_doc
    def attribute(self, inputs: Tensor, target: TargetLike = None, *, score: str | None = None,
                  output: str = "pixels") -> Tensor:
        r"""
        Args:
            {inputs}
            {target}
            score (str, optional): ``"probability"`` or ``"logit"``. Default ``None`` =
                the variant's own where the scores compete like classes:
                ``"probability"`` (their softmax) for ``"paper"``, ``"logit"`` for
                ``"residual"``; ``"logit"`` for a single score of your own (a plain
                callable, a :class:`~captum_vit.targets.TokenTarget` without ``index``,
                one target vector), whose probability would be its saturating sigmoid
                (:func:`default_score`).
            {output}

        Returns:
            Tensor: the (non-negative) attribution map in the requested ``output`` format.

        Examples::

            >>> from captum_vit import TokenTM
            >>> from captum.attr import NoiseTunnel
            >>> attr = TokenTM(model).attribute(images, target=labels)
            >>> resid = TokenTM(model, variant="residual").attribute(images, target=labels)
            >>> smooth = NoiseTunnel(TokenTM(model)).attribute(
            ...     images, nt_type="smoothgrad", stdevs=0.1, target=labels)
        """
        if score is not None:
            check_choice("score", score, SCORES)
        return self._attribute(inputs, target, output, score=score)

    def _token_maps(self, inputs: Tensor, target: Tensor | None, *, score: str | None = None,
                    **_: Any) -> Tensor:
        # Eq. 18-20: the sub-network map of layer 0 is r_0 diag(L(x_0,i))
        return self._maps(inputs, target, [0], score)[0]

    def _block_terms(self, rec: BlockRecord, l: int) -> _Terms:
        """What the propagation needs of block ``l``, computed as soon as the block has run
        (no gradient involved): ``W^h`` / ``W_attn`` and ``W_ffn`` (Eq. 12-13, 16) and
        ``L(x_l,i)`` (Eq. 18); the block's other tensors are then freed."""
        p = self.adapter.blocks[l]
        dt = accumulation_dtype(rec.x)
        x, mid = rec.x.detach().to(dt), rec.mid.detach().to(dt)
        out = rec.out.detach().to(dt)
        merge = None
        if p.merge is not None:  # Swin: out is merged; the FFN's output is mid + ffn_out
            out = mid + rec.ffn_out.detach().to(dt)
            merge = merge_weights(p.merge, out)
        u = rec.u.detach().to(dt)
        e = x  # the attention sublayer's original tokens E (per key token)
        shares = None
        if p.pool is not None:  # query pooling (Hiera; our extension, class docstring)
            e = torch.nn.functional.linear(u, p.pool.weight.detach().to(dt),
                                           None if p.pool.bias is None
                                           else p.pool.bias.detach().to(dt))
            shares = rec.pool_shares
        if self.variant == "residual":
            if p.pool is not None:  # each input token with its pooled token's x_mid
                parent = torch.empty(e.shape[1], dtype=torch.long, device=e.device)
                kids = p.pool.children(e.device)
                parent[kids.reshape(-1)] = torch.arange(
                    kids.shape[0], device=e.device).repeat_interleave(kids.shape[1])
                w_attn = transformation_weights(e, mid[:, parent])
            else:
                w_attn = transformation_weights(x, mid)
            return _Terms(cast(Heads, rec.heads), transformation_weights(mid, out),
                          w_attn, x.norm(dim=-1), merge, shares)
        w_ffn = transformation_weights(mid, rec.ffn_out.detach().to(dt))  # Eq. 16
        if p.inner_norm is None:
            wo, scale = p.proj_weight.detach().to(dt), None
            if p.post_norm1 is not None:  # Ẽ^h through the branch's post-norm, linearised
                # the branch output from the forward's heads (no attention recomputed)
                wo, scale = _post_norm_path(p, wo, u, cast(Heads, rec.heads))
            w = head_weights(e, u, p.v_weight.detach().to(dt), wo, p.num_heads,
                             scale=scale)  # [B, H, N]
        elif p.post_norm1 is not None:
            raise TypeError("TokenTM has no rule for a block with both an inner attention "
                            "norm and a post-norm on its branch")
        else:  # N_in before W_O (EVA-02), see head_weights_inner_norm
            w = head_weights_inner_norm(
                x, u, cast(Heads, rec.heads).probs().detach().to(dt), p.v_weight.detach().to(dt),
                None if p.v_bias is None else p.v_bias.detach().to(dt),
                p.proj_weight.detach().to(dt), p.inner_norm, p.num_heads)
        return _Terms(cast(Heads, rec.heads), w_ffn, w, x.norm(dim=-1), merge, shares)

    def _readout(self, tr: Trace, pool_grad: Tensor | None, dt: torch.dtype, target: Tensor,
                 last_out: Tensor | None = None) -> Tensor:
        """The row ``r`` that starts the propagation, [B, N]. An attention-pool head
        (``global_pool='map'``; our choice, its query is not a token so there is no
        residual path) is one more attention layer without identity:
        ``u = mean_h[ReLU(∇A_p^h) ⊙ (A_p^h W_p^h)][0, :]`` with ``W_p^h`` from
        ``(E, Ẽ^h) = (x̂, x̂ W_v^h W_p^h)``, ``x̂`` the normed last state ``last_out``
        (default: the trace's last record)."""
        if pool_grad is None or self.variant == "residual":
            return readout_rows(tr, pool_grad, dtype=dt, target=target)
        head = self.adapter.head
        pool = cast(PoolParts, head.attn_pool)  # pool_grad comes from an attention pool
        xh = (tr.blocks[-1].out if last_out is None else last_out).detach().to(dt)
        if head.norm is not None:
            xh = Ops().norm(xh, head.norm)
        w = head_weights(xh, xh, pool.v_weight.detach().to(dt),
                         pool.proj_weight.detach().to(dt), pool.num_heads)  # [B, H, N]
        rh = (pool_grad.to(dt).relu() * cast(Tensor, tr.pool_attn).detach().to(dt))[:, :, 0]
        return (rh * w).mean(1)

    def _maps(self, inputs: Tensor, target: Tensor | None, layers: Sequence[int],
              score: str | None) -> Tensor:
        """``r_l diag(L(x_l,i))`` for ``l`` in ``layers`` (Eq. 18-20 started at block
        ``l``), [len(layers), B, N], from one streamed forward and one backward.

        The forward uses the fused attention (no ``[B, H, N, N]`` kept for the
        backward) and keeps per block only its weights and its heads; ``A_l`` and
        ``∇A_l`` are recomputed one block at a time in the propagation."""
        if score is None:  # the target is in force here (ViTFront, the combinators)
            score = default_score(self.variant, self.adapter.probability)
        L = self.adapter.num_blocks
        first = min(layers)
        terms: dict[int, _Terms] = {}
        last: list[Tensor] = []

        def keep(l: int, rec: BlockRecord) -> None:
            if l == L - 1:
                last.append(rec.out)
            if l >= first:
                with torch.no_grad():
                    terms[l] = self._block_terms(rec, l)

        tr = self.adapter.trace(inputs, grad=True, attention="fused", on_block=keep)
        t = resolve_target(target, tr.require_logits())
        # ∇o_l of every needed block (and ∇A_p of an attention-pool head), one backward
        scores = target_scores(tr.require_logits(), t, score, self.adapter.probability)
        grads, pool_grad = gradients_with_pool(tr, scores,
                                               [terms[l].heads.o for l in range(first, L)])
        with torch.no_grad():
            dt = accumulation_dtype(tr.x0)
            r = self._readout(tr, pool_grad, dt, t, last[0])
            rows = {}
            st = self.adapter.stages
            for l in reversed(range(first, L)):
                tm = terms.pop(l)
                r = st.unmerge(r, l, tm.merge)  # Swin: a merge's children by their lengths
                r = self._block_row(r, tm, grads.pop(), dt, l)
                rows[l] = r * tm.x_norm  # C_0 = diag(L(x_l,i)) at the start block, Eq. 18
            return torch.stack([st.carry(rows[l], l, split=True) for l in layers])

    def _block_row(self, r: Tensor, terms: _Terms, grad_o: Tensor, dt: torch.dtype,
                   l: int = 0) -> Tensor:
        """The running row times block ``l``'s factor, ``r^T U_ffn,l U_attn,l`` [B, N]
        (Eq. 14-17 read from the row; ``l`` names the block for a windowed block's
        form, whose matrices are per window)."""
        h = terms.heads
        a, g = h.probs().to(dt), h.probs_grad(grad_o).to(dt)  # A_l, ∇A_l [B, H, N, N]
        st = self.adapter.stages
        r = r * (1 + terms.w_ffn)  # r^T U_ffn, Eq. 17
        # the identity of U_attn is the residual's token mixing: I, or a query pooling's
        # child shares (Hiera)
        res = st.residual(r, l, terms.shares)
        if self.variant == "paper":
            # r^T U_attn = r + mean_h (r^T (ReLU(∇A^h) ⊙ A^h)) ⊙ W^h   (Eq. 14-15)
            rh = st.token_mix(r, g.relu_().mul_(a), l)  # [B, H, N]
            return res + (rh * terms.w_attn).mean(1)
        # (Ā W) ⊙ R̄ = (Ā ⊙ R̄) W: column j scaled by W_j
        m = a.mean(1) * g.relu_().mean(1)
        return res + st.token_mix(r, m, l) * terms.w_attn

    @plus_doc("tokentm")
    # takes this method's own options, not any keyword (PLUSFastPath.plus_maps)
    def plus_maps(self, inputs: Tensor, target: Tensor | None, layers: Sequence[int], *,  # type: ignore[override]
                  aggregate: str = "subnetwork", score: str | None = None) -> Tensor:
        r"""PLUS / SkipPLUS fast path (:mod:`captum_vit.combinators`): TokenTM of every
        sub-network :math:`f_l`, ``l`` in ``layers``, from one forward and one backward,
        [len(layers), B, N].

        With :math:`r_L` the readout row and :math:`r_l = r_{l+1} U_{ffn,l} U_{attn,l}`,
        the map of :math:`f_l` is :math:`r_l\, \mathrm{diag}(L(x_{l,i}))`: Eq. 18 at the
        sub-network's input :math:`x_l` (the sub-network's gradients are the model's).
        Only ``aggregate="subnetwork"``: TokenTM's block factor
        :math:`U_{ffn} U_{attn}` has no identity-free per-block form for
        ``aggregate="layer"`` to sum (:mod:`captum_vit.combinators`).

        Args:
            {plus_args}
            aggregate (str): ``"subnetwork"``.
            score (str, optional): as in :meth:`attribute` (``None``: :func:`default_score`).

        {plus_returns}
        """
        if aggregate != "subnetwork":
            raise ValueError(f"aggregate must be 'subnetwork' for TokenTM, got {aggregate!r}: "
                             "its block factor U_ffn U_attn has no identity-free per-block "
                             "matrix (see captum_vit.combinators)")
        if score is not None:
            check_choice("score", score, SCORES)
        return self._maps(inputs, target, layers, score)
