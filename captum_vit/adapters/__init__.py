"""The adapter layer: the only code that knows a model's internals (methods read the
canonical parts and traces of :mod:`captum_vit.adapters.base`, never the model)."""

from __future__ import annotations

import contextlib
import keyword
from collections.abc import Callable, Iterator

from torch import nn

from captum_vit.adapters.base import (
    BlockParts,
    BlockRecord,
    FusedOps,
    HeadParts,
    Heads,
    HeadsOps,
    Layout,
    NormParts,
    Ops,
    PoolParts,
    Trace,
    ViTAdapter,
)
from captum_vit.adapters.hf_clip import HFEmbeddingAdapter, is_hf_embedding
from captum_vit.adapters.hf_vit import HFViTAdapter, is_hf_vit
from captum_vit.adapters.subnetwork import SubnetworkAdapter
from captum_vit.adapters.subsets import (
    image_logits,
    pools_patches,
    subset_forwards,
    subset_logits,
)
from captum_vit.adapters.timm_beit import TimmBeitAdapter, is_timm_beit
from captum_vit.adapters.timm_eva import TimmEvaAdapter, is_timm_eva
from captum_vit.adapters.timm_vit import TimmViTAdapter, is_timm_vit

ADAPTERS: tuple[tuple[Callable[[nn.Module], bool], type[ViTAdapter]], ...] = (
    (is_timm_vit, TimmViTAdapter),
    (is_timm_beit, TimmBeitAdapter),
    (is_timm_eva, TimmEvaAdapter),
    (is_hf_vit, HFViTAdapter),
    (is_hf_embedding, HFEmbeddingAdapter),
)
"""``(predicate, adapter class)`` rows, tried in order: a new model family is one row."""

SUPPORTED = (
    "timm VisionTransformer family (ViT, DeiT, distilled DeiT, register tokens, "
    "global_pool='token'/'avg'/'map', LayerScale, qk-norm, dynamic_img_size), timm Beit "
    "(relative position bias, GELU or SwiGLU MLP), timm Eva (EVA, EVA-02, DINOv3: RoPE, gated "
    "MLP) and Hugging Face transformers ViTForImageClassification, "
    "DeiTForImageClassification(WithTeacher), Dinov2(WithRegisters)ForImageClassification, "
    "CLIPVisionModel(WithProjection), SiglipVisionModel, CLIPModel and SiglipModel"
)


def adapt(model: nn.Module) -> ViTAdapter:
    """Pick the adapter for ``model`` from the :data:`ADAPTERS` table.

    Args:
        model (nn.Module): a supported Vision Transformer classifier.

    Returns:
        ViTAdapter: the canonical view of ``model`` (the model itself is not modified).

    Raises:
        TypeError: if ``model`` is not a supported ViT; the message lists what is supported,
            or, for a wrapper around one (``nn.Sequential(Normalize(...), vit)``), names the
            inner module to pass.

    Examples::

        >>> import timm
        >>> from captum_vit.adapters import adapt
        >>> model = timm.create_model("vit_tiny_patch16_224", num_classes=10).eval()
        >>> adapt(model).num_blocks
        12
    """
    if isinstance(model, ViTAdapter):
        return model
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for applies, adapter in ADAPTERS:
        if applies(model):
            return adapter(model)
    for name, sub in model.named_modules():
        if name and any(applies(sub) for applies, _ in ADAPTERS):
            path = _module_path(name)
            raise TypeError(
                f"{type(model).__name__} wraps a supported ViT at `{path}` "
                f"({type(sub).__name__}): pass that module (e.g. GAE({path})) and apply "
                "the wrapper's other steps, such as input normalisation, to the inputs "
                "yourself; captum_vit explains the ViT's own forward")
    kind = type(model).__name__
    raise TypeError(
        f"captum_vit cannot explain {_article(kind)} {kind}: supported models are the "
        f"{SUPPORTED}"
    )


