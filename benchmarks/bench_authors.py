"""The authors' code against captum_vit, side by side in one run.

The authors' code cannot be vendored (TIS has no licence), so this script measures
against faithful re-implementations of their algorithms, written here in our own code
with their loop structure, on the SAME model and weights (a deep copy):

* **GAE** (Chefer, Gur & Wolf 2021, ``Transformer-MM-Explainability``'s ViT notebook,
  ``generate_relevance``): one image per call; the model's attention modules save every
  block's probabilities in the forward and register a tensor hook saving their gradient;
  ``one_hot.backward()`` of the target logit (parameter gradients included, as their
  ``model.zero_grad(); one_hot.backward(retain_graph=True)``); then ``R = I`` and, per
  block, ``R += mean_h(clamp(grad ⊙ attn, min=0)) @ R``; the map is ``R[0, 1:]``.
* **Rollout** (Chefer et al.'s baseline, ``Transformer-Explainability``'s
  ``Baselines.generate_rollout`` and ``compute_rollout_attention``): one batched forward
  of the model as it is (autograd on, as their code), the head mean of every block's
  saved probabilities, ``(A + I) / rowsum`` and full ``N × N`` matrix products
  ``M_{L-1} ⋯ M_0``; the map is row 0.
* **TIS** (Englebert et al.): ``benchmarks/authors_tis.py`` (``authors_tis``: batch 1,
  their torch KMeans, their masked forwards), when that file exists; captum_vit's TIS is
  timed exactly (every mask, interleaved with theirs) and in its anytime mode
  (``tolerance=0.95``, timed alone against the same authors' median), with the Spearman
  correlation of each image's anytime map with its exact map (patch tokens).

Before timing, the script checks that each re-implementation gives captum_vit's maps
(max relative difference printed; TIS on the same given masks, since the two KMeans
differ). Timings are interleaved: per repeat, the authors' version and ours alternate
(who goes first alternates too), and the table gives the medians. GAE and Rollout are
timed twice: back to back, and "settled" (each timed call right after an untimed call of
the same code, see :func:`interleaved`: the side that follows the other otherwise pays
for the memory the other left behind). The model is a random
timm ``vit_small_patch16_224``-shaped ``VisionTransformer`` (``benchmarks/speed.py``'s
``vit_s16``) at ``--img-size`` (default 112 px = 50 tokens), float32, ``--threads`` 2.

Run from the repository root (package installed, or ``PYTHONPATH=.``)::

    MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=4294967296 \\
        python benchmarks/bench_authors.py [--img-size 112] [--batches 1 8] \\
        [--threads 2] [--repeats 7] [--tis-masks 256 1024] [--tis-repeats 1] [--no-tis]

Output: a markdown table ``method | batch | authors' ms | captum_vit ms | speed-up``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

import torch
from speed import vit_s16
from torch import Tensor, nn

from captum_vit import GAE, TIS, Rollout
from captum_vit.methods.tis import spearman

HERE = os.path.dirname(os.path.abspath(__file__))


# -- the authors' algorithms, re-implemented -------------------------------------------------
class SavedAttention:
    """Their ``Attention`` module's bookkeeping on a timm model: every block's
    probabilities saved in the forward (``save_attention_map``) and, with
    ``register_hook``, their gradient saved by a tensor hook (``save_attn_gradients``).

    The timm blocks run their explicit attention path (``fused_attn = False``, the only
    one that has probabilities); a forward hook on ``attn_drop`` (the identity in eval
    mode) sees them, exactly where the authors' module saves them.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.register_hook = False
        self.attn: list[Tensor] = []
        self.grads: list[Tensor | None] = []
        for blk in model.blocks:
            blk.attn.fused_attn = False
            blk.attn.attn_drop.register_forward_hook(self._save)

    def _save(self, module: nn.Module, inputs: tuple, attn: Tensor) -> None:
        i = len(self.attn)
        self.attn.append(attn)
        self.grads.append(None)
        if self.register_hook and attn.requires_grad:
            attn.register_hook(lambda g, i=i: self.grads.__setitem__(i, g))

    def __call__(self, x: Tensor, register_hook: bool = False) -> Tensor:
        self.attn, self.grads, self.register_hook = [], [], register_hook
        return self.model(x)


