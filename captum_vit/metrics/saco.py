"""SaCo — the Salience-guided Faithfulness Coefficient (Wu et al., CVPR 2024, Alg. 1).

Per image, with the map ``m`` over the P patch tokens and K groups:

1. sort the patches by descending salience (stable: ties keep the lower index first) and
   split them into K contiguous groups ``G_1 .. G_K`` (numpy ``array_split`` sizes: the
   first ``P mod K`` groups have one patch more — a captum_vit choice);
2. ``s(G_i) = Σ_{u ∈ G_i} m_u`` and ``Δ(G_i) = p(ŷ|x) − p(ŷ|x without G_i)``, p the softmax
   probability of the explained class ŷ (the predicted class by default, as Alg. 1);
3. ``F = Σ_{i<j} σ_ij (s(G_i) − s(G_j)) / Σ_{i<j} |s(G_i) − s(G_j)|`` with ``σ_ij = +1`` if
   ``Δ(G_i) ≥ Δ(G_j)`` else −1; ``F = 0`` when the denominator is 0.

``F ∈ [−1, 1]``: 1 when groups of higher salience always change the prediction at least as
much as groups of lower salience. Groups are removed through the removal engine
(:class:`~captum_vit.metrics.removal.RemovalEngine`): true token removal by default
(the adapters' subset engine), or a pixel baseline (``removal="black"``, ``"mean"``,
``"blur"``, ``"random"`` or a fill callable). The paper's fill value for pixel removal is
not confirmed here (to be verified against the paper for parity). Cost: K removal
jobs per image, batched over images and groups.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor, nn

from captum_vit._base import TargetLike, check_scalar
from captum_vit.adapters import probabilities
from captum_vit.metrics.maps import AttributionLike, patch_maps, ranking
from captum_vit.metrics.removal import RemovalEngine, example_seeds, prepare_metric, vector_targets
from captum_vit.metrics.results import MetricResult
from captum_vit.metrics.settings import EvalSettings, Removal, forward_batch_of


def group_sizes(num_units: int, n_groups: int) -> list[int]:
    """Sizes of ``n_groups`` contiguous groups of ``num_units`` (numpy ``array_split``).

    Examples::

        >>> group_sizes(10, 4)
        [3, 3, 2, 2]
    """
    q, r = divmod(num_units, n_groups)
    return [q + 1] * r + [q] * (n_groups - r)


def saco_coefficient(salience: Tensor, delta: Tensor) -> Tensor:
    r"""Alg. 1's coefficient from the group saliences and probability drops.

    Args:
        salience (Tensor): ``s(G_i)`` [B, K], groups in descending salience order.
        delta (Tensor): ``Δ(G_i)`` [B, K].

    Returns:
        Tensor: ``F`` [B] (float64; 0 where every pair has equal salience).

    Examples::

        >>> saco_coefficient(torch.tensor([[3.0, 2.0, 1.0]]), torch.tensor([[0.5, 0.2, 0.1]]))
        tensor([1.], dtype=torch.float64)
    """
    s, d = salience.double(), delta.double()
    k = s.shape[1]
    i, j = torch.triu_indices(k, k, offset=1, device=s.device)
    diff = s[:, i] - s[:, j]
    sign = torch.where(d[:, i] >= d[:, j], 1.0, -1.0).to(diff)
    num, den = (sign * diff).sum(1), diff.abs().sum(1)
    return torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 0.0)


@vector_targets
def saco(model: nn.Module, inputs: Tensor, attribution: AttributionLike, *,
         n_groups: int = 10, target: TargetLike = None, removal: Removal | None = None,
         forward_batch: int | None = None, pixel_reduce: str = "abs",
         attribute_kwargs: dict | None = None, example_ids: Any = None, seed: int | None = None,
         settings: EvalSettings | None = None, **deprecated: Any) -> MetricResult:
    r"""SaCo, the salience-guided faithfulness coefficient (Wu et al., CVPR 2024, Alg. 1).

    See the module docstring for the definition. Higher is better; 1 means the map ranks
    every pair of patch groups in the order of their effect on the explained class.

    Args:
        model (nn.Module): a supported ViT classifier.
        inputs (Tensor): images [B, C, H, W].
        attribution: maps or an attribution (see
            :func:`~captum_vit.metrics.removal.patch_maps`); signed scores are used as
            they are.
        n_groups (int): K, the number of salience groups, in ``[1, P]``. Default 10.
        target (optional): the explained class ŷ (``None``: the predicted class).
        removal (str or Callable): ``"token"`` (default: true token removal) or a pixel
            baseline (:data:`~captum_vit.metrics.removal.REMOVALS`, or a fill callable).
        forward_batch (int): jobs per forward (``batch_size=`` is its deprecated
            spelling). Default 64.
        pixel_reduce (str): pooling of pixel maps to patches (``"abs"`` or ``"sum"``).
        attribute_kwargs (dict, optional): extra ``attribute`` options.
        example_ids (optional): data set index of each image (seeds of ``"random"``).
        seed (int): seed of the ``"random"`` baseline. Default 0.
        settings (EvalSettings, optional): removal, forward batch (``jobs_per_forward``)
            and seed in one object (:class:`~captum_vit.metrics.settings.EvalSettings`);
            the keywords above win. Default ``EvalSettings()``.

    Returns:
        MetricResult: ``saco`` per image; ``curves`` = ``Δ(G_i)`` [B, K] with ``x`` = the
        group index / K (groups in descending salience).

    Raises:
        ValueError: ``n_groups`` outside ``[1, P]``, an unknown removal.

    Examples::

        >>> from captum_vit import GAE
        >>> from captum_vit.metrics import saco
        >>> saco(model, images, GAE(model)).value
        >>> saco(model, images, GAE(model), n_groups=5, removal="black").value
    """
    adapter, prep = prepare_metric(model, inputs, target)
    images, layout = prep.images, prep.layout
    p = layout.num_patches
    check_scalar(n_groups, "n_groups", int, min_val=1, max_val=p)
    s = EvalSettings() if settings is None else settings
    removal = s.removal if removal is None else removal
    forward_batch = forward_batch_of(forward_batch, deprecated, "saco")
    if deprecated:
        raise TypeError(f"saco() got unexpected keyword arguments {sorted(deprecated)}")
    forward_batch = s.jobs_per_forward if forward_batch is None else forward_batch
    seed = s.seed if seed is None else seed
    engine = RemovalEngine(model, removal, forward_batch, adapter=adapter)
    scores = patch_maps(attribution, images, prep.target, layout, pixel_reduce=pixel_reduce,
                        attribute_kwargs=attribute_kwargs).double()
    b = images.shape[0]
    order = ranking(scores)  # [B, P] most salient first
    group_of_rank = torch.repeat_interleave(
        torch.arange(n_groups), torch.tensor(group_sizes(p, n_groups))).to(order.device)
    group = torch.empty_like(order)
    group.scatter_(1, order, group_of_rank.expand(b, -1))  # group of each patch [B, P]
    removed = group[:, None, :] == torch.arange(n_groups, device=order.device)[None, :, None]
    salience = torch.zeros(b, n_groups, dtype=torch.float64, device=scores.device)
    salience.scatter_add_(1, group.to(scores.device), scores)
    logits = engine.masked_logits(images, removed, full_logits=prep.logits,
                                  seeds=example_seeds(example_ids, b, seed))
    # prepare_metric resolves the target and runs the model
    y = cast(Tensor, prep.target).to(logits.device)
    kind = adapter.probability
    p0 = probabilities(cast(Tensor, prep.logits).double(), kind).gather(1, y[:, None])
    pk = probabilities(logits.double(), kind).gather(2, y[:, None, None].expand(-1, n_groups, 1))
    delta = p0 - pk.squeeze(2)
    x = torch.arange(1, n_groups + 1, dtype=torch.float64) / n_groups
    return MetricResult("saco", saco_coefficient(salience, delta.to(salience.device)), True,
                        x, delta)


__all__ = ["group_sizes", "saco", "saco_coefficient"]
