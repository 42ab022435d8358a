"""A mask of the Segment Anything Model as the target of a map of its image encoder (the
model side: :mod:`captum_vit.adapters.families.sam`)."""

from __future__ import annotations

import textwrap
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from captum_vit.adapters import ModelTree
from captum_vit.adapters.families.sam import sam_mask_logits, sam_model
from captum_vit.adapters.scoring import Outputs, Target, per_image


def _floats(value: Any, name: str, last: int, rows: int) -> Tensor | None:
    """``value`` as a float tensor ``[B, ..., last]`` (``rows`` dimensions for one image
    gain a leading batch of 1); ``None`` stays ``None``."""
    if value is None:
        return None
    t = torch.as_tensor(value)
    if t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"{name} must hold pixel coordinates (real numbers), got {t.dtype}")
    t = t.to(torch.float64)
    if t.dim() == rows:
        t = t[None]
    if t.dim() != rows + 1 or t.shape[-1] != last or 0 in t.shape:
        raise ValueError(f"{name} must have shape {_shape(rows, last)} (one for all images) "
                         f"or [B, {_shape(rows, last)[1:]} (one per image), got "
                         f"{tuple(t.shape)}")
    return t


def _shape(rows: int, last: int) -> str:
    return f"[{last}]" if rows == 1 else f"[P, {last}]"


PROMPT_ARGS = """points (Tensor or sequence, optional): ``[P, 2]`` points ``(x, y)`` for every
    image, or ``[B, P, 2]`` one set per image.
labels (Tensor or sequence, optional): ``[P]`` or ``[B, P]``: 1 for a foreground
    point, 0 for a background one (default: all 1).
boxes (Tensor or sequence, optional): ``[4]`` ``(x0, y0, x1, y1)`` for every image,
    or ``[B, 4]``.
mask (int, optional): which of the decoder's masks (``0 … 2`` with
    ``multimask_output``, else ``0``). Default 0.
multimask_output (bool, optional): the decoder's three masks (default) or its
    single one."""
"""The prompt arguments of :class:`SamMaskTarget` and its subclasses (SAM 2's), put in
their docstrings at ``{prompt_args}`` by :func:`prompt_doc`."""

T = TypeVar("T", bound=type)


def prompt_doc(cls: T) -> T:
    """Class decorator: the docstring's ``{prompt_args}`` line becomes
    :data:`PROMPT_ARGS`, indented as the placeholder."""
    lines = []
    for line in (cls.__doc__ or "").split("\n"):
        if line.strip() == "{prompt_args}":
            pad = line[:len(line) - len(line.lstrip())]
            lines.append(textwrap.indent(PROMPT_ARGS, pad))
        else:
            lines.append(line)
    cls.__doc__ = "\n".join(lines)
    return cls


