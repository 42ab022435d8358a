r"""LeGrad (Bousselham et al., ICCV 2025; WalBouss/LeGrad, MIT).

For every block ``l`` in ``layers`` the model's own readout is applied to the block's
output :math:`z^l = x_{l+1}`, giving a score :math:`s^l`; the explanation signal is the
gradient of that score w.r.t. the attention the readout sees last:

- self-attention readouts (class token, average pooling, ...):
  :math:`G^l = \partial s^l / \partial A^l`, block ``l``'s own attention;
- attention-pool heads (``global_pool='map'``, SigLIP):
  :math:`G^l = \partial s^l / \partial A_p^{(l)}`, the pool's attention computed on
  :math:`z^l`.

:math:`\hat E^l[j] = \mathrm{mean}_h \mathrm{mean}_i \mathrm{ReLU}(G^l_h)[i, j]` (all
query rows; the pool's first latent query) and :math:`E = \sum_l \hat E^l`, prefix
columns dropped.

Batched over blocks: the trace runs with ``cut_blocks=True`` (every block takes a
detached copy of the previous block's output, values unchanged), so :math:`A^l` reaches
:math:`s^{l'}` only for :math:`l' = l` and ONE backward of :math:`\sum_l s^l` gives every
:math:`G^l` exactly (without the cut, :math:`A^l` would also receive the gradients of
the later blocks' scores).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
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
    check_layers,
    check_scalar,
    resolve_target,
    target_scores,
)
from captum_vit.adapters import Ops, TargetHead, Trace
from captum_vit.methods._engines import PLUSFastPath
from captum_vit.methods._front import fill_doc, plus_doc
from captum_vit.methods.table import register_method
from captum_vit.targets import embedding_target

READOUTS = ("model", "mean")
"""Per-layer readouts: the model's own, or the mean of all tokens (LeGrad's CLIP code)."""


def min_max(maps: Tensor, num_prefix: int) -> Tensor:
    """Per-image min–max normalisation of token maps [..., N] over the patch columns
    (the prefix columns become 0; a constant map becomes 0)."""
    patches = maps[..., num_prefix:]
    lo = patches.amin(-1, keepdim=True)
    span = (patches.amax(-1, keepdim=True) - lo).clamp_min(torch.finfo(maps.dtype).tiny)
    out = torch.zeros_like(maps)
    out[..., num_prefix:] = (patches - lo) / span
    return out


@register_method("legrad", kind="gradient_attention")
class LeGrad(PLUSFastPath, ViTGradientAttribution):
    r"""LeGrad: the gradient of every layer's own readout w.r.t. that layer's attention
    (Bousselham et al., "LeGrad: An Explainability Method for Vision Transformers via
    Feature Formation Sensitivity", ICCV 2025).

    For each block ``l`` in ``layers``, :math:`s^l` is the model's readout (final norm,
    pooling, ``fc_norm``, head; for an embedding model the similarity to the target
    vector) applied to the block's output tokens :math:`z^l = x_{l+1}`, and

    .. math::
        \hat E^l[j] = \mathrm{mean}_h\, \mathrm{mean}_i\,
            \mathrm{ReLU}\Big(\frac{\partial s^l}{\partial A^l_h}\Big)[i, j],
        \qquad E = \sum_{l} \hat E^l,

    with :math:`A^l` block ``l``'s attention probabilities (mean over all N query rows).
    For an attention-pool head (``global_pool='map'``, SigLIP) the gradient is taken w.r.t.
    the pool's attention computed on :math:`z^l` (its first latent query row; the block
    attentions are not used), as the authors' SigLIP code. Prefix columns (class,
    distillation, register tokens) are dropped.

    Choices (ours, where the paper and the authors' code leave room):

    - **Layers.** ``layers=None`` (default) uses every block: the paper's method
      "aggregates the signal over all layers". The authors' wrapper (``LeWrapper``,
      ``layer_index=-2``, also in their demo ``app.py``) uses only the last two blocks;
      pass ``layers=range(L - 2, L)`` for it. Which of the two the paper's tables use
      was **not verified** (only the abstract and introduction of the paper could be
      read here). On a model made of stages (Swin) the readout reads the last stage's
      grid and width only, so ``layers=None`` is that stage's blocks and earlier blocks
      are refused; a windowed block's mean over the query rows is taken window by window.
      With query pooling (Hiera) the last stage starts with its pooling block, whose
      output already has the readout's grid and width: its term is the mean over its
      ``N/4`` pooled query rows, on its input grid, and the later blocks' terms are
      copied to their children on that grid before the sum (our choice, as a map is
      upsampled).
    - **Sum, not mean.** The raw sum :math:`E` (the paper averages over layers: same
      ranking); ``normalize=True`` min–max normalises each image's map as the paper.
    - **Readout.** ``readout="model"`` (default) is the model's own readout of
      :math:`z^l`. ``readout="mean"`` is the authors' CLIP code: the mean of all N tokens
      (class token included), then the final norm and the head / projection,
      :math:`\mathrm{LN}_{post}(\mathrm{mean}_i z^l_i) W_{proj}`; the block's attention
      is then used for every model, an attention pool included.
    - **Final norm.** The authors' SigLIP code feeds :math:`z^l` to the attention pool
      without the final norm; captum_vit applies the model's final norm
      (``skip_final_norm=True`` leaves it out, for parity).
    - **SigLIP correction.** Only when ``null_target`` is given to :meth:`attribute`:
      the map :math:`E_0` of a "null" target vector (the authors embed the prompt
      "a photo of a") is min–max normalised per image and :math:`E` is set to 0 where it
      exceeds ``null_threshold`` (0.8).

    Score: the target logit (or, with ``score="probability"``, its softmax probability) of
    each layer's readout; for embedding models the similarity to the target vector
    (:mod:`captum_vit.targets`). Cost: one forward, one backward (stopping at every block's
    input), plus one readout per included block (for an attention-pool head, one pool
    attention per block); a ``null_target`` adds one more backward.

    PLUS / SkipPLUS (:mod:`captum_vit.combinators`): LeGrad on the sub-network :math:`f_l`
    (blocks ``l .. L-1``) is :math:`\sum_{k \geq l} \hat E^k` (each term reads block ``k``
    and the readout only, so it is not layer-local); :meth:`plus_maps` gives every
    sub-network's map from one backward.

    Args:
        model (torch.nn.Module): a supported Vision Transformer (or embedding model).
        layers (iterable of int, optional): the blocks summed, indices in ``[0, L-1]``;
            default all.
        readout (str, optional): ``"model"`` (default) or ``"mean"`` (see above).
        skip_final_norm (bool, optional): leave the final norm out of every layer's
            readout. Default False.
        normalize (bool, optional): min–max normalise each image's map over its patches.
            Default False (raw sum).

    Examples::

        >>> from captum_vit import LeGrad
        >>> attr = LeGrad(model).attribute(images, target=labels)
        >>> last_two = LeGrad(model, layers=range(10, 12), normalize=True)
        >>> # CLIP vision tower against a text embedding, as the authors' code
        >>> clip_map = LeGrad(clip_vision, readout="mean").attribute(
        ...     pixel_values, target=text_embedding)
        >>> # SigLIP with the authors' correction (a null prompt's embedding)
        >>> siglip_map = LeGrad(siglip_vision, skip_final_norm=True).attribute(
        ...     pixel_values, target=text_embedding, null_target=null_embedding)
    """

    pools_queries = True  # the last stage from its pooling block on (Stages.received)

    def __init__(self, model: nn.Module, layers: Iterable[int] | None = None, *,
                 readout: str = "model", skip_final_norm: bool = False,
                 normalize: bool = False) -> None:
        self.readout = check_choice("readout", readout, READOUTS)
        self.skip_final_norm = check_scalar(skip_final_norm, "skip_final_norm", bool)
        self.normalize = check_scalar(normalize, "normalize", bool)
        super().__init__(model)
        self.layers = None if layers is None else check_layers(layers,
                                                                self.adapter.num_blocks)

    @log_usage()
    @fill_doc
    def attribute(self, inputs: Tensor, target: TargetLike = None, *, score: str = "logit",
                  null_target: Any = None, null_threshold: float = 0.8,
                  output: str = "pixels") -> Tensor:
        r"""
        Args:
            {inputs}
            target (int, list, Tensor, optional): class per image; ``None`` explains the
                predicted class (the model's own output). For embedding models a target
                vector (:mod:`captum_vit.targets`).
            score (str, optional): ``"logit"`` (default) or ``"probability"``, of each
                layer's readout.
            null_target (Tensor or EmbeddingTarget, optional): embedding models only: a
                "null" target vector ``[D′]`` (or one per image ``[B, D′]``) for the
                authors' SigLIP correction (see the class docstring). Default None: no
                correction.
            null_threshold (float, optional): the correction's threshold on the null
                map, in ``[0, 1]``. Default 0.8.
            {output}

        Returns:
            Tensor: the map (non-negative; in ``[0, 1]`` with ``normalize=True``) in the
            requested ``output`` format.

        Examples::

            >>> from captum_vit import LeGrad
            >>> attr = LeGrad(model).attribute(images, target=3, output="grid")
        """
        check_choice("score", score, SCORES)
        check_scalar(null_threshold, "null_threshold", float, min_val=0.0, max_val=1.0)
        return self._attribute(inputs, target, output, score=score, null_target=null_target,
                               null_threshold=null_threshold)

    @plus_doc("legrad")
    # takes this method's own options, not any keyword (PLUSFastPath.plus_maps)
    def plus_maps(self, inputs: Tensor, target: Tensor | None, layers: Sequence[int], *,  # type: ignore[override]
                  aggregate: str = "subnetwork", score: str = "logit", null_target: Any = None,
                  null_threshold: float = 0.8) -> Tensor:
        r"""LeGrad of every sub-network :math:`f_l`, ``l`` in ``layers``, from one
        forward and one backward, [len(layers), B, N] (PLUS / SkipPLUS fast path,
        :mod:`captum_vit.combinators`).

        The sub-network's block ``j`` is the model's block ``l + j``, so its map is
        :math:`\sum_{j} \hat E^{l+j}` over its own ``layers`` (all: every block
        :math:`\geq l`); the null correction and ``normalize`` act on each sum.

        Args:
            {plus_args}
            aggregate (str): ``"subnetwork"`` only.
            score, null_target, null_threshold: as for :meth:`attribute`.

        {plus_returns}
        """
        self.check_plus_options(aggregate, score)
        check_scalar(null_threshold, "null_threshold", float, min_val=0.0, max_val=1.0)
        L = self.adapter.num_blocks
        # stages (Swin): the readout reads the last stage's tokens only
        top = self._last_stage()
        if self.layers is not None and self.layers[0] + min(layers) < top:
            raise ValueError(f"layers={list(self.layers)}: LeGrad applies the model's readout "
                             f"to each block's output, which on this model has the readout's "
                             f"grid and width only from block {top} on (its last stage); "
                             f"use layers in [{top}, {L - 1}]")
        sums: list[list[int]] = []
        for l in layers:
            if self.layers is None:
                sums.append(list(range(max(l, top), L)))
                continue
            if l + self.layers[-1] >= L:  # what LeGrad built on the sub-network says
                raise ValueError(f"layers={list(self.layers)} from start block {l} pass the "
                                 f"last block ({L - 1}): the {L - l}-block sub-network has "
                                 f"blocks [0, {L - l - 1}]; use smaller layers")
            sums.append([l + j for j in self.layers])
        blocks = sorted({k for s in sums for k in s})
        if not blocks:  # a target reading an earlier stage's output (SAM 2's mask decoder)
            raise ValueError(f"LeGrad applies the model's readout to block outputs from block "
                             f"{top} on (the last stage's grid and width), but the score "
                             f"reads the output of block {L - 1}, before it: use a method "
                             "that chains token maps (GAE, Rollout, TokenTM) or a gradient "
                             "(TokenIxG, DecompX)")
        null = self._null_head(null_target, inputs)
        per, per_null = self.block_maps(inputs, target, blocks, score=score, null=null)
        k = self.adapter.num_prefix
        with torch.no_grad():
            maps = []
            for s in sums:
                m = cast(Tensor, sum(per[i] for i in s))  # s is never empty
                if per_null is not None:
                    m = m.masked_fill(min_max(cast(Tensor, sum(per_null[i] for i in s)), k)
                                      > null_threshold, 0.0)
                maps.append(min_max(m, k) if self.normalize else m)
            return torch.stack(maps)

    def _last_stage(self) -> int:
        """The first block whose output the readout can read: 0, or for a model with
        stages (Swin) the first block after the last patch merge."""
        # a merge ends its block's stage; a query pooling (Hiera) starts its block's
        ends = [l + 1 if b.merge is not None else l for l, b in enumerate(self.adapter.blocks)
                if b.regrid is not None]
        return ends[-1] if ends else 0

    def _null_head(self, null_target: Any, inputs: Tensor
                   ) -> tuple[TargetHead, Tensor] | None:
        """The null target as a scoring head and one vector index per image."""
        if null_target is None:
            return None
        head = self.adapter.head.target
        if head is None:
            raise ValueError("null_target (LeGrad's SigLIP correction) is for models that "
                             "output an image embedding, explained against target vectors; "
                             f"this {type(self.adapter.model).__name__} is a classifier: "
                             "leave null_target=None")
        if not isinstance(head, TargetHead):
            raise TypeError(f"null_target cannot be combined with the {type(head).__name__} "
                            "in force; leave null_target=None")
        b = inputs.shape[0]
        null, index = embedding_target(null_target, b, head.vectors.shape[-1], inputs)
        if index is None:
            raise ValueError("null_target must be one vector [D′] or one per image [B, D′] "
                             "(an EmbeddingTarget with index='predicted' is not a null "
                             "target)")
        return null, index.to(inputs.device)

    def block_maps(self, inputs: Tensor, target: Tensor | None, blocks: Sequence[int], *,
                   score: str = "logit", null: tuple[TargetHead, Tensor] | None = None
                   ) -> tuple[dict[int, Tensor], dict[int, Tensor] | None]:
        r"""The per-block terms :math:`\hat E^l` [B, N] of the blocks in ``blocks`` (and
        those of the null target), from one forward and one backward (two with
        ``null``).

        Args:
            inputs (Tensor): validated images [B, C, H, W].
            target (Tensor or None): class per image; ``None`` = predicted.
            blocks (sequence of int): block indices in ``[0, L-1]``.
            score (str): ``"logit"`` or ``"probability"``.
            null (tuple, optional): ``(TargetHead, index [B])`` of the null target.

        Returns:
            ``({l: Ê^l}, {l: Ê_0^l} or None)``, token maps with zero prefix columns.
        """
        adapter = self.adapter
        with torch.enable_grad():  # also under Captum's no_grad (NoiseTunnel)
            tr = adapter.trace(inputs, grad=True, cut_blocks=True)
            t = resolve_target(target, tr.require_logits())
            # G w.r.t. the pool's attention when the readout runs through an attention pool
            pooled = self.readout == "model" and adapter.head.attn_pool is not None
            options: dict[str, Any] = {"final_norm": not self.skip_final_norm,
                                       "pool": self.readout}
            ops = Ops()

            def layer(z: Tensor, head: tuple[TargetHead, Tensor] | None
                      ) -> tuple[Tensor, Tensor | None]:
                rec = Trace(tr.layout, tr.x0)
                if head is None:
                    return target_scores(adapter.readout_logits(z, ops, rec, **options), t,
                                         score, adapter.probability), rec.pool_attn
                with adapter.targeting(head[0]):
                    s = target_scores(adapter.readout_logits(z, ops, rec, **options),
                                      head[1], "logit")
                return s, rec.pool_attn

            terms: list[tuple[tuple[TargetHead, Tensor] | None, dict[int, Tensor]]] = [
                (None, {}), *([(null, {})] if null is not None else [])]
            for i, (head, out) in enumerate(terms):
                scores: list[Tensor] = []
                attns: list[Tensor] = []
                for l in blocks:
                    s, pool_attn = layer(tr.blocks[l].out, head)
                    scores.append(s)
                    attns.append(cast(Tensor, pool_attn) if pooled  # a pool head's
                                 else tr.blocks[l].require_attn())
                grads = torch.autograd.grad(torch.stack(scores).sum(), attns,
                                            retain_graph=i + 1 < len(terms))
                dt = accumulation_dtype(attns[0])
                with torch.no_grad():
                    for l, g in zip(blocks, grads, strict=True):
                        e = g.to(dt).clamp(min=0).mean(1)  # heads
                        win = adapter.stages.window(l)
                        if pooled:  # the pool's latent row
                            e = e[:, 0]
                        elif win is None:  # the mean over the query rows
                            e = e.mean(1)
                        elif adapter.blocks[l].pool is None:
                            # windowed (Swin): the same mean, window by window
                            e = win.received(e[:, None])[:, 0]
                        else:  # query pooling (Hiera): the mean over the N/4 pooled rows
                            e = adapter.stages.received(e[:, None], l)[:, 0]
                        e[:, :adapter.num_prefix] = 0.0
                        # on the grid of the first block the readout reads (a pooling
                        # block's keys: its input grid), each value copied to its children
                        out[l] = adapter.stages.carry(e, l, down_to=self._last_stage())
        return terms[0][1], (terms[1][1] if null is not None else None)
