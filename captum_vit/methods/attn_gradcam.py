"""Grad-CAM on the last attention map (Chefer et al.'s "Grad-CAM" baseline)."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor

from captum_vit._base import (
    accumulation_dtype,
    gradients_with_pool,
    readout_rows,
    resolve_target,
    target_scores,
)
from captum_vit.methods._front import HeadsAttribution
from captum_vit.methods.table import register_method


@register_method("attn_gradcam", kind="gradient_attention")
class AttnGradCAM(HeadsAttribution):
    r"""Grad-CAM for ViTs: head weights :math:`w_h = \mathrm{mean}_{j \in patches}
    \nabla A^h[r, j]` of the last block, map
    :math:`m = \mathrm{ReLU}(\mathrm{mean}_h\, w_h A^h[r, :])`. With an attention-pool
    head (``global_pool='map'``) it runs on the pool's attention :math:`A_p` instead of
    the last block.

    Per-head maps (``attribute(..., heads="all")``, our choice): head :math:`h`'s term of
    the head mean before the ReLU, :math:`m_h = w_h A^h[r, :]` (signed: a head with a
    negative weight gives a negative map), so that
    :math:`\mathrm{ReLU}(\mathrm{mean}_h m_h)` is the map of ``heads="mean"``. A ReLU per
    head would zero every negatively weighted head and its mean would not be the map.

    Layer-local: composed with :class:`~captum_vit.combinators.PLUS` / ``SkipPLUS`` it
    runs at every block ``l`` with the model's own gradients.

    Args:
        model (torch.nn.Module): a supported Vision Transformer.
    """

    linear_in_read_gradient = True  # one forward; the score's gradients only (ViTFront)

    pools_queries = True  # the last block read through Stages (pooled query rows)

    layer_local = True
    """PLUS evaluates it on a one-block window: the map at block ``l``."""
    per_head = True
    """``attribute`` takes ``heads="all"``: one map per head."""
    examples_doc = """
        >>> from captum_vit import AttnGradCAM
        >>> attr = AttnGradCAM(model).attribute(images, target=3, output="grid")
        >>> per_head = AttnGradCAM(model).attribute(images, target=3, heads="all")
    """

    def _token_maps(self, inputs: Tensor, target: Tensor | None, *, score: str = "logit",
                    **_: Any) -> Tensor:
        return self._head_maps(inputs, target, score=score).mean(1).clamp(min=0)

    def _head_maps(self, inputs: Tensor, target: Tensor | None, *, score: str = "logit",
                   **_: Any) -> Tensor:
        """The per-head terms :math:`w_h A^h[r, :]` [B, H, N] (before mean and ReLU)."""
        tr = self.adapter.trace(inputs, grad=True)
        t = resolve_target(target, tr.require_logits())
        attn = tr.blocks[-1].require_attn()
        scores = target_scores(tr.require_logits(), t, score, self.adapter.probability)
        (grad,), pool_grad = gradients_with_pool(tr, scores, [attn])
        dt = accumulation_dtype(attn)
        k = tr.layout.num_prefix
        with torch.no_grad():
            if pool_grad is not None:  # an attention-pool head: run on A_p
                pool_attn = cast(Tensor, tr.pool_attn)  # a pool head's trace has them
                g_r, a_r = pool_grad[:, :, 0].to(dt), pool_attn.detach()[:, :, 0].to(dt)
            else:
                w = readout_rows(tr, dtype=dt, target=t)
                last = self.adapter.num_blocks - 1
                w = self.adapter.stages.carry_down(w, last)
                g_r = self.adapter.stages.token_mix(w, grad.to(dt), last)  # [B, H, N]
                a_r = self.adapter.stages.token_mix(w, attn.detach().to(dt), last)
            w = g_r[..., k:].mean(-1, keepdim=True)
            return w * a_r
