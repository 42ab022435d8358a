"""The one engine that scores many kept-token subsets of a batch.

A *job* is one (image, subset) pair: the model runs on the image's prefix tokens plus the
patch tokens the subset keeps, taken right after the positional embedding so that every
kept token keeps its own position (true token removal, :mod:`captum_vit.metrics.removal`).
TIS (:mod:`captum_vit.methods.tis`, one job per mask) and the token-removal metrics
(:mod:`captum_vit.metrics.faithfulness`, one job per removal step) are both a batch of
such jobs, scored here by :func:`subset_logits`.

Planning: the jobs of the whole batch (across images AND subsets) are grouped by their
sequence length ``K + kept``. A forward of ``c`` sequences padded to length ``n`` is
modelled to cost ``c * t(n) + overhead`` token units, where ``t(n) = n + n**2 / w`` (the
per-token linear maps plus the per-pair attention, ``w`` from the block's widths) and
``overhead`` is a fixed per-forward cost (:data:`FORWARD_OVERHEAD_TOKENS`).
:func:`plan_chunks` minimises the modelled cost by dynamic programming over the sorted
distinct lengths, so jobs of different lengths share a forward only where the padding
costs less than the forwards it saves. Shorter sequences of a mixed chunk are padded and
the padding masked out as attention keys and from average pooling
(:class:`~captum_vit.adapters.ops.FusedOps`), which gives the same logits as running
every job alone.

Its pixel-side twin, :func:`image_logits`, runs the model's own forward on many perturbed
copies of the images (ScoreCAM's masked images, RISE's random masks, ViT-CX's cluster masks
with noise), ``batch_size`` images per forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import cast

import numpy as np
import torch
from torch import Tensor

from captum_vit.adapters.base import ViTAdapter
from captum_vit.adapters.ops import FusedOps
from captum_vit.adapters.parts import BlockParts, NormParts

FORWARD_OVERHEAD_TOKENS: dict[str, float] = {"cpu": 32.0, "cuda": 1024.0}
"""Fixed cost of one forward pass in token units (token-forwards of the same model), per
device type. CPU: measured on ViT-S/16 with one thread (about 9 ms per forward against
0.34 ms per token). CUDA: an estimate (kernel launches dominate small forwards); other
devices use the CPU value."""


def forward_overhead(device: torch.device | str) -> float:
    """The per-forward overhead of :data:`FORWARD_OVERHEAD_TOKENS` for ``device``."""
    kind = torch.device(device).type
    return FORWARD_OVERHEAD_TOKENS.get(kind, FORWARD_OVERHEAD_TOKENS["cpu"])


def plan_chunks(lengths: Sequence[int], batch_size: int | None = None, *,
                overhead: float = FORWARD_OVERHEAD_TOKENS["cpu"],
                attention_width: float = math.inf) -> list[list[int]]:
    """Group jobs of the given sequence lengths into forward passes of least modelled cost.

    The cost of a forward of ``c`` sequences padded to length ``n`` is
    ``c * (n + n**2 / attention_width) + overhead``. Jobs are sorted by length; dynamic
    programming over the distinct lengths picks the contiguous groups of least total
    cost (a group of ``C`` jobs whose longest is ``n`` costs ``C * t(n) +
    ceil(C / batch_size) * overhead``); each group is then split, in order, into chunks
    of at most ``batch_size`` jobs.

    Args:
        lengths (Sequence[int]): sequence length of every job.
        batch_size (int, optional): most jobs per forward; ``None`` = no limit.
        overhead (float): fixed cost of one forward, in token units.
        attention_width (float): ``w`` in the per-sequence cost ``n + n**2 / w``
            (``inf`` = linear in the length).

    Returns:
        list of lists of job indices: every job exactly once, each chunk sorted by
        length (stable), chunks in increasing length.

    Examples::

        >>> plan_chunks([5, 5, 100], overhead=32.0)    # the long job alone
        [[0, 1], [2]]
        >>> plan_chunks([5, 6, 7], overhead=32.0)      # padding by 1-2 tokens pays
        [[0, 1, 2]]
    """
    if len(lengths) == 0:
        return []
    lens = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(lens, kind="stable")
    values, counts = np.unique(lens, return_counts=True)
    cum = np.concatenate([[0], np.cumsum(counts)])
    cost = values + values.astype(np.float64) ** 2 / attention_width
    bs = math.inf if batch_size is None else batch_size
    best = np.zeros(len(values) + 1)
    start = np.zeros(len(values) + 1, dtype=np.int64)
    for e in range(1, len(values) + 1):  # best plan of the e shortest lengths
        jobs = cum[e] - cum[:e]  # group = distinct lengths a..e-1, for every a < e
        forwards = np.ones(e) if bs == math.inf else np.ceil(jobs / bs)
        total = best[:e] + jobs * cost[e - 1] + forwards * overhead
        start[e] = int(np.argmin(total))
        best[e] = total[start[e]]
    groups = []
    e = len(values)
    while e > 0:
        groups.append((int(cum[start[e]]), int(cum[e])))
        e = int(start[e])
    step = len(lens) if batch_size is None else batch_size
    return [order[lo:min(lo + step, hi)].tolist()
            for lo_group, hi in reversed(groups) for lo in range(lo_group, hi, step)]


def _attention_width(adapter: ViTAdapter, dim: int) -> float:
    """``w`` of the cost ``n + n**2 / w``: per-token linear MACs over per-pair attention MACs."""
    p = adapter.blocks[0]
    a, hidden = p.inner_dim, p.fc1_weight.shape[0]
    return (2 * dim * a + dim * hidden) / a  # (4·D·A + 2·D·F) / (2·A)


def _check_keep(keep: Tensor, batch: int, num_patches: int) -> Tensor:
    if not isinstance(keep, Tensor) or keep.dtype != torch.bool:
        raise TypeError("keep must be a bool tensor [B, S, P] (True = patch kept), got "
                        f"{getattr(keep, 'dtype', type(keep).__name__)}")
    if keep.dim() != 3 or keep.shape[0] not in (1, batch) or keep.shape[2] != num_patches:
        raise ValueError(f"keep must have shape [{batch} or 1, S, {num_patches}], got "
                         f"{tuple(keep.shape)}")
    return keep.expand(batch, -1, -1)


class FirstBlockShared(FusedOps):
    """:class:`FusedOps` whose first block reads its token-wise work from a cache.

    In the first block, everything up to the attention is per token: ``u = LN1(x)`` and
    the heads ``q, k, v`` (projections, q/k norms, rotary embedding at each token's
    original position). For many subsets of the same images these are computed once per
    image (:meth:`prepare`) and gathered for every subset (:meth:`for_chunk`), instead
    of recomputed for every shortened sequence; the attention itself, which mixes the
    kept tokens, runs per subset (:meth:`BlockParts.attend`). Same values as the plain
    forward: the gathered rows are the rows the shortened sequence would compute.

    Examples::

        >>> shared = FirstBlockShared.prepare(adapter, x0)
        >>> ops = shared.for_chunk(images, positions, key_mask)   # one chunk of subsets
        >>> logits = adapter.run(tokens, ops=ops)
    """

    def __init__(self, first: BlockParts, u: Tensor, heads: tuple[Tensor, Tensor, Tensor],
                 key_mask: Tensor | None = None, positions: Tensor | None = None,
                 images: Tensor | None = None) -> None:
        super().__init__(key_mask=key_mask, positions=positions)
        self.first, self.u, self.heads, self.images = first, u, heads, images

    @classmethod
    def prepare(cls, adapter: ViTAdapter, x0: Tensor) -> FirstBlockShared:
        """The first block's token-wise tensors of the full sequences ``x0`` [B, N, D]:
        ``u`` [B, N, D] and the heads stored token-major, [B, N, H, d] each."""
        adapter.refresh()
        first = adapter.blocks[0]
        ops = FusedOps()
        u = x0 if first.norm1 is None else ops.norm(x0, first.norm1)
        q, k, v = first._qkv(u, False)  # positions None = the full sequence 0..N-1
        return cls(first, u, tuple(t.transpose(1, 2) for t in (q, k, v)))  # type: ignore[arg-type]

    def for_chunk(self, images: Tensor, positions: Tensor,
                  key_mask: Tensor | None) -> FirstBlockShared:
        """The ops of one chunk: sequence ``c`` holds the tokens ``positions[c]`` [C, n]
        (original indices) of image ``images[c]``; ``key_mask`` as in :class:`FusedOps`."""
        return FirstBlockShared(self.first, self.u, self.heads, key_mask, positions,
                                images[:, None])

    def _gather(self, t: Tensor) -> Tensor:
        return t[self.images, self.positions]

    def norm(self, x: Tensor, p: NormParts) -> Tensor:
        if p is self.first.norm1 and self.images is not None:
            return self._gather(self.u)
        return super().norm(x, p)

    def attention(self, u: Tensor, p: BlockParts) -> tuple[Tensor, None]:
        if p is not self.first or self.images is None:
            return super().attention(u, p)
        q, k, v = (self._gather(t).transpose(1, 2) for t in self.heads)  # [C, H, n, d]
        mix, _ = p.attend(q, k, v, materialize=False, key_mask=self.key_mask,
                          positions=self.positions)
        return mix, None


def _forward_chunk(adapter: ViTAdapter, x0: Tensor, images: Tensor, keep: Tensor,
                   kept: Tensor, shared: FirstBlockShared | None = None) -> Tensor:
    """Logits of one chunk: image ``images[c]`` with the patches ``keep[c]`` [C, P], of
    which there are ``kept[c]``; padded with key masks when the counts differ; with
    ``shared``, the first block's token-wise work is gathered from it."""
    k, c = adapter.num_prefix, len(images)
    n_max = int(kept.max())
    if int(kept.min()) == n_max:
        idx = keep.nonzero()[:, 1].reshape(c, n_max)  # kept patches, increasing
        key_mask = None
    else:  # kept patches in increasing order first, then (padding) the others
        idx = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :n_max]
        valid = torch.arange(n_max, device=keep.device) < kept[:, None]
        key_mask = torch.cat([valid.new_ones(c, k), valid], dim=1)
    prefix = torch.arange(k, device=idx.device).expand(c, k)
    positions = torch.cat([prefix, k + idx], dim=1)  # original token indices
    x = torch.cat([x0[images, :k], x0[images[:, None], k + idx]], dim=1)
    ops = (FusedOps(key_mask=key_mask, positions=positions) if shared is None
           else shared.for_chunk(images, positions, key_mask))
    return adapter.run(x, ops=ops)


