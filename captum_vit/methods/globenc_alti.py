"""GlobEnc (Modarressi et al., NAACL 2022) and ALTI (Ferrando et al., EMNLP 2022) on
Vision Transformers, as compared in SkipPLUS (Mehri et al. 2024, §5.1, App. E.2).

Both read one "reset" decomposition per block ``l``: the block input ``x_l`` is written as
one source per token (source ``j`` is ``x_l[j]`` at token ``j``), the DecompX rules
(Modarressi et al., ACL 2023; :class:`~captum_vit.methods.decompx.DecompositionOps`) carry
the sources through block ``l`` alone, and the bias source is dropped. This gives vectors
``v_{i←j}`` [D]: what source token ``j`` of ``x_l`` contributes to token ``i`` of the
block's output. Then

    GlobEnc:  T_l[i, j] = ‖v_{i←j}‖₂
    ALTI:     T_l[i, j] = max(0, ‖o_i‖₁ − ‖o_i − v_{i←j}‖₁),   o_i = x_{l+1}[i] (real output)

each row-normalised (``T_l[i, :] / Σ_j T_l[i, j]``), and aggregated by rollout without
identity: ``R = T′_{L−1} ··· T′_0`` with ``T′_l = (1 − r) T_l + r I`` (``r`` =
``residual_strength``, 0 by default), map ``m = w R`` (``w`` the readout weights).

The MLP branch (``mlp=``):

- ``"ln2"`` (default; the SkipPLUS authors' ``compute_globalti.py``, which decomposes
  with ``mlp_decompose_p=False``): the MLP is not decomposed. Its modules compute their
  real outputs while the decomposition passes through them unchanged, so the branch's
  decomposition is that of its input ``LN2(x_mid)`` (frozen statistics, ``β`` to the
  dropped bias source), times LayerScale ``ls2`` where the model has one (the authors'
  LayerScale is decomposed):
  ``v_{i←j} = x_mid,i←j + ls2 ⊙ LN2^lin(x_mid)_{i←j}``. This is the pre-LN analogue of
  GlobEnc's own treatment of BERT, which skips the FFN and keeps the second residual and
  LayerNorm. A block without ``LN2`` (Swin V2's residual post-norm blocks) carries the
  decomposition of the MLP's input ``x_mid`` itself (the MLP and its post-norm compute
  their real outputs): ``v_{i←j} = 2 x_mid,i←j`` with
  ``x_mid,i←j = δ_ij x_j + LN_p^lin(Σ_h A^h_ij x_j W_V^h W_O^h)`` (the post-norm with the
  frozen statistics of the real branch output), in closed form in :func:`reset_scores`.
- ``"decompx"``: the exact DecompX decomposition of the whole block
  (:mod:`captum_vit.methods.decompx`, GELU zero-origin slope, gated units with their real
  gate). Then ``Σ_j v_{i←j} + (bias part) = x_{l+1}[i]`` exactly.

Verified against the SkipPLUS authors' code (read for its mathematics only):
NightMachinery/pytorch-image-models-libragrad-v1 (Apache-2.0), ``timm/night/
decomposition.py``: ``MLPDecomposed`` with ``mlp_decompose_p=False`` runs ``fc1``, the
activation and ``fc2`` with ``decompose_p=False``, i.e. real features and unchanged
``attributions_v``; ``residual_decomposed`` then adds them to the ``x_mid`` sources;
``attribute_patches_aggregate(mode="reset")`` starts every block with the identity
decomposition and a zero bias ("error") source. NightMachinery/decompv-libragrad-v1 (no
licence file), ``decompv/x/ds/compute_globalti.py`` (``attributions_aggregation_strategy=
"reset"``, ``mlp_decompose_p=False``, residual strengths 0 and 0.5) and
``transform_globalti_attributions`` in ``decompv/x/ds/utils.py``: bias source removed,
GlobEnc = L2 norm, ALTI = ``relu(‖o‖₁ − ‖o − v‖₁)`` with ``o`` the block's real output,
rows of ALTI divided by their sum; rollout ``(1 − r) T + r I``, later blocks on the left.
Two differences from that code, both our choice: its GlobEnc matrices are not
row-normalised before the rollout (nor are they in GlobEnc's own demo,
mohsenfayyaz/GlobEnc), and its rollout has an extra ``scale`` factor (1 by default).

Query pooling (Hiera): a pooling block's reset decomposition goes
through the DecompX rules (each channel of a pooled token takes its maximal child's
decomposition), so ``T_l`` has the ``N/4`` pooled tokens as rows and the ``N`` input
tokens as columns, ``[B, n_W, M/4, M]`` per mask unit (:func:`window_scores`); the
rollout's residual term ``r I`` becomes ``r R_l``, ``R_l`` the residual's pooling with
each child weighted by its share of the channels where it is the maximum
(:meth:`~captum_vit.adapters.Stages.residual`).

Windowed models (Swin, SAM's image encoder; :mod:`captum_vit.adapters.windows`): a token's
block output has sources in its own window only, so ``T_l`` is block-diagonal in window
order and is computed per window, ``[B, n_W, M, M]`` (:func:`reset_scores`,
:func:`window_scores`), never as an ``N × N`` matrix. A padded window slot (zero after
LN1, as in the models) is a key of its window but no source: its value is the value
projection's bias, whose share goes to the dropped bias source; its row is dropped. The
decomposition ends on the block's own output before the patch merge that ends a Swin
stage; the rollout then goes through the merge with equal weights (each merged token's
weight shared by its real children, ¼), the merge rule of the gradient-free methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from captum_vit._base import (
    accumulation_dtype,
    check_choice,
    check_images,
    check_scalar,
    readout_rows,
    resolve_target,
)
from captum_vit.adapters import BlockParts, BlockRecord, NormParts, Ops, Trace, ViTAdapter
from captum_vit.methods._engines import PLUSFastPath
from captum_vit.methods._front import PlainAttribution
from captum_vit.methods.decompx import (
    DEFAULT_MAX_MEMORY,
    Decomposed,
    DecompositionOps,
    source_parts,
    sources_per_chunk,
)
from captum_vit.methods.table import register_method

MLP_CHOICES = ("ln2", "decompx")
MEASURES = ("globenc", "alti")
AGGREGATES = ("subnetwork", "layer")
CACHE_BYTES = 2 << 20
"""Size of ALTI's per-chunk work tensors (about a core's share of a CPU cache)."""


class _Undecomposed(Decomposed):
    """A value inside the MLP under ``mlp="ln2"``: its ``real`` is the MLP's real
    activation, its ``parts`` are still those of ``LN2(x_mid)``."""


class _ResetOps(DecompositionOps):
    """The DecompX rules, keeping the block's output before its patch merge (Swin's last
    block of a stage): the reset decomposition is that of the block; the merge is a
    separate token mixing step with the equal weights of the gradient-free methods."""

    def __init__(self) -> None:
        super().__init__()
        self.before_merge: Decomposed | None = None

    def gather(self, x: Decomposed, merge: Any) -> Decomposed:
        self.before_merge = x
        return super().gather(x, merge)


class _LN2Ops(_ResetOps):
    """The DecompX rules (:mod:`captum_vit.methods.decompx`), except that the MLP of the
    block is not decomposed (the authors' ``mlp_decompose_p=False``): from the output of
    ``norm2`` on, every MLP primitive computes its real output and leaves the decomposition
    as it found it. The branch's LayerScale and the residual add are decomposed as usual."""

    def __init__(self, norm2: NormParts | None, mlp_in: Tensor | None = None) -> None:
        super().__init__()
        self.norm2 = norm2
        self.mlp_in = mlp_in
        self.saw_norm2 = False

    def norm(self, x: Decomposed, p: NormParts) -> Decomposed:
        if isinstance(x, _Undecomposed):  # a norm inside the MLP (timm's scale_mlp)
            return _Undecomposed(Ops.norm(self, x.real, p), x.parts, x.has_bias)
        y = super().norm(x, p)
        if p is not self.norm2:
            return y
        self.saw_norm2 = True
        return _Undecomposed(y.real, y.parts, y.has_bias)

    def linear(self, x: Decomposed, weight: Tensor, bias: Tensor | None) -> Decomposed:
        if isinstance(x, _Undecomposed):
            return _Undecomposed(F.linear(x.real, weight, bias), x.parts, x.has_bias)
        if self.norm2 is None and weight is self.mlp_in:  # no LN2: the MLP's input
            self.saw_norm2 = True
            return _Undecomposed(F.linear(x.real, weight, bias), x.parts, x.has_bias)
        return super().linear(x, weight, bias)

    def act(self, z: Decomposed, act: Any) -> Decomposed:
        if isinstance(z, _Undecomposed):
            return _Undecomposed(act(z.real), z.parts, z.has_bias)
        return super().act(z, act)

    def gated(self, g: Decomposed, z: Decomposed, act: Any) -> Decomposed:
        if isinstance(z, _Undecomposed):
            return _Undecomposed(act(g.real) * z.real, z.parts, z.has_bias)
        return super().gated(g, z, act)


@torch.no_grad()
def decompose_block(adapter: ViTAdapter, x: Tensor, layer: int, *, mlp: str = "ln2",
                    sources: range | None = None, bias: bool = False) -> Decomposed:
    r"""The reset decomposition of block ``layer`` (see the module docstring).

    Source ``j`` of the block input ``x`` starts as ``x[:, j]`` at token ``j`` and zero
    elsewhere; the DecompX rules (:mod:`captum_vit.methods.decompx`) carry the sources
    through this one block.

    Args:
        adapter (ViTAdapter): the model's adapter.
        x (Tensor): the real block input ``x_l`` [B, N, D].
        layer (int): the block ``l``.
        mlp (str, optional): ``"ln2"`` (default: the MLP branch carries the decomposition
            of ``LN2(x_mid)``, see the module docstring) or ``"decompx"`` (exact).
        sources (range, optional): the source tokens to carry (a chunk, ``step`` 1);
            ``None`` = all ``N``.
        bias (bool, optional): also carry the bias source, as the last component (the
            reset decomposition drops it; it is here for completeness checks).
            Default False.

    Returns:
        Decomposed: ``real`` the block's real output ``x_{l+1}`` [B, N, D] (before the
        block's patch merge, if it has one: Swin's last block of a stage); ``parts``
        [B, S, N, D] with ``parts[:, s, i] = v_{i←j}`` for the ``s``-th source ``j``
        (then the bias part with ``bias=True``), in ``accumulation_dtype(x)``.
        With ``mlp="decompx"`` and ``bias=True`` the parts of all ``N`` sources and the
        bias part sum to ``real``; with ``"ln2"`` they sum to
        ``x_mid + ls2 ⊙ LN2(x_mid)``.

    Examples::

        >>> from captum_vit.adapters import adapt
        >>> adapter = adapt(model)
        >>> x0 = adapter.embed(images)
        >>> h = decompose_block(adapter, x0, 0, mlp="decompx", bias=True)
        >>> torch.allclose(h.parts.sum(1), h.real)
        True
    """
    check_choice("mlp", mlp, MLP_CHOICES)
    n = x.shape[1]
    sources = range(n) if sources is None else sources
    if sources.step != 1 or not 0 <= sources.start <= sources.stop <= n:
        raise ValueError(f"sources must be a range(j0, j1) with 0 <= j0 <= j1 <= {n}, "
                         f"got {sources}")
    dt = accumulation_dtype(x)
    parts = source_parts(x, sources.start, sources.stop, dt)
    if bias:
        parts = torch.cat([parts, parts.new_zeros((x.shape[0], 1, *parts.shape[2:]))], 1)
    return _reset_block(adapter, Decomposed(x, parts, has_bias=bias), layer, mlp)


def _reset_block(adapter: ViTAdapter, h: Decomposed, layer: int, mlp: str) -> Decomposed:
    """Block ``layer`` on the decomposed input ``h`` under ``mlp``'s rules, stopped
    before the block's patch merge (if any)."""
    p = adapter.blocks[layer]
    ops = _ResetOps() if mlp == "decompx" else _LN2Ops(p.norm2, p.fc1_weight)
    out = adapter.block(h, layer, ops)
    if isinstance(ops, _LN2Ops) and not ops.saw_norm2:  # pragma: no cover - every block has norm2
        raise TypeError(f"mlp='ln2' needs the block's LN2 (norm2); block {layer} of this "
                        f"{type(adapter.model).__name__} never applied it: use "
                        "mlp='decompx'")
    if ops.before_merge is not None:
        out = ops.before_merge
    return Decomposed(out.real, out.parts, out.has_bias)


def token_scores(h: Decomposed, measure: str) -> Tensor:
    r"""Unnormalised ``T[i, j]`` [B, N, S] of one block from its reset decomposition ``h``
    (parts [B, S, N, D], no bias part): GlobEnc :math:`\|v_{i←j}\|_2`, ALTI
    :math:`\max(0, \|o_i\|_1 - \|o_i - v_{i←j}\|_1)` with ``o = h.real`` (the real
    block output)."""
    check_choice("measure", measure, MEASURES)
    v = h.parts
    if measure == "globenc":
        t = torch.linalg.vector_norm(v, ord=2, dim=-1)
    else:
        o = h.real.to(v.dtype)
        dist = torch.linalg.vector_norm(o[:, None] - v, ord=1, dim=-1)
        t = (torch.linalg.vector_norm(o, ord=1, dim=-1)[:, None] - dist).clamp_min(0)
    return t.transpose(1, 2)


def _centred_scaled(x: Tensor, p: NormParts) -> Tensor:
    """``γ ⊙ (x − mean x) / sqrt(var x + eps)`` per token: LayerNorm without its bias (the
    DecompX rule D1 of :mod:`captum_vit.methods.decompx` applied to a source that is the
    whole token)."""
    y = (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, unbiased=False, keepdim=True)
                                                     + p.eps)
    return y if p.weight is None else y * p.weight.to(y.dtype)


