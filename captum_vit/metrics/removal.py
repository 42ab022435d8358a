"""Patch maps from any attribution, and the removal engine of the faithfulness metrics.

Removal always works on the model's patch grid (SPEC §6.3):

* ``removal="token"`` (default, true token masking, SkipPLUS §4.1): a removed patch's
  token is dropped from the sequence right after the positional embedding
  (``adapter.embed`` then ``adapter.run(x0, keep=...)``); prefix tokens are always kept,
  so no fill value is ever invented. For a model without prefix tokens (``global_pool=
  'avg'``, no class token) an empty sequence has no output; its logits are defined as 0
  (uniform probabilities).
* pixel baselines: the removed patches' pixels are replaced by ``"black"`` (0 in the
  model's input space), ``"mean"`` (the image's per-channel mean), ``"blur"`` (Gaussian
  blur of the image, kernel 11, σ 5, reflect padding) or ``"random"`` (uniform noise in
  ``[min, max]`` of the image, seeded per example id), and the model runs on the images.

Every (image, step) pair is one job; jobs are evaluated in batched forwards over images
AND steps, chunked by ``batch_size``. With token masking, jobs are sorted by the number
of kept tokens and chunked so that padding stays small (:func:`length_chunks`); the
shorter sequences of a chunk are padded, the padding masked out of attention (as keys)
and pooling (:class:`PaddedOps`), which gives the same logits as running each shortened
sequence alone.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from captum.attr import Attribution
from captum.log import log_usage
from torch import Tensor, nn

from captum_vit._base import TargetLike, ViTPerturbationAttribution, check_choice
from captum_vit.adapters import BlockParts, Layout, Ops, ViTAdapter, adapt

REMOVALS = ("token", "black", "mean", "blur", "random")
PIXEL_REDUCES = ("abs", "sum")
AttributionLike = Tensor | Attribution | Callable[..., Tensor]


# -- inputs -------------------------------------------------------------------------------
def check_batch(inputs: Any) -> Tensor:
    """Images [B, C, H, W], non-empty (a 1-tuple is accepted, Captum style)."""
    if isinstance(inputs, tuple) and len(inputs) == 1:
        inputs = inputs[0]
    if not isinstance(inputs, Tensor) or not torch.is_floating_point(inputs):
        raise TypeError(f"inputs must be a floating-point tensor [B, C, H, W], got "
                        f"{type(inputs).__name__}")
    if inputs.dim() != 4:
        raise ValueError(f"inputs must have shape [B, C, H, W], got {tuple(inputs.shape)}")
    if inputs.shape[0] == 0:
        raise ValueError("inputs is an empty batch (the dataset has no examples); "
                         "evaluate at least one image")
    return inputs


def example_seeds(example_ids: Sequence[int] | Tensor | None, batch: int, seed: int) -> list[int]:
    """One seed per example from its dataset index (never from the rank or the batch)."""
    ids = list(range(batch)) if example_ids is None else [int(i) for i in example_ids]
    if len(ids) != batch:
        raise ValueError(f"example_ids has {len(ids)} entries for a batch of {batch}")
    return [seed * 1_000_003 + i for i in ids]


def predicted(model: nn.Module, inputs: Tensor) -> Tensor:
    """Logits of the unperturbed images [B, C] (no gradient)."""
    with torch.no_grad():
        return model(inputs)


def resolve_labels(target: TargetLike, logits: Tensor) -> Tensor:
    """``None`` -> the predicted class; otherwise one class per image [B] on the logits' device."""
    b = logits.shape[0]
    if target is None:
        return logits.argmax(-1)
    t = torch.as_tensor(target, dtype=torch.long, device=logits.device).reshape(-1)
    if t.numel() == 1:
        t = t.expand(b)
    if t.numel() != b:
        raise ValueError(f"target/labels has {t.numel()} entries for a batch of {b} images")
    return t


