"""Method names shared by the CLI, the evaluation suite and the tutorials.

Names are snake_case; compositions are written ``plus:<name>`` / ``skipplus:<name>`` and
Captum's own methods ``captum:<ClassName>`` (e.g. ``captum:IntegratedGradients``).
"""

from __future__ import annotations

from collections.abc import Callable

from captum.attr import Attribution
from torch import nn

from captum_vit.combinators import PLUS, FullGradPlus, SkipPLUS
from captum_vit.methods import (
    GAE,
    TIS,
    AttCAT,
    AttIxG,
    AttnGradCAM,
    DecompX,
    RawAttention,
    Rollout,
    TokenIxG,
    TokenTM,
)

METHODS: dict[str, Callable[[nn.Module], Attribution]] = {
    "raw_attention": RawAttention,
    "rollout": Rollout,
    "gae": GAE,
    "attn_gradcam": AttnGradCAM,
    "attcat": AttCAT,
    "tokentm": TokenTM,
    "tokentm_residual": lambda m: TokenTM(m, variant="residual"),
    "token_ixg": TokenIxG,
    "att_ixg": AttIxG,
    "decompx": DecompX,
    "tis": TIS,
    "fullgrad_plus": FullGradPlus,
    "skip_fullgrad_plus": lambda m: FullGradPlus(m, skip=True),
}
COMBINATORS = {"plus:": PLUS, "skipplus:": SkipPLUS}


def available_methods() -> list[str]:
    """Names accepted by :func:`build_method` (without the ``captum:`` form)."""
    return list(METHODS)


def build_method(name: str, model: nn.Module) -> Attribution:
    """Instantiate the method called ``name`` for ``model``.

    Args:
        name (str): a name from :func:`available_methods`, or ``captum:<ClassName>``
            for any attribution class of ``captum.attr`` taking the model as its only
            constructor argument.
        model (torch.nn.Module): the model to explain.

    Returns:
        Attribution: the method instance.

    Raises:
        ValueError: for an unknown name (the message lists the known ones).

    Examples::

        >>> from captum_vit.registry import build_method
        >>> gae = build_method("gae", model)
        >>> ig = build_method("captum:IntegratedGradients", model)
    """
    if not isinstance(name, str):
        raise TypeError(f"method name must be a str, got {type(name).__name__}")
    if name.startswith("captum:"):
        import captum.attr

        cls = getattr(captum.attr, name.split(":", 1)[1], None)
        if not (isinstance(cls, type) and issubclass(cls, Attribution)):
            raise ValueError(f"unknown Captum attribution class in {name!r}; use a class name "
                             "from captum.attr such as 'captum:IntegratedGradients'")
        return cls(model)
    for prefix, combinator in COMBINATORS.items():
        if name.startswith(prefix):
            base = name[len(prefix):]
            if base.startswith("captum:"):
                import captum.attr

                base = getattr(captum.attr, base.split(":", 1)[1], None)
            return combinator(model, base)
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}, "
                         "'plus:<name>', 'skipplus:<name>' or 'captum:<ClassName>'")
    return METHODS[name](model)
