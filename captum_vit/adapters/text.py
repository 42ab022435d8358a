r"""The text side of an image–text model (CLIP, SigLIP, OpenCLIP): what its family reads
of the text tower (:class:`TextTower`, built by ``hf_clip.text_tower`` and
``open_clip.text_tower``) and how a prompt's token embeddings are explained through it
(:func:`explained_text`): the model's own text forward, run with a leaf at the token
embedding's output and, for the LRP methods, their rule set put on the tower's own modules
by forward hooks, removed on exit.

The rules are those of :class:`~captum_vit.adapters.rules.LRPOps` (the image side's), in
the "relevance as gradient" form: each hook returns the module's own value through a
function whose backward is the rule's.

- LayerNorm: the LN rule (σ detached, the centring kept).
- Element-wise activations: the identity rule :math:`\tilde g_z = \tilde g_y\,
  \mathrm{act}(z)/z` (``act_rule="gradient"`` of CP-LRP: the true gradient).
- Attention: CP (``attention="cp"``): ``q`` and ``k`` detached, the probabilities
  constants; AttnLRP (``attention="attnlrp"``): the uniform rule, gradient × ¼ into ``q``
  and ``k``, × ½ into ``v`` (the softmax keeps its true Jacobian). The hooks sit on the q/k/v
  projections (Hugging Face) or on the inputs of a self-attention ``nn.MultiheadAttention``
  (OpenCLIP: a linear projection commutes with a scaled or cut gradient).
- Linear maps: the ε- or γ-rule of the method on every ``nn.Linear`` the tower *calls as a
  module*. ``nn.MultiheadAttention`` uses its packed in-projection and ``out_proj`` as
  functions, and OpenCLIP's ``text_projection`` is a parameter: these keep their true
  gradient (:math:`\varepsilon \to 0`), as LXT's γ on torchvision's attention does
  (:class:`~captum_vit.methods.AttnLRP`'s docstring).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch import Tensor, nn

from captum_vit.adapters.ops import activation_gate_detached, layer_norm_frozen_variance
from captum_vit.adapters.rules import LRPOps, lrp_linear, scale_gradient


@dataclasses.dataclass
class TextTower:
    """The modules of a text tower, by their role in the rules (read by its family).

    Attributes:
        embedding (nn.Module): the token embedding (an ``nn.Embedding``), called once per
            forward; its output ``[K, L, D]`` is what is explained.
        features (Callable): the model's own text forward on the tokenizer's inputs
            (``input_ids`` ... as a mapping) → text embeddings ``[K, D′]``, un-normalised.
        norms (list of nn.Module): the LayerNorms (one normalised dimension).
        acts (list of nn.Module): the MLPs' element-wise activations.
        qkv (list of tuple): ``(q_proj, k_proj, v_proj)`` of each attention with separate
            projections (``nn.Linear`` modules).
        attentions (list of nn.MultiheadAttention): self-attentions called as
            ``attn(x, x, x, ...)`` (packed in-projection).
        linears (list of nn.Linear): the linear maps called as modules.
        blockers (tuple of str): what the tower holds that the rules do not know (custom
            blocks); ``()`` when the rules apply. Input×gradient needs none of it.
    """

    embedding: nn.Module
    features: Callable[[Mapping[str, Tensor]], Tensor]
    norms: list[nn.LayerNorm] = dataclasses.field(default_factory=list)
    acts: list[nn.Module] = dataclasses.field(default_factory=list)
    qkv: list[tuple[nn.Module, nn.Module, nn.Module]] = dataclasses.field(
        default_factory=list)
    attentions: list[nn.MultiheadAttention] = dataclasses.field(default_factory=list)
    linears: list[nn.Linear] = dataclasses.field(default_factory=list)
    blockers: tuple[str, ...] = ()


class TokenLeaf:
    """The token embeddings of one text forward, a leaf that requires grad
    (:attr:`value`, ``[K, L, D]``), set by the embedding's hook."""

    def __init__(self) -> None:
        self.value: Tensor | None = None

    def hook(self, module: nn.Module, args: Any, out: Tensor) -> Tensor:
        if self.value is not None:
            raise RuntimeError("the text tower called its token embedding twice in one "
                               "forward; captum_vit explains one token embedding per prompt")
        self.value = out.detach().requires_grad_()
        return self.value


def _scaled(factor: float) -> Callable[[nn.Module, Any, Tensor], Tensor]:
    return lambda m, args, out: scale_gradient(out, factor)