def _without_forward(kept: Tensor, num_patches: int, num_prefix: int,
                     reuse_full: bool, pools_patches: bool = False) -> tuple[Tensor, Tensor]:
    """The jobs :func:`subset_logits` answers without a forward: ``(reused, empty)``, those
    keeping every patch (given the full logits) and those without output: no token at all,
    or no patch when the readout averages the patch rows (the mean of nothing)."""
    reused = kept == num_patches if reuse_full else torch.zeros_like(kept, dtype=torch.bool)
    return reused, kept + (0 if pools_patches else num_prefix) == 0


def pools_patches(adapter: ViTAdapter) -> bool:
    """Whether the adapter's readout averages the patch rows (``'avg'``, ``'cls_mean'``):
    then a subset without patches has no output, even with prefix tokens kept."""
    return adapter.readout in ("avg", "cls_mean")


def subset_forwards(keep: Tensor, num_prefix: int, *, reuse_full: bool,
                    pools_patches: bool = False) -> int:
    """How many sequences :func:`subset_logits` runs through the model for ``keep``
    [B, S, P] (with ``reuse_full``: ``full_logits`` given; expand masks shared by the
    batch to B first; ``pools_patches``: :func:`pools_patches` of the adapter), for
    reporting a method's forwards (``num_forwards``).

    Examples::

        >>> keep = torch.tensor([[[True, True], [True, False], [False, False]]])
        >>> subset_forwards(keep, 1, reuse_full=True)   # the full subset reuses the logits
        2
        >>> subset_forwards(keep, 0, reuse_full=True)   # and the empty one has no tokens
        1
    """
    reused, empty = _without_forward(keep.sum(-1), keep.shape[-1], num_prefix, reuse_full,
                                     pools_patches)
    return int((~(reused | empty)).sum())


