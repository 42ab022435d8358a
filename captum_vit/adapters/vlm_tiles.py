"""Hugging Face vision-language models that split an image into tiles:
``Idefics3ForConditionalGeneration`` / ``SmolVLMForConditionalGeneration`` and
``LlavaOnevisionForConditionalGeneration`` (the model side of
:class:`captum_vit.targets.VLMAnswer` on tiles; :mod:`captum_vit.adapters.hf_vlm` is the
untiled one).

Verified in the installed transformers:

- **Idefics3 / SmolVLM** (``modeling_idefics3.py``, ``modeling_smolvlm.py``,
  ``image_processing_idefics3.py``): the processor resizes an image to ``rows × cols``
  squares of ``max_image_size`` and returns them in raster order (row by row) followed by
  the whole image resized to one square (the global view; no split: that image alone,
  ``rows = cols = 0``), as ``pixel_values [B, N_max, C, S, S]`` with all-zero padding
  images and ``pixel_attention_mask [B, N_max, S, S]``. ``get_image_features`` drops the
  padding images (all zero), runs ``vision_model`` (:mod:`~captum_vit.adapters.families.
  hf_idefics3`) on the real ones, then ``connector``: pixel shuffle by ``scale_factor``
  (``s × s`` neighbouring tokens concatenated) and a linear ``modality_projection``; the
  tiles' features are concatenated in order and put at the ``image_token_id`` positions
  (``<fake_token_around_image><row_r_col_c><image>×L`` per tile, then ``<global-img>``).
  The forward takes them as ``mm_encoder_outputs={"image": ...}`` (``pooler_output``, a
  list of ``[tiles·L, D]`` per prompt).
- **LLaVA-OneVision** (``modeling_llava_onevision.py``,
  ``image_processing_llava_onevision.py``): the processor resizes the image into the best
  resolution of ``config.image_grid_pinpoints`` (aspect kept, centred, padded), cuts it into
  ``rows × cols`` crops of the tower's ``image_size`` in raster order and puts the whole
  image resized to one crop (the base image) FIRST: ``pixel_values [B, N_max, C, S, S]``
  (zero padding crops after the real ones) and ``image_sizes [B, 2]`` (the original
  ``(H, W)``). ``get_image_features`` keeps the first ``image_size_to_num_patches`` crops,
  reads the SigLIP tower's ``hidden_states[vision_feature_layer]`` (the first row dropped
  under ``"default"``), runs ``multi_modal_projector`` and then ``pack_image_features``: the
  crops' features are arranged on the whole grid, the padding rows or columns removed
  (``unpad_image``), bilinearly downsized when above ``anyres_max_9``'s budget, an
  ``image_newline`` appended to every row, and the base image's features put first. The
  forward's ``mm_encoder_outputs`` takes the PACKED features (it does not pack them
  itself), so the target calls the model's own ``pack_image_features`` on the projected
  crop features and hands the result to the forward. Images of a multi-image prompt
  (``batch_num_images > 1``) are not tiled by the model: refused here.

How a map is made of several tiles (our choice). The methods explain the tower on the real
tiles of every prompt as one batch ``[N, C, S, S]`` (``VLMAnswer(...).images()``), every
tile one row. The answer's score of a row is the VLM's log-probability with **that tile**
taken from the row and the prompt's other tiles at their clean values: at the clean input
every row scores the model's own answer log-probability, the gradient of a row is exactly
the slice of the whole answer's gradient on that tile (so gradient-based maps of the tiles
are the maps of the whole image), and a perturbation method perturbs one tile at a time.
Each tile is a column of the target (``N`` columns; every forward row is scored against
every column: ``n·N`` language-model sequences for ``n`` forward rows, what the perturbation
methods need). A method whose map depends on the score only through its gradient at the
clean tiles (``ViTFront.linear_in_read_gradient``) needs only every row's own column there:
one sequence per prompt with all its clean tiles (:meth:`TiledParts.prompt_log_probs`).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from captum_vit.adapters.hf_vlm import VLMParts, _part, tower_states

TILED_CLASSES = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration",
                 "LlavaOnevisionForConditionalGeneration", "LlavaNextForConditionalGeneration")
"""The tiled vision-language models :class:`~captum_vit.targets.VLMAnswer` serves."""


@dataclasses.dataclass(frozen=True)
class TileLayout:
    """Where an image's tiles lie in the original image (what
    :func:`captum_vit.viz.stitch` reads).

    Attributes:
        rows (int): tile rows of the split (at least 1).
        cols (int): tile columns of the split (at least 1).
        global_index (int or None): the position of the global view (the whole image
            downsized to one tile) among the image's tiles: ``0`` (LLaVA-OneVision's base
            image comes first), ``rows·cols`` (Idefics3 / SmolVLM put it last), ``None``
            (no global view). The other tiles are in raster order (row by row).
        tile_size (tuple of int): ``(h, w)`` pixels of one tile as the model sees it.
        crop (tuple of int or None): ``(top, left, height, width)``, in pixels of the
            stitched ``rows·h × cols·w`` canvas, of the image's content (LLaVA-OneVision
            pads the resized image to the grid's resolution); ``None``: the whole canvas.
    """

    rows: int
    cols: int
    global_index: int | None
    tile_size: tuple[int, int]
    crop: tuple[int, int, int, int] | None = None

    def __post_init__(self) -> None:
        for name in ("rows", "cols"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"TileLayout.{name} must be a positive int, got {v!r}")
        g = self.global_index
        if g is not None and (isinstance(g, bool) or not isinstance(g, int)
                              or not 0 <= g <= self.rows * self.cols):
            raise ValueError(f"TileLayout.global_index must be None or in [0, "
                             f"{self.rows * self.cols}], got {g!r}")

    @property
    def num_tiles(self) -> int:
        """The image's tiles, the global view included."""
        return self.rows * self.cols + (self.global_index is not None)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """The real tiles of a processor's batch, prompt by prompt.

    Attributes:
        pixels (Tensor): ``[N, C, S, S]``: every prompt's real tiles in its order.
        counts (tuple of int): tiles per prompt (``N`` in all).
        image_sizes (Tensor or None): LLaVA-OneVision's ``[B, 2]`` original sizes.
        rows (tuple of int or None): Idefics3's tile rows per prompt (``0``: no split),
            when the batch holds them (``return_row_col_info=True``).
        cols (tuple of int or None): the tile columns likewise.
    """

    pixels: Tensor
    counts: tuple[int, ...]
    image_sizes: Tensor | None = None
    rows: tuple[int, ...] | None = None
    cols: tuple[int, ...] | None = None

    @property
    def owner(self) -> Tensor:
        """``[N]``: the prompt of every tile."""
        return torch.repeat_interleave(torch.arange(len(self.counts)),
                                       torch.tensor(self.counts))

    @property
    def starts(self) -> list[int]:
        """The first tile of every prompt."""
        out, s = [], 0
        for c in self.counts:
            out.append(s)
            s += c
        return out


