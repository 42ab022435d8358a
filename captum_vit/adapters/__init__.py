"""The adapter layer: the only code that knows a model's internals (methods read the
canonical parts and traces, never the model).

Public (everything in ``__all__``, imported from ``captum_vit.adapters``):

- :func:`adapt` (one adapter per model) and the family table :data:`ADAPTERS`;
- the engine and the family contract: :class:`ViTAdapter` (:data:`FAMILY_CONTRACT`,
  :data:`FAMILY_HOOKS`), its readout and targeting part :class:`Readout`
  (:mod:`~captum_vit.adapters.readout`), the blocks' token geometry :class:`Stages`
  (``adapter.stages``, :mod:`~captum_vit.adapters.stages`), :class:`AdapterState`,
  :class:`AdapterSettings`, the family adapters (with
  :func:`is_torchvision_vit`, :func:`is_open_clip`, :func:`is_hf_backbone` and
  :func:`is_hf_videomae`) and
  :class:`SubnetworkAdapter` (:mod:`~captum_vit.adapters.base`);
- token geometry: :class:`Layout`, :func:`grid_to_pixels`, :func:`grid_to_video`,
  :func:`tokens_to_grid`
  (:mod:`~captum_vit.adapters.layout`);
- what a score is: :class:`TargetHead`, :func:`probabilities`, :func:`log_probabilities`,
  :func:`scores_are_classes`, the kind in force being adapter state
  (:attr:`ViTAdapter.probability`, :meth:`ViTAdapter.probability_kind`)
  (:mod:`~captum_vit.adapters.scoring`);
- canonical parameters and the one attention: :class:`BlockParts`, :class:`AttentionParts`,
  :class:`PoolParts`, :class:`HeadParts`, :class:`PreLogitsHeadParts` (a head
  with a representation layer), :class:`NormParts`, :class:`Heads`,
  :class:`AttentionRules`, the derived views :class:`ValuePath` and
  :data:`BLOCK_FEATURES` (:mod:`~captum_vit.adapters.parts`);
- forward strategies and linearised primitives: :class:`Ops`, :class:`FusedOps`,
  :class:`HeadsOps`, :func:`patch_projection`, :func:`layer_norm_frozen_variance`,
  :func:`activation_gate_detached`, :func:`activation_gate` (:mod:`~captum_vit.adapters.ops`);
- LRP rule sets: :class:`LRPOps`, :class:`CheferOps` and their helpers
  (:mod:`~captum_vit.adapters.rules`);
- trace records and options: :class:`Trace`, :class:`BlockRecord`, :class:`TraceOptions`
  (:mod:`~captum_vit.adapters.trace`);
- windows and merges of models made of stages (Swin): :class:`Windows`,
  :class:`MergeParts`, :data:`MERGE_ORDER` (:mod:`~captum_vit.adapters.windows`), the Swin
  adapters :class:`TimmSwinAdapter` and :class:`HFSwinAdapter` with :func:`is_timm_swin`
  and :func:`is_hf_swin` (:mod:`~captum_vit.adapters.families.swin`);
- the subset engine: :func:`subset_logits`, :func:`subset_forwards`, :func:`image_logits`,
  :func:`pools_patches` (:mod:`~captum_vit.adapters.subsets`).

Names starting with ``_`` are private to this package.
"""

from __future__ import annotations

import contextlib
import keyword
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from captum_vit.adapters import catalog, families
from captum_vit.adapters._typing import ModelTree
from captum_vit.adapters.base import (
    FAMILY_CONTRACT,
    FAMILY_HOOKS,
    AdapterSettings,
    AdapterState,
    ViTAdapter,
)
from captum_vit.adapters.layout import (
    GRID_MODES,
    READOUTS,
    Layout,
    grid_to_pixels,
    grid_to_video,
    tokens_to_grid,
)
from captum_vit.adapters.ops import (
    FusedOps,
    HeadsOps,
    Ops,
    activation_gate,
    activation_gate_detached,
    layer_norm_frozen_variance,
    patch_projection,
)
from captum_vit.adapters.parts import (
    BLOCK_FEATURES,
    AttentionParts,
    AttentionRules,
    BlockParts,
    HeadParts,
    Heads,
    NormParts,
    PoolParts,
    PreLogitsHeadParts,
    ValuePath,
    key_padding_bias,
)
from captum_vit.adapters.readout import Readout
from captum_vit.adapters.rules import (
    ACT_RULES,
    ATTENTION_RULES,
    CHEFER_STABILIZER,
    LRP_METHODS,
    BackwardMode,
    CheferOps,
    LRPOps,
    divide,
    identity_rule,
    lrp_linear,
    scale_gradient,
    stabilized_divide,
)
from captum_vit.adapters.scoring import (
    TargetHead,
    log_probabilities,
    probabilities,
    scores_are_classes,
)
from captum_vit.adapters.stages import Stages
from captum_vit.adapters.subnetwork import SubnetworkAdapter
from captum_vit.adapters.subsets import (
    image_logits,
    pools_patches,
    subset_forwards,
    subset_logits,
)
from captum_vit.adapters.trace import BlockRecord, Trace, TraceOptions
from captum_vit.adapters.windows import MERGE_ORDER, MergeParts, Windows

for _family in catalog.families():  # the family part of the public names
    globals()[_family.adapter.__name__] = _family.adapter
    globals()[_family.predicate.__name__] = _family.predicate
FAMILY_NAMES: tuple[str, ...] = tuple(
    n for f in catalog.families() for n in (f.adapter.__name__, f.predicate.__name__))
"""The adapter classes and predicates of the registered families (in ``__all__``)."""

ADAPTERS: tuple[tuple[Callable[[nn.Module], bool], type[ViTAdapter]], ...] = \
    catalog.adapters()
