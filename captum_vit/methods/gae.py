"""Generic Attention-model Explainability (Chefer, Gur & Wolf, ICCV 2021)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import Tensor

from captum_vit._base import (
    AGGREGATES,
    accumulation_dtype,
    gradients_with_pool,
    readout_rows,
    resolve_target,
    target_scores,
)
from captum_vit.adapters import BlockRecord, Heads
from captum_vit.methods._engines import PLUSFastPath
from captum_vit.methods._front import HeadsAttribution, fill_doc
from captum_vit.methods.table import register_method


@register_method("gae", kind="gradient_attention")
class GAE(PLUSFastPath, HeadsAttribution):
    r"""Gradient-weighted attention relevance (GAE, "GenAtt" in SkipPLUS).

    With :math:`R = I` and, for every block :math:`l = 0 .. L-1`,
    :math:`\bar A_l = \mathrm{mean}_h\,\mathrm{ReLU}(\nabla A_l^h \odot A_l^h)` (ReLU per
    head, then the head mean; Eq. 5 of the paper) and :math:`R \leftarrow R + \bar A_l R`
    (Eq. 6), the map is the readout row of :math:`R`. No row normalisation.

    Gradients of all blocks come from one backward pass of the target score. For a
    large attention (at least four times the head width in keys per query,
    :func:`~captum_vit.adapters.parts.small_attention` with ``inclusive=False``: ViT-B at
    448 px, SigLIP's 256 patches of width 64) the forward
    uses the fused attention kernel and keeps no ``[B, H, N, N]`` tensor for the
    backward; each block's :math:`A_l` and :math:`\nabla A_l = (\nabla o_l) v_l^\top`
    (:math:`o_l = A_l v_l`) are recomputed one block at a time, from the top block down,
    so memory stays that of a plain forward and backward. A small one (ViT-S/B at 224 px,
    Swin's windows) keeps its probabilities, which is faster (nothing is recomputed). Heads are
    averaged per image (the authors' notebook reshapes batch and heads together, which
    mixes images in a batch; this implementation does not). The readout row is carried
    as a vector from the last block down, :math:`r^\top (I+\bar A_{L-1})\cdots(I+\bar
    A_0)`, which equals the matrix recursion.

    Per-head maps (``attribute(..., heads="all")``, our choice): the last block's update
    per head before the head mean, :math:`m_h = w (I + \bar A_{L-1}^h) R_{L-1}` with
    :math:`\bar A_{L-1}^h = \mathrm{ReLU}(\nabla A_{L-1}^h \odot A_{L-1}^h)` and
    :math:`R_{L-1} = (I + \bar A_{L-2}) \cdots (I + \bar A_0)` the head-averaged
    relevance of the blocks below. The map is linear in the last update, so
    :math:`\mathrm{mean}_h m_h` is the map of ``heads="mean"``; the identity term
    :math:`w R_{L-1}` is shared by every head.

    Composed with :class:`~captum_vit.combinators.PLUS` / ``SkipPLUS`` it takes a fast
    path (:meth:`plus_maps`): every sub-network's map from one backward.

    Args:
        model (torch.nn.Module): a supported Vision Transformer.
    """

    linear_in_read_gradient = True  # one forward; the score's gradients only (ViTFront)

    pools_queries = True  # vector chains through query pooling (Stages.residual)

    plus_aggregates = AGGREGATES
    per_head = True
    """``attribute`` takes ``heads="all"``: one map per head of the last block."""
    score_doc = """score (str, optional): ``"logit"`` (default, as the paper) or
        ``"probability"``."""
    examples_doc = """
        >>> from captum_vit import GAE
        >>> from captum.attr import NoiseTunnel
        >>> attr = GAE(model).attribute(images, target=labels)
        >>> smooth = NoiseTunnel(GAE(model)).attribute(
        ...     images, nt_type="smoothgrad", stdevs=0.1, target=labels)
        >>> per_head = GAE(model).attribute(images, target=labels, heads="all")
    """

    @fill_doc
    # takes this method's own options, not any keyword (PLUSFastPath.plus_maps)
    def plus_maps(self, inputs: Tensor, target: Tensor | None, layers: Sequence[int], *,  # type: ignore[override]
                  aggregate: str = "subnetwork", score: str = "logit") -> Tensor:
        r"""PLUS / SkipPLUS fast path (:mod:`captum_vit.combinators`): GAE of every sub-network
        :math:`f_l`, ``l`` in ``layers``, from one forward and one backward,
        [len(layers), B, N].

        ``aggregate="subnetwork"``: :math:`v_L = w`, :math:`v_k = v_{k+1}(I + \bar A_k)`,
        the map of :math:`f_l` is :math:`v_l` (GAE's recursion started at block ``l``:
        :math:`\partial s / \partial A_k` for :math:`k \geq l` is the same in
        :math:`f_l` and in the model). ``aggregate="layer"``: :math:`w \bar A_l`, whose
        sum over the blocks is Grad-SAM (:class:`~captum_vit.methods.gradsam.GradSAM`).

        Args:
            {plus_args}
            aggregate (str): ``"subnetwork"`` or ``"layer"``.
            score (str): ``"logit"`` (default) or ``"probability"``.

        Returns:
            Tensor: token maps [len(layers), B, N].

        Examples::

            >>> from captum_vit import PLUS
            >>> gradsam = PLUS(model, "gae", aggregate="layer").attribute(images)
        """
        self.check_plus_options(aggregate, score)
        first = min(layers)
        need = layers if aggregate == "layer" else range(first, self.adapter.num_blocks)
        w, abar = self._relevance(inputs, target, need, score)
        st = self.adapter.stages
        with torch.no_grad():
            if aggregate == "layer":
                return torch.stack([st.carry(st.token_mix(st.carry_down(w, l), abar(l), l), l,
                                             split=True) for l in layers])
            rows, v = {}, w
            for k in reversed(need):
                v = st.unmerge(v, k)  # stages: through the merge after block k (¼ weights)
                v = st.residual(v, k, self._shares.get(k)) + st.token_mix(v, abar(k), k)
                rows[k] = v
            return torch.stack([st.carry(rows[l], l, split=True) for l in layers])

    def _head_maps(self, inputs: Tensor, target: Tensor | None, *, score: str = "logit",
                   **_: Any) -> Tensor:
        """Per-head maps [B, H, N]: the last update per head, then the blocks below."""
        last = self.adapter.num_blocks - 1
        w, abar = self._relevance(inputs, target, range(last + 1), score)
        st = self.adapter.stages
        with torch.no_grad():
            v = st.residual(w, last, self._shares.get(last))[:, None] \
                + st.token_mix(w, abar(last, per_head=True), last)
            for k in reversed(range(last)):
                v = st.unmerge(v, k)
                v = st.residual(v, k, self._shares.get(k)) + st.token_mix(v, abar(k), k)
            return st.carry(v, 0, split=True)

    def _relevance(self, inputs: Tensor, target: Tensor | None, need: Sequence[int],
                   score: str) -> tuple[Tensor, Callable[..., Tensor]]:
        r"""One forward and one backward: the readout weights ``w`` [B, N] and
        ``abar(k, per_head=False)``, block ``k``'s :math:`\bar A_k` [B, N, N] (each block
        of ``need`` once; ``per_head=True``: before the head mean, [B, H, N, N])."""
        # small attention below the bound (ViT-S/B at 224 px, Swin's windows; at the
        # bound, 256 keys of width 64, the fused route is 10 % slower for 0.6x the peak
        # memory, adapters.parts.small_attention): the explicit forward keeps
        # every A_k for the backward, which gives dA_k directly; otherwise the fused
        # kernel keeps no [B, H, N, N] for the backward, and A_k and dA_k are recomputed
        # block by block below (Heads.probs / probs_grad). Under a class-token readout the
        # last block's FFN runs on the rows the head reads only.
        explicit = self.adapter.small_attention(inputs, inclusive=False)
        kept: dict[int, Any] = {}
        # query pooling (Hiera): the residual's token mixing (Stages.residual)
        self._shares: dict[int, Tensor] = {}

        def keep(l: int, rec: BlockRecord) -> None:  # A_k, or q, k, v, o (fused)
            if rec.pool_shares is not None:
                self._shares[l] = rec.pool_shares
            if l in need:
                kept[l] = rec.require_attn() if explicit else cast(Heads, rec.heads)

        tr = self.adapter.trace(inputs, grad=True, on_block=keep,
                                attention="explicit" if explicit else "fused",
                                last_rows=self.adapter.readout_row_count)
        t = resolve_target(target, tr.require_logits())
        grads, pool_grad = gradients_with_pool(
            tr, target_scores(tr.require_logits(), t, score, self.adapter.probability),
            [kept[k] if explicit else kept[k].o for k in need])
        grad_of = dict(zip(need, grads, strict=True))
        dt = accumulation_dtype(tr.x0)
        w = readout_rows(tr, pool_grad, dtype=dt, target=t)

        def abar(k: int, per_head: bool = False) -> Tensor:
            h, g = kept.pop(k), grad_of.pop(k)
            if explicit:  # g is dA_k itself
                a = g.to(dt) * h.detach().to(dt)
            else:
                a = h.probs_grad(g).to(dt) * h.probs().to(dt)
            a = a.clamp_(min=0)
            return a if per_head else a.mean(1)

        return w, abar
