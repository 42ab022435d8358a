"""Adapter for the vision towers of Hugging Face Qwen2-VL, Qwen2.5-VL and Qwen3-VL
(``Qwen2VisionTransformerPretrainedModel``, ``model.model.visual`` of
``Qwen2VLForConditionalGeneration``; ``Qwen2_5_VisionTransformerPretrainedModel``, of
``Qwen2_5_VLForConditionalGeneration``; ``Qwen3VLVisionModel``, ``model.model.visual`` of
``Qwen3VLForConditionalGeneration``).

Verified in the installed transformers (5.x, ``models/qwen2_vl/modeling_qwen2_vl.py``,
``models/qwen2_5_vl/modeling_qwen2_5_vl.py``, ``models/qwen3_vl/modeling_qwen3_vl.py``,
``models/qwen2_vl/image_processing_qwen2_vl.py``, ``vision_utils.py``):

- **Packed input.** The tower takes ``hidden_states = pixel_values`` ``[ΣN, C·T·P·P]`` and
  ``grid_thw`` ``[n, 3]`` (``(t, h, w)`` per image, ``h``, ``w`` in patches). The image
  processor (``Qwen2VLImageProcessor.patchify``; Qwen3-VL uses it too) reshapes an image
  ``[C, H, W]`` to ``(C, h/m, m, P, w/m, m, P)``, permutes to ``(h/m, w/m, m, m, C, P, P)``
  and copies every patch ``T = temporal_patch_size`` times along a new axis after ``C``:
  each row is one patch flattened as ``(C, T, P, P)``, and the rows come in **merge-group
  order** (the ``m × m`` patches of one merged token consecutive, groups in raster order;
  ``m = spatial_merge_size``). ``t = 1`` for an image.
- **Patch embedding**: ``PatchEmbed`` views each row as ``[C, T, P, P]`` and applies a
  ``Conv3d`` with kernel = stride ``(T, P, P)`` (no bias in Qwen2-VL, a bias in Qwen3-VL):
  on ``T`` identical copies it is the 2-D patch projection with the kernel summed over
  ``T``, the linear map ``embed(inputs, ops)`` routes the pixel gradient through.
- **Position**: Qwen3-VL adds a learned ``pos_embed`` table (``num_position_embeddings``,
  a square grid) bilinearly interpolated to the image's grid (``align_corners=True``,
  ``get_vision_interpolation_indices_and_weights``: the same value for a patch in raster
  order, ``spatial_merge_size=1``, as in merge order). Both add a **2-D rotary embedding**
  (``VisionRotaryEmbedding``, axial): per patch the angles ``[h·f, w·f, h·f, w·f]`` of its
  row and column (``f``: ``head_dim / 4`` frequencies), computed in float32;
  ``apply_rotary_pos_emb_vision`` rotates ``q`` and ``k`` (rotate-half layout) **in
  float32** and casts them back (a float64 model's queries and keys are rounded to float32
  there: the adapter does the same, so its forward equals the model's to 1e-12).
- **Blocks** (``Qwen2VLVisionBlock`` / ``Qwen3VLVisionBlock``): pre-LN,
  ``x + proj(attn(norm1(x)))``, ``x + mlp(norm2(x))``; one fused ``qkv`` Linear split as
  ``reshape(N, 3, heads, d)``, scale ``d ** -0.5``; LayerNorms (eps 1e-6); MLP ``fc1 →
  act → fc2`` (QuickGELU in Qwen2-VL, ``gelu_pytorch_tanh`` in Qwen3-VL). Attention is
  **block-diagonal per image** (``cu_seqlens`` from ``grid_thw``, one segment of ``h·w``
  patches per image and frame): a batch of ``B`` images of one grid is ``B`` independent
  sequences, which is the adapter's batch. No dropout.
- **Qwen2.5-VL's blocks** (``Qwen2_5_VLVisionBlock``): the same attention (``qkv`` with
  bias, 2-D RoPE in float32), but **RMSNorm** (``Qwen2_5_VLRMSNorm``, eps 1e-6: the input
  cast to float32, normalised, cast back, times ``weight``; the adapter's norms do the same,
  :func:`~captum_vit.adapters.parts.rms_norm_parts`) and a **SwiGLU** MLP
  ``down_proj(act(gate_proj(u)) ⊙ up_proj(u))`` (SiLU, biases). The blocks outside
  ``fullatt_block_indexes`` attend within **windows** of ``window = window_size //
  spatial_merge_size // patch_size`` merged tokens a side (``get_vision_window_index``): the
  model permutes the merge groups into window order before the blocks (and the RoPE tables
  with them), attends per window (``cu_window_seqlens``; edge windows smaller, nothing
  padded), and un-permutes only the merger's output, so its ``last_hidden_state`` is in
  window order. The adapter keeps raster order and gives those blocks the windows as index
  sets (:func:`window_slots`, :class:`~captum_vit.adapters.windows.SlotWindows`: padded
  slots are no keys), their RoPE tables partitioned alike; the global blocks attend per
  image as above. True token removal (TIS) is refused on the windowed blocks by name.
- **Output**: ``last_hidden_state`` is the last block's output (no final norm), in merge
  order (Qwen2.5-VL: window order); ``pooler_output`` is ``merger(last_hidden_state)``: a
  norm per patch (LayerNorm; Qwen2.5-VL's RMSNorm;
  Qwen3-VL's ``deepstack_merger_list`` norm the concatenated group), the ``m²`` patches of a
  group concatenated, an MLP: the image features the language model reads. Qwen3-VL's
  **deepstack** also returns ``deepstack_merger_list[i]`` of the outputs of blocks
  ``deepstack_visual_indexes`` (added to the language model's first hidden states).

The adapter's plain input is an image tensor ``[B, C, H, W]`` (``H``, ``W`` multiples of
``P·m``): it builds the packed rows itself (the processor's order and ``T`` copies), runs
the model's own ``patch_embed`` (and ``pos_embed`` interpolation), and keeps the tokens in
**raster order** from there on (the maps land on the patch grid as for every family; the
merge-group order is undone after the embedding and redone by
:class:`~captum_vit.targets.VLMAnswer` before the mergers). A processor's output
(``pixel_values`` + ``image_grid_thw``) is taken by ``attribute`` directly
(:meth:`HFQwenVisionAdapter.processor_images`: each image unpacked to ``[1, C, H, W]``,
grouped by grid); videos (``t > 1``) are refused by name. The tower has no image embedding of
its own: the patch mean of the last block's tokens stands for one (our choice, as for
PaliGemma's head-less tower), scored against the mean of the model's own
``last_hidden_state``; the VLM's answer (:class:`~captum_vit.targets.VLMAnswer`) is what a
user explains. Not supported: videos, ``Qwen3VLMoeVisionModel``.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from captum_vit.adapters._typing import ModelTree
from captum_vit.adapters.catalog import Example, register_family
from captum_vit.adapters.families._examples import VLM_IMAGE_ID, library, randomize_
from captum_vit.adapters.families._hf import HFPatchGrid, first_attribute
from captum_vit.adapters.layout import merge_order
from captum_vit.adapters.ops import Ops
from captum_vit.adapters.parts import BlockParts, HeadParts, rms_norm_parts, rotary_rows
from captum_vit.adapters.parts import layer_norm_parts as _norm
from captum_vit.adapters.windows import SlotWindows

CLASSES = ("Qwen2VisionTransformerPretrainedModel", "Qwen2_5_VisionTransformerPretrainedModel",
           "Qwen3VLVisionModel")
_MODULES = {"Qwen2VisionTransformerPretrainedModel": ("qwen2_vl", "Qwen2VLVisionConfig"),
            "Qwen2_5_VisionTransformerPretrainedModel": ("qwen2_5_vl", "Qwen2_5_VLVisionConfig"),
            "Qwen3VLVisionModel": ("qwen3_vl", "Qwen3VLVisionConfig")}


def is_hf_qwen_vision(model: nn.Module) -> bool:
    """``True`` for the Qwen2-VL, Qwen2.5-VL and Qwen3-VL vision towers of :data:`CLASSES` (a
    subclass too; transformers is never imported for other models).

    Args:
        model (nn.Module): any model.

    Returns:
        bool: whether :class:`HFQwenVisionAdapter` applies.
    """
    return any(c.__name__ in CLASSES and c.__module__.startswith("transformers.")
               for c in type(model).__mro__)


def window_slots(grid: tuple[int, int], merge: int, window: int) -> Tensor:
    """Qwen2.5-VL's attention windows as index sets of the raster patch grid: ``[n_W, M]``
    raster patch indices, ``-1`` at padded slots (``M = (window · merge)²``).

    Verified against ``transformers.vision_utils.get_vision_window_index``: the windows
    tile the **merged** grid ``(h/m, w/m)`` in squares of ``window`` merged tokens
    (``window_size // spatial_merge_size // patch_size``), in raster order of the windows;
    the last row and column of windows are cut at the grid's edge (smaller windows, no
    padding inside the model: its ``cu_window_seqlens`` skip empty windows); each merged
    token brings its ``m × m`` patches. The windows of the Qwen2.5-VL tower's windowed
    blocks (:class:`~captum_vit.adapters.windows.SlotWindows`); the slot order inside a
    window does not change the attention.

    Examples::

        >>> window_slots((4, 6), 2, 2)[1]
        tensor([ 4,  5, 10, 11, 16, 17, 22, 23, -1, -1, -1, -1, -1, -1, -1, -1])
    """
    h, w = grid
    lh, lw = h // merge, w // merge
    side = window * merge
    rows: list[list[int]] = []
    for r0 in range(0, lh, window):
        for c0 in range(0, lw, window):
            slots = [(merge * r + dr) * w + merge * c + dc
                     for r in range(r0, min(r0 + window, lh))
                     for c in range(c0, min(c0 + window, lw))
                     for dr in range(merge) for dc in range(merge)]
            rows.append(slots + [-1] * (side * side - len(slots)))
    return torch.tensor(rows, dtype=torch.long)


def _vision_config(cls_name: str, **kw: Any) -> Any:
    module, config = _MODULES[cls_name]
    cfg = getattr(library(f"transformers.models.{module}.configuration_{module}"), config)
    return cfg(**kw)


def tiny_vision_config(cls_name: str, depth: int = 2, **overrides: Any) -> dict[str, Any]:
    """The keywords of a tiny vision config of ``cls_name`` (patch 4, merge 2, 2 temporal
    copies, width 32, 2 heads, output width 32 (Qwen2-VL's ``hidden_size``) or 24
    (Qwen3-VL's and Qwen2.5-VL's ``out_hidden_size``); Qwen3-VL: a 4×4 position table and
    one deepstack block, block 0; Qwen2.5-VL: SwiGLU MLP of 64, windows of 2×2 merged
    tokens (``window_size`` 16 px), the last block global)."""
    common: dict[str, Any] = dict(depth=depth, num_heads=2, in_channels=3, patch_size=4,
                                  spatial_merge_size=2, temporal_patch_size=2)
    if cls_name.startswith("Qwen2_5"):
        common.update(hidden_size=32, intermediate_size=64, out_hidden_size=24,
                      hidden_act="silu", window_size=16,
                      fullatt_block_indexes=[depth - 1])
    elif cls_name.startswith("Qwen2"):
        common.update(embed_dim=32, mlp_ratio=2, hidden_size=32, hidden_act="quick_gelu")
    else:
        common.update(hidden_size=32, intermediate_size=64, out_hidden_size=24,
                      hidden_act="gelu_pytorch_tanh", num_position_embeddings=16,
                      deepstack_visual_indexes=[0])
    common.update(overrides)
    return common


def qwen_tower_example(cls_name: str) -> Callable[..., nn.Module]:
    """A builder of a tiny Qwen vision tower ``cls_name`` (:func:`tiny_vision_config`;
    ``depth`` blocks), weights drawn far from their initial values."""
    def build(*, seed: int = 0, depth: int = 2, dtype: torch.dtype = torch.float64,
              num_classes: int = 5, **overrides: Any) -> nn.Module:
        module = _MODULES[cls_name][0]
        cfg = _vision_config(cls_name, **tiny_vision_config(cls_name, depth, **overrides))
        cls = getattr(library(f"transformers.models.{module}.modeling_{module}"), cls_name)
        torch.manual_seed(seed)
        return randomize_(cls(cfg), seed).to(dtype).eval()

    return build


def qwen_vlm_example(cls_name: str) -> Callable[..., nn.Module]:
    """A builder of a tiny ``Qwen2VLForConditionalGeneration`` /
    ``Qwen2_5_VLForConditionalGeneration`` / ``Qwen3VLForConditionalGeneration``: the
    tower of :func:`qwen_tower_example` and a
    2-layer language model (width 24, vocabulary 300) whose image placeholder is
    :data:`VLM_IMAGE_ID` (``vision_start`` 297, ``vision_end`` 298)."""
    def build(*, seed: int = 0, depth: int = 2, dtype: torch.dtype = torch.float64,
              num_classes: int = 5, **overrides: Any) -> nn.Module:
        transformers = library("transformers")
        qwen3 = cls_name.startswith("Qwen3")
        qwen25 = cls_name.startswith("Qwen2_5")
        tower = "Qwen3VLVisionModel" if qwen3 else "Qwen2_5_VisionTransformerPretrainedModel" \
            if qwen25 else "Qwen2VisionTransformerPretrainedModel"
        vision = tiny_vision_config(tower, depth, **overrides.pop("vision", {}))
        vision["out_hidden_size" if qwen3 or qwen25 else "hidden_size"] = 24  # the LM's
        text: dict[str, Any] = dict(vocab_size=300, hidden_size=24, intermediate_size=48,
                                    num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=1, max_position_embeddings=256,
                                    bos_token_id=1, eos_token_id=2, pad_token_id=0)
        if qwen3:
            text.update(head_dim=12, rope_parameters={"rope_type": "default",
                                                      "rope_theta": 10000.0,
                                                      "mrope_section": [2, 2, 2],
                                                      "mrope_interleaved": True})
            cfg = transformers.Qwen3VLConfig(
                vision_config=vision, text_config=text, image_token_id=VLM_IMAGE_ID,
                video_token_id=296, vision_start_token_id=297, vision_end_token_id=298,
                **overrides)
        else:
            text.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                         "mrope_section": [2, 2, 2]})
            cfg = getattr(transformers, "Qwen2_5_VLConfig" if qwen25 else "Qwen2VLConfig")(
                vision_config=vision, text_config=text, image_token_id=VLM_IMAGE_ID,
                video_token_id=296, vision_start_token_id=297, vision_end_token_id=298,
                **overrides)
        torch.manual_seed(seed)
        model = getattr(transformers, cls_name)(cfg)
        return randomize_(model, seed).to(dtype).eval()

    return build


@register_family(
    is_hf_qwen_vision,
    supports="Hugging Face Qwen2-VL, Qwen2.5-VL and Qwen3-VL vision towers "
             "(Qwen2VisionTransformerPretrainedModel, Qwen2_5_VisionTransformerPretrainedModel, "
             "Qwen3VLVisionModel; packed inputs)",
    tags=("embedding", "vlm-tower", "variable-size"),
    notes=("`Qwen2VisionTransformerPretrainedModel`, `Qwen2_5_VisionTransformerPretrainedModel` "
           "and `Qwen3VLVisionModel` (the towers of `Qwen2VLForConditionalGeneration` / "
           "`Qwen2_5_VLForConditionalGeneration` / `Qwen3VLForConditionalGeneration`, "
           "explained with `VLMAnswer`; the deepstack blocks read too): ✅ images "
           "`[B, C, H, W]` "
           "(multiples of patch × merge) or the processor's packed `pixel_values` + "
           "`image_grid_thw` (maps per image on its own grid), 2-D vision RoPE (rounded to "
           "float32 as the model does), block-diagonal attention per image, Qwen3-VL's "
           "interpolated position table, Qwen2.5-VL's RMSNorm (in float32 as the model), "
           "SwiGLU MLP and windows of merge groups (index sets; `fullatt_block_indexes` "
           "global); the tower alone: the patch mean of its last tokens as an embedding "
           "(our choice) — refused: videos (`t > 1`)"),
    examples={
        "hf_qwen2_vl_tower": Example(qwen_tower_example("Qwen2VisionTransformerPretrainedModel"),
                                     (16, 24), library="transformers", target="embedding"),
        "hf_qwen3_vl_tower": Example(qwen_tower_example("Qwen3VLVisionModel"), (16, 24),
                                     library="transformers", target="embedding"),
        "hf_qwen2_5_vl_tower": Example(
            qwen_tower_example("Qwen2_5_VisionTransformerPretrainedModel"), (16, 24),
            library="transformers", target="embedding", tags=("windowed",), suite=True),
        # support-matrix columns: whole VLMs, their towers explained through VLMAnswer
        "hf_qwen2_vl": Example(qwen_vlm_example("Qwen2VLForConditionalGeneration"), (16, 24),
                               library="transformers", target="vlm", tags=("matrix",),
                               suite=False),
        "hf_qwen3_vl": Example(qwen_vlm_example("Qwen3VLForConditionalGeneration"), (16, 24),
                               library="transformers", target="vlm", tags=("matrix",),
                               suite=False),
        "hf_qwen2_5_vl": Example(qwen_vlm_example("Qwen2_5_VLForConditionalGeneration"),
                                 (16, 24), library="transformers", target="vlm",
                                 tags=("matrix",), suite=False),
    })
class HFQwenVisionAdapter(HFPatchGrid):
    """Canonical view of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision tower (never modified).

    Its own output, for a target of the tower alone, is the patch mean of the last
    block's tokens (an embedding, our choice); the answer of the VLM around it is
    explained with :class:`~captum_vit.targets.VLMAnswer`.

    Args:
        model (nn.Module): a ``Qwen2VisionTransformerPretrainedModel``,
            ``Qwen2_5_VisionTransformerPretrainedModel`` or ``Qwen3VLVisionModel``.

    Raises:
        TypeError: a layer layout the adapter does not know.

    Examples::

        >>> from captum_vit import GAE
        >>> tower = VLMAnswer.tower(qwen2_vl)            # model.model.visual
        >>> maps = GAE(tower).attribute(images, target=VLMAnswer(qwen2_vl, ids, answer))
        >>> maps = GAE(tower).attribute(processor_batch, target=...)   # packed inputs
    """

    model: ModelTree  # read by attribute names (captum_vit.adapters._typing)
    embedding = True
    processor_keys = ("image_grid_thw",)

    def __init__(self, model: ModelTree) -> None:
        self.model = model
        name = type(model).__name__
        cfg = model.config
        self.qwen3 = hasattr(model, "pos_embed")
        self.qwen25 = hasattr(model, "fullatt_block_indexes")
        module = sys.modules[type(model).__module__]
        rotate_half = getattr(module, "rotate_half", None)
        if rotate_half is None:
            raise TypeError(f"{type(model).__module__} has no rotate_half: this transformers "
                            f"version's {name} is not supported")
        self._rotate_half = rotate_half
        self._interp = getattr(module, "get_vision_interpolation_indices_and_weights", None)
        if self.qwen3 and self._interp is None:
            raise TypeError(f"{name}: this transformers version has no "
                            "get_vision_interpolation_indices_and_weights")
        self.layers = model.blocks
        self.in_chans = int(cfg.in_channels)
        self.num_prefix = 0
        self.readout = "avg"
        self.patch = int(cfg.patch_size)
        self.merge = int(cfg.spatial_merge_size)
        self.frames = int(cfg.temporal_patch_size)
        self.head = HeadParts(None, None, (("avg", None, None),))
        self._rope: tuple[Tensor, Tensor] | None = None  # (cos, sin) [N, d], float32
        # Qwen2.5-VL: windows of `window` merged tokens a side; global blocks `full`
        self.window = int(cfg.window_size) // self.merge // self.patch if self.qwen25 else 0
        self.full = frozenset(int(i) for i in (model.fullatt_block_indexes or ())) \
            if self.qwen25 else frozenset()
        if self.qwen25 and self.window < 1:
            raise TypeError(f"{name}: window_size {cfg.window_size} is below one merged token "
                            f"(spatial_merge_size × patch_size = {self.merge * self.patch})")
        self._windows: SlotWindows | None = None
        self._rope_windows: tuple[Tensor, Tensor] | None = None  # [n_W, M, d], float32
        self._grid: tuple[int, int] | None = None
        self.blocks = [self._block(layer, int(cfg.num_heads), f"{name}.blocks[{i}]", i)
                       for i, layer in enumerate(self.layers)]
        if not self.blocks:
            raise TypeError(f"{name} has no blocks")
        _, (hh, ww) = self.input_shape
        self._set_grid((hh // self.patch, ww // self.patch))

    def windowed(self, layer: int) -> bool:
        """Whether block ``layer`` attends within windows (Qwen2.5-VL's blocks outside
        ``fullatt_block_indexes``)."""
        return self.qwen25 and layer not in self.full

    def _block(self, layer: ModelTree, heads: int, where: str, index: int) -> BlockParts:
        att, mlp = layer.attn, layer.mlp
        w, b = att.qkv.weight, att.qkv.bias
        d = w.shape[0] // 3
        head_dim = d // heads
        if self.qwen25:  # RMSNorm in float32, SwiGLU MLP, windows
            gate, fc1 = mlp.gate_proj, mlp.up_proj
            fc2, act = mlp.down_proj, mlp.act_fn
            norm1 = rms_norm_parts(layer.norm1, f"{where}.norm1", torch.float32)
            norm2 = rms_norm_parts(layer.norm2, f"{where}.norm2", torch.float32)
        else:
            gate = None
            fc1 = first_attribute(mlp, "fc1", "linear_fc1")  # Qwen2-VL, Qwen3-VL
            fc2 = first_attribute(mlp, "fc2", "linear_fc2")
            act = first_attribute(mlp, "act", "act_fn")
            norm1, norm2 = _norm(layer.norm1, f"{where}.norm1"), _norm(layer.norm2,
                                                                       f"{where}.norm2")
        windowed = self.windowed(index)
        return BlockParts(
            norm1=norm1,
            q_weight=w[:d], k_weight=w[d:2 * d], v_weight=w[2 * d:],
            q_bias=None if b is None else b[:d], k_bias=None if b is None else b[d:2 * d],
            v_bias=None if b is None else b[2 * d:],
            num_heads=heads, head_dim=head_dim, scale=head_dim ** -0.5,
            q_norm=nn.Identity(), k_norm=nn.Identity(),
            proj_weight=att.proj.weight, proj_bias=att.proj.bias, ls1=None,
            norm2=norm2,
            fc1_weight=fc1.weight, fc1_bias=fc1.bias, act=act,
            fc2_weight=fc2.weight, fc2_bias=fc2.bias, ls2=None,
            gate_weight=None if gate is None else gate.weight,
            gate_bias=None if gate is None else gate.bias,
            rotary=self._rotate_windows if windowed else self._rotate,
            window=self._windows if windowed else None)

    def refresh(self) -> None:
        """The q/k/v parts are slices of ``qkv.weight``: re-read them after
        ``model.to(...)``."""
        if self.blocks[0].k_weight.untyped_storage().data_ptr() != \
                self.layers[0].attn.qkv.weight.untyped_storage().data_ptr():
            name = type(self.model).__name__
            self.blocks = [self._block(layer, self.blocks[0].num_heads, f"{name}.blocks[{i}]",
                                       i) for i, layer in enumerate(self.layers)]

    def _set_grid(self, grid: tuple[int, int]) -> None:
        """Qwen2.5-VL: the windowed blocks' :class:`~captum_vit.adapters.windows.SlotWindows`
        of the patch grid ``grid`` (:func:`window_slots`); nothing for the other towers."""
        if not self.qwen25 or grid == self._grid:
            return
        self._grid = grid
        self._windows = SlotWindows(window_slots(grid, self.merge, self.window),
                                    grid[0] * grid[1])
        self.blocks = [dataclasses.replace(p, window=self._windows) if self.windowed(i)
                       else p for i, p in enumerate(self.blocks)]

    # -- geometry -----------------------------------------------------------------------
    @property
    def input_shape(self) -> tuple[int, tuple[int, int]]:
        """``(channels, (H, W))``: the tower has no fixed size; 8 merged tokens a side."""
        side = 8 * self.patch * self.merge
        return self.in_chans, (side, side)

    def check_inputs(self, inputs: Tensor) -> None:
        super().check_inputs(inputs)
        if inputs.dim() != 4:
            raise ValueError(f"inputs of shape {tuple(inputs.shape)}: the Qwen vision tower "
                             "takes images [B, C, H, W] (or the processor's output with "
                             "pixel_values and image_grid_thw); videos are not supported")
        unit = self.patch * self.merge
        self.check_patch_multiple(inputs, (unit, unit))

    # -- rotary position embedding -------------------------------------------------------
    def _rotate(self, h: Tensor, positions: Tensor | None) -> Tensor:
        """The model's vision RoPE on ``h`` [B, H, n, d] (no prefix rows): in float32 as
        ``apply_rotary_pos_emb_vision``, cast back; the rows of the tokens' original
        ``positions`` [B, n] under token removal."""
        if self._rope is None:
            raise ValueError("the rotary embedding depends on the input grid: get the token "
                             "states from adapter.embed(images) before running the blocks")
        cos, sin = self._rope
        idx = rotary_rows(positions, h.shape[2], 0, cos.shape[0], cos.device)
        if idx is not None:
            cos, sin = cos[idx].unsqueeze(1), sin[idx].unsqueeze(1)
        hf = h.float()
        return (hf * cos + self._rotate_half(hf) * sin).to(h.dtype)

    def _rotate_windows(self, h: Tensor, positions: Tensor | None) -> Tensor:
        """The model's vision RoPE on the window slots ``h`` [B·n_W, H, M, d] of a windowed
        block (Qwen2.5-VL; padded slots get zero tables), in float32 as the model."""
        if self._rope_windows is None or positions is not None:
            raise ValueError("the rotary embedding depends on the input grid: get the token "
                             "states from adapter.embed(images) before running the blocks")
        cos, sin = self._rope_windows  # [n_W, M, d]
        nw = cos.shape[0]
        hf = h.float().reshape(-1, nw, *h.shape[1:])  # [B, n_W, H, M, d]
        cos, sin = cos[None, :, None], sin[None, :, None]
        out = hf * cos + self._rotate_half(hf) * sin
        return out.reshape(h.shape).to(h.dtype)

    def _positions(self, grid: tuple[int, int], device: torch.device) -> Tensor:
        """``(row, column)`` of every patch in raster order, ``[h·w, 2]``."""
        h, w = grid
        rows, cols = torch.meshgrid(torch.arange(h, device=device),
                                    torch.arange(w, device=device), indexing="ij")
        return torch.stack([rows.flatten(), cols.flatten()], -1)

    # -- packing ------------------------------------------------------------------------
    def pack(self, images: Tensor) -> Tensor:
        """Images ``[B, C, H, W]`` as the processor packs them: ``[B·N, C·T·P·P]``, each
        image's patches in merge-group order, ``T`` copies of each patch."""
        b, c, hh, ww = images.shape
        p, m, t = self.patch, self.merge, self.frames
        x = images.reshape(b, c, hh // p // m, m, p, ww // p // m, m, p)
        x = x.permute(0, 2, 5, 3, 6, 1, 4, 7)  # [B, h/m, w/m, m, m, C, P, P]
        x = x.unsqueeze(6).expand(*x.shape[:6], t, p, p)
        return x.reshape(b * (hh // p) * (ww // p), c * t * p * p)

    def unpack(self, rows: Tensor, grid: tuple[int, int]) -> Tensor:
        """One image's packed rows ``[h·w, C·T·P·P]`` (grid ``(h, w)`` in patches) as the
        image ``[1, C, H, W]`` (:meth:`pack`'s inverse; the first temporal copy)."""
        h, w = grid
        p, m, t, c = self.patch, self.merge, self.frames, self.in_chans
        x = rows.reshape(h // m, w // m, m, m, c, t, p, p)
        if t > 1 and not bool((x == x[:, :, :, :, :, :1]).all()):
            raise ValueError("pixel_values: the temporal copies of a patch differ (a video "
                             "clip); the Qwen vision adapter explains images (t = 1)")
        x = x[:, :, :, :, :, 0].permute(4, 0, 2, 5, 1, 3, 6)  # [C, h/m, m, P, w/m, m, P]
        return x.reshape(1, c, h * p, w * p)

    def _grids(self, batch: Mapping[str, Any]) -> tuple[Tensor, Tensor]:
        """``(pixel_values, image_grid_thw)`` of a processor batch, checked."""
        for key in ("pixel_values", "image_grid_thw"):
            if key not in batch:
                raise ValueError(f"the processor's output has no {key!r}: pass the "
                                 "mapping the Qwen processor returns (pixel_values and "
                                 "image_grid_thw)")
        pixels, thw = batch["pixel_values"], batch["image_grid_thw"]
        if not isinstance(pixels, Tensor) or pixels.dim() != 2:
            raise ValueError(f"pixel_values must be the packed patches [ΣN, C·T·P·P], got "
                             f"{getattr(pixels, 'shape', type(pixels).__name__)}")
        thw = torch.as_tensor(thw)
        if thw.dim() != 2 or thw.shape[1] != 3 or torch.is_floating_point(thw):
            raise ValueError(f"image_grid_thw must be integers [n, 3] (t, h, w per image), "
                             f"got shape {tuple(thw.shape)}")
        width = self.in_chans * self.frames * self.patch ** 2
        if pixels.shape[1] != width:
            raise ValueError(f"pixel_values rows have {pixels.shape[1]} values but this tower "
                             f"takes {width} (C·T·P·P = {self.in_chans}·{self.frames}·"
                             f"{self.patch}·{self.patch})")
        if bool((thw[:, 0] != 1).any()):
            raise ValueError(f"image_grid_thw has t = {thw[:, 0].tolist()}: t > 1 is a video "
                             "(pixel_values_videos), which is not supported; explain images")
        if bool((thw[:, 1:] % self.merge != 0).any()) or bool((thw[:, 1:] < 1).any()):
            raise ValueError(f"image_grid_thw {thw.tolist()}: h and w must be positive "
                             f"multiples of spatial_merge_size {self.merge}")
        total = int(thw.prod(-1).sum())
        if total != pixels.shape[0]:
            raise ValueError(f"image_grid_thw {thw.tolist()} covers {total} patches but "
                             f"pixel_values has {pixels.shape[0]} rows: pass the "
                             "image_grid_thw the processor returned with these pixel_values")
        return pixels, thw.long()

    def processor_images(self, batch: Mapping[str, Any]) -> list[tuple[Tensor, Tensor]]:
        """The images of a Qwen processor's output, ``[k, C, H, W]`` per grid.

        ``pixel_values`` ``[ΣN, C·T·P·P]`` is cut by ``image_grid_thw`` (``t·h·w`` rows
        per image, in order), each image unpacked (:meth:`unpack`), and the images of one
        grid stacked in batch order.

        Raises:
            ValueError: a key missing, an ``image_grid_thw`` that does not cover
                ``pixel_values``, a video (``t > 1``).
        """
        pixels, thw = self._grids(batch)
        groups: dict[tuple[int, int], list[int]] = {}
        images: list[Tensor] = []
        start = 0
        for i, (_, h, w) in enumerate(thw.tolist()):
            images.append(self.unpack(pixels[start:start + h * w], (h, w)))
            start += h * w
            groups.setdefault((h, w), []).append(i)
        return [(torch.tensor(idx, dtype=torch.long), torch.cat([images[i] for i in idx]))
                for idx in groups.values()]

    def processor_pixels(self, maps: Sequence[Tensor], batch: Mapping[str, Any]) -> Tensor:
        """Per-image pixel maps packed as ``pixel_values``: each pixel's value spread
        equally over its ``T`` temporal copies (the row sums are the pixel maps')."""
        return torch.cat([self.pack(m) / self.frames for m in maps])

    # -- embedding --------------------------------------------------------------------------
    def embed(self, inputs: Tensor, ops: Ops | None = None) -> Tensor:
        """The model's ``patch_embed`` of the packed images (Qwen3-VL: plus the
        interpolated ``pos_embed``), in raster order ``[B, N, D]``; keeps the rotary
        tables of the grid for the blocks.

        With ``ops`` the value is the same and the patch projection (the ``Conv3d`` on
        ``T`` copies: the 2-D kernel summed over ``T``) runs through ``ops.linear`` as
        ``p - p.detach()`` (exactly 0), so every pixel gradient goes through it.
        """
        m = self.model
        b, c, hh, ww = inputs.shape
        grid = (hh // self.patch, ww // self.patch)
        n = grid[0] * grid[1]
        order = merge_order(grid, self.merge, inputs.device)
        packed = self.pack(inputs if ops is None else inputs.detach())
        x = m.patch_embed(packed).reshape(b, n, -1)[:, order.argsort()]
        pos = self._positions(grid, inputs.device)
        if self._interp is not None and self.qwen3:
            thw = torch.tensor([[1, *grid]], device=inputs.device)
            idx, wts = self._interp(thw, num_grid_per_side=m.num_grid_per_side,
                                    mode=m.interpolation_mode,
                                    align_corners=m.interpolation_align_corners,
                                    spatial_merge_size=1)
            table = (m.pos_embed(idx) * wts[:, :, None]).sum(1)
            x = x + table.to(x.dtype)
        with torch.no_grad():
            self._rope = m.rotary_pos_emb(x, pos)
        self._set_grid(grid)
        if self._windows is not None:
            self._rope_windows = tuple(  # type: ignore[assignment]
                self._windows.partition(t[None].to(torch.float32))
                for t in self._rope)
        if ops is None:
            return x
        conv = m.patch_embed.proj
        weight = conv.weight.sum(2).reshape(conv.out_channels, -1)  # [D, C·P·P]
        p = self.patch
        patches = inputs.reshape(b, c, grid[0], p, grid[1], p).permute(0, 2, 4, 1, 3, 5)
        proj = ops.linear(patches.reshape(b, n, -1), weight, conv.bias)
        return x + (proj - proj.detach())

    # -- the model's own forward -------------------------------------------------------------
    def model_tokens(self, inputs: Tensor) -> Tensor:
        """The model's own ``last_hidden_state`` of images ``[B, C, H, W]`` (its forward on
        the packed rows), in raster order ``[B, N, D]`` (Qwen2.5-VL's window order of the
        merge groups undone, :func:`window_slots`)."""
        b, _, hh, ww = inputs.shape
        grid = (hh // self.patch, ww // self.patch)
        thw = torch.tensor([[1, *grid]] * b, device=inputs.device)
        out = self.model(self.pack(inputs), grid_thw=thw).last_hidden_state
        order = merge_order(grid, self.merge, inputs.device)
        n = grid[0] * grid[1]
        if self.qwen25:  # its last_hidden_state is in window order: merge groups permuted
            unit = self.merge ** 2
            groups = window_slots(grid, self.merge, self.window)  # raster patch indices
            first = groups[groups >= 0].reshape(-1, unit)[:, 0].to(inputs.device)
            group = order.argsort()[first] // unit  # each window-order group's merge index
            rows = (group[:, None] * unit + torch.arange(unit, device=inputs.device)).flatten()
            out = out.reshape(b, n, -1)[:, rows.argsort()].reshape(b * n, -1)
        return out.reshape(b, n, -1)[:, order.argsort()]

    def model_outputs(self, inputs: Tensor) -> Tensor:
        """The patch mean of the model's own ``last_hidden_state`` ``[B, D]``."""
        return self.model_tokens(inputs).mean(1)

    def self_check_outputs(self, inputs: Tensor) -> dict[str, tuple[Any, Tensor]]:
        """The last block's tokens of the model's forward against the canonical forward's
        (every token, in raster order)."""
        x = self.embed(inputs)
        ops = Ops()
        for l in range(len(self.blocks)):
            x = self.block(x, l, ops)
        return {"token": (self.model_tokens(inputs), x)}

    def parameter_stages(self) -> list[list[nn.Parameter]]:
        """Head stage (the merger and Qwen3-VL's deepstack mergers: what reads the blocks'
        outputs), then blocks ``L-1 .. 0``; the embedding (patch projection, position
        table) belongs to no stage."""
        head = list(self.model.merger.parameters())
        for merger in getattr(self.model, "deepstack_merger_list", ()):
            head += list(merger.parameters())
        return [head] + [list(layer.parameters()) for layer in reversed(self.layers)]


__all__ = ["CLASSES", "HFQwenVisionAdapter", "is_hf_qwen_vision", "merge_order",
           "qwen_tower_example", "qwen_vlm_example", "tiny_vision_config", "window_slots"]