@prompt_doc
class SamMaskTarget(Target):
    r"""The logits of one of SAM's masks summed over the pixels that mask covers: the
    evidence the image encoder gives the mask SAM draws for a prompt (Kirillov et al.,
    ICCV 2023).

    Any method explains SAM's **image encoder** (pass the ``SamModel`` itself: its
    ``vision_encoder`` is what the methods see, :mod:`captum_vit.adapters.families.sam`); this
    target continues from the encoder's output (the neck's ``image_embeddings``) through
    SAM's own prompt encoder and mask decoder (``SamModel.forward`` with
    ``image_embeddings``), picks mask ``k`` of the decoder's outputs for the prompt, and
    scores

    .. math:: s = \sum_{p \in R} z_k(p),

    the mask's low-resolution logits :math:`z_k` summed over its region :math:`R`, the
    pixels where the mask is positive on the **clean** forward of the images the method
    receives (:meth:`resolve`, called by the methods and metrics once per call; under
    ``NoiseTunnel`` each noisy copy fixes its own). The region stays fixed on the
    perturbed forwards of RISE, ScoreCAM or ViT-CX, so their scores say how much of the
    clean mask's evidence survives. The score reads the neck's output as token rows
    through the model's code: the matrix methods weigh the rows by their positive
    input×gradient relevance (gradient-weighted methods) or uniformly (gradient-free
    methods), as for :class:`~captum_vit.targets.TokenTarget`; DecompX's explicit route
    is linearised at the neck's output (the decoder is not linear). True token removal is
    refused (a windowed encoder keeps every token; remove pixels instead).

    Prompts are in pixel coordinates of the model's input images (what ``SamProcessor``
    returns as ``input_points`` / ``input_boxes``, for the resized image). Each image has
    one prompt: points (with labels), a box, or both.

    Args:
        model (nn.Module): a Hugging Face ``SamModel``.
        {prompt_args}

    Raises:
        TypeError: ``model`` is not a ``SamModel``; prompts or ``mask`` of another type.
        ValueError: no prompt, prompts of the wrong shape, labels that do not match the
            points, a mask out of range, prompts outside the images or an empty mask
            region (:meth:`resolve`), or encoder states of another model.

    Examples::

        >>> from captum_vit import GAE
        >>> from captum_vit.targets import SamMaskTarget
        >>> sam = SamModel.from_pretrained(path).eval()
        >>> inputs = processor(image, input_points=[[[450, 600]]], return_tensors="pt")
        >>> target = SamMaskTarget(sam, points=inputs["input_points"][0, 0], mask=0)
        >>> maps = GAE(sam).attribute(inputs["pixel_values"], target=target)
    """

    reads_tokens = True
    probability = "sigmoid"

    model_name = "SamModel"
    """The model class the target runs (messages)."""

    def __init__(self, model: nn.Module, points: Any = None, labels: Any = None,
                 boxes: Any = None, mask: int = 0, multimask_output: bool = True) -> None:
        self.model: ModelTree = self._own_model(model)  # read by attribute names
        if not isinstance(multimask_output, bool):
            raise TypeError(f"multimask_output must be a bool, got {multimask_output!r}")
        self.multimask_output = multimask_output
        count = 3 if multimask_output else 1
        if isinstance(mask, bool) or not isinstance(mask, int):
            raise TypeError(f"mask must be an int (which of the decoder's masks), got "
                            f"{mask!r}")
        if not 0 <= mask < count:
            raise ValueError(f"mask must be in [0, {count}) (the decoder's "
                             f"{'three masks' if multimask_output else 'single mask'}; "
                             f"multimask_output={multimask_output}), got {mask}")
        self.mask = mask
        self.points = _floats(points, "points", 2, 2)
        self.boxes = _floats(boxes, "boxes", 4, 1)
        if self.points is None and self.boxes is None:
            raise ValueError(f"{type(self).__name__} needs a prompt: points=[[x, y], ...] "
                             "(with labels) and/or boxes=[x0, y0, x1, y1]")
        if labels is not None and self.points is None:
            raise ValueError("labels label points: give points too")
        if self.points is not None:
            if labels is None:
                lab = torch.ones(self.points.shape[:2], dtype=torch.long)
            else:
                lab = torch.as_tensor(labels)
                if torch.is_floating_point(lab) or lab.dtype == torch.bool:
                    raise TypeError(f"labels must be integers (1 foreground, 0 background), "
                                    f"got {lab.dtype}")
                lab = lab.long()
                lab = lab[None] if lab.dim() == 1 else lab
                if lab.dim() != 2 or lab.shape[1] != self.points.shape[1] \
                        or lab.shape[0] not in (1, self.points.shape[0]):
                    raise ValueError(f"labels must have shape [P] or [B, P] for points of "
                                     f"shape {tuple(self.points.shape)}, got "
                                     f"{tuple(torch.as_tensor(labels).shape)}")
                lab = lab.expand(self.points.shape[0], -1)
            self.labels: Tensor | None = lab
        else:
            self.labels = None
        sizes = {t.shape[0] for t in (self.points, self.boxes) if t is not None}
        if len(sizes - {1}) > 1:
            raise ValueError(f"points and boxes must have one entry for all images or the "
                             f"same number (one per image), got {sorted(sizes)}")
        self.count = max(sizes)
        self.region: Tensor | None = None  # [m, h, w] bool, fixed by resolve
        self.prompt_of: Tensor | None = None  # [m] int64: each entry's prompt

    def __repr__(self) -> str:
        kinds = [k for k in ("points", "boxes") if getattr(self, k) is not None]
        return (f"{type(self).__name__}({'+'.join(kinds)}, prompts={self.count}, "
                f"mask={self.mask}, multimask_output={self.multimask_output})")

    @staticmethod
    def _own_model(model: nn.Module) -> nn.Module:
        """``model`` if this target can run it (:func:`sam_model`)."""
        return sam_model(model)

    def _prompts(self) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """Points, labels and boxes of the :attr:`count` prompts (``[u, ...]``)."""
        u = self.count
        pts = None if self.points is None else self.points.expand(u, *self.points.shape[1:])
        lab = None if self.labels is None else self.labels.expand(u, -1)
        box = None if self.boxes is None else self.boxes.expand(u, -1)
        return pts, lab, box

    def logits(self, embeddings: Tensor) -> Tensor:
        """Mask :attr:`mask`'s logits ``[n, u, h_m, w_m]`` of every prompt on the neck's
        output ``embeddings`` ``[n, C', gh, gw]`` (SAM's own decoder)."""
        pts, lab, box = self._prompts()
        z = sam_mask_logits(self.model, embeddings, pts, lab, box, self.multimask_output)
        return z[:, :, self.mask]

    def mask_logits(self, out: Outputs) -> Tensor:
        """Mask :attr:`mask`'s logits ``[n, u, h_m, w_m]`` of every prompt on the
        encoder outputs ``out`` of ``n`` images."""
        return self.logits(self._embeddings(out))

    def _embeddings(self, out: Outputs) -> Tensor:
        if out.tokens is None:
            raise ValueError("SamMaskTarget reads the image encoder's output")
        emb = out.patches()
        cfg = self.model.config
        want = int(cfg.vision_config.output_channels)
        size = int(cfg.prompt_encoder_config.image_embedding_size)
        if emb.shape[1] != want or tuple(emb.shape[-2:]) != (size, size):
            raise ValueError(f"SamMaskTarget read encoder outputs of {emb.shape[1]} channels "
                             f"on a {emb.shape[-2]}x{emb.shape[-1]} grid, but its SamModel's "
                             f"decoder takes {want} on {size}x{size}: explain the SamModel "
                             "given to the target")
        return emb

    def resolve(self, adapter: Any, images: Tensor) -> SamMaskTarget:
        """This target with each image's mask region fixed: the pixels where mask
        :attr:`mask` is positive on the model's clean forward of ``images``.

        Args:
            adapter: the adapter of the ``SamModel`` (:func:`captum_vit.adapters.adapt`).
            images (Tensor): the images [B, C, H, W] explained.

        Returns:
            SamMaskTarget: resolved (one region and prompt per image).

        Raises:
            ValueError: the adapter explains another model, prompts that do not match
                the batch or reach outside the images, or an empty region.
        """
        own = getattr(adapter, "model", None)
        name, cls = type(self).__name__, self.model_name
        if own is not self.model:
            raise ValueError(f"{name}'s {cls} is not the model explained "
                             f"({type(own).__name__}): pass the same {cls} to the method")
        self._check_inside(int(images.shape[-2]), int(images.shape[-1]))
        b = images.shape[0]
        prompt_of = per_image(torch.arange(self.count), b, f"{name}'s prompts")
        with torch.no_grad(), adapter.targeting(_SamLogits(self)):
            z = adapter.run(adapter.embed(images))  # [B, u * h * w]
        z = z.reshape(b, self.count, *self._mask_size()).cpu()
        region = z[torch.arange(b), prompt_of] > 0  # [B, h, w]
        empty = (~region.flatten(1).any(1)).nonzero()[:, 0].tolist()
        if empty:
            raise ValueError(f"mask {self.mask} has no positive pixel on image(s) {empty}: "
                             "its region is empty, so its score is 0; choose another mask "
                             "(mask=) or prompt")
        out = type(self).__new__(type(self))
        out.__dict__.update(self.__dict__)
        out.region, out.prompt_of = region, prompt_of
        return out

    def _check_inside(self, height: int, width: int) -> None:
        """Refuse prompts outside the ``height`` × ``width`` images (pixel coordinates)."""
        for name, t in (("points", self.points), ("boxes", self.boxes)):
            if t is None:
                continue
            xy = t.reshape(-1, 2)
            out = (xy[:, 0] < 0) | (xy[:, 0] > width) | (xy[:, 1] < 0) | (xy[:, 1] > height)
            if out.any():
                bad = xy[out][0].tolist()
                raise ValueError(
                    f"{type(self).__name__}'s {name} reach outside the {width}x{height} images "
                    f"(e.g. (x, y) = ({bad[0]:g}, {bad[1]:g})): prompts are pixel "
                    "coordinates (x, y) of the model's input images, in [0, width] x "
                    "[0, height]; scale them as the model's processor does (its "
                    "input_points / input_boxes for the resized image)")

    def _mask_size(self) -> tuple[int, int]:
        size = 4 * int(self.model.config.prompt_encoder_config.image_embedding_size)
        return size, size

    def _resolved(self) -> tuple[Tensor, Tensor]:
        if self.region is None or self.prompt_of is None:
            raise ValueError(f"{type(self).__name__} is not resolved: its region is fixed "
                             "on the clean forward; call target.resolve(adapt(model), images) "
                             "first (the methods and metrics do)")
        return self.region, self.prompt_of

    def num_columns(self, num_classes: int) -> int:
        return self._resolved()[0].shape[0]

    def index(self, batch: int) -> Tensor:
        return per_image(torch.arange(self._resolved()[0].shape[0]), batch,
                         f"{type(self).__name__}'s images")

    def columns(self, out: Outputs) -> Tensor:
        region, prompt_of = self._resolved()
        z = self.mask_logits(out)  # [n, u, h, w]
        dev = z.device
        picked = z[:, prompt_of.to(dev)]  # [n, m, h, w]
        return (picked * region.to(dev, z.dtype)).sum((-2, -1))


class _SamLogits(Target):
    """Every prompt's logits of the chosen mask, flattened ``[n, u·h·w]``: what
    :meth:`SamMaskTarget.resolve` reads on the clean forward."""

    reads_tokens = True

    def __init__(self, target: SamMaskTarget) -> None:
        self.target = target
        self.blocks = target.blocks  # the block outputs it reads (SAM 2: several stages)

    def columns(self, out: Outputs) -> Tensor:
        z = self.target.mask_logits(out)
        return z.reshape(z.shape[0], -1)
