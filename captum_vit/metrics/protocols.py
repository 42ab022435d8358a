"""Evaluation presets: the papers' protocols, one name each.

``captum-vit evaluate --protocol NAME`` runs a preset: it fixes the data handling (images
are resized to the model's input, bilinear, no crop, masks nearest), the removal, the steps
and x-grid, the baselines, the explained class (predicted and/or ground truth), the metrics
and method options (Chefer's scripts run Rollout and Chefer'21 with ``start_layer=1``),
prints what it fixed, and writes, besides the usual ``results.*`` files, ``protocol.md``:
the paper's table layout (its rows and columns) so the numbers can be put beside the
paper's. The data come from ``--data``.

Normalisation: a paper's ``Normalize(mean, std)`` belongs to the paper's model, so every
preset feeds the model its own normalisation (model card, timm data config, Hugging Face
image processor: :func:`captum_vit.models.load_model`) unless the paper's is asked for
(``--protocol-normalization paper``, ``normalization="paper"``). The paper's normalisation
is refused when its channel count differs from the model's input channels, and a warning
(:class:`ProtocolNormalizationWarning`, also in ``protocol.md``) says when the paper's
normalisation differs from the model's. Fills defined in ``[0, 1]`` image space (Chefer's
pixel zeroing) are converted with the normalisation actually used, so they stay image-space
zeros whichever is chosen; TIS's baselines are defined in the normalised input space.

An option a preset fixes (``--metrics``, ``--removal``, ``--steps``, ``--target``) given
with a value other than its default is refused: the preset would silently overrule it.

:data:`PROTOCOLS` holds every preset; adding one is one :class:`Protocol` row. A preset
takes its methods as factories (``model -> Attribution``) like every metric; turning
method names into factories with the preset's :attr:`Protocol.method_options` is the
caller's step (:func:`captum_vit.commands.evaluate.protocol_factories`), so the metrics
never import the method registry. Each
preset's docstring-level notes (``notes``) say what was and was not verified against the
authors' code.

Examples::

    >>> from captum_vit.metrics.protocols import PROTOCOLS, get_protocol
    >>> sorted(PROTOCOLS)[:2]
    ['chefer21_perturbation', 'skipplus_seg_ap']
    >>> get_protocol("tokentm_aopc_lodds").settings["fractions"][:3]
    (0.0, 0.05, 0.1)
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from torch import Tensor, nn

from captum_vit._base import check_choice
from captum_vit.data.specs import IndexedData
from captum_vit.metrics import faithfulness as fa
from captum_vit.metrics import suite
from captum_vit.metrics.localization import segmentation
from captum_vit.metrics.removal import image_space_zero, tis_baseline
from captum_vit.metrics.results import MetricResult
from captum_vit.metrics.settings import EvalSettings
from captum_vit.metrics.table import METRICS, MethodFactory, MetricBatch, MetricSpec

Results = dict[str, dict[str, MetricResult]]
CHEFER_NORMALIZATION = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
CHEFER_FRACTIONS = tuple(i / 10 for i in range(10))  # 0, 0.1, ..., 0.9
TOKENTM_FRACTIONS = tuple(i / 20 for i in range(21))  # 0, 0.05, ..., 1
START_LAYER_1 = {"rollout": {"start_layer": 1}, "chefer21": {"start_layer": 1}}
FIXED_OPTIONS = ("metrics", "removal", "steps", "target")
"""Command-line options every preset fixes (given explicitly with another value: refused)."""
NORMALIZATIONS = ("model", "paper")
"""Choices of ``--protocol-normalization`` / ``normalization=``: ``"model"`` (default) feeds
the model its own normalisation; ``"paper"`` the normalisation of the paper's script where
the preset records one (:attr:`Protocol.normalization`), else the model's own."""


class ProtocolNormalizationWarning(UserWarning):
    """A preset's (paper's) normalisation differs from the model's own: either the run uses
    the model's and may differ from the paper's numbers, or it uses the paper's and feeds the
    model inputs it was not trained on."""


@dataclass(frozen=True)
class Column:
    """One column of a preset's table: ``header``, the explained-class pass it reads
    (``explain``: ``"predicted"`` or ``"label"``), the result column and a display scale."""

    header: str
    explain: str
    key: str
    scale: float = 1.0

    @property
    def target(self) -> str:
        """Deprecated name of :attr:`explain`."""
        warnings.warn("Column.target is deprecated; use Column.explain", DeprecationWarning,
                      stacklevel=2)
        return self.explain