"""``(predicate, adapter class)`` rows of the families registered when the package was
imported, in dispatch order (:func:`captum_vit.adapters.catalog.adapters`; :func:`adapt`
reads the catalogue itself, so a family registered later takes part too)."""

SUPPORTED = catalog.supported()
"""What :func:`adapt` supports: every family's ``supports`` line
(:func:`captum_vit.adapters.catalog.supported`)."""


_ADAPTED: weakref.WeakKeyDictionary[nn.Module, tuple[weakref.ref[ViTAdapter], tuple[Any, ...]]] \
    = weakref.WeakKeyDictionary()
"""The memo of :func:`adapt`: per model (held weakly) its adapter (held weakly: the
adapter holds the model, so a strong value would keep every model alive) and the
fingerprint of the parameters it was built on (:func:`_fingerprint`)."""
_ADAPTED_LOCK = threading.Lock()


def _fingerprint(model: nn.Module) -> tuple[Any, ...]:
    """What an adapter's views depend on: every parameter's identity, storage, dtype and
    device (``model.to(dtype)``, ``load_state_dict(..., assign=True)`` or a replaced
    parameter change it; in-place updates do not, the views see them)."""
    return tuple((name, id(p), p.data_ptr(), p.dtype, p.device)
                 for name, p in model.named_parameters())


def adapt(model: nn.Module | ViTAdapter, *, refresh: bool = False) -> ViTAdapter:
    """The adapter of ``model``, picked from the :data:`ADAPTERS` table; one per model.

    The adapter is memoised per model object (weakly: neither the model nor the adapter is
    kept alive by the memo), so ``adapt(model) is adapt(model)`` while the adapter is in
    use, and per-model settings (:meth:`ViTAdapter.targeting`,
    :meth:`ViTAdapter.with_cls_alpha`) and the self-check memo are its state. It is
    rebuilt when the model's parameters were replaced (``model.to(dtype)``,
    ``load_state_dict(..., assign=True)``, a new ``nn.Parameter``) and with
    ``refresh=True`` (e.g. after replacing a sub-module); a rebuilt adapter keeps the
    settings in force and checks the model again.

    Args:
        model (nn.Module): a supported Vision Transformer classifier.
        refresh (bool, optional): build a new adapter even if the parameters are the
            same. Default ``False``.

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
        >>> adapt(model) is adapt(model)
        True
    """
    if isinstance(model, ViTAdapter):
        return model
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    rows = catalog.adapters()
    for applies, adapter_class in rows:
        if applies(model):
            return _memoised(model, adapter_class, refresh)
    for name, sub in model.named_modules():
        if name and any(applies(sub) for applies, _ in rows):
            path = _module_path(name)
            raise TypeError(
                f"{type(model).__name__} wraps a supported ViT at `{path}` "
                f"({type(sub).__name__}): pass that module (e.g. GAE({path})) and apply "
                "the wrapper's other steps, such as input normalisation, to the inputs "
                "yourself; captum_vit explains the ViT's own forward")
    kind = type(model).__name__
    raise TypeError(
        f"captum_vit cannot explain {_article(kind)} {kind}: supported models are the "
        f"{catalog.supported()}"
    )


def _memoised(model: nn.Module, adapter_class: type, refresh: bool) -> ViTAdapter:
    """The memoised adapter of ``model`` (:data:`_ADAPTED`), built anew when there is
    none alive, the parameters were replaced, or ``refresh``."""
    fingerprint = _fingerprint(model)
    with _ADAPTED_LOCK:
        entry = _ADAPTED.get(model)
        old = entry[0]() if entry is not None else None
        if entry is not None and old is not None and not refresh and entry[1] == fingerprint \
                and type(old) is adapter_class:
            return old
        adapter: ViTAdapter = adapter_class(model)  # a family adapter takes its model
        if old is not None:  # the settings in force stay in force
            adapter.__dict__["_state"] = old.state.renewed()
        _ADAPTED[model] = (weakref.ref(adapter), fingerprint)
        return adapter


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

    The setting is state of the model's adapter (:func:`adapt`, one per model; the
    previous setting is restored on exit, also after an exception, and other threads are
    not affected); the model is not changed.

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
    "ACT_RULES", "ADAPTERS", "ATTENTION_RULES", "BLOCK_FEATURES", "CHEFER_STABILIZER",
    "FAMILY_CONTRACT", "FAMILY_HOOKS", "FAMILY_NAMES", "Readout", "Stages",
    "GRID_MODES", "LRP_METHODS", "READOUTS", "SUPPORTED",
    "AdapterSettings", "AdapterState", "AttentionParts", "AttentionRules", "BackwardMode",
    "BlockParts", "BlockRecord", "CheferOps", "FusedOps", "HeadParts", "Heads", "HeadsOps",
    "MERGE_ORDER", "MergeParts", "Windows", "ModelTree",
    "LRPOps", "Layout", "NormParts", "Ops",
    "PoolParts", "PreLogitsHeadParts", "SubnetworkAdapter", "TargetHead", "Trace", "TraceOptions",
    "ValuePath", "ViTAdapter",
    "activation_gate", "activation_gate_detached", "adapt", "divide", "grid_to_pixels",
    "grid_to_video",
    "identity_rule", "image_logits", "key_padding_bias",
    "layer_norm_frozen_variance",
    "log_probabilities", "lrp_linear", "patch_projection", "pools_patches", "probabilities",
    "readout_alpha", "scale_gradient", "scores_are_classes", "stabilized_divide",
    "subset_forwards", "subset_logits", "tokens_to_grid",
    "catalog", "families",
    *FAMILY_NAMES,
]