# -- patch maps ---------------------------------------------------------------------------
def patch_maps(attribution: AttributionLike, inputs: Tensor, target: Tensor, layout: Layout, *,
               pixel_reduce: str = "abs", attribute_kwargs: dict | None = None) -> Tensor:
    """The attribution as patch scores [B, P] on the model's grid (raster order).

    Args:
        attribution: precomputed maps or an attribution:

            * a tensor of patch scores [B, P], a grid [B, gh, gw] / [B, 1, gh, gw], or a
              pixel map [B, H, W] / [B, C, H, W] at the image size (summed over the
              channels and the pixels of each patch, see ``pixel_reduce``);
            * a captum_vit method: called with ``output="tokens"`` (exact patch scores);
            * any Captum attribution (``IntegratedGradients(model)``, ``Saliency``,
              ``NoiseTunnel(...)``): ``attribute(inputs, target=target, **attribute_kwargs)``
              gives a pixel map, pooled as above;
            * a callable ``f(inputs, target) -> map`` (any of the shapes above).
        inputs (Tensor): images [B, C, H, W].
        target (Tensor): class per image [B].
        layout (Layout): the model's token layout for ``inputs``.
        pixel_reduce (str): ``"abs"`` (default: sum of ``|a|`` over channels and patch
            pixels, the usual pooling of gradient maps) or ``"sum"`` (signed sum).
        attribute_kwargs (dict, optional): extra keyword arguments of ``attribute``.

    Returns:
        Tensor: [B, P] patch scores (detached).
    """
    from captum_vit._base import _ViTFront

    check_choice("pixel_reduce", pixel_reduce, PIXEL_REDUCES)
    kw = dict(attribute_kwargs or {})
    if isinstance(attribution, Tensor):
        maps = attribution
    elif isinstance(attribution, _ViTFront):
        maps = attribution.attribute(inputs, target=target, output="tokens", **kw)
    elif isinstance(attribution, Attribution):
        maps = attribution.attribute(inputs, target=target, **kw)
    elif callable(attribution):
        maps = attribution(inputs, target)
    else:
        raise TypeError("attribution must be a tensor of maps, a Captum Attribution or a "
                        f"callable f(inputs, target); got {type(attribution).__name__}")
    if isinstance(maps, tuple) and len(maps) == 1:
        maps = maps[0]
    return _to_patches(maps.detach(), inputs, layout, pixel_reduce)


def _to_patches(maps: Tensor, inputs: Tensor, layout: Layout, pixel_reduce: str) -> Tensor:
    b = inputs.shape[0]
    (gh, gw), p = layout.grid, layout.num_patches
    h, w = inputs.shape[-2:]
    shape = tuple(maps.shape)
    if shape[:1] != (b,):
        raise ValueError(f"attribution maps have shape {shape} but the batch has {b} images")
    if maps.dim() == 2 and shape[1] == p:
        return maps
    if maps.dim() == 2 and shape[1] == layout.num_tokens:
        raise ValueError(f"attribution maps have {shape[1]} columns = all tokens; drop the "
                         f"{layout.num_prefix} prefix columns (keep the {p} patch scores)")
    if maps.dim() == 4 and shape[1] == 1 and shape[2:] == (gh, gw):
        return maps.reshape(b, p)
    if maps.dim() == 3 and shape[1:] == (gh, gw):
        return maps.reshape(b, p)
    if maps.dim() in (3, 4) and shape[-2:] == (h, w):
        pix = maps.abs() if pixel_reduce == "abs" else maps
        pix = pix.sum(1) if pix.dim() == 4 else pix  # channels
        ph, pw = layout.patch_size
        pix = F.pad(pix, (0, gw * pw - w, 0, gh * ph - h))
        return pix.reshape(b, gh, ph, gw, pw).sum((2, 4)).reshape(b, p)
    raise ValueError(
        f"attribution maps of shape {shape} match neither the patch grid ({p} patches, grid "
        f"{(gh, gw)}) nor the image size {(h, w)}; give [B, P], [B, 1, gh, gw] or pixel maps")


def ranking(scores: Tensor) -> Tensor:
    """Patch indices from most to least important [B, P] (ties: lower index first)."""
    return torch.argsort(scores, dim=1, descending=True, stable=True)