def authors_gae(saved: SavedAttention, image: Tensor, index: int) -> Tensor:
    """``generate_relevance`` of the GAE ViT notebook for ONE image [1, C, H, W]."""
    output = saved(image, register_hook=True)
    one_hot = torch.zeros(1, output.shape[-1], dtype=output.dtype)
    one_hot[0, index] = 1
    one_hot = torch.sum(one_hot.requires_grad_(True) * output)
    saved.model.zero_grad()
    one_hot.backward(retain_graph=True)
    n = saved.attn[0].shape[-1]
    r = torch.eye(n, n, dtype=output.dtype)
    for cam, grad in zip(saved.attn, saved.grads, strict=True):
        cam = cam.reshape(-1, n, n)  # avg_heads: batch and heads together (batch 1)
        grad = grad.reshape(-1, n, n)
        cam = (grad * cam).clamp(min=0).mean(dim=0)
        r += torch.matmul(cam, r)  # apply_self_attention_rules
    return r[0, 1:]


def authors_gae_batch(saved: SavedAttention, x: Tensor, target: Tensor) -> Tensor:
    """Their notebook takes one image per call: a batch is a loop of calls."""
    return torch.stack([authors_gae(saved, x[i:i + 1], int(target[i]))
                        for i in range(x.shape[0])])


def compute_rollout_attention(all_layer_matrices: list[Tensor], start_layer: int = 0
                              ) -> Tensor:
    """Their ``compute_rollout_attention``: full ``N × N`` products."""
    b, n = all_layer_matrices[0].shape[:2]
    eye = torch.eye(n, dtype=all_layer_matrices[0].dtype).expand(b, n, n)
    mats = [m + eye for m in all_layer_matrices]
    mats = [m / m.sum(dim=-1, keepdim=True) for m in mats]
    joint = mats[start_layer]
    for i in range(start_layer + 1, len(mats)):
        joint = mats[i].bmm(joint)
    return joint


def authors_rollout(saved: SavedAttention, x: Tensor, start_layer: int = 0) -> Tensor:
    """``Baselines.generate_rollout``: one batched forward (autograd on, as their code)."""
    saved(x)
    heads = [(a.sum(dim=1) / a.shape[1]).detach() for a in saved.attn]
    return compute_rollout_attention(heads, start_layer=start_layer)[:, 0, 1:]


