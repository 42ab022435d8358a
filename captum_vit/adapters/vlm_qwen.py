"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL answers explained on their vision towers: the model
side of :class:`captum_vit.targets.VLMAnswer` for ``Qwen2VLForConditionalGeneration``,
``Qwen2_5_VLForConditionalGeneration`` and ``Qwen3VLForConditionalGeneration`` (the
tower's adapter:
:mod:`captum_vit.adapters.families.hf_qwen_vl`).

Verified in the installed transformers (5.x, ``modeling_qwen2_vl.py``,
``modeling_qwen2_5_vl.py``, ``modeling_qwen3_vl.py``):

- **Prompt layout** (the processor's chat template): each image is
  ``<|vision_start|> <|image_pad|> × n <|vision_end|>`` with ``n = h·w / m²`` image tokens
  for an image of ``h × w`` patches (``m = spatial_merge_size``); ``image_token_id`` is
  ``<|image_pad|>``. The processor returns ``input_ids``, ``attention_mask``,
  ``pixel_values`` ``[ΣN, C·T·P·P]``, ``image_grid_thw`` ``[n, 3]`` and
  ``mm_token_type_ids`` (1 at image tokens).
- **Image features**: ``visual(pixel_values, grid_thw).pooler_output`` is
  ``merger(last block's tokens)`` in merge-group order (``m²`` tokens concatenated per
  image token), split per image (Qwen2.5-VL runs its blocks with the merge groups permuted
  into window order and puts the merger's output back in merge-group order: the same
  features); Qwen3-VL adds ``deepstack_features``: for each block of
  ``deepstack_visual_indexes`` (in block order), ``deepstack_merger_list[j]`` of that
  block's output, added by the language model to the image positions of its hidden
  states after its first layers.
- **The forward** (``Qwen2VLModel.forward`` / ``Qwen3VLModel.forward``) takes the image
  features as ``mm_encoder_outputs={"image": …}`` (``pooler_output`` a list of per-image
  features, concatenated and ``masked_scatter``-ed at the ``image_token_id`` positions;
  Qwen3-VL: ``deepstack_features`` a list per block of per-image features), and 3-D
  **mRoPE** ``position_ids`` ``[3, B, T]``: when none are given it computes them with
  ``get_rope_index(input_ids, mm_token_type_ids, image_grid_thw, attention_mask)`` and
  caches ``rope_deltas`` on the model. The target calls ``get_rope_index`` itself (the
  same position ids) and passes them, so the model's state is never written.

:class:`QwenVLParts` computes :class:`~captum_vit.targets.VLMAnswer`'s columns: the tower's
states (raster order) put back in merge-group order, the model's own ``merger`` (and
deepstack mergers), then the VLM's own forward with teacher forcing. A prompt may hold
several images (a processor's output with ``pixel_values`` and ``image_grid_thw``): each
image is explained in its own slot, the other images of its prompt held at the features
the model computes for them (a constant). Images of several sizes are explained one grid
at a time (``attribute`` on the processor's output groups them by grid): the target for a
grid's images (:meth:`QwenVLParts.select_images`) keeps the columns of those images only,
so an image is scored in its own prompt with the prompt's other images, of any size,
clean.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from captum_vit.adapters.hf_vlm import VLMParts
from captum_vit.adapters.layout import merge_order
from captum_vit.adapters.scoring import Outputs, per_image

SUPPORTED = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
             "Qwen3VLForConditionalGeneration")
REFUSED = {
    "Qwen3VLMoeForConditionalGeneration": "its tower is not among the supported families "
                                          "yet",
}


def image_runs(ids: Tensor, image_token_id: int, mask: Tensor | None = None
               ) -> list[tuple[int, int]]:
    """``(start, length)`` of every run of consecutive image tokens of one prompt ``[T]``
    (padding, ``mask == 0``, excluded)."""
    image = ids == image_token_id
    if mask is not None:
        image = image & (mask != 0)
    flags = image.tolist()
    runs: list[tuple[int, int]] = []
    for t, f in enumerate(flags):
        if f and (t == 0 or not flags[t - 1]):
            runs.append((t, 1))
        elif f:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
    return runs


@dataclasses.dataclass
class QwenPrompts:
    """The columns of a Qwen :class:`~captum_vit.targets.VLMAnswer` (target state).

    Attributes:
        input_ids (Tensor): ``[K, T]`` the prompt of each column.
        attention_mask (Tensor): ``[K, T]``.
        answer_ids (Tensor): ``[K, A]``.
        slot (list of int): the image slot of each column the explained rows fill.
        images (list of list): per column, per image slot of its prompt: ``None`` (the
            explained slot) or the index of a fixed image (:attr:`fixed`).
        runs (list of list): per column, the image-token count of each slot.
        fixed (list): per fixed image ``(grid (h, w), features, deepstack features)``.
    """

    input_ids: Tensor
    attention_mask: Tensor
    answer_ids: Tensor
    slot: list[int]
    images: list[list[int | None]]
    runs: list[list[int]]
    fixed: list[tuple[tuple[int, int], Tensor, list[Tensor]]]


@dataclasses.dataclass(frozen=True)
class QwenVLParts(VLMParts):
    """:class:`~captum_vit.adapters.hf_vlm.VLMParts` of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL
    model.

    Attributes:
        merge_size (int): ``spatial_merge_size`` ``m``.
        deepstack (tuple of int): Qwen3-VL's ``deepstack_visual_indexes`` in block order
            (0-based blocks; their outputs ``x_{l+1}`` are read); empty for Qwen2-VL.
    """

    merge_size: int = 2
    deepstack: tuple[int, ...] = ()
    packed_pixels = True

    @property
    def width(self) -> int:
        """The tower's token width."""
        cfg = self.tower.config
        return int(getattr(cfg, "embed_dim", None) or cfg.hidden_size)

    def num_features(self, num_tokens: int) -> int:
        return num_tokens // self.merge_size ** 2

    # -- the prompts --------------------------------------------------------------------
    def bind(self, target: Any, batch: Mapping[str, Any] | None) -> None:
        """Set the columns of ``target`` (:class:`QwenPrompts`): one per distinct prompt
        when every prompt holds one image; with a processor's ``pixel_values`` and
        ``image_grid_thw`` (several images per prompt), one per image, the others of its
        prompt fixed at the model's own features.

        Raises:
            ValueError: a prompt without image tokens, several images in a prompt given
                without the processor's output, or an ``image_grid_thw`` that does not
                match the prompts' image tokens.
        """
        col = target._column_of
        ids, mask = target.input_ids[col], target.attention_mask[col]
        answer = target.answer_ids[col]
        runs = [[n for _, n in image_runs(i, self.image_token_id, m)]
                for i, m in zip(ids, mask, strict=True)]
        if batch is None or batch.get("image_grid_thw") is None:
            many = [i for i, r in enumerate(runs) if len(r) != 1]
            if many:
                raise ValueError(
                    f"input_ids: prompt {many[0]} holds {len(runs[many[0]])} images (runs of "
                    f"image tokens, id {self.image_token_id}); give the processor's output "
                    "(with pixel_values and image_grid_thw) as input_ids, so the other "
                    "images of a prompt are known")
            target._qwen = QwenPrompts(target.input_ids, target.attention_mask,
                                       target.answer_ids, [0] * target.prompts,
                                       [[None]] * target.prompts,
                                       [[r[0]] for r in (runs[int((col == k).nonzero()[0])]
                                                         for k in range(target.prompts))], [])
            return
        self._bind_images(target, batch, ids, mask, answer, runs)

    def _bind_images(self, target: Any, batch: Mapping[str, Any], ids: Tensor, mask: Tensor,
                     answer: Tensor, runs: list[list[int]]) -> None:
        thw = torch.as_tensor(batch["image_grid_thw"])
        pixels = batch.get("pixel_values")
        if thw.dim() != 2 or thw.shape[1] != 3:
            raise ValueError(f"image_grid_thw must be [n, 3] (t, h, w per image), got shape "
                             f"{tuple(thw.shape)}")
        prompts = int(batch["input_ids"].shape[0]) if "input_ids" in batch else ids.shape[0]
        if ids.shape[0] != prompts:
            raise ValueError(f"answer_ids has {target.answer_ids.shape[0]} answers for the "
                             f"processor's {prompts} prompts: give one per prompt or one for "
                             "all")
        m2 = self.merge_size ** 2
        tokens = (thw.prod(-1) // m2).tolist()
        flat = [n for r in runs for n in r]
        if flat != tokens or bool((thw[:, 0] != 1).any()):
            raise ValueError(
                f"image_grid_thw {thw.tolist()} gives {tokens} image tokens per image, but "
                f"the prompts' runs of image tokens hold {flat}: pass the image_grid_thw the "
                "processor returned with these input_ids (t = 1: images, not videos)")
        if isinstance(pixels, Tensor) and int(thw.prod(-1).sum()) != pixels.shape[0]:
            raise ValueError(f"image_grid_thw {thw.tolist()} covers "
                             f"{int(thw.prod(-1).sum())} patches but pixel_values has "
                             f"{pixels.shape[0]} rows")
        context = any(len(r) > 1 for r in runs)
        fixed: list[tuple[tuple[int, int], Tensor, list[Tensor]]] = []
        if context:
            if not isinstance(pixels, Tensor):
                raise ValueError("input_ids: a prompt holds several images; the processor's "
                                 "output needs its pixel_values (the other images' features)")
            fixed = self._fixed_features(pixels, thw)
        # one column per image; prompts holding one image share a column when equal
        cols: dict[Any, int] = {}
        col_ids, col_mask, col_answer, slot, images, col_runs = [], [], [], [], [], []
        column_of = []
        image = 0
        for p, r in enumerate(runs):
            for s in range(len(r)):
                key = (tuple(ids[p].tolist()), tuple(mask[p].tolist()),
                       tuple(answer[p].tolist())) if len(r) == 1 else ("image", image)
                if key not in cols:
                    cols[key] = len(cols)
                    col_ids.append(ids[p])
                    col_mask.append(mask[p])
                    col_answer.append(answer[p])
                    slot.append(s)
                    first = image - s
                    images.append([None if j == s else first + j for j in range(len(r))])
                    col_runs.append(list(r))
                column_of.append(cols[key])
                image += 1
        target.input_ids = torch.stack(col_ids)
        target.attention_mask = torch.stack(col_mask)
        target.answer_ids = torch.stack(col_answer)
        target.prompts = len(cols)
        target._column_of = torch.tensor(column_of, dtype=torch.long)
        target._qwen = QwenPrompts(target.input_ids, target.attention_mask, target.answer_ids,
                                   slot, images, col_runs, fixed)

    def _fixed_features(self, pixels: Tensor, thw: Tensor
                        ) -> list[tuple[tuple[int, int], Tensor, list[Tensor]]]:
        """The model's own features of every image of the batch (no gradient): the
        context of a slot that is not explained."""
        inner = self.model.model
        dtype = next(self.tower.parameters()).dtype
        with torch.no_grad():
            out = inner.get_image_features(pixels.to(dtype), thw, return_dict=True)
        deep = getattr(out, "deepstack_features", None) or []
        return [((int(t[1]), int(t[2])), out.pooler_output[i].detach(),
                 [d[i].detach() for d in deep]) for i, t in enumerate(thw.tolist())]

    def select_images(self, target: Any, index: Tensor, total: int) -> Any:
        """``target`` (bound) for the images ``index`` of a processor's batch of ``total``
        images (one grid's, :meth:`VLMAnswer.for_images`): the columns of those images
        only, renumbered, each image still reading its own column; the fixed features of
        the prompts' other images unchanged (they are the model's own, clean).

        Raises:
            ValueError: ``target``'s prompts are neither one per image nor one for all.
        """
        q: QwenPrompts = target._qwen
        col = per_image(target._column_of, total, "VLMAnswer's images")[index.cpu()]
        keep, inverse = torch.unique(col, return_inverse=True)
        ks = keep.tolist()
        out = copy.copy(target)
        out.input_ids, out.attention_mask = q.input_ids[keep], q.attention_mask[keep]
        out.answer_ids = q.answer_ids[keep]
        out.prompts = len(ks)
        out._column_of = inverse
        out._qwen = QwenPrompts(out.input_ids, out.attention_mask, out.answer_ids,
                                [q.slot[k] for k in ks], [q.images[k] for k in ks],
                                [q.runs[k] for k in ks], q.fixed)
        return out

    # -- the score ----------------------------------------------------------------------
    def columns(self, target: Any, out: Outputs) -> Tensor:
        """``[n, K]``: every forward row's answer log-probability under every column; with
        ``per_token=True`` ``[n, K · (1 + A)]``: column ``j``'s slot 0 the whole answer,
        slot ``1 + t`` answer token ``t`` (0 where ``-100`` pads a shorter answer), all
        from the same language-model run."""
        n, k = int(target._states(out)[-1].shape[0]), len(target._qwen.slot)
        pairs = [(i, j) for i in range(n) for j in range(k)]
        return self._scores(target, out, pairs).reshape(n, -1)

    def own_columns(self, target: Any, out: Outputs, bases: Tensor) -> Tensor:
        """``[n, slots]``: each forward row's slots (the whole answer; with
        ``per_token=True`` then each answer token) of its own column ``bases[i]`` only,
        ``n`` sequences in one language-model run (:meth:`columns` scores every row
        against every column: ``n · K``); what
        :meth:`~captum_vit.targets.VLMAnswer.read_gradients` differentiates.

        Raises:
            ValueError: ``bases`` is not one column per forward row.
        """
        n, k = int(target._states(out)[-1].shape[0]), len(target._qwen.slot)
        own = bases.detach().cpu().long().reshape(-1).tolist()
        if len(own) != n or any(not 0 <= j < k for j in own):
            raise ValueError(f"bases must be one column in [0, {k}) per forward row ({n}), "
                             f"got {own}")
        return self._scores(target, out, list(enumerate(own)))

    def _scores(self, target: Any, out: Outputs, pairs: list[tuple[int, int]]) -> Tensor:
        """``[len(pairs), slots]``: forward row ``i`` scored under column ``j`` for each
        ``(i, j)`` of ``pairs``, one language-model run (the checks and the mergers of
        :meth:`columns`)."""
        q: QwenPrompts = target._qwen
        states = target._states(out)
        x = states[-1]
        n, rows, width = x.shape
        gh, gw = out.grid
        tokens = self.num_features(rows)
        if width != self.width or rows != gh * gw or any(
                q.runs[j][q.slot[j]] != tokens for j in range(len(q.slot))):
            slots = sorted({r[s] for r, s in zip(q.runs, q.slot, strict=True)})
            raise ValueError(
                f"VLMAnswer read tower states of {rows} rows × {width} features, but the "
                f"prompts' image slots hold {slots} "
                f"image tokens and the VLM's tower has {self.width} features: explain "
                "VLMAnswer.tower(model) on images of the size the prompts were made for")
        order = merge_order((gh, gw), self.merge_size, x.device)
        tower = self.tower
        feats = tower.merger(x[:, order].reshape(n * rows, width)).reshape(n, tokens, -1)
        deep = []
        for state, block in zip(states[:-1], self.deepstack, strict=True):
            merger = tower.deepstack_merger_list[list(tower.config.deepstack_visual_indexes)
                                                 .index(block)]
            deep.append(merger(state[:, order].reshape(n * rows, width)).reshape(n, tokens, -1))
        dev = feats.device
        cols = torch.tensor([j for _, j in pairs], dtype=torch.long)
        seq = torch.cat([q.input_ids, q.answer_ids.clamp_min(0)], 1)[cols].to(dev)
        am = torch.cat([q.attention_mask, torch.ones_like(q.answer_ids)], 1)[cols].to(dev)
        answer = q.answer_ids[cols].to(dev)
        pooled: list[Tensor] = []
        stacked: list[list[Tensor]] = [[] for _ in deep]
        grids: list[list[int]] = []
        for i, j in pairs:
            for img in q.images[j]:
                if img is None:
                    pooled.append(feats[i])
                    for d, f in zip(stacked, deep, strict=True):
                        d.append(f[i])
                    grids.append([1, gh, gw])
                else:
                    grid, f0, d0 = q.fixed[img]
                    pooled.append(f0.to(feats.dtype))
                    for d, f in zip(stacked, d0, strict=True):
                        d.append(f.to(feats.dtype))
                    grids.append([1, *grid])
        per_token = bool(getattr(target, "per_token", False))
        logp = self._log_probs(seq, am, answer, pooled, stacked,
                               torch.tensor(grids, device=dev), per_token)
        if per_token:  # [m, A] -> slot 0 the sum, slot 1 + t token t
            logp = torch.cat([logp.sum(-1, keepdim=True), logp], 1)
        else:
            logp = logp[:, None]
        return logp.to(x.dtype)

    def _log_probs(self, seq: Tensor, mask: Tensor, answer: Tensor, pooled: list[Tensor],
                   deep: list[list[Tensor]], grids: Tensor, per_token: bool = False
                   ) -> Tensor:
        """``Σ_t log p(answer_t | …)`` of every sequence by the VLM's own forward ``[m]``
        (``per_token``: each token's ``[m, A]``, 0 where not scored), the image features
        given (``mm_encoder_outputs``) and the mRoPE positions of the model's own
        ``get_rope_index``."""
        model = self.model
        inner = model.model
        types = (seq == self.image_token_id).int()
        positions, _ = inner.get_rope_index(seq, types, image_grid_thw=grids,
                                            attention_mask=mask)
        deepstack = getattr(sys.modules[type(model).__module__],
                            "BaseModelOutputWithDeepstackFeatures", None)
        if deepstack is not None:  # Qwen3-VL's forward reads deepstack_features
            image: Any = deepstack(pooler_output=pooled, deepstack_features=deep)
        else:
            from transformers.modeling_outputs import BaseModelOutputWithPooling

            image = BaseModelOutputWithPooling(pooler_output=pooled)  # type: ignore[arg-type]
        a = answer.shape[1]
        out = model(input_ids=seq, attention_mask=mask, position_ids=positions,
                    mm_encoder_outputs={"image": image}, use_cache=False,
                    logits_to_keep=a + 1)
        logits = out.logits[:, -(a + 1):-1]
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        logp = logits.log_softmax(-1)
        scored = answer != -100
        picked = logp.gather(-1, answer.clamp_min(0)[..., None].to(logp.device))[..., 0]
        tokens = picked * scored.to(logp.device)
        return tokens if per_token else tokens.sum(-1)


def qwen_parts(model: Any) -> QwenVLParts | None:
    """The :class:`QwenVLParts` of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL model; ``None`` for
    other models.

    Raises:
        TypeError: Qwen3-VL-MoE (refused by name, with why), or a layout
            this transformers version does not have.
    """
    name = type(model).__name__
    if not type(model).__module__.startswith("transformers."):
        return None
    if name in REFUSED:
        raise TypeError(f"{name} is not supported yet: {REFUSED[name]}; supported Qwen "
                        f"VLMs: {', '.join(SUPPORTED)}")
    if name not in SUPPORTED:
        return None
    inner = getattr(model, "model", None)
    tower = getattr(inner, "visual", None)
    if tower is None or not hasattr(inner, "get_rope_index"):
        raise TypeError(f"{name} has no model.visual / get_rope_index: this transformers "
                        "layout is not supported")
    cfg = model.config
    vc = cfg.vision_config
    deepstack = tuple(sorted(int(i) for i in getattr(vc, "deepstack_visual_indexes", ()) or ()))
    depth = int(vc.depth)
    layers = (*[i + 1 for i in deepstack], depth) if deepstack else None
    family = "qwen3_vl" if name.startswith("Qwen3") else "qwen2_5_vl" \
        if name.startswith("Qwen2_5") else "qwen2_vl"
    return QwenVLParts(model, tower, family,
                       layers, False, int(cfg.image_token_id), "model",
                       int(vc.spatial_merge_size), deepstack)