@torch.no_grad()
def reset_scores(adapter: ViTAdapter, rec: BlockRecord, layer: int, measure: str, *,
                 max_memory: int | None = DEFAULT_MAX_MEMORY) -> Tensor:
    r"""Unnormalised ``T_l[i, j]`` [B, N, N] of block ``layer`` under ``mlp="ln2"``, without
    carrying ``N`` decomposed copies of the sequence through the block's linear layers.

    Equal (to rounding) to :func:`token_scores` of :func:`decompose_block` with
    ``mlp="ln2"``, and far cheaper: a reset source ``j`` lives at token ``j`` alone until
    the attention mixes it, so everything before the mix is one ``[B, N, D]`` pass. With
    ``ũ_j = γ₁ ⊙ (x_j − μ_j)/σ_j`` (LN1 without ``β₁``, whose share goes to the dropped
    bias source) and ``Z^h_j = ũ_j W_V^h W_O^{h⊤}`` (no value or projection bias),

    .. math::

        x_{mid,i←j} = δ_{ij} x_j + ls_1 ⊙ \sum_h A^h_{ij} Z^h_j, \qquad
        v_{i←j} = x_{mid,i←j} + ls_2 ⊙ γ_2 ⊙ C(x_{mid,i←j}) / σ_{2,i},

    ``C`` the centring over channels and ``σ_{2,i}`` the LN2 statistic of the real
    ``x_mid,i``. With EVA-02's inner norm ``N_in`` before ``W_O``, its centring and
    ``γ_in`` fold into ``Z^h_j`` and its frozen ``1/σ_{in,i}`` scales row ``i``. GlobEnc's
    norms come from per-source ``H × H`` Gram matrices of the ``Z^h_j`` (no ``[N, N, D]``
    tensor at all); ALTI's L1 norms need the vectors and hold those of a chunk of output
    rows, ``[B, rows, N, D]``, at a time.

    Args:
        adapter (ViTAdapter): the model's adapter.
        rec (BlockRecord): the block's record from :meth:`ViTAdapter.trace` (its input
            ``x``, ``u = LN1(x)``, probabilities ``attn``, ``mid`` and ``out``).
        layer (int): the block ``l``.
        measure (str): ``"globenc"`` or ``"alti"``.
        max_memory (int or None, optional): bytes of ``[B, rows, N, D]`` work tensors
            (default 1 GiB); ``None`` = all rows at once.

    Returns:
        Tensor: ``T[b, i, j]`` [B, N, N] in ``accumulation_dtype(rec.x)``, not
        row-normalised. For a windowed block (:mod:`captum_vit.adapters.windows`) the
        same terms per window, ``[B, n_W, M, M]`` (the block-diagonal matrix in window
        order, as :func:`window_scores`): a padded slot is no source (its value is the
        projection's bias, whose share goes to the dropped bias source) and its row is
        zero; the block's output is read before its patch merge, if it has one.

    Examples::

        >>> rec = adapter.trace(images).blocks[0]
        >>> t = reset_scores(adapter, rec, 0, "globenc")
        >>> torch.allclose(t, token_scores(decompose_block(adapter, rec.x, 0), "globenc"))
        True
    """
    check_choice("measure", measure, MEASURES)
    p = adapter.blocks[layer]
    form = _closed_form(p)
    if form is None:
        raise ValueError(f"block {layer} has neither the pre-LN form nor Swin V2's post-norm "
                         "form that reset_scores writes out; use window_scores or "
                         "decompose_block, which carry the sources through the block's ops")
    dt = accumulation_dtype(rec.x)
    x = rec.x.detach().to(dt)
    attn = rec.require_attn().detach().to(dt)
    b, n, d = x.shape
    heads, hd = p.num_heads, p.head_dim
    k2 = torch.ones(d, dtype=dt, device=x.device)
    inv_in = None
    if form == "post":  # u = x; the branch's post-norm LN_p: γ_p C(·) / σ_p,i (frozen)
        v = F.linear(x, p.v_weight.to(dt)).reshape(b, n, heads, hd)
        z = torch.einsum("bnhe,dhe->bhnd", v, p.proj_weight.to(dt).reshape(d, heads, hd))
        if p.ls1 is not None:
            z = z * p.ls1.to(dt)
        post = cast(NormParts, p.post_norm1)
        z = z - z.mean(-1, keepdim=True)
        if post.weight is not None:
            z = z * post.weight.to(dt)
        real = p.branch_output(rec.u.detach()).to(dt)
        inv_in = torch.rsqrt(real.var(-1, unbiased=False) + post.eps)  # row i: 1/σ_p,i
        # no LN2: the MLP branch carries x_mid's decomposition, v = 2 x_mid (P_i = 2 I):
        # s = 0 below and the real output halved, the scores doubled at the end
        s2 = torch.zeros(b, n, dtype=dt, device=x.device)
    else:
        norm1, norm2 = cast(NormParts, p.norm1), cast(NormParts, p.norm2)
        v = F.linear(_centred_scaled(x, norm1), p.v_weight.to(dt)).reshape(b, n, heads, hd)
        path = p.value_path(dt)  # W_O with the inner norm's rule folded in (adapters.parts)
        wo = path.weight.reshape(d, heads, hd)  # [D, H, d]
        if path.centre is not None:  # (C(Σ_h A^h v^h) ⊙ γ_in) W_O, row i scaled by 1/σ_in,i
            z = torch.einsum("bnhe,dhe->bhnd", v, wo)
            z = z - (v.sum(-1) / (heads * hd)).transpose(1, 2)[..., None] * path.centre
            real_mix, _ = p.attention(rec.u.detach(), materialize=True)
            inv_in = path.inv_std(real_mix.to(dt))
        else:
            z = torch.einsum("bnhe,dhe->bhnd", v, wo)  # [B, H, N, D]
        if p.ls1 is not None:
            z = z * p.ls1.to(dt)
        s2 = torch.rsqrt(rec.mid.detach().to(dt).var(-1, unbiased=False) + norm2.eps)  # 1/σ_2
        if norm2.weight is not None:
            k2 = k2 * norm2.weight.to(dt)
        if p.ls2 is not None:
            k2 = k2 * p.ls2.to(dt)
    o = _block_output(rec, p.merge is not None or p.out_norm is not None).detach().to(dt)
    factor = 2.0 if form == "post" else 1.0
    o = o / factor
    win = p.window
    if win is not None:  # the B · n_W windows as short sequences (padded slots zero)
        nw, m = win.num_windows, win.area
        z = win.partition(z.transpose(1, 2).reshape(b, n, heads * d))
        z = z.reshape(b * nw, m, heads, d).transpose(1, 2)  # [B n_W, H, M, D]
        x, o = win.partition(x), win.partition(o)
        s2 = win.partition(s2[..., None])[..., 0]
        if inv_in is not None:
            inv_in = win.partition(inv_in[..., None])[..., 0]
        attn = attn.transpose(1, 2).reshape(b * nw, heads, m, m)
    if inv_in is not None:  # row i of the mix scaled by 1/σ_in,i: fold it into A
        attn = attn * inv_in[:, None, :, None]
    # v_{i←j} = x_mid,i←j ⊙ (1 + s_i k2) − mean(x_mid,i←j) s_i k2, and the mean of the
    # attention part is Σ_h A^h_ij mean(Z^h_j): no pass over [B, N, N, D] for it
    diag = x + torch.einsum("bhi,bhid->bid", attn.diagonal(dim1=-2, dim2=-1), z)
    v_diag = diag + (diag - diag.mean(-1, keepdim=True)) * (s2[..., None] * k2)  # [B, N, D]
    if measure == "globenc":
        t = _globenc_norms(z, attn, s2, k2)
        t_diag = torch.linalg.vector_norm(v_diag, ord=2, dim=-1)
    else:
        t = _alti_scores(z, attn, s2, k2, o, max_memory)
        t_diag = (torch.linalg.vector_norm(o, ord=1, dim=-1)
                  - torch.linalg.vector_norm(o - v_diag, ord=1, dim=-1)).clamp_min(0)
    t.diagonal(dim1=-2, dim2=-1).copy_(t_diag)
    if factor != 1.0:
        t = t * factor
    if win is None:
        return t
    real = win.index(t.device) >= 0  # [n_W, M]; a padded slot's row is no token's
    return t.reshape(b, win.num_windows, win.area, win.area) * real[:, :, None].to(dt)