def _pixels(batch: Mapping[str, Any], key: str) -> Tensor:
    pixels = batch.get(key)
    if not isinstance(pixels, Tensor) or pixels.dim() != 5:
        shape = tuple(pixels.shape) if isinstance(pixels, Tensor) else type(pixels).__name__
        raise ValueError(f"{key} must be the processor's tiles [B, N_tiles, C, H, W], got "
                         f"{shape}: pass the processor's whole output as input_ids")
    return pixels


def _list(value: Any, name: str, b: int) -> tuple[int, ...] | None:
    """Idefics3's ``rows`` / ``cols`` of a batch (one per prompt, one image each)."""
    if value is None:
        return None
    flat = [v for x in value for v in (x if isinstance(x, list | tuple) else [x])] \
        if isinstance(value, list | tuple) else torch.as_tensor(value).flatten().tolist()
    if len(flat) != b:
        raise ValueError(f"{name} has {len(flat)} entries for {b} prompts: one image per "
                         "prompt")
    return tuple(int(v) for v in flat)


@dataclasses.dataclass(frozen=True)
class TiledParts(VLMParts):
    """What the answer score reads of a tiled vision-language model (never modified): the
    :class:`VLMParts` of the tower and the language model, plus how the tiles are read
    from a processor's batch, turned into features and arranged for the forward."""

    def read_tiles(self, batch: Mapping[str, Any], key: str) -> Tiles:
        """The real tiles of a processor's output ``batch`` (images under ``key``)."""
        raise NotImplementedError

    def layout(self, tiles: Tiles, prompt: int) -> TileLayout:
        """The :class:`TileLayout` of the image of ``prompt``."""
        raise NotImplementedError

    def clean_states(self, pixels: Tensor) -> list[Tensor]:
        """The tower states the score reads, of the clean tiles ``[N, C, S, S]``: the
        model's own tower forward (no gradient)."""
        return tower_states(self.tower, pixels, self.layers)

    def images(self, tile_features: list[Tensor], prompts: Sequence[int],
               tiles: Tiles) -> list[Tensor]:
        """The image features of each sequence: ``tile_features[i]`` ``[T, L, D]`` (the
        tiles of prompt ``prompts[i]`` in order) arranged as the model puts them at its
        image tokens, ``[L_i, D]`` each."""
        return [f.flatten(0, 1) for f in tile_features]

    def check_prompts(self, tiles: Tiles, counts: Tensor) -> list[Tensor]:
        """The clean tiles' states (:meth:`clean_states`), once the prompts' image tokens
        ``counts`` ``[B]`` are checked against the features the tiles make.

        Raises:
            ValueError: another number of prompts than images, a prompt without image
                tokens, or image tokens that do not match its tiles' features.
        """
        b = len(tiles.counts)
        image = self.image_token_id
        if counts.shape[0] != b:
            raise ValueError(f"input_ids has {counts.shape[0]} prompts but the processor's "
                             f"batch has {b} images: one prompt per image, as the processor "
                             "makes them")
        if (counts == 0).any():
            raise ValueError(f"input_ids: prompt {int((counts == 0).nonzero()[0, 0])} holds no "
                             f"image token (id {image}): give the prompt the processor made "
                             "with the image (its chat template puts the image tokens)")
        clean = self.clean_states(tiles.pixels)
        feats = self.features(clean)
        lo = tiles.starts
        need = [len(f) for f in self.images(
            [feats[lo[g]:lo[g] + tiles.counts[g]] for g in range(b)], range(b), tiles)]
        if counts.tolist() != need:
            raise ValueError(f"input_ids: the prompts hold {counts.tolist()} image tokens (id "
                             f"{image}) but their tiles make {need} image features: give the "
                             "prompts and the tiles of one processor call")
        return clean

    def tile_columns(self, tiles: Tiles, clean: list[Tensor], states: list[Tensor],
                     input_ids: Tensor, attention_mask: Tensor, answer: Tensor,
                     per_token: bool = False) -> Tensor:
        """``[n, N]``: the answer's log-probability for every forward row (a tile's states
        ``states``, ``[n, P, D]`` each) put in the place of every tile ``c`` of its prompt,
        the prompt's other tiles at their ``clean`` states (``n·N`` language-model
        sequences).

        Args:
            tiles (Tiles): the batch's tiles.
            clean (list of Tensor): the clean tiles' states ``[N, P, D]`` (as ``states``).
            states (list of Tensor): the forward rows' states ``[n, P, D]``.
            input_ids (Tensor): ``[B, T]`` prompts (one per image).
            attention_mask (Tensor): ``[B, T]``.
            answer (Tensor): ``[B, A]`` answers (``-100`` pads).
            per_token (bool, optional): ``[n, N·(1 + A)]``: for tile ``c`` the whole
                answer (column ``c·(1 + A)``), then each answer token's log-probability.
                Default False.
        """
        if len(states) != len(clean) or any(
                s.shape[1:] != c.shape[1:] for s, c in zip(states, clean, strict=False)):
            raise ValueError(
                f"VLMAnswer read tower states of shape {tuple(states[0].shape[1:])}, but the "
                f"tiles' are {tuple(clean[0].shape[1:])}: explain VLMAnswer.tower(model) on "
                "target.images(), the tiles the target was made for")
        feats = self.features(states)  # [n, L, D]
        base = self.features([c.to(feats.device, feats.dtype) for c in clean])  # [N, L, D]
        n, big_n = feats.shape[0], base.shape[0]
        owner = tiles.owner.tolist()
        starts = tiles.starts
        per_tile: list[Tensor] = []
        prompts: list[int] = []
        for i in range(n):
            for c in range(big_n):
                g = owner[c]
                lo, hi = starts[g], starts[g] + tiles.counts[g]
                per_tile.append(torch.cat([base[lo:c], feats[i:i + 1], base[c + 1:hi]]))
                prompts.append(g)
        logp = self._log_probs(per_tile, prompts, tiles, input_ids, attention_mask, answer,
                               per_token)
        return logp.reshape(n, -1)

    def prompt_log_probs(self, tiles: Tiles, states: list[Tensor], input_ids: Tensor,
                         attention_mask: Tensor, answer: Tensor,
                         per_token: bool = False) -> Tensor:
        """Every prompt's answer log-probability with ALL its tiles from the forward rows
        ``states`` (``[N, P, D]`` each, the rows being the batch's tiles): one
        language-model sequence per prompt, ``[B]`` (``per_token``: ``[B, 1 + A]``, the
        whole answer then each token). At the clean tiles this is every tile's own column
        of :meth:`tile_columns`, and its gradient w.r.t. a row is that row's own column's.

        Args:
            tiles (Tiles): the batch's tiles.
            states (list of Tensor): the rows' states ``[N, P, D]``.
            input_ids (Tensor): ``[B, T]`` prompts.
            attention_mask (Tensor): ``[B, T]``.
            answer (Tensor): ``[B, A]`` answers (``-100`` pads).
            per_token (bool, optional): the tokens' log-probabilities too. Default False.
        """
        feats = self.features(states)  # [N, L, D]
        lo = tiles.starts
        per_prompt = [feats[lo[g]:lo[g] + c] for g, c in enumerate(tiles.counts)]
        return self._log_probs(per_prompt, list(range(len(tiles.counts))), tiles, input_ids,
                               attention_mask, answer, per_token)

    def _log_probs(self, tile_features: list[Tensor], prompts: list[int], tiles: Tiles,
                   input_ids: Tensor, attention_mask: Tensor, answer: Tensor,
                   per_token: bool) -> Tensor:
        """The answer's log-probability of each sequence (``tile_features[i]``: the tiles
        of prompt ``prompts[i]``), ``[S]`` or with ``per_token`` ``[S, 1 + A]``."""
        images = self.images(tile_features, prompts, tiles)
        dev = tile_features[0].device
        own = torch.tensor(prompts, device=dev)
        ids, mask, ans = input_ids.to(dev)[own], attention_mask.to(dev)[own], answer.to(dev)[own]
        seq = torch.cat([ids, ans.clamp_min(0)], 1)
        am = torch.cat([mask, torch.ones_like(ans)], 1)
        logp = self.answer_log_probs(images, seq, am, ans,  # type: ignore[arg-type]
                                     per_token=per_token)
        if per_token:
            logp = torch.cat([logp.sum(-1, keepdim=True), logp], 1)
        return logp


