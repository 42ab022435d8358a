"""The Captum front shared by every method (DESIGN.md §3).

A method implements ``_token_maps(inputs, target, **kwargs) -> [B, N]`` on top of the
adapter; this module validates the inputs and target, resolves ``target=None`` to the
predicted class, and formats the patch scores as pixels, a grid or tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from captum.attr import GradientAttribution, PerturbationAttribution
from torch import Tensor, nn

from captum_vit.adapters import Layout, ViTAdapter, adapt

OUTPUTS = ("pixels", "grid", "tokens")
SCORES = ("logit", "probability")
TargetLike = int | Sequence[int] | Tensor | None


def check_choice(name: str, value: Any, choices: Sequence[str]) -> str:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is one of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def check_images(inputs: Any) -> tuple[Tensor, bool]:
    """Validate a batch of images; accept a tensor or a 1-tuple (Captum style).

    Returns:
        (images, was_tuple)
    """
    was_tuple = isinstance(inputs, tuple)
    if was_tuple:
        if len(inputs) != 1:
            raise ValueError(f"inputs must be one tensor (or a 1-tuple), got a {len(inputs)}-tuple")
        inputs = inputs[0]
    if not isinstance(inputs, Tensor):
        raise TypeError(f"inputs must be a torch.Tensor [B, C, H, W], got {type(inputs).__name__}")
    if inputs.dim() != 4:
        hint = " (add a batch dimension with inputs.unsqueeze(0))" if inputs.dim() == 3 else ""
        raise ValueError(f"inputs must have shape [B, C, H, W], got {tuple(inputs.shape)}{hint}")
    if not torch.is_floating_point(inputs):
        raise TypeError(f"inputs must be a floating-point tensor, got {inputs.dtype} "
                        "(convert with inputs.float())")
    if inputs.shape[0] == 0:
        raise ValueError("inputs is an empty batch")
    if not torch.isfinite(inputs).all():
        raise ValueError("inputs contain NaN or infinite values")
    return inputs, was_tuple


def check_target(target: TargetLike, batch: int, num_classes: int) -> Tensor | None:
    """Validate Captum's ``target`` and return it as a [B] int64 tensor (None stays None)."""
    if target is None:
        return None
    if isinstance(target, bool):
        raise TypeError("target must be an int, a list of ints or an integer tensor, got bool")
    if isinstance(target, int):
        t = torch.full((batch,), target, dtype=torch.long)
    elif isinstance(target, Tensor):
        if torch.is_floating_point(target) or target.dtype == torch.bool or target.is_complex():
            raise TypeError(f"target tensor must have an integer dtype, got {target.dtype}")
        if target.dim() > 1:
            raise ValueError(f"target must be 0-d or 1-D, got shape {tuple(target.shape)}")
        t = target.reshape(-1).long().cpu()
        if t.numel() == 1:
            t = t.expand(batch)
    elif isinstance(target, list | tuple):
        if not all(isinstance(c, int) and not isinstance(c, bool) for c in target):
            raise TypeError("target list must contain Python ints (one class index per "
                            "example); tuples for multi-dimensional outputs are not supported")
        t = torch.tensor(list(target), dtype=torch.long)
    else:
        raise TypeError(f"target must be an int, a list of ints, an integer tensor or None, "
                        f"got {type(target).__name__}")
    if t.numel() != batch:
        raise ValueError(f"target has {t.numel()} entries but the batch has {batch} images; "
                         "give one class per image or a single int")
    if ((t < 0) | (t >= num_classes)).any():
        raise ValueError(f"target values must be in [0, {num_classes}), got {t.tolist()}")
    return t.contiguous()


def resolve_target(target: Tensor | None, logits: Tensor) -> Tensor:
    """``None`` -> the predicted class of each image (unlike Captum, see the docs)."""
    if target is None:
        return logits.detach().argmax(-1)
    return target.to(logits.device)


def target_scores(logits: Tensor, target: Tensor, score: str = "logit") -> Tensor:
    """Per-image score ``s_c`` [B]: the target logit or its softmax probability."""
    if score == "probability":
        logits = logits.softmax(-1)
    return logits.gather(1, target[:, None]).squeeze(1)