def _closed_form(p: BlockParts) -> str | None:
    """Which block form :func:`reset_scores` writes out in closed form: ``"pre"`` (both
    pre-norms, no post-norm), ``"post"`` (Swin V2: no pre-norm, a post-norm on the
    attention branch, no inner norm), else ``None`` (also for a norm on the block's
    output; the reset decomposition then goes
    through the ops, :func:`window_scores` / :func:`decompose_block`)."""
    if p.out_norm is not None or p.pool is not None:
        # V-JEPA 2's encoder norm on the block's output; Hiera's query pooling (its
        # channel-wise maximum is the DecompX rule's, through the ops)
        return None
    if p.norm1 is not None and p.norm2 is not None and p.post_norm1 is None \
            and p.post_norm2 is None:
        # an RMSNorm (no centring) goes through the ops' rule
        return None if p.norm1.rms or p.norm2.rms else "pre"
    if p.norm1 is None and p.norm2 is None and p.post_norm1 is not None \
            and p.inner_norm is None:
        return "post"
    return None


def _block_output(rec: BlockRecord, merged: bool) -> Tensor:
    """The real output of a block from its record: ``rec.out``, or ``mid + ffn_out`` before
    the patch merge of a block that ends a stage (``merged``; the merge is a separate
    token mixing step of the rollout)."""
    return rec.mid + rec.ffn_out if merged else rec.out