# -- baselines ----------------------------------------------------------------------------
def gaussian_blur(images: Tensor, kernel_size: int = 11, sigma: float = 5.0) -> Tensor:
    """Separable Gaussian blur with reflect padding, per channel."""
    r = kernel_size // 2
    x = torch.arange(kernel_size, dtype=images.dtype, device=images.device) - r
    k = torch.exp(-0.5 * (x / sigma) ** 2)
    k = k / k.sum()
    c = images.shape[1]
    mode = "reflect" if min(images.shape[-2:]) > r else "replicate"
    out = F.pad(images, (r, r, r, r), mode=mode)
    out = F.conv2d(out, k.reshape(1, 1, 1, -1).expand(c, 1, 1, -1), groups=c)
    return F.conv2d(out, k.reshape(1, 1, -1, 1).expand(c, 1, -1, 1), groups=c)


def baseline_images(inputs: Tensor, removal: str, seeds: Sequence[int]) -> Tensor:
    """The fill images [B, C, H, W] of a pixel baseline (SPEC §6.3)."""
    check_choice("removal", removal, REMOVALS[1:])
    if removal == "black":
        return torch.zeros_like(inputs)
    if removal == "mean":
        return inputs.mean((2, 3), keepdim=True).expand_as(inputs).clone()
    if removal == "blur":
        return gaussian_blur(inputs)
    out = torch.empty_like(inputs)
    for i, s in enumerate(seeds):
        g = torch.Generator().manual_seed(s)
        u = torch.rand(inputs.shape[1:], generator=g, dtype=torch.float64)
        lo, hi = inputs[i].min().double().cpu(), inputs[i].max().double().cpu()
        out[i] = (lo + (hi - lo) * u).to(inputs.dtype)
    return out