@dataclasses.dataclass(frozen=True)
class Idefics3Parts(TiledParts):
    """Idefics3 / SmolVLM: the tower's final-normed tokens, the pixel-shuffle
    ``connector``, the tiles' features concatenated in order."""

    @property
    def projector(self) -> Any:
        return _part(self.model, "connector")

    def num_features(self, num_tokens: int) -> int:
        return num_tokens // int(self.model.config.scale_factor) ** 2

    def features(self, states: list[Tensor]) -> Tensor:
        return self.projector(states[0])

    def read_tiles(self, batch: Mapping[str, Any], key: str) -> Tiles:
        pixels = _pixels(batch, key)
        b, m = pixels.shape[:2]
        flat = pixels.flatten(0, 1)
        real = (flat != 0).flatten(1).any(1)  # the model's rule: padding images are all zero
        mask = batch.get("pixel_attention_mask")
        if mask is not None:
            mask = torch.as_tensor(mask)
            if mask.shape[:2] != (b, m):
                raise ValueError(f"pixel_attention_mask has shape {tuple(mask.shape)} but "
                                 f"{key} {tuple(pixels.shape)}: give the processor's pair")
            partial = ~mask.flatten(0, 1).flatten(1).bool().all(1) & real.to(mask.device)
            if partial.any():
                raise ValueError("pixel_attention_mask marks padded pixels inside a real tile: "
                                 "captum_vit explains whole tiles (the processors of Idefics3 "
                                 "and SmolVLM resize every tile to max_image_size)")
        counts = tuple(int(c) for c in real.view(b, m).sum(1))
        if 0 in counts:
            raise ValueError(f"{key} holds no image for prompt {counts.index(0)}: every "
                             "prompt must have its image")
        return Tiles(flat[real], counts, None, _list(batch.get("rows"), "rows", b),
                     _list(batch.get("cols"), "cols", b))

    def layout(self, tiles: Tiles, prompt: int) -> TileLayout:
        s = int(self.tower.config.image_size)
        t = tiles.counts[prompt]
        if t == 1:  # no split: the image alone
            return TileLayout(1, 1, None, (s, s))
        if tiles.rows is not None and tiles.cols is not None:
            r, c = tiles.rows[prompt], tiles.cols[prompt]
        elif math.isqrt(t - 1) ** 2 == t - 1:  # a square split is the only one
            r = c = math.isqrt(t - 1)
        else:
            raise ValueError(f"prompt {prompt}'s image has {t - 1} tiles: its rows and columns "
                             "are not in the batch; add the image processor's 'rows' and "
                             "'cols' (processor.image_processor(images, "
                             "return_row_col_info=True)) to it")
        if r * c + 1 != t:
            raise ValueError(f"rows {r} × cols {c} + the global image do not make the "
                             f"{t} tiles of prompt {prompt}")
        return TileLayout(r, c, r * c, (s, s))