@torch.no_grad()
def window_scores(adapter: ViTAdapter, x: Tensor, layer: int, measure: str, *,
                  mlp: str = "ln2", max_memory: int | None = DEFAULT_MAX_MEMORY) -> Tensor:
    r"""Unnormalised ``T_l`` of a windowed block in window form, ``[B, n_W, M, M]``
    (:class:`~captum_vit.adapters.windows.Windows`), by carrying reset sources through
    the block (:func:`decompose_block`'s rules) without any ``N × N`` tensor.

    A token's output has sources in its own window only, so one carried component can
    hold the sources at the same slot ``m`` of every window: its part at token ``i`` is
    :math:`v_{i←j}` for the token ``j`` at slot ``m`` of ``i``'s window. ``M``
    components (the window area) instead of ``N`` give the whole block-diagonal matrix.
    A padded slot holds no token: it is no source (its key's value is the projection
    bias, whose share goes to the dropped bias source) and its row is zero.

    Args:
        adapter (ViTAdapter): the model's adapter.
        x (Tensor): the real block input ``x_l`` [B, N, D].
        layer (int): a windowed block ``l``.
        measure (str): ``"globenc"`` or ``"alti"``.
        mlp (str, optional): ``"ln2"`` (default) or ``"decompx"``, as in
            :func:`decompose_block`.
        max_memory (int or None, optional): bytes of decomposed activations per pass
            (default 1 GiB); ``None`` = all slots in one pass.

    Returns:
        Tensor: ``T[b, w, a, c]`` [B, n_W, M, M] ([B, n_W, M/4, M] for a block with query
        pooling, the rows its pooled tokens): what the token at slot ``c`` of window
        ``w`` gives the token at slot ``a``, in ``accumulation_dtype(x)``.

    Raises:
        ValueError: block ``layer`` does not attend within windows.

    Examples::

        >>> from captum_vit.adapters import adapt
        >>> adapter = adapt(swin)
        >>> x0 = adapter.embed(images)
        >>> window_scores(adapter, x0, 0, "alti").shape  # [B, n_W, M, M]
    """
    check_choice("measure", measure, MEASURES)
    check_choice("mlp", mlp, MLP_CHOICES)
    win = adapter.stages.window(layer)
    if win is None:
        raise ValueError(f"block {layer} attends globally, not within windows: use "
                         "decompose_block and token_scores")
    idx = win.index(x.device)  # [n_W, M]
    real = idx >= 0
    pool = adapter.blocks[layer].pool
    # query pooling (Hiera): the rows are the pooled tokens of each window (M/4 slots)
    out = win if pool is None else pool.query_window(win)
    out_idx = out.index(x.device)
    b, n, d = x.shape
    dt = accumulation_dtype(x)
    chunk = sources_per_chunk(adapter, x, max_memory)
    t = x.new_zeros((b, win.num_windows, out.area, win.area), dtype=dt)
    rows, real_rows = out_idx.clamp_min(0), (out_idx >= 0)[..., None].to(dt)
    for m0 in range(0, win.area, chunk):
        m1 = min(m0 + chunk, win.area)
        parts = x.new_zeros((b, m1 - m0, n, d), dtype=dt)
        for s, m in enumerate(range(m0, m1)):
            tok = idx[:, m][real[:, m]]
            parts[:, s, tok] = x[:, tok].to(dt)
        h = _reset_block(adapter, Decomposed(x, parts, has_bias=False), layer, mlp)
        scores = token_scores(h, measure)  # [B, N, slots]
        t[..., m0:m1] = scores[:, rows] * real_rows
    return t