def gradients(scores: Tensor, tensors: Sequence[Tensor]) -> list[Tensor]:
    """``d s_c / d T`` for every tensor T from ONE backward pass of ``sum_b s_c(b)``.

    Images do not interact in a ViT, so summing over the batch gives per-image gradients.
    """
    return list(torch.autograd.grad(scores.sum(), list(tensors)))


def format_output(tokens: Tensor, layout: Layout, images: Tensor, output: str) -> Tensor:
    """Patch scores [B, P] -> tokens, a grid [B, 1, gh, gw] or pixels shaped like the images."""
    if output == "tokens":
        return tokens
    gh, gw = layout.grid
    grid = tokens.reshape(tokens.shape[0], 1, gh, gw)
    if output == "grid":
        return grid
    ph, pw = layout.patch_size
    h, w = images.shape[-2:]
    pix = grid.repeat_interleave(ph, dim=2).repeat_interleave(pw, dim=3)[..., :h, :w]
    return pix.expand(-1, images.shape[1], -1, -1).contiguous()


def accumulation_dtype(t: Tensor) -> torch.dtype:
    """float32 for half/bfloat16 tensors (maps accumulate products), else the dtype itself."""
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype


class _ViTFront:
    """Input/target/output handling shared by gradient and perturbation methods."""

    adapter: ViTAdapter

    def _init_adapter(self, model: nn.Module) -> None:
        self.adapter = adapt(model)
        self.model = model

    @property
    def num_classes(self) -> int:
        return int(self.adapter.head.heads[0][1].shape[0])

    def _attribute(self, inputs: Any, target: TargetLike, output: str,
                   **kwargs: Any) -> Tensor | tuple[Tensor]:
        images, was_tuple = check_images(inputs)
        check_choice("output", output, OUTPUTS)
        t = check_target(target, images.shape[0], self.num_classes)
        self.adapter.check_inputs(images)
        self.adapter.self_check(images)
        layout = self.adapter.layout(images)
        with torch.enable_grad():  # Captum's NoiseTunnel / sensitivity_max may call under no_grad
            maps = self._token_maps(images, t, **kwargs).detach()
        maps = maps.to(accumulation_dtype(images))
        out = format_output(maps[:, layout.num_prefix:], layout, images, output)
        return (out,) if was_tuple else out

    def _token_maps(self, inputs: Tensor, target: Tensor | None, **kwargs: Any) -> Tensor:
        raise NotImplementedError  # pragma: no cover


class ViTGradientAttribution(_ViTFront, GradientAttribution):
    """Base of the gradient- and attention-based ViT methods."""

    def __init__(self, model: nn.Module) -> None:
        self._init_adapter(model)
        GradientAttribution.__init__(self, model)

    @property
    def multiplies_by_inputs(self) -> bool:
        return False


class ViTPerturbationAttribution(_ViTFront, PerturbationAttribution):
    """Base of the perturbation-based ViT methods."""

    def __init__(self, model: nn.Module) -> None:
        self._init_adapter(model)
        PerturbationAttribution.__init__(self, model)

    @property
    def multiplies_by_inputs(self) -> bool:
        return False


def readout(layout: Layout, rows: Tensor) -> Tensor:
    """The readout row ``r`` of a per-token matrix [..., N, M] (SPEC §0) -> [..., M].

    Row 0 for class-token and distilled models, the mean of the patch rows for
    average-pooled models.
    """
    w = layout.readout_weights(rows.shape[-2], dtype=rows.dtype, device=rows.device)
    return torch.einsum("n,...nm->...m", w, rows)


def check_layer(name: str, value: Any, num_blocks: int, *, allow_end: bool = False) -> int:
    """Validate a block index in ``[0, L)`` (``[0, L]`` with ``allow_end``)."""
    hi = num_blocks + 1 if allow_end else num_blocks
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= value < hi:
        raise ValueError(f"{name} must be in [0, {hi - 1}] for this {num_blocks}-block "
                         f"model, got {value}")
    return value
