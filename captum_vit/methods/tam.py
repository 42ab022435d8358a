"""Transition Attention Maps (TAM; Yuan et al., "Explaining Information Flow Inside Vision
Transformers Using Markov Chain", NeurIPS 2021 XAI4Debugging).

The readout's state after the last block's attention is propagated backwards as a Markov
chain through the earlier blocks' head-mean attention (with the residual as identity, no
normalisation) and weighted by the integrated gradient of the last block's attention:

    σ = w Ā_{L-1} (I + Ā_{L-2}) ··· (I + Ā_s)
    ω = w · mean_h ReLU( (1/n) Σ_{k=0}^{n-1} ∇A_{L-1}^h(α_k X) ),   α_k = k/(n-1)
    m = σ ⊙ ω

The integrated gradient is Beyond Intuition's reasoning feedback
(:func:`captum_vit.methods.bt.reasoning_feedback`). The authors' code
(XianrenYty/Transition_Attention_Maps, ``baselines/ViT/interpret_methods.py``,
``transition_attention_maps``) was read for its mathematics only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from captum.log import log_usage
from torch import Tensor, nn

from captum_vit._base import (
    SCORES,
    TargetLike,
    accumulation_dtype,
    check_choice,
    check_scalar,
    gradients,
    readout_rows,
    target_scores,
)
from captum_vit.methods._front import fill_doc, plus_doc
from captum_vit.methods.bt import (
    N_STEPS,
    FeedbackMethod,
    reasoning_feedback,
)
from captum_vit.methods.table import register_method

START_LAYER = 4
"""TAM's default last block of the chain (0-based, inclusive; the authors' default)."""


@register_method("tam", kind="gradient_attention", quick={"n_steps": 5})
class TAM(FeedbackMethod):
    r"""Transition Attention Maps (Yuan et al. 2021).

    Markov-chain state :math:`\sigma = w \bar A_{L-1}` (head-mean attention of the last
    block at the readout row), then for :math:`i = L-2` down to :math:`s`:
    :math:`\sigma \leftarrow \sigma + \sigma \bar A_i`, i.e.
    :math:`\sigma = w \bar A_{L-1} (I + \bar A_{L-2}) \cdots (I + \bar A_s)` (no
    normalisation). Weight :math:`\omega = w \cdot \mathrm{mean}_h \mathrm{ReLU}\big(
    \frac1n \sum_{k=0}^{n-1} \nabla A_{L-1}^h(\alpha_k X)\big)` with
    :math:`\alpha_k = k/(n-1)` (``linspace(0, 1, n)``), black baseline (0 in the model's
    normalised input space) and the score of the class chosen on ``X``
    (:func:`~captum_vit.methods.bt.reasoning_feedback`, shared with Beyond Intuition).
    Map :math:`m = \sigma \odot \omega`, raw (no normalisation).

    ``integrated=False`` uses the plain gradient at ``X``,
    :math:`\omega = w \cdot \mathrm{mean}_h \mathrm{ReLU}(\nabla A_{L-1}^h(X))` (the
    authors' ``with_integral=False``: the gradient their loop left from the last step,
    :math:`\alpha = 1`).

    **Start block (verified).** Block 4 (0-based, inclusive) is the authors' default
    ``start_layer=4``: their loop runs ``i`` over ``range(start_layer, L - 1)`` backwards.
    ``start_layer`` is relative to the (sub-)network and lies in ``[0, L-1]``;
    ``start_layer = L - 1`` leaves :math:`\sigma = w \bar A_{L-1}` (the authors'
    ``first_state=True``), and the default is clamped to it on networks (and PLUS /
    SkipPLUS sub-networks) of at most 4 blocks.

    The chain multiplies plain attention, so the readout weights ``w`` of an
    attention-pool head are the plain pool attention :math:`\mathrm{mean}_h A_p^h[0, :]`
    (as for Rollout) in both :math:`\sigma` and :math:`\omega`; other poolings use
    :func:`captum_vit._base.readout_rows`. Images are kept separate.

    Cost: ``n`` forwards (``integrated=False``: one), each with a backward through the
    last block only; the scaled images of all steps are stacked into one batch
    (``internal_batch_size`` chunks it).

    Composed with :class:`~captum_vit.combinators.PLUS` / ``SkipPLUS`` it takes a fast
    path (:meth:`plus_maps`): the chain of every sub-network from one trace, ``ω`` shared.

    Args:
        model (torch.nn.Module): a supported Vision Transformer.
        start_layer (int, optional): last block ``s`` of the chain (0-based, inclusive,
            in ``[0, L-1]``). Default ``None``: block 4, or ``L - 1`` if the model has
            fewer blocks.
        n_steps (int, optional): steps ``n`` ≥ 2 of the integrated gradient. Default 20.
        integrated (bool, optional): integrated gradient (default True) or the plain
            gradient at ``X``.
        internal_batch_size (int, optional): at most this many scaled images per forward
            pass; ``None`` (default) = all ``B·n`` at once.

    Examples::

        >>> from captum_vit import TAM
        >>> attr = TAM(model).attribute(images, target=labels)
        >>> plain = TAM(model, integrated=False).attribute(images, target=labels)
    """

    pools_queries = True  # the σ chain through query pooling (Stages.residual)

    def __init__(self, model: nn.Module, start_layer: int | None = None,
                 n_steps: int = N_STEPS, integrated: bool = True,
                 internal_batch_size: int | None = None) -> None:
        self.integrated = check_scalar(integrated, "integrated", bool)
        super().__init__(model, start_layer, n_steps, internal_batch_size)

    def _options(self, start_layer: int | None, n_steps: int | None,
                 integrated: bool | None, internal_batch_size: int | None
                 ) -> tuple[int | None, int, bool, int | None]:
        s, n, ibs = self._step_options(start_layer, n_steps, internal_batch_size)
        return (s, n, self.integrated if integrated is None
                else check_scalar(integrated, "integrated", bool), ibs)

    @log_usage()
    @fill_doc
    def attribute(self, inputs: Tensor, target: TargetLike = None, *,
                  start_layer: int | None = None, n_steps: int | None = None,
                  integrated: bool | None = None, internal_batch_size: int | None = None,
                  score: str = "logit", output: str = "pixels") -> Tensor:
        r"""
        Args:
            {inputs}
            target (int, list, Tensor, optional): class per image. ``None`` (default)
                explains the predicted class of each image.
            start_layer (int, optional): overrides the constructor's ``start_layer``.
            n_steps (int, optional): overrides the constructor's ``n_steps``.
            integrated (bool, optional): overrides the constructor's ``integrated``.
            internal_batch_size (int, optional): overrides the constructor's.
            score (str, optional): ``"logit"`` (default, as the authors' code) or
                ``"probability"``.
            {output}

        Returns:
            Tensor: the attribution map in the requested ``output`` format.

        Examples::

            >>> from captum_vit import TAM
            >>> attr = TAM(model).attribute(images, target=labels, n_steps=10)
        """
        self._options(start_layer, n_steps, integrated, internal_batch_size)
        check_choice("score", score, SCORES)
        return self._attribute(inputs, target, output, start_layer=start_layer,
                               n_steps=n_steps, integrated=integrated,
                               internal_batch_size=internal_batch_size, score=score)

    @plus_doc("tam")
    # takes this method's own options, not any keyword (PLUSFastPath.plus_maps)
    def plus_maps(self, inputs: Tensor, target: Tensor | None, layers: Sequence[int], *,  # type: ignore[override]
                  aggregate: str = "subnetwork", start_layer: int | None = None,
                  n_steps: int | None = None, integrated: bool | None = None,
                  internal_batch_size: int | None = None, score: str = "logit") -> Tensor:
        r"""PLUS / SkipPLUS fast path (:mod:`captum_vit.combinators`): TAM of every sub-network
        :math:`f_l`, ``l`` in ``layers``, [len(layers), B, N].

        Every sub-network ends with the model's last block, so :math:`\omega` is shared;
        its chain stops at its own block ``s`` (``start_layer``, relative: the model's
        block ``l + s``; the default clamped to its last block): suffix row-vector
        products :math:`v = w \bar A_{L-1}`, :math:`v \leftarrow v + v \bar A_k` for
        ``k = L-2`` down, read at ``k = l + s``.

        Args:
            {plus_args}
            aggregate (str): ``"subnetwork"`` only.
            start_layer, n_steps, integrated, internal_batch_size, score: as in
                :meth:`attribute`.

        {plus_returns}
        """
        self.check_plus_options(aggregate, score)
        s, n, integ, ibs = self._options(start_layer, n_steps, integrated, internal_batch_size)
        ad = self.adapter
        st = ad.stages
        L = ad.num_blocks
        starts, tr, t = self._trace_starts(inputs, target, layers, s, START_LAYER)  # l -> l + s
        last = tr.blocks[-1].require_attn()
        (g,) = gradients(target_scores(tr.require_logits(), t, score, self.adapter.probability),
                         [last], trace=tr)  # last block
        if integ:
            feedback = reasoning_feedback(ad, inputs, t, n_steps=n, score=score,
                                          internal_batch_size=ibs, grad_at_input=g)
        else:
            feedback = g.detach().to(accumulation_dtype(g)).clamp(min=0).mean(1)
        dt = feedback.dtype
        with torch.no_grad():
            w = readout_rows(tr, dtype=dt, target=t)
            omega = st.token_mix(w, feedback, L - 1)
            top = st.token_mix(w, last.detach().to(dt).mean(1), L - 1)  # w Ā_{L-1}
            got: dict[int, Tensor] = {L - 1: top}
            sigma = top
            for k in reversed(range(min(starts.values()), L - 1)):
                a = tr.blocks[k].require_attn().detach().to(dt).mean(1)
                sigma = st.unmerge(sigma, k)  # stages: through the merge (¼ weights)
                # query pooling (Hiera): the residual's own token mixing (child shares)
                sigma = st.residual(sigma, k, tr.blocks[k].pool_shares) \
                    + st.token_mix(sigma, a, k)
                got[k] = sigma
            # stages: ω (a weight per last-stage token) copied onto the chain's grid
            return torch.stack([st.carry(got.get(starts[l], top) * st.carry(
                omega, L - 1, down_to=starts[l] if starts[l] in got else L - 1),
                starts[l] if starts[l] in got else L - 1, split=True) for l in layers])
