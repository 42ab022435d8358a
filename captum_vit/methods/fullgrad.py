r"""FullGrad+ (Eq. 5-6 of SkipPLUS, Mehri et al., CVPRW 2024): the token Input x Gradient of
every included block input plus the bias-gradient maps of every bias in those blocks, all
from one backward pass.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any, cast

import torch
from torch import Tensor, nn

from captum_vit._base import (
    accumulation_dtype,
    check_layers,
    gradients,
    resolve_target,
    target_scores,
)
from captum_vit.adapters import BlockParts, NormParts, Ops, PoolParts
from captum_vit.methods._engines import skip_start
from captum_vit.methods._front import ScoredAttribution
from captum_vit.methods.table import register_method


class _BiasProbeOps(Ops):
    """Plain forward that adds a zero "probe" ``[B, N, C]`` to the output of every
    biased linear map and LayerNorm while ``active``; ``d s / d probe`` is the gradient
    at that op's output, so ``sum_c bias_c * grad[..., c]`` is its bias-gradient map."""

    def __init__(self) -> None:
        super().__init__(linearize=False)
        self.active = False
        self.probes: list[tuple[Tensor, Tensor]] = []  # (bias, probe)

    def _probe(self, out: Tensor, bias: Tensor | None) -> Tensor:
        if not self.active or bias is None or out.dim() != 3:
            return out  # post-pooling ops ([B, C]) have no token axis
        probe = torch.zeros_like(out, requires_grad=True)
        self.probes.append((bias, probe))
        return out + probe

    def norm(self, x: Tensor, p: NormParts) -> Tensor:
        return self._probe(super().norm(x, p), p.bias)

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return self._probe(super().linear(x, weight, bias), bias)

    def add_constant(self, x: Tensor, c: Tensor) -> Tensor:
        # a per-token bias of the residual stream (YOLOS's mid position embeddings)
        return self._probe(super().add_constant(x, c), c)

    def attention(self, u: Tensor, p: BlockParts) -> tuple[Tensor, Tensor | None]:
        if not self.active:
            return super().attention(u, p)
        b, n, _ = u.shape
        probed = {}
        for name in ("q_bias", "k_bias", "v_bias"):  # each bias counted once
            bias = getattr(p, name)
            if bias is not None:  # the probe enters the q/k/v output via its bias
                probe = torch.zeros((b, n, bias.shape[0]), dtype=u.dtype, device=u.device,
                                    requires_grad=True)
                self.probes.append((bias, probe))
                # windowed blocks (Swin): the per-token probe in the windows' layout
                probed[name] = bias + (probe if p.window is None else p.window.partition(probe))
        return super().attention(u, replace(p, **probed))


    def pool_attention(self, x: Tensor, p: PoolParts) -> tuple[Tensor, Tensor | None]:
        self.active = False  # an attention-pool head's outputs have no token axis
        return super().pool_attention(x, p)


@register_method("fullgrad_plus", kind="gradient", composable=False,
                 variants={"skip_fullgrad_plus": {"skip": True}})
class FullGradPlus(ScoredAttribution):
    r"""FullGrad+ (Eq. 5-6 of SkipPLUS): the token IxG maps of the included blocks plus
    the bias-gradient maps of every bias in them,

    .. math::
        m = \sum_{l \in \mathcal{L}} \sum_d x_l \odot \nabla x_l
          + \sum_{l \in \mathcal{L}} \sum_{b \in B_l} \sum_c b_c\, \nabla o_b[:, c]

    where :math:`o_b` is the output of the op owning bias :math:`b`; the biases of a
    block are qkv, output projection, fc1, fc2 and the LayerNorm shifts
    :math:`\beta` of norm1 and norm2, each counted once. All gradients come from one
    backward pass. ``skip=True`` sums blocks :math:`\lceil L/2 \rceil .. L-1` (SkipPLUS).

    The patch-embedding bias is already inside :math:`x_0` (covered by IxG at block 0)
    and the shifts of qk-norm LayerNorms act inside the attention logits; neither is
    counted. Biases after the last block belong to no block; with
    ``head_biases=True`` the final LayerNorm's :math:`\beta` (which has a token axis)
    is added too. The ``fc_norm`` shift and the classifier bias act after pooling, have
    no token position and never count.

    Args:
        model (torch.nn.Module): a supported Vision Transformer.
        skip (bool, optional): SkipPLUS layer range instead of all blocks. Default False.
        layers (iterable of int, optional): overrides the summed blocks.
        head_biases (bool, optional): also count the final norm's shift. Default False.
    """

    pools_queries = True  # runs through query pooling (Hiera): the forward's own maths

    sums_subnetworks = True

    def __init__(self, model: nn.Module, skip: bool = False, *,
                 layers: Iterable[int] | None = None, head_biases: bool = False) -> None:
        super().__init__(model)
        L = self.adapter.num_blocks
        if layers is None:
            layers = range(skip_start(L) if skip else 0, L)
        self.layers = check_layers(layers, L)
        self.skip = bool(skip)
        self.head_biases = bool(head_biases)

    returns_doc = r"""the signed FullGrad+ map in the requested ``output`` format."""
    examples_doc = r"""
        >>> from captum_vit import FullGradPlus
        >>> attr = FullGradPlus(model, skip=True).attribute(images, target=labels)
    """

    def _token_maps(self, inputs: Tensor, target: Tensor | None, *, score: str = "logit",
                    **_: Any) -> Tensor:
        ops = _BiasProbeOps()
        with torch.enable_grad():
            x = self.adapter.embed(inputs).detach().requires_grad_()
            states = []
            for l in range(self.adapter.num_blocks):
                states.append(x)
                ops.active = l in self.layers
                x = self.adapter.block(x, l, ops)
            ops.active = self.head_biases
            logits = self.adapter.logits(x, ops)
            t = resolve_target(target, logits)
            xs = [states[l] for l in self.layers]
            probes = [p for _, p in ops.probes]
            grads = gradients(target_scores(logits, t, score, self.adapter.probability),
                              xs + probes)
        dt = accumulation_dtype(inputs)
        st = self.adapter.stages  # stages (Swin): every term shared onto the first grid
        with torch.no_grad():
            m = cast(Tensor, sum(st.carry((x.detach().to(dt) * g.to(dt)).sum(-1), l, split=True)
                    for l, x, g in zip(self.layers, xs, grads[:len(xs)], strict=True)))
            for (bias, _probe), g in zip(ops.probes, grads[len(xs):], strict=True):
                m = m + st.carry((g.to(dt) * bias.detach().to(dt)).sum(-1), split=True)
        return m