def subset_logits(adapter: ViTAdapter, x0: Tensor, keep: Tensor, *,
                  batch_size: int | None = None, full_logits: Tensor | None = None,
                  reduce: Callable[[Tensor, Tensor], Tensor] | None = None,
                  show_progress: bool = False, desc: str = "subsets",
                  progress_delay: float = 0.0, share_first_block: bool = True) -> Tensor:
    """Logits of the model on many kept-token subsets of every image (one engine).

    Job ``(b, s)`` runs the prefix tokens plus the patch tokens ``keep[b, s]`` of image
    ``b`` (each keeps its position). Jobs of all images and subsets are batched together
    by :func:`plan_chunks`; a chunk mixing lengths is padded with key masks, which equals
    running every job alone. A job without output (no token at all, or no patch when the
    readout averages the patch rows: :func:`pools_patches`) has its logits defined as 0
    (uniform probabilities).
    No gradients. The first block's token-wise work (``LN1`` and the ``q``, ``k``, ``v``
    heads) is computed once per image and gathered for every job
    (:class:`FirstBlockShared`).

    Args:
        adapter (ViTAdapter): the model's adapter.
        x0 (Tensor): embedding output [B, N, D] (tokens after the positional embedding).
        keep (Tensor): bool [B, S, P] or [1, S, P] (shared), ``True`` = patch kept.
        batch_size (int, optional): most sequences per forward; ``None`` = no limit.
        full_logits (Tensor, optional): logits [B, classes] of the full sequences (e.g.
            the clean forward a caller already has); jobs keeping every patch reuse them
            instead of a forward.
        reduce (callable, optional): ``reduce(logits [n, classes], images [n]) ->
            values [n, ...]`` applied to every forward's logits (``images`` = the image
            index of each row); its values are stored instead of the logits (e.g. one
            target score per job, so the logits of all jobs are never held at once).
        show_progress (bool): tqdm progress bar over the jobs.
        desc (str): the progress bar's label.
        progress_delay (float): seconds before the bar appears (tqdm's ``delay``): a
            short run shows none.
        share_first_block (bool): gather the first block's token-wise work from one
            computation per image (``False``: every job recomputes it; the same logits,
            up to the BLAS kernel's choice for very small matrices).

    Returns:
        Tensor: logits [B, S, classes] (or ``reduce``'s values [B, S, ...]).

    Examples::

        >>> x0 = adapter.embed(images)
        >>> keep = torch.rand(len(images), 16, adapter.layout(images).num_patches) < 0.5
        >>> logits = subset_logits(adapter, x0, keep, batch_size=64)   # [B, 16, classes]
    """
    from tqdm.auto import tqdm

    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                   or batch_size < 1):
        raise ValueError(f"batch_size must be a positive int or None, got {batch_size!r}")
    b, n, d = x0.shape
    k = adapter.num_prefix
    adapter.check_token_removal()
    keep = _check_keep(keep, b, n - k).to(x0.device)
    if full_logits is not None and (full_logits.dim() != 2 or full_logits.shape[0] != b):
        raise ValueError(f"full_logits must be [B, classes] with B={b}, got "
                         f"{tuple(full_logits.shape)}")
    s = keep.shape[1]
    kept = keep.sum(-1)  # [B, S]
    out: Tensor | None = None

    def store(ii: Tensor, jj: Tensor, logits: Tensor) -> None:
        nonlocal out
        values = logits if reduce is None else reduce(logits, ii)
        if out is None:
            out = values.new_empty((b, s) + tuple(values.shape[1:]))
        out[ii, jj] = values

    run = torch.ones_like(kept, dtype=torch.bool)
    reused, empty = _without_forward(kept, n - k, k, full_logits is not None,
                                     pools_patches(adapter))
    with torch.no_grad(), tqdm(total=b * s, desc=desc, unit="seq", delay=progress_delay,
                               disable=not show_progress) as bar:
        # rows are reused only when full_logits is given
        for done, logits_of in ((reused, lambda i: cast(Tensor, full_logits)[i]),
                                (empty, lambda i: x0.new_zeros(len(i), adapter.num_classes))):
            ii, jj = done.nonzero(as_tuple=True)
            if len(ii):
                store(ii, jj, logits_of(ii))
                bar.update(len(ii))
            run &= ~done
        ii, jj = run.nonzero(as_tuple=True)
        lengths = (kept[ii, jj] + k).tolist()
        plan = plan_chunks(lengths, batch_size, overhead=forward_overhead(x0.device),
                           attention_width=_attention_width(adapter, d))
        shared = FirstBlockShared.prepare(adapter, x0) if share_first_block and plan else None
        for chunk in plan:
            c = torch.as_tensor(chunk, device=x0.device)
            ci, cj = ii[c], jj[c]
            store(ci, cj, _forward_chunk(adapter, x0, ci, keep[ci, cj], kept[ci, cj], shared))
            bar.update(len(chunk))
    if out is None:  # no job at all (S == 0)
        empty_rows = torch.zeros(0, dtype=torch.long, device=x0.device)
        store(empty_rows, empty_rows, x0.new_zeros(0, adapter.num_classes))
    assert out is not None
    return out


