r"""Transformer Attribution of Chefer, Gur & Wolf, "Transformer Interpretability Beyond
Attention Visualization" (CVPR 2021); reference code
hila-chefer/Transformer-Explainability (MIT), ``baselines/ViT/ViT_LRP.py`` and
``modules/layers_ours.py``.

1. A plain backward of the score gives :math:`\nabla A_l^h`.
2. An LRP backward from the head with initial relevance one-hot at the explained class
   (:class:`~captum_vit.adapters.rules.CheferOps`: α1β0 linear maps, identity LayerNorm /
   GELU / softmax, halved LRP-0 attention matmuls, rescaled residual adds) gives the
   relevance :math:`R^{A_l^h}` of every block's post-softmax attention (after the halving).
3. :math:`\bar A_l = \mathrm{mean}_h \mathrm{ReLU}(\nabla A_l^h \odot R^{A_l^h})` and the
   rollout without row normalisation :math:`R = (I + \bar A_{L-1}) \cdots (I + \bar A_s)`,
   :math:`m = w R` (the paper's Eq. 13–14 as numbered in arXiv:2012.09838v2, recalled, not
   re-read here; the whole method, the LRP pass included, was read as Eq. 9–13, a
   numbering that may belong to another version of the paper).

LRP is patented (Fraunhofer); see :class:`~captum_vit.methods.lrp.AttnLRP`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from captum_vit._base import (
    AGGREGATES,
    accumulation_dtype,
    check_layer,
    gradients,
    readout_rows,
    resolve_target,
    target_scores,
)
from captum_vit.adapters import CheferOps, Trace, ViTAdapter
from captum_vit.adapters import divide as _divide
from captum_vit.methods._engines import PLUSFastPath
from captum_vit.methods._front import ScoredAttribution, plus_doc
from captum_vit.methods.table import register_method


def chefer_pass(adapter: ViTAdapter, inputs: Tensor, target: Tensor | None, *,
                score: str = "logit", start: int = 0
                ) -> tuple[Trace, Tensor, list[Tensor], list[Tensor], Tensor | None,
                           Tensor | None]:
    r"""One forward with Chefer's rules (:class:`~captum_vit.adapters.rules.CheferOps`) and
    two backward passes through it: the true gradient of the score gives
    :math:`\nabla A_l`, the LRP backward from initial relevance one-hot at the class
    (:math:`R = 1`, not the logit) gives :math:`R^{A_l}`, for blocks ``start .. L-1``.

    Args:
        adapter (ViTAdapter): the model's adapter.
        inputs (Tensor): validated images [B, C, H, W].
        target (Tensor or None): class per image; ``None`` = predicted.
        score (str): what :math:`\nabla A` differentiates, ``"logit"`` or
            ``"probability"``.
        start (int): first block whose matrices are needed.

    Returns:
        (trace, resolved target [B], :math:`\nabla A_l` and :math:`R^{A_l}` of blocks
        ``start..L-1`` [B, H, N, N], the attention pool's :math:`\nabla A_p` and
        :math:`R^{A_p}` or ``None``).
    """
    ops = CheferOps()
    with torch.enable_grad():
        tr = adapter.trace(inputs, grad=True, ops=ops)
        t = resolve_target(target, tr.require_logits())
        logits = tr.require_logits()
        wrt = [rec.require_attn() for rec in tr.blocks[start:]]
        pool = tr.pool_attn is not None
        if tr.pool_attn is not None:
            wrt.append(tr.pool_attn)
        ops.mode.lrp = False  # the true gradient through the same graph
        grads = gradients(target_scores(logits, t, score, adapter.probability), wrt, trace=tr,
                          retain_graph=True)
        ops.mode.lrp = True
        onehot = torch.zeros_like(logits).scatter_(1, t.to(logits.device)[:, None], 1.0)
        # relevance as gradient: the head's relevance y ⊙ g̃ is the one-hot vector
        lrp = torch.autograd.grad(logits, wrt, grad_outputs=_divide(onehot, logits.detach()))
    with torch.no_grad():
        rel = [a.detach() * g for a, g in zip(wrt, lrp, strict=True)]
    n = len(wrt) - pool
    return (tr, t, list(grads[:n]), rel[:n], grads[-1] if pool else None,
            rel[-1] if pool else None)


@register_method("chefer21", kind="decomposition")
class TransformerAttribution(PLUSFastPath, ScoredAttribution):
    r"""Chefer'21 Transformer Attribution (Chefer, Gur & Wolf, CVPR 2021, §3).

    :math:`\bar A_l = \mathrm{mean}_h \mathrm{ReLU}(\nabla A_l^h \odot R^{A_l^h})` with
    :math:`\nabla A_l^h` from one backward of the score and :math:`R^{A_l^h}` the LRP
    relevance of the attention probabilities (one-hot start, α1β0 on linear maps, identity
    on LayerNorm/GELU/softmax, halved LRP-0 on the attention matmuls, rescaled residual
    adds; :class:`~captum_vit.adapters.rules.CheferOps`); the map is the readout row of
    :math:`(I + \bar A_{L-1}) \cdots (I + \bar A_s)` (no row normalisation).

    Differences from the reference code (``ViT_LRP.py``, batch size 1): batched, the
    residual rule's sums taken per image; the LRP-0 steps (matmuls, residual split, the
    token used twice, the class-token selection) divide exactly where the reference's
    ``safe_divide`` adds its stabiliser :math:`10^{-9}` (kept in the α1β0 rule and the
    residual rescaling). The maps therefore differ from a float64 transcription of the
    reference by that stabiliser's effect, which grows with depth. Measured on random
    timm ViTs in float64 (patch 8, 4 heads, two images): with 12 blocks (width 32, three
    seeds; width 96, one seed) the difference reaches :math:`1.6 \cdot 10^{-5}` of the
    largest map value (:math:`3.6 \cdot 10^{-5}` of one image's own largest value), with
    2 to 6 blocks :math:`2.3 \cdot 10^{-6}`. It is proportional to the stabiliser: with
    :math:`10^{-12}` in the transcription's LRP-0 steps the 12-block difference drops to
    :math:`1.5 \cdot 10^{-8}`, and with exact LRP-0 divisions the transcription equals
    these maps to :math:`2.3 \cdot 10^{-11}` (12 blocks). Readouts other than the
    class token use the readout weights :math:`w` (average pooling: the patch mean); an
    attention-pool head (``"map"``) reads
    :math:`w = \mathrm{mean}_h \mathrm{ReLU}(\nabla A_p \odot R^{A_p})[0, :]` (the pool as one
    more attention without identity). Model families beyond the reference ViT use the
    rules documented in :class:`~captum_vit.adapters.rules.CheferOps`.

    Cost: one forward (with the rules) and two backward passes through it, the true
    gradient (:math:`\nabla A`) and the LRP backward. The LRP backward of a linear map
    needs three products of the map's size where a gradient needs one: the α1β0
    denominator :math:`z = x^{+} W^{+\top} + x^{-} W^{-\top} = (x W^\top + |x|
    |W|^\top)/2` (one product, :math:`x W^\top` being the forward's) and :math:`S W^{+}`,
    :math:`S W^{-}` (two: :math:`x^{+} \odot S W^{+} + x^{-} \odot S W^{-} = (x \odot S W
    + |x| \odot S |W|)/2`); the halved attention products cost what their gradient costs.
    Per block with :math:`N` tokens, width :math:`D` and an MLP of :math:`4D`, that is
    :math:`60 N D^2 + 10 N^2 D` multiply-adds against :math:`24 N D^2 + 6 N^2 D` for a
    forward+backward (input gradients only), a ratio of
    :math:`(60 D + 10 N) / (24 D + 6 N)`: 2.4 for ViT-S/16 at 224 px, between 1.67 and
    2.5 for any shape. Counted on whole models (``benchmarks/speed.py --flops``): 2.34
    for ViT-S/16, 2.34 to 2.39 for DINOv3-S, Hiera-T, SigLIP2-B and Swin V2-T; timed on
    a CPU at about that (the documentation's Benchmarks page).

    Robustness: the maps are far more sensitive to small input changes than GAE's
    (Max-Sensitivity 1.15 against GAE's 0.033 on the bundled model, the documentation's Results
    page, "The baselines of today's papers"). This is the rule, not rounding: float64 gives the
    same values as float32 (0.845 against 0.845 on the first sample image), and a uniform
    perturbation of :math:`10^{-4}` changes that image's map by 17 % (L2, relative). The
    residual rule's LRP-0 split :math:`R_a = a/(a+b)\,R` meets coordinates of the residual
    stream where :math:`a + b \approx 0`; there :math:`|a/(a+b)|` reached 12,000 on that image,
    so per-coordinate relevances, and what the per-image rescaling and the ReLU keep of them,
    move steeply with the input. The reference ``Add.relprop`` has the same division.

    ``start_layer`` :math:`s` defaults to 0 (the paper); Chefer's evaluation scripts use
    ``start_layer=1`` (the ``chefer21_perturbation`` preset of
    :mod:`captum_vit.metrics.protocols`). Composed
    with :class:`~captum_vit.combinators.PLUS` / ``SkipPLUS`` it takes a suffix-product
    fast path (:meth:`plus_maps`).

    LRP is patented (LXT README: "LRP is a patented technology that can only be used free
    of charge for personal and scientific purposes").

    Args:
        model (torch.nn.Module): a supported Vision Transformer.
        start_layer (int, optional): first block :math:`s` of the rollout, in
            ``[0, L-1]``. Default 0.

    Examples::

        >>> from captum_vit import TransformerAttribution
        >>> attr = TransformerAttribution(model).attribute(images, target=labels)
        >>> paper_eval = TransformerAttribution(model, start_layer=1)
    """

    pools_queries = True  # vector chains through query pooling (Stages.residual)

    plus_aggregates = AGGREGATES

    def __init__(self, model: nn.Module, start_layer: int = 0) -> None:
        super().__init__(model)
        self.start_layer = check_layer("start_layer", start_layer, self.adapter.num_blocks)

    score_doc = r"""score (str, optional): what the gradient :math:`\nabla A` differentiates:
        ``"logit"`` (default, the reference) or ``"probability"``; the LRP pass
        always starts one-hot."""
    returns_doc = r"""the attribution map (non-negative) in the requested ``output`` format."""
    examples_doc = r"""
        >>> from captum_vit import TransformerAttribution
        >>> attr = TransformerAttribution(model).attribute(images, target=labels,
        ...                                                output="grid")
    """

    @plus_doc("chefer21")
    # takes this method's own options, not any keyword (PLUSFastPath.plus_maps)
    def plus_maps(self, inputs: Tensor, target: Tensor | None, layers: Sequence[int], *,  # type: ignore[override]
                  aggregate: str = "subnetwork", score: str = "logit") -> Tensor:
        r"""PLUS / SkipPLUS fast path (:mod:`captum_vit.combinators`): the map of every
        sub-network :math:`f_l`, ``l`` in ``layers``, [len(layers), B, N], from one gradient
        pass and one LRP pass.

        ``aggregate="subnetwork"``: :math:`v_L = w`,
        :math:`v_k = v_{k+1}(I + \bar A_k)`; :math:`f_l` with its own
        ``start_layer`` :math:`s` is :math:`v_{l+s}` (the gradients and the LRP relevances of
        blocks :math:`\geq l` are the same in :math:`f_l` and in the model).
        ``aggregate="layer"``: :math:`w \bar A_l` (``start_layer`` unused).

        Args:
            {plus_args}
            aggregate (str): ``"subnetwork"`` or ``"layer"``.
            score (str): ``"logit"`` (default) or ``"probability"``.

        {plus_returns}
        """
        self.check_plus_options(aggregate, score)
        L = self.adapter.num_blocks
        s = self.start_layer if aggregate == "subnetwork" else 0
        for l in layers:  # the check the method makes on each (L - l)-block sub-network
            check_layer("start_layer", s, L - l)
        first = min(layers) + s
        tr, t, grads, rel, pool_grad, pool_rel = chefer_pass(
            self.adapter, inputs, target, score=score, start=first)
        dt = accumulation_dtype(rel[0])
        with torch.no_grad():
            if pool_grad is not None and pool_rel is not None:  # the pool's row:
                # mean_h ReLU(∇A_p ⊙ R^{A_p})[0]
                w = (pool_grad.to(dt) * pool_rel.to(dt)).clamp(min=0).mean(1)[:, 0]
            else:
                w = readout_rows(tr, dtype=dt, target=t)

            def abar(k: int) -> Tensor:  # block first + k
                return (grads[k].to(dt) * rel[k].to(dt)).clamp(min=0).mean(1)

            st = self.adapter.stages
            if aggregate == "layer":
                return torch.stack([st.carry(st.token_mix(st.carry_down(w, l), abar(l - first),
                                                          l), l, split=True) for l in layers])
            rows, v = {}, w
            for k in reversed(range(len(rel))):
                v = st.unmerge(v, first + k)  # stages: through the merge (¼ weights)
                # query pooling (Hiera): the residual's own token mixing (child shares)
                v = st.residual(v, first + k, tr.blocks[first + k - tr.start].pool_shares) \
                    + st.token_mix(v, abar(k), first + k)
                rows[first + k] = v
            return torch.stack([st.carry(rows[l + s], l + s, split=True) for l in layers])