@dataclasses.dataclass(frozen=True)
class AnyresParts(TiledParts):
    """LLaVA-OneVision and LLaVA-NeXT: LLaVA's feature layers and projector per crop,
    then the model's own ``pack_image_features`` (base image first, unpadding,
    ``image_newline``; OneVision's ``anyres_max`` downsizing)."""

    def _geometry(self, size: Sequence[int]) -> tuple[int, int, tuple[int, int, int, int]]:
        """``(rows, cols, crop)`` of an image of original ``(H, W)`` ``size``: the
        processor's best resolution and centred resize (transformers' own helpers)."""
        from transformers.image_processing_utils import select_best_resolution

        s = int(self.tower.config.image_size)
        h, w = int(size[0]), int(size[1])
        bh, bw = select_best_resolution((h, w), self.model.config.image_grid_pinpoints)
        if bw / w < bh / h:  # transformers' get_patch_output_size
            nw, nh = bw, min(math.ceil(h * bw / w), bh)
        else:
            nh, nw = bh, min(math.ceil(w * bh / h), bw)
        return bh // s, bw // s, ((bh - nh) // 2, (bw - nw) // 2, nh, nw)

    def read_tiles(self, batch: Mapping[str, Any], key: str) -> Tiles:
        pixels = _pixels(batch, key)
        b = pixels.shape[0]
        sizes = batch.get("image_sizes")
        if sizes is None:
            raise ValueError("the processor's output has no image_sizes: LLaVA-OneVision's "
                             "tiles need them; pass the processor's whole output")
        sizes = torch.as_tensor(sizes).reshape(-1, 2)
        if sizes.shape[0] != b:
            raise ValueError(f"image_sizes has {sizes.shape[0]} entries for {b} prompts' "
                             f"{key}: one image per prompt")
        per = batch.get("batch_num_images")
        if per is not None and (torch.as_tensor(per) != 1).any():
            raise ValueError("batch_num_images: prompts with several images (not tiled by "
                             "LLaVA-OneVision) are not supported; one image per prompt")
        # the same function in modeling_llava_onevision (a copy)
        from transformers.models.llava_next.modeling_llava_next import (
            image_size_to_num_patches,
        )

        s = int(self.tower.config.image_size)
        counts = tuple(image_size_to_num_patches(sizes[i].tolist(),
                                                 self.model.config.image_grid_pinpoints, s)
                       for i in range(b))
        if max(counts) > pixels.shape[1]:
            raise ValueError(f"{key} has {pixels.shape[1]} tiles per prompt but image_sizes "
                             f"{sizes.tolist()} make {list(counts)}: give the processor's "
                             "pair")
        real = torch.cat([pixels[i, :c] for i, c in enumerate(counts)])
        return Tiles(real, counts, sizes)

    def layout(self, tiles: Tiles, prompt: int) -> TileLayout:
        s = int(self.tower.config.image_size)
        assert tiles.image_sizes is not None
        if tiles.counts[prompt] == 1:
            return TileLayout(1, 1, None, (s, s))
        r, c, crop = self._geometry(tiles.image_sizes[prompt].tolist())
        return TileLayout(r, c, 0, (s, s), crop)

    def images(self, tile_features: list[Tensor], prompts: Sequence[int],
               tiles: Tiles) -> list[Tensor]:
        assert tiles.image_sizes is not None
        inner = self.model.model
        pack = inner.pack_image_features
        kw: dict[str, Any] = {"image_newline": inner.image_newline}
        if "vision_aspect_ratio" in inspect.signature(pack).parameters:  # OneVision
            kw["vision_aspect_ratio"] = self.model.config.vision_aspect_ratio
        else:  # LLaVA-NeXT
            kw["vision_feature_select_strategy"] = "full" if self.keep_cls else "default"
        packed, _ = pack(tile_features, tiles.image_sizes[list(prompts)], **kw)
        return list(packed)