@dataclass(frozen=True)
class Protocol:
    """One evaluation preset (a row of :data:`PROTOCOLS`).

    Attributes:
        name (str): the preset's name (``--protocol NAME``).
        source (str): the paper and table it reproduces.
        metrics (Callable): ``(mean, std) -> {name: MetricSpec}``: the preset's own metric
            table, given the normalisation of the model's inputs (fills in ``[0, 1]``
            image space need it).
        explain (tuple[str, ...]): explained classes, one evaluation pass each
            (``"predicted"``, ``"label"``; :data:`captum_vit.metrics.settings.EXPLAINED`).
        columns (tuple[Column, ...]): the paper's table columns (``protocol.md``).
        settings (dict): what the preset fixes, printed and stored in ``results.json``.
        normalization (tuple, optional): ``(mean, std)`` the paper's script uses, for the
            paper's model (applied only with ``normalization="paper"``); ``None``: the
            script does not fix one (the model's own is always used).
        needs_labels (bool): ground-truth labels are read (accuracy or explained class).
        method_options (dict): canonical method name -> constructor options.
        optional (dict): metric name -> what it needs (``"masks"``): run only when the
            data has it.
        notes (str): what was and was not verified against the paper's code.
    """

    name: str
    source: str
    metrics: Callable[[Sequence[float] | None, Sequence[float] | None], dict[str, MetricSpec]]
    explain: tuple[str, ...]
    columns: tuple[Column, ...]
    settings: Mapping[str, Any]
    normalization: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    needs_labels: bool = False
    method_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    optional: Mapping[str, str] = field(default_factory=dict)
    notes: str = ""

    @property
    def targets(self) -> tuple[str, ...]:
        """Deprecated name of :attr:`explain`."""
        warnings.warn("Protocol.targets is deprecated; use Protocol.explain",
                      DeprecationWarning, stacklevel=2)
        return self.explain

    @property
    def needs_masks(self) -> bool:
        """Whether every run needs ground-truth masks (a mask metric that is not optional)."""
        return any(spec.needs_masks and name not in self.optional
                   for name, spec in self.metrics(None, None).items())

    def metric_names(self, *, has_masks: bool) -> list[str]:
        """The names of the preset's metric table to run on data with / without masks."""
        return [n for n in self.metrics(None, None)
                if n not in self.optional or (self.optional[n] == "masks" and has_masks)]

    def preprocess(self, preprocess: Any, normalization: str = "model") -> Any:
        r"""The preprocessing the preset feeds the model.

        Args:
            preprocess (Preprocess): the model's own
                :class:`~captum_vit.models.Preprocess` (``load_model(...).preprocess``).
            normalization (str, optional): ``"model"``: the model's own normalisation
                (``preprocess`` unchanged); ``"paper"``: the paper's
                :attr:`normalization` where the preset records one. Default ``"model"``.

        Returns:
            Preprocess: ``preprocess``, or a copy with the paper's mean and std.

        Raises:
            ValueError: an unknown ``normalization``, or ``"paper"`` with a paper
                normalisation whose channel count differs from the model's input channels.

        Examples::

            >>> from captum_vit.models import load_model
            >>> own = load_model("zoo:vit_fmnist_loc").preprocess
            >>> get_protocol("chefer21_perturbation").preprocess(own) is own
            True
        """
        check_choice("normalization", normalization, NORMALIZATIONS)
        if normalization == "model" or self.normalization is None:
            return preprocess
        mean, std = self.normalization
        c = preprocess.channels
        if len(mean) not in (1, c) or len(std) not in (1, c):
            raise ValueError(
                f"--protocol {self.name} --protocol-normalization paper: the paper's "
                f"normalisation (mean {_values(mean)}, std {_values(std)}) is for "
                f"{len(mean)}-channel inputs, but the model takes {c}-channel inputs; drop "
                "--protocol-normalization paper (normalization='model' in Python) to use "
                f"the model's own normalisation ({_norm_text(preprocess)})")
        return dataclasses.replace(preprocess, mean=tuple(float(v) for v in mean),
                                   std=tuple(float(v) for v in std))

    def normalization_warning(self, preprocess: Any, normalization: str = "model"
                              ) -> str | None:
        r"""The warning to give when the paper's normalisation differs from the model's.

        Args:
            preprocess (Preprocess): the model's own
                :class:`~captum_vit.models.Preprocess`.
            normalization (str, optional): the choice of :data:`NORMALIZATIONS` the run
                uses. Default ``"model"``.

        Returns:
            str or None: the message, or ``None`` when the preset records no paper
            normalisation or the paper's equals the model's.

        Examples::

            >>> from captum_vit.models import load_model
            >>> own = load_model("zoo:vit_fmnist_loc").preprocess
            >>> get_protocol("tis_insdel").normalization_warning(own) is None
            True
        """
        check_choice("normalization", normalization, NORMALIZATIONS)
        if self.normalization is None or _same_normalization(self.normalization, preprocess):
            return None
        paper = f"mean {_values(self.normalization[0])}, std {_values(self.normalization[1])}"
        own = _norm_text(preprocess)
        if normalization == "paper":
            return (f"--protocol {self.name}: the paper's normalisation ({paper}) differs "
                    f"from the model's own ({own}); with --protocol-normalization paper the "
                    "model gets inputs normalised unlike its training data, which can lower "
                    "its accuracy and every metric. Use it only for the paper's own model; "
                    "drop it to use the model's normalisation")
        return (f"--protocol {self.name}: the paper normalised with {paper}, for its own "
                f"model; this run uses the model's own normalisation ({own}), so the numbers "
                "need not match the paper's table. --protocol-normalization paper applies the "
                "paper's normalisation (for the paper's model)")

    def normalization_rule(self, preprocess: Any = None, normalization: str = "model") -> str:
        r"""The normalisation the run uses, in words (printed and in ``protocol.md``).

        Args:
            preprocess (Preprocess, optional): the model's own
                :class:`~captum_vit.models.Preprocess` (to name its mean and std).
            normalization (str, optional): the choice of :data:`NORMALIZATIONS` the run
                uses. Default ``"model"``.

        Returns:
            str: e.g. ``"the model's own (mean 0.1, std 0.25); the paper's: mean (0.5, 0.5,
            0.5), std (0.5, 0.5, 0.5) (--protocol-normalization paper)"``.
        """
        check_choice("normalization", normalization, NORMALIZATIONS)
        own = "the model's own" if preprocess is None else \
            f"the model's own ({_norm_text(preprocess)})"
        if self.normalization is None:
            return f"{own}; the paper's script fixes none"
        paper = f"mean {_values(self.normalization[0])}, std {_values(self.normalization[1])}"
        if normalization == "paper":
            return f"the paper's ({paper}, --protocol-normalization paper)"
        return f"{own}; the paper's: {paper} (--protocol-normalization paper)"

    def summary(self, preprocess: Any = None, normalization: str = "model") -> str:
        r"""The settings the preset fixes, one per line (printed by the command).

        Args:
            preprocess (Preprocess, optional): the model's own
                :class:`~captum_vit.models.Preprocess` (to print its normalisation).
            normalization (str, optional): the choice of :data:`NORMALIZATIONS` the run
                uses. Default ``"model"``.

        Returns:
            str: the lines.
        """
        lines = [f"--protocol {self.name}: {self.source}"]
        norm_text = self.normalization_rule(preprocess, normalization)
        lines.append(f"  data: images resized to the model's input (bilinear, no crop), "
                     f"masks nearest; normalisation: {norm_text}")
        lines.append(f"  explained class: {' and '.join(self.explain)}")
        for k, v in self.settings.items():
            lines.append(f"  {k}: {_short(v)}")
        if self.method_options:
            lines.append("  method options: " + ", ".join(
                f"{m} {o}" for m, o in self.method_options.items()))
        return "\n".join(lines)


