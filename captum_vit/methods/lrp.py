r"""Conservative LRP for Vision Transformers: CP-LRP (Ali et al., "XAI for Transformers:
Better Explanations through Conservative Propagation", ICML 2022) and AttnLRP (Achtibat et
al., "AttnLRP: Attention-Aware Layer-Wise Relevance Propagation for Transformers", ICML
2024).

Both are one forward and one backward pass in the "relevance as gradient" form (Arras et
al. 2025, LXT's ``efficient`` module): every rule is a custom backward
(:mod:`captum_vit.adapters.rules`), and the relevance of a tensor :math:`z` is
:math:`R_z = z \odot \tilde g_z`. The token map is :math:`m_j = \sum_c R_{x_0}[j, c]`
(``at="tokens"``) or the pixel relevance :math:`\sum_{\mathrm{channels}} X \odot \tilde
g_X` summed over each patch (``at="pixels"``; it differs from the tokens by the relevance
the position embedding, prefix tokens and patch bias absorb). At the pixels the rules
reach into the embedding (``adapter.embed(images, ops)``): the patch projection, a
convolution with stride = kernel, is the linear map of the unfolded patches with the
linear maps' ε/γ-rule, and an embedding LayerNorm (timm's ``patch_embed.norm`` /
``norm_pre``, CLIP's ``pre_layrnorm``) takes the LN rule (σ detached); prefix tokens and
position embeddings keep their true gradient (they absorb relevance like biases).

**Patent note** (from the LXT README, rachtibat/LRP-eXplains-Transformers): "LRP is a
patented technology that can only be used free of charge for personal and scientific
purposes." The code here is written from the papers (LXT's Clear BSD licence grants no
patent rights).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from captum_vit._base import (
    SCORES,
    accumulation_dtype,
    check_choice,
    check_scalar,
    gradients,
    resolve_target,
    target_scores,
)
from captum_vit.adapters import ACT_RULES, ATTENTION_RULES, LRPOps, Ops, Trace, ViTAdapter
from captum_vit.methods._engines import PLUSFastPath
from captum_vit.methods._front import ScoredAttribution, plus_doc
from captum_vit.methods._masks import patch_sums
from captum_vit.methods.table import register_method

SITES = ("tokens", "pixels")


def lrp_relevance(adapter: ViTAdapter, inputs: Tensor, target: Tensor | None, ops: LRPOps, *,
                  score: str = "logit", at: str = "tokens",
                  layers: Sequence[int] = (0,),
                  embed_ops: Ops | None = None) -> tuple[Tensor, Trace, Tensor]:
    r"""One forward with the rules ``ops`` and ONE backward of the score.

    Args:
        adapter (ViTAdapter): the model's adapter (or a sub-network view).
        inputs (Tensor): validated images [B, C, H, W].
        target (Tensor or None): class per image; ``None`` = predicted.
        ops (LRPOps): the rule set.
        score (str): ``"logit"`` (default) or ``"probability"``.
        at (str): ``"tokens"``: :math:`\sum_c R_{x_l}` at the input of every block in
            ``layers``; ``"pixels"``: the per-patch pixel relevance (prefix columns 0),
            the embedding run with the rules (``adapter.embed(images, embed_ops)``).
        layers (sequence of int): the blocks whose input relevance is returned (tokens).
        embed_ops (Ops, optional): the rule set of the embedding (``at="pixels"``: patch
            projection and embedding norms); default ``ops``.

    Returns:
        (maps [len(layers), B, N] (``at="pixels"``: [1, B, N]), the trace, the resolved
        target [B]).

    Raises:
        TypeError: ``at="pixels"`` on a model whose patch projection is not a
            convolution with stride = kernel or whose embedding norm is not a LayerNorm.
        ValueError: ``at="pixels"`` on an adapter whose embedding is not differentiable
            (a PLUS sub-network).
    """
    with torch.enable_grad():
        if at == "pixels":
            images = inputs.detach().requires_grad_()
            x0 = adapter.embed(images, ops=ops if embed_ops is None else embed_ops)
            if not x0.requires_grad:
                raise ValueError("at='pixels' needs the model's own differentiable embedding; "
                                 "this adapter (a PLUS sub-network) starts at token states: "
                                 "use at='tokens'")
            tr = adapter.trace(images, x=x0, grad=True, ops=ops)
            wrt = [images]
        else:
            tr = adapter.trace(inputs, grad=True, ops=ops)
            states = tr.states
            wrt = [states[l] for l in layers]
        t = resolve_target(target, tr.require_logits())
        grads = gradients(target_scores(tr.require_logits(), t, score, adapter.probability), wrt)
    dt = accumulation_dtype(inputs)
    with torch.no_grad():
        if at == "pixels":
            lay = tr.layout  # channels: dim 1 of images, dim 2 of videos [B, T, C, H, W]
            pix = (images.detach().to(dt) * grads[0].to(dt)).sum(-3)
            m = pix.new_zeros(pix.shape[0], lay.num_tokens)
            m[:, lay.num_prefix:] = patch_sums(pix, lay)
            return m[None], tr, t
        # a model with stages (Swin, Hiera): each block input's map on the first grid,
        # shared among a merged or pooled token's children (the identity otherwise)
        maps = torch.stack([adapter.stages.carry((x.detach().to(dt) * g.to(dt)).sum(-1), l,
                                                 split=True)
                            for l, x, g in zip(layers, wrt, grads, strict=True)])
    return maps, tr, t


class _LRPAttribution(PLUSFastPath, ScoredAttribution):
    """Shared front of CP-LRP and AttnLRP: the rule set, ``attribute`` and the PLUS hook."""

    linear_in_read_gradient = True  # one forward; the score's gradients only (ViTFront)

    def __init__(self, model: nn.Module, ops: LRPOps, at: str,
                 embed_ops: LRPOps | None = None) -> None:
        super().__init__(model)
        self.ops = ops
        self.embed_ops = embed_ops  # the embedding's rules at the pixels; None = ops
        self.at = check_choice("at", at, SITES)

    score_doc = r"""score (str, optional): ``"logit"`` (default, the papers) or
        ``"probability"`` (the softmax then keeps its true Jacobian)."""
    returns_doc = r"""signed relevance per patch in the requested ``output`` format."""
    examples_doc = r"""
        >>> from captum_vit import AttnLRP, CPLRP
        >>> attr = AttnLRP(model).attribute(images, target=labels)
        >>> cp = CPLRP(model).attribute(images, target=labels, output="tokens")
    """

    def _token_maps(self, inputs: Tensor, target: Tensor | None, *, score: str = "logit",
                    **_: Any) -> Tensor:
        maps = lrp_relevance(self.adapter, inputs, target, self.ops, score=score,
                             at=self.at, embed_ops=self.embed_ops)[0]
        return maps[0]

    @plus_doc("attnlrp")
    # takes this method's own options, not any keyword (PLUSFastPath.plus_maps)
    def plus_maps(self, inputs: Tensor, target: Tensor | None, layers: Sequence[int], *,  # type: ignore[override]
                  aggregate: str = "subnetwork", score: str = "logit") -> Tensor:
        r"""PLUS / SkipPLUS fast path (:mod:`captum_vit.combinators`, gradient route): the
        map of every sub-network :math:`f_l`, :math:`m_l = \sum_c x_l \odot \tilde
        g_{x_l}`, from one forward and one backward, [len(layers), B, N] (the rules of
        blocks :math:`\geq l` are the same in :math:`f_l` and in the model).

        Args:
            {plus_args}
            aggregate (str): ``"subnetwork"`` only (no per-block matrix).
            score (str): ``"logit"`` (default) or ``"probability"``.

        {plus_returns}
        """
        if aggregate != "subnetwork":
            raise ValueError(f"aggregate={aggregate!r} is not defined for "
                             f"{type(self).__name__} (no per-block matrix); use "
                             "aggregate='subnetwork'")
        check_choice("score", score, SCORES)
        if self.at != "tokens":
            raise ValueError("PLUS/SkipPLUS sum the relevance at every block's input "
                             f"tokens; build the base with at='tokens' (got at={self.at!r})")
        maps, _, _ = lrp_relevance(self.adapter, inputs, target, self.ops, score=score,
                                   layers=layers)
        return maps


@register_method("cp_lrp", kind="decomposition")
class CPLRP(_LRPAttribution):
    r"""CP-LRP, conservative propagation for Transformers (Ali et al., ICML 2022, the
    "AH-rule" and "LN-rule").

    Gradient × Input with a modified backward:

    - attention heads (AH-rule): the probabilities :math:`A^h` are constants (q and k
      detached), relevance flows through the values only;
    - LayerNorm (LN-rule): the standard deviation detached, the centring kept (their
      ``detach_mean=False`` variant, as LXT);
    - element-wise activations: the identity rule
      :math:`\tilde g_z = \tilde g_y\, \mathrm{act}(z)/z` (``act_rule="identity"``, LXT's
      CP-LRP preset for ViTs; the exact ratio, its limit ½ at :math:`z = 0`, where LXT
      divides by :math:`z + 10^{-10}`) or the true gradient (``"gradient"``);
    - a gated MLP's activated gate is a constant (LXT's ``cp_gated_mlp_forward``);
    - linear maps: the :math:`\varepsilon`-rule, the plain gradient for ``epsilon=0``;
      at the pixels the patch projection too (a convolution with stride = kernel, the
      linear map of the unfolded patches), and an embedding LayerNorm (a pre-norm such
      as CLIP's) takes the LN rule.

    With the defaults the relevance at the input tokens :math:`x_s` of block :math:`s` is
    DecompX started at :math:`s` (:mod:`captum_vit.methods.decompx`): the same linearised
    forward (``LRPOps() == Ops(linearize=True)``), so ``CPLRP(model)`` and
    ``DecompX(model)`` give the same numbers, and without biases the relevance of all
    tokens (prefix tokens included) sums to the logit.

    *Verified against AmeenAli/XAI_Transformers (MIT; its attention-only BERT-like model
    has no MLP):* the softmax output is detached (= q, k detached), the LayerNorm's
    standard deviation (and optionally mean) detached, and the only element-wise
    non-linearity (the pooler's tanh) keeps its true gradient, which is
    ``act_rule="gradient"``; ``"identity"`` follows LXT's ViT preset.

    Composed with :class:`~captum_vit.combinators.PLUS` / ``SkipPLUS`` it is a
    gradient-route base: one backward gives every block's map (:meth:`plus_maps`).

    LRP is patented (LXT README: "LRP is a patented technology that can only be used free
    of charge for personal and scientific purposes").

    Args:
        model (torch.nn.Module): a supported Vision Transformer.
        act_rule (str, optional): ``"identity"`` (default) or ``"gradient"``.
        epsilon (float, optional): ε of the linear maps' ε-rule,
            :math:`R_x = x \odot W^\top (R_y / (y + \varepsilon\,\mathrm{sign}\,y))`;
            default 0 (the plain gradient).
        at (str, optional): ``"tokens"`` (default, relevance of the embedding output
            :math:`x_0`) or ``"pixels"`` (image relevance summed per patch, the rules
            run through the embedding: patch projection by the ε-rule, embedding
            LayerNorms by the LN rule; prefix tokens and position embeddings absorb
            their share like biases).

    Examples::

        >>> from captum_vit import CPLRP, DecompX
        >>> cp = CPLRP(model).attribute(images, target=labels, output="tokens")
        >>> torch.allclose(cp, DecompX(model).attribute(images, target=labels,
        ...                                             output="tokens"))
        True
        >>> pix = CPLRP(model, act_rule="gradient", at="pixels").attribute(images)
    """

    pools_queries = True  # runs through query pooling (Hiera): the forward's own maths

    def __init__(self, model: nn.Module, act_rule: str = "identity", epsilon: float = 0.0,
                 at: str = "tokens") -> None:
        act_rule = check_choice("act_rule", act_rule, ACT_RULES)
        epsilon = check_scalar(epsilon, "epsilon", float, min_val=0)
        super().__init__(model, LRPOps(method="cp", attention="cp", act_rule=act_rule,
                                       epsilon=epsilon), at)
        self.act_rule, self.epsilon = act_rule, float(epsilon)


@register_method("attnlrp", kind="decomposition")
class AttnLRP(_LRPAttribution):
    r"""AttnLRP, attention-aware LRP (Achtibat et al., ICML 2024; efficient
    Gradient × Input form of Arras et al. 2025 / LXT).

    Rules (each a modified backward, the forward is the model's):

    ====================================  ===============================================
    LayerNorm, q/k norms, cosine target   identity rule on the normalisation: σ detached
    GELU, SiLU, QuickGELU, tanh-GELU      identity rule (Eq. 9),
                                          :math:`\tilde g_z = \tilde g_y\,\mathrm{act}(z)/z`
                                          (exact ratio; LXT divides by
                                          :math:`z + 10^{-10}`)
    softmax                               true Jacobian = the bias-absorbing softmax rule
                                          :math:`R_x = x \odot (R_s - s\,\Sigma R_s)`
                                          (Prop. 3.1)
    ``q kᵀ``, ``A v``                     uniform rule (Eq. 7): gradient × ¼ into q, k,
                                          × ½ into v
    gated MLP product                     uniform rule (× ½ into both factors), gate
                                          activation by the identity rule
    RoPE, rel. bias, LayerScale, adds     unmodified
    linear maps, patch projection         ε-rule (``gamma=0``) or γ-rule
    embedding LayerNorm (pre-norm)        LN rule (σ detached), ``at="pixels"``
    ====================================  ===============================================

    The softmax rule is not conservative: per attention row it passes on
    :math:`\Sigma_i x_i R_{s,i} - (\Sigma_i x_i s_i)\,\Sigma_j R_{s,j}` instead of
    :math:`\Sigma_j R_{s,j}` (the rest is absorbed like a bias), nor are linear biases; the
    map therefore sums to the logit only approximately (without biases: the logit minus
    exactly the softmax's share, tested). ``attention="cp"`` is LXT's own ViT preset
    ("AttnLRP outside the attention, CP-LRP inside", easier to tune with γ): q and k
    detached, v unscaled.

    γ-rule (zennit's generalised ``Gamma``, which LXT plugs in for ViTs): for an output
    :math:`y_j > 0` the weights :math:`W + \gamma W^+` act on positive inputs and
    :math:`W + \gamma W^-` on negative ones (bias :math:`b + \gamma b^+` in the
    denominator), for :math:`y_j < 0` the other way round. It applies to every linear map
    of the blocks, of the q/k/v projections and of the head, and (``at="pixels"``) to the
    patch projection: the model's convolution with stride = kernel is the linear map
    :math:`W p + b` of each unfolded patch :math:`p`, so zennit's convolution ``Gamma``
    is this rule on the patches; its γ is ``gamma_embed`` (default: ``gamma``). *Verify
    finding:* LXT's documentation tunes γ per layer by eye (its ViT example sweeps
    conv γ ∈ {0.1, 0.25, 100} × linear γ ∈ {0, 0.01, 0.05, 0.1, 1}, hence the separate
    ``gamma_embed``) and states no fixed values; the paper's appendix values could not be
    checked here, so there is no preset and the default is γ = 0.

    *Which maps LXT's γ reaches* (checked against rachtibat/LRP-eXplains-Transformers:
    ``examples/vit_torch.py``, ``lxt/efficient/models/vit_torch.py``,
    ``lxt/efficient/patches.py``, ``lxt/explicit/models/openclip.py``, and torchvision's
    ``nn.MultiheadAttention``): its ViT example registers zennit's ``Gamma`` on every
    ``nn.Conv2d`` and ``nn.Linear`` module of torchvision's ``vit_b_16``, and zennit's
    rules act through module hooks. torchvision's attention computes its packed q/k/v
    in-projection (``in_proj_weight``, a parameter) and its output projection
    (``out_proj``'s weight, passed to ``F.multi_head_attention_forward``; ``out_proj``
    itself is never called, so its hooks never run) as plain functions. LXT's γ therefore
    reaches the patch projection (the convolution's γ), the two MLP linear maps of every
    block and the classifier head only; in the attention, q and k are detached (its CP
    preset) and v and the output projection keep their true gradient (ε-rule,
    :math:`\varepsilon \to 0`). Its OpenCLIP example does the same: its v and output
    projections are its own ``LinearInProjection`` / ``LinearOutProjection`` modules (not
    ``nn.Linear``) under its ε-rule. Here γ applies to every linear map, the attention's
    v and output projections included (with ``attention="cp"`` the q/k projections receive
    no relevance), so ``AttnLRP(model, attention="cp", gamma=γ)`` is not LXT's ViT
    setting inside the attention when γ > 0.

    **Patent note** (LXT README): "LRP is a patented technology that can only be used
    free of charge for personal and scientific purposes." Implemented from the papers.

    Composed with :class:`~captum_vit.combinators.PLUS` / ``SkipPLUS`` it is a
    gradient-route base (:meth:`plus_maps`).

    Args:
        model (torch.nn.Module): a supported Vision Transformer.
        attention (str, optional): ``"attnlrp"`` (default, the table) or ``"cp"``.
        gamma (float, optional): γ of the linear maps' γ-rule; default 0 (ε-rule).
        epsilon (float, optional): ε stabiliser of the linear maps' rule (ε-rule, or the
            γ-rule's denominators), the patch projection's included; default 0.
        at (str, optional): ``"tokens"`` (default) or ``"pixels"`` (the rules run through
            the embedding: patch projection, embedding LayerNorms; prefix tokens and
            position embeddings absorb their share like biases).
        gamma_embed (float, optional): γ of the patch projection's γ-rule
            (``at="pixels"`` only); default ``None`` = ``gamma``.

    Examples::

        >>> from captum_vit import AttnLRP
        >>> attr = AttnLRP(model).attribute(images, target=labels)
        >>> lxt_like = AttnLRP(model, attention="cp", gamma=0.05, gamma_embed=0.25,
        ...                    at="pixels")
        >>> pix = lxt_like.attribute(images, target=labels)
    """

    pools_queries = True  # runs through query pooling (Hiera): the forward's own maths

    def __init__(self, model: nn.Module, attention: str = "attnlrp", gamma: float = 0.0,
                 epsilon: float = 0.0, at: str = "tokens",
                 gamma_embed: float | None = None) -> None:
        attention = check_choice("attention", attention, ATTENTION_RULES)
        gamma = check_scalar(gamma, "gamma", float, min_val=0)
        epsilon = check_scalar(epsilon, "epsilon", float, min_val=0)
        at = check_choice("at", at, SITES)
        if gamma_embed is not None:
            gamma_embed = check_scalar(gamma_embed, "gamma_embed", float, min_val=0)
            if at != "pixels":
                raise ValueError("gamma_embed is the patch projection's γ, which only "
                                 "at='pixels' explains through; pass at='pixels' or leave "
                                 "gamma_embed=None")
        ops = LRPOps(method="attnlrp", attention=attention, gamma=gamma, epsilon=epsilon)
        embed_ops = None if gamma_embed is None or gamma_embed == gamma else LRPOps(
            method="attnlrp", attention=attention, gamma=gamma_embed, epsilon=epsilon)
        super().__init__(model, ops, at, embed_ops)
        self.attention, self.gamma, self.epsilon = attention, float(gamma), float(epsilon)
        self.gamma_embed = float(gamma if gamma_embed is None else gamma_embed)