# -- engine -------------------------------------------------------------------------------
class PaddedOps(Ops):
    """The plain forward for token removal, optionally on padded token sets.

    ``valid`` [B, N] marks real tokens (None: all real). Padded tokens take no part in
    attention as keys and are left out of average pooling, so every real token's state
    equals that of the unpadded shorter sequence. Attention runs through
    ``F.scaled_dot_product_attention`` (fused; the probabilities are not materialised).
    """

    def __init__(self, valid: Tensor | None = None) -> None:
        super().__init__()
        self.valid = valid

    def attention(self, u: Tensor, p: BlockParts) -> tuple[Tensor, None]:
        b, n, _ = u.shape
        qkv = F.linear(u, p.qkv_weight, p.qkv_bias)
        q, k, v = qkv.reshape(b, n, 3, p.num_heads, p.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        mask = None if self.valid is None else self.valid[:, None, None, :]
        out = F.scaled_dot_product_attention(p.q_norm(q), p.k_norm(k), v, attn_mask=mask,
                                             scale=p.scale)
        return out.transpose(1, 2).reshape(b, n, p.inner_dim), None

    def pool(self, x: Tensor, row: int | str, num_prefix: int) -> Tensor:
        if row != "avg" or self.valid is None:
            return super().pool(x, row, num_prefix)
        w = self.valid[:, num_prefix:].to(x.dtype)[..., None]
        return (x[:, num_prefix:] * w).sum(1) / w.sum(1)


class RemovalEngine:
    """Evaluate a model on images with some patches removed.

    Args:
        model (nn.Module): a supported ViT classifier (never modified).
        removal (str): ``"token"`` (default) or a pixel baseline ``"black"``, ``"mean"``,
            ``"blur"``, ``"random"``.
        batch_size (int): images per forward pass (over images and steps).
        adapter (ViTAdapter, optional): an existing adapter of ``model``.

    Examples::

        >>> eng = RemovalEngine(model, removal="token")
        >>> order = ranking(patch_scores)                  # [B, P], most important first
        >>> logits = eng.logits(x, order, [0, 10, 20])     # [B, 3, classes]
    """

    def __init__(self, model: nn.Module, removal: str = "token", batch_size: int = 64,
                 adapter: ViTAdapter | None = None) -> None:
        check_choice("removal", removal, REMOVALS)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        self.model = model
        self.adapter = adapter or adapt(model)
        self.removal = removal
        self.batch_size = batch_size

    def layout(self, inputs: Tensor) -> Layout:
        self.adapter.check_inputs(inputs)
        return self.adapter.layout(inputs)

    def logits(self, inputs: Tensor, order: Tensor, counts: Sequence[int], *,
               mode: str = "delete", seeds: Sequence[int] | None = None) -> Tensor:
        """Logits [B, S, classes] with the first ``counts[s]`` patches of ``order`` affected.

        Args:
            inputs (Tensor): images [B, C, H, W].
            order (Tensor): [B, P] patch indices, the first ones are affected first
                (``ranking(scores)`` for MoRF, its flip for LeRF).
            counts (Sequence[int]): number of affected patches per step, in ``[0, P]``.
            mode (str): ``"delete"`` removes the affected patches; ``"insert"`` keeps only
                them (starting from everything removed).
            seeds (Sequence[int], optional): per-example seeds (``"random"`` baseline).

        Returns:
            Tensor: logits [B, S, classes] (no gradient).
        """
        check_choice("mode", mode, ("delete", "insert"))
        inputs = check_batch(inputs)
        layout = self.layout(inputs)
        b, p = inputs.shape[0], layout.num_patches
        if order.shape != (b, p):
            raise ValueError(f"order must be [B, P] = {(b, p)}, got {tuple(order.shape)}")
        counts = [int(c) for c in counts]
        if any(not 0 <= c <= p for c in counts):
            raise ValueError(f"counts must be in [0, {p}], got {counts}")
        seeds = list(range(b)) if seeds is None else list(seeds)
        order = order.to(inputs.device)
        # removed[b, s, j]: patch j is removed at step s
        affected = torch.zeros(b, len(counts), p, dtype=torch.bool, device=inputs.device)
        rank_of = torch.empty_like(order)
        rank_of.scatter_(1, order, torch.arange(p, device=order.device).expand(b, -1))
        for s, c in enumerate(counts):
            affected[:, s] = rank_of < c
        removed = affected if mode == "delete" else ~affected
        with torch.no_grad():
            if self.removal == "token":
                self.adapter.self_check(inputs)  # the token path runs the adapter's forward
                return self._token_logits(inputs, removed)
            return self._pixel_logits(inputs, removed, layout, seeds)

    def _token_logits(self, inputs: Tensor, removed: Tensor) -> Tensor:
        """Jobs sorted by kept length and chunked; shorter sequences of a chunk are padded
        and their padding masked out as attention keys (and from average pooling), which
        equals running every job on its own shortened sequence."""
        b, s, p = removed.shape
        k = self.adapter.num_prefix
        x0 = self.adapter.embed(inputs)
        keep = ~removed
        counts = keep.sum(-1).tolist()  # [B][S]
        jobs = sorted((counts[i][j], i, j) for i in range(b) for j in range(s))
        runnable = [t for t in jobs if t[0] + k > 0]  # no tokens at all: logits 0 (docstring)
        out: Tensor | None = None
        for chunk in length_chunks(runnable, k, self.batch_size):
            n = torch.tensor([c for c, _, _ in chunk], device=inputs.device)
            ii = torch.tensor([i for _, i, _ in chunk], device=inputs.device)
            jj = torch.tensor([j for _, _, j in chunk], device=inputs.device)
            n_max = int(n.max())
            # kept patch indices in increasing order first, then (padding) the others
            idx = torch.argsort((~keep[ii, jj]).to(torch.int8), dim=1, stable=True)[:, :n_max]
            valid = torch.arange(n_max, device=inputs.device) < n[:, None]
            if valid.all():
                ops = PaddedOps()
            else:
                ops = PaddedOps(torch.cat([valid.new_ones(len(chunk), k), valid], 1))
            logits = self.adapter.run(x0[ii], keep=idx, ops=ops)
            if out is None:
                out = logits.new_zeros(b, s, logits.shape[-1])
            out[ii, jj] = logits
        if out is None:  # every job empty: only the number of classes is needed
            out = x0.new_zeros(b, s, self.adapter.run(x0[:1]).shape[-1])
        return out

    def _pixel_logits(self, inputs: Tensor, removed: Tensor, layout: Layout,
                      seeds: Sequence[int]) -> Tensor:
        b, s, p = removed.shape
        fill = baseline_images(inputs, self.removal, seeds)
        jobs = [(i, j) for i in range(b) for j in range(s)]
        out: Tensor | None = None
        for lo in range(0, len(jobs), self.batch_size):
            chunk = jobs[lo:lo + self.batch_size]
            ii = torch.tensor([i for i, _ in chunk], device=inputs.device)
            jj = torch.tensor([j for _, j in chunk], device=inputs.device)
            logits = self.model(remove_pixels(inputs[ii], fill[ii], removed[ii, jj], layout))
            if out is None:
                out = logits.new_zeros(b, s, logits.shape[-1])
            out[ii, jj] = logits
        assert out is not None
        return out


def length_chunks(jobs: Sequence[tuple], num_prefix: int, batch_size: int,
                  slack: float = 1.25) -> list[list[tuple]]:
    """Split jobs ``(kept_patches, ...)`` sorted by length into forward-pass chunks.

    A chunk holds at most ``batch_size`` jobs and is closed before padding to its longest
    sequence would cost more than ``slack`` times its real tokens, so one image's steps
    (lengths from 0 to P) are not all padded to the full sequence.
    """
    chunks: list[list[tuple]] = []
    cur: list[tuple] = []
    real = 0
    for job in jobs:
        n = job[0] + num_prefix
        if cur and (len(cur) == batch_size or (len(cur) + 1) * n > slack * (real + n)):
            chunks.append(cur)
            cur, real = [], 0
        cur.append(job)
        real += n
    if cur:
        chunks.append(cur)
    return chunks


def remove_pixels(inputs: Tensor, fill: Tensor, removed: Tensor, layout: Layout) -> Tensor:
    """Images [B, C, H, W] whose removed patches ([B, P] bool) take the ``fill`` pixels."""
    (gh, gw), (ph, pw) = layout.grid, layout.patch_size
    h, w = inputs.shape[-2:]
    m = removed.reshape(-1, 1, gh, gw).repeat_interleave(ph, 2).repeat_interleave(pw, 3)
    return torch.where(m[..., :h, :w], fill, inputs)


# -- chance level -------------------------------------------------------------------------
class RandomMap(ViTPerturbationAttribution):
    r"""Uniform random patch scores: the chance level of every metric table.

    Each image's map is drawn from a generator seeded by ``seed`` and a checksum of the
    image's values, so a map depends only on the image (not on the batch it comes in, the
    process rank or earlier calls) and runs are repeatable.

    Args:
        model (torch.nn.Module): a supported ViT (used for the patch grid; never modified).
        seed (int): base seed.

    Examples::

        >>> from captum_vit.metrics import RandomMap
        >>> RandomMap(model, seed=0).attribute(x, output="tokens").shape
        torch.Size([2, 196])
    """

    def __init__(self, model: nn.Module, seed: int = 0) -> None:
        super().__init__(model)
        self.seed = int(seed)

    @log_usage()
    def attribute(self, inputs: Tensor, target: TargetLike = None, *,
                  output: str = "pixels") -> Tensor:
        r"""
        Args:
            inputs (Tensor): images [B, C, H, W].
            target (int, list, Tensor, optional): validated and ignored.
            output (str, optional): ``"pixels"``, ``"grid"`` or ``"tokens"``.

        Returns:
            Tensor: random scores in [0, 1) in the requested format.
        """
        return self._attribute(inputs, target, output)

    def _token_maps(self, inputs: Tensor, target: Tensor | None, **_: Any) -> Tensor:
        layout = self.adapter.layout(inputs)
        maps = []
        for img in inputs:
            crc = zlib.crc32(img.detach().cpu().contiguous().numpy().tobytes())
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + crc)
            maps.append(torch.rand(layout.num_tokens, generator=g, dtype=torch.float64))
        return torch.stack(maps).to(device=inputs.device, dtype=inputs.dtype)