def _globenc_norms(z: Tensor, attn: Tensor, s2: Tensor, k2: Tensor) -> Tensor:
    r"""``‖v_{i←j}‖₂`` [B, N, N] of the off-diagonal pairs (``j ≠ i``, whose vectors are
    ``P_i Σ_h A^h_ij Z^h_j`` with ``P_i = I + s_i diag(k2) C``) from per-source head Gram
    matrices, never forming the ``[B, N, N, D]`` vectors: :math:`\|P_i m\|^2 = m^	op
    (I + s_i Q_1 + s_i^2 Q_2) m`, ``Q_1 = KC + CK``, ``Q_2 = CK^2C``, ``K = diag(k2)``,
    so ``‖v_{i←j}‖² = Σ_q s_i^q Σ_{h,g} A^h_ij A^g_ij G_q[j, h, g]``."""
    zc = z - z.mean(-1, keepdim=True)
    zk = z * k2
    e = torch.einsum("bhjd,bgjd->bjhg", zk, zc)
    grams = (torch.einsum("bhjd,bgjd->bjhg", z, z), e + e.transpose(-1, -2),
             torch.einsum("bhjd,bgjd->bjhg", zc * k2, zc * k2))
    sq: Tensor | int = 0
    for q, g in enumerate(grams):  # Σ_{h,g} A^h_ij A^g_ij G_q[j, h, g], per q
        y = (attn * torch.einsum("bgij,bjhg->bhij", attn, g)).sum(1)
        sq = sq + y * s2[:, :, None] ** q
    return cast(Tensor, sq).clamp_min(0).sqrt()  # three grams: a tensor