def _detached(m: nn.Module, args: Any, out: Tensor) -> Tensor:
    return out.detach()


def _layer_norm(m: nn.LayerNorm, args: Any, out: Tensor) -> Tensor:
    return layer_norm_frozen_variance(args[0], m.weight, m.bias, m.eps).to(out.dtype)


def _identity_rule(m: nn.Module, args: Any, out: Tensor) -> Tensor:
    return activation_gate_detached(args[0], m.forward)  # forward: no hook recursion


def _linear_rule(gamma: float, epsilon: float) -> Callable[[nn.Linear, Any, Tensor], Tensor]:
    return lambda m, args, out: lrp_linear(args[0], m.weight, m.bias, gamma, epsilon)


def _attention_inputs(cp: bool) -> Callable[..., Any]:
    """A pre-hook on a self-attention ``attn(x, x, x, ...)``: q and k detached (CP) or the
    uniform rule's scaled gradients (AttnLRP) on its three inputs."""
    def pre(m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        if len(args) < 3:
            raise TypeError(f"{type(m).__name__} was not called as attn(query, key, value, "
                            "...); the text tower's attention rules need that call")
        q, k, v = args[:3]
        if cp:
            q, k = q.detach(), k.detach()
        else:
            q, k, v = scale_gradient(q, 0.25), scale_gradient(k, 0.25), scale_gradient(v, 0.5)
        return (q, k, v, *args[3:])

    return pre


def rule_problems(tower: TextTower, ops: LRPOps) -> str | None:
    """Why ``ops`` cannot run through ``tower`` (``None``: it can)."""
    if tower.blockers:
        return ", ".join(tower.blockers)
    bad = [type(m).__name__ for m in tower.norms
           if not isinstance(m, nn.LayerNorm) or len(m.normalized_shape) != 1]
    if bad:
        return f"norms {', '.join(sorted(set(bad)))} (the LN rule needs a LayerNorm)"
    return None


@contextlib.contextmanager
def explained_text(tower: TextTower, ops: LRPOps | None = None) -> Iterator[TokenLeaf]:
    """Within the block, the tower's forward puts a leaf at its token embeddings (the
    yielded :class:`TokenLeaf`) and, with ``ops``, runs the rule set's backward; the hooks
    are removed on exit, also when the block raises (the model is unchanged).

    Args:
        tower (TextTower): the text tower.
        ops (LRPOps, optional): the LRP method's rule set; ``None``: the true gradient
            (input×gradient).

    Yields:
        TokenLeaf: set by the next forward.

    Raises:
        TypeError: ``ops`` on a tower the rules do not know (:func:`rule_problems`).

    Examples::

        >>> with explained_text(tower, method.ops) as leaf:
        ...     t = tower.features(inputs)
        ...     (g,) = torch.autograd.grad(score(t).sum(), [leaf.value])
    """
    leaf = TokenLeaf()
    handles = [tower.embedding.register_forward_hook(leaf.hook)]
    try:
        if ops is not None:
            problem = rule_problems(tower, ops)
            if problem is not None:
                raise TypeError(f"text_relevance: the LRP rules do not reach this text "
                                f"tower ({problem}); explain the image with a gradient "
                                "method (its text side is input×gradient) or build the "
                                "target without text_relevance")
            if ops.gamma or ops.epsilon:  # first on each module: the others see its value
                rule = _linear_rule(ops.gamma, ops.epsilon)
                handles += [m.register_forward_hook(rule) for m in tower.linears]
            handles += [m.register_forward_hook(_layer_norm) for m in tower.norms]
            if not (ops.method == "cp" and ops.act_rule == "gradient"):
                handles += [m.register_forward_hook(_identity_rule) for m in tower.acts]
            cp = ops.attention_rule == "cp"
            for q, k, v in tower.qkv:
                hooks = (_detached, _detached, None) if cp else (
                    _scaled(0.25), _scaled(0.25), _scaled(0.5))
                handles += [m.register_forward_hook(h)
                            for m, h in zip((q, k, v), hooks, strict=True) if h is not None]
            handles += [m.register_forward_pre_hook(_attention_inputs(cp))
                        for m in tower.attentions]
        yield leaf
    finally:
        for h in handles:
            h.remove()


__all__ = ["TextTower", "TokenLeaf", "explained_text", "rule_problems"]