def tiled_parts(model: Any) -> TiledParts | None:
    """The :class:`TiledParts` of a tiled VLM of :data:`TILED_CLASSES`, ``None`` for
    another model.

    Raises:
        TypeError: a transformers version whose forward does not take
            ``mm_encoder_outputs``, or a layout it does not have.
    """
    name = type(model).__name__
    if name not in TILED_CLASSES or not type(model).__module__.startswith("transformers."):
        return None
    if "mm_encoder_outputs" not in inspect.signature(model.forward).parameters:
        raise TypeError(f"{name}: VLMAnswer needs a transformers version whose forward takes "
                        "mm_encoder_outputs (transformers 5)")
    cfg = model.config
    image_token_id = getattr(cfg, "image_token_id", None)
    image_token_id = int(cfg.image_token_index if image_token_id is None else image_token_id)
    if name.startswith(("LlavaOnevision", "LlavaNext")):
        layer = cfg.vision_feature_layer
        layers = (int(layer),) if isinstance(layer, int) else tuple(int(v) for v in layer)
        strategy = cfg.vision_feature_select_strategy
        if strategy not in ("default", "full"):
            raise TypeError(f"{name}: vision_feature_select_strategy {strategy!r} is not "
                            "'default' or 'full'")
        return AnyresParts(model, _part(model, "vision_tower"), "llava", layers,
                              strategy == "full", image_token_id, "model")
    return Idefics3Parts(model, _part(model, "vision_model"), "idefics3", None, True,
                         image_token_id, "model")


