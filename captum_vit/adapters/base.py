"""The adapter: first what a model family implements, then the engine.

Design (the layers of the package's DESIGN: the adapter owns all model maths). A family
adapter is a *declaration*: it says where the model keeps the canonical parameters
(:mod:`captum_vit.adapters.parts`, views of the model's own tensors), how images become
the first token states, and what geometry a batch has (:mod:`captum_vit.adapters.layout`).
Everything after the embedding is computed by the engine below, once, against an
:class:`~captum_vit.adapters.ops.Ops` object (:mod:`captum_vit.adapters.ops`): the plain,
fused and linearised forwards, the LRP rule sets (:mod:`captum_vit.adapters.rules`) and the
decompositions of the methods are all the same canonical forward with other primitives.

What a family implements is the abstract part of :class:`ViTAdapter` (each member
documented there): the attributes ``model``, ``blocks``, ``head``, ``num_prefix``,
``readout`` and ``in_chans``, and the abstract members :meth:`~ViTAdapter.layout`,
:meth:`~ViTAdapter.embed`, :attr:`~ViTAdapter.input_shape` and
:meth:`~ViTAdapter.parameter_stages` (:data:`FAMILY_CONTRACT`); optional hooks with
defaults (:data:`FAMILY_HOOKS`). A family overrides nothing else. The engine (run, trace,
self-check, token removal) is written against that contract only, and so are the two
parts it is made with: the readout and targeting (:class:`~captum_vit.adapters.readout.Readout`,
a base class of :class:`ViTAdapter`) and the token geometry of the blocks
(:class:`~captum_vit.adapters.stages.Stages`, ``adapter.stages``). A view of a model
(:class:`~captum_vit.adapters.subnetwork.SubnetworkAdapter`) is one more implementation of
it, delegating to the model's adapter.

Why this contract reaches further models without touching the methods:

- *A score read from any block's token rows.* The methods see a trace (records of every
  block, :mod:`captum_vit.adapters.trace`) and a score, never the head: the score is the
  readout's :meth:`~ViTAdapter.readout_logits` of any block's states, and inside
  :meth:`~ViTAdapter.targeting` the head itself is replaced (a :class:`TargetHead`,
  :mod:`captum_vit.adapters.scoring`). A target reading other rows of another block is one
  more head over the recorded states; no family member changes.
- *Models made of stages* (Swin, SAM's image encoder: per stage its own token grid,
  windowed attention and a patch merge). The engine walks ``blocks`` with
  :meth:`~ViTAdapter.block`, the only place a block's maths lives, and the one attention
  (:meth:`~captum_vit.adapters.parts.BlockParts.attention`) takes the key mask and the
  tokens' positions: a windowed block is an attention whose mask and positions come from
  its window partition, and a merge is one more canonical operation between two blocks of
  a family's ``block``. The family declares these; the :class:`Layout` it returns is the
  grid the maps land on (the first stage's for Swin), so the front, the metrics and the
  plots convert maps to pixels unchanged; a method moves per-token values between the
  stages' grids through ``adapter.stages`` (:mod:`captum_vit.adapters.stages`).

Per-model settings (target embeddings, the CLS share of a ``[CLS ; mean]`` readout, the
detached parameters of a gradient trace) and the self-check memo are state of the adapter
(:class:`~captum_vit.adapters.state.AdapterState`), and :func:`captum_vit.adapters.adapt`
keeps one adapter per model.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from captum_vit._text import count_noun
from captum_vit.adapters.layout import Layout
from captum_vit.adapters.ops import FusedOps, HeadsOps, Ops
from captum_vit.adapters.parts import (
    BlockParts,
    HeadParts,
    Heads,
    _detached,
    small_attention,
)
from captum_vit.adapters.readout import Readout
from captum_vit.adapters.scoring import Target
from captum_vit.adapters.stages import Stages
from captum_vit.adapters.state import AdapterSettings, AdapterState
from captum_vit.adapters.trace import BlockRecord, Trace, TraceOptions

__all__ = ["FAMILY_CONTRACT", "FAMILY_HOOKS", "AdapterSettings", "AdapterState", "ViTAdapter"]


def _channel_mismatch(got: int, expected: int) -> str:
    """The message for inputs with ``got`` channels fed to a model taking ``expected``,
    with the fix (a grayscale image for an RGB model: repeat its channel)."""
    want = count_noun(expected, "channel")
    if got == 1 and expected > 1:
        return (f"inputs have 1 channel (grayscale) but the model expects {want}: repeat the "
                f"channel with inputs.expand(-1, {expected}, -1, -1) (or "
                f"inputs.repeat(1, {expected}, 1, 1)), normalised as the model expects, or "
                "use a model built for 1-channel inputs (e.g. timm's in_chans=1)")
    if got == 3 and expected == 1:
        return ("inputs have 3 channels (RGB) but the model expects 1 (grayscale): convert "
                "them, e.g. to luminance with (inputs * torch.tensor([0.299, 0.587, "
                "0.114]).view(1, 3, 1, 1)).sum(1, keepdim=True), or use a 3-channel model")
    return f"inputs have {count_noun(got, 'channel')} but the model expects {want}"


FAMILY_CONTRACT = ("layout", "embed", "input_shape", "parameter_stages")
"""The abstract members of :class:`ViTAdapter`: what every model family implements
(besides the attributes ``model``, ``blocks``, ``head``, ``num_prefix``, ``readout`` and
``in_chans``)."""

FAMILY_HOOKS = ("refresh", "embedding_norms", "check_inputs", "is_random", "model_outputs",
                "output_extras", "self_check_outputs", "video", "embedding",
                "no_output_reason", "processor_keys", "processor_images", "processor_pixels")
"""The members of :class:`ViTAdapter` a family may override (methods with defaults,
class attributes): every other member is the engine's."""


