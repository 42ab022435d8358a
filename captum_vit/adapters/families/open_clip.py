"""Adapter for OpenCLIP's image tower (``open_clip_torch``, extra ``openclip``): the
``VisionTransformer`` of ``open_clip.transformer`` on its own (``model.visual``) or inside
a model with a text side (``open_clip.CLIP``, ``CustomTextCLIP``, ``CoCa``), whose image
side (``encode_image(images, normalize=False)``) is explained; the text side is the
user's, to make target vectors (:func:`captum_vit.targets.clip_text_target`).

Only this file knows OpenCLIP's attribute names. What the installed ``open_clip``
(``transformer.py``, ``VisionTransformer.forward``) computes, and how it maps here:

- **Embedding** (``_embeds``): ``conv1`` (a patch convolution without bias), the
  ``class_embedding`` row first, plus ``positional_embedding`` (learned or the fixed 2-D
  sine-cosine table, ``pos_embed_type``; its size is fixed by ``image_size`` and never
  interpolated, so the input size is fixed), ``patch_dropout`` (identity in eval mode),
  then ``ln_pre`` (``nn.Identity`` with ``no_ln_pre``), a pre-norm like timm's
  ``norm_pre``.
- **Blocks** (``transformer.resblocks``, ``ResidualAttentionBlock``): ``x + ls_1(attn(
  ln_1(x)))`` then ``+ ls_2(mlp(ln_2(x)))``; ``attn`` is ``nn.MultiheadAttention`` with
  the packed ``in_proj_weight`` (rows ``[q; k; v]``) and ``out_proj``, called with
  ``need_weights=False`` and no attention mask (PyTorch's fused inference path in eval
  mode without gradients only changes the model's output by rounding); ``ls_1``/``ls_2``
  are LayerScale (``ls_init_value``) or identities; ``mlp`` is ``c_fc``, GELU or
  QuickGELU (``quick_gelu=True``, OpenAI's weights), ``c_proj``. The q/k/v parts are
  views of ``in_proj_weight``.
- **Pooling** (``_pool``): ``pool_type='tok'`` reads the class token, ``'avg'`` the mean
  of the patch rows; ``ln_post`` on every token before pooling, or, with
  ``final_ln_after_pool``, on the pooled vector (here the head's ``fc_norm``). The
  embedding is ``pooled @ proj`` (a bias-free ``[width, output_dim]`` matrix, read as the
  head's weight ``projᵀ``); a tower whose ``proj`` was pruned (``None``) outputs the
  pooled vector. With ``output_tokens`` the tower also returns its tokens; the embedding
  (its first output) is what is explained.

- **Attention pool** (CoCa's ``attn_pool``, an ``AttentionalPooler``; OpenCLIP's original
  CoCa setup, ``attentional_pool=True``): ``ln_k`` on every token (no ``ln_post`` before
  it), then ``nn.MultiheadAttention`` from the learned queries, normed by ``ln_q``, over
  all tokens (class token included; ``kdim = width``, so separate q/k/v projections when
  the width differs from ``output_dim``), then ``ln_post`` on the pooled queries, the
  first query's row (``pool_type='tok'``) and ``proj``: the package's attention-pool head
  (:class:`~captum_vit.adapters.parts.PoolParts`, no MLP) with ``ln_k`` as the final norm,
  the queries' ``ln_q(query)`` as its latent (recomputed from the parameters at every
  entry point, since ``ln_q`` comes before the projection) and ``ln_post`` as the head's
  ``fc_norm``.

Refused by name (``TypeError``): the ``'parallel'`` / ``'cascade'`` attention pools (a
second, contrastive pooler), an attention pool with ``pool_type='avg'`` (a mean over
pooled queries), ``pool_type='none'`` (no single embedding), the custom blocks
(``CustomResidualAttentionBlock``: ``qk_norm``, ``scaled_cosine_attn``, ``scale_heads``,
``scale_attn_inner``, ``scale_attn``, ``scale_fc``), and towers that are no Vision
Transformer of OpenCLIP's own (``ModifiedResNet``, a ``TimmModel`` trunk).
``LayerNormFp32`` norms compute in float32 whatever the input's dtype; the adapter's
norms compute in the input's dtype (the same in float32).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from torch import Tensor, nn

from captum_vit.adapters._typing import ModelTree
from captum_vit.adapters.base import ViTAdapter
from captum_vit.adapters.catalog import Example, register_family
from captum_vit.adapters.families._examples import library, randomize_
from captum_vit.adapters.families._torch import multihead_attention_fields
from captum_vit.adapters.layout import Layout
from captum_vit.adapters.ops import Ops, patch_projection
from captum_vit.adapters.parts import BlockParts, HeadParts, PoolParts
from captum_vit.adapters.parts import layer_norm_parts as _norm
from captum_vit.adapters.parts import linear_module as _linear
from captum_vit.adapters.text import TextTower

CUSTOM_BLOCK_OPTIONS = ("qk_norm", "scaled_cosine_attn", "scale_heads", "scale_attn_inner",
                        "scale_attn", "scale_fc")
"""OpenCLIP options that build ``CustomResidualAttentionBlock`` towers (refused)."""


def _layer_scale(m: ModelTree, where: str) -> Tensor | None:
    if isinstance(m, nn.Identity):
        return None
    gamma = getattr(m, "gamma", None)
    if not isinstance(gamma, Tensor):
        raise TypeError(f"{where} is {type(m).__name__}; captum_vit supports OpenCLIP's "
                        "LayerScale (ls_init_value) or none here")
    return gamma


def _activation(m: ModelTree, where: str) -> nn.Module:
    """GELU (exact or tanh) or QuickGELU (OpenCLIP's or timm's), the module itself."""
    quick = type(m).__name__ == "QuickGELU" and type(m).__module__.startswith(
        ("open_clip.", "timm."))
    if not (isinstance(m, nn.GELU) or quick):
        raise TypeError(f"{where} is {type(m).__name__}; captum_vit supports GELU or "
                        "QuickGELU MLPs in OpenCLIP towers")
    return m


def _block_parts(blk: ModelTree, where: str) -> BlockParts:
    """The canonical parts of one ``ResidualAttentionBlock``; q/k/v are row views
    (through ``detach()``) of the packed ``in_proj_weight`` / ``in_proj_bias``."""
    if type(blk).__name__ != "ResidualAttentionBlock" or hasattr(blk, "ln_1_kv"):
        raise TypeError(f"{where} is {type(blk).__name__}; captum_vit supports OpenCLIP's "
                        "plain ResidualAttentionBlock (towers built without "
                        f"{', '.join(CUSTOM_BLOCK_OPTIONS)})")
    mlp = blk.mlp
    attention = multihead_attention_fields(blk.attn, f"{where}.attn")
    children = dict(mlp.named_children()) if isinstance(mlp, nn.Sequential) else {}
    if list(children) != ["c_fc", "gelu", "c_proj"]:
        raise TypeError(f"{where}.mlp must be OpenCLIP's (c_fc, gelu, c_proj) MLP")
    fc1 = _linear(children["c_fc"], f"{where}.mlp.c_fc")
    fc2 = _linear(children["c_proj"], f"{where}.mlp.c_proj")
    return BlockParts(
        norm1=_norm(blk.ln_1, f"{where}.ln_1"), **attention,
        ls1=_layer_scale(blk.ls_1, f"{where}.ls_1"),
        norm2=_norm(blk.ln_2, f"{where}.ln_2"),
        fc1_weight=fc1.weight, fc1_bias=fc1.bias,
        act=_activation(children["gelu"], f"{where}.mlp.gelu"),
        fc2_weight=fc2.weight, fc2_bias=fc2.bias,
        ls2=_layer_scale(blk.ls_2, f"{where}.ls_2"),
    )


def _attention_pool(pool: ModelTree, where: str) -> PoolParts:
    """The canonical parts of CoCa's ``AttentionalPooler``: the latent is ``ln_q(query)``
    (a tensor computed now, without gradient), ``k``/``v`` read the tokens (normed by
    ``ln_k``, the head's norm), no MLP."""
    mha = pool.attn
    if not (isinstance(mha, nn.MultiheadAttention) and mha.batch_first
            and mha.bias_k is None and not mha.add_zero_attn):
        raise TypeError(f"{where}.attn is not a plain batch-first nn.MultiheadAttention; "
                        "this attention pool is not supported")
    d = mha.embed_dim
    if mha._qkv_same_embed_dim:
        w = mha.in_proj_weight.detach()
        q, k, v = w[:d], w[d:2 * d], w[2 * d:]
    else:
        q, k, v = mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight
    b = mha.in_proj_bias
    qb, kb, vb = (None, None, None) if b is None else b.detach().split(d)
    with torch.no_grad():
        latent = pool.ln_q(pool.query).detach()
    head_dim = d // mha.num_heads
    identity = nn.Identity()
    return PoolParts(
        latent=latent, q_weight=q, q_bias=qb, k_weight=k, k_bias=kb, v_weight=v, v_bias=vb,
        num_heads=mha.num_heads, head_dim=head_dim, scale=head_dim ** -0.5,
        q_norm=identity, k_norm=identity,
        proj_weight=mha.out_proj.weight, proj_bias=mha.out_proj.bias,
        norm=None, fc1_weight=None, fc1_bias=None, act=None, fc2_weight=None, fc2_bias=None,
    )


def text_tower(model: ModelTree) -> TextTower:
    """The text side of an OpenCLIP model (:class:`~captum_vit.adapters.text.TextTower`):
    ``token_embedding``, ``transformer.resblocks`` (``nn.MultiheadAttention`` called as
    ``attn(x, x, x, ...)``, ``mlp.gelu``), ``ln_final`` and a linear ``text_projection``
    of ``open_clip.CLIP`` itself or of its ``text`` (``CustomTextCLIP``, ``CoCa``: a
    ``TextTransformer``); the features are ``encode_text(ids, normalize=False)``.

    Args:
        model (nn.Module): the OpenCLIP model.

    Returns:
        TextTower: ``blockers`` name the custom blocks the LRP rules do not know.

    Raises:
        TypeError: a text tower without OpenCLIP's own token embedding (a Hugging Face
            text encoder, ``HFTextEncoder``).
    """
    name = type(model).__name__
    root = model if hasattr(model, "token_embedding") else getattr(model, "text", None)
    emb = getattr(root, "token_embedding", None)
    blocks = getattr(getattr(root, "transformer", None), "resblocks", None)
    if root is None or not isinstance(emb, nn.Embedding) or blocks is None:
        kind = type(root).__name__ if root is not None else "no text tower"
        raise TypeError(f"text_relevance needs OpenCLIP's own text transformer "
                        f"(token_embedding, transformer.resblocks); {name} has {kind} (a "
                        "Hugging Face text encoder is not read)")
    attentions: list[nn.MultiheadAttention] = []
    acts: list[nn.Module] = []
    blockers: list[str] = []
    for i, blk in enumerate(blocks):
        mlp = getattr(blk, "mlp", None)
        act = getattr(mlp, "gelu", None)
        if type(blk).__name__ != "ResidualAttentionBlock" or hasattr(blk, "ln_1_kv") \
                or not isinstance(blk.attn, nn.MultiheadAttention) \
                or not isinstance(act, nn.Module):
            blockers.append(f"text block {i} ({type(blk).__name__})")
            continue
        attentions.append(blk.attn)
        acts.append(act)
    parts = [emb, root.transformer] + [m for m in (getattr(root, "ln_final", None),
                                                   getattr(root, "text_projection", None))
                                       if isinstance(m, nn.Module)]
    modules = [m for part in parts for m in part.modules()]

    def features(inputs: Mapping[str, Tensor]) -> Tensor:
        return cast(Tensor, model.encode_text(inputs["input_ids"], normalize=False))

    return TextTower(embedding=emb, features=features,
                     norms=[m for m in modules if isinstance(m, nn.LayerNorm)], acts=acts,
                     attentions=attentions,
                     linears=[m for m in modules if isinstance(m, nn.Linear)],
                     blockers=tuple(blockers))


def _vision_transformer_class() -> Any:  # open_clip.transformer.VisionTransformer, or None
    module = sys.modules.get("open_clip.transformer")
    return None if module is None else module.VisionTransformer


def is_open_clip(model: nn.Module) -> bool:
    """``True`` for OpenCLIP's ``VisionTransformer`` and for OpenCLIP models with an image
    tower (``visual``; :class:`OpenCLIPAdapter` refuses towers it cannot explain by name);
    ``open_clip`` is never imported for other models.

    Args:
        model (nn.Module): any model.

    Returns:
        bool: whether :class:`OpenCLIPAdapter` applies.
    """
    if not type(model).__module__.startswith("open_clip."):
        return False
    vt = _vision_transformer_class()
    if vt is not None and isinstance(model, vt):
        return True
    return isinstance(getattr(model, "visual", None), nn.Module) \
        and hasattr(model, "encode_image")


def _example(*, dual: bool = False, quick_gelu: bool = False,
             **extra: Any) -> Callable[..., nn.Module]:
    """A builder of a small OpenCLIP model (32x32 inputs, patch 8, width 32, 4 heads,
    embedding 16 unless ``extra`` says, a one-block text tower with OpenCLIP's own
    vocabulary size): the dual ``open_clip.CLIP`` (``dual``) or its ``visual`` tower.
    ``extra`` and build-time ``overrides`` go to the vision config (``embed_dim`` to the
    model); ``num_classes`` is not used (an embedding model)."""
    def build(*, seed: int = 0, depth: int = 3, dtype: torch.dtype = torch.float64,
              num_classes: int = 5, **overrides: Any) -> nn.Module:
        open_clip = library("open_clip")
        vision: dict[str, Any] = dict(image_size=32, patch_size=8, width=32, head_width=8,
                                      layers=depth, mlp_ratio=2.0, embed_dim=16)
        vision.update(extra)
        vision.update(overrides)
        embed_dim = vision.pop("embed_dim")
        text = dict(context_length=8, vocab_size=49408, width=32, heads=4, layers=1)
        torch.manual_seed(seed)
        model: Any = open_clip.CLIP(embed_dim=embed_dim, vision_cfg=vision, text_cfg=text,
                                    quick_gelu=quick_gelu)
        logit_scale = model.logit_scale.detach().clone()
        model = randomize_(model, seed)
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():  # the names randomize_ does not know
            model.logit_scale.copy_(logit_scale)  # CLIP's initial temperature, 1/0.07
            for name, p in model.named_parameters():
                if name.endswith("in_proj_weight"):  # q and k rows: sharper attention
                    p[:2 * p.shape[1]] *= 1.5
                elif (".ln" in name or "attn_pool.ln" in name) and name.endswith("weight"):
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
                elif name.startswith("visual.") and name.endswith(("class_embedding",
                                                                  "positional_embedding",
                                                                  "attn_pool.query")):
                    p.copy_(0.5 * torch.randn(p.shape, generator=g))
        model = model.to(dtype).eval()
        return cast(nn.Module, model if dual else model.visual)

    return build


@register_family(
    is_open_clip,
    supports="OpenCLIP image towers (open_clip VisionTransformer with pool_type 'tok' or "
             "'avg' or CoCa's attention pool, alone or inside open_clip.CLIP or CoCa)",
    tags=("embedding", "vlm-tower", "packed"),
    notes=("`open_clip_torch`, extra `openclip`: `open_clip.transformer.VisionTransformer` "
           "(`model.visual`) or the dual `open_clip.CLIP` / `CustomTextCLIP` / `CoCa` (its "
           "`encode_image`); `pool_type` `'tok'` or `'avg'`, `final_ln_after_pool`, CoCa's "
           "attention pool (`ln_k`, learned queries after `ln_q`, `ln_post` on the first pooled "
           "query), GELU or QuickGELU, LayerScale, with or without `ln_pre` and `proj`; fixed "
           "input size `image_size`; `--model open_clip:ARCH[:PATH]` (local weights only): ✅ "
           "with vector targets; text prompts through "
           "`captum_vit.targets.clip_text_target(model, tokenizer, texts)` (also for Hugging "
           "Face `CLIPModel` / `SiglipModel`); maps equal a timm twin's whose logit is `⟨e, t⟩` "
           "to 1e-10, every method but Chefer'21 (its α1β0 rule depends on how the head is split "
           "into linear maps; CoCa's pool against timm's `map` pool) — refused: the `'parallel'` "
           "/ `'cascade'` attention pools, `pool_type='none'`, custom blocks (`qk_norm`, "
           "`scaled_cosine_attn`, `scale_heads`, `scale_attn_inner`, `scale_attn`, `scale_fc`), "
           "ResNet and timm-trunk towers"),
    examples={
        # CLS pooling, GELU, the dual model
        "open_clip": Example(_example(dual=True), (32, 32), library="open_clip",
                             target="embedding"),
        # mean pooling, LayerScale, QuickGELU, the tower alone
        "open_clip_avg": Example(_example(quick_gelu=True, pool_type="avg",
                                          ls_init_value=0.5, final_ln_after_pool=True),
                                 (32, 32), library="open_clip", target="embedding"),
        # CoCa's attention pool (4 learned queries, ln_q/ln_k, the first query read out);
        # the pool's width is the embedding's (embed_dim 32 = width: one packed projection)
        "open_clip_coca": Example(_example(dual=True, attentional_pool=True,
                                           attn_pooler_queries=4, attn_pooler_heads=4,
                                           embed_dim=32),
                                  (32, 32), library="open_clip", target="embedding"),
    })
class OpenCLIPAdapter(ViTAdapter):
    """Canonical view of an OpenCLIP image tower (never modified).

    Its output is the image embedding (:attr:`embedding` is ``True``); explain it with a
    vector target, e.g. a text embedding from
    :func:`captum_vit.targets.clip_text_target`.

    Args:
        model (nn.Module): ``open_clip``'s ``VisionTransformer`` (``clip.visual``) or a
            model holding one (``open_clip.CLIP``, ``CustomTextCLIP``, ``CoCa``),
            explained through ``encode_image`` (un-normalised).

    Raises:
        TypeError: a contrastive attention pool (``'parallel'``, ``'cascade'``),
            ``pool_type='none'``, custom blocks, or an image tower that is not OpenCLIP's
            ``VisionTransformer``; the message names what is not supported.

    Examples::

        >>> import open_clip
        >>> from captum_vit import GAE
        >>> from captum_vit.targets import clip_text_target
        >>> model = open_clip.create_model("ViT-B-32", pretrained=None).eval()
        >>> target = clip_text_target(model, open_clip.get_tokenizer("ViT-B-32"),
        ...                           ["a dog", "a cat"], index=[0, 1])
        >>> maps = GAE(model).attribute(images, target=target)
    """

    model: ModelTree  # read by attribute names (captum_vit.adapters._typing)

    embedding = True

    def __init__(self, model: ModelTree) -> None:
        self.model = model
        name = type(model).__name__
        vt = _vision_transformer_class()
        visual = model if vt is not None and isinstance(model, vt) else getattr(
            model, "visual", None)
        if vt is None or not isinstance(visual, vt):
            kind = type(visual).__name__
            raise TypeError(f"{name}.visual is {kind}; captum_vit explains OpenCLIP image "
                            "towers that are OpenCLIP's VisionTransformer (not a ResNet or "
                            "a timm trunk; a timm ViT trunk can be explained as a timm "
                            "model)")
        self.visual = visual
        where = name if visual is model else f"{name}.visual"
        pooled = getattr(visual, "attn_pool", None) is not None
        if pooled and (getattr(visual, "attn_pool_contrastive", None) is not None
                       or visual.pool_type != "tok"):
            raise TypeError(
                f"{where} has the attention pool attentional_pool="
                f"{getattr(visual, 'attn_pool_type', '') or True!r} with pool_type="
                f"{visual.pool_type!r}; captum_vit supports OpenCLIP's original CoCa pool "
                "(attentional_pool=True, pool_type='tok': the first pooled query), not a "
                "second contrastive pooler nor a mean over pooled queries")
        if visual.pool_type not in ("tok", "avg"):
            raise TypeError(f"{where} has pool_type={visual.pool_type!r}: it outputs every "
                            "token, not one image embedding; captum_vit explains pool_type "
                            "'tok' (class token) or 'avg' (mean of the patch tokens)")
        if not isinstance(visual.conv1, nn.Conv2d):
            raise TypeError(f"{where}.conv1 is {type(visual.conv1).__name__}; captum_vit "
                            "needs OpenCLIP's patch convolution")
        if not list(visual.transformer.resblocks):
            raise TypeError(f"{where} has no transformer blocks")
        self._where = where
        self.num_prefix = 1
        self.in_chans = int(visual.conv1.in_channels)
        self.readout = "map" if pooled else "token" if visual.pool_type == "tok" else "avg"
        self._read_parts()

    def _read_parts(self) -> None:
        """The blocks' parts and the head, views of the tower's parameters."""
        v, where = self.visual, self._where
        self.blocks = [_block_parts(blk, f"{where}.transformer.resblocks[{i}]")
                       for i, blk in enumerate(v.transformer.resblocks)]
        self._read_head()

    def _read_head(self) -> None:
        """``ln_post`` before or after pooling (or CoCa's ``ln_k``, pool and ``ln_post``)
        and ``projᵀ``."""
        v, where = self.visual, self._where
        ln_post = _norm(v.ln_post, f"{where}.ln_post")
        proj = None if v.proj is None else v.proj.T
        if self.readout == "map":  # ln_k, the pool, ln_post on the first pooled query
            self.head = HeadParts(_norm(v.attn_pool.ln_k, f"{where}.attn_pool.ln_k"), ln_post,
                                  (("map", proj, None),),
                                  attn_pool=_attention_pool(v.attn_pool, f"{where}.attn_pool"))
            return
        after = bool(getattr(v, "final_ln_after_pool", False))
        row = 0 if self.readout == "token" else "avg"
        self.head = HeadParts(None if after else ln_post, ln_post if after else None,
                              ((row, proj, None),))

    def refresh(self) -> None:
        """Re-read the q/k/v views and the projection after the parameters were replaced
        (``model.to``); recompute CoCa's pool latent ``ln_q(query)`` every time (it is no
        view, and in-place updates must reach it)."""
        blocks = self.visual.transformer.resblocks
        if any(cast(Tensor, p.q_weight).data_ptr() != blk.attn.in_proj_weight.data_ptr()
               for p, blk in zip(self.blocks, blocks, strict=True)):
            self._read_parts()
            return
        weight, proj = self._head_parts.heads[0][1], self.visual.proj
        if self.readout == "map" or (weight is None) != (proj is None) or (
                weight is not None and weight.data_ptr() != proj.data_ptr()):
            self._read_head()

    @property
    def input_shape(self) -> tuple[int, tuple[int, int]]:
        h, w = self.visual.image_size
        return self.in_chans, (int(h), int(w))

    def parameter_stages(self) -> list[list[nn.Parameter]]:
        v = self.visual
        pool = getattr(v, "attn_pool", None)
        head = [*(pool.parameters() if pool is not None else ()), *v.ln_post.parameters(),
                *([v.proj] if v.proj is not None else [])]
        return [head, *(list(blk.parameters()) for blk in reversed(v.transformer.resblocks))]

    def check_inputs(self, inputs: Tensor) -> None:
        super().check_inputs(inputs)
        self.check_fixed_size(inputs, self.input_shape[1], "the OpenCLIP tower")

    def is_random(self) -> bool:
        v = self.visual
        drop = getattr(v.patch_dropout, "prob", 0.0)
        return v.training and (drop > 0 or any(
            m.dropout > 0 for m in v.modules() if isinstance(m, nn.MultiheadAttention)))

    def layout(self, inputs: Tensor) -> Layout:
        self.refresh()
        h, w = inputs.shape[-2:]
        ph, pw = (int(s) for s in self.visual.patch_size)
        return Layout(num_prefix=1, grid=(int(h) // ph, int(w) // pw), patch_size=(ph, pw),
                      readout=self.readout, num_blocks=self.num_blocks,
                      num_heads=self.blocks[0].num_heads, image_size=(int(h), int(w)))

    def embed(self, inputs: Tensor, ops: Ops | None = None) -> Tensor:
        """The tower's own ``_embeds`` (``conv1``, class embedding, positional embedding,
        ``patch_dropout``, ``ln_pre``); with ``ops`` the patch convolution as
        ``ops.linear`` of the unfolded patches and ``ln_pre`` as ``ops.norm``
        (:meth:`ViTAdapter.embed`)."""
        self.refresh()
        v = self.visual
        if ops is None:
            return v._embeds(inputs)
        x = patch_projection(inputs, v.conv1, ops, f"{type(v).__name__}.conv1").flatten(1, 2)
        cls = v.class_embedding.to(x.dtype).view(1, 1, -1).expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + v.positional_embedding.to(x.dtype)
        x = v.patch_dropout(x)
        if isinstance(v.ln_pre, nn.Identity):
            return x
        return ops.norm(x, _norm(v.ln_pre, f"{type(v).__name__}.ln_pre"))

    def embedding_norms(self) -> tuple[str, ...]:
        """``ln_pre`` unless the tower was built with ``no_ln_pre``."""
        return () if isinstance(self.visual.ln_pre, nn.Identity) else ("ln_pre",)

    def model_outputs(self, inputs: Tensor) -> Tensor:
        """``encode_image`` of a dual model, else the tower's forward (its first output
        with ``output_tokens``)."""
        if self.visual is not self.model:  # CoCa's encode_image normalises by default
            out = self.model.encode_image(inputs, normalize=False)
        else:
            out = self.model(inputs)
        return out[0] if isinstance(out, tuple) else out  # output_tokens: (pooled, tokens)