def _alti_scores(z: Tensor, attn: Tensor, s2: Tensor, k2: Tensor, o: Tensor,
                 max_memory: int | None) -> Tensor:
    """``max(0, ‖o_i‖₁ − ‖o_i − v_{i←j}‖₁)`` [B, N, N] of the off-diagonal pairs. The L1
    norm needs the vectors: they are formed one image and a few output rows at a time,
    ``[rows, N, D]`` of about :data:`CACHE_BYTES` (memory-bound work runs about 3× faster
    from cache than over the whole ``[B, N, N, D]``), or fewer under ``max_memory``."""
    b, _, n, d = z.shape
    zmean = z.mean(-1)  # [B, H, N]
    per_row = n * d * (torch.finfo(z.dtype).bits // 8)
    budget = CACHE_BYTES if max_memory is None else min(CACHE_BYTES, max_memory // 3)
    rows = max(1, min(n, budget // per_row))
    o_l1 = torch.linalg.vector_norm(o, ord=1, dim=-1)
    t = z.new_zeros((b, n, n))
    for bi in range(b):
        for i0 in range(0, n, rows):
            i1 = min(i0 + rows, n)
            a, s = attn[bi, :, i0:i1], s2[bi, i0:i1, None]  # [H, r, N], [r, 1]
            mu = torch.einsum("hij,hj->ij", a, zmean[bi])  # [r, N]
            # o_i − v_{i←j} = o_i + μ_ij s_i k2 − (Σ_h A^h_ij Z^h_j) ⊙ (1 + s_i k2)
            base = o[bi, i0:i1, None] + (mu * s)[..., None] * k2
            mix = torch.einsum("hij,hjd->ijd", a, z[bi])
            diff = torch.addcmul(base, mix, 1 + s[..., None] * k2, value=-1)
            t[bi, i0:i1] = (o_l1[bi, i0:i1, None]
                            - torch.linalg.vector_norm(diff, ord=1, dim=-1)).clamp_min(0)
    return t


class _GlobALTI(PLUSFastPath, PlainAttribution):
    """The shared implementation of :class:`GlobEnc` and :class:`ALTI`."""

    reads_window_slots = True  # per-window products/decompositions: one token per slot
    # query pooling (Hiera): each pooling block's reset decomposition through the DecompX
    # rules (window_scores), R the residual's child shares in T′ (Stages.residual)
    pools_queries = True

    class_agnostic = True

    measure: str = ""
    plus_aggregates = AGGREGATES

    def __init__(self, model: nn.Module, mlp: str = "ln2", residual_strength: float = 0.0,
                 max_memory: int | None = DEFAULT_MAX_MEMORY, *, fast: bool = True) -> None:
        super().__init__(model)
        self.fast = bool(fast)
        self.mlp = check_choice("mlp", mlp, MLP_CHOICES)
        self.residual_strength = float(check_scalar(residual_strength, "residual_strength",
                                                    float, min_val=0.0, max_val=1.0))
        if max_memory is not None:  # bytes; None = no chunking
            max_memory = check_scalar(max_memory, "max_memory", int, min_val=1)
        self.max_memory = max_memory

    target_doc = r"""target (int, list, Tensor, optional): validated but unused: the map is
        class-agnostic (except the readout weights of a DINOv2 ``[CLS ; mean]``
        classifier with ``alpha="logit"``, which depend on the class). ``None``
        (default) means the predicted class (Captum's ``None`` means a scalar
        output)."""
    returns_doc = r"""the rolled-out map ``w T′_{L−1} ··· T′_0`` (non-negative, summing to
        1 over all tokens when ``w`` does, prefix tokens included before they are
        dropped) in the requested ``output`` format."""
    examples_doc = r"""
        >>> from captum_vit.methods.globenc_alti import GlobEnc
        >>> attr = GlobEnc(model).attribute(images, output="tokens")  # [B, P]
    """

    def block_matrices(self, inputs: Tensor) -> Tensor | list[Tensor]:
        r"""The row-normalised per-block matrices ``T_l`` (see the module docstring).

        ``T_l[b, i, j]`` is how much source token ``j`` of the block input ``x_l``
        contributes to token ``i`` of the block output; every row is non-negative and
        sums to 1 (a row whose scores are all 0, possible for ALTI, stays 0). PLUS and
        SkipPLUS sum the readout rows ``w T_l`` of these (App. E.2); the rollout of
        :meth:`attribute` multiplies ``(1 − r) T_l + r I``.

        Args:
            inputs (Tensor): images [B, C, H, W] (or a 1-tuple holding them).

        Returns:
            Tensor: [L, B, N, N] (prefix tokens first), in ``accumulation_dtype``. On a
            windowed model (Swin, SAM's encoder) a list with one tensor per block in
            window form, [B, n_W, M, M] (:func:`window_scores`; the rows of padded slots
            are zero), each block's ``T_l`` on its own grid, before its patch merge.

        Examples::

            >>> from captum_vit.methods.globenc_alti import GlobEnc
            >>> T = GlobEnc(model).block_matrices(images)  # [L, B, N, N]
            >>> torch.allclose(T.sum(-1), torch.ones(()))
            True
        """
        images, _ = check_images(inputs, video=self.adapter.video)
        self.adapter.check_inputs(images)
        self.adapter.self_check(images)
        mats = self._matrices(self.adapter.trace(images))
        if any(p.window is not None for p in self.adapter.blocks):
            return mats
        return torch.stack(mats)

    def _matrices(self, tr: Trace, start: int = 0) -> list[Tensor]:
        """Row-normalised ``T_l`` of blocks ``start..L-1``: [B, N, N] each, or
        [B, n_W, M, M] (window form) for a windowed block."""
        out = []
        for l, rec in enumerate(tr.blocks[start:], start=tr.start + start):
            win = self.adapter.stages.window(l)
            # the one-pass scores read the block's output as mid + ffn; a block with an
            # output norm (V-JEPA 2's encoder norm) is decomposed through it instead
            if self.mlp == "ln2" and self.fast and _closed_form(self.adapter.blocks[l]):
                t = reset_scores(self.adapter, rec, l, self.measure, max_memory=self.max_memory)
            elif win is not None:
                t = window_scores(self.adapter, rec.x, l, self.measure, mlp=self.mlp,
                                  max_memory=self.max_memory)
            else:
                x = rec.x
                b, n, _ = x.shape
                chunk = sources_per_chunk(self.adapter, x, self.max_memory)
                t = x.new_zeros((b, n, n), dtype=accumulation_dtype(x))
                for j0 in range(0, n, chunk):
                    j1 = min(j0 + chunk, n)
                    h = decompose_block(self.adapter, x, l, mlp=self.mlp,
                                        sources=range(j0, j1))
                    t[:, :, j0:j1] = token_scores(h, self.measure)
            out.append(t / t.sum(-1, keepdim=True).clamp_min(torch.finfo(t.dtype).tiny))
        return out

    # takes this method's own options, not any keyword (PLUSFastPath.plus_maps)
    def plus_maps(self, inputs: Tensor, target: Tensor | None, layers: Sequence[int], *,  # type: ignore[override]
                  aggregate: str = "subnetwork") -> Tensor:
        r"""PLUS / SkipPLUS fast path (:mod:`captum_vit.combinators`): the map of every sub-network
        :math:`f_l`, ``l`` in ``layers``, from one trace, [len(layers), B, N].

        ``aggregate="subnetwork"``: :math:`v_L = w`, :math:`v_k = v_{k+1} T'_k`, the map
        of :math:`f_l` is :math:`v_l` (the rollout started at block ``l``; the per-block
        matrices do not depend on where it starts). ``aggregate="layer"``: the layer rows
        :math:`w T_l` of the SkipPLUS authors' code (App. E.2). Only blocks
        ``≥ min(layers)`` are decomposed.

        Args:
            inputs (Tensor): validated images [B, C, H, W].
            target (Tensor or None): class per image; ``None`` = predicted (used only by
                a class-dependent readout).
            layers (sequence of int): sorted start blocks.
            aggregate (str): ``"subnetwork"`` (default) or ``"layer"``.

        Returns:
            Tensor: token maps [len(layers), B, N].

        Examples::

            >>> from captum_vit import SkipPLUS
            >>> attr = SkipPLUS(model, "globenc").attribute(images, output="tokens")
        """
        check_choice("aggregate", aggregate, AGGREGATES)
        tr = self.adapter.trace(inputs)
        first = min(layers)
        mats = self._matrices(tr, first)
        w = readout_rows(tr, dtype=mats[0].dtype,
                         target=resolve_target(target, tr.require_logits()))
        st = self.adapter.stages
        if aggregate == "layer":  # stages: w through the merges above block l (¼ weights)
            return torch.stack([st.carry(st.token_mix(st.carry_down(w, l), mats[l - first], l),
                                         l, split=True) for l in layers])
        rs, rows, v = self.residual_strength, {}, w
        for k in reversed(range(first, first + len(mats))):  # v_k = v_{k+1} T′_k
            v = st.unmerge(v, k)  # stages: through the merge after block k (¼ weights)
                # T′ = (1 − r) T + r R, R the residual's token mixing: the identity, or a
            # query pooling's child shares (Hiera)
            v = (1 - rs) * st.token_mix(v, mats[k - first], k) + rs * st.residual(
                v.to(mats[k - first].dtype), k, tr.blocks[k - tr.start].pool_shares)
            rows[k] = v
        return torch.stack([st.carry(rows[l], l, split=True) for l in layers])


@register_method("globenc", kind="decomposition")
class GlobEnc(_GlobALTI):
    r"""GlobEnc (Modarressi et al., NAACL 2022) for ViTs, as in SkipPLUS
    (Mehri et al. 2024, §5.1, App. E.2).

    Per block ``l``, the reset decomposition of the block (one source per token of its
    input ``x_l``, bias source dropped; see :mod:`captum_vit.methods.globenc_alti`) gives
    vectors :math:`v_{i←j}`, and

    .. math::

        T_l[i, j] = \frac{\|v_{i←j}\|_2}{\sum_k \|v_{i←k}\|_2}, \qquad
        m = w \, T'_{L-1} \cdots T'_0, \quad T'_l = (1 - r) T_l + r I.

    Class-agnostic (the target is validated but does not change the map). By default the
    MLP branch is replaced by the decomposition of its input ``LN2(x_mid)`` (times
    LayerScale), the SkipPLUS authors' ``mlp_decompose_p=False``; ``mlp="decompx"`` uses
    the exact DecompX decomposition of the whole block. The SkipPLUS authors' code (and
    GlobEnc's own demo) roll out the norms without row normalisation; captum_vit
    row-normalises (our choice). Cost with ``mlp="ln2"``: one forward plus, per block, one value
    projection of the tokens and an ``[N, N, D]`` attention mix per image (chunked by
    ``max_memory``); ``mlp="decompx"`` carries ``N`` decomposed copies of the sequence
    through each block (``N·N·W`` floats per image and block at MLP width ``W``).

    Args:
        model (torch.nn.Module): a supported Vision Transformer.
        mlp (str, optional): ``"ln2"`` (default) or ``"decompx"``.
        residual_strength (float, optional): ``r`` in ``[0, 1]``; 0 (default) is the
            rollout without identity, the authors also report 0.5.
        max_memory (int or None, optional): bytes of decomposed activations per pass
            (default 1 GiB); ``None`` = all sources in one pass.
        fast (bool, optional): with ``mlp="ln2"``, compute ``T_l`` from one pass over the
            block's tokens (:func:`reset_scores`, default True); False carries the ``N``
            reset sources through the block (:func:`decompose_block`, the reference).

    Examples::

        >>> from captum_vit.methods.globenc_alti import GlobEnc
        >>> attr = GlobEnc(model).attribute(images, output="grid")       # [B, 1, gh, gw]
        >>> T = GlobEnc(model, mlp="decompx").block_matrices(images)     # [L, B, N, N]
        >>> row = T[-1, :, 0]  # what each token of x_{L-1} gives the CLS token
    """

    measure = "globenc"


@register_method("alti", kind="decomposition")
class ALTI(_GlobALTI):
    r"""ALTI (Ferrando, Gállego and Costa-jussà, EMNLP 2022) for ViTs, as in SkipPLUS
    (Mehri et al. 2024, §5.1, App. E.2).

    Per block ``l``, the reset decomposition of the block (one source per token of its
    input ``x_l``, bias source dropped; see :mod:`captum_vit.methods.globenc_alti`) gives
    vectors :math:`v_{i←j}`, and with :math:`o_i = x_{l+1}[i]` the block's **real**
    output (bias and, with ``mlp="ln2"``, the real MLP included, as in the SkipPLUS
    authors' code, which reads the block's stored output)

    .. math::

        c_{ij} = \max\bigl(0, \|o_i\|_1 - \|o_i - v_{i←j}\|_1\bigr), \qquad
        T_l[i, j] = c_{ij} / \textstyle\sum_k c_{ik}, \qquad
        m = w \, T'_{L-1} \cdots T'_0, \quad T'_l = (1 - r) T_l + r I.

    Class-agnostic (the target is validated but does not change the map). The MLP
    choice (``mlp=``), ``residual_strength`` and ``max_memory`` are as in
    :class:`GlobEnc`.

    Args:
        model (torch.nn.Module): a supported Vision Transformer.
        mlp (str, optional): ``"ln2"`` (default) or ``"decompx"``.
        residual_strength (float, optional): ``r`` in ``[0, 1]``; default 0.
        max_memory (int or None, optional): bytes of decomposed activations per pass
            (default 1 GiB); ``None`` = all sources in one pass.
        fast (bool, optional): as in :class:`GlobEnc` (default True).

    Examples::

        >>> from captum_vit.methods.globenc_alti import ALTI
        >>> attr = ALTI(model, residual_strength=0.5).attribute(images, output="tokens")
        >>> T = ALTI(model).block_matrices(images)  # [L, B, N, N], rows sum to 1
    """

    measure = "alti"