def image_logits(adapter: ViTAdapter, num_jobs: int,
                 make: Callable[[Tensor], tuple[Tensor, Tensor]], *,
                 batch_size: int | None = None,
                 reduce: Callable[[Tensor, Tensor], Tensor] | None = None,
                 show_progress: bool = False, desc: str = "images",
                 device: torch.device | str | None = None) -> Tensor:
    """Logits of the model's own forward on many perturbed images (the pixel engine).

    Jobs ``0 .. num_jobs-1`` are run in order, ``batch_size`` per forward; ``make(jobs)``
    builds the perturbed images of a chunk of job indices only when it is run, so masks
    and noise never have to be held for all jobs at once. No gradients.

    Args:
        adapter (ViTAdapter): the model's adapter (:meth:`ViTAdapter.model_logits` runs
            the model's own forward; inside :meth:`ViTAdapter.targeting` it gives the
            scores against the target embeddings).
        num_jobs (int): number of perturbed images.
        make (callable): ``make(jobs [n] int64) -> (images [n, C, H, W], owners [n])``,
            ``owners`` = the index of the original image of each job (passed to
            ``reduce``).
        batch_size (int, optional): most images per forward; ``None`` = all at once.
        reduce (callable, optional): ``reduce(logits [n, classes], owners [n]) -> values
            [n, ...]`` applied to every forward's logits (e.g. the target probability of
            each job), stored instead of the logits.
        show_progress (bool): tqdm progress bar over the jobs.
        desc (str): the progress bar's label.
        device (torch.device, optional): device of the job indices passed to ``make``
            (default: the CPU).

    Returns:
        Tensor: logits [num_jobs, classes] (or ``reduce``'s values [num_jobs, ...]).

    Examples::

        >>> masks = torch.rand(16, 1, *images.shape[-2:]) < 0.5
        >>> def make(jobs):   # image b under mask i for job b * 16 + i
        ...     return images[jobs // 16] * masks[jobs % 16], jobs // 16
        >>> logits = image_logits(adapter, len(images) * 16, make, batch_size=64)
    """
    from tqdm.auto import tqdm

    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                   or batch_size < 1):
        raise ValueError(f"batch_size must be a positive int or None, got {batch_size!r}")
    step = max(num_jobs, 1) if batch_size is None else batch_size
    out: Tensor | None = None
    with torch.no_grad(), tqdm(total=num_jobs, desc=desc, unit="img",
                               disable=not show_progress) as bar:
        for lo in range(0, num_jobs, step):
            jobs = torch.arange(lo, min(lo + step, num_jobs), device=device)
            images, owners = make(jobs)
            logits = adapter.model_logits(images)
            values = logits if reduce is None else reduce(logits, owners)
            if out is None:
                out = values.new_empty((num_jobs,) + tuple(values.shape[1:]))
            out[lo:lo + len(jobs)] = values
            bar.update(len(jobs))
    if out is None:
        raise ValueError("image_logits needs at least one job (num_jobs >= 1)")
    return out