def _values(v: Sequence[float] | None) -> str:
    """``(0.5, 0.5, 0.5)`` -> ``"(0.5, 0.5, 0.5)"``, ``(0.1,)`` -> ``"0.1"``, ``None`` ->
    ``"none"``."""
    if v is None:
        return "none"
    if len(v) == 1:
        return f"{float(v[0]):g}"
    return "(" + ", ".join(f"{float(f):g}" for f in v) + ")"


def _norm_text(preprocess: Any) -> str:
    """A Preprocess's normalisation in words."""
    mean, std = getattr(preprocess, "mean", None), getattr(preprocess, "std", None)
    if mean is None or std is None:
        return "none: inputs in [0, 1]"
    return f"mean {_values(mean)}, std {_values(std)}"


def _same_normalization(paper: tuple[Sequence[float], Sequence[float]], preprocess: Any) -> bool:
    """Whether the paper's ``(mean, std)`` equals the preprocessing's, channel by channel
    (no normalisation = mean 0, std 1; a different channel count is never the same)."""
    c = int(preprocess.channels)
    if len(paper[0]) not in (1, c) or len(paper[1]) not in (1, c):
        return False
    pairs = ((paper[0], preprocess.mean, 0.0), (paper[1], preprocess.std, 1.0))
    for ours, theirs, neutral in pairs:
        a = [float(v) for v in ours] * (c // len(ours))
        b = [neutral] * c if theirs is None else [float(v) for v in theirs] * (c // len(theirs))
        if any(abs(x - y) > 1e-6 for x, y in zip(a, b, strict=True)):
            return False
    return True


def _short(v: Any) -> str:
    if isinstance(v, tuple) and len(v) > 6:
        return f"{v[0]:g}, {v[1]:g}, ..., {v[-1]:g} ({len(v)} points)"
    return str(v)


def _named(*results: MetricResult) -> dict[str, MetricResult]:
    return {r.name: r for r in results}


def _zero_fill_kw(mean: Any, std: Any, b: MetricBatch) -> dict[str, Any]:
    """Pixel zeroing in [0, 1] image space, on the upsampled map's pixels."""
    return {**b.removal_kwargs, "removal": image_space_zero(mean, std), "unit": "pixel",
            "rounding": "floor"}


def _perturbation_metrics(fractions: tuple[float, ...]) -> Callable[..., dict[str, MetricSpec]]:
    """Chefer's perturbation test: accuracy always against the ground-truth label (the
    script compares ``target == argmax``); the pass decides which class the map explains."""
    def table(mean: Any, std: Any) -> dict[str, MetricSpec]:
        def compute(b: MetricBatch) -> dict[str, MetricResult]:
            return _named(*(fa.perturbation_test(
                b.model, b.inputs, b.maps, order=order, labels=b.data_labels,
                fractions=fractions, **_zero_fill_kw(mean, std, b))
                for order in ("negative", "positive")))
        return {"perturbation": MetricSpec(compute, needs_classes=True)}
    return table


def _aopc_lodds(mean: Any, std: Any) -> dict[str, MetricSpec]:
    def metric(fn: Callable[..., MetricResult]) -> MetricSpec:
        return MetricSpec(lambda b: _named(fn(b.model, b.inputs, b.maps,
                                              fractions=TOKENTM_FRACTIONS,
                                              **_zero_fill_kw(mean, std, b))))
    return {"aopc": metric(fa.aopc), "lodds": metric(fa.lodds)}


def _chefer_segmentation(mean: Any, std: Any) -> dict[str, MetricSpec]:
    def compute(b: MetricBatch) -> dict[str, MetricResult]:
        seg = segmentation(b.model, b.inputs, b.maps, cast(Tensor, b.masks), target=b.target,
                           ap_mode="chefer")  # needs_masks: the batch has them
        return {k: seg[k] for k in ("pixel_accuracy", "miou", "map", "mf1")}
    return {"segmentation": MetricSpec(compute, needs_masks=True)}


TIS_STEPS = 224


def _tis_metrics(mean: Any, std: Any) -> dict[str, MetricSpec]:
    def curves(name: str) -> MetricSpec:
        def compute(b: MetricBatch) -> dict[str, MetricResult]:
            kw = {**b.removal_kwargs, "removal": tis_baseline(name), "unit": "pixel",
                  "n_steps": TIS_STEPS, "start_point": False}
            ins = fa.insertion(b.model, b.inputs, b.maps, **kw)
            dele = fa.deletion(b.model, b.inputs, b.maps, **kw)
            diff = fa.insertion_minus_deletion(ins, dele)
            return {f"{r.name}_{name}": dataclasses.replace(r, name=f"{r.name}_{name}")
                    for r in (ins, dele, diff)}
        return MetricSpec(compute)
    table = {f"insdel_{n}": curves(n) for n in ("mean", "blur", "black", "random")}
    table["pointing_game"] = METRICS["pointing_game"]
    table["max_sensitivity"] = METRICS["max_sensitivity"]
    return table


def _token_ratio(mean: Any, std: Any) -> dict[str, MetricSpec]:
    return {"token_ratio": MetricSpec(lambda b: fa.token_ratio(
        b.model, b.inputs, b.maps, labels=b.data_labels, remove_scores=True,
        rounding="floor", **{**b.removal_kwargs, "removal": "token"}))}


def _seg_ap(mean: Any, std: Any) -> dict[str, MetricSpec]:
    return {"raw_ap": MetricSpec(lambda b: {"raw_ap": segmentation(
        b.model, b.inputs, b.maps, cast(Tensor, b.masks), target=b.target,
        raw_upsample="bicubic")["raw_ap"]}, needs_masks=True)}  # needs_masks: has them


def _perturbation_columns() -> tuple[Column, ...]:
    return tuple(Column(f"{h} {o.title()} AUC {a}", t, f"perturbation_{o[:3]}")
                 for t, h in (("predicted", "Predicted"), ("label", "Target"))
                 for o, a in (("negative", "↑"), ("positive", "↓")))


PROTOCOLS: dict[str, Protocol] = {p.name: p for p in (
    Protocol(
        "chefer21_perturbation",
        "Chefer, Gur, Wolf, CVPR 2021, Table 2 (pertubation_eval_from_hdf5.py)",
        _perturbation_metrics(CHEFER_FRACTIONS), ("predicted", "label"),
        _perturbation_columns(),
        {"removal": "zero the top-k pixels of the bilinearly upsampled map, all channels, "
                    "in [0, 1] image space before normalisation (k = int(H*W*f))",
         "fractions": CHEFER_FRACTIONS, "orders": "negative (-map) and positive",
         "accuracy": "top-1 against the ground-truth label (both passes)",
         "auc": "trapezoid over x = 0, 0.1, ..., 0.9, accuracy in percent"},
        CHEFER_NORMALIZATION, needs_labels=True, method_options=START_LAYER_1,
        notes="Verified in hila-chefer/Transformer-Explainability: Resize((224, 224)), "
              "Normalize(0.5, 0.5), x16 bilinear map, topk over 224*224 pixels, zero on all "
              "channels before normalising, accuracy = (label == argmax) for --vis-class top "
              "and target, start_layer=1 for rollout / LRP. Not verified: the AUC scale of "
              "Table 2 (the script prints curves only)."),
    Protocol(
        "tokentm_perturbation",
        "TokenTM (Wu et al., CVPR 2024), perturbation test (Table 2)",
        _perturbation_metrics(TOKENTM_FRACTIONS), ("predicted", "label"),
        _perturbation_columns(),
        {"removal": "zero the top-k pixels of the bilinearly upsampled map in [0, 1] image "
                    "space (as chefer21_perturbation)",
         "fractions": TOKENTM_FRACTIONS, "orders": "negative and positive",
         "accuracy": "top-1 against the ground-truth label",
         "auc": "trapezoid over x in [0, 1], accuracy in percent"},
        needs_labels=True,
        notes="The paper states 5 % increments from 0 to 100 %; it states no "
              "normalisation (the model's own is used)."),
    Protocol(
        "tokentm_aopc_lodds",
        "TokenTM (Wu et al., CVPR 2024), AOPC / LOdds tables",
        _aopc_lodds, ("predicted",),
        (Column("AOPC ↑", "predicted", "aopc"), Column("LOdds ↓", "predicted", "lodds")),
        {"removal": "zero the top-k pixels in [0, 1] image space (as tokentm_perturbation)",
         "fractions": TOKENTM_FRACTIONS,
         "aopc": "mean_K [p(y|x) - p(y|x_K)], y predicted",
         "lodds": "-mean_K log(p(y|x) / p(y|x_K))"},
        notes="K = 0, 5, ..., 100 % as the paper states (K = 0 adds a zero term)."),
    Protocol(
        "tokentm_segmentation",
        "TokenTM (Wu et al., CVPR 2024) Table 1 = Chefer's imagenet_seg_eval.py",
        _chefer_segmentation, ("predicted",),
        (Column("Pixel Acc. ↑ (%)", "predicted", "pixel_accuracy", 100.0),
         Column("mIoU ↑ (%)", "predicted", "miou", 100.0),
         Column("mAP ↑ (%)", "predicted", "map", 100.0)),
        {"threshold": "x16 bilinear, min-max per image, foreground = map > mean(map)",
         "pixel_accuracy": "correct / labelled pixels",
         "miou": "background/foreground IoU accumulated over the data set",
         "map": "two-channel [1 - map, map] AP, flattened (ap_mode='chefer')",
         "mf1": "Chefer's per-row F1 (results files only)"},
        CHEFER_NORMALIZATION, method_options=START_LAYER_1,
        notes="Verified in imagenet_seg_eval.py and utils/metrices.py (AP, F1, IoU). "
              "Masks are resized by nearest-exact, PIL's NEAREST may differ at borders."),
    Protocol(
        "tis_insdel",
        "TIS (Englebert et al., ICCV-W 2023), insertion / deletion (the authors' metrics code)",
        _tis_metrics, ("label",),
        tuple(Column(f"{k} ({n}) {a}", "label", f"{c}_{n}")
              for n in ("mean", "blur", "black", "random")
              for k, c, a in (("Insertion", "insertion", "↑"), ("Deletion", "deletion", "↓"),
                              ("Ins-Del", "insertion_minus_deletion", "↑")))
        + (Column("Pointing game ↑", "label", "pointing_game"),
           Column("Max-Sensitivity ↓", "label", "max_sensitivity")),
        {"ranking": "pixels of the bilinearly upsampled map, descending",
         "n_steps": TIS_STEPS, "pixels_per_step": "ceil(H*W / 224)",
         "curve": "no unperturbed point; x = 1/224, ..., 1; score = softmax probability",
         "baselines": "mean (one scalar), blur (11x11, sigma 5), black (0), random U[0,1), "
                      "in the normalised input space",
         "pointing_game": "skip regions >= 50 % (run when the data has masks)",
         "max_sensitivity": "10 samples, radius 0.02, on the patch map"},
        needs_labels=True, optional={"pointing_game": "masks"},
        notes="Verified in aenglebert/Transformer_Input_Sampling metrics/utils.py: "
              "ceil(HW/n_steps) pixels per step, curves without the start point, softmax of "
              "the class; the repository as checked has only blur and random baselines "
              "(mean and black follow the paper's description). The baselines live in the "
              "model's normalised input space, as TIS defines them (black = 0 = the "
              "normalisation's mean colour). Not reproduced: TIS's Resize(256) + "
              "CenterCrop(224) (the images are resized to the model's input); the AUC "
              "convention of the tables (the repository writes curves only). TIS used a "
              "seeded 5,000-image subset: pass --subset 5000 --subset-seed S."),
    Protocol(
        "skipplus_token_ratio",
        "SkipPLUS (Mehri et al., CVPRW 2024) §4.1, A.1-A.2",
        _token_ratio, ("label",),
        tuple(Column(f"{p.title()} {k}", "label", f"token_ratio_{p}_{c}")
              for p in ("keep", "remove")
              for k, c in (("Acc. AUC", "accuracy"), ("AOPC", "aopc"), ("LOdds", "lodds"))),
        {"removal": "true token masking", "ratios": fa.RATIOS,
         "k": "int(r * P) patches by signed top-k",
         "reference": "ground-truth label (accuracy, AOPC, LOdds)",
         "auc": "trapezoid over the ratios plus the unmasked point (keep: x = 1, remove: "
                "x = 0)"},
        needs_labels=True,
        notes="The paper used a seeded 5,000-image ImageNet val subset (the released code "
              "1,000): pass --subset N --subset-seed S. Its '100 - x' for deletion is "
              "presentation only."),
    Protocol(
        "skipplus_seg_ap",
        "SkipPLUS (Mehri et al., CVPRW 2024) §4.2 (ImageNet-S919 segmentation AP)",
        _seg_ap, ("label",), (Column("AP ↑ (%)", "label", "raw_ap", 100.0),),
        {"map": "raw token map, bicubic upsampling, no normalisation",
         "ap": "binary AP of the map against the class mask, per image, mean",
         "target": "the data's label (ImageNet-S: the present class with the largest area "
                   ">= 5 %)"},
        needs_labels=True,
        notes="From the SkipPLUS authors' code; not verified on real ImageNet-S files."),
)}
"""Preset name -> :class:`Protocol` (the only list of preset names)."""


def get_protocol(name: str) -> Protocol:
    """The preset called ``name``.

    Raises:
        ValueError: an unknown name (the message lists the presets).

    Examples::

        >>> get_protocol("tis_insdel").settings["n_steps"]
        224
    """
    key = str(name).strip().lower().replace("-", "_")
    if key not in PROTOCOLS:
        raise ValueError(f"unknown --protocol {name!r}; choose from {', '.join(PROTOCOLS)}")
    return PROTOCOLS[key]


def check_fixed_options(protocol: Protocol, given: Mapping[str, Any],
                        defaults: Mapping[str, Any]) -> None:
    """Refuse options the preset fixes that were given with a non-default value.

    Args:
        protocol (Protocol): the preset.
        given (Mapping): option name (``FIXED_OPTIONS``) -> value given.
        defaults (Mapping): option name -> the command's default.

    Raises:
        ValueError: naming the conflicting options and the fix.

    Examples::

        >>> check_fixed_options(get_protocol("tis_insdel"), {"steps": 20}, {"steps": 20})
    """
    clash = [o for o in FIXED_OPTIONS if o in given and given[o] != defaults.get(o)]
    if clash:
        opts = ", ".join(f"--{o}" for o in clash)
        raise ValueError(f"--protocol {protocol.name} fixes {opts}; drop {opts} (the preset's "
                         "settings are printed when it starts) or run without --protocol")


def run_protocol(protocol: Protocol, model: nn.Module, data: IndexedData,
                 methods: Mapping[str, MethodFactory], *, preprocess: Any,
                 batch_size: int = 16,
                 seed: int = 0, progress: bool = False, has_masks: bool = False,
                 autocast: str = "none", normalization: str = "model",
                 timings: dict[str, float] | None = None) -> Results:
    r"""Evaluate ``methods`` under a preset: one :func:`~captum_vit.metrics.suite.evaluate`
    pass per explained class, merged (columns get a ``_predicted`` / ``_label`` suffix when
    the preset has both passes).

    Args:
        protocol (Protocol): the preset.
        model (nn.Module): the model (on its device and dtype).
        data (Sequence): examples ``(image, label, mask)``.
        methods (Mapping[str, Callable]): table label -> factory ``model -> Attribution``
            built with the preset's :attr:`Protocol.method_options` (from method names:
            :func:`captum_vit.commands.evaluate.protocol_factories`, which the command
            line uses).
        preprocess (Preprocess): the model's own preprocessing
            (``load_model(...).preprocess``); ``normalization`` decides whether the
            paper's normalisation replaces its mean and std (:meth:`Protocol.preprocess`).
        batch_size (int, optional): images per batch. Default 16.
        seed (int, optional): seed of every random choice. Default 0.
        progress (bool, optional): progress bars. Default False.
        has_masks (bool, optional): whether the data has masks (optional mask metrics).
        autocast (str, optional): passed to :func:`~captum_vit.metrics.suite.evaluate`.
        normalization (str, optional): ``"model"`` (the model's own normalisation) or
            ``"paper"`` (the paper's, where the preset records one; refused when its
            channel count differs from the model's). A
            :class:`ProtocolNormalizationWarning` is given when the paper's normalisation
            differs from the model's. Default ``"model"``.
        timings (dict, optional): filled with method -> seconds per image, summed over
            the preset's passes (:func:`~captum_vit.metrics.suite.evaluate`).

    Returns:
        dict: method -> column -> :class:`MetricResult`.

    Raises:
        ValueError: a preset that needs masks on data without them, an unknown
            ``normalization`` or a paper normalisation of another channel count.

    Examples::

        >>> from captum_vit.models import load_model
        >>> lm = load_model("zoo:vit_fmnist_loc")
        >>> p = get_protocol("tokentm_aopc_lodds")
        >>> from captum_vit.commands.evaluate import protocol_factories
        >>> res = run_protocol(p, lm.model, data, protocol_factories(p, ["gae"]),
        ...                    preprocess=lm.preprocess)
        >>> res["gae"]["aopc"].value
    """
    if protocol.needs_masks and not has_masks:
        raise ValueError(f"--protocol {protocol.name} needs ground-truth masks, which the data "
                         "lacks; use --data imagenet-seg:PATH, imagenet-s:PATH or synthetic")
    own = preprocess
    preprocess = protocol.preprocess(own, normalization) if own is not None else None
    message = None if own is None else protocol.normalization_warning(own, normalization)
    if message is not None:
        warnings.warn(message, ProtocolNormalizationWarning, stacklevel=2)
    mean, std = getattr(preprocess, "mean", None), getattr(preprocess, "std", None)
    table = protocol.metrics(mean, std)
    names = protocol.metric_names(has_masks=has_masks)
    if not isinstance(methods, Mapping):
        raise TypeError("methods must map a label to a factory model -> Attribution with the "
                        "preset's method options; for method names use "
                        "captum_vit.commands.evaluate.protocol_factories(protocol, names, "
                        "seed=seed)")
    factories = dict(methods)
    out: Results = {m: {} for m in factories}
    for explain in protocol.explain:
        seconds: dict[str, float] = {}
        res = suite.evaluate(model, data, factories, names, preprocess=preprocess,
                             settings=EvalSettings(batch_size=batch_size, seed=seed,
                                                   explain=explain, autocast=autocast),
                             progress=progress, table=table, timings=seconds)
        if timings is not None:
            for m, t in seconds.items():
                timings[m] = timings.get(m, 0.0) + t
        for m in factories:
            for c, r in res[m].items():
                key = f"{c}_{explain}" if len(protocol.explain) > 1 else c
                out[m][key] = dataclasses.replace(r, name=key)
    return out


def protocol_rows(protocol: Protocol, results: Results) -> list[list[str]]:
    r"""The cells of the paper's table: one row per method (its name first), the preset's
    columns formatted as in ``protocol.md`` (2 decimals for a column holding a value >= 1,
    such as percentages, else 4; empty where a column is missing).

    Args:
        protocol (Protocol): the preset.
        results (dict): method -> column -> :class:`MetricResult` (:func:`run_protocol`).

    Returns:
        list[list[str]]: rows ``[method, cell, ...]`` in the order of :attr:`Protocol.columns`.
    """
    several = len(protocol.explain) > 1

    def value(cols: Mapping[str, MetricResult], c: Column) -> float | None:
        r = cols.get(f"{c.key}_{c.explain}" if several else c.key)
        return None if r is None else r.value * c.scale

    wide = {c: any(abs(v) >= 1 for cols in results.values()
                   if (v := value(cols, c)) is not None and not math.isnan(v))
            for c in protocol.columns}
    rows = []
    for m, cols in results.items():
        vals = [m]
        for c in protocol.columns:
            v = value(cols, c)
            vals.append("" if v is None else "nan" if math.isnan(v)
                        else f"{v:.2f}" if wide[c] else f"{v:.4f}")
        rows.append(vals)
    return rows


def protocol_table(protocol: Protocol, results: Results, config: Mapping[str, Any]) -> str:
    r"""The paper's table (``protocol.md``): one row per method, the paper's columns, then
    the normalisation the run used, a warning when the paper's differs from the model's,
    and the preset's notes.

    Args:
        protocol (Protocol): the preset.
        results (dict): method -> column -> :class:`MetricResult` (:func:`run_protocol`).
        config (Mapping): ``model``, ``data`` and ``n`` for the title; optional
            ``normalization_rule`` and ``normalization_warning`` (the command's).

    Returns:
        str: the markdown text.

    Examples::

        >>> print(protocol_table(get_protocol("tokentm_aopc_lodds"), results,
        ...                      {"model": "timm:vit_base_patch16_224", "data": "cifar10:..",
        ...                       "n": 1000}))
    """
    lines = [f"# {protocol.source}", "",
             f"`--protocol {protocol.name}`: {config.get('model')} on {config.get('data')} "
             f"(n={config.get('n')})", "",
             "| method | " + " | ".join(c.header for c in protocol.columns) + " |",
             "|---|" + "---:|" * len(protocol.columns)]
    lines += ["| " + " | ".join(row) + " |" for row in protocol_rows(protocol, results)]
    if config.get("normalization_rule"):
        lines += ["", f"Normalisation: {config['normalization_rule']}."]
    if config.get("normalization_warning"):
        lines += ["", f"**Warning:** {config['normalization_warning']}."]
    if protocol.notes:
        lines += ["", f"Notes: {protocol.notes}"]
    return "\n".join(lines) + "\n"


def write_protocol_table(out: str | Path, protocol: Protocol, results: Results,
                         config: Mapping[str, Any]) -> Path:
    """Write :func:`protocol_table` to ``out/protocol.md``; returns the path."""
    path = Path(out) / "protocol.md"
    path.write_text(protocol_table(protocol, results, config))
    return path


__all__ = ["CHEFER_FRACTIONS", "Column", "FIXED_OPTIONS", "NORMALIZATIONS", "PROTOCOLS",
           "Protocol", "ProtocolNormalizationWarning", "TOKENTM_FRACTIONS",
           "check_fixed_options", "get_protocol", "protocol_rows", "protocol_table",
           "run_protocol", "write_protocol_table"]