def stitch(maps: Tensor, layout: Any) -> tuple[Tensor, Tensor | None]:
    r"""Place each tile's map at its tile's place in the original image: the maps of an
    image a vision-language model split into tiles (Idefics3 / SmolVLM splitting,
    LLaVA-OneVision anyres), back on one canvas, and the global view's map apart.

    The global view (the whole image downsized to one tile) is returned on its own, never
    averaged into the tiles (our choice: it sees the whole image at another scale, so its
    map is another map of the same image, not a part of the stitched one). The other
    tiles are in raster order (row by row), as the processors return them.

    Args:
        maps (Tensor): ``[T, ..., h, w]``: one map per tile of ONE image, in the
            processor's order (the global view included): e.g. the image's rows of a
            method's maps of ``VLMAnswer(...).images()`` (``[T, C, S, S]`` pixels or
            ``[T, 1, gh, gw]`` grids: any trailing size, the tile size scaled to it).
        layout (TileLayout or Mapping): where the tiles lie
            (:class:`~captum_vit.adapters.vlm_tiles.TileLayout`, from
            ``VLMAnswer.layouts()``; or a mapping with ``rows``, ``cols``,
            ``global_index`` and optionally ``crop`` and ``tile_size``).

    Returns:
        tuple: ``(stitched, global_view)``: ``stitched`` ``[..., rows·h, cols·w]`` (cut to
        ``layout.crop``, scaled to the maps' size, when the image was padded to the
        grid), ``global_view`` ``[..., h, w]`` or ``None`` when the image has no global
        view.

    Raises:
        ValueError: ``maps`` has another number of tiles than ``layout``, or fewer than
            two dimensions.
        TypeError: ``maps`` is not a tensor.

    Examples::

        >>> import torch
        >>> from captum_vit.viz import stitch
        >>> # 2 × 3 tiles then the global view (Idefics3's order); tile i is the constant i
        >>> maps = torch.arange(7.0)[:, None, None, None].expand(7, 1, 4, 4)
        >>> layout = {"rows": 2, "cols": 3, "global_index": 6}
        >>> stitched, global_view = stitch(maps, layout)
        >>> stitched.shape, global_view.shape
        (torch.Size([1, 8, 12]), torch.Size([1, 4, 4]))
        >>> stitched[0, ::4, ::4]
        tensor([[0., 1., 2.],
                [3., 4., 5.]])
        >>> float(global_view.mean())
        6.0
    """
    if not isinstance(maps, Tensor):
        raise TypeError(f"maps must be a tensor [T, ..., h, w], got {type(maps).__name__}")
    if isinstance(layout, Mapping):
        extra = set(layout) - {"rows", "cols", "global_index", "crop", "tile_size"}
        if extra or not {"rows", "cols"} <= set(layout):
            raise ValueError("layout must be a TileLayout or a mapping with rows, cols, "
                             "global_index (and optionally crop, tile_size); got keys "
                             f"{sorted(layout)}")
        size = tuple(maps.shape[-2:]) if maps.dim() >= 2 else (1, 1)
        layout = TileLayout(layout["rows"], layout["cols"], layout.get("global_index"),
                            tuple(layout.get("tile_size", size)), layout.get("crop"))
    if not isinstance(layout, TileLayout):
        raise TypeError(f"layout must be a TileLayout or a mapping, got "
                        f"{type(layout).__name__}")
    if maps.dim() < 3:
        raise ValueError(f"maps must be [T, ..., h, w] (one map per tile), got shape "
                         f"{tuple(maps.shape)}")
    if maps.shape[0] != layout.num_tiles:
        glob = "" if layout.global_index is None else " + 1 global view"
        raise ValueError(f"maps has {maps.shape[0]} tiles but the layout has "
                         f"{layout.num_tiles} ({layout.rows} × {layout.cols}{glob}): give "
                         "the maps of this image's tiles only, in the processor's order")
    r, c, g = layout.rows, layout.cols, layout.global_index
    keep = [i for i in range(maps.shape[0]) if i != g]
    tiles = maps[keep]  # [r·c, ..., h, w] in raster order
    h, w = tiles.shape[-2:]
    lead = tuple(tiles.shape[1:-2])
    x = tiles.reshape(r, c, -1, h, w).permute(2, 0, 3, 1, 4).reshape(*lead, r * h, c * w)
    if layout.crop is not None:
        th, tw = layout.tile_size
        top, left, ch, cw = layout.crop
        sy, sx = h / th, w / tw
        y0, x0 = int(math.floor(top * sy)), int(math.floor(left * sx))
        y1, x1 = int(math.ceil((top + ch) * sy)), int(math.ceil((left + cw) * sx))
        x = x[..., y0:y1, x0:x1]
    return x, (None if g is None else maps[g])