def _module_path(name: str, root: str = "model") -> str:
    """Python that reaches the sub-module ``name`` of ``named_modules()`` from ``root``:
    attributes for identifiers, indexing for ``nn.Sequential`` / ``nn.ModuleList``
    positions and other ``nn.ModuleDict`` keys.

    Args:
        name (str): a dotted name from ``named_modules()``, e.g. ``"1"`` or
            ``"backbone.0.vit"``.
        root (str, optional): the variable holding the model. Default ``"model"``.

    Returns:
        str: e.g. ``"model[1]"``, ``"model.backbone[0].vit"``.

    Examples::

        >>> _module_path("1"), _module_path("backbone.0.vit")
        ('model[1]', 'model.backbone[0].vit')
    """
    out = root
    for part in name.split("."):
        if part.isdigit():
            out += f"[{part}]"
        elif part.isidentifier() and not keyword.iskeyword(part):
            out += f".{part}"
        else:
            out += f"[{part!r}]"
    return out


def _article(word: str) -> str:
    """``"an"`` or ``"a"`` before ``word`` as it is read aloud: ``an Xcit``, ``an MLP``,
    ``an EvaModel``, ``a Sequential``, ``a UNet``.

    Args:
        word (str): a class name or another word.

    Returns:
        str: ``"an"`` or ``"a"``.

    Examples::

        >>> [_article(w) for w in ("Xcit", "MLP", "Sequential", "ResNet", "UNet")]
        ['an', 'an', 'a', 'a', 'a']
    """
    w = word.lstrip("_")
    if not w:
        return "a"
    first = w[0].lower()
    spelled = len(w) == 1 or w[1].isupper() or w[1].isdigit()  # an acronym, read letter by letter
    if first in "aeio" or first == "x":
        return "an"
    if first == "u":
        return "a" if spelled or w.lower().startswith(("uni", "use", "usu", "uti")) else "an"
    return "an" if spelled and first in "fhlmnrs" else "a"


@contextlib.contextmanager
def readout_alpha(model: nn.Module, alpha: float | str) -> Iterator[None]:
    r"""Within the block, attention-based maps of a classifier on ``[CLS ; mean of the
    patches]`` (Hugging Face DINOv2) read the last state as
    :math:`w = \alpha e_0 + (1-\alpha) u_P` (:math:`u_P` uniform over the patch rows,
    registers excluded).

    The default outside any block is ``α = ½`` (the CLS-row-plus-patch-mean readout of BT
    and txv for DINO). ``alpha="logit"`` is a captum_vit choice: per image and explained
    class ``c``, :math:`\alpha = |W^1_c h_0| / (|W^1_c h_0| + |W^2_c \bar h|)`, the share
    of the logit that the class token carries (``W¹``, ``W²``: the classifier's two halves;
    ``h``: the final LayerNorm's output; ``h̄`` its mean over the patches). DecompX, IxG and
    the gradient methods follow the logit exactly and do not use ``α``.

    The setting holds for every adapter of this model object and lives in a context
    variable; the model is not changed.

    Args:
        model (nn.Module): a DINOv2 classifier (``Dinov2(WithRegisters)ForImageClassification``).
        alpha (float or str): ``α`` in ``[0, 1]`` or ``"logit"``.

    Raises:
        ValueError: another readout, or an ``alpha`` out of range.

    Examples::

        >>> from captum_vit import GAE
        >>> from captum_vit.adapters import readout_alpha
        >>> with readout_alpha(dinov2_classifier, "logit"):
        ...     maps = GAE(dinov2_classifier).attribute(pixel_values, target=labels)
    """
    with adapt(model).with_cls_alpha(alpha):
        yield


__all__ = [
    "ADAPTERS", "BlockParts", "BlockRecord", "FusedOps", "HFEmbeddingAdapter", "HFViTAdapter",
    "HeadParts", "Heads", "HeadsOps", "Layout", "NormParts", "Ops", "PoolParts",
    "SubnetworkAdapter", "Trace",
    "TimmBeitAdapter",
    "TimmEvaAdapter", "TimmViTAdapter", "ViTAdapter", "adapt", "image_logits", "readout_alpha",
    "pools_patches", "subset_forwards", "subset_logits",
    "SUPPORTED",
]