class ViTAdapter(Readout, abc.ABC):
    """Canonical pre-LN ViT on top of a concrete model.

    **What a family implements.** A family adapter sets the attributes below in its
    ``__init__`` and implements the abstract members (:data:`FAMILY_CONTRACT`); a subclass
    missing one of them cannot be instantiated. The optional hooks
    (:data:`FAMILY_HOOKS`) have defaults; a family overrides no other member.

    Attributes:
        model (nn.Module): the model (never modified).
        blocks (list[BlockParts]): the canonical parameters of every block, in order
            (views of the model's parameters, :mod:`captum_vit.adapters.parts`).
        head (HeadParts): final norm, pooling and classifier(s) (set through the
            :attr:`head` property, which adds the target in force when read).
        num_prefix (int): ``K``, the prefix tokens (CLS, DIST, registers) before the
            patches.
        readout (str): how the logits read the last state, one of
            :data:`~captum_vit.adapters.layout.READOUTS`.
        in_chans (int): the number of input channels.
        embedding (bool): whether the model outputs an image embedding (default
            ``False``).

    Abstract members: :meth:`layout` (the geometry of a batch), :meth:`embed` (images to
    ``x_0``), :attr:`input_shape` (the default input size) and :meth:`parameter_stages`
    (the model's parameters by cascade stage). Optional hooks: :meth:`refresh`,
    :meth:`embedding_norms`, :meth:`check_inputs`, :meth:`is_random`,
    :meth:`model_outputs`, :meth:`output_extras`, :meth:`self_check_outputs`, and the
    class attributes :attr:`video`, :attr:`embedding` and :attr:`no_output_reason`.

    **The engine** (the rest): :meth:`run`, :meth:`block`, :meth:`trace`, token removal,
    :meth:`self_check`; the readout and targeting members come from
    :class:`~captum_vit.adapters.readout.Readout`, the blocks' token geometry is
    :attr:`stages`.
    """

    model: nn.Module
    blocks: list[BlockParts]
    _head_parts: HeadParts
    num_prefix: int
    readout: str
    in_chans: int

    # -- what a family implements --------------------------------------------------------
    @abc.abstractmethod
    def layout(self, inputs: Tensor) -> Layout:
        """The token geometry of images ``inputs`` [B, C, H, W] (:class:`Layout`): prefix
        rows, the patch grid the maps land on, the patch size in pixels, the readout."""

    @abc.abstractmethod
    def embed(self, inputs: Tensor, ops: Ops | None = None) -> Tensor:
        """The token states ``x_0`` [B, N, D] of images [B, C, H, W].

        ``ops=None`` runs the model's own embedding modules. With ``ops`` the patch
        projection (a convolution with stride = kernel, :func:`patch_projection`) goes
        through ``ops.linear`` and each normalisation of the embedding
        (:meth:`embedding_norms`) through ``ops.norm``, so a rule set of modified
        backward passes (LRP at the pixels, :mod:`captum_vit.adapters.rules`) reaches the
        pixels; prefix
        tokens, position embeddings (interpolation included) and rotary tables stay the
        model's own code, and the forward values are the model's up to rounding.
        """

    @property
    @abc.abstractmethod
    def input_shape(self) -> tuple[int, tuple[int, int]]:
        """``(channels, (H, W))``: the model's default input size."""

    @abc.abstractmethod
    def parameter_stages(self) -> list[list[nn.Parameter]]:
        """The model's own parameters by cascade stage, for the model-randomisation check.

        Returns:
            list of lists of ``nn.Parameter`` (the model's objects, not views, so an
            in-place randomisation changes the model): the head stage first (final norm,
            ``fc_norm``, classifier head(s)), then one stage per block from the top block
            ``L-1`` down to 0. Every parameter appears exactly once; the embedding's
            (patch embedding, prefix tokens, positional embedding, pre-norm) appear in
            none.
        """

    # -- optional hooks ------------------------------------------------------------------
    def refresh(self) -> None:
        """Re-read the parts if the model's parameters were replaced (e.g. ``model.to``).

        Called at every entry point (:meth:`layout`, :meth:`embed`, :meth:`run`,
        :meth:`trace`); adapters whose parts are the parameters themselves need nothing.
        """
        return None

    def embedding_norms(self) -> tuple[str, ...]:
        """Names of the normalisations inside :meth:`embed` (a pre-norm such as CLIP's
        ``pre_layrnorm``); empty when the embedding is affine in the pixels (patch
        projection, prefix tokens, position embedding). ``embed(inputs, ops)`` runs each
        of them through ``ops.norm`` (pixel-level LRP: the LN rule,
        :mod:`captum_vit.adapters.rules`)."""
        return ()

    def check_inputs(self, inputs: Tensor) -> None:
        """Raise a clear error for inputs the model cannot take (subclasses add their size
        rules).

        The dtype rule (no silent casts): floating-point inputs must have the dtype of
        the model's parameters, else ``TypeError`` naming both dtypes and the fix. The
        channels must be the model's, and a model whose output is random (training mode
        with active dropout) is refused.
        """
        self.refresh()
        want = self.dtype
        if torch.is_floating_point(inputs) and inputs.dtype != want:
            raise TypeError(
                f"inputs are {inputs.dtype} but the model's parameters are {want}; convert "
                f"the inputs with inputs.to({want}) or the model with "
                f"model.to({inputs.dtype})")
        if inputs.shape[-3] != self.in_chans:  # [B, C, H, W], videos [B, T, C, H, W]
            if self.video and inputs.dim() == 5 and inputs.shape[1] == self.in_chans:
                raise ValueError(
                    f"inputs of shape {tuple(inputs.shape)} look like [B, C, T, H, W] "
                    "(channels before frames); video models take [B, T, C, H, W], frames "
                    "before channels: pass inputs.permute(0, 2, 1, 3, 4)")
            raise ValueError(_channel_mismatch(inputs.shape[-3], self.in_chans))
        if self.is_random():
            raise ValueError("the model is in training mode with active dropout/drop-path, "
                             "so its output is random; call model.eval() before explaining")

    def is_random(self) -> bool:
        """Whether the model's forward is random now (training mode with active dropout)."""
        return False

    @staticmethod
    def check_patch_multiple(inputs: Tensor, patch: tuple[int, int]) -> None:
        """Refuse images whose size is not a multiple of the patch size (for
        :meth:`check_inputs` of families that interpolate their position embedding)."""
        h, w = inputs.shape[-2:]
        if h % patch[0] or w % patch[1]:
            raise ValueError(f"inputs size {(h, w)} is not divisible by the patch size "
                             f"{tuple(patch)}; resize, crop or pad the images to a multiple "
                             "of it")

    @staticmethod
    def check_fixed_size(inputs: Tensor, size: tuple[int, int], why: str) -> None:
        """Refuse images of another size than ``size`` (families whose position embedding
        is not interpolated; ``why`` names the model)."""
        got = tuple(inputs.shape[-2:])
        if got != tuple(size):
            raise ValueError(f"inputs size {got} does not match {why}'s fixed image_size "
                             f"{tuple(size)} (its position embedding is not interpolated); "
                             "resize the images")

    video: bool = False
    """Whether the model takes videos ``[B, T, C, H, W]`` rather than images ``[B, C, H,
    W]`` (its :meth:`layout` then sets ``frames``, :mod:`captum_vit.adapters.layout`)."""

    embedding: bool = False
    """Whether the model outputs an image embedding (CLIP, SigLIP, head-less models)
    rather than class logits: its targets are vectors (:mod:`captum_vit.targets`)."""

    no_output_reason: str | None = None
    """Why the model has no output of its own to explain, with what to explain instead
    (a detector: a detection target); ``None`` (default) when it has one (logits or an
    embedding). When set, :meth:`model_outputs` and, with no
    :class:`~captum_vit.adapters.scoring.Target` in force, :attr:`num_classes` raise
    ``TypeError`` with it."""

    processor_keys: tuple[str, ...] = ()
    """The keys of a processor's output besides ``pixel_values`` that this family reads
    when its ``pixel_values`` are not images ``[B, C, H, W]`` (SigLIP2 NaFlex's
    ``pixel_attention_mask`` and ``spatial_shapes``, Qwen-VL's ``image_grid_thw``).
    Empty (default): the family takes image tensors, and a processor's output stands for
    its ``pixel_values``. When set, ``attribute`` takes the processor's output itself,
    splits it into groups of images of one grid (:meth:`processor_images`), explains
    each group and returns the maps per image
    (:func:`captum_vit._base.attribute_processed`)."""

    def processor_images(self, batch: Mapping[str, Any]) -> list[tuple[Tensor, Tensor]]:
        """Split a processor's output into groups of images that share one grid (a family
        with :attr:`processor_keys` implements it).

        Args:
            batch (Mapping): the processor's output (``BatchFeature`` or dict).

        Returns:
            list of ``(index, images)``: ``index`` [k] (int64) the positions of the
            group's images in the batch's image order, ``images`` the images as this
            adapter takes them (``[k, C, H, W]``, unpadded, on their own grid).

        Raises:
            TypeError: the family takes image tensors (the default).
            ValueError: keys missing or inconsistent (the family's rules).
        """
        raise TypeError(f"{type(self.model).__name__} takes image tensors [B, C, H, W]; "
                        "pass the processor output's pixel_values")

    def processor_pixels(self, maps: Sequence[Tensor], batch: Mapping[str, Any]) -> Tensor:
        """Per-image pixel maps ``[1, C, H_i, W_i]`` (in the batch's image order) laid out
        as ``batch["pixel_values"]`` (``output="inputs"``, Captum's rule: shaped like
        the inputs); families with :attr:`processor_keys` implement it."""
        raise TypeError(f"{type(self.model).__name__} takes image tensors [B, C, H, W]")

    def model_outputs(self, inputs: Tensor) -> Tensor:
        """The model's own output for ``inputs``: logits [B, classes] or the image
        embedding [B, D′] (its forward, not ours).

        Raises:
            TypeError: the model has none (:attr:`no_output_reason`).
        """
        if self.no_output_reason is not None:
            raise TypeError(self.no_output_reason)
        return self.model(inputs)

    def output_extras(self, tokens: Tensor) -> dict[str, Tensor]:
        """What a target may read besides the standard
        :class:`~captum_vit.adapters.scoring.Outputs`, computed from the final-normed
        ``tokens`` [n, N, D] (YOLOS: per-detection class logits and boxes). Default none."""
        return {}

    def self_check_outputs(self, inputs: Tensor) -> dict[str, tuple[Any, Tensor]]:
        """What :meth:`self_check` compares on ``inputs`` (two images, no gradient, full
        precision): ``{what: (the model's own, the canonical forward's)}``. Default the
        logits (:meth:`model_logits` against :meth:`run` of :meth:`embed`); a detector
        compares its detections' class logits and boxes."""
        return {"logit": (self.model_logits(inputs), self.run(self.embed(inputs)))}

    # -- the engine -----------------------------------------------------------------------
    def model_logits(self, inputs: Tensor) -> Tensor:
        """:meth:`model_outputs`, scored against the target embeddings inside
        :meth:`targeting`."""
        target = self.state.settings.target
        if isinstance(target, Target):  # the target reads what only our forward has
            return self.run(self.embed(inputs))
        out = self.model_outputs(inputs)
        return out if target is None else target.scores(out)

    @property
    def stages(self) -> Stages:
        """The token geometry of the blocks (:class:`~captum_vit.adapters.stages.Stages`:
        windows, merges, carrying per-token values onto the maps' grid, token-mixing
        matrices); the identity geometry for a model without windows and merges."""
        return Stages(self)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the model's parameters (inputs must have it)."""
        return self.blocks[0].k_weight.dtype

    # -- canonical forward ----------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """``L``; inside :meth:`targeting` with a target reading block outputs, the last
        block it reads (the blocks after it do not reach the score)."""
        layers = self.read_layers()
        return len(self.blocks) if layers is None else layers[-1]

    def block(self, x: Any, l: int, ops: Ops, record: list[BlockRecord] | None = None, *,
              attention_only: bool = False, rows: int | None = None) -> Any:
        """Block ``l`` on ``x`` (the module docstring's notation): attention sublayer then
        FFN sublayer.

        With ``attention_only`` the block stops once it has its attention (for methods
        that read nothing else of it): it returns ``None`` and its record has ``x``,
        ``u`` and ``attn`` (or ``heads``), ``None`` in the other fields. With ``rows``
        (plain-tensor ops) everything after the attention is computed for the first
        ``rows`` tokens only, so the output and the record's later fields have ``rows``
        rows: the last block under a readout of the prefix rows
        (:attr:`readout_row_count`)."""
        p = self.blocks[l]
        if self.state.settings.frozen:
            p = _detached(p)
        n = ops.value(x).shape[1]  # the block's tokens, before any ``rows`` cut
        u = x if p.norm1 is None else ops.norm(x, p.norm1)
        # query pooling (Hiera): the residual branch is the projected, max-pooled LN1(x)
        res, shares = x, None
        if p.pool is not None:
            pre = ops.linear(u, p.pool.weight, p.pool.bias)
            res = ops.maxpool(pre, p.pool)
            if record is not None:
                shares = p.pool.shares(ops.value(pre).detach())
        a, attn = ops.attention(u, p)
        heads = attn if isinstance(attn, Heads) else None
        if attention_only:
            if record is not None:
                # an attention-only record has None after attn (BlockRecord's docstring)
                record.append(BlockRecord(
                    ops.value(x), ops.value(u), None if heads is not None else attn,
                    None, None, None, None, heads, shares))  # type: ignore[arg-type]
            return None
        if rows is not None:  # only these rows reach the readout
            a, x, res = a[:, :rows], x[:, :rows], res[:, :rows]
        if p.inner_norm is not None:  # N_in (EVA-02's scale_attn_inner)
            a = ops.norm(a, p.inner_norm)
        a = ops.linear(a, p.proj_weight, p.proj_bias)
        if p.ls1 is not None:
            a = ops.scale(a, p.ls1)
        if p.post_norm1 is not None:  # a norm on the branch (Swin V2's res-post-norm)
            a = ops.norm(a, p.post_norm1)
        if p.fixed_rows:  # rows the sublayer leaves unchanged (TimeSformer's temporal CLS)
            xv = ops.value(x)
            keep = xv.new_ones(xv.shape[1], 1)
            keep[:p.fixed_rows] = 0
            a = ops.scale(a, keep)
        mid = ops.add(res, a)
        u2 = mid if p.norm2 is None else ops.norm(mid, p.norm2)
        h = ops.linear(u2, p.fc1_weight, p.fc1_bias)
        if p.gate_weight is None:
            h = ops.act(h, p.act)
        else:
            h = ops.gated(ops.linear(u2, p.gate_weight, p.gate_bias), h, p.act)
        if p.mlp_norm is not None:
            h = ops.norm(h, p.mlp_norm)
        f = ops.linear(h, p.fc2_weight, p.fc2_bias)
        if p.ls2 is not None:
            f = ops.scale(f, p.ls2)
        if p.post_norm2 is not None:
            f = ops.norm(f, p.post_norm2)
        out = ops.add(mid, f)
        if p.out_norm is not None:  # a norm between blocks (V-JEPA 2's encoder norm)
            out = ops.norm(out, p.out_norm)
        if p.merge is not None:  # the last block of a stage: merge onto the next grid
            m = p.merge
            if m.norm_last:  # Swin V2: reduce, then norm
                out = ops.norm(ops.linear(ops.gather(out, m), m.weight, m.bias), m.norm)
            else:
                out = ops.linear(ops.norm(ops.gather(out, m), m.norm), m.weight, m.bias)
        if p.post_add is not None:  # a constant on the residual stream (YOLOS's mid PE)
            c = p.post_add(ops.positions, n)
            out = ops.add_constant(out, c[:, :ops.value(out).shape[1]])
        hidden = self.state.settings.hidden
        if hidden is not None and l + 1 in hidden:  # a target reading several blocks
            hidden[l + 1] = out
        if record is not None:
            v = ops.value
            record.append(BlockRecord(v(x), v(u), None if heads is not None else attn, v(a),
                                      v(mid), v(f), v(out), heads, shares))
        return out

    def small_attention(self, inputs: Tensor, *, inclusive: bool = True) -> bool:
        """Whether every block's attention on ``inputs`` is small
        (:func:`~captum_vit.adapters.parts.small_attention`: keys per query, the window's
        area for a windowed block, at most four times the head width): a method that
        needs every block's probabilities and their gradients then traces the explicit
        attention, which keeps them for the backward, rather than the fused kernel, whose
        backward recomputes them (faster on the CPU for little memory).

        Args:
            inputs (Tensor): the images (their layout gives the token count).
            inclusive (bool, optional): whether an attention at the bound counts as small
                (:func:`~captum_vit.adapters.parts.small_attention`). Default True.

        Returns:
            bool
        """
        n = self.layout(inputs).num_tokens
        return all(small_attention(n if p.window is None else p.window.area, p.head_dim,
                                   inclusive=inclusive)
                   for p in self.blocks)

    def run(self, x: Tensor, start: int = 0, stop: int | None = None,
            keep: Tensor | None = None, *, ops: Ops | None = None) -> Tensor:
        """Run blocks ``start..stop-1`` on token states ``x`` (and the head if ``stop == L``).

        Args:
            x (Tensor): token states ``x_start`` of shape [B, N, D].
            start (int): first block to run.
            stop (int, optional): one past the last block; ``None`` = L, which also
                applies the final norm and head and returns logits.
            keep (Tensor, optional): patch indices [B, n] (or a bool mask [B, P] with the
                same count per row) of the patch tokens to keep; prefix tokens are always
                kept. This is true token removal (SkipPLUS, Mehri et al., CVPRW 2024,
                §4.1).
            ops (Ops, optional): primitive operations (default: plain forward).

        Returns:
            Logits [B, classes] when ``stop == L``, else the token states ``x_stop``.
        """
        L = self.num_blocks
        stop = L if stop is None else stop
        if not 0 <= start <= stop <= L:
            raise ValueError(f"need 0 <= start <= stop <= {L}, got start={start}, stop={stop}")
        self.refresh()
        ops = ops or Ops()
        if keep is not None:
            x, positions = self.select_tokens(x, keep, with_positions=True)
            if ops.positions is None:  # the kept tokens keep their own positions
                ops = copy.copy(ops)
                ops.positions = positions
        # the logits read the prefix rows only (class-token readouts): the last block's
        # output is computed for those rows (plain-tensor forwards; rule sets keep all rows)
        plain = (type(ops) is Ops or isinstance(ops, FusedOps)) and not ops.linearize
        rows = self.readout_row_count if stop == L and plain else None
        for l in range(start, stop):
            x = self.block(x, l, ops, rows=rows if l == L - 1 else None)
        return self.logits(x, ops) if stop == L else x

    def check_token_removal(self) -> None:
        """Refuse true token removal on a model with windowed attention (the window
        partition needs every token of its grid) and under a target that reads token rows:
        removing tokens changes the rows it reads (:mod:`captum_vit.targets`). Removal
        keeps every prefix row, so a target reading only prefix rows of the last state
        (``Target.prefix_rows_only``: a detector's detection rows) allows it.

        Raises:
            ValueError: naming the model or the target and the pixel removal that serves
                it.
        """
        if self.stages.has_windows:
            raise ValueError(
                f"{type(self.model).__name__} attends within windows of a fixed token grid, "
                "and true token removal (TIS's token subsets, the metrics' removal='token') "
                "breaks the window partition: remove pixels instead (the metrics: "
                "removal='mean', 'black' or 'blur'; instead of TIS: RISE or ViT-CX, which "
                "mask pixels)")
        target = self.score_target
        if target is not None and target.blocks is None and target.prefix_rows_only:
            return
        if target is not None and (target.reads_tokens or target.blocks is not None):
            raise ValueError(
                f"{type(target).__name__} reads token rows, and true token removal changes "
                "the rows it reads: remove pixels instead (the metrics: removal='mean', "
                "'black' or 'blur'; TIS: use RISE or ViT-CX, which mask pixels)")

    def select_tokens(self, x: Tensor, keep: Tensor, *, with_positions: bool = False
                      ) -> Tensor | tuple[Tensor, Tensor]:
        """Prefix tokens plus the kept patch tokens of ``x`` [B, N, D] (and, with
        ``with_positions``, their original token indices [B, n])."""
        self.check_token_removal()
        k = self.num_prefix
        b, n, d = x.shape
        if keep.dtype == torch.bool:
            if keep.shape != (b, n - k):
                raise ValueError(f"keep mask must have shape {(b, n - k)}, got {tuple(keep.shape)}")
            counts = keep.sum(1)
            if (counts != counts[0]).any():
                raise ValueError("keep mask must keep the same number of patches in every row")
            keep = keep.nonzero()[:, 1].reshape(b, -1)
        if keep.dim() != 2 or keep.shape[0] != b:
            raise ValueError(f"keep must be [B, n] patch indices with B={b}, "
                             f"got {tuple(keep.shape)}")
        keep = keep.to(x.device)
        patches = torch.gather(x[:, k:], 1, keep[..., None].expand(-1, -1, d))
        out = torch.cat([x[:, :k], patches], dim=1)
        if not with_positions:
            return out
        prefix = torch.arange(k, device=x.device).expand(b, k)
        return out, torch.cat([prefix, k + keep], dim=1)

    def trace(self, inputs: Tensor | None = None, *, x: Tensor | None = None,
              options: TraceOptions | None = None, **kwargs: Any) -> Trace:
        r"""One forward pass recording every block (:class:`BlockRecord`).

        With ``grad`` the blocks and the head run on detached views of the model's
        parameters: gradients reach the token states and every recorded tensor (the
        embedding keeps its own graph, so the inputs can require grad), never the
        parameters, and autograd keeps no activation alive for a weight gradient.

        Args:
            inputs (Tensor, optional): images [B, C, H, W]; embedded first.
            x (Tensor, optional): token states of block ``options.start`` instead of
                images.
            options (TraceOptions, optional): how the pass runs
                (:class:`~captum_vit.adapters.trace.TraceOptions`); default the plain
                explicit forward.
            **kwargs: fields of :class:`~captum_vit.adapters.trace.TraceOptions`
                (``start``, ``linearize``, ``grad``, ``cut_blocks``, ``ops``,
                ``attention``, ``on_block``, ``logits``, ``last_rows``), replacing those
                of ``options``.

        Returns:
            :class:`Trace`.

        Raises:
            ValueError: options that do not go together (see
                :class:`~captum_vit.adapters.trace.TraceOptions`).

        Examples::

            >>> means = []   # head-mean attention per block, [B, N, N] each
            >>> tr = adapter.trace(images, on_block=lambda l, rec: means.append(
            ...     rec.attn.mean(1)))
            >>> tr = adapter.trace(images, options=TraceOptions(grad=True))
        """
        if options is None:
            options = TraceOptions(**kwargs)
        elif kwargs:
            options = dataclasses.replace(options, **kwargs)
        self.refresh()
        with self.state.override(frozen=options.grad):
            return self._trace(inputs, x, options)

    def _trace(self, inputs: Tensor | None, x: Tensor | None, o: TraceOptions) -> Trace:
        ops = HeadsOps(o.linearize) if o.attention == "fused" else o.ops
        start, grad = o.start, o.grad
        with torch.set_grad_enabled(grad):
            if x is None:
                assert inputs is not None
                layout = self.target_layout(self.layout(inputs))
                x = self.embed(inputs)
            else:
                layout = self.target_layout(self._layout_of_tokens(x, inputs))
            if grad and not x.requires_grad:
                x = x.detach().requires_grad_()
            tr = Trace(layout=layout, x0=x, start=start)
            ops = Ops(linearize=o.linearize) if ops is None else ops
            h = x
            for l in range(start, self.num_blocks):
                if o.cut_blocks and l > start:
                    h = h.detach().requires_grad_(grad)
                records = tr.blocks if o.on_block is None else []
                last = l == self.num_blocks - 1
                h = self.block(h, l, ops, records, attention_only=not o.logits and last,
                               rows=o.last_rows if last else None)
                if o.on_block is not None:
                    o.on_block(l, records.pop())
            if o.logits:
                tr.logits = self.logits(h, ops, tr)
            tr.final_tokens = self.stages.final_tokens  # windows: the readout's grid
        return tr

    def _layout_of_tokens(self, x: Tensor, inputs: Tensor | None) -> Layout:
        if inputs is not None:
            return self.layout(inputs)
        return Layout.of_tokens(x.shape[1], self.num_prefix, self.readout, self.num_blocks,
                                self.blocks[0].num_heads)

    # -- safety ---------------------------------------------------------------------------
    def self_check(self, inputs: Tensor) -> None:
        """Compare the canonical forward with the model's own (:meth:`self_check_outputs`:
        by default ``model(inputs)``) once per model and dtype/device/input size
        (remembered by the adapter's :class:`AdapterState`, so by every view of the model,
        and kept by :func:`captum_vit.adapters.adapt`'s one adapter per model)."""
        key = (type(self), inputs.dtype, inputs.device, tuple(inputs.shape[1:]))
        checked = self.state.checked
        if key in checked:
            return
        # full precision even under an enclosing autocast (--autocast bf16 builds the
        # randomisation metric's model copies inside it)
        with torch.no_grad(), torch.autocast(inputs.device.type, enabled=False):
            pairs = self.self_check_outputs(inputs[:2])
        tol = {torch.float64: 1e-9, torch.float32: 1e-4}.get(inputs.dtype, 1e-2)
        for what, (ref, ours) in pairs.items():
            if not isinstance(ref, Tensor) or ref.shape != ours.shape:
                raise TypeError(
                    f"{type(self.model).__name__} returned {type(ref).__name__} of an "
                    "unexpected shape; captum_vit needs a classifier returning logits "
                    "[B, classes]")
            err = (ref - ours).abs().max().item()
            if not err <= tol * (ref.abs().max().item() + 1.0):
                raise TypeError(
                    f"captum_vit's {type(self).__name__} does not reproduce this "
                    f"{type(self.model).__name__} (max {what} difference {err:.3g}): the "
                    "model has a component the adapter does not know (custom block, "
                    "attention or head). Supported: standard pre-LN ViT blocks as in timm's "
                    "VisionTransformer.")
        checked.add(key)