# -- timing ------------------------------------------------------------------------------------
def interleaved(ours: Callable[[], object], theirs: Callable[[], object], repeats: int, *,
                settle: bool = False) -> tuple[float, float]:
    """Median ms of ``theirs`` and ``ours``, alternated (and who goes first alternates).

    The garbage collector runs before every timed call (outside the timing): the authors'
    hooks leave reference cycles holding autograd graphs, and a collection triggered
    inside the next timed call would charge their clean-up to whoever runs next (it
    doubled captum_vit's GAE time at batch 8 before this was done).

    ``settle=True`` also runs each function once, untimed, right before its timed call,
    so that every timed call follows a call of the same code (each side's steady state,
    as when it runs alone) while the two sides still alternate. Without it, whoever
    follows the other side pays for the memory that side left: under the benchmark's
    malloc settings the authors' GAE keeps its parameter gradients (88 MB for ViT-S) and
    its last retained graph alive between calls, the next call's buffers no longer fit
    in the heap's free space and are faulted in fresh (about 26,000 minor page faults on
    captum_vit's batch-8 GAE directly after theirs against 1 after its own call: 330 ms
    against 155 ms, measured; a plain forward+backward went from 175 to 431 ms the same
    way), and releasing their state instead moved the faults to their next call.
    """
    theirs(), ours()  # warm-up
    t_a, t_o = [], []
    for i in range(repeats):
        for fn, acc in ((theirs, t_a), (ours, t_o))[:: 1 if i % 2 == 0 else -1]:
            if settle:
                fn()
            gc.collect()
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(t_a), 1e3 * statistics.median(t_o)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median ms of ``fn`` alone (after a warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def max_rel(a: Tensor, b: Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def row(rows: list[str], method: str, batch: int, a_ms: float, o_ms: float) -> None:
    rows.append(f"| {method} | {batch} | {a_ms:,.0f} | {o_ms:,.0f} | {a_ms / o_ms:.2f}× |")
    print(rows[-1], flush=True)


def load_authors_tis() -> Callable | None:
    """``authors_tis`` from ``benchmarks/authors_tis.py``, or ``None`` if it is absent."""
    if not os.path.exists(os.path.join(HERE, "authors_tis.py")):
        return None
    from authors_tis import authors_tis

    return authors_tis


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--img-size", type=int, default=112)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tis-masks", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--tis-repeats", type=int, default=1)
    ap.add_argument("--tolerance", type=float, default=0.95, help="anytime TIS tolerance")
    ap.add_argument("--no-tis", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model = vit_s16(args.img_size)
    saved = SavedAttention(copy.deepcopy(model))  # the same weights, hooked like theirs
    gae, rollout = GAE(model), Rollout(model)
    gen = torch.Generator().manual_seed(0)
    xs = {b: torch.randn(b, 3, args.img_size, args.img_size, generator=gen)
          for b in args.batches}
    ts = {b: torch.arange(b) * 7 % 1000 for b in args.batches}
    tokens = (args.img_size // 16) ** 2 + 1
    print(f"ViT-S/16-shaped random timm model, {args.img_size} px ({tokens} tokens), "
          f"float32, {args.threads} threads, torch {torch.__version__}\n")

    # the re-implementations give captum_vit's maps
    b = max(args.batches)
    x, t = xs[b], ts[b]
    print(f"GAE max relative difference: "
          f"{max_rel(authors_gae_batch(saved, x, t), gae.attribute(x, t, output='tokens')):.1e}")
    print(f"Rollout max relative difference: "
          f"{max_rel(authors_rollout(saved, x), rollout.attribute(x, output='tokens')):.1e}")
    authors_tis = None if args.no_tis else load_authors_tis()
    if authors_tis is not None:
        p = tokens - 1
        masks = torch.rand(16, p, generator=gen).argsort(-1) < p // 2
        ours = TIS(model).attribute(x, t, masks=masks, output="tokens", show_progress=False)
        print(f"TIS (same 16 masks) max relative difference: "
              f"{max_rel(authors_tis(model, x, t, 16, masks=masks), ours):.1e}")
    elif not args.no_tis:
        print("TIS rows skipped: benchmarks/authors_tis.py is not there")
    print()

    rows = ["| method | batch | authors' ms | captum_vit ms | speed-up |",
            "|---|---|---:|---:|---:|"]
    print("\n".join(rows), flush=True)
    for b in args.batches:
        x, t = xs[b], ts[b]
        for settle in (False, True):
            a_ms, o_ms = interleaved(partial(gae.attribute, x, t, output="tokens"),
                                     partial(authors_gae_batch, saved, x, t), args.repeats,
                                     settle=settle)
            row(rows, f"GAE (authors: batch 1 only){', settled' if settle else ''}", b, a_ms,
                o_ms)
    for b in args.batches:
        x = xs[b]
        for settle in (False, True):
            a_ms, o_ms = interleaved(partial(rollout.attribute, x, output="tokens"),
                                     partial(authors_rollout, saved, x), args.repeats,
                                     settle=settle)
            row(rows, f"Rollout (Chefer et al.'s baseline){', settled' if settle else ''}", b,
                a_ms, o_ms)
    if authors_tis is not None:
        tis = TIS(model)
        for n in args.tis_masks:
            for b in args.batches:
                x, t = xs[b], ts[b]
                maps: dict[str, Tensor] = {}

                def ours(key: str = "exact", x: Tensor = x, t: Tensor = t, n: int = n,
                         maps: dict[str, Tensor] = maps, **kw: float) -> None:
                    """TIS, keeping its last map for the Spearman."""
                    maps[key] = tis.attribute(x, t, n_masks=n, random_state=0,
                                              show_progress=False, output="tokens", **kw)

                a_ms, o_ms = interleaved(ours, partial(authors_tis, model, x, t, n, seed=0),
                                         args.tis_repeats)
                row(rows, f"TIS, {n} masks, exact (authors: batch 1 only)", b, a_ms, o_ms)
                any_ms = median_ms(partial(ours, "anytime", tolerance=args.tolerance),
                                   args.tis_repeats)
                used = tis.last_masks_used.float().mean().item()
                rho = spearman(maps["anytime"][:, 1:], maps["exact"][:, 1:])
                row(rows, f"TIS, {n} masks, anytime (tolerance {args.tolerance}, "
                          f"{used:.0f} masks used, Spearman vs exact {rho.mean():.3f}, "
                          f"min {rho.min():.3f})", b, a_ms, any_ms)
    print("\nAll rows:\n" + "\n".join(rows))


if __name__ == "__main__":
    sys.exit(main())
